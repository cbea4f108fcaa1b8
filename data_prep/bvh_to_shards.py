r"""BVH mocap -> memory-mappable training shards (DESIGN sections 3, 7, 9).

    python -m data_prep.bvh_to_shards --input=DIR_OR_FILE --rig=NAME|auto|JOINT_MAP.json \
        --output=DIR [--split=auto|train|val|test|all] [--fps=30] [--units=...] [--up=y] \
        [--forward=z] [--prune=J1,J2] [--split_file=FILE] [--rig_name=NAME] [--on_error=skip] \
        [--reference_pose=zero|first_frame]

Example (the CMU data: 88 files -> 27155 frames at 30 fps, about 15 s on 2 CPU cores):

    python -m data_prep.bvh_to_shards --input=../shared/data/cmu --rig=cmu_body --output=/tmp/cmu

- `--rig=NAME` uses ik_gat_jax/io/joint_maps/NAME.json (its rig, units, axes, committed split);
  `--rig=FILE.json` a joint map of your own (schema: ik_gat_jax/io/joint_maps/schema.json);
  `--rig=auto` derives the rig from the files (needs --units) and writes it as DIR/rig.json: a
  y-up rig facing +z, the files read as `--up` (default y) and `--forward` (default z); it
  warns when the bodies extend most along another axis (files of another up: pass their axes).
- `--split=auto` puts each file where the joint map's committed split (or --split_file) says and
  refuses files it does not list; `--split=NAME` puts every input file in split NAME.
- Running again with the same --output adds the new files (same rig and fps required); files
  already there with the same sha256 are skipped, changed ones refused.
- `--units=auto` estimates metres per file unit from the first file's skeleton (its span along
  the bones, about 1.3 statures, snapped to m, cm, mm, in, ft or cmu where that makes a human of
  1.0-2.2 m), prints the evidence, and refuses when no unit does (io/units.py).
- `--reference_pose` names the source's natural pose when its zero pose is not one (game-engine
  and DCC exports bind bones along local X): `first_frame` takes frame 0 of the first file (a
  T-pose at the start, as MotionBuilder writes), `zero` the zero pose; a joint map may also list
  per-joint channel values (schema). Bone frames, swing-only IK and mirroring use it.
- Every file is verified (FK of the reduced rig vs the raw channels, limit 1e-5 m); a file that
  cannot be reduced or verified stops the run with the reason (or is skipped: --on_error=skip).
Progress per file goes to stderr; bad input exits 2 with a one-line reason (`error: ...`) and
leaves --output as it was. Layout of DIR: ik_gat_jax/data.py.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # host-side float64 work; keep accelerators free

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from data_prep import conversion  # noqa: E402
from ik_gat_jax.absl_main import fail, run_main, terminate_as_interrupt  # noqa: E402
from ik_gat_jax.errors import ConversionError  # noqa: E402
from ik_gat_jax.io import bvh  # noqa: E402

_INPUT = flags.DEFINE_string('input', None, 'A BVH file or a directory searched for *.bvh.')
_RIG = flags.DEFINE_string('rig', None, 'Joint-map name (ik_gat_jax/io/joint_maps), joint-map '
                           'JSON file, or "auto".')
_OUTPUT = flags.DEFINE_string('output', None, 'Shard directory to create or add to.')
_SPLIT = flags.DEFINE_enum('split', 'auto', ['auto', *conversion.SPLIT_NAMES],
                           'auto: the committed split; else every input file goes there.')
_FPS = flags.DEFINE_float('fps', 30.0, 'Output frame rate.')
_UNITS = flags.DEFINE_string('units', None, 'Metres per file unit (number, or m, cm, mm, inch, '
                             'cmu, or auto: estimated from the skeleton); default: the joint '
                             'map\'s.')
_UP = flags.DEFINE_string('up', None, 'Source up axis (x, y, z, -x, ...); default: joint map\'s, '
                          'y for auto.')
_FORWARD = flags.DEFINE_string('forward', None, 'Direction the source rest pose faces; default: '
                               'joint map\'s, z for auto.')
_PRUNE = flags.DEFINE_list('prune', [], 'Source joints whose subtrees are left out.')
_DROP_FIRST = flags.DEFINE_boolean('drop_first_frame', None, 'Drop frame 0 of every file '
                                   '(default: the joint map\'s; false for auto).')
_SUBJECT_REGEX = flags.DEFINE_string('subject_regex', None, 'Regex on the file name whose group '
                                     '"subject" (or 1) names the subject.')
_SPLIT_FILE = flags.DEFINE_string('split_file', None, 'Split JSON for --split=auto.')
_RIG_NAME = flags.DEFINE_string('rig_name', 'auto', 'Name of a rig derived by --rig=auto.')
_REFERENCE_POSE = flags.DEFINE_enum('reference_pose', None, ['zero', 'first_frame'],
                                    'The source\'s natural (T-)pose: its zero pose or frame 0 '
                                    'of the first file; default: the joint map\'s (zero).')
_ON_ERROR = flags.DEFINE_enum('on_error', 'fail', ['fail', 'skip'],
                              'What a refused file does to the run.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  missing = [f'--{f.name}' for f in (_INPUT, _RIG, _OUTPUT) if not f.value]
  if missing:
    fail(f'{", ".join(missing)} required')
  summary_json = Path(_OUTPUT.value) / 'summary.json'
  try:
    runs_before = len(json.loads(summary_json.read_text()).get('runs', []))
  except (OSError, ValueError):
    runs_before = 0
  try:
    with terminate_as_interrupt():
      summary = conversion.convert(
          _INPUT.value, _RIG.value, _OUTPUT.value, split=_SPLIT.value, fps=_FPS.value,
          units=_UNITS.value, up=_UP.value, forward=_FORWARD.value, prune=_PRUNE.value,
          drop_first_frame=_DROP_FIRST.value, subject_regex=_SUBJECT_REGEX.value,
          split_file=_SPLIT_FILE.value, rig_name=_RIG_NAME.value, on_error=_ON_ERROR.value,
          reference_pose=_REFERENCE_POSE.value)
  except (ConversionError, bvh.BVHError, OSError) as e:
    fail(str(e))
  except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the new folder is removed, not swapped in
    print(f'interrupted: {_OUTPUT.value} is as it was; rerun the same command to convert',
          file=sys.stderr)
    sys.exit(130)
  runs_after = len(summary.get('runs', []))
  if runs_after and runs_before == runs_after:  # nothing new: the folder as it was
    conversion.log_stderr(f'unchanged {_OUTPUT.value}: rig {summary["rig"]}, files '
                          f'{summary["files"]}, frames {summary["frames"]} ({summary_json})')
    return
  conversion.log_stderr(
      f'wrote {_OUTPUT.value}: rig {summary["rig"]}, {summary["fps"]:g} fps, files '
      f'{summary["files"]}, frames {summary["frames"]}, FK max error '
      f'{summary["fk_max_error_m"]:.2e} m, {summary["runs"][-1]["seconds"]:.1f} s')


if __name__ == '__main__':
  run_main(main)
