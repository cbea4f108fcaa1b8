"""experiments/latency_breakdown.py: one live frame of `IKSolver.step` split into its parts.

One subprocess on the shipped 3 x 128 model, a few calls: every part is reported, the JSON is
what the text says, and the executable it times is `step`'s own (the model and the solver's
subject compiled in as constants: its entry takes the frame alone). Structure, not times: the
suite's other worker shares the CPU.
"""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The command's parts, in the order it prints them (not imported: its module defines absl flags,
# which another command's in this test process would clash with).
PARTS = ('step', 'step_lying', 'step_any_subject', 'host_checks', 'to_device', 'executable',
         'to_host', 'python_rest', 'dispatch_floor', 'numpy_reduction')


def test_every_part_reported_for_steps_own_executable(tmp_path):
  out = tmp_path / 'latency.json'
  cmd = [sys.executable, '-m', 'experiments.latency_breakdown', '--checkpoint=ikgat_fast',
         '--calls=40', f'--json={out}']
  done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(out.read_text())
  ms = result['ms']
  assert set(PARTS) <= set(ms), sorted(ms)
  for k in PARTS:
    assert f'{k:16s} {ms[k]:7.3f} ms' in done.stdout, k
  assert ms['step'] > 0 and ms['executable'] > 0 and ms['dispatch_floor'] > 0, ms
  assert result['kernels'].get('parameter') == 1, result['kernels']  # the frame alone
  assert result['kernels']['dot'] >= 3 and result['flops_per_frame'] > 1e6, result
