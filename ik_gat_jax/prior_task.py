"""The VPoser-style pose prior as an `inference.Task`: the same trainer, its own model, loss,
metrics.

The prior's input standardisation (fixed, not trained: DESIGN section 6) is part of the model's
definition, so it lives in the config (`config.prior_stats`, computed from the training split by
`standardization_config`) and a checkpoint rebuilds the identical model without the data. The
statistics are of the prior's chart (`vposer.VAEConfig.bone_chart`: the bone-frame chart for new
priors, local rotations for those trained before it) and say which (`bone_chart`, absent =
False); a model whose chart differs from its statistics' is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ik_gat_jax import inference
from ik_gat_jax import input_pipeline
from ik_gat_jax import vposer
from ik_gat_jax.skeleton import Rig


_CHARTS = {True: 'bone-frame chart', False: 'local rotations'}


def chart_rotations(data, idx: np.ndarray, bone_chart: bool) -> np.ndarray:
  """Frames `idx` of a split in a prior's chart, `[n, J, 3, 3]` float32 (the root's local
  rotation kept): the bone-frame chart of the non-root joints (each frame with its subject's
  rest bone frames), or the stored local rotations."""
  local = np.asarray(data.local_rot[idx], np.float32)
  if not bone_chart:
    return local
  B = np.asarray(data.bone_frames, np.float64)[np.asarray(data.subject_id[idx])]
  with jax.enable_x64(True):
    L = vposer.to_bone_chart(jnp.asarray(local, jnp.float64), jnp.asarray(B), data.rig.parents)
    return np.asarray(L, np.float32)


def standardization_config(train_data, bone_chart: bool = True, max_frames: int = 50_000) -> dict:
  """`{'mean': [...], 'std': [...], 'bone_chart': bool}` of the non-root 6D rotations of (a
  subset of) the split, in the chart of a prior with `VAEConfig.bone_chart = bone_chart`."""
  idx = inference.eval_indices(len(train_data.local_rot), max_frames)
  mean, std = vposer.standardization_stats(chart_rotations(train_data, idx, bone_chart))
  return {'mean': list(mean), 'std': list(std), 'bone_chart': bool(bone_chart)}


def _build(config, rig: Rig, rngs, train_data):
  vae = vposer.VAEConfig.from_dict(config.model)
  stats = config.get('prior_stats')
  if not stats and train_data is not None:
    stats = standardization_config(train_data, vae.bone_chart)
  if stats and bool(stats.get('bone_chart', False)) != vae.bone_chart:
    raise ValueError(f"prior_stats are of the {_CHARTS[bool(stats.get('bone_chart', False))]} "
                     f'but model.bone_chart={vae.bone_chart}: recompute them with '
                     f'standardization_config(train_data, bone_chart={vae.bone_chart})')
  return vposer.PosePrior(vae, rig.num_joints, parents=rig.parents,
                          input_mean=stats['mean'] if stats else None,
                          input_std=stats['std'] if stats else None, rngs=rngs)



def _loss(model, batch, key, config, rig):
  k_aug, k_vae = jax.random.split(key)
  batch = input_pipeline.augment(batch, k_aug, config.augment, rig)
  return vposer.vae_loss(model, batch, k_vae, model.config, rig)


def reconstruct(model: vposer.PosePrior, batch: dict, config=None, rig=None) -> jax.Array:
  """Deterministic reconstruction through the mean latent (batch: local_rot, bone_frames); the
  root rotation from the truth."""
  del config, rig
  B = batch.get('bone_frames')
  mu, _ = model.encode(batch['local_rot'], B)
  return jnp.concatenate([batch['local_rot'][..., :1, :, :], model.decode(mu, B)], axis=-3)


def _validate(predict, data, config, rig: Rig) -> dict:
  """Reconstruction errors (deg, mm) of the val split, with the metrics module."""
  return inference.validate_local_rotations(predict, data, config, rig)


PRIOR_TASK = inference.Task(name='pose_prior', build=_build, loss=_loss, infer=reconstruct,
                        validate=_validate, best_metric='local_rot_err_deg')


def latent_statistics(model: vposer.PosePrior, data, max_frames: int = 8192,
                      chunk: int = 2048) -> dict:
  """Active latent dimensions (KL per dimension > 0.01) and mean KL over `data`."""
  idx = inference.eval_indices(len(data.local_rot), max_frames)
  rot = np.asarray(data.local_rot[idx], np.float32)
  B = np.asarray(data.bone_frames, np.float32)[np.asarray(data.subject_id[idx])]
  encode = jax.jit(model.encode)
  mus, logvars = zip(*(encode(rot[i:i + chunk], B[i:i + chunk])
                       for i in range(0, len(rot), chunk)))
  mu, logvar = jnp.concatenate(mus), jnp.concatenate(logvars)
  kl = np.asarray(jnp.mean(vposer.kl_per_dim(mu, logvar), axis=0))
  return {'active_dims': int(vposer.active_dims(mu, logvar)), 'latent': int(mu.shape[-1]),
          'kl_per_dim': [float(x) for x in kl]}


def evaluate_prior(model: vposer.PosePrior, train_data, val_data, rig: Rig, config,
                   seed: int = 0) -> dict:
  """What issue C asks to report: val reconstruction (deg, mm), active dimensions, and sample
  realism (mean geodesic distance, degrees, from 1,000 samples to their nearest training pose,
  next to the same for val poses; both in the prior's chart)."""
  predict = jax.jit(lambda b: reconstruct(model, b))
  recon = _validate(predict, val_data, config, rig)
  idx = inference.eval_indices(len(train_data.local_rot), 8192)
  chart = model.config.bone_chart
  train_poses = jnp.asarray(chart_rotations(train_data, idx, chart)[:, 1:])
  vidx = inference.eval_indices(len(val_data.local_rot), 1000)
  val_poses = jnp.asarray(chart_rotations(val_data, vidx, chart)[:, 1:])
  realism = vposer.sample_realism(model, jax.random.key(seed), train_poses, n=1000)
  val_ref = jnp.degrees(jnp.mean(vposer._nearest_mean_geodesic(  # pylint: disable=protected-access
      val_poses, train_poses, 1024)))
  return {'val_reconstruction': recon, **latent_statistics(model, val_data),
          'sample_to_nearest_train_deg': float(realism),
          'val_to_nearest_train_deg': float(val_ref)}
