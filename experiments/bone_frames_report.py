"""Per-subject bone frames against the rig template, and a PNG of each rest pose with its frames.

  python -m experiments.bone_frames_report --data=/tmp/cmu --output_dir=outputs/bone_frames

Prints, per subject, the largest angle (degrees) between its rest bone frames B and the
template's over all joints (and which joint), and writes `rest_<subject>.png` per subject.
"""

from pathlib import Path

from absl import flags
import numpy as np

from experiments.common import fail_on_user_error, run_main
from ik_gat_jax import bone_frames, data, plots
from ik_gat_jax.io import atomic

_DATA = _OUT = None  # set by define_flags()


def define_flags() -> None:
  """The main's flags, defined only when it runs (tests import `subject_report` beside other
  mains that claim --data)."""
  global _DATA, _OUT
  _DATA = flags.DEFINE_string('data', None, 'Shard directory.')
  _OUT = flags.DEFINE_string('output_dir', 'outputs/bone_frames', 'Where the PNGs go.')


def frame_angles_deg(B: np.ndarray, B_ref: np.ndarray) -> np.ndarray:
  """Geodesic angle per joint between two sets of frames `[..., J, 3, 3]` -> `[..., J]`."""
  M = np.swapaxes(B_ref, -1, -2) @ B
  cos = np.clip((np.trace(M, axis1=-2, axis2=-1) - 1) / 2, -1, 1)
  return np.degrees(np.arccos(cos))


def subject_report(data_dir) -> list[dict]:
  splits = data.available_splits(data_dir)
  ds = data.load_shards(data_dir, splits[0])
  B_t = bone_frames.bone_frames_np(ds.rig.template(), ds.rig)
  rows = []
  for s, subj in enumerate(ds.subjects):
    ang = frame_angles_deg(np.asarray(ds.bone_frames[s], np.float64), B_t)
    j = int(np.argmax(ang))
    rows.append({'subject': subj['name'], 'max_angle_deg': float(ang[j]),
                 'joint': ds.rig.joint_names[j], 'mean_angle_deg': float(ang.mean())})
  return rows


@fail_on_user_error
def main(argv):
  del argv
  rows = subject_report(_DATA.value)
  out = Path(_OUT.value)
  out.mkdir(parents=True, exist_ok=True)
  ds = data.load_shards(_DATA.value, data.available_splits(_DATA.value)[0])
  print('| subject | largest angle to template (deg) | at joint | mean over joints (deg) |')
  print('|---|---:|---|---:|')
  for s, r in enumerate(rows):
    print(f"| {r['subject']} | {r['max_angle_deg']:.1f} | {r['joint']} | {r['mean_angle_deg']:.1f} |")
    plots.plot_rest_bone_frames(np.asarray(ds.offsets[s], np.float64), ds.rig,
                                out / f"rest_{r['subject']}.png",
                                title=f"subject {r['subject']}: rest pose and bone frames "
                                      '(x=bone red, y green, z blue)')
  plots.plot_rest_bone_frames(ds.rig.template(), ds.rig, out / 'rest_template.png')
  atomic.write_json(out / 'report.json', rows)
  print(f'wrote {out}/rest_*.png and report.json')


if __name__ == '__main__':
  define_flags()
  # Marked here, not at import: importing a main (tests do) must not make its flags
  # required for every other absl program in the same process.
  flags.mark_flags_as_required(['data'])
  run_main(main)
