"""Sampling of ranking batches from a world, on device, with the true probabilities.

One call draws, for each of B users: a history (a topic chain over posts, its valid
length from the split, actions drawn from the link with the interest held before each
item), then a candidate list (relevant posts that follow the user's interest or a list
session topic, and random posts), the list's surfaces and post ages, the true action
probabilities and 0/1 labels, and finally the split's slot order and padding.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from phoenix_flax.config import _count
from phoenix_flax.synthetic.config import SplitConfig
from phoenix_flax.synthetic.world import (UNIFORM_VALUES, World, _float32, history_weights,
                                          ids_in_topic, mix_interest, random_blocks,
                                          true_logits, uniform_below, user_interest)
from phoenix_flax.types import RecsysBatch

IMPRESSION_EPOCH_S = 1_700_000_000
IMPRESSION_SPAN_S = 30 * 86_400
MAX_AGE_S = 4800 * 60


class SyntheticBatch(NamedTuple):
  """A model batch plus what only the generator knows.

  Padded history slots and candidates have hash 0, surface 0, actions 0, dwell 0 and
  timestamp 0, and id -1; padded candidates have probability 0 and label 0. `interest`
  is the user's interest for this list (session topic included); history dwell times
  are long (10 s + exponential) where the last action (long dwell) fired.
  """

  batch: RecsysBatch
  labels: Array                # [B, C, A] float32 0/1
  probs: Array                 # [B, C, A] float32 true action probabilities
  candidate_mask: Array        # [B, C] bool
  user_ids: Array              # [B] int32
  candidate_post_ids: Array    # [B, C] int32
  candidate_author_ids: Array  # [B, C] int32
  history_post_ids: Array      # [B, S] int32
  history_len: Array           # [B] int32 valid history items
  candidate_relevant: Array    # [B, C] bool, drawn from the interest (not at random)
  interest: Array              # [B, L] float32


def _randint(u: Array, lo: int, hi: int, key: Optional[PRNGKeyArray] = None) -> Array:
  """Integers uniform in [lo, hi) from uniforms u; over more than `UNIFORM_VALUES` of
  them from `key` (`uniform_below`), which a range that large needs."""
  if key is None and hi - lo > UNIFORM_VALUES:
    raise ValueError(f"drawing among {hi - lo} integers needs a key (uniform_below)")
  return (lo + uniform_below(u, hi - lo, hi - lo, key)).astype(jnp.int32)


def _categorical(u: Array, logits: Array) -> Array:
  """Inverse-CDF draw from `softmax(logits)` (last axis), broadcast against u."""
  cdf = jnp.cumsum(jax.nn.softmax(logits, axis=-1), axis=-1)
  idx = jnp.sum(cdf < u[..., None], axis=-1)
  return jnp.minimum(idx, logits.shape[-1] - 1).astype(jnp.int32)


def _exponential(u: Array) -> Array:
  return -jnp.log1p(-u)


def _history_lengths(split: SplitConfig, max_history: int, u_B: Array) -> Array:
  lo, hi = split.min_history, max_history
  if split.history_dist == "uniform":
    return _randint(u_B, lo, hi + 1)
  log_len = jnp.log(lo + 1.0) + u_B * (jnp.log(hi + 2.0) - jnp.log(lo + 1.0))
  return jnp.clip(jnp.floor(jnp.exp(log_len)).astype(jnp.int32) - 1, lo, hi)


def _hours(age_s: Array) -> Array:
  """Whole-second ages in float32 hours (divided in float32 with `jax_enable_x64` on too)."""
  return age_s.astype(jnp.float32) / 3600.0


def _ages_s(world: World, u: Array) -> Array:
  """Post ages in whole seconds: exponential, clipped to [1 minute, 4800 minutes]."""
  age = _exponential(u) * world.cfg.mean_post_age_hours * 3600.0
  return jnp.clip(jnp.round(age), 60, MAX_AGE_S).astype(jnp.int32)


def uniform_shapes(B: int, S: int, C: int, A: int) -> dict:
  """The named blocks of uniforms one batch draws, in draw order (`random_blocks`): B
  users (lists), S history slots, C candidate slots, A actions."""
  return {
      "user": (B,), "hist_len": (B,), "session": (B,), "impression": (B,), "count": (B,),
      "switch": (B, S), "explore": (B, S), "explore_topic": (B, S), "taste_topic": (B, S),
      "hist_post": (B, S), "hist_surface": (B, S), "hist_age": (B, S), "dwell": (B, S),
      "hist_action": (B, S, A), "rel_topic": (B, C), "use_session": (B, C),
      "relevant": (B, C), "rel_post": (B, C), "rand_post": (B, C), "surface": (B, C),
      "age": (B, C), "order": (B, C), "label": (B, C, A)}


def sample_batch(world: World, split: SplitConfig, batch_size: int, key: PRNGKeyArray
                 ) -> SyntheticBatch:
  """Draws one batch; jit it with `split` and `batch_size` static. Deterministic in key:
  bit for bit between jitted calls (an eager call rounds a few values differently)."""
  if not isinstance(split, SplitConfig):
    raise TypeError(f"split must be a SplitConfig, got {type(split).__name__}")
  batch_size = _count("batch_size", batch_size, 1)
  c = world.cfg
  max_history, C = split.resolve(c)
  B, S, T, P = batch_size, c.history_len, c.num_topics, c.num_posts
  V, A = c.product_surface_vocab_size, c.num_actions
  # As in `make_world`: a new random quantity takes a key of its own, so that the batches
  # of existing configs stay as they are.
  u = random_blocks(key, _float32(jax.random.uniform), uniform_shapes(B, S, C, A))

  # (Keys folded from `key` draw the ids of worlds too large for a float32 uniform.)
  fine = functools.partial(jax.random.fold_in, key)
  user_ids_B = _randint(u["user"], 0, c.num_users, fine(1))
  topic_logits_BT = world.user_topic_logits_UT[user_ids_B]
  taste_BL = world.user_taste_UL[user_ids_B]
  bias_B = world.user_bias_U[user_ids_B]
  history_len_B = _history_lengths(split, max_history, u["hist_len"])

  # History: a topic chain that jumps with topic_switch_prob, one post per step.
  s_S = jnp.arange(S, dtype=jnp.int32)
  switch_BS = (u["switch"] < c.topic_switch_prob).at[:, 0].set(True)
  drawn_BS = jnp.where(u["explore"] < c.explore_prob, _randint(u["explore_topic"], 0, T, fine(2)),
                       _categorical(u["taste_topic"], topic_logits_BT[:, None, :]))
  last_switch_BS = jax.lax.cummax(jnp.where(switch_BS, s_S, 0), axis=1)
  topic_BS = jnp.take_along_axis(drawn_BS, last_switch_BS, axis=1)
  hist_post_BS = ids_in_topic(topic_BS, P, T, u["hist_post"], fine(3))
  hist_valid_BS = s_S[None, :] < history_len_B[:, None]

  # History actions follow the link with the interest held just before each item.
  prior_weights_SS = history_weights(s_S, S, c.recency_decay)
  interest_BSL = mix_interest(world, taste_BL[:, None, :],
                              jnp.broadcast_to(prior_weights_SS, (B, S, S)),
                              world.post_vecs_PL[hist_post_BS][:, None, :, :])
  hist_surface_BS = _randint(u["hist_surface"], 0, V, fine(4))
  hist_logits_BSA = true_logits(world, interest_BSL, hist_post_BS, hist_surface_BS,
                                _hours(_ages_s(world, u["hist_age"])), bias_B[:, None])
  hist_actions_BSA = ((u["hist_action"] < jax.nn.sigmoid(hist_logits_BSA))
                      & hist_valid_BS[..., None])
  dwell_BS = jnp.where(hist_actions_BSA[..., -1], 10.0 + 30.0 * _exponential(u["dwell"]),
                       3.0 * _exponential(u["dwell"]))

  # Candidates: relevant ones follow the interest (or the list's session topic).
  interest_BL = user_interest(world, user_ids_B, hist_post_BS, history_len_B)
  session_topic_B = _categorical(u["session"], topic_logits_BT)
  interest_BL = interest_BL + (split.list_correlation * c.session_scale
                               * world.topic_vecs_TL[session_topic_B])
  retrieval_logits_BT = c.retrieval_sharpness * (interest_BL @ world.topic_vecs_TL.T)
  rel_topic_BC = jnp.where(u["use_session"] < split.list_correlation, session_topic_B[:, None],
                           _categorical(u["rel_topic"], retrieval_logits_BT[:, None, :]))
  relevant_BC = u["relevant"] < split.relevant_fraction
  post_BC = jnp.where(relevant_BC, ids_in_topic(rel_topic_BC, P, T, u["rel_post"], fine(5)),
                      _randint(u["rand_post"], 0, P, fine(6)))
  surface_BC = _randint(u["surface"], 0, V, fine(7))
  impression_ts_B = IMPRESSION_EPOCH_S + _randint(u["impression"], 0, IMPRESSION_SPAN_S)
  age_s_BC = _ages_s(world, u["age"])
  logits_BCA = true_logits(world, interest_BL[:, None, :], post_BC, surface_BC,
                           _hours(age_s_BC), bias_B[:, None])
  probs_BCA = jax.nn.sigmoid(logits_BCA)
  labels_BCA = u["label"] < probs_BCA

  # Slot order of the valid candidates, padding last. Everything above is in draw order:
  # an effect of the slot a candidate is shown in belongs after `take`.
  if split.min_candidates is None:
    num_valid_B = jnp.full((B,), C, jnp.int32)
  else:
    num_valid_B = _randint(u["count"], split.min_candidates, C + 1)
  mask_BC = jnp.arange(C, dtype=jnp.int32)[None, :] < num_valid_B[:, None]
  if split.candidate_order == "random":
    order_key_BC = u["order"]
  elif split.candidate_order == "relevance":
    order_key_BC = -probs_BCA[..., 0]
  else:
    order_key_BC = jnp.where(relevant_BC, 0.0, 1.0)
  perm_BC = jnp.argsort(jnp.where(mask_BC, order_key_BC, 10.0), axis=1, stable=True)
  take = lambda x: jnp.take_along_axis(x, perm_BC.reshape(perm_BC.shape + (1,) * (x.ndim - 2)),
                                       axis=1)
  post_BC, surface_BC, age_s_BC, relevant_BC = map(take, (post_BC, surface_BC, age_s_BC,
                                                          relevant_BC))
  probs_BCA, labels_BCA = take(probs_BCA), take(labels_BCA)

  m_BC, m_BS = mask_BC, hist_valid_BS
  author_BC = world.post_author_P[post_BC]
  hist_author_BS = world.post_author_P[hist_post_BS]
  batch = RecsysBatch(
      user_hashes=world.user_hashes_UK[user_ids_B],
      history_post_hashes=jnp.where(m_BS[..., None], world.post_hashes_PK[hist_post_BS], 0),
      history_author_hashes=jnp.where(m_BS[..., None], world.author_hashes_WK[hist_author_BS], 0),
      history_actions=hist_actions_BSA.astype(jnp.float32),
      history_product_surface=jnp.where(m_BS, hist_surface_BS, 0),
      candidate_post_hashes=jnp.where(m_BC[..., None], world.post_hashes_PK[post_BC], 0),
      candidate_author_hashes=jnp.where(m_BC[..., None], world.author_hashes_WK[author_BC], 0),
      candidate_product_surface=jnp.where(m_BC, surface_BC, 0),
      impression_timestamps=impression_ts_B,
      candidate_post_timestamps=jnp.where(m_BC, impression_ts_B[:, None] - age_s_BC, 0),
      history_dwell_times=jnp.where(m_BS, dwell_BS, 0.0),
  )
  return SyntheticBatch(
      batch=batch,
      labels=(labels_BCA & m_BC[..., None]).astype(jnp.float32),
      probs=jnp.where(m_BC[..., None], probs_BCA, 0.0),
      candidate_mask=mask_BC,
      user_ids=user_ids_B,
      candidate_post_ids=jnp.where(m_BC, post_BC, -1),
      candidate_author_ids=jnp.where(m_BC, author_BC, -1),
      history_post_ids=jnp.where(m_BS, hist_post_BS, -1),
      history_len=history_len_B,
      candidate_relevant=relevant_BC & m_BC,
      interest=interest_BL,
  )
