"""Tests for the solve command: ik_gat_jax.solve (solve_file, the absl main) and ik_gat_jax.cli.

Most cases call `solve_file` in-process (the main is a thin flag parser around it); one runs
`python -m ik_gat_jax.solve` end to end in a subprocess.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from ik_gat_jax import cli
from ik_gat_jax import plots
from ik_gat_jax import skeleton
from ik_gat_jax import solve
from ik_gat_jax.io import bvh
from ik_gat_jax.io import exports
from ik_gat_jax.io.units import UNITS
from ik_gat_jax.solver import InputError, parse_input_axes

from solver_test import fk_np, get_solver, posed_clip, tiny_checkpoint  # noqa: I100 (helpers)

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
  said = []
  summary = solve.solve_file(path, tmp_path / 'out.bvh', checkpoint=ckpt, log=said.append)
  assert summary['frames'] == 6 and summary['rig'] == 'cmu_body'
  # Positions alone: the template's rest pose, said once.
  assert summary['offsets'] == 'template'
  assert sum("the rig's template" in m for m in said) == 1
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
    assert str(z['offsets_source']) == 'template'
  # Re-solving the written BVH: its positions are the first solve's FK positions.
  said.clear()
  summary = solve.solve_file(tmp_path / 'out.bvh', tmp_path / 'again.npz', checkpoint=ckpt,
                             log=said.append)
  assert summary['offsets'] == 'input' and not any("the rig's template" in m for m in said)
  with np.load(tmp_path / 'again.npz') as z:
    np.testing.assert_allclose(z['positions'], fk, atol=1e-4)
    assert str(z['offsets_source']) == 'input'
  # --fit_offsets: the same rotations on the skeleton they imply (solver_test checks the fit).
  summary = solve.solve_file(path, tmp_path / 'fit.npz', checkpoint=ckpt, fit_offsets=True,
                             log=_quiet)
  with np.load(tmp_path / 'fit.npz') as z, np.load(tmp_path / 'out.npz') as t:
    assert summary['offsets'] == 'fitted' and str(z['offsets_source']) == 'fitted'
    np.testing.assert_array_equal(z['local_rot'], t['local_rot'])
    assert not np.allclose(z['offsets'], t['offsets'])
  assert _leftovers(tmp_path) == []


@pytest.mark.filterwarnings('ignore:up axis looks wrong')  # an untrained model's poses
def test_attention_auto_gives_the_dense_solution(ckpt, tmp_path_factory, tmp_path):
  """`attention='auto'` (`--attention=auto`) runs the chunks' graph attention in its sparse form
  (70 frames: from gat.SPARSE_FROM frames on) and writes the dense form's solution: the same
  function, float32 round-off apart (1e-5 per rotation entry; attention weights 10% off move
  this untrained model's entries by ~1e-3)."""
  solver = get_solver(tmp_path_factory)
  path = tmp_path / 'long.npz'
  np.savez(path, positions=posed_clip(solver.rig, solver.offsets, T=70, scale=0.3), fps=30.0)
  out = {}
  for form in ('dense', 'auto'):
    solve.solve_file(path, tmp_path / f'{form}.npz', checkpoint=ckpt, attention=form, log=_quiet)
    with np.load(tmp_path / f'{form}.npz') as z:
      out[form] = z['local_rot']
  assert out['dense'].shape == (70, 21, 3, 3)
  np.testing.assert_allclose(out['auto'], out['dense'], atol=1e-5, rtol=0)
  # `--matmul_precision=bfloat16`: the products in bfloat16 (their rounding moves this
  # untrained model's entries by ~1e-5-1e-4), recorded in the summary.
  summary = solve.solve_file(path, tmp_path / 'b16.npz', checkpoint=ckpt, log=_quiet,
                             matmul_precision='bfloat16')
  assert summary['matmul_precision'] == 'bfloat16'
  with np.load(tmp_path / 'b16.npz') as z:
    assert 0 < np.abs(z['local_rot'] - out['dense']).max() < 1e-2


def test_csv_input_with_units(ckpt, clip_npz, tmp_path):
  _, pos = clip_npz
  csv = tmp_path / 'walk.csv'
  csv.write_text('\n'.join(','.join(f'{v:.6f}' for v in row) for row in 100 * pos.reshape(6, -1)))
  # No units given: refused, naming them (metres by default: bones 100x the template's).
  with pytest.raises(InputError, match=r'looks like centimetres: pass --units=cm \(no --units'):
    solve.solve_file(csv, tmp_path / 'a.npz', checkpoint=ckpt, log=_quiet)
  assert not (tmp_path / 'a.npz').exists()
  with pytest.warns(UserWarning, match='looks like centimetres: pass --units=cm'):  # given
    solve.solve_file(csv, tmp_path / 'a.npz', checkpoint=ckpt, units='mm', log=_quiet)
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
  # A frame past the clip is refused once the input is read, before solving (it was after,
  # throwing the solved output away with the picture); a spec of no form before the model loads.
  solved = []
  with pytest.raises(InputError, match=r'frames \[99\] outside the clip \(0..5\)'):
    solve.solve_file(path, tmp_path / 'new.bvh', checkpoint=ckpt, plot=str(tmp_path / 'p.png'),
                     plot_frames='0,99', log=solved.append)
  assert not any('solved' in m for m in solved), solved
  for spec in ('abc', '0:10:0', '1:2:3:4'):
    with pytest.raises(InputError, match='frames must be like 0,10,20 or 0:60:2'):
      solve.solve_file(path, tmp_path / 'new.bvh', checkpoint='/nonexistent', clip_frames=spec,
                       clip=str(tmp_path / 'c.gif'), log=_quiet)
  assert not (tmp_path / 'new.bvh').exists() and not (tmp_path / 'p.png').exists()
  solve.solve_file(path, out, checkpoint=ckpt, overwrite=True, log=_quiet)
  with np.load(out) as z:
    assert z['local_rot'].shape == (6, 21, 3, 3)
  assert _leftovers(tmp_path) == []


def test_outputs_that_collide_or_a_clip_that_is_no_gif_are_refused_before_solving(
    ckpt, clip_npz, tmp_path):
  """--plot naming --output's file (the PNG replaced the fresh npz, unasked) and --clip=x.mp4
  (an errno about a temp file) are refused in one line, nothing written."""
  path, _ = clip_npz
  out = tmp_path / 'same.npz'
  with pytest.raises(InputError, match=r'--output and --plot name the same file'):
    solve.solve_file(path, out, checkpoint=ckpt, plot=str(out), log=_quiet)
  with pytest.raises(InputError, match=r'--plot and --clip name the same file'):
    solve.solve_file(path, out, checkpoint=ckpt, plot=str(tmp_path / 'a.gif'),
                     clip=str(tmp_path / '.' / 'a.gif'), log=_quiet)
  # An output naming the input (a batch loop's --output=${f%.bvh}.bvh, with --overwrite):
  # refused, not solved over the mocap it reads.
  with pytest.raises(InputError, match=r'^--output names the file --input reads .*: an output '
                     'may not replace its input; give it its own name$'):
    solve.solve_file(path, path.parent / '.' / path.name, checkpoint=ckpt, overwrite=True,
                     log=_quiet)
  with pytest.raises(InputError, match=r'^--plot names the file --offsets_from reads'):
    solve.solve_file(path, out, checkpoint=ckpt, offsets_from=str(tmp_path / 'o.bvh'),
                     plot=str(tmp_path / 'o.bvh'), log=_quiet)
  with pytest.raises(NotADirectoryError, match=r'same.npz is a file, not a directory to write '
                     r'x.glb in$'):  # it said the directory did not exist
    (tmp_path / 'same.npz').write_bytes(b'')
    solve.solve_file(path, tmp_path / 'same.npz' / 'x.glb', checkpoint=ckpt, log=_quiet)
  (tmp_path / 'same.npz').unlink()
  with pytest.raises(InputError, match=r'--clip must be a .gif or a directory .* got .*x.mp4'):
    solve.solve_file(path, out, checkpoint=ckpt, clip=str(tmp_path / 'x.mp4'), log=_quiet)
  assert sorted(q.name for q in tmp_path.iterdir()) == []
  with pytest.raises(InputError, match=r'block_size must be >= 1'):
    solve.solve_file(path, out, checkpoint=ckpt, block_size=0, log=_quiet)


def test_an_unknown_joint_map_is_named_as_one(ckpt, cmu_dir, tmp_path):
  with pytest.raises(InputError, match=r"^no joint map 'nonexistent': neither a file nor a "
                     r'built-in joint map \(cmu_body\)'):
    solve.solve_file(cmu_dir / '07_05.bvh', tmp_path / 'o.npz', checkpoint=ckpt,
                     joint_map='nonexistent', log=_quiet)


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
  # An input whose joints carry other frames (a reference pose named for it) has no SMPL
  # parameters.
  ckpt = str(tiny_checkpoint(tmp_path_factory, 'smpl22'))
  solve.solve_file(tmp_path / 'in.npz', tmp_path / 'out.bvh', checkpoint=ckpt, log=_quiet)
  with pytest.raises(InputError, match="SMPL's own joint frames"):
    solve.solve_file(tmp_path / 'out.bvh', tmp_path / 'again.smpl.npz', checkpoint=ckpt,
                     reference_pose='first_frame', log=_quiet)


def test_plot_and_clips(ckpt, clip_npz, tmp_path):
  path, _ = clip_npz
  solve.solve_file(path, tmp_path / 'o.npz', checkpoint=ckpt, plot=str(tmp_path / 'cmp.png'),
                   plot_frames='0,5', clip=str(tmp_path / 'clip.gif'), clip_frames='0:3',
                   log=_quiet)
  assert (tmp_path / 'cmp.png').read_bytes()[:4] == b'\x89PNG'
  from PIL import Image
  with Image.open(tmp_path / 'clip.gif') as im:
    assert im.n_frames == 3 and im.info['duration'] == plots.gif_frame_ms([0, 1, 2], 30.0)
  # Each image shown for the time its frames span, in GIF's 10 ms units, at least 20 ms (a 0
  # or 10 ms delay plays as 100 ms in browsers): it was 1000 / fps, truncated, whatever the step.
  assert [plots.gif_frame_ms(f, fps) for f, fps in (
      ([0, 1, 2], 30.0), ([0, 3, 6], 30.0), ([0, 1], 120.0), ([0, 4, 8], 120.0), ([5], 24.0))
  ] == [30, 100, 20, 30, 40]
  assert solve.default_clip_frames(1000, 120.0) == '0:240:4'
  assert solve.default_clip_frames(10, 30.0) == '0:10:1'
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
  assert '--matmul_precision' in out
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
         f'--output={tmp_path / "walk.bvh"}', f'--checkpoint={ckpt}', '--latency_frames=3']
  done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert 'solved 6 frames' in done.stderr
  assert '(cpu, live backend)' in done.stderr  # --latency_frames started it (latency line)
  assert bvh.read_bvh(tmp_path / 'walk.bvh').num_frames == 6


def test_live_backend_defaults_to_on_with_latency_frames():
  assert solve.live_backend_wanted(None, 3000) and not solve.live_backend_wanted(None, 0)
  assert not solve.live_backend_wanted(False, 3000)  # --nolive_backend: the default backend
  assert solve.live_backend_wanted(True, 0)


# ----------------------------------------------------------------------------------------------
# A BVH input's own channel orders and units in the output BVH (issue L, item 5).

_ORDERS = ('XZY', 'YXZ', 'ZXY', 'XYZ', 'YZX', 'ZYX')  # cycled over the source joints


def _reordered_cmu(src: Path, dst: Path, frames: int, units_m: float) -> bvh.BVHMotion:
  """The first `frames` frames of a CMU BVH with joint j's rotation channels in
  `_ORDERS[j % 6]` (angles recomputed by scipy: the same rotations) and lengths in `units_m`
  metres per unit; written exactly."""
  m = bvh.read_bvh(src)
  k = UNITS['cmu'] / units_m
  joints, cols = [], []
  for j, joint in enumerate(m.joints):
    order = _ORDERS[j % len(_ORDERS)]
    R = bvh.euler_to_matrix_np(m.rotation_degrees(j)[:frames], m.euler_order(j))
    pos = m.position_channels(j)
    cols += ([] if pos is None else [pos[:frames] * k]) + [
        Rotation.from_matrix(R).as_euler(order, degrees=True)]
    joints.append(bvh.BVHJoint(joint.name, joint.parent, joint.offset * k,
                               (bvh.POSITION_CHANNELS if pos is not None else ()) +
                               tuple(f'{a}rotation' for a in order),
                               None if joint.end_site is None else joint.end_site * k))
  out = bvh.BVHMotion(joints, m.frame_time, np.concatenate(cols, axis=1))
  bvh.write_bvh(dst, out, precision=None)
  np.testing.assert_allclose(bvh.naive_fk_np(out, units_m),
                             bvh.naive_fk_np(m, UNITS['cmu'])[:frames], atol=1e-9)
  return out


def _ancestors(parents, j: int) -> list[int]:
  out = []
  while parents[j] >= 0:
    j = parents[j]
    out.append(j)
  return out


def _text_bound(p: np.ndarray, parents, units_m: float, decimals: int = 6) -> np.ndarray:
  """`[T, J]` metres: how far the FK of a BVH written with `decimals` can move from the exact
  FK at positions `p [T, J, 3]` (float64). Root channels round by h = 0.5e-`decimals` units
  per axis (sqrt(3) h units); each angle by h degrees, so a joint's local rotation by at most
  3 h (radians) and every joint below ancestor a moves by at most that times its distance
  to a; the float64 Euler round trip and exact offsets add ~1e-15 relative (1e-12 m slack)."""
  h = 0.5 * 10.0 ** -decimals
  bound = np.full(p.shape[:2], np.sqrt(3) * h * units_m + 1e-12)
  for j in range(p.shape[1]):
    for a in _ancestors(parents, j):
      bound[:, j] += 3 * np.deg2rad(h) * np.linalg.norm(p[:, j] - p[:, a], axis=-1)
  return bound


def _float32_bound(R: np.ndarray, p: np.ndarray, offsets: np.ndarray, parents) -> np.ndarray:
  """`[T, J]` metres between the solver's float32 FK of `R [T, J, 3, 3]` and the exact FK `p`
  of R's nearest rotations: each R_a is d_a (spectral norm) from its rotation, moving joints
  below a by d_a times their distance to a; float32 rounding (u = 2^-24) of a depth-d chain:
  the product G of d matrices is off by 3 d u, so each term G t by (3 d + 3) u |t|, the sum
  of d + 1 terms by (d + 1) u (|root| + sum |t|), and storing p by u |p|."""
  u = 2.0 ** -24
  d = np.linalg.norm(np.asarray(R, np.float64) - _nearest_rotations(R), ord=2, axis=(-2, -1))
  t = np.linalg.norm(offsets, axis=-1)
  bound = u * np.linalg.norm(p, axis=-1)
  for j in range(p.shape[1]):
    chain = [j] + _ancestors(parents, j)
    depth = [len(_ancestors(parents, a)) for a in chain]
    length = np.linalg.norm(p[:, 0], axis=-1) + sum(t[a] for a in chain[:-1])
    bound[:, j] += u * (sum((3 * da + 3) * t[a] for a, da in zip(chain[:-1], depth))
                        + (depth[0] + 1) * length)
    for a in chain[1:]:
      bound[:, j] += d[:, a] * np.linalg.norm(p[:, j] - p[:, a], axis=-1)
  return bound


def _nearest_rotations(R: np.ndarray) -> np.ndarray:
  u, _, vt = np.linalg.svd(np.asarray(R, np.float64))
  return u @ vt  # det +1 here: the solver's matrices are within 1e-6 of rotations


@pytest.mark.filterwarnings('ignore:up axis looks wrong')  # an untrained model's poses
def test_bvh_output_keeps_the_input_names_orders_and_units(ckpt, cmu_dir, tmp_path):
  """A CMU clip re-written with six rotation orders and inches solves to a BVH in the input's
  names, per-joint orders, inches and End Sites, whose FK is the solution's (bounds derived
  above)."""
  inch = UNITS['inch']
  src = _reordered_cmu(cmu_dir / '07_12.bvh', tmp_path / 'in.bvh', 41, inch)
  # In centimetres, read without --units (as CMU's units, its joint names'): the hint names
  # the file's unit, not a factor on the metres it was read as (it said --units=0.18).
  _reordered_cmu(cmu_dir / '07_12.bvh', tmp_path / 'in_cm.bvh', 3, UNITS['cm'])
  with pytest.raises(InputError, match='looks like centimetres: pass --units=cm'):
    solve.solve_file(tmp_path / 'in_cm.bvh', tmp_path / 'no_units.npz', checkpoint=ckpt,
                     log=_quiet)
  lines = []
  for out_file, bvh_units in (('out.bvh', None), ('sol.npz', None), ('cm.bvh', 'cm')):
    summary = solve.solve_file(tmp_path / 'in.bvh', tmp_path / out_file, checkpoint=ckpt,
                               units='inch', bvh_units=bvh_units, log=lines.append)
    if out_file == 'out.bvh':
      assert summary['bvh_units_m'] == inch and f'{inch:g} m per unit' in lines[-1]
  with np.load(tmp_path / 'sol.npz') as z:
    names, R, fk = [str(n) for n in z['joint_names']], z['local_rot'], z['positions_fk']
    offsets, parents = z['offsets'].astype(np.float64), [int(p) for p in z['parents']]
  out, cm = bvh.read_bvh(tmp_path / 'out.bvh'), bvh.read_bvh(tmp_path / 'cm.bvh')
  # The input's hierarchy: the rig's joints and the four cmu_body removed (constant rotations,
  # written back), less the fingers it pruned; cgspeed's T-pose frame dropped.
  fingers = {'LeftFingerBase', 'LeftHandIndex1', 'LThumb', 'RightFingerBase', 'RightHandIndex1',
             'RThumb'}
  assert out.num_frames == 40 and set(out.names) == set(src.names) - fingers
  assert set(names) < set(out.names)
  index = {n: i for i, n in enumerate(src.names)}
  for i, n in enumerate(out.names):
    assert out.euler_order(i) == cm.euler_order(i) == src.euler_order(index[n]), n
    if i:  # every joint's parent and OFFSET the input's, in its units (the root's: 0 0 0)
      assert out.names[out.parents[i]] == src.names[src.parents[index[n]]], n
      want = src.offsets[index[n]]
      assert np.linalg.norm(out.offsets[i] - want) <= 1e-6 * np.linalg.norm(want) + 1e-12, n
  col = [out.names.index(n) for n in names]
  # Both files' OFFSETs carry 9 significant digits (a float32's; exports.solution_bvh): each
  # within 5e-9 of the same metres, relative.
  np.testing.assert_allclose(cm.offsets * 0.01, out.offsets * inch, rtol=1e-8, atol=1e-15)
  # The leaves' End Sites are the input's (in its units): its own for the head and toes; for
  # a hand, its farthest in the fingers the rig leaves out (CMU's index fingertip), in the
  # hand's frame, where the moving fingers hold it at the median over the frames solved.
  pos, rot = bvh.naive_fk_np(dataclasses.replace(src, motion=src.motion[1:]), 1.0,
                             with_rotations=True)
  for leaf in ('Head', 'LeftToeBase', 'RightToeBase', 'LeftHand', 'RightHand'):
    got = out.joints[out.names.index(leaf)].end_site
    if 'Hand' in leaf:
      h, tip = index[leaf], index[leaf.replace('Hand', 'HandIndex1')]
      world = pos[:, tip] + rot[:, tip] @ src.joints[tip].end_site
      want = np.median(np.einsum('tba,tb->ta', rot[:, h], world - pos[:, h]), axis=0)
    else:
      want = src.joints[index[leaf]].end_site
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.linalg.norm(want),
                               err_msg=leaf)
  assert cm.joints[cm.names.index('Head')].end_site == pytest.approx(
      src.joints[index['Head']].end_site * inch / 0.01, rel=1e-6)
  # Read back: the exact FK of the rotations nearest the float32 solution's (what the writer
  # converts) within the 6-decimal text bound, and the solution's own float32 FK within that
  # plus the float32 bound.
  _, exact = fk_np(_nearest_rotations(R), offsets, parents, fk[:, 0].astype(np.float64))
  bound = _text_bound(exact, parents, inch)
  for back in (bvh.naive_fk_np(out, inch)[:, col],
               exports.read_bvh_clip(tmp_path / 'out.bvh', skeleton.cmu_body(),
                                     units=inch).positions):
    err = np.linalg.norm(back - exact, axis=-1)
    assert (err <= bound).all(), (err.max(), bound.max())
    err32 = np.linalg.norm(back - fk, axis=-1)
    assert (err32 <= bound + _float32_bound(R, exact, offsets, parents)).all(), err32.max()


def _with_extra_finger(m: bvh.BVHMotion, under: str) -> bvh.BVHMotion:
  """`m` with one more rotating joint (and its End Site) as the first child of `under`: a
  joint cgspeed CMU's files do not have, as another lab's export might carry."""
  j = m.names.index(under)
  col = sum(len(joint.channels) for joint in m.joints[:j + 1])
  joints = [dataclasses.replace(joint, parent=joint.parent + (joint.parent > j))
            for joint in m.joints]
  joints.insert(j + 1, bvh.BVHJoint('LeftExtraFinger', j, np.array([1.0, 0.0, 0.0]),
                                    ('Zrotation', 'Yrotation', 'Xrotation'),
                                    np.array([1.0, 0.0, 0.0])))
  angles = np.random.default_rng(0).uniform(-40, 40, (m.num_frames, 3))
  motion = np.concatenate([m.motion[:, :col], angles, m.motion[:, col:]], axis=1)
  return bvh.BVHMotion(joints, m.frame_time, motion)


@pytest.mark.filterwarnings('ignore:up axis looks wrong')  # an untrained model's poses
def test_other_exports_of_a_cmu_file(ckpt, cmu_dir, tmp_path):
  """What another tool makes of a cgspeed CMU file: a joint more (left out, in a warning,
  the same solution), one frame (the T-pose frame the joint map leaves out: said; a clip cut
  from the file's middle keeps its first), and this
  project's own BVH of it read back without --units (refused, naming CMU's units, or inches).
  """
  m = bvh.read_bvh(cmu_dir / '07_05.bvh')
  m = dataclasses.replace(m, motion=m.motion[:6])
  bvh.write_bvh(tmp_path / 'clip.bvh', m, precision=None)
  bvh.write_bvh(tmp_path / 'extra.bvh', _with_extra_finger(m, 'LeftHand'), precision=None)
  lines = []
  solve.solve_file(tmp_path / 'clip.bvh', tmp_path / 'clip.npz', checkpoint=ckpt,
                   log=lines.append)
  assert any('first frame left out: joint map cmu_body' in line for line in lines), lines
  with pytest.warns(UserWarning, match=r'joints LeftExtraFinger are not in joint map cmu_body'):
    solve.solve_file(tmp_path / 'extra.bvh', tmp_path / 'extra.npz', checkpoint=ckpt,
                     log=_quiet)
  with np.load(tmp_path / 'clip.npz') as a, np.load(tmp_path / 'extra.npz') as b:
    assert a['local_rot'].shape[0] == 5
    for key in ('positions', 'local_rot', 'offsets'):
      np.testing.assert_array_equal(a[key], b[key])
  # Cut from the middle of the file: no T-pose to leave out, every frame solved (one lost
  # before), in a line that says so; one frame of it too.
  full = bvh.read_bvh(cmu_dir / '07_05.bvh')
  for frames in (slice(10, 16), slice(10, 11)):
    bvh.write_bvh(tmp_path / 'cut.bvh', dataclasses.replace(full, motion=full.motion[frames]))
    lines = []
    summary = solve.solve_file(tmp_path / 'cut.bvh', tmp_path / 'cut.npz', checkpoint=ckpt,
                               log=lines.append, overwrite=True)
    assert summary['frames'] == frames.stop - frames.start
    assert any('first frame kept: joint map cmu_body' in line for line in lines), lines
  bvh.write_bvh(tmp_path / 'one.bvh', dataclasses.replace(m, motion=m.motion[:1]))
  with pytest.raises(InputError, match='no frames to solve .joint map cmu_body leaves out the '
                     'first'):
    solve.solve_file(tmp_path / 'one.bvh', tmp_path / 'one.npz', checkpoint=ckpt, log=_quiet)
  # A skeleton definition (Frames: 0, as DCC tools write one): nothing to solve, in one line;
  # as --offsets_from, the same offsets as a clip of that skeleton (it crashed on frame 0).
  cmu = skeleton.get_rig('cmu_body')
  bvh.write_bvh(tmp_path / 'skeleton.bvh', dataclasses.replace(m, motion=m.motion[:0]))
  with pytest.raises(InputError, match=r'no frames to solve \(0 in the file: a skeleton'):
    solve.solve_file(tmp_path / 'skeleton.bvh', tmp_path / 'sk.npz', checkpoint=ckpt, log=_quiet)
  np.testing.assert_array_equal(exports.read_bvh_offsets(tmp_path / 'skeleton.bvh', cmu),
                                exports.read_bvh_offsets(tmp_path / 'clip.bvh', cmu))
  solve.solve_file(tmp_path / 'clip.bvh', tmp_path / 'out.bvh', checkpoint=ckpt, log=_quiet)
  with pytest.raises(InputError, match=r'looks like CMU.s units .*: pass --units=cmu \(no '):
    solve.solve_file(tmp_path / 'out.bvh', tmp_path / 'back.npz', checkpoint=ckpt, log=_quiet)
  assert not (tmp_path / 'back.npz').exists()
  solve.solve_file(tmp_path / 'out.bvh', tmp_path / 'back.npz', checkpoint=ckpt, units='cmu',
                   log=_quiet)
  with np.load(tmp_path / 'clip.npz') as a, np.load(tmp_path / 'back.npz') as b:
    # The written angles to 1e-6 deg (2e-8 rad over a 2 m chain: 4e-8 m) and FK in float32
    # (about 1e-7 relative on 1 m: 1e-6 m over the chain's 20 products): 2e-5 m is 10x that.
    np.testing.assert_allclose(b['positions'], a['positions_fk'], atol=2e-5)
  # In inches, read back without --units as centimetres, its bones are 0.39x the template's,
  # inside the band a subject's size may take, but where inches would put them: refused too.
  solve.solve_file(tmp_path / 'clip.bvh', tmp_path / 'inch.bvh', checkpoint=ckpt,
                   bvh_units='inch', log=_quiet)
  with pytest.raises(InputError, match=r'0.3\d+x the template.s .*looks like inches: pass '
                     r'--units=inch \(no '):
    solve.solve_file(tmp_path / 'inch.bvh', tmp_path / 'back_in.npz', checkpoint=ckpt,
                     log=_quiet)
  solve.solve_file(tmp_path / 'inch.bvh', tmp_path / 'back_in.npz', checkpoint=ckpt,
                   units='inch', log=_quiet)
  # Wrong units given: refused by the units (it blamed offsets the user never gave).
  with pytest.raises(InputError, match=r'looks like CMU.s units .*: pass --units=cmu '
                     r'\(--units=cm given\)$'):
    solve.solve_file(tmp_path / 'clip.bvh', tmp_path / 'cm.npz', checkpoint=ckpt, units='cm',
                     log=_quiet)
  with np.load(tmp_path / 'clip.npz') as a, np.load(tmp_path / 'back_in.npz') as b:
    np.testing.assert_allclose(b['positions'], a['positions_fk'], atol=2e-5)


@pytest.mark.filterwarnings('ignore:up axis looks wrong')  # an untrained model's poses
def test_npz_output_records_the_inputs_missing_joints(ckpt, clip_npz, tmp_path):
  """A dropout held (--hold_missing) leaves no NaN in the npz's `positions`: `input_missing`
  says which joints were missing; a whole input writes none."""
  _, pos = clip_npz
  holes = pos.copy()
  holes[3, 9] = holes[4, 9] = holes[4, 2] = np.nan
  np.savez(tmp_path / 'holes.npz', positions=holes)
  solve.solve_file(tmp_path / 'holes.npz', tmp_path / 'out.npz', checkpoint=ckpt,
                   hold_missing=True, log=_quiet)
  with np.load(tmp_path / 'out.npz') as z:
    assert np.isfinite(z['positions']).all()
    np.testing.assert_array_equal(z['input_missing'], np.isnan(holes).any(-1))
  solve.solve_file(clip_npz[0], tmp_path / 'whole.npz', checkpoint=ckpt, log=_quiet)
  with np.load(tmp_path / 'whole.npz') as z:
    assert 'input_missing' not in z


@pytest.mark.filterwarnings('ignore:up axis looks wrong')  # an untrained model's poses
def test_an_npz_s_offsets_are_in_its_units_and_axes_and_the_npz_says_its_frame(
    ckpt, tmp_path_factory, tmp_path):
  """An npz's `offsets` are converted with its positions (`--units`, `--input_axes`): the same
  clip in millimetres and z-up with its own offsets solves to the metres y-up clip's rotations
  and skeleton (it gave a 126 m spine). The output npz says the frame of what it holds (`units`
  'm', the rig's `up` and `forward`) and how the input was converted (`input_units_m`,
  `input_axes`), and `offsets_source` says when the lengths were estimated. `--fps=0` is
  refused; an `--fps` other than an npz's own is said (frames relabelled, not resampled)."""
  solver = get_solver(tmp_path_factory)
  off = solver.offsets * 1.1
  pos = posed_clip(solver.rig, off, T=6, scale=0.3)
  M = parse_input_axes('x,z,-y')  # rig = M @ input
  np.savez(tmp_path / 'm.npz', positions=pos, offsets=off, fps=30.0)
  np.savez(tmp_path / 'mm.npz', positions=(pos * 1000) @ M, offsets=(off * 1000) @ M, fps=30.0)
  solve.solve_file(tmp_path / 'm.npz', tmp_path / 'm_out.npz', checkpoint=ckpt, log=_quiet)
  said = []
  solve.solve_file(tmp_path / 'mm.npz', tmp_path / 'mm_out.npz', checkpoint=ckpt, units='mm',
                   input_axes='x,z,-y', fps=60.0, log=said.append)
  assert any('--fps=60 replaces the input\'s own 30 fps' in m for m in said), said
  with np.load(tmp_path / 'm_out.npz') as a, np.load(tmp_path / 'mm_out.npz') as b:
    np.testing.assert_allclose(b['local_rot'], a['local_rot'], atol=2e-5)
    np.testing.assert_allclose(b['offsets'], a['offsets'], atol=1e-6)
    np.testing.assert_allclose(b['positions_fk'], a['positions_fk'], atol=1e-5)
    assert str(b['units']) == 'm' and list(b['up']) == [0, 1, 0] and list(b['forward']) == [0, 0, 1]
    assert float(b['input_units_m']) == 0.001 and float(a['input_units_m']) == 1.0
    np.testing.assert_array_equal(b['input_axes'], M)
    assert str(a['offsets_source']) == 'input'
  solve.solve_file(tmp_path / 'm.npz', tmp_path / 'est.npz', checkpoint=ckpt,
                   estimate_lengths=True, log=_quiet)
  with np.load(tmp_path / 'est.npz') as z:
    assert str(z['offsets_source']) == 'input, lengths estimated'
  with pytest.raises(InputError, match='--fps must be a positive frame rate, got 0'):
    solve.solve_file(tmp_path / 'm.npz', tmp_path / 'zero.npz', checkpoint=ckpt, fps=0.0)


def _glb_node_names(path: Path) -> list[str]:
  import pygltflib  # noqa: PLC0415 (the GLB reader, only here)
  return [n.name for n in pygltflib.GLTF2().load(str(path)).nodes]


@pytest.mark.filterwarnings('ignore:up axis looks wrong')  # an untrained model's poses
def test_outputs_name_the_joints_as_the_input_did(ckpt, cmu_dir, tmp_path):
  """A namespaced file (`Anna:Hips`) and one whose joints are renamed (read through a joint
  map) solve to a BVH, GLB and npz that name every joint as the input did, the BVH's removed
  joints too, so a tool that binds animation by bone name finds the input's; otherwise the
  same files as the bare input's (`--joint_names=rig`: the rig's names)."""
  m = bvh.read_bvh(cmu_dir / '07_05.bvh')
  m = dataclasses.replace(m, motion=m.motion[:6])
  rename = lambda space, suffix: dataclasses.replace(m, joints=[  # noqa: E731
      dataclasses.replace(j, name=space + j.name + suffix) for j in m.joints])
  bvh.write_bvh(tmp_path / 'bare.bvh', m, precision=None)
  bvh.write_bvh(tmp_path / 'ns.bvh', rename('Anna:', ''), precision=None)
  bvh.write_bvh(tmp_path / 'jnt.bvh', rename('', '_jnt'), precision=None)
  doc = json.loads((REPO / 'ik_gat_jax/io/joint_maps/cmu_body.json').read_text())
  doc.pop('$schema')
  doc['joints'] = {k + '_jnt': v for k, v in doc['joints'].items()}
  doc['prune'] = [k + '_jnt' for k in doc['prune']]
  doc['mirror_pairs'] = [[a + '_jnt', b + '_jnt'] for a, b in doc['mirror_pairs']]
  (tmp_path / 'jnt.json').write_text(json.dumps(doc))
  out = {}
  for name, kw in (('bare', {}), ('ns', {}), ('jnt', {'joint_map': str(tmp_path / 'jnt.json')}),
                   ('ns_rig', {'joint_names': 'rig'})):
    src = tmp_path / f'{name.split("_")[0]}.bvh'
    for ext in ('bvh', 'glb', 'npz'):
      solve.solve_file(src, tmp_path / f'{name}_out.{ext}', checkpoint=ckpt, log=_quiet, **kw)
    out[name] = (tmp_path / f'{name}_out.bvh').read_text()
  bare = bvh.read_bvh(tmp_path / 'bare_out.bvh')
  assert 'LHipJoint' in bare.names  # a removed joint, written back
  ns, jnt = bvh.read_bvh(tmp_path / 'ns_out.bvh'), bvh.read_bvh(tmp_path / 'jnt_out.bvh')
  assert ns.names == tuple('Anna:' + n for n in bare.names)
  assert jnt.names == tuple(n + '_jnt' for n in bare.names)
  assert set(jnt.names) < set(bvh.read_bvh(tmp_path / 'jnt.bvh').names)
  assert out['ns'].replace('Anna:', '') == out['bare'] == out['ns_rig']
  assert out['jnt'].replace('_jnt', '') == out['bare']
  rig_names = list(skeleton.cmu_body().joint_names)
  J = len(rig_names)
  assert _glb_node_names(tmp_path / 'ns_out.glb')[:J] == ['Anna:' + n for n in rig_names]
  assert _glb_node_names(tmp_path / 'jnt_out.glb')[:J] == [n + '_jnt' for n in rig_names]
  assert _glb_node_names(tmp_path / 'ns_rig_out.glb')[:J] == rig_names
  with np.load(tmp_path / 'ns_out.npz') as a, np.load(tmp_path / 'bare_out.npz') as b:
    assert list(a['joint_names']) == rig_names and 'input_joint_names' not in b
    assert list(a['input_joint_names']) == ['Anna:' + n for n in rig_names]
    np.testing.assert_array_equal(a['local_rot'], b['local_rot'])
  # The namespaced output read back (CMU's units, as the bare one's): the bare names' joints.
  solve.solve_file(tmp_path / 'ns_out.bvh', tmp_path / 'back.npz', checkpoint=ckpt,
                   units='cmu', log=_quiet)
  with np.load(tmp_path / 'back.npz') as a, np.load(tmp_path / 'ns_out.npz') as b:
    np.testing.assert_allclose(a['positions'], b['positions_fk'], atol=2e-5)
  # A CSV header's namespace and an npz's joint names name the joints too.
  pos = np.load(tmp_path / 'bare_out.npz')['positions']
  header = ','.join(f'Ben:{n}_{a}' for n in rig_names for a in 'xyz')
  np.savetxt(tmp_path / 'ben.csv', pos.reshape(len(pos), -1), delimiter=',', header=header,
             comments='')
  solve.solve_file(tmp_path / 'ben.csv', tmp_path / 'ben.bvh', checkpoint=ckpt, log=_quiet)
  assert bvh.read_bvh(tmp_path / 'ben.bvh').names == tuple('Ben:' + n for n in rig_names)
  with pytest.raises(InputError, match='--joint_names must be one of input, rig'):
    solve.solve_file(tmp_path / 'ben.csv', tmp_path / 'x.bvh', checkpoint=ckpt, log=_quiet,
                     joint_names='theirs')


def _z_up_cmu(src: Path, dst: Path, frames: int) -> None:
  """The first `frames` frames of a CMU BVH in a z-up world facing -y (Blender's): every
  offset and End Site turned by W, every joint's rotation conjugated (W R W^T, in its own
  channel order), the root's position turned: the same bind and motion, FK turned by W."""
  m = bvh.read_bvh(src)
  W = parse_input_axes('x,z,-y').T  # rig (y up) = M @ input: input = M^T @ rig
  joints, cols = [], []
  for j, joint in enumerate(m.joints):
    R = bvh.euler_to_matrix_np(m.rotation_degrees(j)[:frames], m.euler_order(j))
    pos = m.position_channels(j)
    cols += ([] if pos is None else [pos[:frames] @ W.T]) + [Rotation.from_matrix(
        W @ R @ W.T).as_euler(m.euler_order(j), degrees=True)]
    joints.append(dataclasses.replace(
        joint, offset=W @ joint.offset,
        end_site=None if joint.end_site is None else W @ joint.end_site))
  bvh.write_bvh(dst, bvh.BVHMotion(joints, m.frame_time, np.concatenate(cols, axis=1)),
                precision=None)


@pytest.mark.filterwarnings('ignore:up axis looks wrong')  # an untrained model's poses
def test_a_z_up_bvh_writes_the_y_up_file_s_bvh(ckpt, cmu_dir, tmp_path):
  """A CMU clip exported z-up (facing -y) and solved with --input_axes=x,z,-y writes the BVH
  of the same clip y-up: the joints its reduction removed (LHipJoint, ...), whose offsets and
  constant rotations it writes back, and its End Sites are turned into the rig's axes with the
  positions (they were the file's: every joint under a removed one 10-20 cm off, the Head's End
  Site 11 cm off), and so are its joints' frames in a natural pose it names."""
  m = bvh.read_bvh(cmu_dir / '07_05.bvh')
  bvh.write_bvh(tmp_path / 'y.bvh', dataclasses.replace(m, motion=m.motion[:6]), precision=None)
  _z_up_cmu(cmu_dir / '07_05.bvh', tmp_path / 'z.bvh', 6)
  solve.solve_file(tmp_path / 'y.bvh', tmp_path / 'y_out.bvh', checkpoint=ckpt, log=_quiet)
  solve.solve_file(tmp_path / 'z.bvh', tmp_path / 'z_out.bvh', checkpoint=ckpt, log=_quiet,
                   input_axes='x,z,-y')
  y, z = bvh.read_bvh(tmp_path / 'y_out.bvh'), bvh.read_bvh(tmp_path / 'z_out.bvh')
  assert y.names == z.names and 'LHipJoint' in z.names
  cmu = UNITS['cmu']
  py, ry = bvh.naive_fk_np(y, cmu, with_rotations=True)
  pz, rz = bvh.naive_fk_np(z, cmu, with_rotations=True)
  # The same input to float64 round-off (turned there and back): float32 solutions within
  # 1e-5 m at every joint (a network's float32 noise on 1 m), End Sites too.
  np.testing.assert_allclose(pz, py, atol=1e-5)
  for j, (a, b) in enumerate(zip(y.joints, z.joints)):
    np.testing.assert_allclose(b.offset, a.offset, atol=1e-6, err_msg=a.name)
    if a.end_site is not None:
      np.testing.assert_allclose(b.end_site, a.end_site, atol=1e-6, err_msg=a.name)
      np.testing.assert_allclose(rz[:, j] @ b.end_site, ry[:, j] @ a.end_site, atol=1e-5)
  # Its first frame (the T-pose) named as its natural pose: the joints' frames there are turned
  # too, so the rotations are the y-up file's (they were 0.43 off in a matrix entry).
  for name, kw in (('y', {}), ('z', {'input_axes': 'x,z,-y'})):
    solve.solve_file(tmp_path / f'{name}.bvh', tmp_path / f'{name}_ref.npz', checkpoint=ckpt,
                     log=_quiet, reference_pose='first_frame', **kw)
  with np.load(tmp_path / 'y_ref.npz') as a, np.load(tmp_path / 'z_ref.npz') as b:
    np.testing.assert_allclose(b['local_rot'], a['local_rot'], atol=1e-5)
    np.testing.assert_allclose(b['reference_pose'], a['reference_pose'], atol=1e-9)
