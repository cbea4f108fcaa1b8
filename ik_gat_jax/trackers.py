"""Named tracker subsets and joint masks for sparse inputs (issue G2).

A *tracker spec* names the joints that are observed:
  'full'                every joint;
  a named subset        `SUBSETS[rig.name]` (e.g. '6': head, hands, pelvis, feet, as an XR rig
                        with three-point plus pelvis and foot trackers; '10': those plus elbows
                        and knees);
  'A,B,C'               a comma-separated list of joint names.
The pelvis (the rig's root) is part of every named subset: XR rigs track it, and the model
centres its input on the root when it is observed (`model.observed_centre`).

The *formerly unobservable* joints are the leaves (no designated child: CMU Head, hands, toes):
from positions alone nothing shows their rotation (DESIGN section 4), which is what orientation
inputs are for.
"""

from __future__ import annotations

import numpy as np

from ik_gat_jax.skeleton import Rig

SUBSETS = {
    'cmu_body': {
        '6': ('Hips', 'Head', 'LeftHand', 'RightHand', 'LeftFoot', 'RightFoot'),
        '10': ('Hips', 'Head', 'LeftHand', 'RightHand', 'LeftFoot', 'RightFoot',
               'LeftForeArm', 'RightForeArm', 'LeftLeg', 'RightLeg'),
    },
    'smpl22': {
        '6': ('pelvis', 'head', 'left_wrist', 'right_wrist', 'left_ankle', 'right_ankle'),
        '10': ('pelvis', 'head', 'left_wrist', 'right_wrist', 'left_ankle', 'right_ankle',
               'left_elbow', 'right_elbow', 'left_knee', 'right_knee'),
    },
}
# Joints whose orientation XR trackers give (head and hands), per rig.
XR_ORIENTATIONS = {
    'cmu_body': ('Head', 'LeftHand', 'RightHand'),
    'smpl22': ('head', 'left_wrist', 'right_wrist'),
}


def named_subsets(rig: Rig) -> dict[str, tuple[str, ...]]:
  """The rig's named tracker subsets (empty for a rig without any)."""
  return SUBSETS.get(rig.name, {})


def joint_indices(rig: Rig, names) -> tuple[int, ...]:
  """Joint names (a sequence or a comma-separated string) -> indices; unknown names raise."""
  if isinstance(names, str):
    names = [n.strip() for n in names.split(',') if n.strip()]
  unknown = [n for n in names if n not in rig.joint_names]
  if unknown:
    raise ValueError(f'unknown joints {unknown} for rig {rig.name!r}; joints: '
                     f'{", ".join(rig.joint_names)}')
  return tuple(rig.joint_names.index(n) for n in names)


def tracker_mask(rig: Rig, spec: str) -> np.ndarray:
  """`[J]` bool: the joints observed under tracker spec `spec` (module docstring)."""
  subsets = named_subsets(rig)
  if spec == 'full':
    return np.ones(rig.num_joints, bool)
  names = subsets.get(spec, spec)
  if names == spec and ',' not in spec and spec not in rig.joint_names:
    raise ValueError(f'unknown tracker spec {spec!r} for rig {rig.name!r}: use full, '
                     f'{", ".join(subsets) or "(no named subsets)"}, or joint names A,B,C')
  mask = np.zeros(rig.num_joints, bool)
  mask[list(joint_indices(rig, names))] = True
  return mask


def subset_masks(rig: Rig) -> np.ndarray:
  """`[S, J]` bool: the masks of the rig's named subsets, in `SUBSETS` order (S may be 0)."""
  return np.asarray([tracker_mask(rig, s) for s in named_subsets(rig)], bool).reshape(
      -1, rig.num_joints)


def unobservable_joints(rig: Rig) -> tuple[str, ...]:
  """Leaves: joints whose rotation positions cannot show (DESIGN section 4)."""
  return tuple(n for n, c in zip(rig.joint_names, rig.designated_children) if c < 0)


def random_masks(num: int, rate: float, num_joints: int, seed: int) -> np.ndarray:
  """`[num, J]` bool: each joint dropped independently with probability `rate` (evaluation)."""
  return np.random.default_rng(seed).random((num, num_joints)) >= rate
