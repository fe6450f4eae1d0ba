"""Per-phase time and throughput of one GRPO step (rollout, scoring, train).

python -m benchmarks.grpo_step [--quick] [--config.model.overrides.num_layers=4]
    [--config.train.prompts_per_step=32] [--config.rollout.samples_per_row=8]
    [--config.rollout.max_new_tokens=4] [--config.rollout.prefill_buckets=(8,)]

Runs the default job's config (no SFT: the phases cost the same on random
weights), skips the first step (compilation), and reports medians over the
rest (the first step's time, compiles included, is `first_step_s`).
`--smoke` (tests/test_benchmarks_smoke.py): 8
prompts, one timed step; its numbers mean nothing.

Last stdout line: JSON with `steps_per_s`, `tokens_per_s`,
`step_s`, and the phases' medians `repartition_s`,
`rollout_s`, `scoring_s`, `train_s`; also `build_s` (the job's build),
`first_step_s`, `peak_bytes` (the device's high-water mark, where the
backend reports one), each timed step's phases, and with
`--compilation_cache=DIR` what the first step loaded from and wrote to
JAX's persistent cache there: run twice with one DIR to see what a warm
cache saves the first step (docs/results.md, GPU). `--out` writes the
result with its commit, date and machine (benchmarks/report.py).
"""

import faulthandler
import statistics
import time

from absl import app, flags
from ml_collections import config_flags

from benchmarks import report
from benchmarks import timing

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/tiny_grpo.py", "GRPO config to time.")
_QUICK = flags.DEFINE_bool("quick", False, "Fewer steps (< 3 minutes).")
_STEPS = flags.DEFINE_integer("steps", 12, "Timed steps (after one warm-up).")
_SMOKE = flags.DEFINE_bool("smoke", False, "One timed step of 8 prompts: "
                           "that it runs (tests), not a measurement.")
_CACHE = flags.DEFINE_string(
    "compilation_cache", "off", "A directory for JAX's persistent "
    "compilation cache ('off': none); rlhf_jax/compile_cache.py.")
_STACK_EVERY = flags.DEFINE_float(
    "stack_every", 0, "Seconds between dumps of every thread's Python stack "
    "to stderr (0: none): where the host is when a step runs long.")

PHASES = ("perf/repartition_s", "perf/rollout_s", "perf/scoring_s",
          "perf/train_s", "perf/step_s", "perf/tokens_per_s")


def main(argv):
  del argv
  import jax

  from rlhf_jax import compile_cache
  from rlhf_jax.trainers import rl_job
  from rlhf_jax.trainers.rl_step import rl_step

  config = _CONFIG.value
  if _STACK_EVERY.value:
    faulthandler.dump_traceback_later(_STACK_EVERY.value, repeat=True)
  if _SMOKE.value:  # The runlocal batch (configs/common.shrink_addition_rl).
    timing.smoke_defaults(steps=1)
    config.train.prompts_per_step = config.rollout.num_rows = 8
  cache = compile_cache.setup(_CACHE.value, workdir="")
  t0 = time.perf_counter()
  job = rl_job.build(config)
  states = job.fresh_states(job.params)  # The policy and a reference copy.
  jax.block_until_ready(states)
  build_s = time.perf_counter() - t0
  steps = 4 if _QUICK.value else _STEPS.value
  print(f"built in {build_s:.1f} s", flush=True)
  t0 = time.perf_counter()
  states, first = rl_step(job, 1, states)
  first_s = time.perf_counter() - t0
  print(f"first step {first_s:.1f} s: " + ", ".join(
      f"{k.split('/')[1]} {first[k]:.1f}" for k in PHASES[:5]), flush=True)
  cache_line = compile_cache.summary(cache) if cache else None
  records = []
  for step in range(2, steps + 2):
    states, metrics = rl_step(job, step, states)
    records.append(metrics)
    print(f"step {step}: " + ", ".join(
        f"{k.split('/')[1]} {metrics[k]:.2f}" for k in PHASES), flush=True)
  med = {k: statistics.median(r[k] for r in records) for k in PHASES}
  B = config.train.prompts_per_step * config.rollout.samples_per_row
  print(f"GRPO step: {config.train.prompts_per_step} prompts x "
        f"{config.rollout.samples_per_row} samples = {B} sequences, "
        f"{jax.device_count()} device(s), median of {len(records)} steps")
  print(f"{'phase':<22}{'seconds':>10}{'share':>8}")
  for k in PHASES[:4]:
    print(f"{k:<22}{med[k]:>10.3f}{med[k] / med['perf/step_s']:>8.0%}")
  print(f"{'perf/step_s':<22}{med['perf/step_s']:>10.3f}")
  print(f"{'perf/tokens_per_s':<22}{med['perf/tokens_per_s']:>10.1f}")
  print(f"{'first step (compile)':<22}{first_s:>10.3f}")
  print(f"{'build (init, ref copy)':<22}{build_s:>10.3f}")
  peak = (jax.local_devices()[0].memory_stats() or {}).get(
      "peak_bytes_in_use")
  if peak is not None:
    print(f"peak device memory: {peak / 2**30:.2f} GiB")
  if cache_line:
    print(cache_line)
  summary = {"steps_per_s": 1.0 / med["perf/step_s"],
             "tokens_per_s": med["perf/tokens_per_s"],
             **{k.split("/")[1]: med[k] for k in PHASES[:4]},
             "step_s": med["perf/step_s"], "first_step_s": first_s,
             "build_s": build_s, "peak_bytes": peak,
             "compilation_cache": cache_line,
             "device": jax.devices()[0].device_kind,
             "per_step": [{k.split("/")[1]: r[k] for k in PHASES}
                          for r in records]}
  report.emit(summary)


if __name__ == "__main__":
  app.run(main)
