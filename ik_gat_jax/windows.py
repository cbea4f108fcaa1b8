"""Causal input windows for the temporal IK-GAT (issue K): which past frames a frame sees.

A window model (`ModelConfig.window` = k > 1) sees the current frame and the k-1 frames before
it, spaced 1 / `ModelConfig.window_fps` seconds apart: the window is defined in seconds, so a
clip or stream at another frame rate gets the same time span. Past frame i of frame t
(i = 1 .. k-1, oldest first in the arrays) sits at time tau = t - i * ratio in input frames,
ratio = fps_input / window_fps; a fractional tau is linearly interpolated between the two input
frames around it (`x = x0 + w (x1 - x0)`, w = tau - floor(tau); at the model's own rate w = 0
and the frames are taken as they are).

Start of a clip or stream, and gaps: frames before the first frame of the run holding frame t
(a file's first frame, the first frame after a gap in its frame numbers, the first frame a
stream received after `reset()`) do not exist; such times are clamped to the run's first frame,
so the window begins as if the body had stood still in that first frame. A window therefore
never crosses a file boundary or a frame gap, and a stream and the same frames as a clip get
exactly the same windows (same indices, same weights, same float32 arithmetic).
"""

from __future__ import annotations

import functools
import math

import numpy as np

HISTORY_SCALE = 10.0  # past-frame input features: displacements from the current frame, x10


def run_starts(file_id: np.ndarray, frame_index: np.ndarray) -> np.ndarray:
  """`[T]` -> `[T]` int64: for each row, the row of the first frame of its run (consecutive rows
  of one file whose frame numbers increase by exactly 1)."""
  file_id, frame_index = np.asarray(file_id), np.asarray(frame_index)
  T = len(file_id)
  new_run = np.ones(T, bool)
  if T > 1:
    new_run[1:] = (file_id[1:] != file_id[:-1]) | (frame_index[1:] != frame_index[:-1] + 1)
  starts = np.where(new_run, np.arange(T), 0)
  return np.maximum.accumulate(starts).astype(np.int64) if T else starts.astype(np.int64)


@functools.lru_cache(maxsize=8)
def _cached_run_starts(dataset) -> np.ndarray:
  out = run_starts(dataset.file_id, dataset.frame_index)
  out.flags.writeable = False
  return out


def dataset_run_starts(dataset) -> np.ndarray:
  """`run_starts` of a `data.Dataset` split, computed once per dataset object."""
  return _cached_run_starts(dataset)


def past_times(k: int, ratio: float) -> np.ndarray:
  """`[k-1]` float64: how many input frames back past frames 1..k-1 lie, oldest first."""
  if k < 2:
    return np.zeros((0,), np.float64)
  return ratio * np.arange(k - 1, 0, -1, dtype=np.float64)


def history_sources(rows: np.ndarray, starts: np.ndarray, k: int, ratio: float = 1.0
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """For rows `[N]` (frame t at row t) with their run starts `[N]`: the past-frame sources
  `(i0 [N, k-1], i1 [N, k-1], w [N, k-1] float32)`, value = x[i0] + w (x[i1] - x[i0])."""
  rows = np.asarray(rows, np.int64)
  tau = rows[:, None].astype(np.float64) - past_times(k, ratio)[None]
  tau = np.maximum(tau, np.asarray(starts, np.float64)[:, None])
  i0 = np.floor(tau).astype(np.int64)
  w = (tau - i0).astype(np.float32)
  i1 = np.minimum(i0 + 1, rows[:, None])
  w = np.where(i1 == i0, np.float32(0.0), w)
  return i0, i1, w


def interpolate(x: np.ndarray, i0: np.ndarray, i1: np.ndarray, w: np.ndarray) -> np.ndarray:
  """`x [T, ...]` at the sources of `history_sources` -> `[N, k-1, ...]` float32."""
  a = np.asarray(x[i0], np.float32)
  if not np.any(w):
    return a
  b = np.asarray(x[i1], np.float32)
  wb = w.reshape(w.shape + (1,) * (a.ndim - w.ndim))
  return a + wb * (b - a)


def clip_history(positions: np.ndarray, k: int, ratio: float = 1.0,
                 starts: np.ndarray | None = None) -> np.ndarray:
  """Past frames of every frame of a clip `[T, J, 3]` -> `[T, k-1, J, 3]` float32 (oldest
  first); `starts` (default: the clip is one run) as `run_starts`."""
  T = len(positions)
  starts = np.zeros(T, np.int64) if starts is None else np.asarray(starts, np.int64)
  i0, i1, w = history_sources(np.arange(T), starts, k, ratio)
  return interpolate(np.asarray(positions), i0, i1, w)


def stream_capacity(k: int, ratio: float) -> int:
  """How many past input frames a stream must keep for windows of k frames at `ratio`."""
  return int(math.ceil((k - 1) * ratio)) + 1 if k > 1 else 0


class StreamHistory:
  """A live stream's past frames: `push(frame)` returns the frame's history `[k-1, J, 3]` as
  `clip_history` gives it for the same frames as a clip since the last `reset()`."""

  def __init__(self, k: int, ratio: float = 1.0):
    self.k, self.ratio = int(k), float(ratio)
    self.capacity = stream_capacity(self.k, self.ratio)
    self.reset()

  def reset(self) -> None:
    self._frames: list[np.ndarray] = []
    self._count = 0  # frames seen since reset; the newest has absolute index count - 1
    # Once the stream is past its start (t >= capacity, the buffer full), the sources relative
    # to the oldest kept frame no longer depend on t: computed once, then reused (the same
    # indices and weights, so the same bits; ~35 us of a live frame).
    self._steady: tuple | None = None

  def push(self, frame: np.ndarray) -> np.ndarray:
    frame = np.asarray(frame, np.float32)
    self._frames.append(frame)
    if len(self._frames) > self.capacity + 1:
      self._frames.pop(0)
    t = self._count
    self._count += 1
    steady = t >= self.capacity and len(self._frames) == self.capacity + 1
    if steady and self._steady is not None:
      i0, i1, w = self._steady
    else:
      first = t - (len(self._frames) - 1)  # absolute index of the oldest kept frame
      i0, i1, w = history_sources(np.asarray([t]), np.asarray([0]), self.k, self.ratio)
      i0, i1, w = i0[0] - first, i1[0] - first, w[0]
      if steady:
        self._steady = (i0, i1, w)
    return interpolate(np.stack(self._frames), i0, i1, w)
