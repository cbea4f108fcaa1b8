"""Tests for the solve command: ik_gat_jax.solve (solve_file, the absl main) and ik_gat_jax.cli.

Most cases call `solve_file` in-process (the main is a thin flag parser around it); one runs
`python -m ik_gat_jax.solve` end to end in a subprocess.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ik_gat_jax import cli
from ik_gat_jax import solve
from ik_gat_jax.io import bvh
from ik_gat_jax.solver import InputError

from solver_test import get_solver, posed_clip, tiny_checkpoint  # noqa: I100 (shared helpers)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def ckpt(tmp_path_factory):
  return str(tiny_checkpoint(tmp_path_factory))


@pytest.fixture(scope='module')
def clip_npz(tmp_path_factory):
  solver = get_solver(tmp_path_factory)
  pos = posed_clip(solver.rig, solver.offsets, T=6, scale=0.3)
  path = tmp_path_factory.mktemp('inputs') / 'walk.npz'
  np.savez(path, positions=pos, fps=30.0)
  return path, pos


def _quiet(msg):
  del msg


def _leftovers(directory: Path) -> list[str]:
  return sorted(p.name for p in directory.iterdir() if '.tmp' in p.name)


@pytest.mark.filterwarnings('ignore:up axis looks wrong')  # an untrained model's poses
def test_npz_to_bvh_and_npz(ckpt, clip_npz, tmp_path):
  path, pos = clip_npz
  summary = solve.solve_file(path, tmp_path / 'out.bvh', checkpoint=ckpt, log=_quiet)
  assert summary['frames'] == 6 and summary['rig'] == 'cmu_body'
  motion = bvh.read_bvh(tmp_path / 'out.bvh')
  assert motion.num_frames == 6 and motion.fps == pytest.approx(30.0)
  solve.solve_file(path, tmp_path / 'out.npz', checkpoint=ckpt, log=_quiet)
  with np.load(tmp_path / 'out.npz') as z:
    assert z['local_rot'].shape == (6, 21, 3, 3) and z['positions_fk'].shape == (6, 21, 3)
    assert list(z['joint_names'])[:2] == ['Hips', 'LowerBack'] and float(z['fps']) == 30.0
    order = [motion.names.index(n) for n in z['joint_names']]
    np.testing.assert_allclose(bvh.naive_fk_np(motion, 0.01)[:, order], z['positions_fk'],
                               atol=1e-4)
    fk = z['positions_fk']
  # Re-solving the written BVH: its positions are the first solve's FK positions.
  solve.solve_file(tmp_path / 'out.bvh', tmp_path / 'again.npz', checkpoint=ckpt, log=_quiet)
  with np.load(tmp_path / 'again.npz') as z:
    np.testing.assert_allclose(z['positions'], fk, atol=1e-4)
  assert _leftovers(tmp_path) == []


def test_csv_input_with_units(ckpt, clip_npz, tmp_path):
  _, pos = clip_npz
  csv = tmp_path / 'walk.csv'
  csv.write_text('\n'.join(','.join(f'{v:.6f}' for v in row) for row in 100 * pos.reshape(6, -1)))
  with pytest.warns(UserWarning, match='looks like centimetres: pass --units=cm'):
    solve.solve_file(csv, tmp_path / 'a.npz', checkpoint=ckpt, log=_quiet)
  solve.solve_file(csv, tmp_path / 'b.npz', checkpoint=ckpt, units='cm', log=_quiet)
  with np.load(tmp_path / 'b.npz') as z:
    np.testing.assert_allclose(z['positions'], pos, atol=1e-6)


def test_overwrite_and_atomicity(ckpt, clip_npz, tmp_path):
  path, pos = clip_npz
  out = tmp_path / 'out.npz'
  out.write_bytes(b'old')
  with pytest.raises(FileExistsError, match='pass --overwrite'):
    solve.solve_file(path, out, checkpoint=ckpt, log=_quiet)
  assert out.read_bytes() == b'old'
  bad = pos.copy()
  bad[4, 2] = np.nan
  np.savez(tmp_path / 'bad.npz', positions=bad)
  with pytest.raises(InputError, match=r'frame 4, joint 2 \(Spine\)'):
    solve.solve_file(tmp_path / 'bad.npz', out, checkpoint=ckpt, overwrite=True, log=_quiet)
  assert out.read_bytes() == b'old'  # a failing solve leaves the old output as it was
  with pytest.raises(ValueError, match='outside the clip'):  # fails after solving, mid-write
    solve.solve_file(path, tmp_path / 'new.bvh', checkpoint=ckpt, plot=str(tmp_path / 'p.png'),
                     plot_frames='0,99', log=_quiet)
  assert not (tmp_path / 'new.bvh').exists() and not (tmp_path / 'p.png').exists()
  solve.solve_file(path, out, checkpoint=ckpt, overwrite=True, log=_quiet)
  with np.load(out) as z:
    assert z['local_rot'].shape == (6, 21, 3, 3)
  assert _leftovers(tmp_path) == []


def test_smpl_output_refused_for_cmu_rig(ckpt, clip_npz, tmp_path):
  path, _ = clip_npz
  with pytest.raises(InputError, match='need the smpl22 rig'):
    solve.solve_file(path, tmp_path / 'x.smpl.npz', checkpoint=ckpt, log=_quiet)
  assert list(tmp_path.iterdir()) == []


def test_smpl_rig_end_to_end(tmp_path_factory, tmp_path):
  smpl = get_solver(tmp_path_factory, 'smpl22')
  pos = posed_clip(smpl.rig, smpl.offsets, T=3)
  np.savez(tmp_path / 'in.npz', positions=pos)
  solve.solve_file(tmp_path / 'in.npz', tmp_path / 'out.smpl.npz',
                   checkpoint=str(tiny_checkpoint(tmp_path_factory, 'smpl22')),
                   smpl_npz=None, log=_quiet)
  with np.load(tmp_path / 'out.smpl.npz') as z:
    assert z['poses'].shape == (3, 66) and z['trans'].shape == (3, 3)


def test_plot_and_clips(ckpt, clip_npz, tmp_path):
  path, _ = clip_npz
  solve.solve_file(path, tmp_path / 'o.npz', checkpoint=ckpt, plot=str(tmp_path / 'cmp.png'),
                   plot_frames='0,5', clip=str(tmp_path / 'clip.gif'), clip_frames='0:3',
                   log=_quiet)
  assert (tmp_path / 'cmp.png').read_bytes()[:4] == b'\x89PNG'
  from PIL import Image
  with Image.open(tmp_path / 'clip.gif') as im:
    assert im.n_frames == 3
  solve.solve_file(path, tmp_path / 'o2.npz', checkpoint=ckpt, clip=str(tmp_path / 'frames'),
                   clip_frames='0:4:2', log=_quiet)
  assert sorted(p.name for p in (tmp_path / 'frames').iterdir()) == ['frame_0000.png',
                                                                     'frame_0001.png']
  assert _leftovers(tmp_path) == []


def test_cli_help_and_errors(capsys, tmp_path):
  assert cli.main(['ik-gat', '--help']) == 0
  assert 'solve' in capsys.readouterr().out
  assert cli.main(['ik-gat', 'frobnicate']) == 2
  assert 'unknown command' in capsys.readouterr().err
  assert cli.main(['ik-gat', 'solve', '--help']) == 0
  out = capsys.readouterr().out
  assert '--input' in out and '--input_axes' in out and '--overwrite' in out
  missing = tmp_path / 'missing.npz'
  code = cli.main(['ik-gat', 'solve', f'--input={missing}', f'--output={tmp_path / "o.bvh"}',
                   f'--checkpoint={tmp_path}'])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and err[0].startswith('error: input ') and 'does not exist' \
      in err[0]


def test_module_main_subprocess(ckpt, clip_npz, tmp_path):
  path, _ = clip_npz
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  cmd = [sys.executable, '-m', 'ik_gat_jax.solve', f'--input={path}',
         f'--output={tmp_path / "walk.bvh"}', f'--checkpoint={ckpt}']
  done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert 'solved 6 frames' in done.stderr
  assert bvh.read_bvh(tmp_path / 'walk.bvh').num_frames == 6
