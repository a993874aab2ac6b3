"""Grok building blocks against straightforward numpy versions of the SPEC formulas."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phoenix_flax as pf
from conftest import call, layer, max_abs_diff, shared_draws, transformer_config
from phoenix_flax.layers import Linear, RMSNorm, apply_rope, rms_norm, rope_table, soft_cap
from phoenix_flax.masks import causal_mask


def gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def rope_reference(x, positions):
  """Per-pair rotation of (x_i, x_{i+d/2}) by angle p * 10000^(-2i/d)."""
  out = np.empty_like(x, dtype=np.float64)
  d = x.shape[-1]
  for i in range(d // 2):
    angle = positions[:, :, None] * 10000.0 ** (-2 * i / d)
    a, b = x[..., i], x[..., i + d // 2]
    out[..., i] = a * np.cos(angle) - b * np.sin(angle)
    out[..., i + d // 2] = b * np.cos(angle) + a * np.sin(angle)
  return out


def attention_reference(x, wq, wk, wv, wo, cfg, mask, positions):
  """One head at a time: query head j reads kv head j // (H / KV)."""
  H, KV, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.key_size
  heads = []
  for j in range(H):
    kv = j // (H // KV)
    rotate = lambda y: rope_reference(y[:, :, None, :], positions)[:, :, 0, :]
    q = rotate(x @ wq[:, j * d:(j + 1) * d])
    k = rotate(x @ wk[:, kv * d:(kv + 1) * d])
    v = x @ wv[:, kv * d:(kv + 1) * d]
    logits = np.einsum("btd,bsd->bts", q, k) * cfg.attn_output_multiplier
    if cfg.attn_logit_cap is not None:
      logits = cfg.attn_logit_cap * np.tanh(logits / cfg.attn_logit_cap)
    logits = np.where(mask, logits, -1e30)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    heads.append(weights @ v)
  return np.concatenate(heads, axis=-1) @ wo


def test_rms_norm_formula():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 3, 16)).astype(np.float32) * 3
  scale = rng.standard_normal(16).astype(np.float32)
  norm = eqx.tree_at(lambda n: n.scale, RMSNorm(16), jnp.asarray(scale))
  for size in (1.0, 1e-3):   # small inputs, whose mean square is near the epsilon, test it
    x_ = x * np.float32(size)
    expected = scale * x_ / np.sqrt(np.mean(x_ ** 2, axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(call(norm, jnp.asarray(x_)), expected, rtol=1e-5, atol=1e-6)


def test_rms_norm_computes_in_float32_and_keeps_dtype():
  """A bfloat16 input is normalised in float32 and rounded once: equal to the float32
  result rounded to bfloat16 (a bfloat16 computation differs in about a quarter of the
  entries; a rare float32 rounding flip is allowed)."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((16, 256)) * 3, jnp.bfloat16)
  scale = jnp.asarray(rng.standard_normal(256) + 1, jnp.float32)
  out = call(rms_norm, x, scale)
  assert out.dtype == jnp.bfloat16
  x32 = np.asarray(x, np.float32)
  expected = np.asarray(scale) * x32 / np.sqrt(np.mean(x32 ** 2, -1, keepdims=True) + 1e-5)
  rounded = np.asarray(jnp.asarray(expected, jnp.bfloat16), np.float32)
  assert np.sum(np.asarray(out, np.float32) != rounded) <= 4


def test_rms_norm_default_scale_is_one():
  np.testing.assert_array_equal(RMSNorm(8).scale, np.ones(8))
  np.testing.assert_array_equal(RMSNorm(8, init_value=0.0).scale, np.zeros(8))


def test_rope_matches_pairwise_rotation_of_halves():
  rng = np.random.default_rng(2)
  x = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
  pos = np.array([[0, 1, 2, 3, 4], [7, 0, 3.5, 100, 9]], np.float32)
  out = call(apply_rope, jnp.asarray(x), jnp.asarray(pos))
  np.testing.assert_allclose(out, rope_reference(x, pos), atol=2e-5)


def test_rope_position_zero_is_identity_and_norm_preserved():
  x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 4, 2, 8)), jnp.float32)
  np.testing.assert_allclose(call(apply_rope, x, jnp.zeros((1, 4))), x, atol=1e-7)
  out = call(apply_rope, x, jnp.arange(4.0)[None] * 13)
  np.testing.assert_allclose(jnp.linalg.norm(out, axis=-1), jnp.linalg.norm(x, axis=-1),
                             rtol=1e-5)


def test_rope_scores_depend_on_relative_position_only():
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32)
  dot = lambda pq, pk: jnp.sum(apply_rope(q, pq[None, None]) * apply_rope(k, pk[None, None]))
  score = lambda pq, pk: float(call(dot, jnp.float32(pq), jnp.float32(pk)))
  assert score(5.0, 2.0) == pytest.approx(score(13.0, 10.0), abs=1e-5)
  assert abs(score(5.0, 2.0) - score(5.0, 4.0)) > 1e-3


def test_rope_keeps_forward_dtype():
  x = jnp.ones((1, 2, 1, 4), jnp.bfloat16)
  assert call(apply_rope, x, jnp.arange(2.0)[None]).dtype == jnp.bfloat16


def test_soft_cap():
  x = jnp.array([-100.0, -1.0, 0.0, 2.0, 100.0])
  np.testing.assert_allclose(soft_cap(x, 30.0), 30 * np.tanh(np.asarray(x) / 30), rtol=1e-6)
  assert soft_cap(x, None) is x


def test_linear_float32_params_and_forward_dtype():
  lin = Linear(256, 64, key=jax.random.key(0))
  assert lin.weight.shape == (256, 64) and lin.weight.dtype == jnp.float32
  x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 256)), jnp.float32)
  np.testing.assert_allclose(call(lin, x), np.asarray(x) @ np.asarray(lin.weight), rtol=1e-5,
                             atol=1e-6)
  y = call(lin, x.astype(jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y, np.float32), call(lin, x), rtol=0.05, atol=0.05)
  assert max_abs_diff(y, call(lin, x)) > 0
  w = np.asarray(lin.weight)
  assert w.std() == pytest.approx(1 / 16, rel=0.05)
  assert np.abs(w).max() <= 2 / 16 / 0.8796 + 1e-6
  assert not np.any(Linear(4, 4, key=jax.random.key(0), zero=True).weight)


def test_geglu_formula():
  cfg = transformer_config()
  block = layer(pf.Transformer(cfg, key=jax.random.key(2)), 0).dense
  F = cfg.ffn_size
  assert block.gate_value.weight.shape == (cfg.emb_size, 2 * F)
  assert block.out.weight.shape == (F, cfg.emb_size)
  x = np.random.default_rng(6).standard_normal((2, 3, cfg.emb_size)).astype(np.float32)
  w = np.asarray(block.gate_value.weight)
  expected = (gelu_tanh(x @ w[:, :F]) * (x @ w[:, F:])) @ np.asarray(block.out.weight)
  np.testing.assert_allclose(call(block, jnp.asarray(x)), expected, rtol=1e-4, atol=1e-5)


def attention(cfg, seed):
  """Layer 0's attention of a stacked transformer (shares initialiser compilations)."""
  return layer(pf.Transformer(cfg, key=jax.random.key(seed)), 0).attention


def _split_qkv(attn, cfg):
  H, KV, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.key_size
  w = np.asarray(attn.qkv.weight)
  return w[:, :H * d], w[:, H * d:(H + KV) * d], w[:, (H + KV) * d:], np.asarray(attn.out.weight)


@pytest.mark.parametrize("num_kv_heads, cap", [(4, 30.0), (4, None), (2, 1.0)])
def test_attention_matches_per_head_loop(num_kv_heads, cap):
  cfg = transformer_config(num_kv_heads=num_kv_heads, attn_logit_cap=cap,
                           attn_output_multiplier=0.5)   # != 1: the multiplier is applied
  attn = attention(cfg, 3)
  B, T = 2, 5
  rng = np.random.default_rng(7)
  x = rng.standard_normal((B, T, cfg.emb_size)).astype(np.float32)
  padding = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 1, 0]], np.float32)
  mask = padding[:, None, None, :] * np.asarray(causal_mask(T))
  pos = np.tile(np.arange(T, dtype=np.float32), (B, 1))
  out, max_logit = call(attn, jnp.asarray(x), jnp.asarray(mask), jnp.asarray(pos))
  expected = attention_reference(x, *_split_qkv(attn, cfg), cfg, mask[:, 0] > 0, pos)
  np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
  assert np.isfinite(float(max_logit))


def test_attention_has_no_hidden_sqrt_d_factor():
  cfg = transformer_config(attn_output_multiplier=1.0, attn_logit_cap=None, num_kv_heads=4)
  attn = attention(cfg, 4)
  x = jnp.asarray(np.random.default_rng(8).standard_normal((1, 3, cfg.emb_size)), jnp.float32)
  pos = jnp.arange(3.0)[None]
  q, k, _ = call(attn.project, x, rope_table(pos, cfg.key_size))
  _, max_logit = call(attn, x, causal_mask(3), pos)
  raw = jnp.einsum("btkgd,bskd->bkgts", q, k) * np.tril(np.ones((1, 1, 1, 3, 3)))
  np.testing.assert_allclose(max_logit, jnp.max(jnp.abs(raw)), rtol=1e-5)


def test_attention_outputs_forward_dtype_in_bfloat16():
  cfg = transformer_config()
  attn = attention(cfg, 5)
  x = jnp.asarray(np.random.default_rng(9).standard_normal((1, 4, cfg.emb_size)))
  pos = jnp.arange(4.0)[None]
  out32, _ = call(attn, x.astype(jnp.float32), causal_mask(4), pos)
  out16, _ = call(attn, x.astype(jnp.bfloat16), causal_mask(4, jnp.bfloat16), pos)
  assert out16.dtype == jnp.bfloat16 and attn.qkv.weight.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out16, np.float32), out32, atol=0.1)


def test_attention_refuses_a_mask_that_is_not_per_query():
  """The max |logit| diagnostic reads which queries are valid off the mask's diagonal,
  so a mask must be `[B, 1, T, T]`: a key-only `[B, 1, 1, T]` one is refused by name."""
  cfg = transformer_config()
  attn = attention(cfg, 6)
  x = jnp.asarray(np.random.default_rng(10).standard_normal((2, 4, cfg.emb_size)), jnp.float32)
  pos = jnp.tile(jnp.arange(4.0), (2, 1))
  for mask in (jnp.ones((2, 1, 1, 4)), jnp.ones((4, 4))):
    with pytest.raises(ValueError, match=r"self-attention takes a \[B, 1, T, T\] mask"):
      attn(x, mask, pos)
  # Nor does a [B, 1, T, S] mask of 3 queries over 5 keys pass (its "diagonal" is not
  # the queries' own keys).
  q, k = jnp.ones((1, 3, 2, 2, 8)), jnp.ones((1, 5, 2, 8))
  with pytest.raises(ValueError, match=r"for 3 queries and 5 keys: self-attention takes"):
    attn.attention_weights(q, k, jnp.ones((1, 1, 3, 5)))


def test_variance_scaling_is_haikus_truncated_normal_rescaled_to_its_std():
  """Haiku's VarianceScaling(1.0, "fan_in", "truncated_normal") divides 1/sqrt(fan_in) by
  the std of a unit normal truncated to [-2, 2] (0.8796...), so the draws have std
  1/sqrt(fan_in); computed here from the normal's density and CDF."""
  import math
  from phoenix_flax.layers import variance_scaling
  density_2 = math.exp(-2.0) / math.sqrt(2 * math.pi)
  truncated_std = math.sqrt(1 - 2 * 2 * density_2 / math.erf(2 / math.sqrt(2)))
  assert truncated_std == pytest.approx(0.87962566103423978, rel=1e-15)
  key = jax.random.PRNGKey(3)
  for fan_in in (3, 64, 1000):
    want = (1.0 / jnp.sqrt(jnp.float32(fan_in)) / truncated_std
            * jax.random.truncated_normal(key, -2.0, 2.0, (16, 8), jnp.float32))
    np.testing.assert_array_equal(variance_scaling(key, (16, 8), fan_in), want)


def test_variance_scaling_is_the_same_with_x64_on():
  """The init std was computed in float64 with `jax_enable_x64` on, then rounded into the
  float32 draw: other initial parameters (a smoke run's first losses differed)."""
  from phoenix_flax.layers import variance_scaling
  key = jax.random.PRNGKey(0)
  narrow = [np.asarray(variance_scaling(key, (4, 8), n)) for n in (3, 16, 19, 1000)]
  with jax.enable_x64(True):
    wide = [np.asarray(variance_scaling(key, (4, 8), n)) for n in (3, 16, 19, 1000)]
  for a, b in zip(narrow, wide):
    assert b.dtype == np.float32
    np.testing.assert_array_equal(b, a)


def test_every_weight_of_a_layer_draws_its_own_numbers():
  """Each linear weight takes its own key: with a shared key, the element-wise partitioned
  threefry gives two weights the same draws (scaled by their fan-in) on their common
  prefix, a correlation of 1."""
  cfg = transformer_config(num_layers=1)
  block = layer(pf.Transformer(cfg, key=jax.random.key(12)), 0)
  weights = {"attention.qkv": block.attention.qkv.weight,
             "attention.out": block.attention.out.weight,
             "dense.gate_value": block.dense.gate_value.weight,
             "dense.out": block.dense.out.weight}
  names = sorted(weights)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      assert shared_draws(weights[a], weights[b]) < 0.2, (a, b)


def test_masked_keys_stay_out_when_every_allowed_logit_is_very_negative():
  """Without a cap, the multiplier (up to 1e6) takes allowed logits far below -1e4: a mask
  value of that size would then win the softmax; -1e30 stays below any of them."""
  cfg = transformer_config(attn_logit_cap=None, attn_output_multiplier=1e6, num_kv_heads=4)
  attn = attention(cfg, 13)
  T, d = 3, cfg.key_size
  q = -jnp.ones((1, T, 4, 1, d))                     # q.k = -d, so every raw logit = -8e6
  k = jnp.ones((1, T, 4, d))
  weights, _ = attn.attention_weights(q, k, causal_mask(T))
  # Every allowed key alike, no weight on a masked one.
  expected = np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]
  np.testing.assert_allclose(weights[0, :, 0], np.broadcast_to(expected, (4, T, T)), atol=1e-6)
