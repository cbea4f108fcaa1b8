"""Ship a trained run: copy its best checkpoint (parameters only) under checkpoints/ with a card.

  python -m experiments.export_checkpoint --run=runs/b1_base --output=checkpoints/ikgat_base \
      [--test_json=outputs/eval/test_ikgat.json]

The checkpoint keeps its own meta (config, rig with template offsets, training command, val
metrics, provenance, format version), so loading it needs nothing from ../shared. The card
(README.md beside it) records the checkpoint's step and the steps the run trained ("checkpoint:
step 9500 (best val) of 10000 trained"), the training command, the test metrics when given, and
the CMU acknowledgment. `export_run` is the same as a library call (experiments.train_rig uses it).
"""

import json
import os
from pathlib import Path
import re
import shutil
import tempfile

from absl import flags

from experiments.common import fail_on_user_error, run_main
from ik_gat_jax import checkpointing

_RUN = _OUT = _TEST = _REPORT = _TASK = None  # flag holders, set by define_flags()


def define_flags() -> None:
  """The main's flags, defined only when it runs (`export_run` imports without claiming
  --output, --run, ... in another program's process, e.g. ik_gat_jax.solve's in a test run)."""
  global _RUN, _OUT, _TEST, _REPORT, _TASK
  _RUN = flags.DEFINE_string('run', None, 'Run directory (with checkpoints/best).')
  _OUT = flags.DEFINE_string('output', None, 'Destination, e.g. checkpoints/ikgat_base.')
  _TEST = flags.DEFINE_string('test_json', None, 'experiments.evaluate output on the test split.')
  _REPORT = flags.DEFINE_string('report_json', None, 'A report to ship beside it (e.g. the '
                                "prior's prior_report.json); its scalar fields go in the card.")
  _TASK = flags.DEFINE_enum('task', 'ikgat', ['ikgat', 'pose_prior'], 'What the run trained.')


ACK = ('The data used in this project was obtained from mocap.cs.cmu.edu. The database was '
       'created with funding from NSF EIA-0196217.')


def _as_module(command: str) -> str:
  """`/path/to/experiments/train.py --x` (as older runs recorded it) -> `python -m ...`."""
  return re.sub(r'^\S*/(experiments|data_prep)/(\w+)\.py', r'python -m \1.\2', command)


def checkpoint_steps(step: int, trained: int | None, validated: bool) -> str:
  """The card's 'checkpoint: step 40 (best val) of 60 trained': the exported checkpoint's
  `step`, which the best validation chose (`validated`) or the last (a run without a val
  split), and the steps the run trained (`trained`; None: unknown, left out)."""
  which = 'best val' if validated else 'not validated'
  return f'checkpoint: step {step} ({which})' + (f' of {trained} trained' if trained else '')


def trained_steps(run: str | os.PathLike) -> int | None:
  """The steps `run` trained: its latest checkpoint's step, else run.json's; None without
  either (a bare checkpoint directory)."""
  latest, run_json = Path(run) / 'checkpoints' / 'latest', Path(run) / 'run.json'
  step = (checkpointing.Checkpointer(latest, create=False).latest_step() if latest.is_dir()
          else None)
  if step is None and run_json.is_file():
    step = json.loads(run_json.read_text()).get('step')
  return step if isinstance(step, int) else None


def _training_commands(meta: dict) -> list[str]:
  """The card's training command, or the commands of a run extended by another (its `history`:
  each from the step it started at; the last alone does not reproduce the checkpoint)."""
  history = meta.get('history') or []
  if len(history) < 2:
    return [f"Training command: `{_as_module(meta['command'])}`"]
  lines = [f"Training command: `{_as_module(meta['command'])}`, the last of these in turn (the "
           'run extended, each from the step it started at; the last alone does not reproduce '
           'it: its learning rate decayed over the first steps count):', '']
  for h in history:
    lines.append(f"- steps {h.get('from_step')}-{h.get('steps')}: "
                 f"`{_as_module(h.get('command') or '')}`")
  return lines


def card(meta: dict, test: dict | None, size_bytes: int, name: str,
         acknowledgment: str | None = ACK, test_heading: str = 'Test split',
         extra: str = '', trained: int | None = None) -> str:
  """The README card of the checkpoint of `meta` (its step: `meta['step']`) from a run that
  trained `trained` steps (None: unknown); `extra` (markdown) goes before the acknowledgment
  (None: no such section)."""
  m = meta['metrics']
  lines = [f"# {name}", '',
           f"Task: {meta['task']}; rig: {meta['rig']['name']} ({len(meta['rig']['joint_names'])} "
           f"joints); {checkpoint_steps(meta['step'], trained, bool(m))}; "
           f"size on disk: {size_bytes / 1e6:.1f} MB "
           '(parameters only, no optimizer state); checkpoint format version '
           f"{meta['format_version']}.", '',
           *_training_commands(meta), '',
           f"Data: shards {meta['data'].get('data_dir')} (rig sha256 "
           f"{meta['data'].get('rig_sha256')}, split sha256 {meta['data'].get('split_sha256')}).",
           f"Code: git {meta['provenance']['git_commit']}, JAX {meta['provenance']['jax_version']},"
           f" Flax {meta['provenance']['flax_version']}, {meta['provenance']['cpu_model']}.", '',
           '## Validation metrics (best checkpoint)', '']
  rows = [f'| {k} | {v:.3f} |' for k, v in sorted(m.items()) if isinstance(v, float)]
  lines += (['| field | value |', '|---|---:|'] + rows if rows else
            ['None: the run had no validation split (its last checkpoint is the one here).'])
  if test:
    lines += ['', f'## {test_heading}', '', f"Command: `{test.get('command', '')}`", '',
              '| part | frames | local (deg) | root (deg) | twist (deg) | swing (deg) | MPJPE (mm) |',
              '|---|---:|---:|---:|---:|---:|---:|']
    for part, r in [('all', test)] + list(test.get('per_part', {}).items()):
      lines.append(f"| {part} | {r['frames']} | {r['local_rot_err_deg']:.2f} | "
                   f"{r['root_rot_err_deg']:.2f} | {r['twist_err_deg']:.2f} | "
                   f"{r['swing_err_deg']:.2f} | {r['mpjpe_mm']:.2f} |")
  if extra:
    lines += ['', extra.strip()]
  if acknowledgment:
    lines += ['', '## Acknowledgment', '', acknowledgment]
  return '\n'.join(lines + [''])


def check_replaceable(output: str | os.PathLike) -> None:
  """Refuses an `output` that exists and is not an earlier export (a card README.md with its
  training command, one step directory, JSON reports): it is replaced whole, so a data or
  run folder given by mistake would be lost."""
  out = Path(output)
  if not out.exists():
    return
  if not out.is_dir():
    raise ValueError(f'output {out} exists and is a file, not a checkpoint export')
  entries = sorted(out.iterdir())
  steps = [e for e in entries if e.is_dir() and e.name.isdigit()]
  other = [e.name for e in entries if e not in steps and not (
      e.is_file() and (e.name == 'README.md' or e.suffix == '.json'))]
  readme = out / 'README.md'
  card_text = readme.read_text(errors='replace') if readme.is_file() else ''
  if other or len(steps) > 1 or 'Training command:' not in card_text:
    listed = ', '.join(other[:4] or [e.name for e in entries[:4]]) or 'nothing'
    raise ValueError(f'output {out} exists and is not a checkpoint export (it holds {listed}'
                     f'{" ..." if len(other) > 4 else ""}), so it is not replaced: give a new '
                     'folder or an earlier export')


def _default_mode() -> int:
  """The permissions a new folder gets under this process's umask (mkdtemp gives 0700)."""
  mask = os.umask(0)
  os.umask(mask)
  return 0o777 & ~mask


def export_run(run: str | os.PathLike, output: str | os.PathLike, *, task: str = 'ikgat',
               test: dict | None = None, report_json: str | os.PathLike | None = None,
               acknowledgment: str | None = ACK, test_heading: str = 'Test split',
               extra: str = '') -> dict:
  """Copies `run`'s best checkpoint (parameters only) to `output` with its card (README.md),
  `test_metrics.json` (from `test`, an evaluation result) and `report_json`; the whole directory
  is written beside `output` and renamed into place, replacing an earlier export there
  (anything else is refused: `check_replaceable`). Returns {'output', 'step', 'size_bytes'}."""
  check_replaceable(output)
  src = Path(run) / 'checkpoints' / 'best'
  ckpt = checkpointing.Checkpointer(src, create=False)
  meta = ckpt.restore_meta()
  if meta.get('task') != task:
    raise ValueError(f'{src} holds a {meta.get("task")!r} run, not {task!r}')
  out = Path(output)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f'.{out.name}.'))
  try:
    step = ckpt.latest_step()
    shutil.copytree(src / str(step), tmp / str(step))
    size = sum(f.stat().st_size for f in tmp.rglob('*') if f.is_file())
    (tmp / 'README.md').write_text(card({**meta, 'step': step}, test, size, name=out.name,
                                        acknowledgment=acknowledgment,
                                        test_heading=test_heading, extra=extra,
                                        trained=trained_steps(run)))
    if report_json:
      report = json.loads(Path(report_json).read_text())
      shutil.copy(report_json, tmp / Path(report_json).name)
      scalars = {k: v for k, v in report.items() if isinstance(v, (int, float))}
      with open(tmp / 'README.md', 'a') as f:
        f.write(f'## Report ({Path(report_json).name})\n\n| field | value |\n|---|---:|\n')
        f.writelines(f'| {k} | {v:.3f} |\n' if isinstance(v, float) else f'| {k} | {v} |\n'
                     for k, v in scalars.items())
    if test:
      (tmp / 'test_metrics.json').write_text(json.dumps(
          {k: v for k, v in test.items() if k not in ('per_joint', 'per_file')}, indent=1))
    tmp.chmod(_default_mode())
    check_replaceable(out)  # again: it may have appeared while the export was written
    if out.exists():
      shutil.rmtree(out)
    os.replace(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return {'output': str(out), 'step': step, 'size_bytes': size}


_TEST_FIELDS = ('frames', 'local_rot_err_deg', 'root_rot_err_deg', 'twist_err_deg',
                'swing_err_deg', 'mpjpe_mm')


def read_test_json(path: str | os.PathLike, run: str | os.PathLike, task: str) -> dict:
  """`experiments.evaluate`'s result at `path`, refused (ValueError, one line) unless it is
  what the card calls the test split: this run's `task` method (`settings.checkpoint` this run
  or its best checkpoint, where recorded) on the test split, with the card's fields."""
  try:
    test = json.loads(Path(path).read_text())
  except ValueError as e:
    raise ValueError(f'--test_json {path} is not JSON ({e})') from None
  missing = [k for k in _TEST_FIELDS if not isinstance(test, dict) or k not in test]
  if missing:
    raise ValueError(f'--test_json {path} lacks {", ".join(missing)}: give experiments.evaluate\'s '
                     '--output_json of this run on the test split')
  method, split = test.get('method'), test.get('split')
  ckpt = (test.get('settings') or {}).get('checkpoint')
  ours = {Path(run).resolve(), (Path(run) / 'checkpoints' / 'best').resolve()}
  if method != task or split != 'test' or (ckpt and Path(ckpt).resolve() not in ours):
    raise ValueError(f'--test_json {path} holds {method!r} on the {split} split'
                     f'{" of " + str(ckpt) if ckpt else ""}, and the card calls it this run\'s '
                     f'{task} on the test split: evaluate this run with --split=test')
  measured = (test.get('settings') or {}).get('trained_steps')
  best = Path(run) / 'checkpoints' / 'best'
  now = (checkpointing.Checkpointer(best, create=False).latest_step() if best.is_dir()
         else None)
  if isinstance(measured, int) and now is not None and measured != now:  # trained on since
    raise ValueError(f'--test_json {path} measured the checkpoint of step {measured}, and the '
                     f'run\'s best is now step {now}: evaluate this run on the test split again')
  return test


@fail_on_user_error
def main(argv):
  del argv
  test = read_test_json(_TEST.value, _RUN.value, _TASK.value) if _TEST.value else None
  done = export_run(_RUN.value, _OUT.value, task=_TASK.value, test=test,
                    report_json=_REPORT.value)
  print(f"wrote {done['output']} (step {done['step']}, {done['size_bytes'] / 1e6:.1f} MB)")


if __name__ == '__main__':
  # Marked here, not at import: importing a main (tests do) must not make its flags
  # required for every other absl program in the same process.
  run_main(main, define_flags, required=['run', 'output'])
