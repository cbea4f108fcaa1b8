"""The cmu_body rig on real data: every subject's bone frames near the template's, and the
swing column of Q is the bone direction the positions show."""

import numpy as np

from experiments import bone_frames_report
from ik_gat_jax import bone_frames as bf
from ik_gat_jax import data


def test_every_subjects_bone_frames_within_30_degrees_of_template(all_subject_shards):
  rows = bone_frames_report.subject_report(all_subject_shards)
  assert sorted(r['subject'] for r in rows) == ['01', '03', '05', '06', '07', '08', '09']
  for r in rows:
    assert r['max_angle_deg'] < 30.0, r


def test_q_ex_equals_observed_bone_direction_on_real_frames(all_subject_shards):
  ds = data.load_shards(all_subject_shards, 'all')
  rig = ds.rig
  idx = np.linspace(0, len(ds.positions) - 1, 400).astype(int)
  pos = np.asarray(ds.positions[idx], np.float64)
  G = np.asarray(ds.global_rot[idx], np.float64)
  B = np.asarray(ds.bone_frames, np.float64)[np.asarray(ds.subject_id[idx])]
  Q = np.asarray(bf.q_from_global(G, B))
  checked = 0
  for j, c in enumerate(rig.designated_children):
    if c < 0:
      continue
    bone = pos[:, c] - pos[:, j]
    bone /= np.linalg.norm(bone, axis=-1, keepdims=True)
    np.testing.assert_allclose(Q[:, j, :, 0], bone, atol=1e-4, err_msg=rig.joint_names[j])
    checked += 1
  assert checked == 16  # 21 joints, 5 leaves
