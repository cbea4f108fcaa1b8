"""Which threads do a clip's work: the CPU time of every thread of the process while
`IKSolver.solve` solves one clip several times (Linux, `/proc/self/task`).

  python -m experiments.thread_times --clip=../shared/data/cmu/01_06.bvh [--attention=sparse]
      [--workers=2] [--solves=5] [--live_backend] [--json=FILE]

Solves the clip once (compiling), then `--solves` times timed, and prints frames/s, the
solver's attention form (`IKSolver.attention`) and each thread that used at least 0.05 s of CPU
meanwhile: its name (`comm`: XLA's intra-op pool threads are `tf_XLAEigen`, Python's threads
`python`) and seconds. The solver's worker threads end with each solve, so their time shows as
threads that are gone by the end (`ended`, summed). A thread that holds the work while the others
wait is the sign of work handed to one thread (BENCHMARKS.md, issue N session 34: `auto` chunks on
the live backend's one pool thread).
"""

import json
import os
import time

from absl import flags

from experiments.common import fail_on_user_error, run_main
from ik_gat_jax import inference

_CLIP = flags.DEFINE_string('clip', None, 'A clip (BVH, or npz / csv in metres).', required=True)
_CKPT = flags.DEFINE_string('checkpoint', None, 'IK-GAT run or checkpoint (default: shipped).')
_ATTENTION = flags.DEFINE_enum('attention', 'dense', ['dense', 'auto', 'sparse'],
                               'IKSolver.from_checkpoint\'s attention (\'sparse\': that form '
                               'whatever the batch, as \'auto\' took it before session 34).')
_WORKERS = flags.DEFINE_integer('workers', None, 'The solver\'s workers (default: '
                                'solver.default_workers()).', lower_bound=1)
_SOLVES = flags.DEFINE_integer('solves', 5, 'Timed solves of the clip.', lower_bound=1)
_LIVE = flags.DEFINE_boolean('live_backend', False, 'Start JAX with '
                             '`ik_gat_jax.start_live_backend()` first.')
_JSON = flags.DEFINE_string('json', None, 'Write the result here too.')
_SHOWN = 0.05  # seconds: threads below this are left out of the listing


def thread_cpu_seconds() -> dict[int, tuple[str, float]]:
  """Thread id -> (name, user + system CPU seconds so far) of every thread of this process."""
  tick = os.sysconf('SC_CLK_TCK')
  out = {}
  for tid in os.listdir('/proc/self/task'):
    try:
      with open(f'/proc/self/task/{tid}/stat') as f:
        fields = f.read().rsplit(')', 1)[1].split()  # after "pid (comm)"
      with open(f'/proc/self/task/{tid}/comm') as f:
        name = f.read().strip()
    except OSError:  # ended meanwhile
      continue
    out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime, stime
  return out


def cpu_by_thread(before: dict, after: dict) -> dict[str, float]:
  """{'name tid': CPU seconds between two `thread_cpu_seconds`} of the threads alive at both."""
  return {f'{name} {tid}': sec - before[tid][1] for tid, (name, sec) in after.items()
          if tid in before}


@fail_on_user_error
def main(argv):
  del argv
  if not os.path.isdir('/proc/self/task'):
    raise ValueError('thread times need /proc/self/task (Linux)')
  if _LIVE.value:
    inference.start_live_backend()
  from ik_gat_jax.io import exports  # pylint: disable=import-outside-toplevel
  from ik_gat_jax.solver import IKSolver  # pylint: disable=import-outside-toplevel
  solver = IKSolver.from_checkpoint(_CKPT.value or inference.SHIPPED_IKGAT,
                                    attention=_ATTENTION.value, workers=_WORKERS.value)
  source = exports.read_positions(_CLIP.value, solver.rig)
  offsets = source.offsets if source.metres_rig else None
  solver.solve(source.positions, offsets=offsets, progress=False)  # compile first
  before, process_before = thread_cpu_seconds(), time.process_time()
  t = time.perf_counter()
  for _ in range(_SOLVES.value):
    solver.solve(source.positions, offsets=offsets, progress=False)
  wall = time.perf_counter() - t
  after, process = thread_cpu_seconds(), time.process_time() - process_before
  alive = cpu_by_thread(before, after)
  ended = max(0.0, process - sum(alive.values()))  # the workers: started and ended per solve
  result = {'frames_per_s': _SOLVES.value * len(source.positions) / wall, 'wall_s': wall,
            'cpu_s': process, 'attention': solver.attention, 'workers': solver.workers,
            'live_backend': inference.live_backend() is not None,
            'threads': {k: v for k, v in sorted(alive.items(), key=lambda kv: -kv[1])
                        if v >= _SHOWN},
            'ended_threads_s': ended}
  print(f'{_CLIP.value}: {_SOLVES.value} solves of {len(source.positions)} frames, '
        f'{result["frames_per_s"]:,.0f} frames/s, attention {solver.attention}, '
        f'{solver.workers} worker(s){", live backend" if result["live_backend"] else ""}; '
        f'CPU {process:.2f} s in {wall:.2f} s:')
  for name, sec in result['threads'].items():
    print(f'  {sec:7.2f} s  {name}')
  print(f'  {ended:7.2f} s  threads that ended meanwhile (the solver\'s workers)')
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(result, f, indent=1)


if __name__ == '__main__':
  run_main(main)
