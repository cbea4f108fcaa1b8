"""The solver's files: positions in (npz, csv, BVH), rotations out (npz, BVH, SMPL npz, GLB, FBX).

Readers return positions `[T, J, 3]` in the rig's joint order:
- npz: key `positions` (or the only array), `[T, J, 3]` or `[J, 3]`, input units; optional
  `joint_names` (reordered to the rig's by name; a namespace they all carry dropped), `fps`,
  `offsets [J, 3]` (in the positions' units and axes, converted with them).
- csv: one frame per row, J x 3 columns (x, y, z per joint in rig order), comma, semicolon, tab
  or whitespace separated (the first row's separator, a semicolon before a tab before a comma,
  holds for the file; with a semicolon or a tab, decimal commas are read); a header row is
  optional. A header naming columns `<joint>_<axis>` (or `<joint>.<axis>`) with the rig's joint
  names, in any case, picks and orders them (every joint's x, y, z must be there, once; other
  columns, such as pandas' index or a time, are left out; a namespace all its joint names
  carry, `Anna:Hips_x`, is dropped, as for a BVH's joints); one naming only other joints is
  read in rig order, in a warning. With a comma,
  semicolon or tab between fields an empty field is a missing value (NaN, as pandas writes one;
  a joint the solver then refuses or holds, `hold_missing`), as is `NA` or `N/A` (R's), and one
  separator after the last field is allowed. The first row is a header where it holds more
  words than numbers, or counts the columns (0, 1, 2, ...: pandas' labels of unnamed ones); a UTF-8
  byte order mark (Excel's "CSV UTF-8") is read past.
- BVH: joint positions by FK, reduced to the rig with `io.retarget` (the file's own
  rest offsets come along). A BVH that has every rig joint by name (e.g. one this module wrote)
  is reduced by name, extra subtrees pruned, in centimetres unless `units` says otherwise; any
  other BVH needs a joint map (`joint_map`, default: the rig's own, e.g. `cmu_body`, taken when
  the file has every joint it names: the file's subtrees that hold none of them are pruned too,
  in a warning, and where the map drops the first frame, `PositionsFile.first_dropped` says so).

Writers (all atomic: a temp file in the same directory, then `os.replace`; an existing file is
refused unless `overwrite`):
- npz: `local_rot`, `global_rot`, `bone_aligned_rot [T, J, 3, 3]`, `positions_fk`, `positions`
  `[T, J, 3]` (metres), `offsets [J, 3]` (metres), `bone_frames [J, 3, 3]`, `joint_names`,
  `parents`, `fps`, `rig` (JSON).
- BVH: the rig's joints (depth-first) in the rig's joint names or `names` (`output_names`: the
  input's, its namespace and a joint map's source names; `solve` writes those; with `removed`,
  an input BVH's constant-rotation joints the rig left out, between the same joints), OFFSETs =
  the subject's offsets (the root's 0 0 0: its channels are its world position), angles
  continuous over frames
  (`continuous_euler`), root channels `Xposition Yposition Zposition` then three rotation
  channels, others three rotation channels, per joint in `orders[j]` (intrinsic, channel order:
  'ZYX' is `Zrotation Yrotation Xrotation`, R = Rz Ry Rx, degrees; default ZYX for every joint),
  End Sites at leaves: those given (`end_sites`), else along the leaf's rest direction (half
  the leaf's bone, at least 2 cm). Lengths in `units` metres per file unit (a number or a
  `units.UNITS` name: 'cm', the default, 'm', 'inch', ...). `solve` passes a BVH input's own
  orders and units (`PositionsFile.bvh_orders`, `bvh_units_m`), and its End Sites where the
  output stands on its offsets (`PositionsFile.end_site_offsets`). Blender: File > Import >
  BVH with Scale = metres per unit (0.01 for centimetres), forward -Z, up Y (its defaults: the
  body then stands where the GLB's does; forward Z turns it 180 degrees).
- SMPL npz (rig `smpl22` only): the fields of `io.smpl.smpl_arrays` (that module's docstring):
  `poses [T, 66]` axis-angle of the 22 local rotations (root orientation first), `trans`, ...;
  in the rig's y-up world (the SMPL model's frame) by default, or AMASS's with `world='amass'`.
- GLB (`write_solution_glb`; `io.gltf.solution_glb` for the bytes): glTF 2.0 binary, one node
  per rig joint (the rig's names or `names`, its hierarchy, rest translation = the subject's
  offsets, rest rotation identity), the local rotations and the root position as LINEAR channels at
  t / fps,
  and a body of boxes, each rigidly skinned to its joint. Metres, y up; a rig with other axes
  sits under one fixed rotation node. Details in `io.gltf`'s docstring.
- FBX (`write_solution_fbx`; needs Blender on PATH, else one line saying what to install): the
  GLB above, converted by headless Blender (`io.blender`: its import / export settings, axes
  and units): the same joint names, hierarchy, rest offsets, skinned box body and motion, baked
  at every frame at the clip's rate; metres (`UnitScaleFactor` 100, no scaled node), y up,
  +z forward as the GLB.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import shutil
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ik_gat_jax import bone_frames as bone_frames_lib
from ik_gat_jax import padding
from ik_gat_jax import rotations
from ik_gat_jax.errors import ConversionError, InputError, check_frame_rate
from ik_gat_jax.io import atomic
from ik_gat_jax.io import blender
from ik_gat_jax.io import bvh
from ik_gat_jax.io import gltf
from ik_gat_jax.io import retarget
from ik_gat_jax.io import smpl
from ik_gat_jax.io.units import UNITS, parse_units
from ik_gat_jax.skeleton import Rig, RigError, check_joint_names, depth_first_order

BVH_UNITS = {'cm': 0.01, 'm': 1.0}  # metres per BVH unit by name (the writer takes any units)
DEFAULT_BVH_UNITS = 'cm'
DEFAULT_BVH_ORDER = 'ZYX'  # rotation channels of a written joint without a source order
_END_SITE_MIN_M = 0.02


# ----------------------------------------------------------------------------------------------
# Output paths: refuse to overwrite, write atomically, stage several outputs together.


def check_output(path: str | os.PathLike, overwrite: bool) -> Path:
  """An output path that may be written: its directory exists, and it does not unless
  `overwrite`. Raises FileExistsError / FileNotFoundError with the fix."""
  path = Path(path)
  if path.exists() and not overwrite:
    raise FileExistsError(f'{path} exists; pass --overwrite to replace it')
  parent = path.absolute().parent
  if parent.exists() and not parent.is_dir():
    raise NotADirectoryError(f'{parent} is a file, not a directory to write {path.name} in')
  if not parent.is_dir():
    raise FileNotFoundError(f'output directory {parent} does not exist')
  if not os.access(parent, os.W_OK):  # read-only or not ours: said now, not after solving
    raise PermissionError(f'output directory {parent} is not writable')
  return path


def write_npz_atomic(path: str | os.PathLike, arrays: dict, overwrite: bool = True) -> None:
  """`np.savez` written atomically (`io.atomic`), refusing an existing file unless
  `overwrite`."""
  atomic.write_npz(check_output(path, overwrite), arrays)


@contextlib.contextmanager
def staged(paths: Sequence[str | os.PathLike | None], overwrite: bool) -> Iterator[list]:
  """Yields a temp path per output (None stays None); on success each replaces its output,
  on any error all temps are removed and no output is touched. A temp keeps its output's
  suffix; a path without a suffix is a directory (created empty)."""
  outs = [None if p is None else check_output(p, overwrite) for p in paths]
  temps = []
  for p in outs:
    if p is None:
      temps.append(None)
    elif p.suffix:
      temps.append(atomic.temp_beside(p, p.suffix))
    else:
      _check_frames_dir(p)
      temps.append(Path(tempfile.mkdtemp(dir=p.absolute().parent, prefix=f'.{p.name}.')))
  try:
    yield temps
    for p, tmp in zip(outs, temps):
      if p is not None:
        _replace(tmp, p)
  finally:
    for tmp in temps:
      if tmp is not None and tmp.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
      elif tmp is not None:
        tmp.unlink(missing_ok=True)


def _check_frames_dir(path: Path) -> None:
  """A frames directory may be replaced only if it holds nothing but our frame PNGs."""
  if path.is_dir() and any(not re.fullmatch(r'frame_\d+\.png', q.name) for q in path.iterdir()):
    raise FileExistsError(f'{path} holds files other than frame_*.png; choose an empty or new '
                          'directory for the clip frames')
  if path.exists() and not path.is_dir():
    raise FileExistsError(f'{path} is a file; a clip without .gif is a directory of PNGs')


def _replace(tmp: Path, path: Path) -> None:
  if tmp.is_dir() and path.is_dir():
    shutil.rmtree(path)  # only frame PNGs (checked by _check_frames_dir)
  os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Readers.


@dataclasses.dataclass
class PositionsFile:
  """What a reader found. positions: `[T, J, 3]` (input units and axes unless `metres_rig`);
  offsets: `[J, 3]` in the positions' units and axes, or None; fps or None; metres_rig: already
  metres (a BVH read at its units; its axes are still the file's: `--input_axes` applies);
  end_sites: `[T, E, 3]` the rig leaves' End Sites of a BVH that has them (metres, rig axes, NaN =
  none; issue G2), else None; end_site_offsets: `[E, 3]` the same in each leaf's own frame
  (`retarget.end_site_offsets`: what an output BVH on the file's offsets writes). A BVH also gives
  bvh_orders: per rig joint the rotation channel order of its source joint
  (`source_rotation_orders`), bvh_units_m: metres per file unit it was read in, and reference:
  `[J, 3, 3]` the world frames (rig world) of its joints in the rig's natural pose where its joint
  map names one (`reference_pose`: its zero pose is another pose; `skeleton.with_reference_pose`),
  else None; None otherwise; first_dropped: the name of the joint map that left the file's first
  frame out (its T-pose frame: cgspeed CMU), else None; first_kept: the name of the joint map
  that would have, where the clip does not open with a pose of its own (cut from the middle of
  a file: `retarget.opens_with_its_own_pose`), else None; names: per rig joint the input's own
  name for it where the input names its joints (a BVH's source joint through its joint map, an
  npz's `joint_names`, a CSV header's), namespace included (`Anna:Hips`), else None; namespace:
  the one every name of the input carried ('' for none), which a BVH's `bvh_removed` joints
  lack (`output_names`)."""
  positions: np.ndarray
  offsets: np.ndarray | None = None
  fps: float | None = None
  metres_rig: bool = False
  end_sites: np.ndarray | None = None
  end_site_offsets: np.ndarray | None = None
  bvh_removed: tuple | None = None
  bvh_orders: tuple[str, ...] | None = None
  bvh_units_m: float | None = None
  reference: np.ndarray | None = None
  first_dropped: str | None = None
  first_kept: str | None = None
  names: tuple[str, ...] | None = None
  namespace: str = ''


JOINT_NAMES = ('input', 'rig')


def output_names(source: PositionsFile, rig: Rig, which: str = 'input'
                 ) -> tuple[tuple[str, ...] | None, tuple | None]:
  """(joint names of an output's rig joints or None for the rig's, the BVH's removed joints
  `source.bvh_removed` named to match): `which` 'input' names every joint as the input did (a
  BVH's own names and namespace, `Anna:Hips`, so a tool that binds animation to bones by name
  finds the input's skeleton), 'rig' as the rig does (the removed joints by their bare names)."""
  if which not in JOINT_NAMES:
    raise InputError(f'joint_names must be one of {", ".join(JOINT_NAMES)}, got {which!r}')
  removed = source.bvh_removed
  if which == 'rig' or source.names is None or (
      tuple(source.names) == tuple(rig.joint_names) and not source.namespace):
    return None, removed
  if removed is not None and source.namespace:  # removed[0] is the root's `()`
    removed = tuple(
        (tuple((source.namespace + name, *rest) for name, *rest in entry[0]), *entry[1:])
        if entry and entry[0] else entry for entry in removed)
  return tuple(source.names), removed


def read_positions(path: str | os.PathLike, rig: Rig, *, joint_map: str | None = None,
                   bvh_units: str | float | None = None, bvh_fps: float | None = None,
                   reference_pose: str | None = None) -> PositionsFile:
  """By extension: .npz, .csv, .bvh (module docstring); a BVH resampled to `bvh_fps`, its
  joint map's reference pose overridden by `reference_pose` ('zero' or 'first_frame')."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f'input {path} does not exist')
  ext = path.suffix.lower()
  if ext != '.bvh' and reference_pose not in (None, 'zero'):
    raise InputError(f'reference_pose {reference_pose!r} is read from a BVH input, not {ext}')
  if ext == '.npz':
    return read_positions_npz(path, rig)
  if ext == '.csv':
    table, names, space = _read_csv(path, rig)
    return PositionsFile(table, names=names, namespace=space)
  if ext == '.bvh':
    return read_bvh_clip(path, rig, joint_map=joint_map, units=bvh_units, fps=bvh_fps,
                         reference_pose=reference_pose)
  raise InputError(f'input {path}: unknown format {ext!r}; use .npz, .csv or .bvh')


def half_precision(dtype, what: str = 'positions') -> str | None:
  """The warning for `what` in `dtype` where it is float16: 11 significant bits, steps of
  about 1 mm at 1 m from the origin and 8 mm at 10 m, as much as a tracker's noise (the solver
  reads float32); None for other dtypes."""
  if np.dtype(dtype) != np.float16:
    return None
  return (f'{what} are float16: values are rounded to 11 significant bits (steps of 1 mm at 1 m '
          'from the origin, 8 mm at 10 m); store them as float32')


def _npz_fps(value, path) -> float:
  """An npz's `fps`: one positive finite number."""
  value = np.asarray(value)
  if value.size != 1 or value.dtype.kind not in 'iuf' or not (
      math.isfinite(float(value.ravel()[0])) and float(value.ravel()[0]) > 0):
    raise InputError(f'{path}: fps must be one positive frame rate, got '
                     f'{np.array2string(value, threshold=4)}')
  return float(value.ravel()[0])


def read_positions_npz(path: str | os.PathLike, rig: Rig) -> PositionsFile:
  if not zipfile.is_zipfile(path):  # np.load would try it as a pickle, and say so
    raise InputError(f'{path}: not an npz file (a zip of .npy arrays, as numpy.savez writes)')
  with np.load(path, allow_pickle=False) as z:
    keys = list(z.keys())
    key = 'positions' if 'positions' in keys else (keys[0] if len(keys) == 1 else None)
    if key is None:
      raise InputError(f'{path}: no `positions` array (keys: {", ".join(keys)})')
    pos = z[key]
    if half_precision(pos.dtype):
      warnings.warn(half_precision(pos.dtype, f'{path}: {key}'), stacklevel=3)
    pos = np.asarray(pos, np.float64)
    names = [str(n) for n in z['joint_names']] if 'joint_names' in keys else None
    fps = _npz_fps(z['fps'], path) if 'fps' in keys else None
    offsets = np.asarray(z['offsets'], np.float64) if 'offsets' in keys else None
  if names is None:
    return PositionsFile(pos, offsets, fps)
  order = _order_by_names(names, rig, f'{path}: joint_names')
  pos = pos[..., order, :] if pos.ndim >= 2 and pos.shape[-2] == len(names) else pos
  if offsets is not None and offsets.shape == (len(names), 3):
    offsets = offsets[order]
  return PositionsFile(pos, offsets, fps, names=tuple(names[k] for k in order),
                       namespace=bvh.namespace(names))


def _order_by_names(names: Sequence[str], rig: Rig, what: str) -> list[int]:
  space = bvh.namespace(names)  # 'Anna:Hips' -> 'Hips', as for a BVH's joints
  names = [n[len(space):] for n in names]
  missing = [n for n in rig.joint_names if n not in names]
  extra = [n for n in names if n not in rig.joint_names]
  if missing or extra:
    raise InputError(f'{what} do not match rig {rig.name!r}: missing {missing}, unknown {extra}')
  return [list(names).index(n) for n in rig.joint_names]


_CSV_MISSING = ('', 'NA', 'N/A')  # a missing value: an empty field (pandas), NA (R)


def _is_number(text: str) -> bool:
  try:
    float(text)
    return True
  except ValueError:
    return False


def _csv_separator(line: str) -> str | None:
  """A file's field separator, from its first row (its second where the first, a header, has
  none): a semicolon, else a tab, else a comma (so a
  semicolon- or tab-separated file may write decimal commas, as European locales do), else None
  (runs of whitespace)."""
  return next((sep for sep in (';', '\t', ',') if sep in line), None)


def _csv_fields(line: str, expected: int, sep: str | None) -> list[str]:
  """A row's fields split at `sep` (`_csv_separator`), keeping empty fields (missing values;
  one trailing separator dropped when the row then has `expected`), else at runs of
  whitespace; a decimal comma read as a point where the separator is not a comma."""
  text = line.strip()
  if sep is None:
    return text.split()
  fields = [f.strip() for f in text.split(sep)]
  if len(fields) == expected + 1 and fields[-1] == '':
    fields.pop()
  if sep != ',':
    fields = [f.replace(',', '.') if _is_number(f.replace(',', '.')) else f for f in fields]
  return fields


def read_positions_csv(path: str | os.PathLike, rig: Rig) -> np.ndarray:
  """`[T, J, 3]` from one frame per row (module docstring)."""
  return _read_csv(path, rig)[0]


def _read_csv(path: str | os.PathLike, rig: Rig
              ) -> tuple[np.ndarray, tuple[str, ...] | None, str]:
  """(`read_positions_csv`, the header's names of the rig's joints (namespace included) where
  it names them, else None, and the namespace they carry, '' for none)."""
  text = Path(path).read_text(encoding='utf-8-sig')  # Excel's "CSV UTF-8" opens with a BOM
  lines = [(i + 1, line) for i, line in enumerate(text.splitlines())
           if line.strip() and not line.lstrip().startswith('#')]
  if not lines:
    raise InputError(f'{path}: no rows')
  J = rig.num_joints
  header, order, width, names, space = None, None, 3 * J, None, ''
  sep = next((c for c in (_csv_separator(line) for _, line in lines[:2]) if c), None)
  first = _csv_fields(lines[0][1], width, sep)
  words = sum(f not in _CSV_MISSING and not _is_number(f) for f in first)
  counting = first in ([str(k) for k in range(len(first))],  # pandas' labels of unnamed
                       [str(k + 1) for k in range(len(first))])  # columns: 0, 1, 2, ...
  if words > sum(_is_number(f) for f in first) or (counting and len(first) > 3):  # a header
    header, lines = first, lines[1:]
    order, names, space = _header_order(header, rig, path)
    if order is not None:  # named columns: the others (an index, a time) are left out
      width = len(header)
  rows = []
  for lineno, line in lines:
    fields = _csv_fields(line, width, sep)
    if len(fields) != width:
      what = ('as many as the header names' if order is not None else
              f'x, y, z of the {J} joints of rig {rig.name!r} in order: '
              f'{", ".join(rig.joint_names)}')
      raise InputError(f'{path}:{lineno}: {len(fields)} columns, expected {width} ({what})')
    try:
      rows.append([math.nan if f in _CSV_MISSING else float(f) for f in fields])
    except ValueError:
      bad = next(f for f in fields if f not in _CSV_MISSING and not _is_number(f))
      raise InputError(f'{path}:{lineno}: {bad!r} is not a number') from None
  if not rows:
    raise InputError(f'{path}: a header but no frames')
  table = np.asarray(rows, np.float64)
  return (table if order is None else table[:, order]).reshape(len(rows), J, 3), names, space


def _header_order(header: list[str], rig: Rig, path
                  ) -> tuple[list[int] | None, tuple[str, ...] | None, str]:
  """(The header's columns of the rig's joints' x, y, z, in rig order, its names of the rig's
  joints, namespace included, and the namespace they carry) when it names them (`<rig
  joint>_<axis>`, the joint's name in any case; other fields, such as a pandas index or a time,
  are left out), else (None, None, ''): an opaque header, columns in rig order (a warning where
  it names other joints). A column named twice is refused."""
  parsed = [re.fullmatch(r'(.+?)[_.:]([xyzXYZ])', h) for h in header]
  space = bvh.namespace([m.group(1) for m in parsed if m])  # 'Anna:Hips_x': as a BVH's joints
  named = [(m.group(1)[len(space):], m.group(2).lower()) if m else None for m in parsed]
  folded = {n.casefold(): n for n in rig.joint_names}
  if len(folded) < rig.num_joints:  # names that differ only in case: they must match exactly
    folded = {}
  index, spelled = {}, {}
  for k, f in enumerate(named):
    joint = None if not f else f[0] if f[0] in rig.joint_names else folded.get(f[0].casefold())
    if joint is None:
      continue
    if (joint, f[1]) in index:
      raise InputError(f'{path}: the header names column {header[k]!r} twice (fields '
                       f'{index[(joint, f[1])] + 1} and {k + 1})')
    index[(joint, f[1])], spelled[joint] = k, space + f[0]
  if not index:
    others = sorted({f[0] for f in named if f})
    if len(others) >= 3:
      warnings.warn(f'{path}: the header names joints {", ".join(others[:4])}'
                    f'{" ..." if len(others) > 4 else ""}, none of rig {rig.name!r}\'s: its '
                    f'columns are read in the rig\'s joint order ({", ".join(rig.joint_names[:4])}'
                    ' ...)', stacklevel=4)
    return None, None, ''
  need = [(n, a) for n in rig.joint_names for a in 'xyz']
  missing = [f'{n}_{a}' for n, a in need if (n, a) not in index]
  if missing:
    raise InputError(f'{path}: header lacks columns {", ".join(missing[:6])}'
                     f'{" ..." if len(missing) > 6 else ""}')
  return [index[k] for k in need], tuple(spelled[n] for n in rig.joint_names), space


def _axis_name(v: Sequence[float]) -> str:
  k = int(np.argmax(np.abs(v)))
  return ('-' if v[k] < 0 else '+') + 'xyz'[k]


def bvh_joint_map(motion: bvh.BVHMotion, rig: Rig, joint_map: str | None = None,
                  units: str | float | None = None):
  """The `retarget.JointMap` that reduces `motion` to `rig`: `joint_map` if given; by name
  when the BVH's joints are exactly the rig's (a file this module wrote); else the rig's own
  joint map when the BVH has every joint it names (e.g. cgspeed CMU for cmu_body); else by
  name with the other subtrees pruned. `units` overrides the map's."""
  scale = parse_units(units) if units is not None else None
  if joint_map is not None:
    return retarget.load_joint_map(joint_map).with_overrides(units=scale)
  names = set(motion.names)
  if names != set(rig.joint_names):
    try:
      jmap = retarget.load_joint_map(rig.name)
    except ConversionError:
      jmap = None
    if jmap is not None and {s for s, _ in jmap.joints} | set(jmap.prune) <= names:
      return _with_extra_subtrees_pruned(motion, jmap).with_overrides(units=scale)
  if not set(rig.joint_names) <= names:
    partial = bvh.partial_namespace(motion.names)
    if partial:
      raise InputError(f'BVH {motion.path}: its joint names carry {partial}: give every joint '
                       'the same namespace, or none')
    raise InputError(f'BVH {motion.path} lacks joints {sorted(set(rig.joint_names) - names)[:6]}'
                     f' of rig {rig.name!r} and no joint map fits it: pass --joint_map=JSON '
                     '(ik_gat_jax/io/joint_maps/schema.json)')
  return _by_name_joint_map(motion, rig, scale)


def _unmapped_subtrees(motion: bvh.BVHMotion, kept: Sequence[str]) -> list[str]:
  """The tops of `motion`'s subtrees that hold none of the joints named `kept`."""
  index = {n: i for i, n in enumerate(motion.names)}
  keep = {index[n] for n in kept}
  live = lambda j: not keep.isdisjoint(depth_first_order(motion.parents, j))  # noqa: E731
  return [n for j, n in enumerate(motion.names)
          if not live(j) and motion.parents[j] >= 0 and live(motion.parents[j])]


def _with_extra_subtrees_pruned(motion: bvh.BVHMotion, jmap: retarget.JointMap):
  """The rig's own joint map, chosen for a file that has every joint it names, with the
  file's other subtrees that hold no mapped joint pruned too (a finger or a jaw more than
  the map's source has: the rig's joints do not depend on them), said in a warning."""
  pruned = {n for p in jmap.prune
            for n in (motion.names[j] for j in depth_first_order(
                motion.parents, list(motion.names).index(p)))}
  extra = [n for n in _unmapped_subtrees(motion, [s for s, _ in jmap.joints])
           if n not in pruned]
  if not extra:
    return jmap
  warnings.warn(f'BVH {motion.path}: joints {", ".join(extra[:6])}'
                f'{" ..." if len(extra) > 6 else ""} are not in joint map {jmap.name} and '
                'hold none of its joints: left out', stacklevel=3)
  return dataclasses.replace(jmap, prune=tuple(jmap.prune) + tuple(extra))


def _by_name_joint_map(motion: bvh.BVHMotion, rig: Rig, scale: float | None):
  prune = _unmapped_subtrees(motion, rig.joint_names)
  return retarget.JointMap(
      joints=tuple((n, n) for n in rig.joint_names), prune=tuple(prune),
      units=scale if scale is not None else BVH_UNITS[DEFAULT_BVH_UNITS],
      up=_axis_name(rig.up), forward=_axis_name(rig.forward), rig=rig.name, name='by name')


def read_bvh_clip(path: str | os.PathLike, rig: Rig, *, joint_map: str | None = None,
                  units: str | float | None = None, fps: float | None = None,
                  max_frames: int | None = None,
                  reference_pose: str | None = None,
                  rest_if_empty: bool = False) -> PositionsFile:
  """A BVH's joint positions `[T, J, 3]` and rest offsets `[J, 3]`, reduced to `rig` (metres,
  rig axes, verified FK); at `fps` (default: the file's own rate, no resampling). Where the
  joint map's `reference_pose` gives channel values of a natural pose other than the rig's, or
  `reference_pose` says 'first_frame' (this clip starts in it; 'zero': the zero pose is it),
  `reference` holds the joints' world frames in it (`PositionsFile`). `rest_if_empty`: a file
  of no frames (a skeleton definition, `Frames: 0`) reads as one frame of the rest pose (all
  channels zero; what `read_bvh_offsets` needs), instead of being refused."""
  if reference_pose not in (None,) + retarget.REFERENCE_POSES:
    raise InputError(f'reference_pose must be one of {", ".join(retarget.REFERENCE_POSES)}, '
                     f'got {reference_pose!r}')
  raw = bvh.read_bvh(path)
  motion = bvh.strip_namespace(raw)  # 'mocap:Hips' -> 'Hips' (io/bvh.py)
  jmap = bvh_joint_map(motion, rig, joint_map, units)
  if rest_if_empty and motion.num_frames == 0:
    motion = dataclasses.replace(motion, motion=np.zeros((1,) + motion.motion.shape[1:],
                                                         motion.motion.dtype))
    jmap = dataclasses.replace(jmap, drop_first_frame=False)
  space, source = bvh.namespace(raw.names), {r: src for src, r in jmap.joints}
  if reference_pose is not None or isinstance(jmap.reference_pose, str):
    # A joint map's 'first_frame' meant the first file of its conversion (the rig's reference
    # pose already), not this clip's first frame: only `reference_pose` says so of this clip.
    jmap = dataclasses.replace(jmap, reference_pose=reference_pose)
  # The joint map's T-pose frame (cgspeed CMU), where the clip opens with one (not one cut from
  # the middle of a file).
  kept = jmap.drop_first_frame and not retarget.opens_with_its_own_pose(motion, jmap.units)
  first = 1 if jmap.drop_first_frame and not kept else 0
  stop = None if max_frames is None else first + max_frames
  motion = dataclasses.replace(motion, motion=motion.motion[first:stop])
  if motion.num_frames < 1:
    raise InputError(f'{path}: no frames to solve' + (' (0 in the file: a skeleton definition)'
                                                      if raw.num_frames == 0 else '') + (
        f' (joint map {jmap.name} leaves out the first, a T-pose in its files; --joint_map for '
        'one that keeps it)' if first else ''))
  W = retarget.world_rotation(jmap.up, jmap.forward, rig.up, rig.forward)
  rate = retarget.source_fps(motion.frame_time)
  plan, out, G, p, _ = retarget.convert_motion(motion, jmap, W, fps or rate, rig.joint_names,
                                               rig.parents)
  try:
    F = retarget.reference_rotations(path, jmap, plan, W)
  except ConversionError as e:
    raise InputError(str(e)) from None
  if F is None and reference_pose == 'zero':  # said of this clip: against a rig that has one
    F = np.broadcast_to(np.eye(3), (rig.num_joints, 3, 3)).copy()
  if F is not None and retarget.rotation_angles_deg(
      np.swapaxes(rig.reference_rotations(), -1, -2) @ F).max() <= retarget.REFERENCE_TOL_DEG:
    F = None  # the rig's own natural pose
  return PositionsFile(p, out.offsets, fps or rate, metres_rig=True,
                       end_sites=retarget.end_sites_world(out, G, p, rig.parents),
                       end_site_offsets=retarget.end_site_offsets(out),
                       bvh_removed=removed_joints(motion, out),
                       bvh_orders=source_rotation_orders(motion, jmap, rig),
                       bvh_units_m=jmap.units, reference=F,
                       first_dropped=jmap.name if first else None,
                       first_kept=jmap.name if kept else None,
                       names=tuple(space + source.get(n, n) for n in rig.joint_names),
                       namespace=space)


def removed_joints(motion: bvh.BVHMotion, reduced: retarget.ReducedMotion) -> tuple | None:
  """Per rig joint, the file's joints the reduction removed between it and its rig parent,
  top-down, each `(name, offset [3] metres, constant rotation [3, 3], rotation order)` in the
  rig's axes, and the rig joint's own offset in the file (`ReducedMotion.removed`); None when
  the file had none (what `solution_bvh` writes back: the file's own hierarchy)."""
  if reduced.removed is None or not any(chain for chain, *_ in reduced.removed[1:]):
    return None

  def order(j: int) -> str:
    o = motion.euler_order(j)
    return o if sorted(o) == ['X', 'Y', 'Z'] else DEFAULT_BVH_ORDER

  return ((),) + tuple((tuple((motion.names[j], off, C, order(j)) for j, off, C in chain), own)
                       for chain, own in reduced.removed[1:])


def source_rotation_orders(motion: bvh.BVHMotion, jmap, rig: Rig) -> tuple[str, ...]:
  """Per rig joint: the rotation channel order (e.g. 'XZY') of the source joint `jmap` maps
  it from; `DEFAULT_BVH_ORDER` for a joint without a source or whose source has not three
  distinct rotation channels."""
  index = {n: i for i, n in enumerate(motion.names)}
  source = {r: s for s, r in jmap.joints}
  orders = []
  for name in rig.joint_names:
    j = index.get(source.get(name))
    order = motion.euler_order(j) if j is not None else ''
    orders.append(order if sorted(order) == ['X', 'Y', 'Z'] else DEFAULT_BVH_ORDER)
  return tuple(orders)


def read_bvh_offsets(path: str | os.PathLike, rig: Rig, *, joint_map: str | None = None,
                     units: str | float | None = None) -> np.ndarray:
  """A BVH subject's rest offsets `[J, 3]` reduced to `rig` (metres, rig axes)."""
  return read_bvh_clip(path, rig, joint_map=joint_map, units=units, max_frames=1,
                       rest_if_empty=True).offsets


# ----------------------------------------------------------------------------------------------
# Writers.


def solution_arrays(sol, rig: Rig, fps: float, extra: dict | None = None) -> dict:
  """The npz fields (module docstring) of a `solver.Solution`."""
  fps = check_frame_rate(fps)
  return {'local_rot': sol.local_rot, 'global_rot': sol.global_rot,
          'bone_aligned_rot': sol.bone_aligned_rot, 'positions_fk': sol.positions_fk,
          'positions': sol.positions, 'offsets': np.asarray(sol.offsets, np.float32),
          'bone_frames': np.asarray(sol.bone_frames, np.float32),
          'joint_names': np.asarray(rig.joint_names), 'parents': np.asarray(rig.parents),
          'fps': np.float32(fps), 'rig': np.asarray(json.dumps(rig.to_json())),
          **(extra or {})}


@functools.partial(jax.jit, static_argnums=1)
def _euler_degrees(R: jax.Array, order: str) -> jax.Array:
  # Angles of the nearest rotation (SVD): float32 solutions are off SO(3) by ~1e-7, where
  # `euler_from_matrix` alone lands on a rotation ~1e-7 from the nearest one.
  U, _, Vt = jnp.linalg.svd(R)
  flip = jnp.sign(jnp.linalg.det(U @ Vt))[..., None]
  R = jnp.concatenate([U[..., :2], U[..., 2:] * flip[..., None]], axis=-1) @ Vt
  return rotations.euler_from_matrix(R, order, degrees=True)


def euler_degrees(R: np.ndarray, order: str = DEFAULT_BVH_ORDER) -> np.ndarray:
  """`[..., 3, 3]` -> intrinsic angles in degrees `[..., 3]` in `order`, a permutation of 'XYZ'
  in BVH channel order ('ZYX': R = Rz Ry Rx), float64, of the rotation nearest each matrix
  (SVD; the same matrix for a rotation).

  Jitted over the flattened matrices padded to a power of two (few compiles for any T)."""
  R = np.asarray(R, np.float64)
  flat = R.reshape(-1, 3, 3)
  padded = padding.pad_rows(flat, padding.power_of_two(len(flat), 64), fill=np.eye(3))
  with jax.enable_x64(True):
    angles = np.asarray(_euler_degrees(jnp.asarray(padded, jnp.float64), order))
  return angles[:len(flat)].reshape(R.shape[:-2] + (3,))


def continuous_euler(angles: np.ndarray) -> np.ndarray:
  """`[T, ..., 3]` intrinsic Euler angles (degrees; any order, middle angle in [-90, 90] as
  `euler_degrees` gives them) -> the same rotations with each frame's angles the nearest to the
  previous frame's: of the two triples of a rotation, (a, b, c) and (a + 180, 180 - b, c + 180),
  the one whose change from the previous frame is smaller (summed over the three, each modulo
  360), then each angle unwrapped (`np.unwrap`, period 360), as Blender's BVH importer keeps
  them. Frame 0 keeps its own. Exact greedy choice, vectorised: both triples of a frame differ
  from both of the previous frame's by the same two amounts, so a frame switches triple
  relative to the previous one where its other triple is nearer, whatever came before."""
  a = np.asarray(angles, np.float64)
  if len(a) < 2:
    return a.copy()
  wrap = lambda x: (x + 180.0) % 360.0 - 180.0  # noqa: E731
  other = np.stack([a[..., 0] + 180.0, 180.0 - a[..., 1], a[..., 2] + 180.0], axis=-1)
  same = np.abs(wrap(np.diff(a, axis=0))).sum(-1)
  switch = np.abs(wrap(other[1:] - a[:-1])).sum(-1) < same
  odd = np.concatenate([np.zeros_like(switch[:1]), np.cumsum(switch, axis=0) % 2 == 1])
  chosen = np.where(odd[..., None], other, a)
  return np.unwrap(chosen, period=360.0, axis=0)


def euler_degrees_per_joint(R: np.ndarray, orders: Sequence[str]) -> np.ndarray:
  """`R [T, J, 3, 3]` -> `[T, J, 3]` degrees, joint j in `orders[j]` (`euler_degrees`); one
  conversion per distinct order, over the joints that use it."""
  R = np.asarray(R, np.float64)
  out = np.empty(R.shape[:-1])
  for order in sorted(set(orders)):
    cols = [j for j, o in enumerate(orders) if o == order]
    out[:, cols] = euler_degrees(R[:, cols], order)
  return out


def bvh_metres_per_unit(units: str | float | None) -> float:
  """Metres per file unit of an output BVH: a number or a `units.UNITS` name; None: cm."""
  try:
    return parse_units(DEFAULT_BVH_UNITS if units is None else units)
  except InputError:
    raise InputError(f'BVH units must be metres per file unit (a positive number) or one of '
                     f'{", ".join(UNITS)}, got {units!r}') from None


def check_rotation_orders(orders: Sequence[str] | None, rig: Rig) -> tuple[str, ...]:
  """Per rig joint rotation channel orders (upper case), `DEFAULT_BVH_ORDER` for all when None;
  each must be a permutation of XYZ."""
  if orders is None:
    return (DEFAULT_BVH_ORDER,) * rig.num_joints
  orders = tuple(str(o).upper() for o in orders)
  bad = [o for o in orders if sorted(o) != ['X', 'Y', 'Z']]
  if len(orders) != rig.num_joints or bad:
    raise InputError(f'BVH rotation orders must be {rig.num_joints} permutations of XYZ (one per '
                     f'joint of rig {rig.name!r}), got {len(orders)} with {bad[:3] or "none"} bad')
  return orders


def solution_bvh(local_rot: np.ndarray, root_pos: np.ndarray, offsets: np.ndarray, rig: Rig,
                 fps: float, units: str | float = DEFAULT_BVH_UNITS,
                 orders: Sequence[str] | None = None,
                 end_sites: np.ndarray | None = None,
                 removed: tuple | None = None,
                 names: Sequence[str] | None = None) -> bvh.BVHMotion:
  """The rig animated by `local_rot [T, J, 3, 3]`, root at `root_pos [T, 3]` (metres), on
  `offsets [J, 3]` (metres), in `units` (metres per file unit or a name: 'cm', 'm', 'inch',
  ...), joint j's rotation channels in `orders[j]` (rig order, e.g. 'XZY'; default ZYX).
  `end_sites [E, 3]`: each rig leaf's End Site (`rig.leaves` order, metres, in the leaf's own
  frame; an input BVH's `PositionsFile.end_site_offsets`); a NaN row, or None, gets the
  writer's own: half the leaf's bone along its rest direction, at least 2 cm. `removed`: an
  input BVH's joints its reduction removed (`PositionsFile.bvh_removed`, on the input's own
  offsets): written back between their rig joints with their constant rotations, so the file
  has the input's hierarchy (less its pruned subtrees) and its joints the input's rotations.
  `names`: the rig joints' names in the file (default the rig's; `output_names`).

  The root's OFFSET is 0 0 0 and its position channels its world position: readers that add
  the root's OFFSET to them (three.js's BVHLoader) and those that do not (Blender, Assimp, this
  package) put it in the same place. The angles are continuous over time (`continuous_euler`),
  so a tool that interpolates channels does not spin a joint between frames."""
  fps = check_frame_rate(fps)
  k = 1.0 / bvh_metres_per_unit(units)
  orders = check_rotation_orders(orders, rig)
  try:
    names = check_joint_names(names, rig)
  except RigError as e:
    raise InputError(str(e)) from None
  local_rot = np.asarray(local_rot)
  T = local_rot.shape[0]
  ends = _end_sites(offsets, rig, end_sites)
  # Output nodes: ('rig', j) for the rig's joints, ('src', name) for removed ones written back.
  parent, kids = {}, {}
  spec = {}  # node -> (name, offset metres or None, rotations [T, 3, 3], order, End Site)
  for j in depth_first_order(rig.parents):
    p = rig.parents[j]
    chain, own = (removed[j] if removed is not None and j > 0 else ((), None))
    above, C = ('rig', p) if p >= 0 else None, np.eye(3)
    for name, off, Cj, order in chain:
      node = ('src', name)
      if node not in spec:
        parent[node] = above
        kids.setdefault(above, []).append(node)
        spec[node] = (name, np.asarray(off, np.float64), np.broadcast_to(Cj, (T, 3, 3)), order,
                      None)
      above, C = node, C @ np.asarray(Cj, np.float64)
    parent[('rig', j)] = above
    kids.setdefault(above, []).append(('rig', j))
    R = local_rot[:, j] if not chain else np.swapaxes(C, -1, -2) @ local_rot[:, j]
    off = (None if p < 0 else np.asarray(own if chain else offsets[j], np.float64))
    spec[('rig', j)] = (names[j], off, R, orders[j], ends[j])
  nodes, stack = [], [('rig', 0)]
  while stack:  # depth first: every node's subtree contiguous
    node = stack.pop()
    nodes.append(node)
    stack.extend(reversed(kids.get(node, [])))
  index = {node: i for i, node in enumerate(nodes)}
  joints = []
  for node in nodes:
    name, off, _, order, end = spec[node]
    channels = ((bvh.POSITION_CHANNELS if parent[node] is None else ()) +
                tuple(f'{axis}rotation' for axis in order))
    joints.append(bvh.BVHJoint(
        name=name, parent=-1 if parent[node] is None else index[parent[node]],
        offset=np.zeros(3) if off is None else _float32_digits(off * k),  # root: channels say it
        channels=channels, end_site=None if end is None else _float32_digits(end * k)))
  R = np.stack([np.asarray(spec[node][2], np.float64) for node in nodes], axis=1)
  angles = continuous_euler(euler_degrees_per_joint(R, [spec[node][3] for node in nodes]))
  motion = np.concatenate([np.asarray(root_pos, np.float64) * k,
                           angles.reshape(len(angles), -1)], axis=1)
  return bvh.BVHMotion(joints=joints, frame_time=1.0 / fps, motion=motion)


def _float32_digits(values: np.ndarray) -> np.ndarray:
  """`values` to 9 significant digits, all a float32 carries (the solution's offsets are
  float32): a file's `OFFSET 1.43168` comes back as 1.43168, not 1.4316800000000003 after the
  units' round trip."""
  return np.array([float(f'{v:.9g}') for v in np.ravel(values)]).reshape(np.shape(values))


def _end_sites(offsets: np.ndarray, rig: Rig,
               given: np.ndarray | None = None) -> list[np.ndarray | None]:
  """Per joint: an End Site offset (metres) for leaves: `given [E, 3]`'s row for the leaf where
  finite, else along the leaf's rest direction."""
  if given is not None:
    given = np.asarray(given, np.float64)
    if given.shape != (len(rig.leaves), 3):
      raise InputError(f'end sites must be [{len(rig.leaves)}, 3] (one per leaf of rig '
                       f'{rig.name!r}), got {list(given.shape)}')
  d = np.asarray(bone_frames_lib.rest_bone_directions(jnp.asarray(offsets, jnp.float32), rig))
  row = {k: e for e, k in enumerate(rig.leaves)}
  out = []
  for j, kids in enumerate(rig.children):
    length = max(0.5 * float(np.linalg.norm(offsets[j])), _END_SITE_MIN_M)
    own = None if given is None or kids else given[row[j]]
    out.append(None if kids else own if own is not None and np.isfinite(own).all()
               else d[j].astype(np.float64) * length)
  return out


def write_solution_bvh(path: str | os.PathLike, sol, rig: Rig, fps: float,
                       units: str | float = DEFAULT_BVH_UNITS, overwrite: bool = True,
                       orders: Sequence[str] | None = None,
                       end_sites: np.ndarray | None = None,
                       removed: tuple | None = None,
                       names: Sequence[str] | None = None) -> None:
  """`solution_bvh` of a `solver.Solution` (units, per-joint rotation orders, the leaves' End
  Sites, the input's removed joints written back, the joints' names), written atomically."""
  path = check_output(path, overwrite)
  motion = solution_bvh(sol.local_rot, sol.positions_fk[:, 0], sol.offsets, rig, fps, units,
                        orders, end_sites, removed, names)
  bvh.write_bvh(path, motion)


def write_smpl_npz(path: str | os.PathLike, sol, rig: Rig, fps: float,
                   overwrite: bool = True, world: str = 'rig') -> None:
  """`io.smpl.smpl_arrays` of a `solver.Solution`, written atomically."""
  fps = check_frame_rate(fps)
  write_npz_atomic(path, smpl.smpl_arrays(sol, rig, fps, world), overwrite)


def write_solution_glb(path: str | os.PathLike, sol, rig: Rig, fps: float,
                       overwrite: bool = True, names: Sequence[str] | None = None) -> None:
  """`io.gltf.solution_glb` of a `solver.Solution` (glTF 2.0 binary), written atomically;
  `names` the nodes' names (default the rig's joint names), as for `write_solution_fbx`."""
  gltf.write_solution_glb(check_output(path, overwrite), sol, rig, fps, overwrite=True,
                          names=names)


def write_solution_fbx(path: str | os.PathLike, sol, rig: Rig, fps: float,
                       overwrite: bool = True, names: Sequence[str] | None = None) -> None:
  """FBX of a `solver.Solution` (module docstring): the GLB written to a temporary folder,
  converted by headless Blender into a temp file beside `path`, then renamed into place. Raises
  `blender.BlenderMissing` without Blender and `blender.BlenderError` when it fails or passes
  `blender.timeout_s(frames)`; `path` is untouched then."""
  path = check_output(path, overwrite)
  exe = blender.require_blender('FBX output')
  names = list(rig.joint_names if names is None else names)
  whole, _ = blender.fps_setting(fps)
  with tempfile.TemporaryDirectory(prefix='ik_gat_fbx_') as tmp:
    glb = Path(tmp) / f'{path.stem}.glb'
    glb.write_bytes(gltf.solution_glb(sol, rig, whole, names))  # keys on whole frames
    with atomic.atomic_path(path, '.fbx') as out:
      blender.glb_to_fbx(glb, out, fps, sol.num_frames, names, blender=exe)
