"""Random but valid example inputs for demos and tests (the release's example batch)."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from phoenix_flax.config import PhoenixModelConfig, PhoenixRetrievalModelConfig, _count
from phoenix_flax.types import RecsysBatch, RecsysEmbeddings

NUM_HASH_BUCKETS = 100_000
ACTION_RATE = 0.3
IMPRESSION_TIMESTAMP = 1_700_000_000
MAX_POST_AGE_SECONDS = 4 * 24 * 3600
MAX_DWELL_SECONDS = 60.0

Config = Union[PhoenixModelConfig, PhoenixRetrievalModelConfig]


def _rng(key: PRNGKeyArray) -> np.random.Generator:
  """A NumPy generator seeded by a JAX key: example data is drawn on the host, where it
  costs no compilation."""
  key = jnp.asarray(key)
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  return np.random.default_rng(np.asarray(key, np.uint32).ravel().tolist())


def _history_lengths(history_lengths, batch_size: int, S: int,
                     rng: np.random.Generator) -> np.ndarray:
  if history_lengths is None:
    return rng.integers(S // 2, S + 1, batch_size)
  lengths = np.asarray(history_lengths)
  if lengths.shape != (batch_size,) or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(f"history_lengths={lengths.tolist()} must be {batch_size} integers")
  if ((lengths < 0) | (lengths > S)).any():
    raise ValueError(f"history_lengths={lengths.tolist()} must lie in [0, {S}]")
  return lengths


def example_batch(config: Config, batch_size: int, key: PRNGKeyArray, *,
                  num_candidates: Optional[int] = None,
                  history_lengths: Optional[Sequence[int]] = None,
                  ) -> tuple[RecsysBatch, RecsysEmbeddings]:
  """A random valid batch and its float32 embeddings for a ranking or retrieval config.

  History is left-aligned (valid items first, hash-0 padding after); its valid length is
  `history_lengths[b]`, or drawn from `[S // 2, S]`. Every candidate is valid; there are
  `num_candidates` of them (default `config.candidate_seq_len`). Timestamps and dwell
  times are filled when the config's post-age or dwell-time feature needs them. Hashes,
  surfaces, actions and timestamps are int32; the same key gives the same batch.
  `batch_size` and `num_candidates` are integers >= 1 (NumPy integers too); raises
  TypeError for another config type and ValueError for a bad size or `history_lengths`.
  """
  if not isinstance(config, (PhoenixModelConfig, PhoenixRetrievalModelConfig)):
    raise TypeError("config must be a PhoenixModelConfig or PhoenixRetrievalModelConfig, "
                    f"got {type(config).__name__}")
  # (NumPy integers accepted, bools refused, as by the other public functions)
  C = (config.candidate_seq_len if num_candidates is None
       else _count("num_candidates", num_candidates, 1))
  batch_size = _count("batch_size", batch_size, 1)
  rng = _rng(key)
  hc, B, S, D = config.hash_config, batch_size, config.history_seq_len, config.emb_size
  U, I, Au, A = hc.num_user_hashes, hc.num_item_hashes, hc.num_author_hashes, config.num_actions
  V = config.product_surface_vocab_size
  hashes = lambda *shape: rng.integers(1, NUM_HASH_BUCKETS, shape)
  lengths_B = _history_lengths(history_lengths, B, S, rng)
  valid_BS = np.arange(S)[None, :] < lengths_B[:, None]
  keep = lambda x: np.where(valid_BS.reshape(valid_BS.shape + (1,) * (x.ndim - 2)), x, 0)

  fields = dict(
      user_hashes=hashes(B, U),
      history_post_hashes=keep(hashes(B, S, I)),
      history_author_hashes=keep(hashes(B, S, Au)),
      history_actions=keep(rng.random((B, S, A)) < ACTION_RATE),
      history_product_surface=rng.integers(0, V, (B, S)),
      candidate_post_hashes=hashes(B, C, I),
      candidate_author_hashes=hashes(B, C, Au),
      candidate_product_surface=rng.integers(0, V, (B, C)))
  if "impression_timestamps" in config.optional_batch_fields:
    fields["impression_timestamps"] = np.full((B,), IMPRESSION_TIMESTAMP)
    fields["candidate_post_timestamps"] = (
        IMPRESSION_TIMESTAMP - rng.integers(0, MAX_POST_AGE_SECONDS, (B, C)))
  batch = RecsysBatch(**{f: jnp.asarray(x, jnp.int32) for f, x in fields.items()})
  if "history_dwell_times" in config.optional_batch_fields:
    dwell_BS = keep(rng.uniform(0.0, MAX_DWELL_SECONDS, (B, S)))
    batch = batch._replace(history_dwell_times=jnp.asarray(dwell_BS, jnp.float32))

  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  embeddings = RecsysEmbeddings(
      user_embeddings=normal(B, U, D),
      history_post_embeddings=normal(B, S, I, D),
      candidate_post_embeddings=normal(B, C, I, D),
      history_author_embeddings=normal(B, S, Au, D),
      candidate_author_embeddings=normal(B, C, Au, D))
  return batch, embeddings


def example_corpus(num_items: int, emb_size: int, key: PRNGKeyArray) -> tuple[Array, Array]:
  """Unit-norm corpus embeddings `[N, D]` and distinct, shuffled int32 post ids `[N]`
  (`N = num_items`, `D = emb_size`, integers >= 1, else ValueError). The ids are
  `NUM_HASH_BUCKETS` plus a permutation of `0..N-1`: none is a row index, so code that
  returns rows where it should return ids does not pass by accident."""
  num_items, emb_size = _count("num_items", num_items, 1), _count("emb_size", emb_size, 1)
  rng = _rng(key)
  emb_ND = rng.standard_normal((num_items, emb_size), np.float32)
  emb_ND /= np.linalg.norm(emb_ND, axis=-1, keepdims=True)
  post_ids_N = NUM_HASH_BUCKETS + rng.permutation(num_items)
  return jnp.asarray(emb_ND), jnp.asarray(post_ids_N, jnp.int32)
