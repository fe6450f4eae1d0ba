"""Two-level sharing: a 256-token common prefix prefilled once vs per prompt.

  python -m benchmarks.common_prefix [--quick]

Setting: N prompts (16) that all start with the same C = 256 tokens (a system
prompt / few-shot block) followed by 8..32 tokens of their own, G samples
(4) per prompt, temperature-1 sampling with no stop tokens. Two engines, the
same Engine and Driver code, measured in the same run:
  baseline: the plain engine fed the whole prompts (prompt bucket C + 32):
    every prompt row prefills and stores the common tokens again;
  common:   `Engine(max_common_length=C)` + `Driver.run(common_prefix=
    "auto")`: the common prefix is detected, prefilled once and stored once
    in the decode state; rows prefill and store only their own tokens
    (bucket 32), which attend to the common KV as context. Decode attends
    to it as a third part merged by log-sum-exp.
Both variants keep prefix rows (one prompt KV row per group of G samples);
the difference measured here is the second level only.

Measured per variant (first call, which compiles, excluded; variants
interleaved repeat by repeat; medians):
  rollout_s: `Driver.run` end to end (set_common_prefix, prefills, inserts,
    every decode step until all N*G samples finish);
  prefill_s: the prefill phase alone (set_common_prefix + N prefills);
  step_ms:   one decode step with all N*G samples live.
`rollout_speedup_from_phases` = (prefill_s + (M-1) step) baseline / the same
for common: what the phase timings predict for the end-to-end ratio (a
cross-check; on a loaded shared CPU the end-to-end runs are the noisiest).
Ratios: speedups are baseline time / common time. Resource ratios are
common / baseline (smaller is better): `prefill_tokens_ratio` (padded tokens
run through prefill, the common prefix counted once), `kv_bytes_ratio`
(`Engine.decode_state_bytes`), `kv_read_ratio_theory` (KV tokens read per
decode step: C + R*P_own + R*G*M vs R*(C + P_own) + R*G*M). Equality: the
fraction of samples whose tokens match between the variants (same seeds;
tests/test_common_prefix.py proves it exactly on small shapes).

Model: as benchmarks/engine.py (ModelConfig.tiny with 4 layers, embed 256,
8 query heads, 2 kv heads of dim 64, MLP 768, vocab 1024; 4.2M params), on
one CPU device. `measure(quick)` is importable (benchmarks/prefix_sharing.py
calls it); the last stdout line of this script is its JSON, without the
rows: `rollout_speedup_common256`, `prefill_speedup_common256`,
`decode_step_speedup_common256`, `rollout_speedup_from_phases`,
`prefill_tokens_ratio`, `kv_bytes_ratio`, `kv_read_ratio_theory`,
`tokens_identical_fraction` and the setting. `--smoke`
(tests/test_benchmarks_smoke.py): see `measure`.
"""

from __future__ import annotations

import time

from absl import app
from absl import flags
import jax
import numpy as np

from benchmarks import report
from rlhf_jax.engine.driver import Driver
from rlhf_jax.samples import Request
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib


COMMON = 256
OWN_MAX = 32


def _model_config(smoke: bool = False) -> ModelConfig:
  if smoke:
    return ModelConfig.tiny(num_layers=1, embed_dim=64, num_heads=2,
                            num_kv_heads=1, head_dim=32, mlp_dim=128,
                            vocab_size=1024)
  return ModelConfig.tiny(num_layers=4, embed_dim=256, num_heads=8,
                          num_kv_heads=2, head_dim=64, mlp_dim=768,
                          vocab_size=1024)


class _Variant:
  """One engine + driver and its timings."""

  def __init__(self, name, engine, params, requests, common_prefix):
    self.name, self.engine, self.params = name, engine, params
    self.requests, self.common_prefix = requests, common_prefix
    self.driver = Driver(engine, params)
    self.rollout_s, self.prefill_s, self.step_ms = [], [], []
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

  def _prefill_all(self):
    eng = self.engine
    own_start = 0
    if self.common_prefix is not None:
      common = np.asarray(self.requests[0].tokens[:COMMON])
      eng.set_common_prefix(self.params, common)
      own_start = COMMON
    prefixes = []
    for r in self.requests:
      padded, n = eng.pad_prompt(r.tokens[own_start:], r.prompt_id)
      prefixes.append(eng.prefill_multisampling(
          self.params, padded, n, r.num_samples, prompt_id=r.prompt_id,
          seed=r.seed))
    jax.block_until_ready([p.first_tokens for p in prefixes])
    return prefixes

  def phases(self, timed=True):
    """Prefill phase, then decode steps with every sample live."""
    eng = self.engine
    t0 = time.perf_counter()
    prefixes = self._prefill_all()
    dt = time.perf_counter() - t0
    state = eng.init_decode_state()
    for row, prefix in enumerate(prefixes):
      state = eng.bulk_insert(prefix, state, eng.slots_of_row[row])
    jax.block_until_ready(state)
    times = []
    for _ in range(eng.sampling.max_new_tokens - 1 if timed else 1):
      t1 = time.perf_counter()
      state, result = eng.generate(self.params, state)
      result.data.block_until_ready()
      times.append(time.perf_counter() - t1)
    if timed:
      self.prefill_s.append(dt)
      self.step_ms.append(1e3 * float(np.median(times)))


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
  make = lambda **kw: Engine(cfg, graphdef, layout, num_rows=n_prompts,
                             samples_per_row=group, sampling=sampling, **kw)
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
  kv_base = R * (COMMON + OWN_MAX) + R * G * M
  kv_com = COMMON + R * OWN_MAX + R * G * M
  rows = [dict(variant=v.name, rollout_s=med(v.rollout_s),
               prefill_s=med(v.prefill_s), step_ms=med(v.step_ms),
               prefill_tokens=v.prefill_tokens,
               state_bytes=v.engine.decode_state_bytes())
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
      kv_read_ratio_theory=round(kv_com / kv_base, 4),
      tokens_identical_fraction=round(same, 4),
      common_length=COMMON, own_tokens="8..32", num_prompts=R,
      samples_per_prompt=G, max_new_tokens=M, repeats=repeats, quick=quick,
      params_m=round(cfg.num_params() / 1e6, 2), wall_s=round(wall, 1))


def table(res) -> str:
  head = (f"{'variant':>8} | {'rollout s':>9} {'prefill s':>9} "
          f"{'step ms':>8} | {'prefill tok':>11} {'state MB':>8}")
  lines = [head, "-" * len(head)]
  for r in res["rows"]:
    lines.append(
        f"{r['variant']:>8} | {r['rollout_s']:>9.3f} {r['prefill_s']:>9.3f} "
        f"{r['step_ms']:>8.2f} | {r['prefill_tokens']:>11} "
        f"{r['state_bytes'] / 2**20:>8.2f}")
  lines.append(
      f"speedup (baseline / common, median of paired repeats): rollout "
      f"{res['rollout_speedup_common256']:.2f}x, prefill "
      f"{res['prefill_speedup_common256']:.2f}x, decode step "
      f"{res['decode_step_speedup_common256']:.2f}x (rollout predicted from "
      f"the phases: {res['rollout_speedup_from_phases']:.2f}x)")
  lines.append(
      f"common / baseline: prefill tokens {res['prefill_tokens_ratio']:.3f}, "
      f"decode-state bytes {res['kv_bytes_ratio']:.3f}, KV read per step "
      f"(theory) {res['kv_read_ratio_theory']:.3f}; identical samples "
      f"{res['tokens_identical_fraction']:.2%}")
  lines.append(
      f"{res['num_prompts']} prompts = {res['common_length']} common + "
      f"{res['own_tokens']} own tokens, G={res['samples_per_prompt']}, "
      f"{res['max_new_tokens']} new tokens (temperature 1, no stop).")
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
