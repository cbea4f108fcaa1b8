"""IK-GAT and the dense comparison networks, built from one `ModelConfig` (DESIGN section 5).

`create_model(config, rig, rngs)` returns an `IKModel`: joint positions `[..., J, 3]` (world or
root-relative, metres) -> rotations `[..., J, 3, 3]` in `config.output_space`:
  'bone_aligned'  Q_j = G_j @ B_j (world frame; `Q_j e_x` is the observed bone direction);
  'global'        G_j (world frame);
  'local'         R_j, parent-relative (the root's is its world rotation);
  'mixed'         Q_j for joints with a designated child, R_j for the others (leaves).
`to_local` turns any of them into local rotations given the subject's bone frames B;
`from_local` makes training targets in the output space from local rotations.

Pipeline of `IKModel.__call__` (the parts shared by every arch):
  1. root-relative positions (the model subtracts the root itself);
  2. scale normalisation (optional): divide by the example's mean bone length, the mean of
     |p_j - p_parent(j)| over the bones that are not co-located in the rig's template (so the
     input is in "bone lengths"; yaw invariant, and a child's size no longer shifts every input);
  3. heading canonicalisation (optional): rotate about the rig's up axis so the horizontal part
     of the hip vector p_left_hip - p_right_hip points along `rig.lateral` (the body's left at
     rest, so the canonical frame of a rest pose is the world frame). The hips are the first
     pair of root children that are mirror partners; the one with the larger template offset
     along `lateral` is left. A vertical hip vector (degenerate) leaves the yaw at identity.
     Before it, a body whose spine leans past `tilt_limit_deg` (forward or back; default 45)
     or `tilt_side_limit_deg` (sideways; default 15) is turned back towards up by twice its
     excess, so one lying down or upside down is stood up (`tilt_rotation`; sessions 44-45).
     `body_frame` (session 44; '' = off, as in every model trained before): the whole body's
     frame instead, so the input is the same for every rotation of the body (lying, on its
     side, upside down): every local rotation but the root's is exactly invariant to it and the
     root's turns with it. 'spine': the hip vector to `lateral`, the spine (the hips' midpoint
     to the chest, `chest_joint`) made orthogonal to it to `up`; 'torso': the rotation that
     best fits the torso's joints (`torso_joints`: hips, spine, neck, shoulders) to their
     places in the rig's natural pose (least squares), less moved by noise on any one joint.
     Either way the rig's natural pose maps to itself (`body_reference`), so an upright body is
     turned only by its lean. Where the chest is not observed it falls back to the heading;
  4. the backbone (arch): positions `[B, J, 3]` -> 6D `[B, J, 6]`;
  5. observed-direction head (optional): the first 6D column of every joint with a designated
     child is replaced by the observed direction to that child. Only joints whose output is
     bone-aligned have such a column, so this needs output_space 'bone_aligned' or 'mixed'
     (config validation refuses 'local' / 'global'). `observed_direction_blend` (issue J;
     needs the head): blend instead of copying. The backbone emits one more number per joint,
     a logit; with w = sigmoid(logit) (input-dependent, learned; its bias starts at
     logit(BLEND_INIT_WEIGHT) = logit(0.9), trusting the observation at first) the column is
     normalize(w d_observed + (1 - w) normalize(d_predicted)); joints without a valid observed
     direction (leaves, masked) keep the predicted column. w = 1 is the plain head (up to
     round-off); noisy or jumping joints can learn to lower it;
  6. Gram-Schmidt to rotation matrices; undo the heading (C^T @ R) on every output that lives
     in the world frame: all joints for bone_aligned / global, the root only for local, the
     bone-aligned joints and the root for mixed (leaf local rotations are yaw invariant). This
     makes world-frame outputs exactly equivariant to yaw of the input.

Backbones:
  'ikgat'        per-joint input projection (a per-joint Linear 3 -> d whose per-joint bias is the
                 learned joint embedding), L blocks of [graph attention -> ELU -> dropout ->
                 residual -> LayerNorm] over the static adjacency, a global shortcut adding the
                 input projection to the last block's output, and a per-joint (shared) MLP head
                 d -> head_hidden -> 6. `pooled_global_feature` adds Linear(mean over joints of
                 the block input) to every block's attention output (a proposed fix for leaves).
  'transformer'  the same code with full adjacency, dot-product scoring and a feed-forward
                 sub-block (d -> 2d -> d) per block; width from `DENSE_HIDDEN` (similar
                 parameter count to IK-GAT of the same size). Graph fields are ignored.
  'mlp'          flattened joints `[B, 3J]` -> L hidden layers (ELU, dropout) -> `[B, 6J]`.
Sparse inputs (issue G2; both off by default, which leaves the network and its parameters as
before). Optional keyword inputs of `IKModel.__call__`:
  joint_mask [..., J] (bool or float, 1 = observed; absent = all observed), needs
    `config.joint_mask`. Masked positions never reach the network: they are replaced by 0 with
    `jnp.where` before any use (so NaN/inf there cannot leak and their gradient is exactly 0),
    and every use of positions is restricted to observed joints: the centre (step 1) is the root
    where it is observed, else the mean of the observed joints (0 if none); the scale (step 2)
    is the mean over bones whose both ends are observed (1 if none); the heading (step 3) needs
    both hips, else it stays at identity (no canonicalisation for that example); the observed
    direction (step 5) needs the joint and its designated child. The centred input is zeroed
    again at masked joints and the flag is an input channel of the per-joint projection.
  orientations [..., J, 3, 3] world rotations G_j and orientation_mask [..., J] (1 = given;
    absent = all given), needs `config.orientation_inputs` (joint names): the 6D of G_j (in the
    canonical frame when heading canonicalisation is on) and a given-flag are 7 more input
    channels, zero for joints not named in the config or not given (`jnp.where`, as above).
  end_sites [..., E, 3] world end-site points of the rig's leaves (`rig.leaves`: head top, hand
    and toe tips) and end_site_mask [..., E] (1 = given; absent = all given), needs
    `config.end_sites`: each leaf joint gets 4 more input channels, its end site as an offset
    from the leaf joint (x `END_SITE_SCALE`; scaled and canonicalised like the positions) and a
    given-flag; zero for
    other joints and for end sites not given (`jnp.where` first, as above). End sites never
    enter the centre, the scale or the heading, so a model given none sees what it would see
    without them.
  `extra_inputs(batch, config)` picks these keys from a batch dict for the model.
Noise level (issue J, `noise_level_input`, off by default): one more input channel, the same on
  every joint, `noise_level(x)` of the canonical input: the mean relative length mismatch of
  mirror-paired bones in this frame (x NOISE_LEVEL_SCALE), a label-free estimate of how noisy
  the tracker input is (`noise_level` says why that one); appended after the G2 channels.

Causal window (issue K, `window` = k > 1, off by default): the model also takes `history
  [..., k-1, J, 3]`, the k-1 past frames (oldest first, 1 / `window_fps` s apart; `windows.py`
  builds them for clips and streams, and says how the first frames of a stream are filled). They
  go through the current frame's centre, scale and heading, and each joint gets 3 (k-1) more
  input channels, the last ones: its displacement in each past frame from the current frame
  (x `windows.HISTORY_SCALE`). The output is the current frame's rotations. Window models take
  full-body input only (no joint masks, orientations or end sites).

Every head's last layer starts near the identity 6D (bias (1,0,0,0,1,0), weights ~1e-3).
The static skeleton structure (parents, designated children, adjacency) stays Python tuples:
`Rig` and `ModelConfig` are frozen dataclasses, held as static module attributes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ik_gat_jax import bone_frames
from ik_gat_jax import kinematics
from ik_gat_jax import rotations
from ik_gat_jax import skeleton
from ik_gat_jax import windows
from ik_gat_jax.gat import AGGREGATIONS, MATMUL_PRECISIONS, SCORINGS, GraphAttention, matmul
from ik_gat_jax.skeleton import Rig

ARCHS = ('ikgat', 'mlp', 'transformer')
# size -> (hidden d, blocks L, heads); base: ~374K parameters on cmu_body (the paper's count).
SIZES = {'tiny': (64, 2, 4), 'small': (128, 3, 4), 'base': (320, 3, 4), 'large': (512, 4, 8)}
# Widths of the dense comparison networks, chosen (on cmu_body, default IK-GAT config) so that
# each has about the parameter count of IK-GAT of the same size; `param_table()` shows them.
DENSE_HIDDEN = {
    'mlp': {'tiny': 64, 'small': 144, 'base': 388, 'large': 600},
    'transformer': {'tiny': 28, 'small': 52, 'base': 128, 'large': 200},
}
ADJACENCIES = ('tree', 'parent_to_child', 'child_to_parent', 'full')
OUTPUT_SPACES = ('bone_aligned', 'local', 'global', 'mixed')
END_SITE_SCALE = 10.0  # end-site input features: offsets from the leaf, x10
BLEND_INIT_WEIGHT = 0.9  # observed_direction_blend: initial weight of the observed direction
NOISE_LEVEL_SCALE = 10.0  # noise_level_input: the mean |log length ratio| of mirror bones, x10
_IDENTITY_6D = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)


def elu(x: jax.Array) -> jax.Array:
  """ELU (alpha 1) as `exp(x) - 1` at x <= 0 instead of `jax.nn.elu`'s `expm1`: XLA's CPU
  backend evaluates expm1 about 2x slower than exp, which made the base network's three ELUs
  ~7% of a batched forward (BENCHMARKS.md, issue N session 17). The same function within 1.2e-7
  absolute (exp's round-off near 1; tests/model_test.py), the same gradient (exp(x) at x <= 0);
  exp sees 0 where x > 0, so the unselected branch never overflows into a NaN gradient."""
  return jnp.where(x > 0, x, jnp.exp(jnp.where(x > 0, 0.0, x)) - 1)


def layer_norm(norm: nnx.LayerNorm, x: jax.Array) -> jax.Array:
  """`norm(x)` (flax's LayerNorm over the last axis: fast variance E[x^2] - E[x]^2 clipped at 0,
  its epsilon, scale and bias; statistics in at least float32) with both row statistics as
  matrix-vector products with 1/d (x and x^2). XLA's CPU backend otherwise splits each mean
  over d > 32 into a squared copy, two windowed partial sums and a final sum (its
  tree-reduction rewrite; the YNN reduce fusions that would take them are off, see
  ik_gat_jax/__init__.py): five kernels over the block's activations per LayerNorm, about an
  eighth of a batched forward (BENCHMARKS.md, issue N session 23). Two products, not one of
  `[..., 2, d]` (x and x^2 stacked: a copy of twice the activations, 0.76 ms of a 64-frame call
  against 0.23 ms for the squares now; `experiments.kernel_profile`, BENCHMARKS.md session 28).
  The same function up to float32 summation order (tests/model_test.py)."""
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  xf = x.astype(dtype)
  d = x.shape[-1]
  ones = jnp.full((d,), 1.0 / d, dtype)
  mean, mean2 = xf @ ones, (xf * xf) @ ones
  var = jnp.maximum(0.0, mean2 - mean * mean)
  mul = jax.lax.rsqrt(var + norm.epsilon)[..., None] * norm.scale[...]
  y = (xf - mean[..., None]) * mul + norm.bias[...]
  return y.astype(jnp.result_type(x, norm.scale[...], norm.bias[...]))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Every model choice in one frozen (hashable, JSON-able) record; see the module docstring.

  `hidden`, `num_layers`, `num_heads`, `head_hidden` override the size's defaults when set.
  `adjacency`, `aggregation`, `scoring` and `pooled_global_feature` apply to 'ikgat' only.
  `joint_mask` adds a per-joint observed flag to the input (sparse trackers, dropped joints) and
  `orientation_inputs` names the joints whose world rotation may be given (XR trackers); see
  "Sparse inputs" in the module docstring. `end_sites` adds end-site points of the leaves.
  `bone_chart` (issue L) emits every local output (output_space 'local', the leaves of 'mixed')
  in the chart of the rest bone frames, L_j = B_parent^T R_j B_j (root: R_root B_root), which
  does not depend on how a rig defines its bind (`to_local`); off: R_j itself, as before.
  `observed_direction_blend` (with `observed_direction_head`) blends the observed and the
  predicted bone direction with a learned per-joint weight; `noise_level_input` adds a per-sample
  estimate of the input noise as one more input channel (issue J; module docstring).
  All default off: such models are unchanged.
  """
  arch: str = 'ikgat'
  size: str = 'small'
  hidden: int | None = None
  num_layers: int | None = None
  num_heads: int | None = None
  head_hidden: int | None = None
  adjacency: str = 'tree'
  aggregation: str = 'attention'
  scoring: str = 'gat'
  output_space: str = 'bone_aligned'
  dropout: float = 0.1
  observed_direction_head: bool = False
  heading_canonicalization: bool = False
  body_frame: str = ''
  tilt_limit_deg: float | None = None
  tilt_side_limit_deg: float | None = None
  scale_normalization: bool = False
  pooled_global_feature: bool = False
  joint_mask: bool = False
  orientation_inputs: tuple[str, ...] = ()
  end_sites: bool = False
  observed_direction_blend: bool = False
  noise_level_input: bool = False
  bone_chart: bool = False
  window: int = 1
  window_fps: float = 30.0

  def __post_init__(self):
    # JSON and flags give lists or a comma-separated string; keep a (hashable) tuple.
    names = self.orientation_inputs
    if isinstance(names, str):
      names = [n.strip() for n in names.split(',') if n.strip()]
    object.__setattr__(self, 'orientation_inputs', tuple(names))
    for name, allowed in (('arch', ARCHS), ('size', tuple(SIZES)), ('adjacency', ADJACENCIES),
                          ('aggregation', AGGREGATIONS), ('scoring', SCORINGS),
                          ('output_space', OUTPUT_SPACES)):
      if getattr(self, name) not in allowed:
        raise ValueError(f'ModelConfig.{name}={getattr(self, name)!r}; choose from {allowed}')
    if self.observed_direction_head and self.output_space not in ('bone_aligned', 'mixed'):
      raise ValueError('observed_direction_head replaces the bone-direction column Q e_x, which '
                       f'only bone-aligned outputs have; output_space={self.output_space!r}')
    if self.observed_direction_blend and not self.observed_direction_head:
      raise ValueError('observed_direction_blend blends the observed-direction head\'s column with '
                       'the prediction: set observed_direction_head=True as well')
    if isinstance(self.body_frame, bool):  # session 44's first runs wrote True for 'spine'
      object.__setattr__(self, 'body_frame', 'spine' if self.body_frame else '')
    if self.body_frame not in BODY_FRAMES:
      raise ValueError(f'ModelConfig.body_frame={self.body_frame!r}; choose from {BODY_FRAMES}')
    if self.tilt_limit_deg is not None and not 0.0 <= self.tilt_limit_deg <= 90.0:
      raise ValueError(f'tilt_limit_deg is an angle in [0, 90] (0 = off), got '
                       f'{self.tilt_limit_deg}')
    if self.tilt_side_limit_deg is not None and not 0.0 < self.tilt_side_limit_deg <= 90.0:
      raise ValueError(f'tilt_side_limit_deg is an angle in (0, 90], got '
                       f'{self.tilt_side_limit_deg}')
    if self.body_frame and not self.heading_canonicalization:
      raise ValueError('body_frame turns the heading canonicalisation into a whole-body frame: '
                       'set heading_canonicalization=True as well')
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f'dropout must be in [0, 1), got {self.dropout}')
    if int(self.window) != self.window or self.window < 1:
      raise ValueError(f'window is a number of frames >= 1, got {self.window}')
    if not (math.isfinite(self.window_fps) and self.window_fps > 0):
      raise ValueError(f'window_fps must be a positive frame rate, got {self.window_fps}')
    if self.window > 1 and (self.joint_mask or self.orientation_inputs or self.end_sites):
      raise ValueError('a window model (window > 1) takes full-body positions only: no '
                       'joint_mask, orientation_inputs or end_sites')

  @property
  def dims(self) -> tuple[int, int, int, int]:
    """(hidden d, blocks L, heads, head_hidden) after the overrides and the arch's width."""
    d, layers, heads = SIZES[self.size]
    if self.arch != 'ikgat':
      d = DENSE_HIDDEN[self.arch][self.size]
    d = self.hidden or d
    # The head's hidden width d/3 (rounded up to 8) puts base at ~374K parameters.
    return (d, self.num_layers or layers, self.num_heads or heads,
            self.head_hidden or 8 * math.ceil(d / 24))

  @property
  def input_features(self) -> int:
    """Per-joint input width: position (3), observed flag (1), 6D orientation and its flag (7),
    end site and its flag (4), noise level (1), past-frame displacements (3 per past frame)."""
    return (3 + int(self.joint_mask) + 7 * bool(self.orientation_inputs)
            + 4 * int(self.end_sites) + int(self.noise_level_input) + 3 * (self.window - 1))

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> 'ModelConfig':
    """From a dict, JSON object or `ml_collections.ConfigDict`; unknown keys are an error."""
    d = dict(d.to_dict() if hasattr(d, 'to_dict') else d)
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f'unknown ModelConfig fields {sorted(unknown)}')
    return cls(**d)


def _identity_sixd_init(key, shape, dtype=jnp.float32):
  """Bias `[6 * n]`: the identity 6D repeated n times."""
  del key
  return jnp.tile(jnp.asarray(_IDENTITY_6D, dtype), shape[0] // 6)


def _sixd_output(d_in: int, n_out: int, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(d_in, 6 * n_out, kernel_init=nnx.initializers.normal(1e-3),
                    bias_init=_identity_sixd_init, rngs=rngs)


def _extra_output(d_in: int, n_out: int, rngs: nnx.Rngs) -> nnx.Linear | None:
  """The blend-logit layer (`n_out` logits), or None when there is none. Created after every
  other layer, so a model without it draws exactly the parameters it drew before it existed.
  Bias `logit(BLEND_INIT_WEIGHT)`, weights ~1e-3: the blend starts near that weight everywhere."""
  if not n_out:
    return None
  w = BLEND_INIT_WEIGHT
  return nnx.Linear(d_in, n_out, kernel_init=nnx.initializers.normal(1e-3),
                    bias_init=nnx.initializers.constant(math.log(w / (1 - w))), rngs=rngs)


class PerJointLinear(nnx.Module):
  """`[B, J, d_in]` -> `[B, J, d_out]` with weights `[J, d_in, d_out]` and a per-joint bias
  `[J, d_out]`, which is the learned joint embedding."""

  def __init__(self, num_joints: int, d_in: int, d_out: int, rngs: nnx.Rngs):
    init = nnx.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal', batch_axis=0)
    self.kernel = nnx.Param(init(rngs.params(), (num_joints, d_in, d_out)))
    self.embedding = nnx.Param(0.5 * jax.random.normal(rngs.params(), (num_joints, d_out)))

  def __call__(self, x: jax.Array) -> jax.Array:
    # d_in is 3 (a position): explicit multiply-adds, which XLA fuses into one loop. Measured on
    # this CPU (batch 1 / 1024): 0.007 / 1.3 ms, against 0.03 / 28 ms for the einsum (J tiny
    # batched matmuls) and 0.32 / 2.3 ms for a broadcast-and-sum over the input axis.
    k = self.kernel[...]
    out = self.embedding[...]
    for c in range(k.shape[1]):
      out = out + x[..., c:c + 1] * k[:, c]
    return out


class Block(nnx.Module):
  """`h: [B, J, d]` -> `[B, J, d]`: LN(h + dropout(ELU(attention(h) [+ pooled]))) [+ FFN]."""

  def __init__(self, d: int, adjacency, *, num_heads: int, scoring: str, aggregation: str,
               dropout: float, pooled: bool, ffn: bool, rngs: nnx.Rngs):
    self.attn = GraphAttention(d, d, adjacency, num_heads=num_heads, scoring=scoring,
                               aggregation=aggregation, rngs=rngs)
    self.pool = nnx.Linear(d, d, rngs=rngs) if pooled else None
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    if ffn:  # the Transformer's feed-forward sub-block
      self.ffn_in, self.ffn_out = nnx.Linear(d, 2 * d, rngs=rngs), nnx.Linear(2 * d, d, rngs=rngs)
      self.ffn_norm = nnx.LayerNorm(d, rngs=rngs)
    else:
      self.ffn_in = self.ffn_out = self.ffn_norm = None

  def __call__(self, h: jax.Array, *, deterministic: bool) -> jax.Array:
    a = self.attn(h, training=not deterministic)
    if self.pool is not None:
      a = a + self.pool(jnp.mean(h, axis=-2, keepdims=True))
    h = layer_norm(self.norm, h + self.dropout(elu(a), deterministic=deterministic))
    if self.ffn_in is not None:
      f = self.ffn_out(nnx.gelu(self.ffn_in(h)))
      h = layer_norm(self.ffn_norm, h + self.dropout(f, deterministic=deterministic))
    return h


class GraphNet(nnx.Module):
  """IK-GAT / Transformer backbone: per-joint inputs `[B, J, d_in]` -> 6D `[B, J, 6]`.

  Node i's output depends only on the inputs of nodes within L hops (the input projection, the
  shortcut and the head are per joint), unless `pooled` mixes in the whole body.
  """

  def __init__(self, num_joints: int, adjacency, *, d: int, num_layers: int, num_heads: int,
               head_hidden: int, scoring: str, aggregation: str, dropout: float,
               pooled: bool, ffn: bool, rngs: nnx.Rngs, d_in: int = 3, extra_out: int = 0):
    self.embed = PerJointLinear(num_joints, d_in, d, rngs)
    self.blocks = nnx.List([
        Block(d, adjacency, num_heads=num_heads, scoring=scoring, aggregation=aggregation,
              dropout=dropout, pooled=pooled, ffn=ffn, rngs=rngs) for _ in range(num_layers)])
    self.head_hidden = nnx.Linear(d, head_hidden, rngs=rngs)
    self.head_out = _sixd_output(head_hidden, 1, rngs)
    self.extra_out = _extra_output(head_hidden, extra_out, rngs)
    self.matmul_precision = 'float32'  # the head's hidden product (static; set_matmul_precision)

  def __call__(self, x: jax.Array, *, deterministic: bool) -> jax.Array:
    """-> `[B, J, 6]`, or `[B, J, 6 + extra_out]` (the 6D, then the extra logits)."""
    h0 = self.embed(x)
    h = h0
    for block in self.blocks:
      h = block(h, deterministic=deterministic)
    head = self.head_hidden
    f = elu(matmul(h + h0, head.kernel[...], self.matmul_precision)  # global shortcut: + h0
            + head.bias[...])
    if self.extra_out is None:
      return self.head_out(f)
    return jnp.concatenate([self.head_out(f), self.extra_out(f)], axis=-1)


class MLPNet(nnx.Module):
  """Dense baseline: per-joint inputs `[B, J, d_in]` flattened -> L hidden layers -> 6D
  `[B, J, 6]`."""

  def __init__(self, num_joints: int, *, d: int, num_layers: int, dropout: float,
               rngs: nnx.Rngs, d_in: int = 3, extra_out: int = 0):
    widths = [d_in * num_joints] + [d] * num_layers
    self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths, widths[1:])])
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.out = _sixd_output(d, num_joints, rngs)
    self.extra_out = _extra_output(d, extra_out * num_joints, rngs)

  def __call__(self, x: jax.Array, *, deterministic: bool) -> jax.Array:
    """-> `[B, J, 6]`, or `[B, J, 6 + extra_out]` (the 6D, then the extra logits)."""
    h = x.reshape(x.shape[0], -1)
    for layer in self.layers:
      h = self.dropout(elu(layer(h)), deterministic=deterministic)
    sixd = self.out(h).reshape(*x.shape[:-1], 6)
    if self.extra_out is None:
      return sixd
    return jnp.concatenate([sixd, self.extra_out(h).reshape(*x.shape[:-1], -1)], axis=-1)


# ----------------------------------------------------------------------------------------------
# Static rig helpers (plain Python / numpy, outside jit).


def hip_pair(rig: Rig) -> tuple[int, int]:
  """(left, right): the first mirror pair among the root's children; left is the one whose
  template offset, in the world at the rig's reference pose (`Rig.reference_offsets`: not the
  zero pose, which a re-rigged rig may crumple), lies further along `rig.lateral` (the first of
  the pair without a template)."""
  kids = rig.children[0]
  for a in kids:
    b = rig.mirror[a]
    if b != a and b in kids:
      if rig.template_offsets:
        lat = rig.reference_offsets()[[a, b]] @ np.asarray(rig.lateral)  # world, natural pose
        return (a, b) if lat[0] >= lat[1] else (b, a)
      return (a, b)
  raise ValueError(f'rig {rig.name!r}: no mirror pair among the root children '
                   f'{[rig.joint_names[k] for k in kids]}, so no hip vector for the heading')


def world_frame_outputs(rig: Rig, output_space: str) -> tuple[bool, ...]:
  """Per joint: does its output rotation live in the world frame (and so turn with yaw)?"""
  if output_space in ('bone_aligned', 'global'):
    return (True,) * rig.num_joints
  if output_space == 'local':
    return tuple(p < 0 for p in rig.parents)
  return tuple(p < 0 or c >= 0 for p, c in zip(rig.parents, rig.designated_children))


def _scale_bones(rig: Rig) -> tuple[int, ...]:
  """Joints j whose bone (parent(j) -> j) counts for the scale: not co-located at rest."""
  coloc = rig.colocated() if rig.template_offsets else (False,) * rig.num_joints
  return tuple(j for j, p in enumerate(rig.parents) if p >= 0 and not coloc[j])


def mirror_bone_pairs(rig: Rig) -> tuple[tuple[int, int], ...]:
  """(j, m(j)) with j < m(j): bones parent(j) -> j whose mirror bone is parent(m) -> m, both
  counting for the scale (cmu_body: the 7 arm and leg bone pairs)."""
  bones = set(_scale_bones(rig))
  return tuple((j, m) for j, m in enumerate(rig.mirror) if j < m and j in bones and m in bones
               and rig.mirror[rig.parents[j]] == rig.parents[m])


# ----------------------------------------------------------------------------------------------
# Pure pre/post-processing.


BODY_FRAMES = ('', 'spine', 'torso')
# A heading-only model's `tilt_limit_deg` and `tilt_side_limit_deg` where its config leaves them
# None (every model trained before session 45): the tilt, leaning forward or back and leaning
# sideways, past which a body is turned back towards up (`tilt_rotation`). Chosen on val
# (BENCHMARKS.md "The whole body turned").
TILT_LIMIT_DEG = 45.0
TILT_SIDE_LIMIT_DEG = 15.0


def torso_joints(rig: Rig, hips: tuple[int, int], chest: int) -> tuple[int, ...]:
  """The joints `body_rotation` fits with 'torso': the root and its children, the spine from
  the root to the chest, and the chest's children (cmu_body: the hips, spine, neck and
  shoulders; smpl22: the hips, spine, neck and collars)."""
  spine, j = [], chest
  while j > 0:
    spine.append(j)
    j = rig.parents[j]
  return tuple(sorted({0, *rig.children[0], *hips, *spine, *rig.children[chest]}))


def chest_joint(rig: Rig, hips: tuple[int, int]) -> int:
  """The joint whose position gives `body_rotation` its up: from the root, its child that is
  not a hip with the most descendants, then designated children down to the first joint where
  the body branches (the chest: cmu_body's Spine1, smpl22's spine3) or a leaf."""
  sizes = skeleton.num_descendants(rig.parents)
  kids = [k for k in rig.children[0] if k not in hips]
  if not kids:
    raise ValueError(f'rig {rig.name!r}: the root has no child but the hips, so no spine for '
                     'the body frame')
  j = max(kids, key=lambda k: sizes[k])
  while len(rig.children[j]) == 1 and rig.designated_children[j] >= 0:
    j = rig.designated_children[j]
  return j


def spine_vector(x, hips: tuple[int, int], chest: int):
  """`x: [B, J, 3]` (numpy or JAX) -> `[B, 3]`: the hips' midpoint to the chest, the body's up
  for `_body_frame`, `tilt_rotation` and the model's tilt test."""
  return x[:, chest] - 0.5 * (x[:, hips[0]] + x[:, hips[1]])


def _body_frame(x, hips: tuple[int, int], chest: int, xp=jnp):
  """`x: [B, J, 3]` -> (`[B, 3, 3]` the body's frame, columns the unit hip vector `x[left] -
  x[right]`, the spine's part orthogonal to it (the hips' midpoint to `x[chest]`) and their cross
  product; valid `[B]`: both longer than 1e-6)."""
  hip = x[:, hips[0]] - x[:, hips[1]]
  spine = spine_vector(x, hips, chest)
  hn = xp.linalg.norm(hip, axis=-1, keepdims=True)
  u = hip / xp.maximum(hn, 1e-12)
  v = spine - xp.sum(spine * u, -1, keepdims=True) * u
  vn = xp.linalg.norm(v, axis=-1, keepdims=True)
  valid = (hn[:, 0] > 1e-6) & (vn[:, 0] > 1e-6)
  v = v / xp.maximum(vn, 1e-12)
  return xp.stack([u, v, xp.cross(u, v)], axis=-1), valid


def body_reference(rig: Rig, hips: tuple[int, int], chest: int, kind: str = 'spine'
                   ) -> np.ndarray:
  """What `body_rotation` maps every body to, from the rig's reference pose (its natural pose;
  the template's positions): 'spine', the `[3, 3]` body frame (`_body_frame`) of that pose, or
  `[lateral up forward]` for a rig without a template; 'torso', `[K, 3]` the `torso_joints`'
  positions in that pose about their mean (`[0]` without a template: no 'torso' then). Either
  way a body in the rig's natural pose stays where it is, as with the heading alone."""
  canon = np.stack([rig.lateral, rig.up, rig.forward], axis=-1)
  if not rig.template_offsets:
    if kind == 'torso':
      raise ValueError(f"rig {rig.name!r} has no template: body_frame='torso' fits the torso to "
                       "the template's; use 'spine'")
    return canon
  x = rig.reference_positions()
  if kind == 'torso':
    r = x[list(torso_joints(rig, hips, chest))]
    return r - r.mean(axis=0)
  F, valid = _body_frame(x[None], hips, chest, xp=np)
  return F[0] if valid[0] else canon


def body_rotation(x: jax.Array, hips: tuple[int, int], chest: int, reference: np.ndarray,
                  torso: tuple[int, ...] | None = None, weights: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
  """`x: [B, J, 3]` -> (`C_canon_world [B, 3, 3]`, valid `[B]`); identity where invalid.

  Without `torso` ('spine'): the rotation taking the body's frame (`_body_frame`: the hip
  vector, the spine orthogonal to it) to `reference` (`body_reference`), invalid where the hip
  vector or that part of the spine is under 1e-6. With `torso` ('torso'): the rotation that
  best fits the `torso` joints to `reference [K, 3]` (least squares, both about their means:
  the Kabsch solution by a 3 x 3 SVD), each joint weighted by `weights [B, K]` (1 where
  absent; 0 drops a joint), so noise on each joint moves the frame less than on two; invalid
  where the hips' frame is (the fit is then not unique either). Either way exactly
  equivariant: C(x W^T) = C(x) W^T for any rotation W."""
  F, valid = _body_frame(x, hips, chest)
  if torso is None:
    C = jnp.asarray(reference, x.dtype) @ jnp.swapaxes(F, -1, -2)
  else:
    pts = x[:, list(torso)]
    w = jnp.ones(pts.shape[:2], x.dtype) if weights is None else weights.astype(x.dtype)
    mean = jnp.sum(w[..., None] * pts, 1) / jnp.maximum(jnp.sum(w, 1), 1e-12)[:, None]
    N = jnp.einsum('bk,bki,kj->bij', w, pts - mean[:, None], jnp.asarray(reference, x.dtype))
    U, _, Vt = jnp.linalg.svd(N)
    V = jnp.swapaxes(Vt, -1, -2)
    d = jnp.sign(jnp.linalg.det(V @ jnp.swapaxes(U, -1, -2)))
    C = (V * jnp.stack([jnp.ones_like(d), jnp.ones_like(d), d], -1)[:, None]
         ) @ jnp.swapaxes(U, -1, -2)
  return jnp.where(valid[:, None, None], C, jnp.eye(3, dtype=x.dtype)), valid


def tilt_rotation(x: jax.Array, rig: Rig, hips: tuple[int, int], chest: int, limit: float,
                  side_limit: float | None = None) -> tuple[jax.Array, jax.Array]:
  """`x: [B, J, 3]` -> (`[B, 3, 3]`, tilted `[B]`): a body whose spine (`spine_vector`) is tilted
  from `rig.up` by `theta` more than its limit `L` turned back towards up, about the horizontal
  axis `spine x up`, to the tilt reflected at the limit, `r = max(0, min(theta, 2 L - theta))`.

  `L` (radians) is `limit` for a body leaning forward or back and `side_limit` (default `limit`)
  for one leaning sideways, `L = limit + (side_limit - limit) c^2` between them, `c` the cosine
  of the angle between the hip vector and the way up, both in the plane normal to the spine (1:
  the body leans towards a hip). So bodies within their limit are left as they are, a body
  leaning past it is read as leaning as much less, and one tilted `2 L` or more (lying: 90 deg,
  upside down) is turned all the way up, the minimal rotation of its spine to up: whatever its
  orientation, the heading then gives it one input, the upright body's. Upside down (theta near
  pi) the turn is about the horizontal hip vector; any horizontal axis there gives the same
  input up to a turn about up, which the heading removes, so the input is continuous in the pose
  everywhere. Identity, and not tilted, where the body is within its limit or the spine is
  shorter than 1e-6."""
  up = jnp.asarray(rig.up, x.dtype)
  spine = spine_vector(x, hips, chest)
  axis = jnp.cross(spine, up)
  sin, cos = rotations.safe_norm(axis), jnp.sum(spine * up, -1)
  theta = jnp.arctan2(sin, cos)
  hip = x[:, hips[0]] - x[:, hips[1]]
  L = jnp.full_like(theta, limit)
  if side_limit is not None and side_limit != limit:
    s = rotations.normalize(spine)
    towards_up = rotations.normalize(up - cos[:, None] / jnp.maximum(
        rotations.safe_norm(spine), 1e-12)[:, None] * s)
    h = rotations.normalize(hip - jnp.sum(hip * s, -1, keepdims=True) * s)
    c = jnp.abs(jnp.sum(towards_up * h, -1))
    L = limit + (side_limit - limit) * c * c
  phi = theta - jnp.maximum(0.0, jnp.minimum(theta, 2.0 * L - theta))
  flat = hip - jnp.sum(hip * up, -1, keepdims=True) * up  # upside down: turn about the hips
  flat = jnp.where(rotations.safe_norm(flat, keepdims=True) > 1e-9, flat,
                   jnp.asarray(rig.lateral, x.dtype))
  u = jnp.where((sin > 1e-6 * rotations.safe_norm(spine))[:, None], axis, flat)
  T = rotations.matrix_from_axis_angle(rotations.normalize(u) * phi[:, None])
  tilted = (rotations.safe_norm(spine) > 1e-6) & (phi > 0)
  return jnp.where(tilted[:, None, None], T, jnp.eye(3, dtype=x.dtype)), tilted


def heading_rotation(x: jax.Array, rig: Rig, hips: tuple[int, int]) -> jax.Array:
  """`x: [B, J, 3]` -> `C_canon_world [B, 3, 3]`, a rotation about `rig.up` taking the
  horizontal hip vector `x[left] - x[right]` to `rig.lateral` (identity where it is vertical)."""
  up, lateral = jnp.asarray(rig.up, x.dtype), jnp.asarray(rig.lateral, x.dtype)
  hip = x[:, hips[0]] - x[:, hips[1]]
  horiz = hip - jnp.sum(hip * up, -1, keepdims=True) * up
  ok = rotations.safe_norm(horiz, keepdims=True) > 1e-6
  u = jnp.where(ok, rotations.normalize(horiz), lateral)
  frame = jnp.stack([u, jnp.broadcast_to(up, u.shape), jnp.cross(u, up)], axis=-1)  # [u v w]
  canon = jnp.stack([lateral, up, jnp.asarray(rig.forward, x.dtype)], axis=-1)  # [L U F]
  return canon @ jnp.swapaxes(frame, -1, -2)


def observed_directions(x: jax.Array, rig: Rig,
                        mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """`x: [B, J, 3]` -> (unit direction to the designated child `[B, J, 3]`, valid `[B, J]`);
  invalid for leaves, where the child sits on the joint, and (with `mask: [B, J]` bool) where
  the joint or its child is not observed."""
  child = np.asarray([c if c >= 0 else j for j, c in enumerate(rig.designated_children)])
  has = np.asarray([c >= 0 for c in rig.designated_children])
  v = x[:, child] - x
  valid = has & (rotations.safe_norm(v) > 1e-6)
  if mask is not None:
    valid = valid & mask & mask[:, child]
  return rotations.normalize(v), valid


def noise_level(x: jax.Array, rig: Rig, mask: jax.Array | None = None) -> jax.Array:
  """`x: [B, J, 3]` -> `[B]`: a label-free estimate of how noisy the input is, the mean over
  mirror bone pairs (`mirror_bone_pairs`) of `|log(l_left / l_right)|`, the relative length
  mismatch of a bone and its mirror bone in this frame, x NOISE_LEVEL_SCALE.

  Why these: a body is (nearly) left/right symmetric and the bone-length augmentation keeps
  pairs equal, so the clean mismatch is small (the subject's own asymmetry, ~0.01-0.03 on CMU),
  while position noise, bone-length jitter and a jumping joint all raise it (sigma 10 mm: about
  2 sigma / l ~ 0.1 for a 20 cm bone). It needs no bone lengths at inference (unlike a
  comparison with the subject's rest offsets), no template (which subjects' proportions would
  confound) and is invariant to the centre, scale and heading. With `mask: [B, J]` bool only
  pairs with all four ends observed count (0 when none is). Differentiable (safe norms; the
  |.| has gradient 0 at 0)."""
  pairs = np.asarray(mirror_bone_pairs(rig)).reshape(-1, 2)
  parents = np.asarray(rig.parents)
  ends = np.concatenate([pairs, parents[pairs]], axis=-1)  # [P, 4]: j, m, parent(j), parent(m)
  lengths = rotations.safe_norm(x[:, pairs] - x[:, parents[pairs]])  # [B, P, 2]
  ok = jnp.all(lengths > 1e-6, axis=-1)
  if mask is not None:
    ok = ok & jnp.all(mask[:, ends], axis=-1)
  safe = jnp.where(ok[..., None], lengths, 1.0)
  r = jnp.abs(jnp.log(safe[..., 0]) - jnp.log(safe[..., 1]))
  r = jnp.sum(jnp.where(ok, r, 0.0), -1) / jnp.maximum(jnp.sum(ok, -1), 1)
  return NOISE_LEVEL_SCALE * r


def observed_centre(positions: jax.Array, mask: jax.Array) -> jax.Array:
  """`positions: [B, J, 3]` (zero where masked), `mask: [B, J]` bool -> `[B, 3]`: the root where
  it is observed, else the mean of the observed joints (0 when none is)."""
  m = mask.astype(positions.dtype)[..., None]
  mean = jnp.sum(positions * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
  return jnp.where(mask[:, :1], positions[:, 0], mean)


def extra_inputs(batch: Mapping[str, Any], config: ModelConfig) -> dict[str, Any]:
  """The optional model inputs (module docstring) that `batch` holds and `config` takes."""
  keys = (('joint_mask',) if config.joint_mask else ()) + (
      ('orientations', 'orientation_mask') if config.orientation_inputs else ()) + (
      ('end_sites', 'end_site_mask') if config.end_sites else ()) + (
      ('history',) if config.window > 1 else ())
  return {k: batch[k] for k in keys if k in batch}


class IKModel(nnx.Module):
  """Positions `[..., J, 3]` -> rotations `[..., J, 3, 3]` in `config.output_space`."""

  def __init__(self, config: ModelConfig, rig: Rig, rngs: nnx.Rngs):
    self.config, self.rig = config, rig
    self.hips = hip_pair(rig) if config.heading_canonicalization else None
    self.chest = chest_joint(rig, self.hips) if config.body_frame else None
    self.body_frame_on = bool(config.body_frame)
    self.body_reference = (body_reference(rig, self.hips, self.chest, config.body_frame)
                           if config.body_frame else None)
    self.torso = (torso_joints(rig, self.hips, self.chest) if config.body_frame == 'torso'
                  else None)
    limit = TILT_LIMIT_DEG if config.tilt_limit_deg is None else config.tilt_limit_deg
    side = (min(TILT_SIDE_LIMIT_DEG, limit) if config.tilt_side_limit_deg is None
            else config.tilt_side_limit_deg)
    # radians, forward or back and sideways; None: no tilt limit (the heading alone, body_frame)
    self.tilt_limit = self.tilt_side_limit = None
    if config.heading_canonicalization and not config.body_frame and limit > 0:
      try:
        self.chest = chest_joint(rig, self.hips)
        self.tilt_limit, self.tilt_side_limit = math.radians(limit), math.radians(side)
      except ValueError:  # no spine beside the hips: the heading alone
        pass
    J = rig.num_joints
    unknown = [n for n in config.orientation_inputs if n not in rig.joint_names]
    if unknown:
      raise ValueError(f'orientation_inputs {unknown} are not joints of rig {rig.name!r}')
    # Static per-joint flag: does this joint take an orientation input?
    self.orientation_joints = tuple(n in config.orientation_inputs for n in rig.joint_names)
    if config.noise_level_input and not mirror_bone_pairs(rig):
      raise ValueError(f'noise_level_input compares mirror-paired bones; rig {rig.name!r} has none')
    d, layers, heads, head_hidden = config.dims
    d_in = config.input_features
    extra = int(config.observed_direction_blend)  # the blend logit
    if config.arch == 'mlp':
      self.backbone = MLPNet(J, d=d, num_layers=layers, dropout=config.dropout, rngs=rngs,
                             d_in=d_in, extra_out=extra)
    else:
      graph = config.arch == 'ikgat'
      self.backbone = GraphNet(
          J, rig.adjacency(config.adjacency if graph else 'full'), d=d, num_layers=layers,
          num_heads=heads, head_hidden=head_hidden,
          scoring=config.scoring if graph else 'dot',
          aggregation=config.aggregation if graph else 'attention', dropout=config.dropout,
          pooled=graph and config.pooled_global_feature, ffn=not graph, rngs=rngs, d_in=d_in,
          extra_out=extra)

  def canonical_input(self, positions: jax.Array, mask: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array | None]:
    """`[B, J, 3]` -> (network input `[B, J, 3]`, `C_canon_world [B, 3, 3]` or None).

    `mask: [B, J]` bool (1 = observed) or None (all observed, the original path): the input is
    zero at masked joints and a function of the observed positions only (module docstring).
    """
    x, C, _ = self.canonical_points(positions, mask)
    return x, C

  def canonical_points(self, positions: jax.Array, mask: jax.Array | None = None,
                       points: jax.Array | None = None, points_given: jax.Array | None = None
                       ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """`canonical_input` plus extra points `[B, E, 3]` (end sites) given where `points_given
    [B, E]` is True, put through the same centre, scale and heading (zero where not given);
    the third output is None without points. The points never affect the first two outputs."""
    if mask is None:
      centre = positions[:, :1]
      x = positions - centre
    else:
      positions = jnp.where(mask[..., None], positions, 0.0)  # first: NaN/inf never get through
      centre = observed_centre(positions, mask)[:, None]
      x = jnp.where(mask[..., None], positions - centre, 0.0)
    pts = None
    if points is not None:
      pts = jnp.where(points_given[..., None], points.astype(x.dtype), 0.0)
      pts = jnp.where(points_given[..., None], pts - centre, 0.0)
    if self.config.scale_normalization:
      bones = np.asarray(_scale_bones(self.rig))
      parents = np.asarray(self.rig.parents)[bones]
      lengths = rotations.safe_norm(x[:, bones] - x[:, parents])
      if mask is None:
        s = jnp.mean(lengths, axis=-1)
      else:  # bones with both ends observed
        both = mask[:, bones] & mask[:, parents]
        s = jnp.sum(jnp.where(both, lengths, 0.0), -1) / jnp.maximum(jnp.sum(both, -1), 1)
      x = x / jnp.where(s > 1e-6, s, 1.0)[:, None, None]
      if pts is not None:
        pts = pts / jnp.where(s > 1e-6, s, 1.0)[:, None, None]
    if not self.config.heading_canonicalization:
      return x, None, pts
    C = heading_rotation(x, self.rig, self.hips)
    if self.tilt_limit is not None:
      up = jnp.asarray(self.rig.up, x.dtype)
      spine = spine_vector(x, self.hips, self.chest)
      length = rotations.safe_norm(spine)
      least = min(self.tilt_limit, self.tilt_side_limit)
      leans = (jnp.sum(spine * up, -1) < math.cos(least) * length) & (length > 1e-6)
      seen = True
      if mask is not None:  # the hips and the chest observed, else no tilt limit
        seen = mask[:, self.hips[0]] & mask[:, self.hips[1]] & mask[:, self.chest]

      def turned(C):
        T, tilted = tilt_rotation(x, self.rig, self.hips, self.chest, self.tilt_limit,
                                  self.tilt_side_limit)
        return jnp.where((tilted & seen)[:, None, None], heading_rotation(
            jnp.einsum('bij,bkj->bki', T, x), self.rig, self.hips) @ T, C)

      # Only where some body leans past the smaller limit (a live upright frame skips the
      # work); an untilted one keeps the heading computed as before the limit, bit for bit.
      C = jax.lax.cond(jnp.any(leans & seen), turned, lambda C: C, C)
    if self.body_frame_on:
      Cb, valid = body_rotation(
          x, self.hips, self.chest, self.body_reference, self.torso,
          None if mask is None or self.torso is None else mask[:, list(self.torso)])
      if mask is not None:
        valid = valid & mask[:, self.chest]
      C = jnp.where(valid[:, None, None], Cb, C)
    if mask is not None:  # a hip not observed: no canonicalisation for that example
      hips_seen = mask[:, self.hips[0]] & mask[:, self.hips[1]]
      C = jnp.where(hips_seen[:, None, None], C, jnp.eye(3, dtype=C.dtype))
    if pts is not None:
      pts = jnp.einsum('bij,bkj->bki', C, pts)
    return jnp.einsum('bij,bkj->bki', C, x), C, pts

  def _input_masks(self, joint_mask, orientations, orientation_mask, B: int):
    """Checks the optional inputs against the config; returns (joint mask [B, J] bool or None,
    orientation flags [B, J] bool or None)."""
    J = self.rig.num_joints
    if joint_mask is not None and not self.config.joint_mask:
      raise ValueError('this model was trained without joint masks (ModelConfig.joint_mask='
                       'False): it needs every joint; retrain with joint_mask=True')
    if orientations is not None and not self.config.orientation_inputs:
      raise ValueError('this model takes no orientation inputs (ModelConfig.orientation_inputs '
                       'is empty)')
    mask = None
    if self.config.joint_mask:
      mask = (jnp.ones((B, J), bool) if joint_mask is None else
              jnp.broadcast_to(jnp.asarray(joint_mask) > 0.5, (B, J)))
    given = None
    if self.config.orientation_inputs:
      given = jnp.zeros((B, J), bool) if orientations is None else (
          jnp.ones((B, J), bool) if orientation_mask is None else
          jnp.broadcast_to(jnp.asarray(orientation_mask) > 0.5, (B, J)))
      given = given & np.asarray(self.orientation_joints)
    return mask, given

  def input_features(self, x: jax.Array, C: jax.Array | None, mask, orientations,
                     given, end_points: jax.Array | None = None,
                     end_given: jax.Array | None = None) -> jax.Array:
    """Canonical positions `[B, J, 3]` (+ observed flag, + 6D orientation and given-flag, + end
    site `[B, E, 3]` canonical, zero where not given, and given-flag `[B, E]` on the leaves) ->
    the per-joint network input `[B, J, config.input_features]`."""
    feats = [x]
    if mask is not None:
      feats.append(mask[..., None].astype(x.dtype))
    if given is not None:
      if orientations is None:
        sixd = jnp.zeros(x.shape[:-1] + (6,), x.dtype)
      else:
        G = jnp.where(given[..., None, None], orientations.astype(x.dtype), 0.0)
        if C is not None:  # into the canonical frame, like the positions
          G = C[:, None] @ G
        sixd = jnp.where(given[..., None], rotations.sixd_from_matrix(G), 0.0)
      feats += [sixd, given[..., None].astype(x.dtype)]
    if end_given is not None:
      leaves = np.asarray(self.rig.leaves)
      # The end site as an offset from its leaf joint, x10 (a 5-20 cm vector in decimetres): the
      # leaf's swing is this direction, which a point relative to the body centre (~1 m) hides
      # in a small difference of two large inputs (measured: no gain on the leaves that way).
      rel = END_SITE_SCALE * (end_points - x[:, leaves])
      pts = jnp.zeros(x.shape, x.dtype).at[:, leaves].set(
          jnp.where(end_given[..., None], rel, 0.0))
      flag = jnp.zeros(x.shape[:-1] + (1,), x.dtype).at[:, leaves, 0].set(
          end_given.astype(x.dtype))
      feats += [pts, flag]
    if self.config.noise_level_input:  # the last channel, the same on every joint
      level = noise_level(x, self.rig, mask).astype(x.dtype)
      feats.append(jnp.broadcast_to(level[:, None, None], x.shape[:-1] + (1,)))
    return feats[0] if len(feats) == 1 else jnp.concatenate(feats, axis=-1)

  def __call__(self, positions: jax.Array, *, deterministic: bool,
               joint_mask: jax.Array | None = None, orientations: jax.Array | None = None,
               orientation_mask: jax.Array | None = None, end_sites: jax.Array | None = None,
               end_site_mask: jax.Array | None = None,
               history: jax.Array | None = None) -> jax.Array:
    """`positions [..., J, 3]` (+ the optional sparse inputs of the module docstring; a window
    model's `history [..., window-1, J, 3]`, the past frames oldest first) -> rotations
    `[..., J, 3, 3]` in `config.output_space`."""
    batch, J = positions.shape[:-2], self.rig.num_joints
    B = math.prod(batch)
    mask, given = self._input_masks(
        None if joint_mask is None else jnp.reshape(joint_mask, (-1, J)),
        orientations, None if orientation_mask is None else jnp.reshape(orientation_mask, (-1, J)),
        B)
    E = len(self.rig.leaves)
    if end_sites is not None and not self.config.end_sites:
      raise ValueError('this model takes no end sites (ModelConfig.end_sites=False)')
    end_given = None
    if self.config.end_sites:
      end_given = jnp.zeros((B, E), bool) if end_sites is None else (
          jnp.ones((B, E), bool) if end_site_mask is None else
          jnp.broadcast_to(jnp.reshape(jnp.asarray(end_site_mask), (-1, E)) > 0.5, (B, E)))
    K = self.config.window - 1
    if history is not None and not K:
      raise ValueError('this model sees one frame (ModelConfig.window=1): it takes no history')
    if K:  # past frames go through the same centre, scale and heading as the current one
      if history is None:
        raise ValueError(f'this window model (ModelConfig.window={K + 1}) needs history '
                         f'[..., {K}, J, 3], the past frames (windows.py)')
      x, C, past = self.canonical_points(
          positions.reshape(-1, J, 3), mask, history.reshape(B, K * J, 3),
          jnp.ones((B, K * J), bool))
      end_points = None
    else:
      x, C, end_points = self.canonical_points(
          positions.reshape(-1, J, 3), mask,
          None if end_given is None else (jnp.zeros((B, E, 3), positions.dtype)
                                          if end_sites is None else end_sites.reshape(-1, E, 3)),
          end_given)
    feats = self.input_features(
        x, C, mask, None if orientations is None else orientations.reshape(-1, J, 3, 3), given,
        end_points, end_given)
    if K:  # the last channels: each past frame's displacement from the current frame, x10
      rel = windows.HISTORY_SCALE * (past.reshape(B, K, J, 3) - x[:, None])
      feats = jnp.concatenate(
          [feats, jnp.swapaxes(rel, 1, 2).reshape(B, J, 3 * K).astype(feats.dtype)], axis=-1)
    sixd = self.backbone(feats, deterministic=deterministic)  # [B, J, 6], canonical frame
    if self.config.observed_direction_head:
      obs, valid = observed_directions(x, self.rig, mask)
      if self.config.observed_direction_blend:  # [B, J, 7]: the 6D and the blend logit
        sixd, w = sixd[..., :6], nnx.sigmoid(sixd[..., 6:])
        obs = rotations.normalize(w * obs + (1 - w) * rotations.normalize(sixd[..., :3]))
      sixd = sixd.at[..., :3].set(jnp.where(valid[..., None], obs, sixd[..., :3]))
    R = rotations.matrix_from_sixd(sixd)
    if C is not None:  # back from the canonical to the world frame
      world = np.asarray(world_frame_outputs(self.rig, self.config.output_space))
      R = jnp.where(world[:, None, None], jnp.swapaxes(C, -1, -2)[:, None] @ R, R)
    return R.reshape(*batch, J, 3, 3)


def set_matmul_precision(model: nnx.Module, precision: str) -> None:
  """Sets the precision of a graph network's large products (in place; static, before
  jitting, like `gat.set_form`): the messages `h @ W` of every graph attention layer and the
  head's hidden layer, about 89% of the base model's FLOPs. 'float32' (the default) or
  'bfloat16': bfloat16 inputs, float32 sums (`gat.matmul`); everything else stays float32.
  With 'bfloat16' those kernels are also stored in bfloat16 (the products round them anyway),
  so a forward that takes the weights as arguments converts nothing per call; going back to
  'float32' is refused then (load the model again). On a CPU with bfloat16 instructions and
  their XLA options (`inference.compiler_options`) the base model's live frame takes 0.17 ms
  instead of 0.25 for 0.001 deg more error on CMU val (BENCHMARKS.md, issue N session 31). A
  model with no graph network (the MLP) refuses 'bfloat16' (ValueError)."""
  if precision not in MATMUL_PRECISIONS:
    raise ValueError(f'matmul precision must be one of {MATMUL_PRECISIONS}, got {precision!r}')
  modules = [m for _, m in nnx.iter_graph(model) if isinstance(m, (GraphAttention, GraphNet))]
  if not modules and precision != 'float32':
    raise ValueError(f'matmul precision {precision!r} needs a graph network (arch ikgat or '
                     'transformer); this model has none')
  if precision == 'float32' and any(m.matmul_precision == 'bfloat16' for m in modules):
    raise ValueError('this model\'s product kernels were rounded to bfloat16 '
                     '(set_matmul_precision): load it again for float32')
  for module in modules:
    module.matmul_precision = precision
  if precision == 'bfloat16':
    for m in modules:
      kernel = (m.value if isinstance(m, GraphAttention) else m.head_hidden).kernel
      kernel.set_value(kernel[...].astype(jnp.bfloat16))


def matmul_precision(model: nnx.Module) -> str:
  """The precision `set_matmul_precision` set ('float32' if it was never set)."""
  for _, module in nnx.iter_graph(model):
    if isinstance(module, (GraphAttention, GraphNet)):
      return module.matmul_precision
  return 'float32'


def create_model(config: ModelConfig, rig: Rig, rngs: nnx.Rngs) -> IKModel:
  """The network of `config` for `rig` (parameters initialised from `rngs`)."""
  return IKModel(config, rig, rngs)


def param_count(model: nnx.Module) -> int:
  """Number of trainable parameters (works on `nnx.eval_shape` results too)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def param_table(config: ModelConfig | None = None) -> dict[str, dict[str, dict[str, int]]]:
  """`{arch: {rig: {size: parameters}}}` for cmu_body and smpl22 (shapes only, no allocation)."""
  base = config or ModelConfig()
  rigs = (skeleton.cmu_body(), skeleton.smpl22())
  return {arch: {rig.name: {size: param_count(nnx.eval_shape(
      lambda c=dataclasses.replace(base, arch=arch, size=size), r=rig: create_model(
          c, r, nnx.Rngs(0)))) for size in SIZES} for rig in rigs} for arch in ARCHS}


# ----------------------------------------------------------------------------------------------
# Output spaces <-> local rotations.


def _local_joints(rig: Rig, output_space: str) -> tuple[int, ...]:
  """Joints whose output is a local rotation: all for 'local', the leaves for 'mixed'."""
  if output_space == 'local':
    return tuple(range(rig.num_joints))
  if output_space == 'mixed':
    return tuple(j for j, c in enumerate(rig.designated_children) if c < 0)
  return ()


def to_local(pred: jax.Array, B_frames: jax.Array, rig: Rig, output_space: str,
             bone_chart: bool = False) -> jax.Array:
  """Model output `[B, J, 3, 3]` in `output_space` -> parent-relative local rotations.

  `B_frames: [B or 1, J, 3, 3]` rest bone frames of the subject(s) (`bone_frames.bone_frames`).
  `bone_chart`: the local outputs are in the bone-frame chart (`ModelConfig.bone_chart`).
  """
  joints = _local_joints(rig, output_space) if bone_chart else ()
  if joints:
    pred = jnp.broadcast_to(pred, jnp.broadcast_shapes(pred.shape, B_frames.shape))
    pred = bone_frames.bone_chart(pred, B_frames, rig.parents, joints, inverse=True)
  return _to_local_joint_chart(pred, B_frames, rig, output_space)


def from_local(local_rot: jax.Array, B_frames: jax.Array, rig: Rig, output_space: str,
               bone_chart: bool = False) -> jax.Array:
  """Local rotations `[B, J, 3, 3]` -> the same pose in `output_space` (training targets)."""
  out = _from_local_joint_chart(local_rot, B_frames, rig, output_space)
  joints = _local_joints(rig, output_space) if bone_chart else ()
  if joints:
    out = jnp.broadcast_to(out, jnp.broadcast_shapes(out.shape, B_frames.shape))
    out = bone_frames.bone_chart(out, B_frames, rig.parents, joints, inverse=False)
  return out


def _to_local_joint_chart(pred: jax.Array, B_frames: jax.Array, rig: Rig,
                          output_space: str) -> jax.Array:
  """Model output `[B, J, 3, 3]` in `output_space` -> parent-relative local rotations.

  `B_frames: [B or 1, J, 3, 3]` rest bone frames of the subject(s) (`bone_frames.bone_frames`).
  """
  if output_space == 'local':
    return pred
  if output_space == 'global':
    return kinematics.global_to_local(pred, rig.parents)
  if output_space == 'bone_aligned':
    return bone_frames.local_from_q(pred, B_frames, rig)
  if output_space != 'mixed':
    raise ValueError(f'unknown output_space {output_space!r}; choose from {OUTPUT_SPACES}')
  G = bone_frames.global_from_q(pred, B_frames)  # right for the bone-aligned joints
  pred = jnp.broadcast_to(pred, G.shape)
  # A local output's world rotation (G_parent @ R) is needed only where the joint has children
  # (all co-located with it, so it has no bone); a true leaf's local rotation is the output.
  parents_of_some = set(rig.parents)
  chain = [j for j, c in enumerate(rig.designated_children) if c < 0 and j in parents_of_some]
  if chain:
    Gs = [G[..., j, :, :] for j in range(rig.num_joints)]
    for j in chain:
      p = rig.parents[j]
      Gs[j] = pred[..., j, :, :] if p < 0 else Gs[p] @ pred[..., j, :, :]
    G = jnp.stack(Gs, axis=-3)
  local = kinematics.global_to_local(G, rig.parents)
  leaf = np.asarray([c < 0 for c in rig.designated_children])
  return jnp.where(leaf[:, None, None], pred, local)  # leaves exactly as predicted


def _from_local_joint_chart(local_rot: jax.Array, B_frames: jax.Array, rig: Rig,
                            output_space: str) -> jax.Array:
  """Local rotations `[B, J, 3, 3]` -> the same pose in `output_space` (training targets)."""
  if output_space == 'local':
    return local_rot
  if output_space == 'global':
    return kinematics.local_to_global(local_rot, rig.parents)
  Q = bone_frames.q_from_local(local_rot, B_frames, rig)
  if output_space == 'bone_aligned':
    return Q
  if output_space != 'mixed':
    raise ValueError(f'unknown output_space {output_space!r}; choose from {OUTPUT_SPACES}')
  leaf = np.asarray([c < 0 for c in rig.designated_children])
  return jnp.where(leaf[:, None, None], local_rot, Q)
