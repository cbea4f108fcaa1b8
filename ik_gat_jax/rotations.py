"""Rotations: 6D, quaternion (w, x, y, z), axis-angle, Euler, geodesic angle, swing-twist.

Conventions (DESIGN section 2): rotation matrices act on column vectors; every function is
batched over any leading axes (`[..., 3, 3]`), pure, and jit-, vmap- and grad-safe. Singular
points (zero-length axes, angles near 0 or pi) go through the NaN-safe "double where" so
gradients stay finite. Quaternions are scalar-first (w, x, y, z); `jax.scipy`'s `Rotation` is
scalar-last, so the conversion happens only inside `euler_from_matrix`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.spatial.transform import Rotation as _JaxRotation

_EPS = 1e-12


def safe_norm(v: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
  """Euclidean norm with a finite gradient at zero (double `where`)."""
  sq = jnp.sum(v * v, axis=axis, keepdims=keepdims)
  is_zero = sq < _EPS * _EPS
  safe_sq = jnp.where(is_zero, 1.0, sq)
  return jnp.where(is_zero, 0.0, jnp.sqrt(safe_sq))


def normalize(v: jax.Array, axis: int = -1) -> jax.Array:
  """Unit vectors along `axis`; a zero vector stays zero (no NaN)."""
  n = safe_norm(v, axis=axis, keepdims=True)
  return v / jnp.where(n > 0, n, 1.0)


# ----------------------------------------------------------------------------------------------
# 6D (Zhou et al. 2019): the first two columns of R.


def sixd_from_matrix(R: jax.Array) -> jax.Array:
  """`R: [..., 3, 3]` -> `[..., 6]` = (column 0, column 1)."""
  return jnp.concatenate([R[..., :, 0], R[..., :, 1]], axis=-1)


def matrix_from_sixd(x: jax.Array) -> jax.Array:
  """`x: [..., 6]` (two 3-vectors, columns 0 and 1) -> rotation `[..., 3, 3]` by Gram-Schmidt."""
  a1, a2 = x[..., 0:3], x[..., 3:6]
  b1 = normalize(a1)
  b2 = normalize(a2 - jnp.sum(b1 * a2, axis=-1, keepdims=True) * b1)
  b3 = jnp.cross(b1, b2)
  return jnp.stack([b1, b2, b3], axis=-1)


# ----------------------------------------------------------------------------------------------
# Quaternions, (w, x, y, z).


def matrix_from_quat(q: jax.Array) -> jax.Array:
  """`q: [..., 4]` (w, x, y, z), normalised here -> `[..., 3, 3]`."""
  w, x, y, z = jnp.moveaxis(normalize(q), -1, 0)
  rows = [
      [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
      [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
      [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
  ]
  return jnp.stack([jnp.stack(r, axis=-1) for r in rows], axis=-2)


def quat_from_matrix(R: jax.Array) -> jax.Array:
  """`R: [..., 3, 3]` -> unit quaternion `[..., 4]` (w, x, y, z) with w >= 0.

  Shepperd's method: of the four candidate formulas, use the one with the largest divisor, so
  every branch that is selected is well conditioned.
  """
  m = R
  t = jnp.trace(m, axis1=-2, axis2=-1)
  d = jnp.diagonal(m, axis1=-2, axis2=-1)
  cands = jnp.stack([t, d[..., 0], d[..., 1], d[..., 2]], axis=-1)
  k = jnp.argmax(cands, axis=-1)
  r21, r12 = m[..., 2, 1], m[..., 1, 2]
  r02, r20 = m[..., 0, 2], m[..., 2, 0]
  r10, r01 = m[..., 1, 0], m[..., 0, 1]
  q0 = jnp.stack([1 + t, r21 - r12, r02 - r20, r10 - r01], -1)
  q1 = jnp.stack([r21 - r12, 1 + 2 * d[..., 0] - t, r01 + r10, r02 + r20], -1)
  q2 = jnp.stack([r02 - r20, r01 + r10, 1 + 2 * d[..., 1] - t, r12 + r21], -1)
  q3 = jnp.stack([r10 - r01, r02 + r20, r12 + r21, 1 + 2 * d[..., 2] - t], -1)
  q = jnp.choose(k[..., None], [q0, q1, q2, q3], mode='clip')
  q = normalize(q)
  return q * jnp.where(q[..., :1] < 0, -1.0, 1.0)


def quat_multiply(a: jax.Array, b: jax.Array) -> jax.Array:
  """Hamilton product `a * b`, both `[..., 4]` (w, x, y, z); rotation `a` after `b`."""
  aw, av = a[..., :1], a[..., 1:]
  bw, bv = b[..., :1], b[..., 1:]
  w = aw * bw - jnp.sum(av * bv, axis=-1, keepdims=True)
  v = aw * bv + bw * av + jnp.cross(av, bv)
  return jnp.concatenate([w, v], axis=-1)


def quat_slerp(q0: jax.Array, q1: jax.Array, t: jax.Array) -> jax.Array:
  """Spherical interpolation of unit quaternions `[..., 4]` at fraction `t` (broadcast `[...]`)."""
  dot = jnp.sum(q0 * q1, axis=-1, keepdims=True)
  q1 = jnp.where(dot < 0, -q1, q1)
  dot = jnp.abs(dot)
  t = jnp.asarray(t)[..., None]
  theta = jnp.arccos(jnp.clip(dot, -1.0, 1.0))
  small = theta < 1e-6
  sin_t = jnp.sin(jnp.where(small, 1.0, theta))
  w0 = jnp.where(small, 1 - t, jnp.sin((1 - t) * theta) / sin_t)
  w1 = jnp.where(small, t, jnp.sin(t * theta) / sin_t)
  return normalize(w0 * q0 + w1 * q1)


# ----------------------------------------------------------------------------------------------
# Axis-angle (rotation vectors) and elementary rotations.


def matrix_from_axis_angle(rotvec: jax.Array) -> jax.Array:
  """Rodrigues: `rotvec: [..., 3]` (axis * angle, radians) -> `[..., 3, 3]`; smooth at 0."""
  theta = safe_norm(rotvec, keepdims=True)
  small = theta < 1e-6
  safe_theta = jnp.where(small, 1.0, theta)
  half = 0.5 * theta
  # sin(theta/2)/theta, with its Taylor series near 0.
  s = jnp.where(small, 0.5 - theta**2 / 48.0, jnp.sin(0.5 * safe_theta) / safe_theta)
  q = jnp.concatenate([jnp.cos(half), s * rotvec], axis=-1)
  return matrix_from_quat(q)


def axis_angle_from_quat(q: jax.Array) -> jax.Array:
  """`q: [..., 4]` (w, x, y, z) -> rotation vector `[..., 3]`, angle in [0, pi]."""
  q = q * jnp.where(q[..., :1] < 0, -1.0, 1.0)
  vnorm = safe_norm(q[..., 1:], keepdims=True)
  angle = 2.0 * jnp.arctan2(vnorm, q[..., :1])
  small = vnorm < 1e-7
  scale = jnp.where(small, 2.0 / jnp.where(small, q[..., :1], 1.0),
                    angle / jnp.where(small, 1.0, vnorm))
  return scale * q[..., 1:]


def axis_angle_from_matrix(R: jax.Array) -> jax.Array:
  """`R: [..., 3, 3]` -> rotation vector `[..., 3]` (via the quaternion; stable near pi)."""
  return axis_angle_from_quat(quat_from_matrix(R))


def relative_axis_angle(R_a: jax.Array, R_b: jax.Array) -> jax.Array:
  """Rotation vector `[..., 3]` of `R_a.T @ R_b` (both `[..., 3, 3]`): the step from `R_a` to
  `R_b` in `R_a`'s own (body) frame, `R_b = R_a @ exp(v)`; angle in [0, pi]."""
  return axis_angle_from_matrix(jnp.swapaxes(R_a, -1, -2) @ R_b)


def matrix_slerp(R_0: jax.Array, R_1: jax.Array, t: jax.Array) -> jax.Array:
  """Geodesic interpolation `R_0 @ exp(t * log(R_0.T @ R_1))`, `[..., 3, 3]`, `t: [...]`.

  t = 0 gives R_0, t = 1 gives R_1 (up to rounding); the shorter arc (angle <= pi).
  """
  v = relative_axis_angle(R_0, R_1)
  return R_0 @ matrix_from_axis_angle(jnp.asarray(t)[..., None] * v)


def axis_rotation(axis: str, angle: jax.Array) -> jax.Array:
  """Rotation by `angle: [...]` radians about the principal axis 'x', 'y' or 'z' -> `[..., 3, 3]`."""
  c, s = jnp.cos(angle), jnp.sin(angle)
  o, z = jnp.ones_like(angle), jnp.zeros_like(angle)
  rows = {
      'x': [[o, z, z], [z, c, -s], [z, s, c]],
      'y': [[c, z, s], [z, o, z], [-s, z, c]],
      'z': [[c, -s, z], [s, c, z], [z, z, o]],
  }[axis.lower()]
  return jnp.stack([jnp.stack(r, axis=-1) for r in rows], axis=-2)


def matrix_from_euler(angles: jax.Array, order: str, degrees: bool = False) -> jax.Array:
  """Intrinsic Euler angles in BVH channel order -> `[..., 3, 3]`.

  `order` like 'ZYX' means R = Rz(a0) @ Ry(a1) @ Rx(a2) (scipy's upper-case, intrinsic
  convention). `angles: [..., len(order)]`; any length 1-3 and repeated axes ('ZXZ') work.
  """
  if not order or any(c not in 'XYZxyz' for c in order):
    raise ValueError(f'Euler order must be letters from XYZ, got {order!r}')
  angles = jnp.asarray(angles)
  if angles.shape[-1] != len(order):
    raise ValueError(f'angles last axis {angles.shape[-1]} != len(order {order!r})')
  if degrees:
    angles = jnp.deg2rad(angles)
  R = axis_rotation(order[0], angles[..., 0])
  for i, ax in enumerate(order[1:], start=1):
    R = R @ axis_rotation(ax, angles[..., i])
  return R


def euler_from_matrix(R: jax.Array, order: str, degrees: bool = False) -> jax.Array:
  """Inverse of `matrix_from_euler` for three-axis orders (uses `jax.scipy`'s Rotation)."""
  if len(order) != 3:
    raise ValueError(f'euler_from_matrix needs a 3-axis order, got {order!r}')
  batch = R.shape[:-2]
  rot = _JaxRotation.from_matrix(R.reshape(-1, 3, 3))
  eul = rot.as_euler(order.upper(), degrees=degrees)
  return eul.reshape(*batch, 3)


def minimal_rotation(a: jax.Array, b: jax.Array) -> jax.Array:
  """The smallest rotation taking direction `a` to direction `b` (`[..., 3]`, any length).

  Antiparallel inputs rotate by pi about an axis perpendicular to `a`.
  """
  a, b = normalize(a), normalize(b)
  axis = jnp.cross(a, b)
  cos = jnp.sum(a * b, axis=-1, keepdims=True)
  # Quaternion (1 + cos, a x b), normalised: half-angle formula without trig.
  q = jnp.concatenate([1.0 + cos, axis], axis=-1)
  # Near antiparallel: pick any axis perpendicular to a.
  helper = jnp.where(jnp.abs(a[..., :1]) < 0.9, jnp.array([1.0, 0.0, 0.0]),
                     jnp.array([0.0, 1.0, 0.0]))
  perp = normalize(jnp.cross(a, helper))
  anti = (1.0 + cos) < 1e-7
  q = jnp.where(anti, jnp.concatenate([jnp.zeros_like(cos), perp], axis=-1), q)
  return matrix_from_quat(q)


# ----------------------------------------------------------------------------------------------
# Distances and decompositions.


def geodesic_angle(R_hat: jax.Array, R: jax.Array) -> jax.Array:
  """Angle (radians) of `R_hat.T @ R`, `[..., 3, 3]` -> `[...]`; finite gradients at 0 and pi.

  theta = atan2(|vee(M - M.T)| / 2, (trace(M) - 1) / 2) with a NaN-safe norm.
  """
  M = jnp.swapaxes(R_hat, -1, -2) @ R
  vee = jnp.stack([M[..., 2, 1] - M[..., 1, 2], M[..., 0, 2] - M[..., 2, 0],
                   M[..., 1, 0] - M[..., 0, 1]], axis=-1)
  s = 0.5 * safe_norm(vee)
  c = 0.5 * (jnp.trace(M, axis1=-2, axis2=-1) - 1.0)
  return jnp.arctan2(s, c)


def swing_twist_angles(R: jax.Array, axis: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Twist about `axis` (default x) and swing angles (radians) of rotation `R: [..., 3, 3]`.

  With the quaternion q (w >= 0) of R and `axis` taken as x after a change of basis:
  twist = 2 atan2(|q_x|, q_w), swing = 2 atan2(sqrt(q_y^2 + q_z^2), sqrt(q_w^2 + q_x^2));
  the twist is 0 where the swing is within 1e-3 rad of pi (it is undefined there).
  """
  q = quat_from_matrix(R)
  w, v = q[..., 0], q[..., 1:]
  u = jnp.array([1.0, 0.0, 0.0]) if axis is None else normalize(jnp.asarray(axis))
  tw = jnp.sum(v * u, axis=-1)
  swing_sin = safe_norm(v - tw[..., None] * u)
  swing = 2.0 * jnp.arctan2(swing_sin, safe_norm(jnp.stack([w, tw], -1)))
  twist = 2.0 * jnp.arctan2(jnp.abs(tw), w)
  twist = jnp.where(swing > jnp.pi - 1e-3, 0.0, twist)
  return twist, swing
