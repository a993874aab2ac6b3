"""Ranking task: PhoenixModel behind hash-embedding tables, per-action BCE on the
synthetic world, evaluated against the generator's Bayes-optimal AUC.

    python -m experiments.run --config=experiments/configs/ranking.py --workdir=/tmp/rank
    python -m experiments.run --config=experiments/configs/ranking.py:smoke --workdir=...

Presets (the text after ":"):
  cpu (default): tuned for 2 CPU cores; reaches a mean AUC within 0.03 of the Bayes-optimal
    AUC in under 5 minutes.
  smoke: a tiny world and model, seconds of training (tests, quick checks).
  full: a larger world and model for GPU/TPU.

The schema (every field, with `--config.<section>.<field>=` overrides) is documented in
`phoenix_flax/training/schema.py`.
"""

from __future__ import annotations

import ml_collections

from phoenix_flax.training import base_config

PRESETS = ("cpu", "smoke", "full")


def apply_preset_sizes(c: ml_collections.ConfigDict, preset: str) -> None:
  """The world, model and optimizer of `preset`, shared by the ranking and retrieval tasks
  (each task sets its own `train` section)."""
  # cpu: a world small enough for every post to be seen often in a few minutes, hash
  # tables ~4x the entity counts (few collisions), a small model at a high learning rate.
  # Layer stacks of up to 8 layers run unrolled (scan_unroll): on CPU a small model's
  # training step is bound by per-op overhead, which the scanned backward pass adds to.
  c.world.update(dict(num_users=500, num_posts=1000, num_authors=100, user_buckets=2048,
                      post_buckets=4096, author_buckets=512))
  c.model.update(dict(emb_size=32, key_size=16, num_q_heads=4, num_kv_heads=2, num_layers=2,
                      embedding_init_scale=0.05, scan_unroll=8))
  c.optim.learning_rate = 1e-2
  if preset == "smoke":
    c.world.update(dict(num_users=200, num_posts=400, num_authors=40, num_topics=8,
                        history_len=8, num_candidates=4, user_buckets=256, post_buckets=512,
                        author_buckets=64))
    c.model.update(dict(emb_size=16, key_size=8, num_q_heads=2, num_kv_heads=1,
                        num_layers=1))
    c.optim.warmup_steps = 5
  elif preset == "full":
    c.world.update(dict(num_users=100_000, num_posts=200_000, num_authors=10_000,
                        num_topics=64, latent_dim=64, history_len=128, num_candidates=32,
                        user_buckets=131_072, post_buckets=262_144, author_buckets=16_384))
    c.model.update(dict(emb_size=256, key_size=64, num_q_heads=4, num_kv_heads=2,
                        num_layers=4, attn_output_multiplier=0.125, scan_unroll=1))
    c.optim.update(dict(learning_rate=1e-3, warmup_steps=1000))


def get_config(preset: str = "cpu") -> ml_collections.ConfigDict:
  preset = preset or "cpu"
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r} for ranking.py; use one of {PRESETS}")
  c = base_config("ranking")
  apply_preset_sizes(c, preset)
  # cpu: many cheap steps.
  c.train.update(dict(num_steps=4000, batch_size=16, steps_per_call=200, eval_every=1000,
                      checkpoint_every=1000, eval_batch_size=256, eval_batches=4))
  if preset == "smoke":
    c.train.update(dict(num_steps=40, batch_size=8, steps_per_call=10, eval_every=20,
                        checkpoint_every=20, eval_batch_size=16, eval_batches=2))
    c.ranking.top_k = (2,)    # lists of 4: at K=5 recall would be 1.0 by construction
  elif preset == "full":
    c.train.update(dict(num_steps=20_000, batch_size=512, steps_per_call=200,
                        eval_every=2000, checkpoint_every=2000, eval_batch_size=1024,
                        eval_batches=8))
  return c
