r"""One command for your own rig: convert, train IK-GAT and the prior, evaluate, export.

  python -m experiments.train_rig --bvh=DIR --workdir=DIR [--rig=auto|NAME|JOINT_MAP.json] \
      [--units=auto|NUMBER|m|cm|mm|in|ft|cmu] [--up=y --forward=z] \
      [--reference_pose=zero|first_frame] \
      [--split=auto|subject|file|SPLIT.json] [--subject_regex=RE] [--size=small] [--steps=N] \
      [--prior_steps=N] [--export=DIR] [--eval_frames=N] [--iters=100] [--acknowledgment=TEXT] \
      [--config.train.lr=...] [--prior_config.model.latent=...]

Stages (each skipped when its output is complete, so rerunning the same command continues where
it stopped; the trainer resumes a half-finished run from its latest checkpoint):
  1 convert   --bvh -> WORKDIR/shards (data_prep.conversion.convert), with WORKDIR/split.json
  2 ikgat     IK-GAT (experiments/configs/robust.py, the shipped base's recipe, --size,
              --steps) -> WORKDIR/ikgat; a rig without a pair of hips gets yaw augmentation
              instead of the heading, a workdir trained with the recipe before session 45
              (default.py) goes on with it, each said in one line
  3 prior     the VPoser-style prior (experiments/configs/prior.py, --prior_steps) ->
              WORKDIR/prior (+ prior_report.json)
  4 evaluate  ikgat, ikgat_calibrated (the same with the subject calibration), iterative (with
              that prior), swing, mean_pose on the test split (val when there is none, train
              when there is neither), and ikgat and iterative again with 10 and 20 mm of input
              noise (ikgat_10mm, ...) -> WORKDIR/eval/METHOD.json, table.md
  5 export    the IK-GAT best checkpoint with its card -> --export (default WORKDIR/checkpoint)
WORKDIR/train_rig.json records the options and every stage's status; a line is printed when a
stage starts, finishes or is skipped. A rerun with other training options (--size, --config.*,
--prior_config.*) than a trained run was made with, or a lower --steps / --prior_steps than it
was trained to, is refused in one line naming them (train_rig.json left as it was); a higher
--steps or --prior_steps trains further. A stage that a killed run left 'running' is said so
and resumed; SIGTERM stops the command as Ctrl-C does (the stage recorded 'interrupted').

--split=auto: the joint map's committed split when --rig names one that has it; otherwise
derived (`derive_split`): with 3 or more subjects, whole subjects are held out (subjects sorted
by name: the 1st, 11th, 21st, ... test; the 2nd, 12th, ... val; the rest train); with fewer,
files are (files sorted by path: the 1st, 11th, ... test; the 2nd, 12th, ... val; the rest
train; 2 files: test + train; 1 file: train only, evaluated on train). Subjects are read from
file names as the converter does (the folder inside --bvh, else the name before the first '_';
--subject_regex overrides). --split=subject|file forces a rule; --split=FILE.json gives a
split of your own (data_prep/splits/ format).

--units=auto: the joint map's units for a joint map; for --rig=auto estimated from the first
file's skeleton (io/units.py; printed with its evidence, refused when no unit makes a human).

--up, --forward (--rig=auto only; a joint map names its own): the files' up axis and the axis
their bodies face at rest, default y and z; e.g. --up=z --forward=-y for files exported from
Blender. The derived rig is y-up, +z-forward either way; the card's solve command then adds the
matching --input_axes. The conversion warns when the bodies extend most along another axis than
the one taken as up (data_prep.conversion.doubt_up_axis).

Solve your rig's clips afterwards with the command the card prints, e.g.
  python -m ik_gat_jax.solve --checkpoint=WORKDIR/checkpoint --input=CLIP.bvh \
      --output=CLIP_ikgat.bvh --units=0.056444
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import re
import time
from pathlib import Path
from typing import Callable

import numpy as np
from absl import flags
from ml_collections import config_flags

from data_prep import conversion
from experiments import export_checkpoint
from experiments.common import exit_interrupted, fail_on_user_error, run_main
from experiments.configs import default as default_config
from experiments.configs import prior as prior_config
from experiments.configs import robust as robust_config
from ik_gat_jax.absl_main import terminate_as_interrupt
from ik_gat_jax import checkpointing, data, evaluation, inference, iterative_ik, prior_task
from ik_gat_jax import input_pipeline, provenance, skeleton, train, vposer
from ik_gat_jax import model as model_lib
from ik_gat_jax import solver as solver_lib
from ik_gat_jax.errors import ConversionError
from ik_gat_jax.io import atomic, retarget
from ik_gat_jax.io.units import parse_units

CONFIG_DIR = Path(__file__).resolve().parent / 'configs'
STAGES = ('convert', 'ikgat', 'prior', 'evaluate', 'export')
# Clean input, then IK-GAT and the iterative solver with tracker-like noise (Gaussian, per
# coordinate, seed 0: `experiments.evaluate --noise_mm`): NAME_Nmm.
EVAL_METHODS = ('ikgat', 'ikgat_calibrated', 'iterative', 'swing', 'mean_pose', 'ikgat_10mm',
                'iterative_10mm', 'ikgat_20mm', 'iterative_20mm')
SPLIT_RULES = ('auto', 'subject', 'file')
MANIFEST = 'train_rig.json'
Log = Callable[[str], None]


def eval_row(name: str) -> tuple[str, float]:
  """An `EVAL_METHODS` row -> (its method, the input noise in mm)."""
  method, _, noise = name.partition('_')
  if noise.endswith('mm'):
    return method, float(noise[:-2])
  return name, 0.0


def _print(msg: str) -> None:
  print(msg, flush=True)


@dataclasses.dataclass
class Options:
  """What `run` does (the flags of the main). `config` / `prior_config`: the IK-GAT and prior
  configs (default: experiments/configs/robust.py and prior.py); `size`, `steps` and
  `prior_steps` override them when given."""
  bvh: str
  workdir: str
  rig: str = 'auto'
  units: str = 'auto'
  up: str | None = None
  forward: str | None = None
  reference_pose: str | None = None
  split: str = 'auto'
  subject_regex: str | None = None
  rig_name: str = 'auto'
  fps: float = 30.0
  size: str | None = 'small'
  steps: int | None = None
  prior_steps: int | None = None
  export: str | None = None
  eval_frames: int | None = None
  iters: int = 100
  acknowledgment: str | None = None
  config: object | None = None
  prior_config: object | None = None


# ----------------------------------------------------------------------------------------------
# The split of a rig without a committed one.


def derive_split(files: list[tuple[str, str]], rule: str = 'auto',
                 subject_regex: str | None = None) -> dict:
  """A split document (data_prep/splits format) for `files` = [(relative name, sha256)] by
  `rule` ('auto', 'subject' or 'file'; module docstring). Deterministic: a function of the
  names only (sorted), not of their order or of any random state."""
  if rule not in SPLIT_RULES:
    raise ValueError(f'--split must be auto, subject, file or a split JSON, got {rule!r}')
  files = sorted(files)
  subject = {f: conversion.subject_of(f, subject_regex) for f, _ in files}
  subjects = sorted(set(subject.values()))
  if rule == 'auto':
    rule = 'subject' if len(subjects) >= 3 else 'file'
  if rule == 'subject':
    if len(subjects) < 3:
      raise ValueError(f'--split=subject needs 3 or more subjects, the files name '
                       f'{len(subjects)} ({", ".join(subjects)}); use --split=file')
    rank = {s: k for k, s in enumerate(subjects)}
    slot = lambda f, i: rank[subject[f]] % 10  # noqa: E731
    held = [('test', 'unseen_subject'), ('val', None)]
    text = ('whole subjects held out: subjects sorted by name, the 1st, 11th, ... test, the '
            '2nd, 12th, ... val, the rest train')
  else:
    slot = lambda f, i: i % 10  # noqa: E731
    held = [('test', 'unseen_file'), ('val', None)][:max(0, min(2, len(files) - 1))]
    text = ('files held out: files sorted by name, the 1st, 11th, ... test, the 2nd, 12th, ... '
            'val, the rest train (2 files: test + train; 1 file: train only)')
  entries = []
  for i, (f, sha) in enumerate(files):
    split, part = held[slot(f, i)] if slot(f, i) < len(held) else ('train', None)
    entries.append({'file': f, 'sha256': sha, 'split': split, 'subject': subject[f],
                    **({'part': part} if part else {})})
  return {'name': f'train_rig_{rule}', 'rule': text, 'files': entries}


# ----------------------------------------------------------------------------------------------
# The manifest (WORKDIR/train_rig.json) and stage bookkeeping.


class Manifest:
  """WORKDIR/train_rig.json: the command, options and every stage's status, written atomically
  on every change. A stage's `key` says what its output was made from; a stage whose key
  differs from the current one is not complete."""

  def __init__(self, workdir: Path, options: dict):
    self.path = workdir / MANIFEST
    old = json.loads(self.path.read_text()) if self.path.is_file() else {}
    self.stages = old.get('stages', {})
    self.recorded_configs = old.get('configs', {})  # what the trained runs were made with
    self.doc = {'command': provenance.command_line(), 'workdir': str(workdir.absolute()),
                'options': options, 'stages': self.stages}
    for s in STAGES:
      self.stages.setdefault(s, {'status': 'pending'})
      self.stages[s].pop('skipped', None)
    self.current = None  # the stage running now

  def failed(self, e: BaseException) -> None:
    """Records why the running stage stopped (interrupted, or the error's first line)."""
    if self.current is not None:
      interrupted = isinstance(e, KeyboardInterrupt)
      text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      self.set(self.current, status='interrupted' if interrupted else 'failed',
               **({} if interrupted else {'error': text}))

  def key(self, stage: str):
    return self.stages[stage].get('key')

  def set(self, stage: str, **fields) -> None:
    if fields.get('status') == 'running':
      self.current = stage
      self.stages[stage].pop('error', None)
    elif 'status' in fields and stage == self.current:
      self.current = None
    self.stages[stage].update(fields)
    self.doc['updated_utc'] = time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())
    atomic.write_json(self.path, self.doc)


def _digest(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _run_done(workdir: Path, steps: int) -> bool:
  """A trainer run finished for `steps` steps (run.json) with a best checkpoint."""
  run = workdir / 'run.json'
  if not run.is_file() or not (workdir / 'checkpoints' / 'best').is_dir():
    return False
  doc = json.loads(run.read_text())
  return doc.get('status') == 'done' and doc.get('steps') == steps


def _best(workdir: Path, task: str) -> dict:
  """Which best checkpoint a run holds: its step and validation metric (the key of what was
  evaluated and exported from it)."""
  ckpt = checkpointing.Checkpointer(workdir / 'checkpoints' / 'best', create=False)
  meta = ckpt.restore_meta()
  return {'task': task, 'step': ckpt.latest_step(),
          'local_rot_err_deg': meta.get('metrics', {}).get('local_rot_err_deg')}


# ----------------------------------------------------------------------------------------------
# Stages.


def _conversion(o: Options, w: Path, m: Manifest) -> tuple[list, dict]:
  """(files as [(name, sha256)], the convert stage's key); refuses, writing nothing, a workdir
  whose shards were converted from other files or with other conversion options."""
  shards = w / 'shards'
  inputs = conversion.find_bvh_files(o.bvh)
  files = [(f, provenance.file_sha256(p)) for f, p in inputs]
  key = {'files': _digest(files), 'rig': o.rig, 'units': o.units,
         'reference_pose': o.reference_pose, 'split': o.split,
         'subject_regex': o.subject_regex, 'rig_name': o.rig_name, 'fps': o.fps}
  key.update({k: v for k, v in (('up', o.up), ('forward', o.forward)) if v is not None})
  if (shards / 'summary.json').is_file():
    held = {f['file']: f['sha256'] for f in json.loads((shards / 'files.json').read_text())}
    if held != dict(files):
      new = sorted(set(dict(files)) - set(held))
      gone = sorted(set(held) - set(dict(files)))
      changed = sorted(f for f, s in files if f in held and held[f] != s)
      raise ValueError(f'{shards} was converted from other files than --bvh={o.bvh} '
                       f'({len(new)} new, {len(gone)} missing, {len(changed)} changed): use a new '
                       '--workdir')
    _check_joint_map_unchanged(o, shards)
    old = m.key('convert')
    if old is not None and old != key and _same_units(old, key, shards):
      key = dict(key, units=old['units'])  # --units=cm where the conversion's auto found cm
    if old not in (None, key):
      was = ', '.join(f'--{k}={old.get(k)}' if old.get(k) is not None else f'no --{k}'
                      for k in key if k != 'files' and old.get(k) != key[k])
      raise ValueError(f'{shards} was converted with {was}: rerun with that, or use a new '
                       '--workdir')
  return files, key


def _check_joint_map_unchanged(o: Options, shards: Path) -> None:
  """Refuses shards converted with a joint-map file (`--rig=FILE.json`) whose text has changed
  since (units, frames dropped, names: the shards would no longer be what it describes)."""
  if o.rig == 'auto' or not Path(o.rig).is_file():
    return
  try:
    used = json.loads((shards / 'summary.json').read_text())['runs'][-1]['joint_map_sha256']
  except (OSError, ValueError, KeyError, IndexError):
    return
  now = retarget.load_joint_map(o.rig).sha256
  if used and now != used:
    raise ValueError(f'{shards} was converted with another {o.rig}: the joint map has changed '
                     f'since (sha256 {used[:12]} then, {now[:12]} now): put it back, or use a new '
                     '--workdir')


def _same_units(old: dict, key: dict, shards: Path) -> bool:
  """Whether conversion keys `old` and `key` differ at most in `units`, each naming the metres
  per file unit the conversion of `shards` used (`--units=auto` there: what it resolved to)."""
  if {k for k in set(old) | set(key) if old.get(k) != key.get(k)} != {'units'}:
    return False
  try:
    used = json.loads((shards / 'summary.json').read_text())['runs'][-1]['units_m']
  except (OSError, ValueError, KeyError, IndexError):
    return False
  for units in (old['units'], key['units']):
    if isinstance(units, str) and units.strip().lower() == 'auto':
      continue
    try:
      if not math.isclose(parse_units(units), used, rel_tol=1e-9):
        return False
    except ValueError:
      return False
  return True


def _convert(o: Options, w: Path, m: Manifest, log: Log, tag: str, files: list,
             key: dict) -> dict:
  shards, split_json = w / 'shards', w / 'split.json'
  if (shards / 'summary.json').is_file():  # from these files with these options (_conversion)
    summary = json.loads((shards / 'summary.json').read_text())
    log(f'{tag} convert: already done ({shards}: {summary["total_files"]} files, '
        f'{summary["total_frames"]} frames), skipped')
    m.set('convert', status='done', skipped=True, key=key)
    return summary
  log(f'{tag} convert: {len(files)} BVH files from {o.bvh} -> {shards}')
  m.set('convert', status='running', key=key)
  t = time.perf_counter()
  split, split_file, rule = 'auto', None, None
  if o.split.endswith('.json'):
    split_file = str(Path(o.split).absolute())
  else:
    committed = None
    if o.rig != 'auto' and o.split == 'auto':
      committed = retarget.load_joint_map(o.rig).default_split
    if committed is None:
      doc = derive_split(files, o.split, o.subject_regex)
      atomic.write_json(split_json, doc)
      split_file, rule = str(split_json.absolute()), doc['rule']
      counts = {s: sum(e['split'] == s for e in doc['files']) for s in ('train', 'val', 'test')}
      subjects = sorted({e['subject'] for e in doc['files']})
      log(f'{tag} convert: split {doc["name"]} ({rule}): '
          + ', '.join(f'{n} {s}' for s, n in counts.items()) + f' files -> {split_json}; '
          f'{len(subjects)} subject(s) by file name (--subject_regex): '
          + ', '.join(subjects[:8]) + (' ...' if len(subjects) > 8 else ''))
  units = o.units
  if isinstance(units, str) and units.strip().lower() == 'auto' and o.rig != 'auto':
    units = None  # the joint map's own
  try:
    summary = conversion.convert(o.bvh, o.rig, shards, split=split, split_file=split_file,
                                 fps=o.fps, units=units, up=o.up, forward=o.forward,
                                 subject_regex=o.subject_regex, rig_name=o.rig_name,
                                 reference_pose=o.reference_pose, log=log)
  except ConversionError as e:  # conversion's advice names bvh_to_shards' --split values
    if split == 'auto' and split_file is None and 'is not in split' in str(e):
      raise ConversionError(str(e).split('; pass')[0] + f' (joint map {o.rig}\'s committed '
                            'split): pass --split=subject or --split=file to split your files '
                            'by subject or by file') from None
    if o.split.endswith('.json') and 'is not in split' in str(e):  # --split=YOURS.json
      raise ConversionError(str(e).split('; pass')[0] + f' ({o.split}): list it there, or pass '
                            '--split=subject or --split=file to split your files by subject or '
                            'by file') from None
    raise
  log(f'{tag} convert: done in {time.perf_counter() - t:.1f} s ({summary["total_files"]} files, '
      f'frames {summary["frames"]}, rig {summary["rig"]})')
  m.set('convert', status='done', seconds=round(time.perf_counter() - t, 2), outputs=[
      str(shards)], split_rule=rule or f'{split_file or "committed split of " + o.rig}')
  return summary


def _train(name: str, config, run: Path, m: Manifest, log: Log, tag: str, task=None,
           after: Callable[[], None] | None = None, extra_done: Path | None = None) -> bool:
  """Trains `config` into `run` unless finished; returns whether it ran."""
  steps = int(config.train.steps)
  if _run_done(run, steps):
    if extra_done is not None and not extra_done.is_file():
      log(f'{tag} {name}: trained ({run}, {steps} steps); writing {extra_done.name}')
      after()
      m.set(name, status='done', outputs=[str(run)], key={'steps': steps})
      return True
    log(f'{tag} {name}: already done ({run}, {steps} steps), skipped')
    m.set(name, status='done', skipped=True, key={'steps': steps})
    return False
  log(f'{tag} {name}: training {steps} steps -> {run}')
  m.set(name, status='running', key={'steps': steps})
  t = time.perf_counter()
  train.train_and_evaluate(config, run, log=log, **({'task': task} if task else {}))
  if after is not None:
    after()
  log(f'{tag} {name}: done in {time.perf_counter() - t:.1f} s')
  m.set(name, status='done', seconds=round(time.perf_counter() - t, 2), outputs=[str(run)])
  return True


def eval_split(shards: Path) -> str:
  """test, else val, else train."""
  have = data.available_splits(shards)
  return next(s for s in ('test', 'val', 'train') if s in have)


def _evaluate(o: Options, w: Path, m: Manifest, log: Log, tag: str) -> dict:
  shards, out = w / 'shards', w / 'eval'
  split = eval_split(shards)
  base = {'split': split, 'eval_frames': o.eval_frames}
  keys = {'ikgat': {**base, 'ikgat': _best(w / 'ikgat', 'ikgat')},
          'ikgat_calibrated': {**base, 'ikgat': _best(w / 'ikgat', 'ikgat'),
                               'subject_calibration': True},
          'iterative': {**base, 'iters': o.iters, 'prior': _best(w / 'prior', 'pose_prior')},
          'swing': base, 'mean_pose': base}
  for name in EVAL_METHODS:
    method, noise = eval_row(name)
    if noise:
      keys[name] = {**keys[method], 'noise_mm': noise}
  results = {}
  for name in EVAL_METHODS:
    path = out / f'{name}.json'
    if path.is_file():
      r = json.loads(path.read_text())
      if r.get('train_rig_key') == keys[name]:
        results[name] = r
  if len(results) == len(EVAL_METHODS) and (out / 'table.md').is_file():
    log(f'{tag} evaluate: already done ({out}, {split} split), skipped')
    m.set('evaluate', status='done', skipped=True, key=keys)
    return results
  log(f'{tag} evaluate: {", ".join(EVAL_METHODS)} on the {split} split -> {out}')
  m.set('evaluate', status='running', key=keys)
  t = time.perf_counter()
  out.mkdir(parents=True, exist_ok=True)
  ds = data.load_shards(shards, split)
  train_data = data.load_shards(shards, 'train')
  for name in EVAL_METHODS:
    if name in results:
      log(f'{tag} evaluate: {name} already done ({out / (name + ".json")}), skipped')
      continue
    calibrated = name == 'ikgat_calibrated'  # the solver's --subject_calibration
    kind, noise = eval_row(name)
    method = evaluation.make_method(
        'ikgat' if calibrated else kind, ds.rig,
        train_data=train_data if name == 'mean_pose' else None,
        checkpoint=w / 'ikgat', prior=w / 'prior', solver=iterative_ik.SolverConfig(iters=o.iters))
    r = evaluation.evaluate(method, ds, ds.rig, max_frames=o.eval_frames, noise_mm=noise,
                            subject_calibration=calibrated)
    r.update(command=provenance.command_line(), train_rig_key=keys[name])
    atomic.write_json(out / f'{name}.json', r)
    results[name] = r
    log(f'{tag} evaluate: {name}: local {r["local_rot_err_deg"]:.2f} deg, MPJPE '
        f'{r["mpjpe_mm"]:.1f} mm, {r["frames"]} frames at {r["frames_per_s"]:,.0f} frames/s')
  atomic.write_text(out / 'table.md', results_table(results, ds) + '\n')
  log(f'{tag} evaluate: done in {time.perf_counter() - t:.1f} s ({out / "table.md"})')
  m.set('evaluate', status='done', seconds=round(time.perf_counter() - t, 2),
        outputs=[str(out / f'{n}.json') for n in EVAL_METHODS] + [str(out / 'table.md')])
  return results


def results_table(results: dict, ds) -> str:
  rows = [evaluation.result_cells(results[n], n) for n in EVAL_METHODS if n in results]
  files = sorted({f['file'] for f in ds.files if f['split'] == ds.split})
  done = {r.get('frames') for r in results.values()} - {None}
  frames = (f'{len(ds)} frames' if done in (set(), {len(ds)}) else
            f'{"/".join(str(n) for n in sorted(done))} of its {len(ds)} frames evaluated')
  return '\n'.join([
      f'{ds.rig.name}: {ds.split} split, {frames}, {len(files)} files '
      f'({", ".join(files[:8])}{" ..." if len(files) > 8 else ""})', '',
      evaluation.markdown_grid(evaluation.RESULT_COLUMNS, rows), '',
      'ikgat: this run\'s IK-GAT (best val checkpoint); ikgat_calibrated: the same with '
      '`--subject_calibration` (ik_gat_jax/subject_calibration.py); iterative: the VPoser-style '
      'solver with '
      'this run\'s prior; swing: swing-only IK (a floor); mean_pose: the mean training pose (a '
      'floor); _10mm, _20mm: the same method with Gaussian noise of that sigma per coordinate '
      'on the input positions, as from a tracker (seed 0; `experiments.evaluate --noise_mm`). '
      'Local rotation errors in degrees, MPJPE in mm (DESIGN section 7).'])


def solve_command(export: Path, summary: dict, o: Options) -> str:
  """The `ik_gat_jax.solve` command that reads a clip of this rig as the conversion did."""
  run = summary['runs'][-1]
  cmd = (f'python -m ik_gat_jax.solve --checkpoint={export} --input=CLIP.bvh '
         f'--output=CLIP_ikgat.bvh --units={run["units_m"]:g}')
  if o.rig == 'auto':
    W = retarget.world_rotation(run['up'], run['forward'], (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))
    if not np.array_equal(W, np.eye(3)):  # the files' axes -> the rig's y-up, +z-forward world
      cmd += f' --input_axes={solver_lib.axes_text(W)}'
    return cmd
  return cmd + f' --joint_map={Path(o.rig).absolute() if Path(o.rig).is_file() else o.rig}'


def _card_extra(o: Options, w: Path, summary: dict, results: dict, export: Path, ds,
                split_rule: str | None) -> str:
  run = summary['runs'][-1]
  files = json.loads((w / 'shards' / 'files.json').read_text())
  lines = ['## This rig\'s evaluation', '', results_table(results, ds), '',
           '## Data', '',
           f'Source: {Path(o.bvh).absolute()} ({len(files)} BVH files, {summary["total_frames"]} '
           f'frames at {summary["fps"]:g} fps), converted with `--rig={o.rig}` (joint map '
           f'{run["joint_map"]}) to rig {summary["rig"]} ({ds.rig.num_joints} joints: '
           f'{", ".join(ds.rig.joint_names)}); {run["units_m"]:g} m per file unit '
           f'(`--units={o.units}`), up {run["up"]}, forward {run["forward"]}, reference pose '
           f'{run["reference_pose"] or "zero"}. Split: {split_rule}.', '',
           '| file | subject | split | frames | sha256 |', '|---|---|---|---:|---|']
  lines += [f'| {f["file"]} | {f["subject"]} | {f["split"]} | {f["frames"]} | '
            f'{f["sha256"][:16]} |' for f in files]
  lines += ['', '## Solving with it', '', f'`{solve_command(export, summary, o)}`', '',
            'The output BVH has the rig\'s joints with their source names and, from a BVH '
            'input on its own offsets, its hierarchy (the constant-rotation joints the rig '
            'left out written back with their rotations; pruned subtrees are not written), '
            'the input BVH\'s rotation order per joint and its units '
            '(`--bvh_units=cm|m|NUMBER` to choose) and '
            'the rig\'s y-up world. `--subject_calibration` measures each clip\'s subject\'s '
            'constant biases at the joints whose children branch on the clip\'s own frames '
            'and removes them (the ikgat_calibrated row above): for subjects unlike the '
            'training ones; it needs the subject\'s offsets (a BVH input\'s own, or '
            '`--offsets_from=BVH`). Positions alone (an npz or CSV) are solved on the rig\'s '
            'template, so the rotations are relative to its rest pose; add `--fit_offsets` to '
            'write the skeleton they imply, which plays the input back.', '',
            f'Made by `{provenance.command_line()}` (workdir {w.absolute()}).']
  return '\n'.join(lines)


def _card_title(export: Path) -> str:
  """What an export's card says it holds ('task: ikgat; rig: auto (27 joints)'), or 'no card'."""
  try:
    text = (export / 'README.md').read_text(errors='replace')
  except OSError:
    return 'no card'
  line = next((ln for ln in text.splitlines() if ln.startswith('Task:')), 'no card')
  return '; '.join(line.split('; ')[:2]).replace('Task:', 'task:')


def _export(o: Options, w: Path, m: Manifest, summary: dict, results: dict, log: Log,
            tag: str) -> Path:
  export = Path(o.export) if o.export else w / 'checkpoint'
  key = {'ikgat': _best(w / 'ikgat', 'ikgat'), 'eval': _digest(m.key('evaluate')),
         'export': str(export.absolute()), 'acknowledgment': o.acknowledgment,
         'trained': export_checkpoint.trained_steps(w / 'ikgat')}  # the card says it
  if m.key('export') == key and (export / 'README.md').is_file():
    log(f'{tag} export: already done ({export}), skipped')
    m.set('export', status='done', skipped=True)
    return export
  log(f'{tag} export: IK-GAT best checkpoint -> {export}')
  if export.exists() and (m.key('export') or {}).get('export') != key['export']:
    export_checkpoint.check_replaceable(export)  # an export, or refused before anything
    log(f'{tag} export: {export} holds an export this workdir did not make '
        f'({_card_title(export)}): it is replaced')
  m.set('export', status='running', key=key)
  t = time.perf_counter()
  shards = w / 'shards'
  ds = data.load_shards(shards, eval_split(shards))
  test = results['ikgat']
  heading = ('Test split' if ds.split == 'test' else
             f'{ds.split.capitalize()} split (this rig has no test split)')
  done = export_checkpoint.export_run(
      w / 'ikgat', export, task='ikgat', test=test, acknowledgment=o.acknowledgment,
      test_heading=heading,
      extra=_card_extra(o, w, summary, results, export, ds,
                        m.stages['convert'].get('split_rule')))
  inference.load_model(export)  # the exported checkpoint loads
  log(f'{tag} export: done in {time.perf_counter() - t:.1f} s ({export}, step {done["step"]}, '
      f'{done["size_bytes"] / 1e6:.1f} MB); solve with: {solve_command(export, summary, o)}')
  m.set('export', status='done', seconds=round(time.perf_counter() - t, 2),
        outputs=[str(export)], solve_command=solve_command(export, summary, o))
  return export


# ----------------------------------------------------------------------------------------------
# The whole command.


def configs(o: Options, shards: Path):
  """(IK-GAT config, prior config) for `o` on `shards`."""
  # Copies: `o` is left as it was, so this gives the same configs each time it is called.
  c = copy.deepcopy(o.config) if o.config is not None else robust_config.get_config()
  c.data = str(shards)
  if o.size is not None:
    c.model.size = o.size
  if o.steps is not None:
    c.train.steps = o.steps
  p = (copy.deepcopy(o.prior_config) if o.prior_config is not None
       else prior_config.get_config())
  p.data = str(shards)
  if o.prior_steps is not None:
    p.train.steps = o.prior_steps
  return c, p


def stage_configs(o: Options, w: Path, m: 'Manifest', log: Log, tag: str):
  """`configs` as the stages train them: the robust recipe's parts the rig cannot take off, a
  workdir trained with the recipe before it kept on it, mirror augmentation off for a rig
  that is not mirror-symmetric; each change said in one line."""
  c, p = configs(o, w / 'shards')
  _recipe_where_the_rig_allows(c, w / 'shards', log, tag)
  _keep_recorded_recipe(c, w, m, log, tag)
  _mirror_off_where_asymmetric(c, p, w / 'shards', log, tag)
  return c, p


def _mirror_off_where_asymmetric(c, p, shards: Path, log: Log, tag: str) -> None:
  """Mirror augmentation off (IK-GAT's and the prior's) for a rig that is not
  mirror-symmetric in its natural pose (`input_pipeline.check_mirror`: its zero pose where it
  names no reference pose, another lab's bind of a crumpled zero pose), which would otherwise
  stop the training at its first step; said in one line, with the better way out."""
  rig = skeleton.Rig.from_json(json.loads((shards / 'rig.json').read_text()))
  problem = input_pipeline.mirror_problem(rig)
  if problem is not None:
    turned = [name for name, cfg in (('IK-GAT', c), ('prior', p)) if cfg.augment.mirror > 0]
    for cfg in (c, p):
      cfg.augment.mirror = 0.0
    if turned:
      way_out = ('' if not any(m != j for j, m in enumerate(rig.mirror)) else
                 '; the pose named as its reference is not a mirror-symmetric one: a joint '
                 'map\'s reference_pose can name the T-pose in channel values'
                 if rig.has_reference_pose else '; if the files start in a T-pose, '
                 '--reference_pose=first_frame gives it its natural pose')
      log(f'{tag} mirror augmentation off ({" and ".join(turned)}): rig {rig.name} '
          f'{problem}{way_out}')


def _recipe_where_the_rig_allows(c, shards: Path, log: Log, tag: str) -> None:
  """The robust recipe's parts a rig cannot take turned off, each in one line: heading
  canonicalisation (back to yaw augmentation) where the root has no mirror pair of children to
  give the hip vector, the noise-level input where no arm or leg bones pair up."""
  rig = skeleton.Rig.from_json(json.loads((shards / 'rig.json').read_text()))
  if c.model.heading_canonicalization:
    try:
      model_lib.hip_pair(rig)
    except ValueError as e:
      c.model.heading_canonicalization, c.augment.yaw = False, True
      log(f'{tag} heading canonicalisation off, yaw augmentation on: {e}')
  if c.model.noise_level_input and not model_lib.mirror_bone_pairs(rig):
    c.model.noise_level_input = False
    log(f'{tag} noise-level input off: rig {rig.name} has no left/right bone pairs to compare')


def recipe_changes() -> dict[str, tuple]:
  """{flat key: (experiments/configs/default.py's value, robust.py's)}: where train_rig's
  default recipe since session 45 differs from the one before it."""
  a = _flat(json.loads(json.dumps(default_config.get_config().to_dict())))
  b = _flat(json.loads(json.dumps(robust_config.get_config().to_dict())))
  return {k: (a.get(k), v) for k, v in b.items() if a.get(k) != v}


def _keep_recorded_recipe(c, w: Path, m: 'Manifest', log: Log, tag: str) -> None:
  """A workdir whose IK-GAT was trained with the recipe before session 45 (default.py: yaw
  augmentation, no tracker noise), rerun with the default recipe unchanged, goes on with the
  recipe it was trained with (said in one line), so the same command continues it."""
  old = _flat(m.recorded_configs.get('ikgat') or {})
  if not old or train.trained_step(w / 'ikgat') is None:
    return
  changes = recipe_changes()
  new = _flat(json.loads(json.dumps(c.to_dict())))
  if all(old.get(k, was) == was and new.get(k) == now for k, (was, now) in changes.items()):
    for k, (was, _) in changes.items():
      section, key = k.split('.', 1)
      c[section][key] = was
    log(f'{tag} {w / "ikgat"} was trained with the recipe before session 45 (yaw augmentation, '
        'no tracker noise): going on with it; a new --workdir trains the robust one')


def _flat(d: dict, prefix: str = '') -> dict:
  """{'a': {'b': 1}} -> {'a.b': 1}."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


def _option(stage: str, key: str) -> str:
  """The command-line option that sets `key` of a stage's config."""
  if stage == 'ikgat':
    return '--size' if key == 'model.size' else f'--config.{key}'
  return f'--prior_config.{key}'


def _check_training_options(o: Options, w: Path, m: Manifest) -> None:
  """Refuses, in one line and before anything is written, a rerun that would not continue the
  trained runs as they were made: a lower --steps / --prior_steps than a run is trained to, or
  a config (--size, --config.*, --prior_config.*) that differs from the one train_rig.json
  records for a run that has trained (its step count apart: a higher one trains further)."""
  shards = w / 'shards'
  if not (shards / 'rig.json').is_file():  # nothing trained without shards
    return
  c, p = stage_configs(o, w, m, lambda msg: None, '')  # as the stages will
  was = []
  for stage, cfg, steps_flag in (('ikgat', c, '--steps'), ('prior', p, '--prior_steps')):
    step = train.trained_step(w / stage)
    if step is None:
      continue
    if step > cfg.train.steps:
      raise ValueError(f'{w / stage} is already trained to step {step}, more than '
                       f'{steps_flag}={cfg.train.steps}: rerun with {steps_flag}={step} or '
                       'more, or use a new --workdir')
    old = _flat(m.recorded_configs.get(stage) or {})
    new = _flat(json.loads(json.dumps(cfg.to_dict())))
    was += [f'{_option(stage, k)}={old[k]}' for k in sorted(set(old) & set(new))
            if k not in ('data', 'train.steps') and old[k] != new[k]]
  if was:
    more = f' (+{len(was) - 6} more)' if len(was) > 6 else ''
    raise ValueError(f'{w} was trained with {", ".join(was[:6])}{more}: rerun with that, or '
                     'use a new --workdir')


def run(o: Options, log: Log = _print) -> dict:
  """Runs (or continues) every stage for `o`; returns the manifest (WORKDIR/train_rig.json)."""
  w = Path(o.workdir)
  if not Path(o.bvh).exists():
    raise FileNotFoundError(f'--bvh {o.bvh} does not exist')
  if o.rig != 'auto' and (o.up, o.forward) != (None, None):
    raise ValueError(f'--up and --forward are for --rig=auto; the joint map {o.rig} names its '
                     'files\' axes itself ("up", "forward")')
  for flag, axis in (('--up', o.up), ('--forward', o.forward)):
    if axis is not None:
      try:
        retarget.parse_axis(axis)
      except (ValueError, KeyError) as e:
        raise ValueError(f'{flag}={axis}: {e}') from None
  if (o.up is None) != (o.forward is None):
    raise ValueError('--up and --forward go together (e.g. --up=z --forward=-y for files '
                     'exported from Blender)')
  if o.up is not None:
    retarget.world_rotation(o.up, o.forward, (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))  # checks them
  for flag, value in (('--steps', o.steps), ('--prior_steps', o.prior_steps)):
    if value is not None and value < 1:
      raise ValueError(f'{flag} must be a positive number of steps, got {value}')
  # Refused before the workdir is made: the files, the joint map, the rate, the units, the
  # split rule.
  conversion.find_bvh_files(o.bvh)
  if o.rig != 'auto':
    retarget.load_joint_map(o.rig)
  if not (isinstance(o.fps, (int, float)) and math.isfinite(o.fps) and o.fps > 0):
    raise ValueError(f'--fps must be a positive number, got {o.fps!r}')
  if not (isinstance(o.units, str) and o.units.strip().lower() == 'auto'):
    parse_units(o.units)
  if o.split.endswith('.json'):
    if not Path(o.split).is_file():
      raise FileNotFoundError(f'--split {o.split} does not exist')
  elif o.split not in SPLIT_RULES:
    raise ValueError(f'--split must be auto, subject, file or a split JSON, got {o.split!r}')
  if o.subject_regex is not None:
    try:
      re.compile(o.subject_regex)
    except re.error as e:
      raise ValueError(f'--subject_regex {o.subject_regex!r} is not a regular expression: '
                       f'{e}') from None
  for name in ('iters', 'eval_frames'):
    value = getattr(o, name)
    if value is not None and not (isinstance(value, int) and value >= 1):
      raise ValueError(f'--{name} must be a positive integer, got {value!r}')
  c, p = configs(o, w / 'shards')
  train.check_train_config(c.train, '--config.train')
  train.check_train_config(p.train, '--prior_config.train')
  w.mkdir(parents=True, exist_ok=True)
  shown = {k: v for k, v in dataclasses.asdict(o).items() if k not in ('config', 'prior_config')}
  m = Manifest(w, shown)
  stale = [s for s in STAGES if m.stages[s].get('status') == 'running']
  if stale:
    log(f'train_rig: {m.path} says {", ".join(stale)} {"was" if len(stale) == 1 else "were"} '
        'running when its last run stopped (killed?): resuming')
  try:
    files, key = _conversion(o, w, m)
    _check_training_options(o, w, m)
    return _run_stages(o, w, m, log, files, key)
  except BaseException as e:
    m.failed(e)
    raise


def _run_stages(o: Options, w: Path, m: Manifest, log: Log, files: list, key: dict) -> dict:
  tag = lambda i: f'[{i}/{len(STAGES)}]'  # noqa: E731
  t0 = time.perf_counter()
  summary = _convert(o, w, m, log, tag(1), files, key)
  c, p = stage_configs(o, w, m, log, tag(2))
  m.doc['configs'] = {'ikgat': c.to_dict(), 'prior': p.to_dict()}
  _train('ikgat', c, w / 'ikgat', m, log, tag(2))

  def prior_report():
    train_data = data.load_shards(p.data, 'train')
    model, _ = inference.load_model(w / 'prior', task=prior_task.PRIOR_TASK)
    val_split = 'val' if 'val' in data.available_splits(p.data) else 'train'
    report = prior_task.evaluate_prior(model, train_data, data.load_shards(p.data, val_split),
                                       train_data.rig, p)
    atomic.write_json(w / 'prior' / 'prior_report.json', report)
    r = report['val_reconstruction']
    log(f'{tag(3)} prior: {val_split} reconstruction {r["local_rot_err_deg"]:.2f} deg, '
        f'active latent dims {report["active_dims"]}/{report["latent"]}')

  if not p.get('prior_stats'):
    p.prior_stats = prior_task.standardization_config(
        data.load_shards(p.data, 'train'), vposer.VAEConfig.from_dict(p.model).bone_chart)
  _train('prior', p, w / 'prior', m, log, tag(3), task=prior_task.PRIOR_TASK,
         after=prior_report, extra_done=w / 'prior' / 'prior_report.json')
  results = _evaluate(o, w, m, log, tag(4))
  export = _export(o, w, m, summary, results, log, tag(5))
  skipped = [s for s in STAGES if m.stages[s].get('skipped')]
  log(f'train_rig: finished in {time.perf_counter() - t0:.1f} s'
      + (f' ({len(skipped)} of {len(STAGES)} stages already done)' if skipped else '')
      + f'; table {w / "eval" / "table.md"}, checkpoint {export}')
  m.set('export')  # final write (updated_utc)
  return m.doc


# ----------------------------------------------------------------------------------------------
# The absl main. Flags are defined only when this module runs as the main (not at import), so
# tests and other mains can import `run` without claiming --workdir, --steps, --config ...


def define_flags() -> None:
  s = flags.DEFINE_string
  s('bvh', None, 'A directory searched for *.bvh (or one BVH file) of your rig.')
  s('workdir', None, 'Where everything goes; rerun the same command to continue.')
  s('rig', 'auto', '"auto" (derived from the files), a joint-map JSON or a built-in name.')
  s('units', 'auto', 'Metres per file unit: auto (estimated for --rig=auto, the joint map\'s '
    'otherwise), a number, or m, cm, mm, in, ft, cmu.')
  s('up', None, 'With --rig=auto: the files\' up axis (x, y, z, -x, ...; default y), with '
    '--forward, e.g. --up=z --forward=-y for files exported from Blender.')
  s('forward', None, 'With --rig=auto: the axis the files\' bodies face at rest (default z).')
  flags.DEFINE_enum('reference_pose', None, ['zero', 'first_frame'], 'The source\'s natural '
                    '(T-)pose: its zero pose or frame 0 of the first file (bvh_to_shards).')
  s('split', 'auto', 'auto, subject, file (module docstring) or a split JSON.')
  s('subject_regex', None, 'Regex on the file name whose group "subject" (or 1) names the '
    'subject.')
  s('rig_name', 'auto', 'Name of a rig derived by --rig=auto.')
  flags.DEFINE_float('fps', 30.0, 'Frame rate of the shards.')
  flags.DEFINE_enum('size', 'small', ['tiny', 'small', 'base', 'large'], 'IK-GAT size.')
  flags.DEFINE_integer('steps', None, 'IK-GAT training steps (default: the config\'s, 5000).')
  flags.DEFINE_integer('prior_steps', None, 'Prior training steps (default: the config\'s, '
                       '3000).')
  s('export', None, 'Exported checkpoint directory (default WORKDIR/checkpoint).')
  flags.DEFINE_integer('eval_frames', None, 'Evaluate about this many frames (default all): '
                       'each file its share, rounded up (evaluation.select_frames).')
  flags.DEFINE_integer('iters', 100, 'Iterations per frame of the iterative solver.')
  s('acknowledgment', None, 'Your data\'s acknowledgment, for the card.')
  config_flags.DEFINE_config_file('config', str(CONFIG_DIR / 'robust.py'),
                                  'IK-GAT config (--config.train.lr=...).', lock_config=False)
  config_flags.DEFINE_config_file('prior_config', str(CONFIG_DIR / 'prior.py'),
                                  'Prior config (--prior_config.model.latent=...).',
                                  lock_config=False)


@fail_on_user_error
def main(argv):
  if len(argv) > 1:
    raise ValueError(f'unexpected arguments {" ".join(argv[1:])}; flags look like --bvh=DIR')
  F = flags.FLAGS
  for name in ('bvh', 'workdir'):
    if not F[name].value:
      raise ValueError(f'--{name} is required')
  o = Options(bvh=F.bvh, workdir=F.workdir, rig=F.rig, units=F.units, up=F.up,
              forward=F.forward,
              reference_pose=F.reference_pose, split=F.split, subject_regex=F.subject_regex,
              rig_name=F.rig_name, fps=F.fps, size=F['size'].value, steps=F.steps,
              prior_steps=F.prior_steps, export=F.export, eval_frames=F.eval_frames,
              iters=F.iters, acknowledgment=F.acknowledgment, config=F.config,
              prior_config=F.prior_config)
  try:
    with terminate_as_interrupt():
      run(o)
  except KeyboardInterrupt:
    exit_interrupted()


if __name__ == '__main__':
  run_main(main, define_flags)
