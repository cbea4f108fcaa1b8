"""experiments/device_check.py: the prepared GPU check, run here on the CPU at tiny size.

One subprocess run of the absl main with --tiny (the JSON's structure, positive rates, batch
lists that double), plus the pieces that need no device: the sweep's stop rules and the
torch_geometric graph.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import device_check
from ik_gat_jax import skeleton

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp('device_check') / 'device_check.json'
  cmd = [sys.executable, '-m', 'experiments.device_check', '--tiny', f'--output_json={out}']
  done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'frames/s' in done.stdout  # the table
  return json.loads(out.read_text())


def _doubles(batches):
  return batches and batches[0] == 1 and all(b == 2 * a for a, b in zip(batches, batches[1:]))


def test_json_structure(result):
  for key in ('command', 'config', 'device', 'provenance', 'compile_cache', 'model',
              'torch_geometric', 'matmul', 'inference', 'bf16_speedup', 'bf16_products_speedup',
              'training', 'ratios',
              'seconds'):
    assert key in result, key
  dev = result['device']
  assert dev['backend'] == 'cpu' and dev['device_count'] >= 1 and dev['devices']
  assert dev['versions']['jax'] and dev['versions']['flax']
  assert result['model']['size'] == 'tiny' and result['model']['source'] == 'random init'
  assert result['model']['params'] > 0
  assert result['config']['max_batch'] == 4
  tg = result['torch_geometric']
  if tg['status'] == 'ok':  # PyTorch + torch_geometric installed: the same network's size
    assert tg['model']['params'] == result['model']['params']
    assert _doubles(tg['batches'])
  else:
    assert tg['status'].startswith('not installed')
    assert result['ratios']['jax_f32_over_torch_geometric'] == []
  for m in result['matmul'].values():
    assert m['gflops_per_s'] > 0


def test_inference_batches_double_and_rates_are_positive(result):
  for dtype in ('float32', 'bfloat16', 'bfloat16_products'):
    s = result['inference'][dtype]
    assert _doubles(s['batches']), s['batches']
    assert s['batches'] == [1, 2, 4] and s['stopped'] == 'max_batch'
    assert s['largest_batch'] == 4 and s['best_batch'] in s['batches']
    for r in s['results']:
      assert r['frames_per_s'] > 0 and r['median_ms'] > 0 and r['calls'] >= 3
      assert r['compile_s'] >= 0 and r['flops_per_frame'] > 0
  for key in ('bf16_speedup', 'bf16_products_speedup'):
    assert [r['batch'] for r in result[key]] == [1, 2, 4]
    assert all(r['speedup'] > 0 for r in result[key])


def test_training_rates(result):
  t = result['training']
  assert t['batches'] == [4] and t['stopped'] == 'max_batch'
  for r in t['results']:
    assert r['steps_per_s'] > 0 and r['frames_per_s'] > 0
    assert r['frames_per_s'] == pytest.approx(r['batch'] * r['steps_per_s'])
    assert np.isfinite(r['loss'])


class JaxRuntimeError(RuntimeError):
  """Named like JAX's, as the sweep recognises device errors by type name."""


def test_sweep_stops_at_out_of_memory_budget_and_max_batch():
  def measure(b):
    if b >= 16:
      raise JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate')
    return {'frames_per_s': float(b)}

  s = device_check.doubling_sweep(measure, 1 << 10, 60.0, device_check.jax_oom)
  assert s['batches'] == [1, 2, 4, 8] and s['stopped'] == 'out_of_memory at batch 16'
  assert s['best_batch'] == 8
  assert device_check.doubling_sweep(measure, 4, 60.0, device_check.jax_oom)['stopped'] == \
      'max_batch'
  s = device_check.doubling_sweep(lambda b: {'frames_per_s': 1.0}, 1 << 10, 0.0,
                                  device_check.jax_oom)
  assert s['batches'] == [1] and s['stopped'] == 'budget'  # the first batch always runs

  def other(b):
    raise JaxRuntimeError('INTERNAL: something else\nmore')

  assert device_check.doubling_sweep(other, 8, 60.0, device_check.jax_oom)['stopped'] == \
      'error at batch 1: INTERNAL: something else'

  def bug(b):
    raise KeyError('a bug of the script is not swallowed')

  with pytest.raises(KeyError):
    device_check.doubling_sweep(bug, 8, 60.0, device_check.jax_oom)


def test_budget_shares_renormalise():
  budget = device_check.Budget(100.0, list(device_check.SHARES))
  total = sum(device_check.SHARES.values())
  assert budget.section('torch_geometric') == pytest.approx(
      100 * device_check.SHARES['torch_geometric'] / total, abs=0.5)
  for name in list(budget.todo)[:-1]:
    budget.section(name)
  assert budget.section('training') == pytest.approx(budget.left(), abs=0.5)  # the rest


def test_torch_graph_is_ikgats_tree_with_self_loops():
  rig = skeleton.cmu_body()
  edges = device_check.tree_edge_index(rig.parents)
  adj = np.zeros((rig.num_joints, rig.num_joints), bool)
  adj[edges[1], edges[0]] = True  # target receives from source
  np.testing.assert_array_equal(adj, np.asarray(rig.adjacency('tree')))
  assert len(set(map(tuple, edges.T))) == edges.shape[1]  # no duplicate edge
  big = device_check.batched_edge_index(edges, rig.num_joints, 3)
  assert big.shape == (2, 3 * edges.shape[1])
  np.testing.assert_array_equal(big[:, edges.shape[1]:2 * edges.shape[1]],
                                edges + rig.num_joints)
