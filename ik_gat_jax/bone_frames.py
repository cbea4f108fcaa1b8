"""Rest bone frames and the bone-aligned world representation (DESIGN section 4).

For joint j with designated child c: `d_j = normalize(rest_pos[c] - rest_pos[j])` (a leaf takes
its parent's), `r_j` the rig's reference axis (up or forward, chosen once per rig), and the rest
bone frame `B_j = [x y z]` with `x = d_j`, `y = normalize(r_j - (r_j . x) x)`, `z = x cross y`.
The bone-aligned world rotation is `Q_j = G_j @ B_j`; exactly back: `G_j = Q_j @ B_j.T`, then
`R_j = G_parent.T @ G_j`. `Q_j @ e_x = G_j @ d_j` is the posed bone direction (observable).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ik_gat_jax import kinematics
from ik_gat_jax import rotations
from ik_gat_jax import skeleton
from ik_gat_jax.skeleton import Rig


def rest_bone_directions(offsets: jax.Array, rig: Rig) -> jax.Array:
  """`offsets: [..., J, 3]` (subject rest offsets) -> unit rest bone directions `[..., J, 3]`.

  The jnp twin of `skeleton.rest_bone_directions_np` (traceable, any float dtype; a zero
  offset gives a zero direction): the normalised rest offset of each joint's
  `skeleton.rest_direction_joints`, +x where there is none.
  """
  source = skeleton.rest_direction_joints(rig.parents, rig.designated_children)
  d = rotations.normalize(offsets[..., np.array([max(s, 0) for s in source]), :])
  none = np.array([s < 0 for s in source])[:, None]  # static
  return jnp.where(none, jnp.array([1.0, 0.0, 0.0], d.dtype), d) if none.any() else d


def bone_frames(offsets: jax.Array, rig: Rig) -> jax.Array:
  """`offsets: [..., J, 3]` -> rest bone frames `B: [..., J, 3, 3]` (columns x, y, z)."""
  x = rest_bone_directions(jnp.asarray(offsets), rig)
  r = jnp.asarray(rig.reference_vectors(), x.dtype)
  y = rotations.normalize(r - jnp.sum(r * x, axis=-1, keepdims=True) * x)
  z = jnp.cross(x, y)
  return jnp.stack([x, y, z], axis=-1)


def bone_frames_np(offsets: np.ndarray, rig: Rig) -> np.ndarray:
  """Host float64 version of `bone_frames` (stored with the data)."""
  with jax.enable_x64(True):
    return np.asarray(bone_frames(jnp.asarray(offsets, jnp.float64), rig))


def q_from_global(global_rot: jax.Array, B: jax.Array) -> jax.Array:
  """`Q = G @ B`, `[..., J, 3, 3]` each."""
  return global_rot @ B


def global_from_q(Q: jax.Array, B: jax.Array) -> jax.Array:
  """`G = Q @ B.T`, exactly inverse to `q_from_global`."""
  return Q @ jnp.swapaxes(B, -1, -2)


def local_from_q(Q: jax.Array, B: jax.Array, rig: Rig) -> jax.Array:
  """Bone-aligned world rotations `[..., J, 3, 3]` -> parent-relative local rotations."""
  return kinematics.global_to_local(global_from_q(Q, B), rig.parents)


def q_from_local(local_rot: jax.Array, B: jax.Array, rig: Rig) -> jax.Array:
  """Local rotations `[..., J, 3, 3]` -> bone-aligned world rotations."""
  return q_from_global(kinematics.local_to_global(local_rot, rig.parents), B)
