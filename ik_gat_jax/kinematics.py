"""Forward kinematics over a static tree; global <-> local rotations.

Frames (DESIGN section 2): `R_local[j]` is joint j's rotation relative to its parent,
`G[j] = G[parent] @ R_local[j]` its world rotation, `p[j] = p[parent] + G[parent] @ offsets[j]`.
`parents` is a static Python tuple (topologically ordered, root first, root parent -1), so the
per-joint loop unrolls under `jax.jit`. Measured on this 2-core CPU (`python -m
experiments.bench_fk`, BENCHMARKS.md): the unrolled loop beats per-depth gathers once gradients
flow, so it is the one FK.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def forward_kinematics(local_rot: jax.Array, offsets: jax.Array, parents: Sequence[int],
                       root_pos: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Local rotations -> world rotations and joint positions.

  Args:
    local_rot: `[..., J, 3, 3]` parent-relative rotations (the root's is its world rotation).
    offsets: `[..., J, 3]` rest offsets, each in its parent's frame; broadcast against
      `local_rot`'s batch axes (a subject's `[J, 3]` works for a whole clip).
    parents: static `[J]` parent indices, -1 for the root.
    root_pos: `[..., 3]` world root position; None puts the root at `offsets[..., 0, :]`.

  Returns:
    `(G_world_joint [..., J, 3, 3], p_world_joint [..., J, 3])`.
  """
  batch = jnp.broadcast_shapes(local_rot.shape[:-3], offsets.shape[:-2])
  offsets = jnp.broadcast_to(offsets, batch + offsets.shape[-2:])
  local_rot = jnp.broadcast_to(local_rot, batch + local_rot.shape[-3:])
  root = offsets[..., 0, :] if root_pos is None else jnp.broadcast_to(root_pos, batch + (3,))
  G, p = [local_rot[..., 0, :, :]], [root]
  for j in range(1, len(parents)):
    Gp = G[parents[j]]
    p.append(p[parents[j]] + jnp.einsum('...ab,...b->...a', Gp, offsets[..., j, :]))
    G.append(Gp @ local_rot[..., j, :, :])
  return jnp.stack(G, axis=-3), jnp.stack(p, axis=-2)


def local_to_global(local_rot: jax.Array, parents: Sequence[int]) -> jax.Array:
  """`[..., J, 3, 3]` local -> world rotations (FK without positions)."""
  G = [local_rot[..., 0, :, :]]
  for j in range(1, len(parents)):
    G.append(G[parents[j]] @ local_rot[..., j, :, :])
  return jnp.stack(G, axis=-3)


def global_to_local(global_rot: jax.Array, parents: Sequence[int]) -> jax.Array:
  """`[..., J, 3, 3]` world -> parent-relative rotations: `R_j = G_parent.T @ G_j`."""
  idx = np.asarray([max(p, 0) for p in parents])
  G_parent = jnp.take(global_rot, idx, axis=-3)
  R = jnp.swapaxes(G_parent, -1, -2) @ global_rot
  return R.at[..., 0, :, :].set(global_rot[..., 0, :, :])
