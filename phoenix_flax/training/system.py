"""Trainable systems: hash-embedding tables in front of the Phoenix models.

The release feeds its models pre-looked-up embeddings (`model(batch, embeddings)`); here
one trainable table per entity type (users, posts, authors) does that lookup, so a system
learns end to end while the wrapped model keeps the release's call signature. Row 0 of
every table is padding: hash 0 always looks up an exact zero vector and receives no
gradient.
"""

from __future__ import annotations

from typing import Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, PRNGKeyArray

from phoenix_flax.config import (PhoenixModelConfig, PhoenixRetrievalModelConfig, _count,
                                 _is_int)
from phoenix_flax.features import lookup_hash_embeddings
from phoenix_flax.inference import (_check_values, _field, check_left_aligned,
                                    validate_batch)
from phoenix_flax.ranking import Diagnostics, PhoenixModel
from phoenix_flax.retrieval import PhoenixRetrievalModel, RetrievalOutput
from phoenix_flax.training.loss import (first_positive_rows, in_batch_softmax_loss,
                                        sampling_log_q)
from phoenix_flax.types import RecsysBatch, RecsysEmbeddings, RecsysModelOutput


class HashEmbeddingTables(eqx.Module):
  """One `[buckets, D]` table per entity type; every hash function shares its type's table.

  `*_buckets` are integers >= 2 (row 0 is padding, zero and never trained), `emb_size`
  is D >= 1 and the rows are `N(0, init_scale**2)` float32 (`init_scale` finite, > 0); a
  bad value raises ValueError.
  """

  user_table: Array
  post_table: Array
  author_table: Array

  def __init__(self, user_buckets: int, post_buckets: int, author_buckets: int,
               emb_size: int, *, key: PRNGKeyArray, init_scale: float = 1.0):
    for name, n in (("user_buckets", user_buckets), ("post_buckets", post_buckets),
                    ("author_buckets", author_buckets)):
      if not _is_int(n) or n < 2:   # (NumPy integers accepted, as `hash_ids` takes them)
        raise ValueError(f"{name}={n!r}: a table needs row 0 (padding) plus at least one "
                         "bucket")
    emb_size = _count("emb_size", emb_size, 1)
    if (isinstance(init_scale, bool) or not isinstance(init_scale, (int, float, np.number))
        or not 0 < init_scale < np.inf):
      raise ValueError(f"init_scale={init_scale!r} must be a finite number > 0")
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
    given = [f for f in ("candidate_post_hashes", "candidate_author_hashes")
             if getattr(batch, f) is not None]
    if len(given) == 1:   # (the lookup of the None one failed with a TypeError)
      raise ValueError(f"batch.{given[0]} is given but the other candidate hash field is "
                       "None: set both (a batch with candidates) or neither (a user tower's)")
    if given:
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
    """Logits `[B, C, A]` of the batch's candidates (`forward` without diagnostics)."""
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

  def contrastive_loss(self, user_BD: Array, positive_BD: Array, has_B: Array,
                       positive_ids_B: Optional[Array], temperature: float,
                       log_q_B: Optional[Array] = None) -> Array:
    """`in_batch_softmax_loss` of each user against every user's positive, scored by the
    model (`PhoenixRetrievalModel.scores`)."""
    return in_batch_softmax_loss(self.model.scores(user_BD, positive_BD), has_B,
                                 temperature, positive_ids_B, log_q_B)

  def in_batch_loss(self, batch: RecsysBatch, labels_BCA: Array, mask_BC: Array,
                    post_ids_BC: Optional[Array], *, positive_action: int,
                    temperature: float, sampling_counts_KH: Optional[Array] = None
                    ) -> tuple[Array, Array, Diagnostics]:
    """The retrieval training loss of a batch: each user's first valid candidate whose label
    of `positive_action` is a positive (`first_positive`) is its positive and every other
    user's negative (`contrastive_loss`). `post_ids_BC` (optional; any integer per post,
    equal for the same post) keeps two users' shared positive from counting as a
    negative. `sampling_counts_KH` (optional; a count sketch that includes this batch's
    `positive_hashes`, from `update_sampling_counts`) turns on the logQ correction: each
    positive's `sampling_log_q` is its `log_q`. Only the B positives go through the
    candidate tower. Returns the loss, which users have a positive `[B]`, and the user tower's
    diagnostics."""
    user_BD, diag = self.user_forward(batch)
    at, has_B = first_positive_rows(labels_BCA, mask_BC, positive_action)
    hashes_BK = jnp.asarray(batch.candidate_post_hashes)[at]
    positive_BD = self.corpus_representation(hashes_BK,
                                             jnp.asarray(batch.candidate_author_hashes)[at])
    ids_B = None if post_ids_BC is None else jnp.asarray(post_ids_BC)[at]
    log_q_B = (None if sampling_counts_KH is None
               else sampling_log_q(sampling_counts_KH, hashes_BK))
    loss = self.contrastive_loss(user_BD, positive_BD, has_B, ids_B, temperature, log_q_B)
    return loss, has_B, diag

  @staticmethod
  def positive_hashes(batch: RecsysBatch, labels_BCA: Array, mask_BC: Array, *,
                      positive_action: int) -> tuple[Array, Array]:
    """The post hashes `[B, K]` of each user's positive (`in_batch_loss`'s choice), and
    which users have one `[B]`: what `update_sampling_counts` counts."""
    at, has_B = first_positive_rows(labels_BCA, mask_BC, positive_action)
    return jnp.asarray(batch.candidate_post_hashes)[at], has_B

  def __call__(self, batch: RecsysBatch, corpus_ND: Array, top_k: int,
               corpus_mask: Optional[Array] = None) -> RetrievalOutput:
    """Top-k corpus items per user by the model's `scores`."""
    return self.model.retrieve(self.user_representation(batch), corpus_ND, top_k,
                               corpus_mask)


def validate_training_batch(system: Union[RankingSystem, RetrievalSystem], batch: RecsysBatch,
                            labels_BCA: Optional[ArrayLike] = None,
                            mask_BC: Optional[ArrayLike] = None) -> tuple[int, int]:
  """Host-side checks of a training batch from your own data, before the jitted step;
  returns (B, C).

  Under `jit` nothing checks values: a raw id passed as a hash is clipped into the last
  row of its table, a padded candidate counted by the mask is trained as a negative, and
  labels in percent reach the loss. So this checks, raising ValueError with the field
  (and, for a bad value, the value and its index):
  - the batch against the model config (`phoenix_flax.validate_batch`: shapes, dtypes,
    ranges);
  - a left-aligned history (valid items first), whatever the positions (that they run
    oldest first, as the release orders them, is the caller's to ensure: nothing here
    can tell);
  - every hash against its table: below the table's rows (`pf.hash_ids` with that many
    buckets);
  - `labels_BCA` (optional): floats `[B, C, num_actions]`, finite, in [0, 1];
  - `mask_BC` (optional): booleans `[B, C]`, True exactly where the candidate's post hash
    is not 0 (padding hashed as a real item, or a real item left out, is an error).
  """
  B, C = validate_batch(system.model.config, batch)
  check_left_aligned(batch.history_post_hashes)
  rows = {"user": system.tables.user_table.shape[0], "post": system.tables.post_table.shape[0],
          "author": system.tables.author_table.shape[0]}
  for name, table in (("user_hashes", "user"), ("history_post_hashes", "post"),
                      ("history_author_hashes", "author"), ("candidate_post_hashes", "post"),
                      ("candidate_author_hashes", "author")):
    a = np.asarray(getattr(batch, name))
    _check_values(name, a, a >= rows[table],
                  f"hashes must be < {rows[table]}, the rows of the {table} table (hash raw "
                  f"ids with pf.hash_ids(ids, {rows[table]}, valid=...))")
  A = system.model.config.num_actions
  origins = (f"B={B} from batch.user_hashes", f"C={C} from batch.candidate_post_hashes")
  if labels_BCA is not None:
    _field("", "labels_BCA", labels_BCA, (B, C, A), f"B, C, num_actions={A}", "float",
           origins)
    labels = np.asarray(labels_BCA, np.float64)
    _check_values("labels_BCA", labels, ~((labels >= 0) & (labels <= 1)),
                  "labels must be finite and in [0, 1] (one per action: 1 = engaged)", "")
  if mask_BC is not None:
    _field("", "mask_BC", mask_BC, (B, C), "B, C", "any", origins)
    mask = np.asarray(mask_BC)
    if mask.dtype != bool:
      raise ValueError(f"mask_BC has dtype {mask.dtype}, expected bool")
    real = np.asarray(batch.candidate_post_hashes)[..., 0] != 0
    _check_values("mask_BC", mask, mask & ~real,
                  "the mask marks a padded candidate (post hash 0) as valid", "")
    _check_values("mask_BC", mask, ~mask & real,
                  "the mask leaves out a candidate whose post hash is not 0 (hash padded "
                  "slots with pf.hash_ids(..., valid=mask), so that they hash to 0)", "")
  return B, C
