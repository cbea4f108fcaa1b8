"""How long a new `IKSolver` takes to its first answers, and what it compiles.

  python -m experiments.solver_startup [--clip=../shared/data/cmu/07_05.bvh] [--checkpoint=DIR]
      [--frames=100] [--json=FILE]

Three solvers made one after another in one process, as a scene that adds people does: the
first (it compiles), a second of the same checkpoint and subject (it shares the first's
executables: `solver._ExecutableCache`), and a third with another subject's offsets (the
clip's scaled by 1.05: `step` holds its subject as constants, so it compiles `step` once more;
its clips share). For each: seconds to load it, to its first `step` (the clip's first frame),
to its first `solve` of the clip's first `--frames` frames, and how many times it traced
(`IKSolver.trace_count`). The persistent compilation caches are off unless the environment
turns them on (`JAX_COMPILATION_CACHE_DIR`), so the first solver's times are compiling's
(BENCHMARKS.md "A second solver", session 42).
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
_JSON = flags.DEFINE_string('json', None, 'Write the result here too.')
SCALES = (1.0, 1.0, 1.05)  # the three solvers' subjects: the clip's offsets times these


def measure(clip: str, checkpoint: str | None = None, frames: int = 100) -> list[dict]:
  """Per solver (`SCALES`): its subject's scale, seconds to load, to the first `step` and to
  the first `solve` of `frames` frames, and `trace_count` after both."""
  from ik_gat_jax import IKSolver  # pylint: disable=import-outside-toplevel
  from ik_gat_jax.io import exports  # pylint: disable=import-outside-toplevel
  probe = IKSolver.from_checkpoint(checkpoint)  # the rig only: nothing compiled
  data = exports.read_bvh_clip(clip, probe.rig, max_frames=frames)
  rows = []
  for scale in SCALES:
    t0 = time.perf_counter()
    solver = IKSolver.from_checkpoint(checkpoint, offsets=data.offsets * scale)
    t1 = time.perf_counter()
    solver.step(data.positions[0] * scale)
    t2 = time.perf_counter()
    solver.solve(data.positions * scale)
    t3 = time.perf_counter()
    rows.append({'subject_scale': scale, 'load_s': t1 - t0, 'first_step_s': t2 - t1,
                 'first_solve_s': t3 - t2, 'frames': int(len(data.positions)),
                 'traces': solver.trace_count})
  return rows


@fail_on_user_error
def main(argv):
  del argv
  rows = measure(_CLIP.value, _CKPT.value, _FRAMES.value)
  for i, r in enumerate(rows):
    print(f'solver {i + 1} (offsets x{r["subject_scale"]:g}): load {r["load_s"]:.2f} s, first '
          f'step {r["first_step_s"]:.2f} s, first solve of {r["frames"]} frames '
          f'{r["first_solve_s"]:.2f} s, traced {r["traces"]}x')
  if _JSON.value:
    Path(_JSON.value).write_text(json.dumps(rows, indent=1))


if __name__ == '__main__':
  run_main(main)
