"""Runs every ablation at one preset and writes one combined report.

    python -m ablations.run_all --preset=cpu --workdir=/tmp/phoenix_ablations/cpu

Each ablation writes its runs, results.json, REPORT.md and plots to
`<workdir>/<ablation>/`; `<workdir>/REPORT.md` gathers their verdicts and effect plots,
and `<workdir>/results.json` maps each ablation to its results. Re-running the command
resumes an interrupted sweep and skips finished runs. The flags are those of the single
ablation scripts (`--preset`, `--seeds`, `--workdir`, `--override`, `--reprobe`,
`--dry_run`; not `--variants`, which names one script's variants), plus `--ablations`.
"Every ablation" is every script named in `ablations.SCRIPTS`.
"""

import os
import sys

from absl import flags, logging

if not __package__:  # run by path, not with python -m: import this checkout's packages
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import ablations
from ablations import report, sweep
from experiments.cli import repeated
from phoenix_flax.training.writers import remove_temporaries

ABLATIONS = {m.ABLATION.name: m.ABLATION for m in ablations.modules()}

flags.DEFINE_list("ablations", list(ABLATIONS),
                  f"Comma-separated ablations to run (default: all of {list(ABLATIONS)}).")
FLAGS = flags.FLAGS


def make_sweeps(names, workdir: str, make_sweep=sweep.sweep_from_flags) -> list:
  """The named ablations' sweeps into `<workdir>/<name>/`, every config built and checked
  (and every existing run directory against it, and the combined report's folder) before
  any training starts."""
  if not sweep.previous_results(workdir):   # (one there is run_all's, or refused below)
    sweep.check_no_foreign_runs(workdir, list(ABLATIONS), "ablation's sweep folder")
  sweeps = [make_sweep(ABLATIONS[name], os.path.join(workdir, name)) for name in names]
  sweep.check_report_folder(
      workdir, lambda r: all(isinstance(v, dict) and v.get("ablation") == k
                             for k, v in r.items()), "ablations.run_all")
  return sweeps


def run_all(names, sweeps: list, workdir: str, command: str = "") -> str:
  """Runs the named ablations' sweeps (`make_sweeps`), then writes the combined
  results.json and REPORT.md; returns the REPORT.md path."""
  entries = []
  for name, sw in zip(names, sweeps):
    logging.info("=== %s ===", name)
    entries.append((name, sw.run()))
  path = os.path.join(workdir, "REPORT.md")
  if not sweep.writes_outputs():
    return path
  previous = sweep.previous_results(workdir)
  dropped = sorted(set(previous) - set(names))
  if dropped:
    logging.warning("the combined results.json and REPORT.md now cover %s only, no longer "
                    "%s (their sweeps stay in their directories; name them in --ablations "
                    "to report them together again)", list(names), dropped)
  remove_temporaries(workdir, keep_live_writers=True)   # of a killed earlier writer
  sweep.write_json(os.path.join(workdir, "results.json"), dict(entries))
  report.write_atomic(path, report.combined_markdown(entries, workdir, sweeps[0].preset,
                                                     command))
  return path


def main(argv):
  if len(argv) > 1:
    sweep.usage_error(f"unexpected arguments: {argv[1:]}")
  if not FLAGS.ablations:
    sweep.usage_error(f"--ablations is empty; name one or more of {list(ABLATIONS)}")
  unknown = [n for n in FLAGS.ablations if n not in ABLATIONS]
  if unknown:
    sweep.usage_error(f"--ablations: unknown {unknown}; choose from {list(ABLATIONS)}")
  twice = repeated(FLAGS.ablations)
  if twice:
    sweep.usage_error(f"--ablations names {twice} more than once")
  if FLAGS.variants:
    sweep.usage_error("--variants selects variants of one ablation; run that "
                         "ablation's script instead")
  workdir = sweep.workdir_from_flags()
  with sweep.exit_on_interrupt():   # a Ctrl-C while it checks the sweeps, too
    try:
      sweeps = make_sweeps(FLAGS.ablations, workdir)
    except (ValueError,) + sweep.RUN_ERRORS as e:
      sweep.usage_error(str(e))
    if FLAGS.dry_run:
      print("\n".join(sw.plan() for sw in sweeps))
      return
    path = run_all(FLAGS.ablations, sweeps, workdir, command=sweep.command_line())
  print(sweep.where_to_look(path, workdir))


if __name__ == "__main__":
  sweep.expose_flags()
  sweep.quiet_backend_search()
  sweep.run_app(main, flags_parser=sweep.parse_flags)
