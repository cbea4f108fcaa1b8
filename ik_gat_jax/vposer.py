"""A VPoser-style VAE pose prior (DESIGN section 6): the model and its per-example loss.

`PosePrior` encodes the local rotations of all non-root joints (6D, standardised by a fixed input
mean and std) through `num_hidden` hidden layers of `hidden` units to a diagonal Gaussian over a
`latent`-dimensional z, and decodes z through as many layers back to 6D per non-root joint, then
to rotation matrices by Gram-Schmidt. No BatchNorm: the standardisation is fixed data (plain
Python tuples, static, never trained), computed once from the training split with
`standardization_stats` and stored with the checkpoint by the caller.

Chart (issue L, `VAEConfig.bone_chart`, on for new priors): the prior models each non-root local
rotation in the bone-frame chart `L_j = B_p^T R_j B_j` (`bone_frames.bone_chart`; `B` the
subject's rest bone frames), not as `R_j` itself. Re-rigging by binds A gives `R' = A_p^T R A_j`,
`B' = A^T B`, so `L' = L`: the same motion is the same training data, the same latent
distribution and the same decoder output on every rig, and `decode(z, B')` is exactly
`A_p^T decode(z, B) A_j`. The 6D of `R` is not (the 6D of `A_p^T R A_j` is another function of
the pose), so a joint-chart prior learns a bind-dependent distribution. `encode` and `decode`
therefore take `B` (`[..., J, 3, 3]`); a joint-chart prior (`bone_chart=False`: every prior
trained before issue L, whose saved config lacks the key) ignores it, bit for bit as before.

Choices written down:
- The decoder predicts standardised 6D: `out * std + mean`, so an untrained decoder already
  emits poses near the training mean.
- Hidden activation: SiLU by default, not VPoser's leaky ReLU. Iterative IK differentiates
  through the decoder, and a piecewise-linear decoder has kinks where gradient descent stalls:
  latent IK on targets decoded by a random decoder (latent 8, hidden 64, 10-17 deg poses, 300
  Adam iterations) ended at 4.2 mm MPJPE (frames up to 13 mm) with leaky ReLU and 0.1-0.2 mm
  with SiLU. `activation` selects.
  No dropout.
- `vae_loss` = `rot_weight * mean geodesic (rad, non-root joints)` + `pos_weight * mean FK
  position error (decimetres, non-root joints; true root rotation and position)` +
  `kl_weight * KL(q(z|x) || N(0, I))` (summed over latent dims), per example.
- `sample_realism` measures the distance between two poses as the mean over joints of the
  geodesic angle `arccos((tr(A^T B) - 1) / 2)`: the trace is a dot product of flattened
  matrices, so all sample x training pairs of a chunk are one matmul (no gradient is taken).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ik_gat_jax import bone_frames
from ik_gat_jax import kinematics
from ik_gat_jax import rotations
from ik_gat_jax.skeleton import Rig

_IDENTITY_6D = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)
_STD_FLOOR = 1e-2
_ACTIVATIONS = {'silu': jax.nn.silu, 'elu': jax.nn.elu, 'leaky_relu': jax.nn.leaky_relu}


@dataclasses.dataclass(frozen=True)
class VAEConfig:
  """Sizes and loss weights of the prior (frozen: hashable, a jit static argument).

  Attributes:
    latent: latent dimensions (VPoser: 32).
    hidden: width of each hidden layer.
    num_hidden: hidden layers on each side (encoder and decoder).
    kl_weight: weight of the KL term (summed over latent dims).
    rot_weight: weight of the mean geodesic reconstruction error (radians).
    pos_weight: weight of the mean FK position error in decimetres (DESIGN section 5).
    activation: hidden activation, 'silu', 'elu' or 'leaky_relu' (module docstring).
    bone_chart: model the bone-frame chart `L_j = B_p^T R_j B_j` instead of `R_j` (module
      docstring; rig-invariant). `from_dict` reads a missing key as False: the configs saved with
      the priors trained before it (checkpoints/prior) keep the joint chart.
  """
  latent: int = 32
  hidden: int = 512
  num_hidden: int = 2
  kl_weight: float = 5e-3
  rot_weight: float = 1.0
  pos_weight: float = 0.1
  activation: str = 'silu'
  bone_chart: bool = True

  def __post_init__(self):
    if self.activation not in _ACTIVATIONS:
      raise ValueError(f'activation must be one of {sorted(_ACTIVATIONS)}, got '
                       f'{self.activation!r}')

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> 'VAEConfig':
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
      raise ValueError(f'unknown VAEConfig fields {sorted(unknown)}')
    return cls(**{'bone_chart': False, **d})  # absent: a prior from before the bone chart


def standardization_stats(local_rot: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """Training rotations `[N, J, 3, 3]` in the prior's chart (`to_bone_chart` for a bone-chart
  prior, else the local rotations) -> (mean, std) of the non-root 6D, each a tuple of
  `6 * (J - 1)` floats (std floored at 0.01 so near-constant entries stay bounded)."""
  r = np.asarray(local_rot, np.float64)[:, 1:]
  x = np.concatenate([r[..., :, 0], r[..., :, 1]], axis=-1).reshape(r.shape[0], -1)
  std = np.maximum(x.std(axis=0), _STD_FLOOR)
  return tuple(float(v) for v in x.mean(axis=0)), tuple(float(v) for v in std)


def to_bone_chart(rot: jax.Array, B: jax.Array, parents: Sequence[int],
                  inverse: bool = False) -> jax.Array:
  """Non-root local rotations `[..., J-1, 3, 3]` (or `[..., J, 3, 3]`, root kept as it is) <->
  their bone-frame chart `L_j = B_p^T R_j B_j`; `B: [..., J, 3, 3]` rest bone frames, `parents`
  the rig's. `inverse`: L -> R."""
  parents = tuple(parents)
  J = len(parents)
  if rot.shape[-3] == J:
    return bone_frames.bone_chart(rot, B, parents, range(1, J), inverse)
  root = jnp.broadcast_to(jnp.eye(3, dtype=rot.dtype), rot.shape[:-3] + (1, 3, 3))
  full = jnp.concatenate([root, rot], axis=-3)
  return bone_frames.bone_chart(full, B, parents, range(1, J), inverse)[..., 1:, :, :]


def _mlp(sizes: Sequence[int], rngs: nnx.Rngs) -> nnx.List:
  return nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])


def _run_mlp(layers: nnx.List, x: jax.Array, activation: str) -> jax.Array:
  for layer in layers[:-1]:
    x = _ACTIVATIONS[activation](layer(x))
  return layers[-1](x)


class PosePrior(nnx.Module):
  """The VAE. `num_joints` counts the root; the model sees the `J - 1` non-root rotations.

  Attributes (static): `config`, `num_rotations = J - 1`, `parents` (the rig's, needed by the
  bone chart; `()` for a joint-chart prior built without them), `input_mean`, `input_std`
  (tuples of `6 * (J - 1)` floats in the prior's chart; default: identity rotations and unit
  std).
  """

  def __init__(self, config: VAEConfig, num_joints: int, *,
               parents: Sequence[int] | None = None,
               input_mean: Sequence[float] | None = None,
               input_std: Sequence[float] | None = None, rngs: nnx.Rngs):
    D = 6 * (num_joints - 1)
    self.config = config
    self.num_rotations = num_joints - 1
    self.parents = tuple(int(p) for p in parents) if parents is not None else ()
    if config.bone_chart and len(self.parents) != num_joints:
      raise ValueError(f'a bone-chart prior (VAEConfig.bone_chart) needs the rig\'s {num_joints} '
                       f'parents: PosePrior(..., parents=rig.parents), got {len(self.parents)}')
    self.input_mean = tuple(float(v) for v in (input_mean if input_mean is not None
                                              else _IDENTITY_6D * (num_joints - 1)))
    self.input_std = tuple(float(v) for v in (input_std if input_std is not None else (1.0,) * D))
    if len(self.input_mean) != D or len(self.input_std) != D:
      raise ValueError(f'input_mean/std need {D} entries, got {len(self.input_mean)}, '
                       f'{len(self.input_std)}')
    hidden = [config.hidden] * config.num_hidden
    self.encoder = _mlp([D] + hidden + [2 * config.latent], rngs)
    self.decoder = _mlp([config.latent] + hidden + [D], rngs)

  def _non_root(self, local_rot: jax.Array) -> jax.Array:
    n = local_rot.shape[-3]
    if n == self.num_rotations + 1:
      return local_rot[..., 1:, :, :]
    if n != self.num_rotations:
      raise ValueError(f'expected {self.num_rotations + 1} (or {self.num_rotations} non-root) '
                       f'rotations, got {n}')
    return local_rot

  def _frames(self, B: jax.Array | None) -> jax.Array:
    if B is None:
      raise ValueError("this prior works in the bone-frame chart (VAEConfig.bone_chart): pass "
                       "the subject's rest bone frames B [..., J, 3, 3] (bone_frames.bone_frames)")
    return B

  def to_chart(self, local_rot: jax.Array, B: jax.Array | None = None) -> jax.Array:
    """Local rotations `[..., J, 3, 3]` (root dropped) or `[..., J-1, 3, 3]` -> the non-root
    rotations the prior models, `[..., J-1, 3, 3]`: `L_j = B_p^T R_j B_j` for a bone-chart
    prior (`B: [..., J, 3, 3]`), else `R_j` (B ignored)."""
    rot = self._non_root(local_rot)
    if not self.config.bone_chart:
      return rot
    return to_bone_chart(rot, self._frames(B).astype(rot.dtype), self.parents)

  def from_chart(self, rot: jax.Array, B: jax.Array | None = None) -> jax.Array:
    """The inverse of `to_chart`: `[..., J-1, 3, 3]` -> non-root local rotations."""
    if not self.config.bone_chart:
      return rot
    return to_bone_chart(rot, self._frames(B).astype(rot.dtype), self.parents, inverse=True)

  def encode(self, local_rot: jax.Array, B: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array]:
    """`local_rot: [..., J, 3, 3]` (root ignored) or `[..., J-1, 3, 3]`, the subject's rest
    bone frames `B: [..., J, 3, 3]` (bone-chart priors) -> `(mu, logvar)`, each
    `[..., latent]`."""
    x = rotations.sixd_from_matrix(self.to_chart(local_rot, B))
    x = x.reshape(x.shape[:-2] + (-1,))
    x = (x - jnp.asarray(self.input_mean)) / jnp.asarray(self.input_std)
    mu, logvar = jnp.split(_run_mlp(self.encoder, x, self.config.activation), 2, axis=-1)
    return mu, logvar

  def decode_chart(self, z: jax.Array) -> jax.Array:
    """`z: [..., latent]` -> the non-root rotations in the prior's chart `[..., J-1, 3, 3]`
    (`L` for a bone-chart prior: the same on every rig; else local rotations)."""
    x = _run_mlp(self.decoder, z, self.config.activation)
    x = x * jnp.asarray(self.input_std) + jnp.asarray(self.input_mean)
    return rotations.matrix_from_sixd(x.reshape(x.shape[:-1] + (self.num_rotations, 6)))

  def decode(self, z: jax.Array, B: jax.Array | None = None) -> jax.Array:
    """`z: [..., latent]`, rest bone frames `B: [..., J, 3, 3]` (bone-chart priors; ignored
    otherwise) -> non-root local rotations `[..., J-1, 3, 3]` of that subject."""
    return self.from_chart(self.decode_chart(z), B)

  def __call__(self, local_rot: jax.Array, key: jax.Array, B: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reparameterised reconstruction: -> `(recon [..., J-1, 3, 3], mu, logvar [..., latent])`;
    `B` as in `encode`."""
    mu, logvar = self.encode(local_rot, B)
    z = mu + jnp.exp(0.5 * logvar) * jax.random.normal(key, mu.shape, mu.dtype)
    return self.decode(z, B), mu, logvar


@dataclasses.dataclass(frozen=True)
class DecoderFn:
  """`decode(state, z, B) -> [J-1, 3, 3]` non-root local rotations of the subject with rest bone
  frames `B [J, 3, 3]`, for `iterative_ik.solve_latent*`: hashable (static), with the weights
  passed as the traced `state`. `bone_chart`: the prior's chart (the latent solver puts the root
  in the same chart). `encode(state, local, B) -> z` (the encoder's mean) and `decode` make it
  the refinement's `iterative_ik.PosePrior` too."""
  graphdef: Any
  bone_chart: bool = False

  def __call__(self, state: nnx.State, z: jax.Array, B: jax.Array) -> jax.Array:
    return self.decode(state, z, B)

  def decode(self, state: nnx.State, z: jax.Array, B: jax.Array) -> jax.Array:
    return nnx.merge(self.graphdef, state).decode(z, B)

  def encode(self, state: nnx.State, local_rot: jax.Array, B: jax.Array) -> jax.Array:
    return nnx.merge(self.graphdef, state).encode(local_rot, B)[0]


def decoder(model: PosePrior) -> tuple[DecoderFn, nnx.State]:
  """`(decode, decode_params)` for the iterative solvers."""
  graphdef, state = nnx.split(model)
  return DecoderFn(graphdef, model.config.bone_chart), state


# ----------------------------------------------------------------------------------------------
# Loss and diagnostics.


def kl_per_dim(mu: jax.Array, logvar: jax.Array) -> jax.Array:
  """`KL(N(mu, exp(logvar)) || N(0, 1))` per latent dimension, `[..., latent]`."""
  return 0.5 * (jnp.exp(logvar) + mu**2 - 1.0 - logvar)


def vae_loss(model: PosePrior, batch: dict[str, jax.Array], key: jax.Array, config: VAEConfig,
             rig: Rig) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-example VAE loss.

  Args:
    model: the prior.
    batch: 'local_rot' `[B, J, 3, 3]`, 'offsets' `[B, J, 3]`, 'positions' `[B, J, 3]` (metres),
      'bone_frames' `[B, J, 3, 3]` (needed by a bone-chart prior).
    key: PRNG key for the reparameterisation.
    config: loss weights.
    rig: static rig (parents).

  Returns:
    `(loss [B], aux)` with aux 'recon_geodesic' (rad), 'pos_err_dm', 'kl', each `[B]`.
  """
  true_local = batch['local_rot']
  recon, mu, logvar = model(true_local, key, batch.get('bone_frames'))
  geodesic = jnp.mean(rotations.geodesic_angle(recon, true_local[..., 1:, :, :]), axis=-1)
  local_hat = jnp.concatenate([true_local[..., :1, :, :], recon], axis=-3)
  _, p_hat = kinematics.forward_kinematics(local_hat, batch['offsets'], rig.parents,
                                           root_pos=batch['positions'][..., 0, :])
  err = rotations.safe_norm(p_hat - batch['positions'])[..., 1:]
  pos_dm = 10.0 * jnp.mean(err, axis=-1)
  kl = jnp.sum(kl_per_dim(mu, logvar), axis=-1)
  loss = config.rot_weight * geodesic + config.pos_weight * pos_dm + config.kl_weight * kl
  return loss, {'recon_geodesic': geodesic, 'pos_err_dm': pos_dm, 'kl': kl}


def active_dims(mu_all: jax.Array, logvar_all: jax.Array, threshold: float = 0.01) -> jax.Array:
  """Number of latent dimensions whose KL, averaged over examples `[N, latent]`, exceeds
  `threshold` (DESIGN section 6)."""
  return jnp.sum(jnp.mean(kl_per_dim(mu_all, logvar_all), axis=0) > threshold)


@functools.partial(jax.jit, static_argnames='chunk')
def _nearest_mean_geodesic(samples: jax.Array, train: jax.Array, chunk: int) -> jax.Array:
  """`samples [S, K, 3, 3]`, `train [N, K, 3, 3]` -> `[S]` min over training poses of the mean
  over K joints of the geodesic angle (radians). Training poses go in chunks of `chunk` (the
  last padded with copies of the first pose, which cannot lower a minimum)."""
  S, K = samples.shape[:2]
  N = train.shape[0]
  pad = -N % chunk
  train = jnp.concatenate([train, jnp.broadcast_to(train[:1], (pad,) + train.shape[1:])])
  a = samples.reshape(S, K, 9)

  def body(best, t):  # t: [chunk, K, 9]
    cos = 0.5 * (jnp.einsum('skd,tkd->stk', a, t) - 1.0)
    dist = jnp.mean(jnp.arccos(jnp.clip(cos, -1.0, 1.0)), axis=-1)
    return jnp.minimum(best, jnp.min(dist, axis=1)), None

  best, _ = jax.lax.scan(body, jnp.full((S,), jnp.inf, a.dtype),
                         train.reshape(-1, chunk, K, 9))
  return best


def sample_realism(model: PosePrior, key: jax.Array, train_poses: jax.Array, n: int = 1000,
                   chunk: int = 1024) -> float:
  """Mean over `n` samples (z ~ N(0, I)) of the distance, in degrees, to the nearest training
  pose: the mean over non-root joints of the geodesic angle, in the prior's chart (no subject
  needed). `train_poses: [N, J, 3, 3]` (root ignored) or `[N, J-1, 3, 3]`, in that chart
  (`model.to_chart`)."""
  samples = model.decode_chart(jax.random.normal(key, (n, model.config.latent)))
  train = model._non_root(jnp.asarray(train_poses, samples.dtype))
  best = _nearest_mean_geodesic(samples, train, min(chunk, train.shape[0]))
  return float(jnp.degrees(jnp.mean(best)))
