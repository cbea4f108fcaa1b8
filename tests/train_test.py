"""The trainer on real CMU frames: a step lowers the loss, overfitting, checkpoints, resuming."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import chex
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from ik_gat_jax import checkpointing, data, inference, input_pipeline, metrics, train
from ik_gat_jax import model as model_lib


def _fixed_batch(dataset, n):
  return input_pipeline.gather_batch(dataset, np.arange(min(n, len(dataset.positions))))


def test_batch_order_is_a_function_of_step_only():
  a = [input_pipeline.batch_indices(s, 7, 20, seed=3) for s in range(6)]
  b = [input_pipeline.batch_indices(s, 7, 20, seed=3) for s in (3, 4, 5)]
  np.testing.assert_array_equal(np.stack(a[3:]), np.stack(b))
  # Every example exactly once per epoch (the first 2 epochs = 40 indices).
  flat = np.concatenate(a)[:40]
  assert sorted(flat[:20]) == list(range(20)) and sorted(flat[20:40]) == list(range(20))


def test_overfit_150_frames_of_07_01_no_retrace(overfit_shards, tiny_config):
  """A tiny model fits 150 real frames (1.25 s of 07_01 at 120 fps) to under 2 degrees mean local
  error over all joints (measured 1.24)."""
  c = tiny_config(overfit_shards, train=dict(lr=2e-2, warmup_steps=20, steps=900,
                                             final_lr_fraction=0.05, batch_size=150,
                                             weight_decay=0.0))
  c.model.dropout = 0.0
  c.loss.alpha = 0.0
  c.augment.update(yaw=False, mirror=0.0, bone_scale=0.0)
  ds = data.load_shards(overfit_shards, 'train')
  batch = _fixed_batch(ds, 150)
  assert len(batch['positions']) == 150
  graphdef, state = train.init_state(inference.IKGAT_TASK, c, ds.rig, ds)
  step = train.make_train_step(inference.IKGAT_TASK, graphdef, c, ds.rig)
  traced = chex.assert_max_traces(n=1)  # the step compiles once for all 900 calls
  # 900 calls of one program: XLA's default optimisation level, not the suite's 0 (conftest.py).
  step = jax.jit(traced(step.__wrapped__), donate_argnums=0,
                 compiler_options={'xla_backend_optimization_level': 3})
  losses = []
  for _ in range(c.train.steps):
    state, m = step(state, batch)
    losses.append(float(m['loss']))
  assert losses[2] < losses[1]  # one step lowers the loss (step 0 has warm-up lr 0)
  predict = train.make_predict(inference.IKGAT_TASK, graphdef, c, ds.rig)
  pred = np.asarray(predict(state, batch))
  err = metrics.frame_errors(jnp.asarray(pred), batch['local_rot'], batch['offsets'],
                             batch['bone_frames'], batch['positions'], ds.rig)
  mean_all = float(np.degrees(np.mean(err['local'])))
  assert mean_all < 2.0, f'mean local error over all joints {mean_all:.2f} deg (loss {losses[-1]})'


def _interrupt_at(step_to_stop):
  def log(msg):
    if msg.startswith(f'step {step_to_stop}/'):
      raise KeyboardInterrupt
  return log


def _latest_state(workdir, config, rig, ds):
  """The full `checkpoints/latest` state (params, rest, optimizer state, step) and its step."""
  _, template = train.init_state(inference.IKGAT_TASK, config, rig, ds)
  ckpt = checkpointing.Checkpointer(workdir / 'checkpoints' / 'latest', create=False)
  state, meta = ckpt.restore(checkpointing.abstract_like(train.saved_part(template)))
  return state, meta, ckpt.latest_step()


def test_resume_equals_uninterrupted_and_checkpoint_round_trip(cmu_shards, tmp_path,
                                                               tiny_config):
  """Interrupted at step 4 and resumed = uninterrupted: the `latest` checkpoints of both runs, at
  the same asserted step 6, hold the same parameters and optimizer state bit for bit (one
  process, one machine: the same compiled step on the same inputs). The resumed run must
  really restore (its log says so and it runs only steps 5 and 6): restarting from scratch
  would also end equal, and a resume that dropped the optimizer state would not."""
  c = tiny_config(cmu_shards, train=dict(steps=6, log_every=1, eval_every=3,
                                         checkpoint_every=100))
  train.train_and_evaluate(c, tmp_path / 'straight', log=lambda m: None)
  with pytest.raises(KeyboardInterrupt):
    train.train_and_evaluate(c, tmp_path / 'resumed', log=_interrupt_at(4))
  run = json.loads((tmp_path / 'resumed' / 'run.json').read_text())
  assert run['status'] == 'interrupted' and run['step'] == 4
  lines = []
  train.train_and_evaluate(c, tmp_path / 'resumed', log=lines.append)
  assert any(m.startswith('resumed from') and 'at step 4' in m for m in lines), lines
  steps_run = [int(m.split()[1].split('/')[0]) for m in lines if m.startswith('step ')]
  assert steps_run and min(steps_run) == 5 and max(steps_run) == 6, steps_run
  assert json.loads((tmp_path / 'resumed' / 'run.json').read_text())['status'] == 'done'
  ds = data.load_shards(cmu_shards, 'train')
  sa, _, step_a = _latest_state(tmp_path / 'straight', c, ds.rig, ds)
  sb, _, step_b = _latest_state(tmp_path / 'resumed', c, ds.rig, ds)
  assert step_a == step_b == 6 and int(sa['step']) == int(sb['step']) == 6
  for part in ('params', 'rest', 'opt_state'):
    la, lb = jax.tree.leaves(sa[part]), jax.tree.leaves(sb[part])
    assert jax.tree.structure(sa[part]) == jax.tree.structure(sb[part])
    assert part == 'rest' or len(la) > 0
    for x, y in zip(la, lb):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=part)
  # The optimizer state moved (Adam moments are not all zero), so the comparison means something.
  assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(sa['opt_state'])
             if np.asarray(x).dtype.kind == 'f')
  a, meta_a = inference.load_model(tmp_path / 'straight')
  assert meta_a['rig']['name'] == 'cmu_body' and 'local_rot_err_deg' in meta_a['metrics']
  assert meta_a['provenance']['jax_version'] == jax.__version__
  # The restored model predicts what the metrics in its checkpoint say it does.
  ds = data.load_shards(cmu_shards, 'val')
  val = inference.validate_local_rotations(
      jax.jit(lambda b: inference.ikgat_infer(a, b)), ds, ml_collections.ConfigDict(meta_a['config']),
      ds.rig)
  np.testing.assert_allclose(val['local_rot_err_deg'], meta_a['metrics']['local_rot_err_deg'],
                             rtol=1e-4)


def test_a_run_killed_between_checkpoints_and_resumed_logs_each_step_once(cmu_shards, tmp_path,
                                                                         tiny_config):
  """A run that dies at step 5 with its last checkpoint at 4 (no handler saves, as under
  kill -9; here an error raised from its log) leaves log.jsonl with step 5 logged and maybe a
  torn last row; resumed, the log reads as one uninterrupted run: every train step once, in
  order, the validations once, every row JSON."""
  # The resume test's program (steps=6): read from the persistent compilation cache.
  c = tiny_config(cmu_shards, train=dict(steps=6, log_every=1, eval_every=3,
                                         checkpoint_every=4))
  workdir = tmp_path / 'killed'

  def die_at_5(msg):
    if msg.startswith('step 5/'):
      raise RuntimeError('killed')

  with pytest.raises(RuntimeError, match='killed'):
    train.train_and_evaluate(c, workdir, log=die_at_5)
  log = workdir / 'log.jsonl'
  rows = lambda: [json.loads(x) for x in log.read_text().splitlines()]  # noqa: E731
  assert [r['step'] for r in rows() if r['kind'] == 'train'] == [1, 2, 3, 4, 5]
  assert train.trained_step(workdir) == 4
  with open(log, 'a') as f:
    f.write('{"step": 6, "kind": "tr')  # a row the kill cut short
  lines = []
  train.train_and_evaluate(c, workdir, log=lines.append)
  assert any(m.startswith('resumed from') and 'at step 4' in m for m in lines), lines
  assert [r['step'] for r in rows() if r['kind'] == 'train'] == [1, 2, 3, 4, 5, 6]
  assert [r['step'] for r in rows() if r['kind'] == 'val'] == [3, 6]


def test_ema_recurrence_and_the_best_checkpoint_holds_the_average(cmu_shards, tmp_path,
                                                                   tiny_config):
  """`train.ema_decay`: (1) the jitted step keeps `ema_t = d_t ema + (1 - d_t) params_t` with
  `d_t = min(decay, (1 + t) / (10 + t))`, checked against the recurrence on the step's own
  parameters (decay 0.2: the warm-up binds at t = 1, the cap from t = 2); (2) a run interrupted
  and resumed validates and saves the average: its `best` checkpoint holds `latest`'s average,
  which differs from its parameters; (3) resuming that run with the average turned off drops
  it and finishes."""
  # One config for (1) and (2), and (3) with the resume test's: each compiled step is the same
  # program as one compiled before, read from the persistent compilation cache.
  c = tiny_config(cmu_shards, train=dict(steps=4, log_every=1, eval_every=4, checkpoint_every=100,
                                         ema_decay=0.2))
  ds = data.load_shards(cmu_shards, 'train')
  graphdef, state = train.init_state(inference.IKGAT_TASK, c, ds.rig, ds)
  mesh = train.make_mesh()
  state = train.place_state(state, mesh)
  step = train.make_train_step(inference.IKGAT_TASK, graphdef, c, ds.rig, mesh)
  batch = train.to_global(_fixed_batch(ds, 32), mesh, 32)
  expected = [np.asarray(x) for x in jax.tree.leaves(state['params'])]
  for t in (1, 2, 3):
    state, _ = step(state, batch)
    d = min(0.2, (1 + t) / (10 + t))
    expected = [d * e + (1 - d) * np.asarray(p) for e, p in
                zip(expected, jax.tree.leaves(state['params']))]
  got = jax.tree.leaves(state['ema'])
  assert len(got) == len(expected) > 0
  moved = 0
  for e, g, p in zip(expected, got, jax.tree.leaves(state['params'])):
    scale = max(1.0, float(np.abs(e).max()))
    np.testing.assert_allclose(np.asarray(g), e, rtol=0, atol=1e-6 * scale)
    moved += int(np.abs(np.asarray(p) - e).max() > 1e-5 * scale)  # 10x the tolerance
  assert moved > 0  # the average is not the parameters, so the check above means something

  with pytest.raises(KeyboardInterrupt):
    train.train_and_evaluate(c, tmp_path / 'ema', log=_interrupt_at(2))
  lines = []
  train.train_and_evaluate(c, tmp_path / 'ema', log=lines.append)
  assert any(m.startswith('resumed from') and 'at step 2' in m for m in lines), lines
  latest, _, at = _latest_state(tmp_path / 'ema', c, ds.rig, ds)
  assert at == 4 and 'ema' in latest
  best = checkpointing.Checkpointer(tmp_path / 'ema' / 'checkpoints' / 'best', create=False)
  saved, _ = best.restore(checkpointing.abstract_like(train.saved_part(latest, ('params', 'rest'))))
  differs = False
  for b, e, p in zip(jax.tree.leaves(saved['params']), jax.tree.leaves(latest['ema']),
                     jax.tree.leaves(latest['params'])):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(e))
    differs |= bool(np.any(np.asarray(e) != np.asarray(p)))
  assert differs
  # The raw parameters of the same step, exported as a model (experiments.export_latest).
  assert train.export_latest(tmp_path / 'ema', tmp_path / 'raw', 'params') == 4
  raw, meta = inference.load_model(tmp_path / 'raw')
  assert meta['exported_from']['part'] == 'params' and meta['metrics'] == {}
  for r, p in zip(jax.tree.leaves(nnx.state(raw, nnx.Param)), jax.tree.leaves(latest['params'])):
    np.testing.assert_array_equal(np.asarray(r), np.asarray(p))
  # Again to the same output: replaced whole; a folder it did not write (the run's own best,
  # which it deleted for its step) refused, untouched.
  assert train.export_latest(tmp_path / 'ema', tmp_path / 'raw', 'ema') == 4
  assert inference.load_model(tmp_path / 'raw')[1]['exported_from']['part'] == 'ema'
  best_dir = tmp_path / 'ema' / 'checkpoints' / 'best'
  before = sorted(p.name for p in best_dir.iterdir())
  with pytest.raises(ValueError, match='exists and is not an export_latest output'):
    train.export_latest(tmp_path / 'ema', best_dir, 'params')
  assert sorted(p.name for p in best_dir.iterdir()) == before
  assert not [p for p in tmp_path.iterdir() if p.name.startswith('.')]
  off = tiny_config(cmu_shards, train=dict(steps=6, log_every=1, eval_every=3,
                                           checkpoint_every=100))
  lines = []
  train.train_and_evaluate(off, tmp_path / 'ema', log=lines.append)
  assert any('moving average is dropped' in m for m in lines), lines
  assert json.loads((tmp_path / 'ema' / 'run.json').read_text())['status'] == 'done'
  assert 'ema' not in _latest_state(tmp_path / 'ema', off, ds.rig, ds)[0]


def test_checkpoint_errors_are_clear(cmu_shards, tmp_path):
  with pytest.raises(checkpointing.CheckpointError, match='no checkpoint'):
    inference.load_model(tmp_path / 'nothing')
  (tmp_path / 'empty').mkdir()
  with pytest.raises(checkpointing.CheckpointError, match='no checkpoint found'):
    inference.load_model(tmp_path / 'empty')


def test_a_run_resumed_off_a_log_row_logs_the_losses_of_one_run(cmu_shards, tmp_path,
                                                                 tiny_config):
  """Resumed from step 4 with log rows every 3 steps: the row at step 6 averages steps 4-6, as
  one uninterrupted run's (it averaged only 5-6, the steps the resumed run took)."""
  c = tiny_config(cmu_shards, train=dict(steps=6, log_every=3, eval_every=3,
                                         checkpoint_every=4))

  def die_at_6(msg):
    if msg.startswith('step 6/'):
      raise RuntimeError('killed')

  train.train_and_evaluate(c, tmp_path / 'straight', log=lambda m: None)
  with pytest.raises(RuntimeError, match='killed'):
    train.train_and_evaluate(c, tmp_path / 'resumed', log=die_at_6)
  assert train.trained_step(tmp_path / 'resumed') == 4
  train.train_and_evaluate(c, tmp_path / 'resumed', log=lambda m: None)
  every = tiny_config(cmu_shards, train=dict(steps=6, log_every=1, eval_every=3,
                                             checkpoint_every=100))
  train.train_and_evaluate(every, tmp_path / 'every', log=lambda m: None)
  timing = ('time', 'frames_per_s', 'pipeline_frames_per_s')
  rows = {name: [{k: v for k, v in r.items() if k not in timing} for r in map(json.loads, (
      tmp_path / name / 'log.jsonl').read_text().splitlines()) if r['kind'] == 'train']
          for name in ('straight', 'resumed', 'every')}
  assert [r['step'] for r in rows['straight']] == [3, 6]
  assert rows['resumed'] == rows['straight']
  # Each field of a row is the mean over its steps, the loss's parts and the gradient norm as
  # the loss (they were the row's last step's: the parts did not add up to the loss).
  for row in rows['straight']:
    steps = [r for r in rows['every'] if row['step'] - 3 < r['step'] <= row['step']]
    for k in ('loss', 'rot_rad', 'grad_norm'):
      assert row[k] == pytest.approx(np.mean([r[k] for r in steps]), rel=1e-6), k


def test_ctrl_c_mid_run_saves_and_resumes(cmu_shards, tmp_path):
  """A real SIGINT to `experiments.train`: the step in flight finishes, a checkpoint is saved,
  the exit status is 130, and rerunning the same command resumes and finishes."""
  workdir = tmp_path / 'run'
  cmd = [sys.executable, '-m', 'experiments.train', f'--data={cmu_shards}',
         f'--workdir={workdir}', '--config=experiments/configs/test.py', '--steps=100000',
         '--config.train.log_every=1', '--config.train.eval_every=100000']
  env = {**os.environ, 'PYTHONUNBUFFERED': '1'}
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  p = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
  # Lines arrive through a thread, so a silent child cannot block the test: it waits for
  # 'step 3/' at most 180 s, then kills the child and fails with what it printed.
  lines: queue.Queue = queue.Queue()
  reader = threading.Thread(target=lambda: [lines.put(x) for x in p.stdout], daemon=True)
  reader.start()
  seen, deadline = [], time.time() + 180
  while not any(x.startswith('step 3/') for x in seen):
    try:
      seen.append(lines.get(timeout=max(0.1, deadline - time.time())))
    except queue.Empty:
      p.kill()
      pytest.fail('experiments.train printed no "step 3/" within 180 s:\n' + ''.join(seen)[-2000:])
  p.send_signal(signal.SIGINT)
  try:
    p.wait(timeout=120)
  except subprocess.TimeoutExpired:
    p.kill()
    pytest.fail('experiments.train did not exit within 120 s of SIGINT')
  reader.join(timeout=10)
  out = ''.join(seen) + ''.join(lines.queue)
  assert p.returncode == 130, out[-2000:]
  run = json.loads((workdir / 'run.json').read_text())
  assert run['status'] == 'interrupted' and run['step'] >= 3
  assert checkpointing.Checkpointer(workdir / 'checkpoints' / 'latest').latest_step() == \
      run['step']
  done = subprocess.run(cmd[:-3] + [f"--steps={run['step'] + 2}"], cwd=repo, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert "resumed from" in done.stdout and json.loads(
      (workdir / 'run.json').read_text())['status'] == 'done'


def test_mirror_averaged_teacher_targets_are_mirror_equivariant(cmu_shards, tiny_ikgat_run,
                                                              tiny_config):
  """`train.distill_mirror`: the teacher's target is its mirror-averaged solution
  (`ikgat_infer(mirror=True)`) in its output space, and so mirror-equivariant: the target for a
  batch's mirror image is the mirror image of the batch's target, which the network's own
  output (the option off) is not."""
  val = data.load_shards(cmu_shards, 'val')
  rig = val.rig
  c = tiny_config(cmu_shards, train=dict(distill_from=str(tiny_ikgat_run), distill_mirror=True))
  teacher = train.load_teacher(tiny_ikgat_run, inference.IKGAT_TASK, c, rig)
  batch = {k: jnp.asarray(v) for k, v in _fixed_batch(val, 12).items()}
  mirrored = input_pipeline.mirror_batch(batch, jnp.ones(12, bool), rig)
  batch, mirrored = ({**b, 'input_positions': b['positions']} for b in (batch, mirrored))

  def targets(config):  # local rotations of the targets; one compile per setting
    to_local = lambda b: model_lib.to_local(
        inference.teacher_target(teacher, b, config, rig), b['bone_frames'], rig,
        teacher.config.output_space, teacher.config.bone_chart)
    fn = jax.jit(to_local)
    return [np.asarray(fn(b)) for b in (batch, mirrored)]

  on, on_mirrored = targets(c)
  averaged = jax.jit(lambda b: inference.ikgat_infer(teacher, b, rig=rig, micro_batch=0,
                                                     mirror=True))(batch)
  np.testing.assert_allclose(on, averaged, atol=2e-5)
  mirror = lambda x: np.asarray(input_pipeline.mirror_local(jnp.asarray(x), rig))
  np.testing.assert_allclose(on_mirrored, mirror(on), atol=1e-4)
  c.train.distill_mirror = False
  off, off_mirrored = targets(c)
  assert np.abs(off_mirrored - mirror(off)).max() > 1e-2
  assert np.abs(on - off).max() > 1e-2


def test_distillation_adds_the_angle_to_the_teacher(cmu_shards, tiny_ikgat_run, tmp_path,
                                                    tiny_config):
  """`train.distill_from`: a student that starts as the teacher's exact function (warm start,
  dropout off) has a distillation term of ~0 at step 1 (float32 round-off of the same
  computation; a student of its own initialisation is 0.1-0.5 rad away) and its loss is the
  usual terms + distill_weight x that term; a teacher that predicts in another output space is
  refused with the reason."""
  c = tiny_config(cmu_shards, model=dict(dropout=0.0),
                  train=dict(steps=1, log_every=1, eval_every=100, init_from=str(tiny_ikgat_run),
                             distill_from=str(tiny_ikgat_run)))
  c.loss.distill_weight = 3.0
  lines = []
  train.train_and_evaluate(c, tmp_path / 'student', log=lines.append)
  assert any(m.startswith(f'distilling from {tiny_ikgat_run}') for m in lines), lines
  first = [json.loads(x) for x in (tmp_path / 'student' / 'log.jsonl').read_text().splitlines()
           if '"train"' in x][0]
  assert 0.0 <= first['distill_rad'] < 1e-3, first
  np.testing.assert_allclose(
      first['loss'], first['rot_rad'] + c.loss.alpha * first['pos_dm'] + 3.0 * first[
          'distill_rad'], rtol=1e-5)
  other = tiny_config(cmu_shards, model=dict(output_space='local'))
  with pytest.raises(ValueError, match=r"differs from this model in output_space \('bone_aligned'"
                     r" vs 'local'\)"):
    train.load_teacher(tiny_ikgat_run, inference.IKGAT_TASK, other,
                       data.load_shards(cmu_shards, 'train').rig)
