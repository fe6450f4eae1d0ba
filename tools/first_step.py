"""The first RL step of a job, this tree against another, in fresh processes.

  python tools/first_step.py --other=/tmp/rows_wt --other_engine=rows \
      [--runs=3] [--cases=default_8dev,8x8] [--out=F]

[one-engine]'s first-step check: each case's job is built, then its first
`rl_step` (rollout, scoring and update, every program compiled on the
way) is timed, in a fresh process per run so that nothing is compiled or
cached before it (the persistent compilation cache is off). The other tree
(a `git worktree` of another commit, e.g. 35b40dd: the rows engine with
its defaults, unchanged) runs the same cases from its own code
(`PYTHONPATH` and working directory set to it), with `rollout.engine` set
to `--other_engine` where that tree has the key (at 35b40dd the synthetic
config's default was the paged engine). Runs alternate between the
trees; each side's figure is the least of its runs (other load on a shared
machine only adds). Per run, the XLA compile seconds of each program
(`jax_log_compiles`) show where a difference comes from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

CASES = {  # name -> (devices, config spec), as `benchmarks.engines` had.
    "default_1dev": (1, "configs/tiny_grpo.py"),
    "default_8dev": (8, "configs/tiny_grpo.py"),
    "4x4": (1, "configs/synthetic_grpo.py:runlocal,prompt_len=32,"
               "new_tokens=32,samples=4,prompts=4,steps=100"),
    "8x8": (1, "configs/synthetic_grpo.py:runlocal,prompt_len=128,"
               "new_tokens=64,samples=8,prompts=8,steps=100"),
}


def child(spec: str, engine: str = "") -> None:
  """Builds the job of `spec` in this tree, times its first step."""
  import collections  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  from rlhf_jax.trainers import rl_job  # pylint: disable=g-import-not-at-top
  from rlhf_jax.trainers.rl_step import rl_step  # pylint: disable=g-import-not-at-top

  compile_s = collections.Counter()

  class Compiles(logging.Handler):
    def emit(self, record):
      m = re.search(r"Finished XLA compilation of jit\((.*?)\) in ([0-9.e-]+)"
                    r" sec", record.getMessage())
      if m:
        compile_s[m.group(1)] += float(m.group(2))

  jax.config.update("jax_log_compiles", True)
  logging.getLogger("jax").addHandler(Compiles())
  path, _, arg = spec.partition(":")
  module = importlib.util.module_from_spec(
      importlib.util.spec_from_file_location("config", path))
  module.__spec__.loader.exec_module(module)
  config = module.get_config(arg or None)
  config.sft.steps = 0
  if engine:
    config.rollout.engine = engine
  job = rl_job.build(config)
  states = job.fresh_states(job.params)  # The policy and a reference copy.
  jax.block_until_ready(states)
  compile_s.clear()
  t0 = time.perf_counter()
  states, _ = rl_step(job, 1, states)
  jax.block_until_ready(states)
  print(json.dumps(dict(first_step_s=round(time.perf_counter() - t0, 3),
                        compile_s={k: round(v, 3)
                                   for k, v in compile_s.most_common()})))


def run(tree: str, devices: int, spec: str, engine: str = "") -> dict:
  env = dict(os.environ, PYTHONPATH=tree, JAX_ENABLE_COMPILATION_CACHE="0",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                        spec, engine], cwd=tree, env=env, capture_output=True,
                       text=True, check=True, timeout=900)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv) -> None:
  if argv[1:2] == ["--child"]:
    return child(*argv[2:])
  opts = dict(a[2:].split("=", 1) for a in argv[1:])
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  other, runs = opts["other"], int(opts.get("runs", 3))
  names = opts.get("cases", ",".join(CASES)).split(",")
  commit = lambda tree: subprocess.run(  # noqa: E731
      ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
      text=True, check=True).stdout.strip()
  cases = {}
  for name in names:
    devices, spec = CASES[name]
    got = {"this": [], "other": []}
    for i in range(runs):
      for side in (("this", "other") if i % 2 == 0 else ("other", "this")):
        got[side].append(
            run(here, devices, spec) if side == "this" else
            run(other, devices, spec, opts.get("other_engine", "")))
        print(f"{name} {side}: {got[side][-1]['first_step_s']} s",
              flush=True)
    least = {s: min(r["first_step_s"] for r in got[s]) for s in got}
    cases[name] = dict(devices=devices, config=spec, runs=got, least=least,
                       this_over_other=round(least["this"] / least["other"],
                                             3))
  print(f"{'case':>14} | {'this s':>7} | {'other s':>7} | ratio")
  for name, c in cases.items():
    print(f"{name:>14} | {c['least']['this']:>7.2f} | "
          f"{c['least']['other']:>7.2f} | {c['this_over_other']:.3f}")
  record = dict(
      what="first RL step (build excluded) in fresh processes, least of "
           f"{runs} runs a side, runs alternating; this tree vs the other",
      this=commit(here), other=commit(other),
      other_engine=opts.get("other_engine", "its default"),
      date=time.strftime("%Y-%m-%d"),
      command="python tools/first_step.py " + " ".join(argv[1:]),
      cases=cases)
  if "out" in opts:
    with open(opts["out"], "w", encoding="utf-8") as f:
      json.dump(record, f, indent=1)
  print(json.dumps({n: c["this_over_other"] for n, c in cases.items()}))


if __name__ == "__main__":
  main(sys.argv)
