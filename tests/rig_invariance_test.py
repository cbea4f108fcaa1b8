"""Rig invariance (issue L; DESIGN section 3 "Rig invariance").

Re-rigging joint j by a fixed rotation A_j (new frame = old frame times A_j; offsets
`o'_j = A_parent^T o_j`; motion `R'_j = A_parent^T R_j A_j`, so every position is unchanged and
`G'_j = G_j A_j`) must leave the metrics, the floors and mirroring unchanged, and map the bone
frames to `B'_j = A_j^T B_j`. Real frames: CMU 07_12 on cmu_body, random binds for all 21 joints
(the root too), the rig's reference pose `F_j = A_j` (skeleton.Rig.reference_pose).

Tolerances. The pipeline runs in float32 (eps = 2**-23 = 1.19e-7). A rotation built through the
kinematic chain takes up to 8 products (cmu_body's depth 7, plus the bind), each adding at most
about 3 eps per entry, and the geodesic / swing-twist angle adds a few eps of its own; so two
float32 evaluations of the same angle on inputs that are equal in exact arithmetic differ by at
most ~(3 * 8 + 8) eps ~ 32 eps; the bound used is ANGLE_TOL = 128 eps = 1.5e-5 rad (a 4x
margin, 9e-4 degrees). Positions (metres, lever arms under 2 m): POS_TOL = 2 m * 32 eps ~ 1e-5
m. Float64 checks use 1e-9.
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from data_prep import conversion
from data_prep import rerig
from ik_gat_jax import bone_frames as bf
from ik_gat_jax import data
from ik_gat_jax import inference
from ik_gat_jax import input_pipeline
from ik_gat_jax import iterative_ik
from ik_gat_jax import kinematics
from ik_gat_jax import metrics
from ik_gat_jax import rotations
from ik_gat_jax import skeleton
from ik_gat_jax import train
from ik_gat_jax import vposer
from ik_gat_jax.io import bvh
from ik_gat_jax.io import retarget

EPS32 = float(np.finfo(np.float32).eps)
ANGLE_TOL = 128 * EPS32
POS_TOL = 1e-5
RIG = skeleton.cmu_body()
FINGERS = ('LeftFingerBase', 'LThumb', 'RightFingerBase', 'RThumb')
quiet = lambda message: None  # noqa: E731


def _random_rotations(n: int, seed: int) -> np.ndarray:
  q = np.random.default_rng(seed).normal(size=(n, 4))
  return skeleton.matrix_from_quat_np(q)


def _parent_binds(A: np.ndarray, rig: skeleton.Rig) -> np.ndarray:
  return np.stack([np.eye(3) if p < 0 else A[p] for p in rig.parents])


def rerig_rig(rig: skeleton.Rig, A: np.ndarray) -> skeleton.Rig:
  """The rig under binds A: template `A_p^T o`, reference pose `F_j = A_j` (rig's F = I)."""
  d = rig.to_json()
  Ap = _parent_binds(A, rig)
  tmpl = np.einsum('jba,jb->ja', Ap, rig.template())
  tmpl[0] = rig.template()[0]
  d.update(name=rig.name + '_rerig', template_offsets=tmpl.tolist(),
           reference_pose=skeleton.quat_from_matrix_np(A).tolist())
  return skeleton.Rig.from_json(d)


def rerig_local(local: np.ndarray, A: np.ndarray, rig: skeleton.Rig) -> np.ndarray:
  """`R'_j = A_p^T R_j A_j` (root: `R_root A_root`), `[..., J, 3, 3]`."""
  return np.einsum('jba,...jbc,jcd->...jad', _parent_binds(A, rig), local, A)


def rerig_offsets(offsets: np.ndarray, A: np.ndarray, rig: skeleton.Rig) -> np.ndarray:
  out = np.einsum('jba,...jb->...ja', _parent_binds(A, rig), offsets)
  out[..., 0, :] = offsets[..., 0, :]  # the root's offset is its world rest position
  return out


@pytest.fixture(scope='module')
def clip(cmu_dir):
  """07_12 on cmu_body at 30 fps (float64): local, positions, offsets."""
  jmap = retarget.load_joint_map('cmu_body')
  motion, _ = retarget.read_motion(cmu_dir / '07_12.bvh', jmap.drop_first_frame)
  _, out, _, p, _ = retarget.convert_motion(motion, jmap, np.eye(3), 30.0, RIG.joint_names,
                                            RIG.parents)
  return {'local': out.local_rot, 'positions': p, 'offsets': out.offsets}


@pytest.fixture(scope='module')
def binds():
  return _random_rotations(RIG.num_joints, seed=7)


@pytest.fixture(scope='module')
def rerigged(clip, binds):
  return {'rig': rerig_rig(RIG, binds), 'local': rerig_local(clip['local'], binds, RIG),
          'positions': clip['positions'], 'offsets': rerig_offsets(clip['offsets'], binds, RIG)}


def test_rerigging_keeps_positions_and_the_rig_stays_natural(clip, rerigged):
  rig2 = rerigged['rig']
  _, p = kinematics.forward_kinematics(jnp.asarray(rerigged['local']),
                                       jnp.asarray(rerigged['offsets']), rig2.parents,
                                       root_pos=jnp.asarray(clip['positions'][:, 0]))
  np.testing.assert_allclose(np.asarray(p), clip['positions'], atol=POS_TOL)
  # Same designated children, observability, co-location, reference-axis choice; its zero pose
  # is crumpled, its reference pose is cmu_body's T-pose.
  assert rig2.observability() == RIG.observability()
  assert rig2.colocated() == RIG.colocated()
  assert skeleton.choose_reference_axes(
      rig2.template(), rig2.parents, rig2.designated_children, rig2.up, rig2.forward,
      rig2.reference_rotations()) == RIG.reference_axes
  np.testing.assert_allclose(rig2.reference_positions(), RIG.reference_positions(), atol=1e-12)
  assert rig2.mirror_asymmetry()[0] == pytest.approx(RIG.mirror_asymmetry()[0], abs=1e-9)
  zero_pose = skeleton.Rig.from_json({**rig2.to_json(), 'reference_pose': []})
  assert zero_pose.mirror_asymmetry()[0] > 45


def test_bone_frames_follow_the_bind(clip, binds, rerigged):
  with jax.enable_x64(True):
    B = np.asarray(bf.bone_frames(jnp.asarray(clip['offsets']), RIG))
    B2 = np.asarray(bf.bone_frames(jnp.asarray(rerigged['offsets']), rerigged['rig']))
  np.testing.assert_allclose(B2, np.swapaxes(binds, -1, -2) @ B, atol=1e-9)
  np.testing.assert_allclose(bf.bone_frames_np(rerigged['offsets'], rerigged['rig']), B2,
                             atol=1e-12)
  # Found by this test: from the re-rigged zero pose instead, the non-leaf frames only turn
  # about their bone (x kept), but every leaf takes its parent's direction in a crumpled pose.
  zero_pose = skeleton.Rig.from_json({**rerigged['rig'].to_json(), 'reference_pose': []})
  B0 = bf.bone_frames_np(rerigged['offsets'], zero_pose)
  leaves = [j for j, c in enumerate(RIG.designated_children) if c < 0]
  others = [j for j in range(RIG.num_joints) if j not in leaves]
  np.testing.assert_allclose(B0[others, :, 0], B2[others, :, 0], atol=1e-9)
  assert np.abs(B0[leaves, :, 0] - B2[leaves, :, 0]).max() > 0.5


def _perturbed(local: np.ndarray, seed: int, degrees: float = 25.0) -> np.ndarray:
  """A stand-in prediction: every rotation turned by a random rotation of up to `degrees`."""
  rng = np.random.default_rng(seed)
  v = rng.normal(size=local.shape[:-2] + (3,))
  v *= np.radians(degrees) * rng.uniform(size=v.shape[:-1] + (1,)) / np.linalg.norm(v, axis=-1,
                                                                                     keepdims=True)
  with jax.enable_x64(True):
    E = np.asarray(rotations.matrix_from_axis_angle(jnp.asarray(v)))
  return local @ E


def _errors(local_pred, local_true, offsets, positions, rig):
  B = bf.bone_frames_np(offsets, rig)
  return metrics.compute_errors_batched(local_pred, local_true,
                                        np.broadcast_to(offsets, positions.shape),
                                        np.broadcast_to(B, local_true.shape), positions, rig)


def test_metrics_are_invariant(clip, binds, rerigged):
  pred = _perturbed(clip['local'], seed=1)
  e = _errors(pred, clip['local'], clip['offsets'], clip['positions'], RIG)
  e2 = _errors(rerig_local(pred, binds, RIG), rerigged['local'], rerigged['offsets'],
               clip['positions'], rerigged['rig'])
  for k in ('local', 'global', 'twist', 'swing'):
    np.testing.assert_allclose(e2[k], e[k], atol=ANGLE_TOL, err_msg=k)
  np.testing.assert_allclose(e2['position'], e['position'], atol=POS_TOL)
  s, s2 = metrics.summarize(e, RIG), metrics.summarize(e2, rerigged['rig'])
  for k in metrics.ERROR_FIELDS + ('root_rot_err_deg',):
    assert s2[k] == pytest.approx(s[k], abs=1e-3), k


def test_swing_ik_is_equivariant_and_scores_the_same(clip, binds, rerigged):
  with jax.enable_x64(True):
    R = np.asarray(iterative_ik.swing_ik(jnp.asarray(clip['positions']),
                                         jnp.asarray(clip['offsets']), RIG))
    R2 = np.asarray(iterative_ik.swing_ik(jnp.asarray(clip['positions']),
                                          jnp.asarray(rerigged['offsets']), rerigged['rig']))
  np.testing.assert_allclose(R2, rerig_local(R, binds, RIG), atol=1e-9)
  e = _errors(R, clip['local'], clip['offsets'], clip['positions'], RIG)
  e2 = _errors(R2, rerigged['local'], rerigged['offsets'], clip['positions'], rerigged['rig'])
  for k in ('local', 'global', 'twist', 'swing'):
    np.testing.assert_allclose(e2[k], e[k], atol=ANGLE_TOL, err_msg=k)
  # Found by this test: swinging from the re-rigged zero pose (what swing IK did) is another
  # method entirely: tens of degrees worse, in the twist above all.
  zero_pose = skeleton.Rig.from_json({**rerigged['rig'].to_json(), 'reference_pose': []})
  R0 = np.asarray(iterative_ik.swing_ik(jnp.asarray(clip['positions'], jnp.float32),
                                        jnp.asarray(rerigged['offsets'], jnp.float32),
                                        zero_pose))
  e0 = _errors(R0, rerigged['local'], rerigged['offsets'], clip['positions'], zero_pose)
  assert e0['twist'][:, 1:].mean() > e['twist'][:, 1:].mean() + np.radians(10)
  # Float32 (the evaluation's dtype) within the derived tolerance.
  R32 = np.asarray(iterative_ik.swing_ik(jnp.asarray(clip['positions'], jnp.float32),
                                         jnp.asarray(rerigged['offsets'], jnp.float32),
                                         rerigged['rig']))
  np.testing.assert_allclose(R32, R2, atol=ANGLE_TOL)


def test_mean_pose_is_equivariant(clip, binds, rerigged):
  m = np.asarray(iterative_ik.mean_pose(jnp.asarray(clip['local'], jnp.float32)))
  m2 = np.asarray(iterative_ik.mean_pose(jnp.asarray(rerigged['local'], jnp.float32)))
  np.testing.assert_allclose(m2, rerig_local(m, binds, RIG), atol=ANGLE_TOL)
  P = jnp.asarray(clip['positions'], jnp.float32)
  R = np.asarray(iterative_ik.mean_pose_ik(P, jnp.asarray(clip['offsets'], jnp.float32),
                                           jnp.asarray(m), RIG))
  R2 = np.asarray(iterative_ik.mean_pose_ik(P, jnp.asarray(rerigged['offsets'], jnp.float32),
                                            jnp.asarray(m2), rerigged['rig']))
  np.testing.assert_allclose(R2, rerig_local(R, binds, RIG), atol=ANGLE_TOL)


def _batch(local, positions, offsets, rig):
  n = len(local)
  off = np.broadcast_to(offsets, (n,) + offsets.shape)
  return {'positions': jnp.asarray(positions, jnp.float32),
          'local_rot': jnp.asarray(local, jnp.float32),
          'offsets': jnp.asarray(off, jnp.float32),
          'bone_frames': jnp.asarray(bf.bone_frames_np(off, rig), jnp.float32)}


def test_mirror_commutes_with_rerigging(clip, binds, rerigged):
  """Mirrored samples of a re-rigged subject equal the re-rigged mirrored samples of the
  original: the same positions, rotations and offsets related by the binds."""
  rig2 = rerigged['rig']
  flip = jnp.ones(len(clip['local']), bool)
  a = input_pipeline.mirror_batch(_batch(clip['local'], clip['positions'], clip['offsets'], RIG),
                                  flip, RIG)
  b = input_pipeline.mirror_batch(
      _batch(rerigged['local'], clip['positions'], rerigged['offsets'], rig2), flip, rig2)
  a = {k: np.asarray(v, np.float64) for k, v in a.items()}
  b = {k: np.asarray(v, np.float64) for k, v in b.items()}
  np.testing.assert_allclose(b['positions'], a['positions'], atol=POS_TOL)
  np.testing.assert_allclose(b['local_rot'], rerig_local(a['local_rot'], binds, RIG),
                             atol=ANGLE_TOL)
  np.testing.assert_allclose(b['offsets'][:, 1:], rerig_offsets(a['offsets'], binds, RIG)[:, 1:],
                             atol=POS_TOL)
  np.testing.assert_allclose(b['bone_frames'], np.swapaxes(binds, -1, -2) @ a['bone_frames'],
                             atol=ANGLE_TOL)
  # Each mirrored sample is consistent: FK of its rotations on its offsets gives its positions,
  # the mirror images of the original's with left and right swapped.
  for s, rig in ((a, RIG), (b, rig2)):
    _, p = kinematics.forward_kinematics(jnp.asarray(s['local_rot']), jnp.asarray(s['offsets']),
                                         rig.parents, root_pos=jnp.asarray(s['positions'][:, 0]))
    np.testing.assert_allclose(np.asarray(p), s['positions'], atol=POS_TOL)
  M = np.diag([-1.0, 1.0, 1.0])  # cmu_body: lateral = up x forward = +x
  np.testing.assert_allclose(a['positions'], clip['positions'][:, list(RIG.mirror)] @ M,
                             atol=POS_TOL)
  # Found by this test: the old rule, R'_j = M R_m(j) M, gives the re-rigged subject targets in
  # the partner's frame convention, tens of degrees from the right ones.
  old = M @ rerigged['local'][:, list(RIG.mirror)] @ M
  wrong = np.asarray(rotations.geodesic_angle(jnp.asarray(old), jnp.asarray(b['local_rot'])))
  assert np.degrees(wrong[:, 7:].mean()) > 20  # arms and legs


def test_mirrored_end_sites_follow_the_bind(clip, binds, rerigged):
  rng = np.random.default_rng(3)
  e = rng.normal(size=(4, len(RIG.leaves), 3))  # end sites in their leaf's frame
  A_leaf = binds[list(RIG.leaves)]
  e2 = np.einsum('jba,njb->nja', A_leaf, e)  # the same points under the bind: A^T e
  m = np.asarray(input_pipeline.mirror_end_local(jnp.asarray(e), RIG))
  m2 = np.asarray(input_pipeline.mirror_end_local(jnp.asarray(e2), rerigged['rig']))
  np.testing.assert_allclose(m2, np.einsum('jba,njb->nja', A_leaf, m), atol=1e-5)


def test_mirror_refuses_a_rig_whose_reference_pose_is_not_symmetric(rerigged):
  zero_pose = skeleton.Rig.from_json({**rerigged['rig'].to_json(), 'reference_pose': []})
  batch = {'positions': jnp.zeros((1, 21, 3)), 'local_rot': jnp.tile(jnp.eye(3), (1, 21, 1, 1)),
           'offsets': jnp.asarray(zero_pose.template()[None], jnp.float32),
           'bone_frames': jnp.tile(jnp.eye(3), (1, 21, 1, 1))}
  with pytest.raises(ValueError, match=r'not mirror-symmetric in its zero pose .* '
                     r'--config.augment.mirror=0'):
    input_pipeline.mirror_batch(batch, jnp.ones(1, bool), zero_pose)
  distill = ml_collections.ConfigDict(dict(train=dict(distill_mirror=True)))
  with pytest.raises(ValueError, match=r'^mirror averaging: rig .* not mirror-symmetric in its '
                     r'zero pose .* --config.train.distill_mirror=False$'):
    train.load_teacher('no/teacher/read', inference.IKGAT_TASK, distill, zero_pose)
  input_pipeline.check_mirror(rerigged['rig'])  # with its reference pose: fine
  input_pipeline.check_mirror(RIG)


# ----------------------------------------------------------------------------------------------
# The re-rig script and the conversion of its output.


@pytest.fixture(scope='module')
def rerig_dir(tmp_path_factory, cmu_dir):
  out = tmp_path_factory.mktemp('rerig')
  manifest = rerig.rerig_directory(cmu_dir, out, files=['07_12'], seed=0, log=quiet)
  return out, manifest


def test_rerig_script_round_trip(rerig_dir, cmu_dir, tmp_path):
  out, manifest = rerig_dir
  assert manifest['files'][0]['fk_max_error_m'] < rerig.FK_TOL_M
  m0, m1 = bvh.read_bvh(cmu_dir / '07_12.bvh'), bvh.read_bvh(out / '07_12.bvh')
  assert m1.names == ('Reference',) + m0.names
  assert {j.channels[-3:] for j in m1.joints} == {('Xrotation', 'Zrotation', 'Yrotation')}
  assert np.abs(m1.motion[:, :3]).max() == 0  # the dummy root never rotates
  np.testing.assert_allclose(bvh.naive_fk_np(m1, 0.01)[:, 1:], bvh.naive_fk_np(m0, 0.056444),
                             atol=1e-6)
  # Converted onto cmu_body's joints (the joint map it wrote) vs the original on cmu_body.
  conversion.convert(out / '07_12.bvh', str(out / rerig.JOINT_MAP), tmp_path / 'rr', log=quiet)
  src = tmp_path / 'src'
  src.mkdir()
  (src / '07_12.bvh').symlink_to(cmu_dir / '07_12.bvh')
  conversion.convert(src, 'cmu_body', tmp_path / 'cmu', log=quiet)
  a, b = data.load_shards(tmp_path / 'cmu', 'test'), data.load_shards(tmp_path / 'rr', 'test')
  A = skeleton.matrix_from_quat_np(np.asarray([manifest['binds_wxyz'][n]
                                               for n in RIG.joint_names]))
  np.testing.assert_allclose(b.positions, a.positions, atol=POS_TOL)
  np.testing.assert_allclose(b.local_rot, rerig_local(np.asarray(a.local_rot, np.float64), A, RIG),
                             atol=ANGLE_TOL)
  np.testing.assert_allclose(b.offsets[0, 1:], rerig_offsets(a.offsets[0], A, RIG)[1:],
                             atol=POS_TOL)
  np.testing.assert_allclose(b.bone_frames[0], np.swapaxes(A, -1, -2) @ a.bone_frames[0],
                             atol=ANGLE_TOL)
  assert b.rig.reference_axes == a.rig.reference_axes and b.rig.mirror == a.rig.mirror
  assert b.rig.mirror_asymmetry()[0] == pytest.approx(a.rig.mirror_asymmetry()[0], abs=1e-6)
  # Found by the round trip: the removed joints (LHipJoint, LeftShoulder, ...) no longer rotate
  # by identity but by the constant A_p^T A_j; the reduction must fold any constant rotation.
  R_lhip = bvh.euler_to_matrix_np(m1.rotation_degrees(m1.names.index('LHipJoint')), 'XZY')
  assert retarget.rotation_angles_deg(R_lhip[:1])[0] > 1.0


def test_rerigged_files_convert_with_rig_auto(rerig_dir, tmp_path):
  out, _ = rerig_dir
  summary = conversion.convert(out / '07_12.bvh', 'auto', tmp_path / 'auto', split='all',
                               units='auto', prune=FINGERS, drop_first_frame=True,
                               reference_pose='first_frame', rig_name='lab', log=quiet)
  ds = data.load_shards(tmp_path / 'auto', 'all')
  # Reference folded into the root, the constant joints removed, fingers pruned: 21 joints.
  assert sorted(ds.rig.joint_names) == sorted(skeleton.CMU_BODY_JOINTS)
  assert summary['fk_max_error_m'] < 1e-5 and summary['runs'][-1]['units_m'] == 0.01
  assert ds.rig.has_reference_pose and ds.rig.mirror_asymmetry()[0] < 15


def test_rerig_in_blenders_world_converts_to_the_same_shards(rerig_dir, tmp_path, cmu_dir):
  """`--up=z --forward=-y`: the same files turned into a z-up world facing -y (every joint at
  V p); converted with the joint map it writes (or --rig=auto with those axes), the shards are
  the y-up files' to float64 round-off of the text; --rig=auto without them warns."""
  out, _ = rerig_dir
  z = tmp_path / 'z'
  manifest = rerig.rerig_directory(cmu_dir, z, files=['07_12'], seed=0, up='z', forward='-y',
                                   log=quiet)
  assert manifest['files'][0]['fk_max_error_m'] < rerig.FK_TOL_M
  V = rerig.world('z', '-y')
  m_y, m_z = bvh.read_bvh(out / '07_12.bvh'), bvh.read_bvh(z / '07_12.bvh')
  np.testing.assert_allclose(bvh.naive_fk_np(m_z, 0.01), bvh.naive_fk_np(m_y, 0.01) @ V.T,
                             atol=1e-6)
  for rig, kw in (('map', {}), ('auto', dict(units='auto', prune=FINGERS, drop_first_frame=True,
                                            reference_pose='first_frame', split='all'))):
    spec = (lambda d: str(d / rerig.JOINT_MAP)) if rig == 'map' else (lambda d: 'auto')
    for name, src, axes in (('y', out, {}), ('z', z, dict(up='z', forward='-y'))):
      conversion.convert(src / '07_12.bvh', spec(src), tmp_path / f'{rig}_{name}', log=quiet,
                         **kw, **axes)
    split = 'test' if rig == 'map' else 'all'
    a = data.load_shards(tmp_path / f'{rig}_y', split)
    b = data.load_shards(tmp_path / f'{rig}_z', split)
    np.testing.assert_allclose(b.positions, a.positions, atol=POS_TOL)
    np.testing.assert_allclose(b.local_rot, a.local_rot, atol=ANGLE_TOL)
    np.testing.assert_allclose(b.offsets, a.offsets, atol=POS_TOL)
  lines = []
  conversion.convert(z / '07_12.bvh', 'auto', tmp_path / 'auto_z_as_y', log=lines.append,
                     units='auto', prune=FINGERS, drop_first_frame=True,
                     reference_pose='first_frame', split='all')
  assert any(ln.startswith('WARNING') and "files' z axis" in ln for ln in lines), lines


@pytest.mark.parametrize('space', ['mixed', 'local'])
def test_bone_chart_targets_are_the_same_on_every_rig(clip, rerigged, space):
  """`ModelConfig.bone_chart`: the network's targets (hence what it must learn, and what its
  identity start means) are identical for the original and the re-rigged subject; the plain
  joint chart is not (found by this test: the default mixed leaves differ by up to ~180 deg).
  Round trip to_local(from_local(R)) = R in both charts."""
  from ik_gat_jax import model as model_lib
  with jax.enable_x64(True):
    out = {}
    for name, d, rig in (('orig', clip, RIG), ('rerig', rerigged, rerigged['rig'])):
      R = jnp.asarray(d['local'][:16])
      B = bf.bone_frames(jnp.asarray(d['offsets']), rig)[None]
      for chart in (False, True):
        T = model_lib.from_local(R, B, rig, space, bone_chart=chart)
        np.testing.assert_allclose(np.asarray(model_lib.to_local(T, B, rig, space, chart)),
                                   np.asarray(R), atol=1e-9)
        out[name, chart] = np.asarray(T)
  np.testing.assert_allclose(out['rerig', True], out['orig', True], atol=1e-9)
  leaves = [j for j, c in enumerate(RIG.designated_children) if c < 0]
  assert np.abs(out['rerig', False][:, leaves] - out['orig', False][:, leaves]).max() > 0.5


# ----------------------------------------------------------------------------------------------
# The iterative solvers and the pose prior in the bone-frame chart.
#
# Tolerance. Adam's step per coordinate is `lr m / (sqrt(v) + eps_adam)`, whose sensitivity to
# the gradient is at most `lr / eps_adam` (reached at a zero gradient: an unobserved twist, a
# redundant 6D direction). The two rigs' gradients are equal in exact arithmetic and differ by
# round-off `dg <= n eps G` (n = 64 operations deep, FK chain + chart + decoder; G the largest
# gradient entry, < 200 here: 2 w_data x 9 joints x position errors and lever arms under 1 m), so
# k iterations move the solutions apart by about `k lr n eps G / eps_adam` at most (the steps'
# perturbations added up; matrix entries): 10 iterations, float64: 2.8e-8 (measured 7e-13). In
# float32 the same bound is 15, nothing: Adam turns round-off in the directions the positions
# cannot see into steps of up to lr, which is why these checks run in float64. Measured in
# float32 on all 21 joints, 4 frames: at most 5e-3 rad after 10 iterations, 2e-2 after 100 with
# `adam_eps` 1e-4 (the mean error of 60 frames agrees to 0.002 deg); 0.7 rad after 10 with
# Adam's usual 1e-8 (iterative_ik.SolverConfig). Found by this test: the joint chart
# (`SolverConfig(bone_chart=False)`, the solver before issue L) ends 0.55 apart after 10
# iterations, in float64 too; a joint-chart prior's latent solve 2.0.

LEGS = ('Hips', 'LeftUpLeg', 'LeftLeg', 'LeftFoot', 'LeftToeBase', 'RightUpLeg', 'RightLeg',
        'RightFoot', 'RightToeBase')
SOLVER = iterative_ik.SolverConfig(iters=10)
SOLVER_TOL = SOLVER.iters * SOLVER.lr * 64 * float(np.finfo(np.float64).eps) * 200 / SOLVER.adam_eps


@pytest.fixture(scope='module')
def legs(clip):
  """cmu_body's hips and legs (a determined root, swing joints, leaves) on 3 frames of 07_12,
  as they are and under random binds, float64: the solvers compile in half the time of all 21
  joints."""
  idx = [RIG.index(n) for n in LEGS]
  parents = tuple(-1 if RIG.parents[j] < 0 else idx.index(RIG.parents[j]) for j in idx)
  rig = skeleton.make_rig('cmu_legs', LEGS, parents, RIG.template()[idx], up=RIG.up,
                          forward=RIG.forward)
  A = _random_rotations(rig.num_joints, seed=11)
  frames = [5, 25, 45]
  local = clip['local'][frames][:, idx]
  positions, offsets = clip['positions'][frames][:, idx], clip['offsets'][idx]
  return {'rig': rig, 'binds': A, 'positions': positions,
          'orig': {'rig': rig, 'local': local, 'offsets': offsets},
          'rerig': {'rig': rerig_rig(rig, A), 'local': rerig_local(local, A, rig),
                    'offsets': rerig_offsets(offsets, A, rig)}}


def _local_errors(R, case):
  return np.asarray(rotations.geodesic_angle(jnp.asarray(R), jnp.asarray(case['local'])))


def _check_same_solution(legs, solve):
  """`solve(positions, offsets, rig) -> local` on both rigs, float64: the re-rigged solution is
  the original's under the binds, and every joint's error is the same."""
  with jax.enable_x64(True):
    P = jnp.asarray(legs['positions'])
    R, R2 = (np.asarray(solve(P, jnp.asarray(c['offsets']), c['rig']))
             for c in (legs['orig'], legs['rerig']))
    apart = np.abs(R2 - rerig_local(R, legs['binds'], legs['rig'])).max()
    assert apart < SOLVER_TOL, apart
    np.testing.assert_allclose(_local_errors(R2, legs['rerig']), _local_errors(R, legs['orig']),
                               atol=SOLVER_TOL)


def test_rotation_solver_takes_the_same_path_on_every_rig(legs):
  """Iterative IK without a prior optimises the 6D of the bone-frame chart: the same start, the
  same loss as a function of its parameters, so Adam's path and the solution are the same."""
  _check_same_solution(legs, lambda p, o, rig: iterative_ik.solve_rotations_jit(
      p, o, rig, SOLVER)[0])


def _chart_prior(rig, bone_chart=True):
  """An untrained prior (latent 8, width 32; std 0.5 so its poses are not all near the mean)."""
  config = vposer.VAEConfig(latent=8, hidden=32, bone_chart=bone_chart)
  return vposer.PosePrior(config, rig.num_joints, parents=rig.parents,
                          input_std=(0.5,) * (6 * (rig.num_joints - 1)), rngs=nnx.Rngs(0))


def test_bone_chart_prior_is_the_same_on_every_rig(clip, binds, rerigged):
  """`VAEConfig.bone_chart`: the training data in the prior's chart (hence its standardisation
  and learned distribution) are identical on both rigs, encoding gives the same latent, and one z
  decodes to poses related exactly by the binds (float64: 1e-9). Found by this test: a
  joint-chart prior (the shipped one) encodes the same motion on the two rigs to different
  latents."""
  prior, joint_prior = _chart_prior(RIG), _chart_prior(RIG, bone_chart=False)

  @functools.partial(jax.jit, static_argnums=3)  # op by op, the per-joint chart compiles slowly
  def one_rig(R, offsets, z, rig):
    B = bf.bone_frames(offsets, rig)
    return {'L': vposer.to_bone_chart(R, B, rig.parents), 'mu': prior.encode(R, B)[0],
            'mu_joint': joint_prior.encode(R)[0], 'decoded': prior.decode(z, B)}

  with jax.enable_x64(True):
    z = jax.random.normal(jax.random.key(0), (5, 8), jnp.float64)
    a, b = (jax.tree.map(np.asarray, one_rig(jnp.asarray(d['local'][::4]),
                                             jnp.asarray(d['offsets']), z, rig))
            for d, rig in ((clip, RIG), (rerigged, rerigged['rig'])))
  np.testing.assert_allclose(vposer.standardization_stats(b['L']),
                             vposer.standardization_stats(a['L']), atol=1e-9)
  np.testing.assert_allclose(b['mu'], a['mu'], atol=1e-9)
  full = lambda D: np.concatenate([np.broadcast_to(np.eye(3), D.shape[:1] + (1, 3, 3)), D], 1)
  np.testing.assert_allclose(b['decoded'], rerig_local(full(a['decoded']), binds, RIG)[:, 1:],
                             atol=1e-9)
  assert np.abs(b['mu_joint'] - a['mu_joint']).max() > 0.1


def test_latent_solver_takes_the_same_path_on_every_rig(legs):
  """Iterative IK with a bone-chart prior: the decoder's rotations and the root in the chart, so
  the latent solve is the same on both rigs (the prior's weights are the same: a bone-chart
  prior does not depend on the bind)."""
  decode, params = vposer.decoder(_chart_prior(legs['rig']))
  assert decode.bone_chart
  _check_same_solution(legs, lambda p, o, rig: iterative_ik.solve_latent_jit(
      p, o, decode, params, rig, SOLVER, latent_dim=8)[0])


def test_refinement_with_a_bone_chart_prior_takes_the_same_path_on_every_rig(legs):
  """The refinement with a pose prior (issue J): its start (swing IK, equivariant) and loss (the
  anchor in the solvers' chart, the prior term a Frobenius distance to a bone-chart decoding)
  are the same on both rigs, so is its solution. 20 mm of noise makes the prior term count."""
  decode, params = vposer.decoder(_chart_prior(legs['rig']))
  noise = 0.02 * np.random.default_rng(3).normal(size=np.shape(legs['positions']))
  config = iterative_ik.refine_config(SOLVER.iters, prior=True)

  def solve(p, o, rig):
    p = p + noise
    init = iterative_ik.swing_ik(p, o, rig)
    return iterative_ik.refine_rotations(init, p, o, rig, config, decode, params)[0]

  _check_same_solution(legs, jax.jit(solve, static_argnums=2))


# ----------------------------------------------------------------------------------------------
# Test-time mirror averaging (inference.ikgat_infer(mirror=True)).


def test_unmirror_inverts_mirror_on_every_rig(clip, rerigged):
  """`unmirror_local` undoes `mirror_local`, and mirroring the mirror-image body's offsets gives
  the body back, on cmu_body and under random binds (where the changes of frame C are not I)."""
  for local, offsets, rig in ((clip['local'], clip['offsets'], RIG),
                              (rerigged['local'], rerigged['offsets'], rerigged['rig'])):
    R = jnp.asarray(local, jnp.float32)
    mirrored = input_pipeline.mirror_local(R, rig)
    assert np.abs(np.asarray(mirrored) - local).max() > 0.5  # a real change
    np.testing.assert_allclose(np.asarray(input_pipeline.unmirror_local(mirrored, rig)), local,
                               atol=ANGLE_TOL)
    o = jnp.asarray(offsets, jnp.float32)
    twice = input_pipeline.mirror_offsets(input_pipeline.mirror_offsets(o, rig), rig)
    np.testing.assert_allclose(np.asarray(twice), offsets, atol=POS_TOL)


@functools.lru_cache(maxsize=None)
def _mirror_solver(rig):
  """A random tiny IK-GAT (not mirror-equivariant by itself) as `(positions, offsets, mirror)
  -> local rotations`."""
  from ik_gat_jax import inference
  from ik_gat_jax import model as model_lib
  model = model_lib.create_model(model_lib.ModelConfig(size='tiny'), rig, nnx.Rngs(0))

  def solve(p, o, mirror):
    batch = {'positions': p, 'offsets': o, 'bone_frames': bf.bone_frames(o, rig)}
    return inference.ikgat_infer(model, batch, mirror=mirror)
  return jax.jit(solve, static_argnums=2)


def test_mirror_averaging_is_mirror_equivariant_on_every_rig(clip, rerigged):
  """With mirror averaging the solution of the mirror-image input (`mirror_positions`, the
  mirror-image body's offsets) is the mirror image (`mirror_local`) of the solution, whatever
  the network learned: here a random tiny network, which without it is tens of degrees off.
  Tolerance: the two solutions run the same float32 products on inputs permuted and reflected
  (exact), and on rest offsets mirrored through C (a few eps); 1e-4 per rotation entry bounds
  their round-off through a small network with a wide margin, while a broken map is off by
  ~0.1-1."""
  frames = clip['positions'][::max(1, len(clip['positions']) // 16)][:16]
  noise = 0.01 * np.random.default_rng(5).normal(size=frames.shape)
  for offsets, rig in ((clip['offsets'], RIG), (rerigged['offsets'], rerigged['rig'])):
    solve = _mirror_solver(rig)
    P = jnp.asarray(frames + noise, jnp.float32)
    O = jnp.asarray(offsets, jnp.float32)[None]
    Pm = input_pipeline.mirror_positions(P, rig)
    Om = input_pipeline.mirror_offsets(O, rig)
    for mirror in (True, False):
      a = input_pipeline.mirror_local(solve(P, O, mirror), rig)
      b = solve(Pm, Om, mirror)
      gap = np.abs(np.asarray(a) - np.asarray(b)).max()
      if mirror:
        assert gap < 1e-4, (rig.name, gap)
      else:
        assert gap > 0.05, (rig.name, gap)  # the network alone is not equivariant


def test_mirror_averaging_refuses_what_it_cannot_mirror(rerigged):
  from ik_gat_jax import inference
  zero_pose = skeleton.Rig.from_json({**rerigged['rig'].to_json(), 'reference_pose': []})
  inputs = {'positions': jnp.zeros((1, 21, 3)), 'bone_frames': jnp.tile(jnp.eye(3), (1, 21, 1, 1))}
  offsets = jnp.asarray(zero_pose.template()[None], jnp.float32)
  with pytest.raises(ValueError, match=r'mirror averaging: .* not mirror-symmetric .* '
                     r'turn it off'):
    inference.mirror_inputs(inputs, offsets, zero_pose)
  with pytest.raises(ValueError, match='not orientation_mask, orientations: turn it off'):
    inference.mirror_inputs({**inputs, 'orientations': jnp.zeros((1, 1, 3, 3)),
                             'orientation_mask': jnp.ones((1, 1), bool)}, offsets, RIG)
