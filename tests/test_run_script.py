"""experiments/run.py: flags, help, and clean failures before any work."""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import FRESH_ENV, REPO, ForkServer, run_forked, subprocess_env
from experiments import cli
from experiments.configs import ranking, retrieval
from phoenix_flax.training import parse_config


@pytest.mark.parametrize("module", [ranking, retrieval])
@pytest.mark.parametrize("preset", ["cpu", "smoke", "full"])
def test_every_preset_is_valid(module, preset):
  spec = parse_config(module.get_config(preset))
  assert spec.task == module.__name__.rsplit(".", 1)[-1]
  if spec.task == "ranking":   # no ranking metric is 1.0 by construction (K < list size)
    assert max(spec.config.ranking.top_k) < spec.world.num_candidates
  else:   # an ablation that names recall@10 or recall@100 runs at every preset
    assert {10, 100} <= set(spec.config.retrieval.recall_k)


def test_bad_flags_and_configs_exit_2_before_any_work(tmp_path):
  """... of experiments.run, and of experiments.train_throughput's --config and --out."""
  workdir = tmp_path / "never"
  cases = [
      (["--config.model.num_kv_heads=3"], "num_kv_heads"),
      (["--config.train.steps_per_call=7"], "config.train.steps_per_call"),
      (["--config.model.no_such_field=1"], "no_such_field"),
      (["--config=experiments/configs/nope.py"],   # the cause alone, not the loader's text
       "error: --config could not be loaded: [Errno 2] No such file or directory: "
       "'experiments/configs/nope.py'\n"),
      ([f"--config={tmp_path}"],                 # a folder: the cause, not the loader's words
       f"error: --config could not be loaded: [Errno 21] Is a directory: '{tmp_path}'\n"),
      (["--config.model.num_layer=2"],          # the suggestion, unescaped, on its own line
       ": --config.model.num_layer\n  'num_layer'\n  Did you mean \"num_layers\" instead of "
       "\"num_layer\"?\n"),
      (["--config.retrieval.top_k=7"],          # a field of another section
       ": --config.retrieval.top_k\n  'top_k'\n  A field of that name is at: ranking.top_k\n"),
      (["--config.model.num_layers=abc"],       # --helpfull lists no config field
       "'abc'\nThe schema is in phoenix_flax/training/schema.py\n"),
      (["--config.optim.learning_rate=fast"], "learning_rate"),
      (["--config.extra_eval_splits.foo.min_history=2"],   # splits come from the file
       "'foo'\n  An extra evaluation split is defined in the config file"),
      (["--config.mesh.num_devices=64"], "mesh.num_devices"),
      (["--no_such_flag"], "no_such_flag"),
      # checked before jax.distributed.initialize, which would wait for a coordinator
      (["--config.mesh.distributed=True", "--config.world.history_len=0"], "history_len"),
      (["--config.mesh.distributed=True", "--config.mesh.num_processes=2",
        "--config.mesh.process_id=2"], "mesh.process_id"),
      # settings that would otherwise be ignored, and a setting that could lose progress
      (["--config.mesh.shard_hash_tables=True"], "mesh.shard_hash_tables=True is invalid"),
      (["--config.mesh.num_processes=2"], "only with mesh.distributed=True"),
      (["--config.num_seeds=2", "--config.output.keep_checkpoints=1"],
       "output.keep_checkpoints=1 is invalid"),
      (["--config.mesh.distributed=True"], "Set config.mesh.coordinator_address"),
      (["positional"], "unexpected arguments ['positional']"),
      # below a value: "string indices must be integers", which named no flag
      (["--config.task.foo=1"], "--config.task.foo: config.task holds a value, not a section"),
  ]
  cases = [(["--config=experiments/configs/ranking.py:smoke", f"--workdir={workdir}", *extra],
            needle) for extra, needle in cases]
  cases += [([f"--workdir={workdir}"], "--config is required"),
            ([f"--workdir={workdir}", "--config.model.num_layers=2"],
             "--config is required: the overrides ['--config.model.num_layers=2']"),
            (["--config=experiments/configs/ranking.py:smoke", f"--workdir={workdir}",
              "--config.model.dwell_time_norm=30.0"],
             "'dwell_time_norm' is a field of PhoenixModelConfig that the experiment config "
             "does not expose: the synthetic world's dwell times are its binary dwell action"),
            # `--config PATH` as two words is given too: its overrides apply
            (["--config", "experiments/configs/ranking.py:smoke", f"--workdir={workdir}",
              "--config.model.num_kv_heads=3"], "TransformerConfig.num_kv_heads=3 is invalid"),
            # the config file's own error, without the traceback around it
            (["--config=experiments/configs/ranking.py:nopreset", f"--workdir={workdir}"],
             "unknown preset 'nopreset'")]
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  cases += [(["--config=experiments/configs/ranking.py:smoke", f"--workdir={a_file}/run"],
             f"{a_file} is a file, not a directory")]
  # Workdirs that can never be a directory, and a seed's run directory that is a file.
  (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
  (tmp_path / "seeds").mkdir()
  (tmp_path / "seeds" / "seed_1").write_text("")
  smoke = "--config=experiments/configs/ranking.py:smoke"
  cases += [([smoke, f"--workdir={tmp_path}/dangling/run"],
             f"{tmp_path}/dangling is a link to {tmp_path}/nowhere, which does not exist"),
            ([smoke, f"--workdir={tmp_path}/{'a' * 300}"], "cannot be created (File name too "
                                                           "long)"),
            ([smoke, "--workdir= "], "--workdir is required"),
            ([smoke, "--config.num_seeds=2", f"--workdir={tmp_path}/seeds"],
             f"{tmp_path}/seeds/seed_1, seed 1's run directory, is a file")]
  # Broken config files: a syntax error, a dict instead of a ConfigDict, a misspelled key
  # (which no command-line lock catches), another task's setting.
  configs = {"syntax": "def get_config(:\n", "no_get_config": "x = 1\n",
             "plain_dict": "def get_config():\n  return {'task': 'ranking'}\n",
             "typo": "from experiments.configs import ranking\ndef get_config():\n"
                     "  c = ranking.get_config('smoke')\n  c.train.num_stepz = 7\n  return c\n",
             # a lookup the file's own code gets wrong is its error, not an override's
             "section_typo": "from experiments.configs import ranking\ndef get_config():\n"
                             "  c = ranking.get_config('smoke')\n  c.trian.num_steps = 7\n"
                             "  return c\n",
             "returns_none": "def get_config():\n  c = None\n"}
  for name, text in configs.items():
    (tmp_path / f"{name}.py").write_text(text)
  cases += [([f"--config={tmp_path}/syntax.py", f"--workdir={workdir}"],
             f"--config could not be loaded: {tmp_path}/syntax.py, line 1: invalid syntax"),
            ([f"--config={tmp_path}/plain_dict.py", f"--workdir={workdir}"],
             "must return an ml_collections.ConfigDict, got dict"),
            ([f"--config={tmp_path}/no_get_config.py", f"--workdir={workdir}"],
             "--config could not be loaded: the file defines no get_config()"),
            ([f"--config={tmp_path}/section_typo.py", f"--workdir={workdir}"],
             "--config could not be loaded (AttributeError in its get_config(): 'trian' Did "
             "you mean \"train\""),
            ([f"--config={tmp_path}/returns_none.py", f"--workdir={workdir}"],
             "--config's get_config() returned None"),
            # a folder where nothing can be written, whoever runs the test
            (["--config=experiments/configs/ranking.py:smoke", "--workdir=/proc/pf_test/run"],
             "workdir '/proc/pf_test/run' cannot be written"),
            ([f"--config={tmp_path}/typo.py", f"--workdir={workdir}"],
             "config has no field(s) 'train.num_stepz' (did you mean train.num_steps?)"),
            (["--config=experiments/configs/ranking.py:smoke", f"--workdir={workdir}",
              "--config.retrieval.temperature=0.5"],
             "config.retrieval.temperature=0.5 is invalid: only retrieval runs read it")]
  cases.append((["--config=experiments/configs/ranking.py:smoke"], "--workdir is required"))
  # experiments.train_throughput reads its --config the same way, and checks --out.
  throughput = [
      ([smoke, "--config.model.num_layer=2"],
       "Did you mean \"num_layers\" instead of \"num_layer\"?"),
      ([smoke, "--config.model.num_layers=0"], "TransformerConfig.num_layers=0 is invalid"),
      ([smoke, "--out=/proc/pf_test.json"], "--out=/proc/pf_test.json cannot be written"),
      # a training state too large for the host, refused before anything compiles
      ([smoke, "--config.num_seeds=10000000"], "training state (parameters, AdamW moments "
                                               "and the synthetic world) needs at least"),
      (["--config=experiments/configs/nope.py"],
       "--config could not be loaded: [Errno 2] No such file or directory"),
      # Its --config has a default (ranking.py), which overrides alone apply to.
      (["--config.model.num_layers=0"], "TransformerConfig.num_layers=0 is invalid"),
      # Its loops run on one device: a mesh would be ignored, so it is refused.
      ([smoke, "--config.mesh.num_devices=-1"],
       "the throughput comparison runs every loop on one device"),
      ([smoke, "--config.mesh.distributed=True"],   # which parse_config accepts
       "the throughput comparison runs every loop on one device"),
      ([smoke, "positional"], "unexpected arguments ['positional']; every option is a --flag")]
  with ForkServer(subprocess_env()) as server:
    results = [server.run("experiments.run", args) for args, _ in cases]
    results += [server.run("experiments.train_throughput", args) for args, _ in throughput]
  # A fault in the flags points to --helpfull; one a run meets (its workdir) does not.
  hinted = {"no_such_flag"}
  unhinted = {f"{a_file} is a file, not a directory",
              f"{tmp_path}/seeds/seed_1, seed 1's run directory, is a file"}
  for (code, _, stderr), (args, needle) in zip(results, cases + throughput, strict=True):
    assert code == 2, (args, stderr[-2000:])
    assert needle in stderr, (args, stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-2000:]
    if needle in hinted | unhinted:
      assert ("Run with --helpfull" in stderr) == (needle in hinted), (args, stderr)
  assert not workdir.exists() and not (tmp_path / "nowhere").exists()
  assert os.listdir(tmp_path / "seeds") == ["seed_1"]


def test_a_tilde_in_a_path_flag_is_the_home_directory(tmp_path):
  """`--workdir=~/...` (which the shell leaves alone, unlike `--workdir ~/...`), `--out=~/...`
  and `--config=~/...` name paths under $HOME in every script, never a folder named "~"
  in the current directory."""
  home, cwd = tmp_path / "home", tmp_path / "cwd"
  home.mkdir()
  cwd.mkdir()
  (home / "a_file").write_text("")
  # Where a script took "~" literally it stops at once, with another message, instead of
  # training into ./~ (and the test runs away from the repository).
  (cwd / "~").write_text("")
  shutil.copy(os.path.join(REPO, "experiments", "configs", "ranking.py"), home / "conf.py")
  env = dict(subprocess_env(), HOME=str(home))
  smoke = f"--config={REPO}/experiments/configs/ranking.py:smoke"
  not_a_dir = f"{home}/a_file is a file, not a directory"
  cannot_write = f"cannot be written: {home}/a_file is not a directory"
  cases = {"experiments.run": [([smoke, "--workdir=~/a_file/run"], not_a_dir),
                               (["--config=~/conf.py:smoke", "--print_config"], None)],
           "experiments.own_data": [(["--workdir=~/a_file/run"], not_a_dir)],
           "experiments.benchmark": [(["--out=~/a_file/b.json"], cannot_write)],
           "experiments.train_throughput": [([smoke, "-out=~/a_file/t.json"], cannot_write)]}
  with ForkServer(env, cwd=str(cwd)) as server:
    results = [(server.run(module, argv), needle)
               for module, runs in cases.items() for argv, needle in runs]
  (status, text, stderr), _ = results.pop(1)
  assert status == 0 and "world.history_len = " in text, stderr
  results += [(r, not_a_dir) for r in run_forked(
      "ablations.soft_capping", [["--preset=smoke", "--workdir=~/a_file/s"]], env,
      preload=("ablations.sweep",), cwd=str(cwd))]
  for (status, _, stderr), needle in results:
    assert status == 2 and needle in stderr, stderr
  assert os.listdir(cwd) == ["~"]
  # Only a path flag's value, and only before `--`.
  argv = ["prog", "--override=x=~/a", "--workdir=a~b", "--out", "~/x", "workdir=~/a", "--",
          "--out=~/y"]
  assert cli.expand_home(argv) == argv
  home = os.path.expanduser("~")
  assert cli.expand_home(["~/prog", "--workdir=~/r", "-config=~"]) == [
      "~/prog", f"--workdir={home}/r", f"-config={home}"]


def test_the_run_block_gives_back_the_signal_handlers_it_found():
  """`exit_on_run_errors` installs its own SIGINT and SIGTERM handlers for the block and
  restores the ones it found when the block ends, a caller's own among them."""
  own = lambda signum, frame: None
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  before_term = signal.signal(signal.SIGTERM, own)
  try:
    with cli.exit_on_run_errors():
      assert signal.getsignal(signal.SIGTERM) is not own
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is own
  finally:
    signal.signal(signal.SIGINT, before)
    signal.signal(signal.SIGTERM, before_term)


def test_an_override_below_a_value_is_named_among_good_ones():
  """The override that reaches below a value field is the one named, not a good override
  of a value field given before it."""
  assert cli._below_a_value(["train.num_steps", "model.num_layers"]) is None
  assert cli._below_a_value(["train.num_steps", "task.foo", "world.base_rates.x"]) == (
      "task.foo", "task")


ORPHANED = """
import os, sys, time
sys.path.insert(0, sys.argv[1] + "/tests")
from conftest import ForkServer, subprocess_env
env = subprocess_env()   # keeps the caller's PYTHONPATH, which may hold the packages
server = ForkServer(dict(env, PYTHONPATH=sys.argv[2] + ":" + env["PYTHONPATH"]))
server.submit("sleeper", [])
while not os.path.exists(sys.argv[2] + "/pid"):
  time.sleep(0.01)
print(server._proc.pid, flush=True)
os.kill(os.getpid(), 9)   # no __exit__, no atexit: as when a test process is killed
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks on Linux only")
def test_a_killed_test_process_leaves_no_fork_server_or_run_behind(tmp_path):
  (tmp_path / "sleeper.py").write_text(
      "import os, time\n"
      "open(os.path.join(os.path.dirname(__file__), 'pid.tmp'), 'w').write(str(os.getpid()))\n"
      "os.rename(os.path.join(os.path.dirname(__file__), 'pid.tmp'),\n"
      "          os.path.join(os.path.dirname(__file__), 'pid'))\n"
      "time.sleep(300)\n")
  proc = subprocess.run([sys.executable, "-c", ORPHANED, REPO, str(tmp_path)],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == -9, proc.stderr[-2000:]
  pids = [int(proc.stdout.split()[0]), int((tmp_path / "pid").read_text())]
  deadline = time.monotonic() + 30
  while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not any(_alive(pid) for pid in pids), pids


def _alive(pid: int) -> bool:
  """Whether `pid` runs (a zombie, dead but not yet reaped by init, does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def test_a_forked_run_is_a_fresh_interpreters_run(tmp_path):
  """conftest.ForkServer, which most command-line tests here run through, gives what
  `python -m` in a fresh interpreter gives: exit status, stdout and stderr, for a refused
  override, a printed config and a config file that raises."""
  (tmp_path / "raises.py").write_text("def get_config():\n  raise RuntimeError('boom')\n")
  smoke = "--config=experiments/configs/ranking.py:smoke"
  argvs = [[smoke, f"--workdir={tmp_path / 'run'}", "--config.model.num_kv_heads=3"],
           [smoke, "--config.model.num_layers=3", "--print_config"],
           [f"--config={tmp_path / 'raises.py'}", f"--workdir={tmp_path / 'run'}"]]
  env = subprocess_env()
  forked = run_forked("experiments.run", argvs, env)
  fresh = [subprocess.run([sys.executable, "-m", "experiments.run", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300) for argv in argvs]
  assert forked == [(p.returncode, p.stdout, p.stderr) for p in fresh]
  assert [code for code, _, _ in forked] == [2, 0, 2] and "boom" in forked[2][2]
  # The server's own fresh interpreters (off Linux, or asked for) give the same.
  assert run_forked("experiments.run", argvs[:1], dict(env, **{FRESH_ENV: "1"})) == forked[:1]
  assert not (tmp_path / "run").exists()


def _entry_scripts() -> list[str]:
  """The scripts of experiments/ and ablations/ that run under `if __name__ ==
  "__main__":` and import those folders' packages (which, unlike phoenix_flax, are not
  installed)."""
  found = []
  for folder in ("experiments", "ablations"):
    for name in sorted(os.listdir(os.path.join(REPO, folder))):
      path = os.path.join(folder, name)
      if name.endswith(".py"):
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
          source = f.read()
        if ('if __name__ == "__main__":' in source
            and any(_imports_the_checkout(node) for node in ast.parse(source).body)):
          found.append(path)
  return found


def _imports_the_checkout(node) -> bool:
  names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
           else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
  return any(n.split(".")[0] in ("experiments", "ablations") for n in names)


def test_every_entry_script_runs_by_path_too():
  """`python experiments/run.py` as well as `python -m experiments.run`: each script puts
  the checkout first on sys.path before its first import of it, when run by path (a
  script's own folder would be there instead, where `experiments` cannot be found)."""
  scripts = _entry_scripts()
  assert {"experiments/run.py", "ablations/candidate_isolation.py"} <= set(scripts)
  for path in scripts:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
      body = ast.parse(f.read()).body
    first = next(k for k, node in enumerate(body) if _imports_the_checkout(node))
    assert any(isinstance(node, ast.If) and ast.unparse(node.test) == "not __package__"
               for node in body[:first]), f"{path} cannot be run by path"
  # Run by path from elsewhere, with neither the checkout on PYTHONPATH nor it the cwd.
  outside = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                            if p and os.path.abspath(p) != REPO)
  env = dict(subprocess_env(), PYTHONPATH=outside)
  for path, argv, message in [
      ("experiments/run.py", ["--config.model.num_kv_heads=3"], "num_kv_heads"),
      ("ablations/candidate_isolation.py", ["--preset=bogus"], "flag --preset=bogus")]:
    proc = subprocess.run([sys.executable, os.path.join(REPO, path), *argv], env=env,
                          cwd=os.path.dirname(REPO), capture_output=True, text=True,
                          timeout=300)
    assert (proc.returncode, message in proc.stderr) == (2, True), (path, proc.stderr)


def test_an_unknown_field_is_matched_by_whole_names():
  """The overrides named for a missing key are those with a field of exactly that name:
  `num_layer` is not `num_layers`."""
  message = cli._unknown_field_message("'num_layer'\nDid you mean \"num_layers\"?",
                                       ["model.num_layers", "model.num_layer"])
  assert message.startswith("a --config.* override names a field the config does not "
                            "have: --config.model.num_layer\n"), message
  assert "--config.model.num_layers" not in message


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_print_config_that_cannot_be_written_fails_saying_so():
  """Output that does not arrive (a full disk) is an error with one line, not a traceback
  or a silent success; a reader that stops early (`| head`) is no error."""
  print_config = lambda stdout: subprocess.run(
      [sys.executable, "-m", "experiments.run", "--config=experiments/configs/ranking.py:smoke",
       "--print_config"], cwd=REPO, env=subprocess_env(), stdout=stdout,
      stderr=subprocess.PIPE, text=True, timeout=300)
  with open("/dev/full", "w") as full:
    proc = print_config(full)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert proc.stderr.endswith("error: --print_config could not write the config: [Errno 28] "
                              "No space left on device\n"), proc.stderr[-2000:]
  read_end, write_end = os.pipe()
  os.close(read_end)          # a reader gone before the first line: a broken pipe
  try:
    proc = print_config(write_end)
  finally:
    os.close(write_end)
  assert proc.returncode == 0 and "rror" not in proc.stderr, proc.stderr[-2000:]


def test_print_config_of_a_multi_host_run_starts_no_backend():
  """A multi-host mesh is known once its processes have joined (jax.distributed), which
  needs the backend not started before: --print_config checks such a config without the
  host's devices, where a single-host one is checked against them."""
  code = ("import sys, jax\n"
          "from experiments import run\n"
          "def refuse(*args, **kwargs):\n"
          "  raise SystemExit('the placement was checked: the backend started')\n"
          "run.check_placement = refuse\n"
          "from experiments.cli import parse_config_flags, run_app\n"
          "sys.argv = ['run', '--config=experiments/configs/ranking.py:smoke', *sys.argv[1:],\n"
          "            '--print_config']\n"
          "run_app(run.main, flags_parser=parse_config_flags)\n")
  distributed = ["--config.mesh.distributed=True", "--config.mesh.num_processes=2",
                 "--config.mesh.process_id=0",
                 "--config.mesh.coordinator_address=127.0.0.1:1234"]
  for extra, checked in ((distributed, False), ([], True)):
    proc = subprocess.run([sys.executable, "-c", code, *extra], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    if checked:
      assert proc.returncode != 0 and "the backend started" in proc.stderr, proc.stderr
    else:
      assert proc.returncode == 0, proc.stderr[-2000:]
      assert "mesh.distributed = True" in proc.stdout.splitlines()


def test_helpfull_explains_every_flag():
  [(code, stdout, stderr)] = run_forked("experiments.run", [["--helpfull"]], subprocess_env())
  assert code in (0, 1), stderr  # absl exits 1 after printing help
  for flag, words in (("--config:", "--config.model.num_layers"),
                      ("--workdir:", "resumes"), ("quiet:", "progress line"),
                      ("print_config:", "path = value")):
    assert flag in stdout and words in stdout, flag


def test_print_config_lists_every_field_with_its_value(tmp_path):
  """--print_config checks the config and prints each field as `path = value` (overrides
  applied; every path of the schema), without training or needing --workdir; a bad
  override still exits 2."""
  from phoenix_flax.training.schema import base_config, flatten
  smoke = "--config=experiments/configs/ranking.py:smoke"
  (code, stdout, stderr), *bad = run_forked("experiments.run", [
      [smoke, "--config.model.num_layers=3", "--print_config"],
      [smoke, "--config.model.num_kv_heads=3", "--print_config"],
      # The mesh is checked against this host's devices (the suite's processes see one),
      # and the training state against its memory, on one device too.
      [smoke, "--config.mesh.num_devices=16", "--print_config"],
      [smoke, "--config.world.post_buckets=2000000000", "--print_config"]], subprocess_env())
  assert code == 0, stderr[-2000:]
  printed = dict(line.split(" = ", 1) for line in stdout.splitlines())
  assert printed["model.num_layers"] == "3" and printed["task"] == "'ranking'"
  assert printed["ranking.top_k"] == "(2,)"                      # the smoke preset's
  assert set(printed) == set(flatten(base_config("ranking")))
  for (code, stdout, stderr), field in zip(bad, ("num_kv_heads", "num_devices",
                                                "more than this host's memory"), strict=True):
    assert code == 2 and field in stderr and not stdout, stderr


def test_progress_durations_and_the_summary_metrics():
  """ETA as h:mm:ss ("?" while unknown, never negative); the summary lists the recall
  at each K of a retrieval config next to its Bayes value, a progress line the first; the
  start line says what is about to train. (A subprocess: importing
  experiments.run defines its absl flags.)"""
  code = ("from experiments.configs import ranking, retrieval\n"
          "from experiments.run import _duration, headline_metrics\n"
          "print([_duration(s) for s in (3725.9, 59.0, 36000.0, -3.0, float('nan'))])\n"
          "print(list(headline_metrics(retrieval.get_config('smoke'))))\n"
          "print(list(headline_metrics(ranking.get_config('smoke'))))\n"
          "from experiments.run import progress_keys\n"
          "print([progress_keys(m.get_config('smoke')) for m in (ranking, retrieval)])\n"
          "from experiments.run import start_line\n"
          "c = ranking.get_config('smoke')\n"
          "for seeds, step in (([0], 0), ([1, 2, 3], 20), ([4], 40)):\n"
          "  print(start_line(c, seeds, step))\n"
          "from experiments.run import print_progress\n"
          "from phoenix_flax.training import Progress\n"
          "p = Progress(step=30, num_steps=40, steps_per_second=2.5, eta_seconds=4.0,\n"
          "             loss=(0.51234, 0.6), num_diverged=1, evaluated={\n"
          "                 'eval/auc_mean': (0.7, 0.8), 'eval/bayes_auc_mean': (0.9, 0.91)})\n"
          "print_progress(p, 12)\n"
          "print_progress(p._replace(start_step=20, steps_per_second=2.0, compiling=True,\n"
          "                          num_diverged=0, evaluated={}), 12)\n"
          "print_progress(p._replace(loss=(0.5,), num_diverged=0, evaluated={}), 12)\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  durations, retrieval_keys, ranking_keys, shown, *starts, rate, compiled, one_seed = (
      proc.stdout.splitlines()[-10:])
  assert durations == str(["1:02:05", "0:00:59", "10:00:00", "0:00:00", "?"])
  headline = ["auc_mean", "bayes_auc_mean", "logloss", "auc", "bayes_auc"]
  assert retrieval_keys == str(headline + ["recall@10", "bayes_recall@10",
                                           "popularity_recall@10", "recall@100",
                                           "bayes_recall@100", "popularity_recall@100"])
  assert ranking_keys == str(headline)
  # A progress line shows the mean AUC, and a retrieval run's recall at its first K.
  assert shown == str([("eval/auc_mean",), ("eval/auc_mean", "eval/recall@10")])
  # The line before a run's first chunk (smoke: 40 steps of batch 8, chunks of 10).
  assert starts == [
      "seed 0: starting; 40 steps of batch 8 to go, a progress line every 10; compiling "
      "the training and evaluation programs first",
      "seeds 1, 2, 3 (trained together): resumed from the checkpoint at step 20; 20 steps of "
      "batch 8 to go, a progress line every 10; compiling the training and evaluation "
      "programs first",
      "seed 4: resumed from the checkpoint at step 40, the last; evaluating"]
  # A progress line: 2.5 steps/s of 12 examples for each of the 2 seeds trained (one loss
  # each); the first chunk of a process resumed at step 20 shows the time of its 10 steps
  # at 2 steps/s instead; a call training one seed (the others finished before) counts one.
  assert rate == ("step 30/40 ( 75%) | 2.5 steps/s | 60 ex/s | loss 0.5123 0.6000 | eta "
                  "0:00:04 | diverged 1 | eval/auc_mean 0.7000 0.8000 (bayes 0.9000 0.9100)")
  assert compiled == ("step 30/40 ( 75%) | compiled and ran in 5.0s | loss 0.5123 0.6000 | "
                      "eta 0:00:04")
  assert one_seed == "step 30/40 ( 75%) | 2.5 steps/s | 30 ex/s | loss 0.5000 | eta 0:00:04"


def test_a_signal_exit_skips_the_interpreter_teardown():
  """`cli.run_app` ends a run stopped by a signal (status 130/143) with `os._exit` after
  flushing its output: tearing the interpreter down while XLA's threads were still busy
  ended about half such exits with a segmentation fault. Other exits stay ordinary."""
  script = """
import atexit, sys
from experiments.cli import run_app
atexit.register(lambda: print("teardown ran"))
def main(argv):
  print("unflushed output")
  sys.exit(int(argv[1]))
run_app(main)
"""
  for code, teardown in ((143, False), (130, False), (3, True), (0, True)):
    proc = subprocess.run([sys.executable, "-c", script, str(code)], capture_output=True,
                          text=True, cwd=REPO, env=subprocess_env(), timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "unflushed output" in proc.stdout
    assert ("teardown ran" in proc.stdout) == teardown


@pytest.mark.parametrize("where, signum, status, rest", [
    ("callback", signal.SIGINT, 130, "time.sleep(2)"),
    ("callback", signal.SIGTERM, 143, "time.sleep(2)"),
    ("callback", signal.SIGINT, 130, "pass"),
    ("callback", signal.SIGTERM, 143, "pass"),
    ("__del__", signal.SIGINT, 130, "time.sleep(2)"),
    ("__del__", signal.SIGTERM, 143, "pass")])
def test_a_signal_in_a_gc_callback_or_del_still_stops(where, signum, status, rest):
  """Python loses an exception raised inside a garbage-collector callback (JAX registers
  one, run at any allocation) or a `__del__` method with "Exception ignored", and the
  command would carry on; `exit_on_run_errors` sends such a signal again once the callback
  has returned, so the block still stops with the signal's status, also when it ends
  before that (`pass`)."""
  trigger = {"callback": "gc.callbacks.append(callback)\nwith exit_on_run_errors():\n"
                         "  gc.collect()",
             "__del__": "with exit_on_run_errors():\n  Dropped()   # its __del__ runs"}[where]
  script = f"""
import gc, os, signal, sys, time
from experiments.cli import exit_on_run_errors
# as in an interactive shell (pytest-xdist's workers, and so their children, ignore SIGINT)
signal.signal(signal.SIGINT, signal.default_int_handler)
def send():
  if not sent:
    sent.append(1)
    os.kill(os.getpid(), {int(signum)})
    time.sleep(0.01)   # the handler runs here, inside the callback or __del__
def callback(phase, info):
  if phase == "start":
    send()
class Dropped:
  def __del__(self):
    send()
sent = []
{trigger}
  {rest}
print("carried on")
time.sleep(0.2)   # a signal sent again after the block would land here
"""
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        cwd=REPO, env=subprocess_env(), timeout=120)
  assert proc.returncode == status, (proc.stdout, proc.stderr[-2000:])
  assert "carried on" not in proc.stdout
  assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr
  assert "while no training chunk was running" in proc.stderr


def test_a_script_that_resumes_nothing_says_so_when_stopped():
  """`exit_on_run_errors(resumable=False)` (own_data) says a rerun starts over, not that
  runs and checkpoints are kept."""
  script = """
import os, signal, time
from experiments.cli import exit_on_run_errors
with exit_on_run_errors(resumable=False):
  os.kill(os.getpid(), signal.SIGTERM)
  time.sleep(2)
"""
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        cwd=REPO, env=subprocess_env(), timeout=120)
  assert proc.returncode == 143, proc.stderr[-2000:]
  assert proc.stderr.strip() == ("interrupted by SIGTERM; this command resumes nothing: run "
                                 "it again to start over")


def test_an_ignored_sigint_stays_ignored():
  """A job started in the background (`cmd &` in a script) ignores SIGINT; the block does
  not make it stop on one."""
  script = """
import os, signal
from experiments.cli import exit_on_run_errors
signal.signal(signal.SIGINT, signal.SIG_IGN)
with exit_on_run_errors():
  os.kill(os.getpid(), signal.SIGINT)
print("carried on", signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
"""
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        cwd=REPO, env=subprocess_env(), timeout=120)
  assert proc.returncode == 0 and "carried on True" in proc.stdout, proc.stderr[-2000:]
