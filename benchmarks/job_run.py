"""One job run start to finish and the figures read from its workdir: the
part of `benchmarks.job` that `benchmarks.objectives` reuses (no flags)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


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


def eval_ends(path: str, start_unix_s: float) -> list[float]:
  """Seconds from `start_unix_s` (the command's start) to the end of each
  evaluation, in order (the job's timeline.json)."""
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    timeline = json.load(f)
  origin = timeline["otherData"]["origin_unix_s"]
  ends = sorted(e["ts"] + e["dur"] for e in timeline["traceEvents"]
                if e.get("ph") == "X" and e["name"] == "eval")
  return [round(origin + t / 1e6 - start_unix_s, 1) for t in ends]


def run_job(config: str, overrides: list[str],
            workdir: str | None = None) -> tuple[dict, list[str]]:
  """(the figures of `config` run start to finish with `--config.<k>=<v>`
  `overrides`, its summary.txt lines); `workdir` None: a temporary one,
  removed after."""
  keep = workdir is not None
  workdir = workdir or tempfile.mkdtemp(prefix="rlhf_jax_job_")
  cmd = [sys.executable, "-m", "rlhf_jax.main", f"--config={config}",
         f"--workdir={workdir}", *(f"--config.{s}" for s in overrides)]
  print(" ".join(cmd[1:]), flush=True)
  t0, start_unix_s = time.perf_counter(), time.time()
  proc = subprocess.run(cmd, check=False)
  wall = time.perf_counter() - t0
  try:
    if proc.returncode != 0:
      sys.exit(f"error: the job exited with status {proc.returncode}")
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      records = [json.loads(line) for line in f if line.strip()]
    spans = timeline_totals(os.path.join(workdir, "timeline.json"))
    ends = eval_ends(os.path.join(workdir, "timeline.json"), start_unix_s)
    summary_path = os.path.join(workdir, "summary.txt")
    summary_txt = []
    if os.path.exists(summary_path):
      with open(summary_path, encoding="utf-8") as f:
        summary_txt = f.read().splitlines()
  finally:
    if not keep:
      shutil.rmtree(workdir, ignore_errors=True)
  result = dict(config=config, overrides=list(overrides),
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                wall_s=round(wall, 1), **outcome(records))
  if spans:
    result.update(timeline_totals_s=spans,
                  eval_share=round(spans.get("eval", 0.0) / wall, 4))
  accuracy = result.get("eval_accuracy", [])
  if ends and len(ends) == len(accuracy):
    result["eval_done_s"] = ends
    # When the held-out accuracy first stood 0.20 above the first
    # evaluation's: seconds from the command's start to that evaluation's
    # end (None if never).
    result["gain_0_20_at_s"] = next(
        (t for t, a in zip(ends, accuracy) if a >= accuracy[0] + 0.20), None)
  return result, summary_txt
