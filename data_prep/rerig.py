r"""Re-rigged CMU: the same motion under another bind convention (issue L; DESIGN section 3).

    python -m data_prep.rerig --input=../shared/data/cmu --output=DIR [--seed=0] \
        [--files=07_12,09_03] [--order=XZY] [--units=cm] [--bind=bone_x|random] [--precision=6] \
        [--up=y --forward=z]

Every joint j of the source hierarchy (all 31 CMU joints, fingers included) gets one fixed bind
rotation `A_j`, the same in every file (one rig; `--seed`): its new frame is the old one times
`A_j`. Offsets are re-expressed in the parent's new frame, `o'_j = A_parent^T o_j`, End Sites in
the joint's, `e'_j = A_j^T e_j`, and every frame is compensated, `R'_j = A_parent^T R_j A_j`
(root: `R'_root = R_root A_root`), so that `G'_j = G_j A_j` and every joint position is
unchanged. The zero pose of the result (all channels 0) is a crumpled, non-natural pose.
- `--bind=bone_x` (default): like game-engine and DCC rigs, each bone runs along its joint's
  local +X: `A_j e_x` is the direction of the joint's child bone in the cmu_body template (the
  child mapped to a cmu_body joint with a non-zero offset), with a random twist about it; joints
  without such a child (Hips, Spine1, hands, Head, toes, fingers) get a uniformly random
  rotation. `--bind=random`: every `A_j` uniformly random.
- Channels: every joint gets three rotation channels in `--order` (default XZY, intrinsic as
  everywhere here), the old root `Hips` keeps its three position channels first.
- Units: `--units` (default cm) instead of CMU's 0.056444 m; offsets, End Sites and the root
  translation are scaled.
- A dummy root `Reference` above Hips, with three rotation channels that are 0 in every frame
  and an OFFSET drawn per file (`default_rng([seed, crc32(file name)])`: x, z in [-100, 100],
  y in [0, 20] cm); Hips' position channels are compensated (`t' = p - o_ref`).
- World: `--up` and `--forward` (default y and z, CMU's) name the output world's up axis and the
  axis the rest body faces, e.g. `--up=z --forward=-y` for Blender's. The y-up result is then
  re-labelled by the rotation V taking CMU's (y, z) to them, as a z-up tool writes a BVH (and as
  io/retarget.py reads one back): every OFFSET, End Site and translation `V o`, every local
  rotation `V R' V^T`, so every joint lands at `V p`. The joint map says so (its `up` and
  `forward`), so converting the files gives exactly what the y-up files give.
- Frame 0 (cgspeed's synthetic T-pose) stays, re-rigged like every frame.
Before a file is written its text is parsed back and its FK (`bvh.naive_fk_np` with
`--units`) compared with the original's (CMU units) for every frame, joint and End Site; above
1e-6 m the run stops with the reason and writes nothing more.

Besides the BVH files, DIR gets what converting them onto cmu_body's 21 joints needs, so that
`bvh_to_shards --input=DIR --rig=DIR/cmu_body_rerig.json` is exactly comparable with
`--rig=cmu_body` on the originals:
- `cmu_body_rerig.rig.json`: the cmu_body rig (same joints, parents, designated children,
  reference axes, mirror map) with its template re-expressed (`A_parent^T o`) and its reference
  pose `F_k = A_k` (skeleton.Rig.reference_pose): the re-rigged frames of cmu_body's own
  reference (its zero pose, a T-pose; `G = I` becomes `G' = A`).
- `cmu_body_rerig.json`: the joint map (cmu_body's reduction: fingers and thumbs pruned;
  LHipJoint, RHipJoint, LeftShoulder, RightShoulder removed, their rotation now the constant
  `A_parent^T A_j`; Reference folded into the root), units, cgspeed's first frame dropped, and
  `reference_pose` as the channel values of that T-pose (Euler angles of `A_parent^T A_j`), which
  the conversion checks against the rig's.
- `cmu_default_rerig.split.json`: cmu_default's split with the new files' sha256 (files it does
  not list, or lists with another sha256, are left out: convert those with `--split=NAME`).
- `rerig.json`: seed, order, units, bind mode, the binds (quaternions w, x, y, z), per file its
  Reference offset, FK error and source sha256.
The same files also convert with `--rig=auto --units=auto --reference_pose=first_frame`
(cgspeed's T-pose frame as the reference: a natural pose, but not cmu_body's zero pose, so only
the cmu_body route compares exactly).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
import zlib
from pathlib import Path
from typing import Sequence

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from scipy.spatial.transform import Rotation  # noqa: E402

from ik_gat_jax import skeleton  # noqa: E402
from ik_gat_jax.absl_main import fail, run_main  # noqa: E402
from ik_gat_jax.io import atomic  # noqa: E402
from ik_gat_jax.io import bvh  # noqa: E402
from ik_gat_jax.io import retarget  # noqa: E402
from ik_gat_jax.io.units import parse_units  # noqa: E402
from ik_gat_jax.provenance import file_sha256, git_commit  # noqa: E402

CMU_UNITS = 0.056444
FK_TOL_M = 1e-6
DUMMY_ROOT = 'Reference'
JOINT_MAP = 'cmu_body_rerig.json'
RIG_FILE = 'cmu_body_rerig.rig.json'
SPLIT_FILE = 'cmu_default_rerig.split.json'
REPO = Path(__file__).resolve().parents[1]


class RerigError(RuntimeError):
  """A re-rigged file that does not reproduce the original (the reason, one line)."""


def _random_rotation(rng: np.random.Generator) -> np.ndarray:
  q = rng.normal(size=4)
  return skeleton.matrix_from_quat_np(q / np.linalg.norm(q))


def make_binds(names: Sequence[str], parents: Sequence[int], seed: int,
               mode: str = 'bone_x') -> np.ndarray:
  """`[J, 3, 3]` bind rotations `A_j` for a CMU hierarchy (module docstring)."""
  if mode not in ('bone_x', 'random'):
    raise ValueError(f'--bind must be bone_x or random, got {mode!r}')
  rng = np.random.default_rng([seed, 0x4C])
  rig = skeleton.cmu_body()
  template = {n: rig.template()[k] for k, n in enumerate(rig.joint_names)}
  out = []
  for j in range(len(names)):
    kids = [names[c] for c, p in enumerate(parents) if p == j]
    bone = next((template[c] for c in kids
                 if c in template and np.linalg.norm(template[c]) > 1e-6), None)
    A = _random_rotation(rng)  # drawn for every joint, so both modes share the stream
    if mode == 'bone_x' and bone is not None:
      x = bone / np.linalg.norm(bone)
      u = rng.normal(size=3)
      y = u - (u @ x) * x
      y /= np.linalg.norm(y)
      A = np.stack([x, y, np.cross(x, y)], axis=1)
    out.append(A)
  return np.stack(out)


def reference_offset(file: str, seed: int) -> np.ndarray:
  """The dummy root's OFFSET for `file` (cm-like units of the output): seeded by its name."""
  rng = np.random.default_rng([seed, zlib.crc32(Path(file).name.encode())])
  return np.array([rng.uniform(-100, 100), rng.uniform(0, 20), rng.uniform(-100, 100)])


def _local_rotations(motion: bvh.BVHMotion) -> np.ndarray:
  T, J = motion.num_frames, len(motion.joints)
  R = np.broadcast_to(np.eye(3), (T, J, 3, 3)).copy()
  for j in range(J):
    order = motion.euler_order(j)
    if order:
      R[:, j] = bvh.euler_to_matrix_np(motion.rotation_degrees(j), order)
  return R


def _euler(R: np.ndarray, order: str) -> np.ndarray:
  """`[..., 3, 3]` -> intrinsic Euler degrees `[..., 3]` in `order` (R = R_o0 R_o1 R_o2)."""
  flat = R.reshape(-1, 3, 3)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')  # gimbal lock: the angles still reproduce R
    e = Rotation.from_matrix(flat).as_euler(order.upper(), degrees=True)
  return e.reshape(R.shape[:-2] + (3,))


def world(up: str = 'y', forward: str = 'z') -> np.ndarray:
  """V `[3, 3]`: CMU's world (y up, facing +z) -> the output's (`up`, `forward`)."""
  return retarget.world_rotation('+y', '+z', retarget.parse_axis(up), retarget.parse_axis(forward))


def rerig_motion(motion: bvh.BVHMotion, binds: np.ndarray, order: str, scale: float,
                 ref_offset: np.ndarray, V: np.ndarray = np.eye(3)) -> bvh.BVHMotion:
  """The re-rigged motion (module docstring): a dummy root, binds `[J, 3, 3]`, Euler `order`,
  `scale` output units per source unit, the dummy root at `V ref_offset` (output units), the
  world turned by `V` (`world`)."""
  if len(order) != 3 or sorted(order.upper()) != ['X', 'Y', 'Z']:
    raise ValueError(f'--order must be a permutation of XYZ, got {order!r}')
  order = order.upper()
  rot_channels = tuple(f'{a}rotation' for a in order)
  parents = motion.parents
  if parents[0] != -1 or motion.position_channels(0) is None:
    raise ValueError('the source root must have position channels (a BVH root)')
  if any(motion.position_channels(j) is not None for j in range(1, len(parents))):
    raise ValueError('only the source root may have position channels')
  A = binds
  R = _local_rotations(motion)
  Ap = _parent_binds(A, parents)
  R_new = V @ np.einsum('jba,tjbc,jcd->tjad', Ap, R, A) @ V.T  # V A_p^T R A_j V^T
  ref = V @ np.asarray(ref_offset, np.float64)
  joints = [bvh.BVHJoint(DUMMY_ROOT, -1, ref, rot_channels)]
  for j, joint in enumerate(motion.joints):
    offset = np.zeros(3) if j == 0 else scale * (V @ Ap[j].T @ joint.offset)
    end = None if joint.end_site is None else scale * (V @ A[j].T @ joint.end_site)
    joints.append(bvh.BVHJoint(joint.name, joint.parent + 1, offset,
                               (bvh.POSITION_CHANNELS if j == 0 else ()) + rot_channels, end))
  root_pos = scale * motion.position_channels(0) @ V.T - ref
  T = motion.num_frames
  cols = [np.zeros((T, 3)), root_pos] + [_euler(R_new[:, j], order) for j in range(len(parents))]
  return bvh.BVHMotion(joints=joints, frame_time=motion.frame_time,
                       motion=np.concatenate(cols, axis=1))


def _parent_binds(A: np.ndarray, parents: Sequence[int]) -> np.ndarray:
  """Per joint its parent's bind (identity for the root)."""
  return np.stack([np.eye(3) if p < 0 else A[p] for p in parents])


def fk_error(original: bvh.BVHMotion, rerigged: bvh.BVHMotion, source_m: float,
             target_m: float, V: np.ndarray = np.eye(3)) -> float:
  """Max distance (m) over frames of joints and End Sites between the two files' naive FK,
  the original's turned by `V`."""
  p0, G0 = bvh.naive_fk_np(original, source_m, with_rotations=True)
  p0, G0 = p0 @ V.T, V @ G0  # End Sites: V (p + G e)
  p1, G1 = bvh.naive_fk_np(rerigged, target_m, with_rotations=True)
  p1, G1 = p1[:, 1:], G1[:, 1:]  # without the dummy root
  err = float(np.linalg.norm(p1 - p0, axis=-1).max())
  for j, (a, b) in enumerate(zip(original.joints, rerigged.joints[1:])):
    if a.end_site is not None:
      e0 = p0[:, j] + source_m * G0[:, j] @ a.end_site
      e1 = p1[:, j] + target_m * G1[:, j] @ b.end_site
      err = max(err, float(np.linalg.norm(e1 - e0, axis=-1).max()))
  return err


def rerig_file(src: Path, dst: Path, binds: np.ndarray, order: str, units_m: float, seed: int,
               precision: int | None = 6, V: np.ndarray = np.eye(3)) -> dict:
  """Re-rigs one file, verifies the written text (module docstring), writes it atomically."""
  original = bvh.read_bvh(src)
  if original.names[0] == DUMMY_ROOT:
    raise RerigError(f'{src}: already has a {DUMMY_ROOT} root')
  ref = reference_offset(src.name, seed)
  motion = rerig_motion(original, binds, order, CMU_UNITS / units_m, ref, V)
  text = bvh.format_bvh(motion, precision)
  err = fk_error(original, bvh.parse_bvh(text, str(dst)), CMU_UNITS, units_m, V)
  if not err <= FK_TOL_M:
    raise RerigError(f'{src}: the re-rigged file moves joints by up to {err:.3g} m (limit '
                     f'{FK_TOL_M:g} m); nothing written for it')
  atomic.write_text(dst, text)
  return {'file': src.name, 'source_sha256': file_sha256(src), 'sha256': file_sha256(dst),
          'reference_offset': ref.tolist(), 'fk_max_error_m': err, 'frames': motion.num_frames}


def rerigged_rig(binds: np.ndarray, names: Sequence[str]) -> skeleton.Rig:
  """cmu_body re-expressed under the binds (module docstring): template `A_parent^T o` (the
  rig parent's source joint), reference pose `F_k = A_k`."""
  rig = skeleton.cmu_body()
  index = {n: i for i, n in enumerate(names)}
  A = np.stack([binds[index[n]] for n in rig.joint_names])
  tmpl = rig.template()
  new = np.stack([tmpl[k] if p < 0 else A[p].T @ tmpl[k] for k, p in enumerate(rig.parents)])
  d = rig.to_json()
  d.update(name='cmu_body_rerig', template_offsets=[[float(x) for x in r] for r in new],
           reference_pose=[[float(x) for x in q] for q in skeleton.quat_from_matrix_np(A)])
  return skeleton.Rig.from_json(d)


def joint_map_doc(binds: np.ndarray, names: Sequence[str], parents: Sequence[int], order: str,
                  units_m: float, up: str = 'y', forward: str = 'z') -> dict:
  cmu = json.loads((retarget.JOINT_MAP_DIR / 'cmu_body.json').read_text())
  Ap = _parent_binds(binds, parents)
  V = world(up, forward)
  ref_local = V @ np.einsum('jba,jbc->jac', Ap, binds) @ V.T  # cmu_body's zero pose, re-rigged
  angles = _euler(ref_local, order)
  return {
      '$schema': str(retarget.SCHEMA_PATH),
      'description': 'Re-rigged CMU (data_prep/rerig.py) -> the cmu_body joints, cmu_body\'s '
                     'reduction; its rig is cmu_body under the binds, its reference pose '
                     'cmu_body\'s zero pose in the re-rigged channels.',
      'rig': RIG_FILE,
      'joints': cmu['joints'],
      'prune': cmu['prune'],
      'mirror_pairs': cmu['mirror_pairs'],
      'units': units_m,
      'up': _signed(up),
      'forward': _signed(forward),
      'drop_first_frame': True,
      'subject_regex': cmu['subject_regex'],
      'default_split': SPLIT_FILE,
      'reference_pose': {n: [float(x) for x in angles[j]] for j, n in enumerate(names)},
  }


def _signed(axis: str) -> str:
  axis = axis.strip().lower()
  return axis if axis[0] in '+-' else '+' + axis


def split_doc(records: Sequence[dict]) -> dict:
  base = json.loads((REPO / 'data_prep' / 'splits' / 'cmu_default.json').read_text())
  by_file = {e['file']: e for e in base['files']}
  files = []
  for r in records:  # files cmu_default does not list as they are are left out (--split=NAME)
    e = dict(by_file.get(r['file'], {'sha256': None}))
    if e['sha256'] != r['source_sha256']:
      continue
    e['sha256'] = r['sha256']
    files.append(e)
  return {'name': 'cmu_default_rerig', 'rig': 'cmu_body_rerig',
          'source': 'cmu_default with the re-rigged files (data_prep/rerig.py)', 'files': files}


def rerig_directory(input_dir: str | os.PathLike, output: str | os.PathLike,
                    files: Sequence[str] | None = None, seed: int = 0, order: str = 'XZY',
                    units: str = 'cm', bind: str = 'bone_x', precision: int | None = 6,
                    up: str = 'y', forward: str = 'z',
                    log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
  """The whole command (module docstring). Returns the manifest written as rerig.json."""
  input_dir, output = Path(input_dir), Path(output)
  units_m = parse_units(units)
  V = world(up, forward)
  if files:
    paths = [input_dir / (f if f.endswith('.bvh') else f'{f}.bvh') for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
      raise RerigError(f'no such input file: {", ".join(missing)}')
  else:
    paths = sorted(input_dir.glob('*.bvh'))
    if not paths:
      raise RerigError(f'no .bvh files in {input_dir}')
  first = bvh.read_bvh(paths[0])
  names, parents = first.names, first.parents
  missing = [n for n in skeleton.cmu_body().joint_names if n not in names]
  if missing:  # before a file is written (it wrote them all, then failed)
    raise RerigError(f'{paths[0]}: not a CMU skeleton (re-rigging keeps cmu_body\'s joints): no '
                     + ', '.join(missing[:4]) + (', ...' if len(missing) > 4 else ''))
  output.mkdir(parents=True, exist_ok=True)
  binds = make_binds(names, parents, seed, bind)
  records = []
  for src in paths:
    head = bvh.read_bvh(src)
    if (head.names, head.parents) != (names, parents):
      raise RerigError(f'{src}: hierarchy differs from {paths[0]}')
    rec = rerig_file(src, output / src.name, binds, order, units_m, seed, precision, V)
    records.append(rec)
    log(f'{src.name}: re-rigged, FK max error {rec["fk_max_error_m"]:.2e} m')
  rig = rerigged_rig(binds, names)
  atomic.write_text(output / RIG_FILE, json.dumps(rig.to_json(), indent=1))
  all_names = (DUMMY_ROOT,) + tuple(names)
  atomic.write_json(output / JOINT_MAP, joint_map_doc(binds, names, parents, order, units_m,
                                                     up, forward), indent=1)
  atomic.write_json(output / SPLIT_FILE, split_doc(records), indent=1)
  manifest = {'seed': seed, 'order': order.upper(), 'units_m': units_m, 'bind': bind,
              'up': _signed(up), 'forward': _signed(forward),
              'precision': precision, 'joints': list(all_names), 'input': str(input_dir),
              'binds_wxyz': {n: [float(x) for x in q]
                             for n, q in zip(names, skeleton.quat_from_matrix_np(binds))},
              'files': records, 'fk_tolerance_m': FK_TOL_M, 'git_commit': git_commit()}
  atomic.write_json(output / 'rerig.json', manifest, indent=1)
  return manifest


def define_flags() -> None:
  """The main's flags, defined when it runs, not at import: tests import this module beside
  other mains (ik_gat_jax.solve defines --input too)."""
  flags.DEFINE_string('input', None, 'Directory of CMU BVH files (cgspeed, 31 joints).')
  flags.DEFINE_string('output', None, 'Directory for the re-rigged files.')
  flags.DEFINE_integer('seed', 0, 'Seed of the binds and the dummy root offsets.')
  flags.DEFINE_list('files', [], 'File stems to re-rig (default: every *.bvh).')
  flags.DEFINE_string('order', 'XZY', 'Euler channel order of every joint.')
  flags.DEFINE_string('units', 'cm', 'Output units (metres per unit or a unit name).')
  flags.DEFINE_enum('bind', 'bone_x', ['bone_x', 'random'], 'Bind convention.')
  flags.DEFINE_integer('precision', 6, 'Decimals of the motion values (-1: exact).')
  flags.DEFINE_string('up', 'y', 'Up axis of the output world (x, y, z, -x, ...).')
  flags.DEFINE_string('forward', 'z', 'Axis the rest body faces in the output world.')


def main(argv):
  F = flags.FLAGS
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  if not F.input or not F.output:
    fail('--input and --output required')
  try:
    m = rerig_directory(F.input, F.output, F.files, F.seed, F.order,
                        F.units, F.bind,
                        None if F.precision < 0 else F.precision, F.up, F.forward)
  except (RerigError, bvh.BVHError, ValueError, OSError) as e:
    fail(str(e))
  print(f'wrote {len(m["files"])} files to {F.output} (max FK error '
        f'{max(r["fk_max_error_m"] for r in m["files"]):.2e} m); convert with: python -m '
        f'data_prep.bvh_to_shards --input={F.output} '
        f'--rig={Path(F.output) / JOINT_MAP} --output=DIR', file=sys.stderr)


if __name__ == '__main__':
  define_flags()
  run_main(main)
