"""Train the VPoser-style pose prior with the shared trainer (DESIGN section 9).

  python -m experiments.train_prior --data=DIR --workdir=DIR [--steps=N]
      [--config=experiments/configs/prior.py] [--config.model.kl_weight=...]

Rerunning with the same --workdir resumes (another config or other data is refused in one
line, as in experiments.train). At the end it reports val reconstruction (deg, mm),
active latent dimensions and sample realism, printed and in WORKDIR/prior_report.json. A
finished run with its report says so and exits 0; a lower --steps than it was trained to is
refused, and a higher one resumes with the cosine learning-rate schedule stretched over it (the
rate jumps back up: experiments.train). --config defaults to this package's configs/prior.py,
from any working directory.
"""

from pathlib import Path
import json
import sys

from absl import flags
from ml_collections import config_flags

from experiments.common import fail_on_user_error, run_main
from ik_gat_jax import data, inference, prior_task, train, vposer
from ik_gat_jax.io import atomic

CONFIG_DIR = Path(__file__).resolve().parent / 'configs'
_CONFIG = _DATA = _WORKDIR = _STEPS = None  # set by define_flags()


def define_flags() -> None:
  """The main's flags, defined only when it runs (importing it claims no --data, --config ...);
  the default config file parses its --config.* overrides here."""
  global _CONFIG, _DATA, _WORKDIR, _STEPS
  _CONFIG = config_flags.DEFINE_config_file('config', str(CONFIG_DIR / 'prior.py'),
                                            'Prior config file.', lock_config=False)
  _DATA = flags.DEFINE_string('data', None, 'Shard directory.')
  _WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory; an existing one is resumed.')
  _STEPS = flags.DEFINE_integer('steps', None, 'Training steps (overrides the config).')


def report_split(data_dir: str, train_data: data.Dataset) -> data.Dataset:
  """The split the report measures reconstruction on: val, or `train_data` when there is no
  val split or it has no frames (the trainer then trains without validation)."""
  if 'val' in data.available_splits(data_dir):
    val = data.load_shards(data_dir, 'val')
    if len(val):
      return val
  return train_data


@fail_on_user_error
def main(argv):
  del argv
  if _STEPS.value is not None and _STEPS.value < 1:
    raise ValueError(f'--steps must be a positive number of steps, got {_STEPS.value}')
  config = _CONFIG.value
  config.data = _DATA.value
  if _STEPS.value is not None:
    config.train.steps = _STEPS.value
  train.check_train_config(config.train, '--config.train')
  report_path = Path(_WORKDIR.value) / 'prior_report.json'
  finished = train.finished_run(_WORKDIR.value, int(config.train.steps)) is not None
  train_data = data.load_shards(config.data, 'train')
  if not config.prior_stats:  # in the prior's chart (VAEConfig.bone_chart)
    config.prior_stats = prior_task.standardization_config(
        train_data, vposer.VAEConfig.from_dict(config.model).bone_chart)
  try:
    train.train_and_evaluate(config, _WORKDIR.value, task=prior_task.PRIOR_TASK)
  except KeyboardInterrupt:
    sys.exit(130)
  if finished and _readable(report_path):  # trained before, report written: nothing to redo
    return
  model, meta = inference.load_model(_WORKDIR.value, task=prior_task.PRIOR_TASK)
  measured = report_split(config.data, train_data)
  report = prior_task.evaluate_prior(model, train_data, measured, train_data.rig, config)
  # Without a val split the report measures the training poses: it says so (the JSON keys keep
  # their names, `reconstruction_split` says which).
  report['reconstruction_split'] = split = 'train' if measured is train_data else 'val'
  r = report['val_reconstruction']
  print(f"prior: {split} reconstruction {r['local_rot_err_deg']:.2f} deg, {r['mpjpe_mm']:.1f} "
        f"mm{' (no val split: the training poses)' if split == 'train' else ''}; active latent "
        f"dims {report['active_dims']}/{report['latent']}; nearest training pose from 1000 "
        f"samples {report['sample_to_nearest_train_deg']:.2f} deg vs from {split} poses "
        f"{report['val_to_nearest_train_deg']:.2f} deg")
  atomic.write_json(report_path, report)


def _readable(path: Path) -> bool:
  """Whether the report at `path` is there and JSON (a damaged one is written again)."""
  try:
    json.loads(path.read_text())
    return True
  except (OSError, ValueError):
    return False


if __name__ == '__main__':
  # Marked here, not at import: importing a main (tests do) must not make its flags
  # required for every other absl program in the same process.
  run_main(main, define_flags, required=['data', 'workdir'])
