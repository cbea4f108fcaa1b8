"""Pictures a person can check: a rest pose with its bone frames; predicted vs true skeletons."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from ik_gat_jax import bone_frames as bf
from ik_gat_jax.io import atomic
from ik_gat_jax.skeleton import Rig, rest_positions_np

_AXIS_COLORS = ('tab:red', 'tab:green', 'tab:blue')  # x (bone), y, z


def _to_plot(p: np.ndarray, rig: Rig) -> np.ndarray:
  """World -> plot coordinates (x lateral, y forward, z up) so the figure stands upright."""
  basis = np.stack([np.asarray(rig.lateral), np.asarray(rig.forward), np.asarray(rig.up)])
  return p @ basis.T


@functools.cache
def pyplot():
  """matplotlib.pyplot on the Agg backend, imported on first use: matplotlib costs about half a
  second of start-up, and only the commands that draw pay it."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def save_figure(fig, path: str | os.PathLike, tight: bool = False) -> None:
  """PNG at 110 dpi, written to a temporary file beside `path` and renamed; closes `fig`."""
  if tight:
    fig.tight_layout()
  try:
    with atomic.atomic_path(path, '.png') as tmp:
      fig.savefig(tmp, dpi=110)
  finally:
    pyplot().close(fig)


def plot_rest_bone_frames(offsets: np.ndarray, rig: Rig, path: str | os.PathLike,
                          title: str = '', axis_len: float = 0.07) -> None:
  """PNG of a subject's rest pose with every bone frame's axes (x red = bone, y green, z blue)."""
  plt = pyplot()
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
  save_figure(fig, path)


# ----------------------------------------------------------------------------------------------
# Solver output: input joints vs the solved skeleton, with bone frames to show twist.


def _limits(points: np.ndarray) -> tuple[np.ndarray, float]:
  """Centre and half-width of a cube holding `points [..., 3]` (plot coordinates)."""
  flat = points.reshape(-1, 3)
  lo, hi = flat.min(0), flat.max(0)
  return (lo + hi) / 2, float((hi - lo).max()) / 2 + 0.05


def _draw_solved(ax, inp: np.ndarray, sol: np.ndarray, Q: np.ndarray | None, rig: Rig,
                 centre: np.ndarray, half: float, axis_len: float) -> None:
  """One frame: input joints (black dots), solved skeleton (blue), bone frames Q (x red along
  the bone, y green, z blue: a twist error turns y and z about the bone)."""
  P_in, P_sol = _to_plot(inp, rig), _to_plot(sol, rig)
  for j, p in enumerate(rig.parents):
    if p >= 0:
      ax.plot(*np.stack([P_sol[p], P_sol[j]]).T, color='tab:blue', lw=2)
  ax.scatter(*P_in.T, color='k', s=8, depthshade=False)
  if Q is not None:
    for j in range(rig.num_joints):
      for a in range(3):
        tip = _to_plot(sol[j] + axis_len * Q[j, :, a], rig)
        ax.plot(*np.stack([P_sol[j], tip]).T, color=_AXIS_COLORS[a], lw=1)
  ax.set(xlim=(centre[0] - half, centre[0] + half), ylim=(centre[1] - half, centre[1] + half),
         zlim=(centre[2] - half, centre[2] + half), xticklabels=[], yticklabels=[],
         zticklabels=[])
  ax.view_init(elev=10, azim=-70)


def plot_solve_frames(path: str | os.PathLike, input_positions: np.ndarray,
                      solved_positions: np.ndarray, rig: Rig, frames,
                      bone_aligned_rot: np.ndarray | None = None, title: str = '',
                      axis_len: float = 0.06) -> None:
  """PNG: for each of `frames`, the input joints `[T, J, 3]` (black) against the solved
  skeleton `[T, J, 3]` (FK, blue) with its bone frames `Q [T, J, 3, 3]` (world)."""
  plt = pyplot()
  frames = [int(t) for t in frames]
  T = len(input_positions)
  bad = [t for t in frames if not 0 <= t < T]
  if bad or not frames:
    raise ValueError(f'plot frames {bad or frames} outside the clip (0..{T - 1})')
  cols = min(len(frames), 4)
  rows = -(-len(frames) // cols)
  fig = plt.figure(figsize=(3.4 * cols, 3.4 * rows + 0.4))
  fig.subplots_adjust(left=0.0, right=1.0, bottom=0.0, top=0.86, wspace=0.0, hspace=0.1)
  for k, t in enumerate(frames):
    ax = fig.add_subplot(rows, cols, k + 1, projection='3d')
    both = np.concatenate([input_positions[t], solved_positions[t]])
    centre, half = _limits(_to_plot(both, rig))
    _draw_solved(ax, input_positions[t], solved_positions[t],
                 None if bone_aligned_rot is None else bone_aligned_rot[t], rig, centre, half,
                 axis_len)
    err = 1e3 * np.linalg.norm(solved_positions[t] - input_positions[t], axis=-1).max()
    ax.set_title(f'frame {t}: max |input - FK| {err:.0f} mm', fontsize=8)
  fig.suptitle(title or f'{rig.name}: input joints (black) vs solved skeleton (blue); bone '
               'frames x red (bone), y green, z blue', fontsize=9)
  save_figure(fig, path)


def _render_frame(inp, sol, Q, rig, centre, half, label: str, axis_len: float) -> np.ndarray:
  plt = pyplot()
  fig = plt.figure(figsize=(4, 4))
  fig.subplots_adjust(left=0.0, right=1.0, bottom=0.0, top=0.94)
  ax = fig.add_subplot(1, 1, 1, projection='3d')
  _draw_solved(ax, inp, sol, Q, rig, centre, half, axis_len)
  ax.set_title(label, fontsize=8)
  fig.canvas.draw()
  image = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
  plt.close(fig)
  return image


def save_solve_clip(path: str | os.PathLike, input_positions: np.ndarray,
                    solved_positions: np.ndarray, rig: Rig, frames,
                    bone_aligned_rot: np.ndarray | None = None, fps: float = 30.0,
                    axis_len: float = 0.06) -> None:
  """A short clip of `frames`: an animated GIF when `path` ends in .gif, else a directory of
  `frame_NNNN.png` (created; must not exist or be empty). Fixed axes over the clip, the root
  followed. Written via a temp file / directory then renamed."""
  from PIL import Image
  frames = [int(t) for t in frames]
  pts = np.concatenate([input_positions[frames], solved_positions[frames]], axis=1)
  rel_centre, half = _limits(_to_plot(pts - pts[:, :1], rig))
  images = []
  for t in frames:
    centre = _to_plot(input_positions[t, 0], rig) + rel_centre  # follow the root, fixed scale
    Q = None if bone_aligned_rot is None else bone_aligned_rot[t]
    images.append(_render_frame(input_positions[t], solved_positions[t], Q, rig, centre, half,
                                f'frame {t}', axis_len))
  path = Path(path)
  if path.suffix.lower() == '.gif':
    pics = [Image.fromarray(im) for im in images]
    with atomic.atomic_path(path, '.gif') as tmp:
      pics[0].save(tmp, save_all=True, append_images=pics[1:], duration=int(1000 / fps), loop=0)
    return
  path.mkdir(parents=True, exist_ok=True)
  if any(path.iterdir()):
    raise FileExistsError(f'{path} is not empty')
  for k, im in enumerate(images):
    Image.fromarray(im).save(path / f'frame_{k:04d}.png')
