"""Length units of a user's positions and files: metres per unit, one table for every reader.

`--units` of `ik_gat_jax.solve` (positions, BVH input) and of `data_prep.bvh_to_shards` (BVH
files) both go through `parse_units`. `estimate_units` (`--units=auto` of bvh_to_shards) guesses
the unit of a human skeleton from its size along its bones.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

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
  if isinstance(units, (bool, np.bool_)):  # float(True) is 1.0: metres, by accident
    raise InputError(f'--units must be metres per input unit (a number) or one of '
                     f'{", ".join(UNITS)}; got {units!r}')
  try:
    value = float(units)
  except (TypeError, ValueError):
    raise InputError(f'--units must be metres per input unit (a number) or one of '
                     f'{", ".join(UNITS)}; got {units!r}') from None
  if not (math.isfinite(value) and value > 0):
    raise InputError(f'--units must be a positive number of metres per unit, got {units!r}')
  return value


# ----------------------------------------------------------------------------------------------
# --units=auto: metres per file unit from the skeleton's size.

STATURE_RANGE_M = (1.0, 2.2)  # a plausible human stature (a child to a very tall adult)
TYPICAL_STATURE_M = 1.7
# The longest path along a human skeleton's bones runs from a hand to a foot (arm + spine +
# leg), about 1.3 statures by typical adult proportions. CMU's 7 subjects span 2.14-2.27 m
# (finger and toe End Sites included), i.e. statures of 1.65-1.75 m at this ratio; their real
# statures are not given with the data, so the ratio is an assumption, good to ~10 %, which the
# 1.0-2.2 m window and the snapping to known units absorb.
SPAN_PER_STATURE = 1.3
_SNAP_ORDER = ('m', 'cm', 'mm', 'in', 'ft', 'cmu')  # the known units auto may choose


@dataclasses.dataclass(frozen=True)
class UnitsEstimate:
  """What `estimate_units` found: the chosen metres per unit, the known unit it is (its key in
  `UNITS`), the skeleton's span in file units, the stature that implies, and every known unit's
  implied stature (the evidence)."""
  metres_per_unit: float
  name: str
  span_units: float
  stature_m: float
  candidates: tuple[tuple[str, float], ...]

  def describe(self) -> str:
    others = ', '.join(f'{k} {v:.3g} m' for k, v in self.candidates if k != self.name)
    return (f'units {self.name} ({self.metres_per_unit:g} m per file unit): the skeleton spans '
            f'{self.span_units:.4g} file units along its bones (longest joint-to-joint path, End '
            f'Sites included: hand to foot, ~{SPAN_PER_STATURE:g} statures), i.e. a stature of '
            f'about {self.stature_m:.2f} m in {self.name}; plausible: {STATURE_RANGE_M[0]:g}-'
            f'{STATURE_RANGE_M[1]:g} m; other units would give {others}')


def skeleton_span(offsets: np.ndarray, parents: Sequence[int],
                  end_sites: Sequence[np.ndarray | None] | None = None) -> float:
  """The longest path between two joints (or End Sites) along the bones, in the offsets' units.

  Bone lengths, not rest positions: the zero pose of a rig with bind rotations may be crumpled,
  but its bone lengths are those of the body, so the span does not depend on the bind. Offsets
  from the root down to the first joint with two or more children (a dummy root's, a root bone
  placed at the floor) are placements, not bones, and are left out.
  """
  offsets = np.asarray(offsets, np.float64)
  J = len(parents)
  kids = [[c for c in range(J) if parents[c] == j] for j in range(J)]
  ends = list(end_sites) if end_sites is not None else [None] * J
  hub = 0
  while len(kids[hub]) == 1 and ends[hub] is None:
    hub = kids[hub][0]
  best = 0.0
  depth = [0.0] * J  # longest path down from j
  for j in reversed(range(J)):
    branches = [depth[c] + float(np.linalg.norm(offsets[c])) for c in kids[j]]
    if ends[j] is not None:
      branches.append(float(np.linalg.norm(ends[j])))
    branches.sort(reverse=True)
    depth[j] = branches[0] if branches else 0.0
    if _below(j, hub, parents):
      best = max(best, sum(branches[:2]))
  return best


def _below(j: int, hub: int, parents: Sequence[int]) -> bool:
  while j >= 0:
    if j == hub:
      return True
    j = parents[j]
  return False


def estimate_units(offsets: np.ndarray, parents: Sequence[int],
                   end_sites: Sequence[np.ndarray | None] | None = None,
                   what: str = 'the skeleton') -> UnitsEstimate:
  """Metres per file unit of a human skeleton from its span (`skeleton_span`): the known unit
  (`_SNAP_ORDER`) whose implied stature (span / `SPAN_PER_STATURE`) lies in `STATURE_RANGE_M`, the one nearest
  `TYPICAL_STATURE_M` (log scale) when several do. Raises InputError (one line, with the
  evidence and the span-based number) when none does: not a human, or an unusual unit."""
  span = skeleton_span(offsets, parents, end_sites)
  cand = tuple((k, span * UNITS[k] / SPAN_PER_STATURE) for k in _SNAP_ORDER)
  ok = [(k, s) for k, s in cand if STATURE_RANGE_M[0] <= s <= STATURE_RANGE_M[1]]
  listing = ', '.join(f'{k} {s:.3g} m' for k, s in cand)
  if span <= 0 or not ok:
    guess = (f'; if it is a human of ~{TYPICAL_STATURE_M:g} m, '
             f'--units={TYPICAL_STATURE_M * SPAN_PER_STATURE / span:.4g}') if span > 0 else ''
    raise InputError(f'--units=auto: {what} spans {span:.4g} file units along its bones, which no '
                     f'known unit makes a human stature (span / {SPAN_PER_STATURE:g}) ({STATURE_RANGE_M[0]:g}-'
                     f'{STATURE_RANGE_M[1]:g} m: {listing}); pass --units=NUMBER (metres per '
                     f'file unit){guess}')
  name, stature = min(ok, key=lambda kv: abs(math.log(kv[1] / TYPICAL_STATURE_M)))
  return UnitsEstimate(UNITS[name], name, span, stature, cand)
