"""Configuration dataclasses; every ablation switch lives here and is validated.

Field order of the release's configs is kept (positional construction ports), and the
switches follow. Their defaults are the release's, with two exceptions made for training
from scratch on any backend: `param_init` defaults to variance scaling (the release
initialises every transformer weight and norm scale to zero, placeholders for a
checkpoint: every transformer gradient is then exactly zero, so only the input
projections, final norm and unembedding could learn; "zeros" reproduces them) and
`fprop_dtype` to float32 (the release runs bfloat16).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

NORM_LAYOUTS = ("sandwich", "pre", "post")
PARAM_INITS = ("variance_scaling", "zeros", "rezero")
FPROP_DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("isolated", "dense")
POST_AGE_MAX_MINUTES = 4800   # ages beyond it share the last post-age bucket
AUTO_MICRO_BATCH_ROWS = 2048  # micro_batch_rows="auto" on CPU


def _fail(cls: str, field: str, value: Any, fix: str) -> None:
  raise ValueError(f"{cls}.{field}={value!r} is invalid: {fix}")


def _int_at_least(cls: str, field: str, value: Any, low: int, note: str = "") -> None:
  # A config is static (hashed, compared, written to JSON): its sizes are Python ints.
  if not isinstance(value, int) or isinstance(value, bool) or value < low:
    _fail(cls, field, value, f"must be an integer >= {low}{note}" + (
        f" (a Python int: int({value!r}))" if isinstance(value, np.integer) else ""))


def _positive_int(cls: str, field: str, value: Any) -> None:
  _int_at_least(cls, field, value, 1)


def _is_real(value: Any) -> bool:
  """A real number (NumPy scalars included), not a bool, which would pass for 0 or 1."""
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
      value, (bool, np.bool_))


def _is_int(value: Any) -> bool:
  """An integer (NumPy integers included), not a bool."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


INT32 = np.iinfo(np.int32)


def _beyond_int32(a: np.ndarray) -> np.ndarray:
  """Where integers `a` do not fit int32, the dtype the model computes in."""
  return (a > INT32.max) | (a < INT32.min)


def _count(name: str, value: Any, low: int, high: Optional[int] = None, what: str = "") -> int:
  """`value` as a Python int in `[low, high]` (NumPy integers accepted, bools not), else a
  ValueError naming `name`: the argument check of the public functions and runners."""
  if not _is_int(value) or value < low or (high is not None and value > high):
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{name}={value!r} must be an integer {bound}{what}")
  return int(value)


@functools.lru_cache(maxsize=None)
def _raw_key_shape(impl: str) -> tuple[int, ...]:
  """The shape of a raw `uint32` key of PRNG implementation `impl`."""
  return jax.random.key_data(jax.random.key(0, impl=impl)).shape


def _nnx_hint(model: Any) -> str:
  """The way out, for a TypeError's message, where a Flax NNX wrapper was passed in place
  of its Equinox model (a runner's or the Haiku export's); "" for anything else."""
  if not type(model).__name__.startswith("NNX"):
    return ""
  return "; convert an NNX wrapper with phoenix_flax.flax_nnx.to_equinox(model) first"


def _check_key(owner: str, key: Any) -> None:
  """A TypeError naming `owner`'s `key` argument unless it is a PRNG key: a typed one
  (`jax.random.key(seed)`) or the raw `uint32` key data of `jax.random.PRNGKey(seed)`
  of the default implementation (`uint32[2]` for threefry, `uint32[4]` for "rbg")."""
  dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
  typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
  if (typed and tuple(shape) == ()) or (
      dtype == np.uint32 and tuple(shape) == _raw_key_shape(jax.config.jax_default_prng_impl)):
    return
  what = (f"an array of shape {tuple(shape)} and dtype {dtype}" if dtype is not None
          else repr(key))
  raise TypeError(f"{owner}: key={what} is not a PRNG key; pass jax.random.key(seed) (or "
                  "jax.random.PRNGKey(seed)), one key, not a batch of them")


def _positive_float(cls: str, field: str, value: Any, most: Optional[float] = None,
                    why: str = "") -> None:
  # A bool would count as 1.0 and a string fail in a comparison; inf or NaN gives NaN
  # scores (inf * tanh(0)).
  if not _is_real(value) or not math.isfinite(value) or value <= 0:
    _fail(cls, field, value, "must be a finite number > 0")
  if most is not None and value > most:
    _fail(cls, field, value, f"must be at most {most:g}{why}")


# Attention scales and caps are applied in float32: past 1e6 a cap turns its logits into
# flushed subnormals (1e37) or inf * tanh(0) = NaN (above float32's range), and a
# multiplier overflows them; no reachable attention logit needs either.
MAX_ATTENTION_SCALE = 1e6


def _bool(cls: str, field: str, value: Any) -> None:
  # A string such as "False" would otherwise count as true wherever the flag is tested.
  if not isinstance(value, (bool, np.bool_)):
    _fail(cls, field, value, "must be True or False")


def canonical_dtype(value: Any, cls: str = "config") -> str:
  """Maps a dtype given as a string or numpy/jax dtype to "float32" or "bfloat16"."""
  try:
    name = jnp.dtype(value).name
  except TypeError:
    name = str(value)
  if name not in FPROP_DTYPES:
    _fail(cls, "fprop_dtype", value, f"use one of {FPROP_DTYPES}")
  return name


def field_default(field: dataclasses.Field) -> Any:
  """A dataclass field's default: its `default`, or a fresh call of its `default_factory`
  (a switch declared with `dataclasses.field(default_factory=...)` has `default` MISSING);
  `dataclasses.MISSING` when it has neither."""
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return field.default


def ffn_size(emb_size: int, widening_factor: float) -> int:
  """Hidden width of the GeGLU block: int(w*D)*2//3 rounded up to a multiple of 8."""
  _count("ffn_size: emb_size", emb_size, 1)
  if not _is_real(widening_factor) or not widening_factor > 0:
    raise ValueError(f"ffn_size: widening_factor={widening_factor!r} must be a number > 0")
  size = int(widening_factor * emb_size) * 2 // 3
  return size + (8 - size) % 8


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Grok transformer shape plus the architecture switches.

  Attributes:
    attn_logit_cap: soft cap ``c * tanh(logits / c)`` on attention logits, c in (0, 1e6];
      None = off.
    norm_layout: "sandwich" (release: norm before and after each block), "pre", "post".
    param_init: "variance_scaling" (trainable), "zeros" (the release's placeholders, whose
      transformer gets exactly zero gradients and never trains), "rezero" (variance-scaled
      weights, zero post-block norm scales).
    scan_unroll: layers per iteration of the layer scan. 1 (default) compiles one layer
      whatever the depth (the ranking model's logits-only `__call__` compiles its last
      layer on its own too); values >= num_layers unroll the stack fully, which makes
      small models' backward passes much cheaper on CPU (no per-layer stacking of
      residuals) at the cost of compile time growing with depth. Numerics do not depend
      on it beyond float reassociation.
  """

  emb_size: int
  key_size: int
  num_q_heads: int
  num_kv_heads: int
  num_layers: int
  widening_factor: float = 4.0
  attn_output_multiplier: float = 1.0
  name: Optional[str] = None
  attn_logit_cap: Optional[float] = 30.0
  norm_layout: str = "sandwich"
  param_init: str = "variance_scaling"
  scan_unroll: int = 1

  def __post_init__(self):
    c = "TransformerConfig"
    for f in ("emb_size", "key_size", "num_q_heads", "num_kv_heads", "num_layers",
              "scan_unroll"):
      _positive_int(c, f, getattr(self, f))
    if self.key_size % 2:
      _fail(c, "key_size", self.key_size, "RoPE rotates halves, so key_size must be even")
    if self.num_q_heads % self.num_kv_heads:
      _fail(c, "num_kv_heads", self.num_kv_heads,
            f"must divide num_q_heads={self.num_q_heads} (grouped-query attention)")
    _positive_float(c, "widening_factor", self.widening_factor)
    if ffn_size(self.emb_size, self.widening_factor) < 1:
      _fail(c, "widening_factor", self.widening_factor, "must give a positive ffn_size")
    _positive_float(c, "attn_output_multiplier", self.attn_output_multiplier,
                    MAX_ATTENTION_SCALE, " (the float32 logits overflow)")
    if self.attn_logit_cap is not None:
      _positive_float(c, "attn_logit_cap", self.attn_logit_cap, MAX_ATTENTION_SCALE,
                      " (a cap above any reachable logit is no cap: use None)")
    if self.norm_layout not in NORM_LAYOUTS:
      _fail(c, "norm_layout", self.norm_layout, f"use one of {NORM_LAYOUTS}")
    if self.param_init not in PARAM_INITS:
      _fail(c, "param_init", self.param_init, f"use one of {PARAM_INITS}")
    if self.param_init == "rezero" and self.norm_layout != "sandwich":
      _fail(c, "param_init", self.param_init,
            "'rezero' zeroes the post-block norm scales, which only norm_layout='sandwich' "
            "has; use param_init='variance_scaling' with this layout")

  @property
  def ffn_size(self) -> int:
    """`ffn_size(emb_size, widening_factor)`: the GeGLU block's hidden width."""
    return ffn_size(self.emb_size, self.widening_factor)

  def kv_cache_bytes(self, context_len: int, dtype: str = "float32") -> int:
    """Bytes of keys and values that one user context of `context_len` tokens holds."""
    _count("kv_cache_bytes: context_len", context_len, 0)
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * self.num_layers * self.num_kv_heads * self.key_size * context_len * itemsize


@dataclasses.dataclass(frozen=True)
class HashConfig:
  """Number of hash functions per entity type (release defaults: 2 each)."""

  num_user_hashes: int = 2
  num_item_hashes: int = 2
  num_author_hashes: int = 2

  def __post_init__(self):
    for f in ("num_user_hashes", "num_item_hashes", "num_author_hashes"):
      _positive_int("HashConfig", f, getattr(self, f))


@dataclasses.dataclass(frozen=True)
class NormConfig:
  """Normalisation of a continuous value: clip to [0, norm_scale], then scale (or log)."""

  norm_scale: float = 30.0
  use_log: bool = False

  def __post_init__(self):
    _positive_float("NormConfig", "norm_scale", self.norm_scale)
    _bool("NormConfig", "use_log", self.use_log)


def _validate_common(cls: str, cfg) -> None:
  if not isinstance(cfg.model, TransformerConfig):
    _fail(cls, "model", type(cfg.model).__name__, "pass a TransformerConfig")
  _positive_int(cls, "emb_size", cfg.emb_size)
  if cfg.model.emb_size != cfg.emb_size:
    _fail(cls, "emb_size", cfg.emb_size,
          f"must equal model.emb_size={cfg.model.emb_size}")
  _positive_int(cls, "history_seq_len", cfg.history_seq_len)
  _positive_int(cls, "candidate_seq_len", cfg.candidate_seq_len)
  _positive_int(cls, "product_surface_vocab_size", cfg.product_surface_vocab_size)
  if cfg.hash_config is None:
    object.__setattr__(cfg, "hash_config", HashConfig())
  if not isinstance(cfg.hash_config, HashConfig):
    _fail(cls, "hash_config", cfg.hash_config, "pass a HashConfig")
  object.__setattr__(cfg, "fprop_dtype", canonical_dtype(cfg.fprop_dtype, cls))


@dataclasses.dataclass(frozen=True)
class PhoenixModelConfig:
  """Ranking model. Release fields first, later-release options and switches after.

  Attributes:
    right_anchored_rope: positions from `right_anchored_rope_positions` (newest history
      item at a fixed position, every candidate one after it) instead of 0..T-1.
    candidate_isolation: candidates see user + history + themselves only (release);
      False gives them the plain causal mask (they see earlier candidates).
    attention_impl: "isolated" computes isolation-aware attention without the C x C
      block; "dense" builds the full masked [T, T] attention (the reference path). It
      applies with candidate_isolation=True only: without isolation a candidate attends
      to the candidates before it, and the dense causal path is the only one.
    micro_batch_rows: the isolated path's logits (`PhoenixModel.__call__`, so
      `RankingRunner.rank`) run in micro-batches of about this many token rows, one after
      another inside the compiled call: users in equal groups of at most `rows // (1+S)`
      (at least one), and within a group of `G` users, candidates beyond `rows // G` per
      user in micro-batches against the group's context, encoded once (HSTU's M-FALCON);
      `PhoenixModel.micro_batch_limits` gives the split. None runs one batch; "auto"
      (default) means 2048 on CPU and None on GPU/TPU, where small sequential steps would
      leave the device idle. A micro-batch's temporaries grow with its rows; on CPU with
      glibc, below 32 MiB they reuse the same pages on every call, while larger blocks
      are mapped (and zeroed by the kernel) afresh. The logits agree to float rounding.
      `forward` (training, diagnostics) and the dense path ignore it.
    post_age_granularity_mins: None = no post-age feature; else the candidate post-age
      bucket embedding (table of 4800 // g + 2 rows) joins the candidate tokens.
    dwell_time_norm: None = no dwell feature; else the history dwell-time embedding.
    num_continuous_actions: width K of the continuous head (0 = none).
  """

  model: TransformerConfig
  emb_size: int
  num_actions: int = 19
  history_seq_len: int = 128
  candidate_seq_len: int = 32
  name: Optional[str] = None
  fprop_dtype: Any = "float32"
  hash_config: Optional[HashConfig] = None
  product_surface_vocab_size: int = 16
  right_anchored_rope: bool = False
  candidate_isolation: bool = True
  attention_impl: str = "isolated"
  micro_batch_rows: Union[int, str, None] = "auto"
  post_age_granularity_mins: Optional[int] = None
  dwell_time_norm: Optional[NormConfig] = None
  dwell_hidden_size: int = 64
  num_continuous_actions: int = 0

  def __post_init__(self):
    c = "PhoenixModelConfig"
    _validate_common(c, self)
    _positive_int(c, "num_actions", self.num_actions)
    _bool(c, "right_anchored_rope", self.right_anchored_rope)
    _bool(c, "candidate_isolation", self.candidate_isolation)
    if self.attention_impl not in ATTENTION_IMPLS:
      _fail(c, "attention_impl", self.attention_impl, f"use one of {ATTENTION_IMPLS}")
    if self.micro_batch_rows not in (None, "auto"):
      _int_at_least(c, "micro_batch_rows", self.micro_batch_rows, 1, ', None or "auto"')
    if self.post_age_granularity_mins is not None:
      # Above POST_AGE_MAX_MINUTES every known age shares bucket 1 (a table of 2 rows), as
      # the release's formula gives: degenerate, but the release's.
      _positive_int(c, "post_age_granularity_mins", self.post_age_granularity_mins)
    if self.dwell_time_norm is not None and not isinstance(self.dwell_time_norm, NormConfig):
      _fail(c, "dwell_time_norm", self.dwell_time_norm, "pass a NormConfig or None")
    _positive_int(c, "dwell_hidden_size", self.dwell_hidden_size)
    if (not isinstance(self.num_continuous_actions, int)
        or isinstance(self.num_continuous_actions, bool) or self.num_continuous_actions < 0):
      _fail(c, "num_continuous_actions", self.num_continuous_actions, "must be an int >= 0")

  @property
  def candidate_start_offset(self) -> int:
    """Index of the first candidate in the sequence `[user | history | candidates]`."""
    return 1 + self.history_seq_len

  @property
  def effective_micro_batch_rows(self) -> Optional[int]:
    """`micro_batch_rows` with "auto" resolved for the default backend."""
    if self.micro_batch_rows == "auto":
      return AUTO_MICRO_BATCH_ROWS if jax.default_backend() == "cpu" else None
    return self.micro_batch_rows

  @property
  def optional_batch_fields(self) -> frozenset[str]:
    """The optional `RecsysBatch` fields this model reads (and so requires); the others
    are ignored whatever they hold."""
    fields = set()
    if self.post_age_granularity_mins is not None:
      fields |= {"impression_timestamps", "candidate_post_timestamps"}
    if self.dwell_time_norm is not None:
      fields.add("history_dwell_times")
    return frozenset(fields)

  @property
  def num_post_age_buckets(self) -> int:
    """Rows of the post-age table, `4800 // post_age_granularity_mins + 2` (only with
    the post-age feature on: a TypeError when `post_age_granularity_mins` is None)."""
    return POST_AGE_MAX_MINUTES // self.post_age_granularity_mins + 2


@dataclasses.dataclass(frozen=True)
class PhoenixRetrievalModelConfig:
  """Two-tower retrieval model (release field order; `enable_linear_proj` from the later
  release selects the MLP candidate tower, False the parameter-free mean pool)."""

  model: TransformerConfig
  emb_size: int
  history_seq_len: int = 128
  candidate_seq_len: int = 32
  name: Optional[str] = None
  fprop_dtype: Any = "float32"
  hash_config: Optional[HashConfig] = None
  product_surface_vocab_size: int = 16
  enable_linear_proj: bool = True
  num_actions: int = 19

  def __post_init__(self):
    c = "PhoenixRetrievalModelConfig"
    _validate_common(c, self)
    _positive_int(c, "num_actions", self.num_actions)
    _bool(c, "enable_linear_proj", self.enable_linear_proj)

  @property
  def optional_batch_fields(self) -> frozenset[str]:
    """The optional `RecsysBatch` fields this model reads: none."""
    return frozenset()
