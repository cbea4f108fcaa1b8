"""AMASS motion files + the user's own SMPL-family body model -> SMPL-22 training shards.

The library behind `python -m data_prep.amass_to_shards` (DESIGN sections 3, 7 and 9). Shard
writing, subjects, merging and the atomic swap are `data_prep.conversion`'s, resampling and FK
`ik_gat_jax.io.retarget`'s, shared with the BVH path; SMPL parameters <-> the rig and the AMASS
world rotation are `ik_gat_jax.io.smpl`'s, shared with the solver's SMPL export. Library code:
no flags; progress goes to a `log` callable (stderr by default).

Choices written down:
- Body model. An `.npz` with `v_template [V, 3]`, `shapedirs [V, 3, B]`, `J_regressor [Jm, V]`
  (dense) and `kintree_table [2, Jm]` (row 0: parents; the root's is -1 or a huge number), and
  optionally `weights [V, Jm]`: SMPL (Jm 24), SMPL+H (52) or SMPL-X (55); the first 22 joints
  must have SMPL's parents. A `.pkl` model is refused: unpickling it needs the unmaintained
  chumpy (WORKSPACE.md says how to make the npz). Rest joints are regressed from the shaped
  template, `J = J_regressor @ (v_template + shapedirs[..., :n] @ betas[:n])`, with
  `n = min(num_betas, len(betas), B)`; rig offsets `o_j = J_j - J_parent(j)`, the root's `J_0`.
  Joints after the 22nd (SMPL's hands, SMPL+H fingers, SMPL-X jaw and eyes) are pruned
  subtrees. Each file uses the body model of its `gender` when one was given, else the neutral.
- SMPL kinematics. `poses[:, :66]` are 22 axis-angle local rotations (root first) in model
  coordinates (y up, the rest body facing +z, as the smpl22 rig). SMPL rotates about the joints:
  posed joint `j` is at `a_j = a_parent + R_world_parent @ o_j`, the root at `a_0 = J_0`, and
  `trans` moves everything: `p_j = a_j + trans`. That is our FK with the root at `J_0 + trans`.
- Up axis. The AMASS world is z up. The world (not the body model) is rotated by
  `io.smpl.AMASS_TO_RIG` = -90 degrees about x (AMASS +z -> rig +y, AMASS -y -> rig +z):
  `R_root' = W @ R_root`, `p' = W @ (J_0 + trans)`; other local rotations and the offsets, already
  in the model's y-up frame, stay. Then `G'_j = W G_j` and `p'_j = W p_j` for every joint, and a
  body whose root rotation is AMASS's upright `Rx(+90 deg)` has the identity root in the rig.
  `io.smpl.smpl_pose_from_local` / `smpl_trans_from_root` undo it (the rig's world -> AMASS).
- Frame rates. `mocap_framerate` (or `mocap_frame_rate`), snapped to an integer within 0.01 %,
  then `retarget.resample` (DESIGN section 7): integer ratios decimate (120 -> 30 keeps 0, 4,
  8, ...), others slerp local rotations and interpolate the root position, FK again.
- Splits. By AMASS sub-dataset: the first directory of a file's name (its path under the AMASS
  root) that the split file names, else the first directory. `data_prep/splits/
  amass_default.json` is the AMASS authors' recommended split (its `source`); sub-datasets it
  does not list go to its `unknown` split (train, "the rest"), logged and listed in the run
  record. Every file's test `part` is its sub-dataset, so evaluation reports per sub-dataset.
- Names and subjects. A file is named by its path under `--input` (the AMASS root: `CMU/01/
  01_01_poses.npz`); when `--input` is a sub-dataset or subject directory or a single file, the
  names of the directories above it complete `SUBDATASET/SUBJECT/FILE`. Its subject is the
  directory part (`CMU/01`); a sequence whose betas give other offsets (> 1e-6 m) than its
  subject's earlier ones becomes the variant `CMU/01~1` (conversion's subject rule).
- Files without `poses` (AMASS `shape.npz`, SMPL-X `*_stagei.npz`) are skipped, logged.
- Verification. Positions by `kinematics.forward_kinematics` (float64, the rig path above)
  against an independent numpy chain of 4x4 transforms straight from the raw `poses`, `trans`
  and regressed joints (Rodrigues in numpy, smplx's `batch_rigid_transform` form), for every
  source frame and body joint; above 1e-5 m the file is refused. When the model has `weights`,
  the body model's own joint regression of the linear-blend-skinned mesh, `J_regressor @
  LBS(v_shaped)`, is compared too, on 64 frames spread over the file (LBS costs ~1 ms a frame),
  and reported as `lbs_joint_gap_m` (files.json, the run record), not enforced. A vertex skinned to bone k moves as `v -> p_k + G_k (v - J_k)`, and
  only j's own bone and its parent's carry J_j to FK's p_j; so the regression is exact when,
  per bone, the regressor- and skin-weighted mean of j's vertices is J_j, e.g. when they are
  all skinned rigidly to j's parent (the tests' synthetic model). A real SMPL regressor
  averages vertices blending several bones with varying weights: millimetres to centimetres.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
import zipfile
from pathlib import Path
from typing import Sequence

import numpy as np

from data_prep import conversion
from data_prep.conversion import Log, log_stderr
from ik_gat_jax import skeleton
from ik_gat_jax.errors import ConversionError, InputError, check_frame_rate
from ik_gat_jax.io import retarget
from ik_gat_jax.io import smpl
from ik_gat_jax.io.smpl import AMASS_TO_RIG, BODY_JOINTS
from ik_gat_jax.provenance import file_sha256, git_commit

DEFAULT_SPLIT = conversion.SPLIT_DIR / 'amass_default.json'
MODEL_KEYS = ('v_template', 'shapedirs', 'J_regressor', 'kintree_table')
GENDERS = ('neutral', 'female', 'male')
LBS_FRAMES = 64  # frames per file of the LBS joint-regression diagnostic (~1 ms each)


class NoMotion(ConversionError):
  """An npz without `poses` (a shape file): skipped, not refused."""


# ----------------------------------------------------------------------------------------------
# Body models.


@dataclasses.dataclass(frozen=True, eq=False)
class BodyModel:
  """A SMPL-family body model, float64, model coordinates (y up, facing +z, metres).

  Attributes:
    path, sha256: where it was read from, and its bytes' hash.
    v_template: `[V, 3]` mean template vertices.
    shapedirs: `[V, 3, B]` shape blend shapes.
    J_regressor: `[Jm, V]` joint regressor (dense).
    parents: `[Jm]` parent indices, -1 for the root, parents first.
    weights: `[V, Jm]` skinning weights, or None.
  """
  path: str
  sha256: str
  v_template: np.ndarray
  shapedirs: np.ndarray
  J_regressor: np.ndarray
  parents: tuple[int, ...]
  weights: np.ndarray | None = None

  @property
  def num_betas(self) -> int:
    return int(self.shapedirs.shape[-1])

  def rest_joints(self, betas: np.ndarray) -> np.ndarray:
    """`betas: [n]` (n <= B) -> `[Jm, 3]` rest joints regressed from the shaped template."""
    return self.J_regressor @ self.shaped_vertices(betas)

  def shaped_vertices(self, betas: np.ndarray) -> np.ndarray:
    """`betas: [n]` -> `[V, 3]` = v_template + shapedirs[..., :n] @ betas."""
    betas = np.asarray(betas, np.float64)
    return self.v_template + self.shapedirs[..., :betas.shape[0]] @ betas


_PKL_HELP = ('pickled body models need the unmaintained chumpy; give the .npz of the model (the '
             'SMPL+H and SMPL-X releases ship one; for a .pkl-only SMPL, convert it once as '
             'WORKSPACE.md shows)')


def _open_npz(path: Path, what: str):
  """`np.load` without pickles; one-line ConversionError on anything unreadable."""
  if path.suffix.lower() == '.pkl':
    raise ConversionError(f'{what} {path} is a .pkl: {_PKL_HELP}')
  if not path.is_file():
    raise ConversionError(f'{what} {path} does not exist')
  if not zipfile.is_zipfile(path):  # np.load would offer to unpickle it
    with open(path, 'rb') as f:
      head = f.read(6)
    if head == b'\x93NUMPY':
      raise ConversionError(f'{what} {path} holds one array (np.save), not an .npz of named '
                            'fields')
    hint = f' ({_PKL_HELP})' if head[:1] == b'\x80' and what == 'body model' else ''
    raise ConversionError(f'{what} {path} is not an .npz (not a zip archive: '
                          + ('a pickle' if head[:1] == b'\x80' else 'a failed download or another '
                             'format?') + f'){hint}')
  try:
    npz = np.load(path, allow_pickle=False)
  except (OSError, ValueError, zipfile.BadZipFile) as e:
    hint = f' ({_PKL_HELP})' if 'pickle' in str(e).lower() and what == 'body model' else ''
    raise ConversionError(f'{what} {path} is not a readable .npz: {e}{hint}') from None
  if not isinstance(npz, np.lib.npyio.NpzFile):
    raise ConversionError(f'{what} {path} holds one array, not an .npz of named fields')
  return npz


def _array(npz, key: str, path: Path, what: str) -> np.ndarray:
  """One field of an open npz; a pickled (object) field is refused with the reason."""
  try:
    return np.asarray(npz[key])
  except ValueError as e:
    raise ConversionError(f'{what} {path}: field {key!r} cannot be read without pickle ({e}); '
                          'save it as a plain (dense) numpy array') from None


def parents_from_kintree(kintree: np.ndarray) -> tuple[int, ...]:
  """`kintree_table [2, Jm]` -> parents `[Jm]` in joint-index order (the root's: -1)."""
  kintree = np.asarray(kintree).astype(np.int64)
  Jm = kintree.shape[1]
  order = np.argsort(kintree[1])
  if not np.array_equal(kintree[1][order], np.arange(Jm)):
    raise ConversionError('kintree_table row 1 must list the joints 0..Jm-1')
  return tuple(int(p) if 0 <= p < Jm else -1 for p in kintree[0][order])


def load_body_model(path: str | os.PathLike) -> BodyModel:
  """Reads and checks a body-model npz (module docstring). Raises ConversionError."""
  path = Path(path)
  with _open_npz(path, 'body model') as npz:
    missing = [k for k in MODEL_KEYS if k not in npz.files]
    if missing:
      raise ConversionError(f'body model {path} lacks {", ".join(missing)} (it has: '
                            f'{", ".join(sorted(npz.files))})')
    a = {k: _array(npz, k, path, 'body model') for k in MODEL_KEYS}
    weights = _array(npz, 'weights', path, 'body model') if 'weights' in npz.files else None
  if a['kintree_table'].ndim != 2 or a['kintree_table'].shape[0] != 2:
    raise ConversionError(f'body model {path}: kintree_table has shape '
                          f'{a["kintree_table"].shape}, expected [2, Jm]')
  try:
    parents = parents_from_kintree(a['kintree_table'])
  except ConversionError as e:
    raise ConversionError(f'body model {path}: {e}') from None
  model = BodyModel(path=str(path), sha256=file_sha256(path),
                    v_template=a['v_template'].astype(np.float64),
                    shapedirs=a['shapedirs'].astype(np.float64),
                    J_regressor=a['J_regressor'].astype(np.float64), parents=parents,
                    weights=None if weights is None else weights.astype(np.float64))
  _check_model(model)
  return model


def _check_model(m: BodyModel) -> None:
  if m.v_template.ndim != 2 or m.v_template.shape[1] != 3:
    raise ConversionError(f'body model {m.path}: v_template has shape {m.v_template.shape}, '
                          'expected [V, 3]')
  V, Jm = m.v_template.shape[0], len(m.parents)
  expected = {'v_template': (V, 3), 'shapedirs': (V, 3, m.shapedirs.shape[-1]),
              'J_regressor': (Jm, V)}
  if m.weights is not None:
    expected['weights'] = (V, Jm)
  for name, shape in expected.items():
    if getattr(m, name).shape != shape:
      raise ConversionError(f'body model {m.path}: {name} has shape {getattr(m, name).shape}, '
                            f'expected {shape} (V={V} vertices, Jm={Jm} joints)')
  if Jm < BODY_JOINTS or any(p >= j for j, p in enumerate(m.parents)) or m.parents[0] != -1:
    raise ConversionError(f'body model {m.path}: needs >= {BODY_JOINTS} joints, root first and '
                          f'parents before children; kintree parents are {m.parents}')
  for j in range(BODY_JOINTS):
    if m.parents[j] != skeleton.SMPL22_PARENTS[j]:
      name = lambda k: skeleton.SMPL22_JOINTS[k] if k >= 0 else 'none'  # noqa: E731
      raise ConversionError(
          f'body model {m.path}: joint {j} ({name(j)}) has parent {m.parents[j]}, SMPL\'s is '
          f'{skeleton.SMPL22_PARENTS[j]} ({name(skeleton.SMPL22_PARENTS[j])}): not an SMPL, '
          'SMPL+H or SMPL-X model')


def rest_offsets(rest_joints: np.ndarray) -> np.ndarray:
  """`[22, 3]` rest joints (model frame) -> `[22, 3]` smpl22 offsets `o_j = J_j - J_parent(j)`;
  the root's is its rest position `J_0`."""
  parents = np.asarray([max(p, 0) for p in skeleton.SMPL22_PARENTS])
  offsets = rest_joints - rest_joints[parents]
  offsets[0] = rest_joints[0]
  return offsets


# ----------------------------------------------------------------------------------------------
# AMASS motion files.


@dataclasses.dataclass(frozen=True, eq=False)
class AmassMotion:
  """One AMASS sequence, float64, AMASS world (z up).

  Attributes:
    poses: `[T, 3K]` axis-angle local rotations of K >= 22 joints, root first (radians).
    trans: `[T, 3]` translation (metres).
    betas: `[B]` shape coefficients.
    fps: source frame rate.
    gender: 'neutral', 'female', 'male' or what the file says.
  """
  poses: np.ndarray
  trans: np.ndarray
  betas: np.ndarray
  fps: float
  gender: str

  @property
  def num_frames(self) -> int:
    return int(self.poses.shape[0])

  def body_rotvecs(self) -> np.ndarray:
    """`[T, 22, 3]` axis-angle of the 22 body joints."""
    return self.poses[:, :3 * BODY_JOINTS].reshape(-1, BODY_JOINTS, 3)


_GENDER_WORDS = {'f': 'female', 'female': 'female', 'woman': 'female', 'w': 'female',
                 'm': 'male', 'male': 'male', 'man': 'male',
                 'n': 'neutral', 'neutral': 'neutral', '': 'neutral'}


def _gender(value: np.ndarray) -> str:
  """A file's `gender` field as one of GENDERS where it says one ('f', 'F', 'woman' ->
  'female'; other labs' fitters write these); else the word as written (`choose_model`)."""
  g = value.item() if value.size == 1 else value
  g = g.decode() if isinstance(g, bytes) else str(g)
  g = g.strip().lower()
  return _GENDER_WORDS.get(g, g)


def _frame_rate(value: np.ndarray, path: Path, key: str) -> float:
  """A file's frame rate field: a number, or an array of one (`np.savez(...,
  mocap_framerate=[fps])`); one line for anything else."""
  value = np.asarray(value)
  if value.size != 1:
    raise ConversionError(f'{path}: {key} must be one number, got an array of shape '
                          f'{value.shape} ({value.dtype})')
  try:
    return check_frame_rate(value.ravel()[0].item(), f'{path}: {key}')
  except InputError as e:
    raise ConversionError(str(e)) from None


def read_amass(path: str | os.PathLike) -> AmassMotion:
  """Reads an AMASS npz. Raises NoMotion without `poses`, ConversionError naming the file and
  the field for anything missing or malformed."""
  path = Path(path)
  with _open_npz(path, 'motion file') as npz:
    if 'poses' not in npz.files:
      raise NoMotion(f'{path}: no poses (fields: {", ".join(sorted(npz.files))}); a shape file')
    rate_key = next((k for k in ('mocap_framerate', 'mocap_frame_rate') if k in npz.files), None)
    missing = [k for k in ('trans', 'betas') if k not in npz.files]
    missing += [] if rate_key else ['mocap_framerate (or mocap_frame_rate)']
    if missing:
      raise ConversionError(f'{path}: missing field {", ".join(missing)} (it has: '
                            f'{", ".join(sorted(npz.files))})')
    read = lambda k: _array(npz, k, path, 'motion file')  # noqa: E731
    gender = _gender(read('gender')) if 'gender' in npz.files else 'neutral'
    motion = AmassMotion(poses=read('poses').astype(np.float64),
                         trans=read('trans').astype(np.float64),
                         betas=read('betas').astype(np.float64).reshape(-1),
                         fps=_frame_rate(read(rate_key), path, rate_key),
                         gender=gender)
  _check_motion(motion, path)
  return motion


def _check_motion(m: AmassMotion, path: Path) -> None:
  T = m.poses.shape[0] if m.poses.ndim == 2 else -1
  if T < 1 or m.poses.shape[1] < 3 * BODY_JOINTS or m.poses.shape[1] % 3:
    raise ConversionError(f'{path}: poses has shape {m.poses.shape}, expected [T >= 1, 3K] '
                          f'with K >= {BODY_JOINTS} joints')
  if m.trans.shape != (T, 3):
    raise ConversionError(f'{path}: trans has shape {m.trans.shape}, expected {(T, 3)}')
  if not (math.isfinite(m.fps) and m.fps > 0):
    raise ConversionError(f'{path}: frame rate {m.fps} is not a positive number')
  for name in ('poses', 'trans', 'betas'):
    if not np.all(np.isfinite(getattr(m, name))):
      raise ConversionError(f'{path}: {name} holds NaN or infinite values')


# ----------------------------------------------------------------------------------------------
# SMPL motion on the rig, and the independent references it is checked against.


def rig_motion(rotvecs: np.ndarray, trans: np.ndarray, rest_joints: np.ndarray,
               W: np.ndarray = AMASS_TO_RIG) -> retarget.ReducedMotion:
  """SMPL body pose -> the smpl22 rig in the rig's world (module docstring), float64.

  Args:
    rotvecs: `[T, 22, 3]` axis-angle local rotations (root: AMASS world).
    trans: `[T, 3]` AMASS translation. rest_joints: `[22, 3]` regressed rest joints (model frame).
    W: `[3, 3]` AMASS world -> rig world.
  """
  return retarget.ReducedMotion(local_rot=smpl.local_from_smpl_pose(rotvecs, W),
                                root_pos=(rest_joints[0] + trans) @ W.T,
                                offsets=rest_offsets(rest_joints))


def _rodrigues_np(rotvecs: np.ndarray) -> np.ndarray:
  """`[..., 3]` -> `[..., 3, 3]` by `I + sin(t) K + (1 - cos(t)) K^2` (numpy reference)."""
  theta = np.linalg.norm(rotvecs, axis=-1, keepdims=True)
  k = rotvecs / np.where(theta > 0, theta, 1.0)
  K = np.zeros(rotvecs.shape[:-1] + (3, 3))
  K[..., 0, 1], K[..., 0, 2], K[..., 1, 2] = -k[..., 2], k[..., 1], -k[..., 0]
  K = K - np.swapaxes(K, -1, -2)
  s, c = np.sin(theta)[..., None], np.cos(theta)[..., None]
  return np.eye(3) + s * K + (1 - c) * K @ K


def smpl_chain_np(rotvecs: np.ndarray, rest_joints: np.ndarray, parents: Sequence[int]
                  ) -> np.ndarray:
  """Naive SMPL chain (smplx `batch_rigid_transform`): `[T, K, 3]` axis-angle, `[K, 3]` rest
  joints -> `[T, K, 3, 4]` model-frame world transforms `[R | a]` (a: joint position, no trans).
  """
  R = _rodrigues_np(rotvecs)
  A = []
  for j, p in enumerate(parents):
    rel = rest_joints[j] - (rest_joints[p] if p >= 0 else 0.0)
    T_j = np.concatenate([R[:, j], np.broadcast_to(rel[:, None], R[:, j].shape[:-2] + (3, 1))],
                         axis=-1)
    if p < 0:
      A.append(T_j)
    else:
      A.append(np.concatenate([A[p][..., :3] @ T_j[..., :3],
                               A[p][..., :3] @ T_j[..., 3:] + A[p][..., 3:]], axis=-1))
  return np.stack(A, axis=1)


def naive_joints_np(rotvecs: np.ndarray, trans: np.ndarray, rest_joints: np.ndarray,
                    parents: Sequence[int], W: np.ndarray = AMASS_TO_RIG) -> np.ndarray:
  """`[T, K, 3]` rig-world joint positions from the raw SMPL parameters (the reference)."""
  a = smpl_chain_np(rotvecs, rest_joints, parents)[..., 3]
  return (a + trans[:, None]) @ W.T


def _model_rotvecs(motion: AmassMotion, num_joints: int) -> np.ndarray:
  """`[T, Jm, 3]`: the file's rotations when it poses exactly the model's joints, else the 22
  body joints and identity for the rest."""
  T = motion.num_frames
  if motion.poses.shape[1] == 3 * num_joints:
    return motion.poses.reshape(T, num_joints, 3)
  out = np.zeros((T, num_joints, 3))
  out[:, :BODY_JOINTS] = motion.body_rotvecs()
  return out


def lbs_regressed_joints_np(model: BodyModel, betas: np.ndarray, motion: AmassMotion,
                            W: np.ndarray = AMASS_TO_RIG, chunk: int = 256) -> np.ndarray:
  """The model's own regression of its skinned mesh: `J_regressor[:22] @ LBS(v_shaped)`,
  `[T, 22, 3]` in the rig world. Only vertices the 22 rows use are skinned; pose blend shapes
  are left out (SMPL regresses its joints from the shaped template, before them)."""
  v = model.shaped_vertices(betas)
  J = model.J_regressor @ v
  reg = model.J_regressor[:BODY_JOINTS]
  used = np.flatnonzero(np.any(reg != 0, axis=0))
  w, v_used = model.weights[used], v[used]
  rotvecs = _model_rotvecs(motion, len(model.parents))
  out = []
  for s in range(0, motion.num_frames, chunk):
    A = smpl_chain_np(rotvecs[s:s + chunk], J, model.parents)  # [t, Jm, 3, 4]
    A[..., 3] -= np.einsum('tkab,kb->tka', A[..., :3], J)  # rest-relative: v -> R (v - J) + a
    M = np.matmul(w, A.reshape(A.shape[0], A.shape[1], 12)).reshape(A.shape[0], -1, 3, 4)
    posed = np.einsum('tvab,vb->tva', M[..., :3], v_used) + M[..., 3]
    posed = (posed + motion.trans[s:s + chunk, None]) @ W.T
    out.append(np.einsum('jv,tva->tja', reg[:, used], posed))
  return np.concatenate(out)


# ----------------------------------------------------------------------------------------------
# Inputs and splits.


def find_amass_files(input_path: str | os.PathLike) -> list[tuple[str, Path]]:
  """`(name, path)` of an npz file or of every *.npz under a directory; names are
  `SUBDATASET/SUBJECT/FILE` completed from the directories above `input_path` (module
  docstring)."""
  root = Path(input_path)
  if root.is_file():
    found, base = [root], root.parent
  elif root.is_dir():
    found = conversion.files_under(root, '.npz')
    base = root
    if not found:
      raise ConversionError(f'no .npz files under {root}')
  else:
    raise ConversionError(f'input {root} does not exist')
  # The directories down to `base`, for short names: as the user named them (a linked
  # `HumanEva` is HumanEva, whatever the folder it links to is called).
  above = list(Path(os.path.abspath(base)).parts[1:])
  out = []
  for p in found:
    rel = list(p.relative_to(base).parts)
    prefix = above[max(0, len(above) - (3 - len(rel))):] if len(rel) < 3 else []
    out.append(('/'.join(prefix + rel), p))
  return out


def load_amass_split(path: str | os.PathLike = DEFAULT_SPLIT) -> tuple[dict, str]:
  """A committed sub-dataset split (amass_default.json's layout) and its sha256."""
  path = Path(path)
  try:
    text = path.read_text()
    doc = json.loads(text)
  except (OSError, json.JSONDecodeError) as e:
    raise ConversionError(f'cannot read split {path}: {e}') from None
  names = {'type': 'array', 'items': {'type': 'string', 'minLength': 1}}
  retarget.validate_json(doc, {
      'type': 'object', 'required': ['name', 'unknown', 'subdatasets'], 'properties': {
          'name': {'type': 'string', 'minLength': 1},
          'unknown': {'type': 'string', 'enum': ['train', 'val', 'test', 'refuse']},
          'subdatasets': {'type': 'object', 'additionalProperties': names, 'properties': {
              s: names for s in ('train', 'val', 'test')}}}}, str(path))
  extra = set(doc['subdatasets']) - {'train', 'val', 'test'}
  if extra:
    raise ConversionError(f'{path}: subdatasets has unknown split(s) {sorted(extra)}')
  return doc, hashlib.sha256(text.encode()).hexdigest()


def subdataset_split(file: str, split_doc: dict) -> tuple[str, str | None]:
  """`(sub-dataset, split or None when the split file does not name it)` of a file name."""
  by_name = {n.lower(): s for s, names in split_doc['subdatasets'].items() for n in names}
  dirs = Path(file).parts[:-1]
  for d in dirs:
    if d.lower() in by_name:
      return d, by_name[d.lower()]
  return (dirs[0] if dirs else ''), None


# ----------------------------------------------------------------------------------------------
# One file, and the whole command.


def choose_model(gender: str, models: dict[str, BodyModel | None], file: str
                 ) -> tuple[str, BodyModel]:
  """`(which, model)`: the file's gender's model when given, else the neutral one. A gender
  that is none of GENDERS is refused where gendered models were given (which would it be?)."""
  gendered = [g for g in GENDERS[1:] if models.get(g) is not None]
  if gender not in GENDERS and gendered:
    raise ConversionError(f'{file}: gender {gender!r} is none of {", ".join(GENDERS)} (nor f, m, '
                          'woman, man), and gendered body models were given: fix the file\'s '
                          'gender field, or leave out --body_model_female/--body_model_male to '
                          'use the neutral model for every file')
  which = gender if models.get(gender) is not None else 'neutral'
  if models.get(which) is None:
    flag = f' (or --body_model_{gender})' if gender in GENDERS[1:] else ''
    raise ConversionError(f'{file}: gender {gender!r} and no neutral model: pass --body_model'
                          + flag)
  return which, models[which]


_FAMILIES = {52: 'SMPL+H', 55: 'SMPL-X'}


def _check_family(motion: AmassMotion, model: BodyModel, file: str) -> None:
  """Refuses SMPL-X poses on an SMPL+H model and the reverse: the betas belong to the family
  the file was fitted with."""
  k, jm = motion.poses.shape[1] // 3, len(model.parents)
  if k in _FAMILIES and jm in _FAMILIES and k != jm:
    raise ConversionError(f'{file}: poses of {k} joints ({_FAMILIES[k]}) but body model '
                          f'{model.path} has {jm} ({_FAMILIES[jm]}): use the model family the '
                          'AMASS release was fitted with')


def convert_file(file: str, path: Path, subject: str, sha256: str,
                 models: dict[str, BodyModel | None], fps: float, num_betas: int,
                 W: np.ndarray = AMASS_TO_RIG) -> conversion.Clip:
  """One AMASS npz -> a verified, resampled Clip. Raises NoMotion / ConversionError."""
  start = time.perf_counter()
  motion = read_amass(path)
  which, model = choose_model(motion.gender, models, file)
  _check_family(motion, model, file)
  n = min(num_betas, motion.betas.shape[0], model.num_betas)
  betas = motion.betas[:n]
  rest = model.rest_joints(betas)
  reduced = rig_motion(motion.body_rotvecs(), motion.trans, rest[:BODY_JOINTS], W)
  _, p = retarget.forward_kinematics_np(reduced, skeleton.SMPL22_PARENTS)
  reference = naive_joints_np(motion.body_rotvecs(), motion.trans, rest[:BODY_JOINTS],
                              skeleton.SMPL22_PARENTS, W)
  error = float(np.linalg.norm(p - reference, axis=-1).max())
  if not error <= retarget.FK_TOL_M:
    raise ConversionError(f'{path}: FK check failed: rig positions differ from the SMPL chain by '
                          f'up to {error:.3g} m (limit {retarget.FK_TOL_M:g} m)')
  gap = None
  if model.weights is not None:  # a diagnostic (module docstring), on LBS_FRAMES spread frames
    idx = np.unique(np.linspace(0, motion.num_frames - 1, LBS_FRAMES).round().astype(int))
    some = dataclasses.replace(motion, poses=motion.poses[idx], trans=motion.trans[idx])
    gap = float(np.linalg.norm(p[idx] - lbs_regressed_joints_np(model, betas, some, W),
                               axis=-1).max())
  rate = retarget.source_fps(1.0 / motion.fps)
  out = retarget.resample(reduced, rate, fps)
  G, p_out = retarget.forward_kinematics_np(out, skeleton.SMPL22_PARENTS)
  extra = {'gender': motion.gender, 'body_model': which, 'num_betas': n,
           'betas': [float(b) for b in betas], 'lbs_joint_gap_m': gap}
  return conversion.Clip(
      file=file, path=str(path), subject=subject, sha256=sha256,
      names=skeleton.SMPL22_JOINTS, parents=skeleton.SMPL22_PARENTS, offsets=out.offsets,
      local_rot=out.local_rot, global_rot=G, positions=p_out, source_frames=motion.num_frames,
      source_fps=rate, fk_max_error_m=error, seconds=time.perf_counter() - start, extra=extra)


def load_models(body_model: str | None, female: str | None, male: str | None,
                ) -> dict[str, BodyModel | None]:
  """The neutral / female / male models given (at least one)."""
  paths = dict(zip(GENDERS, (body_model, female, male)))
  if not any(paths.values()):
    raise ConversionError('--body_model (or --body_model_female and --body_model_male) required')
  return {g: load_body_model(p) if p else None for g, p in paths.items()}


def _check_args(split: str, fps: float, num_betas: int, on_error: str) -> None:
  if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
    raise ConversionError(f'--fps must be a positive number, got {fps!r}')
  if split not in ('auto',) + conversion.SPLIT_NAMES:
    raise ConversionError(f'--split must be auto or one of {", ".join(conversion.SPLIT_NAMES)}, '
                          f'got {split!r}')
  if not (isinstance(num_betas, int) and num_betas >= 0):
    raise ConversionError(f'--num_betas must be a non-negative integer, got {num_betas!r}')
  if on_error not in ('fail', 'skip'):
    raise ConversionError(f'on_error must be fail or skip, got {on_error!r}')


def convert(input_path: str | os.PathLike, body_model: str | None, output: str | os.PathLike, *,
            body_model_female: str | None = None, body_model_male: str | None = None,
            split: str = 'auto', fps: float = 30.0, num_betas: int = 10,
            split_file: str | os.PathLike | None = None, on_error: str = 'fail',
            log: Log = log_stderr) -> dict:
  """AMASS npz file(s) -> smpl22 shard directory `output` (created, or added to).

  Args mirror `amass_to_shards` flags: `split` is 'auto' (by sub-dataset, `split_file` or
  amass_default.json) or a split that takes every file; `on_error='skip'` logs and skips refused
  files. Returns the summary. Raises ConversionError (one line); the output is then unchanged.
  """
  started = time.perf_counter()
  _check_args(split, fps, num_betas, on_error)
  output, rig = Path(output), skeleton.smpl22()
  shards = conversion.load_output(output)
  conversion.check_output_matches(shards, output, fps, rig)
  split_doc, digest = load_amass_split(split_file or DEFAULT_SPLIT)
  models = load_models(body_model, body_model_female, body_model_male)
  inputs = find_amass_files(input_path)
  new, skipped = conversion.new_inputs(inputs, shards, output, log)
  if not new:
    log(f'nothing to convert: every input file is already in {output}')
    return shards.summary
  clips, refused, no_motion, unknown = [], [], [], {}
  for file, path, sha in new:
    sub, auto_split = subdataset_split(file, split_doc)
    if split == 'auto' and auto_split is None:
      if split_doc['unknown'] == 'refuse':
        raise ConversionError(f'{file}: sub-dataset {sub!r} is not in split {split_doc["name"]}')
      if sub not in unknown:
        log(f'note: sub-dataset {sub!r} is not in split {split_doc["name"]}: its files go to '
            f'{split_doc["unknown"]}')
      unknown[sub] = unknown.get(sub, 0) + 1
    try:
      clip = convert_file(file, path, str(Path(file).parent.as_posix()), sha, models, fps,
                          num_betas)
    except NoMotion as e:
      no_motion.append(file)
      log(f'{file}: skipped: {e}')
      continue
    except ConversionError as e:
      reason = str(e) if str(e).startswith((str(path), f'{file}:')) else f'{file}: {e}'
      if on_error == 'fail':
        raise ConversionError(reason) from None
      refused.append({'file': file, 'reason': reason})
      log(f'REFUSED {reason}')
      continue
    clip.split = (auto_split or split_doc['unknown']) if split == 'auto' else split
    clip.part = sub
    clips.append(clip)
    _log_clip(clip, fps, log)
  if not clips and not refused and shards.summary is not None:
    log(f'nothing to convert: every motion file is already in {output}')
    return shards.summary
  if not clips:
    raise ConversionError(f'no motion converted: {len(no_motion)} file(s) without poses, '
                          f'{len(refused)} refused')
  run = _run_record(input_path, models, num_betas, split, clips, skipped, refused, no_motion,
                    unknown, started)
  sources = {split_doc['name']: digest} if split == 'auto' else {f'--split={split}': None}
  return conversion.write_output(output, shards, rig, clips, float(fps), sources, run, log)


def _log_clip(clip: conversion.Clip, fps: float, log: Log) -> None:
  x = clip.extra
  model = x['body_model'] + ('' if x['body_model'] == x['gender'] else f' (file: {x["gender"]})')
  gap = '' if x['lbs_joint_gap_m'] is None else f', LBS joint gap {x["lbs_joint_gap_m"]:.2e} m'
  log(f'{clip.file}: subject {clip.subject}, {clip.source_frames} frames @ '
      f'{clip.source_fps:g} fps -> {clip.frames} @ {fps:g} fps ({clip.split}), body model '
      f'{model}, FK max error {clip.fk_max_error_m:.2e} m{gap}, {clip.seconds:.2f} s')


def _run_record(input_path, models, num_betas, split, clips, skipped, refused, no_motion,
                unknown, started) -> dict:
  gaps = [c.extra['lbs_joint_gap_m'] for c in clips if c.extra['lbs_joint_gap_m'] is not None]
  return {
      'input': str(input_path), 'source': 'amass',
      'body_models': {g: {'path': m.path, 'sha256': m.sha256, 'joints': len(m.parents),
                          'num_betas': m.num_betas} for g, m in models.items() if m},
      'num_betas': num_betas, 'world_rotation': AMASS_TO_RIG.tolist(), 'split': split,
      'unknown_subdatasets': unknown, 'files_added': len(clips), 'files_skipped': skipped,
      'files_refused': refused, 'files_without_poses': no_motion,
      'frames_added': sum(c.frames for c in clips),
      'fk_max_error_m': max(c.fk_max_error_m for c in clips),
      'lbs_joint_gap_max_m': max(gaps) if gaps else None,
      'seconds': round(time.perf_counter() - started, 3), 'git_commit': git_commit(),
      'time_utc': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}
