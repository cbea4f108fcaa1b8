"""Evaluation of every method on a shard split, with the one metrics module (DESIGN section 7).

A *method* is a function `solve(positions [N, J, 3], offsets [N, J, 3], file_ids [N]) -> local
rotations [N, J, 3, 3]` built by `make_method`; `evaluate` feeds it fixed-size chunks (one
compile, excluded from the timing), scores the result against the clean truth and returns the
JSON object of DESIGN section 9 (plus per-subject, per-file and per-test-part tables).

Frame selection (`max_frames`): every file of the split contributes its first
`ceil(max_frames * frames_f / total)` frames, so subjects keep their proportions and each file's
frames stay contiguous (warm starts need clips). Noise: i.i.d. Gaussian per coordinate, sigma in
mm, added to the input positions before anything else (seeded); errors are against clean
positions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ik_gat_jax import bone_frames
from ik_gat_jax import data as data_lib
from ik_gat_jax import inference
from ik_gat_jax import input_pipeline
from ik_gat_jax import iterative_ik
from ik_gat_jax import metrics
from ik_gat_jax import model as model_lib
from ik_gat_jax import padding
from ik_gat_jax import prior_task
from ik_gat_jax import provenance
from ik_gat_jax import subject_calibration as subject_calibration_lib
from ik_gat_jax import temporal
from ik_gat_jax import trackers
from ik_gat_jax import vposer
from ik_gat_jax import windows
from ik_gat_jax.skeleton import Rig

METHODS = ('ikgat', 'iterative', 'iterative_noprior', 'swing', 'mean_pose')

Solve = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclasses.dataclass
class Method:
  """A method ready to run: `solve(positions, offsets)` on one chunk (jitted), and whether it
  needs whole clips in order (warm start) rather than independent frames."""
  name: str
  solve: Solve
  chunk: int
  info: dict = dataclasses.field(default_factory=dict)
  clip_solve: Callable | None = None  # (positions [T,J,3], offsets [J,3]) -> [T,J,3,3]


def select_frames(data, max_frames: int | None) -> np.ndarray:
  """Indices into the split (module docstring); all frames when `max_frames` is None/0."""
  if max_frames is not None and max_frames < 0:
    raise ValueError(f'max_frames must be a positive number of frames (0: all), got {max_frames}')
  n = len(data.positions)
  if not max_frames or max_frames >= n:
    return np.arange(n)
  file_id = np.asarray(data.file_id)
  out = []
  for f in np.unique(file_id):
    rows = np.flatnonzero(file_id == f)
    out.append(rows[:math.ceil(max_frames * len(rows) / n)])
  return np.concatenate(out)


def add_noise(positions: np.ndarray, noise_mm: float, seed: int) -> np.ndarray:
  if noise_mm <= 0:
    return positions
  rng = np.random.default_rng(seed)
  return positions + rng.normal(scale=noise_mm * 1e-3, size=positions.shape).astype(np.float32)


def run_chunked(solve: Solve, positions: np.ndarray, offsets: np.ndarray,
                chunk: int, extras: tuple[np.ndarray, ...] = ()
                ) -> tuple[np.ndarray, float, float]:
  """`solve` over fixed-size chunks (last padded). Returns (output, seconds, compile seconds);
  the first call compiles and is excluded from `seconds`. `extras` (arrays with the leading
  axis N, e.g. orientations) are chunked alike and passed after the offsets."""
  n = len(positions)
  chunk = min(chunk, n)
  pad = -n % chunk
  P, O, *E = [np.concatenate([a, np.repeat(a[-1:], pad, 0)])
              for a in (positions, offsets) + tuple(extras)]
  t = time.perf_counter()
  jax.block_until_ready(solve(P[:chunk], O[:chunk], *[e[:chunk] for e in E]))
  compile_s = time.perf_counter() - t
  outs = []
  t = time.perf_counter()
  for s in range(0, len(P), chunk):
    outs.append(solve(P[s:s + chunk], O[s:s + chunk], *[e[s:s + chunk] for e in E]))
  out = np.concatenate([np.asarray(o) for o in jax.block_until_ready(outs)])[:n]
  return out, time.perf_counter() - t, compile_s


def _bucket(n: int, window: int) -> int:
  """Clip length padded to a power-of-two number of windows (few distinct compiled shapes)."""
  return window * padding.power_of_two(math.ceil(n / window))


def run_clips(method: Method, positions: np.ndarray, offsets: np.ndarray,
              file_ids: np.ndarray) -> tuple[np.ndarray, float, float]:
  """Warm-start methods: each file's frames in order as one clip (offsets of its subject),
  padded to a bucketed length; the first clip of each bucket also runs once untimed (compile)."""
  out = np.zeros(positions.shape[:2] + (3, 3), np.float32)
  window = method.info['solver']['window']
  seconds = compile_s = 0.0
  compiled: set[int] = set()
  for f in np.unique(file_ids):
    rows = np.flatnonzero(file_ids == f)
    L = _bucket(len(rows), window)
    clip = np.concatenate([positions[rows], np.repeat(positions[rows[-1:]], L - len(rows), 0)])
    args = (clip, offsets[rows[0]])
    if L not in compiled:
      t = time.perf_counter()
      jax.block_until_ready(method.clip_solve(*args))
      compile_s += time.perf_counter() - t
      compiled.add(L)
    t = time.perf_counter()
    out[rows] = np.asarray(jax.block_until_ready(method.clip_solve(*args)))[:len(rows)]
    seconds += time.perf_counter() - t
  return out, seconds, compile_s


OFFSETS = ('subject', 'template')  # `evaluate`'s `offsets`


def evaluate(method: Method, data, rig: Rig, *, max_frames: int | None = None,
             noise_mm: float = 0.0, seed: int = 0,
             temporal_filter: temporal.FilterConfig | None = None,
             sparse: SparseInputs | None = None, subject_calibration: bool = False,
             offsets: str = 'subject', subject_scale: float = 1.0) -> dict:
  """Runs `method` on `data` (a `data.Dataset`) and returns the result JSON object.

  `sparse` (issue G2): observed joints (tracker subset and/or random dropout: the others reach
  the method as NaN, which IK-GAT with joint masks reads as missing) and orientation inputs;
  methods that cannot take them refuse (`check_sparse_support`).

  `temporal_filter` (issue G3) filters the method's output causally, each file (clip) on its own,
  before scoring; its time is part of `seconds` (its compile is not). Every result carries the
  jitter of the output and of the ground truth (`metrics.jitter_summary`).

  `subject_calibration`: each file's output (after any filter) turned by its subject's biases
  at the joints whose children branch, measured on that file's input frames
  (`subject_calibration.calibrate_clip`, as `IKSolver(subject_calibration=True)` does for a
  clip); its time is part of `seconds`.

  `offsets`: the rest offsets the method (and the calibration) is given: 'subject' (each
  frame's subject's own) or 'template' (the rig's template, as `IKSolver` takes for an input of
  positions alone, without the subject's offsets). The errors are always against the
  subject's own rotations and FK, so 'template' measures what not knowing them costs.

  `subject_scale` k: every body k times its size (positions, offsets and end sites scaled; the
  rotations are the same), before any noise: a subject smaller or larger than the data's.
  """
  if offsets not in OFFSETS:
    raise ValueError(f'offsets must be one of {", ".join(OFFSETS)}, got {offsets!r}')
  if not (math.isfinite(subject_scale) and subject_scale > 0):
    raise ValueError(f'subject_scale must be a positive number, got {subject_scale}')
  idx = select_frames(data, max_frames)
  batch = {k: np.asarray(v) for k, v in
           input_pipeline.gather_batch(data, idx).items()}
  if subject_scale != 1.0:
    batch.update({k: (batch[k] * subject_scale).astype(batch[k].dtype)
                  for k in ('positions', 'offsets') if k in batch})
  given = (batch['offsets'] if offsets == 'subject' else
           np.broadcast_to(rig.template(), batch['offsets'].shape).astype(batch['offsets'].dtype))
  file_ids = np.asarray(data.file_id[idx])
  noisy = add_noise(batch['positions'], noise_mm, seed)
  sparse = sparse or SparseInputs()
  noisy, extras, sparse_info = sparse_inputs(sparse, method, noisy, data, idx, rig)
  if sparse.end_sites and subject_scale != 1.0:  # the true end sites, scaled with the body
    extras = extras[:-2] + ((extras[-2] * subject_scale).astype(np.float32), extras[-1])
  frame_index = np.asarray(data.frame_index[idx])
  k = int(method.info.get('input_window', 1))
  if k > 1:  # issue K: each frame with its past frames, from the same noisy frames (windows.py)
    i0, i1, w = windows.history_sources(np.arange(len(idx)), windows.run_starts(
        file_ids, frame_index), k, data.fps / float(method.info['input_window_fps']))
    noisy = np.concatenate([windows.interpolate(noisy, i0, i1, w), noisy[:, None]], axis=1)
  if method.clip_solve is not None:
    pred, seconds, compile_s = run_clips(method, noisy, given, file_ids)
  else:
    pred, seconds, compile_s = run_chunked(method.solve, noisy, given, method.chunk, extras)
  temporal_filter = temporal_filter or temporal.FilterConfig()
  if temporal_filter.active:
    filt = lambda: temporal.filter_clips(pred, file_ids, temporal_filter, data.fps, frame_index)
    t = time.perf_counter()
    filt()  # compile (and a first run), excluded like the method's
    compile_s += time.perf_counter() - t
    t = time.perf_counter()
    pred = filt()
    seconds += time.perf_counter() - t
  if subject_calibration:
    t = time.perf_counter()
    seen = noisy if noisy.ndim == 3 else noisy[:, -1]  # a window model's current frames
    pred = np.array(pred)
    for f in np.unique(file_ids):
      rows = np.flatnonzero(file_ids == f)
      pred[rows] = subject_calibration_lib.calibrate_clip(pred[rows], seen[rows],
                                                       given[rows[0]], rig)[0]
    seconds += time.perf_counter() - t
  errors = metrics.compute_errors_batched(pred, batch['local_rot'], batch['offsets'],
                                          batch['bone_frames'], batch['positions'], rig)
  result = {'method': method.name, 'split': data.split, **metrics.summarize(errors, rig)}
  result.update(seconds=seconds, compile_seconds=compile_s,
                frames_per_s=len(idx) / max(seconds, 1e-9), noise_mm=noise_mm,
                settings=method.info, temporal_filter=temporal_filter.to_dict(),
                subject_calibration=bool(subject_calibration), offsets=offsets,
                subject_scale=subject_scale)
  result.update(metrics.jitter_summary(pred, batch['local_rot'], file_ids, data.fps, rig,
                                       frame_index))
  if sparse_info:
    result['sparse'] = sparse_info
  subject_names = [s['name'] for s in data.subjects]
  file_names = [f['file'] for f in data.files]
  result['per_subject'] = metrics.summarize_by(errors, np.asarray(data.subject_id[idx]),
                                               subject_names, rig)
  result['per_file'] = metrics.summarize_by(errors, file_ids, file_names, rig)
  parts = np.asarray([data.files[f].get('part') or data.split for f in file_ids])
  part_names = sorted(set(parts))
  result['per_part'] = metrics.summarize_by(errors, np.searchsorted(part_names, parts),
                                            part_names, rig)
  result['provenance'] = provenance.provenance(
      rig_hash=rig.fingerprint(), **provenance.data_provenance(data))
  return result


@dataclasses.dataclass(frozen=True)
class SparseInputs:
  """Sparse-input evaluation (issue G2): `trackers` a `trackers.tracker_mask` spec (full, a
  named subset such as 6 or 10, or joint names A,B,C); `joint_dropout` each observed joint
  further dropped with this probability (seeded by `seed`); `orientations` joint names whose
  world rotation (ground truth) is given; `end_sites` gives every end site the data has (the
  leaves' head top, hand and toe tips; needs shards with end sites)."""
  trackers: str = 'full'
  joint_dropout: float = 0.0
  orientations: tuple[str, ...] = ()
  seed: int = 0
  end_sites: bool = False

  @property
  def active(self) -> bool:
    return (self.trackers != 'full' or self.joint_dropout > 0 or bool(self.orientations)
            or self.end_sites)


def check_sparse_support(method: Method, masked: bool, orientations: bool,
                         end_sites: bool = False) -> None:
  """Refuses sparse inputs a method cannot take (only IK-GAT trained for them can)."""
  caps = method.info.get('sparse_inputs', {})
  if masked and not caps.get('joint_mask'):
    raise ValueError(f'method {method.name!r} needs every joint: missing joints (--trackers, '
                     '--joint_dropout) need an ikgat checkpoint trained with '
                     'config.model.joint_mask=True (and no --refine_iters)')
  if orientations and not caps.get('orientation_inputs'):
    raise ValueError(f'method {method.name!r} takes no orientation inputs (--orientations need '
                     'an ikgat checkpoint with config.model.orientation_inputs)')
  if end_sites and not caps.get('end_sites'):
    raise ValueError(f'method {method.name!r} takes no end sites (--end_sites needs an ikgat '
                     'checkpoint with config.model.end_sites=True)')


def sparse_inputs(sparse: SparseInputs, method: Method, positions: np.ndarray, data, idx,
                  rig: Rig) -> tuple[np.ndarray, tuple[np.ndarray, ...], dict]:
  """(positions with NaN at unobserved joints, extra solve arguments, the result's 'sparse'
  entry); unchanged, (), {} when `sparse` is inactive."""
  if not sparse.active:
    return positions, (), {}
  mask = np.broadcast_to(trackers.tracker_mask(rig, sparse.trackers), positions.shape[:2])
  if sparse.joint_dropout > 0:
    mask = mask & trackers.random_masks(len(positions), sparse.joint_dropout, rig.num_joints,
                                        sparse.seed)
  check_sparse_support(method, not mask.all(), bool(sparse.orientations), sparse.end_sites)
  positions = np.where(mask[..., None], positions, np.nan).astype(np.float32)
  extras = ()
  if sparse.orientations:
    given = np.zeros(rig.num_joints, bool)
    given[list(trackers.joint_indices(rig, sparse.orientations))] = True
    extras = (np.asarray(data.global_rot[idx], np.float32),
              np.broadcast_to(given, positions.shape[:2]).copy())
  info = {'trackers': sparse.trackers, 'joint_dropout': sparse.joint_dropout,
          'orientations': list(sparse.orientations), 'seed': sparse.seed,
          'observed_joints_mean': float(mask.sum(-1).mean())}
  if sparse.end_sites:  # true end sites (no input noise), NaN = absent
    ends = np.asarray(data_lib.require_end_sites(data), np.float32)[idx]
    present = np.all(np.isfinite(ends), axis=-1)
    if not extras:  # zero-width placeholders: no orientations
      extras = (np.zeros((len(positions), 0), np.float32), np.zeros((len(positions), 0), bool))
    extras = extras + (ends, present)
    info.update(end_sites=[rig.joint_names[k] for k in rig.leaves],
                end_sites_given_mean=float(present.sum(-1).mean()))
  return positions, extras, info


# ----------------------------------------------------------------------------------------------
# Methods.


def ikgat_method(checkpoint: str | Path | None, rig: Rig, chunk: int = 1024,
                 dtype: str = 'float32',
                 refine: iterative_ik.SolverConfig | None = None,
                 prior_dir: str | Path | None = None,
                 loaded_prior: Prior | None = None, mirror: bool = False,
                 matmul_precision: str = 'float32', size_normalization: bool = False) -> Method:
  """IK-GAT from a run or checkpoint directory (default: the shipped one).

  `refine` (amortized + refine) with `w_prior > 0` uses the pose prior (`loaded_prior`, or
  loaded from `prior_dir`, default the shipped one) in the refinement (`SolverConfig.w_prior`).
  `mirror`: test-time mirror averaging (`inference.ikgat_infer`), before any refinement.

  A window model (issue K; `info['input_window']` k > 1) takes positions `[N, k, J, 3]`, each
  frame's past frames then itself (`evaluate` builds them per clip); given `[N, J, 3]` it reads
  every frame as the first of a stream (its past frames copies of it).

  `dtype` 'bfloat16' runs the network in bfloat16 (parameters and input positions cast; the
  rest pose's bone frames stay float32, so conversions to local rotations promote to float32).
  `matmul_precision` 'bfloat16' runs only the network's large products with bfloat16 inputs and
  float32 sums (`model.set_matmul_precision`), everything else as `dtype`.
  `size_normalization`: the network sees each body at the rig template's size, as `IKSolver`
  does by default (`inference.ikgat_infer`); off here, so the figures measure the network as
  trained unless asked.
  """
  path = Path(checkpoint) if checkpoint else inference.SHIPPED_IKGAT
  model, meta = inference.load_model(path, expected_rig=rig)
  model = cast_floating(model, dtype)
  model_lib.set_matmul_precision(model, matmul_precision)
  B_of = _bone_frames_fn(rig)

  window = model.config.window
  prior = None
  if refine is not None and refine.w_prior > 0:
    prior = loaded_prior or load_prior(prior_dir, rig)
    if not prior.decode.bone_chart and prior.rig_fingerprint not in (None, rig.fingerprint()):
      raise ValueError(f'the refinement\'s prior {prior.path} models local rotations in its own '
                       'rig\'s binds (a joint-chart prior), not this rig\'s: pass a bone-chart '
                       'prior (--prior) or --norefine_prior')
  prior_fn = (prior.decode, prior.params) if prior is not None else None

  @functools.partial(jax.jit, compiler_options=inference.compiler_options(model))
  def solve(positions, offsets, orientations=None, orientation_mask=None, end_sites=None,
            end_site_mask=None):
    batch = {'bone_frames': B_of(offsets), 'offsets': offsets}
    if window > 1 and positions.ndim == 4:  # [N, k, J, 3]: the past frames, then the current
      batch['history'] = positions[:, :-1].astype(dtype)
      positions = positions[:, -1]
    elif window > 1:  # [N, J, 3] alone (the benchmark's timing): each frame starts a stream
      batch['history'] = jnp.repeat(positions[:, None], window - 1, axis=1).astype(dtype)
    batch['positions'] = positions.astype(dtype)
    if model.config.joint_mask:  # NaN joints are missing (sparse evaluation, issue G2)
      batch['joint_mask'] = jnp.all(jnp.isfinite(positions), axis=-1)
    if orientations is not None and orientations.shape[-1]:  # width 0: a placeholder
      batch.update(orientations=orientations.astype(dtype), orientation_mask=orientation_mask)
    if end_sites is not None:
      batch.update(end_sites=end_sites.astype(dtype), end_site_mask=end_site_mask)
    return inference.ikgat_infer(model, batch, refine=refine, prior=prior_fn, mirror=mirror,
                                 size_normalization=size_normalization).astype(jnp.float32)

  info = {'checkpoint': str(path), 'model': meta['config']['model'],
          'trained_steps': meta.get('step'), 'dtype': dtype,
          'matmul_precision': matmul_precision, 'input_window': window,
          'input_window_fps': model.config.window_fps,
          'temporal': temporal.from_checkpoint_meta(meta).to_dict(),  # the checkpoint's filter
          'sparse_inputs': {'joint_mask': model.config.joint_mask and refine is None,
                            'orientation_inputs': list(model.config.orientation_inputs),
                            'end_sites': model.config.end_sites}}
  if refine is not None:
    info['refine'] = dataclasses.asdict(refine)
  if prior is not None:
    info['refine_prior'] = str(prior.path)
  info['mirror'] = mirror
  info['size_normalization'] = size_normalization

  name = 'ikgat' + ('+mirror' if mirror else '')
  name += '' if refine is None else f'+refine{refine.iters}'
  name += '+prior' if prior is not None else ''
  return Method(name, solve, chunk, info)


def cast_floating(model: nnx.Module, dtype: str) -> nnx.Module:
  """A copy of `model` with its floating-point state in `dtype` (the model itself if float32)."""
  if jnp.dtype(dtype) == jnp.float32:
    return model
  graphdef, state = nnx.split(model)
  cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return nnx.merge(graphdef, jax.tree.map(cast, state))


def _bone_frames_fn(rig: Rig):
  return lambda offsets: bone_frames.bone_frames(offsets, rig)


def swing_method(rig: Rig, chunk: int = 4096) -> Method:
  """Swing-only IK from the rig's reference pose (iterative_ik docstring), stated in the JSON."""
  ref = ('the rig\'s reference_pose' if rig.has_reference_pose else
         'the zero pose (the rig names no other reference pose)')
  return Method('swing', jax.jit(lambda p, o: iterative_ik.swing_ik(p, o, rig)), chunk,
                {'swing_reference': ref})


def mean_pose_method(train_data, rig: Rig, chunk: int = 4096) -> Method:
  mean_local = iterative_ik.mean_pose(jnp.asarray(train_data.local_rot, jnp.float32))
  solve = jax.jit(lambda p, o: iterative_ik.mean_pose_ik(p, o, mean_local, rig))
  return Method('mean_pose', solve, chunk, {'train_frames': len(train_data.local_rot)})


@dataclasses.dataclass(frozen=True)
class Prior:
  """A restored pose prior as the latent solvers take it: `decode(params, z [latent]) ->
  [J-1, 3, 3]` (static, hashable), its traced `params`, the latent size, where it came from."""
  decode: iterative_ik.Decode
  params: Any
  latent: int
  path: Path
  rig_fingerprint: str | None = None  # the rig it was trained on (`Rig.fingerprint`)


def load_prior(prior_dir: str | Path | None, rig: Rig) -> Prior:
  """The pose prior of a run or checkpoint directory (default: the shipped one)."""
  path = Path(prior_dir) if prior_dir else inference.SHIPPED_PRIOR
  model, meta = inference.load_model(path, task=prior_task.PRIOR_TASK, expected_rig=rig)
  decode, params = vposer.decoder(model)
  return Prior(decode, params, model.config.latent, path, Rig.from_json(meta['rig']).fingerprint())


def iterative_method(rig: Rig, config: iterative_ik.SolverConfig, prior_dir: str | Path | None,
                     use_prior: bool, warm_start: bool, chunk: int = 1024,
                     loaded_prior: Prior | None = None) -> Method:
  """Iterative IK with the prior (`loaded_prior`, or loaded from `prior_dir`) or without one."""
  info = {'solver': dataclasses.asdict(config), 'warm_start': warm_start}
  if use_prior:
    prior = loaded_prior or load_prior(prior_dir, rig)
    d, params, latent = prior.decode, prior.params, prior.latent
    info['prior'] = str(prior.path)
    info['prior_bone_chart'] = bool(d.bone_chart)  # rig-invariant prior (issue L)
    cold = lambda p, o: iterative_ik.solve_latent_jit(p, o, d, params, rig, config, latent)[0]
    warm = lambda p, o: iterative_ik.solve_latent_warm_jit(p, o, d, params, rig, config,
                                                            latent)[0]
    name = 'iterative'
  else:
    cold = lambda p, o: iterative_ik.solve_rotations_jit(p, o, rig, config)[0]
    warm = lambda p, o: iterative_ik.solve_rotations_warm_jit(p, o, rig, config)[0]
    name = 'iterative_noprior'
  return Method(name, cold, chunk, info, clip_solve=warm if warm_start else None)


def make_method(name: str, rig: Rig, *, train_data=None, checkpoint=None, prior=None,
                solver: iterative_ik.SolverConfig | None = None, warm_start: bool = False,
                chunk: int | None = None, dtype: str = 'float32',
                refine: iterative_ik.SolverConfig | None = None, mirror: bool = False,
                matmul_precision: str = 'float32', size_normalization: bool = False) -> Method:
  """The method `name` (one of `METHODS`) for `rig`; `dtype`, `matmul_precision`,
  `size_normalization` (`ikgat_method`),
  `mirror` (test-time mirror
  averaging) and `refine` (amortized + refine: `refine_rotations` from IK-GAT's output) apply to
  IK-GAT only; `prior` (a directory; default
  the shipped prior) serves the iterative solver and a refinement with `w_prior > 0`."""
  kw = {'chunk': chunk} if chunk else {}
  if name == 'ikgat':
    return ikgat_method(checkpoint, rig, dtype=dtype, refine=refine, prior_dir=prior,
                        mirror=mirror, matmul_precision=matmul_precision,
                        size_normalization=size_normalization, **kw)
  if matmul_precision != 'float32':
    raise ValueError('a matmul precision applies to ikgat only')
  if size_normalization:
    raise ValueError('size normalization applies to ikgat only')
  if name == 'swing':
    return swing_method(rig, **kw)
  if name == 'mean_pose':
    if train_data is None:
      raise ValueError('mean_pose needs the training split (its mean pose)')
    return mean_pose_method(train_data, rig, **kw)
  if name in ('iterative', 'iterative_noprior'):
    return iterative_method(rig, solver or iterative_ik.SolverConfig(), prior,
                            use_prior=name == 'iterative', warm_start=warm_start, **kw)
  raise ValueError(f'unknown method {name!r}; choose from {", ".join(METHODS)}')


def markdown_grid(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
  """The one markdown-table renderer: a header row, the first column left-aligned and the
  others right-aligned, one line per row of cells (strings)."""
  lines = ['| ' + ' | '.join(header) + ' |',
           '|' + '|'.join(['---'] + ['---:'] * (len(header) - 1)) + '|']
  return '\n'.join(lines + ['| ' + ' | '.join(r) + ' |' for r in rows])


RESULT_COLUMNS = ('method', 'frames', 'local (deg)', 'root (deg)', 'global (deg)', 'twist (deg)',
                  'swing (deg)', 'MPJPE (mm)')


def result_cells(r: dict, label: str | None = None) -> list[str]:
  """A result JSON's row under `RESULT_COLUMNS`."""
  return [label or r['method'], str(r['frames'])] + [
      f'{r[k]:.2f}' for k in ('local_rot_err_deg', 'root_rot_err_deg', 'global_rot_err_deg',
                               'twist_err_deg', 'swing_err_deg', 'mpjpe_mm')]


def markdown_table(result: dict) -> str:
  rows = [result_cells(result)] + [result_cells(r, f"{result['method']} ({part})")
                                   for part, r in result.get('per_part', {}).items()]
  lines = [markdown_grid(RESULT_COLUMNS, rows)]
  lines.append(f"\n{result['frames']} frames in {result['seconds']:.2f} s: "
               f"{result['frames_per_s']:,.0f} frames/s (compile {result['compile_seconds']:.1f} s "
               'excluded)')
  if 'jitter_deg_s2' in result:
    filt = temporal.FilterConfig(**result.get('temporal_filter', {})).describe()
    lines.append(f"jitter {result['jitter_deg_s2']:,.0f} deg/s^2 vs ground truth "
                 f"{result['gt_jitter_deg_s2']:,.0f} (ratio {result['jitter_ratio']:.2f}; "
                 f"filter {filt})")
  return '\n'.join(lines)
