"""BVH -> shards: real CMU files, rig reduction rules, resampling, splits, merging, re-rigging."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from data_prep import conversion
from data_prep import make_split
from data_prep import make_template
from ik_gat_jax import data
from ik_gat_jax import kinematics
from ik_gat_jax import skeleton
from ik_gat_jax.errors import ConversionError
from ik_gat_jax.io import bvh
from ik_gat_jax.io import exports
from ik_gat_jax.io import retarget
from ik_gat_jax.provenance import file_sha256

REPO = Path(__file__).resolve().parents[1]
CMU_UNITS = 0.056444
FINGERS = ('LeftFingerBase', 'LThumb', 'RightFingerBase', 'RThumb')
quiet = lambda message: None  # noqa: E731


def _link(tmp_path: Path, cmu_dir: Path, *names: str) -> Path:
  """A directory holding symlinks to some CMU files (the converter reads a directory)."""
  d = tmp_path / 'in'
  d.mkdir(exist_ok=True)
  for n in names:
    (d / n).symlink_to(cmu_dir / n)
  return d


def _reference_positions(path: Path, frames: slice = slice(1, None, 4)) -> tuple:
  """Naive FK of the raw file (metres) at the kept frames, and the source joint names."""
  m = bvh.read_bvh(path)
  return bvh.naive_fk_np(m, CMU_UNITS)[frames], m.names


# ----------------------------------------------------------------------------------------------
# Real CMU files.


@pytest.fixture(scope='module')
def two_cmu_files(tmp_path_factory, cmu_dir):
  tmp = tmp_path_factory.mktemp('cmu')
  src = _link(tmp, cmu_dir, '07_01.bvh', '09_01.bvh')
  summary = conversion.convert(src, 'cmu_body', tmp / 'out', log=quiet)
  return tmp / 'out', summary


def test_cmu_files_convert_with_tiny_fk_error_and_decimated_frames(two_cmu_files, cmu_dir):
  out, summary = two_cmu_files
  assert summary['fk_max_error_m'] < 1e-5
  rig = skeleton.cmu_body()
  for split, file in (('test', '07_01.bvh'), ('train', '09_01.bvh')):
    ds = data.load_shards(out, split)
    T = bvh.read_bvh(cmu_dir / file).num_frames
    assert ds.num_frames == len(range(0, T - 1, 4))  # drop the T-pose, every 4th frame
    ref, names = _reference_positions(cmu_dir / file)
    idx = [names.index(n) for n in rig.joint_names]
    np.testing.assert_allclose(ds.positions, ref[:, idx], atol=2e-6)  # float32 storage
    np.testing.assert_array_equal(ds.frame_index, np.arange(ds.num_frames))
  assert summary['files'] == {'test': 1, 'train': 1}
  assert summary['frames'] == {'test': 79, 'train': 37}
  files = json.loads((out / 'files.json').read_text())
  assert [f['part'] for f in files] == ['unseen_subject', None]  # from the committed split


def test_cmu_reduction_folds_identity_joints_into_offsets(cmu_dir):
  jmap = retarget.load_joint_map('cmu_body')
  motion, _ = retarget.read_motion(cmu_dir / '07_01.bvh', drop_first_frame=True)
  plan = retarget.plan_reduction(motion.names, motion.parents, jmap, skeleton.CMU_BODY_JOINTS,
                                 skeleton.CMU_BODY_PARENTS)
  folded = {plan.names[k]: [motion.names[j] for j in f] for k, f in enumerate(plan.folded) if f}
  assert folded == {'LeftUpLeg': ['LHipJoint'], 'RightUpLeg': ['RHipJoint'],
                    'LeftArm': ['LeftShoulder'], 'RightArm': ['RightShoulder']}
  reduced = retarget.reduce_motion(motion, plan, CMU_UNITS, np.eye(3))
  rig = skeleton.cmu_body()
  np.testing.assert_allclose(reduced.offsets[rig.index('LeftArm')],
                             CMU_UNITS * motion.offsets[motion.names.index('LeftArm')])
  assert np.all(reduced.offsets[[rig.index('LowerBack'), rig.index('Neck')]] == 0)  # stay


def _split_floats(x, path=''):
  """(every non-float leaf by path, every float leaf by path) of a JSON document."""
  if isinstance(x, dict):
    parts = [_split_floats(v, f'{path}.{k}') for k, v in x.items()]
  elif isinstance(x, list):
    parts = [_split_floats(v, f'{path}[{i}]') for i, v in enumerate(x)]
  else:
    return ({}, {path: x}) if isinstance(x, float) else ({path: x}, {})
  return ({k: v for p in parts for k, v in p[0].items()},
          {k: v for p in parts for k, v in p[1].items()})


def test_make_template_reproduces_the_committed_rig(cmu_dir):
  """The committed rig (written on another machine) is regenerated: names, topology and axes
  exactly; the template offsets (float64 means over 7 subjects of offsets below 1 m) up to the
  summation order a CPU's SIMD width may change: |error| <= 7 x 2.2e-16 m per value, so 1e-12 m
  leaves a wide margin and still catches any real change of the template (> 1e-9 m)."""
  rig = make_template.make_template_rig(cmu_dir, 'cmu_body')
  committed = json.loads((skeleton.RIG_DIR / 'cmu_body.json').read_text())
  exact_new, floats_new = _split_floats(json.loads(make_template.rig_json_text(rig)))
  exact_old, floats_old = _split_floats(committed)
  assert exact_new == exact_old and floats_new.keys() == floats_old.keys()
  np.testing.assert_allclose([floats_new[k] for k in floats_old], list(floats_old.values()),
                             rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# Reduction rules on small synthetic files.

_CHAIN = """HIERARCHY
ROOT Root
{{
\tOFFSET 0 0 0
\tCHANNELS 6 Xposition Yposition Zposition Zrotation Yrotation Xrotation
\tJOINT Mid
\t{{
\t\tOFFSET 0 1 0
\t\tCHANNELS {mid_channels}
\t\tJOINT Tip
\t\t{{
\t\t\tOFFSET {tip_offset}
\t\t\tCHANNELS 3 Zrotation Yrotation Xrotation
\t\t\tEnd Site
\t\t\t{{
\t\t\t\tOFFSET 0 0.5 0
\t\t\t}}
\t\t}}
\t}}
}}
MOTION
Frames: 3
Frame Time: 0.0083333333
{rows}
"""


def _chain(mid_channels: str, rows: list[str], tip_offset: str = '0 1 0') -> bvh.BVHMotion:
  text = _CHAIN.format(mid_channels=mid_channels, rows='\n'.join(rows), tip_offset=tip_offset)
  return bvh.parse_bvh(text, 'chain.bvh')


def _chain_map(*joints: str) -> retarget.JointMap:
  return retarget.JointMap(joints=tuple((j, j) for j in joints), units=1.0, up='y',
                           forward='z')


def test_removing_a_rotating_intermediate_is_refused():
  rows = ['0 0 0 0 0 0 0 0 0 0 0 0', '0 0 0 0 0 0 0 0 2 0 0 0', '0 0 0 0 0 0 0 0 0 0 0 0']
  motion = _chain('3 Zrotation Yrotation Xrotation', rows)
  with pytest.raises(ConversionError, match=r'Mid is not in the rig but rotates '
                     r'\(by 2 degrees in frame 1\)'):
    retarget.convert_motion(motion, _chain_map('Root', 'Tip'), np.eye(3), 120.0)
  # Kept, it converts; identity, it is removed and its offset folds into Tip's.
  retarget.convert_motion(motion, _chain_map('Root', 'Mid', 'Tip'), np.eye(3), 120.0)
  still = _chain('3 Zrotation Yrotation Xrotation', [rows[0]] * 3)
  _, out, _, p, err = retarget.convert_motion(still, _chain_map('Root', 'Tip'), np.eye(3), 120.0)
  np.testing.assert_allclose(out.offsets, [[0, 0, 0], [0, 2, 0]])
  assert err < 1e-12


def test_a_near_identity_joint_above_a_long_bone_fails_the_fk_check():
  # 0.0009 degrees is inside the removal tolerance, but over a 1 km bone it moves Tip by 1.6 cm.
  rows = ['0 0 0 0 0 0 0 0 0 0 0 0', '0 0 0 0 0 0 0 0 0.0009 0 0 0', '0 0 0 0 0 0 0 0 0 0 0 0']
  motion = _chain('3 Zrotation Yrotation Xrotation', rows, tip_offset='0 1000 0')
  with pytest.raises(ConversionError, match='FK check failed'):
    retarget.convert_motion(motion, _chain_map('Root', 'Tip'), np.eye(3), 120.0)


def test_position_channels_on_a_non_root_fold_if_constant_and_refuse_if_moving():
  six = '6 Xposition Yposition Zposition Zrotation Yrotation Xrotation'
  constant = ['1 2 3 10 20 30 0 1.5 0 5 0 0 0 0 7'] * 3
  chain = _chain_map('Root', 'Mid', 'Tip')
  _, out, _, _, err = retarget.convert_motion(_chain(six, constant), chain, np.eye(3), 120.0)
  np.testing.assert_allclose(out.offsets[1], [0, 1.5, 0])  # the channel value, not the OFFSET
  assert err < 1e-12
  moving = constant[:2] + ['1 2 3 10 20 30 0 1.6 0 5 0 0 0 0 7']
  with pytest.raises(ConversionError, match='Mid has position channels that move'):
    retarget.convert_motion(_chain(six, moving), chain, np.eye(3), 120.0)
  # Blender's default export: every joint's channels, with float32 noise of ~1e-6 m: read,
  # and the FK check holds (the noise is the only difference, 2e-6 m here).
  noisy = constant[:2] + ['1 2 3 10 20 30 0.000002 1.5 0 5 0 0 0 0 7']
  _, out, _, _, err = retarget.convert_motion(_chain(six, noisy), chain, np.eye(3), 120.0)
  assert err <= 2e-6 + 1e-12


def test_joint_map_errors_name_the_problem():
  motion = _chain('3 Zrotation Yrotation Xrotation', ['0 0 0 0 0 0 0 0 0 0 0 0'] * 3)
  cases = [(_chain_map('Root', 'Mid'), 'Tip are neither mapped to the rig nor pruned'),
           (_chain_map('Root', 'Mid', 'Toe'), 'does not have: Toe'),
           (_chain_map('Mid', 'Tip'), None)]  # a mapped subtree below an unmapped root: fine
  for jmap, message in cases:
    if message is None:
      retarget.plan_reduction(motion.names, motion.parents, jmap)
    else:
      with pytest.raises(ConversionError, match=message):
        retarget.plan_reduction(motion.names, motion.parents, jmap)
  with pytest.raises(ConversionError, match='its rig parent is Root'):
    retarget.plan_reduction(motion.names, motion.parents, _chain_map('Root', 'Mid', 'Tip'),
                            ('Root', 'Mid', 'Tip'), (-1, 0, 0))


def test_joint_map_schema_validation():
  doc = json.loads((retarget.JOINT_MAP_DIR / 'cmu_body.json').read_text())
  retarget.joint_map_from_json(doc, 'cmu_body', retarget.JOINT_MAP_DIR)
  for change, message in [({'units': -1}, 'must be > 0'),
                          ({'up': 'w'}, "bad.up: 'w' does not match"),
                          ({'colour': 'red'}, "unknown field 'colour'"),
                          ({'prune': 'LThumb'}, 'bad.prune: expected array'),
                          ({'joints': {'Hips': 3}}, 'bad.joints.Hips: expected string')]:
    with pytest.raises(ConversionError, match=message):
      retarget.joint_map_from_json({**doc, **change}, 'bad', retarget.JOINT_MAP_DIR)
  bad = {k: v for k, v in doc.items() if k != 'units'}
  with pytest.raises(ConversionError, match='missing required units'):
    retarget.joint_map_from_json(bad, 'bad', retarget.JOINT_MAP_DIR)
  with pytest.raises(ConversionError, match='perpendicular'):
    retarget.joint_map_from_json({**doc, 'forward': '-y'}, 'bad', retarget.JOINT_MAP_DIR)


# ----------------------------------------------------------------------------------------------
# Resampling against hand-computed frames.


def _two_joint_clip(T: int = 13) -> retarget.ReducedMotion:
  t = np.arange(T, dtype=np.float64)
  root = Rotation.from_euler('y', 10.0 * t[:, None], degrees=True).as_matrix()  # uniform yaw
  child = Rotation.from_euler('x', 2.0 * t[:, None]**2, degrees=True).as_matrix()  # accelerating
  root_pos = np.stack([0.01 * t, 0.001 * t**2, np.zeros(T)], axis=1)
  return retarget.ReducedMotion(local_rot=np.stack([root, child], axis=1), root_pos=root_pos,
                                offsets=np.array([[0.0, 0.0, 0.0], [0.0, 0.0, 0.3]]))


def test_decimation_keeps_every_fourth_frame():
  clip = _two_joint_clip()
  out = retarget.resample(clip, 120.0, 30.0)
  np.testing.assert_array_equal(out.local_rot, clip.local_rot[[0, 4, 8, 12]])
  np.testing.assert_array_equal(out.root_pos, clip.root_pos[[0, 4, 8, 12]])


def test_slerp_resampling_120_to_50_matches_hand_computed_frames():
  clip = _two_joint_clip()
  out = retarget.resample(clip, 120.0, 50.0)
  s = np.array([0.0, 2.4, 4.8, 7.2, 9.6, 12.0])  # source frame of each 50 fps frame
  assert out.local_rot.shape == (6, 2, 3, 3)
  i0 = np.floor(s + 1e-9).astype(int)
  i1, f = np.minimum(i0 + 1, 12), s - i0
  # Same-axis rotations: slerp interpolates the angle linearly between the two frames.
  root = Rotation.from_euler('y', 10.0 * s[:, None], degrees=True).as_matrix()
  child_angle = 2.0 * i0**2 + f * (2.0 * i1**2 - 2.0 * i0**2)
  child = Rotation.from_euler('x', child_angle[:, None], degrees=True).as_matrix()
  np.testing.assert_allclose(out.local_rot[:, 0], root, atol=1e-12)
  np.testing.assert_allclose(out.local_rot[:, 1], child, atol=1e-12)
  y = 0.001 * (i0**2 + f * (i1**2 - i0**2))
  np.testing.assert_allclose(out.root_pos, np.stack([0.01 * s, y, 0 * s], 1), atol=1e-12)
  G, p = retarget.forward_kinematics_np(out, (-1, 0))  # FK again on the slerped rotations
  np.testing.assert_allclose(p[:, 1], out.root_pos + root @ np.array([0.0, 0.0, 0.3]), atol=1e-12)
  np.testing.assert_allclose(G[:, 1], root @ child, atol=1e-12)


def test_source_fps_snaps_rounded_frame_times():
  assert retarget.source_fps(0.0083333) == 120.0
  assert retarget.source_fps(1 / 59.94) == pytest.approx(59.94)


# ----------------------------------------------------------------------------------------------
# The committed split.


def test_split_file_hashes_match_the_data_and_the_rule(cmu_dir):
  split = json.loads((conversion.SPLIT_DIR / 'cmu_default.json').read_text())
  files = {f['file']: f for f in split['files']}
  assert sorted(files) == sorted(p.name for p in cmu_dir.glob('*.bvh'))
  for name, entry in files.items():
    assert file_sha256(cmu_dir / name) == entry['sha256'], name
  assert all(f['split'] == 'test' and f['part'] == 'unseen_subject'
             for f in files.values() if f['subject'] == make_split.UNSEEN_SUBJECT)
  others = {f['subject'] for f in files.values()} - {make_split.UNSEEN_SUBJECT}
  for s in others:
    mine = [f for f in files.values() if f['subject'] == s]
    assert sorted(f['split'] for f in mine if f['split'] != 'train') == ['test', 'val']
    assert [f['part'] for f in mine if f['split'] == 'test'] == ['unseen_file']
  rows = make_split.read_manifest(cmu_dir)
  assert make_split.make_split(rows) == split  # regenerating gives the committed file
  readme = (conversion.SPLIT_DIR / 'README.md').read_text()
  assert readme == make_split.counts_markdown(split)
  with pytest.raises(ValueError, match='subject 05 has 1 trial .05_01.bvh.: each subject'):
    make_split.make_split([r for r in rows if not r['file'].startswith('05_')
                           or r['file'] == '05_01.bvh'])  # it was a traceback from sample()


def test_rerig_refuses_a_skeleton_not_cmu_before_writing(tmp_path, cmu_dir):
  from data_prep import rerig
  m = bvh.read_bvh(cmu_dir / '07_01.bvh')
  joints = [dataclasses.replace(j, name='Bip01 ' + j.name) for j in m.joints]
  (tmp_path / 'in').mkdir()
  bvh.write_bvh(tmp_path / 'in' / 'a.bvh', bvh.BVHMotion(joints, m.frame_time, m.motion[:3]))
  with pytest.raises(rerig.RerigError, match=r'a.bvh: not a CMU skeleton .*: no Hips, '):
    rerig.rerig_directory(tmp_path / 'in', tmp_path / 'out', units='cmu', log=quiet)
  assert not (tmp_path / 'out').exists()  # it wrote every file, then failed


# ----------------------------------------------------------------------------------------------
# Output handling: merging, refusals, the command line.


def test_second_run_adds_files_and_keeps_ids(tmp_path, cmu_dir):
  out = tmp_path / 'out'
  conversion.convert(_link(tmp_path, cmu_dir, '07_01.bvh'), 'cmu_body', out, log=quiet)
  (tmp_path / 'in2').mkdir()
  for n in ('07_01.bvh', '07_02.bvh', '08_01.bvh'):
    (tmp_path / 'in2' / n).symlink_to(cmu_dir / n)
  messages = []
  summary = conversion.convert(tmp_path / 'in2', 'cmu_body', out, split='train',
                               log=messages.append)
  assert '07_01.bvh: already in' in messages[0]
  files = json.loads((out / 'files.json').read_text())
  assert [(f['file'], f['file_id'], f['split'], f['subject_id']) for f in files] == [
      ('07_01.bvh', 0, 'test', 0), ('07_02.bvh', 1, 'train', 0), ('08_01.bvh', 2, 'train', 1)]
  assert summary['files'] == {'test': 1, 'train': 2} and len(summary['runs']) == 2
  train = data.load_shards(out, 'train')
  assert train.num_frames == summary['frames']['train'] == files[1]['frames'] + files[2]['frames']
  np.testing.assert_array_equal(np.unique(train.file_id), [1, 2])
  assert train.offsets.shape == (2, 21, 3)
  # Re-running is a no-op; a refused run leaves the directory as it was.
  before = (out / 'summary.json').read_text()
  conversion.convert(tmp_path / 'in2', 'cmu_body', out, split='train', log=quiet)
  with pytest.raises(ConversionError, match='30.0 fps shards'):
    conversion.convert(cmu_dir / '07_03.bvh', 'cmu_body', out, fps=50.0, log=quiet)
  assert (out / 'summary.json').read_text() == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ['in', 'in2', 'out']  # no temp dirs left
  # The same bytes under another name are skipped, naming the file they are: the folder
  # converted again from another root (a new subject of the same frames, which a subject split
  # could put in test and train), or a copy beside the original in one run.
  (tmp_path / 'in3' / 'anna').mkdir(parents=True)
  for src, name in (('07_02.bvh', 'anna/07_02.bvh'), ('07_03.bvh', 'anna/07_03.bvh'),
                    ('07_03.bvh', 'anna/07_03 copy.bvh')):
    (tmp_path / 'in3' / name).symlink_to(cmu_dir / src)
  messages = []
  summary = conversion.convert(tmp_path / 'in3', 'cmu_body', out, split='train',
                               log=messages.append)
  assert 'anna/07_02.bvh: the same bytes as 07_02.bvh, already in' in messages[0], messages
  assert any('anna/07_03.bvh: the same bytes as anna/07_03 copy.bvh (converted in this run), '
             'skipped' in m for m in messages), messages
  files = json.loads((out / 'files.json').read_text())
  assert [f['file'] for f in files] == ['07_01.bvh', '07_02.bvh', '08_01.bvh',
                                        'anna/07_03 copy.bvh']
  assert summary['runs'][-1]['files_skipped'] == ['anna/07_02.bvh', 'anna/07_03.bvh']


def test_auto_split_refuses_unlisted_and_changed_files(tmp_path, cmu_dir):
  text = (cmu_dir / '07_01.bvh').read_text()
  (tmp_path / '07_99.bvh').write_text(text)
  with pytest.raises(ConversionError, match='07_99.bvh is not in split cmu_default; '
                     'pass --split'):
    conversion.convert(tmp_path / '07_99.bvh', 'cmu_body', tmp_path / 'out', log=quiet)
  (tmp_path / '07_01.bvh').write_text(text.replace('Frame Time: .0083333', 'Frame Time: 0.01'))
  with pytest.raises(ConversionError, match='the file changed'):
    conversion.convert(tmp_path / '07_01.bvh', 'cmu_body', tmp_path / 'out', log=quiet)
  assert not (tmp_path / 'out').exists()


def test_command_line_reports_bad_input_in_one_line(tmp_path):
  result = subprocess.run(
      [sys.executable, '-m', 'data_prep.bvh_to_shards', f'--input={tmp_path}/none.bvh',
       '--rig=cmu_body', f'--output={tmp_path}/out'], cwd=REPO, capture_output=True, text=True,
      timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (
      f'error: input {tmp_path}/none.bvh does not exist')
  assert not (tmp_path / 'out').exists()


def test_a_cmu_file_without_the_joints_its_map_only_prunes_converts(tmp_path, cmu_dir):
  """cgspeed CMU re-exported without fingers and thumbs (as this project's own BVH of a CMU
  file is): cmu_body's joint map only prunes them, so the file converts, to the same frames
  (it was refused: 'names joints the BVH does not have')."""
  from ik_gat_jax.skeleton import depth_first_order
  m = bvh.read_bvh(cmu_dir / '07_01.bvh')
  m = dataclasses.replace(m, motion=m.motion[:41])
  gone = {j for n in ('LeftFingerBase', 'LThumb', 'RightFingerBase', 'RThumb')
          for j in depth_first_order(m.parents, m.names.index(n))}
  keep = [j for j in range(len(m.joints)) if j not in gone]
  new_index = {j: k for k, j in enumerate(keep)}
  joints = [dataclasses.replace(m.joints[j], parent=new_index.get(m.joints[j].parent, -1))
            for j in keep]
  cols = np.concatenate([np.arange(len(m.joints[j].channels)) + m.channel_slice(j).start
                         for j in keep])
  for d in ('full', 'bare'):
    (tmp_path / d).mkdir()
  bvh.write_bvh(tmp_path / 'full' / '07_01.bvh', m, precision=None)
  bvh.write_bvh(tmp_path / 'bare' / '07_01.bvh',
                bvh.BVHMotion(joints, m.frame_time, m.motion[:, cols]), precision=None)
  for d in ('full', 'bare'):
    conversion.convert(tmp_path / d, 'cmu_body', tmp_path / f'out_{d}', split='train',
                       log=quiet)
  a, b = (data.load_shards(tmp_path / f'out_{d}', 'train') for d in ('full', 'bare'))
  assert a.num_frames == b.num_frames == 10
  np.testing.assert_allclose(np.asarray(b.positions), np.asarray(a.positions), atol=1e-9)


def test_files_added_to_a_derived_rig_keep_its_joints(tmp_path, cmu_dir):
  """--rig=auto adding files to a folder keeps the rig it derived: a joint that holds still in
  the new files (an elbow a tracker lost) is still a rig joint (refused before: the rig was
  derived again from the new files alone, without it)."""
  m = bvh.read_bvh(cmu_dir / '01_01.bvh')
  for d in ('a', 'b'):
    (tmp_path / d).mkdir()
  bvh.write_bvh(tmp_path / 'a' / 'S1_walk.bvh', dataclasses.replace(m, motion=m.motion[200:240]))
  still = m.motion[400:440].copy()
  cols = m.channel_slice(m.names.index('LeftForeArm'))
  still[:, cols] = still[:1, cols]
  bvh.write_bvh(tmp_path / 'b' / 'S2_still.bvh', dataclasses.replace(m, motion=still))
  out = tmp_path / 'out'
  for d in ('a', 'b'):
    summary = conversion.convert(tmp_path / d, 'auto', out, units='cmu', split='train',
                                 log=quiet)
  rig = skeleton.Rig.from_json(json.loads((out / 'rig.json').read_text()))
  assert 'LeftForeArm' in rig.joint_names and summary['files'] == {'train': 2}
  clip = data.load_shards(out, 'train')
  assert clip.num_frames == 20  # 40 + 40 frames at 120 fps -> 30 fps


def test_a_stopped_conversion_leaves_its_output_as_it_was(tmp_path, cmu_dir):
  """SIGTERM (a scheduler's time limit) stops the command as Ctrl-C does: exit 130, one line,
  no hidden copy of the shards left beside --output (it left one, never removed); one a killed
  run (SIGKILL) left on this host is removed by the next run, another host's is left."""
  import signal
  names = ('01_01.bvh', '01_02.bvh', '01_03.bvh', '01_04.bvh', '01_05.bvh', '01_06.bvh')
  inputs = _link(tmp_path, cmu_dir, *names)
  out = tmp_path / 'out'
  proc = subprocess.Popen(
      [sys.executable, '-m', 'data_prep.bvh_to_shards', f'--input={inputs}', '--rig=cmu_body',
       f'--output={out}', '--split=train'], cwd=REPO, stderr=subprocess.PIPE, text=True)
  try:
    lines = []
    for line in proc.stderr:  # the first file's line: converting, the others to come
      lines.append(line)
      if '01_01.bvh: subject' in line:
        proc.send_signal(signal.SIGTERM)
        break
    lines += proc.stderr.read().splitlines()
    assert proc.wait(timeout=120) == 130, lines
  finally:
    proc.kill()
  assert lines[-1] == f'interrupted: {out} is as it was; rerun the same command to convert'
  assert sorted(p.name for p in tmp_path.iterdir()) == ['in']
  dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'],
                        capture_output=True, text=True, check=True)
  stale = tmp_path / f'.out.tmp-{conversion._HOST}-{int(dead.stdout)}-x1y2'
  other = tmp_path / '.out.old-elsewhere-7-123'
  for d in (stale, other):
    d.mkdir()
    (d / 'positions.npy').write_bytes(b'0' * 100)
  messages = []
  conversion.convert(inputs / '01_02.bvh', 'cmu_body', out, split='train', log=messages.append)
  assert f'removed {stale}: left by a conversion (process {int(dead.stdout)}) that was killed' in (
      messages), messages
  assert any(m.startswith(f'note: {other} is a conversion in progress (host elsewhere)')
             for m in messages), messages
  assert sorted(p.name for p in tmp_path.iterdir()) == ['.out.old-elsewhere-7-123', 'in', 'out']


# ----------------------------------------------------------------------------------------------
# Re-rigging: the same motion stored the way game engines store it, recovered by --rig=auto.

_IDENTITY_JOINTS = ('LHipJoint', 'RHipJoint', 'LeftShoulder', 'RightShoulder')
_CM_PER_UNIT = CMU_UNITS * 100.0


def _bind_rotations(m: bvh.BVHMotion) -> np.ndarray:
  """Per joint a rest orientation C_j whose +x runs along the joint's bone, with a random roll.

  The four joints that never rotate take their parent's, so they stay identity (removable).
  """
  rng = np.random.default_rng(0)
  C = []
  for j, joint in enumerate(m.joints):
    if joint.name in _IDENTITY_JOINTS:
      C.append(C[joint.parent])
      continue
    bones = [m.joints[c].offset for c in range(len(m.joints))
             if m.joints[c].parent == j and np.linalg.norm(m.joints[c].offset) > 0]
    if not bones and joint.end_site is not None:
      bones = [joint.end_site]
    roll = Rotation.from_euler('x', rng.uniform(-180, 180), degrees=True)
    align = (Rotation.align_vectors([bones[0]], [[1.0, 0.0, 0.0]])[0] if bones
             else Rotation.random(random_state=j))
    C.append((align * roll).as_matrix())
  return np.stack(C)


def _game_engine_bvh(m: bvh.BVHMotion, C: np.ndarray) -> bvh.BVHMotion:
  """Bind-rotated frames, centimetres, ZXY channels, 6 channels everywhere, a dummy root."""
  T, J = m.num_frames, len(m.joints)
  R = np.stack([bvh.euler_to_matrix_np(m.rotation_degrees(j), m.euler_order(j))
                for j in range(J)], axis=1)
  joints = [bvh.BVHJoint('Armature', -1, np.zeros(3), bvh.POSITION_CHANNELS + (
      'Zrotation', 'Xrotation', 'Yrotation'))]
  columns = [np.zeros((T, 6))]
  for j, joint in enumerate(m.joints):
    Cp = C[joint.parent] if joint.parent >= 0 else np.eye(3)
    R_new = Cp.T @ R[:, j] @ C[j]  # new local rotation: G_new = G C, so C_p^T R C
    offset = _CM_PER_UNIT * Cp.T @ joint.offset
    trans = (_CM_PER_UNIT * m.position_channels(j) if joint.parent < 0
             else np.tile(offset, (T, 1)))
    end = None if joint.end_site is None else _CM_PER_UNIT * C[j].T @ joint.end_site
    joints.append(bvh.BVHJoint(joint.name, joint.parent + 1, offset, joints[0].channels, end))
    columns.append(np.concatenate(
        [trans, Rotation.from_matrix(R_new).as_euler('ZXY', degrees=True)], axis=1))
  return bvh.BVHMotion(joints=joints, frame_time=m.frame_time,
                       motion=np.concatenate(columns, axis=1))


def test_game_engine_rig_is_recovered_by_auto(tmp_path, cmu_dir):
  m = bvh.read_bvh(cmu_dir / '07_01.bvh')
  m.motion = m.motion[:61]  # the T-pose frame and 60 real ones
  C = _bind_rotations(m)
  bvh.write_bvh(tmp_path / 'game_07.bvh', _game_engine_bvh(m, C))
  summary = conversion.convert(tmp_path / 'game_07.bvh', 'auto', tmp_path / 'out', split='all',
                               units='cm', prune=FINGERS, drop_first_frame=True,
                               rig_name='game', log=quiet)
  ds = data.load_shards(tmp_path / 'out', 'all')
  rig = ds.rig
  # Armature folded, the never-rotating joints removed, fingers pruned: the 21 cmu_body joints.
  assert rig.name == 'game' and sorted(rig.joint_names) == sorted(skeleton.CMU_BODY_JOINTS)
  assert summary['fk_max_error_m'] < 1e-5 and ds.num_frames == 15
  src = [m.names.index(n) for n in rig.joint_names]
  kept = slice(1, None, 4)
  np.testing.assert_allclose(ds.positions, bvh.naive_fk_np(m, CMU_UNITS)[kept][:, src], atol=1e-5)
  # Local rotations = the originals conjugated by the binds (the source parent's bind: a removed
  # joint between shares its parent's).
  R = np.stack([bvh.euler_to_matrix_np(m.rotation_degrees(j), m.euler_order(j))[kept]
                for j in src], axis=1)
  Cp = np.stack([C[m.parents[j]] if m.parents[j] >= 0 else np.eye(3) for j in src])
  np.testing.assert_allclose(ds.local_rot, np.swapaxes(Cp, -1, -2) @ R @ C[src], atol=1e-5)
  # FK of the converted rotations on the converted offsets gives the same positions.
  _, p = kinematics.forward_kinematics(jnp.asarray(ds.local_rot), jnp.asarray(ds.offsets[0]),
                                       rig.parents, root_pos=jnp.asarray(ds.positions[:, 0]))
  np.testing.assert_allclose(np.asarray(p), ds.positions, atol=1e-5)
  np.testing.assert_allclose(ds.offsets[0], np.asarray(rig.template_offsets), atol=1e-6)


def test_removed_joints_are_written_back_as_the_input_had_them(tmp_path, cmu_dir):
  """A BVH reduced to the rig and written on its own offsets with its removed joints
  (`PositionsFile.bvh_removed`) is the input again, less its pruned fingers: the same joints,
  parents and offsets, and every kept joint's local rotation and position the input's; here
  with a clavicle held at a constant turn that is not the identity (another lab's rig)."""
  m = bvh.read_bvh(cmu_dir / '07_01.bvh')
  m = dataclasses.replace(m, motion=m.motion[:12].copy())
  j = m.names.index('LeftShoulder')
  col = sum(len(joint.channels) for joint in m.joints[:j])
  m.motion[:, col:col + 3] = [25.0, -10.0, 5.0]  # its ZYX angles, every frame
  bvh.write_bvh(tmp_path / 'in.bvh', m, precision=None)
  rig = skeleton.cmu_body()
  motion = bvh.read_bvh(tmp_path / 'in.bvh')
  jmap = exports.bvh_joint_map(motion, rig)
  plan, out, _, p, _ = retarget.convert_motion(motion, jmap, np.eye(3), 120.0, rig.joint_names,
                                                rig.parents)
  removed = exports.removed_joints(motion, out)
  assert [c[0] for c in removed[rig.joint_names.index('LeftArm')][0]] == ['LeftShoulder']
  back = exports.solution_bvh(out.local_rot, p[:, 0], out.offsets, rig, 120.0, units='cmu',
                              orders=exports.source_rotation_orders(motion, jmap, rig),
                              removed=removed)
  fingers = {'LeftFingerBase', 'LeftHandIndex1', 'LThumb', 'RightFingerBase', 'RightHandIndex1',
             'RThumb'}
  assert set(back.names) == set(motion.names) - fingers
  src = [motion.names.index(n) for n in back.names]
  assert [back.names[q] if q >= 0 else None for q in back.parents] == [
      motion.names[motion.parents[i]] if motion.parents[i] >= 0 else None for i in src]
  np.testing.assert_allclose(back.offsets[1:], motion.offsets[src][1:], rtol=1e-8, atol=1e-12)
  # In the file's units (its 6 decimals of angles and positions, float64 elsewhere).
  np.testing.assert_allclose(bvh.naive_fk_np(back, 1.0), bvh.naive_fk_np(motion, 1.0)[:, src],
                             atol=1e-6)
  np.testing.assert_allclose(retarget.source_local_rotations(back),
                             retarget.source_local_rotations(motion)[:, src], atol=1e-6)


def test_a_joint_map_that_does_not_fit_is_said_before_the_split(tmp_path, cmu_dir):
  """A file of another rig under a named rig: its joints are the cause, not its name (which
  the committed split does not list either)."""
  text = (cmu_dir / '07_01.bvh').read_text().replace('LowerBack', 'Waist')
  (tmp_path / 'in').mkdir()
  (tmp_path / 'in' / 'zz_99.bvh').write_text(text)
  with pytest.raises(ConversionError, match=r'^zz_99.bvh: joint map cmu_body names joints the '
                     r'BVH does not have: LowerBack$'):
    conversion.convert(tmp_path / 'in', 'cmu_body', tmp_path / 'out', log=quiet)
  assert not (tmp_path / 'out').exists()


def test_files_of_another_bind_are_warned(tmp_path, cmu_dir):
  """Two subjects' files under one bind convert quietly; a file whose joints carry another
  bind (each frame rolled 90 degrees about its bone: the same motion, other zero-pose bones
  where they branch) is named in one warning, as `solve` warns for one clip."""
  roll = Rotation.from_euler('x', 90, degrees=True).as_matrix()
  for name, binds in (('same', (False, False)), ('mixed', (False, True))):
    (tmp_path / name).mkdir()
    for clip, rolled in zip(('07_01', '08_01'), binds):
      m = bvh.read_bvh(cmu_dir / f'{clip}.bvh')
      m.motion = m.motion[:21]
      C = _bind_rotations(m)
      bvh.write_bvh(tmp_path / name / f'game_{clip}.bvh', _game_engine_bvh(m, C @ roll if rolled
                                                                           else C))
    lines = []
    conversion.convert(tmp_path / name, 'auto', tmp_path / f'out_{name}', split='all',
                       units='cm', prune=FINGERS, drop_first_frame=True, rig_name='game',
                       log=lines.append)
    said = [ln for ln in lines if 'another bind' in ln]
    if name == 'same':
      assert not said, said
    else:
      assert len(said) == 1 and said[0].startswith(
          'WARNING: rig game: 1 of 2 files are another bind of its joints') and (
          "the first file's (game_07_01.bvh)" in said[0] and '(game_08_01.bvh)' in said[0]), said


def test_z_up_source_is_turned_into_the_rig_world(tmp_path, cmu_dir, z_up_copy):
  m = bvh.read_bvh(cmu_dir / '07_01.bvh')
  m.motion = m.motion[:41]
  (tmp_path / 'z').mkdir()
  bvh.write_bvh(tmp_path / 'z' / '07_01.bvh', z_up_copy(m))
  (tmp_path / 'y').mkdir()
  bvh.write_bvh(tmp_path / 'y' / '07_01.bvh', m)
  conversion.convert(tmp_path / 'z', 'cmu_body', tmp_path / 'out_z', up='z', forward='-y',
                     split='all', log=quiet)
  conversion.convert(tmp_path / 'y', 'cmu_body', tmp_path / 'out_y', split='all', log=quiet)
  z, y = data.load_shards(tmp_path / 'out_z', 'all'), data.load_shards(tmp_path / 'out_y', 'all')
  np.testing.assert_allclose(z.positions, y.positions, atol=1e-5)
  np.testing.assert_allclose(z.local_rot, y.local_rot, atol=1e-5)
  np.testing.assert_allclose(z.offsets, y.offsets, atol=1e-6)


def test_a_derived_rig_of_z_up_files_is_doubted_unless_up_is_given(tmp_path, cmu_dir, z_up_copy):
  """--rig=auto on z-up files (Blender's world): taken as y-up, the conversion warns and names
  the axis; with --up=z --forward=-y it gives the y-up files' rig and shards, with no warning."""
  for name in ('07_01', '09_01'):
    m = bvh.read_bvh(cmu_dir / f'{name}.bvh')
    m.motion = m.motion[:41]
    for world, motion in (('y', m), ('z', z_up_copy(m))):
      (tmp_path / world).mkdir(exist_ok=True)
      bvh.write_bvh(tmp_path / world / f'{name}.bvh', motion)
  kw = dict(split='all', units=CMU_UNITS, prune=FINGERS, drop_first_frame=True)
  logs = {}
  for out, world, axes in (('y', 'y', {}), ('z_as_y', 'z', {}),
                           ('z', 'z', dict(up='z', forward='-y'))):
    logs[out] = []
    conversion.convert(tmp_path / world, 'auto', tmp_path / f'out_{out}', log=logs[out].append,
                       **kw, **axes)
  warned = [ln for ln in logs['z_as_y'] if ln.startswith('WARNING')]
  assert len(warned) == 1 and "along the files' z axis" in warned[0] and '--up=z' in warned[0]
  assert not any(ln.startswith('WARNING') for ln in logs['y'] + logs['z'])
  y, z = data.load_shards(tmp_path / 'out_y', 'all'), data.load_shards(tmp_path / 'out_z', 'all')
  assert z.rig.joint_names == y.rig.joint_names
  np.testing.assert_allclose(np.asarray(z.rig.template_offsets),
                             np.asarray(y.rig.template_offsets), atol=1e-6)
  np.testing.assert_allclose(z.positions, y.positions, atol=1e-5)
  np.testing.assert_allclose(z.local_rot, y.local_rot, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Subjects are bodies (issue L): the root's OFFSET, a dummy root's included, does not count.


def test_files_differing_only_in_the_root_offset_are_one_subject(tmp_path, cmu_dir):
  from data_prep import rerig
  src = tmp_path / 'src'
  src.mkdir()
  m = bvh.read_bvh(cmu_dir / '07_12.bvh')
  m.motion = m.motion[:41]
  bvh.write_bvh(src / '07_12.bvh', m)
  m.joints[0].offset = np.array([5.0, 0.0, 3.0])  # the root's OFFSET: its channels place it
  bvh.write_bvh(src / '07_98.bvh', m)
  longer = bvh.read_bvh(src / '07_12.bvh')
  femur = longer.names.index('LeftLeg')
  longer.joints[femur].offset = longer.joints[femur].offset * 1.01  # another body
  bvh.write_bvh(src / '07_99.bvh', longer)
  conversion.convert(src, 'cmu_body', tmp_path / 'out', split='train', log=quiet)
  subjects = json.loads((tmp_path / 'out' / 'subjects.json').read_text())
  assert [(s['name'], s['files']) for s in subjects] == [('07', 2), ('07~1', 1)]
  # A dummy root whose OFFSET changes per file (rerig.py draws it from the file name).
  rerig.rerig_directory(src, tmp_path / 'rr', files=['07_12', '07_98'], log=quiet)
  offsets = [f['reference_offset'] for f in json.loads(
      (tmp_path / 'rr' / 'rerig.json').read_text())['files']]
  assert np.abs(np.subtract(*offsets)).max() > 1.0
  conversion.convert(tmp_path / 'rr', str(tmp_path / 'rr' / rerig.JOINT_MAP),
                     tmp_path / 'out_rr', split='train', log=quiet)
  subjects = json.loads((tmp_path / 'out_rr' / 'subjects.json').read_text())
  assert [(s['name'], s['files']) for s in subjects] == [('07', 2)]
  assert conversion.same_body(np.zeros((3, 3)), np.array([[1.0, 2, 3], [0, 0, 0], [0, 0, 0]]))
  assert not conversion.same_body(np.zeros((3, 3)), np.array([[0.0, 0, 0], [0, 1e-5, 0],
                                                              [0, 0, 0]]))


# ----------------------------------------------------------------------------------------------
# Namespaces: 'Anna:Hips' reads as 'Hips' (io/bvh.py `strip_namespace`).


def _in_namespace(m: bvh.BVHMotion, space: str) -> bvh.BVHMotion:
  return dataclasses.replace(m, joints=[dataclasses.replace(j, name=space + j.name)
                                        for j in m.joints])


def test_subjects_in_their_own_namespaces_derive_one_rig(tmp_path, cmu_dir):
  """Two subjects exported as 'Anna:NAME' and 'Ben:NAME' (as capture software names them): one
  `--rig=auto` hierarchy with the bare names, the same frames as the bare files."""
  inp, bare = tmp_path / 'in', tmp_path / 'bare'
  inp.mkdir()
  bare.mkdir()
  for name, space in (('07_01', 'Anna:'), ('09_01', 'Ben:')):
    m = bvh.read_bvh(cmu_dir / f'{name}.bvh')
    m.motion = m.motion[:21]
    bvh.write_bvh(inp / f'{name}.bvh', _in_namespace(m, space))
    bvh.write_bvh(bare / f'{name}.bvh', m)
  kw = dict(split='all', units=CMU_UNITS, prune=FINGERS, drop_first_frame=True, log=quiet)
  conversion.convert(inp, 'auto', tmp_path / 'out', **kw)
  conversion.convert(bare, 'auto', tmp_path / 'out_bare', **kw)
  ds = data.load_shards(tmp_path / 'out', 'all')
  ref = data.load_shards(tmp_path / 'out_bare', 'all')
  assert ds.rig.joint_names == ref.rig.joint_names and 'Hips' in ds.rig.joint_names
  np.testing.assert_array_equal(ds.positions, ref.positions)


def test_namespaced_file_and_namespaced_joint_map_read_as_bare(tmp_path, cmu_dir):
  """The solver's reader: a namespaced CMU file through the rig's own joint map, and the bare
  file through a joint map written with namespaced source names, give the bare file's joints."""
  rig = skeleton.cmu_body()
  m = bvh.read_bvh(cmu_dir / '07_05.bvh')
  m.motion = m.motion[:41]
  bvh.write_bvh(tmp_path / 'bare.bvh', m)
  bvh.write_bvh(tmp_path / 'ns.bvh', _in_namespace(m, 'mixamorig:'))
  ref = exports.read_bvh_clip(tmp_path / 'bare.bvh', rig)
  got = exports.read_bvh_clip(tmp_path / 'ns.bvh', rig)
  np.testing.assert_array_equal(got.positions, ref.positions)
  np.testing.assert_array_equal(got.offsets, ref.offsets)
  doc = json.loads((REPO / 'ik_gat_jax/io/joint_maps/cmu_body.json').read_text())
  doc.pop('$schema')
  doc['joints'] = {'mocap:' + k: v for k, v in doc['joints'].items()}
  doc['prune'] = ['mocap:' + k for k in doc['prune']]
  (tmp_path / 'map.json').write_text(json.dumps(doc))
  via_map = exports.read_bvh_clip(tmp_path / 'bare.bvh', rig, joint_map=str(tmp_path / 'map.json'))
  np.testing.assert_array_equal(via_map.positions, ref.positions)


def test_a_file_in_other_units_among_the_others_is_refused(tmp_path, cmu_dir):
  """Three CMU files and a fourth re-exported in centimetres (its OFFSETs and root channels
  x 5.6444): `--units=auto` read the first file's units only, and the fourth trained as a
  9.8 m body and stretched the derived rig's template 2.2x; refused in one line naming it and
  the units it looks like. Bodies of one lab (CMU's 0.97-1.04x) pass."""
  inp = tmp_path / 'in'
  inp.mkdir()
  for name in ('07_01', '08_01', '09_01'):
    m = bvh.read_bvh(cmu_dir / f'{name}.bvh')
    bvh.write_bvh(inp / f'{name}.bvh', dataclasses.replace(m, motion=m.motion[:21]))
  kw = dict(split='all', units='auto', prune=FINGERS, drop_first_frame=True, log=quiet)
  conversion.convert(inp, 'auto', tmp_path / 'ok', **kw)
  m = bvh.read_bvh(cmu_dir / '09_02.bvh')
  k = CMU_UNITS / 0.01
  cm = dataclasses.replace(m, joints=[dataclasses.replace(j, offset=j.offset * k, end_site=None
                                                          if j.end_site is None else
                                                          j.end_site * k) for j in m.joints],
                           motion=np.concatenate([m.motion[:21, :3] * k, m.motion[:21, 3:]], 1))
  bvh.write_bvh(inp / '10_01.bvh', cm)
  with pytest.raises(ConversionError, match=r'^10_01.bvh: its skeleton is 5.\d+x the median of '
                     r'the 4 files. \(1 file\(s\) so\), as in other units \(in cm: 0.01 m per '
                     r'unit\?\): convert files in other units on their own'):
    conversion.convert(inp, 'auto', tmp_path / 'mixed', **kw)
  assert not (tmp_path / 'mixed' / 'summary.json').exists()


def test_a_split_file_with_a_named_split_is_refused(tmp_path):
  """--split=train with --split_file: one of them was ignored (the file), silently."""
  (tmp_path / 'split.json').write_text('{}')
  with pytest.raises(ConversionError, match=r'--split_file places each file by its entry, '
                     r'--split=train puts every file in one split: give one of them'):
    conversion.convert(tmp_path, 'cmu_body', tmp_path / 'out', split='train',
                       split_file=str(tmp_path / 'split.json'), log=quiet)


def test_on_error_skip_skips_a_file_the_split_refuses(tmp_path, cmu_dir):
  """--on_error=skip: a file outside the committed split is refused in a line and the others
  converted (the split's refusal stopped the whole conversion)."""
  inp = tmp_path / 'in'
  inp.mkdir()
  (inp / '09_03.bvh').symlink_to(cmu_dir / '09_03.bvh')  # in the split, as it is
  (inp / 'zz_99.bvh').write_text((cmu_dir / '09_03.bvh').read_text() + '\n')  # not a copy
  said = []
  summary = conversion.convert(inp, 'cmu_body', tmp_path / 'out', on_error='skip',
                               log=said.append)
  assert summary['total_files'] == 1
  assert any(s.startswith('REFUSED zz_99.bvh is not in split cmu_default') for s in said), said
  with pytest.raises(ConversionError, match='zz_99.bvh is not in split'):
    conversion.convert(inp, 'cmu_body', tmp_path / 'out2', log=quiet)
