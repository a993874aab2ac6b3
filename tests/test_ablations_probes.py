"""Post-training probes and the scripts' probe, derived-metric and plot hooks, on freshly
initialised smoke-size systems (no training)."""

import dataclasses
import json
import os
from types import SimpleNamespace

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ablations import (candidate_isolation, gqa_ratio, probes, report, rope_anchoring,
                       sandwich_norm, sweep)
from conftest import ranking_config
import phoenix_flax as pf
from phoenix_flax.synthetic import SplitConfig, WorldConfig, make_world
from phoenix_flax.training import make_system, parse_config
from phoenix_flax.types import CANDIDATE_BATCH_FIELDS, RecsysBatch


def context(module, arm, tmp_path):
  """A RunContext of a fresh (untrained) system of one arm at the smoke preset, with the
  forward in float32, which the tolerances here are for (None means bfloat16 on GPU/TPU)."""
  sw = sweep.Sweep(module.ABLATION, "smoke", str(tmp_path))
  variant = next(v for v in sw.variants if v.arm == arm)
  config = sw.config(variant)
  config.model.fprop_dtype = "float32"
  spec = parse_config(config)
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


def test_slot_sensitivity_averages_valid_candidates_only(rope_contexts):
  """On a padded list: the figure is the mean of per-candidate figures over the mask, and
  what the padded slots hold does not count (isolation: nothing reaches the valid ones)."""
  ctx = rope_contexts["sequential"]
  first = probes.eval_batches(ctx.spec, ctx.world, ctx.spec.eval_splits["eval"])[0]
  batch = first.batch
  C = first.candidate_mask.shape[1]
  last_C = jnp.arange(C) == C - 1
  padded = batch._replace(
      candidate_post_hashes=jnp.where(last_C[None, :, None], 0, batch.candidate_post_hashes),
      candidate_author_hashes=jnp.where(last_C[None, :, None], 1 + batch.candidate_author_hashes,
                                        batch.candidate_author_hashes))
  valid = first.candidate_mask & ~last_C[None, :]
  early = valid & (jnp.arange(C) < (C - 1) // 2)[None, :]
  late = valid & ~early
  sens = lambda b, m: probes.slot_sensitivity(ctx.system, b, m)
  on_valid = sens(padded, valid)
  assert on_valid > 1e-4
  np.testing.assert_allclose(on_valid, sens(batch, valid), rtol=1e-6)
  n_early, n_late = int(early.sum()), int(late.sum())
  assert n_early and n_late
  by_part = (n_early * sens(padded, early) + n_late * sens(padded, late)) / (n_early + n_late)
  np.testing.assert_allclose(on_valid, by_part, rtol=1e-5)
  assert sens(padded, early) != sens(padded, late)
  assert sens(padded, jnp.zeros_like(valid)) == 0.0


def test_chunked_scoring_matches_whole_lists_only_with_isolation(tmp_path):
  moved = {}
  for arm in ("isolated", "causal"):
    ctx = context(candidate_isolation, arm, tmp_path)
    out = candidate_isolation.probe(ctx)["chunked"]
    assert set(out) >= {"auc_mean", "calibration_error", "max_logit_change"}
    moved[arm] = out["max_logit_change"]
  assert moved["isolated"] < 1e-5
  assert moved["causal"] > 1e-3


def test_chunked_scoring_reports_the_largest_change_of_any_batch(monkeypatch):
  """max_logit_change is the largest over the batches, not the first's or last's, and a
  masked candidate's change does not count."""
  changes = [0.1, 0.5, 0.2]
  mask = jnp.array([[True, False]])
  batches = [SimpleNamespace(batch=i, candidate_mask=mask) for i in range(3)]
  monkeypatch.setattr(probes, "logits", lambda system, batch: jnp.zeros((1, 2, 3)))
  monkeypatch.setattr(probes, "chunked_logits", lambda system, batch, size: jnp.zeros(
      (1, 2, 3)).at[0, 0].set(changes[batch]).at[0, 1].set(9.0))
  pooled = []
  monkeypatch.setattr(probes, "pooled_shift_metrics",
                      lambda logits_list, bs: pooled.append(list(logits_list)) or {})
  out = probes.chunked_scoring("system", batches, chunk_size=1)
  assert out == {"max_logit_change": pytest.approx(0.5)}
  # The metrics are those of the chunked scores, not of the whole lists'.
  [scored] = pooled
  assert [float(x[0, 0, 0]) for x in scored] == pytest.approx(changes)


def test_gqa_probe_counts_parameters_and_cache(tmp_path):
  found = {arm: gqa_ratio.probe(context(gqa_ratio, arm, tmp_path)) for arm in ("kv8", "kv1")}
  ctx = context(gqa_ratio, "kv8", tmp_path)
  tc = ctx.spec.model.model
  S = ctx.spec.world.history_len
  itemsize = jnp.dtype(ctx.spec.model.fprop_dtype).itemsize      # the forward's dtype
  assert found["kv8"]["kv_cache_bytes"] == 2 * tc.num_layers * 8 * tc.key_size * (1 + S) * itemsize
  assert found["kv1"]["kv_cache_bytes"] * 8 == found["kv8"]["kv_cache_bytes"]
  # q|k|v fused projection: (8 + 2 * KV) * key_size columns per layer.
  saved = tc.num_layers * tc.emb_size * 2 * (8 - 1) * tc.key_size
  assert found["kv8"]["params/transformer"] - found["kv1"]["params/transformer"] == saved
  # The total holds the transformer, the rest of the model and the hash tables (one
  # [buckets, D] table per entity type); only the transformer changes between arms.
  w, D = ctx.spec.world, ctx.spec.model.emb_size
  tables = (w.user_buckets + w.post_buckets + w.author_buckets) * D
  assert found["kv8"]["params/total"] - found["kv1"]["params/total"] == saved
  assert found["kv8"]["params/total"] > found["kv8"]["params/transformer"] + tables


def test_gqa_joint_probe_times_every_variant_of_a_seed(tmp_path, monkeypatch):
  contexts = [context(gqa_ratio, arm, tmp_path) for arm in ("kv8", "kv2", "kv1")]
  seen = {}

  def fake_throughput(systems, batch):
    seen.update(systems=systems, batch=batch)
    return {name: 1000.0 * (i + 1) for i, name in enumerate(systems)}

  monkeypatch.setattr(probes, "scoring_throughput", fake_throughput)
  found = gqa_ratio.joint_probe(contexts)
  assert found == [{"scoring_candidates_per_s": v} for v in (1000.0, 2000.0, 3000.0)]
  assert list(seen["systems"]) == ["kv8", "kv2", "kv1"]
  assert all(seen["systems"][c.variant.name] is c.system for c in contexts)
  other = context(gqa_ratio, "kv4", tmp_path)
  other = dataclasses.replace(other, spec=dataclasses.replace(
      other.spec, world=dataclasses.replace(other.spec.world, num_users=7)))
  with pytest.raises(ValueError, match="worlds differ"):
    gqa_ratio.joint_probe(contexts + [other])


def test_count_params():
  tree = {"a": jax.numpy.zeros((2, 3)), "b": [jax.numpy.zeros(4), "not an array", 7],
          "c": jax.numpy.zeros(5, jax.numpy.int32)}
  assert probes.count_params(tree) == 15


def test_sandwich_derived_metrics_and_rms_plot(tmp_path, monkeypatch):
  found = {"residual_rms/layer_0": 1.0, "residual_rms/layer_1": 1.5, "residual_rms/layer_2": 3.0}
  assert sandwich_norm.derived(found) == {"residual_rms/last": 3.0, "residual_rms/growth": 3.0}
  assert sandwich_norm.derived({}) == {"residual_rms/last": None, "residual_rms/growth": None}
  # A first layer's RMS of 0 (a rezero stream at init): no growth ratio, not a crash.
  assert sandwich_norm.derived({"residual_rms/layer_0": 0.0, "residual_rms/layer_1": 2.0}) == {
      "residual_rms/last": 2.0, "residual_rms/growth": None}
  variants = {}
  for arm in ("sandwich", "post"):
    name = f"{arm}_L3_lr0.003"
    variants[name] = {"arm": arm, "cell": "L3_lr0.003", "seeds": [0, 1]}
    for seed in (0, 1):
      run_dir = tmp_path / name / f"seed_{seed}"
      run_dir.mkdir(parents=True)
      diverged = arm == "post" and seed == 1   # its RMS values stay out of the plot
      (run_dir / "result.json").write_text(json.dumps(
          {"final": {k: v * (2 if arm == "post" else 1) * (1e6 if diverged else 1)
                     for k, v in found.items()},
           "diverged": diverged, "diverged_at_step": 5 if diverged else None, "steps": 20,
           "wall_seconds": 1.0, "examples_per_second": 10.0}))
  figures = []
  real_save = report.save_figure

  def save_figure(fig, path):
    figures.append(fig)
    real_save(fig, path)
  monkeypatch.setattr(report, "save_figure", save_figure)
  assert sandwich_norm.plot_rms({"variants": variants}, str(tmp_path)) == "residual_rms.png"
  assert os.path.getsize(tmp_path / "residual_rms.png") > 1000
  (axes,) = figures[0].axes
  lines = {line.get_label(): list(line.get_ydata()) for line in axes.get_lines()}
  assert lines == {"sandwich": [1.0, 1.5, 3.0], "post": [2.0, 3.0, 6.0]}


def test_gqa_tradeoff_plot(tmp_path):
  summary = lambda mean: {"mean": mean, "ci95": [mean - 0.01, mean + 0.01], "n": 3}
  results = {"variants": {f"kv{k}": {"metrics": {"auc_mean": summary(0.7 + k / 100),
                                                 "kv_cache_bytes": summary(1000.0 * k),
                                                 "params/transformer": summary(5000.0 + k)}}
                          for k in (8, 1)}}
  assert gqa_ratio.plot_tradeoff(results, str(tmp_path)) == "gqa_tradeoff.png"
  assert os.path.getsize(tmp_path / "gqa_tradeoff.png") > 1000


def test_gqa_tradeoff_plot_keeps_seed_noise_from_filling_the_panel(tmp_path, drawn_figures):
  """Means 0.0007 apart: each panel's AUC axis still spans at least ±0.02 about them."""
  summary = lambda mean: {"mean": mean, "ci95": [mean - 0.0005, mean + 0.0005], "n": 3}
  results = {"variants": {f"kv{k}": {"metrics": {"auc_mean": summary(0.7 + k / 10000),
                                                 "kv_cache_bytes": summary(1000.0 * k),
                                                 "params/transformer": summary(5000.0 + k)}}
                          for k in (8, 1)}}
  gqa_ratio.plot_tradeoff(results, str(tmp_path))
  middle = 0.7 + 9 / 20000
  for ax in drawn_figures[0].axes:
    lo, hi = ax.get_ylim()
    assert lo <= middle - 0.02 + 1e-9 and hi >= middle + 0.02 - 1e-9, (lo, hi)


def test_scoring_throughput_times_the_systems_together(tmp_path, monkeypatch):
  contexts = {arm: context(gqa_ratio, arm, tmp_path) for arm in ("kv8", "kv1")}
  batch = probes.eval_batches(contexts["kv8"].spec, contexts["kv8"].world,
                              contexts["kv8"].spec.eval_splits["eval"])[0].batch
  seen = {}

  def fake_rounds(calls, iters, warmup, min_seconds):
    seen.update(iters=iters, warmup=warmup, min_seconds=min_seconds)
    seen["logits"] = {name: call() for name, call in calls.items()}
    return {"kv8": 0.5, "kv1": 0.25}

  monkeypatch.setattr(probes.timing, "time_rounds", fake_rounds)
  B, C = batch.candidate_post_hashes.shape[:2]
  found = probes.scoring_throughput({k: c.system for k, c in contexts.items()}, batch,
                                    min_seconds=0.3)
  assert found == {"kv8": B * C / 0.5, "kv1": B * C / 0.25}
  # One interleaved timing of both, with the time floor per system.
  assert seen["min_seconds"] == 0.6 and seen["iters"] >= 5 and seen["warmup"] >= 1
  # Each timed call is its own system's forward (compiled with the package's options),
  # equal to the probe's forward to float32 rounding (logits up to about 20 here).
  for arm, ctx in contexts.items():
    np.testing.assert_allclose(seen["logits"][arm], probes.logits(ctx.system, batch),
                               rtol=1e-5, atol=1e-5)


def test_probe_eval_batches_are_the_runners(rope_contexts):
  """Probes measure the lists the run's own evaluation scored: same keys, same sampling
  (the same ids, hashes and labels; floats to rounding, as the programs compile apart)."""
  from phoenix_flax.training import Trainer
  ctx = rope_contexts["sequential"]
  trainer, split = Trainer(ctx.spec), ctx.spec.eval_splits["eval"]
  mine = probes.eval_batches(ctx.spec, ctx.world, split)
  sample = eqx.filter_jit(lambda world, key: trainer._sample_eval(world, split, key))
  runners = [sample(ctx.world, key) for key in trainer._eval_keys()]
  assert len(mine) == len(runners) == ctx.spec.config.train.eval_batches
  for a, b in zip(mine, runners):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      if np.asarray(x).dtype.kind == "f":
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
      else:
        np.testing.assert_array_equal(x, y)


def _batch(post_hashes, user_hashes=None):
  """A RecsysBatch with candidate post hashes [B, C, 1] (and user hashes [B, 1]) only."""
  B = post_hashes.shape[0]
  user = jnp.ones((B, 1), jnp.int32) if user_hashes is None else user_hashes
  return RecsysBatch(user, None, None, None, None, post_hashes, None, None, None, None, None)


class _SlotSystem(eqx.Module):
  """Logit = the candidate's own value (from its hash) + an effect of its slot per action."""
  slot_effect_CA: jax.Array

  def __call__(self, batch):
    own_BC = 1.7 + 0.1 * batch.candidate_post_hashes[..., 0].astype(jnp.float32)
    return own_BC[..., None] + self.slot_effect_CA[None]


def test_slot_sensitivity_is_the_std_of_the_slot_effect():
  """A system whose logits are a candidate's own value plus an effect of its slot: rotating
  the list moves each candidate through every slot, so its figure is the (population) std
  of the slot effect, per action, averaged over actions; exactly 0 with no slot effect."""
  C = 8
  batch = _batch(jnp.arange(1, 2 * C + 1, dtype=jnp.int32).reshape(2, C, 1) % 5)
  mask = jnp.ones((2, C), bool)
  effect = np.stack([0.5 * np.arange(C) ** 2, np.zeros(C)], axis=1).astype(np.float32)
  found = probes.slot_sensitivity(_SlotSystem(jnp.asarray(effect)), batch, mask)
  np.testing.assert_allclose(found, (np.std(effect[:, 0]) + 0.0) / 2, rtol=1e-5)
  assert probes.slot_sensitivity(_SlotSystem(jnp.zeros((C, 2))), batch, mask) == 0.0


def test_max_abs_logit_diff_counts_valid_candidates_only():
  a = jnp.asarray([[[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]])
  b = jnp.asarray([[[1.0, -0.25], [2.5, 0.0], [100.0, 0.0]]])
  assert probes.max_abs_logit_diff(a, b, jnp.asarray([[True, True, False]])) == 0.5
  assert probes.max_abs_logit_diff(a, b, jnp.asarray([[True, False, False]])) == 0.25


def test_pooled_shift_metrics_pool_lists_and_compare_logits_with_labels():
  """Two lists of one action, each ranked perfectly by its logits, but not when pooled:
  the AUC pools candidates of every list (positives 5, 1; negatives 4, 0: 3 of 4 pairs);
  the true probabilities rank them backwards (Bayes AUC 0); a padded candidate counts
  nowhere."""
  mask = jnp.asarray([[True, True, False]])
  logits = [jnp.asarray([[[5.0], [4.0], [0.0]]]), jnp.asarray([[[1.0], [0.0], [9.0]]])]
  batches = [SimpleNamespace(labels=jnp.asarray([[[1.0], [0.0], [0.0]]]),
                             probs=jnp.asarray([[[0.3], [0.8], [0.5]]]), candidate_mask=mask),
             SimpleNamespace(labels=jnp.asarray([[[1.0], [0.0], [0.0]]]),
                             probs=jnp.asarray([[[0.2], [0.9], [0.5]]]), candidate_mask=mask)]
  found = probes.pooled_shift_metrics(logits, batches)
  assert found["auc_mean"] == pytest.approx(0.75)
  assert found["bayes_auc_mean"] == pytest.approx(0.0)
  x, y = np.array([5.0, 4.0, 1.0, 0.0]), np.array([1.0, 0.0, 1.0, 0.0])
  logloss = -np.mean(y * np.log(1 / (1 + np.exp(-x))) + (1 - y) * np.log(1 / (1 + np.exp(x))))
  assert found["logloss"] == pytest.approx(logloss, rel=1e-5)


def test_probes_measure_the_in_distribution_lists(monkeypatch):
  """rope_anchoring's slot sensitivity is of the first in-distribution ("eval") list batch,
  not a shifted split's; candidate_isolation scores every eval batch in chunks of C/4 (C
  the eval split's width: the world's unless the split sets its own)."""
  spec = SimpleNamespace(eval_splits={"eval": SplitConfig(), "long_history": SplitConfig()},
                         world=WorldConfig(num_candidates=12))
  ctx = SimpleNamespace(spec=spec, world="world", system="system")
  batches = {label: [SimpleNamespace(batch=f"{label} {i}", candidate_mask=f"mask {i}")
                     for i in range(3)] for label in ("in-distribution", "shifted")}
  seen = {}
  monkeypatch.setattr(probes, "eval_batches", lambda s, w, split: batches[
      "in-distribution" if split is spec.eval_splits["eval"] else "shifted"])
  monkeypatch.setattr(probes, "slot_sensitivity",
                      lambda system, batch, mask: seen.update(slot=(system, batch, mask)) or 0.5)
  monkeypatch.setattr(probes, "chunked_scoring",
                      lambda system, bs, chunk: seen.update(chunked=(system, bs, chunk)) or {})
  assert rope_anchoring.probe(ctx) == {"slot_sensitivity": 0.5}
  assert seen["slot"] == ("system", "in-distribution 0", "mask 0")
  assert candidate_isolation.probe(ctx) == {"chunked": {}}
  assert seen["chunked"] == ("system", batches["in-distribution"], 3)
  spec.eval_splits["eval"] = SplitConfig(num_candidates=20)
  candidate_isolation.probe(ctx)
  assert seen["chunked"] == ("system", batches["in-distribution"], 5)


def test_candidate_isolation_derived_shift_mean_and_consistency_metric(tmp_path):
  found = {"long_list/auc_mean": 0.6, "by_relevance/auc_mean": 0.7,
           "random_companions/auc_mean": 0.95}
  assert candidate_isolation.derived(found)["shift_mean/auc_mean"] == pytest.approx(0.75)
  del found["by_relevance/auc_mean"]
  assert candidate_isolation.derived(found) == {"shift_mean/auc_mean": None}
  # score_consistency, one of its metrics, is measured only when the config asks for it.
  assert sweep.Sweep(candidate_isolation.ABLATION, "smoke", str(tmp_path)).base.train \
      .score_consistency is True


def test_candidate_slice_cuts_every_candidate_field():
  """Post timestamps too (post age on): an unsliced one would pair chunk k's candidates
  with the first chunk's ages."""
  config = ranking_config(candidates=8, post_age_granularity_mins=60)
  batch, _ = pf.example_batch(config, 2, jax.random.key(0))
  part = probes.candidate_slice(batch, 2, 6)
  for field in CANDIDATE_BATCH_FIELDS:
    np.testing.assert_array_equal(getattr(part, field), getattr(batch, field)[:, 2:6],
                                  err_msg=field)
  assert part.history_post_hashes is batch.history_post_hashes


def test_scoring_throughput_defaults_are_the_documented_ones(monkeypatch):
  """At least 10 rounds, until the timed calls add up to 0.5 s per system."""
  seen = {}

  def fake_rounds(calls, iters, warmup, min_seconds):
    seen.update(iters=iters, min_seconds=min_seconds)
    return {name: 1.0 for name in calls}
  monkeypatch.setattr(probes.timing, "time_rounds", fake_rounds)
  batch = _batch(jnp.ones((2, 4, 1), jnp.int32))
  systems = {"a": _SlotSystem(jnp.zeros((4, 1))), "b": _SlotSystem(jnp.ones((4, 1)))}
  assert probes.scoring_throughput(systems, batch) == {"a": 8.0, "b": 8.0}
  assert seen == {"iters": 10, "min_seconds": 1.0}


def test_scoring_throughput_times_the_forward_compiled_with_the_package_options(monkeypatch):
  """The timed calls run the program `xla_options.filter_jit` compiled (the options the
  training, evaluation and serving programs get), not a plain jit of the forward."""
  from phoenix_flax import xla_options
  ran, real = [], xla_options.filter_jit

  def spy(fn, **kwargs):
    compiled = real(fn, **kwargs)
    return lambda *args, **kw: ran.append(1) or compiled(*args, **kw)
  monkeypatch.setattr(xla_options, "filter_jit", spy)
  monkeypatch.setattr(probes.timing, "time_rounds",
                      lambda calls, **kw: {n: (c(), 1.0)[1] for n, c in calls.items()})
  probes._timed_logits.cache_clear()
  try:
    batch = _batch(jnp.ones((2, 4, 1), jnp.int32))
    probes.scoring_throughput({"a": _SlotSystem(jnp.zeros((4, 1))),
                               "b": _SlotSystem(jnp.ones((4, 1)))}, batch)
  finally:
    probes._timed_logits.cache_clear()   # drop the spy's program for later tests
  assert len(ran) == 2


def test_pooled_shift_metrics_pool_batches_of_different_sizes():
  """A smaller last batch pools like one batch of all the lists."""
  def batch(B):
    return SimpleNamespace(labels=jnp.tile(jnp.asarray([[[1.0], [0.0]]]), (B, 1, 1)),
                           probs=jnp.full((B, 2, 1), 0.5), candidate_mask=jnp.ones((B, 2), bool))
  logits = lambda B: jnp.tile(jnp.asarray([[[2.0], [-1.0]]]), (B, 1, 1))
  found = probes.pooled_shift_metrics([logits(2), logits(1)], [batch(2), batch(1)])
  assert found == pytest.approx(probes.pooled_shift_metrics([logits(3)], [batch(3)]))


def test_chunked_probe_of_lists_shorter_than_four_scores_one_candidate_at_a_time(monkeypatch):
  spec = SimpleNamespace(eval_splits={"eval": SplitConfig(num_candidates=3)},
                         world=WorldConfig(num_candidates=12))
  ctx = SimpleNamespace(spec=spec, world="world", system="system")
  monkeypatch.setattr(probes, "eval_batches", lambda s, w, split: ["batch"])
  monkeypatch.setattr(probes, "chunked_scoring", lambda system, bs, chunk: {"chunk": chunk})
  assert candidate_isolation.probe(ctx) == {"chunked": {"chunk": 1}}


def test_gqa_kv_cache_bytes_are_in_the_forward_dtype(tmp_path):
  """bfloat16 (the forward on GPU/TPU) holds half the bytes of float32."""
  sw = sweep.Sweep(gqa_ratio.ABLATION, "smoke", str(tmp_path))
  variant, found = sw.variants[0], {}
  for dtype in ("float32", "bfloat16"):
    config = sw.config(variant)
    config.model.fprop_dtype = dtype
    spec = parse_config(config)
    ctx = sweep.RunContext(str(tmp_path), 0, variant, "smoke", spec, None,
                           make_system(spec, jax.random.PRNGKey(0)))
    found[dtype] = gqa_ratio.probe(ctx)["kv_cache_bytes"]
  assert found["bfloat16"] * 2 == found["float32"]


def test_gqa_tradeoff_plot_skips_a_variant_without_its_x_value(tmp_path):
  s = lambda m: {"mean": m, "ci95": None if m is None else [m - 0.01, m + 0.01], "n": 3}
  results = {"variants": {
      "kv8": {"metrics": {"auc_mean": s(0.78), "kv_cache_bytes": s(8000.0),
                          "params/transformer": s(5008.0)}},
      "kv1": {"metrics": {"auc_mean": s(0.77), "kv_cache_bytes": s(None),
                          "params/transformer": s(None)}}}}
  assert gqa_ratio.plot_tradeoff(results, str(tmp_path)) == "gqa_tradeoff.png"
  assert os.path.getsize(tmp_path / "gqa_tradeoff.png") > 1000


def test_rms_plot_draws_the_mean_over_seeds(tmp_path, drawn_figures):
  """Three seeds (the cpu preset's), one an outlier: the mean, not the median."""
  for seed, scale in enumerate((1.0, 1.0, 4.0)):
    run_dir = tmp_path / "sandwich_L2" / f"seed_{seed}"
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps(
        {"final": {"residual_rms/layer_0": scale, "residual_rms/layer_1": 2.0 * scale},
         "diverged": False, "diverged_at_step": None, "steps": 20, "wall_seconds": 1.0,
         "examples_per_second": 10.0}))
  sandwich_norm.plot_rms({"variants": {"sandwich_L2": {"arm": "sandwich", "cell": "L2",
                                                       "seeds": [0, 1, 2]}}}, str(tmp_path))
  (axes,) = drawn_figures[0].axes
  assert list(axes.get_lines()[0].get_ydata()) == pytest.approx([2.0, 4.0])
