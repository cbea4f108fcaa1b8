"""How long a new `IKSolver` takes to its first answers, and what it compiles.

  python -m experiments.solver_startup [--clip=../shared/data/cmu/07_05.bvh] [--checkpoint=DIR]
      [--frames=100] [--warm_up] [--latency_frames=0] [--live_backend] [--json=FILE]

Three solvers made one after another in one process, as a scene that adds people does: the
first (it compiles), a second of the same checkpoint and subject (it shares the first's
executables: `solver._ExecutableCache`), and a third with another subject's offsets (the
clip's scaled by 1.05: `step` holds its subject as constants, so it compiles `step` once more;
its clips share). For each: seconds to load it, to its first `step` (the clip's first frame),
to its first `solve` of the clip's first `--frames` frames, and how many times it traced
(`IKSolver.trace_count`). With `--warm_up` the first solver calls `IKSolver.warm_up()` before
its first frame (its own `step` and one taking any subject), so the third's first frames run on
the latter while its own compiles in the background: its first step is that frame's, its
`step_compiled_s` when its own program was in place (session 43). The persistent compilation
caches are off unless the environment turns them on (`JAX_COMPILATION_CACHE_DIR`), so the
first solver's times are compiling's (BENCHMARKS.md "A second solver", session 42).
`--latency_frames=N`: then a live frame on the solver's own `step` program against the one
taking any subject, N frames each in eight interleaved blocks, the median of the blocks'
medians (`--live_backend`: started first).
"""

import json
import time
from pathlib import Path

from absl import flags

from experiments.common import fail_on_user_error, run_main

_CLIP = flags.DEFINE_string('clip', str(Path(__file__).resolve().parents[2] / 'shared' / 'data'
                                        / 'cmu' / '07_05.bvh'), 'A BVH clip of the rig.')
_CKPT = flags.DEFINE_string('checkpoint', None, 'IK-GAT run or checkpoint (default: shipped).')
_FRAMES = flags.DEFINE_integer('frames', 100, 'Frames of the clip each solver solves.',
                               lower_bound=1)
_WARM_UP = flags.DEFINE_bool('warm_up', False, 'The first solver calls warm_up() first.')
_LATENCY = flags.DEFINE_integer('latency_frames', 0, 'Frames per block timing own vs any '
                                'subject\'s step (0: not timed).', lower_bound=0)
_LIVE = flags.DEFINE_bool('live_backend', False, 'Start the live backend first.')
_JSON = flags.DEFINE_string('json', None, 'Write the result here too.')
SCALES = (1.0, 1.0, 1.05)  # the three solvers' subjects: the clip's offsets times these


def measure(clip: str, checkpoint: str | None = None, frames: int = 100,
            warm_up: bool = False) -> list[dict]:
  """Per solver (`SCALES`): its subject's scale, seconds to load, to the first `step` and to
  the first `solve` of `frames` frames, and `trace_count` after both; with `warm_up`, the first
  solver's `warm_up()` seconds, and for each solver the seconds from its first step until its
  own `step` program was in place (`step_compiled_s`, 0 when the first step compiled it)."""
  from ik_gat_jax import IKSolver  # pylint: disable=import-outside-toplevel
  from ik_gat_jax.io import exports  # pylint: disable=import-outside-toplevel
  probe = IKSolver.from_checkpoint(checkpoint)  # the rig only: nothing compiled
  data = exports.read_bvh_clip(clip, probe.rig, max_frames=frames)
  rows = []
  for scale in SCALES:
    t0 = time.perf_counter()
    solver = IKSolver.from_checkpoint(checkpoint, offsets=data.offsets * scale)
    extra = {}
    if warm_up and not rows:
      w = time.perf_counter()
      solver.warm_up()
      extra['warm_up_s'] = time.perf_counter() - w
    t1 = time.perf_counter()
    solver.step(data.positions[0] * scale)
    t2 = time.perf_counter()
    solver._wait_for_compiles()  # pylint: disable=protected-access
    extra['step_compiled_s'] = time.perf_counter() - t1 if warm_up else 0.0
    t2b = time.perf_counter()
    solver.solve(data.positions * scale)
    t3 = time.perf_counter()
    rows.append({'subject_scale': scale, 'load_s': t1 - t0 - extra.get('warm_up_s', 0.0),
                 'first_step_s': t2 - t1, 'first_solve_s': t3 - t2b,
                 'frames': int(len(data.positions)), 'traces': solver.trace_count, **extra})
  return rows


def own_vs_any(clip: str, checkpoint: str | None, frames: int) -> dict:
  """Median ms of a live frame on the solver's own `step` program (subject compiled in) and on
  the one taking any subject (`IKSolver._step_forward`): eight blocks of `frames` frames of
  `clip`, alternating which goes first, the median of each block's median."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from ik_gat_jax import IKSolver  # pylint: disable=import-outside-toplevel
  from ik_gat_jax.io import exports  # pylint: disable=import-outside-toplevel
  probe = IKSolver.from_checkpoint(checkpoint)
  data = exports.read_bvh_clip(clip, probe.rig, max_frames=frames)
  solver = IKSolver.from_checkpoint(checkpoint, offsets=data.offsets)
  solver.warm_up()
  # pylint: disable=protected-access  (the two programs `step` chooses between)
  subject, own = solver._device_subject(solver.offsets), solver._default_step()
  pos = np.asarray(data.positions, np.float32)
  ways = {'own': lambda p: np.asarray(own(p[None])),
          'any': lambda p: solver._step_forward(p[None], subject)}
  medians = {k: [] for k in ways}
  for block in range(8):
    for name in (('own', 'any') if block % 2 == 0 else ('any', 'own')):
      times = []
      for p in pos:
        t = time.perf_counter()
        ways[name](p)
        times.append(time.perf_counter() - t)
      medians[name].append(1e3 * float(np.median(times)))
  return {f'{k}_ms': float(np.median(v)) for k, v in medians.items()}


@fail_on_user_error
def main(argv):
  del argv
  if _LIVE.value:
    import ik_gat_jax  # pylint: disable=import-outside-toplevel
    ik_gat_jax.start_live_backend()
  rows = measure(_CLIP.value, _CKPT.value, _FRAMES.value, _WARM_UP.value)
  for i, r in enumerate(rows):
    print(f'solver {i + 1} (offsets x{r["subject_scale"]:g}): load {r["load_s"]:.2f} s'
          + (f', warm_up {r["warm_up_s"]:.2f} s' if 'warm_up_s' in r else '')
          + f', first step {r["first_step_s"]:.3f} s'
          + (f' (its own step in place after {r["step_compiled_s"]:.2f} s)' if _WARM_UP.value
             else '')
          + f', first solve of {r["frames"]} frames {r["first_solve_s"]:.2f} s, traced '
          f'{r["traces"]}x')
  if _LATENCY.value:
    lat = own_vs_any(_CLIP.value, _CKPT.value, _LATENCY.value)
    print(f'a live frame: {lat["own_ms"]:.3f} ms on its own step program, {lat["any_ms"]:.3f} ms '
          'on the one taking any subject (median of 8 blocks)')
    rows.append({'latency': lat})
  if _JSON.value:
    Path(_JSON.value).write_text(json.dumps(rows, indent=1))


if __name__ == '__main__':
  run_main(main)
