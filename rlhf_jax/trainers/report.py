"""End-of-run report: a summary table and reward_curve.png in the workdir."""

from __future__ import annotations

import os

LOG_KEYS = (("rollout/reward_mean", "reward"), ("eval/accuracy", "eval_acc"),
            ("train/loss", "loss"), ("train/kl", "kl"),
            ("perf/step_s", "step_s"))


def log_line(record: dict) -> str:
  return " ".join(f"{short} {record[k]:.4g}" for k, short in LOG_KEYS
                  if k in record)


def summary_table(records: list[dict]) -> str:
  rl = [r for r in records if r.get("phase") == "rl"]
  evals = [r for r in rl if "eval/accuracy" in r]
  sft = [r for r in records if r.get("phase") == "sft"]
  rows = []
  if sft:
    rows.append(("sft steps", f"{sft[-1]['step']}"))
    rows.append(("sft final loss", f"{sft[-1]['sft/loss']:.4f}"))
  if evals:
    rows.append(("eval/accuracy first (after SFT)",
                 f"{evals[0]['eval/accuracy']:.3f}"))
    rows.append(("eval/accuracy last", f"{evals[-1]['eval/accuracy']:.3f}"))
  steps = [r for r in rl if "rollout/reward_mean" in r]
  if steps:
    rows.append(("rl steps", f"{steps[-1]['step']}"))
    rows.append(("reward first -> last", f"{steps[0]['rollout/reward_mean']:.3f}"
                 f" -> {steps[-1]['rollout/reward_mean']:.3f}"))
    step_s = sorted(r["perf/step_s"] for r in steps)
    rows.append(("median step seconds", f"{step_s[len(step_s) // 2]:.2f}"))
  width = max(len(k) for k, _ in rows) if rows else 0
  return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def plot_curve(records: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rl = [r for r in records if r.get("phase") == "rl"]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  steps = [r for r in rl if "rollout/reward_mean" in r]
  ax.plot([r["step"] for r in steps], [r["rollout/reward_mean"] for r in steps],
          label="rollout reward (sampled)")
  evals = [r for r in rl if "eval/accuracy" in r]
  ax.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals],
          "o-", label="eval accuracy (greedy, held-out)")
  ax.set_xlabel("RL step")
  top = max([1.0] + [r["rollout/reward_mean"] for r in steps])
  ax.set_ylim(0, top * 1.05)  # Weighted rewards can exceed 1.
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def finish(records: list[dict], workdir: str) -> None:
  table = summary_table(records)
  print(table)
  with open(os.path.join(workdir, "summary.txt"), "w") as f:
    f.write(table + "\n")
  plot_curve(records, os.path.join(workdir, "reward_curve.png"))
