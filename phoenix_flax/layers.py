"""Grok building blocks as functional Equinox modules.

Parameters are float32; computation runs in the dtype of the input (the forward dtype).
Linear weights are stored `[in, out]` as in the release. The attention projections q|k|v
and the two GeGLU input branches are stored fused (one matmul each); `haiku_compat`
splits them into the release's separate parameters and back. Rotary embedding has no
parameters, so it is functions rather than a module: `rope_phase` (the angles),
`rope_table` (their cosines and sines; the transformer builds the same values once per
forward pass, `transformer._shared_rope`) and `rotate`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from phoenix_flax.config import TransformerConfig

RMS_NORM_EPS = 1e-5
MASK_VALUE = -1e30
ROPE_BASE = 10000.0


def variance_scaling(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int) -> Array:
  """Truncated normal (cut at 2 std) rescaled to an actual std of 1/sqrt(fan_in): Haiku's
  `VarianceScaling(1.0, "fan_in", "truncated_normal")`. (`hk.Linear`'s default,
  `TruncatedNormal(1/sqrt(fan_in))`, skips the rescaling and has ~0.88 of that std.)"""
  # In float32 whatever `jax_enable_x64` says (float64 rounds the std differently).
  stddev = 1.0 / jnp.sqrt(jnp.float32(fan_in)) / 0.87962566103423978
  return stddev * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)


class Linear(eqx.Module):
  """`y = x @ w` with `w` float32 `[in, out]`, cast to the input dtype. No bias."""

  weight: Array

  def __init__(self, in_size: int, out_size: int, *, key: PRNGKeyArray, zero: bool = False):
    shape = (in_size, out_size)
    self.weight = jnp.zeros(shape, jnp.float32) if zero else variance_scaling(key, shape, in_size)

  def __call__(self, x: Array) -> Array:
    return x @ self.weight.astype(x.dtype)


class RMSNorm(eqx.Module):
  """`scale * x * rsqrt(mean(x^2) + 1e-5)` over the last axis, in float32."""

  scale: Array

  def __init__(self, size: int, *, init_value: float = 1.0):
    self.scale = jnp.full((size,), init_value, jnp.float32)

  def __call__(self, x: Array) -> Array:
    return rms_norm(x, self.scale)


def rms_norm(x: Array, scale: Array) -> Array:
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + RMS_NORM_EPS)
  return (jax.lax.broadcast_to_rank(scale.astype(jnp.float32), x.ndim) * normed).astype(x.dtype)


class RopeTable(NamedTuple):
  """Cosine and sine of each token's rotation angles, `[B, T, 1, d/2]` float32."""

  cos: Array
  sin: Array


def rope_phase(positions_BT: Array, key_size: int) -> Array:
  """Rotation angles `[B, T, 1, d/2]` for explicit float positions `[B, T]`, base 10000,
  as the release computes them: the pair `(x_i, x_{i+d/2})` turns by
  `position * inv_freq_i`, `inv_freq_i = 1 / 10000^(2i/d)` in float32 in that form (the
  form `10000^(-2i/d)` differs from it by an ulp in some frequencies)."""
  inv_freq = 1.0 / (ROPE_BASE ** (jnp.arange(0, key_size, 2, dtype=jnp.float32) / key_size))
  return (positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None, :])[:, :, None, :]


def rope_table(positions_BT: Array, key_size: int) -> RopeTable:
  """The cosines and sines of `rope_phase`. Positions are the same in every layer, so
  the transformer builds one table per forward pass."""
  phase_BT1f = rope_phase(positions_BT, key_size)
  return RopeTable(jnp.cos(phase_BT1f), jnp.sin(phase_BT1f))


def rotate(x_BTHd: Array, table: RopeTable) -> Array:
  """Rotary embedding of `[B, T, heads, d]` by a `rope_table`: rotates halves (not
  interleaved pairs), as the release does. Written per half, which equals the release's
  `x * cos + rotate_half(x) * sin` bit for bit and takes the cosine and sine of `d/2`
  angles, not `d`."""
  half = x_BTHd.shape[-1] // 2
  x32 = x_BTHd.astype(jnp.float32)
  first, second = x32[..., :half], x32[..., half:]
  cos, sin = table
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin],
                         axis=-1).astype(x_BTHd.dtype)


def apply_rope(x_BTHd: Array, positions_BT: Array) -> Array:
  """Rotary embedding on `[B, T, heads, d]` with explicit float positions `[B, T]`:
  `rotate(x, rope_table(positions, d))`."""
  return rotate(x_BTHd, rope_table(positions_BT, x_BTHd.shape[-1]))


def soft_cap(logits: Array, cap: Optional[float]) -> Array:
  if cap is None:
    return logits
  return cap * jnp.tanh(logits / cap)


def masked_logits(raw: Array, keep: Array, cap: Optional[float], valid_rows: Array,
                  ) -> tuple[Array, Array]:
  """Soft-capped logits where `keep` (`MASK_VALUE` elsewhere) and the max |raw logit| over
  the kept entries of valid queries' rows (the diagnostic; `valid_rows` broadcasts against
  `raw`). A padded query's row feeds no valid output, so it counts for nothing. Both
  attention paths mask through this."""
  max_logit = jnp.max(jnp.where(keep & valid_rows, jnp.abs(raw), 0.0))
  return jnp.where(keep, soft_cap(raw, cap), MASK_VALUE), max_logit


class MultiHeadAttention(eqx.Module):
  """GQA self-attention: fused q|k|v projection, RoPE on q and k, output projection."""

  qkv: Linear
  out: Linear
  config: TransformerConfig = eqx.field(static=True)

  def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray):
    k1, k2 = jax.random.split(key)
    zero = cfg.param_init == "zeros"
    width = (cfg.num_q_heads + 2 * cfg.num_kv_heads) * cfg.key_size
    self.qkv = Linear(cfg.emb_size, width, key=k1, zero=zero)
    self.out = Linear(cfg.num_q_heads * cfg.key_size, cfg.emb_size, key=k2, zero=zero)
    self.config = cfg

  def project(self, x_BTD: Array, rope: RopeTable) -> tuple[Array, Array, Array]:
    """Returns rotated queries `[B,T,KV,G,d]`, rotated keys and values `[B,T,KV,d]`;
    `rope` is the tokens' `rope_table`."""
    cfg = self.config
    B, T, _ = x_BTD.shape
    H, KV, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.key_size
    qkv = self.qkv(x_BTD)
    q_BTHd = qkv[..., : H * d].reshape(B, T, H, d)
    k_BTKd = qkv[..., H * d: (H + KV) * d].reshape(B, T, KV, d)
    v_BTKd = qkv[..., (H + KV) * d:].reshape(B, T, KV, d)
    q_BTHd = rotate(q_BTHd, rope)
    k_BTKd = rotate(k_BTKd, rope)
    return q_BTHd.reshape(B, T, KV, H // KV, d), k_BTKd, v_BTKd

  def output(self, attn_BTKGd: Array) -> Array:
    B, T = attn_BTKGd.shape[:2]
    return self.out(attn_BTKGd.reshape(B, T, -1))

  def attention_weights(self, q_BTKGd: Array, k_BSKd: Array, mask_B1TS: Array,
                        ) -> tuple[Array, Array]:
    """The softmax weights `[B,KV,G,T,S]` (float32) that `attend` averages the values
    by, and the max |logit| before the cap over valid queries' rows; `mask` `[B,1,T,S]`
    (self-attention, T = S), 1 = may attend.

    A query is valid where it may attend to itself, the mask's diagonal: every structure
    (causal, recsys) lets a token see itself, and padding clears a padded token's column,
    its own entry included."""
    # In the forward dtype, then float32, as the release does (bfloat16 rounds q.k once).
    raw = jnp.einsum("btkgd,bskd->bkgts", q_BTKGd, k_BSKd).astype(jnp.float32)
    raw = raw * self.config.attn_output_multiplier
    T, S = q_BTKGd.shape[1], k_BSKd.shape[1]
    if mask_B1TS.ndim != 4 or mask_B1TS.shape[-2:] != (T, S) or T != S:
      raise ValueError(f"mask of shape {mask_B1TS.shape} for {T} queries and {S} keys: "
                       "self-attention takes a [B, 1, T, T] mask")
    keep_B11TS = mask_B1TS[:, :, None].astype(bool)
    valid_B11T1 = jnp.diagonal(keep_B11TS, axis1=-2, axis2=-1)[..., None]
    logits, max_logit = masked_logits(raw, keep_B11TS, self.config.attn_logit_cap,
                                      valid_B11T1)
    return jax.nn.softmax(logits, axis=-1), max_logit

  def attend(self, q_BTKGd: Array, k_BSKd: Array, v_BSKd: Array, mask_B1TS: Array,
             ) -> tuple[Array, Array]:
    """Masked attention of projected heads. Returns `[B,T,D]` and max |logit| pre-cap."""
    weights, max_logit = self.attention_weights(q_BTKGd, k_BSKd, mask_B1TS)
    weights = weights.astype(q_BTKGd.dtype)
    return self.output(jnp.einsum("bkgts,bskd->btkgd", weights, v_BSKd)), max_logit

  def __call__(self, x_BTD: Array, mask_B1TT: Array, positions_BT: Array,
               ) -> tuple[Array, Array]:
    """Dense masked self-attention (mask `[B,1,T,T]`, 1 = may attend)."""
    rope = rope_table(positions_BT, self.config.key_size)
    return self.attend(*self.project(x_BTD, rope), mask_B1TT)


class DenseBlock(eqx.Module):
  """GeGLU: `(gelu(x @ W1) * (x @ Wv)) @ Wout`, W1|Wv fused into one matmul."""

  gate_value: Linear
  out: Linear

  def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray):
    k1, k2 = jax.random.split(key)
    zero = cfg.param_init == "zeros"
    self.gate_value = Linear(cfg.emb_size, 2 * cfg.ffn_size, key=k1, zero=zero)
    self.out = Linear(cfg.ffn_size, cfg.emb_size, key=k2, zero=zero)

  def __call__(self, x: Array) -> Array:
    gate, value = jnp.split(self.gate_value(x), 2, axis=-1)
    return self.out(jax.nn.gelu(gate) * value)
