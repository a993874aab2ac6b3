"""Measures what the order of the token projections' roundings costs in fidelity and time
(docs/performance.md, "Input projection"). Not a test; run from the repository root:

    python tests/projection_order.py              # fidelity table, then timing at 1k, serve
    python tests/projection_order.py --no-timing

Fidelity: a random release tree (the parity tests' scaling) imported into both attention
paths, 32 history items, 8 candidates, 4 users, three draws per size; the largest |logit
difference| to the jitted Haiku reference (`tests/haiku_reference.py`) with the package's
projection (one product over the concatenated embeddings, as the release) and with the
alternative it replaced (a sum of one product per embedding), beside the reference's own
jitted-vs-eager difference. Timing: the benchmark's fast path at `1k` and `serve`, both
projections compiled in one process and timed in alternating rounds.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import haiku_reference as ref  # noqa: E402
import phoenix_flax as pf  # noqa: E402
from phoenix_flax import haiku_compat, ranking  # noqa: E402
from test_haiku_compat import _random_tree, larger_inputs  # noqa: E402

ONE_PRODUCT = ranking.project_parts


def per_part_sum(parts, proj):
  """The replaced projection: each embedding times its rows of `proj`, summed."""
  out, start = None, 0
  for part in parts:
    width = part.shape[-1]
    term = part.astype(proj.dtype) @ proj[start:start + width]
    out = term if out is None else out + term
    start += width
  return out


PROJECTIONS = {"one product": ONE_PRODUCT, "per-part sum": per_part_sum}


def _forward(model, batch, emb, projection):
  ranking.project_parts = projection
  try:   # a fresh function, so that it is traced with this projection
    return np.asarray(jax.jit(lambda m, b, e: m(b, e).logits)(model, batch, emb))
  finally:
    ranking.project_parts = ONE_PRODUCT


def fidelity(D, layers, seed, S=32, C=8, B=4):
  rng = np.random.default_rng(seed)
  batch, emb = larger_inputs(rng, D, S, C, B)
  shape = dict(emb_size=D, key_size=D // 2 if D == 64 else 64, num_q_heads=4, num_kv_heads=2,
               num_layers=layers, widening_factor=2.0, attn_output_multiplier=0.125)
  transformed = ref.ranking_transform(ref.ReferenceConfig(**shape))
  init = jax.eval_shape(transformed.init, jax.random.PRNGKey(0), batch, emb)
  tree = _random_tree(init, rng)
  want = np.asarray(jax.jit(transformed.apply)(tree, batch, emb))
  eager = np.asarray(transformed.apply(tree, batch, emb))
  row = {"reference jitted vs eager": np.abs(want - eager).max()}
  for impl in ("dense", "isolated"):
    config = pf.PhoenixModelConfig(model=pf.TransformerConfig(**shape), emb_size=D,
                                   history_seq_len=S, candidate_seq_len=C,
                                   attention_impl=impl)
    model = haiku_compat.ranking_model_from_haiku(tree, config)
    for label, projection in PROJECTIONS.items():
      row[f"{label}, {impl}"] = np.abs(_forward(model, batch, emb, projection) - want).max()
  return row


def timing(name):
  from experiments import benchmark
  from experiments.timing import time_rounds
  case = benchmark.CASES[name]
  batch, emb = benchmark.make_inputs(benchmark.model_config(case), case.batch, 1)
  model = pf.PhoenixModel(benchmark.model_config(case), key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_array)
  calls, peaks = {}, {}
  for label, projection in PROJECTIONS.items():
    ranking.project_parts = projection
    try:
      exe, _, peaks[label] = benchmark.compile_fn(benchmark._logits_fn(static), params,
                                                  batch, emb)
    finally:
      ranking.project_parts = ONE_PRODUCT
    calls[label] = lambda exe=exe: exe(params, batch, emb)
  medians = time_rounds(calls, iters=20, warmup=3, min_seconds=10)
  one, part = medians["one product"], medians["per-part sum"]
  print(f"{name}: one product {one * 1e3:.1f} ms, per-part sum {part * 1e3:.1f} ms "
        f"({one / part:.3f}x); peak {peaks['one product'] / 2**20:.1f} vs "
        f"{peaks['per-part sum'] / 2**20:.1f} MiB", flush=True)


def main():
  print(f"{jax.devices()[0].device_kind}; max |logit difference| to the jitted reference")
  for D, layers in ((64, 2), (128, 2), (256, 2), (256, 4)):
    for seed in range(3):
      row = fidelity(D, layers, seed)
      print(f"D={D} layers={layers} draw {seed}: "
            + ", ".join(f"{k} {v:.2e}" for k, v in row.items()), flush=True)
  if "--no-timing" not in sys.argv[1:]:
    for name in ("1k", "serve"):
      timing(name)


if __name__ == "__main__":
  main()
