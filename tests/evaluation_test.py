"""experiments.evaluate's library: every method end to end on real frames, JSON fields, errors."""

import json
import subprocess
import sys

import numpy as np
import pytest

from ik_gat_jax import checkpointing, data, evaluation, iterative_ik, metrics, prior_task, train

REQUIRED = ('method', 'frames', 'local_rot_err_deg', 'root_rot_err_deg', 'global_rot_err_deg',
            'twist_err_deg', 'swing_err_deg', 'mpjpe_mm', 'seconds', 'frames_per_s', 'per_joint',
            'provenance')


def _run(method, shards, **kw):
  ds = data.load_shards(shards, 'val')
  return evaluation.evaluate(method, ds, ds.rig, **kw)


def test_swing_floor_reproduces_clean_positions(cmu_shards):
  ds = data.load_shards(cmu_shards, 'val')
  r = _run(evaluation.make_method('swing', ds.rig), cmu_shards)
  assert all(k in r for k in REQUIRED)
  assert r['mpjpe_mm'] < 0.01 and r['root_rot_err_deg'] < 0.01
  assert r['frames'] == len(ds.positions)
  assert set(r['per_joint']) == set(ds.rig.joint_names)
  json.dumps(r)  # serialisable
  noisy = _run(evaluation.make_method('swing', ds.rig), cmu_shards, noise_mm=20.0)
  assert noisy['local_rot_err_deg'] > r['local_rot_err_deg'] + 1.0


def test_ikgat_method_matches_the_checkpoint_metrics(cmu_shards, tiny_ikgat_run):
  ds = data.load_shards(cmu_shards, 'val')
  r = _run(evaluation.make_method('ikgat', ds.rig, checkpoint=tiny_ikgat_run), cmu_shards)
  _, meta = train.load_model(tiny_ikgat_run)
  np.testing.assert_allclose(r['local_rot_err_deg'], meta['metrics']['local_rot_err_deg'],
                             rtol=1e-4)


def test_max_frames_keeps_files_contiguous(cmu_shards):
  ds = data.load_shards(cmu_shards, 'train')
  idx = evaluation.select_frames(ds, 50)
  file_id = np.asarray(ds.file_id)[idx]
  for f in np.unique(file_id):
    rows = idx[file_id == f]
    np.testing.assert_array_equal(np.diff(rows), 1)
  assert 50 <= len(idx) <= 52


def test_iterative_with_prior_cold_and_warm(cmu_shards, tiny_prior_run):
  ds = data.load_shards(cmu_shards, 'val')
  solver = iterative_ik.SolverConfig(iters=30, warm_iters=10, window=8)
  for warm in (False, True):
    m = evaluation.make_method('iterative', ds.rig, prior=tiny_prior_run, solver=solver,
                               warm_start=warm)
    r = _run(m, cmu_shards, max_frames=24)
    assert r['frames'] == 24 and np.isfinite(r['local_rot_err_deg'])
    assert r['settings']['warm_start'] is warm


def test_prior_checkpoint_refused_as_ikgat(cmu_shards, tiny_prior_run):
  ds = data.load_shards(cmu_shards, 'val')
  with pytest.raises(checkpointing.CheckpointError, match='pose_prior'):
    evaluation.make_method('ikgat', ds.rig, checkpoint=tiny_prior_run)


def test_prior_report_fields(cmu_shards, tiny_prior_run):
  model, meta = train.load_model(tiny_prior_run, task=prior_task.PRIOR_TASK)
  tr, val = data.load_shards(cmu_shards, 'train'), data.load_shards(cmu_shards, 'val')
  import ml_collections
  rep = prior_task.evaluate_prior(model, tr, val, tr.rig, ml_collections.ConfigDict(meta['config']))
  assert 0 <= rep['active_dims'] <= 8 and rep['latent'] == 8
  assert rep['sample_to_nearest_train_deg'] > 0 and rep['val_to_nearest_train_deg'] > 0


def test_cli_bad_split_is_one_line_nonzero(cmu_shards, tmp_path):
  out = tmp_path / 'r.json'
  p = subprocess.run([sys.executable, '-m', 'experiments.evaluate', f'--data={cmu_shards}',
                      '--split=nope', '--method=swing', f'--output_json={out}'],
                     capture_output=True, text=True, timeout=120)
  assert p.returncode != 0
  assert "no split 'nope'" in p.stderr.strip().splitlines()[-1]
  assert not out.exists()


def test_ikgat_bfloat16_close_to_float32(cmu_shards, tiny_ikgat_run):
  ds = data.load_shards(cmu_shards, 'val')
  f32, bf16 = (_run(evaluation.make_method('ikgat', ds.rig, checkpoint=tiny_ikgat_run, dtype=d),
                    cmu_shards, max_frames=32) for d in ('float32', 'bfloat16'))
  assert bf16['settings']['dtype'] == 'bfloat16'
  assert abs(bf16['local_rot_err_deg'] - f32['local_rot_err_deg']) < 1.0


def test_refine_never_increases_its_loss_and_lowers_mpjpe(cmu_shards, tiny_ikgat_run):
  """Amortized + refine (G1): from IK-GAT's output, the anchored refinement keeps its best
  iterate, so its loss never rises; on real frames it brings the joints closer."""
  import jax
  ds = data.load_shards(cmu_shards, 'val')
  b = train.input_pipeline.gather_batch(ds, np.arange(64))
  init = np.asarray(evaluation.make_method('ikgat', ds.rig, checkpoint=tiny_ikgat_run)
                    .solve(b['positions'], b['offsets']))
  cfg = iterative_ik.SolverConfig(iters=8, lr=0.01, w_anchor=0.5)
  local, loss0, loss1 = jax.jit(lambda i, p, o: iterative_ik.refine_rotations(
      i, p, o, ds.rig, cfg))(init, b['positions'], b['offsets'])
  assert np.all(np.asarray(loss1) <= np.asarray(loss0))
  assert np.mean(np.asarray(loss1)) < np.mean(np.asarray(loss0))
  m = evaluation.make_method('ikgat', ds.rig, checkpoint=tiny_ikgat_run, refine=cfg)
  assert m.name == 'ikgat+refine8'
  r0 = _run(evaluation.make_method('ikgat', ds.rig, checkpoint=tiny_ikgat_run), cmu_shards)
  r1 = _run(m, cmu_shards)
  assert r1['mpjpe_mm'] < r0['mpjpe_mm'] and r1['settings']['refine']['iters'] == 8
