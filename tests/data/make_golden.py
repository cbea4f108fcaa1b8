"""Regenerates tests/data/shipped_golden_g2.npz: the shipped IK-GAT's output on 4 synthetic poses,
computed with the code of a named commit (default: d702572, the first commit whose code reads the
shipped robust model of issue J), so the test proves that later code leaves existing models
unchanged.

    python tests/data/make_golden.py [--commit=SHA] [--checkpoint=checkpoints/ikgat_base]

The named commit is checked out in a temporary `git worktree`; this script runs itself there
(`--inner`) with that tree's `ik_gat_jax` first on the path, on the checkpoint given (by default
the one in this checkout), and the result is written atomically with its provenance (commit,
JAX version, CPU). The poses are not mocap: FK of seeded random local rotations (axis-angle,
0.6 rad per axis) on the rig's template rest offsets, root at the origin.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / 'shipped_golden_g2.npz'
DEFAULT_COMMIT = 'd702572'
NUM_POSES, SEED = 4, 20260


def synthetic_positions(parents, template: np.ndarray) -> np.ndarray:
  """[NUM_POSES, J, 3] metres: numpy FK of seeded random rotations (independent of the code)."""
  rng = np.random.default_rng(SEED)
  J = len(parents)
  aa = rng.normal(scale=0.6, size=(NUM_POSES, J, 3))
  pos = np.zeros((NUM_POSES, J, 3))
  for n in range(NUM_POSES):
    G = [None] * J
    for j, p in enumerate(parents):
      R = _rodrigues(aa[n, j])
      G[j] = R if p < 0 else G[p] @ R
      pos[n, j] = 0.0 if p < 0 else pos[n, p] + G[p] @ template[j]
  return pos.astype(np.float32)


def _rodrigues(v: np.ndarray) -> np.ndarray:
  t = np.linalg.norm(v)
  k = v / t
  K = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
  return np.eye(3) + np.sin(t) * K + (1 - np.cos(t)) * K @ K


def inner(checkpoint: str, out: str, commit: str) -> None:
  """Runs inside the worktree: that commit's code computes the output."""
  import jax
  import ik_gat_jax  # noqa: F401  (its XLA set-up first)
  from ik_gat_jax import skeleton
  try:
    from ik_gat_jax.inference import load_model
  except ImportError:  # code from before the inference module
    from ik_gat_jax.train import load_model
  here = Path.cwd().resolve()
  if here not in Path(ik_gat_jax.__file__).resolve().parents:
    sys.exit(f'make_golden: ik_gat_jax imported from {ik_gat_jax.__file__}, not the worktree '
             f'{here}')
  rig = skeleton.cmu_body()
  positions = synthetic_positions(rig.parents, np.asarray(rig.template(), np.float64))
  model, _ = load_model(checkpoint)
  output = np.asarray(jax.jit(lambda p: model(p, deterministic=True))(positions))
  tmp = f'{out}.tmp.npz'
  np.savez(tmp, positions=positions, output=output, commit=commit, jax_version=jax.__version__,
           cpu=platform.processor() or platform.machine())
  os.replace(tmp, out)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--commit', default=DEFAULT_COMMIT)
  ap.add_argument('--checkpoint', default=str(REPO / 'checkpoints' / 'ikgat_base'))
  ap.add_argument('--output', default=str(OUT))
  ap.add_argument('--inner', action='store_true', help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.inner:
    inner(a.checkpoint, a.output, a.commit)
    return
  sha = subprocess.run(['git', 'rev-parse', a.commit], cwd=REPO, check=True, text=True,
                       capture_output=True).stdout.strip()
  with tempfile.TemporaryDirectory() as tmp:
    tree = Path(tmp) / 'tree'
    subprocess.run(['git', 'worktree', 'add', '--detach', str(tree), sha], cwd=REPO, check=True,
                   capture_output=True, timeout=120)
    try:
      env = {**os.environ, 'PYTHONPATH': str(tree), 'JAX_PLATFORMS': 'cpu'}
      subprocess.run([sys.executable, __file__, '--inner', f'--commit={sha}',
                      f'--checkpoint={Path(a.checkpoint).resolve()}',
                      f'--output={Path(a.output).resolve()}'], cwd=tree, env=env, check=True,
                     timeout=600)
    finally:
      subprocess.run(['git', 'worktree', 'remove', '--force', str(tree)], cwd=REPO,
                     capture_output=True, timeout=120)
  print(f'wrote {a.output} with the code of {sha}')


if __name__ == '__main__':
  main()
