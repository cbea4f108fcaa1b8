"""Pictures a person can check: a rest pose with its bone frames; predicted vs true skeletons;
the box body of `io.gltf` posed by several methods, each box coloured by its joint's error."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from ik_gat_jax import bone_frames as bf
from ik_gat_jax.io import atomic
from ik_gat_jax.io import gltf
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


# Browsers show a GIF delay under 20 ms (0 or 1 centisecond) as 100 ms.
GIF_MIN_FRAME_MS = 20


def gif_frame_ms(frames, fps: float) -> int:
  """How long a GIF shows each image of `frames` (indices at `fps`): the time its frames span
  (their step / fps), in GIF's 10 ms units, nearest, and at least `GIF_MIN_FRAME_MS` (a 120
  fps clip shown frame by frame plays slower than real time; a step of 4 plays it true)."""
  frames = np.asarray(frames)
  step = float(np.median(np.diff(frames))) if len(frames) > 1 else 1.0
  return max(GIF_MIN_FRAME_MS, int(round(100 * step / fps)) * 10)


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
      pics[0].save(tmp, save_all=True, append_images=pics[1:], duration=gif_frame_ms(frames, fps),
                   loop=0)
    return
  path.mkdir(parents=True, exist_ok=True)
  if any(path.iterdir()):
    raise FileExistsError(f'{path} is not empty')
  for k, im in enumerate(images):
    Image.fromarray(im).save(path / f'frame_{k:04d}.png')


# ----------------------------------------------------------------------------------------------
# Box bodies side by side: the rotations themselves, each box coloured by its joint's error.

ERROR_CMAP = 'turbo'
_LIGHT = np.array([0.3, -0.8, 0.6]) / np.linalg.norm([0.3, -0.8, 0.6])  # plot axes, near the eye
_REFERENCE_GREYS = {0: 0.78, 1: 0.62, -1: 0.9}  # middle, +lateral side, the other side


class Body(NamedTuple):
  """One column: `label` (its title), world rotations `global_rot [T, J, 3, 3]` and joint
  positions `positions [T, J, 3]` (metres), and `error_deg [T, J]` (each joint's local rotation
  error, colouring its boxes) or None for the reference (greys: the +lateral side darker)."""
  label: str
  global_rot: np.ndarray
  positions: np.ndarray
  error_deg: np.ndarray | None = None


def _box_faces(offsets: np.ndarray, rig: Rig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The `io.gltf` box body at rest as quads: corners `[F, 4, 3]` relative to each face's
  joint, outward normals `[F, 3]`, joint `[F]` (rig axes)."""
  boxes = gltf.body_boxes(offsets, rig)
  rest = rest_positions_np(np.asarray(offsets, np.float64), rig.parents)
  quads = np.concatenate([(b['vertices'] - rest[b['joint']]).reshape(-1, 4, 3) for b in boxes])
  normals = np.concatenate([b['normals'][::4] for b in boxes])  # 4 corners per face
  joints = np.concatenate([np.full(len(b['vertices']) // 4, b['joint']) for b in boxes])
  return quads, normals, joints


def _draw_body(ax, faces, G: np.ndarray, p: np.ndarray, colours: np.ndarray, rig: Rig,
               centre: np.ndarray, half: np.ndarray) -> None:
  """The boxes posed by `G [J, 3, 3]`, `p [J, 3]`, face colours `[F, 3]` shaded by a light near
  the eye, in the box `centre` +- `half [3]` (plot axes, equal scale)."""
  from mpl_toolkits.mplot3d.art3d import Poly3DCollection  # pylint: disable=import-outside-toplevel
  quads, normals, joints = faces
  world = np.einsum('fab,fkb->fka', G[joints], quads) + p[joints][:, None]
  n = _to_plot(np.einsum('fab,fb->fa', G[joints], normals), rig)
  shade = 0.45 + 0.55 * np.clip(n @ _LIGHT, 0.0, 1.0)
  ax.add_collection3d(Poly3DCollection(_to_plot(world, rig), facecolors=colours * shade[:, None],
                                       edgecolors=(0, 0, 0, 0.35), linewidths=0.2))
  lo, hi = centre - half, centre + half
  ax.set(xlim=(lo[0], hi[0]), ylim=(lo[1], hi[1]), zlim=(lo[2], hi[2]))
  ax.set_box_aspect(tuple(half), zoom=1.25)
  ax.view_init(elev=10, azim=-70)
  ax.set_axis_off()


def _face_colours(body: Body, t: int, joints: np.ndarray, sides: np.ndarray, cmap,
                  vmax: float) -> np.ndarray:
  if body.error_deg is None:
    return np.repeat(np.asarray([_REFERENCE_GREYS[int(s)] for s in sides[joints]])[:, None], 3, 1)
  return np.asarray(cmap(np.clip(body.error_deg[t][joints] / vmax, 0.0, 1.0)))[:, :3]


def _panel_title(body: Body, t: int, header: bool) -> str:
  line = (f'frame {t}' if body.error_deg is None else
          f'frame {t}: mean {body.error_deg[t].mean():.1f} deg')
  return f'{body.label}\n{line}' if header else line


def _draw_row(axes, bodies, t, faces, sides, rig, cmap, vmax, centre, half, fontsize, header):
  for ax, body in zip(axes, bodies):
    colours = _face_colours(body, t, faces[2], sides, cmap, vmax)
    _draw_body(ax, faces, body.global_rot[t], body.positions[t], colours, rig, centre, half)
    ax.set_title(_panel_title(body, t, header), fontsize=fontsize, pad=0,
                 fontweight='bold' if header else 'normal')


def _sides(offsets: np.ndarray, rig: Rig) -> np.ndarray:
  """Per joint +1 / -1 / 0: on the rig's +lateral side, the other, or the middle (rest)."""
  rest = rest_positions_np(np.asarray(offsets, np.float64), rig.parents)
  side = (rest - rest[0]) @ np.asarray(rig.lateral)
  return np.where(side > 0.02, 1, np.where(side < -0.02, -1, 0))


def _colour_bar(fig, cax, cmap, vmax: float, label: str, fontsize: int) -> None:
  plt = pyplot()
  bar = fig.colorbar(plt.cm.ScalarMappable(plt.Normalize(0.0, vmax), cmap), cax=cax,
                     extend='max')
  bar.set_label(label, fontsize=fontsize)
  bar.ax.tick_params(labelsize=fontsize - 1)


def _extent(bodies: Sequence[Body], frames: Sequence[int], rig: Rig
            ) -> tuple[np.ndarray, np.ndarray]:
  """(centre relative to the reference's root, half sizes `[3]`) of the box holding every
  body's joints at `frames` (plot axes), with room for the boxes' width."""
  pts = np.concatenate([_to_plot(b.positions[frames] - bodies[0].positions[frames, :1], rig)
                        for b in bodies], axis=1).reshape(-1, 3)
  lo, hi = pts.min(0) - 0.08, pts.max(0) + 0.08
  return (lo + hi) / 2, (hi - lo) / 2


def _error_scene(offsets: np.ndarray, rig: Rig, bodies: Sequence[Body], frames: Sequence[int]):
  """What every error-body picture needs: pyplot, the colour map, the frames as ints, the box
  faces and sides on `offsets`, and the shared view (`_extent`)."""
  plt = pyplot()
  frames = [int(t) for t in frames]
  rel, half = _extent(bodies, frames, rig)
  return (plt, plt.get_cmap(ERROR_CMAP), frames, _box_faces(offsets, rig), _sides(offsets, rig),
          rel, half)


def plot_error_bodies(path: str | os.PathLike, offsets: np.ndarray, rig: Rig,
                      bodies: Sequence[Body], frames: Sequence[int], vmax: float = 30.0,
                      title: str = '') -> None:
  """PNG: a row per frame of `frames`, a column per body (`Body`: a reference in greys, the
  others coloured by error, one colour bar 0..`vmax` degrees). The box body of `io.gltf` on
  `offsets [J, 3]`, each box moving rigidly with its joint: a twist error turns the (flat) box
  about its bone."""
  plt, cmap, frames, faces, sides, rel, half = _error_scene(offsets, rig, bodies, frames)
  rows, cols = len(frames), len(bodies)
  height = 3.6 * rows + 0.9
  fig = plt.figure(figsize=(3.0 * cols + 1.0, height))
  fig.subplots_adjust(left=0.0, right=0.88, bottom=0.0, top=1 - 0.9 / height, wspace=0.0,
                      hspace=0.12)
  for r, t in enumerate(frames):
    axes = [fig.add_subplot(rows, cols, r * cols + c + 1, projection='3d') for c in range(cols)]
    centre = _to_plot(bodies[0].positions[t, 0], rig) + rel
    _draw_row(axes, bodies, t, faces, sides, rig, cmap, vmax, centre, half, 8, r == 0)
  _colour_bar(fig, fig.add_axes([0.9, 0.2, 0.018, 0.6]), cmap, vmax,
              'local rotation error of the joint the box moves with (deg)', 8)
  fig.suptitle(title or f'{rig.name}: the box body posed by each method; each box coloured by the '
               'local rotation error of its joint', fontsize=10, y=1 - 0.25 / height)
  save_figure(fig, path)


def save_error_bodies_clip(path: str | os.PathLike, offsets: np.ndarray, rig: Rig,
                           bodies: Sequence[Body], frames: Sequence[int], fps: float = 30.0,
                           vmax: float = 30.0, title: str = '') -> None:
  """An animated GIF of `plot_error_bodies`' row for each of `frames` (the reference's root
  followed, fixed scale), each image shown for the time its frames span at `fps`."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  plt, cmap, frames, faces, sides, rel, half = _error_scene(offsets, rig, bodies, frames)
  images = []
  for t in frames:
    fig = plt.figure(figsize=(2.6 * len(bodies) + 0.9, 3.3))
    fig.subplots_adjust(left=0.0, right=0.86, bottom=0.0, top=0.84, wspace=0.0)
    axes = [fig.add_subplot(1, len(bodies), c + 1, projection='3d') for c in range(len(bodies))]
    centre = _to_plot(bodies[0].positions[t, 0], rig) + rel
    _draw_row(axes, bodies, t, faces, sides, rig, cmap, vmax, centre, half, 7, True)
    _colour_bar(fig, fig.add_axes([0.88, 0.12, 0.015, 0.66]), cmap, vmax,
                'local rotation error (deg)', 7)
    if title:
      fig.suptitle(title, fontsize=8)
    fig.canvas.draw()
    images.append(Image.fromarray(np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()))
    plt.close(fig)
  with atomic.atomic_path(path, '.gif') as tmp:
    images[0].save(tmp, save_all=True, append_images=images[1:], loop=0,
                   duration=gif_frame_ms(frames, fps))
