"""The solver's GLB, BVH and FBX as a second client reads them: Assimp (Open Asset Import
Library, the importer behind many engines and viewers; Debian's `assimp-utils`), through its
command line `assimp dump FILE OUT.assxml`, which writes the imported scene as XML. Skipped
without `assimp` on PATH (and the FBX case without Blender, which writes the FBX), as
tests/blender_test.py is without Blender; that test checks the same files in Blender.

A real CMU clip (07_05, the unseen subject, 45 frames at 30 fps) solved by the shipped checkpoint
is written as GLB, as BVH in centimetres (ZYX, and once with each joint in another of the six
rotation orders), and as FBX; a 3-joint z-up rig's GLB checks the axes node. From Assimp's scene
alone (node hierarchy, rest matrices, per-node position / rotation / scaling keys):
- the rig's joints are nodes with the rig's names and parents;
- every joint's rotation and root translation has one key per frame, at frame / fps seconds;
- composing the nodes' keyed transforms over the hierarchy at every frame gives the solution's FK
  joint positions (`Solution.positions_fk`; file units times metres per unit) and world
  rotations (`Solution.global_rot`; in the glTF y-up world for the GLB and FBX, the rig's world
  for the BVH).

Tolerance: `assimp dump` prints every number with 6 decimals and Assimp computes in float32.
Per level of the chain a rotation may then be off by 2|dq| <= 2e-6 rad (four quaternion
components rounded by 5e-7) plus 16 float32 ulps, and a translation by 1e-6 file units; over
`depth + 1` levels (7 on cmu_body: 2.7e-5 rad) and times the largest distance from the origin
for positions (about 0.08 mm here). Measured (printed with `pytest -s`): positions within
0.003 mm, rotations within 6e-6 rad. A key one frame off moves some joint of this clip by 30 mm
or more.
"""

import shutil
import subprocess
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from ik_gat_jax import kinematics, skeleton
from ik_gat_jax import solver as solver_lib
from ik_gat_jax.io import exports
from ik_gat_jax.io import gltf as gltf_lib

FPS = 30.0  # solved_07_05's (conftest.py)
NO_ASSIMP = 'assimp not on PATH; apt-get install assimp-utils'


@pytest.fixture(scope='module')
def assimp_exe() -> str:
  exe = shutil.which('assimp')
  if exe is None:
    pytest.skip(NO_ASSIMP)
  return exe


@pytest.fixture(scope='module')
def solved(assimp_exe, solved_07_05):
  del assimp_exe  # asked first, so nothing is solved for nothing
  return solved_07_05  # conftest.py: 45 frames of 07_05 at FPS


def assimp_scene(exe: str, path, tmp_path) -> dict:
  """Assimp's scene of `path`: {'parent': {node: parent or None}, 'rest': {node: [4, 4]},
  'keys': {node: {'T' | 'R' | 'S': (times in seconds [K], values [K, 3 | 4 (x, y, z, w)])}}}."""
  out = tmp_path / f'{path.name}.assxml'
  p = subprocess.run([exe, 'dump', str(path), str(out)], capture_output=True, text=True,
                     timeout=120, check=False)
  assert p.returncode == 0 and out.is_file(), (p.stdout + p.stderr)[-2000:]
  scene = ET.parse(out).getroot().find('Scene')
  parent, rest = {}, {}

  def walk(el, up):
    name = el.get('name')
    parent[name] = up
    rest[name] = np.array(el.find('Matrix4').text.split(), np.float64).reshape(4, 4)
    for child in el.findall('NodeList/Node'):
      walk(child, name)

  walk(scene.find('Node'), None)
  (anim,) = scene.findall('AnimationList/Animation')
  ticks = float(anim.get('tick_cnt'))
  keys = {}
  for na in anim.findall('NodeAnimList/NodeAnim'):
    keys[na.get('node')] = {
        kind: (np.array([float(k.get('time')) for k in na.findall(f'{tag}List/{tag}')]) / ticks,
               np.array([k.text.split() for k in na.findall(f'{tag}List/{tag}')], np.float64))
        for kind, tag in (('T', 'PositionKey'), ('R', 'RotationKey'), ('S', 'ScalingKey'))}
  return dict(parent=parent, rest=rest, keys=keys)


def world_at(scene: dict, frame: int) -> dict[str, np.ndarray]:
  """Every node's world matrix [4, 4] at `frame`: a keyed node's T R S from its key `frame` (or
  its only key), else its rest matrix, composed from the root."""
  out = {}

  def get(name):
    if name not in out:
      M = scene['rest'][name]
      if name in scene['keys']:
        k = scene['keys'][name]
        pick = lambda kind: k[kind][1][frame if len(k[kind][1]) > 1 else 0]  # noqa: E731
        M = np.eye(4)
        M[:3, :3] = Rotation.from_quat(pick('R')).as_matrix() * pick('S')[None, :]
        M[:3, 3] = pick('T')
      up = scene['parent'][name]
      out[name] = M if up is None else get(up) @ M
    return out[name]

  for name in scene['parent']:
    get(name)
  return out


def _depth(parents, j: int) -> int:
  d = 0
  while parents[j] >= 0:
    j, d = parents[j], d + 1
  return d


def check_scene(scene: dict, rig, positions: np.ndarray, rotations: np.ndarray, fps: float,
                metres_per_unit: float, extra_levels: int = 0) -> None:
  """The module docstring's checks; `positions [T, J, 3]` metres, `rotations [T, J, 3, 3]`."""
  names = list(rig.joint_names)
  for j, name in enumerate(names):
    assert name in scene['parent'], (name, sorted(scene['parent']))
    if rig.parents[j] >= 0:
      assert scene['parent'][name] == names[rig.parents[j]], name
    times, q = scene['keys'][name]['R']
    assert len(q) == len(positions), (name, len(q))
    np.testing.assert_allclose(times, np.arange(len(positions)) / fps, atol=1e-5, err_msg=name)
  assert len(scene['keys'][names[0]]['T'][1]) == len(positions)
  levels = max(_depth(rig.parents, j) for j in range(rig.num_joints)) + 1 + extra_levels
  rot_tol = levels * (2e-6 + 16 * float(np.finfo(np.float32).eps))
  pos_tol = (rot_tol * float(np.linalg.norm(positions, axis=-1).max()) +
             levels * 1e-6 * metres_per_unit)
  worst_p = worst_r = 0.0
  for t in range(len(positions)):
    W = world_at(scene, t)
    P = np.array([W[n][:3, 3] for n in names]) * metres_per_unit
    G = np.array([W[n][:3, :3] for n in names])
    G = G / np.linalg.norm(G, axis=1, keepdims=True)  # unit columns (an FBX node's scale 1)
    worst_p = max(worst_p, float(np.abs(P - positions[t]).max()))
    # The angle between two rotations, stable near 0: 2 asin(|A - B|_F / (2 sqrt 2)).
    d = np.linalg.norm(G - rotations[t], axis=(1, 2)) / (2 * np.sqrt(2))
    worst_r = max(worst_r, float((2 * np.arcsin(np.clip(d, 0, 1))).max()))
  # The module docstring's measured figures (`python -m pytest -s tests/assimp_test.py`).
  print(f'assimp: positions within {1e3 * worst_p:.4f} mm (tolerance {1e3 * pos_tol:.3f}), '
        f'rotations within {worst_r:.2e} rad (tolerance {rot_tol:.1e})')
  assert worst_p <= pos_tol, (worst_p, pos_tol)
  assert worst_r <= rot_tol, (worst_r, rot_tol)


@pytest.mark.parametrize('orders', ['ZYX', 'mixed'])
def test_bvh(assimp_exe, solved, tmp_path, orders, write_bvh_in_orders):
  sol, rig = solved
  write_bvh_in_orders(tmp_path / 'clip.bvh', sol, rig, FPS, orders)
  scene = assimp_scene(assimp_exe, tmp_path / 'clip.bvh', tmp_path)
  check_scene(scene, rig, np.asarray(sol.positions_fk), np.asarray(sol.global_rot), FPS, 0.01)


def test_glb(assimp_exe, solved, tmp_path):
  sol, rig = solved
  path = tmp_path / 'clip.glb'
  exports.write_solution_glb(path, sol, rig, FPS)
  scene = assimp_scene(assimp_exe, path, tmp_path)
  assert not gltf_lib.needs_axes_node(rig)  # cmu_body is y-up, +z forward: glTF's world
  check_scene(scene, rig, np.asarray(sol.positions_fk), np.asarray(sol.global_rot), FPS, 1.0)


def test_fbx(assimp_exe, solved, tmp_path, write_fbx_or_skip):
  sol, rig = solved
  path = tmp_path / 'clip.fbx'
  write_fbx_or_skip(path, sol, rig, FPS)
  scene = assimp_scene(assimp_exe, path, tmp_path)
  # Assimp's FBX scene puts Blender's armature node (a fixed axis rotation) above the root.
  check_scene(scene, rig, np.asarray(sol.positions_fk), np.asarray(sol.global_rot), FPS, 1.0,
              extra_levels=2)


def test_z_up_glb_sits_under_its_axes_node(assimp_exe, tmp_path):
  """tests/gltf_test.py's 3-joint z-up rig: in Assimp's world (glTF's y-up) every joint sits at
  W p and turns by W G, W the rig's axes -> glTF's."""
  offsets = np.array([[0.0, 0.0, 1.0], [0.0, 0.0, 0.5], [0.2, 0.0, 0.0]])
  rig = skeleton.make_rig('zup', ['Root', 'Mid', 'Tip'], [-1, 0, 1], offsets,
                          up=(0, 0, 1), forward=(0, 1, 0))
  T, fps = 6, 24.0
  R = Rotation.random(T * 3, random_state=2).as_matrix().reshape(T, 3, 3, 3).astype(np.float32)
  root = np.arange(T * 3, dtype=np.float32).reshape(T, 3) * 0.1
  G, p = (np.asarray(x, np.float64) for x in kinematics.forward_kinematics(
      R, offsets.astype(np.float32), rig.parents, root_pos=root))
  sol = solver_lib.Solution(R, G, G, p, p, offsets.astype(np.float32), np.zeros((3, 3, 3)))
  path = tmp_path / 'zup.glb'
  exports.write_solution_glb(path, sol, rig, fps)
  scene = assimp_scene(assimp_exe, path, tmp_path)
  assert scene['parent']['Root'] == 'zup_to_gltf', scene['parent']
  W = gltf_lib.rig_to_gltf(rig)
  check_scene(scene, rig, p @ W.T, W @ G, fps, 1.0, extra_levels=1)
