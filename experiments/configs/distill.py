"""A cheaper IK-GAT for real time, distilled from the shipped base model (issue N item 3).

J's robust per-frame recipe (tracker noise model, heading canonicalisation, observed-direction
head with the learned blend, noise-level input; checkpoints/ikgat_base/README.md) at hidden
width 160 instead of 320 (3 blocks, 4 heads; 105K parameters, 4.4 MFLOP per frame against
15.8), trained on the ground truth plus the shipped model's output on the same augmented
inputs (`train.distill_from`, `loss.distill_weight` 1: the mean angle to the teacher's
rotations). Command (2-core CPU, about an hour for 6,000 steps):
  python -m experiments.train --data=/tmp/cmu --workdir=runs/n_distill160 \
      --config=experiments/configs/distill.py
"""

from experiments.configs import robust


def get_config():
  c = robust.get_config()
  c.model.update(size='base', hidden=160)
  c.train.update(steps=6000, distill_from='checkpoints/ikgat_base')
  c.loss.update(distill_weight=1.0)
  return c
