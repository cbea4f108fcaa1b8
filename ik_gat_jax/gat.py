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
ablation) averages `W h_k` over the neighbours. `weights` (the reference evaluation, and the
dense form for 'gatv2', 'dot' and 'mean') works in the layout `[B, H, J, C]`, the GAT and dot
logits from one batched matmul each (about 2x faster than a naive einsum on this CPU).

Two evaluations of the same function (`GraphAttention.form`): 'dense' multiplies the masked
`[J, J]` attention by the messages, one small matmul per example and head (for 'gat' scoring
in the layout `[..., J, H, J]`, no copies of the messages into heads: `_dense_gat`); 'sparse'
sums each node's own neighbours (static slices, 61 terms on the 21-joint CMU tree instead of
441), and for 'gat' scoring takes the softmax over each node's padded neighbour list (`[J, max
degree]`, no `[J, J]` logits) with both scores from one `[D, 2 H]` matmul on the layer's input
(`_sparse_gat`). 'auto' takes dense for fewer than SPARSE_FROM examples (a live frame: dense
is faster) and in training (the sparse gradient compiles 2.5x slower), sparse for inference
from there (the base model 1.09x dense's frames/s at 4 examples on one core, 1.4x at 1,024 on
two; BENCHMARKS.md "Close to the machine"). The default is 'dense' (compile time, see
`GraphAttention.form`); `set_form` switches a model's layers.

`GraphAttention.matmul_precision` (static, like `form`; `model.set_matmul_precision`): 'float32',
or 'bfloat16', the messages' product `h @ W` with bfloat16 inputs and float32 accumulation
(`matmul`), everything else float32.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

SCORINGS = ('gat', 'gatv2', 'dot')
AGGREGATIONS = ('attention', 'mean')
_NEG = -1e30  # masked logit; softmax is taken in float32, so exp() of it is exactly 0
SPARSE_FROM = 4  # form 'auto': the sparse form from this many examples on (leading axes)
MATMUL_PRECISIONS = ('float32', 'bfloat16')


def matmul(x: jax.Array, kernel: jax.Array, precision: str = 'float32') -> jax.Array:
  """`x @ kernel`; with `precision` 'bfloat16' both rounded to bfloat16 and the products summed
  in float32 (JAX's 'bfloat16' matmul precision; the result float32). The network's large
  products take it in `model.set_matmul_precision(model, 'bfloat16')`."""
  if precision == 'float32':
    return x @ kernel
  if precision != 'bfloat16':
    raise ValueError(f'matmul precision must be one of {MATMUL_PRECISIONS}, got {precision!r}')
  return jnp.dot(x.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16),
                 preferred_element_type=jnp.promote_types(x.dtype, jnp.float32))


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
    # How __call__ evaluates the (same) function (static, not state): 'dense' (the attention
    # as a [J, J] @ [J, C] product per example and head), 'sparse' (each node's sum over
    # its own neighbours as static slices, the GAT softmax over each node's padded senders; no
    # batched small dots, no transposes) or 'auto' (sparse from SPARSE_FROM examples on in
    # inference, dense below and in training). Default 'dense': the sparse form compiles 1.5x
    # (forward) to 2.5x (gradient) slower, far more on the full graph, which made the test
    # suite 30% slower; `set_form(model, 'auto')` opts in (faster batched inference).
    self.form = 'dense'
    # The messages' product `h @ W` (static; `model.set_matmul_precision`): 'float32' or
    # 'bfloat16' (bfloat16 inputs, float32 sums: `matmul`).
    self.matmul_precision = 'float32'
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

  def messages(self, h: jax.Array) -> jax.Array:
    """`W h + b`, `[..., J, H * C]`, the product in `matmul_precision`."""
    return matmul(h, self.value.kernel[...], self.matmul_precision) + self.value.bias[...]

  def _heads(self, x: jax.Array) -> jax.Array:
    """`[B, J, H * C]` -> `[B, H, J, C]`."""
    return x.reshape(*x.shape[:-1], self.num_heads, self.head_dim).swapaxes(-2, -3)

  def weights(self, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`h: [B, J, D]` -> (attention `[B, H, J(receiver i), J(sender k)]`, messages `[B, H, J, C]`).

    Each row of the attention sums to 1 over the neighbours of i and is exactly 0 elsewhere.
    """
    mask = np.asarray(self.adjacency, dtype=bool)
    wh = self._heads(self.messages(h))
    if self.aggregation == 'mean':
      return jnp.asarray(mask / mask.sum(-1, keepdims=True), wh.dtype), wh
    if self.scoring == 'gat':
      s = wh @ self.attn[...]  # [B, H, J, 2]: one matmul for both scores
      logits = nnx.leaky_relu(s[..., :, None, 0] + s[..., None, :, 1], self.negative_slope)
    elif self.scoring == 'gatv2':
      recv, send = np.nonzero(mask)  # static edge list: E edges instead of J * J pairs
      z = nnx.leaky_relu(self._heads(self.recv(h))[..., recv, :] + wh[..., send, :],
                         self.negative_slope)  # [B, H, E, C]
      e = jnp.einsum('...hec,hc->...he', z, self.attn[...])
      logits = jnp.full(e.shape[:-1] + mask.shape, _NEG, e.dtype).at[..., recv, send].set(e)
    else:
      q, k = self._heads(self.query(h)), self._heads(self.key(h))
      logits = (q @ k.swapaxes(-1, -2)) / np.sqrt(self.head_dim)
    logits = jnp.where(mask, logits.astype(jnp.float32), _NEG)
    return jax.nn.softmax(logits, axis=-1).astype(wh.dtype), wh

  def _dense_gat(self, h: jax.Array) -> jax.Array:
    """The 'gat' attention in the dense form, `h: [..., J, D]` -> `[..., J, H * C]`, in the
    layout `[..., i, H, k]`: no `[.., H, J, C]` copies of the messages or of the output. Both
    scores of every node from one `[H * C, 2 H]` product of the messages with the heads' `a`
    laid out block-diagonally, the softmax over the last (sender) axis, then one `[J, J] @ [J,
    C]` product per head on the messages' columns of that head, concatenated. Against the
    batched `[.., H, J, J] @ [.., H, J, C]` product of `weights` (the base model): a live
    frame's executable 1.06x, batch 1,024 on two cores 1.15x, the training step 1.05x
    (BENCHMARKS.md, issue N session 29). The same function as `weights` (softmax in float32)
    up to float32 round-off (tests/gat_test.py)."""
    H, C = self.num_heads, self.head_dim
    mask = np.asarray(self.adjacency, dtype=bool)
    m = self.messages(h)  # [..., J, H * C]: the messages, bias included
    a = self.attn[...]  # [H, C, 2]
    block = np.eye(H, dtype=bool)[:, None, :, None]  # a[h, c, k] at column (h, k) only
    s = (m @ jnp.where(block, a[:, :, None, :], 0).reshape(H * C, 2 * H)).reshape(
        *m.shape[:-1], H, 2)
    logits = nnx.leaky_relu(s[..., :, :, None, 0] + s[..., None, :, :, 1].swapaxes(-1, -2),
                            self.negative_slope)  # [..., i, H, k]
    logits = jnp.where(mask[:, None, :], logits.astype(jnp.float32), _NEG)
    attn = jax.nn.softmax(logits, axis=-1).astype(m.dtype)
    return jnp.concatenate([attn[..., :, n, :] @ m[..., n * C:(n + 1) * C] for n in range(H)],
                           axis=-1)

  def _sparse_gat(self, h: jax.Array) -> jax.Array:
    """The 'gat' attention in the sparse form, `h: [..., J, D]` -> `[..., J, H * C]`. The
    softmax runs over each node's own senders, padded to the largest degree (`[..., J, deg,
    H]`: 105 entries on the 21-joint tree instead of the `[J, J]` masked 441, whose softmax's
    exponentials and reductions were 7% of a batched forward; BENCHMARKS.md issue N session
    28), taken with the examples on the minor axis (session 29), and each node's weighted sum
    of its senders' messages is elementwise work on static slices, one fused kernel per node.
    Both scores of every node come from one `[D, 2 H]` matmul on `h` (`W A`, bias `b A`)
    instead of from the messages with their bias added. The same function as `weights`
    (softmax in float32; the bias, whose weights sum to 1, added after the sum) up to float32
    round-off (tests/gat_test.py)."""
    H, C = self.num_heads, self.head_dim
    kernel, bias, a = self.value.kernel[...], self.value.bias[...], self.attn[...]
    score_w = jnp.einsum('dhc,hck->dhk', kernel.reshape(-1, H, C), a).reshape(-1, 2 * H)
    score_b = jnp.einsum('hc,hck->hk', bias.reshape(H, C), a).reshape(2 * H)
    s = (h @ score_w + score_b).reshape(*h.shape[:-1], H, 2).astype(jnp.float32)
    wh = matmul(h, kernel, self.matmul_precision).reshape(
        *h.shape[:-1], H, C)  # messages without their bias
    senders = [[k for k, on in enumerate(row) if on] for row in self.adjacency]
    deg = max(len(x) for x in senders)
    idx = np.asarray([x + [x[0]] * (deg - len(x)) for x in senders])  # [J, deg]
    valid = np.asarray([[j < len(x) for j in range(deg)] for x in senders])
    # The softmax with the examples on the minor axis (`[H, J, deg, n]`): XLA's CPU loops
    # vectorise along it (with the 4 heads minor they did not: 1.8x the softmax's time).
    J = h.shape[-2]
    sT = jnp.transpose(s.reshape(-1, J, H, 2), (3, 2, 1, 0))  # [2, H, J, n]
    logits = nnx.leaky_relu(sT[0][:, :, None, :] + sT[1][:, idx, :], self.negative_slope)
    logits = jnp.where(valid[None, :, :, None], logits, _NEG)  # [H, J, deg, n]
    attn = jax.nn.softmax(logits, axis=-2).astype(wh.dtype)
    attn = jnp.transpose(attn, (3, 1, 2, 0)).reshape(*h.shape[:-2], J, deg, H)
    out = []
    for i, ks in enumerate(senders):
      terms = [attn[..., i, j, :, None] * wh[..., k, :, :] for j, k in enumerate(ks)]
      out.append(functools.reduce(jnp.add, terms) + bias.reshape(H, C))
    return jnp.stack(out, axis=-3).reshape(*h.shape[:-1], H * C)

  def __call__(self, h: jax.Array, *, training: bool = False) -> jax.Array:
    """`attn @ messages` of `weights`, heads concatenated, in the layer's `form`. `training`
    (a gradient will be taken): 'auto' stays dense, whose gradient compiles 2.5x faster (4 vs
    10 s for the base model) and training runs compile it on every start."""
    H, C = self.num_heads, self.head_dim
    form = self.form
    if form == 'auto':
      form = ('sparse' if not training and math.prod(h.shape[:-2]) >= SPARSE_FROM
              else 'dense')
    if form == 'dense':
      if self.scoring == 'gat' and self.aggregation == 'attention':
        return self._dense_gat(h)
      attn, wh = self.weights(h)
      return (attn @ wh).swapaxes(-2, -3).reshape(*h.shape[:-1], H * C)
    if self.scoring == 'gat' and self.aggregation == 'attention':
      return self._sparse_gat(h)
    attn, wh = self.weights(h)  # 'mean': attn is the [J, J] neighbour average
    attn = jnp.broadcast_to(attn, wh.shape[:-2] + attn.shape[-2:])
    wh = wh.swapaxes(-2, -3)
    out = []
    for i, row in enumerate(self.adjacency):  # node i: its senders k, static slices
      terms = [attn[..., :, i, k, None] * wh[..., k, :, :] for k, on in enumerate(row) if on]
      out.append(sum(terms[1:], terms[0]))
    return jnp.stack(out, axis=-3).reshape(*h.shape[:-1], H * C)


def form_of(model) -> str | None:
  """The `form` of `model`'s graph attention layers ('dense', 'sparse' or 'auto'; several
  joined by '+' where layers differ), None for a model without any."""
  forms = {m.form for _, m in nnx.iter_graph(model) if isinstance(m, GraphAttention)}
  return '+'.join(sorted(forms)) or None


def set_form(model, form: str) -> None:
  """Sets `form` ('dense', 'sparse', 'auto') on every GraphAttention of `model` (in place; the
  same function, a different evaluation; before jitting)."""
  if form not in ('dense', 'sparse', 'auto'):
    raise ValueError(f"form must be 'dense', 'sparse' or 'auto', got {form!r}")
  for _, module in nnx.iter_graph(model):
    if isinstance(module, GraphAttention):
      module.form = form
