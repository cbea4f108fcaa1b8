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


def gather_batch(dataset: Any, idx: np.ndarray, end_sites: bool = False
                 ) -> dict[str, np.ndarray]:
  """Host batch from a dataset with memory-mapped frame arrays and per-subject arrays.

  Indices are sorted for the memory-mapped read and the original order restored after, so a
  random batch touches each page once. `end_sites`: add the dataset's end sites (issue G2;
  a ValueError if it has none).
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
                 end_sites: bool = False
                 ) -> Iterator[tuple[int, np.ndarray, dict[str, np.ndarray]]]:
  """This process's part of the batches of steps `[start_step, end_step)`, in step order.

  Yields `(step, idx [B/P], batch)`: `idx` are the frame indices of this process's rows of the
  global batch of `step` and `batch` is `gather_batch(dataset, idx)` (leading axis B/P).
  """
  rows = process_rows(global_batch_size, process_index, process_count)
  for step in range(start_step, end_step):
    idx = batch_indices(step, global_batch_size, len(dataset.positions), seed)[rows]
    yield step, idx, gather_batch(dataset, idx, end_sites)


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


def mirror_batch(batch: dict, flip: jax.Array, rig: Rig) -> dict:
  """Mirror the examples where `flip: [B]` is True (whole subject: offsets, rotations, B).

  With M the reflection of the lateral axis and m the mirror map: `o'_j = M o_m(j)`,
  `R'_j = M R_m(j) M`, `p'_j = M p_m(j)`; the bone frames are recomputed from `o'`.
  """
  M = _mirror_matrix(rig)
  m = np.asarray(rig.mirror)
  off = batch['offsets'][:, m] @ M.T
  R = M @ batch['local_rot'][:, m] @ M
  pos = batch['positions'][:, m] @ M.T
  B = bf.bone_frames(off, rig)
  sel = lambda a, b: jnp.where(flip.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
  return {**batch, 'offsets': sel(off, batch['offsets']), 'local_rot': sel(R, batch['local_rot']),
          'positions': sel(pos, batch['positions']),
          'bone_frames': sel(B, batch['bone_frames'])}


def augment(batch: dict, key: jax.Array, aug: Any, rig: Rig) -> dict:
  """Applies the configured augmentations and recomputes clean positions by FK.

  `aug` fields: yaw (bool: uniform rotation about up), mirror (probability), bone_scale
  (half-width s: per-bone factors U[1-s, 1+s] shared by mirror pairs, directions kept),
  noise_mm (Gaussian sigma added to `input_positions` only). Adds `input_positions`.
  Sparse inputs (G2, `sample_input_masks`): joint_dropout, tracker_subsets, orientation_prob
  add `joint_mask` / `orientations` + `orientation_mask`; their keys come from `fold_in`, so the
  other augmentations draw exactly what they drew before these existed.
  End sites (G2): when the batch holds `end_sites [B, E, 3]`, each is carried in its leaf's
  frame (`e = G_leaf^T (x - p_leaf)`) through mirroring (`e' = M e_m`, left/right swapped),
  bone scaling (times the leaf's own bone factor) and yaw, placed again by FK
  (`x = p_leaf + G_leaf e`) and given the same input noise; `end_site_prob` (absent = 0) sets
  `end_site_mask [B, E]`: each present end site given with that probability.
  """
  k_yaw, k_mir, k_scale, k_noise = jax.random.split(key, 4)
  B_ = batch['positions'].shape[0]
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
    flip = jax.random.uniform(k_mir, (B_,)) < aug.mirror
    batch = mirror_batch(batch, flip, rig)
    if end_local is not None:
      end_local = jnp.where(flip[:, None, None],
                            end_local[:, end_site_mirror(rig)] @ _mirror_matrix(rig).T, end_local)
  if aug.bone_scale > 0:
    u = jax.random.uniform(k_scale, (B_, rig.num_joints), minval=1 - aug.bone_scale,
                           maxval=1 + aug.bone_scale)
    u = u[:, np.minimum(np.arange(rig.num_joints), np.asarray(rig.mirror))]
    batch = {**batch, 'offsets': batch['offsets'] * u[..., None]}
    if end_local is not None:
      end_local = end_local * u[:, leaves, None]
    changed = True
  root_pos = batch['positions'][:, 0]
  if aug.yaw:
    angle = jax.random.uniform(k_yaw, (B_,), minval=-jnp.pi, maxval=jnp.pi)
    Ry = rotations.matrix_from_axis_angle(angle[:, None] * jnp.asarray(rig.up, jnp.float32))
    batch = {**batch, 'local_rot': batch['local_rot'].at[:, 0].set(Ry @ batch['local_rot'][:, 0])}
    root_pos = jnp.einsum('bij,bj->bi', Ry, root_pos)
    changed = True
  if changed:
    _, pos = kinematics.forward_kinematics(batch['local_rot'], batch['offsets'], rig.parents,
                                           root_pos)
    batch = {**batch, 'positions': pos}
  noisy = batch['positions']
  if aug.noise_mm > 0:
    noisy = noisy + 1e-3 * aug.noise_mm * jax.random.normal(k_noise, noisy.shape)
  batch = {**batch, 'input_positions': noisy}
  if end_local is not None:
    k_es_noise, k_es = jax.random.split(jax.random.fold_in(key, 0x65))
    G = kinematics.local_to_global(batch['local_rot'], rig.parents)[:, leaves]
    ends = batch['positions'][:, leaves] + jnp.einsum('njab,njb->nja', G, end_local)
    present = jnp.all(jnp.isfinite(ends), axis=-1)
    if aug.noise_mm > 0:
      ends = ends + 1e-3 * aug.noise_mm * jax.random.normal(k_es_noise, ends.shape)
    prob = float(aug.get('end_site_prob', 0.0))
    batch = {**batch, 'end_sites': ends,
             'end_site_mask': present & (jax.random.uniform(k_es, present.shape) < prob)}
  return {**batch, **sample_input_masks(jax.random.fold_in(key, 0x62), batch, aug, rig)}


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
