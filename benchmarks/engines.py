"""The rows engine against the paged engine, before the rows engine goes.

  python -m benchmarks.engines [--quick]
      [--out=benchmarks/results/engines_cpu.json]

One comparison, each case in the same process for both engines ([one-engine]):
  default_1dev, default_8dev: the default job's RL step (configs/tiny_grpo.py,
    64 prompts x 8 samples, 8 + 4 tokens; no SFT: the phases cost the same
    on random weights) on 1 CPU device and on 8 fake ones;
  4x4: 4 prompts x 4 samples of 16-32 + 32 tokens, 8x8: 8 x 8 of 64-128 + 64
    (configs/synthetic_grpo.py:runlocal; random weights over 512 ids rarely
    sample <eos>, so responses run to the cap), on 1 device.
Each builds two jobs from one config that differ only in the engine their
rollout decodes on: "rows" (the engine at 35b40dd with its defaults,
unchanged; swapped into the built job, since jobs decode on the paged
engine only) and "paged" (its defaults: rows x G slots, pages for all of
them at full length). The first
step of each is timed (then again in a process of its own, where no compile
is shared with the other job: `first_step_alone_s`); then the two take
turns, the order alternating, for --steps steps each: `step_s`,
`rollout_s` and the other phases are medians over them.
long_tail: the workload of `benchmarks.paged_long_tail` (32 prompts x G=8,
  lognormal lengths up to 2048, the same KV budget) decoded by the rows
  engine, by the paged engine, and by the plain-jnp static-rows decoder
  (`benchmarks/static_rows.py`, the tests' oracle and, once the rows engine
  is gone, the static baseline): each compiled by an untimed run first,
  then timed runs in turn; all three must give the same tokens.

Every case runs in a child process (`--case`), so the device count is fresh
and one case's compiles do not warm the next. Last stdout line: JSON with
`paged_over_rows_<case>` (the median over turns of rows step seconds /
paged step seconds: > 1 means the paged engine is faster; `rollout_...`
the same for the rollout phase), `first_step_paged_over_rows_<case>`
(paged / rows first-step seconds, each the least of three fresh processes,
the engines taking turns: compiles; on this shared machine one process's
first step varies by 15%), `long_tail_paged_speedup_vs_rows`,
`long_tail_paged_speedup_vs_static_rows`, `static_rows_over_rows_engine`
(oracle seconds / rows engine seconds on the long tail) and each case's
figures.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import long_tail_workload
from benchmarks import report
from benchmarks import timing
from benchmarks.static_rows import StaticRows
from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.paged import PagedEngine
from rlhf_jax.engine.paged_driver import PagedDriver
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import model as model_lib
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.trainers import grpo

_CASE = flags.DEFINE_string("case", None, "Run one case in this process "
                            "(the parent runs each as a child).")
_FIRST_ONLY = flags.DEFINE_string(
    "first_only", None, "With --case: build only this engine's job and time "
    "its first step (a fresh process: no compile shared with the other).")
_QUICK = flags.DEFINE_bool("quick", False, "5 timed steps per engine, one "
                           "timed long-tail run each (~15 minutes).")
_STEPS = flags.DEFINE_integer("steps", 8, "Timed RL steps per engine.")
_SMOKE = flags.DEFINE_bool("smoke", False, "The 4x4 and long-tail cases "
                           "only, tiny sizes, one step, one first-step "
                           "process each: that it runs (tests), not a "
                           "measurement.")

SYNTHETIC = ("configs/synthetic_grpo.py:runlocal,prompt_len={P},"
             "new_tokens={M},samples={G},prompts={N},steps=100")
CASES = {
    "default_1dev": (1, "configs/tiny_grpo.py"),
    "default_8dev": (8, "configs/tiny_grpo.py"),
    "4x4": (1, SYNTHETIC.format(P=32, M=32, G=4, N=4)),
    "8x8": (1, SYNTHETIC.format(P=128, M=64, G=8, N=8)),
    "long_tail": (1, None),
}


def _config(spec: str):
  path, _, arg = report.repo_path(spec).partition(":")
  module = importlib.util.module_from_spec(
      importlib.util.spec_from_file_location("config", path))
  module.__spec__.loader.exec_module(module)
  config = module.get_config(arg or None)
  config.sft.steps = 0
  if _SMOKE.value:
    config.train.prompts_per_step = min(config.train.prompts_per_step, 8)
    config.rollout.num_rows = min(config.rollout.num_rows, 8)
  return config


def _decode_on_rows(job) -> None:
  """The job's rollout decodes on the rows engine, which jobs no longer
  select (`rollout.engine` is gone, [one-engine]): the comparison's
  baseline until the rows engine is deleted."""
  job.rollout.engines = job.rollout.engines.rows_baseline()


def _rl_case(spec: str, engines=("rows", "paged")) -> dict:
  """Both engines' jobs in this process: first steps, then turns (the
  second job's first step may reuse compiles of the first's: the
  comparison of first steps runs each engine alone, `--first_only`)."""
  jobs = {}
  for engine in engines:
    job = grpo.build(_config(spec))
    if engine == "rows":
      _decode_on_rows(job)
    state = job.learner.init_state(job.params)
    ref = jax.tree.map(lambda x: jnp.array(x, copy=True), job.params)
    jax.block_until_ready((state, ref))
    t0 = time.perf_counter()
    state, _ = job.step(1, state, ref)
    jax.block_until_ready(state)
    jobs[engine] = dict(job=job, state=state, ref=ref,
                        first=time.perf_counter() - t0, steps=[])
    print(f"{engine}: first step {jobs[engine]['first']:.1f} s", flush=True)
  if len(engines) == 1:
    return dict(first_step_s=round(jobs[engines[0]]["first"], 3))
  steps = 1 if _SMOKE.value else 5 if _QUICK.value else _STEPS.value
  for i in range(steps):
    order = ("rows", "paged") if i % 2 == 0 else ("paged", "rows")
    for engine in order:
      j = jobs[engine]
      j["state"], metrics = j["job"].step(i + 2, j["state"], j["ref"])
      j["steps"].append({k.split("/")[1]: v for k, v in metrics.items()
                         if k.startswith("perf/") and k.endswith("_s")})
    print(f"step {i + 2}: " + ", ".join(
        f"{e} {jobs[e]['steps'][-1]['step_s']:.3f} s" for e in jobs),
          flush=True)
  out = {}
  for engine, j in jobs.items():
    med = lambda k: statistics.median(s[k] for s in j["steps"])  # noqa: E731
    engines = j["job"].rollout.engines
    out[engine] = dict(first_step_s=round(j["first"], 3),
                       **{k: round(med(k), 4) for k in j["steps"][0]},
                       compiles=dict(engines.whole().trace_counts),
                       per_step=[{k: round(v, 4) for k, v in s.items()}
                                 for s in j["steps"]])
  out["devices"] = jax.device_count()
  return out


def _long_tail_case() -> dict:
  """Rows engine, paged engine and the static-rows oracle on the
  paged_long_tail workload."""

  w = long_tail_workload.workload(
      **(long_tail_workload.SMOKE if _SMOKE.value else {}))
  cfg = w["cfg"]
  mesh = mesh_lib.make_mesh(fsdp=1, devices=jax.devices()[:1])
  layout = mesh_lib.rollout_layout(mesh)
  graphdef, params = model_lib.init_params(cfg, 0, layout)
  params = mesh_lib.to_layout(params, layout)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=w["M"])
  rows_engine = Engine(cfg, graphdef, layout, num_rows=w["static_rows"],
                       samples_per_row=w["G"], prefill_buckets=(w["P"],),
                       sampling=sampling)
  paged = PagedEngine(cfg, graphdef, layout, num_slots=w["paged_slots"],
                      samples_per_group=w["G"], prefill_buckets=(w["P"],),
                      sampling=sampling, page_size=w["page_size"],
                      kv_budget_bytes=w["budget"])
  oracle = StaticRows(cfg, graphdef, params, rows=w["static_rows"],
                      samples_per_row=w["G"], bucket=w["P"],
                      sampling=sampling)
  requests = w["requests"]
  variants = {
      "rows_engine": lambda reqs: {s.key: s for s in
                                   Driver(rows_engine, params).run(reqs)},
      "paged": lambda reqs: {s.key: s for s in
                             PagedDriver(paged, params).run(reqs)},
      "static_rows": oracle.run,
  }
  for name, run in variants.items():  # Compiles (untimed).
    run(requests if name == "paged" else requests[:2])
    print(f"{name}: compiled", flush=True)
  times = {name: [] for name in variants}
  outs = {}
  repeats = 1 if (_QUICK.value or _SMOKE.value) else 3
  for i in range(repeats):
    names = list(variants) if i % 2 == 0 else list(variants)[::-1]
    for name in names:
      t0 = time.perf_counter()
      outs[name] = variants[name](requests)
      times[name].append(time.perf_counter() - t0)
      print(f"{name}: {times[name][-1]:.1f} s", flush=True)
  want = outs["rows_engine"]
  for name in ("paged", "static_rows"):
    same = (outs[name].keys() == want.keys() and
            all(outs[name][k].tokens == want[k].tokens for k in want))
    if not same:
      raise AssertionError(f"{name} sampled other tokens than the rows "
                           "engine")
  med = {name: statistics.median(t) for name, t in times.items()}
  return dict(seconds={k: round(v, 2) for k, v in med.items()},
              tokens=int(np.sum(w["lengths"])), repeats=repeats)


def _child(name: str, first_only: str | None = None) -> dict:
  devices, spec = CASES[name]
  env = dict(os.environ)
  flags_env = env.get("XLA_FLAGS", "")
  flags_env = " ".join(f for f in flags_env.split()
                       if "force_host_platform_device_count" not in f)
  env["XLA_FLAGS"] = (f"{flags_env} --xla_force_host_platform_device_count="
                      f"{devices} {timing.CPU_SCHEDULER_FLAG}").strip()
  cmd = [sys.executable, "-m", "benchmarks.engines", f"--case={name}",
         f"--steps={_STEPS.value}"]
  cmd += ["--quick"] * _QUICK.value + ["--smoke"] * _SMOKE.value
  if first_only:
    cmd.append(f"--first_only={first_only}")
  print(f"== {name}{' first step of ' + first_only if first_only else ''} "
        f"({devices} device(s)){': ' + spec if spec else ''}", flush=True)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True,
                        text=True, check=False)
  for line in proc.stdout.splitlines()[:-1]:
    print("   " + line, flush=True)
  if proc.returncode:
    sys.stderr.write(proc.stderr[-4000:])
    raise SystemExit(f"case {name} failed (exit {proc.returncode})")
  return json.loads(proc.stdout.splitlines()[-1])


def main(argv):
  del argv
  if _CASE.value:
    result = (_long_tail_case() if _CASE.value == "long_tail"
              else _rl_case(CASES[_CASE.value][1], (_FIRST_ONLY.value,))
              if _FIRST_ONLY.value
              else _rl_case(CASES[_CASE.value][1]))
    print(json.dumps(result), flush=True)
    return
  names = ("4x4", "long_tail") if _SMOKE.value else tuple(CASES)
  cases = {name: _child(name) for name in names}
  for name in names:  # Compiles: each engine's first step in its own
    if name != "long_tail":  # process, three times in turn (the fixed
      firsts = {"rows": [], "paged": []}  # work: the least).
      for _ in range(1 if _SMOKE.value else 3):
        for engine in firsts:
          firsts[engine].append(_child(name, engine)["first_step_s"])
      for engine, seconds in firsts.items():
        cases[name][engine]["first_step_alone_s"] = min(seconds)
  summary = {}
  print(f"{'case':<14}{'engine':<8}{'step s':>9}{'rollout s':>11}"
        f"{'first s':>9}  compiles")
  for name, res in cases.items():
    if name == "long_tail":
      continue
    for engine in ("rows", "paged"):
      r = res[engine]
      print(f"{name:<14}{engine:<8}{r['step_s']:>9.3f}{r['rollout_s']:>11.3f}"
            f"{r['first_step_alone_s']:>9.1f}  {r['compiles']}")
    for key, phase in (("", "step_s"), ("rollout_", "rollout_s")):
      # The median of each turn's ratio: the two ran back to back, so a
      # slow stretch of the machine cancels out.
      summary[f"{key}paged_over_rows_{name}"] = round(statistics.median(
          r[phase] / p[phase] for r, p in zip(res["rows"]["per_step"],
                                              res["paged"]["per_step"])), 3)
    summary[f"first_step_paged_over_rows_{name}"] = round(
        res["paged"]["first_step_alone_s"] / res["rows"]["first_step_alone_s"],
        3)
  lt = cases["long_tail"]["seconds"]
  print(f"long tail: rows engine {lt['rows_engine']:.1f} s, paged "
        f"{lt['paged']:.1f} s, static-rows decoder {lt['static_rows']:.1f} s")
  summary.update(
      long_tail_paged_speedup_vs_rows=round(lt["rows_engine"] / lt["paged"],
                                            3),
      long_tail_paged_speedup_vs_static_rows=round(
          lt["static_rows"] / lt["paged"], 3),
      static_rows_over_rows_engine=round(lt["static_rows"] /
                                         lt["rows_engine"], 3),
      cases=cases)
  report.emit(summary)


if __name__ == "__main__":
  app.run(main)
