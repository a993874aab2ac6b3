"""Two-tower retrieval: candidate tower modes, user tower, top-k and corpus masking."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phoenix_flax as pf
from conftest import EMB, call, make_batch, retrieval_config
from phoenix_flax import haiku_compat
from phoenix_flax.retrieval import l2_normalize

B, C, HASHES, CORPUS, TOP_K = 4, 8, 4, 100, 10


def tower_input(seed=0):
  x = np.random.default_rng(seed).standard_normal((B, C, HASHES, EMB)) * 2
  return jnp.asarray(x, jnp.float32)


def unit_norms(x):
  return jnp.sqrt(jnp.sum(jnp.square(x), axis=-1))


def test_l2_normalize_of_short_and_zero_vectors():
  """Any vector with |x|^2 above 1e-12 comes out unit length; the zero vector stays zero
  (no NaN); the norm returned is |x| itself, floored at 1e-6."""
  x = jnp.asarray([[3e-4, 4e-4], [3.0, 4.0], [0.0, 0.0]], jnp.float32)
  unit, norm = call(l2_normalize, x)
  np.testing.assert_allclose(unit, [[0.6, 0.8], [0.6, 0.8], [0.0, 0.0]], rtol=1e-6)
  np.testing.assert_allclose(norm[:, 0], [5e-4, 5.0, 1e-6], rtol=1e-6)


def test_candidate_tower_mlp_shape_norm_and_formula():
  tower = pf.CandidateTower(EMB, HASHES, key=jax.random.key(0))
  assert tower.projection_1.shape == (HASHES * EMB, 2 * EMB)
  assert tower.projection_2.shape == (2 * EMB, EMB)
  x = tower_input()
  out = call(tower, x)
  assert out.shape == (B, C, EMB)
  np.testing.assert_allclose(unit_norms(out), 1.0, atol=1e-5)
  h = np.asarray(x).reshape(B, C, -1) @ np.asarray(tower.projection_1)
  h = (h / (1 + np.exp(-h))) @ np.asarray(tower.projection_2)
  np.testing.assert_allclose(out, h / np.linalg.norm(h, axis=-1, keepdims=True), atol=1e-5)


def test_candidate_tower_mean_pool_has_no_parameters():
  tower = pf.CandidateTower(EMB, HASHES, enable_linear_proj=False, key=jax.random.key(0))
  leaves = jax.tree.leaves(eqx.filter(tower, eqx.is_array))
  assert len(leaves) == 0 and sum(x.size for x in leaves) == 0
  x = tower_input(1)
  out = call(tower, x)
  assert out.shape == (B, C, EMB)
  np.testing.assert_allclose(unit_norms(out), 1.0, atol=1e-5)
  mean = np.asarray(x).mean(axis=2)
  np.testing.assert_allclose(out, mean / np.linalg.norm(mean, axis=-1, keepdims=True),
                             atol=1e-5)
  # bfloat16 embeddings are pooled in float32 (the docstring's unit vectors in float32).
  x16 = x.astype(jnp.bfloat16)
  out16 = call(tower, x16)
  mean = np.asarray(x16, np.float64).mean(axis=2)
  assert out16.dtype == jnp.float32
  np.testing.assert_allclose(out16, mean / np.linalg.norm(mean, axis=-1, keepdims=True),
                             atol=1e-5)
  # Below the normalisation's 1e-6 floor the mean's own length shows (a sum's would not
  # match): a mean of norm sqrt(32) * 1e-7 = 5.7e-7 comes out at 0.57.
  tiny = call(tower, jnp.full((1, 1, HASHES, EMB), 1e-7, jnp.float32))
  np.testing.assert_allclose(unit_norms(tiny), np.sqrt(EMB) * 0.1, rtol=1e-5)


def test_candidate_tower_checks_its_input():
  tower = pf.CandidateTower(EMB, HASHES, key=jax.random.key(0))
  with pytest.raises(AssertionError, match="CandidateTower"):
    tower(tower_input()[:, :, 0])
  with pytest.raises(ValueError, match="hashes"):
    tower(tower_input()[:, :, :3])
  with pytest.raises(ValueError, match="emb size"):
    tower(tower_input()[..., :16])


def model_and_batch(enable_linear_proj=True, **batch_kw):
  cfg = retrieval_config(enable_linear_proj=enable_linear_proj)
  model = pf.PhoenixRetrievalModel(cfg, key=jax.random.key(0))
  return model, *make_batch(cfg, 2, 0, **batch_kw)


def corpus(seed=0):
  x = np.random.default_rng(seed).standard_normal((CORPUS, EMB))
  return jnp.asarray(x / np.linalg.norm(x, axis=-1, keepdims=True), jnp.float32)


def retrieve(model, batch, emb, corpus_embeddings, corpus_mask=None, top_k=TOP_K):
  return call(lambda m, b, e, c, k: m(b, e, c, top_k, k), model, batch, emb,
              corpus_embeddings, corpus_mask)


def test_forward_shapes_unit_norm_and_sorted_top_k():
  model, batch, emb = model_and_batch(history_valid=[4, 1])
  corp = corpus()
  out = retrieve(model, batch, emb, corp)
  assert out.user_representation.shape == (2, EMB)
  assert out.top_k_indices.shape == (2, TOP_K) and out.top_k_indices.dtype == jnp.int32
  assert out.top_k_scores.shape == (2, TOP_K)
  np.testing.assert_allclose(unit_norms(out.user_representation), 1.0, atol=1e-5)
  idx = np.asarray(out.top_k_indices)
  assert np.all((idx >= 0) & (idx < CORPUS))
  scores = np.asarray(out.top_k_scores)
  assert np.all(scores[:, :-1] >= scores[:, 1:])
  full = np.asarray(out.user_representation) @ np.asarray(corp).T
  np.testing.assert_array_equal(idx, np.argsort(-full, axis=1)[:, :TOP_K])
  np.testing.assert_allclose(scores, np.take_along_axis(full, idx, axis=1), atol=1e-5)


def test_user_forward_diagnostics_are_the_user_towers():
  """`user_forward`'s diagnostics (which retrieval training logs) are its transformer's on
  the user's context tokens: each layer's max |attention logit| and residual RMS."""
  model, batch, emb = model_and_batch(history_valid=[4, 1])

  def both(model, batch, emb):
    _, _, diag = model.user_forward(batch, emb)
    return diag, model.transformer(*pf.ranking.context_tokens(model, batch, emb))
  diag, out = call(both, model, batch, emb)
  assert diag.max_abs_attn_logit.shape == (model.config.model.num_layers,)
  np.testing.assert_array_equal(diag.max_abs_attn_logit, out.max_abs_attn_logit)
  np.testing.assert_array_equal(diag.residual_rms, out.residual_rms)
  assert np.all(np.asarray(diag.max_abs_attn_logit) != np.asarray(diag.residual_rms))


def test_user_representation_ignores_padded_history():
  model, batch, emb = model_and_batch(history_valid=[2, 4])
  rep = lambda m, b, e: m.build_user_representation(b, e)
  user, norm = call(rep, model, batch, emb)
  assert norm.shape == (2, 1) and np.all(np.asarray(norm) > 0)
  noisy = emb._replace(history_post_embeddings=emb.history_post_embeddings.at[0, 2:].add(5.0))
  user2, _ = call(rep, model, batch, noisy)
  np.testing.assert_allclose(user2, user, atol=1e-6)
  changed = emb._replace(history_post_embeddings=emb.history_post_embeddings.at[0, 1].add(5.0))
  user3, _ = call(rep, model, batch, changed)
  assert float(jnp.max(jnp.abs(user3[0] - user[0]))) > 1e-3
  np.testing.assert_allclose(user3[1], user[1], atol=1e-6)


@pytest.mark.parametrize("enable_linear_proj", [True, False])
def test_candidate_representation_unit_norm_and_mask(enable_linear_proj):
  model, batch, emb = model_and_batch(enable_linear_proj,
                                      candidate_mask=[[1, 0, 1], [1, 1, 1]])
  reps, mask = call(lambda m, b, e: m.build_candidate_representation(b, e), model, batch, emb)
  assert reps.shape == (2, 3, EMB)
  np.testing.assert_allclose(unit_norms(reps), 1.0, atol=1e-5)
  np.testing.assert_array_equal(mask, [[True, False, True], [True, True, True]])
  # Padding is a 0 in the first post hash, as in the release; other hash columns may be 0.
  post = np.asarray(batch.candidate_post_hashes).copy()
  post[0, 0, 1:] = 0
  post[1, 2, 0] = 0
  _, mask = call(lambda m, b, e: m.build_candidate_representation(b, e), model,
                 batch._replace(candidate_post_hashes=jnp.asarray(post)), emb)
  np.testing.assert_array_equal(mask, [[True, False, True], [True, True, False]])


def test_corpus_mask_excludes_items():
  model, batch, emb = model_and_batch()
  corp = corpus(1)
  user = retrieve(model, batch, emb, corp).user_representation
  best = np.argsort(-(np.asarray(user) @ np.asarray(corp).T), axis=1)[:, :TOP_K]
  mask = np.ones(CORPUS, bool)
  mask[best.ravel()] = False
  out = retrieve(model, batch, emb, corp, jnp.asarray(mask))
  assert not np.any(np.isin(np.asarray(out.top_k_indices), best))
  assert np.all(mask[np.asarray(out.top_k_indices)])
  few = np.zeros(CORPUS, bool)
  few[[3, 50, 97]] = True
  out = retrieve(model, batch, emb, corp, jnp.asarray(few))
  assert set(np.asarray(out.top_k_indices)[:, :3].ravel()) == {3, 50, 97}
  # masked entries score -1e12, as the release (SPEC) does
  np.testing.assert_array_equal(out.top_k_scores[:, 3:], np.float32(-1e12))


def test_a_per_user_corpus_mask_masks_each_users_row():
  """A `[B, N]` mask (each user's own exclusions, such as the posts it has seen) gives
  each user what the `[N]` mask of its own row gives it."""
  model, batch, emb = model_and_batch()
  corp = corpus(2)
  mask_BN = np.random.default_rng(0).random((2, CORPUS)) < 0.5
  out = retrieve(model, batch, emb, corp, jnp.asarray(mask_BN))
  for b in range(2):
    assert np.all(mask_BN[b][np.asarray(out.top_k_indices[b])])
    alone = retrieve(model, batch, emb, corp, jnp.asarray(mask_BN[b]))
    np.testing.assert_array_equal(out.top_k_indices[b], alone.top_k_indices[b])
    np.testing.assert_array_equal(out.top_k_scores[b], alone.top_k_scores[b])


def test_retrieve_checks_arguments():
  retrieve = model_and_batch()[0].retrieve
  user = jnp.ones((2, EMB)) / np.sqrt(EMB)
  with pytest.raises(AssertionError, match="corpus_embeddings"):
    retrieve(user, corpus()[None], 3)
  with pytest.raises(ValueError, match="corpus_embeddings"):
    retrieve(user, corpus()[:, :16], 3)
  too_many = rf"top_k={CORPUS + 1} must be an integer in \[1, {CORPUS}\] \(corpus size\)"
  with pytest.raises(ValueError, match=too_many):   # ours, not lax.top_k's own error
    retrieve(user, corpus(), CORPUS + 1)
  for bad in (0, True, 2.0):   # True read as 1; 2.0 failed inside lax.top_k, or passed
    with pytest.raises(ValueError, match=rf"top_k={bad!r} must be an integer"):
      retrieve(user, corpus(), bad)
  whole = retrieve(user, corpus(), CORPUS)     # the whole corpus, best first
  np.testing.assert_array_equal(np.sort(whole.top_k_indices[0]), np.arange(CORPUS))
  assert np.all(np.diff(np.asarray(whole.top_k_scores), axis=1) <= 0)
  for shape in ((CORPUS - 1,), (3, CORPUS), (2, CORPUS, 1)):
    with pytest.raises(ValueError, match=rf"corpus_mask has shape \({shape[0]},.*expected "
                       rf"\({CORPUS},\) or \(2, {CORPUS}\)"):
      retrieve(user, corpus(), 3, jnp.ones(shape, bool))
  with pytest.raises(ValueError, match="corpus_embeddings has dtype int32, expected floats"):
    retrieve(user, jnp.ones((CORPUS, EMB), jnp.int32), 3)
  # A float mask is refused rather than read as "nonzero keeps": 0.5 is no answer.
  with pytest.raises(ValueError, match="corpus_mask has dtype float32, expected bool"):
    retrieve(user, corpus(), 3, jnp.full(CORPUS, 0.5))


@pytest.mark.parametrize("field", ["user_hashes", "history_post_hashes",
                                   "history_product_surface", "history_actions"])
def test_wrong_batch_shape_names_the_field(field):
  model, batch, emb = model_and_batch()
  x = getattr(batch, field)
  batch = batch._replace(**{field: jnp.zeros(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype)})
  with pytest.raises((AssertionError, ValueError), match=field):
    model.build_user_representation(batch, emb)


def test_wrong_embedding_shape_names_the_field():
  model, batch, emb = model_and_batch()
  emb = emb._replace(history_author_embeddings=emb.history_author_embeddings[..., :16])
  with pytest.raises(AssertionError, match="history_author_embeddings"):
    model.build_user_representation(batch, emb)


def test_candidate_representation_checks_its_fields():
  model, batch, emb = model_and_batch()
  model.build_candidate_representation(batch, emb)
  with pytest.raises(AssertionError, match="candidate_author_embeddings"):
    model.build_candidate_representation(
        batch, emb._replace(candidate_author_embeddings=emb.candidate_author_embeddings[..., :-1]))
  with pytest.raises(AssertionError, match="candidate_post_embeddings must hold floats"):
    model.build_candidate_representation(
        batch, emb._replace(candidate_post_embeddings=emb.candidate_post_embeddings > 0))
  with pytest.raises(AssertionError, match="candidate_post_hashes"):
    model.build_candidate_representation(
        batch._replace(candidate_post_hashes=batch.candidate_post_hashes[:1]), emb)


def test_candidate_tower_refuses_integer_embeddings():
  # Integers used to be cast to float32 and scored without a word.
  tower = pf.CandidateTower(8, 4, key=jax.random.key(0))
  with pytest.raises(AssertionError, match="float embeddings"):
    tower(jnp.ones((1, 2, 4, 8), jnp.int32))


@pytest.mark.parametrize("emb_size, num_hashes", [(8, 0), (0, 4), (8, 2.0), (-8, 4)])
def test_candidate_tower_refuses_bad_sizes(emb_size, num_hashes):
  # (8, 0) used to build a [0, 16] projection.
  with pytest.raises(ValueError, match="must be an integer >= 1"):
    pf.CandidateTower(emb_size, num_hashes, key=jax.random.key(0))


def _transformer_switch_cases():
  """(switch, value): each `TransformerConfig` switch the ranking grid must set, at the
  first value its grid sets (tests/test_ranking.py)."""
  from test_ranking import GRID, GRID_SWITCHES, _field_default
  out = []
  for field in sorted(GRID_SWITCHES[pf.TransformerConfig]):
    default = _field_default(pf.TransformerConfig, field)
    value = next(c[field] for c in GRID.values() if field in c and c[field] != default)
    out.append((field, value))
  return out


@pytest.mark.parametrize("switch, value", _transformer_switch_cases())
def test_every_transformer_switch_reaches_the_user_tower(switch, value):
  """A `TransformerConfig` switch reaches the retrieval model's user tower too (the same
  transformer): the user representations move when it is set."""
  from conftest import transformer_config
  reps = []
  for overrides in ({}, {switch: value}):
    config = retrieval_config(transformer=transformer_config(**overrides))
    model = pf.PhoenixRetrievalModel(config, key=jax.random.key(0))
    batch, emb = make_batch(config, 2, 3)
    reps.append(call(lambda m, b, e: m.build_user_representation(b, e)[0], model, batch, emb))
  assert float(jnp.max(jnp.abs(reps[0] - reps[1]))) > 1e-5, f"{switch}={value!r}"


# The `PhoenixRetrievalModelConfig` fields that retrieval tests must set away from their
# defaults: every one that export refuses away from its default (every new switch, until it
# joins `haiku_compat._FREE_FIELDS`; the release's fields are all free, so none yet), and
# `enable_linear_proj` (free, since the later release names the tower's parameters, but it
# changes what the model computes), as `right_anchored_rope` is for the ranking grid. The
# transformer's switches are the ranking grid's (`GRID_SWITCHES` of tests/test_ranking.py),
# and `test_every_transformer_switch_reaches_the_user_tower` above covers them here. Each
# must be set by a case of RETRIEVAL_CASES below, of `RETRIEVAL_CONFIGS`
# (tests/test_flax_nnx.py) and of `GRADIENT_CASES` (tests/test_training.py).
RETRIEVAL_SWITCHES = ({f.name for f in dataclasses.fields(pf.PhoenixRetrievalModelConfig)}
                      - haiku_compat._FREE_FIELDS[pf.PhoenixRetrievalModelConfig]
                      | {"enable_linear_proj"})
# Retrieval model cases: their keys go to the `PhoenixRetrievalModelConfig` fields of their
# names (the conftest's small transformer and shapes otherwise); together they set every
# retrieval switch (`test_every_retrieval_switch_is_set_in_a_case` checks it).
RETRIEVAL_CASES = {
    "mean_pool": dict(enable_linear_proj=False),
}


def _retrieval_case(name: str, case: dict) -> pf.PhoenixRetrievalModelConfig:
  """The config of a retrieval case; a key that names no retrieval-model field is refused
  instead of falling back to the default (the transformer's fields go to the ranking
  grid)."""
  fields = {f.name for f in dataclasses.fields(pf.PhoenixRetrievalModelConfig)}
  unknown = set(case) - (fields - {"model"})
  if unknown:
    raise KeyError(f"retrieval case {name!r}: {sorted(unknown)} name no "
                   "PhoenixRetrievalModelConfig field")
  return retrieval_config(**case)


def test_every_retrieval_switch_is_set_in_a_case():
  """Step 6 of adding an idea: a `PhoenixRetrievalModelConfig` switch has no isolated-vs-
  dense grid, so a case of RETRIEVAL_CASES sets it away from its default and the test
  below checks that it changes what the model computes (a switch that no path implements
  would pass every other retrieval test). A typo in a case is an error too."""
  from test_ranking import _field_default
  for name, case in RETRIEVAL_CASES.items():
    config = _retrieval_case(name, case)
    assert all(getattr(config, k) == v for k, v in case.items()), name
  for field in sorted(RETRIEVAL_SWITCHES):
    default = _field_default(pf.PhoenixRetrievalModelConfig, field)
    assert any(field in c and c[field] != default for c in RETRIEVAL_CASES.values()), (
        f"PhoenixRetrievalModelConfig.{field} is set away from its default ({default!r}) by "
        "no case of RETRIEVAL_CASES (tests/test_retrieval.py)")
  with pytest.raises(KeyError, match=r"\['enable_linear_prj'\] name no"):
    _retrieval_case("typo", dict(enable_linear_prj=False))


def _with_shared_arrays(model, reference, seed: int = 0):
  """`model` with every array that `reference` has too (same path and shape) taken from
  `reference`, and each of its own (the switch's parameters) moved off its initial value
  by noise: so the two differ only in what the switch changes, and a parameter that starts
  as the identity (a scale at 1, a gate at 0) acts."""
  rng = np.random.default_rng(seed)
  shared = {jax.tree_util.keystr(p): x
            for p, x in jax.tree_util.tree_leaves_with_path(eqx.filter(reference, eqx.is_array))}
  params, static = eqx.partition(model, eqx.is_array)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  out = []
  for path, x in leaves:
    same = shared.get(jax.tree_util.keystr(path))
    out.append(same if same is not None and same.shape == x.shape else
               x + jnp.asarray(0.5 * rng.standard_normal(x.shape), x.dtype))
  return eqx.combine(jax.tree_util.tree_unflatten(treedef, out), static)


def _retrieval_outputs(model, batch, emb, corpus_ND):
  """What training and serving read: the user vectors, `scores` against the batch's
  candidates (the in-batch loss's) and `retrieve`'s scores over the whole corpus."""
  user_BD, _ = model.build_user_representation(batch, emb)
  cand_BCD, _ = model.build_candidate_representation(batch, emb)
  scores_BN = model.scores(user_BD, cand_BCD.reshape(-1, cand_BCD.shape[-1]))
  return user_BD, scores_BN, model.retrieve(user_BD, corpus_ND, corpus_ND.shape[0]).top_k_scores


@pytest.mark.parametrize("name, switch", [(name, key) for name, case in RETRIEVAL_CASES.items()
                                          for key in case if key in RETRIEVAL_SWITCHES])
def test_every_retrieval_switch_changes_the_scores(name, switch):
  """A retrieval switch that no path implements (or whose parameters start as the identity
  and are never read) passes every other test: each switch a case sets must move the user
  vectors or the scores against the same case with that switch at its default, the two
  models sharing every array they both have."""
  without = {k: v for k, v in RETRIEVAL_CASES[name].items() if k != switch}
  off = pf.PhoenixRetrievalModel(_retrieval_case(name, without), key=jax.random.key(0))
  on = pf.PhoenixRetrievalModel(_retrieval_case(name, RETRIEVAL_CASES[name]),
                                key=jax.random.key(0))
  on = _with_shared_arrays(on, off)
  batch, emb = make_batch(on.config, 2, 4)
  outs = [call(_retrieval_outputs, m, batch, emb, corpus(2)) for m in (on, off)]
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(*outs))
  assert moved > 1e-5, (f"{switch}={RETRIEVAL_CASES[name][switch]!r} moves neither the user "
                        f"vectors nor the scores (RETRIEVAL_CASES[{name!r}], "
                        "tests/test_retrieval.py)")
