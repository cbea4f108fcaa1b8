"""Swing-only IK, the mean pose, and the iterative solvers (with and without a prior)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.spatial.transform import Rotation as SciRot

from ik_gat_jax import bone_frames, iterative_ik, kinematics, metrics, rotations, skeleton
from ik_gat_jax import vposer
from ik_gat_jax.io import bvh

CMU_UNIT_M = 0.056444
RIG = skeleton.cmu_body()
# A 7-joint body (determined root, two legs, spine and head) for the generic solver checks:
# the same code paths at half the compile time of the 21-joint rig.
TOY = skeleton.make_rig(
    'toy', ('Root', 'Spine', 'Head', 'LHip', 'LKnee', 'RHip', 'RKnee'), (-1, 0, 1, 0, 3, 0, 5),
    np.array([(0, 1, 0), (0, .2, 0), (0, .2, .02), (.1, -.05, 0), (0, -.4, .01), (-.1, -.05, 0),
              (0, -.4, .01)]), up=(0, 1, 0), forward=(0, 0, 1))


# ----------------------------------------------------------------------------------------------
# Data: 07_01 reduced to cmu_body in the test itself, and synthetic poses.


def _reduce_to_rig(motion: bvh.BVHMotion, rig: skeleton.Rig):
  """Raw BVH -> the rig's `(local [T, J, 3, 3], offsets [J, 3], positions [T, J, 3])`, metres.

  A kept joint's local rotation is the product of its removed ancestors' rotations (down to its
  nearest kept ancestor) and its own; its offset the sum of theirs and its own, which holds
  because removed joints must not rotate (asserted). Positions come from the naive raw loop.
  """
  names = motion.names
  R = [bvh.euler_to_matrix_np(motion.rotation_degrees(j), motion.euler_order(j))
       for j in range(len(names))]
  local, offsets = [], []
  for name in rig.joint_names:
    j = names.index(name)
    rot, off, p = R[j], motion.offsets[j].copy(), motion.parents[j]
    while p >= 0 and names[p] not in rig.joint_names:
      assert np.abs(R[p] - np.eye(3)).max() < 1e-5, f'removed joint {names[p]} rotates'
      rot, off, p = R[p] @ rot, motion.offsets[p] + off, motion.parents[p]
    local.append(rot)
    offsets.append(off)
  positions = bvh.naive_fk_np(motion, CMU_UNIT_M)[:, [names.index(n) for n in rig.joint_names]]
  return np.stack(local, 1), np.stack(offsets) * CMU_UNIT_M, positions


@pytest.fixture(scope='module')
def clip(cmu_dir):
  """07_01 at 30 fps (cgspeed: drop the T-pose frame, then every 4th frame), float32."""
  motion = bvh.read_bvh(cmu_dir / '07_01.bvh')
  motion.motion = motion.motion[1::4]
  local, offsets, positions = _reduce_to_rig(motion, RIG)
  _, p = kinematics.forward_kinematics(jnp.asarray(local), jnp.asarray(offsets), RIG.parents,
                                       jnp.asarray(positions[:, 0]))
  assert np.abs(np.asarray(p) - positions).max() < 1e-5  # the reduction is exact
  return tuple(jnp.asarray(a, jnp.float32) for a in (local, offsets, positions))


def _synthetic(rig, n: int, seed: int = 0, max_angle: float = np.pi):
  """Random local rotations (angles up to `max_angle`) on the template -> (local, off, pos)."""
  rng = np.random.default_rng(seed)
  rotvec = SciRot.random(n * rig.num_joints, random_state=seed).as_rotvec()
  angle = np.linalg.norm(rotvec, axis=-1, keepdims=True)
  rotvec *= np.minimum(angle, max_angle) / np.maximum(angle, 1e-9)
  local = jnp.asarray(SciRot.from_rotvec(rotvec).as_matrix().reshape(n, -1, 3, 3), jnp.float32)
  off = jnp.asarray(rig.template(), jnp.float32)
  _, pos = kinematics.forward_kinematics(local, off, rig.parents,
                                         jnp.asarray(rng.normal(size=(n, 3)), jnp.float32))
  return local, off, pos


def _mpjpe_mm(local, off, pos, rig=RIG):
  _, p = kinematics.forward_kinematics(local, off, rig.parents, pos[..., 0, :])
  return 1000.0 * np.asarray(jnp.linalg.norm(p - pos, axis=-1))[..., 1:]


def _posed_bone_directions(local, off, rig=RIG):
  """`G_j @ normalize(o_c)` for joints with a designated child: `[..., K, 3]`."""
  G = kinematics.local_to_global(local, rig.parents)
  js = [j for j, c in enumerate(rig.designated_children) if c >= 0]
  cs = [rig.designated_children[j] for j in js]
  d = rotations.normalize(off[..., cs, :])
  return jnp.einsum('...kab,...kb->...ka', G[..., js, :, :], d)


# ----------------------------------------------------------------------------------------------
# Analytic.


def test_swing_ik_reproduces_clean_cmu_positions(clip):
  local, off, pos = clip
  R = iterative_ik.swing_ik_jit(pos, off, RIG)
  B = bone_frames.bone_frames(off, RIG)
  s = metrics.summarize(metrics.frame_errors(R, local, off, B, pos, RIG), RIG)
  assert s['mpjpe_mm'] < 1.0 and _mpjpe_mm(R, off, pos).max() < 1.0
  assert s['root_rot_err_deg'] < 0.01
  np.testing.assert_allclose(_posed_bone_directions(R, off), _posed_bone_directions(local, off),
                             atol=1e-4)
  # Fully determined joints (Hips, Spine1) are exact in the world frame.
  err = np.degrees(np.asarray(rotations.geodesic_angle(
      kinematics.local_to_global(R, RIG.parents), kinematics.local_to_global(local, RIG.parents))))
  det = [j for j, o in enumerate(RIG.observability()) if o == 'determined']
  assert err[:, det].max() < 0.05
  leaves = [j for j, c in enumerate(RIG.designated_children) if c < 0]
  np.testing.assert_allclose(R[:, leaves], jnp.broadcast_to(jnp.eye(3), R[:, leaves].shape))


def test_swing_ik_synthetic_any_pose():
  local, off, pos = _synthetic(RIG, 12, seed=1)
  R = iterative_ik.swing_ik_jit(pos, off, RIG)
  assert _mpjpe_mm(R, off, pos).max() < 0.05
  np.testing.assert_allclose(_posed_bone_directions(R, off), _posed_bone_directions(local, off),
                             atol=1e-4)


def test_swing_ik_jit_parity_and_batching():
  local, off, pos = _synthetic(TOY, 12, seed=1)
  R = iterative_ik.swing_ik(pos, off, TOY)
  assert _mpjpe_mm(R, off, pos, TOY).max() < 0.05
  np.testing.assert_allclose(iterative_ik.swing_ik_jit(pos, off, TOY), R, atol=1e-5)
  per_frame_off = jnp.broadcast_to(off, pos.shape)
  np.testing.assert_allclose(iterative_ik.swing_ik(pos, per_frame_off, TOY), R, atol=1e-6)
  R2 = iterative_ik.swing_ik(pos.reshape(3, 4, -1, 3), off, TOY)
  np.testing.assert_allclose(R2.reshape(R.shape), R, atol=1e-6)


def test_kabsch_and_mean_pose_against_scipy():
  rng = np.random.default_rng(2)
  R0 = SciRot.random(random_state=3)
  rest = rng.normal(size=(5, 3))
  np.testing.assert_allclose(iterative_ik.kabsch(jnp.asarray(rest), jnp.asarray(R0.apply(rest))),
                             R0.as_matrix(), atol=1e-5)
  # A reflection-like target still yields a proper rotation.
  assert np.linalg.det(np.asarray(iterative_ik.kabsch(jnp.asarray(rest), -jnp.asarray(rest)))) > 0
  rots = SciRot.random(40 * 3, random_state=4).as_matrix().reshape(40, 3, 3, 3)
  mean = iterative_ik.mean_pose(jnp.asarray(rots))
  for j in range(3):
    np.testing.assert_allclose(mean[j], SciRot.from_matrix(rots[:, j]).mean().as_matrix(),
                               atol=1e-4)


def test_mean_pose_ik_constant_pose_with_analytic_root():
  local, off, pos = _synthetic(TOY, 5, seed=5)
  mean_local = iterative_ik.mean_pose(local)
  R = iterative_ik.mean_pose_ik(pos, off, mean_local, TOY)
  np.testing.assert_allclose(R[:, 1:], jnp.broadcast_to(mean_local[1:], R[:, 1:].shape),
                             atol=1e-6)
  np.testing.assert_allclose(R[:, 0], local[:, 0], atol=1e-4)  # the root is determined


# ----------------------------------------------------------------------------------------------
# Iterative IK without a prior.


def test_rotation_solver_converges_and_loss_decreases(clip):
  _, off, pos = clip
  frames = pos[::16]  # 5 frames across the clip
  config = iterative_ik.SolverConfig(iters=300)
  R, trace = iterative_ik.solve_rotations_jit(frames, off, RIG, config)
  assert trace.shape == (frames.shape[0], 301)
  assert _mpjpe_mm(R, off, frames).mean() < 2.0
  coarse = np.asarray(trace[:, :151:50])  # Adam is not monotone step by step
  assert (np.diff(coarse, axis=1) < 0).all()
  assert (trace[:, -1] < 1e-5 * trace[:, 0]).all()


def test_vmapped_solver_equals_per_frame_solves():
  _, off, pos = _synthetic(TOY, 2, seed=6, max_angle=1.0)
  config = iterative_ik.SolverConfig(iters=40, init_root='identity')
  R, trace = iterative_ik.solve_rotations_jit(pos, off, TOY, config)
  for i in range(2):
    Ri, ti = iterative_ik.solve_rotations_jit(pos[i:i + 1], off, TOY, config)
    np.testing.assert_allclose(Ri[0], R[i], atol=1e-4)
    np.testing.assert_allclose(ti[0], trace[i], rtol=1e-3, atol=1e-6)


def test_lbfgs_option_reduces_the_loss():
  _, off, pos = _synthetic(TOY, 2, seed=7, max_angle=1.0)
  config = iterative_ik.SolverConfig(iters=15, optimizer='lbfgs')
  R, trace = iterative_ik.solve_rotations_jit(pos, off, TOY, config)
  assert np.isfinite(np.asarray(trace)).all()
  assert (trace[:, -1] < 0.05 * trace[:, 0]).all()


def test_fitted_translation_absorbs_a_noisy_root_joint():
  """`fit_translation` (issue J): a root-relative input carries the root joint's noise in every
  joint alike. With the root fixed to the target's root joint the refinement bends the pose to
  meet the shifted joints; with the translation fitted the root joint is one point of J, and a
  shift of every target (root included) leaves the solution as it was."""
  true, off, pos = _synthetic(TOY, 3, seed=11, max_angle=1.0)
  init = true @ jnp.asarray(SciRot.from_rotvec(np.full((3 * TOY.num_joints, 3), 0.05))
                            .as_matrix().reshape(3, -1, 3, 3), jnp.float32)
  shift = jnp.asarray([0.03, -0.02, 0.04], jnp.float32)
  noisy_root = pos.at[:, 0].add(-shift)
  run = jax.jit(lambda i, p, c: iterative_ik.refine_rotations(i, p, off, TOY, c)[0],
                static_argnums=2)
  fitted = iterative_ik.refine_config(100, w_anchor=0.0)
  fixed = iterative_ik.refine_config(100, w_anchor=0.0, fit_translation=False)
  moved = lambda c: float(jnp.mean(rotations.geodesic_angle(run(init, noisy_root, c),
                                                           run(init, pos, c))))
  assert moved(fitted) < 0.5 * moved(fixed)
  a, b = run(init, pos, fitted), run(init, pos + shift, fitted)
  assert float(jnp.max(rotations.geodesic_angle(a, b))) < 1e-3


def test_relative_anchor_is_the_fixed_anchor_at_the_initial_residual():
  """`anchor_relative`: the anchor weight is `w_anchor * w_data * r0`, r0 the initial pose's
  mean squared residual per joint after the fitted translation; so one frame refined with it
  equals the same frame refined with that weight fixed."""
  true, off, pos = _synthetic(TOY, 2, seed=12, max_angle=1.0)
  init = true @ jnp.asarray(SciRot.from_rotvec(np.full((2 * TOY.num_joints, 3), 0.1))
                            .as_matrix().reshape(2, -1, 3, 3), jnp.float32)
  rel = iterative_ik.refine_config(20)
  assert rel.anchor_relative and rel.fit_translation
  for i in range(2):
    _, p0 = kinematics.forward_kinematics(init[i], off, TOY.parents, jnp.zeros(3))
    r = p0 - pos[i]
    r0 = float(jnp.mean(jnp.sum((r - r.mean(0))**2, -1)))
    fixed = iterative_ik.refine_config(20, anchor_relative=False,
                                       w_anchor=rel.w_anchor * rel.w_data * r0)
    a = iterative_ik.refine_rotations(init[i:i + 1], pos[i:i + 1], off, TOY, rel)
    b = iterative_ik.refine_rotations(init[i:i + 1], pos[i:i + 1], off, TOY, fixed)
    np.testing.assert_allclose(a[0], b[0], atol=1e-5)
    np.testing.assert_allclose(a[2], b[2], rtol=1e-4)


def test_warm_start_beats_cold_and_is_causal_per_window(clip):
  _, off, pos = clip
  frames = pos[:16]
  config = iterative_ik.SolverConfig(iters=25, warm_iters=25, window=8)
  R_warm, final = iterative_ik.solve_rotations_warm_jit(frames, off, RIG, config)
  R_cold, _ = iterative_ik.solve_rotations_jit(frames, off, RIG, config)
  warm, cold = _mpjpe_mm(R_warm, off, frames), _mpjpe_mm(R_cold, off, frames)
  assert final.shape == (16,) and warm.mean() <= cold.mean()
  # Error below a floor on these real frames: the solvers' initial pose (rest pose, analytic
  # root) is 228 mm MPJPE; measured cold 43 mm (0.19x), warm 16 mm (0.071x). Bounds: each
  # ratio doubled (2x margin), rounded up.
  rest = jnp.broadcast_to(jnp.eye(3), (RIG.num_joints, 3, 3))
  init = _mpjpe_mm(iterative_ik.mean_pose_ik(frames, off, rest, RIG), off, frames)
  assert cold.mean() < 0.4 * init.mean() and warm.mean() < 0.15 * init.mean(), (
      init.mean(), cold.mean(), warm.mean())
  # A window's first frame is solved cold: same as the independent cold solve.
  np.testing.assert_allclose(R_warm[::8], R_cold[::8], atol=1e-4)
  # Causal within a window, independent across windows: perturbing frame 12 changes 12..15 only.
  moved_hand = frames.at[12, RIG.index('LeftHand')].add(0.05)
  R_pert, _ = iterative_ik.solve_rotations_warm_jit(moved_hand, off, RIG, config)
  np.testing.assert_allclose(R_pert[:12], R_warm[:12], atol=1e-6)
  assert np.abs(np.asarray(R_pert[12:] - R_warm[12:])).max() > 1e-3


def test_solver_config_validates_and_flops_are_counted():
  with pytest.raises(ValueError, match='optimizer'):
    iterative_ik.SolverConfig(optimizer='sgd')
  with pytest.raises(ValueError, match='init_root'):
    iterative_ik.SolverConfig(init_root='random')
  _, off, pos = _synthetic(TOY, 4, seed=8)
  swing = iterative_ik.flops_per_frame(lambda p: iterative_ik.swing_ik(p, off, TOY), pos)
  solver = iterative_ik.solver_flops_per_frame(pos, off, TOY, iterative_ik.SolverConfig(iters=10))
  assert 0 < swing < solver < float('inf')


# ----------------------------------------------------------------------------------------------
# Iterative IK with a prior.


def _small_prior(rig):
  """A random, smooth 8-D decoder (see vposer's docstring on the activation)."""
  config = vposer.VAEConfig(latent=8, hidden=64)
  model = vposer.PosePrior(config, rig.num_joints, parents=rig.parents,
                           input_std=(0.5,) * (6 * (rig.num_joints - 1)), rngs=nnx.Rngs(0))
  return model, config


def _decoded_targets(model, z, seed, rig=RIG, one_root=False):
  """FK of `decode(z) [n, J-1]` under random roots (or one shared root) -> (offsets, pos)."""
  k_root, k_pos = jax.random.split(jax.random.key(seed))
  n = 1 if one_root else z.shape[0]
  root = rotations.matrix_from_axis_angle(jax.random.normal(k_root, (n, 3)))
  root_pos = jax.random.normal(k_pos, (n, 3))
  off = jnp.asarray(rig.template(), jnp.float32)
  decoded = model.decode(z, bone_frames.bone_frames(off, rig))  # a bone-chart prior
  root = jnp.broadcast_to(root, (z.shape[0], 3, 3))
  local = jnp.concatenate([root[:, None], decoded], axis=1)
  _, pos = kinematics.forward_kinematics(local, off, rig.parents,
                                         jnp.broadcast_to(root_pos, (z.shape[0], 3)))
  return off, pos


def test_latent_solver_recovers_decoded_poses():
  model, vae = _small_prior(RIG)
  z_true = jax.random.normal(jax.random.key(1), (6, vae.latent))
  off, pos = _decoded_targets(model, z_true, seed=2)
  decode, params = vposer.decoder(model)
  config = iterative_ik.SolverConfig(iters=300, w_z=0.0)
  R, trace = iterative_ik.solve_latent_jit(pos, off, decode, params, RIG, config,
                                           latent_dim=vae.latent)
  err = _mpjpe_mm(R, off, pos)
  assert err.mean() < 1.0 and err.max() < 3.0
  assert (trace[:, -1] < trace[:, 0]).all()


def test_latent_warm_start_on_a_smooth_clip():
  model, vae = _small_prior(TOY)
  t = jnp.linspace(0.0, 1.0, 12)[:, None]
  z_a, z_b = jax.random.normal(jax.random.key(3), (2, vae.latent))
  off, pos = _decoded_targets(model, (1 - t) * z_a + t * z_b, seed=4, rig=TOY, one_root=True)
  decode, params = vposer.decoder(model)
  config = iterative_ik.SolverConfig(iters=20, warm_iters=20, window=6, w_z=0.0)
  R_warm, _ = iterative_ik.solve_latent_warm_jit(pos, off, decode, params, TOY, config,
                                                 latent_dim=vae.latent)
  R_cold, _ = iterative_ik.solve_latent_jit(pos, off, decode, params, TOY, config,
                                            latent_dim=vae.latent)
  warm, cold = _mpjpe_mm(R_warm, off, pos, TOY), _mpjpe_mm(R_cold, off, pos, TOY)
  assert warm.mean() < cold.mean()
  np.testing.assert_allclose(R_warm[::6], R_cold[::6], atol=1e-4)


def test_refinement_with_a_prior_leans_on_it_for_noisy_input():
  """`w_prior` (issue J): targets from poses on a prior's manifold, 20 mm of noise, the
  initial pose off by ~0.2 rad per joint (a network that copied noise). Without the prior the
  refinement only fits the noisy joints (measured 16.8 -> 15.5 deg); with it the pose is pulled
  toward the prior's decoding (9.5 deg), and the loss it minimises never grows. With
  `w_prior = 0` the prior is unused: bit for bit the refinement without one."""
  model, vae = _small_prior(TOY)
  n = 8
  z = jax.random.normal(jax.random.key(5), (n, vae.latent))
  off = jnp.asarray(TOY.template(), jnp.float32)
  true = jnp.concatenate([jnp.broadcast_to(jnp.eye(3), (n, 1, 3, 3)),
                          model.decode(z, bone_frames.bone_frames(off, TOY))], 1)
  _, pos = kinematics.forward_kinematics(true, off, TOY.parents, jnp.zeros((n, 3)))
  k_noise, k_init = jax.random.split(jax.random.key(7))
  noisy = pos + 0.02 * jax.random.normal(k_noise, pos.shape)
  init = rotations.matrix_from_axis_angle(0.2 * jax.random.normal(k_init, (n, TOY.num_joints,
                                                                           3))) @ true
  init = init.at[:, 0].set(true[:, 0])
  decode, params = vposer.decoder(model)
  err = lambda R: float(jnp.mean(rotations.geodesic_angle(R[:, 1:], true[:, 1:])))
  with_prior = iterative_ik.refine_config(50, prior=True)
  assert with_prior.w_prior > 0
  R, loss0, loss1 = iterative_ik.refine_rotations(init, noisy, off, TOY, with_prior, decode,
                                                  params)
  unused = dataclasses.replace(with_prior, w_prior=0.0)
  R0 = iterative_ik.refine_rotations(init, noisy, off, TOY, unused, decode, params)[0]
  np.testing.assert_array_equal(R0, iterative_ik.refine_rotations(init, noisy, off, TOY,
                                                                  unused)[0])
  assert err(R) < 0.8 * err(R0) < err(init), (err(R), err(R0), err(init))
  assert bool((loss1 <= loss0).all())
