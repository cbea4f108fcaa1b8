"""Benchmark: FK as an unrolled per-joint loop vs per-depth gathers, forward and with gradients.

  python -m experiments.bench_fk [--batch=16384] [--repeats=20]

Prints medians (ms) and frames/s of both forms on the cmu_body rig; the faster one is
`kinematics.forward_kinematics` (BENCHMARKS.md quotes a run).
"""

from typing import Sequence
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments.common import run_main
from ik_gat_jax import kinematics, rotations, skeleton


def depth_groups(parents: Sequence[int]) -> tuple[tuple[int, ...], ...]:
  """Joints grouped by tree depth (root first): the per-depth FK's schedule."""
  depth = []
  for p in parents:
    depth.append(0 if p < 0 else depth[p] + 1)
  return tuple(tuple(j for j, d in enumerate(depth) if d == k) for k in range(max(depth) + 1))


def forward_kinematics_by_depth(local_rot: jax.Array, offsets: jax.Array,
                                parents: Sequence[int],
                                root_pos: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Same result as `forward_kinematics`, one gather + batched matmul per tree depth.

  The rejected form: this benchmark chose the loop (`kinematics.forward_kinematics`); it lives
  here, beside the measurement, not in the library.
  """
  batch = jnp.broadcast_shapes(local_rot.shape[:-3], offsets.shape[:-2])
  J = len(parents)
  G = jnp.broadcast_to(local_rot, batch + (J, 3, 3))
  off = jnp.broadcast_to(offsets, batch + (J, 3))
  root = off[..., 0, :] if root_pos is None else jnp.broadcast_to(root_pos, batch + (3,))
  p = jnp.zeros(batch + (J, 3), G.dtype).at[..., 0, :].set(root)
  for group in depth_groups(parents)[1:]:
    g = np.asarray(group)
    par = np.asarray([parents[j] for j in group])
    Gp = G[..., par, :, :]
    p = p.at[..., g, :].set(p[..., par, :] + jnp.einsum('...ab,...b->...a', Gp, off[..., g, :]))
    G = G.at[..., g, :, :].set(Gp @ G[..., g, :, :])
  return G, p


_BATCH = _REPEATS = None  # set by define_flags()


def define_flags() -> None:
  """The main's flags, defined only when it runs (tests import its FK variants)."""
  global _BATCH, _REPEATS
  _BATCH = flags.DEFINE_integer('batch', 16384, 'Frames per call.', lower_bound=1)
  _REPEATS = flags.DEFINE_integer('repeats', 20, 'Timed calls per variant.', lower_bound=1)


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
           'depth': forward_kinematics_by_depth}
  print(f'FK on {rig.name} ({rig.num_joints} joints), batch {n}, backend {jax.default_backend()}')
  for name, fk in forms.items():
    fwd = jax.jit(lambda x: fk(rotations.matrix_from_sixd(x), off, rig.parents)[1])
    grad = jax.jit(jax.grad(lambda x: jnp.sum(fk(rotations.matrix_from_sixd(x), off,
                                                 rig.parents)[1] ** 2)))
    f_ms, g_ms = _median_ms(fwd, sixd), _median_ms(grad, sixd)
    print(f'{name:6s} forward {f_ms:8.2f} ms ({n / f_ms * 1e3:,.0f} frames/s)   '
          f'forward+grad {g_ms:8.2f} ms ({n / g_ms * 1e3:,.0f} frames/s)')


if __name__ == '__main__':
  define_flags()
  run_main(main)
