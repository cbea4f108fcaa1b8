"""Tracker noise model (issue J, input_pipeline.tracker_noise): each part's drawn statistics on
4096 synthetic frames, each part off = exactly clean, one key per part, draws a function of the
key, the targets untouched by `augment`, the old fixed noise_mm unchanged, old configs (without
the keys) meaning off. Every configuration is compiled once per module (fixtures).

Tolerances are derived from the sample size N = 4096 (and J = 21 joints, 3 coordinates): a
statistic is allowed 5 of its standard errors (a false failure ~1 in 10^6 per check), a
Kolmogorov-Smirnov distance its 0.001 critical value 1.95 / sqrt(n).
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from scipy.spatial.transform import Rotation as SciRot

from ik_gat_jax import bone_frames, input_pipeline, kinematics, model, skeleton

RIG = skeleton.cmu_body()
J = RIG.num_joints
N = 4096
KEY = jax.random.fold_in(jax.random.key(0), 11)
PARTS = dict(noise_mm_max=50.0, clean_frac=0.2, bone_jitter=0.02, outlier_prob=0.05)
# One noise configuration per name; each compiled once (`noised`).
CONFIGS = {
    'off': {},
    'sigma': dict(noise_mm_max=50.0),
    'bone': dict(bone_jitter=0.02),
    'outlier': dict(outlier_prob=0.05),
    'no_clean': dict(noise_mm_max=50.0, bone_jitter=0.02, outlier_prob=0.05),
    'all': PARTS,
}
# Bones that have a length: not co-located with their parent (CMU LowerBack, Neck).
BONES = np.asarray(model._scale_bones(RIG))
PARENTS = np.asarray(RIG.parents)


def _clean_frames(n, seed=0):
  """`(positions [n, J, 3], end sites [n, E, 3] with some NaN)`: FK of random local rotations
  on per-sample scaled templates, moved about."""
  rng = np.random.default_rng(seed)
  local = SciRot.from_rotvec(rng.normal(scale=0.4, size=(n * J, 3))).as_matrix()
  local = jnp.asarray(local.reshape(n, J, 3, 3), jnp.float32)
  off = RIG.template()[None] * rng.uniform(0.9, 1.1, size=(n, 1, 1))
  _, pos = kinematics.forward_kinematics(local, jnp.asarray(off, jnp.float32), RIG.parents,
                                         jnp.asarray(rng.normal(size=(n, 3)), jnp.float32))
  leaves = list(RIG.leaves)
  ends = np.asarray(pos)[:, leaves] + rng.normal(scale=0.06, size=(n, len(leaves), 3))
  ends[::7, 0] = np.nan  # some absent end sites
  return pos, jnp.asarray(ends, jnp.float32)


def _aug(**kw):
  return ml_collections.ConfigDict(kw)


@pytest.fixture(scope='module')
def frames():
  return _clean_frames(N)


@pytest.fixture(scope='module')
def noised(frames):
  """{config name: (input positions, input end sites, info) as numpy} for KEY, and a second
  call per name with the same key and with another key: {name + '@same' / '@other': ...}."""
  pos, ends = frames
  out = {}
  for name, kw in CONFIGS.items():
    aug = _aug(**kw)
    f = jax.jit(lambda k, aug=aug: input_pipeline.tracker_noise(k, pos, aug, RIG, ends,
                                                                 return_info=True))
    for tag, key in (('', KEY), ('@same', KEY), ('@other', jax.random.fold_in(KEY, 1))):
      x, e, info = f(key)
      out[name + tag] = (np.asarray(x), np.asarray(e), {k: np.asarray(v) for k, v in info.items()})
  return out


def _ks_uniform(u, lo, hi):
  """Kolmogorov-Smirnov distance of samples `u` from U[lo, hi]."""
  u = np.sort((np.asarray(u) - lo) / (hi - lo))
  n = len(u)
  return max(np.max(np.arange(1, n + 1) / n - u), np.max(u - np.arange(n) / n))


def test_default_config_has_the_keys_off():
  from experiments.configs import default
  aug = default.get_config().augment
  for k in PARTS:
    assert aug[k] == 0.0, k
  x, _ = _clean_frames(8)
  same, _, info = input_pipeline.tracker_noise(KEY, x, aug, RIG)
  assert same is x and info == {}


def test_each_part_off_leaves_the_input_exactly_clean(frames, noised):
  pos, ends = np.asarray(frames[0]), np.asarray(frames[1])
  x, e, info = noised['off']
  np.testing.assert_array_equal(x, pos)
  np.testing.assert_array_equal(e, ends)
  assert info == {}
  # A configuration without the keys at all (an old checkpoint's) is the same identity.
  old = ml_collections.ConfigDict(dict(yaw=True, mirror=0.5, bone_scale=0.07, noise_mm=0.0))
  same, same_e, _ = input_pipeline.tracker_noise(KEY, frames[0], old, RIG, frames[1])
  assert same is frames[0] and same_e is frames[1]


def test_sigma_is_uniform_per_sample(noised):
  sigma = noised['sigma'][2]['sigma_mm']
  assert sigma.shape == (N,) and sigma.min() >= 0 and sigma.max() <= 50
  se = 50 / np.sqrt(12) / np.sqrt(N)  # standard error of the mean of U[0, 50]
  assert abs(sigma.mean() - 25) < 5 * se, sigma.mean()
  assert _ks_uniform(sigma, 0, 50) < 1.95 / np.sqrt(N)
  np.testing.assert_allclose(np.quantile(sigma, [0.1, 0.5, 0.9]), [5, 25, 45], atol=2.5)


def test_per_coordinate_std_matches_sigma(frames, noised):
  pos, ends = np.asarray(frames[0]), np.asarray(frames[1])
  x, e, info = noised['sigma']
  sigma = info['sigma_mm']
  r = (x - pos) * 1e3  # mm
  z = r / sigma[:, None, None]
  n = z.size
  assert abs(z.mean()) < 5 / np.sqrt(n)
  assert abs(z.std() - 1) < 5 / np.sqrt(2 * n), z.std()  # SE of a std: 1 / sqrt(2n)
  # Per level: samples in sigma bins; the per-coordinate std there is the bin's RMS sigma.
  edges = np.quantile(sigma, np.linspace(0, 1, 6))
  for lo, hi in zip(edges[:-1], edges[1:]):
    sel = (sigma >= lo) & (sigma < hi)
    want = np.sqrt(np.mean(sigma[sel] ** 2))
    got = np.sqrt(np.mean(r[sel] ** 2))
    assert abs(got / want - 1) < 5 / np.sqrt(2 * r[sel].size) + 1e-3, (lo, hi, got, want)
  # End sites: the same sample's level; absent ones stay NaN.
  present = np.isfinite(ends).all(-1)
  np.testing.assert_array_equal(np.isfinite(e).all(-1), present)
  ze = ((e - ends) * 1e3 / sigma[:, None, None])[present]
  assert abs(ze.std() - 1) < 5 / np.sqrt(2 * ze.size)


def test_clean_fraction_and_clean_samples_are_exact(frames, noised):
  pos = np.asarray(frames[0])
  x, e, info = noised['all']  # every part on: clean samples are clean of all of them
  clean = info['clean']
  se = np.sqrt(0.2 * 0.8 / N)
  assert abs(clean.mean() - 0.2) < 5 * se, clean.mean()
  np.testing.assert_array_equal(x[clean], pos[clean])
  np.testing.assert_array_equal(e[clean], np.asarray(frames[1])[clean])
  assert (info['sigma_mm'][clean] == 0).all() and (info['outlier_joint'][clean] == -1).all()
  dirty = info['sigma_mm'][~clean]
  assert _ks_uniform(dirty, 0, 50) < 1.95 / np.sqrt(len(dirty))
  assert (np.abs(x[~clean] - pos[~clean]).max(axis=(1, 2)) > 0).all()


def test_bone_length_ratios_have_the_configured_std(frames, noised):
  pos, ends = np.asarray(frames[0]), np.asarray(frames[1])
  x, e, info = noised['bone']
  np.testing.assert_array_equal(x[:, 0], pos[:, 0])  # the root stays
  b_in = x[:, BONES] - x[:, PARENTS[BONES]]
  b_clean = pos[:, BONES] - pos[:, PARENTS[BONES]]
  ratio = np.linalg.norm(b_in, axis=-1) / np.linalg.norm(b_clean, axis=-1)
  n = ratio.size
  assert abs(ratio.mean() - 1) < 5 * 0.02 / np.sqrt(n)
  assert abs(ratio.std() / 0.02 - 1) < 5 / np.sqrt(2 * n), ratio.std()
  np.testing.assert_allclose(ratio, info['bone_factor'][:, BONES], atol=1e-4)
  # Directions kept: every input bone is parallel to its clean bone.
  norm = lambda v: np.linalg.norm(v, axis=-1)
  cos = np.sum(b_in * b_clean, -1) / norm(b_in) / norm(b_clean)
  assert cos.min() > 1 - 1e-5
  # Co-located joints stay co-located (a zero bone times any factor is zero).
  coloc = np.flatnonzero(RIG.colocated())
  np.testing.assert_allclose(x[:, coloc], x[:, PARENTS[coloc]], atol=1e-6)
  # End sites: their own factors on the vector from the (jittered) leaf.
  leaves = list(RIG.leaves)
  present = np.isfinite(ends).all(-1)
  r_end = norm(e - x[:, leaves]) / norm(ends - pos[:, leaves])
  np.testing.assert_allclose(r_end[present], info['end_site_factor'][present], atol=1e-4)
  assert abs(r_end[present].std() / 0.02 - 1) < 5 / np.sqrt(2 * present.sum())


def test_outliers_one_joint_with_magnitude_in_range(frames, noised):
  pos = np.asarray(frames[0])
  x, e, info = noised['outlier']
  np.testing.assert_array_equal(e, np.asarray(frames[1]))  # end sites get no outliers
  moved = np.linalg.norm(x - pos, axis=-1) * 1e3  # [N, J] mm
  count = (moved > 0).sum(-1)
  assert count.max() == 1
  hit = count == 1
  assert abs(hit.mean() - 0.05) < 5 * np.sqrt(0.05 * 0.95 / N), hit.mean()
  np.testing.assert_array_equal(np.where(hit, moved.argmax(-1), -1), info['outlier_joint'])
  mag = moved.max(-1)[hit]
  assert mag.min() >= 50 - 1e-2 and mag.max() <= 200 + 1e-2
  np.testing.assert_allclose(mag, info['outlier_mm'][hit], atol=1e-2)
  se = 150 / np.sqrt(12) / np.sqrt(hit.sum())
  assert abs(mag.mean() - 125) < 5 * se
  assert len(set(info['outlier_joint'][hit])) > J // 2  # spread over the joints
  d = (x - pos)[hit, moved.argmax(-1)[hit]]
  d /= np.linalg.norm(d, axis=-1, keepdims=True)
  assert np.abs(d.mean(0)).max() < 5 * np.sqrt(1 / (3 * hit.sum()))  # no preferred direction


def test_one_key_per_part(noised):
  """Switching a part on leaves the other parts' draws exactly as they were."""
  alone = {k: noised[n][2][k] for k, n in (('sigma_mm', 'sigma'), ('bone_factor', 'bone'),
                                         ('outlier_joint', 'outlier'), ('outlier_mm', 'outlier'))}
  together = noised['no_clean'][2]
  for k, v in alone.items():
    np.testing.assert_array_equal(together[k], v, err_msg=k)
  # clean_frac only zeroes the clean samples' draws.
  full = noised['all'][2]
  clean = full['clean']
  np.testing.assert_array_equal(full['sigma_mm'], np.where(clean, 0.0, alone['sigma_mm']))
  np.testing.assert_array_equal(full['outlier_joint'],
                                np.where(clean, -1, alone['outlier_joint']))
  np.testing.assert_array_equal(full['bone_factor'], alone['bone_factor'])


def test_draws_are_a_function_of_the_key(noised):
  for name in CONFIGS:
    if name == 'off':
      continue
    np.testing.assert_array_equal(noised[name][0], noised[name + '@same'][0])
    assert not np.array_equal(noised[name][0], noised[name + '@other'][0]), name


def test_bad_values_are_refused(frames):
  for kw in (dict(clean_frac=1.5), dict(outlier_prob=-0.1), dict(bone_jitter=-0.01),
             dict(noise_mm_max=-1.0)):
    with pytest.raises(ValueError, match=next(iter(kw))):
      input_pipeline.tracker_noise(KEY, frames[0], _aug(**kw), RIG)


def _batch(n=256, seed=3):
  rng = np.random.default_rng(seed)
  off = (RIG.template()[None] * rng.uniform(0.9, 1.1, size=(n, 1, 1))).astype(np.float32)
  R = SciRot.from_rotvec(rng.normal(scale=0.4, size=(n * J, 3))).as_matrix()
  R = R.reshape(n, J, 3, 3).astype(np.float32)
  _, pos = kinematics.forward_kinematics(jnp.asarray(R), jnp.asarray(off), RIG.parents,
                                         jnp.asarray(rng.normal(size=(n, 3)), jnp.float32))
  return {'positions': np.asarray(pos), 'local_rot': R, 'offsets': off,
          'bone_frames': np.asarray(bone_frames.bone_frames(off, RIG))}


def test_augment_noises_inputs_only_and_keeps_the_old_noise(frames):
  batch = _batch()
  old = dict(yaw=True, mirror=0.5, bone_scale=0.07)  # an old checkpoint's keys: no new ones
  run = lambda aug: jax.tree.map(np.asarray, jax.jit(
      lambda k: input_pipeline.augment(batch, k, ml_collections.ConfigDict(aug), RIG))(KEY))
  plain = run({**old, 'noise_mm': 0.0})
  fixed = run({**old, 'noise_mm': 10.0})
  noisy = run({**old, 'noise_mm': 0.0, **PARTS})
  both = run({**old, 'noise_mm': 10.0, **PARTS})
  np.testing.assert_array_equal(plain['input_positions'], plain['positions'])
  for out in (fixed, noisy, both):  # the targets and the subject never change
    assert set(out) == set(plain)
    for k in ('positions', 'local_rot', 'offsets', 'bone_frames'):
      np.testing.assert_array_equal(out[k], plain[k], err_msg=k)
  # The fixed noise_mm draws exactly what it drew before issue J (key split(key, 4)[3]).
  k_noise = jax.random.split(KEY, 4)[3]
  want = plain['positions'] + 1e-3 * 10.0 * np.asarray(
      jax.random.normal(k_noise, plain['positions'].shape))
  np.testing.assert_allclose(fixed['input_positions'], want, atol=1e-6)
  # Both set: the tracker noise, plus the same fixed draw on top.
  assert not np.array_equal(noisy['input_positions'], plain['positions'])
  np.testing.assert_allclose(both['input_positions'] - noisy['input_positions'],
                             fixed['input_positions'] - plain['positions'], atol=1e-6)
