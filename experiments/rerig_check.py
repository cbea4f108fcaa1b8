"""Rig invariance, trained from scratch (issue L; DESIGN section 3 "Rig invariance").

  python -m experiments.rerig_check --cmu=../shared/data/cmu --root=runs/rerig_check \
      [--seeds=0,1,2] [--steps=2000] [--prior_steps=1500] [--mode=run|report]

The whole user pipeline, as the command lines run it, on CMU as it is (`cmu_body`) and on the
same motion re-rigged by `data_prep.rerig` (random fixed per-joint binds compensated in the
motion, bones along local X, XZY channels, centimetres, a dummy root whose OFFSET changes per
file): convert, train IK-GAT (small, one run per seed) and the pose prior from scratch, evaluate
every method on the test split. Local-rotation errors are invariant to the binds, so the floors
(swing-only IK, mean pose) must agree to float tolerance and IK-GAT and the iterative solvers
within seed noise (2 pooled std of the IK-GAT seeds). Every stage is one command, skipped when
its output exists (a training run resumes), so rerunning continues; `--mode=report` (also run
at the end) writes ROOT/results.json and ROOT/table.md. About 40 minutes on the 2-core CPU
with the defaults (six small trainings of ~4 min, two priors, the evaluations).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
import subprocess
import sys
import time

from absl import flags
import numpy as np

from experiments.common import exit_interrupted, fail_on_user_error, run_main
from ik_gat_jax import train
from ik_gat_jax.absl_main import fail
from ik_gat_jax.evaluation import markdown_grid
from ik_gat_jax.io import atomic

DATASETS = ('cmu', 'rerig')
FLOORS = ('swing', 'mean_pose')
ITERATIVE = ('iterative', 'iterative_noprior')
FLOOR_TOL_DEG = 1e-3  # float32 round-off through the chain, far below any real difference


def _py(*args: str) -> list[str]:
  return [sys.executable, '-m', *args]


def stages(root: Path, cmu: str, seeds: list[int], steps: int, prior_steps: int):
  """(name, output that marks it done, command) in order."""
  bvh = root / 'rerig_bvh'
  out = [('rerig', bvh / 'cmu_body_rerig.json',
          _py('data_prep.rerig', f'--input={cmu}', f'--output={bvh}', '--seed=0')),
         ('convert_cmu', root / 'shards_cmu' / 'summary.json',
          _py('data_prep.bvh_to_shards', f'--input={cmu}', '--rig=cmu_body',
              f'--output={root / "shards_cmu"}')),
         ('convert_rerig', root / 'shards_rerig' / 'summary.json',
          _py('data_prep.bvh_to_shards', f'--input={bvh}', f'--rig={bvh / "cmu_body_rerig.json"}',
              f'--output={root / "shards_rerig"}'))]
  for d in DATASETS:
    data = root / f'shards_{d}'
    for s in seeds:
      run = root / f'ikgat_{d}_s{s}'
      # Done when the run finished at --steps (train.finished_run), not when `best` exists:
      # the trainer makes that folder at step 0, so a stopped training counted as done.
      out.append((f'train_{d}_s{s}', functools.partial(_trained, run, steps),
                  _py('experiments.train', f'--data={data}', f'--workdir={run}', '--size=small',
                      f'--steps={steps}', f'--config.seed={s}',
                      '--config.train.eval_every=1000')))
    prior = root / f'prior_{d}'
    out.append((f'prior_{d}', prior / 'prior_report.json',
                _py('experiments.train_prior', f'--data={data}', f'--workdir={prior}',
                    f'--steps={prior_steps}')))
    for s in seeds:
      out.append((f'eval_{d}_ikgat_s{s}', root / 'eval' / f'{d}_ikgat_s{s}.json',
                  _py('experiments.evaluate', f'--data={data}', '--split=test', '--method=ikgat',
                      f'--checkpoint={root / f"ikgat_{d}_s{s}"}',
                      f'--output_json={root / "eval" / f"{d}_ikgat_s{s}.json"}')))
    for m in (*FLOORS, *ITERATIVE):
      extra = [f'--prior={prior}'] if m == 'iterative' else []
      out.append((f'eval_{d}_{m}', root / 'eval' / f'{d}_{m}.json',
                  _py('experiments.evaluate', f'--data={data}', '--split=test', f'--method={m}',
                      *extra, f'--output_json={root / "eval" / f"{d}_{m}.json"}')))
  return out


class StageError(RuntimeError):
  """A stage's command failed (its log named)."""


def _trained(run: Path, steps: int) -> bool:
  return train.finished_run(run, steps) is not None


def run_queue(root: Path, queue) -> None:
  """Runs each stage `(name, done, command)` whose `done` (a path that exists, or a callable
  saying so) is not yet; a failed stage raises StageError naming its log."""
  (root / 'eval').mkdir(parents=True, exist_ok=True)
  for i, (name, done, cmd) in enumerate(queue, 1):
    if done() if callable(done) else done.exists():
      print(f'[{i}/{len(queue)}] {name}: done, skipped', flush=True)
      continue
    print(f'[{i}/{len(queue)}] {name}: {" ".join(cmd[1:])}', flush=True)
    t = time.time()
    with open(root / f'{name}.log', 'w') as log:
      rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
      raise StageError(f'{name} failed (exit {rc}); see {root / f"{name}.log"}')
    print(f'  -> done in {time.time() - t:.0f} s', flush=True)


def _load(root: Path, name: str) -> dict | None:
  path = root / 'eval' / f'{name}.json'
  return json.loads(path.read_text()) if path.exists() else None


def report(root: Path, seeds: list[int]) -> dict:
  """Per method: the local error on each dataset, the difference, and the verdict."""
  rows, result = [], {'methods': {}}
  ikgat = {d: [r['local_rot_err_deg'] for s in seeds if (r := _load(root, f'{d}_ikgat_s{s}'))]
           for d in DATASETS}
  dof = sum(max(len(v) - 1, 0) for v in ikgat.values())
  pooled = (float(np.sqrt(sum(((np.asarray(v) - np.mean(v)) ** 2).sum() for v in ikgat.values()
                              if len(v) > 1) / dof)) if dof else None)
  result['ikgat_seed_std_pooled'] = pooled
  for m in ('ikgat', *ITERATIVE, *FLOORS):
    if m == 'ikgat':
      vals = {d: (float(np.mean(v)) if v else None) for d, v in ikgat.items()}
      tol, what = (2 * pooled if pooled is not None else None), 'seed noise (2 pooled std)'
    else:
      vals = {d: (r['local_rot_err_deg'] if (r := _load(root, f'{d}_{m}')) else None)
              for d in DATASETS}
      tol = FLOOR_TOL_DEG if m in FLOORS else (2 * pooled if pooled is not None else None)
      what = 'float tolerance' if m in FLOORS else 'seed noise (2 pooled std)'
    a, b = vals['cmu'], vals['rerig']
    diff = None if a is None or b is None else b - a
    ok = None if diff is None or tol is None else abs(diff) <= tol
    result['methods'][m] = {'cmu': a, 'rerig': b, 'difference': diff, 'tolerance': tol,
                            'within': what, 'ok': ok}
    f = lambda x, fmt='.3f': '-' if x is None else format(x, fmt)
    rows.append([m + (f' (mean of {len(ikgat["cmu"])} / {len(ikgat["rerig"])} seeds)'
                      if m == 'ikgat' else ''), f(a), f(b), f(diff, '+.4f'),
                 f(tol, '.4f') + f' ({what})', {None: '-', True: 'yes', False: 'NO'}[ok]])
  table = markdown_grid(['method', 'cmu_body (deg)', 're-rigged (deg)', 'difference',
                         'allowed', 'same'], rows)
  seeds_txt = '; '.join(f'{d}: ' + ', '.join(f'{x:.2f}' for x in v) for d, v in ikgat.items())
  text = (f'Local rotation error on the CMU test split, {len(seeds)} IK-GAT seeds ({seeds_txt}; '
          f'pooled seed std {f(pooled)} deg).\n\n{table}\n')
  atomic.write_json(root / 'results.json', result)
  atomic.write_text(root / 'table.md', text)
  print(text)
  return result


def define_flags() -> None:
  """The flags, defined when the main runs (not at import: a test imports `run_queue`)."""
  flags.DEFINE_string('cmu', '../shared/data/cmu', 'The CMU BVH directory.')
  flags.DEFINE_string('root', 'runs/rerig_check', 'Where every output goes.')
  flags.DEFINE_list('seeds', ['0', '1', '2'], 'IK-GAT training seeds.')
  flags.DEFINE_integer('steps', 2000, 'IK-GAT training steps (small size).')
  flags.DEFINE_integer('prior_steps', 1500, 'Pose-prior training steps.')
  flags.DEFINE_enum('mode', 'run', ['run', 'report'], 'Run the queue, or only report.')


@fail_on_user_error
def main(argv):
  del argv
  F = flags.FLAGS
  root = Path(F.root)
  seeds = [int(s) for s in F.seeds]
  if F.mode == 'run':
    if not (Path(F.cmu) / '07_01.bvh').exists():
      raise FileNotFoundError(f'no CMU BVH files in {F.cmu}')
    root.mkdir(parents=True, exist_ok=True)
    try:
      run_queue(root, stages(root, F.cmu, seeds, F.steps, F.prior_steps))
    except StageError as e:
      fail(str(e))
    except KeyboardInterrupt:
      exit_interrupted()
  report(root, seeds)


if __name__ == '__main__':
  run_main(main, define_flags)
