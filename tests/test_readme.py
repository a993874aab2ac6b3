"""The README's usage example and the quickstart demo run as written."""

import contextlib
import io
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def usage_block() -> str:
  """The first ```python block of the README's "## Usage" section."""
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  section = re.search(r"^## Usage\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
  assert section, "README.md has no '## Usage' section"
  block = re.search(r"```python\n(.*?)```", section.group(1), re.S)
  assert block, "the Usage section has no ```python block"
  return block.group(1)


def test_readme_usage_runs_as_written():
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    exec(compile(usage_block(), "README.md:Usage", "exec"), {"__name__": "readme_usage"})
  lines = stdout.getvalue().strip().splitlines()
  assert lines[-1] == "(2, 8)", stdout.getvalue()


def test_quickstart_runs():
  result = subprocess.run([sys.executable, "-m", "experiments.quickstart"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  assert "Top 8 candidates of user 0" in result.stdout
  assert "user 1:" in result.stdout
  diff = float(re.search(r"all at once = (\S+)", result.stdout).group(1))
  assert diff <= 1e-5
