"""The causal window model (issue K): windows, their noise, causality, stream == clip."""

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from ik_gat_jax import data as data_lib
from ik_gat_jax import evaluation
from ik_gat_jax import inference
from ik_gat_jax import input_pipeline
from ik_gat_jax import kinematics
from ik_gat_jax import losses
from ik_gat_jax import model as model_lib
from ik_gat_jax import rotations
from ik_gat_jax import train
from ik_gat_jax import windows
from ik_gat_jax.skeleton import get_rig
from ik_gat_jax.solver import IKSolver

RIG = get_rig('cmu_body')
K = 4


def test_run_starts_split_at_files_and_gaps():
  file_id = np.asarray([0, 0, 0, 1, 1, 1, 1, 1])
  frame_index = np.asarray([0, 1, 2, 0, 1, 5, 6, 7])  # a gap between 1 and 5 in file 1
  np.testing.assert_array_equal(windows.run_starts(file_id, frame_index),
                                [0, 0, 0, 3, 3, 5, 5, 5])
  i0, i1, w = windows.history_sources(np.arange(8), windows.run_starts(file_id, frame_index), 3)
  np.testing.assert_array_equal(i0, [[0, 0], [0, 0], [0, 1], [3, 3], [3, 3], [5, 5], [5, 5],
                                     [5, 6]])
  assert not np.any(w) and np.all(i1 <= np.arange(8)[:, None])


@pytest.mark.parametrize('ratio', [1.0, 2.0, 1.7, 0.5])
def test_stream_history_is_clip_history_bit_for_bit(ratio):
  x = np.random.default_rng(0).normal(size=(23, 5, 3)).astype(np.float32)
  clip = windows.clip_history(x, 6, ratio)
  stream = windows.StreamHistory(6, ratio)
  got = np.stack([stream.push(f) for f in x])
  np.testing.assert_array_equal(got, clip)
  stream.reset()
  np.testing.assert_array_equal(np.stack([stream.push(f) for f in x[5:]]),
                                windows.clip_history(x[5:], 6, ratio))
  # Past frame i of frame t sits i * ratio frames back (linear in between), clamped at frame 0.
  t = 20
  tau = np.maximum(t - ratio * np.arange(5, 0, -1), 0)
  expect = np.stack([np.interp(tau, np.arange(23), x[:, j, c]) for j in range(5)
                     for c in range(3)], -1).reshape(5, 5, 3)
  np.testing.assert_allclose(clip[t], expect, atol=1e-5)


def test_gathered_windows_are_past_frames_of_the_same_file(cmu_shards):
  data = data_lib.load_shards(cmu_shards, 'train')
  idx = np.asarray([0, 1, 5, len(data.positions) - 1, int(np.argmax(np.diff(data.file_id))) + 1,
                    int(np.argmax(np.diff(data.file_id))) + 2, 100])
  batch = input_pipeline.gather_batch(data, idx, window=K)
  assert batch['history'].shape == (len(idx), K - 1, RIG.num_joints, 3)
  for row, t in enumerate(idx):
    for i in range(K - 1):
      back = K - 1 - i
      src = t - back
      if src < 0 or data.file_id[src] != data.file_id[t]:  # clamped to the file's first frame
        src = int(np.flatnonzero(data.file_id == data.file_id[t])[0])
      np.testing.assert_array_equal(batch['history'][row, i], data.positions[src])
      np.testing.assert_array_equal(batch['history_local_rot'][row, i], data.local_rot[src])


AUG = ml_collections.ConfigDict(dict(yaw=True, mirror=0.5, bone_scale=0.07, noise_mm=0.0))


def _window_batch(data, idx):
  b = input_pipeline.gather_batch(data, idx, window=K)
  return {k: np.asarray(v) for k, v in b.items()}


def test_augment_windows_one_body_per_window(cmu_shards):
  """Mirror, bone scale and yaw are drawn once per window: a window of one repeated frame stays
  repeated, and every frame of a real window has the current frame's bone lengths."""
  data = data_lib.load_shards(cmu_shards, 'train')
  batch = _window_batch(data, np.arange(40, 104))
  out = input_pipeline.augment_windows(batch, jax.random.key(3), AUG, RIG)
  parents = np.asarray(RIG.parents[1:])
  bones = lambda p: np.linalg.norm(p[..., 1:, :] - p[..., parents, :], axis=-1)
  past = bones(np.asarray(out['history']))
  np.testing.assert_allclose(past, np.broadcast_to(
      bones(np.asarray(out['input_positions']))[:, None], past.shape), atol=2e-6)
  # The targets are the augmented current frame: FK of its rotations gives its positions.
  _, p = kinematics.forward_kinematics(out['local_rot'], out['offsets'], RIG.parents,
                                       out['positions'][:, 0])
  np.testing.assert_allclose(p, out['positions'], atol=2e-6)
  still = {**batch, 'history': np.repeat(batch['positions'][:, None], K - 1, 1),
           'history_local_rot': np.repeat(batch['local_rot'][:, None], K - 1, 1)}
  out = input_pipeline.augment_windows(still, jax.random.key(4), AUG, RIG)
  np.testing.assert_allclose(out['history'], np.repeat(
      np.asarray(out['input_positions'])[:, None], K - 1, 1), atol=2e-6)


def test_temporal_noise_parts_have_their_statistics():
  B, k, J = 4000, 8, RIG.num_joints
  x = np.zeros((B, k, J, 3), np.float32)
  aug = ml_collections.ConfigDict(dict(bias_mm=20.0, hold_prob=0.3, window_start_prob=0.25,
                                       clean_frac=0.2))
  base = np.asarray(jax.random.normal(jax.random.key(1), (B, k, J, 3)))
  y, info = input_pipeline.temporal_noise(jax.random.key(0), x, aug, RIG, return_info=True)
  level = np.asarray(info['bias_mm'])
  assert abs(np.mean(level == 0) - 0.2) < 0.03  # clean samples: no bias
  assert abs(level[level > 0].mean() - 10.0) < 0.5  # U[0, 20]
  # Only a bias (the zero input has nothing to hold): constant over the window, std b / sqrt(3)
  # over the dirty samples (E[s^2] = b^2 / 3), except where the stream start repeats a frame.
  np.testing.assert_allclose(np.asarray(y), np.asarray(y)[:, -1:].repeat(k, 1), atol=0)
  dirty = level > 0
  assert abs(1e3 * np.asarray(y)[dirty].std() - 20 / np.sqrt(3)) < 0.4
  # Hold: the joint repeats frame k-1-h's value for the last h frames; others untouched.
  y, info = input_pipeline.temporal_noise(
      jax.random.key(0), base, ml_collections.ConfigDict(dict(hold_prob=0.3)), RIG,
      return_info=True)
  y, joint, h = np.asarray(y), np.asarray(info['hold_joint']), np.asarray(info['hold_frames'])
  assert abs(np.mean(joint >= 0) - 0.3) < 0.03 and set(h[joint >= 0]) == set(range(1, k))
  for b in np.flatnonzero(joint >= 0)[:50]:
    j = joint[b]
    np.testing.assert_array_equal(y[b, k - h[b]:, j], np.repeat(base[b, k - 1 - h[b], j][None],
                                                               h[b], 0))
    np.testing.assert_array_equal(y[b, :k - h[b]], base[b, :k - h[b]])
  np.testing.assert_array_equal(y[joint < 0], base[joint < 0])
  # Stream starts: frames older than the kept ones are copies of the oldest kept one.
  y, info = input_pipeline.temporal_noise(
      jax.random.key(0), base, ml_collections.ConfigDict(dict(window_start_prob=0.25)), RIG,
      return_info=True)
  y, kept = np.asarray(y), np.asarray(info['start_kept'])
  assert abs(np.mean(kept < k - 1) - 0.25) < 0.03
  for b in range(200):
    first = k - 1 - kept[b]
    np.testing.assert_array_equal(y[b, first:], base[b, first:])
    np.testing.assert_array_equal(y[b, :first], np.repeat(base[b, first][None], first, 0))
  with pytest.raises(ValueError, match='hold_prob'):
    input_pipeline.temporal_noise(jax.random.key(0), base,
                                  ml_collections.ConfigDict(dict(hold_prob=2.0)), RIG)


@pytest.fixture(scope='module')
def window_model():
  config = model_lib.ModelConfig(size='tiny', output_space='mixed', window=K,
                                 heading_canonicalization=True, observed_direction_head=True)
  model = model_lib.create_model(config, RIG, nnx.Rngs(0))
  # Untrained heads start near the identity: perturb every parameter so outputs depend on
  # the history channels too.
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  leaves = [p + 0.2 * jax.random.normal(kk, p.shape) for p, kk in zip(leaves, keys)]
  return (nnx.merge(graphdef, jax.tree.unflatten(tree, leaves), rest),
          {'config': {'model': config.to_dict()}})


@pytest.fixture(scope='module')
def window_solver(window_model):
  return IKSolver(*window_model, block_size=16)


def _clip(cmu_shards, n=40):
  return np.asarray(data_lib.load_shards(cmu_shards, 'val').positions[:n], np.float64)


def test_window_model_is_causal_bit_for_bit(window_solver, cmu_shards):
  clip = _clip(cmu_shards)
  out = window_solver.solve(clip, check=False)
  for t, value in ((9, 1e6), (30, 1e6), (17, -3e5)):
    later = clip.copy()
    later[t + 1:] = value
    got = window_solver.solve(later, check=False)
    np.testing.assert_array_equal(got[:t + 1], out[:t + 1])
    assert np.abs(got[t + 1:t + K] - out[t + 1:t + K]).max() > 1e-3  # it does use the past


def test_window_stream_equals_clip(window_solver, cmu_shards):
  clip = _clip(cmu_shards, 24)
  whole = window_solver.solve(clip)
  window_solver.reset()
  stream = np.stack([window_solver.step(f) for f in clip])
  # Same windows and weights bit for bit (test above); the network runs at batch 1 here and in
  # buckets of 16 and 8 there, whose float32 reductions may round differently: 1e-5 is ~100x
  # float32 epsilon on entries of size <= 1.
  np.testing.assert_allclose(stream, whole, atol=1e-5)
  window_solver.reset()
  again = np.stack([window_solver.step(f) for f in clip[:5]])
  np.testing.assert_array_equal(again, stream[:5])  # reset() forgets the past frames
  window_solver.reset()
  batched = np.concatenate(list(window_solver.solve_stream([clip[:10], clip[10:13], clip[13:]])))
  np.testing.assert_allclose(batched, whole, atol=1e-5)
  window_solver.reset()


def test_refined_window_model_is_causal_and_stream_equals_clip(window_model, window_solver,
                                                              cmu_shards):
  """The refinement on a window model's stream (issue K): per frame, from the window's solution
  against that frame's points, so the refined outputs up to t ignore later frames bit for bit and
  a stream of the frames gives the clip's answer."""
  refined = IKSolver(*window_model, block_size=16, refine_iters=3)
  clip = _clip(cmu_shards, 24)
  whole = refined.solve(clip, check=False)
  plain = window_solver.solve(clip, check=False)
  assert np.abs(whole - plain).max() > 1e-3  # the refinement does run
  later = clip.copy()
  later[12:] = 1e6
  np.testing.assert_array_equal(refined.solve(later, check=False)[:12], whole[:12])
  stream = np.stack([refined.step(f) for f in clip])
  # The same clip solved one frame per chunk runs the network at the stream's batch shape, so the
  # two agree up to the round-off of identical programs (none here): within 1e-5.
  one = IKSolver(*window_model, block_size=1, refine_iters=3)
  np.testing.assert_allclose(stream, one.solve(clip, check=False), atol=1e-5)
  # Against buckets of 16 and 8 the network's round-off differs (the unrefined stream below), and
  # Adam turns a gradient's round-off near zero into up to a whole step: a step moves each 6D
  # coordinate by at most lr (|m_hat| <= sqrt(v_hat) for b1^2 <= b2), so two runs part by at most
  # their start's difference plus 2 lr per iteration; a matrix entry (Gram-Schmidt of the 6D
  # columns near orthonormal) by at most 3x that. Seen: 5e-4 on one Intel Xeon, 1e-4 on others.
  window_solver.reset()
  start = np.abs(np.stack([window_solver.step(f) for f in clip]) - plain).max()
  cfg = refined.refine
  assert cfg.optimizer == 'adam' and cfg.adam_b1 ** 2 <= cfg.adam_b2
  np.testing.assert_allclose(stream, whole, atol=3 * (start + 2 * cfg.iters * cfg.lr))


def test_window_training_and_evaluation(cmu_shards, tiny_config, tmp_path):
  c = tiny_config(cmu_shards, model=dict(window=K, output_space='mixed',
                                         observed_direction_head=True,
                                         heading_canonicalization=True),
                  train=dict(steps=4, eval_every=4, checkpoint_every=4, val_frames=128))
  c.augment.update(noise_mm_max=30.0, clean_frac=0.2, bias_mm=10.0, hold_prob=0.1,
                   window_start_prob=0.1, yaw=False)
  val = train.train_and_evaluate(c, tmp_path / 'run', log=lambda m: None)
  assert np.isfinite(val['local_rot_err_deg'])
  method = evaluation.ikgat_method(tmp_path / 'run', RIG, chunk=64)
  assert method.info['input_window'] == K
  r = evaluation.evaluate(method, data_lib.load_shards(cmu_shards, 'val'), RIG, max_frames=100,
                          noise_mm=10.0)
  assert np.isfinite(r['local_rot_err_deg']) and 'jitter_ratio' in r
  bad = tiny_config(cmu_shards, model=dict(window=K, window_fps=60.0))
  with pytest.raises(ValueError, match='window_fps=60 but .* at 30 fps'):
    train.train_and_evaluate(bad, tmp_path / 'bad', log=lambda m: None)
  with pytest.raises(ValueError, match='full-body positions only'):
    model_lib.ModelConfig(window=K, joint_mask=True)


def test_window_model_refuses_missing_history():
  model = model_lib.create_model(model_lib.ModelConfig(size='tiny', window=K), RIG, nnx.Rngs(0))
  x = np.zeros((2, RIG.num_joints, 3), np.float32)
  with pytest.raises(ValueError, match='needs history'):
    model(x, deterministic=True)
  flat = model_lib.create_model(model_lib.ModelConfig(size='tiny'), RIG, nnx.Rngs(0))
  with pytest.raises(ValueError, match='takes no history'):
    flat(x, deterministic=True, history=np.zeros((2, K - 1, RIG.num_joints, 3), np.float32))


def test_warm_start_from_a_per_frame_run_keeps_its_function(tiny_ikgat_run, cmu_shards):
  """A window model warm-started from a per-frame run (train.init_from) is that run's model
  until it trains: the history channels start at zero weight."""
  flat, meta = inference.load_model(tiny_ikgat_run)
  config = model_lib.ModelConfig.from_dict({**meta['config']['model'], 'window': K})
  model = model_lib.create_model(config, RIG, nnx.Rngs(5))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, counts = train.warm_start_params(params, tiny_ikgat_run, inference.IKGAT_TASK)
  assert counts['grown'] == 1 and counts['kept'] == 0 and counts['copied'] > 5
  model = nnx.merge(graphdef, params, rest)
  x = np.asarray(data_lib.load_shards(cmu_shards, 'val').positions[:8], np.float32)
  history = np.random.default_rng(0).normal(size=(8, K - 1, RIG.num_joints, 3)).astype(
      np.float32)
  np.testing.assert_allclose(model(x, deterministic=True, history=history),
                             flat(x, deterministic=True), atol=1e-5)


def test_window_is_in_seconds_at_any_fps(window_solver, cmu_shards):
  """The same motion at 60 fps (a frame inserted between every two) gives, on the original
  frames, the 30 fps outputs: past frames are taken 1/window_fps s back, not k frames back."""
  clip = _clip(cmu_shards, 20)
  at30 = window_solver.solve(clip)
  fine = np.empty((2 * len(clip) - 1,) + clip.shape[1:])
  fine[0::2], fine[1::2] = clip, 0.5 * (clip[1:] + clip[:-1])
  try:
    window_solver.fps = 60.0
    assert window_solver.window_ratio == 2.0
    at60 = window_solver.solve(fine)
  finally:
    window_solver.fps = 30.0
  # Identical windows on the even frames; the batch differs (buckets), hence the tolerance.
  np.testing.assert_allclose(at60[0::2], at30, atol=1e-5)


def test_causal_fit_oracle_bounds_every_fixed_smoother(cmu_shards):
  """experiments.causal_fit: the polynomial weights reproduce their polynomial at the newest
  frame, and the oracle taps (least squares against the truth on the same noisy windows) are no
  worse than any fixed smoother of that length on those frames (the bound the doc quotes)."""
  from experiments import causal_fit
  t = np.arange(6.0) - 5
  np.testing.assert_allclose(causal_fit.endpoint_weights(6, 2) @ (1 + 2 * t - 0.5 * t**2), 1.0,
                             atol=1e-9)
  ds = data_lib.load_shards(cmu_shards, 'val')
  clean, win = causal_fit.noisy_windows(ds, 8, 20.0)
  assert win.shape == (len(clean), 8) + clean.shape[1:]
  np.testing.assert_array_equal(win[:, -1], evaluation.add_noise(clean, 20.0, 0))
  sq = lambda w: float(np.square(np.einsum('t,ntjc->njc', w, win) - clean).mean())
  oracle = sq(causal_fit.oracle_weights(clean, win))
  fixed = [causal_fit.endpoint_weights(8, d) for d in (0, 1, 2)] + [np.eye(8)[-1]]
  assert all(oracle <= sq(w) for w in fixed)
  assert oracle < 0.7 * sq(np.eye(8)[-1])  # well below the raw noise: the taps do smooth


def test_velocity_loss_penalises_jitter_not_offsets():
  """Zero for an output that moves as the truth does (any constant rotation on the parent's
  side of every frame), positive where consecutive frames change differently."""
  rng = np.random.default_rng(3)
  rot = lambda *shape: np.asarray(rotations.matrix_from_axis_angle(
      rng.normal(size=shape + (3,)).astype(np.float32)))
  truth, offset = rot(8, RIG.num_joints), rot(RIG.num_joints)
  np.testing.assert_allclose(losses.velocity_loss(offset @ truth, truth), 0.0, atol=2e-3)
  shaken = truth.copy()
  shaken[4:] = rot(4, RIG.num_joints) @ truth[4:]
  v = np.asarray(losses.velocity_loss(shaken, truth))
  assert v.shape == (4,) and np.all(v > 0.1)


def test_window_pairs_share_their_frames_and_train(cmu_shards, tiny_config):
  """loss.velocity_weight: each sample is k+1 frames, seen as two windows of k one frame apart
  with the same noisy frames; the loss is the pair's mean plus the weighted velocity term."""
  c = tiny_config(cmu_shards, model=dict(window=K, output_space='mixed'))
  c.loss.velocity_weight = 0.5
  c.augment.update(noise_mm_max=30.0, bias_mm=10.0, hold_prob=0.1, window_start_prob=0.1)
  assert inference.training_window(c) == K + 1 and inference.window_of(c) == K
  data = data_lib.load_shards(cmu_shards, 'train')
  batch = _window_batch(data, np.arange(100, 106))
  assert batch['history'].shape[1] == K - 1
  batch = {k: np.asarray(v) for k, v in
           input_pipeline.gather_batch(data, np.arange(100, 106), window=K + 1).items()}
  pairs = input_pipeline.augment_window_pairs(batch, jax.random.key(2), c.augment, RIG)
  B = 6
  assert pairs['history'].shape == (2 * B, K - 1, RIG.num_joints, 3)
  np.testing.assert_array_equal(pairs['history'][B:, :-1], pairs['history'][:B, 1:])
  np.testing.assert_array_equal(pairs['history'][B:, -1], pairs['input_positions'][:B])
  plain = ml_collections.ConfigDict({**c.augment.to_dict(), 'mirror': 0.0, 'yaw': False})
  labels = input_pipeline.augment_window_pairs(batch, jax.random.key(2), plain, RIG)['local_rot']
  np.testing.assert_array_equal(labels[:B], data.local_rot[99:105])  # the earlier window's
  np.testing.assert_array_equal(labels[B:], data.local_rot[100:106])
  model = model_lib.create_model(model_lib.ModelConfig.from_dict(c.model), RIG, nnx.Rngs(0))
  loss, aux = inference.IKGAT_TASK.loss(model, batch, jax.random.key(2), c, RIG)
  assert loss.shape == (B,) and np.all(np.asarray(aux['velocity_rad']) > 0)
  np.testing.assert_allclose(loss, aux['rot_rad'] + c.loss.alpha * aux['pos_dm']
                             + 0.5 * aux['velocity_rad'], rtol=1e-5)
  c.loss.velocity_weight = 0.0
  assert inference.training_window(c) == K
