"""Temporal stability (issue G3): the jitter metric, the causal One-Euro filter on SO(3), and the
solver's streaming filter state."""

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

import jax
import jax.numpy as jnp

from ik_gat_jax import metrics
from ik_gat_jax import rotations
from ik_gat_jax import temporal

ONE_EURO = temporal.FilterConfig('one_euro', min_cutoff=2.0, beta=0.5)


def _noisy_clip(T=40, J=3, seed=0):
  """A smooth rotation trajectory per joint plus per-frame noise: `[T, J, 3, 3]` float32."""
  rng = np.random.default_rng(seed)
  t = np.arange(T)[:, None, None] / 30.0
  rotvec = np.sin(2 * np.pi * 0.5 * t + rng.uniform(0, 6, (1, J, 3))) * 0.8
  rotvec = rotvec + rng.normal(scale=0.05, size=rotvec.shape)
  return Rotation.from_rotvec(rotvec.reshape(-1, 3)).as_matrix().reshape(T, J, 3, 3).astype(
      np.float32)


# ----------------------------------------------------------------------------------------------
# Jitter metric.


def test_jitter_of_constant_angular_acceleration_is_analytic():
  fps, alpha = 30.0, 3.0  # rad/s^2 about one axis
  t = np.arange(20) / fps
  angle = 0.5 * alpha * t**2
  axis = np.array([1.0, 2.0, -0.5]) / np.linalg.norm([1.0, 2.0, -0.5])
  R = Rotation.from_rotvec(angle[:, None] * axis).as_matrix().astype(np.float32)[:, None]
  jit, n = metrics.joint_jitter(R, np.zeros(20), fps)
  assert n == 18
  np.testing.assert_allclose(jit, np.degrees(alpha), rtol=2e-3)


def test_jitter_of_constant_velocity_is_zero():
  fps = 30.0
  t = np.arange(30) / fps
  R = Rotation.from_rotvec((2.0 * t)[:, None] * np.array([0.0, 0.6, 0.8])).as_matrix()
  jit, _ = metrics.joint_jitter(R.astype(np.float32)[:, None], np.zeros(30), fps)
  assert jit[0] < 0.5  # deg/s^2; float32 rounding only (a 1 deg/frame step is 3,400 deg/s^2)


def test_jitter_never_crosses_files():
  """Two constant-velocity clips with different velocities: jumps between them don't count."""
  t = np.arange(10) / 30.0
  a = Rotation.from_rotvec((1.0 * t)[:, None] * np.array([1.0, 0, 0])).as_matrix()
  b = Rotation.from_rotvec((-3.0 * t + 1)[:, None] * np.array([0, 1.0, 0])).as_matrix()
  R = np.concatenate([a, b]).astype(np.float32)[:, None]
  files = np.repeat([0, 1], 10)
  jit, n = metrics.joint_jitter(R, files, 30.0)
  assert n == 16 and jit[0] < 0.5
  # A gap in frame_index splits a file too.
  frame_index = np.concatenate([np.arange(10), np.arange(20, 30)])
  assert metrics.joint_jitter(R, np.zeros(20), 30.0, frame_index)[1] == 16
  assert metrics.clip_triples(np.zeros(5), np.array([0, 2, 4, 6, 8])).sum() == 0


def test_relative_axis_angle_and_slerp():
  R0, R1 = Rotation.random(2, random_state=1).as_matrix().astype(np.float32)
  v = np.asarray(jax.jit(rotations.relative_axis_angle)(R0, R1))
  np.testing.assert_allclose(v, (Rotation.from_matrix(R0).inv() * Rotation.from_matrix(R1))
                             .as_rotvec(), atol=1e-5)
  ends = jax.jit(jax.vmap(rotations.matrix_slerp, (None, None, 0)))(R0, R1, jnp.array([0., 1.]))
  np.testing.assert_allclose(ends, np.stack([R0, R1]), atol=1e-5)


# ----------------------------------------------------------------------------------------------
# The filter.


def test_filter_is_causal():
  """Frames after k, even NaN, change nothing at or before k (bit for bit)."""
  R = _noisy_clip(T=32)
  k = 13
  _, ref = temporal.filter_sequence_jit(jnp.asarray(R), ONE_EURO, 30.0)
  for junk in (np.nan, 1e6):
    P = R.copy()
    P[k + 1:] = junk
    _, out = temporal.filter_sequence_jit(jnp.asarray(P), ONE_EURO, 30.0)
    np.testing.assert_array_equal(np.asarray(out)[:k + 1], np.asarray(ref)[:k + 1])
  assert not np.allclose(np.asarray(ref)[:k + 1], R[:k + 1], atol=1e-4)  # it does filter


def test_streaming_equals_whole_clip_and_padding_and_resets():
  R = _noisy_clip(T=24)
  state_c, clip = temporal.filter_sequence_jit(jnp.asarray(R), ONE_EURO, 30.0)
  state = temporal.init_state(R.shape[1])
  steps = []
  for r in R:
    state, out = temporal.filter_step_jit(state, jnp.asarray(r), ONE_EURO, 30.0)
    steps.append(np.asarray(out))
  np.testing.assert_allclose(np.stack(steps), np.asarray(clip), atol=2e-6)
  np.testing.assert_allclose(state.rot, state_c.rot, atol=2e-6)
  # Two clips concatenated with a start flag == each filtered alone; padding leaves state alone.
  both = np.concatenate([R, R[::-1]])
  out = temporal.filter_clips(both, np.repeat([4, 9], 24), ONE_EURO, 30.0)
  _, second = temporal.filter_sequence_jit(jnp.asarray(R[::-1].copy()), ONE_EURO, 30.0)
  np.testing.assert_allclose(out[:24], clip, atol=2e-6)
  np.testing.assert_allclose(out[24:], second, atol=2e-6)
  valid = np.arange(32) < 24
  padded = np.concatenate([R, np.repeat(R[-1:], 8, 0)])
  state_p, _ = temporal.filter_sequence_jit(jnp.asarray(padded), ONE_EURO, 30.0, None, None,
                                            jnp.asarray(valid))
  np.testing.assert_allclose(state_p.rot, state_c.rot, atol=2e-6)
  np.testing.assert_allclose(state_p.vel, state_c.vel, atol=2e-5)


def test_filter_of_constant_is_constant_and_none_passes_through():
  R = np.repeat(Rotation.random(3, random_state=2).as_matrix()[None], 20, 0).astype(np.float32)
  _, out = temporal.filter_sequence_jit(jnp.asarray(R), ONE_EURO, 30.0)
  np.testing.assert_allclose(out, R, atol=1e-6)
  _, same = temporal.filter_sequence(jnp.asarray(R), temporal.FilterConfig(), 30.0)
  assert same is not None and np.array_equal(np.asarray(same), R)


def test_filter_reduces_jitter_of_noisy_motion():
  R = _noisy_clip(T=90, seed=3)
  out = temporal.filter_clips(R, np.zeros(90), ONE_EURO, 30.0)
  before, _ = metrics.joint_jitter(R, np.zeros(90), 30.0)
  after, _ = metrics.joint_jitter(out, np.zeros(90), 30.0)
  assert (after < 0.5 * before).all()


def test_filter_config_checks_and_meta():
  with pytest.raises(ValueError, match='kind'):
    temporal.FilterConfig('kalman')
  with pytest.raises(ValueError, match='min_cutoff'):
    temporal.FilterConfig('one_euro', min_cutoff=0.0)
  assert temporal.from_checkpoint_meta({'config': {}}) == temporal.FilterConfig()
  # The API's one_euro is the command line's (the shipped checkpoint's parameters, chosen on
  # val), not the One-Euro paper's generic 1 Hz / 0.05 (worse than none at 10 mm of noise).
  from ik_gat_jax import inference
  _, shipped = inference.load_model(inference.SHIPPED_IKGAT)
  assert temporal.with_overrides(temporal.from_checkpoint_meta(shipped), 'one_euro') == (
      temporal.FilterConfig(kind='one_euro'))
  meta = {'config': {'temporal': {'filter': 'one_euro', 'min_cutoff': 3, 'beta': 1.0,
                                  'd_cutoff': 1.0}}}
  cfg = temporal.from_checkpoint_meta(meta)
  assert cfg == temporal.FilterConfig('one_euro', 3.0, 1.0, 1.0)
  assert temporal.with_overrides(cfg, kind='none', beta=2.0) == temporal.FilterConfig(
      'none', 3.0, 2.0, 1.0)


# ----------------------------------------------------------------------------------------------
# The solver: clips filtered whole, streams filtered with kept state, reset; a real noisy clip.


def test_solver_clip_and_stream_filter_on_a_noisy_real_clip(cmu_dir):
  """Shipped IK-GAT, CMU 07_05 (48 frames at 30 fps, 10 mm noise): `solve` filters the clip
  (FK from the filtered rotations) and lowers its jitter; `step`/`solve_stream` carry the state
  (together == the whole clip); `reset()` forgets it."""
  from ik_gat_jax import kinematics
  from ik_gat_jax.io import exports
  from ik_gat_jax.solver import IKSolver
  solver = IKSolver.from_checkpoint(temporal_filter=ONE_EURO, fps=30.0, block_size=16)
  assert solver.temporal_filter == ONE_EURO
  src = exports.read_bvh_clip(cmu_dir / '07_05.bvh', solver.rig, fps=30.0, max_frames=200)
  pos = src.positions[:48] + np.random.default_rng(0).normal(scale=0.01, size=(48, 21, 3))
  off, ids = src.offsets, np.zeros(48)

  sol = solver.solve(pos, offsets=off, full=True, check=False)
  solver.temporal_filter = temporal.FilterConfig()
  raw = solver.solve(pos, offsets=off, check=False)
  unfiltered_step = solver.step(pos[16], offsets=off)
  solver.temporal_filter = ONE_EURO
  np.testing.assert_allclose(sol.local_rot, temporal.filter_clips(raw, ids, ONE_EURO, 30.0),
                             atol=1e-5)
  assert metrics.joint_jitter(sol.local_rot, ids, 30.0)[0].mean() < 0.5 * metrics.joint_jitter(
      raw, ids, 30.0)[0].mean()
  _, p = kinematics.forward_kinematics(jnp.asarray(sol.local_rot), jnp.asarray(off, jnp.float32),
                                       solver.rig.parents,
                                       root_pos=jnp.asarray(pos[:, 0], jnp.float32))
  np.testing.assert_allclose(sol.positions_fk, p, atol=1e-5)

  solver.reset()
  stepped = np.stack([solver.step(f, offsets=off) for f in pos[:16]])
  streamed = list(solver.solve_stream([pos[16:32], pos[32]], offsets=off))
  got = np.concatenate([stepped, streamed[0], streamed[1][None]])
  np.testing.assert_allclose(got, sol.local_rot[:33], atol=1e-5)
  # State kept: frame 16 now is filtered toward the stream's past, not passed through ...
  assert not np.allclose(solver.step(pos[16], offsets=off), unfiltered_step, atol=1e-4)
  # ... and reset() forgets it: the first frame of a new stream passes through.
  solver.reset()
  np.testing.assert_allclose(solver.step(pos[16], offsets=off), unfiltered_step, atol=1e-6)
  # Setting the filter starts a new stream with it, `step` included: off, the second frame of
  # a stream is the network's own; on again, it is filtered toward the first.
  solver.temporal_filter = temporal.FilterConfig()
  solver.step(pos[15], offsets=off)
  np.testing.assert_allclose(solver.step(pos[16], offsets=off), raw[16], atol=1e-5)
  solver.temporal_filter = ONE_EURO
  solver.step(pos[15], offsets=off)
  assert not np.allclose(solver.step(pos[16], offsets=off), raw[16], atol=1e-4)
  # The solver's own subject (compiled into its stream step): the clip's filtered frames too.
  solver.offsets = off
  solver.reset()
  own = np.stack([solver.step(f) for f in pos[:8]])
  np.testing.assert_allclose(own, sol.local_rot[:8], atol=1e-5)
  with pytest.raises(TypeError, match='FilterConfig'):
    solver.temporal_filter = 'one_euro'


def test_trainer_validation_logs_jitter_of_whole_clips_only():
  import types
  import ml_collections
  from ik_gat_jax import inference, skeleton
  rig = skeleton.get_rig('cmu_body')
  T, J = 12, rig.num_joints
  true = np.repeat(_noisy_clip(T=T, J=1, seed=4), J, axis=1)
  pred = np.repeat(_noisy_clip(T=T, J=1, seed=5), J, axis=1)
  data = types.SimpleNamespace(file_id=np.zeros(T, np.int32), frame_index=np.arange(T), fps=30.0)
  batch = {'local_rot': true, 'offsets': np.repeat(rig.template()[None], T, 0).astype(np.float32),
           'bone_frames': np.repeat(np.eye(3)[None, None], T, 0).repeat(J, 1).astype(np.float32),
           'positions': np.zeros((T, J, 3), np.float32)}
  config = ml_collections.ConfigDict({'temporal': ONE_EURO.to_dict()})
  out = inference._validate_temporal(pred, batch, data, np.arange(T), config, rig)
  assert out['jitter_samples'] == T - 2 and out['filtered_jitter_deg_s2'] < out['jitter_deg_s2']
  assert np.isclose(out['jitter_ratio'], out['jitter_deg_s2'] / out['gt_jitter_deg_s2'])
  spaced = np.arange(0, T, 2)  # an evenly spaced subset: no consecutive frames, no jitter
  sub = {k: v[spaced] for k, v in batch.items()}
  assert inference._validate_temporal(pred[spaced], sub, data, spaced, config, rig) == {}
