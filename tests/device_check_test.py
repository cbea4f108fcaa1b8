"""experiments/device_check.py: the prepared GPU check, run here on the CPU at tiny size.

One subprocess run with --tiny through experiments/device_run.sh, the script a GPU machine
runs (the JSON's structure, positive rates, batch lists that double, the log), plus the pieces
that need no device: the sweep's stop rules, a failing section recorded while the others run,
and the torch_geometric graph.
"""

import json
import os
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
  out = tmp_path_factory.mktemp('device_check')
  cmd = ['bash', 'experiments/device_run.sh', str(out), '--tiny']
  done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                        env={**os.environ, 'PYTHON': sys.executable})
  assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
  assert 'frames/s' in done.stdout and 'jax' in done.stdout.splitlines()[0]  # versions, table
  assert 'frames/s' in (out / 'device_check.log').read_text()
  result = json.loads((out / 'device_check.json').read_text())
  result['_markdown'] = (out / 'device_check.md').read_text()
  return result


def _doubles(batches):
  return batches and batches[0] == 1 and all(b == 2 * a for a, b in zip(batches, batches[1:]))


def test_json_structure(result):
  for key in ('command', 'config', 'device', 'provenance', 'compile_cache', 'model',
              'torch_geometric', 'matmul', 'inference', 'auto_speedup', 'bf16_speedup',
              'bf16_products_speedup',
              'training', 'ratios',
              'seconds'):
    assert key in result, key
  assert result['complete'] and result['errors'] == []
  assert 'jax_default_matmul_precision' in result['device']
  dev = result['device']
  assert dev['backend'] == 'cpu' and dev['device_count'] >= 1 and dev['devices']
  assert dev['versions']['jax'] and dev['versions']['flax']
  assert result['model']['size'] == 'tiny' and result['model']['source'] == 'random init'
  assert result['model']['params'] > 0
  assert result['config']['max_batch'] == 4 and result['config']['batch_step'] == 2  # the CPU
  tg = result['torch_geometric']
  if tg['status'] == 'ok':  # PyTorch + torch_geometric installed: the same network's size
    assert tg['model']['params'] == result['model']['params']
    assert tg['float32_matmul']['precision'] in ('highest', 'high', 'medium')
    assert _doubles(tg['batches'])
  else:
    assert tg['status'].startswith('not installed')
    assert result['ratios']['jax_f32_over_torch_geometric'] == []
  for m in result['matmul'].values():
    assert m['gflops_per_s'] > 0


def test_inference_batches_double_and_rates_are_positive(result):
  for variant in device_check.INFERENCE_VARIANTS:
    s = result['inference'][variant]
    assert _doubles(s['batches']), s['batches']
    assert s['batches'] == [1, 2, 4] and s['stopped'] == 'max_batch'
    assert s['largest_batch'] == 4 and s['best_batch'] in s['batches']
    for r in s['results']:
      assert r['frames_per_s'] > 0 and r['median_ms'] > 0 and r['calls'] >= 3
      assert r['compile_s'] >= 0 and r['flops_per_frame'] > 0
  for key in ('auto_speedup', 'bf16_speedup', 'bf16_products_speedup'):
    assert [r['batch'] for r in result[key]] == [1, 2, 4]
    assert all(r['speedup'] > 0 for r in result[key])


def test_markdown_report_holds_the_measurements(result, tmp_path):
  """The `.md` beside the JSON: one row per batch with the JSON's frames/s, each variant's
  best batch against the 1M goal; `--report` prints the same from the JSON, and a partial JSON
  (written before the sections ran) renders too."""
  md = result['_markdown']
  result = {k: v for k, v in result.items() if k != '_markdown'}
  assert md == device_check.markdown(result)
  lines = md.splitlines()
  for r in result['inference']['float32']['results']:
    row = next(x for x in lines if x.startswith(f'| {r["batch"]:,} |'))
    assert f'| {r["frames_per_s"]:,.0f} |' in row
  for v in device_check.INFERENCE_VARIANTS:
    assert any(x.startswith(f'| {v} |') and '%' in x for x in lines)
  assert '| training batch |' in md and '| matmul |' in md
  partial = {k: result[k] for k in ('command', 'device', 'torch_geometric')}
  assert 'Device:' in device_check.markdown(partial)
  path = tmp_path / 'check.json'
  path.write_text(json.dumps(result))
  done = subprocess.run([sys.executable, '-m', 'experiments.device_check', f'--report={path}'],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0 and done.stdout == md, done.stderr[-2000:]
  path.write_text('[1, 2]')  # JSON, but not this check's
  done = subprocess.run([sys.executable, '-m', 'experiments.device_check', f'--report={path}'],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert done.returncode != 0 and 'is not a JSON of this check' in done.stderr.splitlines()[-1]


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

  s = device_check.batch_sweep(measure, 1 << 10, 60.0, device_check.jax_oom)
  assert s['batches'] == [1, 2, 4, 8] and s['stopped'] == 'out_of_memory at batch 16'
  assert s['best_batch'] == 8
  assert device_check.batch_sweep(measure, 4, 60.0, device_check.jax_oom)['stopped'] == \
      'max_batch'
  s = device_check.batch_sweep(lambda b: {'frames_per_s': 1.0}, 1 << 10, 0.0,
                                  device_check.jax_oom)
  assert s['batches'] == [1] and s['stopped'] == 'budget'  # the first batch always runs

  def other(b):
    raise JaxRuntimeError('INTERNAL: something else\nmore')

  assert device_check.batch_sweep(other, 8, 60.0, device_check.jax_oom)['stopped'] == \
      'error at batch 1: INTERNAL: something else'

  def bug(b):
    raise KeyError('a bug of the script is not swallowed')

  with pytest.raises(KeyError):
    device_check.batch_sweep(bug, 8, 60.0, device_check.jax_oom)


def test_a_failing_section_is_recorded_and_the_others_still_run(tmp_path, monkeypatch, capsys):
  """A section that raises what the sweep does not catch (a bug, an API another JAX lacks) is
  recorded with its traceback, the JSON so far is on disk before the next section, the others
  run, and the table still prints. Only the sections' measurements are replaced (the real ones
  run in the fixture above); the model, the matmul and the JSON are real."""
  out = tmp_path / 'check.json'
  seen = []

  def inference(model, rig, variant, o, seconds):
    seen.append(variant)
    if variant == 'bfloat16':
      raise TypeError('an API this JAX lacks')
    return device_check.sweep(lambda b: {'frames_per_s': 10.0 * b}, [1, 2], seconds,
                              device_check.jax_oom, 2.2)

  def training(rig, o, seconds):
    on_disk = json.loads(out.read_text())  # written after each section
    assert not on_disk['complete'] and on_disk['errors'] == ['inference_bfloat16']
    assert on_disk['inference']['float32']['batches'] == [1, 2]
    raise KeyError('training broke')

  monkeypatch.setattr(device_check, 'inference_section', inference)
  monkeypatch.setattr(device_check, 'training_section', training)
  r = device_check.run(device_check.Options(output_json=str(out), tiny=True, torch=False),
                       log=lambda _: None)
  assert seen == list(device_check.INFERENCE_VARIANTS)
  assert r['errors'] == ['inference_bfloat16', 'training'] and r['complete']
  assert r['inference']['bfloat16']['error'] == 'TypeError: an API this JAX lacks'
  assert 'Traceback' in r['inference']['bfloat16']['traceback']
  assert r['inference']['bfloat16_products']['batches'] == [1, 2]
  assert r['bf16_speedup'] == [] and len(r['bf16_products_speedup']) == 2
  assert r['training']['error'].startswith('KeyError')
  assert json.loads(out.read_text())['errors'] == r['errors']
  assert 'TypeError' in capsys.readouterr().err
  text = device_check.table(r)
  assert 'failed sections (tracebacks in the JSON): inference_bfloat16, training' in text
  assert 'bf16 TypeError: an API this JAX lacks' in text and '      20' in text


def test_batches_grow_by_the_step_and_the_budget_predicts_by_it(monkeypatch):
  assert device_check.geometric_batches(1 << 20, 4) == [4**k for k in range(11)]
  assert device_check.geometric_batches(100, 2) == [1, 2, 4, 8, 16, 32, 64]
  assert device_check.geometric_batches(0, 4) == []
  with pytest.raises(ValueError):
    device_check.geometric_batches(8, 1)
  assert device_check.default_batch_step(True) == 4 and device_check.default_batch_step(False) == 2
  clock, seen = [0.0], []
  monkeypatch.setattr(device_check.time, 'monotonic', lambda: clock[0])

  def measure(b):  # each batch costs 1 s of the fake clock
    seen.append(b)
    clock[0] += 1.0
    return {'frames_per_s': float(b)}

  # After batch 1 (1 s), 4.4 s more fit in 6 s; after batch 4 (2 s spent), they do not.
  s = device_check.batch_sweep(measure, 1 << 10, 6.0, device_check.jax_oom, step=4)
  assert seen == [1, 4] and s['stopped'] == 'budget' and s['best_batch'] == 4
  clock[0], seen[:] = 0.0, []
  assert device_check.batch_sweep(measure, 1 << 10, 6.0, device_check.jax_oom, step=2)[
      'batches'] == [1, 2, 4, 8]  # 2.2 s predicted each time: fits after 1, 2 and 3 s


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
