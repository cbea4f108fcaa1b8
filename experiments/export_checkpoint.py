"""Ship a trained run: copy its best checkpoint (parameters only) under checkpoints/ with a card.

  python -m experiments.export_checkpoint --run=runs/b1_base --output=checkpoints/ikgat_base \
      [--test_json=outputs/eval/test_ikgat.json]

The checkpoint keeps its own meta (config, rig with template offsets, training command, val
metrics, provenance, format version), so loading it needs nothing from ../shared. The card
(README.md beside it) records the training command, the test metrics when given, and the CMU
acknowledgment.
"""

import json
import os
from pathlib import Path
import re
import shutil
import tempfile

from absl import app, flags

from experiments.common import fail_on_user_error
from ik_gat_jax import checkpointing

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


def card(meta: dict, test: dict | None, size_bytes: int) -> str:
  m = meta['metrics']
  lines = [f"# {Path(_OUT.value).name}", '',
           f"Task: {meta['task']}; rig: {meta['rig']['name']} ({len(meta['rig']['joint_names'])} "
           f"joints); trained steps: {meta['step']}; size on disk: {size_bytes / 1e6:.1f} MB "
           '(parameters only, no optimizer state); checkpoint format version '
           f"{meta['format_version']}.", '',
           f"Training command: `{_as_module(meta['command'])}`", '',
           f"Data: shards {meta['data'].get('data_dir')} (rig sha256 "
           f"{meta['data'].get('rig_sha256')}, split sha256 {meta['data'].get('split_sha256')}).",
           f"Code: git {meta['provenance']['git_commit']}, JAX {meta['provenance']['jax_version']},"
           f" Flax {meta['provenance']['flax_version']}, {meta['provenance']['cpu_model']}.", '',
           '## Validation metrics (best checkpoint)', '',
           '| field | value |', '|---|---:|']
  lines += [f'| {k} | {v:.3f} |' for k, v in sorted(m.items()) if isinstance(v, float)]
  if test:
    lines += ['', '## Test split', '', f"Command: `{test.get('command', '')}`", '',
              '| part | frames | local (deg) | root (deg) | twist (deg) | swing (deg) | MPJPE (mm) |',
              '|---|---:|---:|---:|---:|---:|---:|']
    for part, r in [('all', test)] + list(test.get('per_part', {}).items()):
      lines.append(f"| {part} | {r['frames']} | {r['local_rot_err_deg']:.2f} | "
                   f"{r['root_rot_err_deg']:.2f} | {r['twist_err_deg']:.2f} | "
                   f"{r['swing_err_deg']:.2f} | {r['mpjpe_mm']:.2f} |")
  lines += ['', '## Acknowledgment', '', ACK, '']
  return '\n'.join(lines)


@fail_on_user_error
def main(argv):
  del argv
  src = Path(_RUN.value) / 'checkpoints' / 'best'
  ckpt = checkpointing.Checkpointer(src, create=False)
  meta = ckpt.restore_meta()
  if meta.get('task') != _TASK.value:
    raise ValueError(f'{src} holds a {meta.get("task")!r} run, not {_TASK.value!r}')
  test = json.loads(Path(_TEST.value).read_text()) if _TEST.value else None
  out = Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f'.{out.name}.'))
  step = ckpt.latest_step()
  shutil.copytree(src / str(step), tmp / str(step))
  size = sum(f.stat().st_size for f in tmp.rglob('*') if f.is_file())
  (tmp / 'README.md').write_text(card({**meta, 'step': step}, test, size))
  if _REPORT.value:
    report = json.loads(Path(_REPORT.value).read_text())
    shutil.copy(_REPORT.value, tmp / Path(_REPORT.value).name)
    scalars = {k: v for k, v in report.items() if isinstance(v, (int, float))}
    with open(tmp / 'README.md', 'a') as f:
      f.write(f'## Report ({Path(_REPORT.value).name})\n\n| field | value |\n|---|---:|\n')
      f.writelines(f'| {k} | {v:.3f} |\n' if isinstance(v, float) else f'| {k} | {v} |\n'
                   for k, v in scalars.items())
  if test:
    (tmp / 'test_metrics.json').write_text(json.dumps(
        {k: v for k, v in test.items() if k not in ('per_joint', 'per_file')}, indent=1))
  if out.exists():
    shutil.rmtree(out)
  os.replace(tmp, out)
  print(f'wrote {out} (step {step}, {size / 1e6:.1f} MB)')


if __name__ == '__main__':
  # Marked here, not at import: importing a main (tests do) must not make its flags
  # required for every other absl program in the same process.
  flags.mark_flags_as_required(['run', 'output'])
  app.run(main)
