r"""One prepared device check: IK-GAT speed on whatever JAX runs on, written to one JSON.

  python -m experiments.device_check --output_json=outputs/device_check.json
      [--size=base] [--rig=cmu_body] [--max_batch=N] [--time_budget_s=240] [--tiny]
  python -m experiments.device_check --report=outputs/device_check.json   # its Markdown again

Made for a GPU machine with JAX (and optionally PyTorch + torch_geometric) already installed and
a copy of this repository: no data, no training run, under 5 minutes with the default budget.
It measures, in this order, each section given a share of the time left (`SHARES`):
 1. PyTorch + torch_geometric (the paper's stack), when both import: the same network (per-joint
    input projection, `num_layers` blocks of GATConv -> ELU -> residual -> LayerNorm over the
    rig's tree with self loops, global shortcut, MLP head to 6D, Gram-Schmidt) forward in
    `torch.no_grad()` at batch 1, 4, 16, ... (CUDA when available), in a child process that runs
    before JAX starts, so JAX's preallocated GPU memory cannot starve it. Else 'not installed';
 2. a large matmul's GFLOP/s (float32, bfloat16): what the device gives dense work;
 3. IK-GAT inference (`inference.ikgat_infer`, jitted, deterministic) on random root-relative
    positions of realistic scale (the rig's template rest pose + 3 cm noise per coordinate) with
    the template's bone frames, at batch 1, 4, 16, ... (times `--batch_step`: 4 on an
    accelerator, whose compilation of each new shape (autotuning included) would otherwise
    spend the section's time on small batches; 2 on the CPU) until the device runs out of
    memory (XLA's RESOURCE_EXHAUSTED, caught), `--max_batch` or the section's time is up;
    frames/s = batch / median call time (each call waited on with `block_until_ready`);
    XLA's FLOPs per frame. Then the same in bfloat16 (`evaluation.cast_floating`, positions
    bfloat16, output float32, as the benchmark's bf16 rows), and with bfloat16 products only
    ('bfloat16_products': `model.set_matmul_precision`, the large products' inputs in
    bfloat16 and their sums in float32, everything else float32; on the CPU with their XLA
    options, `inference.compiler_options`); and float32 with the opt-in attention form
    ('float32_auto': `gat.set_form(model, 'auto')`, `--attention=auto`: dense below 4 frames,
    sparse from 4), between the float32 sweep and the bfloat16 ones;
 4. training: `train.make_train_step` (AdamW, augmentation, the IK-GAT loss; the recipe of
    experiments/configs/default.py at `--size`) on synthetic batches with the keys of
    `input_pipeline.gather_batch` (positions by FK of random local rotations of the template),
    already on the device: steps/s and frames/s of the jitted step alone (no host input
    pipeline) at `--train_batches` (default 256, 1024, 4096; capped by `--max_batch`).
The model: the shipped checkpoint (checkpoints/ikgat_base) for `--size=base --rig=cmu_body`,
else a freshly initialised model of that size (random weights: speed does not depend on them).
Inference runs on the first device; training on every device JAX sees (the trainer's mesh). The
main lets JAX take 90% of GPU memory (`XLA_PYTHON_CLIENT_MEM_FRACTION`, unless set; JAX's
default is 75%) and uses the command line's compilation cache (ik_gat_jax/compile_cache.py), so
a rerun on the same machine compiles less.

Every measurement is bounded: at least 3 timed calls after the compiling one, more until
`measure_s` has passed (at most 200); a batch is not tried when the last one's time, times
1.1 the batch step, would pass the section's deadline. `--tiny` (the test's mode: tiny model,
batches up to 4, one training batch, short measurements) runs on a CPU in about 20 s.

'float32' means each framework's default for float32 products, recorded in the JSON: JAX lets
XLA use TF32 tensor cores on NVIDIA Ampere and newer (`jax_default_matmul_precision` None),
PyTorch computes them in true float32 unless told otherwise (`float32_matmul`). Read the
JAX/PyTorch ratio with that in mind.

The JSON: command, config, device {backend, devices, device_kind, memory_stats, versions,
jax_default_matmul_precision, nvidia_smi}, provenance, compile_cache, model {size, rig,
source, params, dims}, torch_geometric {status, versions, float32_matmul, device, model,
batch_step, results [...], stopped}, matmul {dtype: ...}, inference
{float32|float32_auto|bfloat16|bfloat16_products: {batches, results [{batch, frames_per_s,
median_ms, p99_ms, calls, compile_s, flops_per_frame}], stopped, largest_batch, best_batch,
best_frames_per_s}}, auto_speedup, bf16_speedup, bf16_products_speedup [{batch, speedup}]
(against float32), training {batches, results [{batch, steps_per_s, frames_per_s, median_ms,
calls, compile_s, loss}], stopped, note}, ratios {jax_f32_over_torch_geometric [{batch,
ratio}]}, seconds, complete, errors. `stopped` is
'max_batch', 'budget', 'out_of_memory at batch N' or 'error at batch N: ...' (the first line of
an XLA error).

At the end the same figures are written beside the JSON as Markdown tables for BENCHMARKS.md
(`.md`; `--report=JSON` prints them for any JSON of this check, a partial one too). Nothing
measured is lost: the JSON is written once the device is described and again after each
section (`complete` false until the end). A section that raises an error the script does
not expect of a device (a bug, an API another JAX version lacks) is recorded as {error,
traceback}, its name added to `errors`, and the sections after it still run; the command then
exits with status 1.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

from absl import flags
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmark_suite import matmul_gflops
from experiments.common import run_main
from experiments.configs import default as default_config
from ik_gat_jax import bone_frames, compile_cache, evaluation, gat, inference, kinematics
from ik_gat_jax import model as model_lib
from ik_gat_jax import provenance, rotations, skeleton, train
from ik_gat_jax.io import atomic

REPO = Path(__file__).resolve().parents[1]
# Share of the time left that each section gets when it starts (renormalised over the sections
# still to come, so an absent PyTorch gives its time to the others).
SHARES = {'torch_geometric': 0.18, 'matmul': 0.03, 'inference_float32': 0.22,
          'inference_float32_auto': 0.14, 'inference_bfloat16': 0.11,
          'inference_bfloat16_products': 0.12, 'training': 0.2}
INFERENCE_VARIANTS = ('float32', 'float32_auto', 'bfloat16', 'bfloat16_products')
SHORT = {'float32': 'f32', 'float32_auto': 'f32 auto', 'bfloat16': 'bf16',
         'bfloat16_products': 'bf16 products'}  # the text table's column names
# The next batch's predicted cost / the last one's (compile + timed calls): for inference 1.1x
# the batch step (`batch_sweep`); a training step's cost is mostly its compilation, whatever the
# batch, so 1.5 there.
TRAINING_GROWTH = 1.5
# GPU memory JAX may take (its default is 75%); set by the main only, if not set already.
MEM_FRACTION = '0.9'


@dataclasses.dataclass
class Options:
  output_json: str = 'outputs/device_check.json'
  size: str = 'base'
  rig: str = 'cmu_body'
  max_batch: int | None = None  # None: 1 << 20 on an accelerator, 1024 on the CPU (tiny: 4)
  time_budget_s: float = 240.0
  tiny: bool = False
  train_batches: tuple[int, ...] | None = None  # None: 256, 1024, 4096 (tiny: 4)
  measure_s: float | None = None  # None: 0.5 (tiny: 0.05)
  torch: bool = True  # False: skip PyTorch even when installed
  batch_step: int | None = None  # None: 4 on an accelerator, 2 on the CPU

  def resolved(self, backend: str) -> 'Options':
    o = dataclasses.replace(self)
    if o.tiny:
      o.size = 'tiny' if self.size == 'base' else self.size
    if o.max_batch is None:
      o.max_batch = 4 if o.tiny else (1024 if backend == 'cpu' else 1 << 20)
    if o.train_batches is None:
      o.train_batches = (4,) if o.tiny else (256, 1024, 4096)
    o.train_batches = tuple(b for b in o.train_batches if b <= o.max_batch) or (o.max_batch,)
    if o.measure_s is None:
      o.measure_s = 0.05 if o.tiny else 0.5
    if o.batch_step is None:
      o.batch_step = default_batch_step(backend != 'cpu')
    return o


# ----------------------------------------------------------------------------------------------
# Budget and batch growth (no JAX: the PyTorch child uses them too).


class Budget:
  """Deadlines for the sections: each gets `SHARES[name]` of the time left, renormalised over
  the sections still to come."""

  def __init__(self, seconds: float, sections: list[str]):
    self.start, self.seconds, self.todo = time.monotonic(), float(seconds), list(sections)

  def left(self) -> float:
    return self.seconds - (time.monotonic() - self.start)

  def section(self, name: str) -> float:
    """Seconds for section `name` (taken off the list)."""
    share = SHARES[name] / sum(SHARES[s] for s in self.todo)
    self.todo.remove(name)
    return max(self.left(), 0.0) * share


def default_batch_step(accelerator: bool) -> int:
  """The inference batches' growth factor (module docstring)."""
  return 4 if accelerator else 2


def batch_sweep(measure: Callable[[int], dict], max_batch: int, seconds: float,
                is_oom: Callable[[BaseException], bool], step: int = 2) -> dict:
  """`measure(b)` at b = 1, step, step^2, ... <= max_batch while the predicted cost (1.1 step
  times the last batch's) fits in `seconds`.

  The first batch is always measured. Returns {batches, results, stopped, largest_batch,
  best_batch, best_frames_per_s}; an out-of-memory error stops the sweep ('out_of_memory at
  batch N'), another runtime error too ('error at batch N: first line')."""
  return sweep(measure, geometric_batches(max_batch, step), seconds, is_oom, 1.1 * step)


def geometric_batches(max_batch: int, step: int = 2) -> list[int]:
  """1, step, step^2, ... <= max_batch."""
  if step < 2:
    raise ValueError(f'batch step must be at least 2, got {step}')
  out, b = [], 1
  while b <= max_batch:
    out.append(b)
    b *= step
  return out


def sweep(measure: Callable[[int], dict], batches: list[int], seconds: float,
          is_oom: Callable[[BaseException], bool], growth: float) -> dict:
  deadline = time.monotonic() + seconds
  results, stopped, last_cost = [], 'max_batch', 0.0
  for i, b in enumerate(batches):
    if i and time.monotonic() + growth * last_cost > deadline:
      stopped = 'budget'
      break
    t = time.monotonic()
    try:
      results.append({'batch': b, **measure(b)})
    except Exception as e:  # noqa: BLE001 (device errors differ by backend; re-raised below)
      if is_oom(e):
        stopped = f'out_of_memory at batch {b}'
      elif _is_runtime_error(e):
        stopped = f'error at batch {b}: {_first_line(e)}'
      else:
        raise
      break
    finally:
      gc.collect()
    last_cost = time.monotonic() - t
  best = max(results, key=lambda r: r['frames_per_s'], default=None)
  return {'batches': [r['batch'] for r in results], 'results': results, 'stopped': stopped,
          'largest_batch': results[-1]['batch'] if results else None,
          'best_batch': best and best['batch'],
          'best_frames_per_s': best and best['frames_per_s']}


def _first_line(e: BaseException) -> str:
  text = str(e).strip()
  return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _is_runtime_error(e: BaseException) -> bool:
  """An error of the device runtime (XLA, CUDA), not a bug of this script."""
  name = type(e).__name__
  return name in ('JaxRuntimeError', 'XlaRuntimeError', 'OutOfMemoryError') or (
      isinstance(e, RuntimeError) and any(s in str(e) for s in ('CUDA', 'cuDNN', 'CUBLAS')))


def jax_oom(e: BaseException) -> bool:
  text = str(e)
  return _is_runtime_error(e) and ('RESOURCE_EXHAUSTED' in text or
                                   'out of memory' in text.lower())


def timed_calls(thunk: Callable[[], Any], sync: Callable[[Any], Any], seconds: float,
                min_calls: int = 3, max_calls: int = 200) -> tuple[np.ndarray, float]:
  """(seconds per call, first call seconds) of `thunk`, each call waited on with `sync`; the
  first call (compilation) is untimed. As `benchmark_suite.time_calls`, for any framework."""
  t = time.perf_counter()
  sync(thunk())
  first = time.perf_counter() - t
  times: list[float] = []
  start = time.perf_counter()
  while len(times) < max_calls:
    t = time.perf_counter()
    sync(thunk())
    times.append(time.perf_counter() - t)
    if len(times) >= min_calls and time.perf_counter() - start >= seconds:
      break
  return np.asarray(times), first


def rate_fields(times: np.ndarray, batch: int, first: float) -> dict:
  median = float(np.median(times))
  return {'frames_per_s': batch / median, 'median_ms': 1e3 * median,
          'p99_ms': 1e3 * float(np.percentile(times, 99)), 'calls': int(len(times)),
          'first_call_s': first}


# ----------------------------------------------------------------------------------------------
# PyTorch + torch_geometric (run in a child process: `--torch_child=SPEC.json`).


def torch_status() -> str:
  """'ok', or what is missing (found without importing)."""
  missing = [m for m in ('torch', 'torch_geometric') if importlib.util.find_spec(m) is None]
  return 'ok' if not missing else 'not installed (' + ', '.join(missing) + ')'


def tree_edge_index(parents: tuple[int, ...]) -> np.ndarray:
  """`[2, E]` (source, target) edges of the rig's 'tree' adjacency with self loops, the graph
  IK-GAT attends over (`Rig.adjacency('tree')`: node i receives from k)."""
  src, dst = list(range(len(parents))), list(range(len(parents)))
  for c, p in enumerate(parents):
    if p >= 0:
      src += [p, c]
      dst += [c, p]
  return np.asarray([src, dst], np.int64)


def batched_edge_index(edges: np.ndarray, num_joints: int, batch: int) -> np.ndarray:
  """The disjoint union of `batch` copies of the graph (torch_geometric's batching)."""
  shift = (np.arange(batch, dtype=np.int64) * num_joints)[:, None, None]
  return (edges[None] + shift).transpose(1, 0, 2).reshape(2, -1)


def torch_child(spec_path: str) -> None:
  """Measures the torch_geometric network described by the spec JSON; writes the result into
  `spec['output']`. Imports torch only here."""
  spec = json.loads(Path(spec_path).read_text())
  import torch
  import torch_geometric
  from torch_geometric.nn import GATConv

  dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
  J, (d, L, H, hh) = spec['num_joints'], spec['dims']
  torch.manual_seed(0)

  class Net(torch.nn.Module):

    def __init__(self):
      super().__init__()
      self.kernel = torch.nn.Parameter(torch.randn(J, 3, d) / np.sqrt(3))
      self.embedding = torch.nn.Parameter(0.5 * torch.randn(J, d))
      self.convs = torch.nn.ModuleList([GATConv(d, d // H, heads=H, add_self_loops=False)
                                        for _ in range(L)])
      self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(d) for _ in range(L)])
      self.head = torch.nn.Sequential(torch.nn.Linear(d, hh), torch.nn.ELU(),
                                      torch.nn.Linear(hh, 6))

    def forward(self, x, edge_index):  # x [B, J, 3]
      B = x.shape[0]
      x = x - x[:, :1]
      h0 = torch.einsum('bjc,jcd->bjd', x, self.kernel) + self.embedding
      h0 = h0.reshape(B * J, d)
      h = h0
      for conv, norm in zip(self.convs, self.norms):
        h = norm(h + torch.nn.functional.elu(conv(h, edge_index)))
      six = self.head(h + h0).reshape(B, J, 2, 3)
      a = torch.nn.functional.normalize(six[..., 0, :], dim=-1)
      b = torch.nn.functional.normalize(six[..., 1, :] - (a * six[..., 1, :]).sum(-1, True) * a,
                                        dim=-1)
      return torch.stack([a, b, torch.cross(a, b, dim=-1)], dim=-1)  # [B, J, 3, 3]

  net = Net().to(dev).eval()
  edges = tree_edge_index(tuple(spec['parents']))
  rest = np.asarray(spec['rest'], np.float32)
  sync = (lambda _: torch.cuda.synchronize()) if dev.type == 'cuda' else (lambda _: None)
  rng = np.random.default_rng(0)

  def measure(b: int) -> dict:
    if dev.type == 'cuda':
      torch.cuda.empty_cache()  # the last batch's tensors are gone: give their memory back
    x = torch.as_tensor(rest[None] + 0.03 * rng.standard_normal((b, J, 3), np.float32),
                        device=dev)
    ei = torch.as_tensor(batched_edge_index(edges, J, b), device=dev)
    with torch.no_grad():
      times, first = timed_calls(lambda: net(x, ei), sync, spec['measure_s'])
    return rate_fields(times, b, first)

  oom = lambda e: isinstance(e, getattr(torch.cuda, 'OutOfMemoryError', ())) or \
      'out of memory' in str(e).lower()
  step = spec['batch_step'] or default_batch_step(dev.type == 'cuda')
  out = batch_sweep(measure, spec['max_batch'], spec['seconds'], oom, step)
  out.update(status='ok', device=str(dev), batch_step=step,
             device_name=torch.cuda.get_device_name(0) if dev.type == 'cuda' else 'cpu',
             versions={'torch': torch.__version__, 'torch_geometric': torch_geometric.__version__,
                       'cuda': torch.version.cuda},
             # PyTorch's default: true float32 products ('highest'; TF32 only if asked for).
             float32_matmul={'precision': torch.get_float32_matmul_precision(),
                             'cuda_allow_tf32': bool(torch.backends.cuda.matmul.allow_tf32)},
             model={'dims': [d, L, H, hh],
                    'params': int(sum(p.numel() for p in net.parameters())),
                    'layer': 'torch_geometric.nn.GATConv', 'grad': False})
  Path(spec['output']).write_text(json.dumps(out))


def run_torch(rig, dims, rest: np.ndarray, max_batch: int, seconds: float,
              measure_s: float, batch_step: int | None = None) -> dict:
  """The torch_geometric section in a child process (timeout: its time plus 30 s)."""
  status = torch_status()
  if status != 'ok':
    return {'status': status}
  with tempfile.TemporaryDirectory() as tmp:
    spec = {'num_joints': rig.num_joints, 'parents': list(rig.parents), 'dims': list(dims),
            'rest': rest.tolist(), 'max_batch': max_batch, 'batch_step': batch_step,
            'seconds': max(seconds - 10.0, 1.0),
            'measure_s': measure_s, 'output': str(Path(tmp) / 'torch.json')}
    spec_path = Path(tmp) / 'spec.json'
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, '-m', 'experiments.device_check', f'--torch_child={spec_path}']
    try:
      done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                            timeout=seconds + 30.0)
    except subprocess.TimeoutExpired:
      return {'status': f'timed out after {seconds + 30.0:.0f} s'}
    if done.returncode != 0 or not Path(spec['output']).is_file():
      tail = (done.stderr.strip().splitlines() or ['no output'])[-1]
      return {'status': f'error (exit {done.returncode}): {tail[:300]}'}
    return json.loads(Path(spec['output']).read_text())


# ----------------------------------------------------------------------------------------------
# JAX sections.


def device_info() -> dict:
  devs = jax.devices()
  info = {'backend': jax.default_backend(), 'devices': [str(d) for d in devs],
          'device_count': len(devs), 'device_kind': devs[0].device_kind,
          'platform': devs[0].platform, 'versions': {},
          # JAX's default (None) lets XLA pick: true float32 products on the CPU, TF32 tensor
          # cores for float32 dots on NVIDIA Ampere and newer (the 'float32' sweep's meaning).
          'jax_default_matmul_precision': jax.config.jax_default_matmul_precision,
          'environment': {k: os.environ[k] for k in (
              'JAX_PLATFORMS', 'XLA_PYTHON_CLIENT_MEM_FRACTION', 'XLA_PYTHON_CLIENT_PREALLOCATE',
              'XLA_FLAGS', 'CUDA_VISIBLE_DEVICES') if k in os.environ}}
  for pkg in ('jax', 'jaxlib', 'flax', 'optax', 'jax-cuda12-plugin', 'jax-cuda13-plugin',
              'torch', 'torch_geometric'):
    try:
      info['versions'][pkg] = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      pass
  try:
    stats = devs[0].memory_stats()
    info['memory_stats'] = {k: stats[k] for k in ('bytes_limit', 'bytes_in_use',
                                                  'peak_bytes_in_use') if k in (stats or {})}
  except Exception:  # noqa: BLE001 (not every backend has memory stats)
    info['memory_stats'] = None
  try:
    smi = subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version,memory.total',
                          '--format=csv,noheader'], capture_output=True, text=True, timeout=20)
    info['nvidia_smi'] = smi.stdout.strip().splitlines() if smi.returncode == 0 else None
  except (OSError, subprocess.TimeoutExpired):
    info['nvidia_smi'] = None
  return info


def build_model(o: Options, rig):
  """(model, source): the shipped checkpoint for base on cmu_body, else a fresh init."""

  if o.size == 'base' and rig.name == 'cmu_body' and inference.SHIPPED_IKGAT.is_dir():
    model, _ = inference.load_model(inference.SHIPPED_IKGAT)
    return model, str(inference.SHIPPED_IKGAT.relative_to(REPO))
  config = model_lib.ModelConfig(size=o.size, output_space='mixed', bone_chart=True)
  return model_lib.create_model(config, rig, nnx.Rngs(0)), 'random init'


def inference_section(model, rig, variant: str, o: Options, seconds: float) -> dict:
  """The batch sweep of one of `INFERENCE_VARIANTS`."""
  dtype = 'bfloat16' if variant == 'bfloat16' else 'float32'
  net = evaluation.cast_floating(model, dtype)
  if variant in ('float32_auto', 'bfloat16_products'):
    net = nnx.clone(net)  # the caller's model keeps its form and float32 kernels
  if variant == 'float32_auto':
    gat.set_form(net, 'auto')
  if variant == 'bfloat16_products':
    model_lib.set_matmul_precision(net, 'bfloat16')
  B = bone_frames.bone_frames(jnp.asarray(rig.template(), jnp.float32), rig)[None]
  rest = skeleton.rest_positions_np(rig.template(), rig.parents)
  rest = jnp.asarray(rest - rest[:1], jnp.float32)

  @functools.partial(jax.jit, compiler_options=inference.compiler_options(net))
  def forward(p):
    return inference.ikgat_infer(net, {'positions': p.astype(dtype), 'bone_frames': B}
                                 ).astype(jnp.float32)

  @functools.partial(jax.jit, static_argnums=1)
  def inputs(key, b):
    return rest + 0.03 * jax.random.normal(key, (b, rig.num_joints, 3), jnp.float32)

  # FLOPs per frame from the sweep's first batch, 1, unblocked (the same at every batch): XLA
  # counts the loop body of a batch run in blocks (`inference.micro_batch_size`, the CPU) once.
  flops = {}

  def measure(b: int) -> dict:
    p = inputs(jax.random.key(b), b)
    t = time.perf_counter()
    compiled = forward.lower(p).compile()
    compile_s = time.perf_counter() - t
    times, first = timed_calls(lambda: compiled(p), jax.block_until_ready, o.measure_s)
    if not flops:
      flops['per_frame'] = _flops(compiled) / b
    return {**rate_fields(times, b, first), 'compile_s': compile_s,
            'flops_per_frame': flops['per_frame']}

  return batch_sweep(measure, o.max_batch, seconds, jax_oom, o.batch_step)


def _flops(compiled) -> float | None:
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost['flops'])
  except Exception:  # noqa: BLE001 (cost analysis is optional per backend)
    return float('nan')


def synthetic_batch(rig, b: int, seed: int = 0) -> dict[str, np.ndarray]:
  """A batch with `input_pipeline.gather_batch`'s keys: the template's offsets, random local
  rotations (axis-angle ~ N(0, 0.4 rad) per axis), positions by FK, the template's bone frames."""

  k1, k2 = jax.random.split(jax.random.key(seed))
  offsets = jnp.broadcast_to(jnp.asarray(rig.template(), jnp.float32), (b, rig.num_joints, 3))
  local = rotations.matrix_from_axis_angle(0.4 * jax.random.normal(k1, (b, rig.num_joints, 3)))
  root = jnp.asarray(rig.up, jnp.float32) * 0.95 + 0.5 * jax.random.normal(k2, (b, 3))
  _, pos = kinematics.forward_kinematics(local, offsets, rig.parents, root_pos=root)
  B = bone_frames.bone_frames(offsets[:1], rig)
  return {'positions': np.asarray(pos, np.float32), 'local_rot': np.asarray(local, np.float32),
          'offsets': np.asarray(offsets, np.float32),
          'bone_frames': np.asarray(jnp.broadcast_to(B, (b,) + B.shape[1:]), np.float32)}


def training_section(rig, o: Options, seconds: float) -> dict:

  config = default_config.get_config()
  config.model.size = o.size
  mesh = train.make_mesh()
  graphdef, state0 = train.init_state(inference.IKGAT_TASK, config, rig, None)

  def measure(b: int) -> dict:
    train.check_batch_size(b, mesh)
    config.train.batch_size = b
    step = train.make_train_step(inference.IKGAT_TASK, graphdef, config, rig, mesh)
    batch = train.to_global(synthetic_batch(rig, b), mesh, b)
    holder = {'state': train.place_state(state0, mesh), 'loss': None}  # a copy: steps donate it

    def one():
      holder['state'], m = step(holder['state'], batch)
      holder['loss'] = m['loss']
      return m['loss']

    times, first = timed_calls(one, jax.block_until_ready, o.measure_s)
    r = rate_fields(times, b, first)
    out = {'steps_per_s': 1.0 / float(np.median(times)), **r, 'compile_s': first,
           'loss': float(holder['loss'])}
    return out

  res = sweep(measure, list(o.train_batches), seconds, jax_oom, TRAINING_GROWTH)
  res['note'] = ('the jitted train step alone (AdamW, augmentation, loss) on a batch already on '
                 'the device; the host input pipeline is not included')
  res['devices'] = mesh.size
  return res


def matmul_section(o: Options, backend: str) -> dict:
  n = 256 if o.tiny else (8192 if backend != 'cpu' else 2048)
  out = {}
  for dtype in ('float32', 'bfloat16'):
    try:
      out[dtype] = matmul_gflops(n, dtype, min_seconds=0.05 if o.tiny else 0.5)
    except Exception as e:  # noqa: BLE001
      if not _is_runtime_error(e):
        raise
      out[dtype] = {'n': n, 'error': _first_line(e)}
  return out


def _ratios(a: dict, b: dict, key: str = 'frames_per_s') -> list[dict]:
  rb = {r['batch']: r[key] for r in b.get('results', [])}
  return [{'batch': r['batch'], 'ratio': r[key] / rb[r['batch']]}
          for r in a.get('results', []) if rb.get(r['batch'])]


def run(o: Options, log: Callable[[str], None] = print) -> dict:
  """Runs every section; writes and returns the JSON."""
  t0 = time.monotonic()
  compile_cache.enable()  # a rerun on the same machine skips compiling

  rig = skeleton.get_rig(o.rig)
  size = 'tiny' if o.tiny and o.size == 'base' else o.size
  dims = model_lib.ModelConfig(size=size).dims
  rest = skeleton.rest_positions_np(rig.template(), rig.parents)
  rest = rest - rest[:1]
  # PyTorch first: before JAX starts its backend (and preallocates GPU memory). Its sweep stops
  # at its own out-of-memory error or time share.
  budget = Budget(o.time_budget_s, list(SHARES))
  tg_seconds = budget.section('torch_geometric')
  if o.torch:
    tg = run_torch(rig, dims, rest, o.max_batch or (4 if o.tiny else 1 << 20), tg_seconds,
                   o.measure_s or (0.05 if o.tiny else 0.5), o.batch_step)
  else:
    tg = {'status': 'skipped (--notorch)'}
  log(f'torch_geometric: {tg["status"]}')

  backend = jax.default_backend()
  o = o.resolved(backend)
  out = Path(o.output_json)
  out.parent.mkdir(parents=True, exist_ok=True)
  result: dict[str, Any] = {
      'command': provenance.command_line(), 'config': dataclasses.asdict(o),
      'device': device_info(), 'provenance': provenance.provenance(),
      'compile_cache': compile_cache.status(), 'complete': False, 'errors': []}
  log(f'{result["device"]["backend"]}: {result["device"]["devices"]}')
  result['torch_geometric'] = tg
  save = lambda: atomic.write_json(out, _finite({**result, 'seconds': time.monotonic() - t0}))
  save()  # the device's description, whatever happens next
  model, source = build_model(o, rig)
  params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
  result['model'] = {'size': o.size, 'rig': rig.name, 'source': source, 'params': params,
                     'dims': list(model.config.dims), 'output_space': model.config.output_space}

  def section(holder: dict, key: str, name: str, fn: Callable[[], dict]) -> dict:
    """`holder[key] = fn()`, then the JSON so far. An error this script does not expect of a
    device (a runtime error stops a sweep instead) is recorded as {error, traceback} and
    printed, and the sections after it still run; `run` then ends with exit status 1."""
    try:
      holder[key] = fn()
    except Exception as e:  # noqa: BLE001 (one broken section must not lose the others)
      tb = traceback.format_exc()
      print(tb, file=sys.stderr)
      holder[key] = {'error': f'{type(e).__name__}: {_first_line(e)}', 'traceback': tb}
      result['errors'].append(name)
    save()
    return holder[key]

  section(result, 'matmul', 'matmul', lambda: matmul_section(o, backend))
  budget.section('matmul')
  result['inference'] = {}
  for variant in INFERENCE_VARIANTS:
    seconds = budget.section(f'inference_{variant}')
    s = section(result['inference'], variant, f'inference_{variant}',
                lambda: inference_section(model, rig, variant, o, seconds))  # noqa: B023
    log(f'inference {variant}: batches {s.get("batches")}, stopped: {_stopped(s)}')
  for key, variant in (('auto_speedup', 'float32_auto'), ('bf16_speedup', 'bfloat16'),
                       ('bf16_products_speedup', 'bfloat16_products')):
    result[key] = [{'batch': r['batch'], 'speedup': r['ratio']} for r in _ratios(
        result['inference'][variant], result['inference']['float32'])]
  seconds = budget.section('training')
  t = section(result, 'training', 'training', lambda: training_section(rig, o, seconds))
  log(f'training: batches {t.get("batches")}, stopped: {_stopped(t)}')
  result['ratios'] = {'jax_f32_over_torch_geometric': _ratios(result['inference']['float32'], tg)}
  result['complete'] = True
  result['seconds'] = time.monotonic() - t0
  atomic.write_json(out, _finite(result))
  atomic.write_text(out.with_suffix('.md'), markdown(_finite(result)))
  log(table(result))
  log(f'wrote {out} and its .md ({result["seconds"]:.0f} s)' + (
      f'; sections that failed: {", ".join(result["errors"])}' if result['errors'] else ''))
  return result


def _stopped(s: dict) -> str:
  """Why a sweep ended, or its section's error."""
  return s.get('stopped') or s.get('error') or s.get('status', '?')


def _finite(x: Any) -> Any:
  if isinstance(x, float):
    return x if np.isfinite(x) else None
  if isinstance(x, dict):
    return {k: _finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_finite(v) for v in x]
  if isinstance(x, (np.integer, np.floating)):
    return _finite(x.item())
  return x


def table(r: dict) -> str:
  """A short text table of the frames/s (and steps/s) measured."""
  rows = [f'IK-GAT {r["model"]["size"]} ({r["model"]["params"]:,} params, {r["model"]["source"]})'
          f' on {r["device"]["backend"]} {r["device"]["device_kind"]}']
  inf = r['inference']
  cols = {SHORT[v]: inf.get(v, {}) for v in INFERENCE_VARIANTS}
  cols['torch_geometric'] = r['torch_geometric']
  by = {k: {x['batch']: x for x in s.get('results', [])} for k, s in cols.items()}
  rows.append(f'{"batch":>8} ' + ' '.join(f'{k:>15}' for k in by) + '   (frames/s)')
  for b in sorted(set().union(*by.values())):
    cell = lambda d: f'{d[b]["frames_per_s"]:,.0f}' if b in d else '-'
    rows.append(f'{b:>8} ' + ' '.join(f'{cell(d):>15}' for d in by.values()))
  rows.append('stopped: ' + ', '.join(f'{k} {_stopped(s)}' for k, s in cols.items()))
  for t in r['training'].get('results', []):
    rows.append(f'train batch {t["batch"]:>6}: {t["steps_per_s"]:,.1f} steps/s, '
                f'{t["frames_per_s"]:,.0f} frames/s')
  for dtype, m in r['matmul'].items():
    if isinstance(m, dict) and 'gflops_per_s' in m:
      rows.append(f'matmul {m["n"]} {dtype}: {m["gflops_per_s"]:,.0f} GFLOP/s')
  if r.get('errors'):
    rows.append(f'failed sections (tracebacks in the JSON): {", ".join(r["errors"])}')
  return '\n'.join(rows)


GOAL_FRAMES_PER_S = 1e6  # issue N item 6: batched inference on a GPU


def markdown(r: dict) -> str:
  """The JSON as Markdown tables for BENCHMARKS.md (written beside it as `.md`): inference
  frames/s per batch and variant with the JAX/torch_geometric ratio, the best batch of each
  against the 1M frames/s goal and as a share of the same run's matmul rate, training, the
  matmul, and what each "float32" means."""
  dev, inf, tg = r.get('device', {}), r.get('inference', {}), r.get('torch_geometric', {})
  m = r.get('model', {})
  num = lambda x, f=',.0f': '-' if x is None else format(x, f)
  rows = [f'Device: {dev.get("device_kind")} ({dev.get("backend")}, {dev.get("device_count")} '
          f'device(s)); {", ".join(f"{k} {v}" for k, v in dev.get("versions", {}).items())}.',
          f'Model: IK-GAT {m.get("size")} ({num(m.get("params"))} parameters, '
          f'{m.get("source")}). Command: `{r.get("command")}`.', '']
  variants = INFERENCE_VARIANTS
  by = {v: {x['batch']: x for x in inf.get(v, {}).get('results', [])} for v in variants}
  by['tg'] = {x['batch']: x for x in tg.get('results', [])}
  rows += ['| batch | float32 frames/s | float32 ms | float32, attention auto | bfloat16 | '
           'bfloat16 products | torch_geometric | JAX float32 / torch_geometric |',
           '|---:|---:|---:|---:|---:|---:|---:|---:|']
  for b in sorted(set().union(*by.values())):
    cell = lambda v, k='frames_per_s': num(by[v][b][k]) if b in by[v] else '-'
    ratio = (f'{by["float32"][b]["frames_per_s"] / by["tg"][b]["frames_per_s"]:.2f}x'
             if b in by['float32'] and b in by['tg'] else '-')
    ms = num(by['float32'].get(b, {}).get('median_ms'), '.3f')
    rows.append(f'| {b:,} | {cell("float32")} | {ms} | {cell("float32_auto")} | '
                f'{cell("bfloat16")} | {cell("bfloat16_products")} | {cell("tg")} | {ratio} |')
  f32_rate = (r.get('matmul', {}).get('float32') or {}).get('gflops_per_s')
  rows += ['', '| variant | best frames/s (batch) | of the 1M goal | FLOPs per frame | '
           'share of the float32 matmul | stopped |', '|---|---:|---:|---:|---:|---|']
  for v in variants:
    s = inf.get(v, {})
    best, flops = s.get('best_frames_per_s'), None
    if s.get('results'):
      flops = s['results'][0].get('flops_per_frame')
    share = (f'{100 * best * flops / (f32_rate * 1e9):.0f}%'
             if best and flops and f32_rate else '-')
    rows.append(f'| {v} | {num(best)} ({num(s.get("best_batch"))}) | '
                f'{"-" if not best else f"{100 * best / GOAL_FRAMES_PER_S:.0f}%"} | '
                f'{num(flops and flops / 1e6, ".2f")} M | {share} | {_stopped(s)} |')
  t = r.get('training', {})
  rows += ['', '| training batch | steps/s | frames/s | compile s |', '|---:|---:|---:|---:|']
  rows += [f'| {x["batch"]:,} | {x["steps_per_s"]:.1f} | {num(x["frames_per_s"])} | '
           f'{x["compile_s"]:.1f} |' for x in t.get('results', [])]
  rows.append(f'Training stopped: {_stopped(t)}; on {t.get("devices", "?")} device(s).')
  rows += ['', '| matmul | n | GFLOP/s |', '|---|---:|---:|']
  rows += [f'| {d} | {x["n"]} | {num(x["gflops_per_s"])} |'
           for d, x in r.get('matmul', {}).items()
           if isinstance(x, dict) and 'gflops_per_s' in x]
  tf = tg.get('float32_matmul')
  rows += ['', f'"float32": JAX `jax_default_matmul_precision` = '
           f'{dev.get("jax_default_matmul_precision")} (XLA picks: TF32 on NVIDIA Ampere and '
           'newer); torch_geometric ' + (
               f'`torch.get_float32_matmul_precision()` = {tf["precision"]}, CUDA allow_tf32 '
               f'{tf["cuda_allow_tf32"]}' if tf else f'({tg.get("status")})') + '.']
  if r.get('errors'):
    rows.append(f'Failed sections (tracebacks in the JSON): {", ".join(r["errors"])}.')
  return '\n'.join(rows) + '\n'


# ----------------------------------------------------------------------------------------------
# The absl main (flags defined only when run as a script, so tests can import this module).


def define_flags() -> None:
  flags.DEFINE_string('output_json', Options.output_json, 'Where the JSON goes.')
  flags.DEFINE_enum('size', 'base', ['tiny', 'small', 'base', 'large'], 'Model size.')
  flags.DEFINE_enum('rig', 'cmu_body', ['cmu_body', 'smpl22'], 'Built-in rig.')
  flags.DEFINE_integer('max_batch', None, 'Largest batch (default 1<<20 on an accelerator, '
                       '1024 on the CPU, 4 with --tiny).', lower_bound=1)
  flags.DEFINE_float('time_budget_s', 240.0, 'Time for all sections together; batches stop '
                     'growing when a section\'s share is near.')
  flags.DEFINE_boolean('tiny', False, 'Tiny model and batches (the CPU test).')
  flags.DEFINE_list('train_batches', None, 'Training batch sizes (default 256,1024,4096; '
                    'capped by --max_batch).')
  flags.DEFINE_float('measure_s', None, 'Seconds of timed calls per measurement (default 0.5).')
  flags.DEFINE_boolean('torch', True, 'Measure PyTorch + torch_geometric when installed.')
  flags.DEFINE_integer('batch_step', None, 'Inference batches 1, step, step^2, ... (default 4 on '
                       'an accelerator, 2 on the CPU).', lower_bound=2)
  flags.DEFINE_string('torch_child', None, 'Internal: run the PyTorch part from this spec.')
  flags.DEFINE_string('report', None, 'Print an existing JSON of this check (a partial one too) '
                      'as Markdown, and measure nothing.')


def main(argv) -> None:
  if len(argv) > 1:
    raise SystemExit(f'error: unexpected arguments {argv[1:]}')
  F = flags.FLAGS
  if F.torch_child:
    torch_child(F.torch_child)
    return
  if F.report:
    try:
      print(markdown(json.loads(Path(F.report).read_text())), end='')
    except (OSError, ValueError) as e:
      raise SystemExit(f'error: cannot read {F.report}: {e}') from None
    except (AttributeError, TypeError, KeyError) as e:
      raise SystemExit(f'error: {F.report} is not a JSON of this check ({type(e).__name__}: '
                       f'{e})') from None
    return
  os.environ.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', MEM_FRACTION)  # before JAX starts
  o = Options(output_json=F.output_json, size=F.size, rig=F.rig, max_batch=F.max_batch,
              time_budget_s=F.time_budget_s, tiny=F.tiny,
              train_batches=tuple(int(b) for b in F.train_batches) if F.train_batches else None,
              measure_s=F.measure_s, torch=F.torch, batch_step=F.batch_step)
  if run(o)['errors']:
    sys.exit(1)  # the JSON is written; the failed sections' tracebacks are in it and above


if __name__ == '__main__':
  define_flags()
  run_main(main)
