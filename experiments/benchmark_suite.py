"""The benchmark suite: amortized IK-GAT against iterative IK, accuracy and speed side by side.

`run_suite(data_dir, output_dir, config)` runs, in one process, on one split (default 'test'):
 1. accuracy of every method (`evaluation.evaluate`, the one metrics module) on the same frames:
    each IK-GAT size found (float32, and when `bf16` the whole network in bfloat16 and only its
    large products in bfloat16, `+bf16_products`), iterative IK with the prior
    (cold analytic root, cold identity root, warm start), iterative IK without a prior, the
    swing-only and mean-pose floors; rows per test part, per-subject and per-file (activity)
    tables; the fast methods (IK-GAT, floors) also on the whole split;
 2. the Pareto picture: local rotation error against milliseconds per frame at one batch size
    (`pareto_batch`): each iterative budget a point, each IK-GAT size a point, the floors;
 3. noise curves (Gaussian per coordinate, mm) for IK-GAT, the floors and the iterative solvers;
 4. initial-pose robustness of the iterative solvers: identity root, analytic root, and the
    analytic root turned by a yaw about the rig's up axis (`init_yaw_deg`);
 5. per-joint local rotation error of every method;
 6. speed: single-frame latency (batch 1, compiled, median and p99 over many calls, each with
    `block_until_ready`), throughput at `batch_sizes`, the IK-GAT block-size sweep with large
    inputs run in blocks of the best block size (what a batch API does), FLOPs per frame (XLA's
    cost analysis; iterative solvers: one iteration times the budget) and achieved GFLOP/s next
    to a large float32 (and bfloat16) matmul's GFLOP/s measured in the same run; the ratios
    IK-GAT / iterative (default budget) at batch 1, at `pareto_batch`, and best against best.

The common frames ("subset") are `evaluation.select_frames(split, max_frames)`: every file's first
frames, in proportion. Timing inputs are subset frames tiled to the batch size. The cold-start
iterative rows run through `cold_core`: one compiled solve per (budget, batch shape) whatever the
initial root (analytic, identity, yawed), bit-identical to `evaluation.iterative_method`'s cold
solve from the analytic root; the warm-start row is `evaluation.iterative_method` itself.

Modes (`PRESETS`; any field can be overridden):

| field | smoke (CI, < 1 min) | quick (minutes) | full |
|---|---|---|---|
| max_frames (subset) | 64 | 256 | 1024 |
| iters (default budget) | 10 | 100 | 100 |
| budgets (Pareto) | 5, 10 | 10, 30, 100 | 10, 30, 100, 300 |
| noise_mm | 0, 20 | 0, 10, 20, 30, 50 | 0, 10, 20, 30, 50 |
| init_yaw_deg | 90 | 90, 180 | 45, 90, 180 |
| batch_sizes | 64, 256 | 64, 256, 1024, 16384 | 64, 256, 1024, 16384 |
| block_sweep (IK-GAT) | 64, 256 | 64, 256, 1024, 4096 | 32, 64, ..., 4096 |
| iterative_batch_cap | 64 | 256 | 1024 |
| pareto_batch | 64 | 256 | 1024 |
| latency calls (at most) | 20 | 300 | 2000 |
| matmul_n | 512 | 2048 | 2048 |
| whole split (fast methods) | no | yes | yes |
| warm-start row | no | yes | yes |

The iterative solvers are timed only at batch sizes up to `iterative_batch_cap` (16384 frames
times 100 iterations is minutes per call on a small CPU and says nothing new: their throughput is
flat in the batch size); the cap is written into the results.

Outputs in `output_dir`: benchmark.json, tables.md (every markdown table, with the command,
machine and date), pareto.png, noise.png, per_joint.png, throughput.png and init.png, each written
atomically; `markdown_report` and `write_plots` rebuild them from benchmark.json. Its keys:

  mode, config, command, skipped {method: reason}, checkpoints {ikgat: {name: dir}, prior},
  data {dir, split, split_frames, subset_frames}, methods {name: {kind, settings}},
  matmul {float32|bfloat16: {n, seconds, gflops_per_s}},
  accuracy {method: evaluation result (fields of DESIGN section 9, per_part, per_subject,
    per_file, per_joint, settings)}, accuracy_whole_split {fast method: the same},
  speed {method: {latency {median_ms, p99_ms, frames_per_s, calls, compile_s},
    throughput {batch: {frames_per_s, ms_per_frame, ...}}, best_frames_per_s, flops_per_frame,
    gflops_per_s_batch1, gflops_per_s_best, capped_batches}},
  block_sweep {ikgat method: {frames_per_s {block: rate}, best_block, best_frames_per_s,
    blocked {batch: {block, frames_per_s, ...}}}},
  pareto [{name, family, iters?, local_rot_err_deg, mpjpe_mm, ms_per_frame, frames_per_s, batch}],
  noise {method: [{noise_mm, local_rot_err_deg, root_rot_err_deg, ..., mpjpe_mm}]},
  init_robustness {family: {init: {local_rot_err_deg, root_rot_err_deg, mpjpe_mm, frames}}},
  bf16 {ikgat method: {bfloat16 ('whole network' | 'large products'), local_rot_err_deg_f32,
    ..._bf16, local_rot_err_change_deg, mpjpe_change_mm, speedup_batch1, speedup_best}},
  ratios {pairs {'ikgat_x/iterative': {batch1, same_batch, same_batch_size, batched_best,
    flops_ratio, ikgat_flops_per_frame, iterative_flops_per_frame, iterative_iters}},
    ikgat_left_of_iterative}, provenance, seconds, files.
Non-finite numbers are written as null.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from ik_gat_jax import checkpointing
from ik_gat_jax import data as data_lib
from ik_gat_jax import evaluation
from ik_gat_jax import gat
from ik_gat_jax import inference
from ik_gat_jax import input_pipeline
from ik_gat_jax import iterative_ik
from ik_gat_jax import plots
from ik_gat_jax import provenance
from ik_gat_jax import rotations
from ik_gat_jax.evaluation import Method, markdown_grid
from ik_gat_jax.io import atomic
from ik_gat_jax.skeleton import Rig

PLOTS = ('pareto.png', 'noise.png', 'per_joint.png', 'throughput.png', 'init.png')


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
  """What the suite runs (module docstring has the presets). Frames and batches are counts."""
  mode: str = 'full'
  split: str = 'test'
  max_frames: int | None = 1024  # the common subset; None or 0: the whole split
  iters: int = 100  # default budget of the iterative rows, the noise and speed sections
  warm_iters: int = 20
  window: int = 30
  budgets: tuple[int, ...] = (10, 30, 100, 300)
  noise_mm: tuple[float, ...] = (0.0, 10.0, 20.0, 30.0, 50.0)
  init_yaw_deg: tuple[float, ...] = (45.0, 90.0, 180.0)
  batch_sizes: tuple[int, ...] = (64, 256, 1024, 16384)
  block_sweep: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)
  iterative_batch_cap: int = 1024
  pareto_batch: int = 1024
  chunk: int = 1024  # frames per call in the accuracy runs
  latency_calls: int = 2000
  latency_seconds: float = 5.0  # per method; at least 10 calls
  throughput_seconds: float = 1.0  # per measurement; at least 3 calls
  matmul_n: int = 2048
  bf16: bool = True
  refine_iters: tuple[int, ...] = ()  # amortized + refine points (G1): ikgat_<size>+refine<N>
  mirror: bool = True  # ikgat_<size>+mirror (and +mirror+refine<max N>+prior): mirror averaging
  whole_split: bool = True  # also the fast methods on the whole split
  warm: bool = True  # the warm-start row (prior)
  seed: int = 0


PRESETS = {
    'full': SuiteConfig(),
    'quick': SuiteConfig(
        mode='quick', max_frames=256, budgets=(10, 30, 100), init_yaw_deg=(90.0, 180.0),
        block_sweep=(64, 256, 1024, 4096), iterative_batch_cap=256, pareto_batch=256, chunk=256,
        latency_calls=300, latency_seconds=1.0, throughput_seconds=0.3),
    'smoke': SuiteConfig(
        mode='smoke', max_frames=64, iters=10, warm_iters=5, window=8, budgets=(5, 10),
        noise_mm=(0.0, 20.0), init_yaw_deg=(90.0,), batch_sizes=(64, 256), block_sweep=(64, 256),
        iterative_batch_cap=64, pareto_batch=64, chunk=64, latency_calls=20,
        latency_seconds=0.2, throughput_seconds=0.02, matmul_n=512, whole_split=False,
        warm=False, mirror=False),
}


def preset(mode: str, **overrides) -> SuiteConfig:
  """The preset `mode` ('smoke', 'quick', 'full') with `overrides` (None values ignored)."""
  if mode not in PRESETS:
    raise ValueError(f'unknown mode {mode!r}; choose from {", ".join(PRESETS)}')
  return dataclasses.replace(PRESETS[mode], **{k: v for k, v in overrides.items()
                                               if v is not None})


# ----------------------------------------------------------------------------------------------
# Timing.


def time_calls(thunk: Callable[[], Any], *, min_calls: int, max_calls: int,
               seconds: float) -> tuple[np.ndarray, float]:
  """Seconds per call of `thunk()`, each call waited on with `block_until_ready`.

  The first call (compilation) is untimed and returned apart. Calls stop at `max_calls`, or
  once `min_calls` were made and `seconds` have passed. Returns `(seconds per call [calls],
  first call seconds)`.
  """
  t = time.perf_counter()
  jax.block_until_ready(thunk())
  first = time.perf_counter() - t
  times: list[float] = []
  start = time.perf_counter()
  while len(times) < max_calls:
    t = time.perf_counter()
    jax.block_until_ready(thunk())
    times.append(time.perf_counter() - t)
    if len(times) >= min_calls and time.perf_counter() - start >= seconds:
      break
  return np.asarray(times), first


def latency(solve: Callable, positions: jax.Array, offsets: jax.Array, *, calls: int,
            max_seconds: float) -> dict:
  """Single-frame latency of a compiled `solve([1, J, 3], [1, J, 3])`: median and p99 over
  `calls` calls (fewer, but at least 10, when they take longer than `max_seconds`)."""
  times, first = time_calls(lambda: solve(positions[:1], offsets[:1]), min_calls=min(10, calls),
                            max_calls=calls, seconds=max_seconds)
  median = float(np.median(times))
  return {'median_ms': 1e3 * median, 'p99_ms': 1e3 * float(np.percentile(times, 99)),
          'frames_per_s': 1.0 / median, 'calls': len(times), 'compile_s': first}


def throughput(solve: Callable, positions: jax.Array, offsets: jax.Array, *,
               min_seconds: float) -> dict:
  """Frames per second of `solve` on one batch `[B, J, 3]` (median call time)."""
  times, first = time_calls(lambda: solve(positions, offsets), min_calls=3, max_calls=200,
                            seconds=min_seconds)
  median = float(np.median(times))
  n = int(positions.shape[0])
  return {'batch': n, 'frames_per_s': n / median, 'ms_per_frame': 1e3 * median / n,
          'seconds_per_call': median, 'calls': len(times), 'compile_s': first}


def blocked_throughput(solve: Callable, positions: jax.Array, offsets: jax.Array, block: int, *,
                       min_seconds: float) -> dict:
  """Frames per second of a large input run in blocks of `block` frames (a batch API's way);
  `len(positions)` must be a multiple of `block`."""
  n = int(positions.shape[0])
  blocks = [(positions[s:s + block], offsets[s:s + block]) for s in range(0, n, block)]
  times, first = time_calls(lambda: [solve(p, o) for p, o in blocks], min_calls=3,
                            max_calls=200, seconds=min_seconds)
  median = float(np.median(times))
  return {'batch': n, 'block': block, 'frames_per_s': n / median,
          'ms_per_frame': 1e3 * median / n, 'calls': len(times), 'compile_s': first}


def matmul_gflops(n: int, dtype: str = 'float32', min_seconds: float = 0.5,
                  precision: str | None = None) -> dict:
  """GFLOP/s of an `n x n` by `n x n` matmul (2 n^3 FLOPs), jitted, median call time.
  `precision` 'bfloat16': float32 matrices multiplied as IK-GAT's bfloat16 products are
  (`gat.matmul`: bfloat16 inputs, float32 sums, with their XLA options)."""
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), dtype)
  b = jax.random.normal(kb, (n, n), dtype)
  f = jax.jit(jnp.matmul)
  if precision is not None:
    f = jax.jit(lambda x, y: gat.matmul(x, y, precision),
                compiler_options=inference.precision_options(precision))
  times, _ = time_calls(lambda: f(a, b), min_calls=3, max_calls=100, seconds=min_seconds)
  median = float(np.median(times))
  out = {'n': n, 'dtype': dtype, 'seconds': median, 'gflops_per_s': 2 * n**3 / median / 1e9}
  return out if precision is None else {**out, 'precision': precision}


# ----------------------------------------------------------------------------------------------
# Checkpoint discovery.


@dataclasses.dataclass
class Found:
  """IK-GAT checkpoints by name (size, or arch_size for dense baselines), the prior, notes."""
  ikgat: dict[str, Path] = dataclasses.field(default_factory=dict)
  prior: Path | None = None
  notes: list[str] = dataclasses.field(default_factory=list)


def _looks_like_checkpoint(path: Path) -> bool:
  """A run directory (with checkpoints/best) or a checkpoint directory (numbered steps)."""
  if (path / 'checkpoints' / 'best').is_dir():
    return True
  return any(c.name.isdigit() and (c / 'meta').is_dir() for c in path.iterdir() if c.is_dir())


def _candidates(root: Path, max_depth: int) -> Iterable[Path]:
  for dirpath, dirnames, _ in os.walk(root, followlinks=True):
    path = Path(dirpath)
    depth = len(path.relative_to(root).parts)
    if _looks_like_checkpoint(path):
      dirnames[:] = []
      yield path
    elif depth >= max_depth:
      dirnames[:] = []
    else:
      dirnames.sort()


def read_meta(path: Path) -> dict:
  """The checkpoint meta of a run directory (its `checkpoints/best`) or a checkpoint directory."""
  return checkpointing.Checkpointer(inference.checkpoint_path(path), create=False).restore_meta()


def model_name(meta: dict) -> str:
  """IK-GAT checkpoints are named by size ('base'); dense baselines 'mlp_base'."""
  model = meta.get('config', {}).get('model', {})
  size, arch = model.get('size', 'unknown'), model.get('arch', 'ikgat')
  return size if arch == 'ikgat' else f'{arch}_{size}'


def discover_checkpoints(root: str | os.PathLike, max_depth: int = 4) -> Found:
  """Every IK-GAT checkpoint (task 'ikgat') and the first pose prior (task 'pose_prior') under
  `root`, found as run directories (`checkpoints/best`) or checkpoint directories. A second
  checkpoint of the same size is named `size:relative/path`."""
  root, found = Path(root), Found()
  if not root.is_dir():
    raise FileNotFoundError(f'checkpoint directory {root} does not exist')
  for path in _candidates(root, max_depth):
    try:
      meta = read_meta(path)
    except checkpointing.CheckpointError as e:
      found.notes.append(f'skipped {path}: {str(e).splitlines()[0]}')
      continue
    if meta.get('task') == 'ikgat':
      name = model_name(meta)
      found.ikgat[name if name not in found.ikgat else f'{name}:{path.relative_to(root)}'] = path
    elif meta.get('task') == 'pose_prior' and found.prior is None:
      found.prior = path
    else:
      found.notes.append(f'skipped {path}: task {meta.get("task")!r}')
  return found


def resolve_checkpoints(checkpoints: str | os.PathLike | None,
                        prior: str | os.PathLike | None) -> Found:
  """`discover_checkpoints(checkpoints)`; `prior` overrides the prior found; the shipped
  checkpoints (inference.SHIPPED_IKGAT / SHIPPED_PRIOR) fill what is missing when they exist."""
  found = discover_checkpoints(checkpoints) if checkpoints else Found()
  if prior:
    found.prior = Path(prior)
  if not found.ikgat and inference.SHIPPED_IKGAT.is_dir():
    found.ikgat[model_name(read_meta(inference.SHIPPED_IKGAT))] = inference.SHIPPED_IKGAT
  if found.prior is None and inference.SHIPPED_PRIOR.is_dir():
    found.prior = inference.SHIPPED_PRIOR
  return found


def default_data_dir(found: Found) -> Path | None:
  """The shard directory a found checkpoint was trained on (its meta's data_dir), if it exists."""
  for path in [*found.ikgat.values(), *([found.prior] if found.prior else [])]:
    d = read_meta(path).get('data', {}).get('data_dir')
    if d and Path(d).is_dir():
      return Path(d)
  return None


# ----------------------------------------------------------------------------------------------
# Methods.


@dataclasses.dataclass
class Context:
  """What every section shares: the split, its common subset on device, methods, timings."""
  config: SuiteConfig
  data: Any  # data.Dataset of the split
  train_data: Any
  rig: Rig
  positions: np.ndarray  # [N, J, 3] the subset, clean
  offsets: np.ndarray  # [N, J, 3]
  prior: evaluation.Prior | None
  log: Callable[[str], None]
  methods: dict[str, Method] = dataclasses.field(default_factory=dict)
  kinds: dict[str, str] = dataclasses.field(default_factory=dict)
  skipped: dict[str, str] = dataclasses.field(default_factory=dict)
  timings: dict[tuple[str, int], dict] = dataclasses.field(default_factory=dict)
  cores: dict[tuple[str, int, bool], Callable] = dataclasses.field(default_factory=dict)

  @property
  def families(self) -> dict[str, evaluation.Prior | None]:
    """Iterative solver families: 'iterative' (the prior; when loaded), 'iterative_noprior'."""
    return {**({'iterative': self.prior} if self.prior else {}), 'iterative_noprior': None}

  def inputs(self, batch: int) -> tuple[jax.Array, jax.Array]:
    """Subset frames tiled to `batch` frames, on device: `([B, J, 3], [B, J, 3])`."""
    rows = np.arange(batch) % len(self.positions)
    return jnp.asarray(self.positions[rows]), jnp.asarray(self.offsets[rows])


def solver_config(cfg: SuiteConfig, **overrides) -> iterative_ik.SolverConfig:
  """The iterative solvers' settings: the suite's budget and warm start, with `overrides`."""
  base = {'iters': cfg.iters, 'warm_iters': cfg.warm_iters, 'window': cfg.window}
  return iterative_ik.SolverConfig(**{**base, **overrides})


def _named(method: Method, name: str) -> Method:
  return dataclasses.replace(method, name=name)


def _add(ctx: Context, name: str, kind: str, make: Callable[[], Method]) -> None:
  ctx.methods[name] = _named(make(), name)
  ctx.kinds[name] = kind


def add_ikgat(ctx: Context, found: Found) -> None:
  """`ikgat_<size>` (and `ikgat_<size>_bf16`) for every IK-GAT checkpoint found, with the
  configured refinement rows and, with `config.mirror`, mirror averaging (`+mirror`, and before
  the prior's refinement at the largest budget)."""
  if not found.ikgat:
    ctx.skipped['ikgat'] = ('no IK-GAT checkpoint under --checkpoints and no shipped one at '
                            f'{inference.SHIPPED_IKGAT}')
  for size, path in found.ikgat.items():
    dtypes = ('float32', 'bfloat16') if ctx.config.bf16 else ('float32',)
    for dtype in dtypes:
      name = f'ikgat_{size}' + ('_bf16' if dtype == 'bfloat16' else '')
      _add(ctx, name, 'ikgat' if dtype == 'float32' else 'ikgat_bf16',
           lambda p=path, d=dtype: evaluation.ikgat_method(p, ctx.rig, ctx.config.chunk, d))
    if ctx.config.bf16:  # only the large products in bfloat16 (`--matmul_precision=bfloat16`)
      _add(ctx, f'ikgat_{size}{BF16_PRODUCTS}', 'ikgat_bf16',
           lambda p=path: evaluation.ikgat_method(p, ctx.rig, ctx.config.chunk,
                                                  matmul_precision='bfloat16'))
    for n in ctx.config.refine_iters:  # same family as IK-GAT: a point on the Pareto plot
      refine = iterative_ik.refine_config(n)
      _add(ctx, f'ikgat_{size}+refine{n}', 'ikgat',
           lambda p=path, r=refine: evaluation.ikgat_method(p, ctx.rig, ctx.config.chunk,
                                                            refine=r))
    if ctx.config.refine_iters and ctx.prior is not None:
      # The refinement with the pose prior (issue J) at the largest budget.
      n = max(ctx.config.refine_iters)
      refine = iterative_ik.refine_config(n, prior=True)
      _add(ctx, f'ikgat_{size}+refine{n}+prior', 'ikgat',
           lambda p=path, r=refine: evaluation.ikgat_method(p, ctx.rig, ctx.config.chunk,
                                                            refine=r, loaded_prior=ctx.prior))
      if ctx.config.mirror:
        _add(ctx, f'ikgat_{size}+mirror+refine{n}+prior', 'ikgat',
             lambda p=path, r=refine: evaluation.ikgat_method(
                 p, ctx.rig, ctx.config.chunk, refine=r, loaded_prior=ctx.prior, mirror=True))
    if ctx.config.mirror:
      _add(ctx, f'ikgat_{size}+mirror', 'ikgat',
           lambda p=path: evaluation.ikgat_method(p, ctx.rig, ctx.config.chunk, mirror=True))


def cold_core(rig: Rig, config: iterative_ik.SolverConfig,
              prior: evaluation.Prior | None) -> Callable:
  """Cold-start iterative IK from a chosen initial root, one compile per (config, shape):

  `solve(positions [N, J, 3], offsets [N, J, 3], analytic, yaw) -> local [N, J, 3, 3]` starts
  every frame from the analytic (Kabsch) root if `analytic` else the identity, turned by `yaw`
  radians about the rig's up axis (both traced), the rest pose (no prior) or z = 0 (prior).
  With `analytic=True, yaw=0` it is `evaluation.iterative_method`'s cold solve.
  """
  up = jnp.asarray(rig.up, jnp.float32)

  def root0(p, o, analytic, yaw):
    eye = jnp.broadcast_to(jnp.eye(3, dtype=p.dtype), p.shape[:-2] + (3, 3))
    R = jnp.where(analytic, iterative_ik.root_rotation(p, o, rig), eye)
    return rotations.matrix_from_axis_angle(yaw * up) @ R

  def solve_noprior(p, o, analytic, yaw):
    init = jnp.broadcast_to(jnp.eye(3, dtype=p.dtype), p.shape + (3,))
    init = init.at[..., 0, :, :].set(root0(p, o, analytic, yaw))
    return iterative_ik.solve_rotations(p, o, rig, config, init_local=init)[0]

  def solve_prior(p, o, analytic, yaw, params):
    # iterative_ik.solve_latent takes no initial root (yet): its cold driver, with ours.
    params0 = iterative_ik.latent_params(root0(p, o, analytic, yaw), o, rig, prior.decode,
                                         prior.latent)
    problem = iterative_ik._latent_problem(prior.decode, params, rig, config)  # noqa: SLF001
    return iterative_ik._solve_cold(problem, params0, p, o, rig, config)[0]  # noqa: SLF001

  if prior is None:
    return jax.jit(solve_noprior)
  jitted = jax.jit(solve_prior)  # the decoder's weights traced, not baked in as constants
  return lambda p, o, analytic, yaw: jitted(p, o, analytic, yaw, prior.params)


def iterative_cold(ctx: Context, family: str, iters: int, init: str = 'analytic_root',
                   yaw_deg: float = 0.0, fit_translation: bool = False) -> Method:
  """Cold-start `family` ('iterative' with the prior, 'iterative_noprior') at `iters`, from
  the analytic or identity root (`init`), turned by `yaw_deg`, the root translation fitted or
  the input root joint's (`SolverConfig.fit_translation`); one compile per budget and fit."""
  config = solver_config(ctx.config, iters=iters, fit_translation=fit_translation)
  prior = ctx.families[family]
  key = (family, iters, fit_translation)
  if key not in ctx.cores:
    ctx.cores[key] = cold_core(ctx.rig, config, prior)
  core, analytic, yaw = ctx.cores[key], init != 'identity_root', math.radians(yaw_deg)
  info = {'solver': dataclasses.asdict(config), 'warm_start': False, 'init': init,
          'init_yaw_deg': yaw_deg, **({'prior': str(prior.path)} if prior else {})}
  return Method(family, lambda p, o: core(p, o, analytic, yaw), ctx.config.chunk, info)


def add_iterative(ctx: Context) -> None:
  """The iterative rows of the accuracy table (with the prior only when one was loaded)."""
  cfg = ctx.config
  if ctx.prior is None:
    ctx.skipped['iterative'] = ('no pose prior under --checkpoints, no --prior and no shipped '
                                f'one at {inference.SHIPPED_PRIOR}')
  else:
    _add(ctx, 'iterative', 'iterative', lambda: iterative_cold(ctx, 'iterative', cfg.iters))
    # The same solver with the root translation fitted (issue J: what the refinement's
    # `fit_translation` gives IK-GAT on noisy input, given to the baseline too); accuracy and
    # noise rows only (its cost is the solver's).
    _add(ctx, 'iterative_fit_translation', 'iterative',
         lambda: iterative_cold(ctx, 'iterative', cfg.iters, fit_translation=True))
    _add(ctx, 'iterative_identity_root', 'iterative',
         lambda: iterative_cold(ctx, 'iterative', cfg.iters, 'identity_root'))
    if cfg.warm:
      _add(ctx, 'iterative_warm', 'iterative', lambda: evaluation.iterative_method(
          ctx.rig, solver_config(cfg), None, True, True, cfg.chunk, loaded_prior=ctx.prior))
  _add(ctx, 'iterative_noprior', 'iterative_noprior',
       lambda: iterative_cold(ctx, 'iterative_noprior', cfg.iters))


def add_floors(ctx: Context) -> None:
  _add(ctx, 'swing', 'floor', lambda: evaluation.swing_method(ctx.rig, ctx.config.chunk))
  _add(ctx, 'mean_pose', 'floor',
       lambda: evaluation.mean_pose_method(ctx.train_data, ctx.rig, ctx.config.chunk))


def build_context(data_dir: str | os.PathLike, found: Found, cfg: SuiteConfig,
                  log: Callable[[str], None]) -> Context:
  """Loads the split, the training split (mean pose), the prior, and every method."""
  data = data_lib.load_shards(data_dir, cfg.split)
  idx = evaluation.select_frames(data, cfg.max_frames)
  batch = input_pipeline.gather_batch(data, idx)
  prior = evaluation.load_prior(found.prior, data.rig) if found.prior else None
  ctx = Context(cfg, data, data_lib.load_shards(data_dir, 'train'), data.rig,
                batch['positions'], batch['offsets'], prior, log)
  add_ikgat(ctx, found)
  add_iterative(ctx)
  add_floors(ctx)
  for name, why in ctx.skipped.items():
    log(f'skipping {name}: {why}')
  return ctx


# ----------------------------------------------------------------------------------------------
# Sections.


def _evaluate(ctx: Context, method: Method, *, whole_split: bool = False,
              noise_mm: float = 0.0) -> dict:
  r = evaluation.evaluate(method, ctx.data, ctx.rig, noise_mm=noise_mm, seed=ctx.config.seed,
                          max_frames=None if whole_split else ctx.config.max_frames)
  r.pop('provenance', None)  # one provenance for the whole benchmark
  return r


def _brief(r: dict) -> str:
  return (f"local {r['local_rot_err_deg']:.2f} deg, root {r['root_rot_err_deg']:.2f} deg, "
          f"MPJPE {r['mpjpe_mm']:.2f} mm, {r['frames']} frames, {r['frames_per_s']:,.0f} frames/s")


def accuracy_section(ctx: Context) -> dict[str, dict]:
  """Every method on the common subset: `{name: evaluation result}`."""
  out = {}
  for name, method in ctx.methods.items():
    out[name] = _evaluate(ctx, method)
    ctx.log(f'accuracy {name}: {_brief(out[name])}')
  return out


def whole_split_section(ctx: Context) -> dict[str, dict]:
  """The fast methods (IK-GAT, floors) on the whole split, when the subset is smaller."""
  if not ctx.config.whole_split or len(ctx.positions) >= len(ctx.data):
    return {}
  out = {}
  for name, method in ctx.methods.items():
    if ctx.kinds[name] in ('ikgat', 'ikgat_bf16', 'floor'):
      out[name] = _evaluate(ctx, method, whole_split=True)
      ctx.log(f'whole split {name}: {_brief(out[name])}')
  return out


def timed(ctx: Context, name: str, method: Method, batch: int) -> dict:
  """Throughput of `method` at `batch`, measured once per (name, batch) in a run."""
  if (name, batch) not in ctx.timings:
    ctx.timings[name, batch] = throughput(method.solve, *ctx.inputs(batch),
                                          min_seconds=ctx.config.throughput_seconds)
  return ctx.timings[name, batch]


def _pareto_point(ctx: Context, name: str, family: str, accuracy: dict, method: Method,
                  timing_name: str | None = None, **label) -> dict:
  t = timed(ctx, timing_name or name, method, ctx.config.pareto_batch)
  point = {'name': name, 'family': family, **label,
           'local_rot_err_deg': accuracy['local_rot_err_deg'], 'mpjpe_mm': accuracy['mpjpe_mm'],
           'ms_per_frame': t['ms_per_frame'], 'frames_per_s': t['frames_per_s'],
           'batch': t['batch']}
  ctx.log(f"pareto {name}: local {point['local_rot_err_deg']:.2f} deg at "
          f"{point['ms_per_frame']:.4f} ms/frame (batch {t['batch']})")
  return point


def pareto_section(ctx: Context, accuracy: dict[str, dict]) -> list[dict]:
  """Local error vs ms/frame at `pareto_batch`: iterative budgets, IK-GAT sizes, floors."""
  points = []
  for name, kind in ctx.kinds.items():
    if kind in ('ikgat', 'ikgat_bf16', 'floor'):
      points.append(_pareto_point(ctx, name, kind, accuracy[name], ctx.methods[name]))
  for family in ctx.families:
    for iters in ctx.config.budgets:
      m = iterative_cold(ctx, family, iters)
      default = iters == ctx.config.iters
      acc = accuracy[family] if default else _evaluate(ctx, m)
      points.append(_pareto_point(ctx, f'{family}@{iters}', family, acc, m, iters=iters,
                                  timing_name=family if default else None))
  return points


def noise_section(ctx: Context, accuracy: dict[str, dict]) -> dict[str, list[dict]]:
  """Errors vs input noise: `{method: [{noise_mm, local_rot_err_deg, ...}]}`."""
  keep = ('local_rot_err_deg', 'root_rot_err_deg', 'global_rot_err_deg', 'twist_err_deg',
          'swing_err_deg', 'mpjpe_mm')
  out = {}
  for name, kind in ctx.kinds.items():
    if kind in ('ikgat_bf16',) or name in ('iterative_identity_root', 'iterative_warm'):
      continue
    curve = []
    for sigma in ctx.config.noise_mm:
      r = accuracy[name] if sigma == 0 else _evaluate(ctx, ctx.methods[name], noise_mm=sigma)
      curve.append({'noise_mm': float(sigma), **{k: r[k] for k in keep}})
    _released(None)
    ctx.log(f'noise {name}: ' + ', '.join(f"{c['noise_mm']:g} mm {c['local_rot_err_deg']:.2f}"
                                          for c in curve))
    out[name] = curve
  return out


def init_section(ctx: Context, accuracy: dict[str, dict]) -> dict[str, dict[str, dict]]:
  """Iterative solvers from different initial poses: `{family: {init: errors}}`."""
  cfg, out = ctx.config, {}
  keep = ('local_rot_err_deg', 'root_rot_err_deg', 'mpjpe_mm', 'frames')
  for family in ctx.families:
    inits = {'analytic_root': accuracy[family]}
    inits['identity_root'] = (accuracy['iterative_identity_root'] if family == 'iterative' else
                              _evaluate(ctx, iterative_cold(ctx, family, cfg.iters,
                                                            'identity_root')))
    for yaw in cfg.init_yaw_deg:
      inits[f'analytic_root_yaw{yaw:g}'] = _evaluate(
          ctx, iterative_cold(ctx, family, cfg.iters, 'analytic_root', yaw))
    out[family] = {k: {f: r[f] for f in keep} for k, r in inits.items()}
    ctx.log(f'init {family}: ' + ', '.join(f"{k} {v['local_rot_err_deg']:.2f}"
                                           for k, v in out[family].items()))
  return out


def _flops(ctx: Context, name: str) -> float:
  """FLOPs per frame (XLA cost analysis; iterative: one iteration times the budget)."""
  p, o = ctx.inputs(inference.flop_frames(min(64, ctx.config.batch_sizes[0])))
  kind, sc = ctx.kinds[name], solver_config(ctx.config)
  if kind == 'iterative_noprior':
    return iterative_ik.solver_flops_per_frame(p, o, ctx.rig, sc)
  if kind == 'iterative':
    pr = ctx.prior
    return iterative_ik.solver_flops_per_frame(p, o, ctx.rig, sc, pr.decode, pr.params,
                                               pr.latent)
  solve = ctx.methods[name].solve
  if hasattr(solve, 'lower'):  # jitted: the executable compiled for this shape is cached
    return _cost_flops(solve.lower(p, o).compile().cost_analysis()) / len(p)
  return iterative_ik.flops_per_frame(solve, p, o)


def _cost_flops(cost: Any) -> float:
  """'flops' of XLA's cost analysis (a dict, or a list of one per computation); NaN if absent."""
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  return float(cost['flops']) if cost and 'flops' in cost else float('nan')


# Rows scored for accuracy (and noise) but not timed: their cost is another row's.
UNTIMED = ('iterative_identity_root', 'iterative_warm', 'iterative_fit_translation')


def _speed_methods(ctx: Context) -> list[str]:
  return [n for n, k in ctx.kinds.items() if n not in UNTIMED]


def speed_of(ctx: Context, name: str) -> dict:
  """Latency, throughput at every batch size (iterative: up to the cap), FLOPs, GFLOP/s."""
  cfg, method = ctx.config, ctx.methods[name]
  iterative = ctx.kinds[name].startswith('iterative')
  batches = [b for b in cfg.batch_sizes if not iterative or b <= cfg.iterative_batch_cap]
  lat = latency(method.solve, *ctx.inputs(1), calls=cfg.latency_calls,
                max_seconds=cfg.latency_seconds)
  thr = {str(b): timed(ctx, name, method, b) for b in batches}
  best = max(t['frames_per_s'] for t in thr.values())
  flops = _flops(ctx, name)
  out = {'latency': lat, 'throughput': thr, 'best_frames_per_s': best, 'flops_per_frame': flops,
         'gflops_per_s_batch1': flops * lat['frames_per_s'] / 1e9,
         'gflops_per_s_best': flops * best / 1e9,
         'capped_batches': [b for b in cfg.batch_sizes if str(b) not in thr]}
  ctx.log(f"speed {name}: batch 1 {lat['median_ms']:.3f} ms (p99 {lat['p99_ms']:.3f}), "
          f"{lat['frames_per_s']:,.0f} frames/s; best batched {best:,.0f} frames/s; "
          f'{flops:,.0f} FLOPs/frame')
  return out


def block_sweep(ctx: Context, name: str) -> dict:
  """IK-GAT throughput at each block size; larger batches run in blocks of the best one."""
  cfg, method = ctx.config, ctx.methods[name]
  sweep = {str(b): timed(ctx, name, method, b)['frames_per_s'] for b in cfg.block_sweep}
  best = int(max(sweep, key=sweep.get))
  blocked = {}
  for b in cfg.batch_sizes:
    if b > best and b % best == 0:
      blocked[str(b)] = blocked_throughput(method.solve, *ctx.inputs(b), best,
                                           min_seconds=cfg.throughput_seconds)
  ctx.log(f'block sweep {name}: best block {best} ({sweep[str(best)]:,.0f} frames/s); in blocks: '
          + (', '.join(f"{b} -> {t['frames_per_s']:,.0f}" for b, t in blocked.items())
             or 'none (no batch size is a larger multiple of it)'))
  return {'frames_per_s': sweep, 'best_block': best, 'best_frames_per_s': sweep[str(best)],
          'blocked': blocked}


BF16_PRODUCTS = '+bf16_products'  # the method-name suffix of IK-GAT with bfloat16 products


def bf16_section(accuracy: dict, speed: dict) -> dict[str, dict]:
  """bfloat16 IK-GAT against float32, per size: the whole network in bfloat16 (`<name>_bf16`,
  keyed by the float32 name) and only its large products (`<name>+bf16_products`, keyed by
  that name): accuracy change and speed-up."""
  out = {}
  for name in accuracy:
    if name.endswith('_bf16'):
      f32_name, key, part = name[:-5], name[:-5], 'whole network'
    elif name.endswith(BF16_PRODUCTS):
      f32_name, key, part = name[:-len(BF16_PRODUCTS)], name, 'large products'
    else:
      continue
    if f32_name not in accuracy:
      continue
    f32, bf = accuracy[f32_name], accuracy[name]
    out[key] = {
        'bfloat16': part,
        'local_rot_err_deg_f32': f32['local_rot_err_deg'],
        'local_rot_err_deg_bf16': bf['local_rot_err_deg'],
        'local_rot_err_change_deg': bf['local_rot_err_deg'] - f32['local_rot_err_deg'],
        'mpjpe_change_mm': bf['mpjpe_mm'] - f32['mpjpe_mm'],
        'speedup_batch1': (speed[name]['latency']['frames_per_s'] /
                           speed[f32_name]['latency']['frames_per_s']),
        'speedup_best': speed[name]['best_frames_per_s'] / speed[f32_name]['best_frames_per_s']}
  return out


def _best_frames_per_s(speed: dict, sweep: dict | None) -> float:
  """The best batched rate of a method: any batch size, block size, or large input in blocks."""
  rates = [speed['best_frames_per_s']]
  if sweep:
    rates += [sweep['best_frames_per_s'], *(t['frames_per_s'] for t in sweep['blocked'].values())]
  return max(rates)


def ratios_section(ctx: Context, speed: dict, sweeps: dict, pareto: list[dict]) -> dict:
  """IK-GAT frames/s over the iterative solvers' (default budget): at batch 1, at the Pareto
  batch size, and best against best; FLOPs per frame of each; whether every IK-GAT point sits
  left of every iterative point on the Pareto plot."""
  pairs, batch = {}, ctx.config.pareto_batch
  for ref in ctx.families:
    for name, kind in ctx.kinds.items():
      if kind not in ('ikgat', 'ikgat_bf16'):
        continue
      ik, it = speed[name], speed[ref]
      pairs[f'{name}/{ref}'] = {
          'ikgat': name, 'iterative': ref, 'iterative_iters': ctx.config.iters,
          'batch1': ik['latency']['frames_per_s'] / it['latency']['frames_per_s'],
          'same_batch': (timed(ctx, name, ctx.methods[name], batch)['frames_per_s'] /
                         timed(ctx, ref, ctx.methods[ref], batch)['frames_per_s']),
          'same_batch_size': batch,
          'batched_best': (_best_frames_per_s(ik, sweeps.get(name)) /
                           _best_frames_per_s(it, None)),
          'flops_ratio': it['flops_per_frame'] / ik['flops_per_frame'],
          'ikgat_flops_per_frame': ik['flops_per_frame'],
          'iterative_flops_per_frame': it['flops_per_frame']}
  ik_ms = [p['ms_per_frame'] for p in pareto if p['family'] == 'ikgat']
  it_ms = [p['ms_per_frame'] for p in pareto if p['family'].startswith('iterative')]
  return {'pairs': pairs,
          'ikgat_left_of_iterative': bool(ik_ms and it_ms and max(ik_ms) < min(it_ms))}


# ----------------------------------------------------------------------------------------------
# The suite.


def _finite_or_none(x: Any) -> Any:
  """JSON without NaN / Infinity: non-finite floats become null."""
  if isinstance(x, dict):
    return {k: _finite_or_none(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_finite_or_none(v) for v in x]
  if isinstance(x, (float, np.floating)):
    return float(x) if math.isfinite(x) else None
  if isinstance(x, np.integer):
    return int(x)
  return x


def run_suite(data_dir: str | os.PathLike, output_dir: str | os.PathLike, config: SuiteConfig,
              found: Found, log: Callable[[str], None] = print, command: str | None = None) -> dict:
  """Runs every section, writes benchmark.json, tables.md and the plots; returns the JSON object.

  `found`: the checkpoints (`resolve_checkpoints`); IK-GAT and the prior solver are skipped, with
  the reason printed and stored under 'skipped', when absent. `log` gets progress lines.
  """
  start = time.perf_counter()
  out_dir = Path(output_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  say = lambda msg: log(f'[{time.perf_counter() - start:7.1f} s] {msg}')
  for note in found.notes:
    say(note)
  ctx = build_context(data_dir, found, config, say)
  say(f'{config.mode}: {len(ctx.positions)} of {len(ctx.data)} {config.split} frames; methods: '
      + ', '.join(ctx.methods))
  result = {'mode': config.mode, 'config': dataclasses.asdict(config),
            'command': command or ' '.join(sys.argv), 'skipped': ctx.skipped,
            'checkpoints': {'ikgat': {k: str(v) for k, v in found.ikgat.items()},
                            'prior': str(found.prior) if found.prior else None},
            'data': {'dir': str(Path(data_dir).absolute()), 'split': config.split,
                     'split_frames': len(ctx.data), 'subset_frames': len(ctx.positions)},
            'methods': {n: {'kind': ctx.kinds[n], 'settings': m.info}
                        for n, m in ctx.methods.items()}}
  result['matmul'] = {d: matmul_gflops(config.matmul_n, d) for d in ('float32', 'bfloat16')}
  say('matmul {n}x{n}: '.format(n=config.matmul_n) + ', '.join(
      f"{d} {m['gflops_per_s']:.1f} GFLOP/s" for d, m in result['matmul'].items()))
  result['accuracy'] = accuracy_section(ctx)
  result['accuracy_whole_split'] = whole_split_section(ctx)
  result['speed'] = {n: _released(speed_of(ctx, n)) for n in _speed_methods(ctx)}
  result['block_sweep'] = {n: _released(block_sweep(ctx, n)) for n, k in ctx.kinds.items()
                           if k == 'ikgat'}
  result['pareto'] = pareto_section(ctx, result['accuracy'])
  result['noise'] = noise_section(ctx, result['accuracy'])
  result['init_robustness'] = init_section(ctx, result['accuracy'])
  result['bf16'] = bf16_section(result['accuracy'], result['speed'])
  result['ratios'] = ratios_section(ctx, result['speed'], result['block_sweep'], result['pareto'])
  result['provenance'] = provenance.provenance(rig_hash=ctx.rig.fingerprint(),
                                               **provenance.data_provenance(ctx.data))
  result['seconds'] = time.perf_counter() - start
  result['files'] = ['benchmark.json', 'tables.md', *PLOTS]
  result = _finite_or_none(result)
  write_outputs(result, out_dir)
  say(f'wrote {out_dir}/benchmark.json, tables.md, ' + ', '.join(PLOTS))
  return result


MAPPINGS_SOFT_LIMIT = 20_000  # of the kernel's default 65,530 per process (vm.max_map_count)


def _memory_mappings() -> int:
  """This process's memory mappings (Linux `/proc/self/maps`; 0 where there is none)."""
  try:
    with open('/proc/self/maps', 'rb') as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


def _released(section: Any) -> Any:
  """`section`, after dropping every compiled executable (`jax.clear_caches`) once this process
  holds more than `MAPPINGS_SOFT_LIMIT` memory mappings: each timed method compiles a dozen
  shapes and LLVM maps every executable's code into its own sections, so two dozen methods
  exhausted the kernel's 65,530 (the run aborted with "Unable to allocate section memory"). A
  later section compiles again what it needs; below the limit (a smoke run) nothing is
  dropped, so nothing is compiled twice."""
  if _memory_mappings() > MAPPINGS_SOFT_LIMIT:
    jax.clear_caches()
  return section


def write_outputs(result: dict, out_dir: Path) -> None:
  """benchmark.json, tables.md and the PNG plots of a result, each written atomically."""
  atomic.write_text(out_dir / 'benchmark.json', json.dumps(result, indent=1, allow_nan=False))
  atomic.write_text(out_dir / 'tables.md', markdown_report(result))
  write_plots(result, out_dir)


# ----------------------------------------------------------------------------------------------
# Markdown: every table, rebuilt from the JSON object alone.


def _f(x: float | None, fmt: str = '.2f') -> str:
  return '-' if x is None else format(x, fmt)


def _setup_md(r: dict) -> str:
  p, d, mm = r['provenance'], r['data'], r['matmul']
  lines = [f"# Benchmark: amortized vs iterative IK ({r['mode']})", '',
           f"- command: `{r['command']}`",
           f"- machine: {p['cpu_model']}, {p['cpu_threads']} CPU threads; JAX {p['jax_version']} "
           f"(backend {p['backend']}), Flax {p['flax_version']}",
           f"- date: {p['time_utc']}; git {p['git_commit']}; the run took {r['seconds']:.0f} s",
           f"- data: `{d['dir']}` split `{d['split']}` ({d['split_frames']} frames); every method "
           f"on the same {d['subset_frames']} frames unless stated",
           f"- large matmul {mm['float32']['n']}x{mm['float32']['n']}: "
           + ', '.join(f"{k} {_f(v['gflops_per_s'], '.1f')} GFLOP/s" for k, v in mm.items())]
  lines += [f'- skipped {k}: {v}' for k, v in r['skipped'].items()]
  return '\n'.join(lines)


def _accuracy_md(results: dict[str, dict], title: str) -> str:
  rows = []
  for name, res in results.items():
    rows.append(evaluation.result_cells(res, name))
    parts = res.get('per_part', {})
    if len(parts) > 1:
      rows += [evaluation.result_cells(pr, f'{name} ({part})') for part, pr in parts.items()]
  return f'{title}\n\n' + markdown_grid(evaluation.RESULT_COLUMNS, rows)


def _by_group_md(accuracy: dict[str, dict], key: str, label: str, title: str) -> str:
  names = list(accuracy)
  groups = sorted(set().union(*(accuracy[n][key] for n in names)))
  first = accuracy[names[0]][key]
  rows = [[g, str(first[g]['frames'])] + [_f(accuracy[n][key][g]['local_rot_err_deg'])
                                          for n in names] for g in groups]
  return f'{title}\n\n' + markdown_grid([label, 'frames', *names], rows)


def _pareto_md(r: dict) -> str:
  rows = [[p['name'], p['family'], str(p.get('iters', '-')), _f(p['local_rot_err_deg']),
           _f(p['mpjpe_mm']), _f(p['ms_per_frame'], '.4f'), _f(p['frames_per_s'], ',.0f')]
          for p in r['pareto']]
  batch = r['pareto'][0]['batch'] if r['pareto'] else '-'
  left = 'yes' if r['ratios']['ikgat_left_of_iterative'] else 'no'
  return (f'## Pareto: local error vs time per frame (batch {batch})\n\n'
          + markdown_grid(['point', 'family', 'iters', 'local (deg)', 'MPJPE (mm)', 'ms/frame',
                    'frames/s'], rows)
          + f'\n\nEvery IK-GAT point left of every iterative point: {left}.')


def _noise_md(r: dict) -> str:
  noise = r['noise']
  if not noise:
    return ''
  sigmas = [c['noise_mm'] for c in next(iter(noise.values()))]
  header = ['method'] + [f'{s:g} mm' for s in sigmas]
  parts = []
  for field, unit in (('local_rot_err_deg', 'local rotation error (deg)'),
                      ('mpjpe_mm', 'MPJPE (mm)')):
    rows = [[n] + [_f(c[field]) for c in curve] for n, curve in noise.items()]
    parts.append(f'## Noise: {unit} vs input noise (sigma per coordinate)\n\n'
                 + markdown_grid(header, rows))
  return '\n\n'.join(parts)


def _init_md(r: dict) -> str:
  init = r['init_robustness']
  inits = list(dict.fromkeys(k for v in init.values() for k in v))
  rows = [[fam] + [f"{_f(v[k]['local_rot_err_deg'])} ({_f(v[k]['root_rot_err_deg'])})"
                   if k in v else '-' for k in inits] for fam, v in init.items()]
  return ('## Initial pose (iterative solvers): local error (root error), deg\n\n'
          + markdown_grid(['solver', *inits], rows))


def _per_joint_md(r: dict) -> str:
  acc = r['accuracy']
  names = list(acc)
  joints = list(acc[names[0]]['per_joint'])
  rows = [[j] + [_f(acc[n]['per_joint'][j]['local_rot_err_deg']) for n in names] for j in joints]
  return '## Per joint: local rotation error (deg)\n\n' + markdown_grid(['joint', *names], rows)


def _percent(x: float | None, of: float | None) -> float | None:
  return None if x is None or not of else 100.0 * x / of


def _speed_md(r: dict) -> str:
  speed, peak = r['speed'], r['matmul']['float32']['gflops_per_s']
  batches = [str(b) for b in r['config']['batch_sizes']]
  rows = []
  for n, s in speed.items():
    lat = s['latency']
    rows.append([n, _f(s['flops_per_frame'], ',.0f'), _f(lat['median_ms'], '.3f'),
                 _f(lat['p99_ms'], '.3f'), _f(lat['frames_per_s'], ',.0f')]
                + [_f(s['throughput'][b]['frames_per_s'], ',.0f') if b in s['throughput']
                   else 'capped' for b in batches]
                + [_f(s['best_frames_per_s'], ',.0f'), _f(s['gflops_per_s_batch1'], '.2f'),
                   _f(s['gflops_per_s_best'], '.2f'), _f(_percent(s['gflops_per_s_best'], peak),
                                                         '.1f')])
  header = ['method', 'FLOPs/frame', 'batch 1 median (ms)', 'p99 (ms)', 'batch 1 frames/s',
            *[f'{b} frames/s' for b in batches], 'best frames/s', 'GFLOP/s batch 1',
            'GFLOP/s best', '% of matmul']
  cap = r['config']['iterative_batch_cap']
  return (f'## Speed (iterative solvers at {r["config"]["iters"]} iterations, timed up to batch '
          f'{cap}; % of the float32 matmul\'s GFLOP/s)\n\n' + markdown_grid(header, rows))


def _sweep_md(r: dict) -> str:
  sweeps = r['block_sweep']
  if not sweeps:
    return ''
  blocks = [str(b) for b in r['config']['block_sweep']]
  big = sorted({b for s in sweeps.values() for b in s['blocked']}, key=int)
  rows = [[n] + [_f(s['frames_per_s'][b], ',.0f') for b in blocks] + [str(s['best_block'])]
          + [_f(s['blocked'][b]['frames_per_s'], ',.0f') if b in s['blocked'] else '-'
             for b in big] for n, s in sweeps.items()]
  return ('## IK-GAT block-size sweep (frames/s); large batches run in blocks of the best\n\n'
          + markdown_grid(['model', *blocks, 'best block', *[f'{b} in blocks' for b in big]], rows))


def _bf16_md(r: dict) -> str:
  if not r['bf16']:
    return ''
  rows = [[n, v.get('bfloat16', 'whole network'), _f(v['local_rot_err_deg_f32']),
           _f(v['local_rot_err_deg_bf16']),
           _f(v['local_rot_err_change_deg'], '+.3f'), _f(v['mpjpe_change_mm'], '+.3f'),
           _f(v['speedup_batch1'], '.2f'), _f(v['speedup_best'], '.2f')]
          for n, v in r['bf16'].items()]
  return ('## IK-GAT in bfloat16 against float32\n\n'
          + markdown_grid(['model', 'bfloat16 in', 'local f32 (deg)', 'local bf16 (deg)',
                           'change (deg)',
                    'MPJPE change (mm)', 'speed-up batch 1', 'speed-up best'], rows))


def _ratios_md(r: dict) -> str:
  pairs = r['ratios']['pairs']
  if not pairs:
    return ''
  rows = [[v['ikgat'], f"{v['iterative']} ({v['iterative_iters']} iters)", _f(v['batch1'], '.1f'),
           _f(v['same_batch'], '.1f'), _f(v['batched_best'], '.1f'),
           _f(v['ikgat_flops_per_frame'], ',.0f'), _f(v['iterative_flops_per_frame'], ',.0f'),
           _f(v['flops_ratio'], '.1f')] for v in pairs.values()]
  batch = next(iter(pairs.values()))['same_batch_size']
  return ('## IK-GAT over iterative IK: frames/s ratios measured in this run\n\n'
          + markdown_grid(['IK-GAT', 'iterative', 'batch 1 ratio', f'batch {batch} ratio',
                    'best batched ratio', 'IK-GAT FLOPs/frame', 'iterative FLOPs/frame',
                    'FLOPs ratio'], rows))


def markdown_report(r: dict) -> str:
  """Every table of a benchmark result (tables.md), with command, machine and date."""
  acc = r['accuracy']
  parts = [_setup_md(r), _ratios_md(r), _speed_md(r), _sweep_md(r), _bf16_md(r), _pareto_md(r),
           _accuracy_md(acc, f"## Accuracy ({r['data']['subset_frames']} frames, every method)")]
  if r['accuracy_whole_split']:
    parts.append(_accuracy_md(r['accuracy_whole_split'],
                              f"## Accuracy on the whole split ({r['data']['split_frames']} "
                              'frames, fast methods)'))
  parts += [_by_group_md(acc, 'per_subject', 'subject',
                         '## Per subject: local rotation error (deg)'),
            _by_group_md(acc, 'per_file', 'file',
                         '## Per file (activity): local rotation error (deg)'),
            _noise_md(r), _init_md(r), _per_joint_md(r)]
  return '\n\n'.join(p for p in parts if p) + '\n'


# ----------------------------------------------------------------------------------------------
# Plots (matplotlib, Agg), rebuilt from the JSON object alone.


_MARKERS = {'ikgat': '*', 'ikgat_bf16': 'P', 'floor': 'X'}


_VARIANT_MARKERS = ('*', 'o', 's', 'D', '^', 'v', 'P', 'h', '<', '>', 'p', 'd')
_VARIANT_DASHES = ('-', '--', ':', '-.', (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))


def _model_variant(name: str) -> tuple[str, str]:
  """'ikgat_base:ikgat_fast+mirror' -> ('ikgat_fast', '+mirror'); 'ikgat_base_bf16' ->
  ('ikgat_base', '_bf16'); 'iterative' -> ('iterative', '')."""
  own = name.split(':')[-1]
  model = own.split('+')[0].removesuffix('_bf16')
  return model, own[len(model):]


def _method_styles(names: list[str]) -> dict[str, dict]:
  """Per method name: a colour per model (every IK-GAT checkpoint, each other method) and a
  marker and a dash per variant (+refine20, +mirror, _bf16, ...), so 20-30 methods stay
  apart and a model's variants read as a family."""
  models = list(dict.fromkeys(_model_variant(n)[0] for n in names))
  variants = list(dict.fromkeys(_model_variant(n)[1] for n in names))
  out = {}
  for n in names:
    m, v = _model_variant(n)
    k = variants.index(v)
    out[n] = {'color': f'C{models.index(m) % 10}',
              'marker': _VARIANT_MARKERS[k % len(_VARIANT_MARKERS)],
              'linestyle': _VARIANT_DASHES[k % len(_VARIANT_DASHES)]}
  return out


def _legend_outside(ax, fontsize: int = 7) -> None:
  """The legend right of the axes, so no curve or point is under it."""
  ax.legend(fontsize=fontsize, loc='upper left', bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def plot_pareto(r: dict, path: Path) -> None:
  """Every point in the legend (no labels on the plot, where IK-GAT's crowd each other): each
  IK-GAT checkpoint a colour, each variant a marker; iterative budgets as lines (the numbers
  by the points: iterations); the floors as crosses."""
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(11, 5.5))
  fams = list(dict.fromkeys(p['family'] for p in r['pareto']))
  styles = _method_styles([p['name'] for p in r['pareto']])
  for fam in fams:
    pts = [p for p in r['pareto'] if p['family'] == fam]
    if fam == 'floor':
      for p in pts:
        ax.scatter(p['ms_per_frame'], p['local_rot_err_deg'], marker='X', s=110, zorder=3,
                   color=styles[p['name']]['color'], label=p['name'])
      continue
    if fam in _MARKERS:
      for p in pts:
        st = styles[p['name']]
        ax.scatter(p['ms_per_frame'], p['local_rot_err_deg'], marker=st['marker'],
                   s=150 if st['marker'] == '*' else 60, zorder=3, color=st['color'],
                   edgecolors='black', linewidths=0.4, label=p['name'])
      continue
    pts.sort(key=lambda p: p['iters'])
    st = styles[pts[0]['name']]
    ax.plot([p['ms_per_frame'] for p in pts], [p['local_rot_err_deg'] for p in pts], marker='o',
            color=st['color'], linestyle=st['linestyle'],
            label=f'{fam} (iterations by the points)')
    for p in pts:
      ax.annotate(str(p['iters']), (p['ms_per_frame'], p['local_rot_err_deg']), fontsize=7,
                  xytext=(4, -10), textcoords='offset points')
  batch = r['pareto'][0]['batch'] if r['pareto'] else '?'
  ax.set(xscale='log', xlabel=f'ms per frame (batch {batch})',
         ylabel='local rotation error (deg)',
         title='Accuracy vs time: IK-GAT (a colour per checkpoint) and iterative budgets')
  ax.grid(True, which='both', alpha=0.3)
  _legend_outside(ax)
  plots.save_figure(fig, path, tight=True)


def plot_noise(r: dict, path: Path) -> None:
  """One curve per method: a colour per model, a dash and marker per variant (the shipped
  model's plain curve, the first IK-GAT, drawn thick), the legend outside the axes."""
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(11, 5.5))
  first = next((n for n in r['noise'] if n.startswith('ikgat')), None)
  styles = _method_styles(list(r['noise']))
  for name, curve in r['noise'].items():
    ax.plot([c['noise_mm'] for c in curve], [c['local_rot_err_deg'] for c in curve],
            markersize=4, linewidth=3.0 if name == first else 1.3, label=name, **styles[name])
  ax.set(xlabel='input noise sigma per coordinate (mm)', ylabel='local rotation error (deg)',
         title='Robustness to input noise')
  ax.grid(True, alpha=0.3)
  _legend_outside(ax)
  plots.save_figure(fig, path, tight=True)


def _markdown_rows(md: str, heading: str) -> tuple[list[str], list[list[str]]]:
  """(header cells, body rows of cells) of the table under the `## ` heading that starts with
  `heading` in `md` (tables.md)."""
  lines = md.splitlines()
  start = next((i for i, line in enumerate(lines) if line.startswith('## ' + heading)), None)
  if start is None:
    raise ValueError(f'no table "{heading}" in the tables file')
  rows = []
  for line in lines[start + 1:]:
    if line.startswith('## '):
      break
    if line.startswith('|'):
      rows.append([c.strip() for c in line.strip().strip('|').split('|')])
  if len(rows) < 2:
    raise ValueError(f'the table "{heading}" has no rows')
  return rows[0], rows[2:]


def plot_data_from_tables(md: str) -> dict:
  """The `pareto` and `noise` sections of a run's JSON, read back from its tables.md (the
  Pareto and the noise tables), for `plot_pareto` and `plot_noise`: a run's figures drawn
  again without the run (`python -m experiments.benchmark --replot_tables=FILE`)."""
  num = lambda c: float(c.replace(',', ''))  # noqa: E731
  head, rows = _markdown_rows(md, 'Pareto')
  batch = re.search(r'batch (\d+)', md[md.index('## Pareto'):].splitlines()[0])
  col = {h: k for k, h in enumerate(head)}
  pareto = [{'name': r[col['point']], 'family': r[col['family']],
             'iters': None if r[col['iters']] == '-' else int(r[col['iters']]),
             'local_rot_err_deg': num(r[col['local (deg)']]),
             'ms_per_frame': num(r[col['ms/frame']]),
             'batch': int(batch.group(1)) if batch else '?'}
            for r in rows]
  head, rows = _markdown_rows(md, 'Noise: local rotation error')
  levels = [num(h.split()[0]) for h in head[1:]]
  noise = {r[0]: [{'noise_mm': m, 'local_rot_err_deg': num(v)} for m, v in zip(levels, r[1:])
                  if v not in ('', '-')] for r in rows}
  return {'pareto': pareto, 'noise': noise}


def replot_from_tables(tables: str | Path, out_dir: str | Path) -> list[Path]:
  """pareto.png and noise.png drawn again from a run's tables.md into `out_dir` (made)."""
  r = plot_data_from_tables(Path(tables).read_text())
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  plot_pareto(r, out / 'pareto.png')
  plot_noise(r, out / 'noise.png')
  return [out / 'pareto.png', out / 'noise.png']


def _grouped_bars(ax, groups: list[str], series: dict[str, list[float]]) -> None:
  width = 0.8 / max(len(series), 1)
  x = np.arange(len(groups))
  for k, (name, values) in enumerate(series.items()):
    ax.bar(x + (k - (len(series) - 1) / 2) * width, [v or 0.0 for v in values], width,
           label=name)
  ax.set_xticks(x, groups, rotation=60, ha='right', fontsize=8)


def plot_per_joint(r: dict, path: Path) -> None:
  plt = plots.pyplot()
  acc = r['accuracy']
  joints = list(next(iter(acc.values()))['per_joint'])
  fig, ax = plt.subplots(figsize=(max(10, 0.7 * len(joints)), 5))
  _grouped_bars(ax, joints, {n: [a['per_joint'][j]['local_rot_err_deg'] for j in joints]
                             for n, a in acc.items()})
  ax.set(ylabel='local rotation error (deg)', title='Per joint')
  ax.legend(fontsize=7, ncol=2)
  plots.save_figure(fig, path, tight=True)


def plot_throughput(r: dict, path: Path) -> None:
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(7.5, 5))
  for name, s in r['speed'].items():
    pts = [(1, s['latency']['frames_per_s'])] + [
        (int(b), t['frames_per_s']) for b, t in s['throughput'].items()]
    pts.sort()
    line, = ax.plot(*zip(*pts), 'o-', label=name)
    sweep = r['block_sweep'].get(name)
    if sweep:
      blocked = sorted((int(b), t['frames_per_s']) for b, t in sweep['blocked'].items())
      if blocked:
        ax.plot(*zip(*blocked), 's--', color=line.get_color(), mfc='none',
                label=f"{name} in blocks of {sweep['best_block']}")
  ax.set(xscale='log', yscale='log', xlabel='batch size (frames per call)',
         ylabel='frames per second', title='Latency (batch 1) and batched throughput')
  ax.grid(True, which='both', alpha=0.3)
  ax.legend(fontsize=7)
  plots.save_figure(fig, path, tight=True)


def plot_init(r: dict, path: Path) -> None:
  plt = plots.pyplot()
  init = r['init_robustness']
  inits = list(dict.fromkeys(k for v in init.values() for k in v))
  fig, ax = plt.subplots(figsize=(7, 4.5))
  _grouped_bars(ax, inits, {fam: [v.get(k, {}).get('local_rot_err_deg') for k in inits]
                            for fam, v in init.items()})
  ax.set(ylabel='local rotation error (deg)', title='Iterative IK from different initial poses')
  ax.legend(fontsize=8)
  plots.save_figure(fig, path, tight=True)


def write_plots(r: dict, out_dir: Path) -> None:
  """pareto.png, noise.png, per_joint.png, throughput.png, init.png."""
  for fn, name in zip((plot_pareto, plot_noise, plot_per_joint, plot_throughput, plot_init),
                      PLOTS):
    fn(r, out_dir / name)
