"""Rest bone frames and the bone-aligned world representation (DESIGN section 4).

For joint j with designated child c: `d_j = normalize(rest_pos[c] - rest_pos[j])` (a leaf takes
its parent's), `r_j` the rig's reference axis (up or forward, chosen once per rig), and the rest
bone frame `B_j = [x y z]` with `x = d_j`, `y = normalize(r_j - (r_j . x) x)`, `z = x cross y`.
The bone-aligned world rotation is `Q_j = G_j @ B_j`; exactly back: `G_j = Q_j @ B_j.T`, then
`R_j = G_parent.T @ G_j`. `Q_j @ e_x = G_j @ d_j` is the posed bone direction (observable).

Rig invariance (DESIGN section 3). `d_j` and `r_j` must be directions in joint j's own frame.
`d_j` from the designated child's offset already is one. The world reference axis `r_j` and a
leaf's inherited direction are world directions *in the rig's reference pose*
(`Rig.reference_pose`, world frames `F_j`; the zero pose when the rig names none, so `F = I`
and nothing changes): `r_j` enters as `F_j^T r_j`, a leaf's direction as
`F_leaf^T F_parent o_c / |o_c|`. Re-rigging by fixed per-joint `A_j` (`F_j -> F_j A_j`,
`o_c -> A_j^T o_c`) then gives exactly `B'_j = A_j^T B_j`, so `Q'_j = G_j A_j A_j^T B_j = Q_j`:
the bone-aligned targets and the twist/swing errors are the same on any bind. (With the zero
pose of a re-rigged rig instead, non-leaf frames would differ by a twist about x, which the
twist/swing errors do not see, but leaves would take their parent's direction in a crumpled
pose: their x axis, and so their twist/swing split, would change.)
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
  if rig.has_reference_pose:  # directions from another joint's frame, carried into j's own
    carry = skeleton.inherited_direction_rotations(rig.parents, rig.designated_children,
                                                   rig.reference_rotations())
    if carry:
      K = np.broadcast_to(np.eye(3), (rig.num_joints, 3, 3)).copy()
      for j, k in carry.items():
        K[j] = k
      d = jnp.einsum('jab,...jb->...ja', jnp.asarray(K, d.dtype), d)
  none = np.array([s < 0 for s in source])[:, None]  # static
  return jnp.where(none, jnp.array([1.0, 0.0, 0.0], d.dtype), d) if none.any() else d


def reference_vectors_local(rig: Rig) -> np.ndarray:
  """`[J, 3]` each joint's world reference axis in its own frame at the reference pose,
  `F_j^T r_j` (just `r_j` for a rig whose reference pose is its zero pose)."""
  r = rig.reference_vectors()
  if not rig.has_reference_pose:
    return r
  return np.einsum('jba,jb->ja', rig.reference_rotations(), r)


def bone_frames(offsets: jax.Array, rig: Rig) -> jax.Array:
  """`offsets: [..., J, 3]` -> rest bone frames `B: [..., J, 3, 3]` (columns x, y, z)."""
  x = rest_bone_directions(jnp.asarray(offsets), rig)
  r = jnp.asarray(reference_vectors_local(rig), x.dtype)
  y = rotations.normalize(r - jnp.sum(r * x, axis=-1, keepdims=True) * x)
  z = jnp.cross(x, y)
  return jnp.stack([x, y, z], axis=-1)


def bone_frames_np(offsets: np.ndarray, rig: Rig) -> np.ndarray:
  """Host float64 version of `bone_frames` (stored with the data). Jitted: one compiled call
  (from the persistent cache on a second run) instead of a dozen eager ops, each its own
  small executable (~0.2 s of a CLI start)."""
  with jax.enable_x64(True):
    return np.asarray(_bone_frames_jit(jnp.asarray(offsets, jnp.float64), rig))


_bone_frames_jit = jax.jit(bone_frames, static_argnums=1)


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


def bone_chart(R: jax.Array, B: jax.Array, parents: tuple[int, ...],
               joints: tuple[int, ...] | range | None = None, inverse: bool = False) -> jax.Array:
  """Local rotations `R: [..., J, 3, 3]` <-> their bone-frame chart `L_j = B_p^T R_j B_j`
  (root: `L = R B_root`), for `joints` (default all; the others are returned unchanged).

  `B: [..., J, 3, 3]` the subject's rest bone frames (`bone_frames`), broadcast against `R`;
  `parents` the rig's (static). Re-rigging by binds A gives `R' = A_p^T R A_j` and
  `B' = A^T B`, so `L' = L`: the chart means the same pose on every rig, and so does its
  identity, `L = I` (joint j's bone frame aligned with its parent's). `inverse`: L -> R,
  `R = B_p L B_j^T`. The one implementation: the IK-GAT's outputs (`model.to_local`), the pose
  prior and the iterative solvers all use it.
  """
  shape = jnp.broadcast_shapes(R.shape, B.shape)
  R, B = jnp.broadcast_to(R, shape), jnp.broadcast_to(B, shape)
  # All the chosen joints at once (static indices: a few kernels instead of two 3x3 products
  # per joint; the same products per joint, so the same numbers as one joint at a time).
  idx = np.arange(R.shape[-3]) if joints is None else np.unique(np.asarray(joints, int))
  if idx.size == 0:
    return R
  par = np.asarray([parents[j] for j in idx])
  left = jnp.where((par >= 0)[:, None, None], B[..., np.maximum(par, 0), :, :],
                   jnp.eye(3, dtype=R.dtype))
  Rj, Bj = R[..., idx, :, :], B[..., idx, :, :]
  if inverse:  # R = B_p L B_j^T
    L = left @ Rj @ jnp.swapaxes(Bj, -1, -2)
  else:
    L = jnp.swapaxes(left, -1, -2) @ Rj @ Bj
  # In R's dtype (a bfloat16 network's output with float32 bone frames: L is float32), the
  # cast the scatter made implicitly, which newer JAX refuses.
  return L if joints is None else R.at[..., idx, :, :].set(L.astype(R.dtype))
