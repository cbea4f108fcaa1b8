"""Metrics: exact values on constructed errors, and invariance to a common yaw."""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial.transform import Rotation as SciRot

from ik_gat_jax import bone_frames as bf
from ik_gat_jax import kinematics, metrics, rotations, skeleton

RIG = skeleton.cmu_body()
N = 6


def _setup(seed=0):
  rng = np.random.default_rng(seed)
  off = jnp.asarray(RIG.template(), jnp.float32)
  R = SciRot.random(N * RIG.num_joints, random_state=seed).as_matrix().reshape(N, -1, 3, 3)
  R = jnp.asarray(R, jnp.float32)
  _, pos = kinematics.forward_kinematics(R, off, RIG.parents, jnp.asarray(rng.normal(size=(N, 3)),
                                                                          jnp.float32))
  B = bf.bone_frames(off, RIG)
  return R, off, B, pos


def _summary(pred, R, off, B, pos):
  return metrics.summarize(metrics.frame_errors(pred, R, off, B, pos, RIG), RIG)


def test_perfect_prediction_scores_zero():
  R, off, B, pos = _setup()
  s = _summary(R, R, off, B, pos)
  for k in metrics.ERROR_FIELDS + ('root_rot_err_deg',):
    assert s[k] < 0.05, (k, s[k])
  assert set(s['per_joint']) == set(RIG.joint_names)
  assert set(s['local_rot_err_deg_by_class']) == {'determined', 'swing', 'leaf'}


def test_known_twist_on_one_joint():
  """A pure twist of 30 degrees about the forearm bone: twist 30, swing 0, hand moves."""
  R, off, B, pos = _setup()
  j = RIG.index('LeftForeArm')
  G = kinematics.local_to_global(R, RIG.parents)
  axis_world = G[:, j] @ B[j][:, 0]  # the posed bone axis
  twist = rotations.matrix_from_axis_angle(axis_world * jnp.deg2rad(30.0))
  G_hat = G.at[:, j].set(twist @ G[:, j])
  # Keep the hand's world rotation: only the forearm is wrong in the global sense.
  G_hat = G_hat.at[:, j + 1].set(G[:, j + 1])
  pred = kinematics.global_to_local(G_hat, RIG.parents)
  e = metrics.frame_errors(pred, R, off, B, pos, RIG)
  np.testing.assert_allclose(np.degrees(e['twist'][:, j]), 30.0, atol=1e-2)
  np.testing.assert_allclose(np.degrees(e['swing'][:, j]), 0.0, atol=1e-2)
  np.testing.assert_allclose(np.degrees(e['global'][:, j]), 30.0, atol=1e-2)
  # A twist about the bone does not move the child joint of that bone.
  np.testing.assert_allclose(e['position'][:, j + 1], 0.0, atol=1e-5)
  s = metrics.summarize(e, RIG)
  np.testing.assert_allclose(s['per_joint']['LeftForeArm']['twist_err_deg'], 30.0, atol=1e-2)


def test_mpjpe_counts_colocated_joints_once():
  R, off, B, pos = _setup()
  e = {k: np.zeros((N, RIG.num_joints)) for k in ('local', 'global', 'twist', 'swing')}
  e['position'] = np.zeros((N, RIG.num_joints))
  e['position'][:, RIG.index('LowerBack')] = 1.0  # co-located with Hips: not counted
  e['position'][:, RIG.index('Head')] = 0.019
  s = metrics.summarize(e, RIG)
  np.testing.assert_allclose(s['mpjpe_mm'], 19.0 / (RIG.num_joints - 3), rtol=1e-6)


@pytest.mark.parametrize('yaw_deg', [35.0, -120.0])
def test_every_metric_invariant_to_common_yaw(yaw_deg):
  R, off, B, pos = _setup(seed=1)
  pred = jnp.asarray(SciRot.random(N * RIG.num_joints, random_state=7).as_matrix()
                     .reshape(R.shape), jnp.float32)
  base = _summary(pred, R, off, B, pos)
  Ry = rotations.axis_rotation('y', jnp.deg2rad(yaw_deg))
  yaw = lambda X: X.at[:, 0].set(Ry @ X[:, 0])
  rotated = _summary(yaw(pred), yaw(R), off, B, pos @ Ry.T)
  for k in metrics.ERROR_FIELDS + ('root_rot_err_deg',):
    np.testing.assert_allclose(rotated[k], base[k], rtol=1e-4, atol=1e-3, err_msg=k)


def test_batched_matches_direct_and_groups():
  R, off, B, pos = _setup(seed=2)
  pred = R.at[:, 3].set(jnp.eye(3))
  offs, Bs = np.broadcast_to(off, (N,) + off.shape), np.broadcast_to(B, (N,) + B.shape)
  direct = metrics.frame_errors(pred, R, off, B, pos, RIG)
  chunked = metrics.compute_errors_batched(np.asarray(pred), np.asarray(R), offs, Bs,
                                           np.asarray(pos), RIG, batch_size=4)
  for k in direct:
    np.testing.assert_allclose(chunked[k], direct[k], atol=1e-5)
  groups = metrics.summarize_by(chunked, np.array([0, 0, 1, 1, 1, 0]), ['a', 'b'], RIG)
  assert set(groups) == {'a', 'b'} and groups['a']['frames'] == 3
