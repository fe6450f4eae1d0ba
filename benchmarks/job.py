"""What a whole job reaches: a config run start to finish in a fresh workdir.

  python -m benchmarks.job --config=configs/tiny_ppo.py [--set=seed=1 ...]
      [--out=benchmarks/results/job_tiny_ppo_cpu.json]

Runs `python -m rlhf_jax.main --config=CONFIG --workdir=TMP` as a child
process (the environment passes through: `XLA_FLAGS` picks the devices and
the arithmetic) and reads the workdir the job wrote. The baseline measured in
the same run is the job's own first evaluation, after its SFT warm-start:
`gain` is the last held-out accuracy minus the first, `eval_reward_gain` the
same for a reward-model score. Reported with them: the wall time of the
whole command (compiles included), every evaluation, the first and last
sampled reward and KL, the sampled reward's mean over each tenth of the
RL steps (one step's batch is noisy), each reward's greedy mean at every
evaluation (`eval_<reward>`), the median RL step and where its time goes,
the per-token KL of every step, the padded fraction of the positions the
train step computes on, each phase's total time and the eval's share of the
wall time (timeline.json), the reward model's held-out pair accuracy
(`configs/tiny_rm.py`), the tool-call rate (`config.agent`), an MoE
policy's fewest and most tokens an expert received in a step's batch, and
the job's own summary.txt. `--workdir` keeps the run's directory: the
PPO job reads its reward model from `reward_model.workdir`
(`workdirs/tiny_rm` in `configs/tiny_ppo.py`), so run
`--config=configs/tiny_rm.py --workdir=workdirs/tiny_rm` first.

The figures README.md quotes for the RM, PPO and tool jobs come from this
benchmark's committed results (tests/test_doc_figures.py).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

from benchmarks import report

_CONFIG = flags.DEFINE_string("config", "configs/tiny_grpo.py",
                              "The job's config (with :args).")
_SET = flags.DEFINE_multi_string(
    "set", [], "key=value config overrides (--set=seed=1 passes "
    "--config.seed=1).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Keep the run here (a new "
                               "directory; default: a temporary one).")
_SMOKE = flags.DEFINE_bool("smoke", False, "The config's :runlocal variant "
                           "(tests/test_benchmarks_smoke.py).")


def _series(records: list[dict], key: str) -> list[float]:
  return [r[key] for r in records if key in r]


def outcome(records: list[dict]) -> dict:
  """The figures of one finished job, from its metrics.jsonl records."""
  out: dict = {}
  rl = [r for r in records if r.get("phase") == "rl"]
  evals = _series(rl, "eval/accuracy")
  if evals:
    out.update(eval_accuracy_first=evals[0], eval_accuracy_last=evals[-1],
               gain=round(evals[-1] - evals[0], 4), eval_accuracy=evals)
  scores = _series(rl, "eval/reward_mean")
  if scores:
    out.update(eval_reward_first=scores[0], eval_reward_last=scores[-1],
               eval_reward_gain=round(scores[-1] - scores[0], 4))
  for key in sorted({k for r in rl for k in r if k.startswith("eval/rewards/")}):
    out[f"eval_{key.split('/')[-1]}"] = _series(rl, key)  # Greedy means.
  rewards = _series(rl, "rollout/reward_mean")
  if len(rewards) >= 10:  # The curve: the mean of each tenth of the run.
    tenths = np.array_split(np.asarray(rewards), 10)
    out["reward_mean_by_tenth"] = [round(float(t.mean()), 4) for t in tenths]
  if scores:
    out["eval_reward"] = scores
  for key, name in (("rollout/reward_mean", "reward"),
                    ("rollout/kl", "rollout_kl"),
                    ("rollout/tool_call_rate", "tool_call_rate")):
    seen = _series(rl, key)
    if seen:
      out[f"{name}_first"], out[f"{name}_last"] = seen[0], seen[-1]
  steps = _series(rl, "perf/step_s")
  if steps:
    out.update(rl_steps=len(steps),
               rl_step_median_s=round(statistics.median(steps), 4))
    out["step_median_s"] = {  # Where a step's time goes.
        phase: round(statistics.median(_series(rl, f"perf/{phase}_s")), 3)
        for phase in ("rollout", "scoring", "train", "repartition")
        if _series(rl, f"perf/{phase}_s")}
  kl = _series(rl, "train/kl")
  if kl:
    out["train_kl"] = [round(v, 5) for v in kl]  # Per token, each step.
  padding = _series(rl, "train/padding_fraction")
  if padding:
    out.update(padding_fraction_median=round(statistics.median(padding), 4),
               padding_fraction_max=round(max(padding), 4))
    positions = _series(rl, "train/positions")
    if len(positions) == len(padding):  # Over the run: weighed by size.
      out["padding_fraction_total"] = round(float(
          np.dot(positions, padding) / np.sum(positions)), 4)
  fewest = _series(rl, "train/expert_tokens_min")
  if fewest:  # An MoE policy: did every expert of every layer get tokens?
    out.update(expert_tokens_min_over_steps=min(fewest),
               steps_with_an_idle_expert=sum(v == 0 for v in fewest),
               expert_tokens_max_over_steps=max(
                   _series(rl, "train/expert_tokens_max")),
               moe_balance_loss_last=round(
                   _series(rl, "train/moe_balance_loss")[-1], 4))
  pair = _series(records, "rm/pair_accuracy")
  if pair:
    out.update(rm_pair_accuracy=pair, rm_pair_accuracy_last=pair[-1])
  return out


def timeline_totals(path: str) -> dict[str, float]:
  """Seconds per phase over the whole run (the job's timeline.json)."""
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    events = json.load(f)["traceEvents"]
  totals: dict[str, float] = {}
  for e in events:
    if e.get("ph") == "X":
      totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"] / 1e6
  return {k: round(v, 2) for k, v in sorted(totals.items())}


def main(argv):
  del argv
  config = _CONFIG.value
  if _SMOKE.value and ":" not in config:
    config += ":runlocal"
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="rlhf_jax_job_")
  cmd = [sys.executable, "-m", "rlhf_jax.main", f"--config={config}",
         f"--workdir={workdir}", *(f"--config.{s}" for s in _SET.value)]
  print(" ".join(cmd[1:]), flush=True)
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, check=False)
  wall = time.perf_counter() - t0
  try:
    if proc.returncode != 0:
      sys.exit(f"error: the job exited with status {proc.returncode}")
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      records = [json.loads(line) for line in f if line.strip()]
    spans = timeline_totals(os.path.join(workdir, "timeline.json"))
    summary_path = os.path.join(workdir, "summary.txt")
    summary_txt = []
    if os.path.exists(summary_path):
      with open(summary_path, encoding="utf-8") as f:
        summary_txt = f.read().splitlines()
  finally:
    if _WORKDIR.value is None:
      shutil.rmtree(workdir, ignore_errors=True)
  result = dict(config=config, overrides=list(_SET.value),
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                wall_s=round(wall, 1), **outcome(records))
  if spans:
    result.update(timeline_totals_s=spans,
                  eval_share=round(spans.get("eval", 0.0) / wall, 4))
  print(f"wall time {wall:.1f} s")
  for line in summary_txt:
    print(line)
  report.emit(result, detail=dict(summary_txt=summary_txt))


if __name__ == "__main__":
  app.run(main)
