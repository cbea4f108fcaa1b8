"""Rerunning a training: a finished run is left as it is, a lower --steps than a run was trained
to, another config or other data is refused without a trace, a config that cannot train or
missing inputs are refused before anything is written, run.json is strict JSON, and the mains
run from any working directory."""

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from ik_gat_jax import checkpointing, inference, prior_task, train

REPO = Path(__file__).resolve().parents[1]


def _quiet(msg):
  del msg


def _snapshot(workdir: Path) -> dict:
  """Every file under `workdir`: its bytes' hash and modification time."""
  return {str(p.relative_to(workdir)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                        p.stat().st_mtime_ns)
          for p in sorted(workdir.rglob('*')) if p.is_file()}


def _strict_json(text: str):
  """json.loads as a strict parser (Node's JSON.parse): no Infinity or NaN."""
  def refuse(name):
    raise ValueError(f'not JSON: {name}')
  return json.loads(text, parse_constant=refuse)


@pytest.fixture
def finished(tiny_ikgat_run, tmp_path):
  """A copy of the session's tiny run, finished at step 20 (make_tiny_config's)."""
  return Path(shutil.copytree(tiny_ikgat_run, tmp_path / 'run'))


def test_rerig_check_counts_a_training_done_only_when_finished(finished, tmp_path):
  """experiments.rerig_check's queue: a training stage is done when its run finished at the
  steps asked (it was when `checkpoints/best` existed, a folder the trainer makes at step 0: a
  stopped training was skipped, and a half-trained model evaluated); a failed stage is one
  StageError naming its log (a RuntimeError traceback)."""
  from experiments import rerig_check
  steps = json.loads((finished / 'run.json').read_text())['step']
  assert rerig_check._trained(finished, steps) and not rerig_check._trained(finished, steps + 1)
  started = tmp_path / 'started'
  (started / 'checkpoints' / 'best').mkdir(parents=True)
  assert not rerig_check._trained(started, steps)
  ran = tmp_path / 'ran.txt'
  queue = [('skipped', functools.partial(rerig_check._trained, finished, steps),
            [sys.executable, '-c', 'raise SystemExit(9)']),
           ('train', functools.partial(rerig_check._trained, started, steps),
            [sys.executable, '-c', f'open({str(ran)!r}, "w").write("x")']),
           ('fails', tmp_path / 'nothing.json', [sys.executable, '-c', 'raise SystemExit(3)'])]
  with pytest.raises(rerig_check.StageError, match=r'^fails failed \(exit 3\); see .*fails.log$'):
    rerig_check.run_queue(tmp_path, queue)
  assert ran.read_text() == 'x' and not (tmp_path / 'skipped.log').exists()


def test_ablations_queue_counts_a_row_done_at_its_steps_and_refuses_unknown_rows(
    cmu_shards, finished, tmp_path):
  """experiments.ablations --mode=train: a row finished at --steps is skipped as done; --only
  naming no row is refused (it trained nothing, silently). (A row done at other steps resumes
  to these: it was skipped, its manifest saying it was trained with them.)"""
  root = tmp_path / 'abl'
  root.mkdir()
  shutil.move(finished, root / 'baseline_baseline_s0')
  steps = json.loads((root / 'baseline_baseline_s0' / 'run.json').read_text())['step']
  cmd = [sys.executable, '-m', 'experiments.ablations', f'--data={cmu_shards}', f'--root={root}',
         '--mode=train', f'--steps={steps}']
  p = subprocess.run(cmd + ['--only=baseline_baseline_s0'], cwd=REPO, capture_output=True,
                     text=True, timeout=120)
  assert p.returncode == 0 and p.stdout == '', p.stdout + p.stderr[-2000:]
  row = json.loads((root / 'manifest.json').read_text())['rows']['baseline_baseline_s0']
  assert row['status'] == 'done' and f'--steps={steps}' in row['command']
  p = subprocess.run(cmd + ['--only=baseline_baseline_s9,nosuch'], cwd=REPO,
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
      'error: --only names no row or table: baseline_baseline_s9, nosuch (--mode=list lists '
      'them)'), p.stderr[-2000:]


def test_rerun_of_a_finished_run_changes_nothing(cmu_shards, tiny_config, finished):
  before = _snapshot(finished)
  lines = []
  val = train.train_and_evaluate(tiny_config(cmu_shards), finished, log=lines.append)
  assert lines == [f'already done: {finished} is trained to step 20 (run.json); nothing to do']
  assert val == _strict_json((finished / 'run.json').read_text())['val']
  assert 'local_rot_err_deg' in val
  assert _snapshot(finished) == before


def test_fewer_steps_are_refused_and_the_run_still_finishes(cmu_shards, tiny_config, finished):
  """A lower --steps than the run was trained to is refused in one line, touching nothing; a
  workdir that an older version left after such a rerun (run.json 'running' for the lower
  steps, latest at 20) finishes with the original command, without training or an error."""
  before = _snapshot(finished)
  with pytest.raises(ValueError, match=r'already trained to step 20, more than --steps=10 '
                     r'\(train.steps\): rerun with --steps=20 or more'):
    train.train_and_evaluate(tiny_config(cmu_shards, train=dict(steps=10)), finished, log=_quiet)
  assert _snapshot(finished) == before
  run = json.loads((finished / 'run.json').read_text())
  run.update(status='running', steps=10)
  (finished / 'run.json').write_text(json.dumps(run))
  lines = []
  train.train_and_evaluate(tiny_config(cmu_shards), finished, log=lines.append)
  assert not any(m.startswith('step ') for m in lines), lines
  run = _strict_json((finished / 'run.json').read_text())
  assert (run['status'], run['step'], run['steps']) == ('done', 20, 20)
  assert 'local_rot_err_deg' in run['val'] and run['best_value'] is not None
  latest = checkpointing.Checkpointer(finished / 'checkpoints' / 'latest', create=False)
  assert latest.all_steps() == [20]


@pytest.mark.parametrize('field, value, what', [
    ('steps', 0, 'a positive integer'), ('steps', -5, 'a positive integer'),
    ('batch_size', 0, 'a positive integer'), ('lr', -1e-3, 'a positive number'),
    ('lr', 0.0, 'a positive number'), ('warmup_steps', -1, 'an integer >= 0'),
    ('checkpoint_every', 0, 'a positive integer'), ('weight_decay', -0.1, 'a number >= 0')])
def test_configs_that_cannot_train_are_refused_before_anything_is_written(
    cmu_shards, tiny_config, tmp_path, field, value, what):
  c = tiny_config(cmu_shards, train={field: value})
  with pytest.raises(ValueError, match=rf'^train\.{field} must be {what}, got {value}$'):
    train.train_and_evaluate(c, tmp_path / 'w', log=_quiet)
  assert not (tmp_path / 'w').exists()


def test_resume_with_another_config_or_other_data_is_refused(cmu_shards, tiny_config, finished,
                                                           train_only_shards):
  """A rerun that would go on training the run under another recipe is refused in one line
  naming the keys with both values, touching nothing, also with a higher --steps: another
  learning rate, batch size, seed or augmentation, or other shards (also at the steps it
  finished at: not "already done")."""
  before = _snapshot(finished)

  def config(**changes):
    c = tiny_config(cmu_shards, train=dict(steps=30))
    for key, value in changes.items():
      section, _, field = key.rpartition('.')
      (c[section] if section else c)[field] = value
    return c

  cases = [
      (config(**{'train.lr': 2e-3}), r'was trained with --config\.train\.lr=0\.001 \(this config '
       r'0\.002\): rerun its command \(run\.json: .*\) to resume it, or use a new '
       r'--workdir$'),
      (config(**{'train.batch_size': 64}), r'--config\.train\.batch_size=32 \(this config 64\)'),
      (config(seed=1, **{'augment.mirror': 0.0}),
       r'--config\.augment\.mirror=0\.5 \(this config 0\.0\), --config\.seed=0 \(this config 1\)'),
      (tiny_config(train_only_shards, train=dict(steps=30)),
       rf'^{re.escape(str(finished))} was trained on other data \({re.escape(str(cmu_shards))}; '
       r'its (split, )?frames differ from '),
      # finished at these steps: other data is not "already done" either
      (tiny_config(train_only_shards),
       rf'^{re.escape(str(finished))} was trained on other data \({re.escape(str(cmu_shards))}; '
       r'its (split, )?frames differ from '),
  ]
  for c, message in cases:
    with pytest.raises(ValueError, match=message) as e:
      train.train_and_evaluate(c, finished, log=_quiet)
    assert '\n' not in str(e.value)
    assert _snapshot(finished) == before


def test_a_prior_run_refuses_another_config_too(tiny_prior_run, tmp_path):
  """The pose prior's trainer is the same: its run, rerun with another learning rate (and more
  steps), is refused in one line, touching nothing; with its own config it is done."""
  run = Path(shutil.copytree(tiny_prior_run, tmp_path / 'prior'))
  c = ml_collections.ConfigDict(json.loads((run / 'config.json').read_text()))
  before = _snapshot(run)
  lines = []
  train.train_and_evaluate(c, run, task=prior_task.PRIOR_TASK, log=lines.append)
  assert len(lines) == 1 and lines[0].startswith('already done'), lines
  c.train.update(steps=30, lr=c.train.lr * 2)
  with pytest.raises(ValueError, match=rf'^{re.escape(str(run))} was trained with '
                     r'--config\.train\.lr=\S+ \(this config \S+\): rerun its command \(run\.json'):
    train.train_and_evaluate(c, run, task=prior_task.PRIOR_TASK, log=_quiet)
  assert _snapshot(run) == before


def test_what_a_resume_may_change():
  """`train.training_config_diff`: --steps, the intervals, prefetch, eval batch size, the moving
  average and the data's path may change; any other key is named; a key an older config lacks
  counts as off."""
  from experiments.configs import test as test_config
  old = test_config.get_config().to_dict()
  new = test_config.get_config()
  new.data = '/elsewhere'
  new.train.update(steps=40, log_every=1, eval_every=7, checkpoint_every=3, prefetch=4,
                   eval_batch_size=64, ema_decay=0.9)
  assert train.training_config_diff(old, new.to_dict()) == []
  new.train.update(lr=1.0, warmup_steps=0)
  new.loss.alpha = 0.5
  new.model.hidden = 7  # the model is `model_config_diff`'s (a CheckpointError)
  assert train.training_config_diff(old, new.to_dict()) == ['loss.alpha', 'train.lr',
                                                            'train.warmup_steps']
  del old['augment']['end_site_prob']  # a field added after the run was made
  assert train.training_config_diff(old, test_config.get_config().to_dict()) == []
  new = test_config.get_config()
  new.augment.end_site_prob = 0.5
  assert train.training_config_diff(old, new.to_dict()) == ['augment.end_site_prob']


def test_missing_data_init_from_or_teacher_is_refused_without_making_the_workdir(
    cmu_shards, tiny_config, tmp_path):
  nope = str(tmp_path / 'nope')
  cases = [(tiny_config(nope), FileNotFoundError, 'does not exist'),
           (tiny_config(cmu_shards, train=dict(init_from=nope)), checkpointing.CheckpointError,
            'no checkpoint'),
           (tiny_config(cmu_shards, train=dict(distill_from=nope)), checkpointing.CheckpointError,
            'no checkpoint')]
  # Mirror augmentation on a rig that is not mirror-symmetric: refused here too, not at the
  # first traced step after run.json said "running".
  crumpled = tmp_path / 'crumpled'
  shutil.copytree(cmu_shards, crumpled)
  rig = json.loads((crumpled / 'rig.json').read_text())
  left = rig['joint_names'].index('LeftUpLeg')
  rig['template_offsets'][left] = [-v for v in rig['template_offsets'][left]]
  (crumpled / 'rig.json').write_text(json.dumps(rig))
  mirrored = tiny_config(str(crumpled))
  mirrored.augment.mirror = 0.5
  cases.append((mirrored, ValueError, 'augment.mirror: .* is not mirror-symmetric'))
  for c, error, message in cases:
    with pytest.raises(error, match=message):
      train.train_and_evaluate(c, tmp_path / 'w', log=_quiet)
    assert not (tmp_path / 'w').exists()


@pytest.fixture(scope='module')
def train_only_shards(cmu_dir, tmp_path_factory):
  """09_03 (a short file) as the only split, 'train': no validation."""
  from data_prep import conversion
  out = tmp_path_factory.mktemp('train_only')
  conversion.convert(cmu_dir / '09_03.bvh', 'cmu_body', out, split='train', log=_quiet)
  return out


def _emptied(shards: Path, out: Path, split: str) -> Path:
  """A copy of `shards` whose `split` holds 0 frames (its arrays cut to no rows), as a shard
  directory made by hand or by another tool can be (data_prep refuses files without frames)."""
  shutil.copytree(shards, out)
  for f in (out / split).glob('*.npy'):
    np.save(f, np.load(f)[:0])
  summary = json.loads((out / 'summary.json').read_text())
  summary['frames'][split] = 0
  (out / 'summary.json').write_text(json.dumps(summary))
  return out


def test_an_empty_val_split_trains_without_validation_and_a_small_one_says_so(
    cmu_shards, tiny_config, tmp_path):
  """A val split of 0 frames: one line, then a run without validation (the old trainer failed
  at the first validation, run.json left 'running'); a train split smaller than one batch (116
  frames, batch 128): one line; a train split of 0 frames: refused, nothing written. The prior's
  report measures the train split when val has no frames (`train_prior.report_split`)."""
  shards = _emptied(cmu_shards, tmp_path / 'shards', 'val')
  c = tiny_config(shards, train=dict(steps=2, batch_size=128, log_every=1, eval_every=1,
                                     checkpoint_every=1))
  lines = []
  assert train.train_and_evaluate(c, tmp_path / 'w', log=lines.append) == {}
  assert lines[:2] == [
      f'the val split of {shards} has 0 frames: training without validation (the best '
      'checkpoint is the last)',
      f'the train split of {shards} has 116 frames, fewer than a batch of 128: every batch '
      'repeats frames']
  run = _strict_json((tmp_path / 'w' / 'run.json').read_text())
  assert (run['status'], run['step'], run['val']) == ('done', 2, {})
  inference.load_model(tmp_path / 'w')
  no_train = _emptied(cmu_shards, tmp_path / 'no_train', 'train')
  with pytest.raises(ValueError, match=rf'^the train split of {re.escape(str(no_train))} has 0 '
                     r'frames: nothing to train on$'):
    train.train_and_evaluate(tiny_config(no_train), tmp_path / 'x', log=_quiet)
  assert not (tmp_path / 'x').exists()
  from experiments import train_prior  # pylint: disable=import-outside-toplevel
  from ik_gat_jax.data import load_shards  # pylint: disable=import-outside-toplevel
  train_set = load_shards(shards, 'train')
  assert train_prior.report_split(str(shards), train_set) is train_set
  assert train_prior.report_split(str(cmu_shards), train_set).split == 'val'


def test_run_json_is_strict_json_without_a_val_split(train_only_shards, tiny_config, tmp_path):
  """No validation: best_value is null (not Infinity, which strict parsers refuse), read back as
  None, also from a run.json an older version wrote with Infinity; the rerun is a no-op."""
  c = tiny_config(train_only_shards, train=dict(steps=2, log_every=1, eval_every=100,
                                                checkpoint_every=100))
  workdir = tmp_path / 'w'
  assert train.train_and_evaluate(c, workdir, log=_quiet) == {}
  run = _strict_json((workdir / 'run.json').read_text())
  assert run['status'] == 'done' and run['best_value'] is None and run['val'] == {}
  assert train.read_run(workdir)['best_value'] is None
  inference.load_model(workdir)  # the best checkpoint of a run without validation
  lines = []
  assert train.train_and_evaluate(c, workdir, log=lines.append) == {}
  assert len(lines) == 1 and lines[0].startswith('already done'), lines
  (workdir / 'run.json').write_text(json.dumps({**run, 'best_value': float('inf')}))
  assert 'Infinity' in (workdir / 'run.json').read_text()
  assert train.read_run(workdir)['best_value'] is None


def test_mains_run_from_any_directory_and_answer_reruns_in_one_line(cmu_shards, finished,
                                                                    tmp_path):
  """From another working directory (the default --config resolves beside the package):
  --steps=-5 and --steps=0 are refused in one line with status 2 and nothing written; a
  finished run rerun says so in one line and exits 0; a lower --steps, another learning rate,
  a mistyped --config.* key (train and train_prior), a missing config file (with an override
  or not) and missing data are refused in one line, status 2, leaving no folder and the runs
  as they were."""
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  lower = Path(shutil.copytree(finished, tmp_path / 'lower'))
  test_config = f'--config={REPO / "experiments" / "configs" / "test.py"}'
  data = f'--data={cmu_shards}'
  runs = {
      'negative': (['experiments.train', data, f'--workdir={tmp_path / "a"}', '--steps=-5'],
                   2, 'error: --steps must be a positive number of steps, got -5'),
      'prior_zero': (['experiments.train_prior', data, f'--workdir={tmp_path / "b"}',
                      '--steps=0'], 2, 'error: --steps must be a positive number of steps, got 0'),
      'done': (['experiments.train', data, f'--workdir={finished}', test_config], 0,
               f'already done: {finished} is trained to step 20 (run.json); nothing to do'),
      'lower': (['experiments.train', data, f'--workdir={lower}', test_config, '--steps=10'], 2,
                f'error: {lower} is already trained to step 20, more than --steps=10'),
      'other_lr': (['experiments.train', data, f'--workdir={lower}', test_config,
                    '--config.train.lr=0.005'], 2,
                   f'error: {lower} was trained with --config.train.lr=0.001 (this config 0.005)'),
      'typo': (['experiments.train', data, f'--workdir={tmp_path / "c"}',
                '--config.train.lrr=1'], 2, 'error: --config.train.lrr: the config has no field '
               'train.lrr (did you mean --config.train.lr?)'),
      'prior_typo': (['experiments.train_prior', data, f'--workdir={tmp_path / "d"}',
                      '--config.model.latentt=4'], 2, 'error: --config.model.latentt: the config '
                     'has no field model.latentt (did you mean --config.model.latent?)'),
      'no_config': (['experiments.train', data, f'--workdir={tmp_path / "f"}',
                     f'--config={tmp_path / "none.py"}'], 2,
                    f'error: --config={tmp_path / "none.py"}: no such config file'),
      'no_config_override': (['experiments.train_prior', data, f'--workdir={tmp_path / "g"}',
                              '--config=none.py', '--config.train.lr=1'], 2,
                             'error: --config=none.py: no such config file'),
      'json_config': (['experiments.train', data, f'--workdir={tmp_path / "h"}',
                       f'--config={tmp_path / "c.json"}'], 2,
                      f'error: --config={tmp_path / "c.json"}: cannot read it (NameError: name '
                      "'true' is not defined; a config file is Python"),
      'bad_beside_override': (['experiments.train', data, f'--workdir={tmp_path / "i"}',
                               test_config, '--steps=abc', '--config.train.lr=1e-3'], 1,
                              'FATAL Flags parsing error: flag --steps=abc: invalid literal'),
      'no_data': (['experiments.train', f'--data={tmp_path / "none"}',
                   f'--workdir={tmp_path / "e" / "run"}'], 2,
                  f'error: shard directory {tmp_path / "none"} does not exist'),
  }
  (tmp_path / 'c.json').write_text('{"train": {"lr": 0.001, "ema": true}}')  # a record
  env = {**os.environ, 'PYTHONUNBUFFERED': '1'}
  before = {'done': _snapshot(finished), 'lower': _snapshot(lower)}
  procs = {k: subprocess.Popen([sys.executable, '-m', *args], cwd=elsewhere, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
           for k, (args, _, _) in runs.items()}
  first = {}
  for k, p in procs.items():
    try:
      out, err = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
      p.kill()
      pytest.fail(f'{k}: no answer within 240 s')
    _, rc, line = runs[k]
    assert p.returncode == rc, (k, out[-2000:], err[-2000:])
    said = [x for x in (out if rc == 0 else err).splitlines() if x.strip()]
    assert len(said) == (2 if rc == 1 else 1) and said[0].startswith(line), (k, said)
    first[k] = said[0]
  # A refused rerun names what resumes the run: the command run.json records (it named
  # config.json, which --config cannot read).
  assert 'rerun its command (run.json: ' in first['other_lr'], first
  assert sorted(p.name for p in tmp_path.iterdir()) == ['c.json', 'elsewhere', 'lower', 'run']
  assert _snapshot(finished) == before['done'] and _snapshot(lower) == before['lower']


def test_other_data_in_the_same_folder_is_named_so(tmp_path):
  """The shards at the run's own --data changed (files added): the refusal says so, not
  'rerun with that --data' naming the folder just given."""
  saved = {'data': {'data_dir': str(tmp_path / 'shards'), 'frames': 100}}
  with pytest.raises(ValueError, match=r'its frames differ from .*shards.s\): the shards there '
                     r'have changed since \(files added or converted again\)'):
    train._check_same_data(tmp_path / 'run', saved,
                           {'data_dir': str(tmp_path / 'shards'), 'frames': 120})
  with pytest.raises(ValueError, match=r'rerun with that --data to resume it'):
    train._check_same_data(tmp_path / 'run', saved,
                           {'data_dir': str(tmp_path / 'other'), 'frames': 120})


def test_values_that_mean_nothing_are_refused_before_anything_is_written(cmu_shards, tiny_config,
                                                                          tmp_path):
  """A probability outside [0, 1] (`--config.augment.mirror=1.5`), a negative noise level or a
  final learning-rate fraction above 1 is refused in one line, the workdir not made (they were
  accepted)."""
  for section, key, value, match in (
      ('augment', 'mirror', 1.5, r'config\.augment\.mirror must be a probability in \[0, 1\]'),
      ('augment', 'outlier_prob', -0.1, r'config\.augment\.outlier_prob must be a probability'),
      ('augment', 'noise_mm_max', -5.0, r'config\.augment\.noise_mm_max must be a number >= 0'),
      ('train', 'final_lr_fraction', 2.0, r'train\.final_lr_fraction must be a fraction of the '
                                          r'learning rate in \[0, 1\]'),
      ('train', 'val_frames', -5, r'train\.val_frames must be an integer >= 0, got -5')):
    c = tiny_config(cmu_shards)
    c[section][key] = value
    with pytest.raises(ValueError, match=match):
      train.train_and_evaluate(c, tmp_path / 'w', log=_quiet)
    assert not (tmp_path / 'w').exists()


def test_a_damaged_prior_report_is_written_again(tmp_path):
  """train_prior reran on a finished run keeps its report only where it is JSON (a truncated
  one was kept, and the run said 'already done')."""
  from experiments import train_prior  # pylint: disable=import-outside-toplevel
  (tmp_path / 'ok.json').write_text('{"active_dims": 3}')
  (tmp_path / 'cut.json').write_text('{"active_di')
  assert train_prior._readable(tmp_path / 'ok.json')
  assert not train_prior._readable(tmp_path / 'cut.json')
  assert not train_prior._readable(tmp_path / 'missing.json')


def test_a_run_extended_by_another_command_records_both(monkeypatch):
  """A run trained to 20 steps, then extended to 40 by another --steps: run.json and the
  checkpoints keep both commands (the last alone, which the card gave, does not reproduce the
  checkpoint: its learning rate decayed over 20 steps first), and the card lists them; a plain
  resume by the same command adds nothing."""
  from experiments import export_checkpoint
  from ik_gat_jax import provenance
  first = 'python -m experiments.train --data=D --workdir=W --steps=20'
  then = 'python -m experiments.train --data=D --workdir=W --steps=40'
  monkeypatch.setattr(provenance, 'command_line', lambda: first)
  assert train.command_history(None, 0, 20) == [{'command': first, 'from_step': 0, 'steps': 20}]
  monkeypatch.setattr(provenance, 'command_line', lambda: then)
  old_run = {'command': first, 'steps': 20, 'step': 20}  # a run.json from before the history
  history = train.command_history(old_run, 20, 40)
  assert history == [{'command': first, 'from_step': 0, 'steps': 20},
                     {'command': then, 'from_step': 20, 'steps': 40}]
  assert train.command_history({**old_run, 'history': history}, 31, 40) == history
  lines = export_checkpoint._training_commands({'command': then, 'history': history})
  assert lines[-2:] == [f'- steps 0-20: `{first}`', f'- steps 20-40: `{then}`'], lines
  # The line an export's card is recognised by (a re-export to it replaces it) stays.
  assert lines[0].startswith(f'Training command: `{then}`, the last of these'), lines
  assert export_checkpoint._training_commands({'command': then, 'history': history[:1]}) == [
      f'Training command: `{then}`']


def test_a_diverged_run_is_one_line_and_recorded_failed(cmu_shards, tiny_config, tmp_path):
  """A loss that became NaN: a one-line error (TrainingDiverged, a ValueError the mains print
  as `error: ...`; it was a FloatingPointError traceback), run.json 'failed' with the reason
  (it said 'running' for good), and log.jsonl strict JSON (it held bare NaN)."""
  c = tiny_config(cmu_shards, train=dict(steps=4, log_every=2, eval_every=100,
                                         checkpoint_every=100, lr=1e30, warmup_steps=0))
  with pytest.raises(train.TrainingDiverged, match=r'^loss became nan at step 2: the run '
                     r'diverged .*its last checkpoint \(none\) stands'):
    train.train_and_evaluate(c, tmp_path / 'run', log=lambda m: None)
  run = json.loads((tmp_path / 'run' / 'run.json').read_text())
  assert run['status'] == 'failed' and run['reason'] == 'loss became nan at step 2'
  rows = [_strict_json(x) for x in (tmp_path / 'run' / 'log.jsonl').read_text().splitlines()]
  assert rows and rows[-1]['loss'] is None


def test_a_workdir_being_trained_refuses_a_second_training(cmu_shards, tiny_config, tmp_path):
  """Two trainings of one workdir (a second terminal, a scheduler's requeue) ran side by side,
  deleting each other's checkpoints, one's log lost, both exit 0: the second is refused,
  naming the first; once the first is done (or dead: the kernel drops its lock) it may run."""
  c = tiny_config(cmu_shards, train=dict(steps=4, log_every=2, eval_every=2,
                                         checkpoint_every=100))
  run = tmp_path / 'run'
  said = []

  def second_training(msg):
    if msg.startswith('step 2/') and not said:
      with pytest.raises(ValueError, match=rf'^{re.escape(str(run))} is being trained by '
                         rf'process {os.getpid()} on .* since .*: wait for it or stop it'):
        train.train_and_evaluate(c, run, log=said.append)
      said.append('refused')

  train.train_and_evaluate(c, run, log=second_training)
  assert said == ['refused'] and json.loads((run / 'run.json').read_text())['status'] == 'done'
  c.train.steps = 6
  train.train_and_evaluate(c, run, log=lambda m: None)  # the first done: the lock is free
  assert json.loads((run / 'run.json').read_text())['step'] == 6


def test_a_run_stopped_before_its_first_checkpoint_or_validation(cmu_shards, tiny_config,
                                                                 tmp_path):
  """Killed after a validation (best saved) but before its first `latest`: the same command
  trains it again from step 0 (it was refused for good, blaming a deletion). Stopped before its
  first validation: loading it says so and how to go on (it said 'deleted?' and that a rerun
  'saves that step as the best')."""
  from ik_gat_jax import inference
  c = tiny_config(cmu_shards, train=dict(steps=4, log_every=1, eval_every=2,
                                         checkpoint_every=100))

  def killed_at_3(msg):
    if msg.startswith('step 3/'):
      raise RuntimeError('killed')

  with pytest.raises(RuntimeError, match='killed'):
    train.train_and_evaluate(c, tmp_path / 'killed', log=killed_at_3)
  assert train.trained_step(tmp_path / 'killed') is None
  lines = []
  train.train_and_evaluate(c, tmp_path / 'killed', log=lines.append)
  assert any('stopped before its first checkpoint' in m for m in lines), lines
  assert json.loads((tmp_path / 'killed' / 'run.json').read_text())['status'] == 'done'
  late = tiny_config(cmu_shards, train=dict(steps=4, log_every=1, eval_every=100,
                                            checkpoint_every=100))

  def _stop_at_1(msg):  # Ctrl-C: the trainer saves `latest` at step 1
    if msg.startswith('step 1/'):
      raise KeyboardInterrupt
  with pytest.raises(KeyboardInterrupt):
    train.train_and_evaluate(late, tmp_path / 'early', log=_stop_at_1)
  with pytest.raises(checkpointing.CheckpointError, match=r'best yet: the run stopped at step 1 '
                     r'of 4, before its first validation'):
    inference.load_model(tmp_path / 'early')
