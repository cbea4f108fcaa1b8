"""The one trainer: train state, jitted step, validation, logging, resumable checkpoints.

A model family plugs in as an `inference.Task` (its model, per-example loss, validation
metrics); IK-GAT is `inference.IKGAT_TASK` and the pose prior brings its own. Everything else is
shared:
- optax AdamW with linear warm-up and cosine decay, global-norm clipping;
- a jitted step that donates its state, per-step RNG by `jax.random.fold_in(seed_key, step)`;
- the stateless batch order of `input_pipeline.batch_indices`, so a resumed run sees exactly
  the batches of an uninterrupted one, read from the memory-mapped shards on a prefetch thread;
- data parallelism (DESIGN section 8): a 1-D device mesh (axis 'data'), the global batch
  sharded along it, parameters and optimizer state replicated; the same code runs on one CPU,
  one GPU, N devices or several hosts (`initialize_distributed`, each host reading its own rows
  of the global batch). Results do not depend on the device count up to float summation order;
- optionally (`train.ema_decay` > 0) an exponential moving average of the parameters, updated
  every step (`ema_update`), which validation and the `best` checkpoint use;
- periodic validation, live progress (step, loss, val error, train and input-pipeline
  frames/s, ETA), JSONL and TensorBoard logs, a run manifest (`run.json`), written by process 0;
- orbax checkpoints: `checkpoints/latest` (full state, for resuming) and `checkpoints/best`
  (parameters only, or their average; best validation metric), each carrying config, rig,
  metrics, provenance;
  restored onto the current mesh, so a run saved on 8 devices resumes on 1.
Library code never reads flags: `experiments/train.py` parses them and calls
`train_and_evaluate(config, workdir)`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ik_gat_jax import checkpointing
from ik_gat_jax import data as data_lib
from ik_gat_jax import inference
from ik_gat_jax import input_pipeline
from ik_gat_jax import model as model_lib
from ik_gat_jax.inference import IKGAT_TASK, Task
from ik_gat_jax.io import atomic
from ik_gat_jax import provenance
from ik_gat_jax.skeleton import Rig


# ----------------------------------------------------------------------------------------------
# Devices, hosts and shardings (DESIGN section 8).


def _cluster_launch(environ: Mapping[str, str]) -> str | None:
  """The launcher whose environment says this is one process of several, or None."""
  if environ.get('JAX_COORDINATOR_ADDRESS'):
    return 'JAX_COORDINATOR_ADDRESS'
  if int(environ.get('SLURM_NTASKS', '1')) > 1 and 'SLURM_JOB_ID' in environ:
    return 'SLURM'
  if int(environ.get('OMPI_COMM_WORLD_SIZE', '1')) > 1:
    return 'Open MPI'
  if ',' in environ.get('TPU_WORKER_HOSTNAMES', ''):
    return 'multi-host Cloud TPU'
  return None


# JAX's default `initialization_timeout` (seconds), and how much later than the watchdog
# of `initialize_distributed` JAX's own deadline (a C++ abort) comes.
DISTRIBUTED_TIMEOUT_S = 300
_DEADLINE_GRACE_S = 10


def initialize_distributed(mode: str = 'auto', environ: Mapping[str, str] = os.environ,
                           timeout_s: int = DISTRIBUTED_TIMEOUT_S,
                           log: Callable[[str], None] = print) -> bool:
  """Starts `jax.distributed` for a run over several processes; call before any other JAX use.

  mode: 'on' always, 'off' never, 'auto' when a launcher's environment is present
  (`JAX_COORDINATOR_ADDRESS`; SLURM or Open MPI with more than one task; a Cloud TPU with several
  worker hosts). With `JAX_COORDINATOR_ADDRESS` (host:port of process 0), `JAX_NUM_PROCESSES`
  and `JAX_PROCESS_ID` give the process count and this process's index; otherwise JAX detects
  them from the cluster (use 'on' on a TPU VM pod slice, which JAX detects from its metadata).
  A launcher environment that cannot work (a variable missing or not a number, no cluster
  found) is a one-line ValueError naming what to set. Logs one line before connecting; when no
  cluster forms within `timeout_s` seconds (no coordinator at the address, a wrong port, a
  process missing or two with one id), prints one line to stderr and exits the process with
  status 2 (`os._exit` from a watchdog thread: JAX's own failure is a C++ abort). Returns
  whether it initialized.
  """
  if mode not in ('auto', 'on', 'off'):
    raise ValueError(f"distributed must be 'auto', 'on' or 'off', got {mode!r}")
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1:
    raise ValueError(f'--distributed_timeout must be a positive number of seconds, got '
                     f'{timeout_s!r}')
  launcher = _cluster_launch(environ)
  if mode == 'off' or (mode == 'auto' and launcher is None):
    return False
  kwargs = _coordinator_from_env(environ)
  if kwargs:
    who = (f"the coordinator {kwargs['coordinator_address']} as process {kwargs['process_id']} "
           f"of {kwargs['num_processes']}")
  else:
    who = (f'the coordinator of the {launcher} environment' if launcher else
           'the coordinator that JAX detects')
  log(f'connecting to {who} (timeout {timeout_s} s)...')
  joined = threading.Event()

  def give_up():
    if joined.is_set():
      return
    print(f'error: no cluster formed within {timeout_s} s connecting to {who}: check that '
          "process 0 runs, that every process has process 0's host and a free port in "
          'JAX_COORDINATOR_ADDRESS, the same JAX_NUM_PROCESSES and its own JAX_PROCESS_ID, or '
          'wait longer with --distributed_timeout', file=sys.stderr, flush=True)
    os._exit(2)  # pylint: disable=protected-access

  watchdog = threading.Timer(timeout_s, give_up)
  watchdog.daemon = True
  watchdog.start()
  try:  # JAX's own deadline later: the watchdog's line comes first
    jax.distributed.initialize(**kwargs, initialization_timeout=timeout_s + _DEADLINE_GRACE_S)
  except ValueError as e:  # JAX found no cluster: 'coordinator_address should be defined.' ...
    if 'defined' not in str(e):
      raise
    raise ValueError('jax.distributed found no cluster to join: set JAX_COORDINATOR_ADDRESS '
                     '(host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID on every '
                     'process, or run under SLURM, Open MPI or on a multi-host Cloud TPU '
                     f'(JAX: {e})') from None
  finally:
    joined.set()
    watchdog.cancel()
  return True


def _coordinator_from_env(environ: Mapping[str, str]) -> dict:
  """`jax.distributed.initialize`'s address, count and id from `JAX_COORDINATOR_ADDRESS`,
  `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, checked ({}: JAX detects them from the cluster)."""
  address = environ.get('JAX_COORDINATOR_ADDRESS', '')
  names = ('JAX_NUM_PROCESSES', 'JAX_PROCESS_ID')
  given = [k for k in names if environ.get(k, '') != '']
  if not address:
    if given:
      raise ValueError(f'{" and ".join(given)} set without JAX_COORDINATOR_ADDRESS: set it to '
                       'host:port of process 0 on every process')
    return {}
  if not given and _cluster_launch({k: v for k, v in environ.items()
                                    if k != 'JAX_COORDINATOR_ADDRESS'}):
    return {}  # the count and the id come from SLURM, Open MPI or the TPU's metadata
  missing = [k for k in names if k not in given]
  if missing:
    raise ValueError(f'JAX_COORDINATOR_ADDRESS is set ({address}) but {" and ".join(missing)} '
                     f'{"is" if len(missing) == 1 else "are"} not: set JAX_NUM_PROCESSES (the '
                     "process count) and JAX_PROCESS_ID (this process's index, 0 to count - 1) "
                     'on every process')
  host, _, port = address.rpartition(':')
  if not host or not port.isdigit():
    raise ValueError(f'JAX_COORDINATOR_ADDRESS must be host:port (process 0\'s host and a free '
                     f'port), got {address!r}')
  values = {}
  for k in names:
    v = environ[k].strip()
    if not (v.isdigit() and (k == 'JAX_PROCESS_ID' or int(v) >= 1)):
      what = ("a whole number, this process's index from 0" if k == 'JAX_PROCESS_ID' else
              'a positive whole number, the process count')
      raise ValueError(f'{k} must be {what}, got {environ[k]!r}')
    values[k] = int(v)
  n, i = values['JAX_NUM_PROCESSES'], values['JAX_PROCESS_ID']
  if i >= n:
    raise ValueError(f'JAX_PROCESS_ID={i} but JAX_NUM_PROCESSES={n}: the ids are 0 to {n - 1}')
  return dict(coordinator_address=address, num_processes=n, process_id=i)


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A 1-D mesh, axis 'data', over `devices` (default: every device of every process)."""
  return Mesh(np.asarray(jax.devices() if devices is None else list(devices)), ('data',))


def replicated(mesh: Mesh) -> NamedSharding:
  """Every device holds the whole array (parameters, optimizer state, metrics)."""
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """The leading (batch) axis split over the mesh's 'data' axis."""
  return NamedSharding(mesh, PartitionSpec('data'))


def check_batch_size(batch_size: int, mesh: Mesh) -> None:
  """A global batch must split evenly over the devices (and so over the processes)."""
  if batch_size % mesh.size:
    raise ValueError(f'batch size {batch_size} is not divisible by the {mesh.size} devices of '
                     f'the mesh; use a multiple of {mesh.size}')


def place_state(state: Any, mesh: Mesh) -> Any:
  """The train state replicated over `mesh`; its arrays are this process's copies (equal on all
  processes, e.g. built from the same seed), which go through the host once."""
  return jax.tree.map(lambda x: _replicate(x, replicated(mesh)), state)


def _replicate(x: Any, sharding: NamedSharding) -> jax.Array:
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed keys go as their raw key data
    data = _replicate(jax.random.key_data(x), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  # Not `jax.device_put`: with several processes it refuses committed single-device arrays.
  return jax.make_array_from_process_local_data(sharding, np.asarray(x), np.shape(x))


def to_global(batch: dict[str, np.ndarray], mesh: Mesh, global_rows: int) -> dict[str, jax.Array]:
  """This process's host rows -> global arrays `[global_rows, ...]` sharded along 'data'.

  Process p passes rows `input_pipeline.process_rows(global_rows, p, P)`; when
  `len(batch) == global_rows` every process passes the same whole batch (validation).
  """
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v, (global_rows,) + v.shape[1:])
          for k, v in batch.items()}


def sharded_predict(predict: Callable, state: dict, mesh: Mesh) -> Callable[[dict], Any]:
  """`predict(state, batch)` on a host batch every process holds whole, sharded over `mesh`.

  Pads the batch to a multiple of the device count and returns host arrays of its own length.
  """

  def run(batch: dict) -> Any:
    n = len(next(iter(batch.values())))
    pad = -n % mesh.size
    if pad:
      batch = {k: np.concatenate([v, np.repeat(v[-1:], pad, 0)]) for k, v in batch.items()}
    out = predict(state, to_global(batch, mesh, n + pad))
    return jax.tree.map(lambda x: np.asarray(x)[:n], out)

  return run


# ----------------------------------------------------------------------------------------------
# Shared machinery.


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
  if ema_decay(config.train):
    state['ema'] = copy_tree(params)
  return graphdef, state


def ema_decay(train_cfg) -> float:
  """`train.ema_decay`: 0 (or absent, as in configs written before it) = no average."""
  d = float(train_cfg.get('ema_decay', 0.0) or 0.0)
  if not 0.0 <= d < 1.0:
    raise ValueError(f'train.ema_decay must be in [0, 1), got {d}')
  return d


def copy_tree(tree: Any) -> Any:
  """A copy with its own buffers (the train step donates the state)."""
  return jax.tree.map(jnp.copy, tree)


def ema_update(ema: Any, params: Any, step: jax.Array, decay: float) -> Any:
  """One step of the parameters' exponential moving average, after update number `step` (1 for
  the first): `ema <- d ema + (1 - d) params` with `d = min(decay, (1 + step) / (10 + step))`,
  so the first updates are not dominated by the initialisation (the warm-up of TensorFlow's
  ExponentialMovingAverage with num_updates)."""
  t = step.astype(jnp.float32)
  d = jnp.minimum(decay, (1.0 + t) / (10.0 + t))
  return jax.tree.map(lambda e, p: (d * e + (1 - d) * p).astype(e.dtype), ema, params)


def evaluated_part(state: dict) -> dict:
  """The state validation and the `best` checkpoint use: the moving average of the parameters
  in place of the parameters when the run keeps one (`train.ema_decay`)."""
  return {**state, 'params': state['ema']} if 'ema' in state else state


def warm_start_params(params: Any, source: str | os.PathLike, task: Task
                      ) -> tuple[Any, dict[str, int]]:
  """`params` with every leaf taken from the trained model at `source` (a run or checkpoint
  directory of `task`) where the path matches: equal shapes are copied; a leaf that only grew
  (each dimension >= the source's, e.g. the input projection of a model with more input
  channels, issue K's window) gets the source in its leading block and zeros elsewhere, so the
  new model starts as the source's function of its old inputs. Other leaves keep their
  initialisation. Returns (params, counts of 'copied', 'grown', 'kept')."""
  model, _ = inference.load_model(source, task)
  src = {jax.tree_util.keystr(k): v for k, v in
         jax.tree_util.tree_flatten_with_path(nnx.split(model, nnx.Param, ...)[1])[0]}
  counts = {'copied': 0, 'grown': 0, 'kept': 0}

  def take(path, leaf):
    old = src.get(jax.tree_util.keystr(path))
    if old is None or old.ndim != leaf.ndim or any(a > b for a, b in zip(old.shape, leaf.shape)):
      counts['kept'] += 1
      return leaf
    if old.shape == leaf.shape:
      counts['copied'] += 1
      return jnp.asarray(old, leaf.dtype)
    counts['grown'] += 1
    return jnp.zeros_like(leaf).at[tuple(slice(0, n) for n in old.shape)].set(old)

  return jax.tree_util.tree_map_with_path(take, params), counts


def load_teacher(source: str | os.PathLike, task: Task, config, rig: Rig) -> nnx.Module:
  """The trained model at `source` as a distillation teacher for `config`'s model (issue N:
  a cheaper student at the base model's accuracy). It must be for the same rig and predict in
  the same output space and chart (the loss compares the outputs directly) and take the same
  inputs (window, masks, sparse inputs); its size may differ."""
  if config.train.get('distill_mirror', False):
    inference.check_mirror_averaging(rig, 'set --config.train.distill_mirror=False')
  teacher, meta = inference.load_model(source, task, expected_rig=rig)
  mine = model_lib.ModelConfig.from_dict(config.model)
  theirs = teacher.config
  keys = ('output_space', 'bone_chart', 'window', 'window_fps', 'joint_mask',
          'orientation_inputs', 'end_sites')
  diff = [k for k in keys if getattr(mine, k) != getattr(theirs, k)]
  if diff:
    raise ValueError(f'distillation teacher {source} differs from this model in '
                     + ', '.join(f'{k} ({getattr(theirs, k)!r} vs {getattr(mine, k)!r})'
                                 for k in diff) + ': its outputs cannot be the targets')
  if config.train.get('distill_mirror', False) and (theirs.orientation_inputs or
                                                    theirs.end_sites):
    raise ValueError(f'train.distill_mirror: teacher {source} takes orientations or end sites, '
                     'which mirror averaging cannot mirror: set '
                     '--config.train.distill_mirror=False')
  del meta
  return teacher


def saved_part(state: dict, keys=('params', 'rest', 'opt_state', 'step', 'ema')) -> dict:
  """What a checkpoint stores: no RNG streams (reseeded every step by `fold_in`); the moving
  average when the run keeps one."""
  return {k: state[k] for k in keys if k in state}


def make_train_step(task: Task, graphdef, config, rig: Rig, mesh: Mesh | None = None,
                    teacher: nnx.Module | None = None, stop_flags: bool = False):
  """The jitted update: `(state, batch) -> (state, metrics)`; donates `state`.

  `stop_flags` (several processes, `train_and_evaluate`): the update takes a third argument,
  `stop_flags(mesh, flag)` of every process, and its metrics carry 'stop', the number of
  devices whose process's flag was set, equal on all processes: a float summed in the step's
  gradient all-reduce (XLA combines the two), no collective of its own.

  `teacher` (distillation, `config.train.distill_from`; `load_teacher`): a trained model whose
  deterministic output on the same augmented inputs the task's loss also matches (its
  parameters are constants of the compiled step, never updated).

  `batch` (global leading axis B) is sharded along `mesh`'s 'data' axis (default: all devices),
  state and metrics are replicated; XLA inserts the gradient all-reduce. Random numbers
  (augmentation, dropout) are drawn for the logical global batch, so they do not depend on the
  number of devices.
  """
  mesh = make_mesh() if mesh is None else mesh
  tx = create_optimizer(config.train)
  decay = ema_decay(config.train)
  base_key = jax.random.key(config.seed)

  teach = {} if teacher is None else {'teacher': teacher}

  def loss_fn(model, batch, key):
    per_example, aux = task.loss(model, batch, key, config, rig, **teach)
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
    if 'ema' in state:
      new_state['ema'] = ema_update(state['ema'], params, new_state['step'], decay)
    return new_state, {'loss': loss, 'grad_norm': optax.tree.norm(grads), **aux}

  if stop_flags:
    def step_and_stop(state, batch, stop):
      state, metrics_ = step(state, batch)
      return state, {**metrics_, 'stop': jnp.sum(stop.astype(jnp.float32))}

    return jax.jit(step_and_stop, donate_argnums=0, out_shardings=replicated(mesh),
                   in_shardings=(replicated(mesh), batch_sharding(mesh), batch_sharding(mesh)))
  return jax.jit(step, donate_argnums=0, in_shardings=(replicated(mesh), batch_sharding(mesh)),
                 out_shardings=replicated(mesh))


def stop_flags(mesh: Mesh, flag: bool) -> jax.Array:
  """This process's stop flag as its rows of a global int32 `[mesh.size]` (one per device)."""
  local = np.full(len(mesh.local_devices), int(flag), np.int32)
  return jax.make_array_from_process_local_data(batch_sharding(mesh), local, (mesh.size,))


def make_predict(task: Task, graphdef, config, rig: Rig, mesh: Mesh | None = None):
  """Jitted deterministic forward `(state, batch) -> outputs`: batch sharded, outputs replicated.

  The batch's leading axis must divide by the device count (`sharded_predict` pads).
  """
  mesh = make_mesh() if mesh is None else mesh

  def predict(state, batch):
    model = nnx.merge(graphdef, state['params'], state['rngs'], state['rest'])
    return task.infer(model, batch, config, rig)

  return jax.jit(predict, in_shardings=(replicated(mesh), batch_sharding(mesh)),
                 out_shardings=replicated(mesh))


def model_config_diff(saved: Mapping | None, current: Mapping | None) -> list[str]:
  """The fields in which two model configs differ as JSON (sorted), a field missing from a
  checkpoint made before it existed counting as its default (`ModelConfig`'s, e.g. window 1)
  or, for a field ModelConfig does not have, its off value (False, empty list, None)."""
  a, b = (json.loads(json.dumps(dict(x or {}))) for x in (saved, current))
  off = (False, [], None, '')
  defaults = json.loads(json.dumps(model_lib.ModelConfig().to_dict()))
  absent = lambda k, v: v == defaults[k] if k in defaults else v in off
  return sorted([k for k in set(a) ^ set(b) if not absent(k, (a if k in a else b)[k])] +
                [k for k in set(a) & set(b) if a[k] != b[k]])


def same_model_config(saved: Mapping | None, current: Mapping | None) -> bool:
  """Model configs equal as JSON, a field missing from a checkpoint made before it existed
  counting as its default (`model_config_diff`)."""
  return not model_config_diff(saved, current)


def _config_diff_text(saved: Mapping | None, current: Mapping | None, keys: list[str]) -> str:
  """'hidden: checkpoint 64, this config 32; ...' (values cut short: one line)."""
  a, b = dict(saved or {}), dict(current or {})
  val = lambda d, k: f'{d[k]!r:.40}' if k in d else '(absent)'
  text = '; '.join(f'{k}: checkpoint {val(a, k)}, this config {val(b, k)}' for k in keys[:4])
  return text + (f' (+{len(keys) - 4} more)' if len(keys) > 4 else '')


class MetricWriter:
  """JSONL (always) and TensorBoard (when tensorboardX imports) logs in the workdir.

  `enabled=False` (processes other than 0 of a multi-host run) writes nothing.
  """

  def __init__(self, workdir: Path, enabled: bool = True):
    self.jsonl, self.tb = None, None
    if not enabled:
      return
    self.jsonl = open(workdir / 'log.jsonl', 'a')
    try:
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(str(workdir / 'tb'))
    except ImportError:  # TensorBoard logs are optional
      self.tb = None

  def write(self, step: int, kind: str, values: dict) -> None:
    if self.jsonl is None:
      return
    row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)  # JSON: no NaN
           for k, v in {'step': step, 'kind': kind, 'time': time.time(), **values}.items()}
    self.jsonl.write(json.dumps(row) + '\n')
    self.jsonl.flush()
    if self.tb is not None:
      for k, v in values.items():
        if isinstance(v, (int, float)):
          self.tb.add_scalar(f'{kind}/{k}', v, step)
      self.tb.flush()

  def close(self) -> None:
    if self.jsonl is not None:
      self.jsonl.close()
    if self.tb is not None:
      self.tb.close()


def _wants_end_sites(config) -> bool:
  """Training batches carry end sites (issue G2) when augmentation may give them to the model."""
  return float(config.get('augment', {}).get('end_site_prob', 0.0)) > 0


def check_window_fps(config, train_data) -> None:
  """A window model (issue K) trains on windows of k consecutive frames of the shards, so its
  `window_fps` must be their rate: a ValueError naming both otherwise."""
  if inference.window_of(config) > 1:
    fps = float(config.model.get('window_fps', 30.0))
    if abs(fps - train_data.fps) > 1e-6 * fps:
      raise ValueError(f'model.window_fps={fps:g} but {config.data} is at {train_data.fps:g} '
                       f'fps: set --config.model.window_fps={train_data.fps:g}')


def _fmt_eta(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m' if seconds >= 3600 else \
      f'{seconds // 60}m{seconds % 60:02d}s'


def checkpoint_meta(config, rig: Rig, task: Task, data_info: dict, metrics_: dict) -> dict:
  return {'task': task.name, 'config': config.to_dict(), 'rig': rig.to_json(),
          'metrics': metrics_, 'data': data_info, 'command': provenance.command_line(),
          'provenance': provenance.provenance(rig_hash=rig.fingerprint())}


def command_history(run: dict | None, step: int, steps: int) -> list[dict]:
  """The commands a run was trained by, each `{'command', 'from_step', 'steps'}`: `run`'s
  (run.json's, None for a new run; one that predates the history counts its command as the
  first) and this one, from `step` to `steps`, where its command or steps differ from the last
  (a run extended with a higher --steps: its last command alone does not reproduce it, its
  learning rate having decayed over the first count). A plain resume adds nothing."""
  now = {'command': provenance.command_line(), 'from_step': int(step), 'steps': int(steps)}
  if not run:
    return [now]
  history = list(run.get('history') or [{'command': run.get('command'), 'from_step': 0,
                                          'steps': run.get('steps')}])
  last = history[-1]
  if (last.get('command'), last.get('steps')) != (now['command'], now['steps']):
    history.append(now)
  return history


def export_latest(workdir: str | os.PathLike, output: str | os.PathLike, part: str = 'params',
                  task: Task = IKGAT_TASK) -> int:
  """Writes `part` ('params' or 'ema') of a run's `checkpoints/latest` as a model checkpoint at
  `output` (what `inference.load_model` and every command taking --checkpoint read). For a run
  with a moving average (`train.ema_decay`) whose `best` holds the average, 'params' gives the
  raw parameters of the same step, for comparing the two. The meta is latest's with `metrics`
  emptied (they were measured on the other part) and `exported_from` added. Returns the step."""
  src = checkpointing.Checkpointer(Path(workdir) / 'checkpoints' / 'latest', create=False)
  meta = src.restore_meta()
  config = ml_collections.ConfigDict(meta['config'])
  rig = Rig.from_json(meta['rig'])
  if part not in ('params', 'ema'):
    raise ValueError(f"part must be 'params' or 'ema', got {part!r}")
  has_ema = ema_decay(config.train) > 0
  if part == 'ema' and not has_ema:
    raise ValueError(f'{workdir} keeps no moving average (train.ema_decay is 0)')
  _, params, _, rest = inference.abstract_model(config, rig, task)
  want = inference.on_one_device({
      'params': params, 'rest': rest,
      'opt_state': jax.eval_shape(create_optimizer(config.train).init, params),
      'step': jax.ShapeDtypeStruct((), jnp.int32), **({'ema': params} if has_ema else {})})
  output = Path(output)
  if output.exists() and not _exported_latest(output):
    raise ValueError(f'{output} exists and is not an export_latest output (a run\'s checkpoint, '
                     'an export with its card, another folder): give a new --output')
  tree, _ = src.restore(want)
  step = int(tree['step'])
  # Written beside it and swapped in whole: an earlier export replaced, nothing half-written.
  tmp = output.parent / f'.{output.name}.tmp-{os.getpid()}'
  shutil.rmtree(tmp, ignore_errors=True)
  try:
    out = checkpointing.Checkpointer(tmp, max_to_keep=1)
    out.save(step, {'params': tree[part], 'rest': tree['rest']},
             {**meta, 'metrics': {}, 'exported_from': {'run': str(workdir), 'part': part,
                                                       'step': step}})
    if output.exists():
      shutil.rmtree(output)
    os.replace(tmp, output)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return step


def _exported_latest(path: Path) -> bool:
  """Whether `path` is a folder `export_latest` wrote (its checkpoint's meta says so, and it
  holds nothing else: no card, no run), which a new export may replace."""
  if not path.is_dir() or any(not p.name.isdigit() for p in path.iterdir()):
    return False
  try:
    return 'exported_from' in checkpointing.Checkpointer(path, create=False).restore_meta()
  except Exception:  # pylint: disable=broad-except  (not a checkpoint: not one to replace)
    return False


class GracefulStop:
  """Ctrl-C / SIGTERM during training: finish the step in flight, then stop as if interrupted.

  The jitted step donates the state, so an interrupt raised inside it would leave nothing to
  save. The first signal only sets a flag that `watch` checks between steps; a second Ctrl-C
  interrupts at once (the last checkpoint on disk then stands). With several processes the
  trainer sends the flag with every step instead (`make_train_step`'s `stop_flags`), so that
  all stop after the same step. Handlers are installed only in the main thread and restored
  by `restore`.
  """

  def __init__(self, log: Callable[[str], None]):
    self.requested, self._log, self._old = False, log, {}
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        self._old[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    if self.requested and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.requested = True
    self._log('stop requested: finishing this step, then saving a checkpoint '
              '(Ctrl-C again to stop at once)')

  def watch(self, iterable):
    for item in iterable:
      if self.requested:
        raise KeyboardInterrupt
      yield item

  def restore(self) -> None:
    for sig, handler in self._old.items():
      signal.signal(sig, handler)
    self._old = {}


LOCK_FILE = '.lock'


def hold_workdir(workdir: Path):
  """Locks `workdir` for this process's training (`fcntl.flock` on WORKDIR/.lock, which the
  kernel releases when the process ends, so a killed run still resumes); the open file, held
  while the lock is. A second training of the same workdir is refused, naming the first (two
  ran side by side, deleting each other's checkpoints, and one's log was lost)."""
  import fcntl  # pylint: disable=import-outside-toplevel  (POSIX; Windows has none)
  f = open(workdir / LOCK_FILE, 'a+')  # pylint: disable=consider-using-with
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    f.seek(0)
    holder = f.read().strip() or 'another process'
    f.close()
    raise ValueError(f'{workdir} is being trained by {holder}: wait for it or stop it, or use '
                     'a new --workdir') from None
  f.seek(0)
  f.truncate()
  f.write(f'process {os.getpid()} on {socket.gethostname()} since '
          f'{time.strftime("%Y-%m-%d %H:%M:%S")}\n')
  f.flush()
  return f


class TrainingDiverged(ValueError):
  """The training loss became NaN or infinite (one line on the command line, run.json
  'failed')."""


class _AllStop(KeyboardInterrupt):
  """The stop all processes of a run agreed on (`train_and_evaluate`)."""


def _is_deleted(tree) -> bool:
  return any(getattr(x, 'is_deleted', lambda: False)() for x in jax.tree.leaves(tree)
             if isinstance(x, jax.Array))


# The train config fields that must be positive integers / non-negative integers, and the
# float fields that must be finite and positive / non-negative (absent ones are not checked).
_POSITIVE_INTS = ('steps', 'batch_size', 'log_every', 'eval_every', 'checkpoint_every',
                  'eval_batch_size', 'prefetch')
_NON_NEGATIVE_INTS = ('warmup_steps', 'val_frames')  # val_frames 0: every val frame
_POSITIVE_FLOATS = ('lr', 'clip_norm')
_NON_NEGATIVE_FLOATS = ('final_lr_fraction', 'weight_decay')


def check_train_config(train_cfg, prefix: str = 'train') -> None:
  """Refuses (one-line ValueError naming `prefix`.field) values that cannot train: zero or
  negative steps, batch size, intervals; a learning rate or clip norm <= 0 (or NaN); a negative
  warm-up, weight decay or final lr fraction. Called before anything is written."""

  def bad(key, what):
    raise ValueError(f'{prefix}.{key} must be {what}, got {train_cfg[key]!r}')

  is_int = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool)  # noqa: E731
  is_num = lambda v: is_int(v) or isinstance(v, (float, np.floating))  # noqa: E731
  for key in _POSITIVE_INTS + _NON_NEGATIVE_INTS + _POSITIVE_FLOATS + _NON_NEGATIVE_FLOATS:
    if key not in train_cfg:
      continue
    v = train_cfg[key]
    if key in _POSITIVE_INTS and not (is_int(v) and v >= 1):
      bad(key, 'a positive integer')
    if key in _NON_NEGATIVE_INTS and not (is_int(v) and v >= 0):
      bad(key, 'an integer >= 0')
    if key in _POSITIVE_FLOATS and not (is_num(v) and v > 0 and (
        math.isfinite(v) or key == 'clip_norm')):  # clip_norm inf: no clipping
      bad(key, 'a positive number')
    if key in _NON_NEGATIVE_FLOATS and not (is_num(v) and math.isfinite(v) and v >= 0):
      bad(key, 'a number >= 0')
  if 'final_lr_fraction' in train_cfg and train_cfg['final_lr_fraction'] > 1:
    bad('final_lr_fraction', 'a fraction of the learning rate in [0, 1]')


# augment fields that are probabilities or shares (input_pipeline; the default config's notes)
_AUGMENT_FRACTIONS = ('mirror', 'clean_frac', 'joint_dropout', 'tracker_subsets',
                      'orientation_prob', 'full_frames', 'end_site_prob', 'outlier_prob',
                      'hold_prob', 'window_start_prob')
# augment fields in mm, degrees or a relative std: any number >= 0
_AUGMENT_AMOUNTS = ('noise_mm', 'noise_mm_max', 'bone_jitter', 'bone_scale', 'tilt_deg',
                    'bias_mm')


def check_augment_config(aug, prefix: str = 'augment') -> None:
  """Refuses (one-line ValueError naming `prefix`.field) augmentation values that mean
  nothing: a probability or share outside [0, 1] (`mirror=1.5` mirrored every sample, said
  nothing), an amount below 0 or not finite."""
  for key in _AUGMENT_FRACTIONS + _AUGMENT_AMOUNTS:
    if key not in aug:
      continue
    v = aug[key]
    num = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
    if key in _AUGMENT_FRACTIONS and not (num and 0.0 <= v <= 1.0):
      raise ValueError(f'{prefix}.{key} must be a probability in [0, 1], got {v!r}')
    if key in _AUGMENT_AMOUNTS and not (num and math.isfinite(v) and v >= 0):
      raise ValueError(f'{prefix}.{key} must be a number >= 0, got {v!r}')


def _finite_or_none(x):
  """JSON has no Infinity or NaN (strict parsers refuse them): such floats become null."""
  if isinstance(x, dict):
    return {k: _finite_or_none(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_finite_or_none(v) for v in x]
  if isinstance(x, (float, np.floating)) and not math.isfinite(x):
    return None
  return x


def _write_run_json(workdir: Path, doc: dict) -> None:
  """run.json, strict JSON: `best_value` is null while nothing was validated."""
  atomic.write_json(workdir / 'run.json', _finite_or_none(doc), allow_nan=False)


def read_run(workdir: str | os.PathLike) -> dict | None:
  """`workdir`'s run.json (None without one); `best_value` null (no validation yet) reads as
  None, and as infinity in files written before it was null."""
  path = Path(workdir) / 'run.json'
  if not path.is_file():
    return None
  try:
    doc = json.loads(path.read_text())
  except ValueError as e:
    raise ValueError(f'{path} is not JSON ({e}): a damaged run record; put it back, or use a '
                     'new --workdir') from None
  if doc.get('best_value') is not None and not math.isfinite(doc['best_value']):
    doc['best_value'] = None
  return doc


def _checkpoint_step(directory: Path) -> int | None:
  """The newest step in a checkpoint directory, None without one (creates nothing)."""
  if not directory.is_dir():
    return None
  return checkpointing.Checkpointer(directory, max_to_keep=1, create=False).latest_step()


def trained_step(workdir: str | os.PathLike) -> int | None:
  """The step of `workdir`'s `checkpoints/latest` (what a rerun resumes from), or None."""
  return _checkpoint_step(Path(workdir) / 'checkpoints' / 'latest')


def finished_run(workdir: str | os.PathLike, steps: int) -> dict | None:
  """`workdir`'s run.json when it records a run finished at exactly `steps` steps whose latest
  and best checkpoints are on disk (a rerun has nothing to do), else None."""
  workdir = Path(workdir)
  run = read_run(workdir)
  if run is None or run.get('status') != 'done' or run.get('step') != steps:
    return None
  if trained_step(workdir) != steps or _checkpoint_step(workdir / 'checkpoints' / 'best') is None:
    return None
  return run


# What a rerun may change and still resume the run (`_check_resumable`): `train.steps` (not
# below the step it is trained to; the cosine schedule then decays over the new count); how
# often it logs, validates and saves, and how it reads and batches (`log_every`, `eval_every`,
# `checkpoint_every`, `prefetch`, `eval_batch_size`): the parameters train the same; and
# `ema_decay`, whether validation and `best` use a moving average of the parameters (the
# parameters train the same; a log line says what happens to the average). The data is
# compared by content (`_check_same_data`), not by path, so moved shards resume.
RESUME_MAY_CHANGE = ('data', 'train.steps', 'train.log_every', 'train.eval_every',
                     'train.checkpoint_every', 'train.prefetch', 'train.eval_batch_size',
                     'train.ema_decay')


def _flat(d: Mapping, prefix: str = '') -> dict:
  """{'a': {'b': 1}} -> {'a.b': 1}, as JSON values (tuples as lists)."""
  out = {}
  for k, v in json.loads(json.dumps(dict(d))).items():
    if isinstance(v, dict) and v:
      out.update(_flat(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


def training_config_diff(saved: Mapping | None, current: Mapping | None) -> list[str]:
  """The dotted keys (sorted) in which two run configs differ outside `model`
  (`model_config_diff`) and `RESUME_MAY_CHANGE`; a key one of them lacks (a config written
  before it existed) counts as equal when the other's value is off (False, 0, None, '', [])."""
  a, b = (_flat({k: v for k, v in dict(x or {}).items() if k != 'model'})
          for x in (saved, current))
  off = lambda v: v in (False, None, '', [], {})  # noqa: E731  (0 == False)
  return sorted(k for k in set(a) | set(b) if k not in RESUME_MAY_CHANGE and (
      (a[k] != b[k]) if k in a and k in b else not off(a[k] if k in a else b[k])))


def _check_resumable(workdir: Path, config) -> dict | None:
  """The meta of `workdir`'s latest checkpoint (None for a fresh run; a CheckpointError where
  the latest is gone but run.json or a best checkpoint say a run was there); a ValueError when it is
  trained past `train.steps` or its config differs outside `RESUME_MAY_CHANGE` (naming the
  keys), a CheckpointError when its model config differs. Writes nothing, so a refused rerun
  leaves the run as it was."""
  step = trained_step(workdir)
  if step is None:
    run = read_run(workdir)
    best = _checkpoint_step(workdir / 'checkpoints' / 'best')
    if (run or {}).get('status') in ('running', 'failed') and not (run or {}).get('step'):
      return None  # killed (or diverged) before its first checkpoint: nothing to resume
    if (run or {}).get('step') or best is not None:  # a fresh run would overwrite what is left
      raise checkpointing.CheckpointError(
          f'{workdir} holds a run (run.json at step {(run or {}).get("step")}, best checkpoint '
          f'{"at step " + str(best) if best is not None else "none"}) but no checkpoint in '
          f'{workdir / "checkpoints" / "latest"} to resume from (deleted, or a save left '
          'unfinished): put it back, or use a new --workdir')
    return None
  steps = int(config.train.steps)
  if step > steps:
    raise ValueError(f'{workdir} is already trained to step {step}, more than --steps={steps} '
                     f'(train.steps): rerun with --steps={step} or more to resume it, or use a '
                     'new --workdir')
  latest = checkpointing.Checkpointer(workdir / 'checkpoints' / 'latest', create=False)
  saved = latest.restore_meta()
  saved_model = (saved.get('config') or {}).get('model')
  diff = model_config_diff(saved_model, config.to_dict().get('model'))
  if diff:  # refuse: resuming would crash on shapes or silently mix two models
    raise checkpointing.CheckpointError(
        f'{workdir} holds a run with a different model config (checkpoint '
        f'{latest.directory} step {step}; '
        f'{_config_diff_text(saved_model, config.to_dict().get("model"), diff)}): '
        'use a new --workdir, or the model config of that run to resume it')
  old, new = _flat(saved.get('config') or {}), _flat(config.to_dict())
  diff = training_config_diff(saved.get('config'), config.to_dict())
  if diff:  # resuming would make one run of two recipes, recorded as the second
    val = lambda d, k: f'{json.dumps(d[k])[:40]}' if k in d else '(absent)'  # noqa: E731
    was = ', '.join(f'--config.{k}={val(old, k)} (this config {val(new, k)})' for k in diff[:4])
    more = f' (+{len(diff) - 4} more)' if len(diff) > 4 else ''
    command = (read_run(workdir) or {}).get('command')
    raise ValueError(f'{workdir} was trained with {was}{more}: rerun ' + (
        f'its command (run.json: {command})' if command else 'with its config (the overrides '
        f'of {workdir / "config.json"}, a record, not a --config file)')
        + ' to resume it, or use a new --workdir')
  return saved


def _check_same_data(workdir: Path, saved: dict | None, data_info: dict) -> None:
  """A ValueError when the run `saved` (its latest checkpoint's meta; None: a fresh run) was
  trained on other shards than `data_info` (`provenance.data_provenance`): another rig, split
  or frame counts; the same shards at another path resume."""
  if saved is None or not saved.get('data'):
    return
  was = saved['data']
  diff = [k.removesuffix('_sha256') for k in ('rig_sha256', 'split_sha256', 'frames')
          if k in was and was[k] != data_info.get(k)]
  if diff:
    same = Path(str(was.get('data_dir'))).resolve() == Path(data_info['data_dir']).resolve()
    fix = ('the shards there have changed since (files added or converted again): convert '
           'the new ones to a new folder, or use a new --workdir' if same else
           'rerun with that --data to resume it, or use a new --workdir')
    raise ValueError(f'{workdir} was trained on other data ({was.get("data_dir")}; its '
                     f'{", ".join(diff)} differ from {data_info["data_dir"]}\'s): {fix}')


def _load_splits(data_dir: str) -> tuple[data_lib.Dataset, data_lib.Dataset | None]:
  """The train split of `data_dir` and its val split (None without one); a ValueError when the
  train split has no frames."""
  train_data = data_lib.load_shards(data_dir, 'train')
  if not len(train_data):
    raise ValueError(f'the train split of {data_dir} has 0 frames: nothing to train on')
  val_data = (data_lib.load_shards(data_dir, 'val')
              if 'val' in data_lib.available_splits(data_dir) else None)
  return train_data, val_data


def _allgather(x: np.ndarray) -> np.ndarray:
  """`x` of every process, stacked in process order (a collective: every process calls it)."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return np.asarray(multihost_utils.process_allgather(np.asarray(x)))


def _processes_text(ids: Sequence[int]) -> str:
  return f'process{"es" if len(ids) > 1 else ""} {", ".join(map(str, ids))}'


def _check_shared_workdir(workdir: Path, wait_s: float = 3.0) -> None:
  """With several processes: a ValueError on every process unless each sees the file that
  process 0 writes into `workdir` (or into its nearest existing parent, before the run makes
  it), waiting up to `wait_s` for a slow file system. All processes write checkpoints into one
  folder together; one that does not share it hangs the first save. The file is removed."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  probe_dir = workdir.absolute()
  while not probe_dir.is_dir() and probe_dir != probe_dir.parent:
    probe_dir = probe_dir.parent
  token = os.urandom(8).hex() if jax.process_index() == 0 else '0' * 16
  token = bytes(np.asarray(multihost_utils.broadcast_one_to_all(
      np.frombuffer(bytes.fromhex(token), np.uint8))).astype(np.uint8)).hex()
  probe = probe_dir / f'.ik_gat_jax_probe_{token}'  # a new name: no cached lookup of it
  if jax.process_index() == 0:
    probe.write_text('every process of a run must see this file; it is removed at once\n')
  multihost_utils.sync_global_devices('ik_gat_jax workdir probe written')
  deadline = time.time() + wait_s
  while not probe.is_file() and time.time() < deadline:
    time.sleep(0.2)
  seen = _allgather(np.int32(probe.is_file()))
  if jax.process_index() == 0:
    probe.unlink(missing_ok=True)
  blind = [p for p, ok in enumerate(seen) if not ok]
  if blind:
    raise ValueError(f'--workdir {workdir} is not shared by all {len(seen)} processes: '
                     f'{_processes_text(blind)} cannot see the file process 0 wrote there '
                     f'({probe_dir} here); put it on a file system every host mounts at the same '
                     'path (all processes write the checkpoints there together)')


def _check_data_of_every_process(data_info: dict | None, error: BaseException | None) -> None:
  """With several processes: re-raises this process's `error` (loading its shards), else a
  ValueError on every process when another could not load its shards or holds other ones than
  process 0 (rig, split or frame counts of `provenance.data_provenance` differ), naming it."""
  fields = ('rig_sha256', 'split_sha256', 'frames')
  digest = np.zeros(1 + len(fields), np.int32)
  if error is None:
    digest[1:] = [int.from_bytes(hashlib.sha256(json.dumps(data_info[k], sort_keys=True)
                                                .encode()).digest()[:3], 'little')
                  for k in fields]
  else:
    digest[0] = 1
  every = _allgather(digest)
  if error is not None:
    raise error
  failed = [p for p in range(len(every)) if every[p, 0]]
  if failed:
    raise ValueError(f'{_processes_text(failed)} could not load the shards (see the error '
                     'there): every host needs a copy of the same shards')
  other = [p for p in range(len(every)) if (every[p] != every[0]).any()]
  if other:
    which = [k.removesuffix('_sha256') for i, k in enumerate(fields)
             if (every[other, 1 + i] != every[0, 1 + i]).any()]
    raise ValueError(f'the processes hold different shards: the {", ".join(which)} of '
                     f'{_processes_text(other)} differ from process 0\'s (--data here: '
                     f'{data_info["data_dir"]}): give every host a copy of the same shards')


def _truncate_log(path: Path, step: int) -> None:
  """Drops the rows of `path` (log.jsonl) logged after `step`, the step a run resumes from,
  and a torn last row (a killed write), so the log reads as one uninterrupted run; rewritten
  atomically, and only when something goes."""
  if not path.is_file():
    return
  lines = path.read_text().splitlines(keepends=True)
  keep = []
  for line in lines:
    try:
      row = json.loads(line)
    except ValueError:
      continue
    if isinstance(row, dict) and isinstance(row.get('step'), int) and row['step'] <= step:
      keep.append(line if line.endswith('\n') else line + '\n')
  if keep != lines:
    atomic.write_text(path, ''.join(keep))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | os.PathLike,
                       task: Task = IKGAT_TASK, log: Callable[[str], None] = print,
                       mesh: Mesh | None = None) -> dict:
  """Trains `task` on `config.data` split 'train', validating on 'val' if present.

  Rerunning with the same `workdir` resumes from `checkpoints/latest`, on any mesh, and drops
  the rows of log.jsonl logged after that step (a killed run logs past its last checkpoint); a
  run already finished at `train.steps` on the same data is left untouched (one line says so,
  and the recorded validation metrics are returned). A run trained past `train.steps`, or with
  another config (anything outside `RESUME_MAY_CHANGE`; another model config: a
  CheckpointError) or other data (finished or not), a config that cannot train
  (`check_train_config`), missing data, `init_from` or teacher are refused before anything is
  written (a new `workdir` is not even made). `mesh` (default:
  every device of every process) shards each global batch of `config.train.batch_size`
  frames, which must divide by its device count. With several processes
  (`initialize_distributed`) each reads its own rows of every batch, all see the same `workdir`
  (a shared file system) and hold the same shards (both checked at the start, on every process:
  a ValueError naming the processes that differ), and only process 0 logs and writes the JSON
  files; a stop signal reaching any of them (`GracefulStop`) stops all after the same step, and
  all save the checkpoint. A val split of 0 frames is trained without (one line says so), a
  train split of 0 frames refused, one smaller than a batch trained (one line). Returns the
  final validation metrics (or {} without validation).
  """
  workdir = Path(workdir)
  tc = config.train
  check_train_config(tc)
  if 'augment' in config:
    check_augment_config(config.augment, 'config.augment')
  mesh = make_mesh() if mesh is None else mesh
  check_batch_size(tc.batch_size, mesh)
  chief, several = jax.process_index() == 0, jax.process_count() > 1
  log = log if chief else (lambda msg: None)
  if several:  # before anything reads the workdir: each process must see the same one
    _check_shared_workdir(workdir)
  saved = _check_resumable(workdir, config)  # refusals first: nothing written yet
  restart = saved is None and read_run(workdir) is not None  # said once the workdir is ours
  done = finished_run(workdir, int(tc.steps)) if saved is not None else None
  if done is not None:  # other data is refused as for an unfinished run (memory-mapped: cheap)
    _check_same_data(workdir, saved,
                     provenance.data_provenance(data_lib.load_shards(config.data, 'train')))
    log(f'already done: {workdir} is trained to step {tc.steps} (run.json); nothing to do')
    return done.get('val') or {}
  # Everything that can refuse the run (data, window rate, init_from, teacher) before the
  # workdir is made: a refused command leaves no folder behind.
  try:
    train_data, val_data = _load_splits(config.data)
    data_info, error = provenance.data_provenance(train_data), None
  except Exception as e:  # pylint: disable=broad-except  (several: raised after agreeing)
    if not several:
      raise
    data_info, error = None, e
  if several:  # every process reads its own copy of the shards: they must be the same
    _check_data_of_every_process(data_info, error)
  rig = train_data.rig
  if val_data is not None and not len(val_data):
    log(f'the val split of {config.data} has 0 frames: training without validation (the best '
        'checkpoint is the last)')
    val_data = None
  if len(train_data) < tc.batch_size:
    log(f'the train split of {config.data} has {len(train_data)} frames, fewer than a batch of '
        f'{tc.batch_size}: every batch repeats frames')
  check_window_fps(config, train_data)
  if config.get('augment') is not None and config.augment.get('mirror', 0) > 0:
    input_pipeline.check_mirror(rig)  # here, not at the first traced step: no workdir yet
  _check_same_data(workdir, saved, data_info)
  graphdef, state = init_state(task, config, rig, train_data)
  if tc.get('init_from') and saved is None:  # a fresh run only; resume restores
    params, counts = warm_start_params(state['params'], tc.init_from, task)
    state = {**state, 'params': params, **({'ema': copy_tree(params)} if 'ema' in state else {})}
    log(f'initialised from {tc.init_from}: {counts["copied"]} parameters copied, '
        f'{counts["grown"]} grown (zeros in the new part), {counts["kept"]} newly initialised')
  teacher = None
  if tc.get('distill_from'):
    teacher = load_teacher(tc.distill_from, task, config, rig)
    log(f'distilling from {tc.distill_from}'
        f'{", mirror-averaged" if tc.get("distill_mirror", False) else ""} (loss.distill_weight '
        f'{config.loss.get("distill_weight", 1.0)})')
  workdir.mkdir(parents=True, exist_ok=True)
  lock = hold_workdir(workdir) if chief else None  # until this function ends (its frame goes)
  if restart:
    log(f'{workdir}: its run stopped before its first checkpoint (run.json step 0; '
        'train.checkpoint_every): nothing to resume, trained again from step 0')
    if chief:  # its early validations' best: made again (training is deterministic)
      shutil.rmtree(workdir / 'checkpoints' / 'best', ignore_errors=True)
  latest = checkpointing.Checkpointer(workdir / 'checkpoints' / 'latest', max_to_keep=1)
  state = place_state(state, mesh)  # first: the abstract tree below takes this mesh's shardings
  best = checkpointing.Checkpointer(workdir / 'checkpoints' / 'best', max_to_keep=1)
  best_value = math.inf
  last_val: dict = {}
  if saved is not None:
    saved_ema = ema_decay(ml_collections.ConfigDict(
        (saved.get('config') or {}).get('train') or {})) > 0
    want = saved_part(state) if saved_ema else saved_part({k: v for k, v in state.items()
                                                           if k != 'ema'})
    if saved_ema and 'ema' not in want:  # the run kept an average, this config does not
      want = {**want, 'ema': state['params']}
    restored, _ = latest.restore(checkpointing.abstract_like(want))
    state = {**state, **restored}
    if 'ema' in state and not ema_decay(tc):
      del state['ema']
      log('train.ema_decay is 0: the saved moving average is dropped, validation uses the '
          'parameters')
    elif 'ema' in state and not saved_ema:
      state['ema'] = copy_tree(state['params'])
      log('train.ema_decay is on and the saved run kept no average: it starts from the '
          'restored parameters')
    if best.latest_step() is not None:
      best_value = best.restore_meta()['metrics'].get(task.best_metric, math.inf)
    last_val = saved.get('metrics') or {}  # the last validation's, until the next (run.json)
    log(f'resumed from {latest.directory} at step {int(state["step"])}')
  history = command_history(read_run(workdir) if saved else None, int(state['step']),
                            int(tc.steps))
  manifest = {'command': provenance.command_line(), 'workdir': str(workdir.absolute()),
              'status': 'running', 'steps': int(tc.steps), 'task': task.name,
              'config': config.to_dict(), 'devices': mesh.size,
              'processes': jax.process_count(), 'history': history}
  if chief:
    _write_run_json(workdir, {**manifest, 'step': int(state['step'])})
    atomic.write_json(workdir / 'config.json', config.to_dict())
    _truncate_log(workdir / 'log.jsonl', int(state['step']))  # rows after the restored step go

  train_step = make_train_step(task, graphdef, config, rig, mesh, teacher, stop_flags=several)
  predict = make_predict(task, graphdef, config, rig, mesh)
  writer = MetricWriter(workdir, enabled=chief)
  step = int(state['step'])

  val_step = None  # the step `last_val` was measured at (the log line names it)

  def run_validation(step):
    nonlocal best_value, last_val, val_step
    if val_data is None:
      return
    val_step = step
    t = time.time()
    last_val = task.validate(sharded_predict(predict, evaluated_part(state), mesh), val_data,
                             config, rig)
    writer.write(step, 'val', {**last_val, 'seconds': time.time() - t})
    value = last_val[task.best_metric]
    if value < best_value:
      best_value = value
      best.save(step, saved_part(evaluated_part(state), ('params', 'rest')),
                {**checkpoint_meta(config, rig, task, data_info, last_val),
                 'history': history})

  def save_latest(step, status):
    if latest.latest_step() != step:  # a run finished but not recorded so has it already
      # The losses of the steps since the last log row, which a resumed run's first row
      # averages with its own (it averaged only its own: another loss than one run's).
      unlogged = [{k: float(v) for k, v in d.items()}
                  for d in jax.device_get(progress.steps_metrics)]
      latest.save(step, saved_part(state),
                  {**checkpoint_meta(config, rig, task, data_info, last_val),
                   'history': history, 'unlogged_metrics': unlogged})
    if chief:
      _write_run_json(workdir, {**manifest, 'status': status, 'step': step, 'val': last_val,
                                'best_value': best_value})

  log(f'training {task.name} on {len(train_data)} frames ({rig.name}, {rig.num_joints} joints), '
      f'{tc.steps} steps of batch {tc.batch_size} on {mesh.size} device(s), '
      f'{jax.process_count()} process(es), params '
      f'{sum(x.size for x in jax.tree.leaves(state["params"])):,}')
  pipeline = input_pipeline.Prefetcher(
      ((s, to_global(b, mesh, tc.batch_size)) for s, _, b in input_pipeline.host_batches(
          train_data, tc.batch_size, config.seed, step, tc.steps, jax.process_index(),
          jax.process_count(), end_sites=_wants_end_sites(config),
          window=inference.training_window(config))), depth=tc.get('prefetch', 2))
  progress = _Progress(step, pipeline)
  if saved and step % tc.log_every:  # resumed off a log row: the steps since it, as one run
    progress.steps_metrics = [{k: np.float32(v) for k, v in d.items()}  # as logged
                              for d in saved.get('unlogged_metrics', [])]
  stopper = GracefulStop(log)
  # Several processes stop after the same step, or one would wait in the next step's
  # all-reduce while another saves: each step carries every process's stop flag, and all stop
  # after the step following the first that carried one (read a step late: no host sync).
  carried = None  # 'stop' of the previous step (several processes)
  try:
    for batch_step, batch in (pipeline if several else stopper.watch(pipeline)):
      assert batch_step == step, (batch_step, step)
      if several:
        state, m = train_step(state, batch, stop_flags(mesh, stopper.requested))
        stop, carried = carried, m.pop('stop')
      else:
        state, m = train_step(state, batch)
      step += 1
      progress.add(m)
      if step % tc.log_every == 0 or step == tc.steps:
        vals = progress.report(tc.batch_size)
        writer.write(step, 'train', vals)
        val_txt = (f' | val {task.best_metric} {last_val[task.best_metric]:.2f}'
                   f'{f" (step {val_step})" if val_step not in (None, step) else ""}'
                   if last_val else '')
        log(f'step {step}/{tc.steps} loss {vals["loss"]:.4f}{val_txt} | '
            f'{vals["frames_per_s"]:,.0f} frames/s, pipeline '
            f'{vals["pipeline_frames_per_s"]:,.0f} frames/s | '
            f'ETA {_fmt_eta((tc.steps - step) / max(progress.steps_per_s(step), 1e-9))}')
        if not np.isfinite(vals['loss']):
          saved_step = latest.latest_step()
          if chief:  # not 'running' for good: a rerun resumes from the last checkpoint
            _write_run_json(workdir, {**manifest, 'status': 'failed', 'step': saved_step,
                                      'val': last_val, 'best_value': best_value,
                                      'reason': f'loss became {vals["loss"]} at step {step}'})
          last = f'step {saved_step}' if saved_step else 'none'
          raise TrainingDiverged(
              f'loss became {vals["loss"]} at step {step}: the run diverged (a lower '
              f'--config.train.lr?); its last checkpoint ({last}) stands, and a rerun from it '
              'diverges the same way (training is deterministic)')
      if step % tc.eval_every == 0 or step == tc.steps:
        run_validation(step)
      if step % tc.checkpoint_every == 0 and step < tc.steps:
        save_latest(step, 'running')
      if several and stop is not None and int(stop) and step < tc.steps:
        if not stopper.requested:
          log('stop requested on another process: all stop here')
        raise _AllStop
  except KeyboardInterrupt as e:
    alone = several and not isinstance(e, _AllStop)  # a second Ctrl-C: saving would hang
    if alone or _is_deleted(state):  # or one inside a step that had donated the state
      saved_step = latest.latest_step()
      if chief:  # the manifest must not keep saying 'running'
        _write_run_json(workdir, {
            **manifest, 'status': 'interrupted', 'step': saved_step, 'val': last_val,
            'best_value': best_value})
      log(f'interrupted {"at once at" if alone else "inside"} step {step}; the last saved '
          f'checkpoint (step {saved_step}) stands. Rerun the same command to resume from it.')
    else:
      save_latest(step, 'interrupted')
      log(f'interrupted at step {step}; checkpoint saved. Rerun the same command to resume.')
    writer.close()
    if lock is not None:
      lock.close()
    raise
  except BaseException:
    if lock is not None:  # now, not when the traceback's frames go: a rerun in this process
      lock.close()
    raise
  finally:
    stopper.restore()
    pipeline.close()
  save_latest(step, 'done')
  writer.close()
  if val_data is None and best.latest_step() != step:
    best.save(step, saved_part(evaluated_part(state), ('params', 'rest')),
              {**checkpoint_meta(config, rig, task, data_info, {}), 'history': history})
  elif best.latest_step() is None:  # deleted: the evaluations, the export and solve need one
    log(f'no best checkpoint in {best.directory}: the last step ({step}) saved as the best')
    best.save(step, saved_part(evaluated_part(state), ('params', 'rest')),
              {**checkpoint_meta(config, rig, task, data_info, last_val or {}),
               'history': history})
  log(f'done: step {step}' + (f', val {task.best_metric} {last_val[task.best_metric]:.3f} '
                              f'(best {best_value:.3f})' if last_val else ''))
  if lock is not None:
    lock.close()  # released; a stop or error releases it with the function's frame
  return last_val


class _Progress:
  """The steps since the last report: the mean of each metric (loss, its parts, the gradient
  norm: every one over the same steps), train frames/s and the input pipeline's own.

  The pipeline rate is global-batch frames per second of the prefetch thread's busy time
  (batch order, memory-mapped reads, copy to the devices; each process makes its 1/P of every
  batch in parallel), comparable with the train rate: when it is not well above it, the input
  pipeline is the bottleneck.
  """

  def __init__(self, step: int, pipeline: input_pipeline.Prefetcher):
    self.pipeline = pipeline
    self.start_step, self.start_time = step, time.time()
    self._reset()

  def _reset(self):
    self.t, self.steps, self.steps_metrics = time.time(), 0, []
    self.busy, self.made = self.pipeline.busy_seconds, self.pipeline.produced

  def add(self, metrics_: dict) -> None:
    """One step's metrics (loss, its parts, the gradient norm): a row averages each."""
    self.steps += 1
    self.steps_metrics.append(metrics_)

  def steps_per_s(self, step: int) -> float:
    return (step - self.start_step) / max(time.time() - self.start_time, 1e-9)

  def report(self, batch_size: int) -> dict:
    rows = jax.device_get(self.steps_metrics)  # every step since the last row (a resumed
    vals = {k: float(np.mean([r[k] for r in rows if k in r]))  # run's: its saved ones too)
            for k in rows[-1]}
    vals['frames_per_s'] = self.steps * batch_size / max(time.time() - self.t, 1e-9)
    made, busy = self.pipeline.produced - self.made, self.pipeline.busy_seconds - self.busy
    if made == 0:  # the thread has made every batch already: its rate over the whole run
      made, busy = self.pipeline.produced, self.pipeline.busy_seconds
    vals['pipeline_frames_per_s'] = made * batch_size / max(busy, 1e-9)
    self._reset()
    return vals
