"""Causal temporal filtering of joint rotations on SO(3) (issue G3: jitter at no latency cost).

Per-frame solvers (IK-GAT, cold-started iterative IK) jitter: each frame's answer is right on
average but shakes from frame to frame. `one_euro` is the One-Euro filter (Casiez et al., CHI
2012) moved onto the rotation manifold, per joint, on the local rotations (root included):

  v_t     = log(F_{t-1}.T @ R_t) * fps                 raw angular velocity (body frame, rad/s)
  V_t     = a(d_cutoff) v_t + (1 - a(d_cutoff)) V_{t-1} its low-passed estimate
  f_c     = min_cutoff + beta * |V_t|                  adaptive cutoff (Hz)
  F_t     = F_{t-1} @ exp(a(f_c) log(F_{t-1}.T @ R_t)) slerp toward the new frame
  a(f)    = r / (r + 1), r = 2 pi f / fps

Slow joints get the low `min_cutoff` (smooth), fast ones a higher cutoff (little lag). The first
frame of a clip (and of a stream after `reset`) passes through. It is causal by construction:
`F_t` depends on frames <= t only, through the state `FilterState` (previous filtered rotation,
previous filtered velocity, an initialized flag) that `lax.scan` carries. The same step runs a
whole clip in one jitted call (`filter_sequence`) and a live stream frame by frame (`filter_step`,
state kept by the caller), with the same results. FK of the filtered rotations is what a user
gets: callers recompute positions from them (the solver does; metrics' MPJPE does).

Units: cutoffs in Hz, `beta` in Hz per rad/s of filtered angular speed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ik_gat_jax import padding
from ik_gat_jax import rotations

KINDS = ('none', 'one_euro')


@dataclasses.dataclass(frozen=True)
class FilterConfig:
  """A temporal filter (static, hashable: a jit static argument).

  Attributes:
    kind: 'none' (pass through) or 'one_euro'.
    min_cutoff: cutoff frequency at rest, Hz (lower: smoother, more lag when slow).
    beta: cutoff increase per rad/s of filtered angular speed, Hz / (rad/s) (higher: less lag
      when fast).
    d_cutoff: cutoff of the angular-velocity estimate, Hz.

  The defaults are the parameters chosen on val for noisy trackers (docs/benchmarks/
  temporal.md), the ones the shipped checkpoints carry, so `FilterConfig(kind='one_euro')` is
  the filter `--filter=one_euro` gives (it was the One-Euro paper's generic 1 Hz and 0.05, which
  lag: worse than no filter at 10 mm of noise).
  """
  kind: str = 'none'
  min_cutoff: float = 1.5
  beta: float = 0.5
  d_cutoff: float = 1.0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f'temporal filter kind must be one of {", ".join(KINDS)}, got '
                       f'{self.kind!r}')
    for name in ('min_cutoff', 'd_cutoff'):
      v = getattr(self, name)
      if not (math.isfinite(v) and v > 0):
        raise ValueError(f'temporal filter {name} must be a positive frequency (Hz), got {v}')
    if not (math.isfinite(self.beta) and self.beta >= 0):
      raise ValueError(f'temporal filter beta must be >= 0, got {self.beta}')

  @property
  def active(self) -> bool:
    return self.kind != 'none'

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any] | None) -> 'FilterConfig':
    """From a config section (`filter` or `kind` names the kind); None or {}: no filter."""
    d = dict(d or {})
    kind = d.pop('filter', d.pop('kind', 'none'))
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(kind=kind, **{k: float(v) for k, v in d.items() if k in fields})

  def describe(self) -> str:
    if not self.active:
      return 'none'
    return (f'one_euro(min_cutoff={self.min_cutoff:g} Hz, beta={self.beta:g}, '
            f'd_cutoff={self.d_cutoff:g} Hz)')


def from_checkpoint_meta(meta: Mapping[str, Any] | None) -> FilterConfig:
  """The filter a checkpoint was trained to be used with (its config's `temporal` section);
  no filter for checkpoints without one (the shipped ones)."""
  return FilterConfig.from_dict(((meta or {}).get('config') or {}).get('temporal'))


def with_overrides(base: FilterConfig, kind: str | None = None,
                   min_cutoff: float | None = None, beta: float | None = None,
                   d_cutoff: float | None = None) -> FilterConfig:
  """`base` with every given (non-None) field replaced: flags over a checkpoint's default."""
  new = {k: v for k, v in dict(kind=kind, min_cutoff=min_cutoff, beta=beta,
                               d_cutoff=d_cutoff).items() if v is not None}
  return dataclasses.replace(base, **new)


class FilterState(NamedTuple):
  """What the filter carries from frame to frame (one stream / clip).

  Attributes:
    rot: `[J, 3, 3]` previous filtered local rotations.
    vel: `[J, 3]` previous filtered angular velocity (rad/s, body frame of `rot`).
    initialized: `[]` bool; False before the first frame (which then passes through).
  """
  rot: jax.Array
  vel: jax.Array
  initialized: jax.Array


def init_state(num_joints: int, dtype=jnp.float32) -> FilterState:
  """A fresh state: the next frame passes through."""
  return FilterState(rot=jnp.broadcast_to(jnp.eye(3, dtype=dtype), (num_joints, 3, 3)),
                     vel=jnp.zeros((num_joints, 3), dtype),
                     initialized=jnp.zeros((), bool))


def _alpha(cutoff: jax.Array, fps: jax.Array) -> jax.Array:
  r = 2.0 * jnp.pi * cutoff / fps
  return r / (r + 1.0)


def one_euro_step(state: FilterState, rot: jax.Array, config: FilterConfig,
                  fps: jax.Array) -> tuple[FilterState, jax.Array]:
  """One frame `rot [J, 3, 3]` -> (new state, filtered `[J, 3, 3]`); reads nothing else."""
  delta = rotations.relative_axis_angle(state.rot, rot)  # [J, 3]
  a_d = _alpha(config.d_cutoff, fps)
  vel = a_d * delta * fps + (1.0 - a_d) * state.vel
  cutoff = config.min_cutoff + config.beta * rotations.safe_norm(vel)  # [J]
  a = _alpha(cutoff, fps)[..., None]
  out = state.rot @ rotations.matrix_from_axis_angle(a * delta)
  # Re-orthonormalise: the filtered rotation is a running product, so rounding would drift.
  out = rotations.matrix_from_sixd(rotations.sixd_from_matrix(out))
  init = state.initialized
  out = jnp.where(init, out, rot)
  vel = jnp.where(init, vel, 0.0)
  return FilterState(out, vel, jnp.ones((), bool)), out


def filter_step(state: FilterState, rot: jax.Array, config: FilterConfig,
                fps: float | jax.Array = 30.0) -> tuple[FilterState, jax.Array]:
  """Streaming: one frame's local rotations `[J, 3, 3]` -> (new state, filtered `[J, 3, 3]`)."""
  if not config.active:
    return state, rot
  return one_euro_step(state, rot, config, jnp.asarray(fps, rot.dtype))


def filter_sequence(rots: jax.Array, config: FilterConfig, fps: float | jax.Array = 30.0,
                    state: FilterState | None = None, starts: jax.Array | None = None,
                    valid: jax.Array | None = None) -> tuple[FilterState, jax.Array]:
  """Filters frames in time order with `lax.scan`, carrying `state`.

  Args:
    rots: `[T, J, 3, 3]` local rotations, frames in time order.
    config: the filter (static).
    fps: frame rate.
    state: the state before frame 0 (None: fresh).
    starts: optional `[T]` bool, True where a new clip begins (the state is reset there), so
      several clips concatenated are filtered in one call, none reading another.
    valid: optional `[T]` bool; invalid frames (padding) leave the state unchanged.

  Returns:
    (state after the last valid frame, filtered `[T, J, 3, 3]`).
  """
  T, J = rots.shape[:2]
  if state is None:
    state = init_state(J, rots.dtype)
  if not config.active:
    return state, rots
  fps = jnp.asarray(fps, rots.dtype)
  starts = jnp.zeros((T,), bool) if starts is None else jnp.asarray(starts, bool)
  valid = jnp.ones((T,), bool) if valid is None else jnp.asarray(valid, bool)

  def body(carry, xs):
    rot, start, ok = xs
    carry_in = carry._replace(initialized=carry.initialized & ~start)
    new, out = one_euro_step(carry_in, rot, config, fps)
    new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, carry)
    return new, out

  return jax.lax.scan(body, state, (rots, starts, valid))


filter_sequence_jit = jax.jit(filter_sequence, static_argnames='config')
filter_step_jit = jax.jit(filter_step, static_argnames='config')


def filter_clips(rots: np.ndarray, file_ids: np.ndarray, config: FilterConfig, fps: float,
                 frame_index: np.ndarray | None = None) -> np.ndarray:
  """Host helper: filters each clip of a frame sequence on its own (frames of a clip
  contiguous and in order; a new clip starts where the file changes or `frame_index` skips).

  `rots [T, J, 3, 3]` -> filtered `[T, J, 3, 3]` float32 numpy, in one jitted scan (padded to a
  power-of-two length: few compiled shapes).
  """
  if not config.active:
    return np.asarray(rots)
  T = rots.shape[0]
  f = np.asarray(file_ids)
  starts = np.ones(T, bool)
  starts[1:] = f[1:] != f[:-1]
  if frame_index is not None:
    k = np.asarray(frame_index)
    starts[1:] |= k[1:] != k[:-1] + 1
  L = padding.power_of_two(T)
  R = padding.pad_rows(np.asarray(rots, np.float32), L)
  valid = np.arange(L) < T
  starts = padding.pad_rows(starts, L, fill=False)
  _, out = filter_sequence_jit(jnp.asarray(R), config, float(fps), None, jnp.asarray(starts),
                               jnp.asarray(valid))
  return np.asarray(out)[:T]
