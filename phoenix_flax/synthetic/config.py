"""Configs of the synthetic world (fixed per run) and of one data split (train vs eval).

Every field is validated in `__post_init__`; a bad value raises `ValueError` naming it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from phoenix_flax.config import (_beyond_int32, _fail, _int_at_least, _is_int, _is_real,
                                 _positive_int)

HISTORY_DISTS = ("uniform", "log_uniform")
CANDIDATE_ORDERS = ("random", "relevance", "grouped")

# Probability of each action at zero affinity, quality, surface and user effects.
DEFAULT_BASE_RATES = (
    0.10, 0.03, 0.03, 0.05, 0.08,   # favorite, reply, repost, photo_expand, click
    0.03, 0.05, 0.02, 0.02, 0.02,   # profile_click, vqv, share, share_via_dm, copy_link
    0.12, 0.02, 0.02, 0.02,         # dwell_score, quote, quoted_click, follow_author
    0.04, 0.02, 0.02, 0.015,        # not_interested, block, mute, report
    0.12,                           # dwell_time (binary long dwell)
)


def _in_range(cls: str, field: str, value, lo: float, hi: float) -> None:
  if not (_is_real(value) and lo <= value <= hi):
    _fail(cls, field, value, f"must be a number in [{lo}, {hi}]")


def _non_negative(cls: str, field: str, value) -> None:
  if not (_is_real(value) and math.isfinite(value) and value >= 0):
    _fail(cls, field, value, "must be a finite number >= 0")


def _sequence(cls: str, field: str, value, fix: str) -> tuple:
  """`value` as a tuple, or a ValueError naming the field when it is no sequence."""
  if not isinstance(value, (tuple, list, np.ndarray)) or np.ndim(value) != 1:
    _fail(cls, field, value, fix)
  return tuple(value.tolist() if isinstance(value, np.ndarray) else value)


def _store_python_scalars(config) -> None:
  """A config is static (hashed, compared, written to JSON): NumPy numbers that passed
  validation (in real-valued fields) are stored as Python floats and ints."""
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if isinstance(value, np.floating):
      object.__setattr__(config, field.name, float(value))
    elif isinstance(value, np.integer):
      object.__setattr__(config, field.name, int(value))


@dataclasses.dataclass(frozen=True)
class WorldConfig:
  """The generative model: entities, hashing and the action link.

  Attributes:
    num_users, num_posts, num_authors, num_topics: entity counts. Post p has topic
      `p % num_topics` and an author of the same topic, so both counts must reach
      `num_topics`.
    latent_dim: width of topic, post and taste vectors.
    history_len, num_candidates: S and C of the batches (a split may change C).
    num_*_hashes: hash functions per entity; `*_buckets`: hash table rows, row 0 reserved
      for padding, so hashes lie in [1, buckets) and distinct ids collide.
    recency_decay: in (0, 1]; weight `decay**k` of the history item k steps before the
      newest one in the current interest, a weighted mean of the items' post vectors
      (small = only the last items count; 1 = every item alike).
    interest_mix: weight of the current (history) interest against the long-term taste;
      0 makes history order irrelevant.
    topic_switch_prob: chance that the history's topic chain draws its topic afresh at
      each step (from the taste, or uniformly: `explore_prob`), which may give the same
      topic again (at the cpu preset 0.3 changed the topic at 22% of steps).
    explore_prob: share of topic draws that ignore the user's taste (uniform topic).
    taste_concentration: sharpness of each user's long-term topic distribution.
    author_style, post_noise: author- and post-specific parts of a post's latent vector.
    retrieval_sharpness: how tightly relevant candidates follow the user's interest.
    base_rates: per-action probability at zero signal (length num_actions).
    negative_actions: indices driven by negative affinity and low quality.
    affinity_scale: logit scale of interest . post (the temperature of the link).
    quality_scale, surface_scale, user_bias_scale: std of the post-quality, per-surface
      and per-user logit effects.
    session_scale: weight of a list's session topic in the interest, at
      `SplitConfig.list_correlation = 1`.
    post_age: whether positive actions decay with post age (visible to the model only
      through the timestamps); `age_decay_per_day` logits per day of age,
      `mean_post_age_hours` the mean of the exponential age distribution before its
      ages are clipped to [1 minute, 80 hours] (the model's oldest post-age bucket,
      `POST_AGE_MAX_MINUTES`), so that the ages' mean is about `m (1 - exp(-80 / m))`
      hours for a set mean m: 11.98 at 12 and 15.89 at 16, but 55.07 at 100, where
      exp(-0.8) = 45% of the ages sit at 80 hours.
    Ids and hashes are drawn uniformly at any size (above 2**23 of them with
    `jax.random.randint`: `world.uniform_below`).
  """

  num_users: int = 1000
  num_posts: int = 1000
  num_authors: int = 100
  num_topics: int = 16
  latent_dim: int = 32
  history_len: int = 32
  num_candidates: int = 16
  num_user_hashes: int = 2
  num_item_hashes: int = 2
  num_author_hashes: int = 2
  user_buckets: int = 1024
  post_buckets: int = 2048
  author_buckets: int = 256
  product_surface_vocab_size: int = 16
  num_actions: int = 19
  recency_decay: float = 0.6
  interest_mix: float = 0.7
  topic_switch_prob: float = 0.3
  explore_prob: float = 0.1
  taste_concentration: float = 2.0
  author_style: float = 0.5
  post_noise: float = 0.5
  retrieval_sharpness: float = 6.0
  base_rates: tuple = DEFAULT_BASE_RATES
  negative_actions: tuple = (14, 15, 16, 17)
  affinity_scale: float = 4.0
  quality_scale: float = 0.5
  surface_scale: float = 0.5
  user_bias_scale: float = 0.5
  session_scale: float = 1.0
  post_age: bool = False
  age_decay_per_day: float = 1.5
  mean_post_age_hours: float = 12.0

  def __post_init__(self):
    c = "WorldConfig"
    for f in ("num_users", "num_posts", "num_authors", "num_topics", "latent_dim",
              "history_len", "num_candidates", "num_user_hashes", "num_item_hashes",
              "num_author_hashes", "product_surface_vocab_size", "num_actions"):
      _positive_int(c, f, getattr(self, f))
    for f in ("num_posts", "num_authors"):
      if getattr(self, f) < self.num_topics:
        _fail(c, f, getattr(self, f), f"must be >= num_topics={self.num_topics}")
    for f in ("user_buckets", "post_buckets", "author_buckets"):
      _positive_int(c, f, getattr(self, f))
      if getattr(self, f) < 2:
        _fail(c, f, getattr(self, f), "must be >= 2 (row 0 is reserved for padding)")
    # Ids and hashes are int32 on the device.
    for f in ("num_users", "num_posts", "num_authors", "user_buckets", "post_buckets",
              "author_buckets"):
      if _beyond_int32(getattr(self, f)):
        _fail(c, f, getattr(self, f), "must be <= 2**31 - 1 (ids and hashes are int32)")
    if not (_is_real(self.recency_decay) and 0 < self.recency_decay <= 1):
      _fail(c, "recency_decay", self.recency_decay, "must be in (0, 1]")
    for f in ("interest_mix", "topic_switch_prob", "explore_prob"):
      _in_range(c, f, getattr(self, f), 0.0, 1.0)
    for f in ("taste_concentration", "author_style", "post_noise", "retrieval_sharpness",
              "affinity_scale", "quality_scale", "surface_scale", "user_bias_scale",
              "session_scale", "age_decay_per_day"):
      _non_negative(c, f, getattr(self, f))
    if not (_is_real(self.mean_post_age_hours) and math.isfinite(self.mean_post_age_hours)
            and self.mean_post_age_hours > 0):
      _fail(c, "mean_post_age_hours", self.mean_post_age_hours, "must be a finite number > 0")
    if not isinstance(self.post_age, bool):
      _fail(c, "post_age", self.post_age, "must be a bool")
    rates_fix = f"give {self.num_actions} probabilities in (0, 1), one per action"
    rates = _sequence(c, "base_rates", self.base_rates, rates_fix)
    if len(rates) != self.num_actions or not all(_is_real(r) and 0 < r < 1 for r in rates):
      _fail(c, "base_rates", self.base_rates, rates_fix)
    negs_fix = f"give distinct action indices in [0, {self.num_actions})"
    negs = tuple(int(i) if _is_int(i) else i
                 for i in _sequence(c, "negative_actions", self.negative_actions, negs_fix))
    if len(set(negs)) != len(negs) or not all(
        _is_int(i) and 0 <= i < self.num_actions for i in negs):
      _fail(c, "negative_actions", self.negative_actions, negs_fix)
    object.__setattr__(self, "base_rates", tuple(float(r) for r in rates))
    object.__setattr__(self, "negative_actions", negs)
    _store_python_scalars(self)


@dataclasses.dataclass(frozen=True)
class SplitConfig:
  """How one split's users, histories and candidate lists are drawn.

  Attributes:
    min_history, max_history: range of the valid history length (max None = world S;
      both 0 for a cold-start split, every history empty).
    history_dist: "uniform" over the range, or "log_uniform" (length + 1 log-uniform:
      many short histories, a long tail).
    relevant_fraction: chance that a candidate follows the user's interest rather than
      being a uniformly random post.
    list_correlation: in [0, 1]. Each list has a session topic (drawn from the user's
      taste); with this probability a relevant candidate comes from it, and the session
      topic enters the interest with weight `list_correlation * session_scale`, so list
      companions carry information about a candidate's labels. The added topic also
      lengthens the interest vector, which raises label rates and makes labels easier to
      predict: at the cpu preset the eval split's Bayes AUC is about 0.81 at 0, 0.86 at
      0.5 and 0.91 at 1, so splits with different correlations are tasks of different
      difficulty (compare variants within one).
    candidate_order: "random" (shuffled), "relevance" (true favorite probability,
      best first) or "grouped" (relevant candidates first, then random ones). The last
      two make a candidate's slot predict its labels, which a model without candidate
      isolation, or with positions that count slots, can learn from a training split in
      that order; the ablations use them for evaluation splits only (a serving shift).
    num_candidates: list width C (None = the world's).
    min_candidates: None = every slot valid; else the valid count is uniform in
      [min_candidates, C] and padded slots come last.
  """

  min_history: int = 1
  max_history: Optional[int] = None
  history_dist: str = "uniform"
  relevant_fraction: float = 0.5
  list_correlation: float = 0.0
  candidate_order: str = "random"
  num_candidates: Optional[int] = None
  min_candidates: Optional[int] = None

  def __post_init__(self):
    c = "SplitConfig"
    _int_at_least(c, "min_history", self.min_history, 0)
    if self.max_history is not None:
      _int_at_least(c, "max_history", self.max_history, 0,
                    " (0: every history empty, a cold-start split)")
      if self.max_history < self.min_history:
        _fail(c, "max_history", self.max_history,
              f"must be >= min_history={self.min_history}")
    if self.history_dist not in HISTORY_DISTS:
      _fail(c, "history_dist", self.history_dist, f"use one of {HISTORY_DISTS}")
    for f in ("relevant_fraction", "list_correlation"):
      _in_range(c, f, getattr(self, f), 0.0, 1.0)
    if self.candidate_order not in CANDIDATE_ORDERS:
      _fail(c, "candidate_order", self.candidate_order, f"use one of {CANDIDATE_ORDERS}")
    if self.num_candidates is not None:
      _positive_int(c, "num_candidates", self.num_candidates)
    if self.min_candidates is not None:
      _positive_int(c, "min_candidates", self.min_candidates)
      if self.num_candidates is not None and self.min_candidates > self.num_candidates:
        _fail(c, "min_candidates", self.min_candidates,
              f"must be <= num_candidates={self.num_candidates}")
    _store_python_scalars(self)

  def resolve(self, world_cfg: WorldConfig) -> tuple[int, int]:
    """(max history length, list width) for a world; checks them against its S."""
    S = world_cfg.history_len
    max_history = S if self.max_history is None else self.max_history
    if max_history > S:
      _fail("SplitConfig", "max_history", self.max_history,
            f"must be <= the world's history_len={S}")
    if self.min_history > max_history:
      _fail("SplitConfig", "min_history", self.min_history,
            f"must be <= max_history={max_history}" if self.max_history is not None else
            f"must be <= the world's history_len={S} (max_history is None: the world's)")
    C = world_cfg.num_candidates if self.num_candidates is None else self.num_candidates
    if self.min_candidates is not None and self.min_candidates > C:
      _fail("SplitConfig", "min_candidates", self.min_candidates,
            f"must be <= the list width {C}")
    return max_history, C
