"""Runs jobs in this tree and another and compares every metric they log.

  python tools/same_metrics.py --other=/tmp/before [--cases=default,ppo]
      [--workdir=/tmp/same_metrics] [--out=F]

A refactor that changes no numbers leaves every logged value of a job as
it was: each case (a job and its overrides, `CASES`) runs to completion
in each tree, in a fresh process (`python -m rlhf_jax.main` from that
tree's directory), and every numeric value of every RL record
(`metrics.jsonl`: rewards, KL, losses, gradient norms, evaluations, counts)
is compared; perf/ (timings) and memory/ (byte counts) are left out.
PPO's case needs a reward model: `tiny_rm:runlocal` is trained once, in
this tree, for both. Prints a table and, last, one JSON line: per case the
values compared and the worst relative difference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

EIGHT = "--xla_force_host_platform_device_count=8"
CASES = {  # name -> (XLA_FLAGS, main.py arguments); {rm}: the reward model.
    "default": ("", ["--config=configs/tiny_grpo.py",
                     "--config.train.steps=10", "--config.eval.every=5",
                     "--config.train.checkpoint_every=10"]),
    "dapo": (EIGHT, ["--config=configs/tiny_grpo.py:runlocal",
                     "--config.rl.dynamic_sampling=True"]),
    "async": (EIGHT, ["--config=configs/tiny_grpo_async.py:runlocal"]),
    "ppo": (EIGHT, ["--config=configs/tiny_ppo.py:runlocal,rm_workdir={rm}"]),
    "fused": (EIGHT, ["--config=configs/tiny_grpo.py:runlocal",
                      "--config.rollout.long_tail.enabled=True",
                      "--config.rollout.long_tail.consolidate_below=0.5",
                      "--config.rollout.num_rows=16"]),
    "smollm2": ("", ["--config=configs/smollm2_grpo.py",
                     "--config.train.steps=3", "--config.eval.every=3",
                     "--config.train.checkpoint_every=3"]),
}
_SKIP = ("perf/", "memory/")


def rl_records(workdir: str) -> dict[int, dict[str, float]]:
  """step -> the numeric values of its RL record (perf/, memory/ left
  out)."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if r.get("phase") == "rl":
        out[r["step"]] = {k: v for k, v in r.items()
                          if isinstance(v, (int, float)) and k != "step"
                          and not k.startswith(_SKIP)}
  return out


def compare(a: dict, b: dict) -> dict:
  """Values compared, the worst relative difference, what differs."""
  if sorted(a) != sorted(b):
    return {"error": f"steps differ: {sorted(a)} vs {sorted(b)}"}
  worst, n, differ = 0.0, 0, []
  for step in sorted(a):
    if set(a[step]) != set(b[step]):
      differ.append([step, sorted(set(a[step]) ^ set(b[step]))])
    for key in sorted(set(a[step]) & set(b[step])):
      x, y = a[step][key], b[step][key]
      n += 1
      if x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)):
        continue
      rel = abs(x - y) / max(abs(x), abs(y))
      worst = max(worst, rel)
      if rel > 1e-6:
        differ.append([step, key, x, y])
  return {"values": n, "steps": len(a), "worst_rel_diff": worst,
          "differ": differ}


def _run(tree: str, xla: str, args: list[str], workdir: str) -> float:
  env = dict(os.environ, XLA_FLAGS=xla, PYTHONPATH=tree)
  start = time.perf_counter()
  with open(workdir + ".log", "w") as log:
    subprocess.run([sys.executable, "-m", "rlhf_jax.main", *args,
                    f"--workdir={workdir}"], cwd=tree, env=env, check=True,
                   stdout=log, stderr=subprocess.STDOUT)
  return time.perf_counter() - start


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--other", required=True, help="the other tree")
  p.add_argument("--cases", default=",".join(CASES))
  p.add_argument("--workdir", default="/tmp/same_metrics")
  p.add_argument("--out", default="")
  a = p.parse_args()
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  os.makedirs(a.workdir, exist_ok=True)
  rm = os.path.join(a.workdir, "rm")
  if "ppo" in a.cases.split(",") and not os.path.exists(rm):
    _run(here, EIGHT, ["--config=configs/tiny_rm.py:runlocal",
                       "--config.train.steps=2", "--config.eval.every=2"], rm)
  result = {}
  for name in a.cases.split(","):
    xla, args = CASES[name]
    args = [x.format(rm=rm) for x in args]
    dirs, seconds = {}, {}
    for side, tree in (("other", a.other), ("this", here)):
      dirs[side] = os.path.join(a.workdir, f"{name}-{side}")
      seconds[side] = round(_run(tree, xla, args, dirs[side]), 1)
    result[name] = {**compare(rl_records(dirs["other"]),
                              rl_records(dirs["this"])),
                    "wall_s": seconds, "args": args}
    r = result[name]
    print(f"{name:8} {r.get('values', 0):5} values, worst relative "
          f"difference {r.get('worst_rel_diff', float('nan')):.3g}, "
          f"{len(r.get('differ', []))} differ > 1e-6", flush=True)
  if a.out:
    with open(a.out, "w") as f:
      commit = lambda tree: subprocess.run(  # noqa: E731
          ["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True,
          text=True).stdout.strip()
      json.dump({"tool": "tools/same_metrics.py",
                 "command": " ".join(sys.argv), "other": a.other,
                 "commit": commit(here), "other_commit": commit(a.other),
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "cases": result}, f, indent=1)
  print(json.dumps({k: {"values": v.get("values"),
                        "worst_rel_diff": v.get("worst_rel_diff")}
                    for k, v in result.items()}))


if __name__ == "__main__":
  main()
