"""The whole body turned: lying, on its side, upside down (`ModelConfig.body_frame`).

  python -m experiments.body_turns --data=/tmp/cmu --split=val [--checkpoint=DIR] \
      [--noise_mm=0,10,20] [--tilt_limit_deg=45] [--tilt_side_limit_deg=15] \
      [--output_json=FILE]

Every frame of the split is turned about its root by each rotation of `TURNS` (the rig's axes:
`up`, `lateral`, `forward`; 'any' is a uniformly random rotation per frame, seed 2), with
i.i.d. Gaussian noise per coordinate (seed 0, as `experiments.evaluate`) added before the turn
(the same noise in the body's frame for every turn: its law is the same in any frame), and
solved with the subject's offsets. The truth turns with it: the root's local rotation is turned,
every other joint's stays. Printed: the local rotation error (DESIGN section 7), every joint's
and the root's. A model whose canonical frame is the heading alone (every checkpoint before
session 44) sees a body on its side as nothing it was trained on; the body frame makes every
row the 'upright' row's.
"""

from __future__ import annotations

import warnings

import numpy as np
from absl import flags
from scipy.spatial.transform import Rotation

from experiments import common
from experiments.common import (checkpoint_noise_main, define_checkpoint_noise_flags,
                                fail_on_user_error, run_main)
from ik_gat_jax import evaluation, input_pipeline, metrics, model
from ik_gat_jax.solver import IKSolver

# name -> (axis, degrees); the axis names one of the rig's axes, or 'any'.
TURNS = {
    'upright': ('up', 0.0),
    'yaw 90': ('up', 90.0),
    'leaning forward 45': ('lateral', 45.0),
    'lying face down (forward 90)': ('lateral', 90.0),
    'lying face up (back 90)': ('lateral', -90.0),
    'leaning sideways 30': ('forward', 30.0),
    'on its side (sideways 90)': ('forward', 90.0),
    'upside down (180)': ('forward', 180.0),
    'any (random per frame)': ('any', 0.0),
}


def define_flags() -> None:
  """The flags, defined only when the main runs (tests import mains side by side)."""
  define_checkpoint_noise_flags()
  flags.adopt_module_key_flags(common)
  flags.DEFINE_float('tilt_limit_deg', None, 'A heading model\'s tilt limit where its config '
                     'leaves it unset, as every shipped checkpoint\'s does (default: '
                     'model.TILT_LIMIT_DEG, 45; 0 = off, the models before session 44).')
  flags.DEFINE_float('tilt_side_limit_deg', None, 'The same for a body leaning sideways '
                     '(default: model.TILT_SIDE_LIMIT_DEG, 15, or the tilt limit if smaller).')


def turn_matrices(rig, name: str, n: int) -> np.ndarray:
  """`[n, 3, 3]` world rotations of the turn `name` (`TURNS`) for n frames."""
  axis, degrees = TURNS[name]
  if axis == 'any':
    return Rotation.random(n, random_state=2).as_matrix()
  v = np.asarray(getattr(rig, axis), np.float64)
  return np.broadcast_to(Rotation.from_rotvec(np.radians(degrees) * v).as_matrix(), (n, 3, 3))


def run(ds, solver: IKSolver, noise_levels: list[float], stride: int = 1) -> dict:
  """`{noise: {turn: {'local': deg, 'root': deg}}}` over every `stride`-th frame of the
  split."""
  idx = np.arange(0, ds.num_frames, stride)
  batch = {k: np.asarray(v) for k, v in input_pipeline.gather_batch(ds, idx).items()}
  pos, local = batch['positions'].astype(np.float64), batch['local_rot']
  subject = np.asarray(ds.subject_id)[idx]
  root = pos[:, :1]
  out = {}
  for noise in noise_levels:
    out[noise] = {}
    for name in TURNS:
      W = turn_matrices(ds.rig, name, len(pos))
      turned = np.einsum('tij,tkj->tki', W, pos - root) + root
      true_local = np.array(local)
      true_local[:, 0] = W @ local[:, 0]
      noisy = evaluation.add_noise(pos.astype(np.float32), noise, 0).astype(np.float64)
      given = (np.einsum('tij,tkj->tki', W, noisy - root) + root).astype(np.float32)
      pred = np.empty_like(local)
      for k in np.unique(subject):  # one subject's offsets per call
        rows = np.flatnonzero(subject == k)
        with warnings.catch_warnings():  # the point here: a body whose up is not the rig's
          warnings.filterwarnings('ignore', message='up axis looks wrong')
          pred[rows] = solver.solve(given[rows], offsets=batch['offsets'][rows[0]],
                                    progress=False)
      err = metrics.compute_errors_batched(pred, true_local, batch['offsets'],
                                           batch['bone_frames'], turned, solver.rig)
      s = metrics.summarize(err, solver.rig)
      out[noise][name] = {'local': s['local_rot_err_deg'], 'root': s['root_rot_err_deg']}
  return out


def table(results: dict) -> str:
  rows = [[f'{noise:g}', name, f'{e["local"]:.2f}', f'{e["root"]:.2f}']
          for noise, turns in results.items() for name, e in turns.items()]
  return evaluation.markdown_grid(['noise (mm)', 'the body', 'local (deg)', 'root (deg)'], rows)


@fail_on_user_error
def main(argv):
  del argv
  limit = flags.FLAGS.tilt_limit_deg
  if limit is not None:
    if not 0.0 <= limit <= 90.0:
      raise ValueError(f'--tilt_limit_deg is an angle in [0, 90], got {limit}')
    model.TILT_LIMIT_DEG = limit  # read when the model is built (its compiled programs too)
  side = flags.FLAGS.tilt_side_limit_deg
  if side is not None:
    if not 0.0 < side <= 90.0:
      raise ValueError(f'--tilt_side_limit_deg is an angle in (0, 90], got {side}')
    model.TILT_SIDE_LIMIT_DEG = side
  checkpoint_noise_main(run, table, 'local rotation error (deg), every frame turned about its '
                        'root')


if __name__ == '__main__':
  define_flags()
  flags.mark_flags_as_required(['data'])
  run_main(main)
