"""Power-of-two padding of a leading axis, so jitted functions see few distinct shapes.

A clip of T frames is padded to the next power of two by repeating its last row (or a given
fill), computed, and cut back to T: any length compiles one of about log2(T_max) shapes.
"""

from __future__ import annotations

import numpy as np


def power_of_two(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= max(n, minimum, 1)."""
  return 1 << (max(int(n), int(minimum), 1) - 1).bit_length()


def pad_rows(a: np.ndarray, length: int, fill: np.ndarray | None = None) -> np.ndarray:
  """`a [T, ...]` extended to `[length, ...]` with copies of `fill` (default: its last row)."""
  a = np.asarray(a)
  extra = length - len(a)
  if extra < 0:
    raise ValueError(f'cannot pad {len(a)} rows to {length}')
  row = a[-1:] if fill is None else np.asarray(fill, a.dtype)[None]
  return np.concatenate([a, np.broadcast_to(row, (extra,) + a.shape[1:])])
