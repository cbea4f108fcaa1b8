"""experiments/bench_forward.py: the matmul and the network timed in turn, shares per round.

One subprocess run at two batch sizes and two rounds, with a short real clip solved by the
solver's clip path each round; the summary's share must be the median of the rounds' own shares
(each of its round's matmul), not a rate over one early matmul.
"""

import concurrent.futures
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
ROUND = re.compile(r'^round (\d+): batch +(\d+): .* ([\d,]+) frames/s .*, ([\d.]+)% of the matmul')
MATMUL = re.compile(r'^round (\d+): float32 2048 x 2048 matmul ([\d.]+) GFLOP/s')
CLIP_ROUND = re.compile(r'^round (\d+): clip +(\d+) frames: ([\d.]+) s, ([\d,]+) frames/s, '
                        r'([\d.]+)% of the matmul')
CLIP_SUMMARY = re.compile(r'^clip +(\d+) frames: median ([\d.]+) s, ([\d,]+) frames/s, ([\d.]+)% '
                          r'of its round\'s matmul')
SUMMARY = re.compile(r'^batch +(\d+): median .* ([\d.]+)% of its round\'s matmul \(range '
                     r'([\d.]+)-([\d.]+)%\)')


def test_rounds_interleave_matmul_and_network_and_summarise_per_round_shares(cmu_dir):
  clip = cmu_dir / '09_03.bvh'
  cmd = [sys.executable, '-m', 'experiments.bench_forward', '--batches=1,2', '--calls=20',
         '--rounds=2', f'--clip={clip}']
  done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  lines = done.stdout.splitlines()
  rates = {int(m[1]): float(m[2]) for m in map(MATMUL.match, lines) if m}
  shares = {}
  for m in filter(None, map(ROUND.match, lines)):
    shares.setdefault(int(m[2]), []).append(float(m[4]))
  summary = {int(m[1]): (float(m[2]), float(m[3]), float(m[4]))
             for m in map(SUMMARY.match, lines) if m}
  assert sorted(rates) == [1, 2] and all(r > 0 for r in rates.values()), done.stdout
  assert sorted(shares) == sorted(summary) == [1, 2], done.stdout
  # The matmul of each round comes before that round's batches (interleaved, not once first).
  order = [l.split(':')[0] for l in lines if l.startswith('round ')]
  assert order.index('round 2') > order.index('round 1') + 2, done.stdout
  for b, (median, low, high) in summary.items():
    assert len(shares[b]) == 2
    np.testing.assert_allclose(median, np.median(shares[b]), atol=0.11)  # three roundings
    np.testing.assert_allclose([low, high], [min(shares[b]), max(shares[b])], atol=0.051)
  # The clip: every frame of the file solved once per round, after that round's matmul.
  from ik_gat_jax import skeleton
  from ik_gat_jax.io import exports
  frames = len(exports.read_positions(clip, skeleton.get_rig('cmu_body')).positions)
  rounds = [m for m in map(CLIP_ROUND.match, lines) if m]
  assert [int(m[1]) for m in rounds] == [1, 2] and {int(m[2]) for m in rounds} == {frames}
  for m in rounds:  # frames/s as printed follows from the seconds as printed (to 0.5 ms)
    seconds, fps = float(m[3]), float(m[4].replace(',', ''))
    assert frames / (seconds + 5e-4) - 1 <= fps <= frames / max(seconds - 5e-4, 1e-9) + 1, m[0]
  (summary_clip,) = [m for m in map(CLIP_SUMMARY.match, lines) if m]
  np.testing.assert_allclose(float(summary_clip[4]), np.median([float(m[5]) for m in rounds]),
                             atol=0.11)


def test_dims_and_several_block_sizes_and_bad_specs():
  """`--dims=WIDTHxBLOCKS` builds the checkpoint's config at that size (its parameter count and
  XLA's FLOPs shrink with it); `--micro_batch=1,0` times both block sizes in every round
  (`--pin_threads` said in the header); a
  malformed spec of either is a one-line error, exit status 2. In a
  subprocess: importing a main would define its flags in this process."""
  from ik_gat_jax import inference, model
  base, _ = inference.load_model(inference.SHIPPED_IKGAT)
  cmd = [sys.executable, '-m', 'experiments.bench_forward', '--batches=2', '--calls=20',
         '--rounds=2', '--pin_threads', '--nomatmul', '--micro_batch=1,0', '--dims=192x2']
  done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  m = re.search(r'width 192, 2 blocks, ([\d,]+) parameters', done.stdout)
  assert m, done.stdout
  assert int(m[1].replace(',', '')) < model.param_count(base) / 3, done.stdout
  assert '1 thread(s) per batch, pinned' in done.stdout, done.stdout
  flops = float(re.search(r'([\d.]+) MFLOP/frame', done.stdout)[1])
  assert 0 < flops < 5.0, done.stdout  # the base computes 15.9
  # Several block sizes: each timed in every round and summarised, labelled.
  for mb in (1, 0):
    label = f'batch     2 (blocks of {mb}): median'
    assert [l.split(': ')[0] for l in done.stdout.splitlines() if label in l] == [
        'round 1', 'round 2', f'batch     2 (blocks of {mb})'], done.stdout
  bad = subprocess.run(cmd[:-1] + ['--dims=wide'], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
  assert bad.returncode == 2 and 'WIDTHxBLOCKS' in bad.stderr, bad.stderr[-2000:]
  bad = subprocess.run(cmd[:-2] + ['--micro_batch=32,32'], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
  assert bad.returncode == 2 and 'distinct block sizes' in bad.stderr, bad.stderr[-2000:]


@pytest.mark.skipif(not hasattr(os, 'sched_setaffinity'), reason='Linux thread affinity')
def test_pinning_initializer_gives_each_thread_a_core_of_its_own():
  """`--pin_threads`' initializer: each pool thread on one core of the process's, no two on the
  same; more threads than cores is a one-line error. The calling thread stays unpinned."""
  from experiments.common import pinning_initializer
  cores = sorted(os.sched_getaffinity(0))
  n = len(cores)
  with concurrent.futures.ThreadPoolExecutor(n, initializer=pinning_initializer(n)) as pool:
    barrier = threading.Barrier(n)  # every thread of the pool runs one of the calls

    def affinity(_):
      barrier.wait(timeout=30)
      return sorted(os.sched_getaffinity(0))

    got = list(pool.map(affinity, range(n)))
  assert sorted(got) == [[c] for c in cores]
  assert sorted(os.sched_getaffinity(0)) == cores
  with pytest.raises(ValueError, match=f'cannot pin {n + 1} threads to a core each: this '
                     f'process may use {n} core'):
    pinning_initializer(n + 1)
