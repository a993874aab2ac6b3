"""Trainable systems: hash-embedding tables in front of the Phoenix models.

The release feeds its models pre-looked-up embeddings (`model(batch, embeddings)`); here
one trainable table per entity type (users, posts, authors) does that lookup, so a system
learns end to end while the wrapped model keeps the release's call signature. Row 0 of
every table is padding: hash 0 always looks up an exact zero vector and receives no
gradient.
"""

from __future__ import annotations

from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from phoenix_flax.config import PhoenixModelConfig, PhoenixRetrievalModelConfig
from phoenix_flax.features import lookup_hash_embeddings
from phoenix_flax.ranking import Diagnostics, PhoenixModel
from phoenix_flax.retrieval import PhoenixRetrievalModel, RetrievalOutput
from phoenix_flax.types import RecsysBatch, RecsysEmbeddings, RecsysModelOutput


class HashEmbeddingTables(eqx.Module):
  """One `[buckets, D]` table per entity type; every hash function shares its type's table."""

  user_table: Array
  post_table: Array
  author_table: Array

  def __init__(self, user_buckets: int, post_buckets: int, author_buckets: int,
               emb_size: int, *, key: PRNGKeyArray, init_scale: float = 1.0):
    for name, n in (("user_buckets", user_buckets), ("post_buckets", post_buckets),
                    ("author_buckets", author_buckets)):
      if not isinstance(n, int) or n < 2:
        raise ValueError(f"{name}={n!r}: a table needs row 0 (padding) plus at least one "
                         "bucket")
    if not init_scale > 0:
      raise ValueError(f"init_scale={init_scale!r} must be > 0")
    ku, kp, ka = jax.random.split(key, 3)
    make = lambda k, n: init_scale * jax.random.normal(k, (n, emb_size), jnp.float32)
    self.user_table = make(ku, user_buckets).at[0].set(0.0)
    self.post_table = make(kp, post_buckets).at[0].set(0.0)
    self.author_table = make(ka, author_buckets).at[0].set(0.0)

  def post_embeddings(self, post_hashes: Array, author_hashes: Array) -> tuple[Array, Array]:
    """Post `[..., I, D]` and author `[..., Au, D]` embeddings of candidate-like items."""
    return (lookup_hash_embeddings(self.post_table, post_hashes),
            lookup_hash_embeddings(self.author_table, author_hashes))

  def __call__(self, batch: RecsysBatch) -> RecsysEmbeddings:
    """Looks up every hash of a batch (the release's `RecsysEmbeddings`); a batch without
    candidates (their hash fields None, as a user tower reads it) gets None for theirs."""
    hist_post, hist_author = self.post_embeddings(batch.history_post_hashes,
                                                  batch.history_author_hashes)
    cand_post = cand_author = None
    if batch.candidate_post_hashes is not None or batch.candidate_author_hashes is not None:
      cand_post, cand_author = self.post_embeddings(batch.candidate_post_hashes,
                                                    batch.candidate_author_hashes)
    return RecsysEmbeddings(
        user_embeddings=lookup_hash_embeddings(self.user_table, batch.user_hashes),
        history_post_embeddings=hist_post,
        candidate_post_embeddings=cand_post,
        history_author_embeddings=hist_author,
        candidate_author_embeddings=cand_author)


class RankingSystem(eqx.Module):
  """Hash tables + `PhoenixModel`: `system(batch) -> logits [B, C, A]`."""

  tables: HashEmbeddingTables
  model: PhoenixModel

  def __init__(self, config: PhoenixModelConfig, user_buckets: int, post_buckets: int,
               author_buckets: int, *, key: PRNGKeyArray, init_scale: float = 1.0):
    kt, km = jax.random.split(key)
    self.tables = HashEmbeddingTables(user_buckets, post_buckets, author_buckets,
                                      config.emb_size, key=kt, init_scale=init_scale)
    self.model = PhoenixModel(config, key=km)

  def forward(self, batch: RecsysBatch) -> tuple[RecsysModelOutput, Diagnostics]:
    """Model output and per-layer diagnostics (max |attention logit|, residual RMS)."""
    return self.model.forward(batch, self.tables(batch))

  def __call__(self, batch: RecsysBatch) -> Array:
    return self.forward(batch)[0].logits


class RetrievalSystem(eqx.Module):
  """Hash tables + `PhoenixRetrievalModel` (user tower and candidate tower)."""

  tables: HashEmbeddingTables
  model: PhoenixRetrievalModel

  def __init__(self, config: PhoenixRetrievalModelConfig, user_buckets: int,
               post_buckets: int, author_buckets: int, *, key: PRNGKeyArray,
               init_scale: float = 1.0):
    kt, km = jax.random.split(key)
    self.tables = HashEmbeddingTables(user_buckets, post_buckets, author_buckets,
                                      config.emb_size, key=kt, init_scale=init_scale)
    self.model = PhoenixRetrievalModel(config, key=km)

  def user_representation(self, batch: RecsysBatch) -> Array:
    """Unit-norm user vectors `[B, D]` from the causal user tower."""
    return self.user_forward(batch)[0]

  def user_forward(self, batch: RecsysBatch) -> tuple[Array, Diagnostics]:
    """Unit-norm user vectors `[B, D]` and the user tower's per-layer diagnostics."""
    user_BD, _, diag = self.model.user_forward(batch, self.tables(batch))
    return user_BD, diag

  def candidate_representation(self, batch: RecsysBatch) -> tuple[Array, Array]:
    """Unit-norm candidate vectors `[B, C, D]` and the candidate padding mask `[B, C]`."""
    return self.model.build_candidate_representation(batch, self.tables(batch))

  def corpus_representation(self, post_hashes_NI: Array, author_hashes_NA: Array) -> Array:
    """Unit-norm vectors `[N, D]` of a corpus given its post and author hashes."""
    post, author = self.tables.post_embeddings(post_hashes_NI, author_hashes_NA)
    return self.model.candidate_tower(jnp.concatenate([post, author], axis=-2)[None])[0]

  def __call__(self, batch: RecsysBatch, corpus_ND: Array, top_k: int,
               corpus_mask_N: Optional[Array] = None) -> RetrievalOutput:
    """Top-k corpus items per user by the model's `scores`."""
    return self.model.retrieve(self.user_representation(batch), corpus_ND, top_k,
                               corpus_mask_N)
