"""Which code trained a run: the git state of the checkout that holds `phoenix_flax`.

`code_version()` is what `result.json` records as "code" and what an ablation's
results.json and REPORT.md cite:

- "<commit>" (12 hex digits) when the checkout's Python files equal that commit's;
- "<commit>+changes.<digest>" when a tracked `.py` file differs from the commit, or an
  untracked one (not ignored by git) lies in `phoenix_flax/`, `ablations/` or
  `experiments/`; the digest (8 hex digits of a SHA-256 over the diff and those files) tells
  two different sets of uncommitted edits apart, so that a run trained before an edit is
  not mistaken for one trained after it;
- outside a git checkout (a package installed into site-packages, a copied tree), the
  environment variable `PHOENIX_FLAX_CODE_VERSION` if set (whoever copies the tree says
  what it is), else None.

Only Python files count: editing the README or a notebook changes no run.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from typing import Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_UNTRACKED_DIRS = ("phoenix_flax", "ablations", "experiments")
ENV_VAR = "PHOENIX_FLAX_CODE_VERSION"


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
  diff = _git(root, "diff", "HEAD", "--binary", "--", "*.py") or b""
  listed = _git(root, "ls-files", "--others", "--exclude-standard", "-z", "--",
                *(f"{d}/*.py" for d in _UNTRACKED_DIRS)) or b""
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
