"""experiments.train_rig: one command for a user's own rig, end to end on three short CMU files
through --rig=auto (convert, IK-GAT, prior, evaluation, export), its resume, and solving one of
the rig's clips with the exported checkpoint."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import export_checkpoint, train_rig
from ik_gat_jax import absl_main, data, inference
from ik_gat_jax.io import bvh
from ik_gat_jax.skeleton import depth_first_order

REPO = Path(__file__).resolve().parents[1]
FILES = ('07_12', '08_10', '09_03')  # short files of three subjects


def _tiny_options(bvh_dir, workdir):
  """experiments/configs/test.py for IK-GAT (tiny, batch 32) and a small prior, 20 steps each."""
  from experiments.configs import prior as prior_config
  from experiments.configs import test as test_config
  p = prior_config.get_config()
  p.model.update(latent=8, hidden=64)
  p.train.update(batch_size=32, warmup_steps=5, log_every=10, eval_every=10,
                 checkpoint_every=10, val_frames=128, eval_batch_size=128)
  return train_rig.Options(bvh=str(bvh_dir), workdir=str(workdir), size='tiny', steps=20,
                           prior_steps=20, iters=20, config=test_config.get_config(),
                           prior_config=p, acknowledgment=export_checkpoint.ACK)


@pytest.fixture(scope='module')
def rig_run(cmu_dir, tmp_path_factory):
  root = tmp_path_factory.mktemp('train_rig')
  bvh_dir = root / 'bvh'
  bvh_dir.mkdir()
  for name in FILES:
    (bvh_dir / f'{name}.bvh').symlink_to(cmu_dir / f'{name}.bvh')
  lines = []
  options = _tiny_options(bvh_dir, root / 'work')
  manifest = train_rig.run(options, log=lines.append)
  return options, manifest, lines


def test_derive_split_rules():
  sha = lambda f: f'{abs(hash(f)) % 10**8:08d}'  # noqa: E731
  # Three subjects: whole subjects held out, sorted by name.
  files = [(f'{s}_{k:02d}.bvh', sha(f'{s}{k}')) for s in ('b', 'a', 'c') for k in (1, 2)]
  doc = train_rig.derive_split(files)
  where = {e['file']: (e['split'], e.get('part')) for e in doc['files']}
  assert doc['name'] == 'train_rig_subject'
  assert where['a_01.bvh'] == where['a_02.bvh'] == ('test', 'unseen_subject')
  assert where['b_01.bvh'] == ('val', None) and where['c_02.bvh'] == ('train', None)
  assert train_rig.derive_split(files[::-1]) == doc  # a function of the names only
  # Twelve subjects: the 1st and 11th test, the 2nd and 12th val.
  many = [(f's{k:02d}_01.bvh', sha(k)) for k in range(12)]
  splits = [e['split'] for e in train_rig.derive_split(many)['files']]
  assert splits == ['test', 'val'] + ['train'] * 8 + ['test', 'val']
  # Fewer than three subjects: by file; one file trains only, two give test + train.
  one_subject = [(f'walk_{k:02d}.bvh', sha(k)) for k in range(12)]
  splits = [e['split'] for e in train_rig.derive_split(one_subject)['files']]
  assert splits == ['test', 'val'] + ['train'] * 8 + ['test', 'val']
  assert [e['split'] for e in train_rig.derive_split(one_subject[:2])['files']] == ['test',
                                                                                 'train']
  assert [e['split'] for e in train_rig.derive_split(one_subject[:1])['files']] == ['train']
  with pytest.raises(ValueError, match='3 or more subjects'):
    train_rig.derive_split(one_subject, 'subject')
  with pytest.raises(ValueError, match='--split must be'):
    train_rig.derive_split(one_subject, 'random')


def test_every_stage_writes_sane_outputs(rig_run):
  options, manifest, lines = rig_run
  w = Path(options.workdir)
  assert all(manifest['stages'][s]['status'] == 'done' for s in train_rig.STAGES)
  assert json.loads((w / 'train_rig.json').read_text())['stages'] == manifest['stages']
  for i, stage in enumerate(train_rig.STAGES, 1):  # progress: a start and a finish line each
    mine = [ln for ln in lines if ln.startswith(f'[{i}/5] {stage}:')]
    assert len(mine) >= 2 and 'done in' in mine[-1], mine
  # 1: shards from the derived split (07 test, 08 val, 09 train).
  summary = json.loads((w / 'shards' / 'summary.json').read_text())
  assert summary['rig'] == 'auto' and summary['total_files'] == 3
  assert summary['runs'][-1]['units_m'] == pytest.approx(0.056444)  # --units=auto: cmu
  split = {e['file']: e['split'] for e in json.loads((w / 'split.json').read_text())['files']}
  assert split == {'07_12.bvh': 'test', '08_10.bvh': 'val', '09_03.bvh': 'train'}
  # 2, 3: finished runs; the prior's report.
  for run in ('ikgat', 'prior'):
    doc = json.loads((w / run / 'run.json').read_text())
    assert doc['status'] == 'done' and doc['step'] == 20
  report = json.loads((w / 'prior' / 'prior_report.json').read_text())
  assert math.isfinite(report['val_reconstruction']['local_rot_err_deg'])
  # 4: every method on the test split; swing-only IK's floor finite and exact in positions.
  results = {m: json.loads((w / 'eval' / f'{m}.json').read_text()) for m in train_rig.EVAL_METHODS}
  for m, r in results.items():
    assert r['split'] == 'test' and r['frames'] == 66, m
    assert math.isfinite(r['local_rot_err_deg']), m
  assert 0 < results['swing']['local_rot_err_deg'] < 45
  assert results['swing']['mpjpe_mm'] < 1.0
  assert results['iterative']['settings']['prior'] == str(w / 'prior')
  assert results['ikgat_calibrated']['subject_calibration']
  assert not results['ikgat']['subject_calibration']
  for m in train_rig.EVAL_METHODS:  # the noisy rows: the same method, the noise as named
    method, noise = train_rig.eval_row(m)
    assert results[m]['noise_mm'] == noise and results[m]['method'] == (
        'ikgat' if m == 'ikgat_calibrated' else method), m
  assert {m for m in results if results[m]['noise_mm'] > 0} == {
      'ikgat_10mm', 'iterative_10mm', 'ikgat_20mm', 'iterative_20mm'}
  for m in ('ikgat', 'iterative'):  # the noise reached the input (20 steps: no accuracy yet)
    assert results[f'{m}_20mm']['local_rot_err_deg'] != results[m]['local_rot_err_deg'], m
  table = (w / 'eval' / 'table.md').read_text()
  assert all(f'| {m} | 66 |' in table for m in train_rig.EVAL_METHODS), table
  assert table.startswith('auto: test split, 66 frames, 1 files (07_12.bvh)'), table
  ds = data.load_shards(w / 'shards', 'test')  # --eval_frames=30: the header says so
  part = train_rig.results_table({m: dict(r, frames=30) for m, r in results.items()}, ds)
  assert part.startswith('auto: test split, 30 of its 66 frames evaluated, 1 files'), part
  # 5: the exported checkpoint loads, its card has the metrics, data provenance and solve line.
  export = w / 'checkpoint'
  model, meta = inference.load_model(export)
  assert meta['rig']['name'] == 'auto' and len(meta['rig']['joint_names']) == 27
  card = (export / 'README.md').read_text()
  for text in ('## Test split', "## This rig's evaluation", '| 07_12.bvh | 07 | test | 66 |',
               '--units=0.056444', 'mocap.cs.cmu.edu', 'whole subjects held out',
               '| ikgat_calibrated | 66 |', '`--subject_calibration`', '`--fit_offsets`'):
    assert text in card, text
  assert json.loads((export / 'test_metrics.json').read_text())['method'] == 'ikgat'


def test_rerun_skips_every_finished_stage(rig_run):
  options, _, _ = rig_run
  lines = []
  manifest = train_rig.run(options, log=lines.append)
  for i, stage in enumerate(train_rig.STAGES, 1):
    assert any(ln.startswith(f'[{i}/5] {stage}: already done') and ln.endswith('skipped')
               for ln in lines), lines
    assert manifest['stages'][stage]['skipped'] is True
  assert not any('training' in ln for ln in lines)
  assert '(5 of 5 stages already done)' in lines[-1]


def test_units_that_name_what_auto_found_are_the_same_conversion(rig_run):
  """A run converted with --units=auto (here the joint map's CMU units) goes on when rerun with
  the units that resolved to (by name or number): every stage skipped, the conversion's record
  unchanged; other units are refused naming the conversion's."""
  options, _, _ = rig_run
  record = Path(options.workdir) / train_rig.MANIFEST
  convert = lambda: json.loads(record.read_text())['stages']['convert']['key']  # noqa: E731
  before = convert()
  assert before['units'] == 'auto'
  for units in ('cmu', '0.056444'):
    lines = []
    train_rig.run(dataclasses.replace(options, units=units), log=lines.append)
    assert '(5 of 5 stages already done)' in lines[-1], (units, lines)
    assert convert() == before, units
  with pytest.raises(ValueError, match=r'was converted with --units=auto: rerun with that'):
    train_rig.run(dataclasses.replace(options, units='cm'), log=lambda m: None)


def test_other_files_in_the_same_workdir_are_refused(rig_run, tmp_path):
  options, _, _ = rig_run
  (tmp_path / '07_12.bvh').symlink_to(Path(options.bvh) / '07_12.bvh')
  other = train_rig.Options(bvh=str(tmp_path), workdir=options.workdir)
  with pytest.raises(ValueError, match='converted from other files .*2 missing'):
    train_rig.run(other, log=lambda m: None)


def test_solve_writes_the_rigs_bvh(rig_run, tmp_path):
  """`ik_gat_jax.solve --checkpoint=EXPORT --units=...` (the card's command) on one of the rig's
  clips writes a BVH in the rig's own joint names (its source names), rotation orders and
  units (issue L), and its hierarchy: the joints the rig removed for their constant rotations
  written back between the same joints (session 43)."""
  from ik_gat_jax.solve import solve_file
  options, manifest, _ = rig_run
  export = Path(options.workdir) / 'checkpoint'
  command = manifest['stages']['export']['solve_command']
  units = command.split('--units=')[1].split()[0]
  source = Path(options.bvh) / '09_03.bvh'
  out = tmp_path / 'solved.bvh'
  summary = solve_file(source, out, checkpoint=str(export), units=units, log=lambda m: None)
  _, meta = inference.load_model(export)
  rig_names, parents = meta['rig']['joint_names'], meta['rig']['parents']
  solved, original = bvh.read_bvh(out), bvh.read_bvh(source)
  assert set(rig_names) < set(solved.names) <= set(original.names)  # the source's names
  rig_order = [n for n in solved.names if n in rig_names]
  assert rig_order == [rig_names[j] for j in depth_first_order(parents)]
  index = {n: i for i, n in enumerate(original.names)}
  for i, n in enumerate(solved.names[1:], 1):  # the source's parents, removed joints back
    assert solved.names[solved.parents[i]] == original.names[original.parents[index[n]]], n
  assert solved.num_frames == original.num_frames == summary['frames']
  assert solved.frame_time == pytest.approx(original.frame_time, rel=1e-5)
  for joint in solved.joints[1:]:  # the source's rotation orders
    assert joint.channels == original.joints[index[joint.name]].channels, joint.name
  # Root translation in the source's own units (the BVH text keeps 4 decimals: 1e-3).
  np.testing.assert_allclose(solved.motion[:, :3], original.motion[:, :3], atol=1e-3)


def test_z_up_clips_solve_with_the_cards_input_axes(rig_run, tmp_path, z_up_copy):
  """Files exported z-up facing -y (Blender's world) and converted with --up=z --forward=-y
  give this rig (tests/conversion_test.py), and the card's command then adds the axes:
  `--input_axes=x,z,-y`. With it, a z-up copy of a clip solves to the clip's own rotations and
  joints: within float32 round-off of the inputs (the copy's text rounds its conjugated angles
  to 6 decimals, 1e-8 rad) through the network, 2e-5 (measured 4e-7; `pytest -s`)."""
  from ik_gat_jax.solve import solve_file
  options, manifest, _ = rig_run
  export = Path(options.workdir) / 'checkpoint'
  summary = json.loads((Path(options.workdir) / 'shards' / 'summary.json').read_text())
  assert train_rig.solve_command(export, summary, options) == (
      manifest['stages']['export']['solve_command'])
  z_options = dataclasses.replace(options, up='z', forward='-y')
  summary['runs'][-1].update(up='+z', forward='-y')  # what that conversion records
  command = train_rig.solve_command(export, summary, z_options)
  assert command.endswith(' --input_axes=x,z,-y'), command
  units = command.split('--units=')[1].split()[0]
  source = Path(options.bvh) / '09_03.bvh'
  bvh.write_bvh(tmp_path / 'z.bvh', z_up_copy(bvh.read_bvh(source)))
  out = {}
  for name, path, axes in (('y', source, None), ('z', tmp_path / 'z.bvh', 'x,z,-y')):
    solve_file(path, tmp_path / f'{name}.npz', checkpoint=str(export), units=units,
               input_axes=axes, log=lambda m: None)
    out[name] = np.load(tmp_path / f'{name}.npz')
  print('z-up copy against the clip:', {k: float(np.abs(out['z'][k] - out['y'][k]).max())
                                        for k in ('local_rot', 'positions_fk', 'offsets')})
  for key in ('local_rot', 'positions_fk', 'offsets'):
    np.testing.assert_allclose(out['z'][key], out['y'][key], atol=2e-5, err_msg=key)


def test_up_and_forward_are_checked(tmp_path):
  for kw, match in ((dict(rig='cmu_body', up='z', forward='-y'), 'are for --rig=auto'),
                    (dict(up='z'), 'go together'),
                    (dict(up='q'), r'^--up=q: axis must be one of x, y, z'),
                    (dict(up='z', forward='z'), 'perpendicular')):
    o = train_rig.Options(bvh=str(tmp_path), workdir=str(tmp_path / 'w'), **kw)
    with pytest.raises(Exception, match=match):
      train_rig.run(o, log=lambda m: None)


def test_bad_input_is_one_line(tmp_path):
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.train_rig', f'--bvh={tmp_path / "missing"}',
       f'--workdir={tmp_path / "w"}'], cwd=REPO, env=env, capture_output=True, text=True,
      timeout=120)
  assert proc.returncode == 2, proc.stderr
  err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert err == [f'error: --bvh {tmp_path / "missing"} does not exist'], proc.stderr


def test_a_failed_stage_is_recorded(tmp_path, cmu_dir):
  (tmp_path / 'bvh').mkdir()
  (tmp_path / 'bvh' / '09_03.bvh').symlink_to(cmu_dir / '09_03.bvh')
  # Bad options are refused before the workdir is made.
  for bad, match in ((dict(units='furlong'), '--units'), (dict(split='foo'), '--split'),
                     (dict(bvh=str(tmp_path)), 'no .bvh files'),
                     (dict(rig=str(tmp_path / 'nope.json')), 'nope.json does not exist'),
                     (dict(fps=0.0), '--fps must be a positive number'),
                     (dict(subject_regex='('), r"--subject_regex '\(' is not a regular "
                                                'expression: missing'),
                     (dict(iters=0), '--iters must be a positive integer, got 0'),
                     (dict(eval_frames=-5), '--eval_frames must be a positive integer')):
    o = train_rig.Options(**{'bvh': str(tmp_path / 'bvh'), 'workdir': str(tmp_path / 'w'),
                             **bad})
    if 'bvh' in bad:
      o = dataclasses.replace(o, bvh=str(tmp_path / 'empty'))
      (tmp_path / 'empty').mkdir()
    with pytest.raises(ValueError, match=match):
      train_rig.run(o, log=lambda m: None)
    assert not (tmp_path / 'w').exists()
  # A stage that fails (here: a file cut short) is recorded so.
  (tmp_path / 'bvh' / 'cut.bvh').write_text('HIERARCHY\nROOT Hips\n{\n')
  o = train_rig.Options(bvh=str(tmp_path / 'bvh'), workdir=str(tmp_path / 'w'))
  with pytest.raises(ValueError, match='cut.bvh:3: unbalanced braces'):
    train_rig.run(o, log=lambda m: None)
  stage = json.loads((tmp_path / 'w' / 'train_rig.json').read_text())['stages']['convert']
  assert stage['status'] == 'failed' and 'cut.bvh:3: unbalanced braces' in stage['error']
  assert not (tmp_path / 'w' / 'shards').exists()


def test_a_joint_map_edited_after_the_conversion_is_refused(tmp_path, cmu_dir):
  """Shards converted with `--rig=MAP.json`, then the map edited (units, dropped frames): a
  rerun is refused in one line (it went on with the stale shards, silently); the map put back,
  it goes on."""
  (tmp_path / 'bvh').mkdir()
  (tmp_path / 'bvh' / '09_03.bvh').symlink_to(cmu_dir / '09_03.bvh')
  doc = json.loads((REPO / 'ik_gat_jax/io/joint_maps/cmu_body.json').read_text())
  doc.pop('$schema')
  jmap = tmp_path / 'map.json'
  jmap.write_text(json.dumps(doc))
  o = train_rig.Options(bvh=str(tmp_path / 'bvh'), workdir=str(tmp_path / 'w'), rig=str(jmap))
  w = Path(o.workdir)
  w.mkdir()
  m = train_rig.Manifest(w, {})
  files, key = train_rig._conversion(o, w, m)
  train_rig._convert(o, w, m, lambda msg: None, '[1/5]', files, key)
  assert train_rig._conversion(o, w, m)[1] == key  # unchanged: goes on
  jmap.write_text(json.dumps(dict(doc, units=0.01, drop_first_frame=False)))
  with pytest.raises(ValueError, match=r'was converted with another .*map.json: the joint map '
                     r'has changed since \(sha256 [0-9a-f]{12} then, [0-9a-f]{12} now\): put it '
                     r'back, or use a new --workdir$'):
    train_rig._conversion(o, w, m)
  jmap.write_text(json.dumps(doc))
  assert train_rig._conversion(o, w, m)[1] == key


def test_a_file_outside_the_committed_split_names_train_rig_s_split_rules(tmp_path, cmu_dir):
  (tmp_path / 'bvh').mkdir()
  (tmp_path / 'bvh' / 'zz_99.bvh').symlink_to(cmu_dir / '09_03.bvh')
  o = train_rig.Options(bvh=str(tmp_path / 'bvh'), workdir=str(tmp_path / 'w'), rig='cmu_body')
  with pytest.raises(ValueError, match=r"^zz_99.bvh is not in split cmu_default \(joint map "
                     r"cmu_body's committed split\): pass --split=subject or --split=file"):
    train_rig.run(o, log=lambda m: None)


def test_a_file_outside_the_user_s_split_json_names_train_rig_s_ways(tmp_path, cmu_dir):
  """--split=MINE.json lacking a file: the advice names what train_rig takes (it named
  --split=train|val|test|all, which train_rig refuses)."""
  from ik_gat_jax import provenance
  (tmp_path / 'bvh').mkdir()
  for name in ('07_12', '09_03'):
    (tmp_path / 'bvh' / f'{name}.bvh').symlink_to(cmu_dir / f'{name}.bvh')
  mine = tmp_path / 'mine.json'
  mine.write_text(json.dumps({'name': 'mine', 'files': [
      {'file': '07_12.bvh', 'subject': '07', 'split': 'train', 'part': None,
       'sha256': provenance.file_sha256(cmu_dir / '07_12.bvh')}]}))
  o = train_rig.Options(bvh=str(tmp_path / 'bvh'), workdir=str(tmp_path / 'w'), split=str(mine))
  with pytest.raises(ValueError, match=r'^09_03.bvh is not in split mine \(.*mine.json\): list '
                     r'it there, or pass --split=subject or --split=file'):
    train_rig.run(o, log=lambda m: None)


def test_mirror_augmentation_off_for_a_rig_that_is_not_mirror_symmetric(tmp_path):
  """A rig whose natural pose is not mirror-symmetric (its zero pose where it names none:
  another lab's crumpled bind) would stop the training at its first step; train_rig turns
  mirror augmentation off for IK-GAT and the prior, in one line naming the better way out,
  and leaves a symmetric rig's as it is."""
  from experiments.configs import default as default_config
  from experiments.configs import prior as prior_config
  from ik_gat_jax import input_pipeline, skeleton
  cmu = skeleton.cmu_body()
  off = cmu.template().copy()
  left = cmu.joint_names.index('LeftUpLeg')
  off[left] = -off[left]  # the left hip on the right: no mirror image of its partner
  crumpled = skeleton.make_rig('crumpled', cmu.joint_names, cmu.parents, off, cmu.up,
                               cmu.forward)
  for rig, off_expected in ((cmu, False), (crumpled, True)):
    shards = tmp_path / rig.name
    shards.mkdir()
    (shards / 'rig.json').write_text(json.dumps(rig.to_json()))
    c, p = default_config.get_config(), prior_config.get_config()
    said = []
    train_rig._mirror_off_where_asymmetric(c, p, shards, said.append, '[2/5]')
    assert (c.augment.mirror == 0 and p.augment.mirror == 0) == off_expected, rig.name
    assert len(said) == int(off_expected)
    if off_expected:
      assert 'mirror augmentation off (IK-GAT and prior)' in said[0]
      assert '--reference_pose=first_frame' in said[0]
      with pytest.raises(ValueError, match='not mirror-symmetric'):
        input_pipeline.check_mirror(rig)  # what the training would have raised


def test_the_default_recipe_is_the_robust_one_where_the_rig_allows_it(tmp_path):
  """train_rig's default IK-GAT recipe is experiments/configs/robust.py (the shipped base's:
  heading canonicalisation, the tracker noise model, ...); on a rig whose root has no pair of
  hips it goes back to yaw augmentation, and without left/right bones drops the noise-level
  input, each in one line."""
  from ik_gat_jax import skeleton
  c, _ = train_rig.configs(train_rig.Options(bvh='x', workdir='y'), tmp_path)
  for k, (_, now) in train_rig.recipe_changes().items():
    section, key = k.split('.', 1)
    assert c[section][key] == now, k
  assert c.model.heading_canonicalization and not c.augment.yaw
  cmu = skeleton.cmu_body()
  no_pairs = skeleton.make_rig('no_pairs', cmu.joint_names, cmu.parents, cmu.template(),
                               cmu.up, cmu.forward, mirror=tuple(range(cmu.num_joints)))
  for rig, kept in ((cmu, True), (no_pairs, False)):
    shards = tmp_path / rig.name
    shards.mkdir()
    (shards / 'rig.json').write_text(json.dumps(rig.to_json()))
    c, _ = train_rig.configs(train_rig.Options(bvh='x', workdir='y'), shards)
    said = []
    train_rig._recipe_where_the_rig_allows(c, shards, said.append, '[2/5]')
    assert (c.model.heading_canonicalization, c.augment.yaw, c.model.noise_level_input) == (
        (True, False, True) if kept else (False, True, False)), rig.name
    assert len(said) == (0 if kept else 2), said
    if not kept:
      assert 'heading canonicalisation off, yaw augmentation on' in said[0]
      assert 'no mirror pair among the root children' in said[0]


def test_a_workdir_trained_with_the_older_recipe_goes_on_with_it(rig_run):
  """rig_run was trained with a config built on default.py (yaw augmentation, no tracker noise),
  the recipe before session 45: the same options with robust.py's changes (what the default
  gives such a workdir now) go on with the recorded recipe, in one line, and are not refused."""
  import copy
  options, _, _ = rig_run
  c = copy.deepcopy(options.config)
  for k, (_, now) in train_rig.recipe_changes().items():
    section, key = k.split('.', 1)
    c[section][key] = now
  w = Path(options.workdir)
  said = []
  o = dataclasses.replace(options, config=c)
  got, _ = train_rig.stage_configs(o, w, train_rig.Manifest(w, {}), said.append, '[2/5]')
  for k, (was, _) in train_rig.recipe_changes().items():
    section, key = k.split('.', 1)
    assert got[section][key] == was, k
  assert len(said) == 1 and 'recipe before session 45' in said[0], said
  train_rig._check_training_options(o, w, train_rig.Manifest(w, {}))  # not refused


def test_changed_training_options_are_refused_and_the_record_kept(rig_run):
  """A finished run rerun with other training options, or fewer steps than it was trained to,
  is refused in one line naming them, and train_rig.json stays as it was (it must describe the
  trained models); steps or a batch size that cannot train are refused the same way."""
  import copy
  options, _, _ = rig_run
  record = Path(options.workdir) / train_rig.MANIFEST
  before = record.read_bytes()
  c, p = copy.deepcopy(options.config), copy.deepcopy(options.prior_config)
  c.train.lr, p.model.latent = 5e-3, 16
  zero_batch = copy.deepcopy(options.config)
  zero_batch.train.batch_size = 0
  for change, match in (
      (dict(size='small', config=c, prior_config=p),
       r'was trained with --size=tiny, --config\.train\.lr=0\.001, '
       r'--prior_config\.model\.latent=8: rerun with that, or use a new --workdir$'),
      (dict(steps=10), r'ikgat is already trained to step 20, more than --steps=10: rerun '
                       r'with --steps=20 or more'),
      (dict(prior_steps=10), r'prior is already trained to step 20, more than '
                             r'--prior_steps=10'),
      (dict(steps=0), r'^--steps must be a positive number of steps, got 0$'),
      (dict(config=zero_batch), r'^--config\.train\.batch_size must be a positive integer, '
                                r'got 0$')):
    lines = []
    with pytest.raises(ValueError, match=match):
      train_rig.run(dataclasses.replace(options, **change), log=lines.append)
    assert not any('already done' in ln for ln in lines), (change, lines)
    assert record.read_bytes() == before, change


def test_a_stage_left_running_by_a_killed_run_is_said_and_resumed(rig_run):
  """SIGKILL leaves a stage 'running' in train_rig.json: the next run says so and goes on."""
  options, _, _ = rig_run
  record = Path(options.workdir) / train_rig.MANIFEST
  doc = json.loads(record.read_text())
  doc['stages']['convert']['status'] = 'running'
  record.write_text(json.dumps(doc))
  lines = []
  manifest = train_rig.run(options, log=lines.append)
  assert lines[0] == (f'train_rig: {record} says convert was running when its last run stopped '
                      '(killed?): resuming'), lines
  assert all(manifest['stages'][s]['status'] == 'done' for s in train_rig.STAGES)


def test_sigterm_during_convert_is_recorded_as_interrupted(tmp_path, cmu_dir):
  import signal
  (tmp_path / 'bvh').mkdir()
  (tmp_path / 'bvh' / '09_03.bvh').symlink_to(cmu_dir / '09_03.bvh')
  o = train_rig.Options(bvh=str(tmp_path / 'bvh'), workdir=str(tmp_path / 'w'))

  def terminate_once_converting(msg):
    if 'convert: split' in msg:  # logged once the stage is recorded 'running'
      os.kill(os.getpid(), signal.SIGTERM)

  with pytest.raises(KeyboardInterrupt):
    with absl_main.terminate_as_interrupt():
      train_rig.run(o, log=terminate_once_converting)
  stage = json.loads((tmp_path / 'w' / train_rig.MANIFEST).read_text())['stages']['convert']
  assert stage['status'] == 'interrupted'


def test_higher_steps_train_further_and_redo_only_what_depends_on_them(rig_run, tmp_path):
  import shutil
  options, _, _ = rig_run
  work = shutil.copytree(options.workdir, tmp_path / 'work', symlinks=True)
  lines = []
  manifest = train_rig.run(dataclasses.replace(options, workdir=str(work), steps=25),
                           log=lines.append)
  assert any(ln.startswith('[2/5] ikgat: training 25 steps') for ln in lines), lines
  assert json.loads((work / 'ikgat' / 'run.json').read_text())['step'] == 25
  assert any(ln.startswith('[3/5] prior: already done') for ln in lines), lines
  redone = [m for m in train_rig.EVAL_METHODS if any(
      ln.startswith(f'[4/5] evaluate: {m}: local') for ln in lines)]
  assert redone == ['ikgat', 'ikgat_calibrated', 'ikgat_10mm', 'ikgat_20mm'], lines
  assert all(manifest['stages'][s]['status'] == 'done' for s in train_rig.STAGES)
  assert manifest['configs']['ikgat']['train']['steps'] == 25


def test_an_export_another_workdir_made_is_replaced_in_a_line_that_says_so(rig_run, tmp_path):
  """`--export=DIR` holding another run's export: replaced (as the README says), in a line
  naming what its card held (it was replaced without a word); any other folder refused."""
  import shutil
  options, _, _ = rig_run
  work = shutil.copytree(options.workdir, tmp_path / 'work', symlinks=True)
  other = shutil.copytree(Path(options.workdir) / 'checkpoint', tmp_path / 'other')
  (other / 'README.md').write_text((other / 'README.md').read_text().replace(
      'rig: auto', 'rig: their_rig'))
  lines = []
  train_rig.run(dataclasses.replace(options, workdir=str(work), export=str(other)),
                log=lines.append)
  assert any(ln.startswith(f'[5/5] export: {other} holds an export this workdir did not make '
                           '(task: ikgat; rig: their_rig') and ln.endswith('it is replaced')
             for ln in lines), lines
  assert 'rig: their_rig' not in (other / 'README.md').read_text()
  (tmp_path / 'data').mkdir()
  (tmp_path / 'data' / 'keep.txt').write_text('mine')
  with pytest.raises(ValueError, match='exists and is not a checkpoint export'):
    train_rig.run(dataclasses.replace(options, workdir=str(work), export=str(tmp_path / 'data')),
                  log=lambda m: None)
  assert (tmp_path / 'data' / 'keep.txt').read_text() == 'mine'
