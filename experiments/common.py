"""Shared helpers of the command-line mains: one-line errors for bad input."""

import functools
import sys

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
