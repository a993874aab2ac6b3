"""Haiku import/export: release tree names, round trips, errors, and numerical parity
with the independent dm-haiku reference in `haiku_reference.py` (the specification's
example shapes: D=64, H=4, KV=2, d=32, 2 layers, w=2)."""

import dataclasses
import functools
import json
import types

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import haiku_reference as ref
import phoenix_flax as pf
from phoenix_flax import haiku_compat

B, S, C, N_CORPUS, TOP_K = 2, 6, 4, 20, 5
PARITY_ATOL = 1e-5

SPEC_RANKING_TOP = {
    "product_surface_embedding_table": (16, 64), "action_projection": (19, 64),
    "proj_mat_1": (128, 64), "proj_mat_3": (384, 64), "proj_mat_2": (320, 64),
    "unembeddings": (64, 19),
}
SPEC_LAYER = {
    "rms_norm": {"scale": (64,)},
    "multi_head_attention/query": {"w": (64, 128)},
    "multi_head_attention/key": {"w": (64, 64)},
    "multi_head_attention/value": {"w": (64, 64)},
    "multi_head_attention/linear": {"w": (128, 64)},
    "rms_norm_1": {"scale": (64,)},
    "rms_norm_2": {"scale": (64,)},
    "linear_v": {"w": (64, 88)},
    "linear": {"w": (64, 88)},
    "linear_1": {"w": (88, 64)},
    "rms_norm_3": {"scale": (64,)},
}
TOWER = "phoenix_retrieval_model/~build_candidate_representation/candidate_tower"


def _spec_tree(retrieval: bool, linear_proj: bool = True) -> dict:
  layers = {f"transformer/decoder_layer_{i}/{m}": p
            for i in range(2) for m, p in SPEC_LAYER.items()}
  if not retrieval:
    return {"phoenix_model": SPEC_RANKING_TOP, "phoenix_model/rms_norm": {"scale": (64,)},
            **layers}
  top = {n: SPEC_RANKING_TOP[n] for n in ("product_surface_embedding_table",
                                          "action_projection", "proj_mat_1", "proj_mat_3")}
  tower = {TOWER: {"candidate_tower_projection_1": (256, 128),
                   "candidate_tower_projection_2": (128, 64)}} if linear_proj else {}
  return {"phoenix_retrieval_model": top, **tower, **layers}


def _shapes(tree) -> dict:
  return {m: {p: tuple(v.shape) for p, v in entries.items()} for m, entries in tree.items()}


def _traced_export(to_haiku, model_cls, config) -> dict:
  """The tree `to_haiku` gives for a fresh model, as shapes (traced, nothing computed)."""
  return jax.eval_shape(lambda: to_haiku(model_cls(config, key=jax.random.PRNGKey(0))))


def _transformer_config(**overrides) -> pf.TransformerConfig:
  kw = dict(emb_size=64, key_size=32, num_q_heads=4, num_kv_heads=2, num_layers=2,
            widening_factor=2.0, attn_output_multiplier=0.125)
  return pf.TransformerConfig(**{**kw, **overrides})


def _ranking_config(**overrides) -> pf.PhoenixModelConfig:
  tkw = {k: overrides.pop(k) for k in ("attn_logit_cap", "norm_layout") if k in overrides}
  return pf.PhoenixModelConfig(model=_transformer_config(**tkw), emb_size=64,
                               history_seq_len=S, candidate_seq_len=C, **overrides)


def _retrieval_config(linear_proj: bool = True) -> pf.PhoenixRetrievalModelConfig:
  return pf.PhoenixRetrievalModelConfig(model=_transformer_config(), emb_size=64,
                                        history_seq_len=S, candidate_seq_len=C,
                                        enable_linear_proj=linear_proj)


def _reference_config(linear_proj: bool = True) -> ref.ReferenceConfig:
  return ref.ReferenceConfig(emb_size=64, key_size=32, num_q_heads=4, num_kv_heads=2,
                             num_layers=2, widening_factor=2.0, attn_output_multiplier=0.125,
                             enable_linear_proj=linear_proj)


def _inputs():
  """Batch with padded history items (a tail and a hole), a padded candidate, rows of
  history without any action, and random embeddings everywhere (padding included)."""
  rng = np.random.default_rng(0)
  hashes = lambda *shape: rng.integers(1, 1000, shape).astype(np.int32)
  history_post = hashes(B, S, 2)
  history_post[0, 4:, 0] = 0
  history_post[1, 2, 0] = 0
  candidate_post = hashes(B, C, 2)
  candidate_post[0, 3, 0] = 0
  actions = (rng.random((B, S, 19)) < 0.3).astype(np.int32)
  actions[:, 1] = 0
  batch = pf.RecsysBatch(
      hashes(B, 2), history_post, hashes(B, S, 2), actions,
      rng.integers(0, 16, (B, S)).astype(np.int32), candidate_post, hashes(B, C, 2),
      rng.integers(0, 16, (B, C)).astype(np.int32))
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  emb = pf.RecsysEmbeddings(normal(B, 2, 64), normal(B, S, 2, 64), normal(B, C, 2, 64),
                            normal(B, S, 2, 64), normal(B, C, 2, 64))
  batch = jax.tree.map(jnp.asarray, batch)
  return batch, jax.tree.map(jnp.asarray, emb)


def larger_inputs(rng: np.random.Generator, D: int, S: int, C: int, B: int):
  """Random batch and embeddings of any size: the first user's history half padded,
  every other entry valid (used by `projection_order.py` too)."""
  hashes = lambda *shape: rng.integers(1, 1000, shape).astype(np.int32)
  history_post = hashes(B, S, 2)
  history_post[0, S // 2:, 0] = 0
  batch = pf.RecsysBatch(hashes(B, 2), history_post, hashes(B, S, 2),
                         (rng.random((B, S, 19)) < 0.3).astype(np.int32),
                         rng.integers(0, 16, (B, S)).astype(np.int32), hashes(B, C, 2),
                         hashes(B, C, 2), rng.integers(0, 16, (B, C)).astype(np.int32))
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  emb = pf.RecsysEmbeddings(normal(B, 2, D), normal(B, S, 2, D), normal(B, C, 2, D),
                            normal(B, S, 2, D), normal(B, C, 2, D))
  return jax.tree.map(jnp.asarray, (batch, emb))


def _random_tree(tree, seed) -> dict:
  """Release-named tree with random values: norm scales ~1, weights normal*0.1, except
  query/key at normal*0.4 so attention logits reach the soft cap's nonlinear range.
  `seed`: an int, or a numpy Generator to draw from."""
  rng = np.random.default_rng(seed)
  out = {}
  for module, entries in tree.items():
    for param, value in entries.items():
      shape = value.shape
      if param == "scale":
        array = 1.0 + 0.2 * rng.normal(size=shape)
      else:
        std = 0.4 if module.endswith(("/query", "/key")) else 0.1
        array = std * rng.normal(size=shape)
      out.setdefault(module, {})[param] = array.astype(np.float32)
  return out


@pytest.fixture(scope="module")
def inputs():
  return _inputs()


@pytest.fixture(scope="module")
def corpus():
  rng = np.random.default_rng(1)
  vectors = rng.normal(size=(N_CORPUS, 64)).astype(np.float32)
  vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
  mask = np.ones(N_CORPUS, bool)
  mask[[2, 7, 11]] = False
  return jnp.asarray(vectors), jnp.asarray(mask)


@pytest.fixture(scope="module")
def ranking_reference():
  return jax.jit(ref.ranking_transform(_reference_config()).apply)


@pytest.fixture(scope="module")
def ranking_params(inputs):
  init = jax.eval_shape(ref.ranking_transform(_reference_config()).init,
                        jax.random.PRNGKey(0), *inputs)
  return init, _random_tree(init, seed=2)


def _retrieval_params(inputs, corpus, linear_proj: bool):
  """Jitted reference apply (top_k static) and a random tree for it."""
  transformed = ref.retrieval_transform(_reference_config(linear_proj))
  init = jax.eval_shape(lambda *args: transformed.init(*args, TOP_K),
                        jax.random.PRNGKey(0), *inputs, corpus[0])
  return jax.jit(transformed.apply, static_argnums=4), _random_tree(init, seed=3)


def _assert_trees_equal(a, b) -> None:
  assert _shapes(a) == _shapes(b)
  for module, entries in a.items():
    for param, value in entries.items():
      np.testing.assert_array_equal(np.asarray(value), np.asarray(b[module][param]),
                                    err_msg=f"{module}/{param}")


def test_reference_init_tree_is_the_spec_tree(inputs, corpus, ranking_params):
  init, _ = ranking_params
  assert _shapes(init) == _spec_tree(retrieval=False)
  for linear_proj in (True, False):
    _, tree = _retrieval_params(inputs, corpus, linear_proj)
    assert _shapes(tree) == _spec_tree(retrieval=True, linear_proj=linear_proj)


def test_export_of_fresh_models_has_the_spec_tree():
  tree = _traced_export(haiku_compat.ranking_model_to_haiku, pf.PhoenixModel,
                        _ranking_config())
  assert _shapes(tree) == _spec_tree(retrieval=False)
  for linear_proj in (True, False):
    tree = _traced_export(haiku_compat.retrieval_model_to_haiku, pf.PhoenixRetrievalModel,
                          _retrieval_config(linear_proj))
    assert _shapes(tree) == _spec_tree(retrieval=True, linear_proj=linear_proj)


def test_ranking_round_trip_is_identity(ranking_params):
  _, tree = ranking_params
  model = haiku_compat.ranking_model_from_haiku(tree, _ranking_config())
  exported = haiku_compat.ranking_model_to_haiku(model)
  _assert_trees_equal(exported, tree)
  # Modules come out layer by layer: the top-level ones, then all of layer 0, then layer 1.
  layers = [int(m.split("/")[1].rsplit("_", 1)[1]) if m.startswith("transformer/") else -1
            for m in exported]
  assert layers == sorted(layers) and layers.count(0) == len(SPEC_LAYER)
  qkv = model.transformer.layers.attention.qkv.weight
  assert qkv.shape == (2, 64, 256) and qkv.dtype == jnp.float32
  np.testing.assert_array_equal(
      qkv[1, :, 128:192], tree["transformer/decoder_layer_1/multi_head_attention/key"]["w"])


def test_export_refuses_arrays_of_other_shapes_than_the_config_builds():
  """The tree's layer count and widths come off the arrays: a model stacked over seeds
  (what a Trainer's system of several seeds' parameters is) would export its seeds as
  layers, and a transposed matrix as is; both are refused, naming the entries."""
  config = _ranking_config()
  two_seeds = eqx.filter_vmap(lambda k: pf.PhoenixModel(config, key=k))(
      jax.random.split(jax.random.PRNGKey(0), 2))
  with pytest.raises(ValueError, match="do not have the shapes its config builds") as e:
    jax.eval_shape(haiku_compat.ranking_model_to_haiku, two_seeds)
  assert "phoenix_model/unembeddings: the config builds (64, 19), the model holds (2, 64, 19)" \
      in str(e.value)
  assert "multi_head_attention/query/w" in str(e.value) and "unstack" in str(e.value)
  model = pf.PhoenixModel(config, key=jax.random.PRNGKey(0))
  flipped = eqx.tree_at(lambda m: m.unembeddings, model, model.unembeddings.T)
  with pytest.raises(ValueError, match=r"unembeddings: the config builds \(64, 19\), the "
                                       r"model holds \(19, 64\)"):
    haiku_compat.ranking_model_to_haiku(flipped)
  retrieval = pf.PhoenixRetrievalModel(_retrieval_config(), key=jax.random.PRNGKey(0))
  tower = retrieval.candidate_tower
  with pytest.raises(ValueError, match="candidate_tower_projection_1"):
    haiku_compat.retrieval_model_to_haiku(eqx.tree_at(
        lambda m: m.candidate_tower, retrieval, jax.tree.map(lambda x: x[..., :-1], tower)))


@pytest.mark.parametrize("linear_proj", [True, False], ids=["mlp", "mean_pool"])
def test_retrieval_round_trip_is_identity(inputs, corpus, linear_proj):
  _, tree = _retrieval_params(inputs, corpus, linear_proj)
  model = haiku_compat.retrieval_model_from_haiku(tree, _retrieval_config(linear_proj))
  _assert_trees_equal(haiku_compat.retrieval_model_to_haiku(model), tree)


def test_optional_later_release_params_round_trip():
  config = _ranking_config(post_age_granularity_mins=60, dwell_time_norm=pf.NormConfig(),
                           num_continuous_actions=3)
  traced = _traced_export(haiku_compat.ranking_model_to_haiku, pf.PhoenixModel, config)
  extra = {"post_age_embedding_table": (82, 64), "dwell_proj_1": (1, 64),
           "dwell_proj_2": (64, 64), "continuous_unembeddings": (64, 3)}
  top = _shapes(traced)["phoenix_model"]
  assert {n: top[n] for n in extra} == extra
  assert top["proj_mat_2"] == (384, 64) and top["proj_mat_3"] == (448, 64)
  tree = _random_tree(traced, seed=4)
  model = haiku_compat.ranking_model_from_haiku(tree, config)
  np.testing.assert_array_equal(model.dwell_proj_2, tree["phoenix_model"]["dwell_proj_2"])
  _assert_trees_equal(haiku_compat.ranking_model_to_haiku(model), tree)
  with pytest.raises(ValueError) as err:
    haiku_compat.ranking_model_from_haiku(tree, _ranking_config())
  for name in extra:
    assert f"extra   params['phoenix_model'][{name!r}]" in str(err.value)


def test_accepts_numpy_float64_and_read_only_mappings(ranking_params):
  _, tree = ranking_params
  frozen = types.MappingProxyType(
      {m: types.MappingProxyType({p: v.astype(np.float64) for p, v in e.items()})
       for m, e in tree.items()})
  model = haiku_compat.ranking_model_from_haiku(frozen, _ranking_config())
  leaves = jax.tree.leaves(model)
  assert all(isinstance(x, jax.Array) and x.dtype == jnp.float32 for x in leaves)
  _assert_trees_equal(haiku_compat.ranking_model_to_haiku(model), tree)


def test_import_and_export_store_float32_whatever_dtype_they_are_given(ranking_params):
  """The release stores float32 (SPEC: "weight stored float32"): a bfloat16 tree imports as
  float32 parameters, a model whose arrays were cast to bfloat16 exports float32 arrays,
  and a float64 value that is finite only in float64 (1e39) is named as inf, not imported."""
  _, tree = ranking_params
  F32 = np.dtype(np.float32)
  bf16 = {m: {p: v.astype(jnp.bfloat16) for p, v in e.items()} for m, e in tree.items()}
  as_f32 = {m: {p: np.asarray(v, np.float32) for p, v in e.items()} for m, e in bf16.items()}
  model = haiku_compat.ranking_model_from_haiku(bf16, _ranking_config())
  assert {x.dtype for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))} == {F32}
  cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)
  exported = haiku_compat.ranking_model_to_haiku(cast)
  assert {v.dtype for e in exported.values() for v in e.values()} == {F32}
  _assert_trees_equal(exported, as_f32)
  wide = tree["phoenix_model"]["unembeddings"].astype(np.float64)
  wide[0, 0] = 1e39
  huge = {m: dict(e) for m, e in tree.items()}
  huge["phoenix_model"]["unembeddings"] = wide
  with np.errstate(over="ignore"), pytest.raises(  # (the float32 check's cast overflows)
      haiku_compat.HaikuParamsError,
      match=r"value   params\['phoenix_model'\]\['unembeddings'\]: holds NaN"):
    haiku_compat.ranking_model_from_haiku(huge, _ranking_config())


def test_broken_tree_lists_every_problem(ranking_params):
  _, tree = ranking_params
  broken = {m: dict(e) for m, e in tree.items()}
  del broken["transformer/decoder_layer_1/linear_v"]["w"]
  broken["phoenix_model"]["bias"] = np.zeros(19, np.float32)
  broken["transformer/decoder_layer_0/multi_head_attention/query"]["w"] = np.zeros((64, 64))
  broken["phoenix_model/final_norm"] = {"scale": np.ones(64)}
  with pytest.raises(ValueError) as err:
    haiku_compat.ranking_model_from_haiku(broken, _ranking_config())
  message = str(err.value)
  assert "(4 problem(s))" in message
  assert "missing params['transformer/decoder_layer_1/linear_v']['w']: expected shape (64, 88)" \
      in message
  assert "extra   params['phoenix_model']['bias']: got shape (19,)" in message
  assert "extra   params['phoenix_model/final_norm']['scale']: got shape (64,)" in message
  assert ("shape   params['transformer/decoder_layer_0/multi_head_attention/query']['w']: "
          "expected (64, 128), got (64, 64)") in message
  assert err.value.problems and len(err.value.problems) == 4


def test_a_missing_or_malformed_module_is_named(ranking_params):
  """A whole module absent, or a module that is not a mapping: each of its entries is
  named missing in the one HaikuParamsError, not a TypeError from the lookup."""
  _, tree = ranking_params
  broken = dict(tree)
  del broken["transformer/decoder_layer_1/linear_v"]
  broken["phoenix_model/rms_norm"] = [tree["phoenix_model/rms_norm"]["scale"]]
  with pytest.raises(haiku_compat.HaikuParamsError) as err:
    haiku_compat.ranking_model_from_haiku(broken, _ranking_config())
  assert sorted(err.value.problems) == [
      "missing params['phoenix_model/rms_norm']['scale']: expected shape (64,)",
      "missing params['transformer/decoder_layer_1/linear_v']['w']: expected shape (64, 88)",
      "params['phoenix_model/rms_norm'] is a list, expected a mapping {param: array}"]


def test_mean_pool_config_rejects_candidate_tower_params(inputs, corpus):
  _, tree = _retrieval_params(inputs, corpus, linear_proj=True)
  with pytest.raises(ValueError) as err:
    haiku_compat.retrieval_model_from_haiku(tree, _retrieval_config(linear_proj=False))
  for name in ("candidate_tower_projection_1", "candidate_tower_projection_2"):
    assert f"extra   params[{TOWER!r}][{name!r}]" in str(err.value)


def test_non_sandwich_layout_is_rejected(ranking_params):
  _, tree = ranking_params
  config = _ranking_config(norm_layout="pre")
  with pytest.raises(ValueError, match="norm_layout='pre'"):
    haiku_compat.ranking_model_from_haiku(tree, config)
  # Every layout but the release's, refused for what it is (not for the norm entries that
  # the tree has and a post-norm model lacks).
  for layout in ("pre", "post"):
    with pytest.raises(ValueError, match=f"norm_layout='{layout}' has no Haiku counterpart"):
      haiku_compat.ranking_model_from_haiku(tree, _ranking_config(norm_layout=layout))
  with pytest.raises(ValueError, match="norm_layout='post'"):
    _traced_export(haiku_compat.ranking_model_to_haiku, pf.PhoenixModel,
                   _ranking_config(norm_layout="post"))


def test_settings_the_release_cannot_run_do_not_export(ranking_params):
  """Settings with no parameter of their own: the release would run the exported tree as
  another model. Import takes them (a released checkpoint may start a variant)."""
  _, tree = ranking_params
  for overrides, message in [(dict(attn_logit_cap=None), "attn_logit_cap=None"),
                             (dict(attn_logit_cap=10.0), "attn_logit_cap=10.0"),
                             (dict(candidate_isolation=False), "candidate_isolation=False")]:
    model = haiku_compat.ranking_model_from_haiku(tree, _ranking_config(**overrides))
    with pytest.raises(ValueError, match=message):
      haiku_compat.ranking_model_to_haiku(model)
  retrieval = pf.PhoenixRetrievalModelConfig(
      model=_transformer_config(attn_logit_cap=None), emb_size=64, history_seq_len=S,
      candidate_seq_len=C)
  with pytest.raises(ValueError, match="attn_logit_cap=None"):
    _traced_export(haiku_compat.retrieval_model_to_haiku, pf.PhoenixRetrievalModel, retrieval)
  # The release's settings spelled by other objects (a cap read from JSON) export.
  released = haiku_compat.ranking_model_from_haiku(
      tree, _ranking_config(attn_logit_cap=json.loads("30.0")))
  _assert_trees_equal(haiku_compat.ranking_model_to_haiku(released), tree)
  anchored = haiku_compat.ranking_model_from_haiku(tree, _ranking_config(right_anchored_rope=True))
  _assert_trees_equal(haiku_compat.ranking_model_to_haiku(anchored), tree)  # a later-release flag


@dataclasses.dataclass(frozen=True)
class _ConfigWithNewSwitch(pf.PhoenixModelConfig):
  """What a new idea adds: a switch whose default is the release's behaviour."""

  hypothetical_flag: bool = False


@dataclasses.dataclass(frozen=True)
class _TransformerWithNewSwitch(pf.TransformerConfig):
  hypothetical_switch: bool = True
  # A switch whose default comes from a factory (`default` is MISSING there).
  hypothetical_scales: tuple = dataclasses.field(default_factory=lambda: (1.0,))


def test_a_new_switch_exports_only_at_its_release_default(ranking_params):
  """Export needs no list of known switches: any field that is not free must hold its
  default, so a switch added later refuses export once it is on, naming itself."""
  _, tree = ranking_params
  base = _ranking_config()
  for config, message in [
      (_ConfigWithNewSwitch(**vars(base), hypothetical_flag=True),
       r"model.config.hypothetical_flag=True \(the release's: False\)"),
      (dataclasses.replace(base, model=_TransformerWithNewSwitch(**vars(base.model),
                                                                 hypothetical_switch=False)),
       r"model.config.model.hypothetical_switch=False \(the release's: True\)"),
      (dataclasses.replace(base, model=_TransformerWithNewSwitch(**vars(base.model),
                                                                 hypothetical_scales=(2.0,))),
       r"model.config.model.hypothetical_scales=\(2.0,\) \(the release's: \(1.0,\)\)")]:
    model = haiku_compat.ranking_model_from_haiku(tree, config)
    with pytest.raises(ValueError, match=message):
      haiku_compat.ranking_model_to_haiku(model)
  for config in (_ConfigWithNewSwitch(**vars(base)),
                 dataclasses.replace(base, model=_TransformerWithNewSwitch(**vars(base.model)))):
    at_default = haiku_compat.ranking_model_from_haiku(tree, config)
    _assert_trees_equal(haiku_compat.ranking_model_to_haiku(at_default), tree)
  # Settings that change nothing the tree computes export as they are.
  free = _ranking_config(attention_impl="dense", fprop_dtype="bfloat16")
  free = dataclasses.replace(free, model=dataclasses.replace(free.model, scan_unroll=2,
                                                             param_init="zeros"))
  model = haiku_compat.ranking_model_from_haiku(tree, free)
  _assert_trees_equal(haiku_compat.ranking_model_to_haiku(model), tree)


def test_a_module_a_switch_removes_is_named_not_crashed_on(ranking_params, monkeypatch):
  """A switch that leaves a release module None (a final norm switched off): import names
  the release's entry as extra, export refuses naming what the release would lack."""
  _, tree = ranking_params
  config = _ranking_config()
  without_norm = lambda model: eqx.tree_at(lambda m: m.final_norm, model, None)
  model = without_norm(haiku_compat.ranking_model_from_haiku(tree, config))
  with pytest.raises(ValueError, match=r"lacks parameters the release has: "
                                       r"\['phoenix_model/rms_norm/scale'\]"):
    haiku_compat.ranking_model_to_haiku(model)
  monkeypatch.setattr(haiku_compat, "PhoenixModel",
                      lambda cfg, key: without_norm(pf.PhoenixModel(cfg, key=key)))
  with pytest.raises(haiku_compat.HaikuParamsError,
                     match=r"extra   params\['phoenix_model/rms_norm'\]\['scale'\]"):
    haiku_compat.ranking_model_from_haiku(tree, config)


def test_entries_that_are_not_finite_float_arrays_are_named(ranking_params):
  _, tree = ranking_params
  broken = {m: dict(e) for m, e in tree.items()}
  query = "transformer/decoder_layer_0/multi_head_attention/query"
  broken[query]["w"] = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  broken["phoenix_model"]["proj_mat_1"] = {"w": np.zeros((128, 64), np.float32)}
  broken["phoenix_model"]["unembeddings"] = np.zeros((64, 19), np.int32)
  nan = np.array(tree["phoenix_model/rms_norm"]["scale"])
  nan[3] = np.nan
  broken["phoenix_model/rms_norm"]["scale"] = nan
  broken["phoenix_model"]["bias"] = {"b": 0}
  broken["phoenix_model"]["action_projection"] = np.asarray(
      tree["phoenix_model"]["action_projection"], np.complex64)   # inexact, yet not a float
  with pytest.raises(ValueError) as err:
    haiku_compat.ranking_model_from_haiku(broken, _ranking_config())
  message = str(err.value)
  assert "(6 problem(s))" in message
  assert ("value   params['phoenix_model']['action_projection']: has dtype complex64, "
          "expected floats") in message
  assert (f"value   params[{query!r}]['w']: is a ShapeDtypeStruct, expected an array of "
          "floats") in message
  assert ("value   params['phoenix_model']['proj_mat_1']: is a dict, expected an array of "
          "floats") in message
  assert ("value   params['phoenix_model']['unembeddings']: has dtype int32, expected floats"
          in message)
  assert "value   params['phoenix_model/rms_norm']['scale']: holds NaN or inf" in message
  assert "extra   params['phoenix_model']['bias']: got a dict" in message


def test_import_under_a_trace_says_it_needs_concrete_arrays(ranking_params):
  """Import reads the values (the finite check): under `jit` or `eval_shape` it failed with
  JAX's TracerArrayConversionError, naming no entry."""
  _, tree = ranking_params
  load = lambda t: haiku_compat.ranking_model_from_haiku(t, _ranking_config())
  for transform in (jax.jit, lambda f: functools.partial(jax.eval_shape, f)):
    with pytest.raises(haiku_compat.HaikuParamsError,
                       match=r"value   params\['phoenix_model'\]\['proj_mat_1'\]: is traced "
                             r"\(import called under jit, vmap or eval_shape\)"):
      transform(lambda t: eqx.filter(load(t), eqx.is_array))(tree)


class _NormWithBias(eqx.Module):
  """A norm with one more parameter than the release's: what a new switch may add."""

  scale: jax.Array
  bias: jax.Array


def _with_new_parameter(model: pf.PhoenixModel) -> pf.PhoenixModel:
  scale = model.transformer.layers.norm_attn_in.scale
  return eqx.tree_at(lambda m: m.transformer.layers.norm_attn_in, model,
                     _NormWithBias(scale, jnp.zeros_like(scale)))


def test_parameters_the_release_lacks_convert_in_neither_direction(ranking_params,
                                                                    monkeypatch):
  """An export must not silently drop a parameter, nor an import leave one unset."""
  _, tree = ranking_params
  config = _ranking_config()
  model = _with_new_parameter(haiku_compat.ranking_model_from_haiku(tree, config))
  message = r"no Haiku name in the release: \['\.transformer\.layers\.norm_attn_in\.bias'\]"
  with pytest.raises(NotImplementedError, match=message):
    haiku_compat.ranking_model_to_haiku(model)
  monkeypatch.setattr(haiku_compat, "PhoenixModel",
                      lambda cfg, key: _with_new_parameter(pf.PhoenixModel(cfg, key=key)))
  with pytest.raises(NotImplementedError, match=message):
    haiku_compat.ranking_model_from_haiku(tree, config)


def test_wrong_argument_types_are_rejected(ranking_params):
  _, tree = ranking_params
  with pytest.raises(TypeError, match="PhoenixModelConfig"):
    haiku_compat.ranking_model_from_haiku(tree, _retrieval_config())
  with pytest.raises(TypeError, match="params must be a mapping"):
    haiku_compat.ranking_model_from_haiku([tree], _ranking_config())
  # Exporting a model of the other kind is refused by name, each way.
  ranking = jax.eval_shape(lambda: pf.PhoenixModel(_ranking_config(), key=jax.random.key(0)))
  retrieval = jax.eval_shape(lambda: pf.PhoenixRetrievalModel(_retrieval_config(),
                                                              key=jax.random.key(0)))
  with pytest.raises(TypeError, match="model must be a PhoenixRetrievalModel, got PhoenixModel"):
    haiku_compat.retrieval_model_to_haiku(ranking)
  with pytest.raises(TypeError, match="model must be a PhoenixModel, got PhoenixRetrievalModel"):
    haiku_compat.ranking_model_to_haiku(retrieval)


@pytest.mark.parametrize("attention_impl", ["isolated", "dense"])
def test_ranking_logits_match_reference(inputs, ranking_params, ranking_reference,
                                        attention_impl):
  _, tree = ranking_params
  expected = ranking_reference(tree, *inputs)
  model = haiku_compat.ranking_model_from_haiku(
      tree, _ranking_config(attention_impl=attention_impl))
  logits = eqx.filter_jit(model)(*inputs).logits
  assert logits.shape == (B, C, 19)
  assert np.std(np.asarray(expected)) > 0.1
  print(f"D=64 {attention_impl}: max |logit difference| "
        f"{float(jnp.max(jnp.abs(logits - expected))):.2e}")   # (pytest -s shows it)
  np.testing.assert_allclose(logits, expected, rtol=0, atol=PARITY_ATOL)


def test_ranking_logits_match_reference_at_a_larger_size():
  """D=128 (key 64), 32 history items, 8 candidates, 4 users: longer sums, where the order
  of a computation's roundings shows. The input projections are one product over the
  concatenated features, as in the release (summing per-part products fails this;
  `tests/projection_order.py` measures both)."""
  D, S_, C_, B_ = 128, 32, 8, 4
  batch, emb = larger_inputs(np.random.default_rng(0), D, S_, C_, B_)
  shape = dict(emb_size=D, key_size=64, num_q_heads=4, num_kv_heads=2, num_layers=2,
               widening_factor=2.0, attn_output_multiplier=0.125)
  transformed = ref.ranking_transform(ref.ReferenceConfig(**shape))
  tree = _random_tree(jax.eval_shape(transformed.init, jax.random.PRNGKey(0), batch, emb),
                      seed=1)
  expected = jax.jit(transformed.apply)(tree, batch, emb)
  for impl in ("isolated", "dense"):
    config = pf.PhoenixModelConfig(model=pf.TransformerConfig(**shape), emb_size=D,
                                   history_seq_len=S_, candidate_seq_len=C_,
                                   attention_impl=impl)
    model = haiku_compat.ranking_model_from_haiku(tree, config)
    logits = eqx.filter_jit(model)(batch, emb).logits
    print(f"D=128 {impl}: max |logit difference| "
          f"{float(jnp.max(jnp.abs(logits - expected))):.2e}")   # (pytest -s shows it)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=PARITY_ATOL, err_msg=impl)


@pytest.mark.parametrize("heads, right_anchored",
                         [((4, 1), False), ((4, 4), False), ((8, 2), False), ((4, 2), True)],
                         ids=["H4-KV1", "H4-KV4", "H8-KV2", "H4-KV2-right-anchored"])
def test_ranking_logits_match_reference_across_variants(inputs, heads, right_anchored):
  """Other query/KV head splits (one shared KV head, plain multi-head, four queries per
  KV head) and the later release's right-anchored positions, each against the reference
  built with the same setting, on both paths. The inputs' second user has a hole in its
  history, which the positions' formula counts like any padding."""
  H, KV = heads
  shape = dict(emb_size=64, key_size=32, num_q_heads=H, num_kv_heads=KV, num_layers=2,
               widening_factor=2.0, attn_output_multiplier=0.125)
  transformed = ref.ranking_transform(ref.ReferenceConfig(**shape,
                                                          right_anchored_rope=right_anchored))
  tree = _random_tree(jax.eval_shape(transformed.init, jax.random.PRNGKey(0), *inputs),
                      seed=3)
  expected = jax.jit(transformed.apply)(tree, *inputs)
  if right_anchored:   # the positions matter at these inputs
    sequential = ref.ranking_transform(ref.ReferenceConfig(**shape)).apply(tree, *inputs)
    assert float(jnp.max(jnp.abs(sequential - expected))) > 0.1
  for impl in ("isolated", "dense"):
    config = pf.PhoenixModelConfig(model=pf.TransformerConfig(**shape), emb_size=64,
                                   history_seq_len=S, candidate_seq_len=C,
                                   right_anchored_rope=right_anchored, attention_impl=impl)
    logits = eqx.filter_jit(haiku_compat.ranking_model_from_haiku(tree, config))(*inputs)
    np.testing.assert_allclose(logits.logits, expected, rtol=0, atol=PARITY_ATOL,
                               err_msg=impl)


@pytest.mark.parametrize("attention_impl", ["isolated", "dense"])
def test_a_user_with_no_valid_context_matches_on_valid_candidates(inputs, ranking_params,
                                                                  ranking_reference,
                                                                  attention_impl):
  """A cold row (user token and every history item padded): its valid candidates attend
  to their own key alone and match the release on both paths. A padded candidate there
  has no key at all; the dense path averages the whole row as the release does, the fast
  path gives it zeros (at the release's cap; `_isolated_attention`), so only the dense
  path matches it."""
  _, tree = ranking_params
  batch, emb = inputs
  batch = batch._replace(user_hashes=batch.user_hashes.at[1, 0].set(0),
                         history_post_hashes=batch.history_post_hashes.at[1, :, 0].set(0),
                         candidate_post_hashes=batch.candidate_post_hashes.at[1, 2, 0].set(0))
  expected = np.asarray(ranking_reference(tree, batch, emb))
  model = haiku_compat.ranking_model_from_haiku(
      tree, _ranking_config(attention_impl=attention_impl))
  logits = np.asarray(eqx.filter_jit(model)(batch, emb).logits)
  valid = np.asarray(batch.candidate_post_hashes[..., 0] != 0)
  assert valid[1].sum() == C - 1
  np.testing.assert_allclose(logits[valid], expected[valid], rtol=0, atol=PARITY_ATOL)
  if attention_impl == "dense":
    np.testing.assert_allclose(logits, expected, rtol=0, atol=PARITY_ATOL)


def test_parity_is_sensitive_to_the_soft_cap(inputs, ranking_params, ranking_reference):
  _, tree = ranking_params
  expected = ranking_reference(tree, *inputs)
  uncapped = haiku_compat.ranking_model_from_haiku(tree, _ranking_config(attn_logit_cap=None))
  logits = eqx.filter_jit(uncapped)(*inputs).logits
  assert np.max(np.abs(logits - expected)) > 100 * PARITY_ATOL


def test_bfloat16_decoder_stack_matches_reference_bit_for_bit(ranking_params):
  """In bfloat16 the release rounds q.k to the forward dtype before its float32 logits;
  the dense path does the same, so the unrolled layer stack is bit-identical (computing
  q.k straight into float32 differed by up to 0.1 here)."""
  _, tree = ranking_params
  cfg = _ranking_config(attention_impl="dense", fprop_dtype="bfloat16")
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_unroll=2))
  transformer = haiku_compat.ranking_model_from_haiku(tree, cfg).transformer
  T = 1 + S + C
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(B, T, 64)), jnp.bfloat16)
  mask = jnp.asarray(rng.random((B, T)) > 0.2).at[:, 0].set(True)
  layers = {name: entries for name, entries in tree.items()
            if name.startswith("transformer/")}
  reference = hk.without_apply_rng(hk.transform(
      lambda x, m: ref.Transformer(_reference_config())(x, m, candidate_start_offset=1 + S)))
  expected = jax.jit(reference.apply)(layers, x, mask)
  got = eqx.filter_jit(lambda t, x, m: t(x, m, 1 + S).embeddings)(transformer, x, mask)
  assert got.dtype == expected.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))


@pytest.mark.parametrize("linear_proj", [True, False], ids=["mlp", "mean_pool"])
def test_retrieval_matches_reference(inputs, corpus, linear_proj):
  reference, tree = _retrieval_params(inputs, corpus, linear_proj)
  vectors, mask = corpus
  expected = reference(tree, *inputs, vectors, TOP_K, mask)
  model = haiku_compat.retrieval_model_from_haiku(tree, _retrieval_config(linear_proj))

  @eqx.filter_jit
  def run(model, batch, emb):
    return (model.build_user_representation(batch, emb),
            model(batch, emb, vectors, TOP_K, mask),
            model.build_candidate_representation(batch, emb))

  (user, user_norm), out, (candidates, candidate_mask) = run(model, *inputs)
  np.testing.assert_allclose(user, expected["user"], rtol=0, atol=PARITY_ATOL)
  np.testing.assert_allclose(user_norm, expected["user_norm"], rtol=1e-5)
  np.testing.assert_array_equal(out.top_k_indices, expected["top_indices"])
  np.testing.assert_allclose(out.top_k_scores, expected["top_scores"], rtol=0, atol=PARITY_ATOL)
  assert not np.isin(np.asarray(out.top_k_indices), [2, 7, 11]).any()

  assert candidates.shape == (B, C, 64)
  np.testing.assert_allclose(candidates, expected["candidates"], rtol=0, atol=PARITY_ATOL)
  np.testing.assert_array_equal(candidate_mask, expected["candidate_mask"])


def test_rope_equals_reference_bit_for_bit():
  """`apply_rope` rotates each half directly; the reference computes the release's
  `x * cos(phase) + rotate_half(x) * sin(phase)` with the phase duplicated over both
  halves. The floats must be the same, jitted and eager."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((3, 7, 4, 16)) * 5, jnp.float32)
  pos = jnp.asarray(rng.uniform(0, 300, (3, 7)), jnp.float32)
  rope = pf.layers.apply_rope
  np.testing.assert_array_equal(jax.jit(rope)(x, pos), jax.jit(ref.rope)(x, pos))
  np.testing.assert_array_equal(rope(x, pos), ref.rope(x, pos))


def test_later_release_tokens_follow_the_spec(inputs):
  """The later release's additions, from SPEC's formulas in numpy: the post-age bucket
  embedding is the last part of each candidate's concat, the dwell-time embedding the last
  part of each history item's (their order decides which rows of an imported proj_mat_2 /
  proj_mat_3 they meet), and the continuous head reads the final-normed candidates. The
  reference models only the first release, so this is their check."""
  batch, emb = inputs
  rng = np.random.default_rng(7)
  impression = np.array([1_700_000_000, 0], np.int32)              # row 1: no impression time
  posted = (1_700_000_000 - rng.integers(-3600, 400_000, (B, C))).astype(np.int32)
  posted[0, :3] = [1_700_000_000 - 7200, 0, 1_700_000_000 - 300_000 * 60]   # 120 min, a
  # missing post time, past the last bucket
  dwell = rng.uniform(-5, 50, (B, S)).astype(np.float32)            # clipped to [0, 30]
  batch = batch._replace(impression_timestamps=jnp.asarray(impression),
                         candidate_post_timestamps=jnp.asarray(posted),
                         history_dwell_times=jnp.asarray(dwell))
  g, scale = 60, 30.0
  config = _ranking_config(
      post_age_granularity_mins=g, dwell_time_norm=pf.NormConfig(norm_scale=scale, use_log=True),
      num_continuous_actions=3)
  # Jitted (as one program each): eagerly, every small op compiles on its own.
  model = eqx.filter_jit(lambda key: pf.PhoenixModel(config, key=key))(jax.random.PRNGKey(0))
  tokens, _, offset = eqx.filter_jit(lambda m, b, e: m.build_inputs(b, e))(model, batch, emb)
  n = lambda x: np.asarray(x, np.float64)

  def lookup(ids, table):   # single-hot: rows outside the table embed as zeros
    ids, table = np.asarray(ids), n(table)
    ok = (ids >= 0) & (ids < table.shape[0])
    return np.where(ok[..., None], table[np.where(ok, ids, 0)], 0.0)

  minutes = (impression[:, None].astype(np.int64) - posted) // 60
  bucket = np.clip(minutes // g + 1, 0, 4800 // g + 1)
  bucket[(minutes < 0) | (posted == 0) | (impression[:, None] == 0)] = 0
  assert model.post_age_embedding_table.shape == (4800 // g + 2, 64)
  assert list(bucket[0, :3]) == [3, 0, 4800 // g + 1] and not bucket[1].any()
  candidates = np.concatenate([
      n(emb.candidate_post_embeddings).reshape(B, C, -1),
      n(emb.candidate_author_embeddings).reshape(B, C, -1),
      lookup(batch.candidate_product_surface, model.product_surface_embedding_table),
      lookup(bucket, model.post_age_embedding_table)], -1) @ n(model.proj_mat_2)

  actions = n(batch.history_actions)
  action_emb = ((2 * actions - 1) @ n(model.action_projection)) * actions.any(-1, keepdims=True)
  normed = np.log1p(np.clip(dwell, 0, scale)) / np.log1p(scale)
  dwell_emb = n(jax.nn.gelu(jnp.asarray(normed[..., None] @ n(model.dwell_proj_1),
                                        jnp.float32))) @ n(model.dwell_proj_2)
  history = np.concatenate([
      n(emb.history_post_embeddings).reshape(B, S, -1),
      n(emb.history_author_embeddings).reshape(B, S, -1), action_emb,
      lookup(batch.history_product_surface, model.product_surface_embedding_table),
      dwell_emb], -1) @ n(model.proj_mat_3)
  user = n(emb.user_embeddings).reshape(B, 1, -1) @ n(model.proj_mat_1)
  want = np.concatenate([user, history, candidates], axis=1)
  assert offset == 1 + S
  np.testing.assert_allclose(n(tokens), want, atol=1e-5, rtol=0)

  def forward_and_final(m, b, e):
    tokens, padding, offset = m.build_inputs(b, e)
    return m(b, e), m.final_norm(m.transformer(tokens, padding, offset).embeddings)

  out, final = eqx.filter_jit(forward_and_final)(model, batch, emb)
  final = n(final)[:, offset:]
  np.testing.assert_allclose(n(out.logits), final @ n(model.unembeddings), atol=1e-5)
  np.testing.assert_allclose(n(out.continuous),
                             1 / (1 + np.exp(-(final @ n(model.continuous_unembeddings)))),
                             atol=1e-6)
