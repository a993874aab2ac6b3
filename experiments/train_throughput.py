"""Training throughput: the scanned on-device loop against a plain host-driven loop.

    python -m experiments.train_throughput --config=experiments/configs/ranking.py

(`python -m experiments.benchmark` runs the same measurement for its `--train_presets`.)

* Scanned loop (what `run_experiment` runs): `Trainer.train_chunk`, `steps_per_call`
  steps per host call under `lax.scan`, batches sampled on device inside the step,
  buffers donated, nothing returned to the host until the chunk ends.
* Plain loop (the baseline: a host data pipeline and one jitted call per step): the
  same model, optimizer and update, one jitted call per step, fed a batch sampled on the
  host with numpy (`experiments/host_sampler.py`: the same generative process over the
  same world, in vectorised numpy). Each step's loss is read back to the host, as a plain
  loop does to log it.
* Plain loop fed device-sampled batches: the same, but each batch is drawn by a
  separately jitted `sample_batch` and copied to numpy (`np.asarray`), a host data
  pipeline at its cheapest on CPU. It shows how much of the speed-up the numpy sampler
  alone accounts for.

All jitted functions get the same compile options as `Trainer`'s
(`phoenix_flax.xla_options`). Every loop runs on one device: a config that sets `mesh.*`
is refused.

The loops are timed after compilation, in alternating rounds so that load from other
processes hits them alike; `speedup` is the scanned loop's examples/s over the numpy plain
loop's, `speedup_vs_device_sampled` over the other plain loop's. With `num_seeds > 1` the
scanned loop trains every seed at once (vmapped, as `run_experiment` does) while the plain
loop trains one seed, i.e. seeds one after another: examples/s count every seed.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import flags
import jax
import ml_collections
import numpy as np
from ml_collections import config_flags

if not __package__:  # run by path, not with python -m: import this checkout's packages
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments.cli import (check_output_file, checked_config, exit_on_run_errors,
                             parse_config_flags, quiet_backend_search, run_app, usage_error,
                             write_output_file)
from experiments.host_sampler import HostSampler
from phoenix_flax import xla_options
from phoenix_flax.synthetic import sample_batch
from phoenix_flax.training import ConfigError, Trainer, parse_config, provenance
from phoenix_flax.training.loop import unstack
from phoenix_flax.training.runner import check_placement


def _block(tree) -> None:
  jax.block_until_ready(jax.tree.leaves(tree))


def check_one_device(config: ml_collections.ConfigDict) -> None:
  """Raises `ConfigError` for a config that asks for a mesh: every loop here runs on one
  device (the plain loops have no mesh), so a `mesh.*` setting would be ignored."""
  mesh = config.mesh
  if mesh.num_devices != 1 or mesh.shard_hash_tables or mesh.distributed:
    raise ConfigError(
        f"mesh.num_devices={mesh.num_devices}, shard_hash_tables={mesh.shard_hash_tables}, "
        f"distributed={mesh.distributed}: the throughput comparison runs every loop on one "
        "device (its plain loops have no mesh); leave mesh.* at its defaults")


class _Loops:
  """The three loops of one config, compiled once, so rounds can alternate."""

  def __init__(self, config: ml_collections.ConfigDict):
    check_one_device(config)
    self.spec = parse_config(config)
    check_placement(self.spec)   # a training state too large for the device: refused
    self.trainer = Trainer(self.spec)
    self.steps = self.spec.config.train.steps_per_call
    self.batch_size = self.spec.config.train.batch_size
    self.num_seeds = len(self.spec.seeds)
    trainer, spec = self.trainer, self.spec
    self.state = trainer.init(list(spec.seeds))
    self.plain_state = unstack(trainer.init([spec.config.seed]), 0)
    # The plain loops' programs as a plain loop writes them: `jax.jit`, the state donated.
    # (`eqx.filter_jit`'s Python wrapper, which sorts arrays from the rest at every call,
    # cost about 0.6 ms a step on the 2-core CPU host: time the baseline paid and scanning
    # saved, which flattered the ratio.)
    options = xla_options.compiler_options() or None
    self._sample = jax.jit(lambda world, key: sample_batch(
        world, spec.train_split, spec.config.train.batch_size, key), compiler_options=options)
    self._update = jax.jit(trainer.update, donate_argnums=0, compiler_options=options)
    self.key = jax.random.PRNGKey(spec.config.seed + 1)
    self.host_sampler = HostSampler(trainer.world, spec.train_split,
                                    spec.config.train.batch_size, spec.config.seed + 1)
    self.scanned(1)
    self.plain(1)
    self.plain(1, device_sampled=True)

  def scanned(self, chunks: int) -> float:
    """Seconds for `chunks` scanned host calls."""
    t0 = time.perf_counter()
    for _ in range(chunks):
      self.state, stats = self.trainer.train_chunk(self.state)
    _block((self.state, stats))
    return time.perf_counter() - t0

  def _device_sampled(self):
    self.key, key = jax.random.split(self.key)
    return jax.tree.map(np.asarray, self._sample(self.trainer.world, key))

  def plain(self, steps: int, device_sampled: bool = False) -> float:
    """Seconds for `steps` plain-loop steps (host batch in, loss out, every step); the
    batch comes from the numpy sampler, or from the device copied to numpy."""
    sample = self._device_sampled if device_sampled else self.host_sampler
    t0 = time.perf_counter()
    for _ in range(steps):
      self.plain_state, stats = self._update(self.plain_state, sample())
      float(stats["loss"])
    _block(self.plain_state)
    return time.perf_counter() - t0


def measure(config: ml_collections.ConfigDict, rounds: int = 3,
            chunks_per_round: int = 2) -> dict:
  """Examples/s of the loops (median over alternating rounds) and their ratios."""
  loops = _Loops(config)
  scanned, plain, device_sampled = [], [], []
  steps = loops.steps * chunks_per_round
  for _ in range(rounds):
    scanned.append(steps * loops.batch_size * loops.num_seeds
                   / loops.scanned(chunks_per_round))
    plain.append(steps * loops.batch_size / loops.plain(steps))
    device_sampled.append(steps * loops.batch_size / loops.plain(steps, device_sampled=True))
  out = {"scanned_examples_per_second": statistics.median(scanned),
         "plain_examples_per_second": statistics.median(plain),
         "plain_device_sampled_examples_per_second": statistics.median(device_sampled),
         "plain_sampler": "numpy (experiments/host_sampler.py)",
         "batch_size": loops.batch_size, "num_seeds": loops.num_seeds,
         "fprop_dtype": loops.spec.model.fprop_dtype,
         "steps_per_call": loops.steps,
         "steps_per_round": steps, "rounds": rounds,
         "device": jax.devices()[0].device_kind, "machine": provenance.machine(),
         "code": provenance.running_code_version(), "backend": jax.default_backend(),
         "compiler_options": xla_options.compiler_options()}
  out["speedup"] = out["scanned_examples_per_second"] / out["plain_examples_per_second"]
  out["speedup_vs_device_sampled"] = (out["scanned_examples_per_second"]
                                      / out["plain_device_sampled_examples_per_second"])
  return out


def _define_flags() -> dict:
  """The command's flags; defined only when run as a script, so that importing `measure`
  (as experiments/benchmark.py does) defines none."""
  return {
      "config": config_flags.DEFINE_config_file(
          "config", "experiments/configs/ranking.py",
          "Experiment config (with optional ':preset'); --config.<field>=... overrides "
          "apply."),
      "rounds": flags.DEFINE_integer("rounds", 3,
                                     "Alternating timing rounds (median reported).",
                                     lower_bound=1),
      "chunks": flags.DEFINE_integer("chunks_per_round", 2,
                                     "Scanned host calls per round; each plain loop runs as "
                                     "many steps.", lower_bound=1),
      "out": flags.DEFINE_string("out", None, "Optional JSON file for the measurement."),
  }


def main(argv: list[str], flag_values: dict) -> None:
  if len(argv) > 1:
    usage_error(f"unexpected arguments {argv[1:]}; every option is a --flag")
  config = checked_config(flag_values["config"].value)
  if flag_values["out"].value:   # (empty: no file, as the write below reads it)
    check_output_file("out", flag_values["out"].value)
  # A mesh is refused (`check_one_device`) before anything compiles; Ctrl-C: one line.
  with exit_on_run_errors(resumable=False):
    result = measure(config, flag_values["rounds"].value, flag_values["chunks"].value)
    result["command"] = " ".join(["python -m experiments.train_throughput"] + sys.argv[1:])
    print(json.dumps(result, indent=2))
    if flag_values["out"].value:
      write_output_file(flag_values["out"].value, result)


if __name__ == "__main__":
  _flags = _define_flags()
  quiet_backend_search()
  run_app(lambda argv: main(argv, _flags), flags_parser=parse_config_flags)
