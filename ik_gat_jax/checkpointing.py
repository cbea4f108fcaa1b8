"""Checkpoints: save, restore, latest, on orbax `CheckpointManager`.

A checkpoint directory holds numbered steps; each step has two items: `state` (a pytree of
arrays: parameters, and for training checkpoints the optimizer state) and `meta` (JSON: config,
rig, metrics, provenance, format version). Restoring goes through an abstract tree (shapes,
dtypes and shardings from `jax.eval_shape`), so a checkpoint written on 8 devices restores on 1.
Writes are atomic (orbax writes a temporary directory and renames it), so an interrupted save
never leaves a half-written step behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

FORMAT_VERSION = 1


class CheckpointError(ValueError):
  """A missing, corrupt or incompatible checkpoint, with the reason."""


class Checkpointer:
  """Numbered checkpoints in `directory`, keeping the newest `max_to_keep`."""

  def __init__(self, directory: str | os.PathLike, max_to_keep: int = 2, create: bool = True):
    self.directory = Path(directory).absolute()
    if not create and not self.directory.is_dir():
      raise CheckpointError(f'no checkpoint directory at {self.directory}')
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create,
                                           enable_async_checkpointing=False)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=('state', 'meta'))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> None:
    meta = {'format_version': FORMAT_VERSION, 'step': int(step), **meta}
    json.dumps(meta)  # fail before writing anything if meta is not JSON
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def restore_meta(self, step: int | None = None) -> dict:
    step = self._resolve(step)
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many kinds; report one clear error
      raise CheckpointError(f'cannot read checkpoint metadata at {self.directory} step {step}: '
                            f'{e}') from e
    meta = dict(meta['meta'])
    if meta.get('format_version') != FORMAT_VERSION:
      raise CheckpointError(f'checkpoint {self.directory} has format version '
                            f'{meta.get("format_version")}, this code reads {FORMAT_VERSION}')
    return meta

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
    """Restores `(state, meta)`; `abstract_state` gives shapes, dtypes and shardings."""
    step = self._resolve(step)
    meta = self.restore_meta(step)
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state)))
    except Exception as e:
      raise CheckpointError(f'checkpoint {self.directory} step {step} does not match the model '
                            f'being restored ({type(e).__name__}: {str(e)[:300]})') from e
    return out['state'], meta

  def _resolve(self, step: int | None) -> int:
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f'no checkpoint found in {self.directory}')
    return step

  def close(self) -> None:
    self._manager.close()


def abstract_like(tree: Any) -> Any:
  """Abstract (ShapeDtypeStruct) version of a concrete tree, keeping shardings."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                     sharding=getattr(x, 'sharding', None)), tree)
