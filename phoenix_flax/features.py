"""Feature embeddings of the recsys tokens: actions, product surface, post age, dwell."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array

from phoenix_flax.config import POST_AGE_MAX_MINUTES, NormConfig


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
  is missing (0) or the post is newer than the impression. int32."""
  impression_ts, post_ts = jnp.asarray(impression_ts), jnp.asarray(post_ts)
  minutes = (impression_ts - post_ts) // 60
  top = POST_AGE_MAX_MINUTES // granularity_mins + 1
  bucket = jnp.clip(minutes // granularity_mins + 1, 0, top)
  missing = (minutes < 0) | (impression_ts == 0) | (post_ts == 0)
  return jnp.where(missing, 0, bucket).astype(jnp.int32)


def normalize_continuous_value(value: Array, config: NormConfig) -> Array:
  """`clip(v, 0, s) / s`, or `log1p(clip(v, 0, s)) / log1p(s)` with `use_log`."""
  s = config.norm_scale
  clipped = jnp.clip(jnp.asarray(value, jnp.float32), 0.0, s)
  if config.use_log:
    return jnp.log1p(clipped) / jnp.log1p(s)
  return clipped / s


def dwell_time_embedding(dwell_BS: Array, config: NormConfig, w1_1H: Array, w2_HD: Array
                         ) -> Array:
  """`gelu(normalize(dwell)[..., None] @ W1) @ W2` -> `[B, S, D]`."""
  x = normalize_continuous_value(dwell_BS, config)[..., None]
  return jax.nn.gelu(x @ w1_1H) @ w2_HD
