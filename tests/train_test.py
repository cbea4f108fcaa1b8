"""The trainer on real CMU frames: a step lowers the loss, overfitting, checkpoints, resuming."""

import json

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from experiments.configs import test as test_config
from ik_gat_jax import checkpointing, data, input_pipeline, metrics, train


def _config(shards, **train_overrides):
  c = test_config.get_config()
  c.data = str(shards)
  c.train.update(train_overrides)
  return c


def _fixed_batch(dataset, n):
  return input_pipeline.gather_batch(dataset, np.arange(min(n, len(dataset.positions))))


def test_batch_order_is_a_function_of_step_only():
  a = [input_pipeline.batch_indices(s, 7, 20, seed=3) for s in range(6)]
  b = [input_pipeline.batch_indices(s, 7, 20, seed=3) for s in (3, 4, 5)]
  np.testing.assert_array_equal(np.stack(a[3:]), np.stack(b))
  # Every example exactly once per epoch (the first 2 epochs = 40 indices).
  flat = np.concatenate(a)[:40]
  assert sorted(flat[:20]) == list(range(20)) and sorted(flat[20:40]) == list(range(20))


def test_overfit_300_frames_of_07_01_no_retrace(overfit_shards):
  """A tiny model fits 300 real frames to under 2 degrees mean local error (all joints)."""
  c = _config(overfit_shards, lr=2e-2, warmup_steps=20, steps=900, final_lr_fraction=0.05,
              batch_size=300, weight_decay=0.0)
  c.model.dropout = 0.0
  c.loss.alpha = 0.0
  c.augment.update(yaw=False, mirror=0.0, bone_scale=0.0)
  ds = data.load_shards(overfit_shards, 'train')
  batch = _fixed_batch(ds, 300)
  assert len(batch['positions']) == 300
  graphdef, state = train.init_state(train.IKGAT_TASK, c, ds.rig, ds)
  step = train.make_train_step(train.IKGAT_TASK, graphdef, c, ds.rig)
  traced = chex.assert_max_traces(n=1)  # the step compiles once for all 900 calls
  step = jax.jit(traced(step.__wrapped__), donate_argnums=0)
  losses = []
  for _ in range(c.train.steps):
    state, m = step(state, batch)
    losses.append(float(m['loss']))
  assert losses[2] < losses[1]  # one step lowers the loss (step 0 has warm-up lr 0)
  predict = train.make_predict(train.IKGAT_TASK, graphdef, c, ds.rig)
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


def test_resume_equals_uninterrupted_and_checkpoint_round_trip(cmu_shards, tmp_path):
  c = _config(cmu_shards, steps=6, log_every=1, eval_every=3, checkpoint_every=100)
  train.train_and_evaluate(c, tmp_path / 'straight', log=lambda m: None)
  with pytest.raises(KeyboardInterrupt):
    train.train_and_evaluate(c, tmp_path / 'resumed', log=_interrupt_at(4))
  run = json.loads((tmp_path / 'resumed' / 'run.json').read_text())
  assert run['status'] == 'interrupted' and run['step'] == 4
  train.train_and_evaluate(c, tmp_path / 'resumed', log=lambda m: None)
  assert json.loads((tmp_path / 'resumed' / 'run.json').read_text())['status'] == 'done'
  a, meta_a = train.load_model(tmp_path / 'straight')
  b, meta_b = train.load_model(tmp_path / 'resumed')
  pa, pb = jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param))
  assert len(pa) == len(pb) > 0
  for x, y in zip(pa, pb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
  assert meta_a['rig']['name'] == 'cmu_body' and 'local_rot_err_deg' in meta_a['metrics']
  assert meta_a['provenance']['jax_version'] == jax.__version__
  # The restored model predicts what the metrics in its checkpoint say it does.
  ds = data.load_shards(cmu_shards, 'val')
  val = train.validate_local_rotations(
      jax.jit(lambda b: train.ikgat_infer(a, b)), ds, ml_collections.ConfigDict(meta_a['config']),
      ds.rig)
  np.testing.assert_allclose(val['local_rot_err_deg'], meta_a['metrics']['local_rot_err_deg'],
                             rtol=1e-4)


def test_checkpoint_errors_are_clear(cmu_shards, tmp_path):
  with pytest.raises(checkpointing.CheckpointError, match='no checkpoint'):
    train.load_model(tmp_path / 'nothing')
  (tmp_path / 'empty').mkdir()
  with pytest.raises(checkpointing.CheckpointError, match='no checkpoint found'):
    train.load_model(tmp_path / 'empty')


def test_ctrl_c_mid_run_saves_and_resumes(cmu_shards, tmp_path):
  """A real SIGINT to `experiments.train`: the step in flight finishes, a checkpoint is saved,
  the exit status is 130, and rerunning the same command resumes and finishes."""
  import os
  import signal
  import subprocess
  import sys
  import time
  workdir = tmp_path / 'run'
  cmd = [sys.executable, '-m', 'experiments.train', f'--data={cmu_shards}',
         f'--workdir={workdir}', '--config=experiments/configs/test.py', '--steps=100000',
         '--config.train.log_every=1', '--config.train.eval_every=100000']
  env = {**os.environ, 'PYTHONUNBUFFERED': '1'}
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  p = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
  deadline = time.time() + 120
  while time.time() < deadline:
    line = p.stdout.readline()
    if line.startswith('step 3/'):
      break
  p.send_signal(signal.SIGINT)
  out, _ = p.communicate(timeout=120)
  assert p.returncode == 130, out[-2000:]
  run = json.loads((workdir / 'run.json').read_text())
  assert run['status'] == 'interrupted' and run['step'] >= 3
  assert checkpointing.Checkpointer(workdir / 'checkpoints' / 'latest').latest_step() == \
      run['step']
  done = subprocess.run(cmd[:-3] + [f"--steps={run['step'] + 2}"], cwd=repo, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert f"resumed from" in done.stdout and json.loads(
      (workdir / 'run.json').read_text())['status'] == 'done'
