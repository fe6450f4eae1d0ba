"""Timing and run-size helpers shared by the benchmarks."""

import contextlib
import os
import statistics
import time

# XLA:CPU's concurrency-optimized scheduler can run a sharded program's
# collectives in different orders on different fake devices, which
# deadlocks their rendezvous (docs/architecture.md); the tests turn it off
# too (tests/conftest.py).
CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def fake_cpu_devices(n: int) -> None:
  """n fake CPU devices for this process, with `CPU_SCHEDULER_FLAG`. Call
  before anything starts JAX's CPU backend (XLA reads XLA_FLAGS then)."""
  import jax
  flags = os.environ.get("XLA_FLAGS", "")
  if CPU_SCHEDULER_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {CPU_SCHEDULER_FLAG}".strip()
  jax.config.update("jax_num_cpu_devices", n)


def smoke_defaults(**values) -> None:
  """Sets each absl flag in `values` that the command line did not give.

  A benchmark's `--smoke` calls it first thing in `main`: the smallest
  sizes, steps and repeats of the same code path, so that
  tests/test_benchmarks_smoke.py runs every module in seconds. The values
  go in only under `--smoke`, so the normal and `--quick` runs measure what
  they did; a flag given explicitly wins over the smoke value.
  """
  from absl import flags
  for name, value in values.items():
    if not flags.FLAGS[name].present:
      flags.FLAGS[name].value = value


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


@contextlib.contextmanager
def count_compiles():
  """Counts XLA compilations inside the block (JAX's backend-compile
  monitoring event): `with count_compiles() as c: ...; c.n`."""
  import types
  import jax
  count = types.SimpleNamespace(n=0)

  def on_event(event, duration_secs, **kwargs):
    del duration_secs, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      count.n += 1

  jax.monitoring.register_event_duration_secs_listener(on_event)
  try:
    yield count
  finally:
    jax.monitoring.unregister_event_duration_listener(on_event)

