"""Import and export of the released Haiku parameter trees.

A tree is a two-level mapping `{module_path: {param_name: array}}` (what
`hk.transform(...).init` returns; dm-haiku is not needed to read it), with the names of
the Jan release's Haiku code:

    phoenix_model                product_surface_embedding_table, action_projection,
                                 proj_mat_1, proj_mat_2, proj_mat_3, unembeddings
    phoenix_model/rms_norm       scale (final norm)
    transformer/decoder_layer_{i}/rms_norm, rms_norm_1, rms_norm_2, rms_norm_3   scale
    transformer/decoder_layer_{i}/multi_head_attention/{query,key,value,linear}  w
    transformer/decoder_layer_{i}/{linear,linear_v,linear_1}                     w
    phoenix_retrieval_model      product_surface_embedding_table, action_projection,
                                 proj_mat_1, proj_mat_3
    phoenix_retrieval_model/~build_candidate_representation/candidate_tower
                                 candidate_tower_projection_1, candidate_tower_projection_2

Our fused weights map onto the release's separate ones: `qkv` = query | key | value and
`gate_value` = linear (gelu gate) | linear_v (value), concatenated on the output axis;
the `[L]`-stacked layer parameters map onto one `decoder_layer_{i}` per layer. Norms map
as N1 = rms_norm, N2 = rms_norm_1, N3 = rms_norm_2, N4 = rms_norm_3 (sandwich layout only).

The later release's optional ranking parameters have no Jan-release name; we store them
under `phoenix_model` with names of our own, present only when the config enables them:
`post_age_embedding_table`, `dwell_proj_1`, `dwell_proj_2`, `continuous_unembeddings`.
Any other parameter (one that a new switch adds) has no name here: import and export raise
`NotImplementedError` naming it, rather than leave it unset or drop it from the tree.
The release's Haiku code cannot read these names: such a tree is for this package (and
code that follows the same naming), not for the Jan release.

A tree holds parameter shapes, not the settings that have no parameter. On import, copy
these from the release's config, because a wrong value imports without error and gives
other logits: `attn_output_multiplier` (the release sets it, e.g. 0.125 for key size 64;
`TransformerConfig` defaults to 1.0), the split of the attention width into
`num_q_heads`/`num_kv_heads` and `key_size` (the tree only fixes the products), the
split of the hashes between posts and authors (`HashConfig.num_item_hashes` and
`num_author_hashes`: the input projections fix only their sum), `attn_logit_cap` (the
release always caps at 30.0), `candidate_isolation` (always on in the release),
`right_anchored_rope` (later release), the later release's `dwell_time_norm` (no
parameter) and `post_age_granularity_mins` (the table fixes only `4800 // g + 2` rows,
the same for g = 98 and 99), and `fprop_dtype` (the release serves in bfloat16).
Import accepts any such settings, so a released checkpoint can start a variant; a switch
that removes a release parameter (leaves its module None) makes that entry of the tree an
extra one, named in the error. Export refuses a model
whose settings the release cannot express, since the release would run the exported tree
as another model: every config field that is not a size, a later-release option or a
setting that changes nothing the tree computes (`_FREE_FIELDS`) must hold its default,
the release's behaviour. So a cap other than 30.0, isolation off, or a new switch that
is on refuses to export, naming the field; so does a model whose arrays are not the
shapes its config builds (a `Trainer`'s parameters stacked over seeds, say), whose tree
would count its seeds as layers. A `norm_layout` other than "sandwich" has other norm
parameters and converts in neither direction.

Float32 JAX arrays outside the decoder layers are not copied either way: an imported
model holds the tree's arrays there (whole, unfused entries such as the embedding
projections and the final norm) and an exported tree the model's, so donating one side
to a jitted call (as the training step donates its state) deletes those of the other.
The decoder layers' entries are copies both ways (the model stacks them over layers, the
tree holds one per layer). numpy inputs are copied to the device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from phoenix_flax.config import (PhoenixModelConfig, PhoenixRetrievalModelConfig,
                                 TransformerConfig, _nnx_hint, field_default)
from phoenix_flax.ranking import PhoenixModel
from phoenix_flax.retrieval import PhoenixRetrievalModel

RANKING_SCOPE = "phoenix_model"
RETRIEVAL_SCOPE = "phoenix_retrieval_model"
CANDIDATE_TOWER_SCOPE = f"{RETRIEVAL_SCOPE}/~build_candidate_representation/candidate_tower"

Params = dict[str, dict[str, jax.Array]]


class HaikuParamsError(ValueError):
  """A parameter tree that does not match the model; lists every offending entry."""

  def __init__(self, model_name: str, problems: list[str]):
    self.problems = problems
    super().__init__(f"Haiku params do not match {model_name} ({len(problems)} problem(s)):\n  "
                     + "\n  ".join(problems))


class _Slot(NamedTuple):
  """One model array and the Haiku entries it maps to.

  `parts` are (module, param, width): the array's last axis is split into those widths
  (None = the whole axis). `stacked` arrays carry a leading `[L]` axis, one Haiku module
  per layer, and their module names are prefixed with `transformer/decoder_layer_{i}/`.
  """

  get: Callable[[Any], Any]
  parts: tuple[tuple[str, str, Optional[int]], ...]
  stacked: bool = False


def _top_level(scope: str, names: tuple[str, ...]) -> list[_Slot]:
  return [_Slot(lambda m, n=n: getattr(m, n), ((scope, n, None),)) for n in names]


# Config fields that export takes whatever their value: sizes (fixed by the tree's shapes
# or set in the release's own config), settings that change nothing the tree computes
# (initialisation, forward dtype, which of two equal attention programs runs, layer
# unrolling, names), and the later release's options, whose parameters (if any) carry
# names of their own. Every other field, a new switch included, must hold its default
# (the release's behaviour, as config.py's defaults are) for the model to export.
_FREE_FIELDS = {
    TransformerConfig: {"emb_size", "key_size", "num_q_heads", "num_kv_heads", "num_layers",
                        "widening_factor", "attn_output_multiplier", "name", "param_init",
                        "scan_unroll"},
    PhoenixModelConfig: {"model", "emb_size", "num_actions", "history_seq_len",
                         "candidate_seq_len", "name", "fprop_dtype", "hash_config",
                         "product_surface_vocab_size", "attention_impl",
                         "micro_batch_rows", "right_anchored_rope",
                         "post_age_granularity_mins", "dwell_time_norm", "dwell_hidden_size",
                         "num_continuous_actions"},
    PhoenixRetrievalModelConfig: {"model", "emb_size", "history_seq_len", "candidate_seq_len",
                                  "name", "fprop_dtype", "hash_config",
                                  "product_surface_vocab_size", "enable_linear_proj",
                                  "num_actions"},
}


def _off_release(config, path: str) -> list[str]:
  """`path.field=value` for each field of `config` (and of its TransformerConfig) that
  is neither free nor at its default."""
  free = next(f for cls, f in _FREE_FIELDS.items() if isinstance(config, cls))
  found = []
  for field in dataclasses.fields(config):
    value, default = getattr(config, field.name), field_default(field)
    if field.name not in free and default is not dataclasses.MISSING and value != default:
      found.append(f"{path}.{field.name}={value!r} (the release's: {default!r})")
  if not isinstance(config, TransformerConfig):
    found += _off_release(config.model, f"{path}.model")
  return found


def _check_exportable(config) -> None:
  """Raises for settings the release cannot run, which have no parameter of their own
  (a cap other than 30.0, isolation off, a new switch that is on): the release would
  compute other logits from the exported tree."""
  off = _off_release(config, "model.config")
  if off:
    raise ValueError(
        f"{'; '.join(off)}: the release runs only its own settings, so it would run this "
        "tree as another model; only models with the release's settings export (a field "
        "that changes nothing the tree computes belongs in haiku_compat._FREE_FIELDS)")


def _transformer_slots(model) -> list[_Slot]:
  tcfg = model.config.model
  if tcfg.norm_layout != "sandwich":
    raise ValueError(f"model.config.model.norm_layout={tcfg.norm_layout!r} has no Haiku "
                     "counterpart: the release only has norm_layout='sandwich'")
  H, KV, d, F = tcfg.num_q_heads, tcfg.num_kv_heads, tcfg.key_size, tcfg.ffn_size
  mha = "multi_head_attention"
  return [
      _Slot(lambda m: m.transformer.layers.norm_attn_in.scale, (("rms_norm", "scale", None),),
            True),
      _Slot(lambda m: m.transformer.layers.attention.qkv.weight,
            ((f"{mha}/query", "w", H * d), (f"{mha}/key", "w", KV * d),
             (f"{mha}/value", "w", KV * d)), True),
      _Slot(lambda m: m.transformer.layers.attention.out.weight,
            ((f"{mha}/linear", "w", None),), True),
      _Slot(lambda m: m.transformer.layers.norm_attn_out.scale,
            (("rms_norm_1", "scale", None),), True),
      _Slot(lambda m: m.transformer.layers.norm_dense_in.scale,
            (("rms_norm_2", "scale", None),), True),
      _Slot(lambda m: m.transformer.layers.dense.gate_value.weight,
            (("linear", "w", F), ("linear_v", "w", F)), True),
      _Slot(lambda m: m.transformer.layers.dense.out.weight, (("linear_1", "w", None),), True),
      _Slot(lambda m: m.transformer.layers.norm_dense_out.scale,
            (("rms_norm_3", "scale", None),), True),
  ]


def _ranking_slots(model: PhoenixModel) -> list[_Slot]:
  names = ("product_surface_embedding_table", "action_projection", "proj_mat_1",
           "proj_mat_2", "proj_mat_3", "unembeddings", "post_age_embedding_table",
           "dwell_proj_1", "dwell_proj_2", "continuous_unembeddings")
  present = tuple(n for n in names if getattr(model, n) is not None)
  return (_top_level(RANKING_SCOPE, present)
          + [_Slot(lambda m: m.final_norm.scale, ((f"{RANKING_SCOPE}/rms_norm", "scale", None),))]
          + _transformer_slots(model))


def _retrieval_slots(model: PhoenixRetrievalModel) -> list[_Slot]:
  slots = _top_level(RETRIEVAL_SCOPE, ("product_surface_embedding_table", "action_projection",
                                       "proj_mat_1", "proj_mat_3"))
  if model.candidate_tower.projection_1 is not None:
    slots += [
        _Slot(lambda m: m.candidate_tower.projection_1,
              ((CANDIDATE_TOWER_SCOPE, "candidate_tower_projection_1", None),)),
        _Slot(lambda m: m.candidate_tower.projection_2,
              ((CANDIDATE_TOWER_SCOPE, "candidate_tower_projection_2", None),)),
    ]
  return slots + _transformer_slots(model)


def _layer_module(layer: int, module: str) -> str:
  return f"transformer/decoder_layer_{layer}/{module}"


def _expanded(slot: _Slot, shape: tuple[int, ...]):
  """Yields (layer or None, module, param, expected shape, start, stop) for a slot."""
  layers = range(shape[0]) if slot.stacked else [None]
  inner = shape[1:] if slot.stacked else shape
  for layer in layers:
    start = 0
    for module, param, width in slot.parts:
      stop = inner[-1] if width is None else start + width
      full = module if layer is None else _layer_module(layer, module)
      yield layer, full, param, inner[:-1] + (stop - start,), start, stop
      start = stop


def _present(model, slots: list[_Slot]) -> list[_Slot]:
  """The slots whose array `model` has: a switch may leave a module None (a final norm
  switched off, say). The release's entry for a missing array then counts as extra on
  import and refuses export; an array in no slot is still caught by `_check_mapped`."""
  def has(slot: _Slot) -> bool:
    try:
      return slot.get(model) is not None
    except AttributeError:   # a module on the way is None
      return False
  return [slot for slot in slots if has(slot)]


def _check_mapped(model, slots: list[_Slot], model_name: str) -> None:
  """Raises if an array of `model` (or a shape of an abstract one) is in no slot: a
  parameter the release does not have, which an import could not fill and an export
  would silently drop."""
  rest = eqx.tree_at(lambda m: [s.get(m) for s in slots], model, [None] * len(slots))
  unmapped = [jax.tree_util.keystr(path) for path, leaf
              in jax.tree_util.tree_leaves_with_path(rest)
              if eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)]
  if unmapped:
    raise NotImplementedError(
        f"{model_name} has parameters with no Haiku name in the release: {unmapped}. Only "
        "models with the release's parameters convert; switch off the option that adds "
        "them, or give them a name in phoenix_flax/haiku_compat.py")


def _check_shapes(model, slots: list[_Slot], model_name: str) -> None:
  """Raises unless each array has the shape its config builds: the tree's layer count and
  widths are read off the arrays, so a model stacked over seeds (a `Trainer`'s system of
  several seeds' parameters) would export its seeds as layers, and a transposed matrix
  as is, trees the release could not run."""
  built = eqx.filter_eval_shape(type(model), model.config, key=jax.random.PRNGKey(0))
  problems = []
  for slot in slots:
    have, want = slot.get(model).shape, slot.get(built).shape
    if have != want:
      names = ", ".join(f"{module}/{param}" for module, param, _ in slot.parts)
      problems.append(f"{names}{' (per layer)' if slot.stacked else ''}: the config builds "
                      f"{want}, the model holds {have}")
  if problems:
    raise ValueError(
        f"{model_name}'s arrays do not have the shapes its config builds, so its tree would "
        "not be the model's (for a Trainer's parameters stacked over seeds, export one "
        "seed's: `training.loop.unstack(state.params, i)`):\n  " + "\n  ".join(problems))


def _to_tree(model, slots: list[_Slot], model_name: str) -> Params:
  """Splits and unstacks the model's arrays; modules come out layer by layer."""
  _check_exportable(model.config)
  present = _present(model, slots)
  if len(present) < len(slots):
    lacking = [f"{module}/{param}" for slot in slots if slot not in present
               for module, param, _ in slot.parts]
    raise ValueError(f"{model_name} lacks parameters the release has: {lacking} (a module "
                     "of the model is None); the release could not run the exported tree")
  _check_mapped(model, slots, model_name)
  _check_shapes(model, slots, model_name)
  entries = []
  for slot in slots:
    array = slot.get(model)
    for layer, module, param, _, start, stop in _expanded(slot, array.shape):
      value = array if layer is None else array[layer]
      entries.append((-1 if layer is None else layer, module, param,
                      value[..., start:stop].astype(jnp.float32)))   # as the release stores
  tree: Params = {}
  for _, module, param, value in sorted(entries, key=lambda e: e[0]):
    tree.setdefault(module, {})[param] = value
  return tree


_ARRAY_TYPES = (np.ndarray, np.generic, jax.Array)


def _not_an_array(value: Any) -> Optional[str]:
  """Why `value` cannot be a parameter (None if it can): a float array is expected."""
  if isinstance(value, jax.core.Tracer):
    return ("is traced (import called under jit, vmap or eval_shape): import reads the "
            "values, so it needs concrete arrays")
  if not isinstance(value, _ARRAY_TYPES):
    return f"is a {type(value).__name__}, expected an array of floats"
  if not jnp.issubdtype(value.dtype, jnp.floating):
    return f"has dtype {value.dtype}, expected floats"
  return None


def _describe(value: Any) -> str:
  """An extra entry: its shape, or its type if it is not an array."""
  if isinstance(value, _ARRAY_TYPES):
    return f"got shape {np.shape(value)}"
  return f"got a {type(value).__name__}"


def _validate(params: Mapping, expected: dict[tuple[str, str], tuple[int, ...]],
              model_name: str) -> None:
  """Raises one `HaikuParamsError` naming every missing, extra or misshapen entry, and
  every entry that is not an array of finite floats."""
  if not isinstance(params, Mapping):
    raise TypeError(f"params must be a mapping {{module: {{param: array}}}}, got "
                    f"{type(params).__name__}")
  problems = []
  expected_modules = {module for module, _ in expected}
  for module, entries in params.items():
    if not isinstance(entries, Mapping):
      problems.append(f"params[{module!r}] is a {type(entries).__name__}, expected a mapping "
                      "{param: array}")
    elif module not in expected_modules:
      problems += [f"extra   params[{module!r}][{p!r}]: {_describe(v)}"
                   for p, v in entries.items()]
    else:
      problems += [f"extra   params[{module!r}][{p!r}]: {_describe(v)}"
                   for p, v in entries.items() if (module, p) not in expected]
  for (module, param), shape in expected.items():
    entries = params.get(module)
    if not isinstance(entries, Mapping) or param not in entries:
      problems.append(f"missing params[{module!r}][{param!r}]: expected shape {shape}")
    elif (why := _not_an_array(entries[param])) is not None:
      problems.append(f"value   params[{module!r}][{param!r}]: {why}")
    elif np.shape(entries[param]) != shape:
      problems.append(f"shape   params[{module!r}][{param!r}]: expected {shape}, "
                      f"got {np.shape(entries[param])}")
    elif not np.isfinite(np.asarray(entries[param], np.float32)).all():
      problems.append(f"value   params[{module!r}][{param!r}]: holds NaN or inf (in float32)")
  if problems:
    raise HaikuParamsError(model_name, problems)


def _from_tree(params: Mapping, skeleton, slots: list[_Slot], model_name: str):
  """Fills the shape-only `skeleton` with the tree's arrays (as float32)."""
  slots = _present(skeleton, slots)
  _check_mapped(skeleton, slots, model_name)
  expected = {(module, param): shape
              for slot in slots
              for _, module, param, shape, _, _ in _expanded(slot, slot.get(skeleton).shape)}
  _validate(params, expected, model_name)

  def assemble(slot: _Slot) -> jax.Array:
    per_layer: dict[Optional[int], list] = {}
    for layer, module, param, _, _, _ in _expanded(slot, slot.get(skeleton).shape):
      per_layer.setdefault(layer, []).append(jnp.asarray(params[module][param], jnp.float32))
    joined = [jnp.concatenate(parts, axis=-1) for parts in per_layer.values()]
    return jnp.stack(joined) if slot.stacked else joined[0]

  return eqx.tree_at(lambda m: [s.get(m) for s in slots], skeleton,
                     [assemble(s) for s in slots])


def ranking_model_from_haiku(params: Mapping, config: PhoenixModelConfig) -> PhoenixModel:
  """Builds a `PhoenixModel` from a release-named Haiku tree (see module docstring)."""
  if not isinstance(config, PhoenixModelConfig):
    raise TypeError(f"config must be a PhoenixModelConfig, got {type(config).__name__}")
  skeleton = eqx.filter_eval_shape(PhoenixModel, config, key=jax.random.PRNGKey(0))
  return _from_tree(params, skeleton, _ranking_slots(skeleton), "PhoenixModel")


def retrieval_model_from_haiku(params: Mapping, config: PhoenixRetrievalModelConfig
                               ) -> PhoenixRetrievalModel:
  """Builds a `PhoenixRetrievalModel` from a release-named Haiku tree."""
  if not isinstance(config, PhoenixRetrievalModelConfig):
    raise TypeError("config must be a PhoenixRetrievalModelConfig, got "
                    f"{type(config).__name__}")
  skeleton = eqx.filter_eval_shape(PhoenixRetrievalModel, config, key=jax.random.PRNGKey(0))
  return _from_tree(params, skeleton, _retrieval_slots(skeleton), "PhoenixRetrievalModel")


def ranking_model_to_haiku(model: PhoenixModel) -> Params:
  """The model's parameters as a release-named Haiku tree (see module docstring)."""
  if not isinstance(model, PhoenixModel):
    raise TypeError(f"model must be a PhoenixModel, got {type(model).__name__}"
                    + _nnx_hint(model))
  return _to_tree(model, _ranking_slots(model), "PhoenixModel")


def retrieval_model_to_haiku(model: PhoenixRetrievalModel) -> Params:
  """The model's parameters as a release-named Haiku tree (see module docstring)."""
  if not isinstance(model, PhoenixRetrievalModel):
    raise TypeError(f"model must be a PhoenixRetrievalModel, got {type(model).__name__}"
                    + _nnx_hint(model))
  return _to_tree(model, _retrieval_slots(model), "PhoenixRetrievalModel")
