"""The on-device training loop: scanned steps, vmapped seeds, divergence guard, evaluation.

A `TrainState` holds only arrays (parameters, optimizer state, step, the seed's data key,
divergence flags), stacked over seeds. `Trainer.train_chunk` runs `steps_per_call` steps
of every seed in one jitted call: batches are sampled from the synthetic world inside the
scanned step, nothing returns to the host until the chunk ends, and the state's buffers
are donated. A step whose loss or gradient norm is not finite marks its seed diverged
(with the step) and freezes that seed's parameters; other seeds train on. Several seeds
train vmapped; they are initialised and evaluated one after another in one program, so
that a seed's initial parameters, and its metrics for given parameters, equal those it
would get alone (its training steps, vmapped, round differently from one seed's program:
docs/training.md, "A seed alone and a seed among others").
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jaxtyping import Array, PyTree

from phoenix_flax import xla_options
from phoenix_flax.ranking import Diagnostics
from phoenix_flax.synthetic import (SplitConfig, World, make_world, post_features,
                                    sample_batch, true_logits)
from phoenix_flax.training import metrics
from phoenix_flax.training.loss import (first_positive_rows, is_positive, ranking_loss,
                                        update_sampling_counts)
from phoenix_flax.training.schema import ExperimentSpec, check_optim
from phoenix_flax.training.sharding import TABLE_FIELDS, Placement, check_tables
from phoenix_flax.training.system import RankingSystem, RetrievalSystem
from phoenix_flax.types import CANDIDATE_BATCH_FIELDS, RecsysBatch, RecsysModelOutput

System = Union[RankingSystem, RetrievalSystem]


class TrainState(eqx.Module):
  """Everything that evolves during training (arrays only; stacked over seeds)."""

  params: PyTree
  opt_state: PyTree
  step: Array            # int32, steps run so far (a diverged seed's count, unapplied)
  data_key: Array        # uint32[2], this seed's training-batch key
  diverged: Array        # bool
  diverged_step: Array   # int32, 1-based step of the first non-finite loss or gradient
                         # norm, -1 if none
  # float32[num_item_hashes, post_buckets]: retrieval's decayed count sketch of positives
  # (`loss.update_sampling_counts`) with retrieval.logq_correction, None otherwise.
  sampling_counts: Optional[Array] = None


def make_system(spec: ExperimentSpec, key) -> System:
  """A freshly initialised system for the spec's task."""
  w, scale = spec.world, spec.config.model.embedding_init_scale
  cls = RankingSystem if spec.task == "ranking" else RetrievalSystem
  return cls(spec.model, w.user_buckets, w.post_buckets, w.author_buckets, key=key,
             init_scale=scale)


def _decay_mask(params: PyTree) -> PyTree:
  """Weight decay on every array of two or more dimensions (the stacked transformer's
  leading layer axis not counted) but norm scales and the hash tables."""
  def decays(path, x):
    names = [getattr(k, "name", None) for k in path]
    stacked = "transformer" in names
    return (x.ndim - stacked >= 2 and names[-1] != "scale"
            and not any(n in TABLE_FIELDS for n in names))
  return jax.tree_util.tree_map_with_path(decays, params)


def make_schedule(spec: ExperimentSpec) -> optax.Schedule:
  """Linear warmup from 0 to the peak, cosine decay to `end_lr_fraction` of it."""
  return schedule_from(spec.config.optim, spec.config.train.num_steps)


def schedule_from(optim: ml_collections.ConfigDict, num_steps: int) -> optax.Schedule:
  """`make_schedule` from an `optim` section and a step count."""
  o = optim
  return _in_standard_promotion(optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.learning_rate, warmup_steps=o.warmup_steps,
      decay_steps=num_steps, end_value=o.learning_rate * o.end_lr_fraction))


def make_optimizer(spec: ExperimentSpec) -> optax.GradientTransformation:
  """Global-norm clipping (optional) then AdamW on the schedule, with weight decay on
  every array of two or more dimensions (per layer, for the stacked transformer) that is
  not named `scale` and not a hash table: the transformer's matrices, the input
  projections, the action projection, the unembedding, the product-surface table. Norm
  scales and the hash tables are not decayed (`_decay_mask`)."""
  return optimizer_from(spec.config.optim, spec.config.train.num_steps)


def optimizer_from(optim: ml_collections.ConfigDict, num_steps: int
                   ) -> optax.GradientTransformation:
  """`make_optimizer` for a training loop of your own: from an `optim` section
  (`base_config(task).optim`, edited; checked as `parse_config` checks it) and the
  number of steps the schedule spans. Apply it to a system's floating-point leaves
  (`eqx.filter(system, eqx.is_inexact_array)`)."""
  check_optim(optim, num_steps)
  o = optim
  adamw = optax.adamw(schedule_from(o, num_steps), b1=o.b1, b2=o.b2, eps=o.eps,
                      weight_decay=o.weight_decay, mask=_decay_mask)
  if o.grad_clip_norm is not None:
    adamw = optax.chain(optax.clip_by_global_norm(o.grad_clip_norm), adamw)
  adamw = optax.with_extra_args_support(adamw)
  return optax.GradientTransformationExtraArgs(_in_standard_promotion(adamw.init),
                                               _in_standard_promotion(adamw.update))


def _in_standard_promotion(fn: Callable) -> Callable:
  """`fn` traced under JAX's standard dtype promotion whatever the caller's
  `jax_numpy_dtype_promotion` says: optax mixes Python floats with int32 step counts
  (AdamW's bias correction `b1 ** count`, the schedule's arithmetic on the step), which
  `"strict"` refuses. Under the default setting it changes nothing."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.numpy_dtype_promotion("standard"):
      return fn(*args, **kwargs)
  return wrapped


def _where_tree(pred: Array, new: PyTree, old: PyTree) -> PyTree:
  return jax.tree.map(lambda n, o: jnp.where(pred, n, o), new, old)


def mix_companions(batch: RecsysBatch, keep_C: Array) -> RecsysBatch:
  """Candidate slots with `keep_C` keep their candidate; the others take the candidate of
  the same slot in the previous user's list (the batch rolled by one: user 0 takes the last
  user's)."""
  fields = {}
  for name in CANDIDATE_BATCH_FIELDS:
    own = getattr(batch, name)
    if own is None:
      continue
    keep = keep_C.reshape((1, -1) + (1,) * (own.ndim - 2))
    fields[name] = jnp.where(keep, own, jnp.roll(own, 1, axis=0))
  return batch._replace(**fields)


def forward_with_new_companions(system: RankingSystem, batch: RecsysBatch, mask_BC: Array
                                ) -> tuple[RecsysModelOutput, Diagnostics, Array, Array]:
  """The batch's output and diagnostics, plus the sum and count of |logit change| (over
  valid candidates and every action) when about half of each candidate's list companions
  are replaced (the score-consistency figure).

  Even slots keep their candidates while odd slots take another user's, then the reverse,
  so every candidate is re-scored in its own slot with the companions of the other
  parity replaced and those of its own kept. The three
  forwards run as one `lax.map` (one compiled body, the same arithmetic for every
  variant), so with candidate isolation the change is exactly 0.
  """
  C = mask_BC.shape[1]
  even_C = jnp.arange(C) % 2 == 0
  variants = jax.tree.map(lambda *xs: jnp.stack(xs),
                          batch, mix_companions(batch, even_C), mix_companions(batch, ~even_C))
  outs, diags = jax.lax.map(system.forward, variants)
  logits_VBCA = outs.logits.astype(jnp.float32)
  moved_BCA = jnp.where(even_C[None, :, None], logits_VBCA[1], logits_VBCA[2]) - logits_VBCA[0]
  m_BCA = jnp.broadcast_to(mask_BC[..., None], moved_BCA.shape)
  first = lambda tree: jax.tree.map(lambda x: x[0], tree)
  return (first(outs), first(diags), jnp.sum(jnp.where(m_BCA, jnp.abs(moved_BCA), 0.0)),
          jnp.sum(m_BCA))


def _over_corpus_logits(world: World, interest_BL: Array, bias_B: Array, action: int,
                        budget: int, fn: Callable, *per_user: Array) -> Any:
  """`fn(logits_cN, *per_user_c)` over chunks of users, where `logits_cN` are the true
  logits of `action` for the whole corpus (surface 0, age 0), chunks holding at most
  ~`budget` intermediate elements; outputs joined back to `[B, ...]`."""
  B, L = interest_BL.shape
  N, A = world.cfg.num_posts, world.cfg.num_actions
  chunk = max(1, min(B, budget // (N * (L + A))))
  while B % chunk:
    chunk -= 1
  ids_1N = jnp.arange(N)[None, :]
  zeros_1N = jnp.zeros((1, N), jnp.int32)

  def one(args):
    interest_cL, bias_c, *rest = args
    logits = true_logits(world, interest_cL[:, None, :], ids_1N, zeros_1N, zeros_1N,
                         bias_c[:, None])[..., action]
    return fn(logits, *rest)

  split = lambda x: x.reshape((B // chunk, chunk) + x.shape[1:])
  out = jax.lax.map(one, tuple(split(x) for x in (interest_BL, bias_B) + per_user))
  return jax.tree.map(lambda x: x.reshape((B,) + x.shape[2:]), out)


def bayes_corpus_hits(world: World, interest_BL: Array, bias_B: Array, action: int,
                      ids_BC: Array, positive_BC: Array, ks: Sequence[int],
                      budget: int = 1 << 24) -> tuple[Array, Array]:
  """`metrics.corpus_hits` of the oracle that scores the whole corpus by the true logit of
  `action` (surface 0, age 0), in user chunks of at most ~`budget` elements: the counts
  of `bayes_recall@K`.

  That recall is an oracle reference, not a ceiling: it knows the link but not how
  candidate lists are drawn, and recall counts positives among the drawn candidates. A
  model trained with the in-batch loss also learns which posts tend to be drawn for a
  user and can score above it (docs/training.md, "The retrieval task").
  """
  hits = lambda logits, ids, positive: metrics.corpus_hits(logits, ids, positive, ks)
  return _over_corpus_logits(world, interest_BL, bias_B, action, budget, hits, ids_BC,
                             positive_BC)


def popularity_scores(world: World, split: SplitConfig, batch_size: int, action: int,
                      keys: Array) -> Array:
  """How many positives of `action` each post has `[N]` in batches of `split` drawn from
  `keys` `[M, 2]`: the scores of a list that is the same for every user (the most engaged
  posts first), the reference behind `popularity_recall@K`."""
  N = world.cfg.num_posts

  def positives(key):
    sb = sample_batch(world, split, batch_size, key)
    positive_BC = is_positive(sb.labels[..., action]) & sb.candidate_mask
    return jnp.where(positive_BC, sb.candidate_post_ids, N)   # N: not a positive

  # Counted by sorting, not by a scatter-add, which on GPU adds in a varying order (see
  # `test_evaluation_programs_sum_nothing_by_scatter`).
  ids = jnp.sort(jax.lax.map(positives, keys).reshape(-1))
  posts = jnp.arange(N, dtype=ids.dtype)
  return (jnp.searchsorted(ids, posts, side="right")
          - jnp.searchsorted(ids, posts, side="left")).astype(jnp.float32)


def popularity_keys(config) -> Array:
  """The keys `[train.eval_batches, 2]` of the training-split batches that
  `popularity_scores` counts: as many lists as an evaluation has, drawn from `eval_seed`
  apart from the evaluation's own (`eval_keys`), the same for every run of a config."""
  return _folded_keys(jax.random.fold_in(jax.random.PRNGKey(config.eval_seed), 0x7FFFFFFF),
                      config.train.eval_batches)


def _diagnostics(max_logit_XL: Array, rms_XL: Array) -> dict[str, Array]:
  """Evaluation diagnostics from per-batch, per-layer values: the max |attention logit|
  over every batch, per layer and over the layers (as training logs it), and each
  layer's mean residual RMS."""
  max_L = jnp.max(max_logit_XL, axis=0)
  out = {"max_attn_logit": jnp.max(max_L)}
  rms_L = jnp.mean(rms_XL, axis=0)
  for i in range(rms_L.shape[0]):
    out[f"max_attn_logit/layer_{i}"] = max_L[i]
    out[f"residual_rms/layer_{i}"] = rms_L[i]
  return out


def _over_seeds(fn, shared_first: bool = True, in_turn: bool = False):
  """`fn` of one seed, mapped over the leading seed axis of its last argument (the first
  argument is shared when `shared_first`).

  Several seeds are vmapped, or with `in_turn` run one after another in one program
  (`lax.map`). A single seed runs `fn` itself on the squeezed arrays, because a vmapped
  axis of size 1 still changes XLA's layouts and fusions, which made the cpu-preset
  training step slower on CPU (docs/performance.md, "Training throughput").

  `in_turn` compiles one copy of `fn` (a vmapped `fn` is a larger program: the
  initialisation of three seeds took about twice as long to compile vmapped), and each
  seed's result equals the one `fn` gives that seed alone, bit for bit, which a vmapped
  evaluation's does not. Training keeps `vmap`: it is what makes several seeds cost less
  than running them one by one.
  """
  vmapped = eqx.filter_vmap(fn, in_axes=(None, 0) if shared_first else 0)

  def mapped(*args):
    if jax.tree.leaves(args[-1])[0].shape[0] == 1:
      squeezed = jax.tree.map(lambda x: x[0], args[-1])
      return jax.tree.map(lambda x: x[None], fn(*args[:-1], squeezed))
    if in_turn:
      return jax.lax.map(lambda one: fn(*args[:-1], one), args[-1])
    return vmapped(*args)

  return mapped


def eval_keys(config) -> Array:
  """The keys `[train.eval_batches, 2]` of every evaluation's batches (folded from
  `eval_seed`): each split samples batch i from key i, so every run of a config, and every
  probe of it, sees the same evaluation lists."""
  return _folded_keys(jax.random.PRNGKey(config.eval_seed), config.train.eval_batches)


def _folded_keys(base: Array, n: int) -> Array:
  """`fold_in(base, i)` for i in 0..n-1, stacked `[n, 2]`."""
  return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(n))


class Trainer:
  """Builds the world, optimizer and jitted functions of one experiment spec."""

  def __init__(self, spec: ExperimentSpec, placement: Placement = Placement(),
               world: Optional[World] = None):
    """`world`: the spec's world when it is at hand (an abstract one, of
    `jax.ShapeDtypeStruct`s, serves to trace); built from `world_seed` otherwise.
    Raises `ConfigError` for a placement that cannot shard the spec's hash tables
    (`check_tables`)."""
    check_tables(spec, placement)
    self.spec = spec
    self.placement = placement
    c = spec.config
    if world is None:
      world = eqx.filter_jit(make_world)(spec.world, jax.random.PRNGKey(c.world_seed))
    self.world: World = placement.replicate(world)
    self.optimizer = make_optimizer(spec)
    self.schedule = make_schedule(spec)
    is_leaf = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    abstract = eqx.filter_eval_shape(make_system, spec, jax.random.PRNGKey(0))
    self.static = eqx.partition(abstract, is_leaf, is_leaf=is_leaf)[1]
    init_seeds = _over_seeds(self._init_one, shared_first=False, in_turn=True)
    self._init = xla_options.filter_jit(
        lambda keys: self.placement.constrain_state(init_seeds(keys), seed_axis=True))
    self._chunk = xla_options.filter_jit(_over_seeds(self._chunk_one),
                                         donate="all-except-first")
    # What depends on the world alone (the evaluation's references) is computed once per
    # trainer, not per seed or per evaluation; `_eval` takes it as an argument.
    self._references = xla_options.filter_jit(self._world_references)
    self._cached_references: Optional[dict] = None
    eval_seeds = _over_seeds(self._eval_one, in_turn=True)
    self._eval = xla_options.filter_jit(
        lambda world, references, params: eval_seeds((world, references), params))

  # -- state -------------------------------------------------------------------------

  def system(self, params: PyTree) -> System:
    """The spec's system with `params` as its arrays (`TrainState.params`: one seed's
    for a system of one model, stacked over seeds for a stack of them)."""
    return eqx.combine(params, self.static)

  def _init_one(self, seed_key: Array) -> TrainState:
    init_key, data_key = jax.random.split(seed_key)
    params = eqx.filter(make_system(self.spec, init_key), eqx.is_array)
    K = self.spec.world.num_item_hashes
    counts = (jnp.zeros((K, self.spec.world.post_buckets), jnp.float32)
              if self._logq_correction else None)
    return TrainState(params=params, opt_state=self.optimizer.init(params),
                      step=jnp.zeros((), jnp.int32), data_key=data_key,
                      diverged=jnp.zeros((), bool), diverged_step=jnp.full((), -1, jnp.int32),
                      sampling_counts=counts)

  def init(self, seeds: Sequence[int]) -> TrainState:
    """Fresh states of `seeds`, stacked on a leading axis and placed on the mesh (built
    there: a sharded table's rows are made on the device that holds them)."""
    keys = jnp.stack([jax.random.PRNGKey(s) for s in seeds])
    return self.placement.place_state(self._init(keys))

  # -- training ------------------------------------------------------------------------

  @property
  def _logq_correction(self) -> bool:
    return self.spec.task == "retrieval" and self.spec.config.retrieval.logq_correction

  def _sampling_counts(self, state: TrainState, sb) -> Optional[Array]:
    """The state's positive counts with this batch's positives added (logQ correction),
    or None."""
    if state.sampling_counts is None:
      return None
    r = self.spec.config.retrieval
    hashes_BK, has_B = RetrievalSystem.positive_hashes(
        sb.batch, sb.labels, sb.candidate_mask, positive_action=r.positive_action)
    return update_sampling_counts(state.sampling_counts, hashes_BK, has_B, r.logq_decay)

  def _loss(self, params: PyTree, sb, sampling_counts: Optional[Array] = None
            ) -> tuple[Array, dict]:
    system = self.system(params)
    if self.spec.task == "ranking":
      out, diag = system.forward(sb.batch)
      loss = self._ranking_loss(out.logits, sb.labels, sb.candidate_mask)
      return loss, {"max_attn_logit": diag.max_abs_attn_logit,
                    "residual_rms": diag.residual_rms}
    # Only each user's first positive enters the loss, so the candidate tower runs on
    # those B items, not on all B*C candidates (equal up to float reassociation).
    r = self.spec.config.retrieval
    loss, has_B, diag = system.in_batch_loss(
        sb.batch, sb.labels, sb.candidate_mask, sb.candidate_post_ids,
        positive_action=r.positive_action, temperature=r.temperature,
        sampling_counts_KH=sampling_counts)
    return loss, {"positive_fraction": jnp.mean(has_B.astype(jnp.float32)),
                  "max_attn_logit": diag.max_abs_attn_logit,
                  "residual_rms": diag.residual_rms}

  def _ranking_loss(self, logits_BCA: Array, labels_BCA: Array, mask_BC: Array) -> Array:
    """The ranking loss with the config's options: the one definition that training
    (`train/loss`) and evaluation (`eval/loss`) share, so an option added here reaches
    both."""
    w = self.spec.action_weights
    return ranking_loss(logits_BCA, labels_BCA, mask_BC, None if w is None else jnp.asarray(w))

  def _retrieval_loss(self, system: RetrievalSystem, sb, user_BD: Array, cand_BCD: Array
                      ) -> tuple[Array, Array]:
    """The in-batch loss of a batch whose user and candidate vectors are already computed
    (evaluation scores every candidate anyway): the training loss's choice of positives
    (`first_positive_rows`) and its `contrastive_loss`, as `RetrievalSystem.in_batch_loss`
    has them, without the logQ correction; and which users have a positive."""
    r = self.spec.config.retrieval
    at, has_B = first_positive_rows(sb.labels, sb.candidate_mask, r.positive_action)
    return system.contrastive_loss(user_BD, cand_BCD[at], has_B, sb.candidate_post_ids[at],
                                   r.temperature), has_B

  def _eval_retrieval_loss(self, system: RetrievalSystem, sb, user_BD: Array, cand_BCD: Array
                           ) -> tuple[Array, Array]:
    """The in-batch loss of an evaluation batch, on the training loss's scale: its users
    are split into groups of `train.batch_size` (where that divides the evaluation batch)
    and each group is its own batch of negatives, since the loss grows with the number of
    users it contrasts (about log B for a model that knows nothing). Mean over the users
    with a positive, and their number (to pool batches by). Never logQ-corrected, so that
    runs with and without `retrieval.logq_correction` compare on it."""
    B, G = user_BD.shape[0], self.spec.config.train.batch_size
    if G >= B or B % G:
      loss, has_B = self._retrieval_loss(system, sb, user_BD, cand_BCD)
      return loss, jnp.sum(has_B).astype(jnp.float32)
    split = lambda x: x.reshape((B // G, G) + x.shape[1:])
    parts = jax.tree.map(split, (sb, user_BD, cand_BCD))
    loss_g, has_gB = jax.vmap(functools.partial(self._retrieval_loss, system))(*parts)
    count_g = jnp.sum(has_gB, axis=1).astype(jnp.float32)
    count = jnp.sum(count_g)
    return jnp.sum(loss_g * count_g) / jnp.maximum(count, 1.0), count

  def sample_train_batch(self, world: World, state: TrainState):
    """The training batch of the state's next step (drawn from the seed's data key)."""
    key = jax.random.fold_in(state.data_key, state.step)
    sb = sample_batch(world, self.spec.train_split, self.spec.config.train.batch_size, key)
    return self.placement.constrain_batch(sb)

  def update(self, state: TrainState, sb) -> tuple[TrainState, dict]:
    """One optimizer step of one seed on a given batch (skipped once diverged)."""
    counts = self._sampling_counts(state, sb)
    (loss, aux), grads = jax.value_and_grad(self._loss, has_aux=True)(state.params, sb,
                                                                       counts)
    grad_norm = optax.tree_utils.tree_norm(grads)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    ok = finite & ~state.diverged
    newly = ~finite & ~state.diverged
    new_state = TrainState(
        params=_where_tree(ok, params, state.params),
        opt_state=_where_tree(ok, opt_state, state.opt_state),
        step=state.step + 1,
        data_key=state.data_key,
        diverged=state.diverged | ~finite,
        diverged_step=jnp.where(newly, state.step + 1, state.diverged_step),
        sampling_counts=None if counts is None else jnp.where(ok, counts,
                                                              state.sampling_counts))
    stats = {"loss": loss, "grad_norm": grad_norm,
             "learning_rate": self.schedule(state.step), **aux}
    return new_state, stats

  def _chunk_one(self, world: World, state: TrainState) -> tuple[TrainState, dict]:
    step = lambda s, _: self.update(s, self.sample_train_batch(world, s))
    state, stats = jax.lax.scan(step, state, None,
                                length=self.spec.config.train.steps_per_call)
    return self.placement.constrain_state(state), stats

  def compile_chunk(self, state: TrainState) -> None:
    """Compiles `train_chunk` for states shaped like `state`, running nothing and donating
    nothing; the next `train_chunk` call reuses the program (JAX caches it), so a caller
    can compile before it starts deferring Ctrl-C to chunk ends."""
    self._chunk.lower(self.world, state).compile()

  def compile_evaluation(self, state: TrainState) -> None:
    """Compiles `evaluate` for states shaped like `state`, as `compile_chunk` does
    `train_chunk` (and computes the evaluation's references, once per trainer)."""
    self._eval.lower(self.world, self.references(), state.params).compile()

  def train_chunk(self, state: TrainState) -> tuple[TrainState, dict]:
    """`steps_per_call` steps of every seed; `state` is donated. Stats are `[seeds, steps]`
    (plus a trailing layer axis for the per-layer diagnostics)."""
    return self._chunk(self.world, state)

  # -- evaluation ----------------------------------------------------------------------

  def _eval_keys(self) -> Array:
    return eval_keys(self.spec.config)

  def _sample_eval(self, world: World, split: SplitConfig, key: Array):
    sb = sample_batch(world, split, self.spec.config.train.eval_batch_size, key)
    return self.placement.constrain_batch(sb)

  def _ranking_eval(self, system: RankingSystem, world: World, split: SplitConfig,
                    consistency: bool) -> dict[str, Array]:
    def one(key):
      sb = self._sample_eval(world, split, key)
      res = {}
      if consistency:
        out, diag, res["moved"], res["count"] = forward_with_new_companions(
            system, sb.batch, sb.candidate_mask)
      else:
        out, diag = system.forward(sb.batch)
      res.update(logits=out.logits.astype(jnp.float32), labels=sb.labels, probs=sb.probs,
                 mask=sb.candidate_mask, max_logit=diag.max_abs_attn_logit,
                 rms=diag.residual_rms)
      return res

    r = jax.lax.map(one, self._eval_keys())
    flat = lambda x: x.reshape((-1,) + x.shape[2:])
    logits, labels = flat(r["logits"]), flat(r["labels"])
    probs, mask = flat(r["probs"]), flat(r["mask"])
    out = dict(metrics.ranking_metrics(logits, labels, probs, mask,
                                       k=tuple(self.spec.config.ranking.top_k)))
    out["loss"] = self._ranking_loss(logits, labels, mask)
    out.update(_diagnostics(r["max_logit"], r["rms"]))
    if consistency:
      out["score_consistency"] = metrics.per_count(jnp.sum(r["moved"]), jnp.sum(r["count"]))
    return out

  def _world_references(self, world: World) -> Optional[dict[str, Any]]:
    """What the evaluation compares a model with that depends on the world and the fixed
    evaluation keys alone, not on any parameters (None for ranking): for retrieval, what
    the generator's oracle and a popularity list find of each evaluation batch's
    positives, `{"<split>": (bayes_found [M, B, K], popular_found [M, B, K])}` over
    the `eval_keys` batches (`bayes_corpus_hits`; `popularity_scores`, the positives of
    each post in training-split lists)."""
    if self.spec.task != "retrieval":
      return None
    rc = self.spec.config.retrieval
    a, ks = rc.positive_action, tuple(rc.recall_k)
    popular_N = popularity_scores(world, self.spec.train_split,
                                  self.spec.config.train.eval_batch_size, a,
                                  popularity_keys(self.spec.config))

    def found(split: SplitConfig) -> tuple[Array, Array]:
      def one(key):
        sb = self._sample_eval(world, split, key)
        positive_BC = is_positive(sb.labels[..., a]) & sb.candidate_mask
        bayes_BK, _ = bayes_corpus_hits(world, sb.interest, world.user_bias_U[sb.user_ids],
                                        a, sb.candidate_post_ids, positive_BC, ks)
        popular_BK, _ = metrics.corpus_hits(popular_N[None], sb.candidate_post_ids,
                                            positive_BC, ks)
        return bayes_BK, popular_BK
      return jax.lax.map(one, self._eval_keys())

    return {name: found(split) for name, split in self.spec.eval_splits.items()}

  def references(self) -> Optional[dict[str, Any]]:
    """`_world_references` of this trainer's world, computed on first use and kept."""
    if self._cached_references is None:
      self._cached_references = self._references(self.world)
    return self._cached_references

  def release_arrays(self) -> None:
    """Drops the trainer's device arrays (its world and the evaluation's references): for
    a trainer being replaced, which cannot train or evaluate afterwards. JAX's caches of
    its compiled functions can keep the trainer object itself alive for the rest of the
    process (their closures refer to it); its arrays no longer."""
    self.world = None
    self._cached_references = None

  def _retrieval_eval(self, system: RetrievalSystem, world: World, split: SplitConfig,
                      references: tuple[Array, Array]) -> dict[str, Array]:
    """`references`: the split's entry of `_world_references`, what the oracle and the
    popularity list find (`bayes_recall@K`, `popularity_recall@K`)."""
    rc = self.spec.config.retrieval
    a, ks = rc.positive_action, tuple(rc.recall_k)
    N = self.spec.world.num_posts
    post_h, author_h, _ = post_features(world, jnp.arange(N))
    corpus_ND = system.corpus_representation(post_h, author_h)

    def one(args):
      key, bayes_found_BK, popular_found_BK = args
      sb = self._sample_eval(world, split, key)
      user_BD, diag = system.user_forward(sb.batch)
      cand_BCD, _ = system.candidate_representation(sb.batch)
      loss, loss_count = self._eval_retrieval_loss(system, sb, user_BD, cand_BCD)
      positive_BC = is_positive(sb.labels[..., a]) & sb.candidate_mask
      found_BK, total_B = metrics.corpus_hits(system.model.scores(user_BD, corpus_ND),
                                              sb.candidate_post_ids, positive_BC, ks)
      own_BC = jax.vmap(lambda u_D, c_CD: system.model.scores(u_D[None], c_CD)[0])
      res = dict(scores=own_BC(user_BD, cand_BCD),
                 labels=positive_BC, probs=sb.probs[..., a], mask=sb.candidate_mask,
                 loss=loss, loss_count=loss_count, max_logit=diag.max_abs_attn_logit,
                 rms=diag.residual_rms, finite=jnp.all(jnp.isfinite(user_BD)), total=total_B)
      for j, k in enumerate(ks):
        res[f"found@{k}"], res[f"bayes_found@{k}"] = found_BK[:, j], bayes_found_BK[:, j]
        res[f"popularity_found@{k}"] = popular_found_BK[:, j]
      return res

    r = jax.lax.map(one, (self._eval_keys(),) + tuple(references))
    flat = lambda x: x.reshape(-1)
    total, has = flat(r["total"]), flat(r["total"]) > 0
    per_user = lambda found: metrics.per_count(
        jnp.sum(jnp.where(has, metrics.per_count(flat(found), total), 0.0)), jnp.sum(has))
    # Mean over every evaluation user with a positive, whatever batch it fell in.
    out = {"loss": jnp.sum(r["loss"] * r["loss_count"])
                   / jnp.maximum(jnp.sum(r["loss_count"]), 1.0)}
    # A model whose representations are not finite (a diverged run) ranks the corpus
    # arbitrarily: its recall is undefined (NaN, null in result.json), not 0.
    defined = jnp.all(r["finite"]) & jnp.all(jnp.isfinite(corpus_ND))
    for k in ks:
      out[f"recall@{k}"] = jnp.where(
          defined, per_user(r[f"found@{k}"]), jnp.nan)
      out[f"bayes_recall@{k}"] = per_user(r[f"bayes_found@{k}"])
      out[f"popularity_recall@{k}"] = per_user(r[f"popularity_found@{k}"])
    m = flat(r["mask"])
    out["auc"] = metrics.roc_auc(flat(r["scores"]), flat(r["labels"]), m)[0]
    out["bayes_auc"] = metrics.roc_auc(flat(r["probs"]), flat(r["labels"]), m)[0]
    out.update(_diagnostics(r["max_logit"], r["rms"]))
    return out

  def _eval_one(self, shared: tuple[World, Optional[dict]], params: PyTree
                ) -> dict[str, Array]:
    """One seed's metrics; `shared` is the world and its `_world_references`."""
    world, references = shared
    system = self.system(params)
    out = {}
    for name, split in self.spec.eval_splits.items():
      if self.spec.task == "ranking":
        consistency = name == "eval" and self.spec.config.train.score_consistency
        res = self._ranking_eval(system, world, split, consistency)
      else:
        res = self._retrieval_eval(system, world, split, references[name])
      out.update({f"{name}/{k}": v for k, v in res.items()})
    return out

  def evaluate(self, state: TrainState) -> dict[str, Array]:
    """Metrics of every eval split (`"<split>/<metric>"`), each `[seeds]`, on the fixed
    evaluation batches (the same for every seed). Seeds are evaluated in turn: each one's
    metrics equal those of its parameters evaluated alone, bit for bit.

    It runs with `jax_debug_nans` off: a metric that is undefined (an action without a
    positive, a diverged seed's recall) is NaN by design, and would otherwise raise where
    a user debugging their own NaNs switched the check on; training steps keep it."""
    with jax.debug_nans(False):
      return self._eval(self.world, self.references(), state.params)


def unstack(tree: Any, index: int) -> Any:
  """Seed `index` of a seed-stacked pytree."""
  return jax.tree.map(lambda x: x[index], tree)
