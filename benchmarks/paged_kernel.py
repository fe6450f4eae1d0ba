"""The paged GPU decode kernel alone, at the engine's shapes: its launch
shape (`launch_shape`'s default) against a sweep of pages per block, query
rows per program, key splits and warps.

  python -m benchmarks.paged_kernel [--quick]

Three parts of one decode step of Qwen2.5-1.5B shapes (16 prompts x G=16,
prompt 2048, mid-decode), one layer of a 28-layer bf16 page pool whose
pages are scattered (a random permutation, as after churn):
- shared_prompt: a group's G*Q query rows against its prompt pages (the
  prompt read once for its G samples);
- repeated_prompt: each sample's Q rows against its own copy of the prompt
  (the baseline the shared layout beats);
- own: each sample's Q rows against its own response pages.
Each configuration's output is checked against the default's. Times are the
median of calls dispatched back to back (launch included, as in a step).
TB/s counts each segment's keys and values once. On GPU the Triton kernel;
--quick runs tiny shapes in interpret mode on CPU (a check that it runs);
--smoke (tests/test_benchmarks_smoke.py) is --quick timing one call.
The last stdout line is JSON: each part's best over default time and both
times, `<part>.best_vs_default`, `<part>.default_us`, `<part>.best_us` for
the parts `shared_prompt`, `repeated_prompt` and `own`.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report
from benchmarks import timing
from kernels_pallas import paged_decode_attention_gpu as gpu

_QUICK = flags.DEFINE_bool("quick", False, "Tiny shapes, interpret mode.")
_CALLS = flags.DEFINE_integer("calls", 20, "Calls per timed batch.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed batches (median).")
_BUDGET = flags.DEFINE_float("budget_s", 55.0, "Seconds per part's sweep; "
                             "configurations past it are skipped.")
_SMOKE = flags.DEFINE_bool("smoke", False, "--quick with one call per "
                           "configuration: that it runs (tests).")


def _setting():
  if _QUICK.value:
    return dict(L=2, N=2, Q=2, K=16, T=4, prompts=2, G=4, prompt=32, own=12)
  return dict(L=28, N=2, Q=6, K=128, T=16, prompts=16, G=16, prompt=2048,
              own=256)


def _grid(part: str):
  """Configurations swept (the default is timed first, separately)."""
  if _QUICK.value:
    return [dict(pages_per_block=2, block_rows=16, num_splits=2,
                 num_warps=4)]
  if part == "shared_prompt":
    return [dict(pages_per_block=p, block_rows=r, num_splits=s, num_warps=w)
            for p, r, s, w in itertools.product((4, 8, 16), (32, 64, 128),
                                                (4, 8, 16), (4, 8))]
  return [dict(pages_per_block=p, block_rows=16, num_splits=s, num_warps=w)
          for p, s, w in itertools.product((2, 4, 8, 16), (1, 2, 4), (4, 8))]


def _inputs(part: str, s: dict, rng):
  """q, pool, table, lengths of one part; the pool's pages are a random
  permutation of the pages the step's segments hold."""
  L, N, Q, K, T = s["L"], s["N"], s["Q"], s["K"], s["T"]
  S = s["prompts"] * s["G"]
  if part == "shared_prompt":
    X, M, length = s["prompts"], gpu.rows_for_dot(s["G"] * Q), s["prompt"]
  elif part == "repeated_prompt":
    X, M, length = S, gpu.rows_for_dot(Q), s["prompt"]
  else:
    X, M, length = S, gpu.rows_for_dot(Q), s["own"]
  A = math.ceil(length / T)
  P = X * A
  table = rng.permutation(P).reshape(X, A).astype(np.int32)
  dtype = jnp.float32 if _QUICK.value else jnp.bfloat16
  key = jax.random.key(0)
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (X, N, M, K), dtype)
  k = jax.random.normal(kk, (L, N, P, T, K), dtype)
  v = jax.random.normal(kv, (L, N, P, T, K), dtype)
  lengths = jnp.full((X,), length, jnp.int32)
  kv_bytes = 2 * X * length * N * K * jnp.dtype(dtype).itemsize
  return (q, k, v, jnp.asarray(table), lengths), kv_bytes


def _timed(fn, args) -> float:
  jax.block_until_ready(fn(*args))  # Compile and warm.
  times = []
  for _ in range(_REPEATS.value):
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(_CALLS.value)]
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - t0) / _CALLS.value)
  return statistics.median(times)


def _part_fn(s: dict, config: dict | None):
  interpret = jax.default_backend() != "gpu"
  kw = dict(config or {})
  if interpret:
    kw.pop("num_warps", None)

  def fn(q, k, v, table, lengths):
    return gpu.paged_part(q, k, v, table, lengths, layer=s["L"] // 2,
                          scale=s["K"]**-0.5, interpret=interpret, **kw)
  return jax.jit(fn)


def sweep(part: str, s: dict) -> dict:
  args, kv_bytes = _inputs(part, s, np.random.default_rng(0))
  X, N, M, K = args[0].shape
  A = args[3].shape[1]
  block_rows = gpu.rows_for_head_dim(K)
  rows, splits = gpu.launch_shape(X, N, M, A, block_rows=block_rows)
  default = dict(pages_per_block=4, block_rows=block_rows, num_splits=splits,
                 num_warps=gpu.warps_for(M // rows))
  ref = _part_fn(s, None)
  ref_out = jax.block_until_ready(ref(*args))
  base_s = _timed(ref, args)
  results = [dict(config=default, seconds=base_s, max_err=0.0,
                  default=True)]
  t_start = time.perf_counter()
  skipped = 0
  for config in _grid(part):
    if config == default:
      continue
    if time.perf_counter() - t_start > _BUDGET.value:
      skipped += 1
      continue
    fn = _part_fn(s, config)
    try:
      out = jax.block_until_ready(fn(*args))
    except Exception as e:  # pylint: disable=broad-except
      results.append(dict(config=config, error=f"{type(e).__name__}: "
                          f"{str(e)[:120]}"))
      continue
    err = float(jnp.max(jnp.abs(out[0] - ref_out[0])))
    results.append(dict(config=config, seconds=_timed(fn, args),
                        max_err=err))
  ok = [r for r in results if "seconds" in r and r["max_err"] < 2e-2]
  best = min(ok, key=lambda r: r["seconds"])
  print(f"\n{part}: X={X} segments, N={N}, M={M} rows, {A} pages of "
        f"{s['T']}, {kv_bytes / 1e6:.1f} MB of keys and values; default "
        f"{M // rows} rows a program, {splits} splits; {skipped} skipped "
        "(budget); rows: query rows a program")
  print(f"{'ppb':>4}{'rows':>5}{'splits':>7}{'warps':>6}{'us':>9}{'TB/s':>7}"
        f"{'vs default':>11}{'max err':>9}")
  for r in sorted(results, key=lambda r: r.get("seconds", math.inf))[:12]:
    c = r["config"]
    row_blocks, _ = gpu.launch_shape(X, N, M, A,
                                     block_rows=c["block_rows"])
    head = (f"{c['pages_per_block']:>4}{M // row_blocks:>5}"
            f"{c['num_splits']:>7}{c['num_warps']:>6}")
    if "error" in r:
      print(f"{head}  {r['error']}")
      continue
    mark = " (default)" if r.get("default") else ""
    print(f"{head}{r['seconds'] * 1e6:>9.1f}"
          f"{kv_bytes / r['seconds'] / 1e12:>7.2f}"
          f"{base_s / r['seconds']:>10.2f}x{r['max_err']:>9.1e}{mark}")
  return dict(default=default, default_s=base_s, best=best["config"],
              best_s=best["seconds"], kv_bytes=kv_bytes, skipped=skipped,
              results=results, best_vs_default=base_s / best["seconds"])


def main(argv):
  del argv
  if _SMOKE.value:
    timing.smoke_defaults(quick=True, calls=1, repeats=1)
  s = _setting()
  dev = jax.devices()[0]
  print(f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}; "
        f"setting {s}", flush=True)
  out = {part: sweep(part, s)
         for part in ("shared_prompt", "repeated_prompt", "own")}
  report.emit({f"{p}.best_vs_default": r["best_vs_default"]
               for p, r in out.items()}
              | {f"{p}.default_us": r["default_s"] * 1e6
                 for p, r in out.items()}
              | {f"{p}.best_us": r["best_s"] * 1e6 for p, r in out.items()},
              detail=dict(device=dev.device_kind, setting=s, parts=out))

if __name__ == "__main__":
  app.run(main)
