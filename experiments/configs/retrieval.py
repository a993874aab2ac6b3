"""Retrieval task: the two-tower PhoenixRetrievalModel behind hash-embedding tables,
trained with an in-batch sampled softmax (a user's positive is its first favorited
candidate; the other users' positives are its negatives) and evaluated by recall@K
against the corpus of every post, beside the Bayes-optimal recall of the generator.

    python -m experiments.run --config=experiments/configs/retrieval.py --workdir=/tmp/ret

Presets (the text after ":"): cpu (default), smoke, full; see ranking.py.
"""

from __future__ import annotations

import ml_collections

from phoenix_flax.training import base_config

PRESETS = ("cpu", "smoke", "full")


def get_config(preset: str = "cpu") -> ml_collections.ConfigDict:
  preset = preset or "cpu"
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r} for retrieval.py; use one of {PRESETS}")
  c = base_config("retrieval")
  c.world.update(dict(num_users=500, num_posts=1000, num_authors=100, user_buckets=2048,
                      post_buckets=4096, author_buckets=512))
  c.model.update(dict(emb_size=32, key_size=16, num_q_heads=4, num_kv_heads=2, num_layers=2,
                      embedding_init_scale=0.05))
  c.optim.learning_rate = 1e-2
  c.train.update(dict(num_steps=2000, batch_size=64, steps_per_call=100, eval_every=500,
                      checkpoint_every=500, eval_batch_size=128, eval_batches=4))
  c.retrieval.recall_k = (10, 100)
  if preset == "smoke":
    c.world.update(dict(num_users=200, num_posts=400, num_authors=40, num_topics=8,
                        history_len=8, num_candidates=4, user_buckets=256, post_buckets=512,
                        author_buckets=64))
    c.model.update(dict(emb_size=16, key_size=8, num_q_heads=2, num_kv_heads=1,
                        num_layers=1))
    c.train.update(dict(num_steps=20, batch_size=8, steps_per_call=10, eval_every=10,
                        checkpoint_every=10, eval_batch_size=16, eval_batches=2))
    c.optim.warmup_steps = 5
    c.retrieval.recall_k = (5, 20)
  elif preset == "full":
    c.world.update(dict(num_users=100_000, num_posts=200_000, num_authors=10_000,
                        num_topics=64, latent_dim=64, history_len=128, num_candidates=32,
                        user_buckets=131_072, post_buckets=262_144, author_buckets=16_384))
    c.model.update(dict(emb_size=256, key_size=64, num_q_heads=4, num_kv_heads=2,
                        num_layers=4, attn_output_multiplier=0.125))
    c.train.update(dict(num_steps=20_000, batch_size=1024, steps_per_call=200,
                        eval_every=2000, checkpoint_every=2000, eval_batch_size=512,
                        eval_batches=8))
    c.optim.update(dict(learning_rate=1e-3, warmup_steps=1000))
    c.retrieval.recall_k = (10, 100, 1000)
  return c
