"""PhoenixModel: the ranking transformer over [user | history | candidates]."""

from __future__ import annotations

from typing import NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from phoenix_flax import features
from phoenix_flax.config import PhoenixModelConfig, _check_key
from phoenix_flax.layers import RMSNorm, variance_scaling
from phoenix_flax.masks import right_anchored_rope_positions
from phoenix_flax.transformer import (ContextCache, Transformer, TransformerOutput, check_cache,
                                      check_cache_type)
from phoenix_flax.types import (CANDIDATE_BATCH_FIELDS, CANDIDATE_EMBEDDING_FIELDS,
                                RecsysBatch, RecsysEmbeddings, RecsysModelOutput,
                                check_batch, check_candidate_embeddings,
                                check_candidate_fields, check_embeddings)


def block_user_reduce(user_hashes: Array, user_embeddings: Array, num_user_hashes: int,
                      emb_size: int, proj_mat_1: Array) -> tuple[Array, Array]:
  """`[B,U,D]` hash embeddings -> one user token `[B,1,D]` and its mask `[B,1]`."""
  B = user_hashes.shape[0]
  flat_B1F = user_embeddings.reshape(B, 1, num_user_hashes * emb_size)
  token_B1D = flat_B1F.astype(proj_mat_1.dtype) @ proj_mat_1
  return token_B1D, (user_hashes[:, 0] != 0)[:, None]


def project_parts(parts: list[Array], proj: Array) -> Array:
  """`concatenate(parts, axis=-1) @ proj`: one product over the concatenated features, as
  the release computes it. A sum of per-part products (each part times its rows of
  `proj`) saves the copy, a few percent of the forward at the benchmark's `1k` and
  `serve` sizes, but rounds in another order: it put the logits 2-3 times further from
  the release's, past the parity tests' 1e-5 (`PARITY_ATOL`, tests/test_haiku_compat.py)
  at D=128 and above (docs/performance.md, "Input projection")."""
  widths = [part.shape[-1] for part in parts]
  if sum(widths) != proj.shape[0]:
    raise ValueError(f"the parts have {sum(widths)} features in all; the projection takes "
                     f"{proj.shape[0]}")
  return jnp.concatenate([part.astype(proj.dtype) for part in parts], axis=-1) @ proj


def block_history_reduce(history_post_hashes: Array, history_post_embeddings: Array,
                         history_author_embeddings: Array, product_surface_embeddings: Array,
                         action_embeddings: Array, proj_mat_3: Array,
                         extra_features: tuple[Array, ...] = ()) -> tuple[Array, Array]:
  """concat(post, author, actions, surface[, extra]) per history item @ proj_mat_3."""
  B, S = history_post_hashes.shape[:2]
  parts = [history_post_embeddings.reshape(B, S, -1),
           history_author_embeddings.reshape(B, S, -1),
           action_embeddings, product_surface_embeddings, *extra_features]
  tokens_BSD = project_parts(parts, proj_mat_3)
  return tokens_BSD, history_post_hashes[:, :, 0] != 0


def block_candidate_reduce(candidate_post_hashes: Array, candidate_post_embeddings: Array,
                           candidate_author_embeddings: Array,
                           product_surface_embeddings: Array, proj_mat_2: Array,
                           extra_features: tuple[Array, ...] = ()) -> tuple[Array, Array]:
  """concat(post, author, surface[, extra]) per candidate @ proj_mat_2."""
  B, C = candidate_post_hashes.shape[:2]
  parts = [candidate_post_embeddings.reshape(B, C, -1),
           candidate_author_embeddings.reshape(B, C, -1),
           product_surface_embeddings, *extra_features]
  tokens_BCD = project_parts(parts, proj_mat_2)
  return tokens_BCD, candidate_post_hashes[:, :, 0] != 0


def context_tokens(model, batch: RecsysBatch, embeddings: RecsysEmbeddings,
                   extra_history_features: tuple[Array, ...] = ()) -> tuple[Array, Array]:
  """User + history tokens `[B, 1+S, D]` (forward dtype) and their padding mask `[B, 1+S]`,
  for either Phoenix model (both carry the release's `proj_mat_1`, `proj_mat_3`, surface
  table and action projection). Shapes are the caller's to check."""
  c = model.config
  user_B1D, user_mask_B1 = block_user_reduce(
      batch.user_hashes, embeddings.user_embeddings, c.hash_config.num_user_hashes,
      c.emb_size, model.proj_mat_1)
  surface_BSD = features.single_hot_embedding(batch.history_product_surface,
                                              model.product_surface_embedding_table)
  actions_BSD = features.action_embedding(batch.history_actions, model.action_projection)
  hist_BSD, hist_mask_BS = block_history_reduce(
      batch.history_post_hashes, embeddings.history_post_embeddings,
      embeddings.history_author_embeddings, surface_BSD, actions_BSD, model.proj_mat_3,
      extra_history_features)
  tokens_BND = jnp.concatenate([user_B1D, hist_BSD], axis=1).astype(c.fprop_dtype)
  return tokens_BND, jnp.concatenate([user_mask_B1, hist_mask_BS], axis=1)


class Diagnostics(NamedTuple):
  max_abs_attn_logit: Array     # [L]
  residual_rms: Array           # [L]


class PhoenixModel(eqx.Module):
  """Ranking model: `model(batch, embeddings) -> RecsysModelOutput(logits [B,C,A])`."""

  product_surface_embedding_table: Array
  action_projection: Array
  proj_mat_1: Array
  proj_mat_2: Array
  proj_mat_3: Array
  transformer: Transformer
  final_norm: RMSNorm
  unembeddings: Array
  post_age_embedding_table: Optional[Array]
  dwell_proj_1: Optional[Array]
  dwell_proj_2: Optional[Array]
  continuous_unembeddings: Optional[Array]
  config: PhoenixModelConfig = eqx.field(static=True)

  def __init__(self, config: PhoenixModelConfig, *, key: PRNGKeyArray):
    if not isinstance(config, PhoenixModelConfig):
      raise TypeError(f"config must be a PhoenixModelConfig, got {type(config).__name__}")
    _check_key("PhoenixModel", key)
    self.config = c = config
    hc, D, A = c.hash_config, c.emb_size, c.num_actions
    ks = jax.random.split(key, 12)   # 11 used; splitting into 12 keeps every init as it was
    hist_in = (hc.num_item_hashes + hc.num_author_hashes + 2 + (c.dwell_time_norm is not None)) * D
    cand_in = (hc.num_item_hashes + hc.num_author_hashes + 1
               + (c.post_age_granularity_mins is not None)) * D
    self.product_surface_embedding_table = variance_scaling(
        ks[0], (c.product_surface_vocab_size, D), D)
    self.action_projection = variance_scaling(ks[1], (A, D), A)
    self.proj_mat_1 = variance_scaling(ks[2], (hc.num_user_hashes * D, D), hc.num_user_hashes * D)
    self.proj_mat_2 = variance_scaling(ks[3], (cand_in, D), cand_in)
    self.proj_mat_3 = variance_scaling(ks[4], (hist_in, D), hist_in)
    self.transformer = Transformer(c.model, key=ks[5])
    self.final_norm = RMSNorm(D, init_value=0.0 if c.model.param_init == "zeros" else 1.0)
    self.unembeddings = variance_scaling(ks[6], (D, A), D)
    self.post_age_embedding_table = (
        None if c.post_age_granularity_mins is None
        else variance_scaling(ks[7], (c.num_post_age_buckets, D), D))
    has_dwell = c.dwell_time_norm is not None
    self.dwell_proj_1 = variance_scaling(ks[8], (1, c.dwell_hidden_size), 1) if has_dwell else None
    self.dwell_proj_2 = (variance_scaling(ks[9], (c.dwell_hidden_size, D), c.dwell_hidden_size)
                         if has_dwell else None)
    K = c.num_continuous_actions
    self.continuous_unembeddings = variance_scaling(ks[10], (D, K), D) if K else None

  def _check(self, batch: RecsysBatch, embeddings: RecsysEmbeddings,
             with_candidates: bool = True) -> tuple[int, int]:
    c = self.config
    B, C = check_batch(batch, c.hash_config, c.history_seq_len, c.num_actions,
                       with_candidates=with_candidates,
                       optional_fields=c.optional_batch_fields)
    check_embeddings(embeddings, c.hash_config, B, c.history_seq_len, C, c.emb_size,
                     with_candidates)
    return B, C

  def _check_candidates(self, batch: RecsysBatch, embeddings: RecsysEmbeddings,
                        batch_size: Optional[int] = None) -> None:
    c = self.config
    B, C = check_candidate_fields(batch, c.hash_config, batch_size,
                                  optional_fields=c.optional_batch_fields)
    check_candidate_embeddings(embeddings, c.hash_config, B, C, c.emb_size)

  def build_context_tokens(self, batch: RecsysBatch, embeddings: RecsysEmbeddings
                           ) -> tuple[Array, Array]:
    """User + history tokens `[B, 1+S, D]` (forward dtype) and their padding mask."""
    self._check(batch, embeddings, with_candidates=False)
    return self._context_tokens(batch, embeddings)

  def _context_tokens(self, batch: RecsysBatch, embeddings: RecsysEmbeddings
                      ) -> tuple[Array, Array]:
    c = self.config
    extra = ()
    if c.dwell_time_norm is not None:
      extra = (features.dwell_time_embedding(batch.history_dwell_times, c.dwell_time_norm,
                                             self.dwell_proj_1, self.dwell_proj_2),)
    return context_tokens(self, batch, embeddings, extra)

  def build_candidate_tokens(self, batch: RecsysBatch, embeddings: RecsysEmbeddings
                             ) -> tuple[Array, Array]:
    """Candidate tokens `[B, C, D]` (forward dtype) and their padding mask `[B, C]`."""
    self._check_candidates(batch, embeddings)
    return self._candidate_tokens(batch, embeddings)

  def _candidate_tokens(self, batch: RecsysBatch, embeddings: RecsysEmbeddings
                        ) -> tuple[Array, Array]:
    c = self.config
    surface_BCD = features.single_hot_embedding(batch.candidate_product_surface,
                                                self.product_surface_embedding_table)
    extra = ()
    if c.post_age_granularity_mins is not None:
      bucket_BC = features.compute_post_age_bucket(batch.impression_timestamps[:, None],
                                                   batch.candidate_post_timestamps,
                                                   c.post_age_granularity_mins)
      extra = (features.single_hot_embedding(bucket_BC, self.post_age_embedding_table),)
    tokens_BCD, mask_BC = block_candidate_reduce(
        batch.candidate_post_hashes, embeddings.candidate_post_embeddings,
        embeddings.candidate_author_embeddings, surface_BCD, self.proj_mat_2, extra)
    return tokens_BCD.astype(c.fprop_dtype), mask_BC

  def build_inputs(self, batch: RecsysBatch, embeddings: RecsysEmbeddings
                   ) -> tuple[Array, Array, int]:
    """The release's sequence: `[B, 1+S+C, D]`, padding mask `[B, T]`, offset `1+S`."""
    self._check(batch, embeddings)
    return self._inputs(batch, embeddings)

  def _inputs(self, batch: RecsysBatch, embeddings: RecsysEmbeddings
              ) -> tuple[Array, Array, int]:
    ctx_BND, ctx_mask_BN = self._context_tokens(batch, embeddings)
    cand_BCD, cand_mask_BC = self._candidate_tokens(batch, embeddings)
    return (jnp.concatenate([ctx_BND, cand_BCD], axis=1),
            jnp.concatenate([ctx_mask_BN, cand_mask_BC], axis=1), ctx_BND.shape[1])

  def context_positions(self, context_mask_BN: Array) -> Optional[Array]:
    """RoPE positions `[B, 1+S]` of the context with `right_anchored_rope` (see
    `right_anchored_rope_positions`); None otherwise (the sequence index)."""
    if not self.config.right_anchored_rope:
      return None
    return right_anchored_rope_positions(context_mask_BN, self.config.history_seq_len, 1)

  def candidate_positions(self, candidate_mask_BC: Array, first_index: int = 0) -> Array:
    """RoPE positions of candidates `first_index ...` of the list (chunks pass their start):
    `1+S` for every valid candidate when right-anchored, else their sequence index."""
    N = 1 + self.config.history_seq_len
    B, C = candidate_mask_BC.shape
    if self.config.right_anchored_rope:
      return jnp.where(candidate_mask_BC, float(N), 0.0)
    idx = jnp.asarray(N + first_index).astype(jnp.float32) + jnp.arange(C, dtype=jnp.float32)
    return jnp.broadcast_to(idx, (B, C))

  def encode_context(self, batch: RecsysBatch, embeddings: RecsysEmbeddings) -> ContextCache:
    """Per-layer keys/values of the user + history context (candidate fields unused)."""
    ctx, ctx_mask = self.build_context_tokens(batch, embeddings)
    return self.transformer.context_cache(ctx, ctx_mask, self.context_positions(ctx_mask))

  def score_candidates(self, cache: ContextCache, batch: RecsysBatch,
                       embeddings: RecsysEmbeddings, first_index: int = 0,
                       ) -> RecsysModelOutput:
    """Scores the batch's candidates against a cached context (isolation only): a cache
    of this model's shapes and `fprop_dtype` (`transformer.check_cache`), of these users."""
    if not self.config.candidate_isolation:
      raise ValueError("score_candidates needs candidate_isolation=True: without it a "
                       "candidate's score depends on the candidates before it")
    check_cache_type(cache)
    self._check_candidates(batch, embeddings, cache.padding_mask.shape[0])
    check_cache(self.config.model, cache, self.config.fprop_dtype,
                cache.padding_mask.shape[0], self.config.candidate_start_offset,
                f"encode the context with this model's encode_context (fprop_dtype="
                f"{self.config.fprop_dtype!r}, history_seq_len={self.config.history_seq_len})")
    cand_BCD, cand_mask_BC = self._candidate_tokens(batch, embeddings)
    out = self.transformer.score_candidates(
        cand_BCD, cand_mask_BC, cache, self.candidate_positions(cand_mask_BC, first_index))
    return self._head(out.embeddings)

  def _head(self, h_BCD: Array) -> RecsysModelOutput:
    normed_BCD = self.final_norm(h_BCD)
    logits_BCA = normed_BCD.astype(self.unembeddings.dtype) @ self.unembeddings
    continuous = None
    if self.continuous_unembeddings is not None:
      continuous = jax.nn.sigmoid(normed_BCD.astype(jnp.float32) @ self.continuous_unembeddings)
    return RecsysModelOutput(logits_BCA, continuous)

  @property
  def _isolated_path(self) -> bool:
    return self.config.candidate_isolation and self.config.attention_impl == "isolated"

  def _isolated_args(self, batch: RecsysBatch, embeddings: RecsysEmbeddings) -> tuple:
    """Context and candidate tokens, masks and RoPE positions, as `Transformer.isolated`
    and `isolated_candidates` take them."""
    ctx_BND, ctx_mask_BN = self._context_tokens(batch, embeddings)
    cand_BCD, cand_mask_BC = self._candidate_tokens(batch, embeddings)
    return (ctx_BND, ctx_mask_BN, cand_BCD, cand_mask_BC, self.context_positions(ctx_mask_BN),
            self.candidate_positions(cand_mask_BC))

  def forward(self, batch: RecsysBatch, embeddings: RecsysEmbeddings
              ) -> tuple[RecsysModelOutput, Diagnostics]:
    """Logits plus per-layer diagnostics (max |attention logit|, residual RMS)."""
    c = self.config
    self._check(batch, embeddings)
    if self._isolated_path:
      args = self._isolated_args(batch, embeddings)
      out = self.transformer.isolated(*args)
      return (self._head(out.embeddings[:, args[0].shape[1]:]),
              Diagnostics(out.max_abs_attn_logit, out.residual_rms))
    tokens_BTD, mask_BT, offset = self._inputs(batch, embeddings)
    positions = None
    if c.right_anchored_rope:
      positions = right_anchored_rope_positions(mask_BT, c.history_seq_len, 1)
    out: TransformerOutput = self.transformer(
        tokens_BTD, mask_BT, offset if c.candidate_isolation else None, positions)
    return (self._head(out.embeddings[:, offset:]),
            Diagnostics(out.max_abs_attn_logit, out.residual_rms))

  def __call__(self, batch: RecsysBatch, embeddings: RecsysEmbeddings) -> RecsysModelOutput:
    """The logits of `forward`, skipping what only the diagnostics need: the context's
    outputs in the last layer.

    On the isolated path the work runs in micro-batches of about `rows =
    config.effective_micro_batch_rows` token rows (None: one batch), one after another
    inside the compiled call (`lax.map`), which bounds the working set
    (`PhoenixModelConfig.micro_batch_rows`):

    * users in equal groups of at most `max(1, rows // (1 + S))` (their context rows);
    * within a group of `G` users, candidates in equal micro-batches of at most
      `max(1, rows // G)` per user: the context runs once (`encode_context`), then each
      micro-batch of candidates against its cache (`score_candidates`, input projection
      and head included), as HSTU's M-FALCON does. When a group's candidates fit one
      micro-batch, one pass runs context and candidates together
      (`Transformer.isolated_candidates`: one q|k|v, output and GeGLU matmul per layer
      over all tokens).

    Where the groups or micro-batches do not tile the users or candidates, the last one
    overlaps the one before (`_in_micro_batches`). Users never see one another and
    isolated candidates never see one another, so the micro-batches change no result
    beyond float rounding.
    """
    if not self._isolated_path:
      return self.forward(batch, embeddings)[0]
    B, C = self._check(batch, embeddings)
    # The optional fields the model does not read hold anything (`RecsysBatch`); the
    # micro-batches would slice them, so they go before.
    batch = batch.without_unread(self.config.optional_batch_fields)
    users = self.micro_batch_limits(B, C)[0]
    if users >= B:
      return self._score_users(batch, embeddings)
    return _in_micro_batches(
        lambda b, e, _: self._score_users(b, e), batch, embeddings, axis=0,
        fields=(RecsysBatch._fields, RecsysEmbeddings._fields), limit=users)

  def micro_batch_limits(self, batch_size: int, num_candidates: int) -> tuple[int, int]:
    """(users per group, candidates per micro-batch and user) of `__call__` for a batch of
    `batch_size` users with `num_candidates` candidates each; limits at least the batch
    and its candidates mean one group, one pass."""
    rows = self.config.effective_micro_batch_rows
    if rows is None:
      return batch_size, num_candidates
    users = min(batch_size, max(1, rows // (1 + self.config.history_seq_len)))
    group = -(-batch_size // -(-batch_size // users))       # the equal groups' size
    return users, max(1, rows // group)

  def _score_users(self, batch: RecsysBatch, embeddings: RecsysEmbeddings
                   ) -> RecsysModelOutput:
    """`__call__` for one group of users: their candidates in micro-batches, or in one
    pass with their context when they fit one."""
    B, C = batch.candidate_post_hashes.shape[:2]
    limit = self.micro_batch_limits(B, C)[1]
    if C <= limit:
      return self._head(self.transformer.isolated_candidates(
          *self._isolated_args(batch, embeddings)))
    cache = self.encode_context(batch, embeddings)
    return _in_micro_batches(
        lambda b, e, start: self.score_candidates(cache, b, e, start), batch, embeddings,
        axis=1, fields=(CANDIDATE_BATCH_FIELDS, CANDIDATE_EMBEDDING_FIELDS), limit=limit)


def _in_micro_batches(fn, batch: RecsysBatch, embeddings: RecsysEmbeddings, axis: int,
                      fields: tuple, limit: int) -> RecsysModelOutput:
  """`fn(batch, embeddings, start)` over `ceil(n / limit)` equal slices along `axis` (0:
  users, 1: candidates; `n` of them) of the named `fields` (the others pass whole), one
  after another (`lax.map`), its outputs joined along `axis`; `start` is the slice's
  first index. When the slices do not tile `n`, the last one starts early, at
  `n - size`, and only its new rows are kept: no input is copied or padded, and fewer
  than one row per slice is computed twice."""
  n = batch.candidate_post_hashes.shape[axis]
  count = -(-n // limit)
  size = -(-n // count)
  parts = [{f: getattr(tree, f) for f in names if getattr(tree, f) is not None}
           for tree, names in zip((batch, embeddings), fields)]

  def step(start):
    part = [{f: jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)
             for f, x in d.items()} for d in parts]
    return fn(batch._replace(**part[0]), embeddings._replace(**part[1]), start)

  outputs = jax.lax.map(step, jnp.minimum(jnp.arange(count) * size, n - size))
  overlap = count * size - n

  def joined(x):      # [count, ..., size (at axis), ...] -> [..., n, ...]
    last = jax.lax.slice_in_dim(x[-1], overlap, size, axis=axis)
    x = jnp.moveaxis(x[:-1], 0, axis)
    x = x.reshape(x.shape[:axis] + ((count - 1) * size,) + x.shape[axis + 2:])
    return jnp.concatenate([x, last], axis=axis)

  return jax.tree.map(joined, outputs)
