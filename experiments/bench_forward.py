"""The jitted IK-GAT network alone: positions -> local rotations, at a few batch sizes.

  python -m experiments.bench_forward [--checkpoint=DIR] [--batches=1,64,256] [--calls=2000]
  taskset -c 0 python -m experiments.bench_forward        # pinned to one core

Prints median and p99 milliseconds per call and frames/s (compiled; every call waited on with
`block_until_ready`). No input checks or host conversions: the floor under `IKSolver.step`.
"""

import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import fail_on_user_error
from ik_gat_jax import bone_frames, inference

_CKPT = flags.DEFINE_string('checkpoint', None, 'IK-GAT run or checkpoint (default: shipped).')
_BATCHES = flags.DEFINE_list('batches', ['1', '64', '256'], 'Batch sizes.')
_CALLS = flags.DEFINE_integer('calls', 2000, 'Timed calls per batch size (batch 1; fewer for '
                              'larger batches).')


@fail_on_user_error
def main(argv):
  del argv
  model, _ = inference.load_model(_CKPT.value or inference.SHIPPED_IKGAT)
  rig = model.rig
  B = bone_frames.bone_frames(jnp.asarray(rig.template(), jnp.float32), rig)[None]
  forward = jax.jit(lambda p: inference.ikgat_infer(model, {'positions': p, 'bone_frames': B}))
  rng = np.random.default_rng(0)
  print(f'IK-GAT ({model.config.size}) forward + local rotations, {jax.default_backend()}, '
        f'{len(jax.devices())} device(s)')
  for b in (int(x) for x in _BATCHES.value):
    p = jnp.asarray(rig.template().cumsum(0)[None] + 0.05 * rng.normal(size=(b, rig.num_joints,
                                                                             3)), jnp.float32)
    jax.block_until_ready(forward(p))
    times = []
    for _ in range(max(_CALLS.value // b, 20)):
      t = time.perf_counter()
      jax.block_until_ready(forward(p))
      times.append(time.perf_counter() - t)
    ms = 1000 * np.asarray(times)
    print(f'batch {b:5d}: median {np.median(ms):.3f} ms, p99 {np.percentile(ms, 99):.3f} ms, '
          f'{b / np.median(ms) * 1000:,.0f} frames/s')


if __name__ == '__main__':
  app.run(main)
