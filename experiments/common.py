"""Shared helpers of the command-line mains: one-line errors for bad input; threads pinned to
cores for a benchmark."""

import functools
import itertools
import os
import sys
import threading

from absl import flags, logging

from ik_gat_jax.errors import CheckpointError
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
