"""`run_experiment`: train one config (one or several vmapped seeds) into a workdir.

Layout: one seed writes into `workdir` itself; several seeds write into
`workdir/seed_<k>/` (`config.output.seed_subdirs=True` gives that layout to one seed too).
Each run directory holds `config.json` (the seed's own config, with the forward dtype
that `model.fprop_dtype=None` resolved to), `events.out.tfevents.*`,
`metrics.jsonl`, `checkpoint/` (the newest is the final model once finished) and, once
finished, `result.json`:

  {"final": {<eval metric>: ..., "<split>/<metric>": ..., "train/loss": ...,
             "train/grad_norm": ...},
   "diverged": bool, "diverged_at_step": int | null, "steps": int, "seed": int,
   "wall_seconds": float, "examples_per_second": float, "num_seeds_vmapped": int,
   "fprop_dtype": str, "num_devices": int, "code": str | null, "machine": str}

`final` holds the primary eval split's metrics under their own names and the extra
splits' as "<split>/<metric>" (NaN/inf are written as null); its `train/loss` and
`train/grad_norm` are the means over the last host call's steps, so they change with
`train.steps_per_call`, which changes no evaluation metric. `fprop_dtype` is the forward
dtype the run used (the config's None resolves to bfloat16 on GPU/TPU, float32 on CPU)
and `num_devices` the size of the last call's mesh. `code` is the git state of the code
that finished the run (`provenance.running_code_version`: the commit when the process
started, "+changes.<digest>" for uncommitted edits; outside a git checkout
`PHOENIX_FLAX_CODE_VERSION`, else null) and
`machine` the processor it ran on (`provenance.machine`: model, vector extension and
core count on CPU, device kind on GPU/TPU; the same code and seeds give the same numbers
on the same kind of processor).
`wall_seconds` is the run's time over resumes: each process's time up to its last
checkpoint (a killed process's time after it is lost with its work, and a resumed one's
restart and compiling count); `examples_per_second` counts the
training examples of every vmapped seed per second of training chunks, the compiling
first chunk excluded (unless it is the only chunk: the last one, or one in which every
seed diverged), of the process that finished the run; one that resumed for a single
(compiling) chunk gives the rate of the chunks logged before it instead.
`num_seeds_vmapped` is how many seeds trained together in the chunks that rate is from
(a seed resumed alone after the other seeds finished keeps the count it trained with).
The compiling chunk's row logs `perf/first_call_seconds`, never a rate.

A run with `result.json` is skipped, with a warning when the code has changed since it
was trained (its `code` differs from this checkout's); one with checkpoints resumes from
the newest step that every seed of the call has, and ends with the same numbers as an
uninterrupted run (on a GPU only with deterministic programs: a resume without them
warns, `_resumes_vary`).
Should a file of that step be unreadable (damaged by a copy or a disk fault: the writes
themselves are atomic), it resumes from the newest step before it that every seed can
read, with a warning naming the file, and raises `CheckpointError` when there is none.
The first Ctrl-C (SIGINT) or SIGTERM during training lets the current chunk finish,
writes a checkpoint of its step and raises `RunInterrupted` (a `KeyboardInterrupt`); a
second one acts at once (single-process runs; see `_StopRequests`). Before the training
program has compiled (setup, compiling) signals keep their previous handlers: Ctrl-C
raises `KeyboardInterrupt`, once the compiler returns if it comes while compiling (a
compile cannot be cut short), and no checkpoint is written.
While a process trains a run directory it holds a lock on its `.lock` file (POSIX
`flock`, released when the process ends, however it ends, with its process id and host
written in it); a second process refuses that directory with `RunInUseError`, naming
them. An `OSError` while writing a run's outputs (a full disk) stops it with
`RunOutputError`, which says what to resume from. The TensorBoard events are flushed
before every checkpoint and closed before `result.json` is written, so what a resumed or
skipped run keeps of them is complete.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import signal
import socket
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, Optional

import equinox as eqx
import jax
import ml_collections
import numpy as np

from phoenix_flax.config import _count
from phoenix_flax.synthetic import make_world
from phoenix_flax.training import checkpoint, provenance, writers
from phoenix_flax.training.loop import Trainer, TrainState, unstack
from phoenix_flax.training.schema import (RUNTIME_SECTIONS, ConfigError, ExperimentSpec,
                                          base_config, check_config, default_fprop_dtype,
                                          flatten, hparams, parse_config, seed_config,
                                          with_defaults)
from phoenix_flax.training.sharding import (TABLE_FIELDS, Placement, check_tables,
                                            initialize_from, make_placement, table_of,
                                            to_host)
from phoenix_flax.training.writers import (RunWriter, jsonable, nearest_existing, read_json,
                                           read_metrics, remove_temporaries, write_json)

_LOG = logging.getLogger(__name__)

try:
  import fcntl
except ImportError:   # no POSIX file locks (Windows): runs are not locked
  fcntl = None

RESULT_FILE = "result.json"
CONFIG_FILE = "config.json"
FPROP_KEY = "model.fprop_dtype"
LOCK_FILE = ".lock"


class RunInUseError(RuntimeError):
  """Another process is training this run directory (it holds the directory's lock)."""


class RunOutputError(OSError):
  """A run's outputs (metrics.jsonl, TensorBoard events, config.json, result.json) could not
  be written (a full disk, a lost mount); the message names the run directory, the system's
  reason and the checkpoints the same command resumes from. `errno` is the cause's."""


@contextlib.contextmanager
def _writing_outputs(run_dir: str) -> Iterator[None]:
  """Turns an `OSError` of writing `run_dir`'s outputs into a `RunOutputError` that says
  what to do (tensorboardX's errors name no file)."""
  try:
    yield
  except RunOutputError:
    raise
  except OSError as e:
    where = f"{e.filename}: " if e.filename else ""
    steps = checkpoint.available_steps(run_dir)
    resume = (f"it resumes from the newest checkpoint on disk (steps {steps})" if steps
              else "no checkpoint was written yet, so it starts over")
    error = RunOutputError(f"the run's outputs in {run_dir} cannot be written ({where}"
                           f"{e.strerror or e}); the run stopped. Fix that and run the same "
                           f"command again: {resume}")
    error.errno = e.errno
    raise error from e


class _FinishedMeanwhile(Exception):
  """Another process finished these seeds' runs between `run_experiment`'s look for
  result.json and this one's lock: `run_experiment` looks again."""


class RunInterrupted(KeyboardInterrupt):
  """Training stopped on SIGINT or SIGTERM (`signum`) at the end of a chunk, after writing a
  checkpoint of `step`; running the same config again resumes from it. With `finished`,
  the signal came during the run's last chunk: the run ended (result.json written; running
  again skips it) and only its caller stops. A `KeyboardInterrupt`, so code that stops on
  Ctrl-C (a sweep over runs) stops on it too."""

  def __init__(self, signum: int, step: int, dirs: list[str], finished: bool = False):
    name = signal.Signals(signum).name
    if finished:   # the signal came during the last chunk: the run ended, then stopped
      message = (f"stopped by {name} after step {step}: the run in {', '.join(dirs)} "
                 "had finished (result.json written)")
    else:
      message = (f"stopped by {name} after step {step}, with a checkpoint in "
                 f"{', '.join(dirs)}; run the same command again to resume")
    super().__init__(message)
    self.signum, self.step, self.dirs, self.finished = signum, step, list(dirs), finished


class _StopRequests:
  """While training, the first SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption) only
  asks the loop to stop at the end of its current chunk, checkpoint and raise
  `RunInterrupted`, since a state interrupted inside a chunk (its buffers donated) cannot
  be saved. A second signal acts as it did before; the `KeyboardInterrupt` it raises
  leaves with `stopped_at_once = True`, so that a script can say why no checkpoint was
  written. Handlers are installed only in the main thread of a single-process run (every
  process of a multi-process run would have to stop at the same chunk) and restored on
  exit."""

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.signum: Optional[int] = None
    self._previous: dict = {}

  def __enter__(self) -> "_StopRequests":
    if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
      for s in self.SIGNALS:
        previous = signal.getsignal(s)
        if previous is signal.SIG_IGN:   # a background job's SIGINT: it stays ignored
          continue
        self._previous[s] = signal.SIG_DFL if previous is None else previous
        signal.signal(s, self._handle)
    return self

  def _handle(self, signum: int, frame: Any) -> None:
    if self.signum is not None:     # the second one: what it did before
      self._restore()
      signal.raise_signal(signum)
      return
    self.signum = signum
    _LOG.warning("%s: stopping with a checkpoint when the current chunk ends (send it "
                 "again to stop at once)", signal.Signals(signum).name)

  def _restore(self) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def __exit__(self, exc_type, exc, traceback) -> None:
    self._restore()
    if (self.signum is not None and isinstance(exc, KeyboardInterrupt)
        and not isinstance(exc, RunInterrupted)):
      exc.stopped_at_once = True    # (a second signal, during training)


def lock_run_dir(run_dir: str) -> Optional[int]:
  """Creates `run_dir` and takes its lock (a `RunInUseError` when another process holds
  it); the file descriptor to release (`os.close`), or None where the platform has no
  `flock`."""
  os.makedirs(run_dir, exist_ok=True)
  if fcntl is None:
    return None
  path = os.path.join(run_dir, LOCK_FILE)
  fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = _lock_holder(fd)
    os.close(fd)
    raise RunInUseError(f"{run_dir} is being trained by another process ({holder}it holds "
                        f"{path}); wait for it to end, or use another workdir") from None
  # Who holds it, for the message of a process refused; a killed holder's line stays in
  # the file, but its lock went with it, and the next holder writes its own.
  try:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
  except OSError:   # the lock holds without the note
    pass
  return fd


def _lock_holder(fd: int) -> str:
  """What the holder of a run directory's lock wrote in it ("pid <n> on <host> since
  <time>; "), or "" (a holder that has not written it yet, or from before it did)."""
  try:
    line = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
  except OSError:
    return ""
  return f"{line}; " if line.startswith("pid ") and "\n" not in line else ""


def _in_use(run_dir: str) -> bool:
  """Whether another process holds `run_dir`'s lock (trains it) now."""
  path = os.path.join(run_dir, LOCK_FILE)
  if fcntl is None or not os.path.exists(path):
    return False
  fd = os.open(path, os.O_RDONLY)   # flock needs no write access
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
  except BlockingIOError:
    return True
  finally:
    os.close(fd)   # closing releases a lock taken here
  return False


def check_workdir(workdir: str) -> None:
  """Raises `NotADirectoryError` naming the path when `workdir` cannot be a directory (a
  blank or overlong name; it, or the nearest of its parents that exists, is a file or a
  link to nothing), and `PermissionError` when this process cannot write there (tried with
  a scratch file)."""
  if not workdir.strip():
    raise NotADirectoryError(f"workdir {workdir!r} is blank: give a directory's path")
  try:
    os.stat(workdir)
  except OSError as e:   # a missing folder is created; a name too long, never
    if e.errno not in (errno.ENOENT, errno.ENOTDIR):
      raise NotADirectoryError(f"workdir {workdir!r} cannot be created ({e.strerror})") from e
  path = nearest_existing(workdir)
  if os.path.islink(path) and not os.path.exists(path):
    raise NotADirectoryError(f"workdir {workdir!r} cannot be created: {path} is a link to "
                             f"{os.readlink(path)}, which does not exist")
  if not os.path.isdir(path):
    raise NotADirectoryError(f"workdir {workdir!r} cannot be created: {path} is a file, "
                             "not a directory")
  why = writers.why_unwritable(path)
  if why:
    raise PermissionError(f"workdir {workdir!r} cannot be written: nothing can be written "
                          f"in {path} ({why})")


class Progress(NamedTuple):
  """What a progress callback receives after every chunk."""

  step: int
  num_steps: int
  steps_per_second: float       # over the latest chunk
  eta_seconds: float           # NaN until a chunk that did not compile was timed; the
                                # evaluations to come count once one was timed
  loss: tuple[float, ...]       # mean training loss of the chunk, per seed
  num_diverged: int
  evaluated: dict               # "<split>/<metric>" -> per-seed values, on eval steps
  start_step: int = 0           # the step this process started from (> 0: resumed)
  compiling: bool = False       # this process's first chunk: its time includes compiling


def seed_dir(workdir: str, seed: int) -> str:
  """The run directory of `seed` in a workdir of several seeds (`output.seed_subdirs`)."""
  return os.path.join(workdir, f"seed_{seed}")


def run_dirs(config: ml_collections.ConfigDict, workdir: str) -> dict[int, str]:
  """Seed -> its run directory under `workdir`."""
  seeds = range(config.seed, config.seed + config.num_seeds)
  sub = config.output.seed_subdirs
  sub = config.num_seeds > 1 if sub is None else sub
  return {k: seed_dir(workdir, k) if sub else workdir for k in seeds}


def finished_seeds(config: ml_collections.ConfigDict, workdir: str) -> list[int]:
  """Seeds whose run directory holds a `result.json` (`run_experiment` skips them)."""
  return [k for k, d in run_dirs(config, workdir).items()
          if os.path.exists(os.path.join(d, RESULT_FILE))]


def _read_run_file(path: str, advice: bool = True) -> dict:
  """A run's config.json or result.json, or a `ConfigError` saying (with `advice`, for a
  run about to train) what to do when it cannot be read (damaged by something outside:
  the runner writes them atomically)."""
  try:
    found = read_json(path)
  except (OSError, ValueError) as e:
    found = e
  if not isinstance(found, dict):
    what = found if isinstance(found, Exception) else f"a {type(found).__name__}, not an object"
    fix = ("" if not advice else
           "; delete it and the run resumes from its checkpoints" if path.endswith(RESULT_FILE)
           else "; " + _unusable_config_advice(os.path.dirname(path)))
    raise ConfigError(f"{path} cannot be read ({what}){fix}")
  return found


# What a result.json must hold for a run to count as finished (the runner writes more).
_RESULT_FIELDS = {"final": dict, "diverged": bool, "steps": int, "wall_seconds": (int, float)}


def read_result(path: str) -> dict:
  """A finished run's result.json, or a `ConfigError` naming what is wrong with it (it
  cannot be read, or lacks a field a finished run's result has) and saying that deleting
  it resumes the run from its checkpoints."""
  found = _read_run_file(path)
  wrong = [f"'{k}'" for k, kind in _RESULT_FIELDS.items()
           if not isinstance(found.get(k), kind) or (kind is not bool
                                                     and isinstance(found[k], bool))]
  if wrong:
    raise ConfigError(f"{path} is not a finished run's result (no valid {', '.join(wrong)}); "
                      "delete it and the run resumes from its checkpoints")
  return found


_SEED_DIR = re.compile(r"seed_\d+")   # `seed_dir`'s


def _ours(run_dir: str, name: str) -> bool:
  """Whether `run_dir/name` is a folder holding no more than a killed writer's temporaries
  (the checkpoint folder of a run killed before its first checkpoint), not a file or a
  folder of someone else's (TensorFlow's `checkpoint` file, say)."""
  path = os.path.join(run_dir, name)
  return os.path.isdir(path) and all(writers.is_temporary(n) for n in os.listdir(path))


def _foreign_files(run_dir: str, with_config: bool = False) -> list[str]:
  """What `run_dir` holds that no run writes before its first checkpoint: beyond its lock,
  temporaries, entries named as seed folders and a checkpoint folder of temporaries
  (`_ours`), and, with `with_config`, its config.json, metrics.jsonl and event files. []
  for no directory."""
  own = {LOCK_FILE} | ({CONFIG_FILE, writers.METRICS_FILE} if with_config else set())
  try:
    names = os.listdir(run_dir)
  except (FileNotFoundError, NotADirectoryError):   # a new run (or a refused path)
    return []
  return sorted(name for name in names
                if name not in own and not writers.is_temporary(name)
                and not _SEED_DIR.fullmatch(name)
                and not (name == checkpoint.CHECKPOINT_DIR and _ours(run_dir, name))
                and not (with_config and name.startswith("events.out.tfevents.")))


def _listed(names: list[str]) -> str:
  more = f" and {len(names) - 5} more" if len(names) > 5 else ""
  return ", ".join(names[:5]) + more


def _unusable_config_advice(run_dir: str) -> str:
  """The way out for a run directory whose config.json is damaged or another tool's:
  deleting the file alone leaves checkpoints or a result no config vouches for (refused
  next), and a directory holding other files may be another tool's."""
  if (checkpoint.available_steps(run_dir)
      or os.path.exists(os.path.join(run_dir, RESULT_FILE))):
    return (f"restore {CONFIG_FILE}, or delete the directory to train the run afresh (its "
            "checkpoints or result are refused without the config that trained them)")
  foreign = _foreign_files(run_dir, with_config=True)
  if foreign:
    return (f"it also holds files that no run wrote ({_listed(foreign)}), so it may be "
            "another tool's directory: use a new or empty one")
  return "delete it, or the run's directory, to start the run afresh"


def _check_existing_config(run_dir: str, expected: dict, locked: bool = False) -> None:
  """Raises `ConfigError` if `run_dir` holds a run of another config, or checkpoints or a
  result without the config that made them; `locked`: this process holds its lock."""
  path = os.path.join(run_dir, CONFIG_FILE)
  if not os.path.exists(path):
    # A run writes config.json before its first checkpoint and its result: without it,
    # what is there cannot be checked against this config, and resuming or reusing it
    # could publish another config's training under this one.
    left = [RESULT_FILE] if os.path.exists(os.path.join(run_dir, RESULT_FILE)) else []
    steps = checkpoint.available_steps(run_dir)
    if steps:
      left.append(f"checkpoints of steps {steps}")
    if left:
      raise ConfigError(f"{run_dir} holds {' and '.join(left)} but no {CONFIG_FILE}, so "
                        "the config that trained them cannot be checked; restore "
                        f"{CONFIG_FILE}, or delete the directory to train the run afresh")
    # Before config.json a run has written its lock, temporaries and an empty checkpoint
    # folder at most (and the workdir of one seed may hold the seed folders of a run of
    # several); anything else is someone else's (`--workdir=~`, a folder of other logs),
    # and a fresh run would write among it, deleting event files and replacing
    # metrics.jsonl.
    foreign = _foreign_files(run_dir)
    if foreign:
      raise ConfigError(f"{run_dir} holds files that no run wrote ({_listed(foreign)}) and "
                        f"no {CONFIG_FILE}: a run's directory holds that run alone, and a "
                        f"new one would delete event files and replace {writers.METRICS_FILE} "
                        "there; use a new or empty directory")
    return
  stored = _read_run_file(path)
  try:
    # Every run's config names its task (with_defaults would read a missing one as
    # "ranking", and so take another tool's config.json, a model's say, for a run's).
    if "task" not in stored:
      raise ValueError("it names no task")
    stored = with_defaults(stored).to_dict()
  except (KeyError, TypeError, ValueError, AttributeError) as e:
    raise ConfigError(f"{path} is not a run's config ({type(e).__name__}: {e}); "
                      f"{_unusable_config_advice(run_dir)}") from e
  found = flatten(jsonable(stored), skip=RUNTIME_SECTIONS)
  # Completed alike: an extra evaluation split may name only the fields it changes.
  wanted = flatten(jsonable(with_defaults(expected).to_dict()), skip=RUNTIME_SECTIONS)
  # config.json holds the forward dtype a None resolved to on the platform that started
  # the run (None in runs written before it did), so that resuming on another platform
  # is refused instead of training on in another dtype.
  wanted[FPROP_KEY] = wanted.get(FPROP_KEY) or default_fprop_dtype()
  found[FPROP_KEY] = found.get(FPROP_KEY) or wanted[FPROP_KEY]
  diff = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
  if diff:
    advice = "use another workdir, or delete that run to start it again"
    if not locked and _in_use(run_dir):
      advice += "; another process is training it now"
    elif not (checkpoint.available_steps(run_dir)
              or os.path.exists(os.path.join(run_dir, RESULT_FILE))):
      foreign = _foreign_files(run_dir, with_config=True)
      advice = (f"use another workdir: it also holds files that no run wrote "
                f"({_listed(foreign)}), so it may be another tool's directory" if foreign else
                advice + "; it stopped before its first checkpoint, so deleting it loses "
                "nothing")
    more = f" and {len(diff) - 8} more" if len(diff) > 8 else ""
    shown = lambda values, k: repr(values[k]) if k in values else "absent"
    values = "; ".join(f"{k} {shown(found, k)} there, {shown(wanted, k)} here" for k in diff[:3])
    dtype = (f"; it computed in {found[FPROP_KEY]}: pass --config.model.fprop_dtype="
             f"{found[FPROP_KEY]} to resume it here" if FPROP_KEY in diff else "")
    raise ConfigError(f"{run_dir} holds a run of another config (differs in {diff[:8]}{more}: "
                      f"{values}){dtype}; {advice}")


def check_run_dirs(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Raises `ConfigError` if a run directory of `config` under `workdir` holds a run of
  another config (which resuming would mix up, and a finished one would stand in for), or
  a result.json that cannot be read (`read_result`), and `NotADirectoryError` if a run
  directory's path is a file; before any seed trains."""
  for k, d in run_dirs(config, workdir).items():
    if os.path.lexists(d) and not os.path.isdir(d):
      raise NotADirectoryError(f"{d}, seed {k}'s run directory, is a file, not a directory; "
                               "use another workdir, or move the file away")
    _check_existing_config(d, seed_config(config, k).to_dict())
    if os.path.exists(os.path.join(d, RESULT_FILE)):
      read_result(os.path.join(d, RESULT_FILE))


def _validate_placement(spec: ExperimentSpec, placement: Placement) -> None:
  n, t = placement.num_devices, spec.config.train
  for f in ("batch_size", "eval_batch_size"):
    if t[f] % n:
      raise ConfigError(f"config.train.{f}={t[f]} is invalid: must be a multiple of the "
                        f"{n} devices of the mesh")
  check_tables(spec, placement)
  check_memory(spec, placement)


def _bytes(tree: Any) -> int:
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _memory_of_a_device() -> tuple[Optional[int], str]:
  """Bytes one device of this process can hold, and what they are; (None, "") when the
  backend does not say. CPU devices share the host's memory (each holds its own copy)."""
  device = jax.local_devices()[0]
  try:
    limit = (device.memory_stats() or {}).get("bytes_limit")
  except Exception:   # a backend without memory statistics
    limit = None
  if limit:
    return int(limit), f"a {device.device_kind}'s memory"
  if device.platform == "cpu" and hasattr(os, "sysconf"):
    try:
      return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host's memory"
    except (ValueError, OSError):
      pass
  return None, ""


def check_memory(spec: ExperimentSpec, placement: Placement) -> None:
  """Raises `ConfigError` when the training state alone (parameters, AdamW moments and the
  synthetic world, for every vmapped seed) cannot fit in memory, naming the largest part
  and its config field: without it, the run would fail on allocating it with an XLA
  out-of-memory error that names no field. Only what is certainly needed is counted
  (gradients and activations come on top), so a config it passes may still not fit."""
  limit, what = _memory_of_a_device()
  if limit is None:
    return
  world = eqx.filter_eval_shape(make_world, spec.world, jax.random.PRNGKey(0))
  one = eqx.filter_eval_shape(Trainer(spec, world=world)._init_one, jax.random.PRNGKey(0))
  n, seeds, w = placement.num_devices, spec.config.num_seeds, spec.world
  # Per device: a sharded table's rows (and moments) split over the mesh; the rest whole.
  tables = {f: 0 for f in TABLE_FIELDS}
  model = 0
  for path, x in jax.tree_util.tree_flatten_with_path(one)[0]:
    size = seeds * _bytes(x)
    table = table_of(path)
    if table is None:
      model += size
    else:
      tables[table] += size // n if placement.shard_hash_tables else size
  world_bytes = _bytes(world)
  per_device = world_bytes + model + sum(tables.values())
  # CPU devices (several only when simulated) all hold their copies in the host's memory.
  cpu = jax.local_devices()[0].platform == "cpu"
  copies = min(n, jax.local_device_count()) if cpu else 1
  if per_device * copies <= limit:
    return
  gib = lambda b: f"{b / 2**30:.1f} GiB"
  each = " on each device" if n > 1 else ""
  table = max(tables, key=tables.get)
  field = table.replace("_table", "_buckets")
  largest = max((tables[table], "table"), (world_bytes, "world"), (model, "model"))[1]
  remedies = []
  if largest == "table":
    what_it_is = (f"the {table.replace('_', ' ')}: config.world.{field}="
                  f"{getattr(w, field)} rows of {spec.model.emb_size} floats, "
                  f"{gib(tables[table])}{each} with its AdamW moments"
                  + (f" for {seeds} seeds" if seeds > 1 else ""))
    remedies.append("lower the world's bucket counts")
    if n > 1 and not placement.shard_hash_tables:
      remedies.append("shard the tables over the mesh (mesh.shard_hash_tables=True)")
    elif n == 1 and jax.device_count() > 1 and not cpu:   # (one host memory on CPU)
      remedies.append("shard the tables over several devices (mesh.num_devices, "
                      "mesh.shard_hash_tables=True)")
  elif largest == "world":
    what_it_is = (f"the synthetic world, {gib(world_bytes)}{each}: latent vectors and hashes "
                  f"of config.world.num_users={w.num_users}, num_posts={w.num_posts} and "
                  f"num_authors={w.num_authors}")
    remedies.append("lower the world's entity counts")
  else:
    what_it_is = (f"the model and its AdamW moments, {gib(model)}{each}"
                  + (f" for {seeds} seeds" if seeds > 1 else ""))
    remedies.append("make the model smaller")
  if seeds > 1 and largest != "world":
    remedies.append("train fewer seeds at once (num_seeds)")
  raise ConfigError(
      f"the config's training state (parameters, AdamW moments and the synthetic world) "
      f"needs at least {gib(per_device * copies)}"
      + (f" ({gib(per_device)} on each of the mesh's {copies} CPU devices)" if copies > 1
         else "")
      + f", more than {what} ({gib(limit)}); the largest part is {what_it_is}. To fit: "
      + ", or ".join(remedies))


def check_placement(spec: ExperimentSpec) -> None:
  """Raises `ConfigError` when the spec's mesh cannot be built on this host's devices
  or its batch sizes (or sharded hash tables) do not divide over it; nothing is compiled.
  A multi-host config (`mesh.distributed`) is left to `run_experiment`: its devices are
  known only once `jax.distributed.initialize` has run, which must come first."""
  mesh = spec.config.mesh
  if mesh.distributed:
    return
  _validate_placement(spec, make_placement(mesh.num_devices, mesh.shard_hash_tables))


_TRAINERS: dict[str, Trainer] = {}


def _trainer(spec: ExperimentSpec) -> Trainer:
  """The Trainer of a spec, reused (with its compiled functions) by the next call whose
  config differs only in seeds or output layout, e.g. seeds run one at a time."""
  key = json.dumps(jsonable(flatten(spec.config, skip=("seed", "num_seeds", "output"))),
                   sort_keys=True)
  if key not in _TRAINERS:
    placement = make_placement(spec.config.mesh.num_devices,
                               spec.config.mesh.shard_hash_tables)
    _validate_placement(spec, placement)
    for old in _TRAINERS.values():
      old.release_arrays()
    _TRAINERS.clear()
    _TRAINERS[key] = Trainer(spec, placement)
  return _TRAINERS[key]


def _resumes_vary(backend: str, xla_flags: str) -> bool:
  """Whether a resumed run can end away from an uninterrupted one, not bit for bit: on a
  GPU unless `xla_flags` (XLA_FLAGS) turns on `--xla_gpu_deterministic_ops` (the last
  entry wins; a bare flag means true). Without it an H200's scatter-adds summed in a
  varying order and its kernels were picked by timing them (docs/training.md,
  "Accelerators")."""
  if backend != "gpu":
    return False
  on = False
  for flag in xla_flags.split():
    name, _, value = flag.partition("=")
    if name == "--xla_gpu_deterministic_ops":
      on = value.lower() in ("", "true", "1")
  return not on


def _resume_steps(dirs: list[str]) -> list[int]:
  """The steps with a checkpoint in every one of `dirs`, newest first."""
  common = set.intersection(*(set(checkpoint.available_steps(d)) for d in dirs))
  return sorted(common, reverse=True)


def _train_scalars(stats: dict, i: int) -> dict[str, float]:
  """Seed i's `train/*` scalars of a chunk: every statistic `Trainer.update` returns, as
  its mean over the chunk's steps (per layer where it has a layer axis), except the
  learning rate (its last value) and the max |attention logit| (the chunk's maximum)."""
  out = {}
  for name, values in stats.items():
    v = np.asarray(values[i])
    if name == "learning_rate":
      out["train/learning_rate"] = float(v[-1])
    elif v.ndim == 1:
      out[f"train/{name}"] = float(np.mean(v))
    elif v.ndim == 2:
      reduce = np.max if name == "max_attn_logit" else np.mean
      per_layer = reduce(v, axis=0)
      out.update({f"train/{name}/layer_{layer}": float(x) for layer, x in enumerate(per_layer)})
      if name == "max_attn_logit":
        out["train/max_attn_logit"] = float(np.max(per_layer))
    else:
      raise ValueError(f"training statistic {name!r} has shape {v.shape} per seed; a "
                       "statistic is a scalar or a per-layer vector per step")
  return out


FINAL_TRAIN_METRICS = ("train/loss", "train/grad_norm")
# The timing scalars of a training chunk's row (`_train_group`): its rates, or the time of
# the compiling first chunk.
PERF_RATES = ("perf/steps_per_second", "perf/examples_per_second")
PERF_FIRST_CALL = "perf/first_call_seconds"


class MetricNames(NamedTuple):
  """The metric keys a run of a config reports, found by tracing it (nothing computed)."""

  final: set[str]             # result.json's `final`
  logged: Optional[set[str]]  # metrics.jsonl rows and TensorBoard scalars (`train/*`,
                              # `perf/*`, `eval/*`, `<split>/*`); None unless asked for


def metric_names(spec: ExperimentSpec, logged: bool = True) -> MetricNames:
  """What a run of `spec` reports, from tracing its evaluation and, with `logged`, one
  training chunk (about as long again) instead of training it."""
  world = eqx.filter_eval_shape(make_world, spec.world, jax.random.PRNGKey(0))
  trainer = Trainer(spec, world=world)
  state = eqx.filter_eval_shape(trainer._init, jax.random.PRNGKey(0)[None])
  references = eqx.filter_eval_shape(trainer._references, trainer.world)
  evaluated = eqx.filter_eval_shape(trainer._eval, trainer.world, references, state.params)
  final = {_final_key(key) for key in evaluated} | set(FINAL_TRAIN_METRICS)
  if not logged:
    return MetricNames(final, None)
  stats = eqx.filter_eval_shape(trainer._chunk, trainer.world, state)[1]
  train = _train_scalars({name: np.zeros(x.shape, x.dtype) for name, x in stats.items()}, 0)
  return MetricNames(final, set(evaluated) | set(train) | {*PERF_RATES, PERF_FIRST_CALL})


def _final_key(key: str) -> str:
  split, metric = key.split("/", 1)
  return metric if split == "eval" else key


def _final_metrics(evaluated: dict, i: int, train: dict) -> dict[str, float]:
  final = {_final_key(key): float(values[i]) for key, values in evaluated.items()}
  for key in FINAL_TRAIN_METRICS:
    if key in train:
      final[key] = train[key]
  return final


def run_experiment(config: ml_collections.ConfigDict, workdir: str, *,
                   progress: Optional[Callable[[Progress], None]] = None,
                   on_start: Optional[Callable[[list[int], int], None]] = None
                   ) -> dict[int, dict]:
  """Trains (or resumes, or skips) every seed of `config`; returns seed -> result dict.

  `progress` is called after every chunk of steps. `on_start(seeds, step)` is called once
  the states of the seeds to train are ready, initialised (`step` 0) or restored from the
  checkpoint of `step`, before the training program compiles (on CPU, the silent part
  of a run's start). Neither is called for seeds that
  finished before, and in a multi-process run only process 0 calls them.

  Raises `ConfigError` (a `ValueError` naming the field) before any work when the config
  is invalid or a run directory holds a different config, and `NotADirectoryError` when
  a run directory's path is a file.

  The compiled programs of the last config are kept for the next call (seeds run one at
  a time reuse them). JAX keeps every config's programs in its own caches too: a script
  that loops over many configs frees them with `jax.clear_caches()` between calls, as
  the ablation sweeps do after each variant (their host memory otherwise grew by about
  100 MB a config in an audit's loop over smoke configs).
  """
  if not isinstance(config, ml_collections.ConfigDict):
    raise TypeError(f"config must be an ml_collections.ConfigDict, got "
                    f"{type(config).__name__}")
  if config.mesh.distributed is True:
    check_config(config)   # fail before waiting for the other processes
    initialize_from(config.mesh)
  spec = parse_config(config)
  check_workdir(workdir)
  check_run_dirs(config, workdir)
  dirs = run_dirs(config, workdir)
  while True:
    done = finished_seeds(config, workdir)
    results = {k: read_result(os.path.join(dirs[k], RESULT_FILE)) for k in done}
    if done:
      _warn_if_other_code(results, dirs)
    pending = [k for k in dirs if k not in done]
    if not pending:
      return results
    try:
      results.update(_train(_trainer(spec), spec.config, pending,
                            {k: dirs[k] for k in pending}, progress, on_start))
    except _FinishedMeanwhile as e:   # by a process that held the lock before this one
      _LOG.warning("another process finished %s meanwhile: reused as it is",
                   ", ".join(dirs[k] for k in e.args[0]))
      continue
    return dict(sorted(results.items()))


def _warn_if_other_code(results: dict[int, dict], dirs: dict[int, str]) -> None:
  """Warns about reused runs whose recorded code differs from this checkout's (runs from
  before `code` was recorded, or from outside a checkout, say nothing)."""
  now = provenance.running_code_version()
  other = {k: r.get("code") for k, r in results.items()
           if r.get("code") is not None and r.get("code") != now}
  if other:
    _LOG.warning("%d finished run(s) reused as they are, trained by other code (%s; this "
                 "checkout: %s): if the change affects training, delete %s (or use a new "
                 "workdir) to train them with this code", len(other),
                 ", ".join(sorted(set(other.values()))), now,
                 " ".join(dirs[k] for k in sorted(other)))


def _hparams_group(run_dir: str, seed: int) -> str:
  """The HParams session group of a run in a seed subdirectory: the absolute path of its
  workdir (in a sweep, ".../<ablation>/<variant>"), shared by the config's seeds and by no
  other sweep's, since TensorBoard averages every session of a group name under its
  logdir (two sweeps' "<ablation>/<variant>" would merge); "" for a run in the workdir
  itself."""
  if os.path.basename(run_dir) != os.path.basename(seed_dir("", seed)):
    return ""
  return os.path.dirname(os.path.abspath(run_dir))


def session_hparams(config: ml_collections.ConfigDict, seed_cfg: ml_collections.ConfigDict,
                    group: str) -> dict[str, Any]:
  """The hparams a run logs: its seed's config's without `num_seeds`, and for a run of a
  session group (the seeds of one config) the group's first `seed`, so every session of
  the group logs the same. TensorBoard's HParams table shows a group with the
  hparams of one of its sessions: per-seed values showed a row averaging seeds 0 and 1 as
  "seed 1, num_seeds 1", and a count would go stale when a later command adds seeds to
  the group (the table counts its sessions). A session's own seed is its run name
  (`seed_<k>`)."""
  out = hparams(seed_cfg)
  out.pop("num_seeds", None)
  if group:
    out["seed"] = config.seed
  return out


class _Group:
  """The seeds trained together in one call: their state, directories and writers.
  `config` is the caller's: the (cached) trainer's may differ in seeds and `output`."""

  def __init__(self, trainer: Trainer, config: ml_collections.ConfigDict, seeds: list[int],
               dirs: dict[int, str]):
    self.t_start = time.perf_counter()
    self.trainer, self.config, self.seeds, self.dirs = trainer, config, seeds, dirs
    self.main = jax.process_index() == 0
    self.locks, self.writers = [], {}
    try:
      self._open(trainer)
    except BaseException:
      self.close()
      raise

  def _open(self, trainer: Trainer) -> None:
    seeds, dirs = self.seeds, self.dirs
    if self.main:
      for k in seeds:
        self.locks.append(lock_run_dir(dirs[k]))
        # Checked again under the lock: another config's process may have trained here
        # between `run_experiment`'s check and now.
        _check_existing_config(dirs[k], seed_config(self.config, k).to_dict(), locked=True)
        remove_temporaries(dirs[k])   # partial files of a killed writer (we hold the lock)
      # ... and so may this config's: a run finished meanwhile is reused, not finished
      # again (evaluated, its result.json rewritten). (One process: every process of a
      # multi-process run must train the same seeds.)
      finished = [k for k in seeds if os.path.exists(os.path.join(dirs[k], RESULT_FILE))]
      if finished and jax.process_count() == 1:
        raise _FinishedMeanwhile(finished)
    self.step = 0
    damaged = []
    for step in _resume_steps(list(dirs.values())):
      try:
        self.state, self.prior_wall = self._restore(step)
      except checkpoint.CheckpointError as e:
        damaged.append(e.path)
        _LOG.warning("checkpoint %s cannot be read (%s); trying the one before it", e.path,
                     e.__cause__)
        continue
      self.step = step
      break
    else:
      if damaged:
        raise checkpoint.CheckpointError(
            f"no checkpoint to resume from can be read (damaged or of another model): "
            f"{', '.join(damaged)}. Delete the checkpoint folder of each run directory to "
            "train from the start", damaged[-1])
      self.state, self.prior_wall = trainer.init(seeds), [0.0] * len(seeds)
    newest = {k: max((s for s in checkpoint.available_steps(dirs[k])   # damaged ones aside
                      if checkpoint.checkpoint_path(dirs[k], s) not in damaged), default=0)
              for k in seeds}
    if self.step and _resumes_vary(jax.default_backend(), os.environ.get("XLA_FLAGS", "")):
      _LOG.warning("resuming at step %d on a GPU without XLA_FLAGS=--xla_gpu_deterministic_"
                   "ops=true: the run will end near an uninterrupted one's result, not bit for "
                   "bit (docs/training.md, \"Accelerators\")", self.step)
    ahead = {k: step for k, step in newest.items() if step > self.step}
    if ahead and len(seeds) > 1:
      _LOG.warning("seeds train together from the newest checkpoint step all of them have "
                   "(%s), so the later steps of seeds %s (newest checkpoints at %s) are "
                   "trained again", f"step {self.step}" if self.step else "none: the start",
                   sorted(ahead), [ahead[k] for k in sorted(ahead)])
    self.writers = {}
    if self.main:
      for k in seeds:
        cfg_k = seed_config(self.config, k)
        cfg_k.model.fprop_dtype = trainer.spec.model.fprop_dtype   # None resolved
        with _writing_outputs(dirs[k]):
          write_json(os.path.join(dirs[k], CONFIG_FILE), cfg_k.to_dict())
          group = _hparams_group(dirs[k], k)
          self.writers[k] = RunWriter(dirs[k], session_hparams(self.config, cfg_k, group),
                                      self.step or None, group)

  def close(self) -> None:
    """Closes the writers still open, then releases the locks (even if a close fails)."""
    try:
      self.close_writers()
    finally:
      self.release()

  def release(self) -> None:
    """Releases the run directories' locks."""
    for fd in self.locks:
      if fd is not None:
        os.close(fd)   # closing the descriptor drops its flock
    self.locks = []

  def _restore(self, step: int) -> tuple[TrainState, list[float]]:
    like = checkpoint_like(self.trainer)
    loaded = [load_checkpoint(self.trainer, self.dirs[k], step, like) for k in self.seeds]
    # Stacked on the host, then each device's shard copied from there.
    state = jax.tree.map(lambda *xs: np.stack(xs), *[s for s, _ in loaded])
    return self.trainer.placement.place_state(state), [wall for _, wall in loaded]

  def wall(self, i: int) -> float:
    return self.prior_wall[i] + time.perf_counter() - self.t_start

  def save(self) -> None:
    host = to_host(self.state)
    if self.main:
      for k, writer in self.writers.items():
        with _writing_outputs(self.dirs[k]):
          writer.flush()   # every event up to this step on disk before the checkpoint says so
      for i, k in enumerate(self.seeds):
        checkpoint.save(self.dirs[k], self.step, _payload(unstack(host, i), self.wall(i)),
                        keep=self.config.output.keep_checkpoints)

  def log(self, rows: dict[int, dict]) -> None:
    if self.main:
      for i, k in enumerate(self.seeds):
        with _writing_outputs(self.dirs[k]):
          self.writers[k].log(self.step, rows[i], self.wall(i))

  def logged_training(self) -> tuple[dict[int, dict], float, int]:
    """The last logged train scalars of each seed, the logged chunks' throughput (the
    first chunk, which compiled, left out when there are more) and how many seeds trained
    vmapped in them (read from the rates: their examples per step over the batch size;
    this group's count where no row has both rates), for a process that resumed from the
    final checkpoint, or for its last chunk, and so did not time the run's chunks itself.
    A seed whose result.json alone was lost trains alone then, but its chunks ran with
    the seeds of the process that trained them."""
    rows = {i: [r for r in read_metrics(self.dirs[k]) if "train/loss" in r]
            for i, k in enumerate(self.seeds)}
    train_rows = {i: {key: v for key, v in r[-1].items() if key.startswith("train/")}
                  for i, r in rows.items() if r}
    steps, examples = PERF_RATES
    rates = [r[examples] for r in rows[0] if examples in r]
    if not any(PERF_FIRST_CALL in r for r in rows[0]):
      rates = rates[1:] or rates   # logged when the compiling chunk's rate was logged too
    both = [r for r in rows[0] if steps in r and examples in r]
    vmapped = (round(both[-1][examples] / both[-1][steps] / self.config.train.batch_size)
               if both else len(self.seeds))
    return train_rows, (len(rates) / sum(1 / x for x in rates) if rates else 0.0), vmapped

  def close_writers(self) -> None:
    """Closes the event writers of a run that stops unfinished (those still open), every
    one of them even when one cannot write its last events (then `RunOutputError`)."""
    error = None
    for k, writer in self.writers.items():
      if not writer.closed:
        try:
          with _writing_outputs(self.dirs[k]):
            writer.close(finished=False)
        except RunOutputError as e:
          error = error or e
    if error is not None:
      raise error

  def finish(self, evaluated: dict, train_rows: dict, throughput: float,
             vmapped: int) -> dict[int, dict]:
    diverged, div_step = to_host((self.state.diverged, self.state.diverged_step))
    code, machine = provenance.running_code_version(), provenance.machine()
    results = {}
    for i, k in enumerate(self.seeds):
      results[k] = jsonable({
          "final": _final_metrics(evaluated, i, train_rows.get(i, {})),
          "diverged": bool(diverged[i]),
          "diverged_at_step": int(div_step[i]) if diverged[i] else None,
          "steps": self.step,
          "seed": k,
          "wall_seconds": self.wall(i),
          "examples_per_second": throughput,
          "num_seeds_vmapped": vmapped,
          "fprop_dtype": self.trainer.spec.model.fprop_dtype,
          "num_devices": self.trainer.placement.num_devices,
          "code": code,
          "machine": machine,
      })
      if self.main:   # result.json last: a run that has it is skipped, never repaired
        with _writing_outputs(self.dirs[k]):
          self.writers[k].close(finished=True, diverged=bool(diverged[i]))
          write_json(os.path.join(self.dirs[k], RESULT_FILE), results[k])
    return results


def _train(trainer: Trainer, config: ml_collections.ConfigDict, seeds: list[int],
           dirs: dict[int, str], progress: Optional[Callable[[Progress], None]],
           on_start: Optional[Callable[[list[int], int], None]] = None
           ) -> dict[int, dict]:
  """Chunks of scanned steps until `num_steps` (or every seed diverged), with evaluation,
  logging and checkpoints at chunk ends; then the final evaluation and result.json."""
  g = _Group(trainer, config, seeds, dirs)
  try:
    if on_start is not None and g.main:
      on_start(seeds, g.step)
    # Compiled before signals are deferred: a Ctrl-C while compiling (which cannot be cut
    # short) stops the run when the compiler returns, not after a chunk and a checkpoint.
    # The evaluation program too, so that no evaluation's time is a compile's (the ETA
    # counts them).
    compile_seconds = 0.0
    if g.step < config.train.num_steps and not to_host(g.state.diverged).all():
      t0 = time.perf_counter()
      trainer.compile_chunk(g.state)
      compile_seconds = time.perf_counter() - t0
    trainer.compile_evaluation(g.state)
    with _StopRequests() as stop:
      results = _train_group(g, trainer, progress, stop, compile_seconds)
  except BaseException:   # writers still open: closed, locks released, the error reported
    with contextlib.suppress(RunOutputError):   # (not a full disk's second failure)
      g.close()
    raise
  g.close()   # (writers closed when the run finished or stopped)
  if stop.signum is not None:   # during the last chunk: the run finished; its caller stops
    raise RunInterrupted(stop.signum, g.step, [g.dirs[k] for k in seeds], finished=True)
  return results


def _evaluations_after(step: int, num_steps: int, eval_every: int) -> int:
  """How many evaluations a run at `step` has still to make: one every `eval_every` steps
  (0: none) up to `num_steps`, and the final one at `num_steps`."""
  if step >= num_steps:
    return 0
  periodic = num_steps // eval_every - step // eval_every if eval_every else 0
  return periodic + (0 if eval_every and num_steps % eval_every == 0 else 1)


def _train_group(g: _Group, trainer: Trainer, progress: Optional[Callable[[Progress], None]],
                 stop: _StopRequests, compile_seconds: float = 0.0) -> dict[int, dict]:
  """The chunks of `_train`; `compile_seconds`, the time it took to compile the training
  program, is counted as part of the first chunk's."""
  seeds = g.seeds
  start_step = g.step
  t = trainer.spec.config.train
  examples_per_chunk = t.steps_per_call * t.batch_size * len(seeds)
  train_seconds, timed_chunks, chunks = 0.0, 0, 0
  eval_seconds, evaluations = 0.0, 0
  evaluated, eval_step, train_rows = {}, -1, {}
  diverged = to_host(g.state.diverged)
  while g.step < t.num_steps and not diverged.all():   # a restored state may be diverged
    t0 = time.perf_counter()
    g.state, stats = trainer.train_chunk(g.state)
    stats = to_host(stats)
    dt = time.perf_counter() - t0 + (compile_seconds if not chunks else 0.0)
    g.step += t.steps_per_call
    chunks += 1
    diverged = to_host(g.state.diverged)
    # The first chunk also compiles: timed only when it is the only one.
    timed = chunks > 1 or g.step == t.num_steps or bool(diverged.all())
    if timed:
      train_seconds, timed_chunks = train_seconds + dt, timed_chunks + 1
    train_rows = {i: _train_scalars(stats, i) for i in range(len(seeds))}
    new_eval = {}
    if g.step == t.num_steps or diverged.all() or (t.eval_every and g.step % t.eval_every == 0):
      t0 = time.perf_counter()
      new_eval = evaluated = to_host(trainer.evaluate(g.state))
      eval_seconds, evaluations = eval_seconds + time.perf_counter() - t0, evaluations + 1
      eval_step = g.step
    # A compiling chunk logs its time, not a rate that would start every perf curve
    # with a dip.
    perf = (dict(zip(PERF_RATES, (t.steps_per_call / dt, examples_per_chunk / dt)))
            if chunks > 1 else {PERF_FIRST_CALL: dt})
    g.log({i: {**row, **perf, **{key: float(v[i]) for key, v in new_eval.items()}}
           for i, row in train_rows.items()})
    saved = bool(t.checkpoint_every) and g.step % t.checkpoint_every == 0
    if saved and g.step < t.num_steps:
      g.save()
    if progress is not None and g.main:
      rate = t.steps_per_call / dt
      remaining = t.num_steps - g.step
      if not remaining or diverged.all():   # (every seed diverged: the run ends here)
        eta = 0.0
      elif timed_chunks:
        eta = remaining * train_seconds / (timed_chunks * t.steps_per_call)
        if evaluations:   # (an estimate only once one was timed)
          eta += (_evaluations_after(g.step, t.num_steps, t.eval_every)
                  * eval_seconds / evaluations)
      else:   # only the compiling first chunk so far: its rate says nothing
        eta = math.nan
      progress(Progress(g.step, t.num_steps, rate, eta,
                        tuple(r["train/loss"] for r in train_rows.values()),
                        int(diverged.sum()), new_eval, start_step, chunks == 1))
    if diverged.all():
      break
    if stop.signum is not None and g.step < t.num_steps:
      if not saved:
        g.save()
      g.close_writers()
      raise RunInterrupted(stop.signum, g.step, [g.dirs[k] for k in seeds])
  if eval_step != g.step:
    evaluated = to_host(trainer.evaluate(g.state))
  g.save()
  measured = timed_chunks * examples_per_chunk / train_seconds if train_seconds else 0.0
  vmapped = len(seeds)
  if not chunks:   # killed after the final checkpoint (every seed diverged, or the last step)
    train_rows, throughput, vmapped = g.logged_training()
  elif chunks == 1 and start_step:   # resumed for one (compiling) chunk: the rate logged before
    _, logged, logged_vmapped = g.logged_training()
    throughput, vmapped = (logged, logged_vmapped) if logged else (measured, vmapped)
  else:
    throughput = measured
  return g.finish(evaluated, train_rows, throughput, vmapped)


def _payload(state: Any, wall_seconds: Any) -> dict:
  """What a run's checkpoint holds: one seed's train state and its wall time so far."""
  return {"state": state, "wall_seconds": np.asarray(wall_seconds, np.float64)}


def checkpoint_like(trainer: Trainer) -> dict:
  """The structure of one seed's checkpoint, from the trainer's shapes alone
  (`eqx.filter_eval_shape` of one seed's initialisation): nothing is initialised or
  compiled."""
  # `_init_one`, not the jitted `init`: tracing the trainer's jit (whose function closes
  # over the trainer) puts the trainer in JAX's caches, where gc cannot free it and its
  # world (`load_run`, a sweep's probes) stayed on the device for the rest of the process.
  one = eqx.filter_eval_shape(trainer._init_one, jax.random.PRNGKey(trainer.spec.config.seed))
  return _payload(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), one), 0.0)


def load_checkpoint(trainer: Trainer, run_dir: str, step: int,
                    like: Optional[dict] = None) -> tuple[TrainState, float]:
  """One seed's train state (host arrays) and wall seconds from the checkpoint of `step`;
  pass `like` (`checkpoint_like(trainer)`) when loading several seeds of one trainer."""
  found = checkpoint.load(run_dir, step, checkpoint_like(trainer) if like is None else like,
                          host=True)
  return found["state"], float(found["wall_seconds"])


class LoadedRun(NamedTuple):
  """A trained run restored from its directory."""

  system: Any                   # RankingSystem or RetrievalSystem
  trainer: Trainer              # its world (`trainer.world`), spec and jitted functions
  step: int


def load_run(run_dir: str, step: Optional[int] = None) -> LoadedRun:
  """The system of a run from its config.json and checkpoint (the newest, or `step`),
  on one device, whatever mesh trained it. `run_dir` is one seed's run: a workdir of
  several seeds, or a sweep's, is refused with the run directories found under it."""
  path = os.path.join(run_dir, CONFIG_FILE)
  if not os.path.exists(path):
    found = sorted(os.path.relpath(os.path.dirname(p), run_dir)
                   for p in writers.matching(run_dir, os.path.join("**", CONFIG_FILE)))
    hint = (f"; it holds the runs {', '.join(found[:4])}{', ...' * (len(found) > 4)}: pass "
            f"one of them, e.g. {os.path.join(run_dir, found[0])}" if found else "")
    raise FileNotFoundError(f"{run_dir} is not a run directory (no {CONFIG_FILE}){hint}")
  cfg = with_defaults(_read_run_file(path, advice=False))
  # One device, whatever mesh trained it (sharded tables, several hosts): the parameters
  # are the same arrays either way.
  one_device = base_config(cfg.task).mesh
  for name in one_device:
    cfg.mesh[name] = one_device[name]
  steps = checkpoint.available_steps(run_dir)
  if not steps:
    raise FileNotFoundError(f"{run_dir} has no checkpoint")
  step = steps[-1] if step is None else _count("step", step, 0)
  trainer = Trainer(parse_config(cfg))
  state, _ = load_checkpoint(trainer, run_dir, step)
  return LoadedRun(trainer.system(jax.device_put(state.params)), trainer, step)
