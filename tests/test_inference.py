"""Runners, example data and host-side validation (phoenix_flax/inference.py, example.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from phoenix_flax import inference
from phoenix_flax.config import (NormConfig, PhoenixModelConfig, PhoenixRetrievalModelConfig,
                                 TransformerConfig)
from phoenix_flax.example import NUM_HASH_BUCKETS, example_batch, example_corpus
from phoenix_flax.inference import (ACTIONS, NEGATIVE_ACTIONS, RankingRunner, RetrievalRunner,
                                    validate_inputs, weighted_score)
from phoenix_flax.transformer import ContextCache
from phoenix_flax.types import CANDIDATE_BATCH_FIELDS, CANDIDATE_EMBEDDING_FIELDS

from conftest import compiled_programs, max_abs_diff

TRANSFORMER = TransformerConfig(emb_size=32, key_size=16, num_q_heads=2, num_kv_heads=1,
                                num_layers=1, widening_factor=2.0, attn_output_multiplier=0.25)
RANKING = PhoenixModelConfig(model=TRANSFORMER, emb_size=32, history_seq_len=8,
                             candidate_seq_len=6)
RETRIEVAL = PhoenixRetrievalModelConfig(model=TRANSFORMER, emb_size=32, history_seq_len=8,
                                        candidate_seq_len=6)
NUM_MANY = 2000


@pytest.fixture(scope="module")
def ranker():
  return RankingRunner.from_config(RANKING, key=jax.random.key(0))


@pytest.fixture(scope="module")
def anchored_ranker():
  config = dataclasses.replace(RANKING, right_anchored_rope=True)
  return RankingRunner.from_config(config, key=jax.random.key(0))


@pytest.fixture(scope="module")
def retriever():
  return RetrievalRunner.from_config(RETRIEVAL, key=jax.random.key(0))


@pytest.fixture(scope="module")
def corpus():
  return example_corpus(100, 32, jax.random.key(5))


def _batch(config=RANKING, batch_size=2, seed=1, **kw):
  return example_batch(config, batch_size, jax.random.key(seed), **kw)


# ---------------------------------------------------------------------------- actions


def test_actions_follow_the_release_order():
  assert len(ACTIONS) == 19 and len(set(ACTIONS)) == 19
  assert ACTIONS[0] == "favorite_score" and ACTIONS[18] == "dwell_time"
  assert NEGATIVE_ACTIONS == ("not_interested_score", "block_author_score",
                              "mute_author_score", "report_score")
  assert ACTIONS[14:18] == NEGATIVE_ACTIONS


def test_weighted_score_by_name_and_by_vector():
  probs = np.random.default_rng(3).uniform(size=(2, 5, 19)).astype(np.float32)
  by_name = weighted_score(probs, {"favorite_score": 2.0, "report_score": -3.0})
  vector = np.zeros(19, np.float32)
  vector[0], vector[17] = 2.0, -3.0
  expected = 2.0 * probs[..., 0] - 3.0 * probs[..., 17]
  np.testing.assert_allclose(by_name, expected, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(weighted_score(probs, vector), expected, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="unknown action 'likes'"):
    weighted_score(probs, {"likes": 1.0})
  with pytest.raises(ValueError, match=r"weights has shape \(3,\)"):
    weighted_score(probs, [1.0, 2.0, 3.0])
  with pytest.raises(ValueError, match="non-finite value: nan"):
    weighted_score(probs, {"favorite_score": float("nan")})
  with pytest.raises(ValueError, match="non-finite value: -inf"):
    weighted_score(probs, [0.0] * 18 + [float("-inf")])
  # An action just past the ones probs hold (report_score is index 17 of 19).
  with pytest.raises(ValueError, match=r"weights names 'report_score' \(index 17\), probs "
                                       "hold only 17 actions"):
    weighted_score(probs[..., :17], {"report_score": 1.0})
  # bfloat16 probabilities score in bfloat16 (the weights cast to them: no promotion).
  half = weighted_score(jnp.asarray(probs, jnp.bfloat16), {"favorite_score": 2.0})
  assert half.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(half, np.float32), 2.0 * probs[..., 0], atol=2e-2)
  # Integer probabilities must not turn the weights into integers.
  np.testing.assert_allclose(weighted_score(np.ones((2, 19), np.int32), {"favorite_score": 0.7}),
                             [0.7, 0.7], rtol=1e-6)


# ---------------------------------------------------------------------------- example data


def test_example_batch_is_valid_and_deterministic():
  config = dataclasses.replace(RANKING, post_age_granularity_mins=60,
                               dwell_time_norm=NormConfig())
  batch, emb = _batch(config, batch_size=3, num_candidates=5, history_lengths=[0, 3, 8])
  assert validate_inputs(config, batch, emb) == (3, 5)
  valid_BS = np.asarray(batch.history_post_hashes[:, :, 0]) != 0
  np.testing.assert_array_equal(valid_BS.sum(1), [0, 3, 8])
  np.testing.assert_array_equal(valid_BS, np.arange(8)[None] < np.array([0, 3, 8])[:, None])
  assert np.all(np.asarray(batch.history_actions)[~valid_BS] == 0)
  dwell_BS = np.asarray(batch.history_dwell_times)   # padded items carry no dwell either
  assert np.all(dwell_BS[~valid_BS] == 0) and np.all(dwell_BS[valid_BS] >= 0)
  assert np.all(np.asarray(batch.candidate_post_hashes) >= 1)
  assert batch.candidate_post_timestamps.shape == (3, 5)
  # Every candidate was posted before its impression: SPEC's post age is a real one
  age_s = np.asarray(batch.impression_timestamps)[:, None] - np.asarray(
      batch.candidate_post_timestamps)
  assert np.all(np.asarray(batch.candidate_post_timestamps) > 0) and np.all(age_s >= 0)
  assert batch.history_dwell_times.shape == (3, 8)
  assert emb.candidate_post_embeddings.dtype == jnp.float32
  again, _ = _batch(config, batch_size=3, num_candidates=5, history_lengths=[0, 3, 8])
  np.testing.assert_array_equal(batch.user_hashes, again.user_hashes)
  other, _ = _batch(config, batch_size=3, seed=2, num_candidates=5, history_lengths=[0, 3, 8])
  assert not np.array_equal(batch.user_hashes, other.user_hashes)
  # The key's every word seeds the draw (raw keys that differ only in their first word).
  first, last = (example_batch(config, 2, jnp.array(words, jnp.uint32))[0].user_hashes
                 for words in ([1, 7], [2, 7]))
  assert not np.array_equal(first, last)
  plain, _ = _batch(RANKING)
  assert plain.impression_timestamps is None and plain.history_dwell_times is None
  # Without history_lengths, each user's lies in [S // 2, S] (S = 8 here), both ends drawn.
  many, _ = _batch(RANKING, batch_size=64)
  lengths = (np.asarray(many.history_post_hashes[:, :, 0]) != 0).sum(axis=1)
  assert (lengths.min(), lengths.max()) == (4, 8)
  for lengths in ([1, 9], [-1, 2]):
    with pytest.raises(ValueError, match=rf"history_lengths=\{lengths} must lie in \[0, 8\]"):
      _batch(history_lengths=lengths)
  for lengths in ([3], [1, 2, 3], [[3, 4]]):   # one length per user of the batch of 2
    with pytest.raises(ValueError, match="must be 2 integers"):
      _batch(history_lengths=lengths)
  # Hashes are drawn from 1 up: none is the padding hash 0 (a candidate would read as
  # invalid), over 64 users' full histories and 1,000 candidates each.
  big, _ = _batch(batch_size=64, num_candidates=1000, history_lengths=[8] * 64)
  for name in ("user_hashes", "history_post_hashes", "history_author_hashes",
               "candidate_post_hashes", "candidate_author_hashes"):
    assert int(np.asarray(getattr(big, name)).min()) >= 1, name


def test_example_corpus_is_unit_norm_with_distinct_ids(corpus):
  emb, ids = corpus
  assert emb.shape == (100, 32) and ids.shape == (100,)
  np.testing.assert_allclose(np.linalg.norm(emb, axis=-1), 1.0, rtol=1e-5)
  ids = np.asarray(ids).tolist()
  assert len(set(ids)) == 100
  assert ids != sorted(ids)    # shuffled: an id says nothing about an item's place
  assert sorted(ids) == list(range(NUM_HASH_BUCKETS, NUM_HASH_BUCKETS + 100))   # no row index
  _, other = example_corpus(100, 32, jax.random.key(2))
  assert np.asarray(other).tolist() != ids


def test_example_data_takes_numpy_integer_sizes_and_refuses_bools():
  """Sizes hinted `int` accept NumPy integers (a sweep over `np.arange`), as the other
  public functions do, and refuse a bool with a ValueError naming the argument."""
  batch, _ = example_batch(RANKING, np.int64(2), jax.random.key(0), num_candidates=np.int32(3))
  assert batch.candidate_post_hashes.shape[:2] == (2, 3)
  emb, ids = example_corpus(np.int64(4), np.int32(8), jax.random.key(0))
  assert emb.shape == (4, 8) and ids.shape == (4,)
  with pytest.raises(ValueError, match="batch_size=True"):
    example_batch(RANKING, True, jax.random.key(0))
  with pytest.raises(ValueError, match="num_items=True"):
    example_corpus(True, 8, jax.random.key(0))
  with pytest.raises(ValueError, match="must be 2 integers"):
    example_batch(RANKING, 2, jax.random.key(0), history_lengths=[1.5, 2.0])


# ---------------------------------------------------------------------------- ranking


def test_rank_orders_by_favorite_with_padding_last(ranker):
  batch, emb = _batch()
  hashes = np.asarray(batch.candidate_post_hashes).copy()
  hashes[0, [1, 3]] = 0
  batch = batch._replace(candidate_post_hashes=jnp.asarray(hashes))
  out = ranker.rank(batch, emb)
  assert out.scores.shape == (2, 6, 19) and out.ranked_indices.shape == (2, 6)
  scores = np.asarray(out.scores)
  assert np.all((scores > 0) & (scores < 1))
  np.testing.assert_array_equal(out.action("reply_score"), scores[..., 1])
  ranked = np.asarray(out.ranked_indices)
  assert sorted(ranked[0, -2:].tolist()) == [1, 3]
  for b, valid in ((0, ranked[0, :4]), (1, ranked[1])):
    fav = scores[b, valid, 0]
    assert np.all(fav[:-1] >= fav[1:])
  chunked = ranker.rank_chunked(batch, emb, 4)   # padding last within and across chunks
  np.testing.assert_array_equal(chunked.ranked_indices, out.ranked_indices)
  with pytest.raises(ValueError, match="valid names: favorite_score, reply_score"):
    out.action("like_score")
  A = scores.shape[-1]
  few = out._replace(scores=out.scores[..., :A - 1])   # a model of A - 1 actions
  np.testing.assert_array_equal(few.action(ACTIONS[A - 2]), scores[..., A - 2])
  with pytest.raises(ValueError, match=rf"has index {A - 1}, the model predicts only "
                                       rf"{A - 1} actions"):
    few.action(ACTIONS[A - 1])


def test_ranking_puts_padding_last_in_slot_order(ranker):
  """Padded candidates all share one sort key; they come last in slot order (the order is
  deterministic), after the valid ones by descending favorite_score, in `rank` and
  `rank_chunked`. 40 slots: an unstable sort reorders such ties."""
  batch, emb = _batch(batch_size=1, num_candidates=40)
  hashes = np.asarray(batch.candidate_post_hashes).copy()
  padded = np.arange(40) % 3 != 1
  hashes[0, padded] = 0
  batch = batch._replace(candidate_post_hashes=jnp.asarray(hashes))
  for out in (ranker.rank(batch, emb), ranker.rank_chunked(batch, emb, 16)):
    fav = np.asarray(out.scores)[0, :, 0]
    valid = np.flatnonzero(~padded)
    expected = np.concatenate([valid[np.argsort(-fav[valid], kind="stable")],
                               np.flatnonzero(padded)])
    np.testing.assert_array_equal(out.ranked_indices[0], expected)


def test_padding_ranks_after_a_valid_candidate_of_probability_zero():
  """A valid candidate whose probability underflowed to 0 (a logit below about -104 in
  float32) still ranks before a padded slot ahead of it."""
  probs = jnp.zeros((1, 2, 1), jnp.float32)
  hashes = jnp.asarray([[[0, 0], [7, 3]]], jnp.int32)   # slot 0 padded, slot 1 valid
  assert inference._ranking_order(probs, hashes).tolist() == [[1, 0]]


def test_a_candidate_is_padding_by_its_first_hash_alone(ranker):
  """As the model reads it: a valid candidate whose later hash is 0 keeps its rank, in
  `rank` and in `rank_chunked`."""
  batch, emb = _batch()
  best = int(np.asarray(ranker.rank(batch, emb).ranked_indices)[0, 0])
  hashes = np.asarray(batch.candidate_post_hashes).copy()
  hashes[0, best, -1] = 0
  later = batch._replace(candidate_post_hashes=hashes)
  assert int(np.asarray(ranker.rank(later, emb).ranked_indices)[0, 0]) == best
  assert int(np.asarray(ranker.rank_chunked(later, emb, 4).ranked_indices)[0, 0]) == best


def test_retrieval_takes_any_history_layout(retriever):
  """Right-aligned history is refused only with right-anchored positions, which the
  retrieval model does not have."""
  batch, emb = _batch(RETRIEVAL, history_lengths=[3, 8])
  hashes = np.asarray(batch.history_post_hashes).copy()
  hashes[0] = np.roll(hashes[0], 5, axis=0)
  shifted = batch._replace(history_post_hashes=hashes)
  assert inference.validate_batch(RETRIEVAL, shifted) == (2, 6)
  retriever.encode_user(shifted, emb)


def test_rank_compiles_once_per_shape(ranker):
  ranker.rank(*_batch(seed=7))
  traces = ranker.trace_counts["rank"]
  ranker.rank(*_batch(seed=8, history_lengths=[0, 8]))
  assert ranker.trace_counts["rank"] == traces
  ranker.rank(*_batch(seed=8, num_candidates=7))
  assert ranker.trace_counts["rank"] == traces + 1


def test_runners_of_one_model_structure_share_their_compiled_programs(corpus):
  """A second runner, or one of another copy of the model (reloaded weights), compiles
  nothing again and scores with its own weights. (A jit per runner compiled every new
  runner's programs again and kept them until `jax.clear_caches()`.) A trace counts for
  the runner whose call made it."""
  transformer = dataclasses.replace(TRANSFORMER, widening_factor=1.5)   # this test's alone
  ranking = dataclasses.replace(RANKING, model=transformer)
  batch, emb = _batch(ranking, batch_size=3)
  first, second = (RankingRunner.from_config(ranking, key=jax.random.key(k)) for k in (1, 2))
  scores = [(r.rank(batch, emb).scores, r.rank_chunked(batch, emb, 2).scores)
            for r in (first, second)]
  assert dict(first.trace_counts) == {"rank": 1, "encode_context": 1, "score_candidates": 1}
  assert sum(second.trace_counts.values()) == 0
  for runner, (at_once, chunked) in zip((first, second), scores):
    np.testing.assert_allclose(at_once, jax.nn.sigmoid(runner.model(batch, emb).logits),
                               atol=1e-6)
    np.testing.assert_allclose(chunked, at_once, atol=1e-5)
  assert max_abs_diff(scores[0][0], scores[1][0]) > 1e-3

  retrieval = dataclasses.replace(RETRIEVAL, model=transformer)
  batch, emb = _batch(retrieval, batch_size=3)
  corpus_ND, ids_N = corpus
  first, second = (RetrievalRunner.from_config(retrieval, key=jax.random.key(k))
                   for k in (1, 2))
  found = []
  for runner in (first, second):
    runner.encode_corpus(emb.candidate_post_embeddings[0], emb.candidate_author_embeddings[0])
    runner.set_corpus(corpus_ND, ids_N)
    found.append(runner.retrieve(batch, emb, top_k=5).user_representation)
    np.testing.assert_allclose(found[-1], runner.encode_user(batch, emb), atol=1e-6)
  assert dict(first.trace_counts) == {"encode_corpus": 1, "retrieve": 1, "encode_user": 1}
  assert sum(second.trace_counts.values()) == 0
  assert max_abs_diff(found[0], found[1]) > 1e-3


def test_chunked_scoring_equals_scoring_at_once(ranker):
  batch, emb = _batch(batch_size=1, num_candidates=NUM_MANY)
  at_once = ranker.rank(batch, emb)
  before = dict(ranker.trace_counts)   # the fixture is shared with other tests
  chunked = ranker.rank_chunked(batch, emb, chunk_size=64)
  assert chunked.scores.shape == (1, NUM_MANY, 19)
  np.testing.assert_allclose(chunked.scores, at_once.scores, atol=1e-5, rtol=0)
  fav = np.asarray(chunked.scores)[0, np.asarray(chunked.ranked_indices[0]), 0]
  assert np.all(fav[:-1] >= fav[1:])
  assert sorted(np.asarray(chunked.ranked_indices[0]).tolist()) == list(range(NUM_MANY))
  # One compiled chunk program serves all 32 chunks and any later candidate count.
  compiled = dict(ranker.trace_counts)
  for name in ("score_candidates", "encode_context"):
    assert compiled[name] - before.get(name, 0) <= 1
  small, small_emb = _batch(batch_size=1, num_candidates=130)
  cache = ranker.encode_context(small, small_emb)
  assert ranker.score_candidates(cache, small, small_emb, chunk_size=64).scores.shape == (
      1, 130, 19)
  assert dict(ranker.trace_counts) == compiled


def test_chunked_scoring_keeps_device_inputs_on_the_device(ranker):
  """Candidates already on the device are padded, cut into chunks and joined there: no
  chunk goes through a NumPy copy that the compiled scorer would have to send back (an
  implicit host-to-device transfer, which the guard refuses). The chunks' offsets are
  the only transfers, and explicit. A cache kept on the host (a stored one, say) goes to
  the device once, explicitly, not with every chunk."""
  batch, emb = _batch(batch_size=2, num_candidates=150)
  cache = ranker.encode_context(batch, emb)
  host_cache = jax.tree.map(np.asarray, cache)
  expected = ranker.rank_chunked(batch, emb, chunk_size=64)   # compiled outside the guard
  ranker.score_candidates(cache, batch, emb, chunk_size=64)
  with jax.transfer_guard_host_to_device("disallow"):
    chunked = ranker.rank_chunked(batch, emb, chunk_size=64)
    scored = ranker.score_candidates(cache, batch, emb, chunk_size=64)
    from_host = ranker.score_candidates(host_cache, batch, emb, chunk_size=64)
  for got in (chunked, scored, from_host):
    assert all(isinstance(x, jax.Array) for x in got[:2])
    np.testing.assert_array_equal(got.scores, expected.scores)
    np.testing.assert_array_equal(got.ranked_indices, expected.ranked_indices)


def test_chunked_scoring_keeps_the_continuous_head_in_candidate_order():
  """The continuous head's outputs are stitched back from the chunks like the scores."""
  config = PhoenixModelConfig(model=TRANSFORMER, emb_size=32, history_seq_len=8,
                              candidate_seq_len=6, num_continuous_actions=2)
  runner = RankingRunner.from_config(config, key=jax.random.key(0))
  batch, emb = example_batch(config, 2, jax.random.key(1))
  whole = runner.rank(batch, emb)
  assert whole.continuous.shape == (2, 6, 2)
  for chunk_size in (1, 4):
    chunked = runner.rank_chunked(batch, emb, chunk_size)
    np.testing.assert_allclose(chunked.scores, whole.scores, atol=1e-5, rtol=0)
    np.testing.assert_allclose(chunked.continuous, whole.continuous, atol=1e-5, rtol=0)


def test_right_anchored_positions_need_left_aligned_history(anchored_ranker, ranker):
  """Right-aligned history would put the newest item after the candidates' position."""
  batch, emb = _batch(batch_size=2, history_lengths=[3, 8])
  hashes = np.asarray(batch.history_post_hashes).copy()
  hashes[0] = np.roll(hashes[0], 5, axis=0)      # padding first, then the 3 items
  shifted = batch._replace(history_post_hashes=hashes)
  with pytest.raises(ValueError, match=r"history_post_hashes holds .* at index \(0, 5\); "
                                       "with right_anchored_rope=True the history must be "
                                       "left-aligned"):
    anchored_ranker.rank(shifted, emb)
  ranker.rank(shifted, emb)    # sequential positions take any layout, as the release does
  # An item is padding by its first hash alone, as the model reads it: a 0 in a later hash
  # of a valid item leaves the history left-aligned.
  later = np.asarray(batch.history_post_hashes).copy()
  later[1, 2, -1] = 0
  anchored_ranker.rank(batch._replace(history_post_hashes=later), emb)


def test_right_anchored_scores_ignore_chunking_and_order(anchored_ranker):
  batch, emb = _batch(batch_size=2, num_candidates=NUM_MANY, history_lengths=[3, 8])
  at_once = np.asarray(anchored_ranker.rank(batch, emb).scores)
  cache = anchored_ranker.encode_context(batch, emb)
  chunked = anchored_ranker.score_candidates(cache, batch, emb, chunk_size=64)
  np.testing.assert_allclose(chunked.scores, at_once, atol=1e-5, rtol=0)

  perm = np.random.default_rng(0).permutation(NUM_MANY)
  permute = lambda x: None if x is None or np.ndim(x) < 2 else jnp.asarray(np.asarray(x)[:, perm])
  cand = ("candidate_post_hashes", "candidate_author_hashes", "candidate_product_surface")
  p_batch = batch._replace(**{f: permute(getattr(batch, f)) for f in cand})
  p_emb = emb._replace(candidate_post_embeddings=permute(emb.candidate_post_embeddings),
                       candidate_author_embeddings=permute(emb.candidate_author_embeddings))
  permuted = anchored_ranker.score_candidates(cache, p_batch, p_emb, chunk_size=300)
  unpermuted = np.empty_like(at_once)
  unpermuted[:, perm] = np.asarray(permuted.scores)
  np.testing.assert_allclose(unpermuted, at_once, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- validation


def _replace_batch(field, fn):
  def corrupt(batch, emb):
    return batch._replace(**{field: fn(np.asarray(getattr(batch, field)))}), emb
  return corrupt


def _replace_emb(field, fn):
  def corrupt(batch, emb):
    return batch, emb._replace(**{field: fn(np.asarray(getattr(emb, field)))})
  return corrupt


def _without_candidates(batch, emb):
  """Every candidate field cut to `[B, 0, ...]`."""
  cut = lambda tree, fields: tree._replace(**{
      f: np.asarray(getattr(tree, f))[:, :0] for f in fields if getattr(tree, f) is not None})
  return cut(batch, CANDIDATE_BATCH_FIELDS), cut(emb, CANDIDATE_EMBEDDING_FIELDS)


def _set(index, value):
  def fn(x):
    x = x.copy()
    x[index] = value
    return x
  return fn


BAD_INPUTS = {
    "negative user hash": (_replace_batch("user_hashes", _set((0, 1), -3)), "user_hashes"),
    "negative history hash": (_replace_batch("history_author_hashes", _set((1, 0, 0), -1)),
                              "history_author_hashes"),
    "negative candidate hash": (_replace_batch("candidate_post_hashes", _set((0, 2, 0), -7)),
                                "candidate_post_hashes.*-7"),
    "float hashes": (_replace_batch("user_hashes", lambda x: x.astype(np.float32)),
                     "user_hashes has dtype float32"),
    "bool hashes": (_replace_batch("user_hashes", lambda x: x != 0),
                    "user_hashes has dtype bool"),
    "surface too large": (_replace_batch("history_product_surface", _set((0, 0), 16)),
                          r"history_product_surface holds 16.*\[0, 16\)"),
    "negative surface": (_replace_batch("candidate_product_surface", _set((1, 5), -1)),
                         "candidate_product_surface"),
    "action not 0/1": (_replace_batch("history_actions", _set((0, 0, 4), 2)),
                       "history_actions holds 2.*0 or 1"),
    "wrong action count": (_replace_batch("history_actions", lambda x: x[..., :18]),
                           "history_actions has shape.*num_actions=19"),
    "wrong history length": (_replace_batch("history_post_hashes", lambda x: x[:, :7]),
                             "history_post_hashes has shape"),
    "candidate author count": (_replace_batch("candidate_author_hashes", lambda x: x[:, :5]),
                               "candidate_author_hashes has shape"),
    # C is read from candidate_post_hashes: a wrong one is named beside the field it fails.
    "candidate post count": (_replace_batch("candidate_post_hashes", lambda x: x[:, :5]),
                             r"candidate_author_hashes has shape \(2, 6, 2\), expected "
                             r"\(2, 5, 2\) \[B, C, num_author_hashes\] "
                             r"\(C=5 from batch.candidate_post_hashes\)$"),
    "user count": (_replace_batch("user_hashes", lambda x: x[:1]),
                   r"history_post_hashes has shape .* \(B=1 from batch.user_hashes\)$"),
    "history length, B and C right": (
        _replace_batch("history_post_hashes", lambda x: x[:, :7]),
        r"history_post_hashes has shape \(2, 7, 2\), expected \(2, 8, 2\) "
        r"\[B, history_seq_len, num_item_hashes\]$"),
    "candidate embeddings": (_replace_emb("candidate_post_embeddings", lambda x: x[:, :5]),
                             r"embeddings.candidate_post_embeddings has shape \(2, 5, 2, 32\)"),
    "user embedding size": (_replace_emb("user_embeddings", lambda x: x[..., :16]),
                            "embeddings.user_embeddings"),
    "integer embeddings": (_replace_emb("history_post_embeddings", lambda x: x.astype(np.int32)),
                           "history_post_embeddings has dtype int32"),
    "list instead of array": (_replace_batch("user_hashes", lambda x: np.asarray(x).tolist()),
                              "user_hashes is a list; pass a numpy or jax array"),
    # int64 values past int32 would be cut to int32 on the device (2**32 -> padding)
    "hash past int32": (_replace_batch("candidate_post_hashes",
                                       lambda x: _set((0, 1, 0), 2 ** 32)(x.astype(np.int64))),
                        "candidate_post_hashes holds 4294967296.*fit int32"),
    "NaN embedding": (_replace_emb("candidate_post_embeddings", _set((1, 2, 0, 3), np.nan)),
                      r"candidate_post_embeddings holds nan at index \(1, 2, 0, 3\)"),
    "inf embedding": (_replace_emb("user_embeddings", _set((0, 0, 0), np.inf)),
                      "user_embeddings holds inf"),
    "NaN embedding on the device": (
        _replace_emb("user_embeddings", lambda x: jnp.asarray(_set((0, 0, 0), np.nan)(x))),
        r"user_embeddings holds nan at index \(0, 0, 0\)"),
    "inf embedding on the device": (
        _replace_emb("user_embeddings", lambda x: jnp.asarray(_set((0, 0, 1), -np.inf)(x))),
        r"user_embeddings holds -inf at index \(0, 0, 1\)"),
    "no users": (lambda b, e: jax.tree.map(lambda x: np.asarray(x)[:0], (b, e)),
                 r"batch.user_hashes holds no users \(B = 0\)"),
    "no candidates": (_without_candidates,
                      r"batch.candidate_post_hashes holds no candidates \(C = 0\)"),
    # A wrong number of axes names where B and C came from too.
    "surface with an extra axis": (
        _replace_batch("candidate_product_surface", lambda x: x[..., None]),
        r"candidate_product_surface has shape \(2, 6, 1\), expected \(2, 6\) \[B, C\] "
        r"\(B=2 from batch.user_hashes; C=6 from batch.candidate_post_hashes\)$"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_ranking_runner_rejects_bad_inputs(ranker, case):
  corrupt, message = BAD_INPUTS[case]
  traces = dict(ranker.trace_counts)
  batch, emb = corrupt(*_batch())
  for call in (ranker.rank, lambda b, e: ranker.rank_chunked(b, e, 4)):
    with pytest.raises(ValueError, match=message):
      call(batch, emb)
  assert dict(ranker.trace_counts) == traces  # rejected on the host, before any compile


def test_missing_feature_fields_are_named():
  config = dataclasses.replace(RANKING, post_age_granularity_mins=60)
  batch, emb = _batch(config)
  with pytest.raises(ValueError, match="batch.candidate_post_timestamps is required"):
    validate_inputs(config, batch._replace(candidate_post_timestamps=None), emb)
  config = dataclasses.replace(RANKING, dwell_time_norm=NormConfig())
  batch, emb = _batch(config)
  with pytest.raises(ValueError, match="batch.history_dwell_times is required"):
    validate_inputs(config, batch._replace(history_dwell_times=None), emb)


def test_runners_ignore_fields_the_model_does_not_read(ranker):
  """With post age and dwell off, timestamps and dwell times are ignored whatever they
  hold (as by the release): not validated, and not passed to the compiled program."""
  batch, emb = _batch()
  junk = batch._replace(impression_timestamps=np.full((9,), -5),
                        candidate_post_timestamps=np.array([np.nan]),
                        history_dwell_times="not an array")
  expected = ranker.rank(batch, emb)
  traces = dict(ranker.trace_counts)
  for got in (ranker.rank(junk, emb), ranker.rank_chunked(junk, emb, 4)):
    np.testing.assert_allclose(got.scores, expected.scores, atol=1e-6)
  assert ranker.trace_counts["rank"] == traces["rank"]


FEATURES = dataclasses.replace(RANKING, post_age_granularity_mins=60,
                               dwell_time_norm=NormConfig())


@pytest.mark.parametrize("field, value, message, dtype", [
    ("impression_timestamps", -5, "timestamps must be >= 0", None),
    ("candidate_post_timestamps", -1, "timestamps must be >= 0", None),
    ("impression_timestamps", 1_700_000_000_000, r"fit int32 \(timestamps are in seconds\)",
     np.int64),
    ("history_dwell_times", np.nan, "dwell times must be finite", None),
    ("history_dwell_times", np.inf, "dwell times must be finite", None),
    ("history_actions", -1, "0 or 1", None),
    ("history_actions", 0.5, "0 or 1", np.float32),
])
def test_feature_values_are_validated(field, value, message, dtype):
  batch, emb = _batch(FEATURES)
  x = np.array(getattr(batch, field), dtype)
  x.flat[0] = value
  with pytest.raises(ValueError, match=f"{field} holds .*{message}"):
    validate_inputs(FEATURES, batch._replace(**{field: x}), emb)


def test_feature_values_at_their_edges_are_taken(ranker):
  """A timestamp of 0 means "missing" and passes; dwell times may be integer seconds."""
  batch, emb = _batch(FEATURES)
  zero = lambda x: np.zeros_like(np.asarray(x))
  assert validate_inputs(FEATURES, batch._replace(
      impression_timestamps=zero(batch.impression_timestamps),
      candidate_post_timestamps=zero(batch.candidate_post_timestamps)), emb) == (2, 6)
  seconds = np.rint(np.asarray(batch.history_dwell_times)).astype(np.int32)
  whole = batch._replace(history_dwell_times=seconds)
  assert validate_inputs(FEATURES, whole, emb) == (2, 6)
  runner = RankingRunner.from_config(FEATURES, key=jax.random.key(0))
  np.testing.assert_allclose(runner.rank(whole, emb).scores, runner.rank(
      batch._replace(history_dwell_times=seconds.astype(np.float32)), emb).scores, atol=1e-6)


def test_user_side_encoders_check_the_dwell_times_they_read():
  """The dwell times are the user's side: checked without candidates too."""
  batch, emb = _batch(FEATURES)
  dwell = np.array(batch.history_dwell_times, np.float32)
  dwell[0, 0] = np.nan
  bad = batch._replace(history_dwell_times=dwell)
  with pytest.raises(ValueError, match="history_dwell_times holds nan"):
    inference.validate_batch(FEATURES, bad, with_candidates=False)
  with pytest.raises(ValueError, match="history_dwell_times holds nan"):
    RankingRunner.from_config(FEATURES, key=jax.random.key(0)).encode_context(bad, emb)


def test_chunked_scoring_rejects_bad_chunk_size_and_cache(ranker):
  batch, emb = _batch()
  for chunk_size in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match="chunk_size"):
      ranker.rank_chunked(batch, emb, chunk_size)
  N = RANKING.candidate_start_offset
  wrong_users = ContextCache(jnp.zeros((1, 1, N, 1, 16)), jnp.zeros((1, 1, N, 1, 16)),
                             jnp.ones((1, N), bool))
  with pytest.raises(ValueError, match=r"cache.keys has shape \(1, 1, 9, 1, 16\)"):
    ranker.score_candidates(wrong_users, batch, emb, chunk_size=4)
  with pytest.raises(ValueError, match="chunk_size=0"):
    ranker.score_candidates(wrong_users, batch, emb, chunk_size=0)
  np.testing.assert_array_equal(ranker.rank_chunked(batch, emb, np.int64(3)).scores,
                                ranker.rank_chunked(batch, emb, 3).scores)


def test_chunked_scoring_needs_candidate_isolation():
  runner = RankingRunner.from_config(dataclasses.replace(RANKING, candidate_isolation=False),
                                     key=jax.random.key(0))
  with pytest.raises(ValueError, match="candidate_isolation=False"):
    runner.rank_chunked(*_batch(), chunk_size=4)


def test_runners_check_the_model_type(ranker, retriever):
  with pytest.raises(TypeError, match="PhoenixModel"):
    RankingRunner(retriever.model)
  with pytest.raises(TypeError, match="PhoenixRetrievalModel"):
    RetrievalRunner(ranker.model)


def test_runners_refuse_parameters_that_are_not_float32(ranker, retriever):
  """Parameters cast to bfloat16 (to save memory) would run the parts that stay float32
  whatever `fprop_dtype` says (input projections, head, candidate tower) in bfloat16 under
  a float32 config: refused, naming the parameter; `fprop_dtype` is the switch."""
  to_bf16 = lambda model, name: jax.tree_util.tree_map_with_path(
      lambda path, x: x.astype(jnp.bfloat16) if name in jax.tree_util.keystr(path) else x,
      model)
  with pytest.raises(ValueError, match=r"RankingRunner: parameter model\.unembeddings is "
                                       r"bfloat16; .*fprop_dtype='bfloat16'"):
    RankingRunner(to_bf16(ranker.model, "unembeddings"))
  with pytest.raises(ValueError, match=r"RetrievalRunner: parameter model\..*projection_1"):
    RetrievalRunner(to_bf16(retriever.model, "projection_1"))
  # Any float but float32: float16 and float64 too.
  for dtype in (jnp.float16, np.float64):
    other = jax.tree_util.tree_map_with_path(
        lambda path, x: np.asarray(x, dtype) if "unembeddings" in jax.tree_util.keystr(path)
        else x, ranker.model)
    with pytest.raises(ValueError, match=rf"parameter model\.unembeddings is "
                                         rf"{np.dtype(dtype).name}"):
      RankingRunner(other)


# ---------------------------------------------------------------------------- retrieval


def test_retrieval_runner_initialisation():
  runner = RetrievalRunner.from_config(RETRIEVAL, key=jax.random.key(0))
  assert runner.model is not None and runner.model.config == RETRIEVAL
  assert runner.corpus_embeddings is None and runner.corpus_post_ids is None


def test_retrieval_runner_encode_user(retriever):
  user = retriever.encode_user(*_batch(RETRIEVAL, batch_size=3))
  assert user.shape == (3, 32)
  np.testing.assert_allclose(np.linalg.norm(user, axis=-1), 1.0, rtol=1e-5)


def test_retrieval_runner_retrieve(retriever, corpus, monkeypatch):
  corpus_ND, ids_N = corpus
  batch, emb = _batch(RETRIEVAL, batch_size=3)
  retriever.set_corpus(corpus_ND, ids_N)
  traces = retriever.trace_counts["retrieve"]   # the fixture is shared with other tests
  out = retriever.retrieve(batch, emb, top_k=10)
  assert out.user_representation.shape == (3, 32)
  assert out.top_k_indices.shape == out.top_k_scores.shape == out.top_k_post_ids.shape == (3, 10)
  idx, scores = np.asarray(out.top_k_indices), np.asarray(out.top_k_scores)
  assert np.all((idx >= 0) & (idx < 100))
  assert np.all(scores[:, :-1] >= scores[:, 1:])
  np.testing.assert_array_equal(out.top_k_post_ids, np.asarray(ids_N)[idx])
  all_scores = np.asarray(out.user_representation) @ np.asarray(corpus_ND).T
  np.testing.assert_allclose(scores, np.sort(all_scores, axis=1)[:, ::-1][:, :10], atol=1e-5)
  traced = retriever.trace_counts["retrieve"]
  assert traced <= traces + 1                    # at most one trace for this shape ...
  retriever.retrieve(batch, emb, top_k=10)
  assert retriever.trace_counts["retrieve"] == traced   # ... and none when called again

  found = retriever.retrieve(batch, emb, top_k=np.int64(10))
  np.testing.assert_array_equal(found.top_k_indices, out.top_k_indices)

  mask = np.ones(100, bool)
  mask[idx[:, :3].ravel()] = False
  masked = retriever.retrieve(batch, emb, top_k=10, corpus_mask=mask)
  assert np.all(mask[np.asarray(masked.top_k_indices)])
  np.testing.assert_array_equal(masked.top_k_post_ids, np.asarray(ids_N)[masked.top_k_indices])
  as_ints = retriever.retrieve(batch, emb, top_k=10, corpus_mask=mask.astype(np.int32))
  np.testing.assert_array_equal(as_ints.top_k_indices, masked.top_k_indices)
  # A device mask is checked on the device and goes to the model as it is, not copied.
  sent = []
  retrieve = retriever._retrieve
  device_masks = (jnp.asarray(mask), jnp.asarray(mask, jnp.int32))
  with monkeypatch.context() as m:   # the fixture is shared: undone even if a check fails
    m.setattr(retriever, "_retrieve", lambda *args: sent.append(args[-1]) or retrieve(*args))
    for device_mask in device_masks:
      on_device = retriever.retrieve(batch, emb, top_k=10, corpus_mask=device_mask)
      np.testing.assert_array_equal(on_device.top_k_indices, masked.top_k_indices)
  assert sent[0] is device_masks[0] and isinstance(sent[1], jax.Array)
  # Per user: each user leaves out its own top 3.
  mask_BN = np.ones((3, 100), bool)
  mask_BN[np.arange(3)[:, None], idx[:, :3]] = False
  own = retriever.retrieve(batch, emb, top_k=10, corpus_mask=mask_BN)
  for b in range(3):
    kept = np.asarray(all_scores[b]).copy()
    kept[idx[b, :3]] = -np.inf
    np.testing.assert_array_equal(np.sort(np.asarray(own.top_k_indices[b])),
                                  np.sort(np.argsort(-kept)[:10]))

  # Candidate fields play no part in retrieval: another candidate count compiles nothing.
  traces = retriever.trace_counts["retrieve"]
  other, other_emb = _batch(RETRIEVAL, batch_size=3, num_candidates=9)
  retriever.retrieve(other, other_emb, top_k=10)
  assert retriever.trace_counts["retrieve"] == traces
  # The user tower is encode_user's program (traced for a new batch shape), and a new k,
  # mask form or corpus size traces the top-k program again, not the tower.
  encoded, traces = retriever.trace_counts["encode_user"], retriever.trace_counts["retrieve"]
  four, four_emb = _batch(RETRIEVAL, batch_size=4)
  retriever.retrieve(four, four_emb, top_k=10)
  assert retriever.trace_counts["encode_user"] == encoded + 1
  encoded, traces = retriever.trace_counts["encode_user"], traces + 1
  retriever.retrieve(batch, emb, top_k=11)
  retriever.set_corpus(corpus_ND[:90], ids_N[:90])
  np.testing.assert_array_equal(
      retriever.retrieve(batch, emb, top_k=10).user_representation, out.user_representation)
  assert retriever.trace_counts["encode_user"] == encoded
  assert retriever.trace_counts["retrieve"] == traces + 2
  np.testing.assert_array_equal(retriever.encode_user(batch, emb), out.user_representation)
  retriever.set_corpus(corpus_ND, ids_N)   # the fixture is shared


def test_encode_corpus_is_the_candidate_tower(retriever):
  """A corpus item's vector is the one the item gets as a candidate."""
  batch, emb = _batch(RETRIEVAL, batch_size=2)
  expected, _ = retriever.model.build_candidate_representation(batch, emb)
  flat = lambda x: np.asarray(x).reshape((-1,) + x.shape[2:])
  got = retriever.encode_corpus(flat(emb.candidate_post_embeddings),
                                flat(emb.candidate_author_embeddings))
  np.testing.assert_allclose(got, flat(expected), rtol=0, atol=1e-6)
  np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, rtol=1e-5)
  # Host arrays go to the device with a copy, compiling nothing (jnp.asarray of a NumPy
  # array compiled a program per shape): a new N compiles the tower's program alone.
  fresh = RetrievalRunner(retriever.model)   # (the fixture's corpus stays)
  post, author = flat(emb.candidate_post_embeddings)[:5], flat(emb.candidate_author_embeddings)[:5]
  with compiled_programs() as compiled:
    vectors = fresh.encode_corpus(post, author)
    fresh.set_corpus(np.asarray(vectors, np.float64), np.arange(1, 6))
  assert len(compiled) == 1, compiled
  assert fresh.corpus_embeddings.dtype == jnp.float32
  np.testing.assert_array_equal(fresh.corpus_embeddings, vectors)
  np.testing.assert_array_equal(fresh.corpus_post_ids, np.arange(1, 6))


def test_a_device_corpus_stays_on_the_device():
  """`encode_corpus` and `set_corpus` check device arrays where they live and keep them
  there: `set_corpus(runner.encode_corpus(...), ids)` makes no round trip through the host
  (the guard refuses the implicit host-to-device transfers a NumPy copy would need)."""
  runner = RetrievalRunner.from_config(RETRIEVAL, key=jax.random.key(0))
  batch, emb = _batch(RETRIEVAL, batch_size=2)
  flat = lambda x: x.reshape((-1,) + x.shape[2:])
  post, author = flat(emb.candidate_post_embeddings), flat(emb.candidate_author_embeddings)
  assert isinstance(post, jax.Array) and isinstance(author, jax.Array)
  ids = jnp.arange(1, post.shape[0] + 1, dtype=jnp.int32)
  runner.set_corpus(runner.encode_corpus(post, author), ids)   # compiled outside the guard
  expected = runner.retrieve(batch, emb, top_k=3)
  runner.corpus_embeddings = runner.corpus_post_ids = None
  with jax.transfer_guard_host_to_device("disallow"):
    runner.set_corpus(runner.encode_corpus(post, author), ids)
    got = runner.retrieve(batch, emb, top_k=3)
  assert runner.corpus_post_ids is ids
  np.testing.assert_array_equal(got.top_k_post_ids, expected.top_k_post_ids)
  np.testing.assert_array_equal(got.top_k_scores, expected.top_k_scores)
  # Checked where it lives: a NaN row of a device corpus is named, and a bfloat16 one is
  # stored in float32, as a host one is.
  nan_row = runner.encode_corpus(post, author).at[3, 0].set(jnp.nan)
  with pytest.raises(ValueError, match=r"corpus.embeddings holds nan at index \(3, 0\)"):
    runner.set_corpus(nan_row, ids)
  runner.set_corpus(runner.encode_corpus(post, author).astype(jnp.bfloat16), ids)
  assert runner.corpus_embeddings.dtype == jnp.float32


def test_user_side_encoders_take_a_batch_without_candidates(ranker, retriever):
  """`encode_context` and `encode_user` read the user's side only: a batch whose candidate
  fields are None (a serving system's, before it has candidates) gives what the whole
  batch gives."""
  for config, encode in ((RANKING, ranker.encode_context), (RETRIEVAL, retriever.encode_user)):
    batch, emb = _batch(config)
    bare = (batch._replace(**dict.fromkeys(CANDIDATE_BATCH_FIELDS)),
            emb._replace(**dict.fromkeys(CANDIDATE_EMBEDDING_FIELDS)))
    jax.tree.map(np.testing.assert_array_equal, encode(*bare), encode(batch, emb))
  # `retrieve` reads the user's side only too.
  retriever.set_corpus(*example_corpus(100, 32, jax.random.key(5)))
  jax.tree.map(np.testing.assert_array_equal, retriever.retrieve(*bare, top_k=3),
               retriever.retrieve(batch, emb, top_k=3))


def test_a_user_with_no_valid_token_gets_the_zero_vector(retriever, corpus):
  """A padding row (user hash 0, no history) pools nothing: its vector is zero, as in the
  release, every item scores 0, and its top k are the corpus's first rows (as documented
  in `types.RetrievalOutput`), while the other users' results are untouched."""
  batch, emb = _batch(RETRIEVAL, batch_size=2, history_lengths=[0, 5])
  padded = batch._replace(user_hashes=np.asarray(batch.user_hashes) * np.array([[0], [1]]))
  retriever.set_corpus(*corpus)
  got = retriever.retrieve(padded, emb, top_k=3)
  whole = retriever.retrieve(batch, emb, top_k=3)
  np.testing.assert_array_equal(got.user_representation[0], 0.0)
  np.testing.assert_array_equal(got.top_k_scores[0], 0.0)
  np.testing.assert_array_equal(got.top_k_indices[0], [0, 1, 2])
  np.testing.assert_array_equal(got.top_k_indices[1], whole.top_k_indices[1])
  np.testing.assert_allclose(np.linalg.norm(whole.user_representation, axis=-1), 1.0,
                             rtol=1e-5)


def test_retrieval_runner_rejects_bad_inputs(corpus):
  runner = RetrievalRunner.from_config(RETRIEVAL, key=jax.random.key(0))
  corpus_ND, ids_N = corpus
  batch, emb = _batch(RETRIEVAL)
  with pytest.raises(ValueError, match="corpus is not set"):
    runner.retrieve(batch, emb, top_k=5)
  with pytest.raises(ValueError, match=r"post_ids has shape \(99,\)"):
    runner.set_corpus(corpus_ND, ids_N[:99])
  with pytest.raises(ValueError, match="corpus embeddings has shape"):
    runner.set_corpus(corpus_ND[:, :16], ids_N)
  with pytest.raises(ValueError, match="post_ids has dtype float32"):
    runner.set_corpus(corpus_ND, ids_N.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"corpus.embeddings holds nan at index \(7, 0\)"):
    runner.set_corpus(np.asarray(corpus_ND).copy() * np.where(np.arange(100) == 7, np.nan,
                                                              1.0)[:, None], ids_N)
  too_big = np.asarray(ids_N, np.int64)
  too_big[0] = 2 ** 32
  with pytest.raises(ValueError, match="corpus.post_ids holds 4294967296.*fit int32"):
    runner.set_corpus(corpus_ND, too_big)
  too_small = np.asarray(ids_N, np.int64)
  too_small[0] = -2 ** 31 - 1
  with pytest.raises(ValueError, match="corpus.post_ids holds -2147483649.*fit int32"):
    runner.set_corpus(corpus_ND, too_small)
  repeated = np.asarray(ids_N).copy()
  repeated[9] = repeated[4]
  with pytest.raises(ValueError, match=rf"corpus.post_ids holds {int(repeated[4])} at index "
                                       r"\(9,\); post ids must be distinct"):
    runner.set_corpus(corpus_ND, repeated)
  edges = np.asarray(ids_N, np.int64)
  edges[:2] = -2 ** 31, 2 ** 31 - 1                # int32's own extremes fit
  runner.set_corpus(corpus_ND, edges)
  np.testing.assert_array_equal(runner.corpus_post_ids[:2], [-2 ** 31, 2 ** 31 - 1])
  runner.set_corpus(corpus_ND, ids_N)
  for top_k in (0, 101, 2.0):
    with pytest.raises(ValueError, match=rf"top_k={top_k!r} must be an integer in \[1, 100\]"):
      runner.retrieve(batch, emb, top_k=top_k)
  B = np.shape(batch.user_hashes)[0]
  for shape in ((50,), (B + 1, 100)):
    with pytest.raises(ValueError, match=rf"corpus_mask has shape \({shape[0]},.*expected "
                       rf"\(100,\) or \({B}, 100\)"):
      runner.retrieve(batch, emb, top_k=5, corpus_mask=np.ones(shape, bool))
  few = np.zeros(100, bool)
  few[[4, 9]] = True
  per_user = np.ones((B, 100), bool)
  per_user[1, 2:] = False
  for where in (np.asarray, jnp.asarray):   # a host mask, and one checked on the device
    with pytest.raises(ValueError, match="top_k=3 exceeds the 2 corpus items corpus_mask "
                                         "keeps$"):
      runner.retrieve(batch, emb, top_k=3, corpus_mask=where(few))
    with pytest.raises(ValueError, match="top_k=3 exceeds the 2 corpus items corpus_mask "
                                         "keeps for user 1"):
      runner.retrieve(batch, emb, top_k=3, corpus_mask=where(per_user))
    for values in (np.full(100, 2, np.int32), np.full(100, -1, np.int32),
                   np.where(np.arange(100) == 3, 0.5, 1.0)):
      with pytest.raises(ValueError, match="corpus_mask must be boolean or 0/1"):
        runner.retrieve(batch, emb, top_k=3, corpus_mask=where(values))
  with pytest.raises(ValueError, match=r"author_embeddings has shape \(4, 2, 32\), expected "
                     r"\[N >= 1, 2, 32\] \(N = 3"):
    runner.encode_corpus(np.zeros((3, 2, 32), np.float32), np.zeros((4, 2, 32), np.float32))
  with pytest.raises(ValueError, match="post_embeddings has dtype int32"):
    runner.encode_corpus(np.zeros((3, 2, 32), np.int32), np.zeros((3, 2, 32), np.float32))
  with pytest.raises(ValueError, match=r"post_embeddings has shape \(0, 2, 32\), expected "
                                       r"\[N >= 1, 2, 32\]"):
    runner.encode_corpus(np.zeros((0, 2, 32), np.float32), np.zeros((0, 2, 32), np.float32))
  bad = np.asarray(batch.user_hashes).copy()
  bad[1, 0] = -2
  with pytest.raises(ValueError, match="user_hashes holds -2"):
    runner.retrieve(batch._replace(user_hashes=bad), emb, top_k=5)
  assert runner.trace_counts["retrieve"] == 0
  everything = runner.retrieve(batch, emb, top_k=100)    # the whole corpus is allowed
  for row in np.asarray(everything.top_k_indices):
    assert sorted(row.tolist()) == list(range(100))
  for where in (np.asarray, jnp.asarray):   # and as many as the mask keeps
    got = runner.retrieve(batch, emb, top_k=2, corpus_mask=where(few))
    assert np.all(np.sort(np.asarray(got.top_k_indices), axis=-1) == [4, 9])
    got = runner.retrieve(batch, emb, top_k=2, corpus_mask=where(per_user))
    np.testing.assert_array_equal(np.sort(np.asarray(got.top_k_indices)[1]), [0, 1])


def test_chunk_size_larger_than_the_list_scores_no_excess_padding(ranker):
  """A chunk_size far above C used to pad the list up to it (10**9 asked XLA for 256 GB)."""
  batch, emb = _batch(batch_size=2, num_candidates=5)
  expected = ranker.rank(batch, emb)
  before = ranker.trace_counts["score_candidates"]
  for chunk_size in (8, 64, 10**9):
    got = ranker.rank_chunked(batch, emb, chunk_size)
    np.testing.assert_allclose(got.scores, expected.scores, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(got.ranked_indices, expected.ranked_indices)
  # Every chunk_size >= 8 runs the same 8-candidate program.
  assert ranker.trace_counts["score_candidates"] - before <= 1
  # A power-of-two C is its own cover: chunk sizes 16 and 64 both run the 16-candidate
  # program, with no padded chunk beyond the list.
  sixteen, sixteen_emb = _batch(batch_size=2, num_candidates=16)
  ranker.rank_chunked(sixteen, sixteen_emb, 16)
  before = ranker.trace_counts["score_candidates"]
  np.testing.assert_allclose(ranker.rank_chunked(sixteen, sixteen_emb, 64).scores,
                             ranker.rank(sixteen, sixteen_emb).scores, atol=1e-5, rtol=0)
  assert ranker.trace_counts["score_candidates"] == before


def test_chunked_scoring_scores_each_chunk_once_and_no_chunk_of_padding_only(ranker,
                                                                             monkeypatch):
  """ceil(C / chunk) scoring calls at offsets 0, chunk, ...: a list that fills its last
  chunk exactly gets no chunk of padding after it (its work would double at C = chunk)."""
  offsets = []
  score = ranker._score
  monkeypatch.setattr(ranker, "_score", lambda *a: (offsets.append(int(a[-1])), score(*a))[1])
  for C, chunk_size in ((8, 4), (8, 8), (12, 4), (5, 4), (5, 8), (16, 64)):
    batch, emb = _batch(batch_size=2, num_candidates=C)
    offsets.clear()
    got = ranker.rank_chunked(batch, emb, chunk_size)
    chunk = min(chunk_size, 1 << (C - 1).bit_length())   # chunk_size_for
    assert offsets == list(range(0, C, chunk)), (C, chunk_size, offsets)
    np.testing.assert_allclose(got.scores, ranker.rank(batch, emb).scores, atol=1e-5, rtol=0)


def test_score_candidates_rejects_a_cache_of_other_users_or_another_dtype(ranker):
  """Same shapes used to score silently against the wrong context."""
  batch, emb = _batch(batch_size=2, history_lengths=[3, 8])
  cache = ranker.encode_context(batch, emb)
  others, others_emb = _batch(batch_size=2, seed=4, history_lengths=[5, 8])
  with pytest.raises(ValueError, match=r"cache.padding_mask\[0, 4\] is True, .* other users"):
    ranker.score_candidates(ranker.encode_context(others, others_emb), batch, emb, 4)
  with pytest.raises(ValueError, match="cache.keys has dtype bfloat16, expected float32"):
    ranker.score_candidates(cache._replace(keys=cache.keys.astype(jnp.bfloat16)), batch, emb, 4)
  with pytest.raises(ValueError, match="cache.padding_mask is a NoneType"):
    ranker.score_candidates(cache._replace(padding_mask=None), batch, emb, 4)
  np.testing.assert_allclose(ranker.score_candidates(cache, batch, emb, 4).scores,
                             ranker.rank(batch, emb).scores, atol=1e-5, rtol=0)
  # A history item is padding by its first hash alone (the model's rule): a 0 in a later
  # hash of a valid item is no mismatch with the cache.
  full, full_emb = _batch(batch_size=2, history_lengths=[8, 8])
  hashes = np.array(full.history_post_hashes)
  hashes[0, 0, -1] = 0
  full = full._replace(history_post_hashes=hashes)
  np.testing.assert_allclose(
      ranker.score_candidates(ranker.encode_context(full, full_emb), full, full_emb, 4).scores,
      ranker.rank(full, full_emb).scores, atol=1e-5, rtol=0)



def test_bfloat16_paths_agree_to_bfloat16_rounding():
  """In bfloat16 (the accelerators' default) the fast path, the dense reference and chunked
  scoring agree to bfloat16 rounding: about 2e-2 in probability (docs/models.md), under
  the 5e-2 checked here (float32: 1e-5, in the tests above)."""
  config = dataclasses.replace(RANKING, fprop_dtype="bfloat16", model=dataclasses.replace(
      TRANSFORMER, num_layers=2))
  fast = RankingRunner.from_config(config, key=jax.random.key(0))
  dense = RankingRunner.from_config(dataclasses.replace(config, attention_impl="dense"),
                                    key=jax.random.key(0))
  for a, b in zip(jax.tree.leaves(fast.model), jax.tree.leaves(dense.model)):
    np.testing.assert_array_equal(a, b)          # the same parameters
  batch, emb = _batch(config, batch_size=4, num_candidates=40, history_lengths=[8, 3, 0, 5])
  want = fast.rank(batch, emb)
  assert want.scores.dtype == jnp.float32
  assert max_abs_diff(dense.rank(batch, emb).scores, want.scores) <= 5e-2
  for chunk_size in (1, 16):
    assert max_abs_diff(fast.rank_chunked(batch, emb, chunk_size).scores, want.scores) <= 5e-2
  # The bound means something: bfloat16 is not float32 here.
  f32 = RankingRunner.from_config(dataclasses.replace(config, fprop_dtype="float32"),
                                  key=jax.random.key(0))
  assert max_abs_diff(f32.rank(batch, emb).scores, want.scores) > 1e-4


# ------------------------------------------------- inputs refused by name (mutation audit)


def test_a_users_cache_scores_its_candidates_whatever_its_later_user_hashes(ranker):
  """A user is padding by its first user hash alone (as the model masks it): a user whose
  first hash is set and later ones 0, or the reverse, keeps its own cache."""
  batch, emb = _batch()
  for first, rest in ((0, 7), (7, 0)):
    hashes = np.array(batch.user_hashes)
    hashes[0, 0], hashes[0, 1:] = first, rest
    changed = batch._replace(user_hashes=hashes)
    cache = ranker.encode_context(changed, emb)
    got = ranker.score_candidates(cache, changed, emb, 4).scores
    np.testing.assert_allclose(got, ranker.rank(changed, emb).scores, atol=1e-6)


def test_runners_refuse_embeddings_of_another_type_by_name(ranker):
  batch, emb = _batch()
  for wrong in (tuple(emb), emb._asdict()):
    with pytest.raises(TypeError, match="embeddings must be RecsysEmbeddings"):
      ranker.rank(batch, wrong)


def test_the_corpus_must_be_finite_and_hold_an_item(retriever):
  hc = RETRIEVAL.hash_config
  post = np.ones((3, hc.num_item_hashes, 32), np.float32)
  author = np.ones((3, hc.num_author_hashes, 32), np.float32)
  post[1, 0, 0] = np.nan
  with pytest.raises(ValueError, match="post_embeddings holds nan"):
    retriever.encode_corpus(post, author)
  with pytest.raises(ValueError, match="N >= 1"):
    retriever.set_corpus(np.zeros((0, 32), np.float32), np.zeros((0,), np.int32))
