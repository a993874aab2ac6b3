"""Ranking metrics computed on device: every function is jittable, and every one over
candidate lists takes a mask (`corpus_hits` takes the positives, already masked).

Shapes: B lists, C candidates per list, A actions; `mask [B, C]` marks valid candidates.
Tied scores never favour a slot or an id: the rank metrics count the expectation over a
uniformly random order of the tied entries.

A metric that is undefined (no positive, a NaN score) is NaN by design, so each public
function that returns metrics runs with `jax_debug_nans` off: called eagerly under
`JAX_DEBUG_NANS=1` it would otherwise raise at its first NaN constant. A jitted function
of your own that returns such a NaN still trips the check when it returns; call it under
`jax.debug_nans(False)`, as `Trainer.evaluate` does.
"""

from __future__ import annotations

import collections.abc
import functools
import numbers
from typing import Optional, Sequence, Union

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array

from phoenix_flax.inference import ACTIONS, PRIMARY_ACTION
from phoenix_flax.training.loss import binary_cross_entropy, is_positive


def _nan_means_undefined(fn):
  """`fn` run with `jax_debug_nans` off (the module docstring says why)."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.debug_nans(False):
      return fn(*args, **kwargs)
  return wrapped


def _undefined_if_nan(value: Array, scores: Array, mask: Array) -> Array:
  """`value`, or NaN when the score of a valid entry (`mask`, broadcast against `scores`)
  is NaN: a model gone non-finite, whose order is undefined."""
  return jnp.where(jnp.any(jnp.isnan(scores) & jnp.asarray(mask, bool)), jnp.nan, value)


def per_count(total: Array, count: Array) -> Array:
  """`total / max(count, 1)`: a float total over an integer count, the count converted to
  the total's dtype first (what JAX's promotion does, written out so that it holds under
  `jax_numpy_dtype_promotion="strict"` too)."""
  total = jnp.asarray(total)
  return total / jnp.maximum(count, 1).astype(total.dtype)


@_nan_means_undefined
def roc_auc(scores_N: Array, labels_N: Array, mask_N: Array) -> tuple[Array, Array]:
  """Exact ROC-AUC (Mann-Whitney U, tied scores count 1/2) over the masked entries.

  Returns `(auc, valid)`; `valid` is False unless there is at least one positive (label
  > 0.5) and one negative (it depends on the labels only), and `auc` is then NaN (null in
  JSON), not a number that could pass for chance. A NaN score among the masked entries
  (a model gone non-finite) leaves the order undefined: `auc` is NaN there too. O(N log
  N): each positive counts the negatives below and tied with it by binary search in the
  sorted negative scores.
  """
  scores_N = jnp.asarray(scores_N, jnp.float32)
  mask_N = jnp.asarray(mask_N, bool)
  positive_N = is_positive(labels_N)
  pos_N, neg_N = mask_N & positive_N, mask_N & ~positive_N
  n_pos, n_neg = jnp.sum(pos_N, dtype=jnp.int32), jnp.sum(neg_N, dtype=jnp.int32)
  sorted_neg_N = jnp.sort(jnp.where(neg_N, scores_N, jnp.inf))
  below_N = jnp.searchsorted(sorted_neg_N, scores_N, side="left")
  at_or_below_N = jnp.minimum(jnp.searchsorted(sorted_neg_N, scores_N, side="right"), n_neg)
  # Counts in float32 before the arithmetic: Python floats with integer arrays make the
  # default float type, float64 with `jax_enable_x64` on.
  f32 = lambda x: x.astype(jnp.float32)
  wins_N = per_count(f32(below_N) + 0.5 * f32(at_or_below_N - below_N), n_neg)
  valid = (n_pos > 0) & (n_neg > 0)
  auc = per_count(jnp.sum(jnp.where(pos_N, wins_N, 0.0)), n_pos)
  return _undefined_if_nan(jnp.where(valid, auc, jnp.nan), scores_N, mask_N), valid


@_nan_means_undefined
def list_auc(scores_BC: Array, labels_BC: Array, mask_BC: Array) -> Array:
  """The mean of each list's own ROC-AUC (`roc_auc` within one user's candidates) over the
  lists that have a positive and a negative: how well a user's candidates are ordered
  among themselves, which the global AUC mixes with differences between users. NaN when
  no list has both, or when a score of such a list is NaN."""
  auc_B, valid_B = jax.vmap(roc_auc)(scores_BC, labels_BC, mask_BC)
  return _mean_valid(auc_B, valid_B)


@_nan_means_undefined
def per_action_auc(scores_BCA: Array, labels_BCA: Array, mask_BC: Array
                   ) -> tuple[Array, Array]:
  """ROC-AUC of each action over all valid candidates of the batch: `(auc [A], valid [A])`."""
  A = scores_BCA.shape[-1]
  mask_N = jnp.broadcast_to(mask_BC, scores_BCA.shape[:-1]).reshape(-1)
  return jax.vmap(roc_auc, in_axes=(1, 1, None))(scores_BCA.reshape(-1, A),
                                                  labels_BCA.reshape(-1, A), mask_N)


def _masked_mean(x_BCA: Array, mask_BC: Array) -> Array:
  """Mean over the valid candidates' entries; NaN when there is none."""
  m_BCA = jnp.broadcast_to(mask_BC[..., None], x_BCA.shape)
  n = jnp.sum(m_BCA)
  return jnp.where(n > 0, per_count(jnp.sum(jnp.where(m_BCA, x_BCA, 0.0)), n), jnp.nan)


@_nan_means_undefined
def log_loss(logits_BCA: Array, labels_BCA: Array, mask_BC: Array) -> Array:
  """Mean binary cross-entropy with logits over valid candidates and all actions; an
  infinite logit counts its limit (0 where the label agrees, +inf where it does not).
  NaN when no candidate is valid (not 0, which would read as a perfect fit)."""
  logits_BCA = jnp.asarray(logits_BCA, jnp.float32)
  labels_BCA = jnp.asarray(labels_BCA, jnp.float32)   # (float64 ones, under x64, promoted)
  bce_BCA = jax.nn.softplus(logits_BCA) - labels_BCA * logits_BCA
  plain = _masked_mean(bce_BCA, mask_BC)
  # `softplus(x) - y x` is inf - inf or 0 * inf at an infinite x: such entries take the
  # limit (the training loss's BCE gives it) instead, in a second sum used only when there
  # is one (the first, which every finite evaluation returns, keeps its rounding).
  inf_BCA = jnp.isinf(logits_BCA)
  limit_BCA = binary_cross_entropy(logits_BCA, labels_BCA)
  any_inf = jnp.any(inf_BCA & jnp.broadcast_to(mask_BC[..., None], inf_BCA.shape))
  return jnp.where(any_inf, _masked_mean(jnp.where(inf_BCA, limit_BCA, bce_BCA), mask_BC),
                   plain)


@_nan_means_undefined
def calibration_error(probs_BCA: Array, labels_BCA: Array, mask_BC: Array,
                      num_bins: int = 10) -> Array:
  """Expected calibration error: predictions of all actions pooled into `num_bins` equal
  bins of [0, 1]; the count-weighted mean |mean prob - label rate| over the bins. NaN
  when no candidate is valid."""
  w_N = jnp.broadcast_to(mask_BC[..., None], probs_BCA.shape).reshape(-1).astype(jnp.float32)
  # Padded entries are zeroed, not only weighted by 0: 0 * NaN would still be NaN.
  p_N = jnp.where(w_N > 0, jnp.asarray(probs_BCA, jnp.float32).reshape(-1), 0.0)
  y_N = jnp.where(w_N > 0, jnp.asarray(labels_BCA, jnp.float32).reshape(-1), 0.0)
  bin_N = jnp.clip(jnp.floor(p_N * num_bins).astype(jnp.int32), 0, num_bins - 1)
  # Each bin sums prob - label (small, of either sign), not probs and labels apart, whose
  # large totals cancel; and it sums by masked reduction, not `segment_sum`. That is a
  # float scatter-add: serial on CPU, where over 300k entries it was 0.1% off, and by
  # atomics in varying order on GPU, where the same predictions gave errors differing in
  # the 7th digit from run to run.
  in_bin_NK = bin_N[:, None] == jnp.arange(num_bins, dtype=jnp.int32)[None, :]
  gap_K = jnp.sum(jnp.where(in_bin_NK, (p_N - y_N)[:, None], 0.0), axis=0)  # padding: 0
  n = jnp.sum(w_N)
  return jnp.where(n > 0, jnp.sum(jnp.abs(gap_K)) / jnp.maximum(n, 1.0), jnp.nan)


def _rank_spans(scores_BC: Array, mask_BC: Array) -> tuple[Array, Array]:
  """Per candidate, how many valid candidates of its list score strictly higher (`above`)
  and how many score the same, itself included (`tied`, at least 1). Under a uniformly
  random order of tied scores a valid candidate takes each rank of `[above, above + tied)`
  with equal chance; padding ranks after every valid candidate. Counted by binary search
  in each list's sorted scores (O(C log C) per list; comparing every pair of candidates
  took memory quadratic in C, 8 GiB for 256 lists of 2048)."""
  C = scores_BC.shape[-1]
  mask_BC = jnp.asarray(mask_BC, bool)
  s_BC = jnp.where(mask_BC, jnp.asarray(scores_BC, jnp.float32), -jnp.inf)   # padding lowest
  sorted_BC = jnp.sort(s_BC, axis=-1)
  find = lambda side: jax.vmap(lambda row, v: jnp.searchsorted(row, v, side=side))(sorted_BC,
                                                                                  s_BC)
  at_or_below_BC, below_BC = find("right"), find("left")
  # Padding never scores above a candidate; it ties only with a valid score of -inf.
  padded_BC = C - jnp.sum(mask_BC, axis=-1, keepdims=True, dtype=jnp.int32)
  padded_ties_BC = jnp.where(s_BC == -jnp.inf, padded_BC, 0)
  tied_BC = at_or_below_BC - below_BC - padded_ties_BC
  return C - at_or_below_BC, jnp.maximum(tied_BC, 1)


def _expected_in_top_k(scores_BC: Array, mask_BC: Array, k: int) -> tuple[Array, Array]:
  """Per valid candidate, under a uniformly random order of tied scores: the chance that
  it ranks in the top k, and its expected discount `[rank < k] / log2(rank + 2)` (rank
  counted from 0; both 0 for padding). Without ties: the indicator of the top k and the
  discount of its rank."""
  C = scores_BC.shape[-1]
  above_BC, tied_BC = _rank_spans(scores_BC, mask_BC)
  chance_BC = per_count(jnp.clip(k - above_BC, 0, tied_BC).astype(jnp.float32), tied_BC)
  rank_R = jnp.arange(C, dtype=jnp.float32)
  discount_R = jnp.where(rank_R < k, 1.0 / jnp.log2(rank_R + 2.0), 0.0)
  cumulative_R = jnp.concatenate([jnp.zeros(1, jnp.float32),   # [C + 1]
                                  jnp.cumsum(discount_R)])
  span_BC = cumulative_R[above_BC + tied_BC] - cumulative_R[above_BC]
  valid_BC = jnp.asarray(mask_BC, bool)
  return (jnp.where(valid_BC, chance_BC, 0.0),
          jnp.where(valid_BC, per_count(span_BC, tied_BC), 0.0))


@_nan_means_undefined
def ndcg_at_k(scores_BC: Array, gains_BC: Array, mask_BC: Array, k: int) -> Array:
  """NDCG@k with linear gains and 1/log2(rank+1) discounts (rank counted from 1),
  averaged over the lists whose ideal DCG is positive (0 when there is none; scikit-learn's
  `ndcg_score` counts such lists as 0 in its mean instead). Tied scores count at their
  expected value over a random order of the tie (as `ndcg_score` does), so neither the
  candidates' slots nor their order decide a tie. A NaN score of a valid candidate leaves
  the order undefined: NaN (as `roc_auc`)."""
  k = min(k, scores_BC.shape[-1])
  gains_BC = jnp.where(mask_BC, jnp.asarray(gains_BC, jnp.float32), 0.0)
  _, discount_BC = _expected_in_top_k(scores_BC, mask_BC, k)
  dcg_B = jnp.sum(gains_BC * discount_BC, axis=-1)
  ideal_discount_K = 1.0 / jnp.log2(jnp.arange(k, dtype=jnp.float32) + 2.0)
  ideal_B = jnp.sum(-jnp.sort(-gains_BC, axis=-1)[:, :k] * ideal_discount_K[None, :], axis=-1)
  has_B = ideal_B > 0
  ndcg_B = jnp.where(has_B, dcg_B / jnp.where(has_B, ideal_B, 1.0), 0.0)
  return _undefined_if_nan(per_count(jnp.sum(ndcg_B), jnp.sum(has_B)), scores_BC,
                           mask_BC)


@_nan_means_undefined
def recall_at_k(scores_BC: Array, relevant_BC: Array, mask_BC: Array, k: int) -> Array:
  """Share of each list's relevant valid candidates ranked in its top k, averaged over
  the lists with at least one relevant candidate (0 when there is none). A tie across the
  k-th rank counts at its expected value over a random order of the tie. NaN when a
  valid candidate's score is NaN."""
  k = min(k, scores_BC.shape[-1])
  relevant_BC = jnp.asarray(relevant_BC, bool) & jnp.asarray(mask_BC, bool)
  chance_BC, _ = _expected_in_top_k(scores_BC, mask_BC, k)
  hits_B = jnp.sum(jnp.where(relevant_BC, chance_BC, 0.0), axis=-1)
  total_B = jnp.sum(relevant_BC, axis=-1)
  has_B = total_B > 0
  recall_B = jnp.where(has_B, per_count(hits_B, total_B), 0.0)
  return _undefined_if_nan(per_count(jnp.sum(recall_B), jnp.sum(has_B)), scores_BC,
                           mask_BC)


@_nan_means_undefined
def corpus_hits(scores_BN: Array, ids_BC: Array, positive_BC: Array, ks: Sequence[int]
                ) -> tuple[Array, Array]:
  """Retrieval against a corpus of N items scored `scores_BN` for each list: for each k of
  `ks`, the expected number of the list's positive candidates whose post id (`ids_BC`, a
  corpus row) is among the k best-scored items, and how many positives the list has.
  Returns `found [B, len(ks)]` (floats) and `total [B]`; recall@k of a list is their
  ratio. Items tied with the k-th score share the places left at random (a constant score
  finds k/N of the positives whatever their ids), where `lax.top_k` would keep the lowest
  ids. A positive whose id is not a corpus row is never found; a list with a NaN score
  has an undefined order, and NaN `found`. Scores `[1, N]` are one ranking for every
  list, ranked once (not broadcast to `[B, N]` first)."""
  ks = tuple(int(k) for k in ks)
  N = scores_BN.shape[1]
  if not ks or min(ks) < 1 or max(ks) > N:
    raise ValueError(f"ks={ks} must lie in [1, corpus size {N}]")
  # One materialised array: the k-th score and each positive's own score must be the same
  # bits, not two fusions' recomputations of them.
  scores_BN = jax.lax.optimization_barrier(scores_BN)
  kth_BK = jax.lax.top_k(scores_BN, max(ks))[0][:, jnp.asarray(ks) - 1]
  at_BC = jnp.clip(ids_BC, 0, N - 1)
  own_BC = (scores_BN[0][at_BC] if scores_BN.shape[0] == 1
            else jnp.take_along_axis(scores_BN, at_BC, axis=1))
  counted_BC = positive_BC & (ids_BC >= 0) & (ids_BC < N)
  undefined_B1 = jnp.any(jnp.isnan(scores_BN), axis=1, keepdims=True)
  found = []
  for j, k in enumerate(ks):
    kth_B1 = kth_BK[:, j, None]
    above_B1 = jnp.sum(scores_BN > kth_B1, axis=1, keepdims=True)
    tied_B1 = jnp.sum(scores_BN == kth_B1, axis=1, keepdims=True)
    share_B1 = per_count(jnp.clip(k - above_B1, 0, tied_B1).astype(jnp.float32), tied_B1)
    in_top_BC = jnp.where(own_BC > kth_B1, 1.0, jnp.where(own_BC == kth_B1, share_B1, 0.0))
    found.append(jnp.where(undefined_B1[:, 0], jnp.nan,
                           jnp.sum(jnp.where(counted_BC, in_top_BC, 0.0), axis=1)))
  return jnp.stack(found, axis=1), jnp.sum(positive_BC, axis=1)


def _mean_valid(values_A: Array, valid_A: Array) -> Array:
  """Mean over the valid entries; NaN when there is none."""
  mean = per_count(jnp.sum(jnp.where(valid_A, values_A, 0.0)), jnp.sum(valid_A))
  return jnp.where(jnp.any(valid_A), mean, jnp.nan)


@_nan_means_undefined
def ranking_metrics(logits_BCA: Array, labels_BCA: Array, probs_BCA: Optional[Array],
                    mask_BC: Array, k: Union[int, Sequence[int]] = 5,
                    action_names: Optional[Sequence[str]] = None) -> dict[str, Array]:
  """The model's metrics next to the Bayes-optimal ones (the generator's true `probs`).

  Data without true probabilities (your own logs) passes `probs_BCA=None`: the keys that
  need them (`bayes_*`, `auc_gap`) are left out, and `ndcg@k` takes the favorite label as
  its gain instead of the true favorite probability.

  Keys: `auc_mean` / `bayes_auc_mean` (mean over actions that have positives and
  negatives in the batch; NaN if none has), `auc_gap` (Bayes minus model), `logloss` /
  `bayes_logloss` (mean binary cross-entropy over valid candidates and all actions; the
  Bayes one clips the true probabilities to [1e-7, 1 - 1e-7] in float32),
  `calibration_error` (`calibration_error`: every action's predictions pooled),
  `list_auc` / `bayes_list_auc` (the favorite's AUC within each list, averaged over the
  lists with a favorited and a not-favorited candidate: `list_auc`), `ndcg@k` of the
  favorite ranking with the true favorite probability as gain (1.0 = Bayes order),
  `recall@k` / `bayes_recall@k` of the favorited candidates (favorite label a positive),
  for each `k` (an int or several; a k at or above a list's size ranks the whole list, so
  its recall is 1.0), `num_valid_actions`, and `auc/<action>` and
  `bayes_auc/<action>` per action (NaN, null in JSON, where the action is not valid: no
  positive or no negative among the lists). Which actions are valid depends on the
  labels only, so the Bayes figures never depend on the model. A NaN logit of a valid
  candidate (a diverged model), of any action, makes every model metric NaN (null in
  JSON), the other actions' `auc/<action>` too, never a number computed over the rest.
  The AUCs but `list_auc` pool every valid candidate of every list given (the runner
  passes all its evaluation batches at once): a global AUC, which compares candidates
  across users; `list_auc` is the mean of per-list AUCs.

  "The favorite" is action `PRIMARY_ACTION` (index 0, `favorite_score`, which orders the
  release's ranking), whatever `action_names` calls it: put the action the list metrics
  should rank by first. A label counts as a positive above one half (`is_positive`).
  Shapes are checked with chex (an `AssertionError` naming the argument): a `[B]` mask
  would otherwise broadcast over the candidates when B equals C.
  """
  chex.assert_rank(logits_BCA, 3, custom_message="ranking_metrics: logits must be [B, C, A]")
  B, C, A = logits_BCA.shape
  chex.assert_shape(labels_BCA, (B, C, A), custom_message="ranking_metrics: labels")
  if probs_BCA is not None:
    chex.assert_shape(probs_BCA, (B, C, A), custom_message="ranking_metrics: probs")
  chex.assert_shape(mask_BC, (B, C), custom_message="ranking_metrics: mask")
  names = action_names or (ACTIONS if A == len(ACTIONS) else
                           tuple(f"action_{i}" for i in range(A)))
  if len(names) != A:
    raise ValueError(f"action_names has {len(names)} names for {A} actions")
  ks = (k,) if isinstance(k, numbers.Integral) else ()
  if isinstance(k, collections.abc.Sequence) and not isinstance(k, str):   # (a range too)
    ks = tuple(k)
  if not ks or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool)
                       and x >= 1 for x in ks):
    raise ValueError(f"k must be an integer >= 1 or a non-empty sequence of them, got {k!r}")
  ks = tuple(dict.fromkeys(int(x) for x in ks))
  logits_BCA = jnp.asarray(logits_BCA, jnp.float32)
  has_probs = probs_BCA is not None
  auc_A, valid_A = per_action_auc(logits_BCA, labels_BCA, mask_BC)
  auc_mean = _mean_valid(auc_A, valid_A)
  F = PRIMARY_ACTION
  favorite_BC = is_positive(labels_BCA[..., F])
  model = lambda x: _undefined_if_nan(x, logits_BCA, jnp.asarray(mask_BC, bool)[..., None])
  out = {"auc_mean": model(auc_mean)}
  if has_probs:
    probs_BCA = jnp.asarray(probs_BCA, jnp.float32)
    bayes_A, _ = per_action_auc(probs_BCA, labels_BCA, mask_BC)
    bayes_mean = _mean_valid(bayes_A, valid_A)
    clipped_BCA = jnp.clip(probs_BCA, 1e-7, 1.0 - 1e-7)
    bayes_logits_BCA = jnp.log(clipped_BCA) - jnp.log1p(-clipped_BCA)
    out["bayes_auc_mean"] = bayes_mean
    out["auc_gap"] = model(bayes_mean - auc_mean)
  out["logloss"] = model(log_loss(logits_BCA, labels_BCA, mask_BC))
  if has_probs:
    out["bayes_logloss"] = log_loss(bayes_logits_BCA, labels_BCA, mask_BC)
  out["calibration_error"] = model(calibration_error(jax.nn.sigmoid(logits_BCA), labels_BCA,
                                                     mask_BC))
  gains_BC = probs_BCA[..., F] if has_probs else favorite_BC
  out["list_auc"] = model(list_auc(logits_BCA[..., F], labels_BCA[..., F], mask_BC))
  if has_probs:
    out["bayes_list_auc"] = list_auc(probs_BCA[..., F], labels_BCA[..., F], mask_BC)
  for k in ks:
    out[f"ndcg@{k}"] = model(ndcg_at_k(logits_BCA[..., F], gains_BC, mask_BC, k))
    out[f"recall@{k}"] = model(recall_at_k(logits_BCA[..., F], favorite_BC, mask_BC, k))
    if has_probs:
      out[f"bayes_recall@{k}"] = recall_at_k(probs_BCA[..., F], favorite_BC, mask_BC, k)
  out["num_valid_actions"] = jnp.sum(valid_A).astype(jnp.float32)
  for i, name in enumerate(names):
    out[f"auc/{name}"] = model(auc_A[i])
    if has_probs:
      out[f"bayes_auc/{name}"] = bayes_A[i]
  return out
