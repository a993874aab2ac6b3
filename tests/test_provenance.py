"""The code version that result.json, results.json and REPORT.md record."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import types

import jax
import pytest

from phoenix_flax.training import provenance


def _git(root, *args):
  subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t",
                  *args], check=True, capture_output=True)


@pytest.fixture
def checkout(tmp_path):
  root = tmp_path / "repo"
  (root / "phoenix_flax").mkdir(parents=True)
  (root / "phoenix_flax" / "layers.py").write_text("x = 1\n")
  (root / "tests").mkdir()
  (root / "tests" / "test_layers.py").write_text("def test_x(): pass\n")
  (root / "setup.py").write_text("NAME = 'p'\n")
  (root / "README.md").write_text("readme\n")
  (root / ".gitignore").write_text(".venv/\n")
  _git(root, "init", "-q")
  _git(root, "add", ".")
  _git(root, "commit", "-q", "-m", "first")
  return root


def test_a_clean_checkout_is_its_commit(checkout):
  head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], check=True,
                        capture_output=True, text=True).stdout.strip()
  assert provenance.code_version(str(checkout)) == head[:12]


def test_python_edits_are_told_apart_and_other_files_do_not_count(checkout):
  clean = provenance.code_version(str(checkout))
  (checkout / "README.md").write_text("edited\n")            # no run changes with it
  (checkout / ".venv").mkdir()
  (checkout / ".venv" / "site.py").write_text("ignored\n")   # ignored by git
  (checkout / "notes.py").write_text("outside the package folders\n")
  with open(checkout / ".gitignore", "a") as f:   # a scratch file the user told git to ignore
    f.write("phoenix_flax/scratch_*.py\n")
  (checkout / "phoenix_flax" / "scratch_1.py").write_text("ignored too\n")
  # Tracked Python files that no run executes: a test, the setup script.
  (checkout / "tests" / "test_layers.py").write_text("def test_x(): assert False\n")
  (checkout / "setup.py").write_text("NAME = 'q'\n")
  # Files in a package folder that are not Python: notes, a data file.
  (checkout / "phoenix_flax" / "notes.txt").write_text("what I tried\n")
  assert provenance.code_version(str(checkout)) == clean

  layers = checkout / "phoenix_flax" / "layers.py"
  layers.write_text("x = 2\n")
  first = provenance.code_version(str(checkout))
  assert first.startswith(clean + "+changes.") and len(first) == len(clean) + 17
  assert provenance.code_version(str(checkout)) == first      # deterministic
  _git(checkout, "add", str(layers))                # staged but not committed: the same
  assert provenance.code_version(str(checkout)) == first
  _git(checkout, "reset", "-q", "--", str(layers))
  layers.write_text("x = 3\n")
  second = provenance.code_version(str(checkout))
  assert second.startswith(clean + "+changes.") and second != first
  layers.write_text("x = 1\n")                                 # back to the commit
  assert provenance.code_version(str(checkout)) == clean

  # A module deeper in a package folder counts like a top-level one.
  (checkout / "phoenix_flax" / "training").mkdir()
  runner = checkout / "phoenix_flax" / "training" / "runner.py"
  runner.write_text("y = 1\n")
  _git(checkout, "add", str(runner))
  _git(checkout, "commit", "-q", "-m", "runner")
  clean = provenance.code_version(str(checkout))
  runner.write_text("y = 2\n")
  assert provenance.code_version(str(checkout)).startswith(clean + "+changes.")
  runner.write_text("y = 1\n")
  assert provenance.code_version(str(checkout)) == clean

  # A new, uncommitted file in a package folder (an ablation script) is a change too.
  (checkout / "ablations").mkdir()
  script = checkout / "ablations" / "my_idea.py"
  script.write_text("VARIANTS = 1\n")
  one = provenance.code_version(str(checkout))
  script.write_text("VARIANTS = 2\n")
  two = provenance.code_version(str(checkout))
  assert one.startswith(clean + "+changes.") and two.startswith(clean + "+changes.")
  assert one != two
  # Its name counts too: the same text under another name is another module.
  script.rename(checkout / "ablations" / "my_other_idea.py")
  assert provenance.code_version(str(checkout)) not in (two, clean)
  # And one in experiments/ (a config file, a script).
  (checkout / "ablations" / "my_other_idea.py").unlink()
  assert provenance.code_version(str(checkout)) == clean
  (checkout / "experiments" / "configs").mkdir(parents=True)
  (checkout / "experiments" / "configs" / "mine.py").write_text("STEPS = 3\n")
  assert provenance.code_version(str(checkout)).startswith(clean + "+changes.")


def test_outside_a_checkout_there_is_no_version(checkout, tmp_path, monkeypatch):
  plain = tmp_path / "plain"
  plain.mkdir()
  monkeypatch.delenv(provenance.ENV_VAR, raising=False)
  assert provenance.code_version(str(plain)) is None
  # Whoever copies the tree out of its checkout can say what it is.
  monkeypatch.setenv(provenance.ENV_VAR, "0123456789ab+copied")
  assert provenance.code_version(str(plain)) == "0123456789ab+copied"
  assert provenance.code_version(str(checkout)) != "0123456789ab+copied"   # git wins
  monkeypatch.setenv(provenance.ENV_VAR, "")   # set but empty (an env file's): no version
  assert provenance.code_version(str(plain)) is None
  monkeypatch.delenv(provenance.ENV_VAR)
  # A folder inside a checkout (a virtualenv's site-packages there) is not that checkout.
  inner = checkout / ".venv" / "lib"
  inner.mkdir(parents=True)
  assert provenance.code_version(str(inner)) is None


def test_running_code_version_is_the_checkout_when_the_module_was_imported(checkout):
  """What a run records: an edit or a commit after the process imported the package does
  not change it; code_version() follows the checkout."""
  module_dir = checkout / "phoenix_flax" / "training"
  module_dir.mkdir()
  shutil.copy(provenance.__file__, module_dir / "provenance.py")
  _git(checkout, "add", ".")
  _git(checkout, "commit", "-q", "-m", "with provenance.py")
  spec = importlib.util.spec_from_file_location("copied_provenance",
                                                module_dir / "provenance.py")
  copied = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(copied)   # imported: its checkout is at its commit
  imported = copied.running_code_version()
  assert imported == copied.code_version() and "+" not in imported
  (checkout / "phoenix_flax" / "layers.py").write_text("x = 2\n")
  assert copied.code_version().startswith(imported + "+changes.")
  _git(checkout, "commit", "-q", "-am", "edited")
  assert copied.code_version() != imported
  assert copied.running_code_version() == imported


def test_this_package_reports_its_own_checkout():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if os.path.dirname(os.path.dirname(os.path.abspath(provenance.__file__))) != os.path.join(
      root, "phoenix_flax"):
    pytest.skip("phoenix_flax is installed from elsewhere, not from this checkout")
  assert provenance.code_version() == provenance.code_version(root)


@pytest.fixture
def on_cpu(monkeypatch):
  """`machine` describes the default backend's processor: make that the CPU, so that
  the cpuinfo tests mean the same on a GPU host."""
  cpus = jax.devices("cpu")
  monkeypatch.setattr(provenance.jax, "devices", lambda *args: cpus)


@pytest.mark.parametrize("lines, want", [
    (["processor\t: 0", "model name\t: AMD EPYC", "flags\t\t: fpu sse4_2 avx avx2 fma",
      "", "processor\t: 1", "model name\t: AMD EPYC"], "AMD EPYC, AVX2"),
    (["model name\t: Intel(R) Xeon(R) Platinum", "flags\t: avx avx2 avx512f avx512bw"],
     "Intel(R) Xeon(R) Platinum, AVX-512"),
    (["processor\t: 0", "Features\t: fp asimd evtstrm sve"], None),   # Arm: no model name
    # processors that differ (a hybrid part): the first one's name and extensions
    (["processor\t: 0", "model name\t: Big Core", "flags\t: avx avx2 avx512f", "",
      "processor\t: 1", "model name\t: Little Core", "flags\t: sse4_2"], "Big Core, AVX-512"),
])
def test_machine_names_the_processor_and_its_widest_vector_extension(tmp_path, lines, want,
                                                                     on_cpu):
  info = tmp_path / "cpuinfo"
  info.write_text("\n".join(lines) + "\n")
  got = provenance.machine(str(info))
  cores = f", {os.cpu_count()} cores"
  if want is None:     # the model falls back to the platform's name; the extension is read
    assert got.endswith(", SVE" + cores)
  else:
    assert got == want + cores


def test_machine_without_cpuinfo_still_names_something(tmp_path, on_cpu):
  got = provenance.machine(str(tmp_path / "missing"))
  assert got and got.endswith(f"{os.cpu_count()} cores")


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_machine_on_an_accelerator_names_the_device_kind_and_count(monkeypatch, tmp_path,
                                                                   platform):
  device = types.SimpleNamespace(platform=platform, device_kind="NVIDIA H200")
  monkeypatch.setattr(provenance.jax, "devices", lambda *args: [device, device])
  monkeypatch.setattr(provenance.jax, "device_count", lambda *args: 2)
  assert provenance.machine(str(tmp_path / "missing")) == "NVIDIA H200 x 2"
