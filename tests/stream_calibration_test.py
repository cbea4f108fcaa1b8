"""experiments/stream_calibration.py: a stream's subject calibration by the time into each clip,
checked against the evaluation's own numbers."""

from pathlib import Path
import subprocess
import sys

import pytest

from experiments import stream_calibration
from ik_gat_jax import data, evaluation
from ik_gat_jax.solver import IKSolver


def test_windows_are_parsed_and_bad_ones_refused():
  assert stream_calibration.parse_windows(['0:30', '30:300', '0:']) == [
      (0, 30), (30, 300), (0, None)]
  for bad in ('5', '30:10', 'a:b', '-1:5', '3:3'):
    with pytest.raises(ValueError, match='--windows'):
      stream_calibration.parse_windows([bad])


def test_the_clip_and_the_plain_rows_agree_with_the_evaluation(cmu_shards):
  ds = data.load_shards(cmu_shards, 'val')
  solver = IKSolver.from_checkpoint(expected_rig=ds.rig, size_normalization=False)  # as evaluate
  res = stream_calibration.run(ds, solver, [0.0], [(0, 30), (0, None)])[0.0]
  method = evaluation.ikgat_method(None, ds.rig)
  for way, on in (('none', False), ('clip', True)):
    want = evaluation.evaluate(method, ds, ds.rig, subject_calibration=on)
    assert res[way]['0:'] == pytest.approx(want['local_rot_err_deg'], abs=1e-3), way
  # Clean input: calibrated as a stream or as a clip, the whole split's error is below the
  # network's alone (the same holds for the unseen subject, BENCHMARKS.md).
  assert res['stream']['0:'] < res['none']['0:'] and res['clip']['0:'] < res['none']['0:']
  assert all(v['0:30'] is not None for v in res.values())


def test_the_command_line_refuses_a_subject_not_there(cmu_shards):
  p = subprocess.run([sys.executable, '-m', 'experiments.stream_calibration',
                      f'--data={cmu_shards}', '--split=val', '--subject=nobody',
                      '--noise_mm=0'], cwd=Path(__file__).resolve().parents[1],
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
      "error: no file of subject 'nobody' in the val split"), p.stderr[-2000:]
