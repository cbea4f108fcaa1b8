"""`--units=auto` (issue L): metres per file unit from a skeleton's span along its bones."""

import numpy as np
import pytest

from data_prep import conversion
from data_prep import rerig
from ik_gat_jax.errors import ConversionError, InputError
from ik_gat_jax.io import bvh
from ik_gat_jax.io import units

quiet = lambda message: None  # noqa: E731
SHORTEST = ('01_14', '03_02', '05_03', '06_09', '07_12', '08_10', '09_03')


def _estimate(m: bvh.BVHMotion, scale: float = 1.0) -> units.UnitsEstimate:
  return units.estimate_units(m.offsets * scale, m.parents,
                              [None if j.end_site is None else j.end_site * scale
                               for j in m.joints])


def test_cmu_files_are_cmu_units(cmu_dir):
  for name in SHORTEST:
    est = _estimate(bvh.read_bvh(cmu_dir / f'{name}.bvh'))
    assert est.name == 'cmu' and est.metres_per_unit == units.UNITS['cmu']
    assert 1.6 < est.stature_m < 1.9, (name, est)
    assert 'spans' in est.describe() and 'cmu' in est.describe()


def test_rerigged_centimetres_and_other_scales(cmu_dir, tmp_path):
  rerig.rerig_directory(cmu_dir, tmp_path, files=['09_03'], log=quiet)
  m = bvh.read_bvh(tmp_path / '09_03.bvh')
  est = _estimate(m)  # crumpled zero pose, dummy root: the span uses bone lengths only
  assert est.name == 'cm'
  base = _estimate(bvh.read_bvh(cmu_dir / '09_03.bvh'))
  assert est.span_units == pytest.approx(base.span_units * 0.056444 / 0.01, rel=1e-9)
  for unit in ('m', 'mm', 'in', 'ft'):
    assert _estimate(m, 0.01 / units.UNITS[unit]).name == unit
  with pytest.raises(InputError, match=r'no known unit .* --units=NUMBER'):
    _estimate(m, 40.0)  # a 90 m giant in metres, 9 km in cm: no unit fits


def test_bvh_to_shards_units_auto_and_the_missing_units_hint(cmu_dir, tmp_path):
  lines = []
  jmap = conversion.build_joint_map('auto', [cmu_dir / '09_03.bvh'], units='auto',
                                    log=lines.append)
  assert jmap.units == units.UNITS['cmu']
  assert lines and lines[0].startswith('--units=auto: 09_03.bvh: units cmu')
  with pytest.raises(ConversionError, match=r'needs --units .* looks like --units=cmu'):
    conversion.build_joint_map('auto', [cmu_dir / '09_03.bvh'])
  # A joint map's units can be replaced by the estimate too.
  assert conversion.build_joint_map('cmu_body', [cmu_dir / '09_03.bvh'], units='auto',
                                    log=quiet).units == units.UNITS['cmu']
  assert np.isclose(units.skeleton_span(np.array([[0, 0, 0], [0, 1.0, 0], [1.0, 0, 0]]),
                                        (-1, 0, 0)), 2.0)
