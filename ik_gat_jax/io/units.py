"""Length units of a user's positions and files: metres per unit, one table for every reader.

`--units` of `ik_gat_jax.solve` (positions, BVH input) and of `data_prep.bvh_to_shards` (BVH
files) both go through `parse_units`.
"""

from __future__ import annotations

import math

from ik_gat_jax.errors import InputError

# 'cmu': the cgspeed CMU BVH files' unit (their joint map's `units`).
UNITS = {'m': 1.0, 'cm': 0.01, 'mm': 0.001, 'in': 0.0254, 'inch': 0.0254, 'ft': 0.3048,
         'cmu': 0.056444}


def parse_units(units: str | float | None) -> float:
  """Metres per input unit: a number, or one of `UNITS` ('cm', 'mm', 'inch', 'cmu', ...).
  None: metres. Raises InputError (one line) for anything else or a non-positive number."""
  if units is None:
    return 1.0
  if isinstance(units, str) and units.strip().lower() in UNITS:
    return UNITS[units.strip().lower()]
  try:
    value = float(units)
  except (TypeError, ValueError):
    raise InputError(f'--units must be metres per input unit (a number) or one of '
                     f'{", ".join(UNITS)}; got {units!r}') from None
  if not (math.isfinite(value) and value > 0):
    raise InputError(f'--units must be a positive number of metres per unit, got {units!r}')
  return value
