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
chordal L2 mean; noise averages out), shrunk toward the identity where that mean is no surer
than the bias is large (`shrunk_mean`), and the joint is turned by it: `G_j <- G_j E_j`. Every
other joint keeps its world rotation, so the local rotations become `E_parent^T R_j E_j` (E the
identity at joints without a fit); each bias is measured against the network's own rotation,
so the joints' corrections do not depend on one another.

- Which joints (`plan`): the joints `Rig.observability(offsets)` calls `determined` for the
  subject (its children at a different place, `Rig.colocated`, span a plane: the joints
  swing-only IK solves by the same Kabsch fit, iterative_ik.py). cmu_body: Hips (LeftUpLeg,
  RightUpLeg; LowerBack
  sits on the Hips) and Spine1 (LeftArm, RightArm; Neck sits on it). A rig with fingers adds
  its hands. A subject without such a joint is left as it is.
- Frames where a joint, its fitted children or its network rotation are not finite are left
  out of that joint's mean; with none left its bias is the identity.
- `calibrate_clip` measures over all of a clip's frames (not causal); `SubjectBias`
  accumulates a stream's frames so far (causal: frame t is corrected by the mean of frames
  0..t).
- One code for both: the functions take `xp`, numpy (float64, clips and batches of a stream)
  or jax.numpy (`frame_update`: a live frame, float32, compiled by the solver once per plan;
  the stream's sums stay float64 on the host). The two agree to float32's rounding.
- The shrinkage (`shrunk_mean`; no parameter): the mean M of n terms has the angle theta
  from the identity, and the terms scatter about it by `s^2 = (3n - tr(M^T sum_t E_t)) / (3(n
  - 1))` per axis (`3 - tr(M^T E_t)` is about the squared angle between them). The bias turned
  by the positive-part James-Stein factor `max(0, 1 - s^2 / (n theta^2))` (3 axes, so p - 2 =
  1) has a lower expected squared error than the mean itself under Gaussian scatter, for any
  bias; with one frame (no scatter to measure) it is the identity. It matters most while few
  frames are in: a stream's first second under heavy tracker noise (at 20 mm it took the
  first 30 frames from 0.30 deg worse than the network alone to level with it on CMU val;
  BENCHMARKS.md, `experiments.stream_calibration`). A clip keeps most of each bias (median
  factor 0.94-0.999 on CMU val and test) and drops the ones within their own scatter.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ik_gat_jax.skeleton import Rig


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """What a subject's calibration computes, found once from its offsets (`plan`): the
  calibrated joints (root first), each one's fitted children and all its children, and the
  joints whose world rotations they need, as `(joint, parent)` in tree order. Derived from
  `fitted`: its (joint, fitted child) pairs and `select [K, P]`, which pairs belong to which
  joint (the fits' gathers and sums in a few array calls, whatever the number of joints)."""
  joints: tuple[int, ...]
  fitted: tuple[tuple[int, ...], ...]
  children: tuple[tuple[int, ...], ...]
  chain: tuple[tuple[int, int], ...]
  pair_joint: np.ndarray = dataclasses.field(init=False)
  pair_child: np.ndarray = dataclasses.field(init=False)
  select: np.ndarray = dataclasses.field(init=False)

  def __post_init__(self):
    pair_of = [k for k, kids in enumerate(self.fitted) for _ in kids]
    pairs = {'pair_joint': [j for j, kids in zip(self.joints, self.fitted) for _ in kids],
             'pair_child': [c for kids in self.fitted for c in kids]}
    for name, value in pairs.items():
      object.__setattr__(self, name, np.asarray(value, np.intp))
    select = np.zeros((len(self.joints), len(pair_of)))
    select[pair_of, np.arange(len(pair_of))] = 1.0
    object.__setattr__(self, 'select', select)

  @property
  def signature(self) -> tuple:
    """What a compiled `frame_update` depends on (the plan's structure, not the offsets)."""
    return self.joints, self.fitted, self.children, self.chain


# The math below runs on numpy (float64: clips, `SubjectBias.calibrate`) and on jax.numpy
# (float32: `frame_update`, a live frame's, compiled by the solver) alike: `xp` picks.


def nearest_rotation(M, xp=np):
  """The rotations `[..., 3, 3]` nearest `M` in the Frobenius norm (SVD, det +1; as
  `iterative_ik.project_to_so3`), in numpy or jax.numpy (`xp`)."""
  U, _, Vt = xp.linalg.svd(M)
  d = xp.sign(xp.linalg.det(U @ Vt))  # -1 for a reflection: turn the least singular direction
  return (U * xp.stack([xp.ones_like(d), xp.ones_like(d), d], axis=-1)[..., None, :]) @ Vt


def plan(offsets: np.ndarray, rig: Rig) -> Plan:
  """The subject's `Plan`: its `determined` joints (module docstring)."""
  offsets = np.asarray(offsets, np.float64)
  colocated = rig.colocated(offsets)
  joints = tuple(j for j, c in enumerate(rig.observability(offsets)) if c == 'determined')
  need = set()
  for j in joints:
    while j >= 0 and j not in need:
      need.add(j)
      j = rig.parents[j]
  return Plan(joints=joints,
              fitted=tuple(tuple(c for c in rig.children[j] if not colocated[c])
                           for j in joints),
              children=tuple(rig.children[j] for j in joints),
              chain=tuple((j, rig.parents[j]) for j in sorted(need)))  # parents first


def fitted_rotations(positions, offsets, p: Plan, xp=np):
  """`[..., K, 3, 3]` per calibrated joint the rotations G with `G o_c` nearest `p_c - p_j`
  over its fitted children (Kabsch); `positions [..., J, 3]`."""
  v = positions[..., p.pair_child, :] - positions[..., p.pair_joint, :]     # [..., P, 3]
  o = offsets[p.pair_child]                                                  # [P, 3]
  return nearest_rotation(xp.einsum('kq,...qa,qb->...kab', p.select, v, o), xp)


def world_rotations(local_rot, p: Plan, xp=np):
  """`[..., K, 3, 3]` the world rotations of the calibrated joints (the products of the local
  rotations along their ancestors; only those are computed)."""
  G = {}
  for j, up in p.chain:
    G[j] = local_rot[..., j, :, :] if up < 0 else G[up] @ local_rot[..., j, :, :]
  return xp.stack([G[j] for j in p.joints], axis=-3)


def bias_terms(local_rot, positions, offsets, p: Plan, xp=np):
  """`[T, K, 3, 3]` per frame and calibrated joint `E_t = G_net,t^T G_fit,t`, zero where a
  frame has no fit (the joint, a fitted child or the network's rotation not finite)."""
  if not p.joints:
    return xp.zeros(local_rot.shape[:-3] + (0, 3, 3))
  if xp is np:
    local_rot, positions = np.asarray(local_rot, np.float64), np.asarray(positions, np.float64)
    offsets = np.asarray(offsets, np.float64)
  G = world_rotations(local_rot, p, xp)
  finite = xp.isfinite(positions).all(axis=-1)                               # [..., J]
  unfit = ~(finite[..., p.pair_child] & finite[..., p.pair_joint])           # [..., P]
  ok = ((xp.einsum('kq,...q->...k', p.select, unfit.astype(G.dtype)) == 0)
        & xp.isfinite(G).all(axis=(-2, -1)))
  fit = fitted_rotations(xp.where(finite[..., None], positions, 0.0), offsets, p, xp)
  return xp.where(ok[..., None, None], xp.swapaxes(G, -1, -2) @ fit, 0.0)


_LEVI_CIVITA = np.zeros((3, 3, 3))
for _i, _j, _k in ((0, 1, 2), (1, 2, 0), (2, 0, 1)):
  _LEVI_CIVITA[_i, _j, _k], _LEVI_CIVITA[_i, _k, _j] = 1.0, -1.0


def shrunk_mean(S, n, xp=np):
  """`[..., 3, 3]` the biases of `n [...]` terms summing to `S [..., 3, 3]`: the chordal mean
  shrunk toward the identity by the positive-part James-Stein factor (module docstring); the
  identity where n < 2. (Few array calls: a live frame runs it.)"""
  if xp is np:
    S, n = np.asarray(S, np.float64), np.asarray(n, np.float64)
  M = nearest_rotation(S, xp)
  # M's angle theta from its skew part (2 sin(theta) u) and trace (1 + 2 cos(theta)): exact
  # for small angles in float32 too.
  w = 0.5 * (M[..., [2, 0, 1], [1, 2, 0]] - M[..., [1, 2, 0], [2, 0, 1]])
  norm = xp.sqrt(xp.einsum('...a,...a->...', w, w))
  theta = xp.arctan2(norm, (xp.einsum('...ii->...', M) - 1.0) / 2.0)
  # Per axis, the scatter of one term about the mean; the James-Stein factor from it (0 where
  # n < 2, 1 where the mean is the identity or there is no scatter).
  scatter = (3.0 * n - xp.einsum('...ab,...ab->...', M, S)) / (3.0 * xp.maximum(n - 1.0, 1.0))
  keep = 1.0 - xp.maximum(scatter, 0.0) / xp.maximum(n * theta * theta,
                                                     np.finfo(S.dtype).tiny)
  keep = xp.where(n < 2, 0.0, xp.clip(keep, 0.0, 1.0))
  # M^keep: the same axis u, the angle keep * theta (Rodrigues). Where M has no skew part
  # (theta 0, or pi, which no real bias is): M itself, or the identity where n < 2.
  ok = norm > 1e-12
  u = w / xp.where(ok, norm, 1.0)[..., None]
  a = (keep * theta)[..., None, None]
  c = xp.cos(a)
  out = (c * np.eye(3) - xp.sin(a) * xp.einsum('abc,...c->...ab', _LEVI_CIVITA, u)
         + (1.0 - c) * (u[..., :, None] * u[..., None, :]))
  return xp.where(ok[..., None, None], out, xp.where((n < 2)[..., None, None], np.eye(3), M))


def mean_bias(terms: np.ndarray) -> np.ndarray:
  """`[..., K, 3, 3]` the biases of `terms [T, ..., K, 3, 3]` over the first axis (frames
  without a fit hold zeros and do not count): `shrunk_mean`."""
  terms = np.asarray(terms, np.float64)
  return shrunk_mean(terms.sum(axis=0), terms.any(axis=(-2, -1)).sum(axis=0))


def apply_bias(local_rot, E, p: Plan, xp=np):
  """Local rotations `[..., J, 3, 3]` with each calibrated joint turned by its bias (`E [K, 3,
  3]`, or `[T, K, 3, 3]` per frame) and every other joint's world rotation kept: `R_j E_j`,
  `E_j^T R_c` for its children c."""
  if xp is np:
    out, E = np.array(local_rot, copy=True), np.asarray(E, np.float64)
  else:
    out = local_rot
  Et = xp.swapaxes(E, -1, -2)
  for k, (j, kids) in enumerate(zip(p.joints, p.children)):
    kids = list(kids)
    new = (out[..., j, :, :] @ E[..., k, :, :], Et[..., k, None, :, :] @ out[..., kids, :, :])
    if xp is np:
      out[..., j, :, :], out[..., kids, :, :] = new
    else:
      out = out.at[..., j, :, :].set(new[0]).at[..., kids, :, :].set(new[1])
  return out


def calibrate_clip(local_rot: np.ndarray, positions: np.ndarray, offsets: np.ndarray,
                   rig: Rig) -> tuple[np.ndarray, dict[int, np.ndarray]]:
  """(calibrated local rotations `[T, J, 3, 3]` in `local_rot`'s dtype, `{joint: bias [3,
  3]}`) of one subject's clip: the biases measured over all its frames (module docstring)."""
  p = plan(offsets, rig)
  E = mean_bias(bias_terms(local_rot, positions, offsets, p))
  out = apply_bias(local_rot, E, p).astype(np.asarray(local_rot).dtype)
  return out, dict(zip(p.joints, E))


def frame_update(local_rot: jax.Array, position: jax.Array, offsets: jax.Array,
                 total: jax.Array, count: jax.Array, p: Plan) -> tuple[jax.Array, jax.Array]:
  """One live frame in jax.numpy, for a stream whose earlier frames' terms sum to `total [K,
  3, 3]` over `count [K]` fits: (`local_rot [J, 3, 3]` corrected by the mean biases up to and
  including this frame, this frame's terms `[K, 3, 3]`, which the caller adds:
  `SubjectBias.add`). `position [J, 3]`, `offsets [J, 3]`. The solver compiles it once per
  plan (`Plan.signature`): a live frame's calibration in one call instead of numpy's many."""
  E = bias_terms(local_rot[None], position[None], offsets, p, jnp)[0]
  n = count + E.any(axis=(-2, -1)).astype(total.dtype)
  return apply_bias(local_rot, shrunk_mean(total + E, n, jnp), p, jnp), E


class SubjectBias:
  """A stream's subject calibration: the sums of the frames seen so far (causal), in
  float64 on the host; `calibrate` (numpy) and `frame_update` (compiled) both add to them."""

  def __init__(self):
    self.total: np.ndarray | None = None  # [K, 3, 3] the sum of the terms so far
    self.count: np.ndarray | None = None  # [K] how many frames had a fit
    # The subject's (offsets' bytes, `plan`), kept between calls: found per call it was most
    # of a live frame's calibration.
    self._subject: tuple[bytes, Plan] | None = None

  def subject(self, offsets: np.ndarray, rig: Rig) -> Plan:
    """The plan of the subject of `offsets` (found once per subject; the sums start afresh
    where a new subject has other calibrated joints)."""
    key = np.asarray(offsets).tobytes()
    if self._subject is None or self._subject[0] != key:
      p = plan(offsets, rig)
      if self._subject is not None and p.joints != self._subject[1].joints:
        self.total = self.count = None  # other joints: the sums so far do not apply
      self._subject = (key, p)
    return self._subject[1]

  def sums(self, K: int) -> tuple[np.ndarray, np.ndarray]:
    """(total `[K, 3, 3]`, count `[K]`) so far, zeros before the first frame."""
    if self.total is None:
      return np.zeros((K, 3, 3)), np.zeros(K)
    return self.total, self.count

  def add(self, terms: np.ndarray) -> None:
    """Adds one frame's terms `[K, 3, 3]` (`frame_update`'s; zeros: no fit)."""
    terms = np.asarray(terms, np.float64)
    total, count = self.sums(len(terms))
    self.total, self.count = total + terms, count + terms.any(axis=(-2, -1))

  def calibrate(self, local_rot: np.ndarray, positions: np.ndarray, offsets: np.ndarray,
                rig: Rig) -> np.ndarray:
    """The next frames `[n, J, 3, 3]`, each corrected by the mean biases up to and including
    itself (`calibrate_clip`'s terms, summed as they come; a new stream takes a new
    `SubjectBias`)."""
    p = self.subject(offsets, rig)
    local_rot = np.asarray(local_rot)
    if not p.joints or not len(local_rot):  # nothing to correct, nothing to learn from
      return local_rot
    terms = bias_terms(local_rot, positions, offsets, p)
    total, count = self.sums(len(p.joints))
    running = np.cumsum(terms, axis=0) + total
    counts = np.cumsum(terms.any(axis=(-2, -1)), axis=0) + count
    self.total, self.count = running[-1], counts[-1]
    return apply_bias(local_rot, shrunk_mean(running, counts), p).astype(local_rot.dtype)
