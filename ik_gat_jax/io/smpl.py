"""SMPL pose parameters of the smpl22 rig and the AMASS world, shared by the solver's SMPL
export (`io.exports.write_smpl_npz`) and the AMASS converter (`data_prep.amass`).

- SMPL kinematics. SMPL's pose is 22 axis-angle local rotations (radians, root orientation
  first) in model coordinates (y up, the rest body facing +z, as the smpl22 rig); SMPL's zero
  pose is the rig's rest pose, so the rig's local rotations are SMPL pose parameters when the
  offsets are the body model's rest joints. `trans` moves the whole body: the root joint is at
  `J_0 + trans` (`J_0`: the rest root joint, the offsets' row 0).
- Worlds. The AMASS world is z up; `AMASS_TO_RIG` = -90 degrees about x (AMASS +z -> rig +y,
  AMASS -y -> rig +z) turns it into the rig's: `R_root' = W @ R_root`, `p' = W @ (J_0 + trans)`;
  the other local rotations and the offsets, in the model's y-up frame, stay. The solver writes
  the root orientation and `trans` in the rig's y-up world (`world='rig'`, the SMPL model's own
  frame) or in AMASS's (`world='amass'`).
- SMPL npz (`smpl_arrays`, rig `smpl22` only): `poses [T, 66]` (root orientation first),
  `root_orient [T, 3]`, `pose_body [T, 63]`, `trans [T, 3]` = root position - rest root position
  (metres), `mocap_framerate`, `world`, `joint_names`, `offsets [22, 3]` (metres).
Axis-angle conversions are `rotations`', in float64 over fixed-size chunks (`retarget.chunked`).
"""

from __future__ import annotations

import jax
import numpy as np

from ik_gat_jax import rotations
from ik_gat_jax.errors import InputError
from ik_gat_jax.io import retarget
from ik_gat_jax.skeleton import SMPL22_JOINTS, Rig

BODY_JOINTS = len(SMPL22_JOINTS)  # 22
# The AMASS world (z up) -> the smpl22 rig's (y up): -90 degrees about x.
AMASS_TO_RIG = retarget.world_rotation('+z', '-y', (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))
SMPL_WORLDS = ('rig', 'amass')

_matrix_from_axis_angle = jax.jit(rotations.matrix_from_axis_angle)
_axis_angle_from_matrix = jax.jit(rotations.axis_angle_from_matrix)


def check_smpl_rig(rig: Rig) -> None:
  """SMPL pose parameters exist only for the SMPL body topology: refuse any other rig."""
  if tuple(rig.joint_names) != SMPL22_JOINTS:
    raise InputError(f'SMPL pose parameters need the smpl22 rig (22 SMPL body joints); this '
                     f'checkpoint is for {rig.name!r} ({rig.num_joints} joints): write .bvh or '
                     '.npz instead')


def smpl_world_rotation(world: str) -> np.ndarray:
  """`[3, 3]` from the world SMPL parameters are written in (`SMPL_WORLDS`) to the rig's."""
  if world not in SMPL_WORLDS:
    raise InputError(f'SMPL world must be one of {", ".join(SMPL_WORLDS)}, got {world!r}')
  return AMASS_TO_RIG if world == 'amass' else np.eye(3)


def local_from_smpl_pose(rotvecs: np.ndarray, W: np.ndarray = AMASS_TO_RIG) -> np.ndarray:
  """SMPL axis-angle `[T, K, 3]` (root orientation in the world `W` maps from) -> smpl22-style
  local rotations `[T, K, 3, 3]` float64, the root's in the rig world (`W @ R_root`)."""
  local = retarget.chunked(_matrix_from_axis_angle, [rotvecs])[0]
  local[:, 0] = W @ local[:, 0]
  return local


def smpl_pose_from_local(local_rot: np.ndarray, W: np.ndarray = AMASS_TO_RIG) -> np.ndarray:
  """Rig local rotations -> SMPL-style axis-angle (undoes `local_from_smpl_pose`).

  Args:
    local_rot: `[..., 22, 3, 3]` smpl22 parent-relative rotations (root: rig world).
    W: `[3, 3]` the world of the parameters -> rig world (default: AMASS's).
  Returns:
    `[..., 66]` float64: root_orient (in W's source world) then the 21 body joints, radians.
  """
  R = np.array(local_rot, np.float64)
  R[..., 0, :, :] = W.T @ R[..., 0, :, :]
  flat = R.reshape(-1, BODY_JOINTS, 3, 3)
  return retarget.chunked(_axis_angle_from_matrix, [flat])[0].reshape(R.shape[:-3] + (66,))


def smpl_trans_from_root(root_pos: np.ndarray, rest_root: np.ndarray,
                         W: np.ndarray = AMASS_TO_RIG) -> np.ndarray:
  """`[..., 3]` rig-world root positions -> SMPL `trans [..., 3]` = `W^T p - J_0`.

  `rest_root`: `[3]` the subject's rest root joint `J_0` (its offsets row 0 in the shards).
  """
  return np.asarray(root_pos, np.float64) @ W - np.asarray(rest_root, np.float64)


def amass_params_from_rig(poses: np.ndarray, trans: np.ndarray, rest_root: np.ndarray,
                          W: np.ndarray = AMASS_TO_RIG) -> tuple[np.ndarray, np.ndarray]:
  """SMPL parameters written in the rig's world (a `world='rig'` SMPL npz) -> AMASS's world.

  Args:
    poses: `[T, 66]` axis-angle, root orientation in the rig world. trans: `[T, 3]` rig world.
    rest_root: `[3]` the subject's rest root joint `J_0` (model frame).
    W: `[3, 3]` the AMASS -> rig world rotation that was applied.
  Returns:
    `(poses [T, 66], trans [T, 3])` float64 as in an AMASS file (only the root changes).
  """
  poses = np.array(poses, np.float64)
  R_root = retarget.chunked(_matrix_from_axis_angle, [poses[:, :3]])[0]
  poses[:, :3] = retarget.chunked(_axis_angle_from_matrix, [W.T @ R_root])[0]
  rest_root = np.asarray(rest_root, np.float64)
  return poses, (np.asarray(trans, np.float64) + rest_root) @ W - rest_root


def smpl_pose_params(local_rot: np.ndarray, rig: Rig, world: str = 'rig') -> np.ndarray:
  """`[T, 22, 3, 3]` local rotations of the smpl22 rig -> axis-angle `[T, 66]` (radians), SMPL
  joint order (root orientation first, in `world`), float64."""
  check_smpl_rig(rig)
  return smpl_pose_from_local(local_rot, smpl_world_rotation(world))


def smpl_arrays(sol, rig: Rig, fps: float, world: str = 'rig') -> dict:
  """The SMPL npz fields (module docstring) of a `solver.Solution`, in `world` ('rig' or
  'amass')."""
  W = smpl_world_rotation(world)
  poses = smpl_pose_params(sol.local_rot, rig, world).astype(np.float32)
  trans = smpl_trans_from_root(sol.positions_fk[:, 0], sol.offsets[0], W).astype(np.float32)
  return {'poses': poses, 'root_orient': poses[:, :3], 'pose_body': poses[:, 3:],
          'trans': trans, 'mocap_framerate': np.float32(fps), 'world': np.asarray(world),
          'joint_names': np.asarray(rig.joint_names),
          'offsets': np.asarray(sol.offsets, np.float32)}
