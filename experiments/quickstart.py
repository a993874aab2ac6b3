"""Quickstart: rank candidates with a fresh Phoenix ranker, then retrieve from a corpus.

    python -m experiments.quickstart

The models are freshly initialised (untrained), so the probabilities and the order carry
no meaning yet; the demo shows the calls and what they return.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from phoenix_flax.config import PhoenixModelConfig, PhoenixRetrievalModelConfig, TransformerConfig
from phoenix_flax.example import example_batch, example_corpus
from phoenix_flax.inference import RankingRunner, RetrievalRunner, weighted_score

SHOWN_ACTIONS = ("favorite_score", "reply_score", "repost_score", "not_interested_score")
# Illustrative serving weights: positive engagement counts for, negative feedback against.
WEIGHTS = {"favorite_score": 1.0, "reply_score": 2.0, "repost_score": 1.5,
           "share_score": 1.0, "not_interested_score": -4.0, "block_author_score": -8.0,
           "mute_author_score": -6.0, "report_score": -10.0}

TRANSFORMER = TransformerConfig(emb_size=64, key_size=32, num_q_heads=4, num_kv_heads=2,
                                num_layers=2, widening_factor=2.0, attn_output_multiplier=0.125)


def rank_demo(num_candidates: int = 32, top_n: int = 8, chunk_size: int = 8) -> None:
  """Ranks candidates for two users and prints user 0's best ones."""
  config = PhoenixModelConfig(model=TRANSFORMER, emb_size=64, history_seq_len=16,
                              candidate_seq_len=num_candidates, right_anchored_rope=True)
  runner = RankingRunner.from_config(config, key=jax.random.key(0))
  batch, embeddings = example_batch(config, batch_size=2, key=jax.random.key(1))
  output = runner.rank(batch, embeddings)
  weighted_BC = np.asarray(weighted_score(output.scores, WEIGHTS))
  shown = {a: np.asarray(output.action(a)) for a in SHOWN_ACTIONS}
  post_hashes = np.asarray(batch.candidate_post_hashes)
  lengths = np.asarray(batch.history_post_hashes[:, :, 0] != 0).sum(axis=1)

  print(f"Ranking {num_candidates} candidates for 2 users (history lengths {lengths.tolist()})")
  print(f"Top {top_n} candidates of user 0, ordered by p(favorite):")
  header = (f"{'rank':>4}  {'cand':>4}  {'post hash':>9}  "
            + "  ".join(f"{a.removesuffix('_score'):>14}" for a in SHOWN_ACTIONS)
            + f"  {'weighted':>8}")
  print(header)
  print("-" * len(header))
  for rank, c in enumerate(np.asarray(output.ranked_indices[0, :top_n])):
    probs = "  ".join(f"{shown[a][0, c]:>14.4f}" for a in SHOWN_ACTIONS)
    print(f"{rank + 1:>4}  {c:>4}  {post_hashes[0, c, 0]:>9}  {probs}  {weighted_BC[0, c]:>8.4f}")

  chunked = runner.rank_chunked(batch, embeddings, chunk_size=chunk_size)
  diff = np.max(np.abs(np.asarray(chunked.scores) - np.asarray(output.scores)))
  print(f"Context encoded once, candidates scored in chunks of {chunk_size}: "
        f"max |difference| from scoring all at once = {diff:.1e}")


def retrieval_demo(corpus_size: int = 1000, top_k: int = 5) -> None:
  """Encodes two users and retrieves their nearest corpus items."""
  config = PhoenixRetrievalModelConfig(model=TRANSFORMER, emb_size=64, history_seq_len=16)
  runner = RetrievalRunner.from_config(config, key=jax.random.key(2))
  batch, embeddings = example_batch(config, batch_size=2, key=jax.random.key(3))
  # Corpus items are encoded by the candidate tower from their hash embeddings (here the
  # example batch's random ones); example_corpus supplies distinct post ids.
  _, items = example_batch(config, batch_size=1, key=jax.random.key(4),
                           num_candidates=corpus_size)
  _, post_ids = example_corpus(corpus_size, config.emb_size, jax.random.key(5))
  runner.set_corpus(runner.encode_corpus(items.candidate_post_embeddings[0],
                                         items.candidate_author_embeddings[0]), post_ids)
  result = runner.retrieve(batch, embeddings, top_k=top_k)
  print(f"\nRetrieval: top {top_k} of {corpus_size} corpus items per user (post id: score)")
  for b in range(2):
    items = ", ".join(f"{i}: {s:.3f}" for i, s in zip(np.asarray(result.top_k_post_ids[b]),
                                                       np.asarray(result.top_k_scores[b])))
    print(f"  user {b}: {items}")


def main(argv: list[str]) -> None:
  if argv[1:]:   # it has no flags: a typo, or --help, would otherwise run the whole demo
    print(f"error: experiments.quickstart takes no arguments, got {argv[1:]}\n"
          f"{__doc__.strip()}", file=sys.stderr)
    sys.exit(2)
  rank_demo()
  retrieval_demo()


if __name__ == "__main__":
  main(sys.argv)
