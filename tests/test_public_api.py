"""The packages' `__all__`: what `from phoenix_flax import *` gives, and what is public."""

from __future__ import annotations

import importlib
import types

import pytest

PACKAGES = ["phoenix_flax", "phoenix_flax.training", "phoenix_flax.synthetic"]

# DESIGN.md's "Public API (stable names)": users and ported release code rely on these.
STABLE = ["TransformerConfig", "HashConfig", "PhoenixModelConfig", "PhoenixRetrievalModelConfig",
          "Transformer", "PhoenixModel", "PhoenixRetrievalModel", "CandidateTower",
          "RecsysBatch", "RecsysEmbeddings", "RecsysModelOutput", "RetrievalOutput",
          "make_recsys_attn_mask", "right_anchored_rope_positions", "ffn_size",
          "compute_post_age_bucket", "NormConfig", "normalize_continuous_value", "ACTIONS",
          "RankingRunner", "RetrievalRunner", "RankingOutput", "haiku_compat"]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_lists_exactly_the_public_names_the_package_imports(name):
  """Every public name an `__init__` imports is in its `__all__` (a name added to the
  imports but not to `__all__` would be missing from `import *` and from the API docs),
  and every entry of `__all__` resolves, once."""
  package = importlib.import_module(name)
  exported = package.__all__
  assert len(exported) == len(set(exported)), sorted(n for n in exported
                                                     if exported.count(n) > 1)
  missing = [n for n in exported if not hasattr(package, n)]
  assert not missing, f"{name}.__all__ names what the package does not define: {missing}"
  # Submodules become attributes of their package as a side effect of being imported; only
  # those the `__init__` imports by name (haiku_compat) are public.
  public = {n for n, v in vars(package).items()
            if not n.startswith("_") and not isinstance(v, types.ModuleType)}
  assert public - set(exported) == set(), f"{name}.__all__ lacks {public - set(exported)}"


def test_star_import_gives_the_stable_names_of_the_design():
  namespace: dict = {}
  exec("from phoenix_flax import *", namespace)   # noqa: S102 - the statement under test
  namespace.pop("__builtins__")
  import phoenix_flax
  assert set(namespace) == set(phoenix_flax.__all__)
  assert set(STABLE) <= set(namespace), sorted(set(STABLE) - set(namespace))
  assert isinstance(namespace["haiku_compat"], types.ModuleType)
  for fn in ("ranking_model_from_haiku", "retrieval_model_from_haiku",
             "ranking_model_to_haiku", "retrieval_model_to_haiku"):
    assert callable(getattr(namespace["haiku_compat"], fn))


def test_the_session_broadcasts_and_promotes_strictly():
  """conftest.py runs every test, in this process, its xdist workers and its subprocesses,
  under `jax_numpy_rank_promotion="raise"` and `jax_numpy_dtype_promotion="strict"`: the
  package must broadcast arrays of different ranks and convert between dtypes explicitly,
  so that projects with those settings can use it."""
  import jax
  import jax.numpy as jnp

  from conftest import subprocess_env
  assert jax.config.jax_numpy_rank_promotion == "raise"
  assert subprocess_env()["JAX_NUMPY_RANK_PROMOTION"] == "raise"
  with pytest.raises(ValueError, match="jax_numpy_rank_promotion='raise'"):
    jnp.ones(3) * jnp.ones((2, 3))
  assert jax.config.jax_numpy_dtype_promotion == "strict"
  assert subprocess_env()["JAX_NUMPY_DTYPE_PROMOTION"] == "strict"
  with pytest.raises(jax.dtypes.TypePromotionError):
    jnp.ones(3, jnp.int32) * 0.5
