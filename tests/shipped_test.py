"""The shipped checkpoints: load without ../shared, refuse the wrong rig, reproduce their card."""

import json
from pathlib import Path

import numpy as np
import pytest

from ik_gat_jax import checkpointing, data, evaluation, prior_task, skeleton, train

SHIPPED = Path(__file__).resolve().parents[1] / 'checkpoints'


def test_shipped_models_load_from_the_repo_alone():
  model, meta = train.load_model(SHIPPED / 'ikgat_base')
  assert meta['rig']['name'] == 'cmu_body' and model.config.size == 'base'
  assert 'mocap.cs.cmu.edu' in (SHIPPED / 'ikgat_base' / 'README.md').read_text()
  prior, pmeta = train.load_model(SHIPPED / 'prior', task=prior_task.PRIOR_TASK)
  assert prior.config.latent == 32 and pmeta['config']['prior_stats']['mean']


def test_a_checkpoint_for_another_rig_is_refused():
  with pytest.raises(checkpointing.CheckpointError, match="not 'smpl22'"):
    train.load_model(SHIPPED / 'ikgat_base', expected_rig=skeleton.smpl22())


def test_shipped_ikgat_reproduces_its_unseen_subject_metrics(cmu_dir, tmp_path):
  """Subject 07 (the unseen-subject test part), converted here, scored as on the card."""
  from data_prep import conversion
  for f in sorted(cmu_dir.glob('07_*.bvh')):
    conversion.convert(f, 'cmu_body', tmp_path, split='test', log=lambda m: None)
  ds = data.load_shards(tmp_path, 'test')
  r = evaluation.evaluate(evaluation.make_method('ikgat', ds.rig), ds, ds.rig)
  card = json.loads((SHIPPED / 'ikgat_base' / 'test_metrics.json').read_text())
  expect = card['per_part']['unseen_subject']
  assert r['frames'] == expect['frames']
  for k in ('local_rot_err_deg', 'twist_err_deg', 'mpjpe_mm'):
    np.testing.assert_allclose(r[k], expect[k], rtol=2e-3, err_msg=k)
