"""Default IK-GAT training config (base size, CMU shards).

Command (about 20 minutes on the 2-core CPU for 4,000 steps of batch 256 at base size):
  python -m data_prep.bvh_to_shards --input=../shared/data/cmu --rig=cmu_body --output=/tmp/cmu
  python -m experiments.train --data=/tmp/cmu --workdir=/tmp/run --size=base --steps=4000
Expected: val local-rotation error below both floors of DESIGN section 6 (mean pose and
swing-only IK); see WORKSPACE.md for the measured numbers of the last such run.
"""

import ml_collections

from ik_gat_jax.model import ModelConfig


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.data = ''  # shard directory (from --data)
  c.model = ModelConfig(size='base').to_dict()
  c.train = ml_collections.ConfigDict(dict(
      steps=20_000, batch_size=256, lr=1e-3, final_lr_fraction=0.01, warmup_steps=500,
      weight_decay=1e-4, clip_norm=1.0, log_every=100, eval_every=1000,
      checkpoint_every=500, val_frames=4096, eval_batch_size=1024, prefetch=2))
  c.loss = ml_collections.ConfigDict(dict(alpha=0.1))
  c.augment = ml_collections.ConfigDict(dict(yaw=True, mirror=0.5, bone_scale=0.07,
                                             noise_mm=0.0))
  return c
