"""Where one live frame's time goes: `IKSolver.step` split into its parts (issue N item 1).

  taskset -c 0 python -m experiments.latency_breakdown [--checkpoint=DIR] [--calls=3000] \
      [--live_backend] [--json=FILE]

Every part is timed alone, interleaved with the others in rounds (medians over all rounds, so a
change in the machine's load hits every part alike), in ms per frame:
  step            `IKSolver.step(frame)`: numpy in -> numpy out, everything included
  step_lying      the same on the frame turned on its side (90 deg about the rig's forward axis,
                  about its root): past both tilt limits, so the model's branch that turns a
                  tilted body back runs (`model.tilt_rotation`; upright frames skip it)
  step_any_subject  `IKSolver.step(frame, offsets=...)` with the solver's own offsets given:
                  the general path, whose executable takes the model's state and the subject
                  as arguments (`step` compiles them in)
  host_checks     shape/finite checks, the sparse-input check
  executable      step's compiled forward (network + conversion to local rotations; the model
                  and the solver's subject compiled in as constants) on a frame
                  already on the device, waited on: the network's own time
  to_device       what a numpy float32 frame handed to the executable adds (step's way in)
  to_host         the output back as numpy (`np.asarray`; what it adds on top)
  dispatch_floor  a compiled `x + 1` on the same `[1, J, 3]` input: the cost of any XLA call
  numpy_reduction what one numpy reduction (`.all()` of 21 bools) between two calls of the
                  executable adds to a call, the reduction's own time included
Also: XLA's FLOPs per frame and its count of kernels (fusions, dots, ...) of the forward, the
single-core rate of the forward's largest matmul shape alone (`[J, d] @ [d, d]`, GFLOP/s) and
the floor it implies for the network (FLOPs / that rate). XLA flags (e.g. `XLA_FLAGS=
--xla_cpu_use_thunk_runtime=false`) apply when set before the run; the JSON records them.
"""

import collections
import os
import re
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from scipy.spatial.transform import Rotation

from experiments.common import fail_on_user_error, run_main
from ik_gat_jax import data, inference, provenance
from ik_gat_jax.io import atomic
from ik_gat_jax.skeleton import rest_positions_np
from ik_gat_jax.solver import IKSolver, check_positions

PARTS = ('step', 'step_lying', 'step_any_subject', 'host_checks', 'to_device', 'executable',
         'to_host', 'python_rest', 'dispatch_floor', 'numpy_reduction')  # in the order printed

_CKPT = flags.DEFINE_string('checkpoint', None, 'IK-GAT run or checkpoint (default: shipped).')
_DATA = flags.DEFINE_string('data', None, 'Shards whose val frames are fed (default: the rest '
                            'pose with noise).')
_CALLS = flags.DEFINE_integer('calls', 3000, 'Timed calls per part.')
_PRECISION = flags.DEFINE_enum('matmul_precision', 'float32', ['float32', 'bfloat16'],
                               'The network\'s large products (IKSolver.from_checkpoint).')
_LIVE = flags.DEFINE_boolean('live_backend', False, 'Start JAX with '
                             '`ik_gat_jax.start_live_backend()` first: every call on the '
                             'calling thread (README, "Solving your own positions").')
_JSON = flags.DEFINE_string('json', None, 'Write the result here too.')


def _median_ms(fns: dict, frames: np.ndarray, calls: int, rounds: int = 10) -> dict[str, float]:
  """Median ms of each `fn(frame)`, `calls` calls each, in `rounds` interleaved rounds; a value
  `(fn, own_frames)` is fed its own frames."""
  times = {k: [] for k in fns}
  per = max(calls // rounds, 1)
  for r in range(rounds):
    for name, fn in fns.items():
      fn, fed = fn if isinstance(fn, tuple) else (fn, frames)
      for i in range(per):
        f = fed[(r * per + i) % len(fed)]
        t = time.perf_counter()
        fn(f)
        times[name].append(time.perf_counter() - t)
  return {k: float(1e3 * np.median(v)) for k, v in times.items()}


def _matmul_gflops(J: int, d: int, calls: int = 400) -> float:
  """GFLOP/s of a jitted chain of 8 `[J, d] @ [d, d]` products (one call's overhead shared)."""
  x, w = jnp.ones((J, d), jnp.float32), jnp.full((d, d), 1.0 / d, jnp.float32)
  chain = jax.jit(lambda x, w: jax.lax.fori_loop(0, 8, lambda _, y: y @ w, x)).lower(
      x, w).compile()
  chain(x, w).block_until_ready()
  ts = []
  for _ in range(calls):
    t = time.perf_counter()
    chain(x, w).block_until_ready()
    ts.append(time.perf_counter() - t)
  return 8 * 2 * J * d * d / np.median(ts) / 1e9


def kernel_counts(compiled) -> dict[str, int]:
  """Instructions of the compiled module's entry computation by opcode (each fusion, dot or
  copy is one kernel launch on the CPU runtime)."""
  text = compiled.as_text()
  entry = text[text.index('ENTRY'):]
  ops = collections.Counter(re.findall(r'= \S+ ([\w-]+)\(', entry))
  return dict(ops.most_common())


def breakdown(solver: IKSolver, frames: np.ndarray, calls: int) -> dict:
  J = solver.rig.num_joints
  for f in frames[:50]:
    solver.step(f)  # compiles step's executable, warms the caches
  exe = solver._default_step()  # pylint: disable=protected-access
  offsets = np.array(solver.offsets)
  solver.step(frames[0], offsets=offsets)  # compiles the general path
  turn = Rotation.from_rotvec(0.5 * np.pi * np.asarray(solver.rig.forward)).as_matrix()
  lying = (frames - frames[:, :1]) @ turn.T + frames[:, :1]
  with warnings.catch_warnings():  # the point here: a body whose up is not the rig's
    warnings.filterwarnings('ignore', message='up axis looks wrong')
    solver.step(lying[0])
  on_device = jnp.asarray(frames[:1], jnp.float32)
  floor = jax.jit(lambda x: x + 1).lower(on_device).compile()
  flags_ = np.ones(J, bool)

  def host_checks(f):
    pos, _ = check_positions(f, solver.rig, allow_missing=solver.supports_masks)
    solver.sparse_inputs(pos)

  parts = _median_ms({
      'step': solver.step,
      'step_lying': (solver.step, lying),
      'step_any_subject': lambda f: solver.step(f, offsets=offsets),
      'host_checks': host_checks,
      'executable': lambda f: exe(on_device).block_until_ready(),
      'numpy_in': lambda f: exe(np.asarray(f[None], np.float32)).block_until_ready(),
      'numpy_in_out': lambda f: np.asarray(exe(np.asarray(f[None], np.float32))),
      'dispatch_floor': lambda f: floor(on_device).block_until_ready(),
      'numpy_in_out_reduction': lambda f: (flags_.all(), np.asarray(exe(
          np.asarray(f[None], np.float32)))),
  }, frames, calls)
  parts['numpy_reduction'] = parts.pop('numpy_in_out_reduction') - parts['numpy_in_out']
  parts['to_host'] = parts.pop('numpy_in_out') - parts['numpy_in']
  parts['to_device'] = parts.pop('numpy_in') - parts['executable']
  parts['python_rest'] = parts['step'] - sum(parts[k] for k in (
      'host_checks', 'to_device', 'executable', 'to_host'))
  cost = exe.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  flops = float(cost.get('flops', float('nan')))
  d = max(int(l.shape[-1]) for l in solver._leaves if getattr(l, 'ndim', 0) == 2
          and l.shape[0] == l.shape[1])
  rate = _matmul_gflops(J, d)
  return {'ms': parts, 'flops_per_frame': flops, 'kernels': kernel_counts(exe),
          'square_matmul': {'shape': f'[{J}, {d}] @ [{d}, {d}]', 'gflop_per_s': rate},
          'network_floor_ms': flops / (rate * 1e9) * 1e3}


@fail_on_user_error
def main(argv):
  del argv
  if _LIVE.value:
    inference.start_live_backend()
  solver = IKSolver.from_checkpoint(_CKPT.value or inference.SHIPPED_IKGAT,
                                    matmul_precision=_PRECISION.value)
  if _DATA.value:
    frames = np.asarray(data.load_shards(_DATA.value, 'val').positions[:1000], np.float64)
  else:
    rng = np.random.default_rng(0)
    rest = rest_positions_np(solver.offsets, solver.rig.parents)
    frames = rest[None] + 0.01 * rng.normal(size=(1000,) + rest.shape)
  result = breakdown(solver, frames, _CALLS.value)
  result.update(checkpoint=solver.source, matmul_precision=solver.matmul_precision,
                cpus=sorted(os.sched_getaffinity(0)), live_backend=inference.live_backend(),
                xla_flags=os.environ.get('XLA_FLAGS', ''), backend=jax.default_backend(),
                provenance=provenance.provenance())
  ms = result['ms']
  print(f"IK-GAT {solver.source}: one live frame, {solver.matmul_precision} products, "
        f"{len(result['cpus'])} core(s), "
        f"{'live backend, ' if result['live_backend'] else ''}"
        f"XLA_FLAGS={result['xla_flags']!r}")
  for k in PARTS:
    print(f'  {k:16s} {ms[k]:7.3f} ms')
  print(f"  network: {result['flops_per_frame'] / 1e6:.1f} MFLOP/frame, kernels "
        f"{sum(result['kernels'].values())} ({result['kernels']}); "
        f"{result['square_matmul']['shape']} alone {result['square_matmul']['gflop_per_s']:.1f}"
        f" GFLOP/s -> floor {result['network_floor_ms']:.3f} ms")
  if _JSON.value:
    atomic.write_json(_JSON.value, result)


if __name__ == '__main__':
  run_main(main)
