"""Attention masks and RoPE positions of the recsys sequence [user | history | candidates]."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array

from phoenix_flax.config import _count


def causal_mask(seq_len: int, dtype=jnp.float32) -> Array:
  """Lower-triangular `[1, 1, T, T]` mask (1 = may attend)."""
  return jnp.tril(jnp.ones((1, 1, seq_len, seq_len), dtype=dtype))


def make_recsys_attn_mask(seq_len: int, candidate_start_offset: int, dtype=jnp.float32) -> Array:
  """Candidate-isolation mask `[1, 1, T, T]`.

  User + history (positions < offset) attend causally; each candidate attends to the
  whole user + history prefix and to itself, never to another candidate.
  """
  # (a float length would build a mask of another size, a negative one slice from the end)
  _count("seq_len", seq_len, 1)
  _count("candidate_start_offset", candidate_start_offset, 0)
  if not 0 <= candidate_start_offset <= seq_len:
    raise ValueError(f"candidate_start_offset={candidate_start_offset} must lie in "
                     f"[0, seq_len={seq_len}]")
  idx = jnp.arange(seq_len)
  row, col = idx[:, None], idx[None, :]
  is_candidate_pair = (row >= candidate_start_offset) & (col >= candidate_start_offset)
  allowed = jnp.where(is_candidate_pair, row == col, col <= row)
  return allowed.astype(dtype)[None, None]


def right_anchored_rope_positions(padding_mask: Array, history_seq_len: int,
                                  num_user_prefix_tokens: int = 1) -> Array:
  """Float32 positions `[B, T]` that anchor the newest history item at a fixed index.

  With `hs = P`, `he = P + S` and `n_b` valid history entries: prefix tokens keep their
  index, history index `i` maps to `he - n_b + (i - hs)`, every later token (the
  candidates) to `he`, and padded tokens to 0.
  """
  _count("history_seq_len", history_seq_len, 0)
  _count("num_user_prefix_tokens", num_user_prefix_tokens, 0)
  if padding_mask.ndim != 2:
    raise ValueError(f"padding_mask must be [B, T], got shape {padding_mask.shape}")
  T = padding_mask.shape[1]
  hs, he = num_user_prefix_tokens, num_user_prefix_tokens + history_seq_len
  if he > T:
    raise ValueError(f"num_user_prefix_tokens + history_seq_len = {he} exceeds T = {T}")
  valid = padding_mask.astype(bool)
  n_B1 = jnp.sum(valid[:, hs:he], axis=1, keepdims=True).astype(jnp.float32)
  idx_1T = jnp.arange(T, dtype=jnp.float32)[None, :]
  history_pos = he - n_B1 + (idx_1T - hs)
  pos = jnp.where(idx_1T < hs, idx_1T, jnp.where(idx_1T < he, history_pos, float(he)))
  return jnp.where(valid, pos, 0.0).astype(jnp.float32)
