"""Where a compiled IK-GAT forward's time goes, kernel by kernel (XLA's own CPU trace).

  taskset -c 0 python -m experiments.kernel_profile [--checkpoint=DIR] [--batch=32]
      [--attention=auto] [--calls=50] [--top=20] [--live]

Times `--calls` calls of the network and its conversion to local rotations
(`inference.ikgat_infer`, blocks as the backend runs them) at `--batch` frames (`--live`:
`IKSolver.step`'s own executable on one frame, as a live stream runs it), untraced (the
median of 7 rounds), then traces as many with XLA's per-kernel events on
(`--xla_cpu_enable_xprof_traceme=true`, added to XLA_FLAGS before JAX starts its backend) and
sums each kernel's time per call (`jax.profiler.ProfileData`). Prints the kernels grouped by
their HLO name without its numeric suffix (`dot`, `add_bitcast_fusion`, ...; `--top` groups),
then the largest single kernels, and the dots' share. Tracing adds overhead, so read the shares
and compare runs of the same command, not the traced times against untraced ones. Where a
BENCHMARKS.md section profiles a block of the network, this is its command.
"""

import collections
import os
import re
import tempfile
import time

from absl import flags
import numpy as np

from experiments.common import fail_on_user_error, run_main

_TRACE_FLAG = '--xla_cpu_enable_xprof_traceme=true'
_CKPT = flags.DEFINE_string('checkpoint', None, 'IK-GAT run or checkpoint (default: shipped).')
_BATCH = flags.DEFINE_integer('batch', 32, 'Frames per call.', lower_bound=1)
_ATTENTION = flags.DEFINE_enum('attention', 'auto', ['dense', 'auto', 'sparse'],
                               'How the graph attention is evaluated (gat.set_form).')
_CALLS = flags.DEFINE_integer('calls', 50, 'Calls timed, and traced.', lower_bound=1)
_PRECISION = flags.DEFINE_enum('matmul_precision', 'float32', ['float32', 'bfloat16'],
                               'The network\'s large products (model.set_matmul_precision).')
_LIVE = flags.DEFINE_bool('live', False, 'Profile `IKSolver.step`\'s own executable instead (one '
                          'frame; the model and the subject compiled in): --batch is ignored.')
_TOP = flags.DEFINE_integer('top', 20, 'Kernel groups and single kernels printed.',
                            lower_bound=1)
# An HLO instruction's name (lower case, no spaces): the host's events (ThunkExecutor::Execute,
# ParseArguments, 'Handle inputs', $api.py:...) are not kernels.
_KERNEL = re.compile(r'^[a-z_][\w-]*(\.\d+)?$')
_CONTAINERS = ('while', 'conditional', 'call')  # their bodies' kernels are events of their own


def kernel_times(xspace_path: str, calls: int) -> dict[str, tuple[float, float]]:
  """Each kernel's (microseconds, events) per call in an xplane file: not the host's events,
  nor loops and conditionals, whose bodies' kernels are traced as events of their own (a loop
  body's kernel once per trip)."""
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  total, events = collections.Counter(), collections.Counter()
  for plane in ProfileData.from_file(xspace_path).planes:
    for line in plane.lines:
      for event in line.events:
        if (_KERNEL.match(event.name)
            and re.sub(r'\.\d+$', '', event.name) not in _CONTAINERS):
          total[event.name] += event.duration_ns / 1e3 / calls
          events[event.name] += 1 / calls
  return {k: (total[k], events[k]) for k in total}


def groups(times: dict[str, tuple[float, float]]) -> dict[str, tuple[float, int, float]]:
  """Kernel name without its `.N` suffix -> (microseconds per call, kernels, events per
  call)."""
  out: dict[str, list] = {}
  for name, (us, n) in times.items():
    g = out.setdefault(re.sub(r'\.\d+$', '', name), [0.0, 0, 0.0])
    g[0] += us
    g[1] += 1
    g[2] += n
  return {k: (v[0], v[1], v[2]) for k, v in out.items()}


@fail_on_user_error
def main(argv):
  del argv
  flags_now = os.environ.get('XLA_FLAGS', '')
  if 'xla_cpu_enable_xprof_traceme' not in flags_now:
    os.environ['XLA_FLAGS'] = f'{flags_now} {_TRACE_FLAG}'.strip()
  import jax  # pylint: disable=import-outside-toplevel
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  if xla_bridge.backends_are_initialized():  # too late for the flag: no per-kernel events
    raise RuntimeError('JAX started its backend before the trace flag was set')
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from ik_gat_jax import bone_frames, gat, inference  # pylint: disable=import-outside-toplevel
  from ik_gat_jax import model as model_lib  # pylint: disable=import-outside-toplevel
  if jax.default_backend() != 'cpu':
    raise ValueError(f'XLA\'s per-kernel trace events are the CPU backend\'s; this backend is '
                     f'{jax.default_backend()}')
  from ik_gat_jax.solver import IKSolver  # pylint: disable=import-outside-toplevel
  batch = 1 if _LIVE.value else _BATCH.value
  rng = np.random.default_rng(0)
  if _LIVE.value:
    solver = IKSolver.from_checkpoint(_CKPT.value, attention=_ATTENTION.value,
                                      matmul_precision=_PRECISION.value)
    forward = solver._default_step()  # pylint: disable=protected-access
    rig = solver.rig
  else:
    model, _ = inference.load_model(_CKPT.value or inference.SHIPPED_IKGAT)
    rig = model.rig
    gat.set_form(model, _ATTENTION.value)
    model_lib.set_matmul_precision(model, _PRECISION.value)
    B = bone_frames.bone_frames(jnp.asarray(rig.template(), jnp.float32), rig)[None]
    forward = jax.jit(lambda p: inference.ikgat_infer(model, {'positions': p,
                                                              'bone_frames': B}),
                      compiler_options=inference.compiler_options(model))
  p = jnp.asarray(rig.template().cumsum(0)[None] + 0.05 * rng.normal(
      size=(batch, rig.num_joints, 3)), jnp.float32)
  n = _CALLS.value
  for _ in range(5):
    jax.block_until_ready(forward(p))
  rounds = []
  for _ in range(7):
    t = time.perf_counter()
    for _ in range(n):
      jax.block_until_ready(forward(p))
    rounds.append(1000 * (time.perf_counter() - t) / n)
  with tempfile.TemporaryDirectory() as tmp:
    jax.profiler.start_trace(tmp)
    for _ in range(n):
      jax.block_until_ready(forward(p))
    jax.profiler.stop_trace()
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs
               if f.endswith('.xplane.pb')]
    times = kernel_times(path, n)
  if not times:
    raise RuntimeError('the trace holds no kernel events (XLA_FLAGS: '
                       f'{os.environ.get("XLA_FLAGS")!r})')
  total = sum(us for us, _ in times.values())
  what = 'step\'s executable, one frame' if _LIVE.value else f'batch {batch}'
  print(f'IK-GAT {_CKPT.value or inference.SHIPPED_IKGAT}, {what}, attention '
        f'{_ATTENTION.value}, {_PRECISION.value} products, blocks of '
        f'{inference.micro_batch_size()}: untraced '
        f'{np.median(rounds):.3f} ms per call (median of 7 rounds of {n}); traced kernels '
        f'{total / 1e3:.3f} ms per call, {len(times)} kernels')
  g = groups(times)
  dots = sum(us for k, (us, _, _) in g.items() if k in ('dot', 'dot_general'))
  print(f'dots {dots / 1e3:.3f} ms ({100 * dots / total:.0f}%), the rest '
        f'{(total - dots) / 1e3:.3f} ms')
  print('by kernel kind (us per call, kernels, kernel runs per call, share):')
  for k, (us, count, runs) in sorted(g.items(), key=lambda kv: -kv[1][0])[:_TOP.value]:
    print(f'  {us:9.1f}  {count:4d}  {runs:6.1f}  {100 * us / total:5.1f}%  {k}')
  print('largest kernels (us per call):')
  for k, (us, _) in sorted(times.items(), key=lambda kv: -kv[1][0])[:_TOP.value]:
    print(f'  {us:9.1f}  {k}')


if __name__ == '__main__':
  run_main(main)
