"""Reading shard directories: memory maps, tables, and clear errors."""

import json

import numpy as np
import pytest

from data_prep import conversion
from ik_gat_jax import bone_frames
from ik_gat_jax import data
from ik_gat_jax import kinematics


@pytest.fixture(scope='module')
def shards(tmp_path_factory, cmu_dir):
  tmp = tmp_path_factory.mktemp('shards')
  (tmp / 'in').mkdir()
  for name in ('08_01.bvh', '09_01.bvh'):
    (tmp / 'in' / name).symlink_to(cmu_dir / name)
  conversion.convert(tmp / 'in', 'cmu_body', tmp / 'out', log=lambda message: None)
  return tmp / 'out'


def test_load_shards_memory_maps_every_array(shards):
  ds = data.load_shards(shards, 'train')
  T, J = ds.num_frames, ds.rig.num_joints
  assert T == len(ds) == ds.summary['frames']['train'] == 70 + 37 and J == 21
  expected = {'positions': ((T, J, 3), np.float32), 'local_rot': ((T, J, 3, 3), np.float32),
              'global_rot': ((T, J, 3, 3), np.float32), 'subject_id': ((T,), np.int32),
              'file_id': ((T,), np.int32), 'frame_index': ((T,), np.int32),
              'offsets': ((2, J, 3), np.float32), 'bone_frames': ((2, J, 3, 3), np.float32)}
  for name, (shape, dtype) in expected.items():
    array = getattr(ds, name)
    assert isinstance(array, np.memmap) and not array.flags.writeable, name
    assert array.shape == shape and array.dtype == dtype, name
  assert ds.fps == 30.0 and ds.rig.name == 'cmu_body'


def test_tables_index_the_arrays(shards):
  ds = data.load_shards(shards, 'train')
  assert [f['file'] for f in ds.split_files()] == ['08_01.bvh', '09_01.bvh']
  assert [s['name'] for s in ds.subjects] == ['08', '09']
  for f in ds.split_files():
    rows = slice(f['start'], f['start'] + f['frames'])
    assert np.all(ds.file_id[rows] == f['file_id'])
    assert np.all(ds.subject_id[rows] == f['subject_id'])
    np.testing.assert_array_equal(ds.frame_index[rows], np.arange(f['frames']))
  # Per subject: FK of the stored rotations on the subject's offsets gives the stored positions,
  # and the bone frames are the rig's for those offsets.
  s = ds.subject_id[:]
  _, p = kinematics.forward_kinematics(np.asarray(ds.local_rot), np.asarray(ds.offsets)[s],
                                       ds.rig.parents, root_pos=np.asarray(ds.positions[:, 0]))
  np.testing.assert_allclose(np.asarray(p), ds.positions, atol=1e-5)
  B = bone_frames.bone_frames_np(np.asarray(ds.offsets, np.float64), ds.rig)
  np.testing.assert_allclose(ds.bone_frames, B, atol=1e-6)
  summary = json.loads((shards / 'summary.json').read_text())
  assert summary['rig_fingerprint'] == ds.rig.fingerprint()


def test_missing_directory_or_split_is_a_clear_error(shards, tmp_path):
  with pytest.raises(FileNotFoundError, match='does not exist'):
    data.load_shards(tmp_path / 'nowhere', 'train')
  with pytest.raises(FileNotFoundError, match='not a shard directory'):
    data.load_shards(tmp_path, 'train')
  with pytest.raises(ValueError, match="has no split 'val'; it has: train"):
    data.load_shards(shards, 'val')
  assert data.available_splits(shards) == ('train',)
