"""Tiny configs, random batches and shared jitted forwards for the core tests, and the
test session's XLA settings."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phoenix_flax as pf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Compiling dominates the suite's time on CPU. Two session-wide settings, made here and
# undone at the end, cut it; the xdist workers and every subprocess inherit them through
# the environment.
#
# 1. The tests compile quickly: unoptimised backend code
#    (`--xla_backend_optimization_level=0`: LLVM does not optimise the kernels) emitted by
#    XLA:CPU's older elemental emitter instead of its MLIR fusion emitters
#    (`--xla_cpu_use_fusion_emitters=false`), both added to the caller's XLA_FLAGS. A
#    cold `python -m experiments.run` at the smoke preset took 32-48 s of CPU time with
#    neither, 18.5-28 s with the first alone, 35-46 s with the second alone and 10-14 s
#    with both (6.5 s with every program already in the compilation cache; two rounds on
#    the 2-core AVX2 host). Float results move by a few ulps (no fused
#    multiply-adds, other exp code), within every tolerance here; the suite passes as
#    users compile too: `PHOENIX_FLAX_TEST_OPTIMIZED=1 pytest ...` runs it with XLA's
#    defaults.
# 2. One JAX persistent compilation cache for the session: many programs are compiled
#    again by another test, by a subprocess (command lines, notebooks, killed-and-resumed
#    runs) or by xdist's other worker. A cache hit loads the executable that compiling
#    would give, so no result depends on it. A JAX_COMPILATION_CACHE_DIR set by the caller
#    is left as it is (and kept).
#
# A third setting holds with PHOENIX_FLAX_TEST_OPTIMIZED=1 too: deterministic GPU programs
# (`--xla_gpu_deterministic_ops=true`; XLA:CPU ignores it). Many tests compare two runs bit
# for bit (a killed run resumed against an uninterrupted one, steps per host call, x64
# on and off). On one H200 without it, scatter-adds (most likely some reductions too)
# summed in a varying order and kernels were picked by timing them, and five such tests
# failed; with it four of them passed (the fifth, tests/test_invariance.py's seed-place
# test, is skipped off CPU; docs/testing.md).
#
# Two more are about the code, not the time: JAX's strict broadcasting
# (`jax_numpy_rank_promotion="raise"`) and strict dtype promotion
# (`jax_numpy_dtype_promotion="strict"`), so that the package, and the tests, broadcast
# arrays of different ranks and mix dtypes only where they say so. Projects that set them
# (jax's and flax's own test suites broadcast strictly) can then call every part of
# phoenix_flax.
OPTIMIZED_ENV = "PHOENIX_FLAX_TEST_OPTIMIZED"
_QUICK_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_EXACT_FLAGS = ("--xla_gpu_deterministic_ops=true",)
_CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


_KNOWN_QUICK_ENV = "PHOENIX_FLAX_TEST_QUICK_FLAGS"
_RANK_PROMOTION_ENV = "JAX_NUMPY_RANK_PROMOTION"
_DTYPE_PROMOTION_ENV = "JAX_NUMPY_DTYPE_PROMOTION"


def _xla_starts_with(flags: Sequence[str]) -> bool:
  """Whether a CPU backend starts in a fresh process with XLA_FLAGS set to `flags`."""
  env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        timeout=300).returncode == 0


def known_quick_flags() -> list[str]:
  """The session's flags (quick-compile and deterministic) this jaxlib's XLA knows. XLA
  ends the process when a backend starts with an unknown XLA_FLAGS entry, and jaxlib 0.12
  no longer knows `--xla_cpu_use_fusion_emitters`: with it the session died at collection
  with no message (the fatal log went to pytest's captured stderr). Each flag is tried in
  a subprocess the first time; the answer goes into the environment, where workers and
  subprocesses find it."""
  if _KNOWN_QUICK_ENV not in os.environ:
    wanted = _QUICK_FLAGS + _EXACT_FLAGS
    known = (list(wanted) if _xla_starts_with(wanted)
             else [flag for flag in wanted if _xla_starts_with([flag])])
    os.environ[_KNOWN_QUICK_ENV] = " ".join(known)
  return os.environ[_KNOWN_QUICK_ENV].split()


def quick_xla_flags(*flags: str) -> str:
  """XLA_FLAGS for a program of the test session: the caller's XLA_FLAGS, the session's
  flags that this jaxlib knows and it does not set already (the quick-compile ones unless
  PHOENIX_FLAX_TEST_OPTIMIZED=1, the deterministic one always), then `flags`."""
  current = os.environ.get("XLA_FLAGS", "")
  named = {flag.split("=", 1)[0] for flag in current.split()}
  quick = os.environ.get(OPTIMIZED_ENV) != "1"
  added = [flag for flag in known_quick_flags()
           if flag.split("=", 1)[0] not in named and (quick or flag in _EXACT_FLAGS)]
  return " ".join(filter(None, [current, *added, *flags]))


def subprocess_env(*xla_flags: str, **variables: str) -> dict:
  """Environment for a `python -m ...` subprocess run from the repository: this one, with
  the repository in front of the caller's PYTHONPATH (which may hold the packages
  themselves, e.g. installed with `pip install --target`), `quick_xla_flags(*xla_flags)`
  and `variables`."""
  path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH", "")]))
  return dict(os.environ, PYTHONPATH=path, XLA_FLAGS=quick_xla_flags(*xla_flags), **variables)


def _flax_extra_installed() -> bool:
  try:
    return importlib.util.find_spec("flax") is not None and (
        importlib.util.find_spec("orbax.checkpoint") is not None)
  except ModuleNotFoundError:   # find_spec of a submodule imports its package
    return False


# The `[flax]` extra's tests: `[test]` installs flax and orbax-checkpoint, so they run
# there; an install without them (a core install, or the floors of setup.py, below
# flax's own jax floor) skips them.
needs_flax = pytest.mark.skipif(not _flax_extra_installed(),
                                reason="needs the flax extra (flax, orbax-checkpoint)")


def import_error(module: str, prelude: str = "") -> str:
  """Run `prelude` (which hides or fakes a dependency), then `import module`, in a fresh
  interpreter at the repository root on CPU; the stdout, with the ImportError, if one was
  raised, printed as `ImportError: <message>`."""
  code = (f"{prelude}try:\n  import {module}\n"
          "except ImportError as e:\n  print('ImportError:', e)\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                        text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def run_at_once(commands: Sequence[Sequence[str]], env: dict, timeout: float = 300,
                stop_on_failure: bool = False) -> list[tuple[int, str]]:
  """Runs the commands at once from the repository and returns each one's (return code,
  stderr); stdout is dropped. Every command still running is killed (return code -9) once
  `timeout` seconds have passed, or, with `stop_on_failure`, once one has failed (processes
  that wait for each other, such as the members of a `jax.distributed` run)."""
  logs = [tempfile.TemporaryFile(mode="w+") for _ in commands]   # no pipe to fill up
  procs = [subprocess.Popen(list(command), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=log, text=True) for command, log in zip(commands, logs)]
  deadline = time.monotonic() + timeout
  try:
    while any(p.poll() is None for p in procs):
      if (time.monotonic() > deadline
          or stop_on_failure and any(p.poll() not in (None, 0) for p in procs)):
        break
      time.sleep(0.1)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  results = []
  for p, log in zip(procs, logs):
    log.seek(0)
    results.append((p.returncode, log.read()))
    log.close()
  return results


# The interpreter behind `ForkServer`: it imports the modules named on its command line,
# says READY, then reads one request a line (a module and its arguments) and answers each
# with a line holding the (exit status, stdout, stderr) of `python -m module *args`, run in
# a fork of itself (in a fresh interpreter where FRESH_ENV is 1, and off Linux: on macOS a
# forked child can crash, since system libraries there may start threads).
FRESH_ENV = "PHOENIX_FLAX_TEST_FRESH_INTERPRETERS"
_FORK_SERVER = r"""
import atexit, importlib, json, os, runpy, subprocess, sys, tempfile, traceback
fork = sys.platform.startswith("linux") and os.environ.get("%s") != "1"


def end_with_parent():   # SIGKILL when the parent dies, however it dies (prctl, Linux)
  import ctypes
  ctypes.CDLL(None, use_errno=True).prctl(1, 9)   # PR_SET_PDEATHSIG, SIGKILL


if fork:
  end_with_parent()   # a test process killed outright leaves no server behind
  for name in sys.argv[1:]:
    importlib.import_module(name)
  from jax._src import xla_bridge
  if xla_bridge.backends_are_initialized():   # XLA's threads do not survive a fork
    sys.exit(f"ForkServer: importing {sys.argv[1:]} started a JAX backend")
print("READY", flush=True)
for line in sys.stdin:
  request = json.loads(line)
  if not fork:
    p = subprocess.run([sys.executable, "-m", request["module"], *request["args"]],
                       stdin=subprocess.DEVNULL, capture_output=True)
    texts = [t.decode(errors="replace") for t in (p.stdout, p.stderr)]
    print(json.dumps([p.returncode, *texts]), flush=True)
    continue
  out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
  pid = os.fork()
  if pid == 0:   # the child: `python -m module *args` from here on
    end_with_parent()   # nor a run that trains on with no one to read it
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.argv = ["-m", *request["args"]]
    code = 0
    try:
      runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:   # as the interpreter exits for it
      if e.code is None or isinstance(e.code, int):
        code = e.code or 0
      else:
        print(e.code, file=sys.stderr)
        code = 1
    except BaseException:
      traceback.print_exc()
      code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
  texts = []
  for f in (out, err):
    f.seek(0)
    texts.append(f.read().decode(errors="replace"))
    f.close()
  print(json.dumps([status, *texts]), flush=True)
""" % FRESH_ENV


class ForkServer:
  """Runs command-line modules as `python -m module *args` would, from the repository in
  `env`, without paying for a fresh interpreter each time: one interpreter imports
  `preload` (and jax) once and forks a child per run. A fresh interpreter spends 1.5-2 s
  importing, which a test of dozens of refused command lines, or a file of several short
  training runs, pays again and again. The command-line modules themselves are not
  preloaded, so each child defines its flags afresh; nothing in the server starts a JAX
  backend, whose threads a fork would not copy. Runs go one after another, in `cwd` (the
  repository unless given; `env`'s PYTHONPATH finds the modules from anywhere). With
  PHOENIX_FLAX_TEST_FRESH_INTERPRETERS=1 in `env`, or off Linux, each run gets a fresh
  interpreter instead."""

  def __init__(self, env: dict, preload: Sequence[str] = ("phoenix_flax.training",),
               timeout: float = 300, cwd: str = REPO):
    self._log = tempfile.TemporaryFile(mode="w+")
    self._proc = subprocess.Popen([sys.executable, "-c", _FORK_SERVER, *preload], cwd=cwd,
                                  env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self._log, text=True, start_new_session=True)
    assert self._readline(timeout) == "READY\n", self._failure()

  def _readline(self, timeout: float) -> str:
    ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
    if not ready:
      self.close()
      raise TimeoutError(f"ForkServer: no answer within {timeout} s")
    return self._proc.stdout.readline()

  def _failure(self) -> str:
    self.close()
    self._log.seek(0)
    return self._log.read()[-3000:]

  def submit(self, module: str, args: Sequence[str]) -> None:
    """Starts `python -m module *args`; `run` waits for it."""
    self._proc.stdin.write(json.dumps({"module": module, "args": list(args)}) + "\n")
    self._proc.stdin.flush()

  def run(self, module: str, args: Sequence[str], timeout: float = 600
          ) -> tuple[int, str, str]:
    """`python -m module *args`: (exit status, stdout, stderr)."""
    self.submit(module, args)
    line = self._readline(timeout)
    assert line, self._failure()
    return tuple(json.loads(line))

  def close(self) -> None:
    if self._proc.poll() is None:
      os.killpg(self._proc.pid, signal.SIGKILL)   # the server and a child it waits for
      self._proc.wait()

  def __enter__(self) -> "ForkServer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


@pytest.fixture(scope="module")
def fork_server():
  """A ForkServer of the test file, in the session's environment (`subprocess_env()`)."""
  with ForkServer(subprocess_env()) as server:
    yield server


@pytest.fixture
def drawn_figures(monkeypatch) -> list:
  """The figures `ablations.report.save_figure` is handed during the test, kept (in
  order) instead of written."""
  from ablations import report
  figures = []
  monkeypatch.setattr(report, "save_figure", lambda fig, path: figures.append(fig))
  return figures


def run_forked(module: str, argvs: Sequence[Sequence[str]], env: dict,
               preload: Sequence[str] = ("phoenix_flax.training",), cwd: str = REPO
               ) -> list[tuple[int, str, str]]:
  """`python -m module *argv` for each argument list, through one ForkServer."""
  with ForkServer(env, preload, cwd=cwd) as server:
    return [server.run(module, argv) for argv in argvs]


def rounding(tolerance: float) -> float:
  """`tolerance`, set on CPUs, for comparing one float32 computation run as two programs
  (all candidates against chunks of them, rows in micro-batches, a scanned against an
  unrolled layer loop), which rounding alone separates; 10 times as much on other backends.

  A GPU's compiler picks, per matmul shape and by timing candidates when it compiles
  (autotuning), a kernel and with it an order of summation, so the same comparison rounds
  differently from one run to the next. On one H200 at JAX_DEFAULT_MATMUL_PRECISION=highest,
  across two runs, four comparisons went past their CPU tolerance, by 2.9 times at most (a
  retrieval gradient of 0.0094 that differed by 5.7e-7, against atol 1e-7 and rtol 1e-5).
  """
  return tolerance if jax.default_backend() == "cpu" else 10 * tolerance


def pytest_configure(config):
  if hasattr(config, "workerinput"):
    return            # an xdist worker: it inherits the controller's environment
  if jax._src.xla_bridge.backends_are_initialized():   # XLA_FLAGS would come too late
    raise pytest.UsageError("tests/conftest.py: a JAX backend started before the session "
                            "set XLA_FLAGS")
  config.phoenix_flax_saved_env = {name: os.environ.get(name) for name in
                                   ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR",
                                    _KNOWN_QUICK_ENV, *_CACHE_ENV, _RANK_PROMOTION_ENV,
                                    _DTYPE_PROMOTION_ENV)}
  os.environ["XLA_FLAGS"] = quick_xla_flags()
  os.environ[_RANK_PROMOTION_ENV] = "raise"   # (the workers' and subprocesses' jax)
  jax.config.update("jax_numpy_rank_promotion", "raise")   # (this process's, imported)
  os.environ[_DTYPE_PROMOTION_ENV] = "strict"
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  path = tempfile.mkdtemp(prefix="phoenix_flax_test_jax_cache_")
  config.phoenix_flax_jax_cache = path
  os.environ.update(_CACHE_ENV, JAX_COMPILATION_CACHE_DIR=path)
  jax.config.update("jax_compilation_cache_dir", path)   # jax is already imported here
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  path = getattr(config, "phoenix_flax_jax_cache", None)
  if path is not None:
    shutil.rmtree(path, ignore_errors=True)
  for name, value in getattr(config, "phoenix_flax_saved_env", {}).items():
    if value is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = value


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's in-memory caches after each test file. XLA:CPU maps memory for every
  program it compiles (8 to 9 mappings for a small one, measured with jax 0.10.2 and
  0.12.0.1), and JAX keeps each program of a jitted function, one per input shape, until
  `jax.clear_caches()`. A Linux process may hold `vm.max_map_count` mappings, 65,530 by
  default: a process that kept the whole suite's programs would reach that, and jaxlib then
  crashes (a segmentation fault or abort while compiling or (de)serialising a program). Each
  of the two xdist workers held about 51,000 mappings at the end of a full run before this
  fixture, and a single process running most of the suite reached 64,935 and crashed. A
  program needed again in another file is loaded from the session's persistent cache.

  A file whose own programs take over `_MAPPINGS_SHARE` of the limit fails here, naming
  itself, before a growing file crashes a worker with no message."""
  yield
  held, limit = _memory_mappings()
  jax.clear_caches()
  if limit and held > _MAPPINGS_SHARE * limit:
    pytest.fail(f"this test file left the process holding {held:,} memory mappings, over "
                f"{_MAPPINGS_SHARE:.0%} of vm.max_map_count ({limit:,}), at which jaxlib "
                "crashes: split the file, or call jax.clear_caches() within it",
                pytrace=False)


_MAPPINGS_SHARE = 0.75


def _memory_mappings() -> tuple[int, Optional[int]]:
  """(mappings this process holds, vm.max_map_count); (0, None) where /proc has neither."""
  try:
    with open("/proc/self/maps", "rb") as maps, open("/proc/sys/vm/max_map_count") as limit:
      return sum(1 for _ in maps), int(limit.read())
  except (OSError, ValueError):
    return 0, None


EMB = 32
NUM_ACTIONS = 19
SURFACES = 16


def open_files_under(folder: str) -> list[str]:
  """The files under `folder` that this process holds open (Linux: /proc/self/fd)."""
  found = []
  for fd in os.listdir("/proc/self/fd"):
    try:
      target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:   # the listing's own descriptor, closed by now
      continue
    if target.startswith(os.path.abspath(folder) + os.sep):
      found.append(target)
  return found


def session_end_status(run_dir: str) -> str:
  """The status of the HParams session end that a run's event files record, by name."""
  from tensorboard.backend.event_processing import event_accumulator
  from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
  acc = event_accumulator.EventAccumulator(run_dir)
  acc.Reload()
  content = acc.PluginTagToContent("hparams")["_hparams_/session_end_info"]
  status = plugin_data_pb2.HParamsPluginData.FromString(content).session_end_info.status
  return api_pb2.Status.Name(status)


def transformer_config(**overrides) -> pf.TransformerConfig:
  """D=32, 4 query / 2 KV heads of size 8, 2 layers, ffn 48."""
  fields = dict(emb_size=EMB, key_size=8, num_q_heads=4, num_kv_heads=2, num_layers=2,
                widening_factor=2.0, attn_output_multiplier=0.25)
  fields.update(overrides)
  return pf.TransformerConfig(**fields)


def ranking_config(history: int = 4, candidates: int = 3, transformer=None,
                   **overrides) -> pf.PhoenixModelConfig:
  tc = transformer or transformer_config()
  return pf.PhoenixModelConfig(model=tc, emb_size=tc.emb_size, num_actions=NUM_ACTIONS,
                               history_seq_len=history, candidate_seq_len=candidates,
                               **overrides)


def retrieval_config(history: int = 4, candidates: int = 3, transformer=None,
                     **overrides) -> pf.PhoenixRetrievalModelConfig:
  tc = transformer or transformer_config()
  return pf.PhoenixRetrievalModelConfig(model=tc, emb_size=tc.emb_size,
                                        num_actions=NUM_ACTIONS, history_seq_len=history,
                                        candidate_seq_len=candidates, **overrides)


def make_batch(config, batch_size: int = 2, seed: int = 0,
               history_valid: Optional[Sequence[int]] = None,
               candidate_mask=None, user_valid: Optional[Sequence[bool]] = None,
               ) -> tuple[pf.RecsysBatch, pf.RecsysEmbeddings]:
  """Random batch + embeddings for `config` (history left-aligned, hash 0 = padding).

  `history_valid[b]` is the number of valid history items of row b (default: all);
  `candidate_mask` `[B, C]` marks valid candidates (default: all); `user_valid[b]`.
  Padded slots keep random embeddings, so any leak through the masks shows up. The
  optional fields that `config` asks for are filled too: candidate post ages from 0 to
  a bit over the post-age table's range (candidate 0's timestamp missing), and dwell
  times from 0 to 60 s on every history slot.
  """
  hc = config.hash_config
  B, S, C, D = batch_size, config.history_seq_len, config.candidate_seq_len, config.emb_size
  U, I, Au = hc.num_user_hashes, hc.num_item_hashes, hc.num_author_hashes
  rng = np.random.default_rng(seed)
  hashes = lambda *shape: rng.integers(1, 1000, size=shape).astype(np.int32)
  user, hist_post, hist_author = hashes(B, U), hashes(B, S, I), hashes(B, S, Au)
  cand_post, cand_author = hashes(B, C, I), hashes(B, C, Au)
  if history_valid is not None:
    keep = np.arange(S)[None, :] < np.asarray(history_valid)[:, None]
    hist_post[~keep] = 0
    hist_author[~keep] = 0
  if candidate_mask is not None:
    keep = np.asarray(candidate_mask, bool)
    cand_post[~keep] = 0
    cand_author[~keep] = 0
  if user_valid is not None:
    user[~np.asarray(user_valid, bool)] = 0
  batch = pf.RecsysBatch(
      user_hashes=jnp.asarray(user),
      history_post_hashes=jnp.asarray(hist_post),
      history_author_hashes=jnp.asarray(hist_author),
      history_actions=jnp.asarray(rng.integers(0, 2, size=(B, S, NUM_ACTIONS)), jnp.float32),
      history_product_surface=jnp.asarray(rng.integers(0, SURFACES, size=(B, S)), jnp.int32),
      candidate_post_hashes=jnp.asarray(cand_post),
      candidate_author_hashes=jnp.asarray(cand_author),
      candidate_product_surface=jnp.asarray(rng.integers(0, SURFACES, size=(B, C)), jnp.int32))
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  embeddings = pf.RecsysEmbeddings(
      user_embeddings=normal(B, U, D),
      history_post_embeddings=normal(B, S, I, D),
      candidate_post_embeddings=normal(B, C, I, D),
      history_author_embeddings=normal(B, S, Au, D),
      candidate_author_embeddings=normal(B, C, Au, D))
  fields = config.optional_batch_fields
  if "impression_timestamps" in fields:
    now = rng.integers(10**6, 2 * 10**6, size=(B,))
    max_age_s = 60 * config.post_age_granularity_mins * (config.num_post_age_buckets + 1)
    posted = now[:, None] - rng.integers(0, max_age_s, size=(B, C))
    posted[:, 0] = 0
    batch = batch._replace(impression_timestamps=jnp.asarray(now, jnp.int32),
                           candidate_post_timestamps=jnp.asarray(posted, jnp.int32))
  if "history_dwell_times" in fields:
    batch = batch._replace(history_dwell_times=jnp.asarray(rng.uniform(0, 60, (B, S)),
                                                           jnp.float32))
  return batch, embeddings


def index_candidates(batch: pf.RecsysBatch, embeddings: pf.RecsysEmbeddings, index):
  """Reorders (or selects) candidate slots along axis 1 of every candidate field."""
  take = lambda x: x[:, index]
  batch = batch._replace(candidate_post_hashes=take(batch.candidate_post_hashes),
                         candidate_author_hashes=take(batch.candidate_author_hashes),
                         candidate_product_surface=take(batch.candidate_product_surface))
  embeddings = embeddings._replace(
      candidate_post_embeddings=take(embeddings.candidate_post_embeddings),
      candidate_author_embeddings=take(embeddings.candidate_author_embeddings))
  return batch, embeddings


@eqx.filter_jit
def call(fn, *args):
  """`fn(*args)` under one jit (eager dispatch compiles every op and is slow on CPU)."""
  return fn(*args)


@eqx.filter_jit
def forward(model, batch, embeddings):
  """Jitted `model.forward`; compiled once per (config, shapes) and shared by tests."""
  return model.forward(batch, embeddings)


def layer(transformer: pf.Transformer, index: int):
  """Layer `index` of a stacked transformer as a standalone DecoderLayer."""
  params, static = eqx.partition(transformer.layers, eqx.is_array)
  return eqx.combine(jax.tree.map(lambda x: x[index], params), static)


def table_cells(line: str) -> list[str]:
  """The cells of a markdown table row, `| a | b |` -> ["a", "b"]."""
  return [cell.strip() for cell in line.strip().strip("|").split("|")]


def max_abs_diff(a, b) -> float:
  return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def shared_draws(a, b) -> float:
  """|correlation| of two arrays' flattened values over their common prefix: near 1 where
  both were drawn from one key (the element-wise partitioned threefry gives each flat
  index the same bits whatever the shape), near 0 for keys of their own."""
  a, b = np.ravel(a), np.ravel(b)
  n = min(a.size, b.size)
  return float(abs(np.corrcoef(a[:n], b[:n])[0, 1]))


def float32_ulp(x) -> float:
  """float32's epsilon times `x`'s largest magnitude (`rounding`'s allowance included): the
  unit in which two programs of one computation are compared, `max_abs_diff(a, b) <= 16 *
  float32_ulp(b)`, which holds across the jaxlib versions and kernels tried."""
  return rounding(float(np.finfo(np.float32).eps * jnp.max(jnp.abs(jnp.asarray(x)))))


@contextlib.contextmanager
def compiled_programs():
  """Yields a list that collects the name of each XLA program compiled inside the block
  (`jax.log_compiles`' messages, read from the "jax" logger)."""
  names = []

  class Collect(logging.Handler):
    def emit(self, record):
      found = re.match(r"Finished XLA compilation of (.+) in ", record.getMessage())
      if found:
        names.append(found.group(1))
  handler, logger = Collect(), logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      yield names
  finally:
    logger.removeHandler(handler)


def jaxpr_equations(jaxpr, into_loops=True):
  """Every equation of a jaxpr and of its sub-jaxprs (jits, calls, and scans and loops
  unless `into_loops` is False)."""
  for eqn in jaxpr.eqns:
    yield eqn
    if not into_loops and eqn.primitive.name in ("scan", "while"):
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from jaxpr_equations(sub, into_loops)
