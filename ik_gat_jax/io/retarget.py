"""A user's BVH reduced to a rig at run time: joint maps, reduction, verification, resampling.

Used by the solver's BVH reader (`io.exports.read_bvh_clip`) and by the offline shard builders
(`data_prep.conversion`, `data_prep.amass`), so both read a BVH the same way (DESIGN sections 3
and 7). Joint maps are JSON files (`joint_maps/NAME.json`, schema `joint_maps/schema.json`).

Choices written down (DESIGN leaves them open):
- Reduction. Every source joint is mapped to a rig joint, pruned (with its whole subtree), or
  removed. A removed joint between two mapped joints must keep a *constant* rotation C (within
  1e-3 degrees of its first converted frame's in every frame; C = I when that is within 1e-3
  degrees of identity, DESIGN's case, bit for bit as before): its translation and C carry the
  child's offset, `o_child' = t_removed + C t_child`, and its per-frame rotation is multiplied
  into the child's local rotation, so the child's world rotation stays exact. Constant, not
  identity: a re-rigged source binds every joint by some fixed rotation, under which DESIGN's
  "identity in every frame" (CMU's LHipJoint, LeftShoulder) becomes "the same in every frame",
  and the rule must not depend on the bind (DESIGN section 3, rig invariance). Joints above the rig's root (a dummy root, "Armature") fold into the root's world
  transform exactly, moving or not. Position channels of any other joint must be constant (within
  1e-5 m, FK_TOL_M: Blender's default export writes them on every joint, with float32 noise of
  about 1e-6 m); their first frame's value replaces the OFFSET (BVH semantics) and becomes the
  rig offset, and the FK check below bounds what the noise adds up to along a chain.
- Namespaces. A file whose joint names all carry one namespace ('Anna:Hips', 'mixamorig:Hips')
  is read by the bare names (`bvh.strip_namespace`), and a joint map's source names the same way
  (`without_namespace`): subjects exported under their own namespaces share one hierarchy.
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
  (folded) and joints with children whose rotation is constant (within 1e-3 degrees of the first
  file's first frame) in every frame of every input file (removed); rig names are the source
  names, the template is the mean subject offsets, and designated children, reference axes and
  mirror map follow DESIGN section 4 and the names.
  The rig's rest pose is the file's zero pose (all channels 0, OFFSETs as written): a file whose
  joints carry bind rotations (game-engine exports) keeps them, so its local rotations are the
  bind-conjugated ones `C_parent^T R C_joint`, consistent with that rest pose; positions are
  the same either way.
- Reference pose (`skeleton.Rig.reference_pose`). A joint map's `reference_pose` names the
  source's natural, mirror-symmetric pose facing `forward`: "zero" (default: the zero pose is
  it), "first_frame" (frame 0 of the first input file, before dropping: MotionBuilder/cgspeed
  exports start with a T-pose), or an object `{source joint: [its rotation channel values in
  degrees, channel order]}` (joints not listed: 0). It becomes the world frame `F_k` of every rig
  joint in that pose (`reference_rotations`: the full source FK of that one frame, then the
  axes' W, `F' = W F W^T`). A derived rig stores it; a joint map naming a rig must agree with
  the rig's (within 0.01 degrees), else the conversion is refused.
- End sites (issue G2). Every rig leaf (a joint without rig children: CMU Head, hands, toes)
  gets the world position of one source `End Site`: its own, else the one in its pruned subtree
  farthest from it in the rest pose (CMU hands: the LeftHandIndex1 tip, not the thumb's; ties:
  the first in file order). It is computed per source frame by the full source FK, through the
  pruned joints, which rotate (CMU fingers have channels), and verified against
  `bvh.naive_fk_np` like the joints (limit 1e-5 m). For resampling it is held in the leaf's
  frame, `e_t = G_leaf^T (x_t - p_leaf)`: decimated frames are exact; slerped frames interpolate
  `e` linearly (exact where the pruned joints are rigid). A leaf without any End Site is NaN.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ik_gat_jax import kinematics
from ik_gat_jax import rotations
from ik_gat_jax import skeleton
from ik_gat_jax.errors import ConversionError
from ik_gat_jax.io import bvh

JOINT_MAP_DIR = Path(__file__).resolve().parent / 'joint_maps'
SCHEMA_PATH = JOINT_MAP_DIR / 'schema.json'

IDENTITY_TOL_DEG = 1e-3  # a removed joint may rotate this much (DESIGN section 3)
REFERENCE_POSES = ('zero', 'first_frame')  # joint map `reference_pose` names (module docstring)
REFERENCE_TOL_DEG = 0.01  # a joint map's reference pose vs its rig's
STATIC_TOL_M = 1e-5  # position channels moving less than this are constant (FK_TOL_M)
FK_TOL_M = 1e-5  # verification threshold (DESIGN section 3)
FPS_SNAP_REL = 1e-4  # relative distance of a frame rate to an integer that snaps to it


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
# Joint maps and axes.


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
  reference_pose: str | tuple[tuple[str, tuple[float, ...]], ...] | None = None
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
    if isinstance(self.reference_pose, str) and self.reference_pose not in REFERENCE_POSES:
      raise ConversionError(f'joint map {self.name}: reference_pose must be one of '
                            f'{", ".join(REFERENCE_POSES)} or per-joint channel values, got '
                            f'{self.reference_pose!r}')
    world_rotation(self.up, self.forward, (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))  # checks the axes

  def with_overrides(self, **kw) -> 'JointMap':
    return dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})


def joint_map_from_json(doc: dict, name: str, base_dir: Path, sha256: str | None = None
                        ) -> JointMap:
  validate_json(doc, json.loads(SCHEMA_PATH.read_text()), name)
  pairs = lambda key: (tuple(tuple(p) for p in doc[key]) if key in doc else None)  # noqa: E731
  dc = doc.get('designated_children')
  ref = doc.get('reference_pose')
  if isinstance(ref, dict):
    ref = tuple((k, tuple(float(x) for x in v)) for k, v in ref.items())
  return without_namespace(JointMap(
      joints=tuple(doc['joints'].items()), units=float(doc['units']), up=doc['up'],
      forward=doc['forward'], rig=doc.get('rig'), prune=tuple(doc.get('prune', ())),
      designated_children=tuple(dc.items()) if dc is not None else None,
      mirror_pairs=pairs('mirror_pairs'), drop_first_frame=doc.get('drop_first_frame', False),
      subject_regex=doc.get('subject_regex'), default_split=doc.get('default_split'),
      reference_pose=ref, name=name, base_dir=base_dir, sha256=sha256))


def without_namespace(jmap: JointMap) -> JointMap:
  """`jmap` with the namespace its source names all carry dropped (`bvh.namespace`: the
  readers drop a file's the same way, so a map written for 'mocap:Hips' reads 'Hips' and the
  other way round). Rig names (`joints`' values, designated children, mirror pairs) stay."""
  ref = jmap.reference_pose if isinstance(jmap.reference_pose, tuple) else ()
  space = bvh.namespace([s for s, _ in jmap.joints] + list(jmap.prune) + [k for k, _ in ref])
  if not space:
    return jmap
  bare = lambda name: name[len(space):]  # noqa: E731
  return dataclasses.replace(
      jmap, joints=tuple((bare(s), r) for s, r in jmap.joints),
      prune=tuple(bare(n) for n in jmap.prune),
      reference_pose=(tuple((bare(k), v) for k, v in ref) if ref else jmap.reference_pose))


def load_joint_map(spec: str) -> JointMap:
  """A joint map by name (ik_gat_jax/io/joint_maps/NAME.json) or by JSON path."""
  path = Path(spec)
  if not (spec.endswith('.json') or path.is_file()):
    path = JOINT_MAP_DIR / f'{spec}.json'
    if not path.is_file():
      known = sorted(p.stem for p in JOINT_MAP_DIR.glob('*.json') if p.stem != 'schema')
      raise ConversionError(f'no joint map {spec!r}: neither a file nor a built-in joint map '
                            f'({", ".join(known)}); give a joint-map JSON file '
                            '(ik_gat_jax/io/joint_maps/schema.json), or for a conversion '
                            '--rig=auto (the files\' own hierarchy)')
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


def plan_reduction(src_names: Sequence[str], src_parents: Sequence[int], jmap: JointMap,
                   rig_names: Sequence[str] | None = None,
                   rig_parents: Sequence[int] | None = None) -> Reduction:
  """Checks the joint map against a source hierarchy; rig order from `rig_names` or the source.

  Raises ConversionError for names the source lacks, joints neither mapped nor pruned, two
  roots, or a parent that differs from the rig's.
  """
  index = {n: i for i, n in enumerate(src_names)}
  to_rig = dict(jmap.joints)
  # A joint it only prunes may be absent (a CMU file re-exported without its fingers, this
  # project's own BVH of one): there is nothing of it to leave out. A mapped one may not.
  missing = [n for n in to_rig if n not in index]
  if missing:
    raise ConversionError(f'joint map {jmap.name} names joints the BVH does not have: '
                          f'{", ".join(missing)}')
  pruned = {j for p in jmap.prune if p in index
            for j in skeleton.depth_first_order(src_parents, index[p])}
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
    removed: per rig joint, the source joints removed between it and its rig parent, top-down
      (`Reduction.folded`; none for the root), each `(source index, offset [3] metres,
      constant rotation C [3, 3])` in the rig's axes, then the rig joint's own source offset;
      the rig joint's offset is `t_1 + C_1 t_2 + ... + (C_1 ... C_n) t_own` and its local
      rotation `C_1 ... C_n R_own` (what an output BVH on these offsets writes back).
  """
  local_rot: np.ndarray
  root_pos: np.ndarray
  offsets: np.ndarray
  end_local: np.ndarray | None = None
  removed: tuple | None = None


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


def constant_rotation(R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`R [T, 3, 3]` -> `(C [3, 3], degrees [T])`: the constant a removed joint keeps (identity
  when its first frame is within IDENTITY_TOL_DEG of it, else the first frame's rotation) and
  each frame's angle from it."""
  if not len(R):
    return np.eye(3), np.zeros(0)
  C = R[0] if rotation_angles_deg(R[:1])[0] > IDENTITY_TOL_DEG else np.eye(3)
  return C, rotation_angles_deg(np.swapaxes(C, -1, -2) @ R)


def _check_removals(motion: bvh.BVHMotion, plan: Reduction, R: np.ndarray,
                    scale: float) -> dict[int, np.ndarray]:
  """Refuses moving position channels below the rig root and removed joints whose rotation is
  not constant; returns the removed joints' constant rotations (source index -> C)."""
  names = motion.names
  constants = {}
  for k in range(1, len(plan.names)):
    for j in plan.folded[k] + (plan.source[k],):
      pc = motion.position_channels(j)
      if pc is not None and np.ptp(pc, axis=0).max() * scale > STATIC_TOL_M:
        raise ConversionError(f'joint {names[j]} has position channels that move (by up to '
                              f'{np.ptp(pc, axis=0).max() * scale:.3g} m); only the root may '
                              'translate')
    for j in plan.folded[k]:
      C, angle = constant_rotation(R[:, j])
      if angle.max() > IDENTITY_TOL_DEG:
        raise ConversionError(
            f'joint {names[j]} is not in the rig but rotates (by {angle.max():.3g} degrees in '
            f'frame {int(angle.argmax())}) away from its '
            f'{"identity" if np.array_equal(C, np.eye(3)) else "first frame"} rotation; a joint '
            f'is removed only if its rotation is constant within {IDENTITY_TOL_DEG:g} degrees in '
            'every frame: map it to a rig joint')
      constants[j] = C
  return constants


def reduce_motion(motion: bvh.BVHMotion, plan: Reduction, scale: float,
                  W: np.ndarray) -> ReducedMotion:
  """Source channels -> rig motion (module docstring: reduction, axes). Refuses by raising."""
  T, J = motion.num_frames, len(plan.names)
  R = source_local_rotations(motion)
  t = _translations(motion)
  constants = _check_removals(motion, plan, R, scale)
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
    offset, C = np.zeros(3), np.eye(3)
    for j in chain:  # o = t_f1 + C_f1 t_f2 + ... + (C_f1 ... C_fn) t_source
      offset = offset + (t[j][0] if j == chain[0] else C @ t[j][0])
      if j in constants:
        C = C @ constants[j]
    offsets[k] = offset
  removed = [()] + [
      (tuple((j, scale * W @ t[j][0], W @ constants[j] @ W.T) for j in plan.folded[k]),
       scale * W @ t[plan.source[k]][0]) for k in range(1, J)]
  return ReducedMotion(local_rot=W @ local @ W.T, root_pos=scale * root_pos @ W.T,
                       offsets=scale * offsets @ W.T, removed=tuple(removed))


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
  out = []
  for k in skeleton.leaves_of(plan.parents):
    top = plan.source[k]
    rel = {top: np.zeros(3)}  # rest position relative to the leaf's source joint
    best, best_d = None, -1.0
    for j in sorted(skeleton.depth_first_order(motion.parents, top)):  # parents first (file order)
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



FIRST_FRAME_JUMP_M = 0.15  # frame 0 this far from frame 1 (a joint, root-relative): its own pose


def opens_with_its_own_pose(motion: bvh.BVHMotion, units_m: float) -> bool:
  """Whether `motion`'s frame 0 is a pose apart from the clip, as a joint map's
  `drop_first_frame` says of its files (cgspeed CMU's open with a T-pose): its rotation channels
  all whole numbers (cgspeed writes that frame so), or a joint `FIRST_FRAME_JUMP_M` or more
  from where frame 1 has it, relative to the root (CMU: 0.31-1.2 m; a body moves 1-2 cm between
  frames at 120 fps). False for a clip cut from the middle of a file, whose frame 0 moves on
  into frame 1, and for a file of no frames."""
  if motion.num_frames < 1:
    return False
  whole = all(np.allclose(motion.rotation_degrees(j)[0], np.round(motion.rotation_degrees(j)[0]),
                          rtol=0.0, atol=1e-9) for j in range(len(motion.joints)))
  if whole or motion.num_frames < 2:
    return whole
  p = bvh.naive_fk_np(dataclasses.replace(motion, motion=motion.motion[:2]), units_m)
  p = p - p[:, :1]
  return float(np.linalg.norm(p[0] - p[1], axis=-1).max()) >= FIRST_FRAME_JUMP_M


def read_motion(path: str | os.PathLike, drop_first_frame: bool) -> tuple[bvh.BVHMotion, int]:
  """Parses a BVH file, dropping frame 0 if asked; returns (motion, frames in the file)."""
  try:
    motion = bvh.strip_namespace(bvh.read_bvh(path))
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


def end_site_offsets(reduced: ReducedMotion) -> np.ndarray | None:
  """`[E, 3]` each rig leaf's end site in the leaf's own frame (the output BVH's `End Site`
  OFFSET, metres, rig axes): `end_local`'s median over the frames (constant where the pruned
  joints carrying it are rigid); NaN for a leaf without one; None for a motion without any."""
  if reduced.end_local is None:
    return None
  return np.median(reduced.end_local, axis=0)


def end_site_names(rig_names: Sequence[str], parents: Sequence[int]) -> list[str]:
  """Names of the end sites, one per rig leaf: '<leaf>_end' (end_sites.json)."""
  return [f'{rig_names[k]}_end' for k in skeleton.leaves_of(parents)]



def reference_rotations(path: str | os.PathLike, jmap: JointMap, plan: Reduction,
                        W: np.ndarray) -> np.ndarray | None:
  """`[J, 3, 3]` world frames (rig world) of the rig joints in the joint map's reference pose
  (module docstring), read from the BVH at `path`; None for the zero pose."""
  spec = jmap.reference_pose
  if spec is None or spec == 'zero':
    return None
  try:
    motion = bvh.strip_namespace(bvh.read_bvh(path))
  except bvh.BVHError as e:
    raise ConversionError(str(e)) from None
  if spec == 'first_frame':
    if motion.num_frames < 1:
      raise ConversionError(f'{path}: reference_pose first_frame needs a frame')
    row = motion.motion[:1].copy()
  else:
    row = np.zeros((1, motion.num_channels))
    index = {n: i for i, n in enumerate(motion.names)}
    for name, values in spec:
      if name not in index:
        raise ConversionError(f'joint map {jmap.name}: reference_pose names {name!r}, which the '
                              'BVH does not have')
      j = index[name]
      cols = [k for k, c in enumerate(motion.joints[j].channels) if c in bvh.ROTATION_CHANNELS]
      if len(values) != len(cols):
        raise ConversionError(f'joint map {jmap.name}: reference_pose of {name} has '
                              f'{len(values)} values, its BVH rotation channels are {len(cols)}')
      row[0, motion.channel_slice(j).start + np.asarray(cols, int)] = values
  one = dataclasses.replace(motion, motion=row)
  R = source_local_rotations(one)[0]
  G = np.empty_like(R)
  for j, p in enumerate(one.parents):
    G[j] = R[j] if p < 0 else G[p] @ R[j]
  return W @ G[list(plan.source)] @ W.T


def check_reference(rig: skeleton.Rig, reference: np.ndarray | None, jmap: JointMap) -> None:
  """Refuses a joint map whose declared reference pose differs from its rig's."""
  F = rig.reference_rotations()
  mine = np.broadcast_to(np.eye(3), F.shape) if reference is None else reference
  angle = rotation_angles_deg(np.swapaxes(F, -1, -2) @ mine)
  if angle.max() > REFERENCE_TOL_DEG:
    k = int(angle.argmax())
    raise ConversionError(f'joint map {jmap.name}: its reference pose differs from rig '
                          f'{rig.name}\'s at {rig.joint_names[k]} by {angle[k]:.3g} degrees')


# ----------------------------------------------------------------------------------------------
# --rig=auto: a joint map derived from the files themselves.


def derive_joint_map(paths: Sequence[str | os.PathLike], units: float, up: str = '+y',
                     forward: str = '+z', prune: Sequence[str] = (),
                     drop_first_frame: bool = False, subject_regex: str | None = None,
                     reference_pose: str | None = None,
                     joints: Sequence[str] | None = None) -> JointMap:
  """Keeps every joint except: pruned subtrees; motionless single-child roots (folded into the
  root below them); joints with children whose rotation is constant (within 1e-3 degrees of
  the first file's first frame) in every frame of every file (removed). End Sites are never
  joints. Rig names = source names. `joints`: keep these instead (the rig a folder derived
  before, added to now: a joint that happens to hold still in the new files is still one).
  """
  first, max_angle, still, start = None, None, None, None
  for path in paths:
    motion, _ = read_motion(path, drop_first_frame)
    R = source_local_rotations(motion)
    if first is None:
      first = (motion.names, motion.parents, path)
      max_angle = np.zeros(len(motion.names))
      still = np.ones(len(motion.names), bool)
      start = R[0]  # "constant" is measured from the first file's first frame
    elif (motion.names, motion.parents) != first[:2]:
      raise ConversionError(f'{path}: joint hierarchy differs from {first[2]}; --rig=auto needs '
                            'one hierarchy (convert them separately or write a joint map)')
    angles = rotation_angles_deg(np.swapaxes(start, -1, -2)[None] @ R)
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
  if joints is not None:
    missing = [n for n in joints if n not in index]
    if missing:
      raise ConversionError(f'{first[2]}: lacks joints of the rig already derived in the output '
                            f'({", ".join(missing[:4])}{", ..." if len(missing) > 4 else ""}); '
                            'convert it into a new --output')
    return JointMap(joints=tuple((n, n) for n in sorted(joints, key=index.get)), units=units,
                    up=up, forward=forward, rig=None, prune=tuple(prune),
                    drop_first_frame=drop_first_frame, subject_regex=subject_regex,
                    reference_pose=reference_pose, name='auto')
  children = skeleton.children_of(parents)
  pruned = {j for p in prune for j in skeleton.depth_first_order(parents, index[p])}
  root = 0
  while root not in pruned and still[root] and len(children[root]) == 1:
    root = children[root][0]
  if root in pruned:
    raise ConversionError('--prune removes every joint')
  keep = []
  for j in sorted(skeleton.depth_first_order(parents, root)):
    live = [c for c in children[j] if c not in pruned]
    if j in pruned or (j != root and live and max_angle[j] <= IDENTITY_TOL_DEG):
      continue
    keep.append(j)
  return JointMap(joints=tuple((names[j], names[j]) for j in keep), units=units, up=up,
                  forward=forward, rig=None, prune=tuple(prune),
                  drop_first_frame=drop_first_frame, subject_regex=subject_regex,
                  reference_pose=reference_pose, name='auto')


def mirror_from_pairs(names: Sequence[str], pairs: Iterable[Sequence[str]]) -> tuple[int, ...]:
  index = {n: i for i, n in enumerate(names)}
  mirror = list(range(len(names)))
  for a, b in pairs:
    if a not in index or b not in index:
      raise ConversionError(f'mirror pair ({a}, {b}) names a joint the rig does not have')
    mirror[index[a]], mirror[index[b]] = index[b], index[a]
  return tuple(mirror)


def derive_rig(name: str, jmap: JointMap, names: Sequence[str], parents: Sequence[int],
               subject_offsets: Sequence[np.ndarray],
               reference: np.ndarray | None = None) -> skeleton.Rig:
  """A y-up, +z-forward rig whose template is the mean of the subjects' rest offsets;
  `reference`: `[J, 3, 3]` its reference pose (`reference_rotations`), None: the zero pose."""
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
                             forward=(0.0, 0.0, 1.0), designated_children=dc, mirror=mirror,
                             reference_pose=reference)
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

