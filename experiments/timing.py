"""Timing of compiled calls in alternating rounds (shared by `experiments.benchmark` and
the throughput probe of `ablations.probes`)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax


def time_rounds(calls: dict[str, Callable[[], object]], iters: int, warmup: int,
                min_seconds: float = 0.0, max_rounds: int = 1000) -> dict[str, float]:
  """Median seconds per call; each round runs every call in turn, twice in a row, and
  times the second run.

  The untimed first run makes each timed call start from caches that hold its own
  weights, as back-to-back serving calls do: the MFU matmul in the benchmark's rounds
  moves 48 MiB through the caches, and without the repeat whichever call follows it pays
  for that (demo: 0.91x with the fast path timed right after the matmul, 1.09x with the
  reference there). Runs at least `iters` rounds, and more (up to `max_rounds`) until the
  timed runs add up to `min_seconds`, so that millisecond-scale calls get a stable
  median.
  """
  for _ in range(warmup):
    for call in calls.values():
      jax.block_until_ready(call())
  times = {name: [] for name in calls}
  spent, rounds = 0.0, 0
  while rounds < iters or (spent < min_seconds and rounds < max_rounds):
    for name, call in calls.items():
      jax.block_until_ready(call())
      start = time.perf_counter()
      jax.block_until_ready(call())
      times[name].append(time.perf_counter() - start)
      spent += times[name][-1]
    rounds += 1
  return {name: statistics.median(ts) for name, ts in times.items()}
