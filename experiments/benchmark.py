"""The benchmark: amortized IK-GAT against iterative IK, accuracy and speed side by side.

  python -m experiments.benchmark --output_dir=DIR [--checkpoints=DIR] [--prior=DIR] \
      [--data=DIR] [--split=test] [--quick|--smoke] [--max_frames=N] [--iters=N] [--nobf16] \
      [--refine_iters=N,M] [--[no]mirror]
  python -m experiments.benchmark --replot_tables=DIR/tables.md --output_dir=DIR

Runs `experiments.benchmark_suite.run_suite` (its docstring lists the sections and what --smoke,
--quick and the full default run) and writes DIR/benchmark.json, DIR/tables.md and PNG plots.
--checkpoints holds IK-GAT runs or checkpoint directories (every size found is a point) and
optionally a pose prior; missing ones fall back to the shipped checkpoints/, else those methods
are skipped with a printed reason. --data defaults to the shard directory the checkpoints were
trained on. --max_frames sets the frames every method runs on (iterative ones included; default
64 with --smoke, 256 with --quick, 1024 otherwise; 0: the whole split); --iters the iterative
budget of the accuracy, noise and speed rows (10 with --smoke, else 100); --refine_iters adds
IK-GAT + refinement rows (and + the prior's refinement at the largest budget); --mirror (default
on, off with --smoke) IK-GAT with mirror averaging, alone and before the prior's refinement.
A refused command (e.g. --max_frames=-4, --iters=0, a missing split) leaves no --output_dir
behind. --replot_tables draws a run's Pareto and noise plots again from its tables.md (their
numbers to the tables' rounding), with the current plotting code. Run it on a quiet machine:
every other process skews the timings. Expected time on the 2-core CPU: --smoke 1-2 minutes
(80 s in session 41's suite), --quick a few minutes, full 35-55 minutes.
"""

import sys

from absl import flags

from experiments import benchmark_suite as benchmark
from experiments.common import fail_on_user_error, no_empty_folder_left, run_main

_OUTPUT = flags.DEFINE_string('output_dir', None, 'Where benchmark.json, tables.md, PNGs go.')
_REPLOT = flags.DEFINE_string('replot_tables', None, 'Run nothing: draw pareto.png and noise.png '
                              'again from this tables.md of an earlier run, into --output_dir.')
_CHECKPOINTS = flags.DEFINE_string('checkpoints', None,
                                   'Directory of IK-GAT (and prior) runs or checkpoints.')
_PRIOR = flags.DEFINE_string('prior', None, 'Pose-prior run or checkpoint (overrides the found).')
_DATA = flags.DEFINE_string('data', None, 'Shard directory (default: the checkpoints\' data).')
_SPLIT = flags.DEFINE_string('split', 'test', 'Split to benchmark on.')
_QUICK = flags.DEFINE_boolean('quick', False, 'Fewer frames, budgets, batch sizes: minutes.')
_SMOKE = flags.DEFINE_boolean('smoke', False, 'Tiny everything: 1-2 minutes (CI).')
_MAX_FRAMES = flags.DEFINE_integer(
    'max_frames', None, 'Frames every method runs on (default 64/256/1024 for smoke/quick/full; '
    '0: the whole split).')
_ITERS = flags.DEFINE_integer('iters', None, 'Default iterative budget (per frame).')
_BF16 = flags.DEFINE_boolean('bf16', True, 'Also run IK-GAT in bfloat16: the whole network, and '
                            'only its large products (+bf16_products rows).')
_SEED = flags.DEFINE_integer('seed', None, 'Noise seed.')
_MIRROR = flags.DEFINE_boolean('mirror', None, 'Also IK-GAT with mirror averaging (+mirror rows; '
                               'default: on, off in --smoke).')
_REFINE = flags.DEFINE_list('refine_iters', [], 'Also IK-GAT + N refinement iterations '
                            '(amortized + refine), e.g. 20,50.')


def _refine_iters(values: list[str]) -> tuple[int, ...]:
  """`--refine_iters` as positive ints; a one-line ValueError otherwise."""
  try:
    iters = tuple(int(v) for v in values)
  except ValueError:
    iters = ()
  if len(iters) != len(values) or any(n < 1 for n in iters):
    raise ValueError(f'--refine_iters must be positive numbers of iterations, got '
                     f'{",".join(values)}')
  return iters


@fail_on_user_error
def main(argv):
  del argv
  if _REPLOT.value is not None:
    for path in benchmark.replot_from_tables(_REPLOT.value, _OUTPUT.value):
      print(f'wrote {path}')
    return
  if _QUICK.value and _SMOKE.value:
    raise ValueError('pass at most one of --quick and --smoke')
  # Refused before --output_dir is made (a refusal found later removes it again if empty).
  if _MAX_FRAMES.value is not None and _MAX_FRAMES.value < 0:
    raise ValueError(f'--max_frames must be a number of frames >= 0 (0: the whole split), got '
                     f'{_MAX_FRAMES.value}')
  if _ITERS.value is not None and _ITERS.value < 1:
    raise ValueError(f'--iters must be a positive number of iterations, got {_ITERS.value}')
  mode = 'smoke' if _SMOKE.value else 'quick' if _QUICK.value else 'full'
  config = benchmark.preset(mode, split=_SPLIT.value, max_frames=_MAX_FRAMES.value,
                            iters=_ITERS.value, bf16=_BF16.value, seed=_SEED.value,
                            refine_iters=_refine_iters(_REFINE.value) or None,
                            mirror=_MIRROR.value)
  found = benchmark.resolve_checkpoints(_CHECKPOINTS.value, _PRIOR.value)
  data = _DATA.value or benchmark.default_data_dir(found)
  if data is None:
    raise FileNotFoundError('no shard directory: pass --data=DIR (no checkpoint names one that '
                            'exists)')
  command = ' '.join(['python -m experiments.benchmark', *sys.argv[1:]])
  with no_empty_folder_left(_OUTPUT.value):
    benchmark.run_suite(data, _OUTPUT.value, config, found, command=command)


if __name__ == '__main__':
  # Marked here, not at import: importing a main (tests do) must not make its flags
  # required for every other absl program in the same process.
  run_main(main, required=['output_dir'])
