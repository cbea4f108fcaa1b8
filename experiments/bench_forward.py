"""The jitted IK-GAT network alone: positions -> local rotations, at a few batch sizes.

  python -m experiments.bench_forward [--checkpoint=DIR] [--batches=1,64,256] [--calls=2000]
  taskset -c 0 python -m experiments.bench_forward        # pinned to one core

Prints median and p99 milliseconds per call and frames/s (compiled; every call waited on with
`block_until_ready`), XLA's FLOPs per frame and, with --matmul (default), the rate as a share of a
float32 2048 x 2048 matmul's GFLOP/s measured in the same process (issue N's 75% target). With
`--rounds=R` (default 3) the matmul and every batch size are timed in turn R times, and each
round's share is of that round's matmul: on a shared host whose matmul rate moves by 30% within
minutes, the median of the per-round shares is the figure to quote, not one batch's rate over a
matmul timed minutes earlier.
No input checks or host conversions: the floor under `IKSolver.step`. `--attention=dense|sparse`
forces one form of the graph attention (the same function; gat.py) for comparison, and
`--micro_batch=N` the block size of a batch (`inference.ikgat_infer`; 0: the batch at once;
default: the backend's, 32 on the CPU; several, e.g. `--micro_batch=16,32,64`: each timed in turn
within every round, so a block-size sweep shares the host's noise). `--threads=N` splits each batch
into N equal parts run at once by N threads on the same executable, as the solver's clip path runs
its chunks (`solver.default_workers()`; a batch that N does not divide runs whole): XLA's CPU
runtime runs one executable's many small kernels one after another, so two at once use two cores
better. `--dims=WIDTHxBLOCKS` times an untrained network of the checkpoint's config at that width
and number of blocks instead (the time does not depend on the weights): what a smaller model would
cost, before training one. `--clip=FILE` (a BVH, or an npz / csv in metres) also solves that clip
whole with `IKSolver.solve` once per round (checks, retargeting and the chunks on `--threads`
workers included, the same attention form; compiled by a first solve before any timing): the
solver's clip path, its frames/s and its share of the round's matmul at the network's FLOPs.
`--matmul_precision=bfloat16` runs the network's large products with bfloat16 inputs and float32
sums (`model.set_matmul_precision`; the clip's solver too); each round then also times the 2048
matmul done the same way, and a batch's line gives its share of that rate beside the float32
one's. `--live_backend` starts JAX as `ik_gat_jax.start_live_backend()` does, for what a
process set up for live frames pays on batches and clips. `--pin_threads` pins each of the
`--threads` threads of a batch to a core of its own (of the cores this process may use, which
must be at least as many): unpinned, two threads on the 2-core AMD EPYC of session 34 sat in a
slow state (60% of the matmul instead of 77-80%) for whole runs, pinned in none (BENCHMARKS.md,
issue N session 34). The clip's solver stays unpinned, as a program runs it.
"""

import concurrent.futures
import dataclasses
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import fail_on_user_error, pinning_initializer, run_main
from experiments import benchmark_suite
from flax import nnx

from ik_gat_jax import bone_frames, gat, inference
from ik_gat_jax.io import exports
from ik_gat_jax.solver import IKSolver
from ik_gat_jax import model as model_lib

_CKPT = flags.DEFINE_string('checkpoint', None, 'IK-GAT run or checkpoint (default: shipped).')
_BATCHES = flags.DEFINE_list('batches', ['1', '64', '256'], 'Batch sizes.')
_ATTENTION = flags.DEFINE_enum('attention', 'dense', ['dense', 'auto', 'sparse'],
                               "How the graph attention is evaluated (the same function; "
                               "gat.GraphAttention.form): 'dense' (the default), 'auto' or "
                               "'sparse'.")
_MATMUL = flags.DEFINE_bool('matmul', True, "Also measure a float32 2048 matmul's GFLOP/s and "
                            "give each batch's rate (XLA's FLOP count) as a share of it.")
_MICRO = flags.DEFINE_list('micro_batch', None, 'Examples per block of a batch (0: none; '
                           'default: inference.micro_batch_size()); several: each timed in turn '
                           'every round.')
_CALLS = flags.DEFINE_integer('calls', 2000, 'Timed calls per batch size (batch 1; fewer for '
                              'larger batches).')
_THREADS = flags.DEFINE_integer('threads', 1, 'Threads per batch, each running an equal part of it '
                                'at once (the solver\'s workers); 1: the batch in one call.',
                                lower_bound=1)
_DIMS = flags.DEFINE_string('dims', None, 'WIDTHxBLOCKS, e.g. 192x2: time an untrained network of '
                            'the checkpoint\'s config at that width and depth instead.')
_CLIP = flags.DEFINE_string('clip', None, 'A clip (BVH, or npz / csv in metres) also solved whole '
                           'by IKSolver.solve each round, on --threads workers.')
_PRECISION = flags.DEFINE_enum('matmul_precision', 'float32', ['float32', 'bfloat16'],
                               "The network's large products (model.set_matmul_precision).")
_LIVE = flags.DEFINE_boolean('live_backend', False, 'Start JAX with '
                             '`ik_gat_jax.start_live_backend()` first (one intra-op thread, '
                             'synchronous dispatch): what a live process pays for batches.')
_PIN = flags.DEFINE_boolean('pin_threads', False, 'Pin each of the --threads threads of a batch '
                            'to a core of its own (the process\'s cores, at least --threads).')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Times the matmul and every batch size are timed in '
                               'turn; each round\'s share is of its own matmul.', lower_bound=1)


@fail_on_user_error
def main(argv):
  del argv
  try:
    if not _BATCHES.value or min(int(x) for x in _BATCHES.value) < 1:
      raise ValueError
  except ValueError:
    raise ValueError(f'--batches must be batch sizes >= 1, got {",".join(_BATCHES.value)!r}'
                     ) from None
  if _DIMS.value and _CLIP.value:
    raise ValueError('--clip solves with the checkpoint\'s trained model; --dims times an '
                     'untrained one: give one of them')
  if _LIVE.value:
    inference.start_live_backend()
  model, _ = inference.load_model(_CKPT.value or inference.SHIPPED_IKGAT)
  rig = model.rig
  if _DIMS.value:
    model = untrained(model, _DIMS.value)
  gat.set_form(model, _ATTENTION.value)
  model_lib.set_matmul_precision(model, _PRECISION.value)
  options = inference.compiler_options(model)
  B = bone_frames.bone_frames(jnp.asarray(rig.template(), jnp.float32), rig)[None]
  micro = [None] if _MICRO.value is None else block_sizes(_MICRO.value)
  jitted = {mb: jax.jit(lambda p, mb=mb: inference.ikgat_infer(
      model, {'positions': p, 'bone_frames': B}, micro_batch=mb), compiler_options=options)
            for mb in micro}
  pool = concurrent.futures.ThreadPoolExecutor(
      _THREADS.value, initializer=pinning_initializer(_THREADS.value) if _PIN.value else None)

  def forward(parts, mb):  # one part: a plain call; several: at once, one thread each
    f = jitted[mb]
    return f(parts[0]) if len(parts) == 1 else list(pool.map(f, parts))

  # FLOPs from the network unblocked at batch 1: XLA counts a blocked batch's loop body once.
  whole = jax.jit(lambda p: inference.ikgat_infer(model, {'positions': p, 'bone_frames': B},
                                                  micro_batch=0), compiler_options=options)
  rng = np.random.default_rng(0)
  print(f'IK-GAT ({model.config.size}, width {model.config.dims[0]}, {model.config.dims[1]} '
        f'blocks, {model_lib.param_count(model):,} parameters) forward + local rotations, '
        f'{jax.default_backend()}, {len(jax.devices())} device(s), attention on '
        f'{_ATTENTION.value}, {_PRECISION.value} products, blocks of '
        f'{inference.micro_batch_size() if _MICRO.value is None else ",".join(_MICRO.value)}, '
        f'{_THREADS.value} thread(s) per batch' + (', pinned' if _PIN.value else ''))
  cost = whole.lower(jnp.zeros((1, rig.num_joints, 3), jnp.float32)).compile().cost_analysis()
  flops = float((cost[0] if isinstance(cost, (list, tuple)) else cost)['flops'])
  batches = [int(x) for x in _BATCHES.value]
  inputs = {}
  for b in batches:
    p = jnp.asarray(rig.template().cumsum(0)[None] + 0.05 * rng.normal(
        size=(b, rig.num_joints, 3)), jnp.float32)
    k = _THREADS.value if b % _THREADS.value == 0 else 1
    inputs[b] = tuple(jnp.split(p, k))
  keys = [(b, mb) for b in batches for mb in micro]  # timed in this order every round
  label = {(b, mb): f'{b:5d}' + (f' (blocks of {mb})' if len(micro) > 1 else '')
           for b, mb in keys}
  for b, mb in keys:
    jax.block_until_ready(forward(inputs[b], mb))  # compile everything before any timing
  clip = _clip_solve(rig) if _CLIP.value else None
  rates, times, clip_s, own = [], {k: [] for k in keys}, [], []
  mixed = _PRECISION.value != 'float32'
  for r in range(_ROUNDS.value):
    if _MATMUL.value:
      rates.append(benchmark_suite.matmul_gflops(2048)['gflops_per_s'])
      print(f'round {r + 1}: float32 2048 x 2048 matmul {rates[-1]:.1f} GFLOP/s')
      if mixed:
        own.append(benchmark_suite.matmul_gflops(2048, precision=_PRECISION.value)[
            'gflops_per_s'])
        print(f'round {r + 1}: the same in {_PRECISION.value} products {own[-1]:.1f} GFLOP/s')
    for b, mb in keys:
      ms = time_forward(lambda p, mb=mb: forward(p, mb), inputs[b], max(_CALLS.value // b, 20))
      times[(b, mb)].append(ms)
      print(f'round {r + 1}: ' + line(b, ms, flops, rates[-1] if rates else None,
                                      label[(b, mb)])
            + (f', {100 * b / np.median(ms) * 1e3 * flops / 1e9 / own[-1]:.1f}% of the '
               f'{_PRECISION.value} one' if own else ''))
    if clip:
      t = time.perf_counter()
      clip[0]()
      clip_s.append(time.perf_counter() - t)
      print(f'round {r + 1}: ' + clip_line(clip[1], clip_s[-1], flops,
                                           rates[-1] if rates else None))
  if _ROUNDS.value > 1:
    print(f'median of {_ROUNDS.value} rounds' + (f' (matmul {np.median(rates):.1f} GFLOP/s, '
                                               f'range {min(rates):.1f}-{max(rates):.1f})'
                                               if rates else '') + ':')
    if own:
      print(f'({_PRECISION.value} products matmul {np.median(own):.1f} GFLOP/s, range '
            f'{min(own):.1f}-{max(own):.1f}; shares of it after the float32 ones)')
    for b, mb in keys:
      ms_rounds = times[(b, mb)]
      fps = [b / np.median(ms) * 1000 for ms in ms_rounds]
      ms_median = np.median([np.median(ms) for ms in ms_rounds])
      print(f'batch {label[(b, mb)]}: median {ms_median:.3f} ms, '
            f'{np.median(fps):,.0f} frames/s ({flops / 1e6:.2f} MFLOP/frame'
            f'{round_shares(fps, flops, rates)}{round_shares(fps, flops, own)})')
    if clip:
      fps = [clip[1] / s for s in clip_s]
      print(f'clip {clip[1]:5d} frames: median {np.median(clip_s):.3f} s, '
            f'{np.median(fps):,.0f} frames/s{round_shares(fps, flops, rates)}'
            f'{round_shares(fps, flops, own)}')


def round_shares(fps: list[float], flops: float, rates: list[float]) -> str:
  """', M% of its round's matmul (range L-H%)': the median and range of each round's frames/s
  at `flops` per frame over that round's matmul GFLOP/s; '' without matmul rates."""
  if not rates:
    return ''
  shares = [100 * f * flops / 1e9 / g for f, g in zip(fps, rates)]
  return (f', {np.median(shares):.1f}% of its round\'s matmul (range '
          f'{min(shares):.1f}-{max(shares):.1f}%)')


def _clip_solve(rig):
  """(a call solving --clip whole with IKSolver.solve, its number of frames), compiled by one
  solve first. The solver takes --checkpoint, --attention and --threads as its workers."""
  solver = IKSolver.from_checkpoint(_CKPT.value or inference.SHIPPED_IKGAT,
                                    attention=_ATTENTION.value, workers=_THREADS.value,
                                    matmul_precision=_PRECISION.value)
  source = exports.read_positions(_CLIP.value, rig)
  offsets = source.offsets if source.metres_rig else None

  def solve():
    return solver.solve(source.positions, offsets=offsets, progress=False)

  solve()
  return solve, len(source.positions)


def clip_line(frames: int, seconds: float, flops: float, rate: float | None) -> str:
  """One round's solve of the clip: seconds, frames/s, the share of `rate` at `flops`."""
  fps = frames / seconds
  share = f', {100 * fps * flops / 1e9 / rate:.1f}% of the matmul' if rate else ''
  return f'clip {frames:5d} frames: {seconds:.3f} s, {fps:,.0f} frames/s{share}'


def block_sizes(values: list[str]) -> list[int]:
  """`--micro_batch` values -> distinct block sizes >= 0, in order (ValueError otherwise)."""
  try:
    sizes = [int(x) for x in values]
  except ValueError:
    sizes = []
  if not sizes or min(sizes) < 0 or len(set(sizes)) != len(sizes):
    raise ValueError(f'--micro_batch takes distinct block sizes >= 0, e.g. 16,32,64; got '
                     f'{",".join(values)!r}')
  return sizes


def untrained(model, dims: str):
  """An untrained model of `model`'s config and rig at `dims` = 'WIDTHxBLOCKS' (ValueError for
  another form)."""
  try:
    width, blocks = (int(x) for x in dims.lower().split('x'))
  except ValueError:
    raise ValueError(f'--dims is WIDTHxBLOCKS, e.g. 192x2, got {dims!r}') from None
  if width < 1 or blocks < 1:
    raise ValueError(f'--dims needs a width and a number of blocks >= 1, got {dims!r}')
  config = dataclasses.replace(model.config, hidden=width, num_layers=blocks)
  return model_lib.create_model(config, model.rig, nnx.Rngs(0))


def time_forward(forward, p, calls: int) -> np.ndarray:
  """Milliseconds of `calls` compiled calls, each waited on."""
  times = []
  for _ in range(calls):
    t = time.perf_counter()
    jax.block_until_ready(forward(p))
    times.append(time.perf_counter() - t)
  return 1000 * np.asarray(times)


def line(b: int, ms: np.ndarray, flops: float, rate: float | None,
         label: str | None = None) -> str:
  """One batch size's timing: median and p99 ms, frames/s, FLOPs, the share of `rate`."""
  fps = b / np.median(ms) * 1000
  share = f', {100 * fps * flops / 1e9 / rate:.1f}% of the matmul' if rate else ''
  return (f'batch {label or f"{b:5d}"}: median {np.median(ms):.3f} ms, '
          f'p99 {np.percentile(ms, 99):.3f} ms, '
          f'{fps:,.0f} frames/s ({flops / 1e6:.2f} MFLOP/frame{share})')


if __name__ == '__main__':
  run_main(main)
