"""experiments/body_turns.py: the whole body turned (lying, on its side, upside down), and the
shipped model's tilt limits (`ModelConfig.tilt_limit_deg`, `tilt_side_limit_deg`)."""

import numpy as np

from experiments import body_turns
from ik_gat_jax import data, skeleton
from ik_gat_jax.solver import IKSolver


def test_the_turns_are_rotations_about_the_rig_s_axes():
  rig = skeleton.cmu_body()
  for name, (axis, degrees) in body_turns.TURNS.items():
    W = body_turns.turn_matrices(rig, name, 5)
    np.testing.assert_allclose(np.swapaxes(W, -1, -2) @ W, np.broadcast_to(np.eye(3), W.shape),
                               atol=1e-12)
    if axis != 'any':
      np.testing.assert_allclose(W @ np.asarray(getattr(rig, axis)), np.broadcast_to(
          getattr(rig, axis), (5, 3)), atol=1e-12)
      cos = (np.trace(W[0]) - 1) / 2
      assert np.isclose(np.degrees(np.arccos(np.clip(cos, -1, 1))), abs(degrees), atol=1e-6)


def test_the_shipped_model_solves_a_body_lying_or_upside_down(cmu_shards):
  """With its tilt limits (45 deg forward or back, 15 sideways, the tilt reflected past them)
  the shipped base reads every turn within 2x its upright error (measured on these val frames:
  at most 1.46x, leaning forward 45) and a body lying or upside down, stood up, within 1.3x
  (measured 1.10-1.13x). Session 44's limit (turned back to 45 deg) read 2.7x on its side;
  without a limit (every model before session 44) a body on its side read 9x and one upside
  down 12x on all val frames (BENCHMARKS.md "The whole body turned"). A turn about up changes
  nothing (the heading)."""
  ds = data.load_shards(cmu_shards, 'val')
  res = body_turns.run(ds, IKSolver.from_checkpoint(expected_rig=ds.rig), [0.0], stride=4)[0.0]
  up = res['upright']
  assert abs(res['yaw 90']['local'] - up['local']) < 1e-3, res
  for name, e in res.items():
    assert e['local'] < 2.0 * up['local'], (name, e, up)
  for name in ('lying face down (forward 90)', 'lying face up (back 90)',
               'on its side (sideways 90)', 'upside down (180)'):
    assert res[name]['local'] < 1.3 * up['local'], (name, res[name], up)
