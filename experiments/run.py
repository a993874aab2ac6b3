r"""Train and evaluate one configuration on the synthetic world.

    python -m experiments.run --config=experiments/configs/ranking.py --workdir=/tmp/rank
    python -m experiments.run --config=experiments/configs/ranking.py:smoke \
        --config.model.num_layers=4 --config.num_seeds=3 --workdir=/tmp/rank_l4

Writes TensorBoard events, config.json, metrics.jsonl, checkpoints and result.json to the
workdir (one seed) or to `<workdir>/seed_<k>/` (several seeds). Re-running the same
command resumes an interrupted run from its last checkpoint and skips a finished one.
Ctrl-C (SIGINT) or SIGTERM stops at the end of the current chunk with a checkpoint (exit
status 130 or 143); a second one, or one before training starts, stops at once (while
the training program compiles: when the compiler returns), saying so.
Prints what it is about to train (and from which checkpoint), one progress line per host
call (steps/s, examples/s, loss, ETA) and the final metrics. An invalid flag or config
value exits with status 2 and a message naming it, before any work starts.
"""

from __future__ import annotations

import math
import os
import sys

from absl import flags
import jax
from ml_collections import config_flags

if not __package__:  # run by path, not with python -m: import this checkout's packages
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments.cli import (checked_config, exit_on_run_errors, fail, parse_config_flags,
                             quiet_backend_search, run_app)
from phoenix_flax.training import Progress, parse_config, run_dirs, run_experiment
from phoenix_flax.training.schema import ConfigError, flatten
from phoenix_flax.training.runner import check_placement, finished_seeds

_CONFIG = config_flags.DEFINE_config_file(
    "config", None,
    "Experiment config file, optionally with a preset after a colon: "
    "experiments/configs/ranking.py (ranking task, default preset 'cpu'), "
    "experiments/configs/ranking.py[:smoke|full], experiments/configs/retrieval.py[:smoke|full]. "
    "Any field can then be overridden with --config.<section>.<field>=<value>, e.g. "
    "--config.model.num_layers=4, --config.optim.learning_rate=1e-3, "
    "--config.model.attn_logit_cap=None, --config.num_seeds=3. Sections: task, seed, "
    "num_seeds, world_seed, eval_seed, world.* (synthetic world), train_split.* and "
    "eval_split.* (how batches are drawn), model.* (shape and ablation switches), "
    "optim.* (AdamW, warmup + cosine, clipping), train.* (steps, batch, eval and "
    "checkpoint cadence), extra_eval_splits.<name>.* (more evaluation splits: a config "
    "file defines them with schema.split_config(); --config.extra_eval_splits.<name>.<field> "
    "changes a field of a split the file defines), ranking.*, retrieval.*, "
    "mesh.* (devices, sharding, multi-host), output.*; "
    "every field is documented in phoenix_flax/training/schema.py; --print_config "
    "lists them with their values.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None,
    "Output directory of the run (created if missing). Re-using it resumes an "
    "interrupted run and skips a finished one; a different config there is an error.")
_QUIET = flags.DEFINE_bool(
    "quiet", False, "Print only the final summary, not a progress line per host call.")
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False,
    "Check --config (with its overrides; a single-host config also against this host's "
    "devices and memory, which starts JAX's backend) and print every field as "
    "`path = value`, then exit without training; needs no --workdir. The fields are "
    "documented in phoenix_flax/training/schema.py.")


def _duration(seconds: float) -> str:
  """h:mm:ss, or "?" while unknown (NaN: before the first chunk that did not compile)."""
  if math.isnan(seconds):
    return "?"
  seconds = int(max(seconds, 0))
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _recall_metrics(config) -> tuple[str, ...]:
  """`recall@K` for each K of a retrieval config (none for ranking)."""
  if config.task != "retrieval":
    return ()
  return tuple(f"recall@{k}" for k in tuple(config.retrieval.recall_k))


def headline_metrics(config) -> tuple[str, ...]:
  """The final metrics the summary prints: AUCs and log-loss, and for the retrieval task
  the recall at each of the config's K next to its Bayes reference and the recall of the
  most engaged posts' list."""
  return (("auc_mean", "bayes_auc_mean", "logloss", "auc", "bayes_auc")
          + tuple(f"{p}{m}" for m in _recall_metrics(config)
                  for p in ("", "bayes_", "popularity_")))


def progress_keys(config) -> tuple[str, ...]:
  """The evaluation metrics a progress line shows: the mean AUC, and for the retrieval
  task the recall at the config's first K (recall_k is validated later, by
  run_experiment)."""
  return ("eval/auc_mean",) + tuple(f"eval/{m}" for m in _recall_metrics(config)[:1])


def start_line(config, seeds: list[int], step: int) -> str:
  """What a run is about to do, printed before it compiles (so on CPU its first progress
  line comes tens of seconds later): which seeds, from which step,
  how many steps of which batch, and how often a progress line follows."""
  t = config.train
  who = (f"seed {seeds[0]}" if len(seeds) == 1 else
         f"seeds {', '.join(map(str, seeds))} (trained together)")
  start = (f"resumed from the checkpoint at step {step}" if step else "starting")
  if step >= t.num_steps:
    return f"{who}: {start}, the last; evaluating"
  return (f"{who}: {start}; {t.num_steps - step} steps of batch {t.batch_size} to go, a "
          f"progress line every {t.steps_per_call}; compiling the training and evaluation "
          "programs first")


def print_progress(p: Progress, batch_size: int,
                   eval_keys: tuple[str, ...] = ("eval/auc_mean",)) -> None:
  """One line per host call: step, rate, loss, ETA (plus `eval_keys` when evaluated).
  The first chunk of a process shows its time, with the training program's compile,
  instead of a rate. `batch_size` is one seed's: examples/s counts the seeds trained in
  this call (one loss each), which are fewer than the config's when some finished before."""
  loss = " ".join(f"{x:.4f}" for x in p.loss)
  if p.compiling:
    seconds = (p.step - p.start_step) / p.steps_per_second
    rate = f"compiled and ran in {seconds:.1f}s"
  else:
    examples = p.steps_per_second * batch_size * len(p.loss)
    rate = f"{p.steps_per_second:.1f} steps/s | {examples:.0f} ex/s"
  line = (f"step {p.step}/{p.num_steps} ({100 * p.step / p.num_steps:3.0f}%) | {rate} "
          f"| loss {loss} | eta {_duration(p.eta_seconds)}")
  if p.num_diverged:
    line += f" | diverged {p.num_diverged}"
  for key in eval_keys:
    if key in p.evaluated:
      line += f" | {key} " + " ".join(f"{x:.4f}" for x in p.evaluated[key])
  if "eval/bayes_auc_mean" in p.evaluated:
    line += " (bayes " + " ".join(f"{x:.4f}" for x in p.evaluated["eval/bayes_auc_mean"]) + ")"
  print(line, flush=True)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}; every option is a --flag")
  config = checked_config(_CONFIG.value)
  if not (_WORKDIR.value or "").strip() and not _PRINT_CONFIG.value:
    fail("--workdir is required")
  if _PRINT_CONFIG.value:
    # The mesh and the training state's memory against this host's devices, as the run
    # checks them (one device too: a state that cannot fit it is refused); a multi-host
    # mesh is known only once its processes have joined (the run checks it): no backend
    # is started for it.
    if not config.mesh.distributed:
      try:
        check_placement(parse_config(config))
      except ConfigError as e:
        fail(str(e))
      except RuntimeError as e:   # no backend to ask (a device another process holds)
        print(f"(the mesh is not checked: JAX's backend did not start: {e})", file=sys.stderr)
    text = "".join(f"{path} = {value!r}\n" for path, value in flatten(config).items())
    try:
      sys.stdout.write(text)
      sys.stdout.flush()
    except BrokenPipeError:   # `| head`: the reader has what it wanted
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError as e:      # a full disk, say: the fields did not all arrive
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (exit's flush too)
      sys.stderr.write(f"error: --print_config could not write the config: {e}\n")
      sys.exit(1)
    return
  eval_keys = progress_keys(config)
  report = None if _QUIET.value else (
      lambda p: print_progress(p, config.train.batch_size, eval_keys))
  start = None if _QUIET.value else (
      lambda seeds, step: print(start_line(config, seeds, step), flush=True))
  with exit_on_run_errors():
    done_before = finished_seeds(config, _WORKDIR.value)   # (config checked above)
    results = run_experiment(config, _WORKDIR.value, progress=report, on_start=start)
  if jax.process_index() != 0:   # process 0 wrote the files and says so
    return
  dirs = run_dirs(config, _WORKDIR.value)
  for seed, r in results.items():
    final = r["final"]
    summary = " ".join(f"{k}={final[k]:.4f}" for k in headline_metrics(config)
                       if isinstance(final.get(k), float))
    state = f"diverged at step {r['diverged_at_step']}" if r["diverged"] else "finished"
    skipped = (" (an earlier run; skipped: delete its directory to train it again)"
               if seed in done_before else "")
    print(f"seed {seed}: {state} after {r['steps']} steps in {r['wall_seconds']:.0f}s"
          f"{skipped} | {summary} | {dirs[seed]}/result.json", flush=True)


if __name__ == "__main__":
  quiet_backend_search()
  run_app(main, flags_parser=parse_config_flags)
