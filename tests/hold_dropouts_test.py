"""experiments/hold_dropouts.py: tracker dropouts held, the fill before session 43 against
`solver.hold_missing_joints`."""

import numpy as np
import pytest

from experiments import hold_dropouts
from ik_gat_jax import data, skeleton
from ik_gat_jax.solver import IKSolver, hold_missing_joints


def test_the_patterns_and_the_old_fill():
  rig = skeleton.cmu_body()
  rng = np.random.default_rng(0)
  pos = rng.normal(size=(360, rig.num_joints, 3))
  for pattern, joints, share in (('root', [0], 1 / 3), ('hand', [9], 1 / 4),
                                 ('every_joint', list(range(rig.num_joints)), 0.1)):
    missing = hold_dropouts.dropouts(360, rig.num_joints, 30.0, pattern, 9, rng)
    assert not missing[0].any() and missing[:, joints].any()
    assert abs(missing[:, joints].mean() - share) < 0.04, (pattern, missing[:, joints].mean())
    if pattern != 'every_joint':
      assert not np.delete(missing, joints, axis=1).any()
    given = np.where(missing[..., None], np.nan, pos)
    old, new = hold_dropouts.hold_root_stays(given), hold_missing_joints(given, None, rig)[0]
    assert np.isfinite(old).all()
    if pattern == 'hand':  # the root always there: the two fills are one
      np.testing.assert_allclose(new, old, rtol=0, atol=1e-12)


def test_a_root_dropout_costs_less_now(cmu_shards):
  ds = data.load_shards(cmu_shards, 'val')
  res = hold_dropouts.run(ds, IKSolver.from_checkpoint(expected_rig=ds.rig), [0.0])[0.0]
  assert res['hand']['children'] == pytest.approx(res['hand']['root_stays'], abs=1e-6)
  assert res['root']['children'] < 0.5 * res['root']['root_stays'], res['root']
