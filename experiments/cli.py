"""What the command-line scripts share: usage errors as one line with exit status 2,
absl flag parsing that reports through them, the exit of a run that was interrupted or
refused, and a quieter JAX backend search."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Iterator, NoReturn

from absl import app, flags

from phoenix_flax.training import ConfigError, RunInterrupted, RunInUseError
from phoenix_flax.training.checkpoint import CheckpointError
from phoenix_flax.training.writers import nearest_existing

EXIT_BAD_INPUT = 2

# What runs raise for a reason the user can act on (a bad config, another process on a run
# directory, a damaged or foreign file there, a workdir that cannot be written): reported
# as one line, where any other exception is a bug and keeps its traceback.
RUN_ERRORS = (ConfigError, RunInUseError, CheckpointError, NotADirectoryError,
              PermissionError)


def usage_error(message: str, flags_hint: bool = True) -> NoReturn:
  """Exits with status 2 and the message alone (plus a pointer to `--helpfull` where the
  fault is in the flags), where absl's `UsageError` would print the script's whole
  docstring first."""
  hint = "Run with --helpfull to see every flag.\n" if flags_hint else ""
  sys.stderr.write(f"error: {message}\n{hint}")
  sys.exit(EXIT_BAD_INPUT)


def check_output_file(flag: str, path: str) -> None:
  """A `usage_error` unless `--<flag>=path` names a file that can be written: checked
  before minutes of work, not after."""
  if not os.path.basename(path):
    usage_error(f"--{flag}={path!r} names no file")
  if os.path.isdir(path):
    usage_error(f"--{flag}={path} is a directory; name a file")
  folder = nearest_existing(os.path.dirname(os.path.abspath(path)))
  if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
    usage_error(f"--{flag}={path} cannot be written: {folder} is not a writable directory")


class Terminated(KeyboardInterrupt):
  """SIGTERM outside a training loop, raised as Ctrl-C raises `KeyboardInterrupt`."""

  signum = signal.SIGTERM


def _raise_terminated(signum, frame) -> NoReturn:
  raise Terminated()


@contextlib.contextmanager
def exit_on_run_errors(resume_hint: str = "") -> Iterator[None]:
  """A run stopped by Ctrl-C or SIGTERM (`RunInterrupted`, its checkpoint written) ends
  the script with its message, `resume_hint`, and the shell's status for that signal
  (130, 143); a Ctrl-C or SIGTERM anywhere else in the block (setup, compiling, probes;
  in the main thread SIGTERM raises `Terminated` there), or a second one during training
  (which stops at once), with a one-line message and 130 or 143; one of `RUN_ERRORS` with
  its message and status 2."""
  main_thread = threading.current_thread() is threading.main_thread()
  previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
  try:
    yield
  except RunInterrupted as e:
    sys.stderr.write(f"{e}\n" + (f"{resume_hint}\n" if resume_hint else ""))
    sys.exit(128 + e.signum)
  except KeyboardInterrupt as e:
    signum = getattr(e, "signum", signal.SIGINT)
    name = signal.Signals(signum).name
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
      signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


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


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing (`app.run(..., flags_parser=parse_flags)`) whose errors (an
  unknown enum value, a value out of bounds) are a `usage_error`."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    usage_error(str(e))


def quiet_backend_search() -> None:
  """Hides JAX's INFO lines about accelerator plugins it did not find ("Unable to
  initialize backend 'tpu'"), which a script's INFO-level progress log would show."""
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
