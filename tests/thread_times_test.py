"""experiments/thread_times.py: the CPU time of each thread while the solver solves a clip.

One subprocess (the live backend must start before JAX does): the sparse attention form on two
workers in a live process, whose chunks all run on XLA's one intra-op thread while the workers
wait (BENCHMARKS.md, issue N session 34): that thread, `tf_XLAEigen`, must hold most of the CPU
time, the workers little. CPU seconds, not timings: the split is XLA's mechanism, not the
machine's speed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not os.path.isdir('/proc/self/task'), reason='Linux thread times')
def test_sparse_chunks_in_a_live_process_run_on_the_one_pool_thread(cmu_dir, tmp_path):
  out = tmp_path / 'threads.json'
  cmd = [sys.executable, '-m', 'experiments.thread_times', f'--clip={cmu_dir / "01_06.bvh"}',
         '--attention=sparse', '--workers=2', '--solves=2', '--live_backend', f'--json={out}']
  done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  got = json.loads(out.read_text())
  assert got['attention'] == 'sparse' and got['workers'] == 2 and got['live_backend']
  assert got['frames_per_s'] > 0 and got['cpu_s'] > 0
  listed = sum(got['threads'].values()) + got['ended_threads_s']
  assert 0.8 * got['cpu_s'] <= listed <= got['cpu_s'] + 0.05 * (len(got['threads']) + 1), got
  pool = sum(s for name, s in got['threads'].items() if name.startswith('tf_XLAEigen'))
  assert pool > 0.5 * got['cpu_s'] and pool > 3 * got['ended_threads_s'], got
  assert 'threads that ended meanwhile' in done.stdout, done.stdout
