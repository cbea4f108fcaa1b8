"""experiments/kernel_profile.py: XLA's per-kernel CPU trace of the forward, summed per kernel.

One subprocess (the trace flag must reach XLA before its backend starts) on the shipped 3 x 128
model at a small batch: the groups printed add up to the traced total, the dots are there (the
network's matmuls), and a loop's body is counted once per trip, its container not at all (two
blocks run each dot twice). Counts, not times: the suite's other worker shares the CPU.
"""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAD = re.compile(r'traced kernels ([\d.]+) ms per call, (\d+) kernels')
GROUP = re.compile(r'^ +([\d.]+) +(\d+) +([\d.]+) +([\d.]+)% +(\S+)$')


def _run(batch: int) -> tuple[float, int, dict[str, tuple[float, int]]]:
  cmd = [sys.executable, '-m', 'experiments.kernel_profile', '--checkpoint=ikgat_fast',
         f'--batch={batch}', '--calls=5', '--top=100']
  done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  total, kernels = HEAD.search(done.stdout).groups()
  groups = {m[5]: (float(m[1]), int(m[2]), float(m[3]))
            for m in map(GROUP.match, done.stdout.splitlines()) if m}
  return float(total), int(kernels), groups


def test_groups_add_up_and_loops_are_not_counted_twice():
  from ik_gat_jax import inference  # pylint: disable=import-outside-toplevel
  mb = inference.MICRO_BATCH_CPU
  total, kernels, groups = _run(mb)
  assert abs(sum(us for us, _, _ in groups.values()) / 1e3 - total) < 0.002 + 0.01 * total
  assert sum(n for _, n, _ in groups.values()) == kernels
  assert groups['dot'][1] >= 3 and 'while' not in groups, groups  # one block: no loop
  assert groups['dot'][2] == groups['dot'][1], groups['dot']  # each dot runs once a call
  _, _, groups2 = _run(2 * mb)  # two blocks: a loop whose body runs twice
  assert 'while' not in groups2, groups2
  dot, dot2 = groups['dot'], groups2['dot']
  assert dot2[2] >= 2 * dot[2] and dot2[2] < dot2[1] * 2 + 0.5, (dot, dot2)
