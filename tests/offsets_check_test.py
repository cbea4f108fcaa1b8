"""experiments/offsets_check.py: what the rest offsets the solver is given change, checked
against the evaluation's own numbers."""

from pathlib import Path
import subprocess
import sys

import pytest

from experiments import offsets_check
from ik_gat_jax import data, evaluation
from ik_gat_jax.solver import IKSolver


def test_the_offsets_rows_agree_with_the_evaluation_and_fitting_keeps_the_rotations(cmu_shards):
  ds = data.load_shards(cmu_shards, 'val')
  solver = IKSolver.from_checkpoint(expected_rig=ds.rig, size_normalization=False)  # as evaluate
  res = offsets_check.run(ds, solver, [0.0])[0.0]
  print(offsets_check.table({0.0: res}))
  method = evaluation.ikgat_method(None, ds.rig)
  for name in ('subject', 'template'):
    want = evaluation.evaluate(method, ds, ds.rig, offsets=name)
    assert res[name]['local_rot_err_deg'] == pytest.approx(want['local_rot_err_deg'],
                                                          abs=1e-3), name
  # The subject's own skeleton plays clean input back as the evaluation's MPJPE says.
  want = evaluation.evaluate(method, ds, ds.rig)
  assert res['subject']['skeleton_to_truth_mm'] == pytest.approx(want['mpjpe_mm'], abs=1e-2)
  # Lengths and fitted offsets change the skeleton, never the rotations; the fitted skeleton
  # is the one nearest the input.
  for name in ('lengths', 'fitted'):
    assert res[name]['local_rot_err_deg'] == res['template']['local_rot_err_deg'], name
  assert res['fitted']['skeleton_to_input_mm'] < min(
      res[k]['skeleton_to_input_mm'] for k in ('template', 'lengths'))


def test_the_command_line_refuses_bad_noise(cmu_shards):
  p = subprocess.run([sys.executable, '-m', 'experiments.offsets_check',
                      f'--data={cmu_shards}', '--noise_mm=a'],
                     cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
      "error: --noise_mm: ['a'] are not numbers"), p.stderr[-2000:]
