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

- Which joints (`calibrated_joints`): those whose children at a different place from them in
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

from typing import Sequence

import numpy as np

from ik_gat_jax.skeleton import Rig

COLOCATED_M = 1e-6   # a child closer to its parent than this is on it (no direction)
MIN_SPAN = 0.05      # |d_a x d_b| of two children's unit rest directions: they span a plane

Joints = tuple[tuple[int, tuple[int, ...]], ...]  # (joint, its fitted children) per joint


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


def calibrated_joints(offsets: np.ndarray, rig: Rig) -> Joints:
  """`((joint, fitted children), ...)` of every joint with a fit, root first."""
  out = ((j, fit_children(offsets, rig, j)) for j in range(rig.num_joints))
  return tuple((j, kids) for j, kids in out if kids)


def fitted_rotations(positions: np.ndarray, offsets: np.ndarray, joints: Joints) -> np.ndarray:
  """`[T, K, 3, 3]` per joint the rotations G with `G o_c` nearest `p_c - p_j` over its
  fitted children (Kabsch)."""
  positions = np.asarray(positions, np.float64)
  offsets = np.asarray(offsets, np.float64)
  H = [np.einsum('tca,cb->tab', positions[:, list(kids)] - positions[:, j:j + 1],
                 offsets[list(kids)]) for j, kids in joints]
  return nearest_rotation(np.stack(H, axis=1))


def world_rotations(local_rot: np.ndarray, rig: Rig, joints: Sequence[int]) -> np.ndarray:
  """`[T, K, 3, 3]` the world rotations of `joints` (the products of the local rotations along
  their ancestors; only those are computed)."""
  need = set()
  for j in joints:
    while j >= 0 and j not in need:
      need.add(j)
      j = rig.parents[j]
  local_rot = np.asarray(local_rot, np.float64)
  G = {}
  for j in sorted(need):  # parents come first (DESIGN: topological order)
    p = rig.parents[j]
    G[j] = local_rot[:, j] if p < 0 else G[p] @ local_rot[:, j]
  return np.stack([G[j] for j in joints], axis=1)


def bias_terms(local_rot: np.ndarray, positions: np.ndarray, offsets: np.ndarray, rig: Rig,
               joints: Joints | None = None) -> np.ndarray:
  """`[T, K, 3, 3]` per frame and calibrated joint `E_t = G_net,t^T G_fit,t`, zero where a
  frame has no fit. `joints`: `calibrated_joints(offsets, rig)`, when the caller has it."""
  joints = calibrated_joints(offsets, rig) if joints is None else joints
  T = len(local_rot)
  if not joints:
    return np.zeros((T, 0, 3, 3))
  positions = np.asarray(positions, np.float64)
  G = world_rotations(local_rot, rig, [j for j, _ in joints])
  ok = np.stack([np.all(np.isfinite(positions[:, (j,) + kids]), axis=(1, 2))
                 for j, kids in joints], axis=1)
  ok &= np.all(np.isfinite(G), axis=(2, 3))
  E = np.zeros((T, len(joints), 3, 3))
  if ok.any():
    fit = fitted_rotations(np.where(np.isfinite(positions), positions, 0.0), offsets, joints)
    E[ok] = (np.swapaxes(G, -1, -2) @ fit)[ok]
  return E


def mean_bias(terms: np.ndarray) -> np.ndarray:
  """`[..., K, 3, 3]` the rotations nearest the sums of `terms [T, ..., K, 3, 3]` over the
  first axis (identity where they are all zero)."""
  return _nearest_or_identity(np.asarray(terms, np.float64).sum(axis=0))


def _nearest_or_identity(S: np.ndarray) -> np.ndarray:
  E = np.broadcast_to(np.eye(3), S.shape).copy()
  some = S.any(axis=(-2, -1))
  if some.any():
    E[some] = nearest_rotation(S[some])
  return E


def apply_bias(local_rot: np.ndarray, E: np.ndarray, rig: Rig, joints: Joints) -> np.ndarray:
  """Local rotations `[T, J, 3, 3]` with each calibrated joint turned by its bias (`E [K, 3,
  3]`, or `[T, K, 3, 3]` per frame) and every other joint's world rotation kept: `R_j E_j`,
  `E_j^T R_c` for its children c."""
  out = np.array(local_rot, copy=True)
  E = np.asarray(E, np.float64)
  for k, (j, _) in enumerate(joints):
    Ek = E[..., k, :, :]
    out[:, j] = out[:, j] @ Ek
    kids = list(rig.children[j])
    Et = np.swapaxes(Ek, -1, -2)
    out[:, kids] = (Et[:, None] if Et.ndim == 3 else Et) @ out[:, kids]
  return out


def calibrate_clip(local_rot: np.ndarray, positions: np.ndarray, offsets: np.ndarray,
                   rig: Rig) -> tuple[np.ndarray, dict[int, np.ndarray]]:
  """(calibrated local rotations `[T, J, 3, 3]` in `local_rot`'s dtype, `{joint: bias [3,
  3]}`) of one subject's clip: the biases measured over all its frames (module docstring)."""
  joints = calibrated_joints(offsets, rig)
  E = mean_bias(bias_terms(local_rot, positions, offsets, rig, joints))
  out = apply_bias(local_rot, E, rig, joints).astype(np.asarray(local_rot).dtype)
  return out, {j: E[k] for k, (j, _) in enumerate(joints)}


class SubjectBias:
  """A stream's subject calibration: the biases of the frames seen so far (causal)."""

  def __init__(self):
    self.total: np.ndarray | None = None  # [K, 3, 3] the sum of the terms so far
    # The subject's (offsets' bytes, `calibrated_joints`), kept between calls: computed per
    # call they were half of a live frame's calibration.
    self._subject: tuple[bytes, Joints] | None = None

  def calibrate(self, local_rot: np.ndarray, positions: np.ndarray, offsets: np.ndarray,
                rig: Rig) -> np.ndarray:
    """The next frames `[n, J, 3, 3]`, each corrected by the mean biases up to and including
    itself (`calibrate_clip`'s terms, summed as they come; a new
    stream takes a new `SubjectBias`)."""
    offsets = np.asarray(offsets)
    key = offsets.tobytes()
    if self._subject is None or self._subject[0] != key:
      joints = calibrated_joints(offsets, rig)
      if self._subject is not None and joints != self._subject[1]:
        self.total = None  # other joints: the sums so far do not apply
      self._subject = (key, joints)
    joints = self._subject[1]
    local_rot = np.asarray(local_rot)
    if not joints:
      return local_rot
    running = np.cumsum(bias_terms(local_rot, positions, offsets, rig, joints), axis=0)
    if self.total is not None:
      running += self.total
    self.total = running[-1]
    return apply_bias(local_rot, _nearest_or_identity(running), rig, joints).astype(
        local_rot.dtype)
