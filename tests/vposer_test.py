"""The VAE pose prior: shapes, standardisation, loss, training signal, diagnostics."""

import jax
import ml_collections
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from scipy.spatial.transform import Rotation as SciRot

from ik_gat_jax import bone_frames, kinematics, prior_task, rotations, skeleton, vposer

RIG = skeleton.cmu_body()
J = RIG.num_joints
TINY = vposer.VAEConfig(latent=4, hidden=32)
# A 7-joint body for the loss and training checks (the 21-joint FK doubles compile time).
TOY = skeleton.make_rig(
    'toy', ('Root', 'Spine', 'Head', 'LHip', 'LKnee', 'RHip', 'RKnee'), (-1, 0, 1, 0, 3, 0, 5),
    np.array([(0, 1, 0), (0, .2, 0), (0, .2, .02), (.1, -.05, 0), (0, -.4, .01), (-.1, -.05, 0),
              (0, -.4, .01)]), up=(0, 1, 0), forward=(0, 0, 1))


def _poses(n: int, seed: int = 0, max_angle: float = 0.8, joints: int = J) -> jax.Array:
  """`[n, joints, 3, 3]` random local rotations with angles up to `max_angle` radians."""
  rotvec = SciRot.random(n * joints, random_state=seed).as_rotvec()
  angle = np.linalg.norm(rotvec, axis=-1, keepdims=True)
  rotvec *= np.minimum(angle, max_angle) / np.maximum(angle, 1e-9)
  return jnp.asarray(SciRot.from_rotvec(rotvec).as_matrix().reshape(n, joints, 3, 3), jnp.float32)


def _frames(rig) -> jax.Array:
  """The template body's rest bone frames `[J, 3, 3]`."""
  return bone_frames.bone_frames(jnp.asarray(rig.template(), jnp.float32), rig)


def _batch(rig, n: int, seed: int = 0) -> dict:
  local = _poses(n, seed, joints=rig.num_joints)
  off = jnp.broadcast_to(jnp.asarray(rig.template(), jnp.float32), (n, rig.num_joints, 3))
  _, pos = kinematics.forward_kinematics(local, off, rig.parents, jnp.zeros((n, 3)))
  return {'local_rot': local, 'offsets': off, 'positions': pos,
          'bone_frames': jnp.broadcast_to(_frames(rig), local.shape)}


def test_config_round_trip_and_validation():
  config = vposer.VAEConfig(latent=16, kl_weight=0.01, activation='elu')
  assert vposer.VAEConfig.from_dict(config.to_dict()) == config
  assert config.bone_chart  # new priors model the bone-frame chart (issue L) ...
  old = {k: v for k, v in config.to_dict().items() if k != 'bone_chart'}
  assert not vposer.VAEConfig.from_dict(old).bone_chart  # ... priors saved before it do not
  with pytest.raises(ValueError, match='unknown'):
    vposer.VAEConfig.from_dict({'latent': 8, 'bogus': 1})
  with pytest.raises(ValueError, match='activation'):
    vposer.VAEConfig(activation='relu6')


def test_shapes_rotations_and_standardisation_are_static():
  local = _poses(10, seed=1)
  mean, std = vposer.standardization_stats(np.asarray(local))
  assert len(mean) == len(std) == 6 * (J - 1) and min(std) >= 0.01
  x = np.asarray(rotations.sixd_from_matrix(local[:, 1:])).reshape(10, -1)
  np.testing.assert_allclose(mean, x.mean(0), atol=1e-5)
  model = vposer.PosePrior(TINY, J, parents=RIG.parents, input_mean=mean, input_std=std,
                           rngs=nnx.Rngs(0))
  B = _frames(RIG)
  mu, logvar = model.encode(local, B)
  assert mu.shape == logvar.shape == (10, TINY.latent)
  np.testing.assert_allclose(model.encode(local[:, 1:], B)[0], mu, atol=1e-6)  # root optional
  with pytest.raises(ValueError, match='bone frames B'):
    model.encode(local)
  with pytest.raises(ValueError, match='parents'):
    vposer.PosePrior(TINY, J, rngs=nnx.Rngs(0))
  recon, _, _ = model(local, jax.random.key(0), B)
  assert recon.shape == (10, J - 1, 3, 3)
  np.testing.assert_allclose(jnp.swapaxes(recon, -1, -2) @ recon,
                             jnp.broadcast_to(jnp.eye(3), recon.shape), atol=1e-5)
  np.testing.assert_allclose(jnp.linalg.det(recon), 1.0, atol=1e-5)
  params = nnx.state(model, nnx.Param)
  assert len(jax.tree.leaves(params)) == 4 * (TINY.num_hidden + 1)  # kernels and biases only
  with pytest.raises(ValueError, match='rotations'):
    model.encode(local[:, 2:], B)


def test_bone_chart_prior_maps_its_chart_with_the_subjects_bone_frames():
  """decode = the chart's rotations L mapped by B (R = B_p L B_j^T), encode its inverse; a
  joint-chart prior with the same weights decodes L itself as the local rotations and ignores
  B (the old behaviour, bit for bit)."""
  model = vposer.PosePrior(TINY, J, parents=RIG.parents, rngs=nnx.Rngs(0))
  joint = vposer.PosePrior(vposer.VAEConfig(latent=4, hidden=32, bone_chart=False), J,
                           rngs=nnx.Rngs(0))
  z = jax.random.normal(jax.random.key(2), (3, TINY.latent))
  B = _frames(RIG)
  L = model.decode_chart(z)
  np.testing.assert_array_equal(joint.decode(z), L)
  np.testing.assert_array_equal(joint.decode(z, B), L)
  R = model.decode(z, B)
  full = jnp.concatenate([jnp.broadcast_to(jnp.eye(3), (3, 1, 3, 3)), R], axis=1)
  Bp = B[np.array([max(p, 0) for p in RIG.parents])][1:]
  np.testing.assert_allclose(R, Bp @ L @ jnp.swapaxes(B[1:], -1, -2), atol=1e-6)
  np.testing.assert_allclose(model.to_chart(full, B), L, atol=1e-5)
  np.testing.assert_allclose(model.encode(full, B)[0], joint.encode(L)[0], atol=1e-4)


def test_decoder_fn_is_hashable_and_matches_decode():
  model = vposer.PosePrior(TINY, J, parents=RIG.parents, rngs=nnx.Rngs(0))
  decode, params = vposer.decoder(model)
  z = jax.random.normal(jax.random.key(1), (TINY.latent,))
  B = _frames(RIG)
  np.testing.assert_allclose(decode(params, z, B), model.decode(z, B), atol=1e-6)
  other, _ = vposer.decoder(vposer.PosePrior(TINY, J, parents=RIG.parents, rngs=nnx.Rngs(5)))
  assert hash(decode) == hash(other) and decode == other  # one compiled solver per architecture
  assert decode.bone_chart


def test_vae_loss_is_per_example_finite_and_trains():
  batch = _batch(TOY, 16, seed=2)
  model = vposer.PosePrior(TINY, TOY.num_joints, parents=TOY.parents, rngs=nnx.Rngs(0))
  loss, aux = vposer.vae_loss(model, batch, jax.random.key(0), TINY, TOY)
  assert loss.shape == (16,) and set(aux) == {'recon_geodesic', 'pos_err_dm', 'kl'}
  assert all(np.isfinite(np.asarray(v)).all() for v in [loss, *aux.values()])
  np.testing.assert_allclose(
      loss, TINY.rot_weight * aux['recon_geodesic'] + TINY.pos_weight * aux['pos_err_dm']
      + TINY.kl_weight * aux['kl'], rtol=1e-5)

  graphdef, params = nnx.split(model)
  opt = optax.adam(1e-2)

  @jax.jit
  def step(params, opt_state, key):
    def mean_loss(p):
      return jnp.mean(vposer.vae_loss(nnx.merge(graphdef, p), batch, key, TINY, TOY)[0])
    value, grads = jax.value_and_grad(mean_loss)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  opt_state = opt.init(params)
  values = []
  for i in range(40):
    params, opt_state, value = step(params, opt_state, jax.random.fold_in(jax.random.key(1), i))
    values.append(float(value))
  assert np.isfinite(values).all()
  assert np.mean(values[-5:]) < 0.85 * np.mean(values[:5])


def test_active_dims_counts_informative_dimensions():
  rng = np.random.default_rng(0)
  mu = np.zeros((500, 8), np.float32)
  logvar = np.zeros((500, 8), np.float32)
  mu[:, :3] = rng.normal(size=(500, 3))        # KL ~ 0.5 each: active
  logvar[:, 3] = -1.0                          # KL = 0.5 (e^-1 + 1 - 1) ~ 0.18: active
  mu[:, 4] = 0.1                               # KL = 0.005: inactive
  assert int(vposer.active_dims(jnp.asarray(mu), jnp.asarray(logvar))) == 4
  assert int(vposer.active_dims(jnp.zeros((5, 8)), jnp.zeros((5, 8)))) == 0


def test_sample_realism_measures_distance_to_nearest_training_pose():
  """In the prior's chart: samples and training poses need no subject."""
  model = vposer.PosePrior(TINY, TOY.num_joints, parents=TOY.parents, rngs=nnx.Rngs(0))
  key = jax.random.key(3)
  samples = model.decode_chart(jax.random.normal(key, (20, TINY.latent)))
  sample = model.decode_chart(jax.random.normal(key, (1, TINY.latent)))
  others = _poses(37, seed=4, joints=TOY.num_joints)[:, 1:]
  # 57 training poses in chunks of 16 (the last padded): the samples themselves are nearest.
  train = jnp.concatenate([others, samples], axis=0)
  assert vposer.sample_realism(model, key, train, n=20, chunk=16) < 0.05
  # One sample; the training set holds it turned by 0.2 rad at every joint, plus others.
  tilted = sample @ rotations.axis_rotation('x', jnp.float32(0.2))
  train = jnp.concatenate([others, tilted], axis=0)
  degrees = vposer.sample_realism(model, key, train, n=1, chunk=16)
  assert degrees == pytest.approx(np.degrees(0.2), abs=0.01)
  with_root = jnp.concatenate([jnp.broadcast_to(jnp.eye(3), (38, 1, 3, 3)), train], axis=1)
  assert vposer.sample_realism(model, key, with_root, n=1, chunk=16) == pytest.approx(degrees)


def test_prior_task_builds_old_priors_in_the_joint_chart_and_refuses_mixed_charts():
  """A saved config without `bone_chart` (checkpoints/prior) with its statistics (no
  `bone_chart` either) rebuilds the joint-chart prior; statistics of the other chart than the
  model's are refused in one line."""
  D = 6 * (TOY.num_joints - 1)
  old_model = {k: v for k, v in TINY.to_dict().items() if k != 'bone_chart'}
  stats = {'mean': [0.0] * D, 'std': [1.0] * D}
  build = lambda model, stats: prior_task._build(  # pylint: disable=protected-access
      ml_collections.ConfigDict({'model': model, 'prior_stats': stats}), TOY, nnx.Rngs(0), None)
  assert not build(old_model, stats).config.bone_chart
  assert build(TINY.to_dict(), {**stats, 'bone_chart': True}).config.bone_chart
  with pytest.raises(ValueError, match=r'local rotations but model.bone_chart=True'):
    build(TINY.to_dict(), stats)
