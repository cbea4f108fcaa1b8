"""The solver's input checks (issue I, item 6): each bad input raises `InputError` with its reason.

One test per check: non-numeric input, float16 (a warning), zero frames, wrong offsets shape,
a zero-length bone, fps <= 0, negative units, offsets and offsets_from both given, `step()` with
several frames, a stream item larger than block_size, block_size < 1, an axes matrix that is not a
signed
permutation. Every check fails before anything is compiled, so the shipped model loads once
(module fixture) and nothing is traced.
"""

import math
import re
import warnings

import numpy as np
import pytest

from ik_gat_jax import inference
from ik_gat_jax.inference import SHIPPED_IKGAT
from ik_gat_jax.io import exports
from ik_gat_jax.skeleton import rest_positions_np
from ik_gat_jax.solver import (IKSolver, InputError, bucket_sizes, check_offsets,
                               check_positions, parse_input_axes, parse_units)


@pytest.fixture(scope='module')
def loaded():
  """The shipped model and its meta, loaded once; solvers built from it compile nothing."""
  return inference.load_model(SHIPPED_IKGAT)


@pytest.fixture(scope='module')
def solver(loaded):
  return IKSolver(*loaded, source=str(SHIPPED_IKGAT))


@pytest.fixture(scope='module')
def clip(solver):
  """Three frames of the template's rest pose `[3, J, 3]` (metres, rig axes): valid input."""
  rest = rest_positions_np(solver.offsets, solver.rig.parents)
  return np.repeat(rest[None], 3, axis=0)


def _assert_nothing_compiled(solver):
  assert solver.trace_count == 0


# -- positions ---------------------------------------------------------------------------------


@pytest.mark.parametrize('bad', [
    'positions.csv',  # a file name where an array belongs
    [['a', 'b', 'c']] * 21,
    [[0.0, 0.0, 0.0], [0.0, 0.0]],  # ragged
    {'Hips': [0.0, 0.0, 0.0]},
    [['0.1', '0.2', '0.3']] * 21,  # numbers as text: not parsed
    np.zeros((21, 3), complex),  # an imaginary part would be dropped
    np.zeros((21, 3), bool),
], ids=['string', 'strings', 'ragged', 'dict', 'numeric_strings', 'complex', 'bool'])
def test_non_numeric_input(solver, bad):
  with pytest.raises(InputError, match='positions are not a numeric array'):
    solver.solve(bad)
  with pytest.raises(InputError, match='positions are not a numeric array'):
    solver.step(bad)
  _assert_nothing_compiled(solver)


def test_float16_positions_warn(solver, clip, tmp_path):
  """float16 positions (1 mm steps at 1 m) warn, from an array and from an npz; float32 and
  float64 do not."""
  rig = solver.rig
  with pytest.warns(UserWarning, match='positions are float16: values are rounded to 11 '):
    out, _ = check_positions(clip.astype(np.float16), rig)
  assert out.dtype == np.float64
  np.savez(tmp_path / 'half.npz', positions=clip.astype(np.float16))
  with pytest.warns(UserWarning, match=r'half\.npz: positions are float16'):
    exports.read_positions_npz(tmp_path / 'half.npz', rig)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    for dtype in (np.float32, np.float64):
      check_positions(clip.astype(dtype), rig)


def test_zero_frames(solver):
  J = solver.rig.num_joints
  with pytest.raises(InputError, match=r'no frames to solve \(positions have T = 0\)'):
    solver.solve(np.zeros((0, J, 3)))
  with pytest.raises(InputError, match='no frames to solve'):
    list(solver.solve_stream([np.zeros((0, J, 3))]))
  with pytest.raises(InputError, match='no frames to solve'):
    check_positions(np.zeros((0, J, 3)), solver.rig)
  _assert_nothing_compiled(solver)


# -- offsets -----------------------------------------------------------------------------------


@pytest.mark.parametrize('shape', [(20, 3), (22, 3), (21, 2), (21,), (21, 3, 1)])
def test_wrong_offsets_shape(solver, loaded, clip, shape):
  bad = np.zeros(shape)
  expect = rf'offsets must be \[21, 3\] in the joint order of rig .cmu_body. .*got shape ' \
           rf'{re.escape(str(shape))}'
  with pytest.raises(InputError, match=expect):
    solver.solve(clip, offsets=bad)
  with pytest.raises(InputError, match=expect):
    solver.step(clip[0], offsets=bad)
  with pytest.raises(InputError, match=expect):
    IKSolver(*loaded, offsets=bad)
  _assert_nothing_compiled(solver)


def test_non_numeric_offsets(solver, clip):
  with pytest.raises(InputError, match='offsets are not a numeric array'):
    solver.solve(clip, offsets=[['x', 'y', 'z']] * 21)


def _a_real_bone(rig):
  """(parent, designated child) of the first bone with a length in the template."""
  tmpl = rig.template()
  return next((j, c) for j, c in enumerate(rig.designated_children)
              if c >= 0 and np.linalg.norm(tmpl[c]) > 1e-6)


def test_zero_length_bone(solver, loaded, clip):
  rig = solver.rig
  j, c = _a_real_bone(rig)
  off = np.array(solver.offsets)
  off[c] = 0.0
  expect = (rf'offsets: bone {rig.joint_names[j]} -> {rig.joint_names[c]} has zero length, so '
            r'its rest direction \(and bone frame\) is undefined')
  with pytest.raises(InputError, match=expect):
    check_offsets(off, rig)
  with pytest.raises(InputError, match=expect):
    solver.solve(clip, offsets=off)
  with pytest.raises(InputError, match=expect):
    IKSolver(*loaded, offsets=off)
  _assert_nothing_compiled(solver)


def test_offsets_and_offsets_from_both_given(solver, tmp_path):
  """Refused before the checkpoint is even read (the BVH does not need to exist)."""
  with pytest.raises(InputError, match='give offsets or offsets_from, not both'):
    IKSolver.from_checkpoint(SHIPPED_IKGAT, offsets=solver.offsets,
                             offsets_from=tmp_path / 'subject.bvh')
  with pytest.raises(InputError, match='not both'):
    IKSolver.from_checkpoint(tmp_path / 'no_such_checkpoint', offsets=solver.offsets,
                             offsets_from=tmp_path / 'subject.bvh')


# -- fps, units, axes --------------------------------------------------------------------------


@pytest.mark.parametrize('fps', [0.0, -30.0, math.nan, math.inf])
def test_fps_not_positive(loaded, fps):
  with pytest.raises(InputError, match=r'fps must be a positive frame rate, got'):
    IKSolver(*loaded, fps=fps)


@pytest.mark.parametrize('units', [-1, -0.01, '-0.0254', 0, '0', math.nan, math.inf])
def test_negative_or_zero_units(solver, clip, units):
  expect = r'--units must be a positive number of metres per unit, got'
  with pytest.raises(InputError, match=expect):
    parse_units(units)
  with pytest.raises(InputError, match=expect):
    solver.solve(clip, units=units)
  _assert_nothing_compiled(solver)


def test_units_names_and_numbers_still_parse():
  assert parse_units(None) == 1.0 and parse_units(' CM ') == 0.01 and parse_units('0.5') == 0.5


_c, _s = math.cos(math.radians(30)), math.sin(math.radians(30))


@pytest.mark.parametrize('M', [
    [[_c, 0, _s], [0, 1, 0], [-_s, 0, _c]],  # a rotation by 30 degrees: orthogonal, not axes
    np.sqrt(0.5) * np.asarray([[1, 1, 0], [-1, 1, 0], [0, 0, np.sqrt(2)]]),  # 45 degrees
    2 * np.eye(3),  # scaled
    [[1, 0, 0], [1, 0, 0], [0, 0, 1]],  # two rows take the same axis
    [[1, 0, 0], [0, 1, 0], [0, 0, 0]],  # an axis dropped
    np.eye(3)[:2],  # not [3, 3]
    np.eye(4),
], ids=['rot30', 'rot45', 'scaled', 'repeated', 'singular', '2x3', '4x4'])
def test_axes_matrix_not_a_signed_permutation(solver, clip, M):
  expect = r'input_axes must be a signed permutation matrix \[3, 3\] \(one entry \+-1 per row'
  with pytest.raises(InputError, match=expect):
    parse_input_axes(np.asarray(M), solver.rig)
  with pytest.raises(InputError, match=expect):
    solver.solve(clip, input_axes=np.asarray(M))
  _assert_nothing_compiled(solver)


def test_non_numeric_axes_matrix(solver):
  with pytest.raises(InputError, match='input_axes must be a signed permutation matrix'):
    parse_input_axes([['x', 'y', 'z']] * 3, solver.rig)


@pytest.mark.parametrize('spec', ['x,z,-y', '-x,y,z', 'unity', 'unreal'])
def test_signed_permutations_still_accepted(solver, spec):
  """Every string spelling's matrix, reflections included, passes as a matrix too."""
  M = parse_input_axes(spec, solver.rig)
  np.testing.assert_array_equal(parse_input_axes(M, solver.rig), M)


# -- step, streams, blocks ---------------------------------------------------------------------


@pytest.mark.parametrize('n', [2, 3])
def test_step_with_several_frames(solver, clip, n):
  with pytest.raises(InputError, match=rf'step takes one frame \[21, 3\], got {n} frames '
                     rf'\[{n}, 21, 3\]; use solve\(\) for a clip'):
    solver.step(clip[:n])
  _assert_nothing_compiled(solver)


def test_stream_item_larger_than_block_size(loaded, clip):
  small = IKSolver(*loaded, block_size=2)
  stream = small.solve_stream([clip])  # 3 frames, block 2
  with pytest.raises(InputError, match=r'a stream item holds 3 frames, more than block_size 2; '
                     r'use solve\(\) for clips'):
    next(stream)
  assert small.trace_count == 0


@pytest.mark.parametrize('block_size', [0, -1, -1024])
def test_block_size_below_one(loaded, block_size):
  with pytest.raises(InputError, match=rf'block_size must be >= 1, got {block_size}'):
    IKSolver(*loaded, block_size=block_size)
  with pytest.raises(InputError, match='block_size must be >= 1'):
    bucket_sizes(block_size)
  with pytest.raises(ValueError):  # InputError is a ValueError, as bucket_sizes raised before
    bucket_sizes(block_size)


def test_block_size_below_one_from_checkpoint():
  with pytest.raises(InputError, match='block_size must be >= 1, got 0'):
    IKSolver.from_checkpoint(SHIPPED_IKGAT, block_size=0)


def test_a_reference_pose_that_is_not_rotations(loaded):
  J = loaded[0].rig.num_joints
  with pytest.raises(InputError, match=r"joint Hips's frame is scaled or sheared"):
    IKSolver(*loaded, reference_pose=np.broadcast_to(100.0 * np.eye(3), (J, 3, 3)))


def test_option_values_of_the_wrong_kind(loaded, clip):
  """A temporal filter given as a dict or a name, a rig name that is none, units given as a
  bool: one-line InputErrors (an AttributeError deep in the stream, a KeyError; True was read
  as 1 m per unit)."""
  for bad in ({'kind': 'one_euro'}, 'one_euro'):
    with pytest.raises(InputError, match=r'temporal_filter must be a temporal.FilterConfig'):
      IKSolver(*loaded, temporal_filter=bad)
  with pytest.raises(InputError, match=r"^unknown rig 'cmu': built-ins are"):
    IKSolver.from_checkpoint(SHIPPED_IKGAT, expected_rig='cmu')
  for units in (True, np.bool_(False)):
    with pytest.raises(InputError, match=r'--units must be metres per input unit'):
      parse_units(units)
