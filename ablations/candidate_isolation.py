"""Candidate isolation: a candidate's score should not depend on the rest of its list.

Hypothesis: with isolation (the release) each candidate attends to the user and history
and to itself only, so its score is the same in any list, in any order, scored at once
or in chunks. A plain causal mask lets candidates read the candidates before them; when
list companions carry signal in training, that can help in distribution, but at serving
time lists change (size, order, composition, chunking) and causal scores move with them,
costing AUC and calibration. When companions carry no signal, reading them buys nothing.

Task knobs: the list-level correlation is a condition: `corr0` (companions carry no
information about a candidate's labels) and `corr0.5` (`list_correlation=0.5`: a session
topic shared by the list's relevant candidates shifts the user's interest, so companions
are informative). Serving-time shifts, each an extra evaluation split of the same world:
`long_list` (another size: 2C candidates), `by_relevance` (another order: best candidates
first), `random_companions` (other companions: 90 percent random candidates, no shared session).
The correlation also changes how predictable labels are (at the cpu preset the eval
split's Bayes AUC is 0.81 at `corr0`, 0.86 at `corr0.5`; the `auc_mean` table gives each
sweep's), and `random_companions` drops the session, so
under `corr0.5` it is a harder task as well; every comparison pairs an arm with the
baseline on the same split, so these differences cancel in the deltas.
The probe scores the in-distribution lists in chunks of C/4 (isolated: one encoded
context, chunks at their true slots; causal: each chunk sent as a list of its own).
With isolation the chunked logits equal the whole lists' up to float rounding: 7e-7 in
float32 on CPU (smoke preset, untrained), but on an H200 0.003 in float32 (whose matmuls
JAX runs as TF32 there) and 0.04 in bfloat16, the forward's default on GPU/TPU, against
3.2 without isolation. There, compare the arms' figures, not the isolated one with zero.

Variants: `isolated` (candidate_isolation=True, baseline), `causal` (False), at each
list correlation (the smoke preset runs 0.5 only).

Metrics: in-distribution `auc_mean`, `score_consistency` (mean |logit change| when the
candidates of the other slot parity, about half of a candidate's companions, are
replaced by another user's), `<shift>/auc_mean` and `<shift>/calibration_error`
for every shift, `shift_mean/auc_mean` (their average), `chunked/auc_mean` and
`chunked/max_logit_change`, `calibration_error`, `logloss`, `diverged`.
"""

import os
import sys

if not __package__:  # run by path, not with python -m: import this checkout's packages
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ablations import probes, sweep

SHIFTS = ("long_list", "by_relevance", "random_companions")
CORRELATIONS = {"smoke": (0.5,), "cpu": (0.0, 0.5), "full": (0.0, 0.5)}


def task(cfg, preset):
  cfg.train.score_consistency = True
  shifts = cfg.extra_eval_splits
  width = cfg.eval_split.num_candidates or cfg.world.num_candidates   # None: the world's
  shifts.long_list = sweep.shifted_split(cfg, num_candidates=2 * width)
  shifts.by_relevance = sweep.shifted_split(cfg, candidate_order="relevance")
  shifts.random_companions = sweep.shifted_split(cfg, relevant_fraction=0.1,
                                                 list_correlation=0.0)


def conditions(preset):
  """Training and evaluation lists share the correlation, except `random_companions`."""
  paths = ("train_split", "eval_split", "extra_eval_splits.long_list",
           "extra_eval_splits.by_relevance")
  return {"list_correlation": {f"corr{c:g}": {f"{p}.list_correlation": c for p in paths}
                               for c in CORRELATIONS[preset]}}


def probe(ctx):
  split = ctx.spec.eval_splits["eval"]
  batches = probes.eval_batches(ctx.spec, ctx.world, split)
  chunk = max(split.resolve(ctx.spec.world)[1] // 4, 1)   # C/4 of the eval lists' width
  return {"chunked": probes.chunked_scoring(ctx.system, batches, chunk)}


def derived(found):
  aucs = [found.get(f"{s}/auc_mean") for s in SHIFTS]
  return {"shift_mean/auc_mean": None if None in aucs else sum(aucs) / len(aucs)}


ABLATION = sweep.Ablation(
    name="candidate_isolation",
    doc=__doc__,
    arms={"isolated": {"model.candidate_isolation": True},
          "causal": {"model.candidate_isolation": False}},
    baseline="isolated",
    metrics=("auc_mean", "shift_mean/auc_mean", "score_consistency", "chunked/auc_mean",
             *(f"{s}/auc_mean" for s in SHIFTS), "chunked/max_logit_change",
             "calibration_error", *(f"{s}/calibration_error" for s in SHIFTS), "logloss",
             "diverged"),
    headline=("auc_mean", "shift_mean/auc_mean", "random_companions/auc_mean",
              "score_consistency", "chunked/auc_mean"),
    task=task,
    conditions=conditions,
    probe=probe,
    derived=derived,
    better={"chunked/max_logit_change": "lower"},
)

if __name__ == "__main__":
  sweep.main(ABLATION)
