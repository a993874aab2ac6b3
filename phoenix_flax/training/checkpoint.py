"""Equinox-native checkpoints (`eqx.tree_serialise_leaves`, no pickle), written atomically.

A run directory holds `checkpoint/step_<N>.eqx` files (N zero-padded to 9 digits:
`step_000000400.eqx`), the newest `keep` of them. Each
file is written through `writers.atomic_file` (temporary name, sync, rename, folder sync),
so a kill or power loss at any moment leaves either the previous set or the new one, never
a half-written file under a final name; old files are deleted only after the new one is
in place, and so are the temporary files that a writer killed mid-write left behind.

A file is `MAGIC`, then equinox's serialisation of the tree, then the SHA-256 of that
serialisation: bytes damaged on disk, even without changing the file's size, fail the
check when the file is read instead of loading as other weights. Files written before the
checksum (no `MAGIC`) load as they are.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from typing import Any, Optional

import equinox as eqx
import jax
import numpy as np

from phoenix_flax.training import writers

CHECKPOINT_DIR = "checkpoint"
_PATTERN = re.compile(r"step_(\d+)\.eqx")
MAGIC = b"PHXCKPT1"
_DIGEST = hashlib.sha256().digest_size


class _Hashing:
  """A writable file that hashes what goes through it."""

  def __init__(self, f):
    self.f, self.sha = f, hashlib.sha256()

  def write(self, data) -> int:
    self.sha.update(data)
    return self.f.write(data)


class CheckpointError(ValueError):
  """A checkpoint file exists but cannot be read into the expected structure, or one
  cannot be written (`path`)."""

  def __init__(self, message: str, path: str):
    super().__init__(message)
    self.path = path


def checkpoint_dir(run_dir: str) -> str:
  return os.path.join(run_dir, CHECKPOINT_DIR)


def available_steps(run_dir: str) -> list[int]:
  """Steps with a complete checkpoint in `run_dir`, ascending: the files named as `save`
  names them (another `step_<N>.eqx`, say a hand-made `step_4.eqx`, is not one: `load`
  would not find it, nor `save` prune it)."""
  path = checkpoint_dir(run_dir)
  if not os.path.isdir(path):
    return []
  steps = [int(m.group(1)) for m in map(_PATTERN.fullmatch, os.listdir(path))
           if m and checkpoint_path(run_dir, int(m.group(1))) == os.path.join(path, m.group(0))
           and os.path.isfile(os.path.join(path, m.group(0)))]
  return sorted(steps)


def checkpoint_path(run_dir: str, step: int) -> str:
  """The file of `step`'s checkpoint in `run_dir`."""
  return os.path.join(checkpoint_dir(run_dir), f"step_{step:09d}.eqx")


def save(run_dir: str, step: int, tree: Any, keep: int = 2) -> str:
  """Writes `tree` as the checkpoint of `step`; keeps it and the `keep - 1` before it.

  Checkpoints of later steps are deleted: they are left from before a restart at an
  earlier step (a run resumes from the newest step all its seeds share), which retrains
  them.
  """
  if keep < 1:
    raise ValueError(f"keep={keep} must be >= 1")
  path = checkpoint_path(run_dir, step)
  try:
    os.makedirs(checkpoint_dir(run_dir), exist_ok=True)   # its failure is reported as below
    with writers.atomic_file(path, "wb") as f:
      f.write(MAGIC)
      payload = _Hashing(f)
      eqx.tree_serialise_leaves(payload, tree)
      f.write(payload.sha.digest())
  except Exception as e:
    cause = _os_error(e)   # equinox wraps a failed write in an error about the leaf
    if cause is None:
      raise
    raise CheckpointError(f"checkpoint {path} cannot be written ({cause.strerror or cause}); "
                          "nothing of it was kept. Fix that and run the same command "
                          "again: it resumes from the newest checkpoint on disk (steps "
                          f"{available_steps(run_dir)})", path) from e
  steps = available_steps(run_dir)
  kept = [s for s in steps if s <= step][-keep:]
  for old in steps:
    if old not in kept:
      os.remove(checkpoint_path(run_dir, old))
  writers.remove_temporaries(checkpoint_dir(run_dir))   # partial files of killed writers
  return path


def _os_error(e: BaseException) -> Optional[OSError]:
  """The `OSError` (a full disk, a lost mount) in `e`'s chain of causes, if any."""
  seen = set()
  while e is not None and id(e) not in seen:
    if isinstance(e, OSError):
      return e
    seen.add(id(e))
    e = e.__cause__ or e.__context__
  return None


def _host_leaf(f, x: Any) -> Any:
  """A numpy leaf read as numpy (equinox's default), bfloat16 included."""
  if isinstance(x, np.ndarray):
    out = np.load(f)
    # np.save writes bfloat16 as raw 2-byte records (ml_dtypes' dtype is not numpy's).
    return out.view(x.dtype) if out.dtype != x.dtype and out.dtype.kind == "V" else out
  return eqx.default_deserialise_filter_spec(f, x)


def load(run_dir: str, step: int, like: Any, host: bool = False) -> Any:
  """Reads the checkpoint of `step` into the structure (and leaf types) of `like`; with
  `host`, its arrays stay numpy arrays in host memory (a caller that shards them copies
  each device's part from there)."""
  path = checkpoint_path(run_dir, step)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no checkpoint for step {step} in {checkpoint_dir(run_dir)}")
  try:
    with open(path, "rb") as f:   # inside: an unreadable file falls back as a damaged one
      data = f.read()
    if data.startswith(MAGIC):
      payload, digest = data[len(MAGIC):-_DIGEST], data[-_DIGEST:]
      if len(data) < len(MAGIC) + _DIGEST or hashlib.sha256(payload).digest() != digest:
        raise ValueError("its SHA-256 checksum does not match its contents")
    else:
      payload = data   # written before checkpoints carried a checksum
    if host:   # numpy placeholders (unwritten memory) in place of the device arrays
      like = jax.tree.map(lambda x: np.empty(x.shape, x.dtype)
                          if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else x, like)
    return eqx.tree_deserialise_leaves(io.BytesIO(payload), like, filter_spec=_host_leaf)
  except Exception as e:   # damaged or foreign bytes: equinox's error names no file
    raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); "
                          "it is damaged or of another model. An older step may still "
                          f"load (steps on disk: {available_steps(run_dir)})", path) from e
