"""Issue J's robust per-frame recipe, the shipped base model's (checkpoints/ikgat_base/README.md)
and `experiments.train_rig`'s default (session 45): the default config plus heading
canonicalisation instead of yaw augmentation (with the tilt limits, `model.tilt_rotation`), the
observed-direction head with its learned blend, the noise-level input, and the tracker noise
model (per-sample Gaussian sigma ~ U[0, 50] mm, a fifth of the samples clean, 2% bone-length
jitter, an outlier joint in 5% of the samples). The shipped base is this at size base for
10,000 steps (its card's command spells the same config out in flags on default.py):
  python -m experiments.train --data=/tmp/cmu --workdir=runs/my_base \
      --config=experiments/configs/robust.py --size=base --steps=10000
"""

from experiments.configs import default


def get_config():
  c = default.get_config()
  c.model.update(heading_canonicalization=True, observed_direction_head=True,
                 observed_direction_blend=True, noise_level_input=True)
  c.augment.update(yaw=False, noise_mm_max=50.0, clean_frac=0.2, bone_jitter=0.02,
                   outlier_prob=0.05)
  return c
