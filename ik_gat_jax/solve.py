r"""Solve joint positions to joint rotations from the command line (DESIGN section 9).

  python -m ik_gat_jax.solve --input=FILE --output=FILE [--checkpoint=DIR] \
      [--offsets_from=BVH] [--units=m] [--input_axes=x,y,z] [--fps=30] \
      [--joint_map=JSON] [--reference_pose=zero|first_frame] \
      [--estimate_lengths | --fit_offsets] \
      [--bvh_units=UNITS] [--joint_names=input|rig] \
      [--overwrite] [--plot=PNG --plot_frames=0,10,20] [--clip=GIF_OR_DIR] [--smpl_npz=FILE] \
      [--filter=none|one_euro --filter_min_cutoff=HZ --filter_beta=B] [--subject_calibration]
  ik-gat solve ...                                     (the same, as a console script)

Input by extension: .npz (`positions [T, J, 3]`), .csv (one frame per row, J x 3 columns in
rig order, header optional), .bvh (joint positions by FK, the file's own rest offsets; where
its joint map or --reference_pose names a natural pose other than the rig's, its joints' frames
in it make the rotations the file's own: `skeleton.with_reference_pose`). Output
by extension: .bvh (the rig with the subject's offsets, animated, its joints named as the input
named them: a namespace, `Anna:Hips`, and a joint map's source names kept; --joint_names=rig for
the rig's names; for a BVH input in its units and, per joint, the rotation channel order of the
source joint it maps from (ZYX for a joint without one) and, where it has its offsets, with its
leaves' End Sites
and its constant-rotation joints the rig left out written back (its hierarchy), else
centimetres, ZYX and End Sites along the leaves; --bvh_units=cm|m|inch|NUMBER sets the units;
the root's OFFSET 0, the angles continuous over frames), .npz (rotations, FK
positions, offsets and whose: `offsets_source`; `input_missing` where joints were NaN),
.smpl.npz
(SMPL axis-angle pose parameters `[T, 66]`, smpl22 rig only; --smpl_world=amass for AMASS's
z-up world), .glb (glTF 2.0 binary: the rig as nodes named as the .bvh's joints, the motion as
animation, a box body skinned to it; io/gltf.py),
.fbx (the same GLB converted by headless Blender, which must be on PATH; io/blender.py).
Every output is written to a temp file and renamed once everything succeeded; an existing output is
refused without --overwrite; every error is one line on stderr with exit status 2 (bones 4x
off the template's without --units among them: `solver.units_problem`). The command
line (`run`, not `solve_file`) keeps compiled code in a persistent cache, `~/.cache/ik_gat_jax/jax`,
and restored checkpoints in `~/.cache/ik_gat_jax/params` (compile_cache.py;
`IK_GAT_NO_COMPILE_CACHE=1` turns both off), so a second run skips compiling and orbax.
`solve_file` is the same as a library call (no flags read).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, NoReturn

import numpy as np
from absl import app, flags, logging

from ik_gat_jax import compile_cache
from ik_gat_jax import inference
from ik_gat_jax import plots
from ik_gat_jax import solver as solver_lib
from ik_gat_jax import temporal
from ik_gat_jax import trackers as trackers_lib
from ik_gat_jax.errors import CheckpointError, InputError
from ik_gat_jax.io import blender
from ik_gat_jax.io import exports
from ik_gat_jax.io import smpl as smpl_lib

_FLAGS_DEFINED = False


def _stderr(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def output_kind(path: str | Path) -> str:
  """'bvh', 'smpl' (.smpl.npz), 'npz', 'glb' or 'fbx' from the output's extension."""
  name = str(path).lower()
  if name.endswith('.smpl.npz'):
    return 'smpl'
  for ext in ('bvh', 'npz', 'glb', 'fbx'):
    if name.endswith('.' + ext):
      return ext
  raise InputError(f'output {path}: unknown format; use .bvh, .npz, .smpl.npz, .glb or .fbx')


def parse_frames(spec: str | None, num_frames: int | None, default: int) -> list[int]:
  """'0,10,20' or 'start:stop[:step]' -> frame indices; None: `default` evenly spaced frames
  (a list spec) or the first `default` frames (a range spec is clipped to the clip).
  `num_frames` None: the spec's form only (its frames not known yet), [] returned."""
  if spec is None:
    return [] if num_frames is None else sorted(
        {int(round(x)) for x in np.linspace(0, num_frames - 1, min(default, num_frames))})
  try:
    if ':' in spec:
      parts = [int(p) if p.strip() else None for p in spec.split(':')]
      if len(parts) > 3 or parts[2:] == [0]:
        raise ValueError
      if num_frames is None:
        return []
      frames = list(range(num_frames)[slice(*parts)])
    else:
      frames = [int(p) for p in spec.split(',') if p.strip()]
      if num_frames is None:
        return []
  except ValueError:
    raise InputError(f'frames must be like 0,10,20 or 0:60:2, got {spec!r}') from None
  bad = [t for t in frames if not 0 <= t < num_frames]
  if bad or not frames:
    raise InputError(f'frames {bad or spec} outside the clip (0..{num_frames - 1})')
  return frames


def _subject_offsets(source):
  """The input's own offsets, in its positions' units and axes (which `IKSolver.solve`
  converts to metres in rig axes with them), or None for the solver's default: the
  `offsets_from` BVH read by `IKSolver.from_checkpoint`, else the template (see solve_file)."""
  return source.offsets


def solve_file(input: str | Path, output: str | Path, *, checkpoint: str | None = None,
               rig: str | None = None,
               offsets_from: str | None = None, offsets_units: str | None = None,
               joint_map: str | None = None, units: str | None = None,
               input_axes: str | None = None, fps: float | None = None,
               estimate_lengths: bool = False, fit_offsets: bool = False,
               overwrite: bool = False,
               plot: str | None = None, plot_frames: str | None = None,
               clip: str | None = None, clip_frames: str | None = None,
               smpl_npz: str | None = None, smpl_world: str = 'rig',
               bvh_units: str | float | None = None,
               block_size: int | None = None, progress: bool | None = None,
               workers: int | None = None, attention: str = 'dense', refine_iters: int = 0,
               refine_prior: str | None = 'shipped',
               mirror: bool = False, filter_kind: str | None = None,
               filter_min_cutoff: float | None = None,
               filter_beta: float | None = None, filter_d_cutoff: float | None = None,
               latency_frames: int = 0, log: Callable[[str], None] = _stderr,
               trackers: str = 'full', orientations: str | None = None,
               end_sites: str | None = None, matmul_precision: str = 'float32',
               hold_missing: bool = False, subject_calibration: bool = False,
               reference_pose: str | None = None, size_normalization: bool = True,
               joint_names: str = 'input') -> dict:
  """Reads `input`, solves, writes `output` (+ `smpl_npz`, `plot`, `clip`); returns a summary.

  `rig` (a name or rig JSON) refuses a checkpoint for another rig. Offsets (the subject R is
  relative to): `offsets_from` (a BVH), else the input's own (a BVH's
  rest offsets, an npz's `offsets`), else the checkpoint's template; `fit_offsets` replaces
  them after solving by the ones the solved rotations imply (`solver.fitted_offsets`: the
  written skeleton then reproduces the input; the rotations unchanged); `estimate_lengths`
  rescales them to the input's bone lengths. `units`: metres per input unit (for a BVH: its
  file units, default the joint map's, or cm for a BVH with the rig's joint names).
  `input_axes`: the signed input column per rig axis (`solver.parse_input_axes`), applied after
  units. `fps`:
  the rate of an npz/csv input (default its `fps`, else 30); a BVH is resampled to it (default:
  its own rate, DESIGN section 7 resampling). `latency_frames` > 0 adds the single-frame
  latency (median, p99 ms over that many compiled `step` calls) to the summary. `filter_kind`
  ('none' | 'one_euro') and `filter_*` override fields of the checkpoint's temporal filter
  (temporal.py; none for the shipped checkpoint), run causally over the clip at its rate.
  `refine_prior` (with `refine_iters`): 'shipped' (the shipped pose prior where it is for the
  checkpoint's rig), a prior directory, or 'none' (`IKSolver.from_checkpoint`). `mirror`:
  test-time mirror averaging (`IKSolver.from_checkpoint`). `workers`: threads solving chunks at
  once (None: `solver.default_workers()`). `attention`: 'dense' or 'auto' (the graph
  attention's sparse form for chunks; the same outputs within float32 round-off, 1.2-1.3x the
  frames/s of a long clip on the CPU, a first compile 0.5 s slower; `IKSolver.from_checkpoint`).
  `matmul_precision`: 'float32' or 'bfloat16' (the network's large products with bfloat16
  inputs and float32 sums; `IKSolver.from_checkpoint`).
  `trackers` (a `trackers.tracker_mask` spec) and NaN input joints mark joints missing, and
  `orientations` (an .npy) gives world rotations, for checkpoints trained for them (issue G2).
  `hold_missing`: NaN input joints (tracker dropouts) keep their last seen offset from the root
  instead (`solver.hold_missing_joints`; any checkpoint). `subject_calibration`: the joints whose
  children branch turned by the subject's biases there, measured on the clip's own frames
  (`IKSolver.from_checkpoint`). `size_normalization`: the network sees each body at the rig
  template's size (`IKSolver.from_checkpoint`; default on).
  `end_sites`: an .npy `[T, E, 3]` of the rig leaves' end-site points (input units and axes,
  NaN = not given), or 'bvh' for a BVH input's own End Sites; a checkpoint trained with end
  sites (issue G2) also uses a BVH input's End Sites when `end_sites` is None; 'none' gives none.
  A .bvh `output` is in `bvh_units` (metres per file unit or a name: cm, m, inch, ...; default:
  a BVH input's own units, else cm) with a BVH input's rotation channel order per joint (the
  source joint's, ZYX without one; ZYX for other inputs).
  `joint_names`: 'input' (a .bvh, .glb or .fbx `output` names the joints as the input did,
  where it named them: its namespace, `Anna:Hips`, and a joint map's source names; an npz
  records them as `input_joint_names`) or 'rig' (the rig's names; `exports.output_names`).
  """
  t0 = time.perf_counter()
  if fps is not None and not (math.isfinite(fps) and fps > 0):
    raise InputError(f'--fps must be a positive frame rate, got {fps:g}')
  kind = output_kind(output)
  exports.check_output(output, overwrite)
  if bvh_units is not None:
    exports.bvh_metres_per_unit(bvh_units)  # refuse before solving
  if joint_names not in exports.JOINT_NAMES:
    raise InputError(f'--joint_names must be one of {", ".join(exports.JOINT_NAMES)}, got '
                     f'{joint_names!r}')
  if kind == 'fbx':
    blender.require_blender('FBX output')  # refuse before solving
  for extra in (smpl_npz, plot, clip):
    if extra is not None:
      exports.check_output(extra, overwrite)
  if clip is not None and Path(clip).suffix and Path(clip).suffix.lower() != '.gif':
    raise InputError(f'--clip must be a .gif or a directory (of frame_NNNN.png files), got '
                     f'{clip}')
  _check_distinct({'--output': output, '--smpl_npz': smpl_npz, '--plot': plot, '--clip': clip},
                  {'--input': input, '--offsets_from': offsets_from})
  for spec, given in ((plot_frames, plot), (clip_frames, clip)):
    if spec is not None and given is not None:
      parse_frames(spec, None, 0)  # its form, before the model loads; the range once read
  if not Path(input).is_file():
    raise FileNotFoundError(f'input {input} does not exist')
  load = functools.partial(
      solver_lib.IKSolver.from_checkpoint, checkpoint, expected_rig=rig,
      block_size=solver_lib.DEFAULT_BLOCK if block_size is None else block_size,
      refine_iters=refine_iters,
      offsets_from=offsets_from, joint_map=joint_map,
      refine_prior=None if refine_prior in (None, '', 'none') else refine_prior,
      bvh_units=offsets_units, mirror=mirror, workers=workers, attention=attention,
      matmul_precision=matmul_precision, hold_missing=hold_missing,
      subject_calibration=subject_calibration, size_normalization=size_normalization)
  solver = load()
  rig = solver.rig
  if kind == 'smpl' or smpl_npz is not None:
    smpl_lib.check_smpl_rig(rig)  # refuse before solving
  source = exports.read_positions(input, rig, joint_map=joint_map, bvh_units=units,
                                  bvh_fps=fps, reference_pose=reference_pose)
  M = solver_lib.parse_input_axes(input_axes, rig)
  source = _in_rig_axes(source, M)
  if source.first_dropped is not None:
    log(f'the first frame left out: joint map {source.first_dropped} reads it as the T-pose its '
        'files open with')
  if source.first_kept is not None:
    log(f'the first frame kept: joint map {source.first_kept} leaves out the T-pose its files '
        'open with, and this clip\'s first frame moves on into its second (a clip cut from a '
        'file)')
  if source.reference is not None:  # another bind of the rig: the input's own rotations
    if kind == 'smpl' or smpl_npz is not None:
      raise InputError('SMPL pose parameters are in SMPL\'s own joint frames, and this '
                       'input\'s joints carry others (its reference pose): write .bvh, .npz, '
                       '.glb or .fbx')
    log(f'reference pose: the input\'s joints carry other frames than rig {rig.name}\'s (its '
        'joint map\'s or --reference_pose\'s natural pose), so the rotations are in its own')
    solver = load(reference_pose=source.reference)
    rig = solver.rig
  solver.temporal_filter = temporal.with_overrides(solver.temporal_filter, filter_kind,
                                                   filter_min_cutoff, filter_beta,
                                                   filter_d_cutoff)
  offsets = None if offsets_from is not None else _subject_offsets(source)
  # Which rest pose the rotations are relative to (the summary's and an npz's `offsets`).
  offsets_source = ('fitted' if fit_offsets else 'offsets_from' if offsets_from is not None
                    else 'input' if offsets is not None else 'template')
  if offsets_source == 'template':
    log('offsets: the rig\'s template (the input has none; at the input\'s size where that is '
        '10% or more off), so the rotations are relative to its rest pose; --offsets_from=BVH '
        'gives the subject\'s own, --fit_offsets a skeleton that reproduces the input')
  if (kind == 'smpl' or smpl_npz is not None) and offsets_source in ('template', 'fitted'):
    log('SMPL trans: the root minus the rest root in the written offsets (not the body '
        'model\'s own, which a reader of trans adds): give its rest joints as the input npz\'s '
        '`offsets` for a body model to stand where the input does')
  if fps is not None and source.fps and not source.metres_rig and abs(fps - source.fps) > 1e-9:
    log(f'--fps={fps:g} replaces the input\'s own {source.fps:g} fps: its frames are taken as '
        f'{fps:g} per second, not resampled (a BVH input is resampled)')
  rate = float(fps or source.fps or 30.0)

  solver.fps = rate
  mask, orient = _sparse_inputs(solver, trackers, orientations, len(source.positions))
  ends = _end_sites(solver, end_sites, source)
  if units is None and not (source.metres_rig and joint_map is not None):
    # Units by default (metres; a BVH's: cm by the rig's joint names, or its rig's joint
    # map's): bones 4x off mean other units, and rotations solved from them mean nothing.
    arr = (source.positions if source.metres_rig
           else solver.prepare(source.positions, input_axes=M, check=False)[0])
    problem = solver_lib.units_problem(arr, rig, source.bvh_units_m or 1.0, defaulted=True)
    if problem:
      raise InputError(f'{problem} (no --units given)')
  if source.metres_rig and solver_lib.all_finite(source.positions):
    # Read at the BVH's units already: a units hint names the file's (--units=cm, not 0.18).
    # Its offsets came in the same units, so units that make no human are refused here, by
    # the units (the solver would refuse the offsets, which the user did not give).
    problem = units is not None and solver_lib.units_problem(source.positions, rig,
                                                             source.bvh_units_m or 1.0)
    if problem:
      raise InputError(f'{problem} (--units={units} given)')
    solver_lib.check_plausibility(source.positions @ M.T, rig, source.bvh_units_m or 1.0,
                                  input_axes=M)
  if plot is not None and plot_frames is not None:  # before solving, not after it
    parse_frames(plot_frames, len(source.positions), 4)
  if clip is not None and clip_frames is not None:
    parse_frames(clip_frames, len(source.positions), 60)
  missing = ~np.isfinite(np.asarray(source.positions, np.float64)).all(axis=-1)  # [T, J]
  sol = solver.solve(source.positions, offsets=offsets, estimate_lengths=estimate_lengths,
                     fit_offsets=fit_offsets,
                     units=None if source.metres_rig else units, input_axes=M, full=True,
                     check=not source.metres_rig, progress=progress, mask=mask,
                     orientations=orient, end_sites=ends)
  names, removed = exports.output_names(source, rig, joint_names)
  bvh_out = _bvh_output(source, bvh_units, rig,
                        own_offsets=offsets_source == 'input' and not estimate_lengths,
                        removed=removed)
  with exports.staged([output, smpl_npz, plot, clip], overwrite) as (out, smpl, png, frames):
    record = {'offsets_source': offsets_source + (', lengths estimated' if estimate_lengths
                                                  else ''),
              'input_axes': M, 'input_units_m': (source.bvh_units_m if source.metres_rig
                                                 else solver_lib.parse_units(units))}
    if source.reference is not None:
      record['reference_pose'] = source.reference
    if names is not None:
      record['input_joint_names'] = np.asarray(names)
    _write_main(kind, out, sol, rig, rate, bvh_out, smpl_world, solver, record, missing, names)
    if smpl is not None:
      exports.write_smpl_npz(smpl, sol, rig, rate, world=smpl_world)
    _write_pictures(png, frames, sol, rig, rate, plot_frames, clip_frames)
  err = 1e3 * sol.fk_error_m()
  err = err[np.isfinite(err)] if not np.isfinite(err).all() else err  # missing joints (G2)
  summary = {'frames': sol.num_frames, 'rig': rig.name, 'joints': rig.num_joints,
             'checkpoint': solver.source, 'output': str(output), 'fps': rate,
             'offsets': offsets_source + (', lengths estimated' if estimate_lengths else ''),
             'temporal_filter': solver.temporal_filter.describe(),
             'matmul_precision': solver.matmul_precision,
             'fk_error_mm_mean': float(err.mean()), 'fk_error_mm_max': float(err.max()),
             'seconds': time.perf_counter() - t0}
  bvh_note = ''
  if kind == 'bvh':
    summary.update(bvh_units_m=bvh_out[0], bvh_orders=list(bvh_out[1]))
    bvh_note = f'; BVH {_describe_orders(bvh_out[1])}, {bvh_out[0]:g} m per unit'
  if latency_frames > 0:
    summary['latency'] = solver.latency_stats(n=latency_frames)
    log(f'single-frame latency over {latency_frames} calls: median '
        f'{summary["latency"]["median_ms"]:.2f} ms, p99 {summary["latency"]["p99_ms"]:.2f} ms '
        f'({summary["latency"]["backend"]}'
        f'{", live backend" if summary["latency"]["live_backend"] else ""})'
        f'{_LIVE_HINT if _live_hint(summary["latency"]) else ""}')
  log(f'solved {sol.num_frames} frames ({rig.name}, {rig.num_joints} joints) in '
      f'{summary["seconds"]:.1f} s -> {output}; |input - FK| mean '
      f'{summary["fk_error_mm_mean"]:.1f} mm, max {summary["fk_error_mm_max"]:.1f} mm'
      f'{bvh_note}')
  return summary


def _in_rig_axes(source: exports.PositionsFile, M: np.ndarray) -> exports.PositionsFile:
  """A BVH input's frame-dependent parts that are not positions, turned by `M` (--input_axes:
  rig = M @ input) as the solver turns its positions and offsets: the rotations it solves are
  then the file's conjugated by M (R' = M R M^T), so a vector in a joint's frame turns by M and
  a frame by M F M^T. These are its reference pose's joint frames, the removed joints' offsets
  and constant rotations written back into an output BVH, and its End Sites in the leaves'
  frames (left in the file's axes, every joint under a removed one was written 10-20 cm off
  with z-up files). Positions, offsets and world End Sites are the solver's to turn."""
  if not source.metres_rig or np.array_equal(M, np.eye(3)):
    return source
  turn = lambda v: None if v is None else np.asarray(v, np.float64) @ M.T  # noqa: E731
  frames = lambda F: M @ np.asarray(F, np.float64) @ M.T  # noqa: E731
  removed = source.bvh_removed
  if removed is not None:  # removed[0] is the root's `()`
    removed = tuple(
        (tuple((name, turn(off), frames(C), order) for name, off, C, order in entry[0]),
         turn(entry[1])) if entry and entry[0] else entry for entry in removed)
  return dataclasses.replace(
      source, bvh_removed=removed, end_site_offsets=turn(source.end_site_offsets),
      reference=None if source.reference is None else frames(source.reference))


def _check_distinct(paths: dict, inputs: dict | None = None) -> None:
  """Refuses two outputs (flag -> path or None) that name one file: the last written would
  replace the other, unasked; and an output naming one of the `inputs` (flag -> path or None):
  it would replace the mocap it is solved from, --overwrite or not."""
  read = {Path(p).absolute().resolve(): flag for flag, p in (inputs or {}).items()
          if p is not None}
  seen = {}
  for flag, path in paths.items():
    if path is None:
      continue
    key = Path(path).absolute().resolve()
    if key in read:
      raise InputError(f'{flag} names the file {read[key]} reads ({path}): an output may not '
                       'replace its input; give it its own name')
    if key in seen:
      raise InputError(f'{seen[key]} and {flag} name the same file {path}: give each its own')
    seen[key] = flag


def _bvh_output(source, bvh_units: str | float | None, rig, own_offsets: bool, removed=None
                ) -> tuple[float, tuple[str, ...], np.ndarray | None, tuple | None]:
  """(metres per file unit, rotation order per rig joint, End Sites, removed joints) of an
  output BVH: `bvh_units`, else a BVH input's own units, else cm; a BVH input's orders
  (`PositionsFile.bvh_orders`), else ZYX; a BVH input's End Sites and the joints its reduction
  removed where the output stands on its offsets (`own_offsets`; `PositionsFile.
  end_site_offsets`, and `removed`, `bvh_removed` as `exports.output_names` names them), else
  None (the writer's End Sites, the rig's joints)."""
  if bvh_units is None and source.bvh_units_m is not None:
    units_m = source.bvh_units_m
  else:
    units_m = exports.bvh_metres_per_unit(bvh_units)
  return (units_m, exports.check_rotation_orders(source.bvh_orders, rig),
          source.end_site_offsets if own_offsets else None,
          removed if own_offsets else None)


def _describe_orders(orders) -> str:
  """'channels XZY' or 'channels XZY x20, ZYX x1' (joints per rotation order)."""
  counts = {o: list(orders).count(o) for o in sorted(set(orders))}
  if len(counts) == 1:
    return f'channels {next(iter(counts))}'
  return 'channels ' + ', '.join(f'{o} x{n}' for o, n in counts.items())


def _sparse_inputs(solver, trackers: str, orientations: str | None, T: int):
  """(mask [J] or None, orientations [T, J, 3, 3] or None) from --trackers / --orientations
  (an .npy of world rotations in the rig's axes, NaN = not given); issue G2."""
  mask = orient = None
  if trackers and trackers != 'full':
    mask = trackers_lib.tracker_mask(solver.rig, trackers)
  if orientations:
    orient = np.load(orientations)
    if orient.shape[-3:] != (solver.rig.num_joints, 3, 3) or len(orient) != T:
      raise ValueError(f'--orientations {orientations}: expected [{T}, '
                       f'{solver.rig.num_joints}, 3, 3], got {list(orient.shape)}')
  return mask, orient


def _end_sites(solver, end_sites: str | None, source) -> np.ndarray | None:
  """`[T, E, 3]` end sites (issue G2) from --end_sites (an .npy, 'bvh' or 'none'); by default a
  BVH input's own End Sites when the checkpoint takes end sites."""
  if end_sites == 'none' or (end_sites is None and not (solver.end_sites and
                                                        source.end_sites is not None)):
    return None
  if end_sites in (None, 'bvh'):
    if source.end_sites is None:
      raise ValueError('--end_sites=bvh: the input is not a BVH with End Sites')
    return source.end_sites
  ends = np.load(end_sites)
  T, E = len(source.positions), len(solver.rig.leaves)
  if ends.shape != (T, E, 3):
    leaves = ', '.join(solver.rig.joint_names[k] for k in solver.rig.leaves)
    raise ValueError(f'--end_sites {end_sites}: expected [{T}, {E}, 3] (end sites of {leaves}), '
                     f'got {list(ends.shape)}')
  return ends


def _write_main(kind, path, sol, rig, fps, bvh_out, smpl_world, solver, record: dict,
                missing=None, names=None) -> None:
  """The main output; an npz also records the checkpoint, `record` (`offsets_source`,
  `input_axes [3, 3]` and `input_units_m`: how the input was converted to the rig's metres
  and axes, `reference_pose [J, 3, 3]` where the input named one), the frame's `units` ('m'),
  `up` and `forward` (the rig's axes) and `input_missing [T, J]` where `missing` (the input's
  NaN joints, held or masked in the solution's `positions`) has any. `names`: the joints' names
  in a .bvh, .glb or .fbx (default the rig's)."""
  if kind == 'bvh':
    units_m, orders, end_sites, removed = bvh_out
    exports.write_solution_bvh(path, sol, rig, fps, units=units_m, orders=orders,
                               end_sites=end_sites, removed=removed, names=names)
  elif kind == 'smpl':
    exports.write_smpl_npz(path, sol, rig, fps, world=smpl_world)
  elif kind == 'glb':
    exports.write_solution_glb(path, sol, rig, fps, names=names)
  elif kind == 'fbx':
    exports.write_solution_fbx(path, sol, rig, fps, names=names)
  else:
    extra = {'checkpoint': np.asarray(str(solver.source)), 'units': np.asarray('m'),
             'up': np.asarray(rig.up, np.float32), 'forward': np.asarray(rig.forward, np.float32),
             **{k: np.asarray(v) for k, v in record.items()}}

    if missing is not None and missing.any():
      extra['input_missing'] = missing
    exports.write_npz_atomic(path, exports.solution_arrays(sol, rig, fps, extra))


def default_clip_frames(num_frames: int, fps: float) -> str:
  """--clip's frames when none are given: 60 images about 1/30 s apart (every frame at 30
  fps or less, every 4th at 120), which a GIF plays in real time (`plots.gif_frame_ms`)."""
  step = max(1, int(round(fps / 30.0)))
  return f'0:{min(num_frames, 60 * step)}:{step}'


def _write_pictures(png, frames_out, sol, rig, fps, plot_frames, clip_frames) -> None:
  if png is None and frames_out is None:
    return
  T = sol.num_frames
  if png is not None:
    plots.plot_solve_frames(png, sol.positions, sol.positions_fk, rig,
                            parse_frames(plot_frames, T, 4), sol.bone_aligned_rot)
  if frames_out is not None:
    frames = parse_frames(clip_frames or default_clip_frames(T, fps), T, 60)
    plots.save_solve_clip(frames_out, sol.positions, sol.positions_fk, rig, frames,
                          sol.bone_aligned_rot, fps)


# ----------------------------------------------------------------------------------------------
# The absl main. Flags are defined on first use (not at import), so importing this module for
# `solve_file` does not claim global flag names another main in the same process may own.


def define_flags() -> None:
  global _FLAGS_DEFINED
  if _FLAGS_DEFINED:
    return
  s, b = flags.DEFINE_string, flags.DEFINE_boolean
  s('input', None, 'Positions: .npz (positions [T,J,3]), .csv (J*3 columns per row) or .bvh.')
  s('output', None, 'Result: .bvh, .npz, .smpl.npz (SMPL pose parameters, smpl22 only), '
    '.glb (glTF 2.0 binary, animated rig with a box body) or .fbx (the same via Blender).')
  s('checkpoint', None, 'Run or checkpoint directory, or a shipped checkpoint by name, e.g. '
    'ikgat_fast (default: the shipped ikgat_base).')
  s('rig', None, 'Refuse a checkpoint that is not for this rig (name or rig JSON).')
  s('offsets_from', None, 'BVH whose rest offsets are the subject (default: the input BVH\'s '
    'own, an npz\'s `offsets`, else the checkpoint template).')
  s('offsets_units', None, 'Units of --offsets_from (default as for a BVH input).')
  s('joint_map', None, 'Joint map (name or JSON) reducing a BVH to the rig (default: by joint '
    'name, else the rig\'s own joint map).')
  s('units', None, 'Metres per input unit: m, cm, mm, inch or a number (default m; BVH: the '
    'joint map\'s, or cm).')
  flags.DEFINE_enum('reference_pose', None, ['zero', 'first_frame'], 'A BVH input\'s natural '
                    'pose, the rig\'s in its channels (default: its joint map\'s channel '
                    'values, else the rig\'s): first_frame where the clip starts in it (a T-pose '
                    'facing forward); then the rotations are in the file\'s own bind even '
                    'where its zero pose is another pose.')
  s('input_axes', None, 'Signed input column per rig axis, e.g. x,z,-y for z-up data; or unity '
    '/ unreal (then also --units=cm for Unreal).')
  flags.DEFINE_float('fps', None, 'Frame rate of an npz/csv input (default: its `fps`, else '
                     '30); a BVH input is resampled to it (default: its own rate).')
  b('estimate_lengths', False, 'Bone lengths from the input (directions from the offsets).')
  b('fit_offsets', False, 'After solving, the offsets the solved rotations imply, so the written '
    'skeleton reproduces the input (rotations unchanged).')
  b('overwrite', False, 'Replace existing outputs.')
  s('plot', None, 'PNG of input joints vs solved skeleton for --plot_frames.')
  s('plot_frames', None, 'Frames for --plot, e.g. 0,10,20 (default: 4 evenly spaced).')
  s('clip', None, 'Short clip: .gif, or a directory of frame_NNNN.png.')
  s('clip_frames', None, 'Frames for --clip as start:stop[:step] (default: 60 images 1/30 s '
    'apart, 0:60 at 30 fps).')
  s('smpl_npz', None, 'Also write SMPL pose parameters [T, 66] here (smpl22 rig).')
  flags.DEFINE_enum('smpl_world', 'rig', ['rig', 'amass'], 'World of the SMPL root orientation '
                    'and trans: the rig\'s y-up (SMPL model frame) or AMASS\'s z-up.')
  flags.DEFINE_enum('joint_names', 'input', list(exports.JOINT_NAMES), 'How a .bvh, .glb or '
                    '.fbx output names the joints: input (as the input named them, where it '
                    'did: its namespace, Anna:Hips, and a joint map\'s source names, so a tool '
                    'that binds animation to bones by name finds them) or rig (the rig\'s; '
                    'for three.js\'s BVHLoader, which binds no name with a colon, and Assimp, '
                    'which reads no BVH name with a space).')
  s('bvh_units', None, 'Units of an output BVH: cm, m, mm, inch, ... or metres per file unit '
    '(default: a BVH input\'s own units, else cm). Its rotation channels follow a BVH input\'s '
    'order per joint (ZYX otherwise).')
  flags.DEFINE_integer('block_size', None, 'Frames per compiled chunk (default 1024).')
  flags.DEFINE_integer('workers', None, 'Threads that solve chunks at once (default: the usable '
                       'CPU cores, up to 4; 1 on a GPU/TPU). The outputs do not depend on it.')
  flags.DEFINE_enum('attention', 'dense', ['dense', 'auto'], 'How the graph attention is '
                    'evaluated: dense, or auto (its sparse form from 4 frames on: 1.2-1.3x the '
                    'frames/s of a long clip on the CPU, a first compile 0.5 s slower; the same '
                    'outputs within float32 round-off).')
  flags.DEFINE_enum('matmul_precision', 'float32', ['float32', 'bfloat16'], 'The network\'s '
                    'large products: float32, or bfloat16 (bfloat16 inputs, float32 sums: on a '
                    'CPU with bfloat16 instructions a live frame 1.4x and a clip 1.8x as fast, '
                    'the error within 0.002 deg of float32\'s on CMU; BENCHMARKS.md).')
  flags.DEFINE_integer('refine_iters', 0, 'Refine IK-GAT with this many anchored iterations '
                       'of the rotation solver, root translation fitted (amortized + refine; 50 '
                       'for noisy trackers: joints closer to the truth than the input, about a '
                       'sixth of the network\'s frames/s; README "Results").', lower_bound=0)
  s('refine_prior', 'shipped', 'The refinement\'s pose prior: shipped (checkpoints/prior where it '
    'is for the checkpoint\'s rig, else none), a prior run or checkpoint directory, or none.')
  flags.DEFINE_boolean('mirror', False, 'Mirror averaging: the network also solves the mirror '
                       'image of each frame and the answer is the midpoint of both (twice the '
                       'network\'s work; 0.2 deg lower error on CMU val; BENCHMARKS.md).')
  flags.DEFINE_integer('latency_frames', 0, 'Also report single-frame latency (median, p99) '
                       'over this many streamed frames.')
  flags.DEFINE_boolean('live_backend', None, 'Start JAX for live frames first '
                       '(ik_gat_jax.start_live_backend: every call on the calling thread; a '
                       'live frame 1.3-2.4x faster on 2 unpinned cores; a clip as fast in the '
                       'dense attention form, which --attention=auto then takes; README, '
                       '"Solving your own positions"). Default: on with --latency_frames, so '
                       'the latency reported is a live process\'s; off otherwise.')
  flags.DEFINE_enum('filter', None, ['none', 'one_euro'], 'Causal temporal filter of the '
                    'rotations (default: the checkpoint\'s, else none).')
  flags.DEFINE_float('filter_min_cutoff', None, 'One-Euro cutoff at rest (Hz).')
  flags.DEFINE_float('filter_beta', None, 'One-Euro cutoff slope (Hz per rad/s of speed).')
  flags.DEFINE_float('filter_d_cutoff', None, 'One-Euro velocity-estimate cutoff (Hz).')
  flags.DEFINE_boolean('hold_missing', False, 'NaN input joints (a tracker\'s dropouts) keep '
                       'their last seen offset from the root, moved with the root, instead of '
                       'being refused (any checkpoint; a joint must be seen once first).')
  flags.DEFINE_boolean('subject_calibration', False, 'Turn the joints whose children branch '
                       '(the root, the chest) by the subject\'s constant biases there, measured '
                       'on the clip\'s own frames: lower error for a subject whose hips and '
                       'shoulders sit unlike the training subjects\' '
                       '(ik_gat_jax/subject_calibration.py).')
  flags.DEFINE_boolean('size_normalization', True, 'The network sees each body scaled to the rig '
                       'template\'s size (from the subject\'s offsets, else each frame\'s '
                       'bones): any subject\'s size gives the same rotations (--nosize_'
                       'normalization: the input as it is).')
  s('trackers', 'full', 'Observed joints (checkpoints with joint masks): full, a named subset '
    '(6, 10; ik_gat_jax/trackers.py) or joint names A,B,C; NaN input joints are missing too.')
  s('orientations', None, '.npy [T, J, 3, 3] world rotations (rig axes; NaN = not given) for a '
    'checkpoint with orientation inputs.')
  s('end_sites', None, '.npy [T, E, 3] end-site points of the rig\'s leaves (input units and '
    'axes; NaN = not given), "bvh" (a BVH input\'s End Sites; the default for a checkpoint with '
    'end sites) or "none".')
  _FLAGS_DEFINED = True


_LIVE_HINT = ('; on several cores --live_backend (or taskset -c 0) runs a live frame faster '
              '(1.3-2.4x on 2 cores; README, "Solving your own positions")')


def live_backend_wanted(flag: bool | None, latency_frames: int) -> bool:
  """--live_backend as given, else on exactly when the run measures live frames."""
  return bool(latency_frames and latency_frames > 0) if flag is None else bool(flag)


def _live_hint(latency: dict) -> bool:
  """Whether the latency line should point at the live backend: a CPU process on several
  cores that did not start it (a frame's kernels then go to other threads: 1.3-2.4x slower)."""
  return (latency['backend'] == 'cpu' and not latency['live_backend']
          and solver_lib.default_workers() > 1)  # the usable cores, 1 under taskset -c 0


def main(argv) -> None:
  if len(argv) > 1:
    raise SystemExit(f'error: unexpected arguments {argv[1:]}; flags look like --input=FILE')
  F = flags.FLAGS
  if not F['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  try:
    for name in ('input', 'output'):
      if F[name].value is None:
        raise ValueError(f'--{name} is required')
    if live_backend_wanted(F.live_backend, F.latency_frames):
      inference.start_live_backend()
    with warnings.catch_warnings():
      warnings.simplefilter('always')
      warnings.showwarning = lambda msg, *a, **k: _stderr(f'warning: {msg}')
      solve_file(F.input, F.output, checkpoint=F.checkpoint, rig=F.rig, offsets_from=F.offsets_from,
                 offsets_units=F.offsets_units, joint_map=F.joint_map, units=F.units,
                 input_axes=F.input_axes, fps=F.fps, estimate_lengths=F.estimate_lengths,
                 fit_offsets=F.fit_offsets,
                 overwrite=F.overwrite, plot=F.plot, plot_frames=F.plot_frames, clip=F.clip,
                 clip_frames=F.clip_frames, smpl_npz=F.smpl_npz, smpl_world=F.smpl_world,
                 bvh_units=F.bvh_units,
                 block_size=F.block_size, workers=F.workers, attention=F.attention,
                 matmul_precision=F.matmul_precision, latency_frames=F.latency_frames,
                 refine_iters=F.refine_iters, refine_prior=F.refine_prior, mirror=F.mirror,
                 filter_kind=F['filter'].value,
                 filter_min_cutoff=F.filter_min_cutoff, filter_beta=F.filter_beta,
                 filter_d_cutoff=F.filter_d_cutoff, trackers=F.trackers,
                 orientations=F.orientations, end_sites=F.end_sites,
                 hold_missing=F.hold_missing, subject_calibration=F.subject_calibration,
                 reference_pose=F.reference_pose, size_normalization=F.size_normalization,
                 joint_names=F.joint_names)
  except (ValueError, KeyError, OSError, CheckpointError) as e:
    text = str(e.args[0] if isinstance(e, KeyError) and e.args else e).strip()
    _stderr(f'error: {text.splitlines()[0] if text else type(e).__name__}')
    sys.exit(2)


def run(argv: list[str] | None = None) -> int:
  """Parses `argv` (argv[0] = program name) and runs `main`; returns the exit status."""
  argv = list(sys.argv if argv is None else argv)
  compile_cache.enable()  # the command line's persistent cache, before the first compilation
  define_flags()
  if any(a in ('-h', '--help', '-help', '--helpshort') for a in argv[1:]):
    print(__doc__.strip() + '\n\nflags:\n' + flags.FLAGS.module_help(sys.modules[__name__]))
    return 0
  try:
    app.run(main, argv=argv)
  except SystemExit as e:
    if isinstance(e.code, str):
      _stderr(e.code)
      return 2
    return int(e.code or 0)
  return 0


def exit_process(status: int) -> NoReturn:
  """Ends a command-line process whose work is done (outputs renamed into place, streams
  flushed) with `status`. It freezes the objects the garbage collector tracks first, so the
  interpreter's last collection skips JAX's and flax's hundreds of thousands of objects, which
  nothing needs collected at exit: 0.3-0.4 s of a 3 s solve on this project's CPU
  (BENCHMARKS.md "Start-up"). The process's memory goes back to the system as always; for
  the command line only (`python -m ik_gat_jax.solve`, `ik-gat`), never a library call."""
  sys.stdout.flush()
  sys.stderr.flush()
  gc.freeze()
  sys.exit(status)


if __name__ == '__main__':
  exit_process(run())
