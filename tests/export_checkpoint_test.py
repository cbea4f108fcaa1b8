"""experiments.export_checkpoint: an export replaces an earlier export and nothing else."""

import json
import os

import pytest

from experiments import export_checkpoint
from ik_gat_jax import checkpointing
from tests.solver_test import tiny_checkpoint


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """A run directory as experiments.train leaves one: checkpoints/best (an untrained model)."""
  run = tmp_path_factory.mktemp('run')
  (run / 'checkpoints').mkdir()
  os.symlink(tiny_checkpoint(tmp_path_factory), run / 'checkpoints' / 'best')
  return run


def test_export_replaces_an_export_and_refuses_any_other_folder(run, tmp_path):
  out = tmp_path / 'ckpt'
  done = export_checkpoint.export_run(run, out, acknowledgment=None)
  assert sorted(p.name for p in out.iterdir()) == [str(done['step']), 'README.md']
  mask = os.umask(0)
  os.umask(mask)
  assert out.stat().st_mode & 0o777 == 0o777 & ~mask  # not mkdtemp's 0700
  export_checkpoint.export_run(run, out, acknowledgment=None)  # an earlier export: replaced
  data = tmp_path / 'mocap'
  data.mkdir()
  (data / 'walk.bvh').write_text('HIERARCHY')
  (data / 'README.md').write_text('# my data')
  for target in (data, run, data / 'walk.bvh'):
    with pytest.raises(ValueError, match='not a checkpoint export|is a file'):
      export_checkpoint.export_run(run, target, acknowledgment=None)
  assert (data / 'walk.bvh').read_text() == 'HIERARCHY' and (run / 'checkpoints').is_dir()
  assert sorted(p.name for p in tmp_path.iterdir()) == ['ckpt', 'mocap']  # no temporary left


def test_the_card_says_which_step_of_how_many_it_ships(tiny_ikgat_run, run, tmp_path):
  """The card names the exported checkpoint's step, what chose it, and the steps the run
  trained (its latest checkpoint's), not the best step as the steps trained."""
  done = export_checkpoint.export_run(tiny_ikgat_run, tmp_path / 'a', acknowledgment=None)
  text = (tmp_path / 'a' / 'README.md').read_text()
  assert f"; checkpoint: step {done['step']} (best val) of 20 trained;" in text, text
  assert 'trained steps' not in text
  meta = checkpointing.Checkpointer(tiny_ikgat_run / 'checkpoints' / 'best',
                                    create=False).restore_meta()
  assert '; checkpoint: step 40 (best val) of 60 trained;' in export_checkpoint.card(
      {**meta, 'step': 40}, None, 10**6, 'x', trained=60)
  export_checkpoint.export_run(run, tmp_path / 'b', acknowledgment=None)  # no run: steps unknown
  assert '; checkpoint: step 0 (not validated); size' in (tmp_path / 'b' / 'README.md').read_text()
  assert '| field | value |' in text
  bare = export_checkpoint.card({**meta, 'step': 40, 'metrics': {}}, None, 10**6, 'x')
  assert '## Validation metrics (best checkpoint)\n\nNone: the run had no validation split' in bare
  assert '| field | value |' not in bare  # no empty table


def test_a_test_json_must_be_this_run_s_test_split(tiny_ikgat_run, tmp_path):
  """`--test_json`: another method's, another split's, another run's result, one lacking the
  card's fields or no JSON at all is refused in one line (the card called any of them this
  run's test split)."""
  fields = dict(frames=10, local_rot_err_deg=4.0, root_rot_err_deg=2.0, twist_err_deg=3.0,
                swing_err_deg=1.0, mpjpe_mm=2.0)
  ok = dict(fields, method='ikgat', split='test', settings={'checkpoint': str(tiny_ikgat_run)})
  cases = {'ok': ok, 'swing': dict(ok, method='swing'), 'val': dict(ok, split='val'),
           'other': dict(ok, settings={'checkpoint': str(tmp_path / 'other_run')}),
           'bare': {'method': 'ikgat', 'split': 'test'},
           'older': dict(ok, settings={'checkpoint': str(tiny_ikgat_run), 'trained_steps': 3})}
  for name, doc in cases.items():
    (tmp_path / f'{name}.json').write_text(json.dumps(doc))
  (tmp_path / 'cut.json').write_text('{"method": "ikg')
  assert export_checkpoint.read_test_json(tmp_path / 'ok.json', tiny_ikgat_run, 'ikgat') == ok
  for name, match in (('swing', r"holds 'swing' on the test split"),
                      ('val', r"holds 'ikgat' on the val split"),
                      ('other', r"holds 'ikgat' on the test split of .*other_run"),
                      ('bare', r'lacks frames, local_rot_err_deg'),
                      ('cut', r'cut.json is not JSON'),
                      ('older', r'measured the checkpoint of step 3, and the run.s best is now '
                                r'step \d+: evaluate this run on the test split again')):
    with pytest.raises(ValueError, match=match):
      export_checkpoint.read_test_json(tmp_path / f'{name}.json', tiny_ikgat_run, 'ikgat')
