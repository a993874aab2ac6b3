"""Decoder layer and the scanned transformer stack, with two attention paths.

* Dense path (the reference): one `[B, 1, T, T]` mask (padding x causal or recsys) and
  full `T x T` attention, exactly as the release computes it.
* Isolated path (candidate isolation on): the context (user + history) runs causally and
  leaves its per-layer keys/values in a `ContextCache`; candidates then attend to those
  cached keys plus their own key only. No `C x C` block and no `T x T` mask is built,
  and the same two calls let a runner encode a context once and score candidates in
  chunks.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from phoenix_flax.config import TransformerConfig
from phoenix_flax.layers import (MASK_VALUE, DenseBlock, MultiHeadAttention, RMSNorm,
                                 soft_cap)
from phoenix_flax.masks import causal_mask, make_recsys_attn_mask


class TransformerOutput(NamedTuple):
  embeddings: Array             # [B, T, D]
  max_abs_attn_logit: Array     # [L] max |logit| over valid entries, before the cap
  residual_rms: Array           # [L] RMS of the residual stream after each layer


class ContextCache(NamedTuple):
  """Per-layer rotated keys and values of a user context, and its padding mask."""

  keys: Array                   # [L, B, N, KV, d]
  values: Array                 # [L, B, N, KV, d]
  padding_mask: Array           # [B, N] bool


AttendFn = Callable[[MultiHeadAttention, Array], tuple[Array, Array]]


class DecoderLayer(eqx.Module):
  """One Grok layer. Norms present depend on `norm_layout`:

  sandwich: `h + N2(Attn(N1(h)))`, `h + N4(Dense(N3(h)))` (release);
  pre:      `h + Attn(N1(h))`,     `h + Dense(N3(h))`;
  post:     `N2(h + Attn(h))`,     `N4(h + Dense(h))`.
  """

  attention: MultiHeadAttention
  dense: DenseBlock
  norm_attn_in: Optional[RMSNorm]
  norm_attn_out: Optional[RMSNorm]
  norm_dense_in: Optional[RMSNorm]
  norm_dense_out: Optional[RMSNorm]
  layout: str = eqx.field(static=True)

  def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray):
    k1, k2 = jax.random.split(key)
    self.attention = MultiHeadAttention(cfg, key=k1)
    self.dense = DenseBlock(cfg, key=k2)
    self.layout = cfg.norm_layout
    in_value = 0.0 if cfg.param_init == "zeros" else 1.0
    out_value = 0.0 if cfg.param_init in ("zeros", "rezero") else 1.0
    has_in = cfg.norm_layout in ("sandwich", "pre")
    has_out = cfg.norm_layout in ("sandwich", "post")
    make = lambda present, v: RMSNorm(cfg.emb_size, init_value=v) if present else None
    self.norm_attn_in = make(has_in, in_value)
    self.norm_attn_out = make(has_out, out_value)
    self.norm_dense_in = make(has_in, in_value)
    self.norm_dense_out = make(has_out, out_value)

  def _sublayer(self, h, fn, norm_in, norm_out):
    if self.layout == "post":
      return norm_out(h + fn(h))
    y = fn(norm_in(h))
    return h + (norm_out(y) if self.layout == "sandwich" else y)

  def __call__(self, h_BTD: Array, attend: AttendFn) -> tuple[Array, Array]:
    """Applies the layer; `attend(attention, x)` returns (output, max |logit|)."""
    stat = []

    def attn_fn(x):
      out, max_logit = attend(self.attention, x)
      stat.append(max_logit)
      return out

    h = self._sublayer(h_BTD, attn_fn, self.norm_attn_in, self.norm_attn_out)
    h = self._sublayer(h, self.dense, self.norm_dense_in, self.norm_dense_out)
    return h, stat[0]


def _rms(h: Array) -> Array:
  return jnp.sqrt(jnp.mean(jnp.square(h.astype(jnp.float32))))


def _default_positions(batch: int, length: int, offset: int = 0) -> Array:
  return jnp.broadcast_to(jnp.arange(offset, offset + length, dtype=jnp.float32),
                          (batch, length))


def _isolated_candidate_attention(attention: MultiHeadAttention, x_BCD: Array,
                                  positions_BC: Array, ctx_k: Array, ctx_v: Array,
                                  ctx_mask_BN: Array, cand_mask_BC: Array):
  """Candidates attend to the cached context keys and to their own key only."""
  cfg = attention.config
  q_BCKGd, k_BCKd, v_BCKd = attention.project(x_BCD, positions_BC)
  mult = cfg.attn_output_multiplier
  raw_ctx = jnp.einsum("bckgd,bnkd->bkgcn", q_BCKGd, ctx_k,
                       preferred_element_type=jnp.float32) * mult
  raw_self = jnp.einsum("bckgd,bckd->bkgc", q_BCKGd, k_BCKd,
                        preferred_element_type=jnp.float32)[..., None] * mult
  keep_ctx = ctx_mask_BN[:, None, None, None, :]
  keep_self = cand_mask_BC[:, None, None, :, None]
  max_logit = jnp.maximum(jnp.max(jnp.where(keep_ctx, jnp.abs(raw_ctx), 0.0)),
                          jnp.max(jnp.where(keep_self, jnp.abs(raw_self), 0.0)))
  cap = cfg.attn_logit_cap
  logits_ctx = jnp.where(keep_ctx, soft_cap(raw_ctx, cap), MASK_VALUE)
  logits_self = jnp.where(keep_self, soft_cap(raw_self, cap), MASK_VALUE)
  weights = jax.nn.softmax(jnp.concatenate([logits_ctx, logits_self], axis=-1), axis=-1)
  weights = weights.astype(q_BCKGd.dtype)
  attn = jnp.einsum("bkgcn,bnkd->bckgd", weights[..., :-1], ctx_v)
  attn = attn + jnp.einsum("bkgc,bckd->bckgd", weights[..., -1], v_BCKd)
  return attention.output(attn), max_logit


class Transformer(eqx.Module):
  """Stack of `num_layers` decoder layers with stacked parameters, run by `lax.scan`."""

  layers: DecoderLayer          # every array has a leading [num_layers] axis
  config: TransformerConfig = eqx.field(static=True)

  def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
    self.config = config
    keys = jax.random.split(key, config.num_layers)
    self.layers = eqx.filter_vmap(lambda k: DecoderLayer(config, key=k))(keys)

  def _scan(self, h: Array, attend: AttendFn, extra_per_layer=None):
    """Runs every layer; `attend(attention, x, extra)` gets this layer's slice of extra."""
    params, static = eqx.partition(self.layers, eqx.is_array)

    def body(carry, xs):
      layer_params, extra = xs
      layer = eqx.combine(layer_params, static)
      out, max_logit = layer(carry, lambda a, x: attend(a, x, extra))
      return out, (max_logit, _rms(out))

    h, (max_logits, rms) = jax.lax.scan(body, h, (params, extra_per_layer))
    return h, max_logits, rms

  def __call__(self, embeddings: Array, padding_mask: Array,
               candidate_start_offset: Optional[int] = None,
               positions: Optional[Array] = None) -> TransformerOutput:
    """Dense reference path: `[B,T,D]` embeddings, `[B,T]` padding mask.

    `candidate_start_offset` selects the recsys mask, otherwise the causal mask.
    """
    B, T, _ = embeddings.shape
    if padding_mask.shape != (B, T):
      raise ValueError(f"padding_mask has shape {padding_mask.shape}, expected {(B, T)}")
    if candidate_start_offset is None:
      structure = causal_mask(T, embeddings.dtype)
    else:
      structure = make_recsys_attn_mask(T, candidate_start_offset, embeddings.dtype)
    mask_B1TT = padding_mask[:, None, None, :].astype(embeddings.dtype) * structure
    pos = _default_positions(B, T) if positions is None else positions
    h, max_logits, rms = self._scan(
        embeddings, lambda attn, x, _: attn(x, mask_B1TT, pos))
    return TransformerOutput(h, max_logits, rms)

  def encode_context(self, embeddings_BND: Array, padding_mask_BN: Array,
                     positions_BN: Optional[Array] = None,
                     ) -> tuple[TransformerOutput, ContextCache]:
    """Runs the context (user + history) causally and caches each layer's keys/values."""
    B, N, _ = embeddings_BND.shape
    mask = padding_mask_BN[:, None, None, :].astype(embeddings_BND.dtype)
    mask = mask * causal_mask(N, embeddings_BND.dtype)
    pos = _default_positions(B, N) if positions_BN is None else positions_BN
    params, static = eqx.partition(self.layers, eqx.is_array)

    def body(h, layer_params):
      layer = eqx.combine(layer_params, static)
      kv = []

      def attend(attention, x):
        q, k, v = attention.project(x, pos)
        kv.append((k, v))
        return attention.attend(q, k, v, mask)

      out, max_logit = layer(h, attend)
      return out, (max_logit, _rms(out), kv[0])

    h, (max_logits, rms, (keys, values)) = jax.lax.scan(body, embeddings_BND, params)
    cache = ContextCache(keys, values, padding_mask_BN.astype(bool))
    return TransformerOutput(h, max_logits, rms), cache

  def score_candidates(self, embeddings_BCD: Array, padding_mask_BC: Array,
                       cache: ContextCache, positions_BC: Optional[Array] = None,
                       ) -> TransformerOutput:
    """Runs isolated candidates against a `ContextCache` (any number of candidates)."""
    B, C, _ = embeddings_BCD.shape
    N = cache.padding_mask.shape[1]
    pos = _default_positions(B, C, N) if positions_BC is None else positions_BC
    cand_mask = padding_mask_BC.astype(bool)

    def attend(attention, x, kv):
      return _isolated_candidate_attention(attention, x, pos, kv[0], kv[1],
                                           cache.padding_mask, cand_mask)

    h, max_logits, rms = self._scan(embeddings_BCD, attend, (cache.keys, cache.values))
    return TransformerOutput(h, max_logits, rms)

