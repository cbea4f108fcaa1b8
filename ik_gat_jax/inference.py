"""Inference: model families as `Task`s, loading trained checkpoints, the IK-GAT forward.

Everything that turns a checkpoint into predictions, with no optimizer in sight: the solver,
evaluation, the benchmark and the pose prior import this module; only the trainer (`train.py`,
imported by the mains and tests) adds optimisation on top. Also here: where the shipped
checkpoints live, and the one rule that maps a training workdir to its best checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from ik_gat_jax import bone_frames as bf
from ik_gat_jax import checkpointing
from ik_gat_jax import compile_cache
from ik_gat_jax import input_pipeline
from ik_gat_jax import iterative_ik
from ik_gat_jax import losses
from ik_gat_jax import metrics
from ik_gat_jax import model as model_lib
from ik_gat_jax import rotations
from ik_gat_jax import skeleton
from ik_gat_jax import temporal
from ik_gat_jax.errors import CheckpointError
from ik_gat_jax.skeleton import Rig

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / 'checkpoints'  # the shipped checkpoints, each loadable by its bare name
SHIPPED_IKGAT = SHIPPED / 'ikgat_base'
SHIPPED_PRIOR = SHIPPED / 'prior'


def resolve_checkpoint(path: str | os.PathLike) -> Path:
  """`path` as given; the bare name of a shipped checkpoint that is not a file or directory
  here (e.g. 'ikgat_fast') -> it under SHIPPED, so the shipped models load by name from any
  working directory (a local directory of that name wins); a bare name of neither: a
  CheckpointError listing the shipped ones."""
  path = Path(path)
  if not path.exists() and len(path.parts) == 1 and (SHIPPED / path).is_dir():
    return SHIPPED / path
  if not path.exists() and len(path.parts) == 1 and SHIPPED.is_dir():  # a name, of nothing
    shipped = sorted(d.name for d in SHIPPED.iterdir() if (d / 'README.md').is_file())
    raise CheckpointError(f'no checkpoint {str(path)!r}: neither a directory here nor a shipped '
                          f'checkpoint ({", ".join(shipped)})')
  return path


def checkpoint_path(path: str | os.PathLike) -> Path:
  """A training workdir -> its `checkpoints/best`; a checkpoint directory -> itself; a shipped
  checkpoint's bare name -> it (`resolve_checkpoint`)."""
  path = resolve_checkpoint(path)
  best = path / 'checkpoints' / 'best'
  return best if best.is_dir() else path


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


def _ikgat_loss(model, batch, key, config, rig, teacher=None):
  """`teacher` (distillation, train.load_teacher): adds `loss.distill_weight` (default 1) x
  the mean geodesic angle between this model's output and the teacher's on the same augmented
  input (both in the same output space), reported as 'distill_rad'."""
  velocity = velocity_weight(config)
  if velocity:  # issue K: pairs of consecutive windows (k + 1 frames per sample)
    batch = input_pipeline.augment_window_pairs(batch, key, config.augment, rig)
  elif model.config.window > 1:  # issue K: windows of k frames, one body and tracker per window
    batch = input_pipeline.augment_windows(batch, key, config.augment, rig)
  else:
    batch = input_pipeline.augment(batch, key, config.augment, rig)
  pred = model(batch['input_positions'], deterministic=False,
               **model_lib.extra_inputs(batch, model.config))
  loss, aux = losses.ikgat_loss(pred, batch, rig, model.config.output_space, config.loss.alpha,
                                model.config.bone_chart)
  if velocity:
    local = model_lib.to_local(pred, batch['bone_frames'], rig, model.config.output_space,
                               model.config.bone_chart)
    vel = losses.velocity_loss(local, batch['local_rot'])
    loss = 0.5 * (loss[:vel.shape[0]] + loss[vel.shape[0]:]) + velocity * vel
    aux = {**{k: 0.5 * (v[:vel.shape[0]] + v[vel.shape[0]:]) for k, v in aux.items()},
           'velocity_rad': vel}
  if teacher is None:
    return loss, aux
  target = jax.lax.stop_gradient(teacher_target(teacher, batch, config, rig))
  distill = jnp.mean(rotations.geodesic_angle(pred, target), axis=-1)
  if velocity:  # per sample: the mean over its two windows, as the loss
    distill = 0.5 * (distill[:distill.shape[0] // 2] + distill[distill.shape[0] // 2:])
  return loss + config.loss.get('distill_weight', 1.0) * distill, {**aux, 'distill_rad': distill}


def teacher_target(teacher, batch: dict, config, rig: Rig) -> jax.Array:
  """The distillation teacher's deterministic output (in its output space, which is the
  student's) on an augmented batch. With `train.distill_mirror` the teacher is mirror-averaged
  (`ikgat_infer(mirror=True)`: its own and its mirror image's solution, mapped back, at their
  geodesic midpoint; 0.2 deg lower error than the network alone for the shipped base on val)
  and brought back to the output space (`model.from_local`)."""
  if not config.train.get('distill_mirror', False):
    return teacher(batch['input_positions'], deterministic=True,
                   **model_lib.extra_inputs(batch, teacher.config))
  local = ikgat_infer(teacher, {**batch, 'positions': batch['input_positions']},
                      rig=rig, micro_batch=0, mirror=True)
  return model_lib.from_local(local, batch['bone_frames'], rig, teacher.config.output_space,
                              teacher.config.bone_chart)


def window_of(config) -> int:
  """The input window (frames) of a run config's model: 1 for a per-frame model or a task
  without one."""
  model = config.get('model') if hasattr(config, 'get') else None
  return int(model.get('window', 1)) if model is not None else 1


def velocity_weight(config) -> float:
  """`loss.velocity_weight` of a window model's run config (issue K; 0 = off, also for
  per-frame models and configs from before it)."""
  if window_of(config) <= 1:
    return 0.0
  return float(config.loss.get('velocity_weight', 0.0))


def training_window(config) -> int:
  """Frames per training sample: the model's window, one more with the velocity loss (two
  consecutive windows per sample)."""
  return window_of(config) + (1 if velocity_weight(config) > 0 else 0)


MICRO_BATCH_CPU = 32


def micro_batch_size() -> int:
  """Examples per block of `ikgat_infer` on this backend: 32 on the CPU, where a bigger
  batch's activations leave the cache (the base network at batch 256-4,096 then runs at about
  its small-batch rate, 1.35-1.6x; BENCHMARKS.md "Blocks"; 64 until session 28, when the
  sparse form's per-node kernels made blocks of 16-32 1.05-1.1x faster than 64 at batch 1,024
  on two cores, "Session 28: a per-node softmax"); 0 (the batch at once) on accelerators, which
  want it whole."""
  return MICRO_BATCH_CPU if jax.default_backend() == 'cpu' else 0


# XLA's CPU dot emitter computes a bfloat16 product in float32 (no faster than float32); its
# YNNPACK library fusion for single dots runs it with the CPU's bfloat16 instructions. The
# package switches YNN fusions off process-wide (ik_gat_jax/__init__.py: a reduce fusion
# miscompiles); this option takes the dots alone, per executable.
_YNN_DOTS = {'xla_cpu_experimental_ynn_fusion_type': 'LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT'}


def compiler_options(model) -> dict[str, str] | None:
  """XLA options for compiling `model`'s forward (`jax.jit(..., compiler_options=...)`):
  `precision_options` of its matmul precision (`model.set_matmul_precision`)."""
  return precision_options(model_lib.matmul_precision(model))


def precision_options(precision: str) -> dict[str, str] | None:
  """XLA options for a program whose large products take `precision` (`gat.matmul`): on the
  CPU with 'bfloat16', XLA's YNNPACK dots, which run bfloat16 products 2.3-3.4x faster than
  float32 ones on a CPU with bfloat16 instructions (XLA's own dot emitter computes them in
  float32: no gain); None otherwise."""
  if precision == 'bfloat16' and jax.default_backend() == 'cpu':
    return dict(_YNN_DOTS)
  return None


def one_frame_options(options: dict | None) -> dict | None:
  """`options` for an executable of one frame (`IKSolver.step`'s): on the CPU also Eigen's
  products on the executing thread (`xla_cpu_multi_thread_eigen` off). A frame's products
  are too small to gain from XLA's intra-op thread pool, and handing them to it cost 3% of a
  pinned live frame (BENCHMARKS.md, issue N session 32). The same function up to float32
  round-off (a product the pool splits may sum in another order; tests/shipped_test.py)."""
  if jax.default_backend() != 'cpu':
    return options
  return {**(options or {}), 'xla_cpu_multi_thread_eigen': False}


_LIVE_BACKEND: dict[str, Any] = {}  # what `start_live_backend` did, once it has


def start_live_backend() -> dict[str, Any]:
  """Starts JAX's backends for a process that solves live frames (`IKSolver.step`) on the CPU:
  every call runs on the calling thread, start to end. Call it first, before any JAX
  computation (`IKSolver.from_checkpoint` included); a second call returns the first's record.

  Two settings: JAX's CPU dispatch made synchronous (`jax_cpu_enable_async_dispatch` off), and
  XLA's CPU client started with one intra-op thread. XLA sizes that pool by the cores the
  starting thread may run on, so the backend is started on one of them and every thread's
  cores are then given back: nothing stays pinned. Otherwise XLA hands a frame's independent
  kernels to its pool and the caller waits on another core: 0.41 ms a frame on 2 unpinned
  cores, against 0.22 ms this way (BENCHMARKS.md, issue N session 33). The cost: work not split
  over threads runs on one core. `IKSolver.solve` still runs a clip's chunks on its `workers`
  threads at once (as device arrays: `IKSolver._chunk_job`), as fast as in a default process
  with the dense attention form (which `IKSolver.from_checkpoint` then takes for
  `attention='auto'` with several workers: the sparse form's chunks would take turns on the one
  pool thread), but one large batch (training) runs about half as fast; so it is opt-in, for a
  process that serves live frames. The same outputs up to float32 round-off.
  Raises RuntimeError when JAX has already started its backends."""
  if _LIVE_BACKEND:
    return dict(_LIVE_BACKEND)
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  if xla_bridge.backends_are_initialized():
    raise RuntimeError('start_live_backend must run before JAX starts its backend: call it '
                       'before the first JAX computation (before IKSolver.from_checkpoint)')
  jax.config.update('jax_cpu_enable_async_dispatch', False)
  pinnable = hasattr(os, 'sched_setaffinity') and os.path.isdir('/proc/self/task')
  if not pinnable:  # no affinity to set (not Linux): synchronous dispatch only
    jax.devices()
    threads = None
  else:
    cores = os.sched_getaffinity(0)
    before = set(os.listdir('/proc/self/task'))
    os.sched_setaffinity(0, {min(cores)})
    try:
      jax.devices()  # XLA's CPU client sizes its intra-op pool by this thread's cores: one
    finally:
      os.sched_setaffinity(0, cores)
      for tid in set(os.listdir('/proc/self/task')) - before:  # started pinned: give back
        try:
          os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that has ended since
          pass
    threads = 1
  _LIVE_BACKEND.update(async_dispatch=False, intra_op_threads=threads,
                       backend=jax.default_backend())
  return dict(_LIVE_BACKEND)


def live_backend() -> dict[str, Any] | None:
  """What `start_live_backend` set in this process, or None when it did not run."""
  return dict(_LIVE_BACKEND) or None


def flop_frames(limit: int = 64) -> int:
  """Frames to count a forward's FLOPs per frame on: at most one block (XLA's cost analysis
  counts a loop body once whatever its trip count, so a batch of several blocks would read
  low), at most `limit`."""
  return min(limit, micro_batch_size() or limit)


def ikgat_infer(model, batch, config=None, rig=None,
                refine: iterative_ik.SolverConfig | None = None,
                micro_batch: int | None = None, prior=None, mirror: bool = False,
                num_valid: jax.Array | int | None = None,
                size_normalization: bool = False) -> jax.Array:
  """The one IK-GAT forward: deterministic, to local rotations `[B, J, 3, 3]` (batch:
  positions, bone_frames; optional joint_mask, orientations, orientation_mask, end_sites,
  end_site_mask where the model takes them; a window model's history `[B, k-1, J, 3]`).
  `refine` (amortized + refine, G1) adds that many anchored iterations of the rotation solver
  from the network's output; it needs `batch['offsets'] [B or 1, J, 3]` and every joint;
  `prior` (`vposer.decoder(prior_model)`, optional) adds the pose prior's term to it
  (`iterative_ik.SolverConfig.w_prior`). A
  batch of more than `micro_batch` examples (None: `micro_batch_size()`; 0: never) runs the
  network in blocks of that many (`lax.map`, the last block padded with copies of the last
  example): the same function per example, one executable. `num_valid` (a traced int32 scalar
  too): only the first that many examples are wanted (the rest pad a fixed shape), so a block
  holding none of them is skipped (`lax.cond`; identity rotations there): one compiled shape
  serves every chunk size without computing its padding (the solver's clip path).

  `mirror` (test-time mirror averaging): the network also solves the mirror image of the input
  (`mirror_inputs`; it needs `batch['offsets']`) in the same call, and the answer is the
  geodesic midpoint of its own and the mirrored solution mapped back
  (`input_pipeline.unmirror_local`): twice the network's work, and a solver that is exactly
  mirror-equivariant whatever the network learned (tests/rig_invariance_test.py).

  `size_normalization`: the network sees each body scaled to the rig template's size
  (`size_scale`: from `batch['offsets']`, or the frame's own bones where those are the
  template's), and a refinement runs on that body too; the outputs keep the input's size. A body
  scaled by k then gives the same rotations for any k (to float32 round-off), and a subject
  smaller or larger than the training data's is solved as one of its size (BENCHMARKS.md "Subject
  size")."""
  del config
  rig = rig or model.rig
  inputs = {'positions': batch['positions'], 'bone_frames': batch['bone_frames'],
            **model_lib.extra_inputs(batch, model.config)}
  n = inputs['positions'].shape[0]
  if size_normalization:
    mask = inputs.get('joint_mask')
    mask = None if mask is None else (mask if mask.dtype == bool else mask > 0.5)
    scale = size_scale(inputs['positions'], batch['offsets'], rig, mask).astype(jnp.float32)
    inputs = scale_points(inputs, scale)

  if mirror:
    inputs = mirror_inputs(inputs, batch['offsets'], rig)
  mb = micro_batch_size() if micro_batch is None else int(micro_batch)
  if mb and inputs['positions'].shape[0] > mb:
    local = _in_blocks(model, inputs, rig, mb, num_valid, period=n)
  else:
    local = _network(model, inputs, rig)
  if mirror:
    local = rotations.matrix_slerp(local[:n], input_pipeline.unmirror_local(local[n:], rig), 0.5)
  if refine is not None:  # with the size normalisation, on the body the network saw
    pos, off = batch['positions'].astype(jnp.float32), batch['offsets'].astype(jnp.float32)
    if size_normalization:
      off = jnp.broadcast_to(off, pos.shape[:1] + off.shape[-2:]) * scale[:, None, None]
      pos = pos * scale[:, None, None]
    local = iterative_ik.refine_rotations(local.astype(jnp.float32), pos, off, rig, refine,
                                          *(prior or (None, None)))[0]
  return local


MIRRORED_INPUTS = ('positions', 'bone_frames', 'joint_mask', 'history')

# The network's inputs that are points (scaled by `size_normalization`).
POINT_INPUTS = ('positions', 'history', 'end_sites')


# Offsets within this many metres of the rig template's, joint by joint, are the template:
# no subject given (float32 copies of it too), so the size comes from each frame.
TEMPLATE_TOL_M = 5e-5


def size_scale(positions: jax.Array, offsets: jax.Array, rig: Rig,
               mask: jax.Array | None = None) -> jax.Array:
  """`[B]`: the factor that brings each frame's body to the rig template's size: 1 / the median
  over the template's bones of the subject's bone length over the template's. From the
  subject's rest `offsets [B or 1, J, 3]`, or, where they are the template's own
  (`TEMPLATE_TOL_M`: no subject given), from the frame's `positions [B, J, 3]` (its bones
  with both ends observed, `mask [B, J]`; the median, so one or two bad joints barely move it;
  1 where no bone is observed, as for a tracker subset that shares none). 1 for a rig without
  a template. Rotations do not change when a body is scaled, so the network then sees every
  subject at the size its training data had (`ikgat_infer`'s `size_normalization`)."""
  positions = jnp.asarray(positions)  # float32 unless JAX runs in 64 bits
  try:
    template = np.asarray(rig.template(), np.float64)
  except Exception:  # a rig without template offsets: nothing to compare with
    return jnp.ones(positions.shape[:1], positions.dtype)
  lengths = np.linalg.norm(template, axis=-1)
  bones = np.asarray([j for j, p in enumerate(rig.parents) if p >= 0 and lengths[j] > 1e-6])
  if not len(bones):
    return jnp.ones(positions.shape[:1], positions.dtype)
  parents = np.asarray(rig.parents)[bones]
  dtype = positions.dtype
  tl = jnp.asarray(lengths[bones], dtype)
  off = jnp.broadcast_to(offsets, positions.shape[:1] + offsets.shape[-2:]).astype(dtype)
  subject = jnp.median(rotations.safe_norm(off[:, bones]) / tl, axis=-1)
  is_template = jnp.all(jnp.abs(off - jnp.asarray(template, dtype)) <= TEMPLATE_TOL_M,
                        axis=(-2, -1))
  seen = (jnp.ones(positions.shape[:1] + (len(bones),), bool) if mask is None
          else mask[:, bones] & mask[:, parents])
  x = jnp.where(seen[..., None], positions[:, bones] - positions[:, parents], 0.0)
  frame = jnp.nanmedian(jnp.where(seen, rotations.safe_norm(x) / tl, jnp.nan), axis=-1)
  ratio = jnp.where(is_template, frame, subject)
  ok = jnp.isfinite(ratio) & (ratio > 1e-6)
  return jnp.where(ok, 1.0 / jnp.where(ok, ratio, 1.0), 1.0).astype(dtype)


def scale_points(inputs: dict, s: jax.Array) -> dict:
  """`inputs` with its points (`POINT_INPUTS`) scaled by `s [B]` about the origin: the network
  removes each frame's centre, so the body it sees is scaled by `s`."""
  out = dict(inputs)
  for k in POINT_INPUTS:
    if k in out:
      out[k] = out[k] * s.reshape((-1,) + (1,) * (out[k].ndim - 1)).astype(out[k].dtype)
  return out



def check_mirror_averaging(rig: Rig, off: str = 'turn it off (--nomirror)') -> None:
  """ValueError for a rig mirror averaging cannot serve: not mirror-symmetric in its reference
  pose (`input_pipeline.check_mirror`), so the mirror image of a pose is not the partner's."""
  input_pipeline.check_mirror(rig, 'mirror averaging', off)


def mirror_inputs(inputs: dict, offsets: jax.Array, rig: Rig) -> dict:
  """The network's inputs `[B, ...]` followed by those of the input's mirror image (`[2B, ...]`):
  the mirror-image body (`input_pipeline.mirror_offsets`, its bone frames) seen by the same
  tracker (`mirror_positions` of the points and the history, the joint mask permuted). Refuses
  inputs it cannot mirror (orientations, end sites) and a rig that is not mirror-symmetric
  (`input_pipeline.check_mirror`)."""
  other = sorted(set(inputs) - set(MIRRORED_INPUTS))
  if other:
    raise ValueError(f'mirror averaging takes positions (and a window model\'s history, a joint '
                     f'mask), not {", ".join(other)}: turn it off for these inputs')
  check_mirror_averaging(rig)
  n = inputs['positions'].shape[0]
  offsets = jnp.broadcast_to(offsets, (n,) + offsets.shape[-2:])
  mirrored = {'positions': input_pipeline.mirror_positions(inputs['positions'], rig),
              'bone_frames': bf.bone_frames(input_pipeline.mirror_offsets(offsets, rig), rig)}
  if 'history' in inputs:
    mirrored['history'] = input_pipeline.mirror_positions(inputs['history'], rig)
  if 'joint_mask' in inputs:
    mirrored['joint_mask'] = inputs['joint_mask'][..., np.asarray(rig.mirror)]
  whole = lambda k: jnp.broadcast_to(inputs[k], (n,) + inputs[k].shape[1:])
  return {k: jnp.concatenate([whole(k), v.astype(inputs[k].dtype)]) for k, v in mirrored.items()}


def _network(model, inputs: dict, rig: Rig) -> jax.Array:
  extra = {k: v for k, v in inputs.items() if k not in ('positions', 'bone_frames')}
  pred = model(inputs['positions'], deterministic=True, **extra)
  return model_lib.to_local(pred, inputs['bone_frames'], rig, model.config.output_space,
                            model.config.bone_chart)


def _in_blocks(model, inputs: dict, rig: Rig, mb: int, num_valid=None,
               period: int | None = None) -> jax.Array:
  """`_network` over blocks of `mb` examples: the inputs with the batch's leading size are cut
  (padded to whole blocks), the broadcast ones (leading 1) go to every block as they are. With
  `num_valid`, example e is wanted when `e % period < num_valid` (`period`: the caller's batch,
  which a mirrored batch repeats), and a block with no wanted example is skipped."""
  n = inputs['positions'].shape[0]
  blocks = -(-n // mb)
  per_frame = {k: v for k, v in inputs.items() if v.shape[0] == n}
  shared = {k: v for k, v in inputs.items() if k not in per_frame}

  def cut(x):
    x = jnp.concatenate([x, jnp.repeat(x[-1:], blocks * mb - n, axis=0)]) if blocks * mb > n else x
    return x.reshape((blocks, mb) + x.shape[1:])

  graphdef, state = nnx.split(model)  # the module goes into lax.map's body as state

  def body(part):
    return _network(nnx.merge(graphdef, state), {**shared, **part}, rig)

  parts = {k: cut(v) for k, v in per_frame.items()}
  if num_valid is None:
    out = jax.lax.map(body, parts)
  else:
    e = np.arange(blocks * mb)
    wanted = ((e % (period or n)) < num_valid) & (e < n)
    live = jnp.any(wanted.reshape(blocks, mb), axis=-1)
    shape = jax.eval_shape(body, jax.tree.map(lambda x: x[0], parts))
    identity = jnp.broadcast_to(jnp.eye(3, dtype=shape.dtype), shape.shape)
    out = jax.lax.map(lambda a: jax.lax.cond(a[0], body, lambda _: identity, a[1]),
                      (live, parts))
  return out.reshape((blocks * mb,) + out.shape[2:])[:n]


def validate_local_rotations(predict, data, config, rig: Rig) -> dict:
  """Metrics of predicted local rotations on (a fixed subset of) `data`; flat dict of floats."""
  idx = eval_indices(len(data.positions), config.train.val_frames)
  batch = input_pipeline.gather_batch(data, idx, window=window_of(config))
  batch.pop('history_local_rot', None)
  pred = predict_in_chunks(predict, batch, config.train.eval_batch_size)
  errors = metrics.compute_errors_batched(pred, batch['local_rot'], batch['offsets'],
                                          batch['bone_frames'], batch['positions'], rig)
  s = metrics.summarize(errors, rig)
  flat = {k: v for k, v in s.items() if isinstance(v, float)}
  flat.update({f'local_rot_err_deg_{c}': v for c, v in s['local_rot_err_deg_by_class'].items()})
  flat.update(_validate_temporal(pred, batch, data, idx, config, rig))
  return flat


def _validate_temporal(pred, batch, data, idx, config, rig: Rig) -> dict:
  """Jitter of the predictions vs the truth (issue G3), where the validation frames hold whole
  runs of consecutive frames (val_frames >= the split: CMU's val); with `config.temporal` set,
  also the filtered error and jitter. {} when no three consecutive frames are evaluated."""
  file_ids, frame_index = np.asarray(data.file_id[idx]), np.asarray(data.frame_index[idx])
  jit = metrics.jitter_summary(pred, batch['local_rot'], file_ids, data.fps, rig, frame_index)
  out = {k: v for k, v in jit.items() if k != 'per_joint_jitter'}
  section = config.get('temporal')
  filt = temporal.FilterConfig.from_dict(section.to_dict() if section is not None else None)
  if jit and filt.active:
    pred = temporal.filter_clips(pred, file_ids, filt, data.fps, frame_index)
    errors = metrics.compute_errors_batched(pred, batch['local_rot'], batch['offsets'],
                                            batch['bone_frames'], batch['positions'], rig)
    out['filtered_local_rot_err_deg'] = metrics.summarize(errors, rig)['local_rot_err_deg']
    out['filtered_jitter_deg_s2'] = metrics.jitter_summary(
        pred, batch['local_rot'], file_ids, data.fps, rig, frame_index)['jitter_deg_s2']
  return {k: float(v) for k, v in out.items()}


IKGAT_TASK = Task(name='ikgat', build=_ikgat_build, loss=_ikgat_loss, infer=ikgat_infer,
                  validate=validate_local_rotations, best_metric='local_rot_err_deg')

# ----------------------------------------------------------------------------------------------
# Evaluation helpers shared by validation, the prior and the benchmark.


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


# ----------------------------------------------------------------------------------------------
# Loading.


def abstract_model(config, rig: Rig, task: Task = IKGAT_TASK) -> tuple:
  """`task`'s model for `config` and `rig`, built abstractly (no parameter initialisation is
  computed: one small jitted op per leaf, about 0.8 s of a CLI run) and split into (graphdef,
  params, rng state, rest), the shapes a checkpoint fills."""
  abstract = nnx.eval_shape(lambda: task.build(config, rig, nnx.Rngs(0), None))
  return nnx.split(abstract, nnx.Param, nnx.RngState, ...)


def on_one_device(tree: Any) -> Any:
  """`tree`'s leaves as ShapeDtypeStructs on this process's first device (a restore target)."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)


def load_model(checkpoint_dir: str | os.PathLike, task: Task = IKGAT_TASK,
               expected_rig: Rig | None = None) -> tuple[nnx.Module, dict]:
  """Restores a trained model (parameters only) and its meta from a checkpoint directory.

  `checkpoint_dir` may be a run's workdir (uses `checkpoints/best`) or a checkpoint directory.
  Once the command line turned its caches on (`compile_cache.params_dir()`), a checkpoint
  restored before comes from the parameter cache (checkpointing.py: the same arrays, no orbax).
  """
  path = checkpoint_path(checkpoint_dir)
  cache = compile_cache.params_dir()
  ckpt, key, meta, cached = None, None, None, None
  if cache is not None and path.is_dir():
    key, meta, cached = checkpointing.cache_lookup(cache, path)
  if meta is None:
    ckpt = checkpointing.Checkpointer(path, create=False)
    meta = ckpt.restore_meta()
  if meta.get('task') != task.name:
    raise CheckpointError(f'{path} holds a {meta.get("task")!r} model, '
                                        f'not {task.name!r}')
  try:
    rig = Rig.from_json(meta['rig'])
    config = ml_collections.ConfigDict(meta['config'])
  except Exception as e:  # valid JSON without a usable rig or config
    raise CheckpointError(f'checkpoint {path} has unusable metadata (rig, config):'
                                        f' {checkpointing.one_line(e)}') from e
  if expected_rig is not None and rig.joint_names != expected_rig.joint_names:
    ours, theirs = rig.joint_names, expected_rig.joint_names
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours),
                                                                             len(theirs)))
    differ = (f'joint {k}: {ours[k]!r} against {theirs[k]!r}' if k < min(len(ours), len(theirs))
              else f'{abs(len(ours) - len(theirs))} joints more in one')
    raise CheckpointError(
        f'checkpoint {path} is for rig {rig.name!r} ({rig.num_joints} joints), not '
        f'{expected_rig.name!r} ({expected_rig.num_joints} joints): their joints differ '
        f'({differ})')
  if expected_rig is not None:
    warn_other_bind(rig, expected_rig, path)
  graphdef, params, rngs, rest = abstract_model(config, rig, task)
  target = on_one_device({'params': params, 'rest': rest})
  tree = None if cached is None else checkpointing.cache_tree(cached, target)
  if tree is None:
    ckpt = ckpt or checkpointing.Checkpointer(path, create=False)
    tree, meta = ckpt.restore(target)
    if cache is not None:
      checkpointing.cache_store(cache, key, path, meta, tree)
  return nnx.merge(graphdef, tree['params'], jax.tree.map(_fresh_rng, rngs), tree['rest']), meta


def warn_other_bind(rig: Rig, expected: Rig, path) -> str | None:
  """A warning (`warnings.warn`, also returned) when `expected` (the data's rig, or the one a
  command names) has the checkpoint rig's joints under another bind: its template's bones point
  a median over `skeleton.REST_POSE_WARN_DEG`, or one over `skeleton.REST_BONE_WARN_DEG`, from
  the checkpoint's in its natural pose (`skeleton.rest_pose_angles`; another lab's files of
  the same joint names). The model's twists are relative to its own rest pose."""
  if expected.fingerprint() == rig.fingerprint() or not expected.template_offsets:
    return None
  angles = skeleton.rest_pose_angles(expected.template(), rig)
  if not (angles.size and np.isfinite(angles).any()):
    return None
  median, k = float(np.nanmedian(angles)), int(np.nanargmax(angles))
  if median <= skeleton.REST_POSE_WARN_DEG and angles[k] <= skeleton.REST_BONE_WARN_DEG:
    return None
  msg = (f'rig {expected.name!r} is another bind of checkpoint {path}\'s joints (rig '
         f'{rig.name!r}): its rest bones point a median {median:.0f} deg, up to {angles[k]:.0f} '
         f'at {rig.joint_names[k]}, from the checkpoint\'s, and the model\'s rotations are '
         'relative to its own rest pose: train on this bind, or convert the data with the '
         'checkpoint rig\'s natural pose named')
  warnings.warn(msg, stacklevel=3)
  return msg


def _fresh_rng(leaf: jax.ShapeDtypeStruct) -> jax.Array:
  """A concrete RNG-state leaf (dropout streams: unused by deterministic inference, reseeded
  by training) for an abstract one: key 0 or a zero counter."""
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    key = jax.random.key(0)
    return jax.random.split(key, leaf.shape) if leaf.shape else key
  return jnp.zeros(leaf.shape, leaf.dtype)
