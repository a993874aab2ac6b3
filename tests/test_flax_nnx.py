"""Flax NNX interop: exact Equinox <-> NNX round trips, the NNX workflow (split/merge,
nnx.jit, nnx.Optimizer, orbax), NNX training equal to the Equinox trainer, and the
ImportError that names the `flax` extra."""

from __future__ import annotations

import copy
import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (forward, import_error, needs_flax, ranking_config, retrieval_config,
                      transformer_config)

import phoenix_flax as pf
from phoenix_flax import haiku_compat
from experiments.configs import ranking as ranking_configs
from phoenix_flax.training import (RetrievalSystem, Trainer, make_optimizer, make_schedule,
                                   make_system, parse_config, ranking_loss)
from phoenix_flax.training.loop import _decay_mask

try:
  import orbax.checkpoint as ocp
  from flax import nnx

  from phoenix_flax import flax_nnx
except ImportError:  # the core install: only the ImportError test runs
  nnx = None


# Non-default switches: right-anchored RoPE, no cap, pre-norm, GQA 4:1, causal candidates
# (dense path); and cap 10, post-norm, 4:4 heads, isolation (fast path), bfloat16, with
# every optional array (post-age table, dwell projections, continuous head).
RANKING_CONFIGS = {
    "anchored_nocap_pre_gqa4_causal": lambda: ranking_config(
        transformer=transformer_config(num_kv_heads=1, attn_logit_cap=None,
                                       norm_layout="pre"),
        right_anchored_rope=True, candidate_isolation=False),
    "cap10_post_mha_isolated_bf16_extras": lambda: ranking_config(
        transformer=transformer_config(num_kv_heads=4, attn_logit_cap=10.0,
                                       norm_layout="post"),
        fprop_dtype="bfloat16", post_age_granularity_mins=60,
        dwell_time_norm=pf.NormConfig(), num_continuous_actions=2),
}


def test_every_switch_reaches_the_nnx_round_trip():
  """The exact round trip below compares configs too, so a rebuild that drops a switch
  fails it, but only for a switch that some case of RANKING_CONFIGS sets away from its
  default: every switch the isolated-vs-dense grid must set (`GRID_SWITCHES` of
  tests/test_ranking.py, right-anchored positions included) has to be set here too."""
  from test_ranking import GRID_SWITCHES, _field_default
  configs = [make() for make in RANKING_CONFIGS.values()]
  for cls, fields in GRID_SWITCHES.items():
    for field in fields | ({"right_anchored_rope"} if cls is pf.PhoenixModelConfig else set()):
      default = _field_default(cls, field)
      owners = [c.model if cls is pf.TransformerConfig else c for c in configs]
      assert any(getattr(o, field) != default for o in owners), (
          f"{cls.__name__}.{field} is set away from its default by no case of "
          "RANKING_CONFIGS (tests/test_flax_nnx.py)")


# Non-default retrieval switches: the mean-pool candidate tower (no tower parameters),
# under a pre-norm transformer.
RETRIEVAL_CONFIGS = {
    "mean_pool_pre": lambda: retrieval_config(
        enable_linear_proj=False, transformer=transformer_config(norm_layout="pre")),
}


def test_every_retrieval_switch_reaches_the_nnx_round_trip():
  """The exact retrieval round trip below compares configs too, but only for a switch
  that some case of RETRIEVAL_CONFIGS sets away from its default: every retrieval switch
  (`RETRIEVAL_SWITCHES` of tests/test_retrieval.py; the transformer's are
  RANKING_CONFIGS') has to be set here."""
  from test_ranking import _field_default
  from test_retrieval import RETRIEVAL_SWITCHES
  configs = [make() for make in RETRIEVAL_CONFIGS.values()]
  for field in sorted(RETRIEVAL_SWITCHES):
    default = _field_default(pf.PhoenixRetrievalModelConfig, field)
    assert any(getattr(c, field) != default for c in configs), (
        f"PhoenixRetrievalModelConfig.{field} is set away from its default by no case of "
        "RETRIEVAL_CONFIGS (tests/test_flax_nnx.py)")


def assert_same_module(got, want, same_arrays: bool = False):
  """Same treedef (static fields and configs included), equal arrays (bit for bit, same
  dtype); with `same_arrays` the very same array objects."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert a is b or not same_arrays
  assert bool(eqx.tree_equal(got, want))


def assert_trees_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def by_path(tree) -> dict[str, object]:
  """`{"a/b/c": leaf}` of a pytree: Equinox fields and dict keys alike give names."""
  name = lambda k: str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))
  return {"/".join(map(name, p)): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def state_paths(module) -> dict[str, type]:
  return {"/".join(map(str, p)): type(v) for p, v in nnx.to_flat_state(nnx.state(module))}


@nnx.jit if nnx is not None else (lambda f: f)
def nnx_forward(model, batch, embeddings):
  return model.forward(batch, embeddings)


@pytest.fixture(scope="module")
def spec():
  """The smoke ranking experiment, with warmup 1 and weight decay 0.1 so that the decay
  (and its mask) acts from the second step. The forward is pinned to float32, the dtype
  the tolerances here are for (the config's None means bfloat16 on GPU/TPU)."""
  c = ranking_configs.get_config("smoke")
  c.optim.update(dict(warmup_steps=1, weight_decay=0.1))
  c.model.fprop_dtype = "float32"
  return parse_config(c)


@pytest.fixture(scope="module")
def ranking_system(spec):
  return make_system(spec, jax.random.PRNGKey(3))


@needs_flax
@pytest.mark.parametrize("name", RANKING_CONFIGS)
def test_ranking_model_round_trip_and_outputs_are_exact(name):
  config = RANKING_CONFIGS[name]()
  model = pf.PhoenixModel(config, key=jax.random.key(0))
  wrapped = flax_nnx.to_nnx(model)
  assert isinstance(wrapped, flax_nnx.NNXPhoenixModel) and isinstance(wrapped, nnx.Module)
  paths = state_paths(wrapped)
  assert set(paths.values()) == {nnx.Param}
  assert len(paths) == len(jax.tree.leaves(eqx.filter(model, eqx.is_array)))
  assert "params/transformer/layers/attention/qkv/weight" in paths
  assert "params/proj_mat_2" in paths
  assert ("params/post_age_embedding_table" in paths) == (
      config.post_age_granularity_mins is not None)

  back = flax_nnx.to_equinox(wrapped)
  assert_same_module(back, model, same_arrays=True)
  assert back.config is config and wrapped.config is config
  assert back.transformer.config is config.model

  batch, embeddings = pf.example_batch(config, batch_size=2, key=jax.random.key(1))
  assert_trees_equal(nnx_forward(wrapped, batch, embeddings), forward(model, batch, embeddings))


@needs_flax
@pytest.mark.parametrize("name", RETRIEVAL_CONFIGS)
def test_retrieval_model_round_trip_and_outputs_are_exact(name):
  config = RETRIEVAL_CONFIGS[name]()
  model = pf.PhoenixRetrievalModel(config, key=jax.random.key(0))
  wrapped = flax_nnx.to_nnx(model)
  assert isinstance(wrapped, flax_nnx.NNXPhoenixRetrievalModel)
  paths = state_paths(wrapped)
  assert set(paths.values()) == {nnx.Param}
  assert len(paths) == len(jax.tree.leaves(eqx.filter(model, eqx.is_array)))
  assert any(p.startswith("params/candidate_tower") for p in paths) == (
      config.enable_linear_proj)
  back = flax_nnx.to_equinox(wrapped)
  assert_same_module(back, model, same_arrays=True)
  assert back.config is config and wrapped.config is config
  batch, embeddings = pf.example_batch(config, batch_size=2, key=jax.random.key(1))
  corpus, _ = pf.example_corpus(8, config.emb_size, jax.random.key(2))
  retrieve = lambda m, b, e, c: m(b, e, c, 3)
  assert_trees_equal(nnx.jit(retrieve)(wrapped, batch, embeddings, corpus),
                     eqx.filter_jit(retrieve)(model, batch, embeddings, corpus))


@needs_flax
def test_retrieval_systems_round_trip_exactly(ranking_system):
  retrieval_system = RetrievalSystem(retrieval_config(), 64, 128, 32, key=jax.random.key(4))
  for system, cls in ((ranking_system, flax_nnx.NNXRankingSystem),
                      (retrieval_system, flax_nnx.NNXRetrievalSystem)):
    wrapped = flax_nnx.to_nnx(system)
    assert type(wrapped) is cls
    paths = state_paths(wrapped)
    assert {"params/tables/post_table", "params/model/proj_mat_1"} <= set(paths)
    assert_same_module(flax_nnx.to_equinox(wrapped), system, same_arrays=True)
    assert wrapped.model.config is system.model.config   # forwarded field access
  post_NI = jnp.arange(1, 7, dtype=jnp.int32).reshape(3, 2)
  corpus = lambda s, p, a: s.corpus_representation(p, a)
  assert_trees_equal(nnx.jit(corpus)(wrapped, post_NI, post_NI + 1),
                     eqx.filter_jit(corpus)(retrieval_system, post_NI, post_NI + 1))


@needs_flax
def test_split_merge_jit_from_config_and_errors():
  config = RANKING_CONFIGS["anchored_nocap_pre_gqa4_causal"]()
  wrapped = flax_nnx.NNXPhoenixModel.from_config(config, rngs=nnx.Rngs(0))
  model = flax_nnx.to_equinox(wrapped)
  graphdef, state = nnx.split(wrapped)
  merged = nnx.merge(graphdef, state)
  assert type(merged) is flax_nnx.NNXPhoenixModel
  assert_same_module(flax_nnx.to_equinox(merged), model, same_arrays=True)
  assert graphdef == nnx.split(flax_nnx.to_nnx(model))[0]   # configs live in the graphdef
  copied = copy.deepcopy(wrapped)
  assert copied.params.unembeddings is not wrapped.params.unembeddings
  assert_same_module(flax_nnx.to_equinox(copied), model)

  @nnx.jit
  def scale_unembeddings(m, factor):   # an in-place update inside nnx.jit reaches m
    m.params.unembeddings[...] = m.params.unembeddings[...] * factor

  scale_unembeddings(merged, 2.0)
  np.testing.assert_array_equal(merged.params.unembeddings[...], 2.0 * model.unembeddings)
  batch, embeddings = pf.example_batch(config, batch_size=2, key=jax.random.key(1))
  scaled = eqx.tree_at(lambda m: m.unembeddings, model, 2.0 * model.unembeddings)
  assert_trees_equal(nnx_forward(merged, batch, embeddings), forward(scaled, batch, embeddings))

  with pytest.raises(TypeError, match="NNXRankingSystem wraps a RankingSystem"):
    flax_nnx.NNXRankingSystem(model)
  with pytest.raises(TypeError, match="equinox.Module"):
    flax_nnx.EquinoxModule(np.zeros(3))
  with pytest.raises(TypeError, match="EquinoxModule"):
    flax_nnx.to_equinox(model)
  with pytest.raises(AttributeError, match="no_such_method"):
    wrapped.no_such_method()


@needs_flax
def test_equinox_tx_hands_tx_the_equinox_parameter_tree(ranking_system):
  system = ranking_system
  wrapped = flax_nnx.to_nnx(system)
  seen = {}

  def init(params):
    seen["init"] = params
    return optax.EmptyState()

  def update(updates, state, params=None):
    seen["update"] = (updates, params)
    return jax.tree.map(lambda u: -u, updates), state

  tx = flax_nnx.equinox_tx(optax.GradientTransformation(init, update), wrapped)
  with pytest.raises(TypeError, match="model must be an EquinoxModule"):   # the bare system
    flax_nnx.equinox_tx(optax.sgd(0.1), system)
  optimizer = nnx.Optimizer(wrapped, tx, wrt=nnx.Param)
  params = eqx.filter(system, eqx.is_array)
  assert_same_module(seen["init"], params)
  assert jax.tree.leaves(_decay_mask(seen["init"])) == jax.tree.leaves(_decay_mask(params))
  assert not all(jax.tree.leaves(_decay_mask(params)))    # the mask does select
  optimizer.update(wrapped, nnx.state(wrapped, nnx.Param))   # grads = params: x - x = 0
  assert_trees_equal(seen["update"][0], params)
  assert_trees_equal(seen["update"][1], params)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(nnx.state(wrapped)))

  # An optimizer state from another equinox_tx (e.g. restored in a new process) works.
  pure = nnx.as_pure(nnx.state(wrapped, nnx.Param))
  opt_state = flax_nnx.equinox_tx(optax.sgd(0.1, momentum=0.9), wrapped).init(pure)
  updates, _ = flax_nnx.equinox_tx(optax.sgd(0.1, momentum=0.9), wrapped).update(
      pure, opt_state, pure)
  assert jax.tree.structure(updates) == jax.tree.structure(pure)

  other = flax_nnx.to_nnx(system.model)
  with pytest.raises(ValueError, match="not a parameter of the NNXPhoenixModel"):
    nnx.Optimizer(wrapped, flax_nnx.equinox_tx(optax.sgd(0.1), other), wrt=nnx.Param)

  # Extra arguments of the update (optax's `value=` for reduce_on_plateau) reach the tx.
  def scaled(updates, state, params=None, *, scale=1.0):
    return jax.tree.map(lambda u: u * scale, updates), state

  extra = flax_nnx.equinox_tx(optax.GradientTransformationExtraArgs(init, scaled), wrapped)
  ones = jax.tree.map(jnp.ones_like, pure)
  updates, _ = extra.update(ones, extra.init(pure), pure, scale=5.0)
  assert all(np.all(np.asarray(x) == 5.0) for x in jax.tree.leaves(updates))


@pytest.fixture(scope="module")
def trained(spec):
  """Four steps of the Equinox trainer and of NNX training from the same initial system,
  with the same optimizer (`make_optimizer`: clipping, AdamW and its decay mask) and the
  trainer's own batches."""
  trainer = Trainer(spec)
  state = trainer._init_one(jax.random.PRNGKey(0))   # Trainer.init of one seed, unstacked
  model = flax_nnx.to_nnx(trainer.system(state.params))
  optimizer = nnx.Optimizer(model, flax_nnx.equinox_tx(make_optimizer(spec), model),
                            wrt=nnx.Param)

  @nnx.jit
  def nnx_step(model, optimizer, sb):
    def loss_fn(model):
      out, _ = model.forward(sb.batch)
      return ranking_loss(out.logits, sb.labels, sb.candidate_mask)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  sample, update = eqx.filter_jit(trainer.sample_train_batch), eqx.filter_jit(trainer.update)
  eqx_losses, nnx_losses = [], []
  for _ in range(4):
    sb = sample(trainer.world, state)
    state, stats = update(state, sb)
    eqx_losses.append(float(stats["loss"]))
    nnx_losses.append(float(nnx_step(model, optimizer, sb)))
  return dict(state=state, model=model, optimizer=optimizer, eqx_losses=eqx_losses,
              nnx_losses=nnx_losses)


@needs_flax
def test_nnx_training_matches_the_equinox_trainer(spec, trained):
  np.testing.assert_allclose(trained["nnx_losses"], trained["eqx_losses"], rtol=1e-5)
  assert trained["eqx_losses"][0] != trained["eqx_losses"][-1]
  state = trained["state"]
  assert int(state.step) == 4 and not bool(state.diverged)
  got = eqx.filter(flax_nnx.to_equinox(trained["model"]), eqx.is_array)
  assert jax.tree.structure(got) == jax.tree.structure(state.params)
  # Adam moves a parameter by about the learning rate whatever its gradient's size, so where
  # the gradient is a near-cancelling sum (a hash row's occurrences) or below Adam's eps,
  # the two programs' rounding changes the step by a visible fraction of the learning rate
  # (0.06% of the four steps' reach in one post-table entry, compiled as the test session
  # compiles). The optimizer moments below are compared tightly.
  reach = sum(float(make_schedule(spec)(step)) for step in range(4))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-3 * reach)
  opt_state = by_path(nnx.as_pure(trained["optimizer"].opt_state))   # Equinox paths
  want = by_path(state.opt_state)
  assert set(opt_state) == set(want) and "1/0/mu/model/transformer/layers/dense/out/weight" in want
  for path, b in want.items():
    np.testing.assert_allclose(opt_state[path], b, rtol=1e-5, atol=1e-7, err_msg=path)


@needs_flax
def test_orbax_restores_model_and_optimizer_exactly(spec, trained, tmp_path):
  model, optimizer = trained["model"], trained["optimizer"]
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "model", nnx.state(model))
    checkpointer.save(tmp_path / "optimizer", nnx.state(optimizer))
    checkpointer.wait_until_finished()

    def fresh():   # abstract: shapes only, no arrays allocated
      m = flax_nnx.to_nnx(make_system(spec, jax.random.PRNGKey(1)))
      return m, nnx.Optimizer(m, flax_nnx.equinox_tx(make_optimizer(spec), m), wrt=nnx.Param)

    abstract_model, abstract_optimizer = nnx.eval_shape(fresh)
    model_def, model_state = nnx.split(abstract_model)
    opt_def, opt_state = nnx.split(abstract_optimizer)
    restored = nnx.merge(model_def, checkpointer.restore(tmp_path / "model", model_state))
    restored_opt = nnx.merge(opt_def, checkpointer.restore(tmp_path / "optimizer", opt_state))

  assert type(restored) is flax_nnx.NNXRankingSystem
  assert_same_module(flax_nnx.to_equinox(restored), flax_nnx.to_equinox(model))
  assert_trees_equal(nnx.state(restored_opt), nnx.state(optimizer))
  assert_trees_equal(nnx.state(copy.deepcopy(optimizer)), nnx.state(optimizer))


def test_import_error_names_the_extra_and_core_import_needs_no_flax():
  out = import_error("phoenix_flax.flax_nnx", (
      "import sys\n"
      "import phoenix_flax, phoenix_flax.training\n"
      "print('flax imported:', any(m == 'flax' or m.startswith('flax.') for m in sys.modules))\n"
      "print('flax_nnx imported:', 'phoenix_flax.flax_nnx' in sys.modules)\n"
      "sys.modules['flax'] = None\n"))
  assert "flax imported: False" in out
  assert "flax_nnx imported: False" in out
  assert ("ImportError: phoenix_flax.flax_nnx needs Flax: pip install -e '.[flax]' "
          "(or pip install 'phoenix_flax[flax]')") in out
  assert "importing the installed flax failed" not in out, out   # none is installed


def test_import_error_for_an_old_flax_names_both_install_commands():
  """An installed flax without the 0.12.8 Variable API: the error says how to upgrade from
  a clone and from an installed package (no clone to run `-e .` in)."""
  out = import_error("phoenix_flax.flax_nnx", (
      "import sys, types\n"
      "flax = types.ModuleType('flax'); flax.__version__ = '0.10.0'\n"
      "flax.nnx = types.ModuleType('flax.nnx'); flax.nnx.Variable = type('Variable', (), {})\n"
      "sys.modules['flax'] = flax; sys.modules['flax.nnx'] = flax.nnx\n"))
  assert ("ImportError: phoenix_flax.flax_nnx needs flax>=0.12.8, found 0.10.0: "
          "pip install -U -e '.[flax]' (or pip install -U 'phoenix_flax[flax]')" in out), out
  # flax 0.10/0.11: a Variable with `.value` but no `get_value` is refused as well.
  out = import_error("phoenix_flax.flax_nnx", (
      "import sys, types\n"
      "flax = types.ModuleType('flax'); flax.__version__ = '0.11.0'\n"
      "flax.nnx = types.ModuleType('flax.nnx')\n"
      "flax.nnx.Variable = type('Variable', (), {'value': property(lambda self: None)})\n"
      "sys.modules['flax'] = flax; sys.modules['flax.nnx'] = flax.nnx\n"))
  assert "ImportError: phoenix_flax.flax_nnx needs flax>=0.12.8, found 0.11.0" in out, out


class _Scaler(eqx.Module):
  """A module with no named wrapper: a float weight and an integer table."""

  weight: jax.Array
  index: jax.Array

  def apply(self, x):
    return self.weight[self.index] * x


@needs_flax
def test_any_equinox_module_wraps_with_its_integer_arrays_frozen():
  """`to_nnx` of a module without a named wrapper: float arrays are trainable Params,
  integer ones plain Variables (an optimizer `wrt=nnx.Param` leaves them alone)."""
  wrapped = flax_nnx.to_nnx(_Scaler(jnp.arange(1.0, 4.0), jnp.array([2, 0])))
  assert type(wrapped) is flax_nnx.EquinoxModule
  assert type(wrapped.params.weight) is nnx.Param
  assert type(wrapped.params.index) is nnx.Variable
  assert set(state_paths(nnx.state(wrapped, nnx.Param))) == {"params/weight"}
  kept = wrapped.apply                 # looked up before the update, called after it
  wrapped.params.weight[...] = jnp.array([10.0, 20.0, 30.0])
  np.testing.assert_array_equal(wrapped.apply(2.0), [60.0, 20.0])
  np.testing.assert_array_equal(kept(2.0), [60.0, 20.0])
  np.testing.assert_array_equal(wrapped.weight, [10.0, 20.0, 30.0])   # forwarded fields
  np.testing.assert_array_equal(wrapped.index, [2, 0])
  np.testing.assert_array_equal(flax_nnx.to_equinox(wrapped).index, [2, 0])
  with pytest.raises(TypeError, match=r"^NNXPhoenixModel wraps a PhoenixModel, got _Scaler$"):
    flax_nnx.NNXPhoenixModel(_Scaler(jnp.ones(2), jnp.array([0])))


class _Scaled(eqx.Module):
  """A float in a plain (not static) field: no parameter, part of the graph definition."""

  weight: jax.Array
  scale: float

  def __call__(self, x):
    return self.weight * x * self.scale


@needs_flax
def test_modules_that_differ_only_in_a_plain_field_are_told_apart():
  """Two wrappers whose modules differ in a non-array leaf have different graph
  definitions: `nnx.jit` runs each with its own value, and neither changes the other."""
  a, b = (flax_nnx.to_nnx(_Scaled(jnp.ones(2), scale)) for scale in (2.0, 3.0))
  run = nnx.jit(lambda module, x: module(x))
  np.testing.assert_array_equal(run(a, 1.0), [2.0, 2.0])
  np.testing.assert_array_equal(run(b, 1.0), [3.0, 3.0])
  np.testing.assert_array_equal(b(1.0), [3.0, 3.0])
  np.testing.assert_array_equal(a(1.0), [2.0, 2.0])


class _Pair(eqx.Module):
  """Arrays in a tuple field."""

  weights: tuple


@needs_flax
def test_arrays_in_a_sequence_are_keyed_by_their_index():
  """The state layout (module docstring): a sequence's arrays sit under their index,
  `params/weights/0`, as the Equinox path `.weights[0]` names them."""
  module = _Pair((jnp.arange(2.0), jnp.arange(3.0)))
  wrapped = flax_nnx.to_nnx(module)
  assert state_paths(wrapped) == {"params/weights/0": nnx.Param, "params/weights/1": nnx.Param}
  assert repr(wrapped.structure) == "_Structure(_Pair, 2 arrays)"
  assert_same_module(flax_nnx.to_equinox(wrapped), module, same_arrays=True)


class _Opaque:
  """A pytree node registered without keys (its children get flat indices)."""

  def __init__(self, value):
    self.value = value


jax.tree_util.register_pytree_node(_Opaque, lambda o: ((o.value,), None),
                                   lambda _, children: _Opaque(*children))


class _HoldsOpaque(eqx.Module):
  opaque: _Opaque


@needs_flax
def test_arrays_of_a_node_without_keys_are_keyed_by_their_index():
  """A child that JAX names only by its flat index sits under that index, as a
  sequence's does."""
  wrapped = flax_nnx.to_nnx(_HoldsOpaque(_Opaque(jnp.ones(2))))
  assert state_paths(wrapped) == {"params/opaque/0": nnx.Param}


@needs_flax
def test_systems_from_config_take_their_init_scale():
  """`from_config` builds the system `RankingSystem(...)` / `RetrievalSystem(...)` builds
  from the same key, its tables at the given scale."""
  for wrapper, config in ((flax_nnx.NNXRankingSystem, ranking_config()),
                          (flax_nnx.NNXRetrievalSystem, retrieval_config())):
    built = flax_nnx.to_equinox(wrapper.from_config(config, 16, 16, 16, rngs=nnx.Rngs(0),
                                                    init_scale=0.05))
    direct = wrapper._wraps(config, 16, 16, 16, key=nnx.Rngs(0).params(), init_scale=0.05)
    assert_same_module(built, direct)
    assert float(np.std(np.asarray(built.tables.post_table)[1:])) < 0.1
    # Without one, the system's own default.
    built = flax_nnx.to_equinox(wrapper.from_config(config, 16, 16, 16, rngs=nnx.Rngs(0)))
    assert_same_module(built, wrapper._wraps(config, 16, 16, 16, key=nnx.Rngs(0).params()))


@needs_flax
def test_models_from_config_draw_their_key_from_the_params_stream():
  """`from_config(config, rngs=...)` is `Model(config, key=rngs.params())`, also for an
  Rngs with a `params` stream and no default one."""
  for wrapper, config in ((flax_nnx.NNXPhoenixModel, ranking_config()),
                          (flax_nnx.NNXPhoenixRetrievalModel, retrieval_config())):
    built = flax_nnx.to_equinox(wrapper.from_config(config, rngs=nnx.Rngs(params=5)))
    assert_same_module(built, wrapper._wraps(config, key=nnx.Rngs(params=5).params()))


class _Keywords(eqx.Module):
  weight: jax.Array

  def __call__(self, x, *, scale=1.0):
    return self.weight * x * scale

  def apply(self, x, *, scale=1.0):
    return self.weight * x * scale


@needs_flax
def test_calls_and_forwarded_methods_pass_keyword_arguments():
  wrapped = flax_nnx.to_nnx(_Keywords(jnp.arange(1.0, 3.0)))
  np.testing.assert_array_equal(wrapped(2.0, scale=3.0), [6.0, 12.0])
  np.testing.assert_array_equal(wrapped.apply(2.0, scale=3.0), [6.0, 12.0])


class _Leaf(eqx.Module):
  w: jax.Array


class _Mid(eqx.Module):
  leaf: _Leaf


class _Outer(eqx.Module):
  mid: _Mid


@needs_flax
def test_submodule_refusal_names_a_dotted_path_two_levels_down():
  wrapped = flax_nnx.to_nnx(_Outer(_Mid(_Leaf(jnp.ones(2)))))
  with pytest.raises(AttributeError, match=r"model\.params\.mid\.leaf\.w\[\.\.\.\] = new"):
    wrapped.mid = None


@needs_flax
def test_equinox_tx_is_an_optax_transformation_of_the_nnx_state():
  """Called directly (not through nnx.Optimizer): `update` takes the state with its
  Variables as `init` does, returns its state in the structure `init` gave (so it chains),
  and refuses updates in another structure instead of matching them by leaf order."""
  wrapped = flax_nnx.to_nnx(_Outer(_Mid(_Leaf(jnp.ones(2)))))
  tx = flax_nnx.equinox_tx(optax.sgd(0.5), wrapped)
  state = nnx.state(wrapped, nnx.Param)
  updates, _ = tx.update(state, tx.init(state), state)
  np.testing.assert_array_equal(nnx.as_pure(updates)["params"]["mid"]["leaf"]["w"], [-0.5] * 2)
  tx = flax_nnx.equinox_tx(optax.sgd(0.1, momentum=0.9), wrapped)
  params = nnx.as_pure(state)
  s0 = tx.init(params)
  _, s1 = tx.update(params, s0, params)
  _, s2 = tx.update(params, s1, params)
  assert jax.tree.structure(s1) == jax.tree.structure(s2) == jax.tree.structure(s0)
  reversed_list = optax.GradientTransformation(
      lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.tree.leaves(u)[::-1], s))
  tx = flax_nnx.equinox_tx(reversed_list, wrapped)
  with pytest.raises(ValueError):
    tx.update(params, tx.init(params), params)


@needs_flax
def test_forwarded_methods_keep_their_names_docs_and_signatures():
  for wrapper, name in ((flax_nnx.NNXPhoenixModel, "forward"),
                        (flax_nnx.NNXPhoenixRetrievalModel, "build_user_representation"),
                        (flax_nnx.NNXRankingSystem, "forward")):
    method, original = getattr(wrapper, name), getattr(wrapper._wraps, name)
    assert method.__name__ == name and method.__doc__ == original.__doc__
    assert inspect.signature(method) == inspect.signature(original)


@needs_flax
def test_methods_and_fields_follow_the_parameters():
  """A method kept across an update runs on the new parameters; `nnx.jit` takes the
  wrapper class's method (module as argument) and refuses a bound one, as NNX does; a
  field of the wrapped module cannot be shadowed by assignment."""
  config = ranking_config()
  model = flax_nnx.to_nnx(pf.PhoenixModel(config, key=jax.random.key(0)))
  batch, emb = pf.example_batch(config, 2, jax.random.key(1))
  assert {"config", "unembeddings", "forward", "params"} <= set(dir(model))  # completion
  assert hasattr(pf.PhoenixModel, "_check_candidates")   # private: not forwarded
  with pytest.raises(AttributeError, match="has no attribute '_check_candidates'"):
    model._check_candidates
  kept = model.forward
  model.params.unembeddings[...] = jnp.zeros_like(model.params.unembeddings[...])
  assert bool(jnp.all(kept(batch, emb)[0].logits == 0))
  jitted = nnx.jit(flax_nnx.NNXPhoenixModel.forward)(model, batch, emb)[0].logits
  assert bool(jnp.all(jitted == 0))
  with pytest.raises(ValueError, match="bound methods"):
    nnx.jit(model.forward)(batch, emb)
  # Each refusal says what works for that field (the array example once followed for the
  # config, a submodule or a method failed in turn).
  for name, how in [
      ("unembeddings", r"set its value through `.params` \(model.params.unembeddings\[...\]"),
      ("final_norm", r"set its arrays through `.params` \(e.g. model.params.final_norm.scale"
                     r"\[...\] = new\)"),
      ("forward", "a method cannot be replaced"),
      ("config", "it is no array but part of the graph definition: build a new wrapper")]:
    with pytest.raises(AttributeError, match=f"'{name}' belongs to the wrapped PhoenixModel: "
                                             + how):
      setattr(model, name, None)
  model.params.final_norm.scale[...] = 2.0   # as the message says
  model._head = "a note"   # a private name is the wrapper's own, even one the model has
  assert model._head == "a note"
  assert bool(jnp.all(flax_nnx.to_equinox(model).final_norm.scale == 2.0))
  # The wrapper's own attributes stay its own, even where a wrapped module (any Equinox
  # one) has fields of their names.

  class Scaled(eqx.Module):
    params: jax.Array
    structure: jax.Array

    def __call__(self, x):
      return x * self.params + self.structure
  wrapped = flax_nnx.to_nnx(Scaled(jnp.arange(3.0), jnp.ones(3)))
  wrapped.params, wrapped.structure = wrapped.params, wrapped.structure
  np.testing.assert_array_equal(wrapped(jnp.ones(3)), jnp.arange(3.0) + 1)
  for refuses in (pf.RankingRunner, haiku_compat.ranking_model_to_haiku):
    with pytest.raises(TypeError, match="got NNXPhoenixModel; convert an NNX wrapper with "
                                        "phoenix_flax.flax_nnx.to_equinox"):
      refuses(model)
