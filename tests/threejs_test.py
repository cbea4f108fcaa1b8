"""The solver's GLB, BVH and FBX as the web reads them: three.js (its GLTFLoader, BVHLoader,
FBXLoader and AnimationMixer, in Node.js) and the Khronos glTF validator, the reference checker
of the glTF 2.0 specification. Both are npm packages pinned in tests/clients/package-lock.json;
`make clients` installs them into tests/clients/node_modules (`make test` does it first where
`npm` is on PATH and the registry answers). Without `node` or those packages the tests skip
with the reason (and the FBX case without Blender, which writes the FBX), as
tests/blender_test.py does without Blender and tests/assimp_test.py without Assimp.

The clip is tests/assimp_test.py's: a real CMU clip (07_05, the unseen subject, 45 frames at
30 fps) solved by the shipped checkpoint. It is written as GLB, as BVH in centimetres (ZYX, and
once with each joint in another of the six rotation orders) and as FBX; a 3-joint z-up rig's GLB
checks the axes node, and a rig named as Blender names bones (`spine.001`, `thigh.L`: three.js
drops the dots from the names it binds animation to) checks that every joint is still driven.
- The validator reports no error, warning, info or hint on each GLB, a one-frame clip's too (and
  does report a file whose accessor bounds were tampered with, so the check is live).
- three.js finds the rig's joints as bones with the rig's parents, one key per frame at
  frame / fps seconds on every joint's rotation and the root's translation, and, playing the
  clip, puts every joint at the solution's FK position (`Solution.positions_fk`, file units
  times metres per unit) turned by its world rotation (`Solution.global_rot`), in glTF's y-up
  world for the GLB and FBX. The skinned box body (GLB, FBX) follows: every vertex three.js skins
  (the CPU form of its skinning shader) is where its joint's rotation and position take its
  bind-pose position, G_j (b - rest_j) + p_j.

Tolerance: three.js keeps keys in float32 and composes in float64; the solution is float32. Per
level of the chain a rotation may then be off by 16 float32 ulps (the quaternion's rounding and
the float32 products on both sides), so `depth + 1` levels (7 on cmu_body: 1.3e-5 rad), and a
position by that times the largest distance from the origin plus 4 ulps of it per level; the
BVH's 6 decimals add 1e-6 file units per level. The clip is played at each key's own float32
time, so no key is blended with the next. Measured (printed with `pytest -s`): joints and skinned
vertices within 0.001 mm, rotations within 1.5e-6 rad. A key one frame off moves some joint of
this clip by 30 mm or more; offsets 0.1% too long move a vertex by 1 mm.
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pygltflib
import pytest
from scipy.spatial.transform import Rotation

from ik_gat_jax import kinematics, skeleton
from ik_gat_jax import solver as solver_lib
from ik_gat_jax.io import exports
from ik_gat_jax.io import gltf as gltf_lib

FPS = 30.0  # solved_07_05's (conftest.py)
CLIENTS = Path(__file__).parent / 'clients'
EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope='module')
def node_exe() -> str:
  exe = shutil.which('node')
  if exe is None:
    pytest.skip('node not on PATH; apt-get install nodejs npm, then make clients')
  for package in ('three', 'gltf-validator'):
    if not (CLIENTS / 'node_modules' / package / 'package.json').is_file():
      pytest.skip(f'{package} not in tests/clients/node_modules; run make clients')
  return exe


@pytest.fixture(scope='module')
def solved(node_exe, solved_07_05):
  del node_exe  # asked first, so nothing is solved for nothing
  return solved_07_05  # conftest.py: 45 frames of 07_05 at FPS


def _node(exe: str, *args) -> dict:
  p = subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=180,
                     check=False, cwd=CLIENTS)
  assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
  return json.loads(p.stdout)


def three_scene(exe: str, kind: str, path, frames) -> dict:
  """tests/clients/three_read.mjs's JSON (see that file) of `path` played at `frames`."""
  return _node(exe, 'three_read.mjs', kind, path, ','.join(map(str, frames)))


def validate(exe: str, path) -> dict:
  """The Khronos glTF validator's issues of `path` ({'numErrors', 'numWarnings', ...})."""
  return _node(exe, 'validate.mjs', path)['issues']


def three_name(name: str) -> str:
  """three.js's PropertyBinding.sanitizeNodeName: what its loaders bind animation to."""
  return re.sub(r'[\[\]\.:/]', '', re.sub(r'\s', '_', name))


def _depth(parents, j: int) -> int:
  d = 0
  while parents[j] >= 0:
    j, d = parents[j], d + 1
  return d


def _rest_positions(offsets: np.ndarray, parents) -> np.ndarray:
  """Every joint's rest position (identity rotations): its offsets summed along its chain."""
  rest = np.zeros((len(parents), 3))
  for j, up in enumerate(parents):
    rest[j] = np.asarray(offsets[j], np.float64) + (rest[up] if up >= 0 else 0.0)
  return rest


def _angles(A: np.ndarray, B: np.ndarray) -> np.ndarray:
  """The angle between rotations, stable near 0: 2 asin(|A - B|_F / (2 sqrt 2))."""
  d = np.linalg.norm(A - B, axis=(-2, -1)) / (2 * np.sqrt(2))
  return 2 * np.arcsin(np.clip(d, 0, 1))


def check_scene(scene: dict, rig, positions: np.ndarray, rotations: np.ndarray, fps: float,
                metres_per_unit: float, by_node: bool, extra_levels: int = 0,
                W: np.ndarray | None = None, offsets: np.ndarray | None = None) -> None:
  """The module docstring's checks. `positions [T, J, 3]` and `rotations [T, J, 3, 3]` are the
  solution's in the rig's world; `W` takes them to the file's world (identity by default).
  `by_node`: joints are found by their glTF node index (joint j is node j), else by name.
  With `offsets`, the skinned body is checked too."""
  W = np.eye(3) if W is None else W
  T, J = positions.shape[:2]
  names = list(rig.joint_names)
  index = {}
  for i, joint in enumerate(scene['joints']):
    key = joint['node'] if by_node else joint['name']
    if key is not None:
      index[key] = i
  rows = [index[j if by_node else name] for j, name in enumerate(names)]
  got_names = [scene['joints'][i]['name'] for i in rows]
  assert got_names == [three_name(n) for n in names], got_names
  for j in range(1, J):
    assert scene['joints'][rows[j]]['parent'] == got_names[rig.parents[j]], names[j]
  tracks = {t['name']: t for t in scene['tracks']}
  for track in [f'{n}.quaternion' for n in got_names] + [f'{got_names[0]}.position']:
    assert track in tracks, (track, sorted(tracks))
    t = tracks[track]
    assert t['keys'] == T, t
    np.testing.assert_allclose([t['first'], t['last']], [0.0, (T - 1) / fps], atol=1e-5)
  np.testing.assert_allclose(scene['duration'], (T - 1) / fps, atol=1e-5)

  levels = max(_depth(rig.parents, j) for j in range(J)) + 1 + extra_levels
  reach = float(np.linalg.norm(positions, axis=-1).max())
  rot_tol = levels * 16 * EPS32
  pos_tol = rot_tol * reach + levels * (4 * EPS32 * reach + 1e-6 * metres_per_unit)
  frames = [f['frame'] for f in scene['frames']]
  np.testing.assert_allclose([f['time'] for f in scene['frames']], np.array(frames) / fps,
                             atol=1e-5)
  P = np.array([f['position'] for f in scene['frames']])[:, rows] * metres_per_unit
  Q = np.array([f['quaternion'] for f in scene['frames']])[:, rows]
  G = Rotation.from_quat(Q.reshape(-1, 4)).as_matrix().reshape(len(frames), J, 3, 3)
  want_p = np.asarray(positions, np.float64)[frames] @ W.T
  want_G = W @ np.asarray(rotations, np.float64)[frames]
  worst_p = float(np.abs(P - want_p).max())
  worst_r = float(_angles(G, want_G).max())
  line = (f'three.js: positions within {1e3 * worst_p:.2e} mm (tolerance {1e3 * pos_tol:.3f}), '
          f'rotations within {worst_r:.1e} rad (tolerance {rot_tol:.1e})')
  if offsets is not None:
    bind = scene['bind']
    assert bind is not None, 'no skinned mesh'
    b = np.array(bind['position'], np.float64).reshape(-1, 3)
    weights = np.array(bind['weights']).reshape(-1, 4)
    np.testing.assert_array_equal(weights, np.tile([1.0, 0, 0, 0], (len(b), 1)))
    bone_rows = np.array(bind['bones'])[np.array(bind['joints']).reshape(-1, 4)[:, 0]]
    joint_of = np.array([rows.index(r) for r in bone_rows])  # each vertex's rig joint
    rest = _rest_positions(offsets, rig.parents)[joint_of]
    local = (b @ W)[None] - rest[None]                      # [1, V, 3], the rig's world
    Gv = np.asarray(rotations, np.float64)[frames][:, joint_of]
    pv = np.asarray(positions, np.float64)[frames][:, joint_of]
    want_v = (np.einsum('tvab,tvb->tva', Gv, np.broadcast_to(local, pv.shape)) + pv) @ W.T
    skinned = np.array([f['skinned'] for f in scene['frames']])
    worst_v = float(np.abs(skinned - want_v).max())
    vert_tol = pos_tol + rot_tol * float(np.linalg.norm(local, axis=-1).max())
    line += f', skinned vertices within {1e3 * worst_v:.2e} mm (tolerance {1e3 * vert_tol:.3f})'
    assert worst_v <= vert_tol, (worst_v, vert_tol)
  print(line)  # the module docstring's measured figures (`pytest -s`)
  assert worst_p <= pos_tol, (worst_p, pos_tol)
  assert worst_r <= rot_tol, (worst_r, rot_tol)


def _random_clip(rig, T: int, seed: int) -> solver_lib.Solution:
  """A clip of random rotations on `rig`'s offsets, as the solver returns one (float32)."""
  J = rig.num_joints
  R = Rotation.random(T * J, random_state=seed).as_matrix().reshape(T, J, 3, 3)
  R = R.astype(np.float32)
  root = (np.arange(T * 3, dtype=np.float32).reshape(T, 3) * 0.1)
  offsets = np.asarray(rig.template_offsets, np.float32)
  G, p = (np.asarray(x) for x in kinematics.forward_kinematics(R, offsets, rig.parents,
                                                               root_pos=root))
  return solver_lib.Solution(R, G, G, p, p, offsets, np.zeros((J, 3, 3), np.float32))


def _zup_rig():
  offsets = np.array([[0.0, 0.0, 1.0], [0.0, 0.0, 0.5], [0.2, 0.0, 0.0]])
  return skeleton.make_rig('zup', ['Root', 'Mid', 'Tip'], [-1, 0, 1], offsets,
                           up=(0, 0, 1), forward=(0, 1, 0))


def _blender_named_rig():
  names = ['hips', 'spine', 'spine.001', 'thigh.L', 'shin.L', 'thigh.R', 'shin.R',
           'upper_arm.L', 'forearm.L']
  parents = [-1, 0, 1, 0, 3, 0, 5, 2, 7]
  offsets = np.array([[0, 1.0, 0], [0, 0.1, 0], [0, 0.25, 0], [0.1, -0.05, 0], [0, -0.45, 0],
                      [-0.1, -0.05, 0], [0, -0.45, 0], [0.18, 0.1, 0], [0.28, 0, 0]])
  return skeleton.make_rig('blender_names', names, parents, offsets, up=(0, 1, 0),
                           forward=(0, 0, 1))


def test_validator_finds_no_issue(node_exe, solved, tmp_path):
  sol, rig = solved
  cases = {'cmu_clip': (sol, rig), 'one_frame': (_first_frame(sol), rig)}
  for name, make in (('zup', _zup_rig), ('blender_names', _blender_named_rig)):
    r = make()
    cases[name] = (_random_clip(r, 5, seed=3), r)
  for name, (s, r) in cases.items():
    path = tmp_path / f'{name}.glb'
    exports.write_solution_glb(path, s, r, FPS)
    issues = validate(node_exe, path)
    counts = [issues[f'num{kind}'] for kind in ('Errors', 'Warnings', 'Infos', 'Hints')]
    assert counts == [0, 0, 0, 0], (name, issues['messages'])
    print(f'glTF validator, {name}: {issues["numErrors"]} errors, {issues["numWarnings"]} '
          f'warnings, {issues["numInfos"]} infos, {issues["numHints"]} hints')


def _first_frame(sol):
  return solver_lib.Solution(*(getattr(sol, f)[:1] for f in (
      'local_rot', 'global_rot', 'bone_aligned_rot', 'positions_fk', 'positions')),
                             sol.offsets, sol.bone_frames)


def test_validator_reports_a_tampered_file(node_exe, solved, tmp_path):
  """The check above is live: a GLB whose POSITION bounds no longer hold is reported."""
  sol, rig = solved
  path = tmp_path / 'clip.glb'
  exports.write_solution_glb(path, sol, rig, FPS)
  gltf = pygltflib.GLTF2().load(str(path))
  position = gltf.accessors[gltf.meshes[0].primitives[0].attributes.POSITION]
  position.max = [m - 0.01 for m in position.max]
  gltf.save(str(path))
  issues = validate(node_exe, path)
  codes = {m['code'] for m in issues['messages']}
  assert issues['numErrors'] > 0 and 'ACCESSOR_MAX_MISMATCH' in codes, issues


def test_glb(node_exe, solved, tmp_path):
  sol, rig = solved
  path = tmp_path / 'clip.glb'
  exports.write_solution_glb(path, sol, rig, FPS)
  scene = three_scene(node_exe, 'glb', path, range(sol.num_frames))
  assert not gltf_lib.needs_axes_node(rig)  # cmu_body is y-up, +z forward: glTF's world
  check_scene(scene, rig, sol.positions_fk, sol.global_rot, FPS, 1.0, by_node=True,
              offsets=sol.offsets)


@pytest.mark.parametrize('make_rig', [_zup_rig, _blender_named_rig], ids=['zup', 'blender'])
def test_glb_of_another_rig(node_exe, tmp_path, make_rig):
  """The z-up rig sits under its axes node (W: the rig's axes -> glTF's); the Blender-named
  rig's joints are bound to animation by their names without dots, every one of them."""
  rig = make_rig()
  sol = _random_clip(rig, 6, seed=2)
  path = tmp_path / 'rig.glb'
  exports.write_solution_glb(path, sol, rig, 24.0)
  scene = three_scene(node_exe, 'glb', path, range(6))
  W = gltf_lib.rig_to_gltf(rig)
  check_scene(scene, rig, sol.positions_fk, sol.global_rot, 24.0, 1.0, by_node=True,
              extra_levels=int(gltf_lib.needs_axes_node(rig)), W=W, offsets=sol.offsets)


@pytest.mark.parametrize('orders', ['ZYX', 'mixed'])
def test_bvh(node_exe, solved, tmp_path, orders, write_bvh_in_orders):
  sol, rig = solved
  write_bvh_in_orders(tmp_path / 'clip.bvh', sol, rig, FPS, orders)
  scene = three_scene(node_exe, 'bvh', tmp_path / 'clip.bvh', range(sol.num_frames))
  check_scene(scene, rig, sol.positions_fk, sol.global_rot, FPS, 0.01, by_node=False)


def test_bvh_of_a_rig_whose_root_has_an_offset(node_exe, tmp_path):
  """BVHLoader adds the root's OFFSET to its position channels (Blender and Assimp do not):
  the writer's root OFFSET 0 0 0 puts the body where the solution has it (the z-up rig's root
  rests 1 m up; it was drawn 1 m too high)."""
  rig = _zup_rig()
  sol = _random_clip(rig, 6, seed=4)
  assert np.linalg.norm(sol.offsets[0]) > 0.5
  exports.write_solution_bvh(tmp_path / 'rig.bvh', sol, rig, 24.0)
  scene = three_scene(node_exe, 'bvh', tmp_path / 'rig.bvh', range(6))
  check_scene(scene, rig, sol.positions_fk, sol.global_rot, 24.0, 0.01, by_node=False)


def test_fbx(node_exe, solved, tmp_path, write_fbx_or_skip):
  sol, rig = solved
  path = tmp_path / 'clip.fbx'
  write_fbx_or_skip(path, sol, rig, FPS)
  scene = three_scene(node_exe, 'fbx', path, range(sol.num_frames))
  # three.js puts Blender's armature node (a fixed axis rotation and scale) above the root.
  check_scene(scene, rig, sol.positions_fk, sol.global_rot, FPS, 1.0, by_node=False,
              extra_levels=2, offsets=sol.offsets)
