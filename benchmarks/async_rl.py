"""Async GRPO vs the synchronous job: trained response tokens per second.

  python -m benchmarks.async_rl [--quick]

The default task's model from random weights (one SFT step: the phases
cost the same; response lengths follow the stop token's chance under a
near-uniform policy, a long tail up to `max_new_tokens`), on 8 forced CPU
devices and equal prompts per step in both modes:

  sync:  the colocated job (`trainers/rl_step.py`): all 8 devices
         decode (paged engine), then all 8 train.
  async: `config.asynchronous` (eta = 1, TIS): 4 devices decode batch
         after batch (`rollout/asynchronous.py`) while the other 4 train.

Each run is the real job (`rl_job.run`) for `--steps` RL steps; the first
two (compilation) are not measured. Throughput = response tokens trained
(every sample of a step; none is dropped) / the steps' seconds
(`perf/step_s`: from the step's start to its update applied; in async the
trainer's wait for its batch included). Runs alternate between the modes;
the ratio is the median over repeats.

What bounds it here: the 8 fake devices share 2 cores, so the rollout's
and the trainer's compute contend for the same CPU; the overlap is of
the decode's per-step latency (host work, small dispatches) with the
trainer's compute, and of the tail's idle rows with the next batch.

The simulator (`sim/async_run.py`, the rules of `sched/staleness.py`)
predicts the ratio from each repeat's measured unit costs: the decode
step of each mode's engine, the trainer's busy seconds a step (async) or
the step less its rollout (sync), num_rows x G slots; the response
lengths are a capped geometric (the stop token's chance per token) whose
mean is the measured one. `sim_rel_error` = sim / live - 1.

`--smoke` (tests/test_benchmarks_smoke.py): 8 prompts, 8 new tokens, no
SFT step, one measured step, one repeat; the numbers mean nothing.

Last stdout line: JSON with `throughput_vs_sync`, `sim_throughput_vs_sync`,
`sim_rel_error`, `staleness_mean`, `stale_dropped`,
`off_policy_samples_fraction`, medians, ...
"""

from __future__ import annotations

import statistics
import sys
import tempfile

import numpy as np
from absl import app
from absl import flags

from benchmarks import report
from benchmarks import timing

_QUICK = flags.DEFINE_bool("quick", False, "Fewer repeats and steps.")
_REPEATS = flags.DEFINE_integer("repeats", 0, "0: 1 (--quick) or 3.")
_STEPS = flags.DEFINE_integer("steps", 0, "RL steps a run; 0: 8 or 12.")
_PROMPTS = flags.DEFINE_integer("prompts", 16, "Prompts per step.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 48, "Length cap.")
_SMOKE = flags.DEFINE_bool("smoke", False, "One measured step of 8 prompts "
                           "a mode: that it runs (tests).")
WARMUP = 2


def _config(mode: str, steps: int):
  from configs import tiny_grpo, tiny_grpo_async

  c = (tiny_grpo_async if mode == "async" else tiny_grpo).get_config(
      "runlocal")
  n = _PROMPTS.value
  # --smoke: no warm-start step (a train program of its own to compile;
  # nothing it measures depends on it).
  c.sft.steps = 0 if _SMOKE.value else 1
  c.train.update(steps=steps, prompts_per_step=n, checkpoint_every=1000)
  c.eval.update(every=1000, batch_size=8, num_rows=8)
  c.task.num_eval = 8
  c.rollout.update(num_rows=n,
                   max_new_tokens=_MAX_NEW.value,
                   max_seq_len=max(c.rollout.prefill_buckets)
                   + 2 * _MAX_NEW.value)
  c.rl.update(num_minibatches=1, importance_weight="tis")
  return c


def _run(mode: str, steps: int) -> dict:
  from rlhf_jax.metrics import MetricWriter
  from rlhf_jax.trainers import rl_job

  with tempfile.TemporaryDirectory() as workdir:
    rl_job.run(_config(mode, steps), workdir)
    records = [r for r in MetricWriter(workdir, enabled=False).read()
               if r["phase"] == "rl" and r["step"] > WARMUP]
  B = _PROMPTS.value * 8
  tokens = sum(r["rollout/response_len_mean"] * B for r in records)
  seconds = sum(r["perf/step_s"] for r in records)
  out = {"tokens_per_s": tokens / seconds, "step_s": seconds / len(records),
         "response_len": statistics.fmean(
             r["rollout/response_len_mean"] for r in records),
         "stale_dropped": sum(r["rollout/stale_dropped"] for r in records),
         "samples": B * len(records)}
  if mode == "sync":  # Decode steps: the longest response's tokens.
    out["unit"] = dict(
        step_s=sum(r["perf/rollout_s"] for r in records)
        / sum(r["rollout/response_len_max"] for r in records),
        train_s=statistics.fmean(r["perf/step_s"] - r["perf/rollout_s"]
                                 for r in records))
  else:
    out["unit"] = dict(
        step_s=sum(r["perf/rollout_decode_s"] for r in records)
        / sum(r["async/decode_steps"] for r in records),
        train_s=statistics.fmean(r["perf/step_s"] - r["perf/trainer_wait_s"]
                                 for r in records))
    out.update(
        staleness_mean=statistics.fmean(r["async/staleness_mean"]
                                        for r in records),
        off_policy=sum(r["async/off_policy_samples"] for r in records),
        trainer_wait_s=statistics.fmean(r["perf/trainer_wait_s"]
                                        for r in records),
        rollout_wait_s=statistics.fmean(r["perf/rollout_wait_weights_s"]
                                        for r in records))
  return out


class _GeometricLengths:
  """Batches of `prompts` x 8 responses whose lengths are capped geometric
  draws with mean `mean` (the stop token's chance p per token, solved
  from E[min(X, cap)] = (1 - (1 - p)^cap) / p)."""

  def __init__(self, mean: float, cap: int, prompts: int, prompt_len: int):
    lo, hi = 1e-6, 1.0
    for _ in range(100):  # The capped mean falls as p grows.
      p = (lo + hi) / 2
      lo, hi = (p, hi) if (1 - (1 - p) ** cap) / p > mean else (lo, p)
    self.p, self.cap, self.prompts = p, cap, prompts
    self.prompt_len = prompt_len

  def batch(self, step: int):
    from rlhf_jax.sim.workload import StepBatch
    rng = np.random.default_rng(step)
    n = np.minimum(rng.geometric(self.p, (self.prompts, 8)), self.cap)
    return StepBatch(list(range(self.prompts)), [
        (i, j, self.prompt_len, int(n[i, j]))
        for i in range(self.prompts) for j in range(8)])


def _simulated_ratio(sync: dict, asyn: dict, steps: int) -> float:
  """Sync over async step seconds in the simulator at one repeat's units."""
  from rlhf_jax.sched.named_policies import get_policy
  from rlhf_jax.sim import async_run
  from rlhf_jax.sched.cost_model.setting import Setting

  c = _config("sync", steps)
  mean = (sync["response_len"] + asyn["response_len"]) / 2
  lengths = _GeometricLengths(mean, _MAX_NEW.value, _PROMPTS.value,
                              max(c.rollout.prefill_buckets))
  slots = c.rollout.num_rows * c.rollout.samples_per_row
  setting = Setting(model="tiny", hardware="cpu", reserved_devices=8)
  units = {m: async_run.Measured(slots=slots, **r["unit"])
           for m, r in (("sync", sync), ("async", asyn))}
  sync_s = statistics.fmean(
      async_run.sync_step_s(setting, lengths.batch(i), units["sync"])
      for i in range(WARMUP, steps))
  result = async_run.run(setting, get_policy("baseline"), lengths, steps,
                         eta=1, rollout_devices=4,
                         switch_after_groups=_PROMPTS.value // 2,
                         measured=units["async"])
  async_s = async_run.summarize(result, setting, WARMUP)["step_s"]
  return sync_s / async_s


def main(argv):
  del argv
  if _SMOKE.value:  # The fewest steps that leave one measured.
    timing.smoke_defaults(quick=True, repeats=1, steps=WARMUP + 1, prompts=8,
                          max_new_tokens=8)
  import jax
  timing.fake_cpu_devices(8)
  jax.config.update("jax_platforms", "cpu")

  steps = _STEPS.value or (8 if _QUICK.value else 12)
  repeats = _REPEATS.value or (1 if _QUICK.value else 3)
  results = {"sync": [], "async": []}
  for r in range(repeats):
    for mode in results:  # Alternating: the machine's load hits both.
      results[mode].append(_run(mode, steps))
    s, a = results["sync"][-1], results["async"][-1]
    print(f"  repeat {r + 1}: {s['tokens_per_s']:.0f} -> "
          f"{a['tokens_per_s']:.0f} tokens/s", flush=True)
  med = {m: {k: statistics.median(x[k] for x in rs)
             for k in ("tokens_per_s", "step_s", "response_len")}
         for m, rs in results.items()}
  ratios = [a["tokens_per_s"] / s["tokens_per_s"]
            for s, a in zip(results["sync"], results["async"])]
  sim_ratios = [_simulated_ratio(s, a, steps)
                for s, a in zip(results["sync"], results["async"])]
  a = results["async"]
  print(f"\n{_PROMPTS.value} prompts x 8 samples a step, cap "
        f"{_MAX_NEW.value} tokens, {steps - WARMUP} measured steps a run, "
        f"median of {repeats}")
  print(f"{'mode':<8}{'tokens/s':>10}{'step s':>9}{'resp len':>10}")
  print("-" * 37)
  for m in results:
    print(f"{m:<8}{med[m]['tokens_per_s']:>10.0f}{med[m]['step_s']:>9.3f}"
          f"{med[m]['response_len']:>10.1f}")
  staleness = statistics.median(x["staleness_mean"] for x in a)
  print(f"async: mean staleness {staleness:.2f} versions per token, "
        f"trainer waits {statistics.median(x['trainer_wait_s'] for x in a):.3f}"
        f" s a step, rollout waits for weights "
        f"{statistics.median(x['rollout_wait_s'] for x in a):.3f} s a step")
  live, sim = statistics.median(ratios), statistics.median(sim_ratios)
  print(f"throughput vs sync: live {live:.2f}x, sim {sim:.2f}x "
        f"({sim / live - 1:+.1%}); units (s): "
        + ", ".join(f"{m} step {x['unit']['step_s']:.4f} train "
                    f"{x['unit']['train_s']:.3f}"
                    for m, x in (("sync", results["sync"][-1]),
                                 ("async", a[-1]))))
  summary = {
      "throughput_vs_sync": round(live, 3),
      "sim_throughput_vs_sync": round(sim, 3),
      "sim_rel_error": round(sim / live - 1, 3),
      "staleness_mean": round(staleness, 3),
      "stale_dropped": int(sum(x["stale_dropped"] for x in a)),
      "off_policy_samples_fraction": round(
          sum(x["off_policy"] for x in a) / sum(x["samples"] for x in a), 3),
      "ratios": [round(x, 3) for x in ratios], "median": med,
      "steps_measured": steps - WARMUP, "repeats": repeats,
      "quick": _QUICK.value}
  sys.stdout.flush()
  report.emit(summary)


if __name__ == "__main__":
  app.run(main)
