"""Configs load, the CLI prints a table and a JSON last line, scale is fast."""

import glob
import json
import math
import os
import subprocess
import sys
import time

import pytest

from rlhf_jax.sched import named_policies as policy_lib
from rlhf_jax.sim import reproduce, runner
from rlhf_jax.sched.cost_model.setting import Setting
from rlhf_jax.sim.workload import Workload, WorkloadSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(
    p for p in glob.glob(os.path.join(ROOT, "configs/sim/*.py"))
    if not p.endswith(("__init__.py", "common.py")))


def _load(path, arg=None):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("cfg", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module, module.get_config(arg)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_docstring_is_run_command_and_runlocal_runs(path):
  module, _ = _load(path)
  rel = os.path.relpath(path, ROOT)
  assert f"python -m rlhf_jax.sim --config={rel}" in module.__doc__
  _, config = _load(path, "runlocal")
  rows, headlines = reproduce.reproduce(config)
  # One table row per (case, policy), in the config's order.
  cases = [dict(c).get("name", "") for c in config.cases]
  policies = [e.partition("=")[0] for e in config.policies.split(",")]
  if "async_rl" in config:  # Async RL runs beside the policies.
    policies.append("async")
  assert [(r["case"], r["policy"]) for r in rows] == [
      (c, p) for c in cases for p in policies]
  for r in rows:
    assert r["step_s"] > 0 and r["cost_per_step"] > 0, r
    assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, r
  # One headline per configured one, each the config's aggregate of its
  # per-case values and the paper's number: recomputed here by hand.
  assert [h["headline"] for h in headlines] == [
      h.name for h in config.headlines]
  for h, want in zip(headlines, config.headlines):
    values = h["per_case"]
    fault = want.metric == "overhead_reduction"
    assert len(values) == (1 if fault else len(cases)), h
    assert all(math.isfinite(v) for v in values), h
    agg = max(values) if want.aggregate == "max" else sum(values) / len(
        values)
    assert h["ours"] == pytest.approx(agg, abs=1e-4), h
    assert h["paper"] == want.paper
    if want.paper is None:
      assert h["rel_error"] is None
    else:
      # Both are rounded to 4 decimals: `ours` by up to 5e-5.
      assert h["rel_error"] == pytest.approx(
          abs(h["ours"] - want.paper) / abs(want.paper),
          abs=5e-5 + 5e-5 / abs(want.paper) + 1e-9), h
    if want.metric in ("throughput_ratio", "speedup", "train_speedup",
                       "gen_score_speedup") and not want.best_of:
      assert all(v > 0 for v in values), h  # A ratio of two rates.


def test_cli_prints_table_then_json(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT)
  out = subprocess.run(
      [sys.executable, "-m", "rlhf_jax.sim",
       "--config=configs/sim/rlboost_qwen3_8b.py:runlocal",
       f"--trace_out={tmp_path}/tl"],
      cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
  lines = out.strip().splitlines()
  assert lines[0].startswith("case")
  last = json.loads(lines[-1])
  assert last["paper"] == 1.66
  assert last["rel_error"] == pytest.approx(
      abs(last["ours"] - 1.66) / 1.66, abs=1e-3)
  trace = json.load(open(f"{tmp_path}/tl.rlboost.json"))
  assert trace["traceEvents"] and {"name", "ph", "ts", "dur"} <= set(
      trace["traceEvents"][0])


def test_a_missing_spot_trace_is_one_line_and_exit_2(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT)
  out = subprocess.run(
      [sys.executable, "-m", "rlhf_jax.sim",
       f"--config=configs/sim/rlboost_qwen3_8b.py:runlocal,trace={tmp_path}"
       "/p3-trace.csv"],
      cwd=ROOT, env=env, capture_output=True, text=True)
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().splitlines() == [
      f"error: no Bamboo spot trace at {tmp_path}/p3-trace.csv (traces/"
      "p3-trace.csv of github.com/uclasystem/bamboo)"]


def test_256_gpu_20_step_simulation_under_a_minute():
  setting = Setting(model="llama-65b", hardware="h800", reserved_devices=256,
                    rollout_tp=8, critic_model="llama-33b",
                    scoring_models=("llama-65b",) * 2 + ("llama-33b",) * 2,
                    train_pp=(8, 4, 8), optimizer_steps=8, micro_batch_size=1,
                    max_response=2048)
  spec = WorkloadSpec(prompts_per_step=512, group_size=1,
                      dataset_prompts=160000, prompt_len=200,
                      median_len=250.0, sigma=1.0, max_len=2048)
  start = time.time()
  results = runner.run(setting, policy_lib.rlhfuse(),
                       Workload(spec), 20)
  assert len(results) == 20
  assert time.time() - start < 60.0


def test_cpu_profile_with_tiny_model_runs(tmp_path, monkeypatch):
  # No calibration file: the CPU profile falls back to its defaults.
  monkeypatch.setenv("RLHF_JAX_CPU_CALIBRATION", str(tmp_path / "none.json"))
  setting = Setting(model="tiny", hardware="cpu", reserved_devices=1,
                    rollout_tp=1, scoring_models=("tiny",), max_response=64,
                    max_slots=16)
  spec = WorkloadSpec(prompts_per_step=4, group_size=4, dataset_prompts=8,
                      prompt_len=16, median_len=20.0, max_len=64)
  results = runner.run(setting, policy_lib.baseline(), Workload(spec), 2)
  assert all(r.step_s > 0 and r.cost > 0 for r in results)
