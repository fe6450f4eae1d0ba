"""Every module in benchmarks/ imports, and every runnable one runs.

Each runnable benchmark runs as `python -m benchmarks.<name>` in its
cheapest mode: `--smoke` (the same code path at the smallest sizes, steps
and repeats; its numbers mean nothing) or `--quick` where that is already
fast. The test reads the last stdout line as JSON and checks the keys the
module's docstring names, and that `--out` wrote the same result with its
commit, date, machine, load average and command. The helpers (`HELPERS`) have no `main`; each is
covered by the runs that import it:
  timing         every benchmark but the engine-only ones (`smoke_defaults`,
                 `fake_cpu_devices`, `median_time`, `count_compiles`);
  report         every benchmark (`emit`: the last line and `--out`);
  long_tail_workload  paged_long_tail (its long-tail trace);
  static_rows    paged_long_tail (its static baseline; tokens checked)
                 and the engine tests (their oracle, tests/engine/test_paged.py);
  cpu_allocator  repartition re-executes itself through it
                 (`retained_allocator` must come back true);
  long_tail_ppo  long_tail's PPO step (`--ppo`, on by default: the
                 `ppo_*` keys);
  job_run        job and objectives (a job run start to finish).
The modules in `EXTERNAL` drive another framework that is not a dependency
(the GPU runs carry its wheels): they import without it, and their smoke
run is skipped where it is not installed.

The runs inherit this process's environment (tests/conftest.py: 8 fake CPU
devices, XLA:CPU's loop emitter, the backend optimizations off, the run's
compilation cache), in a temporary working directory that must stay empty:
a benchmark writes nothing of its own (no benchmarks/results/, no files in
the repo). The runs that take more than ~12 s are `slow`; the
import check is fast and catches a module that no longer imports (a
renamed import, a flag defined twice).
"""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = ("cpu_allocator", "job_run", "long_tail_ppo", "long_tail_workload",
           "report", "static_rows", "timing")
# name -> the package it drives (importable name).
EXTERNAL = {"tunix_grpo": "tunix"}


def _case(args, keys, timeout_s, slow):
  marks = [pytest.mark.slow] if slow else []
  return dict(args=args, keys=keys, timeout_s=timeout_s, marks=marks)


# name -> the flags of its cheapest run, the JSON keys its docstring names,
# a timeout (~5x its duration run alone on the shared 2-core machine, at
# least 120 s: `pytest -n 2` runs two at a time; 2026-11-28, one after
# another: 6 s paged_kernel to 46 s async_rl and long_tail, 304 s in all)
# and its tier.
BENCHMARKS = {
    "async_rl": _case(
        ["--smoke"], ("throughput_vs_sync", "sim_throughput_vs_sync",
                      "sim_rel_error", "staleness_mean", "stale_dropped",
                      "off_policy_samples_fraction"), 240, slow=True),
    "common_prefix": _case(
        ["--smoke"], ("rollout_speedup_common256", "prefill_speedup_common256",
                      "decode_step_speedup_common256",
                      "rollout_speedup_from_phases", "prefill_tokens_ratio",
                      "kv_bytes_ratio", "kv_read_ratio_theory",
                      "tokens_identical_fraction"), 120, slow=False),
    "cpu_dispatch": _case(
        ["--quick"], ("launch_fraction", "thread_vs_inline", "wall_s",
                      "decode_loop_s"), 120, slow=False),
    "elastic": _case(
        ["--smoke"], ("tokens_lost", "reprefill_tokens", "pull_latency_s",
                      "cpu_throughput_vs_trainer_only", "sim_rel_error"), 120,
        slow=True),
    "engine": _case(
        ["--smoke"], ("decode_tok_s", "prompt_once_speedup_g16_p512"), 120,
        slow=True),
    "gpu": _case(
        ["--smoke"], ("prompt_once_decode_speedup", "decode_hbm_fraction",
                      "train_mfu", "repartition_vs_one_shot", "decode",
                      "train", "repartition"), 120, slow=True),
    "grpo_step": _case(
        ["--smoke", f"--config={ROOT}/configs/tiny_grpo.py"],
        ("steps_per_s", "tokens_per_s", "first_step_s", "step_s",
         "repartition_s", "rollout_s", "scoring_s", "train_s"), 120,
        slow=True),
    "hf_eval": _case(
        ["--smoke"], ("accuracy", "runs"), 120, slow=True),
    "job": _case(
        ["--smoke", f"--config={ROOT}/configs/tiny_rm.py"],
        ("config", "wall_s", "rm_pair_accuracy_last"), 120, slow=True),
    "long_tail": _case(
        ["--smoke"], ("speedup_vs_continuous", "speedup_vs_static",
                      "idle_fraction_static",
                      "idle_fraction_ours", "sim_speedup_vs_static",
                      "live_speedup_vs_static", "sim_rel_error",
                      "ppo_step_speedup_vs_unfused", "ppo_sim_rel_error"),
        240, slow=True),
    "memory": _case(
        # The keys carry the preset's name: --smoke's is `tiny`.
        ["--smoke"], ("tiny.train_gib_per_device",
                      "tiny.decode_gib_per_device", "tiny.compile_s",
                      "tiny.move_gib_per_device", "small.train_temp_ratio"),
        180, slow=True),
    "objectives": _case(
        # Two of the variants (each run is a whole job: ~35 s).
        ["--smoke", "--only=cispo"], ("sync_gain_median", "cispo.gain_median",
                                      "cispo.vs_sync", "runs"), 300,
        slow=True),
    "paged_kernel": _case(
        ["--smoke"], tuple(f"{part}.{k}" for part in (
            "shared_prompt", "repeated_prompt", "own")
                           for k in ("best_vs_default", "default_us",
                                     "best_us")), 120, slow=False),
    "paged_long_tail": _case(
        ["--smoke"], ("long_tail_speedup_vs_static",
                      "paged_prefix_speedup_g16_p512", "kv_reserved_over_live",
                      "static_kv_reserved_over_live", "paged_seconds",
                      "static_seconds", "preemptions"), 120, slow=True),
    "prefix_sharing": _case(
        ["--smoke"], ("rollout_speedup", "theoretical_kv_read_ratio",
                      "train_step_speedup", "kv_bytes_ratio"), 120,
        slow=True),
    "real_model": _case(
        ["--smoke"], ("rollout_vs_transformers", "train_vs_matmul_peak",
                      "useful_train_vs_matmul_peak", "matmul_gflop_per_s"),
        240, slow=True),
    "repartition": _case(
        ["--smoke"], ("repartition_s", "device_put_s", "speedup_vs_device_put",
                      "peak_bytes_over_one_copy", "retained_allocator"), 120,
        slow=False),
    "streaming": _case(
        ["--smoke"], ("tail_vs_whole_batch", "step_vs_whole_batch",
                      "streamed_groups_fraction", "loss_rel_diff"), 150,
        slow=True),
    "tunix_grpo": _case(
        ["--smoke"], ("tunix_version", "step_s_median", "first_step_s",
                      "peak_bytes"), 240, slow=True),
}


def test_every_module_is_covered():
  """A new benchmarks/*.py needs a row in BENCHMARKS (or HELPERS)."""
  found = {os.path.basename(p)[:-3]
           for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))}
  assert found - {"__init__"} == set(BENCHMARKS) | set(HELPERS)
  assert set(EXTERNAL) <= set(BENCHMARKS)


def test_every_module_imports():
  """All modules in one process: each defines its absl flags at import, and
  several share names (--quick, --smoke), so each module's flags are
  removed again before the next import."""
  code = (
      "import importlib\n"
      "from absl import flags\n"
      f"for name in {sorted(set(BENCHMARKS) | set(HELPERS))!r}:\n"
      "  before = set(flags.FLAGS)\n"
      "  importlib.import_module('benchmarks.' + name)\n"
      "  for flag in set(flags.FLAGS) - before:\n"
      "    delattr(flags.FLAGS, flag)\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=c["marks"], id=name)
    for name, c in BENCHMARKS.items()])
def test_smoke_run(name, tmp_path):
  case = BENCHMARKS[name]
  if name in EXTERNAL and importlib.util.find_spec(EXTERNAL[name]) is None:
    pytest.skip(f"{EXTERNAL[name]} is not installed (not a dependency)")
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  env = dict(
      os.environ, TMPDIR=str(tmp_path),
      # The simulator's CPU profile is a path relative to the repo root;
      # the run's working directory is not the repo.
      RLHF_JAX_CPU_CALIBRATION=os.path.join(
          ROOT, "benchmarks", "results", "engine_costs_cpu.json"))
  record_path = tmp_path / "result.json"
  try:
    out = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", *case["args"],
         f"--out={record_path}"],
        cwd=cwd, env=env, capture_output=True, text=True,
        timeout=case["timeout_s"])
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"benchmarks.{name} ran past {case['timeout_s']} s; stderr "
                f"tail:\n{(e.stderr or b'')[-3000:]!r}")
  assert out.returncode == 0, out.stderr[-5000:]
  lines = out.stdout.strip().splitlines()
  assert len(lines) > 1, out.stdout  # The table, then the JSON.
  result = json.loads(lines[-1])
  missing = [k for k in case["keys"] if k not in result]
  assert not missing, (missing, sorted(result))
  with open(record_path, encoding="utf-8") as f:
    record = json.load(f)
  assert record["result"] == result
  assert record["benchmark"] == f"benchmarks.{name}"
  assert record["command"].startswith(f"python -m benchmarks.{name} ")
  assert f"--out={record_path}" in record["command"]
  assert len(record["commit"]) == 40 and record["date"].endswith("Z")
  assert record["machine"]["cores"] >= 1
  assert len(record["load_avg_1_5_15_start"]) == 3
  if name == "repartition":  # cpu_allocator's re-exec took effect.
    assert result["retained_allocator"] is True
  assert not list(cwd.iterdir()), "the benchmark wrote into its cwd"
