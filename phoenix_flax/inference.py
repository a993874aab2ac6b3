"""Serving runners: rank candidates, score them in chunks against a cached user context,
and retrieve from a corpus.

Runners call one `xla_options.filter_jit` per entry point (an `eqx.filter_jit` compiled
once per model structure and input shape, with `xla_options.compiler_options()`), shared by
every runner in the process, and validate every input before the model runs, raising a
`ValueError` that names the offending field (host arrays on the host; a device array's
finiteness or mask by a small reduction on its device, whose result is read back). A
runner's `trace_counts` records how often its calls traced each entry point (none where
another runner's calls already compiled the same model structure and shapes).
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Callable, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, PRNGKeyArray

from phoenix_flax import xla_options
from phoenix_flax.config import (PhoenixModelConfig, PhoenixRetrievalModelConfig,
                                 _beyond_int32, _count, _nnx_hint)
from phoenix_flax.ranking import PhoenixModel
from phoenix_flax.retrieval import PhoenixRetrievalModel
from phoenix_flax.transformer import ContextCache, check_cache
from phoenix_flax.types import (CANDIDATE_BATCH_FIELDS, CANDIDATE_EMBEDDING_FIELDS, RecsysBatch,
                                RecsysEmbeddings)

ACTIONS = (
    "favorite_score", "reply_score", "repost_score", "photo_expand_score", "click_score",
    "profile_click_score", "vqv_score", "share_score", "share_via_dm_score",
    "share_via_copy_link_score", "dwell_score", "quote_score", "quoted_click_score",
    "follow_author_score", "not_interested_score", "block_author_score",
    "mute_author_score", "report_score", "dwell_time",
)
NEGATIVE_ACTIONS = ACTIONS[14:18]
PRIMARY_ACTION = 0  # favorite_score orders the ranking, as released



def _check_float32_params(owner: str, model) -> None:
  """A ValueError naming the first parameter that is not float32. The models store float32
  and compute in `config.fprop_dtype`; the parts that stay float32 whatever it says (input
  projections, head, candidate tower) follow their weights' dtype, so parameters cast to
  bfloat16 would run them, and return logits, in bfloat16 under a float32 config."""
  leaves = jax.tree_util.tree_flatten_with_path(model)[0]
  for path, leaf in leaves:
    if (isinstance(leaf, (jax.Array, np.ndarray)) and jnp.issubdtype(leaf.dtype, jnp.floating)
        and leaf.dtype != jnp.float32):
      raise ValueError(
          f"{owner}: parameter model{jax.tree_util.keystr(path)} is {leaf.dtype}; the "
          "models keep float32 parameters and compute in config.fprop_dtype (set "
          "fprop_dtype='bfloat16' for a bfloat16 forward pass, not the parameters' dtype)")


def action_index(name: str) -> int:
  """Position of an action name in `ACTIONS`."""
  if name not in ACTIONS:
    raise ValueError(f"unknown action {name!r}; valid names: {', '.join(ACTIONS)}")
  return ACTIONS.index(name)


class RankingOutput(NamedTuple):
  """Sigmoid probabilities per action and candidates ordered best first."""

  scores: Array                       # [B, C, A] probabilities
  ranked_indices: Array               # [B, C] by favorite_score, padded candidates last
  continuous: Optional[Array] = None  # [B, C, K] when the continuous head is enabled

  def action(self, name: str) -> Array:
    """Probabilities `[B, C]` of one action, by name."""
    i = action_index(name)
    if i >= self.scores.shape[-1]:
      raise ValueError(f"action {name!r} has index {i}, the model predicts only "
                       f"{self.scores.shape[-1]} actions")
    return self.scores[..., i]


def weighted_score(probs: ArrayLike, weights: Union[Mapping[str, float], ArrayLike]) -> Array:
  """`sum_a w_a * p_a` over the last axis; `weights` is `{action name: weight}` (absent
  actions weigh 0; negative actions usually get negative weights) or an `[A]` vector."""
  probs = jnp.asarray(probs)
  if not jnp.issubdtype(probs.dtype, jnp.floating):
    probs = probs.astype(jnp.float32)   # weights would otherwise be cast to integers
  A = probs.shape[-1]
  if isinstance(weights, Mapping):
    w = np.zeros(A, np.float32)
    for name, value in weights.items():
      i = action_index(name)
      if i >= A:
        raise ValueError(f"weights names {name!r} (index {i}), probs hold only {A} actions")
      w[i] = value
  else:
    w = np.asarray(weights, np.float32)
    if w.shape != (A,):
      raise ValueError(f"weights has shape {w.shape}, expected ({A},) to match probs")
  if not np.isfinite(w).all():
    raise ValueError(f"weights hold a non-finite value: {w[~np.isfinite(w)][0]}")
  return probs @ jnp.asarray(w, probs.dtype)


def _field(prefix: str, name: str, x, shape: tuple[int, ...], dims: str, kind: str,
           origins: tuple[str, ...] = ()) -> None:
  """Checks presence, shape and dtype without copying the values to the host. `origins`
  say where the sizes of `dims` were read (such as "C=5 from batch.candidate_post_hashes"),
  so a wrong shape there is not blamed on a field alone."""
  label = f"{prefix}.{name}" if prefix else name
  if x is None:
    raise ValueError(f"{label} is required but is None")
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise ValueError(f"{label} is a {type(x).__name__}; pass a numpy or jax array")
  dtype, got = x.dtype, tuple(np.shape(x))
  if got != shape:
    # Name where a size came from only where that dimension is the one that differs.
    labels = dims.split(", ")
    wrong = set(labels) if len(got) != len(shape) else {
        label for label, g, s in zip(labels, got, shape) if g != s}
    named = [o for o in origins if o.split("=")[0] in wrong]
    raise ValueError(f"{label} has shape {got}, expected {shape} [{dims}]"
                     + (f" ({'; '.join(named)})" if named else ""))
  if kind == "int" and not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"{label} has dtype {dtype}, expected integers")
  if kind == "float" and not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{label} has dtype {dtype}, expected floats")


def _check_values(name: str, a: np.ndarray, bad: np.ndarray, rule: str,
                  prefix: str = "batch") -> None:
  if bad.any():
    label = f"{prefix}.{name}" if prefix else name
    raise ValueError(f"{label} holds {a[bad][0].item()!r} at index "
                     f"{tuple(int(i) for i in np.argwhere(bad)[0])}; {rule}")


@jax.jit
def _all_finite(x: Array) -> Array:
  # One program per shape (the two eager operations compiled one each).
  return jnp.all(jnp.isfinite(x))


@jax.jit
def _mask_summary(mask: Array) -> tuple[Array, Array]:
  """Whether a corpus mask holds only 0/1, and the items it keeps per row."""
  rows = jnp.atleast_2d(mask)
  zero, one = jnp.zeros((), rows.dtype), jnp.ones((), rows.dtype)
  return jnp.all((rows == zero) | (rows == one)), jnp.count_nonzero(rows, axis=-1)


def _host_or_device(x) -> Union[np.ndarray, Array]:
  """A `jax.Array` as it is (checks then run where it lives), anything else as NumPy."""
  return x if isinstance(x, jax.Array) else np.asarray(x)


def _check_finite(prefix: str, name: str, x) -> None:
  """Floats must be finite: one NaN embedding makes every score it reaches NaN (and a
  NaN corpus row tops every retrieval). A device array is reduced where it lives, so only
  a bad one is copied to the host (for the message)."""
  if bool(_all_finite(x) if isinstance(x, jax.Array) else np.isfinite(x).all()):
    return
  a = np.asarray(x, np.float32)
  _check_values(name, a, ~np.isfinite(a), "values must be finite", prefix)


def check_left_aligned(history_post_hashes: np.ndarray, why: str = "") -> None:
  """A ValueError naming the first history item that follows padding (hash 0): the
  history must be left-aligned, valid items first, oldest first."""
  first_hash = np.asarray(history_post_hashes)[..., 0]
  after_pad = np.logical_or.accumulate(first_hash == 0, axis=1)
  _check_values("history_post_hashes", first_hash,
                (first_hash != 0) & np.pad(after_pad[:, :-1], ((0, 0), (1, 0))),
                f"{why}the history must be left-aligned (valid items first, oldest first, "
                "hash-0 padding after); this item follows padding")


def validate_batch(config: Union[PhoenixModelConfig, PhoenixRetrievalModelConfig],
                   batch: RecsysBatch, *, with_candidates: bool = True) -> tuple[int, int]:
  """Host-side checks of a batch against a model config, the runners' own: every field's
  shape and dtype, values that fit int32, hashes >= 0, surface ids below the vocabulary,
  0/1 history actions, finite dwell times and, with right-anchored positions, a
  left-aligned history. Returns (B, C) (C = 0 without candidates); raises ValueError
  naming the field, the bad value and its index (TypeError for a `batch` that is not a
  `RecsysBatch`).

  The models' own entry points check shapes and dtypes only (they run traced), so a
  training loop over your own data calls this, or `training.validate_training_batch`
  (which also checks the layout, the hashes against the system's tables, the labels and
  the mask), on each host batch before the jitted step."""
  if not isinstance(batch, RecsysBatch):
    raise TypeError(f"batch must be a RecsysBatch, got {type(batch).__name__}")
  hc, S, A = config.hash_config, config.history_seq_len, config.num_actions
  U, I, Au = hc.num_user_hashes, hc.num_item_hashes, hc.num_author_hashes
  V = config.product_surface_vocab_size
  if batch.user_hashes is None or np.ndim(batch.user_hashes) != 2:
    raise ValueError(f"batch.user_hashes must be [B, U], got shape {np.shape(batch.user_hashes)}")
  B = np.shape(batch.user_hashes)[0]
  if B < 1:
    raise ValueError("batch.user_hashes holds no users (B = 0)")
  specs = [("user_hashes", (B, U), "B, num_user_hashes", "int"),
           ("history_post_hashes", (B, S, I), "B, history_seq_len, num_item_hashes", "int"),
           ("history_author_hashes", (B, S, Au), "B, history_seq_len, num_author_hashes", "int"),
           ("history_actions", (B, S, A), f"B, history_seq_len, num_actions={A}", "any"),
           ("history_product_surface", (B, S), "B, history_seq_len", "int")]
  C = 0
  if with_candidates:
    if batch.candidate_post_hashes is None or np.ndim(batch.candidate_post_hashes) != 3:
      raise ValueError("batch.candidate_post_hashes must be [B, C, num_item_hashes], got "
                       f"shape {np.shape(batch.candidate_post_hashes)}")
    C = np.shape(batch.candidate_post_hashes)[1]
    if C < 1:
      raise ValueError("batch.candidate_post_hashes holds no candidates (C = 0)")
    specs += [("candidate_post_hashes", (B, C, I), "B, C, num_item_hashes", "int"),
              ("candidate_author_hashes", (B, C, Au), "B, C, num_author_hashes", "int"),
              ("candidate_product_surface", (B, C), "B, C", "int")]
    # Timestamps and dwell times are checked (and required) only when the model reads them.
    if "impression_timestamps" in config.optional_batch_fields:
      specs += [("impression_timestamps", (B,), "B", "int"),
                ("candidate_post_timestamps", (B, C), "B, C", "int")]
  if "history_dwell_times" in config.optional_batch_fields:
    specs.append(("history_dwell_times", (B, S), "B, history_seq_len", "any"))
  origins = _size_origins(B, C)
  for name, shape, dims, kind in specs:
    _field("batch", name, getattr(batch, name), shape, dims, kind, origins)
  arrays = {name: np.asarray(getattr(batch, name)) for name, *_ in specs}

  for name, a in arrays.items():
    if jnp.issubdtype(a.dtype, jnp.integer):   # the model computes in int32
      _check_values(name, a, _beyond_int32(a), "values must fit int32"
                    + (" (timestamps are in seconds)" if "timestamps" in name else ""))
    if name.endswith("_hashes"):
      _check_values(name, a, a < 0, "hashes must be >= 0 (0 = padding)")
    elif name.endswith("_timestamps"):
      _check_values(name, a, a < 0, "timestamps must be >= 0 seconds (0 = missing)")
    elif name.endswith("_product_surface"):
      _check_values(name, a, (a < 0) | (a >= V), f"surface ids must lie in [0, {V})")
  actions = arrays["history_actions"]
  _check_values("history_actions", actions, (actions != 0) & (actions != 1),
                "actions must be 0 or 1")
  if getattr(config, "right_anchored_rope", False):
    check_left_aligned(arrays["history_post_hashes"], "with right_anchored_rope=True ")
  if "history_dwell_times" in arrays:
    dwell = arrays["history_dwell_times"].astype(np.float64)
    _check_values("history_dwell_times", dwell, ~np.isfinite(dwell), "dwell times must be finite")
  return B, C


def _size_origins(B: int, C: int) -> tuple[str, ...]:
  """Where a shape error's B and C (0: no candidates) were read from."""
  return (f"B={B} from batch.user_hashes",) + (
      (f"C={C} from batch.candidate_post_hashes",) if C else ())


def validate_inputs(config: Union[PhoenixModelConfig, PhoenixRetrievalModelConfig],
                    batch: RecsysBatch, embeddings: RecsysEmbeddings, *,
                    with_candidates: bool = True) -> tuple[int, int]:
  """`validate_batch`, then the embeddings' shapes, dtypes and finiteness; returns (B, C)
  (C = 0 without candidates). Raises ValueError naming the field and the bad value."""
  if isinstance(batch, RecsysBatch) and not isinstance(embeddings, RecsysEmbeddings):
    raise TypeError(f"embeddings must be RecsysEmbeddings, got {type(embeddings).__name__}")
  B, C = validate_batch(config, batch, with_candidates=with_candidates)
  hc, S, D = config.hash_config, config.history_seq_len, config.emb_size
  U, I, Au = hc.num_user_hashes, hc.num_item_hashes, hc.num_author_hashes
  origins = _size_origins(B, C)
  emb_specs = [("user_embeddings", (B, U, D), "B, num_user_hashes, emb_size"),
               ("history_post_embeddings", (B, S, I, D),
                "B, history_seq_len, num_item_hashes, emb_size"),
               ("history_author_embeddings", (B, S, Au, D),
                "B, history_seq_len, num_author_hashes, emb_size")]
  if with_candidates:
    emb_specs += [("candidate_post_embeddings", (B, C, I, D), "B, C, num_item_hashes, emb_size"),
                  ("candidate_author_embeddings", (B, C, Au, D),
                   "B, C, num_author_hashes, emb_size")]
  for name, shape, dims in emb_specs:
    _field("embeddings", name, getattr(embeddings, name), shape, dims, "float", origins)
    _check_finite("embeddings", name, getattr(embeddings, name))
  return B, C


def _accepted(config, batch: RecsysBatch, embeddings: RecsysEmbeddings, *,
              with_candidates: bool = True) -> tuple[RecsysBatch, int, int]:
  """What a runner passes on: the batch without the optional fields the model does not
  read (whatever they hold is ignored, as by the release, and never reaches the compiled
  program), validated; with its (B, C)."""
  if isinstance(batch, RecsysBatch):   # otherwise validate_inputs names the type
    batch = batch.without_unread(config.optional_batch_fields)
  B, C = validate_inputs(config, batch, embeddings, with_candidates=with_candidates)
  return batch, B, C


def _without_candidates(batch: RecsysBatch, embeddings: RecsysEmbeddings
                        ) -> tuple[RecsysBatch, RecsysEmbeddings]:
  """Drops the candidate fields, so that context-only programs do not retrace per C."""
  return (batch._replace(**dict.fromkeys(CANDIDATE_BATCH_FIELDS)),
          embeddings._replace(**dict.fromkeys(CANDIDATE_EMBEDDING_FIELDS)))


_CALLER = threading.local()   # .counts: the `trace_counts` of the runner whose call runs


@functools.cache
def _shared_jit(name: str, fn: Callable, options: tuple) -> Callable:
  """The one `xla_options.filter_jit(fn)` of the process (per compile `options`, which it
  looks up itself), which every runner calls: a runner of a model that an earlier runner
  ran, or of a copy of it (reloaded weights), compiles nothing again. (A jit per runner
  compiled again for each new runner, and kept its programs until `jax.clear_caches()`:
  a runner built per request ran out of memory mappings after a few hundred.) A trace
  counts in `trace_counts[name]` of the runner whose call traced it."""
  def traced(*args):
    counts = getattr(_CALLER, "counts", None)
    if counts is not None:
      counts[name] += 1
    return fn(*args)
  return xla_options.filter_jit(traced)


def _counted_jit(counts: collections.Counter, name: str, fn: Callable) -> Callable:
  """`fn` jitted (`_shared_jit`), its traces during the calls made through this counted in
  `counts[name]`."""
  jitted = _shared_jit(name, fn, tuple(sorted(xla_options.compiler_options().items())))

  def call(*args):
    outer, _CALLER.counts = getattr(_CALLER, "counts", None), counts
    try:
      return jitted(*args)
    finally:
      _CALLER.counts = outer
  return call


def _ranking_order(probs_BCA: Array, candidate_post_hashes: Array) -> Array:
  """Slots `[B, C]` by the primary action's probability, best first, padded slots (post
  hash 0) last; ties keep slot order. `rank` and `rank_chunked` both order with this."""
  valid_BC = candidate_post_hashes[:, :, 0] != 0
  key_BC = jnp.where(valid_BC, probs_BCA[..., PRIMARY_ACTION], -1.0)
  return jnp.argsort(-key_BC, axis=-1, stable=True).astype(jnp.int32)


def chunk_size_for(num_candidates: int, chunk_size: int) -> int:
  """The chunk size `RankingRunner.score_candidates` and `rank_chunked` run for a list of
  `num_candidates`: `chunk_size`, shrunk to the smallest power of two >= the list where it
  is larger. A chunk larger than the list would score only padding past it (a chunk_size
  of 10**9 asked XLA for 256 GB); this way the padding stays under the list's length and
  at most ceil(log2(chunk_size)) + 1 chunk programs ever compile."""
  return min(chunk_size, 1 << (num_candidates - 1).bit_length())


@functools.partial(jax.jit, static_argnums=1)
def _padded_candidates(fields, pad: int):
  """Candidate fields (axis 1 is C) padded at the end with `pad` hash-0 candidates."""
  return jax.tree.map(lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)),
                      fields)


def _written(outputs: tuple[Array, Optional[Array]], scored: tuple[Array, Optional[Array]],
             start: Array) -> tuple[Array, Optional[Array]]:
  """`outputs` with one chunk's `scored` outputs written at candidate `start`."""
  write = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), start,
                                                             axis=1)
  return jax.tree.map(write, outputs, scored)


@functools.partial(jax.jit, static_argnums=2, donate_argnums=3)
def _chunk_of(fields, start: Array, size: int, outputs: tuple[Array, Optional[Array]],
              scored: tuple[Array, Optional[Array]], scored_start: Array):
  """Candidates `start:start + size` of every field, and `outputs` (donated: updated in
  place) with the previous chunk's `scored` outputs written at `scored_start`: one
  compiled program for every start."""
  return (jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis=1), fields),
          _written(outputs, scored, scored_start))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _empty_outputs(B: int, C: int, chunk_size: int, A: int, K: int
                   ) -> tuple[tuple[Array, Optional[Array]], tuple[Array, Optional[Array]]]:
  """Zeroed float32 buffers for the probabilities `[B, C, A]` and the continuous outputs
  `[B, C, K]` (None where K is 0) of C candidates, and zeros shaped as one chunk's."""
  zeros = lambda n: (jnp.zeros((B, n, A), jnp.float32),
                     jnp.zeros((B, n, K), jnp.float32) if K else None)
  return zeros(C), zeros(chunk_size)


@functools.partial(jax.jit, static_argnums=4)
def _finished_chunks(outputs: tuple[Array, Optional[Array]],
                     scored: tuple[Array, Optional[Array]], scored_start: Array,
                     candidate_post_hashes: Array, C: int) -> RankingOutput:
  """The chunks' probabilities (and continuous outputs), the last chunk's `scored` written
  at `scored_start`, trimmed to the `C` real candidates and ordered as `rank` orders
  them."""
  outputs = _written(outputs, scored, scored_start)
  probs_BCA, continuous = jax.tree.map(lambda x: x[:, :C], outputs)
  return RankingOutput(probs_BCA, _ranking_order(probs_BCA, candidate_post_hashes), continuous)


def _rank(model: PhoenixModel, batch: RecsysBatch, embeddings: RecsysEmbeddings):
  out = model(batch, embeddings)
  probs_BCA = jax.nn.sigmoid(out.logits.astype(jnp.float32))
  ranked_BC = _ranking_order(probs_BCA, batch.candidate_post_hashes)
  return RankingOutput(probs_BCA, ranked_BC, out.continuous)


def _encode_context(model: PhoenixModel, batch: RecsysBatch, embeddings: RecsysEmbeddings
                    ) -> ContextCache:
  return model.encode_context(batch, embeddings)


def _chunk_outputs(model: PhoenixModel, cache: ContextCache, batch: RecsysBatch,
                   embeddings: RecsysEmbeddings, first_index: Array
                   ) -> tuple[Array, Optional[Array]]:
  """One chunk's probabilities `[B, chunk, A]` and continuous outputs (or None)."""
  out = model.score_candidates(cache, batch, embeddings, first_index)
  return jax.nn.sigmoid(out.logits.astype(jnp.float32)), out.continuous


class RankingRunner:
  """Ranks candidates with a built `PhoenixModel`: `RankingRunner(model).rank(batch, emb)`.

  For serving, `encode_context` runs a user's context once and `score_candidates` scores
  any number of candidates against it in chunks (isolation on; equal to scoring at once).
  """

  def __init__(self, model: PhoenixModel):
    if not isinstance(model, PhoenixModel):
      raise TypeError(f"model must be a PhoenixModel, got {type(model).__name__}"
                      + _nnx_hint(model))
    _check_float32_params("RankingRunner", model)
    self.model = model
    self.trace_counts = collections.Counter()
    self._rank = _counted_jit(self.trace_counts, "rank", _rank)
    self._encode = _counted_jit(self.trace_counts, "encode_context", _encode_context)
    self._score = _counted_jit(self.trace_counts, "score_candidates", _chunk_outputs)

  @classmethod
  def from_config(cls, config: PhoenixModelConfig, *, key: PRNGKeyArray) -> "RankingRunner":
    """A runner of a freshly initialised `PhoenixModel(config, key=key)`."""
    return cls(PhoenixModel(config, key=key))

  @property
  def config(self) -> PhoenixModelConfig:
    """The model's config."""
    return self.model.config

  def rank(self, batch: RecsysBatch, embeddings: RecsysEmbeddings) -> RankingOutput:
    """Probabilities `[B, C, A]` and candidates by favorite_score, padding last."""
    batch, _, _ = _accepted(self.config, batch, embeddings)
    return self._rank(self.model, batch, embeddings)

  def encode_context(self, batch: RecsysBatch, embeddings: RecsysEmbeddings) -> ContextCache:
    """Per-layer keys/values of each user's context (candidate fields are ignored)."""
    batch, _, _ = _accepted(self.config, batch, embeddings, with_candidates=False)
    return self._encode(self.model, *_without_candidates(batch, embeddings))

  def _check_cache(self, cache: ContextCache, batch: RecsysBatch) -> None:
    """The cache's shapes and dtypes are this model's, and its padding mask is the one of
    the batch's users (a cache of other users, or of a model with another forward dtype,
    scored silently). A cache of another model with the same shapes and dtype passes."""
    hint = "encode this batch's users with this runner's encode_context"
    check_cache(self.config.model, cache, self.config.fprop_dtype,
                np.shape(batch.user_hashes)[0], self.config.candidate_start_offset,
                f"{hint} (this model's fprop_dtype is {self.config.fprop_dtype!r})")
    # The rule of `block_user_reduce` and `block_history_reduce`, on the host.
    context_mask = np.concatenate([np.asarray(batch.user_hashes)[:, :1] != 0,
                                   np.asarray(batch.history_post_hashes)[:, :, 0] != 0], axis=1)
    differs = np.asarray(cache.padding_mask) != context_mask
    if differs.any():
      b, n = (int(i) for i in np.argwhere(differs)[0])
      raise ValueError(f"cache.padding_mask[{b}, {n}] is {not context_mask[b, n]}, but the "
                       f"batch's user and history hashes make that context token "
                       f"{'valid' if context_mask[b, n] else 'padding'}: the cache was "
                       f"encoded from other users' context; {hint}")

  def _check_chunking(self, chunk_size) -> int:
    chunk_size = _count("chunk_size", chunk_size, 1)
    if not self.config.candidate_isolation:
      raise ValueError("candidate_isolation=False: a candidate's score depends on the "
                       "candidates before it, so it cannot be scored in chunks; use rank")
    return chunk_size

  def score_candidates(self, cache: ContextCache, batch: RecsysBatch,
                       embeddings: RecsysEmbeddings, chunk_size: int) -> RankingOutput:
    """Scores all of the batch's candidates against `cache` in chunks of `chunk_size`.

    The last chunk is padded with hash-0 candidates; one compiled program serves every
    chunk (its start index is traced), so any candidate count reuses it. A `chunk_size`
    above the smallest power of two >= C shrinks to it (`chunk_size_for`). A new
    C still compiles the small programs that check, pad, slice and join the candidates.
    """
    chunk_size = self._check_chunking(chunk_size)
    batch, _, _ = _accepted(self.config, batch, embeddings)
    self._check_cache(cache, batch)
    return self._score_in_chunks(cache, batch, embeddings, chunk_size)

  def rank_chunked(self, batch: RecsysBatch, embeddings: RecsysEmbeddings,
                   chunk_size: int) -> RankingOutput:
    """`encode_context` then `score_candidates`: equal to `rank`, in bounded memory.

    Chunks always run the isolation-aware attention. Probabilities agree with `rank`'s,
    and with `rank` of a model with `attention_impl="dense"`, up to float rounding, which
    also moves a little with the chunk size (products of other row counts round
    differently): under 1e-6 in float32 and about 2e-2 in bfloat16 in an audit's grid of
    head splits, chunk sizes, paddings and position schemes (the isolated and dense paths
    up to about 4e-2 in bfloat16 where attention logits are large, near 250 before the
    cap, and in some small models: docs/models.md).

    The scoring program is compiled once per chunk size; each new list length compiles up
    to four small programs that pad, slice and write (3.6 and about 5 MB of host memory a
    length on CPU, in an audit's run over 80 lengths), kept for the process's life: a
    long-lived server that sees many list lengths should pad its lists to a few.
    """
    chunk_size = self._check_chunking(chunk_size)
    batch, _, _ = _accepted(self.config, batch, embeddings)
    cache = self._encode(self.model, *_without_candidates(batch, embeddings))
    return self._score_in_chunks(cache, batch, embeddings, chunk_size)

  def _score_in_chunks(self, cache: ContextCache, batch: RecsysBatch,
                       embeddings: RecsysEmbeddings, chunk_size: int) -> RankingOutput:
    # Everything stays on the device: the candidates are padded once, each chunk is a
    # traced-offset slice of them, and the chunks' scores are written into buffers of the
    # whole list (donated, so updated in place; a join of the chunks' arrays compiled a
    # program per chunk count, 195 s for 10,000 chunks), then trimmed and ordered there.
    # The program that slices chunk k also writes chunk k - 1's scores (the first writes
    # zeros that chunk 0's overwrite), so a chunk costs the host two dispatches. One scoring
    # program serves every chunk of a size, whatever the list's length; the slicing and
    # writing programs are compiled per length. The host only dispatches; its one transfer
    # per chunk is the chunk's offset, made explicit.
    # (Each scoring call, an `eqx.filter_jit`, returns once its chunk is scored:
    # docs/performance.md, "Chunked serving".)
    C = np.shape(batch.candidate_post_hashes)[1]
    chunk_size = chunk_size_for(C, chunk_size)
    pad = -C % chunk_size
    candidates = ({f: getattr(batch, f) for f in CANDIDATE_BATCH_FIELDS
                   if getattr(batch, f) is not None},
                  {f: getattr(embeddings, f) for f in CANDIDATE_EMBEDDING_FIELDS})
    candidates = _padded_candidates(candidates, pad)
    # Host (NumPy) context fields and cache (a stored one, say) go to the device once,
    # explicitly, not with every chunk; device ones stay as they are.
    context_batch, context_emb, cache = jax.device_put(
        (*_without_candidates(batch, embeddings), cache))
    c = self.config
    outputs, scored = _empty_outputs(np.shape(batch.candidate_post_hashes)[0], C + pad,
                                     chunk_size, c.num_actions, c.num_continuous_actions)
    scored_start = jax.device_put(np.int32(0))
    for start in range(0, C + pad, chunk_size):
      start = jax.device_put(np.int32(start))
      (cand_batch, cand_emb), outputs = _chunk_of(candidates, start, chunk_size, outputs,
                                                  scored, scored_start)
      scored = self._score(self.model, cache, context_batch._replace(**cand_batch),
                           context_emb._replace(**cand_emb), start)
      scored_start = start
    return _finished_chunks(outputs, scored, scored_start, batch.candidate_post_hashes, C)


class RetrievalResult(NamedTuple):
  """The model's `RetrievalOutput` plus the post ids of the retrieved corpus rows."""

  user_representation: Array  # [B, D], unit norm (zero for a padding row: types.py)
  top_k_indices: Array        # [B, K] int32 rows of the corpus
  top_k_scores: Array         # [B, K] sorted descending
  top_k_post_ids: Array       # [B, K] post ids of those rows


def _encode_user(model: PhoenixRetrievalModel, batch: RecsysBatch,
                 embeddings: RecsysEmbeddings) -> Array:
  return model.build_user_representation(batch, embeddings)[0]


def _encode_corpus(tower, post_NID: Array, author_NAD: Array) -> Array:
  """The candidate tower over corpus items' post and author hash embeddings."""
  return tower(jnp.concatenate([post_NID, author_NAD], axis=1)[None])[0]


def _retrieve(model: PhoenixRetrievalModel, user_BD: Array, corpus_ND: Array,
              post_ids_N: Array, top_k: int, corpus_mask: Optional[Array]):
  """The top k of users already encoded: a program apart from the user tower's, so a new
  `top_k`, corpus size or mask form compiles this small one only."""
  out = model.retrieve(user_BD, corpus_ND, top_k, corpus_mask)
  return RetrievalResult(out.user_representation, out.top_k_indices, out.top_k_scores,
                         post_ids_N[out.top_k_indices])


class RetrievalRunner:
  """Two-tower retrieval with a built model: `encode_corpus` (the candidate tower over
  the corpus items' hash embeddings), `set_corpus`, then `retrieve`.

  The release's runner builds its parameters in an `initialize()` step; here the model
  exists before the runner: pass a built (or imported, `haiku_compat`) model, or use
  `RetrievalRunner.from_config(config, key=...)` for a freshly initialised one."""

  def __init__(self, model: PhoenixRetrievalModel):
    if not isinstance(model, PhoenixRetrievalModel):
      raise TypeError(f"model must be a PhoenixRetrievalModel, got {type(model).__name__}"
                      + _nnx_hint(model))
    _check_float32_params("RetrievalRunner", model)
    self.model = model
    self.corpus_embeddings: Optional[Array] = None
    self.corpus_post_ids: Optional[Array] = None
    self.trace_counts = collections.Counter()
    self._encode = _counted_jit(self.trace_counts, "encode_user", _encode_user)
    self._retrieve = _counted_jit(self.trace_counts, "retrieve", _retrieve)
    self._tower = _counted_jit(self.trace_counts, "encode_corpus", _encode_corpus)

  @classmethod
  def from_config(cls, config: PhoenixRetrievalModelConfig, *, key: PRNGKeyArray
                  ) -> "RetrievalRunner":
    """A runner of a freshly initialised `PhoenixRetrievalModel(config, key=key)`."""
    return cls(PhoenixRetrievalModel(config, key=key))

  @property
  def config(self) -> PhoenixRetrievalModelConfig:
    """The model's config."""
    return self.model.config

  def encode_user(self, batch: RecsysBatch, embeddings: RecsysEmbeddings) -> Array:
    """Unit-norm user representations `[B, D]` (zero for a row with no valid token)."""
    batch, _, _ = _accepted(self.config, batch, embeddings, with_candidates=False)
    return self._encode(self.model, *_without_candidates(batch, embeddings))

  def encode_corpus(self, post_embeddings: ArrayLike, author_embeddings: ArrayLike) -> Array:
    """Unit-norm corpus vectors `[N, D]` from the candidate tower, for `set_corpus`.

    `post_embeddings [N, I, D]` and `author_embeddings [N, Au, D]` are each corpus item's
    hash embeddings (the same lookup as a candidate's). One compiled program per N.
    """
    hc, D = self.config.hash_config, self.config.emb_size
    post, author = _host_or_device(post_embeddings), _host_or_device(author_embeddings)
    N = post.shape[0] if post.ndim else 0
    for name, x, h in (("post_embeddings", post, hc.num_item_hashes),
                       ("author_embeddings", author, hc.num_author_hashes)):
      if x.shape != (N, h, D) or N < 1:
        raise ValueError(f"{name} has shape {x.shape}, expected [N >= 1, {h}, {D}] "
                         f"(N = {N} corpus items from post_embeddings)")
      if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} has dtype {x.dtype}, expected floats")
      _check_finite("corpus", name, x)
    # (jax.device_put copies host arrays; jnp.asarray of a NumPy array compiles a program
    # per shape on jax 0.10. Device ones stay as they are.)
    return self._tower(self.model.candidate_tower, *jax.device_put((post, author)))

  def set_corpus(self, embeddings: ArrayLike, post_ids: ArrayLike) -> None:
    """Stores the corpus: item vectors `[N, D]` and their post ids `[N]`, distinct. Arrays
    already on the device are checked there and kept, not copied (only the ids' check reads
    them on the host); host arrays are copied to the device once."""
    D = self.config.emb_size
    emb = _host_or_device(embeddings)   # a device corpus is checked and kept where it is
    if emb.ndim != 2 or emb.shape[1] != D or emb.shape[0] < 1:
      raise ValueError(f"corpus embeddings has shape {emb.shape}, expected [N >= 1, {D}]")
    if not jnp.issubdtype(emb.dtype, jnp.floating):
      raise ValueError(f"corpus embeddings has dtype {emb.dtype}, expected floats")
    _check_finite("corpus", "embeddings", emb)
    ids = np.asarray(post_ids)
    if ids.shape != (emb.shape[0],):
      raise ValueError(f"corpus post_ids has shape {ids.shape}, expected ({emb.shape[0]},) "
                       "to match the corpus embeddings")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"corpus post_ids has dtype {ids.dtype}, expected integers")
    _check_values("post_ids", ids, _beyond_int32(ids), "post ids must fit int32", "corpus")
    # A post twice in the corpus would be retrieved twice, taking two of the top k.
    order = np.argsort(ids, kind="stable")
    repeated = np.zeros(ids.shape, bool)
    repeated[order[1:]] = ids[order[1:]] == ids[order[:-1]]
    _check_values("post_ids", ids, repeated, "post ids must be distinct (it appears earlier "
                  "too)", "corpus")
    self.corpus_embeddings = (emb.astype(jnp.float32) if isinstance(emb, jax.Array)
                              else jax.device_put(emb.astype(np.float32)))
    self.corpus_post_ids = (post_ids if isinstance(post_ids, jax.Array)   # checked on a copy
                            else jax.device_put(ids))

  def retrieve(self, batch: RecsysBatch, embeddings: RecsysEmbeddings, top_k: int,
               corpus_mask: Optional[ArrayLike] = None) -> RetrievalResult:
    """Top-k corpus items per user by dot product. `corpus_mask` False excludes an item,
    `[N]` for every user or `[B, N]` per user (the posts each has seen, say): `top_k` may
    not exceed the items it keeps for any user (the model itself would fill the rest with
    masked items at score -1e12, as the release does). A mask already on the device (a
    `jax.Array`) is checked there and used as it is: only its per-user counts are read
    back, where a host copy of a `[B, N]` mask would cross to the host and back each call."""
    if self.corpus_embeddings is None:
      raise ValueError("corpus is not set: call set_corpus(embeddings, post_ids) first")
    N = self.corpus_embeddings.shape[0]
    top_k = _count("top_k", top_k, 1, N, " (corpus size)")
    batch, _, _ = _accepted(self.config, batch, embeddings, with_candidates=False)
    if corpus_mask is not None:
      # A device mask ([B, N] can be large) is checked where it lives and stays there;
      # only its per-user counts come to the host.
      on_device = isinstance(corpus_mask, jax.Array)
      mask = corpus_mask if on_device else np.asarray(corpus_mask)
      B = np.shape(batch.user_hashes)[0]
      if mask.shape not in ((N,), (B, N)):
        raise ValueError(f"corpus_mask has shape {mask.shape}, expected ({N},) or ({B}, {N}): "
                         "the corpus items, for every user or per user")
      if on_device:
        binary, kept_B = jax.device_get(_mask_summary(mask))
      else:
        binary = mask.dtype == bool or np.isin(mask, (0, 1)).all()
        kept_B = np.count_nonzero(np.atleast_2d(mask), axis=-1)
      if not binary:
        raise ValueError("corpus_mask must be boolean or 0/1")
      if top_k > kept_B.min():
        who = "" if mask.ndim == 1 else f" for user {int(np.argmin(kept_B))}"
        raise ValueError(f"top_k={top_k} exceeds the {int(kept_B.min())} corpus items "
                         f"corpus_mask keeps{who}")
      corpus_mask = (jnp.asarray(mask, bool) if on_device   # (as it is, if bool already)
                     else jax.device_put(mask.astype(bool)))
    user_BD = self._encode(self.model, *_without_candidates(batch, embeddings))
    return self._retrieve(self.model, user_BD, self.corpus_embeddings, self.corpus_post_ids,
                          top_k, corpus_mask)
