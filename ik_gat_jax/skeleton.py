"""Rigs as data (DESIGN section 3): names, parents, designated children, reference axes, mirror map.

A `Rig` is a frozen, hashable dataclass of Python tuples, so it can be a static argument of
`jax.jit` and is never traced. Rest offsets belong to a *subject*; a rig carries only a template
rest pose (`template_offsets`, metres), from which the designated children and the per-joint
reference axes are chosen once, never per subject.

Choices written down (DESIGN leaves them open):
- "Within 45 degrees of up" is measured against the up *line*: a bone pointing down (legs) is as
  degenerate for an `up` reference as one pointing up, so the test is `|d . up| > cos 45deg`.
- The observability class of a joint: `determined` if it has two or more children at a
  different position whose rest offsets are not collinear (the positions then fix its whole
  rotation), `swing` if it has a designated child otherwise, `leaf` if it has none.
- Reference pose (DESIGN section 3, "Rig invariance"). A rig's zero pose (every local rotation
  identity) depends on how the rig binds its joints and may be a crumpled, non-natural pose. A
  rig therefore names its *reference pose*: `reference_pose[j]`, the world rotation `F_j` (a
  (w, x, y, z) quaternion) of joint j's frame in a natural, mirror-symmetric pose facing
  `forward` (a T-pose); empty means the zero pose is that pose (`cmu_body`, `smpl22`: every
  `F_j = I`). Everything that needs a natural pose reads the rest geometry *in the world at the
  reference pose* instead of the zero pose: the reference-axis choice, the rest bone frames
  (bone_frames.py), a leaf's inherited direction, swing-only IK's starting pose
  (iterative_ik.py), the mirror (input_pipeline.py) and the heading's hip pair. Re-rigging joint
  j by a fixed `A_j` (frame times `A_j`) maps `F_j -> F_j A_j` and offsets `o_j -> A_p^T o_j`,
  so every world quantity at the reference pose (`F_p o_j`) is unchanged: these all become
  rig-invariant (`B'_j = A_j^T B_j` exactly).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from pathlib import Path
from typing import Sequence

import numpy as np

Vec3 = tuple[float, float, float]
_COLOCATED_M = 1e-6  # offsets shorter than this (metres) are co-located with their parent
_COS45 = math.cos(math.radians(45.0))
RIG_DIR = Path(__file__).resolve().parent / 'rigs'


class RigError(ValueError):
  """A rig that is not a valid kinematic tree, with the reason."""


def _unit(v: Sequence[float]) -> np.ndarray:
  v = np.asarray(v, dtype=np.float64)
  n = np.linalg.norm(v)
  if n < 1e-12:
    raise RigError(f'zero-length axis {tuple(v)}')
  return v / n


def rest_positions_np(offsets: np.ndarray, parents: Sequence[int]) -> np.ndarray:
  """Rest-pose joint positions `[..., J, 3]` from offsets `[..., J, 3]` (root at its offset)."""
  offsets = np.asarray(offsets, dtype=np.float64)
  pos = np.zeros_like(offsets)
  for j, p in enumerate(parents):
    pos[..., j, :] = offsets[..., j, :] + (pos[..., p, :] if p >= 0 else 0.0)
  return pos


def children_of(parents: Sequence[int]) -> tuple[tuple[int, ...], ...]:
  return tuple(tuple(c for c, p in enumerate(parents) if p == j) for j in range(len(parents)))


def leaves_of(parents: Sequence[int]) -> tuple[int, ...]:
  """Joints without children, in joint order (the joints that may carry an end site)."""
  kids = children_of(parents)
  return tuple(j for j in range(len(parents)) if not kids[j])


def depth_first_order(parents: Sequence[int], root: int = 0) -> list[int]:
  """`root` and every joint below it, depth-first, children in index order (BVH file order)."""
  children = children_of(parents)
  order, stack = [], [root]
  while stack:
    j = stack.pop()
    order.append(j)
    stack.extend(reversed(children[j]))
  return order


def num_descendants(parents: Sequence[int]) -> tuple[int, ...]:
  counts = [0] * len(parents)
  for j in reversed(range(len(parents))):
    if parents[j] >= 0:
      counts[parents[j]] += counts[j] + 1
  return tuple(counts)


def choose_designated_children(parents: Sequence[int], offsets: np.ndarray) -> tuple[int, ...]:
  """Per joint, the child at a different position with the most descendants (ties: first).

  A child co-located with the joint (zero offset) is skipped: a direction through it is not the
  joint's own bone (DESIGN section 4). Returns -1 for joints without such a child.
  """
  offsets = np.asarray(offsets, dtype=np.float64)
  desc = num_descendants(parents)
  out = []
  for kids in children_of(parents):
    real = [c for c in kids if np.linalg.norm(offsets[c]) > _COLOCATED_M]
    out.append(max(real, key=lambda c: (desc[c], -c)) if real else -1)
  return tuple(out)


# A side letter standing alone between separators: 'thigh_l', 'thigh.L' (Blender), 'l_hip',
# 'Bip01 L Thigh' (3ds Max Biped), 'upperarm-r'.
_SIDE_LETTER = re.compile(r'(?:(?<=^)|(?<=[_.\- :]))([LRlr])(?=$|[_.\- :])')
_OTHER_SIDE = {'L': 'R', 'R': 'L', 'l': 'r', 'r': 'l'}


def mirror_map_from_names(names: Sequence[str]) -> tuple[int, ...]:
  """Pairs joints whose names differ by Left/Right (any case), a side letter between
  separators (`thigh_l`, `thigh.L`, `l_hip`, `Bip01 L Thigh`), an L/R prefix (LHipJoint) or an
  l/r one before a capital (lThigh)."""
  index = {n: i for i, n in enumerate(names)}

  def partner(n: str) -> int:
    for a, b in (('Left', 'Right'), ('Right', 'Left'), ('left', 'right'), ('right', 'left'),
                 ('LEFT', 'RIGHT'), ('RIGHT', 'LEFT')):
      if a in n and n.replace(a, b, 1) in index:
        return index[n.replace(a, b, 1)]
    for m in _SIDE_LETTER.finditer(n):
      other = n[:m.start()] + _OTHER_SIDE[m.group(1)] + n[m.end():]
      if other in index:
        return index[other]
    for a, b in (('L', 'R'), ('R', 'L')):
      if n.startswith(a) and b + n[1:] in index:
        return index[b + n[1:]]
    if n[:1] in ('l', 'r') and n[1:2].isupper():  # DAZ / Poser: lThigh, rShldr
      other = {'l': 'r', 'r': 'l'}[n[0]] + n[1:]
      if other in index:
        return index[other]
    return index[n]

  return tuple(partner(n) for n in names)


@dataclasses.dataclass(frozen=True)
class Rig:
  """A static kinematic tree. All fields are tuples; `Rig` is hashable and jit-static.

  Attributes:
    name: rig name, e.g. 'cmu_body'.
    joint_names: `[J]` names, topologically ordered, root first.
    parents: `[J]` parent index per joint, -1 for the root.
    designated_children: `[J]` child index whose direction defines the bone, -1 for leaves.
    reference_axes: `[J]` 'up' or 'forward': the axis that fixes each bone frame's y.
    up, forward: unit world axes of the rig (e.g. +y and +z for CMU).
    mirror: `[J]` left/right partner of each joint (an involution; self for centre joints).
    template_offsets: `[J][3]` template rest offsets in metres (mean over subjects), or ().
    reference_pose: `[J][4]` world rotation (w, x, y, z) of every joint's frame in the rig's
      natural reference pose, or () when that is the zero pose (module docstring). Left out of
      `to_json` (and so of the fingerprint) when empty.
  """
  name: str
  joint_names: tuple[str, ...]
  parents: tuple[int, ...]
  designated_children: tuple[int, ...]
  reference_axes: tuple[str, ...]
  up: Vec3
  forward: Vec3
  mirror: tuple[int, ...]
  template_offsets: tuple[Vec3, ...] = ()
  reference_pose: tuple[tuple[float, float, float, float], ...] = ()

  def __post_init__(self):
    validate_rig(self)

  @property
  def num_joints(self) -> int:
    return len(self.parents)

  @property
  def children(self) -> tuple[tuple[int, ...], ...]:
    return children_of(self.parents)

  @property
  def leaves(self) -> tuple[int, ...]:
    """Joints without children, in joint order: the end-site joints (data.py, model.py)."""
    return leaves_of(self.parents)

  @property
  def lateral(self) -> Vec3:
    """cross(up, forward): the axis that mirroring negates."""
    return tuple(float(x) for x in np.cross(self.up, self.forward))

  def index(self, name: str) -> int:
    try:
      return self.joint_names.index(name)
    except ValueError:
      raise KeyError(f'rig {self.name!r} has no joint {name!r}; joints: '
                     f'{", ".join(self.joint_names)}') from None

  def template(self) -> np.ndarray:
    if not self.template_offsets:
      raise RigError(f'rig {self.name!r} has no template rest offsets')
    return np.asarray(self.template_offsets, dtype=np.float64)

  def reference_vectors(self) -> np.ndarray:
    """`[J, 3]` world reference axis per joint."""
    ax = {'up': np.asarray(self.up), 'forward': np.asarray(self.forward)}
    return np.stack([ax[a] for a in self.reference_axes])

  @property
  def has_reference_pose(self) -> bool:
    """True when the rig names a reference pose other than its zero pose."""
    return bool(self.reference_pose)

  def reference_rotations(self) -> np.ndarray:
    """`[J, 3, 3]` float64 world rotations `F_j` of the reference pose (identity if none)."""
    if not self.reference_pose:
      return np.broadcast_to(np.eye(3), (self.num_joints, 3, 3)).copy()
    return matrix_from_quat_np(np.asarray(self.reference_pose, np.float64))

  def reference_local(self) -> np.ndarray:
    """`[J, 3, 3]` local rotations of the reference pose: `F_parent^T F_j` (root: `F_root`)."""
    F = self.reference_rotations()
    return np.stack([F[j] if p < 0 else F[p].T @ F[j] for j, p in enumerate(self.parents)])

  def reference_offsets(self, offsets: np.ndarray | None = None) -> np.ndarray:
    """Rest offsets `[..., J, 3]` (default: the template) as world vectors in the reference
    pose: `F_parent(j) o_j` (the root's offset, its rest position, as it is)."""
    off = self.template() if offsets is None else np.asarray(offsets, np.float64)
    if not self.reference_pose:
      return off
    F = self.reference_rotations()
    Fp = np.stack([np.eye(3) if p < 0 else F[p] for p in self.parents])
    return np.einsum('jab,...jb->...ja', Fp, off)

  def reference_positions(self, offsets: np.ndarray | None = None) -> np.ndarray:
    """Joint positions `[..., J, 3]` of the reference pose (default: the template's)."""
    return rest_positions_np(self.reference_offsets(offsets), self.parents)

  def mirror_asymmetry(self, offsets: np.ndarray | None = None) -> tuple[float, str]:
    """`(degrees, joint)`: the largest angle between a bone of the reference pose (world offset
    `w_j`, joints not co-located with their parent) and its mirror partner's reflected
    (`M w_m(j)`, M the reflection of `lateral`); ~0 for a mirror-symmetric natural pose, large
    for a crumpled zero pose. The check behind mirror augmentation (input_pipeline.py)."""
    w = self.reference_offsets(offsets)
    lat = np.asarray(self.lateral)
    M = np.eye(3) - 2.0 * np.outer(lat, lat)
    worst, name = 0.0, ''
    for j, m in enumerate(self.mirror):
      if self.parents[j] < 0 or np.linalg.norm(w[j]) <= _COLOCATED_M:
        continue
      a, b = w[j] / np.linalg.norm(w[j]), M @ w[m] / max(np.linalg.norm(w[m]), 1e-12)
      angle = math.degrees(math.atan2(np.linalg.norm(np.cross(a, b)), float(a @ b)))
      if angle > worst:
        worst, name = angle, self.joint_names[j]
    return worst, name

  def observability(self, offsets: np.ndarray | None = None) -> tuple[str, ...]:
    """Per joint 'determined', 'swing' or 'leaf' (module docstring)."""
    off = self.template() if offsets is None else np.asarray(offsets, np.float64)
    out = []
    for j, kids in enumerate(self.children):
      dirs = [off[c] / np.linalg.norm(off[c]) for c in kids
              if np.linalg.norm(off[c]) > _COLOCATED_M]
      spread = any(np.linalg.norm(np.cross(a, b)) > 0.1 for a in dirs for b in dirs)
      out.append('determined' if spread else
                 'swing' if self.designated_children[j] >= 0 else 'leaf')
    return tuple(out)

  def colocated(self, offsets: np.ndarray | None = None) -> tuple[bool, ...]:
    """Per joint: True where the joint sits at its parent's position (zero offset)."""
    off = self.template() if offsets is None else np.asarray(offsets, np.float64)
    return tuple(bool(p >= 0 and np.linalg.norm(off[j]) <= _COLOCATED_M)
                 for j, p in enumerate(self.parents))

  def adjacency(self, kind: str = 'tree') -> tuple[tuple[bool, ...], ...]:
    """Static `[J, J]` mask, `adj[i][k]`: node i receives from node k (self loops included).

    kind: 'tree' (parent<->child), 'parent_to_child' (i receives from its parent),
    'child_to_parent' (i receives from its children), or 'full'.
    """
    J = self.num_joints
    if kind not in ('tree', 'parent_to_child', 'child_to_parent', 'full'):
      raise ValueError(f'unknown adjacency {kind!r}')
    adj = np.eye(J, dtype=bool) | (kind == 'full')
    for c, p in enumerate(self.parents):
      if p < 0:
        continue
      if kind in ('tree', 'parent_to_child'):
        adj[c, p] = True
      if kind in ('tree', 'child_to_parent'):
        adj[p, c] = True
    return tuple(tuple(bool(x) for x in row) for row in adj)

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    if not d['reference_pose']:
      del d['reference_pose']  # rigs without one keep the JSON (and fingerprint) they had
    return d

  @classmethod
  def from_json(cls, d: dict) -> 'Rig':
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - fields
    if unknown:
      raise RigError(f'unknown rig fields {sorted(unknown)}')
    kw = {k: (tuple(tuple(x) if isinstance(x, list) else x for x in v)
              if isinstance(v, list) else v) for k, v in d.items()}
    return cls(**kw)

  def fingerprint(self) -> str:
    """sha256 of the canonical JSON (for provenance)."""
    blob = json.dumps(self.to_json(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# Median angle between a subject's rest bones and the rig template's above which its rest pose
# is another one than the model's (CMU's 7 subjects: medians 0.5-1.3 deg, at most 13 deg for
# any bone; a rig under random binds: 88 deg; BENCHMARKS.md "Another rest pose").
REST_POSE_WARN_DEG = 20.0
# ... or one bone this far (CMU's T-pose first frames named as the natural pose: 21 deg at most;
# a walking frame: 90).
REST_BONE_WARN_DEG = 60.0


def rest_pose_angles(offsets: np.ndarray, rig: Rig) -> np.ndarray:
  """`[J]` per joint, the angle (degrees) between the subject's rest offset of its bone and the
  rig template's, as world vectors in the rig's natural pose (each in its parent's frame where
  that is the zero pose); NaN for the root and where either offset is zero; empty without a
  template."""
  try:
    template = rig.reference_offsets()
  except RigError:
    return np.zeros(0)
  a, b = rig.reference_offsets(offsets), template
  na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
  ok = (na > 1e-9) & (nb > 1e-9) & (np.asarray(rig.parents) >= 0)
  cos = np.einsum('ja,ja->j', a, b) / np.where(ok, na * nb, 1.0)
  return np.where(ok, np.degrees(np.arccos(np.clip(cos, -1.0, 1.0))), np.nan)


def validate_rig(rig: Rig) -> None:
  """Raises `RigError` naming the first problem found."""
  J = len(rig.parents)
  if J == 0:
    raise RigError('a rig needs at least one joint')
  for field in ('joint_names', 'designated_children', 'reference_axes', 'mirror'):
    if len(getattr(rig, field)) != J:
      raise RigError(f'{field} has {len(getattr(rig, field))} entries, parents has {J}')
  if len(set(rig.joint_names)) != J:
    raise RigError(f'duplicate joint names in {rig.joint_names}')
  if rig.parents[0] != -1:
    raise RigError(f'joint 0 ({rig.joint_names[0]}) must be the root (parent -1)')
  for j, p in enumerate(rig.parents[1:], start=1):
    if p == -1:
      raise RigError(f'second root {rig.joint_names[j]!r}: a rig has exactly one root')
    if p == j:
      raise RigError(f'joint {rig.joint_names[j]!r} is its own parent (a cycle)')
    if not 0 <= p < J:
      raise RigError(f'joint {rig.joint_names[j]!r} has parent index {p} outside [0, {J})')
    if p > j:
      raise RigError(f'joint {rig.joint_names[j]!r} (index {j}) has parent {p} after it: '
                     'parents must be topologically ordered (or the tree has a cycle)')
  for j, m in enumerate(rig.mirror):
    if not 0 <= m < J or rig.mirror[m] != j:
      raise RigError(f'mirror map is not an involution at joint {rig.joint_names[j]!r}')
  for a in rig.reference_axes:
    if a not in ('up', 'forward'):
      raise RigError(f'reference axis must be "up" or "forward", got {a!r}')
  if rig.reference_pose:
    q = np.asarray(rig.reference_pose, np.float64)
    if q.shape != (J, 4) or not np.isfinite(q).all():
      raise RigError(f'reference_pose has shape {q.shape}, expected ({J}, 4) finite quaternions')
    bad = np.abs(np.linalg.norm(q, axis=-1) - 1.0) > 1e-6
    if bad.any():
      raise RigError(f'reference_pose of {rig.joint_names[int(np.argmax(bad))]!r} is not a unit '
                     'quaternion')
  up, fw = _unit(rig.up), _unit(rig.forward)
  if abs(float(up @ fw)) > 1e-6:
    raise RigError(f'up {rig.up} and forward {rig.forward} must be perpendicular')
  off = np.asarray(rig.template_offsets, np.float64) if rig.template_offsets else None
  if off is not None and off.shape != (J, 3):
    raise RigError(f'template_offsets has shape {off.shape}, expected ({J}, 3)')
  for j, c in enumerate(rig.designated_children):
    if c == -1:
      continue
    if not 0 <= c < J or rig.parents[c] != j:
      raise RigError(f'designated child of {rig.joint_names[j]!r} is '
                     f'{c if not 0 <= c < J else repr(rig.joint_names[c])}, not one of its children')
    if off is not None and np.linalg.norm(off[c]) <= _COLOCATED_M:
      raise RigError(f'designated child {rig.joint_names[c]!r} of {rig.joint_names[j]!r} is '
                     'co-located with it: a bone needs a child at a different position')


def choose_reference_axes(offsets: np.ndarray, parents: Sequence[int],
                          designated_children: Sequence[int], up: Vec3,
                          forward: Vec3, reference: np.ndarray | None = None
                          ) -> tuple[str, ...]:
  """'forward' where a template bone is within 45 degrees of the up line, else 'up'.

  The bones are taken in the world at the reference pose (`reference`: `[J, 3, 3]` world
  rotations F, None for the zero pose): `F_j d_j`.
  """
  d = rest_bone_directions_np(offsets, parents, designated_children, reference)
  if reference is not None:
    d = np.einsum('jab,...jb->...ja', np.asarray(reference, np.float64), d)
  cos_up = np.abs(d @ _unit(up))
  return tuple('forward' if c > _COS45 else 'up' for c in cos_up)


def rest_direction_joints(parents: Sequence[int],
                          designated_children: Sequence[int]) -> tuple[int, ...]:
  """Per joint, the joint whose rest offset points along its rest bone: its designated child
  (at rest every frame is the world frame, so the direction to the child is the child's
  offset); a leaf inherits its parent's; -1 for a root without a child (direction +x). The one
  rule behind `rest_bone_directions_np` and `bone_frames.rest_bone_directions`."""
  out: list[int] = []
  for j, c in enumerate(designated_children):
    out.append(c if c >= 0 else (out[parents[j]] if parents[j] >= 0 else -1))
  return tuple(out)


def rest_bone_directions_np(offsets: np.ndarray, parents: Sequence[int],
                            designated_children: Sequence[int],
                            reference: np.ndarray | None = None) -> np.ndarray:
  """`[..., J, 3]` unit rest bone directions (float64), each in its joint's own frame, by
  `rest_direction_joints`. A direction taken from another joint's child (a leaf's, from its
  parent's bone) is carried through the reference pose (`reference`: `[J, 3, 3]` world
  rotations F; None: the zero pose, every F = I): `d_j = F_j^T F_owner o_s / |o_s|`, the same
  world direction in j's frame, so it does not depend on the rig's bind."""
  offsets = np.asarray(offsets, dtype=np.float64)
  source = rest_direction_joints(parents, designated_children)
  d = np.zeros_like(offsets)
  d[..., 0] = 1.0  # +x where no joint gives a direction
  has = [j for j, s in enumerate(source) if s >= 0]
  o = offsets[..., [source[j] for j in has], :]
  d[..., has, :] = o / np.linalg.norm(o, axis=-1, keepdims=True)
  if reference is not None:
    for j, K in inherited_direction_rotations(parents, designated_children, reference).items():
      d[..., j, :] = d[..., j, :] @ K.T
  return d


def inherited_direction_rotations(parents: Sequence[int], designated_children: Sequence[int],
                                  reference: np.ndarray) -> dict[int, np.ndarray]:
  """Joint -> `F_j^T F_owner` `[3, 3]` for every joint whose rest direction comes from an offset
  in another joint's frame (`owner` = the parent of its `rest_direction_joints` source)."""
  F = np.asarray(reference, np.float64)
  out = {}
  for j, s in enumerate(rest_direction_joints(parents, designated_children)):
    if s >= 0 and parents[s] != j:
      out[j] = F[j].T @ F[parents[s]]
  return out


def matrix_from_quat_np(q: np.ndarray) -> np.ndarray:
  """(w, x, y, z) quaternions `[..., 4]` (normalised here) -> rotation matrices `[..., 3, 3]`."""
  q = np.asarray(q, np.float64)
  w, x, y, z = np.moveaxis(q / np.linalg.norm(q, axis=-1, keepdims=True), -1, 0)
  return np.stack([
      np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)], -1),
      np.stack([2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)], -1),
      np.stack([2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1)], -2)


def quat_from_matrix_np(R: np.ndarray) -> np.ndarray:
  """Rotation matrices `[..., 3, 3]` -> (w, x, y, z) unit quaternions with w >= 0 (float64)."""
  R = np.asarray(R, np.float64)
  m = R.reshape(-1, 3, 3)
  out = np.empty((len(m), 4))
  for i, r in enumerate(m):  # Shepperd: the largest of w, x, y, z first (stable everywhere)
    t = np.array([np.trace(r), r[0, 0], r[1, 1], r[2, 2]])
    k = int(np.argmax(t))
    if k == 0:
      w = 0.5 * math.sqrt(max(1.0 + t[0], 0.0))
      q = [w, (r[2, 1] - r[1, 2]) / (4 * w), (r[0, 2] - r[2, 0]) / (4 * w),
           (r[1, 0] - r[0, 1]) / (4 * w)]
    else:
      a = k - 1
      b, c = (a + 1) % 3, (a + 2) % 3
      v = 0.5 * math.sqrt(max(1.0 + r[a, a] - r[b, b] - r[c, c], 0.0))
      q = [0.0] * 4
      q[0] = (r[c, b] - r[b, c]) / (4 * v)
      q[1 + a] = v
      q[1 + b] = (r[b, a] + r[a, b]) / (4 * v)
      q[1 + c] = (r[c, a] + r[a, c]) / (4 * v)
    q = np.asarray(q)
    out[i] = (q if q[0] >= 0 else -q) / np.linalg.norm(q)
  return out.reshape(R.shape[:-2] + (4,))


def make_rig(name: str, joint_names: Sequence[str], parents: Sequence[int],
             template_offsets: np.ndarray, up: Vec3, forward: Vec3,
             designated_children: Sequence[int] | None = None,
             mirror: Sequence[int] | None = None,
             reference_pose: np.ndarray | None = None) -> Rig:
  """Builds a rig, deriving designated children, reference axes and mirror map when not given.

  `reference_pose`: `[J, 3, 3]` world rotations of the rig's natural pose (module docstring),
  None when the zero pose is that pose; the reference axes are chosen at it.
  """
  off = np.asarray(template_offsets, dtype=np.float64)
  parents = tuple(int(p) for p in parents)
  dc = (tuple(int(c) for c in designated_children) if designated_children is not None
        else choose_designated_children(parents, off))
  F = None if reference_pose is None else np.asarray(reference_pose, np.float64)
  ref = choose_reference_axes(off, parents, dc, up, forward, F)
  mir = tuple(mirror) if mirror is not None else mirror_map_from_names(joint_names)
  quats = () if F is None else tuple(tuple(float(x) for x in q) for q in quat_from_matrix_np(F))
  return Rig(name=name, joint_names=tuple(joint_names), parents=parents,
             designated_children=dc, reference_axes=ref,
             up=tuple(float(x) for x in _unit(up)),
             forward=tuple(float(x) for x in _unit(forward)), mirror=mir,
             template_offsets=tuple(tuple(float(x) for x in row) for row in off),
             reference_pose=quats)


def check_joint_names(names, rig: Rig) -> tuple[str, ...]:
  """`names` (default the rig's joint names) as a file's joint names (a BVH's joints, a GLB's
  nodes), else a RigError: one per rig joint, each distinct (a tool binds animation to bones by
  name), non-empty, without whitespace at either end or a line break."""
  names = tuple(rig.joint_names if names is None else (str(n) for n in names))
  bad = [n for n in names if not n or n != n.strip() or '\n' in n or '\r' in n]
  twice = sorted({n for n in names if names.count(n) > 1})
  if len(names) != rig.num_joints or bad or twice:
    why = (f'got {len(names)}' if len(names) != rig.num_joints else
           f'{bad[0]!r} is empty or has whitespace at an end' if bad else
           f'{twice[0]!r} names {names.count(twice[0])} joints')
    raise RigError(f'joint names must be {rig.num_joints} distinct names, one per joint of rig '
                   f'{rig.name!r}: {why}')
  return names


REFERENCE_ROTATION_TOL = 1e-3  # |F^T F - I| of a reference frame: float32 engine matrices pass


def with_reference_pose(rig: Rig, reference: np.ndarray) -> Rig:
  """`rig` for a source whose joints carry other frames (another bind of the same skeleton):
  the same joints, designated children, reference axes and mirror map, the natural pose's
  world frames `reference [J, 3, 3]` (the rig's natural pose in the source's channels) and the
  template turned into those frames (`F_parent^T` of its world offsets in that pose). Bone
  frames then follow the binds exactly (bone_frames.py: `B'_j = A_j^T B_j`), so a model
  trained on `rig` gives the source's own rotations; the mirror and the refinement's chart
  follow them too."""
  F = np.asarray(reference, np.float64)
  if F.shape != (rig.num_joints, 3, 3) or not np.isfinite(F).all():
    raise RigError(f'a reference pose of rig {rig.name!r} is [{rig.num_joints}, 3, 3] finite '
                   f'rotations, got shape {F.shape}')
  off = np.abs(np.swapaxes(F, -1, -2) @ F - np.eye(3)).max(axis=(-2, -1))  # [J]
  bad = np.flatnonzero((off > REFERENCE_ROTATION_TOL) | (np.linalg.det(F) < 0))
  if bad.size:
    j = int(bad[0])
    what = ('a reflection' if np.linalg.det(F[j]) < 0 else
            f'scaled or sheared (|F^T F - I| {off[j]:.3g}; scales '
            f'{", ".join(f"{x:.3g}" for x in np.linalg.svd(F[j], compute_uv=False))})')
    raise RigError(f'a reference pose of rig {rig.name!r} is world rotations, and joint '
                   f'{rig.joint_names[j]}\'s frame is {what}' + (
                       f' ({bad.size} joints so)' if bad.size > 1 else '') +
                   ': take the rotation of each joint\'s world matrix, without its scale')
  changes = {'reference_pose': tuple(tuple(float(x) for x in q) for q in quat_from_matrix_np(F))}
  if rig.template_offsets:
    Fp = np.stack([np.eye(3) if p < 0 else F[p] for p in rig.parents])
    template = np.einsum('jba,jb->ja', Fp, rig.reference_offsets())
    changes['template_offsets'] = tuple(tuple(float(x) for x in row) for row in template)
  out = dataclasses.replace(rig, **changes)
  validate_rig(out)
  return out


# ----------------------------------------------------------------------------------------------
# Built-in rigs.

CMU_BODY_JOINTS = (
    'Hips', 'LowerBack', 'Spine', 'Spine1', 'Neck', 'Neck1', 'Head',
    'LeftArm', 'LeftForeArm', 'LeftHand', 'RightArm', 'RightForeArm', 'RightHand',
    'LeftUpLeg', 'LeftLeg', 'LeftFoot', 'LeftToeBase',
    'RightUpLeg', 'RightLeg', 'RightFoot', 'RightToeBase')
CMU_BODY_PARENTS = (-1, 0, 1, 2, 3, 4, 5, 3, 7, 8, 3, 10, 11, 0, 13, 14, 15, 0, 17, 18, 19)

SMPL22_JOINTS = (
    'pelvis', 'left_hip', 'right_hip', 'spine1', 'left_knee', 'right_knee', 'spine2',
    'left_ankle', 'right_ankle', 'spine3', 'left_foot', 'right_foot', 'neck', 'left_collar',
    'right_collar', 'head', 'left_shoulder', 'right_shoulder', 'left_elbow', 'right_elbow',
    'left_wrist', 'right_wrist')
SMPL22_PARENTS = (-1, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 12, 13, 14, 16, 17, 18, 19)
# An approximate SMPL neutral rest skeleton (metres, y up, facing +z, the body's left at +x),
# offsets from the parent. Only used to choose reference axes and as a default template; a user's
# own body model supplies the real rest joints per sequence (issue H).
_SMPL22_TEMPLATE = (
    (0.0, 0.93, 0.0), (0.07, -0.09, -0.01), (-0.07, -0.09, -0.01), (0.0, 0.11, -0.03),
    (0.04, -0.37, 0.0), (-0.04, -0.37, 0.0), (0.0, 0.13, 0.0), (-0.01, -0.40, -0.04),
    (0.01, -0.40, -0.04), (0.0, 0.06, 0.03), (0.04, -0.06, 0.12), (-0.04, -0.06, 0.12),
    (0.0, 0.21, -0.03), (0.08, 0.12, -0.02), (-0.08, 0.12, -0.02), (0.0, 0.09, 0.05),
    (0.12, 0.05, -0.01), (-0.12, 0.05, -0.01), (0.26, -0.01, -0.03), (-0.26, -0.01, -0.03),
    (0.25, 0.01, 0.0), (-0.25, 0.01, 0.0))


def smpl22() -> Rig:
  """The SMPL 22-joint body topology (AMASS)."""
  return make_rig('smpl22', SMPL22_JOINTS, SMPL22_PARENTS, np.asarray(_SMPL22_TEMPLATE),
                  up=(0.0, 1.0, 0.0), forward=(0.0, 0.0, 1.0))


def cmu_body() -> Rig:
  """The 21-joint body of ../shared/data/cmu; template = mean rest offsets of its 7 subjects.

  The template offsets live in `rigs/cmu_body.json` (generated by
  `python -m data_prep.make_template --rig=cmu_body`, a mean over the subjects' offsets).
  """
  path = RIG_DIR / 'cmu_body.json'
  return Rig.from_json(json.loads(path.read_text()))


BUILTIN_RIGS = {'cmu_body': cmu_body, 'smpl22': smpl22}


def get_rig(name: str) -> Rig:
  """A built-in rig by name, or a rig JSON file (as written by `Rig.to_json`)."""
  if name in BUILTIN_RIGS:
    return BUILTIN_RIGS[name]()
  p = Path(name)
  if p.suffix == '.json' and p.exists():
    return Rig.from_json(json.loads(p.read_text()))
  raise KeyError(f'unknown rig {name!r}: built-ins are {sorted(BUILTIN_RIGS)}, or give a rig '
                 'JSON file')
