"""Train IK-GAT (DESIGN section 9).

  python -m experiments.train --data=DIR --workdir=DIR [--steps=N] [--size=tiny|small|base|large]
      [--config=experiments/configs/default.py] [--config.train.lr=3e-4 ...]
      [--distributed | --nodistributed] [--distributed_timeout=SECONDS]

Rerunning with the same --workdir resumes from its latest checkpoint (on any number of devices);
a finished run says so and exits 0, a higher --steps trains further, a lower one than it was
trained to is refused, and so is other data or another config (one line naming the keys; only
--steps, the log, eval and checkpoint intervals, prefetch, eval batch size and ema_decay may
change: ik_gat_jax.train.RESUME_MAY_CHANGE), the run left as it was. A higher --steps
stretches the cosine learning-rate schedule over the new count, so the rate jumps back up where
the run resumes (the default config: a finished 5,000-step run ends at lr 2e-5; rerun with
--steps=10000 it resumes at 1.06e-3). To fine-tune a finished run at a low rate instead, start a
new --workdir from it: --config.train.init_from=OLD_WORKDIR --config.train.lr=1e-4
--config.train.warmup_steps=0 --steps=N. A mistyped --config.* key is refused in one line.
--config defaults to this package's configs/default.py, from any working directory.
Training uses every device it sees (the batch split over them, DESIGN section 8). On several
hosts run the same command on each: --distributed starts `jax.distributed` (by default it starts
when a launcher's environment is present: JAX_COORDINATOR_ADDRESS with JAX_NUM_PROCESSES and
JAX_PROCESS_ID, SLURM or Open MPI with several tasks, a multi-host Cloud TPU); a cluster that
does not form within --distributed_timeout seconds is one line and exit status 2.
"""

from pathlib import Path
import sys

from absl import flags
from ml_collections import config_flags

from experiments.common import fail_on_user_error, run_main
from ik_gat_jax import train

CONFIG_DIR = Path(__file__).resolve().parent / 'configs'
_CONFIG = _DATA = _WORKDIR = _STEPS = _SIZE = _DISTRIBUTED = _TIMEOUT = None  # define_flags()


def define_flags() -> None:
  """The main's flags, defined only when it runs (importing it claims no --data, --config ...);
  the default config file parses its --config.* overrides here."""
  global _CONFIG, _DATA, _WORKDIR, _STEPS, _SIZE, _DISTRIBUTED, _TIMEOUT
  _CONFIG = config_flags.DEFINE_config_file('config', str(CONFIG_DIR / 'default.py'),
                                            'Training config file.', lock_config=False)
  _DATA = flags.DEFINE_string('data', None, 'Shard directory (from data_prep.bvh_to_shards).')
  _WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory; an existing one is resumed.')
  _STEPS = flags.DEFINE_integer(
      'steps', None, 'Training steps (overrides the config). A higher one resumes a run with '
      'the cosine learning-rate schedule stretched over it: the rate jumps back up (a low-rate '
      'fine-tune: a new --workdir with --config.train.init_from=OLD_WORKDIR and a low lr).')
  _SIZE = flags.DEFINE_enum('size', None, ['tiny', 'small', 'base', 'large'], 'Model size.')
  _DISTRIBUTED = flags.DEFINE_bool(
      'distributed', None, 'Start jax.distributed (several hosts); unset: only when a cluster '
      "launcher's environment is present.")
  _TIMEOUT = flags.DEFINE_integer(
      'distributed_timeout', train.DISTRIBUTED_TIMEOUT_S, 'Seconds to wait for every process '
      'to join the coordinator (jax.distributed), then exit 2 in one line.')


@fail_on_user_error
def main(argv):
  del argv
  if _STEPS.value is not None and _STEPS.value < 1:
    raise ValueError(f'--steps must be a positive number of steps, got {_STEPS.value}')
  train.initialize_distributed({None: 'auto', True: 'on', False: 'off'}[_DISTRIBUTED.value],
                               timeout_s=_TIMEOUT.value)
  config = _CONFIG.value
  config.data = _DATA.value
  if _STEPS.value is not None:
    config.train.steps = _STEPS.value
  if _SIZE.value is not None:
    config.model.size = _SIZE.value
  train.check_train_config(config.train, '--config.train')
  try:
    train.train_and_evaluate(config, _WORKDIR.value)
  except KeyboardInterrupt:
    sys.exit(130)


if __name__ == '__main__':
  # Marked here, not at import: importing a main (tests do) must not make its flags
  # required for every other absl program in the same process.
  run_main(main, define_flags, required=['data', 'workdir'])
