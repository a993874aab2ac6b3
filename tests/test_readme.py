"""The README's usage examples (and its snippet that loads a trained run) and the
quickstart demo run as written, and its Performance table reads the committed benchmark
JSON; the links, section names and command flags of README.md and docs/*.md exist."""

import ast
import contextlib
import dataclasses
import io
import json
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import ablations
from conftest import needs_flax, subprocess_env, table_cells
from phoenix_flax import haiku_compat

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _lines(page: pathlib.Path):
  """Each line of a Markdown page (newline kept) and whether it is a heading: a `#` line
  inside a fenced code block is code, not a heading."""
  fenced = False
  for line in page.read_text(encoding="utf-8").splitlines(keepends=True):
    fenced = fenced != line.startswith("```")
    yield line, not fenced and re.match(r"#+ ", line) is not None


def _section(title: str, page: str = "README.md") -> str:
  """The text of `page` (the README unless named) under the heading `title`, up to the
  next heading of any level."""
  lines, found = [], False
  for line, heading in _lines(ROOT / page):
    if found and heading:
      break
    if found:
      lines.append(line)
    found = found or (heading and line.rstrip("\n") == title)
  assert found, f"{page} has no {title!r} section"
  return "".join(lines)


def usage_blocks() -> list[str]:
  """The ```python blocks of the README's "## Usage" section (before its subsections),
  in order."""
  blocks = re.findall(r"```python\n(.*?)```", _section("## Usage"), re.S)
  assert len(blocks) == 2, "the Usage section should show ranking, then retrieval"
  return blocks


def test_readme_usage_runs_as_written():
  """Ranking, then retrieval (which reuses the first block's names), as a reader runs them."""
  namespace = {"__name__": "readme_usage"}
  for i, (block, last) in enumerate(zip(usage_blocks(), ["(2, 8)", "(2, 10)"])):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
      exec(compile(block, f"README.md:Usage[{i}]", "exec"), namespace)
    assert stdout.getvalue().strip().splitlines()[-1] == last, stdout.getvalue()


@needs_flax
def test_readme_flax_nnx_example_runs_as_written(tmp_path, monkeypatch):
  """The Flax NNX section's example: train a step with nnx.Optimizer, save and restore with
  orbax, score with the Equinox runner."""
  block, = re.findall(r"```python\n(.*?)```", _section("## Flax NNX"), re.S)
  monkeypatch.setenv("TMPDIR", str(tmp_path))
  monkeypatch.setattr("tempfile.tempdir", None)
  stdout = io.StringIO()
  # Under the default dtype promotion, not the session's strict one: the example's own
  # `optax.adamw` raises a Python float to its int32 step count, which "strict" refuses
  # (phoenix_flax's optimizers run their optax arithmetic under the standard promotion).
  with contextlib.redirect_stdout(stdout), jax.numpy_dtype_promotion("standard"):
    exec(compile(block, "README.md:Flax NNX", "exec"), {"__name__": "readme_nnx"})
  loss, shape = stdout.getvalue().strip().splitlines()
  assert 0.0 < float(loss) < 2.0 and shape == "(4, 4)", stdout.getvalue()


def test_links_in_the_readme_and_docs_resolve():
  """Every relative link of README.md and docs/*.md, and every repository path it names in
  backquotes, points at a file or directory of the checkout."""
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
  assert len(pages) >= 5, pages
  for page in pages:
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)", text):
      if not re.match(r"[a-z]+://", target):
        assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links {target}"
    for named in re.findall(r"`((?:phoenix_flax|experiments|ablations|tests|notebooks|docs)"
                            r"/[\w./]*\w/?)`", text):
      assert (ROOT / named).exists(), f"{page.relative_to(ROOT)} names {named}"


def _headings(page: pathlib.Path) -> set[str]:
  """The heading texts of a Markdown page."""
  return {line.lstrip("#").strip() for line, heading in _lines(page) if heading}


def test_sections_named_beside_a_page_exist():
  """A reference to a section of another page, `[page](page.md), "Section"`,
  `docs/page.md, "Section"` or `"Section" in [page](page.md)` (README: `README,
  "Section"`), names a heading that page has, so renaming a section cannot leave the
  pages pointing at nothing."""
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
  page_ref = r"(?:\]\(([\w./-]+\.md)\)|\b((?:[\w]+/)*[\w]+\.md|README)\b)"
  checked = 0
  for page in pages:
    text = re.sub(r"\s*\n\s*", " ", page.read_text(encoding="utf-8"))
    refs = [(m.group(1) or m.group(2), m.group(3))
            for m in re.finditer(page_ref + r",? \"([^\"]+)\"", text)]
    refs += [(m.group(2) or m.group(3), m.group(1))
             for m in re.finditer(r"\"([^\"]+)\" in \[?" + page_ref, text)]
    for target, section in refs:
      path = next((p for p in (ROOT / "README.md" if target == "README" else None,
                               page.parent / target, ROOT / target, ROOT / "docs" / target)
                   if p is not None and p.is_file()), None)
      where = f"{page.relative_to(ROOT)} names {target}, \"{section}\""
      assert path is not None, where + ", a page that does not exist"
      assert section in _headings(path), where + ", a section that page does not have"
      checked += 1
  assert checked >= 20, checked


_ABSL_FLAGS = {"help", "helpfull", "helpshort", "helpxml", "flagfile", "undefok", "verbosity",
               "logtostderr", "alsologtostderr", "log_dir", "only_check_args"}


def _documented_commands() -> list[tuple[str, str]]:
  """Every `python -m experiments.<m>` / `ablations.<m>` command of README.md and
  docs/*.md, as (page, command): the lines of code blocks, and backquoted spans of the
  prose (which may wrap)."""
  found = []
  for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
    text = page.read_text(encoding="utf-8")
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    prose = re.sub(r"\s*\n\s*", " ", re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S))
    for part in [line for block in blocks for line in block.splitlines()] + re.findall(
        r"`([^`]+)`", prose):
      found += [(page.name, command) for command in re.findall(
          r"python -m ((?:experiments|ablations)\.(?:\w+|<name>)(?:(?! \| | && |;)[^`])*)",
          part)]
  return found


def test_documented_commands_use_flags_their_module_defines():
  """Each flag of a documented `python -m experiments.<m>` or `ablations.<m>` command
  (`--config.<path>` overrides aside) is defined by that module or by a module of this
  repository it imports (`ablations/sweep.py` for the ablation scripts), so a renamed or
  removed flag cannot stay in the docs."""
  commands = _documented_commands()
  assert len(commands) >= 30, commands
  for page, command in commands:
    module, *args = command.split()
    path = ROOT / (module.replace(".", "/") + ".py")
    if "<" in module:
      path = ROOT / "ablations" / "sweep.py"
    assert path.is_file(), f"{page}: `python -m {module}`: no {path.relative_to(ROOT)}"
    source = path.read_text(encoding="utf-8")
    for local in re.findall(r"^from ((?:experiments|ablations)[\w.]*) import ([\w, ]+)",
                            source, re.M):
      for name in [local[0].replace(".", "/")] + [
          f"{local[0]}/{n.strip()}".replace(".", "/") for n in local[1].split(",")]:
        if (ROOT / f"{name}.py").is_file():
          source += (ROOT / f"{name}.py").read_text(encoding="utf-8")
    defined = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", source)) | _ABSL_FLAGS
    for flag in re.findall(r"(?<![\w-])--(\w+)(?![.\w])", " ".join(args)):
      assert flag in defined or (flag.startswith("no") and flag[2:] in defined), (
          f"{page}: `python -m {module}` is given --{flag}, which it does not define")


def test_loading_a_trained_run_works_as_written(tmp_path, monkeypatch):
  """The Training section's snippet, on the smoke run its commands train into runs/smoke."""
  section = _section("## Training on the synthetic world")
  block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  assert 'load_run("runs/smoke")' in block
  result = subprocess.run([sys.executable, "-m", "experiments.run", "--quiet",
                           "--config=experiments/configs/ranking.py:smoke",
                           f"--workdir={tmp_path / 'runs' / 'smoke'}"],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  monkeypatch.chdir(tmp_path)
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    exec(compile(block, "README.md:Training", "exec"), {"__name__": "readme_training"})
  steps = json.loads((tmp_path / "runs" / "smoke" / "result.json").read_text())["steps"]
  assert stdout.getvalue().split() == [str(steps), "(4,", "4)"], stdout.getvalue()


def test_serving_a_trained_retriever_works_as_written(tmp_path, monkeypatch):
  """docs/training.md's retrieval snippet, on the smoke run the text says trains into
  runs/retrieval_smoke."""
  text = (ROOT / "docs" / "training.md").read_text("utf-8")
  section = text[text.index("### Serving a trained retriever"):]
  block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  assert 'load_run("runs/retrieval_smoke")' in block
  command = re.search(r"`(python -m experiments\.run\s+--config=\S+\s+--workdir=\S+)`",
                      section).group(1).split()
  assert command[-1] == "--workdir=runs/retrieval_smoke"
  command[-1] = f"--workdir={tmp_path / 'runs' / 'retrieval_smoke'}"
  result = subprocess.run([sys.executable, *command[1:], "--quiet"], cwd=ROOT,
                          env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  monkeypatch.chdir(tmp_path)
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    exec(compile(block, "docs/training.md:Serving", "exec"), {"__name__": "docs_serving"})
  assert stdout.getvalue().split() == ["(4,", "10)", "False"], stdout.getvalue()


def test_every_switch_and_ablation_is_listed():
  """Step 5 of adding an idea: a config field that export refuses away from its default
  (what every new switch is until it joins `haiku_compat._FREE_FIELDS`) has a row in the
  Switches table, and every script of `ablations.SCRIPTS` is in the Ablations list."""
  rows = set(re.findall(r"^\| `(\w+)` \|", _section("### Switches"), re.M))
  for cls, free in haiku_compat._FREE_FIELDS.items():
    for field in dataclasses.fields(cls):
      assert field.name in free or field.name in rows, (
          f"{cls.__name__}.{field.name} has no row in the README's switch table")
  listed = _section("## Ablations").split("\n\n")[1]
  for name in ablations.SCRIPTS:
    assert f"`{name}`" in listed, f"ablation {name} is missing from the README's list"


def test_adding_an_idea_names_tests_that_exist():
  """The test files and test functions that "Adding an idea" and docs/ideas.md tell a
  reader to run or extend are there."""
  section = _section("### Adding an idea") + (ROOT / "docs" / "ideas.md").read_text("utf-8")
  named = re.findall(r"(tests/\w+\.py)(?:::(\w+))?", section)
  assert len(named) >= 6, named
  for path, function in named:
    assert (ROOT / path).is_file(), f"README names {path}, which does not exist"
    if function:
      text = (ROOT / path).read_text(encoding="utf-8")
      assert re.search(rf"^def {function}\(", text, re.M), f"{path} has no {function}"
  tests = "".join(p.read_text("utf-8") for p in (ROOT / "tests").glob("test_*.py"))
  for name in set(re.findall(r"`(test_\w+)`", section)):   # named without their file
    assert re.search(rf"^def {name}\(", tests, re.M), f"no test is named {name}"


def test_quickstart_runs():
  result = subprocess.run([sys.executable, "-m", "experiments.quickstart"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  assert "Top 8 candidates of user 0" in result.stdout
  assert "user 1:" in result.stdout
  diff = float(re.search(r"all at once = (\S+)", result.stdout).group(1))
  assert diff <= 1e-5


def test_quickstart_refuses_arguments(capsys):
  """It has no flags: a typo, or --help, ran the whole demo."""
  from experiments import quickstart
  with pytest.raises(SystemExit) as exit:
    quickstart.main(["quickstart", "--help"])
  assert exit.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: experiments.quickstart takes no arguments, got ['--help']")
  assert "python -m experiments.quickstart" in err


def test_quickstart_prints_the_chunked_scores_difference(monkeypatch):
  """The printed difference is chunked against one-call scores: an error planted in one
  chunked probability shows up as that error."""
  from experiments import quickstart
  from phoenix_flax.inference import RankingRunner

  rank_chunked, rank = RankingRunner.rank_chunked, RankingRunner.rank
  chunk_sizes, ranked = [], []
  def planted(self, *args, **kwargs):
    chunk_sizes.append(kwargs.get("chunk_size"))
    out = rank_chunked(self, *args, **kwargs)
    return out._replace(scores=out.scores.at[1, 5, 2].add(-0.25))   # |difference|
  def recorded(self, *args, **kwargs):
    ranked.append(rank(self, *args, **kwargs))
    return ranked[-1]
  monkeypatch.setattr(RankingRunner, "rank_chunked", planted)
  monkeypatch.setattr(RankingRunner, "rank", recorded)
  with contextlib.redirect_stdout(io.StringIO()) as stdout:
    quickstart.rank_demo()
  diff = float(re.search(r"all at once = (\S+)", stdout.getvalue()).group(1))
  assert abs(diff - 0.25) <= 1e-3, stdout.getvalue()
  assert chunk_sizes == [8] and "in chunks of 8:" in stdout.getvalue()   # as it says
  # The illustrative weights count every negative action against a candidate.
  from phoenix_flax.inference import NEGATIVE_ACTIONS
  negative = [a for a in NEGATIVE_ACTIONS if a in quickstart.WEIGHTS]
  assert negative and all(quickstart.WEIGHTS[a] < 0 for a in negative)
  assert all(w > 0 for a, w in quickstart.WEIGHTS.items() if a not in NEGATIVE_ACTIONS)
  # Each row of the table names its candidate and that candidate's post.
  from phoenix_flax.config import PhoenixModelConfig
  from phoenix_flax.example import example_batch
  config = PhoenixModelConfig(model=quickstart.TRANSFORMER, emb_size=64, history_seq_len=16,
                              candidate_seq_len=32, right_anchored_rope=True)
  post_hashes = np.asarray(example_batch(config, 2, jax.random.key(1))[0].candidate_post_hashes)
  rows = [tuple(map(int, m)) for m in re.findall(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+0\.",
                                                 stdout.getvalue(), re.M)]
  assert [rank for rank, _, _ in rows] == list(range(1, 9))
  # User 0's eight best candidates by p(favorite), best first.
  (output,) = ranked
  assert [c for _, c, _ in rows] == np.asarray(output.ranked_indices[0, :8]).tolist()
  favorite = np.asarray(output.action("favorite_score"))[0]
  assert [c for _, c, _ in rows] == np.argsort(-favorite, kind="stable")[:8].tolist()
  for _, c, post in rows:
    assert post == post_hashes[0, c, 0], (c, post)
  # ... and user 0's probabilities and weighted score, to the 4 decimals printed.
  from phoenix_flax.inference import weighted_score
  weighted = np.asarray(weighted_score(output.scores, quickstart.WEIGHTS))[0]
  shown = np.stack([np.asarray(output.action(a))[0] for a in quickstart.SHOWN_ACTIONS], -1)
  values = [list(map(float, m.split())) for m in re.findall(
      r"^\s*\d+\s+\d+\s+\d+((?:\s+-?\d+\.\d{4}){5})\s*$", stdout.getvalue(), re.M)]
  assert len(values) == 8
  for (_, c, _), row in zip(rows, values):
    np.testing.assert_allclose(row, [*shown[c], weighted[c]], atol=6e-5, err_msg=str(c))


# Import name -> the distribution that provides it, for every third-party import we use.
DISTRIBUTIONS = {"jax": "jax", "jaxlib": "jax", "equinox": "equinox", "jaxtyping": "jaxtyping",
                 "optax": "optax", "chex": "chex", "absl": "absl-py",
                 "ml_collections": "ml_collections", "numpy": "numpy",
                 "tensorboardX": "tensorboardX", "matplotlib": "matplotlib",
                 "tensorboard": "tensorboard", "flax": "flax",
                 "orbax": "orbax-checkpoint", "haiku": "dm-haiku", "nbclient": "nbclient",
                 "nbformat": "nbformat", "pytest": "pytest"}
LOCAL = {"phoenix_flax", "ablations", "experiments", "tests"}


def _setup_keywords() -> dict:
  """setup.py's `install_requires` and `extras_require`, as written."""
  tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
  call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
              and getattr(n.func, "id", "") == "setup")
  return {k.arg: ast.literal_eval(k.value) for k in call.keywords
          if k.arg in ("install_requires", "extras_require")}


def _setup_requirements() -> dict[str, set[str]]:
  """{"": install_requires, extra: its packages} from setup.py, as distribution names."""
  kw = _setup_keywords()
  name = lambda req: re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0]
  out = {"": {name(r) for r in kw["install_requires"]}}
  out.update({extra: {name(r) for r in reqs} for extra, reqs in kw["extras_require"].items()})
  return out


def _third_party_imports(paths) -> dict[str, set[str]]:
  """{top-level module: files importing it} over `paths`, stdlib and local code left out."""
  found: dict[str, set[str]] = {}
  for path in paths:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
      for n in names:
        top = n.split(".")[0]
        if top not in sys.stdlib_module_names and top not in LOCAL:
          found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
  return found


def test_the_floors_command_installs_the_floors_of_setup_py():
  """docs/testing.md's "The floors" pins every floor of `install_requires` and `[test]`
  (flax and orbax-checkpoint aside: flax's own floor needs a newer jax) at that floor, so
  the versions its run tested are the ones setup.py declares."""
  block, = re.findall(r"```bash\n(.*?)```", _section("## The floors", "docs/testing.md"),
                      re.S)
  pins = dict(re.findall(r'"([A-Za-z0-9_.-]+)==([0-9.]+)"', block))
  kw = _setup_keywords()
  floors = dict(re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", req).groups()
                for req in kw["install_requires"] + kw["extras_require"]["test"])
  left_out = {"flax", "orbax-checkpoint"}
  assert left_out <= set(floors) and pins.pop("jaxlib") == pins["jax"], pins
  assert set(pins) == set(floors) - left_out, (sorted(pins), sorted(floors))
  release = lambda v: tuple(int(x) for x in v.split("."))
  for name, floor in floors.items():   # absl-py>=2.1 is pinned at 2.1.0, the one tested
    if name not in left_out:
      assert release(pins[name])[:len(release(floor))] == release(floor), (name, pins[name])


def test_quick_start_install_covers_the_main_job_imports():
  """The first Quick start command installs `pip install -e ".[extras]"`; everything the
  package, experiments/ and ablations/ import (phoenix_flax.flax_nnx aside: its own
  `[flax]` extra, with an ImportError naming it) must come with that install."""
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
  main_cmd = re.findall(r"```(?:bash)?\n(.*?)```", section, re.S)[0]
  install = re.search(r"pip install -e (\S+)", main_cmd).group(1).strip("\"'")
  extras = re.search(r"\[(.*)\]", install)
  reqs = _setup_requirements()
  allowed = set(reqs[""])
  for extra in (extras.group(1).split(",") if extras else []):
    allowed |= reqs[extra.strip()]
  files = [p for d in ("phoenix_flax", "experiments", "ablations")
           for p in (ROOT / d).rglob("*.py") if p.name != "flax_nnx.py"]
  missing = {mod: sorted(where) for mod, where in _third_party_imports(files).items()
             if DISTRIBUTIONS.get(mod) not in allowed}
  assert not missing, (f"imported but not installed by `pip install -e {install}`: "
                       f"{missing}")


def _shown(cell: str) -> tuple[float, int]:
  """A table cell's leading number ("12,765", "1.16×", "32%", "145 (456)") and its
  count of decimals."""
  text = re.sub(r"[,×%]", "", cell.split("(")[0].strip())
  return float(text), len(text.split(".")[1]) if "." in text else 0


def _benchmark_tables(section: str, kind: str = "benchmark", header: str = "| config |"
                      ) -> list[tuple[str, list[list[str]]]]:
  """The tables of a README section that start with `header` (the forward tables), each
  with the committed JSON (`docs/results/<kind>_*.json`) that the text before it last
  links: [(json, rows)]."""
  tables, source, rows = [], None, None
  for line in section.splitlines():
    links = re.findall(rf"\((docs/results/{kind}_[\w]+\.json)\)", line)
    if links:
      source = links[-1]
    if line.startswith(header):
      rows = []
      tables.append((source, rows))
    elif line.startswith("| ") and rows is not None:
      rows.append(table_cells(line))
    elif not line.startswith("|"):
      rows = None
  return tables


def test_the_training_table_matches_the_committed_json():
  """Each cell of the README's training-throughput table reads the run it links
  (`docs/results/train_throughput_cpu_*.json`): examples/s of the three loops and the
  ratios, per preset and seed count."""
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  section = readme.split("\n### Training throughput\n", 1)[1].split("\n## ", 1)[0]
  [(source, rows)] = _benchmark_tables(section, "train_throughput", "| preset |")
  runs = {(r["preset"], r["num_seeds"]): r
          for r in json.loads((ROOT / source).read_text())["training"]}
  rows = [row for row in rows if row[0] != "---"]
  assert len(rows) == len(runs), source
  for name, scanned, plain, ratio, device, device_ratio in rows:
    r = runs[(re.match(r"\w+", name).group(), 3 if "3 vmapped" in name else 1)]
    for cell, value in ((scanned, r["scanned_examples_per_second"]),
                        (plain, r["plain_examples_per_second"]), (ratio, r["speedup"]),
                        (device, r["plain_device_sampled_examples_per_second"]),
                        (device_ratio, r["speedup_vs_device_sampled"])):
      shown, digits = _shown(cell)
      assert shown == round(value, digits), (source, name, cell, value)


def test_performance_tables_match_the_committed_benchmark_json():
  """Every cell of each forward table in the README's Performance section reads the
  figures of the benchmark JSON that the text before it links (docs/results/
  benchmark_cpu.json, benchmark_cpu_avx2.json: times, ratios, candidates/s, compile
  seconds, peak MiB, GFLOP/s, MFU), so a table cannot drift from the run it cites. (The
  prose around them is not parsed.)"""
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  section = readme.split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
  tables = _benchmark_tables(section)
  assert [source for source, _ in tables] == ["docs/results/benchmark_cpu.json",
                                              "docs/results/benchmark_cpu_avx2.json"]
  for source, rows in tables:
    report = json.loads((ROOT / source).read_text())
    rows = [row for row in rows if row[0] != "---"]
    assert sorted(row[0].split()[0] for row in rows) == sorted(report["configs"]), source
    for name, fast, dense, ratio, flops, cand, compile_s, peak, gflops, mfu in rows:
      r = report["configs"][name.split()[0]]
      (compile_fast, compile_dense), (peak_fast, peak_dense) = (
          compile_s.split("/"), peak.split("/"))
      for cell, value in ((compile_fast, r["fast"]["compile_s"]),
                          (compile_dense, r["reference"]["compile_s"]),
                          (peak_fast, r["fast"]["peak_bytes"] / 2 ** 20),
                          (peak_dense, r["reference"]["peak_bytes"] / 2 ** 20),
                          (fast, 1e3 * r["fast"]["median_s"]),
                          (dense, 1e3 * r["reference"]["median_s"]),
                          (ratio, r["speedup"]), (flops, r["flop_ratio"]),
                          (cand, r["candidates_per_s"]), (gflops, r["achieved_gflops"]),
                          (gflops.split("(")[1].rstrip(")"), r["matmul_gflops"]),
                          (mfu, 100 * r["mfu"])):
        shown, digits = _shown(cell)
        assert shown == round(value, digits), (source, name, cell, value)
