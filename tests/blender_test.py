"""The solver's GLB, FBX and BVH as Blender sees them (io/blender.py; skipped without Blender).

A real CMU clip (07_05, the unseen subject, 45 frames at 30 fps) solved by the shipped checkpoint
is written as GLB, FBX (GLB -> Blender -> FBX) and BVH; each file is imported into headless
Blender once (a module-scoped fixture per format), which dumps every pose bone's world head and
frame at every frame. Compared with the solution after Blender's axis change (glTF / FBX / BVH
+y up -> Blender +z up: `(x, y, z) -> (x, -z, y)`, `blender.GLTF_TO_BLENDER`):
- bone names and parents are the rig's joint names and parents (one bone per joint, leaves
  included: Blender's glTF importer makes a bone of every joint node, heads at the joints; the
  FBX has no `*_end` leaf bones);
- heads = FK joint positions `Solution.positions_fk`, every joint and frame;
- GLB / FBX bone world frames = the rig's joint frames `C G_j` (bone axes follow the glTF joint
  nodes); BVH bones are aimed at their children by Blender's BVH importer, so there the bone
  frame relative to `C G_j` must be the same in every frame (twist included).

Tolerance: float32 everywhere (GLB accessors, Blender's matrices; the FBX stores Blender's
float32 values as doubles in metres, unscaled, and the BVH our float64 text in cm read by Blender
in float32). Each level of the chain composes a few float32 products, so allow 16 float32 ulps
per level: rotations `16 (depth + 1) eps32` (7 levels on cmu_body: 1.3e-5) and positions that
times the largest distance from the origin (about 2.5 m here: 0.034 mm). Measured: heads within
0.002 mm, frames within 2e-6, for all three; a key one frame off would move some joint by 30 mm
or more (every frame of this clip moves a joint that far).

Skipped too where Blender's Python cannot import numpy and ours cannot lend it (another Python
version: a Python 3.12 environment beside Debian's Blender 3.4, whose Python is 3.11, without
python3-numpy): io/blender.py's one-line error says so, and the tests cannot fix the machine.

Blender as a writer of our input: its BVH exporter's file of a CMU clip (renamed bones, z-up,
YXZ channels) reads, with a joint map saying so, as the original.

Without Blender the FBX writer and `solve_file` must refuse in one line; a Blender that fails or
hangs is reported with its last stderr line / the timeout and leaves no file (a stand-in
`blender` script on PATH).
"""

import contextlib
import json
import os
from pathlib import Path
import sys
import time

import numpy as np
import pytest

from ik_gat_jax import skeleton, solve
from ik_gat_jax import solver as solver_lib
from ik_gat_jax.io import blender, exports
from ik_gat_jax.io import bvh as bvh_lib

FPS, FRAMES = 30.0, 45  # solved_07_05's (conftest.py)
NO_BLENDER = 'blender not on PATH; apt-get install blender'
TIMES = {}  # seconds per Blender step, printed by the last test (pytest -s)


def _quiet(msg):
  del msg


@contextlib.contextmanager
def _blenders_numpy():
  """Skips (module docstring) on io/blender.py's error for a Blender whose Python cannot
  import numpy; any other Blender error fails the test."""
  try:
    yield
  except blender.BlenderError as e:
    if 'cannot import numpy' in str(e):
      pytest.skip(str(e))
    raise


@pytest.fixture(scope='module')
def blender_exe() -> str:
  """Blender's path; skips without it (asked first, so nothing is solved for nothing)."""
  exe = blender.find_blender()
  if exe is None:
    pytest.skip(NO_BLENDER)
  return exe


@pytest.fixture(scope='module')
def solved(solved_07_05):
  return solved_07_05  # conftest.py: FRAMES frames of 07_05 at FPS


@pytest.fixture(scope='module')
def written(blender_exe, solved, tmp_path_factory):
  """{'glb' | 'fbx' | 'bvh': path} of the solved clip."""
  del blender_exe
  sol, rig = solved
  out = tmp_path_factory.mktemp('blender')
  paths = {k: out / f'clip.{k}' for k in ('glb', 'fbx', 'bvh')}
  exports.write_solution_glb(paths['glb'], sol, rig, FPS)
  exports.write_solution_bvh(paths['bvh'], sol, rig, FPS)  # centimetres
  t = time.perf_counter()
  with _blenders_numpy():
    exports.write_solution_fbx(paths['fbx'], sol, rig, FPS)
  TIMES['write_fbx'] = time.perf_counter() - t
  return paths


@pytest.fixture(scope='module', params=['glb', 'fbx', 'bvh'])
def pose(request, written, solved):
  """(format, Blender's pose with bones in rig order: heads [T, J, 3], rotations [T, J, 3, 3],
  the rest as `blender.blender_pose`)."""
  kind = request.param
  _, rig = solved
  t = time.perf_counter()
  with _blenders_numpy():
    p = blender.blender_pose(written[kind], fps=FPS, bvh_scale=0.01, frames_hint=FRAMES)
  TIMES[f'read_{kind}'] = time.perf_counter() - t
  assert sorted(p['names']) == sorted(rig.joint_names), p['names']
  order = [p['names'].index(n) for n in rig.joint_names]
  p['heads'], p['rotations'] = p['heads'][:, order], p['rotations'][:, order]
  p['parents'] = [p['parents'][k] for k in order]
  return kind, p


def _tolerances(rig, heads: np.ndarray) -> tuple[float, float]:
  """(rotation, position in metres): 16 float32 ulps per chain level (module docstring)."""
  depth = max(_depth(rig.parents, j) for j in range(rig.num_joints))
  rot = 16 * (depth + 1) * float(np.finfo(np.float32).eps)
  return rot, rot * float(np.linalg.norm(heads, axis=-1).max())


def _depth(parents, j: int) -> int:
  d = 0
  while parents[j] >= 0:
    j, d = parents[j], d + 1
  return d


def test_bones_are_the_rig(pose, solved):
  kind, p = pose
  _, rig = solved
  names = list(rig.joint_names)
  assert p['parents'] == [names[q] if q >= 0 else None for q in rig.parents]
  assert p['heads'].shape == (FRAMES, rig.num_joints, 3)  # one key per frame, none lost
  assert p['fps'] == pytest.approx(FPS)
  np.testing.assert_allclose(p['armature_scale'], 1.0, atol=1e-6)  # no x100 / x0.01 node
  if kind != 'bvh':  # the GLB's keys start at 0 (t = 0); Blender's BVH importer starts at 1
    assert p['frame_start'] == 0
    assert sorted(t for _, t in p['objects']) == ['ARMATURE', 'MESH']  # the body came along


def test_heads_are_the_fk_positions(pose, solved):
  kind, p = pose
  sol, rig = solved
  want = sol.positions_fk.astype(np.float64) @ blender.GLTF_TO_BLENDER.T
  _, tol = _tolerances(rig, want)
  err = np.linalg.norm(p['heads'] - want, axis=-1)
  TIMES[f'max_head_err_mm_{kind}'] = 1e3 * err.max()
  assert err.max() < tol, (kind, 1e3 * err.max(), rig.joint_names[err.max(0).argmax()])
  step = np.linalg.norm(np.diff(want, axis=0), axis=-1).max(1)  # [T-1] fastest joint per frame
  assert step.min() > 100 * tol  # a key off by one frame could not pass


def test_bone_frames_are_the_joint_frames(pose, solved):
  kind, p = pose
  sol, rig = solved
  want = np.einsum('ab,tjbc->tjac', blender.GLTF_TO_BLENDER, sol.global_rot.astype(np.float64))
  tol, _ = _tolerances(rig, sol.positions_fk)
  rel = np.einsum('tjba,tjbc->tjac', want, p['rotations'])  # Blender's bone in the joint frame
  if kind == 'bvh':  # bones aimed at children: a fixed rest turn per bone, the same every frame
    err = np.abs(rel - rel[:1]).max()
  else:
    err = np.abs(rel - np.eye(3)).max()
  TIMES[f'max_frame_err_{kind}'] = float(err)
  assert err < tol, (kind, err)


def test_solve_file_writes_fbx(blender_exe, solved, tmp_path):
  del blender_exe
  sol, _ = solved
  inp = tmp_path / 'in.npz'
  np.savez(inp, positions=sol.positions, offsets=sol.offsets, fps=FPS)
  out = tmp_path / 'x.fbx'
  assert solve.output_kind(out) == 'fbx'
  with _blenders_numpy():
    summary = solve.solve_file(inp, out, log=_quiet)
  assert summary['frames'] == FRAMES
  assert out.read_bytes()[:18] == b'Kaydara FBX Binary'
  with pytest.raises(FileExistsError, match='--overwrite'):
    solve.solve_file(inp, out, log=_quiet)
  assert sorted(q.name for q in tmp_path.iterdir()) == ['in.npz', 'x.fbx']


def test_fbx_without_blender_is_one_line(tmp_path, monkeypatch):
  monkeypatch.setattr(blender, 'find_blender', lambda: None)
  inp = tmp_path / 'in.npz'
  np.savez(inp, positions=np.zeros((2, 21, 3)))
  with pytest.raises(blender.BlenderMissing) as e:
    solve.solve_file(inp, tmp_path / 'x.fbx', log=_quiet)  # refused before solving
  assert str(e.value) == ('FBX output needs Blender: apt-get install blender (Debian) or put '
                          'blender on PATH')
  assert sorted(q.name for q in tmp_path.iterdir()) == ['in.npz']


def _fake_blender(folder, body: str):
  """A `blender` on PATH that runs `body` (sh) instead of Blender."""
  exe = folder / 'blender'
  exe.write_text('#!/bin/sh\n' + body + '\n')
  exe.chmod(0o755)
  return exe


def _tiny_solution():
  rig = skeleton.cmu_body()
  T, J = 3, rig.num_joints
  R = np.broadcast_to(np.eye(3, dtype=np.float32), (T, J, 3, 3)).copy()
  p = np.zeros((T, J, 3), np.float32)
  off = rig.template().astype(np.float32)
  return solver_lib.Solution(R, R, R, p, p, off, np.zeros((J, 3, 3), np.float32)), rig


def test_failing_blender_reports_its_last_line(tmp_path, monkeypatch):
  _fake_blender(tmp_path, 'echo "Traceback ..." >&2\necho "RuntimeError: no armature" >&2\n'
                'exit 1')
  monkeypatch.setenv('PATH', f'{tmp_path}{os.pathsep}{os.environ["PATH"]}')
  sol, rig = _tiny_solution()
  out = tmp_path / 'out' / 'x.fbx'
  out.parent.mkdir()
  with pytest.raises(blender.BlenderError, match=r'^Blender failed converting x\.glb to FBX '
                     r'\(exit 1\): RuntimeError: no armature$'):
    exports.write_solution_fbx(out, sol, rig, FPS)
  assert list(out.parent.iterdir()) == []  # no FBX, no temp left


def test_hanging_blender_is_killed(tmp_path, monkeypatch):
  _fake_blender(tmp_path, f'{sys.executable} -c "import time; time.sleep(30)"')  # sh's child
  monkeypatch.setenv('PATH', f'{tmp_path}{os.pathsep}{os.environ["PATH"]}')
  monkeypatch.setattr(blender, 'TIMEOUT_BASE_S', 1.0)
  monkeypatch.setattr(blender, 'TIMEOUT_PER_FRAME_S', 0.0)
  sol, rig = _tiny_solution()
  out = tmp_path / 'out' / 'x.fbx'
  out.parent.mkdir()
  t = time.perf_counter()
  with pytest.raises(blender.BlenderError, match='did not finish converting x.glb to FBX within '
                     '1 s'):
    exports.write_solution_fbx(out, sol, rig, FPS)
  assert time.perf_counter() - t < 10 and list(out.parent.iterdir()) == []


# Blender as the writer: CMU's BVH imported (BVH y-up -> Blender z-up), every bone renamed into
# a namespace, exported in Blender's world (z-up, the file's +z forward now -y) with YXZ channels.
_REWRITE_BVH = blender._PRELUDE + r"""
_open = builtins.open  # Blender 3.4's BVH importer opens with mode "rU" (refused by 3.11)
builtins.open = lambda f, mode='r', *a, **k: _open(f, mode.replace('U', ''), *a, **k)
bpy.ops.import_anim.bvh(filepath=P['input'], global_scale=1.0, use_fps_scale=False,
                        update_scene_fps=True, update_scene_duration=True, rotate_mode='NATIVE',
                        axis_forward='-Z', axis_up='Y')
arm = the_armature()
for b in arm.pose.bones:
  b.name = P['prefix'] + b.name
bpy.ops.export_anim.bvh(filepath=P['output'], frame_start=scene.frame_start,
                        frame_end=scene.frame_end, rotate_mode=P['order'],
                        root_transform_only=True, global_scale=1.0)
"""


def test_a_bvh_blender_wrote_reads_as_the_original(blender_exe, cmu_dir, tmp_path):
  """Blender 3.4's BVH exporter as a writer of our input: 07_05 re-written by Blender (bones
  renamed 'mocap:NAME', z-up and -y forward, YXZ channels, Blender's number format), read with
  a joint map naming that prefix and those axes (the shipped cmu_body map otherwise), gives the
  original file's joint positions and rest offsets (rig world, metres). Blender computes in
  float32: 16 ulps per level of the source chain times the largest distance from the origin
  (about 0.05 mm); measured 0.0003 mm. A wrong axis moves the body by metres."""
  src = cmu_dir / '07_05.bvh'
  out = tmp_path / 'blender.bvh'
  with _blenders_numpy():
    blender.run_script(_REWRITE_BVH, {'input': str(src), 'output': str(out),
                                      'prefix': 'mocap:', 'order': 'YXZ'},
                       blender.timeout_s(600), 'rewriting a BVH', blender=blender_exe)
  head = out.read_text().split('MOTION')[0]
  assert 'ROOT mocap:Hips' in head and 'Yrotation Xrotation Zrotation' in head
  jmap = json.loads((Path(exports.__file__).parent / 'joint_maps' / 'cmu_body.json').read_text())
  jmap.pop('$schema')
  jmap['joints'] = {'mocap:' + k: v for k, v in jmap['joints'].items()}
  jmap['prune'] = ['mocap:' + k for k in jmap['prune']]
  jmap['mirror_pairs'] = [['mocap:' + a, 'mocap:' + b] for a, b in jmap['mirror_pairs']]
  jmap.update(up='+z', forward='-y')
  (tmp_path / 'mocap.json').write_text(json.dumps(jmap))
  rig = skeleton.cmu_body()
  ours = exports.read_bvh_clip(out, rig, joint_map=str(tmp_path / 'mocap.json'), fps=FPS,
                               max_frames=4 * FRAMES)
  ref = exports.read_bvh_clip(src, rig, fps=FPS, max_frames=4 * FRAMES)
  assert ours.positions.shape == ref.positions.shape == (FRAMES, rig.num_joints, 3)
  motion = bvh_lib.read_bvh(src)
  levels = max(_depth(motion.parents, j) for j in range(len(motion.names))) + 1
  tol = 16 * levels * float(np.finfo(np.float32).eps) * float(
      np.linalg.norm(ref.positions, axis=-1).max())
  print(f'a BVH Blender wrote: within {1e3 * np.abs(ours.positions - ref.positions).max():.5f} '
        f'mm of the original (tolerance {1e3 * tol:.3f})')  # the docstring's figure (pytest -s)
  np.testing.assert_allclose(ours.positions, ref.positions, rtol=0, atol=tol)
  np.testing.assert_allclose(ours.offsets, ref.offsets, rtol=0, atol=tol)


def test_times(written):
  """Not a check: the Blender steps' seconds and errors, shown with `pytest -s`."""
  print({k: float(f'{v:.3g}') for k, v in TIMES.items()})
