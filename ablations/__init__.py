"""Ablation suite: one script per Phoenix component, a shared sweep helper and reports."""

import importlib

# The ablation scripts, by module name: `run_all` runs them and the tests check their
# design and configs. A new ablation script joins them with one more name here.
SCRIPTS = ("candidate_isolation", "rope_anchoring", "soft_capping", "sandwich_norm",
           "gqa_ratio", "logq_correction")


def modules(names=SCRIPTS) -> list:
  """The named ablation scripts' modules (each defines `ABLATION`)."""
  return [importlib.import_module(f"{__name__}.{name}") for name in names]
