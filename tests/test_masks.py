"""Recsys attention mask and right-anchored RoPE positions (seed suite + hand examples)."""

import jax.numpy as jnp
import numpy as np
import pytest

import phoenix_flax as pf
from phoenix_flax.masks import causal_mask


def test_mask_shape():
  assert pf.make_recsys_attn_mask(10, 5).shape == (1, 1, 10, 10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_mask_dtype(dtype):
  assert pf.make_recsys_attn_mask(5, 3, dtype=dtype).dtype == dtype
  assert causal_mask(5, dtype=dtype).dtype == dtype


def test_context_block_is_causal():
  m = np.asarray(pf.make_recsys_attn_mask(8, 5)[0, 0])
  np.testing.assert_array_equal(m[:5, :5], np.tril(np.ones((5, 5))))
  np.testing.assert_array_equal(m[:5, 5:], 0)


def test_candidates_see_whole_context():
  m = np.asarray(pf.make_recsys_attn_mask(8, 5)[0, 0])
  np.testing.assert_array_equal(m[5:, :5], 1)


def test_candidate_block_is_self_only():
  m = np.asarray(pf.make_recsys_attn_mask(8, 5)[0, 0])
  np.testing.assert_array_equal(m[5:, 5:], np.eye(3))


@pytest.mark.parametrize("seq_len, offset, expected", [
    (6, 3, [[1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 1, 0],
            [1, 1, 1, 0, 0, 1]]),
    (4, 3, [[1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1]]),
    (4, 1, [[1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 0, 1, 0],
            [1, 0, 0, 1]]),
])
def test_expected_matrices(seq_len, offset, expected):
  m = pf.make_recsys_attn_mask(seq_len, offset)
  np.testing.assert_array_equal(np.asarray(m[0, 0]), np.asarray(expected, np.float32))


def test_offset_equal_to_length_is_causal():
  np.testing.assert_array_equal(pf.make_recsys_attn_mask(5, 5), causal_mask(5))


def test_offset_zero_isolates_every_token():
  """Offset 0 (no context, every token a candidate) is valid: each token sees itself only."""
  np.testing.assert_array_equal(pf.make_recsys_attn_mask(4, 0)[0, 0], np.eye(4))


def test_offset_out_of_range_raises():
  with pytest.raises(ValueError, match="candidate_start_offset"):
    pf.make_recsys_attn_mask(4, 5)


def test_positions_shape_and_dtype():
  pos = pf.right_anchored_rope_positions(jnp.ones((2, 10), bool), history_seq_len=6,
                                         num_user_prefix_tokens=1)
  assert pos.shape == (2, 10)
  assert pos.dtype == jnp.float32


def test_prefix_positions_preserved():
  pos = pf.right_anchored_rope_positions(jnp.ones((1, 10), bool), history_seq_len=6,
                                         num_user_prefix_tokens=2)
  np.testing.assert_array_equal(pos[0, :2], [0.0, 1.0])


def test_candidates_share_history_end():
  pos = pf.right_anchored_rope_positions(jnp.ones((1, 8), bool), history_seq_len=4,
                                         num_user_prefix_tokens=1)
  np.testing.assert_array_equal(pos[0], [0, 1, 2, 3, 4, 5, 5, 5])


def test_padding_gets_zero():
  mask = jnp.array([[True, True, True, True, False, False, False, False]])
  pos = pf.right_anchored_rope_positions(mask, history_seq_len=4, num_user_prefix_tokens=1)
  np.testing.assert_array_equal(pos[0, 4:], 0.0)


def test_partial_history_hand_computed():
  # [user | h0 h1 h2 h3 | c0 c1], two valid history items, c1 padded: hs=1, he=5, n=2.
  mask = jnp.array([[1, 1, 1, 0, 0, 1, 0],
                    [1, 0, 0, 0, 0, 1, 1],
                    [0, 1, 1, 1, 1, 1, 1]], bool)
  pos = pf.right_anchored_rope_positions(mask, history_seq_len=4, num_user_prefix_tokens=1)
  np.testing.assert_array_equal(pos, [[0, 3, 4, 0, 0, 5, 0],
                                      [0, 0, 0, 0, 0, 5, 5],
                                      [0, 1, 2, 3, 4, 5, 5]])


def test_integer_padding_mask_counts_each_valid_slot_once():
  """A 0/1 mask given as integers (any nonzero value marks a valid token) gives the same
  positions as the bool mask: a valid history slot counts once whatever its value."""
  bools = jnp.array([[1, 1, 1, 0, 0, 1, 0],
                     [1, 0, 0, 0, 0, 1, 1]], bool)
  ints = jnp.array([[1, 2, 7, 0, 0, 1, 0],
                    [3, 0, 0, 0, 0, 1, 5]], jnp.int32)
  want = pf.right_anchored_rope_positions(bools, history_seq_len=4, num_user_prefix_tokens=1)
  got = pf.right_anchored_rope_positions(ints, history_seq_len=4, num_user_prefix_tokens=1)
  np.testing.assert_array_equal(got, want)


def test_newest_history_item_is_anchored():
  rng = np.random.default_rng(0)
  S, P = 6, 1
  counts = rng.integers(1, S + 1, size=5)
  hist = np.arange(S)[None, :] < counts[:, None]
  mask = np.concatenate([np.ones((5, P), bool), hist, np.ones((5, 2), bool)], axis=1)
  pos = np.asarray(pf.right_anchored_rope_positions(jnp.asarray(mask), S, P))
  for b, n in enumerate(counts):
    assert pos[b, P + n - 1] == P + S - 1
    np.testing.assert_array_equal(np.diff(pos[b, P:P + n]), 1)


def test_positions_reject_bad_shapes():
  with pytest.raises(ValueError, match="padding_mask"):
    pf.right_anchored_rope_positions(jnp.ones((8,), bool), 4, 1)
  with pytest.raises(ValueError, match="exceeds"):
    pf.right_anchored_rope_positions(jnp.ones((1, 4), bool), 4, 1)


@pytest.mark.parametrize("seq_len, offset", [(0, 0), (4.5, 1), (4, 2.5), (True, 0)])
def test_mask_rejects_non_integer_or_empty_sizes(seq_len, offset):
  # 4.5 used to build a 5x5 mask, 2.5 to act as offset 3, 0 an empty [1,1,0,0] mask.
  with pytest.raises(ValueError, match="must be an integer"):
    pf.make_recsys_attn_mask(seq_len, offset)


@pytest.mark.parametrize("history_len, prefix", [(-2, 1), (3, -1)])
def test_positions_reject_negative_sizes(history_len, prefix):
  # (-2, 1) used to give negative positions, (3, -1) slice the history from the end.
  with pytest.raises(ValueError, match="must be an integer >= 0"):
    pf.right_anchored_rope_positions(jnp.ones((2, 6)), history_len, prefix)
