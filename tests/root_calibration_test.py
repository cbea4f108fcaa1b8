"""ik_gat_jax/root_calibration.py: a subject's constant root bias, measured on its own frames,
and its use by the solver (clips, streams), the command line and the evaluation."""

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from ik_gat_jax import evaluation, skeleton
from ik_gat_jax import root_calibration as rc
from ik_gat_jax import solver as solver_lib

RIG = skeleton.cmu_body()
TOL = 1e-9  # float64 throughout: SVDs of well-conditioned 3x3 sums


def _clip(T=40, seed=0):
  """(local [T, J, 3, 3], positions [T, J, 3]) of random poses on cmu_body's template."""
  rng = np.random.default_rng(seed)
  R = Rotation.from_rotvec(rng.normal(scale=0.5, size=(T * RIG.num_joints, 3))).as_matrix()
  R = R.reshape(T, RIG.num_joints, 3, 3)
  off = RIG.template()
  G, p = np.zeros_like(R), np.zeros(R.shape[:2] + (3,))
  root = rng.normal(scale=0.3, size=(T, 3))
  for j, up in enumerate(RIG.parents):
    G[:, j] = R[:, j] if up < 0 else G[:, up] @ R[:, j]
    p[:, j] = root if up < 0 else p[:, up] + G[:, up] @ off[j]
  return R, p


def _biased(R, bias):
  """What a network with a root bias answers: the root turned by `bias`, every other joint's
  world rotation kept (apply_bias itself is what is under test, so built by hand here)."""
  out = R.copy()
  out[:, 0] = R[:, 0] @ bias
  for c in RIG.children[0]:
    out[:, c] = bias.T @ R[:, c]
  return out


def _angle(A, B):
  return float(np.degrees(Rotation.from_matrix(np.swapaxes(A, -1, -2) @ B).magnitude()).max())


def test_children_and_the_fit():
  assert [RIG.joint_names[c] for c in rc.root_children(RIG.template(), RIG)] == [
      'LeftUpLeg', 'RightUpLeg']  # LowerBack sits on the Hips
  one = skeleton.make_rig('chain', ['a', 'b', 'c'], [-1, 0, 1],
                          np.array([[0, 1.0, 0], [0, 0.5, 0], [0, 0.5, 0]]),
                          up=(0, 1, 0), forward=(0, 0, 1))
  assert rc.root_children(one.template(), one) == ()  # one child: no fit, no calibration
  R, p = _clip()
  assert _angle(rc.fitted_root(p, RIG.template(), (13, 17)), R[:, 0]) < 1e-6


def test_a_constant_bias_is_removed_exactly_and_noise_averages_out():
  R, p = _clip()
  bias = Rotation.from_rotvec([0.1, -0.2, 0.15]).as_matrix()
  out, E = rc.calibrate_clip(_biased(R, bias), p, RIG.template(), RIG)
  assert _angle(E, bias.T) < 1e-6  # the correction undoes the bias
  np.testing.assert_allclose(out, R, atol=1e-6)
  # Per-frame errors of the network's root around the bias: only their mean is removed.
  jitter = Rotation.from_rotvec(np.random.default_rng(1).normal(scale=0.05, size=(40, 3)))
  noisy = _biased(R, bias)
  noisy[:, 0] = noisy[:, 0] @ jitter.as_matrix()
  _, E = rc.calibrate_clip(noisy, p, RIG.template(), RIG)
  assert _angle(E, (bias @ jitter.mean().as_matrix()).T) < 1e-3
  # A clip already unbiased is left as it was.
  same, E = rc.calibrate_clip(R, p, RIG.template(), RIG)
  assert _angle(E, np.eye(3)) < 1e-6 and np.abs(same - R).max() < 1e-6


def test_frames_without_the_children_are_left_out_and_the_stream_is_causal():
  R, p = _clip()
  bias = Rotation.from_rotvec([0.0, 0.3, 0.0]).as_matrix()
  p = p.copy()
  p[5, 13] = np.nan  # a dropped hip: this frame does not count
  out, E = rc.calibrate_clip(_biased(R, bias), p, RIG.template(), RIG)
  assert _angle(E, bias.T) < 1e-6 and np.isfinite(out).all()
  stream = rc.RootBias()
  first = stream.calibrate(_biased(R, bias)[:20], p[:20], RIG.template(), RIG)
  rest = stream.calibrate(_biased(R, bias)[20:], p[20:], RIG.template(), RIG)
  np.testing.assert_allclose(np.concatenate([first, rest]), R, atol=1e-6)  # exact bias: any t
  # Frames after t change nothing up to t.
  later = _biased(R, Rotation.from_rotvec([0.5, 0, 0]).as_matrix())
  again = rc.RootBias().calibrate(np.concatenate([_biased(R, bias)[:20], later[20:]]), p,
                                  RIG.template(), RIG)
  np.testing.assert_array_equal(again[:20], first)


@pytest.fixture(scope='module')
def solver():
  return solver_lib.IKSolver.from_checkpoint(root_calibration=True)


def test_the_solver_calibrates_clips_and_streams(solver, cmu_dir):
  from ik_gat_jax.io import exports
  clip = exports.read_bvh_clip(cmu_dir / '07_05.bvh', solver.rig, fps=30.0, max_frames=240)
  T = len(clip.positions)  # 60 at 30 fps
  plain = solver_lib.IKSolver.from_checkpoint()
  raw = plain.solve(clip.positions, offsets=clip.offsets, full=True)
  sol = solver.solve(clip.positions, offsets=clip.offsets, full=True)
  want, E = rc.calibrate_clip(raw.local_rot, raw.positions, clip.offsets, solver.rig)
  print(f'07_05 root bias {np.degrees(Rotation.from_matrix(E).magnitude()):.2f} deg')
  np.testing.assert_allclose(sol.local_rot, want, atol=1e-6)
  # Only the root and its children's local rotations move; the FK outputs follow them.
  moved = np.abs(sol.local_rot - raw.local_rot).max(axis=(0, 2, 3)) > 0
  assert set(np.flatnonzero(moved)) <= {0, *solver.rig.children[0]}
  np.testing.assert_allclose(sol.global_rot[:, 1:], raw.global_rot[:, 1:], atol=1e-5)
  assert _angle(sol.global_rot[:, 0], raw.global_rot[:, 0] @ E) < 1e-3
  # A stream: each frame by the bias of the frames so far; the last one's is the clip's.
  solver.offsets = clip.offsets
  solver.reset()
  stream = np.stack([solver.step(f) for f in clip.positions])
  np.testing.assert_allclose(stream[-1], sol.local_rot[-1], atol=1e-5)
  solver.reset()
  again = np.concatenate(list(solver.solve_stream([clip.positions[i:i + 20]
                                                   for i in range(0, T, 20)])))
  np.testing.assert_allclose(again, stream, atol=1e-5)


def test_evaluation_calibrates_each_file(cmu_shards):
  from ik_gat_jax import data
  ds = data.load_shards(cmu_shards, 'val')
  method = evaluation.ikgat_method(None, ds.rig)
  off = evaluation.evaluate(method, ds, ds.rig, max_frames=200)
  on = evaluation.evaluate(method, ds, ds.rig, max_frames=200, root_calibration=True)
  assert on['root_calibration'] and not off['root_calibration']
  assert on['frames'] == off['frames']
  # Clean input: the hips' fit is exact, so the root keeps only the network's error around its
  # mean over the file, below the error itself (07_02: the shipped model's root bias on the
  # unseen subject 07).
  print(f"07_02 root error {off['root_rot_err_deg']:.3f} -> {on['root_rot_err_deg']:.3f} deg")
  assert on['root_rot_err_deg'] < off['root_rot_err_deg']
  # Only the root and its children move: every other joint's error is unchanged.
  moved = {'Hips', *(RIG.joint_names[c] for c in RIG.children[0])}
  for name, e in off['per_joint'].items():
    if name not in moved:
      assert on['per_joint'][name]['local_rot_err_deg'] == pytest.approx(
          e['local_rot_err_deg'], abs=1e-6), name
