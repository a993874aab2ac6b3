"""Post-training probes and the scripts' probe, derived-metric and plot hooks, on freshly
initialised smoke-size systems (no training)."""

import json
import os

import jax
import pytest

from ablations import (candidate_isolation, gqa_ratio, probes, rope_anchoring,
                       sandwich_norm, sweep)
from phoenix_flax.synthetic import make_world
from phoenix_flax.training import make_system, parse_config


def context(module, arm, tmp_path):
  """A RunContext of a fresh (untrained) system of one arm at the smoke preset."""
  sw = sweep.Sweep(module.ABLATION, "smoke", str(tmp_path))
  variant = next(v for v in sw.variants if v.arm == arm)
  spec = parse_config(sw.config(variant))
  world = make_world(spec.world, jax.random.PRNGKey(spec.config.world_seed))
  system = make_system(spec, jax.random.PRNGKey(0))
  return sweep.RunContext(str(tmp_path), 0, variant, "smoke", spec, world, system)


@pytest.fixture(scope="module")
def rope_contexts(tmp_path_factory):
  path = tmp_path_factory.mktemp("rope")
  return {arm: context(rope_anchoring, arm, path) for arm in ("sequential", "right_anchored")}


def test_slot_sensitivity_is_zero_only_when_slots_share_a_position(rope_contexts):
  found = {arm: rope_anchoring.probe(ctx)["slot_sensitivity"]
           for arm, ctx in rope_contexts.items()}
  assert found["right_anchored"] == 0.0       # equal logits in every slot, bit for bit
  assert found["sequential"] > 1e-4


def test_chunked_scoring_matches_whole_lists_only_with_isolation(tmp_path):
  moved = {}
  for arm in ("isolated", "causal"):
    ctx = context(candidate_isolation, arm, tmp_path)
    out = candidate_isolation.probe(ctx)["chunked"]
    assert set(out) >= {"auc_mean", "calibration_error", "max_logit_change"}
    moved[arm] = out["max_logit_change"]
  assert moved["isolated"] < 1e-5
  assert moved["causal"] > 1e-3


def test_gqa_probe_counts_parameters_and_cache(tmp_path):
  found = {arm: gqa_ratio.probe(context(gqa_ratio, arm, tmp_path)) for arm in ("kv8", "kv1")}
  ctx = context(gqa_ratio, "kv8", tmp_path)
  tc = ctx.spec.model.model
  S = ctx.spec.world.history_len
  assert found["kv8"]["kv_cache_bytes"] == 2 * tc.num_layers * 8 * tc.key_size * (1 + S) * 4
  assert found["kv1"]["kv_cache_bytes"] * 8 == found["kv8"]["kv_cache_bytes"]
  # q|k|v fused projection: (8 + 2 * KV) * key_size columns per layer.
  saved = tc.num_layers * tc.emb_size * 2 * (8 - 1) * tc.key_size
  assert found["kv8"]["params/transformer"] - found["kv1"]["params/transformer"] == saved
  assert found["kv8"]["params/total"] > found["kv8"]["params/transformer"]
  assert found["kv1"]["scoring_candidates_per_s"] > 0


def test_count_params():
  tree = {"a": jax.numpy.zeros((2, 3)), "b": [jax.numpy.zeros(4), "not an array", 7]}
  assert probes.count_params(tree) == 10


def test_sandwich_derived_metrics_and_rms_plot(tmp_path):
  found = {"residual_rms/layer_0": 1.0, "residual_rms/layer_1": 1.5, "residual_rms/layer_2": 3.0}
  assert sandwich_norm.derived(found) == {"residual_rms/last": 3.0, "residual_rms/growth": 3.0}
  assert sandwich_norm.derived({}) == {"residual_rms/last": None, "residual_rms/growth": None}
  variants = {}
  for arm in ("sandwich", "post"):
    name = f"{arm}_L3_lr0.003"
    variants[name] = {"arm": arm, "cell": "L3_lr0.003", "seeds": [0]}
    run_dir = tmp_path / name / "seed_0"
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps(
        {"final": {k: v * (2 if arm == "post" else 1) for k, v in found.items()},
         "diverged": False}))
  assert sandwich_norm.plot_rms({"variants": variants}, str(tmp_path)) == "residual_rms.png"
  assert os.path.getsize(tmp_path / "residual_rms.png") > 1000


def test_gqa_tradeoff_plot(tmp_path):
  summary = lambda mean: {"mean": mean, "ci95": [mean - 0.01, mean + 0.01], "n": 3}
  results = {"variants": {f"kv{k}": {"metrics": {"auc_mean": summary(0.7 + k / 100),
                                                 "kv_cache_bytes": summary(1000.0 * k),
                                                 "params/transformer": summary(5000.0 + k)}}
                          for k in (8, 1)}}
  assert gqa_ratio.plot_tradeoff(results, str(tmp_path)) == "gqa_tradeoff.png"
  assert os.path.getsize(tmp_path / "gqa_tradeoff.png") > 1000


def test_scoring_throughput_is_candidates_over_the_median_call(tmp_path, monkeypatch):
  ctx = context(gqa_ratio, "kv1", tmp_path)
  batch = probes.eval_batches(ctx.spec, ctx.world, ctx.spec.eval_splits["eval"])[0].batch
  seen = {}

  def fake_rounds(calls, iters, warmup, min_seconds):
    seen.update(iters=iters, warmup=warmup, min_seconds=min_seconds)
    (call,) = calls.values()
    seen["logits"] = call()
    return {name: 0.25 for name in calls}

  monkeypatch.setattr(probes.timing, "time_rounds", fake_rounds)
  B, C = batch.candidate_post_hashes.shape[:2]
  assert probes.scoring_throughput(ctx.system, batch, min_seconds=0.3) == B * C / 0.25
  assert seen["min_seconds"] == 0.3 and seen["iters"] >= 5 and seen["warmup"] >= 1
  # The timed call is the system's forward (compiled with the package's options).
  assert jax.numpy.allclose(seen["logits"], probes.logits(ctx.system, batch), atol=1e-6)
