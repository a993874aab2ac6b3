"""TensorBoard output, read back by tensorboard itself (event reader and a live server)."""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from conftest import REPO, open_files_under, session_end_status, subprocess_env
from phoenix_flax.training import runner
from phoenix_flax.training import schema
from phoenix_flax.training import writers
from phoenix_flax.training.writers import RunWriter, read_metrics

SERVER_WAIT_S = 90


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A finished smoke ranking run of experiments/run.py (compiled as the session
  compiles, conftest.py), evaluated every 30 of its 40 steps: at 30, and at the end."""
  path = str(tmp_path_factory.mktemp("tb") / "smoke_run")
  env = subprocess_env()
  proc = subprocess.run([sys.executable, "-m", "experiments.run", "--quiet",
                         "--config=experiments/configs/ranking.py:smoke", f"--workdir={path}",
                         "--config.train.eval_every=30"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return path


def _accumulator(path):
  acc = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  return acc


@pytest.mark.slow
def test_event_files_hold_every_metric_and_the_hparams(run_dir):
  acc = _accumulator(run_dir)
  tags = set(acc.Tags()["scalars"])
  expected = {"train/loss", "train/grad_norm", "train/learning_rate", "train/max_attn_logit",
              "train/residual_rms/layer_0", "eval/auc_mean", "eval/bayes_auc_mean",
              "eval/logloss", "eval/calibration_error", "eval/score_consistency",
              "eval/max_attn_logit", "eval/recall_2", "eval/auc/favorite_score",
              "perf/examples_per_second"}
  assert expected <= tags, expected - tags
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  loss = acc.Scalars("train/loss")
  assert [e.step for e in loss] == [r["step"] for r in rows] == [10, 20, 30, 40]
  for event, row in zip(loss, rows):
    assert event.value == pytest.approx(row["train/loss"], rel=1e-6)
  auc = acc.Scalars("eval/auc_mean")
  assert [e.step for e in auc] == [30, 40]   # the last step's evaluation is logged too
  assert [r["step"] for r in rows if "eval/auc_mean" in r] == [30, 40]
  result = json.load(open(os.path.join(run_dir, "result.json")))
  assert auc[-1].value == pytest.approx(result["final"]["auc_mean"], rel=1e-6)

  # The session's hparams, and no experiment summary (TensorBoard derives it over all runs).
  content = acc.PluginTagToContent("hparams")
  assert set(content) == {"_hparams_/session_start_info", "_hparams_/session_end_info"}
  start = plugin_data_pb2.HParamsPluginData.FromString(
      content["_hparams_/session_start_info"]).session_start_info
  assert start.hparams["model.num_layers"].number_value == 1
  assert start.hparams["model.norm_layout"].string_value == "sandwich"
  # A field that may be None is a string, set or not (one column type across runs).
  assert start.hparams["model.attn_logit_cap"].string_value == "30.0"
  assert start.hparams["model.post_age_granularity_mins"].string_value == "None"
  assert "ranking.top_k" in start.hparams and "mesh.num_devices" not in start.hparams
  assert not any(name.startswith("retrieval.") for name in start.hparams)  # never read
  assert start.group_name == ""   # one seed in the workdir itself: a group of its own


def _events(run_dir):
  """Every event of a run's event files, file by file, as TensorBoard's loader reads them."""
  from tensorboard.backend.event_processing import event_file_loader
  return [event for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*")))
          for event in event_file_loader.LegacyEventFileLoader(path).Load()]


def test_only_a_finished_run_ends_its_hparams_session(tmp_path):
  """A stopped run (to be resumed) writes no session end, which HParams would list as
  finished; the resumed run's finish writes the one end, a success."""
  run_dir = str(tmp_path / "run")
  writer = RunWriter(run_dir, {"model.num_layers": 2}, None)
  writer.log(10, {"train/loss": 1.0}, 1.0)
  writer.close(finished=False)
  assert set(_accumulator(run_dir).PluginTagToContent("hparams")) == {
      "_hparams_/session_start_info"}
  RunWriter(run_dir, {"model.num_layers": 2}, 10).close(finished=True)
  assert session_end_status(run_dir) == "STATUS_SUCCESS"


def test_the_seeds_of_a_config_share_an_hparams_group(tmp_path, monkeypatch):
  """HParams averages a group's sessions: in a sweep, a variant's seeds form one group,
  named by the variant's directory, so that the same variant of another sweep (another
  preset or workdir under the same logdir) is a group of its own; a run in its workdir
  itself is a group of its own."""
  variant_dir = tmp_path / "smoke" / "candidate_isolation" / "causal_corr0"
  for seed in (0, 1):
    run_dir = str(variant_dir / f"seed_{seed}")
    writer = RunWriter(run_dir, {"seed": seed, "optim.learning_rate": 0.003}, None,
                       runner._hparams_group(run_dir, seed))
    writer.close(finished=True)
    content = _accumulator(run_dir).PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/session_start_info"]).session_start_info
    assert start.group_name == str(variant_dir)
    assert start.hparams["seed"].number_value == seed
    # A float is a number too: HParams filters and sorts numbers by value, not as text.
    assert start.hparams["optim.learning_rate"].number_value == pytest.approx(0.003)
  other = str(tmp_path / "cpu" / "candidate_isolation" / "causal_corr0" / "seed_0")
  assert runner._hparams_group(other, 0) != runner._hparams_group(str(variant_dir / "seed_0"), 0)
  assert runner._hparams_group(str(tmp_path / "run"), 0) == ""
  # A relative workdir's group is its absolute path: the same relative path of two sweeps
  # run from two folders makes two groups.
  monkeypatch.chdir(tmp_path)
  assert runner._hparams_group(os.path.join("sweep", "v", "seed_0"), 0) == str(
      tmp_path / "sweep" / "v")


def test_a_diverged_runs_hparams_session_ends_as_a_failure(tmp_path):
  """The HParams view's status filter tells a diverged run from a finished one."""
  for diverged, status in ((False, "STATUS_SUCCESS"), (True, "STATUS_FAILURE")):
    run_dir = str(tmp_path / str(diverged))
    writer = RunWriter(run_dir, {"seed": 0}, None, "")
    writer.close(finished=True, diverged=diverged)
    writer.close(finished=True)   # closing again does nothing: no second session end
    assert session_end_status(run_dir) == status
    assert len([e for e in _events(run_dir) if any(
        v.tag == "_hparams_/session_end_info" for v in e.summary.value)]) == 1


def test_run_writer_resumes_at_a_step_and_starts_afresh(tmp_path):
  """A resume keeps the rows up to its step and makes TensorBoard drop the events logged
  after it (they are logged again); a fresh start removes the old events and rows. Tags
  keep "/" and replace "@"; a NaN is null in metrics.jsonl."""
  run_dir = str(tmp_path)
  hparams = {"model.num_layers": 2}
  writer = RunWriter(run_dir, hparams, None)
  for step in (10, 20, 30):
    writer.log(step, {"train/loss": float(step), "eval/recall@5": 0.5}, step / 10)
  writer.close(finished=False)
  writer = RunWriter(run_dir, hparams, resume_step=20)   # within the same second too
  assert [r["step"] for r in read_metrics(run_dir)] == [10, 20]
  from tensorboard.compat.proto.event_pb2 import SessionLog
  writer.flush()
  assert [e.step for e in _events(run_dir) if e.HasField("session_log")
          and e.session_log.status == SessionLog.START] == [21]   # the restart marker
  writer.log(30, {"train/loss": 33.0, "eval/recall@5": float("nan")}, 3.5)
  writer.close(finished=True)
  acc = _accumulator(run_dir)
  assert set(acc.Tags()["scalars"]) == {"train/loss", "eval/recall_5"}
  assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(10, 10.0), (20, 20.0),
                                                                    (30, 33.0)]
  lines = open(os.path.join(run_dir, "metrics.jsonl")).read().splitlines()
  assert "NaN" not in lines[-1]
  assert [json.loads(line) for line in lines] == [
      {"step": 10, "wall_seconds": 1.0, "train/loss": 10.0, "eval/recall@5": 0.5},
      {"step": 20, "wall_seconds": 2.0, "train/loss": 20.0, "eval/recall@5": 0.5},
      {"step": 30, "wall_seconds": 3.5, "train/loss": 33.0, "eval/recall@5": None}]
  time.sleep(1.1)
  RunWriter(run_dir, hparams, None).close(finished=False)
  assert read_metrics(run_dir) == []
  assert len([f for f in os.listdir(run_dir) if f.startswith("events.out.tfevents.")]) == 1
  assert "train/loss" not in _accumulator(run_dir).Tags()["scalars"]


def test_a_run_directory_named_like_a_glob_touches_only_its_own_files(tmp_path):
  """`exp[1]` names a folder, not a pattern: starting and resuming a run there, and writing
  an extra event file, leave the files of `exp1` as they were (its event files were
  deleted, or cut back to the resume step)."""
  other = tmp_path / "exp1"
  writer = RunWriter(str(other), {"model.num_layers": 2}, None)
  for step in (10, 20, 30):
    writer.log(step, {"train/loss": float(step)}, 1.0)
  writer.close(finished=True)
  writers.write_event_file(str(other), "probes", {"probe": 1.0}, 30)
  before = {p.name: p.read_bytes() for p in other.iterdir()}
  run_dir = str(tmp_path / "exp[1]")
  RunWriter(run_dir, {"model.num_layers": 2}, None).close(finished=False)
  RunWriter(run_dir, {"model.num_layers": 2}, resume_step=10).close(finished=False)
  assert writers.event_file_name(run_dir, "probes") is None
  writers.write_event_file(run_dir, "probes", {"probe": 2.0}, 30)
  assert {p.name: p.read_bytes() for p in other.iterdir()} == before
  assert writers.event_file_name(run_dir, "probes").startswith(run_dir)


def test_an_extra_event_file_replaces_every_earlier_one_of_its_name(tmp_path):
  """A writer killed between moving its file in and removing the earlier one leaves two
  (TensorBoard would read both, a probe twice at its step): the newer is the run's, and
  the next write leaves one file of that name."""
  import shutil
  run_dir = str(tmp_path)
  newer = writers.write_event_file(run_dir, "probes", {"probe": 1.0}, 30)
  stamp, rest = os.path.basename(newer).removeprefix("events.out.tfevents.").split(".", 1)
  older = os.path.join(run_dir, f"events.out.tfevents.{int(stamp) - 100}.{rest}")
  shutil.copy(newer, older)
  assert writers.event_file_name(run_dir, "probes") == newer
  os.makedirs(os.path.join(run_dir, ".probes.abc123"))   # a writer killed while writing
  written = writers.write_event_file(run_dir, "probes", {"probe": 2.0}, 30)
  assert glob.glob(os.path.join(run_dir, "events.out.tfevents.*.probes")) == [written]
  assert not [name for name in os.listdir(run_dir) if name.startswith(".")]


def test_an_extra_event_file_holds_the_finite_numbers_under_their_tags(tmp_path):
  """`write_event_file` (an ablation's probes) writes the finite numbers it is given, each
  under `tensorboard_tag` of its name: "@" becomes "_", "-" (a split named "eval-cold")
  and "/" stay; a probe that measured nothing (NaN, inf: null in result.json) and a
  value that is not a number are left out."""
  values = {"probe/ok": 1.5, "probe/nan": float("nan"), "probe/inf": float("inf"),
            "probe/flag": True, "probe/text": "x", "eval-cold/recall@5": 0.7, "probe/int": 3,
            # NumPy and JAX numbers count too (np.float32 and np.int64 were left out):
            "np/f32": np.float32(2.5), "np/i64": np.int64(4), "np/0d": np.array(0.25),
            "jax/0d": jnp.float32(0.5), "np/nan": np.float32("nan"), "np/flag": np.bool_(True),
            "np/vector": np.ones(2), "jax/vector": jnp.ones(1), "np/i0d": np.array(7),
            "jax/i0d": jnp.int32(3)}
  writers.write_event_file(str(tmp_path), "probes", values, 30)
  acc = _accumulator(str(tmp_path))
  assert set(acc.Tags()["scalars"]) == {"probe/ok", "eval-cold/recall_5", "probe/int",
                                        "np/f32", "np/i64", "np/0d", "jax/0d", "np/i0d",
                                        "jax/i0d"}
  assert [e.value for e in acc.Scalars("np/f32")] == [2.5]
  # Files are found by their name's suffix: "x.probes" would have been found as "probes"
  # (and replaced by its next write), so names are plain words.
  for bad in ("x.probes", "prob*", "", 5, None):
    with pytest.raises(ValueError, match="use letters, digits, '_' and '-' only"):
      writers.write_event_file(str(tmp_path), bad, values, 30)
    with pytest.raises(ValueError, match="use letters, digits"):
      writers.event_file_name(str(tmp_path), bad)
  assert [(e.step, e.value) for e in acc.Scalars("eval-cold/recall_5")] == [
      (30, pytest.approx(0.7))]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files via /proc")
@pytest.mark.parametrize("failing", ["the session start", "the session end"])
def test_a_writer_whose_write_fails_leaves_no_file_open(tmp_path, monkeypatch, failing):
  """A full disk when a writer records the HParams session start (in its constructor, so
  its caller never holds it to close it) or end (in `close`, after which a second `close`
  does nothing) still closes its event file."""
  real = writers.EventsWriter.write_event
  summaries = []   # the HParams session start, then its end

  def write_event(self, event):
    if event.HasField("summary"):
      summaries.append(event)
      if failing == "the session start" or len(summaries) == 2:
        raise OSError(28, "No space left on device")
    return real(self, event)

  monkeypatch.setattr(writers.EventsWriter, "write_event", write_event)
  try:
    writer = RunWriter(str(tmp_path), {"model.num_layers": 2}, None)
    writer.close(finished=True)
  except OSError as e:
    error = e   # kept, as a caller may keep it: its traceback holds the writer
  assert "No space left" in str(error) and open_files_under(str(tmp_path)) == []


def test_a_resume_removes_the_killed_runs_later_events_from_its_files(tmp_path):
  """TensorBoard's default (Rust) data server ignores the restart marker, so the old event
  files themselves must lose the steps after the resume step: a tag the resumed run does
  not log again at that step (a rate, which its compiling first chunk does not log) would
  otherwise keep the killed process's point, which metrics.jsonl no longer has."""
  run_dir = str(tmp_path)
  writer = RunWriter(run_dir, {"model.num_layers": 2}, None)
  for step in (10, 20, 30):
    writer.log(step, {"train/loss": float(step), "perf/examples_per_second": 5.0}, 1.0)
  writer.flush()   # on disk, as a killed process's events are after a periodic flush
  writer.close(finished=False)
  writer = RunWriter(run_dir, {"model.num_layers": 2}, resume_step=20)
  writer.log(30, {"train/loss": 33.0, "perf/first_call_seconds": 9.0}, 3.0)
  writer.close(finished=True)
  points = [(v.tag, event.step) for event in _events(run_dir) for v in event.summary.value
            if v.metadata.plugin_data.plugin_name != "hparams"]
  assert sorted(points) == sorted(
      [("train/loss", 10), ("train/loss", 20), ("train/loss", 30),
       ("perf/examples_per_second", 10), ("perf/examples_per_second", 20),
       ("perf/first_call_seconds", 30)])
  hparams = _accumulator(run_dir).PluginTagToContent("hparams")
  assert set(hparams) == {"_hparams_/session_start_info", "_hparams_/session_end_info"}


def test_dropping_later_events_keeps_a_damaged_record_as_it_is(tmp_path):
  """A record whose payload does not parse (damage on disk) is copied, not a crash of the
  resume; the events around it are filtered as usual."""
  writer = RunWriter(str(tmp_path), {"model.num_layers": 2}, None)
  for step in (10, 20, 30):
    writer.log(step, {"train/loss": float(step)}, 1.0)
  writer.close(finished=False)
  (path,) = glob.glob(str(tmp_path / "events.out.tfevents.*"))
  records = list(writers._records(open(path, "rb").read()))
  damaged = records[1][0][:12] + b"\xff" * (len(records[1][1])) + records[1][0][-4:]
  with open(path, "wb") as f:
    f.write(records[0][0] + damaged + b"".join(r for r, _ in records[2:]))
  writers.drop_events_after(path, 20)
  kept = [r for r, _ in writers._records(open(path, "rb").read())]
  assert kept[1] == damaged and len(kept) == len(records) - 1   # step 30 dropped


def test_a_flush_puts_every_logged_event_on_disk(tmp_path):
  """The runner flushes before each checkpoint and a resumed run does not log the steps
  before it again: a process killed right after a flush must have written them all."""
  script = (
      "import os, signal\n"
      "from phoenix_flax.training.writers import RunWriter\n"
      f"w = RunWriter({str(tmp_path)!r}, {{'model.num_layers': 2}}, None)\n"
      "for step in (10, 20, 30):\n"
      "  w.log(step, {f'eval/m{i}': float(i) for i in range(60)}, 1.0)\n"
      "w.flush()\n"
      "os.kill(os.getpid(), signal.SIGKILL)\n")
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                        env=subprocess_env(), timeout=120)
  assert proc.returncode == -9, proc.stderr[-2000:]
  acc = _accumulator(str(tmp_path))
  assert len(acc.Tags()["scalars"]) == 60
  assert all([e.step for e in acc.Scalars(f"eval/m{i}")] == [10, 20, 30] for i in range(60))


def test_a_flush_syncs_the_metrics_rows_too(tmp_path, monkeypatch):
  """Appended rows may wait in the page cache; a checkpoint written after a flush must not
  outlive them in a power loss (a resume would leave their steps missing for good)."""
  writer = RunWriter(str(tmp_path), {"model.num_layers": 2}, None)
  writer.log(10, {"train/loss": 1.0}, 1.0)
  synced = []
  real_fsync = os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino),
                                               real_fsync(fd))[1])
  writer.flush()
  assert os.stat(tmp_path / "metrics.jsonl").st_ino in synced
  writer.close(finished=False)


def test_events_reach_disk_while_a_run_trains(tmp_path, monkeypatch):
  """A live TensorBoard sees a run's events once a later row is logged `FLUSH_SECONDS`
  or more after the previous flush, not only at checkpoints."""
  from phoenix_flax.training import writers
  writer = RunWriter(str(tmp_path), {"model.num_layers": 2}, None)
  writer.log(10, {"train/loss": 1.0}, 1.0)   # within the interval: may wait in a buffer
  monkeypatch.setattr(writers, "FLUSH_SECONDS", 0.0)
  writer.log(20, {"train/loss": 2.0}, 2.0)
  assert [e.step for e in _accumulator(str(tmp_path)).Scalars("train/loss")] == [10, 20]
  writer.close(finished=False)


def test_a_writer_flushes_once_an_interval_not_at_every_row(tmp_path, monkeypatch):
  """Each flush fsyncs, so a row a second over 40 s flushes 3 times with a 10 s interval
  (at 10.5, 21.5 and 32.5 s), not at every row once the first interval has passed."""
  now = [0.0]
  clock = type("Clock", (), {"monotonic": staticmethod(lambda: now[0]),
                             "time": staticmethod(time.time),
                             "time_ns": staticmethod(time.time_ns)})
  monkeypatch.setattr(writers, "time", clock)
  monkeypatch.setattr(writers, "FLUSH_SECONDS", 10.0)
  writer = RunWriter(str(tmp_path), {"model.num_layers": 2}, None)
  flushed, flush = [], writer.flush
  writer.flush = lambda: (flushed.append(now[0]), flush())
  for second in range(40):
    now[0] = second + 0.5
    writer.log(second, {"train/loss": 1.0}, now[0])
  writer.close(finished=False)
  assert flushed == [10.5, 21.5, 32.5]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _post_json(url: str, body: dict) -> dict:
  request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                   headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(request, timeout=10) as response:
    return json.load(response)


@pytest.mark.slow
def test_tensorboard_server_serves_the_run_scalars(run_dir):
  """The run's scalars, and an HParams view that compares it with a second run: the
  hparams that differ come first, a cap that is 30.0 in one run and None in the other
  is one string column whose filter finds either (with the cap a number in one run, the
  filter on "30.0" found no run), and the scalars are the metrics."""
  port = _free_port()
  logdir = os.path.dirname(run_dir)
  with open(os.path.join(run_dir, "config.json")) as f:
    hparams = schema.hparams(json.load(f))
  hparams = {k: tuple(v) if isinstance(v, list) else v for k, v in hparams.items()}  # as run
  other = RunWriter(os.path.join(logdir, "other_run"),
                    {**hparams, "model.attn_logit_cap": "None", "model.num_layers": 3}, None)
  other.log(10, {"train/loss": 1.0, "eval/auc_mean": 0.6}, 1.0)
  other.close(finished=True)
  proc = subprocess.Popen(
      [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", "127.0.0.1",
       "--port", str(port), "--reload_interval", "1"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  url = f"http://127.0.0.1:{port}/data/plugin/scalars/tags"
  tags, experiment, groups = {}, {}, {}
  try:
    deadline = time.monotonic() + SERVER_WAIT_S
    while time.monotonic() < deadline:
      assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
      try:
        with urllib.request.urlopen(url, timeout=5) as response:
          tags = json.load(response).get(os.path.basename(run_dir), {})
      except (urllib.error.URLError, ConnectionError, TimeoutError):
        tags = {}
      if "eval/auc_mean" in tags:
        break
      time.sleep(0.5)
    experiment = _post_json(f"http://127.0.0.1:{port}/data/plugin/hparams/experiment",
                            {"experimentName": ""})
    # What the dashboard sends when a value of the cap's filter is ticked alone.
    groups = {cap: _post_json(
        f"http://127.0.0.1:{port}/data/plugin/hparams/session_groups",
        {"experimentName": "", "startIndex": 0, "sliceSize": 10,
         "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                             "STATUS_RUNNING"],
         "colParams": [{"hparam": "model.attn_logit_cap", "filterDiscrete": [cap]}]})
        for cap in ("30.0", "None")}
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
  assert {"train/loss", "eval/auc_mean", "eval/bayes_auc_mean"} <= set(tags), tags
  infos = experiment["hparamInfos"]
  differing = [h["name"] for h in infos if h.get("differs")]
  assert differing == ["model.attn_logit_cap", "model.num_layers"], differing
  assert [h["name"] for h in infos[:2]] == differing
  assert infos[0]["type"] == "DATA_TYPE_STRING" and infos[1]["type"] == "DATA_TYPE_FLOAT64"
  for cap, found in groups.items():
    assert found.get("totalSize") == 1, (cap, found)
  metrics = {m["name"]["tag"] for m in experiment["metricInfos"]}
  assert {"train/loss", "eval/auc_mean", "eval/auc/favorite_score"} <= metrics, metrics


def test_the_sessions_of_a_group_log_the_groups_seeds():
  """HParams shows a session group with one session's hparams: every seed of a group logs
  the group's first seed, so the row reads "seed 3", not the seed of whichever session
  came first, and no seed count, which a later command adding seeds to the group would
  leave stale (the table counts sessions); a run of its own logs its config's seed. A
  retrieval run logs none of the ranking model's switches, and the reverse."""
  from experiments.configs import ranking as ranking_configs
  from experiments.configs import retrieval as retrieval_configs
  config = ranking_configs.get_config("smoke")
  config.seed, config.num_seeds = 3, 2
  for k in (3, 4):
    hp = runner.session_hparams(config, schema.seed_config(config, k), "/w")
    assert hp["seed"] == 3 and "num_seeds" not in hp
  single = ranking_configs.get_config("smoke")
  single.seed = 5
  hp = runner.session_hparams(single, schema.seed_config(single, 5), "")
  assert hp["seed"] == 5 and "num_seeds" not in hp
  assert "model.candidate_isolation" in hp and "model.enable_linear_proj" not in hp
  retrieval = retrieval_configs.get_config("smoke")
  hp = runner.session_hparams(retrieval, schema.seed_config(retrieval, 0), "")
  assert "model.candidate_isolation" not in hp and "model.attention_impl" not in hp
  assert "model.enable_linear_proj" in hp and "model.num_layers" in hp
  # A nullable field is a string, set or not, in an extra evaluation split too.
  shifted = ranking_configs.get_config("smoke")
  shifted.extra_eval_splits.long = schema.split_config(max_history=8)
  shifted.extra_eval_splits.any = schema.split_config(max_history=None)
  hp = schema.hparams(shifted)
  assert hp["eval_split.max_history"] == str(shifted.eval_split.max_history)
  assert (hp["extra_eval_splits.long.max_history"], hp["extra_eval_splits.any.max_history"]
          ) == ("8", "None")
  assert hp["extra_eval_splits.long.min_history"] == shifted.extra_eval_splits.long.min_history
