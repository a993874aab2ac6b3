"""The experiment config (an `ml_collections.ConfigDict`) and its validation.

Schema (`base_config(task)` builds it with defaults; every field can be overridden, on the
command line as `--config.<section>.<field>=value`):

  task                "ranking" (PhoenixModel, per-action BCE) or "retrieval" (two towers,
                      in-batch sampled softmax).
  seed, num_seeds     seeds `seed .. seed+num_seeds-1` train together (vmapped); every seed,
                      world_seed and eval_seed too, is below 2**32 (JAX's PRNG keys take
                      32-bit seeds). Seed k
                      draws the model init and the training batches; one seed writes into
                      the workdir itself, several into `<workdir>/seed_<k>/`.
  world_seed          the synthetic world, shared by every seed.
  eval_seed           the fixed evaluation batches, shared by every seed and split; not
                      world_seed (whose random numbers they would reuse).
  world.*             `phoenix_flax.synthetic.WorldConfig` fields (entity counts, S, C,
                      hashing and bucket sizes, the action link).
  train_split.*       `SplitConfig` of the training batches.
  eval_split.*        `SplitConfig` of the primary evaluation (metrics `eval/<name>`).
  extra_eval_splits   name -> `SplitConfig` fields; evaluated alongside, logged as
                      `<name>/<metric>` (e.g. a history-length or list-size shift).
  model.*             transformer shape and ablation switches: each key goes to the
                      `TransformerConfig` / `PhoenixModelConfig` (or retrieval) field of its
                      name, and a key that is no such field is an error, as is one of the
                      other task's switches set away from its default (the task's model has
                      no such setting); `fprop_dtype` None picks bfloat16 on
                      GPU/TPU and float32 on CPU; `embedding_init_scale` is the std of the
                      hash tables; `enable_linear_proj` is the retrieval candidate tower;
                      `scan_unroll` is layers per scan iteration (a speed knob, not a
                      switch; the cpu preset's 8 unrolls any stack of up to 8 layers).
                      S, C, A, hash counts and the surface vocabulary come from `world`;
                      the other model-config fields the section lacks are in
                      `NOT_IN_MODEL_SECTION`, with the reason an override of one is refused.
  optim.*             AdamW: `learning_rate` (peak), `warmup_steps` (linear from 0; fewer
                      than `train.num_steps`), then
                      cosine decay to `end_lr_fraction * learning_rate` at `num_steps`;
                      `weight_decay` (matrices only; not norms, not the hash tables), `b1`,
                      `b2`, `eps` (>= 1e-30); `grad_clip_norm` (global norm, None = off).
  train.*             `num_steps` (at most 2**31 - 1: an int32 count), `batch_size` (per
                      seed, global over devices),
                      `steps_per_call` (steps scanned per host call; divides num_steps,
                      eval_every and checkpoint_every; changes no step's result, only the
                      window that logged `train/*` scalars average over), `eval_every`
                      (0 = at the end only),
                      `checkpoint_every` (0 = none on the way: the final state, and a
                      run stopped by SIGINT/SIGTERM, are still checkpointed),
                      `eval_batch_size`, `eval_batches`
                      (retrieval's evaluation loss contrasts each user with the others of
                      its group of `batch_size` users, as training does, where
                      `batch_size` divides `eval_batch_size`; with the whole evaluation
                      batch otherwise), `action_weights` (ranking: None or one weight
                      in [0, 1e6] per action, for the loss; a sum >= 1e-6),
                      `score_consistency` (ranking: re-score the primary eval split's
                      lists with the candidates of every other slot taken from another
                      user's list, and report the mean |logit change|; retrieval runs
                      ignore it).
  ranking.*           `top_k`: the K of ndcg@K, recall@K and bayes_recall@K of the favorite
                      ranking of each evaluation list (one or more; a K at or above a
                      list's size ranks the whole list, where recall is 1.0).
  retrieval.*         `temperature` of the sampled softmax, `positive_action` (a user's
                      positive is its first candidate with this label), `recall_k` (K of
                      recall@K against the corpus of every post; at most world.num_posts),
                      `logq_correction` (subtract from each in-batch column's logit, the
                      row's own positive included, the log of how often that post is a
                      positive, estimated by a count sketch over the post hash functions
                      that decays by `logq_decay` per step; the training loss only,
                      evaluation's loss stays uncorrected).
  mesh.*              `num_devices` (1 = no mesh, -1 = all; batch sharded over a "data"
                      axis, parameters replicated), `shard_hash_tables` (rows of the hash
                      tables sharded over "data"; needs num_devices other than 1),
                      `distributed` (call `jax.distributed.initialize`, with
                      `coordinator_address`, `num_processes`, `process_id` when given,
                      auto-detected otherwise; those three are an error without it),
                      `initialization_timeout` (with distributed=True: seconds to wait
                      for every process to join; a process still waiting then aborts).
  output.*            `seed_subdirs`: None = `<workdir>/seed_<k>/` only when num_seeds > 1,
                      True = always, False = never (one seed only); `keep_checkpoints`:
                      newest checkpoints kept per run (the last is the final model; at
                      least 2 with several seeds; a resume falls back to an older one
                      when the newest cannot be read).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import re
from typing import Any, Mapping, Optional

import jax
import ml_collections
from ml_collections import config_dict

from phoenix_flax.config import (INT32, HashConfig, PhoenixModelConfig,
                                 PhoenixRetrievalModelConfig, TransformerConfig, field_default)
from phoenix_flax.synthetic import SplitConfig, WorldConfig
from phoenix_flax.training.loss import MAX_ACTION_WEIGHT

TASKS = ("ranking", "retrieval")
RUNTIME_SECTIONS = ("mesh", "output")
RESERVED_SPLIT_NAMES = ("train", "eval", "perf")


class ConfigError(ValueError):
  """A config value is invalid; the message names the field (`config.<path>`)."""


def nullable(value: Any) -> config_dict.FieldReference:
  """A field that accepts None and any value (`--config.x=None` works on the command line)."""
  return config_dict.FieldReference(value, field_type=object)


def _dataclass_section(cls, **overrides) -> ml_collections.ConfigDict:
  """ConfigDict of a dataclass's fields and defaults; None-default fields stay nullable."""
  section = ml_collections.ConfigDict()
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = set(overrides) - names
  if unknown:
    raise ConfigError(f"{cls.__name__} has no field(s) {sorted(unknown)}; "
                      f"valid: {sorted(names)}")
  for f in dataclasses.fields(cls):
    default = field_default(f)
    value = overrides.get(f.name, default)
    section[f.name] = nullable(value) if default is None else value
  return section


def world_config(**overrides) -> ml_collections.ConfigDict:
  """`WorldConfig` fields as a config section."""
  return _dataclass_section(WorldConfig, **overrides)


def split_config(**overrides) -> ml_collections.ConfigDict:
  """`SplitConfig` fields as a config section (e.g. for `config.extra_eval_splits.<name>`)."""
  return _dataclass_section(SplitConfig, **overrides)


def base_config(task: str = "ranking") -> ml_collections.ConfigDict:
  """The full schema with defaults for `task` (see the module docstring)."""
  if task not in TASKS:
    raise ConfigError(f"config.task={task!r} is invalid: use one of {TASKS}")
  c = ml_collections.ConfigDict()
  c.task = task
  c.seed = 0
  c.num_seeds = 1
  c.world_seed = 0
  c.eval_seed = 10_000
  c.world = world_config()
  c.train_split = split_config()
  c.eval_split = split_config()
  c.extra_eval_splits = ml_collections.ConfigDict()
  c.model = ml_collections.ConfigDict(dict(
      emb_size=64, key_size=16, num_q_heads=4, num_kv_heads=2, num_layers=2,
      widening_factor=2.0, attn_output_multiplier=0.25, attn_logit_cap=nullable(30.0),
      norm_layout="sandwich", param_init="variance_scaling", right_anchored_rope=False,
      candidate_isolation=True, attention_impl="isolated", fprop_dtype=nullable(None),
      post_age_granularity_mins=nullable(None), enable_linear_proj=True,
      embedding_init_scale=1.0, scan_unroll=1))
  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=3e-3, warmup_steps=100, end_lr_fraction=0.1, weight_decay=0.01,
      b1=0.9, b2=0.99, eps=1e-8, grad_clip_norm=nullable(1.0)))
  c.train = ml_collections.ConfigDict(dict(
      num_steps=1000, batch_size=64, steps_per_call=50, eval_every=250,
      checkpoint_every=250, eval_batch_size=256, eval_batches=4,
      action_weights=nullable(None), score_consistency=True))
  c.ranking = ml_collections.ConfigDict(dict(top_k=(5,)))
  c.retrieval = ml_collections.ConfigDict(dict(
      temperature=0.05, positive_action=0, recall_k=(10, 100), logq_correction=False,
      logq_decay=0.999))
  c.mesh = ml_collections.ConfigDict(dict(
      num_devices=1, shard_hash_tables=False, distributed=False,
      coordinator_address=nullable(None), num_processes=nullable(None),
      process_id=nullable(None), initialization_timeout=300))
  c.output = ml_collections.ConfigDict(dict(seed_subdirs=nullable(None), keep_checkpoints=2))
  return c


@dataclasses.dataclass(frozen=True)
class ExperimentSpec:
  """A validated config with its typed parts built."""

  config: ml_collections.ConfigDict
  world: WorldConfig
  train_split: SplitConfig
  eval_splits: dict            # name -> SplitConfig; "eval" first
  model: Any                   # PhoenixModelConfig or PhoenixRetrievalModelConfig
  action_weights: Optional[tuple]

  @property
  def task(self) -> str:
    """`config.task`: "ranking" or "retrieval"."""
    return self.config.task

  @property
  def seeds(self) -> tuple[int, ...]:
    """The seeds trained: `config.num_seeds` of them from `config.seed` on."""
    return tuple(range(self.config.seed, self.config.seed + self.config.num_seeds))


def _check(ok: bool, path: str, value: Any, fix: str) -> None:
  if not ok:
    raise ConfigError(f"config.{path}={value!r} is invalid: {fix}")


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _build(path: str, fn, **kwargs):
  try:
    return fn(**kwargs)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.{path}: {e}") from e


def default_fprop_dtype() -> str:
  """bfloat16 on accelerators, float32 on CPU."""
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


# `config.model` keys that are not fields of the model configs.
TRAINING_MODEL_KEYS = ("embedding_init_scale",)

# Fields of the model configs that `config.model` does not hold, and why (an override of
# one names the reason instead of only "no such field"; a test in tests/test_training.py
# keeps this list and `base_config` covering every field).
NOT_IN_MODEL_SECTION = {
    "name": "the module name is fixed",
    "model": "the transformer's fields are the model section's own keys",
    "history_seq_len": "set world.history_len",
    "candidate_seq_len": "set world.num_candidates",
    "hash_config": "set world.num_user_hashes, num_item_hashes, num_author_hashes",
    "num_actions": "set world.num_actions (with world.base_rates and world.negative_actions)",
    "product_surface_vocab_size": "set world.product_surface_vocab_size",
    "dwell_time_norm": "the synthetic world's dwell times are its binary dwell action "
                       "plus noise, which the model already reads as an action, so the "
                       "dwell-time embedding would read nothing new",
    "dwell_hidden_size": "the synthetic world's dwell times hold nothing beyond its binary "
                         "dwell action",
    "num_continuous_actions": "the synthetic world has no continuous labels to train a "
                              "continuous head on",
    "micro_batch_rows": "a serving setting of `model(...)`; training and evaluation run "
                        "`forward`, which takes the whole batch",
}


def not_in_model_section(key: str) -> Optional[str]:
  """Why `config.model` has no `key`, when `key` is a model-config field; else None."""
  if key not in NOT_IN_MODEL_SECTION:
    return None
  owners = [cls.__name__ for cls in (TransformerConfig, PhoenixModelConfig,
                                     PhoenixRetrievalModelConfig) if key in _fields(cls)]
  return (f"{key!r} is a field of {' / '.join(owners)} that the experiment config does not "
          f"expose: {NOT_IN_MODEL_SECTION[key]}")


def _fields(cls) -> set[str]:
  return {f.name for f in dataclasses.fields(cls)}


def _model_config(c: ml_collections.ConfigDict, world: WorldConfig):
  """The model config: every `config.model` key goes to the `TransformerConfig` or task
  model config field of its name (so a new switch needs only its field and its default in
  `base_config`), but for `TRAINING_MODEL_KEYS` (the trainer's, such as
  `embedding_init_scale`) and the other task's fields left at their defaults; any other
  key is an error, never silently dropped."""
  m = c.model.to_dict()
  tc_fields = _fields(TransformerConfig)
  known = (tc_fields | _fields(PhoenixModelConfig) | _fields(PhoenixRetrievalModelConfig)
           | set(TRAINING_MODEL_KEYS))
  unexposed = sorted(set(m) & set(NOT_IN_MODEL_SECTION))
  if unexposed:
    raise ConfigError(f"config.model.{unexposed[0]} is invalid: "
                      f"{not_in_model_section(unexposed[0])}")
  unknown = sorted(set(m) - known)
  _check(not unknown, "model", unknown,
         "these keys are fields of no model config; add each to TransformerConfig or "
         "PhoenixModelConfig / PhoenixRetrievalModelConfig in phoenix_flax/config.py")
  transformer = _build("model", TransformerConfig,
                       **{k: v for k, v in m.items() if k in tc_fields})
  hashes = HashConfig(world.num_user_hashes, world.num_item_hashes, world.num_author_hashes)
  common = dict(model=transformer, emb_size=m["emb_size"], history_seq_len=world.history_len,
                candidate_seq_len=world.num_candidates, hash_config=hashes,
                num_actions=world.num_actions,
                product_surface_vocab_size=world.product_surface_vocab_size,
                fprop_dtype=m["fprop_dtype"] or default_fprop_dtype())
  cls, other_cls = _model_classes(c.task)
  other_task = "retrieval" if c.task == "ranking" else "ranking"
  # The other task's switches have no field here: one set away from its default would
  # change nothing (two variants differing only in it would train the same model).
  other_defaults = {f.name: field_default(f) for f in dataclasses.fields(other_cls)}
  for k in sorted(set(m) & _other_model_switches(c.task)):
    _check(m[k] == other_defaults[k], f"model.{k}", m[k],
           f"it is a switch of the {other_task} model only, and the {c.task} model has no "
           f"such setting, so it would change nothing; leave it at {other_defaults[k]!r}")
  own = _fields(cls) - tc_fields - set(common)
  switches = {k: v for k, v in m.items() if k in own}
  return _build("model", cls, **switches, **common)


def _split(path: str, fields, world: WorldConfig) -> SplitConfig:
  split = _build(path, SplitConfig, **fields.to_dict())
  _build(path, split.resolve, world_cfg=world)
  return split


def _check_paths(c: ml_collections.ConfigDict) -> None:
  """Every path of the config outside `model` (whose keys `_model_config` checks against
  the model configs' fields) and `extra_eval_splits` (checked against `SplitConfig`) is a
  path of the schema, and every schema path is there: a misspelled key in a config file
  or an ablation's `task` would otherwise be ignored and the run train with the default."""
  skip = ("model", "extra_eval_splits")
  base = base_config(c.task)
  have = set(flatten(c, skip=skip))
  want = set(flatten(base, skip=skip))

  def lacks(what) -> ConfigError:
    return ConfigError(f"config lacks {what}: build configs on "
                       "phoenix_flax.training.base_config, which holds every field")

  unknown, missing = sorted(have - want), sorted(want - have)
  if unknown:
    def hint(path: str) -> str:   # the closest field name of the same section
      section, _, name = path.rpartition(".")
      names = [w.rpartition(".")[2] for w in want if w.rpartition(".")[0] == section]
      close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)
      return f" (did you mean {section + '.' if section else ''}{close[0]}?)" if close else ""
    named = ", ".join(f"{p!r}{hint(p)}" for p in unknown)
    raise ConfigError(f"config has no field(s) {named}: every field is listed in "
                      "phoenix_flax/training/schema.py")
  if missing:
    raise lacks(missing)
  section = (Mapping, ml_collections.ConfigDict)
  for name in skip:
    if name not in c:
      raise lacks(repr(name))
    _check(isinstance(c[name], section), name, c[name], "must be a section")
  lacking = sorted(f"model.{key}" for key in base.model if key not in c.model)
  if lacking:
    raise lacks(lacking)
  for name, split in c.extra_eval_splits.items():
    _check(isinstance(split, section), f"extra_eval_splits.{name}", split,
           "must be a section of SplitConfig fields (see split_config)")


def _check_other_task(c: ml_collections.ConfigDict) -> None:
  """The other task's section holds its defaults: this task never reads it, so a value
  set there would change nothing (two variants differing only in it train alike)."""
  other = "retrieval" if c.task == "ranking" else "ranking"
  defaults = base_config(other)[other]
  as_tuple = lambda v: tuple(v) if isinstance(v, (list, tuple)) else v
  for key, value in c[other].items():
    _check(as_tuple(value) == as_tuple(defaults[key]), f"{other}.{key}", value,
           f"only {other} runs read it and this is a {c.task} run (config.task), so it "
           f"would change nothing; leave it at {defaults[key]!r}")


def _check_optim(o: ml_collections.ConfigDict) -> None:
  """The `optim` section: AdamW, its schedule and clipping."""
  _check(_is_num(o.learning_rate) and o.learning_rate > 0, "optim.learning_rate",
         o.learning_rate, "must be a finite number > 0")
  _check(_is_int(o.warmup_steps) and o.warmup_steps >= 0, "optim.warmup_steps",
         o.warmup_steps, "must be an integer >= 0")
  _check(_is_num(o.end_lr_fraction) and 0 <= o.end_lr_fraction <= 1, "optim.end_lr_fraction",
         o.end_lr_fraction, "must be in [0, 1]")
  _check(_is_num(o.weight_decay) and o.weight_decay >= 0, "optim.weight_decay",
         o.weight_decay, "must be >= 0")
  for f in ("b1", "b2"):
    _check(_is_num(o[f]) and 0 <= o[f] < 1, f"optim.{f}", o[f], "must be in [0, 1)")
  _check(_is_num(o.eps) and o.eps >= 1e-30, "optim.eps", o.eps,
         "must be >= 1e-30: near float32's smallest normal number (1.2e-38) XLA flushes it "
         "to zero, and AdamW's update of a parameter with a zero gradient (every hash-table "
         "row a batch misses) is NaN while the loss stays finite (seen at 1e-37)")
  _check(o.grad_clip_norm is None or (_is_num(o.grad_clip_norm) and o.grad_clip_norm > 0),
         "optim.grad_clip_norm", o.grad_clip_norm, "must be > 0, or None for no clipping")


def _check_warmup(o: ml_collections.ConfigDict, num_steps: int) -> None:
  _check(o.warmup_steps < num_steps, "optim.warmup_steps", o.warmup_steps,
         f"must be below train.num_steps={num_steps}: the learning rate would never reach "
         "its peak nor decay")


def check_optim(o: ml_collections.ConfigDict, num_steps: int) -> None:
  """An `optim` section (`base_config(task).optim`, edited) for a run of `num_steps`
  steps, as `parse_config` checks it; raises ConfigError."""
  if not isinstance(o, ml_collections.ConfigDict):
    raise ConfigError(f"optim must be a ConfigDict (base_config(task).optim), got "
                      f"{type(o).__name__}")
  known = set(base_config("ranking").optim)
  unknown, missing = sorted(set(o) - known), sorted(known - set(o))
  if unknown or missing:
    raise ConfigError(f"optim: unknown fields {unknown}, missing fields {missing}; start "
                      "from base_config(task).optim")
  _check_optim(o)
  _check(_is_int(num_steps) and num_steps >= 1, "train.num_steps", num_steps,
         "must be an integer >= 1")
  _check_step_count(num_steps)
  _check_warmup(o, num_steps)


def _check_step_count(num_steps: int) -> None:
  """The train state counts steps in int32: past its range the count wraps negative,
  where the schedule gives a learning rate of 0 and the data keys repeat."""
  _check(num_steps <= INT32.max, "train.num_steps", num_steps,
         f"must be at most {INT32.max}: the training step is counted in int32")


def _check_train(c: ml_collections.ConfigDict, world: WorldConfig) -> Optional[tuple]:
  """The `train` section; returns the ranking loss's action weights (a tuple), or None."""
  t, o = c.train, c.optim
  for f in ("num_steps", "batch_size", "steps_per_call", "eval_batch_size", "eval_batches"):
    _check(_is_int(t[f]) and t[f] >= 1, f"train.{f}", t[f], "must be an integer >= 1")
  _check_step_count(t.num_steps)
  _check(t.num_steps % t.steps_per_call == 0, "train.steps_per_call", t.steps_per_call,
         f"must divide train.num_steps={t.num_steps}")
  _check_warmup(o, t.num_steps)
  for f in ("eval_every", "checkpoint_every"):
    _check(_is_int(t[f]) and t[f] >= 0 and t[f] % t.steps_per_call == 0, f"train.{f}", t[f],
           f"must be 0 (off) or a multiple of train.steps_per_call={t.steps_per_call}")
  _check(t.eval_batch_size >= 2, "train.eval_batch_size", t.eval_batch_size,
         "must be >= 2 (score consistency borrows companions from another user)")
  _check(c.task == "ranking" or t.batch_size >= 2, "train.batch_size", t.batch_size,
         "retrieval needs >= 2 users per batch (in-batch negatives)")
  _check(isinstance(t.score_consistency, bool), "train.score_consistency",
         t.score_consistency, "must be a bool")
  weights = None
  _check(t.action_weights is None or c.task == "ranking", "train.action_weights",
         t.action_weights, "weighs the ranking loss's actions; retrieval trains on "
         "retrieval.positive_action alone, so leave it None")
  if t.action_weights is not None:
    weights = tuple(t.action_weights) if isinstance(t.action_weights, (tuple, list)) else ()
    # (Only their ratios matter. The bounds keep the loss's float32 products and sums
    # finite and far from float32's smallest numbers: 1e39 became inf, and the loss NaN.)
    _check(len(weights) == world.num_actions
           and all(_is_num(w) and 0 <= w <= MAX_ACTION_WEIGHT for w in weights)
           and sum(weights) >= 1e-6, "train.action_weights", t.action_weights,
           f"give {world.num_actions} weights in [0, {MAX_ACTION_WEIGHT:g}] (one per "
           "action, only their ratios matter) with a sum >= 1e-6, or None")
    weights = tuple(float(w) for w in weights)
  return weights


def _check_metric_settings(c: ml_collections.ConfigDict, world: WorldConfig) -> None:
  """The `ranking` and `retrieval` sections: each field's range (and `logq_decay` set only
  with the correction on)."""
  ks = tuple(c.ranking.top_k) if isinstance(c.ranking.top_k, (tuple, list)) else ()
  _check(len(ks) >= 1 and all(_is_int(k) and k >= 1 for k in ks) and len(set(ks)) == len(ks),
         "ranking.top_k", c.ranking.top_k, "give one or more distinct integers >= 1")

  r = c.retrieval
  _check(_is_num(r.temperature) and r.temperature > 0, "retrieval.temperature",
         r.temperature, "must be > 0")
  _check(_is_int(r.positive_action) and 0 <= r.positive_action < world.num_actions,
         "retrieval.positive_action", r.positive_action,
         f"must be an action index in [0, {world.num_actions})")
  ks = tuple(r.recall_k) if isinstance(r.recall_k, (tuple, list)) else ()
  _check(len(ks) >= 1 and all(_is_int(k) and k >= 1 for k in ks) and len(set(ks)) == len(ks),
         "retrieval.recall_k", r.recall_k, "give one or more distinct integers >= 1")
  _check(c.task != "retrieval" or max(ks) <= world.num_posts, "retrieval.recall_k",
         r.recall_k, f"K must be at most world.num_posts={world.num_posts} (the corpus size)")
  _check(isinstance(r.logq_correction, bool), "retrieval.logq_correction", r.logq_correction,
         "must be True or False")
  _check(_is_num(r.logq_decay) and 0 < r.logq_decay < 1, "retrieval.logq_decay",
         r.logq_decay, "must be in (0, 1): the factor the counts decay by per step")
  default_decay = base_config("retrieval").retrieval.logq_decay
  _check(r.logq_correction or r.logq_decay == default_decay, "retrieval.logq_decay",
         r.logq_decay, "only runs with retrieval.logq_correction=True read it, so it would "
         f"change nothing; leave it at {default_decay!r}")


def _host_port(address: Any) -> bool:
  """Whether `address` is 'host:port' with a port number (gRPC crashed the process, not
  refused it, on 'localhost:abc')."""
  if not isinstance(address, str):
    return False
  host, _, port = address.rpartition(":")
  return bool(host) and port.isascii() and port.isdigit() and 0 < int(port) < 65536


def _check_mesh(m: ml_collections.ConfigDict) -> None:
  """The `mesh` section: devices, hash-table sharding, multi-host settings."""
  _check(_is_int(m.num_devices) and (m.num_devices >= 1 or m.num_devices == -1),
         "mesh.num_devices", m.num_devices, "must be -1 (all devices) or an integer >= 1")
  for f in ("shard_hash_tables", "distributed"):
    _check(isinstance(m[f], bool), f"mesh.{f}", m[f], "must be a bool")
  _check(m.coordinator_address is None or _host_port(m.coordinator_address),
         "mesh.coordinator_address", m.coordinator_address,
         "use 'host:port' (a port in 1..65535), or None")
  _check(m.num_processes is None or (_is_int(m.num_processes) and m.num_processes >= 1),
         "mesh.num_processes", m.num_processes, "must be an integer >= 1, or None")
  _check(m.process_id is None or (_is_int(m.process_id) and 0 <= m.process_id
                                  and (m.num_processes is None
                                       or m.process_id < m.num_processes)),
         "mesh.process_id", m.process_id, "must be an integer in [0, num_processes), or None")
  _check(_is_int(m.initialization_timeout) and m.initialization_timeout >= 1,
         "mesh.initialization_timeout", m.initialization_timeout,
         "must be an integer >= 1 (seconds)")
  _check(not m.shard_hash_tables or m.num_devices != 1, "mesh.shard_hash_tables",
         m.shard_hash_tables, "needs a mesh: set mesh.num_devices to -1 (all) or N > 1")
  for f in ("coordinator_address", "num_processes", "process_id"):
    _check(m.distributed or m[f] is None, f"mesh.{f}", m[f],
           "is read only with mesh.distributed=True: set it on every host, or unset this")


def _check_output(c: ml_collections.ConfigDict) -> None:
  """The `output` section."""
  out = c.output
  _check(out.seed_subdirs is None or isinstance(out.seed_subdirs, bool),   # not 0 or 1
         "output.seed_subdirs", out.seed_subdirs, "must be None (auto), True or False")
  _check(out.seed_subdirs is not False or c.num_seeds == 1, "output.seed_subdirs",
         out.seed_subdirs, "False needs num_seeds=1 (several seeds need one directory each)")
  _check(_is_int(out.keep_checkpoints) and out.keep_checkpoints >= 1,
         "output.keep_checkpoints", out.keep_checkpoints, "must be an integer >= 1")
  _check(out.keep_checkpoints >= 2 or c.num_seeds == 1, "output.keep_checkpoints",
         out.keep_checkpoints, "must be >= 2 with several seeds: their checkpoints are "
         "written one after another, and a kill between two writes must leave a step that "
         "every seed has")


def parse_config(config: ml_collections.ConfigDict) -> ExperimentSpec:
  """Validates every field; raises `ConfigError` naming the first bad one."""
  c = config
  if not isinstance(c, ml_collections.ConfigDict):
    raise ConfigError(f"the config must be an ml_collections.ConfigDict, got "
                      f"{type(c).__name__}")
  _check(c.get("task") in TASKS, "task", c.get("task"), f"use one of {TASKS}")
  _check_paths(c)
  # JAX's PRNG keys take 32-bit seeds: PRNGKey(2**32) is PRNGKey(0).
  for f in ("seed", "world_seed", "eval_seed"):
    _check(_is_int(c[f]) and 0 <= c[f] < 2**32, f, c[f], "must be an integer in [0, 2**32)")
  # split(key)[i] is fold_in(key, i), so evaluation batches 0 and 1 would be drawn from
  # the very random numbers that drew the world (batch 1's users from its post authors).
  _check(c.eval_seed != c.world_seed, "eval_seed", c.eval_seed,
         "must differ from world_seed: the evaluation lists would reuse the world's random "
         "numbers")
  _check(_is_int(c.num_seeds) and c.num_seeds >= 1, "num_seeds", c.num_seeds,
         "must be an integer >= 1")
  _check(c.seed + c.num_seeds <= 2**32, "num_seeds", c.num_seeds,
         f"seeds {c.seed}..{c.seed + c.num_seeds - 1} pass 2**32 - 1, the largest seed")
  world = _build("world", WorldConfig, **c.world.to_dict())
  train_split = _split("train_split", c.train_split, world)
  eval_splits = {"eval": _split("eval_split", c.eval_split, world)}
  for name, fields in c.extra_eval_splits.items():
    _check(re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name) is not None
           and name not in RESERVED_SPLIT_NAMES, "extra_eval_splits", name,
           f"split names are identifiers other than {RESERVED_SPLIT_NAMES}")
    eval_splits[name] = _split(f"extra_eval_splits.{name}", fields, world)
  model = _model_config(c, world)
  _check(_is_num(c.model.embedding_init_scale) and c.model.embedding_init_scale > 0,
         "model.embedding_init_scale", c.model.embedding_init_scale, "must be > 0")
  _check_optim(c.optim)
  weights = _check_train(c, world)
  _check_metric_settings(c, world)
  _check_other_task(c)
  _check_mesh(c.mesh)
  _check_output(c)
  return ExperimentSpec(config=c, world=world, train_split=train_split,
                        eval_splits=eval_splits, model=model, action_weights=weights)




def with_defaults(stored: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A stored config (a run's config.json) completed with the schema's defaults for the
  fields it predates. A switch added later defaults to the released behaviour, which is
  what runs made before it computed, so they still resume, skip and load."""
  def fill(dst: dict, defaults: Mapping) -> None:
    for key, value in defaults.items():
      if key not in dst:
        dst[key] = copy.deepcopy(value)
      elif isinstance(value, Mapping) and isinstance(dst[key], dict):
        fill(dst[key], value)

  out = copy.deepcopy(dict(stored))
  fill(out, base_config(out.get("task", "ranking")).to_dict())
  for split in out["extra_eval_splits"].values():
    fill(split, split_config().to_dict())
  return ml_collections.ConfigDict(out)


def check_config(config: ml_collections.ConfigDict) -> None:
  """`parse_config`'s validation without touching a JAX backend, for use before
  `jax.distributed.initialize` (which must run first): the forward dtype's backend
  default is the only part that needs one, and a placeholder stands in for it."""
  probe = ml_collections.ConfigDict(config.to_dict())
  model = probe.get("model")
  if isinstance(model, ml_collections.ConfigDict) and model.get("fprop_dtype", "") is None:
    model.fprop_dtype = "float32"
  parse_config(probe)


def seed_config(config: ml_collections.ConfigDict, seed: int) -> ml_collections.ConfigDict:
  """The config of one seed's run (`seed=seed, num_seeds=1`): what its config.json holds."""
  single = ml_collections.ConfigDict(config.to_dict())
  single.seed = seed
  single.num_seeds = 1
  return single


def _model_classes(task: str) -> tuple[type, type]:
  """(the task's model config class, the other task's)."""
  return ((PhoenixModelConfig, PhoenixRetrievalModelConfig) if task == "ranking"
          else (PhoenixRetrievalModelConfig, PhoenixModelConfig))


def _other_model_switches(task: str) -> set[str]:
  """The model section's fields that only the other task's model has."""
  own, other = _model_classes(task)
  return _fields(other) - _fields(own) - _fields(TransformerConfig)


@functools.lru_cache(maxsize=None)
def _nullable_paths(task: str) -> frozenset:
  """The dotted paths of `task`'s schema fields that take None or a value (`nullable`)."""
  found = set()

  def walk(prefix: str, node: ml_collections.ConfigDict) -> None:
    for key in node.keys():
      if isinstance(node[key], ml_collections.ConfigDict):
        walk(f"{prefix}{key}.", node[key])
      elif node.get_type(key) is object:
        found.add(f"{prefix}{key}")
  walk("", base_config(task))
  return frozenset(found)


def hparams(config: Mapping[str, Any]) -> dict[str, Any]:
  """The settings a run logs as its TensorBoard hparams: every leaf of the config but the
  runtime sections, the other task's section and the other task's model switches (a
  retrieval run has no `candidate_isolation`), which the run never reads.

  A field that takes None or a value (`nullable`: the soft cap, say) is logged as a string
  in every run ("30.0", "None"): TensorBoard types a column over all runs, and a column
  of numbers and "None" became a string column whose filter, comparing strings, hid
  every numeric run."""
  other = "retrieval" if config["task"] == "ranking" else "ranking"
  skip = {f"model.{k}" for k in _other_model_switches(config["task"])}
  nullable = _nullable_paths(config["task"])
  # (the extra evaluation splits' fields are the eval split's)
  is_nullable = lambda k: (k in nullable or k.startswith("extra_eval_splits.")
                           and "eval_split." + k.rsplit(".", 1)[-1] in nullable)
  return {k: str(v) if is_nullable(k) else v
          for k, v in flatten(config, skip=RUNTIME_SECTIONS + (other,)).items()
          if k not in skip}


def schema_paths() -> set[str]:
  """The dotted paths of every field of the schema (either task's base config)."""
  return {path for task in TASKS for path in flatten(base_config(task))}


def paths_named(name: str) -> list[str]:
  """The dotted paths of the schema whose last key is `name`: where a field that an
  override or a config file put in the wrong section lives."""
  return sorted(path for path in schema_paths() if path.rsplit(".", 1)[-1] == name)


def flatten(config: Mapping[str, Any], skip: tuple = ()) -> dict[str, Any]:
  """`{"model.num_layers": 2, ...}` of every leaf of a ConfigDict or nested dict, skipping
  the top-level sections `skip`."""
  out = {}

  def walk(prefix: str, node) -> None:
    for key, value in node.items():
      path = f"{prefix}{key}"
      if isinstance(value, Mapping):
        walk(f"{path}.", value)
      else:
        out[path] = value

  tree = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else config
  walk("", {k: v for k, v in tree.items() if k not in skip})
  return out
