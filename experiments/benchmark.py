"""Speed and memory of the ranking forward: isolation-aware fast path vs dense reference.

    python -m experiments.benchmark --configs=demo,serve,1k,chunked --out=benchmark.json

Everything is measured in one process, after compilation, every program compiled with
the package's `xla_options.compiler_options()` (recorded in the JSON). The forward paths
run in float32 (each path's `fprop_dtype` is recorded in the JSON and named in the
table); the training loops in their preset's forward dtype, float32 on CPU and bfloat16
on GPU/TPU (recorded with each training entry). For
each configuration: median forward time of the fast path (`attention_impl="isolated"`)
and of the dense masked reference (same parameters, same inputs), their ratio, candidates/s,
compile time, peak memory of each compiled program, achieved GFLOP/s from an analytic
count of useful FLOPs (`useful_flops`), and model FLOP utilisation (MFU): achieved GFLOP/s
over the GFLOP/s of a square fp32 matmul timed in the same rounds. The `chunked` case
serves one user through `RankingRunner.rank_chunked` (context encoded once, candidates
scored in chunks); its reference is the dense model on all candidates in one call (timed
`--dense_iters` times on its own, each time kept: tens of seconds a call), and it also
reports `RankingRunner.rank` on all candidates in one call (`one_call`: the isolated
path, in micro-batches of `micro_batch_rows` rows, as every fast call). Also reported:
KV-cache bytes per user context for each GQA ratio, and the compile time of a
deep model relative to a shallow one.

Training throughput (`--train_presets`, `--train_seeds`): the scanned on-device training
loop of `phoenix_flax.training` against the plain host-driven baseline (a jitted step called
once per step on a batch sampled on the host with numpy, its loss read back every step),
and against the same plain loop fed device-sampled batches copied to numpy; see
`experiments/train_throughput.py`, which holds the loops and can also be run alone.

The JSON (and the line above the forward table, and the training table's) names the
processor (`provenance.machine()`: model, widest vector extension, core count on CPU),
since the figures depend on it: the same `1k` ratio read 5.83x on an AVX-512 host and
4.35x on an AVX2 one (docs/performance.md).
It also records the code version (`provenance.running_code_version()`, as `result.json`
does).
The command line switches off JAX's persistent compilation cache (which
JAX_COMPILATION_CACHE_DIR switches on), so that compile times time compiling, not loading.

Every timing round runs each call in turn (twice in a row, timing the second run, so
each starts from warm caches), so load from other processes hits all of them alike;
ratios are more trustworthy than absolute times on a busy host.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

from absl import flags
import equinox as eqx
import jax
import jax.numpy as jnp

if not __package__:  # run by path, not with python -m: import this checkout's packages
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments import train_throughput
from experiments.cli import (check_output_file, exit_on_run_errors, parse_flags,
                             quiet_backend_search, repeated, run_app, usage_error,
                             write_output_file)
from experiments.configs import ranking
from experiments.timing import time_rounds
import phoenix_flax as pf
from phoenix_flax import xla_options
from phoenix_flax.inference import chunk_size_for
from phoenix_flax.training import provenance

KEY_SIZE = 64
WIDENING_FACTOR = 2.0
ATTN_OUTPUT_MULTIPLIER = 0.125


@dataclasses.dataclass(frozen=True)
class Case:
  """A benchmark configuration; `chunk` set = one-user serving in chunks of that size."""

  batch: int
  history: int
  candidates: int
  emb: int
  layers: int
  q_heads: int
  kv_heads: int
  chunk: Optional[int] = None


CASES = {
    "demo": Case(batch=8, history=32, candidates=8, emb=128, layers=2, q_heads=2, kv_heads=2),
    "serve": Case(batch=64, history=128, candidates=32, emb=256, layers=4, q_heads=4,
                  kv_heads=2),
    "1k": Case(batch=4, history=128, candidates=1024, emb=256, layers=4, q_heads=4,
               kv_heads=2),
    "chunked": Case(batch=1, history=128, candidates=10_000, emb=256, layers=4, q_heads=4,
                    kv_heads=2, chunk=1_000),
}

FLAGS = flags.FLAGS
flags.DEFINE_list("configs", ["demo", "serve", "1k", "chunked"],
                  f"Configurations to run, from {sorted(CASES)}.")
flags.DEFINE_integer("iters", 10, "Timed calls per path at least; more until they add up "
                     "to --min_seconds (the median is reported).",
                     lower_bound=1)
flags.DEFINE_integer("warmup", 2, "Untimed calls per path after compilation.", lower_bound=0)
flags.DEFINE_float("min_seconds", 5.0, "Keep timing rounds (beyond --iters, up to 1000) until "
                   "they add up to this many seconds per configuration.", lower_bound=0.0)
flags.DEFINE_string("out", "benchmark.json", "JSON results file (written atomically).")
flags.DEFINE_integer("chunk_size", None, "Chunk size of the chunked case (default 1000).",
                     lower_bound=1)
flags.DEFINE_integer("dense_iters", 3, "Timed calls of the chunked case's dense reference "
                     "(all candidates in one call; tens of seconds each at 10,000), after an "
                     "untimed first call; outside the timing rounds.", lower_bound=1)
flags.DEFINE_integer("matmul_size", 2048, "Side of the square fp32 matmul (MFU denominator; "
                     "at most 16384, whose three matrices take 3 GiB).", lower_bound=1,
                     upper_bound=16384)
flags.DEFINE_bool("compile_check", True, "Compare compile times of a deep and a shallow model.")
flags.DEFINE_list("compile_layers", ["2", "12"], "Shallow and deep layer counts to compile.")
flags.DEFINE_integer("seed", 0, "Seed of parameters and inputs.")
flags.DEFINE_list("train_presets", ["cpu"],
                  "Presets of experiments/configs/ranking.py whose training loop is timed "
                  "against the plain loops (empty: skip).")
flags.DEFINE_list("train_seeds", ["1", "3"],
                  "Seed counts of the training measurement (the scanned loop trains them "
                  "at once, vmapped).")
flags.DEFINE_integer("train_rounds", 3, "Alternating timing rounds of the training loops.",
                     lower_bound=1)
flags.DEFINE_integer("train_chunks", 2, "Scanned host calls per training round; each plain "
                     "loop runs as many steps.", lower_bound=1)


def model_config(case: Case, attention_impl: str = "isolated",
                 layers: Optional[int] = None) -> pf.PhoenixModelConfig:
  """The release's model shape (key 64, widening 2, multiplier 1/8) at the case's size."""
  tc = pf.TransformerConfig(emb_size=case.emb, key_size=KEY_SIZE, num_q_heads=case.q_heads,
                            num_kv_heads=case.kv_heads,
                            num_layers=case.layers if layers is None else layers,
                            widening_factor=WIDENING_FACTOR,
                            attn_output_multiplier=ATTN_OUTPUT_MULTIPLIER)
  return pf.PhoenixModelConfig(model=tc, emb_size=case.emb, history_seq_len=case.history,
                               candidate_seq_len=case.candidates,
                               attention_impl=attention_impl)


def make_inputs(config: pf.PhoenixModelConfig, batch: int, seed: int):
  """Fully valid inputs (no padding), so that every counted FLOP is useful work."""
  return pf.example_batch(config, batch, jax.random.key(seed),
                          history_lengths=[config.history_seq_len] * batch)


def useful_flops(model: pf.PhoenixModel, batch: int, candidates: int,
                 dense: bool = False) -> int:
  """FLOPs (multiply + add = 2) of the isolation-aware forward with every token valid.

  `model` may be abstract (`eqx.filter_eval_shape`): only its config and shapes are read.

  With context length `N = 1 + S`, `H` query and `KV` key/value heads of size `d`, GeGLU
  width `F`, `A` actions, `U` user hashes and `L` layers, per user:

    kv     = (N + C) * L * 2*D*2*KV*d
               key and value projections of every token in every layer
    rows   = ((N + C) * (L - 1) + C) * (2*D*H*d + 2*H*d*D + 2*D*2F + 2*F*D)
               query and output projections and GeGLU (both branches + output) of
               every token in all but the last layer, and of the candidates in the last:
               the context's last-layer outputs feed no logit
    attend = 4*H*d * ((L - 1) * N*(N+1)/2 + L * C*(N+1))
               QK and AV over allowed keys only: the causal context (all but the last
               layer), and each candidate over the context plus itself
    inputs = 2*D * (U*D + S*(hist_in + A) + C*cand_in)
               user, history and candidate input projections, action projection
    head   = 2*D*A * C
               unembedding

  Masked work, the context's last-layer queries (computed in the fused q|k|v matmul),
  norms, RoPE, softmax, soft-cap, gelu and the one-hot surface lookup get no credit. The
  total is `batch` times the per-user count. Models with the dwell-time MLP or the
  continuous head, which the count leaves out, are refused.

  `dense=True` counts instead the matmul work the dense reference executes: every token's
  projections and GeGLU in every layer, and attention products over all `T = N + C` keys
  for every token, `L * 4*H*d * T*T`, masked or not. The one-hot surface lookup, which
  both paths run as a product (`2*V*D` a history item or candidate, V = 16: 0.5% of
  `demo`'s dense count, under 0.2% elsewhere), is in neither count.
  """
  c, tc = model.config, model.config.model
  if c.dwell_time_norm is not None or c.num_continuous_actions:
    raise ValueError("useful_flops counts no dwell-time MLP nor continuous head: give it a "
                     "model with dwell_time_norm=None and num_continuous_actions=0")
  D, d, H, KV = tc.emb_size, tc.key_size, tc.num_q_heads, tc.num_kv_heads
  L, F = tc.num_layers, tc.ffn_size
  S, A, U, C = c.history_seq_len, c.num_actions, c.hash_config.num_user_hashes, candidates
  N = 1 + S
  kv = 2 * D * 2 * KV * d
  per_row = 2 * D * H * d + 2 * H * d * D + 2 * D * 2 * F + 2 * F * D
  if dense:
    tokens = (N + C) * L * (kv + per_row)
    attend = L * 4 * H * d * (N + C) ** 2
  else:
    tokens = (N + C) * L * kv + ((N + C) * (L - 1) + C) * per_row
    attend = 4 * H * d * ((L - 1) * N * (N + 1) // 2 + L * C * (N + 1))
  hist_in, cand_in = model.proj_mat_3.shape[0], model.proj_mat_2.shape[0]
  inputs = 2 * D * (U * D + S * (hist_in + A) + C * cand_in)
  head = 2 * D * A * C
  return batch * (tokens + attend + inputs + head)


def compile_fn(fn: Callable, *args) -> tuple[Callable, float, int]:
  """Jit-compiles `fn(*args)` with the package's `xla_options.compiler_options()`, as
  `Trainer` and the runners do: (executable, seconds to trace + compile, peak bytes).

  Peak bytes come from XLA's buffer assignment of the compiled program (arguments +
  outputs + temporaries - aliased): the memory the program needs while it runs.
  """
  start = time.perf_counter()
  options = xla_options.compiler_options()
  compiled = jax.jit(fn, compiler_options=options).lower(*args).compile()
  seconds = time.perf_counter() - start
  mem = compiled.memory_analysis()
  peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
          - mem.alias_size_in_bytes)
  return compiled, seconds, int(peak)


def matmul_call(size: int) -> Callable[[], jax.Array]:
  """A compiled `[size, size] @ [size, size]` fp32 matmul (`2 * size**3` FLOPs a call)."""
  a, b = jax.random.normal(jax.random.key(0), (2, size, size), jnp.float32)
  f = compile_fn(jnp.matmul, a, b)[0]
  return lambda: f(a, b)


def _micro_batches(model: pf.PhoenixModel, batch: int, candidates: int) -> dict:
  """How `model(...)` splits a batch (`PhoenixModel.micro_batch_limits`): its rows
  setting, user groups and candidate micro-batches per group."""
  users, per_user = model.micro_batch_limits(batch, candidates)
  return {"micro_batch_rows": model.config.effective_micro_batch_rows,
          "user_groups": -(-batch // users),
          "candidate_micro_batches": -(-candidates // per_user)}


def _logits_fn(static) -> Callable:
  return lambda params, batch, emb: eqx.combine(params, static)(batch, emb).logits


def _max_abs_diff(a, b) -> float:
  return float(jnp.max(jnp.abs(jnp.asarray(a) - jnp.asarray(b))))


def bench_full(case: Case, iters: int, warmup: int, min_seconds: float, seed: int,
               matmul: Callable) -> dict:
  """Whole-batch forward: fast path vs dense reference, same parameters and inputs."""
  batch, emb = make_inputs(model_config(case), case.batch, seed + 1)
  result, calls = {}, {}
  for name, impl in (("fast", "isolated"), ("reference", "dense")):
    model = pf.PhoenixModel(model_config(case, impl), key=jax.random.key(seed))
    params, static = eqx.partition(model, eqx.is_array)
    exe, seconds, peak = compile_fn(_logits_fn(static), params, batch, emb)
    calls[name] = lambda exe=exe, params=params: exe(params, batch, emb)
    result[name] = {"compile_s": seconds, "peak_bytes": peak, "kind": impl,
                    "fprop_dtype": model.config.fprop_dtype}
    if impl == "isolated":
      result[name].update(_micro_batches(model, case.batch, case.candidates))
  result["max_abs_logit_diff"] = _max_abs_diff(calls["fast"](), calls["reference"]())
  medians = time_rounds(dict(calls, matmul=matmul), iters, warmup, min_seconds)
  for name in calls:
    result[name]["median_s"] = medians[name]
  result["matmul_median_s"] = medians["matmul"]
  return result


def bench_chunked(case: Case, iters: int, warmup: int, min_seconds: float, seed: int,
                  matmul: Callable, dense_iters: int = 3) -> dict:
  """One user through `RankingRunner.rank_chunked` (fast) vs the dense reference scoring
  every candidate in one call, and vs `rank` (`one_call`: the isolated path in one call,
  the same useful work, its candidates in the model's micro-batches).

  The dense call is timed on its own, `dense_iters` times after a first call, not in the
  rounds: at 10,000 candidates one call takes tens of seconds on 2 cores (its T x T
  attention), thousands of times a fast call. Compile time of the runner's paths is the
  first call minus a steady call. Peak bytes are those of the larger of the two programs
  a chunked call runs (context encoding, one chunk), and of each one-shot forward.
  """
  model = pf.PhoenixModel(model_config(case), key=jax.random.key(seed))
  batch, emb = make_inputs(model.config, 1, seed + 1)
  runner = pf.RankingRunner(model)
  # Whole outputs, so that timing waits for the ranking order too (dispatched after scores).
  calls = {"fast": lambda: runner.rank_chunked(batch, emb, case.chunk),
           "one_call": lambda: runner.rank(batch, emb)}
  result = {}
  for name, call in calls.items():
    start = time.perf_counter()
    jax.block_until_ready(call())
    result[name] = {"first_call_s": time.perf_counter() - start}
  result["max_abs_prob_diff"] = _max_abs_diff(calls["fast"]().scores,
                                              calls["one_call"]().scores)
  medians = time_rounds(dict(calls, matmul=matmul), iters, warmup, min_seconds)
  for name in calls:
    result[name]["median_s"] = medians[name]
    result[name]["compile_s"] = result[name]["first_call_s"] - medians[name]
  result["matmul_median_s"] = medians["matmul"]

  params, static = eqx.partition(model, eqx.is_array)
  chunk = chunk_size_for(case.candidates, case.chunk)   # the size rank_chunked runs
  chunk_batch, chunk_emb = make_inputs(dataclasses.replace(model.config,
                                                           candidate_seq_len=chunk),
                                       1, seed + 1)
  encode = lambda p, b, e: eqx.combine(p, static).encode_context(b, e)
  cache = jax.eval_shape(encode, params, batch, emb)
  score = lambda p, c, b, e: eqx.combine(p, static).score_candidates(c, b, e, jnp.int32(0))
  peaks = [compile_fn(encode, params, batch, emb)[2],
           compile_fn(score, params, cache, chunk_batch, chunk_emb)[2]]
  result["fast"].update(kind=f"rank_chunked({chunk})", peak_bytes=max(peaks),
                        num_chunks=-(-case.candidates // chunk),
                        fprop_dtype=model.config.fprop_dtype)
  result["one_call"].update(kind="rank (isolated, one call)",
                            fprop_dtype=model.config.fprop_dtype,
                            **_micro_batches(model, 1, case.candidates),
                            peak_bytes=compile_fn(_logits_fn(static), params, batch, emb)[2])

  dense = pf.PhoenixModel(model_config(case, "dense"), key=jax.random.key(seed))
  dense_params, dense_static = eqx.partition(dense, eqx.is_array)
  exe, seconds, peak = compile_fn(_logits_fn(dense_static), dense_params, batch, emb)
  logits = jax.block_until_ready(exe(dense_params, batch, emb))
  result["max_abs_prob_diff_dense"] = _max_abs_diff(jax.nn.sigmoid(logits),
                                                    calls["fast"]().scores)
  times = []
  for _ in range(dense_iters):
    start = time.perf_counter()
    jax.block_until_ready(exe(dense_params, batch, emb))
    times.append(time.perf_counter() - start)
  result["reference"] = {"kind": "dense (one call)", "compile_s": seconds, "peak_bytes": peak,
                         "fprop_dtype": dense.config.fprop_dtype, "times_s": times,
                         "median_s": statistics.median(times), "iters": dense_iters}
  return result


def bench_case(name: str, case: Case, iters: int, warmup: int, min_seconds: float, seed: int,
               matmul_size: int, dense_iters: int = 3) -> dict:
  """Times one case; its MFU uses the matmul timed in the same rounds."""
  matmul = matmul_call(matmul_size)
  if case.chunk:
    result = bench_chunked(case, iters, warmup, min_seconds, seed, matmul, dense_iters)
  else:
    result = bench_full(case, iters, warmup, min_seconds, seed, matmul)
  model = eqx.filter_eval_shape(pf.PhoenixModel, model_config(case), key=jax.random.key(seed))
  flops = useful_flops(model, case.batch, case.candidates)
  dense_flops = useful_flops(model, case.batch, case.candidates, dense=True)
  fast_s = result["fast"]["median_s"]
  gflops = flops / fast_s / 1e9
  matmul_gflops = 2 * matmul_size ** 3 / result["matmul_median_s"] / 1e9
  result.update(name=name, case=dataclasses.asdict(case), useful_gflop=flops / 1e9,
                dense_gflop=dense_flops / 1e9, flop_ratio=dense_flops / flops,
                speedup=result["reference"]["median_s"] / fast_s,
                candidates_per_s=case.batch * case.candidates / fast_s,
                achieved_gflops=gflops, matmul_gflops=matmul_gflops,
                mfu=gflops / matmul_gflops)
  if "one_call" in result:
    result["speedup_vs_one_call"] = result["one_call"]["median_s"] / fast_s
  return result


def kv_cache_table(case: Case) -> list[dict]:
  """KV-cache bytes per user context (`1 + S` tokens) for every KV-head count dividing H."""
  rows = []
  for kv in (k for k in range(case.q_heads, 0, -1) if case.q_heads % k == 0):
    tc = model_config(dataclasses.replace(case, kv_heads=kv)).model
    rows.append({"q_heads": case.q_heads, "kv_heads": kv, "context_len": 1 + case.history,
                 "float32_bytes": tc.kv_cache_bytes(1 + case.history, "float32"),
                 "bfloat16_bytes": tc.kv_cache_bytes(1 + case.history, "bfloat16")})
  return rows


def compile_scaling(case: Case, layer_counts: Sequence[int], seed: int) -> dict:
  """Seconds to trace + compile the fast forward at each depth (best of two)."""
  seconds = {}
  for layers in layer_counts:
    model = pf.PhoenixModel(model_config(case, layers=layers), key=jax.random.key(seed))
    batch, emb = make_inputs(model.config, case.batch, seed + 1)
    params, static = eqx.partition(model, eqx.is_array)
    seconds[str(layers)] = min(compile_fn(_logits_fn(static), params, batch, emb)[1]
                               for _ in range(2))
  shallow, deep = (str(n) for n in layer_counts)
  return {"layers": list(layer_counts), "seconds": seconds,
          "ratio": seconds[deep] / seconds[shallow], "case": dataclasses.asdict(case)}


def training_throughput(preset: str, num_seeds: int, rounds: int, chunks: int) -> dict:
  """Scanned vs plain training loop at a ranking preset (`train_throughput.measure`)."""
  config = ranking.get_config(preset)
  config.num_seeds = num_seeds
  return {"preset": preset, **train_throughput.measure(config, rounds, chunks)}


def check_args(names: Sequence[str], cases: dict[str, Case], compile_layers: Sequence[int],
               train: Sequence[tuple[str, int]], dense_iters: int) -> None:
  """Raises `ValueError` naming the first bad argument of `run_benchmark`."""
  unknown = [n for n in names if n not in cases]
  if unknown:
    raise ValueError(f"unknown configs {unknown}; choose from {sorted(cases)}")
  twice = repeated(names)
  if twice:   # (timed twice, the second result kept)
    raise ValueError(f"configs {twice} named more than once")
  if len(compile_layers) != 2:
    raise ValueError(f"compile_layers={list(compile_layers)} must name two layer counts")
  if any(n < 1 for n in compile_layers):
    raise ValueError(f"compile_layers={list(compile_layers)}: layer counts must be >= 1")
  if dense_iters < 1:
    raise ValueError(f"dense_iters={dense_iters}: the chunked case's dense reference needs "
                     "at least 1 timed call")
  for preset, num_seeds in train:
    if preset not in ranking.PRESETS:
      raise ValueError(f"train preset {preset!r}: choose from {list(ranking.PRESETS)}")
    if num_seeds < 1:
      raise ValueError(f"train seeds {num_seeds}: need at least 1")


def persistent_cache_configured() -> bool:
  """Whether JAX's config has the persistent compilation cache on (a directory set and the
  cache enabled); then compile times may be cache loads. `main` switches it off before
  compiling anything; JAX fixes its choice at a process's first compilation."""
  return bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)


def run_benchmark(names: Sequence[str], cases: dict[str, Case] = CASES, iters: int = 10,
                  warmup: int = 2, min_seconds: float = 0.0, seed: int = 0,
                  matmul_size: int = 2048,
                  compile_case: Optional[Case] = None,
                  compile_layers: Sequence[int] = (2, 12),
                  train: Sequence[tuple[str, int]] = (), train_rounds: int = 3,
                  train_chunks: int = 2, dense_iters: int = 3) -> dict:
  """Runs the named cases, the KV-cache table, (with `compile_case`) compile scaling and
  (for each `(preset, num_seeds)` of `train`) the training-loop measurement."""
  check_args(names, cases, compile_layers, train, dense_iters)
  report = {"device": str(jax.devices()[0]), "machine": provenance.machine(),
            "code": provenance.running_code_version(), "jax_version": jax.__version__,
            "persistent_compilation_cache": persistent_cache_configured(),
            "compiler_options": xla_options.compiler_options(), "matmul_size": matmul_size,
            "iters": iters, "warmup": warmup, "min_seconds": min_seconds,
            "configs": {n: bench_case(n, cases[n], iters, warmup, min_seconds, seed,
                                      matmul_size, dense_iters) for n in names}}
  kv_name = "serve" if "serve" in cases else (names or list(cases))[0]
  report["kv_cache"] = kv_cache_table(cases[kv_name])
  report["kv_cache_config"] = {"name": kv_name, "layers": cases[kv_name].layers,
                               "key_size": KEY_SIZE}
  if compile_case is not None:
    report["compile_scaling"] = compile_scaling(compile_case, compile_layers, seed)
  if train:
    report["training"] = [training_throughput(p, n, train_rounds, train_chunks)
                          for p, n in train]
  report["process_max_rss_bytes"] = max_rss_bytes()
  return report


def max_rss_bytes() -> int:
  """This process's peak resident memory in bytes (`ru_maxrss` counts bytes on macOS and
  KiB on Linux)."""
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return rss if sys.platform == "darwin" else rss * 1024


def _mib(size: float) -> float:
  return size / 2 ** 20


def format_table(report: dict) -> str:
  """The report as markdown tables (times in ms, memory in MiB)."""
  lines = _forward_lines(report) if report["configs"] else []
  kv = report.get("kv_cache_config")
  where = f" ({kv['name']}: {kv['layers']} layers, key {kv['key_size']})" if kv else ""
  lines += ["", f"| q heads | kv heads | KV cache per user context{where}, fp32 | bf16 |",
            "|---|---|---|---|"]
  for row in report["kv_cache"]:
    lines.append(f"| {row['q_heads']} | {row['kv_heads']} "
                 f"| {row['float32_bytes'] / 1024:.0f} KiB ({row['context_len']} tokens) "
                 f"| {row['bfloat16_bytes'] / 1024:.0f} KiB |")
  if "compile_scaling" in report:
    cs = report["compile_scaling"]
    shallow, deep = (str(n) for n in cs["layers"])
    lines += ["", f"compile time of the fast forward, {deep} vs {shallow} layers: "
              f"{cs['seconds'][deep]:.2f} s vs "
              f"{cs['seconds'][shallow]:.2f} s = {cs['ratio']:.2f}x"]
  if report.get("training"):
    rows = report["training"]
    join = lambda key: " / ".join(sorted({str(r[key]) for r in rows}))
    steps = ", ".join(dict.fromkeys(f"{r['preset']} {r['steps_per_round']}" for r in rows))
    lines += ["", f"training ({report['device']}, {report['machine']}, {join('fprop_dtype')}): "
              f"medians of {join('rounds')} alternating rounds (steps a round: {steps})",
              "", "| training preset | seeds | scanned loop ex/s | plain loop, numpy sampler "
              "ex/s | scanned/plain | plain loop, device-sampled ex/s | scanned/that |",
              "|---|---|---|---|---|---|---|"]
    for r in report["training"]:
      lines.append(f"| {r['preset']} | {r['num_seeds']} "
                   f"| {r['scanned_examples_per_second']:,.0f} "
                   f"| {r['plain_examples_per_second']:,.0f} | {r['speedup']:.2f}x "
                   f"| {r['plain_device_sampled_examples_per_second']:,.0f} "
                   f"| {r['speedup_vs_device_sampled']:.2f}x |")
  lines += ["", f"process peak RSS: {_mib(report['process_max_rss_bytes']):.0f} MiB"]
  return "\n".join(lines).lstrip("\n")


def _forward_lines(report: dict) -> list[str]:
  """The forward table, the paths' kinds, and the chunked case's one-call time."""
  dtypes = sorted({r[path]["fprop_dtype"] for r in report["configs"].values()
                   for path in ("fast", "reference")})
  lines = [
      f"{report['device']} ({report['machine']}), "
      f"jax {report['jax_version']}, {' and '.join(dtypes)}, compiler options "
      f"{report['compiler_options']}, median over at least "
      f"{report['iters']} rounds and {report['min_seconds']:g} s; MFU = achieved GFLOP/s / "
      f"GFLOP/s of a {report['matmul_size']}^3 matmul timed in the same rounds; dense/fast "
      f"FLOPs = matmul FLOPs the dense reference executes over the fast path's useful FLOPs",
      "",
      "| config | fast ms | dense ms | dense/fast | dense/fast FLOPs | cand/s "
      "| compile s fast / dense | peak MiB fast / dense | useful GFLOP | GFLOP/s "
      "| matmul GFLOP/s | MFU |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for name, r in report["configs"].items():
    fast, ref = r["fast"], r["reference"]
    lines.append(
        f"| {name} | {1e3 * fast['median_s']:.1f} | {1e3 * ref['median_s']:.1f} "
        f"| {r['speedup']:.2f}x | {r['flop_ratio']:.2f}x | {r['candidates_per_s']:,.0f} "
        f"| {fast['compile_s']:.1f} / {ref['compile_s']:.1f} "
        f"| {_mib(fast['peak_bytes']):.1f} / {_mib(ref['peak_bytes']):.1f} "
        f"| {r['useful_gflop']:.2f} | {r['achieved_gflops']:.0f} | {r['matmul_gflops']:.0f} "
        f"| {100 * r['mfu']:.0f}% |")
  def kind(r):
    names = {"user_groups": ("user group", "user groups"),
             "candidate_micro_batches": ("candidate micro-batch", "candidate micro-batches")}
    parts = [f"{r[k]} {names[k][r[k] > 1]}" for k in names if r.get(k, 1) > 1]
    return r["kind"] + (" in " + " x ".join(parts) if parts else "")

  refs = "; ".join(f"{n}: {kind(r['fast'])} vs {r['reference']['kind']}"
                   for n, r in report["configs"].items())
  lines += ["", f"fast vs reference: {refs}."]
  if report.get("persistent_compilation_cache"):
    lines.append("JAX's persistent compilation cache was on (JAX_COMPILATION_CACHE_DIR): the "
                 "compile times may be loads from it.")
  for name, r in report["configs"].items():
    if "one_call" in r:
      lines.append(f"{name}: {kind(r['one_call'])} {1e3 * r['one_call']['median_s']:.1f} ms "
                   f"= {r['speedup_vs_one_call']:.2f}x the chunked time; dense timed over "
                   f"{r['reference']['iters']} call{'s' * (r['reference']['iters'] != 1)}")
  return lines


def _ints(name: str) -> list[int]:
  try:
    return [int(n) for n in FLAGS[name].value]
  except ValueError:
    usage_error(f"--{name}={','.join(FLAGS[name].value)}: give integers, comma-separated")


def with_chunk_size(cases: dict[str, Case], chunk_size: Optional[int]) -> dict[str, Case]:
  """`cases` with the chunked ones scoring in chunks of `chunk_size` (None: as they are);
  the others score whole lists."""
  return {n: dataclasses.replace(c, chunk=chunk_size) if c.chunk and chunk_size else c
          for n, c in cases.items()}


def check_flags_used() -> None:
  """A `usage_error` for a flag given on the command line that this run would not read
  (`--chunk_size` without the chunked config, say): its value would be ignored without a
  word, and the results taken for what it asked."""
  chunked = [n for n in FLAGS.configs if n in CASES and CASES[n].chunk]
  readers = {"chunk_size": (chunked, "it sizes the chunks of the chunked config, and "
                            "--configs does not name it"),
             "dense_iters": (chunked, "it times the chunked config's dense reference, and "
                             "--configs does not name it"),
             "compile_layers": (FLAGS.compile_check, "--nocompile_check skips the compile "
                                "times"),
             **{f"train_{name}": (FLAGS.train_presets, "--train_presets is empty, so no "
                                  "training loop runs")
                for name in ("seeds", "rounds", "chunks")}}
  for name, (read, why) in readers.items():
    if FLAGS[name].present and not read:
      usage_error(f"--{name} would change nothing: {why}")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    usage_error(f"unexpected arguments {argv[1:]}; every option is a --flag")
  # Compile times must time compiling: with JAX's persistent compilation cache (on when
  # JAX_COMPILATION_CACHE_DIR is set) they would time loading executables from disk. JAX
  # settles whether to use the cache at the process's first compilation: this precedes it.
  jax.config.update("jax_enable_compilation_cache", False)
  cases = with_chunk_size(CASES, FLAGS.chunk_size)
  compile_layers = _ints("compile_layers")
  train = [(p, n) for p in FLAGS.train_presets for n in _ints("train_seeds")]
  if FLAGS.train_presets and not train:
    usage_error(f"--train_presets={','.join(FLAGS.train_presets)} with no --train_seeds: "
                "give seed counts, or --train_presets= to skip the training loops")
  try:
    check_args(FLAGS.configs, cases, compile_layers, train, FLAGS.dense_iters)
  except ValueError as e:
    usage_error(str(e))
  check_flags_used()
  check_output_file("out", FLAGS.out)
  with exit_on_run_errors(resumable=False):   # Ctrl-C: one line, no traceback
    report = run_benchmark(FLAGS.configs, cases, FLAGS.iters, FLAGS.warmup,
                           FLAGS.min_seconds, FLAGS.seed, FLAGS.matmul_size,
                           cases["serve"] if FLAGS.compile_check else None,
                           compile_layers, train,
                           FLAGS.train_rounds, FLAGS.train_chunks, FLAGS.dense_iters)
    report["command"] = " ".join(["python -m experiments.benchmark"] + sys.argv[1:])
    write_output_file(FLAGS.out, report)
  print(format_table(report))
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  quiet_backend_search()
  run_app(main, flags_parser=parse_flags)
