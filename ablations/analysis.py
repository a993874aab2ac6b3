"""A sweep's statistics, computed from its variants' per-seed values alone.

`compare` takes the `variants` and `conditions` of a results.json (see `ablations.sweep`)
and returns its three lists of tests against the baseline:

- "comparisons": each variant minus the baseline variant of the same condition level
  (cell), paired by seed (`stats.paired_t`; `stats.mcnemar_exact` for the 0/1 metric
  `diverged`);
- "pooled_comparisons" (sweeps with more than one cell): per seed, the mean of an arm's
  values over the cells minus the baseline's, paired by seed. Every cell trains with the
  same seeds, so the seed is the independent unit (`diverged` becomes a per-seed rate,
  `stats.rate_difference`);
- "interactions" (axes with two levels or more): does an arm's difference depend on the
  condition (`interactions`).

`p_holm` is Holm-adjusted over the rows of one metric in one list. Nothing here reads a
run directory, so a results.json can be analysed again from the file itself.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Mapping, Optional, Sequence

from ablations import stats

Variants = Mapping[str, Mapping]   # results.json's "variants": name -> {"arm", "cell", ...}


def cell_name_of(levels: Iterable[str]) -> str:
  """A cell's name: its level on each axis, in the axes' order, joined by "_"."""
  return "_".join(levels)


def per_seed(variants: Variants, name: str, metric: str) -> list[Optional[float]]:
  """One variant's per-seed values of `metric` (None: a diverged run's, or missing)."""
  return variants[name]["metrics"][metric]["per_seed"]


def compare(variants: Variants, conditions: Mapping[str, Sequence[str]], baseline: str,
            metrics: Sequence[str]) -> dict[str, list[dict]]:
  """{"comparisons", "pooled_comparisons", "interactions"} of one sweep (module docstring).

  `variants` and `conditions` are as in results.json; `baseline` is the baseline arm.
  """
  baselines = {v["cell"]: name for name, v in variants.items() if v["arm"] == baseline}
  arms = list(dict.fromkeys(v["arm"] for v in variants.values()))
  comparisons, pooled = [], []
  for metric in metrics:
    test = stats.mcnemar_exact if metric == "diverged" else stats.paired_t
    rows = [{"variant": name, "baseline": baselines[v["cell"]], "metric": metric,
             **test(per_seed(variants, baselines[v["cell"]], metric),
                    per_seed(variants, name, metric))}
            for name, v in variants.items() if v["arm"] != baseline and v["cell"] in baselines]
    comparisons += _with_holm(rows)
    if len(baselines) > 1:
      prow = []
      pooled_test = stats.rate_difference if metric == "diverged" else stats.paired_t
      for arm in arms:
        members = [(name, v["cell"]) for name, v in variants.items()
                   if v["arm"] == arm and v["cell"] in baselines]
        if arm == baseline or not members:
          continue
        row = pooled_test(
            stats.seed_means([per_seed(variants, baselines[cell], metric)
                              for _, cell in members]),
            stats.seed_means([per_seed(variants, name, metric) for name, _ in members]))
        prow.append({"variant": arm, "baseline": baseline, "metric": metric, **row,
                     "test": f"{row['test']} of seed means", "conditions": len(members)})
      pooled += _with_holm(prow)
  return {"comparisons": comparisons, "pooled_comparisons": pooled,
          "interactions": interactions(variants, conditions, baseline, metrics)}


def interactions(variants: Variants, conditions: Mapping[str, Sequence[str]],
                 baseline: str, metrics: Sequence[str]) -> list[dict]:
  """Does an arm's difference to the baseline depend on the condition?

  For each arm, axis, level after the axis's first (the reference level) and metric
  (`diverged` aside): per seed, the arm's difference to the baseline at that level minus
  its difference at the reference level, averaged over the other axes' levels (those
  where all four variants ran); then a paired t-test of those per-seed values
  (`stats.paired_t`, seeds as the unit, as in the pooled comparisons), Holm-adjusted over
  the rows of one metric. A seed missing a value in any of the cells averaged leaves
  that row.

  Returns [{"arm", "baseline", "metric", "axis", "level", "reference", "delta",
  "ci95", "p_value", "p_holm", "n", "test", "cells"}] ("delta": the difference of
  differences; "cells": how many combinations of the other axes were averaged).
  """
  axes = list(conditions)
  by_cell = {(v["arm"], v["cell"]): name for name, v in variants.items()}
  cell_levels = {cell_name_of(levels): dict(zip(axes, levels))
                 for levels in itertools.product(*conditions.values())}
  arms = [a for a in dict.fromkeys(v["arm"] for v in variants.values()) if a != baseline]

  def has(arm: str, cell: str, metric: str) -> bool:
    return (arm, cell) in by_cell and metric in variants[by_cell[(arm, cell)]]["metrics"]

  def deltas(arm: str, cell: str, metric: str) -> list[Optional[float]]:
    return [None if a is None or b is None else a - b
            for a, b in zip(per_seed(variants, by_cell[(arm, cell)], metric),
                            per_seed(variants, by_cell[(baseline, cell)], metric))]

  out = []
  for metric in metrics:
    if metric == "diverged":
      continue
    rows = []
    for arm, axis in itertools.product(arms, axes):
      reference, *others = conditions[axis]
      for level in others:
        pairs = []   # (cell at the reference level, cell at `level`), other axes equal
        for cell, where in cell_levels.items():
          if where[axis] != reference:
            continue
          moved = cell_name_of({**where, axis: level}[a] for a in axes)
          if all(has(x, c, metric) for x in (arm, baseline) for c in (cell, moved)):
            pairs.append((cell, moved))
        if not pairs:
          continue
        row = stats.paired_t(
            stats.seed_means([deltas(arm, cell, metric) for cell, _ in pairs]),
            stats.seed_means([deltas(arm, moved, metric) for _, moved in pairs]),
            sources=[per_seed(variants, by_cell[(x, c)], metric)
                     for x in (arm, baseline) for pair in pairs for c in pair])
        rows.append({"arm": arm, "baseline": baseline, "metric": metric, "axis": axis,
                     "level": level, "reference": reference, **row,
                     "cells": len(pairs)})
    out += _with_holm(rows)
  return out


def _with_holm(rows: list[dict]) -> list[dict]:
  for row, p in zip(rows, stats.holm([r["p_value"] for r in rows])):
    row["p_holm"] = p
  return rows
