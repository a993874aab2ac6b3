"""Grouped-query attention: fewer key/value heads should cost little quality and save
serving memory.

Hypothesis: with 8 query heads, sharing each key/value head among 2, 4 or 8 query heads
shrinks the per-user KV cache (what a server keeps to score a user's candidates in
chunks) and the attention parameters proportionally, while the ranking AUC barely moves,
so the AUC per KV-cache byte improves as the KV heads shrink. (Scoring throughput does
not depend on the trained weights, so its seeds are repeated timings in one
process: its CI and p measure timing noise within that process, not how much the
speed-up changes from one process or host load to another.)

Task knobs: `model.num_q_heads=8` fixed, the default ranking task otherwise.

Variants: `kv8` (8 KV heads, no grouping, as in the released example config; baseline),
`kv4`, `kv2`, `kv1` (multi-query attention).

Metrics: `auc_mean`, `params/transformer` and `params/total` (trained parameters),
`kv_cache_bytes` (keys and values of one user context, 1 + S tokens, in the forward
dtype), `scoring_candidates_per_s` (jitted forward on one evaluation batch, every
variant's run of a seed timed together in interleaved rounds: median of at least 10
rounds, and more until the timed calls add up to 0.5 s per variant on average, after
compiling), `logloss`, `diverged`;
`gqa_tradeoff.png` plots AUC against KV-cache bytes and parameters.
"""

import os
import sys

if not __package__:  # run by path, not with python -m: import this checkout's packages
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ablations import probes, report, sweep


def task(cfg, preset):
  cfg.model.num_q_heads = 8


def probe(ctx):
  model = ctx.spec.model
  return {"params/transformer": probes.count_params(ctx.system.model.transformer),
          "params/total": probes.count_params(ctx.system),
          "kv_cache_bytes": model.model.kv_cache_bytes(model.candidate_start_offset,
                                                       model.fprop_dtype)}


def joint_probe(contexts):
  """Scoring throughput of one seed's runs of every variant, timed in interleaved rounds
  on the first evaluation batch (the variants share the world, so the batch is one)."""
  first = contexts[0]
  if any(c.spec.world != first.spec.world for c in contexts):
    raise ValueError("gqa_ratio: the variants' synthetic worlds differ, so their "
                     "throughputs would be timed on different batches")
  batch = probes.eval_batches(first.spec, first.world, first.spec.eval_splits["eval"])[0].batch
  found = probes.scoring_throughput({c.variant.name: c.system for c in contexts}, batch)
  return [{"scoring_candidates_per_s": found[c.variant.name]} for c in contexts]


def plot_tradeoff(results, workdir):
  """gqa_tradeoff.png: mean AUC (95% CI over seeds) against KV-cache bytes per user
  context and transformer parameters, log2 x-axes (each halving of the KV heads is a
  step), ticks at the variants' values."""
  from matplotlib.ticker import FixedLocator, NullLocator
  fig, axes = report.figure(1, 2, (8.4, 3.2))
  units = {"kv_cache_bytes": "KV-cache bytes per user context",
           "params/transformer": "transformer parameters"}
  aucs = [v["metrics"]["auc_mean"]["mean"] for v in results["variants"].values()
          if v["metrics"]["auc_mean"]["mean"] is not None]
  for ax, x_metric in zip(axes.flat, units):
    xs = []
    for name, v in results["variants"].items():
      auc, x = v["metrics"]["auc_mean"], v["metrics"][x_metric]
      if auc["mean"] is None or x["mean"] is None:
        continue
      err = 0.0 if auc["ci95"] is None else (auc["ci95"][1] - auc["ci95"][0]) / 2
      ax.errorbar(x["mean"], auc["mean"], yerr=err, fmt="o", capsize=3)
      ax.annotate(name, (x["mean"], auc["mean"]), fontsize=7, xytext=(4, 4),
                  textcoords="offset points")
      xs.append(x["mean"])
    if xs:
      ax.set_xscale("log", base=2)
      ax.xaxis.set_major_locator(FixedLocator(sorted(set(xs))))
      ax.xaxis.set_minor_locator(NullLocator())
      ax.set_xticklabels([report.fmt(x) for x in sorted(set(xs))], fontsize=7, rotation=30)
      ax.margins(x=0.15)
    if aucs:   # at least +-0.02 around the means: seed noise should not fill the panel
      middle = (max(aucs) + min(aucs)) / 2
      half = max((max(aucs) - min(aucs)) / 2 * 1.6, 0.02)
      lo, hi = ax.get_ylim()
      ax.set_ylim(min(lo, middle - half), max(hi, middle + half))
    ax.set_xlabel(units[x_metric] + " (log scale)", fontsize=8)
    ax.set_ylabel("auc_mean (mean ± 95% CI over seeds)", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
  report.save_figure(fig, os.path.join(workdir, "gqa_tradeoff.png"))
  return "gqa_tradeoff.png"


ABLATION = sweep.Ablation(
    name="gqa_ratio",
    doc=__doc__,
    arms={f"kv{k}": {"model.num_kv_heads": k} for k in (8, 4, 2, 1)},
    baseline="kv8",
    metrics=("auc_mean", "scoring_candidates_per_s", "kv_cache_bytes", "params/transformer",
             "params/total", "logloss", "diverged"),
    headline=("auc_mean", "scoring_candidates_per_s"),
    preset_overrides={"cpu": {"train.num_steps": 800, "train.eval_every": 400,
                              "train.checkpoint_every": 400}},
    task=task,
    probe=probe,
    joint_probe=joint_probe,
    plots=(plot_tradeoff,),
    better={"scoring_candidates_per_s": "higher", "kv_cache_bytes": "lower"},
)

if __name__ == "__main__":
  sweep.main(ABLATION)
