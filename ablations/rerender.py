"""Recompute a finished sweep's statistics and rewrite its report from results.json alone.

    python -m ablations.rerender runs/candidate_isolation [more sweep folders]

For a sweep whose run directories are gone (such as docs/results, which keeps results.json,
REPORT.md and the plots only), or after a change to the statistics (`ablations.stats`,
`ablations.analysis`) or to the report: the per-seed values in results.json are kept,
each variant's summaries (`stats.summarize`) and the comparisons, pooled comparisons and
interactions (`analysis.compare`) are computed again, effects.png is drawn again, and
REPORT.md is written with the plots it listed before (curves need the runs: with them,
run the sweep's own command instead, which redraws everything and reuses every run).
results.json records the code and command that did this as `rendered`; its `environment`
still describes the sweep's process. A folder of `python -m ablations.run_all` (its
results.json maps each ablation to its results) is rendered ablation by ablation, then
its combined report; name that folder, not one of its ablations, or the combined report
keeps the old figures.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Callable

from absl import flags

if not __package__:  # run by path, not with python -m: import this checkout's packages
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ablations import analysis, report, stats, sweep
from experiments.cli import parse_flags, quiet_backend_search, run_app
from phoenix_flax.training import provenance, writers


def _listed_plots(report_path: str, folder: str) -> list[str]:
  """The plot files an existing REPORT.md shows, those still in `folder`."""
  if not os.path.exists(report_path):
    return []
  with open(report_path, encoding="utf-8") as f:
    listed = re.findall(r"^!\[[^\]]*\]\(([^)/]+\.png)\)$", f.read(), re.M)
  return [name for name in listed if os.path.exists(os.path.join(folder, name))]


class RerenderError(ValueError):
  """A folder that holds no results.json this command can render (named in the message)."""


def _load(folder: str) -> dict:
  """The folder's results.json as an object, or a `RerenderError` saying why not."""
  path = os.path.join(folder, "results.json")
  if not os.path.isfile(path):
    raise RerenderError(f"{folder} holds no results.json: not a finished sweep")
  try:
    found = writers.read_json(path)
  except (OSError, ValueError) as e:
    raise RerenderError(f"{path} cannot be read ({type(e).__name__}: {e})") from e
  if not isinstance(found, dict):
    raise RerenderError(f"{path} holds a {type(found).__name__}, not a sweep's results")
  return found


def _check_sweep(folder: str, results: dict) -> None:
  """A `RerenderError` naming what a sweep's results.json lacks of what rendering reads."""
  path = os.path.join(folder, "results.json")
  variants, metrics = results.get("variants"), results.get("metrics")
  if not isinstance(variants, dict) or not variants:
    raise RerenderError(f"{path} is no sweep's results (no 'variants')")
  if not isinstance(metrics, list) or not metrics:
    raise RerenderError(f"{path} is no sweep's results (no 'metrics' list)")
  if not isinstance(results.get("preset"), str):
    raise RerenderError(f"{path} names no 'preset'")
  if results.get("conditions") and not isinstance(results.get("arms"), list):
    raise RerenderError(f"{path} has 'conditions' but no 'arms' list")
  arms = results.get("arms") or list(variants)   # with conditions, the baseline is an arm
  if results.get("baseline") not in arms:
    raise RerenderError(f"{path}: its 'baseline' {results.get('baseline')!r} is none of "
                        f"its arms {sorted(arms)}")
  for name, variant in variants.items():
    summaries = variant.get("metrics") if isinstance(variant, dict) else None
    if isinstance(variant, dict) and not all(k in variant for k in ("arm", "cell")):
      raise RerenderError(f"{path}: variant {name!r} names no 'arm' and 'cell'")
    if not isinstance(summaries, dict) or not all(
        isinstance(s, dict) and isinstance(s.get("per_seed"), list) for s in summaries.values()):
      raise RerenderError(f"{path}: variant {name!r} has no per-seed values of its metrics "
                          "('metrics' -> <metric> -> 'per_seed')")
  if results.get("primary_metric") not in metrics:
    raise RerenderError(f"{path}: its 'primary_metric' {results.get('primary_metric')!r} is "
                        f"none of its metrics {metrics}")
  seeds = results.get("seeds")
  if not isinstance(seeds, list) or not seeds:
    raise RerenderError(f"{path} names no 'seeds' list")
  for name, variant in variants.items():   # what the statistics read, value by value
    for metric in metrics:
      values = variant["metrics"].get(metric, {}).get("per_seed")
      if values is None:
        raise RerenderError(f"{path}: variant {name!r} has no per-seed values of {metric!r}")
      if len(values) != len(seeds):
        raise RerenderError(f"{path}: variant {name!r} has {len(values)} per-seed values of "
                            f"{metric!r} for its {len(seeds)} seeds")
      odd = [v for v in values
             if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))]
      if odd:
        raise RerenderError(f"{path}: variant {name!r} has a per-seed value of {metric!r} "
                            f"that is neither a number nor null: {odd[0]!r}")


def check(folder: str) -> None:
  """Raises `RerenderError` unless `folder` (a sweep's, or a `run_all` one and every sweep
  it lists) can be rendered: called for every folder before anything is rewritten."""
  results = _load(folder)
  if "ablation" in results:
    _check_sweep(folder, results)
    return
  if not results:
    raise RerenderError(f"{folder}/results.json lists no sweeps")
  presets = set()
  for name in results:
    inner = os.path.join(folder, name)
    found = _load(inner)
    _check_sweep(inner, found)
    presets.add(found["preset"])
  if len(presets) != 1:
    raise RerenderError(f"{folder}: its sweeps ran at several presets {sorted(presets)}")


def _recompute(folder: str, command: str) -> dict:
  """A sweep's results with its statistics computed again, in memory (nothing written)."""
  results = _load(folder)
  _check_sweep(folder, results)
  try:
    for variant in results["variants"].values():   # mean, std and CI over seeds
      variant["metrics"] = {m: stats.summarize(summary["per_seed"])
                            for m, summary in variant["metrics"].items()}
    results.update(analysis.compare(results["variants"], results.get("conditions") or {},
                                    results["baseline"], results["metrics"]))
    results["rendered"] = {"code": provenance.code_version(), "command": command}
    report.markdown(results)   # a trial: what cannot be rendered fails before any write
  except (TypeError, KeyError, ValueError, AttributeError, IndexError) as e:
    raise RerenderError(f"{os.path.join(folder, 'results.json')} cannot be rendered "
                        f"({type(e).__name__}: {e}): a field of another type or shape than "
                        "a sweep writes; run the sweep again to write it afresh") from e
  return results


def _write_sweep(folder: str, results: dict) -> None:
  """effects.png drawn again, then results.json and REPORT.md (with the plots it listed)."""
  writers.remove_temporaries(folder, keep_live_writers=True)   # of a killed earlier writer
  headline = results.get("headline", [results["primary_metric"]])
  drawn = report.plot_effects(results, headline, os.path.join(folder, "effects.png"))
  # Read after drawing: an effects.png with nothing left to draw is gone, so not listed.
  plots = _listed_plots(os.path.join(folder, "REPORT.md"), folder)
  if drawn and "effects.png" not in plots:
    plots.append("effects.png")
  sweep.write_json(os.path.join(folder, "results.json"), results)
  report.write_atomic(os.path.join(folder, "REPORT.md"), report.markdown(results, plots))


def _prepare(folder: str, command: str) -> Callable[[], str]:
  """Renders a sweep's folder, or a `run_all` folder (every ablation it lists, then the
  combined report), in memory; the function returned writes it all and returns the path of
  the REPORT.md written last. Nothing is written until every statistic is computed."""
  results = _load(folder)
  if "ablation" in results:
    fresh = _recompute(folder, command)

    def write_one() -> str:
      _write_sweep(folder, fresh)
      return os.path.join(folder, "REPORT.md")
    return write_one
  check(folder)   # every sweep it lists
  path = os.path.join(folder, "REPORT.md")
  presets = {_load(os.path.join(folder, name))["preset"] for name in results}
  old = ""
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      old = f.read()
  ran = re.search(r"^Command:\n\n    (.*)$", old, re.M)
  entries = [(name, _recompute(os.path.join(folder, name), command)) for name in results]
  preset = presets.pop()

  def write_all() -> str:
    for name, sweep_results in entries:
      _write_sweep(os.path.join(folder, name), sweep_results)
    writers.remove_temporaries(folder, keep_live_writers=True)
    sweep.write_json(os.path.join(folder, "results.json"), dict(entries))
    # after the sweeps: the combined report shows the effect plots that now exist
    report.write_atomic(path, report.combined_markdown(entries, folder, preset,
                                                       ran.group(1) if ran else ""))
    return path
  return write_all


def rerender(folder: str, command: str = "") -> str:
  """A sweep's folder, or a `run_all` folder (every ablation it lists, then the combined
  report); returns the path of the REPORT.md written last. Every statistic is computed
  before any file is rewritten."""
  return _prepare(folder, command)()


def main(argv) -> None:
  # The sweep's flags exist here only because this module imports `ablations.sweep`: a
  # report is rendered from results.json alone, so none of them would change anything.
  given = [f"--{name}" for name in sweep.SWEEP_FLAGS if flags.FLAGS[name].present]
  if given:
    sweep.usage_error(f"{', '.join(given)}: flags of an ablation's sweep, which rerender "
                      "does not take (it renders results.json as it is)", flags_hint=False)
  folders = argv[1:]
  if not folders:
    sweep.usage_error("name one or more sweep folders (each holding a results.json)",
                      flags_hint=False)
  for folder in folders:   # every folder checked before any is rewritten
    try:
      check(folder)
    except RerenderError as e:
      sweep.usage_error(str(e), flags_hint=False)
  command = sweep.command_line()
  try:
    writes = [_prepare(folder, command) for folder in folders]   # all computed, then written
  except RerenderError as e:
    sweep.usage_error(str(e), flags_hint=False)
  for write in writes:
    print(f"wrote {write()}")


if __name__ == "__main__":
  quiet_backend_search()
  run_app(main, flags_parser=parse_flags)
