"""Post-training measurements of a trained ranking system on its synthetic world.

What the training run's own evaluation (which already covers extra evaluation splits and
score consistency) does not measure: lists scored in chunks as a server would, how much
a candidate's score moves with its slot in the list, and scoring throughput. Functions
take a `RankingSystem` (hash tables + `PhoenixModel`) and synthetic batches.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

from experiments import timing
from phoenix_flax import xla_options
from phoenix_flax.synthetic import SplitConfig, SyntheticBatch, World, sample_batch
from phoenix_flax.training import metrics as metrics_lib
from phoenix_flax.training.loop import eval_keys
from phoenix_flax.types import CANDIDATE_BATCH_FIELDS, RecsysBatch

SHIFT_METRICS = ("auc_mean", "calibration_error", "logloss", "bayes_auc_mean")


@functools.partial(jax.jit, static_argnums=(1, 2))
def sample(world: World, split: SplitConfig, batch_size: int, key) -> SyntheticBatch:
  """One batch of a split (jitted `sample_batch`)."""
  return sample_batch(world, split, batch_size, key)


def _float32_logits(system, batch: RecsysBatch) -> jax.Array:
  return system(batch).astype(jnp.float32)


@eqx.filter_jit
def logits(system, batch: RecsysBatch) -> jax.Array:
  """Float32 logits `[B, C, A]` of a ranking system on one batch."""
  return _float32_logits(system, batch)


@functools.cache
def _timed_logits():
  """`logits` compiled with the package's compile options (built on first use, not at
  import: looking the options up compiles a probe program)."""
  return xla_options.filter_jit(_float32_logits)


def candidate_slice(batch: RecsysBatch, start: int, stop: int) -> RecsysBatch:
  """The batch with only candidates `start:stop` (context fields unchanged)."""
  return batch._replace(**{f: getattr(batch, f)[:, start:stop] for f in CANDIDATE_BATCH_FIELDS
                           if getattr(batch, f) is not None})


@eqx.filter_jit
def _encode(system, batch: RecsysBatch):
  return system.model.encode_context(batch, system.tables(batch))


@eqx.filter_jit
def _score_chunk(system, cache, batch: RecsysBatch, first_index: jax.Array):
  out = system.model.score_candidates(cache, batch, system.tables(batch), first_index)
  return out.logits.astype(jnp.float32)


def chunked_logits(system, batch: RecsysBatch, chunk_size: int) -> jax.Array:
  """Logits when a list is scored `chunk_size` candidates at a time.

  With candidate isolation this is what serving does: encode the user context once, score
  each chunk against it with the chunk's true slot indices (equal to scoring at once).
  Without isolation a chunk can only be sent as a list of its own, so each candidate sees
  the earlier candidates of its chunk at the chunk's own slot indices.
  """
  C = batch.candidate_post_hashes.shape[1]
  starts = range(0, C, chunk_size)
  if system.model.config.candidate_isolation:
    cache = _encode(system, batch)
    parts = [_score_chunk(system, cache, candidate_slice(batch, s, s + chunk_size),
                          jnp.int32(s))
             for s in starts]
  else:
    parts = [logits(system, candidate_slice(batch, s, s + chunk_size)) for s in starts]
  return jnp.concatenate(parts, axis=1)


def eval_batches(spec, world: World, split: SplitConfig) -> list[SyntheticBatch]:
  """The runner's evaluation batches of a split: `train.eval_batches` batches of
  `train.eval_batch_size` lists, from the runner's own keys (`loop.eval_keys`)."""
  return [sample(world, split, spec.config.train.eval_batch_size, key)
          for key in eval_keys(spec.config)]


@jax.jit
def _metrics(logits_NCA, labels_NCA, probs_NCA, mask_NC) -> dict:
  found = metrics_lib.ranking_metrics(logits_NCA, labels_NCA, probs_NCA, mask_NC)
  return {m: found[m] for m in SHIFT_METRICS}


def pooled_shift_metrics(logits_list, batches: Sequence[SyntheticBatch]) -> dict[str, float]:
  """`SHIFT_METRICS` of logits over several batches, pooled."""
  cat = lambda xs: jnp.concatenate(list(xs), axis=0)
  found = _metrics(cat(logits_list), cat(b.labels for b in batches),
                   cat(b.probs for b in batches), cat(b.candidate_mask for b in batches))
  return {m: float(v) for m, v in found.items()}


def chunked_scoring(system, batches: Sequence[SyntheticBatch], chunk_size: int
                    ) -> dict[str, float]:
  """Metrics when every list is scored `chunk_size` candidates at a time, and
  `max_logit_change`, the largest |logit| difference to scoring whole lists."""
  whole = [logits(system, b.batch) for b in batches]
  chunked = [chunked_logits(system, b.batch, chunk_size) for b in batches]
  out = pooled_shift_metrics(chunked, batches)
  out["max_logit_change"] = max(max_abs_logit_diff(w, c, b.candidate_mask)
                                for w, c, b in zip(whole, chunked, batches))
  return out


def slot_sensitivity(system, batch: RecsysBatch, mask_BC: jax.Array) -> float:
  """Std of a candidate's logit across the slots it can occupy (the list rotated through
  every position), mean over valid candidates and actions; exactly 0 when slots do not
  matter (the std is taken of each logit's change from slot 0, which is exactly 0 for
  equal logits; the std of the logits themselves can round to ~1e-7 there)."""
  C = mask_BC.shape[1]
  per_shift = []
  for r in range(C):
    rolled = batch._replace(**{f: jnp.roll(getattr(batch, f), r, axis=1)
                               for f in CANDIDATE_BATCH_FIELDS if getattr(batch, f) is not None})
    per_shift.append(jnp.roll(logits(system, rolled), -r, axis=1))
  logits_RBCA = jnp.stack(per_shift)
  std_BCA = jnp.std(logits_RBCA - logits_RBCA[:1], axis=0)
  std_BC = jnp.mean(std_BCA, axis=-1)
  return float(metrics_lib.per_count(jnp.sum(jnp.where(mask_BC, std_BC, 0.0)), jnp.sum(mask_BC)))


@jax.jit
def _max_abs_diff(a, b, mask_BC):
  return jnp.max(jnp.where(mask_BC[..., None], jnp.abs(a - b), 0.0))


def max_abs_logit_diff(a: jax.Array, b: jax.Array, mask_BC: jax.Array) -> float:
  """Largest |a - b| over valid candidates and actions."""
  return float(_max_abs_diff(a, b, mask_BC))


def count_params(tree) -> int:
  """Number of scalars in the arrays of a pytree (an Equinox module)."""
  return int(sum(x.size for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))))


def scoring_throughput(systems: Mapping[str, Any], batch: RecsysBatch,
                       min_seconds: float = 0.5, rounds: int = 10) -> dict[str, float]:
  """Candidates per second of each system's jitted forward on `batch`, timed together.

  `experiments.timing.time_rounds` interleaves the systems round by round (each round
  runs every system's forward twice in a row and times the second run), so host load
  and process state hit them alike and their ratios stay comparable where separately
  timed figures move by up to 2x from one process to the next. Each system's figure is
  its median over at least `rounds` rounds, and more (up to 1,000) until the timed calls
  of all systems add up to `min_seconds` times their number (a fast system's share of
  that time is small); compiled first, with the package's `xla_options` as the
  training, evaluation and serving programs are."""
  calls = {name: functools.partial(_timed_logits(), system, batch)
           for name, system in systems.items()}
  seconds = timing.time_rounds(calls, iters=rounds, warmup=1,
                               min_seconds=min_seconds * len(calls))
  B, C = batch.candidate_post_hashes.shape[:2]
  return {name: B * C / t for name, t in seconds.items()}
