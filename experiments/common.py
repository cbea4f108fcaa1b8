"""Shared helpers of the command-line mains: running one (`run_main`, from
`ik_gat_jax.absl_main`: --help exits 0, a config override of no field is one line); one-line
errors for bad input; noise levels and a per-noise
results JSON; threads pinned to cores for a benchmark."""

import contextlib
import functools
import itertools
import math
import os
from pathlib import Path
import sys
import threading
from typing import Iterator, NoReturn

from absl import flags, logging

from ik_gat_jax import provenance
from ik_gat_jax.absl_main import run_main  # noqa: F401  (the mains import it from here)
from ik_gat_jax.errors import CheckpointError
from ik_gat_jax.io import atomic
from ik_gat_jax.skeleton import RigError


def fail_on_user_error(main):
  """Turns the library's input errors into a one-line message and exit status 2.

  Also quiets orbax's per-save INFO logging (pass --verbosity=0 to see it again).
  """

  @functools.wraps(main)
  def wrapped(argv):
    if not flags.FLAGS['verbosity'].present:
      logging.set_verbosity(logging.WARNING)
    try:
      return main(argv)
    except (FileNotFoundError, CheckpointError, RigError, ValueError, KeyError) as e:
      msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      print(f'error: {msg}', file=sys.stderr)
      sys.exit(2)

  return wrapped


def exit_interrupted(message: str | None = 'interrupted; rerun the same command to continue'
                     ) -> NoReturn:
  """Ends a main that Ctrl-C or SIGTERM stopped: `message` on stderr, then exit status 130 at
  once. Everything a main keeps is written by then (atomic files; checkpoints saved
  synchronously, `checkpointing.Checkpointer.save`), and the interpreter's own shutdown after an
  interrupt inside a JAX call can crash (`Fatal Python error: Segmentation fault`, status 139,
  in 2 of 3 Ctrl-C's early in train_rig's conversion), so it is skipped. Not for a main that
  may run `jax.distributed` (experiments.train): its shutdown must run."""
  if message:
    print(message, file=sys.stderr)
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(130)  # pylint: disable=protected-access


@contextlib.contextmanager
def no_empty_folder_left(path: str | os.PathLike) -> Iterator[None]:
  """A block that may make the folder `path` (and its missing parents): when it raises (a
  refused command), the folders of these that it made and left empty are removed again;
  folders that existed before, or hold anything, stay."""
  made, p = [], Path(path).absolute()
  while not p.exists():
    made.append(p)  # deepest first
    p = p.parent
  try:
    yield
  except BaseException:
    for p in made:
      try:
        p.rmdir()
      except FileNotFoundError:  # not made after all
        continue
      except OSError:  # holds something: it and its parents stay
        break
    raise


def define_checkpoint_noise_flags() -> None:
  """The flags of a main that runs one IK-GAT checkpoint on a shard split at several noise
  levels (--data, --split, --checkpoint, --noise_mm, --output_json); called by its
  `define_flags()` when it runs, never at import (tests import the mains side by side), which
  then adopts them (`flags.adopt_module_key_flags(common)`) for its --help."""
  flags.DEFINE_string('data', None, 'Shard directory.')
  flags.DEFINE_string('split', 'val', 'Split to evaluate (choose on val).')
  flags.DEFINE_string('checkpoint', None, 'IK-GAT checkpoint (default: shipped).')
  flags.DEFINE_list('noise_mm', ['0', '10', '20'], 'Noise levels, mm per coordinate.')
  flags.DEFINE_string('output_json', None, 'Also write the results here (atomically).')


def noise_levels(values) -> list[float]:
  """`--noise_mm`'s values (mm per coordinate) as floats; a one-line ValueError otherwise: not
  numbers, or not finite and >= 0 (a typo's -10 ran as the clean input, labelled -10 mm)."""
  try:
    levels = [float(v) for v in values]
  except ValueError:
    raise ValueError(f'--noise_mm: {list(values)} are not numbers') from None
  bad = [v for v in values if not (math.isfinite(float(v)) and float(v) >= 0)]
  if bad:
    raise ValueError(f'--noise_mm: {", ".join(map(str, bad))}: noise levels are mm >= 0')
  return levels


def checkpoint_noise_main(run, table, what: str, **solver_options) -> None:
  """The body of a main of `define_checkpoint_noise_flags`: the --split of --data, the
  --checkpoint's solver on it (`solver_options` to `IKSolver.from_checkpoint`), `run(ds,
  solver, noise levels)`, its `table(results)` printed under a line saying `what`, and
  --output_json written (`write_noise_results`)."""
  from ik_gat_jax import data  # pylint: disable=import-outside-toplevel  (JAX: when it runs)
  from ik_gat_jax.solver import IKSolver  # pylint: disable=import-outside-toplevel
  F = flags.FLAGS
  noise = noise_levels(F.noise_mm)
  ds = data.load_shards(F.data, F.split)
  solver = IKSolver.from_checkpoint(F.checkpoint, expected_rig=ds.rig, **solver_options)
  results = run(ds, solver, noise)
  print(f'{ds.split} split, {solver.source}: {what}')
  print(table(results))
  if F.output_json:
    write_noise_results(F.output_json, ds, solver, results)


def write_noise_results(path: str, ds, solver, results: dict, **fields) -> None:
  """Writes `{noise: ...}` results of `solver` on the split `ds` as one JSON, atomically, with
  `fields`, the command line and the data's provenance; says where."""
  atomic.write_json(path, {
      'split': ds.split, **fields, 'checkpoint': solver.source,
      'results': {f'{k:g}': v for k, v in results.items()},
      'command': provenance.command_line(), 'provenance': provenance.data_provenance(ds)})
  print(f'wrote {path}')


def pinning_initializer(threads: int):
  """A thread pool initializer that pins each of its `threads` threads to a core of its own (the
  cores this process may use, in order). ValueError where there are fewer cores than threads."""
  if not hasattr(os, 'sched_setaffinity'):
    raise ValueError('pinning threads needs os.sched_setaffinity (Linux)')
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < threads:
    raise ValueError(f'cannot pin {threads} threads to a core each: this process may use '
                     f'{len(cores)} core(s)')
  started, lock = itertools.count(), threading.Lock()

  def init():
    with lock:
      i = next(started)
    os.sched_setaffinity(0, {cores[i % threads]})

  return init
