"""The one trainer: train state, jitted step, validation, logging, resumable checkpoints.

A model family plugs in as a `Task` (its model, per-example loss, validation metrics); IK-GAT is
`IKGAT_TASK` below and the pose prior brings its own. Everything else is shared:
- optax AdamW with linear warm-up and cosine decay, global-norm clipping;
- a jitted step that donates its state, per-step RNG by `jax.random.fold_in(seed_key, step)`;
- the stateless batch order of `input_pipeline.batch_indices`, so a resumed run sees exactly
  the batches of an uninterrupted one;
- periodic validation, live progress (step, loss, val error, frames/s, ETA), JSONL and
  TensorBoard logs, a run manifest (`run.json`);
- orbax checkpoints: `checkpoints/latest` (full state, for resuming) and `checkpoints/best`
  (parameters only, best validation metric), each carrying config, rig, metrics, provenance.
Library code never reads flags: `experiments/train.py` parses them and calls
`train_and_evaluate(config, workdir)`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from ik_gat_jax import checkpointing
from ik_gat_jax import data as data_lib
from ik_gat_jax import input_pipeline
from ik_gat_jax import losses
from ik_gat_jax import metrics
from ik_gat_jax import model as model_lib
from ik_gat_jax import provenance
from ik_gat_jax.skeleton import Rig


@dataclasses.dataclass(frozen=True)
class Task:
  """What the trainer needs from a model family.

  build(config, rig, rngs, train_data) -> nnx.Module.
  loss(model, batch, key, config, rig) -> (per-example loss [B], {name: [B]}), jittable; the
    batch is `input_pipeline.gather_batch`'s dict, augmentation is the task's business.
  validate(predict, data, config, rig) -> flat dict of floats (must hold `best_metric`);
    `predict(batch_dict) -> outputs` is the jitted deterministic forward of `infer`.
  infer(model, batch, config, rig) -> outputs used by `validate` (jittable, deterministic).
  """
  name: str
  build: Callable[..., nnx.Module]
  loss: Callable[..., tuple[jax.Array, dict]]
  infer: Callable[..., Any]
  validate: Callable[..., dict]
  best_metric: str


# ----------------------------------------------------------------------------------------------
# IK-GAT as a task.


def _ikgat_build(config, rig: Rig, rngs: nnx.Rngs, train_data) -> nnx.Module:
  del train_data
  return model_lib.create_model(model_lib.ModelConfig.from_dict(config.model), rig, rngs)


def _ikgat_loss(model, batch, key, config, rig):
  batch = input_pipeline.augment(batch, key, config.augment, rig)
  pred = model(batch['input_positions'], deterministic=False)
  return losses.ikgat_loss(pred, batch, rig, model.config.output_space, config.loss.alpha)


def ikgat_infer(model, batch, config=None, rig=None) -> jax.Array:
  """Deterministic forward to local rotations `[B, J, 3, 3]` (batch: positions, bone_frames)."""
  del config
  rig = rig or model.rig
  pred = model(batch['positions'], deterministic=True)
  return model_lib.to_local(pred, batch['bone_frames'], rig, model.config.output_space)


def validate_local_rotations(predict, data, config, rig: Rig) -> dict:
  """Metrics of predicted local rotations on (a fixed subset of) `data`; flat dict of floats."""
  idx = eval_indices(len(data.positions), config.train.val_frames)
  batch = input_pipeline.gather_batch(data, idx)
  pred = predict_in_chunks(predict, batch, config.train.eval_batch_size)
  errors = metrics.compute_errors_batched(pred, batch['local_rot'], batch['offsets'],
                                          batch['bone_frames'], batch['positions'], rig)
  s = metrics.summarize(errors, rig)
  flat = {k: v for k, v in s.items() if isinstance(v, float)}
  flat.update({f'local_rot_err_deg_{c}': v for c, v in s['local_rot_err_deg_by_class'].items()})
  return flat


IKGAT_TASK = Task(name='ikgat', build=_ikgat_build, loss=_ikgat_loss, infer=ikgat_infer,
                  validate=validate_local_rotations, best_metric='local_rot_err_deg')


# ----------------------------------------------------------------------------------------------
# Shared machinery.


def eval_indices(n: int, max_frames: int) -> np.ndarray:
  """A fixed, evenly spaced subset of at most `max_frames` of `n` frames."""
  if max_frames <= 0 or n <= max_frames:
    return np.arange(n)
  return np.linspace(0, n - 1, max_frames).round().astype(np.int64)


def predict_in_chunks(predict, batch: dict, chunk: int) -> np.ndarray:
  """Runs `predict` over a host batch in fixed-size chunks (last one padded: one compile)."""
  n = len(next(iter(batch.values())))
  outs = []
  for start in range(0, n, chunk):
    part = {k: v[start:start + chunk] for k, v in batch.items()}
    m = len(part['positions'])
    if m < chunk and n > chunk:
      part = {k: np.concatenate([v, np.repeat(v[-1:], chunk - m, 0)]) for k, v in part.items()}
    outs.append(np.asarray(predict(part))[:m])
  return np.concatenate(outs)


def create_optimizer(train_cfg) -> optax.GradientTransformation:
  """AdamW, linear warm-up then cosine decay to `lr * final_lr_fraction`, global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train_cfg.lr, warmup_steps=train_cfg.warmup_steps,
      decay_steps=max(train_cfg.steps, train_cfg.warmup_steps + 1),
      end_value=train_cfg.lr * train_cfg.final_lr_fraction)
  return optax.chain(optax.clip_by_global_norm(train_cfg.clip_norm),
                     optax.adamw(schedule, weight_decay=train_cfg.weight_decay))


def init_state(task: Task, config, rig: Rig, train_data):
  """Builds the model; returns (graphdef, state) with state = params, rest, opt_state, step."""
  model = task.build(config, rig, nnx.Rngs(params=config.seed, dropout=config.seed + 1),
                     train_data)
  graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
  opt_state = create_optimizer(config.train).init(params)
  state = {'params': params, 'rngs': rngs, 'rest': rest, 'opt_state': opt_state,
           'step': jnp.zeros((), jnp.int32)}
  return graphdef, state


def saved_part(state: dict, keys=('params', 'rest', 'opt_state', 'step')) -> dict:
  """What a checkpoint stores: no RNG streams (reseeded every step by `fold_in`)."""
  return {k: state[k] for k in keys}


def make_train_step(task: Task, graphdef, config, rig: Rig):
  """The jitted update: `(state, batch) -> (state, metrics)`; donates `state`."""
  tx = create_optimizer(config.train)
  base_key = jax.random.key(config.seed)

  def loss_fn(model, batch, key):
    per_example, aux = task.loss(model, batch, key, config, rig)
    return jnp.mean(per_example), {k: jnp.mean(v) for k, v in aux.items()}

  def step(state, batch):
    key = jax.random.fold_in(base_key, state['step'])
    model = nnx.merge(graphdef, state['params'], state['rngs'], state['rest'])
    nnx.reseed(model, dropout=jax.random.fold_in(key, 1))  # dropout: a function of the step
    (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
        model, batch, jax.random.fold_in(key, 0))
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    new_state = {**state, 'params': params, 'opt_state': opt_state, 'step': state['step'] + 1}
    return new_state, {'loss': loss, 'grad_norm': optax.tree.norm(grads), **aux}

  return jax.jit(step, donate_argnums=0)


def make_predict(task: Task, graphdef, config, rig: Rig):
  """Jitted deterministic forward `(params, rest, batch) -> outputs`."""

  def predict(state, batch):
    model = nnx.merge(graphdef, state['params'], state['rngs'], state['rest'])
    return task.infer(model, batch, config, rig)

  return jax.jit(predict)


class MetricWriter:
  """JSONL (always) and TensorBoard (when tensorboardX imports) logs in the workdir."""

  def __init__(self, workdir: Path):
    self.jsonl = open(workdir / 'log.jsonl', 'a')
    try:
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(str(workdir / 'tb'))
    except ImportError:  # TensorBoard logs are optional
      self.tb = None

  def write(self, step: int, kind: str, values: dict) -> None:
    self.jsonl.write(json.dumps({'step': step, 'kind': kind, 'time': time.time(), **values}) + '\n')
    self.jsonl.flush()
    if self.tb is not None:
      for k, v in values.items():
        if isinstance(v, (int, float)):
          self.tb.add_scalar(f'{kind}/{k}', v, step)
      self.tb.flush()

  def close(self) -> None:
    self.jsonl.close()
    if self.tb is not None:
      self.tb.close()


def write_json_atomic(path: Path, obj: Any) -> None:
  tmp = path.with_name(path.name + '.tmp')
  tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
  os.replace(tmp, path)


def _fmt_eta(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m' if seconds >= 3600 else \
      f'{seconds // 60}m{seconds % 60:02d}s'


def data_provenance(data) -> dict:
  """Which data a run used: shard directory, rig and split hashes, frames per split."""
  s = data.summary
  return {'data_dir': str(Path(data.path).absolute()), 'rig_sha256': s.get('rig_sha256'),
          'split_sha256': s.get('split_sha256'), 'frames': s.get('frames')}


def checkpoint_meta(config, rig: Rig, task: Task, data_info: dict, metrics_: dict) -> dict:
  return {'task': task.name, 'config': config.to_dict(), 'rig': rig.to_json(),
          'metrics': metrics_, 'data': data_info, 'command': ' '.join(sys.argv),
          'provenance': provenance.provenance(rig_hash=rig.fingerprint())}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | os.PathLike,
                       task: Task = IKGAT_TASK, log: Callable[[str], None] = print) -> dict:
  """Trains `task` on `config.data` split 'train', validating on 'val' if present.

  Rerunning with the same `workdir` resumes from `checkpoints/latest`. Returns the final
  validation metrics (or the last training metrics without a val split).
  """
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  train_data = data_lib.load_shards(config.data, 'train')
  val_data = (data_lib.load_shards(config.data, 'val')
              if 'val' in data_lib.available_splits(config.data) else None)
  rig = train_data.rig
  data_info = data_provenance(train_data)
  graphdef, state = init_state(task, config, rig, train_data)
  latest = checkpointing.Checkpointer(workdir / 'checkpoints' / 'latest', max_to_keep=1)
  best = checkpointing.Checkpointer(workdir / 'checkpoints' / 'best', max_to_keep=1)
  best_value = math.inf
  if latest.latest_step() is not None:
    saved = latest.restore_meta()
    if saved.get('config', {}).get('model') != config.to_dict().get('model'):
      raise checkpointing.CheckpointError(
          f'{workdir} holds a run with a different model config; use a new --workdir')
    restored, _ = latest.restore(checkpointing.abstract_like(saved_part(state)))
    state = {**state, **restored}
    if best.latest_step() is not None:
      best_value = best.restore_meta()['metrics'].get(task.best_metric, math.inf)
    log(f'resumed from {latest.directory} at step {int(state["step"])}')
  manifest = {'command': ' '.join(sys.argv), 'workdir': str(workdir.absolute()),
              'status': 'running', 'steps': int(config.train.steps), 'task': task.name,
              'config': config.to_dict()}
  write_json_atomic(workdir / 'run.json', {**manifest, 'step': int(state['step'])})
  (workdir / 'config.json').write_text(json.dumps(config.to_dict(), indent=1))

  train_step = make_train_step(task, graphdef, config, rig)
  predict = make_predict(task, graphdef, config, rig)
  writer = MetricWriter(workdir)
  tc = config.train
  n_train = len(train_data.positions)
  step = int(state['step'])
  last_val: dict = {}
  window_t, window_steps, window_loss = time.time(), 0, []
  start_step, start_time = step, time.time()

  def run_validation(step):
    nonlocal best_value, last_val
    if val_data is None:
      return
    t = time.time()
    last_val = task.validate(lambda b: predict(state, b), val_data,
                             config, rig)
    writer.write(step, 'val', {**last_val, 'seconds': time.time() - t})
    value = last_val[task.best_metric]
    if value < best_value:
      best_value = value
      best.save(step, saved_part(state, ('params', 'rest')),
                checkpoint_meta(config, rig, task, data_info, last_val))

  def save_latest(step, status):
    latest.save(step, saved_part(state), checkpoint_meta(config, rig, task, data_info, last_val))
    write_json_atomic(workdir / 'run.json', {**manifest, 'status': status, 'step': step,
                                             'val': last_val, 'best_value': best_value})

  log(f'training {task.name} on {n_train} frames ({rig.name}, {rig.num_joints} joints), '
      f'{tc.steps} steps of batch {tc.batch_size}, params '
      f'{sum(x.size for x in jax.tree.leaves(state["params"])):,}')
  try:
    while step < tc.steps:
      idx = input_pipeline.batch_indices(step, tc.batch_size, n_train, config.seed)
      batch = input_pipeline.gather_batch(train_data, idx)
      state, m = train_step(state, batch)
      step += 1
      window_steps += 1
      window_loss.append(m['loss'])
      if step % tc.log_every == 0 or step == tc.steps:
        m = jax.device_get(m)
        dt = time.time() - window_t
        fps = window_steps * tc.batch_size / max(dt, 1e-9)
        rate = (step - start_step) / max(time.time() - start_time, 1e-9)
        vals = {k: float(v) for k, v in m.items()}
        vals['loss'] = float(np.mean(jax.device_get(window_loss)))
        vals['frames_per_s'] = fps
        writer.write(step, 'train', vals)
        val_txt = (f' | val {task.best_metric} {last_val[task.best_metric]:.2f}'
                   if last_val else '')
        log(f'step {step}/{tc.steps} loss {vals["loss"]:.4f}{val_txt} | {fps:,.0f} frames/s '
            f'| ETA {_fmt_eta((tc.steps - step) / max(rate, 1e-9))}')
        if not np.isfinite(vals['loss']):
          raise FloatingPointError(f'loss became {vals["loss"]} at step {step}')
        window_t, window_steps, window_loss = time.time(), 0, []
      if step % tc.eval_every == 0 or step == tc.steps:
        run_validation(step)
      if step % tc.checkpoint_every == 0 and step < tc.steps:
        save_latest(step, 'running')
  except KeyboardInterrupt:
    save_latest(step, 'interrupted')
    log(f'interrupted at step {step}; checkpoint saved. Rerun the same command to resume.')
    writer.close()
    raise
  save_latest(step, 'done')
  writer.close()
  if val_data is None:
    best.save(step, saved_part(state, ('params', 'rest')),
              checkpoint_meta(config, rig, task, data_info, {}))
  log(f'done: step {step}' + (f', val {task.best_metric} {last_val[task.best_metric]:.3f} '
                              f'(best {best_value:.3f})' if last_val else ''))
  return last_val


def load_model(checkpoint_dir: str | os.PathLike, task: Task = IKGAT_TASK,
               expected_rig: Rig | None = None) -> tuple[nnx.Module, dict]:
  """Restores a trained model (parameters only) and its meta from a checkpoint directory.

  `checkpoint_dir` may be a run's workdir (uses `checkpoints/best`) or a checkpoint directory.
  """
  path = Path(checkpoint_dir)
  if (path / 'checkpoints' / 'best').is_dir():
    path = path / 'checkpoints' / 'best'
  ckpt = checkpointing.Checkpointer(path, create=False)
  meta = ckpt.restore_meta()
  if meta.get('task') != task.name:
    raise checkpointing.CheckpointError(f'{path} holds a {meta.get("task")!r} model, '
                                        f'not {task.name!r}')
  rig = Rig.from_json(meta['rig'])
  if expected_rig is not None and rig.joint_names != expected_rig.joint_names:
    raise checkpointing.CheckpointError(
        f'checkpoint {path} is for rig {rig.name!r} ({rig.num_joints} joints), not '
        f'{expected_rig.name!r} ({expected_rig.num_joints} joints)')
  config = ml_collections.ConfigDict(meta['config'])
  model = task.build(config, rig, nnx.Rngs(0), None)
  graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
  tree, _ = ckpt.restore(checkpointing.abstract_like({'params': params, 'rest': rest}))
  return nnx.merge(graphdef, tree['params'], rngs, tree['rest']), meta
