"""Bone frames: orthonormality, Q <-> R round trips, the observable swing column."""

import warnings

import jax.numpy as jnp
import numpy as np
from scipy.spatial.transform import Rotation as SciRot

from ik_gat_jax import bone_frames as bf
from ik_gat_jax import kinematics, skeleton
from ik_gat_jax import model as model_lib


def _pose(rig, n, seed):
  R = SciRot.random(n * rig.num_joints, random_state=seed).as_matrix()
  return jnp.asarray(R.reshape(n, rig.num_joints, 3, 3), jnp.float32)


def test_bone_frames_are_rotations_with_x_along_the_bone():
  for rig in (skeleton.cmu_body(), skeleton.smpl22()):
    off = rig.template()
    B = bf.bone_frames_np(off, rig)
    np.testing.assert_allclose(np.swapaxes(B, -1, -2) @ B, np.broadcast_to(np.eye(3), B.shape),
                               atol=1e-12)
    np.testing.assert_allclose(np.linalg.det(B), 1.0, atol=1e-12)
    for j, c in enumerate(rig.designated_children):
      if c >= 0:
        np.testing.assert_allclose(B[j, :, 0], off[c] / np.linalg.norm(off[c]), atol=1e-12)
      else:  # a leaf inherits its parent's direction
        np.testing.assert_allclose(B[j, :, 0], B[rig.parents[j], :, 0], atol=1e-12)


def test_q_local_round_trip():
  rig = skeleton.cmu_body()
  R = _pose(rig, 8, seed=0)
  B = jnp.asarray(bf.bone_frames_np(rig.template(), rig), jnp.float32)
  Q = bf.q_from_local(R, B, rig)
  np.testing.assert_allclose(bf.local_from_q(Q, B, rig), R, atol=1e-5)
  G = kinematics.local_to_global(R, rig.parents)
  np.testing.assert_allclose(bf.global_from_q(bf.q_from_global(G, B), B), G, atol=1e-5)


def test_swing_is_observable_q_ex_is_the_posed_bone():
  rig = skeleton.cmu_body()
  off = jnp.asarray(rig.template(), jnp.float32)
  R = _pose(rig, 8, seed=1)
  G, p = kinematics.forward_kinematics(R, off, rig.parents)
  Q = bf.q_from_global(G, bf.bone_frames(off, rig))
  for j, c in enumerate(rig.designated_children):
    if c < 0:
      continue
    bone = np.array(p[:, c] - p[:, j])
    bone /= np.linalg.norm(bone, axis=-1, keepdims=True)
    np.testing.assert_allclose(Q[:, j, :, 0], bone, atol=1e-5)


def test_batched_bone_frames_match_per_subject():
  rig = skeleton.cmu_body()
  rng = np.random.default_rng(0)
  subjects = rig.template()[None] * rng.uniform(0.9, 1.1, size=(3, 1, 1))
  B = np.asarray(bf.bone_frames(jnp.asarray(subjects), rig))
  for s in range(3):
    np.testing.assert_allclose(B[s], bf.bone_frames_np(subjects[s], rig), atol=1e-5)


def test_bone_chart_on_chosen_joints_is_the_per_joint_formula():
  """`bone_chart` on a joint subset (any order, repeats) = `L_j = B_p^T R_j B_j` (root:
  `R B`) per chosen joint in float64, the other joints unchanged; `inverse` undoes it."""
  rig = skeleton.cmu_body()
  R = np.asarray(_pose(rig, 4, seed=1), np.float64)
  B = bf.bone_frames_np(rig.template(), rig)
  for joints in (None, (16, 0, 9, 9, 20, 12), ()):
    want = R.copy()
    for j in (range(rig.num_joints) if joints is None else joints):
      p = rig.parents[j]
      want[:, j] = (np.eye(3) if p < 0 else B[p]).T @ R[:, j] @ B[j]
    L = bf.bone_chart(jnp.asarray(R, jnp.float32), jnp.asarray(B[None], jnp.float32),
                      rig.parents, joints)
    np.testing.assert_allclose(np.asarray(L), want, atol=1e-5)
    back = bf.bone_chart(L, jnp.asarray(B[None], jnp.float32), rig.parents, joints, inverse=True)
    np.testing.assert_allclose(np.asarray(back), R, atol=1e-5)


def test_bone_chart_of_bfloat16_rotations_with_float32_frames():
  """A bfloat16 network's output (`evaluation.cast_floating`) with the subject's float32 bone
  frames: the chosen joints' chart is computed in float32 and stored in R's dtype, each the
  float32 chart rounded once, with no dtype warning (newer JAX refuses the implicit cast)."""
  rig = skeleton.cmu_body()
  R = _pose(rig, 3, seed=2).astype(jnp.bfloat16)
  B = jnp.asarray(bf.bone_frames_np(rig.template(), rig)[None], jnp.float32)
  joints = (0, 5, 16)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    L = bf.bone_chart(R, B, rig.parents, joints, inverse=True)
  assert L.dtype == jnp.bfloat16
  want = bf.bone_chart(R.astype(jnp.float32), B, rig.parents, joints, inverse=True)
  # One bfloat16 ulp at magnitude 1 (entries are at most 1): float32 round-off in the products
  # may round an entry the other way; a wrong joint or an uncast value moves entries by ~0.1-1.
  np.testing.assert_allclose(np.asarray(L, np.float32),
                             np.asarray(want.astype(jnp.bfloat16), np.float32), atol=2.0**-8)


def test_mixed_output_through_a_joint_whose_children_are_co_located():
  """'mixed' output: a joint without a bone (its only child co-located, so a local output)
  still carries its rotation to its children: G = G_parent R there. A rig built for it (cmu_body
  with LeftLeg at LeftUpLeg's position), against the per-joint formula in float64."""
  base = skeleton.cmu_body()
  doc = base.to_json()
  names = base.joint_names
  up_leg, leg = names.index('LeftUpLeg'), names.index('LeftLeg')
  off = np.asarray(doc['template_offsets'], np.float64)
  off[leg] = 0.0
  doc['template_offsets'] = off.tolist()
  doc['designated_children'] = list(skeleton.choose_designated_children(base.parents, off))
  rig = skeleton.Rig.from_json(doc)
  assert rig.designated_children[up_leg] == -1 and rig.designated_children[leg] >= 0
  pred = np.asarray(_pose(rig, 3, seed=2), np.float64)
  B = bf.bone_frames_np(off, rig)
  local_out = [c < 0 for c in rig.designated_children]
  G = [None] * rig.num_joints
  for j, p in enumerate(rig.parents):
    if not local_out[j]:
      G[j] = pred[:, j] @ B[j].T
    else:
      G[j] = pred[:, j] if p < 0 else G[p] @ pred[:, j]
  want = np.stack([pred[:, j] if local_out[j] else G[j] if p < 0 else
                   np.swapaxes(G[p], -1, -2) @ G[j] for j, p in enumerate(rig.parents)], 1)
  got = model_lib.to_local(jnp.asarray(pred, jnp.float32), jnp.asarray(B[None], jnp.float32),
                           rig, 'mixed')
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
