"""Subject calibration: a subject's constant rotation biases, measured on its own frames.

The network sees positions only, never the subject's rest offsets. Where a joint's children
branch (the hips from the root, the arms from the chest), the offsets fix how the joint turns
about its bone, and a subject whose offsets there are unlike the training subjects' gets that
joint's world rotation off by a nearly constant rotation, and the local rotations of the joint
and its children with it. Removing it lowers the shipped checkpoint's error on the CMU test
split (the chest: 2.96 -> 1.34 deg world; the root: 2.02 -> 0.89) and, much more, on a rig
trained by `experiments.train_rig` whose held-out subject is unlike its training subjects
(BENCHMARKS.md "Subject calibration", with the commands).

Such a joint's world rotation is also the rigid rotation taking the subject's rest offsets of
its children to their observed directions, `v_c = p_c - p_j = G_j o_c` (a Kabsch fit; exact on
clean positions, which swing-only IK uses), but per frame that fit follows the input's noise
(children 10-20 cm away). So the bias is measured over frames instead: `E_t = G_net,t^T
G_fit,t` (the network's world rotation of the joint to the fit, in the joint's frame), averaged
over the frames as the rotation nearest their mean (`nearest_rotation` of `sum_t E_t`, the
chordal L2 mean; noise averages out), and the joint is turned by it: `G_j <- G_j E_j`. Every
other joint keeps its world rotation, so the local rotations become `E_parent^T R_j E_j` (E the
identity at joints without a fit); each bias is measured against the network's own rotation,
so the joints' corrections do not depend on one another.

- Which joints (`plan`): those whose children at a different place from them in
  the subject's offsets (more than `COLOCATED_M`) span a plane (the cross product of two of
  their unit directions over `MIN_SPAN`). cmu_body: Hips (LeftUpLeg, RightUpLeg; LowerBack
  sits on the Hips) and Spine1 (LeftArm, RightArm; Neck sits on it). A rig with fingers adds
  its hands. A subject without such a joint is left as it is.
- Frames where a joint, its fitted children or its network rotation are not finite are left
  out of that joint's mean; with none left its bias is the identity.
- `calibrate_clip` measures over all of a clip's frames (not causal); `SubjectBias`
  accumulates a stream's frames so far (causal: frame t is corrected by the mean of frames
  0..t).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ik_gat_jax.skeleton import Rig

COLOCATED_M = 1e-6   # a child closer to its parent than this is on it (no direction)
MIN_SPAN = 0.05      # |d_a x d_b| of two children's unit rest directions: they span a plane



@dataclasses.dataclass(frozen=True)
class Plan:
  """What a subject's calibration computes, found once from its offsets (`plan`): the
  calibrated joints (root first), each one's fitted children and all its children, and the
  joints whose world rotations they need, as `(joint, parent)` in tree order."""
  joints: tuple[int, ...]
  fitted: tuple[tuple[int, ...], ...]
  children: tuple[tuple[int, ...], ...]
  chain: tuple[tuple[int, int], ...]


def nearest_rotation(M: np.ndarray) -> np.ndarray:
  """The rotations `[..., 3, 3]` nearest `M` in the Frobenius norm (SVD, det +1)."""
  U, _, Vt = np.linalg.svd(M)
  flip = np.linalg.det(U @ Vt) < 0  # a reflection: turn the least singular direction
  U[..., :, 2] *= np.where(flip, -1.0, 1.0)[..., None]
  return U @ Vt


def fit_children(offsets: np.ndarray, rig: Rig, j: int) -> tuple[int, ...]:
  """Joint j's children used for its fit (module docstring), or () when they do not span a
  plane."""
  offsets = np.asarray(offsets, np.float64)
  kids = [c for c in rig.children[j] if np.linalg.norm(offsets[c]) > COLOCATED_M]
  d = offsets[kids] / np.linalg.norm(offsets[kids], axis=-1, keepdims=True) if kids else None
  span = max((np.linalg.norm(np.cross(d[a], d[b])) for a in range(len(kids))
              for b in range(a + 1, len(kids))), default=0.0)
  return tuple(kids) if span > MIN_SPAN else ()


def plan(offsets: np.ndarray, rig: Rig) -> Plan:
  """The subject's `Plan`: every joint with a fit (module docstring)."""
  children = rig.children
  fits = [(j, fit_children(offsets, rig, j)) for j in range(rig.num_joints) if children[j]]
  fits = [(j, kids) for j, kids in fits if kids]
  need = set()
  for j, _ in fits:
    while j >= 0 and j not in need:
      need.add(j)
      j = rig.parents[j]
  return Plan(joints=tuple(j for j, _ in fits), fitted=tuple(k for _, k in fits),
              children=tuple(children[j] for j, _ in fits),
              chain=tuple((j, rig.parents[j]) for j in sorted(need)))  # parents first


def fitted_rotations(positions: np.ndarray, offsets: np.ndarray, p: Plan) -> np.ndarray:
  """`[T, K, 3, 3]` per calibrated joint the rotations G with `G o_c` nearest `p_c - p_j`
  over its fitted children (Kabsch)."""
  positions = np.asarray(positions, np.float64)
  offsets = np.asarray(offsets, np.float64)
  H = [np.swapaxes(positions[:, kids] - positions[:, j:j + 1], -1, -2) @ offsets[kids, :]
       for j, kids in zip(p.joints, p.fitted)]
  return nearest_rotation(np.stack(H, axis=1))


def world_rotations(local_rot: np.ndarray, p: Plan) -> np.ndarray:
  """`[T, K, 3, 3]` the world rotations of the calibrated joints (the products of the local
  rotations along their ancestors; only those are computed)."""
  local_rot = np.asarray(local_rot, np.float64)
  G = {}
  for j, up in p.chain:
    G[j] = local_rot[:, j] if up < 0 else G[up] @ local_rot[:, j]
  return np.stack([G[j] for j in p.joints], axis=1)


def bias_terms(local_rot: np.ndarray, positions: np.ndarray, offsets: np.ndarray,
               p: Plan) -> np.ndarray:
  """`[T, K, 3, 3]` per frame and calibrated joint `E_t = G_net,t^T G_fit,t`, zero where a
  frame has no fit (the joint, a fitted child or the network's rotation not finite)."""
  T = len(local_rot)
  if not p.joints:
    return np.zeros((T, 0, 3, 3))
  positions = np.asarray(positions, np.float64)
  G = world_rotations(local_rot, p)
  finite = np.isfinite(positions).all(axis=-1)
  ok = np.stack([finite[:, (j,) + kids].all(axis=1) for j, kids in zip(p.joints, p.fitted)],
                axis=1) & np.isfinite(G).all(axis=(2, 3))
  if ok.all():
    return np.swapaxes(G, -1, -2) @ fitted_rotations(positions, offsets, p)
  E = np.zeros((T, len(p.joints), 3, 3))
  if ok.any():
    fit = fitted_rotations(np.where(np.isfinite(positions), positions, 0.0), offsets, p)
    E[ok] = (np.swapaxes(G, -1, -2) @ fit)[ok]
  return E


def mean_bias(terms: np.ndarray) -> np.ndarray:
  """`[..., K, 3, 3]` the rotations nearest the sums of `terms [T, ..., K, 3, 3]` over the
  first axis (identity where they are all zero)."""
  return _nearest_or_identity(np.asarray(terms, np.float64).sum(axis=0))


def _nearest_or_identity(S: np.ndarray) -> np.ndarray:
  some = S.any(axis=(-2, -1))
  if some.all():
    return nearest_rotation(S)
  E = np.broadcast_to(np.eye(3), S.shape).copy()
  if some.any():
    E[some] = nearest_rotation(S[some])
  return E


def apply_bias(local_rot: np.ndarray, E: np.ndarray, p: Plan) -> np.ndarray:
  """Local rotations `[T, J, 3, 3]` with each calibrated joint turned by its bias (`E [K, 3,
  3]`, or `[T, K, 3, 3]` per frame) and every other joint's world rotation kept: `R_j E_j`,
  `E_j^T R_c` for its children c."""
  out = np.array(local_rot, copy=True)
  E = np.asarray(E, np.float64)
  Et = np.swapaxes(E, -1, -2)
  for k, (j, kids) in enumerate(zip(p.joints, p.children)):
    out[:, j] = out[:, j] @ E[..., k, :, :]
    out[:, kids] = (Et[:, k, None] if Et.ndim == 4 else Et[k]) @ out[:, kids]
  return out


def calibrate_clip(local_rot: np.ndarray, positions: np.ndarray, offsets: np.ndarray,
                   rig: Rig) -> tuple[np.ndarray, dict[int, np.ndarray]]:
  """(calibrated local rotations `[T, J, 3, 3]` in `local_rot`'s dtype, `{joint: bias [3,
  3]}`) of one subject's clip: the biases measured over all its frames (module docstring)."""
  p = plan(offsets, rig)
  E = mean_bias(bias_terms(local_rot, positions, offsets, p))
  out = apply_bias(local_rot, E, p).astype(np.asarray(local_rot).dtype)
  return out, dict(zip(p.joints, E))


class SubjectBias:
  """A stream's subject calibration: the biases of the frames seen so far (causal)."""

  def __init__(self):
    self.total: np.ndarray | None = None  # [K, 3, 3] the sum of the terms so far
    # The subject's (offsets' bytes, `plan`), kept between calls: found per call it was most
    # of a live frame's calibration.
    self._subject: tuple[bytes, Plan] | None = None

  def calibrate(self, local_rot: np.ndarray, positions: np.ndarray, offsets: np.ndarray,
                rig: Rig) -> np.ndarray:
    """The next frames `[n, J, 3, 3]`, each corrected by the mean biases up to and including
    itself (`calibrate_clip`'s terms, summed as they come; a new stream takes a new
    `SubjectBias`)."""
    offsets = np.asarray(offsets)
    key = offsets.tobytes()
    if self._subject is None or self._subject[0] != key:
      p = plan(offsets, rig)
      if self._subject is not None and p.joints != self._subject[1].joints:
        self.total = None  # other joints: the sums so far do not apply
      self._subject = (key, p)
    p = self._subject[1]
    local_rot = np.asarray(local_rot)
    if not p.joints:
      return local_rot
    running = np.cumsum(bias_terms(local_rot, positions, offsets, p), axis=0)
    if self.total is not None:
      running += self.total
    self.total = running[-1]
    return apply_bias(local_rot, _nearest_or_identity(running), p).astype(local_rot.dtype)
