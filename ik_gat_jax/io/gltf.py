"""A solved clip as glTF 2.0 binary (.glb): the rig as nodes, the motion as animation, a box body.

Written with pygltflib (the JSON is its dataclasses; only the binary chunk is ours). Layout:

- Nodes `0 .. J-1` are the rig's joints in rig order, named by the rig's joint names (or
  `names`), children as the rig's parents. Each joint's rest translation is the subject's rest
  offset (`sol.offsets`, metres; the root's is `offsets[0]`) and its rest rotation identity, so
  the animated rotation of node j *is* the solver's local rotation R_j (glTF quaternion
  `(x, y, z, w)`; ours are `(w, x, y, z)`).
- Axes. glTF is metres, right-handed, +y up, the asset facing +z. A rig whose `up` is +y and
  `forward` +z (cmu_body, smpl22) is written as is: the root joint is a scene root. Any other rig
  gets one extra node above the root, `<rig>_to_gltf` (index J), whose fixed rotation W takes
  the rig's (up, forward, up x forward) to glTF's (+y, +z, +x); the joints stay in the rig's own
  axes below it, so their rotations and offsets are still the solution's exactly.
- Animation `ik_gat`: per joint one LINEAR rotation sampler (keys at t / fps seconds, the clip's
  frame rate; quaternion signs kept continuous), and one LINEAR translation sampler for the root
  (the solution's root positions, `sol.positions_fk[:, 0]`). `asset.extras` records the rig,
  fps and frame count (glTF itself has no frame rate).
- Body (mesh `body`, on a node `body` at the scene root with skin `skeleton`): a box along every
  bone longer than 1 mm (joint -> child), 0.25 x its length wide (at most 8 cm, at least 5 mm)
  and 0.6 x that deep, and for a leaf a box along its rest bone direction (half the leaf's bone,
  at least 5 cm, 0.5 x that wide). Each box's 24 vertices are skinned 100% to the bone's parent
  joint (JOINTS_0 uint16, WEIGHTS_0 (1, 0, 0, 0)), so it moves rigidly with that joint, twist
  included (the cross-section is not square, so even a quarter turn shows). The skin's joints are
  every joint node; inverseBindMatrices are the inverses of the joints' rest world transforms
  (translation to the rest position, W included), the vertices are in the bind pose in glTF world
  space. Vertex colours: grey, blue on the rig's +lateral side, red on the other.
- Buffers are little-endian float32 (positions, normals, colours, weights, times, rotations,
  translations, inverse bind matrices, column-major) and uint16 (joints; indices, uint32 past
  65535 vertices), one buffer view per accessor, 4-byte aligned. POSITION (and the animation
  inputs) carry min/max as the spec requires; they are checked against the data.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pygltflib

from ik_gat_jax import padding
from ik_gat_jax import rotations
from ik_gat_jax import skeleton
from ik_gat_jax.errors import InputError, check_frame_rate
from ik_gat_jax.io import atomic
from ik_gat_jax.io import retarget
from ik_gat_jax.skeleton import Rig

GLTF_UP = (0.0, 1.0, 0.0)
GLTF_FORWARD = (0.0, 0.0, 1.0)
ANIMATION_NAME = 'ik_gat'

_MIN_BONE_M = 1e-3      # shorter child bones (co-located joints) get no box
_WIDTH_FRACTION = 0.25  # box width / bone length
_DEPTH_FRACTION = 0.6   # box depth / box width (not square: a twist by any angle shows)
_MAX_WIDTH_M = 0.08
_MIN_WIDTH_M = 0.005
_LEAF_MIN_M = 0.05
_COLOURS = {0: (0.7, 0.7, 0.7), 1: (0.25, 0.45, 0.85), -1: (0.85, 0.3, 0.25)}

_FLOAT, _USHORT, _UINT = (pygltflib.FLOAT, pygltflib.UNSIGNED_SHORT, pygltflib.UNSIGNED_INT)
_NP_TYPES = {_FLOAT: '<f4', _USHORT: '<u2', _UINT: '<u4', pygltflib.UNSIGNED_BYTE: 'u1',
             pygltflib.SHORT: '<i2', pygltflib.BYTE: 'i1'}
_WIDTHS = {'SCALAR': 1, 'VEC2': 2, 'VEC3': 3, 'VEC4': 4, 'MAT4': 16}


# ----------------------------------------------------------------------------------------------
# Rotations and axes.


@jax.jit
def _quat(R: jax.Array) -> jax.Array:
  return rotations.quat_from_matrix(R)


def quaternions_xyzw(R: np.ndarray) -> np.ndarray:
  """`[T, J, 3, 3]` -> glTF unit quaternions `(x, y, z, w)` `[T, J, 4]` (float64), each joint's
  sign chosen continuous over time (LINEAR interpolation then takes the short way)."""
  R = np.asarray(R, np.float64)
  flat = R.reshape(-1, 3, 3)
  padded = padding.pad_rows(flat, padding.power_of_two(len(flat), 64), fill=np.eye(3))
  with jax.enable_x64(True):
    q = np.asarray(_quat(jnp.asarray(padded, jnp.float64)))[:len(flat)]
  q = q.reshape(R.shape[:-2] + (4,))
  if q.ndim == 3 and len(q) > 1:  # flip where a key is on the far side of the previous one
    flips = np.sum(q[1:] * q[:-1], axis=-1) < 0
    sign = np.concatenate([np.ones((1,) + flips.shape[1:]),
                           np.cumprod(np.where(flips, -1.0, 1.0), axis=0)])
    q = q * sign[..., None]
  return np.concatenate([q[..., 1:], q[..., :1]], axis=-1)


def rig_to_gltf(rig: Rig) -> np.ndarray:
  """W `[3, 3]`: the rig's world axes -> glTF's (up -> +y, forward -> +z, up x forward -> +x)."""
  return retarget.world_rotation(rig.up, rig.forward, GLTF_UP, GLTF_FORWARD)


def needs_axes_node(rig: Rig) -> bool:
  return not np.allclose(rig_to_gltf(rig), np.eye(3), atol=1e-9)


# ----------------------------------------------------------------------------------------------
# The box body.


def _box(start: np.ndarray, direction: np.ndarray, length: float, width: float,
         depth: float, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """24 vertices `[24, 3]`, normals `[24, 3]`, triangles `[12, 3]` (counter-clockwise seen
  from outside) of a box from `start` along unit `direction`, the width along the part of
  `ref` perpendicular to it."""
  d = direction / np.linalg.norm(direction)
  e1 = ref - (ref @ d) * d
  if np.linalg.norm(e1) < 1e-6:
    e1 = np.eye(3)[int(np.argmin(np.abs(d)))]
    e1 = e1 - (e1 @ d) * d
  e1 = e1 / np.linalg.norm(e1)
  frame = np.stack([d, e1, np.cross(d, e1)], axis=1)  # right-handed: winding is kept
  size = np.array([length, width, depth])
  verts, normals, tris = [], [], []
  for k in range(3):
    for s in (1.0, -1.0):
      n = np.zeros(3)
      n[k] = s
      u, v = np.eye(3)[(k + 1) % 3], np.eye(3)[(k + 2) % 3]
      if s < 0:
        u, v = v, u  # u x v = n
      base = len(verts)
      for a, b in ((-1, -1), (1, -1), (1, 1), (-1, 1)):
        c = 0.5 * (n + a * u + b * v) + np.array([0.5, 0.0, 0.0])  # x in [0, 1]: along the bone
        verts.append(start + frame @ (c * size))
        normals.append(frame @ n)
      tris += [(base, base + 1, base + 2), (base, base + 2, base + 3)]
  return np.asarray(verts), np.asarray(normals), np.asarray(tris)


def body_boxes(offsets: np.ndarray, rig: Rig) -> list[dict]:
  """The boxes of the body, in the rig's axes at the rest (bind) pose: dicts with `joint`
  (the joint it is skinned to), `vertices [24, 3]`, `normals [24, 3]`, `triangles [12, 3]`."""
  offsets = np.asarray(offsets, np.float64)
  rest = skeleton.rest_positions_np(offsets, rig.parents)
  F = rig.reference_rotations() if rig.has_reference_pose else None
  dirs = skeleton.rest_bone_directions_np(offsets, rig.parents, rig.designated_children, F)
  up, forward = np.asarray(rig.up, np.float64), np.asarray(rig.forward, np.float64)
  boxes = []

  def add(j, direction, length, width):
    d = direction / np.linalg.norm(direction)
    ref = forward if abs(float(d @ up)) > np.cos(np.pi / 4) else up
    v, n, t = _box(rest[j], d, length, width, _DEPTH_FRACTION * width, ref)
    boxes.append({'joint': j, 'vertices': v, 'normals': n, 'triangles': t})

  for j in range(rig.num_joints):
    for c in rig.children[j]:
      length = float(np.linalg.norm(offsets[c]))
      if length >= _MIN_BONE_M:
        add(j, offsets[c], length,
            float(np.clip(_WIDTH_FRACTION * length, _MIN_WIDTH_M, _MAX_WIDTH_M)))
    if not rig.children[j]:
      length = max(0.5 * float(np.linalg.norm(offsets[j])), _LEAF_MIN_M)
      add(j, dirs[j], length, float(np.clip(0.5 * length, _MIN_WIDTH_M, _MAX_WIDTH_M)))
  return boxes


def _sides(offsets: np.ndarray, rig: Rig) -> np.ndarray:
  """Per joint +1 / -1 / 0: on the rig's +lateral side, the other, or the middle (rest pose)."""
  rest = skeleton.rest_positions_np(np.asarray(offsets, np.float64), rig.parents)
  side = (rest - rest[0]) @ np.asarray(rig.lateral)
  return np.where(side > 0.02, 1, np.where(side < -0.02, -1, 0))


# ----------------------------------------------------------------------------------------------
# The file.


class _Blob:
  """The binary chunk: each array a 4-byte aligned buffer view with one accessor."""

  def __init__(self, gltf: pygltflib.GLTF2):
    self.gltf, self.data = gltf, bytearray()

  def add(self, array: np.ndarray, component: int, kind: str, target: int | None = None,
          min_max: bool = False) -> int:
    a = np.ascontiguousarray(array, dtype=_NP_TYPES[component])
    raw = a.tobytes()
    self.data += b'\0' * (-len(self.data) % 4)
    self.gltf.bufferViews.append(pygltflib.BufferView(buffer=0, byteOffset=len(self.data),
                                                      byteLength=len(raw), target=target))
    self.data += raw
    flat = a.reshape(len(a), -1)
    acc = pygltflib.Accessor(bufferView=len(self.gltf.bufferViews) - 1, byteOffset=0,
                             componentType=component, count=len(a), type=kind)
    if min_max:
      acc.min = [float(x) for x in flat.min(axis=0)]
      acc.max = [float(x) for x in flat.max(axis=0)]
    self.gltf.accessors.append(acc)
    return len(self.gltf.accessors) - 1


def _mat4_column_major(M: np.ndarray) -> np.ndarray:
  """`[..., 4, 4]` -> `[..., 16]` in glTF's column-major order."""
  return np.swapaxes(M, -1, -2).reshape(M.shape[:-2] + (16,))


def solution_glb(sol, rig: Rig, fps: float, names: Sequence[str] | None = None) -> bytes:
  """A `solver.Solution` on `rig` at `fps` as glTF 2.0 binary (module docstring). `names`
  renames the joint nodes (default: the rig's joint names)."""
  try:
    names = list(skeleton.check_joint_names(names, rig))
  except skeleton.RigError as e:
    raise InputError(str(e)) from None
  J = rig.num_joints
  fps = check_frame_rate(fps)
  local = np.asarray(sol.local_rot, np.float64)
  root = np.asarray(sol.positions_fk, np.float64)[:, 0]
  offsets = np.asarray(sol.offsets, np.float64)
  T = len(local)
  if not (np.isfinite(local).all() and np.isfinite(root).all() and np.isfinite(offsets).all()):
    raise InputError('the solution has non-finite rotations or root positions; a glTF '
                     'animation needs every frame (is the root joint missing?)')
  W = rig_to_gltf(rig)
  axes_node = needs_axes_node(rig)

  gltf = pygltflib.GLTF2(asset=pygltflib.Asset(generator=f'ik_gat_jax (pygltflib '
                                                         f'{pygltflib.__version__})'))
  gltf.asset.extras = {'rig': rig.name, 'fps': float(fps), 'frames': T,
                       'rig_up': list(rig.up), 'rig_forward': list(rig.forward)}
  blob = _Blob(gltf)
  for j in range(J):
    node = pygltflib.Node(name=names[j], translation=[float(x) for x in offsets[j]],
                          rotation=[0.0, 0.0, 0.0, 1.0], children=list(rig.children[j]))
    gltf.nodes.append(node)
  scene_roots = [0]
  if axes_node:
    qw = quaternions_xyzw(W[None, None])[0, 0]
    gltf.nodes.append(pygltflib.Node(name=f'{rig.name}_to_gltf', children=[0],
                                     rotation=[float(x) for x in qw]))
    scene_roots = [J]

  # The body: boxes in the bind pose (glTF world), skinned to their joints.
  boxes = body_boxes(offsets, rig)
  side = _sides(offsets, rig)
  verts = np.concatenate([b['vertices'] for b in boxes]) @ W.T
  normals = np.concatenate([b['normals'] for b in boxes]) @ W.T
  joint_of = np.concatenate([np.full(len(b['vertices']), b['joint']) for b in boxes])
  tris = np.concatenate([b['triangles'] + 24 * i for i, b in enumerate(boxes)])
  colours = np.asarray([_COLOURS[int(side[j])] for j in joint_of])
  joints4 = np.zeros((len(verts), 4), np.uint16)
  joints4[:, 0] = joint_of
  weights4 = np.zeros((len(verts), 4))
  weights4[:, 0] = 1.0
  index_type = _USHORT if len(verts) <= 65535 else _UINT
  attrs = pygltflib.Attributes(
      POSITION=blob.add(verts, _FLOAT, 'VEC3', pygltflib.ARRAY_BUFFER, min_max=True),
      NORMAL=blob.add(normals, _FLOAT, 'VEC3', pygltflib.ARRAY_BUFFER),
      COLOR_0=blob.add(colours, _FLOAT, 'VEC3', pygltflib.ARRAY_BUFFER),
      JOINTS_0=blob.add(joints4, _USHORT, 'VEC4', pygltflib.ARRAY_BUFFER),
      WEIGHTS_0=blob.add(weights4, _FLOAT, 'VEC4', pygltflib.ARRAY_BUFFER))
  indices = blob.add(tris.reshape(-1), index_type, 'SCALAR', pygltflib.ELEMENT_ARRAY_BUFFER)
  gltf.materials.append(pygltflib.Material(
      name='body', pbrMetallicRoughness=pygltflib.PbrMetallicRoughness(
          baseColorFactor=[1.0, 1.0, 1.0, 1.0], metallicFactor=0.0, roughnessFactor=0.8)))
  gltf.meshes.append(pygltflib.Mesh(name='body', primitives=[pygltflib.Primitive(
      attributes=attrs, indices=indices, material=0, mode=pygltflib.TRIANGLES)]))
  rest = skeleton.rest_positions_np(offsets, rig.parents)
  bind = np.broadcast_to(np.eye(4), (J, 4, 4)).copy()  # (W T(P_j))^-1 = [W^T, -P_j]
  bind[:, :3, :3] = W.T
  bind[:, :3, 3] = -rest
  gltf.skins.append(pygltflib.Skin(name='skeleton', joints=list(range(J)), skeleton=0,
                                   inverseBindMatrices=blob.add(_mat4_column_major(bind),
                                                                _FLOAT, 'MAT4')))
  gltf.nodes.append(pygltflib.Node(name='body', mesh=0, skin=0))
  scene_roots.append(len(gltf.nodes) - 1)

  # The animation: rotations of every joint, translation of the root, at t / fps.
  times = blob.add(np.arange(T, dtype=np.float64) / fps, _FLOAT, 'SCALAR', min_max=True)
  q = quaternions_xyzw(local)
  anim = pygltflib.Animation(name=ANIMATION_NAME)
  for j in range(J):
    out = blob.add(q[:, j], _FLOAT, 'VEC4')
    anim.samplers.append(pygltflib.AnimationSampler(input=times, output=out,
                                                    interpolation=pygltflib.ANIM_LINEAR))
    anim.channels.append(pygltflib.AnimationChannel(
        sampler=j, target=pygltflib.AnimationChannelTarget(node=j, path=pygltflib.ROTATION)))
  out = blob.add(root, _FLOAT, 'VEC3')
  anim.samplers.append(pygltflib.AnimationSampler(input=times, output=out,
                                                  interpolation=pygltflib.ANIM_LINEAR))
  anim.channels.append(pygltflib.AnimationChannel(
      sampler=J, target=pygltflib.AnimationChannelTarget(node=0, path=pygltflib.TRANSLATION)))
  gltf.animations.append(anim)

  gltf.scenes.append(pygltflib.Scene(name=rig.name, nodes=scene_roots))
  gltf.scene = 0
  gltf.buffers.append(pygltflib.Buffer(byteLength=len(blob.data)))
  gltf.set_binary_blob(bytes(blob.data))
  _check_position_bounds(gltf)
  return b''.join(gltf.save_to_bytes())


def accessor_array(gltf: pygltflib.GLTF2, index: int) -> np.ndarray:
  """Accessor `index` of a GLB read with pygltflib, `[count, width]` (`[count]` for SCALAR),
  as stored (float32, uint16, ...). Tightly packed buffer views only (as written here)."""
  acc = gltf.accessors[index]
  view = gltf.bufferViews[acc.bufferView]
  width = _WIDTHS[acc.type]
  dtype = np.dtype(_NP_TYPES[acc.componentType])
  start = (view.byteOffset or 0) + (acc.byteOffset or 0)
  data = gltf.binary_blob()[start:start + acc.count * width * dtype.itemsize]
  a = np.frombuffer(data, dtype).reshape(acc.count, width)
  return a[:, 0] if acc.type == 'SCALAR' else a


def _check_position_bounds(gltf: pygltflib.GLTF2) -> None:
  """POSITION accessors must carry min/max (glTF 2.0 3.6.2.4) equal to their data's."""
  for mesh in gltf.meshes:
    for prim in mesh.primitives:
      acc = gltf.accessors[prim.attributes.POSITION]
      data = accessor_array(gltf, prim.attributes.POSITION)
      if (acc.min is None or acc.max is None or not np.allclose(acc.min, data.min(0), atol=0)
          or not np.allclose(acc.max, data.max(0), atol=0)):
        raise RuntimeError('POSITION accessor min/max do not match its data')


def write_solution_glb(path: str | os.PathLike, sol, rig: Rig, fps: float,
                       overwrite: bool = True, names: Sequence[str] | None = None) -> None:
  """`solution_glb`, written atomically (`io.atomic`); an existing file is refused unless
  `overwrite`."""
  path = Path(path)
  if path.exists() and not overwrite:
    raise FileExistsError(f'{path} exists; pass --overwrite to replace it')
  data = solution_glb(sol, rig, fps, names)
  with atomic.atomic_path(path, '.glb') as tmp:
    tmp.write_bytes(data)
