"""Two-level sharing: a 256-token common prefix prefilled once vs per prompt.

  python -m benchmarks.common_prefix [--quick]

Setting: N prompts (16) that all start with the same C = 256 tokens (a system
prompt / few-shot block) followed by 8..32 tokens of their own, G samples
(4) per prompt, temperature-1 sampling with no stop tokens. Two paged
engines (`Engine` + `Driver`, what jobs decode on), measured in
the same run:
  baseline: the engine fed the whole prompts (prompt bucket C + 32): every
    group prefills the common tokens again and holds them in its prompt
    pages;
  common:   `Engine(max_common_length=C)` + `Driver.run(
    common_prefix="auto")`: the common prefix is detected, prefilled once
    and stored once (one dense copy in the decode state, outside the page
    pool); groups prefill and page only their own tokens (bucket 32), which
    attend to the common KV as context. Decode attends to it as a third
    part merged by log-sum-exp.
Both variants submit one request of G samples per prompt (one group: its
prompt pages stored once and read once per step for its G samples); the
difference measured here is the second level only. Both engines: N*G
slots, pages of 16 tokens, `num_groups` = N, the default page pool (room
for every group's prompt and every sample's own tokens: nothing waits for a
slot or a page) and the default decode window (8 steps a `generate` call).

Measured per variant (a first run of each, which compiles, excluded;
variants interleaved repeat by repeat; medians):
  rollout_s: `Driver.run` end to end (set_common_prefix, prefills,
    inserts, starts, every decode call until all N*G samples finish);
  prefill_s: the admission phase of a second run, from its start until the
    decode state is ready for the first decode call (set_common_prefix, the
    N prefills, their inserts and the samples' starts; `timed_run`);
  step_ms:   one decode step with all N*G samples live, from the same run:
    each `generate` call runs alone (the device idle before it, waited for
    after it), its time divided by the steps it ran.
`rollout_speedup_from_phases` = (prefill_s + (M-1) step) baseline / the same
for common: what the phase timings predict for the end-to-end ratio (a
cross-check; on a loaded shared CPU the end-to-end runs are the noisiest).
Ratios: speedups are baseline time / common time. Resource ratios are
common / baseline (smaller is better): `prefill_tokens_ratio` (padded tokens
run through prefill, `Driver.stats.prefill_tokens`: the common prefix
counted once, at its capacity C), `kv_bytes_ratio` (decode-state bytes,
`decode_state_bytes`: the page pool, the common prefix's KV and the
tables), `kv_read_ratio_theory` (KV tokens a decode step with every sample
live reads, as the engine's attention reads them: `kv_tokens_read`, common
prefix included). Equality: the fraction of samples whose tokens match
between the variants (same seeds; tests/engine/test_common_prefix.py proves it
exactly on small shapes).

Model: as benchmarks/engine.py (ModelConfig.tiny with 4 layers, embed 256,
8 query heads, 2 kv heads of dim 64, MLP 768, vocab 1024; 4.2M params), on
one CPU device. `measure(quick)` is importable (benchmarks/prefix_sharing.py
calls it), as are the paged-run helpers `timed_run`, `kv_tokens_read` and
`decode_state_bytes` (benchmarks/engine.py and prefix_sharing.py time their
runs with them); this module defines its flags only when run as a script.
The last stdout line of this script is its JSON, without the rows:
`rollout_speedup_common256`, `prefill_speedup_common256`,
`decode_step_speedup_common256`, `rollout_speedup_from_phases`,
`prefill_tokens_ratio`, `kv_bytes_ratio`, `kv_read_ratio_theory`,
`tokens_identical_fraction` and the setting. `--smoke`
(tests/test_benchmarks_smoke.py): see `measure`.
"""

from __future__ import annotations

import dataclasses
import time

from absl import app
from absl import flags
import jax
import numpy as np

from benchmarks import report
from kernels_pallas import paged_decode_attention as pda
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.state import STEP_FLOORS, pow2_at_least, step_bounds
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.samples import Request


COMMON = 256
OWN_MAX = 32
PAGE_SIZE = 16


def _model_config(smoke: bool = False) -> ModelConfig:
  if smoke:
    return ModelConfig.tiny(num_layers=1, embed_dim=64, num_heads=2,
                            num_kv_heads=1, head_dim=32, mlp_dim=128,
                            vocab_size=1024)
  return ModelConfig.tiny(num_layers=4, embed_dim=256, num_heads=8,
                          num_kv_heads=2, head_dim=64, mlp_dim=768,
                          vocab_size=1024)


# ------------------------------------------- paged-run helpers (importable)
def decode_state_bytes(engine: Engine) -> int:
  """Bytes of the engine's decode state (`DecodeState`): the page pool, the
  common prefix's KV (its capacity) and the group and slot tables."""
  fields = engine._fields()  # pylint: disable=protected-access
  return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
             for _, shape, dtype in fields.values())


def kv_tokens_read(engine: Engine, slots, groups: int,
                   prompt_pages: int, own_pages: int) -> int:
  """KV tokens one decode step of `engine.generate(slots=..., groups=...,
  prompt_pages=..., own_pages=...)` reads, as its attention reads them.

  The jnp attention (CPU) reads dense rows up to the step's bounds, each
  rounded up to a power of two above its floor and capped by the engine's
  tables (`engine/state.step_bounds`; padding is read and masked): groups x
  prompt pages (once per group, for all its samples) plus listed slots
  (`Engine._list_slots`) x own pages, per data replica. The Pallas
  kernels (TPU, GPU) walk each table to its length, counted here at the
  driver's page counts. Plus the common prefix, once for all slots (the jnp
  part reads its whole capacity).
  """
  T, D = engine.page_size, engine.replicas
  per_replica = [0] * D
  for s in slots:
    per_replica[engine.replica_of(s)] += 1
  if pda.resolve_impl(engine.attention_impl) == "pallas":
    g, a, b, x = groups, prompt_pages, own_pages, max(per_replica)
    common = engine.common_prefix_tokens.size
  else:
    g, a, b = step_bounds((groups, prompt_pages, own_pages),
                          (engine.num_groups // D, engine.max_prompt_pages,
                           engine.max_own_pages))
    x = pow2_at_least(max(per_replica), engine.num_slots // D,
                      STEP_FLOORS[0])
    common = engine.max_common_length
  return D * (g * a + x * b) * T + common


@dataclasses.dataclass
class TimedRun:
  """One `Driver.run`, timed by `timed_run`."""
  tokens: dict    # (prompt id, sample index) -> sampled tokens
  admit_s: float  # run start -> decode state ready for the first decode call
  decode_s: float  # from then to the run's end (decode calls + host work)
  calls: list     # per `generate` call: (seconds alone or None, steps, KV
                  # tokens one of its steps reads)

  def live(self, steps: int) -> list:
    """The calls within the run's first `steps` decode steps (with no stop
    tokens and equal budgets M, steps = M - 1 is every sample live)."""
    out, done = [], 0
    for call in self.calls:
      if done + call[1] > steps:
        break
      out.append(call)
      done += call[1]
    return out

  def step_s(self, steps: int) -> list[float]:
    """Seconds per decode step of each call timed alone within `steps`."""
    return [t / n for t, n, _ in self.live(steps) for _ in range(n)]

  def kv_read(self, steps: int) -> float:
    """KV tokens a decode step reads, averaged over the first `steps`."""
    live = self.live(steps)
    return sum(n * kv for _, n, kv in live) / sum(n for _, n, _ in live)


def timed_run(driver: Driver, requests, *, common_prefix=None,
              each_call: bool = False) -> TimedRun:
  """Runs `requests` through `driver` (`Driver.run`), timing phases.

  The first `generate` call waits for the decode state (admission done:
  common prefix, prefills, inserts, starts): `admit_s` ends there. With
  `each_call`, every `generate` call runs alone (the device idle before it,
  waited for after it) and is timed; without, the calls after the first
  pipeline as in a job. Each call's KV read per step: `kv_tokens_read`.
  """
  eng = driver.engine
  generate = eng.generate
  calls, marks = [], []

  def timed_generate(params, state, growth=(), **kw):
    kv = kv_tokens_read(eng, kw["slots"], kw["groups"], kw["prompt_pages"],
                        kw["own_pages"])
    steps = kw.get("steps", 1)
    if each_call or not marks:
      jax.block_until_ready(state)
    if not marks:
      marks.append(time.perf_counter())
    if not each_call:
      calls.append((None, steps, kv))
      return generate(params, state, growth, **kw)
    t0 = time.perf_counter()
    state, result = generate(params, state, growth, **kw)
    jax.block_until_ready((state, result.data))
    calls.append((time.perf_counter() - t0, steps, kv))
    return state, result

  eng.generate = timed_generate
  try:
    t0 = time.perf_counter()
    tokens = {s.key: s.tokens
              for s in driver.run(requests, common_prefix=common_prefix)}
    t1 = time.perf_counter()
  finally:
    del eng.generate  # The class's method again.
  return TimedRun(tokens, marks[0] - t0, t1 - marks[0], calls)


# ------------------------------------------------------------- this case
class _Variant:
  """One engine + driver and its timings."""

  def __init__(self, name, engine, params, requests, common_prefix):
    self.name, self.engine, self.params = name, engine, params
    self.requests, self.common_prefix = requests, common_prefix
    self.driver = Driver(engine, params)
    self.rollout_s, self.prefill_s, self.step_ms = [], [], []
    self.kv_read = 0.0
    self.samples = None
    self.prefill_tokens = 0

  def rollout(self, timed=True):
    self.driver.stats.prefill_tokens = 0
    t0 = time.perf_counter()
    samples = {s.key: s for s in self.driver.run(
        self.requests, common_prefix=self.common_prefix)}
    dt = time.perf_counter() - t0
    self.prefill_tokens = self.driver.stats.prefill_tokens
    if timed:
      self.rollout_s.append(dt)
    self.samples = samples

  def phases(self, timed=True):
    """Admission phase, then decode calls alone with every sample live."""
    run = timed_run(self.driver, self.requests,
                    common_prefix=self.common_prefix, each_call=True)
    live = self.engine.sampling.max_new_tokens - 1
    self.kv_read = run.kv_read(live)
    if timed:
      self.prefill_s.append(run.admit_s)
      self.step_ms.append(1e3 * float(np.median(run.step_s(live))))


def measure(quick: bool, log=print, smoke: bool = False) -> dict:
  """Runs both variants; returns the table rows and the headline ratios.

  `smoke`: 4 prompts, 3 new tokens, one repeat on a 1-layer 64-wide model,
  the same C = 256 (tests/test_benchmarks_smoke.py); numbers meaningless.
  """
  t_start = time.perf_counter()
  n_prompts, group = (4, 2) if smoke else (16, 4)
  max_new = 3 if smoke else 16 if quick else 32
  repeats = 1 if smoke else 3 if quick else 5
  cfg = _model_config(smoke)
  layout = mesh_lib.rollout_layout(
      mesh_lib.make_mesh(fsdp=1, devices=jax.devices()[:1]))
  graphdef, params = model_lib.init_params(cfg, 0, layout)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new)
  rng = np.random.default_rng(0)
  common = rng.integers(0, cfg.vocab_size, COMMON)
  # First own token differs from the next common one, so "auto" finds
  # exactly C tokens (a longer chance match would also be correct).
  prompts = []
  for _ in range(n_prompts):
    own = rng.integers(0, cfg.vocab_size, rng.integers(8, OWN_MAX + 1))
    prompts.append(np.concatenate([common, own]).astype(np.int32))
  requests = [Request(i, p, group, seed=1) for i, p in enumerate(prompts)]
  make = lambda **kw: Engine(
      cfg, graphdef, layout, num_slots=n_prompts * group,
      samples_per_group=group, sampling=sampling, page_size=PAGE_SIZE,
      num_groups=n_prompts, **kw)
  variants = [
      _Variant("baseline", make(prefill_buckets=(COMMON + OWN_MAX,)), params,
               requests, None),
      _Variant("common", make(prefill_buckets=(OWN_MAX,),
                              max_common_length=COMMON), params, requests,
               "auto")]
  for v in variants:  # Compile everything once, untimed.
    v.rollout(timed=False)
    v.phases(timed=False)
  log(f"compiled both variants ({time.perf_counter() - t_start:.0f}s)")
  for i in range(repeats):
    for v in variants:
      v.rollout()
      v.phases()
    log(f"  repeat {i + 1}/{repeats}: rollout baseline "
        f"{variants[0].rollout_s[-1]:.2f}s, common "
        f"{variants[1].rollout_s[-1]:.2f}s "
        f"({time.perf_counter() - t_start:.0f}s)")

  base, com = variants
  assert com.driver.stats.common_prefix_length == COMMON, (
      com.driver.stats.common_prefix_length)
  same = sum(base.samples[k].tokens == com.samples[k].tokens
             for k in base.samples) / len(base.samples)
  med = lambda x: float(np.median(x))
  paired = lambda a, b: med(np.asarray(a) / np.asarray(b))
  R, G, M = n_prompts, group, max_new
  rows = [dict(variant=v.name, rollout_s=med(v.rollout_s),
               prefill_s=med(v.prefill_s), step_ms=med(v.step_ms),
               prefill_tokens=v.prefill_tokens,
               state_bytes=decode_state_bytes(v.engine), kv_read=v.kv_read)
          for v in variants]
  wall = time.perf_counter() - t_start
  return dict(
      rows=rows,
      rollout_speedup_common256=round(paired(base.rollout_s, com.rollout_s),
                                      3),
      prefill_speedup_common256=round(paired(base.prefill_s, com.prefill_s),
                                      3),
      decode_step_speedup_common256=round(
          paired(base.step_ms, com.step_ms), 3),
      rollout_speedup_from_phases=round(
          (rows[0]["prefill_s"] + (M - 1) * rows[0]["step_ms"] / 1e3) /
          (rows[1]["prefill_s"] + (M - 1) * rows[1]["step_ms"] / 1e3), 3),
      prefill_tokens_ratio=round(com.prefill_tokens / base.prefill_tokens, 4),
      kv_bytes_ratio=round(rows[1]["state_bytes"] / rows[0]["state_bytes"],
                           4),
      kv_read_ratio_theory=round(com.kv_read / base.kv_read, 4),
      tokens_identical_fraction=round(same, 4),
      common_length=COMMON, own_tokens="8..32", num_prompts=R,
      samples_per_prompt=G, max_new_tokens=M, page_size=PAGE_SIZE,
      repeats=repeats, quick=quick,
      params_m=round(cfg.num_params() / 1e6, 2), wall_s=round(wall, 1))


def table(res) -> str:
  head = (f"{'variant':>8} | {'rollout s':>9} {'prefill s':>9} "
          f"{'step ms':>8} | {'prefill tok':>11} {'state MB':>8} "
          f"{'KV read/step':>12}")
  lines = [head, "-" * len(head)]
  for r in res["rows"]:
    lines.append(
        f"{r['variant']:>8} | {r['rollout_s']:>9.3f} {r['prefill_s']:>9.3f} "
        f"{r['step_ms']:>8.2f} | {r['prefill_tokens']:>11} "
        f"{r['state_bytes'] / 2**20:>8.2f} {r['kv_read']:>12.0f}")
  lines.append(
      f"speedup (baseline / common, median of paired repeats): rollout "
      f"{res['rollout_speedup_common256']:.2f}x, prefill "
      f"{res['prefill_speedup_common256']:.2f}x, decode step "
      f"{res['decode_step_speedup_common256']:.2f}x (rollout predicted from "
      f"the phases: {res['rollout_speedup_from_phases']:.2f}x)")
  lines.append(
      f"common / baseline: prefill tokens {res['prefill_tokens_ratio']:.3f}, "
      f"decode-state bytes {res['kv_bytes_ratio']:.3f}, KV tokens read per "
      f"step (theory: the attention's page-rounded reads) "
      f"{res['kv_read_ratio_theory']:.3f}; identical samples "
      f"{res['tokens_identical_fraction']:.2%}")
  lines.append(
      f"{res['num_prompts']} prompts = {res['common_length']} common + "
      f"{res['own_tokens']} own tokens, G={res['samples_per_prompt']}, "
      f"{res['max_new_tokens']} new tokens (temperature 1, no stop); paged "
      f"engine, pages of {res['page_size']} tokens; prefill s = admission "
      f"phase (common prefix, prefills, inserts, starts).")
  return "\n".join(lines)


def main(argv):
  del argv
  res = measure(flags.FLAGS.quick, smoke=flags.FLAGS.smoke)
  print()
  print(table(res))
  report.emit({k: v for k, v in res.items() if k != "rows"})


if __name__ == "__main__":
  # Defined here, not at import: benchmarks/prefix_sharing.py imports this
  # module and has its own --quick.
  flags.DEFINE_bool("quick", False, "Fewer repeats and new tokens.")
  flags.DEFINE_bool("smoke", False, "Smallest sizes: that it runs (tests).")
  app.run(main)
