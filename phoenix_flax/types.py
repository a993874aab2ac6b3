"""Data containers (pytrees that pass through `jit`) and their shape checks.

Field names and order follow the release, so positional construction from release code
works; later-release optional fields come after, defaulting to None.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import chex
from jaxtyping import Array


class RecsysBatch(NamedTuple):
  """Hashed ids and features. Hash 0 is padding; actions are 0/1. History is left-aligned:
  the valid items first, oldest first (the newest at index length - 1), then padding
  (a history item is padding where its first post hash is 0); candidates are in list
  order, padded ones after the valid ones (docs/models.md, "Inputs").

  The optional later-release fields count only when the model's config reads them:
  timestamps with `post_age_granularity_mins`, dwell times with `dwell_time_norm`
  (`config.optional_batch_fields` names them).
  Otherwise they are ignored (as by the release), whatever they hold: neither the model
  nor the runners check them.
  """

  user_hashes: Array                # [B, U] int
  history_post_hashes: Array        # [B, S, I] int
  history_author_hashes: Array      # [B, S, Au] int
  history_actions: Array            # [B, S, A] 0/1
  history_product_surface: Array    # [B, S] int in [0, V)
  candidate_post_hashes: Array      # [B, C, I] int
  candidate_author_hashes: Array    # [B, C, Au] int
  candidate_product_surface: Array  # [B, C] int in [0, V)
  impression_timestamps: Optional[Array] = None      # [B] seconds (0 = missing)
  candidate_post_timestamps: Optional[Array] = None  # [B, C] seconds (0 = missing)
  history_dwell_times: Optional[Array] = None        # [B, S] seconds

  def without_unread(self, optional_fields) -> "RecsysBatch":
    """This batch with the optional fields not in `optional_fields` (a config's
    `optional_batch_fields`) set to None, so nothing they hold reaches a program."""
    return self._replace(**{name: None for name in self._field_defaults
                            if name not in optional_fields})


class RecsysEmbeddings(NamedTuple):
  """Hash embeddings looked up outside the model (release call signature)."""

  user_embeddings: Array            # [B, U, D]
  history_post_embeddings: Array    # [B, S, I, D]
  candidate_post_embeddings: Array  # [B, C, I, D]
  history_author_embeddings: Array  # [B, S, Au, D]
  candidate_author_embeddings: Array  # [B, C, Au, D]


# The per-candidate fields (axis 1 is the candidate axis), by their `candidate_` prefix:
# what chunked scoring slices, score consistency mixes and context-only programs drop.
CANDIDATE_BATCH_FIELDS = tuple(f for f in RecsysBatch._fields if f.startswith("candidate_"))
CANDIDATE_EMBEDDING_FIELDS = tuple(f for f in RecsysEmbeddings._fields
                                   if f.startswith("candidate_"))


class RecsysModelOutput(NamedTuple):
  """The ranking model's output: `logits` `[B, C, A]` per candidate and action (sigmoid
  for probabilities; float32, the head's dtype, whatever `fprop_dtype` says) and, when
  `num_continuous_actions` K > 0, `continuous` `[B, C, K]` in (0, 1) (else None)."""

  logits: Array                     # [B, C, A]
  continuous: Optional[Array] = None  # [B, C, K] in (0, 1), when the head is enabled


class RetrievalOutput(NamedTuple):
  """The retrieval model's output: unit-norm `user_representation` `[B, D]` (zero for a
  row with no valid token, whose items all score 0 and whose top k are the corpus's first
  rows), and per user the `top_k_indices` `[B, K]` (int32 rows of the corpus) with their
  `top_k_scores` `[B, K]` (dot products, best first; a masked item scores -1e12)."""

  user_representation: Array        # [B, D], unit norm (zero for a padding row)
  top_k_indices: Array              # [B, K] int32 in [0, N)
  top_k_scores: Array               # [B, K], sorted descending


def _check(x, shape, name: str, kind: str, required_by: str = "") -> None:
  if x is None:
    raise ValueError(f"{name} is required" + (f": {required_by} is set" if required_by
                                              else " but is None"))
  chex.assert_shape(x, shape, custom_message=f"field {name}")
  if kind == "int":
    chex.assert_type(x, int, custom_message=f"field {name} must hold integers")
  elif kind == "float":
    chex.assert_type(x, float, custom_message=f"field {name} must hold floats")


def _require(batch: RecsysBatch) -> None:
  if not isinstance(batch, RecsysBatch):
    raise TypeError(f"batch must be a RecsysBatch, got {type(batch).__name__}")


def check_batch(batch: RecsysBatch, hash_config, history_len: int, num_actions: int,
                with_candidates: bool = True, *,
                optional_fields: frozenset[str] = frozenset()) -> tuple[int, int]:
  """Checks ranks, shapes and dtypes of a batch; returns (B, C) (C = 0 without candidates).

  The optional fields are checked, and required, only when the model reads them
  (`optional_fields`, its config's `optional_batch_fields`); otherwise they are ignored.
  """
  _require(batch)
  chex.assert_rank(batch.user_hashes, 2, custom_message="field user_hashes must be [B, U]")
  B = batch.user_hashes.shape[0]
  if B == 0:
    raise ValueError("field user_hashes holds no users (B = 0)")
  S, I, Au = history_len, hash_config.num_item_hashes, hash_config.num_author_hashes
  _check(batch.user_hashes, (B, hash_config.num_user_hashes), "user_hashes", "int")
  _check(batch.history_post_hashes, (B, S, I), "history_post_hashes", "int")
  _check(batch.history_author_hashes, (B, S, Au), "history_author_hashes", "int")
  chex.assert_rank(batch.history_actions, 3, custom_message="field history_actions")
  if batch.history_actions.shape[-1] != num_actions:
    raise ValueError(f"history_actions has {batch.history_actions.shape[-1]} actions, "
                     f"config.num_actions={num_actions}")
  _check(batch.history_actions, (B, S, num_actions), "history_actions", "any")
  _check(batch.history_product_surface, (B, S), "history_product_surface", "int")
  if "history_dwell_times" in optional_fields:
    _check(batch.history_dwell_times, (B, S), "history_dwell_times", "any", "dwell_time_norm")
  if not with_candidates:
    return B, 0
  return check_candidate_fields(batch, hash_config, B, optional_fields=optional_fields)


def check_candidate_fields(batch: RecsysBatch, hash_config, batch_size: Optional[int] = None,
                           *, optional_fields: frozenset[str] = frozenset()
                           ) -> tuple[int, int]:
  """Checks the candidate fields of a batch (of `batch_size` users when given); returns
  (B, C)."""
  _require(batch)
  I, Au = hash_config.num_item_hashes, hash_config.num_author_hashes
  chex.assert_rank(batch.candidate_post_hashes, 3,
                   custom_message="field candidate_post_hashes must be [B, C, I]")
  B = batch.candidate_post_hashes.shape[0] if batch_size is None else batch_size
  C = batch.candidate_post_hashes.shape[1]
  if C == 0:
    raise ValueError("field candidate_post_hashes holds no candidates (C = 0)")
  _check(batch.candidate_post_hashes, (B, C, I), "candidate_post_hashes", "int")
  _check(batch.candidate_author_hashes, (B, C, Au), "candidate_author_hashes", "int")
  _check(batch.candidate_product_surface, (B, C), "candidate_product_surface", "int")
  if "candidate_post_timestamps" in optional_fields:
    _check(batch.impression_timestamps, (B,), "impression_timestamps", "int",
           "post_age_granularity_mins")
    _check(batch.candidate_post_timestamps, (B, C), "candidate_post_timestamps", "int",
           "post_age_granularity_mins")
  return B, C


def check_embeddings(emb: RecsysEmbeddings, hash_config, B: int, S: int, C: int, D: int,
                     with_candidates: bool = True) -> None:
  """Checks that every embedding matches the batch's shape and is floating point."""
  _require_embeddings(emb)
  I, Au = hash_config.num_item_hashes, hash_config.num_author_hashes
  _check(emb.user_embeddings, (B, hash_config.num_user_hashes, D), "user_embeddings", "float")
  _check(emb.history_post_embeddings, (B, S, I, D), "history_post_embeddings", "float")
  _check(emb.history_author_embeddings, (B, S, Au, D), "history_author_embeddings", "float")
  if with_candidates:
    check_candidate_embeddings(emb, hash_config, B, C, D)


def check_candidate_embeddings(emb: RecsysEmbeddings, hash_config, B: int, C: int,
                               D: int) -> None:
  """Checks the candidate embeddings: `[B, C, hashes, D]` floats."""
  _require_embeddings(emb)
  I, Au = hash_config.num_item_hashes, hash_config.num_author_hashes
  _check(emb.candidate_post_embeddings, (B, C, I, D), "candidate_post_embeddings", "float")
  _check(emb.candidate_author_embeddings, (B, C, Au, D), "candidate_author_embeddings",
         "float")


def _require_embeddings(emb: RecsysEmbeddings) -> None:
  if not isinstance(emb, RecsysEmbeddings):
    raise TypeError(f"embeddings must be RecsysEmbeddings, got {type(emb).__name__}")
