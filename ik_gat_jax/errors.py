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
