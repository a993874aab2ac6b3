"""Independent dm-haiku reference of the released (Jan release) Phoenix models, plus the
later release's right-anchored RoPE positions for the ranking model.

Written from the project's written specification of the released code alone (not shipped:
it records the release's semantics and parameter names, which this file and
`phoenix_flax/haiku_compat.py` restate) and never imports `phoenix_flax`: it is the
yardstick the parity tests hold our Equinox code to. Module names are chosen so that
`hk.transform(...).init` yields exactly the release's parameter tree. Every parameter is
zero-initialised (the release zeroes only the transformer's Linear weights and RMSNorm
scales); initial values never matter here, as the tests load random values before
comparing. The specification is silent on three roundings to the forward dtype that the
release makes, of the action and product-surface embeddings and of the logits it returns;
this file keeps them in float32, as `phoenix_flax` does, so in bfloat16 both differ from
the release there (docs/models.md, "How close to the release").

Batches and embeddings are read by attribute only (`batch.user_hashes`, ...), so the
`RecsysBatch` / `RecsysEmbeddings` containers of any implementation can be passed in.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp

ZEROS = hk.initializers.Constant(0.0)


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
  """Shape of the released models (forward dtype float32 unless given)."""

  emb_size: int
  key_size: int
  num_q_heads: int
  num_kv_heads: int
  num_layers: int
  widening_factor: float
  attn_output_multiplier: float
  num_actions: int = 19
  product_surface_vocab_size: int = 16
  enable_linear_proj: bool = True
  fprop_dtype: jnp.dtype = jnp.float32
  right_anchored_rope: bool = False   # later release (ranking model)


def ffn_size(emb_size: int, widening_factor: float) -> int:
  size = int(widening_factor * emb_size) * 2 // 3
  return -(-size // 8) * 8


class Linear(hk.Module):
  """`x @ w`, `w` float32 `[in, out]` cast to the input dtype; no bias."""

  def __init__(self, output_size: int, name: Optional[str] = None):
    super().__init__(name=name)
    self.output_size = output_size

  def __call__(self, x):
    w = hk.get_parameter("w", [x.shape[-1], self.output_size], jnp.float32, init=ZEROS)
    return jnp.dot(x, w.astype(x.dtype))


class RMSNorm(hk.Module):
  """`scale * x * rsqrt(mean(x^2) + 1e-5)` in float32, cast back."""

  def __call__(self, x):
    scale = hk.get_parameter("scale", [x.shape[-1]], jnp.float32, init=ZEROS)
    x32 = x.astype(jnp.float32)
    mean_sq = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    scale = jnp.broadcast_to(scale, x.shape)
    return (scale * (x32 * jax.lax.rsqrt(mean_sq + 1e-5))).astype(x.dtype)


def rotate_half(x):
  first, second = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([-second, first], axis=-1)


def rope(x, positions):
  """RoPE on `[B, T, heads, d]` with positions `[B, T]`, base 10000, halves rotated."""
  d = x.shape[-1]
  inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  phase = jnp.einsum("bt,f->btf", positions.astype(jnp.float32), inv_freq)
  phase = jnp.concatenate([phase, phase], axis=-1)[:, :, None, :]
  xf = x.astype(jnp.float32)   # (the release multiplies a bfloat16 x by float32 phases)
  return (xf * jnp.cos(phase) + rotate_half(xf) * jnp.sin(phase)).astype(x.dtype)


class MultiHeadAttention(hk.Module):
  """Self-attention with grouped query heads, RoPE, multiplier, soft cap 30."""

  def __init__(self, cfg: ReferenceConfig):
    super().__init__()
    self.cfg = cfg

  def __call__(self, x, mask, positions):
    cfg = self.cfg
    B, T, D = x.shape
    H, KV, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.key_size
    q = Linear(H * d, name="query")(x).reshape(B, T, H, d)
    k = Linear(KV * d, name="key")(x).reshape(B, T, KV, d)
    v = Linear(KV * d, name="value")(x).reshape(B, T, KV, d)
    k = rope(k, positions)
    q = rope(q, positions)
    q = q.reshape(B, T, KV, H // KV, d)
    logits = jnp.einsum("...thHd,...Thd->...hHtT", q, k).astype(jnp.float32)
    logits = logits * cfg.attn_output_multiplier
    logits = 30.0 * jnp.tanh(logits / 30.0)
    logits = jnp.where(mask[:, :, None, :, :], logits, -1e30)
    weights = jax.nn.softmax(logits).astype(q.dtype)
    attn = jnp.einsum("...hHtT,...Thd->...thHd", weights, v).reshape(B, T, H * d)
    return Linear(D)(attn)


class DecoderLayer(hk.Module):
  """Sandwich-norm layer; the GeGLU block lives directly in the layer's scope."""

  def __init__(self, cfg: ReferenceConfig, name: str):
    super().__init__(name=name)
    self.cfg = cfg

  def __call__(self, h, mask, positions):
    D = h.shape[-1]
    attn = MultiHeadAttention(self.cfg)(RMSNorm()(h), mask, positions)
    h = h + RMSNorm()(attn)
    x = RMSNorm()(h)
    F = ffn_size(D, self.cfg.widening_factor)
    value = Linear(F, name="linear_v")(x)
    gate = jax.nn.gelu(Linear(F)(x))
    h = h + RMSNorm()(Linear(D)(gate * value))
    return h


def make_recsys_attn_mask(seq_len: int, offset: int, dtype=jnp.float32):
  """Causal triangle, candidate block zeroed, its diagonal set back to one."""
  mask = jnp.tril(jnp.ones((seq_len, seq_len), dtype))
  mask = mask.at[offset:, offset:].set(0)
  idx = jnp.arange(offset, seq_len)
  mask = mask.at[idx, idx].set(1)
  return mask[None, None]


def right_anchored_rope_positions(padding_mask, history_seq_len: int, prefix: int):
  """Later release's positions `[B, T]`: prefix tokens keep their index, the history
  window `[hs, he)` ends its valid entries at `he - 1`, every later token sits at `he`,
  padded tokens at 0."""
  T = padding_mask.shape[1]
  hs, he = prefix, prefix + history_seq_len
  n = jnp.sum(padding_mask[:, hs:he].astype(jnp.int32), axis=1, keepdims=True)
  index = jnp.arange(T)[None, :]
  positions = jnp.where(index < hs, index, jnp.where(index < he, he - n + (index - hs), he))
  return jnp.where(padding_mask, positions, 0).astype(jnp.float32)


class Transformer(hk.Module):

  def __init__(self, cfg: ReferenceConfig):
    super().__init__(name="transformer")
    self.cfg = cfg

  def __call__(self, embeddings, padding_mask, candidate_start_offset=None, positions=None):
    dtype = embeddings.dtype
    B, T, _ = embeddings.shape
    mask = padding_mask[:, None, None, :].astype(dtype)
    if candidate_start_offset is None:
      mask = mask * jnp.tril(jnp.ones((1, 1, T, T), dtype))
    else:
      mask = mask * make_recsys_attn_mask(T, candidate_start_offset, dtype)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32), (B, T))
    h = embeddings
    for i in range(self.cfg.num_layers):
      h = DecoderLayer(self.cfg, name=f"decoder_layer_{i}")(h, mask, positions)
    return h


def _surface_embedding(ids, table):
  return jax.nn.one_hot(ids, table.shape[0]) @ table


def _action_embedding(actions, projection):
  a = actions.astype(jnp.float32)
  has_any = jnp.any(actions != 0, axis=-1, keepdims=True).astype(jnp.float32)
  return ((2.0 * a - 1.0) @ projection) * has_any


class _UserHistoryTokens(hk.Module):
  """Shared user + history token construction (params in the owning model's scope)."""

  def context_tokens(self, batch, emb):
    cfg = self.cfg
    D = cfg.emb_size
    B, U = batch.user_hashes.shape
    S = batch.history_post_hashes.shape[1]
    V, A = cfg.product_surface_vocab_size, cfg.num_actions
    table = hk.get_parameter("product_surface_embedding_table", [V, D], jnp.float32, init=ZEROS)
    action_projection = hk.get_parameter("action_projection", [A, D], jnp.float32, init=ZEROS)
    proj_mat_1 = hk.get_parameter("proj_mat_1", [U * D, D], jnp.float32, init=ZEROS)
    user = emb.user_embeddings.reshape(B, 1, U * D) @ proj_mat_1
    history_parts = [
        emb.history_post_embeddings.reshape(B, S, -1),
        emb.history_author_embeddings.reshape(B, S, -1),
        _action_embedding(batch.history_actions, action_projection),
        _surface_embedding(batch.history_product_surface, table),
    ]
    history_in = jnp.concatenate(history_parts, axis=-1)
    proj_mat_3 = hk.get_parameter("proj_mat_3", [history_in.shape[-1], D], jnp.float32,
                                  init=ZEROS)
    history = history_in @ proj_mat_3
    tokens = jnp.concatenate([user, history], axis=1)
    mask = jnp.concatenate([batch.user_hashes[:, :1] != 0,
                            batch.history_post_hashes[:, :, 0] != 0], axis=1)
    return tokens, mask, table


class PhoenixModel(_UserHistoryTokens):
  """Ranking model: `[user | history | candidates]` -> logits `[B, C, A]`."""

  def __init__(self, cfg: ReferenceConfig, transformer: Transformer):
    super().__init__(name="phoenix_model")
    self.cfg = cfg
    self.transformer = transformer

  def __call__(self, batch, emb):
    cfg = self.cfg
    D = cfg.emb_size
    context, context_mask, table = self.context_tokens(batch, emb)
    B, C = batch.candidate_post_hashes.shape[:2]
    candidate_in = jnp.concatenate([
        emb.candidate_post_embeddings.reshape(B, C, -1),
        emb.candidate_author_embeddings.reshape(B, C, -1),
        _surface_embedding(batch.candidate_product_surface, table),
    ], axis=-1)
    proj_mat_2 = hk.get_parameter("proj_mat_2", [candidate_in.shape[-1], D], jnp.float32,
                                  init=ZEROS)
    candidates = candidate_in @ proj_mat_2
    offset = context.shape[1]
    tokens = jnp.concatenate([context, candidates], axis=1).astype(cfg.fprop_dtype)
    mask = jnp.concatenate([context_mask, batch.candidate_post_hashes[:, :, 0] != 0], axis=1)
    positions = None
    if cfg.right_anchored_rope:
      positions = right_anchored_rope_positions(mask, batch.history_post_hashes.shape[1], 1)
    h = self.transformer(tokens, mask, candidate_start_offset=offset, positions=positions)
    h = RMSNorm()(h)[:, offset:]
    unembeddings = hk.get_parameter("unembeddings", [D, cfg.num_actions], jnp.float32,
                                    init=ZEROS)
    return jnp.dot(h.astype(unembeddings.dtype), unembeddings)


class CandidateTower(hk.Module):
  """`[B, C, hashes, D]` -> unit vectors: MLP with silu, or a plain mean over hashes."""

  def __init__(self, cfg: ReferenceConfig):
    super().__init__(name="candidate_tower")
    self.cfg = cfg

  def __call__(self, x):
    B, C, N, D = x.shape
    if not self.cfg.enable_linear_proj:
      return _l2_normalize(jnp.mean(x, axis=2))[0]
    p1 = hk.get_parameter("candidate_tower_projection_1", [N * D, 2 * D], jnp.float32,
                          init=ZEROS)
    p2 = hk.get_parameter("candidate_tower_projection_2", [2 * D, D], jnp.float32, init=ZEROS)
    return _l2_normalize(jax.nn.silu(x.reshape(B, C, N * D) @ p1) @ p2)[0]


def _l2_normalize(x):
  norm = jnp.sqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), 1e-12))
  return x / norm, norm


class PhoenixRetrievalModel(_UserHistoryTokens):
  """Two towers: causal user transformer with masked mean pool, and `CandidateTower`."""

  def __init__(self, cfg: ReferenceConfig, transformer: Transformer):
    super().__init__(name="phoenix_retrieval_model")
    self.cfg = cfg
    self.transformer = transformer

  def build_user_representation(self, batch, emb):
    tokens, mask, _ = self.context_tokens(batch, emb)
    h = self.transformer(tokens.astype(self.cfg.fprop_dtype), mask).astype(jnp.float32)
    m = mask[..., None].astype(jnp.float32)
    pooled = jnp.sum(h * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
    return _l2_normalize(pooled)

  def build_candidate_representation(self, batch, emb):
    hashes = jnp.concatenate([emb.candidate_post_embeddings,
                              emb.candidate_author_embeddings], axis=2)
    return CandidateTower(self.cfg)(hashes), batch.candidate_post_hashes[:, :, 0] != 0

  def __call__(self, batch, emb, corpus, top_k, corpus_mask=None):
    """Returns the user representation, its norm, and the top-k indices and scores."""
    user, user_norm = self.build_user_representation(batch, emb)
    scores = user @ corpus.T
    if corpus_mask is not None:
      scores = jnp.where(corpus_mask[None, :], scores, -1e12)
    top_scores, top_indices = jax.lax.top_k(scores, top_k)
    return user, user_norm, top_indices, top_scores


def ranking_transform(cfg: ReferenceConfig) -> hk.Transformed:
  """`init(rng, batch, emb)` / `apply(params, batch, emb) -> logits [B, C, A]`."""

  def forward(batch, emb):
    return PhoenixModel(cfg, Transformer(cfg))(batch, emb)

  return hk.without_apply_rng(hk.transform(forward))


def retrieval_transform(cfg: ReferenceConfig) -> hk.Transformed:
  """`apply(params, batch, emb, corpus, top_k)` -> dict of user representation, its
  pre-normalisation norm, top-k indices and scores, and candidate representations."""

  def forward(batch, emb, corpus, top_k, corpus_mask=None):
    model = PhoenixRetrievalModel(cfg, Transformer(cfg))
    user, user_norm, top_indices, top_scores = model(batch, emb, corpus, top_k, corpus_mask)
    candidates, candidate_mask = model.build_candidate_representation(batch, emb)
    return dict(user=user, user_norm=user_norm, top_indices=top_indices,
                top_scores=top_scores, candidates=candidates, candidate_mask=candidate_mask)

  return hk.without_apply_rng(hk.transform(forward))
