"""BVH mocap -> training shards: inputs, subjects, splits, verified clips, shard directories.

The library behind `python -m data_prep.bvh_to_shards` (DESIGN sections 3, 7 and 9). Reading a
BVH onto the rig (joint maps, reduction, verification, resampling, end sites, `--rig=auto`) is
`ik_gat_jax.io.retarget`, shared with the solver; the AMASS converter (data_prep/amass.py) shares
this module's subjects, merging and shard writing. Library code: no flags; progress goes to a
`log` callable (stderr by default).

Choices written down (DESIGN leaves them open; the reduction's are in `io.retarget`):
- End sites (issue G2) are written as `<split>/end_sites.npy [T, E, 3]` with the leaf list in
  `end_sites.json`; adding to a directory written before end sites existed keeps its old frames
  NaN (absent).
- Subjects are bodies, not clips: keyed by name and the rest offsets of every joint but the
  root; a file whose non-root offsets differ from its subject's earlier files by more than
  1e-6 m becomes a subject variant 'NAME~1' (its own offsets row). The root's offset is its rest
  position in the world (with a dummy root folded in, the sum of their OFFSETs), a placement of
  the clip that FK never reads (the root position channels place the body), so files that
  differ only there are one subject (the first file's row is kept).
- `--units=auto` (`build_joint_map`): `io.units.estimate_units` on the first input file's
  skeleton (bone lengths and End Sites, so a crumpled zero pose does not matter), logged with its
  evidence, refused when no known unit gives a human stature; without --units, `--rig=auto`
  refuses and names the unit the skeleton suggests. Every conversion then refuses a file whose
  skeleton is `SIZE_RATIO` (2) times the files' median or under its inverse (`other_size`: one
  file in other units among the others), naming it and the units it looks like.
- Reference pose (`io.retarget`, module docstring): a joint map's or `--reference_pose`
  declaration is read from the first file to convert; a derived rig stores it, a named rig must
  agree with it.
- Merging. A run into an existing shard directory appends: files already there with the same
  sha256 are skipped (logged), a file of the same name with a different sha256 is refused, and a
  file whose bytes are there (or earlier in the run) under another name is skipped, naming it
  (a folder converted again from another root: its frames twice, under two subjects). The
  rig and the frame rate must match the directory's. The whole new directory is written beside
  the old one and swapped in with renames, so a failed run leaves the old output untouched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np

from ik_gat_jax import bone_frames as bone_frames_lib
from ik_gat_jax import data as data_lib
from ik_gat_jax import skeleton
from ik_gat_jax.errors import ConversionError, InputError
from ik_gat_jax.io import bvh
from ik_gat_jax.io import retarget
from ik_gat_jax.io import units as units_lib
from ik_gat_jax.io.units import UNITS, parse_units
from ik_gat_jax.provenance import file_sha256, git_commit

PACKAGE_DIR = Path(__file__).resolve().parent
SPLIT_DIR = PACKAGE_DIR / 'splits'

SUBJECT_TOL_M = 1e-6  # offsets closer than this are the same subject's
NATURAL_POSE_ASYMMETRY_DEG = 20.0  # a derived rig's reference pose asymmetric beyond: warned
# A derived rig's up (y) is doubted when the bodies' median extent along another axis is this
# many times their extent along y (CMU's training frames, y up: about 2.5 times as tall as they
# are wide or deep).
UP_EXTENT_RATIO = 1.25
SPLIT_NAMES = ('train', 'val', 'test', 'all')
Log = Callable[[str], None]


def log_stderr(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# One file: a verified, resampled clip.


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


def convert_file(file: str, path: str | os.PathLike, subject: str, jmap: retarget.JointMap,
                 W: np.ndarray, fps: float, rig_names: Sequence[str] | None = None,
                 rig_parents: Sequence[int] | None = None, sha256: str | None = None) -> Clip:
  """One BVH file -> a verified, resampled `Clip`. Raises ConversionError with the reason."""
  start = time.perf_counter()
  motion, total = retarget.read_motion(path, jmap.drop_first_frame)
  plan, out, G, p, error = retarget.convert_motion(motion, jmap, W, fps, rig_names, rig_parents)
  ends = retarget.end_sites_world(out, G, p, plan.parents)
  extra = {}
  if ends is not None:
    srcs = retarget.end_site_sources(motion, plan)
    extra['end_site_sources'] = {
        plan.names[k]: (None if s is None else
                        f'{motion.names[s[0]]} End Site')
        for k, s in zip(skeleton.leaves_of(plan.parents), srcs)}
  return Clip(file=file, path=str(path), subject=subject, sha256=sha256 or file_sha256(path),
              names=plan.names, parents=plan.parents, offsets=out.offsets,
              local_rot=out.local_rot, global_rot=G, positions=p, source_frames=total,
              source_fps=retarget.source_fps(motion.frame_time), fk_max_error_m=error,
              seconds=time.perf_counter() - start, extra=extra, end_sites=ends)


# ----------------------------------------------------------------------------------------------
# Inputs, subjects and splits.


def files_under(root: Path, suffix: str) -> list[Path]:
  """Every file named `*suffix` (any case) under the directory `root`, sorted, following linked
  directories (a dataset linked in from another disk; each real directory once), without
  macOS's AppleDouble `._NAME` files (metadata a Mac leaves on other file systems)."""
  found, seen = [], set()
  for top, dirs, files in os.walk(root, followlinks=True):
    real = os.path.realpath(top)
    if real in seen:  # a link back up the tree, or a second link to one directory
      dirs[:] = []
      continue
    seen.add(real)
    dirs.sort()
    found += [Path(top) / f for f in files
              if f.lower().endswith(suffix) and not f.startswith('._')
              and os.path.isfile(os.path.join(top, f))]
  return sorted(found)


def find_bvh_files(input_path: str | os.PathLike) -> list[tuple[str, Path]]:
  """`(name, path)` of a BVH file, or of every *.bvh under a directory (name: relative path)."""
  root = Path(input_path)
  if root.is_file():
    return [(root.name, root)]
  if not root.is_dir():
    raise ConversionError(f'input {root} does not exist')
  found = files_under(root, '.bvh')
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
      raise ConversionError(f'{file}: subject_regex {regex!r} (the joint map\'s, or '
                            '--subject_regex) does not match the file name: pass a '
                            '--subject_regex that does (its group "subject", or 1, names it)')
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
  retarget.validate_json(doc, {'type': 'object', 'required': ['name', 'files'], 'properties': {
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


def same_body(a: np.ndarray, b: np.ndarray) -> bool:
  """Offsets `[J, 3]` of one body: every non-root joint within SUBJECT_TOL_M (module docstring:
  the root's offset is where the clip is placed, not the body)."""
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and bool(np.abs(a[1:] - b[1:]).max(initial=0.0) <= SUBJECT_TOL_M)


def _assign_subjects(shards: _Shards, clips: Sequence[Clip]) -> list[int]:
  """Sets `clip.subject_id` (new subjects appended); returns the new subjects' ids."""
  new = []
  for clip in clips:
    same = [i for i, s in enumerate(shards.subjects) if s['subject'] == clip.subject]
    match = next((i for i in same if same_body(shards.offsets[i], clip.offsets)), None)
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
      'fk_tolerance_m': retarget.FK_TOL_M,
      'runs': (shards.summary or {}).get('runs', []) + [run],
  }


def write_output(output: Path, shards: _Shards, rig: skeleton.Rig, clips: Sequence[Clip],
                 fps: float, split_sources: dict, run: dict, log: Log = log_stderr) -> dict:
  """Writes old + new content into a temporary sibling directory, then swaps it in. The
  siblings a killed run left (`remove_stale_siblings`) go first."""
  remove_stale_siblings(output, log)
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
  tmp = Path(tempfile.mkdtemp(prefix=f'.{output.name}.tmp-{_HOST}-{os.getpid()}-',
                              dir=output.parent))
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
           'names': retarget.end_site_names(rig.joint_names, rig.parents)}, indent=1))
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


_HOST = re.sub(r'[^A-Za-z0-9_.]', '_', socket.gethostname()) or 'host'


def remove_stale_siblings(output: Path, log: Log = log_stderr) -> None:
  """Removes the `.NAME.tmp-HOST-PID-*` / `.NAME.old-HOST-PID-*` folders beside `output` that a
  run on this host killed (SIGKILL, a power cut) before its clean-up left: each a whole copy of
  the shards, hidden. A live process's, or another host's, stay (said)."""
  pattern = re.compile(rf'^\.{re.escape(output.name)}\.(tmp|old)-(.+)-(\d+)-[^-]+$')
  if not output.parent.is_dir():
    return
  for p in sorted(output.parent.iterdir()):
    m = pattern.match(p.name)
    if m is None or not p.is_dir():
      continue
    host, pid = m.group(2), int(m.group(3))
    if host == _HOST and pid != os.getpid() and not _alive(pid):
      shutil.rmtree(p, ignore_errors=True)
      log(f'removed {p}: left by a conversion (process {pid}) that was killed')
    else:
      who = f'process {pid}' if host == _HOST else f'host {host}'
      log(f'note: {p} is a conversion in progress ({who}) or one killed on another host; left '
          'as it is')


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's
    return True
  return True


def _swap_in(tmp: Path, output: Path) -> None:
  """Replaces `output` by `tmp` with renames: the old content stays until the new is in place."""
  if not output.exists():
    os.replace(tmp, output)
    return
  old = output.parent / f'.{output.name}.old-{_HOST}-{os.getpid()}-{time.time_ns()}'
  os.replace(output, old)
  try:
    os.replace(tmp, output)
  except BaseException:
    os.replace(old, output)
    raise
  shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# The whole command.


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
  the same sha256 is skipped (logged), one with a different sha256 refused. A file whose bytes
  are already there, or earlier in `inputs`, under another name (the same folder converted
  again from another root, or a copy) is skipped too, naming the other: its frames twice
  would weigh it double, and under two subjects one could land in test and one in train."""
  todo, skipped = [], []
  done = {f['file']: f['sha256'] for f in shards.files}
  by_sha = {f['sha256']: f['file'] for f in shards.files}
  for file, path in inputs:
    sha = file_sha256(path)
    if file in done:
      if done[file] != sha:
        raise ConversionError(f'{file} is already in {output} with a different sha256; convert it '
                              'into a new --output')
      skipped.append(file)
      log(f'{file}: already in {output}, skipped')
      continue
    if sha in by_sha:
      skipped.append(file)
      log(f'{file}: the same bytes as {by_sha[sha]}' + (
          f', already in {output}' if by_sha[sha] in done else ' (converted in this run)')
          + ', skipped')
      continue
    by_sha[sha] = file
    todo.append((file, path, sha))
  return todo, skipped


def estimate_file_units(path: str | os.PathLike) -> units_lib.UnitsEstimate:
  """`io.units.estimate_units` of one BVH file's skeleton (ConversionError when implausible)."""
  try:
    motion = bvh.read_bvh(path)
    return units_lib.estimate_units(motion.offsets, motion.parents,
                                    [j.end_site for j in motion.joints], what=f'{path}')
  except bvh.BVHError as e:
    raise ConversionError(str(e)) from None
  except InputError as e:
    raise ConversionError(str(e)) from None


def build_joint_map(rig: str, inputs: Sequence[Path], units: str | float | None = None,
                    up: str | None = None, forward: str | None = None,
                    prune: Sequence[str] = (), drop_first_frame: bool | None = None,
                    subject_regex: str | None = None, reference_pose: str | None = None,
                    log: Log = log_stderr, derived: skeleton.Rig | None = None
                    ) -> retarget.JointMap:
  """The joint map for `--rig` (name, JSON path, or 'auto' derived from `inputs`), with the
  command-line overrides applied. `units='auto'`: estimated from the first input's skeleton
  (module docstring), logged. `derived`: the rig an output folder derived before, whose
  joints 'auto' keeps (new files are added to it, not derived anew)."""
  if isinstance(units, str) and units.strip().lower() == 'auto':
    if not inputs:
      raise ConversionError('--units=auto needs an input file')
    est = estimate_file_units(inputs[0])
    log(f'--units=auto: {Path(inputs[0]).name}: {est.describe()}')
    scale = est.metres_per_unit
  else:
    try:
      scale = parse_units(units) if units is not None else None
    except InputError as e:  # convert() refuses bad input with a ConversionError
      raise ConversionError(str(e)) from None
  if rig == 'auto':
    if scale is None:
      try:
        est = estimate_file_units(inputs[0]) if inputs else None
        hint = (f'; {Path(inputs[0]).name} looks like --units={est.name} (a stature of about '
                f'{est.stature_m:.2f} m; --units=auto would pick it)') if est else ''
      except ConversionError as e:
        hint = f'; --units=auto cannot tell either: {e}'
      raise ConversionError('--rig=auto needs --units (metres per file unit: a number, one of '
                            f'{", ".join(UNITS)}, or auto){hint}')
    return retarget.derive_joint_map(inputs, scale, up or '+y', forward or '+z', tuple(prune),
                                     bool(drop_first_frame), subject_regex, reference_pose,
                                     None if derived is None else derived.joint_names)
  jmap = retarget.load_joint_map(rig)
  return jmap.with_overrides(units=scale, up=up, forward=forward,
                             drop_first_frame=drop_first_frame, subject_regex=subject_regex,
                             prune=(tuple(jmap.prune) + tuple(prune)) if prune else None,
                             reference_pose=reference_pose)


def convert(input_path: str | os.PathLike, rig: str, output: str | os.PathLike, *,
            split: str = 'auto', fps: float = 30.0, units: str | float | None = None,
            up: str | None = None, forward: str | None = None, prune: Sequence[str] = (),
            drop_first_frame: bool | None = None, subject_regex: str | None = None,
            split_file: str | None = None, rig_name: str = 'auto', on_error: str = 'fail',
            reference_pose: str | None = None, log: Log = log_stderr) -> dict:
  """BVH file(s) -> shard directory `output` (created, or added to). Returns the summary.

  Args mirror `bvh_to_shards` flags: `rig` is a joint-map name, a joint-map JSON path or 'auto';
  `split` is 'auto' (the joint map's committed split, or `split_file`) or a split name that takes
  every input file; `units` (metres per file unit), `up`, `forward`, `drop_first_frame` and
  `subject_regex` override the joint map; `prune` adds subtrees to prune; `rig_name` names a
  derived rig; `on_error='skip'` logs and skips refused files instead of failing the run;
  `reference_pose` ('zero' or 'first_frame') overrides the joint map's (io.retarget).
  Raises ConversionError (one line) on bad input; the output is then left as it was.
  """
  started = time.perf_counter()
  if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
    raise ConversionError(f'--fps must be a positive number, got {fps!r}')
  if split not in ('auto',) + SPLIT_NAMES:
    raise ConversionError(f'--split must be auto or one of {", ".join(SPLIT_NAMES)}, got {split!r}')
  if on_error not in ('fail', 'skip'):
    raise ConversionError(f'on_error must be fail or skip, got {on_error!r}')
  if split_file is not None and split != 'auto':
    raise ConversionError(f'--split_file places each file by its entry, --split={split} puts '
                          'every file in one split: give one of them')
  output = Path(output)
  shards = load_output(output)
  inputs = find_bvh_files(input_path)
  jmap = build_joint_map(rig, [p for _, p in inputs], units, up, forward, prune,
                         drop_first_frame, subject_regex, reference_pose, log,
                         derived=shards.rig if rig == 'auto' else None)
  target = retarget.resolve_rig(jmap)
  check_output_matches(shards, output, fps, target)
  known = target or shards.rig
  W = retarget.world_rotation(jmap.up, jmap.forward, known.up if known else (0.0, 1.0, 0.0),
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
  if new and on_error == 'fail':
    _check_joint_map_first(new[0][1], jmap, known)
  todo, refused = [], []
  for file, path, sha in new:
    try:
      todo.append((file, path, sha, *assign_split(file, sha, split, split_doc),
                   subject_of(file, jmap.subject_regex)))
    except ConversionError as e:  # not in the split, or edited since it was made
      if on_error != 'skip':
        raise
      refused.append({'file': file, 'reason': str(e)})
      log(f'REFUSED {e}')
  if not todo and not refused:
    log(f'nothing to convert: every input file is already in {output}')
    return shards.summary

  clips = []
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
  odd = other_size(clips, list(shards.offsets), jmap.units)
  if odd:
    raise ConversionError(odd)
  reference = None  # the declared reference pose, read from the first converted file
  if jmap.reference_pose not in (None, 'zero'):
    first = Path(clips[0].path)
    try:
      raw = bvh.strip_namespace(bvh.read_bvh(first))
    except bvh.BVHError as e:
      raise ConversionError(str(e)) from None
    plan = retarget.plan_reduction(raw.names, raw.parents, jmap, names, parents)
    reference = retarget.reference_rotations(first, jmap, plan, W)
  derived = target is None and shards.rig is None
  if derived:
    target = retarget.derive_rig(rig_name, jmap, names, parents, _subject_mean_offsets(clips),
                                 reference)
    doubt = doubt_up_axis(clips, jmap)
    if doubt:
      log(f'WARNING: rig {target.name}: {doubt}')
    angle, joint = target.mirror_asymmetry()
    if not any(m != j for j, m in enumerate(target.mirror)):
      if angle > NATURAL_POSE_ASYMMETRY_DEG:  # a body's sides, not found by name
        log(f'WARNING: rig {target.name}: its joint names pair no left and right joints '
            '(Left/Right, thigh_l or thigh.L, L_ or R_, LHip, lThigh), so mirror augmentation '
            'and averaging cannot serve it (experiments.train_rig turns augmentation off)')
    elif angle > NATURAL_POSE_ASYMMETRY_DEG:
      log(f'WARNING: rig {target.name}: its {"reference" if reference is not None else "zero"} '
          f'pose is not mirror-symmetric (the {joint} bone {angle:.0f} degrees from its '
          'partner\'s mirror image), so it is not a natural pose: bone frames and swing-only IK '
          'start from it and mirror augmentation will refuse it (experiments.train_rig turns '
          'it off); if frame 0 is a T-pose, convert again with --reference_pose=first_frame')
  else:
    target = target or shards.rig
    if jmap.reference_pose is not None:
      retarget.check_reference(target, reference, jmap)
  other_binds = other_bind_warning(target, clips, derived)
  if other_binds:
    log(f'WARNING: rig {target.name}: {other_binds}')
  run = {'input': str(input_path), 'joint_map': jmap.name, 'joint_map_sha256': jmap.sha256,
         'units_m': jmap.units, 'up': jmap.up, 'forward': jmap.forward,
         'drop_first_frame': jmap.drop_first_frame, 'split': split,
         'reference_pose': (jmap.reference_pose if isinstance(jmap.reference_pose, str) or
                            jmap.reference_pose is None else 'per-joint channel values'),
         'files_added': len(clips), 'files_skipped': skipped, 'files_refused': refused,
         'frames_added': sum(c.frames for c in clips),
         'fk_max_error_m': max(c.fk_max_error_m for c in clips),
         'seconds': round(time.perf_counter() - started, 3), 'git_commit': git_commit(),
         'time_utc': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}
  return write_output(output, shards, target, clips, float(fps), split_sources, run, log)


def _check_joint_map_first(path, jmap: retarget.JointMap, known: skeleton.Rig | None) -> None:
  """Refuses (ConversionError) a joint map that does not fit the first file's joints before its
  name is judged (the committed split, the subject pattern): a folder of another rig then hears
  the real cause first. Unreadable files are left to their conversion's own error."""
  try:
    motion = bvh.strip_namespace(bvh.read_bvh(path))
  except (bvh.BVHError, OSError):
    return
  try:
    retarget.plan_reduction(motion.names, motion.parents, jmap,
                            known.joint_names if known else None,
                            known.parents if known else None)
  except ConversionError as e:
    raise ConversionError(f'{Path(path).name}: {e}') from None


def other_bind_warning(rig: skeleton.Rig, clips: Sequence[Clip], derived: bool) -> str | None:
  """Why some files' zero poses look like another bind of the rig's joints, or None: their
  bones point a median over `skeleton.REST_POSE_WARN_DEG`, or one bone over
  `skeleton.REST_BONE_WARN_DEG`, from the rig template's (a rig derived here: from the first
  file's), in the rig's natural pose, as `solve` warns for one clip. Different subjects of one
  lab stay well under (CMU's: a median of 3 deg at most, one bone 19 deg). Mixed binds would
  teach contradictory twists for the same pose."""
  if not clips or not (rig.template_offsets or derived):
    return None
  ref = (dataclasses.replace(rig, template_offsets=tuple(map(tuple, clips[0].offsets.tolist())))
         if derived else rig)
  far = []
  for c in clips:
    a = skeleton.rest_pose_angles(c.offsets, ref)
    if a.size and np.isfinite(a).any():
      med, k = float(np.nanmedian(a)), int(np.nanargmax(a))
      if med > skeleton.REST_POSE_WARN_DEG or a[k] > skeleton.REST_BONE_WARN_DEG:
        far.append((Path(c.path).name, med, float(a[k]), rig.joint_names[k]))
  if not far:
    return None
  name, med, worst, joint = max(far, key=lambda f: f[2])
  whose = f'the first file\'s ({Path(clips[0].path).name})' if derived else 'the rig\'s template'
  return (f'{len(far)} of {len(clips)} files are another bind of its joints: their zero poses '
          f'point bones from {whose} by a median up to {max(f[1] for f in far):.0f} deg, '
          f'{worst:.0f} deg at {joint} in {name} ({", ".join(f[0] for f in far[:3])}'
          f'{" ..." if len(far) > 3 else ""}), so the same pose would train other twists: '
          'convert each bind to its own folder, or name the files\' natural pose '
          '(--reference_pose=first_frame, a joint map "reference_pose")')


SIZE_RATIO = 2.0  # a file's skeleton this many times the files' median: other units


def other_size(clips: Sequence[Clip], held: Sequence[np.ndarray] = (),
               units_m: float = 1.0) -> str | None:
  """Why a file's skeleton is not a human among the others, or None: its summed bone length
  `SIZE_RATIO` times the median over every file (these `clips` and the shards' `held` offsets)
  or less than its inverse, as a file in other units gives (inches among centimetres: 2.54x;
  CMU's units among centimetres: 5.6x), where people of one lab differ far less (children and
  adults: under 1.8x). Such a file would be trained as a giant or a doll and move the rig's
  template (`--units=auto` estimates the first file's units only)."""
  size = lambda off: float(np.linalg.norm(np.asarray(off)[1:], axis=-1).sum())  # noqa: E731
  sizes = [size(c.offsets) for c in clips]
  median = float(np.median(sizes + [size(o) for o in held]))
  if not median > 0:
    return None
  odd = [(c, k / median) for c, k in zip(clips, sizes)
         if not 1 / SIZE_RATIO < k / median < SIZE_RATIO]
  if not odd:
    return None
  clip, ratio = max(odd, key=lambda o: abs(math.log(max(o[1], 1e-12))))
  want = units_m / ratio  # the units that would make it the median's size
  name = min(UNITS, key=lambda u: abs(math.log(UNITS[u] / want)))
  unit = (f' (in {name}: {UNITS[name]:g} m per unit?)'
          if abs(math.log(UNITS[name] / want)) < math.log(1.3) else '')
  return (f'{Path(clip.path).name}: its skeleton is {ratio:.3g}x the median of the '
          f'{len(sizes) + len(held)} files\' ({len(odd)} file(s) so), as in other units{unit}: '
          'convert files in other units on their own (--units), or leave it out')


def doubt_up_axis(clips: Sequence[Clip], jmap: retarget.JointMap) -> str | None:
  """Why the files may not be `jmap.up`-up, or None: a derived rig takes its files' up as its
  own (y), but upright bodies extend most along up; here the median over every frame of the
  bodies' extent (highest joint minus lowest) along another rig axis is `UP_EXTENT_RATIO` times
  that along y or more. Fine for motion that lies down throughout."""
  p = np.concatenate([c.positions for c in clips])
  extent = np.median(p.max(axis=1) - p.min(axis=1), axis=0)  # [3], rig axes
  k = int(np.argmax(extent))
  if k == 1 or extent[k] < UP_EXTENT_RATIO * extent[1]:
    return None
  W = retarget.world_rotation(jmap.up, jmap.forward, (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))
  axis = 'xyz'[int(np.argmax(np.abs(W[k])))]  # the files' axis that became the rig's axis k
  return (f'the bodies extend most along the files\' {axis} axis (median {extent[k]:.2f} m, '
          f'against {extent[1]:.2f} m along {jmap.up}, taken as up): if the files are '
          f'{axis}-up, convert again with --up={axis} (or --up=-{axis}) and the axis they face '
          f'(--forward); fine if the bodies lie down throughout')


def _subject_mean_offsets(clips: Sequence[Clip]) -> list[np.ndarray]:
  """One offsets row per subject (the mean over its files), for a derived rig's template."""
  by_subject: dict[str, list[np.ndarray]] = {}
  for c in clips:
    by_subject.setdefault(c.subject, []).append(c.offsets)
  return [np.mean(v, axis=0) for v in by_subject.values()]
