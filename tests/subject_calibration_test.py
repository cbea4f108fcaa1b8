"""ik_gat_jax/subject_calibration.py: a subject's constant rotation biases at the joints whose
children branch, measured on its own frames, and their use by the solver (clips, streams), the
command line and the evaluation."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from ik_gat_jax import evaluation, skeleton
from ik_gat_jax import subject_calibration as sc
from ik_gat_jax import solver as solver_lib

RIG = skeleton.cmu_body()
HIPS, CHEST = RIG.joint_names.index('Hips'), RIG.joint_names.index('Spine1')


def _world(R):
  G = np.zeros_like(R)
  for j, up in enumerate(RIG.parents):
    G[:, j] = R[:, j] if up < 0 else G[:, up] @ R[:, j]
  return G


def _local(G):
  return np.stack([G[:, j] if up < 0 else np.swapaxes(G[:, up], -1, -2) @ G[:, j]
                   for j, up in enumerate(RIG.parents)], axis=1)


def _clip(T=40, seed=0):
  """(local [T, J, 3, 3], positions [T, J, 3]) of random poses on cmu_body's template."""
  rng = np.random.default_rng(seed)
  R = Rotation.from_rotvec(rng.normal(scale=0.5, size=(T * RIG.num_joints, 3))).as_matrix()
  R = R.reshape(T, RIG.num_joints, 3, 3)
  off, G = RIG.template(), _world(R)
  p = np.zeros(R.shape[:2] + (3,))
  root = rng.normal(scale=0.3, size=(T, 3))
  for j, up in enumerate(RIG.parents):
    p[:, j] = root if up < 0 else p[:, up] + G[:, up] @ off[j]
  return R, p


def _biased(R, biases):
  """What a network with these biases answers: each joint j's world rotation turned by
  `biases[j]` (per frame `[T, 3, 3]` or constant), every other joint's kept (apply_bias itself
  is what is under test, so built by hand here)."""
  G = _world(R)
  for j, B in biases.items():
    G[:, j] = G[:, j] @ B
  return _local(G)


def _mean_angle(A, B):
  return float(np.degrees(Rotation.from_matrix(
      (np.swapaxes(A, -1, -2) @ B).reshape(-1, 3, 3)).magnitude()).mean())


def _true_local(path, joint_map=None):
  """The local rotations of a BVH's first 120 frames (after CMU's T-pose frame) at 30 fps,
  reduced to cmu_body: the conversion's, as `exports.read_bvh_clip(max_frames=120)` reads its
  positions."""
  from ik_gat_jax.io import bvh, exports, retarget
  motion = bvh.read_bvh(path)
  jmap = exports.bvh_joint_map(motion, RIG, joint_map)
  motion.motion = motion.motion[1:121]
  W = retarget.world_rotation(jmap.up, jmap.forward, RIG.up, RIG.forward)
  out = retarget.convert_motion(motion, jmap, W, 30.0, RIG.joint_names, RIG.parents)[1]
  return out.local_rot


def _angle(A, B):
  return float(np.degrees(Rotation.from_matrix(np.swapaxes(A, -1, -2) @ B).magnitude()).max())


BIASES = {HIPS: Rotation.from_rotvec([0.1, -0.2, 0.15]).as_matrix(),
          CHEST: Rotation.from_rotvec([-0.05, 0.25, 0.1]).as_matrix()}


def test_the_joints_and_their_fits():
  plan = sc.plan(RIG.template(), RIG)
  assert [(RIG.joint_names[j], [RIG.joint_names[c] for c in kids])
          for j, kids in zip(plan.joints, plan.fitted)] == [
      ('Hips', ['LeftUpLeg', 'RightUpLeg']),  # LowerBack sits on the Hips
      ('Spine1', ['LeftArm', 'RightArm'])]    # and Neck on Spine1
  assert plan.children == (RIG.children[HIPS], RIG.children[CHEST])
  assert [j for j, _ in plan.chain] == [0, 1, 2, 3]  # the root and the chest's ancestors
  one = skeleton.make_rig('chain', ['a', 'b', 'c'], [-1, 0, 1],
                          np.array([[0, 1.0, 0], [0, 0.5, 0], [0, 0.5, 0]]),
                          up=(0, 1, 0), forward=(0, 0, 1))
  assert sc.plan(one.template(), one).joints == ()  # one child each: no fit
  R, p = _clip()
  G = _world(R)
  fit = sc.fitted_rotations(p, RIG.template(), plan)
  assert _angle(fit[:, 0], G[:, HIPS]) < 1e-6 and _angle(fit[:, 1], G[:, CHEST]) < 1e-6
  np.testing.assert_allclose(sc.world_rotations(R, plan), G[:, [HIPS, CHEST]], atol=1e-12)


def test_constant_biases_are_removed_exactly_and_noise_averages_out():
  R, p = _clip()
  out, E = sc.calibrate_clip(_biased(R, BIASES), p, RIG.template(), RIG)
  assert sorted(E) == [HIPS, CHEST]
  for j, B in BIASES.items():
    assert _angle(E[j], B.T) < 1e-6  # the correction undoes the bias
  np.testing.assert_allclose(out, R, atol=1e-6)
  # Per-frame errors of the network around the biases: only their mean is removed.
  rng = np.random.default_rng(1)
  jitter = {j: Rotation.from_rotvec(rng.normal(scale=0.05, size=(40, 3))) for j in BIASES}
  noisy = _biased(R, {j: B @ jitter[j].as_matrix() for j, B in BIASES.items()})
  _, E = sc.calibrate_clip(noisy, p, RIG.template(), RIG)
  for j, B in BIASES.items():
    mean = (B @ jitter[j].mean().as_matrix()).T
    # Shrunk toward the identity by about s^2 / (n theta^2) of its angle: 3 deg of scatter per
    # axis, 40 frames, a 15 deg bias: 0.1%, 0.015 deg.
    assert _angle(E[j], mean) < 0.05
    assert _angle(E[j], np.eye(3)) < _angle(mean, np.eye(3))
  # A clip already unbiased is left as it was.
  same, E = sc.calibrate_clip(R, p, RIG.template(), RIG)
  assert max(_angle(e, np.eye(3)) for e in E.values()) < 1e-6
  assert np.abs(same - R).max() < 1e-6


def test_the_same_in_any_world_frame():
  """Turning the world (the positions and every world rotation) changes no bias."""
  R, p = _clip()
  W = Rotation.from_rotvec([0.3, -1.2, 2.0]).as_matrix()
  biased = _biased(R, BIASES)
  turned = biased.copy()
  turned[:, 0] = W @ biased[:, 0]
  out, E = sc.calibrate_clip(biased, p, RIG.template(), RIG)
  out_w, E_w = sc.calibrate_clip(turned, p @ W.T, RIG.template(), RIG)
  for j in E:
    assert _angle(E[j], E_w[j]) < 1e-6
  np.testing.assert_allclose(out_w[:, 1:], out[:, 1:], atol=1e-6)
  np.testing.assert_allclose(out_w[:, 0], W @ out[:, 0], atol=1e-6)


def test_frames_without_the_children_are_left_out_and_the_stream_is_causal():
  R, p = _clip()
  p = p.copy()
  p[5, 13] = np.nan  # a dropped hip: this frame does not count for the root
  p[7, 0] = np.nan   # a dropped root: nor this one
  p[9, 7] = np.nan   # a dropped arm: this frame does not count for the chest
  biased = _biased(R, BIASES)
  out, E = sc.calibrate_clip(biased, p, RIG.template(), RIG)
  assert max(_angle(E[j], B.T) for j, B in BIASES.items()) < 1e-6 and np.isfinite(out).all()
  stream = sc.SubjectBias()
  first = stream.calibrate(biased[:20], p[:20], RIG.template(), RIG)
  assert stream.calibrate(biased[:0], p[:0], RIG.template(), RIG).shape == (0,) + R.shape[1:]
  rest = stream.calibrate(biased[20:], p[20:], RIG.template(), RIG)
  # An exact bias: removed from the second frame on; one frame shows no scatter to weigh it by.
  np.testing.assert_allclose(first[0], biased[0], atol=1e-6)
  np.testing.assert_allclose(np.concatenate([first, rest])[1:], R[1:], atol=1e-6)
  # Frames after t change nothing up to t.
  later = _biased(R, {HIPS: Rotation.from_rotvec([0.5, 0, 0]).as_matrix()})
  again = sc.SubjectBias().calibrate(np.concatenate([biased[:20], later[20:]]), p,
                                     RIG.template(), RIG)
  np.testing.assert_array_equal(again[:20], first)
  # No joint with a fit: nothing to calibrate.
  flat = RIG.template().copy()
  flat[[13, 17, 7, 10]] = 0.0
  np.testing.assert_array_equal(sc.calibrate_clip(biased, p, flat, RIG)[0], biased)
  np.testing.assert_array_equal(sc.SubjectBias().calibrate(biased, p, flat, RIG), biased)


def test_the_compiled_frame_update_is_the_numpy_stream():
  """`frame_update` (jax.numpy, float32, one frame: the solver's `step`) corrects each frame
  as the numpy stream does, frames without a fit included, and its terms add up to the same
  float64 sums, for terms that scatter by 1 and by 0.1 deg."""
  import jax
  R, p = _clip(T=12, seed=5)
  p = p.copy()
  p[3, 13] = np.nan  # no fit for the root in frame 3
  rng = np.random.default_rng(1)
  for scale in (0.02, 0.002):
    noisy = {j: B @ Rotation.from_rotvec(rng.normal(scale=scale, size=(12, 3))).as_matrix()
             for j, B in BIASES.items()}
    biased = _biased(R, noisy).astype(np.float32)
    want_stream = sc.SubjectBias()
    want = want_stream.calibrate(biased, p, RIG.template(), RIG)
    stream = sc.SubjectBias()
    plan = stream.subject(RIG.template(), RIG)
    update = jax.jit(lambda *a: sc.frame_update(*a, p=plan))
    for t in range(len(R)):
      total, count = stream.sums(len(plan.joints))
      args = [np.asarray(a, np.float32) for a in (biased[t], p[t], RIG.template(), total, count)]
      out, terms = update(*args)
      stream.add(np.asarray(terms))
      # float32 (eps 1.2e-7) through two SVDs and chains of 3x3 products: about 100 eps.
      np.testing.assert_allclose(np.asarray(out), want[t], atol=1e-5)
    np.testing.assert_array_equal(stream.count, want_stream.count)
    np.testing.assert_allclose(stream.total, want_stream.total, atol=1e-5)
  assert stream.count.tolist() == [11, 12]


def test_the_shrinkage_beats_the_plain_mean_on_average():
  """James-Stein: over biases of any size, the shrunk mean of a few noisy terms is nearer the
  bias than their plain chordal mean, on average; with one term it is the identity."""
  rng = np.random.default_rng(3)
  plain, shrunk = [], []
  for trial in range(400):
    bias = Rotation.from_rotvec(rng.normal(size=3) * rng.choice([0.0, 0.02, 0.1])).as_matrix()
    n = int(rng.integers(2, 12))
    terms = bias @ Rotation.from_rotvec(rng.normal(scale=0.08, size=(n, 3))).as_matrix()
    S = terms.sum(axis=0)
    plain.append(_angle(sc.nearest_rotation(S), bias) ** 2)
    shrunk.append(_angle(sc.shrunk_mean(S, n), bias) ** 2)
  print(f'mean squared error {np.mean(plain):.3f} -> {np.mean(shrunk):.3f} deg^2')
  assert np.mean(shrunk) < 0.8 * np.mean(plain)
  one = Rotation.from_rotvec([0.2, 0, 0]).as_matrix()
  np.testing.assert_allclose(sc.shrunk_mean(one, 1), np.eye(3), atol=1e-12)
  np.testing.assert_allclose(sc.shrunk_mean(np.zeros((3, 3)), 0), np.eye(3), atol=1e-12)
  # No scatter: the mean itself, however few the terms.
  np.testing.assert_allclose(sc.shrunk_mean(2 * one, 2), one, atol=1e-9)


@pytest.fixture(scope='module')
def solver():
  return solver_lib.IKSolver.from_checkpoint(subject_calibration=True)


def test_the_solver_calibrates_clips_and_streams(solver, cmu_dir):
  from ik_gat_jax.io import exports
  clip = exports.read_bvh_clip(cmu_dir / '07_05.bvh', solver.rig, fps=30.0, max_frames=240)
  T = len(clip.positions)  # 60 at 30 fps
  plain = solver_lib.IKSolver.from_checkpoint()
  raw = plain.solve(clip.positions, offsets=clip.offsets, full=True)
  sol = solver.solve(clip.positions, offsets=clip.offsets, full=True)
  want, E = sc.calibrate_clip(raw.local_rot, raw.positions, clip.offsets, solver.rig)
  print('07_05 biases', {RIG.joint_names[j]: round(float(np.degrees(Rotation.from_matrix(
      e).magnitude())), 2) for j, e in E.items()}, 'deg')
  np.testing.assert_allclose(sol.local_rot, want, atol=1e-6)
  # Only the calibrated joints and their children's local rotations move; every other
  # world rotation stays; the FK outputs follow them.
  moved = np.abs(sol.local_rot - raw.local_rot).max(axis=(0, 2, 3)) > 0
  assert set(np.flatnonzero(moved)) <= {j for j in E} | {
      c for j in E for c in solver.rig.children[j]}
  kept = [j for j in range(RIG.num_joints) if j not in E]
  np.testing.assert_allclose(sol.global_rot[:, kept], raw.global_rot[:, kept], atol=1e-5)
  for j, e in E.items():
    assert _angle(sol.global_rot[:, j], raw.global_rot[:, j] @ e) < 1e-3
  # Without the subject's offsets (the template's, or only its bone lengths) the fits are
  # the template's: warned once per subject, never for the subject's own.
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    solver.solve(clip.positions[:4], offsets=clip.offsets)
  with pytest.warns(UserWarning, match="template's rest offsets"):
    solver.solve(clip.positions[:4])
  with pytest.warns(UserWarning, match="template's rest offsets"):
    solver.solve(clip.positions[:4], estimate_lengths=True)
  # A stream: each frame by the biases of the frames so far; the last one's are the clip's.
  solver.offsets = clip.offsets
  solver.reset()
  stream = np.stack([solver.step(f) for f in clip.positions])
  np.testing.assert_allclose(stream[-1], sol.local_rot[-1], atol=1e-5)
  solver.reset()
  again = np.concatenate(list(solver.solve_stream([clip.positions[i:i + 20]
                                                   for i in range(0, T, 20)])))
  np.testing.assert_allclose(again, stream, atol=1e-5)


@pytest.fixture(scope='module')
def rerigged(cmu_dir, tmp_path_factory):
  """A folder with 07_05 under random binds (`data_prep.rerig`) and its joint map."""
  from data_prep import rerig
  out = tmp_path_factory.mktemp('rerig')
  rerig.rerig_directory(cmu_dir, out, files=['07_05'], log=lambda m: None)
  return out


def test_another_rest_pose_is_warned_and_the_calibration_reproduces_the_input(
    solver, cmu_dir, rerigged):
  """A BVH of the rig's joints under other binds (`data_prep.rerig`: a random bind per joint,
  compensated in the motion, bones along local X; the same positions): its rest pose is not
  the rig's, which the solver says (never for a CMU subject's); the network's rotations then
  miss the input where bones branch, and the calibration, exact for any bind there, brings
  the FK error back to the original file's (BENCHMARKS.md "Another rest pose")."""
  from ik_gat_jax.io import exports
  rr = exports.read_bvh_clip(rerigged / '07_05.bvh', RIG, units='cm', fps=30.0, max_frames=240)
  assert rr.reference is None  # read as cmu_body: its own zero pose taken for the rig's
  orig = exports.read_bvh_clip(cmu_dir / '07_05.bvh', RIG, fps=30.0, max_frames=240)
  np.testing.assert_allclose(rr.positions - rr.positions[:, :1],
                             orig.positions - orig.positions[:, :1], atol=1e-6)
  plain = solver_lib.IKSolver.from_checkpoint()
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    base = plain.solve(orig.positions, offsets=orig.offsets, full=True)
  with pytest.warns(UserWarning, match="rest pose is not the rig's"):
    raw = plain.solve(rr.positions, offsets=rr.offsets, full=True)
  with pytest.warns(UserWarning, match="rest pose is not the rig's"):
    cal = solver.solve(rr.positions, offsets=rr.offsets, full=True)
  mm = {k: 1e3 * s.fk_error_m().mean() for k, s in (('cmu', base), ('rerig', raw),
                                                     ('rerig calibrated', cal))}
  print('|input - FK| mean (mm)', {k: round(v, 2) for k, v in mm.items()})
  assert mm['rerig'] > 10 * mm['cmu']
  assert mm['rerig calibrated'] < 1.5 * mm['cmu']
  # Every CMU subject's own rest pose is the rig's (bones within 13 deg of the template's).
  firsts = {p.name[:2]: p for p in sorted(cmu_dir.glob('*.bvh'), reverse=True)}
  assert len(firsts) == 7
  for path in firsts.values():
    offsets = exports.read_bvh_clip(path, RIG, max_frames=1).offsets
    assert solver_lib.check_rest_pose(offsets, RIG) is None, path.name
    assert np.nanmax(solver_lib.rest_pose_angles(offsets, RIG)) < 15.0, path.name


def test_the_input_s_reference_pose_gives_its_own_rotations_exactly(cmu_dir, rerigged,
                                                                     tmp_path):
  """The same re-rigged clip with its natural pose named (its joint map's `reference_pose`:
  cmu_body's zero pose in its channels): the solver's rig takes it (`with_reference_pose`),
  the bone frames follow the binds, and the shipped model gives the file's own rotations,
  `A_parent^T R_j A_j` of the original's (A: the binds), to float32 round-off, with mirror
  averaging too; its FK is the original's. The command line does it from the joint map, and
  from `--reference_pose=first_frame` (CMU's T-pose frame: near the zero pose, not it)."""
  from ik_gat_jax import solve
  from ik_gat_jax.io import exports
  jmap = str(rerigged / 'cmu_body_rerig.json')
  rr = exports.read_bvh_clip(rerigged / '07_05.bvh', RIG, joint_map=jmap, fps=30.0,
                             max_frames=120)
  orig = exports.read_bvh_clip(cmu_dir / '07_05.bvh', RIG, fps=30.0, max_frames=120)
  A = rr.reference
  Ap = np.stack([np.eye(3) if p < 0 else A[p] for p in RIG.parents])
  for kw in ({}, {'mirror': True}):
    base = solver_lib.IKSolver.from_checkpoint(**kw).solve(orig.positions, offsets=orig.offsets,
                                                           full=True)
    mine = solver_lib.IKSolver.from_checkpoint(reference_pose=A, **kw)
    with warnings.catch_warnings():
      warnings.simplefilter('error')  # its rest pose is the rig's now: no warning
      got = mine.solve(rr.positions, offsets=rr.offsets, full=True)
    want = np.swapaxes(Ap, -1, -2) @ base.local_rot.astype(np.float64) @ A
    assert _angle(want, got.local_rot) < 2e-3, kw
    np.testing.assert_allclose(got.positions_fk - got.positions_fk[:, :1],
                               base.positions_fk - base.positions_fk[:, :1], atol=1e-5)
  # The refinement is exact too (its 6D chart is the bone frames'). The shipped prior models
  # the joint chart of cmu_body's own binds, so under another bind it is not taken (as for a
  # rig it does not fit): the refinement runs without it, the same as refine_prior=None.
  kw = {'refine_iters': 5, 'refine_prior': None}
  refined = solver_lib.IKSolver.from_checkpoint(**kw).solve(orig.positions[:10],
                                                            offsets=orig.offsets)
  for prior in (None, 'shipped'):
    with (pytest.warns(UserWarning, match='the shipped pose prior does not fit rig') if prior
          else warnings.catch_warnings()):
      if prior is None:
        warnings.simplefilter('error')  # None: asked for, nothing said (but the short run's)
        warnings.filterwarnings('ignore', message='refine_iters=5: a refinement of fewer')
      other = solver_lib.IKSolver.from_checkpoint(reference_pose=A, refine_iters=5,
                                                  refine_prior=prior)
    assert other._prior is None
    got = other.solve(rr.positions[:10], offsets=rr.offsets)
    assert _angle(np.swapaxes(Ap, -1, -2) @ refined.astype(np.float64) @ A, got) < 5e-3
  # Against the file's own rotations (its conversion's, the same frames): the joint map's
  # natural pose gives the original's error; CMU's T-pose frame, near it, a little more; none
  # (the zero pose taken for the rig's) misses every bone's twist.
  truth = _true_local(rerigged / '07_05.bvh', jmap)
  err = {'original': _mean_angle(_true_local(cmu_dir / '07_05.bvh'), base.local_rot)}
  for name, reference in (('joint map', A), ('first_frame', exports.read_bvh_clip(
      rerigged / '07_05.bvh', RIG, units='cm', max_frames=1,
      reference_pose='first_frame').reference), ('none', None)):
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')  # 'none': the rest pose is not the rig's
      got = solver_lib.IKSolver.from_checkpoint(reference_pose=reference, mirror=True).solve(
          rr.positions, offsets=rr.offsets)
    err[name] = _mean_angle(truth, got)
  print('local error against each file\'s own rotations (deg, mirror averaging)',
        {k: round(v, 2) for k, v in err.items()})
  assert abs(err['joint map'] - err['original']) < 0.01
  assert err['joint map'] < err['first_frame'] < 2 * err['original'] < err['none'] / 5
  said = []
  summary = solve.solve_file(rerigged / '07_05.bvh', tmp_path / 'a.npz', joint_map=jmap,
                             log=said.append)
  assert any(m.startswith('reference pose:') for m in said)
  # A joint map's 'first_frame' meant its conversion's first file (the rig's own reference
  # pose), not this clip's: not taken; only --reference_pose=first_frame says it of the clip.
  doc = json.loads(Path(jmap).read_text())
  doc['reference_pose'] = 'first_frame'
  (tmp_path / 'rig.json').write_text((rerigged / doc['rig']).read_text())
  doc['rig'] = 'rig.json'
  (tmp_path / 'first.json').write_text(json.dumps(doc))
  said.clear()
  with pytest.warns(UserWarning, match="rest pose is not the rig's"):
    solve.solve_file(rerigged / '07_05.bvh', tmp_path / 'c.npz',
                     joint_map=str(tmp_path / 'first.json'), log=said.append)
  assert not any(m.startswith('reference pose:') for m in said)
  first = solve.solve_file(rerigged / '07_05.bvh', tmp_path / 'f.npz', units='cm',
                           reference_pose='first_frame', log=lambda m: None)
  assert first['fk_error_mm_mean'] < 1.5 * summary['fk_error_mm_mean'] < 5.0
  # A clip that does not start in the natural pose, named so: warned (an arm 90 deg off).
  from ik_gat_jax.io import bvh
  late = bvh.read_bvh(cmu_dir / '07_05.bvh')
  late.motion = late.motion[200:260]
  bvh.write_bvh(tmp_path / 'late.bvh', late)
  with pytest.warns(UserWarning, match='in the natural pose named for it'):
    solve.solve_file(tmp_path / 'late.bvh', tmp_path / 'l.npz', reference_pose='first_frame',
                     log=lambda m: None)
  with pytest.raises(solver_lib.InputError, match='read from a BVH'):
    solve.solve_file(tmp_path / 'a.npz', tmp_path / 'b.npz', reference_pose='first_frame',
                     log=lambda m: None)


def test_evaluation_calibrates_each_file(cmu_shards):
  from ik_gat_jax import data
  ds = data.load_shards(cmu_shards, 'val')
  method = evaluation.ikgat_method(None, ds.rig)
  off = evaluation.evaluate(method, ds, ds.rig, max_frames=200)
  on = evaluation.evaluate(method, ds, ds.rig, max_frames=200, subject_calibration=True)
  assert on['subject_calibration'] and not off['subject_calibration']
  assert on['frames'] == off['frames']
  # Clean input: the fits are exact, so the calibrated joints keep only the network's error
  # around its mean over each file, below the error itself (val's first 200 frames, the
  # shipped model).
  for name in ('Hips', 'Spine1'):
    was, now = (r['per_joint'][name]['global_rot_err_deg'] for r in (off, on))
    print(f'{name} world error {was:.3f} -> {now:.3f} deg')
    assert now < was, name
  # Given the rig's template instead of the subject's offsets (positions alone), the errors,
  # still against the subject's own rotations, are higher, and the calibration, fitting the
  # template's hips and shoulders, raises them further (val's first 200 frames).
  tmpl = evaluation.evaluate(method, ds, ds.rig, max_frames=200, offsets='template')
  tmpl_on = evaluation.evaluate(method, ds, ds.rig, max_frames=200, offsets='template',
                                subject_calibration=True)
  assert (off['offsets'], tmpl['offsets']) == ('subject', 'template')
  errs = [r['local_rot_err_deg'] for r in (on, off, tmpl, tmpl_on)]
  print('local error: subject calibrated / subject / template / template calibrated', errs)
  assert errs == sorted(errs)
  with pytest.raises(ValueError, match='offsets must be one of'):
    evaluation.evaluate(method, ds, ds.rig, max_frames=8, offsets='mean')
  # Only the calibrated joints and their children move: every other joint's error stays.
  moved = {n for j in (HIPS, CHEST) for n in
           [RIG.joint_names[j]] + [RIG.joint_names[c] for c in RIG.children[j]]}
  for name, e in off['per_joint'].items():
    if name not in moved:
      assert on['per_joint'][name]['local_rot_err_deg'] == pytest.approx(
          e['local_rot_err_deg'], abs=1e-6), name
