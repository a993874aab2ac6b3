"""The plain training loop's data pipeline: the synthetic world sampled on the host, in numpy.

The training loop samples its batches on device, inside the jitted step
(`phoenix_flax.synthetic.sample_batch`). The plain loop that the training-throughput
benchmark compares it with instead samples each batch on the host with numpy and calls a
jitted step once per step, and this module
is that host sampler: `sample_batch`'s generative process written in vectorised numpy over
the same world (its arrays copied to the host once), with no Python loop over users.

It draws its uniforms from a `numpy.random.Generator`, in the same named blocks as the
device sampler (`sampling.uniform_shapes`); `sample_from_uniforms` takes them as given,
so that a test can feed both samplers the same draws and compare the batches (equal up to
float rounding: a draw that falls within a rounding step of a boundary can go the other
way). It is benchmark code, not a second implementation to train with: the package's own
loop never leaves the device. It follows the device sampler for worlds of up to
`world.UNIFORM_VALUES` (2**23) users, posts (in all, and per topic), topics and surfaces,
which every preset is; beyond that the device sampler draws ids with
`jax.random.randint` instead.
"""

from __future__ import annotations

import jax
import numpy as np

from phoenix_flax.synthetic import SplitConfig, SyntheticBatch, World
from phoenix_flax.synthetic.sampling import (IMPRESSION_EPOCH_S, IMPRESSION_SPAN_S, MAX_AGE_S,
                                             uniform_shapes)
from phoenix_flax.synthetic.world import random_blocks
from phoenix_flax.types import RecsysBatch

F32 = np.float32


def _randint(u: np.ndarray, lo, hi) -> np.ndarray:
  """Integers uniform in [lo, hi) from uniforms u (float32 arithmetic, as on device)."""
  n = np.asarray(hi, np.int32) - np.asarray(lo, np.int32)
  return (lo + np.minimum(np.floor(u * n.astype(F32)).astype(np.int32), n - 1)).astype(np.int32)


def _softmax(x: np.ndarray) -> np.ndarray:
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def _categorical(u: np.ndarray, logits: np.ndarray) -> np.ndarray:
  cdf = np.cumsum(_softmax(logits), axis=-1)
  idx = np.sum(cdf < u[..., None], axis=-1)
  return np.minimum(idx, logits.shape[-1] - 1).astype(np.int32)


def _exponential(u: np.ndarray) -> np.ndarray:
  return -np.log1p(-u)


def _sigmoid(x: np.ndarray) -> np.ndarray:
  return (1.0 / (1.0 + np.exp(-x))).astype(F32)


def _ids_in_topic(topic: np.ndarray, num_ids: int, num_topics: int, u: np.ndarray) -> np.ndarray:
  count = (num_ids - 1 - topic) // num_topics + 1
  j = np.minimum(np.floor(u * count.astype(F32)).astype(np.int32), count - 1)
  return (topic + num_topics * j).astype(np.int32)


def _history_lengths(split: SplitConfig, max_history: int, u_B: np.ndarray) -> np.ndarray:
  lo, hi = split.min_history, max_history
  if split.history_dist == "uniform":
    return _randint(u_B, lo, hi + 1)
  log_lo, log_hi = np.log(F32(lo + 1.0)), np.log(F32(hi + 2.0))
  log_len = log_lo + u_B * (log_hi - log_lo)
  return np.clip(np.floor(np.exp(log_len)).astype(np.int32) - 1, lo, hi)


def _ages_s(world: World, u: np.ndarray) -> np.ndarray:
  age = _exponential(u) * F32(world.cfg.mean_post_age_hours * 3600.0)
  return np.clip(np.round(age), 60, MAX_AGE_S).astype(np.int32)


def _history_weights(history_len_X: np.ndarray, S: int, decay: float) -> np.ndarray:
  s = np.arange(S)
  n = np.asarray(history_len_X)[..., None]
  age = (n - 1 - s).astype(F32)
  return np.where(s < n, np.power(F32(decay), np.maximum(age, F32(0))), F32(0))


def _mix_interest(world: World, taste_XL, weights_XS, history_vecs_XSL) -> np.ndarray:
  total_X1 = weights_XS.sum(axis=-1, keepdims=True)
  current_XL = np.matmul(weights_XS[..., None, :], history_vecs_XSL)[..., 0, :]
  current_XL = np.where(total_X1 > 0, current_XL / np.maximum(total_X1, F32(1e-12)), taste_XL)
  m = F32(world.cfg.interest_mix)
  return m * current_XL + (F32(1.0) - m) * taste_XL


def _true_logits(world: World, interest_XL, post_ids_X, surface_X, age_hours_X,
                 user_bias_X) -> np.ndarray:
  c = world.cfg
  affinity_X = F32(c.affinity_scale) * np.sum(interest_XL * world.post_vecs_PL[post_ids_X], -1)
  quality_X = F32(c.quality_scale) * world.post_quality_P[post_ids_X]
  drive_XA = world.action_sign_A * (affinity_X[..., None] * world.affinity_weight_A
                                    + quality_X[..., None] * world.quality_weight_A)
  positive_A = (world.action_sign_A > 0).astype(F32)
  shift_X = np.asarray(user_bias_X, F32)
  if c.post_age:
    shift_X = shift_X - F32(c.age_decay_per_day) * np.asarray(age_hours_X, F32) / F32(24.0)
  return (world.base_logits_A + drive_XA + world.surface_effect_VA[surface_X]
          + shift_X[..., None] * positive_A)


def host_world(world: World) -> World:
  """The world with every array copied to host numpy (do this once, outside the loop)."""
  return jax.tree.map(np.asarray, world)


def sample_from_uniforms(world: World, split: SplitConfig, batch_size: int,
                         u: dict[str, np.ndarray]) -> SyntheticBatch:
  """`sample_batch` in numpy, given its uniform draws (`uniform_shapes` blocks, float32)."""
  c = world.cfg
  max_history, C = split.resolve(c)
  B, S, T, P = batch_size, c.history_len, c.num_topics, c.num_posts
  V = c.product_surface_vocab_size

  user_ids_B = _randint(u["user"], 0, c.num_users)
  topic_logits_BT = world.user_topic_logits_UT[user_ids_B]
  taste_BL = world.user_taste_UL[user_ids_B]
  bias_B = world.user_bias_U[user_ids_B]
  history_len_B = _history_lengths(split, max_history, u["hist_len"])

  # History: a topic chain that jumps with topic_switch_prob, one post per step.
  s_S = np.arange(S, dtype=np.int32)
  switch_BS = u["switch"] < F32(c.topic_switch_prob)
  switch_BS[:, 0] = True
  drawn_BS = np.where(u["explore"] < F32(c.explore_prob), _randint(u["explore_topic"], 0, T),
                      _categorical(u["taste_topic"], topic_logits_BT[:, None, :]))
  last_switch_BS = np.maximum.accumulate(np.where(switch_BS, s_S, 0), axis=1)
  topic_BS = np.take_along_axis(drawn_BS, last_switch_BS, axis=1)
  hist_post_BS = _ids_in_topic(topic_BS, P, T, u["hist_post"])
  hist_valid_BS = s_S < history_len_B[:, None]

  # History actions follow the link with the interest held just before each item.
  prior_weights_SS = _history_weights(s_S, S, c.recency_decay)
  interest_BSL = _mix_interest(world, taste_BL[:, None, :],
                               np.broadcast_to(prior_weights_SS, (B, S, S)),
                               world.post_vecs_PL[hist_post_BS][:, None, :, :])
  hist_surface_BS = _randint(u["hist_surface"], 0, V)
  hist_age_h_BS = _ages_s(world, u["hist_age"]).astype(F32) / F32(3600.0)
  hist_logits_BSA = _true_logits(world, interest_BSL, hist_post_BS, hist_surface_BS,
                                 hist_age_h_BS, bias_B[:, None])
  hist_actions_BSA = (u["hist_action"] < _sigmoid(hist_logits_BSA)) & hist_valid_BS[..., None]
  dwell_BS = np.where(hist_actions_BSA[..., -1],
                      F32(10.0) + F32(30.0) * _exponential(u["dwell"]),
                      F32(3.0) * _exponential(u["dwell"]))

  # Candidates: relevant ones follow the interest (or the list's session topic).
  weights_BS = _history_weights(history_len_B, S, c.recency_decay)
  interest_BL = _mix_interest(world, taste_BL, weights_BS, world.post_vecs_PL[hist_post_BS])
  session_topic_B = _categorical(u["session"], topic_logits_BT)
  interest_BL = interest_BL + (F32(split.list_correlation * c.session_scale)
                               * world.topic_vecs_TL[session_topic_B])
  retrieval_logits_BT = F32(c.retrieval_sharpness) * (interest_BL @ world.topic_vecs_TL.T)
  rel_topic_BC = np.where(u["use_session"] < F32(split.list_correlation),
                          session_topic_B[:, None],
                          _categorical(u["rel_topic"], retrieval_logits_BT[:, None, :]))
  relevant_BC = u["relevant"] < F32(split.relevant_fraction)
  post_BC = np.where(relevant_BC, _ids_in_topic(rel_topic_BC, P, T, u["rel_post"]),
                     _randint(u["rand_post"], 0, P))
  surface_BC = _randint(u["surface"], 0, V)
  impression_ts_B = IMPRESSION_EPOCH_S + _randint(u["impression"], 0, IMPRESSION_SPAN_S)
  age_s_BC = _ages_s(world, u["age"])
  probs_BCA = _sigmoid(_true_logits(world, interest_BL[:, None, :], post_BC, surface_BC,
                                    age_s_BC.astype(F32) / F32(3600.0), bias_B[:, None]))
  labels_BCA = u["label"] < probs_BCA

  # Slot order of the valid candidates, padding last.
  if split.min_candidates is None:
    num_valid_B = np.full((B,), C, np.int32)
  else:
    num_valid_B = _randint(u["count"], split.min_candidates, C + 1)
  mask_BC = np.arange(C) < num_valid_B[:, None]
  if split.candidate_order == "random":
    order_key_BC = u["order"]
  elif split.candidate_order == "relevance":
    order_key_BC = -probs_BCA[..., 0]
  else:
    order_key_BC = np.where(relevant_BC, F32(0.0), F32(1.0))
  perm_BC = np.argsort(np.where(mask_BC, order_key_BC, F32(10.0)), axis=1, kind="stable")
  take = lambda x: np.take_along_axis(x, perm_BC.reshape(perm_BC.shape + (1,) * (x.ndim - 2)),
                                      axis=1)
  post_BC, surface_BC, age_s_BC, relevant_BC = map(take, (post_BC, surface_BC, age_s_BC,
                                                          relevant_BC))
  probs_BCA, labels_BCA = take(probs_BCA), take(labels_BCA)

  m_BC, m_BS = mask_BC, hist_valid_BS
  author_BC = world.post_author_P[post_BC]
  hist_author_BS = world.post_author_P[hist_post_BS]
  batch = RecsysBatch(
      user_hashes=world.user_hashes_UK[user_ids_B],
      history_post_hashes=world.post_hashes_PK[hist_post_BS] * m_BS[..., None],
      history_author_hashes=world.author_hashes_WK[hist_author_BS] * m_BS[..., None],
      history_actions=hist_actions_BSA.astype(F32),
      history_product_surface=hist_surface_BS * m_BS,
      candidate_post_hashes=world.post_hashes_PK[post_BC] * m_BC[..., None],
      candidate_author_hashes=world.author_hashes_WK[author_BC] * m_BC[..., None],
      candidate_product_surface=surface_BC * m_BC,
      impression_timestamps=impression_ts_B,
      candidate_post_timestamps=((impression_ts_B[:, None] - age_s_BC) * m_BC).astype(np.int32),
      history_dwell_times=np.where(m_BS, dwell_BS, F32(0.0)),
  )
  return SyntheticBatch(
      batch=batch,
      labels=(labels_BCA & m_BC[..., None]).astype(F32),
      probs=np.where(m_BC[..., None], probs_BCA, F32(0.0)),
      candidate_mask=mask_BC,
      user_ids=user_ids_B,
      candidate_post_ids=np.where(m_BC, post_BC, -1).astype(np.int32),
      candidate_author_ids=np.where(m_BC, author_BC, -1).astype(np.int32),
      history_post_ids=np.where(m_BS, hist_post_BS, -1).astype(np.int32),
      history_len=history_len_B,
      candidate_relevant=relevant_BC & m_BC,
      interest=interest_BL,
  )


class HostSampler:
  """Draws batches of one split on the host: `sampler()` -> a `SyntheticBatch` of numpy
  arrays, from its own `numpy.random.Generator` (deterministic in `seed`)."""

  def __init__(self, world: World, split: SplitConfig, batch_size: int, seed: int):
    if not isinstance(split, SplitConfig):
      raise TypeError(f"split must be a SplitConfig, got {type(split).__name__}")
    if not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f"batch_size={batch_size!r} is invalid: must be an integer >= 1")
    self.world = host_world(world)
    self.split, self.batch_size = split, batch_size
    c = self.world.cfg
    _, C = split.resolve(c)
    self.shapes = uniform_shapes(batch_size, c.history_len, C, c.num_actions)
    self.rng = np.random.default_rng(seed)

  def uniforms(self) -> dict[str, np.ndarray]:
    """One batch's uniforms, in the device sampler's named blocks."""
    return random_blocks(self.rng, lambda rng, shape: rng.random(shape, dtype=F32),
                         self.shapes)

  def __call__(self) -> SyntheticBatch:
    return sample_from_uniforms(self.world, self.split, self.batch_size, self.uniforms())
