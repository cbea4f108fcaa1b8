"""Tests for ik_gat_jax.solver (IKSolver, checks, buckets, streaming) and ik_gat_jax.io.exports.

The checkpoints are untrained tiny models saved in the trainer's format (seconds, no data
needed); what is tested is the plumbing (shapes, frames, FK consistency, files), not accuracy.
"""

import dataclasses
import io
import re
import warnings

import numpy as np
import pytest
from flax import nnx
from scipy.spatial.transform import Rotation

from experiments.configs import test as test_config
import ik_gat_jax
from ik_gat_jax import checkpointing
from ik_gat_jax import compile_cache
from ik_gat_jax import inference
from ik_gat_jax import rotations
from ik_gat_jax import skeleton
from ik_gat_jax import solver as solver_lib
from ik_gat_jax import train
from ik_gat_jax.checkpointing import CheckpointError
from ik_gat_jax.io import bvh
from ik_gat_jax.io import exports
from ik_gat_jax.io import smpl as smpl_lib
from ik_gat_jax.solver import IKSolver, InputError, bucket_sizes, parse_input_axes

_CHECKPOINTS = {}


def tiny_checkpoint(tmp_path_factory, rig_name: str = 'cmu_body'):
  """An untrained tiny IK-GAT for `rig_name`, saved as `train` saves one (built once)."""
  if rig_name not in _CHECKPOINTS:
    config = test_config.get_config()
    rig = skeleton.get_rig(rig_name)
    model = inference.IKGAT_TASK.build(config, rig, nnx.Rngs(0), None)
    _, params, _, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    path = tmp_path_factory.mktemp(f'ckpt_{rig_name}')
    checkpointing.Checkpointer(path, max_to_keep=1).save(
        0, {'params': params, 'rest': rest},
        train.checkpoint_meta(config, rig, inference.IKGAT_TASK, {}, {}))
    _CHECKPOINTS[rig_name] = path
  return _CHECKPOINTS[rig_name]


_SOLVERS = {}


def get_solver(tmp_path_factory, rig_name: str = 'cmu_body') -> IKSolver:
  if rig_name not in _SOLVERS:
    _SOLVERS[rig_name] = IKSolver.from_checkpoint(tiny_checkpoint(tmp_path_factory, rig_name))
  return _SOLVERS[rig_name]


@pytest.fixture(scope='module')
def solver(tmp_path_factory):
  return get_solver(tmp_path_factory)


def fk_np(R, offsets, parents, root):
  """Naive numpy FK: `R [T, J, 3, 3]`, `offsets [J, 3]`, `root [T, 3]` -> (G, p)."""
  T, J = R.shape[:2]
  G, p = np.zeros((T, J, 3, 3)), np.zeros((T, J, 3))
  for j, par in enumerate(parents):
    if par < 0:
      G[:, j], p[:, j] = R[:, j], root
    else:
      G[:, j] = G[:, par] @ R[:, j]
      p[:, j] = p[:, par] + G[:, par] @ offsets[j]
  return G, p


def random_rotations(shape, scale, seed):
  aa = np.random.default_rng(seed).normal(scale=scale, size=tuple(shape) + (3,))
  return Rotation.from_rotvec(aa.reshape(-1, 3)).as_matrix().reshape(tuple(shape) + (3, 3))


def posed_clip(rig, offsets, T=6, seed=0, scale=0.4):
  """Positions `[T, J, 3]` (metres) of random moderate poses on `offsets`, root moving."""
  R = random_rotations((T, rig.num_joints), scale, seed)
  root = np.asarray(offsets[0]) + np.random.default_rng(seed).normal(scale=0.2, size=(T, 3))
  return fk_np(R, np.asarray(offsets, np.float64), rig.parents, root)[1]


def test_solve_one_frame_and_clip(solver):
  pos = posed_clip(solver.rig, solver.offsets)
  J = solver.rig.num_joints
  R = solver.solve(pos)
  R1 = solver.solve(pos[2])
  assert R.shape == (len(pos), J, 3, 3) and R1.shape == (J, 3, 3)
  np.testing.assert_allclose(R1, R[2], atol=2e-5)  # padding to a bucket changes nothing
  np.testing.assert_allclose(R @ np.swapaxes(R, -1, -2), np.broadcast_to(np.eye(3), R.shape),
                             atol=1e-5)


def test_full_solution_is_consistent(solver):
  pos = posed_clip(solver.rig, solver.offsets, T=5, seed=1)
  sol = solver.solve(pos, full=True)
  G, p = fk_np(sol.local_rot.astype(np.float64), sol.offsets, solver.rig.parents, pos[:, 0])
  np.testing.assert_allclose(p, sol.positions_fk, atol=1e-5)
  np.testing.assert_allclose(G, sol.global_rot, atol=1e-5)
  np.testing.assert_allclose(sol.global_rot @ sol.bone_frames.astype(np.float32),
                             sol.bone_aligned_rot, atol=1e-5)
  np.testing.assert_allclose(sol.positions_fk[:, 0], pos[:, 0], atol=1e-6)
  assert sol.fk_error_m().shape == (5, solver.rig.num_joints)


def test_estimate_lengths_keeps_template_directions(solver):
  rig = solver.rig
  subject = solver.offsets * 1.15
  pos = posed_clip(rig, subject, T=4, seed=2)
  off = solver.resolve_offsets(pos, estimate_lengths=True)
  real = np.linalg.norm(solver.offsets, axis=-1) > 1e-6
  real[0] = False
  np.testing.assert_allclose(off[real], subject[real], rtol=1e-4, atol=1e-6)
  dirs = lambda o: o[real] / np.linalg.norm(o[real], axis=-1, keepdims=True)  # noqa: E731
  np.testing.assert_allclose(dirs(off), dirs(solver.offsets), atol=1e-9)
  sol = solver.solve(pos, estimate_lengths=True, full=True)
  np.testing.assert_allclose(sol.offsets, off)


def test_fitted_offsets_are_the_ones_the_rotations_imply(solver):
  rig = solver.rig
  rng = np.random.default_rng(4)
  # Any rotations and any offsets (bones turned and stretched; co-located joints kept so):
  # from the FK positions, the offsets come back exactly.
  subject = solver.offsets * rng.uniform(0.8, 1.2, (rig.num_joints, 1))
  subject = np.einsum('jab,jb->ja', random_rotations((rig.num_joints,), 0.3, 5), subject)
  R = random_rotations((7, rig.num_joints), 0.8, 6)
  G, p = fk_np(R, subject, rig.parents, rng.normal(size=(7, 3)))
  fit = solver_lib.fitted_offsets(G, p, solver.offsets, rig)
  np.testing.assert_allclose(fit[1:], subject[1:], atol=1e-12)
  np.testing.assert_array_equal(fit[0], solver.offsets[0])
  # Solved on the template's: the same rotations, a skeleton nearer the input, its FK and
  # bone frames from the fitted offsets.
  pos = posed_clip(rig, subject, T=5, seed=7)
  a = solver.solve(pos, full=True)
  b = solver.solve(pos, full=True, fit_offsets=True)
  np.testing.assert_array_equal(a.local_rot, b.local_rot)
  np.testing.assert_allclose(b.offsets, solver_lib.fitted_offsets(a.global_rot, pos,
                                                                  a.offsets, rig), atol=1e-6)
  assert b.fk_error_m()[:, 1:].mean() < a.fk_error_m()[:, 1:].mean()
  _, fk = fk_np(b.local_rot.astype(np.float64), b.offsets, rig.parents, pos[:, 0])
  np.testing.assert_allclose(fk, b.positions_fk, atol=1e-5)
  np.testing.assert_allclose(b.bone_frames, solver_lib.bone_frames_lib.bone_frames_np(
      b.offsets, rig), atol=1e-6)
  for bad in (dict(), dict(full=True, estimate_lengths=True)):
    with pytest.raises(InputError, match='fit_offsets'):
      solver.solve(pos, fit_offsets=True, **bad)


def test_fitted_offsets_after_a_refinement_stand_on_the_input_s_root(tmp_path_factory):
  """A refinement fits a root translation for the offsets it solved on; the fitted offsets
  replace those, so their FK stands on the input's root again (it was left at the refined
  root: every joint 17 mm off on a CMU clip), as without the refinement."""
  refined = IKSolver.from_checkpoint(tiny_checkpoint(tmp_path_factory), refine_iters=5,
                                     refine_prior=None)
  rig = refined.rig
  pos = posed_clip(rig, refined.offsets * 1.1, T=4, seed=3)
  moved = refined.solve(pos, full=True)
  assert np.abs(moved.positions_fk[:, 0] - pos[:, 0]).max() > 1e-4  # the fitted root
  fit = refined.solve(pos, full=True, fit_offsets=True)
  np.testing.assert_allclose(fit.positions_fk[:, 0], pos[:, 0], atol=1e-6)
  np.testing.assert_allclose(fit.offsets, solver_lib.fitted_offsets(
      moved.global_rot, pos, moved.offsets, rig), atol=1e-6)


def test_float16_frames_warn_once_per_solver_at_the_caller_s_line(tmp_path_factory):
  """float16 frames (1 mm steps at 1 m) warn once per solver, however many frames come
  (step, a stream, single-frame solves), at the caller's line (it said so per frame, at a
  library line)."""
  fresh = IKSolver.from_checkpoint(tiny_checkpoint(tmp_path_factory))
  clip = posed_clip(fresh.rig, fresh.offsets, T=3, scale=0.2).astype(np.float16)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    for frame in clip:
      fresh.step(frame)
      fresh.solve(frame)
    list(fresh.solve_stream(list(clip)))
  said = [w for w in caught if 'float16' in str(w.message)]
  assert len(said) == 1 and said[0].filename == __file__, [(w.filename, w.message) for w in said]


def test_step_and_stream_take_offsets_in_the_frames_units_and_axes(solver):
  """`offsets=` given with `units=` and `input_axes=` are in those units and axes for `step`
  and `solve_stream` as for `solve` (they were taken as metres in rig axes: refused in cm, or
  other rotations in z-up metres)."""
  rig = solver.rig
  off = np.asarray(solver.offsets) * 1.05
  pos = posed_clip(rig, off, T=3, seed=11, scale=0.2)
  M = parse_input_axes('x,z,-y')
  x, o = (pos / 0.01) @ M, (off / 0.01) @ M  # z-up centimetres: input = M^T rig
  want = solver.solve(x, offsets=o, units='cm', input_axes='x,z,-y')
  solver.reset()
  got = np.stack([solver.step(f, offsets=o, units='cm', input_axes='x,z,-y') for f in x])
  np.testing.assert_allclose(got, want, atol=2e-5)
  solver.reset()
  streamed = np.concatenate(list(solver.solve_stream([x[:2], x[2:]], offsets=o, units='cm',
                                                     input_axes='x,z,-y')))
  np.testing.assert_allclose(streamed, want, atol=2e-5)
  solver.reset()


def test_every_output_is_the_caller_s_to_write(tmp_path_factory):
  """step, solve_stream and solve (a temporal filter on, full) give arrays the caller may
  edit in place (step's and a filtered solve's were read-only views of device memory)."""
  from ik_gat_jax import temporal
  s = IKSolver.from_checkpoint(tiny_checkpoint(tmp_path_factory))
  pos = posed_clip(s.rig, s.offsets, T=3, scale=0.2)
  outs = [s.step(pos[0]), next(iter(s.solve_stream([pos[1:]]))), s.solve(pos)]
  s.temporal_filter = temporal.FilterConfig(kind='one_euro')
  s.reset()
  sol = s.solve(pos, full=True)
  outs += [s.solve(pos), s.step(pos[0])] + [getattr(sol, f.name) for f in
                                            dataclasses.fields(sol)]
  for a in outs:
    assert isinstance(a, np.ndarray) and a.flags.writeable
    a[...] = 0.0


def test_a_stream_takes_the_subject_assigned_while_it_runs(tmp_path_factory):
  """`solver.offsets = ...` between a stream's items (a tracker's calibration arriving)
  starts a new stream there, for `solve_stream` as for `step` (the generator kept the subject
  it began with: 7.9 deg from step on the shipped model)."""
  s = IKSolver.from_checkpoint(tiny_checkpoint(tmp_path_factory))
  template = np.array(s.offsets)
  new = np.einsum('jab,jb->ja', random_rotations((len(template),), 0.3, 5), template)  # turned
  pos = posed_clip(s.rig, new, T=6, seed=2, scale=0.2)
  want = []
  for i, f in enumerate(pos):
    if i == 3:
      s.offsets = new
    want.append(s.step(f))
  s.offsets = template
  got = []
  for i, R in enumerate(s.solve_stream(iter(pos))):
    got.append(R)
    if i == 2:
      s.offsets = new
  np.testing.assert_allclose(np.stack(got), np.stack(want), atol=2e-5)
  assert _max_angle(np.stack(got)[3:], s.solve(pos[3:], offsets=template)) > 1e-3


def test_writers_refuse_joint_names_a_tool_cannot_bind(solver, tmp_path):
  """Names given to the BVH and GLB writers: one per joint, distinct (a GLB of 21 nodes all
  named 'a' was written), non-empty."""
  rig = solver.rig
  sol = solver.solve(posed_clip(rig, solver.offsets, T=2, seed=3, scale=0.2), full=True)
  J = rig.num_joints
  for names, why in ((['a'] * J, "'a' names 21 joints"), (list(rig.joint_names[:-1]), 'got 20'),
                     ([''] + list(rig.joint_names[1:]), "'' is empty")):
    for write in (exports.write_solution_bvh, exports.write_solution_glb):
      with pytest.raises(InputError, match=rf'joint names must be {J} distinct names, one per '
                         rf"joint of rig 'cmu_body': {why}"):
        write(tmp_path / 'x.out', sol, rig, 30.0, names=names)
  assert list(tmp_path.iterdir()) == []


def test_writers_refuse_a_frame_rate_that_is_not_one(solver, tmp_path):
  """Every writer refuses fps 0, negative, NaN, inf in one line, writing nothing (the BVH
  writer wrote `Frame Time: nan` or divided by zero; the GLB's JSON failed on inf)."""
  rig = solver.rig
  sol = solver.solve(posed_clip(rig, solver.offsets, T=2, seed=3, scale=0.2), full=True)
  writers = {'bvh': exports.write_solution_bvh, 'glb': exports.write_solution_glb,
             'npz': lambda path, *a: exports.write_npz_atomic(path, exports.solution_arrays(*a))}
  for fps in (0.0, -30.0, float('nan'), float('inf'), 'x'):
    for ext, write in writers.items():
      with pytest.raises(InputError, match='fps must be a positive frame rate'):
        write(tmp_path / f'a.{ext}', sol, rig, fps)
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize('units', ['cm', 'm'])
def test_bvh_write_read_fk_matches_solver(solver, tmp_path, units):
  rig = solver.rig
  offsets = np.asarray(solver.offsets).copy()
  offsets[0] = (0.1, 0.9, -0.2)  # a root rest position (smpl22's template has one)
  sol = solver.solve(posed_clip(rig, offsets, T=5, seed=3), offsets=offsets, full=True)
  path = tmp_path / f'out_{units}.bvh'
  exports.write_solution_bvh(path, sol, rig, fps=30.0, units=units)
  motion = bvh.read_bvh(path)
  order = [motion.names.index(n) for n in rig.joint_names]
  scale = exports.BVH_UNITS[units]
  p = bvh.naive_fk_np(motion, scale=scale)[:, order]
  np.testing.assert_allclose(p, sol.positions_fk, atol=1e-4)
  # The root's OFFSET is 0, so a reader that adds it to the root's channels (three.js's
  # BVHLoader) places the body where one that does not (Blender, Assimp, this FK) does.
  np.testing.assert_array_equal(motion.joints[0].offset, 0.0)
  np.testing.assert_allclose(motion.offsets[order][1:] * scale, sol.offsets[1:], atol=1e-9)
  assert motion.fps == pytest.approx(30.0)
  leaves = [j for j, kids in enumerate(rig.children) if not kids]
  assert all(motion.joints[order[j]].end_site is not None for j in leaves)
  # The file's own offsets come back as the subject, and its positions as the input.
  np.testing.assert_allclose(exports.read_bvh_offsets(path, rig, units=units)[1:],
                             sol.offsets[1:], atol=1e-6)
  clip = exports.read_bvh_clip(path, rig, units=units)
  np.testing.assert_allclose(clip.positions, sol.positions_fk, atol=1e-4)


def test_bvh_channels_are_continuous_over_time(tmp_path):
  """Each joint turning about its order's middle axis by 25 degrees a frame for two turns,
  between fixed turns about the other two: every rotation order's channels come out as that
  continuous triple (no 360-degree wraps, no switch to the other triple of a rotation at a
  middle angle of 90), and FK is unchanged."""
  rig = skeleton.cmu_body()
  T, J = 30, rig.num_joints
  for order in ('ZYX', 'XYZ', 'YZX', 'ZXY', 'XZY', 'YXZ'):
    # Middle angles 4.5 degrees or more from 90 + 180 k (gimbal lock: there only the sum or
    # the difference of the other two is defined).
    middle = 25.0 * np.arange(T)[:, None] + 0.37 * np.arange(J) + 3.1
    want = np.stack(np.broadcast_arrays(20.0, middle, 10.0), axis=-1)  # [T, J, 3] in `order`
    R = Rotation.from_euler(order, want.reshape(-1, 3), degrees=True).as_matrix()
    R = R.reshape(T, J, 3, 3)
    motion = exports.solution_bvh(R, np.zeros((T, 3)), rig.template(), rig, 30.0,
                                  orders=[order] * J)
    order_j = [motion.names.index(n) for n in rig.joint_names]
    got = motion.motion[:, 3:].reshape(T, J, 3)[:, order_j]
    np.testing.assert_allclose(got, want, atol=1e-6, err_msg=order)
    bvh.write_bvh(tmp_path / 'turn.bvh', motion)
    _, p = fk_np(R, rig.template(), rig.parents, np.zeros((T, 3)))
    back = bvh.read_bvh(tmp_path / 'turn.bvh')
    np.testing.assert_allclose(bvh.naive_fk_np(back, 0.01)[:, order_j], p, atol=1e-6)


def test_bvh_with_extra_joints_reduces_by_name(solver, tmp_path):
  rig = solver.rig
  sol = solver.solve(posed_clip(rig, solver.offsets, T=3, seed=4), full=True)
  motion = exports.solution_bvh(sol.local_rot, sol.positions_fk[:, 0], sol.offsets, rig, 30.0)
  # A rotating extra leaf under the last joint (depth-first order stays valid): pruned by name.
  motion.joints.append(bvh.BVHJoint('RightToeEnd', len(motion.joints) - 1,
                                    np.array([0.0, 0.0, 5.0]), ('Zrotation', 'Yrotation',
                                                                'Xrotation')))
  motion.motion = np.concatenate([motion.motion, np.full((3, 3), 20.0)], axis=1)
  bvh.write_bvh(tmp_path / 'extra.bvh', motion)
  clip = exports.read_bvh_clip(tmp_path / 'extra.bvh', rig)
  np.testing.assert_allclose(clip.positions, sol.positions_fk, atol=1e-4)
  np.testing.assert_allclose(clip.offsets, sol.offsets, atol=1e-6)


def test_bvh_of_smpl22_reorders_depth_first(tmp_path):
  rig = skeleton.smpl22()
  T = 3
  R = random_rotations((T, 22), 0.5, 0)
  root = np.tile(rig.template()[0], (T, 1))
  motion = exports.solution_bvh(R, root, rig.template(), rig, 30.0)
  bvh.write_bvh(tmp_path / 's.bvh', motion)  # refuses a non depth-first order
  back = bvh.read_bvh(tmp_path / 's.bvh')
  order = [back.names.index(n) for n in rig.joint_names]
  _, p = fk_np(R, rig.template(), rig.parents, root)
  np.testing.assert_allclose(bvh.naive_fk_np(back, 0.01)[:, order], p, atol=1e-4)


def test_bvh_end_sites_round_trip(tmp_path):
  """A rig-named BVH's End Sites, read (`end_site_offsets`, metres, each leaf's frame) and
  given to the writer, come back as they were, in other units too; a NaN row gets the
  writer's own (along the leaf's rest direction); a wrong shape is refused in one line."""
  rig = skeleton.cmu_body()
  T, E = 4, len(rig.leaves)
  R = random_rotations((T, rig.num_joints), 0.4, 5)
  root = np.tile(rig.template()[0], (T, 1))
  ends = np.random.default_rng(6).normal(0.0, 0.08, (E, 3))
  bvh.write_bvh(tmp_path / 'in.bvh', exports.solution_bvh(R, root, rig.template(), rig, 30.0,
                                                          end_sites=ends))
  clip = exports.read_bvh_clip(tmp_path / 'in.bvh', rig)
  np.testing.assert_allclose(clip.end_site_offsets, ends, rtol=1e-6, atol=1e-9)
  own = exports.solution_bvh(R, root, rig.template(), rig, 30.0, units='inch')
  for units in ('cm', 'inch'):
    motion = exports.solution_bvh(R, root, rig.template(), rig, 30.0, units=units,
                                  end_sites=clip.end_site_offsets)
    k = exports.bvh_metres_per_unit(units)
    for e, leaf in enumerate(rig.leaves):
      got = motion.joints[motion.names.index(rig.joint_names[leaf])].end_site * k
      np.testing.assert_allclose(got, ends[e], rtol=1e-6, atol=1e-9)
  half = clip.end_site_offsets.copy()
  half[0] = np.nan
  motion = exports.solution_bvh(R, root, rig.template(), rig, 30.0, units='inch', end_sites=half)
  first = rig.joint_names[rig.leaves[0]]
  np.testing.assert_array_equal(motion.joints[motion.names.index(first)].end_site,
                                own.joints[own.names.index(first)].end_site)
  with pytest.raises(InputError, match=r'end sites must be \[5, 3\] \(one per leaf'):
    exports.solution_bvh(R, root, rig.template(), rig, 30.0, end_sites=ends[:3])


def test_csv_with_and_without_header(solver, tmp_path):
  rig = solver.rig
  pos = posed_clip(rig, solver.offsets, T=3)
  flat = pos.reshape(3, -1)
  (tmp_path / 'a.csv').write_text('\n'.join(','.join(f'{v:.9f}' for v in r) for r in flat))
  header = ','.join(f'{n}_{a}' for n in rig.joint_names for a in 'xyz')
  (tmp_path / 'b.csv').write_text(header + '\n' + (tmp_path / 'a.csv').read_text() + '\n')
  # A named header in another joint order is reordered to the rig's.
  perm = np.random.default_rng(0).permutation(3 * rig.num_joints)
  names = header.split(',')
  (tmp_path / 'c.csv').write_text(','.join(names[k] for k in perm) + '\n' + '\n'.join(
      ','.join(f'{v:.9f}' for v in r[perm]) for r in flat))
  (tmp_path / 'd.csv').write_text('frame data\n' + (tmp_path / 'a.csv').read_text())
  for name in 'abcd':
    np.testing.assert_allclose(exports.read_positions_csv(tmp_path / f'{name}.csv', rig), pos,
                               atol=1e-8, err_msg=name)
  (tmp_path / 'bad.csv').write_text('1,2,3\n')
  with pytest.raises(InputError, match=r'bad.csv:1: 3 columns, expected 63 .*Hips, LowerBack'):
    exports.read_positions_csv(tmp_path / 'bad.csv', rig)


def test_npz_reader_orders_by_joint_names(solver, tmp_path):
  rig = solver.rig
  pos = posed_clip(rig, solver.offsets, T=2)
  perm = np.arange(rig.num_joints)[::-1]
  np.savez(tmp_path / 'p.npz', positions=pos[:, perm],
           joint_names=np.asarray(rig.joint_names)[perm], fps=60.0)
  got = exports.read_positions_npz(tmp_path / 'p.npz', rig)
  np.testing.assert_allclose(got.positions, pos)
  assert got.fps == 60.0
  np.savez(tmp_path / 'q.npz', positions=pos, joint_names=np.asarray(['x'] * rig.num_joints))
  with pytest.raises(InputError, match='do not match rig'):
    exports.read_positions_npz(tmp_path / 'q.npz', rig)
  np.savez(tmp_path / 'n.npz', positions=pos[:, perm],  # one namespace: the bare names count
           joint_names=np.asarray(['Anna:' + n for n in rig.joint_names])[perm])
  np.testing.assert_allclose(exports.read_positions_npz(tmp_path / 'n.npz', rig).positions, pos)


def test_input_errors(solver):
  rig = solver.rig
  pos = posed_clip(rig, solver.offsets, T=3)
  with pytest.raises(InputError, match=r'expected positions \[T, 21, 3\].*Hips, LowerBack.*got 22 '
                     'joints'):
    solver.solve(np.zeros((3, 22, 3)))
  with pytest.raises(InputError, match=r'got shape \(3, 21, 2\)'):
    solver.solve(pos[..., :2])
  bad = pos.copy()
  bad[1, 6, 2] = np.nan
  with pytest.raises(InputError, match=r'NaN/inf: frame 1, joint 6 \(Head\).*hold_missing=True'):
    solver.solve(bad)
  trackers = pos.copy()
  trackers[:, [2, 3]] = np.nan  # the same joints in every frame: no tracker there
  with pytest.raises(InputError, match=r'Spine, Spine1 missing in every frame: a tracker subset '
                     r'needs a checkpoint trained with joint masks'):
    solver.solve(trackers)
  bad[1, 6, 2] = np.inf
  with pytest.raises(InputError, match='NaN/inf'):
    solver.step(bad[1])
  with pytest.raises(InputError, match='--units'):
    solver.solve(pos, units='furlongs')
  with pytest.raises(InputError, match='each of x, y, z once'):
    solver.solve(pos, input_axes='x,x,z')


@pytest.mark.parametrize('size', [(1, 21, 3), (2000, 21, 3)])  # summed in Python / numpy
def test_all_finite_is_numpys_isfinite_all(size):
  """`solver.all_finite` on finite arrays, NaN, +-inf, both infinities, and finite values whose
  sum overflows (the Python sum's fallback)."""
  rng = np.random.default_rng(3)
  for value in (None, np.nan, np.inf, -np.inf, 'both', 'overflow', 'huge'):
    a = rng.normal(size=size)
    if value == 'both':
      a.flat[1], a.flat[-1] = np.inf, -np.inf
    elif value == 'overflow':
      a.flat[0] = a.flat[-1] = 1e308
    elif value == 'huge':
      a.flat[0], a.flat[-1] = 1e308, -1e308
    elif value is not None:
      a.flat[a.size // 2] = value
    assert solver_lib.all_finite(a) == bool(np.isfinite(a).all()), value


def test_prepare_applies_units_and_axes(solver):
  """`prepare`: metres in rig axes pass as they are; units and an axes map scale and rotate."""
  pos = posed_clip(solver.rig, solver.offsets, T=4)
  np.testing.assert_array_equal(solver.prepare(pos)[0], pos)
  M = solver_lib.parse_input_axes('x,z,-y', solver.rig)
  got = solver.prepare(pos * 100 @ M, units='cm', input_axes='x,z,-y', check=False)[0]
  np.testing.assert_allclose(got, pos, rtol=0, atol=1e-12)


def _warnings_of(fn):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    fn()
  return [str(w.message) for w in caught]


def test_unit_and_axis_warnings(solver):
  rig = solver.rig
  pos = posed_clip(rig, solver.offsets, T=4, scale=0.2)
  assert _warnings_of(lambda: solver.solve(pos)) == []
  msgs = _warnings_of(lambda: solver.solve(pos * 100))
  assert any('looks like centimetres: pass --units=cm' in m for m in msgs), msgs
  assert _warnings_of(lambda: solver.solve(pos * 100, units='cm')) == []
  msgs = _warnings_of(lambda: solver.solve(pos, units='cm'))
  assert any('looks like metres: pass --units=m' in m for m in msgs), msgs
  # z-up data (rig y = input z): the head is below the pelvis in the rig's frame.
  z_up = pos @ parse_input_axes('x,z,-y')  # rig = M @ input
  msgs = _warnings_of(lambda: solver.solve(z_up))
  assert any('up axis looks wrong' in m and '--input_axes=x,z,-y' in m for m in msgs), msgs
  assert _warnings_of(lambda: solver.solve(z_up, input_axes='x,z,-y')) == []
  upside_down = pos * np.array([1.0, -1.0, -1.0])
  msgs = _warnings_of(lambda: solver.solve(upside_down))  # it may be a handstand: said so
  assert any('up axis looks wrong' in m and m.endswith('a clip of a body lying or upside down '
                                                       'is solved as it is (leave the axes)')
             for m in msgs), msgs
  # Left-handed data (a y-up engine's, exported unconverted): the solution faced backwards,
  # knees bent the wrong way, 50 deg off, without a word; a turned body is not mirrored.
  mirrored = pos * np.array([-1.0, 1.0, 1.0])
  msgs = _warnings_of(lambda: solver.solve(mirrored))
  assert any(m.startswith('the body looks mirrored: its feet point backwards in 100% of the '
                          'frames') and m.endswith('--input_axes=-x,y,z)') for m in msgs), msgs
  assert _warnings_of(lambda: solver.solve(mirrored, input_axes='-x,y,z')) == []
  assert not any('mirrored' in m for m in _warnings_of(lambda: solver.solve(upside_down)))
  # Feet (a unit the solver knows) read as metres: named (it passed, a 5.6 m person); a child
  # (0.65x the template) in millimetres: the unit named, not the number that made it an adult.
  # (the command line's check of units nobody named).
  assert 'looks like feet: pass --units=ft' in solver_lib.units_problem(pos / 0.3048, rig,
                                                                       defaulted=True)
  assert solver_lib.units_problem(pos, rig, 0.3048, defaulted=True) is None  # --units=ft
  assert _warnings_of(lambda: solver.solve(pos / 0.3048, units='ft')) == []
  assert solver_lib.units_hint(0.65 * 1000, 1.0) == 'looks like millimetres: pass --units=mm'
  assert solver_lib.units_hint(0.65 * 100, 1.0) == 'looks like centimetres: pass --units=cm'
  assert solver_lib.units_hint(300.0, 1.0) == 'pass --units=0.003333 (metres per input unit)'
  # y-up data given a wrong --input_axes: the hint is the whole map from the input's axes, so
  # following it silences the warning (it used to suggest a map of the converted axes, which
  # sent the user round in a circle), for clips and for a stream's first frame alike.
  for given, data in (('x,z,-y', pos), ('x,-z,y', z_up), ('x,-y,-z', pos)):
    for run in (lambda a: solver.solve(data, input_axes=a),
                lambda a: (solver.reset(), solver.step(data[0], input_axes=a))):
      msgs = [m for m in _warnings_of(lambda: run(given)) if 'up axis looks wrong' in m]
      assert len(msgs) == 1, (given, msgs)
      spec = re.search(r'--input_axes=(\S+) if input ([+-][xyz]) is up', msgs[0])
      assert spec.group(2) == ('+y' if data is pos else '+z'), msgs
      assert not [m for m in _warnings_of(lambda: run(spec.group(1))) if 'up axis' in m], msgs


def test_up_check_of_a_rig_whose_zero_pose_is_not_upright(solver):
  """Another lab's rig whose zero pose has its legs up (a toe on top, as under random binds):
  an upright clip draws no up warning (the toe is no head), z-up data still does, by the
  bodies' extent, with the axes that fix it."""
  cmu = solver.rig
  template = np.asarray(cmu.template()).copy()
  legs = [cmu.joint_names.index(n) for n in ('LeftUpLeg', 'LeftLeg', 'LeftFoot', 'LeftToeBase')]
  template[legs, 1] *= -1.0
  rig = skeleton.make_rig('legs_up', cmu.joint_names, cmu.parents, template, up=cmu.up,
                          forward=cmu.forward)
  assert solver_lib._top_joint(rig) == cmu.joint_names.index('LeftToeBase')
  pos = posed_clip(cmu, solver.offsets, T=4, scale=0.2)
  assert any('up axis looks wrong' in m for m in _warnings_of(
      lambda: solver_lib.check_plausibility(pos, dataclasses.replace(rig, name='cmu_body'))))
  assert solver_lib.check_plausibility(pos, rig) == []
  z_up = pos @ parse_input_axes('x,z,-y')
  msgs = _warnings_of(lambda: solver_lib.check_plausibility(z_up, rig))
  assert any('bodies extend most along z' in m and '--input_axes=x,z,-y' in m for m in msgs), msgs


def test_plausibility_of_a_long_clip_on_spread_frames(solver):
  """A long clip is judged on at most `_PLAUSIBILITY_FRAMES` frames spread over it: the same
  warnings as the whole clip's for a unit or axis problem, and none for a good clip."""
  rig = solver.rig
  n = 3 * solver_lib._PLAUSIBILITY_FRAMES + 7
  pos = posed_clip(rig, solver.offsets, T=n, scale=0.2)
  assert solver_lib.check_plausibility(pos, rig) == []
  msgs = _warnings_of(lambda: solver_lib.check_plausibility(pos * 100, rig))
  assert len(msgs) == 1 and 'looks like centimetres' in msgs[0] and '100x' in msgs[0], msgs
  z_up = pos @ parse_input_axes('x,z,-y')
  assert any('--input_axes=x,z,-y' in m
             for m in _warnings_of(lambda: solver_lib.check_plausibility(z_up, rig)))


def test_input_axes():
  M = parse_input_axes('x,z,-y')
  np.testing.assert_array_equal(M @ np.array([1.0, 2.0, 3.0]), [1.0, 3.0, -2.0])
  rig = skeleton.cmu_body()
  # Unreal: z up, x forward, y right -> rig y up, z forward, x left.
  U = parse_input_axes('unreal', rig)
  np.testing.assert_array_equal(U @ [0, 0, 1.0], rig.up)
  np.testing.assert_array_equal(U @ [1.0, 0, 0], rig.forward)
  np.testing.assert_array_equal(U @ [0, 1.0, 0], -np.asarray(rig.lateral))
  Y = parse_input_axes('unity', rig)
  np.testing.assert_array_equal(Y @ [1.0, 0, 0], -np.asarray(rig.lateral))
  assert np.linalg.det(U) == pytest.approx(-1.0)


def test_checkpoint_for_another_rig(tmp_path_factory, solver):
  smpl_ckpt = tiny_checkpoint(tmp_path_factory, 'smpl22')
  with pytest.raises(CheckpointError, match="for rig 'smpl22' .*not 'cmu_body'"):
    IKSolver.from_checkpoint(smpl_ckpt, expected_rig='cmu_body')
  smpl_pos = np.zeros((2, 22, 3))
  with pytest.raises(InputError, match='got 22 joints'):
    solver.solve(smpl_pos)


def test_missing_shipped_default(monkeypatch, tmp_path):
  monkeypatch.setattr(inference, 'SHIPPED_IKGAT', tmp_path / 'nope')
  with pytest.raises(CheckpointError, match='shipped default .* does not exist yet'):
    IKSolver.from_checkpoint(None)


def test_buckets_stream_never_recompiles(solver):
  assert bucket_sizes(1024) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
  assert bucket_sizes(12) == (1, 2, 4, 8, 12)
  rig = solver.rig
  pos = posed_clip(rig, solver.offsets, T=8, scale=0.2)
  before = solver.trace_count
  sizes = [1, 3, 5, 7, 1, 2, 3, 4, 6, 8, 1]
  out = list(solver.solve_stream(pos[:n] for n in sizes))
  assert [o.shape[0] for o in out] == sizes
  assert solver.trace_count - before <= 4  # at most one compile per bucket 1, 2, 4, 8
  solver.step(pos[0])  # `step`'s own executable for the solver's subject: at most one more
  assert solver.trace_count - before <= 5
  after = solver.trace_count
  list(solver.solve_stream(pos[:n] for n in sizes))
  for t in range(len(pos)):
    solver.step(pos[t])
  list(solver.solve_stream(iter(pos)))  # single frames [J, 3]
  assert solver.trace_count == after  # nothing new once each bucket was compiled
  np.testing.assert_allclose(solver.step(pos[3]), solver.solve(pos)[3], atol=2e-5)


def test_step_of_the_solvers_subject_is_any_subjects_step(solver):
  """`step` compiles the solver's own subject (`offsets`) into its executable: the same
  rotations as the generic path given those offsets, and a new subject assigned to `offsets`
  is compiled in anew (the old array cannot be edited in place)."""
  pos = posed_clip(solver.rig, solver.offsets, T=4, scale=0.2)
  saved = solver.offsets
  with pytest.raises(ValueError, match='read-only'):
    solver.offsets[0, 0] = 1.0
  assert solver.solve(pos[:2], full=True).offsets.flags.writeable  # a solution's own copy
  np.testing.assert_allclose(solver.step(pos[1]), solver.step(pos[1], offsets=saved.copy()),
                             atol=1e-6)
  other = saved + 0.03 * np.random.default_rng(0).standard_normal(saved.shape)  # new directions
  try:
    solver.offsets = other
    assert solver.offsets is not other and not solver.offsets.flags.writeable
    np.testing.assert_allclose(solver.step(pos[2]), solver.step(pos[2], offsets=other),
                               atol=1e-6)
    assert np.abs(solver.step(pos[2]) - solver.step(pos[2], offsets=saved)).max() > 1e-4
  finally:
    solver.offsets = saved
  np.testing.assert_allclose(solver.step(pos[2]), solver.step(pos[2], offsets=saved), atol=1e-6)
  current, traces = solver.offsets, solver.trace_count
  solver.offsets = saved.copy()  # the same subject again: kept, nothing recompiles
  solver.step(pos[3])
  assert solver.offsets is current and solver.trace_count == traces


def test_long_clip_in_chunks_with_progress(tmp_path_factory, solver, monkeypatch):
  # Traces are counted: no executable cache, which a command-line test run before in this
  # process may have turned on (its entries would load without a trace), and none of the
  # executables an earlier solver of this process shares (`solver.clear_executables`).
  monkeypatch.setattr(compile_cache, '_executables_dir', None)
  solver_lib.clear_executables()
  small = IKSolver.from_checkpoint(tiny_checkpoint(tmp_path_factory), block_size=8)
  pos = posed_clip(small.rig, small.offsets, T=21, scale=0.2)
  stream = io.StringIO()
  bar = solver_lib._ProgressBar(21, True, stream)
  for k in (8, 16, 21):
    bar.update(k)
  assert '21/21 frames 100%' in stream.getvalue()
  R = small.solve(pos, progress=False)
  np.testing.assert_allclose(R, solver.solve(pos), atol=2e-5)
  assert small.trace_count == 1  # chunks of 8, 8 and 5 frames: all in bucket 8
  small.solve(posed_clip(small.rig, small.offsets, T=17, scale=0.2), progress=False)
  assert small.trace_count == 1  # 8, 8 and 1: the last padded to the block, not bucket 1
  small.solve(pos[:1], progress=False)  # compiles bucket 1, which a long clip's tail then takes
  small.solve(posed_clip(small.rig, small.offsets, T=17, scale=0.2), progress=False)
  assert small.trace_count == 2  # no new shape either way


def _check_plan(solver, T):
  """A clip's chunk plan covers its frames in order, each chunk within block_size."""
  plan = solver._chunk_plan(T)
  assert [p[0] for p in plan] == list(np.cumsum([0] + [p[1] for p in plan[:-1]]))
  assert sum(p[1] for p in plan) == T and all(0 < p[1] <= solver.block_size for p in plan)
  return plan


def test_chunk_plan_balances_blocks_over_workers(tmp_path_factory):
  """Where the network runs in blocks, a clip is cut at block boundaries into chunks that give
  every worker the same number of blocks within one, computing at most one block of padding,
  all in the block_size bucket; without blocks (block_size <= a block) or with a refinement,
  chunks of block_size, or one per worker."""
  ckpt = tiny_checkpoint(tmp_path_factory)
  mb = inference.micro_batch_size()
  for workers in (1, 2, 3):
    solver = IKSolver.from_checkpoint(ckpt, workers=workers)
    for T in (mb + 1, 5 * mb, 1024, 1025, 1918, 5133, 9 * 1024 + 5):
      plan = _check_plan(solver, T)
      blocks = [-(-n // mb) for _, n, _ in plan]
      assert all(start % mb == 0 for start, _, _ in plan)
      assert sum(blocks) == -(-T // mb)  # at most one block of padding in the whole clip
      assert {b for _, _, b in plan} == {1024}
      per_worker = [sum(blocks[w::workers]) for w in range(workers)]
      assert max(per_worker) - min(per_worker) <= 1, (workers, T, plan)
      assert len(plan) % workers == 0 or len(plan) == sum(blocks)  # or one block each
      assert len(plan) < -(-T // 1024) + workers  # as few chunks as that allows
  two = IKSolver.from_checkpoint(ckpt, workers=2)
  assert two._chunk_plan(mb) == [(0, mb, None)]  # one block: its own bucket
  assert two._chunk_plan(5 * mb) == [(0, 3 * mb, 1024), (3 * mb, 2 * mb, 1024)]
  odd = IKSolver(inference.load_model(ckpt)[0], workers=4, block_size=mb - 24)
  for T in range(2 * mb, 4 * mb):
    assert all(b is None for _, _, b in _check_plan(odd, T))
  refined = IKSolver.from_checkpoint(ckpt, workers=2, refine_iters=2)
  assert [p[1] for p in _check_plan(refined, 5 * mb)] == [4 * mb, mb]  # one chunk per worker
  assert [p[1] for p in _check_plan(refined, 3000)] == [1024, 1024, 952]


def test_workers_solve_the_same_frames_in_order(tmp_path_factory):
  """Chunks run by two threads at once give every frame the one-thread solution, in order: a
  clip shorter than workers x block_size cut into one chunk per worker, and more chunks than
  workers; every clip longer than a block runs in one compiled shape; a bad worker count is
  refused."""
  ckpt = tiny_checkpoint(tmp_path_factory)
  one = IKSolver.from_checkpoint(ckpt, workers=1)
  two = IKSolver.from_checkpoint(ckpt, workers=2)
  assert one.workers == 1 and two.workers == 2
  assert solver_lib.default_workers() >= 1
  mb = inference.micro_batch_size()
  T = 5 * mb
  pos = posed_clip(one.rig, one.offsets, T=T, seed=3, scale=0.3)
  a, b = one.solve(pos, full=True, progress=False), two.solve(pos, full=True, progress=False)
  for k in ('local_rot', 'global_rot', 'positions_fk'):
    np.testing.assert_allclose(getattr(b, k), getattr(a, k), atol=2e-5)
  three = IKSolver.from_checkpoint(ckpt, workers=2, block_size=mb)  # 5 chunks for 2 threads
  np.testing.assert_allclose(three.solve(pos, progress=False), a.local_rot, atol=2e-5)
  solver_lib.clear_executables()  # `two` compiles its new shape itself (counted below)
  before = two.trace_count
  for n in (mb + 1, 2 * mb, 3 * mb + 7, T):  # every length in the block_size bucket
    np.testing.assert_allclose(two.solve(pos[:n], progress=False), a.local_rot[:n], atol=2e-5)
  assert two.trace_count == before + 1  # full=False: one more shape, then none
  for bad in (0, -1, 1.5, True):
    with pytest.raises(InputError, match='workers'):
      IKSolver.from_checkpoint(ckpt, workers=bad)


def test_smpl_export(tmp_path_factory, tmp_path, solver):
  smpl = get_solver(tmp_path_factory, 'smpl22')
  sol = smpl.solve(posed_clip(smpl.rig, smpl.offsets, T=4), full=True)
  arrays = smpl_lib.smpl_arrays(sol, smpl.rig, 30.0)
  assert arrays['poses'].shape == (4, 66) and arrays['pose_body'].shape == (4, 63)
  R = np.asarray(rotations.matrix_from_axis_angle(arrays['poses'].reshape(4, 22, 3)))
  np.testing.assert_allclose(R, sol.local_rot, atol=1e-5)  # the round trip through our module
  R_scipy = Rotation.from_rotvec(arrays['poses'].reshape(-1, 3)).as_matrix().reshape(R.shape)
  np.testing.assert_allclose(R_scipy, sol.local_rot, atol=1e-5)
  np.testing.assert_allclose(arrays['trans'] + sol.offsets[0], sol.positions_fk[:, 0], atol=1e-6)
  # AMASS's z-up world: only the root orientation and trans change (rig = W @ amass).
  am = smpl_lib.smpl_arrays(sol, smpl.rig, 30.0, world='amass')
  np.testing.assert_allclose(am['pose_body'], arrays['pose_body'], atol=1e-6)
  R_root = Rotation.from_rotvec(am['root_orient']).as_matrix()
  np.testing.assert_allclose(smpl_lib.AMASS_TO_RIG @ R_root, sol.local_rot[:, 0], atol=1e-5)
  np.testing.assert_allclose((am['trans'] + sol.offsets[0]) @ smpl_lib.AMASS_TO_RIG.T,
                             sol.positions_fk[:, 0], atol=1e-5)
  exports.write_smpl_npz(tmp_path / 'a.smpl.npz', sol, smpl.rig, 30.0)
  with np.load(tmp_path / 'a.smpl.npz') as z:
    assert z['poses'].shape == (4, 66)
  with pytest.raises(InputError, match='SMPL pose parameters need the smpl22 rig'):
    smpl_lib.smpl_pose_params(np.zeros((1, 21, 3, 3)), solver.rig)


def test_latency_stats(solver):
  stats = solver.latency_stats(n=20, warmup=2)
  assert stats['n'] == 20 and 0 < stats['median_ms'] <= stats['p99_ms']


def test_lazy_package_export():
  assert ik_gat_jax.IKSolver is IKSolver


def test_cmu_bvh_through_the_joint_map(cmu_dir, solver):
  clip = exports.read_bvh_clip(cmu_dir / '07_01.bvh', solver.rig, max_frames=8)
  assert clip.positions.shape == (8, 21, 3) and clip.fps == 120.0
  bones = np.linalg.norm(clip.offsets, axis=-1)
  assert 0.3 < bones[solver.rig.index('LeftLeg')] < 0.6  # metres: a shin
  assert solver.solve(clip.positions).shape == (8, 21, 3, 3)


def test_sparse_attention_solves_the_same(tmp_path_factory, solver):
  """`attention='auto'` (the sparse form from 16 frames on) is the same function as the
  default dense form (tests/gat_test.py: within float32 round-off); unknown forms are refused."""
  sparse = IKSolver.from_checkpoint(tiny_checkpoint(tmp_path_factory), attention='auto')
  pos = posed_clip(sparse.rig, sparse.offsets, T=20, scale=0.2)
  np.testing.assert_allclose(sparse.solve(pos), solver.solve(pos), atol=2e-5)
  x = np.zeros((32,) + pos.shape[1:], np.float32)
  hlo = [sol._forward.lower(sol._leaves, x, *sol._device_subject(sol.offsets)[:2], False).as_text()
         for sol in (sparse, solver)]
  assert hlo[0] != hlo[1]  # another evaluation was compiled, not the dense one again
  with pytest.raises(InputError, match="attention must be 'dense', 'sparse' or 'auto', got 'fast'"):
    IKSolver.from_checkpoint(tiny_checkpoint(tmp_path_factory), attention='fast')


# ----------------------------------------------------------------------------------------------
# Tracker dropouts held (`hold_missing`).


def _held_reference(pos: np.ndarray, rig) -> np.ndarray:
  """Frame by frame: a missing root keeps its offset from the mean of its children seen both
  now and where the root was last seen (none: it stays where it was in the frame before);
  another missing joint keeps its offset from the root of the frame before (the definition
  `hold_missing_joints` vectorises)."""
  kids = list(rig.children[0])
  out, prev, root_seen, kids_seen = [], None, None, None
  for f in pos:
    f = f.copy()
    bad = ~np.isfinite(f).all(axis=-1)
    if not bad[0]:
      root_seen, kids_seen = f[0].copy(), f[kids].copy()
    else:
      both = [i for i, k in enumerate(kids) if not bad[k] and np.isfinite(kids_seen[i]).all()]
      f[0] = (root_seen + np.mean([f[kids[i]] - kids_seen[i] for i in both], axis=0) if both
              else prev[0])
    for j in np.nonzero(bad[1:])[0] + 1:
      f[j] = prev[j] - prev[0] + f[0]
    out.append(f)
    prev = f
  return np.stack(out)


def _dropouts(pos: np.ndarray) -> np.ndarray:
  pos = pos.copy()
  pos[2:5, 9] = np.nan  # a hand for three frames
  pos[3, 0] = np.nan  # the root for one, meanwhile
  pos[5, 12, 1] = np.inf  # one coordinate
  pos[6:, 16] = np.nan  # a toe to the end
  return pos


def test_hold_missing_joints_fills_causally_and_alike_in_any_chunks(solver):
  rig = solver.rig
  pos = _dropouts(posed_clip(rig, solver.offsets, T=9, seed=3))
  filled, state = solver_lib.hold_missing_joints(pos, None, rig)
  np.testing.assert_allclose(filled, _held_reference(pos, rig), rtol=0, atol=1e-12)
  ok = np.isfinite(pos).all(axis=-1)
  np.testing.assert_array_equal(filled[ok], pos[ok])  # observed joints untouched
  for chunks in ([1] * 9, [2, 3, 4], [4, 5]):
    parts, held, t = [], None, 0
    for n in chunks:
      part, held = solver_lib.hold_missing_joints(pos[t:t + n], held, rig)
      parts.append(part)
      t += n
    np.testing.assert_array_equal(np.concatenate(parts), filled)  # stream == clip, bit for bit
    for a, b in zip(held, state):
      np.testing.assert_array_equal(a, b)
  with pytest.raises(InputError, match=r'joint 9 \(LeftHand\) is missing .* in frame 0 and was '
                     'not seen before it'):
    solver_lib.hold_missing_joints(pos[2:], None, rig)


def test_a_missing_root_moves_with_its_children(solver):
  """A walker whose root (pelvis) tracker drops out: the root keeps its offset from its
  children seen with it (exact for a body that moves rigidly without turning), so the held
  joints below it move too; a child missing as well leaves it to the others, and with none
  seen the root stays where it was."""
  rig = solver.rig
  still = posed_clip(rig, solver.offsets, T=1, seed=7)[0]
  walk = still + np.linspace(0.0, 1.5, 30)[:, None, None] * np.array([0.0, 0.05, 1.0])
  pos = walk.copy()
  pos[5:25, 0] = np.nan  # the root for 20 frames
  pos[10:25, 9] = np.nan  # a hand too
  pos[12:16, rig.children[0][1]] = np.nan  # and one of the root's children for a while
  filled, _ = solver_lib.hold_missing_joints(pos, None, rig)
  np.testing.assert_allclose(filled, walk, rtol=0, atol=1e-12)
  np.testing.assert_allclose(filled, _held_reference(pos, rig), rtol=0, atol=1e-12)
  pos[20:25, list(rig.children[0])] = np.nan  # none of them: it stays
  filled, _ = solver_lib.hold_missing_joints(pos, None, rig)
  np.testing.assert_array_equal(filled[20:25, 0], np.broadcast_to(filled[19, 0], (5, 3)))
  np.testing.assert_allclose(filled, _held_reference(pos, rig), rtol=0, atol=1e-12)


def test_solver_holds_dropouts_in_clips_and_streams(tmp_path_factory):
  solver = IKSolver.from_checkpoint(tiny_checkpoint(tmp_path_factory), hold_missing=True)
  rig = solver.rig
  pos = _dropouts(posed_clip(rig, solver.offsets, T=9, seed=4))
  filled, _ = solver_lib.hold_missing_joints(pos, None, rig)
  np.testing.assert_array_equal(solver.solve(pos), solver.solve(filled))
  sol = solver.solve(pos, full=True)
  np.testing.assert_array_equal(sol.positions, filled.astype(np.float32))
  streamed = np.stack([solver.step(f) for f in pos])
  solver.reset()
  np.testing.assert_array_equal(streamed, np.stack([solver.step(f) for f in filled]))
  solver.reset()
  np.testing.assert_allclose(np.concatenate(list(solver.solve_stream([pos[:4], pos[4:]]))),
                             solver.solve(filled), atol=2e-5)  # other batch shapes
  solver.reset()  # a new stream: nothing to hold the hand from
  with pytest.raises(InputError, match='was not seen before it'):
    solver.step(pos[2])
  plain = get_solver(tmp_path_factory)  # without it, dropouts are refused, pointing at it
  assert not plain.hold_missing
  with pytest.raises(InputError, match=r'NaN/inf: frame 2, joint 9 .*--hold_missing'):
    plain.solve(pos)


def test_csv_empty_fields_are_missing_values(solver, tmp_path):
  """pandas writes NaN as an empty field: read as NaN (a joint `hold_missing` fills), with or
  without a header, comma- or tab-separated; a trailing separator is still allowed."""
  rig = solver.rig
  pos = posed_clip(rig, solver.offsets, T=3)
  pos[1, 9] = np.nan
  flat = pos.reshape(3, -1)
  header = ','.join(f'{n}_{a}' for n in rig.joint_names for a in 'xyz')
  rows = ['' if not np.isfinite(v) else f'{v:.9f}' for v in flat.ravel()]
  rows = [rows[k:k + flat.shape[1]] for k in range(0, flat.size, flat.shape[1])]
  (tmp_path / 'a.csv').write_text(header + '\n' + '\n'.join(','.join(r) for r in rows) + '\n')
  (tmp_path / 'b.tsv.csv').write_text('\n'.join('\t'.join(r) for r in rows) + '\n')
  (tmp_path / 'c.csv').write_text('\n'.join(','.join(r) + ',' for r in rows) + '\n')
  for name in ('a.csv', 'b.tsv.csv', 'c.csv'):
    got = exports.read_positions_csv(tmp_path / name, rig)
    np.testing.assert_allclose(got, pos, atol=1e-8, err_msg=name)  # NaN where NaN
  (tmp_path / 'short.csv').write_text(','.join(rows[0][:-1]) + '\n')
  with pytest.raises(InputError, match=r'short.csv:1: 62 columns, expected 63'):
    exports.read_positions_csv(tmp_path / 'short.csv', rig)


def test_csv_byte_order_mark_and_r_s_na(solver, tmp_path):
  """Excel's "CSV UTF-8" opens with a byte order mark: read past, with a header or without
  (where it made the first frame a header, dropped, and every frame one late); R writes a
  missing value as NA: a missing value, also in the first row (not taken for a header)."""
  rig = solver.rig
  pos = posed_clip(rig, solver.offsets, T=3)
  header = ','.join(f'{n}_{a}' for n in rig.joint_names for a in 'xyz')
  rows = [','.join(f'{v:.9f}' for v in r) for r in pos.reshape(3, -1)]
  for name, text in (('bom.csv', '\n'.join(rows)), ('bom_header.csv', header + '\n' +
                                                     '\n'.join(rows))):
    (tmp_path / name).write_text(text + '\n', encoding='utf-8-sig')
    np.testing.assert_allclose(exports.read_positions_csv(tmp_path / name, rig), pos,
                               atol=1e-8, err_msg=name)
  holes = pos.copy()
  holes[0, 3] = np.nan
  fields = [['NA' if not np.isfinite(v) else f'{v:.9f}' for v in r] for r in
            holes.reshape(3, -1)]
  (tmp_path / 'r.csv').write_text('\n'.join(','.join(f) for f in fields) + '\n')
  np.testing.assert_allclose(exports.read_positions_csv(tmp_path / 'r.csv', rig), holes,
                             atol=1e-8)  # NaN where NaN
  fields[1][5] = 'n/a?'
  (tmp_path / 'bad.csv').write_text('\n'.join(','.join(f) for f in fields) + '\n')
  with pytest.raises(InputError, match=r"bad.csv:2: 'n/a\?' is not a number"):
    exports.read_positions_csv(tmp_path / 'bad.csv', rig)


def test_csv_headers_as_people_write_them(solver, tmp_path):
  """A header naming the joints in another case (`rightarm_x`, in another order) is read by
  name (it was taken for an opaque header: the columns read in rig order, left and right
  swapped, silently), and the solution names the joints as it did; a header naming other
  joints warns that the columns are read in rig order; a column named twice is refused (the
  last won); a European file (semicolons, decimal commas) is read."""
  rig = solver.rig
  pos = posed_clip(rig, solver.offsets, T=3)
  perm = np.random.default_rng(1).permutation(rig.num_joints)
  cols = [f'{rig.joint_names[j].lower()}_{a}' for j in perm for a in 'xyz']
  rows = [','.join(f'{v:.9f}' for v in r) for r in pos[:, perm].reshape(3, -1)]
  (tmp_path / 'lower.csv').write_text(','.join(cols) + '\n' + '\n'.join(rows) + '\n')
  got = exports.read_positions(tmp_path / 'lower.csv', rig)
  np.testing.assert_allclose(got.positions, pos, atol=1e-8)
  assert got.names == tuple(n.lower() for n in rig.joint_names)
  generic = [f'j{j}_{a}' for j in range(rig.num_joints) for a in 'xyz']
  plain = [','.join(f'{v:.9f}' for v in r) for r in pos.reshape(3, -1)]
  (tmp_path / 'generic.csv').write_text(','.join(generic) + '\n' + '\n'.join(plain) + '\n')
  with pytest.warns(UserWarning, match=r"names joints j0, j1, j10, j11 ..., none of rig "
                    r"'cmu_body'.s: its columns are read in the rig.s joint order"):
    np.testing.assert_allclose(exports.read_positions_csv(tmp_path / 'generic.csv', rig), pos,
                               atol=1e-8)
  (tmp_path / 'twice.csv').write_text(','.join(cols + cols[:3]) + '\n' + '\n'.join(
      r + ',0,0,0' for r in rows) + '\n')
  with pytest.raises(InputError, match=r"twice.csv: the header names column '[a-z]+_x' twice "
                     r'\(fields 1 and 64\)'):
    exports.read_positions_csv(tmp_path / 'twice.csv', rig)
  for start in (0, 1):  # pandas' header of unnamed columns: a header, not a frame
    (tmp_path / 'counted.csv').write_text(','.join(str(k + start) for k in range(
        3 * rig.num_joints)) + '\n' + '\n'.join(plain) + '\n')
    np.testing.assert_allclose(exports.read_positions_csv(tmp_path / 'counted.csv', rig), pos,
                               atol=1e-8)
  euro = [';'.join(f'{v:.9f}'.replace('.', ',') for v in r) for r in pos.reshape(3, -1)]
  header = ';'.join(f'{n}_{a}' for n in rig.joint_names for a in 'xyz')
  for name, text in (('euro.csv', header + '\n' + '\n'.join(euro)),
                     ('euro_plain.csv', '\n'.join(euro)),
                     ('tabs.csv', '\n'.join(r.replace(';', '\t') for r in euro))):
    (tmp_path / name).write_text(text + '\n')
    np.testing.assert_allclose(exports.read_positions_csv(tmp_path / name, rig), pos,
                               atol=1e-8, err_msg=name)


def test_npz_that_is_not_one_or_has_a_bad_fps(solver, tmp_path):
  """A text file named .npz, and an `fps` that is not one positive number, are refused in
  one line naming the file."""
  rig = solver.rig
  pos = posed_clip(rig, solver.offsets, T=2)
  (tmp_path / 'text.npz').write_text('hello\n')
  with pytest.raises(InputError, match=r'text.npz: not an npz file'):
    exports.read_positions_npz(tmp_path / 'text.npz', rig)
  for fps in (0.0, -30.0, np.nan, [120.0, 30.0], 'fast'):
    np.savez(tmp_path / 'f.npz', positions=pos, fps=np.asarray(fps))
    with pytest.raises(InputError, match=r'f.npz: fps must be one positive frame rate'):
      exports.read_positions_npz(tmp_path / 'f.npz', rig)
  np.savez(tmp_path / 'ok.npz', positions=pos, fps=np.asarray([[24]]))
  assert exports.read_positions_npz(tmp_path / 'ok.npz', rig).fps == 24.0


def test_csv_named_columns_leave_an_index_and_a_time_out(solver, tmp_path):
  """`pandas.DataFrame.to_csv` of named columns writes its index first (an empty header
  field); a time column may sit anywhere: the named x, y, z columns are picked, the rest left
  out."""
  rig = solver.rig
  pos = posed_clip(rig, solver.offsets, T=3)
  names = [f'{n}_{a}' for n in rig.joint_names for a in 'xyz']
  header = ',' + ','.join(names[:6]) + ',time,' + ','.join(names[6:])
  rows = [f'{t},' + ','.join(f'{v:.9f}' for v in r[:6]) + f',{t / 30:.4f},' +
          ','.join(f'{v:.9f}' for v in r[6:]) for t, r in enumerate(pos.reshape(3, -1))]
  (tmp_path / 'df.csv').write_text(header + '\n' + '\n'.join(rows) + '\n')
  np.testing.assert_allclose(exports.read_positions_csv(tmp_path / 'df.csv', rig), pos,
                             atol=1e-8)
  spaced = ',' + ','.join('Anna:' + n for n in names[:6]) + ',time,' + ','.join(
      'Anna:' + n for n in names[6:])  # one namespace: the bare names count
  (tmp_path / 'ns.csv').write_text(spaced + '\n' + '\n'.join(rows) + '\n')
  np.testing.assert_allclose(exports.read_positions_csv(tmp_path / 'ns.csv', rig), pos,
                             atol=1e-8)
  (tmp_path / 'part.csv').write_text(','.join(names[:60]) + '\n' + '1,' * 59 + '1\n')
  with pytest.raises(InputError, match=r'part.csv: header lacks columns RightToeBase_x'):
    exports.read_positions_csv(tmp_path / 'part.csv', rig)


def test_positions_beyond_reach_are_refused_and_a_refused_stream_item_changes_nothing(
    tmp_path_factory):
  """Coordinates of 1e7 m or more (float32 overflowed inside the network: NaN rotations) are
  refused in one line, by solve, step and solve_stream; a stream item refused for its length
  leaves the held joints as they were."""
  solver = IKSolver.from_checkpoint(tiny_checkpoint(tmp_path_factory), hold_missing=True)
  rig = solver.rig
  pos = posed_clip(rig, solver.offsets, T=3, seed=5)
  huge = pos.copy()
  huge[1, 4, 2] = 1e20
  for call in (lambda: solver.solve(huge), lambda: solver.step(huge[1]),
               lambda: next(solver.solve_stream([huge]))):
    with pytest.raises(InputError, match=r'1e\+07 m or more .*frame \d, joint 4'):
      call()
  solver.reset()
  solver.step(pos[0])
  held = solver._held
  too_long = np.repeat(pos[:1], solver.block_size + 1, axis=0) + 1.0
  with pytest.raises(InputError, match='more than block_size'):
    next(solver.solve_stream([too_long]))
  assert solver._held is held
  gap = pos[1].copy()
  gap[9] = np.nan
  np.testing.assert_array_equal(solver.step(gap), solver.step(
      solver_lib.hold_missing_joints(gap[None], held, rig)[0][0]))


def test_offsets_are_in_the_positions_units_and_axes(solver):
  """`solve(positions, offsets=, units=, input_axes=)` converts the offsets with the positions
  (as the end sites): millimetres and z-up data with their own offsets solve as the metres in
  rig axes do. Offsets in other units than that (metres with millimetre positions) are refused
  in one line: their bones are 1000x off the template's."""
  rig = solver.rig
  off = solver.offsets * 1.1
  pos = posed_clip(rig, off, T=4, scale=0.3)
  want = solver.solve(pos, offsets=off, full=True)
  M = parse_input_axes('x,z,-y')  # rig = M @ input
  for units, k, axes, R in (('mm', 1000.0, None, np.eye(3)), ('cm', 100.0, 'x,z,-y', M)):
    given = (pos * k) @ R  # input = M^T rig: a row vector times M
    got = solver.solve(given, offsets=(off * k) @ R, units=units, input_axes=axes, full=True)
    np.testing.assert_allclose(got.local_rot, want.local_rot, atol=2e-5)
    np.testing.assert_allclose(got.offsets, want.offsets, atol=1e-12)
    np.testing.assert_allclose(got.positions_fk, want.positions_fk, atol=1e-5)
  with pytest.raises(InputError,
                     match=r'offsets: the bones are 0\.0011x the template.s.*positions. units'):
    solver.solve(pos * 1000, offsets=off, units='mm')
  with pytest.raises(InputError, match=r'offsets: the bones are 110x the template.s'):
    solver.solve(pos, offsets=off * 100)
  with pytest.raises(InputError, match=r'median 8\d deg off once turned .* rig.s axes'):
    solver.solve(pos @ M, offsets=off, input_axes='x,z,-y')  # offsets in rig axes: refused
  bad = off.copy()
  bad[3, 1] = np.nan
  with pytest.raises(InputError, match=r'offsets contain NaN/inf: joint 3 \(Spine1\)'):
    solver.solve(pos, offsets=bad)


def test_a_stream_hears_units_and_axes_at_its_first_frame(tmp_path_factory):
  """`step` and `solve_stream` run `solve`'s units and axes checks on a stream's first whole
  frame (not on every frame: a live loop hears it once, and again after `reset()`); `solve` on
  single frames says each kind once per solver; every warning names the caller's line."""
  solver = IKSolver.from_checkpoint(tiny_checkpoint(tmp_path_factory))
  pos = posed_clip(solver.rig, solver.offsets, T=5, scale=0.2)

  def caught(fn):
    with warnings.catch_warnings(record=True) as got:
      warnings.simplefilter('always')
      fn()
    assert all(w.filename == __file__ for w in got), [(w.filename, w.lineno) for w in got]
    return [str(w.message) for w in got]

  for frames, says in ((pos, []), (pos * 1000, ['looks like millimetres: pass --units=mm']),
                       (pos @ parse_input_axes('x,z,-y'), ['up axis looks wrong'])):
    solver.reset()
    msgs = caught(lambda: [solver.step(f) for f in frames])
    assert len(msgs) == len(says) and all(s in m for s, m in zip(says, msgs)), msgs
    solver.reset()
    msgs = caught(lambda: list(solver.solve_stream(frames)))
    assert len(msgs) == len(says) and all(s in m for s, m in zip(says, msgs)), msgs
    assert caught(lambda: list(solver.solve_stream(frames))) == []  # the same stream
  z_up = pos @ parse_input_axes('x,z,-y')
  msgs = caught(lambda: [solver.solve(f) for f in z_up])
  assert len(msgs) == 1 and 'up axis looks wrong' in msgs[0], msgs
  assert len(caught(lambda: solver.solve(z_up))) == 1  # a clip: said every time


def test_a_stream_in_other_units_and_axes(tmp_path_factory):
  """`step` and `solve_stream` take a stream's `units` and `input_axes`, as `solve` does (the
  warnings' --units / --input_axes): the same rotations as metres in rig axes, no warning;
  `latency_stats` (rest frames in metres) leaves a stream's first-frame check to its frames."""
  solver = IKSolver.from_checkpoint(tiny_checkpoint(tmp_path_factory))
  pos = posed_clip(solver.rig, solver.offsets, T=3, seed=8)
  M = parse_input_axes('x,z,-y')
  given = pos @ M * 100.0  # centimetres, z up: rig = M @ given / 100
  want = solver.solve(pos)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    got = [solver.step(f, units='cm', input_axes='x,z,-y') for f in given]
    solver.reset()
    streamed = list(solver.solve_stream([given[0], given[1:]], units='cm',
                                        input_axes='x,z,-y'))
  np.testing.assert_allclose(np.stack(got), want, atol=1e-5)
  np.testing.assert_allclose(np.concatenate([streamed[0][None], streamed[1]]), want, atol=1e-5)
  solver.reset()
  solver.latency_stats(n=2, warmup=1)
  with pytest.warns(UserWarning, match='looks like centimetres: pass --units=cm'):
    solver.step(pos[0] * 100.0)


def test_one_stream_per_solver_a_second_caller_is_refused(tmp_path_factory):
  """While `step` (or a `solve_stream` item) runs, another call on the same solver is refused
  in one line rather than interleaved with the stream's state; bad options likewise."""
  solver = IKSolver.from_checkpoint(tiny_checkpoint(tmp_path_factory))
  frame = posed_clip(solver.rig, solver.offsets, T=1, seed=9)[0]
  solver.step(frame)
  assert solver._stream_busy.acquire(blocking=False)  # as another thread inside `step`
  try:
    with pytest.raises(InputError, match='another thread is in this solver.s step'):
      solver.step(frame)
    with pytest.raises(InputError, match='another thread'):
      next(solver.solve_stream([frame]))
    solver.solve(frame[None])  # clips keep no stream state
  finally:
    solver._stream_busy.release()
  solver.step(frame)
  for bad in ('30', None, True, float('nan')):
    with pytest.raises(InputError, match='fps must be a positive frame rate'):
      solver.fps = bad


def test_a_checkpoint_for_another_rig_or_bind(tmp_path_factory):
  """A checkpoint for other joints is refused naming the first that differs; for the same
  joints under another bind (the data's rig: its rest bones elsewhere), a warning."""
  ckpt = tiny_checkpoint(tmp_path_factory)
  with pytest.raises(CheckpointError, match=r"is for rig 'cmu_body' \(21 joints\), not 'smpl22' "
                     r"\(22 joints\): their joints differ \(joint 0: 'Hips' against 'pelvis'\)"):
    IKSolver.from_checkpoint(ckpt, expected_rig='smpl22')
  cmu = skeleton.cmu_body()
  off = cmu.template().copy()
  left = cmu.joint_names.index('LeftUpLeg')
  off[left] = -off[left]
  other = skeleton.make_rig('other_bind', cmu.joint_names, cmu.parents, off, cmu.up, cmu.forward)
  with pytest.warns(UserWarning, match=r"rig 'other_bind' is another bind of checkpoint .* up "
                    r'to \d+ at LeftUpLeg'):
    IKSolver.from_checkpoint(ckpt, expected_rig=other)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    IKSolver.from_checkpoint(ckpt, expected_rig=cmu)


@pytest.mark.parametrize('filtered', [False, True])
def test_a_new_subject_runs_at_once_while_its_own_step_compiles(tmp_path_factory, filtered):
  """After `warm_up`, a new subject's first frames run on the program taking any subject while
  its own compiles in a background thread, then on its own: the same answers as a clip's (with
  a temporal filter too: one stream, carried across the switch). A compile for a subject
  assigned over since is not installed."""
  from ik_gat_jax import temporal  # pylint: disable=import-outside-toplevel
  kind = 'step filtered' if filtered else 'step'
  solver = IKSolver.from_checkpoint(
      tiny_checkpoint(tmp_path_factory),
      temporal_filter=temporal.FilterConfig('one_euro', min_cutoff=2.0, beta=0.5) if filtered
      else None)
  solver.warm_up()
  own = lambda: solver._step_exec if kind == 'step' else solver._stream_execs.get(  # noqa: E731
      'own subject')
  assert own() is not None and not solver._pending
  other = solver.offsets * (1.0731 + 0.0106 * filtered)  # a subject no test compiled before
  frames = posed_clip(solver.rig, other, T=4, seed=12)
  want = solver.solve(frames, offsets=other)
  solver.offsets = other
  got = [solver.step(frames[0])]
  assert own() is None and kind in solver._pending  # compiling in the background
  solver._wait_for_compiles()
  assert own() is not None and kind not in solver._pending
  got += [solver.step(f) for f in frames[1:]]
  np.testing.assert_allclose(np.stack(got), want, atol=1e-5)
  stale, execs = solver._offsets, solver._stream_execs
  solver.offsets = other * 1.05
  solver._install(kind, stale, execs, object())  # the subject before's, finished late
  assert own() is None


def test_fps_and_offsets_set_start_a_new_stream(tmp_path_factory):
  """Setting `fps` or new `offsets` starts a new stream, as `reset()` does: the held joints
  (and the subject calibration's sums) of the frames before are forgotten."""
  solver = IKSolver.from_checkpoint(tiny_checkpoint(tmp_path_factory), hold_missing=True)
  pos = posed_clip(solver.rig, solver.offsets, T=2, seed=6)
  gap = pos[1].copy()
  gap[9] = np.nan
  for change in (lambda: setattr(solver, 'fps', 60.0),
                 lambda: setattr(solver, 'offsets', solver.offsets * 1.05)):
    solver.step(pos[0])
    solver.step(gap)  # held from frame 0
    change()
    with pytest.raises(InputError, match='was not seen before it'):
      solver.step(gap)


def test_a_calibrated_stream_far_from_the_origin_is_the_stream_near_it(tmp_path_factory):
  """The live subject calibration works on the frame `near_origin` moved, as the network does:
  a stream 1,000 km away gives the stream at the origin's rotations (it was 0.5 deg off)."""
  ckpt = tiny_checkpoint(tmp_path_factory)
  off = IKSolver.from_checkpoint(ckpt).offsets
  off = off + np.random.default_rng(8).normal(scale=0.01, size=off.shape) * (off != 0)
  pos = posed_clip(skeleton.cmu_body(), off, T=6, seed=8)
  out = []
  for shift in (0.0, 1e6):
    solver = IKSolver.from_checkpoint(ckpt, offsets=off, subject_calibration=True)
    out.append(np.stack([solver.step(f + shift) for f in pos]))
    solver.reset()
    out.append(np.stack(list(solver.solve_stream(list(pos + shift)))))
  for got in out[1:]:
    np.testing.assert_allclose(got, out[0], atol=2e-5)


def test_a_body_scaled_by_any_factor_gives_the_same_rotations(tmp_path_factory):
  """Size normalisation (the default): the network sees each body at the template's size, from
  the subject's offsets or, with the template's, from each frame's own bones; a body and its
  offsets scaled by k solve to the same rotations (float32 round-off), in `solve`, `step` and
  `solve_stream`; FK outputs keep the input's size. Without it they do not."""
  ckpt = tiny_checkpoint(tmp_path_factory)
  solver = IKSolver.from_checkpoint(ckpt)
  off = solver.offsets * 1.05
  pos = posed_clip(solver.rig, off, T=5, seed=9, scale=0.3)
  base = solver.solve(pos, offsets=off, full=True)
  plain = solver.solve(pos)  # the template's offsets: each frame's own bones
  for k in (0.5, 2.0):
    got = solver.solve(pos * k, offsets=off * k, full=True)
    np.testing.assert_allclose(got.local_rot, base.local_rot, atol=2e-5)
    np.testing.assert_allclose(got.positions_fk, base.positions_fk * k, atol=1e-5 * k)
    np.testing.assert_allclose(solver.solve(pos * k), plain, atol=2e-5)
    solver.reset()
    np.testing.assert_allclose(np.stack([solver.step(f) for f in pos * k]), plain, atol=2e-5)
    streamed = np.concatenate(list(solver.solve_stream([pos[:2] * k, pos[2:] * k])))
    np.testing.assert_allclose(streamed, plain, atol=2e-5)
  with pytest.warns(UserWarning, match=r'refine_iters=5: a refinement of fewer than 30 '
                    'iterations fits the positions worse') as w:  # tuned at 50
    refined = IKSolver.from_checkpoint(ckpt, refine_iters=5, refine_prior='none')
  assert w[0].filename == __file__ and refined._prior is None  # 'none', as the flag says
  want = refined.solve(pos, offsets=off)  # the refinement runs on the normalised body too
  np.testing.assert_allclose(refined.solve(pos * 2.0, offsets=off * 2.0), want, atol=2e-5)
  as_is = IKSolver.from_checkpoint(ckpt, size_normalization=False)
  assert not as_is.size_normalization
  assert _max_angle(as_is.solve(pos * 2.0, offsets=off * 2.0), base.local_rot) > 1e-2


def _max_angle(a, b):
  return float(np.degrees(np.asarray(rotations.geodesic_angle(np.asarray(a, np.float32),
                                                               np.asarray(b, np.float32)))).max())


def test_the_size_from_a_frame_barely_moves_with_a_bad_joint_or_two(tmp_path_factory):
  """`inference.size_scale` from each frame's bones (positions alone) is a median over the
  bones: a forearm and hand collapsed onto the shoulder (two bones 0, one far longer) move it
  under 3%, where the summed length moved 14%; a tracker subset that shares no bone gets 1."""
  from ik_gat_jax import inference
  solver = get_solver(tmp_path_factory)
  rig, off = solver.rig, solver.offsets
  pos = posed_clip(rig, off * 1.2, T=4, seed=10, scale=0.3)
  template = np.broadcast_to(off, pos.shape)
  clean = np.asarray(inference.size_scale(pos, template, rig))
  np.testing.assert_allclose(clean, 1 / 1.2, rtol=1e-5)
  n = rig.joint_names
  bad = pos.copy()
  bad[:, n.index('LeftForeArm')] = bad[:, n.index('LeftHand')] = bad[:, n.index('LeftArm')]
  np.testing.assert_allclose(np.asarray(inference.size_scale(bad, template, rig)), clean,
                             rtol=0.03)
  mask = np.zeros(pos.shape[:2], bool)
  mask[:, [n.index(j) for j in ('Hips', 'Head', 'LeftHand', 'RightHand')]] = True
  np.testing.assert_array_equal(np.asarray(inference.size_scale(pos, template, rig, mask)), 1.0)
  np.testing.assert_allclose(np.asarray(inference.size_scale(pos, off * 1.2, rig)), 1 / 1.2,
                             rtol=1e-5)  # from the subject's offsets
