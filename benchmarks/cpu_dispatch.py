"""When does a launch return on XLA's CPU client, and can a thread overlap?

  python -m benchmarks.cpu_dispatch [--quick]

A program of four [rows, 512] x [512, 512] matmuls, its rows split over a
set of the 8 forced CPU devices. For each device set: the median seconds
the launch call takes to return and the median seconds to its result
(20 launches after a warm one). Single-device programs return at once
(`jax_cpu_enable_async_dispatch`); a program sharded over several devices
returns only after most of its run, so the host thread that launched it
waits (`benchmarks.long_tail`: a scoring chunk's "launch" is its compute).

Then the long-tail pattern: a decode stand-in on device 0 (200 blocking
steps) and a chunk stand-in on devices 1-7 every 5th step, launched from
the same thread or from a worker thread. The last stdout line is JSON:
`launch_fraction` per device set (launch / run), `thread_vs_inline` (the
one-thread wall over the worker-thread wall; > 1: the worker overlaps) and
the walls.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from benchmarks import report
from benchmarks import timing

_QUICK = flags.DEFINE_bool("quick", False, "Fewer launches.")


def _program(devices, rows):
  """A jitted 4-matmul program on `devices` and a call of it."""
  mesh = Mesh(np.array(devices), ("d",))
  x_RxD = jax.device_put(jnp.ones((len(devices) * rows, 512)),
                         NamedSharding(mesh, P("d")))
  w_DxD = jax.device_put(jnp.ones((512, 512)), NamedSharding(mesh, P()))
  fn = jax.jit(lambda x, w: jnp.tanh(x @ w) @ w @ w @ w)
  jax.block_until_ready(fn(x_RxD, w_DxD))  # Compiled.
  return lambda: fn(x_RxD, w_DxD)


def main(argv):
  del argv
  timing.fake_cpu_devices(8)  # Before the backend starts.
  jax.config.update("jax_platforms", "cpu")
  devs = jax.devices()
  n = 10 if _QUICK.value else 20
  sets = {"0": [0], "7": [7], "0-3": [0, 1, 2, 3], "4-7": [4, 5, 6, 7],
          "1-7": list(range(1, 8)), "0-7": list(range(8))}
  print(f"{'devices':<9}{'launch ms':>11}{'run ms':>9}{'launch/run':>12}")
  fractions = {}
  for name, ids in sets.items():
    call = _program([devs[i] for i in ids], 64)
    launch, run = [], []
    for _ in range(n):
      t0 = time.perf_counter()
      out = call()
      t1 = time.perf_counter()
      jax.block_until_ready(out)
      launch.append(t1 - t0)
      run.append(time.perf_counter() - t0)
    la, ru = statistics.median(launch), statistics.median(run)
    fractions[name] = round(la / ru, 3)
    print(f"{name:<9}{1e3 * la:>11.2f}{1e3 * ru:>9.2f}{la / ru:>12.2f}")

  decode = _program([devs[0]], 8)
  chunk = _program(devs[1:], 64)
  steps, every = 200, 5

  def rollout(launch_chunk):
    """Wall of `steps` blocking decode steps with a chunk every `every`,
    and of the decode loop alone; waits for every chunk."""
    t0 = time.perf_counter()
    pending = []
    for i in range(steps):
      if i % every == 0:
        pending.append(launch_chunk())
      jax.block_until_ready(decode())
    loop = time.perf_counter() - t0
    for p in pending:
      jax.block_until_ready(p.result() if hasattr(p, "result") else p)
    return time.perf_counter() - t0, loop

  with concurrent.futures.ThreadPoolExecutor(1) as worker:
    walls = {"inline": [], "thread": []}
    loops = {"inline": [], "thread": []}
    for _ in range(3 if _QUICK.value else 5):  # Interleaved: shared machine.
      for mode, launch_chunk in (("inline", chunk),
                                 ("thread", lambda: worker.submit(chunk))):
        wall, loop = rollout(launch_chunk)
        walls[mode].append(wall)
        loops[mode].append(loop)
  wall = {k: statistics.median(v) for k, v in walls.items()}
  loop = {k: statistics.median(v) for k, v in loops.items()}
  print(f"\ndecode on 0 + chunks on 1-7 every {every} steps: one thread "
        f"{wall['inline']:.3f}s (decode loop {loop['inline']:.3f}s), "
        f"chunks from a worker thread {wall['thread']:.3f}s (decode loop "
        f"{loop['thread']:.3f}s)")
  report.emit(dict(
      launch_fraction=fractions,
      thread_vs_inline=round(wall["inline"] / wall["thread"], 3),
      wall_s={k: round(v, 4) for k, v in wall.items()},
      decode_loop_s={k: round(v, 4) for k, v in loop.items()},
      quick=_QUICK.value))


if __name__ == "__main__":
  app.run(main)
