"""AMASS -> shards on a synthetic body model and synthetic AMASS-like files (no licensed data).

The synthetic model regresses every joint j from vertices skinned 100% to j's parent bone (the
root: to the root), with regressor weights summing to 1, so their weighted mean is the rest
joint J_j. A vertex skinned to bone k moves as `v -> p_k + G_k (v - J_k)`, and the parent's
bone carries J_j to FK's `p_j`, so `J_regressor @ LBS(mesh)` equals the FK joints exactly: the
converter's FK is checked against the model's own joint regression. (Real SMPL regressors
average vertices that blend several bones with varying weights: a gap of millimetres to
centimetres, which `test_the_regression_check_has_teeth` imitates.)
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from data_prep import amass
from ik_gat_jax import data
from ik_gat_jax import skeleton
from ik_gat_jax.errors import ConversionError
from ik_gat_jax.io import smpl as smpl_lib
from ik_gat_jax.provenance import file_sha256

REPO = Path(__file__).resolve().parents[1]
PARENTS24 = skeleton.SMPL22_PARENTS + (20, 21)  # SMPL: the hands hang from the wrists
quiet = lambda message: None  # noqa: E731


def make_body_model(path: Path, seed: int = 0, per_joint: int = 6, loose: int = 60,
                    blend: bool = False, parents: tuple = PARENTS24) -> Path:
  """A small SMPL-like model npz: 24 joints, ~200 vertices, 16 shape directions, weights;
  `blend`: joint j's regressor vertices blend j's bone and its parent's, varying per vertex."""
  rng = np.random.default_rng(seed)
  Jm = len(parents)
  hands = rng.normal(0, 0.05, (Jm - 22, 3))
  offsets = np.concatenate([skeleton.smpl22().template(), hands])
  rest = skeleton.rest_positions_np(offsets, parents)
  clusters = [rest[j] + rng.normal(0, 0.02, (per_joint, 3)) for j in range(Jm)]
  loose_v = rest[rng.integers(0, Jm, loose)] + rng.normal(0, 0.05, (loose, 3))
  v = np.concatenate(clusters + [loose_v])
  weights = np.zeros((len(v), Jm))
  regressor = np.zeros((Jm, len(v)))
  for j in range(Jm):
    rows = slice(j * per_joint, (j + 1) * per_joint)
    share = rng.uniform(0, 1, per_joint) if blend else 0.0  # of j's own bone
    weights[rows, max(parents[j], 0)] = 1.0 - share
    weights[rows, j] += share
    regressor[j, rows] = rng.dirichlet(np.ones(per_joint))
  for i in range(Jm * per_joint, len(v)):  # loose vertices blend three bones
    weights[i, rng.choice(Jm, 3, replace=False)] = rng.dirichlet(np.ones(3))
  kintree = np.array([[4294967295] + list(parents[1:]), list(range(Jm))], np.int64)
  np.savez(path, v_template=v, shapedirs=rng.normal(0, 0.01, (len(v), 3, 16)),
           J_regressor=regressor, kintree_table=kintree, weights=weights,
           f=np.zeros((1, 3), np.int32))
  return path


def make_motion(path: Path, T: int, fps: float, betas: np.ndarray, seed: int,
                joints: int = 52, rate_key: str = 'mocap_framerate', drop: tuple = ()) -> Path:
  """A smooth AMASS-like npz: upright (root Rz(yaw) Rx(90deg), z up) and walking about."""
  rng = np.random.default_rng(seed)
  t = np.arange(T)[:, None] / fps
  f, phase = rng.uniform(0.3, 1.5, 3 * joints), rng.uniform(0, 2 * np.pi, 3 * joints)
  poses = rng.uniform(0.1, 0.6, 3 * joints) * np.sin(2 * np.pi * f * t + phase)
  root = (Rotation.from_euler('z', (0.8 * np.sin(t[:, 0]) + seed)[:, None])
          * Rotation.from_euler('x', 90, degrees=True) * Rotation.from_rotvec(0.3 * poses[:, :3]))
  poses[:, :3] = root.as_rotvec()
  trans = np.stack([np.sin(t[:, 0]), 0.5 * t[:, 0], 0.02 * np.cos(3 * t[:, 0])], axis=1)
  fields = dict(poses=poses, trans=trans, betas=betas, gender=np.array('neutral'),
                dmpls=np.zeros((T, 8)))
  fields[rate_key] = np.array(float(fps))
  for key in drop:
    fields.pop(key)
  path.parent.mkdir(parents=True, exist_ok=True)
  np.savez(path, **fields)
  return path


def geodesic_rad(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  return (Rotation.from_rotvec(a.reshape(-1, 3)).inv()
          * Rotation.from_rotvec(b.reshape(-1, 3))).magnitude()


# (file, frames, fps, betas seed, extra) -- the synthetic AMASS tree.
FILES = {
    'CMU/01/01_01_poses.npz': (121, 120.0, 1, {}),
    'CMU/01/01_02_poses.npz': (61, 120.0, 1, {}),
    'CMU/01/01_03_poses.npz': (41, 120.0, 2, {}),  # other betas: subject variant CMU/01~1
    'CMU/02/02_01_poses.npz': (45, 60.0, 3, {'joints': 24}),  # SMPL's 72 pose parameters
    'Transitions_mocap/mazen_c3d/walk_poses.npz': (101, 50.0, 4,
                                                   {'rate_key': 'mocap_frame_rate'}),
    'HumanEva/S1/box_poses.npz': (31, 60.0, 5, {}),
    'MyLab/p1/take_poses.npz': (20, 30.0, 6, {}),
}


def betas_of(seed: int) -> np.ndarray:
  return np.random.default_rng(100 + seed).normal(0, 1, 16)


@pytest.fixture(scope='module')
def converted(tmp_path_factory):
  tmp = tmp_path_factory.mktemp('amass')
  model = make_body_model(tmp / 'model.npz')
  for i, (name, (T, fps, b, extra)) in enumerate(FILES.items()):
    make_motion(tmp / 'amass' / name, T, fps, betas_of(b), seed=i, **extra)
  np.savez(tmp / 'amass' / 'CMU' / '01' / 'shape.npz', betas=betas_of(1),
           gender=np.array('neutral'))
  messages = []
  summary = amass.convert(tmp / 'amass', model, tmp / 'out', log=messages.append)
  return tmp, summary, messages


def _files(out: Path) -> dict:
  return {f['file']: f for f in json.loads((out / 'files.json').read_text())}


def _clip(out: Path, name: str):
  """(dataset, file row, slice of the file's frames) of one converted file."""
  row = _files(out)[name]
  ds = data.load_shards(out, row['split'])
  return ds, row, slice(row['start'], row['start'] + row['frames'])


# ----------------------------------------------------------------------------------------------
# The conversion.


def test_fk_matches_the_models_own_joint_regression(converted):
  tmp, summary, _ = converted
  assert summary['fk_max_error_m'] < 1e-5  # our FK vs the naive SMPL chain
  rows = _files(tmp / 'out')
  assert all(r['lbs_joint_gap_m'] < 1e-5 for r in rows.values())
  assert summary['runs'][-1]['lbs_joint_gap_max_m'] < 1e-5
  # And independently, on the written (float32) shards: every 4th frame of a 120 fps file.
  model = amass.load_body_model(tmp / 'model.npz')
  motion = amass.read_amass(tmp / 'amass' / 'CMU/01/01_01_poses.npz')
  betas = motion.betas[:10]
  regressed = amass.lbs_regressed_joints_np(model, betas, motion)[::4]
  ds, row, sl = _clip(tmp / 'out', 'CMU/01/01_01_poses.npz')
  assert row['num_betas'] == 10 and np.allclose(row['betas'], betas)
  np.testing.assert_allclose(ds.positions[sl], regressed, atol=1e-5)
  rest = model.rest_joints(betas)[:22]
  np.testing.assert_allclose(ds.offsets[row['subject_id']], amass.rest_offsets(rest), atol=1e-6)


def test_the_regression_check_has_teeth(tmp_path):
  """Regressor vertices that blend two bones with varying weights (as in SMPL) break it."""
  model = amass.load_body_model(make_body_model(tmp_path / 'm.npz', blend=True))
  motion = amass.read_amass(make_motion(tmp_path / 'a' / 'b' / 'c.npz', 5, 30.0, betas_of(0), 0))
  rest = model.rest_joints(motion.betas[:10])
  fk = amass.naive_joints_np(motion.body_rotvecs(), motion.trans, rest[:22],
                             skeleton.SMPL22_PARENTS)
  gap = np.linalg.norm(fk - amass.lbs_regressed_joints_np(model, motion.betas[:10], motion),
                       axis=-1).max()
  assert gap > 1e-4


def test_frame_counts_after_resampling(converted):
  tmp, summary, _ = converted
  rows = _files(tmp / 'out')
  expected = {'CMU/01/01_01_poses.npz': 31, 'CMU/01/01_02_poses.npz': 16,
              'CMU/01/01_03_poses.npz': 11, 'CMU/02/02_01_poses.npz': 23,
              'Transitions_mocap/mazen_c3d/walk_poses.npz': 61,  # 50 -> 30: slerp
              'HumanEva/S1/box_poses.npz': 16, 'MyLab/p1/take_poses.npz': 20}
  assert {f: r['frames'] for f, r in rows.items()} == expected
  assert rows['Transitions_mocap/mazen_c3d/walk_poses.npz']['source_fps'] == 50.0
  assert summary['fps'] == 30.0 and summary['rig'] == 'smpl22'


def test_slerped_frames_hit_the_source_frames_they_land_on(converted):
  """50 -> 30 fps: output frame 3k sits on source frame 5k exactly."""
  tmp, _, _ = converted
  name = 'Transitions_mocap/mazen_c3d/walk_poses.npz'
  ds, row, sl = _clip(tmp / 'out', name)
  motion = amass.read_amass(tmp / 'amass' / name)
  poses = smpl_lib.smpl_pose_from_local(np.asarray(ds.local_rot[sl]))
  assert geodesic_rad(poses[::3], motion.poses[::5, :66][:len(poses[::3])]).max() < 1e-5
  between = geodesic_rad(poses[1], motion.poses[1, :66]).max()
  assert between > 1e-4  # frame 1 is at source time 5/3: interpolated, not copied


def test_up_axis_is_rotated_to_plus_y(converted):
  tmp, _, _ = converted
  W = Rotation.from_euler('x', -90, degrees=True).as_matrix()
  np.testing.assert_allclose(smpl_lib.AMASS_TO_RIG, W, atol=1e-12)
  name = 'CMU/01/01_01_poses.npz'
  ds, row, sl = _clip(tmp / 'out', name)
  motion = amass.read_amass(tmp / 'amass' / name)
  R_amass = Rotation.from_rotvec(motion.poses[::4, :3]).as_matrix()
  np.testing.assert_allclose(ds.global_rot[sl][:, 0], W @ R_amass, atol=1e-6)
  J0 = ds.offsets[row['subject_id']][0]
  np.testing.assert_allclose(ds.positions[sl][:, 0], (J0 + motion.trans[::4]) @ W.T, atol=1e-6)
  head, pelvis = ds.positions[sl][:, 15], ds.positions[sl][:, 0]  # upright in the rig: +y
  assert np.all(head[:, 1] - pelvis[:, 1] > 0.2)


def test_splits_by_subdataset_and_subjects(converted):
  tmp, summary, messages = converted
  rows = _files(tmp / 'out')
  split = {f: r['split'] for f, r in rows.items()}
  assert split['Transitions_mocap/mazen_c3d/walk_poses.npz'] == 'test'
  assert split['HumanEva/S1/box_poses.npz'] == 'val'
  assert split['CMU/01/01_01_poses.npz'] == split['CMU/02/02_01_poses.npz'] == 'train'
  assert split['MyLab/p1/take_poses.npz'] == 'train'  # unknown: the split file's 'unknown'
  assert rows['HumanEva/S1/box_poses.npz']['part'] == 'HumanEva'
  run = summary['runs'][-1]
  assert run['unknown_subdatasets'] == {'MyLab': 1}
  assert any('MyLab' in m and 'note' in m for m in messages)
  assert run['files_without_poses'] == ['CMU/01/shape.npz']
  assert summary['split_sources'] == {
      'amass_default': file_sha256(amass.DEFAULT_SPLIT)}
  subjects = {s['name']: s['files'] for s in json.loads((tmp / 'out/subjects.json').read_text())}
  assert subjects['CMU/01'] == 2 and subjects['CMU/01~1'] == 1  # other betas: a variant
  assert rows['CMU/01/01_03_poses.npz']['subject'] == 'CMU/01~1'


def test_split_file_lists_the_recommended_amass_split():
  doc, _ = amass.load_amass_split()
  assert {'HumanEva', 'MPI_HDM05', 'SFU', 'MPI_mosh'} <= set(doc['subdatasets']['val'])
  assert {'Transitions_mocap', 'SSM_synced'} <= set(doc['subdatasets']['test'])
  names = [n.lower() for names in doc['subdatasets'].values() for n in names]
  assert len(names) == len(set(names))
  assert amass.subdataset_split('downloads/ssm/x/y.npz', doc) == ('ssm', 'test')


def test_names_from_a_subdataset_directory_or_one_file(converted):
  tmp, _, _ = converted
  assert [n for n, _ in amass.find_amass_files(tmp / 'amass' / 'HumanEva')] == [
      'HumanEva/S1/box_poses.npz']
  one = tmp / 'amass' / 'CMU' / '02' / '02_01_poses.npz'
  assert amass.find_amass_files(one) == [('CMU/02/02_01_poses.npz', one)]


def test_linked_folders_are_followed_and_named_as_linked(converted, tmp_path):
  """A sub-dataset linked in from another disk: its files found (they were left out without a
  word) and named by the link (a `HumanEva` linked to `he_smplh` was named he_smplh, not in the
  split, so HumanEva's val files went to train); AppleDouble `._` files are not motion."""
  tmp, _, _ = converted
  store = tmp_path / 'disk2' / 'he_smplh'
  store.parent.mkdir()
  store.symlink_to(tmp / 'amass' / 'HumanEva', target_is_directory=True)
  root = tmp_path / 'amass'
  root.mkdir()
  (root / 'HumanEva').symlink_to(store, target_is_directory=True)
  (root / 'loop').symlink_to(root, target_is_directory=True)  # each real folder once
  (root / 'CMU' / '01').mkdir(parents=True)
  (root / 'CMU' / '01' / '._01_01_poses.npz').write_bytes(b'\x00\x05\x16\x07')
  assert [n for n, _ in amass.find_amass_files(root)] == ['HumanEva/S1/box_poses.npz']
  assert [n for n, _ in amass.find_amass_files(root / 'HumanEva')] == [
      'HumanEva/S1/box_poses.npz']


def test_rerun_adds_nothing_and_named_split(converted, tmp_path):
  tmp, summary, _ = converted
  messages = []
  again = amass.convert(tmp / 'amass', tmp / 'model.npz', tmp / 'out', log=messages.append)
  assert again == summary and any('nothing to convert' in m for m in messages)
  s = amass.convert(tmp / 'amass' / 'MyLab', tmp / 'model.npz', tmp_path / 'o', split='test',
                    log=quiet)
  assert s['files'] == {'test': 1} and s['runs'][-1]['unknown_subdatasets'] == {}


# ----------------------------------------------------------------------------------------------
# Back to AMASS: the inverse world rotation, and the solver's SMPL export.


def test_round_trip_through_the_shards(converted):
  """AMASS npz -> shards (local_rot, positions) -> [T, 66] + trans equals the input."""
  tmp, _, _ = converted
  for name, step in (('CMU/01/01_01_poses.npz', 4), ('CMU/02/02_01_poses.npz', 2)):
    ds, row, sl = _clip(tmp / 'out', name)
    motion = amass.read_amass(tmp / 'amass' / name)
    poses = smpl_lib.smpl_pose_from_local(np.asarray(ds.local_rot[sl]))
    assert poses.shape == (row['frames'], 66)
    assert geodesic_rad(poses, motion.poses[::step, :66]).max() < 1e-5
    trans = smpl_lib.smpl_trans_from_root(ds.positions[sl][:, 0], ds.offsets[row['subject_id']][0])
    np.testing.assert_allclose(trans, motion.trans[::step], atol=1e-5)


def test_round_trip_in_float64():
  rng = np.random.default_rng(3)
  rotvecs = Rotation.random(7 * 22, random_state=4).as_rotvec().reshape(7, 22, 3)
  trans, rest = rng.normal(size=(7, 3)), rng.normal(size=(22, 3))
  reduced = amass.rig_motion(rotvecs, trans, rest)
  back = smpl_lib.smpl_pose_from_local(reduced.local_rot)
  assert geodesic_rad(back, rotvecs).max() < 1e-9
  np.testing.assert_allclose(smpl_lib.smpl_trans_from_root(reduced.root_pos, rest[0]), trans,
                             atol=1e-12)


def test_solver_smpl_export_round_trip(converted):
  """The solver's SMPL export (rig world) -> `amass_params_from_rig` -> the AMASS input."""
  tmp, _, _ = converted
  name = 'CMU/01/01_01_poses.npz'
  ds, row, sl = _clip(tmp / 'out', name)
  motion = amass.read_amass(tmp / 'amass' / name)
  offsets = ds.offsets[row['subject_id']]
  poses_rig = smpl_lib.smpl_pose_params(np.asarray(ds.local_rot[sl]), skeleton.smpl22())
  trans_rig = ds.positions[sl][:, 0] - offsets[0]  # what smpl_lib.smpl_arrays writes
  poses, trans = smpl_lib.amass_params_from_rig(poses_rig, trans_rig, offsets[0])
  assert geodesic_rad(poses, motion.poses[::4, :66]).max() < 1e-5
  np.testing.assert_allclose(trans, motion.trans[::4], atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Refusals.


@pytest.mark.parametrize('key', ['trans', 'betas', 'mocap_framerate'])
def test_missing_field_names_the_file_and_key(tmp_path, key):
  path = make_motion(tmp_path / 'D' / 's' / 'x.npz', 4, 30.0, betas_of(0), 0, drop=(key,))
  with pytest.raises(ConversionError, match=key) as e:
    amass.read_amass(path)
  assert str(path) in str(e.value) and '\n' not in str(e.value)


def test_frame_rate_as_an_array_of_one_and_a_file_that_is_no_npz(tmp_path):
  path = make_motion(tmp_path / 'D' / 's' / 'x.npz', 4, 120.0, betas_of(0), 0)
  np.savez(path, **{**np.load(path), 'mocap_framerate': np.array([120.0])})  # as [fps] saves
  assert amass.read_amass(path).fps == 120.0
  np.savez(path, **{**np.load(path), 'mocap_framerate': np.array([120.0, 60.0])})
  with pytest.raises(ConversionError, match=r'mocap_framerate must be one number, got an array '
                     r'of shape \(2,\)'):
    amass.read_amass(path)
  html = tmp_path / 'D' / 's' / 'y_poses.npz'
  html.write_text('<html>404 Not Found</html>')  # a failed download under the file's name
  with pytest.raises(ConversionError, match=r'is not an .npz \(not a zip archive: a failed '
                     r'download or another format\?\)$'):
    amass.read_amass(html)


def test_body_model_refusals(tmp_path):
  pkl = tmp_path / 'SMPL_NEUTRAL.pkl'
  pkl.write_bytes(b'\x80\x04N.')
  with pytest.raises(ConversionError, match=r'\.pkl.*chumpy.*npz'):
    amass.load_body_model(pkl)
  good = dict(np.load(make_body_model(tmp_path / 'm.npz')))
  np.savez(tmp_path / 'noreg.npz', **{k: v for k, v in good.items() if k != 'J_regressor'})
  with pytest.raises(ConversionError, match='lacks J_regressor'):
    amass.load_body_model(tmp_path / 'noreg.npz')
  kintree = good['kintree_table'].copy()
  kintree[0, 4] = 2  # left_knee under right_hip
  np.savez(tmp_path / 'bad.npz', **{**good, 'kintree_table': kintree})
  with pytest.raises(ConversionError, match='left_knee.*not an SMPL'):
    amass.load_body_model(tmp_path / 'bad.npz')


def test_gender_picks_its_model_and_families_must_match(tmp_path):
  neutral = make_body_model(tmp_path / 'n.npz')
  female = make_body_model(tmp_path / 'f.npz', seed=1)
  path = make_motion(tmp_path / 'in' / 'D' / 's' / 'a.npz', 8, 30.0, betas_of(0), 0)
  np.savez(path, **{**np.load(path), 'gender': np.array(b'female')})
  s = amass.convert(path, neutral, tmp_path / 'o', body_model_female=female, log=quiet)
  row = json.loads((tmp_path / 'o' / 'files.json').read_text())[0]
  assert row['gender'] == row['body_model'] == 'female' and row['file'] == 'D/s/a.npz'
  assert s['runs'][-1]['body_models']['female']['sha256'] == file_sha256(female)
  # Other fitters' words for it: 'F' is female (it got the neutral model); a word that is no
  # gender is refused where gendered models were given; the flag named is one that exists.
  for word in (b'F', 'woman'):
    np.savez(path, **{**np.load(path), 'gender': np.array(word)})
    assert amass.read_amass(path).gender == 'female'
  np.savez(path, **{**np.load(path), 'gender': np.array('unknown')})
  with pytest.raises(ConversionError, match=r"^D/s/a.npz: gender 'unknown' is none of neutral, "
                     'female, male'):
    amass.convert(path, neutral, tmp_path / 'o3', body_model_female=female, log=quiet)
  np.savez(path, **{**np.load(path), 'gender': np.array('m')})
  with pytest.raises(ConversionError, match=r"^D/s/a.npz: gender 'male' and no neutral model: "
                     r'pass --body_model \(or --body_model_male\)$'):
    amass.convert(path, None, tmp_path / 'o3', body_model_female=female, log=quiet)
  smplh = make_body_model(tmp_path / 'h.npz', parents=PARENTS24 + (20,) * 14 + (21,) * 14)
  smplx = make_motion(tmp_path / 'x' / 'D' / 's' / 'x.npz', 8, 30.0, betas_of(0), 0, joints=55)
  with pytest.raises(ConversionError, match=r'55 joints \(SMPL-X\).*52 \(SMPL\+H\)'):
    amass.convert(smplx, smplh, tmp_path / 'o2', log=quiet)


def test_command_line(tmp_path, converted):
  tmp, _, _ = converted
  cmd = [sys.executable, '-m', 'data_prep.amass_to_shards', f'--body_model={tmp / "model.npz"}']
  ok = subprocess.run(cmd + [f'--input={tmp / "amass" / "HumanEva"}', f'--output={tmp_path / "o"}'],
                      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert ok.returncode == 0, ok.stderr
  assert 'HumanEva/S1/box_poses.npz: subject HumanEva/S1, 31 frames @ 60 fps -> 16' in ok.stderr
  summary = json.loads((tmp_path / 'o' / 'summary.json').read_text())
  assert summary['files'] == {'val': 1} and summary['fk_max_error_m'] < 1e-5
  bad = make_motion(tmp_path / 'in' / 'S' / 'x_poses.npz', 4, 30.0, betas_of(0), 0,
                    drop=('trans',))
  err = subprocess.run(cmd + [f'--input={bad}', f'--output={tmp_path / "o2"}'], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert err.returncode == 2 and not (tmp_path / 'o2').exists()
  assert err.stderr.strip().splitlines()[-1].startswith('error: ')
  assert 'missing field trans' in err.stderr
