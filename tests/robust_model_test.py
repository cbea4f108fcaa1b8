"""Model options for tracker input (issue J): the observed-direction blend (a learned weight
between the observed and the predicted bone direction) and the noise-level input channel;
both off leave old configs and their models exactly as they were."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.spatial.transform import Rotation as SciRot

from ik_gat_jax import model, skeleton, train
# Shared helpers (tests/ is on sys.path): FK of random local rotations, a random 6D output
# layer (predicted directions differ from observed ones), rotation-matrix checks.
from model_test import _assert_rotations, _positions, _randomize_head

RIG = skeleton.cmu_body()
J = RIG.num_joints


X = _positions(RIG, 4, 0)


def _cfg(**kw):
  return model.ModelConfig(size='tiny', **kw)


def _set_blend(m, bias):
  """Forces w = sigmoid(bias) everywhere (zero kernel)."""
  m.backbone.extra_out.kernel[...] = jnp.zeros_like(m.backbone.extra_out.kernel[...])
  m.backbone.extra_out.bias[...] = jnp.full_like(m.backbone.extra_out.bias[...], bias)
  return m


BLEND = dict(observed_direction_head=True, observed_direction_blend=True)
_VARIANTS = {
    'blend_ikgat_mixed': dict(output_space='mixed', heading_canonicalization=True, **BLEND),
    'blend_mlp': dict(arch='mlp', output_space='bone_aligned', **BLEND),
    'blend_transformer': dict(arch='transformer', output_space='bone_aligned', **BLEND),
    'noise_level_masked': dict(output_space='mixed', noise_level_input=True, joint_mask=True),
    'both_scaled': dict(output_space='mixed', heading_canonicalization=True,
                        scale_normalization=True, noise_level_input=True, **BLEND),
}


@pytest.fixture(scope='module')
def forwards():
  """Per variant: (model, jitted forward(positions)), compiled once per module."""
  out = {}
  for name, kw in _VARIANTS.items():
    m = _randomize_head(model.create_model(_cfg(**kw), RIG, nnx.Rngs(0)))
    out[name] = (m, jax.jit(lambda p, m=m: m(p, deterministic=True)))
  return out


@pytest.mark.parametrize('name', list(_VARIANTS))
def test_shapes_and_rotations(forwards, name):
  m, f = forwards[name]
  R = f(X)
  assert R.shape == (4, J, 3, 3)
  _assert_rotations(R)
  assert m.config.input_features == 3 + int(m.config.joint_mask) + int(m.config.noise_level_input)
  if m.config.observed_direction_blend:
    raw = jax.eval_shape(lambda x: m.backbone(m.input_features(
        m.canonical_input(x)[0], None, None, None, None), deterministic=True), X)
    assert raw.shape == (4, J, 7)  # 6D + the blend logit


def test_blend_needs_the_head():
  with pytest.raises(ValueError, match='observed_direction_head=True'):
    _cfg(observed_direction_blend=True)


def test_old_config_dicts_build_the_identical_model():
  new = _cfg(output_space='mixed', observed_direction_head=True)
  old = new.to_dict()
  for k in ('observed_direction_blend', 'noise_level_input'):
    old.pop(k)
  assert model.ModelConfig.from_dict(old) == new and new.input_features == 3
  state = lambda cfg, *f: nnx.to_pure_dict(nnx.state(model.create_model(cfg, RIG, nnx.Rngs(0)), *f))
  chex.assert_trees_all_equal(state(model.ModelConfig.from_dict(old)), state(new))
  assert train.same_model_config(old, new.to_dict())
  for k in ('observed_direction_blend', 'noise_level_input'):
    assert not train.same_model_config(old, {**new.to_dict(), k: True})
  # A blend model's other parameters are the plain head model's (the logit layer comes last).
  blend = state(_cfg(output_space='mixed', **BLEND), nnx.Param)
  plain = state(new, nnx.Param)
  assert set(blend['backbone']) == set(plain['backbone']) | {'extra_out'}
  del blend['backbone']['extra_out']
  chex.assert_trees_all_equal(plain, blend)


@pytest.mark.parametrize('kw', [dict(output_space='mixed', heading_canonicalization=True),
                                dict(arch='mlp', output_space='bone_aligned')])
def test_blend_at_w_1_is_the_head_and_at_w_0_the_prediction(kw):
  head = _randomize_head(model.create_model(_cfg(observed_direction_head=True, **kw), RIG,
                                            nnx.Rngs(0)))
  plain = _randomize_head(model.create_model(_cfg(**kw), RIG, nnx.Rngs(0)))
  blend = _randomize_head(model.create_model(_cfg(**BLEND, **kw), RIG, nnx.Rngs(0)))
  ref_head, ref_plain = head(X, deterministic=True), plain(X, deterministic=True)
  assert np.abs(np.asarray(ref_head) - np.asarray(ref_plain)).max() > 0.1  # they do differ
  np.testing.assert_allclose(_set_blend(blend, 50.0)(X, deterministic=True), ref_head,
                             atol=1e-5)
  np.testing.assert_allclose(_set_blend(blend, -50.0)(X, deterministic=True), ref_plain,
                             atol=1e-5)


def test_blend_starts_near_w_0p9():
  kw = dict(output_space='bone_aligned')
  blend = _randomize_head(model.create_model(_cfg(**BLEND, **kw), RIG, nnx.Rngs(0)))
  np.testing.assert_allclose(jax.nn.sigmoid(blend.backbone.extra_out.bias[...]), 0.9, rtol=1e-6)
  plain = _randomize_head(model.create_model(_cfg(**kw), RIG, nnx.Rngs(0)))
  Q = np.asarray(blend(X, deterministic=True))
  pred = np.asarray(plain(X, deterministic=True))[..., 0]  # the predicted bone direction
  p = np.asarray(X)
  unit = lambda v: v / np.linalg.norm(v, axis=-1, keepdims=True)
  for j, c in enumerate(RIG.designated_children):
    if c >= 0:
      want = unit(0.9 * unit(p[:, c] - p[:, j]) + 0.1 * pred[:, j])
      np.testing.assert_allclose(Q[:, j, :, 0], want, atol=2e-3)
    else:  # leaves keep the predicted column
      np.testing.assert_allclose(Q[:, j, :, 0], pred[:, j], atol=1e-5)


def test_jit_once_and_gradients_finite():
  m = _randomize_head(model.create_model(
      _cfg(output_space='mixed', heading_canonicalization=True, noise_level_input=True,
           joint_mask=True, **BLEND), RIG, nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(m, nnx.Param, ...)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def loss_grads(params, x, mask):
    def loss(params, x):
      return jnp.sum(nnx.merge(graphdef, params, rest)(x, deterministic=True,
                                                       joint_mask=mask) ** 2)
    return jax.grad(loss, argnums=(0, 1))(params, x)

  chex.clear_trace_counter()
  mask = np.ones((4, J), bool)
  # Degenerate input too: an exactly symmetric rest pose (every bone pair equal: |log 1| at 0).
  smpl_like = np.asarray(X).copy()
  off = RIG.template().copy()
  lat = np.asarray(RIG.lateral, float)
  for j, mj in enumerate(RIG.mirror):  # the left offsets mirrored onto the right
    if j < mj:
      off[mj] = off[j] @ (np.eye(3) - 2 * np.outer(lat, lat)).T
  rest_pose = skeleton.rest_positions_np(off, RIG.parents)
  smpl_like[0] = rest_pose
  assert float(model.noise_level(jnp.asarray(rest_pose)[None], RIG)[0]) < 1e-5
  masked = mask.copy()
  masked[1, [8, 14]] = False
  bad = smpl_like.copy()
  bad[1, [8, 14]] = np.nan
  for x, mk in ((X, mask), (jnp.asarray(bad, jnp.float32), masked)):
    g_params, g_x = loss_grads(params, x, mk)
    for leaf in jax.tree.leaves(g_params) + [g_x]:
      assert np.isfinite(np.asarray(leaf)).all()
  assert np.abs(np.asarray(g_params['backbone']['extra_out']['bias'][...])).max() > 0
  assert np.abs(np.asarray(g_params['backbone']['embed']['kernel'][...])[:, -1]).max() > 0
  assert np.all(np.asarray(g_x)[~masked] == 0)


def test_noise_level_estimate():
  x = _positions(RIG, 256, 5)
  level = lambda p, mask=None: np.asarray(model.noise_level(jnp.asarray(p, jnp.float32), RIG,
                                                            mask))
  base = level(x)
  rng = np.random.default_rng(0)
  medians = [np.median(level(x + rng.normal(scale=mm * 1e-3, size=x.shape)))
             for mm in (0, 10, 30)]
  assert medians[0] < medians[1] < medians[2]
  assert medians[1] > 3 * medians[0]  # the template's own asymmetry is well below 10 mm noise
  # Invariant to translation, uniform scale and rotation.
  R = SciRot.from_rotvec([0.3, 1.2, -0.4]).as_matrix().astype(np.float32)
  np.testing.assert_allclose(level(1.7 * np.asarray(x) @ R.T + 3.0), base, atol=1e-4)
  # Masked joints do not count (NaN there cannot leak); nothing observed gives 0.
  mask = np.ones((256, J), bool)
  mask[:, 8] = False  # LeftForeArm: the pairs of bones into and out of it drop out
  holes = np.asarray(x).copy()
  holes[:, 8] = np.nan
  pairs = [k for k, (j, mj) in enumerate(model.mirror_bone_pairs(RIG)) if 8 not in
           (j, RIG.parents[j])]
  lengths = lambda p, j: np.linalg.norm(p[:, j] - p[:, RIG.parents[j]], axis=-1)
  want = np.mean([np.abs(np.log(lengths(np.asarray(x), j) / lengths(np.asarray(x), mj)))
                  for k, (j, mj) in enumerate(model.mirror_bone_pairs(RIG)) if k in pairs],
                 axis=0) * model.NOISE_LEVEL_SCALE
  np.testing.assert_allclose(level(holes, mask), want, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(level(holes, np.zeros_like(mask)), 0.0)


def test_smpl22_runs_with_both():
  smpl = skeleton.smpl22()
  m = _randomize_head(model.create_model(
      _cfg(output_space='mixed', noise_level_input=True, **BLEND), smpl, nnx.Rngs(0)))
  _assert_rotations(jax.jit(lambda p: m(p, deterministic=True))(_positions(smpl, 2, 3)))
