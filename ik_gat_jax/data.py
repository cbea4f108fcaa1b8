"""Training data: shard directories written by `data_prep.bvh_to_shards`, read memory-mapped.

Shard directory layout (DESIGN section 9), format `FORMAT`:

  summary.json            format, fps, rig/split hashes, files and frames per split, FK error
  rig.json                the rig (`Rig.to_json`); summary['rig_sha256'] is this file's sha256
  split.json              every file in the shards: file, subject, sha256, split, test part
  files.json              the files table; row i is file_id i
  subjects.json           the subjects table; row s is subject_id s
  offsets.npy             [S, J, 3] float32 rest offsets per subject (metres, parent frame)
  bone_frames.npy         [S, J, 3, 3] float32 rest bone frames B per subject (section 4)
  <split>/positions.npy   [T, J, 3] float32 world joint positions (metres)
  <split>/local_rot.npy   [T, J, 3, 3] float32 parent-relative rotations R (root: world)
  <split>/global_rot.npy  [T, J, 3, 3] float32 world rotations G
  <split>/subject_id.npy  [T] int32
  <split>/file_id.npy     [T] int32
  <split>/frame_index.npy [T] int32 frame number within its file, at summary['fps']
  end_sites.json          optional (issue G2): {"joints": [leaf names], "names": [...]}, the
                          rig's leaves (`Rig.leaves`) in joint order
  <split>/end_sites.npy   optional [T, E, 3] float32 world end-site positions of those leaves
                          (head top, hand tips, toe tips; NaN where the source has none)

Directories written before end sites existed load with `Dataset.end_sites = None`; features that
need them call `require_end_sites`, which says how to convert again.

The frames of one file are contiguous and in time order. Every array is its own uncompressed
`.npy` file (an `.npz` cannot be memory-mapped), so `np.load(mmap_mode='r')` maps it and a host
reads only the pages it touches.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from ik_gat_jax.skeleton import Rig

FORMAT = 'ik_gat_jax.shards/1'
SPLIT_ARRAYS = ('positions', 'local_rot', 'global_rot', 'subject_id', 'file_id', 'frame_index')
SUBJECT_ARRAYS = ('offsets', 'bone_frames')


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
  """One split of a shard directory; the array fields are read-only memory maps.

  Attributes:
    path: the shard directory.
    split: e.g. 'train'.
    rig: the rig of every array's joint axis J.
    positions: `[T, J, 3]` world joint positions, metres.
    local_rot: `[T, J, 3, 3]` parent-relative rotations (the root's is its world rotation).
    global_rot: `[T, J, 3, 3]` world rotations.
    subject_id: `[T]` row of `offsets`, `bone_frames` and `subjects`.
    file_id: `[T]` row of `files`.
    frame_index: `[T]` frame number within its file at `fps`.
    offsets: `[S, J, 3]` rest offsets of every subject in the directory (all splits).
    bone_frames: `[S, J, 3, 3]` rest bone frames of every subject.
    files: files table of the whole directory (dicts: file, subject, sha256, split, part, ...).
    subjects: subjects table of the whole directory (dicts: name, files, frames).
    summary: the directory's summary.json.
    end_sites: `[T, E, 3]` world end sites of `rig.leaves` (NaN: absent), or None when the
      directory has none.
  """
  path: Path
  split: str
  rig: Rig
  positions: np.ndarray
  local_rot: np.ndarray
  global_rot: np.ndarray
  subject_id: np.ndarray
  file_id: np.ndarray
  frame_index: np.ndarray
  offsets: np.ndarray
  bone_frames: np.ndarray
  files: tuple[dict, ...]
  subjects: tuple[dict, ...]
  summary: dict
  end_sites: np.ndarray | None = None

  @property
  def num_frames(self) -> int:
    return int(self.positions.shape[0])

  def __len__(self) -> int:
    return self.num_frames

  @property
  def fps(self) -> float:
    return float(self.summary['fps'])

  def split_files(self) -> tuple[dict, ...]:
    """The files table rows of this split."""
    return tuple(f for f in self.files if f['split'] == self.split)


def available_splits(directory: str | Path) -> tuple[str, ...]:
  """Split names present in a shard directory (from its summary)."""
  return tuple(sorted(_read_summary(Path(directory))['frames']))


def load_shards(directory: str | Path, split: str) -> Dataset:
  """Memory-maps split `split` of the shard directory `directory`.

  Raises FileNotFoundError when the directory is not a shard directory, ValueError when it has
  no split `split` (naming the ones it has) or its arrays disagree in shape.
  """
  path = Path(directory)
  summary = _read_summary(path)
  if split not in summary['frames']:
    raise ValueError(f'{path} has no split {split!r}; it has: '
                     f'{", ".join(sorted(summary["frames"])) or "none"}')
  arrays = {name: np.load(path / split / f'{name}.npy', mmap_mode='r') for name in SPLIT_ARRAYS}
  arrays.update({name: np.load(path / f'{name}.npy', mmap_mode='r') for name in SUBJECT_ARRAYS})
  rig = Rig.from_json(json.loads((path / 'rig.json').read_text()))
  if (path / split / 'end_sites.npy').is_file():
    arrays['end_sites'] = np.load(path / split / 'end_sites.npy', mmap_mode='r')
    names = json.loads((path / 'end_sites.json').read_text())['joints']
    if tuple(names) != tuple(rig.joint_names[k] for k in rig.leaves):
      raise ValueError(f'{path}: end_sites.json joints {names} are not the rig\'s leaves')
  data = Dataset(path=path, split=split, rig=rig,
                 files=tuple(json.loads((path / 'files.json').read_text())),
                 subjects=tuple(json.loads((path / 'subjects.json').read_text())),
                 summary=summary, **arrays)
  _check_shapes(data)
  return data


def require_end_sites(d: Dataset) -> np.ndarray:
  """`d.end_sites`, or a ValueError saying how to get a directory that has them."""
  if d.end_sites is None:
    raise ValueError(f'{d.path} has no end sites (written before they existed, or from a source '
                     'without End Sites); convert again into a new directory: python -m '
                     'data_prep.bvh_to_shards --input=... --rig=... --output=NEW_DIR')
  return d.end_sites


def _read_summary(path: Path) -> dict:
  if not path.is_dir():
    raise FileNotFoundError(f'shard directory {path} does not exist')
  if not (path / 'summary.json').is_file():
    raise FileNotFoundError(f'{path} is not a shard directory (no summary.json); write one with '
                            'python -m data_prep.bvh_to_shards')
  summary = json.loads((path / 'summary.json').read_text())
  if summary.get('format') != FORMAT:
    raise ValueError(f'{path}: shard format {summary.get("format")!r}, this code reads {FORMAT!r}')
  return summary


def _check_shapes(d: Dataset) -> None:
  T, J, S = d.positions.shape[0], d.rig.num_joints, len(d.subjects)
  expected = {'positions': (T, J, 3), 'local_rot': (T, J, 3, 3), 'global_rot': (T, J, 3, 3),
              'subject_id': (T,), 'file_id': (T,), 'frame_index': (T,),
              'offsets': (S, J, 3), 'bone_frames': (S, J, 3, 3)}
  if d.end_sites is not None:
    expected['end_sites'] = (T, len(d.rig.leaves), 3)
  for name, shape in expected.items():
    if getattr(d, name).shape != shape:
      raise ValueError(f'{d.path}: {name} has shape {getattr(d, name).shape}, expected {shape}')
