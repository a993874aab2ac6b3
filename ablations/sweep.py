"""The shared sweep helper: variants x seeds -> runs -> results.json -> REPORT.md + PNGs.

An ablation (`Ablation`) names *arms*, the settings of the component under test, one of
them the released setting (the baseline), and optionally *conditions*, axes such as the
learning rate or the depth across which the comparison should hold. Every arm x
condition level is a *variant*, trained for every seed by
`phoenix_flax.training.run_experiment` into `<workdir>/<variant>/seed_<k>/` (seeds are
vmapped in one call). The runner skips finished runs and resumes interrupted ones, so
re-running a sweep only does the missing work. A *probe* can then measure what training
does not (serving-time behaviour, parameter counts) on each finished run; its numbers are
cached in `seed_<k>/probes.json` and written to TensorBoard as the run's scalars at its last
step (`events.out.tfevents.*.probes`; `.joint_probes` for joint probes, `.derived` for the
metrics `derived` computes). A *joint probe* measures one seed's runs of every
variant together, for comparisons that need the same conditions (throughput, timed in
interleaved rounds); cached in `seed_<k>/joint_probes.json`. The caches know nothing of
the probe's code: after changing a probe, `--reprobe` measures every finished run again.

Config of a variant, in order: `experiments/configs/<experiment>.py:get_config(preset)`
(the ablation's `experiment`, "ranking" or "retrieval"), the sweep preset (`PRESETS`),
the ablation's `preset_overrides` and `task(config, preset)`, the user's `--override`s,
`num_seeds` (with `output.seed_subdirs=True`), then the condition level and the arm. The
task sees the user's overrides (of the fields that exist before it runs), since it derives
knobs from sizes such as `world.history_len`; they are applied again after it, so an
override of a field that the task sets wins.

results.json:

    {"ablation": str, "experiment": "ranking"|"retrieval", "preset": str, "baseline": arm,
     "primary_metric": str,
     "headline": [metric], "metrics": [metric], "better": {metric: "higher"|"lower"|null},
     "curves": [metrics.jsonl key] (those curves.png draws),
     "hypothesis": str, "design": str (the docstring's other sections),
     "training": {"num_steps", "batch_size", "eval_batches", "eval_batch_size", "eval_lists",
                  "eval_seed"} (the base config's), "variants_run": [variant] | null (the
     variants of a --variants subset), "overrides": {path: value} (the user's, every
     variant), "command": str, "seeds": [int],
     "arms": [arm], "conditions": {axis: [level]},
     "variants": {name: {"arm": str, "cell": str, "overrides": {path: value},
                         "seeds": [int], "diverged": int, "diverged_at_step": [int|null],
                         "metrics": {metric: {"mean", "std", "ci95": [lo, hi], "n",
                                              "per_seed": [float|null]}},
                         "bayes": {metric: float} (the generator's Bayes-optimal value
                                  of each metric the runs report one for, e.g.
                                  `bayes_auc_mean` beside `auc_mean`; the mean over the
                                  finished runs, which share their evaluation lists)}},
     "comparisons": [{"variant", "baseline", "metric", "delta", "ci95": [lo, hi],
                      "p_value", "p_holm", "n", "test"}],
     "pooled_comparisons": [the same, with "variant" an arm and "conditions" the number
                            of condition levels averaged; empty without conditions],
     "interactions": [{"arm", "baseline", "metric", "axis", "level", "reference",
                       "delta", "ci95", "p_value", "p_holm", "n", "test", "cells"}]
                     (does an arm's difference depend on the condition:
                     `analysis.interactions`; empty unless an axis has two levels or
                     more),
     "environment": {"python", "jax", "jaxlib", "numpy", "code", "machine",
                     "run_codes": {code: number of runs it trained}},
     "rendered": {"code", "command"} (only once `python -m ablations.rerender` has
                 recomputed the statistics: the code that did and its command)}

Statistics: per variant, the mean, sample std and t-based 95% CI over seeds
(`ablations.stats`); against the baseline, the per-condition, pooled and interaction tests
of `ablations.analysis`, computed from the variants' per-seed values alone. Diverged runs
are never dropped silently: each counts in `diverged` and in the `diverged` metric, and
has null for every other metric, so means and paired differences use the finished runs
and `n` says how many. Null also marks what cannot be computed (a CI from one value).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import difflib
import functools
import itertools
import json
import os
import re
import shlex
import sys
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from absl import flags, logging
import jax
import jaxlib
import ml_collections
import numpy as np

from ablations import analysis, report, stats
from experiments.cli import (RUN_ERRORS, exit_on_run_errors, parse_flags,
                             quiet_backend_search, repeated, run_app, usage_error)
from experiments.configs import ranking, retrieval
from phoenix_flax.training import (Trainer, check_run_dirs, checkpoint, load_checkpoint,
                                   parse_config, run_dirs, run_experiment)
from phoenix_flax.training import provenance, writers
from phoenix_flax.training.schema import (ExperimentSpec, check_config, flatten,
                                         not_in_model_section, paths_named, split_config)
from phoenix_flax.training.sharding import initialize_from
from phoenix_flax.training.runner import (CONFIG_FILE, check_placement, check_workdir,
                                          checkpoint_like, finished_seeds, metric_names,
                                          read_result, RESULT_FILE, seed_dir)
from phoenix_flax.training.writers import (event_file_name, jsonable, read_json,
                                           remove_temporaries, write_event_file)

SEEDS = {"smoke": 2, "cpu": 3, "full": 5}
DEFAULT_ROOT = "/tmp/phoenix_ablations"   # the workdirs' folder without --workdir

# On top of the experiment config's preset of the same name (ablations may
# shorten runs further with `Ablation.preset_overrides`). cpu: 1200 steps (the ranking
# preset has 4000, the retrieval one 2000), so that the five ranking ablations trained in
# 39 minutes on 2 cores (README, "Results"); smoke: the tiny world, a handful of steps.
# The evaluation lists are the experiment config's (cpu: 4 x 256 for ranking, 16 x 128 for
# retrieval, whose oracle recall needs the 2048). Score consistency costs two extra
# forwards per evaluation batch, so only the ablation that reports it turns it on.
PRESETS = {
    "smoke": {"train.num_steps": 20, "train.steps_per_call": 10, "train.eval_every": 0,
              "train.checkpoint_every": 10, "train.eval_batches": 1,
              "train.score_consistency": False},
    "cpu": {"train.num_steps": 1200, "train.steps_per_call": 200, "train.eval_every": 600,
            "train.checkpoint_every": 600, "train.score_consistency": False},
    "full": {"train.score_consistency": False},
}

BETTER = {"auc_mean": "higher", "auc_gap": "lower", "logloss": "lower", "diverged": "lower",
          "calibration_error": "lower", "score_consistency": "lower", "auc": "higher",
          "loss": "lower", "recall@K": "higher", "ndcg@K": "higher"}
_AT_K = re.compile(r"@\d+$")   # a metric at every K of `top_k`: one entry, "<name>@K"
_LAYER = re.compile(r"/layer_\d+")
EXPERIMENTS = {"ranking": ranking, "retrieval": retrieval}
# What an ablation reports and plots unless it says otherwise (every preset of the
# retrieval config evaluates recall@10 and recall@100).
DEFAULT_METRICS = {"ranking": ("auc_mean", "logloss", "calibration_error", "diverged"),
                   "retrieval": ("recall@100", "recall@10", "auc", "diverged")}
DEFAULT_CURVES = {"ranking": ("train/loss", "eval/auc_mean"),
                  "retrieval": ("train/loss", "eval/recall@100")}
# Config fields a sweep sets in every variant, whatever an override says, and what to use
# instead.
SWEEP_SETS = {"num_seeds": "use --seeds (the `seeds` argument)",
              "output.seed_subdirs": "every run has its seed's directory in a sweep"}


class SweepError(ValueError):
  """A sweep that cannot go on for a reason its user can fix: the ablation scripts end
  with its message alone, exit status 2 (`exit_on_interrupt`)."""


Overrides = Mapping[str, Any]
Conditions = Mapping[str, Mapping[str, Overrides]]


@dataclasses.dataclass(frozen=True)
class Variant:
  """One trained configuration: an arm at one condition level (cell)."""

  name: str
  arm: str
  cell: str
  overrides: Overrides


@dataclasses.dataclass(frozen=True)
class RunContext:
  """What a probe gets for one finished, non-diverged run: its directory, seed and
  variant, the parsed config (`spec`: world, splits, model config), the synthetic world
  and the trained system (final checkpoint): a `RankingSystem`, or a `RetrievalSystem` for
  an ablation of the retrieval experiment."""

  run_dir: str
  seed: int
  variant: Variant
  preset: str
  spec: Any
  world: Any
  system: Any


Probe = Callable[[RunContext], Mapping[str, Any]]
JointProbe = Callable[[Sequence[RunContext]], Sequence[Mapping[str, Any]]]
PROBES_FILE, JOINT_PROBES_FILE = "probes.json", "joint_probes.json"


def _probe_tag(name: str) -> str:
  """The name of a probe file's TensorBoard event file (`write_event_file`): its stem."""
  return name.rsplit(".", 1)[0]


Plot = Callable[[Mapping, str], Optional[str]]


@dataclasses.dataclass(frozen=True)
class Ablation:
  """Everything a script states about one ablation.

  Attributes:
    name: directory and report name.
    doc: the script's docstring; its first and "Hypothesis:" paragraphs open the report.
    arms: arm -> config overrides (dotted paths, e.g. "model.attn_logit_cap").
    baseline: the arm with the released setting; every other arm is compared with it.
    metrics: every reported metric (result.json finals such as "auc_mean" or
      "long/auc_mean", probe outputs, "diverged"), in report order (default:
      `DEFAULT_METRICS` of the experiment). Without probes or `derived`, each must be a
      final of the runs (checked before training).
    primary_metric: the metric the headline starts from (default: the first of
      `metrics`); with `headline` given it changes nothing (results.json files written
      before `headline` existed use it as their headline).
    headline: metrics whose comparisons the verdict spells out, each with a table of
      its own at the top of the report (default: the primary metric, and "diverged"
      when it is among `metrics`).
    preset_overrides: {preset: overrides} on top of `PRESETS` (e.g. shorter runs for a
      sweep with many variants), applied before `task`.
    task: `task(config, preset)` sets the task knobs on the preset's config in place
      (the user's overrides already applied; see the module docstring).
    conditions: `conditions(preset) -> {axis: {level: overrides}}`; variants = arms x
      levels.
    probe: post-training measurements of one run (cached in probes.json).
    joint_probe: measurements of one seed's runs of every variant, taken together:
      `joint_probe(contexts) -> one mapping per context`. For comparisons that must see
      the same conditions, e.g. throughputs timed in interleaved rounds so that the
      host's load hits every variant alike. Cached in each run's joint_probes.json;
      when any run of a seed lacks one, that seed is measured again as a whole.
    derived: `derived(found) -> {metric: value}`, metrics computed from one run's
      flattened finals and probe outputs (e.g. a ratio of two of them).
    curves: metrics.jsonl keys drawn in curves.png (default: `DEFAULT_CURVES` of the
      experiment), such as "train/loss" (each arm's own loss: compare an idea that
      changes the loss by "eval/logloss" instead), "eval/auc_mean" or
      "long_list/auc_mean"; checked before training against what the runs log (a
      per-layer key against any layer: "train/residual_rms/layer_5" passes at a preset
      with fewer layers).
    plots: extra `plot(results, workdir) -> png file name or None` for the report.
    better: metric -> "higher"/"lower" is better (None: neither), on top of `BETTER`.
    experiment: the config the variants start from, `experiments/configs/<experiment>.py`:
      "ranking" (PhoenixModel) or "retrieval" (PhoenixRetrievalModel, whose finals are
      "auc", "loss", "recall@K" for the config's `retrieval.recall_k`, ...; the default
      `metrics` and `curves` follow it).
  """

  name: str
  doc: str
  arms: Mapping[str, Overrides]
  baseline: str
  metrics: Optional[Sequence[str]] = None   # default: DEFAULT_METRICS[experiment]
  primary_metric: Optional[str] = None
  headline: Sequence[str] = ()
  preset_overrides: Mapping[str, Overrides] = dataclasses.field(default_factory=dict)
  task: Optional[Callable[[ml_collections.ConfigDict, str], None]] = None
  conditions: Optional[Callable[[str], Conditions]] = None
  probe: Optional[Probe] = None
  joint_probe: Optional[JointProbe] = None
  derived: Optional[Callable[[Mapping[str, Optional[float]]], Mapping[str, Any]]] = None
  curves: Optional[Sequence[str]] = None    # default: DEFAULT_CURVES[experiment]
  plots: Sequence[Plot] = ()
  better: Mapping[str, str] = dataclasses.field(default_factory=dict)
  experiment: str = "ranking"

  def __post_init__(self):
    if self.experiment not in EXPERIMENTS:
      raise ValueError(f"Ablation {self.name!r}: experiment={self.experiment!r} must be one "
                       f"of {list(EXPERIMENTS)}")
    for name, defaults in (("metrics", DEFAULT_METRICS), ("curves", DEFAULT_CURVES)):
      if getattr(self, name) is None:
        object.__setattr__(self, name, defaults[self.experiment])
    if self.baseline not in self.arms:
      raise ValueError(f"Ablation {self.name!r}: baseline={self.baseline!r} is not one of "
                       f"the arms {list(self.arms)}")
    primary = self.primary_metric or self.metrics[0]
    if primary not in self.metrics:
      raise ValueError(f"Ablation {self.name!r}: primary_metric={primary!r} must be one "
                       f"of metrics={list(self.metrics)}")
    object.__setattr__(self, "primary_metric", primary)
    if not self.headline:
      head = (primary,) + (("diverged",) if "diverged" in self.metrics else ())
      object.__setattr__(self, "headline", tuple(dict.fromkeys(head)))

  def variants(self, preset: str) -> list[Variant]:
    """Arms x condition levels (arm overrides win over condition overrides)."""
    axes = self.conditions(preset) if self.conditions else {}
    cells = itertools.product(*(levels.items() for levels in axes.values()))
    out = []
    for cell in cells:
      cell_name = analysis.cell_name_of(level for level, _ in cell)
      cell_overrides = {k: v for _, ov in cell for k, v in ov.items()}
      for arm, arm_overrides in self.arms.items():
        name = f"{arm}_{cell_name}" if cell_name else arm
        out.append(Variant(name, arm, cell_name, {**cell_overrides, **arm_overrides}))
    twice = repeated([v.name for v in out])
    if twice:   # (arm "b" at level "x_y" and arm "b_x" at level "y": one folder)
      raise ValueError(f"Ablation {self.name!r} names two variants {twice} at preset "
                       f"{preset!r}: rename an arm or a condition level")
    return out


def parse_override(text: str) -> tuple[str, Any]:
  """"a.b=value" -> ("a.b", value); Python literals (numbers, None, True, tuples) are
  evaluated, true/false in any case are booleans and none in any case is None (no
  setting takes the string "none"), anything else stays a string."""
  path, sep, raw = text.partition("=")
  path = path.strip()
  if not sep or not path:
    raise ValueError(f"override {text!r} must look like path.to.field=value")
  raw = raw.strip()
  if raw.lower() in ("true", "false"):   # as absl reads --config.<bool>=true
    return path, raw.lower() == "true"
  if raw.lower() == "none":
    return path, None
  try:
    value = ast.literal_eval(raw)
  except (ValueError, SyntaxError, RecursionError, MemoryError):   # (the last two: nested
    value = raw                                                     # too deep to parse)
  return path, value


def apply_overrides(config: ml_collections.ConfigDict, overrides: Overrides
                    ) -> ml_collections.ConfigDict:
  """A copy of `config` with dotted-path overrides; an unknown path or a type change
  raises `ValueError` naming the path."""
  config = copy.deepcopy(config)
  for path, value in overrides.items():
    *parents, leaf = path.split(".")
    node, where = config, "config"
    try:
      for key in [*parents, leaf]:
        if not isinstance(node, ml_collections.ConfigDict) or key not in node:
          fields = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
          near = difflib.get_close_matches(key, fields, n=1)
          why = not_in_model_section(key) if where == "config.model" else None
          if why:
            raise ValueError(why)
          elsewhere = paths_named(key) if key == leaf and not near else []
          raise ValueError(
              f"{where} has no field {key!r}"
              + (f" (did you mean {near[0]!r}?)" if near else
                 f" (a field of that name is at: {', '.join(elsewhere)})" if elsewhere else
                 f" (fields: {fields})")
              + _where_new_fields_go(where))
        if key == leaf:
          if isinstance(node[leaf], ml_collections.ConfigDict):
            raise ValueError(f"{where}.{leaf} is a section: override its fields "
                             f"({path}.<field>=...)")
          try:
            node[leaf] = value
          except TypeError:   # ml_collections' own text names Python classes, not the path
            kind = node.get_ref(leaf).get_type().__name__
            raise ValueError(f"{where}.{leaf} takes values of type {kind}, not "
                             f"{type(value).__name__}") from None
        else:
          node, where = node[key], f"{where}.{key}"
    except (ValueError, TypeError) as e:
      raise ValueError(f"config override {path}={value!r} is invalid: {e}") from None
  return config


def _where_new_fields_go(where: str) -> str:
  """The hint that ends an unknown-field error in section `where` ("config.world", ...)."""
  section = where.split(".")
  if len(section) < 2:
    return ""
  if section[1:] == ["extra_eval_splits"]:
    return "; extra evaluation splits are defined in the experiment config file"
  if section[1] == "world":
    return "; a new field needs its default in WorldConfig (phoenix_flax/synthetic/config.py)"
  if section[1] in ("train_split", "eval_split", "extra_eval_splits"):
    return "; a new field needs its default in SplitConfig (phoenix_flax/synthetic/config.py)"
  return "; a new field needs its default in phoenix_flax/training/schema.py base_config"


def _has_path(config: ml_collections.ConfigDict, path: str) -> bool:
  node = config
  for key in path.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or key not in node:
      return False
    node = node[key]
  return True


def preset_config(preset: str, experiment: str = "ranking") -> ml_collections.ConfigDict:
  """The experiment's config at `preset`, with the sweep preset applied."""
  return apply_overrides(EXPERIMENTS[experiment].get_config(preset), PRESETS[preset])


def shifted_split(config: ml_collections.ConfigDict, **changes) -> ml_collections.ConfigDict:
  """An evaluation split for a serving shift, made in a task: `config.eval_split`, as the
  user's overrides left it, changed in `changes` only, so that the shift differs from the
  in-distribution lists in what it names and in nothing else (a split of defaults lost
  every `--override=eval_split.<field>`)."""
  return split_config(**{**config.eval_split.to_dict(), **changes})


def writes_outputs() -> bool:
  """Whether this process writes the sweep's files: process 0 only, as `run_experiment`
  writes a run's (in a multi-host sweep every process computes the same values)."""
  return jax.process_index() == 0


def write_json(path: str, obj: Any) -> None:
  """`writers.write_json` (atomic; NaN and inf become null, so a probe that measures NaN is
  recorded, not a crash after training), keys in their order, on process 0 only."""
  if writes_outputs():
    writers.write_json(path, obj, indent=1, sort_keys=False)


def read_json_if_exists(path: str) -> Optional[dict]:
  """The JSON object in `path`, or None where there is no such file."""
  if not os.path.exists(path):
    return None
  return read_json(path)


def previous_results(folder: str) -> dict:
  """The results.json a report in `folder` wrote before, or {} where there is none or it
  is no JSON object (damaged from outside: it is replaced)."""
  try:
    found = read_json_if_exists(os.path.join(folder, "results.json"))
  except ValueError:
    return {}
  return found if isinstance(found, dict) else {}


def check_report_folder(folder: str, is_ours: Callable[[dict], bool], writer: str) -> None:
  """Raises ValueError where `folder` holds a report that `writer` did not write, which
  writing its own would replace: a results.json that `is_ours` rejects, or a REPORT.md
  without results.json (a sweep writes results.json first). A results.json that is no
  JSON object, damaged from outside, is replaced."""
  try:
    found = read_json_if_exists(os.path.join(folder, "results.json"))
  except ValueError:
    return
  if found is not None and not isinstance(found, dict):
    return
  if found is None and os.path.exists(os.path.join(folder, "REPORT.md")):
    raise ValueError(f"{folder} holds a REPORT.md but no results.json, so {writer} did not "
                     "write it, and its report would replace it: use another workdir")
  if found is not None and not is_ours(found):
    raise ValueError(f"{folder}/results.json is not {writer}'s, and its report would "
                     "replace it (and REPORT.md and the plots there): use another workdir")


def _holds_runs(path: str, depth: int) -> bool:
  """Whether `path` or a folder up to `depth` levels below it holds a run's config.json."""
  if os.path.isfile(os.path.join(path, CONFIG_FILE)):
    return True
  return depth > 0 and any(_holds_runs(os.path.join(path, d), depth - 1)
                           for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))


def foreign_run_folders(folder: str, names: Sequence[str]) -> list[str]:
  """The folders in `folder` named none of `names` that hold runs: another sweep's
  variants (`<variant>/seed_<k>/config.json`) or another `run_all`'s sweeps (one level
  deeper), whose sweep could not resume once this one's report stood beside them (a
  sweep killed before its first report leaves no results.json to say whose they are)."""
  if not os.path.isdir(folder):
    return []
  return [name for name in sorted(os.listdir(folder))
          if name not in names and os.path.isdir(os.path.join(folder, name))
          and _holds_runs(os.path.join(folder, name), 2)]


def check_no_foreign_runs(folder: str, names: Sequence[str], what: str) -> None:
  """Raises ValueError naming the `foreign_run_folders` of `folder`, if any: `what` (the
  folders it expects, say "variant of X") they are not."""
  foreign = foreign_run_folders(folder, names)
  if foreign:
    raise ValueError(f"{folder} holds runs that are no {what} ({', '.join(foreign[:4])}"
                     f"{', ...' if len(foreign) > 4 else ''}): another sweep's, which could "
                     "not resume beside this report; use another workdir")


def result_if_finished(run_dir: str) -> Optional[dict]:
  """The run's result.json (checked: `runner.read_result`), or None where it has none."""
  path = os.path.join(run_dir, RESULT_FILE)
  return read_result(path) if os.path.exists(path) else None


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Optional[float]]:
  """Numbers (and None) kept, lists -> "name/i", dicts -> "name/key"; the rest dropped."""
  out = {}
  for k, v in metrics.items():
    key = f"{prefix}{k}"
    if isinstance(v, bool):
      out[key] = float(v)
    elif v is None or isinstance(v, (int, float)):
      out[key] = None if v is None else float(v)
    elif isinstance(v, (list, tuple)):
      out.update(flatten_metrics({str(i): x for i, x in enumerate(v)}, f"{key}/"))
    elif isinstance(v, Mapping):
      out.update(flatten_metrics(v, f"{key}/"))
  return out


def load_systems(config: ml_collections.ConfigDict, variant_dir: str,
                 seeds: Optional[Sequence[int]] = None):
  """(trainer, [final system per seed]) of a finished variant, from the final
  checkpoint of each seed (of `seeds` only, in that order, if given); `trainer.world` is
  the run's synthetic world."""
  spec = parse_config(config)
  trainer = Trainer(spec)
  dirs = run_dirs(config, variant_dir)
  like = checkpoint_like(trainer)
  systems = []
  for seed in dirs if seeds is None else seeds:
    run_dir = dirs[seed]
    if spec.config.train.num_steps not in checkpoint.available_steps(run_dir):
      raise FileNotFoundError(f"{run_dir} has no final checkpoint (step "
                              f"{spec.config.train.num_steps}); the run has not finished")
    state, _ = load_checkpoint(trainer, run_dir, spec.config.train.num_steps, like)
    systems.append(trainer.system(jax.device_put(state.params)))
  return trainer, systems


def _log_cached(what: str, name: str, count: int) -> None:
  if count:
    logging.info("%s: %d run(s) keep the values of their %s (--reprobe measures them "
                 "again)", what, count, name)


class Sweep:
  """One ablation at one preset in one workdir: runs, probes, statistics, report."""

  def __init__(self, ablation: Ablation, preset: str, workdir: str, *,
               seeds: Optional[int] = None, variants: Sequence[str] = (),
               overrides: Overrides = (), command: str = "",
               runner: Optional[Callable] = None, reprobe: bool = False):
    if preset not in PRESETS:
      raise ValueError(f"preset={preset!r}: use one of {tuple(PRESETS)}")
    n = SEEDS[preset] if seeds is None else seeds
    if n < 1:
      raise ValueError(f"seeds={n}: need at least 1 (2 give confidence intervals, 3 or "
                       "more useful ones)")
    for path, instead in SWEEP_SETS.items():
      if path in dict(overrides):
        raise ValueError(f"override of {path!r}: a sweep sets it itself; {instead}")
    self.ablation, self.preset, self.workdir, self.command = ablation, preset, workdir, command
    self.variants = select(ablation.variants(preset), variants, ablation.baseline)
    self.subset = len(self.variants) < len(ablation.variants(preset))
    self._runner = runner
    self._reprobe = reprobe
    self._measured: set[str] = set()   # run dirs whose probes this process wrote
    preset_cfg = preset_config(preset, ablation.experiment)
    cfg = apply_overrides(preset_cfg, ablation.preset_overrides.get(preset, {}))
    # The design without the user's overrides, whose metrics those must not take away.
    self._designed = copy.deepcopy(cfg)
    if ablation.task is not None:
      cfg = apply_overrides(cfg, {path: value for path, value in dict(overrides).items()
                                  if _has_path(cfg, path)})
      for c, given in ((cfg, dict(overrides)), (self._designed, {})):
        try:
          ablation.task(c, preset)
        except (TypeError, ValueError) as e:
          read = {p: v for p, v in given.items() if _has_path(c, p)}
          if read:   # it computes from them (`world.history_len=None`)
            raise ValueError(f"{ablation.name}'s task() failed on your overrides {read} "
                             f"({type(e).__name__}: {e}): check their values") from None
          if isinstance(e, ValueError):
            raise
          raise ValueError(f"{ablation.name}'s task() sets a value of the wrong type: {e}"
                           ) from None   # ml_collections' refusal of another type
    # What the ablation sets in every variant (its preset overrides and task), for `plan`:
    # of an extra evaluation split it adds, the fields that differ from a split's defaults.
    before, split = flatten(preset_cfg), flatten(split_config())
    default = lambda path, value: (path.startswith("extra_eval_splits.") and path not in before
                                   and split.get(path.split(".", 2)[2]) == value)
    self.task_settings = {path: value for path, value in flatten(cfg).items()
                          if before.get(path) != value and path not in dict(overrides)
                          and not default(path, value)}
    self.base = apply_overrides(cfg, dict(overrides))
    self.overrides = dict(overrides)   # the user's, for every variant (results.json)
    self.base.num_seeds = n   # (SWEEP_SETS)
    self.base.output.seed_subdirs = True
    self.seeds = list(range(self.base.seed, self.base.seed + n))
    ignored = [path for path in dict(overrides)
               if all(path in v.overrides for v in self.variants)]
    if ignored:
      raise ValueError(f"override of {ignored} would change nothing: every variant of "
                       f"{ablation.name!r} sets it itself (its arms or conditions)")
    check_workdir(workdir)
    check_report_folder(workdir, lambda r: r.get("ablation") == ablation.name,
                        f"the {ablation.name} sweep")   # (and again before writing)
    # (Beside its own report, runs of variants no longer in the design are this
    # ablation's, from before an edit of its grid: left alone.)
    if previous_results(workdir).get("ablation") != ablation.name:
      check_no_foreign_runs(workdir, [v.name for v in ablation.variants(preset)],
                            f"variant of {ablation.name} at preset {preset!r}")
    configs = [self.config(variant) for variant in self.variants]
    if self.base.mesh.distributed is True:   # before parse_config starts a backend
      for cfg in configs:
        check_config(cfg)
      initialize_from(self.base.mesh)
    specs = []
    for variant, cfg in zip(self.variants, configs):
      specs.append(parse_config(cfg))
      check_placement(specs[-1])
      check_run_dirs(cfg, self.variant_dir(variant))
    if runner is None:   # (another runner may report other metrics)
      self._check_metric_names(specs)

  def _check_metric_names(self, specs: Sequence[ExperimentSpec]) -> None:
    """Every curve is a metric its runs log, and every metric of an ablation without
    probes or derived metrics a final of its runs (both found by tracing a run), so that
    a misnamed one is refused before training, not found after it (a metric as an
    error, a curve as an empty panel)."""
    a = self.ablation
    check_finals = a.probe is None and a.joint_probe is None and a.derived is None
    if not check_finals and self.overrides:
      # A probe's metrics are known only once it has run, but an override can still take
      # away a final metric the ablation reports (`train.score_consistency=False`).
      variant = self.variants[0]
      designed = parse_config(apply_overrides(self._designed, variant.overrides))
      lost = metric_names(designed, logged=False).final - metric_names(specs[0],
                                                                        logged=False).final
      lost = [m for m in a.metrics if m in lost]
      if lost:
        raise ValueError(f"{a.name}: your overrides {self.overrides} take away metrics "
                         f"{lost} that it reports; leave those settings to the ablation")
    if not (check_finals or a.curves):
      return
    distinct = {json.dumps(jsonable(flatten(spec.config, skip=("optim",))), sort_keys=True): spec
                for spec in specs}   # (the optimizer changes no metric's name)
    finals, logged = set(), set()
    for spec in distinct.values():
      # A training chunk is traced (about as long again as the evaluation) only until
      # every curve is found: usually in the first variant's runs alone.
      find_curves = not _any_layer(a.curves) <= _any_layer(logged)
      if not (check_finals or find_curves):
        break
      names = metric_names(spec, logged=find_curves)
      finals |= names.final
      logged |= names.logged or set()
    if check_finals:
      top_level = ", ".join(sorted(m for m in finals if "/" not in m))
      self._refuse_unknown("metrics", [m for m in a.metrics if m not in finals | {"diverged"}],
                           finals, "final metrics", f"the {a.experiment} experiment's: "
                           f"{top_level}; plus train/loss, train/grad_norm and the per-action, "
                           "per-layer and per-split ones")
    if a.curves:
      examples = ", ".join(sorted(m for m in logged if m.count("/") == 1
                                  and m.startswith(("train/", "eval/"))))
      unknown = [c for c in a.curves if not _any_layer([c]) <= _any_layer(logged)]
      self._refuse_unknown("curves", unknown, logged, "logged metrics (metrics.jsonl keys)",
                           f"such as {examples}")

  def _refuse_unknown(self, field: str, missing: Sequence[str], known: set[str], kind: str,
                      examples: str) -> None:
    if missing:
      raise ValueError(f"{self.ablation.name}: {field} {did_you_mean(missing, known)} are not "
                       f"among its runs' {kind} at preset {self.preset!r} ({examples})")

  def config(self, variant: Variant) -> ml_collections.ConfigDict:
    """The full config of a variant (all seeds)."""
    return apply_overrides(self.base, variant.overrides)

  def variant_dir(self, variant: Variant) -> str:
    return os.path.join(self.workdir, variant.name)

  def run_dir(self, variant: Variant, seed: int) -> str:
    return seed_dir(self.variant_dir(variant), seed)

  def plan(self) -> str:
    """What `run` would do, as text: each variant's overrides on top of the base config,
    and how many of its seeds are finished already (reused) or still to train."""
    a, t = self.ablation, self.base.train
    lines = [f"{a.name} at preset {self.preset!r}: {len(self.variants)} variants x "
             f"{len(self.seeds)} seeds {self.seeds}, {t.num_steps} steps of batch "
             f"{t.batch_size} each, into {self.workdir}"
             + (f"; your overrides {self.overrides}" if self.overrides else "")
             + ("; --reprobe: every finished run's probes are measured again"
                if self._reprobe and (a.probe or a.joint_probe) else "")]
    if self.task_settings:
      lines.append("  every variant: " + ", ".join(f"{k}={v!r}"
                                                   for k, v in self.task_settings.items()))
    now = provenance.running_code_version()
    for variant in self.variants:
      done = finished_seeds(self.config(variant), self.variant_dir(variant))
      state = (f"{len(done)} of {len(self.seeds)} seeds finished (reused)" if done
               else "to train")
      other = sorted({c for c in (result_if_finished(self.run_dir(variant, k)).get("code")
                                  for k in done) if c is not None and c != now})
      if other:   # as `run_experiment` warns when it reuses them
        state += f", trained by other code ({', '.join(other)}; this checkout: {now})"
      settings = ", ".join(f"{k}={v!r}" for k, v in variant.overrides.items())
      baseline = " (baseline)" if variant.arm == a.baseline else ""
      lines.append(f"  {variant.name}{baseline}: {settings or 'the base config'}; {state}")
    lines.append(f"metrics: {', '.join(a.metrics)}")
    return "\n".join(lines)

  def run(self) -> dict:
    """Trains what is missing, probes, writes results.json, REPORT.md and the plots."""
    runner = self._runner or functools.partial(run_experiment, progress=_log_evaluation,
                                               on_start=_log_start)
    os.makedirs(self.workdir, exist_ok=True)
    start = time.time()
    for i, variant in enumerate(self.variants):
      logging.info("[%s %d/%d] %s", self.ablation.name, i + 1, len(self.variants),
                   variant.name)
      cfg = self.config(variant)
      reused = finished_seeds(cfg, self.variant_dir(variant))
      if reused:
        logging.info("  %d of %d seeds finished earlier and are reused (their code is in "
                     "result.json; delete %s to train them again)", len(reused),
                     len(self.seeds), self.variant_dir(variant))
      runner(cfg, self.variant_dir(variant))
      if self.ablation.probe is not None:
        self._probe(variant, cfg)
      jax.clear_caches()  # every variant compiles its own programs: keep memory flat
    if self.ablation.joint_probe is not None:
      self._joint_probe()
    logging.info("%s: %d variants x %d seeds in %.0f s", self.ablation.name,
                 len(self.variants), len(self.seeds), time.time() - start)
    return self.write()

  def write(self) -> dict:
    """results.json, REPORT.md and the plots from the finished runs (with a warning when
    they replace a report of more variants or seeds: a rerun with fewer)."""
    results = self.results()
    if not writes_outputs():
      return results
    remove_temporaries(self.workdir, keep_live_writers=True)   # of a killed earlier writer
    # Checked again: another sweep, started in this workdir while this one trained, may
    # have written its report since (both passed the check at the start).
    check_report_folder(self.workdir, lambda r: r.get("ablation") == self.ablation.name,
                        f"the {self.ablation.name} sweep")
    path = os.path.join(self.workdir, "results.json")
    before = previous_results(self.workdir)
    lost_variants = sorted(set(before.get("variants") or ()) - set(results["variants"]))
    lost_seeds = sorted(set(before.get("seeds") or ()) - set(results["seeds"]))
    if lost_variants or lost_seeds:
      logging.warning("the report now covers fewer runs than the one it replaces (left out: "
                      "variants %s, seeds %s; their runs stay in %s): run the sweep with all "
                      "of them to report them again", lost_variants, lost_seeds, self.workdir)
    write_json(path, results)
    report.write_report(results, self.workdir, self.ablation.curves, self.ablation.plots)
    return results

  def _probeable(self, variant: Variant, seed: int) -> bool:
    """Whether the run has finished without diverging (probes need its final model)."""
    result = result_if_finished(self.run_dir(variant, seed))
    return result is not None and not result["diverged"]

  def _cached(self, variant: Variant, seed: int, name: str) -> bool:
    """Whether the run's probe file `name` is there and this sweep may use it (one that is
    no JSON object, damaged from outside, is measured again). Clears the partial files
    of a killed probe writer from the run's directory."""
    run_dir = self.run_dir(variant, seed)
    if writes_outputs():
      remove_temporaries(run_dir, keep_live_writers=True)
    path = os.path.join(run_dir, name)
    if self._reprobe or not os.path.exists(path):
      return False
    try:
      if isinstance(read_json_if_exists(path), dict):
        return True
    except ValueError:
      pass
    logging.warning("%s cannot be read as a JSON object: measuring it again", path)
    return False

  def _probe(self, variant: Variant, cfg: ml_collections.ConfigDict) -> None:
    done = [seed for seed in self.seeds if self._probeable(variant, seed)]
    todo = [seed for seed in done if not self._cached(variant, seed, PROBES_FILE)]
    _log_cached(variant.name, PROBES_FILE, len(done) - len(todo))
    if todo:
      trainer, systems = load_systems(cfg, self.variant_dir(variant), todo)
      for seed, system in zip(todo, systems):
        ctx = RunContext(self.run_dir(variant, seed), seed, variant, self.preset,
                         trainer.spec, trainer.world, system)
        write_json(os.path.join(ctx.run_dir, PROBES_FILE),
                   flatten_metrics(self.ablation.probe(ctx)))
    for seed in done:
      self._probe_events(self.run_dir(variant, seed), PROBES_FILE, fresh=seed in todo)

  def _probe_events(self, run_dir: str, name: str, fresh: bool) -> None:
    """The TensorBoard copy of a run's probe file `name`, at the run's last step: written
    after a measurement, and for a cached one when it is missing (a sweep probed before
    probes reached TensorBoard)."""
    tag = _probe_tag(name)
    if not writes_outputs():
      return
    if fresh:
      self._measured.add(run_dir)
    if fresh or event_file_name(run_dir, tag) is None:
      write_event_file(run_dir, tag, read_json_if_exists(os.path.join(run_dir, name)) or {},
                       result_if_finished(run_dir)["steps"])

  def _joint_probe(self) -> None:
    """`Ablation.joint_probe` of every seed with a run that lacks joint_probes.json."""
    for seed in self.seeds:
      variants = [v for v in self.variants if self._probeable(v, seed)]
      if all(self._cached(v, seed, JOINT_PROBES_FILE) for v in variants):
        _log_cached(f"seed {seed}", JOINT_PROBES_FILE, len(variants))
        for v in variants:
          self._probe_events(self.run_dir(v, seed), JOINT_PROBES_FILE, fresh=False)
        continue
      contexts = []
      for v in variants:
        trainer, (system,) = load_systems(self.config(v), self.variant_dir(v),
                                          [seed])
        contexts.append(RunContext(self.run_dir(v, seed), seed, v, self.preset, trainer.spec,
                                   trainer.world, system))
      found = list(self.ablation.joint_probe(contexts))
      if len(found) != len(contexts):
        raise ValueError(f"{self.ablation.name}: joint_probe returned {len(found)} results "
                         f"for {len(contexts)} runs; it must return one per run, in order")
      for ctx, metrics in zip(contexts, found):
        write_json(os.path.join(ctx.run_dir, JOINT_PROBES_FILE), flatten_metrics(metrics))
        self._probe_events(ctx.run_dir, JOINT_PROBES_FILE, fresh=True)
      self._drop_joint_probes_apart_from(seed, variants)
      jax.clear_caches()

  def _drop_joint_probes_apart_from(self, seed: int, measured: Sequence[Variant]) -> None:
    """Removes the joint probes of `seed`'s runs of the ablation's other variants (left
    out by --variants), measured in another session than `measured` were: a later sweep
    over every variant measures them all together again, instead of comparing values
    measured apart (throughputs under other load, say)."""
    if not writes_outputs():
      return
    names = {v.name for v in measured}
    for v in self.ablation.variants(self.preset):
      run_dir = self.run_dir(v, seed)
      if v.name not in names and os.path.exists(os.path.join(run_dir, JOINT_PROBES_FILE)):
        logging.info("%s: joint probes removed, to be measured again with the others",
                     run_dir)
        os.remove(os.path.join(run_dir, JOINT_PROBES_FILE))
        events = event_file_name(run_dir, _probe_tag(JOINT_PROBES_FILE))
        if events is not None:
          os.remove(events)

  def per_seed(self, variant: Variant
               ) -> tuple[dict[str, list], list, set, list, dict, dict[str, list[str]]]:
    """metric -> per-seed values (None for a diverged run), the divergence steps, every
    metric name the finished runs provide, the code version each run recorded (None for
    runs from before `result.json` held it, or from outside a git checkout without
    `PHOENIX_FLAX_CODE_VERSION`), metric ->
    the Bayes-optimal value each finished run reported beside it (`bayes_counterpart`),
    and metric -> the finished runs that report no such key at all (a null is a measured
    NaN; no key, results of older code)."""
    values = {m: [] for m in self.ablation.metrics}
    bayes = {m: [] for m in self.ablation.metrics}
    diverged_at, available, codes, lacking = [], set(), [], {}
    for seed in self.seeds:
      run_dir = self.run_dir(variant, seed)
      result = result_if_finished(run_dir)
      if result is None:
        raise FileNotFoundError(f"{run_dir}/result.json is missing: that run has not "
                                "finished; run the sweep (not only the report) again")
      diverged = result["diverged"]
      codes.append(result.get("code"))
      diverged_at.append(result.get("diverged_at_step") if diverged else None)
      found = flatten_metrics(result["final"])
      for probes_file in (PROBES_FILE, JOINT_PROBES_FILE):
        found.update(flatten_metrics(read_json_if_exists(os.path.join(run_dir, probes_file)) or {}))
      if self.ablation.derived is not None:
        derived = flatten_metrics(self.ablation.derived(found))
        found.update(derived)
        if (not diverged and writes_outputs()   # again whenever its probes were measured
            and (self._reprobe or run_dir in self._measured
                 or event_file_name(run_dir, "derived") is None)):
          write_event_file(run_dir, "derived", derived, result["steps"])   # TensorBoard's copy
      if not diverged:   # (a NaN is stored as null: reported, as n/a)
        available.update(found)
        for m in self.ablation.metrics:
          if m != "diverged" and m not in found:
            lacking.setdefault(m, []).append(run_dir)
      for m in values:
        if m == "diverged":
          values[m].append(float(diverged))
        else:
          values[m].append(None if diverged else found.get(m))
          ceiling = bayes_counterpart(m, found)
          if ceiling is not None and not diverged and found[ceiling] is not None:
            bayes[m].append(found[ceiling])
    return (values, diverged_at, available, codes, {m: b for m, b in bayes.items() if b},
            lacking)

  def training(self) -> dict:
    """How long the base config trains and what it evaluates on (results.json's
    "training")."""
    t = self.base.train
    return {"num_steps": t.num_steps, "batch_size": t.batch_size,
            "eval_batches": t.eval_batches, "eval_batch_size": t.eval_batch_size,
            "eval_lists": t.eval_batches * t.eval_batch_size, "eval_seed": self.base.eval_seed}

  def results(self) -> dict:
    """The results.json dict (see the module docstring)."""
    ab = self.ablation
    variants, available, finished, run_codes, lacking = {}, set(), False, {}, {}
    for v in self.variants:
      values, diverged_at, found, codes, bayes, lacks = self.per_seed(v)
      for m, dirs in lacks.items():
        lacking.setdefault(m, []).extend(dirs)
      for code in codes:   # how many runs each code version trained
        run_codes[code or "not recorded"] = run_codes.get(code or "not recorded", 0) + 1
      available |= found
      finished |= any(x is None for x in diverged_at)
      variants[v.name] = {
          "arm": v.arm, "cell": v.cell, "overrides": dict(v.overrides),
          "seeds": list(self.seeds),
          "diverged": sum(x is not None for x in diverged_at),
          "diverged_at_step": diverged_at,
          "metrics": {m: stats.summarize(vals) for m, vals in values.items()},
          "bayes": {m: sum(b) / len(b) for m, b in bayes.items()}}
    missing = [m for m in ab.metrics if m != "diverged" and m not in available]
    if finished and missing:
      stale = ((ab.probe is not None or ab.joint_probe is not None) and not self._reprobe)
      raise SweepError(
          f"{ab.name}: metrics {did_you_mean(missing, available)} are in no run's "
          f"result.json, probes.json or joint_probes.json ({len(available)} metrics are)"
          + ("; finished runs keep the probes.json and joint_probes.json of the probe code "
             "that measured them: if a probe changed since, run again with --reprobe"
             if stale else "")
          + "; runs trained by code from before a metric existed lack it: use a new "
          "--workdir, or delete the variants' folders to train them again")
    # Some runs report a metric that others lack: older code made the latter, and their
    # missing values would pass for diverged runs in the statistics.
    partial = {m: dirs for m, dirs in lacking.items() if m in available}
    if partial:
      dirs = sorted({d for found in partial.values() for d in found})
      raise SweepError(
          f"{ab.name}: {len(dirs)} finished run(s) lack metrics {sorted(partial)} that "
          f"other runs report ({', '.join(dirs[:3])}{', ...' * (len(dirs) > 3)}): older "
          "code made them. A probe's metric: run again with --reprobe, which measures "
          "every run's probes afresh; a metric of result.json: delete those runs' folders "
          "to train them again")
    axes = ab.conditions(self.preset) if ab.conditions else {}
    return {"ablation": ab.name, "experiment": ab.experiment, "preset": self.preset,
            "baseline": ab.baseline,
            "primary_metric": ab.primary_metric, "headline": list(ab.headline),
            "metrics": list(ab.metrics), "curves": list(ab.curves),
            "better": {m: better(m, ab.better) for m in ab.metrics},
            "hypothesis": hypothesis(ab.doc), "design": design(ab.doc),
            "training": self.training(),
            "variants_run": [v.name for v in self.variants] if self.subset else None,
            "overrides": self.overrides, "command": self.command,
            "seeds": list(self.seeds),
            "arms": list(dict.fromkeys(v.arm for v in self.variants)),
            "conditions": {axis: list(levels) for axis, levels in axes.items()},
            "variants": variants,
            **analysis.compare(variants, {axis: list(levels) for axis, levels in axes.items()},
                               ab.baseline, ab.metrics),
            "environment": {**environment(), "run_codes": dict(sorted(run_codes.items()))}}


def _any_layer(names) -> set[str]:
  """Metric names with their layer index dropped (a per-layer curve names any layer)."""
  return {_LAYER.sub("/layer_", m) for m in names}


def did_you_mean(names: Sequence[str], known: set[str]) -> str:
  """`names`, quoted, each with the nearest of `known` where one is close."""
  near = {m: difflib.get_close_matches(m, sorted(known), n=1) for m in names}
  return ", ".join(f"{m!r}" + (f" (did you mean {near[m][0]!r}?)" if near[m] else "")
                   for m in names)


def bayes_counterpart(metric: str, finals: Mapping[str, Any]) -> Optional[str]:
  """The final that holds the generator's Bayes-optimal value of `metric`: "bayes_" before
  one part of its name ("auc_mean" -> "bayes_auc_mean", "long_list/auc_mean" ->
  "long_list/bayes_auc_mean", "auc/click_score" -> "bayes_auc/click_score"); None when
  the runs report none (probe outputs, derived metrics, "diverged")."""
  parts = metric.split("/")
  for i in range(len(parts)):
    name = "/".join(parts[:i] + ["bayes_" + parts[i]] + parts[i + 1:])
    if name in finals:
      return name
  return None


def environment() -> dict:
  """What produced the numbers: Python, JAX and NumPy versions, the git state of the code
  this process runs (`provenance.running_code_version`: the commit when it started, with
  "+changes.<digest>" when the Python files of phoenix_flax/, ablations/ or experiments/
  had uncommitted edits; outside a git checkout `PHOENIX_FLAX_CODE_VERSION`, else None)
  and the processor (`provenance.machine`)."""
  return {"python": sys.version.split()[0], "jax": jax.__version__,
          "jaxlib": jaxlib.__version__, "numpy": np.__version__,
          "code": provenance.running_code_version(), "machine": provenance.machine()}


def better(metric: str, extra: Optional[Mapping[str, str]] = None) -> Optional[str]:
  """Which direction is an improvement: by full name, else by the name after the split
  prefix ("long_list/auc_mean" -> "auc_mean"), else a metric at a K by its "<name>@K"
  entry ("recall@10" -> "recall@K"; `bayes_recall@10`, the generator's, has none)."""
  table = {**BETTER, **(extra or {})}
  name = metric.rsplit("/", 1)[-1]
  return table.get(metric, table.get(name, table.get(_AT_K.sub("@K", name))))


def select(variants: Sequence[Variant], names: Sequence[str], baseline: str
           ) -> list[Variant]:
  """The variants named (by variant or arm name; all when `names` is empty), plus the
  baseline variant of each of their cells, which every comparison needs."""
  if not names:
    return list(variants)
  known = {v.name for v in variants} | {v.arm for v in variants}
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(f"--variants: unknown {unknown}; choose from {sorted(known)}")
  chosen = [v for v in variants if v.name in names or v.arm in names]
  cells = {v.cell for v in chosen}
  return [v for v in variants if v in chosen or (v.arm == baseline and v.cell in cells)]


def design(doc: str) -> str:
  """A script docstring's paragraphs after the first, except "Hypothesis:" (task knobs,
  variants, metrics), each on one line, separated by blank lines."""
  paragraphs = [" ".join(p.split()) for p in (doc or "").strip().split("\n\n")]
  return "\n\n".join(p for p in paragraphs[1:] if p and not p.startswith("Hypothesis:"))


def hypothesis(doc: str) -> str:
  """A script docstring's first paragraph and its "Hypothesis:" paragraph, each on one
  line, separated by a blank line."""
  paragraphs = [" ".join(p.split()) for p in (doc or "").strip().split("\n\n")]
  keep = paragraphs[:1] + [p for p in paragraphs[1:] if p.startswith("Hypothesis:")]
  return "\n\n".join(keep)


FLAGS = flags.FLAGS
flags.DEFINE_enum("preset", "cpu", list(PRESETS),
                  "smoke: a tiny world and model, for tests (a sweep still takes a "
                  "minute or two on 2 CPU cores, mostly compilation); cpu: about 3-15 "
                  "minutes an ablation on 2 CPU cores (sandwich_norm, 16 variants x 3 "
                  "seeds, the longest); full: accelerator scale.")
flags.DEFINE_integer("seeds", None, "Seeds per variant (default: 2 smoke, 3 cpu, 5 full).")
flags.DEFINE_string("workdir", None,
                    f"Output directory (default: {DEFAULT_ROOT}/<preset>/<ablation>; for "
                    f"ablations.run_all, {DEFAULT_ROOT}/<preset>). "
                    "Re-running with the same one resumes and skips finished runs.")
flags.DEFINE_list("variants", [], "Comma-separated variants or arms to run (default: all); "
                  "the baseline runs too, every comparison needs it. Single ablation "
                  "scripts only (ablations.run_all refuses it). The report's Holm "
                  "correction then covers fewer comparisons than the whole sweep's.")
flags.DEFINE_multi_string("override", [],
                          "Config override for every variant, repeatable, e.g. "
                          "--override=train.num_steps=600 --override=optim.warmup_steps=50. "
                          "The ablated switch and the condition axes are set after it; "
                          "an override that every variant sets itself is refused.")
flags.DEFINE_bool("reprobe", False,
                  "Measure the probes of every finished run again instead of using their "
                  "cached probes.json / joint_probes.json (after changing a probe).")
flags.DEFINE_bool("dry_run", False,
                  "Build and check the sweep (variants, their configs, metric names, the "
                  "workdir's existing runs) and print what it would train, then exit "
                  "without training or writing anything.")


SWEEP_FLAGS = ("preset", "seeds", "workdir", "variants", "override", "reprobe", "dry_run")


def expose_flags() -> None:
  """Lists the sweep flags in the running script's `--help`."""
  for name in SWEEP_FLAGS:
    FLAGS.register_key_flag_for_module(sys.argv[0], FLAGS[name])


def _log_start(seeds: list[int], step: int) -> None:
  """A line when a variant's seeds start training: from the start, or resumed from the
  checkpoint of a killed earlier sweep."""
  logging.info("  seeds %s: %s", seeds,
               f"resumed from the checkpoint of step {step}" if step else
               "training from the start (compiling first)")


def _log_evaluation(p) -> None:
  """A line per evaluation while a variant trains (its seeds side by side)."""
  if not p.evaluated:
    return
  values = lambda key: " ".join(f"{x:.4f}" for x in p.evaluated[key])
  shown = [k for k in ("eval/auc_mean", "eval/bayes_auc_mean", "eval/auc", "eval/loss")
           if k in p.evaluated]
  recall = [k for k in p.evaluated if k.startswith("eval/recall@")]
  if recall and "eval/auc_mean" not in p.evaluated:   # retrieval: its largest K, and the oracle's
    top = max(recall, key=lambda k: int(k.rpartition("@")[2]))
    shown += [top, top.replace("eval/", "eval/bayes_")]
  logging.info("  step %d/%d | train loss %s | %s", p.step, p.num_steps,
               " ".join(f"{x:.4f}" for x in p.loss),
               " | ".join(f"{k} {values(k)}" for k in shown))


def default_workdir(preset: str, name: Optional[str] = None) -> str:
  """Where a sweep of ablation `name` writes without --workdir (`name` None: the folder of
  every ablation's, `ablations.run_all`'s)."""
  return os.path.join(DEFAULT_ROOT, preset, *([name] if name else []))


def workdir_from_flags(name: Optional[str] = None) -> str:
  """--workdir, or `default_workdir` where the flag is left out. An empty one
  (`--workdir=$WD` with WD unset) exits with a usage error: read as the default, it
  trained into, and resumed from, the shared default folder."""
  if FLAGS.workdir is not None and not FLAGS.workdir.strip():
    usage_error("--workdir is empty: give a directory, or leave the flag out for "
                f"{default_workdir(FLAGS.preset, name)}")
  return FLAGS.workdir or default_workdir(FLAGS.preset, name)


def command_line() -> str:
  """The command that started this process, as `python -m module ...`."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
  return " ".join(shlex.quote(a) for a in head + sys.argv[1:])


def where_to_look(report: str, workdir: str) -> str:
  """The lines a finished sweep prints: its report, and the command that shows its curves
  (quoted, so it can be pasted whatever characters the workdir holds)."""
  return f"Report: {report}\nCurves: tensorboard --logdir {shlex.quote(workdir)}"


def sweep_from_flags(ablation: Ablation, workdir: Optional[str] = None) -> Sweep:
  """A `Sweep` configured by the command-line flags."""
  return Sweep(ablation, FLAGS.preset,
               workdir or workdir_from_flags(ablation.name),
               seeds=FLAGS.seeds, variants=FLAGS.variants,
               overrides=dict(parse_override(o) for o in FLAGS.override),
               command=command_line(), reprobe=FLAGS.reprobe)


@contextlib.contextmanager
def exit_on_interrupt() -> Iterator[None]:
  """`cli.exit_on_run_errors` with the sweep's resume hint; a `SweepError` ends the
  script with its message, too."""
  with exit_on_run_errors("Run the same command again to go on with the sweep."):
    try:
      yield
    except SweepError as e:
      usage_error(str(e), flags_hint=False)


def main(ablation: Ablation) -> None:
  """Entry point of an ablation script: `sweep.main(ABLATION)` under `__main__`."""

  def _main(argv):
    if len(argv) > 1:
      usage_error(f"unexpected arguments: {argv[1:]}")
    with exit_on_interrupt():   # a Ctrl-C while it checks the variants, too
      try:
        sweep = sweep_from_flags(ablation)
      except (ValueError,) + RUN_ERRORS as e:
        usage_error(str(e))
      if FLAGS.dry_run:
        print(sweep.plan())
        return
      sweep.run()
    print(where_to_look(os.path.join(sweep.workdir, "REPORT.md"), sweep.workdir))

  expose_flags()
  quiet_backend_search()
  run_app(_main, flags_parser=parse_flags)
