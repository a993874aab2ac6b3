"""On-device metrics against direct numpy references (pairwise AUC, loops over lists)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phoenix_flax as pf
from phoenix_flax.training import metrics


def pairwise_auc(scores, labels, mask):
  """O(n^2) reference: P(score_pos > score_neg) + 1/2 P(tie) over valid pairs."""
  s, y, m = np.asarray(scores, np.float64), np.asarray(labels) > 0.5, np.asarray(mask, bool)
  pos, neg = s[m & y], s[m & ~y]
  if len(pos) == 0 or len(neg) == 0:
    return float("nan"), False
  diff = pos[:, None] - neg[None, :]
  return float(np.mean((diff > 0) + 0.5 * (diff == 0))), True


def random_case(seed, n=300, levels=7, pos_rate=0.3, mask_rate=0.8):
  rng = np.random.default_rng(seed)
  scores = rng.integers(0, levels, n).astype(np.float32) / levels  # many ties
  labels = (rng.random(n) < pos_rate).astype(np.float32)
  mask = rng.random(n) < mask_rate
  scores[~mask] = rng.normal(size=(~mask).sum()) * 100  # masked entries must not matter
  return scores, labels, mask


auc_jit = jax.jit(metrics.roc_auc)
# Jitted: eagerly, each of the metrics' many small ops compiles on its own.
ranking_metrics_jit = jax.jit(metrics.ranking_metrics, static_argnames=("k", "action_names"))
ndcg_at_k_jit = jax.jit(metrics.ndcg_at_k, static_argnums=3)
recall_at_k_jit = jax.jit(metrics.recall_at_k, static_argnums=3)


@pytest.mark.parametrize("seed,levels", [(0, 7), (1, 2), (2, 1000), (3, 1)])
def test_roc_auc_matches_pairwise_reference_with_ties_and_mask(seed, levels):
  scores, labels, mask = random_case(seed, levels=levels)
  auc, valid = auc_jit(scores, labels, mask)
  ref, ref_valid = pairwise_auc(scores, labels, mask)
  assert bool(valid) == ref_valid
  np.testing.assert_allclose(float(auc), ref, atol=1e-6)


def test_roc_auc_invalid_and_nan():
  scores = np.array([0.1, 0.4, np.nan, 0.9], np.float32)
  auc, valid = auc_jit(scores, np.array([1, 1, 1, 1], np.float32), np.ones(4, bool))
  assert np.isnan(float(auc)) and not bool(valid)   # no negative: not valid, no number
  # A NaN score of a valid entry leaves the order undefined; validity is the labels'.
  auc, valid = auc_jit(scores, np.array([1, 0, 0, 1], np.float32), np.ones(4, bool))
  assert bool(valid) and np.isnan(float(auc))
  masked = np.array([True, True, False, True])      # a padded NaN does not count
  auc, valid = auc_jit(scores, np.array([1, 0, 0, 1], np.float32), masked)
  assert bool(valid) and float(auc) == pytest.approx(pairwise_auc([0.1, 0.4, 0.9], [1, 0, 1],
                                                                   np.ones(3))[0])
  auc, valid = auc_jit(np.array([1.0, -np.inf, np.inf], np.float32), np.array([1, 0, 0]),
                       np.ones(3, bool))
  assert bool(valid) and float(auc) == pytest.approx(0.5)


def test_roc_auc_with_infinite_scores_stays_a_probability():
  """Padding sorts the negatives behind +inf: a positive at +inf beats every negative
  (1.0, not more) and ties one at +inf (1/2), whatever the padding."""
  mask = np.array([True, True, True, False, False])
  scores = np.array([np.inf, 0.0, 1.0, 5.0, np.inf], np.float32)
  auc, valid = auc_jit(scores, np.array([1, 0, 0, 1, 0], np.float32), mask)
  assert bool(valid) and float(auc) == 1.0
  scores = np.array([np.inf, np.inf, 1.0, 5.0, np.inf], np.float32)
  auc, _ = auc_jit(scores, np.array([1, 0, 0, 1, 0], np.float32), mask)
  assert float(auc) == pytest.approx(0.75)       # (1/2 + 1) / 2


def test_ranking_metrics_of_a_non_finite_model():
  """A diverged model's metrics are NaN, never numbers over the finite rest; the Bayes
  figures are the world's whatever the model."""
  rng = np.random.default_rng(7)
  B, C, A = 8, 6, 3
  logits = rng.normal(size=(B, C, A)).astype(np.float32)
  labels = (rng.random((B, C, A)) < 0.4).astype(np.float32)
  probs = rng.random((B, C, A)).astype(np.float32)
  mask = np.ones((B, C), bool)
  fine = ranking_metrics_jit(logits, labels, probs, mask, k=3)
  one_action = logits.copy()
  one_action[5, 2, 2] = np.nan     # one logit of the last action: every action's AUC too
  for broken in (np.full_like(logits, np.nan), np.where(np.arange(B)[:, None, None] < 4,
                                                         np.nan, logits), one_action):
    got = ranking_metrics_jit(broken, labels, probs, mask, k=3)
    # Every metric of the model is NaN (a new one too); the generator's are untouched.
    generator = {k for k in got if k.startswith("bayes_")} | {"num_valid_actions"}
    assert {"auc_mean", "auc_gap", "logloss", "calibration_error", "ndcg@3", "recall@3",
            "auc/action_2"} <= set(got) - generator
    for key in set(got) - generator:
      assert np.isnan(float(got[key])), key
    for key in generator:
      assert float(got[key]) == pytest.approx(float(fine[key])), key
  # NaN logits of padded candidates are no divergence: every metric is the one over the
  # valid candidates.
  mask[:, -2:] = False
  fine = ranking_metrics_jit(logits, labels, probs, mask, k=3)
  got = ranking_metrics_jit(np.where(mask[..., None], logits, np.nan), labels, probs, mask,
                                k=3)
  for key, value in fine.items():
    assert np.isfinite(float(got[key])) and float(got[key]) == pytest.approx(float(value)), key


def test_list_metrics_of_a_nan_score_and_of_no_candidate_are_nan():
  """Called directly (not through `ranking_metrics`, which guards every model metric): a
  NaN score of a valid candidate has no rank, and nothing valid has no log-loss or
  calibration error; neither reads as a perfect 1.0 or 0.0."""
  scores = np.array([[np.nan, 0.5, 0.1], [0.3, 0.2, np.nan]], np.float32)
  relevant = np.array([[True, False, False], [True, False, False]])
  gains = relevant.astype(np.float32)
  mask = np.array([[True, True, True], [True, True, False]])
  for k in (1, 2):
    assert np.isnan(float(ndcg_at_k_jit(scores, gains, mask, k)))
    assert np.isnan(float(recall_at_k_jit(scores, relevant, mask, k)))
  # A NaN of a padded candidate is no NaN rank: list 1 alone, its favorite ranked first.
  mask[0] = False
  assert float(ndcg_at_k_jit(scores, gains, mask, 1)) == 1.0
  assert float(recall_at_k_jit(scores, relevant, mask, 1)) == 1.0
  # list_auc: a NaN score in one of two lists with a positive and a negative.
  two = np.array([[2.0, 1.0, 0.0], [np.nan, 1.0, 0.0]], np.float32)
  labels = np.array([[1, 0, 0], [1, 0, 1]], np.float32)
  assert np.isnan(float(metrics.list_auc(two, labels, np.ones((2, 3), bool))))
  logits = np.zeros((2, 3, 4), np.float32)
  labels = np.ones((2, 3, 4), np.float32)
  none = np.zeros((2, 3), bool)
  assert np.isnan(float(metrics.log_loss(logits, labels, none)))
  assert np.isnan(float(metrics.calibration_error(logits + 0.5, labels, none)))
  one = none.copy()
  one[1, 0] = True
  assert float(metrics.log_loss(logits, labels, one)) == pytest.approx(np.log(2.0))
  assert float(metrics.calibration_error(logits + 0.5, labels, one)) == pytest.approx(0.5)


def test_ranking_metrics_checks_shapes():
  """A `[B]` or `[B, 1]` mask would broadcast over the candidates (silently when B equals
  C); probabilities or labels of another shape would pair entries wrongly."""
  B = C = 4
  logits = np.zeros((B, C, 2), np.float32)
  labels = np.ones((B, C, 2), np.float32)
  mask = np.ones((B, C), bool)
  metrics.ranking_metrics(logits, labels, labels * 0.5, mask)
  for bad_mask in (np.ones(B, bool), np.ones((B, 1), bool)):
    with pytest.raises(AssertionError, match="ranking_metrics: mask"):
      metrics.ranking_metrics(logits, labels, None, bad_mask)
  with pytest.raises(AssertionError, match="ranking_metrics: labels"):
    metrics.ranking_metrics(logits, labels[..., :1], None, mask)
  with pytest.raises(AssertionError, match="ranking_metrics: probs"):
    metrics.ranking_metrics(logits, labels, labels[:, :2], mask)
  with pytest.raises(AssertionError, match="ranking_metrics: logits"):
    metrics.ranking_metrics(logits[..., 0], labels, None, mask)


def test_per_action_auc_matches_reference():
  rng = np.random.default_rng(4)
  B, C, A = 6, 5, 4
  scores = rng.integers(0, 5, (B, C, A)).astype(np.float32)
  labels = (rng.random((B, C, A)) < 0.4).astype(np.float32)
  labels[..., 3] = 0  # an action without positives is reported invalid
  mask = rng.random((B, C)) < 0.7
  auc, valid = jax.jit(metrics.per_action_auc)(scores, labels, mask)
  for a in range(A):
    ref, ref_valid = pairwise_auc(scores[..., a].ravel(), labels[..., a].ravel(), mask.ravel())
    assert bool(valid[a]) == ref_valid
    np.testing.assert_allclose(float(auc[a]), ref, atol=1e-6)


def test_log_loss_and_calibration_match_reference():
  rng = np.random.default_rng(5)
  B, C, A = 4, 6, 3
  logits = rng.normal(size=(B, C, A)).astype(np.float32) * 3
  labels = (rng.random((B, C, A)) < 0.3).astype(np.float32)
  mask = rng.random((B, C)) < 0.6
  logits[~mask] = np.nan  # padded rows must not leak
  p = 1 / (1 + np.exp(-logits.astype(np.float64)))
  bce = -(labels * np.log(p) + (1 - labels) * np.log(1 - p))
  np.testing.assert_allclose(metrics.log_loss(logits, labels, mask), bce[mask].mean(),
                             rtol=1e-5)
  pv, yv = p[mask].ravel(), labels[mask].ravel()
  bins = np.minimum((pv * 10).astype(int), 9)
  ece = sum(abs(pv[bins == k].sum() - yv[bins == k].sum()) for k in range(10)) / len(pv)
  np.testing.assert_allclose(metrics.calibration_error(np.nan_to_num(p).astype(np.float32),
                                                       labels, mask), ece, rtol=1e-5)
  # A probability of exactly 1 (a saturated sigmoid) belongs to the top bin, [0.9, 1].
  probs = np.array([[[1.0], [0.95], [0.0]]], np.float32)
  ece = metrics.calibration_error(probs, np.array([[[1.0], [0.0], [0.0]]]), np.ones((1, 3), bool))
  assert float(ece) == pytest.approx(abs(1.95 - 1.0) / 3)
  # ... and counts there: a wrong 1.0 (label 0) beside a 0.95 with label 1 leaves the top
  # bin |(1.0 - 0) + (0.95 - 1)| = 0.95 over 2 predictions (dropping it would leave 0.05).
  ece = metrics.calibration_error(np.array([[[1.0], [0.95]]], np.float32),
                                  np.array([[[0.0], [1.0]]]), np.ones((1, 2), bool))
  assert float(ece) == pytest.approx(0.95 / 2)


def test_calibration_error_stays_accurate_over_an_evaluation_sized_batch():
  """300k well-calibrated predictions: the error is a small difference of large per-bin
  totals, which float32 sums added one by one (`segment_sum` on CPU) got 0.1% wrong."""
  rng = np.random.default_rng(0)
  p = rng.beta(0.5, 5, (512, 32, 19)).astype(np.float32)
  labels = (rng.random(p.shape) < p).astype(np.float32)
  mask = rng.random(p.shape[:2]) < 0.9
  pv = p[mask].astype(np.float64).ravel()
  gap = pv - labels[mask].ravel()
  bins = np.minimum(np.floor(p[mask].ravel() * 10).astype(int), 9)
  ece = sum(abs(gap[bins == k].sum()) for k in range(10)) / len(pv)
  got = jax.jit(metrics.calibration_error)(p, labels, mask)
  np.testing.assert_allclose(float(got), ece, rtol=1e-5)


def _tie_groups(scores):
  """(first rank, size) of each group of equal scores, best first, and each score's group."""
  values = np.unique(scores)[::-1]
  sizes = np.array([(scores == v).sum() for v in values])
  firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  return {v: (f, n) for v, f, n in zip(values, firsts, sizes)}


@pytest.mark.parametrize("seed,C,levels", [(6, 7, None), (9, 40, 3)], ids=["distinct", "ties"])
def test_ndcg_and_recall_match_reference(seed, C, levels):
  """Against loops over the lists, where a group of tied scores spanning ranks
  [first, first + size) gives each member the mean discount of those ranks, and a chance
  of (ranks of the group inside the top k) / size of being in the top k."""
  rng = np.random.default_rng(seed)
  B, k = 5, 3
  scores = (rng.normal(size=(B, C)) if levels is None
            else rng.integers(0, levels, (B, C))).astype(np.float32)
  gains = rng.random((B, C)).astype(np.float32) * (rng.random((B, C)) < 0.5)
  relevant = rng.random((B, C)) < 0.3
  mask = rng.random((B, C)) < 0.8
  gains[4] = 0  # a list without gain is skipped
  relevant[3] = False  # and one without a relevant candidate (recall averages the others)
  ndcgs, recalls = [], []
  for b in range(B):
    idx = np.flatnonzero(mask[b])
    groups = _tie_groups(scores[b, idx])
    dcg = hits = 0.0
    for i in idx:
      first, size = groups[scores[b, i]]
      ranks = np.arange(first, first + size)
      dcg += gains[b, i] * np.mean(np.where(ranks < k, 1 / np.log2(ranks + 2), 0.0))
      hits += relevant[b, i] * np.mean(ranks < k)
    ideal = np.sort(gains[b, idx])[::-1][:k]
    if ideal.sum() > 0:
      ndcgs.append(dcg / (ideal / np.log2(np.arange(len(ideal)) + 2)).sum())
    if relevant[b, idx].sum() > 0:
      recalls.append(hits / relevant[b, idx].sum())
  np.testing.assert_allclose(ndcg_at_k_jit(scores, gains, mask, k), np.mean(ndcgs),
                             rtol=1e-5)
  np.testing.assert_allclose(recall_at_k_jit(scores, relevant, mask, k), np.mean(recalls),
                             rtol=1e-5)
  assert float(ndcg_at_k_jit(gains, gains, mask, k)) == pytest.approx(1.0)
  # k beyond the list size is the whole list.
  for fn, target in ((ndcg_at_k_jit, gains), (recall_at_k_jit, relevant)):
    np.testing.assert_allclose(fn(scores, target, mask, C + 3), fn(scores, target, mask, C),
                               rtol=1e-6)
  # Slots decide nothing: the same lists with their candidates (and padding) shuffled.
  perm = rng.permutation(C)
  for fn, target in ((ndcg_at_k_jit, gains), (recall_at_k_jit, relevant)):
    np.testing.assert_allclose(fn(scores[:, perm], target[:, perm], mask[:, perm], k),
                               fn(scores, target, mask, k), rtol=1e-6)


def test_a_constant_model_gets_the_chance_level_whatever_the_order():
  """A model that scores every candidate alike ranks no better than chance, even on a
  list ordered best first (the sampler's `relevance` order): a tie broken by slot would
  give it the Bayes NDCG of 1."""
  gains = np.array([[0.9, 0.5, 0.2, 0.1, 0.0, 0.0]], np.float32)   # best first, 2 padded
  mask = np.array([[True, True, True, True, False, False]])
  constant = np.zeros_like(gains)
  discounts = 1 / np.log2(np.arange(2) + 2)
  chance = gains[0, :4].sum() * discounts.sum() / 4 / (gains[0, :2] * discounts).sum()
  assert float(ndcg_at_k_jit(constant, gains, mask, 2)) == pytest.approx(chance, rel=1e-6)
  relevant = gains > 0.4
  assert float(recall_at_k_jit(constant, relevant, mask, 2)) == pytest.approx(0.5)
  # A valid candidate scored -inf still ranks above padding: k = the valid count is 1.0.
  scores = np.array([[0.0, -np.inf, 1.0, 0.0]], np.float32)
  pad_first = np.array([[False, True, True, False]])
  assert float(recall_at_k_jit(scores, np.array([[0, 1, 0, 0]], bool), pad_first, 2)) == 1.0
  # A k beyond the list is the whole list, however large (2**31 no longer fits an int32).
  for k in (4, 5, 2**31):
    assert float(recall_at_k_jit(constant, relevant, mask, k)) == 1.0, k


def test_corpus_hits_match_reference():
  rng = np.random.default_rng(8)
  B, C, N, ks = 6, 9, 15, (1, 4, 15)
  ids = rng.integers(0, N, (B, C))              # repeats: a post can fill two slots
  positive = rng.random((B, C)) < 0.4
  positive[2] = False
  hits = jax.jit(metrics.corpus_hits, static_argnums=3)
  # Distinct scores: the positives whose id is among the k best-scored.
  scores = rng.normal(size=(B, N)).astype(np.float32)
  found, total = hits(scores, ids, positive, ks)
  np.testing.assert_array_equal(total, positive.sum(axis=1))
  for j, k in enumerate(ks):
    top = np.argsort(-scores, axis=1)[:, :k]
    expected = [sum(positive[b, c] and ids[b, c] in set(top[b]) for c in range(C))
                for b in range(B)]
    np.testing.assert_array_equal(found[:, j], expected)
  assert float(found[2].sum()) == int(total[2]) == 0
  # A constant score finds k/N of the positives, whatever their ids (top_k's order would
  # find the low ids only).
  found, _ = hits(np.zeros((B, N), np.float32), ids, positive, ks)
  np.testing.assert_allclose(found, positive.sum(1)[:, None] * np.array(ks) / N, rtol=1e-6)
  # Scores on a coarse grid (ties at the k-th place): the mean over random tie orders.
  scores = rng.integers(0, 4, (B, N)).astype(np.float32)
  found, _ = hits(scores, ids, positive, ks)
  R = 4000
  order = np.lexsort((rng.random((R, B, N)), np.broadcast_to(-scores, (R, B, N))), axis=-1)
  rank = np.argsort(order, axis=-1)                          # [R, B, N]: place of each item
  own_rank = np.take_along_axis(rank, np.broadcast_to(ids, (R, B, C)), axis=-1)
  for j, k in enumerate(ks):
    mc = ((own_rank < k) & positive).sum(-1).mean(0)
    np.testing.assert_allclose(found[:, j], mc, atol=0.05, err_msg=f"k={k}")
  assert np.any(found % 1 != 0)     # the ties did fall at the k-th place
  # One ranking for every list, given as [1, N]: what its broadcast to [B, N] finds; a NaN
  # in it leaves every list undefined.
  for shared in (scores[3], np.where(np.arange(N) == 5, np.nan, scores[3]).astype(np.float32)):
    one, _ = hits(shared[None], ids, positive, ks)
    every, _ = hits(np.broadcast_to(shared, (B, N)), ids, positive, ks)
    np.testing.assert_array_equal(one, every)
  assert np.all(np.isnan(one[positive.any(axis=1)]))
  for ks in ((16,), (0, 5), ()):   # beyond the corpus, no place at all (ks - 1 wraps), none
    with pytest.raises(ValueError, match="must lie in"):
      metrics.corpus_hits(scores, ids, positive, ks)
  # An id outside the corpus is never found (not clipped onto its last row, or for a
  # negative id its first), and a list with a NaN score has an undefined order: NaN, not a
  # count above its positives.
  found, total = hits(np.arange(5.0, dtype=np.float32)[None], np.array([[7, 4]]),
                      np.array([[True, True]]), (1,))
  assert (float(found[0, 0]), int(total[0])) == (1.0, 2)
  found, total = hits(np.arange(5.0, 0.0, -1, dtype=np.float32)[None], np.array([[-1, 3]]),
                      np.array([[True, True]]), (1,))
  assert (float(found[0, 0]), int(total[0])) == (0.0, 2)
  scores = np.array([[np.nan, 3, 2, 1, 0], [4, 3, 2, 1, 0]], np.float32)
  found, _ = hits(scores, np.array([[1, 2], [0, 2]]), np.array([[True, False], [True, True]]),
                  (2,))
  assert np.isnan(found[0, 0]) and float(found[1, 0]) == 1.0
  # ... whatever its positives: none, or none inside the corpus.
  found, total = hits(scores, np.array([[1, 9], [0, 2]]), np.array([[False, True], [True, True]]),
                      (2,))
  assert np.isnan(found[0, 0]) and int(total[0]) == 1 and float(found[1, 0]) == 1.0
  found, _ = hits(scores, np.array([[1, 2], [0, 2]]), np.zeros((2, 2), bool), (2,))
  assert np.isnan(found[0, 0]) and float(found[1, 0]) == 0.0


def test_ranking_metrics_bayes_and_keys():
  rng = np.random.default_rng(7)
  B, C, A = 16, 8, 19
  probs = rng.uniform(0.05, 0.95, (B, C, A)).astype(np.float32)
  labels = (rng.random((B, C, A)) < probs).astype(np.float32)
  mask = np.ones((B, C), bool)
  mask[:, -2:] = False
  bayes_logits = np.log(probs) - np.log1p(-probs)
  out = ranking_metrics_jit(bayes_logits, labels, probs, mask)
  assert float(out["auc_mean"]) == pytest.approx(float(out["bayes_auc_mean"]), abs=1e-6)
  assert float(out["ndcg@5"]) == pytest.approx(1.0)
  assert float(out["logloss"]) == pytest.approx(float(out["bayes_logloss"]), rel=1e-5)
  ref, _ = pairwise_auc(probs[..., 1][mask], labels[..., 1][mask], np.ones(mask.sum()))
  assert float(out["auc/reply_score"]) == pytest.approx(ref, abs=1e-6)
  worse = ranking_metrics_jit(-bayes_logits, labels, probs, mask)
  assert float(worse["auc_gap"]) > 0.1
  assert {"calibration_error", "recall@5", "bayes_recall@5", "auc/dwell_time",
          "bayes_auc/report_score", "num_valid_actions"} <= set(out)
  # The favorite's list AUC ranks each list by its true favorite probability.
  F = pf.ACTIONS.index("favorite_score")
  per_list = [pairwise_auc(probs[b, :, F][mask[b]], labels[b, :, F][mask[b]],
                           np.ones(mask[b].sum())) for b in range(B)]
  assert float(out["bayes_list_auc"]) == pytest.approx(
      np.mean([auc for auc, ok in per_list if ok]), abs=1e-6)
  assert float(worse["bayes_list_auc"]) == float(out["bayes_list_auc"])
  assert float(worse["list_auc"]) == pytest.approx(1 - float(out["list_auc"]), abs=1e-6)


def test_bayes_logloss_clips_the_true_probabilities_at_1e_7():
  """Certain true probabilities (0 or 1, a world's hard actions) give a finite Bayes
  log-loss: they are clipped to [1e-7, 1 - 1e-7] (in float32), no further."""
  probs = np.array([[[0.0, 1.0, 1e-9, 1e-5, 0.3], [1.0, 0.0, 1e-6, 0.999, 0.5]]], np.float32)
  labels = np.array([[[0, 1, 1, 0, 1], [0, 1, 0, 1, 0]]], np.float32)
  mask = np.ones((1, 2), bool)
  out = ranking_metrics_jit(np.zeros_like(probs), labels, probs, mask,
                            action_names=tuple("abcde"))
  p = np.clip(probs, np.float32(1e-7), np.float32(1 - 1e-7)).astype(np.float64)
  want = -np.mean(labels * np.log(p) + (1 - labels) * np.log1p(-p))
  assert np.isfinite(float(out["bayes_logloss"]))
  assert float(out["bayes_logloss"]) == pytest.approx(want, rel=1e-4)


def test_list_auc_is_the_mean_of_each_lists_own_auc():
  """A list's AUC orders its own candidates only: a user whose scores are all shifted up
  changes the global AUC, not the list AUC; lists without both classes are left out."""
  rng = np.random.default_rng(9)
  B, C = 6, 7
  scores = rng.normal(size=(B, C)).astype(np.float32)
  labels = (rng.random((B, C)) < 0.4).astype(np.float32)
  labels[0] = 0.0                       # no positive: left out
  labels[1] = 1.0                       # no negative: left out
  mask = np.ones((B, C), bool)
  mask[2, 5:] = False
  want = []
  for b in range(2, B):
    keep = mask[b]
    auc, _ = pairwise_auc(scores[b][keep], labels[b][keep], np.ones(keep.sum()))
    want.append(auc)
  got = jax.jit(metrics.list_auc)(scores, labels, mask)
  assert float(got) == pytest.approx(np.mean(want), abs=1e-6)
  shifted = scores + 10.0 * np.arange(B)[:, None]
  assert float(jax.jit(metrics.list_auc)(shifted, labels, mask)) == pytest.approx(
      float(got), abs=1e-6)
  assert np.isnan(float(jax.jit(metrics.list_auc)(scores, np.zeros_like(labels), mask)))


def test_ranking_metrics_without_true_probabilities():
  """Own data has labels, not the generator's probabilities: `probs=None` leaves out what
  needs them, and NDCG takes the favorite label as its gain."""
  rng = np.random.default_rng(8)
  B, C, A = 16, 8, 19
  probs = rng.uniform(0.05, 0.95, (B, C, A)).astype(np.float32)
  labels = (rng.random((B, C, A)) < probs).astype(np.float32)
  logits = rng.normal(size=(B, C, A)).astype(np.float32)
  mask = np.ones((B, C), bool)
  mask[:, -3:] = False
  full = ranking_metrics_jit(logits, labels, probs, mask, k=(2, 5))
  own = ranking_metrics_jit(logits, labels, None, mask, k=(2, 5))
  needs_probs = {key for key in full if key.startswith("bayes_") or key == "auc_gap"}
  assert needs_probs and set(own) == set(full) - needs_probs
  for key in set(own) - {"ndcg@2", "ndcg@5"}:
    assert float(own[key]) == float(full[key]), key
  for k in (2, 5):
    want = metrics.ndcg_at_k(logits[..., 0], labels[..., 0], mask, k)
    assert float(own[f"ndcg@{k}"]) == pytest.approx(float(want), abs=1e-6)
    assert float(own[f"ndcg@{k}"]) != pytest.approx(float(full[f"ndcg@{k}"]), abs=1e-3)
  # The actions a log records, sliced out and named (docs/own_data.md, favorite first):
  # each per-action AUC under its name, equal to the full call's for that action.
  logged = [0, 2, 5]
  names = tuple(pf.ACTIONS[i] for i in logged)
  sliced = ranking_metrics_jit(logits[..., logged], labels[..., logged], None, mask,
                               k=(2, 5), action_names=names)
  assert {key for key in sliced if key.startswith("auc/")} == {f"auc/{n}" for n in names}
  for name in names:
    assert float(sliced[f"auc/{name}"]) == float(own[f"auc/{name}"]), name
  # Too few names, or too many (an extra name is no action, not the clamped index's AUC
  # reported a second time).
  for given in (names[:2], names + ("extra",)):
    with pytest.raises(ValueError, match=f"action_names has {len(given)} names for 3 actions"):
      metrics.ranking_metrics(logits[..., logged], labels[..., logged], None, mask,
                              action_names=given)


def test_ranking_metrics_average_valid_actions_and_rank_favorites():
  """`auc_mean` averages the actions with positives and negatives only; recall@k is
  the one of the favorite action (index 0); the Bayes log-loss stays finite where the
  true probability is exactly 0 or 1."""
  rng = np.random.default_rng(11)
  B, C, A, k = 6, 8, 4, 3
  logits = rng.normal(size=(B, C, A)).astype(np.float32)
  probs = rng.uniform(0.05, 0.95, (B, C, A)).astype(np.float32)
  labels = (rng.random((B, C, A)) < probs).astype(np.float32)
  labels[..., 2] = 0                      # no positive: action 2 is not valid
  mask = rng.random((B, C)) < 0.8
  out = ranking_metrics_jit(logits, labels, probs, mask, k=k)
  assert float(out["num_valid_actions"]) == 3
  assert np.isnan(float(out["auc/action_2"])) and np.isnan(float(out["bayes_auc/action_2"]))
  none = ranking_metrics_jit(logits, np.zeros_like(labels), probs, mask, k=k)
  assert float(none["num_valid_actions"]) == 0
  assert np.isnan(float(none["auc_mean"])) and np.isnan(float(none["bayes_auc_mean"]))
  for prefix in ("auc", "bayes_auc"):
    valid = [float(out[f"{prefix}/action_{a}"]) for a in (0, 1, 3)]
    assert float(out[f"{prefix}_mean"]) == pytest.approx(np.mean(valid), abs=1e-6)
  favorite = labels[..., 0] > 0.5
  assert float(out[f"recall@{k}"]) == pytest.approx(
      float(recall_at_k_jit(logits[..., 0], favorite, mask, k)))
  assert float(out[f"bayes_recall@{k}"]) == pytest.approx(
      float(recall_at_k_jit(probs[..., 0], favorite, mask, k)))
  assert float(out[f"recall@{k}"]) != pytest.approx(
      float(recall_at_k_jit(logits[..., 0], labels[..., 1] > 0.5, mask, k)))
  # Several K at once give each K's metrics; a K at the list size ranks the whole list.
  several = ranking_metrics_jit(logits, labels, probs, mask, k=(1, k, C))
  for key in (f"ndcg@{k}", f"recall@{k}", f"bayes_recall@{k}"):
    assert float(several[key]) == float(out[key])
  assert float(several["recall@1"]) == pytest.approx(
      float(recall_at_k_jit(logits[..., 0], favorite, mask, 1)))
  assert float(several[f"recall@{C}"]) == 1.0 and float(several["recall@1"]) < 1.0
  # Any sequence of K (a range as well as a tuple or list), not a string:
  by_range = metrics.ranking_metrics(logits, labels, probs, mask, k=range(1, 3))
  assert {key for key in by_range if "@" in key} == {
      key for key in metrics.ranking_metrics(logits, labels, probs, mask, k=[1, 2]) if "@" in key}
  for bad in (0, (), (2, True), 2.0, "2"):
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
      metrics.ranking_metrics(logits, labels, probs, mask, k=bad)
  certain = np.where(rng.random((B, C, A)) < 0.5, labels, 1.0 - labels)   # some wrong
  out = ranking_metrics_jit(logits, labels, certain.astype(np.float32), mask, k=k)
  assert np.isfinite(float(out["bayes_logloss"]))


def test_rank_spans_count_what_comparing_every_pair_counts():
  """`_rank_spans` counts by binary search in sorted lists; per valid candidate it gives
  the counts of the pairwise definition (valid candidates strictly above, and tied with
  it), with ties, padding, and valid scores of -inf and inf."""
  rng = np.random.default_rng(0)
  rank_spans = jax.jit(metrics._rank_spans)   # one compile per shape, not one per operation
  shapes = [(1, 1), (1, 2), (2, 5), (3, 17), (4, 29)]
  for trial in range(60):
    B, C = shapes[trial % len(shapes)]
    s = rng.integers(-3, 4, size=(B, C)).astype(np.float32)
    s[rng.random((B, C)) < 0.15] = -np.inf
    s[rng.random((B, C)) < 0.1] = np.inf
    m = rng.random((B, C)) < 0.7
    above, tied = rank_spans(jnp.asarray(s), jnp.asarray(m))
    other = m[:, None, :]
    want_above = ((s[:, None, :] > s[:, :, None]) & other).sum(-1)
    want_tied = np.maximum(((s[:, None, :] == s[:, :, None]) & other).sum(-1), 1)
    np.testing.assert_array_equal(np.asarray(above)[m], want_above[m], err_msg=str(trial))
    np.testing.assert_array_equal(np.asarray(tied)[m], want_tied[m], err_msg=str(trial))


def test_metrics_called_eagerly_under_debug_nans_return_their_nans():
  """Undefined metrics are NaN by design (here: action 1 has no positive). Under
  `jax_debug_nans` an eager call raised at the first NaN constant, defined or not; each
  public function runs with the check off, so a user chasing a NaN of their own with
  `JAX_DEBUG_NANS=1` gets through an evaluation that calls them eagerly, as
  experiments/own_data.py does."""
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(3, 4, 2)), jnp.float32)
  labels = jnp.asarray(np.stack([rng.random((3, 4)) < 0.5, np.zeros((3, 4), bool)], -1))
  mask = jnp.ones((3, 4), bool)
  with jax.debug_nans(True):
    out = metrics.ranking_metrics(logits, labels, None, mask, k=2, action_names=("a", "b"))
    auc, valid = metrics.roc_auc(logits[..., 1].reshape(-1), labels[..., 1].reshape(-1),
                                 mask.reshape(-1))
    assert jax.config.jax_debug_nans
  assert np.isnan(out["auc/b"]) and np.isfinite(out["auc/a"]) and not valid and np.isnan(auc)


def test_per_count_divides_as_standard_promotion_does():
  """`per_count(total, count)`: total / max(count, 1), the integer count converted to the
  total's dtype first, so the quotient is the standard promotion's, bit for bit, and the
  session's strict promotion accepts it."""
  total = jnp.asarray([3.0, 1.0, 2.5, 1e-3], jnp.float32)
  count = jnp.asarray([2, 0, 7, 3], jnp.int32)
  with jax.numpy_dtype_promotion("standard"):
    want = total / jnp.maximum(count, 1)
  got = metrics.per_count(total, count)
  assert got.dtype == want.dtype == jnp.float32
  np.testing.assert_array_equal(got, want)


def test_metrics_are_float32_and_the_same_with_x64_on():
  """Integer counts mixed with Python floats make the default float type: with
  `jax_enable_x64` on, AUCs, NDCG, recall and corpus hits came out float64 (and rounded
  otherwise). They are float32, bit for bit those of x64 off."""
  rng = np.random.default_rng(0)
  B, C, A, N = 6, 5, 19, 40
  logits = np.round(rng.normal(size=(B, C, A)), 1).astype(np.float32)   # ties too
  labels = (rng.random((B, C, A)) < 0.4).astype(np.float32)
  probs = rng.random((B, C, A)).astype(np.float32)
  mask = rng.random((B, C)) < 0.8
  scores = np.round(rng.normal(size=(B, N)), 1).astype(np.float32)
  ids = rng.integers(0, N, (B, C)).astype(np.int32)
  @jax.jit   # traced again under x64 (one program each way, not one per operation)
  def metrics_of(logits, labels, probs, mask, scores, ids):
    out = dict(metrics.ranking_metrics(logits, labels, probs, mask, k=(2, 3)))
    out["hits"], _ = metrics.corpus_hits(scores, ids, labels[..., 0] > 0, (3, 10))
    return out
  run = lambda: jax.device_get(metrics_of(logits, labels, probs, mask, scores, ids))
  narrow = run()
  with jax.enable_x64(True):
    wide = run()
    # Float64 labels (a user's own, from NumPy) too: the log-loss came out float64.
    labels = labels.astype(np.float64)
    wide_labels = run()
  assert set(wide) == set(narrow) == set(wide_labels)
  for name, v in narrow.items():
    for found in (wide, wide_labels):
      assert found[name].dtype == v.dtype == np.float32, (name, found[name].dtype)
      np.testing.assert_array_equal(found[name], v, err_msg=name)
