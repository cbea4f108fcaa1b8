"""The benchmark suite: the --smoke run on real frames, its JSON, tables and plots; discovery;
the timing helpers (on a fake clock: known answers). Speed numbers are benchmarks, not
asserted here."""

import json
import math
import subprocess
import sys
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import benchmark_suite as benchmark
from ik_gat_jax import bone_frames, data, evaluation, inference, iterative_ik, skeleton
from ik_gat_jax import model as model_lib

SECTIONS = ('accuracy', 'speed', 'block_sweep', 'pareto', 'noise', 'init_robustness', 'bf16',
            'ratios', 'matmul')


@pytest.fixture(scope='module')
def checkpoints_dir(tiny_ikgat_run, tiny_prior_run, tmp_path_factory):
  """A --checkpoints directory holding the tiny IK-GAT run and the tiny prior (as links)."""
  root = tmp_path_factory.mktemp('bench_checkpoints')
  (root / 'runs').mkdir()
  (root / 'runs' / 'ikgat_tiny').symlink_to(tiny_ikgat_run, target_is_directory=True)
  (root / 'prior').symlink_to(tiny_prior_run, target_is_directory=True)
  return root


@pytest.fixture(scope='module')
def smoke(cmu_shards, checkpoints_dir, tmp_path_factory):
  """The --smoke suite in-process on the val split of the session shards."""
  out = tmp_path_factory.mktemp('bench_out')
  lines = []
  t = time.perf_counter()
  result = benchmark.run_suite(cmu_shards, out, benchmark.preset('smoke', split='val'),
                               benchmark.resolve_checkpoints(checkpoints_dir, None),
                               log=lines.append, command='pytest smoke')
  print(f'smoke suite: {time.perf_counter() - t:.1f} s')
  return result, out, lines


def _numbers(x, path=''):
  """Every (path, value) leaf under x, skipping method settings (configs hold None)."""
  if isinstance(x, dict):
    for k, v in x.items():
      if k != 'settings':
        yield from _numbers(v, f'{path}/{k}')
  elif isinstance(x, list):
    for i, v in enumerate(x):
      yield from _numbers(v, f'{path}/{i}')
  else:
    yield path, x


def test_discovery_names_sizes_and_finds_the_prior(checkpoints_dir, tiny_prior_run):
  found = benchmark.discover_checkpoints(checkpoints_dir)
  assert list(found.ikgat) == ['tiny']
  assert found.prior.resolve() == tiny_prior_run.resolve()
  assert benchmark.default_data_dir(found) is not None


def test_smoke_json_has_every_section_and_method(smoke):
  r, _, _ = smoke
  assert r['mode'] == 'smoke' and not r['skipped']
  methods = {'ikgat_tiny', 'ikgat_tiny_bf16', 'ikgat_tiny+bf16_products', 'iterative',
             'iterative_identity_root',
             'iterative_fit_translation', 'iterative_noprior', 'swing', 'mean_pose'}
  assert set(r['accuracy']) == methods
  for res in r['accuracy'].values():
    assert res['frames'] == r['data']['subset_frames'] == 64
    assert {'per_part', 'per_subject', 'per_file', 'per_joint'} <= set(res)
  assert set(r['speed']) == methods - {'iterative_identity_root', 'iterative_fit_translation'}
  for s in r['speed'].values():
    assert s['latency']['p99_ms'] >= s['latency']['median_ms'] > 0
  assert set(r['speed']['ikgat_tiny']['throughput']) == {'64', '256'}
  assert set(r['speed']['iterative']['throughput']) == {'64'}  # capped at 64 in smoke
  assert r['speed']['iterative']['capped_batches'] == [256]
  assert r['block_sweep']['ikgat_tiny']['best_block'] in (64, 256)
  iters = sorted(p['iters'] for p in r['pareto'] if p['family'] == 'iterative')
  assert iters == [5, 10]
  assert {p['name'] for p in r['pareto']} >= {'ikgat_tiny', 'swing', 'mean_pose'}
  assert [c['noise_mm'] for c in r['noise']['ikgat_tiny']] == [0.0, 20.0]
  assert set(r['noise']) >= {'ikgat_tiny', 'swing', 'iterative', 'iterative_noprior',
                            'iterative_fit_translation'}
  assert set(r['init_robustness']['iterative']) == {'analytic_root', 'identity_root',
                                                     'analytic_root_yaw90'}
  assert set(r['bf16']) == {'ikgat_tiny', 'ikgat_tiny+bf16_products'}
  products = r['bf16']['ikgat_tiny+bf16_products']
  assert products['bfloat16'] == 'large products'
  # bfloat16 inputs with float32 sums move the rotations by a rounding of the inputs (the
  # shipped base: +0.001 deg, BENCHMARKS.md; this tiny model: about 0.001 here); a product on
  # wrong rows moves the error by degrees, so 0.5 leaves a wide margin. Not exactly 0: the
  # rounding was applied (float32 products in its place would give the same error).
  assert 0 < abs(products['local_rot_err_change_deg']) < 0.5, products
  assert set(r['ratios']['pairs']) >= {'ikgat_tiny/iterative'}
  assert r['provenance']['jax_version'] == jax.__version__


def test_smoke_numbers_are_finite(smoke):
  r, _, _ = smoke
  for section in SECTIONS:
    for path, v in _numbers(r[section], section):
      assert v is not None, path
      if isinstance(v, float):
        assert math.isfinite(v), path
  # The swing floor reproduces clean positions; noise makes it worse.
  assert r['accuracy']['swing']['mpjpe_mm'] < 0.01
  assert r['noise']['swing'][1]['local_rot_err_deg'] > r['noise']['swing'][0][
      'local_rot_err_deg']


def test_benchmark_rows_match_experiments_evaluate(smoke, cmu_shards):
  """The suite's mean-pose row is what evaluation.evaluate gives on the same frames."""
  r, _, _ = smoke
  ds = data.load_shards(cmu_shards, 'val')
  method = evaluation.make_method('mean_pose', ds.rig, chunk=64,
                                  train_data=data.load_shards(cmu_shards, 'train'))
  ref = evaluation.evaluate(method, ds, ds.rig, max_frames=64)
  for field in ('local_rot_err_deg', 'root_rot_err_deg', 'mpjpe_mm'):
    np.testing.assert_allclose(r['accuracy']['mean_pose'][field], ref[field], rtol=1e-6)


def test_smoke_writes_json_tables_and_pngs(smoke, tmp_path):
  r, out, lines = smoke
  assert json.loads((out / 'benchmark.json').read_text()) == r
  tables = (out / 'tables.md').read_text()
  for title in ('## Accuracy', '## Per subject', '## Per file', '## Pareto', '## Noise',
                '## Initial pose', '## Per joint', '## Speed', '## IK-GAT block-size sweep',
                '## IK-GAT in bfloat16', '## IK-GAT over iterative IK', 'machine:'):
    assert title in tables, title
  for name in benchmark.PLOTS:
    assert (out / name).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n', name
  assert not list(out.glob('*.tmp*'))
  assert any('accuracy ikgat_tiny' in line for line in lines)  # progress printed
  benchmark.write_outputs(r, tmp_path)  # rebuilt from the JSON alone
  assert (tmp_path / 'tables.md').read_text() == tables
  # The Pareto and noise plots' numbers read back from tables.md (--replot_tables), to the
  # tables' rounding, and drawn again.
  back = benchmark.plot_data_from_tables(tables)
  assert [p['name'] for p in back['pareto']] == [p['name'] for p in r['pareto']]
  for p, q in zip(back['pareto'], r['pareto']):
    assert (p['family'], p['iters'], p['batch']) == (q['family'], q.get('iters'), q['batch'])
    assert abs(p['local_rot_err_deg'] - q['local_rot_err_deg']) <= 0.005 + 1e-9
    assert abs(p['ms_per_frame'] - q['ms_per_frame']) <= 5e-5 + 1e-9
  assert list(back['noise']) == list(r['noise'])
  for name, curve in r['noise'].items():
    assert [c['noise_mm'] for c in back['noise'][name]] == [c['noise_mm'] for c in curve]
    assert all(abs(a['local_rot_err_deg'] - b['local_rot_err_deg']) <= 0.005 + 1e-9
               for a, b in zip(back['noise'][name], curve))
  drawn = benchmark.replot_from_tables(out / 'tables.md', tmp_path / 'replot')
  assert [p.read_bytes()[:4] for p in drawn] == [b'\x89PNG'] * 2


def test_missing_prior_skips_only_the_prior_solver(cmu_shards, tiny_ikgat_run, monkeypatch,
                                                   tmp_path):
  monkeypatch.setattr(inference, 'SHIPPED_PRIOR', tmp_path / 'no_prior')
  monkeypatch.setattr(inference, 'SHIPPED_IKGAT', tmp_path / 'no_ikgat')
  found = benchmark.resolve_checkpoints(None, None)
  assert found.prior is None and not found.ikgat
  found.ikgat['tiny'] = tiny_ikgat_run
  lines = []
  ctx = benchmark.build_context(cmu_shards, found, benchmark.preset('smoke', split='val'),
                                lines.append)
  assert 'iterative' in ctx.skipped and any('skipping iterative' in s for s in lines)
  assert set(ctx.methods) == {'ikgat_tiny', 'ikgat_tiny_bf16', 'ikgat_tiny+bf16_products',
                              'iterative_noprior', 'swing', 'mean_pose'}
  assert list(ctx.families) == ['iterative_noprior']


class _Clock:
  """Stands in for the benchmark module's `time`: `perf_counter` moves by `tick` per call and
  otherwise only when a workload advances it, so the timing helpers' arithmetic has known
  answers whatever this machine's speed (no speed is asserted)."""

  def __init__(self, tick: float = 0.0):
    self.now, self.tick = 0.0, tick

  def perf_counter(self) -> float:
    self.now += self.tick
    return self.now


class _Workload:
  """A jitted `p + o` that takes exactly `seconds` on `clock`, counting its calls and frames."""

  def __init__(self, clock: _Clock, seconds: float):
    self.clock, self.seconds, self.calls, self.frames = clock, seconds, 0, 0
    self._f = jax.jit(lambda p, o: p + o)

  def __call__(self, p, o):
    self.calls += 1
    self.frames += int(p.shape[0])
    self.clock.now += self.seconds
    return self._f(p, o)


X8 = jnp.ones((8, 21, 3))


def test_time_calls_counts_one_untimed_call_and_stops_by_its_rule(monkeypatch):
  clock = _Clock()
  monkeypatch.setattr(benchmark, 'time', clock)
  work = _Workload(clock, 0.5)
  times, first = benchmark.time_calls(lambda: work(X8, X8), min_calls=3, max_calls=7,
                                      seconds=1e9)
  assert work.calls == 1 + 7 and first == 0.5  # the untimed first call, then max_calls
  np.testing.assert_array_equal(times, np.full(7, 0.5))
  work.calls = 0
  times, _ = benchmark.time_calls(lambda: work(X8, X8), min_calls=3, max_calls=200, seconds=2.0)
  assert work.calls == 1 + 4 and len(times) == 4  # 4 calls of 0.5 s reach 2 s (after >= 3)
  work.calls = 0
  times, _ = benchmark.time_calls(lambda: work(X8, X8), min_calls=3, max_calls=200, seconds=0.0)
  assert work.calls == 1 + 3 and len(times) == 3  # min_calls, however fast


def test_latency_and_throughput_of_a_known_workload(monkeypatch):
  clock = _Clock()
  monkeypatch.setattr(benchmark, 'time', clock)
  work = _Workload(clock, 0.5)
  lat = benchmark.latency(work, X8, X8, calls=30, max_seconds=1e9)
  assert work.calls == 1 + 30 and work.frames == 31  # batch 1: one frame per call
  assert lat == {'median_ms': 500.0, 'p99_ms': 500.0, 'frames_per_s': 2.0, 'calls': 30,
                 'compile_s': 0.5}
  work.calls = 0
  assert benchmark.latency(work, X8, X8, calls=30, max_seconds=0.0)['calls'] == 10
  assert work.calls == 1 + 10  # at least 10 calls when they take longer than max_seconds
  work.calls = work.frames = 0
  thr = benchmark.throughput(work, X8, X8, min_seconds=0.0)
  assert work.calls == 1 + 3 and work.frames == 8 * 4
  assert thr == {'batch': 8, 'frames_per_s': 16.0, 'ms_per_frame': 62.5, 'seconds_per_call': 0.5,
                 'calls': 3, 'compile_s': 0.5}
  work.calls = work.frames = 0
  blk = benchmark.blocked_throughput(work, X8, X8, 4, min_seconds=0.0)
  assert work.calls == 2 * (1 + 3) and work.frames == 8 * 4  # 2 blocks of 4 frames per call
  assert blk == {'batch': 8, 'block': 4, 'frames_per_s': 8.0, 'ms_per_frame': 125.0,
                 'calls': 3, 'compile_s': 1.0}
  # Median, not mean: one slow call among three does not move frames/s.
  durations = iter([0.5, 0.25, 4.0, 0.25])
  def uneven(p, o):
    clock.now += next(durations)
    return p + o
  thr = benchmark.throughput(uneven, X8, X8, min_seconds=0.0)
  assert thr['seconds_per_call'] == 0.25 and thr['frames_per_s'] == 32.0


def test_matmul_gflops_is_2n3_over_the_median_call(monkeypatch):
  monkeypatch.setattr(benchmark, 'time', _Clock(tick=0.25))  # every timed interval: 0.25 s
  r = benchmark.matmul_gflops(64, min_seconds=0.0)
  assert r['seconds'] == 0.25 and r['n'] == 64 and r['dtype'] == 'float32'
  np.testing.assert_allclose(r['gflops_per_s'], 2 * 64**3 / 0.25 / 1e9, rtol=1e-12)


def test_flop_count_of_a_known_matmul():
  """XLA's cost analysis counts a [m, k] @ [k, n] matmul as 2 m n k FLOPs; the benchmark's
  FLOPs-per-frame divides by the leading (frame) axis."""
  m, k, n, frames = 16, 32, 24, 8
  b = jnp.ones((k, n))
  cost = jax.jit(jnp.matmul).lower(jnp.ones((m, k)), b).compile().cost_analysis()
  assert benchmark._cost_flops(cost) == 2 * m * n * k  # pylint: disable=protected-access
  assert benchmark._cost_flops([cost]) == 2 * m * n * k  # older jax: a list of one dict
  assert math.isnan(benchmark._cost_flops({})) and math.isnan(benchmark._cost_flops([]))
  per_frame = iterative_ik.flops_per_frame(lambda x: x @ b, jnp.ones((frames, m, k)))
  assert per_frame == 2 * m * n * k


def test_flops_per_frame_are_counted_on_one_block():
  """XLA counts a loop body once, so an IK-GAT batch of several blocks (`lax.map` on the CPU)
  reads low per frame; `inference.flop_frames()` frames (at most one block, what the benchmark
  and the ablations count on) read what one frame unblocked does."""
  rig = skeleton.cmu_body()
  net = model_lib.create_model(model_lib.ModelConfig(size='tiny'), rig, nnx.Rngs(0))
  B = bone_frames.bone_frames(jnp.asarray(rig.template(), jnp.float32), rig)[None]
  forward = lambda p: inference.ikgat_infer(net, {'positions': p, 'bone_frames': B})
  per = lambda n: iterative_ik.flops_per_frame(forward, jnp.ones((n, rig.num_joints, 3)))
  n, one = inference.flop_frames(), per(1)
  assert 1 <= n <= 64 and (inference.micro_batch_size() == 0 or n <= inference.micro_batch_size())
  # XLA's cost model reads a few percent apart for one frame and for n (jaxlib 0.10.2: 0.1%,
  # 0.11.2: 2.7%, the tiny model); a loop body counted once would read half or less.
  np.testing.assert_allclose(per(n), one, rtol=0.05)
  if inference.micro_batch_size():  # four blocks: the body counted once, a quarter per frame
    assert per(4 * inference.micro_batch_size()) < 0.5 * one


def test_cli_missing_checkpoints_is_one_line_nonzero(tmp_path):
  p = subprocess.run([sys.executable, '-m', 'experiments.benchmark', f'--output_dir={tmp_path}',
                      f'--checkpoints={tmp_path / "nope"}', '--smoke'],
                     capture_output=True, text=True, timeout=120)
  assert p.returncode != 0
  assert 'does not exist' in p.stderr.strip().splitlines()[-1]
  assert not (tmp_path / 'benchmark.json').exists()


def test_cli_refusals_leave_no_output_dir(cmu_shards, tmp_path):
  """A refused benchmark leaves no --output_dir behind (nor its missing parents): a bad
  --max_frames or --iters is refused before the folder is made, a missing split (found once
  the suite starts) removes the folder it made."""
  runs = {'frames': ['--max_frames=-4'], 'iters': ['--iters=0'], 'split': ['--split=nosuch']}
  procs = {k: subprocess.Popen(
      [sys.executable, '-m', 'experiments.benchmark', f'--output_dir={tmp_path / k / "rb"}',
       '--smoke', f'--data={cmu_shards}', *args], text=True, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE) for k, args in runs.items()}
  said = {}
  for k, p in procs.items():
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, (k, out[-2000:], err[-2000:])
    said[k] = err.strip().splitlines()
  assert said == {
      'frames': ['error: --max_frames must be a number of frames >= 0 (0: the whole split), '
                 'got -4'],
      'iters': ['error: --iters must be a positive number of iterations, got 0'],
      'split': [f"error: {cmu_shards} has no split 'nosuch'; it has: train, val"]}
  assert list(tmp_path.iterdir()) == []
