"""logQ correction: the retriever's in-batch negatives should not punish popular posts.

Hypothesis: the in-batch softmax draws its negatives from the other users' positives, so
a post is a negative as often as it is engaged with. Without a correction the model
learns a score near `log p(post | user) - log q(post)`, which ranks popular posts below
where their engagement puts them; subtracting each negative's estimated `log q` (Yi et
al. 2019) removes that bias, so recall of the (popularity-weighted) positives rises.
The more engagement concentrates on a few posts, the larger the gain: in this world
the post quality (`world.quality_scale`) is what makes some posts engaged with more
often than others.

Task knobs: the retrieval task (`experiments/configs/retrieval.py`) as it is;
`retrieval.logq_decay` stays at its default 0.999 (counts remember about 1,000 steps).

Variants: `off` (retrieval.logq_correction=False, the plain in-batch softmax,
baseline) and `logq` (True), each in the default world (`quality0.5`) and in one where
quality weighs twice as much (`quality1`, world.quality_scale=1.0).

Metrics: final `recall@10`, `recall@100` and `auc` against the corpus of every post, and
the evaluation's in-batch `loss`. That loss is never corrected, so both arms are measured
on one scale (`train/loss` is each arm's own loss), but it is the loss `off` minimises,
whose optimum is the biased score above: it leans towards `off` by construction, and
recall is the judge of the correction.
"""

import os
import sys

if not __package__:  # run by path, not with python -m: import this checkout's packages
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ablations import sweep


def conditions(preset):
  return {"quality": {f"quality{q:g}": {"world.quality_scale": q} for q in (0.5, 1.0)}}


ABLATION = sweep.Ablation(
    name="logq_correction",
    doc=__doc__,
    experiment="retrieval",
    arms={"off": {"retrieval.logq_correction": False},
          "logq": {"retrieval.logq_correction": True}},
    baseline="off",
    metrics=("recall@10", "recall@100", "auc", "loss", "diverged"),
    headline=("recall@10", "recall@100", "auc"),
    conditions=conditions,
    curves=("eval/loss", "eval/recall@10"),
)

if __name__ == "__main__":
  sweep.main(ABLATION)
