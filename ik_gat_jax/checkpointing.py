"""Checkpoints: save, restore, latest, on orbax `CheckpointManager`.

A checkpoint directory holds numbered steps; each step has two items: `state` (a pytree of
arrays: parameters, and for training checkpoints the optimizer state) and `meta` (JSON: config,
rig, metrics, provenance, format version). Restoring goes through an abstract tree (shapes,
dtypes and shardings from `jax.eval_shape`), so a checkpoint written on 8 devices restores on 1.
Writes are atomic (orbax writes a temporary directory and renames it), so an interrupted save
never leaves a half-written step behind.

A checkpoint that cannot be used (corrupt metadata, a truncated or missing array file, a tree or
shapes that do not match the model being restored) raises `CheckpointError` with one line naming
the checkpoint directory, the step and the reason (orbax's own multi-line reports are reduced to
their most specific cause).

The parameter cache (`cache_lookup`, `cache_tree`, `cache_store`; the command line's, enabled
with its compilation cache, compile_cache.py): a restored checkpoint's meta and arrays as one
npz, named by the SHA-256 of every file of the checkpoint directory (so any change to the
checkpoint is a miss) and written atomically, so that the next run of the command reads them
with numpy and never imports orbax (0.4 s of a 2 s solve). An entry is used only when its
arrays are exactly the tree being restored (the same paths, shapes and dtypes); anything else,
an unreadable entry included, is a miss, and the checkpoint is restored with orbax as always.
orbax is imported on first use (`_orbax`), not with this module.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ik_gat_jax.errors import CheckpointError  # noqa: F401  (also checkpointing.CheckpointError)
from ik_gat_jax.io import atomic

FORMAT_VERSION = 1
CACHE_VERSION = 1  # the parameter cache's entry layout


def _orbax():
  """orbax.checkpoint, imported on first use: a cached load (module docstring) never needs it."""
  import orbax.checkpoint as ocp  # function level: 0.4 s of import that a cache hit skips
  return ocp


def one_line(e: BaseException, limit: int = 300) -> str:
  """`e`'s most specific cause (the innermost of its chain) as one line of at most `limit`
  characters: orbax and TensorStore errors span many lines and bury the reason at the end."""
  root, seen = e, {id(e)}
  while True:
    nxt = root.__cause__ if root.__cause__ is not None else (
        None if root.__suppress_context__ else root.__context__)
    if nxt is None or id(nxt) in seen:
      break
    seen.add(id(nxt))
    root = nxt
  text = f'{type(root).__name__}: {" ".join(str(root).split())}'
  return text if len(text) <= limit else text[:limit - 3] + '...'


def _without_tracebacks(e: BaseException) -> BaseException:
  """`e` and its chain without their tracebacks: the messages stay, the frames (and orbax's
  abandoned read coroutines they hold) can go."""
  x, seen = e, set()
  while x is not None and id(x) not in seen:
    seen.add(id(x))
    x.__traceback__ = None
    x = x.__cause__ if x.__cause__ is not None else x.__context__
  return e


def _closed_loop_filter(previous):
  """An unraisable hook: drops the "Event loop is closed" errors of orbax's closed event loop
  (`_collect_abandoned_reads`), hands everything else to `previous`."""

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == 'Event loop is closed'):
      previous(unraisable)

  hook.closed_loop_filter = True
  return hook


def _collect_abandoned_reads(settle_s: float = 0.2) -> None:
  """After a failed restore, orbax has closed its event loop with the sibling array reads still
  pending: when TensorStore finishes them its callbacks hit the closed loop ("Event loop is
  closed") and the abandoned coroutines, once collected, print "Exception ignored in
  <coroutine>" with a TensorStore spec (dozens of lines after the one-line error). Give the
  reads `settle_s` to finish, then collect them, quietly. A read that finishes later still
  hits the closed loop (a loaded machine: seen once in CI), so the process's unraisable hook
  keeps dropping that one error from then on (`_closed_loop_filter`; every other goes on)."""
  if not getattr(sys.unraisablehook, 'closed_loop_filter', False):
    sys.unraisablehook = _closed_loop_filter(sys.unraisablehook)
  hook = sys.unraisablehook
  sys.unraisablehook = lambda unraisable: None
  try:
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', RuntimeWarning)  # "coroutine ... was never awaited"
      gc.collect()
      time.sleep(settle_s)
      gc.collect()
  finally:
    sys.unraisablehook = hook


def _key_name(k) -> str:
  for attr in ('key', 'idx', 'name'):  # DictKey, SequenceKey, GetAttrKey
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _shapes(tree: Any) -> dict[str, tuple]:
  """`{dotted path: shape}` of a tree's array leaves (orbax's spelling of the paths)."""
  return {'.'.join(_key_name(k) for k in path): tuple(x.shape)
          for path, x in jax.tree_util.tree_leaves_with_path(tree) if hasattr(x, 'shape')}


def _listed(names, n: int = 3) -> str:
  names = sorted(names)
  return ', '.join(names[:n]) + (f' (+{len(names) - n} more)' if len(names) > n else '')


def tree_mismatch(saved: Any, wanted: Any) -> str | None:
  """How the saved tree (orbax metadata) and the wanted abstract tree differ, or None."""
  s, w = _shapes(saved), _shapes(wanted)
  if not s or not w or not set(s) & set(w):  # nothing comparable: no diagnosis
    return None
  parts = []
  if set(s) - set(w):
    parts.append(f'only in the checkpoint: {_listed(set(s) - set(w))}')
  if set(w) - set(s):
    parts.append(f'only in the model: {_listed(set(w) - set(s))}')
  diff = sorted(k for k in set(s) & set(w) if s[k] != w[k])
  if diff:
    k = diff[0]
    more = f' (+{len(diff) - 1} more arrays)' if len(diff) > 1 else ''
    parts.append(f'{k} has shape {s[k]} in the checkpoint, {w[k]} in the model{more}')
  return '; '.join(parts) or None


def _has_step(directory: Path) -> bool:
  """Whether `directory` holds a finished checkpoint step (a digits-named folder with its
  `_CHECKPOINT_METADATA`, as orbax writes last), without opening orbax."""
  return directory.is_dir() and any(
      c.name.isdigit() and (c / '_CHECKPOINT_METADATA').is_file() for c in directory.iterdir())


class Checkpointer:
  """Numbered checkpoints in `directory`, keeping the newest `max_to_keep`."""

  def __init__(self, directory: str | os.PathLike, max_to_keep: int = 2, create: bool = True):
    self.directory = Path(directory).absolute()
    if not create and not self.directory.is_dir():
      raise CheckpointError(f'no checkpoint directory at {self.directory}')
    self._ocp = ocp = _orbax()
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create,
                                           enable_async_checkpointing=False)
    # Handlers named up front (not inferred from the first save/restore's args), so the
    # state's array metadata can be read before restoring it (`_saved_tree`).
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={'state': ocp.StandardCheckpointHandler(),
                       'meta': ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> None:
    meta = {'format_version': FORMAT_VERSION, 'step': int(step), **meta}
    json.dumps(meta)  # fail before writing anything if meta is not JSON
    ocp = self._ocp
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def restore_meta(self, step: int | None = None) -> dict:
    if step is None:  # the latest; replaced while read (a training's best): the new one
      for attempt in range(3):
        latest = self._resolve(None)
        try:
          return self.restore_meta(latest)
        except CheckpointError:
          if (self.directory / str(latest)).exists() or attempt == 2:
            raise
          self._manager.reload()
    step = self._resolve(step)
    ocp = self._ocp
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many kinds; report one clear error
      raise CheckpointError(f'cannot read checkpoint metadata at {self.directory} step {step} '
                            f'(corrupt meta file?): {one_line(e)}') from e
    meta = meta['meta']
    if not isinstance(meta, dict):
      raise CheckpointError(f'cannot read checkpoint metadata at {self.directory} step {step}: '
                            f'it holds a JSON {type(meta).__name__}, not an object')
    if meta.get('format_version') != FORMAT_VERSION:
      raise CheckpointError(f'checkpoint {self.directory} has format version '
                            f'{meta.get("format_version")!r:.40}, this code reads '
                            f'{FORMAT_VERSION}')
    return dict(meta)

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
    """Restores `(state, meta)`; `abstract_state` gives shapes, dtypes and shardings. Without
    `step`, the latest: where a trainer replaced it while it was read (a run's `best` while it
    trains: max_to_keep=1 deletes the step it saved before), the new latest, read again."""
    if step is not None:
      return self._restore(abstract_state, step)
    for attempt in range(3):
      latest = self._resolve(None)
      try:
        return self._restore(abstract_state, latest)
      except CheckpointError:
        if (self.directory / str(latest)).exists() or attempt == 2:
          raise
        self._manager.reload()  # the step was deleted under us: read the one that replaced it
    raise AssertionError('unreachable')

  def _restore(self, abstract_state: Any, step: int) -> tuple[Any, dict]:
    step = self._resolve(step)
    meta = self.restore_meta(step)
    saved = self._saved_tree(step)
    if saved is not None and set(_shapes(saved)) == set(_shapes(abstract_state)):
      mismatch = tree_mismatch(saved, abstract_state)  # the same arrays: only shapes can differ
      if mismatch is not None:  # refuse before orbax starts reading (and fails noisily)
        raise CheckpointError(f'checkpoint {self.directory} step {step} does not match the '
                              f'model being restored: {mismatch}')
    ocp = self._ocp
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state)))
    except Exception as e:
      mismatch = None if saved is None else tree_mismatch(saved, abstract_state)
      if mismatch is not None:
        error = CheckpointError(f'checkpoint {self.directory} step {step} does not match the '
                                f'model being restored: {mismatch}')
      else:
        error = CheckpointError(f'cannot restore checkpoint {self.directory} step {step} (a '
                                f'corrupt or truncated array file?): {one_line(e)}')
      error.__cause__ = _without_tracebacks(e)
    else:
      return out['state'], meta
    _collect_abandoned_reads()
    raise error

  def _saved_tree(self, step: int) -> Any:
    """The step's saved array metadata (shapes, dtypes) as a tree, or None when unreadable."""
    try:
      return self._manager.item_metadata(step)['state']
    except Exception:  # unreadable metadata: the restore error itself is reported
      return None

  def _resolve(self, step: int | None) -> int:
    step = self.latest_step() if step is None else step
    if step is None:
      d = Path(self.directory)
      hint = ''
      if d.name == 'best' and _has_step(d.parent / 'latest'):
        try:
          run = json.loads((d.parent.parent / 'run.json').read_text())
        except (OSError, ValueError):
          run = {}
        if run.get('status') != 'done' and isinstance(run.get('step'), int) and isinstance(
            run.get('steps'), int) and run['step'] < run['steps']:  # not validated yet
          hint = (f' yet: the run stopped at step {run["step"]} of {run["steps"]}, before its '
                  'first validation (train.eval_every): rerun its training command (run.json\'s '
                  '"command") to train on, or experiments.export_latest for its last step')
        else:  # a finished run's best deleted
          hint = (f' (deleted?); {d.parent / "latest"} holds the run\'s last step: rerun its '
                  'training command (run.json\'s "command"), which saves that step as the best')
      raise CheckpointError(f'no checkpoint found in {self.directory}{hint}')
    return step

  def close(self) -> None:
    self._manager.close()


def abstract_like(tree: Any) -> Any:
  """Abstract (ShapeDtypeStruct) version of a concrete tree, keeping shardings."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                     sharding=getattr(x, 'sharding', None)), tree)


# ----------------------------------------------------------------------------------------------
# The parameter cache (module docstring).


def content_key(directory: str | os.PathLike) -> str:
  """SHA-256 (hex) of every file under `directory`: relative paths, sizes and bytes."""
  directory = Path(directory)
  h = hashlib.sha256(f'ik_gat_jax checkpoint {FORMAT_VERSION} cache {CACHE_VERSION}'.encode())
  for f in sorted(p for p in directory.rglob('*') if p.is_file()):
    data = f.read_bytes()
    h.update(f'\0{f.relative_to(directory).as_posix()}\0{len(data)}\0'.encode())
    h.update(data)
  return h.hexdigest()


def _cache_file(cache_dir: Path, key: str) -> Path:
  return Path(cache_dir) / f'{key}.npz'


def cache_lookup(cache_dir: str | os.PathLike, directory: str | os.PathLike
                 ) -> tuple[str, dict | None, dict[str, np.ndarray] | None]:
  """(key, meta, {path: array}) of `directory`'s entry, or (key, None, None) on a miss (no
  entry, or one that cannot be read)."""
  key = content_key(directory)
  try:
    with np.load(_cache_file(cache_dir, key), allow_pickle=False) as z:
      meta = json.loads(z['meta'].tobytes().decode('utf-8'))
      arrays = {name[2:]: z[name] for name in z.files if name.startswith('a:')}
  except Exception:  # missing, truncated, not an npz, bad JSON: a miss
    return key, None, None
  return (key, meta, arrays) if isinstance(meta, dict) else (key, None, None)


def _paths(tree: Any) -> list[tuple[str, Any]]:
  return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def cache_tree(arrays: dict[str, np.ndarray], abstract: Any) -> Any | None:
  """`abstract` (ShapeDtypeStructs) filled from a cache entry's arrays, on each leaf's sharding;
  None unless the entry holds exactly its leaves with their shapes and dtypes."""
  leaves = _paths(abstract)
  if set(arrays) != {k for k, _ in leaves}:
    return None
  for k, x in leaves:
    if arrays[k].shape != tuple(x.shape) or arrays[k].dtype != x.dtype:
      return None
  values = [jax.device_put(arrays[k], getattr(x, 'sharding', None)) for k, x in leaves]
  return jax.tree.unflatten(jax.tree.structure(abstract), values)


def cache_store(cache_dir: str | os.PathLike, key: str, directory: str | os.PathLike,
                meta: dict, tree: Any) -> bool:
  """Writes the entry (atomically) of a checkpoint just restored from `directory`, whose
  `content_key` was `key` before the restore; False (nothing written) when the directory
  changed meanwhile, a leaf has no plain numpy dtype, or the cache cannot be written."""
  arrays = {'a:' + k: np.asarray(x) for k, x in _paths(tree)}
  if any(a.dtype.kind not in 'biuf' for a in arrays.values()):  # bfloat16, PRNG keys: no
    return False
  try:
    if content_key(directory) != key:  # written while we read it: no entry for either state
      return False
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    meta_bytes = np.frombuffer(json.dumps(meta).encode('utf-8'), np.uint8)
    atomic.write_npz(_cache_file(cache_dir, key), {'meta': meta_bytes, **arrays})
  except OSError:  # a read-only or full cache folder: run without it
    return False
  return True
