"""The causal temporal IK-GAT (issue K): J's robust per-frame recipe with an input window.

The network sees the current frame and the 7 before it (window 8 at 30 fps: 0.27 s,
ik_gat_jax/windows.py) and outputs the current frame's rotations. Training noise: J's tracker
noise model (per-sample level U[0, 50] mm, 20% clean samples, bone-length jitter, outliers),
each frame of a window its own draw at the window's level, plus the time-correlated parts of
input_pipeline.temporal_noise: a drift (per-joint offset constant over the window, level
U[0, 10] mm), a joint held at its last position for 1-7 frames (5% of windows) and stream
starts (10% of windows). Command (base size, 2-core CPU: about 25-40 minutes):
  python -m experiments.train --data=/tmp/cmu --workdir=runs/k_temporal \
      --config=experiments/configs/temporal.py
"""

from experiments.configs import default


def get_config():
  c = default.get_config()
  c.model.update(heading_canonicalization=True, observed_direction_head=True,
                 observed_direction_blend=True, noise_level_input=True, window=8,
                 window_fps=30.0)
  c.augment.update(yaw=False, noise_mm_max=50.0, clean_frac=0.2, bone_jitter=0.02,
                   outlier_prob=0.05, bias_mm=10.0, hold_prob=0.05, window_start_prob=0.1)
  return c
