"""Flax NNX interop: the Phoenix models as `flax.nnx.Module`s, with no second model code.

`to_nnx(module)` wraps any Equinox module (a `PhoenixModel`, a `PhoenixRetrievalModel`,
or a trainable `RankingSystem` / `RetrievalSystem` with its hash tables) in an
`nnx.Module` whose arrays are `nnx.Param`s; calling it (or any public method of the
wrapped module: `forward`, `encode_context`, `score_candidates`, `user_representation`,
...) rebuilds the Equinox module from the parameters at call time and runs the Equinox
code. The named wrappers carry those methods as their own, so `nnx.jit` takes them in
the unbound form, `nnx.jit(NNXPhoenixModel.forward)(model, ...)`.
`to_equinox(wrapper)` gives the Equinox module back. Both directions are exact: the same
arrays bit for bit, the same config object with every switch.

A Flax user's path (`pip install -e ".[flax]"`):

    from flax import nnx
    from phoenix_flax import flax_nnx

    model = flax_nnx.NNXPhoenixModel.from_config(config, rngs=nnx.Rngs(0))
    #   or: model = flax_nnx.to_nnx(pf.PhoenixModel(config, key=jax.random.key(0)))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch, embeddings, labels):
      def loss_fn(model):
        return optax.sigmoid_binary_cross_entropy(model(batch, embeddings).logits,
                                                  labels).mean()
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      return loss

    checkpointer = ocp.StandardCheckpointer()            # orbax.checkpoint as ocp
    checkpointer.save(path, nnx.state(model))
    nnx.update(model, checkpointer.restore(path, nnx.state(model)))

Layout of `nnx.state(wrapper)`: the Equinox module's own tree under `params`, one
`nnx.Param` per array, keyed by the Equinox field names, e.g.
`params/transformer/layers/attention/qkv/weight` (layer parameters keep their stacked
`[num_layers]` axis) or, for a system, `params/tables/post_table` and
`params/model/unembeddings`. Configs and other static fields stay in the graph
definition (`nnx.split`), never in the state.

Optax transformations that look at parameter paths written against the Equinox tree,
such as `phoenix_flax.training.make_optimizer`, whose weight-decay mask reads Equinox
field names, see a differently keyed tree in `nnx.Optimizer`; wrap them with
`equinox_tx(tx, model)` so they see exactly the tree the Equinox trainer gives them.
"""

from __future__ import annotations

try:
  import flax
  from flax import nnx
except ImportError as e:  # flax is an optional extra
  _missing = isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "flax"
  raise ImportError(
      "phoenix_flax.flax_nnx needs Flax: pip install -e '.[flax]' "
      "(or pip install 'phoenix_flax[flax]')"
      + ("" if _missing else f"; importing the installed flax failed: {e}")) from e
if not hasattr(nnx.Variable, "get_value"):   # the Variable API of flax 0.12.8
  raise ImportError(f"phoenix_flax.flax_nnx needs flax>=0.12.8, found {flax.__version__}: "
                    "pip install -U -e '.[flax]' (or pip install -U 'phoenix_flax[flax]')")

import functools
import inspect
from typing import Any, Optional

import equinox as eqx
import jax
import optax

from phoenix_flax.config import PhoenixModelConfig, PhoenixRetrievalModelConfig
from phoenix_flax.ranking import PhoenixModel
from phoenix_flax.retrieval import PhoenixRetrievalModel
from phoenix_flax.training.system import RankingSystem, RetrievalSystem

__all__ = ["EquinoxModule", "NNXPhoenixModel", "NNXPhoenixRetrievalModel",
           "NNXRankingSystem", "NNXRetrievalSystem", "equinox_tx", "to_equinox", "to_nnx"]

PARAMS = "params"   # the attribute (first key of every state path) holding the arrays


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _to_variable(x: jax.Array) -> nnx.Variable:
  """Floating arrays become trainable `nnx.Param`s; any other array a plain Variable."""
  return nnx.Param(x) if eqx.is_inexact_array(x) else nnx.Variable(x)


def _key_name(key: Any) -> str:
  """A jax path entry as a string key: field name, sequence index or dict key."""
  if isinstance(key, jax.tree_util.GetAttrKey):
    return key.name
  if isinstance(key, jax.tree_util.SequenceKey):
    return str(key.idx)
  if isinstance(key, (jax.tree_util.DictKey, jax.tree_util.FlattenedIndexKey)):
    return str(key.key)
  return str(key)


def _path(jax_path: tuple) -> tuple[str, ...]:
  return tuple(_key_name(k) for k in jax_path)


def _leaves_by_path(tree: Any) -> dict[tuple[str, ...], Any]:
  """`{path: leaf}` of a pytree (Variables are leaves), paths as string tuples."""
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)[0]
  return {_path(p): leaf for p, leaf in leaves}


class _Structure:
  """How a wrapper's `params` map back onto its Equinox module: the treedef of the array
  tree, the path of each leaf, and the static part (arrays replaced by None).

  Static in the NNX graph definition (hashable, compared by value). Copies share it:
  Equinox treedefs do not survive `copy.deepcopy`, which `nnx.Module` uses to copy the
  graph definition.
  """

  __slots__ = ("treedef", "paths", "static", "_key")

  def __init__(self, treedef, paths: tuple[tuple[str, ...], ...], static: eqx.Module):
    self.treedef, self.paths, self.static = treedef, paths, static
    static_leaves, static_def = jax.tree.flatten(static)
    self._key = (treedef, paths, static_def, tuple(static_leaves))

  def __eq__(self, other) -> bool:
    return isinstance(other, _Structure) and self._key == other._key

  def __hash__(self) -> int:
    return hash(self._key)

  def __deepcopy__(self, memo) -> "_Structure":
    return self

  def __copy__(self) -> "_Structure":
    return self

  def __repr__(self) -> str:
    return f"_Structure({type(self.static).__name__}, {len(self.paths)} arrays)"


def _nested(paths: tuple[tuple[str, ...], ...], values: list) -> nnx.Dict:
  """Nested `nnx.Dict`s holding `values[i]` at `paths[i]`."""
  root: dict = {}
  for path, value in zip(paths, values):
    node = root
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value

  def build(node):
    return nnx.Dict({k: build(v) if isinstance(v, dict) else v for k, v in node.items()})

  return build(root)


def _forwarded(name: str, function) -> Any:
  """`wrapper.name(...)`: the wrapped module's method, on the current parameters."""
  @functools.wraps(function)
  def method(self, *args, **kwargs):
    return getattr(self.to_equinox(), name)(*args, **kwargs)
  return method


class EquinoxModule(nnx.Module):
  """An Equinox module as an `nnx.Module`: arrays in `params` as `nnx.Param`s, the rest
  (configs, static fields) static; calls and public methods run the Equinox code.

  Attributes:
    params: nested `nnx.Dict`s keyed by the Equinox field names, one `nnx.Param` per array
      (integer arrays: `nnx.Variable`), e.g. `params.transformer.layers.attention.qkv
      .weight`; fields holding no array (None, static) are absent.
    structure: static; the Equinox tree structure, the leaf paths and the static part.
  """

  _wraps: Optional[type] = None   # subclasses: the Equinox class they accept

  def __init_subclass__(cls, **kwargs):
    # The wrapped class's public methods become methods of the wrapper class, so that
    # `nnx.jit(NNXPhoenixModel.forward)(model, ...)` works and `nnx.jit(model.forward)`
    # meets NNX's own refusal of bound methods (which would bake in the parameters).
    super().__init_subclass__(**kwargs)
    for name in dir(cls._wraps) if cls._wraps is not None else ():
      if (not name.startswith("_") and name not in vars(cls)
          and inspect.isfunction(inspect.getattr_static(cls._wraps, name))):
        setattr(cls, name, _forwarded(name, getattr(cls._wraps, name)))

  def __init__(self, module: eqx.Module):
    wraps = type(self)._wraps
    if wraps is not None and not isinstance(module, wraps):
      raise TypeError(f"{type(self).__name__} wraps a {wraps.__name__}, got "
                      f"{type(module).__name__}")
    if not isinstance(module, eqx.Module):
      raise TypeError(f"expected an equinox.Module, got {type(module).__name__}")
    arrays, static = eqx.partition(module, eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(arrays)
    paths = tuple(_path(p) for p, _ in leaves)
    self.params = _nested(paths, [_to_variable(x) for _, x in leaves])
    self.structure = nnx.static(_Structure(treedef, paths, static))

  @property
  def static(self) -> eqx.Module:
    """The static part of the Equinox module (its arrays replaced by None)."""
    return self.structure.static

  def _variable(self, path: tuple[str, ...]) -> nnx.Variable:
    node = self.params
    for key in path:
      node = node[key]
    return node

  def to_equinox(self) -> eqx.Module:
    """The Equinox module with the current parameters (the same arrays, not copies)."""
    s = self.structure
    arrays = s.treedef.unflatten([self._variable(p).get_value() for p in s.paths])
    return eqx.combine(arrays, s.static)

  def __call__(self, *args, **kwargs):
    return self.to_equinox()(*args, **kwargs)

  def __getattr__(self, name: str):
    # Only reached when ordinary lookup fails: forwards public attributes of the wrapped
    # module: its fields (e.g. config) as they are now, and its methods as functions that
    # rebuild the module from the parameters when called, not when looked up (a method
    # kept across training steps would otherwise run on the old parameters).
    structure = vars(self).get("structure")
    if name.startswith("_") or structure is None or not hasattr(structure.static, name):
      raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
    # A function on the class is a method (equinox binds it as its own BoundMethod type,
    # which inspect.ismethod does not recognise).
    if inspect.isfunction(inspect.getattr_static(type(structure.static), name, None)):
      return functools.partial(_forwarded(name, getattr(type(structure.static), name)), self)
    return getattr(self.to_equinox(), name)

  def __setattr__(self, name: str, value: Any):
    # The wrapped module's fields live in `params` (arrays) or the graph definition
    # (config, static fields): an attribute of the same name would shadow them on
    # reading while the model went on using the old values.
    structure = vars(self).get("structure")
    if (structure is not None and not name.startswith("_")
        and name not in ("params", "structure") and hasattr(structure.static, name)):
      raise AttributeError(f"{name!r} belongs to the wrapped "
                           f"{type(structure.static).__name__}: {self._how_to_set(name)}")
    super().__setattr__(name, value)

  def _how_to_set(self, name: str) -> str:
    """What to do instead of assigning the wrapped module's field `name`."""
    node = getattr(vars(self).get(PARAMS), name, None)
    if _is_variable(node):
      return f"set its value through `.params` (model.params.{name}[...] = new)"
    if node is not None:   # a submodule: its arrays are Variables below it
      path = ".".join(map(str, nnx.to_flat_state(nnx.state(node))[0][0]))
      return (f"set its arrays through `.params` (e.g. model.params.{name}.{path}[...] = "
              "new)")
    if inspect.isfunction(inspect.getattr_static(type(self.structure.static), name, None)):
      return "a method cannot be replaced"
    return ("it is no array but part of the graph definition: build a new wrapper with "
            "to_nnx(...) from a module with the value you want")

  def __dir__(self):
    structure = vars(self).get("structure")
    forwarded = ([] if structure is None
                 else [n for n in dir(structure.static) if not n.startswith("_")])
    return sorted(set(super().__dir__()) | set(forwarded))


class NNXPhoenixModel(EquinoxModule):
  """`PhoenixModel` as an `nnx.Module`: `model(batch, embeddings) -> RecsysModelOutput`;
  also `forward`, `encode_context`, `score_candidates`, `build_inputs`, `config`."""

  _wraps = PhoenixModel

  @classmethod
  def from_config(cls, config: PhoenixModelConfig, *, rngs: nnx.Rngs) -> "NNXPhoenixModel":
    return cls(PhoenixModel(config, key=rngs.params()))


class NNXPhoenixRetrievalModel(EquinoxModule):
  """`PhoenixRetrievalModel` as an `nnx.Module`: `model(batch, embeddings, corpus, top_k)`;
  also `build_user_representation`, `build_candidate_representation`, `config`."""

  _wraps = PhoenixRetrievalModel

  @classmethod
  def from_config(cls, config: PhoenixRetrievalModelConfig, *, rngs: nnx.Rngs
                  ) -> "NNXPhoenixRetrievalModel":
    return cls(PhoenixRetrievalModel(config, key=rngs.params()))


class NNXRankingSystem(EquinoxModule):
  """`RankingSystem` (hash tables + `PhoenixModel`) as an `nnx.Module`:
  `system(batch) -> logits [B, C, A]`; also `forward(batch)`, `tables`, `model`."""

  _wraps = RankingSystem

  @classmethod
  def from_config(cls, config: PhoenixModelConfig, user_buckets: int, post_buckets: int,
                  author_buckets: int, *, rngs: nnx.Rngs, init_scale: float = 1.0
                  ) -> "NNXRankingSystem":
    return cls(RankingSystem(config, user_buckets, post_buckets, author_buckets,
                             key=rngs.params(), init_scale=init_scale))


class NNXRetrievalSystem(EquinoxModule):
  """`RetrievalSystem` as an `nnx.Module`: `system(batch, corpus_ND, top_k)`; also
  `user_representation`, `candidate_representation`, `corpus_representation`."""

  _wraps = RetrievalSystem

  @classmethod
  def from_config(cls, config: PhoenixRetrievalModelConfig, user_buckets: int,
                  post_buckets: int, author_buckets: int, *, rngs: nnx.Rngs,
                  init_scale: float = 1.0) -> "NNXRetrievalSystem":
    return cls(RetrievalSystem(config, user_buckets, post_buckets, author_buckets,
                               key=rngs.params(), init_scale=init_scale))


_WRAPPERS = {cls._wraps: cls for cls in (NNXPhoenixModel, NNXPhoenixRetrievalModel,
                                         NNXRankingSystem, NNXRetrievalSystem)}


def to_nnx(module: eqx.Module) -> EquinoxModule:
  """Wraps an Equinox module as an `nnx.Module` (the class named for it where there is
  one, e.g. `NNXPhoenixModel`, else `EquinoxModule`); its arrays become `nnx.Param`s."""
  return _WRAPPERS.get(type(module), EquinoxModule)(module)


def to_equinox(module: EquinoxModule) -> eqx.Module:
  """The Equinox module of a wrapper, with its current parameters (exact inverse of
  `to_nnx`: the same arrays and the same static fields and config)."""
  if not isinstance(module, EquinoxModule):
    raise TypeError(f"expected an EquinoxModule (from to_nnx), got {type(module).__name__}")
  return module.to_equinox()


def _to_plain(tree: Any) -> Any:
  """Every Equinox module in `tree` as a dict of its dynamic fields (recursively)."""
  is_module = lambda x: isinstance(x, eqx.Module)

  def convert(x):
    if not is_module(x):
      return x
    fields = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]
    return {_key_name(p[0]): jax.tree.map(convert, v, is_leaf=is_module) for p, v in fields}

  return jax.tree.map(convert, tree, is_leaf=is_module)


def equinox_tx(tx: optax.GradientTransformation, model: EquinoxModule
               ) -> optax.GradientTransformationExtraArgs:
  """Runs `tx`, written against the Equinox parameter tree, on `model`'s NNX state.

  `nnx.Optimizer(model, equinox_tx(tx, model), wrt=nnx.Param)` hands `tx` the tree
  `eqx.filter(module, eqx.is_array)` that an Equinox training loop gives it (the same
  structure, path keys and arrays), so path-dependent masks and labels (the weight-decay
  mask of `training.make_optimizer`, `optax.multi_transform`) decide exactly as there.
  The updates come back in the NNX state's structure. The optimizer state is kept with
  Equinox modules turned into dicts keyed by field name (readable paths in
  `nnx.state(optimizer)`, e.g. `opt_state/1/0/mu/model/unembeddings`). A transformation
  that ignores parameter paths (`optax.adamw(lr)` without a mask) needs no wrapper.
  """
  if not isinstance(model, EquinoxModule):
    raise TypeError(f"model must be an EquinoxModule (from to_nnx), got "
                    f"{type(model).__name__}")
  structure = model.structure
  index = {(PARAMS,) + path: i for i, path in enumerate(structure.paths)}
  opt_structures = {}   # plain opt-state treedef -> (Equinox-structured treedef, leaf paths)

  def to_tree(state):
    values = [None] * len(index)
    for path, leaf in _leaves_by_path(state).items():
      i = index.get(path)
      if i is None:
        raise ValueError(f"equinox_tx: state entry {'/'.join(path)} is not a parameter of "
                         f"the {type(model).__name__} it was built for; build "
                         "nnx.Optimizer on that wrapper itself")
      values[i] = leaf.get_value() if _is_variable(leaf) else leaf
    return structure.treedef.unflatten(values)

  def to_state(tree, like):
    values = structure.treedef.flatten_up_to(tree)
    return jax.tree_util.tree_map_with_path(lambda p, _: values[index[_path(p)]], like,
                                            is_leaf=_is_variable)

  def plain_opt_state(opt_state):
    plain = _to_plain(opt_state)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(opt_state)
    opt_structures[jax.tree.structure(plain)] = (treedef, [_path(p) for p, _ in leaves])
    return plain

  def equinox_opt_state(plain, like_params):
    key = jax.tree.structure(plain)
    if key not in opt_structures:   # e.g. an optimizer restored in a new process
      plain_opt_state(jax.eval_shape(tx.init, like_params))
    treedef, paths = opt_structures[key]
    values = _leaves_by_path(plain)
    return treedef.unflatten([values[p] for p in paths])

  def init(params):
    return plain_opt_state(tx.init(to_tree(params)))

  def update(updates, state, params=None, **extra_args):
    tree_updates = to_tree(updates)
    tree_params = None if params is None else to_tree(params)
    new_updates, new_state = optax.with_extra_args_support(tx).update(
        tree_updates, equinox_opt_state(state, tree_updates), tree_params, **extra_args)
    return to_state(new_updates, updates), plain_opt_state(new_state)

  return optax.GradientTransformationExtraArgs(init, update)
