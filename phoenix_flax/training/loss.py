"""Training losses: per-action BCE for ranking, in-batch sampled softmax for retrieval."""

from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array


def binary_cross_entropy(logits: Array, labels: Array) -> Array:
  """Elementwise binary cross-entropy with logits, `-y log p - (1 - y) log(1 - p)`.

  The same values as `optax.sigmoid_binary_cross_entropy` for finite logits, and the
  limits at infinite ones: 0 where the label agrees, +inf where it does not (optax's
  `0 * inf` gives NaN there, and so would `softplus(x) - y x`). Its gradient in the
  labels is `-logit` (for soft labels learned, say), at labels 0 and 1 too.
  """
  logits = jnp.asarray(logits)
  labels = jnp.asarray(labels, logits.dtype)
  # A log is set to 0 only where it is -inf and its label weight 0 (an infinite logit that
  # agrees): replacing the whole term where the label is 0 or 1 also cut its derivative in
  # the label.
  log_p, log_q = jax.nn.log_sigmoid(logits), jax.nn.log_sigmoid(-logits)
  log_p = jnp.where((labels == 0) & jnp.isneginf(log_p), 0.0, log_p)
  log_q = jnp.where((labels == 1) & jnp.isneginf(log_q), 0.0, log_q)
  return -labels * log_p - (1.0 - labels) * log_q


# The largest action weight of the ranking loss (only their ratios matter): it keeps the
# loss's float32 products and sums finite (a weight of 1e39 became inf, and the loss NaN).
MAX_ACTION_WEIGHT = 1e6


def ranking_loss(logits_BCA: Array, labels_BCA: Array, mask_BC: Array,
                 action_weights_A: Optional[Array] = None) -> Array:
  """Weighted mean binary cross-entropy over valid candidates and actions.

  `sum_{b,c valid} sum_a w_a * bce(b,c,a) / (#valid * sum_a w_a)`; with no weights this
  is the mean BCE per (candidate, action), the same scale as the log-loss metric. Padded
  candidates, and actions weighted 0, are selected out, not multiplied by 0: whatever
  their logits hold (NaN, ±inf), neither the loss nor its gradient sees it. A batch
  without a valid candidate has loss 0 and gradient 0, not NaN.

  `action_weights_A` must lie in [0, `MAX_ACTION_WEIGHT`] and sum to a normal float32
  number (at least 1.2e-38: weights summing to 1e-40 became 0 in float32, and the loss
  NaN); `train.action_weights` is checked the same way, with a sum of at least 1e-6.
  Given as values (not traced), they are checked here, a `ValueError`. Shapes are checked
  with chex (an `AssertionError` naming the argument).
  """
  # Broadcasting would hide a wrong shape: a [B, 1] mask or a [1] weight vector gave a
  # loss on another scale (x C, x A) without an error.
  chex.assert_rank(logits_BCA, 3, custom_message="ranking_loss: logits must be [B, C, A]")
  B, C, A = jnp.shape(logits_BCA)
  chex.assert_shape(labels_BCA, (B, C, A), custom_message="ranking_loss: labels")
  chex.assert_shape(mask_BC, (B, C), custom_message="ranking_loss: mask")
  if action_weights_A is not None:
    chex.assert_shape(action_weights_A, (A,), custom_message="ranking_loss: action_weights")
    if not isinstance(action_weights_A, jax.core.Tracer):   # values known: check them
      w = np.asarray(action_weights_A, np.float64)
      least = float(np.finfo(np.float32).tiny)
      if not (np.all((w >= 0) & (w <= MAX_ACTION_WEIGHT)) and np.sum(w) >= least):
        raise ValueError(f"ranking_loss: action_weights must lie in [0, {MAX_ACTION_WEIGHT:g}] "
                         f"and sum to at least {least:.3g} (only their ratios matter), got "
                         f"{w.tolist()}")
  m_BC1 = jnp.asarray(mask_BC, bool)[..., None]
  w_A = jnp.ones((A,), jnp.float32) if action_weights_A is None else jnp.asarray(
      action_weights_A, jnp.float32)
  # (Unweighted, the plain mask: the program, and so its rounding, of the committed runs.)
  kept = m_BC1 if action_weights_A is None else m_BC1 & (w_A > 0)[None, None, :]
  # Dropped logits are replaced before the BCE as well as after it: a NaN that the
  # forward pass drops would still reach the gradient through the unselected branch.
  logits = jnp.where(kept, jnp.asarray(logits_BCA, jnp.float32), 0.0)
  per_BCA = binary_cross_entropy(logits, jnp.asarray(labels_BCA, jnp.float32))
  total = jnp.sum(jnp.where(kept, per_BCA * w_A[None, None, :], 0.0))
  count = jnp.sum(jnp.asarray(mask_BC, jnp.float32))
  # (A floor on the count alone: one on the product, 1e-9, rescaled the loss of weights
  # summing below 1e-9 / count.)
  return total / (jnp.maximum(count, 1.0) * jnp.sum(w_A))


def is_positive(labels: Array) -> Array:
  """Which labels count as a positive: those above one half. The one threshold of the
  retrieval loss's choice of positive and of every metric; a soft label in [0, 1] enters
  the binary cross-entropy as it is."""
  labels = jnp.asarray(labels)
  if labels.dtype == jnp.bool_:
    return labels
  # (An integer label is above one half when it is above 0.)
  return labels > (0 if jnp.issubdtype(labels.dtype, jnp.integer) else 0.5)


def first_positive(labels_BCA: Array, mask_BC: Array, action: int) -> tuple[Array, Array]:
  """Index `[B]` of each user's first valid candidate whose label of `action` is a
  positive (`is_positive`), and whether one exists `[B]` (index 0 where none does)."""
  engaged_BC = is_positive(labels_BCA[..., action]) & mask_BC.astype(bool)
  return jnp.argmax(engaged_BC, axis=1), jnp.any(engaged_BC, axis=1)


def first_positive_rows(labels_BCA: Array, mask_BC: Array, action: int
                        ) -> tuple[tuple[Array, Array], Array]:
  """`first_positive` as an index `(rows_B, cols_B)` that picks each user's first positive
  candidate out of any `[B, C, ...]` array, and whether each user has one `[B]`."""
  idx_B, has_B = first_positive(labels_BCA, mask_BC, action)
  return (jnp.arange(idx_B.shape[0]), idx_B), has_B


def in_batch_softmax_loss(scores_BB: Array, valid_B: Array, temperature: float,
                          positive_ids_B: Optional[Array] = None,
                          log_q_B: Optional[Array] = None) -> Array:
  """Sampled softmax where every user's positive is every other user's negative.

  `scores_BB[b, j]` scores user b against user j's positive (the model's `scores(user_BD,
  positive_BD)`); row b, divided by the temperature, is trained to pick its own. Users
  without a positive (`valid_B` false) contribute no row and no negative column; when
  `positive_ids_B` is given, another user's positive that is the same post is not counted
  as a negative (other collisions stay: a post the user engaged with elsewhere in its
  list is a negative when it is another user's positive). Mean over valid rows (0, with
  gradient 0, when no user has a positive). Every row keeps its own positive, so the
  excluded columns can be -inf.

  The negatives are drawn as often as posts are positives, so without a correction a
  popular post is pushed down more than a rare one. `log_q_B` (optional) is the log of
  how often each user's positive is drawn (up to a constant, which cancels): it is
  subtracted from column j's logits, `s_bj / temperature - log_q_j` (the logQ correction
  of Yi et al. 2019, "Sampling-bias-corrected neural modeling for large corpus item
  recommendations"); its values in columns of invalid users are ignored.
  """
  chex.assert_rank(scores_BB, 2, custom_message="in_batch_softmax_loss: scores must be [B, B]")
  B = scores_BB.shape[0]
  chex.assert_shape(scores_BB, (B, B), custom_message="in_batch_softmax_loss: scores")
  chex.assert_shape(valid_B, (B,), custom_message="in_batch_softmax_loss: valid")
  if positive_ids_B is not None:
    chex.assert_shape(positive_ids_B, (B,), custom_message="in_batch_softmax_loss: positive_ids")
  logits_BB = jnp.asarray(scores_BB, jnp.float32) / temperature
  if log_q_B is not None:
    chex.assert_shape(log_q_B, (B,), custom_message="in_batch_softmax_loss: log_q")
    logits_BB = logits_BB - jnp.asarray(log_q_B, jnp.float32)[None, :]
  eye_BB = jnp.eye(B, dtype=bool)
  keep_BB = valid_B[None, :] & ~eye_BB
  if positive_ids_B is not None:
    keep_BB &= positive_ids_B[None, :] != positive_ids_B[:, None]
  # An invalid user's row is replaced before the softmax and its loss selected away, not
  # weighted by 0, and so is its column in every other row: a non-finite score there, or
  # its log q (the log of a zero count is -inf), would otherwise make the loss and the
  # gradient of every score NaN (0 * NaN).
  logits_BB = jnp.where((keep_BB | eye_BB) & valid_B[:, None], logits_BB,
                        jnp.where(valid_B[:, None], -jnp.inf, 0.0))
  per_B = jnp.where(valid_B, jax.nn.logsumexp(logits_BB, axis=1) - jnp.diagonal(logits_BB), 0.0)
  return jnp.sum(per_B) / jnp.maximum(jnp.sum(valid_B.astype(jnp.float32)), 1.0)


def update_sampling_counts(counts_KH: Array, hashes_BK: Array, present_B: Array,
                           decay: float) -> Array:
  """Streaming estimate of how often each post is drawn as an in-batch positive.

  `counts_KH` is a count-min sketch of the positives seen so far: per hash function k and
  bucket, an exponentially decayed count. Each step multiplies it by `decay` and adds this
  batch's positives (`hashes_BK`, each positive's K post hashes, counted where
  `present_B`; a post in several rows counts several times) in every row k; a hash of H
  or more counts nowhere. `sampling_log_q` reads it back. `1 / (1 - decay)` steps is its
  memory. On GPU the scatter may add in another order from run to run; its addends are
  all 1 or 0, so only another grouping of them (`x + 2` against `x + 1 + 1`) could round a
  count differently, by an ulp.
  """
  chex.assert_rank(counts_KH, 2, custom_message="update_sampling_counts: counts must be [K, H]")
  K = jnp.shape(counts_KH)[0]
  chex.assert_shape(hashes_BK, (None, K),
                    custom_message="update_sampling_counts: hashes must be [B, K]")
  chex.assert_shape(present_B, (jnp.shape(hashes_BK)[0],),
                    custom_message="update_sampling_counts: present must be [B]")
  counts_KH = jnp.asarray(counts_KH)
  hashes_BK = jnp.asarray(hashes_BK)
  rows_BK = jnp.broadcast_to(jnp.arange(K), hashes_BK.shape)
  added_BK = jnp.broadcast_to(jnp.asarray(present_B, counts_KH.dtype)[:, None], hashes_BK.shape)
  return (decay * counts_KH).at[rows_BK, hashes_BK].add(added_BK, mode="drop")


def sampling_log_q(counts_KH: Array, hashes_BK: Array) -> Array:
  """`log_q` `[B]` for `in_batch_softmax_loss`, up to a constant: the log of each post's
  count in the sketch, the smallest over its K hash functions (a count-min estimate: a
  post that shares a bucket with a popular one under one function rarely does under all
  of them: at the cpu preset 19.5% of the posts share their first bucket, 3.8% a bucket
  under both functions). Counts updated with this batch (`update_sampling_counts`) give
  every present positive a count of at least 1; a count of 0 gives -inf, which
  `in_batch_softmax_loss` ignores for users without a positive and turns into a NaN loss
  for the others. A hash of H or more reads a count of 0, as `update_sampling_counts`
  counts it nowhere (not the clamped last bucket, another post's count).
  """
  chex.assert_rank(counts_KH, 2, custom_message="sampling_log_q: counts must be [K, H]")
  hashes_BK = jnp.asarray(hashes_BK)
  chex.assert_shape(hashes_BK, (None, jnp.shape(counts_KH)[0]),
                    custom_message="sampling_log_q: hashes must be [B, K]")
  rows_BK = jnp.broadcast_to(jnp.arange(hashes_BK.shape[1]), hashes_BK.shape)
  counts_BK = jnp.asarray(counts_KH).at[rows_BK, hashes_BK].get(mode="fill", fill_value=0)
  return jnp.log(jnp.min(counts_BK, axis=1))
