"""Ablation tables of issue E: train every variant at one step budget, then evaluate them.

  python -m experiments.ablations --data=/tmp/cmu --mode=train    # resumable queue of runs
  python -m experiments.ablations --data=/tmp/cmu --mode=report   # test-split tables (quiet CPU)

Every row is the default recipe (experiments/configs/default.py: mixed output space, both-way
tree adjacency, GAT attention, alpha 0.1, yaw + mirror + bone-length augmentation) at size
small, trained for `--steps` steps of batch 256 (lr 2e-3, warm-up 200), with one thing changed.
The baseline runs with three seeds, a few rows with two; the pooled spread of those is the seed
noise each table marks differences against. Rows are trained one after another by `python -m experiments.train` (so each row's
command is a plain training command, recorded in `<root>/manifest.json` with its status); rerun
the same command after an interruption and finished rows are skipped, a stopped row resumes from
its last checkpoint. `--mode=report` evaluates each finished row's best checkpoint on the whole
test split (`evaluation.evaluate`, the numbers `experiments.evaluate` prints) and times its
forward pass at batch 1024, writing `<root>/results.json` and `<root>/tables.md`
(`results_val.json`, `tables_val.md` with `--split=val`). Time it on an
otherwise idle machine: its frames/s column is a measurement, the error columns are not
affected.

Table 'robust' (issue J): every row trains with the tracker noise model (NOISE_MODEL_ARGS), then
adds the v2 recipe (heading canonicalisation instead of yaw augmentation, observed-direction
head), the observed-direction blend, the noise-level input, the parameters' moving average;
seeds 0 and 1
(`--mode=list --only=robust`). The report gives the rows of CURVE_TABLES (baseline, noise,
robust) the noise curve 0-50 mm (NOISE_LEVELS_MM), over all test frames and the unseen subject,
and every row its unseen-subject error.
"""

import dataclasses
import json
from pathlib import Path
import re
import signal
import subprocess
import sys
import time

from absl import flags
from flax import nnx
import jax
import numpy as np

from experiments.common import fail_on_user_error, run_main
from ik_gat_jax import data as data_lib
from ik_gat_jax import evaluation, inference, input_pipeline, iterative_ik, train
from ik_gat_jax.io import atomic

_DATA = flags.DEFINE_string('data', None, 'Shard directory.')
_ROOT = flags.DEFINE_string('root', 'runs/ablations', 'Directory of the runs and tables.')
_MODE = flags.DEFINE_enum('mode', 'train', ['train', 'report', 'list'], 'What to do.')
_STEPS = flags.DEFINE_integer('steps', 2000, 'Training steps of every row.')
_ONLY = flags.DEFINE_list('only', None, 'Rows to train / report, by row or table name (e.g. '
                          'robust; default: all).')
_SKIP = flags.DEFINE_list('skip', [], 'Rows to leave out of training.')
_SPLIT = flags.DEFINE_string('split', 'test', 'Split the report evaluates.')
_NOISE_SIGMAS = flags.DEFINE_float('noise_sigmas', 2.0, 'Differences from the baseline smaller '
                                   'than this many seed standard deviations are marked noise.')


@dataclasses.dataclass(frozen=True)
class Row:
  table: str
  variant: str  # label in its table
  args: tuple[str, ...] = ()
  seed: int = 0

  @property
  def name(self) -> str:
    slug = re.sub(r'[^a-z0-9]+', '_', self.variant.split(' (')[0].replace('.', 'p').lower())
    return f'{self.table}_{slug.strip("_")}_s{self.seed}'


BASE_ARGS = ('--size=small', '--config.train.lr=2e-3', '--config.train.warmup_steps=200',
             '--config.model.bone_chart=False',  # the recipe every row was trained with
             '--config.train.eval_every=1000', '--config.train.checkpoint_every=500')
BASELINE = 'baseline'


def _m(field, value):
  return f'--config.model.{field}={value}'


# Issue J: the tracker noise model (input_pipeline.tracker_noise) and the 'v2' recipe.
NOISE_MODEL_ARGS = ('--config.augment.noise_mm_max=50.0', '--config.augment.clean_frac=0.2',
                    '--config.augment.bone_jitter=0.02', '--config.augment.outlier_prob=0.05')
V2_ARGS = (_m('heading_canonicalization', True), '--config.augment.yaw=False',
           _m('observed_direction_head', True))
BLEND_ARGS = (_m('observed_direction_blend', True),)
NOISE_LEVEL_ARGS = (_m('noise_level_input', True),)
# Session 9: the parameters' moving average (train.ema_decay; horizon ~200 of the 2,000 steps).
EMA_ARGS = ('--config.train.ema_decay=0.995',)
ROBUST_ROWS = tuple(
    Row('robust', variant, args, seed) for seed in (0, 1) for variant, args in (
        ('noise model', NOISE_MODEL_ARGS),
        ('noise model + v2 (canonical heading, observed-direction head)',
         NOISE_MODEL_ARGS + V2_ARGS),
        ('noise model + v2 + blend (observed-direction blend)',
         NOISE_MODEL_ARGS + V2_ARGS + BLEND_ARGS),
        ('noise model + v2 + blend + noise level (noise-level input)',
         NOISE_MODEL_ARGS + V2_ARGS + BLEND_ARGS + NOISE_LEVEL_ARGS),
        ('noise model + v2 + blend + noise level + EMA (parameter average, decay 0.995)',
         NOISE_MODEL_ARGS + V2_ARGS + BLEND_ARGS + NOISE_LEVEL_ARGS + EMA_ARGS)))


# The baseline appears in every table under the name of its setting there.
ROWS = (
    Row(BASELINE, 'baseline', (), 0),
    Row('output', 'bone_aligned', (_m('output_space', 'bone_aligned'),)),
    Row('output', 'local', (_m('output_space', 'local'),)),
    Row('output', 'global', (_m('output_space', 'global'),)),
    Row('adjacency', 'parent_to_child (one way)', (_m('adjacency', 'parent_to_child'),)),
    Row('adjacency', 'child_to_parent (one way)', (_m('adjacency', 'child_to_parent'),)),
    Row('adjacency', 'full (fully connected)', (_m('adjacency', 'full'),)),
    Row('aggregation', 'mean (no attention)', (_m('aggregation', 'mean'),)),
    Row('alpha', 'alpha=0', ('--config.loss.alpha=0.0',)),
    Row('alpha', 'alpha=0.01', ('--config.loss.alpha=0.01',)),
    Row('alpha', 'alpha=1', ('--config.loss.alpha=1.0',)),
    Row('head', 'observed-direction head', (_m('observed_direction_head', True),)),
    Row('heading', 'canonicalised, no yaw aug', (_m('heading_canonicalization', True),
                                                 '--config.augment.yaw=False')),
    Row('heading', 'neither', ('--config.augment.yaw=False',)),
    Row('arch', 'mlp', (_m('arch', 'mlp'),)),
    Row('arch', 'transformer', (_m('arch', 'transformer'),)),
    Row('noise', 'noise_mm=10 augmentation', ('--config.augment.noise_mm=10.0',)),
    Row(BASELINE, 'baseline', (), 1),
    Row(BASELINE, 'baseline', (), 2),
    Row('size', 'tiny', ('--size=tiny',)),
    Row('size', 'base', ('--size=base',)),
    Row('adjacency', 'parent_to_child (one way)', (_m('adjacency', 'parent_to_child'),), 1),
    Row('adjacency', 'child_to_parent (one way)', (_m('adjacency', 'child_to_parent'),), 1),
    Row('adjacency', 'full (fully connected)', (_m('adjacency', 'full'),), 1),
    Row('aggregation', 'mean (no attention)', (_m('aggregation', 'mean'),), 1),
    Row('head', 'observed-direction head', (_m('observed_direction_head', True),), 1),
    Row('alpha', 'alpha=0', ('--config.loss.alpha=0.0',), 1),
    Row('heading', 'canonicalised, no yaw aug', (_m('heading_canonicalization', True),
                                                 '--config.augment.yaw=False'), 1),
    Row('size', 'large', ('--size=large',)),
    *ROBUST_ROWS,
)
# What the baseline is called in each table.
BASELINE_LABEL = {'output': 'mixed (baseline)', 'adjacency': 'tree, both ways (baseline)',
                  'aggregation': 'attention (baseline)', 'alpha': 'alpha=0.1 (baseline)',
                  'head': 'no extra head (baseline)',
                  'heading': 'yaw augmentation (baseline)', 'arch': 'ikgat (baseline)',
                  'size': 'small (baseline)', 'noise': 'no noise augmentation (baseline)',
                  'robust': 'no noise model (baseline)'}
TABLE_TITLES = {'output': 'Output space', 'adjacency': 'Adjacency',
                'aggregation': 'Attention vs mean aggregation', 'alpha': 'Position-loss weight alpha',
                'head': 'Observed-direction head',
                'heading': 'Heading canonicalisation vs yaw augmentation',
                'arch': 'Architecture (about equal parameters)', 'size': 'Size (same steps)',
                'noise': 'Input-noise augmentation (errors at 0 mm; noisy inputs below)',
                'robust': 'Robustness to tracker noise (noise model on; errors at 0 mm, the '
                          'whole noise curve below)'}


def command(row: Row, root: Path, data: str, steps: int) -> list[str]:
  base = [a for a in BASE_ARGS
          if not (a.startswith('--size=') and any(b.startswith('--size=') for b in row.args))]
  return [sys.executable, '-m', 'experiments.train', f'--data={data}',
          f'--workdir={root / row.name}', f'--steps={steps}', *base,
          f'--config.seed={row.seed}', *row.args]


def _status(workdir: Path) -> str:
  try:
    return json.loads((workdir / 'run.json').read_text())['status']
  except (OSError, ValueError, KeyError):
    return 'pending'


def _selected(rows):
  only = set(_ONLY.value or [])
  unknown = sorted(only - {r.name for r in rows} - {r.table for r in rows})
  if unknown:  # it trained or reported nothing, silently
    raise ValueError(f'--only names no row or table: {", ".join(unknown)} (--mode=list lists '
                     'them)')
  return [r for r in rows if not only or r.name in only or r.table in only]


def train_all(root: Path, data: str, steps: int) -> None:
  root.mkdir(parents=True, exist_ok=True)
  manifest_path = root / 'manifest.json'
  manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {'rows': {}}
  manifest['queue_command'] = ' '.join(['python', '-m', 'experiments.ablations', *sys.argv[1:]])
  rows = [r for r in _selected(ROWS) if r.name not in set(_SKIP.value)]
  for i, row in enumerate(rows):
    workdir = root / row.name
    cmd = command(row, root, data, steps)
    entry = manifest['rows'].setdefault(row.name, {})
    entry.update(table=row.table, variant=row.variant, seed=row.seed,
                 command=' '.join(['python', *cmd[1:]]), workdir=str(workdir))
    if train.finished_run(workdir, steps) is not None:  # at these --steps (a run done at
      entry['status'] = 'done'                         # others resumes to them, as recorded)
      continue
    print(f'[{i + 1}/{len(rows)}] {row.name}: {entry["command"]}', flush=True)
    entry['status'] = 'running'
    atomic.write_json(manifest_path, manifest)
    t0 = time.time()
    log = open(root / f'{row.name}.log', 'a')
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
      rc = proc.wait()
    except KeyboardInterrupt:  # pass the stop on; the trainer saves and exits
      proc.send_signal(signal.SIGINT)
      proc.wait()
      entry['status'] = 'interrupted'
      atomic.write_json(manifest_path, manifest)
      raise
    entry['wall_seconds'] = entry.get('wall_seconds', 0.0) + time.time() - t0
    entry['status'] = ('done' if rc == 0 and train.finished_run(workdir, steps) is not None
                       else f'failed (rc {rc})')
    atomic.write_json(manifest_path, manifest)
    print(f'  -> {entry["status"]} in {time.time() - t0:.0f} s', flush=True)
  atomic.write_json(manifest_path, manifest)


def _flops(method, batch: dict) -> float:
  """XLA's FLOPs per frame on one block of frames (a bigger batch runs as a loop of blocks on
  the CPU, whose body XLA counts once; `inference.flop_frames`)."""
  n = inference.flop_frames()
  return iterative_ik.flops_per_frame(method.solve, np.asarray(batch['positions'][:n]),
                                      np.asarray(batch['offsets'][:n]))


def _forward_fps(method, positions, offsets, batch: int = 1024, reps: int = 7) -> float:
  pos, off = jax.device_put(positions[:batch]), jax.device_put(offsets[:batch])
  jax.block_until_ready(method.solve(pos, off))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(method.solve(pos, off))
    times.append(time.perf_counter() - t)
  return batch / float(np.median(times))


# The report's noise curve (evaluation's fixed protocol: i.i.d. Gaussian sigma per coordinate,
# seed 0); 0 mm is the clean evaluation. Rows of CURVE_TABLES get it, all seeds.
NOISE_LEVELS_MM = (10, 20, 30, 50)
CURVE_TABLES = (BASELINE, 'noise', 'robust')
UNSEEN = 'unseen_subject'  # the test part reported beside every row (per_part of the result)
KEYS = ('local_rot_err_deg', 'root_rot_err_deg', 'twist_err_deg', 'swing_err_deg', 'mpjpe_mm',
        'local_rot_err_deg_leaf')


def report(root: Path, data_dir: str, split: str) -> None:
  data = data_lib.load_shards(data_dir, split)
  rig = data.rig
  manifest = json.loads((root / 'manifest.json').read_text())
  results_path, tables_path = report_paths(root, split)
  results = json.loads(results_path.read_text()) if results_path.exists() else {}
  idx = np.arange(len(data))
  batch = input_pipeline.gather_batch(data, idx[:1024])
  for row in _selected(ROWS):
    workdir = root / row.name
    if _status(workdir) != 'done':
      continue
    step = json.loads((workdir / 'run.json').read_text()).get('step')
    if row.name in results and results[row.name].get('step', step) != step:
      del results[row.name]  # trained further since: evaluated again
    if row.name in results:
      entry = results[row.name]
      method = _lazy(lambda w=workdir: evaluation.make_method('ikgat', rig, checkpoint=w))
      changed = False
      if 'flops_per_frame' not in entry:  # added to the report later
        entry['flops_per_frame'] = _flops(method(), batch)
        changed = True
      if 'part_local_rot_err_deg' not in entry:  # added later (issue J)
        entry['part_local_rot_err_deg'] = _part_errors(evaluation.evaluate(method(), data, rig))
        changed = True
      if row.table in CURVE_TABLES:
        changed |= _fill_noise_curve(entry, method, data, rig)
      if changed:
        atomic.write_json(results_path, results)
      continue
    method = evaluation.make_method('ikgat', rig, checkpoint=workdir)
    r = evaluation.evaluate(method, data, rig)
    meta_params = sum(int(np.prod(np.shape(x))) for x in _params(workdir))
    run = json.loads((workdir / 'run.json').read_text())
    results[row.name] = {
        'table': row.table, 'variant': row.variant, 'seed': row.seed,
        **{k: r[k] for k in KEYS[:-1]},
        'local_rot_err_deg_leaf': r['local_rot_err_deg_by_class']['leaf'],
        'per_joint': r['per_joint'], 'params': meta_params,
        'forward_frames_per_s': _forward_fps(method, np.asarray(batch['positions']),
                                             np.asarray(batch['offsets'])),
        'flops_per_frame': _flops(method, batch),
        'train_wall_s': manifest['rows'].get(row.name, {}).get('wall_seconds'),
        'val_local_rot_err_deg': run.get('val', {}).get('local_rot_err_deg'),
        'command': manifest['rows'].get(row.name, {}).get('command'), 'split': split,
        'step': run.get('step'),
        'frames': r['frames'], 'part_local_rot_err_deg': _part_errors(r)}
    if row.table in CURVE_TABLES:
      _fill_noise_curve(results[row.name], lambda: method, data, rig)
    print(f'{row.name}: local {r["local_rot_err_deg"]:.2f} deg, MPJPE {r["mpjpe_mm"]:.2f} mm, '
          f'{results[row.name]["forward_frames_per_s"]:,.0f} frames/s', flush=True)
    atomic.write_json(results_path, results)
  atomic.write_text(tables_path, tables_markdown(results, split))
  print(f'wrote {results_path} and {tables_path}')


def report_paths(root: Path, split: str) -> tuple[Path, Path]:
  """The report's results JSON and tables of `split`: `results.json` and `tables.md` for test,
  `results_SPLIT.json` and `tables_SPLIT.md` for another (one split's rows never mixed with
  another's, nor its cached rows reused for another)."""
  tail = '' if split == 'test' else f'_{split}'
  return root / f'results{tail}.json', root / f'tables{tail}.md'


def _lazy(make):
  """`make()` on the first call, the same object after."""
  cache = []

  def get():
    if not cache:
      cache.append(make())
    return cache[0]
  return get


def _part_errors(result: dict) -> dict:
  """{test part (unseen_subject, unseen_file): local error (deg)} of an evaluation result."""
  return {part: s['local_rot_err_deg'] for part, s in result.get('per_part', {}).items()}


def _fill_noise_curve(entry: dict, method, data, rig) -> bool:
  """Adds the noise-curve points `entry` lacks: local error at every NOISE_LEVELS_MM, all
  frames (`noisy_local_rot_err_deg`) and the unseen subject
  (`noisy_unseen_subject_local_rot_err_deg`; None on a split without it). `method()` gives the
  row's method. Returns whether anything was added."""
  curve = entry.setdefault('noisy_local_rot_err_deg', {})
  unseen = entry.setdefault('noisy_unseen_subject_local_rot_err_deg', {})
  changed = False
  for mm in NOISE_LEVELS_MM:
    if str(mm) in curve and str(mm) in unseen:
      continue
    r = evaluation.evaluate(method(), data, rig, noise_mm=mm)
    curve[str(mm)] = r['local_rot_err_deg']
    unseen[str(mm)] = _part_errors(r).get(UNSEEN)
    changed = True
  return changed


def _params(workdir: Path):
  model, _ = inference.load_model(workdir)
  return jax.tree.leaves(nnx.state(model, nnx.Param))


def _agg(rs: list[dict]) -> dict:
  out = {k: float(np.mean([r[k] for r in rs])) for k in (*KEYS, 'forward_frames_per_s')}
  out['flops_per_frame'] = rs[0].get('flops_per_frame', float('nan'))
  out['std'] = float(np.std([r['local_rot_err_deg'] for r in rs], ddof=1)) if len(rs) > 1 else None
  out['seeds'] = len(rs)
  out['params'] = rs[0]['params']
  unseen = [r.get('part_local_rot_err_deg', {}).get(UNSEEN) for r in rs]
  out['unseen'] = float(np.mean(unseen)) if all(u is not None for u in unseen) else None
  return out


def _curve_means(rs: list[dict], key: str, zero) -> list[float | None]:
  """Mean over seeds of the local error at 0 mm (`zero(r)`) and at NOISE_LEVELS_MM (`r[key]`);
  None where a seed lacks the point."""
  out = []
  for get in [zero] + [lambda r, mm=mm: r.get(key, {}).get(str(mm)) for mm in NOISE_LEVELS_MM]:
    v = [get(r) for r in rs]
    out.append(float(np.mean(v)) if all(x is not None for x in v) else None)
  return out


def pooled_seed_std(groups: dict) -> tuple[float | None, int]:
  """Pooled standard deviation of the local error over every group with several seeds (a
  row's seeds differ only in initialisation, batch order and augmentation draws)."""
  ss, dof = 0.0, 0
  for rs in groups.values():
    if len(rs) > 1:
      x = np.asarray([r['local_rot_err_deg'] for r in rs])
      ss += float(((x - x.mean()) ** 2).sum())
      dof += len(x) - 1
  return (float(np.sqrt(ss / dof)) if dof else None), dof


def tables_markdown(results: dict, split: str = 'test') -> str:
  groups: dict[tuple[str, str], list[dict]] = {}
  for r in results.values():
    groups.setdefault((r['table'], r['variant']), []).append(r)
  base = groups.get((BASELINE, 'baseline'))
  if not base:
    return 'no baseline yet\n'
  b = _agg(base)
  noise, dof = pooled_seed_std(groups)
  multi = ', '.join(f'{v} {len(rs)}' for (t, v), rs in groups.items() if len(rs) > 1)
  lines = [f'Baseline: {len(base)} seed(s), {split} local error {b["local_rot_err_deg"]:.2f} deg.'
           + (f' Seed noise: pooled std {noise:.2f} deg of the local error over the rows run '
              f'with several seeds ({multi}; {dof} degrees of freedom); differences from the '
              f'baseline under {_NOISE_SIGMAS.value:g} std ({_NOISE_SIGMAS.value * noise:.2f} '
              'deg) are marked "~" = within seed noise.' if noise is not None else ''), '']
  header = ['variant', 'seeds', 'local (deg)', 'vs baseline', 'unseen subject (deg)',
            'root (deg)', 'twist (deg)',
            'swing (deg)', 'leaves (deg)', 'MPJPE (mm)', 'params', 'MFLOP/frame',
            'frames/s (batch 1024)']
  for table, title in TABLE_TITLES.items():
    rows = [(BASELINE_LABEL[table], b)] + [
        (variant, _agg(rs)) for (t, variant), rs in groups.items() if t == table]
    if len(rows) == 1:
      continue
    cells = []
    for label, a in rows:
      d = a['local_rot_err_deg'] - b['local_rot_err_deg']
      mark = '' if a is b else (
          f'{d:+.2f}' + (' ~' if noise is not None and abs(d) < _NOISE_SIGMAS.value * noise
                          else ''))
      std = f' ± {a["std"]:.2f}' if a['std'] is not None else ''
      cells.append([label, str(a['seeds']), f'{a["local_rot_err_deg"]:.2f}{std}', mark,
                    '-' if a['unseen'] is None else f'{a["unseen"]:.2f}',
                    f'{a["root_rot_err_deg"]:.2f}', f'{a["twist_err_deg"]:.2f}',
                    f'{a["swing_err_deg"]:.2f}', f'{a["local_rot_err_deg_leaf"]:.2f}',
                    f'{a["mpjpe_mm"]:.2f}', f'{a["params"]:,}',
                    f'{a["flops_per_frame"] / 1e6:.1f}', f'{a["forward_frames_per_s"]:,.0f}'])
    lines += [f'### {title}', '', evaluation.markdown_grid(header, cells), '']
  # Noise curves: every row of CURVE_TABLES, seeds averaged.
  curves = [(f'{t}: {v}' if t != BASELINE else v, rs) for (t, v), rs in groups.items()
            if t in CURVE_TABLES and any('noisy_local_rot_err_deg' in r for r in rs)]
  if len(curves) > 1:
    head = ['model', 'seeds', '0 mm'] + [f'{mm} mm' for mm in NOISE_LEVELS_MM]
    fmt = lambda xs: ['-' if x is None else f'{x:.2f}' for x in xs]
    for what, key, zero in (
        ('all test frames', 'noisy_local_rot_err_deg', lambda r: r['local_rot_err_deg']),
        ('unseen subject', 'noisy_unseen_subject_local_rot_err_deg',
         lambda r: r.get('part_local_rot_err_deg', {}).get(UNSEEN))):
      lines += [f'Local error (deg) vs Gaussian input noise (sigma per coordinate, evaluation '
                f'seed 0), {what}, mean over training seeds:', '',
                evaluation.markdown_grid(head, [[label, str(len(rs)), *fmt(_curve_means(
                    rs, key, zero))] for label, rs in curves]), '']
  return '\n'.join(lines)


@fail_on_user_error
def main(argv):
  del argv
  root = Path(_ROOT.value)
  if _MODE.value == 'list':
    for row in _selected(ROWS):
      print(row.name, _status(root / row.name), ' '.join(command(row, root, _DATA.value or 'DIR',
                                                                  _STEPS.value)[1:]))
    return
  if not _DATA.value:
    raise ValueError('--data is required')
  if _MODE.value == 'train':
    try:
      train_all(root, _DATA.value, _STEPS.value)
    except KeyboardInterrupt:
      sys.exit(130)
  else:
    report(root, _DATA.value, _SPLIT.value)


if __name__ == '__main__':
  run_main(main)
