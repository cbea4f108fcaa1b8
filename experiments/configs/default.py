"""Default IK-GAT training config (base size, CMU shards).

The base recipe. The model shipped before issue J (checkpoints/ikgat_base_v1) is this config
with `--config.model.bone_chart=False`; command (about 20-33 minutes on the 2-core CPU for
5,000 steps of batch 256 at base size, depending on what else runs):
  python -m data_prep.bvh_to_shards --input=../shared/data/cmu --rig=cmu_body --output=/tmp/cmu
  python -m experiments.train --data=/tmp/cmu --workdir=runs/base --size=base --steps=5000
Expected: val local-rotation error 6.2 deg after 20 minutes and 5.8 at the end, below both
floors of DESIGN section 6 (swing-only IK 15.6, mean pose 21.6; BENCHMARKS.md). The shipped
model (checkpoints/ikgat_base, issue J) adds the tracker noise model and the robust model
options as flags; its card has the commands.
"""

import ml_collections
from ml_collections import config_dict

from ik_gat_jax.model import ModelConfig


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.data = ''  # shard directory (from --data)
  # Mixed output: bone-aligned Q for joints with a designated child, local R for the leaves.
  # bone_chart (issue L): the leaves' local outputs in the rest-bone-frame chart, the same on
  # every rig whatever its bind (model.to_local); models trained before it lack the key (off).
  c.model = ModelConfig(size='base', output_space='mixed', bone_chart=True).to_dict()
  # tilt_limit_deg and tilt_side_limit_deg (sessions 44, 45): None = the heading models'
  # defaults (model.TILT_LIMIT_DEG, 45, leaning forward or back; model.TILT_SIDE_LIMIT_DEG, 15,
  # sideways), as in every older checkpoint; float placeholders so that
  # --config.model.tilt_limit_deg=30 (0 = off) or --config.model.tilt_side_limit_deg=20 can set
  # them.
  c.model.tilt_limit_deg = config_dict.placeholder(float)
  c.model.tilt_side_limit_deg = config_dict.placeholder(float)
  # The size's fields, None = from --size (model.SIZES): int placeholders, so that
  # --config.model.num_layers=3 (or hidden, num_heads, head_hidden) can set them.
  for field in ('hidden', 'num_layers', 'num_heads', 'head_hidden'):
    if c.model[field] is None:
      c.model[field] = config_dict.placeholder(int)
  c.train = ml_collections.ConfigDict(dict(
      steps=5_000, batch_size=256, lr=2e-3, final_lr_fraction=0.01, warmup_steps=300,
      weight_decay=1e-4, clip_norm=1.0, log_every=100, eval_every=500,
      checkpoint_every=500, val_frames=4096, eval_batch_size=1024, prefetch=2,
      # A trained run or checkpoint to start from (train.warm_start_params: matching
      # parameters copied, grown ones zero-padded); '' = a fresh initialisation.
      init_from='',
      # A trained model to distil from (train.load_teacher: same rig, output space and
      # inputs, any size); '' = none. The loss adds loss.distill_weight x the mean angle
      # between the model's output and the teacher's on the same augmented input.
      distill_from='',
      # Distil from the teacher's mirror-averaged solution (inference.teacher_target: its own
      # and its mirror image's, mapped back, at their midpoint; a rig symmetric in its
      # reference pose only); absent in older runs' configs = off.
      distill_mirror=False,
      # Exponential moving average of the parameters (train.ema_update; 0 = off, absent in
      # older runs' configs = off): validation, the `best` checkpoint and so every model loaded
      # from the run use the average; `latest` keeps both for resuming.
      ema_decay=0.0))
  # velocity_weight (issue K, window models; 0 = off): each sample is two consecutive windows
  # and the loss adds this x the mean angle between the predicted and the true frame-to-frame
  # change of the local rotations (losses.velocity_loss: a jitter penalty).
  c.loss = ml_collections.ConfigDict(dict(alpha=0.1, distill_weight=1.0, velocity_weight=0.0))
  c.augment = ml_collections.ConfigDict(dict(yaw=True, mirror=0.5, bone_scale=0.07,
                                             noise_mm=0.0))
  # tilt_deg (session 44; 0 = off, absent in older checkpoints' configs = off): every sample
  # turned by U[0, tilt_deg] degrees about a random horizontal axis, for a model that meets
  # bodies leaning or lying (a heading model turns bodies tilted past its
  # model.tilt_limit_deg back to it).
  c.augment.update(tilt_deg=0.0)
  # Sparse inputs (G2; 0 = off; input_pipeline.sample_input_masks): per-frame joint dropout
  # rate U[0, p], probability of a named tracker subset, probability an orientation is given,
  # probability a frame keeps every joint.
  c.augment.update(joint_dropout=0.0, tracker_subsets=0.0, orientation_prob=0.0, full_frames=0.0)
  # End sites (G2; needs shards with end sites and config.model.end_sites): probability each
  # leaf's end-site point is given, per frame.
  c.augment.update(end_site_prob=0.0)
  # Tracker noise (issue J; input_pipeline.tracker_noise; 0 = off, and absent in old
  # checkpoints' configs = off), on the inputs only, never the targets: per-sample Gaussian
  # sigma ~ U[0, noise_mm_max] mm; share of samples left exactly clean by these parts;
  # per-frame relative std of every bone's length; probability per sample that one random
  # joint jumps by U[50, 200] mm. noise_mm above is added on top, to every sample.
  # The 'robust' ablation rows use noise_mm_max=50, clean_frac=0.2, bone_jitter=0.02,
  # outlier_prob=0.05.
  c.augment.update(noise_mm_max=0.0, clean_frac=0.0, bone_jitter=0.0, outlier_prob=0.0)
  # Time-correlated tracker errors for window models (issue K, config.model.window > 1;
  # input_pipeline.temporal_noise; 0 = off): per-sample level U[0, bias_mm] of a per-joint
  # offset constant over the window (drift); probability a sample holds one joint at its last
  # good position for the last 1..k-1 frames (dropout); probability a window starts a stream
  # (older frames copies of the oldest kept). experiments/configs/temporal.py sets them.
  c.augment.update(bias_mm=0.0, hold_prob=0.0, window_start_prob=0.0)
  # Causal temporal filter of the output rotations (issue G3, ik_gat_jax/temporal.py), saved in
  # the checkpoint: IKSolver / ik_gat_jax.solve / experiments.evaluate use it unless a --filter
  # flag overrides; validation logs the filtered error and jitter. Off: on clean CMU input IK-GAT
  # already jitters less than the ground truth (val ratio 0.73) and every filter raises the
  # error. The parameters are the val choice for noisy trackers (10 mm; docs/benchmarks/temporal.md).
  c.temporal = ml_collections.ConfigDict(dict(filter='none', min_cutoff=1.5, beta=0.5,
                                              d_cutoff=1.0))
  return c
