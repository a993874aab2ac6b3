"""Decoder layer and the scanned transformer stack, with two attention paths.

* Dense path (the reference): one `[B, 1, T, T]` mask (padding x causal or recsys) and
  full `T x T` attention, exactly as the release computes it.
* Isolated path (candidate isolation on): the context (user + history) attends causally
  to itself; each candidate attends to the context keys plus its own key only. No `C x C`
  block and no `T x T` mask is built. `isolated` runs context and candidates in one pass
  (one q|k|v, output and GeGLU matmul per layer over all tokens); `encode_context` leaves
  the context's per-layer keys/values in a `ContextCache` and `score_candidates` scores
  any number of candidates against it, so a runner can score candidates in chunks.
  `isolated_candidates` returns the candidates' outputs alone and skips the context's
  last-layer outputs, which only the diagnostics read (`PhoenixModel.__call__` uses it
  when the candidates fit one micro-batch); `context_cache` likewise builds the cache
  alone (`PhoenixModel.encode_context`, and `__call__` before scoring micro-batches).

Every path builds one RoPE table per forward pass and shares it between layers.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from phoenix_flax.config import TransformerConfig
from phoenix_flax.layers import (DenseBlock, MultiHeadAttention, RMSNorm, RopeTable,
                                 masked_logits, rope_phase)
from phoenix_flax.masks import causal_mask, make_recsys_attn_mask


class TransformerOutput(NamedTuple):
  embeddings: Array             # [B, T, D]
  max_abs_attn_logit: Array     # [L] max |logit| a valid query gives a kept key, before the cap
  residual_rms: Array           # [L] RMS of the residual stream after each layer, over
                                #     the non-padded tokens


class ContextCache(NamedTuple):
  """Per-layer rotated keys and values of a user context, and its padding mask."""

  keys: Array                   # [L, B, N, KV, d]
  values: Array                 # [L, B, N, KV, d]
  padding_mask: Array           # [B, N] bool


AttendFn = Callable[[MultiHeadAttention, Array], tuple[Array, Array]]


def check_cache_type(cache) -> None:
  """A TypeError unless `cache` is a `ContextCache` (checked before its fields are read)."""
  if not isinstance(cache, ContextCache):
    raise TypeError(f"cache must be a ContextCache, got {type(cache).__name__}")


def check_cache(config: TransformerConfig, cache: ContextCache, dtype, batch_size: int,
                context_len: Optional[int] = None, hint: str = "") -> None:
  """`cache` is a `ContextCache` of a transformer of `config`: keys and values
  `[L, B, N, KV, d]` of `dtype`, a bool padding mask `[B, N]`, with B = `batch_size` and
  N = `context_len` (default: the mask's). A cache of another depth, head split, batch,
  context length or dtype raises a ValueError naming the field (it scored silently, or
  failed deep in the scan). `hint` ends the message."""
  check_cache_type(cache)
  hint = f": {hint}" if hint else ""
  for name in ContextCache._fields:
    x = getattr(cache, name)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"cache.{name} is a {type(x).__name__}, expected an array{hint}")
  if context_len is None:
    context_len = cache.padding_mask.shape[-1]
  kv = (config.num_layers, batch_size, context_len, config.num_kv_heads, config.key_size)
  expected = {"keys": (kv, jnp.dtype(dtype)), "values": (kv, jnp.dtype(dtype)),
              "padding_mask": ((batch_size, context_len), jnp.dtype(bool))}
  for name, (shape, want) in expected.items():
    x = getattr(cache, name)
    if tuple(x.shape) != shape:
      raise ValueError(f"cache.{name} has shape {tuple(x.shape)}, expected {shape}{hint}")
    if x.dtype != want:
      raise ValueError(f"cache.{name} has dtype {x.dtype}, expected {want}{hint}")


def _check_tokens(config: TransformerConfig, what: str, x_BTD: Array, mask_BT: Array,
                  positions_BT: Optional[Array] = None, batch_size: Optional[int] = None,
                  batch_of: str = "the cache") -> None:
  """Token embeddings `[B, T, emb_size]` of a float dtype with a `[B, T]` padding mask (and
  positions); `batch_size`, when given, is the B of `batch_of`."""
  if getattr(x_BTD, "ndim", None) != 3 or x_BTD.shape[-1] != config.emb_size:
    raise ValueError(f"{what} must be [B, T, emb_size={config.emb_size}], got shape "
                     f"{getattr(x_BTD, 'shape', type(x_BTD).__name__)}")
  if not jnp.issubdtype(x_BTD.dtype, jnp.floating):
    raise ValueError(f"{what} must be float embeddings, got dtype {x_BTD.dtype}")
  B, T = x_BTD.shape[:2]
  if batch_size is not None and B != batch_size:
    raise ValueError(f"{what} holds {B} users but {batch_of} holds {batch_size}")
  for name, x in (("padding_mask", mask_BT), ("positions", positions_BT)):
    if x is not None and tuple(getattr(x, "shape", ())) != (B, T):
      raise ValueError(f"{what}: {name} has shape {tuple(getattr(x, 'shape', ()))}, "
                       f"expected {(B, T)}")


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

  def _block_input(self, h, norm_in):
    """What a block (attention or GeGLU) reads: `h` in the post layout, else `norm_in(h)`."""
    return h if self.layout == "post" else norm_in(h)

  def _sublayer(self, h, fn, norm_in, norm_out, out_from: int = 0):
    rest = h[:, out_from:] if out_from else h
    y = fn(self._block_input(h, norm_in))
    if y.shape != rest.shape:   # `attend` must return the rows `out_from:` exactly
      raise ValueError(f"the layer's block returned shape {y.shape} for rows {out_from}: "
                       f"of {h.shape}")
    if self.layout == "post":
      return norm_out(rest + y)
    return rest + (norm_out(y) if self.layout == "sandwich" else y)

  def keys_values(self, h_BTD: Array, rope: RopeTable) -> tuple[Array, Array]:
    """The rotated keys and values `[B, T, KV, d]` this layer's attention takes from
    `h` (the queries come out of the same fused matmul and are dropped)."""
    _, k, v = self.attention.project(self._block_input(h_BTD, self.norm_attn_in), rope)
    return k, v

  def __call__(self, h_BTD: Array, attend: AttendFn, out_from: int = 0
               ) -> tuple[Array, Array]:
    """Applies the layer; `attend(attention, x)` returns (output, max |logit|).

    With `out_from`, attention still reads every token of `h` (its keys and values), but
    `attend` returns outputs for tokens `out_from:` only and the rest of the layer runs on
    those tokens alone: the result is `[B, T - out_from, D]`.
    """
    stat = []

    def attn_fn(x):
      out, max_logit = attend(self.attention, x)
      stat.append(max_logit)
      return out

    h = self._sublayer(h_BTD, attn_fn, self.norm_attn_in, self.norm_attn_out, out_from)
    h = self._sublayer(h, self.dense, self.norm_dense_in, self.norm_dense_out)
    return h, stat[0]


def _rms(h_BTD: Array, keep_BT: Array) -> Array:
  """RMS of `h` over the tokens `keep` marks (padding would dilute it); 0 if none."""
  keep = keep_BT.astype(jnp.float32)
  sq_BT = jnp.mean(jnp.square(h_BTD.astype(jnp.float32)), axis=-1)
  return jnp.sqrt(jnp.sum(sq_BT * keep) / jnp.maximum(jnp.sum(keep), 1.0))


def _default_positions(batch: int, length: int, offset: int = 0) -> Array:
  return jnp.broadcast_to(jnp.arange(offset, offset + length, dtype=jnp.float32),
                          (batch, length))


def _shared_rope(config: TransformerConfig, positions_BT: Array) -> RopeTable:
  """One RoPE table for every layer of a forward pass, its cosines and sines built in a
  loop of two steps (a `lax.switch` picks the function).

  The loop is there for XLA:CPU, which fuses elementwise producers into their consumers
  and drops `optimization_barrier`: with the layers unrolled (`scan_unroll` > 1, or the
  last layer run on its own) it fused the cosines and sines into every rotation and
  recomputed them for each head of each layer (16 ms of a 104 ms forward at the
  benchmark's `1k` size). A loop's results are buffers that its consumers read. The
  values are those of `rope_table`.
  """
  phase = rope_phase(positions_BT, config.key_size)
  both = jax.lax.map(lambda i: jax.lax.switch(i, (jnp.cos, jnp.sin), phase), jnp.arange(2))
  return RopeTable(both[0], both[1])


def _swap_time_heads(x: Array) -> Array:
  """`[B, T, KV, ...]` <-> `[B, KV, T, ...]`: heads-first makes attention batched GEMMs."""
  return jnp.swapaxes(x, 1, 2)


def _exp_without_shift(cap: Optional[float], dtype, keys: int) -> bool:
  """Whether the softmax may take `exp` of the logits themselves, with no row max.

  Soft-capped logits lie in `[-cap, cap]`. The row max only keeps `exp` in range, and
  costs a reduction over every logit; it can go when `exp(cap) * keys` stays below the
  square root of the largest `dtype` (the weights' dtype) and `exp(-cap)` above the
  square root of its smallest normal number, which leaves the value product that range
  again as headroom. Masked logits (`MASK_VALUE`) give exactly 0. For float32 and
  bfloat16 that allows the release's cap of 30 up to about a million keys, and caps up
  to about 39 at 130 keys; float16 allows it only for caps below about 4.8 (fewer with
  more keys), so at the release's 30 it keeps the row max."""
  if cap is None:
    return False
  info = jnp.finfo(dtype)
  return (cap + math.log(keys) <= math.log(float(info.max)) / 2
          and cap <= -math.log(float(info.tiny)) / 2)


def _isolated_attention(cfg: TransformerConfig, q_BTKGd: Array, ctx_k_BNKd: Array,
                        ctx_v_BNKd: Array, ctx_mask_BN: Array,
                        candidates: Optional[tuple[Array, Array, Array]] = None
                        ) -> tuple[Array, Array]:
  """Attention of context or candidate queries against the context keys; no `C x C` block.

  Without `candidates` the queries are the context itself and attend causally. With
  `candidates = (k_BTKd, v_BTKd, mask_BT)` they are candidates: each attends to every
  context key and to its own key (kept where `mask_BT` is set), and one softmax spans both
  parts without concatenating them. Masks come from iota comparisons and are never
  stored. Returns the attended values `[B,T,KV,G,d]` (before the output projection) and
  the max |logit| over the kept entries of valid queries.

  The softmax is the release's masked softmax over the row, computed in another order:
  the unnormalised weights `exp(logit - shift)` go through the value product and its
  result is divided by their sum (a `d`-wide division instead of one per key). The shift
  is 0 when the soft cap bounds the logits (`_exp_without_shift`), else the row max, as
  `jax.nn.softmax` takes it. Results agree with the dense reference to float32 rounding
  (tested to 1e-5 on logits).

  A query with no kept key at all (a padded user or history token with no valid key
  before it, or a padded candidate whose context is entirely padding) gets zeros with
  the shift of 0, and the average of the values it sees (a candidate: the context's and
  its own) with the row max; the release's dense softmax averages every value of its
  row, other candidates' included. No kept query reads such an output, so every valid
  candidate's logits are unaffected; only such a padded candidate's own logits differ (a
  padded candidate in the row of a user with no valid user token and no valid history),
  which a ranking puts last.
  """
  B, T, KV, G, d = q_BTKGd.shape
  N = ctx_k_BNKd.shape[1]
  mult, cap = cfg.attn_output_multiplier, cfg.attn_logit_cap
  q_BKQd = _swap_time_heads(q_BTKGd).reshape(B, KV, T * G, d)   # Q = T * G query rows
  raw_BKQN = jnp.einsum("bkqd,bkdn->bkqn", q_BKQd,
                        jnp.transpose(ctx_k_BNKd, (0, 2, 3, 1))).astype(jnp.float32)
  keep_B1T1N = ctx_mask_BN[:, None, None, None, :]   # (T: 1 for candidates, all keys)
  if candidates is None:   # the queries are the context: valid where its mask is set
    keep_B1T1N = keep_B1T1N & (jnp.arange(N)[None, :] <= jnp.arange(T)[:, None]
                               )[None, None, :, None, :]
    valid_B1T11 = ctx_mask_BN[:, None, :, None, None]
  else:
    k_BTKd, v_BTKd, mask_BT = candidates
    valid_B1T11 = mask_BT[:, None, :, None, None]
  logits_BKTGN, max_logit = masked_logits(raw_BKQN.reshape(B, KV, T, G, N) * mult,
                                          keep_B1T1N, cap, valid_B1T11)
  if candidates is not None:
    # The own-key term stays in token order ([B,T,KV,G]): only its small result moves
    # to heads-first, not a second copy of the queries.
    raw_self_BTKG = jnp.einsum("btkgd,btkd->btkg", q_BTKGd, k_BTKd).astype(jnp.float32) * mult
    own_BT11 = mask_BT[:, :, None, None]   # a candidate's own key: valid as a key and a query
    logits_self_BTKG, max_self = masked_logits(raw_self_BTKG, own_BT11, cap, own_BT11)
    logits_self_BKTG = _swap_time_heads(logits_self_BTKG)
    max_logit = jnp.maximum(max_logit, max_self)
  if _exp_without_shift(cap, q_BTKGd.dtype, N + 1):
    exp_BKTGN = jnp.exp(logits_BKTGN)
    exp_self_BKTG = None if candidates is None else jnp.exp(logits_self_BKTG)
  else:
    top_BKTG = jnp.max(logits_BKTGN, axis=-1)
    if candidates is not None:
      top_BKTG = jnp.maximum(top_BKTG, logits_self_BKTG)
    # The row max only keeps exp in range and the softmax does not depend on it, so its
    # gradient is zero; stopping it skips that backward work (as `jax.nn.softmax` does).
    top_BKTG = jax.lax.stop_gradient(top_BKTG)
    exp_BKTGN = jnp.exp(logits_BKTGN - top_BKTG[..., None])
    exp_self_BKTG = None if candidates is None else jnp.exp(logits_self_BKTG - top_BKTG)
  total_BKTG = jnp.sum(exp_BKTGN, axis=-1)
  if candidates is not None:
    total_BKTG = total_BKTG + exp_self_BKTG
  attn_BKQd = jnp.einsum("bkqn,bknd->bkqd",
                         exp_BKTGN.reshape(B, KV, T * G, N).astype(q_BTKGd.dtype),
                         _swap_time_heads(ctx_v_BNKd))
  # (Summed and normalised in float32: a bfloat16 forward's values are widened first.)
  attn_BTKGd = _swap_time_heads(attn_BKQd.reshape(B, KV, T, G, d)).astype(jnp.float32)
  total_BTKG1 = _swap_time_heads(jnp.where(total_BKTG > 0, total_BKTG, 1.0))[..., None]
  if candidates is not None:
    v_BTK1d = v_BTKd[:, :, :, None].astype(jnp.float32)
    attn_BTKGd = attn_BTKGd + _swap_time_heads(exp_self_BKTG)[..., None] * v_BTK1d
  return (attn_BTKGd / total_BTKG1).astype(q_BTKGd.dtype), max_logit


class Transformer(eqx.Module):
  """Stack of `num_layers` decoder layers with stacked parameters, run by `lax.scan`
  (`config.scan_unroll` layers per scan iteration)."""

  layers: DecoderLayer          # every array has a leading [num_layers] axis
  config: TransformerConfig = eqx.field(static=True)

  def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
    self.config = config
    keys = jax.random.split(key, config.num_layers)
    self.layers = eqx.filter_vmap(lambda k: DecoderLayer(config, key=k))(keys)

  def _layer(self, index) -> DecoderLayer:
    """Layer `index` (an int or a traced scalar) of the stacked parameters."""
    params, static = eqx.partition(self.layers, eqx.is_array)
    return eqx.combine(jax.tree.map(lambda p: p[index], params), static)

  def _scan(self, h: Array, keep: Array, attend, extra_per_layer=None,
            num_layers: Optional[int] = None):
    """Runs the first `num_layers` layers (default: all). `attend(attention, x, extra)`
    gets this layer's slice of `extra_per_layer` and returns (output, max |logit|, kept),
    where `kept` is any pytree (None for nothing) that comes back stacked over layers.
    `keep` `[B, T]` marks the tokens the residual RMS counts. Returns (h, max logits, RMS,
    kept), each per layer.

    The loop runs over layer indices and indexes the stacked parameters in place, as
    `lax.scan` does with its inputs, so that running fewer layers copies no parameters.
    """
    count = self.config.num_layers if num_layers is None else num_layers

    def body(carry, xs):
      index, extra = xs
      kept = []

      def layer_attend(attention, x):
        out, max_logit, this = attend(attention, x, extra)
        kept.append(this)
        return out, max_logit

      out, max_logit = self._layer(index)(carry, layer_attend)
      return out, (max_logit, _rms(out, keep), kept[0])

    unroll = max(1, min(self.config.scan_unroll, count))
    h, (max_logits, rms, kept) = jax.lax.scan(body, h, (jnp.arange(count), extra_per_layer),
                                              unroll=unroll)
    return h, max_logits, rms, kept

  def __call__(self, embeddings: Array, padding_mask: Array,
               candidate_start_offset: Optional[int] = None,
               positions: Optional[Array] = None) -> TransformerOutput:
    """Dense reference path: `[B,T,D]` embeddings, `[B,T]` padding mask.

    `candidate_start_offset` selects the recsys mask, otherwise the causal mask.
    """
    _check_tokens(self.config, "embeddings", embeddings, padding_mask, positions)
    B, T, _ = embeddings.shape
    if candidate_start_offset is None:
      structure = causal_mask(T, embeddings.dtype)
    else:
      structure = make_recsys_attn_mask(T, candidate_start_offset, embeddings.dtype)
    mask_B1TT = padding_mask[:, None, None, :].astype(embeddings.dtype) * structure
    rope = _shared_rope(self.config, _default_positions(B, T) if positions is None
                        else positions)
    h, max_logits, rms, _ = self._scan(
        embeddings, padding_mask,
        lambda attn, x, _: (*attn.attend(*attn.project(x, rope), mask_B1TT), None))
    return TransformerOutput(h, max_logits, rms)

  def _context_setup(self, embeddings_BND, padding_mask_BN, positions_BN):
    """Checks a context; returns its bool mask, its RoPE table and the layers' `attend`
    (causal attention that keeps each layer's keys and values)."""
    _check_tokens(self.config, "context", embeddings_BND, padding_mask_BN, positions_BN)
    B, N, _ = embeddings_BND.shape
    padding_mask_BN = padding_mask_BN.astype(bool)
    rope = _shared_rope(self.config,
                        _default_positions(B, N) if positions_BN is None else positions_BN)

    def attend(attention, x, _):
      q, k, v = attention.project(x, rope)
      attn, max_logit = _isolated_attention(self.config, q, k, v, padding_mask_BN)
      return attention.output(attn), max_logit, (k, v)

    return padding_mask_BN, rope, attend

  def encode_context(self, embeddings_BND: Array, padding_mask_BN: Array,
                     positions_BN: Optional[Array] = None,
                     ) -> tuple[TransformerOutput, ContextCache]:
    """Runs the context (user + history) causally and caches each layer's keys/values."""
    mask, _, attend = self._context_setup(embeddings_BND, padding_mask_BN, positions_BN)
    h, max_logits, rms, (keys, values) = self._scan(embeddings_BND, mask, attend)
    cache = ContextCache(keys, values, mask)
    return TransformerOutput(h, max_logits, rms), cache

  def context_cache(self, embeddings_BND: Array, padding_mask_BN: Array,
                    positions_BN: Optional[Array] = None) -> ContextCache:
    """The `ContextCache` of `encode_context` alone. The last layer stops after its
    key/value projection: its attention and GeGLU feed only the context's outputs."""
    mask, rope, attend = self._context_setup(embeddings_BND, padding_mask_BN, positions_BN)
    L = self.config.num_layers
    h, _, _, (keys, values) = self._scan(embeddings_BND, mask, attend, num_layers=L - 1)
    k, v = self._layer(L - 1).keys_values(h, rope)
    return ContextCache(jnp.concatenate([keys, k[None]]), jnp.concatenate([values, v[None]]),
                        mask)

  def score_candidates(self, embeddings_BCD: Array, padding_mask_BC: Array,
                       cache: ContextCache, positions_BC: Optional[Array] = None,
                       ) -> TransformerOutput:
    """Runs isolated candidates against a `ContextCache` (any number of candidates), of
    this transformer and of the candidates' users and dtype (`check_cache`)."""
    check_cache_type(cache)
    _check_tokens(self.config, "candidates", embeddings_BCD, padding_mask_BC, positions_BC,
                  cache.padding_mask.shape[0])
    check_cache(self.config, cache, embeddings_BCD.dtype, embeddings_BCD.shape[0])
    B, C, _ = embeddings_BCD.shape
    N = cache.padding_mask.shape[1]
    rope = _shared_rope(self.config, _default_positions(B, C, N) if positions_BC is None
                        else positions_BC)
    cand_mask = padding_mask_BC.astype(bool)

    def attend(attention, x, kv):
      q, k, v = attention.project(x, rope)
      attn, max_logit = _isolated_attention(self.config, q, kv[0], kv[1], cache.padding_mask,
                                            (k, v, cand_mask))
      return attention.output(attn), max_logit, None

    h, max_logits, rms, _ = self._scan(embeddings_BCD, cand_mask, attend,
                                       (cache.keys, cache.values))
    return TransformerOutput(h, max_logits, rms)

  def _isolated_setup(self, context_BND, context_mask_BN, candidates_BCD, candidate_mask_BC,
                      context_positions_BN, candidate_positions_BC):
    """Checks the inputs of `isolated`; returns the tokens `[B, N+C, D]`, their padding
    mask, and `attend(attention, x, candidates_only)`, which runs both attention calls
    (context and candidates) or the candidates' only (their `C` rows)."""
    _check_tokens(self.config, "context", context_BND, context_mask_BN, context_positions_BN)
    _check_tokens(self.config, "candidates", candidates_BCD, candidate_mask_BC,
                  candidate_positions_BC, context_BND.shape[0], "the context")
    B, N, _ = context_BND.shape
    C = candidates_BCD.shape[1]
    ctx_pos = _default_positions(B, N) if context_positions_BN is None else context_positions_BN
    cand_pos = (_default_positions(B, C, N) if candidate_positions_BC is None
                else candidate_positions_BC)
    rope = _shared_rope(self.config, jnp.concatenate([ctx_pos, cand_pos], axis=1))
    ctx_mask, cand_mask = context_mask_BN.astype(bool), candidate_mask_BC.astype(bool)

    def attend(attention, x, candidates_only=False):
      q, k, v = attention.project(x, rope)
      ctx_k, ctx_v = k[:, :N], v[:, :N]
      attn, max_logit = _isolated_attention(self.config, q[:, N:], ctx_k, ctx_v, ctx_mask,
                                            (k[:, N:], v[:, N:], cand_mask))
      if not candidates_only:
        attn_ctx, max_ctx = _isolated_attention(self.config, q[:, :N], ctx_k, ctx_v, ctx_mask)
        attn = jnp.concatenate([attn_ctx, attn], axis=1)
        max_logit = jnp.maximum(max_ctx, max_logit)
      return attention.output(attn), max_logit

    tokens = jnp.concatenate([context_BND, candidates_BCD], axis=1)
    return tokens, jnp.concatenate([ctx_mask, cand_mask], axis=1), attend

  def isolated(self, context_BND: Array, context_mask_BN: Array, candidates_BCD: Array,
               candidate_mask_BC: Array, context_positions_BN: Optional[Array] = None,
               candidate_positions_BC: Optional[Array] = None) -> TransformerOutput:
    """Context + isolated candidates in one pass over `[B, N+C, D]` (outputs in that order).

    Its embeddings equal those of `encode_context` followed by `score_candidates` (context
    rows, then candidate rows); its diagnostics cover both parts at once (the residual RMS
    over every valid token, the larger max |logit|). Every layer runs one q|k|v, output and
    GeGLU matmul over all tokens, and only attention is split in two.
    """
    tokens, mask, attend = self._isolated_setup(
        context_BND, context_mask_BN, candidates_BCD, candidate_mask_BC,
        context_positions_BN, candidate_positions_BC)
    h, max_logits, rms, _ = self._scan(tokens, mask,
                                       lambda attn, x, _: (*attend(attn, x), None))
    return TransformerOutput(h, max_logits, rms)

  def isolated_candidates(self, context_BND: Array, context_mask_BN: Array,
                          candidates_BCD: Array, candidate_mask_BC: Array,
                          context_positions_BN: Optional[Array] = None,
                          candidate_positions_BC: Optional[Array] = None) -> Array:
    """The candidates' outputs `[B, C, D]` of `isolated`, without its diagnostics.

    The context's outputs of the last layer feed nothing but the diagnostics, so that
    layer projects every token (the candidates need the context's keys and values) and
    runs attention, the output projection and the GeGLU for the candidates only.
    """
    tokens, mask, attend = self._isolated_setup(
        context_BND, context_mask_BN, candidates_BCD, candidate_mask_BC,
        context_positions_BN, candidate_positions_BC)
    L, N = self.config.num_layers, context_BND.shape[1]
    h, _, _, _ = self._scan(tokens, mask, lambda attn, x, _: (*attend(attn, x), None),
                            num_layers=L - 1)
    out, _ = self._layer(L - 1)(h, lambda attn, x: attend(attn, x, True), out_from=N)
    return out
