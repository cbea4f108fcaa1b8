"""Root calibration: a subject's constant root-rotation bias, measured on its own frames.

The network sees positions only, never the subject's rest offsets, so a subject whose hips sit
unlike the training subjects' (the hip joints' rest directions from the root) gets its root
rotation off by a nearly constant rotation, and with it the local rotations of the root's
children (which are relative to the root). Removing it lowers the shipped checkpoint's root
error on the CMU test split from 2.02 to 0.89 deg, and on a rig trained by
`experiments.train_rig` whose held-out subject is unlike its training subjects from 15.6 to 8.1
deg (BENCHMARKS.md "Another lab's rig in Blender's world", with the commands).

The root's rotation is also the rigid rotation taking the subject's rest offsets of the root's
children to their observed directions, `v_c = p_c - p_root = G_root o_c` (a Kabsch fit; exact on
clean positions, which swing-only IK uses), but per frame that fit follows the input's noise.
So the bias is measured over frames instead: `E_t = G_net,t^T G_fit,t` (the network's root to
the fit, in the root's frame), averaged over the frames as the rotation nearest their mean
(`nearest_rotation` of `sum_t E_t`, the chordal L2 mean; noise averages out), and the root is
turned by it: `G_root <- G_root E`. The root's children keep their world rotations, so their
local rotations become `E^T R_c`; every other local rotation is unchanged.

- Which children: the root's children at a different place from it in the subject's offsets
  (more than `COLOCATED_M`); they must span a plane (cross product of their unit directions
  over `MIN_SPAN`), else there is no fit and no calibration (`root_children` returns ()).
  cmu_body: LeftUpLeg and RightUpLeg (LowerBack sits on the Hips).
- Frames whose root or those children are not finite are left out of the mean; with none left
  the bias is the identity.
- `calibrate_clip` measures over all of a clip's frames (not causal); `RootBias` accumulates a
  stream's frames so far (causal: frame t is corrected by the mean of frames 0..t).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ik_gat_jax.skeleton import Rig

COLOCATED_M = 1e-6   # a child closer to the root than this is on it (no direction)
MIN_SPAN = 0.05      # |d_a x d_b| of the children's unit rest directions: they span a plane


def nearest_rotation(M: np.ndarray) -> np.ndarray:
  """The rotations `[..., 3, 3]` nearest `M` in the Frobenius norm (SVD, det +1)."""
  U, _, Vt = np.linalg.svd(M)
  flip = np.linalg.det(U @ Vt) < 0  # a reflection: turn the least singular direction
  U[..., :, 2] *= np.where(flip, -1.0, 1.0)[..., None]
  return U @ Vt


def root_children(offsets: np.ndarray, rig: Rig) -> tuple[int, ...]:
  """The root's children used for the fit (module docstring), or () when they do not span a
  plane."""
  offsets = np.asarray(offsets, np.float64)
  kids = [c for c in rig.children[0] if np.linalg.norm(offsets[c]) > COLOCATED_M]
  d = offsets[kids] / np.linalg.norm(offsets[kids], axis=-1, keepdims=True) if kids else None
  span = max((np.linalg.norm(np.cross(d[a], d[b])) for a in range(len(kids))
              for b in range(a + 1, len(kids))), default=0.0)
  return tuple(kids) if span > MIN_SPAN else ()


def fitted_root(positions: np.ndarray, offsets: np.ndarray,
                kids: Sequence[int]) -> np.ndarray:
  """`[T, 3, 3]` the rotations G with `G o_c` nearest `p_c - p_root` over `kids` (Kabsch)."""
  positions = np.asarray(positions, np.float64)
  v = positions[:, list(kids)] - positions[:, :1]
  o = np.asarray(offsets, np.float64)[list(kids)]
  return nearest_rotation(np.einsum('tca,cb->tab', v, o))


def bias_terms(root_rot: np.ndarray, positions: np.ndarray, offsets: np.ndarray,
               rig: Rig, kids: Sequence[int] | None = None) -> np.ndarray:
  """`[T, 3, 3]` per frame `E_t = G_net,t^T G_fit,t`, zero for frames without a fit.
  `kids`: `root_children(offsets, rig)`, when the caller has it."""
  T = len(root_rot)
  kids = tuple(root_children(offsets, rig) if kids is None else kids)
  if not kids:
    return np.zeros((T, 3, 3))
  positions = np.asarray(positions, np.float64)
  ok = np.all(np.isfinite(positions[:, (0,) + kids]), axis=(1, 2))
  ok &= np.all(np.isfinite(root_rot), axis=(1, 2))
  E = np.zeros((T, 3, 3))
  if ok.any():
    G = np.asarray(root_rot, np.float64)[ok]
    E[ok] = np.swapaxes(G, -1, -2) @ fitted_root(positions[ok], offsets, kids)
  return E


def mean_bias(terms: np.ndarray) -> np.ndarray:
  """The rotation nearest the sum of `terms [T, 3, 3]` (identity when they are all zero)."""
  S = np.asarray(terms, np.float64).sum(axis=0)
  return np.eye(3) if not np.any(S) else nearest_rotation(S)


def apply_bias(local_rot: np.ndarray, E: np.ndarray, rig: Rig,
               kids: Sequence[int] | None = None) -> np.ndarray:
  """Local rotations `[T, J, 3, 3]` with the root turned by `E` (`[3, 3]`, or `[T, 3, 3]` per
  frame) and its children's world rotations kept: `R_0 E`, `E^T R_c`. `kids`: the root's
  children (`rig.children[0]`), when the caller has them."""
  out = np.array(local_rot, copy=True)
  E = np.asarray(E, np.float64)
  out[:, 0] = out[:, 0] @ E
  kids = list(rig.children[0] if kids is None else kids)
  Et = np.swapaxes(E, -1, -2)
  out[:, kids] = (Et[:, None] if Et.ndim == 3 else Et) @ out[:, kids]
  return out


def calibrate_clip(local_rot: np.ndarray, positions: np.ndarray, offsets: np.ndarray,
                   rig: Rig) -> tuple[np.ndarray, np.ndarray]:
  """(calibrated local rotations `[T, J, 3, 3]` in `local_rot`'s dtype, the bias `[3, 3]`) of
  one subject's clip: the bias measured over all its frames (module docstring)."""
  E = mean_bias(bias_terms(np.asarray(local_rot)[:, 0], positions, offsets, rig))
  return apply_bias(local_rot, E, rig).astype(np.asarray(local_rot).dtype), E


class RootBias:
  """A stream's root calibration: the bias of the frames seen so far (causal)."""

  def __init__(self):
    self.total = np.zeros((3, 3))
    # The subject's (offsets' bytes, `root_children`, the root's children), kept between calls:
    # computed per call they were half of a live frame's calibration.
    self._subject: tuple[bytes, tuple[int, ...], list[int]] | None = None

  def calibrate(self, local_rot: np.ndarray, positions: np.ndarray, offsets: np.ndarray,
                rig: Rig) -> np.ndarray:
    """The next frames `[n, J, 3, 3]`, each corrected by the mean bias up to and including
    itself (`calibrate_clip`'s terms, summed as they come)."""
    offsets = np.asarray(offsets)
    key = offsets.tobytes()
    if self._subject is None or self._subject[0] != key:
      self._subject = (key, root_children(offsets, rig), list(rig.children[0]))
    _, fit, kids = self._subject
    local_rot = np.asarray(local_rot)
    running = self.total + np.cumsum(bias_terms(local_rot[:, 0], positions, offsets, rig, fit),
                                     axis=0)
    self.total = running[-1]
    E = np.broadcast_to(np.eye(3), running.shape).copy()
    some = running.any(axis=(1, 2))  # frames after at least one fit
    if some.any():
      E[some] = nearest_rotation(running[some])
    return apply_bias(local_rot, E, rig, kids).astype(local_rot.dtype)
