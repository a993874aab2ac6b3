"""Checkpoints: a run killed mid-way resumes to the same result; finished runs are skipped."""

from __future__ import annotations

import contextlib
import errno
import gc
import glob
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from tensorboard.backend.event_processing import event_accumulator

from conftest import REPO, compiled_programs, open_files_under, subprocess_env
from experiments.configs import ranking as ranking_configs
from phoenix_flax.training import (ConfigError, RunInterrupted, RunInUseError, checkpoint,
                                   run_experiment, writers)
from phoenix_flax.training import loop, provenance, runner
from phoenix_flax.training.loop import unstack
from phoenix_flax.training.runner import load_run
from phoenix_flax.training.schema import parse_config, seed_config
from phoenix_flax.training.sharding import DATA_AXIS, Placement, make_placement


# The smoke preset (40 steps, 10 per host call, checkpoints at 20) that kills itself with
# SIGKILL when its progress callback reports KILL_AT_STEP: after the step-20 checkpoint
# and the step-30 metrics row, before the end.
KILLABLE_RUN = """
import os, signal, sys
from experiments.configs import ranking
from phoenix_flax.training import run_experiment
kill_at = int(os.environ.get("KILL_AT_STEP", "0"))
def progress(p):
  print("progress", p.step, p.start_step, p.compiling, flush=True)
  if p.step == kill_at:
    os.kill(os.getpid(), signal.SIGKILL)
run_experiment(ranking.get_config("smoke"), sys.argv[1], progress=progress,
               on_start=lambda seeds, step: print("start", step, flush=True))
"""


@pytest.fixture(scope="module")
def env():
  """Subprocess environment with the session's XLA settings (unoptimised compiles, one
  compilation cache: conftest.py)."""
  return subprocess_env()


def _rows(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _curve(run_dir):
  """Every logged value except timings."""
  return [{k: v for k, v in row.items() if k != "wall_seconds" and not k.startswith("perf/")}
          for row in _rows(run_dir)]


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, env, monkeypatch, caplog):
  straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
  cli = subprocess.run(
      [sys.executable, "-m", "experiments.run",
       "--config=experiments/configs/ranking.py:smoke", f"--workdir={straight}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert cli.returncode == 0, cli.stderr[-3000:]
  # A line before compiling (so the first progress line comes late).
  assert cli.stdout.splitlines()[0] == (
      "seed 0: starting; 40 steps of batch 8 to go, a progress line every 10; compiling "
      "the training and evaluation programs first")
  progress = [line for line in cli.stdout.splitlines() if line.startswith("step ")]
  assert len(progress) == 4 and all("eta" in line for line in progress)
  assert "compiled and ran in" in progress[0]            # its time includes compiling
  assert all("steps/s" in line for line in progress[1:])
  assert "result.json" in cli.stdout.splitlines()[-1] and "skipped" not in cli.stdout
  rerun = subprocess.run(cli.args, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
  assert rerun.returncode == 0 and len(rerun.stdout.splitlines()) == 1   # the summary only
  assert "(an earlier run; skipped" in rerun.stdout

  first = subprocess.run([sys.executable, "-c", KILLABLE_RUN, killed], cwd=REPO,
                         env=dict(env, KILL_AT_STEP="30"), capture_output=True, text=True,
                         timeout=600)
  assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
  assert not os.path.exists(os.path.join(killed, "result.json"))
  assert checkpoint.available_steps(killed) == [20]
  assert [r["step"] for r in _rows(killed)] == [10, 20, 30]

  again = subprocess.run([sys.executable, "-c", KILLABLE_RUN, killed], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert first.stdout.split("\n")[0] == "start 0"
  assert [line.split() for line in again.stdout.splitlines()] == [   # resumed at 20,
      ["start", "20"], ["progress", "30", "20", "True"],              # compiled once
      ["progress", "40", "20", "False"]]
  want = json.load(open(os.path.join(straight, "result.json")))
  got = json.load(open(os.path.join(killed, "result.json")))
  assert got["final"] == want["final"]
  assert got["steps"] == want["steps"] == 40 and got["diverged"] is False
  assert _curve(killed) == _curve(straight)
  # Wall time carries over the kill: the resumed rows continue from the checkpoint's.
  walls = [r["wall_seconds"] for r in _rows(killed)]
  assert walls == sorted(walls) and got["wall_seconds"] >= walls[-1]
  assert checkpoint.available_steps(killed)[-1] == 40
  # TensorBoard holds every step once: the killed process flushed its events up to the
  # checkpoint it resumed from (they were still buffered otherwise: it ran for seconds).
  events = event_accumulator.EventAccumulator(killed, size_guidance={"scalars": 0})
  events.Reload()
  assert [e.step for e in events.Scalars("train/loss")] == [10, 20, 30, 40]
  assert [e.step for e in events.Scalars("eval/auc_mean")] == [20, 40]

  # Finished: the same call is skipped (nothing rewritten); another config is refused.
  before = {f: os.path.getmtime(os.path.join(killed, f)) for f in os.listdir(killed)}
  skipped = run_experiment(ranking_configs.get_config("smoke"), killed)
  assert skipped[0]["final"] == want["final"]
  assert before == {f: os.path.getmtime(os.path.join(killed, f)) for f in os.listdir(killed)}
  # Each result names the code that trained it; reusing it after the code changed warns.
  assert want["code"] == got["code"] == provenance.running_code_version()
  assert "other code" not in caplog.text
  monkeypatch.setattr(provenance, "running_code_version", lambda: "0123456789ab+changes.x")
  run_experiment(ranking_configs.get_config("smoke"), killed)
  assert "1 finished run(s) reused as they are, trained by other code" in caplog.text
  assert f"delete {killed} " in caplog.text
  monkeypatch.undo()
  other = ranking_configs.get_config("smoke")
  other.optim.learning_rate = 1e-4
  with pytest.raises(ConfigError, match="optim.learning_rate"):
    run_experiment(other, killed)
  # Without its config.json a run's result and checkpoints cannot be checked against any
  # config: neither reused nor resumed, whatever the config asked for.
  os.rename(os.path.join(killed, "config.json"), os.path.join(killed, "config.moved"))
  for asked in (other, ranking_configs.get_config("smoke")):
    with pytest.raises(ConfigError, match=r"holds result.json and checkpoints of steps "
                                          r"\[20, 40\] but no config.json"):
      run_experiment(asked, killed)
  os.rename(os.path.join(killed, "config.moved"), os.path.join(killed, "config.json"))

  # Killed after the final checkpoint but before result.json: the re-run trains nothing
  # and writes the same result, train scalars included (read back from metrics.jsonl).
  os.remove(os.path.join(killed, "result.json"))
  late = subprocess.run([sys.executable, "-c", KILLABLE_RUN, killed], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)
  assert late.returncode == 0, late.stderr[-3000:]
  late = json.load(open(os.path.join(killed, "result.json")))
  assert late["final"] == want["final"] and late["steps"] == 40
  assert late["wall_seconds"] >= walls[-1]
  assert late["examples_per_second"] > 0
  assert _curve(killed) == _curve(straight)

  # A run made before a field existed (its config.json lacks it) counts as having the
  # field's default: it is still skipped as finished, and it loads.
  config_path = os.path.join(killed, "config.json")
  stored = json.load(open(config_path))
  # What the config's None resolved to on this platform (float32 on CPU, bfloat16 on GPU).
  assert stored["model"]["fprop_dtype"] == runner.default_fprop_dtype()
  del stored["model"]["attention_impl"]
  stored["model"]["fprop_dtype"] = None                # as written before dtypes were
  json.dump(stored, open(config_path, "w"))
  assert run_experiment(ranking_configs.get_config("smoke"), killed)[0]["final"] == want["final"]
  assert load_run(killed).trainer.spec.model.attention_impl == "isolated"

  # A platform where None means another dtype must not resume or skip the run as its own.
  stored["model"]["fprop_dtype"] = "float32"
  json.dump(stored, open(config_path, "w"))
  monkeypatch.setattr(runner, "default_fprop_dtype", lambda: "bfloat16")
  with pytest.raises(ConfigError, match="model.fprop_dtype 'float32' there, 'bfloat16' here\\); "
                                        "it computed in float32: pass "
                                        "--config.model.fprop_dtype=float32 to resume it here"):
    run_experiment(ranking_configs.get_config("smoke"), killed)


def test_a_run_refuses_a_directory_of_files_no_run_wrote(tmp_path):
  """A workdir that holds someone else's files and no config.json (the home directory,
  another project's TensorBoard logs) is refused before any work, and nothing in it is
  touched; a run's own leftovers from before its config.json was written are not."""
  config = ranking_configs.get_config("smoke")
  logs = tmp_path / "logs"
  logs.mkdir()
  files = {"events.out.tfevents.1.other": b"not ours", "metrics.jsonl": b"{}\n",
           "notes.txt": b"mine"}
  for name, data in files.items():
    (logs / name).write_bytes(data)
  with pytest.raises(ConfigError, match=r"logs holds files that no run wrote \("
                     r"events.out.tfevents.1.other, metrics.jsonl, notes.txt\) and no "
                     r"config.json: .* use a new or empty directory"):
    run_experiment(config, str(logs))
  assert {p.name: p.read_bytes() for p in logs.iterdir()} == files
  for k in range(4):
    (logs / f"more_{k}").mkdir()
  with pytest.raises(ConfigError, match=r"\(events.out.tfevents.1.other, metrics.jsonl, "
                                        r"more_0, more_1, more_2 and 2 more\)"):
    runner.check_run_dirs(config, str(logs))
  # A name that only starts like a seed's folder is no seed's.
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "seed_2_old.csv").write_text("")
  with pytest.raises(ConfigError, match=r"files that no run wrote \(seed_2_old.csv\)"):
    runner.check_run_dirs(config, str(tmp_path / "other"))
  # What a run writes before its config: its lock, temporaries, an empty checkpoint folder.
  own = tmp_path / "own"
  (own / "checkpoint").mkdir(parents=True)
  (own / ".lock").write_text("")
  (own / ".config.json.tmp.12345").write_text("")
  (own / "checkpoint" / ".step_000000010.eqx.tmp.12345").write_text("")   # a killed save's
  runner.check_run_dirs(config, str(own))
  # A `checkpoint` of someone else's: TensorFlow's checkpoint-state file, or a folder of
  # other files (a plain file there once trained in full and then crashed at the first save).
  for name, make in [("tf_file", lambda p: p.write_text("model_checkpoint_path: x")),
                     ("tf_folder", lambda p: (p.mkdir(), (p / "model.ckpt-100.index")
                                              .write_text("")))]:
    (tmp_path / name).mkdir()
    make(tmp_path / name / "checkpoint")
    with pytest.raises(ConfigError, match=rf"{name} holds files that no run wrote "
                                          r"\(checkpoint\)"):
      runner.check_run_dirs(config, str(tmp_path / name))
  # One seed where several trained (their seed folders), and several seeds: the run
  # directories are the seed folders then, not the workdir.
  (own / "seed_0").mkdir()
  runner.check_run_dirs(config, str(own))
  config.num_seeds = 2
  runner.check_run_dirs(config, str(logs))
  (logs / "seed_1").mkdir()
  (logs / "seed_1" / "notes.txt").write_text("")
  with pytest.raises(ConfigError, match=r"seed_1 holds files that no run wrote \(notes.txt\)"):
    runner.check_run_dirs(config, str(logs))


def test_a_bfloat16_checkpoint_reads_back_into_host_memory_as_bfloat16(tmp_path):
  """NumPy writes bfloat16 as raw 2-byte records; `load(host=True)` views them as
  bfloat16 again (they were a structured |V2 array, refused against the tree)."""
  tree = {"w": jnp.arange(4, dtype=jnp.bfloat16) / 3, "n": jnp.arange(2, dtype=jnp.int32)}
  checkpoint.save(str(tmp_path), 10, tree)
  loaded = checkpoint.load(str(tmp_path), 10, tree, host=True)
  assert isinstance(loaded["w"], np.ndarray) and loaded["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(loaded["w"], np.asarray(tree["w"]))
  np.testing.assert_array_equal(loaded["n"], np.asarray(tree["n"]))
  # Into a structure of shapes alone (as the runner restores a sharded state): numpy too.
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  shaped = checkpoint.load(str(tmp_path), 10, like, host=True)
  assert all(isinstance(leaf, np.ndarray) for leaf in shaped.values())
  np.testing.assert_array_equal(shaped["w"], np.asarray(tree["w"]))
  # Only the raw records are viewed as their dtype: another stored dtype is refused, not
  # reinterpreted bit for bit (float32 ones as int32 1065353216, say).
  floats = {"w": jnp.ones(4, jnp.float32), "n": jnp.ones(2, jnp.float32)}
  checkpoint.save(str(tmp_path), 20, floats)
  for like in ({"w": tree["w"], "n": floats["n"]}, {"w": floats["w"], "n": tree["n"]}):
    with pytest.raises(checkpoint.CheckpointError, match="dtype"):
      checkpoint.load(str(tmp_path), 20, like, host=True)


def test_an_os_error_is_found_among_the_causes_and_contexts_of_a_failure():
  """A full disk inside a serialiser that raises its own error, with or without `from`:
  the OSError is found either way (a save names the disk, not the serialiser)."""
  full = OSError(28, "No space left on device")
  for linked in ("__cause__", "__context__"):
    outer = RuntimeError("failed to serialise leaf")
    setattr(outer, linked, full)
    assert checkpoint._os_error(outer) is full
  assert checkpoint._os_error(RuntimeError("no disk involved")) is None
  # A subclass (a permission, a missing folder) is an OSError too.
  denied = PermissionError(13, "Permission denied")
  outer = RuntimeError("failed to serialise leaf")
  outer.__context__ = denied
  assert checkpoint._os_error(outer) is denied
  # A chain that loops back on itself ends the search (the alarm fails a search that
  # does not end, rather than hang the suite).
  a, b = RuntimeError("a"), RuntimeError("b")
  a.__cause__, b.__cause__ = b, a

  def endless(*_):
    raise TimeoutError("_os_error went round a cyclic chain of causes")

  previous = signal.signal(signal.SIGALRM, endless)
  signal.alarm(10)
  try:
    assert checkpoint._os_error(a) is None
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_save_that_fails_names_the_disk_or_lets_the_error_be(tmp_path, monkeypatch):
  """A failure with an OSError behind it becomes a CheckpointError naming the file; any
  other failure comes out as it was raised."""
  tree = {"a": np.ones(2, np.float32)}
  for error, expected in ((PermissionError(13, "Permission denied"), checkpoint.CheckpointError),
                          (RuntimeError("not serialisable"), RuntimeError)):
    def failing(f, tree, error=error):
      raise error

    monkeypatch.setattr(checkpoint.eqx, "tree_serialise_leaves", failing)
    with pytest.raises(expected) as raised:
      checkpoint.save(str(tmp_path), 10, tree)
    assert type(raised.value) is expected
  monkeypatch.undo()
  for step in (10, 20, 30):   # without `keep`, the two newest are kept
    checkpoint.save(str(tmp_path), step, tree)
  assert checkpoint.available_steps(str(tmp_path)) == [20, 30]


def test_checkpoint_files_are_atomic_and_pruned(tmp_path):
  tree = {"a": np.arange(3, dtype=np.float32), "b": np.zeros((), np.int32)}
  for step in (10, 20, 30):
    checkpoint.save(str(tmp_path), step, {"a": tree["a"] + step, "b": tree["b"]}, keep=2)
  assert checkpoint.available_steps(str(tmp_path)) == [20, 30]
  assert not [f for f in os.listdir(tmp_path / "checkpoint") if ".tmp" in f]
  # A file named otherwise than `save` names them is no checkpoint: listed as step 4, it
  # could not be loaded, and the next save failed when it pruned it.
  (tmp_path / "checkpoint" / "step_4.eqx").write_bytes(b"")
  assert checkpoint.available_steps(str(tmp_path)) == [20, 30]
  # Nor is a folder under a checkpoint's name (load would fail on it).
  (tmp_path / "checkpoint" / os.path.basename(checkpoint.checkpoint_path("", 40))).mkdir()
  assert checkpoint.available_steps(str(tmp_path)) == [20, 30]
  checkpoint.save(str(tmp_path), 30, {"a": tree["a"] + 30, "b": tree["b"]}, keep=2)
  assert checkpoint.available_steps(str(tmp_path)) == [20, 30]
  loaded = checkpoint.load(str(tmp_path), 20, tree)
  np.testing.assert_array_equal(loaded["a"], tree["a"] + 20)
  with pytest.raises(FileNotFoundError, match="step 10"):
    checkpoint.load(str(tmp_path), 10, tree)
  with pytest.raises(ValueError, match="keep=0"):
    checkpoint.save(str(tmp_path), 40, tree, keep=0)
  assert checkpoint.available_steps(str(tmp_path)) == [20, 30]
  # A damaged file (truncated by a copy, a disk fault) is named, with what to do.
  path = os.path.join(tmp_path, "checkpoint", "step_000000030.eqx")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"step_000000030.eqx cannot be read .*An older step may still load "
                           r"\(steps on disk: \[20, 30\]\)"):
    checkpoint.load(str(tmp_path), 30, tree)
  # Bytes flipped in place (same size) fail the checksum instead of loading as weights.
  path = os.path.join(tmp_path, "checkpoint", "step_000000020.eqx")
  data = bytearray(open(path, "rb").read())
  assert data.startswith(checkpoint.MAGIC)
  data[len(data) // 2] ^= 0xFF
  open(path, "wb").write(bytes(data))
  with pytest.raises(checkpoint.CheckpointError, match=r"step_000000020.eqx cannot be read "
                                                       r"\(ValueError: its SHA-256 checksum"):
    checkpoint.load(str(tmp_path), 20, tree)
  # A file from before the checksum (equinox's bytes alone) still loads.
  eqx.tree_serialise_leaves(path, jax.tree.map(lambda a: a + 1, tree))
  np.testing.assert_array_equal(checkpoint.load(str(tmp_path), 20, tree)["a"], tree["a"] + 1)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files via /proc")
def test_a_run_that_raises_leaves_no_file_open(tmp_path):
  """A run stopped by an exception other than a signal (here its progress callback's)
  closes its event writers, as a finished or signalled one does: no file of the run
  directory stays open, however long the caller keeps the exception (and its traceback,
  which holds the writers)."""
  def progress(p):
    raise RuntimeError("the callback failed")

  workdir = str(tmp_path / "run")
  with pytest.raises(RuntimeError, match="the callback failed") as raised:
    run_experiment(ranking_configs.get_config("smoke"), workdir, progress=progress)
  assert raised.value is not None and open_files_under(workdir) == []


def test_the_checkpoint_structure_leaves_its_trainer_collectable():
  """`load_run` and a sweep's probes build a trainer to read a checkpoint by its structure
  (`checkpoint_like`), traced from one seed's initialisation, not from the trainer's
  jitted `init`: tracing that put the trainer in JAX's caches for good, and its world
  stayed on the device (15 arrays more per probed variant)."""
  import weakref
  spec = parse_config(ranking_configs.get_config("smoke"))
  trainer = loop.Trainer(spec)
  like = runner.checkpoint_like(trainer)
  stacked = eqx.filter_eval_shape(trainer.init, [spec.config.seed])   # (as it was read)
  assert jax.tree.structure(like["state"]) == jax.tree.structure(stacked)
  assert [(x.shape, x.dtype) for x in jax.tree.leaves(like["state"])] == [
      (x.shape[1:], x.dtype) for x in jax.tree.leaves(stacked)]
  fresh = loop.Trainer(spec)
  runner.checkpoint_like(fresh)
  gone = weakref.ref(fresh)
  del fresh
  gc.collect()
  assert gone() is None


def test_a_replaced_trainer_keeps_no_device_array(tmp_path):
  """The runner keeps one trainer, replaced by the next config's; the replaced one's
  world and evaluation references are freed even where JAX's caches of its compiled
  functions keep the object (they did: 15 more live arrays with each new config, its world
  102 MiB at the full preset)."""
  def config(lr):
    c = ranking_configs.get_config("smoke")
    c.train.update(dict(num_steps=10, steps_per_call=10, eval_every=0, checkpoint_every=10,
                        eval_batches=1))
    c.optim.learning_rate = lr
    return c

  def live() -> int:
    gc.collect()
    return len(jax.live_arrays())

  one_chunk = run_experiment(config(1e-2), str(tmp_path / "a"))[0]
  assert one_chunk["examples_per_second"] > 0   # its only chunk, compile included, timed
  after_one = live()
  run_experiment(config(2e-2), str(tmp_path / "b"))   # another trainer: lr is compiled in
  assert live() == after_one


def test_the_compile_counts_in_the_wall_time_and_the_first_chunks_time(tmp_path,
                                                                      monkeypatch):
  """`wall_seconds` is the run's time, compiling included; the first chunk, which waited
  for the compiler, logs that wait in `perf/first_call_seconds` and no rate, and the next
  chunk's rate leaves it out. (A first run compiles the programs for real: in the second,
  the compile is the sleep alone, longer than anything else the run does.)"""
  real = loop.Trainer.compile_chunk

  def slow_compile(self, state):
    real(self, state)
    time.sleep(1.5)
  monkeypatch.setattr(loop.Trainer, "compile_chunk", slow_compile)
  c = ranking_configs.get_config("smoke")
  c.train.update(dict(num_steps=20, steps_per_call=10, eval_every=0, checkpoint_every=0,
                      eval_batches=1))
  run_experiment(c, str(tmp_path / "first"))
  result = run_experiment(c, str(tmp_path / "second"))[0]
  rows = writers.read_metrics(str(tmp_path / "second"))
  assert rows[0]["perf/first_call_seconds"] >= 1.5
  assert result["wall_seconds"] >= rows[0]["perf/first_call_seconds"]
  assert "perf/steps_per_second" not in rows[0] and "perf/first_call_seconds" not in rows[1]
  assert rows[1]["perf/steps_per_second"] > 10 / 1.5


def test_a_resume_on_a_gpu_without_deterministic_programs_is_said_to_vary():
  """On an H200 a resumed run ended away from an uninterrupted one (docs/training.md,
  "Accelerators") unless XLA_FLAGS turned on deterministic programs; where it can, the
  runner warns when it resumes (the warning itself: the test below)."""
  vary = runner._resumes_vary
  assert not vary("cpu", "") and not vary("tpu", "")
  assert vary("gpu", "") and vary("gpu", "--xla_force_host_platform_device_count=8")
  for on in ("--xla_gpu_deterministic_ops=true", "--xla_gpu_deterministic_ops",
             "--xla_gpu_deterministic_ops=1", "--a=1 --xla_gpu_deterministic_ops=True"):
    assert not vary("gpu", on), on
  assert vary("gpu", "--xla_gpu_deterministic_ops=false")
  assert vary("gpu", "--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false")
  assert not vary("cpu", "--xla_gpu_deterministic_ops=false")


def test_an_unreadable_checkpoint_resumes_from_the_one_before_it(tmp_path, caplog,
                                                                 monkeypatch):
  """A damaged newest checkpoint of one seed (truncated by a copy, a disk fault) makes
  every seed resume from the newest step they all can read, with a warning naming the
  file, and the run ends as an uninterrupted one; with none readable the run stops with
  `CheckpointError` naming the files instead of training from scratch over them."""
  config = ranking_configs.get_config("smoke")
  config.num_seeds = 2
  config.train.checkpoint_every = 10
  workdir = str(tmp_path / "run")
  want = run_experiment(config, workdir)
  seed_dirs = [os.path.join(workdir, f"seed_{k}") for k in (0, 1)]
  assert [checkpoint.available_steps(d) for d in seed_dirs] == [[30, 40]] * 2

  def damage(run_dir, step):
    path = os.path.join(run_dir, "checkpoint", f"step_{step:09d}.eqx")
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
    return path

  for d in seed_dirs:
    os.remove(os.path.join(d, "result.json"))   # as if killed after the final checkpoint
  damaged = damage(seed_dirs[1], 40)
  # As on a GPU without deterministic programs: the resume says its result may vary.
  monkeypatch.setattr(runner, "_resumes_vary", lambda backend, flags: True)
  with caplog.at_level("WARNING", logger=runner.__name__):
    got = run_experiment(config, workdir)
  assert ("resuming at step 30 on a GPU without XLA_FLAGS=--xla_gpu_deterministic_ops=true"
          in caplog.text)
  assert f"checkpoint {damaged} cannot be read" in caplog.text
  assert "trying the one before it" in caplog.text
  # seed 0's readable step 40 is trained again, and the warning says so and how to keep
  # it (seed 1's damaged one is no step it has)
  assert ("later steps of seeds [0] (newest checkpoints at [40]) are trained again"
          in caplog.text)
  for k in (0, 1):
    assert got[k]["final"] == want[k]["final"] and got[k]["steps"] == 40
    assert [r["step"] for r in writers.read_metrics(seed_dirs[k])] == [10, 20, 30, 40]
  assert load_run(seed_dirs[1]).step == 40   # the damaged file was replaced by the retrained one
  # A fresh run resumes nothing, and says nothing of resuming.
  caplog.clear()
  fresh = ranking_configs.get_config("smoke")
  fresh.train.update(num_steps=10, eval_every=0, checkpoint_every=0, eval_batches=1)
  with caplog.at_level("WARNING", logger=runner.__name__):
    run_experiment(fresh, str(tmp_path / "fresh"))
  assert "resuming" not in caplog.text

  for d in seed_dirs:
    os.remove(os.path.join(d, "result.json"))
  paths = [damage(seed_dirs[0], 40), damage(seed_dirs[1], 30)]
  with pytest.raises(checkpoint.CheckpointError,
                     match="no checkpoint to resume from can be read") as raised:
    run_experiment(config, workdir)
  assert all(p in str(raised.value) for p in paths)
  assert checkpoint.available_steps(seed_dirs[0]) == [30, 40]   # nothing was overwritten


def test_a_restart_at_an_earlier_step_replaces_the_later_checkpoints(tmp_path):
  """After a restart from step 10 (the newest step every seed had), the old step 30 file
  must not make the new step 20 the one pruned."""
  tree = {"a": np.arange(3, dtype=np.float32)}
  for step in (10, 20, 30):
    checkpoint.save(str(tmp_path), step, tree, keep=3)
  checkpoint.save(str(tmp_path), 20, {"a": tree["a"] + 1}, keep=2)
  assert checkpoint.available_steps(str(tmp_path)) == [10, 20]
  np.testing.assert_array_equal(checkpoint.load(str(tmp_path), 20, tree)["a"], tree["a"] + 1)


def test_atomic_file_replaces_only_on_success_and_syncs_the_folder(tmp_path, monkeypatch):
  path = tmp_path / "out.json"
  writers.write_json(str(path), {"x": 1})
  synced = []
  real_fsync = os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_mode),
                                               real_fsync(fd))[1])
  with pytest.raises(RuntimeError, match="midway"):
    with writers.atomic_file(str(path)) as f:
      f.write('{"x": ')
      raise RuntimeError("midway")
  assert json.loads(path.read_text()) == {"x": 1}
  assert os.listdir(tmp_path) == ["out.json"]   # the temporary file is gone
  assert not synced                               # nothing was committed
  with writers.atomic_file(str(path), "wb") as f:
    f.write(b"new")
  assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.json"]
  if os.name == "posix":                          # the file, then its folder
    assert [stat.S_ISREG(m) for m in synced] == [True, False]
    assert stat.S_ISDIR(synced[1])
  with pytest.raises(ValueError, match="mode='a'"):
    with writers.atomic_file(str(path), "a"):
      pass
  # An interrupt (Ctrl-C is no Exception) also leaves the old file and no temporary.
  with pytest.raises(KeyboardInterrupt):
    with writers.atomic_file(str(path), "wb") as f:
      f.write(b"half")
      raise KeyboardInterrupt
  assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.json"]


def test_json_files_are_strict_json_and_truncated_metrics_rows_are_dropped(tmp_path, caplog):
  """NaN and +-inf become null (strict JSON has neither); a metrics.jsonl whose last line
  a kill cut short reads as the rows before it; a damaged line elsewhere is skipped with a
  warning and the rows after it are kept."""
  assert writers.jsonable({"a": [np.float32(np.inf), -np.inf, np.nan, 1.5], "b": 2}) == {
      "a": [None, None, None, 1.5], "b": 2}
  path = tmp_path / "result.json"
  writers.write_json(str(path), {"final": {"logloss": float("inf"), "auc": 0.75}})
  assert writers.read_json(str(path)) == {"final": {"logloss": None, "auc": 0.75}}
  # Keys sorted at every level: the same results give the same bytes, whatever the order.
  writers.write_json(str(path), {"b": 1, "a": {"d": 2, "c": 3}})
  assert path.read_text() == json.dumps({"a": {"c": 3, "d": 2}, "b": 1}, indent=2) + "\n"
  (tmp_path / "metrics.jsonl").write_text('{"step": 10}\n{"step": 20}\n{"step": 3')
  assert writers.read_metrics(str(tmp_path)) == [{"step": 10}, {"step": 20}]
  assert writers.read_metrics(str(tmp_path / "none")) == []
  (tmp_path / "metrics.jsonl").write_bytes(
      b'{"step": 10}\n{"st\x00\n3\n{"loss": 1.0}\n{"step": true}\n\xff\xfe\n{"step": 40}\n')
  with caplog.at_level("WARNING", logger=writers.__name__):
    assert writers.read_metrics(str(tmp_path)) == [{"step": 10}, {"step": 40}]
  warned = [n for n in range(1, 8) if f"metrics.jsonl line {n} is not" in caplog.text]
  assert warned == [2, 3, 4, 5, 6]   # (6: bytes that are no UTF-8)
  # A row cut just before its newline parses, but is still the unfinished last line: it
  # is dropped, silently like any cut-short row.
  caplog.clear()
  (tmp_path / "metrics.jsonl").write_text('{"step": 10}\n{"step": 30}')
  with caplog.at_level("WARNING", logger=writers.__name__):
    assert writers.read_metrics(str(tmp_path)) == [{"step": 10}]
  assert "not a metrics row" not in caplog.text


def test_write_json_keeps_the_old_file_when_a_write_fails(tmp_path, monkeypatch):
  """result.json and config.json go through atomic_file: a write that fails midway (a kill,
  a full disk) leaves the previous content, never a truncated file that reads as done."""
  path = tmp_path / "result.json"
  writers.write_json(str(path), {"steps": 20})

  def partial_dump(obj, f, **kw):
    f.write('{"steps": 4')
    raise OSError("disk full")

  monkeypatch.setattr(json, "dump", partial_dump)
  with pytest.raises(OSError, match="disk full"):
    writers.write_json(str(path), {"steps": 40})
  assert json.loads(path.read_text()) == {"steps": 20}
  assert os.listdir(tmp_path) == ["result.json"]


def test_placement_needs_batches_and_sharded_tables_that_divide_the_devices():
  """Checked before any work, not discovered inside jit midway through a run."""
  eight = types.SimpleNamespace(num_devices=8, shard_hash_tables=True)
  ok = ranking_configs.get_config("smoke")
  ok.train.update(batch_size=16, eval_batch_size=16)
  ok.world.update(user_buckets=256, post_buckets=512, author_buckets=64)
  runner._validate_placement(parse_config(ok), eight)
  for section, field, value in (("train", "batch_size", 12), ("train", "eval_batch_size", 12),
                                ("world", "user_buckets", 250), ("world", "post_buckets", 1001),
                                ("world", "author_buckets", 65)):
    bad = ranking_configs.get_config("smoke")
    bad.train.update(batch_size=16, eval_batch_size=16)
    bad.world.update(user_buckets=256, post_buckets=512, author_buckets=64)
    bad[section][field] = value
    with pytest.raises(ConfigError, match=f"config.{section}.{field}={value} is invalid"):
      runner._validate_placement(parse_config(bad), eight)
  bad.world.post_buckets = 1001   # unsharded tables may have any size
  runner._validate_placement(parse_config(bad), types.SimpleNamespace(
      num_devices=8, shard_hash_tables=False))


def test_placing_a_host_state_on_one_device_compiles_nothing():
  """A resumed state goes from host memory to the device as a copy: `jnp.asarray` of each
  NumPy leaf compiled a program per shape (19 at the smoke preset, about a second)."""
  host = {"table": np.arange(12.0, dtype=np.float32).reshape(4, 3),
          "step": np.int32(7), "moments": [np.ones((2, 5), np.float32), np.zeros(6, bool)]}
  with compiled_programs() as compiled:
    placed = Placement().place_state(host)
  assert compiled == []
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(placed))
  for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(host)):
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_a_host_state_is_placed_shard_by_shard_on_a_mesh(monkeypatch):
  """On a mesh, each NumPy leaf is built from its shards (`make_array_from_callback`), not
  `jax.device_put`, which runs a collective between the processes of a multi-host run to
  check that all hold the same; device arrays may take `device_put`."""
  from phoenix_flax.training import sharding
  put = []
  real = sharding.jax.device_put
  monkeypatch.setattr(sharding.jax, "device_put",
                      lambda x, *args, **kwargs: put.append(type(x)) or real(x, *args, **kwargs))
  placement = Placement(Mesh(np.array(jax.devices()[:1]), (DATA_AXIS,)), True)
  table = np.arange(24.0, dtype=np.float32).reshape(2, 4, 3)   # [seeds, rows, D]
  host = {"params": {"tables": {"post_table": table}}, "step": np.asarray(3, np.int32),
          "device": jnp.ones(2)}
  placed = placement.place_state(host)
  assert all(not issubclass(t, np.ndarray) for t in put), put
  for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(host)):
    assert isinstance(got, jax.Array) and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_make_placement_uses_the_visible_devices(caplog):
  n = jax.device_count()
  with caplog.at_level("WARNING"):
    assert make_placement(1, True).mesh is None       # one device: no mesh, nothing to shard
  assert "shard_hash_tables=True has no effect" in caplog.text
  caplog.clear()
  with caplog.at_level("WARNING"):
    make_placement(1, False)
  assert "has no effect" not in caplog.text   # (nothing asked for, nothing to say)
  assert make_placement(-1, False).num_devices == n
  assert make_placement(n, False).num_devices == n
  with pytest.raises(ConfigError, match=f"num_devices={n + 1} is invalid: only {n} "
                     + ("device is visible" if n == 1 else "devices are visible")):
    make_placement(n + 1, False)
  for bad in (0, -2, True, 1.0):   # (0 and -2 built a mesh over no or too few devices)
    with pytest.raises(ConfigError, match=f"num_devices={bad!r} is invalid: must be -1"):
      make_placement(bad, False)


def test_a_multi_process_mesh_holds_every_device(monkeypatch):
  """With several processes a mesh over some devices would leave a process without its
  shards (or train the whole run on each process alone): refused, -1 accepted."""
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert make_placement(-1, False).num_devices == jax.device_count()
  monkeypatch.setattr(jax, "devices", lambda: jax.local_devices() * 2)   # one per process
  with pytest.raises(ConfigError, match=r"num_devices=1 is invalid with 2 processes .*use -1 "
                                        r"\(all 2\)"):
    make_placement(1, False)


def test_a_seed_stacked_table_is_sharded_by_rows_after_the_seed_axis():
  """With sharded hash tables, a table stacked over seeds `[seeds, rows, D]` shards its
  rows (axis 1) and one seed's table `[rows, D]` its axis 0; other leaves, and 1-D ones,
  are replicated (on one device here: the 8-device test covers it too, in a subprocess
  ~50 times slower)."""
  placement = Placement(Mesh(np.asarray(jax.devices()[:1]), (DATA_AXIS,)),
                        shard_hash_tables=True)
  key = jax.tree_util.GetAttrKey
  table, other = (key("params"), key("post_table")), (key("params"), key("proj_mat_1"))
  stacked, single = jnp.zeros((2, 16, 4)), jnp.zeros((16, 4))
  assert placement._state_sharding(table, stacked, seed_axis=True).spec == P(None, DATA_AXIS)
  assert placement._state_sharding(table, single, seed_axis=False).spec == P(DATA_AXIS)
  assert placement._state_sharding(other, stacked, seed_axis=True).spec == P()
  assert placement._state_sharding(table, jnp.zeros((16,)), seed_axis=False).spec == P()


def test_constrain_batch_shards_arrays_and_leaves_scalars():
  placement = Placement(Mesh(np.asarray(jax.devices()[:1]), (DATA_AXIS,)))
  tree = {"ids": jnp.arange(8).reshape(4, 2), "temperature": jnp.float32(0.5)}
  out = jax.jit(placement.constrain_batch)(tree)
  np.testing.assert_array_equal(out["ids"], tree["ids"])
  assert float(out["temperature"]) == 0.5


def test_failed_checkpoint_write_keeps_the_previous_ones(tmp_path, monkeypatch):
  checkpoint.save(str(tmp_path), 10, {"a": np.ones(3, np.float32)}, keep=1)

  def disk_full(f, tree):
    f.write(b"partial")
    raise OSError("disk full")

  monkeypatch.setattr(checkpoint.eqx, "tree_serialise_leaves", disk_full)
  with pytest.raises(checkpoint.CheckpointError, match=r"step_000000020.eqx cannot be "
                                                       r"written \(disk full\)"):
    checkpoint.save(str(tmp_path), 20, {"a": np.zeros(3, np.float32)}, keep=1)
  assert checkpoint.available_steps(str(tmp_path)) == [10]
  assert os.listdir(tmp_path / "checkpoint") == ["step_000000010.eqx"]
  # A writer killed mid-write leaves its temporary file; the next save removes it.
  (tmp_path / "checkpoint" / ".step_000000020.eqx.tmp.999999").write_bytes(b"partial")
  (tmp_path / "checkpoint" / ".notes.tmp").write_text("not ours")
  monkeypatch.undo()
  checkpoint.save(str(tmp_path), 30, {"a": np.zeros(3, np.float32)}, keep=1)
  assert sorted(os.listdir(tmp_path / "checkpoint")) == [".notes.tmp", "step_000000030.eqx"]


def test_a_second_run_keeps_its_own_output_settings(tmp_path):
  """Runs whose configs differ only in `output` (or seeds) share one cached Trainer, yet
  each keeps and records its own settings."""
  def config(keep):
    c = ranking_configs.get_config("smoke")
    c.train.update(dict(num_steps=20, steps_per_call=10, eval_every=0, checkpoint_every=10,
                        eval_batches=1))
    c.train.score_consistency = False
    c.output.keep_checkpoints = keep
    return c
  first, second = str(tmp_path / "keep2"), str(tmp_path / "keep1")
  run_experiment(config(2), first)
  (trainer,) = runner._TRAINERS.values()
  run_experiment(config(1), second)
  (again,) = runner._TRAINERS.values()
  assert again is trainer                 # reused, compiled functions and all
  assert checkpoint.available_steps(first) == [10, 20]
  assert checkpoint.available_steps(second) == [20]
  recorded = json.load(open(os.path.join(second, runner.CONFIG_FILE)))
  assert recorded["output"]["keep_checkpoints"] == 1
  # The final checkpoint loads (from shapes alone) to the run's final parameters.
  loaded = load_run(second)
  assert loaded.step == 20
  state, wall = runner.load_checkpoint(loaded.trainer, second, 20)
  assert int(state.step) == 20 and wall > 0
  got = jax.tree.leaves(eqx.filter(loaded.system, eqx.is_array))
  want = jax.tree.leaves(state.params)
  assert len(got) == len(want) > 0
  for g, w in zip(got, want):             # load_run's system holds the checkpoint's params
    np.testing.assert_array_equal(g, w)
  fresh = jax.tree.leaves(eqx.filter(loaded.trainer.system(
      unstack(loaded.trainer.init([0]), 0).params), eqx.is_array))
  assert not all(np.array_equal(g, f) for g, f in zip(got, fresh))   # trained, not initial


def test_a_run_directory_is_locked_cleaned_and_finished_by_result_json(tmp_path, monkeypatch):
  """One process at a time trains a run directory; a failed start releases the lock; the
  partial files of a killed writer are removed; result.json comes after the TensorBoard
  events are closed (a run that has it is skipped, so nothing after it is ever repaired)
  and names the code the process imported; a workdir under a file is refused by name
  before any work."""
  config = ranking_configs.get_config("smoke")
  config.train.update(num_steps=10, eval_every=10, checkpoint_every=10)
  run_dir = str(tmp_path / "run")
  held = runner.lock_run_dir(run_dir)
  with pytest.raises(RunInUseError, match="is being trained by another process"):
    run_experiment(config, run_dir)
  os.close(held)

  def fail(dirs):
    raise OSError("disk gone")
  with monkeypatch.context() as m:
    m.setattr(runner, "_resume_steps", fail)
    with pytest.raises(OSError, match="disk gone"):
      run_experiment(config, run_dir)

  partial = os.path.join(run_dir, ".config.json.tmp.12345")
  with open(partial, "w") as f:
    f.write("{")
  order = []
  write_json, close = runner.write_json, writers.RunWriter.close
  monkeypatch.setattr(runner, "write_json",
                      lambda path, payload: (order.append(os.path.basename(path)),
                                             write_json(path, payload)))
  monkeypatch.setattr(writers.RunWriter, "close",
                      lambda self, finished, **kw: (order.append(f"close {finished}"),
                                                    close(self, finished, **kw)))
  # The checkout edited since this process imported the package: its code still runs, and
  # result.json names it.
  edited = "0123456789ab+changes.edited"
  monkeypatch.setattr(provenance, "code_version", lambda root=None: edited)
  result = run_experiment(config, run_dir)[0]
  assert result["code"] == provenance.running_code_version() != edited
  assert result["steps"] == 10 and not os.path.exists(partial)
  assert order == ["config.json", "close True", "result.json"]
  assert os.path.exists(os.path.join(run_dir, runner.LOCK_FILE))
  with pytest.raises(NotADirectoryError, match="result.json is a file, not a directory"):
    run_experiment(config, os.path.join(run_dir, "result.json", "sub"))


def test_a_refused_process_is_told_which_process_holds_the_run(tmp_path):
  """The refusal names the holder's process id and host, so the user can find the first
  launch; a holder killed with SIGKILL leaves its line in `.lock` but not its lock: the next
  process takes the directory and writes its own line."""
  run_dir = str(tmp_path / "run")
  lock_path = os.path.join(run_dir, runner.LOCK_FILE)
  os.makedirs(run_dir)
  holder = subprocess.Popen(   # another process: flock, its note as the runner writes it
      [sys.executable, "-c",
       "import fcntl, os, sys, time\n"
       f"fd = os.open({lock_path!r}, os.O_CREAT | os.O_RDWR)\n"
       "fcntl.flock(fd, fcntl.LOCK_EX)\n"
       "os.write(fd, b'pid %d on elsewhere since then\\n' % os.getpid())\n"
       "print('held', flush=True)\n"
       "time.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(RunInUseError, match=rf"another process \(pid {holder.pid} on "
                                            r"elsewhere since then; it holds "):
      runner.lock_run_dir(run_dir)
  finally:
    holder.kill()   # SIGKILL: no cleanup of its own
    holder.wait()
  with open(lock_path, "w") as f:   # a killed holder's longer note: replaced whole
    f.write("pid 4194303 on a-much-longer-host-name.example.org since 2026-01-01 00:00:00\n")
  fd = runner.lock_run_dir(run_dir)   # a stale note does not block
  try:
    with open(lock_path) as f:
      note = f.read()
    assert note.startswith(f"pid {os.getpid()} on ") and note.count("\n") == 1, note
    with pytest.raises(RunInUseError, match=rf"\(pid {os.getpid()} on .* since "):
      runner.lock_run_dir(run_dir)
  finally:
    os.close(fd)


def test_a_run_finished_by_another_process_before_the_lock_is_reused(tmp_path, monkeypatch):
  """A second launch that looked for result.json before the first process finished, and
  took the lock after, reuses the result (as a launch after it would) instead of
  evaluating the final checkpoint again and rewriting result.json and the events."""
  config = ranking_configs.get_config("smoke")
  config.train.update(num_steps=10, eval_every=10, checkpoint_every=10)
  run_dir = str(tmp_path / "run")
  theirs = {"final": {"auc_mean": 0.5}, "diverged": False, "steps": 10, "wall_seconds": 1.0}
  lock = runner.lock_run_dir

  def the_other_process_finishes_first(path):
    monkeypatch.setattr(runner, "lock_run_dir", lock)
    os.makedirs(path, exist_ok=True)
    writers.write_json(os.path.join(path, runner.CONFIG_FILE),
                       seed_config(config, 0).to_dict())
    writers.write_json(os.path.join(path, runner.RESULT_FILE), theirs)
    return lock(path)

  monkeypatch.setattr(runner, "lock_run_dir", the_other_process_finishes_first)
  assert run_experiment(config, run_dir) == {0: theirs}
  assert writers.read_json(os.path.join(run_dir, runner.RESULT_FILE)) == theirs
  assert not glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))


def _stop_at(step_signals: dict):
  """A progress callback that sends this process the given signals after those steps."""
  def progress(p):
    for sig in step_signals.get(p.step, ()):
      os.kill(os.getpid(), sig)
  return progress


def test_ctrl_c_and_sigterm_stop_at_a_chunk_end_with_a_checkpoint(tmp_path):
  """The first SIGINT or SIGTERM lets the chunk finish, writes a checkpoint of its step
  (10 and 30 are not checkpoint steps here) and raises `RunInterrupted`; running again
  resumes to the uninterrupted result. A second signal acts at once, as before."""
  config = ranking_configs.get_config("smoke")   # 10 steps a chunk, checkpoints at 20
  want = run_experiment(config, str(tmp_path / "straight"))[0]
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    run_dir = str(tmp_path / "stopped")
    with pytest.raises(RunInterrupted, match=r"stopped by SIGINT after step 10, with a "
                                             r"checkpoint in .*stopped; run the same") as e:
      run_experiment(config, run_dir, progress=_stop_at({10: [signal.SIGINT]}))
    assert e.value.signum == signal.SIGINT and e.value.step == 10
    assert e.value.dirs == [run_dir] and e.value.finished is False
    assert not hasattr(e.value, "stopped_at_once")   # (stopped with a checkpoint)
    assert checkpoint.available_steps(run_dir) == [10]
    assert not os.path.exists(os.path.join(run_dir, "result.json"))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # restored
    with pytest.raises(RunInterrupted, match="SIGTERM after step 30") as e:
      run_experiment(config, run_dir, progress=_stop_at({30: [signal.SIGTERM]}))
    assert e.value.signum == signal.SIGTERM and checkpoint.available_steps(run_dir) == [20, 30]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    got = run_experiment(config, run_dir)[0]
    assert got["final"] == want["final"] and got["steps"] == 40
    assert [r["step"] for r in writers.read_metrics(run_dir)] == [10, 20, 30, 40]

    # During the last chunk: the run finishes, and its caller (a sweep) still stops.
    last = str(tmp_path / "last")
    with pytest.raises(RunInterrupted, match=r"after step 40: the run in .*last had "
                                             r"finished") as e:
      run_experiment(config, last, progress=_stop_at({40: [signal.SIGINT]}))
    assert json.load(open(os.path.join(last, "result.json")))["final"] == want["final"]
    assert e.value.finished is True   # (its caller can tell it from a resumable stop)

    # Ctrl-C twice: the second raises KeyboardInterrupt where it lands, with no checkpoint.
    again = str(tmp_path / "twice")
    with pytest.raises(KeyboardInterrupt) as e:
      run_experiment(config, again, progress=_stop_at({10: [signal.SIGINT, signal.SIGINT]}))
    assert type(e.value) is KeyboardInterrupt and checkpoint.available_steps(again) == []
    assert e.value.stopped_at_once   # (for the scripts' message)
  finally:
    signal.signal(signal.SIGINT, previous)


def test_a_signal_while_compiling_stops_before_the_first_chunk(tmp_path, monkeypatch):
  """The training program compiles before signals are deferred to chunk ends: a Ctrl-C
  that lands while it compiles (its handler runs when the compiler returns) raises a plain
  KeyboardInterrupt with no chunk run and nothing saved. The chunks and evaluations of a
  run reuse the programs compiled there (so the ETA times no compile)."""
  config = ranking_configs.get_config("smoke")
  compile_chunk = loop.Trainer.compile_chunk
  def compile_then_signal(self, state):
    compile_chunk(self, state)
    os.kill(os.getpid(), signal.SIGINT)
  monkeypatch.setattr(loop.Trainer, "compile_chunk", compile_then_signal)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    run_dir = str(tmp_path / "run")
    with pytest.raises(KeyboardInterrupt) as e:
      run_experiment(config, run_dir)
    assert type(e.value) is KeyboardInterrupt
    assert checkpoint.available_steps(run_dir) == [] and writers.read_metrics(run_dir) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  finally:
    signal.signal(signal.SIGINT, previous)
  monkeypatch.setattr(loop.Trainer, "compile_chunk", compile_chunk)
  calls, compiles = [], []
  def logged(name):   # collects any compile that happens inside the method's calls
    method = getattr(loop.Trainer, name)
    def call(self, state):
      calls.append(name)
      with compiled_programs() as compiled:
        out = method(self, state)
      compiles.extend(compiled)
      return out
    monkeypatch.setattr(loop.Trainer, name, call)
  logged("train_chunk")
  logged("evaluate")
  result = run_experiment(config, run_dir)[0]   # the lock was released
  assert result["steps"] == 40 and not compiles, compiles
  assert calls.count("train_chunk") == 4 and calls.count("evaluate") == 2   # steps 20, 40


@pytest.mark.slow
def test_run_script_exits_143_on_sigterm_with_a_checkpoint(tmp_path, env):
  """`experiments/run.py` under a scheduler's SIGTERM: the message, the shell's status for
  that signal, and a checkpoint at the step it names."""
  workdir = str(tmp_path / "run")
  proc = subprocess.Popen(
      [sys.executable, "-m", "experiments.run", "--config=experiments/configs/ranking.py:smoke",
       "--config.train.num_steps=1000000", "--config.train.checkpoint_every=0",
       f"--workdir={workdir}"],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    # The start line, then the first chunk's progress line: training has begun.
    lines = [proc.stdout.readline() for _ in range(2)]
    if not (lines[0].startswith("seed 0: starting") and lines[1].startswith("step 10/")):
      proc.kill()   # before reading stderr to its end, which a live run never reaches
      pytest.fail("".join(lines) + proc.stderr.read()[-3000:])
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
  finally:
    proc.kill()
  assert proc.returncode == 143, err[-3000:]
  stopped = [line for line in err.splitlines() if line.startswith("stopped by SIGTERM")]
  assert len(stopped) == 1 and "run the same command again to resume" in stopped[0]
  step = int(stopped[0].split("after step ")[1].split(",")[0])
  assert checkpoint.available_steps(workdir) == [step] and step % 10 == 0


def test_damaged_run_files_are_named_with_what_to_do(tmp_path):
  """config.json and result.json are written atomically, so damage comes from outside;
  it is a ConfigError naming the file and the way out, before any work, not a traceback."""
  config = ranking_configs.get_config("smoke")
  run_dir = str(tmp_path)
  path = tmp_path / "config.json"
  for text, why in (('{"task": "ranking", ', "Expecting"), ("[1, 2]", "a list, not an object"),
                    ('{"task": 3}', "config.task=3 is invalid"),
                    ('{"model": 3}', "it names no task")):
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"config.json (cannot be read|is not a run's "
                                          rf"config).*{why}.*delete it, or the run's"):
      runner.check_run_dirs(config, run_dir)
  # A config, of another shape: every differing key counted.
  path.write_text('{"task": "ranking", "model": 3}')
  with pytest.raises(ConfigError, match=r"differs in \[.model., .*\] and \d+ more: model 3 "
                                        r"there, absent here; [^;]*; [^;]*\)"):
    runner.check_run_dirs(config, run_dir)
  # Beside files no run writes (another tool's model, say), it may be another tool's
  # directory: deleting it is never said to lose nothing.
  (tmp_path / "model.bin").write_bytes(b"weights")
  for text, match in (('{"hidden_size": 768}', r"config.json is not a run's config \("
                       r"ValueError: it names no task\); it also holds files that no run "
                       r"wrote \(model.bin\), so it may be another tool's directory: use a "
                       r"new or empty one$"),
                      ('{"task": "ranking", "model": 3}', r"use another workdir: it also "
                       r"holds files that no run wrote \(model.bin\), so it may be another "
                       r"tool's directory$")):
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
      runner.check_run_dirs(config, run_dir)
  # Beside a result (the run wrote it), the advice is to restore config.json too.
  finished = tmp_path / "finished"
  finished.mkdir()
  (finished / "config.json").write_text("{")
  (finished / "result.json").write_text(
      '{"final": {}, "diverged": false, "steps": 40, "wall_seconds": 1.0}')
  with pytest.raises(ConfigError, match=r"; restore config.json, or delete the directory"):
    runner.check_run_dirs(config, str(finished))
  shutil.rmtree(finished)   # (not a file of the run directory below)
  # Beside checkpoints, deleting config.json alone would be refused next: restore it.
  checkpoint.save(run_dir, 20, {"a": np.zeros(2, np.float32)})
  path.write_text('{"task": "ranking", ')
  with pytest.raises(ConfigError, match=r"cannot be read \(Expecting.*\); restore config.json, "
                                        r"or delete the directory to train the run afresh"):
    runner.check_run_dirs(config, run_dir)
  os.remove(tmp_path / "model.bin")
  shutil.rmtree(tmp_path / "checkpoint")
  # Another config, never checkpointed: deleting it loses nothing, and the error says so.
  other = ranking_configs.get_config("smoke")
  other.optim.learning_rate = 1e-4
  path.write_text(json.dumps(runner.jsonable(other.to_dict())))
  with pytest.raises(ConfigError, match=r"differs in \['optim.learning_rate'\].*stopped "
                                        r"before its first checkpoint"):
    runner.check_run_dirs(config, run_dir)
  longer = ranking_configs.get_config("smoke")   # the train section counts too
  longer.train.num_steps *= 2
  path.write_text(json.dumps(runner.jsonable(longer.to_dict())))
  with pytest.raises(ConfigError, match=r"differs in \['train.num_steps'\]"):
    runner.check_run_dirs(config, run_dir)
  lock = runner.lock_run_dir(run_dir)   # ... unless a process is training it right now
  try:
    with pytest.raises(ConfigError, match=r"another process is training it now$"):
      runner.check_run_dirs(config, run_dir)
  finally:
    os.close(lock)
  # The run's own config, and a damaged result.json: deleting it resumes the run.
  path.write_text(json.dumps(runner.jsonable(config.to_dict())))
  (tmp_path / "result.json").write_text("")
  with pytest.raises(ConfigError, match=r"result.json cannot be read .*delete it and the run "
                                        r"resumes from its checkpoints"):
    run_experiment(config, run_dir)
  # JSON, but not a finished run's result (emptied, or another file's content): the
  # same way out, naming what it lacks, instead of a KeyError or a run counted as done.
  for text, lacks in (("{}", "'final', 'diverged', 'steps', 'wall_seconds'"),
                      ('{"final": {}, "diverged": false, "steps": true, "wall_seconds": 1}',
                       "'steps'"),
                      ('{"final": {}, "diverged": false, "steps": 3, "wall_seconds": true}',
                       "'wall_seconds'")):
    (tmp_path / "result.json").write_text(text)
    with pytest.raises(ConfigError, match=rf"result.json is not a finished run's result \(no "
                                          rf"valid {lacks}\); delete it and the run resumes"):
      run_experiment(config, run_dir)
    with pytest.raises(ConfigError, match=r"is not a finished run's result"):
      runner.check_run_dirs(config, run_dir)   # (the scripts' check before any seed trains)


def test_checkpoint_io_errors_name_the_file(tmp_path, monkeypatch):
  """A disk that fills while equinox writes the leaves (which wraps the OS's error in one
  about the leaf) gives `CheckpointError` naming the file and the OS's reason, no partial
  file, and the checkpoints on disk kept; a folder named like a checkpoint is no step to
  resume from, and an unreadable file reads as a damaged one (so a resume falls back to
  the step before it)."""
  tree = {"a": np.arange(3, dtype=np.float32)}
  run_dir = str(tmp_path)
  checkpoint.save(run_dir, 10, tree)
  real = checkpoint.writers.atomic_file

  @contextlib.contextmanager
  def full_disk(path, mode):
    with real(path, mode):   # its temporary file is made, then the write fails
      class Full:
        def write(self, data):   # the header fits, the first leaf does not
          if data != checkpoint.MAGIC:
            raise OSError(errno.ENOSPC, "No space left on device")
      yield Full()

  monkeypatch.setattr(checkpoint.writers, "atomic_file", full_disk)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"step_000000020.eqx cannot be written \(No space left on device\)"
                           r".*resumes from the newest checkpoint on disk \(steps \[10\]\)"):
    checkpoint.save(run_dir, 20, tree)
  monkeypatch.undo()
  assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step_000000010.eqx"]
  os.mkdir(tmp_path / "checkpoint" / "step_000000030.eqx")
  assert checkpoint.available_steps(run_dir) == [10]
  path = tmp_path / "checkpoint" / "step_000000040.eqx"
  path.write_bytes(b"")
  def unreadable(*args, **kwargs):
    raise PermissionError(errno.EACCES, "Permission denied")

  monkeypatch.setattr(checkpoint, "open", unreadable, raising=False)   # the module's open
  with pytest.raises(checkpoint.CheckpointError, match=r"step_000000040.eqx cannot be read "
                                                       r"\(PermissionError"):
    checkpoint.load(run_dir, 40, tree)


def test_a_disk_that_fills_while_logging_stops_the_run_with_a_resumable_error(tmp_path,
                                                                              monkeypatch):
  """A full disk when a chunk's TensorBoard events are written (tensorboardX's bare
  OSError, no file named) stops the run with `RunOutputError`, one of the errors the
  scripts report as one line: it names the run directory, the system's reason and the
  checkpoints to resume from, and the same command then resumes from them."""
  from experiments.cli import RUN_ERRORS
  config = ranking_configs.get_config("smoke")
  config.train.update(num_steps=30, eval_every=30, checkpoint_every=10)
  run_dir = str(tmp_path / "run")
  write_event = writers.EventsWriter.write_event

  def full_at_step_20(self, event):
    if event.step == 20 and event.HasField("summary"):
      raise OSError(errno.ENOSPC, "No space left on device")
    return write_event(self, event)

  with monkeypatch.context() as m:
    m.setattr(writers.EventsWriter, "write_event", full_at_step_20)
    with pytest.raises(OSError, match=rf"outputs in {run_dir} cannot be written \(.*No "
                                      r"space left on device\).*resumes from the newest "
                                      r"checkpoint on disk \(steps \[10\]\)") as e:
      run_experiment(config, run_dir)
  assert isinstance(e.value, RUN_ERRORS) and e.value.errno == errno.ENOSPC
  assert run_experiment(config, run_dir)[0]["steps"] == 30   # the lock went with the error
  assert [r["step"] for r in writers.read_metrics(run_dir)] == [10, 20, 30]


def test_events_a_full_disk_keeps_unwritten_still_stop_the_run_with_one_error(tmp_path,
                                                                               monkeypatch):
  """Events that stay buffered because the disk is full fail again when the writers are
  closed on the way out: that second failure neither replaces the first one's
  `RunOutputError` (the scripts' one-line error) with a bare OSError and its traceback, nor
  keeps the other seed's writer open or the run's lock held."""
  config = ranking_configs.get_config("smoke")
  config.num_seeds = 2
  config.train.update(num_steps=20, eval_every=20, checkpoint_every=10)
  run_dir = str(tmp_path / "run")
  closed = []
  close = writers.RunWriter.close

  def full_disk(self):
    raise OSError(errno.ENOSPC, "No space left on device")

  def recorded_close(self, finished):
    closed.append(self.run_dir)
    return close(self, finished)

  with monkeypatch.context() as m:
    m.setattr(writers.EventsWriter, "flush", full_disk)
    m.setattr(writers.RunWriter, "close", recorded_close)
    with pytest.raises(runner.RunOutputError, match=r"No space left on device.*no "
                                                    r"checkpoint was written yet") as e:
      run_experiment(config, run_dir)
  assert e.value.errno == errno.ENOSPC
  assert sorted(closed) == [os.path.join(run_dir, f"seed_{k}") for k in (0, 1)]
  assert sorted(run_experiment(config, run_dir)) == [0, 1]


def test_an_extra_split_naming_some_fields_only_is_the_same_config_when_run_again(tmp_path):
  """An extra evaluation split given as the fields it changes (what a dict override
  `--config.extra_eval_splits={'long': {'max_history': 3}}` gives) is stored as given:
  the same config run again is skipped, not refused as another config; another value of
  that field still is."""
  config = ranking_configs.get_config("smoke")
  config.train.update(num_steps=10, eval_every=10, checkpoint_every=10)
  config.extra_eval_splits = ml_collections.ConfigDict({"long": {"max_history": 3}})
  run_dir = str(tmp_path / "run")
  first = run_experiment(config, run_dir)
  assert run_experiment(config, run_dir) == first
  config.extra_eval_splits.long.max_history = 2
  with pytest.raises(ConfigError, match=r"differs in \['extra_eval_splits.long.max_history'"):
    run_experiment(config, run_dir)
  # A finished run without the split is no run with it (reused, it would lack long/*).
  plain = ranking_configs.get_config("smoke")
  plain.train.update(num_steps=10, eval_every=10, checkpoint_every=10)
  run_experiment(plain, str(tmp_path / "plain"))
  with pytest.raises(ConfigError, match=r"differs in \['extra_eval_splits.long.candidate_order"
                                        r"', .*'extra_eval_splits.long.max_history', "):
    run_experiment(config, str(tmp_path / "plain"))


def test_a_run_resumed_for_its_last_chunk_reports_the_rate_logged_before(tmp_path):
  """A run resumed with one chunk to go runs only the chunk that compiles: its row logs
  that time as perf/first_call_seconds (as every first call does, not a rate), and
  result.json's examples_per_second is the rate of the chunks logged before the resume,
  not the compile-inclusive rate of that chunk (which read about 6 examples/s where the
  uninterrupted run read 8,000)."""
  config = ranking_configs.get_config("smoke")
  config.train.checkpoint_every = 10
  workdir = str(tmp_path / "run")
  run_experiment(config, workdir)
  os.remove(os.path.join(workdir, runner.RESULT_FILE))
  os.remove(checkpoint.checkpoint_path(workdir, 40))   # killed during the last chunk
  (result,) = run_experiment(config, workdir).values()
  assert result["diverged"] is False and result["diverged_at_step"] is None
  rows = writers.read_metrics(workdir)
  assert [r["step"] for r in rows] == [10, 20, 30, 40]
  assert "perf/first_call_seconds" in rows[-1] and "perf/examples_per_second" not in rows[-1]
  rates = [r["perf/examples_per_second"] for r in rows if "perf/examples_per_second" in r]
  assert len(rates) == 2   # steps 20 and 30 of the first process
  assert result["examples_per_second"] == pytest.approx(len(rates) / sum(1 / x for x in rates))


def test_a_seed_finished_alone_reports_the_seeds_it_trained_with(tmp_path, monkeypatch):
  """Two seeds trained vmapped, the process killed between their result.json files: the
  re-run finishes seed 1 alone from the final checkpoint, and its result says it trained
  with 2 seeds (the logged rates it reports are those of both), as uninterrupted."""
  config = ranking_configs.get_config("smoke")
  config.num_seeds = 2
  workdir = str(tmp_path / "run")
  want = run_experiment(config, workdir)
  os.remove(os.path.join(workdir, "seed_1", runner.RESULT_FILE))
  compiled = []   # (nothing left to train: the training program is not compiled)
  real = loop.Trainer.compile_chunk
  monkeypatch.setattr(loop.Trainer, "compile_chunk",
                      lambda self, state: compiled.append(1) or real(self, state))
  got = run_experiment(config, workdir)
  assert compiled == []
  assert got[1]["final"] == want[1]["final"]
  assert got[1]["num_seeds_vmapped"] == want[1]["num_seeds_vmapped"] == 2
  rows = writers.read_metrics(os.path.join(workdir, "seed_1"))
  rates = [r["perf/examples_per_second"] for r in rows if "perf/examples_per_second" in r]
  assert got[1]["examples_per_second"] == pytest.approx(len(rates) / sum(1 / x for x in rates))
  # Seed 0 finished here, seed 1 before: the results still come in seed order.
  os.remove(os.path.join(workdir, "seed_0", runner.RESULT_FILE))
  assert list(run_experiment(config, workdir)) == [0, 1]


def test_seeds_resumed_together_keep_their_own_wall_time(tmp_path):
  """Each seed's wall_seconds continues from its own checkpoint's: seeds resumed together
  may have trained apart before (seed 1's process here ran 1000 s longer)."""
  config = ranking_configs.get_config("smoke")
  config.num_seeds = 2
  config.train.update(num_steps=20, eval_every=0, checkpoint_every=10, eval_batches=1)
  run_experiment(config, str(tmp_path))
  like = runner.checkpoint_like(loop.Trainer(parse_config(config)))
  for k in (0, 1):
    seed_dir = str(tmp_path / f"seed_{k}")
    os.remove(os.path.join(seed_dir, runner.RESULT_FILE))
    os.remove(checkpoint.checkpoint_path(seed_dir, 20))
  seed_1 = str(tmp_path / "seed_1")
  found = checkpoint.load(seed_1, 10, like, host=True)
  found["wall_seconds"] = np.asarray(float(found["wall_seconds"]) + 1000.0, np.float64)
  checkpoint.save(seed_1, 10, found, keep=2)
  results = run_experiment(config, str(tmp_path))
  assert results[1]["wall_seconds"] - results[0]["wall_seconds"] == pytest.approx(1000, abs=1)


def test_a_checkpoint_due_one_step_before_the_end_is_written(tmp_path):
  """Every checkpoint_every steps a checkpoint, the one due just before the last step
  too (the final step's is written anyway)."""
  config = ranking_configs.get_config("smoke")
  config.train.update(num_steps=20, steps_per_call=1, eval_every=0, checkpoint_every=19,
                      eval_batches=1)
  config.output.keep_checkpoints = 3
  run_experiment(config, str(tmp_path))
  assert checkpoint.available_steps(str(tmp_path)) == [19, 20]


def test_the_logged_rate_leaves_out_the_compiling_chunk_in_old_metrics_files_too(tmp_path):
  """What a run resumed after its final checkpoint reports: the last train scalars logged,
  and the harmonic mean of the logged rates without the compiling chunk's, which rows
  written before `perf/first_call_seconds` existed logged as a rate (5 examples/s here)."""
  group = types.SimpleNamespace(seeds=[0], dirs={0: str(tmp_path)})
  rows = [{"step": 10, "train/loss": 3.0}, {"step": 20, "train/loss": 2.0},
          {"step": 30, "train/loss": 1.0, "eval/auc_mean": 0.6}]
  rates = [8000.0, 9000.0]
  want = 2 / (1 / 8000.0 + 1 / 9000.0)
  for first in ({"perf/examples_per_second": 5.0}, {"perf/first_call_seconds": 12.0}):
    logged = [{**rows[0], **first}] + [{**r, "perf/examples_per_second": x}
                                       for r, x in zip(rows[1:], rates)]
    with open(tmp_path / writers.METRICS_FILE, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in logged)
    train, throughput, vmapped = runner._Group.logged_training(group)
    assert train == {0: {"train/loss": 1.0}}
    assert throughput == pytest.approx(want) and vmapped == 1   # no row has both rates
  # An old file whose one rate is the compiling chunk's: that rate is all there is.
  with open(tmp_path / writers.METRICS_FILE, "w") as f:
    f.write(json.dumps({**rows[0], "perf/examples_per_second": 80.0}) + "\n")
  assert runner._Group.logged_training(group)[1:] == (80.0, 1)
  # The seeds trained together: those of the process that logged last (a run resumed
  # with more seeds vmapped), from its examples per step over the batch size.
  group.config = types.SimpleNamespace(train=types.SimpleNamespace(batch_size=4))
  with open(tmp_path / writers.METRICS_FILE, "w") as f:
    f.writelines(json.dumps({**r, "perf/steps_per_second": 10.0,
                             "perf/examples_per_second": 10.0 * 4 * seeds}) + "\n"
                 for r, seeds in zip(rows, (2, 2, 3)))
  assert runner._Group.logged_training(group)[2] == 3
  # Rates of a short chunk whose ratio lands just below the count (2.9999999999999996).
  with open(tmp_path / writers.METRICS_FILE, "w") as f:
    f.write(json.dumps({**rows[0], "perf/steps_per_second": 10 / 0.013,
                        "perf/examples_per_second": 120 / 0.013}) + "\n")
  assert runner._Group.logged_training(group)[2] == 3
  # No row with both rates: the group's own seed count.
  group.seeds, group.dirs = [0, 1], {0: str(tmp_path), 1: str(tmp_path)}
  with open(tmp_path / writers.METRICS_FILE, "w") as f:
    f.write(json.dumps({**rows[0], "perf/examples_per_second": 80.0}) + "\n")
  assert runner._Group.logged_training(group)[2] == 2


def test_run_directory_checks_for_library_callers(tmp_path):
  """`check_workdir` refuses a blank name; `check_run_dirs` names a seed directory that is
  a link to nothing (not a bare FileExistsError later); `_lock_holder` tells only what a
  holder wrote."""
  for blank in ("", "   "):
    with pytest.raises(NotADirectoryError, match="is blank"):
      runner.check_workdir(blank)
  # A link to a directory (a scratch disk, say) is a workdir, or holds one.
  (tmp_path / "scratch").mkdir()
  os.symlink(tmp_path / "scratch", tmp_path / "link")
  runner.check_workdir(str(tmp_path / "link"))
  runner.check_workdir(str(tmp_path / "link" / "run"))
  # Where creating a folder would start: a link to nothing is that place, not its parent.
  os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
  assert writers.nearest_existing(str(tmp_path / "dangling" / "run")) == str(
      tmp_path / "dangling")
  config = ranking_configs.get_config("smoke")
  config.num_seeds = 2
  os.symlink(tmp_path / "nowhere", tmp_path / "seed_1")
  with pytest.raises(NotADirectoryError, match="seed 1's run directory, is a file"):
    runner.check_run_dirs(config, str(tmp_path))
  lock = tmp_path / "lock"
  for text, want in (("", ""), ("garbage\nmore", ""), ("pid 7\nmore", ""),
                     ("pid 7 on h since t", "pid 7 on h since t; ")):
    lock.write_text(text)
    fd = os.open(lock, os.O_RDONLY)
    try:
      assert runner._lock_holder(fd) == want, text
    finally:
      os.close(fd)


def test_reused_runs_without_a_recorded_code_version_warn_of_nothing(tmp_path, caplog):
  """Runs from before `code` was recorded, or from outside a checkout (null), are not
  called other code's; one that names another version is."""
  dirs = {0: str(tmp_path / "seed_0"), 1: str(tmp_path / "seed_1")}
  with caplog.at_level("WARNING"):
    runner._warn_if_other_code({0: {}, 1: {"code": None}}, dirs)
  assert "other code" not in caplog.text
  with caplog.at_level("WARNING"):
    runner._warn_if_other_code({0: {}, 1: {"code": "0123456789ab"}}, dirs)
  assert "1 finished run(s) reused as they are, trained by other code (0123456789ab" in (
      caplog.text)


def test_partial_files_of_live_writers_are_kept_where_others_may_write(tmp_path,
                                                                       monkeypatch):
  """`remove_temporaries(keep_live_writers=True)` (sweep folders, probed runs) keeps the
  temporary file of a writer still running on this host (another user's too, which this
  process may not signal) and removes the rest, names with numbers no process can have
  included; without it, every one goes. A name that only starts like a temporary's is no
  temporary."""
  live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  others = 4_000_000   # a pid of another user's process: signalling it is not permitted
  real_kill = os.kill

  def kill(pid, sig):
    if pid == others:
      raise PermissionError(1, "Operation not permitted")
    return real_kill(pid, sig)

  monkeypatch.setattr(os, "kill", kill)
  try:
    names = [f".a.json.tmp.{live.pid}", f".g.json.tmp.{others}", ".b.json.tmp.0",
             f".c.json.tmp.{10 ** 30}", f".d.json.tmp.{os.getpid()}", ".f.json.tmp.1",
             "e.json", ".h.json.tmp.5.bak", ".i.json.tmp.9x",   # (1: init, running)
             "j.json.tmp.7"]   # a user's own file: a writer's temporary starts with a dot
    for name in names:
      (tmp_path / name).write_text("partial")
    assert [writers.is_temporary(name) for name in names] == [True] * 6 + [False] * 4
    writers.remove_temporaries(str(tmp_path), keep_live_writers=True)
    assert sorted(os.listdir(tmp_path)) == sorted(names[:2] + names[6:])
    writers.remove_temporaries(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(names[6:])
  finally:
    live.kill()
    live.wait()


def test_a_save_removes_every_partial_checkpoint_even_of_a_live_pid(tmp_path):
  """The run holds its lock, so every temporary in checkpoint/ is a killed writer's, even
  one whose process id another running process has since taken."""
  live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / f".step_000000010.eqx.tmp.{live.pid}").write_bytes(b"partial")
    checkpoint.save(str(tmp_path), 20, {"w": jnp.ones(2)})
    assert sorted(os.listdir(folder)) == ["step_000000020.eqx"]
  finally:
    live.kill()
    live.wait()


def test_an_output_error_names_the_file_it_was_about(tmp_path):
  """tensorboardX's errors name no file; where an OSError does, the message says which."""
  path = str(tmp_path / "metrics.jsonl")
  with pytest.raises(runner.RunOutputError,
                     match=re.escape(f"({path}: No space left on device)")) as raised:
    with runner._writing_outputs(str(tmp_path)):
      raise OSError(errno.ENOSPC, "No space left on device", path)
  assert raised.value.errno == errno.ENOSPC


def test_stop_requests_leave_the_signals_alone_outside_the_main_thread():
  """`run_experiment` from a worker thread (a notebook's, a server's): no handler is
  installed there (`signal.signal` raises ValueError off the main thread)."""
  errors, before = [], signal.getsignal(signal.SIGINT)

  def body():
    try:
      with runner._StopRequests() as stop:
        assert stop._previous == {}
    except Exception as e:   # (reported from the main thread)
      errors.append(e)

  thread = threading.Thread(target=body)
  thread.start()
  thread.join()
  assert not errors and signal.getsignal(signal.SIGINT) is before


def test_an_ignored_signal_stays_ignored_during_training():
  """A background job ignores SIGINT; the training loop's stop handler leaves it so (and
  still takes SIGTERM), restoring both on exit."""
  previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    with runner._StopRequests():
      assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
      assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
  finally:
    signal.signal(signal.SIGINT, previous)


def test_the_config_is_checked_again_under_the_lock(tmp_path, monkeypatch):
  """A process of another config that trained the directory between `run_experiment`'s
  check and the lock (simulated by skipping the first check) is caught under the lock,
  before its checkpoints are resumed under this config."""
  config = ranking_configs.get_config("smoke")
  other = ranking_configs.get_config("smoke")
  other.optim.learning_rate = 1e-4
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "config.json").write_text(json.dumps(runner.jsonable(other.to_dict())))
  monkeypatch.setattr(runner, "check_run_dirs", lambda config, workdir: None)
  with pytest.raises(ConfigError, match=r"holds a run of another config \(differs in "
                                        r"\['optim.learning_rate'\]: optim.learning_rate "
                                        r"0.0001 there, 0.01 here\); .*stopped before "
                                        r"its first checkpoint"):   # not "another process"
    run_experiment(config, str(run_dir))
  assert sorted(os.listdir(run_dir)) == [".lock", "config.json"]   # nothing written
