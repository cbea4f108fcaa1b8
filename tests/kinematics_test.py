"""FK against a naive numpy loop on real CMU data, equivariance, parity, no retracing."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from scipy.spatial.transform import Rotation as SciRot

from experiments import bench_fk
from ik_gat_jax import kinematics, rotations, skeleton
from ik_gat_jax.io import bvh

CMU_UNIT_M = 0.056444


def _bvh_local_rotations(motion: bvh.BVHMotion) -> np.ndarray:
  """`[T, J, 3, 3]` local rotations from the raw Euler channels, through our rotation module."""
  cols = [rotations.matrix_from_euler(motion.rotation_degrees(j), motion.euler_order(j),
                                      degrees=True) for j in range(len(motion.joints))]
  return np.stack([np.asarray(c) for c in cols], axis=1)


def test_fk_matches_naive_loop_on_real_cmu_file(cmu_dir):
  motion = bvh.read_bvh(cmu_dir / '07_01.bvh')
  motion.motion = motion.motion[:200]
  expect = bvh.naive_fk_np(motion, scale=CMU_UNIT_M)
  with jax.enable_x64(True):
    R = jnp.asarray(_bvh_local_rotations(motion), jnp.float64)
    _, pos = kinematics.forward_kinematics(
        R, jnp.asarray(motion.offsets * CMU_UNIT_M), motion.parents,
        root_pos=jnp.asarray(motion.position_channels(0) * CMU_UNIT_M))
  assert np.abs(np.asarray(pos) - expect).max() < 1e-9


def _random_pose(rig, n, seed=0):
  rng = np.random.default_rng(seed)
  R = SciRot.random(n * rig.num_joints, random_state=seed).as_matrix().reshape(n, -1, 3, 3)
  return jnp.asarray(R, jnp.float32), jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)


def test_fk_equivariant_to_global_yaw():
  rig = skeleton.cmu_body()
  R, root = _random_pose(rig, 8)
  off = jnp.asarray(rig.template(), jnp.float32)
  Ry = rotations.axis_rotation('y', jnp.float32(0.7))
  G, p = kinematics.forward_kinematics(R, off, rig.parents, root)
  G2, p2 = kinematics.forward_kinematics(R.at[:, 0].set(Ry @ R[:, 0]), off, rig.parents,
                                         root @ Ry.T)
  np.testing.assert_allclose(p2, p @ Ry.T, atol=1e-5)
  np.testing.assert_allclose(G2, Ry @ G, atol=1e-5)


def test_global_local_round_trip_and_depth_form_agrees():
  rig = skeleton.smpl22()
  R, root = _random_pose(rig, 4, seed=3)
  off = jnp.asarray(rig.template(), jnp.float32)
  G, p = kinematics.forward_kinematics(R, off, rig.parents, root)
  np.testing.assert_allclose(kinematics.global_to_local(G, rig.parents), R, atol=1e-5)
  np.testing.assert_allclose(kinematics.local_to_global(R, rig.parents), G, atol=1e-6)
  G_d, p_d = bench_fk.forward_kinematics_by_depth(R, off, rig.parents, root)
  np.testing.assert_allclose(G_d, G, atol=1e-5)
  np.testing.assert_allclose(p_d, p, atol=1e-5)


def test_rest_pose_positions_are_summed_offsets():
  rig = skeleton.cmu_body()
  off = rig.template()
  _, p = kinematics.forward_kinematics(jnp.broadcast_to(jnp.eye(3), (rig.num_joints, 3, 3)),
                                       jnp.asarray(off), rig.parents)
  np.testing.assert_allclose(p, skeleton.rest_positions_np(off, rig.parents), atol=1e-6)


def test_jit_parity_no_retrace_and_finite_grads():
  rig = skeleton.cmu_body()
  R, root = _random_pose(rig, 16, seed=5)
  off = jnp.asarray(rig.template(), jnp.float32)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def fk(R, root):
    return kinematics.forward_kinematics(R, off, rig.parents, root)

  eager = kinematics.forward_kinematics(R, off, rig.parents, root)
  for seed in (5, 6):  # a second call with new values must not retrace
    R, root = _random_pose(rig, 16, seed=seed)
    out = fk(R, root)
  np.testing.assert_allclose(out[1], kinematics.forward_kinematics(R, off, rig.parents, root)[1],
                             atol=1e-5)
  del eager
  g = jax.grad(lambda R: kinematics.forward_kinematics(R, off, rig.parents, root)[1].sum())(R)
  assert np.all(np.isfinite(g))
