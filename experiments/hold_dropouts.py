"""Tracker dropouts held (`hold_missing`): the error of the filled streams against the truth.

  python -m experiments.hold_dropouts --data=/tmp/cmu --split=val [--checkpoint=DIR] \
      [--noise_mm=0,10] [--output_json=FILE]

Each file of the split, as a stream from its first frame (i.i.d. Gaussian noise per coordinate,
seed 0, as `experiments.evaluate`), gets tracker dropouts of three kinds (`PATTERNS`, seed 1):
the root (pelvis) missing for 1 s of every 3 s, a hand for 0.5 s of every 2 s, and every joint
on its own for bursts of 0.25 s, about a tenth of the time each. The missing joints are filled
two ways, then solved by the plain network (`IKSolver.solve`, which is `step`'s stream frame
by frame): `root_stays` is the definition before session 43 (a missing root stays where it was
last seen; another joint keeps its offset from the root), `children` is
`solver.hold_missing_joints` (a missing root keeps its offset from its children seen with it).
The local rotation error (DESIGN section 7) is over the frames with a dropout.
"""

from __future__ import annotations

import numpy as np
from absl import flags

from experiments import common
from experiments.common import (checkpoint_noise_main, define_checkpoint_noise_flags,
                                fail_on_user_error, run_main)
from ik_gat_jax import evaluation, input_pipeline, metrics
from ik_gat_jax.solver import IKSolver, hold_missing_joints


def define_flags() -> None:
  """The flags, defined only when the main runs (tests import mains side by side)."""
  define_checkpoint_noise_flags()
  flags.adopt_module_key_flags(common)


PATTERNS = ('root', 'hand', 'every_joint')
FILLS = ('root_stays', 'children')


def dropouts(T: int, J: int, fps: float, pattern: str, hand: int,
             rng: np.random.Generator) -> np.ndarray:
  """`[T, J]` bool, True where the joint is missing; frame 0 has every joint."""
  out = np.zeros((T, J), bool)
  t = np.arange(T)
  if pattern == 'root':
    out[:, 0] = (t % round(3 * fps)) >= round(2 * fps)
  elif pattern == 'hand':
    out[:, hand] = (t % round(2 * fps)) >= round(1.5 * fps)
  else:  # bursts of 0.25 s starting on 1 frame in 2.5 s per joint: missing ~10% of the time
    n = max(1, round(0.25 * fps))
    starts = rng.random((T, J)) < 1.0 / (2.5 * fps)
    for k in range(n):
      out[k:] |= starts[:T - k]
  out[0] = False
  return out


def hold_root_stays(pos: np.ndarray) -> np.ndarray:
  """The fill before session 43, frame by frame: a missing root stays where it was last; another
  missing joint keeps its offset from the root of the frame before."""
  out, prev = np.array(pos, np.float64), None
  for t in range(len(out)):
    bad = ~np.isfinite(out[t]).all(axis=-1)
    if bad[0]:
      out[t, 0] = prev[0]
    for j in np.nonzero(bad[1:])[0] + 1:
      out[t, j] = prev[j] - prev[0] + out[t, 0]
    prev = out[t]
  return out


def run(ds, solver: IKSolver, noise_levels: list[float]) -> dict:
  """`{noise: {pattern: {fill: local error over the frames with a dropout}}}`."""
  files = []
  for f in np.unique(ds.file_id):
    rows = np.flatnonzero(np.asarray(ds.file_id) == f)
    files.append(rows[np.argsort(np.asarray(ds.frame_index)[rows], kind='stable')])
  idx = np.concatenate(files)
  batch = {k: np.asarray(v) for k, v in input_pipeline.gather_batch(ds, idx).items()}
  bounds = np.cumsum([0] + [len(rows) for rows in files])
  J = ds.rig.num_joints
  hand = ds.rig.joint_names.index('LeftHand') if 'LeftHand' in ds.rig.joint_names else J - 1
  out = {}
  for noise in noise_levels:
    noisy = evaluation.add_noise(batch['positions'], noise, 0).astype(np.float64)
    out[noise] = {}
    for pattern in PATTERNS:
      rng = np.random.default_rng(1)
      missing = np.concatenate([dropouts(b - a, J, ds.fps, pattern, hand, rng)
                                for a, b in zip(bounds[:-1], bounds[1:])])
      given = np.where(missing[..., None], np.nan, noisy)
      out[noise][pattern] = {}
      for fill in FILLS:
        pred = np.empty_like(batch['local_rot'])
        for a, b in zip(bounds[:-1], bounds[1:]):
          filled = (hold_root_stays(given[a:b]) if fill == 'root_stays'
                    else hold_missing_joints(given[a:b], None, ds.rig)[0])
          pred[a:b] = solver.solve(filled, offsets=batch['offsets'][a], progress=False)
        err = metrics.compute_errors_batched(pred, batch['local_rot'], batch['offsets'],
                                             batch['bone_frames'], batch['positions'], solver.rig)
        keep = missing.any(-1)
        out[noise][pattern][fill] = metrics.summarize({k: v[keep] for k, v in err.items()},
                                                      solver.rig)['local_rot_err_deg']
  return out


def table(results: dict) -> str:
  rows = [[f'{noise:g}', pattern] + [f'{errs[f]:.3f}' for f in FILLS]
          for noise, patterns in results.items() for pattern, errs in patterns.items()]
  return evaluation.markdown_grid(['noise (mm)', 'dropouts'] + list(FILLS), rows)


@fail_on_user_error
def main(argv):
  del argv
  checkpoint_noise_main(run, table, 'local rotation error (deg) over the frames with a dropout')


if __name__ == '__main__':
  define_flags()
  flags.mark_flags_as_required(['data'])
  run_main(main)
