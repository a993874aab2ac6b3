"""Training on your own data: the host-side batch checks, the optimizer from an `optim`
section, the retrieval loss as a system method, and experiments/own_data.py end to end."""

import dataclasses
import os
from types import SimpleNamespace

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phoenix_flax as pf
from experiments import own_data
from phoenix_flax import training
from phoenix_flax.training import checkpoint
from phoenix_flax.training.runner import RunInUseError, lock_run_dir

from conftest import REPO


@pytest.fixture(scope="module")
def logs():
  return own_data.make_logs(num_users=120, num_posts=400, num_authors=40, seed=3)


@pytest.fixture(scope="module")
def system():
  return training.RankingSystem(own_data.ranking_config(), *own_data.BUCKETS.values(),
                                key=jax.random.key(0), init_scale=0.05)


def test_to_batch_lays_out_own_logs(logs, system):
  rows = np.arange(8)
  impressions = np.arange(8) % 4
  batch, labels, mask = own_data.to_batch(logs, rows, impressions)
  assert training.validate_training_batch(system, batch, labels, mask) == (
      8, own_data.CANDIDATES)
  # Left-aligned histories, hash 0 exactly after each user's length; lists likewise.
  valid_S = np.asarray(batch.history_post_hashes[..., 0]) != 0
  np.testing.assert_array_equal(valid_S.sum(axis=1), logs.history_len[rows])
  np.testing.assert_array_equal(valid_S, np.arange(own_data.HISTORY) < logs.history_len[rows, None])
  # Padding carries nothing, though the logs hold actions and surfaces past each length.
  assert logs.history_actions[rows][~valid_S].any()
  # A made-up history is the user's engagements: every item favorited.
  assert logs.history_actions[..., own_data.FAVORITE].all()
  for field in ("history_actions", "history_product_surface", "candidate_product_surface"):
    values = np.asarray(getattr(batch, field))
    assert not values[~(valid_S if field.startswith("history") else mask)].any(), field
  np.testing.assert_array_equal(np.asarray(batch.candidate_post_hashes[..., 0]) != 0, mask)
  np.testing.assert_array_equal(mask.sum(axis=1), logs.list_len[rows, impressions])
  assert not labels[~mask].any()
  np.testing.assert_array_equal(labels[mask], logs.list_labels[rows, impressions][mask])
  # Each field hashes its own column of the logs into its own table.
  hist_valid = np.arange(own_data.HISTORY) < logs.history_len[rows, None]
  at = (rows, impressions)
  for field, ids, table, valid in (
      ("user_hashes", logs.user_id[rows], "user", None),
      ("history_post_hashes", logs.history_post[rows], "post", hist_valid),
      ("history_author_hashes", logs.history_author[rows], "author", hist_valid),
      ("candidate_post_hashes", logs.list_post[at], "post", mask),
      ("candidate_author_hashes", logs.list_author[at], "author", mask)):
    np.testing.assert_array_equal(
        getattr(batch, field), pf.hash_ids(ids, own_data.BUCKETS[table], valid=valid),
        err_msg=field)
  # The same raw id hashes alike wherever it appears.
  post = logs.history_post[0, 0]
  where = np.argwhere((logs.list_post[rows, impressions] == post) & mask)
  for b, c in where:
    np.testing.assert_array_equal(batch.candidate_post_hashes[b, c],
                                  batch.history_post_hashes[0, 0])
  # Real logs often record actions as bools or small ints: the labels come out float32.
  for dtype in (bool, np.int8, np.float64):
    _, labels, _ = own_data.to_batch(logs._replace(list_labels=logs.list_labels.astype(dtype)),
                                     rows, impressions)
    assert labels.dtype == np.float32, dtype


def test_make_logs_spans_its_ranges_with_labels_that_follow_their_logits(logs):
  """Histories of 1 to HISTORY items and lists of 2 to CANDIDATES (full ones included);
  labels drawn as Bernoulli(sigmoid(true logit)), favorites the commonest action."""
  assert logs.history_len.min() >= 1 and logs.history_len.max() == own_data.HISTORY
  assert logs.list_len.min() >= 2 and logs.list_len.max() == own_data.CANDIDATES
  valid = np.arange(own_data.CANDIDATES) < logs.list_len[..., None]
  labels, logit = logs.list_labels[valid], logs.list_true_logit[valid]      # [N, A]
  np.testing.assert_allclose(labels.mean(axis=0), (1 / (1 + np.exp(-logit))).mean(axis=0),
                             atol=0.03)
  rates = labels.mean(axis=0)
  assert rates.argmax() == own_data.FAVORITE and rates[own_data.FAVORITE] > rates[-1] + 0.2


def test_validate_training_batch_names_what_jit_would_hide(logs, system):
  batch, labels, mask = own_data.held_out(logs, np.arange(4))
  # The held-out impression is each user's last, the one training never draws.
  last = own_data.to_batch(logs, np.arange(4), np.full(4, logs.list_len.shape[1] - 1))
  for got, want in zip(jax.tree.leaves((batch, labels, mask)), jax.tree.leaves(last)):
    np.testing.assert_array_equal(got, want)
  raw = batch._replace(user_hashes=np.asarray(logs.user_id[:4, None].repeat(2, 1),
                                              np.int32))
  with pytest.raises(ValueError, match=r"batch.user_hashes holds \d+ at index \(0, 0\); "
                                       r"hashes must be < 4096, the rows of the user table"):
    training.validate_training_batch(system, raw)
  # Each hash field against its own table, at the boundary: its row count is one too many.
  rows = {table: getattr(system.tables, f"{table}_table").shape[0]
          for table in ("user", "post", "author")}
  assert len(set(rows.values())) == 3   # a field checked against another table shows
  for field, table in (("user_hashes", "user"), ("history_post_hashes", "post"),
                       ("history_author_hashes", "author"), ("candidate_post_hashes", "post"),
                       ("candidate_author_hashes", "author")):
    values = np.asarray(getattr(batch, field)).copy()
    where = np.unravel_index(np.flatnonzero(values)[0], values.shape)   # a real item's
    values[where] = rows[table]
    with pytest.raises(ValueError, match=rf"batch.{field} holds {rows[table]} at index "
                       rf".*hashes must be < {rows[table]}, the rows of the {table} table"):
      training.validate_training_batch(system, batch._replace(**{field: values}))
    values[where] = rows[table] - 1
    training.validate_training_batch(system, batch._replace(**{field: values}))
  with pytest.raises(ValueError, match=r"labels_BCA holds 100.0 .*must be finite and in "
                                       r"\[0, 1\]"):
    training.validate_training_batch(system, batch, labels * 100, mask)
  with pytest.raises(ValueError, match=r"labels_BCA holds -1.0 at index \(0, 0, 0\)"):
    negative = np.asarray(labels).copy()
    negative[0, 0, 0] = -1.0
    training.validate_training_batch(system, batch, negative, mask)
  with pytest.raises(ValueError, match=r"mask_BC has shape \(1, 16\), expected \(4, 16\)"):
    training.validate_training_batch(system, batch, labels, mask[:1])
  with pytest.raises(ValueError, match=r"labels_BCA holds nan"):
    training.validate_training_batch(system, batch, np.where(labels > 0, np.nan, labels),
                                     mask)
  with pytest.raises(ValueError, match=r"labels_BCA has shape \(4, 16, 18\), expected "
                                       r"\(4, 16, 19\)"):
    training.validate_training_batch(system, batch, labels[..., 1:], mask)
  with pytest.raises(ValueError, match="labels_BCA has dtype int32, expected floats"):
    training.validate_training_batch(system, batch, labels.astype(np.int32), mask)
  padded = np.argwhere(~mask)[0]
  everything = np.ones_like(mask)
  with pytest.raises(ValueError, match=rf"mask_BC holds True at index \({padded[0]}, "
                                       rf"{padded[1]}\); the mask marks a padded candidate"):
    training.validate_training_batch(system, batch, labels, everything)
  with pytest.raises(ValueError, match="mask_BC has dtype float32, expected bool"):
    training.validate_training_batch(system, batch, labels, mask.astype(np.float32))
  real = np.argwhere(mask)[0]
  fewer = mask.copy()
  fewer[tuple(real)] = False
  with pytest.raises(ValueError, match=rf"mask_BC holds False at index \({real[0]}, "
                                       rf"{real[1]}\); the mask leaves out a candidate"):
    training.validate_training_batch(system, batch, labels, fewer)
  # A right-aligned history: an error for the model config with right-anchored positions
  # (pf.validate_batch, the runners' check) and for training whatever the positions.
  right = batch._replace(history_post_hashes=np.asarray(batch.history_post_hashes)[:, ::-1])
  with pytest.raises(ValueError, match="must be left-aligned"):
    training.validate_training_batch(system, right)
  with pytest.raises(ValueError, match="must be left-aligned"):
    pf.validate_batch(system.model.config, right)
  assert pf.validate_batch(system.model.config, batch) == (4, own_data.CANDIDATES)
  sequential = training.RankingSystem(
      dataclasses.replace(own_data.ranking_config(), right_anchored_rope=False),
      *own_data.BUCKETS.values(), key=jax.random.key(0))
  assert pf.validate_batch(sequential.model.config, right) == (4, own_data.CANDIDATES)
  with pytest.raises(ValueError, match="history must be left-aligned"):
    training.validate_training_batch(sequential, right)


def test_optimizer_from_an_optim_section_is_the_runs_optimizer():
  spec = training.parse_config(training.base_config("ranking"))
  params = {"w": jnp.ones((3, 3)), "scale": jnp.ones(3)}
  grads = {"w": jnp.full((3, 3), 0.5), "scale": jnp.full(3, -0.25)}
  ours = training.optimizer_from(spec.config.optim, spec.config.train.num_steps)
  runs = training.make_optimizer(spec)
  state_ours, state_runs = ours.init(params), runs.init(params)
  for _ in range(3):
    update_ours, state_ours = ours.update(grads, state_ours, params)
    update_runs, state_runs = runs.update(grads, state_runs, params)
    jax.tree.map(np.testing.assert_array_equal, update_ours, update_runs)
  assert float(jnp.abs(update_ours["w"]).max()) > 0   # past the warmup's first step
  optim = training.base_config("ranking").optim
  optim.warmup_steps = 50
  with pytest.raises(training.ConfigError, match="optim.warmup_steps=50 is invalid: must be "
                                                  "below train.num_steps=50"):
    training.optimizer_from(optim, 50)
  with pytest.raises(training.ConfigError, match="train.num_steps=0 is invalid"):
    training.optimizer_from(optim, 0)
  with pytest.raises(training.ConfigError, match="train.num_steps=2147483648 is invalid: "
                                                  "must be at most"):
    training.optimizer_from(optim, 2**31)
  # Every range of the section is checked, as a run checks it.
  for field, bad in (("learning_rate", -1.0), ("b2", 1.0), ("eps", 0.0),
                     ("grad_clip_norm", 0.0)):
    wrong = training.base_config("ranking").optim
    wrong[field] = bad
    with pytest.raises(training.ConfigError, match=rf"optim.{field}={bad} is invalid"):
      training.optimizer_from(wrong, 100)
  optim.momentum = 0.9
  with pytest.raises(training.ConfigError, match=r"optim: unknown fields \['momentum'\]"):
    training.optimizer_from(optim, 100)
  with pytest.raises(training.ConfigError, match="optim must be a ConfigDict"):
    training.optimizer_from({"learning_rate": 1e-3}, 100)
  del optim["momentum"], optim["grad_clip_norm"]
  with pytest.raises(training.ConfigError, match=r"optim: unknown fields \[\], missing "
                                                  r"fields \['grad_clip_norm'\]"):
    training.optimizer_from(optim, 100)


@pytest.mark.slow
def test_own_data_example_trains_evaluates_saves_and_serves(logs, tmp_path, capsys,
                                                            monkeypatch):
  """experiments/own_data.py's steps at a tiny size: what the doc walks through runs, and
  each step's output is what it says."""
  eval_rows = np.arange(40)
  ranker = own_data.train_ranker(logs, num_steps=20, batch_size=16, seed=0)
  found = own_data.evaluate_ranker(ranker, logs, eval_rows)
  assert not any(k.startswith("bayes_") or k == "auc_gap" for k in found)
  assert 0.0 <= found["auc_mean"] <= 1.0 and np.isfinite(found["logloss"])
  checkpoint.save(str(tmp_path), 20, ranker)
  restored = checkpoint.load(str(tmp_path), 20, ranker)
  jax.tree.map(np.testing.assert_array_equal, eqx.filter(restored, eqx.is_array),
               eqx.filter(ranker, eqx.is_array))
  rank_chunked, chunk_sizes = pf.RankingRunner.rank_chunked, []
  def recorded(self, batch, embeddings, chunk_size):
    chunk_sizes.append(chunk_size)
    return rank_chunked(self, batch, embeddings, chunk_size)
  monkeypatch.setattr(pf.RankingRunner, "rank_chunked", recorded)
  ranked = own_data.serve_one_user(restored, logs, int(eval_rows[0]))
  monkeypatch.undo()
  assert chunk_sizes == [4] and 4 < own_data.CANDIDATES   # chunks of 4, as its line says
  # The runner scores what the training forward scores.
  batch, _, mask = own_data.held_out(logs, eval_rows[:1])
  logits = eqx.filter_jit(lambda s, b: s(b))(ranker, batch)
  np.testing.assert_allclose(np.asarray(ranked.scores)[mask],
                             np.asarray(jax.nn.sigmoid(logits))[mask], atol=1e-5)
  retriever = own_data.train_retriever(logs, num_steps=20, batch_size=16, seed=0)
  recall = own_data.retrieval_recall(retriever, logs, eval_rows, top_k=50)
  assert 0.0 <= recall <= 1.0
  # Users without a held-out favorite are left out: given a favorite no catalogue holds
  # (-1), they would miss it, yet the whole catalogue finds every favorite there is.
  first, has = own_data.held_out_favorite(logs, eval_rows)
  assert not has.all()
  monkeypatch.setattr(own_data, "held_out_favorite",
                      lambda logs, rows: (np.where(has, first, -1), has))
  everything = len(logs.catalogue_post)
  assert own_data.retrieval_recall(retriever, logs, eval_rows, top_k=everything) == 1.0
  monkeypatch.undo()
  # The baseline: the 50 posts favorited most in the training impressions.
  liked = (logs.list_labels[..., 0] > 0) & (np.arange(own_data.CANDIDATES)
                                            < logs.list_len[..., None])
  counts = {}
  for post in logs.list_post[:, :-1][liked[:, :-1]]:
    counts[post] = counts.get(post, 0) + 1
  # At every cut, ties in count go to the lower post id; at 5 the held-out favorites would
  # change the set (they did not).
  for top_k in range(1, 100):
    top = set(sorted(counts, key=lambda p: (-counts[p], p))[:top_k])
    hits = [logs.list_post[u, -1, np.argmax(liked[u, -1])] in top
            for u in eval_rows if liked[u, -1].any()]
    popular = own_data.popularity_recall(logs, eval_rows, top_k=top_k)
    assert popular == pytest.approx(np.mean(hits))
  out = capsys.readouterr().out
  assert "ranker: training loss" in out and "retriever: training loss" in out
  gap = float(out.split("max |p difference| ")[1].split(")")[0])
  assert gap < 1e-5


@pytest.mark.parametrize("flag, message", [
    ("--num_steps=5", "--num_steps=5: use at least 10"),
    ("--batch_size=0", "--batch_size=0: use 1 to 2000"),
    ("--init_scale=0", "--init_scale=0.0: must be a finite number > 0"),
    ("--init_scale=inf", "--init_scale=inf: must be a finite number > 0"),   # (a traceback)
    ("--workdir=", "--workdir is empty"),   # (a traceback from os.makedirs(''))
    ("--workdir= ", "--workdir is empty"),   # (a folder named " ")
    ("--seed=-1", "--seed=-1: use 0 to 2**32 - 1"),
    ("--seed=4294967296", "--seed=4294967296: use 0 to 2**32 - 1"),
    ("--workdir=/proc/own_data", "workdir '/proc/own_data' cannot be written"),
    # an experiments.run run directory, whose checkpoints the example's save would replace
    ("--workdir={run}", "holds a training run (config.json, result.json)")])
def test_own_data_refuses_bad_flags_before_training(flag, message, tmp_path, fork_server):
  run = tmp_path / "run"
  (run / "checkpoint").mkdir(parents=True)
  for name in ("config.json", "result.json", "checkpoint/step_000000200.eqx"):
    (run / name).write_text("{}")
  code, stdout, stderr = fork_server.run("experiments.own_data", [flag.format(run=run)])
  # one line and status 2, as every script's usage errors (not absl's whole help text)
  assert code == 2 and message in stderr, stderr[-2000:]
  assert len(stderr.strip().splitlines()) <= 2, stderr[-2000:]
  assert "ranker:" not in stdout
  assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step_000000200.eqx"]


def test_own_data_flag_bounds_and_a_half_written_run(tmp_path, monkeypatch, capsys):
  """The documented bounds (10 steps, a batch of every user) are accepted, one past them
  refused; a workdir holding only an unfinished run's config.json is refused too."""
  ran = []
  monkeypatch.setattr(own_data, "_run", lambda: ran.append(dict(vars(own_data.FLAGS))))

  def main(**flags):
    defaults = dict(num_steps=600, batch_size=64, workdir=str(tmp_path / "work"), seed=0,
                    init_scale=0.05, logq_correction=True)
    monkeypatch.setattr(own_data, "FLAGS", SimpleNamespace(**{**defaults, **flags}))
    own_data.main(["own_data"])

  main(num_steps=10, batch_size=2000)
  assert [(r["num_steps"], r["batch_size"]) for r in ran] == [(10, 2000)]
  for bad, message in ((dict(num_steps=9), "--num_steps=9: use at least 10"),
                       (dict(batch_size=2001), "--batch_size=2001: use 1 to 2000")):
    with pytest.raises(SystemExit) as e:
      main(**bad)
    assert e.value.code == 2 and message in capsys.readouterr().err
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text("{}")
  with pytest.raises(SystemExit) as e:
    main(workdir=str(run))
  assert e.value.code == 2
  assert "holds a training run (config.json), whose" in capsys.readouterr().err
  # A stray argument (a mistyped flag such as `--num-steps=10` reaches main as one) is a
  # usage error, not a default run.
  for argv in (["own_data", "--num-steps=10"], ["own_data", "a", "b"]):
    with pytest.raises(SystemExit) as e:
      own_data.main(argv)
    assert e.value.code == 2 and "unexpected arguments" in capsys.readouterr().err
  assert len(ran) == 1


def test_fit_warms_up_for_at_least_one_step(monkeypatch):
  """The schedule starts from a learning rate of 0 at every run length: a twentieth of
  the steps, and one step where a twentieth rounds to none."""
  seen = []

  def optimizer_from(optim, num_steps):
    seen.append((num_steps, optim.warmup_steps, optim.learning_rate))
    raise StopIteration
  monkeypatch.setattr(own_data.training, "optimizer_from", optimizer_from)
  for num_steps, learning_rate in ((10, 3e-3), (19, 0.1), (20, 3e-3), (600, 3e-3)):
    with pytest.raises(StopIteration):
      own_data.fit(None, None, None, num_steps, learning_rate)
  assert seen == [(10, 1, 3e-3), (19, 1, 0.1), (20, 1, 3e-3), (600, 30, 3e-3)]


def test_fit_records_the_first_steps_loss_then_every_tenth(monkeypatch):
  """`fit`'s losses, printed as "training loss A -> B": the first step's, taken before
  any update, then the last step's of each tenth of the run."""
  monkeypatch.setattr(own_data.training, "validate_training_batch", lambda *args: None)

  class Weights(eqx.Module):
    w: jax.Array

  def loss_fn(system, target):
    return jnp.sum((system.w - target) ** 2)

  # Step i pulls w towards i + 1: at w = 0 the first step's loss is 3 * 1**2, the second's
  # (the warmup's learning rate 0 left w at 0) 3 * 2**2.
  system, losses = own_data.fit(Weights(jnp.zeros(3)), loss_fn,
                                lambda i: (jnp.full(3, i + 1.0),), 20, 0.1)
  assert len(losses) == 11 and losses[:2] == [3.0, 12.0]
  assert losses[-1] != losses[-2] and np.all(np.asarray(system.w) > 0)


def test_train_retriever_uses_the_logq_counts_only_when_asked(logs, monkeypatch):
  """`logq=True` (`--logq_correction`, the default) trains on the in-batch loss corrected
  by `positive_counts`; `logq=False` on the plain one, a different loss."""
  seen = {}

  def fit(system, loss_fn, batches, num_steps, learning_rate):
    batch = batches(0)
    seen[len(seen)] = system, batch, float(eqx.filter_jit(loss_fn)(system, *batch))
    return system, [0.0]
  monkeypatch.setattr(own_data, "fit", fit)
  for logq in (True, False):
    own_data.train_retriever(logs, num_steps=10, batch_size=16, seed=0, logq=logq)
  counts = jnp.asarray(own_data.positive_counts(logs))
  for (system, (batch, labels, mask), got), counts_KH in zip(seen.values(), (counts, None)):
    want, _, _ = eqx.filter_jit(lambda s: s.in_batch_loss(
        batch, labels, mask, own_data.post_ids(batch), positive_action=own_data.FAVORITE,
        temperature=0.05, sampling_counts_KH=counts_KH))(system)
    assert got == pytest.approx(float(want), rel=1e-5)
  assert seen[0][2] != pytest.approx(seen[1][2], rel=1e-3)


def test_retrieval_recall_checks_each_user_against_their_own_favorite(logs, monkeypatch):
  """A runner that retrieves, for each user, just that user's held-out favorite has recall
  1 at `top_k=1`; one that retrieves the next user's favorite instead, about none."""
  monkeypatch.setattr(own_data, "fit", lambda system, *args: (system, [0.0]))
  retriever = own_data.train_retriever(logs, num_steps=10, batch_size=16, seed=0)
  rows = np.arange(3, 43)
  first, has = own_data.held_out_favorite(logs, rows)
  assert has.sum() > 10 and len(set(first[has].tolist())) > 10
  row_of = {post: i for i, post in enumerate(logs.catalogue_post.tolist())}
  own = np.array([[row_of[post]] for post in first.tolist()], np.int32)
  for found, want in ((own, 1.0), (np.roll(own, 1, axis=0), None)):
    monkeypatch.setattr(pf.RetrievalRunner, "retrieve",
                        lambda self, batch, embeddings, top_k: SimpleNamespace(
                            top_k_post_ids=found))
    got = own_data.retrieval_recall(retriever, logs, rows, top_k=1)
    hits = (first == first[np.roll(np.arange(len(rows)), 1)])[has].mean()
    assert got == (want if want is not None else pytest.approx(hits)) and hits < 0.5


def test_own_data_main_runs_every_step_under_the_workdirs_lock(logs, tmp_path, monkeypatch,
                                                                capsys):
  """`main` at a small size (the module's logs, the training loop stubbed out): each step
  prints its line, the checkpoint is written, `--nologq_correction` reaches the retriever,
  `--init_scale` the ranker's tables, and the workdir's run lock is held while `_run`
  works and released after."""
  workdir = str(tmp_path / "work")
  monkeypatch.setattr(own_data, "FLAGS", SimpleNamespace(
      num_steps=10, batch_size=16, workdir=workdir, seed=0, init_scale=0.3,
      logq_correction=False))
  monkeypatch.setattr(own_data, "make_logs", lambda num_users=2000, seed=0: logs)
  monkeypatch.setattr(own_data, "fit", lambda system, *args: (system, [0.5, 0.25]))
  train_retriever, asked = own_data.train_retriever, []

  def recorded(logs, num_steps, batch_size, seed, init_scale, logq):
    asked.append(logq)
    with pytest.raises(RunInUseError, match="is being trained by another process"):
      lock_run_dir(workdir)
    return train_retriever(logs, num_steps, batch_size, seed, init_scale, logq)
  monkeypatch.setattr(own_data, "train_retriever", recorded)
  train_ranker, rankers = own_data.train_ranker, []
  monkeypatch.setattr(own_data, "train_ranker",
                      lambda *a, **k: rankers.append(train_ranker(*a, **k)) or rankers[-1])
  own_data.main(["own_data"])
  assert asked == [False]
  assert np.std(np.asarray(rankers[0].tables.user_table)) == pytest.approx(0.3, rel=0.05)
  os.close(lock_run_dir(workdir))   # released
  out = capsys.readouterr().out
  for line in ("ranker: training loss 0.5000 -> 0.2500 over 10 steps",
               "ranker on the 120 users' held-out impressions: auc_mean ",
               "written and read back", "serving user ", "retriever: training loss 0.5000",
               "retriever: recall@100 of the held-out favorited post over 400 catalogue "
               "posts", "done in "):
    assert line in out, out
  assert os.listdir(os.path.join(workdir, "checkpoint")) == ["step_000000010.eqx"]


def test_generator_metrics_score_the_held_out_lists_with_the_logs_own_logits(logs):
  """The ceiling line: the made-up logs' true logits, ranked on each user's last list."""
  from phoenix_flax.training import metrics
  rows = np.arange(40)
  _, labels, mask = own_data.held_out(logs, rows)
  L = logs.list_len.shape[1]
  want = metrics.ranking_metrics(logs.list_true_logit[rows, L - 1], labels, None, mask, k=5)
  got = own_data.generator_metrics(logs, rows)
  assert got.keys() == want.keys() and "auc_mean" in got
  for k in want:
    assert got[k] == pytest.approx(float(want[k]), nan_ok=True), k


def test_held_out_is_each_users_last_impression(logs, monkeypatch):
  """Evaluation lists are the impressions training never draws: the last of each user."""
  rows = np.arange(6)
  batch, labels, mask = own_data.held_out(logs, rows)
  L = logs.list_len.shape[1]
  np.testing.assert_array_equal(mask.sum(axis=1), logs.list_len[rows, L - 1])
  np.testing.assert_array_equal(
      batch.candidate_post_hashes[mask],
      pf.hash_ids(logs.list_post[rows, L - 1][mask], own_data.BUCKETS["post"]))
  np.testing.assert_array_equal(labels[mask], logs.list_labels[rows, L - 1][mask])
  # Training draws each of the others.
  drawn, users = [], []
  def record(logs, rows, at):
    drawn.extend(at.tolist())
    users.append(rows.tolist())
  monkeypatch.setattr(own_data, "to_batch", record)
  batches = own_data.training_batches(logs, batch_size=len(logs.user_id) - 10, seed=0)
  for step in range(3):
    batches(step)
  assert sorted(set(drawn)) == list(range(L - 1))
  assert all(len(set(rows)) == len(rows) for rows in users)   # a batch holds no user twice


def test_retrieval_loss_methods_agree():
  """`in_batch_loss` is `contrastive_loss` of the user vectors and each user's first
  favorited candidate, as the candidate tower scores it."""
  logs = own_data.make_logs(num_users=12, num_posts=120, num_authors=10, seed=5)
  config = pf.PhoenixRetrievalModelConfig(model=own_data.TRANSFORMER, emb_size=64,
                                          history_seq_len=own_data.HISTORY,
                                          product_surface_vocab_size=own_data.SURFACES)
  system = training.RetrievalSystem(config, *own_data.BUCKETS.values(), key=jax.random.key(1),
                                    init_scale=0.05)
  batch, labels, mask = own_data.held_out(logs, np.arange(12))
  labels[::3, :, 0] = 0.0   # users without a favorite: no positive, no negative column
  training.validate_training_batch(system, batch, labels, mask)
  ids = np.asarray(own_data.post_ids(batch))
  loss, has_B, _ = eqx.filter_jit(lambda s: s.in_batch_loss(
      batch, labels, mask, ids, positive_action=0, temperature=0.05))(system)
  first = np.argmax((labels[..., 0] > 0) & mask, axis=1)
  np.testing.assert_array_equal(has_B, ((labels[..., 0] > 0) & mask).any(axis=1))
  rows = np.arange(12)
  cand_BCD, _ = eqx.filter_jit(lambda s: s.candidate_representation(batch))(system)
  user_BD = eqx.filter_jit(lambda s: s.user_representation(batch))(system)
  want = system.contrastive_loss(user_BD, cand_BCD[rows, first], has_B, ids[rows, first], 0.05)
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
  assert has_B.any() and not has_B.all()
  # With counts (the logQ correction): each positive's log count, the smaller of its two
  # hash functions', comes off its column.
  counts = np.random.default_rng(0).integers(1, 9, (2, own_data.BUCKETS["post"])).astype(
      np.float32)
  loss, _, _ = eqx.filter_jit(lambda s: s.in_batch_loss(
      batch, labels, mask, ids, positive_action=0, temperature=0.05,
      sampling_counts_KH=counts))(system)
  hashes = np.asarray(batch.candidate_post_hashes)[rows, first]
  log_q = np.log(np.minimum(counts[0, hashes[:, 0]], counts[1, hashes[:, 1]]))
  want = system.contrastive_loss(user_BD, cand_BCD[rows, first], has_B, ids[rows, first], 0.05,
                                 log_q)
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)


def test_post_ids_tell_apart_posts_that_share_a_hash(logs):
  """The retriever's loss drops another user's positive from a user's negatives when it is
  the same post: posts that share their first hash (a third of the catalogue) but not the
  second are different posts (the first hash used to serve as the id)."""
  hashes = np.asarray(pf.hash_ids(logs.catalogue_post, own_data.BUCKETS["post"]))
  _, first_of, counts = np.unique(hashes[:, 0], return_inverse=True, return_counts=True)
  shared = np.flatnonzero(counts[first_of] > 1)
  assert shared.size > 0
  a = shared[0]
  b = next(i for i in shared[1:] if hashes[i, 0] == hashes[a, 0])
  batch = pf.RecsysBatch(*[None] * len(pf.RecsysBatch._fields))._replace(
      candidate_post_hashes=hashes[[a, b, a]][None])
  ids = np.asarray(own_data.post_ids(batch))[0]
  assert ids[0] != ids[1] and ids[0] == ids[2]
  # Swapped hashes, or hashes with the same sum, are other posts too.
  batch = batch._replace(candidate_post_hashes=np.array([[[1, 5], [5, 1], [2, 4]]], np.int32))
  assert len(set(np.asarray(own_data.post_ids(batch))[0].tolist())) == 3
  # The second hash counts in post buckets: (1, 4097) and (2, 1) are two posts.
  batch = batch._replace(candidate_post_hashes=np.array([[[1, 4097], [2, 1]]], np.int32))
  ids = np.asarray(own_data.post_ids(batch))[0]
  assert ids[0] != ids[1] and ids.tolist() == [own_data.BUCKETS["post"] + 4097,
                                               2 * own_data.BUCKETS["post"] + 1]


def test_positive_counts_count_each_training_impressions_first_favorite(logs):
  """The count sketch the example's logQ correction uses: per hash function, the number
  of training impressions (all but each user's last) whose first favorited candidate
  hashes to each bucket. Favorited is the loss's rule, a label above one half: a soft
  label of 0.3 before the favorite neither counts nor hides the favorite (it did, and
  the loss's positive, counted 0 times, made the logQ-corrected loss NaN)."""
  labels = logs.list_labels.copy()
  fav = labels[..., own_data.FAVORITE]
  fav[(fav == 0) & (np.arange(own_data.CANDIDATES) % 3 == 0)] = 0.3
  logs = logs._replace(list_labels=labels)
  got = own_data.positive_counts(logs)
  want = np.zeros_like(got)
  liked = (logs.list_labels[..., own_data.FAVORITE] > 0.5) & (
      np.arange(own_data.CANDIDATES) < logs.list_len[..., None])
  for u in range(liked.shape[0]):
    for impression in range(liked.shape[1] - 1):
      if liked[u, impression].any():
        post = logs.list_post[u, impression, np.argmax(liked[u, impression])]
        for k, h in enumerate(np.asarray(pf.hash_ids(np.array([post]),
                                                     own_data.BUCKETS["post"]))[0]):
          want[k, h] += 1
  np.testing.assert_array_equal(got, want)
  assert got.sum() > 0
  retriever = own_data.train_retriever(logs, num_steps=10, batch_size=16, seed=0, logq=True)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(eqx.filter(retriever, eqx.is_array)))
  assert 0.0 <= own_data.retrieval_recall(retriever, logs, np.arange(40), top_k=50) <= 1.0


def test_the_docs_history_per_impression_snippet_cuts_each_history_before_it():
  """docs/own_data.md, "One history per impression", run as written on a random log: each
  impression's history is the user's newest S engagements strictly before it, oldest
  first, padding (hash 0) after them."""
  import re
  with open(os.path.join(REPO, "docs", "own_data.md"), encoding="utf-8") as f:
    text = f.read()
  section = text[text.index("### One history per impression"):]
  block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  rng = np.random.default_rng(0)
  n, S = 300, 6
  ev_user = rng.integers(0, 12, n)
  ev_time = rng.integers(0, 50, n)
  order = np.lexsort((ev_time, ev_user))       # sorted by user, then time
  ev_user, ev_time = ev_user[order], ev_time[order]
  ev_post = rng.integers(1, 10**12, n)
  scope = dict(np=np, pf=pf, ev_user=ev_user, ev_time=ev_time, ev_post=ev_post,
               ev_author=rng.integers(1, 10**9, n), ev_actions=rng.integers(0, 2, (n, 19)),
               ev_surface=rng.integers(0, 16, n), imp_user=rng.integers(0, 14, 200),
               imp_time=rng.integers(0, 55, 200), S=S, post_buckets=4096, author_buckets=512)
  exec(compile(block, "docs/own_data.md:history", "exec"), scope)
  rows, valid = scope["rows"], scope["valid"]
  for i, (u, t) in enumerate(zip(scope["imp_user"], scope["imp_time"])):
    want = [j for j in range(n) if ev_user[j] == u and ev_time[j] < t][-S:]
    assert rows[i][valid[i]].tolist() == want
    assert valid[i].tolist() == [True] * len(want) + [False] * (S - len(want))
  hashes = np.asarray(scope["history_post_hashes"])
  np.testing.assert_array_equal(hashes, np.asarray(pf.hash_ids(ev_post[rows], 4096,
                                                               valid=valid)))
  assert np.all((hashes == 0) == ~valid[..., None]) and valid.any() and not valid.all()
