"""Every error of DESIGN section 7, in one place, with the JSON field names of section 9.

`frame_errors` is the jittable core: per frame and joint errors from predicted and true local
rotations. `summarize` reduces them to the JSON fields; `summarize_by` makes the per-subject and
per-file tables. Training validation, `experiments.evaluate`, the baselines and the benchmark all
call these two.

Definitions (per frame, per joint):
- local: geodesic angle between predicted and true R_j (parent-relative);
- global: the same for G_j (world); the root's is the `root_rot_err_deg` field;
- twist / swing: of `E = Q_hat.T @ Q` (bone-aligned world rotations, `rotations.swing_twist_angles`
  about the bone axis x);
- position: FK of the predicted local rotations on the subject's rest offsets, root placed at the
  true root position, against the clean true positions. MPJPE averages non-root joints that are
  not co-located with their parent (a co-located pair is one point, counted once).
Means over joints exclude the root except for `root_rot_err_deg`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ik_gat_jax import bone_frames
from ik_gat_jax import kinematics
from ik_gat_jax import padding
from ik_gat_jax import rotations
from ik_gat_jax.skeleton import Rig

ERROR_FIELDS = ('local_rot_err_deg', 'global_rot_err_deg', 'twist_err_deg', 'swing_err_deg',
                'mpjpe_mm')
OBSERVABILITY_CLASSES = ('determined', 'swing', 'leaf')


def frame_errors(pred_local: jax.Array, true_local: jax.Array, offsets: jax.Array,
                 B: jax.Array, true_positions: jax.Array, rig: Rig) -> dict[str, jax.Array]:
  """Per frame, per joint errors.

  Args:
    pred_local, true_local: `[N, J, 3, 3]` parent-relative rotations.
    offsets: `[N, J, 3]` (or `[J, 3]`) the subject's rest offsets, metres.
    B: `[N, J, 3, 3]` (or `[J, 3, 3]`) the subject's rest bone frames.
    true_positions: `[N, J, 3]` clean world joint positions, metres.
    rig: static rig (parents).

  Returns:
    dict of `[N, J]` arrays: 'local', 'global', 'twist', 'swing' (radians), 'position' (metres).
  """
  G_hat = kinematics.local_to_global(pred_local, rig.parents)
  G = kinematics.local_to_global(true_local, rig.parents)
  E = jnp.swapaxes(bone_frames.q_from_global(G_hat, B), -1, -2) @ bone_frames.q_from_global(G, B)
  twist, swing = rotations.swing_twist_angles(E)
  _, pos_hat = kinematics.forward_kinematics(pred_local, offsets, rig.parents,
                                             root_pos=true_positions[..., 0, :])
  return {
      'local': rotations.geodesic_angle(pred_local, true_local),
      'global': rotations.geodesic_angle(G_hat, G),
      'twist': twist,
      'swing': swing,
      'position': jnp.linalg.norm(pos_hat - true_positions, axis=-1),
  }


frame_errors_jit = jax.jit(frame_errors, static_argnames='rig')


def _joint_masks(rig: Rig) -> dict[str, np.ndarray]:
  J = rig.num_joints
  nonroot = np.arange(J) > 0
  coloc = np.asarray(rig.colocated())
  obs = np.asarray(rig.observability())
  masks = {'nonroot': nonroot, 'mpjpe': nonroot & ~coloc}
  for c in OBSERVABILITY_CLASSES:
    masks[c] = nonroot & (obs == c)
  return masks


def _deg(x) -> float:
  return float(np.degrees(x))


def position_error_mm(a: np.ndarray, b: np.ndarray, rig: Rig) -> float:
  """Mean distance in mm between two `[T, J, 3]` position sets (metres) over MPJPE's joints
  (not the root, not those co-located with their parent)."""
  m = _joint_masks(rig)['mpjpe']
  return float(1000.0 * np.linalg.norm(np.asarray(a, np.float64)[:, m]
                                       - np.asarray(b, np.float64)[:, m], axis=-1).mean())


def summarize(errors: Mapping[str, np.ndarray], rig: Rig) -> dict:
  """`[N, J]` error arrays -> the JSON fields of DESIGN section 9 (degrees, millimetres).

  Returns `local_rot_err_deg`, `root_rot_err_deg`, `global_rot_err_deg`, `twist_err_deg`,
  `swing_err_deg`, `mpjpe_mm`, `local_rot_err_deg_by_class` (determined / swing / leaf),
  `frames`, and `per_joint` (joint name -> the error fields).
  """
  e = {k: np.asarray(v, np.float64) for k, v in errors.items()}
  m = _joint_masks(rig)
  n = int(e['local'].shape[0])
  if n == 0:
    raise ValueError('summarize needs at least one frame')
  out = {
      'frames': n,
      'local_rot_err_deg': _deg(e['local'][:, m['nonroot']].mean()),
      'root_rot_err_deg': _deg(e['global'][:, 0].mean()),
      'global_rot_err_deg': _deg(e['global'][:, m['nonroot']].mean()),
      'twist_err_deg': _deg(e['twist'][:, m['nonroot']].mean()),
      'swing_err_deg': _deg(e['swing'][:, m['nonroot']].mean()),
      'mpjpe_mm': float(1000.0 * e['position'][:, m['mpjpe']].mean()),
      'local_rot_err_deg_by_class': {
          c: _deg(e['local'][:, m[c]].mean()) for c in OBSERVABILITY_CLASSES if m[c].any()},
  }
  out['per_joint'] = {
      name: {'local_rot_err_deg': _deg(e['local'][:, j].mean()),
             'global_rot_err_deg': _deg(e['global'][:, j].mean()),
             'twist_err_deg': _deg(e['twist'][:, j].mean()),
             'swing_err_deg': _deg(e['swing'][:, j].mean()),
             'mpjpe_mm': float(1000.0 * e['position'][:, j].mean())}
      for j, name in enumerate(rig.joint_names)}
  return out


def summarize_by(errors: Mapping[str, np.ndarray], group_ids: np.ndarray,
                 group_names: Sequence[str], rig: Rig) -> dict[str, dict]:
  """Per-group summaries (per subject, per file): group name -> `summarize` without per_joint."""
  group_ids = np.asarray(group_ids)
  out = {}
  for g in np.unique(group_ids):
    sel = group_ids == g
    s = summarize({k: np.asarray(v)[sel] for k, v in errors.items()}, rig)
    s.pop('per_joint')
    out[str(group_names[int(g)])] = s
  return out


def compute_errors_batched(pred_local: np.ndarray, true_local: np.ndarray, offsets: np.ndarray,
                           B: np.ndarray, true_positions: np.ndarray, rig: Rig,
                           batch_size: int = 4096) -> dict[str, np.ndarray]:
  """`frame_errors` over many frames in fixed-size chunks (one compile; last chunk padded)."""
  N = pred_local.shape[0]
  chunks = {k: [] for k in ('local', 'global', 'twist', 'swing', 'position')}
  arrays = [pred_local, true_local, offsets, B, true_positions]
  for start in range(0, N, batch_size):
    stop = min(start + batch_size, N)
    pad = batch_size - (stop - start) if N > batch_size else 0
    part = [np.concatenate([a[start:stop], np.repeat(a[stop - 1:stop], pad, 0)]) if pad
            else a[start:stop] for a in arrays]
    res = frame_errors_jit(*[jnp.asarray(p, jnp.float32) for p in part], rig=rig)
    for k, v in res.items():
      chunks[k].append(np.asarray(v)[:stop - start])
  return {k: np.concatenate(v) for k, v in chunks.items()}


# ----------------------------------------------------------------------------------------------
# Temporal stability (issue G3): jitter = mean angular acceleration of the local rotations.


def angular_acceleration(local_rot: jax.Array, fps: float | jax.Array) -> jax.Array:
  """Magnitude of the angular acceleration of each joint's local rotation, rad/s^2.

  Angular velocity `w_t = log(R_t.T @ R_{t+1}) * fps` (rotation vector, body frame of R_t),
  acceleration `|w_{t+1} - w_t| * fps`.

  Args:
    local_rot: `[T, J, 3, 3]` parent-relative rotations of consecutive frames of one clip.
    fps: frame rate (frames per second).

  Returns:
    `[T - 2, J]`; entry t uses frames t, t + 1, t + 2.
  """
  w = rotations.relative_axis_angle(local_rot[:-1], local_rot[1:]) * fps
  return rotations.safe_norm(w[1:] - w[:-1]) * fps


angular_acceleration_jit = jax.jit(angular_acceleration)


def clip_triples(file_ids: np.ndarray, frame_index: np.ndarray | None = None) -> np.ndarray:
  """`[T - 2]` bool: frames t, t + 1, t + 2 lie in one clip (same file and, given
  `frame_index`, consecutive frame numbers), so an acceleration there is real motion."""
  f = np.asarray(file_ids)
  ok = (f[:-2] == f[1:-1]) & (f[1:-1] == f[2:])
  if frame_index is not None:
    k = np.asarray(frame_index)
    ok &= (k[1:-1] == k[:-2] + 1) & (k[2:] == k[1:-1] + 1)
  return ok


def joint_jitter(local_rot: np.ndarray, file_ids: np.ndarray, fps: float,
                 frame_index: np.ndarray | None = None) -> tuple[np.ndarray, int]:
  """Mean angular acceleration per joint (deg/s^2) over the clips of a frame sequence.

  Frames are in clip order (a clip's frames contiguous, in time order); accelerations that
  would straddle two files (or a gap in `frame_index`) are dropped, never computed across.

  Args:
    local_rot: `[T, J, 3, 3]` local rotations.
    file_ids: `[T]` clip (file) of each frame.
    fps: frame rate.
    frame_index: optional `[T]` frame number within its file.

  Returns:
    (`[J]` mean over valid accelerations in deg/s^2 (NaN without any), how many there were).
  """
  R = np.asarray(local_rot, np.float32)
  T = R.shape[0]
  if T < 3:
    return np.full(R.shape[1], np.nan), 0
  ok = clip_triples(file_ids, frame_index)
  # Pad to a power of two: few compiled shapes. Padded frames repeat the last one (ok=False).
  R = padding.pad_rows(R, padding.power_of_two(T))
  acc = np.asarray(angular_acceleration_jit(jnp.asarray(R), float(fps)), np.float64)[:T - 2]
  n = int(ok.sum())
  if n == 0:
    return np.full(R.shape[1], np.nan), 0
  return np.degrees(acc[ok].mean(axis=0)), n


def jitter_summary(pred_local: np.ndarray, true_local: np.ndarray, file_ids: np.ndarray,
                   fps: float, rig: Rig, frame_index: np.ndarray | None = None) -> dict:
  """The method's jitter against the ground truth's, as JSON fields (all joints, root included:
  the root's local rotation is the body's heading, whose shake shows as much as a limb's).

  Returns `jitter_deg_s2` (mean over joints and accelerations), `gt_jitter_deg_s2`,
  `jitter_ratio` (method / ground truth), `jitter_samples` (accelerations per joint) and
  `per_joint_jitter` (joint -> {jitter_deg_s2, gt_jitter_deg_s2}); {} with no three
  consecutive frames of one clip.
  """
  pred, n = joint_jitter(pred_local, file_ids, fps, frame_index)
  if n == 0:
    return {}
  true, _ = joint_jitter(true_local, file_ids, fps, frame_index)
  out = {'jitter_deg_s2': float(pred.mean()), 'gt_jitter_deg_s2': float(true.mean()),
         'jitter_samples': n}
  out['jitter_ratio'] = out['jitter_deg_s2'] / max(out['gt_jitter_deg_s2'], 1e-12)
  out['per_joint_jitter'] = {
      name: {'jitter_deg_s2': float(pred[j]), 'gt_jitter_deg_s2': float(true[j])}
      for j, name in enumerate(rig.joint_names)}
  return out
