"""Scale (DESIGN section 8): 8 simulated CPU devices train like 1, checkpoints move between
meshes, hosts read disjoint slices, the prefetched loader covers each epoch once.

The 8-device checks run `experiments.scale_check` in a subprocess (XLA fixes the CPU device
count when JAX starts) and assert on its JSON; the thread and launcher logic is tested here.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ik_gat_jax import input_pipeline, train
REPO = Path(__file__).resolve().parents[1]
DEVICES = 8


@pytest.fixture(scope='module')
def scale_check(cmu_shards, tmp_path_factory, xla_level_flags):
  """The JSON of `python -m experiments.scale_check --cpu_devices=8` on the CMU test shards."""
  out = tmp_path_factory.mktemp('scale') / 'scale.json'
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
         'XLA_FLAGS': ' '.join([f'--xla_force_host_platform_device_count={DEVICES}'] +
                               xla_level_flags)}  # and the suite's optimisation level
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.scale_check', f'--data={cmu_shards}',
       f'--cpu_devices={DEVICES}', '--steps=20', f'--json={out}'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert out.exists(), proc.stderr[-3000:]
  return json.loads(out.read_text())


def test_eight_devices_train_like_one_with_dropout_and_augmentation(scale_check):
  r = scale_check
  assert r['devices'] == DEVICES and r['platform'] == 'cpu'
  assert r['steps'] == list(range(1, 21))
  one = np.array(r['loss']['one'])
  assert np.all(np.isfinite(one)) and len(set(one.tolist())) > 1
  np.testing.assert_allclose(r['loss']['all'], one, rtol=1e-4)
  assert r['max_rel_diff']['all_vs_one'] <= 1e-4


def test_checkpoint_written_on_eight_devices_restores_and_resumes_on_one(scale_check):
  restore = scale_check['restore']
  assert restore['step'] == 10 and restore['same_params']
  assert restore['devices_per_leaf'] == {'all': [DEVICES], 'one': [1]}
  # Steps 11-20 resumed on 1 device from the 8-device checkpoint continue the same curve.
  np.testing.assert_allclose(scale_check['loss']['resumed'], scale_check['loss']['one'],
                             rtol=1e-4)


def test_hosts_read_disjoint_slices_and_loader_covers_each_epoch_once(scale_check):
  assert scale_check['process_slices'] == {'processes': 2, 'steps': 3, 'ok': True}
  assert scale_check['epoch_once']['ok'] and scale_check['epoch_once']['frames'] > 32
  assert scale_check['pipeline_frames_per_s'] > 0
  assert f'not divisible by the {DEVICES} devices' in scale_check['indivisible_batch_error']
  assert scale_check['ok']


def test_process_rows_partition_the_global_batch():
  rows = [input_pipeline.process_rows(12, p, 3) for p in range(3)]
  assert [(r.start, r.stop) for r in rows] == [(0, 4), (4, 8), (8, 12)]
  with pytest.raises(ValueError, match='not divisible by the 5 processes'):
    input_pipeline.process_rows(12, 0, 5)


def _counting(n=None, fail_at=None):
  i = 0
  while n is None or i < n:
    if i == fail_at:
      raise OSError(f'bad shard at item {i}')
    yield i
    i += 1


def _alive(prefetcher):
  return prefetcher._thread.is_alive()  # pylint: disable=protected-access


def test_prefetcher_keeps_order_bounds_the_queue_and_passes_errors_on():
  with input_pipeline.Prefetcher(_counting(50), depth=2) as p:
    assert list(p) == list(range(50))
    assert p.produced == 50 and p.busy_seconds > 0
  p = input_pipeline.Prefetcher(_counting(fail_at=3), depth=2)
  assert [next(p), next(p), next(p)] == [0, 1, 2]
  with pytest.raises(OSError, match='bad shard at item 3'):
    next(p)
  p.close()
  assert not _alive(p)
  # An endless source is never read more than `depth` (+1 in hand) ahead of the consumer.
  p = input_pipeline.Prefetcher(_counting(), depth=3)
  assert next(p) == 0
  time.sleep(0.3)
  assert p.produced <= 1 + 3 + 1
  p.close()
  assert not _alive(p)


def test_prefetcher_stops_cleanly_on_keyboard_interrupt():
  before = threading.active_count()
  with pytest.raises(KeyboardInterrupt):
    with input_pipeline.Prefetcher(_counting(), depth=2) as p:
      for i in p:
        if i == 5:
          raise KeyboardInterrupt
  assert not _alive(p) and threading.active_count() == before


def test_distributed_starts_only_when_asked_or_launched():
  launch = train._cluster_launch  # pylint: disable=protected-access
  assert launch({}) is None
  launches = {'JAX_COORDINATOR_ADDRESS': {'JAX_COORDINATOR_ADDRESS': 'host0:1234'},
              'SLURM': {'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '4'},
              'Open MPI': {'OMPI_COMM_WORLD_SIZE': '2'},
              'multi-host Cloud TPU': {'TPU_WORKER_HOSTNAMES': 'w0,w1'}}
  for name, env in launches.items():
    assert launch(env) == name
  assert launch({'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '1'}) is None
  assert not train.initialize_distributed('auto', environ={})
  assert not train.initialize_distributed('off', environ=launches['SLURM'])
  with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
    train.initialize_distributed('yes')
