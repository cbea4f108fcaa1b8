"""Guards the XLA CPU workaround of ik_gat_jax/__init__.py (YNN reduce fusion miscompile) and
its speed setting (the preferred vector width)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import ik_gat_jax  # noqa: F401  (applies the workaround before any computation)
from ik_gat_jax import bone_frames, skeleton


def test_flag_is_set():
  assert 'xla_cpu_experimental_ynn_fusion_type' in os.environ.get('XLA_FLAGS', '')


def _flags_after_import(**env) -> str:
  """XLA_FLAGS as `import ik_gat_jax` leaves them in a fresh interpreter (JAX not imported)."""
  base = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'IK_GAT_NO_XLA_TUNING')}
  done = subprocess.run([sys.executable, '-c', 'import os, ik_gat_jax; '
                         'print(os.environ.get("XLA_FLAGS", ""))'],
                        cwd=Path(__file__).resolve().parents[1], env={**base, **env},
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  return done.stdout.strip()


def test_vector_width_is_added_unless_set_or_turned_off():
  assert _flags_after_import().split() == ['--xla_cpu_experimental_ynn_fusion_type=',
                                           '--xla_cpu_prefer_vector_width=512']
  own = '--xla_cpu_prefer_vector_width=256 --xla_cpu_enable_fast_math=false'
  assert _flags_after_import(XLA_FLAGS=own).split() == own.split() + [
      '--xla_cpu_experimental_ynn_fusion_type=']
  assert _flags_after_import(IK_GAT_NO_XLA_TUNING='1') == '--xla_cpu_experimental_ynn_fusion_type='


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
