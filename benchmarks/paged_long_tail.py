"""Long-tailed responses: the paged engine vs static-row batching.

  python -m benchmarks.paged_long_tail [--quick]

Workload (the [engine2] case): 32 prompts x G=8 samples, prompts of 256
tokens, response lengths lognormal (mean 256, sigma 1) capped at 2048 and
forced by per-sample token budgets (no stop tokens), the same weights,
seeds and budgets in both variants, so both produce the same samples (the
run checks it token by token). Both variants get the same KV byte budget:
  static: `benchmarks/static_rows.StaticRows`, the static-row batching
    most RL frameworks run, in plain jnp: R rows x G slots, each row
    reserving its prompt bucket plus G x max_new_tokens (2048) of suffix
    KV; a row takes its next prompt only when the last of its G samples
    ends; results read one step late, as the paged driver does. R sets the
    budget (--static_rows, default 2: 16 slots, 33k tokens of KV).
  paged:  `Engine` + `Driver`: a pool of the same bytes in pages
    of --page_size tokens, --paged_slots slots (default 256: slots cost
    no KV, the pool limits what runs); a finished sample frees its pages
    and slot at once, decode reads live pages only, and when the pool runs
    out the newest sample is preempted and recomputed later.
Metric: wall time to finish all 256 samples with everything compiled: an
untimed short static run (its prefill, insert and step) and a whole
untimed paged run compile first (the
paged engine compiles one decode step per triple of live slot / prompt
page / own page buckets, ~20 here), then the variants alternate, 3 timed
runs each (1 with --quick). `long_tail_speedup_vs_static` = median static
seconds / median paged seconds. `kv_reserved_over_live` = pool bytes / the peak bytes of
KV actually held (each group's prompt once + each live sample's tokens),
measured in the paged run; the static rows' is printed next to it
(`static_kv_reserved_over_live`, from a replay of their row schedule).

Model: ModelConfig.tiny with 1 layer, embed 256, 4 query heads, 1 kv head
of dim 64, MLP 768, vocab 1024 (fp32), one CPU device: small enough that
the static rows' ~6700 decode steps fit the 3-minute --quick budget.

A second, small case checks that the paged engine still reads a group's
prompt once for its G samples (`paged_prefix_speedup_g16_p512`,
`_prefix_case`).

`--smoke` (tests/test_benchmarks_smoke.py): 4 prompts x G=2 of 16 tokens,
lengths up to 32, and a small prefix case; the numbers mean nothing.

Prints a table, then one JSON line (last stdout line) with
`long_tail_speedup_vs_static`, `paged_prefix_speedup_g16_p512`,
`kv_reserved_over_live`, `static_kv_reserved_over_live`, `paged_seconds`,
`static_seconds`, `preemptions`, `device`, `jax`.
"""

from __future__ import annotations

import time

from absl import app
from absl import flags
import jax
import numpy as np

from rlhf_jax.samples import Request
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib

from benchmarks import long_tail_workload
from benchmarks import report
from benchmarks import timing
from benchmarks.static_rows import StaticRows

_SIZES = long_tail_workload.SIZES
_QUICK = flags.DEFINE_bool("quick", False, "One timed run per variant.")
_HELP = dict(prompts="Prompts.", samples="Samples per prompt.",
             prompt_len="Prompt tokens.", mean_len="Mean response length.",
             sigma="Lognormal sigma.", max_new_tokens="Length cap.",
             static_rows="Rows of the static engine (sets the KV budget of "
             "both).", paged_slots="Paged slots.",
             page_size="Tokens per page.", num_layers="Model layers.",
             num_heads="Query heads.", num_kv_heads="KV heads.")
for _name, _help in _HELP.items():  # The workload's sizes, as flags.
  (flags.DEFINE_float if isinstance(_SIZES[_name], float)
   else flags.DEFINE_integer)(_name, _SIZES[_name], _help)
_SMOKE = flags.DEFINE_bool("smoke", False, "4 prompts x 2 samples of up to "
                           "32 tokens, a small prefix case: that it runs "
                           "(tests).")


def _run(run, requests):
  """(seconds, {sample key: Sample}) of `run(requests)`, which returns
  or yields the samples."""
  t0 = time.perf_counter()
  out = run(requests)
  out = dict(out) if isinstance(out, dict) else {s.key: s for s in out}
  return time.perf_counter() - t0, out


def main(argv):
  del argv
  if _SMOKE.value:
    timing.smoke_defaults(quick=True, **{
        k: v for k, v in long_tail_workload.SMOKE.items()
        if v != long_tail_workload.SIZES[k]})
  t_start = time.perf_counter()
  w = long_tail_workload.workload(**{
      name: flags.FLAGS[name].value for name in long_tail_workload.SIZES})
  cfg, requests, lengths = w["cfg"], w["requests"], w["lengths"]
  mesh = mesh_lib.make_mesh(fsdp=1, devices=jax.devices()[:1])
  layout = mesh_lib.rollout_layout(mesh)
  graphdef, params = model_lib.init_params(cfg, 0, layout)
  params = mesh_lib.to_layout(params, layout)
  G, P, M = w["G"], w["P"], w["M"]
  sampling = SamplingParams(temperature=1.0, max_new_tokens=M)
  tokens = int(lengths.sum())

  static = StaticRows(cfg, graphdef, params, rows=w["static_rows"],
                      samples_per_row=G, bucket=P, sampling=sampling)
  token_bytes, budget = w["token_bytes"], w["budget"]
  paged = Engine(cfg, graphdef, layout, num_slots=w["paged_slots"],
                      samples_per_group=G, prefill_buckets=(P,),
                      sampling=sampling, page_size=w["page_size"],
                      kv_budget_bytes=budget)
  print(f"model: {cfg.num_params() / 1e6:.2f}M params, L={cfg.num_layers}; "
        f"{len(requests)} prompts x G={G}, prompt {P}, lengths lognormal "
        f"mean {w['mean_len']:.0f} sigma {w['sigma']} cap {M}: {tokens} "
        f"tokens (mean {lengths.mean():.0f}, max {lengths.max()}); KV budget "
        f"{budget / 2**20:.0f} MiB = {w['static_rows']} static rows = "
        f"{paged.num_pages} pages of {w['page_size']}; quick={_QUICK.value}",
        flush=True)

  runs = {"static": [], "paged": []}
  outputs = {}
  # Untimed first: a short static run compiles its prefill, insert and
  # step; a whole paged run compiles its decode-step shapes (and extend
  # lengths).
  _run(static.run, [dataclass_replace_budget(r, 16) for r in requests[:2]])
  secs, _ = _run(Driver(paged, params).run, requests)
  print(f"  paged compile run: {secs:.1f} s, {paged.trace_counts['generate']}"
        f" decode-step shapes ({time.perf_counter() - t_start:.0f} s)",
        flush=True)
  for _ in range(1 if _QUICK.value else 3):
    paged_driver = Driver(paged, params)
    for name, run in (("static", static.run), ("paged", paged_driver.run)):
      secs, outputs[name] = _run(run, requests)
      runs[name].append(secs)
      steps = ("" if name == "static" else
               f", {paged_driver.stats.steps} decode steps")
      print(f"  {name}: {secs:.1f} s{steps} "
            f"({time.perf_counter() - t_start:.0f} s)", flush=True)
  a, b = outputs["static"], outputs["paged"]
  if a.keys() != b.keys() or any(a[k].tokens != b[k].tokens for k in a):
    raise AssertionError("static and paged runs sampled different tokens")
  if paged_driver.pool.num_free != paged.num_pages:
    raise AssertionError("pages not all returned to the pool")
  pst = paged_driver.paged
  static_s, paged_s = (float(np.median(runs[n])) for n in ("static", "paged"))
  speedup = static_s / paged_s
  live_bytes = pst.peak_kv_tokens * token_bytes
  reserved_over_live = paged.pool_bytes / live_bytes
  static_live = max_static_live(requests, lengths, w["static_rows"], G,
                                P)
  static_ratio = budget / (static_live * token_bytes)
  print()
  head = (f"{'variant':>7} | {'seconds':>7} | {'tok/s':>6} | {'steps':>6} | "
          f"{'KV reserved MiB':>15} | {'peak live MiB':>13} | "
          f"{'reserved/live':>13}")
  print(head)
  print("-" * len(head))
  print(f"{'static':>7} | {static_s:>7.1f} | "
        f"{tokens / static_s:>6.0f} | {'':>6} | "
        f"{budget / 2**20:>15.1f} | {static_live * token_bytes / 2**20:>13.1f}"
        f" | {static_ratio:>13.2f}")
  print(f"{'paged':>7} | {paged_s:>7.1f} | "
        f"{tokens / paged_s:>6.0f} | {paged_driver.stats.steps:>6} | "
        f"{paged.pool_bytes / 2**20:>15.1f} | {live_bytes / 2**20:>13.1f} | "
        f"{reserved_over_live:>13.2f}")
  print(f"paged: peak {pst.peak_live} live samples, peak {pst.peak_pages} of "
        f"{paged.num_pages} pages, {pst.preemptions} preemptions "
        f"({pst.recomputed_tokens} tokens recomputed), "
        f"{paged.trace_counts['generate']} decode-step compiles; all runs "
        f"(s): "
        f"{runs}. Static 'peak live' is the largest number of tokens its rows "
        f"held at once in a replay of its row schedule.")
  prefix = _prefix_case(3 if _QUICK.value else 7, smoke=_SMOKE.value)
  print(f"prompt once per group (paged, G=16, P=512, 32 new tokens): "
        f"{prefix['speedup']:.2f}x decode vs the prompt repeated 16 times "
        f"({prefix['shared_ms_per_step']:.1f} vs "
        f"{prefix['repeated_ms_per_step']:.1f} ms/step; KV-read theory "
        f"{prefix['kv_read_ratio_theory']:.1f}x)")
  report.emit(dict(
      long_tail_speedup_vs_static=round(speedup, 3),
      paged_prefix_speedup_g16_p512=round(prefix["speedup"], 3),
      kv_reserved_over_live=round(reserved_over_live, 3),
      static_kv_reserved_over_live=round(static_ratio, 3),
      paged_seconds=round(paged_s, 2),
      static_seconds=round(static_s, 2),
      preemptions=pst.preemptions,
      device=jax.devices()[0].device_kind, jax=jax.__version__))


def _prefix_case(repeats: int, smoke: bool = False) -> dict:
  """The prompt-once read survives paging: 16 samples of one 512-token
  prompt as ONE group of 16 vs 16 groups of 1 (the prompt repeated, sample
  indices 0..15: the same samples), 32 new tokens, the paged engine in both,
  on `benchmarks.engine`'s model (4 layers, 8 query / 2 kv heads of 64,
  4.2M params). Decode steps after admission are timed (prefill excluded),
  after an untimed compile run; the speedup is the median over repeats of
  the paired ratio repeated / shared. `smoke`: a 1-layer 64-wide model, 5
  new tokens, one repeat (tests/test_benchmarks_smoke.py)."""
  if smoke:
    cfg = ModelConfig.tiny(num_layers=1, embed_dim=64, num_heads=2,
                           num_kv_heads=1, head_dim=32, mlp_dim=128,
                           vocab_size=1024)
    repeats = 1
  else:
    cfg = ModelConfig.tiny(num_layers=4, embed_dim=256, num_heads=8,
                           num_kv_heads=2, head_dim=64, mlp_dim=768,
                           vocab_size=1024)
  layout = mesh_lib.rollout_layout(
      mesh_lib.make_mesh(fsdp=1, devices=jax.devices()[:1]))
  graphdef, params = model_lib.init_params(cfg, 0, layout)
  params = mesh_lib.to_layout(params, layout)
  P, M, S = 512, 5 if smoke else 32, 16  # Steps 3..M decode: timed.
  sampling = SamplingParams(temperature=1.0, max_new_tokens=M)
  prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, P)
  prompt = prompt.astype(np.int32)
  variants = {
      "shared": (S, [Request(0, prompt, S, seed=1)]),
      "repeated": (1, [Request(0, prompt, 1, seed=1, first_sample_index=j)
                       for j in range(S)])}
  engines = {name: Engine(
      cfg, graphdef, layout, num_slots=S, samples_per_group=g,
      prefill_buckets=(P,), sampling=sampling, page_size=16,
      num_pages=S * (P // 16 + 3), prefill_batch=S,
      decode_window=1)  # One step a driver iteration: the timed steps.
             for name, (g, _) in variants.items()}

  def decode_seconds(name):
    driver = Driver(engines[name], params)
    driver.start(variants[name][1])
    out, secs, n = [], 0.0, 0
    while driver.busy:
      t0 = time.perf_counter()
      out += driver.step()
      n += 1
      if n > 2:  # Steps 1-2 admit and prefill.
        secs += time.perf_counter() - t0
    return secs, {s.key: s.tokens for s in out}

  tokens = {name: decode_seconds(name)[1] for name in variants}  # Compile.
  if tokens["shared"] != tokens["repeated"]:
    raise AssertionError("shared and repeated prompts sampled differently")
  ratios, times = [], {name: [] for name in variants}
  for _ in range(repeats):
    for name in variants:
      times[name].append(decode_seconds(name)[0])
    ratios.append(times["repeated"][-1] / times["shared"][-1])
  own = S * M / 2  # Mean own tokens read per step.
  return dict(speedup=float(np.median(ratios)),
              shared_ms_per_step=1e3 * float(np.median(times["shared"])) /
              (M - 2),
              repeated_ms_per_step=1e3 * float(np.median(times["repeated"])) /
              (M - 2),
              kv_read_ratio_theory=(S * P + own) / (P + own))


def dataclass_replace_budget(req: Request, cap: int) -> Request:
  import dataclasses  # pylint: disable=g-import-not-at-top
  return dataclasses.replace(req, max_new_tokens_per_sample=tuple(
      min(cap, b) for b in req.max_new_tokens_per_sample))


def max_static_live(requests, lengths, rows, G, P) -> int:
  """Peak tokens the static rows hold live: replays their schedule (a row
  takes the next prompt when its longest sample ends; live = prompt + the
  tokens so far of each sample still running)."""
  free_at = [0] * rows
  spans = []  # (start step, per-sample lengths)
  for i in range(len(requests)):
    r = int(np.argmin(free_at))
    start = free_at[r]
    spans.append((start, lengths[i]))
    free_at[r] = start + int(lengths[i].max())
  peak = 0
  for t in sorted({s for s, _ in spans} | {s + int(l.max()) - 1
                                           for s, l in spans}):
    live = sum(P + int(np.where(l > t - s, t - s + 1, 0).sum())
               for s, l in spans if s <= t < s + int(l.max()))
    peak = max(peak, live)
  return peak


if __name__ == "__main__":
  app.run(main)
