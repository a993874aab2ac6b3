"""The package's per-program XLA compile options (phoenix_flax/xla_options.py)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest
from experiments.configs import ranking as ranking_configs
from phoenix_flax import xla_options
from phoenix_flax.training import Trainer, parse_config

OPTION = "xla_cpu_experimental_ynn_fusion_type"


@pytest.fixture
def clean_env(monkeypatch):
  monkeypatch.delenv(xla_options.DISABLE_ENV, raising=False)
  monkeypatch.setenv("XLA_FLAGS", "")
  return monkeypatch


def test_cpu_gets_the_options_this_jaxlib_accepts(clean_env):
  got = xla_options.compiler_options("cpu")
  want = xla_options.CPU_OPTIONS if xla_options._accepted(xla_options.CPU_OPTIONS, "cpu") else {}
  assert got == want
  if jax.__version_info__ >= (0, 10):   # the jaxlib whose YNNPACK fusions the option disables
    assert got == xla_options.CPU_OPTIONS
  got["mutated"] = 1                          # callers get their own dict
  assert "mutated" not in xla_options.compiler_options("cpu")


def test_unknown_option_is_refused_not_fatal():
  assert not xla_options._accepted({"xla_no_such_option_anywhere": ""}, "cpu")


def test_a_jaxlib_that_refuses_the_options_gets_none(clean_env):
  """Options this jaxlib does not know would fail every compile: none are passed."""
  clean_env.setattr(xla_options, "_accepted", lambda options, backend: False)
  xla_options._options_for.cache_clear()
  try:
    assert xla_options.compiler_options("cpu") == {}
  finally:   # (no answer of the stand-in stays cached)
    xla_options._options_for.cache_clear()


def test_off_switches(clean_env):
  assert xla_options.compiler_options("gpu") == {}
  assert xla_options.compiler_options("tpu") == {}
  clean_env.setenv(xla_options.DISABLE_ENV, "0")
  assert xla_options.compiler_options("cpu") == {}
  clean_env.setenv(xla_options.DISABLE_ENV, "1")
  clean_env.setenv("XLA_FLAGS", f"--{OPTION}=default --xla_cpu_use_xnnpack=true")
  assert xla_options.compiler_options("cpu") == {}     # the user's XLA_FLAGS setting stands
  # The CPU options are the CPU compiler's, even where another backend would accept them.
  clean_env.delenv(xla_options.DISABLE_ENV)
  clean_env.setenv("XLA_FLAGS", "")
  clean_env.setattr(xla_options, "_accepted", lambda options, backend: True)
  xla_options._options_for.cache_clear()
  try:
    for backend in ("gpu", "tpu", "cuda", "rocm", "METAL"):
      assert xla_options.compiler_options(backend) == {}, backend
    assert xla_options.compiler_options("cpu") == xla_options.CPU_OPTIONS
  finally:   # (no answer of the stand-in stays cached)
    xla_options._options_for.cache_clear()


def test_trainer_chunk_is_compiled_with_the_options(clean_env):
  if jax.default_backend() != "cpu":   # test_off_switches covers the other backends
    pytest.skip("the options are the CPU compiler's; this backend compiles without them")
  if not xla_options.compiler_options("cpu"):
    assert jax.__version_info__ < (0, 10), "jax >= 0.10 must accept the option"
    pytest.skip("this jaxlib has no YNNPACK fusion option")
  trainer = Trainer(parse_config(ranking_configs.get_config("smoke")))
  state = trainer.init([0])
  text = trainer._chunk.lower(trainer.world, state).compile().compiled.as_text()
  plain = jax.jit(lambda x: jnp.sum(jnp.tanh(x) * x, axis=-1)).lower(
      jnp.ones((64, 256))).compile().as_text()
  fusions = lambda hlo: re.findall(r"%ynn_fusion[.\w]* = ", hlo)  # op names, not metadata
  assert fusions(plain)                   # XLA's default for a program like this one ...
  assert not fusions(text)                # ... is not what the trainer runs


def test_filter_jit_matches_default_compilation(clean_env):
  x = jax.random.normal(jax.random.key(0), (32, 48))
  f = lambda x: jnp.sum(jax.nn.gelu(x @ x.T) * 2.0, axis=-1)
  np.testing.assert_allclose(xla_options.filter_jit(f)(x), jax.jit(f)(x), rtol=1e-5,
                             atol=1e-5)


def test_a_top_level_call_compiles_with_the_options_a_nested_one_without(clean_env):
  """The options reach the compiler of every top-level call, not only `.lower`: with an
  option XLA refuses, the call fails, while a call inlined into an outer trace (which
  compiles with the outer program's options) runs."""
  clean_env.setattr(xla_options, "compiler_options",
                    lambda backend=None: {"xla_no_such_option_anywhere": "1"})
  f = xla_options.filter_jit(lambda x: jnp.tanh(x) * 2.0)
  x = jnp.linspace(-1.0, 1.0, 8)
  with pytest.raises(Exception, match="xla_no_such_option_anywhere"):
    f(x)
  np.testing.assert_allclose(jax.jit(lambda x: f(x))(x), jnp.tanh(x) * 2.0, rtol=1e-6)
  # a tracer passed by keyword alone makes a nested call too
  np.testing.assert_allclose(jax.jit(lambda x: f(x=x))(x), jnp.tanh(x) * 2.0, rtol=1e-6)
  # and so does one traced argument among concrete ones, under jit or vmap
  g = xla_options.filter_jit(lambda x, y: jnp.tanh(x) * y)
  np.testing.assert_allclose(jax.jit(lambda x: g(x, 2.0))(x), jnp.tanh(x) * 2.0, rtol=1e-6)
  np.testing.assert_allclose(jax.vmap(g, in_axes=(0, None))(x, 2.0), jnp.tanh(x) * 2.0,
                             rtol=1e-6)


def test_filter_jit_runs_nested_under_other_traces(clean_env):
  f = xla_options.filter_jit(lambda x: jnp.tanh(x) * 2.0)
  x = jnp.linspace(-1.0, 1.0, 8)
  np.testing.assert_allclose(jax.jit(lambda x: f(x) + 1.0)(x), f(x) + 1.0, rtol=1e-6)
  assert jax.eval_shape(f, x).shape == (8,)
  np.testing.assert_allclose(jax.vmap(f)(x[:, None])[:, 0], f(x), rtol=1e-6)
  trainer = Trainer(parse_config(ranking_configs.get_config("smoke")))
  shapes = jax.eval_shape(trainer.init, [0])       # as ablations/sweep.py's load_systems does
  assert shapes.step.shape == (1,)


def test_session_passes_only_the_quick_compile_flags_this_jaxlib_knows(monkeypatch):
  """An unknown XLA_FLAGS entry ends the process when a backend starts (jaxlib 0.12 dropped
  `--xla_cpu_use_fusion_emitters`, one of the test session's quick-compile flags), so
  tests/conftest.py passes only the flags its subprocess probe found known."""
  unknown = "--xla_phoenix_flax_no_such_flag=true"
  monkeypatch.setattr(conftest, "_QUICK_FLAGS", (*conftest._QUICK_FLAGS, unknown))
  monkeypatch.delenv(conftest._KNOWN_QUICK_ENV, raising=False)
  monkeypatch.delenv(conftest.OPTIMIZED_ENV, raising=False)
  monkeypatch.setenv("XLA_FLAGS", "")
  flags = conftest.quick_xla_flags().split()
  assert unknown not in flags
  assert "--xla_backend_optimization_level=0" in flags     # known to every jaxlib >= 0.6
  assert "--xla_gpu_deterministic_ops=true" in flags      # XLA:CPU knows it and ignores it
  assert conftest._xla_starts_with(flags)
  assert not conftest._xla_starts_with([unknown])
  monkeypatch.setenv(conftest.OPTIMIZED_ENV, "1")   # XLA's optimisations, still deterministic
  assert conftest.quick_xla_flags().split() == ["--xla_gpu_deterministic_ops=true"]
