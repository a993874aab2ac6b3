"""Training systems, losses, optimizer, score consistency, and whole runs of run.py."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import (REPO, float32_ulp, max_abs_diff, rounding, session_end_status,
                      shared_draws, subprocess_env)
from experiments.configs import ranking as ranking_configs
from experiments.configs import retrieval as retrieval_configs
import phoenix_flax as pf
from phoenix_flax.retrieval import CandidateTower
from phoenix_flax.synthetic import make_world, post_features, sample_batch
from phoenix_flax.training import (ConfigError, HashEmbeddingTables, RankingSystem, Trainer,
                                   first_positive, in_batch_softmax_loss, make_optimizer,
                                   make_schedule, make_system, parse_config, ranking_loss)
from phoenix_flax.training import checkpoint, metrics, provenance, runner, schema
from phoenix_flax.training.loss import binary_cross_entropy, is_positive
from phoenix_flax.training.loop import (_over_seeds, eval_keys, forward_with_new_companions,
                                        mix_companions, popularity_keys, popularity_scores,
                                        unstack)
from phoenix_flax.training.runner import (_evaluations_after, _resume_steps, _train_scalars,
                                          load_run, metric_names)
from phoenix_flax.training.schema import (base_config, check_config, seed_config,
                                          split_config, with_defaults)
from phoenix_flax.training.writers import read_metrics


def smoke_config(**train):
  c = ranking_configs.get_config("smoke")
  c.train.update(train)
  return c


def test_hash_tables_padding_is_zero_and_gets_no_gradient():
  tables = HashEmbeddingTables(5, 7, 3, 4, key=jax.random.PRNGKey(0))
  for table in (tables.user_table, tables.post_table, tables.author_table):
    assert not np.any(np.asarray(table[0])) and np.all(np.asarray(table[1:]) != 0)
  # Each table draws from its own key: no row is another table's same row.
  user, post, author = (np.asarray(t[1:3]) for t in (tables.user_table, tables.post_table,
                                                      tables.author_table))
  assert not np.any(user == post) and not np.any(user == author) and not np.any(post == author)
  hashes = jnp.array([[0, 2], [4, 0]])
  post, _ = tables.post_embeddings(hashes, hashes % 3)
  assert np.all(np.asarray(post[0, 0]) == 0) and np.all(np.asarray(post[1, 1]) == 0)
  np.testing.assert_allclose(post[0, 1], tables.post_table[2])
  # A linear loss: row 0 would get a gradient of 1 per padded slot without the mask.
  grads = jax.grad(lambda t: jnp.sum(t.post_embeddings(hashes, hashes % 3)[0]))(tables)
  assert np.all(np.asarray(grads.post_table[0]) == 0)
  assert np.any(np.asarray(grads.post_table[2]) != 0)
  with pytest.raises(ValueError, match="post_buckets"):
    HashEmbeddingTables(5, 1, 3, 4, key=jax.random.PRNGKey(0))


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_a_systems_model_and_tables_draw_from_their_own_keys(task):
  """The model's arrays are no rescaled copies of the tables' draws: with the tables' key,
  the element-wise partitioned threefry gives the model's first arrays the tables' numbers
  (a correlation of 1 on their common prefix)."""
  spec = parse_config(_overridden(task, {}))
  system = eqx.filter_jit(lambda key: make_system(spec, key))(jax.random.PRNGKey(0))
  tables = (system.tables.user_table, system.tables.post_table, system.tables.author_table)
  arrays = [x for x in jax.tree.leaves(eqx.filter(system.model, eqx.is_array))
            if np.ndim(x) == 2 and np.unique(np.asarray(x)).size > 2]
  assert len(arrays) >= 4
  for t in tables:
    for a in arrays:
      assert shared_draws(t, a) < 0.3


def test_a_seeds_config_is_one_seeds_run():
  """What a seed's config.json holds: that seed, one seed, everything else as given, and
  the run's config left as it was."""
  c = base_config("ranking")
  c.num_seeds, c.seed = 3, 7
  before = c.to_dict()
  single = seed_config(c, 8)
  assert (single.seed, single.num_seeds) == (8, 1)
  assert c.to_dict() == before
  assert {**single.to_dict(), "seed": 7, "num_seeds": 3} == before


def test_the_documented_initialization_timeout_is_the_default():
  """docs/training.md gives the multi-host join's default wait in seconds."""
  with open(os.path.join(os.path.dirname(__file__), "..", "docs", "training.md")) as f:
    text = f.read()
  stated = re.search(r"`--config\.mesh\.initialization_timeout` seconds \((\d+);", text)
  assert stated, "docs/training.md no longer states the default wait"
  assert base_config("ranking").mesh.initialization_timeout == int(stated.group(1)) == 300


def test_hash_tables_take_numpy_integer_sizes_and_refuse_an_empty_embedding():
  """Bucket counts hinted `int` accept NumPy integers (as `hash_ids` does); a zero
  `emb_size` built `[N, 0]` tables that looked up empty vectors without an error."""
  tables = HashEmbeddingTables(np.int64(5), 7, np.int32(3), 4, key=jax.random.PRNGKey(0))
  assert tables.user_table.shape == (5, 4) and tables.author_table.shape == (3, 4)
  with pytest.raises(ValueError, match="emb_size=0"):
    HashEmbeddingTables(5, 7, 3, 0, key=jax.random.PRNGKey(0))
  for scale in (0.0, float("inf"), float("nan"), "1", True):   # inf built tables of +-inf
    with pytest.raises(ValueError, match=f"init_scale={scale!r} must be a finite number"):
      HashEmbeddingTables(5, 7, 3, 4, key=jax.random.PRNGKey(0), init_scale=scale)


def test_retrieval_system_user_tower_needs_no_candidates():
  """The user tower reads no candidate field, so a context-only batch (as
  `RetrievalRunner.encode_user` sends) gives the same user vectors."""
  spec = parse_config(retrieval_configs.get_config("smoke"))
  system = eqx.filter_jit(lambda key: make_system(spec, key))(jax.random.PRNGKey(0))
  world = make_world(spec.world, jax.random.PRNGKey(1))
  batch = jax.jit(sample_batch, static_argnums=(1, 2))(world, spec.train_split, 3,
                                                       jax.random.PRNGKey(2)).batch
  no_candidates = batch._replace(candidate_post_hashes=None, candidate_author_hashes=None,
                                 candidate_product_surface=None,
                                 candidate_post_timestamps=None)
  users = eqx.filter_jit(lambda s, b: s.user_representation(b))
  np.testing.assert_array_equal(users(system, no_candidates), users(system, batch))
  assert system.tables(no_candidates).candidate_post_embeddings is None
  # Serving with a corpus mask: what it leaves out is never retrieved.
  hashes = jnp.arange(1, 41).reshape(20, 2)
  corpus = system.corpus_representation(hashes, hashes % 7 + 1)
  top = eqx.filter_jit(lambda s, b, c, m: s(b, c, 3, m))
  free = np.unique(np.asarray(top(system, no_candidates, corpus, None).top_k_indices))
  mask = np.ones(20, bool)
  mask[free] = False
  kept = np.asarray(top(system, no_candidates, corpus, jnp.asarray(mask)).top_k_indices)
  assert mask[kept].all(), (free, kept)
  # Half a candidate (one hash field None) is refused by name, not dropped or a TypeError.
  for given, other in (("candidate_post_hashes", "candidate_author_hashes"),
                       ("candidate_author_hashes", "candidate_post_hashes")):
    half = batch._replace(**{other: None})
    for call in (system.tables, system.user_representation):
      with pytest.raises(ValueError, match=f"batch.{given} is given but the other candidate "
                                           "hash field is None"):
        call(half)


def test_losses_refuse_shapes_that_would_broadcast():
  # Each of these used to broadcast into a loss on another scale, without an error.
  logits, labels = jnp.zeros((2, 3, 19)), jnp.ones((2, 3, 19))
  with pytest.raises(AssertionError, match="mask"):
    ranking_loss(logits, labels, jnp.ones((2, 1)))
  with pytest.raises(AssertionError, match="labels"):
    ranking_loss(logits, jnp.ones((3, 19)), jnp.ones((2, 3)))
  with pytest.raises(AssertionError, match="action_weights"):
    ranking_loss(logits, labels, jnp.ones((2, 3)), jnp.ones((1,)))
  # Weights given as values are checked too: these gave NaN or -0.0 without a word (1e39
  # and a sum of 1e-40 passed a check of finite, >= 0 and a positive sum made in float64,
  # and the float32 loss was NaN).
  for bad in ((0.0,) * 19, (1.0, np.nan) + (1.0,) * 17, (1.0, -1.0) + (1.0,) * 17,
              (1e39,) + (1.0,) * 18, (1e-40,) + (0.0,) * 18):
    with pytest.raises(ValueError, match=r"action_weights must lie in \[0, 1e\+06\] and sum "
                                         r"to at least 1.18e-38"):
      ranking_loss(logits, labels, jnp.ones((2, 3)), np.asarray(bad, np.float64))
  assert np.isfinite(ranking_loss(logits, labels, jnp.ones((2, 3)),
                                  np.asarray((1e6,) + (1e-6,) * 18)))   # the bounds hold
  scores = jnp.ones((4, 4))
  with pytest.raises(AssertionError, match="positive_ids"):
    in_batch_softmax_loss(scores, jnp.ones(4, bool), 0.05, jnp.zeros(1, jnp.int32))
  with pytest.raises(AssertionError, match="valid"):
    in_batch_softmax_loss(scores, jnp.ones(1, bool), 0.05)
  with pytest.raises(AssertionError, match="scores"):   # one row per user, one column per positive
    in_batch_softmax_loss(jnp.ones((4, 3)), jnp.ones(4, bool), 0.05)


def test_is_positive_takes_labels_of_every_dtype_above_one_half():
  """Booleans as they are, integers from 1 up, floats (soft labels) strictly above one
  half: what comparing with 0.5 under JAX's standard promotion decides, without the
  integer-to-float conversion that the session's strict promotion refuses."""
  for labels in (jnp.array([True, False]), jnp.array([-1, 0, 1, 2], jnp.int32),
                 np.array([0, 1, 3], np.uint8), jnp.array([0.0, 0.5, 0.500001, 1.0]),
                 jnp.array([0.25, 0.5, 0.75], jnp.bfloat16)):
    with jax.numpy_dtype_promotion("standard"):
      want = jnp.asarray(labels) > 0.5
    got = is_positive(labels)
    assert got.dtype == bool, labels
    np.testing.assert_array_equal(got, want, err_msg=str(labels))


def test_ranking_loss_is_weighted_masked_bce():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 4)).astype(np.float32)
  labels = (rng.random((2, 3, 4)) < 0.4).astype(np.float32)
  mask = np.array([[True, True, False], [True, False, False]])
  w = np.array([1.0, 0.0, 2.0, 1.0], np.float32)
  bce = np.logaddexp(0, logits) - labels * logits
  expected = (bce * w * mask[..., None]).sum() / (mask.sum() * w.sum())
  np.testing.assert_allclose(ranking_loss(logits, labels, mask, w), expected, rtol=1e-5)
  # The weights are relative: scaling them all leaves the loss as it is (down to 1e-12,
  # where a floor of 1e-9 on count * sum(w) made it 10 times too small).
  for scale in (3.0, 1e-9, 1e-12):
    np.testing.assert_allclose(ranking_loss(logits, labels, mask, scale * w), expected,
                               rtol=1e-5)
  np.testing.assert_allclose(ranking_loss(logits, labels, mask),
                             bce[mask].mean(), rtol=1e-5)


def test_losses_ignore_padded_logits_and_take_limits_at_infinite_ones():
  """Padded candidates are selected out (NaN or -inf there leaves loss and gradient as
  without them), and an infinite logit gives the BCE's limit, never NaN, in the training
  loss and the log-loss metric."""
  rng = np.random.default_rng(2)
  x = rng.normal(size=(64,)).astype(np.float32) * 5
  y = (rng.random(64) < 0.5).astype(np.float32)
  np.testing.assert_array_equal(binary_cross_entropy(x, y),
                                optax.sigmoid_binary_cross_entropy(x, y))
  # Integer or boolean labels (under the suite's strict promotion) give the loss of the
  # same labels as floats, in the logits' dtype.
  for labels in (y.astype(np.int32), y.astype(bool)):
    np.testing.assert_array_equal(binary_cross_entropy(x, jnp.asarray(labels)),
                                  binary_cross_entropy(x, y))
  assert binary_cross_entropy(jnp.asarray(x, jnp.bfloat16), y).dtype == jnp.bfloat16
  # Its gradient in the labels is -logit, at labels 0 and 1 as in between (for labels that
  # are learned); replacing the terms of those labels by constants cut it there.
  soft = jnp.asarray(np.where(np.arange(64) % 3 == 0, 0.5, y), jnp.float32)
  np.testing.assert_allclose(jax.grad(lambda l: binary_cross_entropy(x, l).sum())(soft), -x,
                             rtol=1e-5, atol=1e-6)
  labels = jnp.array([[[1.0], [0.0], [1.0]]])
  mask = jnp.array([[True, True, False]])
  want = float(ranking_loss(jnp.array([[[0.5], [-1.0], [0.0]]]), labels, mask))
  for pad in (np.nan, np.inf, -np.inf):
    logits = jnp.array([[[0.5], [-1.0], [pad]]])
    for loss in (ranking_loss, metrics.log_loss):   # the log-loss metric selects too
      np.testing.assert_allclose(float(loss(logits, labels, mask)), want, rtol=1e-6)
    grad = jax.grad(lambda l: ranking_loss(l, labels, mask))(logits)
    assert np.all(np.isfinite(grad)) and float(grad[0, 2, 0]) == 0.0, (pad, grad)
  bce = lambda l, y: float(binary_cross_entropy(jnp.float32(l), jnp.float32(y)))
  assert bce(np.inf, 1.0) == bce(-np.inf, 0.0) == 0.0
  assert bce(np.inf, 0.0) == bce(-np.inf, 1.0) == bce(np.inf, 0.5) == np.inf
  # The metric: an agreeing infinite logit adds 0, a disagreeing one makes it +inf.
  logits = jnp.array([[[np.inf], [-1.0], [-np.inf]]])
  np.testing.assert_allclose(float(metrics.log_loss(logits, labels, mask)),
                             float(jax.nn.softplus(-1.0)) / 2, rtol=1e-6)
  assert float(metrics.log_loss(-logits, labels, mask)) == np.inf
  one = jnp.ones((1, 1), bool)
  assert float(ranking_loss(jnp.full((1, 1, 1), np.inf), jnp.ones((1, 1, 1)), one)) == 0.0
  # An action weighted 0 is dropped as a padded candidate is, gradient included.
  w = jnp.array([0.0, 1.0])
  for bad in (np.inf, np.nan):
    logits = jnp.array([[[bad, 0.0]]])
    loss, grad = jax.value_and_grad(ranking_loss)(logits, jnp.array([[[0.0, 1.0]]]), one, w)
    np.testing.assert_allclose(float(loss), np.log(2), rtol=1e-6)
    assert np.all(np.isfinite(grad)) and float(grad[0, 0, 0]) == 0.0


def test_losses_compute_in_float32_whatever_the_input_dtype():
  """bfloat16 logits or scores (a model of the user's own) give the loss of the same values
  in float32: the losses cast before any arithmetic."""
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.normal(size=(4, 8, 3)) * 5, jnp.bfloat16)
  labels = jnp.asarray(rng.random((4, 8, 3)) < 0.3, jnp.float32)
  mask = jnp.ones((4, 8), bool)
  bce = jax.jit(ranking_loss)
  assert float(bce(logits, labels, mask)) == float(bce(logits.astype(jnp.float32), labels,
                                                       mask))
  scores = jnp.asarray(rng.uniform(-1, 1, (16, 16)), jnp.bfloat16)
  valid = jnp.ones(16, bool)
  softmax = jax.jit(in_batch_softmax_loss, static_argnums=2)
  assert float(softmax(scores, valid, 0.05)) == float(softmax(scores.astype(jnp.float32),
                                                              valid, 0.05))


def test_in_batch_softmax_loss_excludes_invalid_users_and_duplicate_posts():
  rng = np.random.default_rng(1)
  user = rng.normal(size=(4, 3)).astype(np.float32)
  pos = rng.normal(size=(4, 3)).astype(np.float32)
  valid = np.array([True, True, False, True])
  ids = np.array([7, 8, 9, 7])
  t = 0.5
  logits = user @ pos.T / t
  expected = []
  for b in (0, 1, 3):
    cols = [j for j in range(4) if j == b or (valid[j] and ids[j] != ids[b])]
    expected.append(np.log(np.exp(logits[b, cols]).sum()) - logits[b, b])
  got = in_batch_softmax_loss(user @ pos.T, valid, t, ids)
  np.testing.assert_allclose(got, np.mean(expected), rtol=1e-5)
  # Excluded columns stay out at any temperature: a user scoring its own positive below
  # an excluded one still has loss 0 when nothing else is left.
  u, p = np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([[-1.0, 0.0], [-1.0, 0.0]])
  for temperature in (0.05, 1e-10):
    assert float(in_batch_softmax_loss(u @ p.T, np.array([True, False]), temperature)) == 0.0
  # An invalid user's row contributes nothing, whatever it holds: a non-finite score
  # there leaves the loss and the gradient of every score finite.
  scores = user @ pos.T
  broken = scores.copy()
  broken[2, 1], broken[2, 2] = np.nan, np.inf
  loss = lambda s: in_batch_softmax_loss(s, valid, t, ids)
  assert float(loss(broken)) == float(loss(scores))
  grad = np.asarray(jax.grad(loss)(jnp.asarray(broken)))
  assert np.all(np.isfinite(grad)) and np.all(grad[2] == 0)
  np.testing.assert_array_equal(grad[valid], np.asarray(jax.grad(loss)(scores))[valid])
  labels = np.zeros((2, 3, 2), np.float32)
  labels[0, 2, 1] = labels[0, 1, 1] = 1
  idx, has = first_positive(labels, np.ones((2, 3), bool), action=1)
  assert idx.tolist()[0] == 1 and has.tolist() == [True, False]
  labels[1, 0, 1] = 1                                   # engaged, but a padded slot
  idx, has = first_positive(labels, np.array([[True, False, True], [False, True, True]]), 1)
  assert idx.tolist()[0] == 2 and has.tolist() == [True, False]


def test_losses_of_a_batch_with_nothing_to_learn_are_zero_not_nan():
  """A ranking batch without a valid candidate, or a retrieval batch where no user has a
  positive, has loss 0 and gradient 0 (a NaN there would end the seed as diverged); and an
  eager call under `jax_debug_nans`, invalid users included, meets no NaN on the way."""
  rng = np.random.default_rng(4)
  logits = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
  labels = jnp.ones((2, 3, 4))
  none = jnp.zeros((2, 3), bool)
  loss, grad = jax.value_and_grad(ranking_loss)(logits, labels, none)
  assert float(loss) == 0.0 and not np.any(np.asarray(grad))
  scores = jnp.asarray(rng.normal(size=(4, 4)), jnp.float32)
  for temperature in (0.05, 1.0):
    loss, grad = jax.value_and_grad(in_batch_softmax_loss)(scores, jnp.zeros(4, bool),
                                                           temperature)
    assert float(loss) == 0.0 and not np.any(np.asarray(grad)), temperature
  valid = jnp.array([True, False, True, True])
  want = jax.jit(jax.value_and_grad(in_batch_softmax_loss), static_argnums=2)(scores, valid,
                                                                             0.5)
  with jax.debug_nans(True):
    got = jax.value_and_grad(in_batch_softmax_loss)(scores, valid, 0.5)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-7)


def test_a_soft_label_is_a_positive_above_one_half_for_the_loss_and_the_metrics():
  """Own data may carry soft labels in [0, 1]: the retrieval loss's positive and every
  metric's agree on which count (above 0.5), so a 0.3 is no positive for either."""
  labels = np.zeros((1, 3, 1), np.float32)
  labels[0, :, 0] = [0.3, 0.7, 1.0]
  mask = np.ones((1, 3), bool)
  idx, has = first_positive(labels, mask, action=0)
  assert idx.tolist() == [1] and has.tolist() == [True]
  assert first_positive(np.minimum(labels, 0.5), mask, action=0)[1].tolist() == [False]
  scores = np.array([3.0, 1.0, 2.0], np.float32)       # the 0.3 scored highest
  assert float(metrics.roc_auc(scores, labels[0, :, 0], mask[0])[0]) == 0.0
  assert float(metrics.recall_at_k(scores[None], labels[..., 0] > 0.5, mask, 1)) == 0.0
  # ranking_metrics reads the labels by the same rule (the generator's probabilities too).
  found = metrics.ranking_metrics(scores[None, :, None], labels, scores[None, :, None] / 4,
                                  mask, k=1)
  for key in ("auc_mean", "list_auc", "recall@1", "bayes_recall@1"):
    assert float(found[key]) == 0.0, key


# (name, task, config overrides): the smoke configs, and an idea with parameters of its own
# switched on (README, "Adding an idea", step 6).
GRADIENT_CASES = [
    ("ranking", "ranking", {}),
    ("retrieval", "retrieval", {}),
    ("ranking_pre_norm", "ranking", {"model.norm_layout": "pre"}),
    ("retrieval_mean_pool", "retrieval", {"model.enable_linear_proj": False}),
    # the post-age feature's table, the one optional feature the synthetic world feeds
    ("ranking_post_age", "ranking", {"world.post_age": True,
                                     "model.post_age_granularity_mins": 60}),
]


def test_every_retrieval_switch_is_set_in_a_gradient_case():
  """Step 6 of adding an idea: a retrieval switch (`RETRIEVAL_SWITCHES` of
  tests/test_retrieval.py: every `PhoenixRetrievalModelConfig` field that export refuses
  away from its default, a new one included) is set away from its default by a retrieval
  case of GRADIENT_CASES. Its parameters are read only by the retrieval model's own code
  (a learned temperature in `scores`, say), which no ranking case runs, and written where
  not every path scores (in `retrieve`, say) they would never train, which only the test
  below sees."""
  from test_ranking import _field_default
  from test_retrieval import RETRIEVAL_SWITCHES
  cases = [overrides for _, task, overrides in GRADIENT_CASES if task == "retrieval"]
  for field in sorted(RETRIEVAL_SWITCHES):
    default = _field_default(pf.PhoenixRetrievalModelConfig, field)
    assert any(o.get(f"model.{field}", default) != default for o in cases), (
        f"PhoenixRetrievalModelConfig.{field} is set away from its default ({default!r}) by "
        "no retrieval case of GRADIENT_CASES (tests/test_training.py)")


def _parameters_added(case_name: str, field: str) -> set[str]:
  """The parameters (tree paths) of grid case `case_name`'s ranking model
  (tests/test_ranking.py) that the same case with `field` at its default lacks."""
  from test_ranking import GRID, _grid_case
  def paths(cfg):
    shapes = eqx.filter_eval_shape(pf.PhoenixModel, cfg, key=jax.random.PRNGKey(0))
    return {jax.tree_util.keystr(p) for p, leaf in jax.tree_util.tree_leaves_with_path(shapes)
            if isinstance(leaf, jax.ShapeDtypeStruct)}
  without = {k: v for k, v in GRID[case_name].items() if k != field}
  return (paths(_grid_case(case_name)[0]["dense"])
          - paths(_grid_case(case_name, without)[0]["dense"]))


def test_every_ranking_switch_with_parameters_of_its_own_is_in_a_gradient_case():
  """Step 6 of adding an idea: a ranking switch (a field of `GRID_SWITCHES`,
  tests/test_ranking.py) whose setting in a grid case gives the model parameters it lacks
  at the default (a QK-norm's scales, say) is set away from its default by a ranking case
  of GRADIENT_CASES, so that the test below sees whether the training loss reaches them."""
  from test_ranking import GRID, GRID_SWITCHES, _field_default
  # (the check sees parameters that a field adds: the post-age feature's table)
  assert any("post_age_embedding_table" in p
             for p in _parameters_added("post_age_dwell_continuous_no_user",
                                        "post_age_granularity_mins"))
  cases = [overrides for _, task, overrides in GRADIENT_CASES if task == "ranking"]
  for cls in (pf.TransformerConfig, pf.PhoenixModelConfig):
    for field in sorted(GRID_SWITCHES[cls]):
      default = _field_default(cls, field)
      added = set().union(*(_parameters_added(name, field) for name, case in GRID.items()
                            if case.get(field, default) != default))
      assert not added or any(o.get(f"model.{field}", default) != default for o in cases), (
          f"{cls.__name__}.{field} adds parameters ({sorted(added)}) but no ranking case of "
          "GRADIENT_CASES (tests/test_training.py) sets it away from its default")


@pytest.mark.parametrize("task, overrides", [case[1:] for case in GRADIENT_CASES],
                         ids=[case[0] for case in GRADIENT_CASES])
def test_every_parameter_gets_a_gradient_from_the_training_loss(task, overrides):
  """An idea's parameter that the loss never reaches (a branch written in the model but not
  in every path that scores, such as a retrieval scoring change outside
  `PhoenixRetrievalModel.scores`) would keep its initial value while its arm reads "no
  significant difference"."""
  trainer = Trainer(parse_config(_overridden(task, overrides)))
  state = unstack(trainer.init([0]), 0)
  sb = eqx.filter_jit(trainer.sample_train_batch)(trainer.world, state)
  grads = eqx.filter_jit(jax.grad(lambda p: trainer._loss(p, sb)[0]))(state.params)
  dead = [jax.tree_util.keystr(path) for path, g in jax.tree_util.tree_leaves_with_path(grads)
          if not np.any(np.asarray(g))]
  assert not dead, f"parameters with an all-zero gradient: {dead}"


def test_retrieval_evaluation_loss_groups_users_as_training_does():
  """At the smoke preset (batch 8, evaluation batches of 16) `eval/loss` is the mean, over
  users with a positive, of the in-batch loss within each group of 8 users, not over 16."""
  spec = parse_config(retrieval_configs.get_config("smoke"))
  trainer = Trainer(spec)
  system = trainer.system(unstack(trainer.init([0]), 0).params)

  def losses(system, key):   # jitted below (eagerly, every small op compiles on its own)
    sb = trainer._sample_eval(trainer.world, spec.eval_splits["eval"], key)
    user_BD, _ = system.user_forward(sb.batch)
    cand_BCD, _ = system.candidate_representation(sb.batch)
    groups = [trainer._retrieval_loss(system, jax.tree.map(lambda x: x[g], sb), user_BD[g],
                                      cand_BCD[g]) for g in (slice(0, 8), slice(8, 16))]
    return (trainer._eval_retrieval_loss(system, sb, user_BD, cand_BCD)[0], groups,
            trainer._retrieval_loss(system, sb, user_BD, cand_BCD)[0])

  # A fresh jit each time: the config is read when tracing.
  traced = lambda: eqx.filter_jit(lambda *args: losses(*args))(system, jax.random.PRNGKey(3))
  got, groups, whole = traced()
  total = sum(float(loss) * float(has.sum()) for loss, has in groups)
  count = sum(float(has.sum()) for _, has in groups)
  np.testing.assert_allclose(float(got), total / count, rtol=1e-5)
  assert whole > got   # more users to contrast: a higher loss
  spec.config.train.batch_size = 6   # no whole number of groups: the whole batch
  np.testing.assert_allclose(float(traced()[0]), float(whole), rtol=1e-6)


def test_retrieval_training_loss_runs_the_candidate_tower_on_positives_only(monkeypatch):
  """The training loss gathers each user's first positive before the candidate tower; loss
  and gradients equal those of the tower run on every candidate and gathered after."""
  spec = parse_config(retrieval_configs.get_config("smoke"))
  trainer = Trainer(spec)
  state = unstack(trainer.init([0]), 0)
  sb = eqx.filter_jit(trainer.sample_train_batch)(trainer.world, state)

  def reference(params, sb):
    system = trainer.system(params)
    user_BD, _ = system.user_forward(sb.batch)
    cand_BCD, _ = system.candidate_representation(sb.batch)
    return trainer._retrieval_loss(system, sb, user_BD, cand_BCD)[0]

  grad = lambda f: eqx.filter_jit(jax.value_and_grad(f))(state.params, sb)
  seen = []    # the candidate tower's input shapes, recorded while tracing
  tower = CandidateTower.__call__
  monkeypatch.setattr(CandidateTower, "__call__",
                      lambda self, x: seen.append(x.shape) or tower(self, x))
  got, got_g = grad(lambda p, b: trainer._loss(p, b)[0])
  B = spec.config.train.batch_size
  assert [s[:-2] for s in seen] == [(1, B)], seen    # B items, not B x C candidates
  monkeypatch.undo()
  want, want_g = grad(reference)
  assert float(want) > 0
  np.testing.assert_allclose(got, want, rtol=rounding(1e-6))
  # Two programs of one computation: each gradient within 16 float32 ulps of its largest
  # entry (jax 0.8.0 left the post table's, of largest 11.45, 3.0e-6 apart: 2.2 ulps).
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    assert max_abs_diff(g, w) <= 16 * float32_ulp(w), g.shape


def test_retrieval_evaluation_loss_is_the_mean_over_all_users_with_a_positive():
  """`eval/loss` pools the evaluation batches by their users with a positive (a batch
  with fewer of them counts less), as the ranking loss pools candidates."""
  spec = parse_config(retrieval_configs.get_config("smoke"))
  trainer = Trainer(spec)
  state = trainer.init([0])
  got = float(trainer.evaluate(state)["eval/loss"][0])
  system = trainer.system(unstack(state, 0).params)

  @eqx.filter_jit
  def group_losses(system, key):
    sb = trainer._sample_eval(trainer.world, spec.eval_splits["eval"], key)
    user_BD, _ = system.user_forward(sb.batch)
    cand_BCD, _ = system.candidate_representation(sb.batch)
    return [trainer._retrieval_loss(system, jax.tree.map(lambda x: x[g], sb), user_BD[g],
                                    cand_BCD[g]) for g in (slice(0, 8), slice(8, 16))]

  per_batch = [group_losses(system, key) for key in eval_keys(spec.config)]
  sums = [sum(float(loss) * float(has.sum()) for loss, has in b) for b in per_batch]
  counts = [sum(float(has.sum()) for _, has in b) for b in per_batch]
  np.testing.assert_allclose(got, sum(sums) / sum(counts), rtol=1e-5)
  # The batches differ in size and loss, so the unweighted mean of their means is another
  # figure: the check above tells the two apart.
  unweighted = np.mean([s / c for s, c in zip(sums, counts)])
  assert abs(unweighted - got) > 1e-3 * got, (counts, sums)


def test_retrieval_recall_is_the_mean_over_the_users_with_a_positive():
  """`eval/recall@K`: per evaluation user with a positive, the share of its positives whose
  post is among the K best-scored corpus items (a brute-force sort here), averaged over
  those users of every batch; users without a positive count for nothing. `eval/auc` and
  `eval/bayes_auc` pool every valid candidate of those batches, labelled by the positive
  action (here not the default one), scored by the model and by its true probability."""
  cfg = retrieval_configs.get_config("smoke")
  cfg.model.fprop_dtype = "float32"        # (bfloat16 scores, the GPU default, tie often)
  cfg.retrieval.positive_action = 1
  spec = parse_config(cfg)
  trainer = Trainer(spec)
  state = trainer.init([0])
  got = trainer.evaluate(state)
  system = trainer.system(unstack(state, 0).params)
  a, N = spec.config.retrieval.positive_action, spec.world.num_posts

  @eqx.filter_jit
  def scores(system, key):
    sb = trainer._sample_eval(trainer.world, spec.eval_splits["eval"], key)
    post_h, author_h, _ = post_features(trainer.world, jnp.arange(N))
    user_BD, _ = system.user_forward(sb.batch)
    corpus_ND = system.corpus_representation(post_h, author_h)
    positive = (sb.labels[..., a] > 0) & sb.candidate_mask
    cand_BCD, _ = system.candidate_representation(sb.batch)
    own_BC = jnp.einsum("bd,bcd->bc", user_BD, cand_BCD)
    return (user_BD @ corpus_ND.T, sb.candidate_post_ids, positive, own_BC,
            sb.probs[..., a], sb.candidate_mask)

  per_user = {k: [] for k in spec.config.retrieval.recall_k}
  without = 0
  pooled = {"own": [], "probs": [], "positive": []}
  for key in eval_keys(spec.config):
    s_BN, ids_BC, positive_BC, own_BC, probs_BC, mask_BC = map(np.asarray,
                                                               scores(system, key))
    pooled["own"].append(own_BC[mask_BC])
    pooled["probs"].append(probs_BC[mask_BC])
    pooled["positive"].append(positive_BC[mask_BC])
    for s_N, ids_C, pos_C in zip(s_BN, ids_BC, positive_BC):
      if not pos_C.any():
        without += 1
        continue
      for k in per_user:
        top = set(np.argsort(-s_N, kind="stable")[:k])
        per_user[k].append(np.mean([i in top for i in ids_C[pos_C]]))
  assert without > 0     # the check tells a mean over every user apart
  for k, values in per_user.items():
    assert float(got[f"eval/recall@{k}"][0]) == pytest.approx(np.mean(values), rel=1e-5), k
  pooled = {name: np.concatenate(parts) for name, parts in pooled.items()}
  for name, key in (("own", "eval/auc"), ("probs", "eval/bayes_auc")):
    pos, neg = pooled[name][pooled["positive"]], pooled[name][~pooled["positive"]]
    diff = pos[:, None].astype(np.float64) - neg[None, :]
    want = np.mean((diff > 0) + 0.5 * (diff == 0))
    assert float(got[key][0]) == pytest.approx(want, abs=2e-5), key


def test_the_evaluations_references_are_computed_once_per_trainer():
  """The oracle's and the popularity list's hits depend on the world and the fixed
  evaluation batches alone: computed at the first evaluation, then reused by every
  evaluation of every seed, with the same metrics as computed afresh."""
  spec = parse_config(retrieval_configs.get_config("smoke"))
  trainer = Trainer(spec)
  calls = []
  compute = trainer._references
  trainer._references = lambda world: calls.append(1) or compute(world)
  state = trainer.init([0, 1])
  first = trainer.evaluate(state)
  state, _ = trainer.train_chunk(state)
  second = trainer.evaluate(state)
  assert len(calls) == 1
  fresh = Trainer(spec).evaluate(state)
  for key in ("eval/bayes_recall@10", "eval/popularity_recall@10", "eval/recall@10"):
    np.testing.assert_array_equal(second[key], fresh[key], err_msg=key)
  np.testing.assert_array_equal(first["eval/bayes_recall@10"], second["eval/bayes_recall@10"])


def test_training_and_evaluation_run_under_debug_nans():
  """A user chasing a NaN of their own switches `jax_debug_nans` on: the training chunks
  make no NaN, and the evaluation, whose undefined metrics are NaN by design (the smoke
  preset's actions without a positive), runs with the check off instead of raising."""
  spec = parse_config(smoke_config())
  trainer = Trainer(spec)
  with jax.debug_nans(True):
    state, stats = trainer.train_chunk(trainer.init([0]))
    out = jax.device_get(trainer.evaluate(state))
    assert jax.config.jax_debug_nans
  assert np.isfinite(stats["loss"]).all()
  undefined = [k for k, v in out.items() if np.isnan(v).any()]
  assert "eval/auc/report_score" in undefined, undefined


def test_popularity_recall_ranks_the_corpus_by_the_training_splits_positives():
  """`eval/popularity_recall@K`: the recall of one list for every user, the corpus ranked
  by how many positives each post has in `train.eval_batches` training-split batches
  (`popularity_keys`); posts tied with the K-th share its places. It depends on no
  parameter, so every seed reads the same. (Training lists of random posts only here, so
  that ranking by the evaluation split's positives would read otherwise.)"""
  config = retrieval_configs.get_config("smoke")
  config.train_split.relevant_fraction = 0.0
  spec = parse_config(config)
  keys = lambda fn: {tuple(k) for k in np.asarray(fn(spec.config)).tolist()}
  assert not keys(popularity_keys) & keys(eval_keys)   # counted on other lists
  trainer = Trainer(spec)
  got = trainer.evaluate(trainer.init([0, 1]))
  a, N = spec.config.retrieval.positive_action, spec.world.num_posts
  B = spec.config.train.eval_batch_size
  draw = eqx.filter_jit(lambda key, split: sample_batch(trainer.world, split, B, key))
  counts = np.zeros(N)
  for key in popularity_keys(spec.config):
    sb = draw(key, spec.train_split)
    positive = (np.asarray(sb.labels)[..., a] > 0) & np.asarray(sb.candidate_mask)
    np.add.at(counts, np.asarray(sb.candidate_post_ids)[positive], 1.0)
  np.testing.assert_array_equal(
      popularity_scores(trainer.world, spec.train_split, B, a, popularity_keys(spec.config)),
      counts)
  with jax.enable_x64(True):   # (its post indices were int64 there, the drawn ids int32)
    np.testing.assert_array_equal(
        popularity_scores(trainer.world, spec.train_split, B, a, popularity_keys(spec.config)),
        counts)
  for k in spec.config.retrieval.recall_k:
    kth = np.sort(counts)[::-1][k - 1]
    share = (k - np.sum(counts > kth)) / np.sum(counts == kth)
    in_top = np.where(counts > kth, 1.0, np.where(counts == kth, share, 0.0))
    per_user = []
    for key in eval_keys(spec.config):
      sb = trainer._sample_eval(trainer.world, spec.eval_splits["eval"], key)
      positive = (np.asarray(sb.labels)[..., a] > 0) & np.asarray(sb.candidate_mask)
      ids = np.asarray(sb.candidate_post_ids)
      per_user += [in_top[ids[b][positive[b]]].mean() for b in range(B) if positive[b].any()]
    values = np.asarray(got[f"eval/popularity_recall@{k}"])
    assert values[0] == values[1]
    assert float(values[0]) == pytest.approx(np.mean(per_user), rel=1e-5), k


def test_weight_decay_skips_hash_tables_and_norms():
  spec = parse_config(smoke_config())
  opt = make_optimizer(spec)

  @eqx.filter_jit
  def second_update(key):
    params = eqx.filter(make_system(spec, key), eqx.is_array)
    zero = jax.tree.map(jnp.zeros_like, params)
    _, state = opt.update(zero, opt.init(params), params)   # step 0: warmup lr is 0
    return opt.update(zero, state, params)[0]               # zero grads: only decay acts

  updates = second_update(jax.random.PRNGKey(0))
  # Decoupled decay alone: -lr(1) * weight_decay * w, with the config's weight decay.
  o = spec.config.optim
  params = eqx.filter(make_system(spec, jax.random.PRNGKey(0)), eqx.is_array)
  np.testing.assert_allclose(updates.model.unembeddings,
                             -float(make_schedule(spec)(1)) * o.weight_decay
                             * np.asarray(params.model.unembeddings), rtol=1e-5, atol=1e-12)
  # Adam's moments after one step of a gradient below the clip norm: (1-b1) g, (1-b2) g^2.
  grads = jax.tree.map(jnp.zeros_like, params)
  grads = eqx.tree_at(lambda p: p.model.unembeddings, grads,
                      jnp.full_like(params.model.unembeddings, 1e-3))
  _, state = jax.jit(opt.update)(grads, opt.init(params), params)
  (adam,) = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
      x, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
  np.testing.assert_allclose(adam.mu.model.unembeddings, (1 - o.b1) * 1e-3, rtol=1e-5)
  np.testing.assert_allclose(adam.nu.model.unembeddings, (1 - o.b2) * 1e-6, rtol=1e-5)
  assert o.b1 != o.b2
  assert np.all(np.asarray(updates.tables.post_table) == 0)
  assert np.all(np.asarray(updates.model.final_norm.scale) == 0)
  assert np.all(np.asarray(updates.model.transformer.layers.norm_attn_in.scale) == 0)
  assert np.any(np.asarray(updates.model.unembeddings) != 0)
  assert np.any(np.asarray(updates.model.transformer.layers.dense.out.weight) != 0)


@pytest.mark.slow
def test_score_consistency_is_zero_with_isolation_only():
  world = eqx.filter_jit(make_world)(parse_config(smoke_config()).world,
                                    jax.random.PRNGKey(0))
  moved = {}
  for isolation in (True, False):
    cfg = smoke_config()
    cfg.model.candidate_isolation = isolation
    spec = parse_config(cfg)
    system = eqx.filter_jit(lambda k: RankingSystem(spec.model, 256, 512, 64, key=k))(
        jax.random.PRNGKey(1))
    sb = jax.jit(sample_batch, static_argnums=(1, 2))(world, spec.train_split, 6,
                                                      jax.random.PRNGKey(2))
    out, _, total, count = eqx.filter_jit(forward_with_new_companions)(
        system, sb.batch, sb.candidate_mask)
    assert out.logits.shape == (6, 4, 19)
    moved[isolation] = float(total) / float(count)
  assert moved[True] == 0.0
  assert moved[False] > 1e-4
  # Padded slots (hash 0, here the last) count for nothing: neither their own logit
  # changes nor what they hold (masked keys) moves the figure.
  C = sb.candidate_mask.shape[1]
  last_C = jnp.arange(C) == C - 1
  mask_BC = sb.candidate_mask & ~last_C[None, :]
  padded = lambda shift: sb.batch._replace(
      candidate_post_hashes=jnp.where(last_C[None, :, None], 0, sb.batch.candidate_post_hashes),
      candidate_author_hashes=jnp.where(last_C[None, :, None],
                                        shift + sb.batch.candidate_author_hashes,
                                        sb.batch.candidate_author_hashes))
  found = [eqx.filter_jit(forward_with_new_companions)(system, padded(shift), mask_BC)[2:]
           for shift in (0, 7)]
  assert int(found[0][1]) == int(mask_BC.sum()) * 19
  assert float(found[0][0]) > 0
  assert float(found[0][0]) == float(found[1][0])
  keep = jnp.array([True, False, True, False])
  mixed = mix_companions(sb.batch, keep)
  np.testing.assert_array_equal(mixed.candidate_post_hashes[1, 1],
                                sb.batch.candidate_post_hashes[0, 1])
  np.testing.assert_array_equal(mixed.candidate_post_hashes[1, 0],
                                sb.batch.candidate_post_hashes[1, 0])


def test_evaluation_pools_diagnostics_and_score_consistency_over_batches():
  """The evaluation's `score_consistency` is the mean |logit change| per valid
  (candidate, action) over all its batches (of the primary split only), `loss` the
  training loss (action weights included) over every valid candidate of them,
  `residual_rms/layer_i` layer i's RMS averaged over the batches and `max_attn_logit` the
  maximum over batches and layers (`max_attn_logit/layer_i` over batches): checked
  against forwards of each evaluation batch run one by one."""
  cfg = ranking_configs.get_config("smoke")
  cfg.model.candidate_isolation = False     # companions move the scores
  cfg.model.num_layers = 2
  cfg.train.eval_batches = 3                # 3 batches, 2 layers: the axes differ
  cfg.model.fprop_dtype = "float32"         # the GPU default rounds each program its way
  weights = np.linspace(0.0, 2.0, 19)       # action 0 weighted 0
  cfg.train.action_weights = tuple(float(w) for w in weights)
  cfg.extra_eval_splits.short = split_config(max_history=2)
  trainer = Trainer(parse_config(cfg))
  state = trainer.init([0])
  got = {k: float(v[0]) for k, v in trainer.evaluate(state).items()}
  system = trainer.system(unstack(state.params, 0))
  sample = jax.jit(sample_batch, static_argnums=(1, 2))
  forward = eqx.filter_jit(lambda s, b: s.forward(b))
  split = trainer.spec.eval_splits["eval"]
  moved = count = loss = 0.0
  rms, max_logit = [], []
  for key in eval_keys(trainer.spec.config):
    sb = sample(trainer.world, split, cfg.train.eval_batch_size, key)
    out, diag = forward(system, sb.batch)
    rms.append(np.asarray(diag.residual_rms))
    max_logit.append(np.asarray(diag.max_abs_attn_logit))
    logits = np.asarray(out.logits, np.float64)
    C = logits.shape[1]
    even = np.arange(C) % 2 == 0
    for keep in (even, ~even):          # each slot re-scored among new companions
      new = np.asarray(forward(system, mix_companions(sb.batch, keep))[0].logits, np.float64)
      valid = np.asarray(sb.candidate_mask) & keep[None, :]
      moved += np.abs(new - logits)[valid].sum()
    count += np.asarray(sb.candidate_mask).sum() * logits.shape[-1]
    y = np.asarray(sb.labels, np.float64)
    bce = np.logaddexp(0.0, logits) - y * logits
    loss += (bce * weights)[np.asarray(sb.candidate_mask)].sum()
  assert moved > 0
  assert got["eval/score_consistency"] == pytest.approx(moved / count, rel=1e-4)
  assert "short/logloss" in got and "short/score_consistency" not in got
  valid = count / logits.shape[-1]
  assert got["eval/loss"] == pytest.approx(loss / (valid * weights.sum()), rel=1e-5)
  rms_L = np.mean(rms, axis=0)
  assert rms_L.shape == (2,) and abs(rms_L[0] - rms_L[1]) > 1e-3
  for layer, value in enumerate(rms_L):
    assert got[f"eval/residual_rms/layer_{layer}"] == pytest.approx(value, rel=1e-5)
  assert not any(k.startswith("eval/residual_rms/layer_2") for k in got)
  assert got["eval/max_attn_logit"] == pytest.approx(np.max(max_logit), rel=1e-5)
  for layer, value in enumerate(np.max(max_logit, axis=0)):   # per layer, as train/ logs it
    assert got[f"eval/max_attn_logit/layer_{layer}"] == pytest.approx(value, rel=1e-5)


def test_bad_config_values_name_the_field():
  for path, value, match in (("optim.learning_rate", -1.0, "optim.learning_rate"),
                             ("train.steps_per_call", 7, "train.steps_per_call"),
                             ("train.action_weights", (1.0, 2.0), "train.action_weights"),
                             ("world.num_users", 0, "config.world"),
                             ("eval_split.max_history", 99, "config.eval_split"),
                             ("model.norm_layout", "middle", "norm_layout")):
    c = smoke_config()
    section, field = path.split(".")
    c[section][field] = value
    with pytest.raises(ConfigError, match=match):
      parse_config(c)
  for path, value, match in (("train.action_weights", (1.0,) * 19, "leave it None"),
                             ("retrieval.recall_k", (5, 5), "distinct integers")):
    c = retrieval_configs.get_config("smoke")
    section, field = path.split(".")
    c[section][field] = value
    with pytest.raises(ConfigError, match=match):
      parse_config(c)


def test_a_training_state_beyond_memory_is_refused_before_anything_is_written(
    tmp_path, monkeypatch):
  """A hash table of 2e9 rows (357.6 GiB with its AdamW moments) failed in XLA's
  allocator with an out-of-memory error that named no field, after the run directory was
  made; now it is refused first, naming the field. The accounting is exact: parameters,
  both AdamW moments and the world, per seed, a sharded table split over the mesh."""
  c = smoke_config()
  c.world.post_buckets = 2_000_000_000
  # The host's memory on CPU; on an accelerator its own ("more than a NVIDIA H200's memory").
  with pytest.raises(ConfigError, match=r"needs at least 357\.6 GiB, more than (this host|a .+)'s "
                                        r"memory .*config\.world\.post_buckets=2000000000 "
                                        r"rows of 16 floats"):
    pf.training.run_experiment(c, str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")

  c.world.post_buckets = 2**14   # the largest part, as a table the size of a real one's
  spec = parse_config(c)
  world = eqx.filter_eval_shape(make_world, spec.world, jax.random.PRNGKey(0))
  shaped = lambda x: isinstance(x, jax.ShapeDtypeStruct)
  leaves = lambda tree: sum(x.size * x.dtype.itemsize
                            for x in jax.tree.leaves(tree, is_leaf=shaped) if shaped(x))
  params = eqx.filter_eval_shape(make_system, spec, jax.random.PRNGKey(0))
  # The parameters and AdamW's two moments; the step counters, key and flags add < 64 B.
  tables = [3 * leaves(t) for t in (params.tables.user_table, params.tables.post_table,
                                    params.tables.author_table)]
  state = leaves(world) + 3 * leaves(params)
  assert tables[1] > state / 2
  placement = lambda n, shard: type("P", (), {"num_devices": n, "shard_hash_tables": shard})
  limit = lambda b: monkeypatch.setattr(runner, "_memory_of_a_device", lambda: (b, "RAM"))
  limit(state + 64)
  runner.check_memory(spec, placement(1, False))
  limit(state - 1)
  with pytest.raises(ConfigError, match="more than RAM .* the largest part is the post table"):
    runner.check_memory(spec, placement(1, False))
  sharded = state - sum(tables) + sum(t // 8 for t in tables)   # on each of 8 devices
  limit(sharded + 64)
  runner.check_memory(spec, placement(8, True))
  with pytest.raises(ConfigError, match="shard the tables over the mesh"):
    runner.check_memory(spec, placement(8, False))
  limit(sharded - 1)
  with pytest.raises(ConfigError, match="lower the world's bucket counts$"):
    runner.check_memory(spec, placement(8, True))
  # Each vmapped seed holds its own parameters and moments (the world is shared) ...
  c4 = copy.deepcopy(c)   # (the spec holds `c` itself)
  c4.num_seeds = 4
  seeds4 = parse_config(c4)
  limit(leaves(world) + 4 * 3 * leaves(params) + 4 * 64)
  runner.check_memory(seeds4, placement(1, False))
  limit(leaves(world) + 4 * 3 * leaves(params) - 1)
  with pytest.raises(ConfigError, match="for 4 seeds"):
    runner.check_memory(seeds4, placement(1, False))
  # ... and simulated CPU devices each hold a copy in the one host memory.
  monkeypatch.setattr(runner.jax, "local_device_count", lambda: 8)
  limit(8 * (state + 64))
  runner.check_memory(spec, placement(8, False))
  limit(8 * state - 1)
  with pytest.raises(ConfigError, match="more than RAM"):
    runner.check_memory(spec, placement(8, False))
  # Where the world, held once whatever the seeds, is the largest part, fewer seeds
  # cannot help: not offered.
  big_world = copy.deepcopy(c4)
  big_world.world.num_users = 20_000_000
  limit(1 << 20)
  with pytest.raises(ConfigError, match=r"the largest part is the synthetic world") as raised:
    runner.check_memory(parse_config(big_world), placement(1, False))
  assert "fewer seeds" not in str(raised.value), str(raised.value)
  limit(None)   # a backend that does not say: nothing is refused
  runner.check_memory(spec, placement(1, False))


def test_unknown_and_missing_config_paths_are_refused():
  """A misspelled key in a config file (which no command-line lock catches) is an error
  naming it, with the field it was probably meant to be, not a run with the default."""
  c = smoke_config()
  c.optim.lr = 5.0
  c.train.num_stepz = 7
  c.bogus_section = 1
  with pytest.raises(ConfigError, match=r"config has no field\(s\) 'bogus_section', 'optim.lr', "
                     r"'train.num_stepz' \(did you mean train.num_steps\?\)"):
    parse_config(c)
  c = smoke_config()
  del c["train"]
  with pytest.raises(ConfigError, match=r"config lacks \['train.action_weights', "):
    parse_config(c)
  for section, key in (("model", None), ("extra_eval_splits", None), ("model", "fprop_dtype"),
                       ("model", "embedding_init_scale")):
    c = smoke_config()
    del (c if key is None else c[section])[key or section]
    lacks = f"'{section}'" if key is None else rf"\['{section}.{key}'\]"
    for check in (parse_config, check_config):   # (check_config reads model.fprop_dtype)
      with pytest.raises(ConfigError, match=f"config lacks {lacks}: build configs on"):
        check(c)
  c = smoke_config()
  c.extra_eval_splits.short = 3
  with pytest.raises(ConfigError, match="extra_eval_splits.short=3 is invalid: must be a section"):
    parse_config(c)
  with pytest.raises(ConfigError, match="must be an ml_collections.ConfigDict, got dict"):
    parse_config(smoke_config().to_dict())


@pytest.mark.parametrize("task, path, value", [("ranking", "retrieval.temperature", 0.5),
                                               ("retrieval", "ranking.top_k", (3,))])
def test_the_other_tasks_section_is_refused_unless_at_its_defaults(task, path, value):
  with pytest.raises(ConfigError, match=rf"config.{path}=.* is invalid: only .* runs read it "
                                        rf"and this is a {task} run"):
    parse_config(_overridden(task, {path: value}))
  default = base_config("retrieval" if task == "ranking" else "ranking")
  section, field = path.split(".")
  parse_config(_overridden(task, {path: list(default[section][field])
                                  if isinstance(value, tuple) else default[section][field]}))


def _overridden(task, overrides):
  c = (ranking_configs if task == "ranking" else retrieval_configs).get_config("smoke")
  for path, value in overrides.items():
    *sections, field = path.split(".")
    node = c
    for section in sections:
      node = node[section]
    node[field] = value
  return c


# (task, overrides, the message): each value is just outside what its field allows.
OUT_OF_RANGE = [
    ("ranking", {"optim.b1": 1.0}, r"optim.b1=1.0 is invalid: must be in \[0, 1\)"),
    ("ranking", {"optim.end_lr_fraction": 1.5}, "optim.end_lr_fraction=1.5 is invalid"),
    ("ranking", {"optim.warmup_steps": -1}, "optim.warmup_steps=-1 is invalid"),
    ("ranking", {"optim.grad_clip_norm": 0.0}, "optim.grad_clip_norm=0.0 is invalid"),
    ("ranking", {"model.embedding_init_scale": 0.0}, "model.embedding_init_scale=0.0 is invalid"),
    ("ranking", {"train.eval_batch_size": 1}, "train.eval_batch_size=1 is invalid: must be >= 2"),
    ("ranking", {"train.eval_every": 15}, "train.eval_every=15 is invalid"),
    ("ranking", {"train.checkpoint_every": 5}, "train.checkpoint_every=5 is invalid"),
    ("ranking", {"train.action_weights": (0.0,) * 19}, "train.action_weights"),
    ("ranking", {"train.action_weights": (1e39,) + (1.0,) * 18},
     r"train.action_weights=\(1e\+39, 1.0, .*in \[0, 1e\+06\]"),
    ("ranking", {"train.action_weights": (1e-9,) * 19}, r"with a sum >= 1e-6"),
    ("ranking", {"train.action_weights": (1.0,) * 20}, r"train.action_weights=\(1.0, .*19"),
    ("retrieval", {"train.batch_size": 1}, "train.batch_size=1 is invalid: retrieval needs"),
    ("ranking", {"retrieval.positive_action": 19}, "retrieval.positive_action=19 is invalid"),
    ("retrieval", {"retrieval.positive_action": 19}, "retrieval.positive_action=19 is invalid"),
    ("retrieval", {"retrieval.positive_action": -1}, "retrieval.positive_action=-1 is invalid"),
    ("retrieval", {"retrieval.recall_k": (5, 401)}, r"retrieval.recall_k=\(5, 401\) is invalid: "
     "K must be at most world.num_posts=400"),
    ("ranking", {"retrieval.recall_k": (401,)}, r"retrieval.recall_k=\(401,\) is invalid: only"),
    ("ranking", {"seed": 2**32},
     r"seed=4294967296 is invalid: must be an integer in \[0, 2\*\*32\)"),
    ("ranking", {"world_seed": -1}, r"world_seed=-1 is invalid"),
    ("ranking", {"eval_seed": 2**64}, r"eval_seed=18446744073709551616 is invalid"),
    ("ranking", {"eval_seed": 0}, r"eval_seed=0 is invalid: must differ from world_seed"),
    ("ranking", {"seed": 2**32 - 2, "num_seeds": 3}, r"num_seeds=3 is invalid: seeds "
     "4294967294..4294967296 pass"),
    ("ranking", {"optim.warmup_steps": 40}, "optim.warmup_steps=40 is invalid: must be below "
     "train.num_steps=40"),
    ("ranking", {"ranking.top_k": (0, 3)}, r"ranking.top_k=\(0, 3\) is invalid"),
    ("ranking", {"ranking.top_k": (3, 3)}, r"ranking.top_k=\(3, 3\) is invalid: give one or "
     "more distinct"),
    ("ranking", {"ranking.top_k": ()}, r"ranking.top_k=\(\) is invalid"),
    ("ranking", {"mesh.num_devices": -2}, "mesh.num_devices=-2 is invalid"),
    ("ranking", {"mesh.num_devices": 0}, "mesh.num_devices=0 is invalid"),
    ("ranking", {"mesh.distributed": True, "mesh.coordinator_address": "localhost"},
     "mesh.coordinator_address='localhost' is invalid: use 'host:port'"),
    *[("ranking", {"mesh.distributed": True, "mesh.coordinator_address": address},
       f"mesh.coordinator_address='{address}' is invalid: use 'host:port' \\(a port in "
       "1..65535\\)")   # 'localhost:abc' crashed the process in gRPC, not a refusal
      for address in ("localhost:abc", "localhost:", "localhost:99999", ":1234",
                      "10.0.0.1:0", "10.0.0.1:65536",
                      "localhost:\u0661\u0662\u0663\u0664")],   # digits int() reads
    ("ranking", {"num_seeds": 2, "output.seed_subdirs": False},
     "output.seed_subdirs=False is invalid: False needs num_seeds=1"),
    ("ranking", {"num_seeds": 2, "output.seed_subdirs": 0},   # 0 == False let it through
     r"output.seed_subdirs=0 is invalid: must be None \(auto\), True or False"),
    # the run's own scalar groups (eval/, train/, perf/) are no split's
    *[("ranking", {f"extra_eval_splits.{name}": split_config()},
       f"extra_eval_splits='{name}' is invalid") for name in ("eval", "train", "perf")],
    *[("ranking", {f"extra_eval_splits.{name}": split_config()},   # (metric names' parts)
       f"extra_eval_splits='{name}' is invalid: split names are identifiers")
      for name in ("9x", "long/lists", "long lists")],
    ("ranking", {"task": "ranker"}, "config.task='ranker' is invalid"),
    ("ranking", {"optim.b2": 1.0}, r"optim.b2=1.0 is invalid: must be in \[0, 1\)"),
    ("ranking", {"optim.eps": 0.0}, "optim.eps=0.0 is invalid: must be >= 1e-30"),
    ("ranking", {"optim.eps": 1e-37}, "optim.eps=1e-37 is invalid: must be >= 1e-30"),
    ("ranking", {"optim.learning_rate": 0.0}, "optim.learning_rate=0.0 is invalid"),
    ("ranking", {"optim.weight_decay": -0.1}, "optim.weight_decay=-0.1 is invalid"),
    ("ranking", {"train.num_steps": 0}, "train.num_steps=0 is invalid"),
    ("ranking", {"train.batch_size": 0}, "train.batch_size=0 is invalid"),
    ("ranking", {"train.eval_every": -10}, "train.eval_every=-10 is invalid"),
    ("ranking", {"train.checkpoint_every": -10}, "train.checkpoint_every=-10 is invalid"),
    ("ranking", {"num_seeds": 0}, "num_seeds=0 is invalid"),
    ("retrieval", {"retrieval.recall_k": (0, 10)}, r"retrieval.recall_k=\(0, 10\) is invalid"),
    ("ranking", {"train.num_steps": 2_147_483_800},   # 200 x 10,737,419: past int32
     "train.num_steps=2147483800 is invalid: must be at most 2147483647"),
    ("ranking", {"train.steps_per_call": 0}, "train.steps_per_call=0 is invalid"),
    ("ranking", {"train.eval_batches": 0}, "train.eval_batches=0 is invalid"),
    ("retrieval", {"retrieval.temperature": 0.0}, "retrieval.temperature=0.0 is invalid"),
    ("retrieval", {"retrieval.logq_correction": True, "retrieval.logq_decay": 1.0},
     r"retrieval.logq_decay=1.0 is invalid: must be in \(0, 1\)"),
    ("retrieval", {"retrieval.logq_correction": True, "retrieval.logq_decay": 0.0},
     r"retrieval.logq_decay=0.0 is invalid: must be in \(0, 1\)"),
    ("retrieval", {"retrieval.logq_decay": 0.99},
     "retrieval.logq_decay=0.99 is invalid: only runs with retrieval.logq_correction=True"),
    ("ranking", {"retrieval.logq_correction": True},
     "retrieval.logq_correction=True is invalid: only retrieval runs read it"),
    ("ranking", {"output.keep_checkpoints": 0}, "output.keep_checkpoints=0 is invalid"),
    ("ranking", {"mesh.num_processes": 0}, "mesh.num_processes=0 is invalid"),
    ("ranking", {"mesh.process_id": -1}, "mesh.process_id=-1 is invalid"),
    ("ranking", {"mesh.distributed": True, "mesh.coordinator_address": "10.0.0.1:1234",
                 "mesh.num_processes": 2, "mesh.process_id": 2},
     "mesh.process_id=2 is invalid"),
    ("ranking", {"mesh.initialization_timeout": 0}, "mesh.initialization_timeout=0 is invalid"),
]

# Fields of `base_config` that need no case above, and why. (The model section's other
# keys are model-config fields, with their cases in `BAD_CONFIGS` of tests/test_config.py;
# the world's and the splits' are `WorldConfig` / `SplitConfig` fields, tested in
# tests/test_synthetic.py.)
NO_OUT_OF_RANGE_CASE = {
    "train.score_consistency": "a bool: ml_collections refuses any other type",
    "mesh.distributed": "a bool: ml_collections refuses any other type",
    "mesh.shard_hash_tables": "a bool: ml_collections refuses any other type",
}

# Values on the edge of what their fields allow (a world of 400 posts, 19 actions).
AT_THE_EDGE = {
    "optim.b1": 0.0, "optim.end_lr_fraction": 1.0, "optim.warmup_steps": 0, "optim.eps": 1e-30,
    "optim.weight_decay": 0.0, "optim.grad_clip_norm": None,   # plain Adam, no clipping
    "train.eval_batch_size": 2, "train.eval_every": 0, "train.checkpoint_every": 0,
    "train.action_weights": (1.0,) + (0.0,) * 18, "ranking.top_k": (1, 400),
    "mesh.num_devices": -1,
    "mesh.distributed": True,
    "mesh.coordinator_address": "10.0.0.1:1234", "mesh.num_processes": 2,
    "mesh.process_id": 1, "mesh.initialization_timeout": 1,
    "output.seed_subdirs": True, "seed": 2**32 - 1,
    "world_seed": 2**32 - 1, "eval_seed": 0,
}


# The fields of the sections where a loss option goes (`train`, `ranking`, `retrieval`),
# each either in LOSS_CASES or in NOT_A_LOSS_OPTION with why. A loss option that no path
# reads passes every other test, and an ablation of it reads "no significant difference".
# A case: (task, the reference's overrides, the field, a value away from the reference's,
# whether `eval/loss` moves with it too); the value must change the training loss.
LOSS_CASES = [
    ("ranking", {}, "train.action_weights", (3.0,) + (1.0,) * 18, True),
    ("retrieval", {}, "retrieval.temperature", 0.2, True),
    ("retrieval", {}, "retrieval.positive_action", 1, True),
    # Training-side only: the evaluation's loss stays the plain one.
    ("retrieval", {}, "retrieval.logq_correction", True, False),
    ("retrieval", {"retrieval.logq_correction": True}, "retrieval.logq_decay", 0.5, False),
]
NOT_A_LOSS_OPTION = {
    "train.num_steps": "how long training runs",
    "train.batch_size": "how many lists a step draws",
    "train.steps_per_call": "how many steps a host call runs",
    "train.eval_every": "when to evaluate",
    "train.checkpoint_every": "when to checkpoint",
    "train.eval_batch_size": "the evaluation's batches",
    "train.eval_batches": "the evaluation's batches",
    "train.score_consistency": "an evaluation metric",
    "ranking.top_k": "the evaluation's cut-offs",
    "retrieval.recall_k": "the evaluation's cut-offs",
}


def test_every_loss_section_field_is_a_loss_case_or_says_why_not():
  """A training-side idea's field in `train`, `ranking` or `retrieval` has a case in
  LOSS_CASES (whose test checks that it reaches the training loss) or a reason in
  NOT_A_LOSS_OPTION."""
  cased = {field for _, _, field, _, _ in LOSS_CASES}
  for task in schema.TASKS:
    c = base_config(task)
    fields = {f"{section}.{key}" for section in ("train", "ranking", "retrieval")
              for key in c[section]}
    missing = sorted(fields - cased - set(NOT_A_LOSS_OPTION))
    assert not missing, (f"{missing}: add a case to LOSS_CASES, or a reason to "
                         "NOT_A_LOSS_OPTION (tests/test_training.py)")
  assert not cased & set(NOT_A_LOSS_OPTION)


@functools.lru_cache(maxsize=None)   # the cases share their references
def _first_losses(task: str, overrides: str) -> tuple[float, np.ndarray]:
  """The evaluation's loss at initialisation and the first chunk's losses, of seed 0 of the
  smoke config with `overrides` (JSON)."""
  trainer = Trainer(parse_config(_overridden(task, json.loads(overrides))))
  state = trainer.init([0])
  evaluated = float(trainer.evaluate(state)["eval/loss"][0])
  return evaluated, np.asarray(trainer.train_chunk(state)[1]["loss"][0])


@pytest.mark.parametrize("task, reference, field, value, eval_moves", LOSS_CASES,
                         ids=[case[2] for case in LOSS_CASES])
def test_every_loss_option_reaches_the_training_loss(task, reference, field, value,
                                                     eval_moves):
  """Ten steps from the same initial state train on other losses with the field set; the
  evaluation's loss of the same parameters moves too only where the option is meant for
  it (a training-side correction leaves `eval/loss` the plain loss, which arms with and
  without it compare on)."""
  evaluated, losses = zip(*(_first_losses(task, json.dumps(overrides, sort_keys=True))
                            for overrides in (reference, {**reference, field: value})))
  assert np.all(np.isfinite(losses))
  assert np.max(np.abs(losses[0] - losses[1])) > 1e-4, f"{field}={value!r} changes no step's loss"
  assert (evaluated[0] != evaluated[1]) == eval_moves, (
      f"{field}={value!r} {'leaves' if eval_moves else 'moves'} eval/loss "
      f"({evaluated[0]} vs {evaluated[1]}), where its LOSS_CASES entry says it "
      f"{'moves' if eval_moves else 'leaves'} it: a training-only option goes into "
      "Trainer._loss, around its ranking loss call, not into the loss both share "
      "(docs/ideas.md, \"A training-side idea\")")


@pytest.mark.parametrize("task, overrides, message", OUT_OF_RANGE,
                         ids=[",".join(o) for _, o, _ in OUT_OF_RANGE])
def test_values_just_out_of_range_are_refused_by_name(task, overrides, message):
  with pytest.raises(ConfigError, match=message):
    parse_config(_overridden(task, overrides))


def test_every_training_field_has_an_out_of_range_case():
  """A field added to `base_config` outside the model, world and split sections (a
  training-side idea: a loss or optimizer option) needs a case in `OUT_OF_RANGE`, or a
  reason in `NO_OUT_OF_RANGE_CASE`. A field of the `ranking` or `retrieval` section
  counts only with a case of its own task: in the other task's run any value is refused
  by itself, so such a case passes without a range check."""
  covered = {path for task, overrides, _ in OUT_OF_RANGE for path in overrides
             if path.split(".")[0] not in schema.TASKS or path.split(".")[0] == task}
  covered |= {path.split(".")[0] for path in covered}   # extra_eval_splits.<name>

  def leaves(node, prefix=""):
    for key, value in node.items():
      if hasattr(value, "items") and value:
        yield from leaves(value, f"{prefix}{key}.")
      else:
        yield prefix + key

  for task in schema.TASKS:
    paths = [p for p in leaves(base_config(task))
             if p.split(".")[0] not in ("model", "world", "train_split", "eval_split")]
    paths += [f"model.{key}" for key in schema.TRAINING_MODEL_KEYS]
    missing = sorted(set(paths) - covered - set(NO_OUT_OF_RANGE_CASE))
    assert not missing, (f"{task} config fields without a case in OUT_OF_RANGE "
                         f"(tests/test_training.py): {missing}")


def test_values_at_the_edge_of_their_range_are_accepted():
  spec = parse_config(_overridden("ranking", AT_THE_EDGE))
  assert spec.action_weights == (1.0,) + (0.0,) * 18
  # The other ends: weights summing to exactly 1e-6, a decay to a rate of 0.
  assert parse_config(_overridden("ranking", {
      "train.action_weights": (1e-6,) + (0.0,) * 18})).action_weights[0] == 1e-6
  assert parse_config(_overridden("ranking", {"optim.end_lr_fraction": 0.0})).config.optim[
      "end_lr_fraction"] == 0.0
  # The most steps an int32 step counter holds (one step a call, no evaluation or checkpoint
  # on the way).
  parse_config(_overridden("ranking", {"train.num_steps": 2**31 - 1, "train.steps_per_call": 1,
                                       "train.eval_every": 0, "train.checkpoint_every": 0}))
  retrieval = parse_config(_overridden("retrieval", {
      "train.batch_size": 2, "retrieval.positive_action": 18, "retrieval.recall_k": (1, 400)}))
  assert retrieval.config.train.batch_size == 2
  # A ranking run never reads retrieval.recall_k: its default (10, 100) needs no 100 posts.
  parse_config(_overridden("ranking", {"world.num_posts": 50, "optim.warmup_steps": 39}))
  with pytest.raises(ConfigError, match=r"SplitConfig has no field\(s\) \['max_histroy'\]"):
    split_config(max_histroy=4)


def test_paths_named_matches_whole_field_names():
  """Where the hints of `experiments/cli.py` and `ablations/sweep.py` point a misplaced
  field: the paths whose last key is the name itself, not one ending with it."""
  assert schema.paths_named("num_steps") == ["train.num_steps"]
  assert schema.paths_named("seed") == ["seed"]
  assert schema.paths_named("steps") == [] and schema.paths_named("k") == []


def test_the_evaluations_a_run_has_still_to_make():
  """The ETA's count: one every eval_every steps, and the final one unless it is one."""
  assert _evaluations_after(20, 40, 20) == 1        # at 40
  assert _evaluations_after(0, 40, 20) == 2
  assert _evaluations_after(10, 40, 15) == 3        # at 15, 30 and the final 40
  assert _evaluations_after(30, 40, 15) == 1
  assert _evaluations_after(0, 40, 0) == 1          # the final one alone
  assert _evaluations_after(40, 40, 20) == _evaluations_after(40, 40, 0) == 0


def test_a_stored_config_is_completed_with_the_defaults_it_predates():
  """A run's config.json written before a field existed gets the field's default, in
  nested sections and in each extra evaluation split too."""
  stored = ranking_configs.get_config("smoke").to_dict()
  del stored["model"]["attention_impl"]
  del stored["optim"]
  stored["train"]["num_steps"] = 200   # beyond the default warmup's 100 steps
  stored["extra_eval_splits"] = {"long": {"max_history": 4}}
  config = with_defaults(stored)
  assert config.model.attention_impl == "isolated"
  assert config.model.num_layers == 1                    # kept, not reset to the default
  assert config.optim.to_dict() == base_config("ranking").optim.to_dict()
  assert config.extra_eval_splits.long.to_dict() == {**split_config().to_dict(),
                                                     "max_history": 4}
  assert parse_config(config).eval_splits["long"].max_history == 4


def test_every_model_key_reaches_its_model_config_field():
  """A `config.model` key goes to the config field of its name: switches are never
  dropped on the way (a switch's field and its default are all the schema needs), and
  a key that is a field of no model config is an error."""
  c = smoke_config()
  c.model.update(dict(scan_unroll=3, attention_impl="dense", right_anchored_rope=True))
  model = parse_config(c).model
  assert (model.model.scan_unroll, model.attention_impl, model.right_anchored_rope) == (
      3, "dense", True)
  c.model.no_such_switch = True
  with pytest.raises(ConfigError,
                     match=r"config.model=\['no_such_switch'\].*phoenix_flax/config.py"):
    parse_config(c)


def test_every_model_config_field_is_in_the_model_section_or_says_why_not():
  """A field added to the model configs needs its default in `base_config` (or a reason
  in `NOT_IN_MODEL_SECTION`); an unexposed field set in a config file is refused with the
  reason, not passed to a model the synthetic world cannot feed."""
  fields = set()
  for cls in (pf.TransformerConfig, pf.PhoenixModelConfig, pf.PhoenixRetrievalModelConfig):
    fields |= {f.name for f in dataclasses.fields(cls)}
  section = set(base_config("ranking").model) - set(schema.TRAINING_MODEL_KEYS)
  assert section == set(base_config("retrieval").model) - set(schema.TRAINING_MODEL_KEYS)
  unexposed = set(schema.NOT_IN_MODEL_SECTION)
  assert not section & unexposed
  assert section | unexposed == fields, sorted(fields - section - unexposed)
  c = smoke_config()
  c.model.num_continuous_actions = 2
  with pytest.raises(ConfigError, match=r"config.model.num_continuous_actions is invalid: "
                                        r".*PhoenixModelConfig.*no continuous labels"):
    parse_config(c)
  c = smoke_config()
  c.model.num_actions = 5   # the world's field sets it (not a fixed 19)
  with pytest.raises(ConfigError, match=r"config.model.num_actions is invalid: .*"
                                        r"set world.num_actions"):
    parse_config(c)


@pytest.mark.parametrize("task, key, value", [("retrieval", "candidate_isolation", False),
                                              ("retrieval", "right_anchored_rope", True),
                                              ("retrieval", "attention_impl", "dense"),
                                              ("ranking", "enable_linear_proj", False)])
def test_the_other_tasks_switches_are_refused_unless_at_their_default(task, key, value):
  """The task's model has no such setting: a variant that sets it would train the same
  model as the baseline, so it is an error; left at its default it is fine."""
  c = (retrieval_configs if task == "retrieval" else ranking_configs).get_config("smoke")
  parse_config(c)
  c.model[key] = value
  with pytest.raises(ConfigError, match=rf"config.model.{key}=.*switch of the .* model only"):
    parse_config(c)


def _finals(result):
  return {k: v for k, v in result["final"].items() if v is not None}


@pytest.fixture(scope="module")
def main(fork_server):
  """Runs `python -m <module> <args>` in a process of its own (`fork_server`'s child) with
  the session's XLA settings (unoptimised compiles, one compilation cache: conftest.py);
  returns its stdout."""

  def run(module: str, *args: str) -> str:
    code, stdout, stderr = fork_server.run(module, args)
    assert code == 0, stderr[-3000:]
    return stdout

  return run


@pytest.fixture(scope="module")
def cli(main):
  """experiments/run.py with a config file of experiments/configs, a workdir, overrides."""
  return lambda config, workdir, *overrides: main(
      "experiments.run", "--quiet", f"--config=experiments/configs/{config}",
      f"--workdir={workdir}", *overrides)


def _result(run_dir):
  with open(os.path.join(run_dir, "result.json")) as f:
    return json.load(f)


def test_schedule_warms_up_then_decays_to_the_end_fraction():
  c = smoke_config(num_steps=100)
  c.optim.update(dict(learning_rate=0.02, warmup_steps=10, end_lr_fraction=0.1))
  schedule = make_schedule(parse_config(c))
  lr = lambda step: float(schedule(step))
  assert lr(0) == 0.0
  assert lr(5) == pytest.approx(0.01)
  assert lr(10) == pytest.approx(0.02)
  assert lr(55) == pytest.approx(0.011)           # half way: (peak + end) / 2
  assert lr(100) == pytest.approx(0.002)
  assert lr(30) > lr(40) > lr(50)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_gradients_are_clipped_to_the_global_norm_before_adam(clip):
  c = smoke_config()
  c.optim.grad_clip_norm = clip
  opt = make_optimizer(parse_config(c))
  params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}
  grads = {"w": jnp.full((3, 4), 2.0), "b": jnp.full(4, 2.0)}    # global norm 8
  _, state = opt.update(grads, opt.init(params), params)
  mu = optax.tree_utils.tree_get(state, "mu")
  scale = 1.0 if clip is None else clip / 8.0
  np.testing.assert_allclose(mu["w"], (1 - c.optim.b1) * 2.0 * scale, rtol=1e-6)


def test_training_chunk_donates_its_state_and_never_calls_the_host():
  """The scanned chunk's program: every state buffer is donated (aliased to an output),
  and there is no host callback, send or receive anywhere in it."""
  trainer = Trainer(parse_config(smoke_config()))
  state = trainer.init([0])
  text = trainer._chunk.lower(trainer.world, state).as_text()
  assert text.count("tf.aliasing_output") == len(jax.tree.leaves(state))
  for op in ("callback", "stablehlo.send", "stablehlo.recv", "infeed", "outfeed"):
    assert op not in text, op


@pytest.mark.parametrize("configs", [ranking_configs, retrieval_configs])
def test_evaluation_programs_sum_nothing_by_scatter(configs):
  """No scatter in an evaluation program adds (`segment_sum`, `.at[].add`): on GPU such a
  scatter of floats adds by atomics, in an order that varies from run to run. On an H200,
  `calibration_error`, then binned with `segment_sum`, differed in its 7th digit between
  an uninterrupted run and a resumed one whose every other metric was equal."""
  trainer = Trainer(parse_config(configs.get_config("smoke")))
  text = trainer._eval.lower(trainer.world, trainer.references(),
                             trainer.init([0]).params).as_text()
  text += trainer._references.lower(trainer.world).as_text()
  scatters = text.split('"stablehlo.scatter"')[1:]
  for scatter in scatters:
    combiner = scatter[:scatter.index("})")]     # the region that merges updates
    assert "stablehlo.add" not in combiner, combiner
  assert scatters   # the search finds them at all: both evaluations `.at[].set` a mask


@pytest.mark.slow
def test_vmapped_seeds_differ_and_match_single_seed_runs(tmp_path, cli):
  # float32 on every platform: in bfloat16 (the GPU default) the vmapped and the single
  # program round differently, and 40 steps moved auc_mean by 1e-3 on an H200.
  f32 = "--config.model.fprop_dtype=float32"
  quick = "--config.train.score_consistency=False"
  ks = "--config.ranking.top_k=(1,3)"
  cli("ranking.py:smoke", tmp_path / "both", "--config.num_seeds=2", quick, ks, f32)
  assert sorted(os.listdir(tmp_path / "both")) == ["seed_0", "seed_1"]
  together = {k: _result(tmp_path / "both" / f"seed_{k}") for k in (0, 1)}
  assert _finals(together[0])["logloss"] != _finals(together[1])["logloss"]
  for seed in (1,):   # the second vmapped seed: catches a seed or key offset between them
    cli("ranking.py:smoke", tmp_path / f"alone_{seed}", f"--config.seed={seed}", quick, ks, f32)
    got, want = _finals(_result(tmp_path / f"alone_{seed}")), _finals(together[seed])
    for key in ("logloss", "loss", "auc_mean", "bayes_auc_mean", "train/loss"):
      np.testing.assert_allclose(got[key], want[key], atol=1e-4, err_msg=key)
    cfg_alone = json.load(open(tmp_path / f"alone_{seed}" / "config.json"))
    cfg_together = json.load(open(tmp_path / "both" / f"seed_{seed}" / "config.json"))
    assert cfg_alone == cfg_together
  result = together[1]
  assert set(result) >= {"final", "diverged", "diverged_at_step", "steps", "wall_seconds",
                         "examples_per_second"}
  assert result["steps"] == 40 and result["diverged"] is False
  assert result["num_seeds_vmapped"] == 2 and result["final"]["bayes_auc_mean"] > 0.5
  assert result["machine"] == provenance.machine()
  at_k = {k for k in result["final"] if "@" in k}   # every metric at K, at each K of top_k
  names = {k.rsplit("@", 1)[0] for k in at_k}
  assert {"ndcg", "recall", "bayes_recall"} <= names   # (a new metric at K joins them)
  assert at_k == {f"{m}@{k}" for m in names for k in (1, 3)}
  # Throughput counts the examples of both seeds: batch 8 x 2 per step, over the timed
  # chunks (every chunk after the first, which compiles).
  curves = {k: [json.loads(line) for line in open(tmp_path / "both" / f"seed_{k}"
                                                    / "metrics.jsonl")] for k in (0, 1)}
  for k in (0, 1):   # each seed's curve is its own
    assert curves[k][-1]["train/loss"] == pytest.approx(_finals(together[k])["train/loss"])
  assert curves[0][-1]["train/loss"] != curves[1][-1]["train/loss"]
  rows = curves[1]
  # The first chunk compiled: it logs its time, the others their rates.
  assert rows[0]["perf/first_call_seconds"] > 0 and "perf/steps_per_second" not in rows[0]
  timed = rows[1:]
  for row in timed:
    assert row["perf/examples_per_second"] == pytest.approx(
        16 * row["perf/steps_per_second"], rel=1e-9)
  expected = len(timed) * 10 * 16 / sum(10 / r["perf/steps_per_second"] for r in timed)
  assert result["examples_per_second"] == pytest.approx(expected, rel=1e-6)
  assert together[0]["examples_per_second"] == result["examples_per_second"]
  loaded = load_run(str(tmp_path / "both" / "seed_1"))
  assert loaded.step == 40
  # A run trained on a mesh (tables sharded, several hosts) loads on one device all the
  # same: mesh.* describes where it trained, not its parameters.
  import shutil
  meshed = tmp_path / "meshed"
  shutil.copytree(tmp_path / "both" / "seed_1", meshed)
  stored = json.loads((meshed / "config.json").read_text())
  stored["mesh"].update(num_devices=-1, shard_hash_tables=True, distributed=True,
                        coordinator_address="10.0.0.1:1234", num_processes=2, process_id=0)
  (meshed / "config.json").write_text(json.dumps(stored))
  again = load_run(str(meshed))
  assert again.step == 40 and again.trainer.spec.config.mesh.num_devices == 1
  for a, b in zip(jax.tree.leaves(eqx.filter(again.system, eqx.is_array)),
                  jax.tree.leaves(eqx.filter(loaded.system, eqx.is_array))):
    np.testing.assert_array_equal(a, b)
  # The workdir of several seeds is no run: the error names the runs under it.
  with pytest.raises(FileNotFoundError, match=r"both is not a run directory \(no config"
                                               r"\.json\); it holds the runs seed_0, seed_1: "
                                               r"pass one of them, e.g. .*both/seed_0$"):
    load_run(str(tmp_path / "both"))
  with pytest.raises(FileNotFoundError, match=r"empty is not a run directory \(no "
                                               r"config\.json\)$"):
    load_run(str(tmp_path / "empty"))
  with pytest.raises(ValueError, match="step='40' must be an integer >= 0"):
    load_run(str(tmp_path / "both" / "seed_1"), step="40")
  damaged = tmp_path / "damaged"
  damaged.mkdir()
  (damaged / "config.json").write_text("{bad")
  with pytest.raises(ConfigError, match=r"damaged/config.json cannot be read \(Expecting"):
    load_run(str(damaged))
  sb = jax.jit(sample_batch, static_argnums=(1, 2))(
      loaded.trainer.world, loaded.trainer.spec.train_split, 2, jax.random.PRNGKey(0))
  assert eqx.filter_jit(loaded.system)(sb.batch).shape == (2, 4, 19)


def test_each_seed_initialises_and_evaluates_as_it_would_alone():
  """Initialisation and evaluation run several seeds one after another in one program, so
  a seed's parameters and metrics do not depend on the seeds beside it, to the bit (a
  vmapped evaluation rounded differently)."""
  trainer = Trainer(parse_config(smoke_config()))
  both, alone = trainer.init([3, 5]), trainer.init([5])
  same = lambda x, y: np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
  assert all(jax.tree.leaves(jax.tree.map(lambda x, y: same(x[1], y[0]), both, alone)))
  together, by_itself = trainer.evaluate(both), trainer.evaluate(alone)
  assert set(together) == set(by_itself) and len(together) > 20
  for key, values in together.items():
    assert values.shape == (2,) and same(values[1], by_itself[key][0]), key
  assert not same(together["eval/logloss"][0], together["eval/logloss"][1])
  # Each seed draws its own training batches, not only its own initial parameters.
  assert not same(both.data_key[0], both.data_key[1])
  sample = eqx.filter_jit(trainer.sample_train_batch)   # one wrapper: one compile
  first = [sample(trainer.world, unstack(both, i)) for i in (0, 1)]
  assert not same(first[0].batch.candidate_post_hashes, first[1].batch.candidate_post_hashes)


def test_one_seed_runs_its_function_unmapped_and_several_are_vmapped():
  """`_over_seeds` runs a single seed's function on the squeezed arrays, not under a vmap
  of axis size 1 (whose layouts made the CPU training step slower), and vmaps several
  (one after another with `in_turn`); each way gives every seed its own result."""
  seen = []

  def fn(shared, x):
    seen.append(type(x).__name__)
    return x * shared

  for n, in_turn, batched in ((1, False, False), (1, True, False), (3, False, True)):
    seen.clear()
    x = jnp.arange(n * 2.0).reshape(n, 2)
    out = _over_seeds(fn, in_turn=in_turn)(jnp.float32(3.0), x)
    np.testing.assert_array_equal(out, 3.0 * x)
    assert ("BatchTracer" in seen) == batched, (n, in_turn, seen)


def test_divergence_guard_freezes_a_seed_for_good():
  """A non-finite step marks the seed diverged at that 1-based step and keeps its
  parameters and optimizer state; later finite steps neither train it nor clear the flag."""
  trainer = Trainer(parse_config(smoke_config()))
  update = eqx.filter_jit(trainer.update)
  state = unstack(trainer.init([0]), 0)
  sb = eqx.filter_jit(trainer.sample_train_batch)(trainer.world, state)
  state, _ = update(state, sb)   # warmup starts at learning rate 0: step 1 changes nothing
  same = lambda a, b: jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), a, b)

  fine, _ = update(state, sb)
  assert not fine.diverged and int(fine.diverged_step) == -1 and int(fine.step) == 2
  assert any(np.any(np.asarray(a) != np.asarray(b))
             for a, b in zip(jax.tree.leaves(fine.params), jax.tree.leaves(state.params)))

  leaves, tree = jax.tree.flatten(state.params)
  leaves[0] = jnp.full_like(leaves[0], jnp.nan)
  poisoned = eqx.tree_at(lambda s: s.params, state, jax.tree.unflatten(tree, leaves))
  bad, _ = update(poisoned, sb)
  assert bool(bad.diverged) and int(bad.diverged_step) == 2 and int(bad.step) == 2
  same(bad.params, poisoned.params)
  same(bad.opt_state, poisoned.opt_state)

  healed = eqx.tree_at(lambda s: s.params, bad, state.params)
  after, _ = update(healed, sb)
  assert bool(after.diverged) and int(after.diverged_step) == 2 and int(after.step) == 3
  same(after.params, healed.params)
  same(after.opt_state, healed.opt_state)
  # A later non-finite step leaves the step it first diverged at as it was.
  again, _ = update(eqx.tree_at(lambda s: s.params, after, poisoned.params), sb)
  assert bool(again.diverged) and int(again.diverged_step) == 2 and int(again.step) == 4


@pytest.mark.parametrize("config", [smoke_config, lambda: _overridden(
    "retrieval", {"retrieval.logq_correction": True})], ids=["ranking", "retrieval_logq"])
def test_a_nan_gradient_with_a_finite_loss_diverges_the_seed(config):
  """The guard checks the gradient norm too: a step whose loss is finite but whose
  gradient is not (a `where` over a NaN branch, a bfloat16 overflow) stops the seed there,
  before AdamW writes NaN into its parameters; the logQ counts stay as they were too."""
  trainer = Trainer(parse_config(config()))
  state = unstack(trainer.init([0]), 0)
  sb = eqx.filter_jit(trainer.sample_train_batch)(trainer.world, state)
  original = trainer._loss

  def loss_with_nan_gradient(params, sb, sampling_counts=None):
    loss, aux = original(params, sb, sampling_counts)
    x = jax.tree.leaves(params)[0]
    trap = jnp.where(True, 0.0, jnp.sqrt(-1.0 - jnp.sum(jnp.abs(x))))  # 0, gradient NaN
    return loss + trap, aux

  trainer._loss = loss_with_nan_gradient
  new, stats = eqx.filter_jit(trainer.update)(state, sb)
  assert np.isfinite(float(stats["loss"])) and not np.isfinite(float(stats["grad_norm"]))
  assert bool(new.diverged) and int(new.diverged_step) == 1
  jax.tree.map(np.testing.assert_array_equal, new.params, state.params)
  jax.tree.map(np.testing.assert_array_equal, new.sampling_counts, state.sampling_counts)
  if state.sampling_counts is not None:     # the step would have counted its positives
    assert np.asarray(trainer._sampling_counts(state, sb)).sum() > 0


def test_a_step_logs_the_rate_it_applies_and_each_step_draws_a_new_batch():
  trainer = Trainer(parse_config(smoke_config()))
  state = unstack(trainer.init([0]), 0)
  sample, update = eqx.filter_jit(trainer.sample_train_batch), eqx.filter_jit(trainer.update)
  sb0 = sample(trainer.world, state)
  after, stats = update(state, sb0)
  assert float(stats["learning_rate"]) == float(trainer.schedule(0)) == 0.0
  jax.tree.map(np.testing.assert_array_equal, after.params, state.params)  # rate 0 applied
  _, stats1 = update(after, sb0)
  assert 0.0 < float(trainer.schedule(1)) != float(trainer.schedule(2))
  np.testing.assert_allclose(float(stats1["learning_rate"]), float(trainer.schedule(1)),
                             rtol=1e-5)   # jit and eager schedules differ by an ulp
  sb1 = sample(trainer.world, after)
  assert not np.array_equal(np.asarray(sb0.batch.candidate_post_hashes),
                            np.asarray(sb1.batch.candidate_post_hashes))


def test_a_step_logs_its_gradients_global_norm_and_each_step_has_its_own_batch():
  """`train/grad_norm` is the global norm of the step's gradients (not its square); the
  batch of step i is drawn from `fold_in(data_key, i)`, a key of its own for every step,
  and the data key is not the key the parameters were drawn from."""
  trainer = Trainer(parse_config(smoke_config()))
  state = unstack(trainer.init([0]), 0)
  sample = eqx.filter_jit(trainer.sample_train_batch)
  sb = sample(trainer.world, state)
  _, stats = eqx.filter_jit(trainer.update)(state, sb)
  grads, _ = eqx.filter_jit(jax.grad(trainer._loss, has_aux=True))(state.params, sb, None)
  norm = float(np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64)))
                           for g in jax.tree.leaves(grads))))
  assert abs(norm - 1.0) > 0.05       # a norm of 1 would be its own square
  np.testing.assert_allclose(float(stats["grad_norm"]), norm, rtol=1e-5)

  at_step = lambda i: eqx.tree_at(lambda s: s.step, state, jnp.asarray(i, jnp.int32))
  hashes = [np.asarray(sample(trainer.world, at_step(i)).batch.candidate_post_hashes)
            for i in range(4)]
  for i in range(4):
    for j in range(i):
      assert not np.array_equal(hashes[i], hashes[j]), (i, j)

  seed_key = np.asarray(jax.random.PRNGKey(0))
  assert not np.array_equal(np.asarray(state.data_key), seed_key)
  drawn = eqx.filter_jit(lambda key: make_system(trainer.spec, key))(state.data_key)
  random = [(np.asarray(a), np.asarray(b)) for a, b in zip(
      jax.tree.leaves(eqx.filter(drawn, eqx.is_array)), jax.tree.leaves(state.params))
      if np.unique(np.asarray(b)).size > 2]   # not the norms' ones or a padding row alone
  assert random and not any(np.array_equal(a, b) for a, b in random)


def test_training_batches_come_from_the_train_split():
  """A step's batch is drawn from `train_split` (here with no relevant candidates at all),
  not from the evaluation split (half of them relevant)."""
  c = smoke_config()
  c.train_split.relevant_fraction = 0.0
  trainer = Trainer(parse_config(c))
  state = unstack(trainer.init([0]), 0)
  sb = eqx.filter_jit(trainer.sample_train_batch)(trainer.world, state)
  assert not np.any(np.asarray(sb.candidate_relevant))
  eval_sb = jax.jit(sample_batch, static_argnums=(1, 2))(
      trainer.world, trainer.spec.eval_splits["eval"], 8, jax.random.PRNGKey(0))
  assert np.any(np.asarray(eval_sb.candidate_relevant))


def test_resume_steps_are_those_every_seed_has(tmp_path):
  """A kill between two seeds' checkpoint writes leaves them at different steps; the run
  resumes from the newest step all seeds have (then the ones before it, newest first, if
  a file of it cannot be read)."""
  tree = {"w": jnp.arange(3.0)}
  dirs = [str(tmp_path / "seed_0"), str(tmp_path / "seed_1")]
  for d, steps in zip(dirs, ([10, 20], [10])):
    for step in steps:
      checkpoint.save(d, step, tree, keep=3)
  assert _resume_steps(dirs) == [10]
  assert _resume_steps(dirs[:1]) == [20, 10]
  assert _resume_steps([str(tmp_path / "empty")]) == []


@pytest.mark.slow
def test_divergence_is_recorded_not_raised(tmp_path, cli):
  out = cli("ranking.py:smoke", tmp_path, "--config.optim.learning_rate=1e12",
            "--config.optim.grad_clip_norm=None", "--config.optim.weight_decay=0.0",
            "--config.optim.warmup_steps=0", "--config.train.eval_every=0",
            "--config.train.checkpoint_every=0", "--config.train.steps_per_call=1")
  result = _result(tmp_path)
  assert result["diverged"] is True
  assert 1 <= result["diverged_at_step"] <= 40
  logged = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  first = next(r["step"] for r in logged   # a step a row each: the first non-finite one
               if r["train/loss"] is None or r["train/grad_norm"] is None)
  assert result["diverged_at_step"] == first
  assert f"diverged at step {result['diverged_at_step']}" in out
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert rows and rows[-1]["step"] <= 40
  # Training stops once every seed has diverged; `steps` counts the steps run, and the
  # throughput is that of the chunks run (the compiling one too when it is the last).
  assert result["steps"] == max(r["step"] for r in rows) < 40
  assert result["examples_per_second"] > 0
  assert session_end_status(str(tmp_path)) == "STATUS_FAILURE"   # HParams' status filter
  # Killed after its final checkpoint (result.json missing): the diverged state it restores
  # trains no further, and the run ends as it did.
  os.remove(tmp_path / "result.json")
  cli("ranking.py:smoke", tmp_path, "--config.optim.learning_rate=1e12",
      "--config.optim.grad_clip_norm=None", "--config.optim.weight_decay=0.0",
      "--config.optim.warmup_steps=0", "--config.train.eval_every=0",
      "--config.train.checkpoint_every=0", "--config.train.steps_per_call=1")
  again = _result(tmp_path)
  assert (again["steps"], again["diverged_at_step"]) == (result["steps"],
                                                         result["diverged_at_step"])
  assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == rows
  # A diverged retrieval model's recall is undefined (null), as its AUC and loss are.
  cli("retrieval.py:smoke", tmp_path / "retrieval", "--config.optim.learning_rate=1e8",
      "--config.optim.grad_clip_norm=None")
  final = _result(tmp_path / "retrieval")["final"]
  assert final["recall@10"] is None and final["auc"] is None and final["loss"] is None
  assert final["bayes_recall@10"] > 0


def test_every_seed_diverging_in_the_compiling_chunk_still_times_it(tmp_path):
  """A run whose seeds all diverge in its first chunk ends there: that chunk (compiling
  included) is the only one, so it is timed, and the throughput is not 0; it is evaluated
  and its progress line reports it finished."""
  config = smoke_config(num_steps=20, steps_per_call=10, eval_every=0, checkpoint_every=0)
  config.optim.update(learning_rate=1e12, grad_clip_norm=None, warmup_steps=0)
  config.num_seeds = 2
  seen = []
  results = pf.training.run_experiment(config, str(tmp_path), progress=seen.append)
  for result in results.values():
    assert result["diverged"] is True and result["steps"] == 10
    assert result["examples_per_second"] > 0
  # Its one progress line says so: both diverged, nothing left to wait for, and the
  # final evaluation (made although eval_every=0 never asked for one before the end).
  [p] = seen
  assert (p.step, p.num_diverged, p.eta_seconds) == (10, 2, 0.0)
  assert "eval/auc_mean" in p.evaluated
  for k in (0, 1):
    assert "eval/auc_mean" in read_metrics(str(tmp_path / f"seed_{k}"))[-1]


def test_the_progress_eta_counts_the_steps_and_evaluations_left(tmp_path, monkeypatch):
  """On a clock that advances one second a reading, every chunk of 10 steps and every
  evaluation takes 1 s: after step 20 of 40 (one chunk timed besides the compiling one),
  20 steps and the evaluations at 30 and 40 are left, 2 s + 2 s; after step 30, 1 s + 1 s.
  After the compiling chunk alone the estimate is unknown (NaN)."""
  import itertools
  import math
  import time as real_time
  ticks = itertools.count(1)

  class Clock:   # the runner's `time` module, its perf_counter faked
    def __getattr__(self, name):
      return getattr(real_time, name)

    @staticmethod
    def perf_counter():
      return float(next(ticks))
  monkeypatch.setattr(runner, "time", Clock())
  seen = []
  pf.training.run_experiment(
      smoke_config(num_steps=40, steps_per_call=10, eval_every=10, checkpoint_every=0),
      str(tmp_path), progress=lambda p: seen.append((p.step, p.eta_seconds)))
  assert [step for step, _ in seen] == [10, 20, 30, 40]
  assert math.isnan(seen[0][1]) and [eta for _, eta in seen[1:]] == [4.0, 2.0, 0.0]


def test_one_diverged_seed_leaves_the_others_training(tmp_path, monkeypatch):
  """Seeds trained together stop only when every one has diverged: a seed diverged from
  the start (as a restored one can be) leaves the other to train all its steps."""
  init = Trainer.init
  def first_seed_diverged(self, seeds):
    state = init(self, seeds)
    return eqx.tree_at(lambda s: (s.diverged, s.diverged_step), state,
                       (jnp.array([True, False]), jnp.array([1, -1], jnp.int32)))
  monkeypatch.setattr(Trainer, "init", first_seed_diverged)
  config = smoke_config(num_steps=20, steps_per_call=10, eval_every=0, checkpoint_every=0)
  config.num_seeds = 2
  results = runner.run_experiment(config, str(tmp_path))
  assert (results[0]["diverged"], results[0]["diverged_at_step"]) == (True, 1)
  assert (results[1]["diverged"], results[1]["steps"]) == (False, 20)
  assert results[1]["final"]["train/loss"] is not None


def test_every_training_statistic_is_logged():
  """A statistic that `Trainer.update` returns (an idea's own included) becomes a
  `train/` scalar: its mean over the chunk, per layer where it has a layer axis."""
  # Three uneven steps: a mean is no median.
  stats = {"loss": [[1.0, 2.0, 6.0]], "learning_rate": [[0.1, 0.2, 0.3]],
           "temperature": [[0.5, 1.5, 4.0]],
           "max_attn_logit": [[[1.0, 5.0], [4.0, 2.0], [0.0, 1.0]]],
           "residual_rms": [[[1.0, 2.0], [3.0, 4.0], [8.0, 0.0]]]}
  assert _train_scalars(stats, 0) == {
      "train/loss": 3.0, "train/learning_rate": 0.3, "train/temperature": 2.0,
      "train/max_attn_logit": 5.0, "train/max_attn_logit/layer_0": 4.0,
      "train/max_attn_logit/layer_1": 5.0, "train/residual_rms/layer_0": 4.0,
      "train/residual_rms/layer_1": 2.0}
  with pytest.raises(ValueError, match="'grid' has shape \\(1, 1, 1\\) per seed"):
    _train_scalars({"grid": [[[[0.0]]]]}, 0)


def test_make_system_draws_the_tables_at_the_configs_scale():
  """`model.embedding_init_scale` is the hash tables' initial std (the systems' own
  default is 1.0), for both tasks."""
  for module in (ranking_configs, retrieval_configs):
    for scale in (0.05, 0.5):
      config = module.get_config("smoke")
      config.model.embedding_init_scale = scale
      system = make_system(parse_config(config), jax.random.PRNGKey(0))
      for table in (system.tables.user_table, system.tables.post_table):
        assert float(np.std(np.asarray(table))) == pytest.approx(scale, rel=0.1)


@pytest.mark.slow
def test_retrieval_task_trains_and_reports_recall(tmp_path, main):
  out = main("experiments.run", "--config=experiments/configs/retrieval.py:smoke",
             f"--workdir={tmp_path}")
  # The summary line gives the recall at the preset's K (10, 100, as at every preset);
  # a progress line with an evaluation, the first K's alone.
  assert " recall@10=" in out and " recall@100=" in out and " bayes_recall@100=" in out
  evaluated = [line for line in out.splitlines()
               if line.startswith("step ") and "| eval/" in line]
  assert evaluated and all("| eval/recall@10 " in line and "recall@100" not in line
                           for line in evaluated), out
  final = _result(tmp_path)["final"]
  for key in ("loss", "recall@10", "recall@100", "bayes_recall@100", "auc", "bayes_auc"):
    assert key in final and final[key] is not None, key
  assert 0.0 <= final["recall@10"] <= final["recall@100"] <= 1.0
  assert final["bayes_recall@100"] >= final["bayes_recall@10"]
  # The user tower's diagnostics, as for ranking: at evaluation and in every train row.
  assert final["max_attn_logit"] > 0 and final["residual_rms/layer_0"] > 0
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  train_rows = [r for r in rows if "train/loss" in r]
  assert train_rows and all(r["train/max_attn_logit"] > 0 and r["train/residual_rms/layer_0"] > 0
                            for r in train_rows)
  # The share of users with a positive in their list, which the in-batch loss counts.
  assert all(0 < r["train/positive_fraction"] <= 1 for r in train_rows)
  # A process other than the first (multi-host) prints no summary: process 0 wrote the
  # files and says so. (The finished run is skipped, so nothing trains again.)
  code = ("import sys, jax\n"
          "jax.process_index = lambda *args, **kwargs: 1\n"
          "from experiments import run\n"
          "from experiments.cli import parse_config_flags, run_app\n"
          "sys.argv = ['run', '--config=experiments/configs/retrieval.py:smoke', "
          f"'--workdir={tmp_path}', '--quiet']\n"
          "run_app(run.main, flags_parser=parse_config_flags)\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0 and proc.stdout == "", (proc.stdout, proc.stderr[-2000:])


@pytest.mark.slow
def test_throughput_measures_both_loops(tmp_path, main):
  out = tmp_path / "new_folder" / "throughput.json"   # created
  main("experiments.train_throughput", "--config=experiments/configs/ranking.py:smoke",
       "--rounds=1", "--chunks_per_round=1", f"--out={out}")
  result = json.load(open(out))
  assert result["scanned_examples_per_second"] > 0 and result["plain_examples_per_second"] > 0
  assert result["speedup"] == pytest.approx(
      result["scanned_examples_per_second"] / result["plain_examples_per_second"])
  assert result["speedup_vs_device_sampled"] == pytest.approx(
      result["scanned_examples_per_second"]
      / result["plain_device_sampled_examples_per_second"])
  assert result["steps_per_round"] == 10 and result["batch_size"] == 8
  assert result["command"] == ("python -m experiments.train_throughput "
                               "--config=experiments/configs/ranking.py:smoke --rounds=1 "
                               f"--chunks_per_round=1 --out={out}")


def test_plain_loops_draw_from_their_own_samplers_and_train(monkeypatch):
  """The throughput baseline the issue names takes its batches from the numpy sampler; the
  second plain loop from the device; both train the same single-seed state."""
  from experiments import train_throughput
  config = ranking_configs.get_config("smoke")
  config.eval_split.num_candidates = config.world.num_candidates - 1   # tells the splits apart
  loops = train_throughput._Loops(config)
  assert loops.host_sampler.split == loops.spec.train_split   # the scanned loop's batches
  assert loops.host_sampler().candidate_mask.shape == (config.train.batch_size,
                                                       config.world.num_candidates)
  calls = {"host": 0, "device": 0}
  real_host, real_device = loops.host_sampler, loops._device_sampled

  def counted(name, fn):
    def call():
      calls[name] += 1
      return fn()
    return call

  # The device-sampled loop draws from the training split too, a new batch each step.
  first, second = real_device(), real_device()
  assert first.candidate_mask.shape == loops.host_sampler().candidate_mask.shape
  assert not np.array_equal(first.batch.candidate_post_hashes,
                            second.batch.candidate_post_hashes)

  class Loss:   # counts the reads of each step's loss back to the host
    reads = 0

    def __init__(self, value):
      self.value = value

    def __float__(self):
      Loss.reads += 1
      return float(self.value)

  real_update = loops._update

  def update(state, batch):
    state, stats = real_update(state, batch)
    return state, {**stats, "loss": Loss(stats["loss"])}

  monkeypatch.setattr(loops, "_update", update)
  monkeypatch.setattr(loops, "host_sampler", counted("host", real_host))
  monkeypatch.setattr(loops, "_device_sampled", counted("device", real_device))
  step = int(loops.plain_state.step)
  table = np.asarray(loops.plain_state.params.tables.post_table)
  loops.plain(3)
  assert calls == {"host": 3, "device": 0}
  loops.plain(2, device_sampled=True)
  assert calls == {"host": 3, "device": 2}
  assert Loss.reads == 5   # every step's loss, as a plain loop logs it
  assert int(loops.plain_state.step) == step + 5
  assert not np.array_equal(np.asarray(loops.plain_state.params.tables.post_table), table)


def test_the_throughput_loops_refuse_a_mesh_and_a_state_too_large_first(monkeypatch):
  """Every loop runs on one device, so any `mesh.*` setting is refused; and a training
  state too large for the device is refused before the trainer is built (and compiled)."""
  from experiments import train_throughput
  for field, value in (("num_devices", 4), ("num_devices", -1),   # -1: all devices, a mesh
                       ("shard_hash_tables", True), ("distributed", True)):
    config = ranking_configs.get_config("smoke")
    config.mesh[field] = value
    with pytest.raises(ConfigError, match=r"leave mesh\.\* at its defaults"):
      train_throughput.check_one_device(config)
  train_throughput.check_one_device(ranking_configs.get_config("smoke"))

  class Refused(Exception):
    pass

  def refuse(_):
    raise Refused

  def trainer(_):
    raise AssertionError("the trainer was built before the placement check")

  monkeypatch.setattr(train_throughput, "check_placement", refuse)
  monkeypatch.setattr(train_throughput, "Trainer", trainer)
  with pytest.raises(Refused):
    train_throughput._Loops(ranking_configs.get_config("smoke"))


@pytest.mark.parametrize("backend,expected", [("cpu", "float32"), ("gpu", "bfloat16"),
                                              ("tpu", "bfloat16")])
def test_forward_dtype_defaults_by_backend(monkeypatch, backend, expected):
  from experiments.configs import ranking, retrieval
  from phoenix_flax.training import parse_config
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  for get_config in (ranking.get_config, retrieval.get_config):
    cfg = get_config("smoke")
    assert parse_config(cfg).model.fprop_dtype == expected
    cfg.model.fprop_dtype = "float32"          # an explicit setting wins everywhere
    assert parse_config(cfg).model.fprop_dtype == "float32"


@pytest.mark.slow
@pytest.mark.parametrize("configs", [ranking_configs, retrieval_configs])
def test_a_bfloat16_forward_trains_end_to_end(tmp_path, configs, cli):
  """The forward dtype that GPU and TPU default to, trained on CPU: the run records it,
  its model computes in it, the loss falls and every final metric is finite."""
  config = configs.get_config("smoke")
  config.model.fprop_dtype = "bfloat16"
  cli(f"{configs.__name__.rsplit('.', 1)[1]}.py:smoke", tmp_path,
      "--config.model.fprop_dtype=bfloat16")
  result = _result(tmp_path)
  assert result["fprop_dtype"] == "bfloat16" and result["steps"] == config.train.num_steps
  final = result["final"]
  # Every final is a finite number, except the per-action AUCs of an action that has no
  # positive (or no negative) in the evaluation lists: null for the model and Bayes alike.
  per_action = {k for k in final if k.rpartition("/")[0].endswith("auc")}
  assert all(v is not None and np.isfinite(v) for k, v in final.items() if k not in per_action)
  for k in per_action:
    twin = k.replace("bayes_auc/", "auc/") if "bayes_auc/" in k else k.replace("auc/",
                                                                               "bayes_auc/", 1)
    assert (final[k] is None) == (final[twin] is None), (k, twin)
    assert final[k] is None or np.isfinite(final[k])
  names = metric_names(parse_config(config))   # traced, not run
  assert set(final) == names.final
  logged = set().union(*read_metrics(str(tmp_path))) - {"step", "wall_seconds"}
  assert logged == names.logged, logged ^ names.logged
  assert json.load(open(tmp_path / "config.json"))["model"]["fprop_dtype"] == "bfloat16"
  run = load_run(str(tmp_path))
  assert run.trainer.spec.model.fprop_dtype == "bfloat16"
  if configs is ranking_configs:   # (20 retrieval steps are too few for a falling loss)
    losses = [r["train/loss"] for r in read_metrics(str(tmp_path)) if "train/loss" in r]
    assert losses[-1] < losses[0]
    # The same parameters in a float32 forward: close, but not equal (bfloat16 was used).
    config.model.fprop_dtype = "float32"
    template = eqx.filter_eval_shape(make_system, parse_config(config), jax.random.PRNGKey(0))
    system32 = jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves(run.system))
    split = run.trainer.spec.train_split
    sb = eqx.filter_jit(lambda world, key: sample_batch(world, split, 4, key))(
        run.trainer.world, jax.random.PRNGKey(1))
    forward = eqx.filter_jit(lambda system, batch: system(batch))
    got, want = forward(run.system, sb.batch), forward(system32, sb.batch)
    diff = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
    assert 0 < diff < 0.1, diff


def test_the_corpus_oracle_is_the_true_top_k_and_a_reference_not_a_ceiling():
  """`bayes_corpus_hits` counts the top k of the true favorite logit over the whole corpus,
  in user chunks of any size. Its recall is not a ceiling: recall counts favorites among
  the candidates the sampler drew, and ranking by the chance of being drawn (the sampler's
  topic softmax) times the favorite probability scores above it, on the cpu preset's
  first 40 evaluation batches of 128 lists (docs/training.md, "The retrieval task")."""
  from phoenix_flax.synthetic import true_logits
  from phoenix_flax.training.loop import bayes_corpus_hits
  spec = parse_config(retrieval_configs.get_config("cpu"))
  world = make_world(spec.world, jax.random.PRNGKey(spec.config.world_seed))   # the run's
  split, wc = spec.eval_splits["eval"], spec.world
  N, T, K = wc.num_posts, wc.num_topics, 100
  topic_N = np.arange(N) % T
  per_topic_N = np.bincount(topic_N, minlength=T)[topic_N]
  sample = jax.jit(sample_batch, static_argnums=(1, 2))
  oracle, draw_aware = [], []
  for i in range(40):
    key = jax.random.fold_in(jax.random.PRNGKey(spec.config.eval_seed), i)
    sb = sample(world, split, 128, key)
    bias_B = world.user_bias_U[sb.user_ids]
    logit_BN = np.asarray(true_logits(world, sb.interest[:, None, :], jnp.arange(N)[None],
                                      jnp.zeros((1, N), jnp.int32), jnp.zeros((1, N)),
                                      bias_B[:, None])[..., 0])
    if i == 0:   # the oracle's counts (in chunks of 16 users) are those of the true top k
      positive_BC = (np.asarray(sb.labels)[..., 0] > 0) & np.asarray(sb.candidate_mask)
      ids = np.asarray(sb.candidate_post_ids)
      found, _ = bayes_corpus_hits(world, sb.interest, bias_B, 0, ids, positive_BC, (K,),
                                   budget=16 * N * (wc.latent_dim + wc.num_actions))
      top = np.argsort(-logit_BN, 1)[:, :K]
      want = [sum(p and i in set(top[b]) for i, p in zip(ids[b], positive_BC[b]))
              for b in range(len(ids))]
      np.testing.assert_array_equal(found[:, 0], want)
      assert sum(want) > 0
      # A budget of 48 users, which 128 lists do not divide into: chunks of 32 then.
      found_32, _ = bayes_corpus_hits(world, sb.interest, bias_B, 0, ids, positive_BC, (K,),
                                      budget=48 * N * (wc.latent_dim + wc.num_actions))
      np.testing.assert_array_equal(found_32, found)
    topic_logits_BT = wc.retrieval_sharpness * np.asarray(sb.interest) @ np.asarray(
        world.topic_vecs_TL).T
    topic_BT = np.exp(topic_logits_BT - topic_logits_BT.max(1, keepdims=True))
    topic_BT /= topic_BT.sum(1, keepdims=True)
    drawn_BN = (split.relevant_fraction * topic_BT[:, topic_N] / per_topic_N
                + (1 - split.relevant_fraction) / N)
    favored_BC = (np.asarray(sb.labels)[..., 0] > 0) & np.asarray(sb.candidate_mask)
    ids_BC = np.asarray(sb.candidate_post_ids)
    favorite_BN = 1 / (1 + np.exp(-logit_BN))
    for scores_BN, out in ((logit_BN, oracle), (drawn_BN * favorite_BN, draw_aware)):
      kth_B = -np.partition(-scores_BN, K - 1, axis=1)[:, K - 1]
      in_top_BC = np.take_along_axis(scores_BN, ids_BC, 1) >= kth_B[:, None]
      has_B = favored_BC.any(1)
      out.extend((in_top_BC & favored_BC).sum(1)[has_B] / favored_BC.sum(1)[has_B])
  gain = np.asarray(draw_aware) - np.asarray(oracle)
  print(f"recall@{K}: oracle {np.mean(oracle):.3f}, draw-aware {np.mean(draw_aware):.3f}, "
        f"{len(gain)} users, standard error of the difference "
        f"{gain.std(ddof=1) / np.sqrt(len(gain)):.4f}")   # docs/training.md's figures (pytest -s)
  assert len(gain) > 4000
  assert gain.mean() > 3 * gain.std(ddof=1) / np.sqrt(len(gain)), (
      np.mean(oracle), np.mean(draw_aware), len(gain))


def test_training_loop_makes_no_implicit_transfer(tmp_path, monkeypatch):
  """Once its programs are compiled, the run's loop (scanned chunks, evaluations,
  checkpoints, logs) sends nothing to the device implicitly: `jax_transfer_guard`
  "disallow", which a careful user may switch on, lets the run finish. (On CPU the guard
  sees host-to-device transfers only; reading device arrays back is not guarded there.)"""
  from phoenix_flax.training import runner
  loop_of = runner._train_group

  def guarded(*args, **kwargs):
    with jax.transfer_guard("disallow"):
      return loop_of(*args, **kwargs)

  monkeypatch.setattr(runner, "_train_group", guarded)
  config = smoke_config(num_steps=20, eval_every=10, checkpoint_every=10)
  assert runner.run_experiment(config, str(tmp_path / "run"))[0]["steps"] == 20
  # The guard works: a NumPy argument of a jitted call is an implicit transfer (jax 0.8.0
  # to 0.11.2 all guard it; `jnp.asarray` of one counted as explicit, so allowed, in 0.8
  # and 0.9).
  with pytest.raises(Exception, match="Disallowed host-to-device"):
    with jax.transfer_guard("disallow"):
      jax.jit(lambda x: x * 2)(np.ones(3))
