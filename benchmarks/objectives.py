"""What the off-policy objectives reach under async RL, each run start to end.

  python -m benchmarks.objectives [--seeds=0,1,2]
      [--out=benchmarks/results/objectives_cpu.json]

Two baselines, measured in the same run: the synchronous default job
(`configs/tiny_grpo.py`, fp32) and the same job with bf16 compute
(`sync-bf16`: `model.compute_dtype=bfloat16`, the fp32 master weights
train), at each seed. The second is the like-for-like one: the async runs
compute in bf16 too, and bf16 changes the warm-start (held-out accuracy
after it: 0.495 at seed 0 in bf16, sync or async, against fp32's 0.435),
so only against it does a gain measure what async and the objective
change. Against them, the async job (`configs/tiny_grpo_async.py`) at
eta = 2 with a bf16 rollout copy under each objective of `rl/off_policy.py`
and `rl/losses.py`:

  tis        the async config's own: TIS at C = 2
  icepop     IcePop: tokens outside [0.5, 2] masked
  seq-mask   the geometric sequence mask, band (0.9, 1.1), on TIS (alone,
             or at the band (0.99, 1.01), it lost most of the gain:
             docs/results.md, `seq_mask_trials_cpu.json`)
  cispo      CISPO's loss (clip_low 1: from above only) with TIS weights

Each run is `benchmarks.job_run.run_job` (a child process, a fresh workdir)
on 8 fake CPU devices (`XLA_FLAGS`'s device count, set to 8 when the
environment gives none: the async job splits the devices);
`gain` is its last held-out greedy accuracy minus its first (after the SFT
warm-start). The result: each objective's median gain over the seeds and
its difference to each baseline's median ([algos] asks >= -0.05), and
every run's gain.
"""

from __future__ import annotations

import os
import statistics

from absl import app
from absl import flags

from benchmarks import job_run
from benchmarks import report

_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "config seeds to run.")
_ONLY = flags.DEFINE_list("only", [], "run only these variants (and sync).")
_SMOKE = flags.DEFINE_bool("smoke", False, "the configs' :runlocal variants "
                           "at the first seed (tests/test_benchmarks_smoke.py)")

_BF16 = ["model.compute_dtype=bfloat16"]
_ASYNC = ["asynchronous.max_staleness=2"] + _BF16
BASELINES = ("sync", "sync-bf16")
VARIANTS = {
    "sync": ("configs/tiny_grpo.py", []),
    "sync-bf16": ("configs/tiny_grpo.py", _BF16),
    "tis": ("configs/tiny_grpo_async.py", _ASYNC),
    "icepop": ("configs/tiny_grpo_async.py", _ASYNC + [
        "rl.importance_weight=icepop", "rl.importance_floor=0.5"]),
    "seq-mask": ("configs/tiny_grpo_async.py", _ASYNC + [
        "rl.sequence_mask=geometric", "rl.sequence_band=(0.9,1.1)"]),
    "cispo": ("configs/tiny_grpo_async.py", _ASYNC + [
        "rl.policy_loss=cispo", "rl.clip_low=1.0"]),
}


def main(argv):
  del argv
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in xla_flags:
    os.environ["XLA_FLAGS"] = (
        f"{xla_flags} --xla_force_host_platform_device_count=8".strip())
  seeds = [int(s) for s in _SEEDS.value][:1 if _SMOKE.value else None]
  names = [n for n in VARIANTS
           if n == "sync" or not _ONLY.value or n in _ONLY.value]
  baselines = [n for n in BASELINES if n in names]
  runs: dict[str, dict[int, dict]] = {n: {} for n in names}
  for name in names:
    config, overrides = VARIANTS[name]
    config = report.repo_path(config) + (":runlocal" if _SMOKE.value else "")
    for seed in seeds:
      result, _ = job_run.run_job(config, overrides + [f"seed={seed}"])
      runs[name][seed] = {k: result[k] for k in (
          "gain", "eval_accuracy_first", "eval_accuracy_last", "wall_s",
          "rl_step_median_s") if k in result}
  print(f"{'variant':10s} " + " ".join(f"seed {s:<6d}" for s in seeds)
        + " median" + "".join(f" vs {b:>9s}" for b in baselines))
  medians = {n: statistics.median(r["gain"] for r in runs[n].values())
             for n in names}
  summary: dict = {f"{b.replace('-', '_')}_gain_median": round(
      medians[b], 4) for b in baselines}
  for name in names:
    gains = " ".join(f"{runs[name][s]['gain']:+11.3f}" for s in seeds)
    diffs = {b: medians[name] - medians[b] for b in baselines}
    print(f"{name:10s} {gains} {medians[name]:+7.3f}"
          + "".join(f" {d:+12.3f}" for d in diffs.values()))
    if name not in BASELINES:
      summary[f"{name}.gain_median"] = round(medians[name], 4)
      for b, d in diffs.items():
        summary[f"{name}.vs_{b.replace('-', '_')}"] = round(d, 4)
  summary["seeds"] = seeds
  summary["runs"] = {n: {str(s): r for s, r in v.items()}
                     for n, v in runs.items()}
  report.emit(summary)


if __name__ == "__main__":
  app.run(main)
