"""What the command-line scripts share: usage errors as one line with exit status 2,
absl flag parsing that reports through them, and a quieter JAX backend search."""

from __future__ import annotations

import logging
import sys
from typing import NoReturn

from absl import flags

EXIT_BAD_INPUT = 2


def usage_error(message: str) -> NoReturn:
  """Exits with status 2 and the message alone, where absl's `UsageError` would print the
  script's whole docstring first."""
  sys.stderr.write(f"error: {message}\nRun with --helpfull to see every flag.\n")
  sys.exit(EXIT_BAD_INPUT)


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
