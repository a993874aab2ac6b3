"""Sandwich norm: normalising each block's input and output should keep deep stacks
trainable across learning rates.

Hypothesis: the release's sandwich layout (`h + N(block(N(h)))`) bounds what every block
adds to the residual stream, so the stream's RMS grows slowly with depth and training
tolerates larger learning rates; pre-norm lets the stream grow with depth, post-norm
(`N(h + block(h))`) is the classic unstable layout at depth and high learning rates, and
"rezero" (sandwich with the output norms starting at zero) starts every block as the
identity.

Task knobs: the depth and the peak learning rate are swept (conditions: depths 2, 4, 8 x
learning rates 1e-3 (the preset's default), 3e-3, 1e-2 at the full preset; depths 2 and 6
x 1e-2 (the default) and 3e-2 at the cpu preset, whose runs are short, 400 steps, to fit
its budget); a short warmup (5 percent of the steps) makes high learning rates bite early.

Variants: `sandwich` (baseline), `pre`, `post`, `rezero` (sandwich + param_init=rezero),
each at every depth x learning rate.

Metrics: final `auc_mean` and `logloss`, `diverged`, and the residual-stream RMS (over
non-padded tokens, at evaluation) after the last layer (`residual_rms/last`) and its ratio
to the first layer's (`residual_rms/growth`); `residual_rms.png` plots the RMS by layer.
"""

import os
import sys

import numpy as np

if not __package__:  # run by path, not with python -m: import this checkout's packages
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ablations import report, sweep
from phoenix_flax.training.runner import seed_dir

DEPTHS = {"smoke": (2,), "cpu": (2, 6), "full": (2, 4, 8)}
LEARNING_RATES = {"smoke": (3e-2,), "cpu": (1e-2, 3e-2), "full": (1e-3, 3e-3, 1e-2)}


def task(cfg, preset):
  cfg.optim.warmup_steps = max(cfg.train.num_steps // 20, 1)


def conditions(preset):
  return {"depth": {f"L{d}": {"model.num_layers": d} for d in DEPTHS[preset]},
          "lr": {f"lr{lr:g}": {"optim.learning_rate": lr} for lr in LEARNING_RATES[preset]}}


def layer_rms(found):
  """Per-layer residual RMS of one run, in layer order."""
  values, i = [], 0
  while found.get(f"residual_rms/layer_{i}") is not None:
    values.append(found[f"residual_rms/layer_{i}"])
    i += 1
  return values


def derived(found):
  rms = layer_rms(found)
  return {"residual_rms/last": rms[-1] if rms else None,
          "residual_rms/growth": rms[-1] / rms[0] if rms and rms[0] else None}


def plot_rms(results, workdir):
  """residual_rms.png: mean residual RMS by layer, one panel per condition."""
  cells = list(dict.fromkeys(v["cell"] for v in results["variants"].values()))
  fig, axes = report.figure(1, len(cells), (3.6 * len(cells), 3.0))
  for ax, cell in zip(axes.flat, cells):
    for name, v in results["variants"].items():
      if v["cell"] != cell:
        continue
      per_seed = []
      for seed in v["seeds"]:
        result = sweep.result_if_finished(seed_dir(os.path.join(workdir, name), seed))
        if result and not result["diverged"]:
          per_seed.append(layer_rms(result["final"]))
      if per_seed:
        ax.plot(np.mean(per_seed, axis=0), marker="o", label=v["arm"])
    ax.set_title(cell, fontsize=9)
    ax.set_xlabel("layer", fontsize=8)
    ax.set_ylabel("residual RMS (mean over seeds)", fontsize=8)
    ax.legend(fontsize=7)
  report.save_figure(fig, os.path.join(workdir, "residual_rms.png"))
  return "residual_rms.png"


ABLATION = sweep.Ablation(
    name="sandwich_norm",
    doc=__doc__,
    arms={"sandwich": {"model.norm_layout": "sandwich", "model.param_init": "variance_scaling"},
          "pre": {"model.norm_layout": "pre", "model.param_init": "variance_scaling"},
          "post": {"model.norm_layout": "post", "model.param_init": "variance_scaling"},
          "rezero": {"model.norm_layout": "sandwich", "model.param_init": "rezero"}},
    baseline="sandwich",
    metrics=("auc_mean", "diverged", "residual_rms/last", "residual_rms/growth", "logloss",
             "calibration_error"),
    headline=("auc_mean", "diverged", "residual_rms/growth"),
    preset_overrides={"cpu": {"train.num_steps": 400, "train.eval_every": 0,
                              "train.checkpoint_every": 400, "train.eval_batches": 2}},
    task=task,
    conditions=conditions,
    derived=derived,
    curves=("train/loss", "train/grad_norm"),
    plots=(plot_rms,),
)

if __name__ == "__main__":
  sweep.main(ABLATION)
