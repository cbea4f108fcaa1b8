"""Export the raw parameters (or the moving average) of a run's latest checkpoint as a model.

  python -m experiments.export_latest --run=runs/X --output=runs/X_raw [--part=params|ema]

A run trained with `train.ema_decay` validates and saves the parameters' moving average as its
`best`; `--part=params` writes the raw parameters of its last saved step instead, so the two can
be evaluated side by side (`experiments.evaluate --checkpoint=runs/X_raw`).
"""

from absl import flags

from experiments.common import fail_on_user_error, run_main
from ik_gat_jax import train

_RUN = flags.DEFINE_string('run', None, 'Run directory (its checkpoints/latest is read).')
_OUTPUT = flags.DEFINE_string('output', None, 'Checkpoint directory to write.')
_PART = flags.DEFINE_enum('part', 'params', ['params', 'ema'], 'What to export.')


@fail_on_user_error
def main(argv):
  del argv
  step = train.export_latest(_RUN.value, _OUTPUT.value, _PART.value)
  print(f'wrote {_OUTPUT.value}: {_PART.value} of {_RUN.value} at step {step}')


if __name__ == '__main__':
  flags.mark_flags_as_required(['run', 'output'])
  run_main(main)
