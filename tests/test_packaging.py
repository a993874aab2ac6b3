"""What `pip install` gets: the sdist and the built package, made with setuptools alone
(no wheel or network needed) from a copy of the files they are built from."""

import glob
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from conftest import REPO

pytest.importorskip("setuptools")
SOURCES = ("setup.py", "README.md", "MANIFEST.in", "phoenix_flax", "tests")


def _copy(tmp_path) -> str:
  root = str(tmp_path / "src")
  os.makedirs(root)
  for name in SOURCES:
    src = os.path.join(REPO, name)
    if os.path.isdir(src):
      shutil.copytree(src, os.path.join(root, name),
                      ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    elif os.path.exists(src):
      shutil.copy(src, root)
  return root


def _setup(root: str, *args: str) -> None:
  proc = subprocess.run([sys.executable, "setup.py", "-q", *args], cwd=root,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]


def _package_files(root: str) -> set[str]:
  return {os.path.relpath(os.path.join(d, f), root)
          for d, _, files in os.walk(os.path.join(root, "phoenix_flax"))
          for f in files if f.endswith(".py")}


def test_built_package_holds_every_module(tmp_path):
  """What the wheel gets (`build_py`): every .py file of phoenix_flax/, every subpackage
  (a folder without __init__.py would be left out by find_packages), nothing else."""
  root = _copy(tmp_path)
  _setup(root, "build_py", "-d", "lib")
  built = {os.path.relpath(os.path.join(d, f), os.path.join(root, "lib"))
           for d, _, files in os.walk(os.path.join(root, "lib")) for f in files}
  assert built == _package_files(root)


def test_sdist_holds_what_builds_the_wheel_and_no_partial_tests(tmp_path):
  root = _copy(tmp_path)
  _setup(root, "sdist", "-d", "dist")
  sdist, = glob.glob(os.path.join(root, "dist", "*.tar.gz"))
  with tarfile.open(sdist) as tar:
    names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
  assert {"setup.py", "README.md", "PKG-INFO"} <= names
  assert _package_files(root) <= names
  assert not [n for n in names if n.startswith("tests")], sorted(names)
