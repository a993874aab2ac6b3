"""experiments/benchmark.py: runs on tiny configurations and reports every field (no timing
assertions: timings depend on the machine)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
import types

import equinox as eqx
import jax
import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver

import phoenix_flax as pf
from conftest import REPO, run_forked, subprocess_env, table_cells
from phoenix_flax import inference, synthetic
from phoenix_flax.training import provenance
from experiments import benchmark, cli, timing

TINY = {
    "full": benchmark.Case(batch=2, history=4, candidates=3, emb=32, layers=1, q_heads=2,
                           kv_heads=1),
    "chunked": benchmark.Case(batch=1, history=4, candidates=10, emb=32, layers=1,
                              q_heads=2, kv_heads=1, chunk=4),
}


def test_useful_flops_counts_the_isolated_computation():
  case = dataclasses.replace(TINY["full"], layers=2)
  model = eqx.filter_eval_shape(pf.PhoenixModel, benchmark.model_config(case),
                                key=jax.random.key(0))
  D, d, H, KV, F, N, C, A = 32, 64, 2, 1, model.config.model.ffn_size, 5, 3, 19
  kv = 2 * D * 2 * KV * d                              # key and value projections
  per_row = 2 * D * H * d + 2 * H * d * D + 6 * D * F  # query, output, GeGLU
  context = N * (N + 1) // 2                           # causal (query, key) pairs
  candidate = N + 1                                    # the context plus its own key
  first = (N + C) * (kv + per_row) + 4 * H * d * (context + C * candidate)
  # The last layer: keys and values of every token, the rest for the candidates only.
  last = (N + C) * kv + C * per_row + 4 * H * d * C * candidate
  inputs = 2 * D * (2 * D + 4 * (6 * D + A) + C * 5 * D)
  expected = 2 * (first + last + inputs + 2 * D * A * C)
  assert benchmark.useful_flops(model, 2, C) == expected
  # One more candidate costs its rows in both layers, its attention rows (N + 1 keys in
  # each layer) and its input projection and head.
  extra = benchmark.useful_flops(model, 1, C + 1) - benchmark.useful_flops(model, 1, C)
  assert extra == 2 * (kv + per_row + 4 * H * d * candidate) + 2 * D * (5 * D + A)
  # The dense reference's matmuls cover every token in every layer and every (query,
  # key) pair of the N + C tokens.
  dense = 2 * (2 * ((N + C) * (kv + per_row) + 4 * H * d * (N + C) ** 2) + inputs
               + 2 * D * A * C)
  assert benchmark.useful_flops(model, 2, C, dense=True) == dense
  # The count has no term for the dwell-time MLP or the continuous head: refused.
  for extra_fields in ({"dwell_time_norm": pf.NormConfig()}, {"num_continuous_actions": 2}):
    other = eqx.filter_eval_shape(
        pf.PhoenixModel, dataclasses.replace(benchmark.model_config(case), **extra_fields),
        key=jax.random.key(0))
    with pytest.raises(ValueError, match="dwell-time MLP nor continuous head"):
      benchmark.useful_flops(other, 2, C)


def test_kv_cache_table_and_micro_batches_by_hand():
  """KV-cache bytes per user context: K and V, every layer, every KV head dividing the query
  heads, key size 64, 1 + S tokens, 4 bytes a float32 and 2 a bfloat16."""
  case = benchmark.Case(batch=3, history=6, candidates=7, emb=32, layers=3, q_heads=4,
                        kv_heads=4)
  rows = benchmark.kv_cache_table(case)
  assert [r["kv_heads"] for r in rows] == [4, 2, 1]
  for r in rows:
    assert r["q_heads"] == 4 and r["context_len"] == 7
    assert r["float32_bytes"] == 2 * 3 * r["kv_heads"] * 64 * 7 * 4
    assert r["bfloat16_bytes"] == 2 * 3 * r["kv_heads"] * 64 * 7 * 2
  # R rows a micro-batch, contexts of 1 + 6 = 7 tokens: R // 7 users a group (at least 1),
  # so 3 users make ceil(3 / users) groups; each user's 7 candidates go in micro-batches of
  # R // (users of an equal group) rows. R=20: 2 users a group, 2 groups, 10 rows each;
  # R=4: 1 user a group, 3 groups, candidates in 2 micro-batches of up to 4.
  for rows_, groups, micro in ((10, 3, 1), (20, 2, 1), (8, 3, 1), (4, 3, 2)):
    config = dataclasses.replace(benchmark.model_config(case), micro_batch_rows=rows_)
    model = eqx.filter_eval_shape(pf.PhoenixModel, config, key=jax.random.key(0))
    found = benchmark._micro_batches(model, 3, 7)
    assert found == {"micro_batch_rows": rows_, "user_groups": groups,
                     "candidate_micro_batches": micro}, rows_


def test_the_chunked_case_measures_the_chunk_that_rank_chunked_runs():
  """A chunk above the list shrinks, in rank_chunked, to the power of two that covers the
  list (10 candidates: 16); the case's label, chunk count and peak memory (of the chunk
  program it compiles) are of that chunk, not of the 1000 asked for."""
  assert [inference.chunk_size_for(10, n) for n in (4, 10, 16, 1000)] == [4, 10, 16, 16]
  case = dataclasses.replace(TINY["chunked"], chunk=1000)
  r = benchmark.bench_chunked(case, iters=1, warmup=0, min_seconds=0, seed=0,
                              matmul=benchmark.matmul_call(16), dense_iters=1)
  assert (r["fast"]["kind"], r["fast"]["num_chunks"]) == ("rank_chunked(16)", 1)


def test_the_chunked_peak_is_the_larger_of_its_two_programs(monkeypatch):
  real, count = benchmark.compile_fn, [0]

  def compile_fn(fn, *args):   # the first program bench_chunked compiles: encode_context
    exe, seconds, peak = real(fn, *args)
    count[0] += 1
    return exe, seconds, (10 ** 9 if count[0] == 1 else peak)
  monkeypatch.setattr(benchmark, "compile_fn", compile_fn)
  r = benchmark.bench_chunked(TINY["chunked"], 1, 0, 0.0, 0, matmul=lambda: 0,
                              dense_iters=1)
  assert r["fast"]["peak_bytes"] == 10 ** 9


def test_run_benchmark_reports_every_field(tmp_path):
  report = benchmark.run_benchmark(["full", "chunked"], TINY, iters=2, warmup=0,
                                   matmul_size=64, compile_case=TINY["full"],
                                   compile_layers=(1, 2), dense_iters=2)
  for name in ("full", "chunked"):
    r = report["configs"][name]
    for path in ("fast", "reference"):
      for field in ("median_s", "compile_s", "peak_bytes", "kind"):
        assert field in r[path], (name, path, field)
      assert r[path]["median_s"] > 0 and r[path]["peak_bytes"] > 0
    for field in ("speedup", "candidates_per_s", "achieved_gflops", "matmul_gflops", "mfu",
                  "useful_gflop"):
      assert r[field] > 0, (name, field)
    # The derived figures follow from the timings (matmul: 2 n^3 FLOPs).
    fast = r["fast"]["median_s"]
    assert r["matmul_gflops"] == pytest.approx(2 * 64 ** 3 / r["matmul_median_s"] / 1e9)
    assert r["achieved_gflops"] == pytest.approx(r["useful_gflop"] / fast)
    assert r["mfu"] == pytest.approx(r["achieved_gflops"] / r["matmul_gflops"])
    assert r["speedup"] == pytest.approx(r["reference"]["median_s"] / fast)
    assert r["candidates_per_s"] == pytest.approx(
        r["case"]["batch"] * r["case"]["candidates"] / fast)
  assert report["configs"]["full"]["max_abs_logit_diff"] <= 1e-5
  chunked = report["configs"]["chunked"]
  assert chunked["max_abs_prob_diff"] <= 1e-5 and chunked["max_abs_prob_diff_dense"] <= 1e-5
  assert chunked["fast"]["num_chunks"] == 3
  assert chunked["one_call"]["median_s"] > 0
  assert chunked["speedup_vs_one_call"] == pytest.approx(chunked["one_call"]["median_s"]
                                                         / chunked["fast"]["median_s"])
  for path in ("fast", "one_call"):   # compile time: the first call less a steady one
    assert chunked[path]["compile_s"] == pytest.approx(chunked[path]["first_call_s"]
                                                       - chunked[path]["median_s"])
  assert report["configs"]["full"]["reference"]["kind"] == "dense"
  assert chunked["reference"]["kind"] == "dense (one call)"
  # The dense reference's median is over its `dense_iters` timed calls, all kept.
  times = chunked["reference"]["times_s"]
  assert chunked["reference"]["iters"] == len(times) == 2 and min(times) > 0
  assert chunked["reference"]["median_s"] == statistics.median(times)
  # Every timed program runs the float32 forward, and the table's first line says so.
  for r in report["configs"].values():
    assert {r[p]["fprop_dtype"] for p in ("fast", "reference", "one_call") if p in r} == {
        "float32"}
  assert report["configs"]["full"]["flop_ratio"] > 1.0 and chunked["flop_ratio"] > 1.0

  kv = {row["kv_heads"]: row["float32_bytes"] for row in report["kv_cache"]}
  assert set(kv) == {2, 1} and kv[2] == 2 * kv[1]
  assert kv[1] == 2 * 1 * 1 * 64 * 5 * 4          # K and V, 1 layer, 1 head, d=64, N=5
  assert set(report["compile_scaling"]["seconds"]) == {"1", "2"}
  scaling = report["compile_scaling"]
  assert scaling["ratio"] == pytest.approx(scaling["seconds"]["2"] / scaling["seconds"]["1"])
  assert report["process_max_rss_bytes"] > 0
  assert (report["iters"], report["warmup"]) == (2, 0)   # the timing settings given
  assert report["machine"] == provenance.machine()
  assert report["code"] == provenance.running_code_version()

  path = tmp_path / "out" / "bench.json"
  cli.write_output_file(str(path), report)
  assert json.loads(path.read_text()) == json.loads(json.dumps(report))
  assert os.listdir(path.parent) == ["bench.json"]
  table = benchmark.format_table(report)
  assert "| full |" in table and "| chunked |" in table and "compile time" in table
  assert f"({report['machine']})" in table.splitlines()[0]
  # Each cell sits under its header, in the unit the header names.
  lines = table.splitlines()
  header = table_cells(next(line for line in lines if line.startswith("| config |")))
  for name, r in report["configs"].items():
    got = dict(zip(header, table_cells(next(line for line in lines
                                            if line.startswith(f"| {name} |")))))
    assert got["fast ms"] == f"{1e3 * r['fast']['median_s']:.1f}", name
    assert got["dense ms"] == f"{1e3 * r['reference']['median_s']:.1f}", name
    assert got["dense/fast"] == f"{r['speedup']:.2f}x", name
    assert got["cand/s"] == f"{r['candidates_per_s']:,.0f}", name
    assert got["GFLOP/s"] == f"{r['achieved_gflops']:.0f}", name
    assert got["MFU"] == f"{100 * r['mfu']:.0f}%", name
  for row in report["kv_cache"]:
    head = f"| {row['q_heads']} | {row['kv_heads']} |"
    _, _, fp32, bf16 = table_cells(next(line for line in lines if line.startswith(head)))
    assert fp32.startswith(f"{row['float32_bytes'] / 1024:.0f} KiB (")
    assert bf16 == f"{row['bfloat16_bytes'] / 1024:.0f} KiB"
  assert f"= {scaling['ratio']:.2f}x" in table
  assert ", float32, compiler options" in table.splitlines()[0]
  mixed = json.loads(json.dumps(report))
  mixed["configs"]["full"]["fast"]["fprop_dtype"] = "bfloat16"
  assert ", bfloat16 and float32, compiler" in benchmark.format_table(mixed).splitlines()[0]
  # The session caches compilations (conftest.py): the report and the table say so.
  assert report["persistent_compilation_cache"] is bool(jax.config.jax_compilation_cache_dir)
  assert ("persistent compilation cache was on" in table) is report["persistent_compilation_cache"]


def test_bench_case_derives_its_figures_from_the_flop_counts(monkeypatch):
  """On fixed timings, every derived figure follows from `useful_flops` (the fast and the
  dense count) and the medians: `dense_gflop` is the dense reference's count."""
  monkeypatch.setattr(benchmark, "bench_full", lambda *a, **k: {
      "fast": {"median_s": 0.5}, "reference": {"median_s": 1.0}, "matmul_median_s": 0.25})
  case = TINY["full"]
  r = benchmark.bench_case("full", case, 1, 0, 0.0, 0, matmul_size=16)
  model = eqx.filter_eval_shape(pf.PhoenixModel, benchmark.model_config(case),
                                key=jax.random.key(0))
  flops = benchmark.useful_flops(model, case.batch, case.candidates)
  dense = benchmark.useful_flops(model, case.batch, case.candidates, dense=True)
  assert r["useful_gflop"] == pytest.approx(flops / 1e9)
  assert r["dense_gflop"] == pytest.approx(dense / 1e9)
  assert r["flop_ratio"] == pytest.approx(dense / flops) and dense > flops
  assert r["matmul_gflops"] == pytest.approx(2 * 16 ** 3 / 0.25 / 1e9)


def test_compile_scaling_keeps_the_faster_of_two_compiles(monkeypatch):
  seconds = iter([3.0, 1.0, 8.0, 2.0])   # two compiles at 1 layer, then two at 2
  monkeypatch.setattr(benchmark, "compile_fn", lambda fn, *args: (None, next(seconds), 0))
  r = benchmark.compile_scaling(TINY["full"], (1, 2), seed=0)
  assert r["seconds"] == {"1": 1.0, "2": 2.0} and r["ratio"] == 2.0


def _synthetic_report():
  """A hand-made report with a distinct value in every field (no timing)."""
  path = lambda ms, peak, **extra: {"median_s": ms / 1e3, "compile_s": 1.5,
                                    "peak_bytes": peak, "kind": "isolated",
                                    "fprop_dtype": "float32", **extra}
  r = {"fast": path(2.0, 3 * 2 ** 20, user_groups=1, candidate_micro_batches=1),
       "reference": dict(path(5.0, 7 * 2 ** 20), kind="dense"),
       "speedup": 2.5, "flop_ratio": 1.75, "candidates_per_s": 12345.0,
       "useful_gflop": 0.25, "achieved_gflops": 125.0, "matmul_gflops": 400.0, "mfu": 0.3125}
  return {"device": "cpu", "machine": "test cpu", "jax_version": "0", "compiler_options": {},
          "iters": 3, "min_seconds": 0.0, "matmul_size": 64, "configs": {"x": r},
          "kv_cache": [], "kv_cache_config": None,
          "compile_scaling": {"layers": [2, 12], "seconds": {"2": 1.25, "12": 5.0},
                              "ratio": 4.0},
          "training": [{"preset": "cpu", "num_seeds": 3, "fprop_dtype": "float32",
                        "rounds": 3, "steps_per_round": 400,
                        "scanned_examples_per_second": 9000.0,
                        "plain_examples_per_second": 1000.0, "speedup": 9.0,
                        "plain_device_sampled_examples_per_second": 3000.0,
                        "speedup_vs_device_sampled": 3.0}],
          "process_max_rss_bytes": 2 ** 30}


def test_format_table_puts_every_figure_under_its_header():
  """Every cell of the forward and training tables, the compile line and the paths' kinds,
  on a report whose figures all differ (so a swapped field shows)."""
  lines = benchmark.format_table(_synthetic_report()).splitlines()
  row = lambda start: table_cells(next(l for l in lines if l.startswith(start)))
  assert dict(zip(row("| config |"), row("| x |"))) == {
      "config": "x", "fast ms": "2.0", "dense ms": "5.0", "dense/fast": "2.50x",
      "dense/fast FLOPs": "1.75x", "cand/s": "12,345", "compile s fast / dense": "1.5 / 1.5",
      "peak MiB fast / dense": "3.0 / 7.0", "useful GFLOP": "0.25", "GFLOP/s": "125",
      "matmul GFLOP/s": "400", "MFU": "31%"}
  assert row("| cpu | 3 |") == ["cpu", "3", "9,000", "1,000", "9.00x", "3,000", "3.00x"]
  assert ("compile time of the fast forward, 12 vs 2 layers: 5.00 s vs 1.25 s = 4.00x"
          in lines)
  # One user group and one candidate micro-batch are no split: not named.
  assert "fast vs reference: x: isolated vs dense." in lines


def test_bench_full_compares_the_fast_path_with_the_reference(monkeypatch):
  """`max_abs_logit_diff` is fast vs dense (a reference off by 1 reads 1), and the
  micro-batch split is reported for the fast path, the one that splits."""
  real, count = benchmark.compile_fn, [0]

  def compile_fn(fn, *args):   # the second program compiled, the dense reference: + 1
    exe, seconds, peak = real(fn, *args)
    count[0] += 1
    return ((lambda *a: exe(*a) + 1.0) if count[0] == 2 else exe), seconds, peak
  monkeypatch.setattr(benchmark, "compile_fn", compile_fn)
  r = benchmark.bench_full(TINY["full"], 1, 0, 0.0, 0, matmul=lambda: 0)
  assert r["max_abs_logit_diff"] == pytest.approx(1.0, abs=1e-4)
  assert {k: r["fast"][k] for k in ("user_groups", "candidate_micro_batches")} == {
      "user_groups": 1, "candidate_micro_batches": 1}
  assert r["fast"]["micro_batch_rows"] > 0 and "user_groups" not in r["reference"]


def test_max_rss_is_in_bytes_on_linux_and_macos(monkeypatch):
  """`ru_maxrss` counts KiB on Linux and bytes on macOS: times 1024 on macOS read 1024
  times the memory used."""
  usage = types.SimpleNamespace(ru_maxrss=2048)
  monkeypatch.setattr(benchmark.resource, "getrusage", lambda who: usage)
  for platform, expected in (("linux", 2048 * 1024), ("darwin", 2048)):
    monkeypatch.setattr(benchmark.sys, "platform", platform)
    assert benchmark.max_rss_bytes() == expected


def test_a_training_only_report_prints_no_forward_table(monkeypatch):
  """With no forward configuration (`--configs=`, as the README's training command runs)
  the table names no forward timing that never ran, and says how the training rows were
  timed; `run_benchmark` picks its KV-cache model among the cases it has."""
  report = json.load(open(os.path.join(REPO, "docs", "results",
                                       "train_throughput_cpu_774575f.json")))
  assert report["configs"] == {}
  table = benchmark.format_table(report)
  assert "median over at least" not in table and "fast vs reference" not in table
  assert ("float32): medians of 7 alternating rounds (steps a round: cpu 400, smoke 20)"
          in table)
  assert table.startswith("| q heads | kv heads |")
  no_serve = benchmark.run_benchmark([], cases={"full": TINY["full"]}, matmul_size=64)
  assert no_serve["kv_cache_config"]["name"] == "full"
  # A serve case among the cases is the KV-cache model, timed or not.
  serve = benchmark.run_benchmark([], cases={"full": TINY["full"], "serve": TINY["full"]},
                                  matmul_size=64)
  assert serve["kv_cache_config"]["name"] == "serve"
  # Without one, the first config named (not the first in `cases`), with its layer count
  # (its timing stubbed out).
  monkeypatch.setattr(benchmark, "bench_case", lambda *args, **kwargs: {})
  cases = {"full": TINY["full"], "deep": dataclasses.replace(TINY["full"], layers=3)}
  deep = benchmark.run_benchmark(["deep"], cases, matmul_size=64)
  assert deep["kv_cache_config"] == {"name": "deep", "layers": 3, "key_size": 64}
  assert deep["kv_cache"] == benchmark.kv_cache_table(cases["deep"])


def test_time_rounds_runs_iters_then_until_min_seconds():
  calls = []
  call = lambda: (calls.append(1), time.sleep(0.01))[0]
  assert timing.time_rounds({"a": call}, iters=3, warmup=1)["a"] >= 0.01
  assert len(calls) == 1 + 3 * 2          # warmup, then an untimed and a timed run a round
  calls.clear()
  start = time.perf_counter()
  timing.time_rounds({"a": call}, iters=2, warmup=0, min_seconds=0.1)
  assert time.perf_counter() - start >= 0.1
  assert 4 <= len(calls) <= 20            # every call sleeps at least 0.01 s


def test_time_rounds_medians_the_second_run_of_each_round(monkeypatch):
  """On a fake clock: each round runs every call in turn, twice in a row, and times the
  second run; the figure is the median of those; rounds continue past `iters` until the
  timed runs of all calls add up to `min_seconds`."""
  clock, order = [0.0], []
  monkeypatch.setattr(timing, "time", type("FakeTime", (), {
      "perf_counter": staticmethod(lambda: clock[0])}))

  def make(name, costs):
    costs = iter(costs)
    def call():
      order.append(name)
      clock[0] += next(costs)
    return call

  # Untimed runs cost 100 s (cold), timed ones 1, 2, 9 s (a) and 3, 3, 30 s (b).
  found = timing.time_rounds({"a": make("a", [100, 1, 100, 2, 100, 9]),
                              "b": make("b", [100, 3, 100, 3, 100, 30])}, iters=3, warmup=0)
  assert found == {"a": 2, "b": 3}
  assert order == ["a", "a", "b", "b"] * 3
  # The timed span waits for the result: an asynchronously dispatched call costs its
  # dispatch (1 s) plus the wait (5 s).
  class Pending:
    def block_until_ready(self):
      clock[0] += 5
      return self
  def dispatch():
    clock[0] += 1
    return Pending()
  assert timing.time_rounds({"a": dispatch}, iters=1, warmup=0) == {"a": 6}
  order.clear()
  # Warmup runs (1000 s each, compiling say) are timed in no round.
  assert timing.time_rounds({"a": make("a", [1000, 1000, 100, 1])}, iters=1,
                            warmup=2) == {"a": 1}
  order.clear()
  # Timed runs of 1 s each, two calls: 10 s in all takes 5 rounds, beyond iters=1.
  order.clear()
  timing.time_rounds({"a": make("a", [0, 1] * 20), "b": make("b", [0, 1] * 20)}, iters=1,
                     warmup=2, min_seconds=10.0)
  assert order == ["a", "b"] * 2 + ["a", "a", "b", "b"] * 5
  # ... and at most max_rounds.
  order.clear()
  timing.time_rounds({"a": make("a", [0, 1] * 20)}, iters=1, warmup=0, min_seconds=100.0,
                     max_rounds=4)
  assert len(order) == 2 * 4


def test_run_benchmark_rejects_unknown_configs():
  with pytest.raises(ValueError, match="unknown configs"):
    benchmark.run_benchmark(["nope"], TINY)
  with pytest.raises(ValueError, match="train preset 'tiny'"):
    benchmark.run_benchmark(["full"], TINY, train=[("tiny", 1)])
  with pytest.raises(ValueError, match="train seeds 0"):
    benchmark.run_benchmark(["full"], TINY, train=[("smoke", 0)])
  with pytest.raises(ValueError, match="dense_iters=0"):
    benchmark.run_benchmark(["chunked"], TINY, dense_iters=0)
  for layers in ((2,), (1, 2, 3)):
    with pytest.raises(ValueError, match="must name two layer counts"):
      benchmark.run_benchmark(["full"], TINY, compile_layers=layers)
  with pytest.raises(ValueError, match="layer counts must be >= 1"):
    benchmark.run_benchmark(["full"], TINY, compile_layers=(0, 2))


def test_chunk_size_sets_the_chunked_cases_only():
  cases = benchmark.with_chunk_size(benchmark.CASES, 64)
  assert cases["chunked"] == dataclasses.replace(benchmark.CASES["chunked"], chunk=64)
  assert {n: c for n, c in cases.items() if n != "chunked"} == {
      n: c for n, c in benchmark.CASES.items() if n != "chunked"}   # whole lists
  assert benchmark.with_chunk_size(benchmark.CASES, None) == benchmark.CASES


def test_cli_rejects_bad_flags_before_any_timing(tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  cases = [(["--iters=0"], "flag --iters=0: 0 is not a positive integer"),
           (["--warmup=-1"], "flag --warmup=-1"),
           (["--chunk_size=0"], "flag --chunk_size=0"),
           (["--matmul_size=100000"], "flag --matmul_size=100000: 100000 is not an integer "
            "in the range [1, 16384]"),
           (["--train_seeds=abc"], "--train_seeds=abc: give integers"),
           (["--compile_layers=2,x"], "--compile_layers=2,x: give integers"),
           (["--configs=foo"], "unknown configs ['foo']"),
           (["--configs=demo,serve,demo"], "configs ['demo'] named more than once"),
           # Flags this run would not read, their values silently ignored:
           (["--configs=demo,1k", "--chunk_size=64"], "--chunk_size would change nothing: it "
            "sizes the chunks of the chunked config, and --configs does not name it"),
           (["--configs=serve", "--dense_iters=1"], "--dense_iters would change nothing"),
           (["--nocompile_check", "--compile_layers=2,4"],
            "--compile_layers would change nothing: --nocompile_check skips"),
           (["--train_presets=", "--train_seeds=1"], "--train_seeds would change nothing: "
            "--train_presets is empty"),
           (["--train_presets=", "--train_rounds=1"], "--train_rounds would change nothing"),
           (["--train_presets=", "--train_chunks=1"], "--train_chunks would change nothing"),
           (["--train_presets=smoke", "--train_seeds="], "--train_presets=smoke with no "
            "--train_seeds: give seed counts"),
           ([f"--out={tmp_path}"], "is a directory; name a file"),
           ([f"--out={tmp_path}/new_folder/"], "names no file"),   # (a folder not there yet)
           ([f"--out={a_file}/b.json"], f"{a_file} is not a directory"),
           (["positional"], "unexpected arguments ['positional']")]
  results = run_forked("experiments.benchmark", [args for args, _ in cases],
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  for (code, _, err), (args, needle) in zip(results, cases, strict=True):
    assert code == 2 and err.startswith("error: ") and needle in err, (args, err)
    assert "Traceback" not in err


@pytest.mark.slow
def test_cli_writes_json_and_table(tmp_path):
  out, cache = tmp_path / "bench.json", tmp_path / "jax_cache"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.benchmark", "--configs=demo", "--iters=1",
       "--warmup=0", "--min_seconds=0", "--matmul_size=64", "--nocompile_check", f"--out={out}",
       "--train_presets=smoke", "--train_seeds=1,2", "--train_rounds=1", "--train_chunks=1"],
      capture_output=True, text=True, cwd=REPO,
      # Plumbing, not timing: compiled as the session compiles (unoptimised, conftest.py).
      # A persistent compilation cache the user set (the session's caches everything) is
      # not used: compile times would time loading from it.
      env=subprocess_env(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache)))
  assert proc.returncode == 0, proc.stderr
  report = json.loads(out.read_text())
  assert not (cache.exists() and os.listdir(cache))
  assert report["persistent_compilation_cache"] is False
  assert "persistent compilation cache was on" not in proc.stdout
  assert set(report["configs"]) == {"demo"}
  assert report["configs"]["demo"]["case"] == dataclasses.asdict(benchmark.CASES["demo"])
  assert "compile_scaling" not in report             # --nocompile_check
  assert report["command"].startswith("python -m experiments.benchmark")
  assert "| demo |" in proc.stdout
  # The training loops: scanned vs the two plain loops, per seed count.
  assert [(r["preset"], r["num_seeds"]) for r in report["training"]] == [("smoke", 1),
                                                                         ("smoke", 2)]
  for r in report["training"]:
    assert (r["machine"], r["code"]) == (report["machine"], report["code"])
    assert r["fprop_dtype"] == "float32"   # the presets' None, on this CPU
    assert r["scanned_examples_per_second"] > 0 and r["plain_examples_per_second"] > 0
    assert r["plain_device_sampled_examples_per_second"] > 0
    assert r["speedup"] == pytest.approx(
        r["scanned_examples_per_second"] / r["plain_examples_per_second"])
    assert r["speedup_vs_device_sampled"] == pytest.approx(
        r["scanned_examples_per_second"] / r["plain_device_sampled_examples_per_second"])
  assert "| smoke | 2 |" in proc.stdout


HOST_WORLD = synthetic.WorldConfig(
    num_users=64, num_posts=200, num_authors=24, num_topics=8, latent_dim=8, history_len=12,
    num_candidates=6, user_buckets=40, post_buckets=128, author_buckets=16, post_age=True)
# The host sampler mirrors `sample_batch`, so the worlds and splits it is compared on set
# every field of WorldConfig and SplitConfig away from its default
# (`test_host_sampler_cases_set_every_field`): a field that changes how batches are drawn
# fails the comparison until the host sampler draws it too.
HOST_WORLDS = {
    "small": dataclasses.replace(HOST_WORLD, post_age=False),
    "aged": HOST_WORLD,
    "shifted": dataclasses.replace(
        HOST_WORLD, num_user_hashes=3, num_item_hashes=1, num_author_hashes=3,
        product_surface_vocab_size=5, num_actions=7, base_rates=(0.2, 0.1, 0.05, 0.3, 0.1,
                                                                  0.05, 0.15),
        negative_actions=(4, 5), recency_decay=0.3, interest_mix=0.4, topic_switch_prob=0.6,
        explore_prob=0.3, taste_concentration=1.0, author_style=0.8, post_noise=0.2,
        retrieval_sharpness=3.0, affinity_scale=2.0, quality_scale=1.0, surface_scale=0.2,
        user_bias_scale=1.0, session_scale=0.5, age_decay_per_day=3.0,
        mean_post_age_hours=6.0)}
HOST_SPLITS = [
    synthetic.SplitConfig(),
    synthetic.SplitConfig(history_dist="log_uniform", list_correlation=0.5,
                          candidate_order="relevance", min_candidates=2, num_candidates=9),
    synthetic.SplitConfig(min_history=0, max_history=7, relevant_fraction=0.8,
                          list_correlation=1.0, candidate_order="grouped")]


def test_host_sampler_cases_set_every_field():
  for cls, cases in ((synthetic.WorldConfig, HOST_WORLDS.values()),
                     (synthetic.SplitConfig, HOST_SPLITS)):
    default = cls()
    unset = {f.name for f in dataclasses.fields(cls)
             if all(getattr(c, f.name) == getattr(default, f.name) for c in cases)}
    assert not unset, (f"{cls.__name__} fields that no host-sampler case sets (HOST_WORLDS, "
                       f"HOST_SPLITS in tests/test_benchmark.py): {sorted(unset)}")


@pytest.mark.parametrize("world_name", list(HOST_WORLDS))
@pytest.mark.parametrize("split", HOST_SPLITS)
def test_host_sampler_draws_the_device_samplers_batches(split, world_name):
  """The plain loop's numpy sampler, given the device sampler's uniforms, gives its batch:
  every id, hash, label and mask equal, floats to rounding, and timestamps within the one
  second that rounding an age can move."""
  from experiments import host_sampler
  from phoenix_flax.synthetic.sampling import uniform_shapes
  from phoenix_flax.synthetic.world import random_blocks
  world_cfg = HOST_WORLDS[world_name]
  world = synthetic.make_world(world_cfg, jax.random.key(0))
  B, (_, C) = 128, split.resolve(world_cfg)
  key = jax.random.key(1)
  device = jax.jit(synthetic.sample_batch, static_argnums=(1, 2))(world, split, B, key)
  uniforms = random_blocks(key, jax.random.uniform,
                           uniform_shapes(B, world_cfg.history_len, C, world_cfg.num_actions))
  host = host_sampler.sample_from_uniforms(host_sampler.host_world(world), split, B,
                                           {k: np.asarray(v) for k, v in uniforms.items()})
  paths = jax.tree_util.tree_leaves_with_path(device)
  assert len(paths) == len(jax.tree.leaves(host)) == 21
  for (path, d), h in zip(paths, jax.tree.leaves(host)):
    name, d = jax.tree_util.keystr(path), np.asarray(d)
    assert isinstance(h, np.ndarray) and (h.dtype, h.shape) == (d.dtype, d.shape), name
    if name.endswith("candidate_post_timestamps"):
      assert np.abs(h - d).max() <= 1 and np.mean(h != d) < 0.01, name
    elif d.dtype.kind == "f":
      np.testing.assert_allclose(h, d, rtol=1e-5, atol=1e-5, err_msg=name)
    else:
      np.testing.assert_array_equal(h, d, err_msg=name)
  assert 0 < host.labels.mean() < 1 and host.candidate_mask.any()


def test_host_sampler_draws_fresh_uniforms_from_its_seed():
  from experiments import host_sampler
  from phoenix_flax.synthetic.sampling import uniform_shapes
  world = synthetic.make_world(HOST_WORLD, jax.random.key(0))
  split = synthetic.SplitConfig(num_candidates=5)
  u = host_sampler.HostSampler(world, split, 4, seed=7).uniforms()
  assert {k: v.shape for k, v in u.items()} == uniform_shapes(4, 12, 5, 19)
  assert all(v.dtype == np.float32 and (0 <= v).all() and (v < 1).all() for v in u.values())
  sampler = host_sampler.HostSampler(world, split, 4, seed=7)
  first, second = sampler(), sampler()
  assert first.batch.candidate_post_hashes.shape == (4, 5, 2)
  assert not np.array_equal(first.user_ids, second.user_ids)
  again = host_sampler.HostSampler(world, split, 4, seed=7)()
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)))
  with pytest.raises(ValueError, match="batch_size"):
    host_sampler.HostSampler(world, split, 0, seed=7)
  with pytest.raises(ValueError, match="batch_size=4.0"):   # up front, not a later TypeError
    host_sampler.HostSampler(world, split, 4.0, seed=7)
  with pytest.raises(TypeError, match="split must be a SplitConfig, got dict"):
    host_sampler.HostSampler(world, dataclasses.asdict(split), 4, seed=7)
  # The first history item has no earlier one to weigh: its interest is the taste, with no
  # 0/0 on the way (a floating-point error would raise here).
  with np.errstate(all="raise"):
    host_sampler.HostSampler(world, split, 4, seed=7)()


def test_host_sampler_categorical_stays_in_range_when_the_cdf_rounds_low():
  """float32 rounding can leave the softmax CDF's last entry below a uniform just under 1;
  the draw is then the last category, not one past it."""
  from experiments.host_sampler import _categorical, _softmax
  u = np.array([np.nextafter(np.float32(1), np.float32(0))], np.float32)
  rng = np.random.default_rng(0)
  for _ in range(1000):
    logits = rng.normal(size=(1, 16)).astype(np.float32) * 3
    if np.cumsum(_softmax(logits), -1)[0, -1] < u[0]:
      break
  else:
    raise AssertionError("no logits found whose float32 CDF ends below u")
  assert int(_categorical(u, logits)[0]) == 15
  # Logits past float32's exp range (a large taste_concentration or retrieval_sharpness,
  # which the config only requires >= 0) still give the softmax's draw: equal logits split
  # evenly, whether they would overflow exp or underflow it.
  u = np.array([0.25, 0.75], np.float32)
  for logits, want in (([[100.0, 100.0]], [0, 1]), ([[-200.0, -200.0]], [0, 1]),
                       ([[300.0, 0.0, 300.0]], [0, 2])):
    assert _categorical(u, np.array(logits, np.float32)).tolist() == want, logits


def test_the_benchmarks_training_rows_pass_rounds_and_chunks_in_order(monkeypatch):
  """`benchmark.training_throughput` measures the preset's config with its seed count,
  the rounds and the chunks a round as given."""
  from experiments import train_throughput
  seen = []

  def measure(config, rounds=3, chunks_per_round=2):   # (the real one's signature)
    seen.append((config.num_seeds, rounds, chunks_per_round))
    return {"speedup": 1.0}
  monkeypatch.setattr(train_throughput, "measure", measure)
  assert benchmark.training_throughput("smoke", 2, 3, 4) == {"preset": "smoke", "speedup": 1.0}
  assert seen == [(2, 3, 4)]


def test_training_throughput_counts_every_seeds_examples(monkeypatch):
  """`train_throughput.measure` on loops that report fixed times: each round runs
  `chunks_per_round` scanned calls (steps_per_call steps each, every seed's batch) and as
  many steps of each plain loop (one seed); figures are medians over rounds."""
  from experiments import train_throughput
  calls = []

  class FakeLoops:
    steps, batch_size, num_seeds = 5, 8, 3
    spec = types.SimpleNamespace(model=types.SimpleNamespace(fprop_dtype="bfloat16"))
    times = {"scanned": iter([2.0, 1.0, 4.0]), "plain": iter([10.0, 20.0, 40.0]),
             "device": iter([5.0, 5.0, 1.0])}

    def __init__(self, config):
      calls.append(("init", config))

    def scanned(self, chunks):
      calls.append(("scanned", chunks))
      return next(self.times["scanned"])

    def plain(self, steps, device_sampled=False):
      calls.append(("device" if device_sampled else "plain", steps))
      return next(self.times["device" if device_sampled else "plain"])

  monkeypatch.setattr(train_throughput, "_Loops", FakeLoops)
  out = train_throughput.measure("config", rounds=3, chunks_per_round=2)
  assert calls == [("init", "config")] + [("scanned", 2), ("plain", 10), ("device", 10)] * 3
  # 10 steps a round: 10 * 8 * 3 examples in 2, 1, 4 s; 10 * 8 in 10, 20, 40 s and 5, 5, 1 s.
  assert out["scanned_examples_per_second"] == 120.0
  assert out["plain_examples_per_second"] == 4.0
  assert out["plain_device_sampled_examples_per_second"] == 16.0
  assert out["speedup"] == 30.0 and out["speedup_vs_device_sampled"] == 7.5
  assert (out["steps_per_round"], out["batch_size"], out["num_seeds"]) == (10, 8, 3)
  assert (out["steps_per_call"], out["rounds"]) == (5, 3)
  assert out["fprop_dtype"] == "bfloat16"   # the loops' forward dtype, whatever it is


def test_a_ctrl_c_ends_the_benchmark_with_one_line_and_no_file(tmp_path, monkeypatch, capsys):
  """Ctrl-C while it measures: exit status 130 and one line (a KeyboardInterrupt traceback
  before, and now and then a segmentation fault in XLA's teardown), no --out file."""
  def interrupted(*args):
    raise KeyboardInterrupt
  monkeypatch.setattr(benchmark, "run_benchmark", interrupted)
  out = tmp_path / "bench.json"
  flags.FLAGS.mark_as_parsed()
  try:
    with flagsaver.flagsaver(configs=["demo"], out=str(out), train_presets=[]):
      with pytest.raises(SystemExit) as e:
        benchmark.main(["benchmark"])
  finally:
    flags.FLAGS.unparse_flags()
  assert e.value.code == 130 and not out.exists()
  assert capsys.readouterr().err == ("interrupted by SIGINT; this command resumes nothing: "
                                     "run it again to start over\n")


def test_main_hands_every_flag_to_run_benchmark(tmp_path, monkeypatch):
  """`main` passes --train_rounds, --train_chunks (and the rest) to their parameters, and
  the compile check compiles the `serve` case."""
  signature, seen = inspect.signature(benchmark.run_benchmark), []

  def fake(*args, **kwargs):
    seen.append(signature.bind(*args, **kwargs).arguments)
    raise KeyboardInterrupt   # nothing timed, nothing written
  monkeypatch.setattr(benchmark, "run_benchmark", fake)
  flags.FLAGS.mark_as_parsed()
  try:
    with flagsaver.flagsaver(configs=["demo"], out=str(tmp_path / "b.json"),
                             train_presets=["smoke"], train_seeds=["1"], train_rounds=7,
                             train_chunks=2, dense_iters=3, iters=4, warmup=1):
      with pytest.raises(SystemExit):
        benchmark.main(["benchmark"])
  finally:
    flags.FLAGS.unparse_flags()
  [args] = seen
  assert args["train"] == [("smoke", 1)]
  assert (args["train_rounds"], args["train_chunks"]) == (7, 2)
  assert (args["iters"], args["warmup"], args["dense_iters"]) == (4, 1, 3)
  assert args["compile_case"] == benchmark.CASES["serve"]
