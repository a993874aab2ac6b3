"""Data parallelism on 8 simulated CPU devices matches one device (ranking and retrieval).

Runs in a subprocess: `--xla_force_host_platform_device_count` must be set before JAX
initialises, and must not leak into the other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, run_at_once, subprocess_env


SCRIPT = """
import json, re, sys
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from experiments.configs import ranking, retrieval
from phoenix_flax.training import (ConfigError, Trainer, make_placement, parse_config,
                                   run_experiment)
from phoenix_flax.training import runner

assert jax.device_count() == 8, jax.devices()
cfg = ranking.get_config("smoke")
cfg.num_seeds = 2


def train(placement, cfg=cfg, chunks=4):
  # Chunks of both seeds: the trainer, final state and every step's loss [seeds, steps].
  trainer = Trainer(parse_config(cfg), placement)
  state, losses = trainer.init([0, 1]), []
  for _ in range(chunks):
    state, stats = trainer.train_chunk(state)
    losses.append(np.asarray(stats["loss"]))
  return trainer, state, np.concatenate(losses, axis=1).tolist()


trainer, state, loss = train(make_placement(1, False))
out = {"loss": loss, "auc": np.asarray(trainer.evaluate(state)["eval/auc_mean"]).tolist()}

# 8 devices, tables replicated, driven directly: every step's loss, and where a sampled
# training batch lives.
mesh_trainer, state, out["replicated_loss"] = train(make_placement(8, False))
one_seed = jax.tree.map(lambda x: x[0], state)
batch = eqx.filter_jit(mesh_trainer.sample_train_batch)(mesh_trainer.world, one_seed)
out["batch_axes"] = sorted({str(x.sharding.spec[0] if len(x.sharding.spec) else None)
                            for x in jax.tree.leaves(batch) if x.ndim >= 1})
out["table_devices_replicated"] = len(state.params.tables.post_table.sharding.device_set)
out["table_spec_replicated"] = list(state.params.tables.post_table.sharding.spec)
# The chunk's collectives: the gradients' all-reduce only; sampling the batch moves no data
# between devices (each samples the whole batch and keeps its rows).
hlo = mesh_trainer._chunk.lower(mesh_trainer.world, state).lowered.compile().as_text()
out["collectives"] = sorted(set(re.findall(r"\\b(all-gather|all-to-all|collective-permute|"
                                           r"reduce-scatter)\\(", hlo)))

cfg.mesh.num_devices, cfg.mesh.shard_hash_tables = 8, True
results = run_experiment(cfg, sys.argv[1])
out["mesh_auc"] = [results[k]["final"]["auc_mean"] for k in (0, 1)]
out["mesh_chunk_loss"] = [
    [json.loads(line)["train/loss"] for line in open(f"{sys.argv[1]}/seed_{k}/metrics.jsonl")]
    for k in (0, 1)]
(mesh_trainer,) = runner._TRAINERS.values()
# The initialisation program itself returns the tables sharded (each device builds its
# rows).
keys = jnp.stack([jax.random.PRNGKey(s) for s in (0, 1)])
made = mesh_trainer._init(keys)
# No device builds a whole table: the compiled program holds the 64-row shards only.
init_hlo = mesh_trainer._init.lower(keys).lowered.compile().as_text()
out["init_whole_table"] = "512,16]" in init_hlo
out["init_shard_rows"] = "64,16]" in init_hlo
out["init_table_spec"] = list(made.params.tables.post_table.sharding.spec)
# The same values as one device's (up to float rounding: two programs, two fusions).
out["init_table_diff"] = float(np.max(np.abs(
    np.asarray(made.params.tables.post_table)
    - np.asarray(Trainer(parse_config(ranking.get_config("smoke")), make_placement(1, False))
                 .init([0, 1]).params.tables.post_table))))
# A checkpoint loads into host memory, and its tables go from there to their shards.
loaded, _ = runner.load_checkpoint(mesh_trainer, f"{sys.argv[1]}/seed_0", cfg.train.num_steps)
out["loaded_on_host"] = all(isinstance(x, np.ndarray) for x in jax.tree.leaves(loaded))
host = jax.tree.map(lambda *xs: np.stack(xs), loaded, loaded)
placed = mesh_trainer.placement.place_state(host)
out["placed_table_spec"] = list(placed.params.tables.post_table.sharding.spec)
out["placed_equal"] = all(np.array_equal(np.asarray(a), b)
                          for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(host)))
table = mesh_trainer.init([0, 1]).params.tables.post_table
out["mesh_devices"] = mesh_trainer.placement.num_devices
out["table_shard_shape"] = list(table.addressable_shards[0].data.shape)
out["table_devices"] = len(table.sharding.device_set)

# The retrieval task (its in-batch loss contrasts users across the devices' shards), hash
# tables sharded, with the logQ correction (its counts add up the positives of every
# device's rows; without it the loss is the same softmax, uncorrected): every step's loss
# and the evaluation, against one device.
rcfg = retrieval.get_config("smoke")
rcfg.num_seeds = 2
rcfg.retrieval.recall_k = (5, 200)   # half the corpus: a 20-step model finds some
rcfg.retrieval.logq_correction = True
for name, placement in (("retrieval", make_placement(1, False)),
                        ("mesh_retrieval", make_placement(8, True))):
  trainer, state, out[name + "_loss"] = train(placement, rcfg, chunks=2)
  ev = trainer.evaluate(state)
  out[name + "_eval"] = {k: np.asarray(ev["eval/" + k]).tolist()
                         for k in ("loss", "auc", "recall@5", "recall@200", "bayes_recall@5",
                                   "bayes_recall@200", "popularity_recall@200")}
# A Trainer built by hand on a mesh that does not divide a sharded table's rows names the
# field to change before it traces anything.
bad = ranking.get_config("smoke")
bad.world.post_buckets = 500
try:
  Trainer(parse_config(bad), make_placement(8, True))
  out["indivisible"] = None
except ConfigError as e:
  out["indivisible"] = str(e)
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_eight_devices_match_one_device(tmp_path):
  env = subprocess_env("--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run")], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
  out = json.loads(line[len("RESULT"):])
  single = np.asarray(out["loss"])
  assert single.shape == (2, 40)
  assert not np.allclose(single[0], single[1])  # two seeds, two curves
  # Trainer on 8 devices with replicated tables: every step's loss equals one device's,
  # and a sampled batch is split over the mesh's "data" axis.
  np.testing.assert_allclose(out["replicated_loss"], single, rtol=2e-5, atol=1e-6)
  assert out["batch_axes"] == ["data"]
  assert out["collectives"] == []   # no collective-permute per step for the sampled batch
  assert out["table_devices_replicated"] == 8   # on every device, each whole:
  assert "data" not in out["table_spec_replicated"], out["table_spec_replicated"]
  # run_experiment on 8 devices (batch sharded, hash tables sharded by rows): the same
  # loss curve (chunk means of the per-step losses) and final AUC as one device.
  chunk_means = single.reshape(2, 4, 10).mean(axis=2)
  np.testing.assert_allclose(out["mesh_chunk_loss"], chunk_means, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(out["mesh_auc"], out["auc"], atol=2e-3)
  assert out["mesh_devices"] == 8 and out["table_devices"] == 8
  assert out["table_shard_shape"] == [2, 512 // 8, 16]
  assert out["init_table_spec"] == [None, "data"] and out["init_table_diff"] < 1e-6
  assert out["init_shard_rows"] and not out["init_whole_table"]
  assert out["loaded_on_host"] and out["placed_equal"]
  assert out["placed_table_spec"] == [None, "data"]
  assert os.path.exists(tmp_path / "run" / "seed_1" / "result.json")
  # Retrieval: its softmax at temperature 0.05 magnifies float reassociation, and 20 steps
  # of training compound it: the first step (the same parameters) to float rounding, every
  # step within 1e-3 (step 20 differed by 2.2e-4 of the loss on an AVX-512 host; under
  # 2e-4 on the AVX2 hosts that ran the suite before).
  single_retrieval = np.asarray(out["retrieval_loss"])
  assert single_retrieval.shape == (2, 20)
  mesh_retrieval = np.asarray(out["mesh_retrieval_loss"])
  np.testing.assert_allclose(mesh_retrieval[:, 0], single_retrieval[:, 0], rtol=2e-5)
  np.testing.assert_allclose(mesh_retrieval, single_retrieval, rtol=1e-3)
  single, mesh = out["retrieval_eval"], out["mesh_retrieval_eval"]
  np.testing.assert_allclose(mesh["loss"], single["loss"], rtol=2e-4)
  for k in ("auc", "recall@5", "recall@200", "bayes_recall@5", "bayes_recall@200",
            "popularity_recall@200"):
    np.testing.assert_allclose(mesh[k], single[k], atol=2e-3, err_msg=k)
  assert min(single["recall@200"]) > 0 and min(single["bayes_recall@5"]) > 0, single
  assert out["indivisible"] == ("config.world.post_buckets=500 is invalid: sharding the hash "
                                "tables needs a multiple of the 8 devices"), out["indivisible"]


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _train_rows(run_dir) -> list[dict]:
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  return [r for r in rows if "train/loss" in r]


@pytest.mark.slow
def test_two_processes_match_one_device(tmp_path):
  """Multi-host data parallelism, simulated by two CPU processes of 2 devices each that
  meet through `jax.distributed.initialize` (mesh.distributed=True): the same run as on
  one device, hash tables sharded across both processes, files written once."""
  base = subprocess_env(JAX_PLATFORMS="cpu")
  run = [sys.executable, "-m", "experiments.run", "--config=experiments/configs/ranking.py:smoke"]
  single = subprocess.run(run + [f"--workdir={tmp_path / 'single'}"], cwd=REPO, env=base,
                          capture_output=True, text=True, timeout=600)
  assert single.returncode == 0, single.stderr[-4000:]

  env = subprocess_env("--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
  # The coordinator's port is free when chosen but could be taken before process 0 binds
  # it: then one process fails and the other would wait out JAX's join timeout, so a
  # failure stops both, and the run is tried once more on another port.
  for attempt in range(2):
    multi, port = tmp_path / f"multi_{attempt}", _free_port()
    errors = "\n".join(err for code, err in run_at_once([
        run + [f"--workdir={multi}", "--config.mesh.num_devices=-1",
               "--config.mesh.shard_hash_tables=True", "--config.mesh.distributed=True",
               f"--config.mesh.coordinator_address=127.0.0.1:{port}",
               "--config.mesh.num_processes=2", f"--config.mesh.process_id={i}"]
        for i in range(2)], env, timeout=600, stop_on_failure=True) if code != 0)
    if not errors:
      break
  assert not errors, errors[-4000:]

  one, two = _train_rows(tmp_path / "single"), _train_rows(multi)
  assert [r["step"] for r in two] == [r["step"] for r in one] == [10, 20, 30, 40]
  np.testing.assert_allclose([r["train/loss"] for r in two], [r["train/loss"] for r in one],
                             rtol=2e-5)
  final = lambda d: json.load(open(d / "result.json"))["final"]
  assert final(multi)["auc_mean"] == pytest.approx(
      final(tmp_path / "single")["auc_mean"], abs=2e-3)
  # Only process 0 writes: one event file, one metrics row per host call.
  events = [f for f in os.listdir(multi) if f.startswith("events.out")]
  assert len(events) == 1
  assert len(_train_rows(multi)) == 4


DISTRIBUTED_BEFORE = """
import socket, jax
from phoenix_flax.training import sharding
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)
sharding.initialize_distributed()   # config.mesh.distributed=True, cluster fields unset
sharding.initialize_distributed(f"127.0.0.1:{port}", 1, 0)
print("OK", jax.process_count())
"""


def test_distributed_already_initialized_by_the_caller():
  """A launcher that called `jax.distributed.initialize` itself, then a run with
  mesh.distributed=True: the run uses that runtime instead of refusing it with a
  ConfigError that asks for the coordinator's address (JAX refuses a second call)."""
  proc = subprocess.run([sys.executable, "-c", DISTRIBUTED_BEFORE], cwd=REPO,
                        env=subprocess_env(JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "OK 1" in proc.stdout


def _join_a_missing_peer(workdir, timeout_s: int) -> subprocess.Popen:
  """Process 1 of 2 of a run whose process 0 never starts: it waits to join."""
  return subprocess.Popen(
      [sys.executable, "-m", "experiments.run", "--config=experiments/configs/ranking.py:smoke",
       f"--workdir={workdir}", "--config.mesh.distributed=True",
       f"--config.mesh.coordinator_address=127.0.0.1:{_free_port()}",
       "--config.mesh.num_processes=2", "--config.mesh.process_id=1",
       f"--config.mesh.initialization_timeout={timeout_s}"],
      cwd=REPO, env=subprocess_env(JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)


def test_a_process_whose_peer_never_joins_stops_at_its_timeout(tmp_path):
  """`mesh.initialization_timeout` bounds the wait for the other processes (JAX's
  runtime then aborts the process; jaxlib 0.8 and 0.9 raised DEADLINE_EXCEEDED instead,
  exit status 1), and the log says first what it waits for."""
  import signal
  import time
  started = time.monotonic()
  proc = _join_a_missing_peer(tmp_path / "run", 2)
  try:
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode in (-signal.SIGABRT, 1), (proc.returncode, err[-3000:])
  assert time.monotonic() - started < 60
  assert "waiting up to 2 s (mesh.initialization_timeout) for 2 processes" in err, err[-3000:]
  assert not os.path.exists(tmp_path / "run" / "result.json")


def test_sigterm_ends_a_process_waiting_for_its_peers(tmp_path):
  """While `jax.distributed.initialize` blocks in native code, Python's SIGTERM handler
  could not run: the wait restores the default action, so the signal ends it at once."""
  import select
  import signal
  import time
  proc = _join_a_missing_peer(tmp_path / "run", 300)
  try:
    waited, err = time.monotonic(), ""
    while "waiting up to 300 s" not in err and time.monotonic() - waited < 120:
      if select.select([proc.stderr], [], [], 1.0)[0]:   # never blocks past the deadline
        err += proc.stderr.readline()
    assert "waiting up to 300 s" in err, err[-3000:]
    time.sleep(1.0)   # into the native call
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert time.monotonic() - sent < 10
    assert proc.returncode == -signal.SIGTERM
  finally:
    proc.kill()
    proc.communicate()


def test_the_join_passes_every_mesh_field_and_leaves_foreign_handlers_alone(monkeypatch):
  """`initialize_from` hands every `mesh` field to `jax.distributed.initialize` (the runner
  and the sweeps both call it). During the join, a Python handler gives way to the
  default action (the process ends), while an ignored signal stays ignored and one
  handled outside Python (`getsignal` None) is left alone; all come back after."""
  import signal
  from phoenix_flax.training import sharding
  from phoenix_flax.training.schema import base_config
  during, real = [], signal.getsignal

  def join(**kwargs):
    during.append(dict(kwargs, SIGTERM=real(signal.SIGTERM), SIGINT=real(signal.SIGINT)))

  monkeypatch.setattr(sharding.jax.distributed, "initialize", join)
  monkeypatch.setattr(sharding.jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(sharding, "_distributed_initialized", False)
  mesh = base_config("ranking").mesh
  mesh.distributed, mesh.coordinator_address = True, "127.0.0.1:1234"
  mesh.num_processes, mesh.process_id, mesh.initialization_timeout = 2, 1, 7
  ours = lambda *args: None
  before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    signal.signal(signal.SIGTERM, ours)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sharding.initialize_from(mesh)
    after = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    # A handler installed outside Python: neither swapped nor "restored" to None.
    monkeypatch.setattr(sharding, "_distributed_initialized", False)
    monkeypatch.setattr(signal, "getsignal",
                        lambda s: None if s == signal.SIGTERM else real(s))
    sharding.initialize_from(mesh)
  finally:
    for s, handler in before.items():
      signal.signal(s, handler)
  fields = dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=1,
                initialization_timeout=7)
  assert during == [dict(fields, SIGTERM=signal.SIG_DFL, SIGINT=signal.SIG_IGN),
                    dict(fields, SIGTERM=ours, SIGINT=signal.SIG_IGN)]
  assert after == {signal.SIGTERM: ours, signal.SIGINT: signal.SIG_IGN}


def test_a_failed_join_is_a_config_error_and_another_thread_may_join(monkeypatch):
  """What `jax.distributed.initialize` raises, a ValueError or a RuntimeError (a
  coordinator that cannot be reached), becomes a ConfigError naming the mesh fields; a
  join from a thread other than the main one leaves the signal handlers alone (Python
  allows them to be set only in the main thread)."""
  import threading
  from phoenix_flax.training import ConfigError, sharding

  def fails(error):
    def initialize(**kwargs):
      raise error
    return initialize

  monkeypatch.setattr(sharding.jax.distributed, "is_initialized", lambda: False)
  for error, match in ((RuntimeError("UNAVAILABLE: failed to connect"),
                        r"initialize failed \(UNAVAILABLE: failed to connect\)\. Set "
                        r"config.mesh.coordinator_address"),
                       (ValueError("coordinator_address should be defined"),
                        r"initialize failed \(coordinator_address should be defined\)"),
                       (RuntimeError("initialize() must be called before any JAX calls"),
                        r"came after this process had started its JAX backend")):
    monkeypatch.setattr(sharding, "_distributed_initialized", False)
    monkeypatch.setattr(sharding.jax.distributed, "initialize", fails(error))
    with pytest.raises(ConfigError, match=match):
      sharding.initialize_distributed("127.0.0.1:1234", 2, 1)
  joined, errors = [], []
  monkeypatch.setattr(sharding, "_distributed_initialized", False)
  monkeypatch.setattr(sharding.jax.distributed, "initialize",
                      lambda **kwargs: joined.append(kwargs["process_id"]))

  def join():
    try:
      sharding.initialize_distributed("127.0.0.1:1234", 2, 1)
    except Exception as e:   # (re-raised below, in the test's thread)
      errors.append(e)
  thread = threading.Thread(target=join)
  thread.start()
  thread.join()
  assert errors == [] and joined == [1]
