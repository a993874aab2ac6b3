"""Decoder layer layouts, the scanned stack, rezero, soft-cap and the isolated path."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phoenix_flax as pf
from conftest import (call, float32_ulp, jaxpr_equations, layer, max_abs_diff, rounding,
                      transformer_config)
from phoenix_flax.masks import causal_mask, make_recsys_attn_mask

B, T, OFFSET = 2, 7, 4
PADDING = jnp.array([[1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 1, 0, 1]], bool)


def inputs(seed=0, dtype=jnp.float32):
  x = np.random.default_rng(seed).standard_normal((B, T, transformer_config().emb_size))
  return jnp.asarray(x, dtype)


def dense_mask(offset=OFFSET):
  structure = causal_mask(T) if offset is None else make_recsys_attn_mask(T, offset)
  return PADDING[:, None, None, :].astype(jnp.float32) * structure


def positions():
  return jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32), (B, T))


def decoder_layer(cfg, seed=0):
  """Layer 0 of a stacked transformer (shares initialiser compilations across tests)."""
  return layer(pf.Transformer(cfg, key=jax.random.key(seed)), 0)


def norms(lyr):
  return [n for n in (lyr.norm_attn_in, lyr.norm_attn_out, lyr.norm_dense_in,
                      lyr.norm_dense_out) if n is not None]


def randomize_norms(lyr, seed=0):
  rng = np.random.default_rng(seed)
  new = [jnp.asarray(rng.uniform(0.5, 1.5, n.scale.shape), jnp.float32) for n in norms(lyr)]
  return eqx.tree_at(lambda l: [n.scale for n in norms(l)], lyr, new)


def manual_layer(lyr, h, mask, pos):
  attn = lambda x: lyr.attention(x, mask, pos)[0]
  if lyr.layout == "sandwich":
    h = h + lyr.norm_attn_out(attn(lyr.norm_attn_in(h)))
    return h + lyr.norm_dense_out(lyr.dense(lyr.norm_dense_in(h)))
  if lyr.layout == "pre":
    h = h + attn(lyr.norm_attn_in(h))
    return h + lyr.dense(lyr.norm_dense_in(h))
  h = lyr.norm_attn_out(h + attn(h))
  return lyr.norm_dense_out(h + lyr.dense(h))


def run_layer(lyr, h, mask, pos):
  return lyr(h, lambda a, x: a(x, mask, pos))[0]


@pytest.mark.parametrize("layout", ["sandwich", "pre", "post"])
def test_decoder_layer_matches_its_formula(layout):
  cfg = transformer_config(norm_layout=layout)
  lyr = randomize_norms(decoder_layer(cfg))
  present = {"sandwich": 4, "pre": 2, "post": 2}[layout]
  assert len(norms(lyr)) == present
  if layout == "pre":
    assert lyr.norm_attn_out is None and lyr.norm_dense_out is None
  if layout == "post":
    assert lyr.norm_attn_in is None and lyr.norm_dense_in is None
  args = (inputs(), dense_mask(), positions())
  np.testing.assert_allclose(call(run_layer, lyr, *args), call(manual_layer, lyr, *args),
                             rtol=1e-5, atol=1e-5)


def test_norm_layouts_differ():
  args = (inputs(), dense_mask(), positions())
  outs = {l: call(run_layer, decoder_layer(transformer_config(norm_layout=l)), *args)
          for l in ("sandwich", "pre", "post")}
  assert max_abs_diff(outs["sandwich"], outs["pre"]) > 1e-2
  assert max_abs_diff(outs["sandwich"], outs["post"]) > 1e-2
  assert max_abs_diff(outs["pre"], outs["post"]) > 1e-2


def test_layers_are_stacked():
  cfg = transformer_config()
  tr = pf.Transformer(cfg, key=jax.random.key(1))
  leaves = jax.tree.leaves(eqx.filter(tr.layers, eqx.is_array))
  assert len(leaves) == 8 and all(x.shape[0] == 2 and x.dtype == jnp.float32 for x in leaves)
  assert tr.layers.attention.qkv.weight.shape == (2, cfg.emb_size, (4 + 2 * 2) * 8)
  assert tr.layers.dense.gate_value.weight.shape == (2, cfg.emb_size, 2 * cfg.ffn_size)
  assert max_abs_diff(tr.layers.attention.qkv.weight[0], tr.layers.attention.qkv.weight[1]) > 0


def valid_rms(h, keep=PADDING):
  """RMS over the tokens `keep` marks, by boolean indexing."""
  return jnp.sqrt(jnp.mean(jnp.square(h[keep])))


def _loop(tr, x, mask, pos):
  h, stats = x, []
  for i in range(tr.config.num_layers):
    h, max_logit = layer(tr, i)(h, lambda a, y: a(y, mask, pos))
    stats.append((max_logit, valid_rms(h)))
  return h, stats


def test_scan_equals_python_loop():
  tr = pf.Transformer(transformer_config(), key=jax.random.key(2))
  pos = positions() * 0.5 + 3
  out = call(lambda t, x: t(x, PADDING, OFFSET, pos), tr, inputs())
  h, stats = call(_loop, tr, inputs(), dense_mask(), pos)
  np.testing.assert_allclose(out.embeddings, h, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out.max_abs_attn_logit, [s[0] for s in stats], rtol=1e-5)
  np.testing.assert_allclose(out.residual_rms, [s[1] for s in stats], rtol=1e-5)


@pytest.mark.parametrize("layout", ["sandwich", "post"])
def test_diagnostics_ignore_padded_tokens(layout):
  """Every path's diagnostics count valid tokens only: new values at padded positions
  (which no valid token attends to) change neither the residual RMS nor the max |attention
  logit| (a padded query's row feeds no valid output), and the RMS equals that of the
  valid outputs themselves. In the post layout the attention reads the unnormalised
  stream, so the padded rows' 100x larger values would set the max if they counted."""
  tr = pf.Transformer(transformer_config(norm_layout=layout), key=jax.random.key(6))
  x, pos = inputs(), positions()
  noisy = jnp.where(PADDING[:, :, None], x, 100.0 * inputs(seed=1))

  def paths(t, x):
    dense = t(x, PADDING, OFFSET, pos)
    iso = t.isolated(x[:, :OFFSET], PADDING[:, :OFFSET], x[:, OFFSET:], PADDING[:, OFFSET:],
                     pos[:, :OFFSET], pos[:, OFFSET:])
    ctx, cache = t.encode_context(x[:, :OFFSET], PADDING[:, :OFFSET], pos[:, :OFFSET])
    cand = t.score_candidates(x[:, OFFSET:], PADDING[:, OFFSET:], cache, pos[:, OFFSET:])
    return dense, iso, ctx, cand

  clean, dirty = call(paths, tr, x), call(paths, tr, noisy)
  for c, d in zip(clean, dirty):
    assert float(jnp.min(c.residual_rms)) > 0.1
    np.testing.assert_allclose(d.residual_rms, c.residual_rms, rtol=1e-5)
    np.testing.assert_allclose(d.max_abs_attn_logit, c.max_abs_attn_logit, rtol=1e-5)
  dense, iso, ctx, cand = clean
  np.testing.assert_allclose(dense.residual_rms[-1], valid_rms(dense.embeddings), rtol=1e-5)
  np.testing.assert_allclose(iso.residual_rms, dense.residual_rms, rtol=1e-5)
  np.testing.assert_allclose(ctx.residual_rms[-1],
                             valid_rms(ctx.embeddings, PADDING[:, :OFFSET]), rtol=1e-5)
  np.testing.assert_allclose(cand.residual_rms[-1],
                             valid_rms(cand.embeddings, PADDING[:, OFFSET:]), rtol=1e-5)
  empty = call(lambda t, x: t(x, jnp.zeros_like(PADDING), OFFSET, pos), tr, x)
  np.testing.assert_array_equal(empty.residual_rms, 0.0)


@pytest.mark.parametrize("unroll", [2, 5])
def test_unrolled_scan_equals_scan(unroll):
  """`scan_unroll` (2 of 3 layers per iteration, or more than the depth) changes no result:
  dense and isolated paths, the context cache, and the gradients."""
  base = pf.Transformer(transformer_config(num_layers=3), key=jax.random.key(5))
  unrolled = pf.Transformer(transformer_config(num_layers=3, scan_unroll=unroll),
                            key=jax.random.key(5))
  assert max_abs_diff(unrolled.layers.dense.out.weight, base.layers.dense.out.weight) == 0
  x, pos = inputs(), positions()

  def outputs(t, x):
    dense = t(x, PADDING, OFFSET, pos)
    iso = t.isolated(x[:, :OFFSET], PADDING[:, :OFFSET], x[:, OFFSET:], PADDING[:, OFFSET:],
                     pos[:, :OFFSET], pos[:, OFFSET:])
    _, cache = t.encode_context(x[:, :OFFSET], PADDING[:, :OFFSET], pos[:, :OFFSET])
    loss = lambda t: jnp.sum(jnp.sin(t(x, PADDING, OFFSET, pos).embeddings))
    grads = eqx.filter_grad(loss)(t)
    return dense, iso, cache.keys, jax.tree.leaves(eqx.filter(grads, eqx.is_array))

  got, want = call(eqx.filter_jit(outputs), unrolled, x), call(eqx.filter_jit(outputs), base, x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=rounding(1e-5), atol=rounding(1e-5))
  # Equal results alone would not show the switch reached the layer scan.
  for t, want_unroll in ((base, 1), (unrolled, min(unroll, 3))):
    jaxpr = jax.make_jaxpr(lambda x: t(x, PADDING, OFFSET, pos).embeddings)(x)
    layer_scans = [e.params["unroll"] for e in jaxpr_equations(jaxpr.jaxpr)
                   if e.primitive.name == "scan" and e.params["length"] == 3]
    assert layer_scans == [want_unroll]


def test_scan_unroll_is_validated():
  with pytest.raises(ValueError, match="scan_unroll"):
    transformer_config(scan_unroll=0)


def test_recsys_mask_only_changes_candidates():
  tr = pf.Transformer(transformer_config(), key=jax.random.key(3))
  recsys = call(lambda t, x: t(x, PADDING, OFFSET), tr, inputs()).embeddings
  causal = call(lambda t, x: t(x, PADDING), tr, inputs()).embeddings
  np.testing.assert_allclose(recsys[:, :OFFSET + 1], causal[:, :OFFSET + 1], atol=1e-6)
  assert max_abs_diff(recsys[:, OFFSET + 1:], causal[:, OFFSET + 1:]) > 1e-3


def test_isolated_path_matches_dense_and_chunks():
  tr = pf.Transformer(transformer_config(), key=jax.random.key(4))
  x, pos = inputs(), positions()

  def isolated(t, x):
    ctx, cache = t.encode_context(x[:, :OFFSET], PADDING[:, :OFFSET], pos[:, :OFFSET])
    whole = t.score_candidates(x[:, OFFSET:], PADDING[:, OFFSET:], cache, pos[:, OFFSET:])
    chunks = [t.score_candidates(x[:, s:e], PADDING[:, s:e], cache, pos[:, s:e])
              for s, e in ((OFFSET, OFFSET + 2), (OFFSET + 2, T))]
    return ctx, whole, jnp.concatenate([c.embeddings for c in chunks], axis=1)

  ctx, whole, chunked = call(isolated, tr, x)
  dense = call(lambda t, x: t(x, PADDING, OFFSET, pos), tr, x).embeddings
  valid = PADDING[:, :, None]
  np.testing.assert_allclose(jnp.where(valid[:, :OFFSET], ctx.embeddings, 0),
                             jnp.where(valid[:, :OFFSET], dense[:, :OFFSET], 0), atol=1e-5)
  np.testing.assert_allclose(whole.embeddings, dense[:, OFFSET:], atol=1e-5)
  # Chunks are other matmul shapes, which may round differently: equal on jaxlib 0.10.2,
  # 1.7e-6 apart on jaxlib 0.12's XLA:CPU (2.3 float32 ulps of the largest |embedding|,
  # past the former atol=1e-6); tests/test_ranking.py allows 16 such ulps.
  assert max_abs_diff(chunked, whole.embeddings) <= 16 * float32_ulp(whole.embeddings)


def test_softmax_skips_the_row_max_only_where_the_cap_allows():
  shift_free = pf.transformer._exp_without_shift
  assert shift_free(30.0, jnp.float32, 130) and shift_free(30.0, jnp.bfloat16, 10**6)
  assert not shift_free(30.0, jnp.float32, 2 * 10**6)      # exp(30) * keys too large
  assert shift_free(39.0, jnp.float32, 130) and not shift_free(40.0, jnp.float32, 130)
  assert not shift_free(None, jnp.float32, 130)
  assert not shift_free(30.0, jnp.float16, 130)
  # float16 with one key: exp(5) * 1 fits (5 <= log(max)/2 = 5.55) but exp(-5) falls
  # below the square root of its smallest normal (5 > -log(tiny)/2 = 4.85).
  assert shift_free(4.8, jnp.float16, 1) and not shift_free(5.0, jnp.float16, 1)


def test_float16_isolated_attention_keeps_the_row_max():
  """float16 cannot hold exp(30): under the release's cap its isolated softmax keeps the
  row max (the decision is made for the forward dtype, not float32), and its outputs are
  finite and close to the dense path's."""
  tr = pf.Transformer(transformer_config(attn_logit_cap=30.0, attn_output_multiplier=4.0),
                      key=jax.random.key(0))
  x = (4 * inputs()).astype(jnp.float16)
  mask = jnp.ones((B, T), bool)
  iso = tr.isolated(x[:, :OFFSET], mask[:, :OFFSET], x[:, OFFSET:], mask[:, OFFSET:])
  dense = tr(x, mask, OFFSET)
  assert float(jnp.max(iso.max_abs_attn_logit)) > 20   # exp of it is beyond float16
  assert np.all(np.isfinite(np.asarray(iso.embeddings, np.float32)))
  assert max_abs_diff(iso.embeddings, dense.embeddings) < 0.05


def _isolated_attention_args(cfg, seed=0, context_mask=None, candidate_mask=None,
                             queries=3):
  """Arguments of `_isolated_attention` with 5 context tokens: `queries` candidates, or
  (`queries=None`) the context's own queries."""
  N, KV, G, d = 5, cfg.num_kv_heads, cfg.num_q_heads // cfg.num_kv_heads, cfg.key_size
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(3 * rng.standard_normal(shape), jnp.float32)
  ctx_mask = jnp.ones((B, N), bool) if context_mask is None else context_mask
  args = (cfg, f(B, queries or N, KV, G, d), f(B, N, KV, d), f(B, N, KV, d), ctx_mask)
  if queries is None:
    return args
  cand_mask = jnp.ones((B, queries), bool) if candidate_mask is None else candidate_mask
  return (*args, (f(B, queries, KV, d), f(B, queries, KV, d), cand_mask))


@pytest.mark.parametrize("cap", [30.0, 1.0])
def test_isolated_softmax_without_row_max_equals_with_it(cap, monkeypatch):
  """Both softmax forms of the fast path (exp of the capped logits themselves, and the
  row max subtracted first) give the same attention, for candidates and for the causal
  context; and only the capped form skips the row max (its one max reduction left is the
  max |logit| diagnostic, over every axis)."""
  cfg = transformer_config(attn_logit_cap=cap, attn_output_multiplier=1.0)
  args = _isolated_attention_args(cfg)
  ctx_args = _isolated_attention_args(cfg, 1, queries=None)

  # Fresh functions each time: jit and make_jaxpr cache traces by function, and the
  # branch is taken at trace time.
  def run():
    fresh = lambda cfg, *a: pf.transformer._isolated_attention(cfg, *a)
    return (jax.jit(fresh, static_argnums=0)(*args),
            jax.jit(fresh, static_argnums=0)(*ctx_args))

  def row_maxes():
    fresh = lambda cfg, *a: pf.transformer._isolated_attention(cfg, *a)
    jaxpr = jax.make_jaxpr(fresh, static_argnums=0)(*args)
    return [e for e in jaxpr_equations(jaxpr.jaxpr) if e.primitive.name == "reduce_max"
            and len(e.params["axes"]) < e.invars[0].aval.ndim]

  assert not row_maxes()
  shift_free = run()
  monkeypatch.setattr(pf.transformer, "_exp_without_shift", lambda *a: False)
  assert row_maxes()
  with_max = run()
  # The two forms exponentiate different numbers: equal to a few float32 ulps.
  for a, b in zip(jax.tree.leaves(shift_free), jax.tree.leaves(with_max)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_isolated_query_with_no_kept_key_gets_zeros():
  """A candidate whose own key and every context key are masked (padding): zeros with the
  shift-free softmax, not NaN (0 / 0)."""
  cfg = transformer_config()
  ctx_mask = jnp.array([[False] * 5, [True] * 5])
  cand_mask = jnp.array([[False, True, False], [True, True, True]])
  attn, _ = jax.jit(pf.transformer._isolated_attention, static_argnums=0)(
      *_isolated_attention_args(cfg, 1, ctx_mask, cand_mask))
  assert np.all(np.isfinite(attn))
  assert np.all(attn[0, [0, 2]] == 0) and np.all(np.abs(attn[0, 1]) > 0)
  assert np.all(np.abs(attn[1]) > 0)


def test_candidate_with_an_empty_context_attends_to_itself_with_the_row_max():
  """Without a soft cap the fast path subtracts the row max. A candidate whose context is
  all padding sees its own key only, so its row max must include its own logit (the
  context's are all MASK_VALUE): its attention is then its own value, as the dense
  softmax over that one key gives, not exp(own + 1e30) = inf."""
  cfg = transformer_config(attn_logit_cap=None, attn_output_multiplier=1.0)
  ctx_mask = jnp.array([[False] * 5, [True] * 5])
  args = _isolated_attention_args(cfg, 2, ctx_mask)
  assert not pf.transformer._exp_without_shift(None, jnp.float32, 6)
  attn, _ = jax.jit(pf.transformer._isolated_attention, static_argnums=0)(*args)
  own_v = args[5][1]                                   # [B, C, KV, d]
  G = cfg.num_q_heads // cfg.num_kv_heads
  want = jnp.broadcast_to(own_v[0][:, :, None], attn[0].shape)
  np.testing.assert_allclose(attn[0], want, rtol=1e-6, atol=1e-6)
  assert np.all(np.isfinite(attn)) and G > 1


@pytest.mark.parametrize("layers", [1, 3])
def test_isolated_candidates_equal_isolated(layers):
  """The logits-only path (last layer for the candidates alone) gives the candidate rows
  of `isolated`, with one layer (nothing scanned before it) and with three, and with the
  layers unrolled."""
  x, pos = inputs(), positions()
  ctx, cand = (x[:, :OFFSET], PADDING[:, :OFFSET]), (x[:, OFFSET:], PADDING[:, OFFSET:])

  def paths(t, x):
    args = (x[:, :OFFSET], PADDING[:, :OFFSET], x[:, OFFSET:], PADDING[:, OFFSET:],
            pos[:, :OFFSET], pos[:, OFFSET:])
    return t.isolated(*args).embeddings[:, OFFSET:], t.isolated_candidates(*args)

  for unroll in (1, layers):
    tr = pf.Transformer(transformer_config(num_layers=layers, scan_unroll=unroll),
                        key=jax.random.key(9))
    full, only = call(paths, tr, x)
    assert only.shape == (B, T - OFFSET, transformer_config().emb_size)
    assert float(jnp.max(jnp.abs(full))) > 0.1
    # Two programs of one computation: within 16 float32 ulps of the largest |embedding|
    # (jax 0.8.0 to 0.10.0 rounded the three-layer stack 2.3e-6 to 2.9e-6 apart, about 6).
    assert max_abs_diff(only, full) <= 16 * float32_ulp(full)
  with pytest.raises(ValueError, match="candidates holds 1 users but the context holds 2"):
    tr.isolated_candidates(ctx[0], ctx[1], cand[0][:1], cand[1][:1])


@pytest.mark.parametrize("layers,layout", [(1, "sandwich"), (3, "post")])
def test_context_cache_equals_encode_contexts_cache(layers, layout):
  """`context_cache` (the last layer stops after its key/value projection) gives the
  keys, values and mask of `encode_context`."""
  tr = pf.Transformer(transformer_config(num_layers=layers, norm_layout=layout),
                      key=jax.random.key(10))
  ctx, mask, pos = inputs()[:, :OFFSET], PADDING[:, :OFFSET], positions()[:, :OFFSET] + 2

  def caches(t, x):
    return t.encode_context(x, mask, pos)[1], t.context_cache(x, mask, pos)

  full, alone = call(caches, tr, ctx)
  assert alone.keys.shape == full.keys.shape == (layers, B, OFFSET, 2, 8)
  assert float(jnp.max(jnp.abs(full.values[-1]))) > 0.1
  for got, want in zip(alone, full):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_layer_refuses_an_attention_output_of_the_wrong_rows():
  """With `out_from`, the attention block must return exactly the rows `out_from:`; a
  block that returns every row is an error, not a silent broadcast (here C = 1)."""
  lyr, x = decoder_layer(transformer_config()), inputs()
  full = lambda a, y: a(y, dense_mask(), positions())
  with pytest.raises(ValueError, match=r"returned shape \(2, 7, 32\) for rows 6:"):
    lyr(x, full, out_from=T - 1)


def test_score_candidates_default_positions_follow_the_context():
  """Without explicit positions, cached scoring numbers candidates N, N+1, ... after an
  N-token context, as the dense path's default positions 0..T-1 do."""
  tr = pf.Transformer(transformer_config(), key=jax.random.key(5))
  x = inputs(1)

  def isolated(t, x):
    _, cache = t.encode_context(x[:, :OFFSET], PADDING[:, :OFFSET])
    return t.score_candidates(x[:, OFFSET:], PADDING[:, OFFSET:], cache).embeddings

  dense = call(lambda t, x: t(x, PADDING, OFFSET), tr, x).embeddings
  np.testing.assert_allclose(call(isolated, tr, x), dense[:, OFFSET:], atol=1e-5)


def test_isolated_default_positions_follow_the_context():
  """`isolated` and `isolated_candidates` without positions number the candidates N,
  N+1, ... after an N-token context too: the dense path's default positions 0..T-1."""
  tr = pf.Transformer(transformer_config(), key=jax.random.key(5))
  x = inputs(1)

  def isolated(t, x):
    args = (x[:, :OFFSET], PADDING[:, :OFFSET], x[:, OFFSET:], PADDING[:, OFFSET:])
    return t.isolated(*args).embeddings, t.isolated_candidates(*args)

  dense = call(lambda t, x: t(x, PADDING, OFFSET), tr, x).embeddings
  both, only = call(isolated, tr, x)
  valid = PADDING[:, :, None]
  np.testing.assert_allclose(jnp.where(valid, both, 0), jnp.where(valid, dense, 0), atol=1e-5)
  np.testing.assert_allclose(only, dense[:, OFFSET:], atol=1e-5)


def test_rezero_layers_are_identity_at_init():
  cfg = transformer_config(param_init="rezero")
  tr = pf.Transformer(cfg, key=jax.random.key(5))
  assert not np.any(tr.layers.norm_attn_out.scale) and not np.any(tr.layers.norm_dense_out.scale)
  assert np.all(tr.layers.norm_attn_in.scale == 1) and np.all(tr.layers.norm_dense_in.scale == 1)
  assert np.any(tr.layers.attention.qkv.weight)
  x = inputs()
  out = call(lambda t, x: t(x, PADDING, OFFSET), tr, x)
  np.testing.assert_array_equal(out.embeddings, x)
  rms = float(valid_rms(x))
  np.testing.assert_allclose(out.residual_rms, [rms, rms], rtol=1e-6)
  assert np.all(np.asarray(out.max_abs_attn_logit) > 0)


def test_zeros_init_matches_release_placeholders():
  tr = pf.Transformer(transformer_config(param_init="zeros"), key=jax.random.key(6))
  leaves = jax.tree.leaves(eqx.filter(tr.layers, eqx.is_array))
  assert all(not np.any(x) for x in leaves)


def test_no_cap_equals_huge_cap():
  args = (inputs() * 4, dense_mask(), positions())
  out = {}
  huge = pf.config.MAX_ATTENTION_SCALE   # the largest cap the config takes
  for cap in (None, huge, 1.0):
    cfg = transformer_config(attn_logit_cap=cap, attn_output_multiplier=1.0)
    out[cap] = call(lambda a, *xs: a(*xs), decoder_layer(cfg, seed=7).attention, *args)
  np.testing.assert_allclose(out[None][0], out[huge][0], atol=1e-5)
  assert float(out[None][1]) > 1.0
  assert max_abs_diff(out[None][0], out[1.0][0]) > 1e-2


def test_padding_mask_shape_is_checked():
  tr = pf.Transformer(transformer_config(num_layers=1), key=jax.random.key(8))
  with pytest.raises(ValueError, match="padding_mask"):
    tr(inputs(), PADDING[:, :-1])


def test_every_entry_point_checks_its_tokens():
  tr = pf.Transformer(transformer_config(num_layers=1), key=jax.random.key(8))
  x, D = inputs(), transformer_config().emb_size
  ctx, cand = x[:, :OFFSET], x[:, OFFSET:]
  _, cache = tr.encode_context(ctx, PADDING[:, :OFFSET])
  with pytest.raises(ValueError, match=f"embeddings must be \\[B, T, emb_size={D}\\]"):
    tr(x[..., :-1], PADDING)
  with pytest.raises(ValueError, match="positions has shape"):
    tr(x, PADDING, OFFSET, positions()[:, :-1])
  with pytest.raises(ValueError, match="context must be"):
    tr.encode_context(ctx[0], PADDING[0, :OFFSET])
  with pytest.raises(ValueError, match="candidates holds 1 users but the cache holds 2"):
    tr.score_candidates(cand[:1], PADDING[:1, OFFSET:], cache)
  with pytest.raises(TypeError, match="cache must be a ContextCache, got tuple"):
    tr.score_candidates(cand, PADDING[:, OFFSET:], tuple(cache))   # (an AttributeError)
  _, bf16_cache = tr.encode_context(ctx.astype(jnp.bfloat16), PADDING[:, :OFFSET])
  with pytest.raises(ValueError, match="cache.keys has dtype bfloat16, expected float32"):
    tr.score_candidates(cand, PADDING[:, OFFSET:], bf16_cache)   # (promoted silently)
  # A 0/1 float mask is taken, and the cache holds it as booleans, as scoring expects.
  _, float_cache = tr.encode_context(ctx, PADDING[:, :OFFSET].astype(jnp.float32))
  assert float_cache.padding_mask.dtype == jnp.bool_
  np.testing.assert_array_equal(
      tr.score_candidates(cand, PADDING[:, OFFSET:], float_cache).embeddings,
      tr.score_candidates(cand, PADDING[:, OFFSET:], cache).embeddings)
  # Each field of a cache is checked for its own dtype: values apart from keys, and the
  # mask as booleans (a float mask in a hand-built cache is named, not taken).
  half = lambda x: x.astype(jnp.bfloat16)
  with pytest.raises(ValueError, match="cache.values has dtype bfloat16, expected float32"):
    tr.score_candidates(cand, PADDING[:, OFFSET:], cache._replace(values=half(cache.values)))
  with pytest.raises(ValueError, match="cache.padding_mask has dtype float32, expected bool"):
    tr.score_candidates(cand, PADDING[:, OFFSET:], cache._replace(
        padding_mask=cache.padding_mask.astype(jnp.float32)))
  with pytest.raises(ValueError, match="candidates: padding_mask"):
    tr.isolated(ctx, PADDING[:, :OFFSET], cand, PADDING[:, :OFFSET])
  with pytest.raises(ValueError, match=r"context: positions has shape \(2, 2\)"):
    tr.isolated(ctx, PADDING[:, :OFFSET], cand, PADDING[:, OFFSET:],
                context_positions_BN=positions()[:, :2])
  with pytest.raises(ValueError, match="candidates holds 1 users but the context holds 2"):
    tr.isolated(ctx, PADDING[:, :OFFSET], cand[:1], PADDING[:1, OFFSET:])
  with pytest.raises(ValueError, match="embeddings must be float embeddings, got dtype int32"):
    tr(x.astype(jnp.int32), PADDING)
  with pytest.raises(ValueError, match="context must be float"):
    tr.encode_context(ctx.astype(jnp.int32), PADDING[:, :OFFSET])
