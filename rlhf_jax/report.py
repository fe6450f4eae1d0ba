"""End-of-run report: a summary table and reward_curve.png in the workdir."""

from __future__ import annotations

import os

LOG_KEYS = (("rollout/reward_mean", "reward"), ("eval/accuracy", "eval_acc"),
            ("eval/reward_mean", "eval_reward"), ("train/loss", "loss"),
            ("train/kl", "train_kl"), ("rollout/kl", "rollout_kl"),
            ("critic/loss", "vf_loss"), ("perf/step_s", "step_s"))
# (key, label) of eval metrics reported first -> last and plotted.
EVAL_KEYS = (("eval/accuracy", "eval accuracy (greedy, held-out)"),
             ("eval/reward_mean", "eval reward-model score (greedy)"))


def sampled_eval_keys(records: list[dict]) -> list[tuple[str, str]]:
  """(key, label) of pass@1, pass@n and maj@n where the job sampled n
  responses a held-out prompt (`eval.num_samples`)."""
  ks = sorted({int(k.rsplit("_", 1)[1]) for r in records for k in r
               if k.startswith("eval/pass_at_")})
  if not ks:
    return []
  n = ks[-1]
  return [(f"eval/pass_at_{k}", f"pass@{k} (T > 0, held-out)")
          for k in dict.fromkeys((1, n))] + [
              (f"eval/maj_at_{n}", f"maj@{n} (T > 0, held-out)")]


def log_line(record: dict) -> str:
  return " ".join(f"{short} {record[k]:.4g}" for k, short in LOG_KEYS
                  if k in record)


def summary_table(records: list[dict]) -> str:
  rl = [r for r in records if r.get("phase") == "rl"]
  sft = [r for r in records if r.get("phase") == "sft"]
  rows = []
  if sft:
    rows.append(("sft steps", f"{sft[-1]['step']}"))
    rows.append(("sft final loss", f"{sft[-1]['sft/loss']:.4f}"))
  for key, _ in EVAL_KEYS + tuple(sampled_eval_keys(rl)):
    seen = [r[key] for r in rl if key in r]
    if seen:
      rows.append((f"{key} first (after SFT) -> last",
                   f"{seen[0]:.3f} -> {seen[-1]:.3f}"))
  steps = [r for r in rl if "rollout/reward_mean" in r]
  if steps:
    rows.append(("rl steps", f"{steps[-1]['step']}"))
    rows.append(("reward first -> last", f"{steps[0]['rollout/reward_mean']:.3f}"
                 f" -> {steps[-1]['rollout/reward_mean']:.3f}"))
    if "rollout/kl" in steps[-1]:
      rows.append(("rollout/kl first -> last", f"{steps[0]['rollout/kl']:.4f}"
                   f" -> {steps[-1]['rollout/kl']:.4f}"))
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
  values = [r["rollout/reward_mean"] for r in steps]
  for key, label in EVAL_KEYS + tuple(sampled_eval_keys(rl)):
    evals = [r for r in rl if key in r]
    if evals:
      ax.plot([r["step"] for r in evals], [r[key] for r in evals], "o-",
              label=label)
      values += [r[key] for r in evals]
  ax.set_xlabel("RL step")
  # Weighted rewards can exceed 1; reward-model scores can be negative.
  ax.set_ylim(min([0.0] + values) * 1.05, max([1.0] + values) * 1.05)
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
