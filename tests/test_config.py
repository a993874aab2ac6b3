"""Config defaults, ffn_size and validation messages."""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

import phoenix_flax as pf
from phoenix_flax import haiku_compat
from conftest import ranking_config, retrieval_config, transformer_config


@pytest.mark.parametrize("emb_size, widening, expected",
                         [(128, 4.0, 344), (256, 2, 344), (64, 2, 88), (32, 2.0, 48),
                          (48, 2.0, 64), (12, 1.0, 8),   # already multiples of 8
                          (10, 3.75, 24)])   # int(37.5) * 2 // 3 = 24, not int(75) // 3 = 25
def test_ffn_size(emb_size, widening, expected):
  assert pf.ffn_size(emb_size, widening) == expected
  cfg = transformer_config(emb_size=emb_size, widening_factor=widening)
  assert cfg.ffn_size == expected


@pytest.mark.parametrize("emb_size, widening, match",
                         [(-128, 4.0, "emb_size"), (0, 4.0, "emb_size"), (64.0, 2.0, "emb_size"),
                          (True, 2.0, "emb_size"), (64, -1.0, "widening_factor"),
                          (64, 0, "widening_factor"), (64, "2", "widening_factor"),
                          (64, float("nan"), "widening_factor")])
def test_ffn_size_refuses_bad_arguments(emb_size, widening, match):
  # -128 used to give a hidden width of -336, 0 a width of 0.
  with pytest.raises(ValueError, match=match):
    pf.ffn_size(emb_size, widening)


def test_defaults_are_the_release_forward_pass_except_dtype_and_init():
  tc = transformer_config()
  assert tc.attn_logit_cap == 30.0
  assert tc.norm_layout == "sandwich"
  assert tc.param_init == "variance_scaling"       # the release's zeros: no transformer gradient
  cfg = ranking_config(transformer=tc)
  assert cfg.right_anchored_rope is False
  assert cfg.candidate_isolation is True
  assert cfg.attention_impl == "isolated"
  assert cfg.fprop_dtype == "float32"               # the release runs bfloat16
  assert cfg.hash_config == pf.HashConfig(2, 2, 2)
  assert cfg.candidate_start_offset == 1 + cfg.history_seq_len
  # Defaults the tree does not carry (docs/models.md): the release's TransformerConfig
  # multiplies the logits by 1.0 unless its config sets a value, and its NormConfig
  # clips continuous values at 30 on a linear scale.
  bare = dict(emb_size=32, key_size=8, num_q_heads=4, num_kv_heads=2, num_layers=1)
  assert pf.TransformerConfig(**bare).attn_output_multiplier == 1.0
  assert (pf.NormConfig().norm_scale, pf.NormConfig().use_log) == (30.0, False)


def test_optional_batch_fields_follow_the_feature_switches():
  assert ranking_config().optional_batch_fields == frozenset()
  assert ranking_config(post_age_granularity_mins=60).optional_batch_fields == {
      "impression_timestamps", "candidate_post_timestamps"}
  assert ranking_config(dwell_time_norm=pf.NormConfig()).optional_batch_fields == {
      "history_dwell_times"}
  assert retrieval_config().optional_batch_fields == frozenset()
  # Every name is an optional field of RecsysBatch.
  both = ranking_config(post_age_granularity_mins=60, dwell_time_norm=pf.NormConfig())
  assert both.optional_batch_fields == set(pf.RecsysBatch._field_defaults)


def test_fprop_dtype_accepts_dtype_objects():
  assert ranking_config(fprop_dtype=jnp.bfloat16).fprop_dtype == "bfloat16"
  assert retrieval_config(fprop_dtype=jnp.float32).fprop_dtype == "float32"


def test_kv_cache_bytes():
  cfg = transformer_config(num_layers=2, num_kv_heads=2, key_size=8)
  assert cfg.kv_cache_bytes(10) == 2 * 2 * 2 * 8 * 10 * 4
  assert cfg.kv_cache_bytes(10, "bfloat16") == 2 * 2 * 2 * 8 * 10 * 2
  assert cfg.kv_cache_bytes(0) == 0
  for bad in (-5, 2.5, True):   # -5 used to give -320 bytes
    with pytest.raises(ValueError, match="context_len"):
      cfg.kv_cache_bytes(bad)


BAD_CONFIGS = [
    ("num_kv_heads", lambda: transformer_config(num_q_heads=4, num_kv_heads=3)),
    ("key_size", lambda: transformer_config(key_size=7)),
    ("norm_layout", lambda: transformer_config(norm_layout="postln")),
    ("param_init", lambda: transformer_config(param_init="xavier")),
    ("param_init", lambda: transformer_config(param_init="rezero", norm_layout="pre")),
    ("param_init", lambda: transformer_config(param_init="rezero", norm_layout="post")),
    ("attn_logit_cap", lambda: transformer_config(attn_logit_cap=0.0)),
    ("attn_logit_cap", lambda: transformer_config(attn_logit_cap=-30.0)),
    ("num_layers", lambda: transformer_config(num_layers=0)),
    ("num_q_heads", lambda: transformer_config(num_q_heads=2.5)),
    ("widening_factor", lambda: transformer_config(widening_factor=0.0)),
    ("attn_output_multiplier", lambda: transformer_config(attn_output_multiplier=0.0)),
    ("fprop_dtype", lambda: ranking_config(fprop_dtype="float16")),
    ("fprop_dtype", lambda: retrieval_config(fprop_dtype="int8")),
    ("emb_size", lambda: pf.PhoenixModelConfig(model=transformer_config(), emb_size=64)),
    ("emb_size", lambda: pf.PhoenixRetrievalModelConfig(model=transformer_config(),
                                                        emb_size=16)),
    ("attention_impl", lambda: ranking_config(attention_impl="flash")),
    ("micro_batch_rows", lambda: ranking_config(micro_batch_rows=0)),
    ("micro_batch_rows", lambda: ranking_config(micro_batch_rows=64.0)),
    ("micro_batch_rows", lambda: ranking_config(micro_batch_rows="cpu")),
    ("micro_batch_rows", lambda: ranking_config(micro_batch_rows=True)),
    ("history_seq_len", lambda: ranking_config(history=0)),
    ("candidate_seq_len", lambda: ranking_config(candidates=0)),
    ("post_age_granularity_mins", lambda: ranking_config(post_age_granularity_mins=0)),
    ("dwell_time_norm", lambda: ranking_config(dwell_time_norm=30.0)),
    ("num_continuous_actions", lambda: ranking_config(num_continuous_actions=-1)),
    ("hash_config", lambda: ranking_config(hash_config=(2, 2, 2))),
    ("num_user_hashes", lambda: pf.HashConfig(num_user_hashes=0)),
    ("num_item_hashes", lambda: pf.HashConfig(num_item_hashes=0)),
    ("num_author_hashes", lambda: pf.HashConfig(num_author_hashes=0)),
    ("norm_scale", lambda: pf.NormConfig(norm_scale=0.0)),
    ("use_log", lambda: pf.NormConfig(use_log="yes")),
    ("candidate_isolation", lambda: ranking_config(candidate_isolation="False")),
    ("right_anchored_rope", lambda: ranking_config(right_anchored_rope=1)),
    ("num_continuous_actions", lambda: ranking_config(num_continuous_actions=True)),
    ("enable_linear_proj", lambda: retrieval_config(enable_linear_proj="no")),
    # values that would pass a `> 0` test and break the model, or fail in a comparison
    ("attn_logit_cap", lambda: transformer_config(attn_logit_cap=float("inf"))),
    ("attn_logit_cap", lambda: transformer_config(attn_logit_cap=True)),
    ("attn_output_multiplier", lambda: transformer_config(attn_output_multiplier=float("nan"))),
    # past float32's reach: NaN logits above 3.4e38, flushed (uniform) attention near 1e37
    ("attn_logit_cap", lambda: transformer_config(attn_logit_cap=1e39)),
    ("attn_output_multiplier", lambda: transformer_config(attn_output_multiplier=1e39)),
    ("micro_batch_rows", lambda: ranking_config(micro_batch_rows=np.int64(4))),
    ("widening_factor", lambda: transformer_config(widening_factor="2")),
    ("widening_factor", lambda: transformer_config(widening_factor=float("inf"))),
    ("norm_scale", lambda: pf.NormConfig(norm_scale=float("inf"))),
    ("widening_factor", lambda: transformer_config(widening_factor=0.01)),   # ffn_size 0
    ("dwell_hidden_size", lambda: ranking_config(dwell_hidden_size=0)),
    ("num_layers", lambda: transformer_config(num_layers=True)),
    ("num_actions", lambda: _ranking(num_actions=0)),
    ("num_actions", lambda: _ranking(num_actions=-3)),
    ("num_actions", lambda: _ranking(num_actions=2.5)),
    ("num_actions", lambda: _retrieval(num_actions=0)),
    ("product_surface_vocab_size", lambda: ranking_config(product_surface_vocab_size=0)),
    ("product_surface_vocab_size", lambda: retrieval_config(product_surface_vocab_size=0)),
    # equal to model.emb_size, yet not a Python int (a config is hashed and written to JSON)
    ("emb_size", lambda: _ranking(emb_size=32.0)),
    ("emb_size", lambda: _retrieval(emb_size=np.int64(32))),
    ("model", lambda: _ranking(model=dict(emb_size=32))),
    ("model", lambda: _retrieval(model=None)),
    ("fprop_dtype", lambda: ranking_config(fprop_dtype="bf16")),
]


def _ranking(**fields):
  """A ranking config built from its class, every field but the given ones the helper's."""
  return pf.PhoenixModelConfig(**{"model": transformer_config(), "emb_size": 32, **fields})


def _retrieval(**fields):
  return pf.PhoenixRetrievalModelConfig(
      **{"model": transformer_config(), "emb_size": 32, **fields})


@pytest.mark.parametrize("field, build", BAD_CONFIGS, ids=[f for f, _ in BAD_CONFIGS])
def test_bad_config_raises_naming_the_field(field, build):
  try:
    build()
  except ValueError as e:
    assert re.search(rf"\.{field}=", str(e)) and "invalid:" in str(e), str(e)
  else:
    pytest.fail(f"the bad value of {field} in BAD_CONFIGS was accepted: its config class's "
                "__post_init__ must check the field (config.py: _bool, _positive_int, ...)")


def test_every_switch_has_a_bad_value_case():
  """Step 6 of adding an idea: every field that export refuses away from its default (what
  a new switch is until it joins `haiku_compat._FREE_FIELDS`) has a case above."""
  named = {field for field, _ in BAD_CONFIGS}
  for cls, free in haiku_compat._FREE_FIELDS.items():
    for field in dataclasses.fields(cls):
      assert field.name in free or field.name in named, (
          f"{cls.__name__}.{field.name} has no bad value in BAD_CONFIGS (tests/test_config.py)")


def test_rezero_message_says_what_to_change():
  with pytest.raises(ValueError, match="norm_layout='sandwich'"):
    transformer_config(param_init="rezero", norm_layout="pre")


def test_values_on_the_edge_of_their_range_are_accepted():
  assert ranking_config(post_age_granularity_mins=4800).num_post_age_buckets == 3
  # Coarser than the oldest bucketed age: every known age in bucket 1, as the release gives.
  assert ranking_config(post_age_granularity_mins=6000).num_post_age_buckets == 2
  assert ranking_config(num_continuous_actions=0, dwell_hidden_size=1).dwell_hidden_size == 1
  assert transformer_config(widening_factor=0.0625).ffn_size == 8   # int(2.0) * 2 // 3 = 1
  # Attention scales up to 1e6 are taken (MAX_ATTENTION_SCALE), and nothing past it.
  assert transformer_config(attn_logit_cap=1e6).attn_logit_cap == 1e6
  assert transformer_config(attn_output_multiplier=1e6).attn_output_multiplier == 1e6
  for field in ("attn_logit_cap", "attn_output_multiplier"):
    with pytest.raises(ValueError, match=
                       rf"\.{field}=2000000\.0 is invalid: must be at most 1e\+06"):
      transformer_config(**{field: 2e6})


def test_micro_batch_rows_auto_is_2048_on_cpu_and_off_elsewhere(monkeypatch):
  """"auto" micro-batches the isolated path's candidates on CPU only; an explicit value
  or None holds on every backend."""
  auto, fixed, off = (ranking_config(micro_batch_rows=v) for v in ("auto", 64, None))
  assert ranking_config().micro_batch_rows == "auto"
  for backend, expected in (("cpu", 2048), ("gpu", None), ("tpu", None)):
    monkeypatch.setattr(pf.config.jax, "default_backend", lambda b=backend: b)
    assert (auto.effective_micro_batch_rows, fixed.effective_micro_batch_rows,
            off.effective_micro_batch_rows) == (
        expected, 64, None)


def test_numpy_scalars_numpy_bools_and_their_messages():
  """NumPy bools pass as flags (a mask's element is one); a NumPy integer where a config
  size must be a Python int is refused with the conversion to make."""
  assert pf.NormConfig(use_log=np.True_).use_log
  assert ranking_config(candidate_isolation=np.False_).candidate_isolation == np.False_
  assert retrieval_config(enable_linear_proj=np.True_).enable_linear_proj
  with pytest.raises(ValueError, match=re.escape("(a Python int: int(np.int64(2)))")):
    transformer_config(num_layers=np.int64(2))
  with pytest.raises(ValueError, match=r"num_layers=0 is invalid: must be an integer >= 1$"):
    transformer_config(num_layers=0)   # a Python int: no conversion to suggest
