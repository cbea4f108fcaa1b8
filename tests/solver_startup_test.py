"""experiments/solver_startup.py: three solvers one after another in one process; the second
(same checkpoint and subject) traces nothing, the third (another subject) only its `step`.
Trace counts, not timings: which programs a solver compiles is the mechanism measured."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_second_solver_compiles_nothing_and_another_subject_only_its_step(cmu_dir, tmp_path):
  out = tmp_path / 'startup.json'
  done = subprocess.run([sys.executable, '-m', 'experiments.solver_startup',
                         f'--clip={cmu_dir / "07_05.bvh"}', '--frames=8', f'--json={out}'],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads(out.read_text())
  assert [r['traces'] for r in rows] == [2, 0, 1], rows
  assert [r['subject_scale'] for r in rows] == [1.0, 1.0, 1.05]
  assert all(r['frames'] == 8 and r['first_step_s'] > 0 for r in rows)
  assert done.stdout.count('\nsolver ') + done.stdout.startswith('solver ') == 3, done.stdout
