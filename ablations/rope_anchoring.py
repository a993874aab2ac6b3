"""Right-anchored RoPE: recency should not depend on how long a user's history is.

Hypothesis: with sequential positions (the release default) the newest history item sits
at position n (the history length) while the candidates sit after the padded history, so
the distance between a candidate and the item that matters most varies with n, and a
model that learned it on some lengths misreads other lengths. Right-anchored positions
put the newest item right before the candidates at any length, so AUC should hold when
the length distribution shifts, and a candidate's score should not depend on its slot
(every candidate shares one position).

Task knobs: a recency-driven world (`world.recency_decay=0.3`: the current interest
follows the last few history items; `world.interest_mix=0.9`: it outweighs long-term
taste); training histories of widely varying length, log-uniform in [1, 3S/4]; the
`long_history` evaluation split draws lengths in (3S/4, S], never seen in training.

Variants: `sequential` (right_anchored_rope=False, baseline), `right_anchored` (True).

Metrics: in-distribution `auc_mean`, `long_history/auc_mean` (the length shift),
`slot_sensitivity` (std of a candidate's logit as its list is rotated through every
slot, mean over candidates and actions), calibration errors, `logloss`, `diverged`.
"""

import os
import sys

if not __package__:  # run by path, not with python -m: import this checkout's packages
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ablations import probes, sweep


def task(cfg, preset):
  S = cfg.world.history_len
  seen = max(3 * S // 4, 1)
  cfg.world.recency_decay = 0.3
  cfg.world.interest_mix = 0.9
  for split in (cfg.train_split, cfg.eval_split):
    split.update(dict(history_dist="log_uniform", min_history=1, max_history=seen))
  cfg.extra_eval_splits.long_history = sweep.shifted_split(
      cfg, history_dist="uniform", min_history=min(seen + 1, S), max_history=S)


def probe(ctx):
  first = probes.eval_batches(ctx.spec, ctx.world, ctx.spec.eval_splits["eval"])[0]
  return {"slot_sensitivity": probes.slot_sensitivity(ctx.system, first.batch,
                                                      first.candidate_mask)}


ABLATION = sweep.Ablation(
    name="rope_anchoring",
    doc=__doc__,
    arms={"sequential": {"model.right_anchored_rope": False},
          "right_anchored": {"model.right_anchored_rope": True}},
    baseline="sequential",
    metrics=("auc_mean", "long_history/auc_mean", "slot_sensitivity", "calibration_error",
             "long_history/calibration_error", "logloss", "diverged"),
    headline=("auc_mean", "long_history/auc_mean", "slot_sensitivity"),
    task=task,
    probe=probe,
    better={"slot_sensitivity": "lower"},
)

if __name__ == "__main__":
  sweep.main(ABLATION)
