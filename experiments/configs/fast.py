"""A cheaper IK-GAT for real time, fewer and wider layers (issue N item 3), distilled from the
shipped base model.

The shipped base's recipe (experiments/configs/distill.py: J's tracker noise model, heading
canonicalisation, observed-direction head with the learned blend, noise-level input; the
teacher's rotations as a second target, `loss.distill_weight` 1) with 2 blocks of width 192
instead of 3 of 320 (108K parameters, about distill.py's 3 blocks of 160, with fewer kernels per
frame): 3.0x the base's frames/s batched on 2 cores (two threads, sparse form), val 5.15 deg
against the base's 4.64 after this config's 15,000 steps (2-core CPU, about half an hour):
  python -m experiments.train --data=/tmp/cmu --workdir=runs/n_w192l2 \
      --config=experiments/configs/fast.py
Continued for 24,000 steps at half the peak rate (val 4.99; BENCHMARKS.md "Fewer, wider layers";
about an hour):
  python -m experiments.train --data=/tmp/cmu --workdir=runs/n_w192l2_long \
      --config=experiments/configs/fast.py --config.train.init_from=runs/n_w192l2 \
      --steps=24000 --config.train.lr=1e-3 --config.train.warmup_steps=300
then without dropout (val 4.79; about 50 minutes):
  python -m experiments.train --data=/tmp/cmu --workdir=runs/n_w192l2_nodrop \
      --config=experiments/configs/fast.py --config.train.init_from=runs/n_w192l2_long \
      --config.model.dropout=0.0 --steps=12000 --config.train.lr=5e-4 --config.train.warmup_steps=200
and at batch 512 (8,000 steps from runs/n_w192l2_nodrop, val 4.72) and then 1,024 (6,000 steps at
lr 4e-4, val 4.68; the opt-in checkpoints/ikgat_fast of sessions 23-26). Distilling it further
from the base's mirror-averaged solution (`--config.train.distill_mirror=True`, runs/manifest.json
n_w192l2_mirror) gained 0.02 deg on val and lost 0.07 on the unseen subject.

The shipped checkpoints/ikgat_fast (session 27) is this config at 3 blocks of 128 instead
(`--config.model.hidden=128 --config.model.num_layers=3`: 71K parameters, 3.2x the base's
frames/s) through the same chain, its no-dropout and batch-512 steps in one: val 5.14 after
15,000 steps, 4.90 after 24,000 more, 4.61 at batch 512, 4.57 at 1,024, at or under the base's
error clean and with noise (its card lists the four commands; runs/manifest.json n_w128l3*).
"""

from experiments.configs import distill


def get_config():
  c = distill.get_config()
  c.model.update(hidden=192, num_layers=2)
  c.train.update(steps=15000, eval_every=1000)
  return c
