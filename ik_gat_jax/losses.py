"""Per-example losses (the caller reduces; no batch-size-dependent weighting).

IK-GAT (DESIGN section 5): mean geodesic angle (radians) between predicted and true rotations in
the model's output space, plus `alpha * mean_j |p_hat_j - p_j|` with positions in decimetres
(alpha = 0.1 weighs 1 cm like 0.01 rad). `p_hat` is FK of the predicted local rotations on the
example's rest offsets with the root at the true root, against the clean positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ik_gat_jax import kinematics
from ik_gat_jax import model as model_lib
from ik_gat_jax import rotations
from ik_gat_jax.skeleton import Rig


def ikgat_loss(pred: jax.Array, batch: dict, rig: Rig, space: str, alpha: float,
               bone_chart: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-example IK-GAT loss.

  Args:
    pred: `[B, J, 3, 3]` model output in `space`.
    batch: 'local_rot' [B, J, 3, 3], 'bone_frames' [B, J, 3, 3], 'offsets' [B, J, 3],
      'positions' [B, J, 3] clean world positions (m).
    alpha: weight of the position term (decimetres).
    bone_chart: `pred`'s local outputs are in the bone-frame chart (`model.to_local`); the
      angle is the same in either chart, only the parametrisation differs.

  Returns:
    `(loss [B], {'rot_rad': [B], 'pos_dm': [B]})`.
  """
  target = model_lib.from_local(batch['local_rot'], batch['bone_frames'], rig, space,
                                bone_chart)
  rot = jnp.mean(rotations.geodesic_angle(pred, target), axis=-1)
  if alpha == 0:
    return rot, {'rot_rad': rot, 'pos_dm': jnp.zeros_like(rot)}
  local = model_lib.to_local(pred, batch['bone_frames'], rig, space, bone_chart)
  _, pos = kinematics.forward_kinematics(local, batch['offsets'], rig.parents,
                                         root_pos=batch['positions'][:, 0])
  pos_dm = 10.0 * jnp.mean(rotations.safe_norm(pos - batch['positions']), axis=-1)
  return rot + alpha * pos_dm, {'rot_rad': rot, 'pos_dm': pos_dm}


def velocity_loss(local: jax.Array, target: jax.Array) -> jax.Array:
  """Per-pair loss of consecutive frames (issue K, `loss.velocity_weight`): `local` and `target`
  `[2B, J, 3, 3]` local rotations, rows b and B + b one frame apart (the earlier first); the
  mean over joints of the angle (radians) between the predicted frame-to-frame change
  `R_prev^T R_cur` and the true one. Zero for any output that moves as the truth does, whatever
  its offset: it penalises jitter, not error. Returns `[B]`."""
  B = local.shape[0] // 2
  step = lambda r: jnp.swapaxes(r[:B], -1, -2) @ r[B:]
  return jnp.mean(rotations.geodesic_angle(step(local), step(target)), axis=-1)
