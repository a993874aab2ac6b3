"""What produced a run's numbers: the git state of the checkout that holds
`phoenix_flax`, and the machine it ran on.

`code_version()` describes the checkout as it is now:

- "<commit>" (12 hex digits) when the checkout's Python files equal that commit's;
- "<commit>+changes.<digest>" when a `.py` file in `phoenix_flax/`, `ablations/` or
  `experiments/` differs from the commit, or an untracked one (not ignored by git) lies
  there; the digest (8 hex digits of a SHA-256 over the diff and those files) tells two
  different sets of uncommitted edits apart, so that a run trained before an edit is not
  mistaken for one trained after it;
- outside a git checkout (a package installed into site-packages, a copied tree), the
  environment variable `PHOENIX_FLAX_CODE_VERSION` if set (whoever copies the tree says
  what it is), else None.

Only the Python files of those three folders count: they are all a run executes from the
checkout. Editing a test, the README, a notebook or the docs changes no run.

`running_code_version()` is what `result.json`, an ablation's results.json and REPORT.md,
and the benchmarks record as "code": `code_version()` taken when this module was imported,
which is when a run's process reads the package (the runner and every script import it
at their start). Read at the end instead, a run that trained while its checkout was
edited or committed would be credited to code it never ran, and a later run of the new
code would reuse its results without the warning that results of other code get.

`machine()` is what `result.json` records as "machine": the same code and seeds give the
same numbers on the same kind of processor, but not across kinds. XLA:CPU compiles for the
vector extensions of the host it runs on, and a wider vector (AVX-512 against AVX2, say)
sums in another order; training carries those last-bit differences into the metrics
(per-seed AUCs up to 0.011 apart between an AVX-512 and an AVX2 host; README, "Quick
start").
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from typing import Optional

import jax

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CODE_DIRS = ("phoenix_flax", "ablations", "experiments")
ENV_VAR = "PHOENIX_FLAX_CODE_VERSION"
# The widest vector extension a Linux /proc/cpuinfo "flags" (x86) or "Features" (Arm)
# line names, widest first.
_VECTOR_EXTENSIONS = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"),
                      ("sse4_2", "SSE4.2"), ("sve2", "SVE2"), ("sve", "SVE"),
                      ("asimd", "NEON"))


def _git(root: str, *args: str) -> Optional[bytes]:
  try:
    done = subprocess.run(["git", "-C", root, *args], capture_output=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return None
  return done.stdout if done.returncode == 0 else None


def code_version(root: Optional[str] = None) -> Optional[str]:
  """The code's version as described in the module docstring; `root` is the checkout
  (default: the one that holds this package, if it is one)."""
  root = os.path.realpath(root or _ROOT)
  top = _git(root, "rev-parse", "--show-toplevel")
  # A package installed into a virtualenv that lies inside some checkout is not that
  # checkout's code: only a checkout whose top folder is `root` counts.
  head = None
  if top is not None and os.path.realpath(top.decode().strip()) == root:
    head = _git(root, "rev-parse", "--short=12", "HEAD")
  if head is None:
    return os.environ.get(ENV_VAR) or None
  return head.decode().strip() + _changes(root)


def _changes(root: str) -> str:
  code = [f"{d}/*.py" for d in _CODE_DIRS]    # git's `*` matches `/` too: every depth
  diff = _git(root, "diff", "HEAD", "--binary", "--", *code) or b""
  listed = _git(root, "ls-files", "--others", "--exclude-standard", "-z", "--", *code) or b""
  untracked = sorted(p for p in listed.split(b"\0") if p)
  if not diff and not untracked:
    return ""
  digest = hashlib.sha256(diff)
  for path in untracked:
    digest.update(b"\0" + path + b"\0")
    try:
      with open(os.path.join(root, path.decode()), "rb") as f:
        digest.update(f.read())
    except OSError:   # deleted since it was listed
      pass
  return "+changes." + digest.hexdigest()[:8]


def running_code_version() -> Optional[str]:
  """`code_version()` of the default checkout as it was when this process imported this
  module (see the module docstring)."""
  return _RUNNING_CODE


_RUNNING_CODE = code_version()


def machine(cpuinfo: str = "/proc/cpuinfo") -> str:
  """The processor of JAX's default backend, in words: on CPU, its model name, widest
  vector extension and logical cores ("AMD EPYC, AVX2, 2 cores"; the extension where
  `cpuinfo` names one, i.e. on Linux); on GPU/TPU, the first device's kind and the
  number of devices ("NVIDIA H100 80GB HBM3 x 1")."""
  device = jax.devices()[0]
  if device.platform != "cpu":
    return f"{device.device_kind} x {jax.device_count()}"
  fields = {}
  try:
    with open(cpuinfo, encoding="utf-8", errors="replace") as f:
      for line in f:
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
          fields[key.strip()] = value.strip()
  except OSError:
    pass
  name = (fields.get("model name") or fields.get("Hardware") or platform.processor()
          or platform.machine() or "unknown processor")
  flags = set((fields.get("flags") or fields.get("Features") or "").split())
  extension = next((label for flag, label in _VECTOR_EXTENSIONS if flag in flags), None)
  cores = os.cpu_count()
  return ", ".join([name] + ([extension] if extension else [])
                   + ([f"{cores} cores"] if cores else []))
