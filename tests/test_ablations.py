"""The sweep helper, statistics plumbing and report, driven by a fake runner (no
training), plus checks that every ablation script builds valid configs."""

import ast
import dataclasses
import glob
import json
import logging
import math
import os
import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

import ablations
from ablations import analysis, report, rope_anchoring, run_all, soft_capping, stats, sweep
from conftest import REPO, ForkServer, import_error
from phoenix_flax.training import ConfigError, provenance, run_dirs, writers
from phoenix_flax.training.schema import seed_config, split_config

SCRIPTS = ablations.modules()
EFFECT = {"a": 0.0, "b": 0.03, "c": -0.001}


def fake_runner(diverge=(), code=None, bayes=None):
  """A stand-in for run_experiment: writes result.json and metrics.jsonl per seed.

  AUC = 0.7 + EFFECT[arm] + a wobble that depends on arm and seed, and b's effect grows
  at the `hi` condition level (an interaction, varying by seed); `diverge` lists
  (variant, seed); `code(variant)`, if given, is the code version each result records;
  `bayes(variant, seed)`, if given, the Bayes AUC each reports (else 0.81 at `hi`, 0.8)."""
  calls = []

  def run(config, workdir):
    calls.append(workdir)
    variant = os.path.basename(workdir)
    arm = variant.split("_")[0]
    for seed, run_dir in run_dirs(config, workdir).items():
      os.makedirs(run_dir, exist_ok=True)
      auc = 0.7 + EFFECT[arm] + 0.002 * math.sin(3 * seed + ord(arm))
      auc += 0.004 + 0.001 * seed if variant == "b_hi" else 0.0
      diverged = (variant, seed) in diverge
      result = {"final": {"auc_mean": None if diverged else auc, "logloss": 0.3 - auc / 10,
                          "calibration_error": 0.01, "residual_rms/layer_0": 1.0,
                          "residual_rms/layer_1": 2.0,
                          "bayes_auc_mean": (bayes(variant, seed) if bayes else
                                             0.81 if variant.endswith("_hi") else 0.8)},
                "diverged": diverged, "diverged_at_step": 7 if diverged else None,
                "steps": 20, "wall_seconds": 1.0, "examples_per_second": 10.0}
      if code is not None:
        result["code"] = code(variant)
      writers.write_json(os.path.join(run_dir, "config.json"),
                         seed_config(config, seed).to_dict())   # as a run writes it first
      with open(os.path.join(run_dir, "result.json"), "w") as f:
        json.dump(result, f)
      with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step in (10, 20):
          f.write(json.dumps({"step": step, "train/loss": 1.0 / step,
                              "eval/auc_mean": auc - 0.1 / step}) + "\n")
  run.calls = calls
  return run


def toy_ablation(**kwargs):
  fields = dict(name="toy", doc="Toy hypothesis.\n\nMore text.",
                arms={"a": {"model.num_layers": 1}, "b": {"model.num_layers": 2},
                      "c": {"model.num_layers": 3}},
                baseline="a", metrics=("auc_mean", "logloss", "residual_rms/layer_1", "diverged"))
  fields.update(kwargs)
  return sweep.Ablation(**fields)


def fake_sweep(ablation, workdir):
  """A smoke sweep of `ablation` in `workdir` whose runs are `fake_runner`'s (run_all's
  `make_sweep`)."""
  return sweep.Sweep(ablation, "smoke", workdir, runner=fake_runner())


def lr_conditions(preset):
  return {"lr": {"lo": {"optim.learning_rate": 1e-3}, "hi": {"optim.learning_rate": 1e-2}}}


def test_variants_are_arms_times_conditions():
  ab = toy_ablation(conditions=lr_conditions)
  names = [v.name for v in ab.variants("smoke")]
  assert names == ["a_lo", "b_lo", "c_lo", "a_hi", "b_hi", "c_hi"]
  v = ab.variants("smoke")[4]
  assert (v.arm, v.cell) == ("b", "hi")
  assert v.overrides == {"optim.learning_rate": 1e-2, "model.num_layers": 2}
  picked = sweep.select(ab.variants("smoke"), ["b_hi"], "a")
  assert [p.name for p in picked] == ["a_hi", "b_hi"]
  assert [p.name for p in sweep.select(ab.variants("smoke"), ["c"], "a")] == \
      ["a_lo", "c_lo", "a_hi", "c_hi"]
  with pytest.raises(ValueError, match="unknown"):
    sweep.select(ab.variants("smoke"), ["zz"], "a")
  # Two variants of one name would share a run folder.
  clash = toy_ablation(arms={"b": {}, "b_x": {"model.num_layers": 2}}, baseline="b",
                       conditions=lambda preset: {"c": {"x_y": {}, "y": {}}})
  with pytest.raises(ValueError, match=r"names two variants \['b_x_y'\] at preset 'smoke'"):
    clash.variants("smoke")
  # An arm that sets what a condition sets keeps its own value in every cell.
  own = toy_ablation(conditions=lr_conditions,
                     arms={"a": {}, "b": {"optim.learning_rate": 3e-4}})
  for v in own.variants("smoke"):
    assert v.overrides == ({"optim.learning_rate": 3e-4} if v.arm == "b" else
                           lr_conditions("smoke")["lr"][v.cell]), v.name


def test_ablation_validation():
  with pytest.raises(ValueError, match="baseline"):
    toy_ablation(baseline="nope")
  with pytest.raises(ValueError, match="primary_metric"):
    toy_ablation(primary_metric="ndcg")
  assert toy_ablation().headline == ("auc_mean", "diverged")
  # "diverged" joins the default headline only as one of the ablation's metrics.
  assert toy_ablation(metrics=("auc_mean", "logloss")).headline == ("auc_mean",)


def test_overrides():
  assert sweep.parse_override("model.attn_logit_cap=None") == ("model.attn_logit_cap", None)
  assert sweep.parse_override("optim.learning_rate=1e-3") == ("optim.learning_rate", 1e-3)
  assert sweep.parse_override("model.norm_layout=pre") == ("model.norm_layout", "pre")
  for text, value in (("true", True), ("False", False), ("TRUE", True), ("True", True)):
    assert sweep.parse_override(f"model.right_anchored_rope={text}") == (
        "model.right_anchored_rope", value)            # as experiments.run reads them
  for text in ("num_layers", "=5", " =x"):   # no path: refused, not a field named ""
    with pytest.raises(ValueError, match="path.to.field=value"):
      sweep.parse_override(text)
  deep = "-" * 5000 + "1"   # too deep for ast.literal_eval: a string, refused by its field
  assert sweep.parse_override(f"model.num_layers={deep}") == ("model.num_layers", deep)
  base = sweep.preset_config("smoke")
  cfg = sweep.apply_overrides(base, {"model.num_layers": 3, "model.attn_logit_cap": None})
  assert cfg.model.num_layers == 3 and cfg.model.attn_logit_cap is None
  assert base.model.num_layers == 1 and base.model.attn_logit_cap == 30.0
  for text in ("none", "None", "NONE"):
    assert sweep.parse_override(f"model.attn_logit_cap={text}") == ("model.attn_logit_cap",
                                                                   None)
  with pytest.raises(ValueError, match=r"config.model has no field 'num_layerz' \(did you "
                                       r"mean 'num_layers'\?\); a new field .*base_config"):
    sweep.apply_overrides(base, {"model.num_layerz": 3})
  with pytest.raises(ValueError, match=r"config.model has no field 'zzz' \(fields: "
                                       r"\['attention_impl'.*'num_layers'.*base_config"):
    sweep.apply_overrides(base, {"model.zzz": 3})
  # The world's and the splits' defaults are their dataclasses' (no base_config entry).
  with pytest.raises(ValueError, match=r"config.world has no field 'position_bias' .*; a new "
                                       r"field needs its default in WorldConfig"):
    sweep.apply_overrides(base, {"world.position_bias": 0.5})
  with pytest.raises(ValueError, match=r"config.eval_split has no field 'zzz' .*in SplitConfig"):
    sweep.apply_overrides(base, {"eval_split.zzz": 1})
  with pytest.raises(ValueError, match=r"no field 'foo' .*; extra evaluation splits are "
                                       r"defined in the experiment config file"):
    sweep.apply_overrides(base, {"extra_eval_splits.foo.min_history": 1})
  with pytest.raises(ValueError, match=r"config.retrieval has no field 'top_k' \(a field of "
                                       r"that name is at: ranking.top_k\)"):
    sweep.apply_overrides(base, {"retrieval.top_k": (3,)})   # another section's field
  with pytest.raises(ValueError, match=r"model.micro_batch_rows=64 is invalid: "
                                       r"'micro_batch_rows' is a field of PhoenixModelConfig "
                                       r"that the experiment config does not expose"):
    sweep.apply_overrides(base, {"model.micro_batch_rows": 64})
  with pytest.raises(ValueError, match=r"config has no field 'modle' \(did you mean "
                                       r"'model'\?\)$"):   # a section typo: no switch hint
    sweep.apply_overrides(base, {"modle.num_layers": 3})
  with pytest.raises(ValueError, match=r"^config override train.num_steps=2.5 is invalid: "
                                       r"config.train.num_steps takes values of type int, "
                                       r"not float$"):
    sweep.apply_overrides(base, {"train.num_steps": 2.5})


def test_a_task_that_sets_a_wrong_type_names_the_ablation(tmp_path):
  """ml_collections refuses the value with a TypeError about Python classes; the sweep
  turns it into a ValueError naming the ablation's task (exit 2 with an error line)."""
  from ablations import rope_anchoring

  def task(cfg, preset):
    rope_anchoring.ABLATION.task(cfg, preset)
    cfg.model.norm_layout = 1

  bad = dataclasses.replace(rope_anchoring.ABLATION, task=task)
  with pytest.raises(ValueError, match="rope_anchoring's task\\(\\) sets a value of the wrong "
                                       "type"):
    sweep.Sweep(bad, "smoke", str(tmp_path / "r"))
  assert not (tmp_path / "r").exists()


def test_a_task_derives_its_knobs_from_the_overridden_config(tmp_path):
  """A task sees the user's overrides (its knobs follow the sizes they set), and an
  override of a knob the task sets wins over it."""
  from ablations import candidate_isolation, rope_anchoring, sandwich_norm, soft_capping

  def build(ablation, folder, overrides):
    # A runner of the test's own: the sweep traces no run to check the metric names
    # (test_scripts_state_their_design_and_build_valid_configs checks the scripts').
    return sweep.Sweep(ablation, "smoke", str(tmp_path / folder), overrides=overrides,
                       runner=fake_runner())

  sw = build(rope_anchoring.ABLATION, "r", {"world.history_len": 4})
  assert sw.base.train_split.max_history == 3 and sw.base.eval_split.max_history == 3
  for split in (sw.base.train_split, sw.base.eval_split):   # log-uniform in [1, 3S/4]
    assert (split.history_dist, split.min_history) == ("log_uniform", 1)
  long = sw.base.extra_eval_splits.long_history
  assert (long.min_history, long.max_history) == (4, 4)
  sw = build(rope_anchoring.ABLATION, "r2",
             {"world.history_len": 64, "train_split.max_history": 10})
  assert sw.base.train_split.max_history == 10 and sw.base.eval_split.max_history == 48
  assert sw.base.extra_eval_splits.long_history.max_history == 64
  sw = build(candidate_isolation.ABLATION, "c",
             {"world.num_candidates": 12, "ranking.top_k": (2,)})
  assert sw.base.extra_eval_splits.long_list.num_candidates == 24
  for ablation in (soft_capping.ABLATION, sandwich_norm.ABLATION):   # 5% of the steps
    sw = build(ablation, ablation.name, {"train.num_steps": 1000})
    assert sw.base.optim.warmup_steps == 50, ablation.name
  # A serving shift is the evaluation split, overrides and all, changed in one way only.
  sw = build(candidate_isolation.ABLATION, "c2",
             {"eval_split.num_candidates": 6, "eval_split.min_candidates": 2,
              "eval_split.min_history": 2})
  shifts = sw.base.extra_eval_splits
  eval_split = sw.base.eval_split.to_dict()
  for name, changed in (("long_list", {"num_candidates": 12}),
                        ("by_relevance", {"candidate_order": "relevance"}),
                        ("random_companions", {"relevant_fraction": 0.1,
                                               "list_correlation": 0.0})):
    assert shifts[name].to_dict() == {**eval_split, **changed}, name
  sw = build(rope_anchoring.ABLATION, "r3", {"eval_split.relevant_fraction": 0.2})
  long = sw.base.extra_eval_splits.long_history
  assert (long.relevant_fraction, long.history_dist, long.min_history) == (0.2, "uniform", 7)


def test_interactions_average_over_the_other_axes():
  """Two axes: an interaction along one averages the difference of differences over the
  other axis's levels where all four variants ran; a missing value drops its seed."""
  conditions = {"depth": ["d2", "d6"], "lr": ["l1", "l3"]}
  rng = np.random.default_rng(0)
  values = {(arm, d, l): rng.normal(size=4).tolist()
            for arm in ("base", "x") for d in conditions["depth"] for l in conditions["lr"]}
  values[("x", "d6", "l3")][2] = None   # a diverged run

  def variants(keep):
    return {f"{arm}_{d}_{l}": {"arm": arm, "cell": f"{d}_{l}",
                               "metrics": {"m": {"per_seed": v}, "diverged": {}}}
            for (arm, d, l), v in values.items() if (arm, d, l) in keep}

  def did(d, l, d0, l0, seed):   # (x - base) at (d, l) minus at (d0, l0)
    return (values[("x", d, l)][seed] - values[("base", d, l)][seed]
            - values[("x", d0, l0)][seed] + values[("base", d0, l0)][seed])

  rows = {(r["axis"], r["level"]): r for r in analysis.interactions(
      variants(set(values)), conditions, "base", ["m", "diverged"])}
  assert set(rows) == {("depth", "d6"), ("lr", "l3")}
  depth = rows[("depth", "d6")]
  expected = [(did("d6", "l1", "d2", "l1", s) + did("d6", "l3", "d2", "l3", s)) / 2
              for s in (0, 1, 3)]
  assert depth["n"] == 3 and depth["cells"] == 2 and depth["reference"] == "d2"
  assert depth["delta"] == pytest.approx(np.mean(expected))
  assert depth["p_value"] == pytest.approx(stats.paired_t([0.0] * 3, expected)["p_value"])
  assert [r["p_holm"] for r in rows.values()] == stats.holm(
      [r["p_value"] for r in rows.values()])
  # Without x at (d6, l3), e.g. a --variants subset: each axis keeps the one pair it has.
  rows = {(r["axis"], r["level"]): r for r in analysis.interactions(
      variants(set(values) - {("x", "d6", "l3")}), conditions, "base", ["m"])}
  assert rows[("depth", "d6")]["cells"] == 1 and rows[("depth", "d6")]["n"] == 4
  # A baseline without the metric at a level (a probe it did not run) drops that level's
  # pairs, as a missing variant does.
  m = lambda xs: {"m": stats.summarize(xs)}
  one_axis = {"base_lo": {"arm": "base", "cell": "lo", "metrics": m([0.1, 0.2, 0.3])},
              "base_hi": {"arm": "base", "cell": "hi", "metrics": {}},
              "b_lo": {"arm": "b", "cell": "lo", "metrics": m([0.2, 0.3, 0.5])},
              "b_hi": {"arm": "b", "cell": "hi", "metrics": m([0.4, 0.1, 0.6])}}
  assert analysis.interactions(one_axis, {"c": ["lo", "hi"]}, "base", ["m"]) == []
  assert rows[("depth", "d6")]["delta"] == pytest.approx(
      np.mean([did("d6", "l1", "d2", "l1", s) for s in range(4)]))
  # One level per axis (or no conditions): nothing to compare.
  assert analysis.interactions(variants(set(values)), {"depth": ["d2"]}, "base", ["m"]) == []
  assert analysis.interactions({"base": {"arm": "base", "cell": "", "metrics": {}}}, {},
                            "base", ["m"]) == []


def test_an_interaction_of_identical_differences_is_not_exact():
  """Each seed's difference is the same at each level while the seeds' values vary (a
  coarse metric, or float32 rounding of values near 0.7): the difference of differences is
  not a deterministic quantity with p = 0, nor a t-test of rounding noise, but the exact
  sign-flip p of identical differences, as each level's own comparison reads."""
  seeds = np.array([0.61, 0.67, 0.72, 0.78])
  for lo, hi in ((1 / 24, 1 / 16), (0.004, 0.007)):
    values = {("base", "lo"): seeds, ("x", "lo"): seeds + lo,
              ("base", "hi"): seeds + 0.01, ("x", "hi"): seeds + 0.01 + hi}
    variants = {f"{arm}_{cell}": {"arm": arm, "cell": cell, "metrics": {
        "m": {"per_seed": np.asarray(v, np.float32).astype(float).tolist()}}}
        for (arm, cell), v in values.items()}
    [row] = analysis.interactions(variants, {"c": ["lo", "hi"]}, "base", ["m"])
    assert row["delta"] == pytest.approx(hi - lo, abs=1e-6)
    assert row["p_value"] == 2.0 ** (1 - len(seeds)), row
    assert row["test"] == "sign-flip permutation (identical differences)"
    assert row["ci95"] is None
  # A baseline arm that gives the same value in every seed does not make the rest exact.
  values = {("base", "lo"): [0.5] * 3, ("x", "lo"): seeds[:3].tolist(),
            ("base", "hi"): [0.5] * 3, ("x", "hi"): (seeds[:3] + 0.01).tolist()}
  [row] = analysis.interactions(_variants(values), {"c": ["lo", "hi"]}, "base", ["m"])
  assert (row["ci95"], row["p_value"]) == (None, 0.25), row
  assert row["test"] == "sign-flip permutation (identical differences)"
  # A deterministic metric (the same value in every seed, each variant) stays exact.
  variants = {f"{arm}_{cell}": {"arm": arm, "cell": cell, "metrics": {"m": {"per_seed": [v] * 3}}}
              for (arm, cell), v in {("base", "lo"): 10.0, ("x", "lo"): 12.0,
                                     ("base", "hi"): 10.0, ("x", "hi"): 15.0}.items()}
  [row] = analysis.interactions(variants, {"c": ["lo", "hi"]}, "base", ["m"])
  assert (row["delta"], row["ci95"], row["p_value"]) == (3.0, [3.0, 3.0], 0.0)


def _variants(values):
  return {f"{arm}_{cell}": {"arm": arm, "cell": cell, "metrics": {"m": {"per_seed": v}}}
          for (arm, cell), v in values.items()}


def test_an_interaction_is_exact_only_if_every_averaged_cell_is():
  """Two cells averaged per level: the first pair is deterministic, the second varies by
  seed with identical differences; the average is not exact (CI [3, 3], p 0) but the
  sign-flip p of identical differences."""
  s = [0.61, 0.67, 0.72]
  v = {("base", "d2_l1"): [10.0] * 3, ("x", "d2_l1"): [12.0] * 3,
       ("base", "d6_l1"): [10.0] * 3, ("x", "d6_l1"): [15.0] * 3,
       ("base", "d2_l3"): s, ("x", "d2_l3"): [x + 2.0 for x in s],
       ("base", "d6_l3"): s, ("x", "d6_l3"): [x + 5.0 for x in s]}
  rows = analysis.interactions(_variants(v), {"depth": ["d2", "d6"], "lr": ["l1", "l3"]},
                               "base", ["m"])
  [r] = [r for r in rows if r["axis"] == "depth"]
  assert r["cells"] == 2 and r["delta"] == pytest.approx(3.0)
  assert (r["ci95"], r["p_value"]) == (None, 0.25)
  assert r["test"] == "sign-flip permutation (identical differences)"


def test_a_variant_diverged_in_every_seed_has_an_empty_comparison():
  v = {"a": {"arm": "a", "cell": "", "metrics": {"auc": {"per_seed": [0.7, 0.71, 0.72]}}},
       "b": {"arm": "b", "cell": "", "metrics": {"auc": {"per_seed": [None] * 3}}}}
  [row] = analysis.compare(v, {}, "a", ["auc"])["comparisons"]
  assert (row["n"], row["delta"], row["p_value"], row["p_holm"]) == (0, None, None, None)


def test_pooled_and_interaction_rows_at_their_edges():
  """A baseline seed that diverged at one level leaves the interaction; an arm that is
  the same in every seed does not make an interaction exact; a pooled row compares an arm
  with the baseline at the levels the arm ran, and an arm with no baseline level beside
  it has no pooled row."""
  v = {("base", "lo"): [0.70, 0.71, 0.69, 0.72], ("x", "lo"): [0.72, 0.73, 0.70, 0.75],
       ("base", "hi"): [0.70, None, 0.69, 0.71], ("x", "hi"): [0.75, 0.74, 0.73, 0.77]}
  [row] = analysis.interactions(_variants(v), {"c": ["lo", "hi"]}, "base", ["m"])
  assert row["n"] == 3 and row["delta"] == pytest.approx(0.03)
  seeds = [0.61, 0.67, 0.72]
  v = {("base", "lo"): seeds, ("x", "lo"): [0.5] * 3,
       ("base", "hi"): [s + 0.01 for s in seeds], ("x", "hi"): [0.6] * 3}
  [row] = analysis.interactions(_variants(v), {"c": ["lo", "hi"]}, "base", ["m"])
  assert (row["ci95"], row["p_value"]) == (None, 0.25), row
  assert row["test"] == "sign-flip permutation (identical differences)"
  # x ran at `hi` alone (a --variants subset), where the baseline is 0.1 above `lo`.
  v = {("a", "lo"): [0.60, 0.61, 0.59, 0.62], ("a", "hi"): [0.70, 0.71, 0.69, 0.72],
       ("x", "hi"): [0.72, 0.72, 0.71, 0.75]}
  [row] = analysis.compare(_variants(v), {"c": ["lo", "hi"]}, "a", ["m"])["pooled_comparisons"]
  assert row["conditions"] == 1 and row["delta"] == pytest.approx(0.02)
  v = {("base", "lo"): [0.70, 0.71, 0.69], ("base", "hi"): [0.70, 0.72, 0.69],
       ("x", "lo"): [0.72, 0.73, 0.70], ("x", "hi"): [0.75, 0.74, 0.73],
       ("y", "mid"): [0.8, 0.8, 0.81]}
  pooled = analysis.compare(_variants(v), {"c": ["lo", "mid", "hi"]}, "base",
                            ["m"])["pooled_comparisons"]
  assert [r["variant"] for r in pooled] == ["x"]


COMMITTED = sorted(glob.glob(os.path.join(REPO, "docs", "results", "*", "results.json")))


def _results_wanted(names) -> str:
  return (f"docs/results has no committed results of {names}: run `python -m "
          f"ablations.<name> --preset=cpu --workdir=DIR` and copy DIR's results.json, "
          "REPORT.md and *.png to docs/results/<name>/ (README, 'Adding an idea', step 4)")


def test_every_ablation_has_committed_results():
  """The test below runs once per file found: none found must fail, not skip; a script
  without results is named, with what to run."""
  names = {m.__name__.rsplit(".", 1)[-1] for m in ablations.modules()}
  found = {os.path.basename(os.path.dirname(p)) for p in COMMITTED}
  assert names <= found, _results_wanted(sorted(names - found))
  assert found <= names, f"docs/results holds results of no ablation script: {found - names}"


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: os.path.basename(os.path.dirname(p)))
def test_the_committed_results_are_what_the_analysis_computes(path):
  """docs/results/<ablation>/results.json: its tests against the baseline follow from its
  per-seed values by `analysis.compare` (the README quotes them)."""
  with open(path) as f:
    results = json.load(f)
  got = analysis.compare(results["variants"], results["conditions"], results["baseline"],
                         results["metrics"])
  assert json.loads(json.dumps(got)) == {k: results[k] for k in got}


@pytest.mark.parametrize("module", ablations.modules(), ids=lambda m: m.__name__)
def test_each_script_builds_the_design_of_its_committed_results(module, tmp_path):
  """The committed results are what the script runs today: at their preset, the same
  variants with the same overrides (grids, dtypes, task knobs), the same baseline,
  metrics and directions of improvement, so a grid changed in a script cannot pass for
  the documented design."""
  name = module.__name__.rsplit(".", 1)[-1]
  path = os.path.join(REPO, "docs", "results", name, "results.json")
  if not os.path.exists(path):
    pytest.fail(_results_wanted([name]))
  with open(path) as f:
    committed = json.load(f)
  # The documented results are the cpu preset's sweep, with its seeds (a smoke sweep's
  # report calls itself no evidence).
  assert (committed["preset"], committed["seeds"]) == ("cpu", list(range(sweep.SEEDS["cpu"]))), (
      f"{path} is a sweep at preset {committed['preset']!r} with seeds {committed['seeds']}: "
      f"commit the cpu preset's, {_results_wanted([name]).split(': ', 1)[1]}")
  ab = module.ABLATION
  built = {v.name: {"arm": v.arm, "cell": v.cell, "overrides": v.overrides}
           for v in ab.variants(committed["preset"])}
  stored = {k: {"arm": v["arm"], "cell": v["cell"], "overrides": v["overrides"]}
            for k, v in committed["variants"].items()}
  assert json.loads(json.dumps(built)) == stored
  assert ab.baseline == committed["baseline"]
  assert ab.primary_metric == committed["primary_metric"]
  assert list(ab.metrics) == committed["metrics"]
  assert list(ab.headline) == committed["headline"]
  assert {m: sweep.better(m, ab.better) for m in ab.metrics} == committed["better"]
  # The preset's training length and evaluation set, as the script builds them today.
  built = sweep.Sweep(ab, committed["preset"], str(tmp_path / name), runner=fake_runner())
  assert built.training() == committed["training"]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: os.path.basename(os.path.dirname(p)))
def test_the_committed_reports_are_what_their_results_render(path):
  """Each docs/results/<ablation>/REPORT.md is `report.markdown` of its results.json, with
  the plots it lists: every number, column and verdict in the tables the README quotes
  comes from the results, in the place the header says."""
  from ablations import rerender
  folder = os.path.dirname(path)
  with open(path) as f:
    results = json.load(f)
  with open(os.path.join(folder, "REPORT.md"), encoding="utf-8") as f:
    committed = f.read()
  plots = rerender._listed_plots(os.path.join(folder, "REPORT.md"), folder)
  assert report.markdown(results, plots) == committed


def test_the_committed_combined_report_is_what_the_sweeps_render():
  folder = os.path.join(REPO, "docs", "results")
  with open(os.path.join(folder, "results.json")) as f:
    entries = list(json.load(f).items())
  with open(os.path.join(folder, "REPORT.md"), encoding="utf-8") as f:
    committed = f.read()
  command = re.search(r"^Command:\n\n    (.*)$", committed, re.M).group(1)
  (preset,) = {results["preset"] for _, results in entries}
  assert report.combined_markdown(entries, folder, preset, command) == committed


def test_rerender_recomputes_statistics_and_reports_from_results_alone(tmp_path,
                                                                     monkeypatch):
  """`python -m ablations.rerender` on a copy of docs/results (results.json, REPORT.md and
  plots only): each sweep's statistics are computed again from its per-seed values, its
  report is rewritten with the plots it listed, and so is the combined report."""
  import shutil
  from ablations import rerender
  folder = tmp_path / "results"
  shutil.copytree(os.path.join(REPO, "docs", "results"), folder)
  one = folder / "candidate_isolation" / "results.json"
  stale = json.loads(one.read_text())
  del stale["interactions"]                      # as written before they existed
  stale["comparisons"][0]["p_value"] = 0.5       # as an older statistic gave it
  first = next(iter(stale["variants"]))
  summary = stale["variants"][first]["metrics"]["auc_mean"]
  right_mean, summary["mean"] = summary["mean"], 0.0
  one.write_text(json.dumps(stale))
  os.remove(folder / "gqa_ratio" / "gqa_tradeoff.png")   # a plot lost since: not linked
  drawn = {}
  real_plot = report.plot_effects

  def plot_effects(results, metrics, path):
    drawn[results["ablation"]] = list(metrics)
    return real_plot(results, metrics, path)
  monkeypatch.setattr(report, "plot_effects", plot_effects)
  # Partial files of a killed earlier writer, in the top folder and in a sweep's: cleared.
  left = [folder / ".REPORT.md.tmp.999999", folder / "gqa_ratio" / ".results.json.tmp.999999"]
  for path in left:
    path.write_text("partial")
  ran = re.search(r"^Command:\n\n    (.*)$", (folder / "REPORT.md").read_text(), re.M)
  rerender.rerender(str(folder), "python -m ablations.rerender x")
  assert not [path for path in left if path.exists()]
  # The combined report keeps the command that ran the sweeps (rerender's is `rendered`).
  assert ran and f"Command:\n\n    {ran.group(1)}\n" in (folder / "REPORT.md").read_text()
  fresh = json.loads(one.read_text())
  listed = json.loads((folder / "results.json").read_text())   # the sweeps run_all ran
  assert set(drawn) == set(listed)
  for name in listed:   # each sweep's effects panels: its headline metrics
    assert drawn[name] == listed[name]["headline"], name
  gqa = (folder / "gqa_ratio" / "REPORT.md").read_text()
  assert "![effects](effects.png)" in gqa and "](gqa_tradeoff.png)" not in gqa
  want = analysis.compare(stale["variants"], stale["conditions"], stale["baseline"],
                          stale["metrics"])
  assert {k: fresh[k] for k in want} == json.loads(json.dumps(want))
  assert fresh["variants"][first]["metrics"]["auc_mean"]["mean"] == right_mean
  assert fresh["rendered"]["command"] == "python -m ablations.rerender x"
  assert fresh["environment"] == stale["environment"]   # still the sweep's process
  text = (folder / "candidate_isolation" / "REPORT.md").read_text()
  assert "| ΔΔ `score_consistency` | corr0.5 − corr0 |" in text
  assert "computed again from results.json by code " in text
  assert "![curves](curves.png)" in text and "![effects](effects.png)" in text
  assert text.count("](effects.png)") == 1   # listed before, and drawn again: once
  combined = json.loads((folder / "results.json").read_text())
  assert combined["candidate_isolation"] == fresh
  assert "computed again from results.json" in (folder / "REPORT.md").read_text()
  cli = subprocess.run([sys.executable, "-m", "ablations.rerender", str(tmp_path / "none")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
  assert cli.returncode == 2 and "holds no results.json: not a finished sweep" in cli.stderr
  assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr   # no docstring, no traceback
  # A sweep's flag would change nothing here (--dry_run rewrote the report all the same),
  # and a flag it does not know is a usage error too, before any folder is rewritten.
  before = (folder / "REPORT.md").read_text()
  for args, message in [(["--dry_run", "--seeds=9"], "--seeds, --dry_run: flags of an "),
                        (["--bogus"], "Unknown command line flag 'bogus'")]:
    cli = subprocess.run([sys.executable, "-m", "ablations.rerender", *args, str(folder)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and message in cli.stderr, cli.stderr
    assert "Traceback" not in cli.stderr and "FATAL" not in cli.stderr, cli.stderr
  assert (folder / "REPORT.md").read_text() == before


def _sweep_json(per_seed=(0.5, None), metrics=("m",), seeds=(0, 1), **extra) -> str:
  """A sweep's results.json, well formed but for what the arguments change."""
  found = {"ablation": "x", "preset": "cpu", "baseline": "a", "primary_metric": "m",
           "metrics": list(metrics), "seeds": None if seeds is None else list(seeds),
           "variants": {"a": {"arm": "a", "cell": "", "metrics": {"m": {"per_seed":
                                                                         list(per_seed)}}}}}
  return json.dumps({**found, **extra})


@pytest.mark.parametrize("text, message", [
    ('{"ablation": "x", "variants": {', "cannot be read (JSONDecodeError"),
    ("[1]", "holds a list, not a sweep's results"),
    ('{"ablation": "x"}', "no sweep's results (no 'variants')"),
    ('{"ablation": "x", "variants": {"a": {"metrics": {}}}}', "no 'metrics' list"),
    ('{"ablation": "x", "variants": {"a": {"metrics": {}}}, "metrics": ["m"]}',
     "names no 'preset'"),
    ('{"ablation": "x", "variants": {"a": {"metrics": {}}}, "metrics": ["m"], '
     '"preset": "cpu"}', "its 'baseline' None is none of its arms ['a']"),
    ('{"ablation": "x", "variants": {"a": {"metrics": {}}}, "metrics": ["m"], '
     '"preset": "cpu", "baseline": "a"}', "variant 'a' names no 'arm' and 'cell'"),
    ('{"ablation": "x", "variants": {"a": {"arm": "a", "cell": "", "metrics": {"m": {}}}}, '
     '"metrics": ["m"], "preset": "cpu", "baseline": "a"}', "variant 'a' has no per-seed values"),
    ('{"ablation": "x", "variants": {"a": {"arm": "a", "cell": "", '
     '"metrics": {"m": {"per_seed": []}}}}, "metrics": ["m"], "preset": "cpu", '
     '"baseline": "a"}', "its 'primary_metric' None is none of its metrics"),
    ('{"one": {}}', "one holds no results.json"),   # a run_all folder: each sweep checked
    (_sweep_json(seeds=None), "names no 'seeds' list"),
    (_sweep_json(per_seed=[], seeds=[]), "names no 'seeds' list"),
    ('{"ablation": "x", "variants": {"a": {"arm": "a", "metrics": {}}}, "metrics": ["m"], '
     '"preset": "cpu", "baseline": "a"}', "variant 'a' names no 'arm' and 'cell'"),
    (_sweep_json(conditions={"lr": ["lo"]}), "has 'conditions' but no 'arms' list"),
    (_sweep_json(metrics=["m", "n"]), "variant 'a' has no per-seed values of 'n'"),
    (_sweep_json(per_seed=[0.5]), "variant 'a' has 1 per-seed values of 'm' for its 2 seeds"),
    (_sweep_json(per_seed=[0.5, 0.6, 0.7]),
     "variant 'a' has 3 per-seed values of 'm' for its 2 seeds"),
    (_sweep_json(variants={}, arms=["a"]), "no sweep's results (no 'variants')"),
    ("{}", "results.json lists no sweeps"),
    (_sweep_json(per_seed=[0.5, "0.6"]), "neither a number nor null: '0.6'"),
    (_sweep_json(per_seed=[0.5, True]), "neither a number nor null: True"),
])
def test_rerender_checks_every_folder_before_rewriting_any(tmp_path, text, message):
  """A results.json that rendering cannot read is refused by name, before any file of any
  folder named is rewritten (a run_all folder's sweeps included)."""
  import shutil
  from ablations import rerender
  good = tmp_path / "good"
  shutil.copytree(os.path.join(REPO, "docs", "results", "gqa_ratio"), good)
  before = {p.name: p.read_bytes() for p in good.iterdir()}
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "results.json").write_text(text)
  with pytest.raises(rerender.RerenderError, match=re.escape(message)):
    rerender.check(str(bad))
  with pytest.raises(SystemExit) as stop:
    rerender.main(["rerender", str(good), str(bad)])
  assert stop.value.code == 2
  assert {p.name: p.read_bytes() for p in good.iterdir()} == before


def test_rerender_without_a_folder_is_a_usage_error(capsys):
  from ablations import rerender
  with pytest.raises(SystemExit) as stop:
    rerender.main(["rerender"])
  assert stop.value.code == 2
  assert "name one or more sweep folders" in capsys.readouterr().err


def test_rerender_refuses_a_field_it_cannot_render_before_writing(tmp_path, capsys):
  """A field of another type than a sweep writes (a variant's `cell` a number), which the
  checks let through, stops rerender with one line naming the file (a traceback, after
  effects.png and results.json were rewritten and REPORT.md was not), writing nothing."""
  import shutil
  from ablations import rerender
  folder = tmp_path / "gqa_ratio"
  shutil.copytree(os.path.join(REPO, "docs", "results", "gqa_ratio"), folder)
  results = json.loads((folder / "results.json").read_text())
  next(iter(results["variants"].values()))["cell"] = 5
  (folder / "results.json").write_text(json.dumps(results))
  before = {p.name: p.read_bytes() for p in folder.iterdir()}
  with pytest.raises(SystemExit) as stop:
    rerender.main(["rerender", str(folder)])
  assert stop.value.code == 2
  assert capsys.readouterr().err.startswith(f"error: {folder}/results.json cannot be rendered "
                                            "(TypeError")
  assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
  # Another error of rendering (AttributeError: a string where a sweep writes an object).
  results = json.loads((folder / "results.json").read_text())
  next(iter(results["variants"].values()))["cell"] = ""
  results["environment"] = "cpu box"
  (folder / "results.json").write_text(json.dumps(results))
  before = {p.name: p.read_bytes() for p in folder.iterdir()}
  with pytest.raises(SystemExit) as stop:
    rerender.main(["rerender", str(folder)])
  assert stop.value.code == 2
  assert "cannot be rendered (AttributeError" in capsys.readouterr().err
  assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_rerender_computes_every_sweep_before_writing_any(tmp_path, monkeypatch):
  """Where a statistic fails after the checks pass, in a `run_all` folder's third sweep or
  in the second of two folders named, no file of any folder has been rewritten."""
  import shutil
  from ablations import rerender
  from ablations import analysis as analysis_module
  assert rerender.check(str(_write(tmp_path / "ok", _sweep_json()))) is None
  folder, single = tmp_path / "results", tmp_path / "single"
  shutil.copytree(os.path.join(REPO, "docs", "results"), folder)
  shutil.copytree(os.path.join(REPO, "docs", "results", "gqa_ratio"), single)
  files = lambda: {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  before = files()
  compare, calls = analysis_module.compare, []

  def failing_compare(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
      raise RuntimeError("planted failure")
    return compare(*args, **kwargs)
  monkeypatch.setattr(analysis_module, "compare", failing_compare)
  with pytest.raises(RuntimeError, match="planted failure"):
    rerender.rerender(str(folder), "x")
  assert calls == [1, 1, 1] and files() == before
  calls.clear()
  calls.append(1)   # counted in advance: the third call is the second folder's first sweep
  with pytest.raises(RuntimeError, match="planted failure"):
    rerender.main(["rerender", str(single), str(folder)])
  assert files() == before


def _write(folder, text: str):
  folder.mkdir()
  (folder / "results.json").write_text(text)
  return folder


def test_rerender_drops_an_effects_plot_it_cannot_draw_again(tmp_path):
  """A sweep whose results no longer hold a comparison (its baseline alone, as a
  `--variants` run of the baseline into its folder leaves them): its effects.png is
  removed, and neither its REPORT.md nor the combined report links it any more."""
  import shutil
  from ablations import rerender
  top = tmp_path / "results"
  shutil.copytree(os.path.join(REPO, "docs", "results"), top)
  one = top / "gqa_ratio"
  results = json.loads((one / "results.json").read_text())
  results["variants"] = {name: v for name, v in results["variants"].items()
                         if name == results["baseline"]}
  (one / "results.json").write_text(json.dumps(results))
  combined = json.loads((top / "results.json").read_text())
  combined["gqa_ratio"] = results
  (top / "results.json").write_text(json.dumps(combined))
  assert "effects.png" in rerender._listed_plots(str(one / "REPORT.md"), str(one))
  assert "](gqa_ratio/effects.png)" in (top / "REPORT.md").read_text()
  rerender.rerender(str(top), "x")
  assert not (one / "effects.png").exists()
  assert "effects.png" not in (one / "REPORT.md").read_text()
  assert "](gqa_ratio/effects.png)" not in (top / "REPORT.md").read_text()
  assert "](soft_capping/effects.png)" in (top / "REPORT.md").read_text()


def test_rerender_refuses_a_run_all_folder_whose_sweeps_ran_at_several_presets(tmp_path):
  """Its combined report names one preset (with that preset's note)."""
  from ablations import rerender
  top = tmp_path / "top"
  top.mkdir()
  (top / "results.json").write_text(json.dumps({"a": {}, "b": {}}))
  _write(top / "a", _sweep_json())
  _write(top / "b", _sweep_json(preset="smoke"))
  with pytest.raises(rerender.RerenderError,
                     match=re.escape("its sweeps ran at several presets ['cpu', 'smoke']")):
    rerender.check(str(top))
  (top / "b" / "results.json").write_text(_sweep_json())
  rerender.check(str(top))


def test_sweep_results_stats_and_report(tmp_path):
  runner = fake_runner(diverge={("c_hi", 1)})
  ab = toy_ablation(conditions=lr_conditions)
  sw = sweep.Sweep(ab, "smoke", str(tmp_path), seeds=4, runner=runner,
                   overrides={"train.num_steps": 20, "train.eval_batches": 2},
                   command="python -m toy")
  results = sw.run()
  assert len(runner.calls) == 6
  on_disk = json.loads((tmp_path / "results.json").read_text())
  assert on_disk == json.loads(json.dumps(results))
  assert {"ablation", "preset", "baseline", "primary_metric", "variants", "comparisons"} \
      <= set(on_disk)
  assert on_disk["conditions"] == {"lr": ["lo", "hi"]}
  b = on_disk["variants"]["b_lo"]
  assert b["overrides"] == {"optim.learning_rate": 1e-3, "model.num_layers": 2}
  assert b["seeds"] == [0, 1, 2, 3] and b["diverged"] == 0
  auc = b["metrics"]["auc_mean"]
  assert set(auc) >= {"mean", "std", "ci95", "per_seed"}
  assert auc["ci95"][0] < auc["mean"] < auc["ci95"][1]
  assert b["metrics"]["residual_rms/layer_1"]["mean"] == 2.0

  assert b["bayes"] == {"auc_mean": 0.8}   # logloss and the RMS have no Bayes value here
  c = on_disk["variants"]["c_hi"]
  assert c["bayes"] == {"auc_mean": 0.81}
  assert c["diverged"] == 1 and c["diverged_at_step"] == [None, 7, None, None]
  assert c["metrics"]["auc_mean"]["per_seed"][1] is None
  assert c["metrics"]["auc_mean"]["n"] == 3
  # The diverged run wrote a finite logloss; a diverged run's metrics never count.
  assert c["metrics"]["logloss"]["per_seed"][1] is None
  assert c["metrics"]["logloss"]["n"] == 3
  assert c["metrics"]["diverged"]["per_seed"] == [0.0, 1.0, 0.0, 0.0]

  comps = {(r["variant"], r["metric"]): r for r in on_disk["comparisons"]}
  up = comps[("b_lo", "auc_mean")]
  assert up["baseline"] == "a_lo" and up["delta"] == pytest.approx(0.03, abs=0.004)
  assert up["p_value"] < 1e-3 and up["n"] == 4
  assert comps[("c_hi", "auc_mean")]["n"] == 3
  assert comps[("c_hi", "diverged")]["test"] == "exact McNemar"
  assert comps[("c_hi", "diverged")]["p_value"] == 1.0
  # Pooled: per seed, the mean over the two conditions, then paired by seed (the seeds are
  # shared across conditions); c loses seed 1, whose c_hi run diverged.
  pooled = {(r["variant"], r["metric"]): r for r in on_disk["pooled_comparisons"]}
  values = lambda name: on_disk["variants"][name]["metrics"]["auc_mean"]["per_seed"]
  for arm, seeds in (("b", [0, 1, 2, 3]), ("c", [0, 2, 3])):
    row = pooled[(arm, "auc_mean")]
    d = np.array([(values(f"{arm}_lo")[s] + values(f"{arm}_hi")[s]
                   - values("a_lo")[s] - values("a_hi")[s]) / 2 for s in seeds])
    t = d.mean() / (d.std(ddof=1) / math.sqrt(d.size))
    assert row["n"] == len(seeds) and row["conditions"] == 2
    assert row["delta"] == pytest.approx(d.mean())
    assert row["p_value"] == pytest.approx(2 * stats.t_cdf(-abs(t), d.size - 1))
    assert row["test"] == "paired t of seed means"
  # An arm run at one condition only (`--variants=c_hi`) pools that one: "the mean over 1".
  subset = {k: v for k, v in on_disk["variants"].items() if k != "c_lo"}
  row = next(r for r in analysis.compare(subset, on_disk["conditions"], "a",
                                         ["auc_mean"])["pooled_comparisons"]
             if r["variant"] == "c")
  d = np.array([values("c_hi")[s] - values("a_hi")[s] for s in (0, 2, 3)])
  assert row["conditions"] == 1 and row["delta"] == pytest.approx(d.mean())
  # Holm families: one per metric among the per-condition rows, one among the pooled rows.
  for rows in (on_disk["comparisons"], on_disk["pooled_comparisons"]):
    for metric in {r["metric"] for r in rows}:
      family = [r for r in rows if r["metric"] == metric]
      assert [r["p_holm"] for r in family] == stats.holm([r["p_value"] for r in family])
    assert any(r["p_holm"] > r["p_value"] for r in rows)   # the adjustment does something
  # Interactions: per seed, the arm's difference at `hi` minus its difference at `lo`;
  # c loses seed 1 again, and `diverged` has none.
  inter = {(r["arm"], r["metric"]): r for r in on_disk["interactions"]}
  assert ("b", "diverged") not in inter and ("a", "auc_mean") not in inter
  for arm, seeds in (("b", [0, 1, 2, 3]), ("c", [0, 2, 3])):
    row = inter[(arm, "auc_mean")]
    d = np.array([(values(f"{arm}_hi")[s] - values("a_hi")[s])
                  - (values(f"{arm}_lo")[s] - values("a_lo")[s]) for s in seeds])
    assert (row["axis"], row["level"], row["reference"], row["cells"]) == ("lr", "hi", "lo", 1)
    assert row["n"] == len(seeds) and row["delta"] == pytest.approx(d.mean())
  d = np.array([0.004 + 0.001 * s for s in range(4)])   # b's growth at `hi`, by seed
  t = d.mean() / (d.std(ddof=1) / math.sqrt(d.size))
  assert inter[("b", "auc_mean")]["delta"] == pytest.approx(d.mean())
  assert inter[("b", "auc_mean")]["p_value"] == pytest.approx(2 * stats.t_cdf(-t, 3))
  assert inter[("c", "auc_mean")]["p_value"] == 1.0   # c's difference is the same at both
  for metric in {r["metric"] for r in on_disk["interactions"]}:
    family = [r for r in on_disk["interactions"] if r["metric"] == metric]
    assert [r["p_holm"] for r in family] == stats.holm([r["p_value"] for r in family])
  rate = pooled[("c", "diverged")]
  assert rate["delta"] == pytest.approx(0.5 / 4) and rate["n"] == 4
  assert pooled[("b", "diverged")]["ci95"] is None   # no divergence: no CI
  env = on_disk["environment"]
  assert env["jax"] == jax.__version__ and env["python"] == sys.version.split()[0]
  assert env["run_codes"] == {"not recorded": 24}   # the fake runs record no code

  text = (tmp_path / "REPORT.md").read_text()
  assert "Toy hypothesis." in text and "python -m toy" in text
  assert f"jax {jax.__version__}" in text
  assert " for this report; the runs were trained by: unrecorded code (24 runs);" in text
  # The design: the docstring's other sections, the training length, the evaluation lists.
  assert on_disk["design"] == "More text."
  assert on_disk["training"]["num_steps"] == 20
  design = text.split("## Design\n\n")[1].split("## How to read this")[0]
  assert design.startswith("More text.\n\nTraining: 20 steps of ")
  t = on_disk["training"]
  assert (t["eval_batches"], t["eval_lists"]) == (2, 2 * t["eval_batch_size"])
  assert (f"Evaluation: {2 * t['eval_batch_size']} lists per split "
          f"(2 batches of {t['eval_batch_size']}), drawn from `eval_seed` "
          f"{t['eval_seed']}") in design
  assert "(pooled: per seed, the mean over 2 conditions), `auc_mean`" in text
  assert "4 seeds)." in text
  assert "significantly higher (better)" in text
  assert "| c_hi | 4 | 1 |" in text
  auc_table = text.split("## `auc_mean`\n\n")[1].split("\n\n")[0].splitlines()
  assert auc_table[0].startswith("| variant | runs | diverged | `auc_mean` (mean ± 95% CI) "
                                 "| Bayes-optimal | Δ vs baseline [unadjusted 95% CI]")
  assert all(len(row.split("|")) == len(auc_table[0].split("|")) for row in auc_table)
  assert auc_table[2].startswith("| a_lo | 4 | 0 | ") and " | 0.8 | baseline |" in auc_table[2]
  assert " | 0.81 | " in auc_table[-1]
  # A retrieval sweep's oracle is a reference that a model can exceed, not a ceiling.
  assert on_disk["experiment"] == "ranking"
  assert "| Bayes oracle (a reference) | Δ vs baseline" in report.metric_table(
      dict(on_disk, experiment="retrieval"), "auc_mean")[0]
  # A results.json from before "experiment" was recorded: retrieval runs report `auc`.
  older = {k: v for k, v in on_disk.items() if k != "experiment"}
  assert "| Bayes-optimal |" in report.metric_table(older, "auc_mean")[0]
  older["variants"] = {n: dict(v, bayes={**v["bayes"], "auc": 0.8})
                       for n, v in older["variants"].items()}
  assert "| Bayes oracle (a reference) |" in report.metric_table(older, "auc_mean")[0]
  older["variants"]["c_hi"]["bayes"] = {}    # every run of it diverged: no Bayes value
  assert "| Bayes oracle (a reference) |" in report.metric_table(older, "auc_mean")[0]
  assert "| Δ `auc_mean` | lo | hi |" in text and "| b | +0.03 (p <0.001) * |" in text
  # The interaction table: b's difference grows from `lo` to `hi`, c's does not move.
  inter_table = text.split("| ΔΔ `auc_mean` | hi − lo |\n| --- | --- |\n")[1]
  assert inter_table.startswith("| b | +0.0055 (p 0.003) * |\n| c | 0 (p 1.000) |\n")
  # Metrics outside the headline get their pooled differences too (logloss moves with AUC).
  differences = text.split("Their differences to the baseline (pooled over the conditions")[1]
  b_row = next(line for line in differences.splitlines() if line.startswith("| b |"))
  assert b_row.startswith("| b | -0.00327 [") and b_row.split(" | ")[1].endswith(" *")
  assert "| vs baseline | Δ `logloss` | Δ `residual_rms/layer_1` |" in differences
  for png in ("curves.png", "effects.png"):
    assert (tmp_path / png).stat().st_size > 1000
    assert f"({png})" in text


def test_bayes_counterpart_finds_the_ceiling_of_a_metric():
  finals = {"bayes_auc_mean": 0.8, "long/bayes_auc_mean": 0.7, "bayes_auc/click_score": 0.6,
            "bayes_recall@5": 0.5}
  assert sweep.bayes_counterpart("auc_mean", finals) == "bayes_auc_mean"
  assert sweep.bayes_counterpart("long/auc_mean", finals) == "long/bayes_auc_mean"
  assert sweep.bayes_counterpart("auc/click_score", finals) == "bayes_auc/click_score"
  assert sweep.bayes_counterpart("recall@5", finals) == "bayes_recall@5"
  for metric in ("logloss", "score_consistency", "diverged", "short/auc_mean"):
    assert sweep.bayes_counterpart(metric, finals) is None


def test_which_side_of_a_metric_is_better():
  """The verdict's better/worse reading of every metric the ablations report."""
  assert sweep.BETTER == {"auc_mean": "higher", "auc_gap": "lower", "logloss": "lower",
                          "diverged": "lower", "calibration_error": "lower",
                          "score_consistency": "lower", "auc": "higher", "loss": "lower",
                          "recall@K": "higher", "ndcg@K": "higher"}
  assert sweep.better("eval/recall@10") == "higher" and sweep.better("ndcg@5") == "higher"
  assert sweep.better("shift_mean/logloss") == "lower"
  assert sweep.better("bayes_recall@10") is None
  # A new metric at every K takes one entry; an ablation's own entry wins, None included.
  assert sweep.better("long_list/precision@5", {"precision@K": "higher"}) == "higher"
  assert sweep.better("recall@10", {"recall@10": None}) is None
  assert sweep.better("logloss", {"logloss": "higher"}) == "higher"   # over a built-in one
  # Only the last prefix is a split's: a metric of a split with its own prefix too.
  assert sweep.better("serving/long_list/auc_mean") == "higher"


def test_verdict_uses_the_holm_adjusted_p():
  row = {"p_value": 0.03, "p_holm": 0.09, "delta": 0.01, "n": 3}
  assert report.verdict(row, "higher") == "no significant difference"
  assert report.verdict({**row, "p_holm": 0.04}, "higher") == \
      "significantly higher (better)"
  assert report.verdict({**row, "p_holm": 0.04, "delta": -0.01}, "higher") == \
      "significantly lower (worse)"
  assert report.verdict({**row, "p_holm": 0.04}, None) == "significantly higher"
  assert report.verdict({**row, "p_holm": 0.05}, "higher") == "no significant difference"
  assert report.verdict({"p_value": None, "delta": None, "n": 1}, "higher") == \
      "not testable: 1 complete pair"


def test_verdict_of_an_exact_difference_and_of_a_test_that_cannot_reject():
  """A difference every seed gave alike (a parameter count) is exact, neither starred nor
  called significant; an exact test whose pairs cannot reach p < 0.05 (three seeds'
  divergences) reads "not testable", not "no significant difference"."""
  exact = stats.paired_t([10.0, 10.0, 10.0], [7.0, 7.0, 7.0])
  exact["p_holm"] = 0.0
  assert exact["p_value"] == 0.0 and report.deterministic(exact)
  assert not report.significant(exact)
  assert report.verdict(exact, "higher") == "lower (worse) in every seed alike (exact, not a test)"
  assert report.short_verdict({**exact, "metric": "params"}, {}) == "-3 (exact)"
  varying = stats.paired_t([0.5, 0.6, 0.7], [0.4, 0.6, 0.55])
  assert not report.deterministic(varying) and not report.deterministic(
      stats.paired_t([1.0, 1.0, 1.0], [1.0, 1.0, 1.0]))
  never = stats.mcnemar_exact([0, 0, 0], [1, 1, 1])
  never["p_holm"] = never["p_value"]
  assert never["p_value"] == 0.25 and report.smallest_p(never) == 0.25
  assert report.verdict(never, "lower") == \
      "not testable: 3 pairs give no exact p below 0.250"
  pooled = stats.rate_difference([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
  pooled["test"] += " of seed means"
  assert report.verdict(pooled, "lower").startswith("not testable: 3 pairs")
  # Six pairs can reject: the verdict is the test's.
  six = stats.mcnemar_exact([0] * 6, [1] * 6)
  six["p_holm"] = six["p_value"]
  assert report.smallest_p(six) == 2.0 ** -5 and report.verdict(six, "lower") == \
      "significantly higher (worse)"
  assert report.verdict({**six, "p_holm": 0.5}, "lower") == "no significant difference"
  # Five pairs: the smallest exact p, 0.0625, lies between 0.05 and 0.1.
  five = stats.mcnemar_exact([0] * 5, [1] * 5)
  assert report.smallest_p(five) == 0.0625
  assert report.verdict(five, "lower") == "not testable: 5 pairs give no exact p below 0.062"
  # A t-test whose p underflows to 0 is a test (its interval has a width), not an exact
  # difference.
  rng = np.random.default_rng(0)
  b = rng.normal(size=100)
  underflow = stats.paired_t(b.tolist(), (b + 1.0 + 1e-4 * rng.normal(size=100)).tolist())
  underflow["p_holm"] = underflow["p_value"]
  assert underflow["p_value"] == 0.0 and underflow["ci95"][0] < underflow["ci95"][1]
  assert not report.deterministic(underflow)
  assert report.verdict(underflow, "higher") == "significantly higher (better)"
  # A sweep without conditions has no per-condition table.
  assert report.condition_matrix({"variants": {"a": {"arm": "a", "cell": ""},
                                               "b": {"arm": "b", "cell": ""}},
                                  "arms": ["a", "b"], "baseline": "a", "comparisons": []},
                                 "auc_mean") == []
  assert report.smallest_p(varying) is None
  # Pairs that all moved alike in a continuous metric: the exact sign-flip test again.
  alike = stats.paired_t([0.5, 0.6, 0.7], [0.51, 0.61, 0.71])
  assert report.smallest_p(alike) == 0.25 and report.verdict(alike, "higher").startswith(
      "not testable: 3 pairs")
  # Rows written by hand: no pairs, no test name.
  assert report.smallest_p({"test": None, "n": None}) is None
  assert report.verdict({"p_value": 0.5, "delta": 0.1, "n": None, "test": None}, "higher") \
      == "no significant difference"
  # An exact difference shows no p-value beside "not a test", in the tables and the verdict.
  results = {"baseline": "a", "better": {"params": "lower"}, "headline": ["params"],
             "primary_metric": "params", "experiment": "ranking",
             "variants": {n: {"arm": n, "cell": "", "seeds": [0, 1, 2], "diverged": 0,
                              "metrics": {"params": stats.summarize([x] * 3)}}
                          for n, x in (("a", 10.0), ("b", 7.0))},
             "comparisons": [{**exact, "variant": "b", "baseline": "a", "metric": "params"}]}
  row = report.metric_table(results, "params")[-1]
  assert row.endswith("| -3 (exact) | | | lower (better) in every seed alike (exact, not a test) |")
  line, = report.headline_lines(results)
  assert "(Δ = -3, 3 pairs)" in line and "p =" not in line
  # A hand-written row without a pair count still renders.
  results["comparisons"][0] = {k: v for k, v in results["comparisons"][0].items() if k != "n"}
  assert report.headline_lines(results)[0].endswith("(Δ = -3, 0 pairs).")


def test_a_printed_p_is_on_the_side_of_005_that_the_verdict_is():
  """A p just under 0.05 is not printed "0.050" beside "significantly"; the per-condition
  table stars a significant divergence comparison like any other."""
  assert [report.fmt_p(p) for p in (0.0496, 0.04996, 0.0504, 0.05, 0.214, 0.0009)] == \
      ["0.0496", "0.04996", "0.050", "0.050", "0.214", "<0.001"]
  assert report.fmt_p(0.001) == "0.001"   # "<0.001" is for smaller p only
  row = {**stats.mcnemar_exact([0] * 7, [1] * 7), "variant": "b", "baseline": "a",
         "metric": "diverged"}
  row["p_holm"] = row["p_value"]
  results = {"variants": {"a": {"diverged": 0, "seeds": list(range(7))},
                          "b": {"diverged": 7, "seeds": list(range(7))}}}
  assert report.significant(row)
  assert report.short_verdict(row, results) == "7/7 vs 0/7 (p 0.016) *"
  assert report.short_verdict({**row, "p_holm": 0.5}, results) == "7/7 vs 0/7 (p 0.016)"


def test_mean_and_interval_show_the_same_decimals():
  assert report.fmt_pm(0.5317, 0.2034) == "0.53 ± 0.20"      # no digit finer than the CI
  assert report.fmt_pm(0.7928, 0.0021) == "0.7928 ± 0.0021"
  assert report.fmt_pm(0.5, 0.0996) == "0.50 ± 0.10"          # rounding up adds no digit
  assert report.fmt_pm(14937.0, 4200.0) == "14900 ± 4200"
  assert report.fmt_pm(43015.0, 9409.0) == "43000 ± 9400"    # 2 significant digits, >= 100
  assert report.fmt_pm(43015.0, 9960.0) == "43000 ± 10000"   # rounding up adds no digit
  assert report.fmt_pm(12.34, 5.67) == "12.3 ± 5.7"
  assert report.fmt_pm(0.8, 0.0) == "0.8 ± 0"
  assert report.fmt_pm(0.7928, 0.00099) == "0.79280 ± 0.00099"
  assert report.fmt_pm(0.001486, 0.00088) == "0.00149 ± 0.00088"   # one format per column
  assert report.fmt_pm(2.7e-6, 3.4e-6) == "2.70e-06 ± 3.4e-06"     # tiny: scientific
  assert report.fmt_pm(-1e-5, 0.0021) == "0.0000 ± 0.0021"        # no sign on a rounded 0
  assert report.fmt_pm(-0.3, 40.0) == "0 ± 40"
  assert report.fmt_pm(1e5, 1.5) == "1.00e+05 ± 1.5"                 # from 1e5: as fmt


def test_training_variants_log_each_evaluation(caplog, tmp_path, monkeypatch):
  """A sweep that trains passes run_experiment a progress callback logging a line per
  evaluation (none for chunks without one), and an on_start one."""
  from phoenix_flax.training import Progress
  caplog.set_level("INFO")
  sweep._log_evaluation(Progress(10, 40, 5.0, 1.0, (0.5, 0.6), 0, {}))
  sweep._log_evaluation(Progress(20, 40, 5.0, 1.0, (0.4, 0.45), 0,
                                 {"eval/auc_mean": [0.61, 0.62], "eval/loss": [0.3, 0.31],
                                  "eval/ndcg@5": [0.9, 0.9]}))
  lines = [r.getMessage() for r in caplog.records]
  assert lines == ["  step 20/40 | train loss 0.4000 0.4500 | eval/auc_mean 0.6100 0.6200 | "
                   "eval/loss 0.3000 0.3100"]
  caplog.clear()   # retrieval: the recall at its largest K (here listed first), and the oracle's
  sweep._log_evaluation(Progress(20, 40, 5.0, 1.0, (0.4,), 0,
                                 {"eval/recall@100": [0.5], "eval/bayes_recall@100": [0.7],
                                  "eval/recall@10": [0.2], "eval/bayes_recall@10": [0.3],
                                  "eval/auc": [0.8], "eval/loss": [2.0]}))
  assert [r.getMessage() for r in caplog.records] == [
      "  step 20/40 | train loss 0.4000 | eval/auc 0.8000 | eval/loss 2.0000 | "
      "eval/recall@100 0.5000 | eval/bayes_recall@100 0.7000"]
  # ... and one when its seeds start, which says whether a killed sweep's run resumed.
  caplog.clear()
  sweep._log_start([0, 1], 0)
  sweep._log_start([1], 1000)
  assert [r.getMessage() for r in caplog.records] == [
      "  seeds [0, 1]: training from the start (compiling first)",
      "  seeds [1]: resumed from the checkpoint of step 1000"]
  passed = []
  def run_experiment(config, workdir, **callbacks):
    passed.append(callbacks)
    return fake_runner()(config, workdir)
  monkeypatch.setattr(sweep, "run_experiment", run_experiment)
  sw = sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), seeds=2, runner=fake_runner())
  sw._runner = None   # (a runner given skips the metric-name check that traces real runs)
  sw.run()
  assert passed and all(c == {"progress": sweep._log_evaluation, "on_start": sweep._log_start}
                        for c in passed)


def test_small_effect_reads_not_significant(tmp_path):
  results = sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), seeds=3,
                        runner=fake_runner()).run()
  c = next(r for r in results["comparisons"]
           if r["variant"] == "c" and r["metric"] == "auc_mean")
  assert c["p_value"] > 0.05
  text = (tmp_path / "REPORT.md").read_text()
  assert "**c** vs **a**, `auc_mean`: no significant difference" in text
  assert "Smoke preset: a check that the sweep runs end to end, not evidence" in text
  assert "(near chance) with 3 seeds; its verdicts mean nothing" in text
  # The combined report names the sweeps' seed count too, where they share one.
  combined = report.combined_markdown([("x", results), ("y", results)], str(tmp_path), "smoke")
  assert "(near chance) with 3 seeds;" in combined
  other = {**results, "seeds": [0, 1]}
  assert "(near chance) with few seeds;" in report.combined_markdown(
      [("x", results), ("y", other)], str(tmp_path), "smoke")
  unrecorded = {k: v for k, v in results.items() if k != "seeds"}   # older results.json
  assert "(near chance) with few seeds;" in report.combined_markdown(
      [("x", unrecorded)], str(tmp_path), "smoke")
  results["preset"] = "cpu"
  assert "Smoke preset" not in report.markdown(results)


def test_a_metric_undefined_in_every_run_reads_n_a_not_misspelled(tmp_path):
  """A metric every finished run stored as null (NaN: a log-loss with no valid entry) is
  a metric the runs report: n/a in the report, not "in no run's result.json"."""
  fake = fake_runner()

  def runner(config, workdir):
    fake(config, workdir)
    for run_dir in run_dirs(config, workdir).values():
      path = os.path.join(run_dir, "result.json")
      result = json.load(open(path))
      result["final"]["logloss"] = None
      writers.write_json(path, result)

  results = sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), runner=runner).run()
  assert all(v["metrics"]["logloss"]["mean"] is None for v in results["variants"].values())
  text = (tmp_path / "REPORT.md").read_text()
  assert "| a | n/a | 2 ± 0 |" in text and "| b | n/a | 0 [0, 0] (Holm p 1.000) |" in text
  # A metric no run has at all: misspelled, or new since the runs trained (they are reused).
  with pytest.raises(sweep.SweepError, match=r"metrics 'precision@5' are in no run's .*"
                                             r"before a metric existed lack it: use a new "
                                             r"--workdir, or delete the variants' folders"):
    sweep.Sweep(toy_ablation(metrics=("auc_mean", "precision@5", "diverged")), "smoke",
                str(tmp_path), runner=runner).run()


def test_a_value_left_out_of_a_finished_run_is_counted_in_the_report(tmp_path):
  """A finished run whose metric is undefined (null) is left out of that metric's mean
  and pairs: the cell names the n it rests on, the difference its pairs."""
  fake = fake_runner()

  def runner(config, workdir):
    fake(config, workdir)
    if os.path.basename(workdir) == "b":
      path = os.path.join(run_dirs(config, workdir)[0], "result.json")
      result = json.load(open(path))
      result["final"]["logloss"] = None
      writers.write_json(path, result)

  sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), seeds=3, runner=runner).run()
  lines = (tmp_path / "REPORT.md").read_text().splitlines()
  start = lines.index("| variant | `logloss` | `residual_rms/layer_1` |")
  b, c = (lines[start + i].strip("| ").split(" | ") for i in (3, 4))
  assert b[1].endswith(" (n=2)") and b[2] == "2 ± 0" and "(n=" not in c[1]
  start = lines.index("| vs baseline | Δ `logloss` | Δ `residual_rms/layer_1` |")
  b, c = (lines[start + i].strip("| ").split(" | ") for i in (2, 3))
  assert b[1].endswith(", 2 pairs)") and "pairs" not in b[2] + c[1]


def test_exact_differences_and_exact_tests_read_alike_in_every_report(tmp_path, monkeypatch):
  """A difference every seed gave exactly has no p in the combined table either (its row
  in a sweep's own table has none); a significant row without a CI (an exact test, such
  as `diverged`'s McNemar) is red in effects.png, as the plot's title says."""
  results = sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), seeds=3,
                        runner=fake_runner()).run()
  row = next(c for c in results["comparisons"] if c["metric"] == results["headline"][0])
  row.update(delta=200.0, ci95=[200.0, 200.0], p_value=0.0, p_holm=0.0)
  combined = report.combined_markdown([("x", results)], str(tmp_path), "smoke")
  assert (f"| `{row['metric']}` | 200 (exact) | | | higher (better) in every seed alike "
          "(exact, not a test) |") in combined
  figures = []
  monkeypatch.setattr(report, "save_figure", lambda fig, path: figures.append(fig))
  exact = {"variant": "b", "metric": "diverged", "delta": -1.0, "ci95": None, "n": 8,
           "p_value": 0.008, "p_holm": 0.016, "test": "exact McNemar"}
  for p_holm, color in ((0.016, "tab:red"), (0.5, "tab:gray")):
    figures.clear()
    assert report.plot_effects({"baseline": "a", "comparisons": [dict(exact, p_holm=p_holm)]},
                               ["diverged"], str(tmp_path / "effects.png"))
    [line] = figures[0].axes[0].get_lines()[:1]
    assert line.get_color() == color and line.get_markerfacecolor() == "none"


def _probe_scalars(run_dir, name):
  """tag -> [(step, value)] of a run's probe event file, read by TensorBoard's reader."""
  events = event_accumulator.EventAccumulator(writers.event_file_name(str(run_dir), name),
                                              size_guidance={"scalars": 0})
  events.Reload()
  return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
          for tag in events.Tags()["scalars"]}


def test_probes_are_cached_and_skip_diverged_runs(tmp_path, monkeypatch, caplog):
  calls = []

  def probe(ctx):
    calls.append((ctx.variant.name, ctx.seed))
    return {"probe": {"value": float(ctx.seed)}}

  monkeypatch.setattr(sweep, "load_systems", lambda cfg, d, seeds: (
      type("T", (), {"spec": None, "world": None}), [f"s{s}" for s in seeds]))
  ab = toy_ablation(probe=probe, metrics=("auc_mean", "probe/value", "diverged"))
  runner = fake_runner(diverge={("b", 0)})
  sw = sweep.Sweep(ab, "smoke", str(tmp_path), runner=runner)
  results = sw.run()
  assert sorted(calls) == [("a", 0), ("a", 1), ("b", 1), ("c", 0), ("c", 1)]
  assert results["variants"]["c"]["metrics"]["probe/value"]["per_seed"] == [0.0, 1.0]
  assert results["variants"]["b"]["metrics"]["probe/value"]["per_seed"] == [None, 1.0]
  # TensorBoard shows them as the run's scalars, at its last step (none for b0).
  assert _probe_scalars(tmp_path / "c" / "seed_1", "probes") == {"probe/value": [(20, 1.0)]}
  assert writers.event_file_name(str(tmp_path / "b" / "seed_0"), "probes") is None
  first = writers.event_file_name(str(tmp_path / "c" / "seed_1"), "probes")
  with caplog.at_level("INFO"):
    sw.run()
  assert len(calls) == 5
  assert "c: 2 run(s) keep the values of their probes.json (--reprobe" in caplog.text
  assert writers.event_file_name(str(tmp_path / "c" / "seed_1"), "probes") == first
  # A sweep probed before probes reached TensorBoard gets its event file from the cache.
  os.remove(first)
  sw.run()
  assert len(calls) == 5
  assert _probe_scalars(tmp_path / "c" / "seed_1", "probes") == {"probe/value": [(20, 1.0)]}
  # A probes.json damaged from outside is measured again, not a traceback; the partial
  # files of writers killed mid-write (a probe's, the report's) are cleared.
  text = (tmp_path / "c" / "seed_1" / sweep.PROBES_FILE).read_text()
  (tmp_path / "c" / "seed_1" / sweep.PROBES_FILE).write_text(text[:len(text) // 2])
  left = [tmp_path / "c" / "seed_0" / ".probes.json.tmp.999999",
          tmp_path / ".REPORT.md.tmp.999999"]
  for path in left:
    path.write_text("partial")
  with caplog.at_level("WARNING"):
    sw.run()
  assert calls[5:] == [("c", 1)] and "cannot be read as a JSON object" in caplog.text
  assert not [path for path in left if path.exists()]
  del calls[5:]
  # A probe changed to report another metric, run without --reprobe: the cached values
  # lack it, and the error says why and what to do.
  changed = dataclasses.replace(ab, metrics=("auc_mean", "probe/valu", "diverged"))
  with pytest.raises(sweep.SweepError, match=r"metrics 'probe/valu' \(did you mean "
                                             r"'probe/value'\?\) are in no run's .*run again "
                                             r"with --reprobe"):
    sweep.Sweep(changed, "smoke", str(tmp_path), runner=runner).run()
  # A probe that gained a metric, run with a seed more: the new runs report it and the
  # cached ones lack it, whose values passed for diverged runs' (n = 1 of 3) until the
  # check named them.
  def grown(ctx):
    calls.append((ctx.variant.name, ctx.seed))
    return {"probe": {"value": float(ctx.seed), "extra": 1.0}}
  more = dataclasses.replace(ab, probe=grown,
                             metrics=("auc_mean", "probe/value", "probe/extra", "diverged"))
  with pytest.raises(sweep.SweepError, match=r"5 finished run\(s\) lack metrics \['probe/"
                                             r"extra'\] that other runs report \(.*a/seed_0, "
                                             r".*a/seed_1, .*b/seed_1, \.\.\.\): older code "
                                             r"made them\. .*run again with --reprobe"):
    sweep.Sweep(more, "smoke", str(tmp_path), seeds=3, runner=runner).run()
  assert sorted(calls[5:]) == [("a", 2), ("b", 2), ("c", 2)]
  del calls[5:]
  # --reprobe (after a probe changed): every finished run is measured again.
  sweep.Sweep(ab, "smoke", str(tmp_path), runner=runner, reprobe=True).run()
  assert sorted(calls[5:]) == sorted(calls[:5])
  assert len(glob.glob(str(tmp_path / "c" / "seed_1" / "events.out.tfevents.*"))) == 1


def test_a_result_json_of_the_wrong_shape_stops_the_report(tmp_path):
  """A result.json emptied or overwritten from outside (valid JSON, no run's result) is
  named with the way out, instead of a report without that seed."""
  sw = sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), runner=fake_runner())
  sw.run()
  (tmp_path / "b" / "seed_1" / "result.json").write_text("{}")
  with pytest.raises(ConfigError, match=r"b/seed_1/result.json is not a finished run's result "
                                        r"\(no valid 'final', .*delete it and the run resumes"):
    sw.write()


def test_derived_metrics_reach_tensorboard(tmp_path):
  gap = lambda auc: None if auc is None else 1.0 - auc   # a diverged run has no AUC
  ab = toy_ablation(derived=lambda found: {"gap": {"auc": gap(found["auc_mean"])}},
                    metrics=("auc_mean", "gap/auc", "diverged"))
  results = sweep.Sweep(ab, "smoke", str(tmp_path), runner=fake_runner(diverge={("b", 0)})).run()
  gap = results["variants"]["c"]["metrics"]["gap/auc"]["per_seed"][1]
  ((step, value),) = _probe_scalars(tmp_path / "c" / "seed_1", "derived")["gap/auc"]
  assert step == 20 and value == pytest.approx(gap)
  assert writers.event_file_name(str(tmp_path / "b" / "seed_0"), "derived") is None


def test_a_derived_metric_follows_its_probes_when_they_are_measured_again(tmp_path,
                                                                          monkeypatch):
  """An arm added later measures every run of its seeds' joint probe again, without
  --reprobe: the derived metric's TensorBoard copy is rewritten with them (it kept the
  first measurement's value, against the report's)."""
  monkeypatch.setattr(sweep, "load_systems", lambda cfg, d, seeds: (
      type("T", (), {"spec": None, "world": None}), [None] * len(seeds)))
  rounds = []

  def joint_probe(contexts):
    rounds.append(len(contexts))
    return [{"speed": 100.0 * len(rounds) + i} for i in range(len(contexts))]
  twice = lambda found: {"twice": None if found.get("speed") is None else 2 * found["speed"]}
  kw = dict(joint_probe=joint_probe, derived=twice,
            metrics=("auc_mean", "speed", "twice", "diverged"))
  two_arms = toy_ablation(arms={"a": {"model.num_layers": 1}, "b": {"model.num_layers": 2}},
                          **kw)
  sweep.Sweep(two_arms, "smoke", str(tmp_path), seeds=1, runner=fake_runner()).run()
  results = sweep.Sweep(toy_ablation(**kw), "smoke", str(tmp_path), seeds=1,
                        runner=fake_runner()).run()
  assert rounds == [2, 3]
  assert results["variants"]["a"]["metrics"]["twice"]["per_seed"] == [400.0]
  assert _probe_scalars(tmp_path / "a" / "seed_0", "derived") == {"twice": [(20, 400.0)]}


def test_joint_probes_measure_each_seed_once_over_all_variants(tmp_path, monkeypatch):
  calls = []

  def joint_probe(contexts):
    calls.append([(c.variant.name, c.seed, c.system) for c in contexts])
    return [{"speed": 10.0 * (i + 1) + c.seed} for i, c in enumerate(contexts)]

  monkeypatch.setattr(sweep, "load_systems", lambda cfg, d, seeds: (
      type("T", (), {"spec": None, "world": None}),
      [f"{os.path.basename(d)}{s}" for s in seeds]))
  ab = toy_ablation(joint_probe=joint_probe, metrics=("auc_mean", "speed", "diverged"))
  sw = sweep.Sweep(ab, "smoke", str(tmp_path), runner=fake_runner(diverge={("b", 0)}))
  results = sw.run()
  # One call per seed, over that seed's finished runs in variant order (b0 diverged).
  assert calls == [[("a", 0, "a0"), ("c", 0, "c0")],
                   [("a", 1, "a1"), ("b", 1, "b1"), ("c", 1, "c1")]]
  speed = {v: results["variants"][v]["metrics"]["speed"]["per_seed"] for v in "abc"}
  assert speed == {"a": [10.0, 11.0], "b": [None, 21.0], "c": [20.0, 31.0]}
  assert _probe_scalars(tmp_path / "c" / "seed_1", "joint_probes") == {"speed": [(20, 31.0)]}
  sw.run()
  assert len(calls) == 2                                  # cached
  os.remove(tmp_path / "c" / "seed_1" / sweep.JOINT_PROBES_FILE)
  sw.run()                                                # seed 1 again, as a whole
  assert calls[2:] == [[("a", 1, "a1"), ("b", 1, "b1"), ("c", 1, "c1")]]
  sweep.Sweep(ab, "smoke", str(tmp_path), runner=fake_runner(diverge={("b", 0)}),
              reprobe=True).run()
  assert calls[3:] == calls[:2]                           # --reprobe: every seed again
  # --reprobe of a --variants subset measures the subset together and drops the other
  # variants' joint probes of those seeds (measured in another session), so that the next
  # sweep over every variant measures them all together again.
  sweep.Sweep(ab, "smoke", str(tmp_path), runner=fake_runner(diverge={("b", 0)}),
              variants=["c"], reprobe=True).run()
  assert calls[5:] == [[("a", 0, "a0"), ("c", 0, "c0")], [("a", 1, "a1"), ("c", 1, "c1")]]
  assert not (tmp_path / "b" / "seed_1" / sweep.JOINT_PROBES_FILE).exists()
  assert writers.event_file_name(str(tmp_path / "b" / "seed_1"), "joint_probes") is None
  sw.run()
  assert calls[7:] == [[("a", 1, "a1"), ("b", 1, "b1"), ("c", 1, "c1")]]
  os.remove(tmp_path / "a" / "seed_0" / sweep.JOINT_PROBES_FILE)
  bad = sweep.Sweep(toy_ablation(joint_probe=lambda contexts: [{}],
                                 metrics=("auc_mean", "speed", "diverged")),
                    "smoke", str(tmp_path), runner=fake_runner(diverge={("b", 0)}))
  with pytest.raises(ValueError, match="returned 1 results for 2 runs"):
    bad.run()


def test_report_names_the_code_that_trained_the_runs(tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(provenance, "running_code_version", lambda: "cafe00000000")
  old = fake_runner(code=lambda variant: "01d000000000" if variant == "a" else "cafe00000000")
  results = sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), runner=old).run()
  assert results["environment"]["code"] == "cafe00000000"
  assert results["environment"]["run_codes"] == {"01d000000000": 2, "cafe00000000": 4}
  assert results["environment"]["machine"] == provenance.machine()
  text = (tmp_path / "REPORT.md").read_text()
  assert ("Code: cafe00000000 for this report; the runs were trained by: 01d000000000 "
          "(2 runs), cafe00000000 (4 runs); Python") in text
  assert f"; machine: {provenance.machine()}." in text
  # Re-run: the finished runs are reused, and the log says so and where they lie.
  with caplog.at_level(logging.INFO):
    sweep.Sweep(toy_ablation(), "smoke", str(tmp_path),
                runner=fake_runner(code=lambda variant: "cafe00000000")).run()
  assert "2 of 2 seeds finished earlier and are reused" in caplog.text
  assert f"delete {tmp_path / 'a'} to train them again" in caplog.text
  assert "Code: cafe00000000 (every run's too); Python" in (tmp_path / "REPORT.md").read_text()
  # A rerun with fewer variants replaces the report, and says what it left out.
  with caplog.at_level(logging.WARNING):
    sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), variants=["a", "b"],
                runner=fake_runner(code=lambda variant: "cafe00000000")).run()
  assert "the report now covers fewer runs than the one it replaces (left out: variants " \
         "['c'], seeds []; their runs stay in" in caplog.text
  caplog.clear()   # and with fewer seeds (every variant again)
  with caplog.at_level(logging.WARNING):
    sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), seeds=1,
                runner=fake_runner(code=lambda variant: "cafe00000000")).run()
  assert "(left out: variants [], seeds [1]; their runs stay in" in caplog.text


def test_a_sweeps_seeds_start_at_the_configs_seed_and_its_directions_are_its_own(tmp_path):
  """`--override=seed=7` with 2 seeds runs seeds 7 and 8 (their runs in seed_7/, seed_8/);
  results.json's `better` reads the ablation's own directions over the built-in ones."""
  ab = toy_ablation(better={"logloss": "higher"})
  sw = sweep.Sweep(ab, "smoke", str(tmp_path), seeds=2, overrides={"seed": 7},
                   runner=fake_runner())
  assert sw.seeds == [7, 8]
  results = sw.run()
  assert results["seeds"] == [7, 8] and (tmp_path / "a" / "seed_8").is_dir()
  assert results["better"]["logloss"] == "higher"
  assert results["better"]["auc_mean"] == "higher"
  with pytest.raises(ValueError, match="seeds=0: need at least 1"):
    sweep.Sweep(ab, "smoke", str(tmp_path / "none"), seeds=0, runner=fake_runner())


def test_unknown_metric_is_an_error(tmp_path):
  sw = sweep.Sweep(toy_ablation(metrics=("auc_mean", "auc_maen")), "smoke", str(tmp_path),
                   runner=fake_runner())
  with pytest.raises(ValueError, match="auc_maen"):
    sw.run()
  # A diverged seed in every variant: the seeds that finished still show the name is wrong.
  diverging = fake_runner(diverge={(arm, 0) for arm in ("a", "b", "c")})
  sw = sweep.Sweep(toy_ablation(metrics=("auc_mean", "auc_maen")), "smoke",
                   str(tmp_path / "diverging"), seeds=2, runner=diverging)
  with pytest.raises(ValueError, match="auc_maen"):
    sw.run()


def test_missing_run_is_an_error(tmp_path):
  sw = sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), runner=lambda c, w: None)
  with pytest.raises(FileNotFoundError, match="has not finished"):
    sw.run()


ARMS = {   # per ablation, what each arm's name says it sets
    "soft_capping": {"cap30": {"model.attn_logit_cap": 30.0},
                     "cap10": {"model.attn_logit_cap": 10.0},
                     "cap50": {"model.attn_logit_cap": 50.0},
                     "off": {"model.attn_logit_cap": None}},
    "gqa_ratio": {f"kv{k}": {"model.num_kv_heads": k} for k in (8, 4, 2, 1)},
    "sandwich_norm": {
        **{a: {"model.norm_layout": a, "model.param_init": "variance_scaling"}
           for a in ("sandwich", "pre", "post")},
        "rezero": {"model.norm_layout": "sandwich", "model.param_init": "rezero"}},
    "candidate_isolation": {"isolated": {"model.candidate_isolation": True},
                            "causal": {"model.candidate_isolation": False}},
    "rope_anchoring": {"sequential": {"model.right_anchored_rope": False},
                       "right_anchored": {"model.right_anchored_rope": True}},
    "logq_correction": {"off": {"retrieval.logq_correction": False},
                        "logq": {"retrieval.logq_correction": True}}}


def _get(cfg, path):
  for part in path.split("."):
    cfg = cfg[part]
  return cfg


def _cell_settings(part):
  """What one part of a condition cell's name says it sets."""
  kind, value = re.fullmatch(r"(L|lr|corr|quality|)(.+)", part).groups()
  if kind == "quality":
    return {"world.quality_scale": float(value)}
  if kind == "L":
    return {"model.num_layers": int(value)}
  if kind == "lr":
    return {"optim.learning_rate": float(value)}
  if kind == "corr":   # every split but random_companions, which has no shared session
    return {f"{p}.list_correlation": float(value)
            for p in ("train_split", "eval_split", "extra_eval_splits.long_list",
                      "extra_eval_splits.by_relevance")}
  assert value in ("float32", "bfloat16"), (
      f"condition {part!r}: add what it sets to _cell_settings in tests/test_ablations.py")
  return {"model.fprop_dtype": value}


@pytest.mark.parametrize("module", SCRIPTS, ids=lambda m: m.ABLATION.name)
def test_scripts_state_their_design_and_build_valid_configs(module, tmp_path):
  """The docstring's sections; and at every preset each variant's config sets its
  overrides, what its arm and condition names say (`cap10`: logits capped at 10;
  `L6_lr0.03`: 6 layers, peak learning rate 0.03; ...), and every `section.field=value`
  the docstring's "Task knobs:" names."""
  doc = module.__doc__
  for section in ("Hypothesis:", "Task knobs:", "Variants:", "Metrics:"):
    assert section in doc, f"{module.__name__} docstring lacks {section!r}"
  knobs = doc[doc.index("Task knobs:"):doc.index("Variants:")]
  documented = {path: ast.literal_eval(value) for path, value
                in re.findall(r"`(\w+(?:\.\w+)+)=([^`]+)`", knobs)}
  ab = module.ABLATION
  assert set(ab.headline) <= set(ab.metrics)
  for preset in sweep.PRESETS:
    sw = sweep.Sweep(ab, preset, str(tmp_path / "w"))
    assert sw.seeds == list(range(sweep.SEEDS[preset]))
    arms = {v.arm for v in sw.variants}
    assert arms == set(ab.arms)
    for v in sw.variants:
      cfg = sw.config(v)
      assert cfg.num_seeds == len(sw.seeds) and cfg.output.seed_subdirs is True
      for path, value in v.overrides.items():
        assert _get(cfg, path) == value, path
      named = ARMS.get(ab.name, {})
      assert v.arm in named, (f"arm {v.arm!r} of {ab.name}: add what its name says it "
                             f"sets to ARMS[{ab.name!r}] in tests/test_ablations.py")
      expected = dict(documented, **named[v.arm])
      for part in filter(None, v.cell.split("_")):
        expected.update(_cell_settings(part))
      for path, value in expected.items():
        assert _get(cfg, path) == value, (preset, v.name, path)
      if "corr" in v.cell:
        companions = cfg.extra_eval_splits.random_companions
        assert companions.list_correlation == 0 and companions.relevant_fraction == 0.1


@pytest.mark.parametrize("module", SCRIPTS, ids=lambda m: m.ABLATION.name)
def test_curves_png_shows_every_cell_at_every_preset(module):
  """curves.png draws one panel per (condition cell, curve) up to
  `report.MAX_CURVE_PANELS`: at 12, sandwich_norm's full preset (9 cells x 2 curves) lost
  its three deepest cells, the ones its hypothesis is about."""
  ab = module.ABLATION
  for preset in sweep.PRESETS:
    cells = {v.cell for v in ab.variants(preset)}
    assert len(cells) * len(ab.curves) <= report.MAX_CURVE_PANELS, preset


def test_presets_grow_and_fit_the_budget():
  smoke, cpu = sweep.preset_config("smoke"), sweep.preset_config("cpu")
  assert smoke.train.num_steps <= 20 and smoke.world.history_len <= 8
  assert cpu.train.num_steps < sweep.preset_config("full").train.num_steps
  # At the cpu preset an ablation trains at most 16 runs (sandwich_norm's 16 took 848 s on
  # the 2-core AVX2 host of docs/results).
  runs = {m.ABLATION.name: len(m.ABLATION.variants("cpu")) for m in SCRIPTS}
  assert max(runs.values()) <= 16, runs


def test_sweep_refuses_ignored_overrides_and_runs_of_other_configs(tmp_path):
  """Both are refused when the sweep is built, before anything trains."""
  ab = toy_ablation(conditions=lr_conditions)
  for path in ("model.num_layers", "optim.learning_rate"):   # set by every arm / condition
    with pytest.raises(ValueError, match=rf"\['{path}'\] would change nothing"):
      sweep.Sweep(ab, "smoke", str(tmp_path), overrides={path: 4})
  # ... and one of what the sweep itself sets in every variant, which would be ignored.
  for path, value, instead in (("num_seeds", 5, "use --seeds"),
                               ("output.seed_subdirs", False, "every run has its seed's")):
    with pytest.raises(ValueError, match=rf"override of '{path}': a sweep sets it itself; "
                                         rf"{instead}"):
      sweep.Sweep(ab, "smoke", str(tmp_path), overrides={path: value})
  # An override that only some variants set is the value of the others.
  partial = toy_ablation(arms={"a": {"model.num_layers": 1}, "b": {}})
  sw = sweep.Sweep(partial, "smoke", str(tmp_path), overrides={"model.num_layers": 3})
  assert [sw.config(v).model.num_layers for v in sw.variants] == [1, 3]
  # A run directory that holds another config's run (here b's in a's place).
  sw = sweep.Sweep(ab, "smoke", str(tmp_path))
  a_lo, b_lo = sw.variants[0], sw.variants[1]
  os.makedirs(sw.run_dir(a_lo, 0))
  with open(os.path.join(sw.run_dir(a_lo, 0), "config.json"), "w") as f:
    json.dump(seed_config(sw.config(b_lo), 0).to_dict(), f)
  runner = fake_runner()
  with pytest.raises(ValueError, match=r"a_lo/seed_0 holds a run of another config \(differs "
                                       r"in \['model.num_layers'\]: model.num_layers 2 there, "
                                       r"1 here\)"):
    sweep.Sweep(ab, "smoke", str(tmp_path), runner=runner)
  assert runner.calls == []


def test_retrieval_ablations_start_from_the_retrieval_config(tmp_path):
  ab = toy_ablation(arms={"a": {"retrieval.temperature": 0.05},
                          "b": {"retrieval.temperature": 0.2}},
                    metrics=("recall@10", "auc", "diverged"), experiment="retrieval",
                    curves=("train/loss", "eval/recall@10"))
  sw = sweep.Sweep(ab, "cpu", str(tmp_path))
  cfgs = [sw.config(v) for v in sw.variants]
  assert [c.task for c in cfgs] == ["retrieval", "retrieval"]
  assert [c.retrieval.temperature for c in cfgs] == [0.05, 0.2]
  assert cfgs[0].train.num_steps == sweep.PRESETS["cpu"]["train.num_steps"]
  assert sweep.Sweep(toy_ablation(), "cpu", str(tmp_path)).base.task == "ranking"
  with pytest.raises(ValueError, match="experiment='ranker' must be one of"):
    toy_ablation(experiment="ranker")
  assert [sweep.better(m) for m in ("recall@10", "long/ndcg@5", "bayes_recall@10", "auc")] \
      == ["higher", "higher", None, "higher"]


def test_run_all_runs_every_registered_script():
  """... and every script of ablations/ that defines an `ABLATION` is registered (in
  `ablations.SCRIPTS`), or no test would check its design, configs and README entry."""
  folder = os.path.dirname(ablations.__file__)
  defined = set()
  for name in os.listdir(folder):
    if name.endswith(".py"):
      with open(os.path.join(folder, name), encoding="utf-8") as f:
        body = ast.parse(f.read()).body
      if any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ABLATION"
                                                  for t in node.targets) for node in body):
        defined.add(name[:-3])
  assert defined - set(ablations.SCRIPTS) == set(), (
      "add these ablation scripts' names to ablations.SCRIPTS (ablations/__init__.py)")
  assert defined >= {"candidate_isolation", "logq_correction"}
  assert [m.__name__ for m in SCRIPTS] == [f"ablations.{n}" for n in ablations.SCRIPTS]
  assert list(run_all.ABLATIONS) == [m.ABLATION.name for m in SCRIPTS]
  assert run_all.FLAGS["ablations"].default == list(run_all.ABLATIONS)


def test_printed_commands_paste_back_whatever_the_workdir(monkeypatch):
  """The command a report records and the TensorBoard command a finished sweep prints
  split back, as a shell would, into the arguments they came from."""
  workdir = "/tmp/my sweeps/ünï #1 'x'"
  argv = ["ablations/soft_capping.py", "--preset=smoke", f"--workdir={workdir}"]
  monkeypatch.setattr(sys, "argv", argv)
  monkeypatch.setattr(sys.modules["__main__"], "__spec__", None, raising=False)
  assert shlex.split(sweep.command_line()) == ["python", *argv]
  report_line, curves = sweep.where_to_look(os.path.join(workdir, "REPORT.md"),
                                            workdir).splitlines()
  assert report_line == f"Report: {workdir}/REPORT.md"
  assert shlex.split(curves) == ["Curves:", "tensorboard", "--logdir", workdir]


def test_run_all_writes_one_combined_report(tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(run_all, "ABLATIONS", {"toy": toy_ablation(),
                                             "toy2": toy_ablation(name="toy2")})
  names = ["toy", "toy2"]
  path = run_all.run_all(names, run_all.make_sweeps(names, str(tmp_path), make_sweep=fake_sweep),
                         str(tmp_path), command="cmd")
  text = open(path).read()
  assert "## [toy](toy/REPORT.md)" in text and "## [toy2](toy2/REPORT.md)" in text
  assert "| [toy](toy/REPORT.md) | b vs a | `auc_mean` |" in text
  assert "![toy](toy/effects.png)" in text and "    cmd" in text
  # One environment line for both sweeps, counting every run.
  code_lines = [line for line in text.splitlines() if line.startswith("Code: ")]
  assert len(code_lines) == 1 and "the runs were trained by: unrecorded code (12 runs);" \
      in code_lines[0], code_lines
  combined = json.loads((tmp_path / "results.json").read_text())
  assert set(combined) == {"toy", "toy2"}
  # The partial files of a writer of the combined report killed mid-write are cleared.
  left = tmp_path / ".REPORT.md.tmp.999999"
  left.write_text("partial")
  run_all.run_all(names, run_all.make_sweeps(names, str(tmp_path), make_sweep=fake_sweep),
                  str(tmp_path))
  assert not left.exists()
  assert combined["toy"]["variants"]["b"]["metrics"]["auc_mean"]["mean"] > 0.72
  assert (tmp_path / "toy" / "REPORT.md").exists()
  # A later run of fewer ablations into the same workdir says what its report leaves out.
  caplog.set_level("WARNING")
  run_all.run_all(["toy"], run_all.make_sweeps(["toy"], str(tmp_path), make_sweep=fake_sweep),
                  str(tmp_path))
  assert any("now cover ['toy'] only, no longer ['toy2']" in r.getMessage()
             for r in caplog.records)
  assert set(json.loads((tmp_path / "results.json").read_text())) == {"toy"}


def test_a_sweep_refuses_a_folder_holding_a_report_it_did_not_write(tmp_path, monkeypatch):
  """A sweep (and run_all) would replace results.json, REPORT.md and the plots of its
  folder: another tool's, another ablation's or a report without its results.json is
  refused before any work, and left as it was; its own earlier report is not."""
  monkeypatch.setattr(run_all, "ABLATIONS", {"toy": toy_ablation()})
  other = tmp_path / "other"
  other.mkdir()
  (other / "REPORT.md").write_text("mine\n")
  # (the second: a map of objects, as run_all's, but none a sweep's of the ablation named)
  for text in ('{"a": 1}\n', '{"toy": {"a": 1}}\n'):
    (other / "results.json").write_text(text)
    for check in (lambda: fake_sweep(toy_ablation(), str(other)),
                  lambda: run_all.make_sweeps(["toy"], str(other), make_sweep=fake_sweep)):
      with pytest.raises(ValueError, match="results.json is not the toy sweep's|"
                                           "results.json is not ablations.run_all's"):
        check()
  (other / "results.json").unlink()
  with pytest.raises(ValueError, match="holds a REPORT.md but no results.json, so the toy "
                                       "sweep did not write it"):
    fake_sweep(toy_ablation(), str(other))
  assert os.listdir(other) == ["REPORT.md"] and (other / "REPORT.md").read_text() == "mine\n"
  # Its own report: the sweep runs again there; another ablation's is refused.
  mine = tmp_path / "mine"
  fake_sweep(toy_ablation(), str(mine)).run()
  fake_sweep(toy_ablation(), str(mine))
  with pytest.raises(ValueError, match="results.json is not the toy2 sweep's"):
    fake_sweep(toy_ablation(name="toy2"), str(mine))
  # Two sweeps started at once in one folder both pass that check: the one that finishes
  # second is refused when it comes to write, leaving the other's report as it was.
  both = tmp_path / "both"
  second = fake_sweep(toy_ablation(name="toy2"), str(both))
  fake_sweep(toy_ablation(), str(both)).run()
  written = (both / "results.json").read_text()
  with pytest.raises(ValueError, match="results.json is not the toy2 sweep's"):
    second.run()
  assert (both / "results.json").read_text() == written
  # A sweep killed before its first report leaves runs and no results.json: another
  # ablation (or run_all) refuses the folder, naming the runs, which would otherwise be
  # stranded (the killed sweep could not resume beside the other's report); the killed
  # sweep itself resumes there.
  killed = tmp_path / "killed"
  fake_sweep(toy_ablation(), str(killed)).run()
  for name in ("results.json", "REPORT.md"):
    (killed / name).unlink()
  other_arms = dict(name="toy2", arms={"x": {"model.num_layers": 1},
                                       "y": {"model.num_layers": 2}}, baseline="x")
  with pytest.raises(ValueError, match=r"holds runs that are no variant of toy2 at preset "
                                       r"'smoke' \(a, b, c\): another sweep's"):
    fake_sweep(toy_ablation(**other_arms), str(killed))
  with pytest.raises(ValueError, match=r"holds runs that are no ablation's sweep folder "
                                       r"\(a, b, c\)"):
    run_all.make_sweeps(["toy"], str(killed), make_sweep=fake_sweep)
  fake_sweep(toy_ablation(), str(killed)).run()
  assert (killed / "results.json").exists()
  # Beside its own report, runs of variants its edited grid no longer has are its own.
  fake_sweep(toy_ablation(arms={"a": {"model.num_layers": 1}, "b": {"model.num_layers": 2}}),
       str(killed)).run()
  # A single sweep in a run_all folder whose combined report was never written: its
  # ablation folders hold runs one level deeper, and are refused the same way.
  nested = tmp_path / "nested"
  run_all.run_all(["toy"], run_all.make_sweeps(["toy"], str(nested), make_sweep=fake_sweep),
                  str(nested))
  for name in ("results.json", "REPORT.md"):
    (nested / name).unlink()
  with pytest.raises(ValueError, match=r"no variant of toy2 at preset 'smoke' \(toy\)"):
    fake_sweep(toy_ablation(**other_arms), str(nested))
  # run_all's combined report, made by run_all, and a damaged results.json are replaced.
  combined = tmp_path / "combined"
  run_all.run_all(["toy"], run_all.make_sweeps(["toy"], str(combined), make_sweep=fake_sweep),
                  str(combined))
  run_all.make_sweeps(["toy"], str(combined), make_sweep=fake_sweep)
  (other / "results.json").write_text("{damaged")
  fake_sweep(toy_ablation(), str(other))
  # So is one that is JSON but no object (it raised AttributeError), in a sweep's folder and
  # in run_all's, whose combined results.json is read again after every sweep has run.
  (other / "results.json").write_text("[]")
  fake_sweep(toy_ablation(), str(other))
  run_all.make_sweeps(["toy"], str(other), make_sweep=fake_sweep)
  for damaged in ("[]", "{damaged"):
    (combined / "results.json").write_text(damaged)
    run_all.run_all(["toy"], run_all.make_sweeps(["toy"], str(combined), make_sweep=fake_sweep),
                    str(combined))
    assert set(json.loads((combined / "results.json").read_text())) == {"toy"}


def test_cli_rejects_bad_flags_before_work(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  workdir = tmp_path / "sweep"
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  cases = {
      "gqa_ratio": [
          (["--preset=huge"], "flag --preset=huge: value should be one of"),
          (["--variants=nope"], "unknown"),
          (["--override=model.num_layerz=2"], "num_layerz"),
          (["--override=model.num_kv_heads=1"], "would change nothing"),
          (["--override=mesh.num_devices=3"], "mesh.num_devices=3 is invalid"),
          (["--override=model=None"], "config.model is a section: override its fields"),
          ([f"--workdir={a_file}/sweep"], f"{a_file} is a file, not a directory"),
          # (--workdir=$WD with WD unset trained into the default folder)
          (["--workdir="], "--workdir is empty: give a directory, or leave the flag out "
                           "for /tmp/phoenix_ablations/cpu/gqa_ratio")],
      # a setting that takes a reported metric away, in an ablation with probes (whose
      # metrics are known only after training: it trained every run, then failed)
      "candidate_isolation": [(["--override=train.score_consistency=false"],
                               "your overrides {'train.score_consistency': False} take away "
                               "metrics ['score_consistency'] that it reports")],
      # a value its task() computes from (a traceback blaming the script's own code)
      "rope_anchoring": [(["--override=world.history_len=None"],
                          "rope_anchoring's task() failed on your overrides "
                          "{'world.history_len': None} (TypeError")],
      "run_all": [
          ([f"--workdir={a_file}"], f"{a_file} is a file, not a directory"),
          (["--workdir="], "--workdir is empty"),
          (["--workdir= "], "--workdir is empty"),   # (trained into a folder named " ")
          (["--ablations="], "--ablations is empty"),
          (["--ablations=gqa_ratio,gqa_ratio"], "names ['gqa_ratio'] more than once"),
          (["--variants=kv8"], "--variants selects variants of one ablation; run that "
                               "ablation's script instead")]}
  with ForkServer(env, preload=["ablations.sweep"]) as server:
    for module, module_cases in cases.items():
      for args, message in module_cases:
        code, _, stderr = server.run(f"ablations.{module}", [f"--workdir={workdir}", *args])
        assert code == 2, (args, stderr[-2000:])   # the message alone: no traceback,
        assert message in stderr, (args, stderr)   # no docstring dump
        assert stderr.startswith("error: ") and "Hypothesis:" not in stderr
        assert "Traceback" not in stderr
  assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
  """--dry_run builds and checks the sweep, prints each variant's settings and how many of
  its seeds are finished, and trains and writes nothing; run_all prints every sweep's."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  workdir = tmp_path / "sweep"
  with ForkServer(env, preload=["ablations.sweep"]) as server:
    results = [server.run(f"ablations.{module}", ["--preset=smoke", f"--workdir={workdir}",
                                                  "--dry_run", *extra])
               for module, extra in (("gqa_ratio", ["--override=optim.learning_rate=0.02"]),
                                     ("run_all", ["--ablations=gqa_ratio,soft_capping"]))]
  for code, _, stderr in results:
    assert code == 0, stderr[-2000:]
  single, both = (stdout.splitlines() for _, stdout, _ in results)
  ablation = ablations.gqa_ratio.ABLATION
  variants = ablation.variants("smoke")
  assert single[0].startswith(f"gqa_ratio at preset 'smoke': {len(variants)} variants x 2 "
                              "seeds [0, 1],")
  assert single[0].endswith(f"into {workdir}; your overrides {{'optim.learning_rate': 0.02}}")
  # What the script's task sets in every variant (the user's overrides are in line 0).
  assert single[1] == "  every variant: model.num_q_heads=8"
  assert single[2] == "  kv8 (baseline): model.num_kv_heads=8; to train"
  assert [line.split(" ")[2].rstrip(":") for line in single[2:-1]] == [v.name for v in variants]
  assert single[-1] == f"metrics: {', '.join(ablation.metrics)}"
  assert both[0].startswith("gqa_ratio at preset 'smoke'") and any(
      line.startswith("soft_capping at preset 'smoke'") for line in both)
  assert not workdir.exists()


def test_the_plan_names_what_the_ablation_sets_in_every_variant(tmp_path):
  """The plan's second line is what the script's task and preset overrides set in every
  variant, an extra evaluation split by the fields that differ from a split's defaults;
  the user's overrides are named in the first line instead."""
  def task(cfg, preset):
    cfg.optim.warmup_steps = 3
    cfg.extra_eval_splits.long = split_config(max_history=3)

  ab = toy_ablation(task=task, preset_overrides={"smoke": {"world.recency_decay": 0.25}})
  plan = sweep.Sweep(ab, "smoke", str(tmp_path), runner=fake_runner(),
                     overrides=[("optim.warmup_steps", 2)]).plan().splitlines()
  assert plan[1] == ("  every variant: extra_eval_splits.long.max_history=3, "
                     "world.recency_decay=0.25")
  assert plan[2].startswith("  a (baseline): model.num_layers=1;")
  assert "every variant" not in sweep.Sweep(toy_ablation(), "smoke", str(tmp_path / "plain"),
                                            runner=fake_runner()).plan()


def test_the_plan_says_what_the_run_would_warn_about_or_refuse(tmp_path, monkeypatch):
  """The plan of a workdir with finished runs says which came from other code (the run
  warns as it reuses them) and that --reprobe measures probes again; a finished run whose
  result.json cannot be read is refused when the sweep is built, before any variant
  trains (the run refused it only at that variant's turn)."""
  monkeypatch.setattr(provenance, "running_code_version", lambda: "cafe00000000")
  old = fake_runner(code=lambda variant: "01d000000000" if variant == "b" else "cafe00000000")
  sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), runner=old).run()
  plan = sweep.Sweep(toy_ablation(probe=lambda ctx: {}), "smoke", str(tmp_path),
                     runner=old, reprobe=True).plan().splitlines()
  assert plan[0].endswith("; --reprobe: every finished run's probes are measured again")
  assert plan[1:4] == [
      "  a (baseline): model.num_layers=1; 2 of 2 seeds finished (reused)",
      "  b: model.num_layers=2; 2 of 2 seeds finished (reused), trained by other code "
      "(01d000000000; this checkout: cafe00000000)",
      "  c: model.num_layers=3; 2 of 2 seeds finished (reused)"]
  (tmp_path / "c" / "seed_1" / "result.json").write_text('{"final":')
  with pytest.raises(ConfigError, match=r"c/seed_1/result.json cannot be read"):
    sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), runner=old)


def test_a_misnamed_metric_or_curve_is_refused_before_training(tmp_path):
  """An ablation without probes names finals only; a name its runs will not report (here
  a K that the smoke preset's retrieval config does not evaluate) is refused up front, as
  is a curve that no run logs."""
  ablation = sweep.Ablation(
      name="temperature", doc="x", arms={"t05": {"retrieval.temperature": 0.05},
                                         "t20": {"retrieval.temperature": 0.2}},
      baseline="t05", experiment="retrieval", metrics=("recall@50", "loss", "diverged"))
  with pytest.raises(ValueError, match=r"metrics 'recall@50' \(did you mean 'recall@10'\?\) "
                                       r"are not among its runs' final metrics"):
    sweep.Sweep(ablation, "smoke", str(tmp_path / "sweep"))
  assert not os.path.exists(tmp_path / "sweep")
  fixed = dataclasses.replace(ablation, metrics=("recall@100", "loss", "diverged"),
                              primary_metric=None, headline=())
  # The curves too, whatever the probes: here a ranking run's curve.
  ranking_curve = dataclasses.replace(fixed, curves=("train/loss", "eval/auc_mean"))
  for probed in (ranking_curve, dataclasses.replace(ranking_curve, probe=lambda ctx: {})):
    with pytest.raises(ValueError, match=r"curves 'eval/auc_mean' \(did you mean 'eval/auc'\?\) "
                                         r"are not among its runs' logged metrics"):
      sweep.Sweep(probed, "smoke", str(tmp_path / "sweep"))
  # The defaults follow the experiment; a per-layer curve may name a layer that only a
  # deeper preset has (the smoke model has one).
  assert fixed.curves == ("train/loss", "eval/recall@100")
  plain = sweep.Ablation(name="t", doc="x", arms={"a": {}}, baseline="a", experiment="retrieval")
  assert plain.metrics[:2] == ("recall@100", "recall@10")
  sweep.Sweep(dataclasses.replace(fixed, curves=("train/loss", "train/residual_rms/layer_3")),
              "smoke", str(tmp_path / "sweep"))
  assert not os.path.exists(tmp_path / "sweep")


def test_a_run_error_ends_the_sweep_with_its_message(capsys):
  """What a user can act on (a run directory in use, a damaged file) is one line and
  status 2; anything else keeps its traceback."""
  from phoenix_flax.training import ConfigError, RunInUseError, RunOutputError
  for error in (RunInUseError("/w/a is being trained by another process"),
                RunOutputError("the run's outputs in /w/a cannot be written (No space left "
                               "on device)"),
                ConfigError("/w/a/config.json cannot be read"),
                sweep.SweepError("toy: metrics 'x' are in no run's result.json")):
    with pytest.raises(SystemExit) as e:
      with sweep.exit_on_interrupt():
        raise error
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: {error}\n")
  with pytest.raises(KeyError):
    with sweep.exit_on_interrupt():
      raise KeyError("a bug")


def _absl_mains():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  paths = [os.path.join(root, d, f) for d in ("ablations", "experiments")
           for f in sorted(os.listdir(os.path.join(root, d))) if f.endswith(".py")]
  return [p for p in paths if 'if __name__ == "__main__":' in open(p).read()]


@pytest.mark.parametrize("path", _absl_mains(), ids=os.path.basename)
def test_usage_text_has_no_percent_sign(path):
  """absl's --help %-formats the main module's docstring with the program name: "90%
  random" printed as "90'<path>'andom". Scripts write "percent" instead."""
  doc = ast.get_docstring(ast.parse(open(path).read()), clean=False)
  assert doc and "%" not in doc


def test_sweep_json_records_nan_as_null(tmp_path):
  """A probe that measures NaN is recorded as missing, not a crash after training."""
  path = str(tmp_path / "probes.json")
  sweep.write_json(path, sweep.flatten_metrics({"probe": {"value": float("nan")}, "n": 2}))
  assert json.load(open(path)) == {"probe/value": None, "n": 2.0}


def test_an_interrupted_run_ends_the_sweep_with_its_message_and_status(capsys):
  """A run stopped by SIGTERM (its checkpoint written) ends an ablation script with the
  run's message, how to go on, and the shell's status for that signal."""
  import signal
  from phoenix_flax.training import RunInterrupted
  with pytest.raises(SystemExit) as e:
    with sweep.exit_on_interrupt():
      raise RunInterrupted(signal.SIGTERM, 30, ["/w/full/seed_0", "/w/full/seed_1"])
  assert e.value.code == 143
  err = capsys.readouterr().err
  assert err.startswith("stopped by SIGTERM after step 30, with a checkpoint in /w/full/seed_0, "
                        "/w/full/seed_1; run the same command again to resume\n")
  assert "go on with the sweep" in err
  with sweep.exit_on_interrupt():   # nothing raised: nothing happens
    pass
  with pytest.raises(SystemExit) as e:   # Ctrl-C outside a training loop: one line too
    with sweep.exit_on_interrupt():
      raise KeyboardInterrupt
  assert e.value.code == 130
  assert capsys.readouterr().err.startswith("interrupted by SIGINT while no training chunk")
  twice = KeyboardInterrupt()   # the second signal during training (`_StopRequests`)
  twice.stopped_at_once = True
  with pytest.raises(SystemExit) as e:
    with sweep.exit_on_interrupt():
      raise twice
  assert e.value.code == 130
  assert capsys.readouterr().err.startswith(
      "stopped at once by a second signal (SIGINT) during training, losing the chunk "
      "under way, so no new checkpoint was written")
  previous = signal.getsignal(signal.SIGTERM)
  with pytest.raises(SystemExit) as e:   # SIGTERM there too: the same, not a silent kill
    with sweep.exit_on_interrupt():
      signal.raise_signal(signal.SIGTERM)
  assert e.value.code == 143
  assert capsys.readouterr().err.startswith("interrupted by SIGTERM while no training chunk")
  assert signal.getsignal(signal.SIGTERM) is previous   # restored


def test_exact_counts_are_printed_whole():
  assert report.fmt(22832) == "22832" and report.fmt(-2304, 3) == "-2304"
  assert report.fmt(12345.6) == "12346" and report.fmt(0.123456) == "0.1235"
  assert report.fmt(2.5e6) == "2.50e+06" and report.fmt(1.5e-4) == "1.50e-04"
  assert report.fmt(99999) == "99999" and report.fmt(100000) == "1.00e+05"   # (the bound)
  assert [report.fmt(x) for x in (0.001, -0.001)] == ["0.001", "-0.001"]     # (the other)
  assert report.fmt_ci([0.001, 0.0123]) == "[0.001, 0.0123]"


def test_report_cells_at_their_edges(tmp_path):
  """One pair, a diverged seed, a variant without Bayes values, rows without a Δ: each
  reads what it is."""
  one = stats.mcnemar_exact([0], [1])
  assert report.smallest_p(one) == 1.0
  assert report.verdict(one, "lower") == "not testable: 1 pair gives no exact p below 1.000"
  # A diverged seed is not a missing value: 2 values from the 2 finished runs need no "(n=".
  variant = {"seeds": [0, 1, 2], "diverged": 1, "metrics": {"auc": stats.summarize(
      [0.7, 0.72, None])}}
  assert report._variant_cell(variant, "auc") == report._cell(variant["metrics"]["auc"])
  assert "(n=" not in report._variant_cell(variant, "auc")
  # A finished run without a value is told.
  assert report._variant_cell(dict(variant, diverged=0), "auc").endswith(" (n=2)")
  # A variant that diverged in every seed has no Bayes value; the column stays for the rest.
  results = {"baseline": "a", "experiment": "ranking", "comparisons": [], "variants": {
      "a": {"arm": "a", "cell": "", "seeds": [0, 1], "diverged": 0, "bayes": {"auc": 0.81},
            "metrics": {"auc": stats.summarize([0.7, 0.72])}},
      "b": {"arm": "b", "cell": "", "seeds": [0, 1], "diverged": 2, "bayes": {},
            "metrics": {}}}}
  table = report.metric_table(results, "auc")
  assert "| Bayes-optimal |" in table[0] and " | 0.81 | baseline |" in table[2]
  assert "| b | 2 | 2 | n/a | n/a | n/a |" in table[3]
  # Comparisons without a Δ draw nothing, and leave no plot behind.
  path = str(tmp_path / "effects.png")
  untestable = {"variant": "b", "metric": "auc", "delta": None, "ci95": None, "n": 0,
                "p_value": None}
  assert not report.plot_effects({"baseline": "a", "comparisons": [untestable]}, ["auc"], path)
  assert not os.path.exists(path)


def test_a_one_seed_subset_report_says_what_it_is(tmp_path):
  results = sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), seeds=1, variants=["b"],
                        runner=fake_runner()).run()
  assert results["variants_run"] == ["a", "b"] and list(results["variants"]) == ["a", "b"]
  text = (tmp_path / "REPORT.md").read_text()
  assert "with 1 seed; its verdicts mean nothing" in text
  assert "`auc_mean`: not testable: 1 complete pair (Δ = " in text and "1 pair)." in text
  assert "Variants run: a, b (a subset, chosen with `--variants`" in text
  assert "so with more than one seed the intervals would cover" in text
  assert (tmp_path / "effects.png").stat().st_size > 1000
  full = sweep.Sweep(toy_ablation(), "smoke", str(tmp_path / "full"), runner=fake_runner()).run()
  assert full["variants_run"] is None and full["overrides"] == {}


def test_sweep_files_are_written_by_process_zero_only(tmp_path, monkeypatch):
  """In a multi-host sweep every process runs `Sweep.run`; as `run_experiment` does for a
  run, only process 0 writes results.json, REPORT.md and the plots (the others return the
  same results), so that no two processes write (or clean up) the same files at once."""
  monkeypatch.setattr(jax, "process_index", lambda *args, **kwargs: 1)
  results = sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), seeds=3,
                        runner=fake_runner()).run()
  assert sorted(results["variants"]) == ["a", "b", "c"]
  assert not [f for f in os.listdir(tmp_path) if os.path.isfile(tmp_path / f)]
  monkeypatch.setattr(jax, "process_index", lambda *args, **kwargs: 0)
  sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), seeds=3, runner=fake_runner()).run()
  assert {"results.json", "REPORT.md"} <= set(os.listdir(tmp_path))


def test_ablations_without_matplotlib_name_the_extra():
  """A core install (`pip install phoenix_flax` or `-e .`, no `[ablations]`) running an
  ablation script gets an ImportError naming the extra, not a bare ModuleNotFoundError."""
  out = import_error("ablations.candidate_isolation",
                     "import sys\nsys.modules['matplotlib'] = None\n")
  assert ("ImportError: the ablation scripts need matplotlib (REPORT.md's plots): "
          "pip install -e '.[ablations]'") in out, out


def test_a_variants_bayes_value_is_the_mean_over_its_finished_runs(tmp_path):
  """results.json's "bayes" of a variant: the mean of the Bayes values its finished runs
  report (not the first run's, and not a diverged run's); none when every run diverged,
  and the report's Bayes column then reads n/a."""
  every_c = {("c", seed) for seed in range(3)}
  runner = fake_runner(diverge={("b", 2)} | every_c, bayes=lambda v, seed: 0.8 + 0.01 * seed)
  results = sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), seeds=3, runner=runner).run()
  bayes = {name: v["bayes"] for name, v in results["variants"].items()}
  assert bayes["a"] == {"auc_mean": pytest.approx(0.81)}
  assert bayes["b"] == {"auc_mean": pytest.approx(0.805)}
  assert bayes["c"] == {}
  c_row = next(line for line in report.metric_table(results, "auc_mean")
               if line.startswith("| c |"))
  assert c_row.split(" | ")[4] == "n/a", c_row


def test_flatten_metrics_names_list_items_from_0_and_keeps_numbers_only():
  found = sweep.flatten_metrics({"per_layer": [0.5, 0.7], "probe": {"ok": True, "nan": None},
                                 "count": 3, "name": "text", "nested": [[1.0]]})
  assert found == {"per_layer/0": 0.5, "per_layer/1": 0.7, "probe/ok": 1.0, "probe/nan": None,
                   "count": 3.0, "nested/0/0": 1.0}
  assert type(found["probe/ok"]) is float


def test_load_systems_loads_the_seeds_asked_for_in_their_order(tmp_path, monkeypatch):
  """`Sweep._probe` zips the seeds it asks for with the systems it gets: each must be the
  final checkpoint of that seed's run, in the order asked (every seed when none is)."""
  cfg = sweep.apply_overrides(sweep.preset_config("smoke"),
                              {"num_seeds": 3, "output.seed_subdirs": True})
  seed_of = {d: seed for seed, d in run_dirs(cfg, str(tmp_path)).items()}
  steps = cfg.train.num_steps
  monkeypatch.setattr(sweep, "Trainer", lambda spec: type("T", (), {
      "system": staticmethod(lambda params: int(params))})())
  monkeypatch.setattr(sweep, "checkpoint_like", lambda trainer: None)
  monkeypatch.setattr(sweep.checkpoint, "available_steps",
                      lambda run_dir: [steps] if seed_of[run_dir] != 1 else [steps - 1])
  loaded = []

  def load_checkpoint(trainer, run_dir, step, like):
    loaded.append((seed_of[run_dir], step))
    return type("S", (), {"params": np.int32(seed_of[run_dir])}), None
  monkeypatch.setattr(sweep, "load_checkpoint", load_checkpoint)
  assert sweep.load_systems(cfg, str(tmp_path), [2, 0])[1] == [2, 0]
  assert loaded == [(2, steps), (0, steps)]
  with pytest.raises(FileNotFoundError, match="seed_1 has no final checkpoint"):
    sweep.load_systems(cfg, str(tmp_path))
  assert sweep.load_systems(cfg, str(tmp_path), [0])[1] == [0]


def test_a_missing_metric_says_reprobe_where_probes_were_kept(tmp_path, monkeypatch):
  """A metric in no run: the error suggests --reprobe when a probe or a joint probe kept
  old values, and not in a sweep that has just measured them again (--reprobe)."""
  monkeypatch.setattr(sweep, "load_systems", lambda cfg, d, seeds: (
      type("T", (), {"spec": None, "world": None}), [None] * len(seeds)))
  joint = dict(joint_probe=lambda contexts: [{"speed": 1.0} for _ in contexts])
  single = dict(probe=lambda ctx: {"value": 1.0})
  for name, probe, reprobe, hint in (("joint", joint, False, True),
                                     ("single", single, False, True),
                                     ("again", single, True, False),
                                     ("none", {}, False, False)):
    ab = toy_ablation(metrics=("auc_mean", "sped", "diverged"), **probe)
    sw = sweep.Sweep(ab, "smoke", str(tmp_path / name), runner=fake_runner(), reprobe=reprobe)
    with pytest.raises(sweep.SweepError, match="sped") as error:
      sw.run()
    assert ("run again with --reprobe" in str(error.value)) == hint, name


def test_an_unknown_split_field_points_at_split_config():
  """A field no split has: every split section (train_split too) says a new field needs
  its default in SplitConfig."""
  for section in ("train_split", "eval_split"):
    with pytest.raises(ValueError, match="its default in SplitConfig") as error:
      sweep.apply_overrides(sweep.preset_config("smoke"), {f"{section}.zzz": 1})
    assert f"{section}.zzz" in str(error.value)


def test_the_plan_marks_the_baseline_in_every_condition(tmp_path):
  plan = sweep.Sweep(toy_ablation(conditions=lr_conditions), "smoke", str(tmp_path),
                     runner=fake_runner()).plan().splitlines()
  marked = sorted(line.split(" ")[2].rstrip(":") for line in plan
                  if line.startswith("  ") and " (baseline):" in line)
  assert marked == ["a_hi", "a_lo"]


def test_report_words_one_run_and_one_batch_in_the_singular():
  line = report.environment_line({"code": "cafe", "run_codes": {"01d0": 1, "cafe": 3}})
  assert "the runs were trained by: 01d0 (1 run), cafe (3 runs);" in line
  t = {"num_steps": 20, "batch_size": 8, "eval_batches": 1, "eval_batch_size": 64,
       "eval_lists": 64, "eval_seed": 1}
  design = "\n".join(report.design_lines({"training": t, "seeds": [0, 1]}))
  assert "Evaluation: 64 lists per split (1 batch of 64)" in design
  t.update(eval_batches=2, eval_lists=128)
  design = "\n".join(report.design_lines({"training": t, "seeds": [0, 1]}))
  assert "Evaluation: 128 lists per split (2 batches of 64)" in design


def test_curves_skip_non_finite_values_and_name_each_arm_once(tmp_path, drawn_figures):
  """A diverging run's inf or NaN loss is left out of its curve (it would stretch the
  axis to nothing); the legend has one entry per arm, not one per seed."""
  rows = [{"step": 1, "k": 0.5}, {"step": 2, "k": float("inf")}, {"step": 3, "k": float("nan")},
          {"step": 4}, {"step": 5, "k": 2}]
  assert report.curve(rows, "k") == ([1, 5], [0.5, 2])
  variants = {arm: {"arm": arm, "cell": "", "seeds": [0, 1, 2]} for arm in ("a", "b")}
  for arm in variants:
    for seed in range(3):
      run = tmp_path / arm / f"seed_{seed}"
      run.mkdir(parents=True)
      (run / "metrics.jsonl").write_text("".join(
          json.dumps({"step": k, "train/loss": 1.0 / k + seed}) + "\n" for k in (1, 2, 3)))
  assert report.plot_curves({"variants": variants, "arms": ["a", "b"]}, str(tmp_path),
                            ["train/loss"], "unused.png")
  legend = drawn_figures[0].axes[0].get_legend()
  assert [text.get_text() for text in legend.get_texts()] == ["a", "b"]


def test_effects_plot_lists_its_rows_top_down_in_the_tables_order(drawn_figures):
  comps = [{"variant": v, "baseline": "a", "metric": "auc", "delta": d, "ci95": [d - .01, d + .01],
            "p_value": 0.5, "p_holm": 0.5, "n": 3, "test": "paired t"}
           for v, d in (("b", 0.1), ("c", 0.2), ("d", 0.3))]
  assert report.plot_effects({"baseline": "a", "comparisons": comps}, ["auc"], "unused.png")
  ax = drawn_figures[0].axes[0]
  y = dict(zip((label.get_text() for label in ax.get_yticklabels()), ax.get_yticks()))
  assert y["b"] > y["c"] > y["d"], y   # the first row on top


def _one_variant_results(**extra):
  found = {"ablation": "x", "preset": "cpu", "baseline": "a", "primary_metric": "m",
           "metrics": ["m"], "comparisons": [], "seeds": [0],
           "variants": {"a": {"arm": "a", "cell": "", "seeds": [0], "diverged": 0,
                              "metrics": {"m": {"mean": 0.5, "ci95": None, "n": 1}}}}}
  return {**found, **extra}


def test_report_text_at_its_edges():
  """Zero pairs in the plural; a verdict section without comparisons says so; a half-width
  of exactly 1e-5 stays fixed-point (scientific only under it); a smoke report without
  recorded seeds says "few seeds"; no report has a double blank line."""
  assert (report.verdict({"p_value": None, "delta": None, "n": 0}, "higher")
          == "not testable: 0 complete pairs")
  assert (report.verdict({"p_value": None, "delta": None, "n": 1}, "higher")
          == "not testable: 1 complete pair")
  results = _one_variant_results()
  assert report.headline_lines(results) == [
      "- No comparison with the baseline could be computed."]
  text = report.markdown(results)
  assert "## Verdict\n\n- No comparison with the baseline could be computed.\n" in text
  assert report.rendered_lines([results]) == [] and "\n\n\n" not in text
  assert report.fmt_pm(0.5, 1e-5) == "0.500000 ± 0.000010"
  assert report.fmt_pm(0.5, 9.9e-6) == "0.5 ± 9.9e-06"
  results = _one_variant_results(preset="smoke")
  del results["seeds"]   # a results.json from before seeds were recorded
  text = report.markdown(results)
  assert "(near chance) with few seeds;" in text and "0 seeds" not in text


def test_curves_grid_is_four_panels_wide(tmp_path, drawn_figures):
  variants = {f"{arm}_{cell}": {"arm": arm, "cell": cell, "seeds": [0]}
              for cell in ("c1", "c2", "c3", "c4") for arm in ("a", "b")}
  for name in variants:
    run = tmp_path / name / "seed_0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": k, "train/loss": 1.0 / k, "eval/auc": 0.5}) + "\n" for k in (1, 2)))
  assert report.plot_curves({"variants": variants, "arms": ["a", "b"]}, str(tmp_path),
                            ["train/loss", "eval/auc"], "unused.png")
  grid = drawn_figures[0].axes[0].get_subplotspec().get_gridspec().get_geometry()
  assert grid == (2, 4)   # 8 panels: 4 a row


def test_effects_plot_colours_titles_and_panel_limit(drawn_figures):
  """Significant intervals red, others gray; "hollow = no CI" in the title only where a
  row has no CI; at most MAX_EFFECT_PANELS (6) metrics drawn."""
  tested = {"variant": "b", "metric": "auc", "delta": 0.1, "ci95": [0.05, 0.15], "n": 5,
            "p_value": 0.001, "p_holm": 0.002, "test": "paired t"}
  for p_holm, colour in ((0.002, "tab:red"), (0.5, "tab:gray")):
    drawn_figures.clear()
    assert report.plot_effects({"baseline": "a", "comparisons": [dict(tested, p_holm=p_holm)]},
                               ["auc"], "unused.png")
    assert drawn_figures[0].axes[0].get_lines()[0].get_color() == colour
    assert "hollow" not in drawn_figures[0]._suptitle.get_text()
  exact = {"variant": "b", "metric": "diverged", "delta": -1.0, "ci95": None, "n": 8,
           "p_value": 0.008, "p_holm": 0.016, "test": "exact McNemar"}
  drawn_figures.clear()
  assert report.plot_effects({"baseline": "a", "comparisons": [exact]}, ["diverged"],
                             "unused.png")
  assert drawn_figures[0]._suptitle.get_text().endswith("; hollow = no CI)")
  metrics = [f"m{i}" for i in range(7)]
  comps = [dict(tested, metric=m, p_holm=0.5) for m in metrics]
  drawn_figures.clear()
  assert report.plot_effects({"baseline": "a", "comparisons": comps}, metrics, "unused.png")
  titles = [ax.get_title() for ax in drawn_figures[0].axes if ax.get_title()]
  assert report.MAX_EFFECT_PANELS == 6
  assert titles == [f"Δ m{i}" for i in range(6)]


def test_an_extra_plot_that_draws_nothing_is_not_linked(tmp_path):
  with open(os.path.join(REPO, "docs", "results", "gqa_ratio", "results.json")) as f:
    results = json.load(f)
  path = report.write_report(results, str(tmp_path), extra_plots=[lambda r, w: None])
  with open(path) as f:
    plots = [line for line in f.read().splitlines() if line.startswith("![")]
  assert plots == ["![effects](effects.png)"]


def test_run_all_takes_a_folder_where_another_registered_ablation_left_runs(tmp_path,
                                                                          monkeypatch):
  """A run_all stopped during one ablation's sweep, before the combined report: the
  folder still takes a run_all of another ablation (the runs are a registered one's)."""
  monkeypatch.setattr(run_all, "ABLATIONS", {"toy": toy_ablation(),
                                             "toy2": toy_ablation(name="toy2")})
  fake_sweep(toy_ablation(), str(tmp_path / "toy")).run()
  run_all.run_all(["toy2"], run_all.make_sweeps(["toy2"], str(tmp_path), make_sweep=fake_sweep),
                  str(tmp_path))
  assert set(json.loads((tmp_path / "results.json").read_text())) == {"toy2"}


def test_run_all_refuses_a_report_that_files_another_ablation_under_a_name(tmp_path,
                                                                         monkeypatch):
  monkeypatch.setattr(run_all, "ABLATIONS", {"toy": toy_ablation()})
  (tmp_path / "results.json").write_text('{"toy": {"ablation": "toy2", "variants": {}}}\n')
  with pytest.raises(ValueError, match="results.json is not ablations.run_all's"):
    run_all.make_sweeps(["toy"], str(tmp_path), make_sweep=fake_sweep)


def test_run_all_writes_the_combined_report_on_process_zero_only(tmp_path, monkeypatch):
  monkeypatch.setattr(run_all, "ABLATIONS", {"toy": toy_ablation()})
  monkeypatch.setattr(jax, "process_index", lambda *args, **kwargs: 1)
  run_all.run_all(["toy"], run_all.make_sweeps(["toy"], str(tmp_path), make_sweep=fake_sweep),
                  str(tmp_path))
  assert not [f for f in os.listdir(tmp_path) if os.path.isfile(tmp_path / f)]


def test_run_all_keeps_the_temporary_files_of_live_writers(tmp_path, monkeypatch):
  monkeypatch.setattr(run_all, "ABLATIONS", {"toy": toy_ablation()})
  live = subprocess.Popen(["sleep", "60"])
  try:
    busy = tmp_path / f".results.json.tmp.{live.pid}"
    busy.write_text("being written")
    run_all.run_all(["toy"], run_all.make_sweeps(["toy"], str(tmp_path), make_sweep=fake_sweep),
                    str(tmp_path))
    assert busy.exists()
  finally:
    live.kill()
    live.wait()


def test_run_all_cli_refuses_stray_arguments_and_unknown_ablations(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  workdir = tmp_path / "sweep"
  taken = tmp_path / "taken"
  taken.mkdir()
  (taken / "gqa_ratio").write_text("")   # an ablation's folder that is a file
  cases = [([f"--workdir={workdir}", "stray"], "error: unexpected arguments: ['stray']\n"),
           ([f"--workdir={workdir}", "--ablations=nope"], "error: --ablations: unknown ['nope']"),
           ([f"--workdir={taken}", "--ablations=gqa_ratio"], "is a file, not a directory\n"
                                                            "Run with --helpfull")]
  with ForkServer(env, preload=["ablations.sweep"]) as server:
    for args, message in cases:   # --dry_run: a mutant that accepts them trains nothing
      code, _, stderr = server.run("ablations.run_all", ["--preset=smoke", "--dry_run", *args])
      assert code == 2 and message in stderr and "Traceback" not in stderr, (args, stderr)
  assert not workdir.exists()


def test_rope_anchoring_task_at_a_history_of_one(tmp_path):
  sw = sweep.Sweep(rope_anchoring.ABLATION, "smoke", str(tmp_path / "r"),
                   overrides={"world.history_len": 1}, runner=fake_runner())
  long = sw.base.extra_eval_splits.long_history
  assert (long.min_history, long.max_history) == (1, 1)


def test_soft_capping_full_preset_sweeps_both_dtypes():
  """Its docstring: float32 and bfloat16 at the full preset, bfloat16 only at cpu."""
  dtypes = lambda preset: {v.overrides["model.fprop_dtype"]
                           for v in soft_capping.ABLATION.variants(preset)}
  assert dtypes("full") == {"float32", "bfloat16"} and dtypes("cpu") == {"bfloat16"}


def test_default_seed_counts_are_the_ones_the_flag_help_states():
  """--seeds left out: 2 seeds at smoke, 3 at cpu, 5 at full, as `--help` says."""
  assert sweep.SEEDS == {"smoke": 2, "cpu": 3, "full": 5}
  counts = ", ".join(f"{n} {preset}" for preset, n in sweep.SEEDS.items())
  assert f"(default: {counts})" in sweep.FLAGS["seeds"].help


@pytest.mark.parametrize("experiment", sorted(sweep.EXPERIMENTS))
def test_no_sweep_preset_pays_for_score_consistency(experiment):
  """Score consistency costs two extra forwards per evaluation batch: every sweep preset
  turns it off (the ranking config's full preset has it on); only an ablation that
  reports it turns it back on."""
  for preset in sweep.PRESETS:
    assert sweep.preset_config(preset, experiment).train.score_consistency is False, preset


def test_a_diverged_primary_metric_heads_the_report_once():
  ab = toy_ablation(metrics=("diverged", "auc_mean"), primary_metric="diverged")
  assert ab.headline == ("diverged",)


def test_an_override_value_padded_with_spaces_reads_as_without_them():
  """`--override "model.right_anchored_rope= false "` (a quoted shell variable) sets the
  boolean, as "=false" does, and "=none " sets None: not the strings " false "/"none "."""
  assert sweep.parse_override("model.right_anchored_rope= false ") == (
      "model.right_anchored_rope", False)
  assert sweep.parse_override("model.attn_logit_cap= none ") == ("model.attn_logit_cap", None)
  assert sweep.parse_override(" model.norm_layout = pre ") == ("model.norm_layout", "pre")


def test_results_json_keeps_the_designs_order(tmp_path):
  """results.json lists the variants (and its fields) in the order the sweep made them,
  arms within each condition level, which `ablations.rerender` renders the tables in."""
  results = sweep.Sweep(toy_ablation(conditions=lr_conditions), "smoke", str(tmp_path),
                        runner=fake_runner()).run()
  on_disk = json.loads((tmp_path / "results.json").read_text())
  assert list(on_disk["variants"]) == ["a_lo", "b_lo", "c_lo", "a_hi", "b_hi", "c_hi"]
  assert list(on_disk) == list(results)
  assert list(on_disk["variants"]["a_lo"]["metrics"]) == list(toy_ablation().metrics)


@pytest.mark.parametrize("text", ["[1, 2]\n", '"text"\n', "3\n"])
def test_a_sweep_replaces_a_results_json_that_is_no_object(tmp_path, text):
  """A results.json damaged from outside into JSON of another kind (not only `[]`) is
  replaced, not an AttributeError when the sweep is built."""
  (tmp_path / "results.json").write_text(text)
  assert sweep.previous_results(str(tmp_path)) == {}
  sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), runner=fake_runner()).run()
  assert json.loads((tmp_path / "results.json").read_text())["ablation"] == "toy"


def test_an_empty_results_object_is_not_the_sweeps_own(tmp_path):
  """`{}` is a JSON object that no sweep wrote: refused like another tool's results.json."""
  (tmp_path / "results.json").write_text("{}\n")
  with pytest.raises(ValueError, match="results.json is not the toy sweep's"):
    sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), runner=fake_runner())
  assert (tmp_path / "results.json").read_text() == "{}\n"


def test_a_killed_sweep_resumes_with_a_variants_subset(tmp_path):
  """A sweep killed before its first report left runs of every variant and no
  results.json: resuming it with --variants is not refused for the runs of its own
  variants left out (they are its design's, not another sweep's)."""
  sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), runner=fake_runner()).run()
  for name in ("results.json", "REPORT.md"):
    (tmp_path / name).unlink()
  results = sweep.Sweep(toy_ablation(), "smoke", str(tmp_path), variants=["b"],
                        runner=fake_runner()).run()
  assert results["variants_run"] == ["a", "b"]


def test_probes_measured_again_reach_tensorboard(tmp_path, monkeypatch):
  """--reprobe (after a probe changed) rewrites each run's TensorBoard copy of its probes
  with the new values, which results.json reports: not the first measurement's."""
  monkeypatch.setattr(sweep, "load_systems", lambda cfg, d, seeds: (
      type("T", (), {"spec": None, "world": None}), [None] * len(seeds)))
  measured = [0.0]
  ab = toy_ablation(probe=lambda ctx: {"value": measured[0]},
                    metrics=("auc_mean", "value", "diverged"))
  sweep.Sweep(ab, "smoke", str(tmp_path), runner=fake_runner()).run()
  measured[0] = 1.0
  results = sweep.Sweep(ab, "smoke", str(tmp_path), runner=fake_runner(), reprobe=True).run()
  assert results["variants"]["a"]["metrics"]["value"]["per_seed"] == [1.0, 1.0]
  assert _probe_scalars(tmp_path / "a" / "seed_0", "probes") == {"value": [(20, 1.0)]}


def test_a_subset_reports_the_arms_it_ran(tmp_path):
  """results.json's "arms" of a --variants subset are the arms run: the per-condition
  table has no row of n/a for an arm left out."""
  results = sweep.Sweep(toy_ablation(conditions=lr_conditions), "smoke", str(tmp_path),
                        variants=["b"], runner=fake_runner()).run()
  assert results["arms"] == ["a", "b"]
  rows = report.condition_matrix(results, "auc_mean")[2:]
  assert [row.split(" | ")[0] for row in rows] == ["| b"]


def test_an_ablations_direction_for_a_full_metric_name_wins():
  """An ablation's entry for one split's metric, named in full, wins over the built-in
  direction of the metric's short name."""
  assert sweep.better("long_list/auc_mean", {"long_list/auc_mean": "lower"}) == "lower"
  assert sweep.better("long_list/auc_mean", {"auc_mean": "lower"}) == "lower"
  assert sweep.better("long_list/auc_mean") == "higher"


def test_the_hypothesis_is_the_first_paragraph_and_the_hypothesis_paragraph():
  doc = "Title line.\n\nHypothesis: it helps.\n\nTask knobs: x.\n\nHypothesis: again."
  assert sweep.hypothesis(doc) == "Title line.\n\nHypothesis: it helps.\n\nHypothesis: again."
  assert sweep.design(doc) == "Task knobs: x."
  for module in SCRIPTS:   # each script's report opens with its hypothesis
    assert "Hypothesis:" in sweep.hypothesis(module.__doc__), module.__name__


def test_a_retrieval_evaluation_logs_its_largest_k(caplog):
  """The recall at the largest K by number (10 over 5, not the larger string)."""
  from phoenix_flax.training import Progress
  caplog.set_level("INFO")
  sweep._log_evaluation(Progress(20, 40, 5.0, 1.0, (0.4,), 0,
                                 {"eval/recall@5": [0.2], "eval/bayes_recall@5": [0.3],
                                  "eval/recall@10": [0.4], "eval/bayes_recall@10": [0.5]}))
  assert [r.getMessage() for r in caplog.records] == [
      "  step 20/40 | train loss 0.4000 | eval/recall@10 0.4000 | "
      "eval/bayes_recall@10 0.5000"]


def test_an_ablation_script_refuses_a_positional_argument(tmp_path):
  """A stray argument (a flag's value after a space: `--preset smoke`) is a usage error,
  not silently ignored."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  with ForkServer(env, preload=["ablations.sweep"]) as server:
    code, _, stderr = server.run("ablations.gqa_ratio", ["--preset=smoke", "--dry_run",
                                                         f"--workdir={tmp_path / 'w'}", "stray"])
  assert code == 2 and stderr.startswith("error: unexpected arguments: ['stray']"), stderr
  assert not (tmp_path / "w").exists()
