"""Pictures a person can check: a rest pose with its bone frames; predicted vs true skeletons."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ik_gat_jax import bone_frames as bf  # noqa: E402
from ik_gat_jax.skeleton import Rig, rest_positions_np  # noqa: E402

_AXIS_COLORS = ('tab:red', 'tab:green', 'tab:blue')  # x (bone), y, z


def _to_plot(p: np.ndarray, rig: Rig) -> np.ndarray:
  """World -> plot coordinates (x lateral, y forward, z up) so the figure stands upright."""
  basis = np.stack([np.asarray(rig.lateral), np.asarray(rig.forward), np.asarray(rig.up)])
  return p @ basis.T


def _save_atomic(fig, path: str | os.PathLike) -> None:
  path = Path(path)
  tmp = path.with_name(path.name + '.tmp.png')
  fig.savefig(tmp, dpi=110)
  plt.close(fig)
  os.replace(tmp, path)


def plot_rest_bone_frames(offsets: np.ndarray, rig: Rig, path: str | os.PathLike,
                          title: str = '', axis_len: float = 0.07) -> None:
  """PNG of a subject's rest pose with every bone frame's axes (x red = bone, y green, z blue)."""
  pos = rest_positions_np(offsets, rig.parents)
  B = bf.bone_frames_np(offsets, rig)
  P = _to_plot(pos, rig)
  fig = plt.figure(figsize=(10, 6))
  for k, (elev, azim) in enumerate(((10, -80), (10, -10))):
    ax = fig.add_subplot(1, 2, k + 1, projection='3d')
    for j, p in enumerate(rig.parents):
      if p >= 0:
        ax.plot(*np.stack([P[p], P[j]]).T, color='0.3', lw=2)
    for j in range(rig.num_joints):
      for a in range(3):
        tip = _to_plot(pos[j] + axis_len * B[j, :, a], rig)
        ax.plot(*np.stack([P[j], tip]).T, color=_AXIS_COLORS[a], lw=1.2)
      ax.text(*P[j], rig.joint_names[j], fontsize=5)
    lo, hi = P.min(0), P.max(0)
    c, r = (lo + hi) / 2, (hi - lo).max() / 2 + 0.05
    ax.set(xlim=(c[0] - r, c[0] + r), ylim=(c[1] - r, c[1] + r), zlim=(c[2] - r, c[2] + r),
           xlabel='lateral', ylabel='forward', zlabel='up')
    ax.view_init(elev=elev, azim=azim)
  fig.suptitle(title or f'{rig.name} rest pose, bone frames (x=bone red, y green, z blue)')
  _save_atomic(fig, path)
