"""The world's fixed latent state and its known action link.

Suffixes: U users, P posts, W authors (writers), T topics, L latent dim, V surfaces,
A actions, K hash functions; `X` stands for any leading shape.
"""

from __future__ import annotations

import functools
import itertools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from phoenix_flax.synthetic.config import WorldConfig


class World(eqx.Module):
  """Latent vectors, link parameters and id -> hash tables; `cfg` is static."""

  cfg: WorldConfig = eqx.field(static=True)
  topic_vecs_TL: Array
  post_vecs_PL: Array
  post_quality_P: Array
  post_author_P: Array
  user_topic_logits_UT: Array
  user_taste_UL: Array
  user_bias_U: Array
  base_logits_A: Array
  affinity_weight_A: Array
  quality_weight_A: Array
  surface_effect_VA: Array
  action_sign_A: Array
  user_hashes_UK: Array
  post_hashes_PK: Array
  author_hashes_WK: Array


def _unit(x: Array) -> Array:
  return x / jnp.sqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), 1e-12))


# A float32 uniform in [0, 1) takes 2**23 values (multiples of 2**-23), so `floor(u * n)`
# reaches at most 2**23 of n integers: a draw among more comes from `jax.random.randint`.
UNIFORM_VALUES = 2 ** 23


def uniform_below(u: Array, n, bound: int, key: PRNGKeyArray) -> Array:
  """int32 integers uniform in `[0, n)`, of u's shape (`n` an int, or an int array that
  broadcasts against u, at most the static `bound`): `floor(u * n)` from the float32
  uniforms `u`, or, where `bound` exceeds `UNIFORM_VALUES`, `jax.random.randint` of `key`
  (u unused), so that every integer can come up. Below the bound the draws of existing
  worlds stay as they were."""
  if bound > UNIFORM_VALUES:
    return jax.random.randint(key, jnp.shape(u), 0, n, dtype=jnp.int32)
  n = jnp.asarray(n)
  return jnp.minimum(jnp.floor(u * n.astype(u.dtype)).astype(jnp.int32),
                     (n - 1).astype(jnp.int32))


def ids_in_topic(topic: Array, num_ids: int, num_topics: int, u: Array,
                 key: PRNGKeyArray) -> Array:
  """The id `topic + T * j` with j uniform among the ids of that topic (u in [0, 1); `key`
  draws j instead where a topic has more than `UNIFORM_VALUES` ids)."""
  count = (num_ids - 1 - topic) // num_topics + 1
  j = uniform_below(u, count, -(-num_ids // num_topics), key)
  return (topic + num_topics * j).astype(jnp.int32)


def _float32(sampler):
  """`sampler` drawing float32 whatever `jax_enable_x64` says (its default dtype follows
  the flag, and a float64 draw is another world, not a wider copy of this one)."""
  return functools.partial(sampler, dtype=jnp.float32)


def random_blocks(key: PRNGKeyArray, sampler, shapes: dict) -> dict:
  """One draw of `sampler` cut into named blocks (each random call costs compile time)."""
  sizes = [math.prod(shape) for shape in shapes.values()]
  flat = sampler(key, (sum(sizes),))
  starts = itertools.accumulate([0] + sizes)
  return {name: flat[a:a + n].reshape(shape)
          for (name, shape), a, n in zip(shapes.items(), starts, sizes)}


@functools.partial(jax.jit, static_argnums=0)
def _make_world(cfg: WorldConfig, key: PRNGKeyArray) -> World:
  U, P, W, T, L = cfg.num_users, cfg.num_posts, cfg.num_authors, cfg.num_topics, cfg.latent_dim
  A, V = cfg.num_actions, cfg.product_surface_vocab_size
  k_normal, k_uniform = jax.random.split(key)
  # A new random quantity takes a key of its own (`jax.random.fold_in(key, 1)`, ...): a
  # block added to these draws would change every existing world, and every result
  # trained on it, while the runs' configs stay the same (guarded by
  # tests/test_synthetic.py::test_the_default_world_and_its_batches_are_unchanged).
  z = random_blocks(k_normal, _float32(jax.random.normal), {
      "topic": (T, L), "author": (W, L), "post": (P, L), "quality": (P,), "taste": (U, T),
      "bias": (U,), "surface": (V, A)})
  u = random_blocks(k_uniform, _float32(jax.random.uniform), {
      "author_of_post": (P,), "affinity": (A,), "quality": (A,),
      "user_hashes": (U, cfg.num_user_hashes), "post_hashes": (P, cfg.num_item_hashes),
      "author_hashes": (W, cfg.num_author_hashes)})
  topic_vecs_TL = _unit(z["topic"])
  post_topic_P = jnp.arange(P, dtype=jnp.int32) % T
  # (Keys folded from `key` draw the ids and hashes of worlds too large for a float32
  # uniform, `uniform_below`.)
  post_author_P = ids_in_topic(post_topic_P, W, T, u["author_of_post"],
                               jax.random.fold_in(key, 1))
  post_vecs_PL = _unit(topic_vecs_TL[post_topic_P]
                       + cfg.author_style * z["author"][post_author_P] / jnp.sqrt(L)
                       + cfg.post_noise * z["post"] / jnp.sqrt(L))
  user_topic_logits_UT = cfg.taste_concentration * z["taste"]
  negative_A = np.isin(np.arange(A), cfg.negative_actions)
  rates_A = jnp.asarray(cfg.base_rates, jnp.float32)

  def hashes(u_NK, buckets, tag):  # uniform in [1, buckets)
    return 1 + uniform_below(u_NK, buckets - 1, buckets - 1, jax.random.fold_in(key, tag))

  return World(
      cfg=cfg,
      topic_vecs_TL=topic_vecs_TL,
      post_vecs_PL=post_vecs_PL,
      post_quality_P=z["quality"],
      post_author_P=post_author_P,
      user_topic_logits_UT=user_topic_logits_UT,
      user_taste_UL=_unit(jax.nn.softmax(user_topic_logits_UT) @ topic_vecs_TL),
      user_bias_U=cfg.user_bias_scale * z["bias"],
      base_logits_A=jnp.log(rates_A) - jnp.log1p(-rates_A),
      affinity_weight_A=0.5 + u["affinity"],
      quality_weight_A=0.25 + 0.75 * u["quality"],
      surface_effect_VA=cfg.surface_scale * z["surface"],
      action_sign_A=jnp.asarray(np.where(negative_A, -1.0, 1.0), jnp.float32),
      user_hashes_UK=hashes(u["user_hashes"], cfg.user_buckets, 2),
      post_hashes_PK=hashes(u["post_hashes"], cfg.post_buckets, 3),
      author_hashes_WK=hashes(u["author_hashes"], cfg.author_buckets, 4),
  )


def make_world(cfg: WorldConfig, key: PRNGKeyArray) -> World:
  """Draws every latent quantity of the world from `key` (deterministic).

  Topic vectors are random unit vectors; post p has topic `p % T`, an author of that
  topic, a unit latent `topic + author style + noise` and a N(0, 1) quality; a user's
  long-term taste is the unit mean of the topics under a random softmax; per-action
  affinity weights are uniform in [0.5, 1.5], quality weights in [0.25, 1]; hash tables
  map every id to buckets drawn uniformly from [1, buckets).
  """
  if not isinstance(cfg, WorldConfig):
    raise TypeError(f"cfg must be a WorldConfig, got {type(cfg).__name__}")
  return _make_world(cfg, key)


def history_weights(history_len_X: Array, S: int, decay: float) -> Array:
  """`[..., S]` weights `decay**(n-1-s)` of the valid items s < n, 0 elsewhere."""
  n = jnp.asarray(history_len_X).astype(jnp.int32)[..., None]   # (lengths <= S)
  s = jax.lax.broadcast_to_rank(jnp.arange(S, dtype=jnp.int32), n.ndim)
  age = (n - 1 - s).astype(jnp.float32)
  return jnp.where(s < n, jnp.power(decay, jnp.maximum(age, 0.0)), 0.0)


def mix_interest(world: World, taste_XL: Array, weights_XS: Array, history_vecs_XSL: Array
                 ) -> Array:
  """`interest_mix * current + (1 - interest_mix) * taste`; current = weighted mean of
  the history vectors (the taste itself when no weight is positive)."""
  total_X1 = jnp.sum(weights_XS, axis=-1, keepdims=True)
  current_XL = jnp.einsum("...s,...sl->...l", weights_XS, history_vecs_XSL)
  current_XL = jnp.where(total_X1 > 0, current_XL / jnp.maximum(total_X1, 1e-12), taste_XL)
  m = world.cfg.interest_mix
  return m * current_XL + (1.0 - m) * taste_XL


def user_interest(world: World, user_ids_B: Array, history_post_ids_BS: Array,
                  history_len_B: Array) -> Array:
  """Interest `[B, L]` a user holds after the first `history_len` history items."""
  weights_BS = history_weights(history_len_B, history_post_ids_BS.shape[-1],
                               world.cfg.recency_decay)
  vecs_BSL = world.post_vecs_PL[jnp.maximum(history_post_ids_BS, 0)]
  return mix_interest(world, world.user_taste_UL[user_ids_B], weights_BS, vecs_BSL)


def true_logits(world: World, interest_XL: Array, post_ids_X: Array, surface_X: Array,
                age_hours_X: Array, user_bias_X: Array) -> Array:
  """The link: per-action logits `[..., A]` of a user with this interest on a post.

  Positive actions rise with `affinity_scale * interest . post`, post quality, the user's
  bias and fall with post age (when `post_age`); negative actions take the opposite sign
  of affinity and quality. Every action has its own base rate, weights and surface effect.
  """
  c = world.cfg
  affinity_X = c.affinity_scale * jnp.sum(interest_XL * world.post_vecs_PL[post_ids_X], -1)
  quality_X = c.quality_scale * world.post_quality_P[post_ids_X]
  per_action = lambda v_A: jax.lax.broadcast_to_rank(v_A, affinity_X.ndim + 1)   # [..., A]
  drive_XA = per_action(world.action_sign_A) * (
      affinity_X[..., None] * per_action(world.affinity_weight_A)
      + quality_X[..., None] * per_action(world.quality_weight_A))
  positive_A = (world.action_sign_A > 0).astype(jnp.float32)
  per_item = lambda v: jnp.broadcast_to(jnp.asarray(v, jnp.float32), affinity_X.shape)
  shift_X = per_item(user_bias_X)   # (a user's bias may come as [B, 1], or one number)
  if c.post_age:
    shift_X = shift_X - c.age_decay_per_day * per_item(age_hours_X) / 24.0
  return (per_action(world.base_logits_A) + drive_XA + world.surface_effect_VA[surface_X]
          + shift_X[..., None] * per_action(positive_A))


def post_features(world: World, post_ids: Array) -> tuple[Array, Array, Array]:
  """Hashes of posts for a retrieval corpus: `(post [..., I], author [..., Au],
  surface [...])`; the surface is 0 (a corpus has no impression context)."""
  post_ids = jnp.asarray(post_ids, jnp.int32)
  return (world.post_hashes_PK[post_ids],
          world.author_hashes_WK[world.post_author_P[post_ids]],
          jnp.zeros(post_ids.shape, jnp.int32))
