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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
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


def mirror_map_from_names(names: Sequence[str]) -> tuple[int, ...]:
  """Pairs joints whose names differ by Left/Right, left/right, or an L/R prefix (LHipJoint)."""
  index = {n: i for i, n in enumerate(names)}

  def partner(n: str) -> int:
    for a, b in (('Left', 'Right'), ('Right', 'Left'), ('left', 'right'), ('right', 'left')):
      if a in n and n.replace(a, b, 1) in index:
        return index[n.replace(a, b, 1)]
    for a, b in (('L', 'R'), ('R', 'L')):
      if n.startswith(a) and b + n[1:] in index:
        return index[b + n[1:]]
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
    return dataclasses.asdict(self)

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
                          forward: Vec3) -> tuple[str, ...]:
  """'forward' where a template bone is within 45 degrees of the up line, else 'up'."""
  d = rest_bone_directions_np(offsets, parents, designated_children)
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
                            designated_children: Sequence[int]) -> np.ndarray:
  """`[..., J, 3]` unit rest bone directions (float64), by `rest_direction_joints`."""
  offsets = np.asarray(offsets, dtype=np.float64)
  source = rest_direction_joints(parents, designated_children)
  d = np.zeros_like(offsets)
  d[..., 0] = 1.0  # +x where no joint gives a direction
  has = [j for j, s in enumerate(source) if s >= 0]
  o = offsets[..., [source[j] for j in has], :]
  d[..., has, :] = o / np.linalg.norm(o, axis=-1, keepdims=True)
  return d


def make_rig(name: str, joint_names: Sequence[str], parents: Sequence[int],
             template_offsets: np.ndarray, up: Vec3, forward: Vec3,
             designated_children: Sequence[int] | None = None,
             mirror: Sequence[int] | None = None) -> Rig:
  """Builds a rig, deriving designated children, reference axes and mirror map when not given."""
  off = np.asarray(template_offsets, dtype=np.float64)
  parents = tuple(int(p) for p in parents)
  dc = (tuple(int(c) for c in designated_children) if designated_children is not None
        else choose_designated_children(parents, off))
  ref = choose_reference_axes(off, parents, dc, up, forward)
  mir = tuple(mirror) if mirror is not None else mirror_map_from_names(joint_names)
  return Rig(name=name, joint_names=tuple(joint_names), parents=parents,
             designated_children=dc, reference_axes=ref,
             up=tuple(float(x) for x in _unit(up)),
             forward=tuple(float(x) for x in _unit(forward)), mirror=mir,
             template_offsets=tuple(tuple(float(x) for x in row) for row in off))


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
