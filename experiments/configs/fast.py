"""A cheaper IK-GAT for real time, fewer and wider layers (issue N item 3), distilled from the
shipped base model.

The shipped base's recipe (experiments/configs/distill.py: J's tracker noise model, heading
canonicalisation, observed-direction head with the learned blend, noise-level input; the
teacher's rotations as a second target, `loss.distill_weight` 1) with 2 blocks of width 192
instead of 3 of 320 (108K parameters, about distill.py's 3 blocks of 160, with fewer kernels per
frame): 3.0x the base's frames/s batched on 2 cores (two threads, sparse form), val 5.15 deg
against the base's 4.64; shipped opt-in as checkpoints/ikgat_fast (BENCHMARKS.md "Fewer, wider
layers"). Command (2-core CPU, about half an hour):
  python -m experiments.train --data=/tmp/cmu --workdir=runs/n_w192l2 \
      --config=experiments/configs/fast.py
"""

from experiments.configs import distill


def get_config():
  c = distill.get_config()
  c.model.update(hidden=192, num_layers=2)
  c.train.update(steps=15000, eval_every=1000)
  return c
