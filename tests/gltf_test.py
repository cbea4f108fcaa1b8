"""GLB export (ik_gat_jax/io/gltf.py): a solved real clip written, read back with pygltflib.

Everything is checked from the file alone: the node names and hierarchy, the keyframe rotations
against the solution's local rotations, FK over the nodes against the solution's FK positions,
the key times, the skin (joints, weights, inverse bind matrices) and that each box moves
rigidly with its joint. A z-up rig checks the axes node; `solve_file` writes a .glb.
"""

import numpy as np
import pygltflib
import pytest
from scipy.spatial.transform import Rotation

from ik_gat_jax import kinematics, skeleton, solve
from ik_gat_jax import solver as solver_lib
from ik_gat_jax.io import exports
from ik_gat_jax.io import gltf as gltf_lib

FPS = 30.0
FRAMES = 30


def _quiet(msg):
  del msg


@pytest.fixture(scope='module')
def solver():
  return solver_lib.IKSolver.from_checkpoint()


@pytest.fixture(scope='module')
def solved(cmu_dir, solver):
  """07_12's first 30 frames (at 30 fps), solved by the shipped checkpoint."""
  clip = exports.read_bvh_clip(cmu_dir / '07_12.bvh', solver.rig, fps=FPS, max_frames=4 * FRAMES)
  pos = clip.positions[:FRAMES]
  return solver.solve(pos, offsets=clip.offsets, full=True), solver.rig


@pytest.fixture(scope='module')
def glb(solved, tmp_path_factory):
  sol, rig = solved
  path = tmp_path_factory.mktemp('glb') / 'clip.glb'
  exports.write_solution_glb(path, sol, rig, FPS)
  return pygltflib.GLTF2.load(path)


def _quat_matrix(q_xyzw: np.ndarray) -> np.ndarray:
  return Rotation.from_quat(np.asarray(q_xyzw, np.float64)).as_matrix()


def _channels(g: pygltflib.GLTF2) -> dict:
  """(node, path) -> (times [T], values [T, 3|4]) of the only animation."""
  (anim,) = g.animations
  out = {}
  for ch in anim.channels:
    s = anim.samplers[ch.sampler]
    assert s.interpolation == 'LINEAR'
    out[(ch.target.node, ch.target.path)] = (gltf_lib.accessor_array(g, s.input),
                                             gltf_lib.accessor_array(g, s.output))
  return out


def _parents(g: pygltflib.GLTF2) -> dict[int, int]:
  return {c: i for i, n in enumerate(g.nodes) for c in (n.children or [])}


def _world(g: pygltflib.GLTF2, frame: int) -> tuple[np.ndarray, np.ndarray]:
  """Every node's world rotation [N, 3, 3] and translation [N, 3] at `frame`: node TRS with the
  animated channels, composed over the hierarchy (scene roots from the identity)."""
  ch = _channels(g)
  parent = _parents(g)
  N = len(g.nodes)
  R, p = [None] * N, [None] * N

  def visit(i):
    if R[i] is not None:
      return
    n = g.nodes[i]
    assert n.matrix is None and n.scale in (None, [1.0, 1.0, 1.0])
    q = ch[(i, 'rotation')][1][frame] if (i, 'rotation') in ch else (n.rotation or [0, 0, 0, 1])
    t = (ch[(i, 'translation')][1][frame] if (i, 'translation') in ch
         else (n.translation or [0, 0, 0]))
    Rl, tl = _quat_matrix(q), np.asarray(t, np.float64)
    if i in parent:
      visit(parent[i])
      R[i], p[i] = R[parent[i]] @ Rl, p[parent[i]] + R[parent[i]] @ tl
    else:
      R[i], p[i] = Rl, tl

  for i in range(N):
    visit(i)
  return np.stack(R), np.stack(p)


def test_nodes_are_the_rig(glb, solved):
  sol, rig = solved
  J = rig.num_joints
  assert [n.name for n in glb.nodes[:J]] == list(rig.joint_names)
  parent = _parents(glb)
  assert [parent.get(j, -1) for j in range(J)] == list(rig.parents)
  np.testing.assert_allclose([n.translation for n in glb.nodes[:J]], sol.offsets, atol=1e-7)
  assert all(n.rotation == [0.0, 0.0, 0.0, 1.0] for n in glb.nodes[:J])
  assert glb.scenes[glb.scene].nodes[0] == 0  # cmu_body is y up, +z forward: no axes node
  assert glb.asset.extras['fps'] == FPS and glb.asset.extras['rig'] == 'cmu_body'


def test_keyframes_reproduce_the_solution(glb, solved):
  sol, rig = solved
  ch = _channels(glb)
  assert len(ch) == rig.num_joints + 1
  for j in range(rig.num_joints):
    times, q = ch[(j, 'rotation')]
    np.testing.assert_allclose(times, np.arange(FRAMES) / FPS, atol=1e-7)
    assert times.dtype == np.float32 and q.shape == (FRAMES, 4)
    np.testing.assert_allclose(np.linalg.norm(q, axis=-1), 1.0, atol=1e-6)
    assert (np.sum(q[1:] * q[:-1], axis=-1) >= 0).all()  # continuous signs
    np.testing.assert_allclose(_quat_matrix(q), sol.local_rot[:, j], atol=1e-5)
  _, root = ch[(0, 'translation')]
  np.testing.assert_allclose(root, sol.positions_fk[:, 0], atol=1e-6)
  acc = glb.accessors[glb.animations[0].samplers[0].input]
  assert acc.min == [0.0] and acc.max[0] == pytest.approx((FRAMES - 1) / FPS)


def test_fk_over_the_nodes_is_the_solution(glb, solved):
  sol, rig = solved
  J = rig.num_joints
  for t in (0, FRAMES // 2, FRAMES - 1):
    R, p = _world(glb, t)
    np.testing.assert_allclose(p[:J], sol.positions_fk[t], atol=1e-5)
    np.testing.assert_allclose(R[:J], sol.global_rot[t], atol=1e-5)


def test_skin_moves_each_box_rigidly_with_its_joint(glb, solved):
  sol, rig = solved
  J = rig.num_joints
  (skin,) = glb.skins
  body = next(n for n in glb.nodes if n.mesh is not None)
  assert body.skin == 0 and sorted(skin.joints) == list(range(J))
  (prim,) = glb.meshes[body.mesh].primitives
  a = prim.attributes
  v32 = gltf_lib.accessor_array(glb, a.POSITION)
  v = v32.astype(np.float64)
  acc = glb.accessors[a.POSITION]
  assert acc.min == v.min(0).tolist() and acc.max == v.max(0).tolist()
  joints = gltf_lib.accessor_array(glb, a.JOINTS_0)
  weights = gltf_lib.accessor_array(glb, a.WEIGHTS_0)
  assert joints.dtype == np.uint16 and v32.dtype == np.float32
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-7)
  assert (weights[:, 0] == 1.0).all()
  owner = np.asarray(skin.joints)[joints[:, 0]]
  assert set(owner) == set(range(J))  # every joint carries a box
  assert len(gltf_lib.accessor_array(glb, prim.indices)) % 3 == 0
  ibm = gltf_lib.accessor_array(glb, skin.inverseBindMatrices).reshape(-1, 4, 4)
  ibm = np.swapaxes(ibm, -1, -2).astype(np.float64)  # column-major
  rest = skeleton.rest_positions_np(np.asarray(sol.offsets, np.float64), rig.parents)
  for j in range(J):  # the inverse bind matrices invert the rest world transforms
    np.testing.assert_allclose(ibm[j][:3, 3], -rest[j], atol=1e-6)
    np.testing.assert_allclose(ibm[j][:3, :3], np.eye(3), atol=1e-7)
  t = FRAMES // 2
  R, p = _world(glb, t)
  world = np.broadcast_to(np.eye(4), (J, 4, 4)).copy()
  world[:, :3, :3], world[:, :3, 3] = R[:J], p[:J]
  jm = (world @ ibm)[joints[:, 0]]  # the joint matrix of each vertex (one influence)
  skinned = np.einsum('vab,vb->va', jm[:, :3, :3], v) + jm[:, :3, 3]
  # rigid with the joint: its offset from the joint, in the joint's frame, is the bind one
  np.testing.assert_allclose(
      np.einsum('vba,vb->va', sol.global_rot[t][owner], skinned - sol.positions_fk[t][owner]),
      v - rest[owner], atol=1e-5)
  assert np.abs(skinned - v).max() > 0.05  # and it did move


def test_the_file_validates(glb):
  import warnings
  from pygltflib import validator
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')  # "provisional function"
    validator.validate(glb)


def test_z_up_rig_sits_under_an_axes_node():
  """A 3-joint z-up rig (forward +y): one fixed rotation node above the root maps it to glTF's
  y-up, +z-forward world; the joints below keep the rig's own rotations and offsets."""
  offsets = np.array([[0.0, 0.0, 1.0], [0.0, 0.0, 0.5], [0.2, 0.0, 0.0]])
  rig = skeleton.make_rig('zup', ['Root', 'Mid', 'Tip'], [-1, 0, 1], offsets,
                          up=(0, 0, 1), forward=(0, 1, 0))
  T = 4
  R = Rotation.random(T * 3, random_state=1).as_matrix().reshape(T, 3, 3, 3).astype(np.float32)
  root = np.arange(T * 3, dtype=np.float32).reshape(T, 3) * 0.1
  G, p = (np.asarray(x) for x in kinematics.forward_kinematics(
      R, offsets.astype(np.float32), rig.parents, root_pos=root))
  sol = solver_lib.Solution(R, G, G, p, p, offsets.astype(np.float32), np.zeros((3, 3, 3)))
  g = pygltflib.GLTF2.load_from_bytes(gltf_lib.solution_glb(sol, rig, 24.0))
  W = gltf_lib.rig_to_gltf(rig)
  np.testing.assert_allclose(W @ rig.up, [0, 1, 0], atol=1e-12)
  np.testing.assert_allclose(W @ rig.forward, [0, 0, 1], atol=1e-12)
  axes = g.scenes[g.scene].nodes[0]
  assert g.nodes[axes].name == 'zup_to_gltf' and g.nodes[axes].children == [0]
  times, _ = _channels(g)[(0, 'rotation')]
  np.testing.assert_allclose(times, np.arange(T) / 24.0, atol=1e-7)
  for t in range(T):
    Rw, pw = _world(g, t)
    np.testing.assert_allclose(pw[:3], p[t] @ W.T, atol=1e-5)
    np.testing.assert_allclose(Rw[:3], W @ G[t], atol=1e-5)


def test_solve_file_writes_glb(cmu_dir, tmp_path):
  out = tmp_path / 'x.glb'
  assert solve.output_kind(out) == 'glb'
  summary = solve.solve_file(cmu_dir / '07_12.bvh', out, fps=FPS, log=_quiet)
  g = pygltflib.GLTF2.load(out)
  assert [n.name for n in g.nodes[:21]] == list(skeleton.cmu_body().joint_names)
  times, _ = _channels(g)[(0, 'rotation')]
  assert len(times) == summary['frames'] and times[-1] == pytest.approx(
      (summary['frames'] - 1) / FPS)
  with pytest.raises(FileExistsError, match='--overwrite'):
    solve.solve_file(cmu_dir / '07_12.bvh', out, log=_quiet)
