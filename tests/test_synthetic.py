"""Synthetic world: config validation, determinism, layout, label link, recency, splits."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phoenix_flax as pf
from phoenix_flax.synthetic import (SplitConfig, WorldConfig, make_world, post_features,
                                    sample_batch, true_logits, user_interest)
from phoenix_flax.synthetic.sampling import MAX_AGE_S, _ages_s, _history_lengths, _randint
from phoenix_flax.synthetic.world import (UNIFORM_VALUES, history_weights, ids_in_topic,
                                          uniform_below)
from phoenix_flax.training.metrics import per_action_auc

SMALL = WorldConfig(num_users=64, num_posts=200, num_authors=24, num_topics=8, latent_dim=8,
                    history_len=12, num_candidates=6, user_buckets=40, post_buckets=128,
                    author_buckets=16)
BIG = 2048
sample = jax.jit(sample_batch, static_argnums=(1, 2))


@functools.lru_cache(maxsize=None)
def world(cfg: WorldConfig = SMALL, seed: int = 0):
  return make_world(cfg, jax.random.PRNGKey(seed))


# (field, kwargs): each value is just outside what its field allows.
BAD_WORLD = [
    ("num_topics", dict(num_topics=0)), ("num_authors", dict(num_authors=4, num_topics=8)),
    ("num_posts", dict(num_posts=8, num_topics=16)), ("num_users", dict(num_users=0)),
    ("latent_dim", dict(latent_dim=0)), ("history_len", dict(history_len=0)),
    ("num_candidates", dict(num_candidates=0)), ("num_user_hashes", dict(num_user_hashes=0)),
    ("num_item_hashes", dict(num_item_hashes=0)),
    ("num_author_hashes", dict(num_author_hashes=0)),
    ("user_buckets", dict(user_buckets=1)), ("post_buckets", dict(post_buckets=1)),
    ("author_buckets", dict(author_buckets=1)),
    ("post_buckets", dict(post_buckets=3_000_000_000)),   # beyond int32
    ("num_users", dict(num_users=2**31)),
    ("product_surface_vocab_size", dict(product_surface_vocab_size=0)),
    ("num_actions", dict(num_actions=0)),
    ("recency_decay", dict(recency_decay=0.0)), ("interest_mix", dict(interest_mix=1.5)),
    ("topic_switch_prob", dict(topic_switch_prob=-0.1)), ("explore_prob", dict(explore_prob=1.1)),
    ("taste_concentration", dict(taste_concentration=-1.0)),
    ("author_style", dict(author_style=-0.1)), ("post_noise", dict(post_noise=float("nan"))),
    ("retrieval_sharpness", dict(retrieval_sharpness=-1.0)),
    ("base_rates", dict(base_rates=(0.1,) * 3)),
    ("negative_actions", dict(negative_actions=(14, 19))),
    ("affinity_scale", dict(affinity_scale=-1.0)), ("quality_scale", dict(quality_scale=-1.0)),
    ("surface_scale", dict(surface_scale=float("inf"))),
    ("user_bias_scale", dict(user_bias_scale=-1.0)), ("session_scale", dict(session_scale=-1.0)),
    ("post_age", dict(post_age=1)), ("age_decay_per_day", dict(age_decay_per_day=-1.0)),
    # a bool would pass for 1; inf would clip every post's age
    ("recency_decay", dict(recency_decay=True)),
    ("mean_post_age_hours", dict(mean_post_age_hours=float("inf"))),
    ("base_rates", dict(base_rates=("a",) * 19)),
    ("negative_actions", dict(negative_actions=(14, True))),
    # not sequences: a ValueError naming the field, not Python's TypeError
    ("base_rates", dict(base_rates=0.1)), ("base_rates", dict(base_rates=None)),
    ("negative_actions", dict(negative_actions=14)),
    ("base_rates", dict(base_rates=np.array(0.1))),   # a 0-d array is no sequence either
    ("recency_decay", dict(recency_decay=1.5)),   # a decay factor is at most 1
    ("negative_actions", dict(negative_actions=(14, 14))),   # each action named once
    # every id range fits int32, and the open bounds are open
    ("num_posts", dict(num_posts=2**31)), ("num_authors", dict(num_authors=2**31)),
    ("user_buckets", dict(user_buckets=2**31)), ("author_buckets", dict(author_buckets=2**31)),
    ("mean_post_age_hours", dict(mean_post_age_hours=0.0)),
    ("base_rates", dict(base_rates=(0.0,) + (0.1,) * 18)),   # an infinite base logit
    ("base_rates", dict(base_rates=(1.0,) + (0.1,) * 18)),
    ("negative_actions", dict(negative_actions=(-1, 14))),   # -1 would index the last action
]
BAD_SPLIT = [
    ("max_history", dict(min_history=5, max_history=3)), ("min_history", dict(min_history=-1)),
    ("history_dist", dict(history_dist="normal")),
    ("candidate_order", dict(candidate_order="score")),
    ("relevant_fraction", dict(relevant_fraction=2.0)),
    ("list_correlation", dict(list_correlation=-0.5)),
    ("num_candidates", dict(num_candidates=0)),
    ("min_candidates", dict(num_candidates=4, min_candidates=5)),
    ("min_history", dict(min_history=True)), ("relevant_fraction", dict(relevant_fraction=True)),
    ("max_history", dict(max_history=-1)),
    # sizes are Python ints, as every config's are (the message says how to convert)
    ("min_history", dict(min_history=np.int64(2))), ("max_history", dict(max_history=np.int64(4))),
]


@pytest.mark.parametrize("cls, field, kwargs", [(WorldConfig, *case) for case in BAD_WORLD]
                         + [(SplitConfig, *case) for case in BAD_SPLIT],
                         ids=lambda x: x if isinstance(x, str) else None)
def test_config_validation_names_the_field(cls, field, kwargs):
  with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}=.* is invalid"):
    cls(**kwargs)


def test_every_world_and_split_field_has_a_bad_value_case():
  """A data-side idea's field is validated in `__post_init__`, with a case above."""
  for cls, cases in ((WorldConfig, BAD_WORLD), (SplitConfig, BAD_SPLIT)):
    missing = {f.name for f in dataclasses.fields(cls)} - {field for field, _ in cases}
    assert not missing, (f"{cls.__name__} fields without a case in BAD_WORLD or BAD_SPLIT "
                         f"(tests/test_synthetic.py): {sorted(missing)}")


def test_config_checks_across_fields_and_numpy_scalars():
  # NumPy scalars pass and are stored as Python scalars (a config is written to JSON)
  decay = WorldConfig(recency_decay=np.float32(0.5)).recency_decay
  assert decay == 0.5 and type(decay) is float
  scale = WorldConfig(affinity_scale=np.int64(2)).affinity_scale   # an integer real value
  assert scale == 2 and type(scale) is int
  rates = WorldConfig(base_rates=np.full(19, 0.1, np.float32)).base_rates
  assert len(rates) == 19 and all(type(r) is float for r in rates)
  rates = WorldConfig(base_rates=(np.float32(0.1),) * 19).base_rates   # a tuple of them too
  assert all(type(r) is float for r in rates)
  negs = WorldConfig(negative_actions=(np.int64(14),)).negative_actions
  assert negs == (14,) and type(negs[0]) is int
  fraction = SplitConfig(relevant_fraction=np.float32(0.25)).relevant_fraction
  assert fraction == 0.25 and type(fraction) is float
  with pytest.raises(ValueError, match="batch_size"):
    sample(world(), SplitConfig(), True, jax.random.PRNGKey(0))
  # A NumPy integer batch size (from a config or an array's shape) is a batch size.
  numpy_sized = sample(world(), SplitConfig(), np.int64(3), jax.random.PRNGKey(0))
  assert numpy_sized.batch.user_hashes.shape[0] == 3
  with pytest.raises(ValueError, match="max_history"):
    SplitConfig(max_history=SMALL.history_len + 1).resolve(SMALL)
  # an unset max_history is the world's S, and the message says so
  with pytest.raises(ValueError, match=rf"min_history=.*<= the world's history_len="
                                       rf"{SMALL.history_len} \(max_history is None"):
    SplitConfig(min_history=SMALL.history_len + 1).resolve(SMALL)
  # a list's minimum length is at most its width, the split's or (unset) the world's
  C = WorldConfig().num_candidates
  with pytest.raises(ValueError, match=rf"SplitConfig\.min_candidates={C + 1} is invalid"):
    SplitConfig(min_candidates=C + 1).resolve(WorldConfig())
  # The boundaries themselves are valid: a list of exactly its minimum length, and as
  # many posts and authors as topics.
  assert SplitConfig(num_candidates=4, min_candidates=4).min_candidates == 4
  assert SplitConfig(min_candidates=C).resolve(WorldConfig())[1] == C
  assert WorldConfig(num_posts=16, num_authors=16, num_topics=16).num_posts == 16
  # The closed bounds are valid: a decay of 1 weighs every item alike, and the mixes and
  # probabilities take 0 and 1.
  assert WorldConfig(recency_decay=1.0).recency_decay == 1.0
  for f in ("interest_mix", "topic_switch_prob", "explore_prob"):
    assert getattr(WorldConfig(**{f: 0.0}), f) == 0.0
    assert getattr(WorldConfig(**{f: 1.0}), f) == 1.0


def test_a_cold_start_split_has_empty_histories():
  """min_history=max_history=0: every user's history is padding, candidates are still scored by the
  taste alone (finite probabilities, labels drawn)."""
  b = sample(world(), SplitConfig(min_history=0, max_history=0), BIG, jax.random.PRNGKey(5))
  assert int(jnp.max(b.history_len)) == 0
  assert not bool(jnp.any(b.batch.history_post_hashes != 0))
  assert bool(jnp.all(jnp.isfinite(b.probs))) and 0 < float(jnp.mean(b.labels)) < 1


def test_deterministic_given_key():
  w1, w2 = make_world(SMALL, jax.random.PRNGKey(3)), make_world(SMALL, jax.random.PRNGKey(3))
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), w1, w2)))
  a = sample(w1, SplitConfig(), BIG, jax.random.PRNGKey(1))
  b = sample(w2, SplitConfig(), BIG, jax.random.PRNGKey(1))
  c = sample(w1, SplitConfig(), BIG, jax.random.PRNGKey(2))
  assert all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a, b)))
  assert not jnp.array_equal(a.labels, c.labels)


def test_shapes_dtypes_and_padding_layout():
  cfg, split = SMALL, SplitConfig(min_history=0, min_candidates=2, candidate_order="grouped")
  sb = sample(world(), split, 64, jax.random.PRNGKey(0))
  B, S, C, A = 64, cfg.history_len, cfg.num_candidates, cfg.num_actions
  assert pf.types.check_batch(sb.batch, pf.HashConfig(), S, 19) == (B, C)
  assert sb.labels.shape == sb.probs.shape == (B, C, A)
  assert sb.labels.dtype == sb.probs.dtype == jnp.float32
  assert sb.candidate_mask.dtype == jnp.bool_ and sb.user_ids.dtype == jnp.int32
  b = jax.tree.map(np.asarray, sb.batch)
  n = np.asarray(sb.history_len)
  hist_valid = np.arange(S)[None, :] < n[:, None]
  assert n.min() >= 0 and n.max() <= S
  for hashes, buckets in [(b.history_post_hashes, cfg.post_buckets),
                          (b.history_author_hashes, cfg.author_buckets)]:
    assert np.all((hashes >= 1) & (hashes < buckets) == hist_valid[..., None])
  assert np.all(b.history_actions[~hist_valid] == 0)
  assert np.all(b.history_dwell_times[~hist_valid] == 0)
  assert np.all((np.asarray(sb.history_post_ids) >= 0) == hist_valid)
  mask = np.asarray(sb.candidate_mask)
  count = mask.sum(1)
  assert np.array_equal(mask, np.arange(C)[None, :] < count[:, None])  # valid slots first
  assert count.min() >= 2 and count.max() == C
  assert np.all((b.candidate_post_hashes >= 1) & (b.candidate_post_hashes < cfg.post_buckets)
                == mask[..., None])
  assert np.all((b.user_hashes >= 1) & (b.user_hashes < cfg.user_buckets))
  assert np.all(np.asarray(sb.probs)[~mask] == 0) and np.all(np.asarray(sb.labels)[~mask] == 0)
  assert np.all((np.asarray(sb.candidate_post_ids) >= 0) == mask)
  assert np.all(np.diff(np.asarray(sb.candidate_relevant, np.int32), axis=1) <= 0)  # grouped
  assert set(np.unique(np.asarray(sb.labels))) <= {0.0, 1.0}
  minutes = (b.impression_timestamps[:, None] - b.candidate_post_timestamps) // 60
  assert np.all((minutes[mask] >= 1) & (minutes[mask] <= 4800))
  assert np.all(b.candidate_post_timestamps[~mask] == 0)
  # Hashes are the world's tables applied to the ids, and post_features agrees.
  w = world()
  ids = np.asarray(sb.candidate_post_ids)[mask]
  post_h, author_h, surface = post_features(w, ids)
  np.testing.assert_array_equal(post_h, b.candidate_post_hashes[mask])
  np.testing.assert_array_equal(author_h, b.candidate_author_hashes[mask])
  assert surface.shape == ids.shape and np.all(np.asarray(surface) == 0)
  assert post_h.dtype == author_h.dtype == surface.dtype == jnp.int32   # the batches' dtype


def test_hash_tables_collide_and_avoid_padding():
  w = world()
  table = np.asarray(w.post_hashes_PK)
  assert table.shape == (SMALL.num_posts, SMALL.num_item_hashes)
  assert table.min() >= 1 and table.max() < SMALL.post_buckets
  assert len(np.unique(table[:, 0])) < SMALL.num_posts  # 200 posts in 127 buckets collide


def test_labels_follow_true_probabilities():
  sb = sample(world(), SplitConfig(), BIG, jax.random.PRNGKey(5))
  p = np.asarray(sb.probs, np.float64).reshape(-1, SMALL.num_actions)
  y = np.asarray(sb.labels, np.float64).reshape(-1, SMALL.num_actions)
  se = np.sqrt(np.sum(p * (1 - p), axis=0)) / p.shape[0]
  assert np.all(np.abs(y.mean(0) - p.mean(0)) < 5 * se + 1e-9)
  # Within probability bins of the favorite action as well (calibration of the labels).
  bins = np.digitize(p[:, 0], [0.1, 0.2, 0.4, 0.6])
  for k in np.unique(bins):
    sel = bins == k
    se_k = np.sqrt(np.sum(p[sel, 0] * (1 - p[sel, 0]))) / sel.sum()
    assert abs(y[sel, 0].mean() - p[sel, 0].mean()) < 5 * se_k + 1e-9


def test_default_world_bayes_auc_is_informative():
  cfg = WorldConfig()
  w = make_world(cfg, jax.random.PRNGKey(0))
  sb = sample(w, SplitConfig(), 1024, jax.random.PRNGKey(1))
  auc, valid = per_action_auc(sb.probs, sb.labels, sb.candidate_mask)
  assert bool(jnp.all(valid))
  assert 0.72 < float(jnp.mean(auc)) < 0.9
  # Negative actions fall with affinity: their true probs anti-correlate with favorites.
  p = np.asarray(sb.probs).reshape(-1, cfg.num_actions)
  assert np.corrcoef(p[:, 0], p[:, 15])[0, 1] < -0.3


def _probs_from_history(w, sb, history_ids):
  interest = user_interest(w, sb.user_ids, history_ids, sb.history_len)
  b = sb.batch
  age_s = b.impression_timestamps[:, None] - b.candidate_post_timestamps
  age_h = age_s.astype(jnp.float32) / 3600.0
  logits = true_logits(w, interest[:, None, :], sb.candidate_post_ids, b.candidate_product_surface,
                       age_h, w.user_bias_U[sb.user_ids][:, None])
  return jax.nn.sigmoid(logits)


def test_recent_history_moves_probabilities_more_than_old_history():
  w = world()
  sb = sample(w, SplitConfig(), BIG, jax.random.PRNGKey(2))
  base = _probs_from_history(w, sb, sb.history_post_ids)
  np.testing.assert_allclose(base, sb.probs, atol=1e-6)  # the public link reproduces probs
  T, rows = SMALL.num_topics, jnp.arange(BIG)
  ids, n = sb.history_post_ids, sb.history_len
  long_B = (n >= 6)[:, None, None]

  def shifted(position):  # move one history item to the next topic
    old = ids[rows, position]
    return ids.at[rows, position].set((old + 1) % T + (old // T) * T)

  newest = jnp.mean(jnp.abs(_probs_from_history(w, sb, shifted(n - 1)) - base), where=long_B)
  oldest = jnp.mean(jnp.abs(_probs_from_history(w, sb, shifted(jnp.zeros_like(n))) - base),
                    where=long_B)
  assert float(newest) > 3 * float(oldest) > 0


def test_history_actions_follow_the_interest_held_before_each_item():
  """Item s's actions are drawn with the interest after items 0..s-1 (the taste-led
  interest at s = 0). The observed actions are far likelier under that link than with
  the item itself counted, one item behind, or with the whole history's interest."""
  w = world()
  sb = sample(w, SplitConfig(), BIG, jax.random.PRNGKey(3))
  ids = jnp.maximum(sb.history_post_ids, 0)
  S = ids.shape[1]
  users_BS = jnp.broadcast_to(sb.user_ids[:, None], (BIG, S))
  ids_BSS = jnp.broadcast_to(ids[:, None, :], (BIG, S, S))
  s_BS = jnp.broadcast_to(jnp.arange(S), (BIG, S))
  valid_BS = s_BS < sb.history_len[:, None]
  actions_BSA = np.asarray(sb.batch.history_actions)

  def log_likelihood(lengths_BS):
    interest_BSL = user_interest(w, users_BS, ids_BSS, lengths_BS)
    logits = true_logits(w, interest_BSL, ids, sb.batch.history_product_surface, 0.0,
                         w.user_bias_U[sb.user_ids][:, None])
    ll = jnp.where(actions_BSA > 0, jax.nn.log_sigmoid(logits), jax.nn.log_sigmoid(-logits))
    return float(jnp.sum(jnp.where(valid_BS[..., None], ll, 0.0)))

  before = log_likelihood(s_BS)
  assert before > log_likelihood(s_BS + 1) + 100          # the item itself counted
  assert before > log_likelihood(jnp.maximum(s_BS - 1, 0)) + 100   # one item behind
  assert before > log_likelihood(jnp.broadcast_to(sb.history_len[:, None], (BIG, S))) + 100
  assert not actions_BSA[~np.asarray(valid_BS)].any()      # padding has no actions


@pytest.mark.parametrize("decay, expected", [(0.5, [0.25, 0.5, 1.0, 0.0, 0.0]),
                                             (1.0, [1.0, 1.0, 1.0, 0.0, 0.0])])
def test_recency_decay_weighs_history_by_age(decay, expected):
  """`recency_decay` sets the weight of each valid item: decay ** (age in items); 1.0
  weighs the whole history alike, and padding (past the valid length 3) gets none."""
  np.testing.assert_allclose(history_weights(jnp.array([3]), 5, decay)[0], expected)


def test_history_weights_take_lengths_of_any_integer_dtype():
  """uint8 lengths weigh a history of 400 slots as int32 lengths do (positions counted in
  the lengths' own dtype wrapped past 255)."""
  lengths = np.array([0, 3, 200])
  np.testing.assert_array_equal(history_weights(lengths.astype(np.uint8), 400, 0.9),
                                history_weights(jnp.asarray(lengths, jnp.int32), 400, 0.9))


def test_split_history_lengths_shift_order_and_composition():
  w = world()
  train = sample(w, SplitConfig(max_history=4), 256, jax.random.PRNGKey(0))
  shifted = sample(w, SplitConfig(min_history=8, max_history=12, candidate_order="relevance"),
                   256, jax.random.PRNGKey(0))
  longtail = sample(w, SplitConfig(history_dist="log_uniform", relevant_fraction=0.0), 256,
                    jax.random.PRNGKey(0))
  assert set(np.unique(train.history_len)) == {1, 2, 3, 4}
  assert set(np.unique(shifted.history_len)) == set(range(8, 13))
  assert np.all(np.asarray(shifted.batch.history_post_hashes)[:, :8] > 0)
  n = np.asarray(longtail.history_len)
  assert n.min() >= 1 and n.max() <= SMALL.history_len
  assert np.mean(n <= 3) > 0.3 and np.mean(n >= 9) > 0.1  # short-heavy with a long tail
  assert np.all(np.diff(np.asarray(shifted.probs[..., 0]), axis=1) <= 0)  # relevance order
  assert np.any(train.candidate_relevant) and not np.any(longtail.candidate_relevant)


def test_list_correlation_gives_each_list_one_session_topic():
  split = SplitConfig(relevant_fraction=1.0, list_correlation=1.0, num_candidates=9)
  session = sample(world(), split, 64, jax.random.PRNGKey(0))
  topics = np.asarray(session.candidate_post_ids) % SMALL.num_topics
  assert topics.shape == (64, 9) and np.all(topics == topics[:, :1])
  assert len(np.unique(topics[:, 0])) > 1


def test_list_correlation_moves_the_interest_labels_are_drawn_from():
  """A correlated list shifts the user's interest toward its session topic (by
  list_correlation * session_scale), and the list's probabilities come from that interest.
  A session_scale other than the default 1 is one of the cases (a shift by the correlation
  alone passed them all)."""
  T = SMALL.num_topics
  for session_scale, corr in ((SMALL.session_scale, 1.0), (SMALL.session_scale, 0.5),
                              (0.25, 1.0), (0.25, 0.5)):
    w = dataclasses.replace(world(), cfg=dataclasses.replace(SMALL, session_scale=session_scale))
    split = SplitConfig(relevant_fraction=1.0, list_correlation=corr)
    sb = sample(w, split, 64, jax.random.PRNGKey(1))
    base = user_interest(w, sb.user_ids, jnp.maximum(sb.history_post_ids, 0), sb.history_len)
    moved = np.asarray(sb.interest) - np.asarray(base)
    scale = np.linalg.norm(moved, axis=-1)
    np.testing.assert_allclose(scale, corr * session_scale, rtol=1e-4)
    if corr == 1.0:   # every list is its session topic's (see the test above)
      topic = np.asarray(sb.candidate_post_ids)[:, 0] % T
      np.testing.assert_allclose(moved, session_scale * np.asarray(w.topic_vecs_TL)[topic],
                                 atol=1e-5)


def test_history_dwell_times_follow_the_dwell_action():
  """Dwell times are long (>= 10 s) where the binary long-dwell action (the last one)
  fired, short (3 s on average) where it did not, and 0 at padding."""
  sb = sample(world(), SplitConfig(), BIG, jax.random.PRNGKey(3))
  dwell = np.asarray(sb.batch.history_dwell_times)
  long = np.asarray(sb.batch.history_actions)[..., -1] == 1
  valid = np.asarray(sb.batch.history_post_hashes)[..., 0] != 0
  assert long.any() and (valid & ~long).any()
  assert np.all(dwell[long] >= 10.0)
  assert abs(dwell[valid & ~long].mean() - 3.0) < 0.3
  assert np.all(dwell[~valid] == 0.0)


def test_log_uniform_history_lengths():
  """log_uniform draws n with P(n) = log((n+2)/(n+1)) / log((max+2)/(min+1)): every length
  from min to max, short ones most often."""
  u = jax.random.uniform(jax.random.PRNGKey(0), (200_000,))
  n = np.asarray(_history_lengths(SplitConfig(history_dist="log_uniform"), 12, u))
  assert n.min() == 1 and n.max() == 12
  lengths = np.arange(1, 13)
  expected = np.log((lengths + 2) / (lengths + 1)) / np.log(14 / 2)
  got = np.bincount(n, minlength=13)[1:] / n.size
  np.testing.assert_allclose(got, expected, atol=0.005)
  # exp(log(lo + 1)) rounds below lo + 1 for some lo (12 among them): the draws still
  # start at min_history.
  split = SplitConfig(min_history=12, max_history=20, history_dist="log_uniform")
  low = jax.jit(lambda u: _history_lengths(split, 20, u))(jnp.array([0.0, 1e-9], jnp.float32))
  assert int(np.min(low)) == 12


def test_post_ages_are_exponential_whole_seconds_clipped_to_1_and_4800_minutes():
  """Age = -log(1 - u) * mean_post_age_hours (12 h here) in whole seconds, clipped to
  [60 s, 4800 min]: a draw a few seconds old is a minute old, a very old one 4800 min."""
  mean_s = SMALL.mean_post_age_hours * 3600.0
  u = jnp.array([0.0, 1e-4, 0.5, 1.0 - 1e-6], jnp.float32)
  ages = np.asarray(_ages_s(world(), u))
  assert ages.dtype == np.int32
  assert -np.log1p(-1e-4) * mean_s < 60                   # 4.3 s before the clip
  assert ages[0] == ages[1] == 60 and ages[3] == MAX_AGE_S == 4800 * 60
  assert abs(int(ages[2]) - round(np.log(2.0) * mean_s)) <= 1


def test_post_age_decays_positive_actions_only():
  cfg = dataclasses.replace(SMALL, post_age=True, age_decay_per_day=2.0)
  w = dataclasses.replace(world(), cfg=cfg)  # post_age only changes the link
  interest = w.user_taste_UL[:4]
  post, surface = jnp.arange(4), jnp.zeros(4, jnp.int32)
  fresh = true_logits(w, interest, post, surface, jnp.zeros(4), jnp.zeros(4))
  day_old = true_logits(w, interest, post, surface, jnp.full(4, 24.0), jnp.zeros(4))
  drop = np.asarray(fresh - day_old)
  negative = np.isin(np.arange(cfg.num_actions), cfg.negative_actions)
  np.testing.assert_allclose(drop[:, ~negative], 2.0, rtol=1e-5)
  np.testing.assert_allclose(drop[:, negative], 0.0, atol=1e-6)


# The cpu preset's world and a batch of its training split, summarised per array (the
# weighted sum of |values|). Every committed result (docs/results) was trained on this
# world: a change of the generator that alters it alters them all, while the run configs
# (the runs' identity on resume) stay the same. A new random quantity therefore draws from
# a key of its own (world.py, `make_world`). Integers must match exactly, floats to 1e-5.
DEFAULT_WORLD = {
    ".topic_vecs_TL": 295.8575270450674, ".post_vecs_PL": 18333.352667125248,
    ".post_quality_P": 3138.2196285095997, ".post_author_P": 193884,
    ".user_topic_logits_UT": 51066.74512216536, ".user_taste_UL": 9186.734320183077,
    ".user_bias_U": 792.4964259942062, ".base_logits_A": 235.7459580898285,
    ".affinity_weight_A": 76.1234439611435, ".quality_weight_A": 54.32961055636406,
    ".surface_effect_VA": 431.31631534115877, ".action_sign_A": 71.0,
    ".user_hashes_UK": 4171131, ".post_hashes_PK": 16575230, ".author_hashes_WK": 213670,
}
DEFAULT_BATCH = {
    ".batch.user_hashes": 23156, ".batch.history_post_hashes": 909243,
    ".batch.history_author_hashes": 135029, ".batch.history_actions": 1217.0,
    ".batch.history_product_surface": 1595, ".batch.candidate_post_hashes": 975791,
    ".batch.candidate_author_hashes": 130913, ".batch.candidate_product_surface": 1774,
    ".batch.impression_timestamps": 17021257546,
    ".batch.candidate_post_timestamps": 430588607032,
    ".batch.history_dwell_times": 3913.2670302651823, ".labels": 471.0,
    ".probs": 558.0685256413562, ".candidate_mask": 253, ".user_ids": 2885,
    ".candidate_post_ids": 133717, ".candidate_author_ids": 12405,
    ".history_post_ids": 116552, ".history_len": 153, ".candidate_relevant": 108,
    ".interest": 55.95383438637509,
}


def _fingerprint(tree) -> dict:
  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    x = np.asarray(x)
    total = np.sum(np.abs(x.astype(np.float64)).ravel() * (1 + np.arange(x.size) % 7))
    out[jax.tree_util.keystr(path)] = int(total) if x.dtype.kind in "biu" else float(total)
  return out


def test_ids_and_hashes_beyond_a_float32_uniform_reach_every_integer():
  """A float32 uniform takes 2**23 values, so ids and hashes drawn from one over a larger
  range came from a grid: 2**26 post buckets held only every 8th bucket (the collisions
  of 2**23), and of 3 * 2**23 users a sixth had ids not divisible by 3. Beyond 2**23
  they come from jax.random.randint; below it, from the uniform as before."""
  cfg = WorldConfig(num_users=8, num_posts=4096, num_authors=8, num_topics=2, latent_dim=4,
                    post_buckets=2 ** 26)
  hashes = np.asarray(make_world(cfg, jax.random.PRNGKey(0)).post_hashes_PK)
  assert hashes.min() >= 1 and hashes.max() < 2 ** 26
  assert len(np.unique((hashes - 1) % 8)) == 8   # every residue: no grid of step 8
  # Each entity's table from a key of its own: one key would give post w and author w
  # (and user w) the same hashes.
  big = 2 ** 24 + 1
  w = make_world(dataclasses.replace(cfg, user_buckets=big, post_buckets=big,
                                     author_buckets=big), jax.random.PRNGKey(0))
  tables = [np.asarray(t)[:8] for t in (w.user_hashes_UK, w.post_hashes_PK,
                                        w.author_hashes_WK)]
  for i, j in ((0, 1), (0, 2), (1, 2)):
    assert np.mean(tables[i] == tables[j]) < 0.1, (i, j)
  u, key = jax.random.uniform(jax.random.PRNGKey(1), (60_000,)), jax.random.PRNGKey(2)
  n = 3 * UNIFORM_VALUES
  ids = np.asarray(jax.jit(_randint, static_argnums=(1, 2))(u, 0, n, key))
  assert ids.min() >= 0 and ids.max() < n
  np.testing.assert_allclose(np.bincount(ids % 3) / len(ids), 1 / 3, atol=0.02)
  # Posts of one topic among 2 topics: every id of the topic, each residue alike.
  posts = np.asarray(ids_in_topic(jnp.zeros(60_000, jnp.int32), 2 * n, 2, u, key))
  assert np.all(posts % 2 == 0) and posts.max() < 2 * n
  np.testing.assert_allclose(np.bincount(posts // 2 % 3) / len(posts), 1 / 3, atol=0.02)
  # Up to 2**23 integers the uniform itself gives them (the draws of every preset).
  np.testing.assert_array_equal(_randint(u, 0, 1000, key), np.floor(np.asarray(u) * 1000))
  # ... up to and including 2**23 itself; above it the key draws, up to the last integer
  # (for a count below the bound too), and for a topic of 2**23 + 1 ids.
  np.testing.assert_array_equal(uniform_below(u, UNIFORM_VALUES, UNIFORM_VALUES, key),
                                np.floor(np.asarray(u) * UNIFORM_VALUES))
  small = np.asarray(uniform_below(u, jnp.full(u.shape, 3), 2 * UNIFORM_VALUES, key))
  assert set(np.unique(small).tolist()) == {0, 1, 2}
  topic = jnp.zeros(u.shape, jnp.int32)
  draws = [np.asarray(ids_in_topic(topic, 2 * UNIFORM_VALUES + 1, 2, u, jax.random.PRNGKey(k)))
           for k in (3, 4)]
  assert np.mean(draws[0] == draws[1]) < 0.01 and draws[0].max() < 2 * UNIFORM_VALUES + 1
  for count in (n, UNIFORM_VALUES + 1):   # from the first integer past the uniform's reach
    with pytest.raises(ValueError, match="needs a key"):
      _randint(u, 0, count)


def test_categorical_draws_stay_in_range_when_the_cdf_ends_below_one():
  """The float32 softmax's running total may end just below 1, under a uniform drawn just
  below 1: the draw is then the last category, not one past it."""
  from phoenix_flax.synthetic.sampling import _categorical
  u = np.nextafter(np.float32(1), np.float32(0))
  logits = jax.random.normal(jax.random.PRNGKey(7), (16,)) * 2
  assert float(jnp.cumsum(jax.nn.softmax(logits))[-1]) < u   # the case to cover
  assert int(_categorical(jnp.float32(u), logits)) == 15


def test_grouped_order_keeps_draw_order_within_a_group():
  """"grouped" sorts with a stable sort: with no relevant candidate every key ties, and
  the list stays in draw order (XLA's CPU sort is stable by accident up to 16 elements
  only, so the list is longer)."""
  from phoenix_flax.synthetic.sampling import uniform_shapes
  from phoenix_flax.synthetic.world import random_blocks
  split = SplitConfig(relevant_fraction=0.0, candidate_order="grouped", num_candidates=64)
  key = jax.random.PRNGKey(3)
  sb = sample(world(), split, 16, key)
  cfg = SMALL
  u = random_blocks(key, jax.random.uniform,
                    uniform_shapes(16, cfg.history_len, 64, cfg.num_actions))
  np.testing.assert_array_equal(sb.candidate_post_ids,
                                np.floor(np.asarray(u["rand_post"]) * cfg.num_posts))


def test_the_world_and_its_sampler_refuse_arguments_of_another_kind():
  """A dict for a config, or no users in a batch, is named (not an AttributeError, a
  hashing error from jit, or an empty batch)."""
  w = world()
  with pytest.raises(TypeError, match="cfg must be a WorldConfig, got dict"):
    make_world(dataclasses.asdict(SMALL), jax.random.PRNGKey(0))
  with pytest.raises(TypeError, match="split must be a SplitConfig, got dict"):
    sample_batch(w, dataclasses.asdict(SplitConfig()), 4, jax.random.PRNGKey(0))
  for bad in (0, -1):
    with pytest.raises(ValueError, match=f"batch_size={bad}"):
      sample_batch(w, SplitConfig(), bad, jax.random.PRNGKey(0))


def test_the_default_world_and_its_batches_are_unchanged():
  from experiments.configs import ranking
  from phoenix_flax.training import parse_config
  spec = parse_config(ranking.get_config("cpu"))
  w = make_world(spec.world, jax.random.PRNGKey(spec.config.world_seed))
  found = {**_fingerprint(w),
           **_fingerprint(sample(w, spec.train_split, 4, jax.random.PRNGKey(0)))}
  expected = {**DEFAULT_WORLD, **DEFAULT_BATCH}
  assert set(found) == set(expected), set(found) ^ set(expected)
  changed = [k for k, v in expected.items()
             if (found[k] != v if isinstance(v, int) else found[k] != pytest.approx(v, rel=1e-5))]
  assert not changed, (f"the default world or batch changed in {changed}: every committed "
                       "result changes with it (regenerate docs/results, then these values)")


def test_the_worlds_normal_and_uniform_draws_are_independent():
  """The world draws its normal and its uniform numbers from two keys. Drawn from one,
  the i-th normal would be a monotone function of the i-th uniform (JAX makes normals from
  uniform bits), and post i's author among its topic's authors (a uniform) would follow
  coordinate i of the topic vectors (normals): rank correlation about 0.96, against
  |r| < 0.02 with two keys (3 seeds)."""
  cfg = WorldConfig()
  n = cfg.num_topics * cfg.latent_dim
  assert cfg.num_posts >= n
  ranks = lambda x: np.argsort(np.argsort(x, kind="stable"), kind="stable")
  for seed in range(3):
    w = world(cfg, seed)
    coordinate = np.asarray(w.topic_vecs_TL).reshape(-1)
    author = np.asarray(w.post_author_P)[:n]
    among_topic = (author - np.arange(n) % cfg.num_topics) // cfg.num_topics
    r = np.corrcoef(ranks(coordinate), ranks(among_topic))[0, 1]
    assert abs(r) < 0.2, (seed, r)


def test_world_and_batches_are_the_same_with_x64_on():
  """`jax_enable_x64` on draws the same float32 world and batches, bit for bit: the
  random draws' default dtype follows the flag, and a float64 draw was another world
  (a smoke ranking run's bayes_auc_mean 0.846 instead of 0.817), its batches carrying
  float64 interests, probabilities and dwell times into training."""
  from experiments.configs import ranking
  from phoenix_flax.training import parse_config
  spec = parse_config(ranking.get_config("smoke"))
  def draw():
    w = jax.jit(make_world, static_argnums=0)(spec.world, jax.random.PRNGKey(0))
    return w, jax.jit(sample_batch, static_argnums=(1, 2))(w, spec.train_split, 8,
                                                            jax.random.PRNGKey(1))
  narrow = jax.device_get(draw())
  with jax.enable_x64(True):
    wide = jax.device_get(draw())
    # Nor does a float64 array appear inside (ages were divided into hours in float64).
    jaxpr = str(jax.make_jaxpr(sample_batch, static_argnums=(1, 2))(
        wide[0], spec.train_split, 8, jax.random.PRNGKey(1)))
  assert not re.search(r"f64\[\d", jaxpr), re.findall(r".*f64\[\d.*", jaxpr)[:3]
  flat_n = jax.tree_util.tree_leaves_with_path(narrow)
  flat_w = jax.tree_util.tree_leaves(wide)
  assert len(flat_n) == len(flat_w)
  for (path, a), b in zip(flat_n, flat_w):
    name = jax.tree_util.keystr(path)
    assert np.asarray(b).dtype == np.asarray(a).dtype, (name, b.dtype)
    np.testing.assert_array_equal(b, a, err_msg=name)


# Knobs of the link and the latent state at 0 (or at non-default values), on a world
# small enough that 8 post buckets and 4 user and author buckets all come up.
KNOBS_OFF = dataclasses.replace(SMALL, user_buckets=4, post_buckets=8, author_buckets=4,
                                user_bias_scale=0.0, surface_scale=0.0, taste_concentration=0.0,
                                author_style=0.0, post_noise=0.0, negative_actions=(2, 5))
KNOBS_UP = dataclasses.replace(SMALL, num_users=2048, latent_dim=32,
                               product_surface_vocab_size=32, user_bias_scale=2.0,
                               surface_scale=2.0, taste_concentration=4.0, author_style=2.0,
                               post_noise=0.0)


def _link_drop(w, interest_XL, post_X):
  """Logits at this interest minus logits at a zero interest (the affinity's part)."""
  zeros = jnp.zeros(post_X.shape, jnp.int32)
  return np.asarray(true_logits(w, interest_XL, post_X, zeros, 0.0, 0.0)
                    - true_logits(w, 0.0 * interest_XL, post_X, zeros, 0.0, 0.0))


def test_world_knobs_at_zero_switch_their_effects_off():
  """user_bias_scale, surface_scale 0: no user or surface effect; taste_concentration 0:
  every user's topic distribution is uniform; author_style, post_noise 0: a post's vector
  is its topic's; negative_actions: exactly the configured actions fall with affinity."""
  cfg = KNOBS_OFF
  w = world(cfg)
  assert not np.any(np.asarray(w.user_bias_U))
  post = jnp.arange(8)
  logits_V = [true_logits(w, w.user_taste_UL[:8], post, jnp.full(8, v), 0.0, 0.0)
              for v in range(cfg.product_surface_vocab_size)]
  for logits in logits_V[1:]:
    np.testing.assert_array_equal(logits, logits_V[0])
  np.testing.assert_allclose(jax.nn.softmax(w.user_topic_logits_UT), 1 / cfg.num_topics,
                             rtol=1e-6)
  np.testing.assert_allclose(w.user_taste_UL, np.broadcast_to(w.user_taste_UL[0],
                                                              w.user_taste_UL.shape), atol=1e-6)
  topic_P = np.arange(cfg.num_posts) % cfg.num_topics
  np.testing.assert_allclose(w.post_vecs_PL, np.asarray(w.topic_vecs_TL)[topic_P], atol=1e-6)
  drop = _link_drop(w, w.post_vecs_PL[:8], post)
  assert set(np.flatnonzero(np.all(drop < 0, axis=0))) == {2, 5}
  assert np.all(drop[:, [a for a in range(cfg.num_actions) if a not in (2, 5)]] > 0)


def test_world_knob_scales_set_the_size_of_their_effects():
  """At non-default values: user_bias_scale and surface_scale are the std of the user and
  surface effects; a larger taste_concentration sharpens tastes (the top topic holds about
  0.76 at 4 against 0.57 at 2); author_style 2 with no post noise leaves a post's cosine
  with its topic near 1 / sqrt(1 + 2**2) = 0.45 (0.91 at 0.5)."""
  cfg = KNOBS_UP
  w = world(cfg)
  assert 1.75 < np.std(np.asarray(w.user_bias_U)) < 2.25
  assert 1.6 < np.std(np.asarray(w.surface_effect_VA)) < 2.4
  top = np.max(np.asarray(jax.nn.softmax(w.user_topic_logits_UT)), axis=1)
  assert 0.66 < top.mean() < 0.86
  topic_P = np.arange(cfg.num_posts) % cfg.num_topics
  cos = np.sum(np.asarray(w.post_vecs_PL) * np.asarray(w.topic_vecs_TL)[topic_P], axis=-1)
  assert 0.3 < cos.mean() < 0.7


def test_hash_functions_differ_and_reach_every_bucket():
  """An entity's hash functions are drawn independently (two agree on about one id in
  buckets - 1), and every bucket in [1, buckets) comes up, the last one included."""
  for table, buckets in ((world().post_hashes_PK, SMALL.post_buckets),
                         (world().user_hashes_UK, SMALL.user_buckets)):
    table = np.asarray(table)
    assert np.mean(table[:, 0] == table[:, 1]) < 0.2, buckets
  w = world(KNOBS_OFF)
  for table, buckets in ((w.post_hashes_PK, 8), (w.user_hashes_UK, 4), (w.author_hashes_WK, 4)):
    assert set(np.unique(np.asarray(table))) == set(range(1, buckets))


def test_the_link_adds_each_effect_with_its_sign():
  """true_logits: positive actions rise with affinity, post quality and the user's bias;
  negative actions fall with affinity and quality and ignore the bias; surface v adds its
  row of `surface_effect_VA` to every action."""
  w, cfg = world(), SMALL
  negative = np.isin(np.arange(cfg.num_actions), cfg.negative_actions)
  post = jnp.arange(8)
  drop = _link_drop(w, w.post_vecs_PL[:8], post)
  assert np.all(drop[:, ~negative] > 0) and np.all(drop[:, negative] < 0)
  zeros, interest = jnp.zeros(8, jnp.int32), jnp.zeros((8, cfg.latent_dim))
  by_quality = np.asarray(true_logits(w, interest, post, zeros, 0.0, 0.0))
  sign_P = np.sign(np.asarray(w.post_quality_P)[:8] - float(w.post_quality_P[8]))[:, None]
  rise = sign_P * (by_quality - np.asarray(true_logits(w, interest[0], 8, 0, 0.0, 0.0)))
  assert np.all(rise[:, ~negative] > 0) and np.all(rise[:, negative] < 0)
  base = true_logits(w, w.user_taste_UL[:8], post, zeros, 0.0, 0.0)
  biased = true_logits(w, w.user_taste_UL[:8], post, zeros, 0.0, 0.75)
  np.testing.assert_allclose((biased - base)[:, ~negative], 0.75, rtol=1e-5)
  np.testing.assert_allclose((biased - base)[:, negative], 0.0, atol=1e-6)
  effect = np.asarray(w.surface_effect_VA)
  shown = true_logits(w, w.user_taste_UL[:8], post, jnp.full(8, 3), 0.0, 0.0)
  np.testing.assert_allclose(shown - base, np.broadcast_to(effect[3] - effect[0], (8, 19)),
                             atol=1e-5)
  assert np.all(np.abs(effect[3] - effect[0]) > 1e-3)


def test_min_candidates_gives_every_list_width_from_min_to_c():
  """With min_candidates set, a list's valid count is uniform in [min_candidates, C]:
  every width comes up, C included."""
  sb = sample(world(), SplitConfig(min_candidates=3), 256, jax.random.PRNGKey(6))
  count = np.asarray(sb.candidate_mask).sum(1)
  assert set(np.unique(count)) == set(range(3, SMALL.num_candidates + 1))
  assert np.all(np.abs(np.bincount(count)[3:] / 256 - 0.25) < 0.17)


def test_post_age_reaches_candidate_and_history_actions():
  """With post_age, the candidates' probabilities are the link's at the ages their
  timestamps give, and history items' positive actions decay with their (unseen) ages too:
  from the same key they fire at a subset of the ageless world's slots, far fewer of them,
  while negative actions are untouched."""
  w = world()
  aged = dataclasses.replace(w, cfg=dataclasses.replace(SMALL, post_age=True,
                                                        age_decay_per_day=2.0))
  sb = sample(w, SplitConfig(), BIG, jax.random.PRNGKey(2))
  sb_aged = sample(aged, SplitConfig(), BIG, jax.random.PRNGKey(2))
  np.testing.assert_array_equal(sb_aged.candidate_post_ids, sb.candidate_post_ids)
  np.testing.assert_allclose(_probs_from_history(aged, sb_aged, sb_aged.history_post_ids),
                             sb_aged.probs, atol=1e-5)
  assert np.all(np.asarray(sb_aged.probs[..., 0]) < np.asarray(sb.probs[..., 0]))
  negative = np.isin(np.arange(SMALL.num_actions), SMALL.negative_actions)
  h, h_aged = np.asarray(sb.batch.history_actions), np.asarray(sb_aged.batch.history_actions)
  np.testing.assert_array_equal(h_aged[..., negative], h[..., negative])
  assert np.all(h_aged <= h)
  assert h_aged[..., ~negative].sum() < 0.8 * h[..., ~negative].sum()


@functools.lru_cache(maxsize=None)
def _taste_led_batch():
  """Histories of one topic drawn from the taste (no exploring, no switching), lists with
  half their candidates relevant, all of those from the session topic."""
  cfg = dataclasses.replace(SMALL, explore_prob=0.0, topic_switch_prob=0.0)
  w = dataclasses.replace(world(), cfg=cfg)
  split = SplitConfig(relevant_fraction=0.5, list_correlation=1.0)
  return sample(w, split, BIG, jax.random.PRNGKey(7))


def test_history_and_session_topics_are_drawn_from_the_taste():
  """A history's topic chain (explore_prob 0, topic_switch_prob 0: one topic) and a list's
  session topic are draws from the user's taste: the taste's mean probability of the
  drawn topic is E[sum_t p_t**2] (0.49 here), not the 1/T = 0.125 of a uniform topic."""
  sb, T = _taste_led_batch(), SMALL.num_topics
  taste_BT = np.asarray(jax.nn.softmax(world().user_topic_logits_UT))[np.asarray(sb.user_ids)]
  expected = np.mean(np.sum(taste_BT ** 2, axis=1))
  rows = np.arange(BIG)
  ids, n = np.asarray(sb.history_post_ids), np.asarray(sb.history_len)
  valid = np.arange(SMALL.history_len)[None, :] < n[:, None]
  history_topic = ids[:, 0] % T
  assert np.all((ids % T == history_topic[:, None])[valid])
  assert abs(taste_BT[rows, history_topic].mean() - expected) < 0.05
  relevant = np.asarray(sb.candidate_relevant)
  lists = relevant.any(1)
  session_topic = (np.asarray(sb.candidate_post_ids) % T)[rows, relevant.argmax(1)]
  assert abs(taste_BT[rows, session_topic][lists].mean() - expected) < 0.05


def test_every_relevant_candidate_of_a_fully_correlated_list_has_its_session_topic():
  """list_correlation 1 with relevant_fraction 0.5: the relevant candidates of a list all
  come from its session topic, whatever the share of relevant candidates."""
  sb, T = _taste_led_batch(), SMALL.num_topics
  relevant = np.asarray(sb.candidate_relevant)
  topic = np.asarray(sb.candidate_post_ids) % T
  first = topic[np.arange(BIG), relevant.argmax(1)]
  assert np.all((topic == first[:, None])[relevant])
  assert relevant.sum() > BIG * SMALL.num_candidates * 0.4


@functools.lru_cache(maxsize=None)
def _interest_led_batch():
  """One uniformly drawn history topic per user (explore_prob 1, no switching), an
  interest of the history alone (interest_mix 1), relevant candidates only, in draw order
  (grouped with every candidate relevant)."""
  cfg = dataclasses.replace(SMALL, explore_prob=1.0, topic_switch_prob=0.0, interest_mix=1.0)
  w = dataclasses.replace(world(), cfg=cfg)
  split = SplitConfig(relevant_fraction=1.0, candidate_order="grouped")
  return sample(w, split, BIG, jax.random.PRNGKey(4))


def test_relevant_candidates_follow_the_interest_not_the_taste():
  """Without list correlation a relevant candidate's topic is drawn by its affinity with
  the interest: with the interest all history, of one topic drawn without the taste, most
  candidates (0.77 here) share that topic, against about 1/T by the taste."""
  sb, T = _interest_led_batch(), SMALL.num_topics
  history_topic = np.asarray(sb.history_post_ids)[:, 0] % T
  share = np.mean(np.asarray(sb.candidate_post_ids) % T == history_topic[:, None])
  assert share > 0.5, share


def test_candidate_labels_are_independent_of_history_actions():
  """A candidate's labels use uniforms of their own: a history item's actions and the
  labels of the candidate in the same slot co-occur no more than with another slot's."""
  sb, C = _interest_led_batch(), SMALL.num_candidates
  history_BCA = np.asarray(sb.batch.history_actions)[:, :C]
  labels_BCA = np.asarray(sb.labels)
  valid_BC = np.arange(C)[None, :] < np.asarray(sb.history_len)[:, None]
  valid = np.broadcast_to(valid_BC[..., None], labels_BCA.shape)
  excess = (history_BCA * (labels_BCA - np.roll(labels_BCA, 1, axis=1)))[valid]
  assert abs(excess.mean()) < 0.006, excess.mean()


def test_interest_mix_weighs_the_history_against_the_taste():
  """interest_mix 0: the interest is the taste whatever the history; 1: the recency-
  weighted mean of the history's post vectors alone."""
  w = world()
  users, lengths = jnp.arange(4), jnp.array([1, 3, 5, 12])
  ids = jax.random.randint(jax.random.PRNGKey(8), (4, SMALL.history_len), 0, SMALL.num_posts)
  mix = lambda m: dataclasses.replace(w, cfg=dataclasses.replace(SMALL, interest_mix=m))
  np.testing.assert_allclose(user_interest(mix(0.0), users, ids, lengths),
                             w.user_taste_UL[users], atol=1e-6)
  weights = history_weights(lengths, SMALL.history_len, SMALL.recency_decay)
  mean = (np.einsum("bs,bsl->bl", weights, np.asarray(w.post_vecs_PL)[np.asarray(ids)])
          / np.asarray(weights).sum(1, keepdims=True))
  np.testing.assert_allclose(user_interest(mix(1.0), users, ids, lengths), mean, atol=1e-5)
