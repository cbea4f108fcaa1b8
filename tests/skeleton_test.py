"""Rig validation errors, built-in rigs, designated children and reference axes."""

import dataclasses

import numpy as np
import pytest

from ik_gat_jax import skeleton as sk


def _base():
  return sk.cmu_body()


def test_builtin_rigs_are_valid_and_hashable():
  cmu = sk.cmu_body()
  assert cmu.num_joints == 21 and cmu.joint_names == sk.CMU_BODY_JOINTS
  assert hash(cmu) == hash(sk.cmu_body())  # usable as a jit static argument
  smpl = sk.smpl22()
  assert smpl.num_joints == 22
  assert sk.get_rig('smpl22') == smpl


def test_cmu_designated_children_skip_colocated_joints():
  rig = sk.cmu_body()
  name = lambda j: rig.joint_names[j] if j >= 0 else None
  dc = {n: name(rig.designated_children[i]) for i, n in enumerate(rig.joint_names)}
  # Hips -> LowerBack is co-located (zero offset): the bone goes to a hip instead.
  assert dc['Hips'] == 'LeftUpLeg'
  assert dc['LowerBack'] == 'Spine' and dc['Neck'] == 'Neck1' and dc['Spine1'] == 'LeftArm'
  leaves = [n for n, c in dc.items() if c is None]
  assert sorted(leaves) == sorted(['Head', 'LeftHand', 'RightHand', 'LeftToeBase', 'RightToeBase'])
  obs = dict(zip(rig.joint_names, rig.observability()))
  assert obs['Hips'] == obs['Spine1'] == 'determined'
  assert obs['LeftForeArm'] == 'swing' and obs['Head'] == 'leaf'
  assert [rig.joint_names[j] for j, c in enumerate(rig.colocated()) if c] == ['LowerBack', 'Neck']


def test_reference_axes_forward_for_near_vertical_bones():
  rig = sk.cmu_body()
  ref = dict(zip(rig.joint_names, rig.reference_axes))
  assert ref['Spine'] == ref['Neck1'] == ref['LeftUpLeg'] == 'forward'  # spine / legs vertical
  assert ref['LeftArm'] == ref['LeftForeArm'] == 'up'  # T-pose arms horizontal


def test_mirror_map():
  rig = sk.cmu_body()
  m = dict(zip(rig.joint_names, (rig.joint_names[i] for i in rig.mirror)))
  assert m['LeftArm'] == 'RightArm' and m['RightToeBase'] == 'LeftToeBase' and m['Head'] == 'Head'
  assert sk.mirror_map_from_names(['Hips', 'LHipJoint', 'RHipJoint']) == (0, 2, 1)
  # Other tools' conventions: Unreal's 'thigh_l', Blender's 'thigh.L', 'l_hip', 3ds Max
  # Biped's 'Bip01 L Thigh', upper-case words; a side letter inside a word is not one.
  names = ['pelvis', 'thigh_l', 'upper_arm.L', 'l_hip', 'Bip01 L Thigh', 'LEFT_FOOT', 'Lumbar',
           'thigh_r', 'upper_arm.R', 'r_hip', 'Bip01 R Thigh', 'RIGHT_FOOT', 'Rumbar_x']
  assert sk.mirror_map_from_names(names) == (0, 7, 8, 9, 10, 11, 6, 1, 2, 3, 4, 5, 12)
  # DAZ / Poser: an l/r prefix before a capital; 'rootJoint' and 'lumbar' are no side.
  assert sk.mirror_map_from_names(['hip', 'lThigh', 'rThigh', 'rootJoint', 'lumbar']) == (
      0, 2, 1, 3, 4)


def test_a_rig_whose_names_pair_no_sides_cannot_mirror():
  """Names with no side in them (J00, J01, ...): every joint its own partner, so mirroring
  would be wrong; the refusal says why (not that the pose is asymmetric)."""
  from ik_gat_jax import input_pipeline
  cmu = sk.cmu_body()
  plain = sk.make_rig('plain', [f'J{j:02d}' for j in range(cmu.num_joints)], cmu.parents,
                      cmu.template(), cmu.up, cmu.forward)
  assert plain.mirror == tuple(range(cmu.num_joints))
  with pytest.raises(ValueError, match=r"rig 'plain' pairs no left and right joints by name"):
    input_pipeline.check_mirror(plain)
  input_pipeline.check_mirror(cmu)


@pytest.mark.parametrize('change, message', [
    (dict(parents=(-1, 0, 1, 2, 3, 4, 5, 3, 7, 8, 3, 10, 11, 0, 13, 14, 15, 0, 17, 20, 19)),
     'topologically ordered'),
    (dict(parents=(-1, 0, 1, 2, 4, 4, 5, 3, 7, 8, 3, 10, 11, 0, 13, 14, 15, 0, 17, 18, 19)),
     'its own parent'),
    (dict(parents=(-1, 0, 1, 2, 3, 4, 5, 3, 7, 8, 3, 10, 11, -1, 13, 14, 15, 0, 17, 18, 19)),
     'second root'),
    (dict(mirror=(0, 1, 2, 3, 4, 5, 6, 10, 11, 12, 7, 8, 9, 17, 18, 19, 20, 13, 14, 15, 13)),
     'involution'),
    (dict(designated_children=(1,) + sk.cmu_body().designated_children[1:]), 'co-located'),
    (dict(designated_children=(5,) + sk.cmu_body().designated_children[1:]), 'not one of its'),
    (dict(reference_axes=('sideways',) * 21), 'reference axis'),
    (dict(joint_names=('Hips',) * 21), 'duplicate'),
    (dict(up=(0.0, 0.0, 1.0)), 'perpendicular'),
    (dict(mirror=(0,) * 5), 'entries'),
])
def test_invalid_rigs_give_clear_errors(change, message):
  with pytest.raises(sk.RigError, match=message):
    dataclasses.replace(_base(), **change)


def test_rig_json_round_trip_and_unknown_name():
  rig = sk.cmu_body()
  assert sk.Rig.from_json(rig.to_json()) == rig
  with pytest.raises(KeyError, match='no joint'):
    rig.index('Tail')
  with pytest.raises(KeyError, match='unknown rig'):
    sk.get_rig('octopus')


def test_adjacency_kinds():
  rig = sk.cmu_body()
  tree = np.asarray(rig.adjacency('tree'))
  assert tree.sum() == rig.num_joints + 2 * (rig.num_joints - 1) and (tree == tree.T).all()
  p2c = np.asarray(rig.adjacency('parent_to_child'))
  assert p2c[1, 0] and not p2c[0, 1]
  assert np.asarray(rig.adjacency('full')).all()


def test_a_reference_pose_is_world_rotations():
  """A reference pose's frames must be rotations: a scaled (an engine's cm <-> m matrix), a
  reflected or a sheared frame is refused in one line naming the joint (it rebuilt the template
  from them: bones 0.4-0.6 m off, rotations 31-175 deg from the rig's own); float32 round-off
  of a rotation passes."""
  from scipy.spatial.transform import Rotation
  rig = sk.cmu_body()
  J = rig.num_joints
  R = Rotation.random(J, random_state=0).as_matrix()
  assert sk.with_reference_pose(rig, R.astype(np.float32)).num_joints == J
  for bad, what in ((2.0 * R, 'scaled or sheared .*scales 2, 2, 2'),
                    (R @ np.diag([-1.0, 1.0, 1.0]), 'a reflection'),
                    (np.ones((J, 3, 3)), 'scaled or sheared')):
    with pytest.raises(sk.RigError, match=rf"joint Hips's frame is {what}.*\({J} joints so\): "
                       'take the rotation of each joint.s world matrix'):
      sk.with_reference_pose(rig, bad)
