"""Benchmark: FK as an unrolled per-joint loop vs per-depth gathers, forward and with gradients.

  python -m experiments.bench_fk [--batch=16384] [--repeats=20]

Prints medians (ms) and frames/s of both forms on the cmu_body rig; the faster one is
`kinematics.forward_kinematics` (BENCHMARKS.md quotes a run).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from ik_gat_jax import kinematics, rotations, skeleton

_BATCH = flags.DEFINE_integer('batch', 16384, 'Frames per call.')
_REPEATS = flags.DEFINE_integer('repeats', 20, 'Timed calls per variant.')


def _median_ms(fn, *args) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(_REPEATS.value):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return 1000 * float(np.median(times))


def main(argv):
  del argv
  rig = skeleton.cmu_body()
  n = _BATCH.value
  key = jax.random.key(0)
  sixd = jax.random.normal(key, (n, rig.num_joints, 6))
  off = jnp.asarray(rig.template(), jnp.float32)
  forms = {'loop': kinematics.forward_kinematics,
           'depth': kinematics.forward_kinematics_by_depth}
  print(f'FK on {rig.name} ({rig.num_joints} joints), batch {n}, backend {jax.default_backend()}')
  for name, fk in forms.items():
    fwd = jax.jit(lambda x: fk(rotations.matrix_from_sixd(x), off, rig.parents)[1])
    grad = jax.jit(jax.grad(lambda x: jnp.sum(fk(rotations.matrix_from_sixd(x), off,
                                                 rig.parents)[1] ** 2)))
    f_ms, g_ms = _median_ms(fwd, sixd), _median_ms(grad, sixd)
    print(f'{name:6s} forward {f_ms:8.2f} ms ({n / f_ms * 1e3:,.0f} frames/s)   '
          f'forward+grad {g_ms:8.2f} ms ({n / g_ms * 1e3:,.0f} frames/s)')


if __name__ == '__main__':
  app.run(main)
