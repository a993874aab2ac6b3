"""Train both Phoenix models on your own logs: arrays of raw ids in, a served model out.

    python -m experiments.own_data --workdir=/tmp/phoenix_own_data

The logs here are made up (`make_logs`: raw ids below 10**9, ragged histories, four
impressions per user of up to 16 candidates with 19 action labels each), as a stand-in for
yours; every other step is what you would run on real data, with the library's public
pieces and nothing of the synthetic world (docs/own_data.md walks through it). Each
user's last impression is held out for evaluation:

1. `to_batch`: ids -> `pf.hash_ids` (with `valid=`, so padding hashes to 0), histories
   left-aligned, oldest first -> `pf.RecsysBatch`, labels `[B, C, 19]` and a candidate
   mask `[B, C]`.
2. The ranker: `training.RankingSystem` (hash tables + `PhoenixModel`), AdamW from
   `training.optimizer_from`, `training.ranking_loss` in a jitted step, every host batch
   checked first by `training.validate_training_batch` (under jit nothing checks values).
3. Evaluation without true probabilities: `training.metrics.ranking_metrics(..., None,
   ...)`.
4. A checkpoint (`training.checkpoint.save` / `load`), then serving one user with
   `pf.RankingRunner`.
5. The retriever: `training.RetrievalSystem.in_batch_loss`, with the logQ correction from
   counts of the training impressions' positives (`positive_counts`), then
   `pf.RetrievalRunner` over the whole catalogue, and recall@K of each evaluation user's
   favorited post against the most favorited posts.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import time
from typing import NamedTuple

from absl import flags
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

if not __package__:  # run by path, not with python -m: import this checkout's packages
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments.cli import (exit_on_run_errors, parse_flags, quiet_backend_search, run_app,
                             usage_error)
import phoenix_flax as pf
from phoenix_flax import training
from phoenix_flax.training import checkpoint, metrics
from phoenix_flax.training.runner import (CONFIG_FILE, RESULT_FILE, check_workdir,
                                          lock_run_dir)

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags, defined when it runs (importing this module for its
  functions, as the tests do, leaves absl's flag registry to others)."""
  flags.DEFINE_integer("num_steps", 600, "Training steps of each model.")
  flags.DEFINE_integer("batch_size", 64, "Users per training batch.")
  flags.DEFINE_string("workdir", "/tmp/phoenix_own_data", "Where the ranker's checkpoint goes.")
  flags.DEFINE_integer("seed", 0, "Seed of the made-up logs and of the models.")
  flags.DEFINE_float("init_scale", 0.05, "Initial std of the hash-embedding tables "
                     "(the presets' 0.05; the systems' default is 1.0).")
  flags.DEFINE_bool("logq_correction", True, "Train the retriever with the logQ "
                    "correction, from counts of the training impressions' positives "
                    "(--nologq_correction: the plain in-batch softmax).")

A = len(pf.ACTIONS)
FAVORITE = pf.ACTIONS.index("favorite_score")
HISTORY, CANDIDATES, SURFACES = 32, 16, 4        # the model's S, C and surface vocabulary
BUCKETS = {"user": 4096, "post": 8192, "author": 1024}   # hash-table rows (0 = padding)
TRANSFORMER = pf.TransformerConfig(emb_size=64, key_size=16, num_q_heads=4, num_kv_heads=2,
                                   num_layers=2, widening_factor=2.0,
                                   attn_output_multiplier=0.25)


class Logs(NamedTuple):
  """Made-up logs, one row per user, ragged parts padded and their lengths given. Each
  user has `L` impressions (candidate lists) in time order, the last held out, and one
  history, made apart from them; from real logs, pair each impression with the history
  before it, so that no label it predicts is in its input."""

  user_id: np.ndarray          # int64 [U], raw ids
  history_post: np.ndarray     # int64 [U, HISTORY], oldest first (first `history_len`)
  history_author: np.ndarray   # int64 [U, HISTORY]
  history_actions: np.ndarray  # int8 [U, HISTORY, A]: the actions on each history item
  history_surface: np.ndarray  # int32 [U, HISTORY]
  history_len: np.ndarray      # int [U]
  list_post: np.ndarray        # int64 [U, L, CANDIDATES]: each impression's candidates
  list_author: np.ndarray      # int64 [U, L, CANDIDATES]
  list_surface: np.ndarray     # int32 [U, L, CANDIDATES]
  list_labels: np.ndarray      # float32 [U, L, CANDIDATES, A]: the actions taken
  list_len: np.ndarray         # int [U, L]
  list_true_logit: np.ndarray  # float32 [U, L, CANDIDATES, A]: what made the labels (made-up
                               # logs only: real logs have no such thing)
  catalogue_post: np.ndarray   # int64 [P]: every post, for retrieval
  catalogue_author: np.ndarray  # int64 [P]


def make_logs(num_users: int = 2000, num_posts: int = 3000, num_authors: int = 300,
              impressions: int = 4, seed: int = 0) -> Logs:
  """Logs with learnable structure: users have latent tastes, authors topics (their posts'
  topics scatter around them), posts a popularity; a user engages with popular posts near
  their taste, and each action has its own base rate. Histories and impressions are
  drawn from the same taste as the engagements."""
  rng = np.random.default_rng(seed)
  post_ids = rng.choice(10**9, num_posts, replace=False)
  author_ids = rng.choice(10**9, num_authors, replace=False)
  author_of = rng.integers(num_authors, size=num_posts)
  taste = rng.normal(size=(num_users, 8))
  topic = rng.normal(size=(num_authors, 8))[author_of] + 0.5 * rng.normal(size=(num_posts, 8))
  affinity = taste @ topic.T / np.sqrt(8)                       # [U, P]
  popularity = rng.normal(size=num_posts)
  base_rate = np.linspace(-1.0, -4.0, A)                        # favorites commonest

  def pick(weights, n):   # n distinct posts per user, drawn by softmax(weights)
    p = np.exp(weights - weights.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return np.stack([rng.choice(num_posts, n, replace=False, p=row) for row in p])

  U, L, C = num_users, impressions, CANDIDATES
  history = pick(2.0 * affinity, HISTORY)                       # engaged posts
  shown = pick(2.0 * affinity, L * C).reshape(U, L, C)          # impressions
  signal = (2.0 * np.take_along_axis(affinity, shown.reshape(U, L * C), 1).reshape(U, L, C)
            + popularity[shown])
  true_logit = signal[..., None] + base_rate
  engaged = rng.random((U, L, C, A)) < 1 / (1 + np.exp(-true_logit))
  actions = rng.random((U, HISTORY, A)) < 0.2
  actions[..., FAVORITE] = True
  return Logs(
      user_id=rng.choice(10**9, U, replace=False),
      history_post=post_ids[history], history_author=author_ids[author_of[history]],
      history_actions=actions.astype(np.int8),
      history_surface=rng.integers(SURFACES, size=(U, HISTORY)).astype(np.int32),
      history_len=rng.integers(1, HISTORY + 1, size=U),
      list_post=post_ids[shown], list_author=author_ids[author_of[shown]],
      list_surface=rng.integers(SURFACES, size=(U, L, C)).astype(np.int32),
      list_labels=engaged.astype(np.float32),
      list_len=rng.integers(2, C + 1, size=(U, L)),
      list_true_logit=true_logit.astype(np.float32),
      catalogue_post=post_ids, catalogue_author=author_ids[author_of])


def to_batch(logs: Logs, rows: np.ndarray, impressions: np.ndarray
             ) -> tuple[pf.RecsysBatch, np.ndarray, np.ndarray]:
  """(batch, labels [B, C, A], mask [B, C]) of impression `impressions[b]` of user
  `rows[b]`.

  The history is left-aligned, oldest first, padding after it (what the model and the
  runners expect); `valid=` makes padding hash to 0, which the model masks out."""
  hist_valid = np.arange(HISTORY) < logs.history_len[rows, None]        # [B, S]
  mask = np.arange(CANDIDATES) < logs.list_len[rows, impressions, None]  # [B, C]
  hashed = lambda ids, table, valid: np.asarray(pf.hash_ids(ids, BUCKETS[table], valid=valid))
  at = (rows, impressions)
  batch = pf.RecsysBatch(
      user_hashes=hashed(logs.user_id[rows], "user", None),
      history_post_hashes=hashed(logs.history_post[rows], "post", hist_valid),
      history_author_hashes=hashed(logs.history_author[rows], "author", hist_valid),
      history_actions=np.where(hist_valid[..., None], logs.history_actions[rows], 0),
      history_product_surface=np.where(hist_valid, logs.history_surface[rows], 0),
      candidate_post_hashes=hashed(logs.list_post[at], "post", mask),
      candidate_author_hashes=hashed(logs.list_author[at], "author", mask),
      candidate_product_surface=np.where(mask, logs.list_surface[at], 0))
  labels = np.where(mask[..., None], logs.list_labels[at], 0.0).astype(np.float32)
  return batch, labels, mask


def ranking_config() -> pf.PhoenixModelConfig:
  return pf.PhoenixModelConfig(model=TRANSFORMER, emb_size=64, history_seq_len=HISTORY,
                               candidate_seq_len=CANDIDATES, right_anchored_rope=True,
                               product_surface_vocab_size=SURFACES)


def fit(system, loss_fn, batches, num_steps: int, learning_rate: float):
  """AdamW (the library's schedule, clipping and decay mask) on `loss_fn(system, *batch)`
  over the host batches `batches(step)`, each checked before its step; returns the system
  and the losses of the first step and at every tenth of the run."""
  optim = training.base_config("ranking").optim
  optim.learning_rate = learning_rate
  optim.warmup_steps = max(num_steps // 20, 1)
  tx = training.optimizer_from(optim, num_steps)
  opt_state = tx.init(eqx.filter(system, eqx.is_inexact_array))

  @eqx.filter_jit(donate="all-except-first")
  def step(batch, system, opt_state):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(system, *batch)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(system, eqx.is_inexact_array))
    return eqx.apply_updates(system, updates), opt_state, loss

  losses = []
  for i in range(num_steps):
    batch = batches(i)
    training.validate_training_batch(system, *batch)
    system, opt_state, loss = step(batch, system, opt_state)
    if i == 0 or (i + 1) % max(num_steps // 10, 1) == 0:
      losses.append(float(loss))   # a host sync: the first step, then every tenth of the run
  return system, losses


def training_batches(logs: Logs, batch_size: int, seed: int):
  """`batches(step)` for `fit`: random users, each at a random impression before its last
  (the last is held out for evaluation)."""
  rng = np.random.default_rng(seed)
  U, L = logs.list_len.shape

  def batches(step):
    rows = rng.choice(U, batch_size, replace=False)
    return to_batch(logs, rows, rng.integers(L - 1, size=batch_size))
  return batches


def held_out(logs: Logs, rows: np.ndarray):
  """(batch, labels, mask) of the users' last impressions."""
  return to_batch(logs, rows, np.full(len(rows), logs.list_len.shape[1] - 1))


def train_ranker(logs: Logs, num_steps: int, batch_size: int, seed: int,
                 init_scale: float = 0.05) -> training.RankingSystem:
  system = training.RankingSystem(ranking_config(), BUCKETS["user"], BUCKETS["post"],
                                  BUCKETS["author"], key=jax.random.key(seed),
                                  init_scale=init_scale)

  def loss_fn(system, batch, labels, mask):
    return training.ranking_loss(system(batch), labels, mask)

  system, losses = fit(system, loss_fn, training_batches(logs, batch_size, seed + 1),
                       num_steps, 3e-3)
  print(f"ranker: training loss {losses[0]:.4f} -> {losses[-1]:.4f} over {num_steps} steps")
  return system


def evaluate_ranker(system: training.RankingSystem, logs: Logs, rows: np.ndarray) -> dict:
  """The ranking metrics on the users' held-out last impressions (no true probabilities:
  `probs=None`)."""
  batch, labels, mask = held_out(logs, rows)
  training.validate_training_batch(system, batch, labels, mask)
  logits = eqx.filter_jit(lambda s, b: s(b))(system, batch)
  found = metrics.ranking_metrics(logits, labels, None, mask, k=5)
  return {k: float(v) for k, v in found.items()}


def generator_metrics(logs: Logs, rows: np.ndarray) -> dict:
  """The ranking metrics of the made-up logs' own logits on the same held-out lists: the
  ceiling a ranker could reach here (real logs have none)."""
  _, labels, mask = held_out(logs, rows)
  logits = logs.list_true_logit[rows, -1]
  found = metrics.ranking_metrics(logits, labels, None, mask, k=5)
  return {k: float(v) for k, v in found.items()}


def serve_one_user(system: training.RankingSystem, logs: Logs, row: int) -> pf.RankingOutput:
  """Ranks one user's held-out list with the serving runner (which checks every input
  itself), whole and in chunks of 4 against one encoded context."""
  batch, _, mask = held_out(logs, np.array([row]))
  runner = pf.RankingRunner(system.model)
  embeddings = system.tables(batch)
  ranked = runner.rank(batch, embeddings)
  chunked = runner.rank_chunked(batch, embeddings, chunk_size=4)
  gap = float(np.max(np.abs(np.asarray(ranked.scores) - np.asarray(chunked.scores))[0][mask[0]]))
  order = np.asarray(ranked.ranked_indices[0])[:int(mask[0].sum())]
  best = [int(logs.list_post[row, -1, c]) for c in order[:3]]
  print(f"serving user {int(logs.user_id[row])}: best posts {best} "
        f"(chunks of 4 vs whole list: max |p difference| {gap:.1e})")
  return ranked


def positive_counts(logs: Logs) -> np.ndarray:
  """float32 `[2, post buckets]`: a count sketch (`training.update_sampling_counts`'s
  layout: a row per post hash function) of the training examples' positives. An example
  is an impression before the user's last, which `training_batches` draws uniformly; its
  positive is its first favorited candidate. For the logQ correction: the rate at which a
  post turns up as another user's negative is proportional to its count."""
  liked = _favorited(logs)[:, :-1]                                     # [U, L-1, C]
  first = np.take_along_axis(logs.list_post[:, :-1], np.argmax(liked, axis=-1)[..., None],
                             axis=-1)[..., 0]
  hashes = pf.hash_ids(first[liked.any(axis=-1)], BUCKETS["post"])            # [N, 2]
  # All at once, undecayed: the runner's streaming update applied to the whole log.
  return np.asarray(training.update_sampling_counts(
      np.zeros((hashes.shape[1], BUCKETS["post"]), np.float32), hashes,
      np.ones(hashes.shape[0], bool), decay=1.0))


def train_retriever(logs: Logs, num_steps: int, batch_size: int, seed: int,
                    init_scale: float = 0.05, logq: bool = True
                    ) -> training.RetrievalSystem:
  """The retriever trained on `training_batches`; `logq`: with the logQ correction from
  `positive_counts` (the command's default, `--logq_correction`)."""
  config = pf.PhoenixRetrievalModelConfig(model=TRANSFORMER, emb_size=64,
                                          history_seq_len=HISTORY,
                                          product_surface_vocab_size=SURFACES)
  system = training.RetrievalSystem(config, BUCKETS["user"], BUCKETS["post"],
                                    BUCKETS["author"], key=jax.random.key(seed + 2),
                                    init_scale=init_scale)
  # Counted once over the logs (which do not change), rather than streamed as the
  # runner's `retrieval.logq_correction` does.
  counts = jnp.asarray(positive_counts(logs)) if logq else None

  def loss_fn(system, batch, labels, mask):
    # The same post favorited by two users of a batch is not a negative for either.
    loss, _, _ = system.in_batch_loss(batch, labels, mask, post_ids(batch),
                                      positive_action=FAVORITE, temperature=0.05,
                                      sampling_counts_KH=counts)
    return loss

  system, losses = fit(system, loss_fn, training_batches(logs, batch_size, seed + 3),
                       num_steps, 3e-3)
  print(f"retriever: training loss {losses[0]:.4f} -> {losses[-1]:.4f} over {num_steps} "
        "steps")
  return system


def post_ids(batch: pf.RecsysBatch) -> jax.Array:
  """int `[B, C]`: an id per candidate post for `in_batch_loss`, equal for the same post
  and different for different ones: its two hashes as one integer. Posts that share both
  are one item to the model; the first hash alone is shared by about a third of the
  example's catalogue, so as an id it made different posts each other's duplicates.
  Above 46,340 post rows the product wraps around in int32: still an id, two different
  posts sharing one with a chance of about 2^-32."""
  h = jnp.asarray(batch.candidate_post_hashes)
  return h[..., 0] * BUCKETS["post"] + h[..., 1]


def retrieval_recall(system: training.RetrievalSystem, logs: Logs, rows: np.ndarray,
                     top_k: int = 100) -> float:
  """Share of users whose first favorited candidate of their held-out impression is among
  the top `top_k` posts retrieved from the whole catalogue (ties at the `top_k`-th score
  go to the lower row, as `lax.top_k` breaks them; the training runs' `recall@K` shares
  tied places and counts every positive, so the two figures are defined differently).
  The runner's corpus ids must fit int32, so the catalogue's row numbers stand in for the
  raw ids (mapped back with `catalogue_post`)."""
  runner = pf.RetrievalRunner(system.model)
  valid = np.ones(len(logs.catalogue_post), bool)
  vectors = runner.encode_corpus(*system.tables.post_embeddings(
      jnp.asarray(pf.hash_ids(logs.catalogue_post, BUCKETS["post"], valid=valid)),
      jnp.asarray(pf.hash_ids(logs.catalogue_author, BUCKETS["author"], valid=valid))))
  runner.set_corpus(vectors, np.arange(len(logs.catalogue_post), dtype=np.int32))
  batch, _, _ = held_out(logs, rows)
  first, has = held_out_favorite(logs, rows)
  found = runner.retrieve(batch, system.tables(batch), top_k=top_k)
  retrieved = logs.catalogue_post[np.asarray(found.top_k_post_ids)]      # back to raw ids
  hits = (retrieved == first[:, None]).any(axis=1)
  return float(hits[has].mean())


def _favorited(logs: Logs) -> np.ndarray:
  """bool [U, L, C]: the candidates of each impression that were favorited: a favorite
  label above one half (`training.is_positive`, the retrieval loss's and the metrics'
  rule, so that a soft label counts here as it counts there)."""
  return np.asarray(training.is_positive(logs.list_labels[..., FAVORITE])) & (
      np.arange(CANDIDATES) < logs.list_len[..., None])


def held_out_favorite(logs: Logs, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The raw id of each user's first favorited candidate in its held-out impression, and
  whether it has one (the others leave the recall)."""
  held = _favorited(logs)[rows, -1]
  return logs.list_post[rows, -1, np.argmax(held, axis=1)], held.any(axis=1)


def popularity_recall(logs: Logs, rows: np.ndarray, top_k: int = 100) -> float:
  """`retrieval_recall` of a baseline without a model: the `top_k` posts favorited most
  often in the training impressions, the same list for every user (ties go to the lower
  post id)."""
  liked = _favorited(logs)
  posts, counts = np.unique(logs.list_post[:, :-1][liked[:, :-1]], return_counts=True)
  top = posts[np.argsort(-counts, kind="stable")[:top_k]]
  first, has = held_out_favorite(logs, rows)
  return float(np.isin(first, top)[has].mean())


def _check_workdir(workdir: str) -> None:
  """Refuses a workdir that cannot be written or that is an `experiments.run` run
  directory, whose checkpoints `checkpoint.save` would replace (it keeps no later step)."""
  check_workdir(workdir)
  found = [name for name in (CONFIG_FILE, RESULT_FILE)
           if os.path.exists(os.path.join(workdir, name))]
  if found:
    usage_error(f"--workdir={workdir} holds a training run ({', '.join(found)}), whose "
                "checkpoints this example would replace; use another --workdir",
                flags_hint=False)


def main(argv) -> None:
  if len(argv) > 1:
    usage_error(f"unexpected arguments: {argv[1:]}")
  num_users = inspect.signature(make_logs).parameters["num_users"].default
  if FLAGS.num_steps < 10:
    usage_error(f"--num_steps={FLAGS.num_steps}: use at least 10")
  if not (math.isfinite(FLAGS.init_scale) and FLAGS.init_scale > 0):
    usage_error(f"--init_scale={FLAGS.init_scale}: must be a finite number > 0")
  if not FLAGS.workdir.strip():
    usage_error("--workdir is empty: give a directory, or leave the flag out for its "
                "default")
  if not 1 <= FLAGS.batch_size <= num_users:
    usage_error(f"--batch_size={FLAGS.batch_size}: use 1 to {num_users}")
  if not 0 <= FLAGS.seed < 2 ** 32:
    usage_error(f"--seed={FLAGS.seed}: use 0 to 2**32 - 1")
  with exit_on_run_errors(resumable=False):   # Ctrl-C, a workdir in use or unwritable
    _check_workdir(FLAGS.workdir)   # before minutes of training, not after
    lock = lock_run_dir(FLAGS.workdir)   # no experiments.run starts here meanwhile
    try:
      _run()
    finally:
      if lock is not None:
        os.close(lock)


def _run() -> None:
  start = time.perf_counter()
  logs = make_logs(seed=FLAGS.seed)
  users = np.arange(len(logs.user_id))
  ranker = train_ranker(logs, FLAGS.num_steps, FLAGS.batch_size, FLAGS.seed, FLAGS.init_scale)
  found = evaluate_ranker(ranker, logs, users)
  ceiling = generator_metrics(logs, users)
  print(f"ranker on the {len(users)} users' held-out impressions: auc_mean "
        f"{found['auc_mean']:.4f}, list_auc {found['list_auc']:.4f}, logloss "
        f"{found['logloss']:.4f}, ndcg@5 {found['ndcg@5']:.4f}, recall@5 "
        f"{found['recall@5']:.4f} (the logs' own logits: auc_mean "
        f"{ceiling['auc_mean']:.4f}, list_auc {ceiling['list_auc']:.4f})")
  path = checkpoint.save(FLAGS.workdir, FLAGS.num_steps, ranker)
  restored = checkpoint.load(FLAGS.workdir, FLAGS.num_steps, ranker)
  print(f"checkpoint {path} written and read back")
  serve_one_user(restored, logs, 0)

  retriever = train_retriever(logs, FLAGS.num_steps, FLAGS.batch_size, FLAGS.seed,
                              FLAGS.init_scale, FLAGS.logq_correction)
  recall = retrieval_recall(retriever, logs, users)
  print(f"retriever: recall@100 of the held-out favorited post over "
        f"{len(logs.catalogue_post)} catalogue posts {recall:.4f} (chance "
        f"{100 / len(logs.catalogue_post):.4f}; the 100 most favorited posts: "
        f"{popularity_recall(logs, users):.4f})")
  print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  define_flags()
  quiet_backend_search()
  run_app(main, flags_parser=parse_flags)
