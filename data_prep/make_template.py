r"""Regenerates a built-in BVH rig's JSON from its subjects: `ik_gat_jax/rigs/cmu_body.json`.

    python -m data_prep.make_template --rig=cmu_body [--input=../shared/data/cmu]

The rig's template rest offsets are the mean over its subjects of each subject's reduced rest
offsets (metres, rounded to 1e-6 m), one file per subject (all files of a CMU subject share their
OFFSETs; this is checked). Designated children, reference axes and the mirror map then follow
from `skeleton.make_rig` (DESIGN sections 3 and 4), y up, facing +z. Running it on the committed
data reproduces the committed JSON byte for byte (`git diff` stays empty).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
from absl import flags

from data_prep import conversion
from ik_gat_jax import skeleton
from ik_gat_jax.absl_main import fail, run_main
from ik_gat_jax.errors import ConversionError
from ik_gat_jax.io import atomic
from ik_gat_jax.io import bvh
from ik_gat_jax.io import retarget

# Rig name -> (joint names, parents): the topology is fixed in code, the template is data.
TOPOLOGIES = {'cmu_body': (skeleton.CMU_BODY_JOINTS, skeleton.CMU_BODY_PARENTS)}

def subject_offsets(input_dir: str | os.PathLike, rig: str) -> dict[str, np.ndarray]:
  """Subject -> `[J, 3]` reduced rest offsets (metres), checked equal over the subject's files."""
  jmap = retarget.load_joint_map(rig)
  names, parents = TOPOLOGIES[rig]
  W = retarget.world_rotation(jmap.up, jmap.forward, (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))
  out: dict[str, np.ndarray] = {}
  for file, path in conversion.find_bvh_files(input_dir):
    motion, _ = retarget.read_motion(path, jmap.drop_first_frame)
    motion = dataclasses.replace(motion, motion=motion.motion[:1])  # offsets need one frame
    plan = retarget.plan_reduction(motion.names, motion.parents, jmap, names, parents)
    offsets = retarget.reduce_motion(motion, plan, jmap.units, W).offsets
    subject = conversion.subject_of(file, jmap.subject_regex)
    if subject in out and np.abs(out[subject] - offsets).max() > conversion.SUBJECT_TOL_M:
      raise ValueError(f'{file}: rest offsets differ from subject {subject}\'s other files')
    out.setdefault(subject, offsets)
  return out


def make_template_rig(input_dir: str | os.PathLike, rig: str) -> skeleton.Rig:
  offsets = subject_offsets(input_dir, rig)
  template = np.round(np.mean(np.stack(list(offsets.values())), axis=0), 6)
  names, parents = TOPOLOGIES[rig]
  return skeleton.make_rig(rig, names, parents, template, up=(0.0, 1.0, 0.0),
                           forward=(0.0, 0.0, 1.0))


def rig_json_text(rig: skeleton.Rig) -> str:
  return json.dumps(rig.to_json(), indent=1)


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  try:
    rig = make_template_rig(FLAGS.input, FLAGS.rig)
  except (ConversionError, bvh.BVHError, OSError) as e:
    fail(str(e))
  path = Path(FLAGS.output or skeleton.RIG_DIR / f'{FLAGS.rig}.json')
  atomic.write_text(path, rig_json_text(rig))
  print(f'wrote {path} (fingerprint {rig.fingerprint()})')


if __name__ == '__main__':
  # Flags live here, not at import: tests import this module's functions beside other mains.
  flags.DEFINE_enum('rig', 'cmu_body', sorted(TOPOLOGIES), 'Built-in rig to regenerate.')
  flags.DEFINE_string('input', str(Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'cmu'),
                      "Directory of the rig's BVH files.")
  flags.DEFINE_string('output', None, 'Rig JSON to write (default: the built-in one).')
  run_main(main)
