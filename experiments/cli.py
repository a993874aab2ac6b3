"""What the command-line scripts share: usage errors as one line with exit status 2,
absl flag parsing that reports through them (`parse_config_flags` and `checked_config`
for the scripts that take a `--config` file) and expands `~` in path flags, the exit of
a run that was interrupted or refused, and a quieter JAX backend search."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Iterator, NoReturn, Optional, Sequence

from absl import app, flags
import ml_collections

from phoenix_flax.training import (ConfigError, RunInterrupted, RunInUseError,
                                   RunOutputError, writers)
from phoenix_flax.training.checkpoint import CheckpointError
from phoenix_flax.training.schema import (check_config, not_in_model_section, paths_named,
                                          schema_paths)
from phoenix_flax.training.writers import nearest_existing

EXIT_BAD_INPUT = 2

# What runs raise for a reason the user can act on (a bad config, another process on a run
# directory, a damaged or foreign file there, a workdir or outputs that cannot be written):
# reported as one line, where any other exception is a bug and keeps its traceback.
RUN_ERRORS = (ConfigError, RunInUseError, CheckpointError, NotADirectoryError,
              PermissionError, RunOutputError)


def repeated(names: Sequence[str]) -> list[str]:
  """The names that `names` holds more than once, sorted (a config, an ablation or a
  variant named twice would run twice, or share one folder)."""
  return sorted({n for n in names if list(names).count(n) > 1})


def usage_error(message: str, flags_hint: bool = True) -> NoReturn:
  """Exits with status 2 and the message alone (plus a pointer to `--helpfull` where the
  fault is in the flags), where absl's `UsageError` would print the script's whole
  docstring first."""
  hint = "Run with --helpfull to see every flag.\n" if flags_hint else ""
  sys.stderr.write(f"error: {message}\n{hint}")
  sys.exit(EXIT_BAD_INPUT)


def check_output_file(flag: str, path: str) -> None:
  """A `usage_error` unless `--<flag>=path` names a file that can be written (its folder
  is created if missing, by `write_output_file`): checked before minutes of work, not
  after, by writing a scratch file where the folder would start."""
  if not os.path.basename(path):
    usage_error(f"--{flag}={path!r} names no file")
  if os.path.isdir(path):
    usage_error(f"--{flag}={path} is a directory; name a file")
  folder = nearest_existing(os.path.dirname(os.path.abspath(path)))
  if not os.path.isdir(folder):
    usage_error(f"--{flag}={path} cannot be written: {folder} is not a directory")
  why = writers.why_unwritable(folder)
  if why:
    usage_error(f"--{flag}={path} cannot be written: {folder} is not a writable directory "
                f"({why})")


def write_output_file(path: str, obj) -> None:
  """Writes `obj` as JSON to `path` atomically (`writers.write_json`: NaN and inf become
  null), creating its folder."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  writers.write_json(path, obj)


class Terminated(KeyboardInterrupt):
  """SIGTERM outside a training loop, raised as Ctrl-C raises `KeyboardInterrupt`."""

  signum = signal.SIGTERM


def _swallowed_here(frame) -> bool:
  """Whether an exception raised in `frame` would be lost: inside a garbage-collector
  callback (JAX registers one, which runs at any allocation) or a `__del__` method,
  Python prints "Exception ignored" and carries on."""
  callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
  while frame is not None:
    if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
      return True
    frame = frame.f_back
  return False


_DEFERRED: list[threading.Timer] = []   # signals `_stop_on_signal` sends again


def _interrupt(signum: int) -> NoReturn:
  raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _stop_on_signal(signum, frame) -> None:
  """The handler of SIGINT and SIGTERM in `exit_on_run_errors`: raises `KeyboardInterrupt`
  (`Terminated` for SIGTERM), or, where that would be lost (`_swallowed_here`), sends the
  signal again 50 ms later, once the callback has returned (a block that ends before
  then raises it as it ends)."""
  if _swallowed_here(frame):
    timer = threading.Timer(0.05, os.kill, (os.getpid(), signum))
    timer.daemon = True
    _DEFERRED.append(timer)
    timer.start()
    return
  _cancel_deferred()
  _interrupt(signum)


def _cancel_deferred() -> Optional[int]:
  """Cancels the signals waiting to be sent again; the last one's number, or None."""
  signum = _DEFERRED[-1].args[1] if _DEFERRED else None
  for timer in _DEFERRED:
    timer.cancel()
  _DEFERRED.clear()
  return signum


@contextlib.contextmanager
def exit_on_run_errors(resume_hint: str = "", resumable: bool = True) -> Iterator[None]:
  """A run stopped by Ctrl-C or SIGTERM (`RunInterrupted`, its checkpoint written) ends
  the script with its message, `resume_hint`, and the shell's status for that signal
  (130, 143); a Ctrl-C or SIGTERM anywhere else in the block (setup, compiling, probes;
  in the main thread SIGTERM raises `Terminated` there, and a signal that lands in a
  garbage-collector callback, which would lose the exception, is sent again once it has
  returned: `_stop_on_signal`), or a second one during training (which stops at once),
  with a one-line message and 130 or 143; one of `RUN_ERRORS` with its message and
  status 2. A signal that the process ignores (a job started in the background with
  `&` ignores SIGINT) stays ignored. `resumable=False` (a script that keeps nothing to
  resume from) says that running it again starts over."""
  main_thread = threading.current_thread() is threading.main_thread()
  previous = {}
  if main_thread:
    for s in (signal.SIGINT, signal.SIGTERM):
      if signal.getsignal(s) is not signal.SIG_IGN:
        previous[s] = signal.signal(s, _stop_on_signal)
  try:
    yield
    # caught in a callback just before the block ended (only the main thread has handlers)
    deferred = _cancel_deferred() if main_thread else None
    if deferred is not None:
      _interrupt(deferred)
  except RunInterrupted as e:
    sys.stderr.write(f"{e}\n" + (f"{resume_hint}\n" if resume_hint else ""))
    sys.exit(128 + e.signum)
  except KeyboardInterrupt as e:
    signum = getattr(e, "signum", signal.SIGINT)
    name = signal.Signals(signum).name
    if not resumable:
      sys.stderr.write(f"interrupted by {name}; this command resumes nothing: run it again "
                       "to start over\n")
      sys.exit(128 + signum)
    what = (f"stopped at once by a second signal ({name}) during training, losing the "
            "chunk under way" if getattr(e, "stopped_at_once", False)
            else f"interrupted by {name} while no training chunk was running")
    sys.stderr.write(f"{what}, so no new checkpoint was written; finished runs and "
                     "checkpoints are kept: run the same command again\n")
    sys.exit(128 + signum)
  except RUN_ERRORS as e:
    usage_error(str(e), flags_hint=False)
  finally:
    if main_thread:
      _cancel_deferred()
    for s, handler in previous.items():
      signal.signal(s, signal.SIG_DFL if handler is None else handler)


def run_app(main, **kwargs) -> NoReturn:
  """`absl.app.run(main, **kwargs)` for the scripts that stop on Ctrl-C or SIGTERM
  (`exit_on_run_errors`): such an exit (status 130 or 143) flushes the logs and output and
  leaves with `os._exit`, skipping the interpreter's teardown. Everything of the run is
  on disk by then, while XLA's threads may still be busy with a compile or a computation
  the signal cut short; tearing the interpreter down under them ended such exits with a
  segmentation fault (status 139) in about half the tries."""
  try:
    app.run(main, **kwargs)
  except SystemExit as e:
    if e.code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
      logging.shutdown()
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(e.code)
    raise


# The flags whose value is a path. The shell expands the `~` of `--workdir ~/runs` but not
# that of `--workdir=~/runs`, which would make a folder named "~" in the current directory
# (one `rm -rf ~` away from deleting the home directory): both parsers expand it.
PATH_FLAGS = ("config", "out", "workdir")


def expand_home(argv: list[str]) -> list[str]:
  """`argv` with a leading `~` or `~user` expanded in `--<path flag>=~...` values
  (`PATH_FLAGS`, one dash or two), as the shell does for a separate `~...` word. The
  program name and everything after `--` are left alone."""
  out = list(argv[:1])
  for i, arg in enumerate(argv[1:], 1):
    if arg == "--":
      return out + list(argv[i:])
    name, eq, value = arg.partition("=")
    if eq and value.startswith("~") and name.lstrip("-") in PATH_FLAGS and (
        name.startswith("-")):
      arg = f"{name}={os.path.expanduser(value)}"
    out.append(arg)
  return out


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing (`app.run(..., flags_parser=parse_flags)`) whose errors (an
  unknown enum value, a value out of bounds) are a `usage_error`; `~` in a path flag's
  value is expanded (`expand_home`)."""
  argv = expand_home(argv)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    usage_error(str(e))


def fail(message: str) -> NoReturn:
  """A `usage_error` without the pointer to `--helpfull` (the fault is not in a flag)."""
  usage_error(message, flags_hint=False)


def _key_error_message(e: BaseException) -> str:
  """The text of a lookup error, unwrapped: ml_collections raises AttributeError(KeyError(
  message)), and a KeyError's str() is the repr of its message."""
  while isinstance(e, (AttributeError, KeyError)) and e.args and isinstance(e.args[0],
                                                                              BaseException):
    e = e.args[0]
  return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


SCHEMA_HINT = "The schema is in phoenix_flax/training/schema.py"


def _unknown_field_message(lookup_error: str, paths: list[str]) -> str:
  """The message for an override of a field the config does not have: the overrides that
  name the missing key, the lookup error (with ml_collections' "Did you mean"), and where
  a field of that name does exist (another section, e.g. `ranking.top_k`)."""
  key = lookup_error.splitlines()[0].strip().strip("'\"")
  named = [p for p in paths if key in p.split(".")]
  text = ("a --config.* override names a field the config does not have"
          + (": " + ", ".join(f"--config.{p}" for p in named) if named else "") + "\n  "
          + lookup_error.replace("\n", "\n  "))
  elsewhere = [path for path in paths_named(key) if path not in named]
  if elsewhere:
    text += "\n  A field of that name is at: " + ", ".join(elsewhere)
  if any(p.startswith("extra_eval_splits.") and p.split(".")[1] == key for p in named):
    text += ("\n  An extra evaluation split is defined in the config file (with "
             "schema.split_config()); the command line only changes the fields of those it "
             "defines")
  return f"{text}\n{SCHEMA_HINT}"


def _raised_in_get_config(e: BaseException) -> bool:
  """Whether `e` (or an error it was raised from) came through a config file's
  `get_config()`: a field the file's own code misspells, not an override's."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if any(frame.f_code.co_name == "get_config"
           for frame, _ in traceback.walk_tb(e.__traceback__)):
      return True
    e = e.__cause__ or e.__context__
  return False


def _below_a_value(paths: list[str]) -> Optional[tuple[str, str]]:
  """The first override path that reaches below a field of the schema holding a value
  (`task.foo`, `world.base_rates.x`), with that field."""
  values = schema_paths()
  for path in paths:
    parts = path.split(".")
    for n in range(1, len(parts)):
      if ".".join(parts[:n]) in values:
        return path, ".".join(parts[:n])
  return None


def parse_config_flags(argv: list[str]) -> list[str]:
  """absl flag parsing that turns every bad flag or `--config` override into a message
  and exit status 2 (`cli.parse_flags`, plus the config file's own errors); `~` in a path
  flag's value is expanded (`expand_home`)."""
  argv = expand_home(argv)
  overrides = [a for a in argv[1:] if a.startswith("--config.")]
  given = any(a == "--config" or a.startswith("--config=") for a in argv[1:])
  if overrides and not given and flags.FLAGS["config"].default is None:
    fail(f"--config is required: the overrides {overrides} apply to a config file, e.g. "
         "--config=experiments/configs/ranking.py")
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    lines = [line for line in str(e).splitlines() if line.strip()]
    if any(line.startswith("Traceback") for line in lines):
      lines = [lines[0], lines[-1]]
    if lines[0].startswith("flag --config."):   # --helpfull does not list config fields
      fail("\n".join(lines) + f"\n{SCHEMA_HINT}")
    usage_error("\n".join(lines))
  except (AttributeError, KeyError) as e:
    if "has no attribute 'get_config'" in _key_error_message(e):
      fail("--config could not be loaded: the file defines no get_config() (a config file "
           "is a Python file whose get_config() returns an ml_collections.ConfigDict)")
    if _raised_in_get_config(e):   # the file's own code (`c.trian`), not an override
      fail(f"--config could not be loaded ({type(e).__name__} in its get_config(): "
           f"{_key_error_message(e)})".replace("\n", " ") + f"\n{SCHEMA_HINT}")
    paths = [a[len("--config."):].split("=", 1)[0] for a in overrides]
    for path in paths:
      why = not_in_model_section(path[len("model."):]) if path.startswith("model.") else None
      if why:
        fail(f"--config.{path}: {why}")
    fail(_unknown_field_message(_key_error_message(e), paths))
  except (TypeError, ValueError) as e:
    below = _below_a_value([a[len("--config."):].split("=", 1)[0] for a in overrides])
    if below:   # `--config.task.foo=1`: "string indices must be integers, not 'str'"
      path, value = below
      fail(f"--config.{path}: config.{value} holds a value, not a section of fields\n"
           f"{SCHEMA_HINT}")
    fail(f"bad --config value: {e}")
  except SyntaxError as e:
    fail(f"--config could not be loaded: {e.filename}, line {e.lineno}: {e.msg}")
  except Exception as e:   # raised by the config file's own code while loading it
    fail(f"--config could not be loaded ({type(e).__name__}: {e})")


def checked_config(config) -> ml_collections.ConfigDict:
  """The value of a `--config` flag (`config_flags.DEFINE_config_file`), checked: a file
  that could not be loaded, a `get_config()` that returns no ConfigDict and any invalid
  field (`schema.check_config`) end the script with a usage error, before any work."""
  if config is None:
    if "config" in flags.FLAGS and flags.FLAGS["config"].present:
      fail("--config's get_config() returned None: it must return an "
           "ml_collections.ConfigDict (a missing return statement?)")
    fail("--config is required, e.g. --config=experiments/configs/ranking.py")
  try:
    config.to_dict()   # ml_collections defers a config file's load error to first use
  except OSError as e:
    # ml_collections wraps the cause ("[Errno 2] No such file ...: 'path'") in lines about
    # its own loader; the cause is the line to show.
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    cause = next((line for line in reversed(lines) if "[Errno" in line), None)
    fail("--config could not be loaded: "
         + (cause[cause.index("[Errno"):] if cause else " ".join(lines)))
  except AttributeError:
    pass   # no ConfigDict: said next
  if not isinstance(config, ml_collections.ConfigDict):
    fail(f"--config's get_config() must return an ml_collections.ConfigDict, got "
         f"{type(config).__name__}")
  try:
    check_config(config)   # before reading any section (no backend touched)
  except ConfigError as e:
    fail(str(e))
  return config


def quiet_backend_search() -> None:
  """Hides JAX's INFO lines about accelerator plugins it did not find ("Unable to
  initialize backend 'tpu'"), which a script's INFO-level progress log would show."""
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
