"""Guards the XLA CPU workaround of ik_gat_jax/__init__.py (YNN reduce fusion miscompile)."""

import os

import jax
import jax.numpy as jnp
import numpy as np

import ik_gat_jax  # noqa: F401  (applies the workaround before any computation)
from ik_gat_jax import bone_frames, skeleton


def test_flag_is_set():
  assert 'xla_cpu_experimental_ynn_fusion_type' in os.environ.get('XLA_FLAGS', '')


def test_projection_pattern_past_512_rows_matches_numpy():
  r = np.random.default_rng(1).normal(size=(21, 3)).astype(np.float32)
  x = np.random.default_rng(0).normal(size=(1024, 21, 3)).astype(np.float32)
  f = jax.jit(lambda x: jnp.asarray(r) - jnp.sum(jnp.asarray(r) * x, -1, keepdims=True) * x)
  np.testing.assert_allclose(f(x), r - np.sum(r * x, -1, keepdims=True) * x, atol=1e-4)


def test_jitted_bone_frames_of_a_mixed_batch_equal_per_subject():
  rig = skeleton.cmu_body()
  rng = np.random.default_rng(0)
  subjects = (rig.template()[None] * rng.uniform(0.8, 1.2, (2, rig.num_joints, 3))).astype(
      np.float32)
  offsets = subjects[np.repeat([0, 1], 600)]  # 1200 frames: two subjects
  B = np.asarray(jax.jit(lambda o: bone_frames.bone_frames(o, rig))(offsets))
  for s in (0, 1):
    np.testing.assert_allclose(B[600 * s:600 * (s + 1)],
                               np.broadcast_to(bone_frames.bone_frames_np(subjects[s], rig),
                                               (600, rig.num_joints, 3, 3)), atol=1e-5)
