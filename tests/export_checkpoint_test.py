"""experiments.export_checkpoint: an export replaces an earlier export and nothing else."""

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
