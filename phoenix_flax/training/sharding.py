"""Data parallelism on a `jax.sharding.Mesh` with one "data" axis.

Batches are sharded over "data" (their leading axis), parameters and optimizer state are
replicated, except that the hash-embedding tables (and their optimizer moments) can be
sharded by rows. Without a mesh every helper is the identity, so the same training code
runs on one device, several, or several hosts (`jax.distributed.initialize`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
from typing import Any, Iterator, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from phoenix_flax.config import _is_int
from phoenix_flax.training.schema import ConfigError

DATA_AXIS = "data"
TABLE_FIELDS = ("user_table", "post_table", "author_table")

_distributed_initialized = False


def initialize_distributed(coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None,
                           initialization_timeout: int = 300) -> None:
  """`jax.distributed.initialize` once per process (arguments auto-detected when None).

  It waits about `initialization_timeout` seconds (`config.mesh.initialization_timeout`;
  JAX's connection retries add a few) until all `num_processes` processes have joined,
  so start the same command on every host. A process that is still waiting then is
  aborted by JAX's runtime (a native fatal error, not a Python exception), after the log
  line this writes first has said what it waits for. While it waits, Ctrl-C and SIGTERM
  end the process at once (the call blocks in native code, where Python's handlers cannot
  run). A failure to start (no coordinator given and none detected) is a `ConfigError`
  naming the `config.mesh` fields.
  """
  global _distributed_initialized
  if _distributed_initialized or jax.distributed.is_initialized():
    # (or the caller, e.g. a launcher script, initialized it already: JAX refuses a second
    # call, and its devices are this run's)
    _distributed_initialized = True
    return
  logging.info(
      "jax.distributed.initialize: waiting up to %d s (mesh.initialization_timeout) for %s "
      "to join the coordinator %s, as process %s; a process that never starts makes this "
      "one abort then", initialization_timeout,
      "the cluster's processes" if num_processes is None else f"{num_processes} processes",
      coordinator_address or "(detected)", "(detected)" if process_id is None else process_id)
  try:
    with _signals_end_the_process():
      jax.distributed.initialize(coordinator_address=coordinator_address,
                                 num_processes=num_processes, process_id=process_id,
                                 initialization_timeout=initialization_timeout)
  except (ValueError, RuntimeError) as e:
    if "must be called before" in str(e):
      raise ConfigError(
          f"config.mesh.distributed=True: jax.distributed.initialize came after this "
          f"process had started its JAX backend ({e}); initialize_distributed must run "
          "before anything else touches JAX") from e
    raise ConfigError(
        f"config.mesh.distributed=True: jax.distributed.initialize failed ({e}). Set "
        "config.mesh.coordinator_address, num_processes and process_id, or run where JAX "
        "detects the cluster (e.g. SLURM, Cloud TPU)") from e
  _distributed_initialized = True


def initialize_from(mesh: Any) -> None:
  """`initialize_distributed` with the fields of a config's `mesh` section (what both the
  runner and the ablation sweeps call, so that neither leaves one out)."""
  initialize_distributed(mesh.coordinator_address, mesh.num_processes, mesh.process_id,
                         mesh.initialization_timeout)


@contextlib.contextmanager
def _signals_end_the_process() -> Iterator[None]:
  """Inside the block, SIGINT and SIGTERM end the process (their default action) where a
  Python handler would have caught them, since a native call blocks Python's handlers;
  a signal the process ignores stays ignored, and one handled outside Python (no
  Python-visible handler) is left alone. The handlers are restored after. In a thread
  other than the main one, nothing changes."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  swapped = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  swapped = {s: h for s, h in swapped.items()
             if callable(h) and h not in (signal.SIG_DFL, signal.SIG_IGN)}
  for s in swapped:
    signal.signal(s, signal.SIG_DFL)
  try:
    yield
  finally:
    for s, handler in swapped.items():
      signal.signal(s, handler)


def table_of(path) -> Optional[str]:
  """The hash table (a `TABLE_FIELDS` name) a state leaf's path belongs to (the table
  itself or one of its optimizer moments), or None."""
  return next((k.name for k in path if getattr(k, "name", None) in TABLE_FIELDS), None)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where arrays live: `mesh` None means a single device and no constraints."""

  mesh: Optional[Mesh] = None
  shard_hash_tables: bool = False

  @property
  def num_devices(self) -> int:
    """Devices of the mesh (1 without one)."""
    return 1 if self.mesh is None else self.mesh.size

  def _state_sharding(self, path, leaf, seed_axis: bool) -> NamedSharding:
    """A state leaf's layout: replicated, or a table sharded by rows (after the seed axis
    of a seed-stacked state)."""
    if self.shard_hash_tables and table_of(path) and getattr(leaf, "ndim", 0) >= 2:
      return NamedSharding(self.mesh, P(None, DATA_AXIS) if seed_axis else P(DATA_AXIS))
    return NamedSharding(self.mesh, P())

  def place_state(self, tree: Any) -> Any:
    """Puts a (seed-stacked) train state on the mesh: replicated, tables optionally sharded.
    Host (numpy) arrays are copied to each of this process's devices as its shard, never
    whole to one device first, and with no collective between processes (which
    `jax.device_put` of a host array runs to check that every process holds the same);
    without a mesh they go to the default device."""
    if self.mesh is None:   # (jnp.asarray would compile a program per leaf shape)
      return jax.device_put(tree)

    def place(path, x):
      sharding = self._state_sharding(path, x, seed_axis=True)
      if isinstance(x, np.ndarray):
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
      return jax.device_put(x, sharding)
    return jax.tree_util.tree_map_with_path(place, tree)

  def replicate(self, tree: Any) -> Any:
    """`tree` copied whole to every device of the mesh (unchanged without one)."""
    if self.mesh is None:
      return tree
    return jax.device_put(tree, NamedSharding(self.mesh, P()))

  def constrain_state(self, tree: Any, seed_axis: bool = False) -> Any:
    """Inside jit: keeps a state (one seed's; with `seed_axis`, seed-stacked) in the layout
    `place_state` gives it, from one call to the next, and so that a program that makes
    one (the initialisation) builds each device's shard of a sharded table there, not the
    whole table on one device."""
    if self.mesh is None:
      return tree
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jax.lax.with_sharding_constraint(
            x, self._state_sharding(p, x, seed_axis)), tree)

  def constrain_batch(self, tree: Any) -> Any:
    """Inside jit (per seed): shards every array's leading (batch) axis over "data".

    For a batch sampled inside the program: every device samples the whole (cheap) batch
    and keeps its rows, since the sampler slices its blocks out of one flat vector of
    uniforms, which, left to the partitioner, is sharded and re-laid out with a
    collective-permute per block at every step."""
    if self.mesh is None:
      return tree
    pin = lambda spec: lambda x: (jax.lax.with_sharding_constraint(
        x, NamedSharding(self.mesh, spec)) if x.ndim >= 1 else x)
    return jax.tree.map(pin(P(DATA_AXIS)), jax.tree.map(pin(P()), tree))


def check_tables(spec: Any, placement: Placement) -> None:
  """Raises `ConfigError` unless `spec`'s (an `ExperimentSpec`) hash tables split over the
  placement's mesh: with `shard_hash_tables`, each table's buckets a multiple of its
  devices. `Trainer` calls it, so a mesh built with `make_placement` fails with the field
  to change, not in XLA's sharding code. (A batch that does not divide runs, in uneven
  shards; `run_experiment` refuses one all the same.)"""
  n, w = placement.num_devices, spec.world
  if placement.shard_hash_tables:
    for f in ("user_buckets", "post_buckets", "author_buckets"):
      if getattr(w, f) % n:
        raise ConfigError(f"config.world.{f}={getattr(w, f)} is invalid: sharding the "
                          f"hash tables needs a multiple of the {n} devices")


def make_placement(num_devices: int, shard_hash_tables: bool) -> Placement:
  """A data-parallel mesh over the first `num_devices` devices (-1 = all; 1 = no mesh).

  Raises `ConfigError` for a count that is not -1 or an integer >= 1, one above the
  visible devices, or, with several processes, one that leaves out some of them."""
  if not _is_int(num_devices) or not (num_devices >= 1 or num_devices == -1):
    # (0 or -2 built a mesh over no devices, or over all but the last two)
    raise ConfigError(f"config.mesh.num_devices={num_devices!r} is invalid: must be -1 (all "
                      "devices) or an integer >= 1")
  devices = jax.devices()
  n = len(devices) if num_devices == -1 else num_devices
  if n > len(devices):
    visible = "1 device is" if len(devices) == 1 else f"{len(devices)} devices are"
    raise ConfigError(f"config.mesh.num_devices={num_devices} is invalid: only {visible} "
                      "visible")
  if jax.process_count() > 1 and n != len(devices):
    raise ConfigError(f"config.mesh.num_devices={num_devices} is invalid with "
                      f"{jax.process_count()} processes (mesh.distributed): the mesh must "
                      f"hold every process's devices; use -1 (all {len(devices)})")
  if n == 1:
    if shard_hash_tables:   # (-1 on a one-device host: the same command runs anywhere)
      logging.getLogger(__name__).warning(
          "mesh.shard_hash_tables=True has no effect: one device is visible, so the "
          "tables stay whole on it")
    return Placement(None, False)
  return Placement(Mesh(np.asarray(devices[:n]), (DATA_AXIS,)), shard_hash_tables)


def to_host(tree: Any) -> Any:
  """numpy copies of a pytree's arrays, gathering those spread over several processes."""
  def fetch(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
  return jax.tree.map(fetch, tree)
