"""Runs the candidate-isolation ablation at the smoke preset through its command line,
checks what isolation guarantees, and executes every notebook on that sweep with nbclient
(kernel: the Python running the tests). The committed notebooks carry no outputs."""

import fcntl
import json
import os
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import needs_flax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
NAMES = ("compare_variants", "inside_phoenix", "new_idea", "flax_nnx")


def _run_sweep(workdir: str) -> None:
  cmd = [sys.executable, "-m", "ablations.candidate_isolation", "--preset=smoke",
         f"--workdir={workdir}"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "REPORT.md" in proc.stdout


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory, request):
  """The smoke sweep, trained once per test session: under pytest-xdist the workers share
  one folder of the session, and the first to take the lock trains it."""
  if not hasattr(request.config, "workerinput"):   # not an xdist worker
    workdir = str(tmp_path_factory.mktemp("candidate_isolation"))
    _run_sweep(workdir)
    return workdir
  shared = tmp_path_factory.getbasetemp().parent
  workdir = shared / "candidate_isolation"
  with open(shared / "candidate_isolation.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (workdir / "REPORT.md").exists():
      _run_sweep(str(workdir))
  return str(workdir)


def test_notebooks_are_committed_without_outputs():
  for name in NAMES:
    nb = nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)
    for cell in nb.cells:
      if cell.cell_type == "code":
        assert cell.outputs == [] and cell.execution_count is None, name


@pytest.mark.slow
def test_smoke_sweep_shows_the_isolation_property(sweep_dir):
  with open(os.path.join(sweep_dir, "results.json")) as f:
    results = json.load(f)
  variants = results["variants"]
  assert set(variants) == {"isolated_corr0.5", "causal_corr0.5"}
  iso = variants["isolated_corr0.5"]["metrics"]
  causal = variants["causal_corr0.5"]["metrics"]
  assert iso["score_consistency"]["per_seed"] == [0.0, 0.0]
  assert min(causal["score_consistency"]["per_seed"]) > 0
  assert max(iso["chunked/max_logit_change"]["per_seed"]) < 1e-4
  assert min(causal["chunked/max_logit_change"]["per_seed"]) > 1e-3
  for metric in results["metrics"]:
    assert iso[metric]["n"] == 2 and causal[metric]["n"] == 2, metric
  with open(os.path.join(sweep_dir, "REPORT.md")) as f:
    text = f.read()
  assert "**causal_corr0.5** vs **isolated_corr0.5**, `score_consistency`" in text
  for png in ("curves.png", "effects.png"):
    assert os.path.getsize(os.path.join(sweep_dir, png)) > 1000


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=needs_flax) if n == "flax_nnx" else n for n in NAMES])
def test_notebook_executes(name, sweep_dir, tmp_path, monkeypatch):
  # Relative to the clone's root, as a user running from there writes them; the kernel
  # runs in notebooks/ and new_idea's sweep in a scratch copy.
  monkeypatch.setenv("PHOENIX_SWEEP_DIR", os.path.relpath(sweep_dir, ROOT))
  monkeypatch.setenv("PHOENIX_NEW_IDEA_DIR", os.path.relpath(tmp_path / "no_rope", ROOT))
  monkeypatch.setenv("PHOENIX_PRESET", "smoke")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)
  NotebookClient(nb, timeout=900, kernel_name="python3",
                 resources={"metadata": {"path": NOTEBOOKS}}).execute()
  text = "\n".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for out in cell.outputs)
  if name == "flax_nnx":
    for claim in ("same arrays: True | same config: True",
                  "restored model == trained model: True",
                  "restored optimizer == optimizer: True", "| equal: True",
                  "same logits through Equinox and NNX: True"):
      assert claim in text, claim
  if name == "compare_variants":   # every curve the ablation declares was drawn
    assert "panel stays empty" not in text and "no curves" not in text, text
  if name == "inside_phoenix":
    assert "isolated  slot 0: max |logit change| when the companions change = 0" in text
    assert "identity: True" in text
  if name == "new_idea":
    with open(tmp_path / "no_rope" / "results.json") as f:
      results = json.load(f)
    assert set(results["variants"]) == {"rope", "no_rope"}
    assert ("right_anchored_rope=True is invalid: needs model.rope=True" in text), text[-3000:]
    slot = results["variants"]["no_rope"]["metrics"]["slot_sensitivity"]["per_seed"]
    assert max(slot) < 1e-5
    # The scratch copy is no checkout: its runs record the version the notebook gives.
    code = results["environment"]["code"]
    assert code.endswith("+notebooks/new_idea.ipynb")
    assert results["environment"]["run_codes"] == {code: 4}
    # Its last cell prints the edits as a patch that applies to this checkout, or says that
    # the checkout holds them already (a user kept the idea as the notebook says).
    patch = "".join(out.get("text", "") for out in nb.cells[-1].outputs)
    if os.path.exists(os.path.join(ROOT, "ablations", "no_rope.py")):
      assert patch.startswith(("your checkout already holds these edits", "--- a/")), patch
      return
    assert "--- /dev/null\n+++ b/ablations/no_rope.py" in patch
    # Saved whole, the printed patch with it; the config edits document and check the field.
    saved = (tmp_path / "no_rope" / "no_rope.patch").read_text()
    assert saved in patch and f"git apply {tmp_path / 'no_rope' / 'no_rope.patch'}" in patch
    assert "+    rope: rotary positions on queries and keys" in saved
    assert "+    if self.right_anchored_rope and not self.model.rope:" in saved
    assert "+if not __package__:  # run by path" in saved   # as every script in ablations/
    if os.path.isdir(os.path.join(ROOT, ".git")):
      proc = subprocess.run(["git", "apply", "--check", "-"], input=saved, cwd=ROOT,
                            text=True, capture_output=True)
      assert proc.returncode == 0, proc.stderr


def test_compare_variants_reads_a_results_file_without_its_runs(tmp_path, monkeypatch):
  """docs/results keeps results.json and the report, not the runs: the notebook shows the
  verdict, tables and effects, and says the curves need the run directories."""
  with open(os.path.join(ROOT, "docs", "results", "candidate_isolation", "results.json")) as f:
    results = json.load(f)
  del results["interactions"]   # as a results.json from before reports held them
  (tmp_path / "results.json").write_text(json.dumps(results))
  monkeypatch.setenv("PHOENIX_SWEEP_DIR", str(tmp_path))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.read(os.path.join(NOTEBOOKS, "compare_variants.ipynb"), as_version=4)
  NotebookClient(nb, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": NOTEBOOKS}}).execute()
  text = "\n".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for out in cell.outputs)
  assert "holds no run directories (a copy of results.json only): no curves" in text
  assert "candidate_isolation (cpu preset)" in text
  shown = "\n".join(out.get("data", {}).get("text/markdown", "") for cell in nb.cells
                    if cell.cell_type == "code" for out in cell.outputs)
  assert "| ΔΔ `score_consistency` | corr0.5 − corr0 |\n| --- | --- |\n| causal | +0.226 (p " \
      in shown
