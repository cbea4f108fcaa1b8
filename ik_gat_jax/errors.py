"""The library's exceptions, in one leaf module every layer may import.

Each is a `ValueError` whose `str()` is one line: the reason and, where there is one, the fix.
The command lines print it after `<command>: error: ` and exit non-zero.
"""


class InputError(ValueError):
  """Positions, offsets, options or files the library cannot use, with the reason and the fix."""


class ConversionError(InputError):
  """A source file (BVH, AMASS, joint map) that cannot be reduced to the rig, or a refused file."""


class CheckpointError(ValueError):
  """A missing, corrupt or incompatible checkpoint, naming its path (one line)."""


def check_frame_rate(fps, what: str = 'fps') -> float:
  """`fps` as a float if it is one positive finite frame rate, else `InputError` (every writer
  checks it: a file with `Frame Time: nan`, or one its own reader refuses, is never written)."""
  try:
    value = float(fps)
  except (TypeError, ValueError):
    raise InputError(f'{what} must be a positive frame rate, got {fps!r}') from None
  if not (value > 0 and value != float('inf')):
    raise InputError(f'{what} must be a positive frame rate, got {fps!r}')
  return value
