"""REPORT.md and PNG plots from a sweep's results.json (see `ablations.sweep`).

Meant to be read in a minute: the verdict in plain sentences, one table per headline
metric (value per variant, paired difference to the baseline with its CI and p-value, a
verdict), a table of the other metrics, then the training curves (from each run's
metrics.jsonl) and the effect sizes with their 95% confidence intervals.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Mapping, Optional, Sequence

try:
  import matplotlib
  from matplotlib.figure import Figure
  from matplotlib.ticker import MaxNLocator
except ImportError as e:  # matplotlib comes with the [ablations] extra, not the core
  _missing = isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "matplotlib"
  raise ImportError(
      "the ablation scripts need matplotlib (REPORT.md's plots): pip install -e '.[ablations]'"
      + ("" if _missing else f"; importing the installed matplotlib failed: {e}")) from e

from phoenix_flax.training.runner import seed_dir
from phoenix_flax.training.writers import atomic_file, read_metrics

ALPHA = 0.05
MAX_CURVE_PANELS = 24   # (sandwich_norm at the full preset: 9 cells x 2 curves)
MAX_EFFECT_PANELS = 6


def write_atomic(path: str, text: str) -> None:
  """Writes `text` to `path` atomically (`writers.atomic_file`)."""
  with atomic_file(path) as f:
    f.write(text)


def figure(rows: int, cols: int, figsize: tuple[float, float]):
  """(figure, 2-D array of axes) rendered by Agg, without pyplot's global state (so
  importing this module changes no notebook's backend)."""
  fig = Figure(figsize=figsize, layout="constrained")
  return fig, fig.subplots(rows, cols, squeeze=False)


def save_figure(fig, path: str) -> None:
  """Saves a figure as PNG atomically."""
  with atomic_file(path, "wb") as f:
    fig.savefig(f, format="png", dpi=110, bbox_inches="tight")


def fmt(value: Optional[float], digits: int = 4) -> str:
  """`digits` significant digits (scientific outside [1e-3, 1e5); from 10**digits to 1e5
  rounded to a whole number, and 99999.9 reads "100000"), whole numbers below 1e5 in full
  (a count, a byte size), or "n/a"."""
  if value is None:
    return "n/a"
  if value == 0:
    return "0"
  if abs(value) < 1e5 and float(value).is_integer():
    return f"{int(value)}"
  if 1e-3 <= abs(value) < 1e5:
    text = f"{value:.{digits}g}"
    # `g` turns to an exponent at 10**digits (12345 -> "1.234e+04"); a rounded whole
    # number reads better there.
    return f"{round(value):d}" if "e" in text else text
  return f"{value:.{max(digits - 2, 1)}e}"


def fmt_ci(ci: Optional[Sequence[float]]) -> str:
  return "n/a" if ci is None else f"[{fmt(ci[0], 3)}, {fmt(ci[1], 3)}]"


def fmt_p(p: Optional[float]) -> str:
  """3 decimals, or more where 3 would put p on the other side of 0.05 than it is (0.0496,
  not "0.050" beside "significantly")."""
  if p is None:
    return "n/a"
  if p < 1e-3:
    return "<0.001"
  digits = 3
  while digits < 9 and (float(f"{p:.{digits}f}") < ALPHA) != (p < ALPHA):
    digits += 1
  return f"{p:.{digits}f}"


def p_phrase(label: str, p: Optional[float]) -> str:
  """"p = 0.214", "p < 0.001" or "p = n/a"."""
  text = fmt_p(p)
  return f"{label} < 0.001" if text == "<0.001" else f"{label} = {text}"


def deterministic(comparison: Mapping) -> bool:
  """A nonzero difference that every seed gave exactly (a parameter count, a cache size):
  `stats.paired_t` records it with a zero-width CI and p = 0. Nothing was tested."""
  ci = comparison.get("ci95")
  return (bool(comparison.get("delta")) and comparison.get("p_value") == 0.0
          and ci is not None and ci[0] == ci[1])


def smallest_p(comparison: Mapping) -> Optional[float]:
  """The smallest p the row's exact test could give with its n pairs whatever they held,
  2**(1 - n): McNemar's for `diverged`, the sign-flip test of a pooled `diverged` or of a
  metric whose pairs all moved by the same amount (`stats.paired_t`). None for a t-test
  or a row without pairs."""
  test = comparison.get("test") or ""
  n = comparison.get("n") or 0
  if n < 1 or not test.startswith(("exact McNemar", "sign-flip permutation")):
    return None
  return 2.0 ** (1 - n)


def significant(comparison: Mapping) -> bool:
  """Holm-adjusted p < 0.05 (raw p when no adjustment is recorded); never for a
  `deterministic` difference, which is exact rather than tested."""
  p = comparison.get("p_holm", comparison.get("p_value"))
  return (p is not None and p < ALPHA and bool(comparison.get("delta"))
          and not deterministic(comparison))


def verdict(comparison: Mapping, better: Optional[str]) -> str:
  """Plain reading of one comparison."""
  n = comparison.get("n") or 0
  if comparison.get("p_value") is None or comparison.get("delta") is None:
    return f"not testable: {n} complete pair{'' if n == 1 else 's'}"
  side = "higher" if comparison["delta"] > 0 else "lower"
  judged = "" if better is None else f" ({'better' if side == better else 'worse'})"
  if deterministic(comparison):
    return f"{side}{judged} in every seed alike (exact, not a test)"
  if not significant(comparison):
    floor = smallest_p(comparison)
    if floor is not None and floor >= ALPHA:
      return (f"not testable: {n} pair{' gives' if n == 1 else 's give'} no exact p "
              f"below {fmt_p(floor)}")
    return "no significant difference"
  return f"significantly {side}{judged}"


def headline_lines(results: Mapping) -> list[str]:
  """One sentence per headline comparison: pooled over conditions when the sweep has
  them, per variant otherwise."""
  better = results.get("better", {})

  def scope(c: Mapping) -> tuple[str, str]:
    n = c.get("n") or 0
    plural = "" if n == 1 else "s"
    if "conditions" not in c:
      return "", f"{n} pair{plural}"
    return (f" (pooled: per seed, the mean over {c['conditions']} conditions)",
            f"{n} seed{plural}")

  def figures(c: Mapping) -> str:
    if deterministic(c):
      return f"Δ = {fmt(c['delta'])}"
    return (f"Δ = {fmt(c['delta'])}, unadjusted 95% CI {fmt_ci(c['ci95'])}, "
            f"{p_phrase('p', c['p_value'])}, {p_phrase('Holm p', c.get('p_holm'))}")

  lines = [f"- **{c['variant']}** vs **{c['baseline']}**{scope(c)[0]}, `{c['metric']}`: "
           f"{verdict(c, better.get(c['metric']))} ({figures(c)}, {scope(c)[1]})."
           for c in headline_comparisons(results)]
  return lines or ["- No comparison with the baseline could be computed."]


def short_verdict(comparison: Mapping, results: Mapping) -> str:
  """"+0.026 (p <0.001) *": the difference, its p-value, a star when significant; for
  `diverged`, the divergence counts of the variant and of its baseline."""
  star = " *" if significant(comparison) else ""
  if comparison["metric"] == "diverged":
    runs = lambda name: (results["variants"][name]["diverged"],
                         len(results["variants"][name]["seeds"]))
    (k, n), (kb, nb) = runs(comparison["variant"]), runs(comparison["baseline"])
    return f"{k}/{n} vs {kb}/{nb} (p {fmt_p(comparison['p_value'])}){star}"
  if comparison.get("delta") is None:
    return "n/a"
  if deterministic(comparison):
    return f"{comparison['delta']:+.3g} (exact)"
  delta = "0" if comparison["delta"] == 0 else f"{comparison['delta']:+.3g}"
  return f"{delta} (p {fmt_p(comparison['p_value'])}){star}"


def condition_matrix(results: Mapping, metric: str) -> list[str]:
  """Markdown table of one metric's difference to the baseline, arm x condition level
  (a star marks significance after the Holm correction); empty without conditions."""
  cells = list(dict.fromkeys(v["cell"] for v in results["variants"].values()))
  if len(cells) < 2:
    return []
  comps = {(results["variants"][c["variant"]]["arm"], results["variants"][c["variant"]]["cell"]):
           c for c in results.get("comparisons", []) if c["metric"] == metric}
  arms = [a for a in results["arms"] if a != results["baseline"]]
  head = "diverged runs" if metric == "diverged" else f"Δ `{metric}`"
  rows = [f"| {head} | " + " | ".join(cells) + " |", "| --- |" + " --- |" * len(cells)]
  return rows + [f"| {arm} | " + " | ".join(short_verdict(comps[(arm, cell)], results)
                                             if (arm, cell) in comps else "n/a"
                                             for cell in cells) + " |" for arm in arms]


def interaction_matrix(results: Mapping, metric: str) -> list[str]:
  """Markdown table of one metric's interactions (`analysis.interactions`): per arm, how much
  its difference to the baseline changes from an axis's first level to each other level
  (a star marks significance after the Holm correction); empty when there are none
  (no conditions, one level per axis, or a results.json from before they were computed)."""
  rows = [r for r in results.get("interactions") or () if r["metric"] == metric]
  if not rows:
    return []
  columns = list(dict.fromkeys((r["axis"], r["level"], r["reference"]) for r in rows))
  found = {(r["arm"], r["axis"], r["level"]): r for r in rows}
  arms = list(dict.fromkeys(r["arm"] for r in rows))
  head = [f"| ΔΔ `{metric}` | " + " | ".join(f"{level} − {ref}" for _, level, ref in columns)
          + " |", "| --- |" + " --- |" * len(columns)]
  return head + [f"| {arm} | " + " | ".join(
      short_verdict(found[(arm, axis, level)], results) if (arm, axis, level) in found
      else "n/a" for axis, level, _ in columns) + " |" for arm in arms]


def interaction_lines(results: Mapping, metrics: Sequence[str]) -> list[str]:
  """The interaction tables of `metrics` under their explanation; empty without any."""
  matrices = [interaction_matrix(results, metric) for metric in metrics]
  tables = [line for m in matrices if m for line in m + [""]]
  if not tables:
    return []
  return ["Does the difference depend on the condition? Each cell: the arm's Δ at a level "
          "minus its Δ at the axis's first level, per seed (averaged over the other axes' "
          "levels), and its p-value from a paired t-test over seeds; * = significant after "
          "the Holm correction:", ""] + tables


def _variant_cell(variant: Mapping, metric: str) -> str:
  """A variant's value of `metric`: the count of diverged runs for `diverged` (a 0/1
  metric whose t-interval over a few seeds would read "0 ± 0"), else mean ± CI."""
  if metric == "diverged":
    return f"{variant['diverged']}/{len(variant['seeds'])}"
  summary = variant["metrics"].get(metric)
  runs = len(variant["seeds"]) - variant["diverged"]
  if summary and summary.get("ci95") is not None and summary["n"] < runs:
    # a finished run whose value is undefined (NaN, stored as null) is left out
    return f"{_cell(summary)} (n={summary['n']})"
  return _cell(summary)


def _cell(summary: Optional[Mapping]) -> str:
  if not summary or summary.get("mean") is None:
    return "n/a"
  if summary.get("ci95") is None:
    return f"{fmt(summary['mean'])} (n={summary['n']})"
  half = (summary["ci95"][1] - summary["ci95"][0]) / 2
  return fmt_pm(summary["mean"], half)


def fmt_pm(mean: float, half: float) -> str:
  """"mean ± half": the half-width to 2 significant digits and the mean to the same
  decimal place, so that no digit shown is finer than the interval resolves. Scientific
  notation (as `fmt`) for a half-width under 1e-5 (more than 6 decimals) or a mean of 1e5
  or more; a zero half-width (every seed equal) keeps the mean's 4 significant digits."""
  if half == 0:
    return f"{fmt(mean)} ± 0"
  if not (math.isfinite(mean) and math.isfinite(half)) or half < 1e-5 or abs(mean) >= 1e5:
    return f"{fmt(mean)} ± {fmt(half, 2)}"
  decimals = 1 - math.floor(math.log10(half))   # negative: rounds to tens, hundreds, ...
  if abs(round(half, decimals)) >= 10 ** (2 - decimals):   # rounding added a digit (0.0996)
    decimals -= 1
  text = lambda x: f"{round(x, decimals) + 0.0:.{max(decimals, 0)}f}"   # + 0.0: no "-0.00"
  return f"{text(mean)} ± {text(half)}"


def _experiment(results: Mapping) -> str:
  """The sweep's experiment; for a results.json from before it was recorded, "retrieval"
  when a variant holds the Bayes value of `auc`, which only retrieval runs report."""
  if "experiment" in results:
    return results["experiment"]
  return ("retrieval" if any("auc" in v.get("bayes", {}) for v in results["variants"].values())
          else "ranking")


def metric_table(results: Mapping, metric: str) -> list[str]:
  """Markdown rows: value per variant, the generator's Bayes-optimal value beside it when
  the runs report one (its oracle on the same evaluation lists: a ceiling for the ranking
  metrics, a reference that a model can exceed for retrieval's `bayes_recall@K`), and the
  paired difference to the baseline."""
  comps = {c["variant"]: c for c in results.get("comparisons", []) if c["metric"] == metric}
  better = results.get("better", {}).get(metric)
  ceiling = any(metric in v.get("bayes", {}) for v in results["variants"].values())
  oracle = ("Bayes oracle (a reference) " if _experiment(results) == "retrieval"
            else "Bayes-optimal ")
  rows = [f"| variant | runs | diverged | `{metric}` (mean ± 95% CI) "
          + (f"| {oracle}" if ceiling else "")
          + "| Δ vs baseline [unadjusted 95% CI] | p | Holm p | verdict |",
          "| --- | --- | --- | --- " + ("| --- " if ceiling else "")
          + "| --- | --- | --- | --- |"]
  for name, v in results["variants"].items():
    head = f"| {name} | {len(v['seeds'])} | {v['diverged']} | {_variant_cell(v, metric)}"
    if ceiling:
      head += f" | {fmt(v.get('bayes', {}).get(metric))}"
    c = comps.get(name)
    if v["arm"] == results["baseline"]:
      rows.append(f"{head} | baseline | | | |")
    elif c is None:
      rows.append(f"{head} | n/a | | | |")
    elif deterministic(c):
      rows.append(f"{head} | {fmt(c['delta'])} (exact) | | | {verdict(c, better)} |")
    else:
      rows.append(f"{head} | {fmt(c['delta'])} {fmt_ci(c['ci95'])} | {fmt_p(c['p_value'])} "
                  f"| {fmt_p(c.get('p_holm'))} | {verdict(c, better)} |")
  return rows


def _narrow_table(names: Sequence[str], metrics: Sequence[str], cell: Callable[[str, str], str],
                  corners: tuple[str, str], prefix: str = "") -> list[str]:
  """A row per name and a column per metric (headed `prefix` + the metric), or the metrics
  down the rows when there are more of them than names: a narrow table either way.
  `corners`: the top-left header of the two layouts (names down, metrics down)."""
  if len(metrics) > len(names):
    rows = [f"| {corners[1]} | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    return rows + [f"| `{m}` | " + " | ".join(cell(n, m) for n in names) + " |"
                   for m in metrics]
  rows = [f"| {corners[0]} | " + " | ".join(f"{prefix}`{m}`" for m in metrics) + " |",
          "| --- |" + " --- |" * len(metrics)]
  return rows + [f"| {n} | " + " | ".join(cell(n, m) for m in metrics) + " |" for n in names]


def other_metrics_table(results: Mapping, metrics: Sequence[str]) -> list[str]:
  """Means of `metrics` per variant (a narrow table)."""
  variants = results["variants"]
  return _narrow_table(list(variants), metrics,
                       lambda name, m: _variant_cell(variants[name], m),
                       ("variant", "metric"))


def other_differences_table(results: Mapping, metrics: Sequence[str]) -> list[str]:
  """Paired differences of `metrics` to the baseline, as the verdict pairs them (pooled
  over conditions when the sweep has any, per variant otherwise): "Δ [unadjusted 95% CI]
  (Holm p)",
  a star when significant. Empty when none could be computed."""
  metrics = [m for m in metrics if m != "diverged"]   # its counts are in the tables above
  comps = {(c["variant"], c["metric"]): c for c in verdict_comparisons(results)
           if c["metric"] in metrics}
  names = list(dict.fromkeys(variant for variant, _ in comps))
  if not names:
    return []

  def cell(name: str, metric: str) -> str:
    c = comps.get((name, metric))
    if c is None or c.get("delta") is None:
      return "n/a"
    if deterministic(c):
      return f"{fmt(c['delta'], 3)} (exact: the same in every seed)"
    star = " *" if significant(c) else ""
    pairs = f", {c['n']} pairs" if c["n"] < len(results["seeds"]) else ""   # runs left out
    return (f"{fmt(c['delta'], 3)} {fmt_ci(c['ci95'])} (Holm p {fmt_p(c.get('p_holm'))}"
            f"{pairs}){star}")

  return _narrow_table(names, metrics, cell, ("vs baseline", "Δ vs baseline"), prefix="Δ ")


def preset_note(preset: str, seeds: Optional[int] = None) -> list[str]:
  """A warning under the title of a smoke-preset report: its runs are too short to learn
  and its `seeds` (None: not one count) too few for any difference to be significant."""
  if preset != "smoke":
    return []
  n = "few seeds" if seeds is None else f"{seeds} seed{'' if seeds == 1 else 's'}"
  return ["> **Smoke preset: a check that the sweep runs end to end, not evidence.** Its "
          f"runs train for a few steps (near chance) with {n}; its verdicts mean nothing, "
          "the *significant* ones included (runs this short can differ by chance in the "
          "same direction in every seed). Use `--preset=cpu` for results.", ""]


def markdown(results: Mapping, plots: Sequence[str] = ()) -> str:
  """The REPORT.md text of one sweep."""
  better = results.get("better", {})
  headline = results.get("headline", [results["primary_metric"]])
  out = [f"# Ablation `{results['ablation']}` ({results['preset']} preset)", ""]
  out += preset_note(results["preset"], len(results.get("seeds") or ()) or None)
  if results.get("hypothesis"):
    out += [results["hypothesis"], ""]
  if results.get("command"):
    out += ["Command:", "", f"    {results['command']}", ""]
  if results.get("environment"):
    out += [environment_line(results["environment"]), ""]
  out += rendered_lines([results])
  conditions = "; ".join(f"{axis} = " + ", ".join(map(str, levels))
                         for axis, levels in (results.get("conditions") or {}).items())
  out += [f"Baseline (the released setting): **{results['baseline']}**. "
          f"Seeds per variant: {len(results.get('seeds', []))}. "
          + (f"Conditions: {conditions}. " if conditions else "")
          + "Direction of improvement: "
          + ", ".join(f"`{m}` {better.get(m) or 'none'}" for m in headline) + ".", "",
          "## Verdict", ""] + headline_lines(results) + [""]
  matrices = [condition_matrix(results, metric) for metric in headline]
  if any(matrices):
    out += ["Per condition (difference to the baseline of the same condition, its p-value; "
            "* = significant after the Holm correction):", ""]
    out += [line for m in matrices if m for line in m + [""]]
  out += interaction_lines(results, headline)
  for metric in headline:
    out += [f"## `{metric}`", ""] + metric_table(results, metric) + [""]
  others = [m for m in results.get("metrics", []) if m not in headline]
  if others:
    out += ["## Other metrics (mean ± 95% CI over the runs that did not diverge)", ""]
    out += other_metrics_table(results, others) + [""]
    differences = other_differences_table(results, others)
    if differences:
      scope = ("pooled over the conditions, as in the verdict"
               if results.get("pooled_comparisons") else "paired by seed")
      out += [f"Their differences to the baseline ({scope}; * = significant after the Holm "
              "correction):", ""] + differences + [""]
  if plots:
    out += ["## Plots", ""] + [f"![{os.path.splitext(p)[0]}]({p})" for p in plots] + [""]
  out += design_lines(results)
  out += ["## How to read this", "", HOW_TO_READ, ""]
  return "\n".join(out)


def design_lines(results: Mapping) -> list[str]:
  """"## Design": the script's task knobs, variants and metrics, and how long each run
  trained and on which evaluation lists (sweeps from before results.json held them: none)."""
  out = []
  if results.get("design"):
    out += [p for paragraph in results["design"].split("\n\n") for p in (paragraph, "")]
  t = results.get("training")
  ran = results.get("variants_run")
  if ran:
    out += [f"Variants run: {', '.join(ran)} (a subset, chosen with `--variants`; the "
            "design above names every variant of the ablation). The Holm correction "
            "covers the comparisons of these variants only, fewer than the whole "
            "sweep's, so its p-values can read lower than the whole sweep's would.", ""]
  if t:
    batches = f"{t['eval_batches']} batch{'es' if t['eval_batches'] > 1 else ''}"
    covers = ("so the intervals above cover the seed's variation (model initialisation "
              "and training batches), not evaluation sampling"
              if len(results.get("seeds") or ()) > 1 else
              "so with more than one seed the intervals would cover the seed's variation, "
              "not evaluation sampling")
    out += [f"Training: {t['num_steps']} steps of {t['batch_size']} users per seed "
            "(the base config's; a variant's own setting, if any, is in its overrides). "
            f"Evaluation: {t['eval_lists']} lists per split ({batches} of "
            f"{t['eval_batch_size']}), drawn from `eval_seed` {t['eval_seed']} and the same "
            f"for every variant and seed, {covers}.", ""]
  return ["## Design", ""] + out if out else []


HOW_TO_READ = "\n".join([
    "- **Values**: the mean ± the half-width of the t-based 95% confidence interval over "
    "seeds.",
    "- **Tests**: each variant is compared with the baseline run of the same seed (and the "
    "same condition): a paired t-test on the differences, or the exact McNemar test for "
    "`diverged` (which needs at least 6 pairs that disagree, all in one direction, to "
    "reach p < 0.05 before the Holm correction; no CI is given for `diverged`: read the "
    "divergence counts). A pooled comparison first averages each seed's values over the "
    "conditions, then pairs those means by seed, because every condition trains with the "
    "same seeds: it has as many pairs as seeds (`diverged` becomes a per-seed rate, "
    "compared by an exact sign-flip test, up to 16 seeds).",
    "- **Holm p** corrects for the number of comparisons of one metric in one table (the "
    "per-condition rows, the pooled rows, or the interaction rows), not across metrics; "
    "a metric with one row there, such as a single arm's pooled comparison, is its own "
    "family, and its Holm p is its p. A verdict says *significant* only when Holm p is "
    "below 0.05, so a real but small effect can read *no significant difference* with "
    "few seeds.",
    "- **The CIs are not adjusted**: each is its own row's 95% t-interval, so one that "
    "excludes 0 can sit beside *no significant difference* when the Holm correction lifts "
    "p above 0.05.",
    "- **Few seeds**: with n pairs the t-test has n − 1 degrees of freedom, and its p rests "
    "on the paired differences being roughly normal; no test that assumes nothing of "
    "their distribution can give p below 2^(1 − n) from n pairs (0.25 with three). Where "
    "such an exact test is the one used (`diverged`, and a metric whose pairs all moved "
    "by the same amount), the verdict reads *not testable* while n is 5 or less, since "
    "its p cannot reach 0.05.",
    "- **Zero-width CIs** (± 0): every pair differed by the same amount (up to float "
    "rounding) and that amount is 0 (p 1), or every seed gave the same value on each "
    "side, as a deterministic quantity (a parameter count) does: an exact difference, "
    "marked *exact* and not starred, since nothing was tested. Where the seeds' values "
    "vary but every pair differs by the same nonzero amount (a coarse metric can), the "
    "t-test is undefined: the row has no CI (`n/a`) and takes the exact sign-flip p, "
    "2^(1 − n) (0.25 with three seeds: *not testable*, as above).",
    "- **Diverged runs** (non-finite loss or gradient norm) count in `diverged` and have "
    "no other final metric: they are left out of the means and of the pairs they belong "
    "to (the pair count says how many remained).",
    "- **TensorBoard** (`tensorboard --logdir` on this folder): the primary evaluation's "
    "metrics are tagged `eval/<metric>` (`auc_mean` is `eval/auc_mean`; characters "
    "TensorBoard rejects become `_`: `recall@5` is `eval/recall_5`), the extra splits' "
    "`<split>/<metric>`, and probe and derived metrics keep their names, at each run's "
    "last step. The HParams view groups each variant's seeds (every `seed_<k>` folder on "
    "disk, so also seeds a rerun with fewer left out of this report) and opens with five "
    "metric columns in alphabetical order: tick the tags of the metrics above to compare "
    "the variants on them.",
])


def merged_environments(envs: Sequence[Mapping]) -> list[dict]:
  """The distinct environments of several sweeps, each sweep's runs counted in its
  environment's `run_codes` (sweeps that differ only in their runs share one line)."""
  merged = {}
  for env in envs:
    key = repr(sorted((k, v) for k, v in env.items() if k != "run_codes"))
    into = merged.setdefault(key, {**env, "run_codes": {} if "run_codes" in env else None})
    for code, count in (env.get("run_codes") or {}).items():
      into["run_codes"][code] = into["run_codes"].get(code, 0) + count
  return list(merged.values())


def environment_line(env: Mapping) -> str:
  """"Code: <commit>; Python ..., jax ..., jaxlib ..., numpy ...; machine: ..." of a
  results.json, with the code versions that trained the runs where they differ from the
  report's (results.json files written before the machine was recorded lack it)."""
  code = env.get("code") or "not a git checkout"
  runs = env.get("run_codes")
  if runs and list(runs) == [env.get("code")]:
    code += " (every run's too)"
  elif runs:
    code += (" for this report; the runs were trained by: " + ", ".join(
        f"{c if c != 'not recorded' else 'unrecorded code'} ({n} run{'s' if n > 1 else ''})"
        for c, n in runs.items()))
  machine = f"; machine: {env['machine']}" if env.get("machine") else ""
  return (f"Code: {code}; Python {env.get('python')}, jax {env.get('jax')}, "
          f"jaxlib {env.get('jaxlib')}, numpy {env.get('numpy')}{machine}.")


def rendered_lines(sweeps: Sequence[Mapping]) -> list[str]:
  """Where statistics and report were computed again from results.json after the sweep
  (`ablations.rerender`): the code and command, once per distinct pair."""
  seen = list(dict.fromkeys((r["rendered"].get("code") or "not a git checkout",
                             r["rendered"].get("command") or "")
                            for r in sweeps if r.get("rendered")))
  return [f"Statistics and report computed again from results.json by code {code}"
          + (f" (`{command}`)" if command else "") + ", after the runs." for code, command
          in seen] + ([""] if seen else [])


def curve(rows: Sequence[Mapping], key: str) -> tuple[list[float], list[float]]:
  """(steps, values) of one metrics.jsonl key; missing and non-finite values skipped."""
  pairs = [(r["step"], r[key]) for r in rows
           if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
  return [s for s, _ in pairs], [v for _, v in pairs]


def plot_curves(results: Mapping, workdir: str, keys: Sequence[str], path: str) -> bool:
  """One panel per (condition, key), one colour per arm, one line per seed: the first
  `MAX_CURVE_PANELS` panels (every shipped ablation's grid fits, sandwich_norm's 18 at
  the full preset the largest); a larger grid's other panels are in TensorBoard."""
  variants = results["variants"]
  cells = list(dict.fromkeys(v["cell"] for v in variants.values()))
  panels = [(cell, k) for cell in cells for k in keys][:MAX_CURVE_PANELS]
  palette = matplotlib.colormaps["tab10"]
  colours = {a: palette(i % 10) for i, a in enumerate(results["arms"])}
  cols = min(len(panels), max(len(keys), 4 if len(panels) > 4 else len(panels)))
  rows_n = math.ceil(len(panels) / cols)
  fig, axes = figure(rows_n, cols, (4.0 * cols, 3.0 * rows_n))
  drawn = False
  for ax, (cell, key) in zip(axes.flat, panels):
    for name, v in variants.items():
      if v["cell"] != cell:
        continue
      for i, seed in enumerate(v["seeds"]):
        steps, values = curve(read_metrics(seed_dir(os.path.join(workdir, name), seed)), key)
        if steps:
          ax.plot(steps, values, color=colours[v["arm"]], lw=1.1, alpha=0.8,
                  marker="o" if len(steps) < 3 else None, label=v["arm"] if i == 0 else None)
          drawn = True
    ax.set_title(key + (f" | {cell}" if cell else ""), fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=7)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=7)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  if drawn:
    save_figure(fig, path)
  return drawn


def plot_effects(results: Mapping, metrics: Sequence[str], path: str) -> bool:
  """Δ vs the baseline with 95% CI error bars (red: significant), one panel per metric,
  every panel on the same rows (variants, then arms pooled over conditions). Where there
  is nothing to draw (no comparison has a Δ), an earlier plot at `path` is removed: the
  combined report links a sweep's effects.png wherever the file exists."""
  comps = results.get("comparisons", []) + [
      dict(c, variant=f"{c['variant']} (pooled)") for c in results.get("pooled_comparisons", [])]
  comps = [c for c in comps if c["metric"] in metrics and c["delta"] is not None]
  panels = [m for m in metrics if any(c["metric"] == m for c in comps)][:MAX_EFFECT_PANELS]
  if not panels:
    if os.path.exists(path):
      os.remove(path)
    return False
  labels = list(dict.fromkeys(c["variant"] for c in comps))
  row = {label: len(labels) - 1 - i for i, label in enumerate(labels)}
  cols = min(len(panels), 3)
  rows_n = math.ceil(len(panels) / cols)
  fig = Figure(figsize=(1.5 + 3.6 * cols, (0.9 + 0.28 * len(labels)) * rows_n),
               layout="constrained")
  axes = fig.subplots(rows_n, cols, squeeze=False, sharey=True)
  better = results.get("better", {})
  no_ci = False
  for ax, metric in zip(axes.flat, panels):
    for c in (c for c in comps if c["metric"] == metric):
      if c["ci95"] is None:   # an exact test's row (`diverged`), or one pair: no bar
        no_ci = True
        ax.plot(c["delta"], row[c["variant"]], "o", mfc="none",
                color="tab:red" if significant(c) else "tab:gray")
        continue
      lo, hi = c["ci95"]
      ax.errorbar(c["delta"], row[c["variant"]], xerr=[[c["delta"] - lo], [hi - c["delta"]]],
                  fmt="o", capsize=3, color="tab:red" if significant(c) else "tab:gray")
    ax.axvline(0.0, color="black", lw=0.8)
    direction = better.get(metric)
    ax.set_title(f"Δ {metric}" + (f" ({direction} is better)" if direction else ""),
                 fontsize=9)
    ax.tick_params(labelsize=7)
  axes[0, 0].set_yticks(list(row.values()))
  axes[0, 0].set_yticklabels(list(row), fontsize=7)
  axes[0, 0].set_ylim(-0.6, len(labels) - 0.4)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  fig.suptitle(f"difference to {results['baseline']} (unadjusted 95% CI; red = significant "
               "after Holm"
               + ("; hollow = no CI" if no_ci else "") + ")", fontsize=9)
  save_figure(fig, path)
  return True


def write_report(results: Mapping, workdir: str, curve_keys: Sequence[str] = (),
                 extra_plots: Sequence = ()) -> str:
  """Writes curves.png, effects.png, the extra plots and REPORT.md into `workdir`;
  returns the path of REPORT.md."""
  plots = []
  if curve_keys and plot_curves(results, workdir, curve_keys,
                                os.path.join(workdir, "curves.png")):
    plots.append("curves.png")
  headline = results.get("headline", [results["primary_metric"]])
  if plot_effects(results, headline, os.path.join(workdir, "effects.png")):
    plots.append("effects.png")
  for plot in extra_plots:
    name = plot(results, workdir)
    if name:
      plots.append(name)
  path = os.path.join(workdir, "REPORT.md")
  write_atomic(path, markdown(results, plots))
  return path


def verdict_comparisons(results: Mapping) -> list[Mapping]:
  """The comparisons a verdict reads: pooled over conditions when there are any, per
  variant otherwise."""
  return results.get("pooled_comparisons") or results.get("comparisons", [])


def headline_comparisons(results: Mapping) -> list[Mapping]:
  """The comparisons the verdict states, of the headline metrics."""
  source = verdict_comparisons(results)
  return [c for metric in results.get("headline", [results["primary_metric"]])
          for c in source if c["metric"] == metric]


def combined_markdown(entries: Sequence[tuple[str, Mapping]], workdir: str, preset: str,
                      command: str = "") -> str:
  """One page over several sweeps: a summary table of every headline comparison, then
  per ablation its hypothesis, per-condition effects, effect plot and a link to its full
  report. `entries` are (directory relative to `workdir`, results)."""
  out = [f"# Phoenix ablations ({preset} preset)", ""]
  counts = {len(r.get("seeds") or ()) for _, r in entries}
  out += preset_note(preset, counts.pop() if len(counts) == 1 and 0 not in counts else None)
  if command:
    out += ["Command:", "", f"    {command}", ""]
  envs = sorted(environment_line(env) for env in merged_environments(
      [r["environment"] for _, r in entries if r.get("environment")]))
  out += envs + ([""] if envs else [])
  out += rendered_lines([r for _, r in entries])
  out += ["Each row: a variant against the released setting, paired over seeds (where the "
          "sweep has several conditions, pooled: each seed's values averaged over them "
          "first); significant means Holm-adjusted p < 0.05, Holm over the comparisons of "
          "one metric within one ablation (not across metrics or ablations).", "",
          "| ablation | variant vs baseline | metric | Δ [unadjusted 95% CI] | p | Holm p "
          "| verdict |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
  for rel, results in entries:
    better = results.get("better", {})
    for c in headline_comparisons(results):
      head = (f"| [{results['ablation']}]({rel}/REPORT.md) | {c['variant']} vs "
              f"{c['baseline']} | `{c['metric']}` | ")
      tested = (f"{fmt(c['delta'])} (exact) | |" if deterministic(c) else   # (as `table`)
                f"{fmt(c['delta'])} {fmt_ci(c['ci95'])} | {fmt_p(c['p_value'])} | "
                f"{fmt_p(c.get('p_holm'))}")
      out.append(f"{head}{tested} | {verdict(c, better.get(c['metric']))} |")
  out.append("")
  for rel, results in entries:
    out += [f"## [{results['ablation']}]({rel}/REPORT.md)", ""]
    if results.get("hypothesis"):
      out += [results["hypothesis"], ""]
    for metric in results.get("headline", []):
      matrix = condition_matrix(results, metric)
      if matrix:
        out += matrix + [""]
    out += interaction_lines(results, results.get("headline", []))
    if os.path.exists(os.path.join(workdir, rel, "effects.png")):
      out += [f"![{results['ablation']}]({rel}/effects.png)", ""]
  return "\n".join(out)
