"""Equinox-native checkpoints (`eqx.tree_serialise_leaves`, no pickle), written atomically.

A run directory holds `checkpoint/step_<N>.eqx` files, the newest `keep` of them. Each
file is written through `writers.atomic_file` (temporary name, sync, rename, folder sync),
so a kill or power loss at any moment leaves either the previous set or the new one, never
a half-written file under a final name; old files are deleted only after the new one is
in place, and so are the temporary files that a writer killed mid-write left behind.
"""

from __future__ import annotations

import os
import re
from typing import Any

import equinox as eqx

from phoenix_flax.training import writers

CHECKPOINT_DIR = "checkpoint"
_PATTERN = re.compile(r"step_(\d+)\.eqx")


class CheckpointError(ValueError):
  """A checkpoint file exists but cannot be read into the expected structure (`path`)."""

  def __init__(self, message: str, path: str):
    super().__init__(message)
    self.path = path


def checkpoint_dir(run_dir: str) -> str:
  return os.path.join(run_dir, CHECKPOINT_DIR)


def available_steps(run_dir: str) -> list[int]:
  """Steps with a complete checkpoint in `run_dir`, ascending."""
  path = checkpoint_dir(run_dir)
  if not os.path.isdir(path):
    return []
  steps = [int(m.group(1)) for m in map(_PATTERN.fullmatch, os.listdir(path)) if m]
  return sorted(steps)


def _path(run_dir: str, step: int) -> str:
  return os.path.join(checkpoint_dir(run_dir), f"step_{step:09d}.eqx")


def save(run_dir: str, step: int, tree: Any, keep: int = 2) -> str:
  """Writes `tree` as the checkpoint of `step`; keeps it and the `keep - 1` before it.

  Checkpoints of later steps are deleted: they are left from before a restart at an
  earlier step (a run resumes from the newest step all its seeds share), which retrains
  them.
  """
  if keep < 1:
    raise ValueError(f"keep={keep} must be >= 1")
  os.makedirs(checkpoint_dir(run_dir), exist_ok=True)
  path = _path(run_dir, step)
  with writers.atomic_file(path, "wb") as f:
    eqx.tree_serialise_leaves(f, tree)
  steps = available_steps(run_dir)
  kept = [s for s in steps if s <= step][-keep:]
  for old in steps:
    if old not in kept:
      os.remove(_path(run_dir, old))
  writers.remove_temporaries(checkpoint_dir(run_dir))   # partial files of killed writers
  return path


def load(run_dir: str, step: int, like: Any) -> Any:
  """Reads the checkpoint of `step` into the structure (and leaf types) of `like`."""
  path = _path(run_dir, step)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no checkpoint for step {step} in {checkpoint_dir(run_dir)}")
  try:
    return eqx.tree_deserialise_leaves(path, like)
  except Exception as e:   # truncated or foreign bytes: equinox's error names no file
    raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); "
                          "it is damaged or of another model. An older step may still "
                          f"load (steps on disk: {available_steps(run_dir)})", path) from e
