r"""AMASS + your own SMPL-family body model (.npz) -> smpl22 training shards (DESIGN 3, 7, 9).

    python -m data_prep.amass_to_shards --input=AMASS_ROOT_OR_NPZ --body_model=MODEL.npz \
        --output=DIR [--body_model_female=F.npz --body_model_male=M.npz] \
        [--split=auto|train|val|test|all] [--fps=30] [--num_betas=10] [--split_file=FILE] \
        [--on_error=skip]

Example (AMASS SMPL+H G download unpacked under ~/amass: ~/amass/CMU/01/01_01_poses.npz, ...;
the SMPL+H models from the MANO site under ~/smplh):

    python -m data_prep.amass_to_shards --input=~/amass --body_model=~/smplh/neutral/model.npz \
        --body_model_female=~/smplh/female/model.npz --body_model_male=~/smplh/male/model.npz \
        --output=/tmp/amass_shards

- `--input` is the AMASS root (the directory holding CMU/, BMLrub/, ...), one sub-dataset or
  subject directory, or one npz; files are named SUBDATASET/SUBJECT/FILE.npz, their subject is
  SUBDATASET/SUBJECT.
- Each file uses the body model of its `gender` when given (--body_model_female/_male), else
  --body_model; rest joints come from the model's J_regressor with the file's first
  --num_betas betas (at most what the file and model have; AMASS SMPL+H fits use 16).
- `--split=auto` splits by sub-dataset with data_prep/splits/amass_default.json (the AMASS
  authors' recommended split: val HumanEva, MPI_HDM05, SFU, MPI_mosh; test Transitions_mocap,
  SSM_synced; train the rest; unknown sub-datasets go to train with a note); `--split=NAME` puts
  every file in split NAME.
- The AMASS world (z up) is rotated -90 degrees about x to the rig's y up; frames are resampled
  to --fps (decimation for integer ratios, else slerp). Files without poses (shape.npz) are
  skipped. Every file is verified (FK vs the raw SMPL chain, limit 1e-5 m).
Running again with the same --output adds new files. Progress per file goes to stderr; bad input
exits 2 with a one-line reason (`error: ...`) and leaves --output as it was. Library:
data_prep/amass.py.
"""

import os
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # host-side float64 work; keep accelerators free

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from data_prep import amass  # noqa: E402
from data_prep import conversion  # noqa: E402
from ik_gat_jax.absl_main import fail, run_main, terminate_as_interrupt  # noqa: E402
from ik_gat_jax.errors import ConversionError  # noqa: E402

_INPUT = flags.DEFINE_string('input', None, 'AMASS root, a sub-dataset/subject directory, or '
                             'one AMASS .npz file.')
_BODY_MODEL = flags.DEFINE_string('body_model', None, 'Body model .npz (neutral, or the one for '
                                  'every file whose gender has no model of its own).')
_FEMALE = flags.DEFINE_string('body_model_female', None, 'Body model .npz for gender=female.')
_MALE = flags.DEFINE_string('body_model_male', None, 'Body model .npz for gender=male.')
_OUTPUT = flags.DEFINE_string('output', None, 'Shard directory to create or add to.')
_SPLIT = flags.DEFINE_enum('split', 'auto', ['auto', *conversion.SPLIT_NAMES],
                           'auto: by AMASS sub-dataset (--split_file); else every file there.')
_FPS = flags.DEFINE_float('fps', 30.0, 'Output frame rate.')
_NUM_BETAS = flags.DEFINE_integer('num_betas', 10, 'Shape coefficients used (at most the file\'s '
                                  'and the model\'s).')
_SPLIT_FILE = flags.DEFINE_string('split_file', None, 'Sub-dataset split JSON for --split=auto '
                                  '(default data_prep/splits/amass_default.json).')
_ON_ERROR = flags.DEFINE_enum('on_error', 'fail', ['fail', 'skip'],
                              'What a refused file does to the run.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  missing = [f'--{f.name}' for f in (_INPUT, _OUTPUT) if not f.value]
  if missing:
    fail(f'{", ".join(missing)} required')
  expand = lambda p: os.path.expanduser(p) if p else p  # noqa: E731
  try:
    with terminate_as_interrupt():
      summary = amass.convert(
          expand(_INPUT.value), expand(_BODY_MODEL.value), expand(_OUTPUT.value),
          body_model_female=expand(_FEMALE.value), body_model_male=expand(_MALE.value),
          split=_SPLIT.value, fps=_FPS.value, num_betas=_NUM_BETAS.value,
          split_file=expand(_SPLIT_FILE.value), on_error=_ON_ERROR.value)
  except (ConversionError, OSError) as e:
    fail(str(e))
  except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the new folder is removed, not swapped in
    print(f'interrupted: {_OUTPUT.value} is as it was; rerun the same command to convert',
          file=sys.stderr)
    sys.exit(130)
  run = summary['runs'][-1]
  gap = run.get('lbs_joint_gap_max_m')
  conversion.log_stderr(
      f'wrote {_OUTPUT.value}: rig {summary["rig"]}, {summary["fps"]:g} fps, files '
      f'{summary["files"]}, frames {summary["frames"]}, FK max error '
      f'{summary["fk_max_error_m"]:.2e} m' + ('' if gap is None else f', LBS joint gap {gap:.2e} m')
      + f', {run["seconds"]:.1f} s')


if __name__ == '__main__':
  run_main(main)
