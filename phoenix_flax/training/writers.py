"""What a run writes: TensorBoard events (tensorboardX, no TensorFlow), metrics.jsonl and
atomic JSON files."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import numbers
import os
import re
import shutil
import struct
import tempfile
import time
from typing import IO, Any, Iterator, Mapping, Optional

import numpy as np
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.api_pb2 import Status
from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData
from tensorboardX.summary import hparams as hparams_summary
from tensorboardX.summary import scalar as scalar_summary

_LOG = logging.getLogger(__name__)
# tensorboardX warns at every non-finite scalar; a diverged run logs NaN on purpose (and
# says it diverged), so those warnings would only flood its output.
logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)

METRICS_FILE = "metrics.jsonl"
_TEMPORARY = re.compile(r"\..+\.tmp\.(\d+)")   # atomic_file's ".<name>.tmp.<pid>"


def jsonable(value: Any) -> Any:
  """Python scalars/lists for JSON; NaN and inf become None (strict JSON has neither)."""
  if isinstance(value, Mapping):
    return {str(k): jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  if isinstance(value, (np.ndarray, np.generic)):
    return jsonable(value.tolist())
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  return value


@contextlib.contextmanager
def atomic_file(path: str, mode: str = "w") -> Iterator[IO]:
  """A file object whose content replaces `path` only once the block completes.

  It writes to a temporary file in `path`'s folder, syncs it, renames it over `path` and
  syncs the folder, so `path` holds the old content or the new, never a mix, after a kill
  or a power loss. If the block raises, the temporary file is removed and `path` is left
  as it was. `mode` is "w" (UTF-8 text) or "wb".
  """
  if mode not in ("w", "wb"):
    raise ValueError(f"mode={mode!r} must be 'w' or 'wb'")
  folder = os.path.dirname(os.path.abspath(path))
  tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp.{os.getpid()}")
  try:
    with open(tmp, mode, encoding=None if mode == "wb" else "utf-8") as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  if os.name == "posix":  # the rename itself survives a power loss once the folder is synced
    fd = os.open(folder, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def why_unwritable(folder: str) -> Optional[str]:
  """None when a file can be created in the existing `folder`, else why not (the OS's
  words). Tried with a scratch file: `os.access` says yes to root in a folder such as
  /proc, where nothing can be created."""
  try:
    with tempfile.TemporaryFile(dir=folder):
      return None
  except OSError as e:
    return e.strerror or str(e)


def nearest_existing(path: str) -> str:
  """`path` (made absolute) or its nearest ancestor that exists: where creating `path`
  would start, so whether it is a writable folder says whether that can work."""
  path = os.path.abspath(path)
  while not os.path.lexists(path):   # (a link to nothing exists: nothing is created there)
    path = os.path.dirname(path)
  return path


def _running(pid: int) -> bool:
  """Whether another process with this id runs on this host."""
  if pid == os.getpid() or pid <= 1:   # no writer of ours is init, or a process group
    return False
  try:
    os.kill(pid, 0)
  except (ProcessLookupError, OverflowError):   # none, or no process id at all
    return False
  except PermissionError:   # it exists, as another user's
    return True
  return True


def is_temporary(name: str) -> bool:
  """Whether `name` is that of an `atomic_file` temporary (a writer's, or a killed one's)."""
  return _TEMPORARY.fullmatch(name) is not None


def remove_temporaries(folder: str, keep_live_writers: bool = False) -> None:
  """Deletes `atomic_file`'s temporary files in `folder`: partial files of killed writers
  (call it only where no other process is writing, or with `keep_live_writers`, which
  keeps the files of writers still running on this host)."""
  for name in os.listdir(folder):
    found = _TEMPORARY.fullmatch(name)
    if found and not (keep_live_writers and _running(int(found.group(1)))):
      try:
        os.remove(os.path.join(folder, name))
      except FileNotFoundError:   # its writer finished (renamed it) meanwhile
        pass


def write_json(path: str, payload: Any, indent: int = 2, sort_keys: bool = True) -> None:
  """Writes `payload` as JSON to `path` (`atomic_file`); NaN and inf become null."""
  with atomic_file(path) as f:
    json.dump(jsonable(payload), f, indent=indent, sort_keys=sort_keys, allow_nan=False)
    f.write("\n")


def matching(folder: str, pattern: str) -> list[str]:
  """The paths in `folder` whose names match the glob `pattern` (`**` spans folders),
  sorted; `folder` is taken literally (a workdir named `runs/exp[1]` must not match, and
  lose files of, `runs/exp1`)."""
  return sorted(glob.glob(os.path.join(glob.escape(folder), pattern), recursive=True))


_EVENT_NAME = re.compile(r"[A-Za-z0-9_-]+")


def _check_event_name(name: str) -> None:
  """An extra event file is found by its name's suffix, `*.<name>`: a name with a dot
  ("x.probes") would be found as another ("probes"), one with `*` or `?` as many."""
  if not isinstance(name, str) or not _EVENT_NAME.fullmatch(name):
    raise ValueError(f"event file name {name!r}: use letters, digits, '_' and '-' only")


def event_file_name(run_dir: str, name: str) -> Optional[str]:
  """The run's extra event file `name` (see `write_event_file`), the newest where a killed
  writer left two, or None."""
  _check_event_name(name)
  found = _event_files(run_dir, name)
  return found[-1] if found else None


def _event_files(run_dir: str, name: str) -> list[str]:
  """Every extra event file `name` in `run_dir`, oldest first (one, but where a writer was
  killed between moving its file in and removing the earlier one)."""
  return matching(run_dir, f"events.out.tfevents.*.{name}")


def _is_finite_number(value: Any) -> bool:
  """Whether `value` is a finite real number: a Python, NumPy or 0-d array one (a probe
  computed with jnp), not a bool."""
  if isinstance(value, (bool, np.bool_)):
    return False
  if not isinstance(value, numbers.Real):   # (NumPy's real scalars register as one)
    if not hasattr(value, "__array__") or np.ndim(value) != 0:
      return False
    dtype = np.asarray(value).dtype
    if not (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)):
      return False   # (a complex number, say)
  return bool(np.isfinite(np.asarray(value, np.float64)))


def write_event_file(run_dir: str, name: str, scalars: Mapping[str, Any], step: int) -> str:
  """Writes `scalars` (the finite numbers among them) at `step` to an event file of their
  own in `run_dir`, `events.out.tfevents.*.<name>`, replacing an earlier one of that name.
  TensorBoard reads every event file of a folder as one run, so values measured after
  training (an ablation's probes) join the run's curves and its HParams metrics. The file
  is written in a temporary folder and moved in whole. `name` holds letters, digits, '_'
  and '-' only."""
  _check_event_name(name)
  for stale in matching(run_dir, f".{name}.*"):   # a killed writer's
    shutil.rmtree(stale, ignore_errors=True)
  tmp = tempfile.mkdtemp(prefix=f".{name}.", dir=run_dir)
  try:
    events = EventsWriter(os.path.join(tmp, "events"), f".{name}")
    for key, value in scalars.items():
      if _is_finite_number(value):
        events.write_event(_scalar_event(key, value, step))
    events.close()
    (written,) = matching(tmp, "events.out.tfevents.*")
    olds = _event_files(run_dir, name)   # every earlier one
    path = os.path.join(run_dir, os.path.basename(written))
    os.replace(written, path)
    for old in olds:
      if old != path:
        os.remove(old)
    return path
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _records(data: bytes) -> Iterator[tuple[bytes, bytes]]:
  """(whole record, payload) of each complete TFRecord of an event file's bytes; a torn
  last record (a killed writer's) ends the iteration."""
  pos = 0
  while pos + 12 <= len(data):
    (length,) = struct.unpack("<Q", data[pos:pos + 8])
    end = pos + 12 + length + 4
    if end > len(data):
      return
    yield data[pos:end], data[pos + 12:pos + 12 + length]
    pos = end


def drop_events_after(path: str, step: int) -> None:
  """Rewrites the event file `path` (atomically) without its summaries of steps after
  `step`. A resumed run logs those steps again; TensorBoard's default (Rust) data server
  ignores the restart marker that `RunWriter` also writes, so without this a tag that the
  resumed run does not log again at the same step (the killed process's
  `perf/examples_per_second` of the chunk after the checkpoint) keeps a point of the killed
  process that metrics.jsonl no longer has."""
  with open(path, "rb") as f:
    data = f.read()
  kept = []
  for record, payload in _records(data):
    try:
      event = Event.FromString(payload)
    except Exception:   # protobuf's DecodeError: a damaged record, kept as it is
      # (TensorBoard skips it; protobuf comes with tensorboardX, not imported here)
      kept.append(record)
      continue
    if not (event.HasField("summary") and event.step > step):
      kept.append(record)
  with atomic_file(path, "wb") as f:
    f.write(b"".join(kept))


def _event(**fields) -> Event:
  """A TensorBoard event stamped with the current time."""
  return Event(wall_time=time.time(), **fields)


def _scalar_event(name: str, value: float, step: int) -> Event:
  return _event(step=step, summary=scalar_summary(tensorboard_tag(name), float(value)))


def read_json(path: str) -> Any:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def tensorboard_tag(name: str) -> str:
  """The TensorBoard tag of a metric name: characters TensorBoard rejects (e.g. "@" in
  "recall@5") become "_"; metrics.jsonl and result.json keep the name itself."""
  return re.sub(r"[^-/\w.]", "_", name)


def _hparam_value(value: Any) -> Any:
  if isinstance(value, (bool, int, float, str)):
    return value
  return str(value)


def read_metrics(run_dir: str) -> list[dict]:
  """The rows of a run's metrics.jsonl (none if it has none).

  A last line without its newline (a killed process's half-written row) is dropped. A
  line elsewhere that is not a JSON object with an integer "step" (damage from outside:
  rows are appended whole) is skipped with a warning naming it; the rows after it stay.
  """
  path = os.path.join(run_dir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8", errors="replace") as f:
    lines = f.read().split("\n")
  rows = []
  for number, line in enumerate(lines[:-1], 1):   # lines[-1]: "" or an unfinished row
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      row = None
    step = row.get("step") if isinstance(row, dict) else None
    if isinstance(step, int) and not isinstance(step, bool):
      rows.append(row)
    else:
      _LOG.warning("%s line %d is not a metrics row (skipped): %.80r", path, number, line)
  return rows


# A live TensorBoard sees a logged event once it is flushed: by the first `log` at least
# this long after the previous flush, or by the next checkpoint's `flush`, whichever
# comes first (so within about this long plus the time between two host calls).
FLUSH_SECONDS = 10


@contextlib.contextmanager
def _hparams_data(summary) -> Iterator[HParamsPluginData]:
  """The HParams plugin data of a tensorboardX hparams summary, to edit in the block;
  written back into the summary after it."""
  content = summary.value[0].metadata.plugin_data
  data = HParamsPluginData.FromString(content.content)
  yield data
  content.content = data.SerializeToString()


class RunWriter:
  """Scalars of one run to TensorBoard and metrics.jsonl.

  metrics.jsonl has one JSON object per host call: `{"step", "wall_seconds", "train/...",
  "perf/...", and on evaluation steps "eval/..." and "<split>/..."}`. TensorBoard gets the
  same scalars (tags from `tensorboard_tag`) plus the run's hparams (HParams dashboard).
  Only the session's hparams are written, no experiment summary: TensorBoard then derives
  the experiment from every run under its logdir, types each hparam over all of them (so
  `schema.hparams` gives a field that may be None a string in every run: numbers beside
  "None" made a string column whose filter hid the numbers), marks the hparams that
  differ between runs and lists them first, and offers every scalar as a metric. A summary
  per run would make it take one run's, in which nothing differs.
  Events are written in the calling thread (no background queue), so that `flush` puts
  every event logged so far on disk before the checkpoint that follows it: a resumed run
  drops the events after its checkpoint and does not log them again.
  `resume_step` None starts afresh (old events and rows are removed); an int keeps the rows
  and the events up to that step (`drop_events_after` rewrites the old event files) and
  marks the restart as `SummaryWriter(purge_step=...)` does. `group` names
  the session group of the HParams view: the seeds of one config share it, so that view
  can average them and compare configs (empty: the run is a group of its own).
  """

  def __init__(self, run_dir: str, hparams: Mapping[str, Any], resume_step: Optional[int],
               group: str = ""):
    os.makedirs(run_dir, exist_ok=True)
    self.run_dir = run_dir
    self.metrics_path = os.path.join(run_dir, METRICS_FILE)
    if resume_step is None:
      for old in matching(run_dir, "events.out.tfevents.*"):
        os.remove(old)
      rows = []
    else:
      rows = [r for r in read_metrics(run_dir) if r.get("step", 0) <= resume_step]
      for old in matching(run_dir, "events.out.tfevents.*"):
        drop_events_after(old, resume_step)
    with atomic_file(self.metrics_path) as f:
      f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    # The file name's timestamp has whole seconds; the suffix keeps two writers of one run
    # that start within a second apart, and in the order they started.
    self._events = EventsWriter(os.path.join(run_dir, "events"), f".{time.time_ns()}")
    try:
      self._start_session(hparams, resume_step, group)
    except BaseException:   # not yet in its caller's hands: nothing else would close it
      self._events.close()
      raise
    self._hparams = dict(hparams)
    self._flushed = time.monotonic()
    self._closed = False

  def _start_session(self, hparams: Mapping[str, Any], resume_step: Optional[int],
                     group: str) -> None:
    """The first events: a resume's restart marker, or a fresh run's HParams session."""
    if resume_step is not None:   # as SummaryWriter(purge_step=...) marks a restart
      purge = resume_step + 1
      self._events.write_event(_event(step=purge, file_version="brain.Event:2"))
      self._events.write_event(_event(step=purge,
                                      session_log=SessionLog(status=SessionLog.START)))
    else:
      _, ssi, _ = hparams_summary({k: _hparam_value(v) for k, v in hparams.items()}, {})
      if group:
        with _hparams_data(ssi) as data:
          data.session_start_info.group_name = group
      self._events.write_event(_event(summary=ssi))

  def log(self, step: int, scalars: Mapping[str, float], wall_seconds: float) -> None:
    """One row: every scalar to TensorBoard at `step` and to metrics.jsonl."""
    for name, value in scalars.items():
      self._events.write_event(_scalar_event(name, value, step))
    row = {"step": step, "wall_seconds": wall_seconds, **scalars}
    with open(self.metrics_path, "a", encoding="utf-8") as f:
      f.write(json.dumps(jsonable(row), sort_keys=True) + "\n")
    if time.monotonic() - self._flushed > FLUSH_SECONDS:   # for a TensorBoard watching
      self.flush()

  def flush(self) -> None:
    """Puts every event and metrics.jsonl row logged so far on disk (fsynced: the runner
    flushes before each checkpoint, whose steps a resume does not log again)."""
    self._events.flush()
    with open(self.metrics_path, "a", encoding="utf-8") as f:   # rows are written as logged
      os.fsync(f.fileno())
    self._flushed = time.monotonic()

  @property
  def closed(self) -> bool:
    return self._closed

  def close(self, finished: bool, diverged: bool = False) -> None:
    """Closes the event file, flushing it (metrics.jsonl rows are written as they are
    logged; `flush` also syncs them); on a finished run first records the HParams session
    end, whose status is a failure for a diverged run (the HParams view's status filter
    then leaves it out). Closing again does nothing; `log` and `flush` after a close
    raise ValueError."""
    if self._closed:
      return
    self._closed = True
    try:
      if finished:
        _, _, sei = hparams_summary({k: _hparam_value(v) for k, v in self._hparams.items()}, {})
        if diverged:
          with _hparams_data(sei) as data:
            data.session_end_info.status = Status.Value("STATUS_FAILURE")
        self._events.write_event(_event(summary=sei))
    finally:   # closed even when the last write fails (a full disk)
      self._events.close()
