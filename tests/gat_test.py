"""Graph attention: masking, L-hop locality, mean aggregation, softmax over neighbours, and the
GAT / GATv2 / dot scores against a naive per-edge numpy reference."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ik_gat_jax import gat, model, skeleton

RIG = skeleton.cmu_body()
J = RIG.num_joints
KINDS = ('tree', 'parent_to_child', 'child_to_parent', 'full')
VARIANTS = (('gat', 'attention'), ('gatv2', 'attention'), ('dot', 'attention'), ('gat', 'mean'))


def _layer(kind, scoring, aggregation, d_in=8, d_out=8, heads=2, seed=0):
  return gat.GraphAttention(d_in, d_out, RIG.adjacency(kind), num_heads=heads, scoring=scoring,
                            aggregation=aggregation, rngs=nnx.Rngs(seed))


def _changed(fn, x, eps=0.5):
  """`changed[k, i]`: does output node i move when only input node k is perturbed?

  One batched call: example k of the batch perturbs node k of `x: [J, D]`.
  """
  pert = x[None] + eps * jnp.eye(J)[:, :, None]  # [J(k), J, D]
  out = np.asarray(fn(jnp.concatenate([x[None], pert])))  # the same call: bitwise comparable
  return np.abs(out[1:] - out[:1]).max(axis=-1)  # [J(k), J(i)]


@pytest.mark.parametrize('kind,variant', list(itertools.product(KINDS, VARIANTS)))
def test_one_layer_sees_only_its_neighbours(kind, variant):
  layer = _layer(kind, *variant)
  h = jax.random.normal(jax.random.key(1), (J, 8))
  diff = _changed(layer, h)
  adj = np.asarray(RIG.adjacency(kind))  # adj[i, k]: i receives from k
  assert diff.T[~adj].max(initial=0.0) < 1e-6  # unchanged off the graph (exactly 0 on CPU)
  assert (diff.T[adj] > 1e-4).all(), 'every neighbour should influence the node'


@pytest.mark.parametrize('kind,layers', [('tree', 1), ('tree', 2), ('tree', 3),
                                         ('parent_to_child', 2), ('child_to_parent', 2)])
def test_stack_of_layers_sees_only_joints_within_layers_hops(kind, layers):
  # The backbone alone: IKModel would subtract the root first (every joint then depends on the
  # root) and heading/scale normalisation mix the whole body. The backbone's input projection,
  # global shortcut and head are per joint, so only the L blocks move information; no pooling.
  cfg = model.ModelConfig(size='tiny', num_layers=layers, adjacency=kind)
  net = model.create_model(cfg, RIG, nnx.Rngs(0)).backbone
  x = jax.random.normal(jax.random.key(2), (J, 3))
  diff = _changed(lambda p: net(p, deterministic=True), x)
  adj = np.asarray(RIG.adjacency(kind), dtype=int)
  reach = np.linalg.matrix_power(adj, layers) > 0  # reach[i, k]: k within `layers` hops of i
  assert diff.T[~reach].max(initial=0.0) < 1e-6
  assert (diff.T[reach] > 1e-6).all()
  if layers < 3:
    assert (~reach).any()  # the test has something to show


def test_mean_aggregation_is_the_neighbour_mean_of_the_messages():
  layer = _layer('tree', 'gat', 'mean', d_in=5, d_out=6, heads=3)
  h = np.asarray(jax.random.normal(jax.random.key(3), (2, J, 5)))
  msg = h @ np.asarray(layer.value.kernel[...]) + np.asarray(layer.value.bias[...])
  adj = np.asarray(RIG.adjacency('tree'))
  want = np.stack([msg[:, adj[i]].mean(axis=1) for i in range(J)], axis=1)
  np.testing.assert_allclose(layer(jnp.asarray(h)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('kind,scoring', list(itertools.product(KINDS, gat.SCORINGS)))
def test_attention_sums_to_one_over_neighbours_and_is_zero_elsewhere(kind, scoring):
  layer = _layer(kind, scoring, 'attention', heads=4)
  attn, _ = layer.weights(jax.random.normal(jax.random.key(4), (3, J, 8)))
  attn = np.asarray(attn)
  adj = np.broadcast_to(np.asarray(RIG.adjacency(kind)), attn.shape)
  assert attn.shape == (3, 4, J, J)
  np.testing.assert_array_equal(attn[~adj], 0.0)
  assert (attn[adj] > 0).all()
  np.testing.assert_allclose(attn.sum(-1), 1.0, atol=1e-5)


def _reference_logits(layer, h):
  """Naive per-edge scores `[B, H, J, J]` (NaN off the graph), straight from the formulas."""
  H, C = layer.num_heads, layer.head_dim
  lrelu = lambda z: np.where(z > 0, z, 0.2 * z)
  wh = (h @ np.asarray(layer.value.kernel[...]) + np.asarray(layer.value.bias[...]))
  wh = wh.reshape(*h.shape[:2], H, C)
  if layer.scoring == 'gatv2':
    wr = (h @ np.asarray(layer.recv.kernel[...])).reshape(*h.shape[:2], H, C)
  if layer.scoring == 'dot':
    q = (h @ np.asarray(layer.query.kernel[...])).reshape(*h.shape[:2], H, C)
    k = (h @ np.asarray(layer.key.kernel[...])).reshape(*h.shape[:2], H, C)
  a = np.asarray(layer.attn[...]) if layer.scoring != 'dot' else None
  out = np.full((h.shape[0], H, J, J), np.nan)
  for b, hd, i, kk in itertools.product(range(h.shape[0]), range(H), range(J), range(J)):
    if not layer.adjacency[i][kk]:
      continue
    if layer.scoring == 'gat':
      out[b, hd, i, kk] = lrelu(a[hd, :, 0] @ wh[b, i, hd] + a[hd, :, 1] @ wh[b, kk, hd])
    elif layer.scoring == 'gatv2':
      out[b, hd, i, kk] = a[hd] @ lrelu(wr[b, i, hd] + wh[b, kk, hd])
    else:
      out[b, hd, i, kk] = q[b, i, hd] @ k[b, kk, hd] / np.sqrt(C)
  return out, wh


@pytest.mark.parametrize('scoring', gat.SCORINGS)
def test_scores_and_output_match_a_naive_reference(scoring):
  layer = _layer('tree', scoring, 'attention', d_in=6, d_out=8, heads=2)
  h = np.asarray(jax.random.normal(jax.random.key(5), (2, J, 6)), np.float64)
  logits, wh = _reference_logits(layer, h)
  e = np.exp(np.nan_to_num(logits - np.nanmax(logits, -1, keepdims=True), nan=-np.inf))
  attn = e / e.sum(-1, keepdims=True)
  np.testing.assert_allclose(layer.weights(jnp.asarray(h, jnp.float32))[0], attn, atol=1e-5)
  want = np.einsum('bhik,bkhc->bihc', attn, wh).reshape(2, J, 8)
  np.testing.assert_allclose(layer(jnp.asarray(h, jnp.float32)), want, rtol=1e-4, atol=1e-5)


def test_adjacency_is_static_not_state():
  layer = _layer('tree', 'gatv2', 'attention')
  leaves = jax.tree.leaves(nnx.state(layer))
  assert {x.shape for x in leaves} == {(8, 8), (8,), (2, 4)}  # value, recv, attn: no J x J
  assert isinstance(layer.adjacency, tuple)


@pytest.mark.parametrize('kind,variant', list(itertools.product(KINDS, VARIANTS)))
def test_every_form_is_the_dense_attention(kind, variant):
  """`__call__` in each form ('dense', 'sparse', 'auto' on both sides of SPARSE_FROM) is
  `weights()`'s `attn @ messages` on every adjacency and variant."""
  layer = _layer(kind, *variant, d_in=8, d_out=8, heads=2)
  for shape in ((), (1,), (3,), (2, 3), (gat.SPARSE_FROM,)):  # () and (2, 3): leading axes
    h = jax.random.normal(jax.random.key(6), shape + (J, 8))
    attn, wh = layer.weights(h)
    want = np.asarray((attn @ wh).swapaxes(-2, -3).reshape(shape + (J, 8)))
    for form in ('dense', 'sparse', 'auto'):
      layer.form = form
      for training in (False, True):
        np.testing.assert_allclose(layer(h, training=training), want, rtol=1e-5, atol=1e-6,
                                   err_msg=f'{form} {shape} {training}')


def test_set_form_switches_every_layer_and_refuses_an_unknown_form():
  net = model.create_model(model.ModelConfig(size='tiny'), RIG, nnx.Rngs(0))
  layers = [m for _, m in nnx.iter_graph(net) if isinstance(m, gat.GraphAttention)]
  assert layers and {m.form for m in layers} == {'dense'}
  gat.set_form(net, 'auto')
  assert {m.form for m in layers} == {'auto'} and gat.form_of(net) == 'auto'
  layers[0].form = 'sparse'
  assert gat.form_of(net) == 'auto+sparse'
  assert gat.form_of(model.create_model(model.ModelConfig(size='tiny', arch='mlp'), RIG,
                                        nnx.Rngs(0))) is None
  with pytest.raises(ValueError, match="form must be 'dense', 'sparse' or 'auto', got 'fast'"):
    gat.set_form(net, 'fast')


def test_bfloat16_products_sum_the_rounded_inputs_in_float32():
  """`gat.matmul(..., 'bfloat16')` is the float32 product of both inputs rounded to bfloat16
  (float32 sums: within float32 summation round-off of it), not the float32 product; 'float32'
  is the plain product; another precision is refused."""
  x = jax.random.normal(jax.random.key(1), (21, 320))
  k = jax.random.normal(jax.random.key(2), (320, 64))
  r = lambda a: np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
  got = np.asarray(gat.matmul(x, k, 'bfloat16'))
  assert got.dtype == np.float32
  # 320 terms of size ~1: float32 sums err by ~sqrt(320) * 6e-8 * 18 ~ 2e-5; bfloat16 rounding
  # (2^-9 relative per input) moves the product by ~sqrt(320) * 4e-3 ~ 0.07.
  np.testing.assert_allclose(got, r(x) @ r(k), atol=1e-4, rtol=0)
  assert np.abs(got - np.asarray(x @ k)).max() > 1e-2
  np.testing.assert_array_equal(gat.matmul(x, k, 'float32'), x @ k)
  with pytest.raises(ValueError, match='matmul precision must be one of'):
    gat.matmul(x, k, 'float16')


def test_set_matmul_precision_sets_every_product_and_stays_close_to_float32():
  """`model.set_matmul_precision` reaches every graph attention layer and the head, stores
  their kernels in bfloat16 (the same outputs: the products round them anyway), keeps the
  network within bfloat16 round-off of float32 in every form, and refuses going back, an
  unknown precision and a network without graph layers."""
  cfg = model.ModelConfig(size='tiny')
  net = model.create_model(cfg, RIG, nnx.Rngs(0))
  x = jnp.asarray(RIG.template().cumsum(0)[None] + 0.05 * np.random.default_rng(0).normal(
      size=(5, J, 3)), jnp.float32)
  want = np.asarray(net(x, deterministic=True))
  assert model.matmul_precision(net) == 'float32'
  model.set_matmul_precision(net, 'bfloat16')
  mods = [m for _, m in nnx.iter_graph(net) if isinstance(m, (gat.GraphAttention, model.GraphNet))]
  assert len(mods) == cfg.dims[1] + 1 and {m.matmul_precision for m in mods} == {'bfloat16'}
  assert model.matmul_precision(net) == 'bfloat16'
  assert {m.value.kernel[...].dtype for m in mods if isinstance(m, gat.GraphAttention)} == {
      jnp.dtype(jnp.bfloat16)}
  for form in ('dense', 'sparse'):
    gat.set_form(net, form)
    got = np.asarray(net(x, deterministic=True))
    # Rotation entries: bfloat16 inputs move each product by ~2^-9 relative (measured here:
    # 5e-5 at most in an entry, untrained); a wrong product (rows, layout) moves them by ~1.
    assert 1e-6 < np.abs(got - want).max() < 5e-3, form
  with pytest.raises(ValueError, match='load it again for float32'):
    model.set_matmul_precision(net, 'float32')
  with pytest.raises(ValueError, match='matmul precision must be one of'):
    model.set_matmul_precision(net, 'fp8')
  mlp = model.create_model(model.ModelConfig(arch='mlp', size='tiny'), RIG, nnx.Rngs(0))
  model.set_matmul_precision(mlp, 'float32')  # nothing to set: allowed
  with pytest.raises(ValueError, match='needs a graph network'):
    model.set_matmul_precision(mlp, 'bfloat16')
