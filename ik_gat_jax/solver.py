"""IKSolver: a trained checkpoint as a product. Joint positions in, joint rotations out.

  solver = IKSolver.from_checkpoint()        # the shipped default, or a run / checkpoint dir
  local = solver.solve(positions)             # [T, J, 3] -> [T, J, 3, 3]; [J, 3] -> [J, 3, 3]
  sol = solver.solve(positions, full=True)    # + global, bone-aligned Q, FK positions
  R = solver.step(frame)                      # one live frame, compiled once
  solver.reset()                              # forget the temporal filter's stream state
  stats = solver.latency_stats(n=200)         # single-frame median / p99 ms

Frames and units (DESIGN section 2): positions are world joint positions `p_world_joint` in the
rig's joint order, in metres, in the rig's world axes (`rig.up`, `rig.forward`); `units` and
`input_axes` convert other data first. Outputs: `local_rot` R_j (parent-relative; the root's is
its world rotation), `global_rot` G_j (world), `bone_aligned_rot` Q_j = G_j @ B_j (world),
`positions_fk` = FK of R on the subject's rest offsets with the root at the input root (refined
solutions: at the refinement's fitted root, the input root moved by the mean residual over the
joints, `iterative_ik.SolverConfig.fit_translation`; the exports' root follows it).

Offsets. R is relative to one subject's rest offsets `o_j` (metres, each in its parent's frame):
given, read from a BVH, or the checkpoint rig's template; `estimate_lengths=True` keeps their
directions and takes each bone's length from the input (median over frames; directions never
come from the input, which shows a posed body). The bone frames B come from these offsets, so
the output BVH, written with exactly these offsets, reproduces `positions_fk`. Without the
subject's offsets the rotations are relative to the template's rest pose, whose bones point a
few degrees from the subject's, so FK on the template misses the input (20 mm on clean CMU val);
`fit_offsets=True` (`full=True` only) then replaces the offsets after solving by the ones the
solved rotations imply, `o_j = mean_t G_p,t^T (x_j,t - x_p,t)` (`fitted_offsets`): the rotations
stay as they are, every bone vector is nearest the input's on average, and the output skeleton
reproduces the input (1.4 mm; BENCHMARKS.md "Without the subject's offsets"). Offsets given
to `solve` are in the positions' units and axes (`units`, `input_axes` convert both).

Size (`size_normalization`, default on): the network sees each body scaled to the template's
size (`inference.size_scale`: from the offsets, or each frame's bones where they are the
template's); outputs keep the input's size, and any scale of a body gives the same rotations.

Compilation. One jitted forward (model merged, deterministic) over `[b, J, 3]` with b a bucket:
1, 2, 4, ... up to `block_size` (a power-of-two ladder, ending at `block_size`). A batch is
padded (by repeating its last frame) to its bucket, so a live stream of single frames or small
batches compiles at most once per bucket. A clip runs in chunks of at most `block_size` (device
memory bounded by `workers` chunks), with a progress bar on stderr when longer than that. On the
CPU the network runs a batch in blocks of 32 (`inference.micro_batch_size()`), and a clip of more
than one block is cut at block boundaries into as few chunks as fit, their number a multiple of
`workers`, the blocks shared out evenly (`IKSolver._chunk_plan`); every chunk runs in the
`block_size` bucket, whose forward skips the blocks of its padding (`num_valid`): any clip
length needs one compiled shape and computes at most one block of padding, and the `workers`
threads (`default_workers()`: the usable cores, up to MAX_WORKERS) get equal work (before this,
a 5,133-frame clip computed 6,144 frames, 3 chunks of 1,024 on one thread against 2 and 14 frames
on the other). The same outputs, 1.3x the frames/s on 2 cores. On an accelerator, with a
refinement (which runs on a chunk's every frame) or with `block_size` at most one block: chunks
of `block_size`, or one per worker for a clip shorter than workers x block_size, the last in its
own bucket when that is compiled already, else padded to a whole chunk, so a long clip never
compiles a second shape (0.3 s from the persistent cache, seconds without).
Each shape is compiled ahead (`lower().compile()`) once per process, the model's state an
argument (one copy of the weights for every shape): solvers of the same model structure,
configuration and shapes share their executables (`_ExecutableCache`; a second solver of the
shipped model solves its first frame in 0.01 s, not 2; `clear_executables()` forgets them);
`step` on the solver's own subject (`offsets`, which is read-only: assign new offsets to
change it) has an executable of its own with the model's state and the subject compiled in as
constants, so its call passes the frame alone (the base model's 23 weight arrays and the
subject as arguments were 0.05 ms of a live frame). After the command line's
`compile_cache.enable()`, a shape compiled by an earlier run is loaded whole from the
executable cache (compile_cache.py; `step`'s entry is keyed by what it compiles in), neither
traced nor lowered. With bfloat16 products (`matmul_precision`,
`model.set_matmul_precision`) every executable compiles with their XLA options
(`inference.compiler_options`: XLA's YNNPACK dots on the CPU).

Input checks (`check_positions`, `check_plausibility`): wrong shape or joint count and NaN/inf
raise `InputError` (a ValueError) naming the expected joints or the frame and joint; bone
lengths 4x (or under a quarter of) the template's, a head below the pelvis on average and a
mirrored body warn with the
likely fix (`--units`, `--input_axes`), attributed to the caller's line; a single frame's
kind of warning is said once per solver (a live loop calling `solve`); float16 positions
warn that they carry 1 mm steps at 1 m (`exports.half_precision`), once per solver. `step` and
`solve_stream` run the cheap hard checks (shape, finite) on every frame and the warnings on a
stream's first whole frame only (after `reset()`: `_check_stream`). Offsets whose bones are 4x
the template's or under a quarter are refused (`check_offsets_size`).

Sparse inputs (issue G2). A checkpoint trained with `joint_mask` takes missing joints: `mask
[T, J]` (1 = observed) and/or NaN joints in the positions (read as missing); one trained with
`orientation_inputs` takes `orientations [T, J, 3, 3]` (world rotations G_j in the rig's axes;
`orientation_mask [T, J]`, default all given; only its `orientation_inputs` joints are used).
A checkpoint trained with `end_sites` takes `end_sites [T, E, 3]` (world points of the rig's
leaves `rig.leaves`: head top, hand and toe tips; same units and axes as the positions; NaN =
not given).
A checkpoint without them refuses a mask, NaN joints, orientations or end sites with `InputError`,
unless the solver holds missing joints (`hold_missing=True`, `--hold_missing`): a tracker's
dropout then keeps the joint's last seen offset from the root, moved with the root, in clips and
streams alike (`hold_missing_joints`; a joint must have been seen once).
With missing joints the plausibility warnings are skipped, `estimate_lengths` and refinement
refuse, and `positions_fk` is NaN in frames whose root is missing (FK starts at the root).

Window models (issue K, `ModelConfig.window` k > 1): the network sees each frame with its k-1
past frames, 1 / `window_fps` s apart (at another `fps` the past frames are interpolated;
`windows.py`). `solve` builds the windows of the clip; `step` and `solve_stream` keep the past
frames as stream state, so a stream and the same frames as a clip get the same windows; the
first frames of a clip or a stream (after `reset()`) see copies of its first frame in place of
the frames before it. The output at frame t depends on frames <= t only; `refine_iters`
refines each frame's window solution against that frame's points (per frame, so still causal).

Temporal filter (issue G3, `temporal.py`). `temporal_filter` (a `temporal.FilterConfig`; default
the checkpoint config's `temporal` section, none for the shipped checkpoint) smooths the local
rotations causally at `fps`: `solve` filters each clip from a fresh state (FK outputs recomputed
from the filtered rotations), while `step` and `solve_stream` carry the filter state from call
to call, one live stream, until `reset()`. Setting `solver.temporal_filter` or `solver.fps`
starts a new stream with the new setting (`step` included).
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import functools
import hashlib
import math
import os
import re
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ik_gat_jax import bone_frames as bone_frames_lib
from ik_gat_jax import compile_cache
from ik_gat_jax import gat
from ik_gat_jax import inference
from ik_gat_jax import iterative_ik
from ik_gat_jax import kinematics
from ik_gat_jax import model as model_lib
from ik_gat_jax import padding
from ik_gat_jax import prior_task
from ik_gat_jax import skeleton
from ik_gat_jax import subject_calibration as subject_calibration_lib
from ik_gat_jax import temporal
from ik_gat_jax import vposer
from ik_gat_jax import windows
from ik_gat_jax.errors import CheckpointError, InputError  # noqa: F401  (also solver.InputError)
from ik_gat_jax.io import exports
from ik_gat_jax.io.units import UNITS, parse_units  # noqa: F401  (also solver.parse_units)
from ik_gat_jax.skeleton import BUILTIN_RIGS, Rig, RigError, get_rig, rest_positions_np

DEFAULT_BLOCK = 1024
# Most threads `default_workers` gives a clip's chunks (measured on 2 cores only; BENCHMARKS.md).
MAX_WORKERS = 4
# Signed axis maps of common engines onto a right-handed, y-up, z-forward, x-left world (the
# built-in rigs' world): Unity is y-up, z-forward, left-handed (x = the body's right);
# Unreal is z-up, x-forward, y-right, left-handed (and in centimetres: --units=cm).
AXIS_PRESETS = {'unity': '-x,y,z', 'unreal': '-y,z,x'}
_UNIT_WARN_RATIO = 4.0  # median bone length this far from the template's: likely units problem
_UNIT_MATCH_RATIO = 1.15  # with default units, this near another unit's ratio: that unit
# A subject's rest pose is another one than the model's beyond these (skeleton.py).
REST_POSE_WARN_DEG = skeleton.REST_POSE_WARN_DEG
_REST_BONE_WARN_DEG = skeleton.REST_BONE_WARN_DEG
# The units a plausibility warning may name (the hint's candidates, in this order).
_UNIT_LABELS = {'m': 'metres', 'cm': 'centimetres', 'mm': 'millimetres', 'inch': 'inches',
                'in': 'inches', 'ft': 'feet', 'cmu': 'CMU\'s units (0.056444 m; this project\'s '
                'BVH of a CMU file too)'}
# A human's bones, as a multiple of the template's, that a units hint names a unit for (a child
# to a tall adult); outside it, the number that would make the body the template's size.
_HINT_SIZES = (0.5, 1.5)


# ----------------------------------------------------------------------------------------------
# Units and axes.


def parse_input_axes(spec: str | np.ndarray | None, rig: Rig | None = None) -> np.ndarray:
  """`M [3, 3]` with `p_rig = M @ p_input`.

  `spec` 'a,b,c' names, for rig axes x, y, z in turn, the signed input column each takes:
  'x,z,-y' means rig x = input x, rig y = input z, rig z = -input y (z-up data into a y-up
  rig). A reflection (det -1, left-handed engines) is allowed. Presets 'unity' and 'unreal' map
  those engines' conventions onto a y-up, z-forward, x-left world and then onto `rig`'s
  up/forward. None: identity.
  """
  if spec is None:
    return np.eye(3)
  if not isinstance(spec, str):
    try:
      M = np.asarray(spec, np.float64)
    except (TypeError, ValueError):
      raise InputError(f'input_axes must be a signed permutation matrix [3, 3] or a string like '
                       f"'x,z,-y', got {spec!r:.80}") from None
    # A preset's matrix on a rig whose axes are not the principal ones is a signed permutation
    # in the rig's canonical frame (`_canonical_to_rig`, identity for the built-in rigs).
    if M.shape != (3, 3) or not (_is_signed_permutation(M) or _is_signed_permutation(
        _canonical_to_rig(rig).T @ M)):
      got = np.round(M, 4).tolist() if M.shape == (3, 3) else f'shape {M.shape}'
      raise InputError('input_axes must be a signed permutation matrix [3, 3] (one entry +-1 per '
                       f'row and column, the rest 0), got {got}')
    return M
  key = spec.strip().lower()
  if key in AXIS_PRESETS:
    return _canonical_to_rig(rig) @ parse_input_axes(AXIS_PRESETS[key])
  parts = [p.strip() for p in key.split(',')]
  if len(parts) != 3 or not all(re.fullmatch(r'[+-]?[xyz]', p) for p in parts):
    raise InputError(f"--input_axes must be three signed axes like 'x,z,-y' (or one of "
                     f"{', '.join(AXIS_PRESETS)}), got {spec!r}")
  if sorted(p[-1] for p in parts) != ['x', 'y', 'z']:
    raise InputError(f'--input_axes must use each of x, y, z once, got {spec!r}')
  M = np.zeros((3, 3))
  for row, p in enumerate(parts):
    M[row, 'xyz'.index(p[-1])] = -1.0 if p.startswith('-') else 1.0
  return M


def _is_signed_permutation(M: np.ndarray) -> bool:
  """One entry +-1 per row and column, the rest 0 (a rotation by other than a multiple of 90
  degrees is orthogonal too, but not an axis map)."""
  A = np.abs(M)
  return bool(np.all(np.isclose(A, 0, atol=1e-6) | np.isclose(A, 1, atol=1e-6))
              and np.allclose(A.sum(0), 1) and np.allclose(A.sum(1), 1))


def _canonical_to_rig(rig: Rig | None) -> np.ndarray:
  """Rotation from the y-up, z-forward, x-left world to `rig`'s (identity for the built-ins)."""
  if rig is None:
    return np.eye(3)
  up, fw = np.asarray(rig.up), np.asarray(rig.forward)
  return np.stack([np.cross(up, fw), up, fw], axis=1)  # columns: images of x, y, z


def axes_text(M: np.ndarray) -> str:
  """The 'a,b,c' spelling of a signed permutation matrix."""
  out = []
  for row in M:
    k = int(np.argmax(np.abs(row)))
    out.append(('-' if row[k] < 0 else '') + 'xyz'[k])
  return ','.join(out)


# ----------------------------------------------------------------------------------------------
# Input checks.


def check_positions(positions, rig: Rig, allow_missing: bool = False,
                    said: set[str] | None = None) -> tuple[np.ndarray, bool]:
  """Shape and finiteness: `[T, J, 3]` or `[J, 3]` -> (`[T, J, 3]` float64, was_single_frame).
  `allow_missing`: NaN/inf joints pass (a model with joint masks reads them as missing).
  float16 positions warn (`exports.half_precision`), attributed to the caller's line; with
  `said` (a set the caller keeps: a solver's), once."""
  try:
    arr = np.asarray(positions)
    if arr.dtype.kind not in 'iuf':  # no strings parsed, no imaginary parts dropped
      raise TypeError(f'positions are {arr.dtype} values, not real numbers')
    if arr.dtype == np.float16 and (said is None or 'float16' not in said):
      warn_caller(exports.half_precision(arr.dtype))
      if said is not None:
        said.add('float16')
    arr = arr.astype(np.float64, copy=False)
  except (TypeError, ValueError) as e:
    raise InputError(f'positions are not a numeric array: {e}') from None
  J = rig.num_joints
  single = arr.ndim == 2
  if arr.ndim not in (2, 3) or arr.shape[-1] != 3 or arr.shape[-2] != J:
    got = (f'{arr.shape[-2]} joints' if arr.ndim in (2, 3) and arr.shape[-1] == 3
           else f'shape {arr.shape}')
    raise InputError(f'expected positions [T, {J}, 3] or [{J}, 3] in the joint order of rig '
                     f'{rig.name!r} ({", ".join(rig.joint_names)}); got {got}')
  arr = arr[None] if single else arr
  if arr.shape[0] == 0:
    raise InputError('no frames to solve (positions have T = 0)')
  if not allow_missing:
    check_finite(arr, rig)
  return arr, single


_PY_SUM_UNTIL = 1024  # all_finite: arrays up to this size are summed as Python floats


def all_finite(arr: np.ndarray) -> bool:
  """`np.isfinite(arr).all()`; a live frame's few values summed as Python floats instead. A
  numpy reduction (`all`, `any`, `sum`, `max`) between two live frames costs the next compiled
  call about 10 us more than the reduction itself (pinned, BENCHMARKS.md issue N session 29),
  four of them a third of `step`'s Python. A finite sum means every value is finite (NaN and inf
  carry through it; inf - inf is NaN); a sum that overflows falls back to numpy."""
  if arr.size <= _PY_SUM_UNTIL and math.isfinite(sum(arr.ravel().tolist())):
    return True
  return bool(np.isfinite(arr).all())


def check_finite(arr: np.ndarray, rig: Rig, what: str = 'positions') -> None:
  """Raises naming the first non-finite frame and joint of `arr [T, J, 3]`."""
  if all_finite(arr):
    return
  bad = ~np.isfinite(arr).all(axis=-1)
  if bad.any():
    t, j = (int(i[0]) for i in np.nonzero(bad))
    never = [rig.joint_names[k] for k in np.nonzero(bad.all(axis=0))[0]]
    hint = ('fill or drop those frames first, or hold them from earlier frames '
            '(hold_missing=True, --hold_missing); a tracker subset needs a checkpoint trained '
            'with joint masks (config.model.joint_mask=True, --trackers)')
    if never and len(arr) > 1:  # the same joints missing in every frame: trackers, not dropouts
      hint = (f'{", ".join(never[:4])}{" ..." if len(never) > 4 else ""} missing in every '
              'frame: a tracker subset needs a checkpoint trained with joint masks '
              '(config.model.joint_mask=True, --trackers); this one needs every joint')
    raise InputError(f'{what} contain NaN/inf: frame {t}, joint {j} ({rig.joint_names[j]}) is '
                     f'{arr[t, j].tolist()} ({int(bad.sum())} bad joint entries in '
                     f'{int(bad.any(-1).sum())} frames); {hint}')


_ORIGIN_GRID_M = 64.0  # `near_origin` moves frames by multiples of this


_MAX_ABS_M = 1e7  # positions this far from the origin (metres) are refused: wrong units


def check_extent(arr: np.ndarray) -> None:
  """Refuses positions `[T, J, 3]` (metres, rig axes) with a finite coordinate of
  `_MAX_ABS_M` or more (10,000 km; NaN and inf are missing joints, judged elsewhere): beyond
  float32's reach in the network and in the outputs, and no body is there (a units or a
  sensor fault)."""
  if arr.size <= _PY_SUM_UNTIL:  # a live frame: Python floats first, as `all_finite`
    vals = arr.ravel().tolist()
    if max(vals) < _MAX_ABS_M and min(vals) > -_MAX_ABS_M:
      return
  with np.errstate(invalid='ignore'):
    far = (np.isfinite(arr) & (np.abs(arr) >= _MAX_ABS_M)).any(-1)
  if far.any():
    t, j = (int(i[0]) for i in np.nonzero(far))
    raise InputError(f'positions reach {_MAX_ABS_M:g} m or more from the origin (frame {t}, '
                     f'joint {j}: {arr[t, j].tolist()}): wrong units (--units) or a sensor '
                     'fault?')


def near_origin(pos: np.ndarray, sparse: dict | None = None
                ) -> tuple[np.ndarray, dict | None, np.ndarray | None]:
  """`pos [T, J, 3]` (metres, float64) with each frame moved by the multiple of 64 m nearest
  its root (per axis), its sparse inputs' end sites with it -> (pos, sparse, shift `[T, 1, 3]`
  or None when no frame moved). The network is translation-invariant but float32: a body 10 km
  from the origin would keep 1 mm of its coordinates and its rotations would be off by up to
  1.4 degrees, so it sees every frame within 32 m of the origin, in float64 first. Frames whose
  root is within 32 m already (or missing) are unchanged, bit for bit; add `shift` back to
  positions the network returns."""
  if len(pos) == 1:  # a live frame: Python floats (a numpy reduction costs the next call)
    if not any(abs(v) >= 0.5 * _ORIGIN_GRID_M for v in pos[0, 0].tolist()):  # NaN: kept
      return pos, sparse, None
  elif not (np.abs(pos[:, 0]) >= 0.5 * _ORIGIN_GRID_M).any():
    return pos, sparse, None
  root = pos[:, :1]
  shift = np.round(root / _ORIGIN_GRID_M) * _ORIGIN_GRID_M
  shift = np.where(np.isfinite(shift), shift, 0.0)
  if sparse is not None and 'end_sites' in sparse:
    given = sparse['end_site_mask'][..., None]
    sparse = {**sparse, 'end_sites': np.where(given, sparse['end_sites'] - shift, 0.0).astype(
        sparse['end_sites'].dtype)}
  return pos - shift, sparse, shift


def hold_missing_joints(pos: np.ndarray, held: tuple | None, rig: Rig
                        ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
  """Tracker dropouts filled causally: in `pos [T, J, 3]` a joint with a NaN/inf coordinate
  keeps its offset from the root at the last frame that had it, moved with the root (`p_j(t) =
  root(t) + p_j(s) - root(s)`). A missing root moves with its children (the pelvis's: hips and
  lower spine, `rig.children[0]`): it keeps its offset from the mean of those seen both now and
  at the root's last sighting, so a walker whose pelvis tracker drops out still walks; with
  none of them seen, it stays where it was. `held`: the state after the frames before `pos` (a
  stream's: `(root [3], offsets from the root [J, 3], the root and its children where last
  seen with the root [3], [K, 3])`), or None at a stream's start. Returns the filled copy
  (observed joints bit for bit) and the state after it. Each frame depends only on it and
  earlier ones, computed the same way whether the frames come one by one or as a clip, so a
  stream and a clip are filled bit for bit alike. Raises InputError when a joint is missing
  before it was ever seen."""
  ok = np.isfinite(pos).all(axis=-1)  # [T, J]
  T, J = ok.shape
  kids = list(rig.children[0])
  if ok.all():  # the common case: nothing to fill, only the state (the same numbers)
    return pos, (pos[-1, 0].copy(), pos[-1] - pos[-1, 0], pos[-1, 0].copy(), pos[-1, kids])
  seen = np.maximum.accumulate(np.where(ok, np.arange(T)[:, None], -1), axis=0)  # [T, J]
  if held is None and (seen < 0).any():
    t, j = (int(i[0]) for i in np.nonzero(seen < 0))
    raise InputError(f'joint {j} ({rig.joint_names[j]}) is missing (NaN/inf) in frame {t} and '
                     'was not seen before it: hold_missing fills a joint only from an earlier '
                     'frame; start the stream on a frame with every joint (joints no tracker '
                     'gives need a checkpoint trained with joint masks: --trackers)')
  s = np.maximum(seen, 0)
  before = seen[:, 0] < 0  # the root not seen in `pos` yet: the stream's state
  root_seen = pos[s[:, 0], 0]  # [T, 3] the root and its children where it was last seen
  kids_seen = pos[s[:, 0]][:, kids]  # [T, K, 3]
  if held is not None:
    root_seen = np.where(before[:, None], held[2], root_seen)
    kids_seen = np.where(before[:, None, None], held[3], kids_seen)
  if ok[:, 0].all():
    root = pos[:, 0]
  else:
    with np.errstate(invalid='ignore'):  # NaN/inf joints: left out below
      both = np.isfinite(pos[:, kids]).all(-1) & np.isfinite(kids_seen).all(-1)  # [T, K]
      n = both.sum(-1)
      moved = np.where(both[..., None], pos[:, kids] - kids_seen, 0.0).sum(1) / np.maximum(
          n, 1)[:, None]
    root = np.where(ok[:, :1], pos[:, 0], np.where((n > 0)[:, None], root_seen + moved,
                                                   np.nan))
    # No child seen with the root: the root where it was in the frame before.
    have = np.isfinite(root).all(-1)
    last = np.maximum.accumulate(np.where(have, np.arange(T), -1))
    root = root[np.maximum(last, 0)]
    if held is not None:
      root = np.where((last < 0)[:, None], held[0], root)
  with np.errstate(invalid='ignore'):  # NaN where never seen here, replaced below
    rel = pos[s, np.arange(J)[None, :]] - root[s]  # [T, J, 3] offsets from the root
  if held is not None:
    rel = np.where((seen < 0)[..., None], held[1], rel)
  out = np.where(ok[..., None], pos, root[:, None, :] + rel)
  return out, (root[-1].copy(), rel[-1].copy(), root_seen[-1].copy(), kids_seen[-1].copy())


def _real_bones(rig: Rig) -> np.ndarray:
  """Joints whose template bone (to the parent) has length: the ones bone lengths compare on."""
  tmpl = rig.template()
  return np.asarray([j for j, p in enumerate(rig.parents)
                     if p >= 0 and np.linalg.norm(tmpl[j]) > 1e-6])


def bone_lengths(positions: np.ndarray, rig: Rig) -> np.ndarray:
  """`[T, J, 3]` -> `[T, J]` distance of each joint to its parent (root: 0)."""
  parents = np.asarray([max(p, 0) for p in rig.parents])
  d = positions - np.take(positions, parents, axis=1)
  d *= d
  return np.sqrt(d[..., 0] + d[..., 1] + d[..., 2])  # np.linalg.norm's sum, 1.8x faster


def length_ratio(lengths: np.ndarray, rig: Rig) -> float:
  """Median over the rig's real bones of `lengths [J]` / the template's bone lengths."""
  bones = _real_bones(rig)
  tmpl = np.linalg.norm(rig.template()[bones], axis=-1)
  return float(np.median(lengths[bones] / tmpl))


def units_hint(ratio: float, scale: float) -> str:
  """The `--units` that would bring a length ratio to ~1, named when it is a known unit."""
  want = scale / ratio
  if not (math.isfinite(want) and want > 0):
    return 'pass --units=NUMBER (metres per input unit)'
  # The named unit that makes a human of it (a child in millimetres is millimetres, 0.65x the
  # template; the number that made it template-sized wrote an adult), the nearest if several.
  human = [k for k in _UNIT_LABELS if _HINT_SIZES[0] <= UNITS[k] / want <= _HINT_SIZES[1]]
  if human:
    name = min(human, key=lambda k: abs(math.log(UNITS[k] / want)))
    return f'looks like {_UNIT_LABELS[name]}: pass --units={name}'
  return f'pass --units={want:.4g} (metres per input unit)'


_PLAUSIBILITY_FRAMES = 512  # check_plausibility judges at most this many frames of a clip


def units_problem(positions: np.ndarray, rig: Rig, scale: float = 1.0,
                  defaulted: bool = False) -> str | None:
  """What is wrong with the units of `positions [T, J, 3]` (metres after `scale` metres per
  input unit, rig axes; frames with a missing joint not counted): median bone lengths over
  `_UNIT_WARN_RATIO` times the template's or under its inverse, with the `--units` that would
  fit; None when they are plausible, or nothing can be judged (no template, no whole frame).
  `defaulted` (nobody named the units: a default was taken): also bones within
  `_UNIT_MATCH_RATIO` of what another named unit would give (inches read as centimetres:
  0.39x, a body 70 cm tall; `--units` says otherwise)."""
  try:
    rig.template()
  except RigError:
    return None
  positions = positions[np.isfinite(positions).all(axis=(1, 2))]
  if not len(positions):
    return None
  ratio = length_ratio(np.median(bone_lengths(positions, rig), axis=0), rig)
  if ratio < 1e-9:
    return 'bone lengths are ~0: every joint sits at the same place?'
  if not 1 / _UNIT_WARN_RATIO < ratio < _UNIT_WARN_RATIO:
    return f'bone lengths are {ratio:.3g}x the template\'s ({rig.name}): {units_hint(ratio, scale)}'
  if defaulted and any(abs(math.log(ratio * UNITS[name] / scale)) < math.log(_UNIT_MATCH_RATIO)
                       and abs(math.log(UNITS[name] / scale)) > math.log(1.5)
                       for name in _UNIT_LABELS):
    return f'bone lengths are {ratio:.3g}x the template\'s ({rig.name}): {units_hint(ratio, scale)}'
  return None


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_caller(msg: str) -> None:
  """`warnings.warn(msg)` attributed to the first frame outside this package (the user's
  line that called the library), so Python's warning filters and its file:line see that."""
  frame, level = sys._getframe(1), 2
  while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
    frame, level = frame.f_back, level + 1
  warnings.warn(msg, stacklevel=level)


def warning_kind(msg: str) -> str:
  """A warning's kind: `msg` up to its first colon, without numbers (whatever the frame's
  measurements: 'up axis looks wrong', 'bone lengths are #x the template's (cmu_body)')."""
  return re.sub(r'[-+]?\d[\d.,e+-]*', '#', msg.split(':')[0])


# The refinement fits the positions with the offsets' bone lengths: where the input's bones
# are another size (a tracker's scale off, offsets of another subject), it bends the joints to
# make up the difference; a 2% mismatch already costs it about as much as it gains on clean
# input. Warned past REFINE_SCALE_TOL, measured on the longer bones, which noise lengthens
# least (30 mm of noise: about 2%).
REFINE_SCALE_TOL = 0.04


# The refinement's step sizes and keep-best rule are tuned at 50 iterations: 5-20 leave the
# joints farther from the input than the network's own solution (MPJPE on clean CMU val;
# `experiments.evaluate --split=val --method=ikgat --max_frames=400 --refine_iters=N`).
REFINE_MIN_ITERS = 30

# Positions alone of a body this much larger or smaller than the template (a child, a tall
# adult) get the template scaled to their size; within it (CMU's subjects, 0.97-1.04x) the
# template as it is.
TEMPLATE_SIZE_TOL = 0.1


def template_at_size(positions: np.ndarray, offsets: np.ndarray, rig: Rig) -> np.ndarray:
  """`offsets`, or for positions alone (`offsets` equal to the rig's template) of a body more
  than TEMPLATE_SIZE_TOL from its size, the template scaled by the median over the real bones
  of the clip's median bone length over the template's: the rotations are the same (the
  network sees the template's size either way), and FK and every output keep the input's size
  (a 1.1 m child got an adult's skeleton, its feet 35 cm under the floor)."""
  try:
    template = rig.template()
  except RigError:
    return offsets
  if not np.array_equal(np.asarray(offsets, np.float64), np.asarray(template, np.float64)):
    return offsets
  whole = positions[np.isfinite(positions).all(axis=(1, 2))][:_PLAUSIBILITY_FRAMES]
  if not len(whole):
    return offsets
  ratio = length_ratio(np.median(bone_lengths(whole, rig), axis=0), rig)
  if not (np.isfinite(ratio) and 1 / _UNIT_WARN_RATIO < ratio < _UNIT_WARN_RATIO) or abs(
      math.log(ratio)) <= math.log(1 + TEMPLATE_SIZE_TOL):
    return offsets  # a human's size as it is, or other units (said by the units check)
  return check_offsets(np.asarray(template, np.float64) * ratio, rig)


def check_refined_scale(positions: np.ndarray, offsets: np.ndarray, rig: Rig) -> None:
  """Warns (at the caller's line) when `positions [T, J, 3]` (metres, rig axes) have bones more
  than REFINE_SCALE_TOL longer or shorter than `offsets` (the median over the real bones of
  each bone's median over up to `_PLAUSIBILITY_FRAMES` whole frames): what a refinement does
  then, and the remedies."""
  whole = positions[np.isfinite(positions).all(axis=(1, 2))][:_PLAUSIBILITY_FRAMES]
  bones = np.asarray(_real_bones(rig))
  rest = np.linalg.norm(np.asarray(offsets, np.float64), axis=-1)[bones]
  if not len(whole) or not len(bones) or not (rest > 1e-6).all():
    return
  # The longer half of the bones: noise of sigma lengthens a bone of L by about 3 sigma^2 / L^2
  # (a 10 cm bone 8% at 15 mm; a 40 cm one 0.4%), a scale error every bone alike.
  long = rest >= np.median(rest)
  ratio = float(np.median(np.median(bone_lengths(whole, rig), axis=0)[bones[long]] / rest[long]))
  if abs(ratio - 1.0) > REFINE_SCALE_TOL:
    warn_caller(f'the input\'s bones are {100 * (ratio - 1):+.0f}% the offsets\' lengths: the '
                'refinement (refine_iters) fits the offsets\' lengths and bends the joints to '
                'make up the difference; give offsets at the input\'s scale, estimate_lengths='
                'True (--estimate_lengths), or no refinement')


def check_plausibility(positions: np.ndarray, rig: Rig, scale: float = 1.0,
                       said: set[str] | None = None,
                       input_axes: np.ndarray | None = None) -> list[str]:
  """Warns (`warnings.warn`, also returned) on likely unit or axis problems; with `said` (a
  set the caller keeps), each kind of warning once (`warning_kind`), the kinds added to it.

  `positions [T, J, 3]` in metres (after `scale` metres per unit was applied), rig axes
  (after `input_axes [3, 3]`, the caller's map from the input's, was applied: an axis hint is
  the whole map from the input's axes, and names the input's axis that points up).
  Needs the rig's template; without one nothing is checked. A long clip is judged on at most
  `_PLAUSIBILITY_FRAMES` frames spread evenly over it (every k-th): the medians and the mean
  below barely move, and the check of a 5,133-frame clip takes 0.3 ms instead of 2.4 (0.6% of
  its solve on two cores; BENCHMARKS.md, issue N, session 30).
  """
  try:
    rig.template()
  except RigError:
    return []
  positions = positions[::-(-len(positions) // _PLAUSIBILITY_FRAMES)]
  msgs = [m for m in (units_problem(positions, rig, scale),) if m]
  msgs += _check_up(positions, rig, input_axes)
  msgs += _check_handedness(positions, rig, input_axes)
  if said is not None:
    msgs = [m for m in msgs if warning_kind(m) not in said]
    said.update(warning_kind(m) for m in msgs)
  for m in msgs:
    warn_caller(m)
  return msgs


def _top_joint(rig: Rig) -> int:
  """The joint highest above the root at rest (the head), in the rig's reference pose (its
  natural pose; the zero pose unless the rig names another)."""
  rest = rig.reference_positions()
  return int(np.argmax((rest - rest[0]) @ np.asarray(rig.up)))


_UP_EXTENT_RATIO = 1.25  # as data_prep.conversion's: upright bodies extend most along up


def _check_up(positions: np.ndarray, rig: Rig, given: np.ndarray | None = None) -> list[str]:
  """The mean head - root vector should point up: warn when it is below, or over 60 degrees
  off (the input's up is another axis; fine for a clip that lies down throughout). The head
  is the top joint of the rig's natural pose, known for a built-in rig or one that names its
  reference pose; another rig's zero pose may be any (another lab's bind: a toe on top), so
  there the bodies must also extend most along another axis than up (median over frames of
  the highest joint minus the lowest, `_UP_EXTENT_RATIO` times up's or more), as upright
  bodies do not. `given`: the input axes map already applied to `positions` (the hint
  composes with it)."""
  given = np.eye(3) if given is None else np.asarray(given, np.float64)
  head = _top_joint(rig)
  v = np.mean(positions[:, head] - positions[:, 0], axis=0)
  up = np.asarray(rig.up)
  n = np.linalg.norm(v)
  if n < 1e-9 or float(v @ up) >= 0.5 * n:
    return []
  if not (rig.has_reference_pose or rig.name in BUILTIN_RIGS):
    extent = np.median(positions.max(axis=1) - positions.min(axis=1), axis=0)
    k, u = int(np.argmax(extent)), int(np.argmax(np.abs(up)))
    if k == u or extent[k] < _UP_EXTENT_RATIO * extent[u]:
      return []
    M = _suggest_axes(k, 1.0, rig) @ given
    return [f'up axis looks wrong: the bodies extend most along {"xyz"[k]} (median '
            f'{extent[k]:.2f} m, against {extent[u]:.2f} m along rig up '
            f'{axes_text(up[None])}); pass --input_axes (e.g. --input_axes={axes_text(M)} if '
            f'input {_input_axis(given, k, 1.0)} is up)' + _LYING]
  where = ('below the' if float(v @ up) < 0 else
           f'{math.degrees(math.acos(float(v @ up) / n)):.0f} degrees off up from the')
  k = int(np.argmax(np.abs(v)))  # the input axis that points up: suggest the map to rig up
  M = _suggest_axes(k, float(np.sign(v[k])), rig) @ given
  return [f'up axis looks wrong: the {rig.joint_names[head]} is {where} '
          f'{rig.joint_names[0]} on average (rig up is {axes_text(up[None])}); pass '
          f'--input_axes (e.g. --input_axes={axes_text(M)} if input '
          f'{_input_axis(given, k, float(np.sign(v[k])))} is up)' + _LYING]


@functools.lru_cache(maxsize=16)
def _handedness_joints(rig: Rig) -> tuple[int, int, int, tuple[tuple[int, int], ...]] | None:
  """(left hip, right hip, top, ((foot, toe) of each side)) where the rig's natural pose shows
  them: the mirrored pair nearest the root (the hips), the top joint (the head), and the lowest
  mirrored leaves whose bone from their parent points forward (the toes). None for a rig
  without them (no mirror map, no feet pointing forward)."""
  try:
    rest = rig.reference_positions()
  except RigError:
    return None
  up, forward, side = (np.asarray(v, np.float64) for v in (rig.up, rig.forward, rig.lateral))
  depth = [0] * rig.num_joints
  for j, p in enumerate(rig.parents):
    depth[j] = 0 if p < 0 else depth[p] + 1
  pairs = [j for j, m in enumerate(rig.mirror) if m != j]
  if not pairs:
    return None
  hip = min(pairs, key=lambda j: (depth[j], j))
  left, right = ((hip, rig.mirror[hip]) if float((rest[hip] - rest[rig.mirror[hip]]) @ side) > 0
                 else (rig.mirror[hip], hip))
  feet = []
  for toe in sorted((j for j in rig.leaves if rig.mirror[j] != j), key=lambda j: rest[j] @ up)[:2]:
    bone = rest[toe] - rest[rig.parents[toe]]
    if float(bone @ forward) < 0.5 * np.linalg.norm(bone):
      return None
    feet.append((rig.parents[toe], toe))
  if len(feet) != 2 or float(np.linalg.norm(rest[left] - rest[right])) < 1e-6:
    return None
  return left, right, _top_joint(rig), tuple(feet)


_MIRRORED_SHARE = 0.8  # of the frames' feet pointing clearly backwards: a mirrored body


def _check_handedness(positions: np.ndarray, rig: Rig,
                      given: np.ndarray | None = None) -> list[str]:
  """Warns when the body looks mirrored (left-handed axes given as right-handed, as a y-up
  engine's data exported without converting: the solution then faces backwards with its knees
  and toes bent the wrong way, an error of about 50 degrees, while its FK looks as close as
  the input's): the triple product of the hips' left-right, the body's up (head - root) and a
  foot's toe direction has the opposite sign to the rig's natural pose's in most frames. A
  rotation of the body keeps that sign (any orientation, lying or upside down), a reflection
  flips it; a foot pointing up in a kick is left out (|cosine| < 0.3)."""
  if len(positions) < 2:  # two feet of one frame never decide it (below): no cost per frame
    return []
  joints = _handedness_joints(rig)
  if joints is None:
    return []
  left, right, top, feet = joints

  def signs(p):  # [T, 2]: the sign per frame and foot, 0 where not clear
    a = p[..., left, :] - p[..., right, :]
    b = p[..., top, :] - p[..., 0, :]
    n = np.cross(a, b)
    out = []
    for foot, toe in feet:
      f = p[..., toe, :] - p[..., foot, :]
      c = np.einsum('...i,...i->...', n, f) / np.maximum(
          np.linalg.norm(n, axis=-1) * np.linalg.norm(f, axis=-1), 1e-12)
      out.append(np.where(np.abs(c) >= 0.3, np.sign(c), 0.0))
    return np.stack(out, axis=-1)

  rest = signs(rig.reference_positions()[None])[0]
  if not np.all(rest == rest[0]) or rest[0] == 0:
    return []
  with np.errstate(invalid='ignore'):
    got = signs(positions[np.isfinite(positions).all(axis=(1, 2))])
  clear = got != 0
  if clear.sum() < 4:
    return []
  backwards = float(np.mean(got[clear] == -rest[0]))
  if backwards < _MIRRORED_SHARE:
    return []
  given = np.eye(3) if given is None else np.asarray(given, np.float64)
  flip = np.eye(3) - 2.0 * np.outer(rig.lateral, rig.lateral)  # the rig's left-right reflection
  return [f'the body looks mirrored: its feet point backwards in {100 * backwards:.0f}% of the '
          'frames, so left and right would swap and the knees bend the wrong way (left-handed '
          f'axes?); pass --input_axes (e.g. --input_axes={axes_text(flip @ given)})']


# What an up-axis warning says of a body that is lying or upside down: the solver takes any
# orientation, so then the axes are right and the warning is not.
_LYING = '; a clip of a body lying or upside down is solved as it is (leave the axes)'


def _input_axis(given: np.ndarray, k: int, sign: float) -> str:
  """The input's signed axis ('+z') that `given` took to `sign * e_k`."""
  d = given.T @ (sign * np.eye(3)[k])
  i = int(np.argmax(np.abs(d)))
  return ('-' if d[i] < 0 else '+') + 'xyz'[i]


def _suggest_axes(k: int, sign: float, rig: Rig) -> np.ndarray:
  """A proper rotation (signed permutation) taking input axis `sign * e_k` to the rig's up."""
  up = np.asarray(rig.up)
  u = int(np.argmax(np.abs(up)))
  src = np.zeros(3)
  src[k] = sign
  # Rotate src onto e_u (90 or 180 degrees about a principal axis), then to up's sign.
  for spec in ('x,y,z', 'x,z,-y', 'x,-z,y', 'z,y,-x', '-z,y,x', 'y,-x,z', '-y,x,z',
               'x,-y,-z', '-x,y,-z', '-x,-y,z'):
    M = parse_input_axes(spec)
    if np.allclose(M @ src, np.sign(up[u]) * np.eye(3)[u]):
      return M
  return np.eye(3)


# ----------------------------------------------------------------------------------------------
# Offsets.


def check_offsets(offsets, rig: Rig) -> np.ndarray:
  """A subject's rest offsets `[J, 3]` (metres, parent frames): shape, finite, real bones."""
  try:
    off = np.asarray(offsets, dtype=np.float64)
  except (TypeError, ValueError) as e:
    raise InputError(f'offsets are not a numeric array: {e}') from None
  if off.shape != (rig.num_joints, 3):
    raise InputError(f'offsets must be [{rig.num_joints}, 3] in the joint order of rig '
                     f'{rig.name!r} ({", ".join(rig.joint_names)}); got shape {off.shape}')
  if not all_finite(off):
    j = int(np.flatnonzero(~np.isfinite(off).all(axis=-1))[0])
    raise InputError(f'offsets contain NaN/inf: joint {j} ({rig.joint_names[j]}) is '
                     f'{off[j].tolist()}; every joint needs its rest offset')
  children = np.asarray(rig.designated_children)  # one vectorised check: `step` runs it per call
  short = (children >= 0) & (np.einsum('ij,ij->i', off[children], off[children]) <= 1e-12)
  if short.any():
    j = int(np.flatnonzero(short)[0])
    raise InputError(f'offsets: bone {rig.joint_names[j]} -> '
                     f'{rig.joint_names[children[j]]} has zero length, so its rest direction '
                     '(and bone frame) is undefined')
  return off


def _writable(a: np.ndarray) -> np.ndarray:
  """`a` as an array the caller may write into: a copy of a read-only view of device memory
  (what `np.asarray` of a JAX array gives), `a` itself otherwise (a live frame's copy: 0.5 us)."""
  a = np.asarray(a)
  return a if a.flags.writeable else a.copy()


def _with_reference_pose(rig: Rig, reference) -> Rig:
  """`skeleton.with_reference_pose`, its refusals as the solver's `InputError`s."""
  try:
    return skeleton.with_reference_pose(rig, reference)
  except RigError as e:
    raise InputError(str(e)) from None


def _offsets_as_positions(raw: np.ndarray, scale: float, M: np.ndarray, rig: Rig) -> np.ndarray:
  """Offsets `raw [J, 3]` given in the positions' units and axes -> metres in rig axes (`scale`
  metres per unit, rig = `M` @ input). InputError where they look given in metres or the rig's
  axes already (the contract before session 41, the solver's own `offsets` still): bones of a
  plausible size as given and not once converted, or pointing as the template's as given and a
  median `REST_POSE_WARN_DEG` off once turned."""
  out = raw * scale @ M.T
  try:
    rig.template()
  except RigError:
    return out
  size = lambda o: length_ratio(np.linalg.norm(o, axis=-1), rig)  # noqa: E731
  plausible = lambda r: 1 / _UNIT_WARN_RATIO < r < _UNIT_WARN_RATIO  # noqa: E731
  if scale != 1.0 and plausible(size(raw)) and not plausible(size(out)):
    raise InputError(f'offsets: the bones are {size(out):.3g}x the template\'s once converted '
                     'with the positions\' units; they look given in metres: give them in the '
                     'positions\' units (units= / --units converts both)')
  if not np.array_equal(M, np.eye(3)):
    turned = lambda o: float(np.nanmedian(rest_pose_angles(o, rig)))  # noqa: E731
    if turned(raw * scale) <= REST_POSE_WARN_DEG < turned(out):
      raise InputError(f'offsets: their bones point as the template\'s as given and a median '
                       f'{turned(out):.0f} deg off once turned by the positions\' axes; they '
                       'look given in the rig\'s axes: give them in the positions\' axes '
                       '(input_axes= / --input_axes turns both)')
  return out


def check_offsets_size(offsets: np.ndarray, rig: Rig) -> None:
  """InputError when the subject's bones are a median `_UNIT_WARN_RATIO` times the template's
  or under its inverse: offsets in other units than metres (or than the positions' with
  `units`), which would put every FK output and exported skeleton off by that factor."""
  try:
    ratio = length_ratio(np.linalg.norm(offsets, axis=-1), rig)
  except RigError:  # no template: nothing to compare with
    return
  if not 1 / _UNIT_WARN_RATIO < ratio < _UNIT_WARN_RATIO:
    raise InputError(f'offsets: the bones are {ratio:.3g}x the template\'s ({rig.name}): give '
                     'them in the positions\' units (units= / --units converts both; metres '
                     'without it)')


rest_pose_angles = skeleton.rest_pose_angles  # the subject's rest bones against the template's


def check_rest_pose(offsets: np.ndarray, rig: Rig) -> str | None:
  """A warning (`warnings.warn`, also returned) when the subject's rest pose, the pose of its
  zero rotations, is another one than the rig template's in the rig's natural pose: its bones
  point a median over `REST_POSE_WARN_DEG` from the template's (a bind of another lab's rig
  read with this rig's joints, and no natural pose named for it: `skeleton.with_reference_pose`),
  or one of them over `_REST_BONE_WARN_DEG` (a natural pose named for it that is not the rig's,
  e.g. `--reference_pose=first_frame` of a clip that does not start in a T-pose facing
  forward). The rotations then reproduce the bones' directions, but their twist about each bone
  is relative to another pose than the model learnt, and where children branch they miss the
  input (BENCHMARKS.md "Another rest pose")."""
  angles = rest_pose_angles(offsets, rig)
  if not np.isfinite(angles).any():
    return None
  median, worst = float(np.nanmedian(angles)), int(np.nanargmax(angles))
  if median <= REST_POSE_WARN_DEG and angles[worst] <= _REST_BONE_WARN_DEG:
    return None
  named = ('in the natural pose named for it (a joint map\'s reference_pose, --reference_pose) '
           if rig.has_reference_pose else '')
  msg = (f'the subject\'s rest pose is not the rig\'s ({rig.name}): {named}its bones point a '
         f'median {median:.0f} deg and up to {angles[worst]:.0f} deg '
         f'({rig.joint_names[rig.parents[worst]]} -> {rig.joint_names[worst]}) from the '
         'template\'s, so the rotations\' twist about each bone is relative to another pose '
         'than the model learnt and, where bones branch (the hips, the chest), they miss the '
         'input: name its natural pose, a T-pose facing forward (a joint map\'s reference_pose, '
         '--reference_pose=first_frame for a clip that starts in it), or --subject_calibration '
         'fits those joints to the input')
  warn_caller(msg)
  return msg


def estimate_offsets(positions: np.ndarray, base_offsets: np.ndarray, rig: Rig) -> np.ndarray:
  """Directions of `base_offsets [J, 3]`, lengths = median observed bone lengths of
  `positions [T, J, 3]` (metres). Co-located joints stay co-located; the root row is kept."""
  observed = np.median(bone_lengths(positions, rig), axis=0)
  out = np.array(base_offsets, np.float64)
  for j, p in enumerate(rig.parents):
    n = np.linalg.norm(out[j])
    if p < 0 or n <= 1e-6:
      continue
    if observed[j] <= 1e-6:
      warn_caller(f'bone {rig.joint_names[p]} -> {rig.joint_names[j]} has zero length in the '
                  'input; keeping its template length')

      continue
    out[j] *= observed[j] / n
  return out


def fitted_offsets(global_rot: np.ndarray, positions: np.ndarray, base_offsets: np.ndarray,
                   rig: Rig) -> np.ndarray:
  """`[J, 3]` the rest offsets that solved world rotations `global_rot [T, J, 3, 3]` imply for
  `positions [T, J, 3]` (finite, metres, rig axes): each joint's offset from its parent in the
  parent's solved frame, averaged over the frames, `o_j = mean_t G_p,t^T (x_j,t - x_p,t)`, the
  offset whose bone vector `G_p,t o_j` is nearest the input's (least squares). Joints
  co-located with their parent in `base_offsets` stay so; the root row is kept."""
  G = np.asarray(global_rot, np.float64)
  x = np.asarray(positions, np.float64)
  out = np.array(base_offsets, np.float64)
  kids = [j for j, p in enumerate(rig.parents) if p >= 0 and np.linalg.norm(out[j]) > 1e-6]
  ups = [rig.parents[j] for j in kids]
  out[kids] = np.einsum('tjba,tjb->ja', G[:, ups], x[:, kids] - x[:, ups]) / len(x)
  return out


# ----------------------------------------------------------------------------------------------
# Results and the compiled forward.


@dataclasses.dataclass
class Solution:
  """A solved clip, numpy float32, frames `[T, ...]` (metres; world = the rig's world axes).

  Attributes:
    local_rot: `[T, J, 3, 3]` R_j, parent-relative (root: world rotation).
    global_rot: `[T, J, 3, 3]` G_j, world.
    bone_aligned_rot: `[T, J, 3, 3]` Q_j = G_j @ B_j, world.
    positions_fk: `[T, J, 3]` FK of `local_rot` on `offsets`, root at the input root (refined:
      the fitted root, unless `fit_offsets`; module docstring).
    positions: `[T, J, 3]` the input after units/axes conversion (what was solved).
    offsets: `[J, 3]` the subject's rest offsets R is relative to.
    bone_frames: `[J, 3, 3]` B from `offsets`.
  """
  local_rot: np.ndarray
  global_rot: np.ndarray
  bone_aligned_rot: np.ndarray
  positions_fk: np.ndarray
  positions: np.ndarray
  offsets: np.ndarray
  bone_frames: np.ndarray

  @property
  def num_frames(self) -> int:
    return int(self.local_rot.shape[0])

  def fk_error_m(self) -> np.ndarray:
    """`[T, J]` distance between the input and the FK positions (metres)."""
    return np.linalg.norm(self.positions_fk - self.positions, axis=-1)


def bucket_sizes(block_size: int) -> tuple[int, ...]:
  """1, 2, 4, ... below `block_size`, then `block_size`."""
  if block_size < 1:
    raise InputError(f'block_size must be >= 1, got {block_size}')
  sizes = [1 << k for k in range(block_size.bit_length()) if (1 << k) < block_size]
  return tuple(sizes) + (block_size,)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
  """The smallest bucket holding `n` frames (n <= the largest bucket)."""
  return next(b for b in buckets if b >= n)


def default_workers() -> int:
  """Threads that run a clip's chunks at once: on the CPU backend the cores this process may run
  on (`os.sched_getaffinity`; 1 under `taskset -c 0`), at most MAX_WORKERS; 1 on accelerators.
  XLA's CPU runtime spreads one executable's kernels over the cores poorly (a block's hundred
  small kernels run one after another), so two chunks at once on two cores solve a batch 1.3x
  faster than one chunk using both (BENCHMARKS.md, issue N session 17)."""
  if jax.default_backend() != 'cpu':
    return 1
  try:
    cores = len(os.sched_getaffinity(0))
  except (AttributeError, OSError):  # not Linux
    cores = os.cpu_count() or 1
  return max(1, min(cores, MAX_WORKERS))


def _host_constants(leaves: list) -> list:
  """`leaves` as numpy (PRNG keys as they are): passed by a jitted function's trace to the
  forward, they are compiled into its executable as constants (`IKSolver._default_step`)."""
  return [x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else np.asarray(x)
          for x in leaves]


def _constants_digest(tree) -> str:
  """sha256 of `tree`'s arrays (dtype, shape, bytes): the executable cache's key part for
  arrays compiled in as constants."""
  h = hashlib.sha256()
  for x in jax.tree.leaves(tree):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    x = np.ascontiguousarray(x)
    h.update(f'{x.dtype.str}{x.shape}'.encode())
    h.update(x.tobytes())
  return h.hexdigest()


class _ExecutableCache:
  """The solver's compiled executables shared by every `IKSolver` of the process, by
  `IKSolver._compiled_for`'s key (what the program computes, on which argument shapes, in this
  environment: the executable cache's, compile_cache.py): a second solver of the same model,
  configuration and argument shapes (another person in a scene, a clip after a live stream)
  runs without tracing, lowering or compiling (with XLA's defaults, about 2 s for a first
  `step` and as much for a first 100-frame clip of the shipped model on a 2-core CPU;
  BENCHMARKS.md "A second solver in one process"). The least
  recently used go first beyond `max_entries`, or beyond `max_bytes` of model state compiled
  in (`step`'s executables hold their weights). Thread-safe."""

  def __init__(self, max_entries: int = 256, max_bytes: int = 512 << 20):
    self.max_entries, self.max_bytes = max_entries, max_bytes
    self._entries: dict[str, tuple[Any, int]] = {}  # key -> (executable, bytes held); LRU order
    self._lock = threading.Lock()

  def get(self, key: str):
    with self._lock:
      entry = self._entries.pop(key, None)
      if entry is None:
        return None
      self._entries[key] = entry  # most recently used: last
      return entry[0]

  def put(self, key: str, exe, held: int = 0) -> None:
    with self._lock:
      self._entries.pop(key, None)
      self._entries[key] = (exe, int(held))
      while len(self._entries) > 1 and (
          len(self._entries) > self.max_entries
          or sum(h for _, h in self._entries.values()) > self.max_bytes):
        del self._entries[next(iter(self._entries))]

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()

  def __len__(self) -> int:
    return len(self._entries)


_PROCESS_EXECUTABLES = _ExecutableCache()


def clear_executables() -> None:
  """Forgets the executables the process's solvers share (`_ExecutableCache`): a solver made
  after this compiles (or loads from the executable cache) its own; solvers made before keep
  theirs."""
  _PROCESS_EXECUTABLES.clear()


def _make_forward(graphdef, treedef, rig: Rig, counter: list[int], refine=None, prior=None,
                  mirror: bool = False, size: bool = False):
  """jit((state leaves, positions [b, J, 3], offsets [J, 3], B [J, 3, 3]), full static) -> dict.

  The model state (with the refinement's prior state: `(state, prior_state)`) goes in as its
  flat list of leaves (`treedef` rebuilds it at trace time): a call then skips flattening the
  nested nnx State, ~25 us of a ~0.4 ms live frame. The clip path passes the leaves as
  arguments (one copy of the weights for every bucket); `step` passes them as numpy at trace
  time, so they are compiled in (`IKSolver._default_step`).

  `refine` (an `iterative_ik.SolverConfig`): amortized + refine, a few anchored iterations of the
  rotation solver from IK-GAT's output (issues G1, J; BENCHMARKS.md), with the pose prior
  `prior` (`vposer.DecoderFn`, static) where given. `mirror`: test-time mirror averaging
  (`inference.ikgat_infer`). `num_valid` (int32 scalar or None): the positions' first that many
  frames are the chunk, the rest its padding, whose blocks of the network are skipped. `size`:
  the network sees each body at the template's size (`inference.ikgat_infer`'s
  `size_normalization`).
  """

  def forward(leaves, positions, offsets, B, full, sparse=None, num_valid=None):
    counter[0] += 1  # runs at trace time only: counts compilations
    state, prior_state = jax.tree.unflatten(treedef, leaves)
    local = _infer(graphdef, rig, refine, state, positions, offsets, B, sparse,
                   (prior, prior_state) if prior is not None else None, mirror, num_valid,
                   size)
    if not full:
      return {'local_rot': local}
    G, p = kinematics.forward_kinematics(local, offsets, rig.parents, root_pos=positions[:, 0])
    if refine is not None and refine.fit_translation:  # the refinement's own (fitted) root
      p = p - jnp.mean(p - positions, axis=1, keepdims=True)
    return {'local_rot': local, 'global_rot': G, 'bone_aligned_rot': G @ B, 'positions_fk': p}

  return jax.jit(forward, static_argnums=4)


def _infer(graphdef, rig: Rig, refine, state, positions, offsets, B, sparse=None, prior=None,
           mirror: bool = False, num_valid=None, size: bool = False):
  """The network (mirror-averaged with `mirror`; + the optional refinement, with `prior =
  (DecoderFn, state)` where given): positions `[b, J, 3]` -> local `[b, J, 3, 3]`."""
  return inference.ikgat_infer(nnx.merge(graphdef, state),
                               {'positions': positions, 'bone_frames': B[None],
                                'offsets': offsets, **(sparse or {})}, rig=rig, refine=refine,
                               prior=prior, mirror=mirror, num_valid=num_valid,
                               size_normalization=size)


def _make_stream_step(graphdef, treedef, rig: Rig, counter: list[int], refine,
                      config: temporal.FilterConfig, fps: float, prior=None,
                      mirror: bool = False, size: bool = False):
  """jit((state leaves, filter state, one frame [1, J, 3], offsets, B, sparse)) -> (filter state,
  filtered local [J, 3, 3]): network and temporal filter in one call, so a filtered live stream
  pays one dispatch per frame, not two (measured: +42% latency as two calls)."""

  def step(leaves, fstate, positions, offsets, B, sparse=None):
    counter[0] += 1
    state, prior_state = jax.tree.unflatten(treedef, leaves)
    local = _infer(graphdef, rig, refine, state, positions, offsets, B, sparse,
                   (prior, prior_state) if prior is not None else None, mirror, None, size)
    return temporal.filter_step(fstate, local[0], config, fps)

  return jax.jit(step)


def _numpy_inputs(sparse: dict | None) -> dict[str, np.ndarray] | None:
  """Sparse inputs as numpy in the dtypes JAX would give them (float64 -> float32 unless x64),
  for a compiled executable's own transfer (faster than `jnp.asarray` first)."""
  if sparse is None:
    return None
  return {k: np.asarray(v, jax.dtypes.canonicalize_dtype(np.asarray(v).dtype))
          for k, v in sparse.items()}


def _refine_prior(prior: str | os.PathLike | None, rig: Rig):
  """The refinement's pose prior model (`IKSolver.from_checkpoint`'s `refine_prior`) or None
  (None, or 'none' / '' as the command line spells it: no prior)."""
  if prior is None or str(prior).strip().lower() in ('', 'none'):
    return None
  if str(prior) == 'shipped':
    path = Path(inference.SHIPPED_PRIOR)
    if not path.is_dir():
      return None
    model, meta = inference.load_model(path, task=prior_task.PRIOR_TASK)
    prior_rig = Rig.from_json(meta['rig'])
    # A bone-chart prior serves any binds of its joints (issue L); a joint-chart one (the
    # shipped prior) models local rotations in its own rig's binds, so only that rig.
    fits = (prior_rig.joint_names == rig.joint_names if model.config.bone_chart
            else prior_rig.fingerprint() == rig.fingerprint())
    return model if fits else None
  return inference.load_model(prior, task=prior_task.PRIOR_TASK, expected_rig=rig)[0]


_fk_jit = jax.jit(lambda local, off, root, rig: kinematics.forward_kinematics(
    local, off, rig.parents, root_pos=root), static_argnums=3)


def _execute(job: tuple) -> dict[str, np.ndarray]:
  """Runs one `IKSolver._chunk_job`: its outputs as numpy, trimmed to its n frames (thread-safe:
  the executable is compiled, and XLA releases the GIL while it runs)."""
  exe, args, n = job
  return {k: np.asarray(v)[:n] for k, v in exe(*args).items()}


class _ProgressBar:
  """A carriage-return bar on stderr: frames done, percent, frames/s."""

  def __init__(self, total: int, enabled: bool, stream=None):
    self.total, self.enabled, self.stream = total, enabled, stream or sys.stderr
    self.start = time.perf_counter()

  def update(self, done: int) -> None:
    if not self.enabled:
      return
    frac = done / max(self.total, 1)
    bar = '#' * int(30 * frac) + '.' * (30 - int(30 * frac))
    rate = done / max(time.perf_counter() - self.start, 1e-9)
    self.stream.write(f'\rsolving [{bar}] {done:,}/{self.total:,} frames {100 * frac:3.0f}% '
                      f'{rate:,.0f} frames/s')
    self.stream.flush()
    if done >= self.total:
      self.stream.write('\n')


# ----------------------------------------------------------------------------------------------
# The solver.


class IKSolver:
  """A trained IK model ready to solve: positions `[T, J, 3]` -> rotations (module docstring).

  Holds the model's state, the rig, the default subject offsets and one jitted forward; the
  only state between calls is the stream's for `step` / `solve_stream` (`reset`): the temporal
  filter's, a window model's past frames and, with `hold_missing`, the joints held.
  """

  def __init__(self, model, meta: dict | None = None, *, offsets=None,
               block_size: int = DEFAULT_BLOCK, source: str | None = None,
               refine_iters: int = 0, temporal_filter: temporal.FilterConfig | None = None,
               fps: float = 30.0, refine_prior=None, mirror: bool = False,
               workers: int | None = None, hold_missing: bool = False,
               subject_calibration: bool = False, reference_pose: np.ndarray | None = None,
               size_normalization: bool = True):
    # The model's rig, or the same skeleton under another bind whose natural pose is
    # `reference_pose` (`skeleton.with_reference_pose`: bone frames follow the binds).
    self.rig: Rig = (model.rig if reference_pose is None
                     else _with_reference_pose(model.rig, reference_pose))
    # The subject's rotation biases measured on its own frames (subject_calibration.py): a
    # clip's over all of them, a stream's (`step` / `solve_stream`) over those so far, in
    # `_subject_bias`.
    self.subject_calibration = bool(subject_calibration)
    # The network sees each subject at the template's size (`inference.size_scale`); read-only.
    self.size_normalization = bool(size_normalization)
    self._subject_bias = subject_calibration_lib.SubjectBias()
    self._calibration_offsets_seen: set[bytes] = set()  # `_calibration_offsets`
    self._said: set[str] = set()  # kinds of input warning said for single frames (`prepare`),
    # and float16 input (`check_positions`): once per solver
    self._stream_checked = False  # `reset()` and `_check_stream`
    # Held while `step` or a `solve_stream` item runs: one stream per solver, so a second
    # thread stepping the same solver is refused, not interleaved with the first's state.
    self._stream_busy = threading.Lock()
    self._step_pos = None  # the frame `_step` solved last (rig metres, dropouts held)
    # Tracker dropouts (NaN joints) held from earlier frames (`hold_missing_joints`); the
    # stream's state for `step` / `solve_stream` in `_held` (`reset`).
    self.hold_missing = bool(hold_missing)
    self._held = None
    self.attention = gat.form_of(model)  # how the forward evaluates the graph attention
    self.mirror = bool(mirror)
    if self.mirror:  # a rig that cannot be mirrored: refused here, not at the first solve
      try:
        inference.check_mirror_averaging(self.rig, 'turn it off (mirror=False, no --mirror)')
      except ValueError as e:
        raise InputError(str(e)) from None
    self.meta = meta or {}
    self.source = source
    self.block_size = int(block_size)
    self.buckets = bucket_sizes(self.block_size)
    if workers is not None and (isinstance(workers, bool) or int(workers) != workers
                                or workers < 1):
      raise InputError(f'workers must be a whole number >= 1, got {workers!r}')
    # Threads for a clip's chunks (`_solve_chunks`); None: `default_workers()`.
    self.workers = default_workers() if workers is None else int(workers)
    self.offsets = offsets if offsets is not None else self._template_offsets()
    graphdef, state = nnx.split(model)
    # The network's large products (`model.set_matmul_precision`, static: in the graphdef)
    # and the XLA options every executable compiles with (`_compiled_for`).
    self.matmul_precision = model_lib.matmul_precision(model)
    self._options = inference.precision_options(self.matmul_precision)
    self._one_frame = inference.one_frame_options(self._options)  # `step`'s executables
    # The refinement's pose prior (issue J): a `vposer.PosePrior` for this rig, or None.
    self._prior, prior_state = (vposer.decoder(refine_prior)
                                if refine_iters > 0 and refine_prior is not None else (None, None))
    self._leaves, self._treedef = jax.tree.flatten((state, prior_state))
    self._const_leaves = None  # `_host_constants(self._leaves)`, for `step`, on first use
    self._leaves_digest = None  # `_constants_digest` of those (`_step_any`), on first use
    self._traces = [0]
    self.refine = None
    if refine_iters > 0:
      self.refine = iterative_ik.refine_config(refine_iters, prior=self._prior is not None)
    self._forward = _make_forward(graphdef, self._treedef, self.rig, self._traces, self.refine,
                                  self._prior, self.mirror, self.size_normalization)
    self._step_exec = None  # `_default_step`, compiled on first use (per subject: `offsets`)
    self._compiled: set[tuple] = set()  # `_signature`s of the clip chunks run so far
    self._executables: dict[tuple, object] = {}  # argument signature -> compiled forward
    self._description: str | None = None  # the executable cache's static part, on first use
    self.supports_masks = bool(model.config.joint_mask)  # sparse inputs (issue G2)
    self.orientation_inputs = tuple(model.config.orientation_inputs)
    self.end_sites = bool(getattr(model.config, 'end_sites', False))
    self._frames_cache: dict[bytes, tuple] = {}
    self._graphdef = graphdef
    if temporal_filter is not None and not isinstance(temporal_filter, temporal.FilterConfig):
      raise InputError(f'temporal_filter must be a temporal.FilterConfig (e.g. temporal.'
                       f'FilterConfig(kind=\'one_euro\')), got {temporal_filter!r}')
    self._temporal_filter = (temporal.from_checkpoint_meta(self.meta) if temporal_filter is None
                             else temporal_filter)
    # A window model (issue K): each frame with its past frames, 1/window_fps s apart.
    self.window = int(model.config.window)
    self.window_fps = float(model.config.window_fps)
    # A window model's refinement is per frame (the current frame's points, from the window's
    # solution): causal, and a stream and a clip of the same frames agree (window_model_test).
    self.fps = fps  # the property below: the filter's stream step and the window's spacing

  @property
  def fps(self) -> float:
    """The input frame rate (Hz) of clips and streams: the temporal filter's rate and, for a
    window model, the spacing of its past frames. Setting it starts a new stream."""
    return self._fps

  @fps.setter
  def fps(self, value: float) -> None:
    try:
      ok = not isinstance(value, (bool, str)) and math.isfinite(value) and value > 0
    except TypeError:
      ok = False
    if not ok:
      raise InputError(f'fps must be a positive frame rate, got {value!r}')
    self._fps = float(value)
    self._new_filter_stream()
    self.window_ratio = self._fps / self.window_fps
    self._history = (windows.StreamHistory(self.window, self.window_ratio)
                     if self.window > 1 else None)
    self.reset()  # a new stream: the held joints and the subject's biases too

  @property
  def temporal_filter(self) -> temporal.FilterConfig:
    """The causal output filter (`temporal.FilterConfig`) of clips and streams. Setting it
    starts a new filtered stream (`step`, `solve_stream` and `solve` all use the new one)."""
    return self._temporal_filter

  @temporal_filter.setter
  def temporal_filter(self, value: temporal.FilterConfig) -> None:
    if not isinstance(value, temporal.FilterConfig):
      raise TypeError(f'temporal_filter must be a temporal.FilterConfig, got {type(value)!r}')
    self._temporal_filter = value
    self._new_filter_stream()
    self.reset()  # a new stream: a window model's past frames too

  def _new_filter_stream(self) -> None:
    """A fresh filter state and the stream step of the current filter and fps."""
    self._filter_state = None
    self._stream_step = (_make_stream_step(self._graphdef, self._treedef, self.rig,
                                           self._traces, self.refine, self.temporal_filter,
                                           self._fps, self._prior, self.mirror,
                                           self.size_normalization)
                         if self.temporal_filter.active else None)
    self._stream_execs = {}  # `_stream_step` compiled ahead, per sparse-input signature
    getattr(self, '_pending', {}).pop('step filtered', None)  # for the filter before

  @property
  def offsets(self) -> np.ndarray:
    """The default subject's offsets `[J, 3]` (metres, rig axes; read-only: assign new ones,
    which starts a new stream: `reset()`)."""
    return self._offsets

  @offsets.setter
  def offsets(self, value) -> None:
    value = np.array(check_offsets(value, self.rig), np.float64)  # a copy of the caller's
    if getattr(self, '_offsets', None) is not None and np.array_equal(value, self._offsets):
      return  # the same subject: `step`'s executables stay
    value.flags.writeable = False  # `step`'s executables compile it in: changed only here,
    self._offsets = value
    self._step_exec = None  # so a new subject drops them (compiled again on first use)
    getattr(self, '_stream_execs', {}).pop('own subject', None)
    self._pending = {}  # `_own_or_none`'s compiles for the subject before: not installed
    if hasattr(self, '_history'):  # a new subject, a new stream (not the constructor's first)
      self.reset()


  @classmethod
  def from_checkpoint(cls, path: str | os.PathLike | None = None, *, offsets=None,
                      offsets_from: str | os.PathLike | None = None,
                      expected_rig: Rig | str | None = None, block_size: int = DEFAULT_BLOCK,
                      joint_map: str | None = None, bvh_units: str | float | None = None,
                      refine_iters: int = 0,
                      temporal_filter: temporal.FilterConfig | None = None,
                      fps: float = 30.0, attention: str = 'dense',
                      refine_prior: str | os.PathLike | None = 'shipped',
                      mirror: bool = False, workers: int | None = None,
                      matmul_precision: str = 'float32',
                      hold_missing: bool = False,
                      subject_calibration: bool = False,
                      reference_pose: np.ndarray | None = None,
                      size_normalization: bool = True) -> 'IKSolver':
    """Loads a run directory or checkpoint (None: `inference.SHIPPED_IKGAT`).

    `offsets [J, 3]` (metres) or `offsets_from` (a BVH: its rest offsets reduced to the rig,
    `joint_map`/`bvh_units` as for BVH input, `io.exports.read_bvh_offsets`) set the default
    subject; otherwise the checkpoint rig's template. `expected_rig` refuses a checkpoint for
    another rig (CheckpointError). `refine_iters > 0` refines each solution with that many
    iterations of the rotation solver (`iterative_ik.refine_config`: the root translation
    fitted, anchored to the network's pose and, with `refine_prior`, pulled toward a pose
    prior's decoding as the input gets noisier; 50 for noisy trackers; BENCHMARKS.md
    "Amortized + refine"). `refine_prior`: 'shipped' (default) uses `inference.SHIPPED_PRIOR`
    where it is for this checkpoint's rig (else the refinement runs without a prior), a
    directory a prior that must be for the rig (CheckpointError otherwise), None none.
    `mirror`: test-time mirror averaging (the network also solves the mirror image of each
    frame, and the answer is the geodesic midpoint of both, before any refinement): twice the
    network's work for an exactly mirror-equivariant solver, 0.2 deg lower error on CMU val
    (BENCHMARKS.md "Mirror averaging"); the rig must be mirror-symmetric in its reference pose.
    `temporal_filter` (None: the checkpoint's `temporal` config, else none) at frame rate `fps`
    (module docstring). `attention`: how the graph attention is evaluated (`gat.set_form`, the
    same function): 'dense', or 'auto', the sparse form from `gat.SPARSE_FROM` (4) frames on:
    1.3x the clip path's frames/s once compiled, for a compile 1.3x as long and more tracing,
    so a program that solves many clips gains and a one-clip run does not (BENCHMARKS.md
    "Blocks"); in a process started with `inference.start_live_backend` and with several
    `workers`, 'auto' is 'dense', the faster form there (the solver's `attention` says which).
    `workers`: threads that solve a clip's chunks at once (None: `default_workers()`, the
    usable CPU cores up to MAX_WORKERS, 1 on accelerators; the outputs do not depend on it).
    `matmul_precision`: 'float32', or 'bfloat16' for the network's large products (bfloat16
    inputs, float32 sums; `model.set_matmul_precision`): on a CPU with bfloat16 instructions a
    live frame 1.4x and a clip 1.8x as fast, the error within 0.002 deg of float32's on CMU
    val and test (BENCHMARKS.md, issue N session 31). `hold_missing`: NaN joints of clips and
    streams (tracker dropouts) take their last seen offset from the root, moved with the root
    (`hold_missing_joints`), for checkpoints without joint masks, which otherwise refuse them.
    `subject_calibration`: the joints whose children branch (the root, the chest) turned by
    the subject's constant biases there, measured on the input's own frames
    (subject_calibration.py: all of a clip's, a stream's so far), after any filter; lower
    error for a subject whose hips and shoulders sit unlike the training subjects'.
    `reference_pose` `[J, 3, 3]`: the input's joints carry other frames than the rig's (another
    bind of the same skeleton, whose zero pose is another pose): the world frames of its joints
    in the rig's natural pose (`io.exports.PositionsFile.reference`, from a joint map's
    `reference_pose`). The rotations are then the input's own, in its bind, exactly as the
    model gives them for the rig's (`skeleton.with_reference_pose`; BENCHMARKS.md "Another
    rest pose"); `offsets` in that bind. Mirror averaging and the refinement stay exact: the
    shipped prior models the joint chart of its own rig's binds, so under another bind
    'shipped' refines without it, as for any rig it does not fit (a prior trained with
    `VAEConfig.bone_chart` serves any bind).
    `size_normalization` (default on): the network sees each subject scaled to the rig
    template's size (rotations do not change with a body's scale), from the subject's offsets,
    or each frame's own bones where the offsets are the template's (no subject given): a body
    scaled by any k gives the same rotations, and one 15% smaller or larger than CMU's is
    solved 0.9-1.6 deg closer to the truth, at 0.02-0.04 deg more on CMU's own subjects
    (BENCHMARKS.md "Subject size"). False gives the network the input as it is.
    """
    if offsets is not None and offsets_from is not None:  # before the (slow) model load
      raise InputError('give offsets or offsets_from, not both')
    if not (isinstance(refine_iters, (int, np.integer)) and refine_iters >= 0):
      raise InputError(f'refine_iters must be a whole number >= 0 (0: off), got {refine_iters!r}')
    if 0 < refine_iters < REFINE_MIN_ITERS:
      warn_caller(f'refine_iters={refine_iters}: a refinement of fewer than {REFINE_MIN_ITERS} '
                  'iterations fits the positions worse than the network alone (its settings '
                  'are tuned at 50: README "Which model for what")')
    if path is None:
      if not Path(inference.SHIPPED_IKGAT).is_dir():
        raise CheckpointError(
            f'no --checkpoint given and the shipped default {inference.SHIPPED_IKGAT} does not '
            'exist yet: pass --checkpoint=RUN_OR_CHECKPOINT_DIR (a training workdir works)')
      path = inference.SHIPPED_IKGAT
    if isinstance(expected_rig, str):
      try:
        expected_rig = get_rig(expected_rig)
      except KeyError as e:
        raise InputError(str(e.args[0]) if e.args else str(e)) from None
    path = inference.resolve_checkpoint(path)  # a shipped name -> its directory (the source)
    model, meta = inference.load_model(path, expected_rig=expected_rig)
    if (attention == 'auto' and inference.live_backend() is not None
        and (default_workers() if workers is None else workers) != 1):
      # In a live process the sparse form's chunks all run on XLA's one pool thread, so
      # several workers' chunks take turns; the dense ones run on the workers' own threads
      # (1.7x the clip's frames/s on 2 cores; BENCHMARKS.md, issue N session 34).
      attention = 'dense'
    try:
      gat.set_form(model, attention)  # static: before the forward is built
    except ValueError:
      raise InputError(f"attention must be 'dense', 'sparse' or 'auto', got {attention!r}"
                       ) from None
    try:
      model_lib.set_matmul_precision(model, matmul_precision)
    except ValueError as e:
      raise InputError(str(e)) from None
    if offsets_from is not None:
      offsets = exports.read_bvh_offsets(offsets_from, model.rig, joint_map=joint_map,
                                         units=bvh_units)
    # A joint-chart prior (the shipped one) serves only its own rig's binds: not another's.
    rig = (model.rig if reference_pose is None
           else _with_reference_pose(model.rig, reference_pose))
    prior = _refine_prior(refine_prior, rig) if refine_iters > 0 else None
    if refine_iters > 0 and prior is None and str(refine_prior) == 'shipped':
      warn_caller(f'refine_prior=\'shipped\': the shipped pose prior does not fit rig '
                  f'{rig.name!r} (another rig, or its joints under another bind), so the '
                  'refinement runs without a prior (train one for it: experiments.train_prior '
                  'or train_rig, and pass it as refine_prior / --refine_prior; none is quiet)')
    return cls(model, meta, offsets=offsets, block_size=block_size, source=str(path),
               refine_iters=refine_iters, temporal_filter=temporal_filter, fps=fps,
               refine_prior=prior, mirror=mirror, workers=workers, hold_missing=hold_missing,
               subject_calibration=subject_calibration, reference_pose=reference_pose,
               size_normalization=size_normalization)


  # -- offsets ------------------------------------------------------------------------------

  def _template_offsets(self) -> np.ndarray:
    try:
      return check_offsets(self.rig.template(), self.rig)
    except RigError:
      raise InputError(f'rig {self.rig.name!r} of this checkpoint has no template offsets: '
                       'give the subject\'s offsets (or --offsets_from=BVH)') from None

  def resolve_offsets(self, positions: np.ndarray | None = None, offsets=None,
                      estimate_lengths: bool = False) -> np.ndarray:
    """The subject for one solve: `offsets` or the solver's default, bone lengths from
    `positions [T, J, 3]` (metres, rig axes) when `estimate_lengths`."""
    off = self.offsets if offsets is None else check_offsets(offsets, self.rig)
    if estimate_lengths:
      if positions is None:
        raise InputError('estimate_lengths needs the input positions')
      off = check_offsets(estimate_offsets(positions, off, self.rig), self.rig)
    return off

  def _calibration_offsets(self, offsets: np.ndarray) -> np.ndarray:
    """`offsets`, for the subject calibration; warns once per subject where their bones point
    as the template's do (no subject offsets given, or only its lengths): the calibration
    then fits the template's hips and shoulders, not the subject's, which raises the error
    against the subject's own rotations (BENCHMARKS.md "Without the subject's offsets")."""
    key = np.asarray(offsets, np.float64).tobytes()
    if key in self._calibration_offsets_seen:
      return offsets
    if len(self._calibration_offsets_seen) > 64:  # bounded in a long-running process
      self._calibration_offsets_seen.clear()
    self._calibration_offsets_seen.add(key)
    try:
      template = self.rig.template()
    except RigError:
      return offsets
    unit = lambda o: o / np.maximum(np.linalg.norm(o, axis=-1, keepdims=True), 1e-12)
    if np.allclose(unit(np.asarray(offsets, np.float64)), unit(template), atol=1e-6):
      warn_caller('subject calibration with the template\'s rest offsets, not the '
                  'subject\'s: it fits the template\'s hips and shoulders and raises the error; '
                  'give the subject\'s offsets (offsets=, --offsets_from=BVH, an npz\'s '
                  '`offsets`) or leave the calibration off')
    return offsets

  def _device_subject(self, offsets: np.ndarray,
                      check: bool = True) -> tuple[jax.Array, jax.Array, np.ndarray]:
    """(offsets, B) on device, float32, and B float64 on the host; cached per subject, whose
    rest pose is checked (`check_rest_pose`) when it is new and `check`."""
    key = np.asarray(offsets, np.float64).tobytes()
    entry = self._frames_cache.get(key)  # held here: another thread may clear the cache
    if entry is None:
      if check:
        check_offsets_size(offsets, self.rig)
        check_rest_pose(offsets, self.rig)
      B = bone_frames_lib.bone_frames_np(offsets, self.rig)
      if len(self._frames_cache) > 16:
        self._frames_cache.clear()
      entry = self._frames_cache[key] = (jnp.asarray(offsets, jnp.float32),
                                         jnp.asarray(B, jnp.float32), B)
    return entry

  # -- inputs -------------------------------------------------------------------------------

  def prepare(self, positions, *, units: str | float | None = None,
              input_axes: str | np.ndarray | None = None,
              check: bool = True) -> tuple[np.ndarray, bool]:
    """Checks and converts input positions to `[T, J, 3]` metres in rig axes (module doc).
    NaN joints pass when the model takes joint masks (no plausibility check then); with
    `hold_missing` they are filled from earlier frames of the clip (`hold_missing_joints`)."""
    arr, single = check_positions(positions, self.rig,
                                  allow_missing=self.supports_masks or self.hold_missing,
                                  said=self._said)
    arr, scale = self._to_rig(arr, units, input_axes)
    check_extent(arr)
    if self.hold_missing:
      arr, _ = hold_missing_joints(arr, None, self.rig)
    if check and all_finite(arr):  # single frames (a live loop calling solve): each kind once
      check_plausibility(arr, self.rig, scale, self._said if len(arr) == 1 else None,
                         None if input_axes is None else parse_input_axes(input_axes, self.rig))
    return arr, single

  def _to_rig(self, arr: np.ndarray, units, input_axes) -> tuple[np.ndarray, float]:
    """`arr [T, J, 3]` in `units` and `input_axes` -> (metres in rig axes, metres per input
    unit); the same array when both are None (the input is in them already)."""
    if units is None and input_axes is None:
      return arr, 1.0
    scale = parse_units(units)
    M = parse_input_axes(input_axes, self.rig)
    if scale != 1.0 or not np.array_equal(M, np.eye(3)):
      arr = (arr.reshape(-1, 3) @ (scale * M.T)).reshape(arr.shape)
    return arr, scale

  # -- solving ------------------------------------------------------------------------------

  def sparse_inputs(self, pos: np.ndarray, mask=None, orientations=None,
                    orientation_mask=None, end_sites=None) -> dict[str, np.ndarray] | None:
    """Checks the optional sparse inputs of `pos [T, J, 3]` (module docstring) -> the model's
    extra inputs (`joint_mask`, `orientations`, `orientation_mask`, `end_sites`,
    `end_site_mask`), or None without any. `end_sites` in metres, rig axes. `pos` as
    `check_positions` gives it: every joint finite unless the model takes joint masks, so with
    no sparse input and no masks there is nothing to check (no second pass over a live frame)."""
    if (mask is None and orientations is None and end_sites is None
        and not self.supports_masks):
      return None
    T, J = pos.shape[:2]
    out = {}
    if mask is not None or not all_finite(pos):
      finite = np.isfinite(pos).all(-1)
      if not self.supports_masks:
        if mask is None:
          check_finite(pos, self.rig)  # the usual error, naming the frame and joint
        raise InputError('this checkpoint was trained without joint masks (config.model.'
                         'joint_mask=False): it needs every joint; train one with joint_mask')
      m = finite if mask is None else finite & np.broadcast_to(
          np.asarray(mask, bool).reshape((-1, J)), (T, J))
      out['joint_mask'] = m
    if orientations is not None:
      if not self.orientation_inputs:
        raise InputError('this checkpoint takes no orientation inputs (config.model.'
                         'orientation_inputs is empty)')
      o = np.asarray(orientations, np.float32).reshape((-1, J, 3, 3))
      if o.shape[0] not in (1, T):
        raise InputError(f'orientations hold {o.shape[0]} frames, positions {T}')
      given = np.ones((T, J), bool) if orientation_mask is None else np.broadcast_to(
          np.asarray(orientation_mask, bool).reshape((-1, J)), (T, J))
      out['orientations'] = np.broadcast_to(o, (T, J, 3, 3))
      out['orientation_mask'] = given & np.isfinite(out['orientations']).all((-1, -2))
    if end_sites is not None:
      if not self.end_sites:
        raise InputError('this checkpoint takes no end sites (config.model.end_sites=False)')
      E = len(self.rig.leaves)
      e = np.asarray(end_sites, np.float32)
      if e.shape[-2:] != (E, 3) or e.reshape((-1, E, 3)).shape[0] not in (1, T):
        raise InputError(f'end_sites must be [{T}, {E}, 3] (leaves '
                         f'{", ".join(self.rig.joint_names[k] for k in self.rig.leaves)}), '
                         f'got {list(e.shape)}')
      e = np.broadcast_to(e.reshape((-1, E, 3)), (T, E, 3))
      given = np.isfinite(e).all(-1)
      out['end_sites'] = np.where(given[..., None], e, 0.0).astype(np.float32)
      out['end_site_mask'] = given
    if out and self.refine is not None:
      raise InputError('refinement (refine_iters) needs every joint and takes no orientations '
                       'or end sites')
    if self.mirror and ('orientations' in out or 'end_sites' in out):
      raise InputError('mirror averaging takes positions (and a joint mask), not orientations '
                       'or end sites: turn it off (mirror=False) for these inputs')
    return out or None

  @staticmethod
  def _signature(bucket: int, full: bool, sparse: dict | None) -> tuple:
    """What a clip chunk's compiled forward depends on (the model and rig are the solver's)."""
    return bucket, full, tuple(sorted((k, v.shape[1:]) for k, v in (sparse or {}).items()))

  def _run(self, pos: np.ndarray, subject, full: bool,
           sparse: dict[str, np.ndarray] | None = None,
           bucket: int | None = None) -> dict[str, np.ndarray]:
    """One chunk `[n <= block, J, 3]` through its bucket (or `bucket`); outputs trimmed to n,
    numpy."""
    return _execute(self._chunk_job(pos, subject, full, sparse, bucket))

  def _chunk_job(self, pos: np.ndarray, subject, full: bool,
                 sparse: dict[str, np.ndarray] | None = None,
                 bucket: int | None = None) -> tuple:
    """(executable, arguments, n) of one chunk, compiled or loaded here (in the calling thread,
    so chunks run by several threads never compile the same shape twice); `_execute` runs it."""
    n = pos.shape[0]
    b = bucket or bucket_for(n, self.buckets)
    self._compiled.add(self._signature(b, full, sparse))
    pad = lambda a: np.concatenate([a, np.repeat(a[-1:], b - n, axis=0)]) if b > n else a
    pos = pad(pos)
    if sparse is not None:  # numpy into the executable: its own transfer (~0.1 ms less per call)
      sparse = _numpy_inputs({k: pad(v) for k, v in sparse.items()})
    off, B, _ = subject
    # A bucket the network runs in blocks: the chunk's frame count, so its padding's blocks
    # are skipped (one shape serves every chunk size; `inference.ikgat_infer`).
    mb = inference.micro_batch_size()
    num_valid = np.int32(n) if mb and b > mb else None
    args = (self._leaves, np.asarray(pos, np.float32), off, B, sparse, num_valid)
    if self.workers > 1 and inference.live_backend() is not None:
      # Synchronous dispatch runs a call taking numpy arguments one at a time across threads;
      # with device arrays the workers' chunks run at once (BENCHMARKS.md, N session 33).
      args = args[:1] + tuple(jax.device_put(args[1:]))
    return self._executable(full, args), args, n

  def _executable(self, full: bool, args: tuple):
    """The forward compiled ahead (`lower().compile()`) for `args` = (leaves, positions,
    offsets, B, sparse, num_valid): once per argument signature and process (`_compiled_for`)."""
    # positions [b, J, 3] and the sparse inputs vary; offsets and B are the rig's float32 arrays.
    pos, sparse = args[1], args[4]
    signature = (full, pos.shape, pos.dtype.str, None if sparse is None else tuple(
        (k, v.shape, v.dtype.str) for k, v in sorted(sparse.items())))
    return self._compiled_for(signature, args,
                              lambda: self._forward.lower(args[0], *args[1:4], full, *args[4:]),
                              self._one_frame if pos.shape[0] == 1 else self._options)

  def _compiled_in(self, offsets: np.ndarray | None = None
                   ) -> tuple[list, np.ndarray, np.ndarray]:
    """What `step`'s executables on the solver's own subject (or `offsets`) compile in as
    constants: the model state's leaves as numpy (`_host_constants`, made once), the subject's
    float32 offsets and bone frames."""
    if self._const_leaves is None:
      self._const_leaves = _host_constants(self._leaves)
    subject = self.offsets if offsets is None else offsets
    off, B = (np.asarray(a) for a in self._device_subject(subject)[:2])
    return self._const_leaves, off, B

  def _default_step(self):
    """`step`'s executable for the solver's own subject (`self.offsets`), no sparse input: one
    frame `[1, J, 3]` float32 -> local `[J, 3, 3]`, with the model's state and the subject's
    offsets and bone frames compiled in as constants, so a call passes the frame alone. Each
    array argument costs a call about 1.6 us on the CPU: the base model's 23 state arrays and
    the subject as arguments took 0.05 ms of a 0.30 ms live frame (BENCHMARKS.md, issue N,
    session 30); the outputs are bit for bit the same. One copy of the weights in this
    executable; the clip path's buckets take them as arguments (big models, many buckets)."""
    if self._step_exec is None:
      self._step_exec = self._own_exe('step', self._offsets)
    return self._step_exec

  def _own_exe(self, kind: str, offsets: np.ndarray, compile: bool = True):
    """`step`'s executable of `kind` for the subject `offsets`, compiled in: 'step' (the frame
    alone, `_default_step`) or 'step filtered' (the temporal filter's state and the frame,
    `_step_filtered_own`); not installed. `compile=False`: None unless the process or the
    executable cache holds it already."""
    leaves, off, B = self._compiled_in(offsets)
    x = np.zeros((1, self.rig.num_joints, 3), np.float32)
    digest = _constants_digest((leaves, off, B))
    if kind == 'step':
      forward = self._forward
      step = jax.jit(lambda p: forward(leaves, p, off, B, False)['local_rot'][0])
      return self._compiled_for(('step', digest), (x,), lambda: step.lower(x), self._one_frame,
                                compile)
    stream_step, fstate = self._stream_step, temporal.init_state(self.rig.num_joints)
    return self._compiled_for(
        ('step filtered', digest, repr(self.temporal_filter), self._fps), (fstate, x),
        lambda: jax.jit(lambda fs, p: stream_step(leaves, fs, p, off, B)).lower(fstate, x),
        self._one_frame, compile)

  def _any_exe(self, kind: str, compile: bool = True):
    """`step`'s executable of `kind` ('step' or 'step filtered') taking any subject as
    arguments, for one frame without sparse inputs (`_step_any`, `_filtered_any`); with
    `compile=False`, None unless compiled or cached already."""
    off, B = self._device_subject(self.offsets)[:2]
    x = np.zeros((1, self.rig.num_joints, 3), np.float32)
    if kind == 'step':
      return self._step_any((x, off, B, None), compile)
    fstate = temporal.init_state(self.rig.num_joints)
    return self._filtered_any((fstate, x, off, B, None), None, compile)

  def _own_or_none(self, kind: str):
    """`step`'s own-subject executable of `kind` ('step', or 'step filtered' with a temporal
    filter) when ready; None while it compiles in a background thread, which it does when a
    program taking any subject is compiled already (`warm_up`, or a `step(offsets=...)`): the
    frames of a new subject then run on that one (about 0.5 ms instead of 0.3 on two cores)
    instead of waiting seconds for their own program. Otherwise compiled here, as before."""
    have = self._step_exec if kind == 'step' else self._stream_execs.get('own subject')
    if have is not None:
      return have
    pending = self._pending.get(kind)
    if pending is not None and pending.is_alive():
      return None
    target, execs = self._offsets, self._stream_execs
    exe = self._own_exe(kind, target, compile=False)
    if exe is None and pending is None and self._any_exe(kind, compile=False) is not None:

      def work():
        try:
          self._install(kind, target, execs, self._own_exe(kind, target))
        except Exception:  # pylint: disable=broad-except  (the foreground compiles it and says)
          pass

      self._pending[kind] = threading.Thread(target=work, daemon=True,
                                             name=f'ik_gat_jax {kind} compile')
      self._pending[kind].start()
      return None
    exe = exe or self._own_exe(kind, target)  # a failed background compile: here, raising
    self._install(kind, target, execs, exe)
    return exe

  def _install(self, kind: str, target: np.ndarray, execs: dict, exe) -> None:
    """Makes `exe` the own-subject executable of `kind` unless the subject (or, for the
    filtered one, the filter) changed since it was asked for."""
    if self._offsets is not target:
      return
    if kind == 'step':
      self._step_exec = exe
    elif self._stream_execs is execs:
      execs['own subject'] = exe
    self._pending.pop(kind, None)

  def _wait_for_compiles(self) -> None:
    """Joins the background compiles of `_own_or_none` (before timing `step`)."""
    for t in list(self._pending.values()):
      t.join()

  def warm_up(self) -> None:
    """Compiles (or loads from the caches) what a live stream's `step` runs, before its first
    frame: the program for the solver's own subject and one that takes any subject, with the
    temporal filter where one is set. Afterwards a new subject (assigned `offsets`, or a new
    solver of the process with its own) does not stall: its first frames run on the second
    while its own compiles in a background thread (README, "One stream per solver")."""
    kind = 'step' if self._stream_step is None else 'step filtered'
    self._any_exe(kind)
    self._own_or_none(kind)
    self._wait_for_compiles()

  def _compiled_for(self, signature: tuple, args: tuple, lower: Callable[[], Any],
                    options: dict | None, compile: bool = True):
    """`lower().compile(options)` for `args`, once per `signature` and process (`options`: XLA's,
    a function of the signature: `_options`, or `_one_frame` for one frame). Once the command line
    turned its caches on (`compile_cache.executables_dir()`), a signature compiled by an earlier
    run is loaded from the executable cache, skipping tracing and lowering too (0.3 s of a CLI
    solve); its entry's name hashes the model's graph definition and state shapes, the
    refinement, the block size of the forward, the signature (`step`'s: a digest of what it
    compiles in) and every argument's shape and dtype (compile_cache.py adds the code,
    versions, devices, CPU and flags). `compile=False`: None where nothing holds it yet."""
    exe = self._executables.get(signature)
    if exe is not None:
      return exe
    if self._description is None:
      self._description = (f'ik_gat_jax.solver forward\n{self._graphdef!r}\n{self._treedef}\n'
                           f'{[(x.shape, x.dtype.name) for x in self._leaves]}\n'
                           f'refine={self.refine!r}\nprior={self._prior!r}\n'
                           f'mirror={self.mirror}\n'
                           f'size_normalization={self.size_normalization}\n'
                           f'rig={self.rig.fingerprint()}\n'
                           f'reference_pose={self.rig.reference_pose!r}\n'
                           f'matmul_precision={self.matmul_precision}\n'
                           f'micro_batch={inference.micro_batch_size()}'
                           f' of {inference.MICRO_BATCH_CPU}')
    avals = [(np.shape(a), str(a.dtype)) for a in jax.tree.leaves(args)]
    key = compile_cache.executable_key(
        f'{self._description}\n{signature}\n{jax.tree.structure(args)}\n{avals}\n'
        f'{sorted((options or {}).items())}')
    exe = _PROCESS_EXECUTABLES.get(key)
    if exe is None:
      on_disk = compile_cache.executables_dir() is not None
      exe = compile_cache.load_executable(key) if on_disk else None
      if exe is None and not compile:
        return None
      if exe is None:
        exe = compile_cache.compile_for_entry(key if on_disk else None, lower, args, options)
      # What it compiles in: `step`'s executables hold the model's state (`_compiled_in`).
      held = (sum(x.nbytes for x in self._leaves) if str(signature[0]).startswith('step')
              else 0)
      _PROCESS_EXECUTABLES.put(key, exe, held)
    self._executables[signature] = exe
    return exe

  def solve(self, positions, *, offsets=None, estimate_lengths: bool = False,
            units: str | float | None = None, input_axes: str | np.ndarray | None = None,
            full: bool = False, check: bool = True, progress: bool | None = None,
            mask=None, orientations=None, orientation_mask=None, end_sites=None,
            fit_offsets: bool = False):
    """Solves a clip `[T, J, 3]` or one frame `[J, 3]` (rig joint order).

    Returns local rotations `[T, J, 3, 3]` (`[J, 3, 3]` for one frame), float32 numpy; with
    `full=True` a `Solution` (always with the frame axis). `progress`: None shows a bar on
    stderr when T > block_size. Raises InputError; warns on likely unit/axis problems.
    `mask [T, J]` / `[J]` (1 = observed; NaN joints count as missing too), `orientations
    [T, J, 3, 3]` / `[J, 3, 3]` and `orientation_mask`, `end_sites [T, E, 3]` / `[E, 3]` (in
    the positions' units and axes; NaN = not given): sparse inputs (module docstring).
    `offsets [J, 3]`: the subject's rest offsets (module docstring), in the positions' units and
    axes, converted with them (the solver's default subject: metres, rig axes).
    `fit_offsets` (with `full`): the Solution's offsets fitted to the input after solving
    (`fitted_offsets`; the rotations unchanged, the FK outputs and bone frames from them).
    """
    if fit_offsets and estimate_lengths:
      raise InputError('give estimate_lengths or fit_offsets, not both (fit_offsets fits the '
                       'lengths too)')
    if fit_offsets and not full:
      raise InputError('fit_offsets sets the Solution\'s offsets: ask for full=True')
    pos, single = self.prepare(positions, units=units, input_axes=input_axes, check=check)
    if end_sites is not None:  # the positions' units and axes (NaN = not given)
      with np.errstate(invalid='ignore'):
        end_sites = (np.asarray(end_sites, np.float64) * parse_units(units)) @ parse_input_axes(
            input_axes, self.rig).T
    if offsets is not None and (units is not None or input_axes is not None):
      offsets = _offsets_as_positions(check_offsets(offsets, self.rig), parse_units(units),
                                      parse_input_axes(input_axes, self.rig), self.rig)
    sparse = self.sparse_inputs(pos, mask, orientations, orientation_mask, end_sites)
    if self.window > 1:  # the same causal windows as a stream of these frames (windows.py)
      sparse = {'history': windows.clip_history(pos, self.window, self.window_ratio)}
    if sparse is not None and 'joint_mask' in sparse and (estimate_lengths or fit_offsets):
      raise InputError(f'{"fit_offsets" if fit_offsets else "estimate_lengths"} needs every '
                       'joint; give the subject\'s offsets')
    off = self.resolve_offsets(pos, offsets, estimate_lengths)
    if not estimate_lengths and sparse is None:
      off = template_at_size(pos, off, self.rig)
      if self.refine is not None:
        check_refined_scale(pos, off, self.rig)
    subject = self._device_subject(off)
    out = self._solve_chunks(pos, subject, full, progress, sparse)
    if self.temporal_filter.active and len(pos) > 1:
      out = self._filter_clip(out, pos, subject)
    if self.subject_calibration:
      local, _ = subject_calibration_lib.calibrate_clip(out['local_rot'], pos,
                                                        self._calibration_offsets(off), self.rig)
      root = out['positions_fk'][:, 0] if 'positions_fk' in out else pos[:, 0]  # refined: fitted
      out = self._with_local(out, local, root, subject)
    if fit_offsets:  # the rotations kept; the skeleton and its FK from the fitted offsets
      off = fitted_offsets(out['global_rot'], pos, off, self.rig)
      subject = self._device_subject(off, check=False)  # the model's rest pose, fitted
      # The root at the input's: the fitted offsets reproduce the input from there (a
      # refinement's fitted root translation was fitted for the offsets just replaced).
      out = self._with_local(out, out['local_rot'], pos[:, 0], subject)
    out = {k: _writable(v) for k, v in out.items()}  # a filter's or a refinement's: device views
    if not full:
      return out['local_rot'][0] if single else out['local_rot']
    return Solution(positions=pos.astype(np.float32), offsets=np.array(off),  # the caller's copy
                    bone_frames=_writable(subject[2]), **out)

  def _solve_chunks(self, pos: np.ndarray, subject, full: bool, progress: bool | None,
                    sparse: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    T, J = pos.shape[:2]
    shift = None
    if self.window <= 1:  # a window model's history is in the clip's own coordinates
      pos, sparse, shift = near_origin(pos, sparse)
    shapes = {'local_rot': (J, 3, 3)}
    if full:
      shapes.update(global_rot=(J, 3, 3), bone_aligned_rot=(J, 3, 3), positions_fk=(J, 3))
    out = {k: np.empty((T,) + s, np.float32) for k, s in shapes.items()}
    bar = _ProgressBar(T, T > self.block_size if progress is None else progress)
    jobs = []
    plan = self._chunk_plan(T)
    for start, n, bucket in plan:
      part = None if sparse is None else {k: v[start:start + n] for k, v in sparse.items()}
      if bucket is None and len(plan) > 1 and self._signature(
          bucket_for(n, self.buckets), full, part) not in self._compiled:
        # A long clip's last chunk outside the blocked plan: its own bucket only when compiled
        # already, else a whole chunk (another shape would trace, lower and compile).
        bucket = plan[0][1]
      jobs.append(self._chunk_job(pos[start:start + n], subject, full, part, bucket))
    workers = min(self.workers, len(jobs))
    pool = concurrent.futures.ThreadPoolExecutor(workers) if workers > 1 else None
    try:
      for (start, n, _), chunk in zip(plan, pool.map(_execute, jobs) if pool
                                      else map(_execute, jobs)):
        for k, v in chunk.items():  # in order
          out[k][start:start + len(v)] = v
        bar.update(start + n)
    finally:
      if pool is not None:
        pool.shutdown(cancel_futures=True)
    if shift is not None and 'positions_fk' in out:
      out['positions_fk'] += shift.astype(np.float32)
    return out

  def _chunk_plan(self, T: int) -> list[tuple[int, int, int | None]]:
    """`(start, frames, bucket)` of each chunk of a T-frame clip, in order (bucket None: the
    chunk's own, `bucket_for`).

    Where the network runs in blocks (`inference.micro_batch_size()` below `block_size`, the
    CPU) a clip of more than one block is cut at block boundaries into as few chunks as fit
    `block_size`, their number rounded up to a multiple of `workers`, the blocks shared out
    evenly; every chunk runs in the `block_size` bucket, which skips its padding's blocks
    (`num_valid`). So a clip computes at most one block of padding, every worker gets the same
    work within a block, and any clip length needs one compiled shape. Otherwise (an
    accelerator, `block_size` at most one block, or a refinement, which runs on every frame of
    a chunk, padding included) chunks of `block_size`, or with several workers and a clip
    shorter than workers x block_size one chunk per worker (a bucket of at least one block)."""
    S, mb = self.block_size, inference.micro_batch_size()
    if T <= S and (not mb or S <= mb or T <= mb):
      return [(0, T, None)]
    if not mb or S <= mb or self.refine is not None:
      size = S
      if self.workers > 1 and mb and 2 * mb <= T < self.workers * S:
        size = bucket_for(min(max(-(-T // self.workers), mb), S), self.buckets)
      return [(start, min(size, T - start), None) for start in range(0, T, size)]
    blocks, per_chunk = -(-T // mb), S // mb
    chunks = -(-blocks // per_chunk)
    if self.workers > 1:
      chunks = min(blocks, -(-chunks // self.workers) * self.workers)
    q, r = divmod(blocks, chunks)
    plan, start = [], 0
    for i in range(chunks):
      n = min((q + (i < r)) * mb, T - start)
      plan.append((start, n, S))
      start += n
    return plan

  def _filter_clip(self, out: dict[str, np.ndarray], pos: np.ndarray,
                   subject) -> dict[str, np.ndarray]:
    """The temporal filter over a whole clip (fresh state); FK outputs from the filtered R, the
    root where `out` has it (a refinement's fitted root, not the input's)."""
    local = temporal.filter_clips(out['local_rot'], np.zeros(len(pos)), self.temporal_filter,
                                  self.fps)
    root = out['positions_fk'][:, 0] if 'positions_fk' in out else pos[:, 0]
    return self._with_local(out, local, root, subject)

  def _with_local(self, out: dict[str, np.ndarray], local: np.ndarray, root: np.ndarray,
                  subject) -> dict[str, np.ndarray]:
    """`out` with new local rotations and, where `out` has them, the FK outputs from them
    (the root at `root [T, 3]`)."""
    T = len(root)
    new = {'local_rot': np.asarray(local, np.float32)}
    if 'global_rot' in out:
      L = padding.power_of_two(T)  # padded: few compiled shapes
      pad = lambda a: jnp.asarray(padding.pad_rows(a, L), jnp.float32)
      off, B, _ = subject
      G, p = _fk_jit(pad(local), off, pad(root), self.rig)
      new.update(global_rot=np.asarray(G)[:T], bone_aligned_rot=np.asarray(G @ B)[:T],
                 positions_fk=np.asarray(p)[:T])
    return new

  def _filter_stream(self, local: np.ndarray) -> np.ndarray:
    """The temporal filter on the next `[n, J, 3, 3]` frames of the live stream (state kept)."""
    if not self.temporal_filter.active:
      return local
    state = self._filter_state or temporal.init_state(self.rig.num_joints)
    n = local.shape[0]
    if n == 1:
      state, out = temporal.filter_step_jit(state, jnp.asarray(local[0]), self.temporal_filter,
                                            self.fps)
      out = out[None]
    else:  # padded to its bucket; padding leaves the state alone
      b = bucket_for(n, self.buckets)
      R = np.concatenate([local, np.repeat(local[-1:], b - n, axis=0)])
      state, out = temporal.filter_sequence_jit(jnp.asarray(R), self.temporal_filter, self.fps,
                                                state, None, jnp.arange(b) < n)
    self._filter_state = state
    return np.asarray(out)[:n]

  def reset(self) -> None:
    """Starts a new stream: the temporal filter, a window model's past frames, the held
    joints (`hold_missing`) and the subject's biases (`subject_calibration`) forget the frames
    `step`/`solve_stream` saw."""
    self._filter_state = None
    self._held = None
    self._subject_bias = subject_calibration_lib.SubjectBias()
    self._stream_checked = False  # the next frame is a stream's first: units and axes checked
    if self._history is not None:
      self._history.reset()

  def _check_stream(self, pos: np.ndarray, scale: float = 1.0, input_axes=None,
                    own_subject: bool = False) -> None:
    """A stream's first frame(s) `[n, J, 3]` with every joint: the units and axes checks of
    `solve` (`check_plausibility`; `scale`: the metres per input unit the frames were given
    in; `input_axes`, the axes map they were given with), once per stream (until `reset()`), so a
    live loop fed millimetres or z-up data hears it at its start; the frames after it are not
    checked. With a refinement and the solver's own subject (`own_subject`), also the bones'
    size against its offsets (`check_refined_scale`)."""
    if all_finite(pos):
      self._stream_checked = True
      check_plausibility(pos, self.rig, scale, input_axes=None if input_axes is None else
                         parse_input_axes(input_axes, self.rig))
      if self.refine is not None and own_subject:
        check_refined_scale(pos, self.offsets, self.rig)

  def _stream_history(self, pos: np.ndarray) -> dict[str, np.ndarray] | None:

    """A window model's `history [n, k-1, J, 3]` of the next frames `pos [n, J, 3]` of the
    live stream (pushed into its state), else None."""
    if self._history is None:
      return None
    return {'history': np.stack([self._history.push(f) for f in pos])}

  def step(self, frame, offsets=None, mask=None, orientations=None,
           orientation_mask=None, end_sites=None, *, units: str | float | None = None,
           input_axes: str | np.ndarray | None = None) -> np.ndarray:
    """One live frame `[J, 3]` (metres, rig axes; else `units` and `input_axes` as `solve`'s)
    -> local rotations `[J, 3, 3]`.

    The cheap checks (shape, finite; units and axes on a stream's first frame); compiled once.
    With a temporal filter the output is filtered with the stream's state (kept until
    `reset`). `offsets`: this frame's subject, if not the solver's, in the frame's units and
    axes as `solve`'s (a new person in the same stream is not a new stream: call `reset()`, or
    assign `solver.offsets`, which does).
    `mask`, `orientations`,
    `orientation_mask`, `end_sites`: sparse inputs of this frame (`[J]`, `[J, 3, 3]`, `[E, 3]`;
    module docstring; metres, rig axes). On a CPU with several cores, a process that serves
    live frames starts
    JAX with `ik_gat_jax.start_live_backend()` first: a frame then runs on the calling thread,
    1.4-1.9x faster on two cores (`inference.start_live_backend`; BENCHMARKS.md, issue N
    sessions 33-34).
    """
    if not self._stream_busy.acquire(blocking=False):
      raise self._busy_error()
    try:
      if offsets is not None and (units is not None or input_axes is not None):
        offsets = self._given_offsets(offsets, units, input_axes)  # as solve's: theirs
      local = self._step(frame, offsets, mask, orientations, orientation_mask, end_sites, units,
                         input_axes)
      if not self.subject_calibration:
        return _writable(local)
      off = self._calibration_offsets(self.offsets if offsets is None else offsets)  # checked
      return _writable(self._calibrate_frame(local, self._step_pos[0], off))
    finally:
      self._stream_busy.release()

  @staticmethod
  def _busy_error() -> InputError:
    return InputError('another thread is in this solver\'s step / solve_stream: a solver '
                      'carries one stream; give each thread its own solver (solve() on clips '
                      'may be shared)')

  def _calibrate_frame(self, local: np.ndarray, position: np.ndarray,
                       offsets: np.ndarray) -> np.ndarray:
    """`step`'s subject calibration of its frame: `subject_calibration.frame_update` compiled
    once per plan (float32), the stream's sums kept in float64 (`SubjectBias`, shared with
    `solve_stream`): 0.07 ms a frame against 0.31 ms for numpy's calls (BENCHMARKS.md "Subject
    calibration", session 39)."""
    bias = self._subject_bias
    p = bias.subject(offsets, self.rig)
    if not p.joints:
      return local
    total, count = bias.sums(len(p.joints))
    args = tuple(np.asarray(a, np.float32) for a in (local, position, offsets, total, count))
    exe = self._compiled_for(
        ('subject calibration', p.signature), args,
        lambda: jax.jit(lambda *a: subject_calibration_lib.frame_update(*a, p=p)).lower(*args),
        self._one_frame)
    out, terms = exe(*args)
    bias.add(np.asarray(terms))
    return np.asarray(out)

  def _step(self, frame, offsets=None, mask=None, orientations=None,
            orientation_mask=None, end_sites=None, units=None, input_axes=None) -> np.ndarray:
    """`step` without the subject calibration (the frame it solved in `_step_pos`)."""
    pos, _ = check_positions(frame, self.rig,
                             allow_missing=self.supports_masks or self.hold_missing,
                             said=self._said)
    if pos.shape[0] != 1:
      raise InputError(f'step takes one frame [{self.rig.num_joints}, 3], got {pos.shape[0]} '
                       f'frames {list(pos.shape)}; use solve() for a clip or solve_stream() '
                       'for batches')
    pos, scale = self._to_rig(pos, units, input_axes)
    check_extent(pos)
    if self.hold_missing:  # the stream's dropouts filled from its earlier frames
      pos, self._held = hold_missing_joints(pos, self._held, self.rig)
    if not self._stream_checked:
      self._check_stream(pos, scale, input_axes, own_subject=offsets is None)
    sparse = self.sparse_inputs(pos, mask, orientations, orientation_mask, end_sites)
    if self.window <= 1:  # as a clip's frames (`near_origin`), the calibration's float32 too
      pos, sparse, _ = near_origin(pos, sparse)
    self._step_pos = pos
    if offsets is None and sparse is None and self._history is None:  # the common live frame
      if self._stream_step is None:  # one argument, one call
        exe = self._own_or_none('step')
        if exe is None:  # a new subject's own program compiling: any subject's meanwhile
          return self._step_forward(pos, self._device_subject(self.offsets))
        return np.asarray(exe(np.asarray(pos, np.float32)))
      return self._step_filtered_own(np.asarray(pos, np.float32))
    off = self.offsets if offsets is None else check_offsets(offsets, self.rig)
    subject = self._device_subject(off)
    sparse = self._stream_history(pos) or sparse  # window models take no other sparse input
    if self._stream_step is None:
      return self._step_forward(pos, subject, sparse)
    return self._step_filtered(pos, subject, sparse)

  def _step_filtered(self, pos: np.ndarray, subject, sparse=None) -> np.ndarray:
    """`step` with the temporal filter: network and filter in one executable compiled ahead
    (once per sparse-input signature), the frame and sparse inputs as numpy, the filter state
    carried as device arrays: pinned, 0.29-0.30 ms a frame against 0.34-0.42 through jit's
    dispatch with `jnp.asarray` first (BENCHMARKS.md, issue N, session 16)."""
    fstate = self._filter_state or temporal.init_state(self.rig.num_joints)
    sparse = _numpy_inputs(sparse)
    args = (fstate, np.asarray(pos, np.float32), subject[0], subject[1], sparse)
    key = None if sparse is None else tuple((k, v.shape, v.dtype.str)
                                            for k, v in sorted(sparse.items()))
    exe = self._stream_execs.get(key) or self._filtered_any(args, key)
    self._filter_state, out = exe(*args)
    return np.asarray(out)

  def _filtered_any(self, args: tuple, key, compile: bool = True):
    """`_step_filtered`'s executable for `args` (filter state, frame, offsets, B, sparse
    inputs; `key` their signature), the model's state compiled in as in `_step_any`; kept per
    signature; with `compile=False`, None unless compiled or cached already."""
    exe = self._stream_execs.get(key)
    if exe is not None:
      return exe
    if self._leaves_digest is None:
      self._leaves_digest = _constants_digest(self._compiled_in()[0])
    stream_step = self._stream_step

    def lower():  # on a miss only (`_compiled_for`: shared by the process's solvers)
      leaves = self._compiled_in()[0]
      return jax.jit(lambda fs, p, o, b, sp: stream_step(leaves, fs, p, o, b, sp)).lower(*args)

    exe = self._compiled_for(
        ('step filtered any subject', self._leaves_digest, repr(self.temporal_filter),
         self._fps, key), args, lower, self._one_frame, compile)
    if exe is not None:
      self._stream_execs[key] = exe
    return exe

  def _step_filtered_own(self, x: np.ndarray) -> np.ndarray:
    """`_step_filtered` on the solver's own subject, no sparse input: the model's state and
    the subject compiled in as constants (`_default_step`), so a call passes the filter state
    and the frame."""
    exe = self._own_or_none('step filtered')  # dropped by a new filter or subject
    if exe is None:  # a new subject's own program compiling: any subject's meanwhile
      return self._step_filtered(x, self._device_subject(self.offsets))
    fstate = self._filter_state or temporal.init_state(self.rig.num_joints)
    self._filter_state, out = exe(fstate, x)
    return np.asarray(out)

  def _step_forward(self, pos: np.ndarray, subject, sparse=None) -> np.ndarray:
    """One frame `[1, J, 3]` (+ its sparse inputs or window history) of any subject -> local
    `[J, 3, 3]`: `_step_any`'s executable called directly, without jit's per-call dispatch or
    `_run`'s padding. The frame goes in as numpy: the executable's own transfer is ~70 us
    faster than `jnp.asarray` first (experiments/latency_breakdown.py, BENCHMARKS.md "One live
    frame")."""
    off, B, _ = subject
    args = (np.asarray(pos, np.float32), off, B, _numpy_inputs(sparse))
    return np.asarray(self._step_any(args)(*args))

  def _step_any(self, args: tuple, compile: bool = True):
    """`step`'s executable for `args` = (one frame `[1, J, 3]`, offsets, B, sparse inputs or
    None) -> local `[J, 3, 3]`: the model's state compiled in as constants, as in
    `_default_step`, the subject and sparse inputs as arguments; once per sparse-input
    signature. With the state as 23 more arguments (before) a frame took 0.54-0.57 ms
    against 0.27 ms on the live backend, 0.34 against 0.30 ms pinned (BENCHMARKS.md, issue N
    session 33)."""
    pos, sparse = args[0], args[3]
    if self._leaves_digest is None:
      self._leaves_digest = _constants_digest(self._compiled_in()[0])
    signature = ('step any subject', self._leaves_digest, pos.shape, None if sparse is None
                 else tuple((k, v.shape, v.dtype.str) for k, v in sorted(sparse.items())))
    forward = self._forward

    def lower():  # on a miss only (`_compiled_for`)
      leaves = self._compiled_in()[0]
      return jax.jit(lambda p, o, b, s: forward(leaves, p, o, b, False, s)['local_rot'][0]
                     ).lower(*args)

    return self._compiled_for(signature, args, lower, self._one_frame, compile)

  def _given_offsets(self, offsets, units, input_axes) -> np.ndarray:
    """Offsets given in the positions' `units` and `input_axes` (`solve`'s contract, and
    `step`'s and `solve_stream`'s) -> `[J, 3]` metres in rig axes, checked."""
    off = check_offsets(offsets, self.rig)
    if units is None and input_axes is None:
      return off
    return _offsets_as_positions(off, parse_units(units), parse_input_axes(input_axes, self.rig),
                                 self.rig)

  def solve_stream(self, frames: Iterable, offsets=None, *, mask=None,
                   units: str | float | None = None,
                   input_axes: str | np.ndarray | None = None) -> Iterator[np.ndarray]:
    """Per item of `frames` (`[J, 3]` or a small batch `[b, J, 3]`, b <= block_size; metres,
    rig axes, else `units` and `input_axes` as `solve`'s): its local rotations, same leading
    shape. The frames of every item are the next frames of one stream, in order (`step`'s:
    its temporal filter, held joints, subject calibration and a window model's history carry
    across items and calls until `reset()`), not several people: solve several people's frames
    with `solve` on `[P, J, 3]` (no stream state), or give each a solver. `mask` `[J]`: the
    joints the trackers give, for every item (a joint-mask checkpoint; NaN joints count as
    missing too, as `step`'s); per-frame orientations or end sites go to `step`."""
    off = (self.offsets if offsets is None else
           self._given_offsets(offsets, units, input_axes))  # as solve's: theirs
    subject = self._device_subject(off)
    for item in frames:
      if offsets is None and off is not self.offsets:  # `solver.offsets = ...` between items
        off = self.offsets
        subject = self._device_subject(off)
      if not self._stream_busy.acquire(blocking=False):
        raise self._busy_error()
      try:
        local, single = self._stream_item(item, off, subject, mask, units, input_axes)
      finally:
        self._stream_busy.release()
      local = _writable(local)
      yield local[0] if single else local

  def _stream_item(self, item, off: np.ndarray, subject, mask, units, input_axes
                   ) -> tuple[np.ndarray, bool]:
    """One item of `solve_stream` -> (local rotations `[b, J, 3, 3]`, whether it was one
    frame `[J, 3]`)."""
    pos, single = check_positions(item, self.rig,
                                  allow_missing=self.supports_masks or self.hold_missing,
                                  said=self._said)
    if pos.shape[0] > self.block_size:  # refused before it changes the stream's state
      raise InputError(f'a stream item holds {pos.shape[0]} frames, more than block_size '
                       f'{self.block_size}; use solve() for clips')
    pos, scale = self._to_rig(pos, units, input_axes)
    check_extent(pos)
    if self.hold_missing:
      pos, self._held = hold_missing_joints(pos, self._held, self.rig)
    if not self._stream_checked:
      self._check_stream(pos, scale, input_axes, own_subject=off is self.offsets)
    sparse = self.sparse_inputs(pos, mask)
    history = self._stream_history(pos)
    if history is not None:  # window models take no other sparse input (as `step`)
      x, sparse = pos, history
    else:
      x, sparse, _ = near_origin(pos, sparse)  # as a clip's frames
    local = self._filter_stream(self._run(x, subject, False, sparse)['local_rot'])
    if self.subject_calibration:  # one frame as `step` calibrates it, a batch by numpy
      cal = self._calibration_offsets(off)
      local = (self._calibrate_frame(local[0], x[0], cal)[None] if len(pos) == 1
               else self._subject_bias.calibrate(local, pos, cal, self.rig))
    return local, single

  @property
  def trace_count(self) -> int:
    """How many times this solver traced (compiled) its forward: once per bucket and `full`,
    once for `step`'s frame of the solver's own subject and once per sparse-input signature of
    `step`'s frame of any subject (`_step_any`); none for those another solver of the process
    compiled already (`_ExecutableCache`) or the executable cache held."""
    return self._traces[0]

  def latency_stats(self, n: int = 200, warmup: int = 5, frame=None) -> dict[str, float]:
    """Single-frame `step` latency (numpy in -> numpy out, compiled, synchronous, temporal
    filter and subject calibration included), ms."""
    frame = (rest_positions_np(self.offsets, self.rig.parents) if frame is None
             else np.asarray(frame, np.float64))
    saved, held = self._filter_state, self._held  # the timing stream must not disturb the user's
    saved_history, bias = copy.deepcopy(self._history), copy.deepcopy(self._subject_bias)
    checked, last = self._stream_checked, self._step_pos
    for _ in range(warmup):
      self.step(frame)
    self._wait_for_compiles()  # a background compile (`_own_or_none`) is not what is timed
    self.step(frame)  # on the program it installed
    times = []
    for _ in range(n):
      t = time.perf_counter()
      self.step(frame)
      times.append(time.perf_counter() - t)
    self._filter_state, self._history, self._held = saved, saved_history, held
    self._subject_bias, self._stream_checked, self._step_pos = bias, checked, last
    ms = 1e3 * np.asarray(times)
    return {'n': int(n), 'median_ms': float(np.median(ms)),
            'p99_ms': float(np.percentile(ms, 99)), 'mean_ms': float(ms.mean()),
            'frames_per_s': float(1e3 / np.median(ms)), 'backend': jax.default_backend(),
            'live_backend': inference.live_backend() is not None,
            'temporal_filter': self.temporal_filter.describe()}
