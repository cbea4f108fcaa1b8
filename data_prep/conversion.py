"""BVH mocap -> training shards: joint maps, rig reduction, verification, resampling, shards.

The library behind `python -m data_prep.bvh_to_shards` (DESIGN sections 3, 7 and 9); the AMASS
converter (data_prep/amass.py) shares its resampling, subjects, merging and shard writing.
Library code: no flags; progress goes to a `log` callable (stderr by default).

Choices written down (DESIGN leaves them open):
- Reduction. Every source joint is mapped to a rig joint, pruned (with its whole subtree), or
  removed. A removed joint between two mapped joints must rotate by at most 1e-3 degrees in every
  converted frame; its constant translation adds to the child's offset and its (near-identity)
  rotation is multiplied into the child's local rotation, so the child's world rotation stays
  exact. Joints above the rig's root (a dummy root, "Armature") fold into the root's world
  transform exactly, moving or not. Position channels of any other joint must be constant (within
  1e-6 m); their value replaces the OFFSET (BVH semantics) and becomes the rig offset.
- Axes. When the source's up/forward differ from the rig's, the world is re-labelled by the
  constant rotation W taking (up, forward, up x forward) of the source to the rig's: offsets
  `o' = W o`, every local rotation `R' = W R W^T`, root position `p' = W p`. Then `G' = W G W^T`
  and `p'_j = W p_j` for every joint, and the rest pose (all R = I) faces the rig's forward, so
  bone frames and reference axes stay meaningful. Derived rigs (`--rig=auto`, a joint map without
  a rig) are y-up, facing +z.
- Frame rates. A source rate within 0.01 % of an integer is that integer (BVH frame times are
  written rounded: CMU's 0.0083333 s is 120 fps). An integer ratio decimates (120 -> 30 keeps
  frames 0, 4, 8, ... counted from the first real frame, i.e. after the dropped T-pose);
  otherwise output frame k sits at source time k / fps: local rotations are slerped between the
  two neighbouring frames, the root position interpolated linearly, and positions and world
  rotations recomputed by FK. Both give `floor((T - 1) * fps / fps_in) + 1` frames.
- Verification. Before resampling, positions of the reduced rig by `kinematics.
  forward_kinematics` (float64) are compared with `bvh.naive_fk_np` over the raw channels, for
  every converted frame and rig joint (in the rig's world). Above 1e-5 m the file is refused.
  Slerped frames come from the same FK, so they are consistent with the verified rotations.
- `--rig=auto` keeps every source joint except pruned subtrees, motionless single-child roots
  (folded) and joints with children whose rotation is identity in every frame of every input
  file (removed); rig names are the source names, the template is the mean subject offsets, and
  designated children, reference axes and mirror map follow DESIGN section 4 and the names.
  The rig's rest pose is the file's zero pose (all channels 0, OFFSETs as written): a file whose
  joints carry bind rotations (game-engine exports) keeps them, so its local rotations are the
  bind-conjugated ones `C_parent^T R C_joint`, consistent with that rest pose; positions are
  the same either way.
- End sites (issue G2). Every rig leaf (a joint without rig children: CMU Head, hands, toes)
  gets the world position of one source `End Site`: its own, else the one in its pruned subtree
  farthest from it in the rest pose (CMU hands: the LeftHandIndex1 tip, not the thumb's; ties:
  the first in file order). It is computed per source frame by the full source FK, through the
  pruned joints, which rotate (CMU fingers have channels), and verified against
  `bvh.naive_fk_np` like the joints (limit 1e-5 m). For resampling it is held in the leaf's
  frame, `e_t = G_leaf^T (x_t - p_leaf)`: decimated frames are exact; slerped frames interpolate
  `e` linearly (exact where the pruned joints are rigid). A leaf without any End Site is NaN.
  Written as `<split>/end_sites.npy [T, E, 3]` with the leaf list in `end_sites.json`; adding to
  a directory written before end sites existed keeps its old frames NaN (absent).
- Subjects are keyed by name and rest offsets: a file whose offsets differ from its subject's
  earlier files by more than 1e-6 m becomes a subject variant 'NAME~1' (its own offsets row).
- Merging. A run into an existing shard directory appends: files already there with the same
  sha256 are skipped (logged), a file of the same name with a different sha256 is refused. The
  rig and the frame rate must match the directory's. The whole new directory is written beside
  the old one and swapped in with renames, so a failed run leaves the old output untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ik_gat_jax import bone_frames as bone_frames_lib
from ik_gat_jax import data as data_lib
from ik_gat_jax import kinematics
from ik_gat_jax import rotations
from ik_gat_jax import skeleton
from ik_gat_jax.io import bvh
from ik_gat_jax.provenance import file_sha256  # noqa: F401  (also used as conversion.file_sha256)

PACKAGE_DIR = Path(__file__).resolve().parent
JOINT_MAP_DIR = PACKAGE_DIR / 'joint_maps'
SPLIT_DIR = PACKAGE_DIR / 'splits'
SCHEMA_PATH = JOINT_MAP_DIR / 'schema.json'

IDENTITY_TOL_DEG = 1e-3  # a removed joint may rotate this much (DESIGN section 3)
STATIC_TOL_M = 1e-6  # position channels moving less than this are constant
FK_TOL_M = 1e-5  # verification threshold (DESIGN section 3)
SUBJECT_TOL_M = 1e-6  # offsets closer than this are the same subject's
FPS_SNAP_REL = 1e-4  # relative distance of a frame rate to an integer that snaps to it
SPLIT_NAMES = ('train', 'val', 'test', 'all')
UNITS = {'m': 1.0, 'cm': 0.01, 'mm': 0.001, 'in': 0.0254, 'inch': 0.0254, 'ft': 0.3048,
         'cmu': 0.056444}
Log = Callable[[str], None]


class ConversionError(ValueError):
  """Bad input or a refused file; `str(e)` is a one-line reason."""


def log_stderr(message: str) -> None:
  print(message, file=sys.stderr, flush=True)



# ----------------------------------------------------------------------------------------------
# A small JSON-schema validator (the keywords schema.json uses; no jsonschema dependency).

_TYPES = {'object': dict, 'array': list, 'string': str, 'boolean': bool, 'null': type(None)}


def _has_type(value, name: str) -> bool:
  if name in ('number', 'integer'):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and (name == 'number' or float(value).is_integer())
  return isinstance(value, _TYPES[name])


def validate_json(value, schema: dict, where: str = '$') -> None:
  """Raises ConversionError naming the first place where `value` breaks `schema`."""
  types = schema.get('type')
  if types is not None:
    types = [types] if isinstance(types, str) else types
    if not any(_has_type(value, t) for t in types):
      raise ConversionError(f'{where}: expected {" or ".join(types)}, got {value!r:.60}')
  if 'enum' in schema and value not in schema['enum']:
    raise ConversionError(f'{where}: {value!r} is not one of {schema["enum"]}')
  if isinstance(value, str):
    if len(value) < schema.get('minLength', 0):
      raise ConversionError(f'{where}: empty string')
    if 'pattern' in schema and not re.search(schema['pattern'], value):
      raise ConversionError(f'{where}: {value!r} does not match {schema["pattern"]}')
  if _has_type(value, 'number') and 'exclusiveMinimum' in schema:
    if not value > schema['exclusiveMinimum']:
      raise ConversionError(f'{where}: {value} must be > {schema["exclusiveMinimum"]}')
  if isinstance(value, list):
    if not schema.get('minItems', 0) <= len(value) <= schema.get('maxItems', math.inf):
      raise ConversionError(f'{where}: {len(value)} items, expected '
                            f'{schema.get("minItems", 0)}..{schema.get("maxItems", "any")}')
    for i, item in enumerate(value):
      validate_json(item, schema.get('items', {}), f'{where}[{i}]')
  if isinstance(value, dict):
    _validate_object(value, schema, where)


def _validate_object(value: dict, schema: dict, where: str) -> None:
  missing = [k for k in schema.get('required', ()) if k not in value]
  if missing:
    raise ConversionError(f'{where}: missing required {", ".join(missing)}')
  if len(value) < schema.get('minProperties', 0):
    raise ConversionError(f'{where}: needs at least {schema["minProperties"]} entries')
  props, extra = schema.get('properties', {}), schema.get('additionalProperties', True)
  for key, item in value.items():
    if key in props:
      validate_json(item, props[key], f'{where}.{key}')
    elif extra is False:
      raise ConversionError(f'{where}: unknown field {key!r} (known: {", ".join(props)})')
    elif isinstance(extra, dict):
      validate_json(item, extra, f'{where}.{key}')


# ----------------------------------------------------------------------------------------------
# Joint maps, axes and units.


@dataclasses.dataclass(frozen=True)
class JointMap:
  """A source description (schema.json). `joints` are (source, rig) name pairs."""
  joints: tuple[tuple[str, str], ...]
  units: float
  up: str
  forward: str
  rig: str | None = None
  prune: tuple[str, ...] = ()
  designated_children: tuple[tuple[str, str], ...] | None = None
  mirror_pairs: tuple[tuple[str, str], ...] | None = None
  drop_first_frame: bool = False
  subject_regex: str | None = None
  default_split: str | None = None
  name: str = 'auto'
  base_dir: Path = JOINT_MAP_DIR
  sha256: str | None = None

  def __post_init__(self):
    rig_names = [r for _, r in self.joints]
    dup = sorted({r for r in rig_names if rig_names.count(r) > 1})
    if dup:
      raise ConversionError(f'joint map {self.name}: several source joints map to {dup}')
    if self.subject_regex is not None:
      try:
        re.compile(self.subject_regex)
      except re.error as e:
        raise ConversionError(f'joint map {self.name}: bad subject_regex: {e}') from None
    world_rotation(self.up, self.forward, (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))  # checks the axes

  def with_overrides(self, **kw) -> 'JointMap':
    return dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})


def joint_map_from_json(doc: dict, name: str, base_dir: Path, sha256: str | None = None
                        ) -> JointMap:
  validate_json(doc, json.loads(SCHEMA_PATH.read_text()), name)
  pairs = lambda key: (tuple(tuple(p) for p in doc[key]) if key in doc else None)  # noqa: E731
  dc = doc.get('designated_children')
  return JointMap(
      joints=tuple(doc['joints'].items()), units=float(doc['units']), up=doc['up'],
      forward=doc['forward'], rig=doc.get('rig'), prune=tuple(doc.get('prune', ())),
      designated_children=tuple(dc.items()) if dc is not None else None,
      mirror_pairs=pairs('mirror_pairs'), drop_first_frame=doc.get('drop_first_frame', False),
      subject_regex=doc.get('subject_regex'), default_split=doc.get('default_split'),
      name=name, base_dir=base_dir, sha256=sha256)


def load_joint_map(spec: str) -> JointMap:
  """A joint map by name (data_prep/joint_maps/NAME.json) or by JSON path."""
  path = Path(spec)
  if not (spec.endswith('.json') or path.is_file()):
    path = JOINT_MAP_DIR / f'{spec}.json'
    if not path.is_file():
      known = sorted(p.stem for p in JOINT_MAP_DIR.glob('*.json') if p.stem != 'schema')
      raise ConversionError(f'no joint map for rig {spec!r} (known: {", ".join(known)}); pass a '
                            'joint-map JSON file or --rig=auto')
  if not path.is_file():
    raise ConversionError(f'joint map {spec} does not exist')
  text = path.read_text()
  try:
    doc = json.loads(text)
  except json.JSONDecodeError as e:
    raise ConversionError(f'{path}: not JSON: {e}') from None
  return joint_map_from_json(doc, str(path) if path.parent != JOINT_MAP_DIR else path.stem,
                             path.parent, hashlib.sha256(text.encode()).hexdigest())


def parse_axis(axis: str) -> np.ndarray:
  """'y', '+y', '-z' -> a unit vector."""
  m = re.fullmatch(r'([+-]?)([xyzXYZ])', axis.strip())
  if not m:
    raise ConversionError(f'axis must be one of x, y, z with an optional sign, got {axis!r}')
  v = np.zeros(3)
  v['xyz'.index(m.group(2).lower())] = -1.0 if m.group(1) == '-' else 1.0
  return v


def parse_units(units: str | float) -> float:
  """Metres per file unit: a number or one of UNITS ('cm', 'mm', 'cmu', ...)."""
  if isinstance(units, str) and units.strip().lower() in UNITS:
    return UNITS[units.strip().lower()]
  try:
    value = float(units)
  except ValueError:
    raise ConversionError(f'units must be metres per file unit (a number) or one of '
                          f'{", ".join(UNITS)}; got {units!r}') from None
  if not value > 0 or not math.isfinite(value):
    raise ConversionError(f'units must be positive, got {units!r}')
  return value


def world_rotation(src_up, src_forward, rig_up, rig_forward) -> np.ndarray:
  """The rotation W `[3, 3]` taking the source's (up, forward, up x forward) to the rig's."""
  def frame(up, forward):
    u = parse_axis(up) if isinstance(up, str) else np.asarray(up, np.float64)
    f = parse_axis(forward) if isinstance(forward, str) else np.asarray(forward, np.float64)
    if abs(float(u @ f)) > 1e-6:
      raise ConversionError(f'up {up} and forward {forward} must be perpendicular')
    return np.stack([u, f, np.cross(u, f)], axis=1)
  return frame(rig_up, rig_forward) @ frame(src_up, src_forward).T


# ----------------------------------------------------------------------------------------------
# Reduction plan: which source joints make which rig joint.


@dataclasses.dataclass(frozen=True)
class Reduction:
  """How a source hierarchy becomes the rig.

  Attributes:
    names: `[J]` rig joint names, rig order.
    parents: `[J]` rig parent indices.
    source: `[J]` source joint index of each rig joint.
    folded: `[J]` per rig joint, the source joints folded into it, top-down: for the root, its
      source ancestors; for other joints, the removed joints between it and its rig parent.
  """
  names: tuple[str, ...]
  parents: tuple[int, ...]
  source: tuple[int, ...]
  folded: tuple[tuple[int, ...], ...]


def _subtree(children, top: int) -> list[int]:
  out, stack = [], [top]
  while stack:
    j = stack.pop()
    out.append(j)
    stack.extend(children[j])
  return out


def plan_reduction(src_names: Sequence[str], src_parents: Sequence[int], jmap: JointMap,
                   rig_names: Sequence[str] | None = None,
                   rig_parents: Sequence[int] | None = None) -> Reduction:
  """Checks the joint map against a source hierarchy; rig order from `rig_names` or the source.

  Raises ConversionError for names the source lacks, joints neither mapped nor pruned, two
  roots, or a parent that differs from the rig's.
  """
  index = {n: i for i, n in enumerate(src_names)}
  to_rig = dict(jmap.joints)
  missing = [n for n in list(to_rig) + list(jmap.prune) if n not in index]
  if missing:
    raise ConversionError(f'joint map {jmap.name} names joints the BVH does not have: '
                          f'{", ".join(missing)}')
  children = skeleton.children_of(src_parents)
  pruned = {j for p in jmap.prune for j in _subtree(children, index[p])}
  mapped = [j for j, n in enumerate(src_names) if n in to_rig]
  both = [src_names[j] for j in mapped if j in pruned]
  if both:
    raise ConversionError(f'joint map {jmap.name} both maps and prunes {", ".join(both)}')
  mapped_below = [False] * len(src_names)
  for j in reversed(range(len(src_names))):
    mapped_below[j] = mapped_below[j] or src_names[j] in to_rig
    if src_parents[j] >= 0:
      mapped_below[src_parents[j]] |= mapped_below[j]
  loose = [src_names[j] for j in range(len(src_names))
           if j not in pruned and not mapped_below[j]]
  if loose:
    raise ConversionError(f'source joints {", ".join(loose)} are neither mapped to the rig nor '
                          'pruned: add them (or the top of their subtree) to prune')
  up, folded = {}, {}
  for j in mapped:
    chain, a = [], src_parents[j]
    while a >= 0 and src_names[a] not in to_rig:
      chain.append(a)
      a = src_parents[a]
    up[j], folded[j] = a, tuple(reversed(chain))
  roots = [src_names[j] for j in mapped if up[j] < 0]
  if len(roots) != 1:
    raise ConversionError(f'the mapped joints must form one tree; roots: {", ".join(roots)}')
  if rig_names is None:
    order = mapped
    rig_names = [to_rig[src_names[j]] for j in order]
  else:
    by_rig = {to_rig[src_names[j]]: j for j in mapped}
    absent = [n for n in rig_names if n not in by_rig]
    unknown = sorted(set(by_rig) - set(rig_names))
    if absent or unknown:
      raise ConversionError(f'joint map {jmap.name}: rig joints not mapped: {absent}; mapped '
                            f'names not in the rig: {unknown}')
    order = [by_rig[n] for n in rig_names]
  pos = {j: k for k, j in enumerate(order)}
  parents = tuple(pos[up[j]] if up[j] >= 0 else -1 for j in order)
  if rig_parents is not None and tuple(rig_parents) != parents:
    bad = next(k for k in range(len(parents)) if parents[k] != rig_parents[k])
    name = lambda k: rig_names[k] if k >= 0 else 'none'  # noqa: E731
    raise ConversionError(f'rig joint {rig_names[bad]}: its rig parent is '
                          f'{name(rig_parents[bad])} but in the source it is {name(parents[bad])}')
  if any(p >= k for k, p in enumerate(parents)):
    raise ConversionError('rig joints must be ordered parents first')
  return Reduction(names=tuple(rig_names), parents=parents, source=tuple(order),
                   folded=tuple(folded[j] for j in order))


# ----------------------------------------------------------------------------------------------
# One motion: source channels -> reduced rig -> verified -> resampled.


@dataclasses.dataclass
class ReducedMotion:
  """A motion on the rig, float64, rig world frame, metres.

  Attributes:
    local_rot: `[T, J, 3, 3]` parent-relative rotations (root: world rotation).
    root_pos: `[T, 3]` world root position.
    offsets: `[J, 3]` rest offsets (root: its rest position).
    end_local: `[T, E, 3]` end site of every rig leaf (`skeleton.leaves_of`) in the leaf's frame,
      metres (NaN: the leaf has none), or None (module docstring, "End sites").
  """
  local_rot: np.ndarray
  root_pos: np.ndarray
  offsets: np.ndarray
  end_local: np.ndarray | None = None


# The JAX computations below run jitted, in float64, over fixed-size chunks of frames (the last
# padded by repeating its final frame): one compilation per shape instead of one per file length.
_CHUNK = 512


def chunked(fn: Callable, frames: Sequence[np.ndarray], *rest) -> tuple[np.ndarray, ...]:
  """`fn(*frame_chunks, *rest)` over `_CHUNK`-frame slices of `frames` (leading axis T),
  concatenated along T; `fn` is a jitted function, outputs are numpy float64."""
  T = frames[0].shape[0]
  padded = [np.pad(a, [(0, -T % _CHUNK)] + [(0, 0)] * (a.ndim - 1), mode='edge')
            for a in frames]
  outs = []
  with jax.enable_x64(True):
    for start in range(0, max(T, 1), _CHUNK):
      out = fn(*(jnp.asarray(a[start:start + _CHUNK], jnp.float64) for a in padded), *rest)
      outs.append([np.asarray(o) for o in (out if isinstance(out, tuple) else (out,))])
  return tuple(np.concatenate(o)[:T] for o in zip(*outs))


@functools.partial(jax.jit, static_argnums=(1,))
def _euler_matrices(degrees: jax.Array, order: str) -> jax.Array:
  return rotations.matrix_from_euler(degrees, order, degrees=True)


@jax.jit
def _angles_from_identity(R: jax.Array) -> jax.Array:
  return jnp.degrees(rotations.geodesic_angle(jnp.broadcast_to(jnp.eye(3, dtype=R.dtype),
                                                               R.shape), R))


@functools.partial(jax.jit, static_argnums=(3,))
def _fk(local_rot: jax.Array, root_pos: jax.Array, offsets: jax.Array,
        parents: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  return kinematics.forward_kinematics(local_rot, offsets, parents, root_pos=root_pos)


@jax.jit
def _slerp_matrices(R0: jax.Array, R1: jax.Array, frac: jax.Array) -> jax.Array:
  q = rotations.quat_slerp(rotations.quat_from_matrix(R0), rotations.quat_from_matrix(R1),
                           frac[:, None])
  return rotations.matrix_from_quat(q)


def source_local_rotations(motion: bvh.BVHMotion) -> np.ndarray:
  """`[T, Js, 3, 3]` float64 local rotation of every source joint, by `rotations`."""
  T, Js = motion.num_frames, len(motion.joints)
  out = np.broadcast_to(np.eye(3), (T, Js, 3, 3)).copy()
  by_order: dict[str, list[int]] = {}
  for j in range(Js):
    if motion.euler_order(j):
      by_order.setdefault(motion.euler_order(j), []).append(j)
  for order, joints in by_order.items():
    angles = np.stack([motion.rotation_degrees(j) for j in joints], axis=1)  # [T, n, len(order)]
    out[:, joints] = chunked(_euler_matrices, [angles], order)[0]
  return out


def rotation_angles_deg(R: np.ndarray) -> np.ndarray:
  """`[T, ..., 3, 3]` -> rotation angle in degrees `[T, ...]` (geodesic distance from I)."""
  return chunked(_angles_from_identity, [R])[0]


def _translations(motion: bvh.BVHMotion) -> list[np.ndarray]:
  """Per source joint `[T, 3]` translation in file units (position channels replace OFFSET)."""
  T = motion.num_frames
  out = []
  for j, joint in enumerate(motion.joints):
    pc = motion.position_channels(j)
    out.append(pc if pc is not None else np.broadcast_to(joint.offset, (T, 3)))
  return out


def _check_removals(motion: bvh.BVHMotion, plan: Reduction, R: np.ndarray,
                    scale: float) -> None:
  """Refuses moving position channels below the rig root and rotating removed joints."""
  names = motion.names
  for k in range(1, len(plan.names)):
    for j in plan.folded[k] + (plan.source[k],):
      pc = motion.position_channels(j)
      if pc is not None and np.ptp(pc, axis=0).max() * scale > STATIC_TOL_M:
        raise ConversionError(f'joint {names[j]} has position channels that move (by up to '
                              f'{np.ptp(pc, axis=0).max() * scale:.3g} m); only the root may '
                              'translate')
    for j in plan.folded[k]:
      angle = rotation_angles_deg(R[:, j])
      if angle.max() > IDENTITY_TOL_DEG:
        raise ConversionError(
            f'joint {names[j]} is not in the rig but rotates (by {angle.max():.3g} degrees in '
            f'frame {int(angle.argmax())}); a joint is removed only if its rotation is identity '
            f'within {IDENTITY_TOL_DEG:g} degrees in every frame: map it to a rig joint')


def reduce_motion(motion: bvh.BVHMotion, plan: Reduction, scale: float,
                  W: np.ndarray) -> ReducedMotion:
  """Source channels -> rig motion (module docstring: reduction, axes). Refuses by raising."""
  T, J = motion.num_frames, len(plan.names)
  R = source_local_rotations(motion)
  t = _translations(motion)
  _check_removals(motion, plan, R, scale)
  local = np.empty((T, J, 3, 3))
  offsets = np.empty((J, 3))
  root_chain = plan.folded[0] + (plan.source[0],)
  G, p = np.broadcast_to(np.eye(3), (T, 3, 3)), np.zeros((T, 3))
  for j in root_chain:  # the root's world transform, through its source ancestors, exactly
    p = p + np.einsum('tab,tb->ta', G, t[j])
    G = G @ R[:, j]
  local[:, 0], root_pos = G, p
  offsets[0] = sum(motion.joints[j].offset for j in root_chain)  # rest position (unused by FK)
  for k in range(1, J):
    chain = plan.folded[k] + (plan.source[k],)
    rot = R[:, chain[0]]
    for j in chain[1:]:
      rot = rot @ R[:, j]
    local[:, k] = rot
    offsets[k] = sum(t[j][0] for j in chain)
  return ReducedMotion(local_rot=W @ local @ W.T, root_pos=scale * root_pos @ W.T,
                       offsets=scale * offsets @ W.T)


def forward_kinematics_np(reduced: ReducedMotion, parents: Sequence[int]
                          ) -> tuple[np.ndarray, np.ndarray]:
  """`kinematics.forward_kinematics` in float64: `(G [T, J, 3, 3], p [T, J, 3])`."""
  with jax.enable_x64(True):
    offsets = jnp.asarray(reduced.offsets, jnp.float64)
  return chunked(_fk, [reduced.local_rot, reduced.root_pos], offsets, tuple(parents))


def verify_fk(motion: bvh.BVHMotion, plan: Reduction, reduced: ReducedMotion, scale: float,
              W: np.ndarray) -> float:
  """Max distance (m) between our FK of the rig and the naive FK of the raw channels."""
  _, p = forward_kinematics_np(reduced, plan.parents)
  reference = bvh.naive_fk_np(motion, scale)[:, list(plan.source)] @ W.T
  return float(np.linalg.norm(p - reference, axis=-1).max()) if len(p) else 0.0


def end_site_sources(motion: bvh.BVHMotion, plan: Reduction
                     ) -> list[tuple[int, np.ndarray] | None]:
  """Per rig leaf (`skeleton.leaves_of(plan.parents)`): `(source joint, End Site offset in its
  frame, file units)` of the leaf's end site (module docstring, "End sites"), or None."""
  children = skeleton.children_of(motion.parents)
  out = []
  for k in skeleton.leaves_of(plan.parents):
    top = plan.source[k]
    rel = {top: np.zeros(3)}  # rest position relative to the leaf's source joint
    best, best_d = None, -1.0
    for j in sorted(_subtree(children, top)):  # parents before children in BVH file order
      if j != top:
        rel[j] = rel[motion.parents[j]] + motion.joints[j].offset
      e = motion.joints[j].end_site
      if e is not None and np.linalg.norm(rel[j] + e) > best_d + 1e-12:
        best, best_d = (j, np.asarray(e, np.float64)), float(np.linalg.norm(rel[j] + e))
    out.append(best)
  return out


def end_site_positions(motion: bvh.BVHMotion, sources: Sequence[tuple[int, np.ndarray] | None],
                       scale: float, W: np.ndarray, R: np.ndarray | None = None) -> np.ndarray:
  """`[T, E, 3]` world end sites (metres, rig world; NaN for None) by the full source FK.

  `R`: `source_local_rotations(motion)` if already computed.
  """
  R = source_local_rotations(motion) if R is None else R
  t = _translations(motion)
  T = motion.num_frames
  out = np.full((T, len(sources), 3), np.nan)
  for e, src in enumerate(sources):
    if src is None:
      continue
    chain, j = [], src[0]
    while j >= 0:
      chain.append(j)
      j = motion.parents[j]
    G, p = np.broadcast_to(np.eye(3), (T, 3, 3)), np.zeros((T, 3))
    for j in reversed(chain):
      p = p + np.einsum('tab,tb->ta', G, t[j])
      G = G @ R[:, j]
    out[:, e] = scale * (p + G @ src[1]) @ W.T
  return out


def verify_end_sites(motion: bvh.BVHMotion, sources, end_sites: np.ndarray, scale: float,
                     W: np.ndarray) -> float:
  """Max distance (m) between `end_sites [T, E, 3]` and the same End Sites by `naive_fk_np`."""
  pos, rot = bvh.naive_fk_np(motion, 1.0, with_rotations=True)
  err = 0.0
  for e, src in enumerate(sources):
    if src is not None:
      ref = scale * (pos[:, src[0]] + rot[:, src[0]] @ src[1]) @ W.T
      err = max(err, float(np.linalg.norm(end_sites[:, e] - ref, axis=-1).max()))
  return err


def source_fps(frame_time: float) -> float:
  """The file's frame rate, snapped to an integer within FPS_SNAP_REL (module docstring)."""
  fps = 1.0 / frame_time
  return float(round(fps)) if abs(fps - round(fps)) <= FPS_SNAP_REL * fps else fps


def resample(reduced: ReducedMotion, fps_in: float, fps_out: float) -> ReducedMotion:
  """Decimation for integer rate ratios, else slerp of local rotations (module docstring)."""
  T = reduced.local_rot.shape[0]
  ratio = fps_in / fps_out
  step = round(ratio)
  end = reduced.end_local
  if step >= 1 and abs(ratio - step) <= FPS_SNAP_REL * ratio:
    return dataclasses.replace(reduced, local_rot=reduced.local_rot[::step],
                               root_pos=reduced.root_pos[::step],
                               end_local=None if end is None else end[::step])
  n = int(math.floor((T - 1) / ratio + 1e-9)) + 1
  s = np.arange(n) * ratio
  i0 = np.minimum(np.floor(s).astype(int), T - 1)
  i1 = np.minimum(i0 + 1, T - 1)
  frac = s - i0
  local = chunked(_slerp_matrices, [reduced.local_rot[i0], reduced.local_rot[i1], frac])[0]
  root = (1 - frac)[:, None] * reduced.root_pos[i0] + frac[:, None] * reduced.root_pos[i1]
  if end is not None:
    end = (1 - frac)[:, None, None] * end[i0] + frac[:, None, None] * end[i1]
  return dataclasses.replace(reduced, local_rot=local, root_pos=root, end_local=end)


@dataclasses.dataclass
class Clip:
  """One converted file, at the output rate (float64 until written).

  Attributes:
    file: name relative to the input directory (the key of splits and the files table).
    path: where it was read from.
    subject: subject name (from the file name, module docstring of bvh_to_shards).
    sha256: of the file's bytes.
    names, parents: the rig joints the arrays follow.
    offsets: `[J, 3]` the file's rest offsets on the rig (metres).
    local_rot, global_rot: `[n, J, 3, 3]`; positions: `[n, J, 3]` (metres, rig world).
    source_frames: frames in the file (before dropping the first); source_fps: its rate.
    fk_max_error_m: the verification error over every converted source frame.
    extra: more fields for the file's row of files.json (JSON values; e.g. AMASS betas).
    end_sites: `[n, E, 3]` world end sites of the rig leaves (NaN: none), or None (no source).
  """
  file: str
  path: str
  subject: str
  sha256: str
  names: tuple[str, ...]
  parents: tuple[int, ...]
  offsets: np.ndarray
  local_rot: np.ndarray
  global_rot: np.ndarray
  positions: np.ndarray
  source_frames: int
  source_fps: float
  fk_max_error_m: float
  seconds: float = 0.0
  split: str = 'train'
  part: str | None = None
  subject_id: int = -1
  extra: dict = dataclasses.field(default_factory=dict)
  end_sites: np.ndarray | None = None

  @property
  def frames(self) -> int:
    return int(self.positions.shape[0])


def read_motion(path: str | os.PathLike, drop_first_frame: bool) -> tuple[bvh.BVHMotion, int]:
  """Parses a BVH file, dropping frame 0 if asked; returns (motion, frames in the file)."""
  try:
    motion = bvh.read_bvh(path)
  except bvh.BVHError as e:
    raise ConversionError(str(e)) from None
  total = motion.num_frames
  if drop_first_frame:
    motion = dataclasses.replace(motion, motion=motion.motion[1:])
  if motion.num_frames < 1:
    raise ConversionError(f'{path}: no frames to convert ({total} in the file'
                          f'{", the first dropped" if drop_first_frame else ""})')
  return motion, total


def _require_fk(error: float, what: str) -> None:
  """Conversion refuses a file whose reduced rig does not reproduce the raw channels' FK."""
  if not error <= FK_TOL_M:
    raise ConversionError(f'FK check failed: {what} differ from the raw channels by up to '
                          f'{error:.3g} m (limit {FK_TOL_M:g} m)')


def convert_motion(motion: bvh.BVHMotion, jmap: JointMap, W: np.ndarray, fps: float,
                   rig_names: Sequence[str] | None = None,
                   rig_parents: Sequence[int] | None = None
                   ) -> tuple[Reduction, ReducedMotion, np.ndarray, np.ndarray, float]:
  """Reduce, verify, resample, FK: `(plan, resampled, G, p, fk_max_error_m)`, float64.

  `resampled.end_local` holds the rig leaves' end sites when the source has any End Site (the
  error then covers them too); `end_sites_world(resampled, G, p, parents)` places them.
  """
  plan = plan_reduction(motion.names, motion.parents, jmap, rig_names, rig_parents)
  reduced = reduce_motion(motion, plan, jmap.units, W)
  error = verify_fk(motion, plan, reduced, jmap.units, W)
  _require_fk(error, 'reduced rig positions')
  sources = end_site_sources(motion, plan)
  if any(s is not None for s in sources):
    world = end_site_positions(motion, sources, jmap.units, W)
    es_error = verify_end_sites(motion, sources, world, jmap.units, W)
    _require_fk(es_error, 'end sites')
    error = max(error, es_error)
    leaves = list(skeleton.leaves_of(plan.parents))
    G0, p0 = forward_kinematics_np(reduced, plan.parents)
    end_local = np.einsum('tjba,tjb->tja', G0[:, leaves], world - p0[:, leaves])
    reduced = dataclasses.replace(reduced, end_local=end_local)
  out = resample(reduced, source_fps(motion.frame_time), fps)
  G, p = forward_kinematics_np(out, plan.parents)
  return plan, out, G, p, error


def end_sites_world(reduced: ReducedMotion, G: np.ndarray, p: np.ndarray,
                    parents: Sequence[int]) -> np.ndarray | None:
  """`[T, E, 3]` world end sites `p_leaf + G_leaf e` of a (resampled) motion, or None."""
  if reduced.end_local is None:
    return None
  leaves = list(skeleton.leaves_of(parents))
  return p[:, leaves] + np.einsum('tjab,tjb->tja', G[:, leaves], reduced.end_local)


def end_site_names(rig_names: Sequence[str], parents: Sequence[int]) -> list[str]:
  """Names of the end sites, one per rig leaf: '<leaf>_end' (end_sites.json)."""
  return [f'{rig_names[k]}_end' for k in skeleton.leaves_of(parents)]


def convert_file(file: str, path: str | os.PathLike, subject: str, jmap: JointMap,
                 W: np.ndarray, fps: float, rig_names: Sequence[str] | None = None,
                 rig_parents: Sequence[int] | None = None, sha256: str | None = None) -> Clip:
  """One BVH file -> a verified, resampled `Clip`. Raises ConversionError with the reason."""
  start = time.perf_counter()
  motion, total = read_motion(path, jmap.drop_first_frame)
  plan, out, G, p, error = convert_motion(motion, jmap, W, fps, rig_names, rig_parents)
  ends = end_sites_world(out, G, p, plan.parents)
  extra = {}
  if ends is not None:
    srcs = end_site_sources(motion, plan)
    extra['end_site_sources'] = {
        plan.names[k]: (None if s is None else
                        f'{motion.names[s[0]]} End Site')
        for k, s in zip(skeleton.leaves_of(plan.parents), srcs)}
  return Clip(file=file, path=str(path), subject=subject, sha256=sha256 or file_sha256(path),
              names=plan.names, parents=plan.parents, offsets=out.offsets,
              local_rot=out.local_rot, global_rot=G, positions=p, source_frames=total,
              source_fps=source_fps(motion.frame_time), fk_max_error_m=error,
              seconds=time.perf_counter() - start, extra=extra, end_sites=ends)


# ----------------------------------------------------------------------------------------------
# --rig=auto: a joint map derived from the files themselves.


def derive_joint_map(paths: Sequence[str | os.PathLike], units: float, up: str = '+y',
                     forward: str = '+z', prune: Sequence[str] = (),
                     drop_first_frame: bool = False, subject_regex: str | None = None
                     ) -> JointMap:
  """Keeps every joint except: pruned subtrees; motionless single-child roots (folded into the
  root below them); joints with children whose rotation is identity (within 1e-3 degrees) in
  every frame of every file (removed). End Sites are never joints. Rig names = source names.
  """
  first, max_angle, still = None, None, None
  for path in paths:
    motion, _ = read_motion(path, drop_first_frame)
    if first is None:
      first = (motion.names, motion.parents, path)
      max_angle = np.zeros(len(motion.names))
      still = np.ones(len(motion.names), bool)
    elif (motion.names, motion.parents) != first[:2]:
      raise ConversionError(f'{path}: joint hierarchy differs from {first[2]}; --rig=auto needs '
                            'one hierarchy (convert them separately or write a joint map)')
    angles = rotation_angles_deg(source_local_rotations(motion))
    max_angle = np.maximum(max_angle, angles.max(axis=0))
    for j, joint in enumerate(motion.joints):
      ptp = np.ptp(motion.motion[:, motion.channel_slice(j)], axis=0)
      is_pos = np.array([c.endswith('position') for c in joint.channels], bool)
      still[j] &= bool(np.all(np.where(is_pos, ptp * units <= STATIC_TOL_M,
                                       ptp <= IDENTITY_TOL_DEG)))
  if first is None:
    raise ConversionError('no BVH files to derive a rig from')
  names, parents, _ = first
  index = {n: i for i, n in enumerate(names)}
  unknown = [p for p in prune if p not in index]
  if unknown:
    raise ConversionError(f'--prune names joints the BVH does not have: {", ".join(unknown)}')
  children = skeleton.children_of(parents)
  pruned = {j for p in prune for j in _subtree(children, index[p])}
  root = 0
  while root not in pruned and still[root] and len(children[root]) == 1:
    root = children[root][0]
  if root in pruned:
    raise ConversionError('--prune removes every joint')
  keep = []
  for j in sorted(_subtree(children, root)):
    live = [c for c in children[j] if c not in pruned]
    if j in pruned or (j != root and live and max_angle[j] <= IDENTITY_TOL_DEG):
      continue
    keep.append(j)
  return JointMap(joints=tuple((names[j], names[j]) for j in keep), units=units, up=up,
                  forward=forward, rig=None, prune=tuple(prune),
                  drop_first_frame=drop_first_frame, subject_regex=subject_regex, name='auto')


def mirror_from_pairs(names: Sequence[str], pairs: Iterable[Sequence[str]]) -> tuple[int, ...]:
  index = {n: i for i, n in enumerate(names)}
  mirror = list(range(len(names)))
  for a, b in pairs:
    if a not in index or b not in index:
      raise ConversionError(f'mirror pair ({a}, {b}) names a joint the rig does not have')
    mirror[index[a]], mirror[index[b]] = index[b], index[a]
  return tuple(mirror)


def derive_rig(name: str, jmap: JointMap, names: Sequence[str], parents: Sequence[int],
               subject_offsets: Sequence[np.ndarray]) -> skeleton.Rig:
  """A y-up, +z-forward rig whose template is the mean of the subjects' rest offsets."""
  template = np.mean(np.stack(subject_offsets), axis=0)
  dc = list(skeleton.choose_designated_children(parents, template))
  for joint, child in jmap.designated_children or ():
    if joint not in names or child not in names:
      raise ConversionError(f'designated child {joint} -> {child} names a joint not in the rig')
    dc[names.index(joint)] = names.index(child)
  mirror = (mirror_from_pairs(names, jmap.mirror_pairs) if jmap.mirror_pairs is not None
            else None)
  try:
    return skeleton.make_rig(name, names, parents, template, up=(0.0, 1.0, 0.0),
                             forward=(0.0, 0.0, 1.0), designated_children=dc, mirror=mirror)
  except skeleton.RigError as e:
    raise ConversionError(f'cannot build rig {name!r}: {e}') from None


def resolve_rig(jmap: JointMap) -> skeleton.Rig | None:
  """The joint map's rig (built-in name or rig JSON path), checked against the map; None when
  the rig is to be derived."""
  if jmap.rig is None:
    return None
  try:
    if jmap.rig in skeleton.BUILTIN_RIGS:
      rig = skeleton.get_rig(jmap.rig)
    else:
      path = jmap.base_dir / jmap.rig
      rig = skeleton.Rig.from_json(json.loads(path.read_text()))
  except (OSError, KeyError, ValueError) as e:
    raise ConversionError(f'joint map {jmap.name}: cannot load rig {jmap.rig!r}: '
                          f'{e.args[0] if e.args else e}') from None
  for joint, child in jmap.designated_children or ():
    if rig.designated_children[rig.index(joint)] != rig.index(child):
      raise ConversionError(f'joint map {jmap.name}: designated child of {joint} is {child}, '
                            f'rig {rig.name} says otherwise')
  if jmap.mirror_pairs is not None and mirror_from_pairs(rig.joint_names,
                                                         jmap.mirror_pairs) != rig.mirror:
    raise ConversionError(f'joint map {jmap.name}: mirror_pairs differ from rig {rig.name}')
  return rig


# ----------------------------------------------------------------------------------------------
# Inputs, subjects and splits.


def find_bvh_files(input_path: str | os.PathLike) -> list[tuple[str, Path]]:
  """`(name, path)` of a BVH file, or of every *.bvh under a directory (name: relative path)."""
  root = Path(input_path)
  if root.is_file():
    return [(root.name, root)]
  if not root.is_dir():
    raise ConversionError(f'input {root} does not exist')
  found = sorted(p for p in root.rglob('*') if p.is_file() and p.suffix.lower() == '.bvh')
  if not found:
    raise ConversionError(f'no .bvh files under {root}')
  return [(p.relative_to(root).as_posix(), p) for p in found]


def subject_of(file: str, regex: str | None = None) -> str:
  """Subject of a file (relative name): `regex` group 'subject' (or 1) searched in the file
  name; else the parent directory inside the input; else the name before the first '_'."""
  name = Path(file).name
  if regex is not None:
    m = re.search(regex, name)
    if m is None:
      raise ConversionError(f'{file}: subject_regex {regex!r} does not match the file name')
    if 'subject' in m.re.groupindex:
      return m.group('subject')
    return m.group(1) if m.re.groups else m.group(0)
  parts = Path(file).parts
  return parts[-2] if len(parts) > 1 else Path(name).stem.split('_')[0]


def split_path(spec: str, base_dir: Path = SPLIT_DIR) -> Path:
  """A split by name (data_prep/splits/NAME.json) or a JSON path (relative to `base_dir`)."""
  if spec.endswith('.json') or Path(spec).is_file():
    return Path(spec) if Path(spec).is_absolute() else base_dir / spec
  return SPLIT_DIR / f'{spec}.json'


def load_split(path: Path) -> tuple[dict, str]:
  """A committed split file and its sha256; checks its structure."""
  try:
    text = path.read_text()
    doc = json.loads(text)
  except (OSError, json.JSONDecodeError) as e:
    raise ConversionError(f'cannot read split {path}: {e}') from None
  entry = {'type': 'object', 'required': ['file', 'sha256', 'split'],
           'properties': {'file': {'type': 'string'}, 'sha256': {'type': 'string'},
                          'split': {'type': 'string', 'enum': list(SPLIT_NAMES)}}}
  validate_json(doc, {'type': 'object', 'required': ['name', 'files'], 'properties': {
      'name': {'type': 'string'}, 'files': {'type': 'array', 'items': entry}}}, str(path))
  return doc, hashlib.sha256(text.encode()).hexdigest()


def assign_split(file: str, sha256: str, split: str, split_doc: dict | None
                 ) -> tuple[str, str | None]:
  """`(split, test part)` of a file: the named split, or its entry in the committed split."""
  if split != 'auto':
    return split, None
  entries = {e['file']: e for e in split_doc['files']}
  entry = entries.get(file) or entries.get(Path(file).name)
  if entry is None:
    raise ConversionError(f'{file} is not in split {split_doc["name"]}; pass '
                          '--split=train|val|test|all to put every input file in one split')
  if entry['sha256'] != sha256:
    raise ConversionError(f'{file}: sha256 {sha256[:12]}... differs from split '
                          f'{split_doc["name"]}\'s {entry["sha256"][:12]}... (the file changed)')
  return entry['split'], entry.get('part')


# ----------------------------------------------------------------------------------------------
# Shard directories (layout: ik_gat_jax/data.py): read for merging, written whole, swapped in.

_SPLIT_LAYOUT = {'positions': (np.float32, (3,)), 'local_rot': (np.float32, (3, 3)),
                 'global_rot': (np.float32, (3, 3)), 'subject_id': (np.int32, ()),
                 'file_id': (np.int32, ()), 'frame_index': (np.int32, ())}
assert tuple(_SPLIT_LAYOUT) == data_lib.SPLIT_ARRAYS


@dataclasses.dataclass
class _Shards:
  """A shard directory's content (all empty for a new one); arrays are memory maps."""
  summary: dict | None = None
  rig: skeleton.Rig | None = None
  files: list = dataclasses.field(default_factory=list)
  subjects: list = dataclasses.field(default_factory=list)
  offsets: list = dataclasses.field(default_factory=list)
  bone_frames: list = dataclasses.field(default_factory=list)
  split_files: list = dataclasses.field(default_factory=list)
  split_sources: dict = dataclasses.field(default_factory=dict)
  arrays: dict = dataclasses.field(default_factory=dict)


def load_output(output: Path) -> _Shards:
  if not output.exists():
    return _Shards()
  if not output.is_dir():
    raise ConversionError(f'--output {output} is a file, not a directory')
  if not any(output.iterdir()):
    return _Shards()
  if not (output / 'summary.json').is_file():
    raise ConversionError(f'--output {output} exists and is not a shard directory (no '
                          'summary.json); give a new or empty directory')
  try:
    sets = {s: data_lib.load_shards(output, s) for s in data_lib.available_splits(output)}
    split_doc = json.loads((output / 'split.json').read_text())
  except (OSError, ValueError) as e:
    raise ConversionError(f'--output {output}: cannot add to it: {e}') from None
  d = next(iter(sets.values()))
  return _Shards(summary=d.summary, rig=d.rig, files=[dict(f) for f in d.files],
                 subjects=[dict(s) for s in d.subjects], offsets=list(np.asarray(d.offsets)),
                 bone_frames=list(np.asarray(d.bone_frames)), split_files=split_doc['files'],
                 split_sources=split_doc.get('sources', {}),
                 arrays={s: {n: getattr(ds, n) for n in tuple(_SPLIT_LAYOUT) + (
                     ('end_sites',) if ds.end_sites is not None else ())}
                         for s, ds in sets.items()})


def _assign_subjects(shards: _Shards, clips: Sequence[Clip]) -> list[int]:
  """Sets `clip.subject_id` (new subjects appended); returns the new subjects' ids."""
  new = []
  for clip in clips:
    same = [i for i, s in enumerate(shards.subjects) if s['subject'] == clip.subject]
    match = next((i for i in same if np.abs(shards.offsets[i] - clip.offsets).max()
                  <= SUBJECT_TOL_M), None)
    if match is None:
      match = len(shards.subjects)
      shards.subjects.append({'name': clip.subject + (f'~{len(same)}' if same else ''),
                              'subject': clip.subject, 'files': 0, 'frames': 0})
      shards.offsets.append(clip.offsets)
      new.append(match)
    shards.subjects[match]['files'] += 1
    shards.subjects[match]['frames'] += clip.frames
    clip.subject_id = match
  return new


def _write_split(directory: Path, old: dict | None, clips: Sequence[Clip],
                 file_ids: Sequence[int], num_end_sites: int = 0) -> None:
  """Writes one split's arrays (old frames first); `end_sites.npy` too when `num_end_sites`
  (NaN for frames that have none: old directories without them, sources without End Sites)."""
  directory.mkdir()
  old_T = 0 if old is None else old['positions'].shape[0]
  T = old_T + sum(c.frames for c in clips)
  J = (old['positions'] if old is not None else clips[0].positions).shape[1]
  for name, (dtype, tail) in _SPLIT_LAYOUT.items():
    out = np.lib.format.open_memmap(directory / f'{name}.npy', mode='w+', dtype=dtype,
                                    shape=(T,) + ((J,) + tail if tail else ()))
    if old is not None:
      out[:old_T] = old[name]
    start = old_T
    for clip, fid in zip(clips, file_ids):
      n = clip.frames
      out[start:start + n] = {'positions': clip.positions, 'local_rot': clip.local_rot,
                              'global_rot': clip.global_rot, 'subject_id': clip.subject_id,
                              'file_id': fid, 'frame_index': np.arange(n)}[name]
      start += n
    out.flush()
    del out
  if num_end_sites:
    out = np.lib.format.open_memmap(directory / 'end_sites.npy', mode='w+', dtype=np.float32,
                                    shape=(T, num_end_sites, 3))
    out[:] = np.nan
    if old is not None and 'end_sites' in old:
      out[:old_T] = old['end_sites']
    start = old_T
    for clip in clips:
      if clip.end_sites is not None:
        out[start:start + clip.frames] = clip.end_sites
      start += clip.frames
    out.flush()
    del out


def _summarise(shards: _Shards, rig: skeleton.Rig, fps: float, hashes: dict, run: dict) -> dict:
  splits = sorted({f['split'] for f in shards.files})
  rows = lambda s: [f for f in shards.files if f['split'] == s]  # noqa: E731
  subject_frames = {}
  for s in splits:
    per = {}
    for f in rows(s):
      per[f['subject']] = per.get(f['subject'], 0) + f['frames']
    subject_frames[s] = dict(sorted(per.items()))
  return {
      'format': data_lib.FORMAT,
      'rig': rig.name, 'rig_fingerprint': rig.fingerprint(), **hashes,
      'fps': fps, 'joints': rig.num_joints, 'subjects': len(shards.subjects),
      'files': {s: len(rows(s)) for s in splits},
      'frames': {s: sum(f['frames'] for f in rows(s)) for s in splits},
      'subject_frames': subject_frames,
      'total_files': len(shards.files),
      'total_frames': sum(f['frames'] for f in shards.files),
      'fk_max_error_m': max(f['fk_max_error_m'] for f in shards.files),
      'fk_tolerance_m': FK_TOL_M,
      'runs': (shards.summary or {}).get('runs', []) + [run],
  }


def write_output(output: Path, shards: _Shards, rig: skeleton.Rig, clips: Sequence[Clip],
                 fps: float, split_sources: dict, run: dict) -> dict:
  """Writes old + new content into a temporary sibling directory, then swaps it in."""
  new_subjects = _assign_subjects(shards, clips)
  with jax.enable_x64(True):
    for s in new_subjects:
      shards.bone_frames.append(bone_frames_lib.bone_frames_np(shards.offsets[s], rig))
  first_id = len(shards.files)
  starts = {s: (a['positions'].shape[0]) for s, a in shards.arrays.items()}
  for i, c in enumerate(clips):
    start = starts.get(c.split, 0)
    starts[c.split] = start + c.frames
    shards.files.append({
        'file_id': first_id + i, 'file': c.file, 'subject': shards.subjects[c.subject_id]['name'],
        'subject_id': c.subject_id, 'sha256': c.sha256, 'split': c.split, 'part': c.part,
        'start': start, 'frames': c.frames, 'source_frames': c.source_frames,
        'source_fps': c.source_fps, 'fk_max_error_m': c.fk_max_error_m, 'path': c.path,
        **c.extra})
    shards.split_files.append({'file': c.file, 'subject': shards.subjects[c.subject_id]['name'],
                               'sha256': c.sha256, 'split': c.split, 'part': c.part})
  shards.split_sources.update(split_sources)
  output.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f'.{output.name}.tmp-', dir=output.parent))
  try:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private
    rig_text = json.dumps(rig.to_json(), indent=1)
    split_text = json.dumps({'sources': shards.split_sources, 'files': shards.split_files},
                            indent=1)
    (tmp / 'rig.json').write_text(rig_text)
    (tmp / 'split.json').write_text(split_text)
    (tmp / 'files.json').write_text(json.dumps(shards.files, indent=1))
    (tmp / 'subjects.json').write_text(json.dumps(shards.subjects, indent=1))
    np.save(tmp / 'offsets.npy', np.stack(shards.offsets).astype(np.float32))
    np.save(tmp / 'bone_frames.npy', np.stack(shards.bone_frames).astype(np.float32))
    has_ends = (any(c.end_sites is not None for c in clips)
                or any('end_sites' in a for a in shards.arrays.values()))
    num_ends = len(rig.leaves) if has_ends else 0
    if has_ends:
      (tmp / 'end_sites.json').write_text(json.dumps(
          {'joints': [rig.joint_names[k] for k in rig.leaves],
           'names': end_site_names(rig.joint_names, rig.parents)}, indent=1))
    for split in sorted(set(shards.arrays) | {c.split for c in clips}):
      mine = [(c, first_id + i) for i, c in enumerate(clips) if c.split == split]
      _write_split(tmp / split, shards.arrays.get(split), [c for c, _ in mine],
                   [f for _, f in mine], num_ends)
    hashes = {'rig_sha256': hashlib.sha256(rig_text.encode()).hexdigest(),
              'split_sha256': hashlib.sha256(split_text.encode()).hexdigest(),
              'split_sources': shards.split_sources}
    summary = _summarise(shards, rig, fps, hashes, run)
    (tmp / 'summary.json').write_text(json.dumps(summary, indent=1))
    _swap_in(tmp, output)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return summary


def _swap_in(tmp: Path, output: Path) -> None:
  """Replaces `output` by `tmp` with renames: the old content stays until the new is in place."""
  if not output.exists():
    os.replace(tmp, output)
    return
  old = output.parent / f'.{output.name}.old-{os.getpid()}-{time.time_ns()}'
  os.replace(output, old)
  try:
    os.replace(tmp, output)
  except BaseException:
    os.replace(old, output)
    raise
  shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# The whole command.


def git_commit() -> str:
  """HEAD of the converter's checkout, '+dirty' with uncommitted changes to tracked files."""
  import subprocess
  def run(*args):
    return subprocess.run(['git', *args], cwd=PACKAGE_DIR, capture_output=True, text=True,
                          timeout=10, check=True).stdout.strip()
  try:
    return run('rev-parse', 'HEAD') + ('+dirty' if run('status', '--porcelain', '-uno') else '')
  except (OSError, subprocess.SubprocessError):
    return 'unknown'


def check_output_matches(shards: _Shards, output: Path, fps: float,
                         rig: skeleton.Rig | None) -> None:
  """Refuses adding to a shard directory of another frame rate or rig (None: not yet known)."""
  if shards.summary is None:
    return
  if float(shards.summary['fps']) != float(fps):
    raise ConversionError(f'--output {output} holds {shards.summary["fps"]} fps shards, this run '
                          f'asks for --fps={fps:g}')
  if rig is not None and rig.fingerprint() != shards.rig.fingerprint():
    raise ConversionError(f'--output {output} holds rig {shards.rig.name} '
                          f'({shards.rig.fingerprint()}), this run converts to {rig.name} '
                          f'({rig.fingerprint()})')


def new_inputs(inputs: Sequence[tuple[str, Path]], shards: _Shards, output: Path,
               log: Log = log_stderr) -> tuple[list[tuple[str, Path, str]], list[str]]:
  """`((file, path, sha256) not yet in the shards, files skipped)`: a file already there with
  the same sha256 is skipped (logged), one with a different sha256 refused."""
  todo, skipped = [], []
  done = {f['file']: f['sha256'] for f in shards.files}
  for file, path in inputs:
    sha = file_sha256(path)
    if file in done:
      if done[file] != sha:
        raise ConversionError(f'{file} is already in {output} with a different sha256; convert it '
                              'into a new --output')
      skipped.append(file)
      log(f'{file}: already in {output}, skipped')
      continue
    todo.append((file, path, sha))
  return todo, skipped


def build_joint_map(rig: str, inputs: Sequence[Path], units: str | float | None = None,
                    up: str | None = None, forward: str | None = None,
                    prune: Sequence[str] = (), drop_first_frame: bool | None = None,
                    subject_regex: str | None = None) -> JointMap:
  """The joint map for `--rig` (name, JSON path, or 'auto' derived from `inputs`), with the
  command-line overrides applied."""
  scale = parse_units(units) if units is not None else None
  if rig == 'auto':
    if scale is None:
      raise ConversionError('--rig=auto needs --units (metres per file unit: a number, or one of '
                            f'{", ".join(UNITS)})')
    return derive_joint_map(inputs, scale, up or '+y', forward or '+z', tuple(prune),
                            bool(drop_first_frame), subject_regex)
  jmap = load_joint_map(rig)
  return jmap.with_overrides(units=scale, up=up, forward=forward,
                             drop_first_frame=drop_first_frame, subject_regex=subject_regex,
                             prune=(tuple(jmap.prune) + tuple(prune)) if prune else None)


def convert(input_path: str | os.PathLike, rig: str, output: str | os.PathLike, *,
            split: str = 'auto', fps: float = 30.0, units: str | float | None = None,
            up: str | None = None, forward: str | None = None, prune: Sequence[str] = (),
            drop_first_frame: bool | None = None, subject_regex: str | None = None,
            split_file: str | None = None, rig_name: str = 'auto', on_error: str = 'fail',
            log: Log = log_stderr) -> dict:
  """BVH file(s) -> shard directory `output` (created, or added to). Returns the summary.

  Args mirror `bvh_to_shards` flags: `rig` is a joint-map name, a joint-map JSON path or 'auto';
  `split` is 'auto' (the joint map's committed split, or `split_file`) or a split name that takes
  every input file; `units` (metres per file unit), `up`, `forward`, `drop_first_frame` and
  `subject_regex` override the joint map; `prune` adds subtrees to prune; `rig_name` names a
  derived rig; `on_error='skip'` logs and skips refused files instead of failing the run.
  Raises ConversionError (one line) on bad input; the output is then left as it was.
  """
  started = time.perf_counter()
  if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
    raise ConversionError(f'--fps must be a positive number, got {fps!r}')
  if split not in ('auto',) + SPLIT_NAMES:
    raise ConversionError(f'--split must be auto or one of {", ".join(SPLIT_NAMES)}, got {split!r}')
  if on_error not in ('fail', 'skip'):
    raise ConversionError(f'on_error must be fail or skip, got {on_error!r}')
  output = Path(output)
  shards = load_output(output)
  inputs = find_bvh_files(input_path)
  jmap = build_joint_map(rig, [p for _, p in inputs], units, up, forward, prune,
                         drop_first_frame, subject_regex)
  target = resolve_rig(jmap)
  check_output_matches(shards, output, fps, target)
  known = target or shards.rig
  W = world_rotation(jmap.up, jmap.forward, known.up if known else (0.0, 1.0, 0.0),
                     known.forward if known else (0.0, 0.0, 1.0))
  split_doc, split_sources = None, {}
  if split == 'auto':
    spec = split_file or jmap.default_split
    if spec is None:
      raise ConversionError(f'--split=auto: joint map {jmap.name} names no committed split; pass '
                            '--split=train|val|test|all or --split_file')
    path = split_path(spec, jmap.base_dir if split_file is None else Path.cwd())
    split_doc, digest = load_split(path)
    split_sources = {split_doc['name']: digest}
  else:
    split_sources = {f'--split={split}': None}

  new, skipped = new_inputs(inputs, shards, output, log)
  todo = [(file, path, sha, *assign_split(file, sha, split, split_doc),
           subject_of(file, jmap.subject_regex)) for file, path, sha in new]
  if not todo:
    log(f'nothing to convert: every input file is already in {output}')
    return shards.summary

  clips, refused = [], []
  names = known.joint_names if known else None
  parents = known.parents if known else None
  for file, path, sha, split_name, part, subject in todo:
    try:
      clip = convert_file(file, path, subject, jmap, W, fps, names, parents, sha256=sha)
    except ConversionError as e:
      reason = str(e) if str(e).startswith(str(path)) else f'{file}: {e}'
      if on_error == 'skip':
        refused.append({'file': file, 'reason': reason})
        log(f'REFUSED {reason}')
        continue
      raise ConversionError(reason) from None
    clip.split, clip.part = split_name, part
    names, parents = clip.names, clip.parents
    clips.append(clip)
    log(f'{file}: subject {subject}, {clip.source_frames} frames @ {clip.source_fps:g} fps -> '
        f'{clip.frames} @ {fps:g} fps ({split_name}), FK max error {clip.fk_max_error_m:.2e} m, '
        f'{clip.seconds:.2f} s')
  if not clips:
    raise ConversionError(f'no file converted ({len(refused)} refused)')
  if target is None:
    target = shards.rig or derive_rig(rig_name, jmap, names, parents,
                                      _subject_mean_offsets(clips))
  run = {'input': str(input_path), 'joint_map': jmap.name, 'joint_map_sha256': jmap.sha256,
         'units_m': jmap.units, 'up': jmap.up, 'forward': jmap.forward,
         'drop_first_frame': jmap.drop_first_frame, 'split': split,
         'files_added': len(clips), 'files_skipped': skipped, 'files_refused': refused,
         'frames_added': sum(c.frames for c in clips),
         'fk_max_error_m': max(c.fk_max_error_m for c in clips),
         'seconds': round(time.perf_counter() - started, 3), 'git_commit': git_commit(),
         'time_utc': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}
  return write_output(output, shards, target, clips, float(fps), split_sources, run)


def _subject_mean_offsets(clips: Sequence[Clip]) -> list[np.ndarray]:
  """One offsets row per subject (the mean over its files), for a derived rig's template."""
  by_subject: dict[str, list[np.ndarray]] = {}
  for c in clips:
    by_subject.setdefault(c.subject, []).append(c.offsets)
  return [np.mean(v, axis=0) for v in by_subject.values()]
