"""End-site points (issue G2): conversion against an independent FK, optional shard arrays,
augmentation (mirror swaps left/right), the model's masking (absent end sites cannot affect the
output), the solver's NaN -> absent path and the evaluator's refusal."""

import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from ik_gat_jax import data as data_lib
from ik_gat_jax import inference
from ik_gat_jax import input_pipeline
from ik_gat_jax import model as model_lib
from ik_gat_jax import skeleton

# Rotation-matrix entries lie in [-1, 1]: two compiled programs computing the same function in
# float32 (eps 1.2e-7) may differ by a few units in the last place, whatever the machine or the
# compiler's optimisation level (the tests' XLA_FLAGS, conftest.py).
ULP_TOL = 8 * float(np.finfo(np.float32).eps)


@pytest.fixture(scope='module')
def rig():
  return skeleton.cmu_body()


# One compiled forward per variant, shared by the tests of this module.
_VARIANTS = {
    'mixed_masked': dict(output_space='mixed', joint_mask=True, heading_canonicalization=True,
                         scale_normalization=True),
    'mlp_global': dict(arch='mlp', output_space='global'),
}


@pytest.fixture(scope='module')
def forwards(rig):
  out = {}
  for name, kw in _VARIANTS.items():
    model = model_lib.create_model(model_lib.ModelConfig(size='tiny', end_sites=True, **kw), rig,
                                   nnx.Rngs(0))
    out[name] = jax.jit(lambda p, e, m, model=model: model(p, deterministic=True, end_sites=e,
                                                           end_site_mask=m))
  return out


def _inputs(rig, n=4, seed=0):
  rng = np.random.default_rng(seed)
  pos = rng.normal(scale=0.3, size=(n, rig.num_joints, 3)).astype(np.float32)
  ends = pos[:, list(rig.leaves)] + rng.normal(scale=0.08, size=(n, len(rig.leaves), 3))
  given = np.ones((n, len(rig.leaves)), bool)
  given[0] = False             # none given
  given[1, [1, 3]] = False     # a hand and a toe
  given[2, 0] = False          # the head
  return jnp.asarray(pos), jnp.asarray(ends, jnp.float32), given


@pytest.mark.parametrize('variant', list(_VARIANTS))
def test_absent_end_sites_cannot_affect_output(rig, forwards, variant):
  f = forwards[variant]
  pos, ends, given = _inputs(rig)
  ref = np.asarray(f(pos, ends, given))
  assert np.isfinite(ref).all()
  rng = np.random.default_rng(1)
  for fill in (rng.normal(size=ends.shape) * 5, np.full(ends.shape, 1e30),
               np.full(ends.shape, np.nan)):
    other = jnp.where(given[..., None], ends, jnp.asarray(fill, jnp.float32))
    np.testing.assert_array_equal(np.asarray(f(pos, other, given)), ref)
  grad = np.asarray(jax.grad(lambda e: jnp.sum(f(pos, e, given) ** 2))(ends))
  assert np.all(grad[~given] == 0.0)
  assert np.abs(grad[given]).max() > 0
  # A given end site changes the output (of that example only).
  moved = np.asarray(f(pos, ends.at[3, 0].add(0.05), given))
  assert np.abs(moved[3] - ref[3]).max() > 1e-7
  np.testing.assert_array_equal(moved[:3], ref[:3])


def test_no_end_sites_equals_none_given(rig, forwards):
  pos, ends, _ = _inputs(rig)
  none = np.zeros(ends.shape[:2], bool)
  f = forwards['mixed_masked']
  model = model_lib.create_model(model_lib.ModelConfig(size='tiny', end_sites=True,
                                                       **_VARIANTS['mixed_masked']), rig,
                                 nnx.Rngs(0))
  plain = jax.jit(lambda p: model(p, deterministic=True))
  # Two compiled programs: equal up to float32 rounding, not bit for bit (ULP_TOL).
  np.testing.assert_allclose(np.asarray(plain(pos)), np.asarray(f(pos, ends, none)),
                             rtol=0, atol=ULP_TOL)


def test_config_default_off_and_refused(rig):
  old = model_lib.ModelConfig(size='base').to_dict()
  old.pop('end_sites')
  assert model_lib.ModelConfig.from_dict(old) == model_lib.ModelConfig(size='base')
  assert model_lib.ModelConfig(end_sites=True).input_features == 7
  model = model_lib.create_model(model_lib.ModelConfig(size='tiny'), rig, nnx.Rngs(0))
  with pytest.raises(ValueError, match='end sites'):
    model(np.zeros((1, rig.num_joints, 3)), deterministic=True,
          end_sites=np.zeros((1, len(rig.leaves), 3)))
  from ik_gat_jax import evaluation
  with pytest.raises(ValueError, match='end sites'):
    evaluation.check_sparse_support(evaluation.swing_method(rig), False, False, end_sites=True)


def _naive_end_sites(path, names, scale):
  """World End Sites of the named joints by a plain loop (scipy Euler), file frame order."""
  from scipy.spatial.transform import Rotation
  from ik_gat_jax.io import bvh
  motion = bvh.read_bvh(path)
  T = motion.num_frames
  G = np.zeros((T, len(motion.joints), 3, 3))
  p = np.zeros((T, len(motion.joints), 3))
  col = 0
  for j, joint in enumerate(motion.joints):
    t = np.tile(joint.offset, (T, 1)).astype(np.float64)
    rot_axes, rot_cols = '', []
    for ch in joint.channels:
      if ch.endswith('position'):
        t[:, 'XYZ'.index(ch[0])] = motion.motion[:, col]
      else:
        rot_axes += ch[0]
        rot_cols.append(col)
      col += 1
    R = (Rotation.from_euler(rot_axes.upper(), motion.motion[:, rot_cols], degrees=True)
         .as_matrix() if rot_axes else np.broadcast_to(np.eye(3), (T, 3, 3)))
    if joint.parent < 0:
      G[:, j], p[:, j] = R, t
    else:
      G[:, j] = G[:, joint.parent] @ R
      p[:, j] = p[:, joint.parent] + np.einsum('tab,tb->ta', G[:, joint.parent], t)
  idx = [motion.names.index(n) for n in names]
  ends = np.stack([p[:, j] + G[:, j] @ motion.joints[j].end_site for j in idx], axis=1)
  return scale * ends


def test_conversion_end_sites_match_independent_fk(cmu_shards, cmu_dir, rig):
  d = data_lib.load_shards(cmu_shards, 'train')
  assert d.end_sites is not None and d.end_sites.shape[1:] == (5, 3)
  f = next(f for f in d.files if f['file'] == '07_01.bvh')
  assert f['end_site_sources']['LeftHand'] == 'LeftHandIndex1 End Site'  # the finger, not thumb
  got = np.asarray(d.end_sites[f['start']:f['start'] + f['frames']])
  # cgspeed CMU: drop the T-pose frame, 120 -> 30 fps keeps every 4th; y-up, +z forward as rig.
  ref = _naive_end_sites(cmu_dir / '07_01.bvh', ['Head', 'LeftHandIndex1', 'RightHandIndex1',
                                                 'LeftToeBase', 'RightToeBase'], 0.056444)[1::4]
  assert got.shape == ref.shape
  np.testing.assert_allclose(got, ref, atol=2e-6)
  # End sites sit a plausible distance from their leaves (head top ~10 cm, tips 5-10 cm).
  dist = np.linalg.norm(got - np.asarray(d.positions[f['start']:f['start'] + f['frames']])[
      :, list(rig.leaves)], axis=-1)
  assert 0.03 < dist.min() and dist.max() < 0.15


def test_old_shard_directories_load(cmu_shards, tmp_path):
  old = tmp_path / 'old'
  shutil.copytree(cmu_shards, old)
  (old / 'end_sites.json').unlink()
  for split in ('train', 'val'):
    (old / split / 'end_sites.npy').unlink()
  d = data_lib.load_shards(old, 'train')
  assert d.end_sites is None
  batch = input_pipeline.gather_batch(d, np.arange(8))
  assert 'end_sites' not in batch
  with pytest.raises(ValueError, match='no end sites'):
    input_pipeline.gather_batch(d, np.arange(8), end_sites=True)
  with pytest.raises(ValueError, match='end_site_prob'):
    input_pipeline.augment(batch, jax.random.key(0), _aug(end_site_prob=0.5), d.rig)


def _aug(**kw):
  base = dict(yaw=False, mirror=0.0, bone_scale=0.0, noise_mm=0.0)
  return ml_collections.ConfigDict({**base, **kw})


def test_augmentation_mirror_swaps_left_right_end_sites(cmu_shards, rig):
  d = data_lib.load_shards(cmu_shards, 'val')
  batch = input_pipeline.gather_batch(d, np.arange(0, 64, 4), end_sites=True)
  m = input_pipeline.end_site_mirror(rig)
  assert [rig.joint_names[rig.leaves[i]] for i in m] == [
      'Head', 'RightHand', 'LeftHand', 'RightToeBase', 'LeftToeBase']
  M = np.eye(3) - 2 * np.outer(rig.lateral, rig.lateral)
  augment = lambda key, aug: jax.jit(
      lambda b, k: input_pipeline.augment(b, k, aug, rig))(batch, key)
  out = augment(jax.random.key(0), _aug(mirror=1.0, end_site_prob=1.0))
  np.testing.assert_allclose(np.asarray(out['end_sites']), batch['end_sites'][:, m] @ M.T,
                             atol=2e-6)
  assert np.asarray(out['end_site_mask']).all()


def test_solver_end_sites(rig, tmp_path):
  from experiments.configs import test as test_config
  from ik_gat_jax import checkpointing, train
  from ik_gat_jax.solver import IKSolver, InputError
  config = test_config.get_config()
  config.model.update(end_sites=True)
  model = inference.IKGAT_TASK.build(config, rig, nnx.Rngs(0), None)
  _, params, _, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
  checkpointing.Checkpointer(tmp_path / 'es', max_to_keep=1).save(
      0, {'params': params, 'rest': rest},
      train.checkpoint_meta(config, rig, inference.IKGAT_TASK, {}, {}))
  distill = test_config.get_config()  # a student of it cannot learn its mirror average
  distill.model.update(end_sites=True)
  distill.train.update(distill_mirror=True)
  with pytest.raises(ValueError, match=r'^train.distill_mirror: teacher .* takes orientations or '
                     r'end sites.* --config.train.distill_mirror=False$'):
    train.load_teacher(tmp_path / 'es', inference.IKGAT_TASK, distill, rig)
  solver = IKSolver.from_checkpoint(tmp_path / 'es')
  pos, ends, given = _inputs(rig)
  pos = np.asarray(pos) + np.asarray(rig.template())[None]  # plausible enough: no warnings
  ends = np.asarray(ends) + np.asarray(rig.template())[None, list(rig.leaves)]
  with_nan = np.where(given[..., None], ends, np.nan)
  a = solver.solve(pos, end_sites=with_nan, check=False)
  b = solver.solve(pos, end_sites=np.where(given[..., None], ends, np.inf), check=False)
  np.testing.assert_array_equal(a, b)  # absent (NaN) end sites are ignored
  none = solver.solve(pos, check=False)
  # Frame 0: nothing given. Two compiled programs, so float32 rounding apart (see above).
  np.testing.assert_allclose(a[0], none[0], rtol=0, atol=ULP_TOL)
  assert np.abs(a[3] - none[3]).max() > 10 * ULP_TOL
  with pytest.raises(InputError, match='end_sites must be'):
    solver.solve(pos, end_sites=ends[:, :3], check=False)
  plain_cfg = test_config.get_config()
  plain_model = inference.IKGAT_TASK.build(plain_cfg, rig, nnx.Rngs(0), None)
  _, params, _, rest = nnx.split(plain_model, nnx.Param, nnx.RngState, ...)
  checkpointing.Checkpointer(tmp_path / 'plain', max_to_keep=1).save(
      0, {'params': params, 'rest': rest},
      train.checkpoint_meta(plain_cfg, rig, inference.IKGAT_TASK, {}, {}))
  with pytest.raises(InputError, match='end sites'):
    IKSolver.from_checkpoint(tmp_path / 'plain').solve(pos, end_sites=ends, check=False)
