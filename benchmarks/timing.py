"""Timing helpers shared by the benchmarks."""

import statistics
import time


def median_time(fn, n: int = 5) -> float:
  """Median seconds of `fn()` (a jitted call, compiled already) over n runs.

  One warm call first; each run waits for `fn`'s outputs to be ready.
  """
  import jax
  jax.block_until_ready(fn())
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)
