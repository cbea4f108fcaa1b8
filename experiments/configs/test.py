"""Tiny config for the end-to-end tests: a few steps of the tiny model.

Command (seconds): python -m experiments.train --data=DIR --workdir=/tmp/t \
    --config=experiments/configs/test.py
Expected: runs, logs, checkpoints; the loss falls (it does not converge in so few steps).
"""

from experiments.configs import default


def get_config():
  c = default.get_config()
  c.model.update(size='tiny', output_space='bone_aligned')
  c.train.update(steps=20, batch_size=32, lr=1e-3, warmup_steps=5, log_every=5, eval_every=10,
                 checkpoint_every=10, val_frames=256, eval_batch_size=256)
  return c
