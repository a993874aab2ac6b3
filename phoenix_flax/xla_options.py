"""XLA compile options that the package's own `jit`s pass (`compiler_options=`).

On CPU, jaxlib 0.10 routes many small elementwise and reduction fusions through YNNPACK;
in a trace of the cpu-preset training step they cost 0.1-0.5 ms each on tensors of a few
thousand elements. The package turns them off (`xla_cpu_experimental_ynn_fusion_type`
set to empty) in the programs it compiles: init, training chunks and evaluation
(`training.Trainer`), the serving runners' entry points (`RankingRunner`,
`RetrievalRunner`; their small checking, padding and slicing programs keep XLA's
defaults), and the timed programs of `experiments/` and of the ablations' throughput
probe. With other load on the host the training loop ran 17-37% faster without them; on a
quiet host the effect is nil for training and mixed for forward passes
(docs/performance.md, "Training throughput", has the runs and commands).

The option is per program, not process-wide: other code in the same process compiles
with XLA's defaults. It is probed once per backend; a jaxlib that does not know the
option (compiling with an unknown option raises, where an unknown `XLA_FLAGS` entry
aborts the process) gets no options. No options are passed on GPU or TPU, when the
environment sets `PHOENIX_FLAX_XLA_OPTIONS=0`, or for an option that `XLA_FLAGS`
already names (the user's setting stands).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

import equinox as eqx
import jax
import jax.numpy as jnp

CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
DISABLE_ENV = "PHOENIX_FLAX_XLA_OPTIONS"


def _accepted(options: dict[str, Any], backend: str) -> bool:
  """Whether this jaxlib compiles a trivial program with `options` on `backend`."""
  try:
    x = jax.device_put(jnp.zeros((), jnp.float32), jax.local_devices(backend=backend)[0])
    jax.jit(lambda x: x + 1, compiler_options=options).lower(x).compile()
  except Exception:   # "No such compile option" (an XlaRuntimeError) or an unknown backend
    return False
  return True


@functools.cache
def _options_for(backend: str, disabled: bool, xla_flags: str) -> dict[str, Any]:
  if disabled or backend != "cpu":
    return {}
  wanted = {k: v for k, v in CPU_OPTIONS.items() if f"--{k}" not in xla_flags}
  return wanted if wanted and _accepted(wanted, backend) else {}


def compiler_options(backend: Optional[str] = None) -> dict[str, Any]:
  """The options the package compiles with on `backend` (default: JAX's default backend);
  a new dict each call."""
  return dict(_options_for(backend or jax.default_backend(),
                           os.environ.get(DISABLE_ENV, "1") == "0",
                           os.environ.get("XLA_FLAGS", "")))


def filter_jit(fn: Callable, **jit_kwargs) -> Callable:
  """`eqx.filter_jit(fn, ...)` compiled with `compiler_options()` of the default backend
  (looked up now, not when the returned function runs).

  JAX accepts compile options only on a top-level jit. Called under another trace (inside
  an outer `jit`, `eval_shape`, `vmap`, ...: some argument is a tracer), the function
  runs as a plain `eqx.filter_jit` instead, inlined into the outer program, which is
  compiled with whatever options the outer program has. `.lower` is the top-level one's.
  """
  plain = eqx.filter_jit(fn, **jit_kwargs)
  options = compiler_options()
  if not options:
    return plain
  top = eqx.filter_jit(fn, compiler_options=options, **jit_kwargs)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))
    return (plain if traced else top)(*args, **kwargs)

  call.lower = top.lower
  return call
