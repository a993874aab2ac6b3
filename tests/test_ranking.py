"""PhoenixModel: isolation, padding, positions, init, transforms, dtypes, diagnostics,
input checks, and the isolated-vs-dense equality grid (outputs and gradients)."""

import collections
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phoenix_flax as pf
from conftest import (EMB, NUM_ACTIONS, call, float32_ulp, forward, index_candidates,
                      jaxpr_equations, layer, make_batch, max_abs_diff, ranking_config,
                      retrieval_config, transformer_config)
from phoenix_flax import haiku_compat
from phoenix_flax.layers import apply_rope
from phoenix_flax.types import CANDIDATE_BATCH_FIELDS, CANDIDATE_EMBEDDING_FIELDS

HISTORY_VALID = [4, 2]
CANDIDATE_MASK = [[1, 1, 1], [1, 0, 1]]


def model_for(config, seed=0):
  return pf.PhoenixModel(config, key=jax.random.key(seed))


def padded_batch(config, seed=0, **overrides):
  kw = dict(history_valid=HISTORY_VALID, candidate_mask=CANDIDATE_MASK)
  kw.update(overrides)
  return make_batch(config, 2, seed, **kw)


def perturb_candidate(batch, emb, j):
  """New content for candidate slot j (hashes stay valid)."""
  bump = lambda x, v: x.at[:, j].set(v)
  batch = batch._replace(candidate_post_hashes=bump(batch.candidate_post_hashes, 777),
                         candidate_product_surface=bump(batch.candidate_product_surface, 5))
  emb = emb._replace(
      candidate_post_embeddings=bump(emb.candidate_post_embeddings,
                                     -emb.candidate_post_embeddings[:, j] + 0.3),
      candidate_author_embeddings=bump(emb.candidate_author_embeddings,
                                       emb.candidate_author_embeddings[:, j] * 2))
  return batch, emb


@pytest.mark.parametrize("impl", ["isolated", "dense"])
def test_forward_shapes_and_diagnostics(impl):
  cfg = ranking_config(attention_impl=impl)
  out, diag = forward(model_for(cfg), *padded_batch(cfg))
  assert out.logits.shape == (2, 3, NUM_ACTIONS) and out.logits.dtype == jnp.float32
  assert out.continuous is None
  L = cfg.model.num_layers
  assert diag.max_abs_attn_logit.shape == (L,) and diag.residual_rms.shape == (L,)
  assert np.all(np.isfinite(diag.max_abs_attn_logit)) and np.all(np.isfinite(diag.residual_rms))
  assert np.all(np.asarray(diag.max_abs_attn_logit) > 0)
  assert np.all(np.isfinite(out.logits)) and float(jnp.std(out.logits)) > 0.1


@pytest.mark.parametrize("impl", ["isolated", "dense"])
def test_isolation_other_candidates_unchanged(impl):
  cfg = ranking_config(attention_impl=impl)
  model, (batch, emb) = model_for(cfg), padded_batch(cfg)
  base = forward(model, batch, emb)[0].logits
  changed = forward(model, *perturb_candidate(batch, emb, 1))[0].logits
  assert max_abs_diff(base[0, 1], changed[0, 1]) > 1e-3
  np.testing.assert_allclose(changed[:, [0, 2]], base[:, [0, 2]], atol=1e-6)


def test_without_isolation_later_candidates_change():
  cfg = ranking_config(candidate_isolation=False)
  model, (batch, emb) = model_for(cfg), padded_batch(cfg, candidate_mask=None)
  base = forward(model, batch, emb)[0].logits
  changed = forward(model, *perturb_candidate(batch, emb, 1))[0].logits
  np.testing.assert_allclose(changed[:, 0], base[:, 0], atol=1e-6)
  assert max_abs_diff(base[:, 1], changed[:, 1]) > 1e-3
  assert max_abs_diff(base[:, 2], changed[:, 2]) > 1e-3


@pytest.mark.parametrize("impl", ["isolated", "dense"])
@pytest.mark.parametrize("case", [
    dict(candidate_mask=[[0, 1, 1], [1, 0, 0]]),
    dict(history_valid=[0, 0]),
    dict(history_valid=[0, 4], user_valid=[False, True], candidate_mask=[[0, 0, 0], [1, 1, 1]]),
    dict(history_valid=[0, 4], user_valid=[False, True], candidate_mask=None),
], ids=["padded_candidates", "empty_history", "fully_padded_row", "padded_context"])
def test_padding_gives_finite_outputs(impl, case):
  cfg = ranking_config(attention_impl=impl)
  out, diag = forward(model_for(cfg), *padded_batch(cfg, **case))
  assert np.all(np.isfinite(out.logits))
  assert np.all(np.isfinite(diag.max_abs_attn_logit)) and np.all(np.isfinite(diag.residual_rms))


def test_padded_context_with_valid_candidates_matches_dense():
  """A row whose user and history are all padding: each candidate attends to itself only.
  The fast path's softmax must take the candidate's own logit into its row maximum, or
  exp(own - (-1e30)) overflows."""
  cfg = ranking_config()
  batch, emb = padded_batch(cfg, history_valid=[0, 4], user_valid=[False, True],
                            candidate_mask=None)
  fast = forward(model_for(cfg), batch, emb)[0].logits
  dense = forward(model_for(dataclasses.replace(cfg, attention_impl="dense")), batch, emb)[0]
  assert np.all(np.isfinite(fast))
  np.testing.assert_allclose(fast, dense.logits, atol=1e-5)


@pytest.mark.parametrize("impl", ["isolated", "dense"])
def test_padded_user_and_history_do_not_reach_candidates(impl):
  """Padded tokens are masked as keys: the embeddings of a padded user (hash 0) and of
  padded history items do not change any valid candidate's logits."""
  cfg = ranking_config(attention_impl=impl)
  model = model_for(cfg)
  batch, emb = padded_batch(cfg, user_valid=[False, True])    # row 1: 2 padded items
  base = forward(model, batch, emb)[0].logits
  pad_SI = (batch.history_post_hashes[..., :1] == 0)[..., None]
  moved = lambda x: jnp.where(pad_SI, 3.0 - 2.0 * x, x)
  other = emb._replace(user_embeddings=emb.user_embeddings.at[0].multiply(-2.0),
                       history_post_embeddings=moved(emb.history_post_embeddings),
                       history_author_embeddings=moved(emb.history_author_embeddings))
  changed = forward(model, batch, other)[0].logits
  valid = np.asarray(CANDIDATE_MASK, bool)
  np.testing.assert_allclose(changed[valid], base[valid], atol=1e-5)
  live = emb._replace(user_embeddings=emb.user_embeddings.at[1].multiply(-2.0))
  assert max_abs_diff(forward(model, batch, live)[0].logits[1], base[1]) > 1e-3


@pytest.mark.parametrize("impl", ["isolated", "dense"])
def test_right_anchored_permuting_candidates_permutes_logits(impl):
  cfg = ranking_config(right_anchored_rope=True, attention_impl=impl)
  model, (batch, emb) = model_for(cfg), padded_batch(cfg)
  perm = np.array([2, 0, 1])
  base = forward(model, batch, emb)[0].logits
  permuted = forward(model, *index_candidates(batch, emb, perm))[0].logits
  np.testing.assert_allclose(permuted, base[:, perm], atol=1e-5)


def test_sequential_positions_make_slots_matter():
  cfg = ranking_config()
  model, (batch, emb) = model_for(cfg), padded_batch(cfg, candidate_mask=None)
  perm = np.array([2, 0, 1])
  base = forward(model, batch, emb)[0].logits
  permuted = forward(model, *index_candidates(batch, emb, perm))[0].logits
  assert max_abs_diff(permuted, base[:, perm]) > 1e-4


@eqx.filter_jit
def logit_grads(model, batch, emb, weights):
  return eqx.filter_grad(lambda m: jnp.sum(m(batch, emb).logits * weights))(model)


def _zero_placeholders(model):
  """The model with the release's all-zero transformer weights and final-norm scale."""
  arrays, static = eqx.partition(model.transformer.layers, eqx.is_array)
  zeroed = eqx.combine(jax.tree.map(jnp.zeros_like, arrays), static)
  return eqx.tree_at(lambda m: (m.transformer.layers, m.final_norm.scale), model,
                     (zeroed, jnp.zeros_like(model.final_norm.scale)))


GRAD_WEIGHTS = np.random.default_rng(9).standard_normal((2, 3, NUM_ACTIONS)).astype(np.float32)


def test_gradients_reach_every_transformer_weight():
  cfg = ranking_config()
  grads = logit_grads(model_for(cfg), *padded_batch(cfg), GRAD_WEIGHTS)
  leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(grads.transformer, eqx.is_array))
  assert len(leaves) == 2 + 2 + 4
  for path, g in leaves:
    for i in range(cfg.model.num_layers):
      assert np.any(g[i] != 0), (jax.tree_util.keystr(path), i)
  for g in jax.tree.leaves(eqx.filter(grads, eqx.is_array)):
    assert np.all(np.isfinite(g))


def test_zeros_init_gradients_are_exactly_zero():
  cfg = ranking_config()
  released = model_for(ranking_config(transformer=transformer_config(param_init="zeros")))
  placeholders = _zero_placeholders(model_for(cfg))
  for a, b in zip(jax.tree.leaves(eqx.filter(released, eqx.is_array)),
                  jax.tree.leaves(eqx.filter(placeholders, eqx.is_array))):
    np.testing.assert_array_equal(a, b)
  grads = logit_grads(placeholders, *padded_batch(cfg), GRAD_WEIGHTS)
  leaves = jax.tree.leaves(eqx.filter(grads.transformer, eqx.is_array))
  assert len(leaves) == 8 and all(np.all(g == 0) for g in leaves)
  np.testing.assert_array_equal(forward(placeholders, *padded_batch(cfg))[0].logits, 0.0)
  # Outside the transformer the zeros stop nothing: the final norm's scale multiplies the
  # untouched residual stream, so it (and what feeds it) gets a gradient.
  assert np.any(grads.final_norm.scale != 0)


def test_vmap_over_batches():
  cfg = ranking_config()
  model = model_for(cfg)
  pairs = [padded_batch(cfg, seed=s) for s in (0, 1)]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *pairs)
  vmapped = call(jax.vmap(lambda b, e: model(b, e).logits), *stacked)
  for i, (batch, emb) in enumerate(pairs):
    np.testing.assert_allclose(vmapped[i], forward(model, batch, emb)[0].logits, atol=1e-5)


def test_batch_and_embeddings_are_jit_pytrees_in_release_order():
  batch, emb = padded_batch(ranking_config())
  out = jax.jit(lambda b, e: (b, e))(batch, emb)
  assert isinstance(out[0], pf.RecsysBatch) and isinstance(out[1], pf.RecsysEmbeddings)
  assert pf.RecsysBatch._fields[:8] == (
      "user_hashes", "history_post_hashes", "history_author_hashes", "history_actions",
      "history_product_surface", "candidate_post_hashes", "candidate_author_hashes",
      "candidate_product_surface")
  assert pf.RecsysEmbeddings._fields == (
      "user_embeddings", "history_post_embeddings", "candidate_post_embeddings",
      "history_author_embeddings", "candidate_author_embeddings")


BF16_TOLERANCE = 0.05  # relative to max |logit|; observed max diff 1-1.5% of it


def test_bfloat16_runs_and_stays_close_to_float32():
  cfg32, cfg16 = ranking_config(), ranking_config(fprop_dtype="bfloat16")
  batch, emb = padded_batch(cfg32)
  m32, m16 = model_for(cfg32), model_for(cfg16)
  tokens, out16 = call(lambda m, b, e: (m.build_inputs(b, e)[0], m(b, e).logits), m16, batch,
                       emb)
  assert tokens.dtype == jnp.bfloat16
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(eqx.filter(m16, eqx.is_array)))
  out32 = forward(m32, batch, emb)[0].logits
  assert np.all(np.isfinite(out16)) and out16.dtype == jnp.float32   # unembedded in float32
  diff = max_abs_diff(out16, out32)
  assert 1e-4 < diff < BF16_TOLERANCE * float(jnp.max(jnp.abs(out32))), diff


def _direct_diagnostics(model, batch, emb):
  """Per layer, by hand: max |q.k| * multiplier over the entries a non-padded query attends
  to (before the cap) and the RMS of the layer's output over the non-padded tokens, running
  the layers one by one on the dense mask."""
  cfg = model.config.model
  H, KV, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.key_size
  h, mask, offset = model.build_inputs(batch, emb)
  B, T, _ = h.shape
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32), (B, T))
  allowed = pf.make_recsys_attn_mask(T, offset).astype(bool) & mask[:, None, None, :]
  max_logits, rms = [], []
  for i in range(cfg.num_layers):
    lyr = layer(model.transformer, i)
    x = lyr.norm_attn_in(h)
    w = lyr.attention.qkv.weight
    q = apply_rope((x @ w[:, :H * d]).reshape(B, T, H, d), pos)
    k = apply_rope((x @ w[:, H * d:(H + KV) * d]).reshape(B, T, KV, d), pos)
    raw = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, H // KV, axis=2))
    raw = raw * cfg.attn_output_multiplier
    counted = allowed & mask.astype(bool)[:, None, :, None]   # valid queries' rows only
    max_logits.append(jnp.max(jnp.where(counted, jnp.abs(raw), 0.0)))
    h = lyr(h, lambda a, y: a(y, allowed.astype(h.dtype), pos))[0]
    valid = mask.astype(bool)[..., None]   # the RMS counts non-padded tokens only
    count = (jnp.sum(valid) * h.shape[-1]).astype(jnp.float32)
    rms.append(jnp.sqrt(jnp.sum(jnp.where(valid, h * h, 0.0)) / count))
  return jnp.stack(max_logits), jnp.stack(rms)


CAP1 = dict(attn_logit_cap=1.0, attn_output_multiplier=1.0)


def test_diagnostics_match_direct_computation():
  cfg = ranking_config(transformer=transformer_config(**CAP1))
  model, (batch, emb) = model_for(cfg), padded_batch(cfg)
  _, diag = forward(model, batch, emb)
  max_logits, rms = call(_direct_diagnostics, model, batch, emb)
  assert float(jnp.min(max_logits)) > 1.0
  np.testing.assert_allclose(diag.max_abs_attn_logit, max_logits, rtol=1e-5)
  np.testing.assert_allclose(diag.residual_rms, rms, rtol=1e-5)


def test_project_parts_equals_the_concatenated_product():
  rng = np.random.default_rng(0)
  parts = [jnp.asarray(rng.standard_normal((2, 3, w)), jnp.float32) for w in (8, 8, 4)]
  proj = jnp.asarray(rng.standard_normal((20, 5)), jnp.float32)
  got = jax.jit(pf.ranking.project_parts)(parts, proj)
  want = jax.jit(lambda parts, proj: jnp.concatenate(parts, axis=-1) @ proj)(parts, proj)
  np.testing.assert_array_equal(got, want)   # the same product, so the same rounding
  with pytest.raises(ValueError, match="the parts have 16 features in all; the projection "
                                       "takes 20"):
    pf.ranking.project_parts(parts[:2], proj)
  with pytest.raises(ValueError, match="have 24 features"):
    pf.ranking.project_parts(parts + parts[2:], proj)


def test_parameters_outside_the_transformer_start_at_the_documented_scales():
  """docs/models.md: each projection outside the transformer draws a standard deviation of
  1/sqrt(its input width) (the first axis: `action_projection` 1/sqrt(A), `unembeddings`
  1/sqrt(D), the candidate tower's two projections), each embedding table 1/sqrt(D)."""
  tc = transformer_config(emb_size=128, key_size=32)
  models = [pf.PhoenixModel(ranking_config(transformer=tc, post_age_granularity_mins=10,
                                           dwell_time_norm=pf.NormConfig(),
                                           dwell_hidden_size=64, num_continuous_actions=8),
                            key=jax.random.key(0)),
            pf.PhoenixRetrievalModel(retrieval_config(transformer=tc), key=jax.random.key(0))]
  checked = set()
  for model in models:
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array))
    for path, w in leaves:
      name = jax.tree_util.keystr(path)
      if ".transformer" in name or ".final_norm" in name or w.size < 500:
        continue
      fan_in = w.shape[1] if name.endswith("_table") else w.shape[0]
      tol = max(0.03, 5 / np.sqrt(w.size))
      assert np.std(np.asarray(w)) == pytest.approx(1 / np.sqrt(fan_in), rel=tol), name
      checked.add(name.rsplit(".", 1)[-1])
  assert {"action_projection", "unembeddings", "proj_mat_1", "proj_mat_2", "proj_mat_3",
          "product_surface_embedding_table", "post_age_embedding_table", "dwell_proj_2",
          "continuous_unembeddings", "projection_1", "projection_2"} <= checked, checked


def test_later_release_features():
  cfg = ranking_config(post_age_granularity_mins=60, dwell_time_norm=pf.NormConfig(),
                       num_continuous_actions=2)
  model = model_for(cfg)
  assert model.post_age_embedding_table.shape == (4800 // 60 + 2, EMB)
  batch, emb = padded_batch(cfg)
  now = 1_000_000
  batch = batch._replace(impression_timestamps=jnp.array([now, now], jnp.int32),
                         candidate_post_timestamps=jnp.full((2, 3), now - 1800, jnp.int32),
                         history_dwell_times=jnp.full((2, 4), 12.0))
  out = forward(model, batch, emb)[0]
  assert out.continuous.shape == (2, 3, 2)
  assert np.all((out.continuous > 0) & (out.continuous < 1))
  older = batch._replace(candidate_post_timestamps=batch.candidate_post_timestamps - 7200)
  assert max_abs_diff(forward(model, older, emb)[0].logits, out.logits) > 1e-3
  with pytest.raises(ValueError, match="impression_timestamps"):
    model(batch._replace(impression_timestamps=None), emb)
  with pytest.raises(ValueError, match="history_dwell_times"):
    model(batch._replace(history_dwell_times=None), emb)


def _grow_last(x):
  return jnp.zeros(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype)


BAD_FIELDS = ["user_hashes", "history_post_hashes", "history_author_hashes",
              "history_actions", "history_product_surface", "candidate_post_hashes",
              "candidate_author_hashes", "candidate_product_surface", "user_embeddings",
              "history_post_embeddings", "candidate_post_embeddings",
              "history_author_embeddings", "candidate_author_embeddings"]


@pytest.mark.parametrize("field", BAD_FIELDS)
def test_wrong_shape_names_the_field(field):
  cfg = ranking_config()
  model, (batch, emb) = model_for(cfg), padded_batch(cfg)
  if field in batch._fields:
    batch = batch._replace(**{field: _grow_last(getattr(batch, field))})
  else:
    emb = emb._replace(**{field: _grow_last(getattr(emb, field))})
  with pytest.raises((AssertionError, ValueError), match=field):
    model(batch, emb)


def test_wrong_dtype_names_the_field():
  cfg = ranking_config()
  model, (batch, emb) = model_for(cfg), padded_batch(cfg)
  with pytest.raises(AssertionError, match="candidate_post_hashes"):
    model(batch._replace(candidate_post_hashes=batch.candidate_post_hashes.astype(jnp.float32)),
          emb)
  with pytest.raises(AssertionError, match="user_embeddings"):
    model(batch, emb._replace(user_embeddings=emb.user_embeddings.astype(jnp.int32)))


def test_a_model_is_built_from_one_prng_key():
  from conftest import retrieval_config
  for cls, cfg in ((pf.PhoenixModel, ranking_config()),
                   (pf.PhoenixRetrievalModel, retrieval_config())):
    for key in (0, jax.random.split(jax.random.key(0), 2), jnp.zeros((2, 2), jnp.uint32)):
      with pytest.raises(TypeError, match=rf"{cls.__name__}: key=.* is not a PRNG key; pass "
                                          r"jax.random.key\(seed\)"):
        cls(cfg, key=key)
    cls(cfg, key=jax.random.PRNGKey(0))   # the legacy uint32[2] key
    previous = jax.config.jax_default_prng_impl
    try:   # another default implementation's raw keys: rbg's are uint32[4]
      jax.config.update("jax_default_prng_impl", "rbg")
      cls(cfg, key=jax.random.PRNGKey(0))
    finally:
      jax.config.update("jax_default_prng_impl", previous)
    with pytest.raises(TypeError, match="an array of shape \\(4,\\) and dtype uint32"):
      cls(cfg, key=jax.random.key_data(jax.random.key(0, impl="rbg")))   # not the default's


@pytest.mark.parametrize("entry", ["build_inputs", "build_context_tokens",
                                   "build_candidate_tokens", "score_candidates"])
def test_every_model_entry_point_names_a_bad_field(entry):
  cfg = ranking_config()
  model, (batch, emb) = model_for(cfg), padded_batch(cfg)
  cache = model.encode_context(batch, emb)
  call = {"score_candidates": lambda b, e: model.score_candidates(cache, b, e)}.get(
      entry, getattr(model, entry))
  call(batch, emb)
  bad = emb._replace(candidate_post_embeddings=emb.candidate_post_embeddings[..., :-1])
  if entry == "build_context_tokens":
    bad = emb._replace(history_post_embeddings=emb.history_post_embeddings[..., :-1])
  with pytest.raises(AssertionError, match="post_embeddings"):
    call(batch, bad)
  with pytest.raises(AssertionError, match="hashes must hold integers"):
    call(batch._replace(candidate_post_hashes=batch.candidate_post_hashes.astype(jnp.float32),
                        history_post_hashes=batch.history_post_hashes.astype(jnp.float32)),
         emb)
  # Another type with the same fields (the release's namedtuples, say) is refused by type.
  foreign_batch = collections.namedtuple("ReleaseBatch", pf.RecsysBatch._fields)(*batch)
  with pytest.raises(TypeError, match="batch must be a RecsysBatch, got ReleaseBatch"):
    call(foreign_batch, emb)
  foreign_emb = collections.namedtuple("ReleaseEmbeddings", pf.RecsysEmbeddings._fields)(*emb)
  with pytest.raises(TypeError, match="embeddings must be RecsysEmbeddings, got "
                                      "ReleaseEmbeddings"):
    call(batch, foreign_emb)
  if entry == "score_candidates":   # a batch of other users than the cache's
    one = jax.tree.map(lambda x: x[:1], (batch, emb))
    with pytest.raises(AssertionError, match="candidate_post_hashes"):
      call(*one)


def test_each_field_is_checked_for_its_dtype():
  """Each check of `types.py` names the field whose dtype is wrong: fields that a model
  would cast (float surfaces or timestamps, integer embeddings) are refused, not cast."""
  cfg = ranking_config(post_age_granularity_mins=60)
  model, (batch, emb) = model_for(cfg), padded_batch(cfg)
  as_type = lambda x, dtype: jnp.asarray(x, dtype)
  bad = [("history_product_surface must hold integers", batch._replace(
              history_product_surface=as_type(batch.history_product_surface, jnp.float32)), emb),
         ("candidate_product_surface must hold integers", batch._replace(
              candidate_product_surface=as_type(batch.candidate_product_surface,
                                                jnp.float32)), emb),
         ("candidate_post_timestamps must hold integers", batch._replace(
              candidate_post_timestamps=as_type(batch.candidate_post_timestamps,
                                                jnp.float32)), emb),
         ("user_hashes must hold integers", batch._replace(
              user_hashes=as_type(batch.user_hashes, jnp.float32)), emb),
         ("impression_timestamps must hold integers", batch._replace(
              impression_timestamps=as_type(batch.impression_timestamps, jnp.float32)), emb),
         ("candidate_post_embeddings must hold floats", batch, emb._replace(
              candidate_post_embeddings=as_type(emb.candidate_post_embeddings, jnp.int32)))]
  for match, b, e in bad:
    with pytest.raises(AssertionError, match=match):
      model.build_inputs(b, e)


def test_item_and_author_hash_counts_may_differ():
  """Every check and projection takes the item and author hash counts from their own
  fields: with 2 item and 3 author hashes both models run, and the cached context scores
  as the forward pass does."""
  hc = pf.HashConfig(num_user_hashes=1, num_item_hashes=2, num_author_hashes=3)
  cfg = ranking_config(hash_config=hc)
  model, (batch, emb) = model_for(cfg), padded_batch(cfg)
  assert emb.history_author_embeddings.shape[2] == 3
  out, _ = forward(model, batch, emb)
  cached = call(lambda m, b, e: m.score_candidates(m.encode_context(b, e), b, e),
                model, batch, emb)
  np.testing.assert_allclose(cached.logits, out.logits, atol=1e-5)
  rcfg = retrieval_config(hash_config=hc)
  retrieval = pf.PhoenixRetrievalModel(rcfg, key=jax.random.key(0))
  batch, emb = padded_batch(rcfg)
  user, _ = call(retrieval.build_user_representation, batch, emb)
  items, _ = call(retrieval.build_candidate_representation, batch, emb)
  assert user.shape == (2, EMB) and items.shape == (2, 3, EMB)
  assert np.all(np.isfinite(user)) and np.all(np.isfinite(items))


def test_score_candidates_needs_candidate_isolation():
  """Without isolation a candidate attends to the candidates before it, so no cached
  context scores it: refused, rather than logits unlike the model's own forward."""
  cfg = ranking_config(candidate_isolation=False)
  model, (batch, emb) = model_for(cfg), padded_batch(cfg)
  cache = model.encode_context(batch, emb)
  with pytest.raises(ValueError, match="score_candidates needs candidate_isolation=True"):
    model.score_candidates(cache, batch, emb)


def test_score_candidates_refuses_a_cache_of_another_model():
  """A cache encoded by a model of another history length or forward dtype scored silently
  (wrong logits); one of another depth or head split failed deep in the scan. Each is
  refused naming the cache's field, jitted too (the check reads shapes only)."""
  cfg = ranking_config()
  model, (batch, emb) = model_for(cfg), padded_batch(cfg)
  score = lambda cache: model.score_candidates(cache, batch, emb)
  score(model.encode_context(batch, emb))
  with pytest.raises(TypeError, match="cache must be a ContextCache, got tuple"):
    score(tuple(model.encode_context(batch, emb)))   # (it was an AttributeError)
  others = {"history": (dict(history=6), r"cache.keys has shape \(2, 2, 7, 2, 8\), expected "
                                         r"\(2, 2, 5, 2, 8\).*history_seq_len=4"),
            "dtype": (dict(fprop_dtype="bfloat16"),
                      r"cache.keys has dtype bfloat16, expected float32.*fprop_dtype='float32'"),
            "depth": (dict(transformer=transformer_config(num_layers=3)),
                      r"cache.keys has shape \(3, "),
            "heads": (dict(transformer=transformer_config(num_q_heads=2, num_kv_heads=1,
                                                          key_size=16)),
                      r"cache.keys has shape \(2, 2, 5, 1, 16\)")}
  for name, (overrides, message) in others.items():
    other_cfg = ranking_config(**overrides)
    other_batch, other_emb = make_batch(other_cfg, 2)
    cache = model_for(other_cfg).encode_context(other_batch, other_emb)
    with pytest.raises(ValueError, match=message):
      score(cache)
    with pytest.raises(ValueError, match=message):
      jax.jit(score)(cache)
  cache = model.encode_context(batch, emb)
  with pytest.raises(ValueError, match=r"cache.padding_mask has shape \(2, 4\)"):
    score(cache._replace(padding_mask=cache.padding_mask[:, :-1]))


@pytest.mark.parametrize("impl", ["isolated", "dense"])
def test_a_batch_of_no_users_or_no_candidates_names_the_field(impl):
  """B = 0 or C = 0 failed in a reshape (ZeroDivisionError) on every path."""
  cfg = ranking_config(attention_impl=impl)
  model, (batch, emb) = model_for(cfg), padded_batch(cfg)
  cut = lambda nt, fields: nt._replace(**{f: getattr(nt, f)[:, :0] for f in fields
                                          if getattr(nt, f) is not None})
  no_candidates = (cut(batch, CANDIDATE_BATCH_FIELDS), cut(emb, CANDIDATE_EMBEDDING_FIELDS))
  for entry in (model, model.forward):
    with pytest.raises(ValueError, match=r"candidate_post_hashes holds no candidates"):
      entry(*no_candidates)
  no_users = jax.tree.map(lambda x: x[:0], (batch, emb))
  for entry in (model, model.forward, model.encode_context):
    with pytest.raises(ValueError, match=r"user_hashes holds no users \(B = 0\)"):
      entry(*no_users)


def test_history_actions_of_another_count_than_the_config_are_refused_by_name():
  """(chex's shape AssertionError, deeper in, named neither the field nor the config.)"""
  cfg = ranking_config()
  model, (batch, emb) = model_for(cfg), padded_batch(cfg)
  fewer = batch._replace(history_actions=batch.history_actions[..., :5])
  for entry in (model, model.encode_context):
    with pytest.raises(ValueError, match=rf"history_actions has 5 actions, "
                                         rf"config.num_actions={cfg.num_actions}"):
      entry(fewer, emb)


def test_fields_the_model_does_not_read_are_ignored():
  """Timestamps and dwell times count only with the options that read them (as released);
  otherwise the model neither checks nor reads them, in one pass or in micro-batches."""
  cfg = ranking_config()
  model, (batch, emb) = model_for(cfg), padded_batch(cfg)
  junk = batch._replace(impression_timestamps=jnp.full((7,), -1.5),
                        candidate_post_timestamps=jnp.zeros((1,), bool),
                        history_dwell_times=jnp.zeros((3, 2, 1)))
  np.testing.assert_array_equal(model(junk, emb).logits, model(batch, emb).logits)
  # Micro-batches (groups of one user, candidates two at a time) slice only what the
  # model reads: the junk above used to be sliced too, and failed.
  micro = model_for(dataclasses.replace(cfg, micro_batch_rows=2))
  assert micro.micro_batch_limits(2, 3) == (1, 2)
  np.testing.assert_array_equal(micro(junk, emb).logits, micro(batch, emb).logits)
  with pytest.raises(ValueError, match="impression_timestamps is required: "
                     "post_age_granularity_mins is set"):
    model_for(dataclasses.replace(cfg, post_age_granularity_mins=60))(batch, emb)


def test_wrong_history_length_names_the_field():
  model, (batch, emb) = model_for(ranking_config()), make_batch(ranking_config(history=5), 2)
  with pytest.raises(AssertionError, match="history_post_hashes"):
    model(batch, emb)


# Isolated vs dense equality grid (issue 3, item 1). Defaults: B=2, S=4, C=3, D=32,
# 2 layers, 4 query / 2 KV heads, cap 30, sandwich, sequential positions, padded history
# (rows with S and S/2 valid items) and padded candidates (every third of row 1). Cases
# vary several axes at once, and three share their shapes with other tests here, to keep
# the number of compilations small.
GRID = {
    "base": {},
    "right_anchored": dict(right_anchored_rope=True),
    "cap1_active": CAP1,
    "C40_right_anchored": dict(candidates=40, right_anchored_rope=True),
    "C40_post_mha_cap1": dict(candidates=40, norm_layout="post", num_kv_heads=4, **CAP1),
    "C1_right_anchored_pre_4q1kv_capoff_empty_history": dict(
        candidates=1, right_anchored_rope=True, norm_layout="pre", num_kv_heads=1,
        attn_logit_cap=None, history_valid=[0, 3]),
    "S16_C2_4q1kv_1layer": dict(history=16, candidates=2, num_kv_heads=1, num_layers=1,
                                history_valid=[16, 5]),
    "3layers_unrolled": dict(num_layers=3, scan_unroll=3),
    # The later release's features and continuous head, and a padded user token
    "post_age_dwell_continuous_no_user": dict(
        candidates=7, history=5, history_valid=[5, 2], user_valid=[True, False],
        post_age_granularity_mins=60, dwell_time_norm=pf.NormConfig(30.0, True),
        num_continuous_actions=2),
}
# The grid cases whose gradients are compared too: together they set every switch
# (`test_every_switch_is_set_in_a_grid_case` checks it).
GRADIENT_GRID = ["base", "C40_post_mha_cap1", "C1_right_anchored_pre_4q1kv_capoff_empty_history"]
# A case's keys go to the config that has a field of that name (a new switch needs no edit
# here); `history`, `candidates` and `history_valid` shape the batch. Anything else is a
# typo, and an error rather than a case that silently tests the default.
BATCH_KEYS = ("history", "candidates", "history_valid", "user_valid")
# The fields a grid case must set away from their defaults: every one that export refuses
# away from its default (every new switch, until it joins `haiku_compat._FREE_FIELDS`).
GRID_SWITCHES = {cls: {f.name for f in dataclasses.fields(cls)} - haiku_compat._FREE_FIELDS[cls]
                 for cls in (pf.TransformerConfig, pf.PhoenixModelConfig)}


def _is_switch(key: str) -> bool:
  """A switch whose setting must change the logits: the non-free fields, and right-anchored
  positions (free, since they have no parameters; the grid's histories are padded)."""
  return key == "right_anchored_rope" or any(key in f for f in GRID_SWITCHES.values())


def _split_case(name: str, case: dict) -> tuple[dict, dict]:
  """A grid case's (TransformerConfig, PhoenixModelConfig) overrides."""
  fields = lambda cls: {f.name for f in dataclasses.fields(cls)}
  transformer, model = fields(pf.TransformerConfig), fields(pf.PhoenixModelConfig)
  unknown = set(case) - transformer - model - set(BATCH_KEYS)
  if unknown:
    raise KeyError(f"grid case {name!r}: {sorted(unknown)} name no config field")
  return ({k: v for k, v in case.items() if k in transformer},
          {k: v for k, v in case.items() if k in model and k not in BATCH_KEYS})


def _grid_batch(cfg, case):
  S, C = cfg.history_seq_len, cfg.candidate_seq_len
  cand = np.ones((2, C), bool)
  cand[1, 1::3] = False
  if C == 1:
    cand[1, 0] = False
  return make_batch(cfg, 2, 5, history_valid=case.get("history_valid", [S, S // 2]),
                    candidate_mask=cand, user_valid=case.get("user_valid"))


def _grid_case(name, case=None):
  """The isolated and dense configs of a grid case (or of `case` under its name), and its
  padded batch."""
  case = GRID[name] if case is None else case
  transformer, model = _split_case(name, case)
  cfgs = {impl: ranking_config(history=case.get("history", 4),
                               candidates=case.get("candidates", 3),
                               transformer=transformer_config(**transformer),
                               **dict(model, attention_impl=impl))
          for impl in ("isolated", "dense")}
  return (cfgs, *_grid_batch(cfgs["dense"], case))


def test_zeros_init_zeroes_every_transformer_parameter_of_every_grid_case():
  """`param_init="zeros"` (the release's placeholders) zeroes every transformer parameter,
  those of each grid case's switches included (step 3 of adding an idea: a new parameter
  starts as its kind starts under each `param_init`)."""
  for name, case in GRID.items():
    transformer = dict(_split_case(name, case)[0], param_init="zeros")
    model = pf.Transformer(transformer_config(**transformer), key=jax.random.key(0))
    nonzero = [jax.tree_util.keystr(path) for path, x in
               jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array))
               if np.any(np.asarray(x))]
    assert nonzero == [], (name, nonzero)


def test_grid_cases_reach_the_configs():
  """Every key of a case is set on the config that has that field, and a key that names
  no field is refused instead of falling back to the default."""
  for name, case in GRID.items():
    cfgs = _grid_case(name)[0]
    for cfg in cfgs.values():
      for key, value in case.items():
        if key not in BATCH_KEYS:
          owner = cfg.model if hasattr(cfg.model, key) else cfg
          assert getattr(owner, key) == value, (name, key)
    assert cfgs["isolated"].attention_impl == "isolated"
    assert cfgs["dense"].attention_impl == "dense"
  with pytest.raises(KeyError, match=r"\['qk_nrom'\] name no config field"):
    _split_case("typo", dict(qk_nrom=True))


def test_every_switch_is_set_in_a_grid_case():
  """Step 6 of adding an idea: a ranking switch that export refuses away from its default
  (every new switch, until it joins `haiku_compat._FREE_FIELDS`) is set away from its
  default by some grid case, and by some case of `GRADIENT_GRID`, so that the
  isolated-vs-dense comparisons of logits and of gradients cover it. Candidate isolation
  is the one exception: with it off, both implementations run the dense path."""
  exempt = {"candidate_isolation"}
  for cls in (pf.TransformerConfig, pf.PhoenixModelConfig):
    for field in GRID_SWITCHES[cls] - exempt:
      default = _field_default(cls, field)
      for where, names in (("GRID", list(GRID)), ("GRADIENT_GRID", GRADIENT_GRID)):
        assert any(field in GRID[n] and GRID[n][field] != default for n in names), (
            f"{cls.__name__}.{field} is set away from its default ({default!r}) by no case "
            f"of {where} (tests/test_ranking.py)")


def _field_default(cls, name: str):
  field = next(f for f in dataclasses.fields(cls) if f.name == name)
  return field.default_factory() if field.default is dataclasses.MISSING else field.default


@pytest.mark.parametrize("name, switch", [(name, key) for name, case in GRID.items()
                                          for key in case if _is_switch(key)])
def test_every_grid_switch_changes_the_logits(name, switch):
  """A switch that no path implements passes the isolated-vs-dense comparison (both
  ignore it alike): each switch a grid case sets must change the dense reference's
  logits against the same case with that switch at its default."""
  cfgs, batch, emb = _grid_case(name)
  without = {k: v for k, v in GRID[name].items() if k != switch}
  default_cfgs, _, _ = _grid_case(name, without)
  on = forward(model_for(cfgs["dense"]), batch, emb)[0].logits
  off = forward(model_for(default_cfgs["dense"]), batch, emb)[0].logits
  assert max_abs_diff(on, off) > 1e-4, f"{switch}={GRID[name][switch]!r} changes nothing"


@pytest.mark.parametrize("name", list(GRID))
def test_isolated_equals_dense(name):
  cfgs, batch, emb = _grid_case(name)
  outs = {impl: forward(model_for(cfg), batch, emb) for impl, cfg in cfgs.items()}
  (iso, iso_diag), (dense, dense_diag) = outs["isolated"], outs["dense"]
  assert float(jnp.max(jnp.abs(dense.logits))) > 0.1
  assert max_abs_diff(iso.logits, dense.logits) <= 1e-5, (
      f"grid case {name!r}: the isolation-aware path (transformer.py: `score_candidates`, "
      "`_isolated_attention`) and the dense reference (`attention_weights`) disagree: is a "
      "switch of this case implemented in one of them only?")
  if dense.continuous is not None:
    assert max_abs_diff(iso.continuous, dense.continuous) <= 1e-5
  # `model(...)`, the serving path: all at once, in micro-batches of rows (one user per
  # group here; C=40: two candidate micro-batches of 20; C=3: one pass per user), and of
  # single rows (groups of one user, one candidate at a time).
  C = cfgs["isolated"].candidate_seq_len
  served, halves, singles = (
      call(lambda m, b, e: m(b, e),
           model_for(dataclasses.replace(cfgs["isolated"], micro_batch_rows=rows)),
           batch, emb)
      for rows in (None, 2 * ((C + 1) // 2), 1))
  # Separate context and candidate matmuls, and other row counts, round differently, and
  # by how much depends on the machine's kernels: in float32 ulps of the largest logit, up
  # to 6 seen on an AVX2 CPU and 8.2 on an AVX-512 one, each time between single rows and
  # all at once (11.4 on an H200, where `rounding` allows ten times as much; 12.3 on the
  # AVX-512 host between `micro_batch_rows=8` and none, B=5, S=6, C=12, 2 layers).
  ulp = float32_ulp(iso.logits)
  assert max_abs_diff(served.logits, iso.logits) <= 16 * ulp
  assert max_abs_diff(halves.logits, served.logits) <= 16 * ulp
  assert max_abs_diff(singles.logits, served.logits) <= 16 * ulp
  assert max_abs_diff(served.logits, dense.logits) <= 1e-5
  if dense.continuous is not None:
    assert max_abs_diff(served.continuous, dense.continuous) <= 1e-5
    assert max_abs_diff(singles.continuous, dense.continuous) <= 1e-5
  np.testing.assert_allclose(iso_diag.max_abs_attn_logit, dense_diag.max_abs_attn_logit,
                             rtol=1e-5)
  np.testing.assert_allclose(iso_diag.residual_rms, dense_diag.residual_rms, rtol=1e-5)


@pytest.mark.parametrize("name", list(GRID))
def test_grid_through_the_serving_runner(name):
  """`RankingRunner` serves each grid case as the dense reference scores it: `rank`, and
  `rank_chunked` over one encoded context (chunks of 2), on the valid candidates (and
  the continuous head's outputs, where the case has one)."""
  cfgs, batch, emb = _grid_case(name)
  dense = forward(model_for(cfgs["dense"]), batch, emb)[0]
  runner = pf.RankingRunner(model_for(cfgs["isolated"]))
  ranked = runner.rank(batch, emb)
  chunked = runner.rank_chunked(batch, emb, chunk_size=2)
  valid = np.asarray(batch.candidate_post_hashes[..., 0]) != 0
  want = np.asarray(jax.nn.sigmoid(dense.logits))[valid]
  np.testing.assert_allclose(np.asarray(ranked.scores)[valid], want, atol=1e-5)
  np.testing.assert_allclose(np.asarray(chunked.scores)[valid], want, atol=1e-5)
  assert (ranked.continuous is None) == (dense.continuous is None)
  if dense.continuous is not None:
    for out in (ranked, chunked):
      np.testing.assert_allclose(np.asarray(out.continuous)[valid],
                                 np.asarray(dense.continuous)[valid], atol=1e-5)


@pytest.mark.parametrize("name", GRADIENT_GRID)
def test_isolated_gradients_equal_dense(name):
  """Training differentiates the isolated path: its parameter gradients equal the dense
  reference's (padded history and candidates, active soft-cap, GQA, cap off)."""
  cfgs, batch, emb = _grid_case(name)
  weights = np.random.default_rng(3).standard_normal(
      (2, cfgs["dense"].candidate_seq_len, NUM_ACTIONS)).astype(np.float32)
  grads = {impl: jax.tree.leaves(eqx.filter(logit_grads(model_for(cfg), batch, emb, weights),
                                            eqx.is_array))
           for impl, cfg in cfgs.items()}
  assert len(grads["isolated"]) == len(grads["dense"])
  for iso, dense in zip(grads["isolated"], grads["dense"]):
    scale = float(jnp.max(jnp.abs(dense)))
    assert max_abs_diff(iso, dense) <= 1e-5 * max(scale, 1.0), (iso.shape, scale)


def _intermediate_shapes(jaxpr):
  """Shapes of every value a jaxpr computes, inside scans, jits and other sub-jaxprs too."""
  return (v.aval.shape for eqn in jaxpr_equations(jaxpr) for v in eqn.outvars)


def test_isolated_path_never_builds_a_candidate_by_candidate_array():
  """No value of the isolated forward or its gradient has two axes sized C or T = 1+S+C
  (a C x C block, a T x T mask or logits); the dense reference does, so the scan can
  see them."""
  S, C = 4, 40
  T = 1 + S + C
  shapes = {}
  for impl in ("isolated", "dense"):
    cfg = ranking_config(history=S, candidates=C, attention_impl=impl)
    model = model_for(cfg)
    batch, emb = padded_batch(cfg, candidate_mask=np.ones((2, C), bool))
    loss = lambda m: jnp.sum(m.forward(batch, emb)[0].logits)
    closed = jax.make_jaxpr(lambda m: (loss(m), eqx.filter_grad(loss)(m), m(batch, emb)))(model)
    shapes[impl] = {s for s in _intermediate_shapes(closed.jaxpr)
                    if sum(n in (C, T) for n in s) >= 2}
  assert not shapes["isolated"], shapes["isolated"]
  assert any(s[-2:] == (T, T) for s in shapes["dense"]), shapes["dense"]


def _loops_with_geglu(jaxpr, width):
  """`(lengths, shapes)` for each scan of `jaxpr` whose own body runs products of the
  GeGLU's `width` (`lengths`: of the scans around it, outermost first, and its own;
  innermost scans listed first), then `((), shapes)` for the products outside every scan."""
  found = []

  def walk(jaxpr, lengths):
    shapes = []
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape[-1] == width:
        shapes.append(eqn.outvars[0].aval.shape)
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else [param]:
          sub = getattr(sub, "jaxpr", sub)
          if not hasattr(sub, "eqns"):
            continue
          if eqn.primitive.name == "scan":
            inner_lengths = lengths + (eqn.params["length"],)
            inner = walk(sub, inner_lengths)
            if inner:
              found.append((inner_lengths, inner))
          else:
            shapes += walk(sub, lengths)
    return shapes

  found.append(((), walk(jaxpr, ())))
  return found


def test_serving_call_skips_the_contexts_last_layer_and_scores_micro_batches():
  """`model(...)` never runs the GeGLU on the context's rows in the last layer (they feed
  only the diagnostics). Candidates that fit one micro-batch share a layer loop with the
  context for all but the last layer, whose GeGLU then runs on the candidates' rows
  alone. With more (12 rows for 2 users: C=10 in two micro-batches of 5 per user), the
  context's loop runs all but the last layer, and every layer runs for the candidates in
  a loop over micro-batches; with fewer rows than two contexts (8 rows, contexts of 5),
  all of that runs in a loop over groups of one user. `forward` runs one loop of every
  layer over all rows."""
  cfg = ranking_config(candidates=10)
  batch, emb = padded_batch(cfg, candidate_mask=np.arange(10) < np.array([[10], [7]]))
  L, N, C = cfg.model.num_layers, 1 + cfg.history_seq_len, cfg.candidate_seq_len
  width = 2 * cfg.model.ffn_size                    # the GeGLU's gate|value product
  assert width != (cfg.model.num_q_heads + 2 * cfg.model.num_kv_heads) * cfg.model.key_size
  loops = lambda model, fn: _loops_with_geglu(jax.make_jaxpr(fn)(model).jaxpr, width)
  groups, micro, whole = (model_for(dataclasses.replace(cfg, micro_batch_rows=rows))
                          for rows in (8, 12, 20))
  assert loops(groups, lambda m: m(batch, emb)) == [((2, L - 1), [(1, N, width)]),
                                                    ((2, 2, L), [(1, 5, width)]), ((), [])]
  assert loops(micro, lambda m: m(batch, emb)) == [((L - 1,), [(2, N, width)]),
                                                   ((2, L), [(2, 5, width)]), ((), [])]
  assert loops(whole, lambda m: m(batch, emb)) == [((L - 1,), [(2, N + C, width)]),
                                                   ((), [(2, C, width)])]
  assert loops(whole, lambda m: m.forward(batch, emb)) == [((L,), [(2, N + C, width)]),
                                                           ((), [])]


@pytest.mark.parametrize("right_anchored", [False, True])
def test_micro_batches_that_do_not_tile_give_one_passs_logits(right_anchored):
  """Three users in two groups of two (the second starting at user 1) and seven
  candidates in two micro-batches of four per user (the second starting at candidate 3),
  with padded history and candidates, give the logits of one pass, up to 16 ulps."""
  cfg = ranking_config(candidates=7, right_anchored_rope=right_anchored)
  mask = np.arange(7) < np.array([[7], [4], [6]])
  batch, emb = make_batch(cfg, 3, 11, history_valid=[4, 2, 0], candidate_mask=mask)
  whole, micro = (call(lambda m, b, e: m(b, e),
                       model_for(dataclasses.replace(cfg, micro_batch_rows=rows)), batch, emb)
                  for rows in (None, 10))
  assert micro.logits.shape == whole.logits.shape == (3, 7, NUM_ACTIONS)
  assert np.all(np.isfinite(micro.logits))
  # 16 ulps, as in test_isolated_equals_dense
  assert max_abs_diff(micro.logits, whole.logits) <= 16 * float32_ulp(whole.logits)


def test_micro_batch_limits():
  """Users per group from the context rows (at least one), candidates per micro-batch
  from the equal groups' size; None: one group, one pass."""
  cfg = ranking_config(history=128, micro_batch_rows=2048)
  limits = model_for(cfg).micro_batch_limits
  assert limits(64, 32) == (15, 157)       # 5 groups of 13 users (serve)
  assert limits(4, 1024) == (4, 512)       # one group, two micro-batches (1k)
  assert limits(1, 10_000) == (1, 2048)
  assert model_for(ranking_config(history=128, micro_batch_rows=100)).micro_batch_limits(
      3, 5) == (1, 100)                    # a context longer than the rows: one user
  assert model_for(ranking_config(micro_batch_rows=None)).micro_batch_limits(7, 9) == (7, 9)


def test_each_parameter_draws_from_its_own_key_of_one_split():
  """A seed's initial parameters stay as they were (committed results were trained from
  them): parameter i of each model draws from `split(key, n)[i]` in the order the
  constructor lists (every optional parameter on here: each keeps its index)."""
  from phoenix_flax.layers import variance_scaling
  from phoenix_flax.retrieval import CandidateTower
  key = jax.random.key(4)
  cfg = ranking_config(post_age_granularity_mins=60, dwell_time_norm=pf.NormConfig(),
                       num_continuous_actions=3)
  model, ks = pf.PhoenixModel(cfg, key=key), jax.random.split(key, 12)

  def drawn(m, ks, order):   # {key index: name of a variance-scaled array of m}
    for i, name in order.items():
      w = getattr(m, name)
      fan_in = w.shape[1] if name.endswith("_table") else w.shape[0]
      np.testing.assert_array_equal(w, variance_scaling(ks[i], w.shape, fan_in), err_msg=name)

  same = lambda a, b: jax.tree.map(np.testing.assert_array_equal, eqx.filter(a, eqx.is_array),
                                   eqx.filter(b, eqx.is_array))
  drawn(model, ks, {0: "product_surface_embedding_table", 1: "action_projection",
                    2: "proj_mat_1", 3: "proj_mat_2", 4: "proj_mat_3", 6: "unembeddings",
                    7: "post_age_embedding_table", 8: "dwell_proj_1", 9: "dwell_proj_2",
                    10: "continuous_unembeddings"})
  same(model.transformer, pf.Transformer(cfg.model, key=ks[5]))

  rcfg = retrieval_config()
  retrieval, ks = pf.PhoenixRetrievalModel(rcfg, key=key), jax.random.split(key, 6)
  drawn(retrieval, ks, {0: "product_surface_embedding_table", 1: "action_projection",
                        2: "proj_mat_1", 3: "proj_mat_3"})
  same(retrieval.transformer, pf.Transformer(rcfg.model, key=ks[4]))
  hc = rcfg.hash_config
  same(retrieval.candidate_tower, CandidateTower(
      rcfg.emb_size, hc.num_item_hashes + hc.num_author_hashes, key=ks[5]))
