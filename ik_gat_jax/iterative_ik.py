"""Non-learned baselines and iterative IK (DESIGN section 6).

- `swing_ik`: analytic swing-only IK, top-down. A joint whose rigid child bones (children not
  co-located with it) span a plane -- the root and every 'determined' joint of
  `Rig.observability()` -- gets the SVD (Kabsch) rotation taking its rest child offsets to the
  observed child bones, in its parent's frame; every other joint with a designated child c gets
  `R_j = Rmin(R0_j normalize(o_c) -> G_hat_parent.T @ b_j) @ R0_j`, `b_j = p_c - p_j`: the
  reference pose's local rotation `R0_j`, swung minimally (in the parent's frame) until the bone
  points where the positions say; leaves get `R0_j`. A root with a single rigid child bone is
  solved like a swing joint (a Kabsch rotation from one vector leaves the twist to the SVD's
  arbitrary basis). On clean input every bone direction is reproduced, so FK gives the observed
  positions.
  The reference `R0` (stated, DESIGN section 6 read for any rig): the rig's reference pose
  (`Rig.reference_local()`: `F_parent^T F_j`, skeleton.py), which is its natural T-pose; for
  `cmu_body` and `smpl22` that is the zero pose, `R0 = I`, DESIGN's formula exactly. It is never
  the zero pose of a rig that names another reference pose, because the zero pose depends on how
  the rig binds its joints (a zero pose with the spine horizontal is legal BVH). `reference=`
  takes another (e.g. the mean training pose: on the CMU test split 9.3 deg instead of 13.0,
  twist 7.8 instead of 14.8, leaves 15.2 instead of 13.0). Rig invariance: with `A_j` fixed
  per-joint binds (`o'_c = A_j^T o_c`, `R0'_j = A_p^T R0_j A_j`, `G'_p = G_p A_p` by induction),
  `Rmin(A_p^T u -> A_p^T v) = A_p^T Rmin(u -> v) A_p` gives `R'_j = A_p^T R_j A_j` exactly, and
  Kabsch is equivariant the same way (SVD of `A_p^T M A_j`).
- `mean_pose` / `mean_pose_ik`: the chordal L2 mean of the training local rotations (SVD
  projection of the mean matrix) with the analytic (Kabsch) root. Rig-invariant as it stands:
  the mean of `A_p^T R_j A_j` is `A_p^T mean(R_j) A_j` and the SVD projection commutes with
  fixed rotations on either side.
- Iterative IK: one optimisation core `_optimize` (fixed budget, `lax.scan` over iterations;
  Adam with a cosine-decayed step, or optax L-BFGS with its zoom line search) minimising, for ONE
  frame, `w_data * sum_j |FK(params)_j - p_j|^2` (metres, root translation fixed to the target
  root, or fitted in closed form: `SolverConfig.fit_translation`) plus a penalty. Two
  parameterisations plug into it:
  - rotations (no prior): per-joint 6D of all J rotations, root included, no penalty; with
    `SolverConfig.bone_chart` (the default) the 6D of the solvers' bone chart
    `D_j = B_j^T R0_j^T R_j B_j` (`solver_chart`: `R0` the rig's reference pose, identity for
    cmu_body; `B` the rest bone frames, from the offsets), else of the local rotations `R_j`;
  - latent (prior): `(z [latent], root 6D)`, non-root rotations `decode(decode_params, z, B)`,
    penalty `w_z |z|^2`; the root's 6D in the bone chart `D_root` with a bone-chart prior
    (`decode.bone_chart`), else of `R_root` (a prior trained before issue L: bit for bit as
    before).
  The per-frame solve is `jax.vmap`ped over frames (cold start) or over fixed windows of a clip
  with `lax.scan` over the frames of a window (warm start: a window's first frame is solved cold
  with `iters`, each later frame starts from the previous frame's solution with `warm_iters`).

Choices written down:
- The decoder is passed as `decode(decode_params, z, B) -> [J-1, 3, 3]` (non-root local
  rotations of the subject whose rest bone frames are `B [J, 3, 3]`, computed here from the
  offsets with `bone_frames.bone_frames`) with its parameters as a traced pytree, so one
  compiled solver serves every checkpoint; `decode` itself is a static argument of the jitted
  entry points (hashable, with a `bone_chart` attribute: `vposer.DecoderFn`).
- Adam's step follows a cosine decay from `lr` to `lr * final_lr_frac` over the budget (a constant
  step leaves a jitter of about `lr` in 6D units, mm-level on limbs), with b2 = 0.9 (see
  `SolverConfig`).
- `init_root` applies to both parameterisations; the non-root joints start at the rig's
  reference pose (`Rig.reference_local()`; identity for a rig whose zero pose is its reference,
  as before) without a prior and at `z = 0` with one; `init_root='identity'` starts the root at
  the reference pose's root orientation (identity there too).
- Rig invariance (issue L). Re-rigging by binds A (`R' = A_p^T R A_j`, `R0' = A_p^T R0 A_j`,
  `B' = A^T B`, `o' = A_p^T o`) leaves the chart unchanged, `D' = D`, and the start pose (the
  reference pose and the Kabsch root are equivariant), FK's positions and so the loss as a
  function of `D` are the same: the whole optimisation, Adam's path included, is identical on
  every rig, and the solution maps back exactly (`R' = R0' B' D B'^T = A_p^T R A_j`, up to float
  round-off). In the joint chart (`bone_chart=False`, the solver before issue L) it is not: the
  6D parameterisation `GS(x)` does not commute with multiplication by a bind, so Adam's path
  differs (same start pose, same optimum set; CMU test, no prior: 31.0 deg on cmu_body, 34.7
  re-rigged). The latent solver is invariant with a bone-chart prior
  (`vposer.VAEConfig.bone_chart`, whose decoder is) for the same reason.
- Why `D` and not the prior's chart `L_j = B_p^T R_j B_j` (`bone_frames.bone_chart`), which is
  as invariant: `D_j = L0_j^T L_j` with `L0` the reference pose's chart, a fixed rotation of
  each joint's 6D coordinates, and Adam's per-coordinate steps are not rotation-invariant. `D`
  starts every joint at the identity 6D, with its coordinates along the rest bone frame (twist
  about x), as the joint chart does on cmu_body; `L` starts at `B_p^T B_j`. Measured on 60
  frames of 07_01, 07_12, 09_05 on cmu_body, no prior (local deg / MPJPE mm): 100 iterations `D`
  27.5 / 7.8, `L` 28.7 / 7.5, the joint chart (with eps 1e-8, the solver before issue L)
  27.7 / 6.8; 300 iterations 24.4 / 0.10, 26.6 / 0.17, 24.6 / 0.12.
- Adam's `eps` is 1e-4, not optax's 1e-8 (`SolverConfig.adam_eps`): at a zero gradient (an
  unobserved twist; a straight limb at the start pose) Adam's step is `lr g / (|g| + eps)`, so
  float32 round-off in the gradient (~1e-6) became steps of up to `lr`, and the solution
  depended on round-off, hence on the rig (the 60 frames above, bone chart, 100 iterations:
  28.02 deg on cmu_body, 28.96 re-rigged with 1e-8; 27.54 and 27.54 with 1e-4; the shipped
  prior's latent solve is unchanged to 0.001 deg and 0.001 mm).
- The loss trace has `iters + 1` entries: the loss at the start and after every iteration.
- Measured on 07_01 (316 clean frames, rotations without a prior, 300 iterations; the joint
  chart, before issue L): MPJPE 0.14 mm but local rotation error 21.9 deg against swing IK's
  11.5: the unobserved twists have no restoring force and Adam's normalised steps let them
  wander. Positions check consistency;
  rotation errors rank methods (DESIGN section 7).
- XLA's cost analysis counts a loop body once, whatever its trip count, so solver FLOPs are
  measured on one iteration and multiplied by the budget (`solver_flops_per_frame`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import optax

from ik_gat_jax import bone_frames
from ik_gat_jax import kinematics
from ik_gat_jax import rotations
from ik_gat_jax.skeleton import Rig

Params = Any  # a pytree of arrays
# (decode_params, z [L], B [J, 3, 3]) -> [J-1, 3, 3]; has `.bone_chart` (vposer.DecoderFn)
Decode = Callable[[Params, jax.Array, jax.Array], jax.Array]


class PosePrior(Protocol):
  """A pose prior as the refinement takes it (`vposer.DecoderFn`: static, hashable): `decode` as
  `Decode`, and `encode(params, local [J, 3, 3], B [J, 3, 3]) -> z [latent]` (the mean)."""

  def decode(self, params: Params, z: jax.Array, B: jax.Array) -> jax.Array: ...

  def encode(self, params: Params, local: jax.Array, B: jax.Array) -> jax.Array: ...


# ----------------------------------------------------------------------------------------------
# Analytic: Kabsch, swing-only IK, mean pose.


def project_to_so3(M: jax.Array) -> jax.Array:
  """Nearest rotation (Frobenius / chordal) to `M: [..., 3, 3]`, by SVD with det correction."""
  U, _, Vt = jnp.linalg.svd(M)
  d = jnp.sign(jnp.linalg.det(U @ Vt))
  U = U.at[..., :, 2].multiply(d[..., None])
  return U @ Vt


def kabsch(rest: jax.Array, observed: jax.Array) -> jax.Array:
  """Rotation R minimising `sum_k |R rest_k - observed_k|^2`; `rest, observed: [..., K, 3]`."""
  return project_to_so3(jnp.einsum('...ka,...kb->...ab', observed, rest))


def rigid_children(rig: Rig) -> tuple[tuple[int, ...], ...]:
  """Per joint, its children at a different position (template rest pose); static."""
  coloc = rig.colocated()
  return tuple(tuple(c for c in kids if not coloc[c]) for kids in rig.children)


def _spans_plane(j: int, rig: Rig) -> bool:
  return rig.observability()[j] == 'determined'


def _joint_rotation(j: int, positions: jax.Array, offsets: jax.Array, G_parent: jax.Array,
                    rig: Rig, reference: jax.Array | None = None) -> jax.Array:
  """Local rotation `[..., 3, 3]` of joint j from observed positions, given its parent's frame.

  `positions, offsets: [..., J, 3]`, `G_parent: [..., 3, 3]` (world rotation of j's parent,
  identity for the root); `reference: [J, 3, 3]` the local rotations swings start from (None:
  identity, the zero pose).
  """
  to_parent = lambda v: jnp.einsum('...ba,...b->...a', G_parent, v)  # G_parent.T @ v
  if _spans_plane(j, rig):
    kids = list(rigid_children(rig)[j])
    bones = positions[..., kids, :] - positions[..., j:j + 1, :]
    observed = jnp.einsum('...ba,...kb->...ka', G_parent, bones)
    return kabsch(offsets[..., kids, :], observed)
  c = rig.designated_children[j]
  R0 = None if reference is None else reference[j].astype(positions.dtype)
  if c < 0:
    return jnp.broadcast_to(jnp.eye(3, dtype=positions.dtype) if R0 is None else R0,
                            G_parent.shape)
  bone = to_parent(positions[..., c, :] - positions[..., j, :])
  if R0 is None:
    return rotations.minimal_rotation(offsets[..., c, :], bone)
  rest = jnp.einsum('ab,...b->...a', R0, offsets[..., c, :])  # the bone in the reference pose
  return rotations.minimal_rotation(rest, bone) @ R0


def swing_reference(rig: Rig, reference: jax.Array | None = None) -> jax.Array | None:
  """The local rotations `[J, 3, 3]` swing-only IK starts from: `reference` if given, else the
  rig's reference pose (`Rig.reference_local()`), None for a rig whose zero pose is its
  reference (the identity path, bit for bit what it was)."""
  if reference is not None:
    return jnp.asarray(reference)
  return jnp.asarray(rig.reference_local()) if rig.has_reference_pose else None


def _broadcast_pair(positions: jax.Array, offsets: jax.Array) -> tuple[jax.Array, jax.Array]:
  positions, offsets = jnp.asarray(positions), jnp.asarray(offsets, positions.dtype)
  batch = jnp.broadcast_shapes(positions.shape[:-2], offsets.shape[:-2])
  return (jnp.broadcast_to(positions, batch + positions.shape[-2:]),
          jnp.broadcast_to(offsets, batch + offsets.shape[-2:]))


def swing_ik(positions: jax.Array, offsets: jax.Array, rig: Rig,
             reference: jax.Array | None = None) -> jax.Array:
  """Analytic swing-only IK (module docstring).

  Args:
    positions: `[..., J, 3]` observed world joint positions (metres).
    offsets: `[..., J, 3]` or `[J, 3]` the subject's rest offsets (each in its parent's frame).
    rig: static rig.
    reference: optional `[J, 3, 3]` local rotations to swing from (default: the rig's
      reference pose, `swing_reference`).

  Returns:
    `[..., J, 3, 3]` local (parent-relative) rotations; the root's is its world rotation.
  """
  positions, offsets = _broadcast_pair(positions, offsets)
  ref = swing_reference(rig, reference)
  eye = jnp.broadcast_to(jnp.eye(3, dtype=positions.dtype), positions.shape[:-2] + (3, 3))
  G, R = [], []
  for j, p in enumerate(rig.parents):
    G_parent = eye if p < 0 else G[p]
    R.append(_joint_rotation(j, positions, offsets, G_parent, rig, ref))
    G.append(G_parent @ R[-1])
  return jnp.stack(R, axis=-3)


def root_rotation(positions: jax.Array, offsets: jax.Array, rig: Rig) -> jax.Array:
  """The analytic root rotation of `swing_ik` alone: `[..., J, 3]` -> `[..., 3, 3]` (world)."""
  positions, offsets = _broadcast_pair(positions, offsets)
  eye = jnp.broadcast_to(jnp.eye(3, dtype=positions.dtype), positions.shape[:-2] + (3, 3))
  return _joint_rotation(0, positions, offsets, eye, rig, swing_reference(rig))


def mean_pose(train_local_rot: jax.Array) -> jax.Array:
  """Chordal L2 mean per joint: `[N, J, 3, 3]` -> `[J, 3, 3]` (SVD projection of the mean)."""
  return project_to_so3(jnp.mean(jnp.asarray(train_local_rot, jnp.float32), axis=0))


def mean_pose_ik(positions: jax.Array, offsets: jax.Array, mean_local: jax.Array,
                 rig: Rig) -> jax.Array:
  """The mean-pose floor: constant non-root local rotations `mean_local: [J, 3, 3]`, analytic
  root from `positions: [..., J, 3]` -> local rotations `[..., J, 3, 3]`."""
  root = root_rotation(positions, offsets, rig)
  local = jnp.broadcast_to(mean_local, root.shape[:-2] + mean_local.shape)
  return local.at[..., 0, :, :].set(root)


# ----------------------------------------------------------------------------------------------
# Iterative IK: configuration and the one optimisation core.


@dataclasses.dataclass(frozen=True)
class SolverConfig:
  """Static configuration of the iterative solvers (hashable: a jit static argument).

  Attributes:
    iters: iterations per frame for a cold start (and a window's first frame).
    lr: Adam's initial step (ignored by L-BFGS, which uses its line search).
    final_lr_frac: Adam's step decays (cosine) to `lr * final_lr_frac` at the end of a budget.
    adam_b1, adam_b2: Adam's moment decays. b2 = 0.9, not 0.999: the gradients shrink by orders
      of magnitude within a solve, and a long second-moment memory of the first large ones
      stalls the end (07_01, 16 frames, 300 iterations, lr 0.1: 4.6 mm MPJPE with b2 = 0.999,
      3.5 mm with 0.99, 0.02 mm with 0.9).
    w_data: weight of the sum of squared position errors (metres^2).
    w_z: weight of `|z|^2` (latent solver only).
    optimizer: 'adam' or 'lbfgs'.
    init_root: 'identity' or 'analytic' (the Kabsch root of `swing_ik`).
    warm_iters: iterations per frame for warm-started frames.
    window: frames per warm-start window (a window's first frame is solved cold).
    lbfgs_memory: L-BFGS history length.
    w_anchor: refinement only (`refine_rotations`): weight of `|6D - 6D_init|^2`, which keeps
      what the positions cannot see (twists, leaves) near the amortized prediction. G1's clean
      val sweep (fixed root, lr 0.003) found 0 best; with `fit_translation` and
      `anchor_relative` the sweep over the whole noise curve chose 50 (`REFINE_DEFAULTS`).
    adam_eps: Adam's eps, 1e-4: above the float32 round-off of the gradient (module
      docstring).
    bone_chart: the rotation solver and the refinement optimise the 6D of the solvers' bone
      chart `D_j = B_j^T R0_j^T R_j B_j` (rig-invariant: module docstring), not of `R_j`.
      False (with adam_eps=1e-8): the solver before issue L, bit for bit. The latent solver's
      root follows its prior's chart instead (`vposer.VAEConfig.bone_chart`).
    fit_translation: the fitted skeleton's root translation is the least-squares one for the
      pose being scored (the mean over joints of `target - FK(params, root at 0)`, closed form)
      instead of the target's root joint. The input is root-relative, so noise on the root
      joint shifts every other target alike; a fixed root turns that shift into a bias of
      every rotation, a fitted one absorbs it (issue J: BENCHMARKS.md "On noisy input: a fitted
      root and a relative anchor"). Scoring is unchanged (metrics put the root at the true
      root). Re-rigging moves no position, so the fit stays rig-invariant.
    anchor_relative: refinement only: the anchor's weight is `w_anchor * w_data * r0`, `r0`
      the initial pose's mean squared position residual per joint (m^2; with
      `fit_translation`, after the fitted translation): a MAP-like weighting in which the pull
      toward the amortized pose grows with how far the input is from what that pose explains
      (input noise), so one `w_anchor` serves clean and noisy input.
    w_prior: refinement with a pose prior only (`refine_rotations(..., prior=...)`): weight of
      `sum_j |R_j - decode(z)_j|_F^2` over the non-root joints, the prior's latent `z`
      optimised with the pose (from the prior's encoding of the initial pose, penalised by
      `w_z |z|^2`, moving `PRIOR_Z_STEP` times the rotations' Adam step). The term's weight is
      `w_prior * w_data * r0 * (r0 / PRIOR_R_REF)`, `r0` as for `anchor_relative`: it grows as
      the square of the initial residual, so clean input keeps the network's pose and noisy
      input leans on the prior (BENCHMARKS.md "On noisy input: the pose prior in the
      refinement"). The Frobenius distance is the same in every chart, so with a bone-chart
      prior the term is rig-invariant too.
  """
  iters: int = 100
  lr: float = 0.1
  final_lr_frac: float = 0.05
  adam_b1: float = 0.9
  adam_b2: float = 0.9
  adam_eps: float = 1e-4
  w_data: float = 10.0
  w_z: float = 0.001  # tuned on val: BENCHMARKS.md "Iterative solver sweep"
  optimizer: str = 'adam'
  init_root: str = 'analytic'
  warm_iters: int = 20
  window: int = 30
  lbfgs_memory: int = 10
  w_anchor: float = 0.0
  bone_chart: bool = True
  fit_translation: bool = False
  anchor_relative: bool = False
  w_prior: float = 0.0

  def __post_init__(self):
    if self.optimizer not in ('adam', 'lbfgs'):
      raise ValueError(f"optimizer must be 'adam' or 'lbfgs', got {self.optimizer!r}")
    if self.init_root not in ('identity', 'analytic'):
      raise ValueError(f"init_root must be 'identity' or 'analytic', got {self.init_root!r}")
    if self.iters < 1 or self.warm_iters < 1 or self.window < 1:
      raise ValueError(f'iters, warm_iters and window must be >= 1, got {self}')


# Amortized + refine (issues G1, J): chosen on val over the whole noise curve (BENCHMARKS.md
# "On noisy input: a fitted root and a relative anchor"): the root translation fitted, the
# anchor relative to the initial residual (w_anchor 50), lr 0.003 over 50 iterations
# (`REFINE_ITERS`, the suggested budget).
REFINE_DEFAULTS = {'lr': 0.003, 'w_anchor': 50.0, 'fit_translation': True,
                   'anchor_relative': True}
REFINE_ITERS = 50
# With a pose prior (issue J): chosen on val over the whole noise curve (BENCHMARKS.md "On noisy
# input: the pose prior in the refinement"). Without a prior, lr 0.01 scores as 0.003 (val,
# 0-50 mm, within 0.02 deg).
PRIOR_REFINE_DEFAULTS = {**REFINE_DEFAULTS, 'lr': 0.01, 'w_prior': 10.0}
PRIOR_R_REF = 1e-4  # m^2: the prior term's weight is relative to a (10 mm)^2 initial residual
PRIOR_Z_STEP = 10.0  # the latent's Adam step, in units of the rotations' (6D) step


def refine_config(iters: int = REFINE_ITERS, prior: bool = False, **overrides) -> SolverConfig:
  """The refinement's configuration: `iters` anchored Adam steps from the amortized pose with
  `REFINE_DEFAULTS`, or `PRIOR_REFINE_DEFAULTS` for a refinement with a pose prior (`prior`;
  None values in `overrides` are ignored)."""
  defaults = PRIOR_REFINE_DEFAULTS if prior else REFINE_DEFAULTS
  kw = {**defaults, **{k: v for k, v in overrides.items() if v is not None}}
  return SolverConfig(iters=int(iters), **kw)


def _optimizer(config: SolverConfig, iters: int) -> optax.GradientTransformationExtraArgs:
  if config.optimizer == 'lbfgs':
    return optax.lbfgs(memory_size=config.lbfgs_memory)
  schedule = optax.cosine_decay_schedule(config.lr, iters, alpha=config.final_lr_frac)
  return optax.with_extra_args_support(optax.adam(schedule, b1=config.adam_b1, b2=config.adam_b2,
                                                  eps=config.adam_eps))


def _make_step(loss_fn: Callable[[Params], jax.Array], opt: optax.GradientTransformationExtraArgs,
               config: SolverConfig) -> Callable:
  """One iteration `((params, opt_state), _) -> ((params, opt_state), loss before the step)`."""
  if config.optimizer == 'lbfgs':
    value_and_grad = optax.value_and_grad_from_state(loss_fn)  # reuses the line search's value
  else:
    value_and_grad = lambda p, state: jax.value_and_grad(loss_fn)(p)

  def step(carry, _):
    params, state = carry
    value, grad = value_and_grad(params, state=state)
    updates, state = opt.update(grad, state, params, value=value, grad=grad, value_fn=loss_fn)
    return (optax.apply_updates(params, updates), state), value

  return step


def _optimize(loss_fn: Callable[[Params], jax.Array], params0: Params, iters: int,
              config: SolverConfig) -> tuple[Params, jax.Array]:
  """Minimises `loss_fn` from `params0` for exactly `iters` iterations (one problem, unbatched).

  Returns `(params, trace [iters + 1])`: the loss before each iteration and at the end.
  """
  opt = _optimizer(config, iters)
  step = _make_step(loss_fn, opt, config)
  (params, _), trace = jax.lax.scan(step, (params0, opt.init(params0)), length=iters)
  return params, jnp.append(trace, loss_fn(params))


# ----------------------------------------------------------------------------------------------
# Parameterisations: params of one frame -> local rotations [J, 3, 3], and a penalty.


@dataclasses.dataclass(frozen=True)
class _Problem:
  to_local: Callable[[Params, jax.Array], jax.Array]  # (params, B [J, 3, 3]) -> [J, 3, 3]
  penalty: Callable[[Params], jax.Array]


def solver_chart(local: jax.Array, B: jax.Array, rig: Rig, joints: slice = slice(None),
                 inverse: bool = False) -> jax.Array:
  """Local rotations `[..., K, 3, 3]` of `joints` (default all J) <-> the solvers' bone chart
  `D_j = B_j^T R0_j^T R_j B_j` (module docstring): each rotation relative to the rig's
  reference pose `R0` (`Rig.reference_local()`, identity for cmu_body), in the joint's own rest
  bone frame (`B: [..., J, 3, 3]`, `bone_frames.bone_frames`). `inverse`: D -> R."""
  Bj = jnp.asarray(B, local.dtype)[..., joints, :, :]
  BjT = jnp.swapaxes(Bj, -1, -2)
  R0 = (jnp.asarray(rig.reference_local()[joints], local.dtype) if rig.has_reference_pose
        else None)  # static
  if inverse:
    R = Bj @ local @ BjT
    return R if R0 is None else R0 @ R
  rel = local if R0 is None else jnp.swapaxes(R0, -1, -2) @ local
  return BjT @ rel @ Bj


def _rotation_to_local(rig: Rig, chart: bool) -> Callable[[Params, jax.Array], jax.Array]:
  """`(params [J, 6], B [J, 3, 3]) -> [J, 3, 3]` local rotations from the 6D of the chart."""
  if not chart:
    return lambda params, B: rotations.matrix_from_sixd(params)
  return lambda params, B: solver_chart(rotations.matrix_from_sixd(params), B, rig,
                                        inverse=True)


def _rotation_problem(rig: Rig, config: SolverConfig) -> _Problem:
  """params: `[J, 6]` 6D of the rotations in the solver's chart (`config.bone_chart`), root
  included."""
  return _Problem(to_local=_rotation_to_local(rig, config.bone_chart),
                  penalty=lambda params: 0.0)


def _latent_problem(decode: Decode, decode_params: Params, rig: Rig,
                    config: SolverConfig) -> _Problem:
  """params: `{'z': [L], 'root': [6]}`; non-root rotations from the decoder, the root's 6D in
  the solvers' bone chart with a bone-chart prior (`decode.bone_chart`), else of `R`."""

  def to_local(params, B):
    root = rotations.matrix_from_sixd(params['root'])[None]
    if decode.bone_chart:
      root = solver_chart(root, B, rig, slice(0, 1), inverse=True)
    return jnp.concatenate([root, decode(decode_params, params['z'], B)], axis=0)

  return _Problem(to_local=to_local, penalty=lambda params: config.w_z * jnp.sum(params['z']**2))


def _position_residual(local: jax.Array, target: jax.Array, offsets: jax.Array, rig: Rig,
                       config: SolverConfig) -> jax.Array:
  """`FK(local) - target`, `[J, 3]`: the root at the target's root joint, or at the
  least-squares translation (`config.fit_translation`)."""
  if not config.fit_translation:
    _, p = kinematics.forward_kinematics(local, offsets, rig.parents, root_pos=target[0])
    return p - target
  _, p = kinematics.forward_kinematics(local, offsets, rig.parents,
                                       root_pos=jnp.zeros_like(target[0]))
  r = p - target
  return r - jnp.mean(r, axis=0)


def _frame_loss(params: Params, target: jax.Array, offsets: jax.Array, B: jax.Array,
                problem: _Problem, rig: Rig, config: SolverConfig) -> jax.Array:
  """One frame: `target, offsets: [J, 3]`, rest bone frames `B: [J, 3, 3]` -> scalar loss (root
  translation from the target, or fitted: `SolverConfig.fit_translation`)."""
  r = _position_residual(problem.to_local(params, B), target, offsets, rig, config)
  return config.w_data * jnp.sum(r**2) + problem.penalty(params)


def _frame_loss_fn(problem: _Problem, target: jax.Array, offsets: jax.Array, rig: Rig,
                   config: SolverConfig) -> Callable[[Params], jax.Array]:
  """The loss of one frame as a function of its params; the bone frames are computed once,
  outside the iterations."""
  return functools.partial(_frame_loss, target=target, offsets=offsets,
                           B=bone_frames.bone_frames(offsets, rig), problem=problem, rig=rig,
                           config=config)


def _solve_frame(problem: _Problem, params0: Params, target: jax.Array, offsets: jax.Array,
                 iters: int, rig: Rig, config: SolverConfig) -> tuple[Params, jax.Array]:
  return _optimize(_frame_loss_fn(problem, target, offsets, rig, config), params0, iters, config)


def _initial_root(positions: jax.Array, offsets: jax.Array, rig: Rig,
                  config: SolverConfig) -> jax.Array:
  """`[..., J, 3]` -> initial root rotation `[..., 3, 3]` per `config.init_root`."""
  if config.init_root == 'analytic':
    return root_rotation(positions, offsets, rig)
  start = rig.reference_local()[0] if rig.has_reference_pose else jnp.eye(3)
  return jnp.broadcast_to(jnp.asarray(start, positions.dtype), positions.shape[:-2] + (3, 3))


def _rotation_init(positions, offsets, rig, config, init_local=None) -> Params:
  """`[..., J, 3]` -> `[..., J, 6]`: the rig's reference pose (the zero pose unless the rig names
  another) with the configured root, or `init_local`, in the solver's chart."""
  if init_local is None:
    root = _initial_root(positions, offsets, rig, config)
    start = rig.reference_local() if rig.has_reference_pose else jnp.eye(3)
    init_local = jnp.broadcast_to(jnp.asarray(start, root.dtype), positions.shape + (3,))
    init_local = init_local.at[..., 0, :, :].set(root)
  if config.bone_chart:
    init_local = solver_chart(init_local, _frames(offsets, rig, init_local.dtype), rig)
  return rotations.sixd_from_matrix(init_local)


def _frames(offsets: jax.Array, rig: Rig, dtype) -> jax.Array:
  return bone_frames.bone_frames(jnp.asarray(offsets, dtype), rig)


def latent_params(root: jax.Array, offsets: jax.Array, rig: Rig, decode: Decode,
                  latent_dim: int) -> Params:
  """The latent solver's start from a root rotation `root: [..., 3, 3]` (world) and
  `offsets: [..., J, 3]`: `{'z': [..., L] zeros, 'root': [..., 6]}`, the root's 6D in the
  solvers' bone chart with a bone-chart prior (`decode.bone_chart`), else of `R`."""
  z = jnp.zeros(root.shape[:-2] + (latent_dim,), root.dtype)
  if decode.bone_chart:
    root = solver_chart(root[..., None, :, :], _frames(offsets, rig, root.dtype), rig,
                        slice(0, 1))[..., 0, :, :]
  return {'z': z, 'root': rotations.sixd_from_matrix(root)}


def _latent_init(positions, offsets, rig, config, decode: Decode, latent_dim: int) -> Params:
  """`[..., J, 3]` -> `{'z': [..., L] zeros, 'root': [..., 6]}` (`latent_params`)."""
  return latent_params(_initial_root(positions, offsets, rig, config), offsets, rig, decode,
                       latent_dim)


# ----------------------------------------------------------------------------------------------
# Batched drivers: cold start over frames, warm start over windows of a clip.


def _solve_cold(problem: _Problem, params0: Params, positions: jax.Array, offsets: jax.Array,
                rig: Rig, config: SolverConfig) -> tuple[jax.Array, jax.Array]:
  """Independent frames: `positions [N, J, 3]`, `offsets [N, J, 3] | [J, 3]`, `params0` with a
  leading N axis -> `(local [N, J, 3, 3], trace [N, iters + 1])`."""

  def one(p0, target, off):
    params, trace = _solve_frame(problem, p0, target, off, config.iters, rig, config)
    return problem.to_local(params, bone_frames.bone_frames(off, rig)), trace

  # in_axes: params0 and targets per frame; offsets per frame or shared by the whole batch.
  return jax.vmap(one, in_axes=(0, 0, 0 if offsets.ndim == 3 else None))(
      params0, positions, offsets)


def _solve_windows(problem: _Problem, init_fn: Callable[[jax.Array], Params],
                   positions: jax.Array, offsets: jax.Array, rig: Rig,
                   config: SolverConfig) -> tuple[jax.Array, jax.Array]:
  """A clip `positions [T, J, 3]` of one subject (`offsets [J, 3]`) in windows of
  `config.window` frames (the last padded by repeating the final frame) ->
  `(local [T, J, 3, 3], final_loss [T])`. Causal within a window."""
  if offsets.ndim != 2:
    raise ValueError(f'warm start solves one subject: offsets must be [J, 3], got {offsets.shape}')
  T, J = positions.shape[:2]
  W = config.window
  n = math.ceil(T / W)
  padded = jnp.concatenate([positions, jnp.repeat(positions[-1:], n * W - T, axis=0)])
  B = bone_frames.bone_frames(offsets, rig)

  def window(frames):  # [W, J, 3]
    first, trace = _solve_frame(problem, init_fn(frames[0]), frames[0], offsets, config.iters,
                                rig, config)

    def next_frame(params, target):
      params, trace = _solve_frame(problem, params, target, offsets, config.warm_iters, rig,
                                   config)
      return params, (params, trace[-1])

    _, (rest, rest_loss) = jax.lax.scan(next_frame, first, frames[1:])
    params = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest)
    # in_axes: the window's frames; one subject's bone frames.
    local = jax.vmap(problem.to_local, in_axes=(0, None))(params, B)
    return local, jnp.concatenate([trace[-1:], rest_loss])

  # in_axes: one window of frames per solver; offsets are closed over (one subject).
  local, final = jax.vmap(window)(padded.reshape(n, W, J, 3))
  return local.reshape(n * W, J, 3, 3)[:T], final.reshape(n * W)[:T]


def solve_rotations(positions: jax.Array, offsets: jax.Array, rig: Rig, config: SolverConfig,
                    init_local: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Iterative IK without a prior, cold start per frame.

  Args:
    positions: `[N, J, 3]` target world joint positions (metres).
    offsets: `[N, J, 3]` or `[J, 3]` rest offsets.
    rig, config: static.
    init_local: optional `[N, J, 3, 3]` initial local rotations (default: rest pose with the
      configured root).

  Returns:
    `(local_rot [N, J, 3, 3], loss_trace [N, config.iters + 1])`.
  """
  params0 = _rotation_init(positions, offsets, rig, config, init_local)
  return _solve_cold(_rotation_problem(rig, config), params0, positions, offsets, rig, config)


def solve_latent(positions: jax.Array, offsets: jax.Array, decode: Decode, decode_params: Params,
                 rig: Rig, config: SolverConfig,
                 latent_dim: int = 32) -> tuple[jax.Array, jax.Array]:
  """Iterative IK with a prior, cold start per frame: optimise `(z [latent_dim], root 6D)`.

  `decode(decode_params, z [latent_dim], B [J, 3, 3]) -> [J-1, 3, 3]` non-root local rotations
  of the subject with rest bone frames B (module docstring). Shapes and returns as
  `solve_rotations`.
  """
  params0 = _latent_init(positions, offsets, rig, config, decode, latent_dim)
  problem = _latent_problem(decode, decode_params, rig, config)
  return _solve_cold(problem, params0, positions, offsets, rig, config)


def solve_rotations_warm(positions: jax.Array, offsets: jax.Array, rig: Rig,
                         config: SolverConfig) -> tuple[jax.Array, jax.Array]:
  """`solve_rotations` with warm start over windows of a clip `positions: [T, J, 3]`,
  `offsets: [J, 3]` -> `(local_rot [T, J, 3, 3], final_loss [T])`."""
  init_fn = lambda target: _rotation_init(target, offsets, rig, config)
  return _solve_windows(_rotation_problem(rig, config), init_fn, positions, offsets, rig, config)


def solve_latent_warm(positions: jax.Array, offsets: jax.Array, decode: Decode,
                      decode_params: Params, rig: Rig, config: SolverConfig,
                      latent_dim: int = 32) -> tuple[jax.Array, jax.Array]:
  """`solve_latent` with warm start over windows of a clip; returns as `solve_rotations_warm`."""
  init_fn = lambda target: _latent_init(target, offsets, rig, config, decode, latent_dim)
  problem = _latent_problem(decode, decode_params, rig, config)
  return _solve_windows(problem, init_fn, positions, offsets, rig, config)


def _anchored_problem(init: jax.Array, rig: Rig, config: SolverConfig,
                      weight: jax.Array | float | None = None) -> _Problem:
  """Rotations problem plus `weight |params - init|^2` (init: `[J, 6]`, one frame, in the
  solver's chart: with the bone chart the anchor is rig-invariant too; weight: `w_anchor`
  unless given)."""
  weight = config.w_anchor if weight is None else weight
  return _Problem(to_local=_rotation_to_local(rig, config.bone_chart),
                  penalty=lambda params: weight * jnp.sum((params - init)**2))


def _prior_term(prior: PosePrior, prior_params: Params, init_local: jax.Array, B: jax.Array,
                weight: jax.Array, config: SolverConfig) -> tuple[Params, Callable]:
  """The refinement's prior term (`SolverConfig.w_prior`): `(u0, penalty(local, u))`, the latent
  `z = PRIOR_Z_STEP * u` starting at the prior's encoding of `init_local`."""
  u0 = prior.encode(prior_params, init_local, B) / PRIOR_Z_STEP

  def penalty(local, u):
    z = PRIOR_Z_STEP * u
    decoded = prior.decode(prior_params, z, B)
    return weight * jnp.sum((local[1:] - decoded)**2) + config.w_z * jnp.sum(z**2)

  return u0, penalty


def _refine_frame(init_local: jax.Array, target: jax.Array, offsets: jax.Array, rig: Rig,
                  config: SolverConfig, prior: PosePrior | None = None,
                  prior_params: Params = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One frame: `config.iters` steps from `init_local [J, 3, 3]`, keeping the best iterate, so
  the returned loss never exceeds the initial one. -> (local, initial loss, final loss)."""
  B = bone_frames.bone_frames(offsets, rig)
  start = solver_chart(init_local, B, rig) if config.bone_chart else init_local
  params0 = rotations.sixd_from_matrix(start)
  weight = None
  use_prior = prior is not None and config.w_prior > 0
  if config.anchor_relative or use_prior:  # a constant of the frame: no gradient flows into it
    r0 = _position_residual(init_local, target, offsets, rig, config)
    r0 = jax.lax.stop_gradient(jnp.mean(jnp.sum(r0**2, -1)))
  if config.anchor_relative:
    weight = config.w_anchor * config.w_data * r0
  problem = _anchored_problem(params0, rig, config, weight)
  loss_fn = _frame_loss_fn(problem, target, offsets, rig, config)
  if use_prior:  # params {'x': the rotations' 6D, 'u': the scaled latent}
    u0, penalty = _prior_term(prior, prior_params, init_local, B,
                              config.w_prior * config.w_data * r0 * (r0 / PRIOR_R_REF), config)
    rotation_loss = loss_fn
    loss_fn = lambda p: rotation_loss(p['x']) + penalty(problem.to_local(p['x'], B), p['u'])
    params0 = {'x': params0, 'u': u0}
  opt = _optimizer(config, config.iters)
  step = _make_step(loss_fn, opt, config)

  def keep_best(carry, _):
    (params, state), (best, best_loss) = carry
    (new_params, state), loss = step((params, state), None)  # loss of `params`
    better = loss < best_loss
    best = jax.tree.map(lambda a, b: jnp.where(better, a, b), params, best)
    return ((new_params, state), (best, jnp.minimum(loss, best_loss))), None

  loss0 = loss_fn(params0)
  ((last, _), (best, best_loss)), _ = jax.lax.scan(
      keep_best, ((params0, opt.init(params0)), (params0, loss0)), length=config.iters)
  last_loss = loss_fn(last)
  best = jax.tree.map(lambda a, b: jnp.where(last_loss < best_loss, a, b), last, best)
  x = best['x'] if use_prior else best
  return problem.to_local(x, B), loss0, jnp.minimum(last_loss, best_loss)


def refine_rotations(init_local: jax.Array, positions: jax.Array, offsets: jax.Array, rig: Rig,
                     config: SolverConfig, prior: PosePrior | None = None,
                     prior_params: Params = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Amortized + refine (issues G1, J): a few anchored iterations from an initial pose.

  Args:
    init_local: `[N, J, 3, 3]` initial local rotations (e.g. IK-GAT's).
    positions: `[N, J, 3]` target world positions; offsets `[N, J, 3]` or `[J, 3]`.
    config: `iters` (a few), `lr`, `w_data`, `w_anchor`, `w_prior` (`refine_config`).
    prior, prior_params: optional pose prior (`vposer.decoder(model)`): with
      `config.w_prior > 0` the pose is also pulled toward the prior's decoding of a latent
      optimised with it (`SolverConfig.w_prior`).

  Returns:
    `(local [N, J, 3, 3], initial loss [N], final loss [N])`, final <= initial per frame (the
    loss the refinement minimises, prior term included).
  """
  offsets = jnp.broadcast_to(offsets, positions.shape)
  # in_axes: one frame per solver for every argument; the prior is shared.
  return jax.vmap(lambda r, p, o: _refine_frame(r, p, o, rig, config, prior, prior_params))(
      init_local, positions, offsets)


# Entry points.
swing_ik_jit = jax.jit(swing_ik, static_argnames='rig')
solve_rotations_jit = jax.jit(solve_rotations, static_argnames=('rig', 'config'))
solve_latent_jit = jax.jit(solve_latent, static_argnames=('decode', 'rig', 'config',
                                                          'latent_dim'))
solve_rotations_warm_jit = jax.jit(solve_rotations_warm, static_argnames=('rig', 'config'))
solve_latent_warm_jit = jax.jit(solve_latent_warm, static_argnames=('decode', 'rig', 'config',
                                                                    'latent_dim'))


# ----------------------------------------------------------------------------------------------
# FLOPs.


def flops_per_frame(fn: Callable, *example_args, num_frames: int | None = None) -> float:
  """XLA's FLOP estimate of `fn(*example_args)`, compiled, divided by the number of frames.

  `num_frames` defaults to the leading axis of the first argument. Loop bodies (`lax.scan`,
  `while_loop`) are counted once by XLA whatever their trip count; see `solver_flops_per_frame`.
  Returns NaN where the backend gives no estimate.
  """
  cost = jax.jit(fn).lower(*example_args).compile().cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
    cost = cost[0] if cost else None
  if not cost or 'flops' not in cost:
    return float('nan')
  if num_frames is None:
    num_frames = int(jnp.shape(example_args[0])[0]) if jnp.ndim(example_args[0]) else 1
  return float(cost['flops']) / num_frames


def solver_flops_per_frame(positions: jax.Array, offsets: jax.Array, rig: Rig,
                           config: SolverConfig, decode: Decode | None = None,
                           decode_params: Params = None, latent_dim: int = 32) -> float:
  """FLOPs per frame of a cold-start solve: one iteration (value, gradient, update), measured
  on `positions [N, J, 3]`, times `config.iters` (initialisation excluded). For L-BFGS the
  line search is a loop, so this counts one of its evaluations."""
  if decode is None:
    problem = _rotation_problem(rig, config)
    params0 = _rotation_init(positions, offsets, rig, config)
  else:
    problem = _latent_problem(decode, decode_params, rig, config)
    params0 = _latent_init(positions, offsets, rig, config, decode, latent_dim)
  opt = _optimizer(config, config.iters)

  def one_iteration(params0, positions, offsets):
    def one(p0, target, off):
      step = _make_step(_frame_loss_fn(problem, target, off, rig, config), opt, config)
      return step((p0, opt.init(p0)), None)[0][0]
    # in_axes: as `_solve_cold`.
    return jax.vmap(one, in_axes=(0, 0, 0 if offsets.ndim == 3 else None))(
        params0, positions, offsets)

  per_iter = flops_per_frame(one_iteration, params0, positions, offsets,
                             num_frames=positions.shape[0])
  return per_iter * config.iters
