"""Pose-prior (VPoser-style VAE) training config.

Command (a few minutes on the 2-core CPU):
  python -m experiments.train_prior --data=/tmp/cmu --workdir=runs/prior --steps=3000
Expected: val reconstruction of a few degrees; active latent dimensions and sample realism are
printed and written to WORKDIR/prior_report.json.
"""

import ml_collections

from experiments.configs import default
from ik_gat_jax.vposer import VAEConfig


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.model = VAEConfig().to_dict()
  c.prior_stats = ml_collections.ConfigDict()  # filled from the training split at start
  c.train.update(steps=3000, batch_size=256, lr=1e-3, warmup_steps=200, eval_every=500,
                 weight_decay=0.0)
  c.augment.update(yaw=False, mirror=0.5, bone_scale=0.0, noise_mm=0.0)
  return c
