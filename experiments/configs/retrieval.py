"""Retrieval task: the two-tower PhoenixRetrievalModel behind hash-embedding tables,
trained with an in-batch sampled softmax (a user's positive is its first favorited
candidate; the other users' positives are its negatives) and evaluated by recall@K
against the corpus of every post, beside `bayes_recall@K`: the recall of an oracle that
ranks the corpus by the generator's true favorite probability (a reference, not a
ceiling; see `training.loop.bayes_corpus_hits`).

    python -m experiments.run --config=experiments/configs/retrieval.py --workdir=/tmp/ret

Presets (the text after ":"): cpu (default), smoke, full; see ranking.py.
"""

from __future__ import annotations

import ml_collections

from experiments.configs import ranking
from phoenix_flax.training import base_config

PRESETS = ranking.PRESETS


def get_config(preset: str = "cpu") -> ml_collections.ConfigDict:
  preset = preset or "cpu"
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r} for retrieval.py; use one of {PRESETS}")
  c = base_config("retrieval")
  ranking.apply_preset_sizes(c, preset)     # the same world, model and optimizer
  # cpu: 2048 evaluation lists; over 512, the oracle's recall@100 varied with an SD of
  # 0.017 between evaluation sets (30 sets), as much as the model-to-oracle gap.
  c.train.update(dict(num_steps=2000, batch_size=64, steps_per_call=100, eval_every=500,
                      checkpoint_every=500, eval_batch_size=128, eval_batches=16))
  # Every preset reports recall@10 and recall@100, so that an ablation naming them runs
  # at any preset (the smoke world's corpus has 400 posts).
  c.retrieval.recall_k = (10, 100)
  if preset == "smoke":
    c.train.update(dict(num_steps=20, batch_size=8, steps_per_call=10, eval_every=10,
                        checkpoint_every=10, eval_batch_size=16, eval_batches=2))
  elif preset == "full":
    c.train.update(dict(num_steps=20_000, batch_size=1024, steps_per_call=200,
                        eval_every=2000, checkpoint_every=2000, eval_batch_size=1024,
                        eval_batches=4))
    c.retrieval.recall_k = (10, 100, 1000)
  return c
