"""Feature embeddings of the recsys tokens (actions, product surface, post age, dwell) and
the hashing helpers that turn raw ids into the hashes a `RecsysBatch` carries and look
those hashes up in embedding tables.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from phoenix_flax.config import POST_AGE_MAX_MINUTES, NormConfig, _beyond_int32, _count


def action_embedding(actions_BSA: Array, action_projection_AD: Array) -> Array:
  """Signed multi-hot actions `(2a - 1) @ W`, zeroed for rows without any action."""
  a = actions_BSA.astype(jnp.float32)
  emb = (2.0 * a - 1.0) @ action_projection_AD
  return emb * jnp.any(actions_BSA != 0, axis=-1, keepdims=True).astype(emb.dtype)


def single_hot_embedding(ids: Array, table_VD: Array) -> Array:
  """`one_hot(ids, V) @ table`: ids outside [0, V) give a zero vector, as released."""
  return jax.nn.one_hot(ids, table_VD.shape[0], dtype=table_VD.dtype) @ table_VD


def compute_post_age_bucket(impression_ts: Array, post_ts: Array,
                            granularity_mins: int = 60) -> Array:
  """Age bucket `minutes // g + 1`, clipped to `[0, 4800 // g + 1]`; 0 when a timestamp
  is missing (0) or the post is newer than the impression. int32, of the broadcast shape
  of the two timestamp arrays (integer seconds since the epoch, e.g. `[B, 1]` and
  `[B, C]`). Raises ValueError for float timestamps, concrete ones beyond int32
  (milliseconds) or a `granularity_mins` that is not an integer >= 1."""
  # (a negative one clipped every bucket to a negative id, which embeds as zeros)
  _count("granularity_mins", granularity_mins, 1)
  for name, ts in (("impression_ts", impression_ts), ("post_ts", post_ts)):
    # Without 64-bit mode JAX would wrap or clip an int64 value beyond int32 (milliseconds
    # since the epoch) with a warning: refused while the values are known.
    if not isinstance(ts, jax.core.Tracer):
      host = np.asarray(ts)
      if np.issubdtype(host.dtype, np.integer):
        beyond = _beyond_int32(host)
        if beyond.any():
          raise ValueError(f"{name} holds {host[beyond][0]}, beyond int32: timestamps are "
                           "seconds since the epoch (from milliseconds, divide by 1000)")
  impression_ts, post_ts = jnp.asarray(impression_ts), jnp.asarray(post_ts)
  for name, ts in (("impression_ts", impression_ts), ("post_ts", post_ts)):
    if not jnp.issubdtype(ts.dtype, jnp.integer):   # (float32 rounds epoch seconds to 128 s)
      raise ValueError(f"{name} must hold integer seconds since the epoch, got dtype "
                       f"{ts.dtype}")
  minutes = (impression_ts - post_ts) // 60
  top = POST_AGE_MAX_MINUTES // granularity_mins + 1
  bucket = jnp.clip(minutes // granularity_mins + 1, 0, top)
  # A newer post, found by comparing (`minutes < 0` in signed integers): unsigned ones
  # wrap on the subtraction, and a post 10 minutes newer got the oldest bucket.
  missing = (post_ts > impression_ts) | (impression_ts == 0) | (post_ts == 0)
  return jnp.where(missing, 0, bucket).astype(jnp.int32)


def normalize_continuous_value(value: Array, config: NormConfig) -> Array:
  """`clip(v, 0, s) / s`, or `log1p(clip(v, 0, s)) / log1p(s)` with `use_log`."""
  if not isinstance(config, NormConfig):
    raise TypeError(f"config must be a NormConfig, got {type(config).__name__}")
  value = jnp.asarray(value)
  if not (jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.floating)):
    raise ValueError(f"value must hold real numbers (integers or floats), got dtype "
                     f"{value.dtype}")
  s = config.norm_scale
  clipped = jnp.clip(value.astype(jnp.float32), 0.0, s)
  if config.use_log:
    return jnp.log1p(clipped) / jnp.log1p(s)
  return clipped / s


def dwell_time_embedding(dwell_BS: Array, config: NormConfig, w1_1H: Array, w2_HD: Array
                         ) -> Array:
  """`gelu(normalize(dwell)[..., None] @ W1) @ W2` -> `[B, S, D]`."""
  x = normalize_continuous_value(dwell_BS, config)[..., None]
  return jax.nn.gelu(x @ w1_1H) @ w2_HD


# One seed per hash function: the five 32-bit primes of xxHash32.
_HASH_SEEDS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1)


def _mix32(x: Array) -> Array:
  """The murmur3 32-bit finaliser: a bijection of uint32 that spreads every input bit."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def hash_ids(ids: Array, num_buckets: int, num_hashes: int = 2,
             valid: Array | None = None) -> Array:
  """Hashes of integer ids `[...]` -> int32 `[..., num_hashes]` in `[1, num_buckets)`.

  Hash function k mixes the id with its own seed, so two ids that collide under one
  function rarely collide under the other (the point of several hashes per entity). 0 is
  never produced for a valid id: it marks padding, where `valid` (bool, the ids' shape)
  is False. Deterministic, and a function of each id's integer value alone, whatever
  its dtype and whether `jax_enable_x64` is on: an id outside the int32 range (a 64-bit
  id) mixes its high half, seeded per hash function, into its low half first (split on
  the host for numpy ids), so two 64-bit ids share all their hashes about as rarely as
  two int32 ids do. Strings have no hash here: map them to integers with a stable hash
  first (hashlib, not Python's `hash()`, which changes every process).
  """
  is_int = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
  if not is_int(num_hashes) or not 1 <= num_hashes <= len(_HASH_SEEDS):
    raise ValueError(f"num_hashes must be an int in [1, {len(_HASH_SEEDS)}], got "
                     f"{num_hashes!r}")
  if not is_int(num_buckets) or not 2 <= num_buckets <= np.iinfo(np.int32).max:
    raise ValueError(f"num_buckets must be an int in [2, 2**31 - 1] (bucket 0 is padding), "
                     f"got {num_buckets!r}")
  if not isinstance(ids, jax.Array):
    ids = np.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"ids must hold integers, got dtype {ids.dtype}")
  if valid is not None and tuple(np.shape(valid)) != ids.shape:
    raise ValueError(f"valid has shape {tuple(np.shape(valid))}, the ids {ids.shape}")
  unsigned = jnp.issubdtype(ids.dtype, jnp.unsignedinteger)
  high = outside = None
  if ids.dtype.itemsize == 8 or (unsigned and ids.dtype.itemsize == 4):
    # An id outside int32 mixes its high half, seeded per hash function, into its low
    # half, so that two such ids share every hash as rarely as two int32 ids do; an id
    # inside hashes as the same int32 would. The halves are split on the host for numpy
    # ids (jax without x64 would drop the high one).
    xp = jnp if isinstance(ids, jax.Array) else np
    outside = ids > np.iinfo(np.int32).max
    if not unsigned:
      outside = outside | (ids < np.iinfo(np.int32).min)
    high = (ids >> 32).astype(xp.uint32) if ids.dtype.itemsize == 8 else xp.zeros(
        ids.shape, xp.uint32)
  return _hash_halves(ids.astype(jnp.uint32) if isinstance(ids, jax.Array)
                      else ids.astype(np.uint32), high, outside,
                      None if valid is None else jnp.asarray(valid, bool),
                      int(num_buckets), int(num_hashes))


@functools.partial(jax.jit, static_argnums=(4, 5))
def _hash_halves(low: Array, high: Array | None, outside: Array | None,
                 valid: Array | None, num_buckets: int, num_hashes: int) -> Array:
  """`hash_ids` of ids split into uint32 halves, as one program per shape (eagerly, its
  dozen elementwise operations dispatched one by one cost more than the hashing)."""
  seeds = jax.lax.broadcast_to_rank(jnp.asarray(_HASH_SEEDS[:num_hashes], jnp.uint32),
                                    low.ndim + 1)
  x = low[..., None]
  if high is not None:
    x = jnp.where(outside[..., None], x ^ _mix32(high[..., None] ^ _mix32(seeds)), x)
  mixed = _mix32(_mix32(x ^ seeds) + seeds)
  hashes = (1 + mixed % jnp.uint32(num_buckets - 1)).astype(jnp.int32)
  if valid is not None:
    hashes = jnp.where(valid[..., None], hashes, 0)
  return hashes


def lookup_hash_embeddings(table_ND: Array, hashes: Array) -> Array:
  """`table[hashes]` `[..., D]`, with hash 0 (padding) giving zeros and no gradient to row 0.

  Hashes outside `[0, num_buckets)` are an error when they are concrete (an eager call);
  traced ones (under `jit`, `vmap` or `grad`) cannot be checked and are clipped to the
  table: one too large reads the last row, a negative one row 0, unmasked (its gradient
  reaches row 0). Validate them before (the synthetic world draws them in range)."""
  if not isinstance(hashes, jax.Array):   # a Python int or list, as hash_ids takes
    hashes = np.asarray(hashes)
  if jnp.ndim(table_ND) != 2:   # a [N] table broadcast its rows against the padding mask
    raise ValueError(f"table must be [num_buckets, D], got shape {jnp.shape(table_ND)}")
  if not jnp.issubdtype(jnp.result_type(hashes), jnp.integer):
    raise ValueError(f"hashes must hold integers, got dtype {jnp.result_type(hashes)}")
  if not isinstance(hashes, jax.core.Tracer):
    # Clipping would give hash >= num_buckets the last row and a negative one row 0,
    # which, unlike hash 0, is not masked: a wrong embedding with no error.
    host = np.asarray(hashes)
    n = jnp.shape(table_ND)[0]
    bad = (host < 0) | (host >= n)
    if bad.any():
      where = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"hash {host[where]} at index {where} is outside the table's "
                       f"[0, {n}) buckets")
  emb = jnp.take(table_ND, hashes, axis=0, mode="clip")
  # A select, not a product with the mask: whatever row 0 holds (inf or NaN included),
  # padding reads zeros and sends row 0 no gradient.
  return jnp.where((hashes != 0)[..., None], emb, jnp.zeros((), emb.dtype))
