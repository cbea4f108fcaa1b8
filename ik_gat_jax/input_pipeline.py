"""Training input: a stateless batch order, host batching from memory-mapped shards, a
prefetching thread, and the augmentations of DESIGN section 5 as pure, jittable functions.

The batch order is a function of `(seed, step)` only: epoch e is a permutation of all frames
of the split (across every shard file) drawn from `np.random.default_rng([seed, e])`, and step
s takes the next `batch_size` entries of the endless concatenation of epochs. Resuming at step
s therefore yields exactly the batches an uninterrupted run would have seen, on any number of
devices or hosts.

Several hosts (DESIGN section 8): the global batch of step s is `batch_indices(s, ...)`; host p
of P reads only rows `process_rows(B, p, P)` of it from its memory maps, and the trainer
assembles the global array with `jax.make_array_from_process_local_data`. Only the pages a host
touches are read, so a split larger than RAM trains as well. Augmentation randomness is drawn
for the logical global batch inside the jitted step, so it does not depend on the device or
host count either.

A batch is a dict of arrays, leading axis B:
  positions [B, J, 3] world positions (m), local_rot [B, J, 3, 3], offsets [B, J, 3] (the
  frame's subject), bone_frames [B, J, 3, 3] (the subject's rest bone frames); with
  `end_sites=True` also end_sites [B, E, 3] (world end sites of `rig.leaves`, NaN = absent).
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
from typing import Any, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ik_gat_jax import bone_frames as bf
from ik_gat_jax import data as data_lib
from ik_gat_jax import kinematics
from ik_gat_jax import rotations
from ik_gat_jax import trackers
from ik_gat_jax import windows
from ik_gat_jax.skeleton import Rig

BATCH_KEYS = ('positions', 'local_rot', 'offsets', 'bone_frames')


def batch_indices(step: int, batch_size: int, num_examples: int, seed: int) -> np.ndarray:
  """Frame indices `[batch_size]` of training step `step` (module docstring)."""
  start = step * batch_size
  out = []
  while len(out) < batch_size:
    epoch, offset = divmod(start + len(out), num_examples)
    perm = epoch_permutation(seed, epoch, num_examples)
    out.extend(perm[offset:offset + batch_size - len(out)].tolist())
  return np.asarray(out, dtype=np.int64)


@functools.lru_cache(maxsize=2)
def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
  """The order `[num_examples]` of epoch `epoch`: a permutation of every frame of the split.

  Cached (this epoch and the next), so a step costs O(batch), not O(frames), on a large split.
  """
  perm = np.random.default_rng([seed, epoch]).permutation(num_examples)
  perm.flags.writeable = False
  return perm


def gather_batch(dataset: Any, idx: np.ndarray, end_sites: bool = False, window: int = 1
                 ) -> dict[str, np.ndarray]:
  """Host batch from a dataset with memory-mapped frame arrays and per-subject arrays.

  Indices are sorted for the memory-mapped read and the original order restored after, so a
  random batch touches each page once. `end_sites`: add the dataset's end sites (issue G2;
  a ValueError if it has none). `window` k > 1 (issue K): add each frame's k-1 past frames
  (`windows.py`: oldest first, never across a file boundary or frame gap), `history [B, k-1,
  J, 3]` and `history_local_rot [B, k-1, J, 3, 3]`; the window is k frames of the dataset's
  own rate (a model whose window_fps differs is refused by the trainer).
  """
  order = np.argsort(idx, kind='stable')
  inverse = np.empty_like(order)
  inverse[order] = np.arange(len(order))
  sidx = idx[order]
  subj = np.asarray(dataset.subject_id[sidx])[inverse]
  out = {
      'positions': np.asarray(dataset.positions[sidx], np.float32)[inverse],
      'local_rot': np.asarray(dataset.local_rot[sidx], np.float32)[inverse],
      'offsets': np.asarray(dataset.offsets, np.float32)[subj],
      'bone_frames': np.asarray(dataset.bone_frames, np.float32)[subj],
  }
  if end_sites:
    out['end_sites'] = np.asarray(data_lib.require_end_sites(dataset)[sidx], np.float32)[inverse]
  if window > 1:
    starts = windows.dataset_run_starts(dataset)
    i0, _, _ = windows.history_sources(idx, starts[idx], window)  # whole frames: w = 0
    flat = i0.reshape(-1)
    order = np.argsort(flat, kind='stable')
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    read = lambda a, tail: np.asarray(a[flat[order]], np.float32)[inverse].reshape(i0.shape + tail)
    J = dataset.positions.shape[1]
    out['history'] = read(dataset.positions, (J, 3))
    out['history_local_rot'] = read(dataset.local_rot, (J, 3, 3))
  return out


def process_rows(global_batch_size: int, process_index: int, process_count: int) -> slice:
  """Rows `[p*B/P, (p+1)*B/P)` of a global batch of `B` that process `p` of `P` reads."""
  if global_batch_size % process_count:
    raise ValueError(f'batch size {global_batch_size} is not divisible by the {process_count} '
                     'processes; use a multiple of the process count')
  per = global_batch_size // process_count
  return slice(process_index * per, (process_index + 1) * per)


def host_batches(dataset: Any, global_batch_size: int, seed: int, start_step: int,
                 end_step: int, process_index: int = 0, process_count: int = 1,
                 end_sites: bool = False, window: int = 1
                 ) -> Iterator[tuple[int, np.ndarray, dict[str, np.ndarray]]]:
  """This process's part of the batches of steps `[start_step, end_step)`, in step order.

  Yields `(step, idx [B/P], batch)`: `idx` are the frame indices of this process's rows of the
  global batch of `step` and `batch` is `gather_batch(dataset, idx)` (leading axis B/P).
  """
  rows = process_rows(global_batch_size, process_index, process_count)
  for step in range(start_step, end_step):
    idx = batch_indices(step, global_batch_size, len(dataset.positions), seed)[rows]
    yield step, idx, gather_batch(dataset, idx, end_sites, window)


_END = object()


class _Failure:
  def __init__(self, error: BaseException):
    self.error = error


class Prefetcher:
  """Runs an iterator on a background thread, at most `depth` items ahead, in its order.

  Use as a context manager (or call `close`): leaving it stops and joins the thread, also on an
  exception or KeyboardInterrupt in the consumer. An exception raised by the iterator is
  re-raised by `next` in the consumer. `busy_seconds` and `produced` count the thread's time
  inside the iterator (not waiting on a full queue) and the items it made, so
  `produced / busy_seconds` is the pipeline's own rate, whatever the consumer's speed.
  """

  def __init__(self, iterable: Iterable, depth: int = 2):
    if depth < 1:
      raise ValueError(f'prefetch depth must be at least 1, got {depth}')
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self.busy_seconds = 0.0
    self.produced = 0
    self._thread = threading.Thread(target=self._work, args=(iter(iterable),),
                                    name='prefetch', daemon=True)
    self._thread.start()

  def _work(self, iterator: Iterator) -> None:
    try:
      while not self._stop.is_set():
        t = time.perf_counter()
        try:
          item = next(iterator)
        except StopIteration:
          break
        self.busy_seconds += time.perf_counter() - t
        self.produced += 1
        if not self._put(item):
          return
    except BaseException as e:  # handed to the consumer, which re-raises it
      self._put(_Failure(e))
      return
    self._put(_END)

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.05)
        return True
      except queue.Full:
        continue
    return False

  def __iter__(self):
    return self

  def __next__(self):
    item = self._queue.get()
    if item is _END:
      self._queue.put(_END)  # later calls stop too
      raise StopIteration
    if isinstance(item, _Failure):
      self._queue.put(item)
      raise item.error
    return item

  def close(self) -> None:
    """Stops the thread (it finishes the item in hand) and waits for it."""
    self._stop.set()
    self._thread.join(timeout=60)

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# ----------------------------------------------------------------------------------------------
# Augmentation (jittable; each is off when its config value is 0 / False).


def _mirror_matrix(rig: Rig) -> jax.Array:
  lat = jnp.asarray(rig.lateral, jnp.float32)
  return jnp.eye(3) - 2.0 * jnp.outer(lat, lat)


MIRROR_ASYMMETRY_DEG = 20.0  # reference-pose bones this far from their partner's mirror image:
# the rig's reference pose is not a mirror-symmetric natural pose (CMU's template: 2.3 degrees,
# its subjects up to 14 at the Head; a re-rigged zero pose: tens of degrees)


def check_mirror(rig: Rig, what: str = 'augment.mirror',
                 off: str = 'set --config.augment.mirror=0') -> None:
  """Refuses mirroring (ValueError, at the first traced step, i.e. training start) for a rig
  whose reference pose is not mirror-symmetric (`Rig.mirror_asymmetry` above
  `MIRROR_ASYMMETRY_DEG`): `mirror_rotations` would then pair frames that are not mirror
  images, and the targets would be wrong. A rig without a template is not checked. `what` and
  `off` name the feature and how to turn it off in the message."""
  problem = mirror_problem(rig)
  if problem is None:
    return
  if not any(m != j for j, m in enumerate(rig.mirror)):
    raise ValueError(f'{what}: rig {rig.name!r} {problem}, so mirrored rotations would be '
                     f'wrong: {off}')
  raise ValueError(
      f'{what}: rig {rig.name!r} {problem} (limit {MIRROR_ASYMMETRY_DEG:g}), so mirrored '
      'rotations would be wrong. Give the rig its natural pose (convert with '
      '--reference_pose=first_frame, bvh_to_shards\'s or train_rig\'s, or a joint map '
      f'"reference_pose" of per-joint channel values) or {off}')


def mirror_problem(rig: Rig) -> str | None:
  """Why `rig` cannot be mirrored (a clause after its name), or None: its joint names pair no
  left and right joints, or its reference pose is not mirror-symmetric (`Rig.mirror_asymmetry`
  above `MIRROR_ASYMMETRY_DEG`); a rig without a template is not judged."""
  if not rig.template_offsets:
    return None
  angle, joint = rig.mirror_asymmetry()
  if angle <= MIRROR_ASYMMETRY_DEG:
    return None
  if not any(m != j for j, m in enumerate(rig.mirror)):
    return ('pairs no left and right joints by name (Left/Right, thigh_l or thigh.L, L_ or R_, '
            'LHip, lThigh), so no joint has a mirror partner')
  where = ('its reference pose' if rig.has_reference_pose else
           'its zero pose (it names no reference_pose)')
  return (f'is not mirror-symmetric in {where}: the {joint} bone is {angle:.0f} degrees from '
          'its partner\'s mirror image')


def mirror_rotations(rig: Rig) -> np.ndarray | None:
  """`[J, 3, 3]` `C_j = M F_m(j)^T M F_j` (float64), or None where every `C_j = I` (a rig whose
  reference pose is its zero pose): the fixed change of frame from "mirror image of partner
  m(j)'s frame" to joint j's own frame (`mirror_batch`)."""
  if not rig.has_reference_pose:
    return None
  lat = np.asarray(rig.lateral)
  M = np.eye(3) - 2.0 * np.outer(lat, lat)
  F = rig.reference_rotations()
  m = np.asarray(rig.mirror)
  return np.einsum('ab,jcb,cd,jde->jae', M, F[m], M, F)


def mirror_batch(batch: dict, flip: jax.Array, rig: Rig) -> dict:
  """Mirror the examples where `flip: [B]` is True (whole subject: offsets, rotations, B).

  With M the reflection of the lateral axis (det -1) and m the mirror map (`m(parent(j)) =
  parent(m(j))`), the mirrored motion has positions `p'_j = M p_m(j)` and world frames
  `G'_j = M G_m(j) M C_j`, the mirror image of partner m(j)'s frame turned into joint j's own
  frame convention by the fixed `C_j = M F_m(j)^T M F_j` (`mirror_rotations`; `F` the world
  frames of the rig's reference pose, skeleton.py). Then, exactly:
    `R'_j = C_parent^T (M R_m(j) M) C_j`  (root: `M R_m(root) M C_root`),
    `o'_j = C_parent^T M o_m(j)`          (root: `M o_m(root)`),
  and FK holds: `p'_parent + G'_parent o'_j = M (p_m(p) + G_m(p) o_m(j)) = M p_m(j)`. The
  mirrored sample is the mirror-image *body* (offsets `o'`, bone frames recomputed from them),
  so it is exact for any subject, symmetric or not. Why `C`: in the reference pose (a natural,
  mirror-symmetric T-pose) joint j's frame is `F_j`; the mirror image of m(j)'s frame there is
  `M F_m(j) M`, which differs from `F_j` whenever the rig binds left and right differently;
  `C_j` maps one to the other, so the reference pose mirrors onto itself (`G'_j = F_j`) and a
  mirrored sample is expressed in the rig's own joint frames. Without it (`R'_j = M R_m(j) M`,
  correct only where `F = I`) a re-rigged subject's mirrored targets live in the partner's
  frame convention, which the network cannot tell from the positions. Rig invariance: with
  binds `A` (`F -> F A`), `C'_j = M A_m(j)^T M C_j A_j`, and mirroring the re-rigged sample
  gives `R'_j = A_p^T R*_j A_j`, `o'_j = A_p^T o*_j` of the mirrored original
  (tests/rig_invariance_test.py). `check_mirror` refuses a rig whose reference pose is not
  mirror-symmetric.
  """
  check_mirror(rig)
  off = mirror_offsets(batch['offsets'], rig)
  R = mirror_local(batch['local_rot'], rig)
  pos = mirror_positions(batch['positions'], rig)
  B = bf.bone_frames(off, rig)
  sel = lambda a, b: jnp.where(flip.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
  return {**batch, 'offsets': sel(off, batch['offsets']), 'local_rot': sel(R, batch['local_rot']),
          'positions': sel(pos, batch['positions']),
          'bone_frames': sel(B, batch['bone_frames'])}


def _mirror_changes(rig: Rig) -> tuple[np.ndarray | None, np.ndarray | None]:
  """`(C [J, 3, 3], C_parent [J, 3, 3])` of `mirror_rotations` (identity at the root's parent),
  or `(None, None)` for a rig whose reference pose is its zero pose."""
  C = mirror_rotations(rig)
  if C is None:
    return None, None
  return C, np.stack([np.eye(3) if p < 0 else C[p] for p in rig.parents])


def mirror_positions(x: jax.Array, rig: Rig) -> jax.Array:
  """World points `[..., J, 3]` of the mirror-image body: `x'_j = M x_m(j)` (`mirror_batch`)."""
  return x[..., np.asarray(rig.mirror), :] @ _mirror_matrix(rig).T.astype(x.dtype)


def mirror_offsets(offsets: jax.Array, rig: Rig) -> jax.Array:
  """Rest offsets `[..., J, 3]` of the mirror-image body: `o'_j = C_parent^T M o_m(j)`."""
  off = mirror_positions(offsets, rig)
  _, Cp = _mirror_changes(rig)
  if Cp is None:
    return off
  return jnp.einsum('jba,...jb->...ja', jnp.asarray(Cp, off.dtype), off)


def mirror_local(R: jax.Array, rig: Rig) -> jax.Array:
  """Local rotations `[..., J, 3, 3]` of the mirror-image motion:
  `R'_j = C_parent^T (M R_m(j) M) C_j` (`mirror_batch`)."""
  M = _mirror_matrix(rig).astype(R.dtype)
  R = M @ R[..., np.asarray(rig.mirror), :, :] @ M
  C, Cp = _mirror_changes(rig)
  if C is None:
    return R
  return jnp.asarray(np.swapaxes(Cp, -1, -2), R.dtype) @ R @ jnp.asarray(C, R.dtype)


def unmirror_local(R_mirrored: jax.Array, rig: Rig) -> jax.Array:
  """The inverse of `mirror_local`: the local rotations of the motion whose mirror image has
  `R_mirrored`, `R_m(j) = M C_parent R'_j C_j^T M` (m an involution, so
  `unmirror_local(mirror_local(R)) = R` up to rounding)."""
  C, Cp = _mirror_changes(rig)
  R = R_mirrored
  if C is not None:
    R = jnp.asarray(Cp, R.dtype) @ R @ jnp.asarray(np.swapaxes(C, -1, -2), R.dtype)
  M = _mirror_matrix(rig).astype(R.dtype)
  return (M @ R @ M)[..., np.asarray(rig.mirror), :, :]


def _repeat(a: jax.Array, group: int) -> jax.Array:
  """One draw per group of `group` consecutive rows, repeated to every row of the group."""
  return a if group == 1 else jnp.repeat(a, group, axis=0)


def augment(batch: dict, key: jax.Array, aug: Any, rig: Rig, group: int = 1) -> dict:
  """Applies the configured augmentations and recomputes clean positions by FK.

  `group` (issue K's windows): the rows are groups of `group` consecutive frames of one sample
  (`augment_windows`); the mirror, bone scale and yaw and the tracker noise's level and clean
  choice are drawn once per group (one body, one tracker), the per-frame noise per row. With
  `group=1` every draw is what it was before windows existed.

  `aug` fields: yaw (bool: uniform rotation about up), tilt_deg (absent = 0 = off: a rotation
  by U[0, tilt_deg] degrees about a uniformly random horizontal axis), mirror (probability),
  bone_scale (half-width s: per-bone factors U[1-s, 1+s] shared by mirror pairs, directions
  kept),
  noise_mm (Gaussian sigma added to `input_positions` only). Adds `input_positions`.
  Tracker noise (issue J; `tracker_noise`, absent = off): noise_mm_max, clean_frac,
  bone_jitter, outlier_prob, also on `input_positions` (and end sites) only; the fixed
  noise_mm is added on top of it with its own (old) draw, so both may be set.
  Sparse inputs (G2, `sample_input_masks`): joint_dropout, tracker_subsets, orientation_prob
  add `joint_mask` / `orientations` + `orientation_mask`; their keys come from `fold_in`, so the
  other augmentations draw exactly what they drew before these existed.
  End sites (G2): when the batch holds `end_sites [B, E, 3]`, each is carried in its leaf's
  frame (`e = G_leaf^T (x - p_leaf)`) through mirroring (`e' = C^T M e_m`, `mirror_end_local`),
  bone scaling (times the leaf's own bone factor) and yaw, placed again by FK
  (`x = p_leaf + G_leaf e`) and given the same input noise; `end_site_prob` (absent = 0) sets
  `end_site_mask [B, E]`: each present end site given with that probability.
  """
  k_yaw, k_mir, k_scale, k_noise = jax.random.split(key, 4)
  B_ = batch['positions'].shape[0]
  if B_ % group:
    raise ValueError(f'augment: {B_} rows are not whole groups of {group}')
  n = B_ // group
  changed = False
  leaves = list(rig.leaves)
  end_local = None
  if 'end_sites' in batch:
    G0 = kinematics.local_to_global(batch['local_rot'], rig.parents)[:, leaves]
    rel = batch['end_sites'] - batch['positions'][:, leaves]
    end_local = jnp.einsum('njba,njb->nja', G0, rel)
  elif float(aug.get('end_site_prob', 0.0)) > 0:
    raise ValueError('augment.end_site_prob > 0 needs end sites in the batch: shards converted '
                     'with them (data.require_end_sites) and gather_batch(end_sites=True)')
  if aug.mirror > 0:
    flip = _repeat(jax.random.uniform(k_mir, (n,)) < aug.mirror, group)
    batch = mirror_batch(batch, flip, rig)
    if end_local is not None:
      end_local = jnp.where(flip[:, None, None], mirror_end_local(end_local, rig), end_local)
  if aug.bone_scale > 0:
    u = _repeat(jax.random.uniform(k_scale, (n, rig.num_joints), minval=1 - aug.bone_scale,
                                   maxval=1 + aug.bone_scale), group)
    u = u[:, np.minimum(np.arange(rig.num_joints), np.asarray(rig.mirror))]
    batch = {**batch, 'offsets': batch['offsets'] * u[..., None]}
    if end_local is not None:
      end_local = end_local * u[:, leaves, None]
    changed = True
  root_pos = batch['positions'][:, 0]
  if aug.yaw:
    angle = _repeat(jax.random.uniform(k_yaw, (n,), minval=-jnp.pi, maxval=jnp.pi), group)
    Ry = rotations.matrix_from_axis_angle(angle[:, None] * jnp.asarray(rig.up, jnp.float32))
    batch = {**batch, 'local_rot': batch['local_rot'].at[:, 0].set(Ry @ batch['local_rot'][:, 0])}
    root_pos = jnp.einsum('bij,bj->bi', Ry, root_pos)
    changed = True
  tilt = float(aug.get('tilt_deg', 0.0))
  if tilt > 0:  # session 44: a turn about a random horizontal axis, U[0, tilt] degrees
    k_dir, k_ang = jax.random.split(jax.random.fold_in(key, 0x74))
    lat, fwd = jnp.asarray(rig.lateral, jnp.float32), jnp.asarray(rig.forward, jnp.float32)
    a = _repeat(jax.random.uniform(k_dir, (n,), minval=-jnp.pi, maxval=jnp.pi), group)
    angle = _repeat(jax.random.uniform(k_ang, (n,), maxval=math.radians(tilt)), group)
    axis = jnp.cos(a)[:, None] * lat + jnp.sin(a)[:, None] * fwd
    Rt = rotations.matrix_from_axis_angle(angle[:, None] * axis)
    batch = {**batch, 'local_rot': batch['local_rot'].at[:, 0].set(Rt @ batch['local_rot'][:, 0])}
    root_pos = jnp.einsum('bij,bj->bi', Rt, root_pos)
    changed = True
  if changed:
    _, pos = kinematics.forward_kinematics(batch['local_rot'], batch['offsets'], rig.parents,
                                           root_pos)
    batch = {**batch, 'positions': pos}
  noisy, ends = batch['positions'], None
  if end_local is not None:
    k_es_noise, k_es = jax.random.split(jax.random.fold_in(key, 0x65))
    G = kinematics.local_to_global(batch['local_rot'], rig.parents)[:, leaves]
    ends = batch['positions'][:, leaves] + jnp.einsum('njab,njb->nja', G, end_local)
    present = jnp.all(jnp.isfinite(ends), axis=-1)
  # Tracker noise (issue J; `tracker_noise`): the identity, returning its inputs, when all off.
  noisy, ends, _ = tracker_noise(key, noisy, aug, rig, ends, group=group)
  if aug.noise_mm > 0:
    noisy = noisy + 1e-3 * aug.noise_mm * jax.random.normal(k_noise, noisy.shape)
  batch = {**batch, 'input_positions': noisy}
  if end_local is not None:
    if aug.noise_mm > 0:
      ends = ends + 1e-3 * aug.noise_mm * jax.random.normal(k_es_noise, ends.shape)
    prob = float(aug.get('end_site_prob', 0.0))
    batch = {**batch, 'end_sites': ends,
             'end_site_mask': present & (jax.random.uniform(k_es, present.shape) < prob)}
  return {**batch, **sample_input_masks(jax.random.fold_in(key, 0x62), batch, aug, rig)}


# Tracker noise (issue J): each part draws from its own key, `fold_in(augmentation key, K)`, so
# switching one part on or off leaves the draws of every other part (and of the augmentations
# above, which use `split(key, 4)` and fold_in constants 0x62, 0x65) exactly as they were.
NOISE_KEY_LEVEL = 0x4A01    # per-sample sigma ~ U[0, noise_mm_max] and its Gaussian draws
NOISE_KEY_CLEAN = 0x4A02    # which samples the noise model leaves clean (clean_frac)
NOISE_KEY_BONE = 0x4A03     # per-frame bone-length factors (bone_jitter)
NOISE_KEY_OUTLIER = 0x4A04  # outlier sample, joint, direction and magnitude (outlier_prob)
OUTLIER_MM = (50.0, 200.0)  # outlier displacement magnitude range, uniform (mm)
BONE_FACTOR_CLIP = (0.5, 1.5)  # bone factors are clipped here (25 std at bone_jitter 0.02)


def tracker_noise(key: jax.Array, positions: jax.Array, aug: Any, rig: Rig,
                  end_sites: jax.Array | None = None, return_info: bool = False,
                  group: int = 1):
  """Tracker-like input noise (issue J) on clean `positions [B, J, 3]` (m) and, when given,
  end sites `[B, E, 3]` of `rig.leaves` (NaN = absent, stays NaN). Returns
  `(input positions, input end sites or None, info)`; info is {} unless `return_info`.

  `aug` fields, each absent = 0 = off (old configs lack them); all off returns the inputs
  themselves. Applied in this order, per sample:
    bone_jitter s: per-frame bone-length inconsistency. Every bone vector `p_j - p_parent(j)`
      is scaled by its own factor `1 + s * N(0, 1)` (clipped to BONE_FACTOR_CLIP) and the
      positions re-accumulated down the tree from the root (`x_j = x_parent + f_j (p_j -
      p_parent)`), so the root stays, directions stay, lengths vary by relative std s. An end
      site's vector from its leaf gets a factor of its own.
    noise_mm_max m: i.i.d. Gaussian noise per coordinate with a per-sample level sigma ~
      U[0, m] (mm), joints and end sites alike.
    outlier_prob q: with probability q per sample, ONE joint (uniform over all J, root
      included) is displaced along a uniformly random direction by U[OUTLIER_MM] mm; end
      sites get no outliers. One per sample (not an independent draw per joint) keeps the
      meaning of q fixed whatever J is, and matches a tracker's occasional single jump.
    clean_frac c: that share of samples is left exactly clean by all three parts above
      (sigma 0, no jitter, no outlier), so the clean-input accuracy keeps being trained.
  `group` (`augment`): the level and the clean choice are drawn per group of rows.
  The fixed `noise_mm` of `augment` is separate and added on top (its old draw), to every
  sample: both set give per-coordinate variance `noise_mm^2 + sigma^2`.
  info (for tests and logs): sigma_mm [B], clean [B] bool, bone_factor [B, J] (1 at the root),
  end_site_factor [B, E], outlier_joint [B] (-1 = none), outlier_mm [B] (0 = none); each only
  when its part is on.
  """
  m = float(aug.get('noise_mm_max', 0.0))
  c = float(aug.get('clean_frac', 0.0))
  s = float(aug.get('bone_jitter', 0.0))
  q = float(aug.get('outlier_prob', 0.0))
  for name, v in (('noise_mm_max', m), ('bone_jitter', s)):
    if v < 0:
      raise ValueError(f'augment.{name} must be >= 0, got {v}')
  for name, v in (('clean_frac', c), ('outlier_prob', q)):
    if not 0.0 <= v <= 1.0:
      raise ValueError(f'augment.{name} is a probability in [0, 1], got {v}')
  info: dict[str, jax.Array] = {}
  if not (m > 0 or s > 0 or q > 0):
    return positions, end_sites, info
  B_, J = positions.shape[:2]
  n = B_ // group
  dirty = jnp.ones((B_,), bool)
  if c > 0:
    dirty = _repeat(jax.random.uniform(jax.random.fold_in(key, NOISE_KEY_CLEAN), (n,)) >= c,
                    group)
    info['clean'] = ~dirty
  leaves = list(rig.leaves)
  x, ends = positions, end_sites
  if s > 0:
    k_bone, k_end = jax.random.split(jax.random.fold_in(key, NOISE_KEY_BONE))
    f = jnp.clip(1.0 + s * jax.random.normal(k_bone, (B_, J)), *BONE_FACTOR_CLIP).at[:, 0].set(1.0)
    out = [positions[:, 0]]
    for j in range(1, J):
      p = rig.parents[j]
      out.append(out[p] + f[:, j, None] * (positions[:, j] - positions[:, p]))
    x = jnp.stack(out, axis=1)
    info['bone_factor'] = f
    if ends is not None:
      fe = jnp.clip(1.0 + s * jax.random.normal(k_end, ends.shape[:2]), *BONE_FACTOR_CLIP)
      ends = x[:, leaves] + fe[..., None] * (ends - positions[:, leaves])
      info['end_site_factor'] = fe
  if m > 0:
    k_sigma, k_joint, k_end = jax.random.split(jax.random.fold_in(key, NOISE_KEY_LEVEL), 3)
    sigma = jnp.where(dirty, _repeat(jax.random.uniform(k_sigma, (n,), maxval=m), group), 0.0)
    x = x + 1e-3 * sigma[:, None, None] * jax.random.normal(k_joint, x.shape)
    if ends is not None:
      ends = ends + 1e-3 * sigma[:, None, None] * jax.random.normal(k_end, ends.shape)
    info['sigma_mm'] = sigma
  if q > 0:
    k_hit, k_joint, k_dir, k_mag = jax.random.split(jax.random.fold_in(key, NOISE_KEY_OUTLIER), 4)
    hit = (jax.random.uniform(k_hit, (B_,)) < q) & dirty
    joint = jax.random.randint(k_joint, (B_,), 0, J)
    direction = rotations.normalize(jax.random.normal(k_dir, (B_, 3)))
    mag = jax.random.uniform(k_mag, (B_,), minval=OUTLIER_MM[0], maxval=OUTLIER_MM[1])
    at = hit[:, None] & (jnp.arange(J) == joint[:, None])
    x = jnp.where(at[..., None], x + 1e-3 * (mag[:, None] * direction)[:, None], x)
    info['outlier_joint'] = jnp.where(hit, joint, -1)
    info['outlier_mm'] = jnp.where(hit, mag, 0.0)
  x = jnp.where(dirty[:, None, None], x, positions)  # clean samples exactly clean
  if ends is not None:
    ends = jnp.where(dirty[:, None, None], ends, end_sites)
  return x, ends, (info if return_info else {})


def mirror_end_local(end_local: jax.Array, rig: Rig) -> jax.Array:
  """End sites in their leaf's frame `[B, E, 3]`, mirrored: `e'_j = C_j^T M e_m(j)`
  (`mirror_batch`; `M e_m` where the rig's reference pose is its zero pose)."""
  e = end_local[:, end_site_mirror(rig)] @ _mirror_matrix(rig).T
  C = mirror_rotations(rig)
  if C is None:
    return e
  Ct = np.swapaxes(C[np.asarray(rig.leaves)], -1, -2)
  return jnp.einsum('jab,...jb->...ja', jnp.asarray(Ct, e.dtype), e)


def end_site_mirror(rig: Rig) -> np.ndarray:
  """`[E]`: for each end site (of `rig.leaves`), the index of its mirror partner's."""
  leaves = list(rig.leaves)
  return np.asarray([leaves.index(rig.mirror[k]) for k in leaves])


def sample_input_masks(key: jax.Array, batch: dict, aug: Any, rig: Rig) -> dict:
  """Random sparse-input masks for one batch (issue G2); {} when all are off.

  `aug` fields (absent = 0): joint_dropout p (per frame a rate r ~ U[0, p], then every joint,
  the root included, dropped with probability r), tracker_subsets q (per frame, with
  probability q the mask is instead one of the rig's named subsets, uniformly), full_frames f
  (with probability f a frame keeps every joint, whatever p and q drew), orientation_prob
  o (each joint's world rotation given with probability o, independently of its position; the
  model uses only its `orientation_inputs` joints). Returns `joint_mask [B, J]` bool and/or
  `orientations [B, J, 3, 3]` (G from the batch's local rotations) + `orientation_mask [B, J]`.
  """
  p, q = float(aug.get('joint_dropout', 0.0)), float(aug.get('tracker_subsets', 0.0))
  o = float(aug.get('orientation_prob', 0.0))
  B_, J = batch['positions'].shape[:2]
  k_rate, k_drop, k_use, k_pick, k_orient = jax.random.split(key, 5)
  out = {}
  if p > 0 or q > 0:
    rate = jax.random.uniform(k_rate, (B_, 1), maxval=p)
    mask = jax.random.uniform(k_drop, (B_, J)) >= rate
    if q > 0:
      subsets = trackers.subset_masks(rig)
      if not len(subsets):
        raise ValueError(f'augment.tracker_subsets={q} but rig {rig.name!r} has no named '
                         'tracker subsets (ik_gat_jax/trackers.py)')
      pick = jnp.asarray(subsets)[jax.random.randint(k_pick, (B_,), 0, len(subsets))]
      mask = jnp.where(jax.random.uniform(k_use, (B_, 1)) < q, pick, mask)
    f = float(aug.get('full_frames', 0.0))
    if f > 0:  # own key (fold_in): the draws above stay what they were without it
      full = jax.random.uniform(jax.random.fold_in(key, 7), (B_, 1)) < f
      mask = mask | full
    out['joint_mask'] = mask
  if o > 0:
    out['orientations'] = kinematics.local_to_global(batch['local_rot'], rig.parents)
    out['orientation_mask'] = jax.random.uniform(k_orient, (B_, J)) < o
  return out


# ----------------------------------------------------------------------------------------------
# Windows (issue K): a sample is the current frame and its k-1 past frames.

NOISE_KEY_BIAS = 0x4B01   # per-window constant offset of every joint (bias_mm)
NOISE_KEY_HOLD = 0x4B02   # which window holds a joint, which joint, for how many frames
NOISE_KEY_START = 0x4B03  # which windows start a stream, and how much history they keep


def augment_windows(batch: dict, key: jax.Array, aug: Any, rig: Rig) -> dict:
  """`augment` for window samples: `batch` as `gather_batch(window=k)` gives it (current frame
  `positions [B, J, 3]`, `local_rot`, ... and `history [B, k-1, J, 3]`, `history_local_rot`).

  The k frames of a sample become k consecutive rows (oldest first) through
  `augment(group=k)`: one mirror, bone scale, yaw, tracker noise level and clean choice per
  sample, per-frame Gaussian noise, bone-length jitter and outliers (J's noise model, each
  frame its own draw, as a tracker's frames are). Then `temporal_noise` on the window. Returns
  the current frame's `positions`, `local_rot`, `offsets`, `bone_frames`, `input_positions`
  and the noisy past frames `history [B, k-1, J, 3]`.
  """
  out, noisy = _augmented_window_frames(batch, key, aug, rig)
  B_, k, J = noisy.shape[:3]
  current = lambda a: a.reshape((B_, k) + a.shape[1:])[:, -1]
  return {'positions': current(out['positions']), 'local_rot': current(out['local_rot']),
          'offsets': current(out['offsets']), 'bone_frames': current(out['bone_frames']),
          'input_positions': noisy[:, -1], 'history': noisy[:, :-1]}


def augment_window_pairs(batch: dict, key: jax.Array, aug: Any, rig: Rig) -> dict:
  """`augment_windows` for the velocity loss (issue K, `loss.velocity_weight`): samples of k+1
  frames (`gather_batch(window=k+1)`) augmented as one window (one body, one tracker, the same
  noisy frames), returned as its two overlapping windows of k frames, the earlier one first:
  `[2B, ...]` rows, row b the window ending one frame before row B + b's."""
  out, noisy = _augmented_window_frames(batch, key, aug, rig)
  B_, k1, J = noisy.shape[:3]
  k = k1 - 1
  pair = lambda a: a.reshape((B_, k1) + a.shape[1:])[:, -2:].swapaxes(0, 1).reshape(
      (2 * B_,) + a.shape[1:])
  windows_ = jnp.concatenate([noisy[:, :k], noisy[:, 1:]])  # [2B, k, J, 3]
  return {'positions': pair(out['positions']), 'local_rot': pair(out['local_rot']),
          'offsets': pair(out['offsets']), 'bone_frames': pair(out['bone_frames']),
          'input_positions': windows_[:, -1], 'history': windows_[:, :-1]}


def _augmented_window_frames(batch: dict, key: jax.Array, aug: Any, rig: Rig):
  """The k frames of each window sample augmented (`augment_windows`): `augment`'s flat
  output (`[B * k, ...]`, oldest first per sample) and the noisy frames `[B, k, J, 3]`."""
  B_, J = batch['positions'].shape[:2]
  k = batch['history'].shape[1] + 1
  flat = {
      'positions': jnp.concatenate([batch['history'], batch['positions'][:, None]], 1
                                   ).reshape(B_ * k, J, 3),
      'local_rot': jnp.concatenate([batch['history_local_rot'], batch['local_rot'][:, None]], 1
                                   ).reshape(B_ * k, J, 3, 3),
      'offsets': jnp.repeat(batch['offsets'], k, axis=0),
      'bone_frames': jnp.repeat(batch['bone_frames'], k, axis=0)}
  out = augment(flat, key, aug, rig, group=k)
  return out, temporal_noise(key, out['input_positions'].reshape(B_, k, J, 3), aug, rig)


def temporal_noise(key: jax.Array, x: jax.Array, aug: Any, rig: Rig,
                   return_info: bool = False):
  """Time-correlated tracker errors on noisy windows `x [B, k, J, 3]` (oldest first, m), issue
  K; `key` is the augmentation key of `augment` (the samples `clean_frac` left clean there are
  left clean here too). `aug` fields, each absent = 0 = off:
    bias_mm b: a drift, i.e. an error that persists over the window: every joint of a sample
      is offset by the same vector in all k frames, N(0, s^2) per coordinate with a per-sample
      level s ~ U[0, b] mm (a tracker's drift changes over seconds, so over a window of a
      fraction of a second it is a constant offset).
    hold_prob q: with probability q per sample, one joint (uniform) drops out for the last h
      frames of the window (h ~ U{1 .. k-1}, the current frame included): the tracker repeats
      that joint's last good position, frame k-1-h's.
    window_start_prob p: with probability p per sample (clean ones too), the window is at the
      start of a stream: only c ~ U{0 .. k-2} past frames exist and the older ones are copies of
      the oldest that does (`windows.py`'s rule for the first frames of a stream).
  Returns `x` (the same array when all are off), or `(x, info)` with `return_info` (bias_mm
  [B], hold_joint [B] (-1 = none), hold_frames [B], start_kept [B] (k-1 = full window))."""
  b = float(aug.get('bias_mm', 0.0))
  q = float(aug.get('hold_prob', 0.0))
  p = float(aug.get('window_start_prob', 0.0))
  c = float(aug.get('clean_frac', 0.0))
  if b < 0:
    raise ValueError(f'augment.bias_mm must be >= 0, got {b}')
  for name, v in (('hold_prob', q), ('window_start_prob', p)):
    if not 0.0 <= v <= 1.0:
      raise ValueError(f'augment.{name} is a probability in [0, 1], got {v}')
  B_, k, J = x.shape[:3]
  info: dict[str, jax.Array] = {}
  dirty = jnp.ones((B_,), bool)
  if c > 0:  # the same draw as tracker_noise's (group k: one per sample)
    dirty = jax.random.uniform(jax.random.fold_in(key, NOISE_KEY_CLEAN), (B_,)) >= c
  if b > 0:
    k_level, k_off = jax.random.split(jax.random.fold_in(key, NOISE_KEY_BIAS))
    level = jnp.where(dirty, jax.random.uniform(k_level, (B_,), maxval=b), 0.0)
    x = x + 1e-3 * level[:, None, None, None] * jax.random.normal(k_off, (B_, 1, J, 3))
    info['bias_mm'] = level
  if q > 0 and k > 1:
    k_hit, k_joint, k_len = jax.random.split(jax.random.fold_in(key, NOISE_KEY_HOLD), 3)
    hit = (jax.random.uniform(k_hit, (B_,)) < q) & dirty
    joint = jax.random.randint(k_joint, (B_,), 0, J)
    h = jax.random.randint(k_len, (B_,), 1, k)
    frame = jnp.arange(k)[None]
    held = x[jnp.arange(B_), k - 1 - h, joint]  # [B, 3], the last good position
    at = (hit[:, None] & (frame >= k - h[:, None]))[:, :, None] & (
        jnp.arange(J)[None, None] == joint[:, None, None])
    x = jnp.where(at[..., None], held[:, None, None], x)
    info['hold_joint'] = jnp.where(hit, joint, -1)
    info['hold_frames'] = jnp.where(hit, h, 0)
  if p > 0 and k > 1:
    k_start, k_kept = jax.random.split(jax.random.fold_in(key, NOISE_KEY_START))
    start = jax.random.uniform(k_start, (B_,)) < p
    kept = jnp.where(start, jax.random.randint(k_kept, (B_,), 0, k - 1), k - 1)
    src = jnp.maximum(jnp.arange(k)[None], k - 1 - kept[:, None])  # [B, k]
    x = jnp.take_along_axis(x, src[:, :, None, None], axis=1)
    info['start_kept'] = kept
  return (x, info) if return_info else x
