"""PhoenixRetrievalModel: causal user tower and a candidate tower, scored by dot product."""

from __future__ import annotations

from typing import Optional

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from phoenix_flax.config import PhoenixRetrievalModelConfig, _check_key, _count
from phoenix_flax.layers import variance_scaling
from phoenix_flax.ranking import Diagnostics, context_tokens
from phoenix_flax.transformer import Transformer
from phoenix_flax.types import (RecsysBatch, RecsysEmbeddings, RetrievalOutput, check_batch,
                                check_candidate_embeddings, check_embeddings)

NORM_EPS = 1e-12
MASKED_SCORE = -1e12


def l2_normalize(x: Array) -> tuple[Array, Array]:
  """`x / sqrt(max(|x|^2, 1e-12))` over the last axis; also returns that norm."""
  norm = jnp.sqrt(jnp.maximum(jnp.sum(jnp.square(x), axis=-1, keepdims=True), NORM_EPS))
  return x / norm, norm


class CandidateTower(eqx.Module):
  """`[B, C, I+Au, D]` hash embeddings -> unit vectors `[B, C, D]`.

  MLP mode: flatten -> `@ P1 [(I+Au)D, 2D]` -> silu -> `@ P2 [2D, D]` -> L2 normalise.
  Mean-pool mode (`enable_linear_proj=False`): mean over hashes -> L2 normalise; no
  parameters at all.
  """

  projection_1: Optional[Array]
  projection_2: Optional[Array]
  emb_size: int = eqx.field(static=True)

  def __init__(self, emb_size: int, num_hashes: int, enable_linear_proj: bool = True, *,
               key: PRNGKeyArray):
    for name, value in (("emb_size", emb_size), ("num_hashes", num_hashes)):
      _count(f"CandidateTower: {name}", value, 1)
    self.emb_size = emb_size
    if enable_linear_proj:
      k1, k2 = jax.random.split(key)
      self.projection_1 = variance_scaling(k1, (num_hashes * emb_size, 2 * emb_size),
                                           num_hashes * emb_size)
      self.projection_2 = variance_scaling(k2, (2 * emb_size, emb_size), 2 * emb_size)
    else:
      self.projection_1 = self.projection_2 = None

  def __call__(self, hash_embeddings_BCHD: Array) -> Array:
    """Unit vectors `[B, C, D]` (float32) of float hash embeddings `[B, C, hashes, D]`;
    `AssertionError` (chex) for another rank or an integer dtype, ValueError for
    another D or, in MLP mode, another number of hashes than it was built for."""
    chex.assert_rank(hash_embeddings_BCHD, 4,
                     custom_message="CandidateTower input must be [B, C, hashes, D]")
    chex.assert_type(hash_embeddings_BCHD, float,
                     custom_message="CandidateTower input must hold float embeddings")
    B, C, H, D = hash_embeddings_BCHD.shape
    if D != self.emb_size:
      raise ValueError(f"CandidateTower input has emb size {D}, expected {self.emb_size}")
    x = hash_embeddings_BCHD.astype(jnp.float32)
    if self.projection_1 is None:
      return l2_normalize(jnp.mean(x, axis=2))[0]
    if H * D != self.projection_1.shape[0]:
      raise ValueError(f"CandidateTower input has {H} hashes, built for "
                       f"{self.projection_1.shape[0] // D}")
    h = jax.nn.silu(x.reshape(B, C, H * D) @ self.projection_1) @ self.projection_2
    return l2_normalize(h)[0]


class PhoenixRetrievalModel(eqx.Module):
  """Two towers; `model(batch, embeddings, corpus, top_k) -> RetrievalOutput`."""

  product_surface_embedding_table: Array
  action_projection: Array
  proj_mat_1: Array
  proj_mat_3: Array
  transformer: Transformer
  candidate_tower: CandidateTower
  config: PhoenixRetrievalModelConfig = eqx.field(static=True)

  def __init__(self, config: PhoenixRetrievalModelConfig, *, key: PRNGKeyArray):
    if not isinstance(config, PhoenixRetrievalModelConfig):
      raise TypeError("config must be a PhoenixRetrievalModelConfig, got "
                      f"{type(config).__name__}")
    _check_key("PhoenixRetrievalModel", key)
    self.config = c = config
    hc, D = c.hash_config, c.emb_size
    ks = jax.random.split(key, 6)
    hist_in = (hc.num_item_hashes + hc.num_author_hashes + 2) * D
    self.product_surface_embedding_table = variance_scaling(
        ks[0], (c.product_surface_vocab_size, D), D)
    self.action_projection = variance_scaling(ks[1], (c.num_actions, D), c.num_actions)
    self.proj_mat_1 = variance_scaling(ks[2], (hc.num_user_hashes * D, D), hc.num_user_hashes * D)
    self.proj_mat_3 = variance_scaling(ks[3], (hist_in, D), hist_in)
    self.transformer = Transformer(c.model, key=ks[4])
    self.candidate_tower = CandidateTower(D, hc.num_item_hashes + hc.num_author_hashes,
                                          c.enable_linear_proj, key=ks[5])

  def build_user_representation(self, batch: RecsysBatch, embeddings: RecsysEmbeddings
                                ) -> tuple[Array, Array]:
    """Unit-norm user vector `[B, D]` and its norm before normalisation `[B, 1]` (at
    least 1e-6, the normalisation's floor). A row with no valid token (user hash 0 and no
    history: a batch's padding row) pools nothing and gets the zero vector, as in the
    release, so every corpus item scores 0 for it."""
    user_BD, norm_B1, _ = self.user_forward(batch, embeddings)
    return user_BD, norm_B1

  def user_forward(self, batch: RecsysBatch, embeddings: RecsysEmbeddings
                   ) -> tuple[Array, Array, Diagnostics]:
    """`build_user_representation` plus the user tower's per-layer diagnostics (max
    |attention logit| before the cap, residual RMS), as `PhoenixModel.forward` gives."""
    c = self.config
    B, _ = check_batch(batch, c.hash_config, c.history_seq_len, c.num_actions,
                       with_candidates=False)
    check_embeddings(embeddings, c.hash_config, B, c.history_seq_len, 0, c.emb_size,
                     with_candidates=False)
    tokens_BTD, mask_BT = context_tokens(self, batch, embeddings)
    out = self.transformer(tokens_BTD, mask_BT)
    h_BTD = out.embeddings.astype(jnp.float32)
    m_BT1 = mask_BT[..., None].astype(jnp.float32)
    pooled_BD = jnp.sum(h_BTD * m_BT1, axis=1) / jnp.maximum(jnp.sum(m_BT1, axis=1), 1.0)
    user_BD, norm_B1 = l2_normalize(pooled_BD)
    return user_BD, norm_B1, Diagnostics(out.max_abs_attn_logit, out.residual_rms)

  def build_candidate_representation(self, batch: RecsysBatch, embeddings: RecsysEmbeddings
                                     ) -> tuple[Array, Array]:
    """Unit-norm candidate vectors `[B, C, D]` and the candidate padding mask `[B, C]`."""
    if not isinstance(embeddings, RecsysEmbeddings):
      raise TypeError(f"embeddings must be RecsysEmbeddings, got {type(embeddings).__name__}")
    post, author = embeddings.candidate_post_embeddings, embeddings.candidate_author_embeddings
    chex.assert_rank(post, 4, custom_message="field candidate_post_embeddings must be "
                     "[B, C, num_item_hashes, emb_size]")
    c = self.config
    B, C = post.shape[:2]
    check_candidate_embeddings(embeddings, c.hash_config, B, C, c.emb_size)
    chex.assert_shape(batch.candidate_post_hashes, (B, C, c.hash_config.num_item_hashes),
                      custom_message="field candidate_post_hashes")
    chex.assert_type(batch.candidate_post_hashes, int,
                     custom_message="field candidate_post_hashes must hold integers")
    reps = self.candidate_tower(jnp.concatenate([post, author], axis=2))
    return reps, batch.candidate_post_hashes[:, :, 0] != 0

  def __call__(self, batch: RecsysBatch, embeddings: RecsysEmbeddings,
               corpus_embeddings: Array, top_k: int, corpus_mask: Optional[Array] = None,
               ) -> RetrievalOutput:
    """Top-k corpus items for each user by dot product; masked items score -1e12 (and
    still fill the top k when fewer than k items are unmasked, as in the release).
    `corpus_mask` is `[N]` (the release's: the same items for every user) or `[B, N]`
    (per user, e.g. to leave out what each has seen).
    `top_k` fixes an output shape: under `jax.jit` pass it as a static argument
    (`RetrievalRunner` does this for you)."""
    user, _ = self.build_user_representation(batch, embeddings)
    return self.retrieve(user, corpus_embeddings, top_k, corpus_mask)

  def scores(self, user_BD: Array, items_ND: Array) -> Array:
    """How well each user matches each item, `[B, N]`: the dot product of their unit
    vectors (the release's), in the user's dtype (float32: `user_forward` pools in it,
    whatever the forward dtype; the loss, which casts the scores to float32 after this
    product, relies on that). Every retrieval score is this one:
    serving (`retrieve`), the in-batch training loss, and the evaluation's recall, AUC
    and loss (`training/loop.py`), so an idea that changes the scoring is written here
    once."""
    return user_BD @ items_ND.astype(user_BD.dtype).T

  def retrieve(self, user_BD: Array, corpus_ND: Array, top_k: int,
               corpus_mask: Optional[Array] = None) -> RetrievalOutput:
    """The top-k corpus items of users already encoded: `scores`, masked entries at
    -1e12 (`corpus_mask` `[N]`, or `[B, N]` per user; False leaves an item out), then
    `lax.top_k`."""
    chex.assert_rank(corpus_ND, 2, custom_message="corpus_embeddings must be [N, D]")
    if not jnp.issubdtype(corpus_ND.dtype, jnp.floating):
      raise ValueError(f"corpus_embeddings has dtype {corpus_ND.dtype}, expected floats")
    if corpus_ND.shape[1] != user_BD.shape[1]:
      raise ValueError(f"corpus_embeddings has dim {corpus_ND.shape[1]}, user representation "
                       f"has {user_BD.shape[1]}")
    # (an integer: True passed as 1, and 2.0 failed inside lax.top_k, or not, by the cache)
    top_k = _count("top_k", top_k, 1, corpus_ND.shape[0], " (corpus size)")
    scores = self.scores(user_BD, corpus_ND)
    if corpus_mask is not None:
      N, B = corpus_ND.shape[0], user_BD.shape[0]
      if jnp.shape(corpus_mask) not in ((N,), (B, N)):
        raise ValueError(f"corpus_mask has shape {jnp.shape(corpus_mask)}, expected ({N},) or "
                         f"({B}, {N}): the corpus items, for every user or per user")
      if corpus_mask.dtype != jnp.bool_:
        raise ValueError(f"corpus_mask has dtype {corpus_mask.dtype}, expected bool (True "
                         "keeps an item; RetrievalRunner.retrieve also takes 0/1 numbers)")
      scores = jnp.where(corpus_mask if corpus_mask.ndim == 2 else corpus_mask[None, :],
                         scores, MASKED_SCORE)
    top_scores, top_idx = jax.lax.top_k(scores, top_k)
    return RetrievalOutput(user_BD, top_idx.astype(jnp.int32), top_scores)
