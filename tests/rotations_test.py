"""Rotations against scipy, round trips, and gradients at the singular points."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial.transform import Rotation as SciRot

from ik_gat_jax import rotations as rot

RNG = np.random.default_rng(0)
R_RAND = SciRot.random(64, random_state=1)
MATS = R_RAND.as_matrix()


def test_sixd_round_trip():
  back = rot.matrix_from_sixd(rot.sixd_from_matrix(jnp.asarray(MATS)))
  np.testing.assert_allclose(back, MATS, atol=1e-5)


def test_sixd_gram_schmidt_of_noisy_columns_is_a_rotation():
  x = RNG.normal(size=(32, 6))
  R = np.asarray(rot.matrix_from_sixd(jnp.asarray(x)))
  np.testing.assert_allclose(R.transpose(0, 2, 1) @ R, np.broadcast_to(np.eye(3), R.shape),
                             atol=1e-5)
  np.testing.assert_allclose(np.linalg.det(R), 1.0, atol=1e-5)
  # First column is the normalised first input vector.
  np.testing.assert_allclose(R[:, :, 0], x[:, :3] / np.linalg.norm(x[:, :3], axis=1, keepdims=True),
                             atol=1e-5)


def test_quaternion_matches_scipy_and_round_trips():
  q_sci = R_RAND.as_quat()  # x, y, z, w
  q_wxyz = np.concatenate([q_sci[:, 3:], q_sci[:, :3]], axis=1)
  q_wxyz *= np.where(q_wxyz[:, :1] < 0, -1, 1)
  np.testing.assert_allclose(rot.matrix_from_quat(jnp.asarray(q_wxyz)), MATS, atol=1e-5)
  np.testing.assert_allclose(rot.quat_from_matrix(jnp.asarray(MATS)), q_wxyz, atol=1e-5)


def test_quat_from_matrix_near_pi():
  mats = SciRot.from_rotvec(np.pi * np.eye(3) * (1 - 1e-7)).as_matrix()
  back = rot.matrix_from_quat(rot.quat_from_matrix(jnp.asarray(mats)))
  np.testing.assert_allclose(back, mats, atol=1e-5)


def test_axis_angle_matches_scipy():
  rv = R_RAND.as_rotvec()
  np.testing.assert_allclose(rot.matrix_from_axis_angle(jnp.asarray(rv)), MATS, atol=1e-5)
  np.testing.assert_allclose(rot.axis_angle_from_matrix(jnp.asarray(MATS)), rv, atol=1e-4)
  np.testing.assert_allclose(rot.matrix_from_axis_angle(jnp.zeros(3)), np.eye(3), atol=1e-7)


ORDERS = [''.join(p) for p in itertools.permutations('XYZ')] + ['ZXZ', 'XYX', 'YZY']


@pytest.mark.parametrize('order', ORDERS)
def test_euler_every_order_vs_scipy(order):
  ang = RNG.uniform(-170, 170, size=(16, 3))
  ang[:, 1] = RNG.uniform(-80, 80, size=16) if len(set(order)) == 3 else RNG.uniform(10, 170, 16)
  expect = SciRot.from_euler(order, ang, degrees=True).as_matrix()
  got = rot.matrix_from_euler(jnp.asarray(ang), order, degrees=True)
  np.testing.assert_allclose(got, expect, atol=1e-5)
  back = rot.euler_from_matrix(jnp.asarray(expect), order, degrees=True)
  np.testing.assert_allclose(rot.matrix_from_euler(back, order, degrees=True), expect, atol=1e-5)


def test_euler_bad_order_is_a_clear_error():
  with pytest.raises(ValueError, match='Euler order'):
    rot.matrix_from_euler(jnp.zeros(3), 'ZYQ')


def test_geodesic_angle_matches_scipy_magnitude():
  other = SciRot.random(64, random_state=2)
  expect = (R_RAND.inv() * other).magnitude()
  got = rot.geodesic_angle(jnp.asarray(MATS), jnp.asarray(other.as_matrix()))
  np.testing.assert_allclose(got, expect, atol=1e-4)


@pytest.mark.parametrize('angle', [0.0, 1e-9, 0.3, np.pi - 1e-4, np.pi])
def test_geodesic_gradients_finite(angle):
  axis = np.array([0.3, -0.5, 0.8]) / np.linalg.norm([0.3, -0.5, 0.8])
  target = jnp.asarray(SciRot.from_rotvec(angle * axis).as_matrix(), jnp.float32)

  def loss(x):
    return rot.geodesic_angle(rot.matrix_from_sixd(x), target)

  x0 = rot.sixd_from_matrix(jnp.eye(3))
  g = jax.grad(loss)(x0)
  assert np.all(np.isfinite(g)), g
  np.testing.assert_allclose(loss(x0), angle, atol=2e-3)


def test_swing_twist_of_known_rotations():
  twist, swing = rot.swing_twist_angles(jnp.asarray(SciRot.from_euler('X', 40, degrees=True).as_matrix()))
  np.testing.assert_allclose([np.degrees(twist), np.degrees(swing)], [40, 0], atol=1e-3)
  twist, swing = rot.swing_twist_angles(jnp.asarray(SciRot.from_euler('Z', 70, degrees=True).as_matrix()))
  np.testing.assert_allclose([np.degrees(twist), np.degrees(swing)], [0, 70], atol=1e-3)
  # Swing then twist: R = S @ T composes exactly.
  R = SciRot.from_euler('Y', 30, degrees=True) * SciRot.from_euler('X', -50, degrees=True)
  twist, swing = rot.swing_twist_angles(jnp.asarray(R.as_matrix()))
  np.testing.assert_allclose([np.degrees(twist), np.degrees(swing)], [50, 30], atol=1e-3)
  # About another axis: twist about z.
  twist, _ = rot.swing_twist_angles(jnp.asarray(SciRot.from_euler('Z', 25, degrees=True).as_matrix()),
                                    axis=jnp.array([0.0, 0.0, 2.0]))
  np.testing.assert_allclose(np.degrees(twist), 25, atol=1e-3)


def test_minimal_rotation_takes_a_to_b_and_is_minimal():
  a = RNG.normal(size=(32, 3))
  b = RNG.normal(size=(32, 3))
  b[0] = -a[0]  # antiparallel
  b[1] = 2 * a[1]  # parallel
  R = np.asarray(rot.minimal_rotation(jnp.asarray(a), jnp.asarray(b)))
  an = a / np.linalg.norm(a, axis=1, keepdims=True)
  bn = b / np.linalg.norm(b, axis=1, keepdims=True)
  np.testing.assert_allclose(np.einsum('nij,nj->ni', R, an), bn, atol=1e-5)
  angle = SciRot.from_matrix(R).magnitude()
  np.testing.assert_allclose(angle, np.arccos(np.clip((an * bn).sum(1), -1, 1)), atol=1e-4)


def test_slerp_halfway():
  q0 = np.array([1.0, 0, 0, 0])
  q1 = SciRot.from_euler('Y', 90, degrees=True).as_quat()[[3, 0, 1, 2]]
  mid = rot.quat_slerp(jnp.asarray(q0), jnp.asarray(q1), 0.5)
  expect = SciRot.from_euler('Y', 45, degrees=True).as_matrix()
  np.testing.assert_allclose(rot.matrix_from_quat(mid), expect, atol=1e-6)


def test_jit_matches_eager():
  x = jnp.asarray(MATS)
  for f in (rot.quat_from_matrix, rot.axis_angle_from_matrix, rot.sixd_from_matrix):
    np.testing.assert_allclose(jax.jit(f)(x), f(x), atol=1e-6)
