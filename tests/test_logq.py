"""The retriever's logQ correction (`retrieval.logq_correction`): the loss's column shift,
the streaming counts, their place in the training state and in checkpoints. (Its config
checks are cases of `OUT_OF_RANGE` in tests/test_training.py; 8 devices against one, in
tests/test_multidevice.py.)"""

from __future__ import annotations

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.configs import retrieval as retrieval_configs
from phoenix_flax.training import Trainer, checkpoint, run_experiment
from phoenix_flax.training.loop import unstack
from phoenix_flax.training.loss import (in_batch_softmax_loss, sampling_log_q,
                                        update_sampling_counts)
from phoenix_flax.training.runner import load_checkpoint
from phoenix_flax.training.schema import parse_config
from phoenix_flax.training.system import RetrievalSystem


def logq_config(**train):
  c = retrieval_configs.get_config("smoke")
  c.retrieval.logq_correction = True
  c.train.update(train)
  return c


def test_the_correction_subtracts_each_columns_log_frequency():
  rng = np.random.default_rng(0)
  scores = rng.normal(size=(5, 5)).astype(np.float32)
  valid = np.array([True, True, False, True, True])
  ids = np.array([3, 4, 5, 3, 6])
  # The invalid user's log q is -inf (a zero count): it must reach neither its own row
  # nor any column.
  log_q = np.array([0.5, -1.0, -np.inf, 2.0, 0.0], np.float32)
  t = 0.1
  logits = scores / t - np.where(valid, log_q, 0.0)[None, :]
  expected = []
  for b in np.flatnonzero(valid):
    cols = [j for j in range(5) if j == b or (valid[j] and ids[j] != ids[b])]
    expected.append(np.log(np.exp(logits[b, cols]).sum()) - logits[b, b])
  got = in_batch_softmax_loss(scores, valid, t, ids, log_q)
  assert np.isfinite(float(got))
  np.testing.assert_allclose(got, np.mean(expected), rtol=1e-5)
  # Nor does it reach the gradient: the same as with a finite value in its place.
  grad = lambda q: jax.grad(in_batch_softmax_loss)(jnp.asarray(scores), valid, t, ids, q)
  np.testing.assert_array_equal(grad(log_q), grad(np.where(valid, log_q, 7.0)))
  # Only the differences between columns matter: a constant log q changes nothing.
  plain = in_batch_softmax_loss(scores, valid, t, ids)
  np.testing.assert_allclose(in_batch_softmax_loss(scores, valid, t, ids, np.full(5, -3.0)),
                             plain, rtol=1e-6)
  with pytest.raises(AssertionError, match="log_q"):
    in_batch_softmax_loss(scores, valid, t, ids, log_q[:4])


def test_sampling_counts_decay_and_count_every_present_positive():
  counts = np.zeros((2, 6), np.float32)
  hashes = np.array([[1, 2], [3, 2], [1, 4], [5, 5]])     # [B, K]: posts 0 and 2 are one post
  present = np.array([True, True, True, False])
  once = update_sampling_counts(counts, hashes, present, 0.5)
  np.testing.assert_array_equal(once, [[0, 2, 0, 1, 0, 0], [0, 0, 2, 0, 1, 0]])
  twice = update_sampling_counts(once, hashes, present, 0.5)
  np.testing.assert_array_equal(twice, [[0, 3, 0, 1.5, 0, 0], [0, 0, 3, 0, 1.5, 0]])
  # The estimate is each post's smallest count over its hash functions: post 1 shares
  # bucket 2 of the second function with post 0, but not its bucket 3 of the first.
  np.testing.assert_allclose(sampling_log_q(twice, hashes[:2]), np.log([3.0, 1.5]))
  assert sampling_log_q(twice, np.array([[5, 5]]))[0] == -np.inf   # never counted
  # A hash outside the sketch's 6 buckets counts nowhere and reads a count of 0 (not the
  # clamped last bucket, another post's count).
  ones = np.ones((2, 6), np.float32)
  outside = update_sampling_counts(ones, np.array([[1, 6]]), np.array([True]), 1.0)
  np.testing.assert_array_equal(outside - ones, [[0, 1, 0, 0, 0, 0], [0] * 6])
  assert sampling_log_q(outside, np.array([[1, 6]]))[0] == -np.inf
  with pytest.raises(AssertionError, match="present must be"):
    update_sampling_counts(counts, hashes, present[:3], 0.5)
  with pytest.raises(AssertionError, match="hashes must be"):
    update_sampling_counts(counts, hashes[:, :1], present, 0.5)


def test_the_counted_positive_is_the_first_unmasked_one():
  """`positive_hashes` picks what `in_batch_loss` trains on: a positive label on a masked
  (padded) slot counts for nothing, so user 0's positive is slot 2, and user 1 has none."""
  labels = np.zeros((2, 3, 2), np.float32)
  labels[0, 0, 1] = labels[0, 2, 1] = labels[1, 1, 1] = 1.0
  mask = np.array([[False, True, True], [True, False, True]])
  hashes = jnp.asarray([[[11, 12], [21, 22], [31, 32]], [[41, 42], [51, 52], [61, 62]]])
  batch = type("Batch", (), {"candidate_post_hashes": hashes})()
  got, has = RetrievalSystem.positive_hashes(batch, labels, mask, positive_action=1)
  assert np.asarray(got)[0].tolist() == [31, 32]
  assert np.asarray(has).tolist() == [True, False]


def test_training_counts_the_positives_of_every_step_and_corrects_the_loss():
  """After a chunk, the state's count sketch is the decayed sum of every step's positives
  under each post hash function; each step's loss is the in-batch loss with the smaller of
  a positive's counts, logged, as its log q."""
  spec = parse_config(logq_config())
  trainer = Trainer(spec)
  r, n = spec.config.retrieval, spec.config.train.steps_per_call
  start = unstack(trainer.init([0]), 0)
  K, H = spec.world.num_item_hashes, spec.world.post_buckets
  assert start.sampling_counts.shape == (K, H)
  assert Trainer(parse_config(retrieval_configs.get_config("smoke"))).init(
      [0]).sampling_counts is None                      # off: no state, as before

  # Counts as after earlier steps, uneven, so that the first step's log q differs
  # between posts (from zero counts, a step's positives are mostly counted once each).
  seeded = np.random.default_rng(0).uniform(1, 50, (K, H))
  start = eqx.tree_at(lambda s: s.sampling_counts, start, jnp.asarray(seeded, jnp.float32))
  sample = eqx.filter_jit(trainer.sample_train_batch)
  expected = seeded.copy()
  first_loss = None
  for i in range(n):
    sb = sample(trainer.world, eqx.tree_at(lambda s: s.step, start, jnp.int32(i)))
    hashes, has = RetrievalSystem.positive_hashes(sb.batch, sb.labels, sb.candidate_mask,
                                                  positive_action=r.positive_action)
    assert np.asarray(has).any()
    expected *= r.logq_decay
    for k in range(K):
      np.add.at(expected[k], np.asarray(hashes)[np.asarray(has), k], 1.0)
    if i == 0:
      system = trainer.system(start.params)
      user, _ = system.user_forward(sb.batch)
      at = (np.arange(len(hashes)), np.argmax(
          (np.asarray(sb.labels)[..., r.positive_action] > 0) & np.asarray(sb.candidate_mask),
          axis=1))
      positive = system.corpus_representation(np.asarray(sb.batch.candidate_post_hashes)[at],
                                              np.asarray(sb.batch.candidate_author_hashes)[at])
      h = np.asarray(hashes)
      log_q = np.log(np.where(has, np.minimum(expected[0, h[:, 0]], expected[1, h[:, 1]]), 1.0))
      first_loss = in_batch_softmax_loss(system.model.scores(user, positive), has,
                                         r.temperature, np.asarray(sb.candidate_post_ids)[at],
                                         log_q)
  stacked = trainer.init([0])
  stacked = eqx.tree_at(lambda s: s.sampling_counts, stacked,
                        jnp.asarray(seeded[None], jnp.float32))
  state, stats = trainer.train_chunk(stacked)
  np.testing.assert_allclose(np.asarray(state.sampling_counts[0]), expected, rtol=1e-5)
  np.testing.assert_allclose(float(stats["loss"][0, 0]), float(first_loss), rtol=1e-5)
  plain = Trainer(parse_config(retrieval_configs.get_config("smoke")))
  _, plain_stats = plain.train_chunk(plain.init([0]))
  assert abs(float(plain_stats["loss"][0, 0]) - float(first_loss)) > 0.01


def test_a_resumed_run_restores_the_counts_and_ends_as_an_uninterrupted_one(tmp_path):
  config = logq_config(num_steps=20, checkpoint_every=10, eval_every=10)
  want = run_experiment(config, str(tmp_path / "whole"))
  run_dir = str(tmp_path / "resumed")
  run_experiment(config, run_dir)
  os.remove(os.path.join(run_dir, "result.json"))     # as if killed after step 10's
  os.remove(os.path.join(run_dir, "checkpoint", f"step_{20:09d}.eqx"))
  assert checkpoint.available_steps(run_dir) == [10]
  trainer = Trainer(parse_config(config))
  state, _ = load_checkpoint(trainer, run_dir, 10)
  assert np.asarray(state.sampling_counts).sum() > 0
  got = run_experiment(config, run_dir)
  assert got[0]["steps"] == 20 and got[0]["final"] == want[0]["final"]
