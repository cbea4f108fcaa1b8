"""Masked multi-head graph attention over a small static graph (DESIGN section 5).

Our graphs have ~20 nodes and a fixed adjacency, so attention is dense `[B, H, J, J]` with the
non-edges masked out before the softmax; no segment ops and no graph library. The adjacency is a
tuple of tuples of bools (`Rig.adjacency(kind)`, `adj[i][k]`: node i receives from node k, self
loops included). It stays a Python tuple on the module (static, not NNX state) and becomes a
numpy constant inside `__call__`, hence a compile-time constant under `jax.jit`.

Scoring of edge k -> i (per head; `W` the message projection, `h` the node features):
  'gat'   (Velickovic et al. 2018): LeakyReLU(a_dst . W h_i + a_src . W h_k)
  'gatv2' (Brody et al. 2022):      a . LeakyReLU(W_recv h_i + W h_k), evaluated on edges only
  'dot'   (Transformer):            (W_q h_i) . (W_k h_k) / sqrt(C)
Aggregation 'attention' softmaxes the scores over the neighbours; 'mean' (the non-attentive
ablation) averages `W h_k` over the neighbours. Layout `[B, H, J, C]`: the GAT and dot logits
come from one batched matmul each (measured on this CPU: about 2x faster than a naive einsum).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

SCORINGS = ('gat', 'gatv2', 'dot')
AGGREGATIONS = ('attention', 'mean')
_NEG = -1e30  # masked logit; softmax is taken in float32, so exp() of it is exactly 0


class GraphAttention(nnx.Module):
  """`h: [B, J, in_features]` -> `[B, J, out_features]`, heads concatenated.

  `out_features = num_heads * C`. Each head aggregates `W h_k` over the neighbours k of node i.
  """

  def __init__(self, in_features: int, out_features: int, adjacency: Sequence[Sequence[bool]],
               *, num_heads: int, rngs: nnx.Rngs, scoring: str = 'gat',
               aggregation: str = 'attention', negative_slope: float = 0.2):
    if out_features % num_heads:
      raise ValueError(f'out_features {out_features} not divisible by num_heads {num_heads}')
    if scoring not in SCORINGS or aggregation not in AGGREGATIONS:
      raise ValueError(f'scoring {scoring!r} / aggregation {aggregation!r} not in '
                       f'{SCORINGS} / {AGGREGATIONS}')
    self.adjacency = tuple(tuple(bool(x) for x in row) for row in adjacency)
    self.num_heads, self.head_dim = num_heads, out_features // num_heads
    self.scoring, self.aggregation, self.negative_slope = scoring, aggregation, negative_slope
    self.value = nnx.Linear(in_features, out_features, rngs=rngs)  # W: the messages
    # How __call__ evaluates the (same) function: 'dense' (all J x J pairs masked, `weights()`)
    # or 'neighbours' (the padded neighbour table, D = 5 slots of J = 21 on the CMU tree).
    # Dense is the default: on this 2-core CPU the whole base model is 1.4x slower at batch
    # 64-4096 and 1.1x at batch 1 on the neighbour table, though it computes 5% fewer FLOPs
    # (`python -m experiments.bench_forward --attention=neighbours|dense`, BENCHMARKS.md
    # "Throughput"). Static, not state.
    self.form = 'dense'
    if aggregation == 'mean':
      return
    init = nnx.initializers.lecun_normal()
    if scoring == 'gat':  # a[..., 0] = a_dst, a[..., 1] = a_src
      self.attn = nnx.Param(init(rngs.params(), (num_heads, self.head_dim, 2)))
    elif scoring == 'gatv2':
      self.recv = nnx.Linear(in_features, out_features, use_bias=False, rngs=rngs)
      self.attn = nnx.Param(init(rngs.params(), (num_heads, self.head_dim, 1))[..., 0])
    else:
      self.query = nnx.Linear(in_features, out_features, use_bias=False, rngs=rngs)
      self.key = nnx.Linear(in_features, out_features, use_bias=False, rngs=rngs)

  def _heads(self, x: jax.Array) -> jax.Array:
    """`[B, J, H * C]` -> `[B, H, J, C]`."""
    return x.reshape(*x.shape[:-1], self.num_heads, self.head_dim).swapaxes(-2, -3)

  def weights(self, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`h: [B, J, D]` -> (attention `[B, H, J(receiver i), J(sender k)]`, messages `[B, H, J, C]`).

    Each row of the attention sums to 1 over the neighbours of i and is exactly 0 elsewhere.
    """
    mask = np.asarray(self.adjacency, dtype=bool)
    wh = self._heads(self.value(h))
    if self.aggregation == 'mean':
      return jnp.asarray(mask / mask.sum(-1, keepdims=True), wh.dtype), wh
    if self.scoring == 'gat':
      s = wh @ self.attn[...]  # [B, H, J, 2]: one matmul for both scores
      logits = nnx.leaky_relu(s[..., :, None, 0] + s[..., None, :, 1], self.negative_slope)
    elif self.scoring == 'gatv2':
      recv, send = np.nonzero(mask)  # static edge list: E edges instead of J * J pairs
      z = nnx.leaky_relu(self._heads(self.recv(h))[..., recv, :] + wh[..., send, :],
                         self.negative_slope)  # [B, H, E, C]
      e = jnp.einsum('bhec,hc->bhe', z, self.attn[...])
      logits = jnp.full(e.shape[:2] + mask.shape, _NEG, e.dtype).at[..., recv, send].set(e)
    else:
      q, k = self._heads(self.query(h)), self._heads(self.key(h))
      logits = (q @ k.swapaxes(-1, -2)) / np.sqrt(self.head_dim)
    logits = jnp.where(mask, logits.astype(jnp.float32), _NEG)
    return jax.nn.softmax(logits, axis=-1).astype(wh.dtype), wh

  def neighbours(self) -> tuple[np.ndarray, np.ndarray]:
    """The static neighbour table: (`nbr [J, D]` int, `valid [J, D]` bool), row i listing the
    senders k of node i in increasing order, padded with i itself (invalid) to the largest
    in-degree D (5 on the CMU tree against J = 21)."""
    mask = np.asarray(self.adjacency, dtype=bool)
    J, D = len(mask), int(mask.sum(-1).max())
    nbr = np.repeat(np.arange(J)[:, None], D, axis=1)
    valid = np.zeros((J, D), bool)
    for i in range(J):
      ks = np.flatnonzero(mask[i])
      nbr[i, :len(ks)], valid[i, :len(ks)] = ks, True
    return nbr, valid

  def __call__(self, h: jax.Array) -> jax.Array:
    """`attn @ messages` of `weights`, heads concatenated. With `form='neighbours'` the same
    function on the neighbour table instead of all J x J pairs: `[..., J, D, H]` scores,
    softmax over D, messages gathered per neighbour slot, layout `[..., J, H, C]`."""
    if self.form == 'dense':
      attn, wh = self.weights(h)
      return (attn @ wh).swapaxes(-2, -3).reshape(*h.shape[:-1], self.num_heads * self.head_dim)
    nbr, valid = self.neighbours()
    H, C = self.num_heads, self.head_dim
    wh = self.value(h)
    wh = wh.reshape(*wh.shape[:-1], H, C)  # [..., J, H, C]
    take = lambda x, idx, axis: jnp.take(x, idx, axis=axis)  # static indices: a gather per slot
    if self.aggregation == 'mean':
      logits = jnp.zeros(valid.shape + (H,), jnp.float32)  # uniform over the valid slots
    elif self.scoring == 'gat':
      s = jnp.einsum('...jhc,hcx->...jhx', wh, self.attn[...])  # [..., J, H, 2]
      logits = nnx.leaky_relu(s[..., :, None, :, 0] + take(s[..., 1], nbr, -2),
                              self.negative_slope)  # [..., J, D, H]
    elif self.scoring == 'gatv2':
      recv = self.recv(h)
      recv = recv.reshape(*recv.shape[:-1], H, C)
      z = nnx.leaky_relu(recv[..., :, None, :, :] + take(wh, nbr, -3), self.negative_slope)
      logits = jnp.einsum('...jdhc,hc->...jdh', z, self.attn[...])
    else:
      q, k = self.query(h), self.key(h)
      q, k = q.reshape(*q.shape[:-1], H, C), k.reshape(*k.shape[:-1], H, C)
      logits = jnp.sum(q[..., :, None, :, :] * take(k, nbr, -3), axis=-1) / np.sqrt(C)
    logits = jnp.where(valid[:, :, None], logits.astype(jnp.float32), _NEG)
    w = jax.nn.softmax(logits, axis=-2).astype(wh.dtype)  # [..., J, D, H]
    out = sum(w[..., :, d, :, None] * take(wh, nbr[:, d], -3) for d in range(nbr.shape[1]))
    return out.reshape(*h.shape[:-1], H * C)
