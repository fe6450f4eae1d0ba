"""The pins `tests/test_doc_figures.py` checks: every figure README.md quotes
and the figures at the head of each docs/results.md section, each tied to
the committed result it comes from (the spec format is in that module's
doc), and the numbers that are not figures (`NOT_FIGURES`), with reasons.
Data only; a new figure in a doc gets its pin here.
"""

from __future__ import annotations

import dataclasses
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


@dataclasses.dataclass(frozen=True)
class Pin:
  doc: str
  quote: str
  file: str
  specs: tuple

  def __repr__(self):
    return f"{self.doc}: {self.quote!r} <- {self.file}"


def P(doc, quote, file, *specs):
  return Pin(doc, quote, file, specs)


def _summary(file: str, under: str | None = None) -> str:
  """A job's printed summary as one text (`under`: the key holding it)."""
  with open(os.path.join(RESULTS, file), encoding="utf-8") as f:
    rec = json.load(f)
  return "\n".join((rec[under] if under else rec)["summary_txt"])


R, D = "README.md", "docs/results.md"
# The third machine's calibration against the earlier records' VM
# (suite_cpu.json, the fast-tier run at dec4130).
CAL = "fast_tier/runs/21/calibration/"
# The fourth machine's (the fast-tier run at 2323705).
CAL4 = "fast_tier/runs/22/calibration/"
MOE_JOB = "job_tiny_grpo_moe_cpu.json"
DJ = "default_job_quiet_cpu.json"
H100, H200 = "gpu_h100.json", "gpu_h200.json"
# The whole GRPO step on the H200 (2026-11-29) and its train MFU.
WS, MFU29 = "session_2026_11_29/whole_step/", "session_2026_11_29/train_mfu/"
# The 2026-11-30 session: SmolLM2 on the H200, the step again, Tunix.
S30 = "session_2026_11_30/"
WS30, VS30 = S30 + "whole_step/", S30 + "ours_vs_tunix/"
MEM, PLT = "memory_cpu.json", "paged_long_tail_cpu.json"
EN, EJ = "engines_cpu.json", "engines_jobs_cpu.json"
LT, AF = "long_tail_cpu.json", "async_rl_full_cpu.json"
PPO = "job_tiny_ppo_cpu.json"
SG = "smollm2_grpo_cpu.json"
HF, RM = "smollm2_hf_check_cpu.json", "real_model_cpu.json"

OBJ = "objectives_cpu.json"

PINS: list[Pin] = [
    # ---- README.md
    P(R, "1.63x the repeated prompt at G=16 / P=2048, at\n>   13 %", H200,
      "decode/pallas.prompt_once_speedup", None, None,
      ("decode/pallas.shared/device_hbm_fraction", 100)),
    P(R, "1.33x on the H100", H100, "decode/pallas.prompt_once_speedup"),
    P(R, "39.6 % MFU", H200, ("train/remat-dots_micro_batches-1/mfu", 100)),
    P(R, "32.8 % on the H100", H100, ("train/mfu", 100)),
    P(R, "in 40.0 s, 59.12 GiB peak; its first step\n> takes 100.0 s with "
      "a cold compilation cache, 58.5 s warm", H200, WS + "cold_cache/step_s",
      (WS + "cold_cache/peak_bytes", 2**-30), WS + "cold_cache/first_step_s",
      WS + "warm_cache/first_step_s"),
    P(R, "takes 24.38 s (11.3 % MFU), slower than the\n> repeated prompt's "
      "19.90 s", H200, WS + "cold_cache/train_s", (MFU29 + "prompt_shared", 100),
      WS + "repeated_prompt/train_s"),
    P(R, "takes 75.10 s a\n> step against our 39.64 s (1.89x; the goal is ≥ 3x), "
      "its train phase\n> 35.01 s against our 24.16 s", H200,
      S30 + "tunix/step_s_median", WS30 + "prompt_shared/step_s",
      VS30 + "step_speedup_prompt_shared",
      S30 + "tunix/tunix_phase_median_s/actor_train_s",
      WS30 + "prompt_shared/train_s"),
    P(R, "the config below: 0.195 -> 0.855 in 82.6 s", H200,
      S30 + "smollm2_grpo/result/eval_accuracy_first",
      S30 + "smollm2_grpo/result/eval_accuracy_last",
      S30 + "smollm2_grpo/result/wall_s"),
    P(R, "On one H200 (jax 0.11.2): 0.195\n-> 0.855 in 30 steps, **82.6 s** of "
      "wall time, a step's median 0.231 s", H200,
      S30 + "smollm2_grpo/result/eval_accuracy_first",
      S30 + "smollm2_grpo/result/eval_accuracy_last",
      None,
      S30 + "smollm2_grpo/result/wall_s",
      S30 + "smollm2_grpo/result/rl_step_median_s"),
    P(R, "against 27.3 s here", SG, "result/rl_step_median_s"),
    P(R, "H200 at Qwen2.5-1.5B shapes: 75.10 s a step, our "
      "`benchmarks.grpo_step` 39.64 s", H200, S30 + "tunix/step_s_median",
      WS30 + "prompt_shared/step_s"),
    P(R, "took 18.7 min\nat 2c4912a", "suite_cpu.json",
      ("runs/17/pytest_s", 1 / 60), None),
    P(R, "20.8 min at 0320b52", "suite_cpu.json", ("runs/9/pytest_s", 1 / 60),
      None),
    P(R, "14.9 min at\nits fastest, at 680e3e9", "suite_cpu.json",
      ("runs/3/pytest_s", 1 / 60), None),
    P(R, "the fast tier 5.7 min at 7392424", "suite_cpu.json",
      ("fast_tier/runs/17/pytest_s", 1 / 60), None),
    P(R, "took 21.9 min for the suite at 78b4de2", "suite_cpu.json",
      ("runs/19/pytest_s", 1 / 60), None),
    P(R, "22.4 min at 2c2eaad", "suite_cpu.json", ("runs/18/pytest_s", 1 / 60),
      None),
    P(R, "7.6 min for the\nfast tier at 9157386", "suite_cpu.json",
      ("fast_tier/runs/20/pytest_s", 1 / 60), None),
    P(R, "8.0 min at 72b6be0", "suite_cpu.json",
      ("fast_tier/runs/18/pytest_s", 1 / 60), None),
    P(R, "took 13.5 min for the fast tier at dec4130", "suite_cpu.json",
      ("fast_tier/runs/21/pytest_s", 1 / 60)),
    P(R, "41.9 min for the suite at 7dfd3d5", "suite_cpu.json",
      ("runs/20/pytest_s", 1 / 60), None),
    P(R, "1.83 to 1.88 times slower than the first\n"
      "(tests/engine/test_paged.py at 970d167: 71.2 s against 38.8 and 37.9 "
      "s)", "suite_cpu.json",
      ("ratio", CAL + "this_vm_s", CAL + "earlier_vm_s/1"),
      ("ratio", CAL + "this_vm_s", CAL + "earlier_vm_s/0"), None,
      CAL + "this_vm_s", CAL + "earlier_vm_s/1", CAL + "earlier_vm_s/0"),
    P(R, "A fourth, 2.05 to 2.09 times slower than the first (79.4 s\n"
      "on that test)", "suite_cpu.json",
      ("ratio", CAL4 + "this_vm_s", CAL4 + "earlier_vm_s/1"),
      ("ratio", CAL4 + "this_vm_s", CAL4 + "earlier_vm_s/0"),
      CAL4 + "this_vm_s"),
    P(R, "14.7 min for the fast tier at 2323705", "suite_cpu.json",
      ("fast_tier/runs/22/pytest_s", 1 / 60), None),
    P(R, "41.4 min\nfor the suite at d8a3128", "suite_cpu.json",
      ("runs/22/pytest_s", 1 / 60)),
    P(R, "**0.195 -> 0.885** in 30 steps, **1354.6 s**", SG,
      "result/eval_accuracy_first", "result/eval_accuracy_last", None,
      "result/wall_s"),
    P(R, "format rate stays\n0.0", SG, "result/eval_number_only/6"),
    P(R, "27.3 s (rollout 6.956, scoring\n4.196, train 16.329)", SG,
      "result/rl_step_median_s", "result/step_median_s/rollout",
      "result/step_median_s/scoring", "result/step_median_s/train"),
    P(R, "24.6 % of the time", SG, ("result/eval_share", 100)),
    P(R, "scores 0.885 and the\nuntrained one 0.195", HF,
      "result/runs/1/accuracy", "result/runs/0/accuracy"),
    P(R, "one carry 0.189 -> 0.867, with two\n0.0 -> 0.455", HF,
      "result/runs/0/accuracy_by_carries/1/0",
      "result/runs/1/accuracy_by_carries/1/0",
      "result/runs/0/accuracy_by_carries/2/0",
      "result/runs/1/accuracy_by_carries/2/0"),
    P(R, "1.81x its tokens/s (143.4 vs 79.1)", RM,
      "result/rollout_vs_transformers",
      "result/rollout/ours/tokens_per_s",
      "result/rollout/transformers/tokens_per_s"),
    P(R, "at 0.331 of this machine's float32 matmul rate (151.1 GFLOP/s), "
      "0.231", RM, "result/train_vs_matmul_peak",
      "result/matmul_gflop_per_s", "result/useful_train_vs_matmul_peak"),
    P(R, "**114.0 s**", "job_tiny_grpo_cpu.json", "result/wall_s"),
    P(R, "`eval.num_samples=0` took 104.3 s",
      "job_tiny_grpo_greedy_eval_cpu.json", None, "result/wall_s"),
    # The job's printed summary, as the README shows it.
    P(R, _summary("job_tiny_grpo_cpu.json", "detail"),
      "job_tiny_grpo_cpu.json", ("text", "detail/summary_txt")),
    P(R, "seed 0\n**+0.230**", DJ, None, "runs/0/gain"),
    P(R, "seed 1 **+0.265**", DJ, None, "runs/1/gain"),
    P(R, "seed 2 **+0.200** (0.570 -> 0.770", DJ, None, "runs/2/gain",
      "runs/2/eval_accuracy_every_50_steps/0",
      "runs/2/eval_accuracy_every_50_steps/6"),
    P(R, "AVX, no FMA) **+0.235**", DJ, "runs/3/gain"),
    P(R, "gains 0.000 (0.450 -> 0.450 in 50 steps)", DJ, "runs/4/gain",
      "runs/4/eval_accuracy_every_50_steps/0",
      "runs/4/eval_accuracy_every_50_steps/1", None),
    P(R, "a decode step took 8.09 ms instead of 9.31 ms and prefill with its "
      "compiles 92.9 s instead of 7.8 s", H200,
      "decode_unrolled_old_launch/pallas.shared/median_step_ms",
      "decode_old_launch/pallas.shared/median_step_ms",
      "decode_unrolled_old_launch/pallas.shared/prefill_s",
      "decode_old_launch/pallas.shared/prefill_s"),
    P(R, "Qwen2.5-7B: 28.89 GiB per device", "memory_cpu.json",
      "result/qwen2.5-7b.train_gib_per_device"),
    P(R, "live pages (4.4x faster", "paged_long_tail_cpu.json",
      "result/long_tail_speedup_vs_static"),
    P(R, "train 28.89 GiB with FSDP 8, bf16, remat; 64× less temporary",
      "memory_cpu.json", "result/qwen2.5-7b.train_gib_per_device", None,
      "result/small.train_temp_ratio"),
    P(R, "bf16 base 19.23 GiB", "memory_cpu.json",
      "result/qwen2.5-7b.train_gib_per_device_lora"),
    P(R, "one 128K-token sequence split over the 8 devices "
      "(`mesh.context=8`) 27.34 GiB, against 116.41 GiB", "memory_cpu.json",
      None, None, None, "result/qwen2.5-7b.train_gib_per_device_128k_cp8",
      "result/qwen2.5-7b.train_gib_per_device_128k_cp1"),
    P(R, "rows engine, since deleted: 4.4x faster, pool / peak live KV 1.15 "
      "(rows engine 9.81); a group's prompt read once: 1.65x",
      "paged_long_tail_cpu.json",
      "result/long_tail_speedup_vs_static", "result/kv_reserved_over_live",
      "result/static_kv_reserved_over_live",
      "result/paged_prefix_speedup_g16_p512"),
    P(R, "Against the static rows at cb50741: 4.37x faster, pool / peak "
      "live KV 1.15 (static rows 9.81", "paged_long_tail_static_rows_cpu.json",
      "result/long_tail_speedup_vs_static", "result/kv_reserved_over_live",
      "result/static_kv_reserved_over_live"),
    P(D, "CPU device, nothing else running) the paged engine is 4.37x faster\n"
      "(13.37 s against 58.38 s), its pool again 1.15x the peak live KV "
      "(static\nrows: 9.81x), the prompt read once 1.52x",
      "paged_long_tail_static_rows_cpu.json",
      "result/long_tail_speedup_vs_static", "result/paged_seconds",
      "result/static_seconds", "result/kv_reserved_over_live",
      "result/static_kv_reserved_over_live",
      "result/paged_prefix_speedup_g16_p512"),
    P(R, "(2.48x before 6a7de68", "paged_long_tail_cpu.json",
      "previous/result/paged_prefix_speedup_g16_p512", None),
    P(R, "is 1.35× continuous batching, the fair baseline (2.01× static "
      "waves; 1.18× RLHFless's", LT, "result/speedup_vs_continuous",
      "result/speedup_vs_static", "result/ours_vs_rlhfless"),
    P(R, "costs 0.93 ms against 10.37 ms on eight", LT,
      ("result/unit_costs/step_s/1", 1000), ("result/unit_costs/step_s/8",
                                             1000)),
    P(R, "within +11 %", LT, ("result/sim_rel_error", 100)),
    P(R, "is 1.05× the one with them after it", LT,
      "result/ppo_step_speedup_vs_unfused"),
    P(R, "measured async at 0.955× the synchronous", AF,
      "result/throughput_vs_sync"),
    P(R, "repeats from 0.84× to 1.214× (`async_rl_full_cpu.json`", AF,
      "result/ratios/0", "result/ratios/2"),
    P(R, "`--quick`: 0.88×, `async_rl_cpu.json`", "async_rl_cpu.json",
      "result/throughput_vs_sync"),
    P(R, "prediction was 0.839× (−12.1 %)", AF,
      "result/sim_throughput_vs_sync", ("result/sim_rel_error", 100)),
    P(R, "gains\n+0.240, and +0.245", DJ, "inheriting_configs/2/gain",
      "inheriting_configs/3/gain"),
    P(R, "H100 (`gpu_h100.json`): 1.33×, 15 % of HBM, 32.8 % MFU, switch "
      "1.12×", H100, "decode/pallas.prompt_once_speedup",
      ("decode/pallas.shared/device_hbm_fraction", 100), ("train/mfu", 100),
      "repartition/round_trip_vs_one_shot"),
    P(R, "H200 (`gpu_h200.json`): 1.63×, 13 % of HBM, 39.6 % MFU", H200,
      "decode/pallas.prompt_once_speedup",
      ("decode/pallas.shared/device_hbm_fraction", 100),
      ("train/remat-dots_micro_batches-1/mfu", 100)),
    P(R, "1.86x faster than the old default", H200,
      ("ratio", "paged_kernel_sweep/shared_prompt/default_s",
       "paged_kernel_new_default/shared_prompt/default_s")),
    P(R, "read 2.34x", H200, "paged_kernel_sweep/shared_prompt/best_vs_default"),
    P(R, "async 0.88× the synchronous job here", "async_rl_cpu.json",
      "result/throughput_vs_sync"),
    P(R, "tokens lost to preemption (0)", "elastic_cpu.json",
      "result/tokens_lost"),
    P(R, "tokens lost 0 (`elastic_lora_cpu.json`)", "elastic_lora_cpu.json",
      "result/tokens_lost"),
    P(R, "throughput ratio (−3.5 % from the live one", "elastic_cpu.json",
      ("result/sim_rel_error", 100)),
    P(R, "adapters (0.0312 of the full weights", "elastic_lora_cpu.json",
      "result/lora/pull_fraction"),
    P(R, "update (0.33× here); the step as a whole is slower, 1.14×",
      "streaming_cpu.json", "result/tail_vs_whole_batch",
      "result/step_vs_whole_batch"),
    P(R, "(peak 1.03 copies vs 1.117; training → rollout 0.28 s vs "
      "`device_put`'s 0.034 s", "repartition_cpu.json",
      "result/peak_bytes_over_one_copy",
      "result/device_put_peak_bytes_over_one_copy", "result/repartition_s",
      "result/device_put_s"),
    P(R, "accuracy 0.025 → 0.775 in 376 s on one CPU device, tool-call rate "
      "0.09 →\n0.97", "job_tiny_tool_cpu.json", "result/eval_accuracy_first",
      "result/eval_accuracy_last", "result/wall_s",
      "result/tool_call_rate_first", "result/tool_call_rate_last"),
    P(R, "it ends at 0.020\n(`job_tiny_tool_notools_cpu.json`)",
      "job_tiny_tool_notools_cpu.json", "result/eval_accuracy_last"),
    P(R, "accuracy 0.005 → 0.77, measured through the agent, at an "
      "evaluation that\nended 215.8 s after the command started; a median "
      "RL step of 7.16 s", "job_tiny_agent_api_cpu.json",
      "result/eval_accuracy_first", "result/eval_accuracy/1",
      "result/gain_0_20_at_s", "result/rl_step_median_s"),
    P(R, "held-out pair accuracy 0.916 (1200 steps, 175 s)",
      "job_tiny_rm_cpu.json", "result/rm_pair_accuracy_last", None,
      "result/wall_s"),
    P(R, "took 97 s:", PPO, "result/wall_s"),
    P(R, _summary(PPO, "detail"), PPO, ("text", "detail/summary_txt")),
    P(R, "rises by 1.13 (1.799 ->\n2.926)", PPO, "result/eval_reward_gain",
      "result/eval_reward_first", "result/eval_reward_last"),
    P(R, "from 2.62\nto 3.54", PPO, "result/reward_mean_by_tenth/0",
      "result/reward_mean_by_tenth/9"),
    P(R, "the last one's is 2.223", PPO, "result/reward_last"),
    P(R, "ends at 2.85 nats", PPO, "result/rollout_kl_last"),
    P(R, "(sampled reward 0.48 -> 0.99", "job_synthetic_runlocal_cpu.json",
      "result/reward_first", "result/reward_last"),
    P(R, "held-out pair accuracy 0.916 in 175 s", "job_tiny_rm_cpu.json",
      "result/rm_pair_accuracy_last", "result/wall_s"),
    P(R, "held-out +0.20 in 409 s on 8 fake CPU devices", MOE_JOB,
      "result/gain", "result/wall_s", None),
    P(R, "held-out pass rate 0.163 -> 1.000 in\n50 RL steps, 428 s on 8 fake "
      "CPU devices", "job_tiny_code_cpu.json", "result/eval_accuracy_first",
      "result/eval_accuracy_last", "result/rl_steps", "result/wall_s", None),
    # ---- docs/results.md, the heads
    P(D, "gains **+0.20** held-out\n(0.26 -> 0.46) in 500 RL steps and "
      "409.3 s, the median RL step 0.65 s", MOE_JOB, "result/gain",
      "result/eval_accuracy_first", "result/eval_accuracy_last",
      "result/rl_steps", "result/wall_s", "result/rl_step_median_s"),
    P(D, "is 17\n(`expert_tokens_min_over_steps`), in 0 of the 500 steps "
      "none\n(`steps_with_an_idle_expert`); the most is 649",
      MOE_JOB, "result/expert_tokens_min_over_steps",
      "result/steps_with_an_idle_expert", "result/rl_steps",
      "result/expert_tokens_max_over_steps"),
    P(D, "ends at 2.13, where 2 is balanced", MOE_JOB,
      "result/moe_balance_loss_last", None),
    P(D, "gains +0.125 (0.26 -> 0.385, after 0.43 at step 450) in 417.5 s",
      "job_tiny_grpo_moe_replay_cpu.json", "result/gain",
      "result/eval_accuracy_first", "result/eval_accuracy_last",
      "result/eval_accuracy/9", None, "result/wall_s"),
    P(D, "step 450 the run without replay stood at 0.40 held-out\n"
      "(`job_tiny_grpo_moe_cpu.json`, its training reward 0.9211 in the first"
      "\ntenth of the steps and 1.1595 in the last)", MOE_JOB, None,
      "result/eval_accuracy/9", "result/reward_mean_by_tenth/0",
      "result/reward_mean_by_tenth/9"),
    P(D, "the run with replay at 0.43\n(`job_tiny_grpo_moe_replay_cpu.json`: "
      "0.9248 and 1.1484)", "job_tiny_grpo_moe_replay_cpu.json",
      "result/eval_accuracy/9", "result/reward_mean_by_tenth/0",
      "result/reward_mean_by_tenth/9"),
    P(D, "moved to 0.46 without replay", MOE_JOB, "result/eval_accuracy_last"),
    P(D, "and to 0.385 with it", "job_tiny_grpo_moe_replay_cpu.json",
      "result/eval_accuracy_last"),
    P(D, "With seed 1 both\nruns gain +0.24 (0.29 -> 0.53;",
      "job_tiny_grpo_moe_seed1_cpu.json", None, "result/gain",
      "result/eval_accuracy_first", "result/eval_accuracy_last"),
    P(D, "With seed 1 both\nruns gain +0.24 (0.29 -> 0.53;",
      "job_tiny_grpo_moe_replay_seed1_cpu.json", None, "result/gain",
      "result/eval_accuracy_first", "result/eval_accuracy_last"),
    P(D, "receiving at least 12\ntokens in every step",
      "job_tiny_grpo_moe_seed1_cpu.json",
      "result/expert_tokens_min_over_steps"),
    P(D, "receiving at least 12\ntokens in every step",
      "job_tiny_grpo_moe_replay_seed1_cpu.json",
      "result/expert_tokens_min_over_steps"),
    P(D, "With seed 2 the job gains +0.465 without replay\n(0.425 -> 0.89;",
      "job_tiny_grpo_moe_seed2_cpu.json", None, "result/gain",
      "result/eval_accuracy_first", "result/eval_accuracy_last"),
    P(D, "and +0.49 with it\n(0.425 -> 0.915;",
      "job_tiny_grpo_moe_replay_seed2_cpu.json", "result/gain",
      "result/eval_accuracy_first", "result/eval_accuracy_last"),
    P(D, "With seed 3,\n+0.355 without replay (0.435 -> 0.79;",
      "job_tiny_grpo_moe_seed3_cpu.json", None, "result/gain",
      "result/eval_accuracy_first", "result/eval_accuracy_last"),
    P(D, "and +0.405 with it (0.435 -> 0.84;",
      "job_tiny_grpo_moe_replay_seed3_cpu.json", "result/gain",
      "result/eval_accuracy_first", "result/eval_accuracy_last"),
    P(D, "0.450 -> 0.680 (+0.230) in 176 s", DJ,
      "runs/0/eval_accuracy_every_50_steps/0",
      "runs/0/eval_accuracy_every_50_steps/6", "runs/0/gain",
      "runs/0/wall_s"),
    P(D, "seeds 1 and 2 +0.265\nand +0.200", DJ, None, None, "runs/1/gain",
      "runs/2/gain"),
    P(D, "SSE4.2 +0.235", DJ, "runs/3/gain"),
    P(D, "learning rate 0 +0.000", DJ, None, "runs/4/gain"),
    P(D, "prompt-once decode 1.33x the repeated\nprompt, at 15 %", H100,
      "decode/pallas.prompt_once_speedup",
      ("decode/pallas.shared/device_hbm_fraction", 100)),
    P(D, "32.8 % MFU with full\nremat", H100, ("train/mfu", 100)),
    P(D, "1.12x the time of one-shot", H100,
      "repartition/round_trip_vs_one_shot"),
    P(D, "1.63x the\nrepeated prompt at 13 %", H200,
      "decode/pallas.prompt_once_speedup",
      ("decode/pallas.shared/device_hbm_fraction", 100)),
    P(D, "(1.34x before it", H200,
      "decode_old_launch/pallas.prompt_once_speedup"),
    P(D, "39.6 % MFU", H200, ("train/remat-dots_micro_batches-1/mfu", 100)),
    P(D, "(36.6 % with full\nremat)", H200,
      ("train/remat-full_micro_batches-1/mfu", 100)),
    P(D, "1.86x faster than the old default", H200,
      ("ratio", "paged_kernel_sweep/shared_prompt/default_s",
       "paged_kernel_new_default/shared_prompt/default_s")),
    P(D, "read 2.34x", H200, "paged_kernel_sweep/shared_prompt/best_vs_default"),
    P(D, "in 40.0 s (repartition 0.12 s,\nrollout 10.35 s, scoring 5.13 s, "
      "train 24.38 s), 59.12 GiB peak", H200,
      *(WS + "cold_cache/" + k for k in ("step_s", "repartition_s",
                                         "rollout_s", "scoring_s", "train_s")),
      (WS + "cold_cache/peak_bytes", 2**-30)),
    P(D, "took 100.0 s after an 88.3 s build with a cold compilation cache, "
      "and\n58.5 s after a 7.4 s build with it warm", H200,
      WS + "cold_cache/first_step_s", WS + "cold_cache/build_s",
      WS + "warm_cache/first_step_s", WS + "warm_cache/build_s"),
    P(D, "(24.38 s against 19.90 s a train\nstep; 11.3 % against 37.0 % MFU), "
      "at 59.12 against 97.10 GiB peak", H200, WS + "cold_cache/train_s",
      WS + "repeated_prompt/train_s", (MFU29 + "prompt_shared", 100),
      (MFU29 + "repeated_prompt", 100), (WS + "cold_cache/peak_bytes", 2**-30),
      (WS + "repeated_prompt/peak_bytes", 2**-30)),
    # The 2026-11-30 session: SmolLM2 trained on the H200, Tunix beside us.
    P(D, "**0.195 -> 0.855** in 30 steps and 82.6 s of wall time, a step's "
      "median\n0.231 s, 118x", H200, S30 + "smollm2_grpo/result/eval_accuracy_first",
      S30 + "smollm2_grpo/result/eval_accuracy_last", None,
      S30 + "smollm2_grpo/result/wall_s",
      S30 + "smollm2_grpo/result/rl_step_median_s",
      S30 + "smollm2_grpo/step_speedup_vs_cpu"),
    P(D, "the 27.3 s of this project's CPU", SG, "result/rl_step_median_s"),
    P(D, "takes **75.10 s** a GRPO step; ours takes 39.64 s\nwith the prompt "
      "stored once (1.89x) and 36.02 s with it repeated\n(2.09x)", H200,
      S30 + "tunix/step_s_median", WS30 + "prompt_shared/step_s",
      VS30 + "step_speedup_prompt_shared", WS30 + "repeated_prompt/step_s",
      VS30 + "step_speedup_repeated_prompt"),
    P(D, "24.16 s against Tunix's 35.01 s (1.45x), where\nour rollout is 3.22x "
      "Tunix's (10.26 s against 33.06 s)", H200, WS30 + "prompt_shared/train_s",
      S30 + "tunix/tunix_phase_median_s/actor_train_s",
      VS30 + "train_speedup_prompt_shared", VS30 + "rollout_speedup",
      WS30 + "prompt_shared/rollout_s",
      S30 + "tunix/tunix_phase_median_s/rollout_s"),
    P(D, "took 83.9 s", H200, "session_2026_11_28_b/whole_step/"
      "call2_timeline_s/build (random init, reference copy; compiles)"),
    P(D, "killed at 315 s inside the first\ntrain step", H200,
      ("text", "session_2026_11_28_b/whole_step/note")),
    P(D, "> 105 s", H200, ("text", "session_2026_11_28_b/whole_step/"
                           "call2_timeline_s/train step executing when "
                           "killed")),
    P(D, "+0.245 (0.450 -> 0.695) in 405 s", DJ, "inheriting_configs/0/gain",
      "inheriting_configs/0/eval_accuracy_every_50_steps/0",
      "inheriting_configs/0/eval_accuracy_every_50_steps/6",
      "inheriting_configs/0/wall_s"),
    P(D, "SSE4.2 +0.255 (0.460 -> 0.715)", DJ, "inheriting_configs/1/gain",
      "inheriting_configs/1/eval_accuracy_every_50_steps/0",
      "inheriting_configs/1/eval_accuracy_every_50_steps/6"),
    P(D, "same seed: +0.230", DJ, "runs/0/gain"),
    # ---- the real model (configs/smollm2_grpo.py)
    P(D, "from 0.195\nto 0.885 (+0.69) in 30 steps and 1354.6 s", SG,
      "result/eval_accuracy_first", "result/eval_accuracy_last",
      "result/gain", None, "result/wall_s"),
    P(D, "0.195, 0.68, 0.89, 0.87, 0.885, 0.785, 0.885", SG,
      *(f"result/eval_accuracy/{i}" for i in range(7))),
    P(D, "stays at 0.0 throughout", SG, "result/eval_number_only/6"),
    P(D, "27.3 s: rollout 6.956 s, scoring 4.196 s, train 16.329 s", SG,
      "result/rl_step_median_s", "result/step_median_s/rollout",
      "result/step_median_s/scoring", "result/step_median_s/train"),
    P(D, "took 24.6 % of the wall time", SG, ("result/eval_share", 100)),
    P(D, "median 0.1 of a step's, max 0.344", SG,
      "result/padding_fraction_median", "result/padding_fraction_max"),
    P(D, "up to 1.298 (step 22)", SG, "result/train_kl/21", None),
    P(D, "0.195 untrained, 0.885\ntrained", HF, "result/runs/0/accuracy",
      "result/runs/1/accuracy"),
    P(D, "0.222 -> 0.949\n(none), 0.189 -> 0.867 (one), 0.0 -> 0.455 (two)", HF,
      "result/runs/0/accuracy_by_carries/0/0",
      "result/runs/1/accuracy_by_carries/0/0",
      "result/runs/0/accuracy_by_carries/1/0",
      "result/runs/1/accuracy_by_carries/1/0",
      "result/runs/0/accuracy_by_carries/2/0",
      "result/runs/1/accuracy_by_carries/2/0"),
    P(D, "1.81x the tokens/s", RM, "result/rollout_vs_transformers"),
    P(D, "at 0.331 of this machine's", RM, "result/train_vs_matmul_peak"),
    P(D, "needs 28.89 GiB per device\n(18.25 temporary)", MEM,
      "result/qwen2.5-7b.train_gib_per_device",
      "result/qwen2.5-7b.train_temp_gib"),
    P(D, "log-prob pass\n6.66 GiB", MEM,
      "result/qwen2.5-7b.logprob_gib_per_device"),
    P(D, "bf16 base 19.23 GiB", MEM,
      "result/qwen2.5-7b.train_gib_per_device_lora"),
    P(D, "train step needs **59.65 GiB per device** (38.32 temporary)", MEM,
      "result/qwen3-30b-a3b.train_gib_per_device",
      "result/qwen3-30b-a3b.train_temp_gib"),
    P(D, "adds 150.71 GiB (210.36 in all)", MEM,
      "result/qwen3-30b-a3b.ragged_dot_dense_cpu_gib",
      "result/qwen3-30b-a3b.train_gib_per_device_cpu_ragged_dot"),
    P(D, "take 9.62 GiB per\ndevice, and a KV pool of 65536 tokens 6.00 GiB",
      MEM, "result/qwen3-30b-a3b.rollout_weights_gib", None,
      "result/qwen3-30b-a3b.rollout_kv_pool_gib"),
    P(D, "53.06 GiB, of which 20.45 arguments (14.37", MEM,
      "result/qwen2.5-7b.decode_gib_per_device",
      "result/qwen2.5-7b.decode_argument_gib",
      "result/qwen2.5-7b.decode_argument_gib_int8"),
    P(D, "needs\n64.28x our temporary", MEM, "result/small.train_temp_ratio"),
    P(D, "one sequence of 128K\ntokens a data-parallel rank needs 116.41 GiB per "
      "device whole on each\ndevice and 27.34 GiB split over the 8 devices "
      "with `mesh.context=8`; at\n32K, 39.69 and 17.61 GiB; at 64K, 65.26 and "
      "20.84 GiB. The temporaries\nfall 4.17x, 5.36x and 6.33x from `context` "
      "1 to 8", MEM, None, "result/qwen2.5-7b.train_gib_per_device_128k_cp1",
      "result/qwen2.5-7b.train_gib_per_device_128k_cp8", None, None, None,
      "result/qwen2.5-7b.train_gib_per_device_32k_cp1",
      "result/qwen2.5-7b.train_gib_per_device_32k_cp8", None,
      "result/qwen2.5-7b.train_gib_per_device_64k_cp1",
      "result/qwen2.5-7b.train_gib_per_device_64k_cp8",
      "result/qwen2.5-7b.long_temp_ratio_32k",
      "result/qwen2.5-7b.long_temp_ratio_64k",
      "result/qwen2.5-7b.long_temp_ratio_128k", None, None),
    P(D, "one CPU device or 8 fake ones, nothing else\nrunning", EN, None),
    P(D, "the default job 1.023 on 1\ndevice and 1.208 on 8; 4 prompts x 4 "
      "samples at 32 + 32 tokens 1.024; 8 x\n8 at 128 + 64 tokens 1.034", EN,
      "result/paged_over_rows_default_1dev", None,
      "result/paged_over_rows_default_8dev", None, None, None, None, None,
      "result/paged_over_rows_4x4", None, None, None, None,
      "result/paged_over_rows_8x8"),
    P(D, "The rollout phase alone: 0.996, 1.498, 1.126,\n1.109", EN,
      "result/rollout_paged_over_rows_default_1dev",
      "result/rollout_paged_over_rows_default_8dev",
      "result/rollout_paged_over_rows_4x4",
      "result/rollout_paged_over_rows_8x8"),
    P(D, "paged\n/ rows: 1.175, 1.309, 1.076, 1.206", EN,
      "result/first_step_paged_over_rows_default_1dev",
      "result/first_step_paged_over_rows_default_8dev",
      "result/first_step_paged_over_rows_4x4",
      "result/first_step_paged_over_rows_8x8"),
    P(D, "the paged engine is 4.883x faster than the\nrows engine and 4.768x "
      "the static-rows decoder", EN, "result/long_tail_paged_speedup_vs_rows",
      "result/long_tail_paged_speedup_vs_static_rows"),
    P(D, "which takes 0.976x the rows engine's time", EN,
      "result/static_rows_over_rows_engine"),
    P(D, "at 8 devices (1.309) and at 8 x 8\n(1.206)", EN, None,
      "result/first_step_paged_over_rows_default_8dev", None, None,
      "result/first_step_paged_over_rows_8x8"),
    P(D, "least of 3 fresh processes a side, runs alternating: paged / rows "
      "1.079\n(default job, 1 device), 1.085 (8 devices), 1.129 (4 x 4), "
      "1.144 (8 x 8),\neach within 1.2x", "first_step_vs_rows_cpu.json",
      None, "cases/default_1dev/this_over_other", None,
      "cases/default_8dev/this_over_other", None,
      "cases/4x4/this_over_other", None, None, "cases/8x8/this_over_other",
      None, None, None),
    P(D, "the default job +0.230, PPO -0.055 (the\nreward model's score "
      "+1.127), LoRA +0.245; tool use +0.750 and async GRPO\n+0.230 (2 "
      "devices)", EJ, "gain/tiny_grpo_paged", "gain/tiny_ppo_paged",
      "eval_reward_gain/tiny_ppo_paged", "gain/tiny_grpo_lora_paged",
      "gain/tiny_tool_paged", "gain/tiny_grpo_async_paged", None),
    P(D, "is 4.37x faster than the rows engine with the same KV\nbytes "
      "(9.83 s against 42.96 s), its pool 1.15x the peak live KV (rows\n"
      "engine: 9.81x)", PLT, "result/long_tail_speedup_vs_static",
      "result/paged_seconds", "result/static_seconds",
      "result/kv_reserved_over_live", "result/static_kv_reserved_over_live"),
    P(D, "decode step 1.65x faster than the prompt repeated for each sample",
      PLT, "result/paged_prefix_speedup_g16_p512"),
    P(D, "engine, G = 16, P = 512, the jnp path): down from 2.48x, a "
      "regression of\n6a7de68", PLT, None, None,
      "previous/result/paged_prefix_speedup_g16_p512", None),
    P(D, "**1.35x continuous batching**", LT, "result/speedup_vs_continuous"),
    P(D, "2.01x static waves; 1.18x RLHFless's", LT,
      "result/speedup_vs_static", "result/ours_vs_rlhfless"),
    P(D, "Decode steps: 86 against continuous batching's 117", LT,
      "result/steps/ours", "result/steps/continuous"),
    P(D, "costs 0.93 ms against 10.37 ms on eight", LT,
      ("result/unit_costs/step_s/1", 1000), ("result/unit_costs/step_s/8",
                                             1000)),
    P(D, "to static: 2.23x\n(+11.0 %)", LT, "result/sim_speedup_vs_static",
      ("result/sim_rel_error", 100)),
    P(D, "fused into the tail: 1.05x", LT,
      "result/ppo_step_speedup_vs_unfused"),
    P(D, "async GRPO gains +0.240 (0.435 -> 0.675), and +0.245\n(0.450 -> "
      "0.695)", DJ, "inheriting_configs/2/gain",
      "inheriting_configs/2/eval_accuracy_every_50_steps/0",
      "inheriting_configs/2/eval_accuracy_every_50_steps/6",
      "inheriting_configs/3/gain",
      "inheriting_configs/3/eval_accuracy_every_50_steps/0",
      "inheriting_configs/3/eval_accuracy_every_50_steps/6"),
    P(D, "the synchronous job on 1\ndevice +0.230", DJ, None, "runs/0/gain"),
    P(D, "async trains 0.955x", AF, "result/throughput_vs_sync"),
    P(D, "(repeats 0.84x to\n1.214x", AF, "result/ratios/0",
      "result/ratios/2"),
    P(D, "`async_rl_cpu.json`: 0.88x", "async_rl_cpu.json",
      "result/throughput_vs_sync"),
    P(D, "prediction was\n0.839x (-12.1 %)", AF,
      "result/sim_throughput_vs_sync", ("result/sim_rel_error", 100)),
    P(D, "0 tokens lost to 2 preemptions,\n8 samples migrated, 144 tokens "
      "re-prefilled", "elastic_cpu.json", "result/tokens_lost",
      "result/preemptions", "result/migrated_samples",
      "result/reprefill_tokens"),
    P(D, "ratio is 1.555x against the live 1.61x (-3.5 %)", "elastic_cpu.json",
      "result/sim_cpu_throughput_vs_trainer_only",
      "result/cpu_throughput_vs_trainer_only", ("result/sim_rel_error", 100)),
    P(D, "0 tokens lost, and a\npull ships 0.0312", "elastic_lora_cpu.json",
      "result/tokens_lost", "result/lora/pull_fraction"),
    P(D, "update is 0.33x the whole-batch step's; the step as a whole is "
      "slower,\n1.14x", "streaming_cpu.json", "result/tail_vs_whole_batch",
      "result/step_vs_whole_batch"),
    P(D, "decode step 1.65x faster", PLT,
      "result/paged_prefix_speedup_g16_p512"),
    P(D, "P = 512; 2.48x\nbefore 6a7de68", PLT, None,
      "previous/result/paged_prefix_speedup_g16_p512", None),
    P(D, "1.71x on\nthe rows engine", "engine_rows_cpu.json",
      "result/prefix_rows_speedup_g16_p512"),
    P(D, "caps it at 1.76x against\na KV-read theory of 8.5x",
      "engine_rows_cpu.json", "result/speedup_bound_g16_p512",
      "result/kv_read_ratio_theory_g16_p512"),
    P(D, "peaks at 1.03 copies of the weights against `device_put`'s\n1.117, "
      "and takes 0.28 s against its 0.034 s", "repartition_cpu.json",
      "result/peak_bytes_over_one_copy",
      "result/device_put_peak_bytes_over_one_copy", "result/repartition_s",
      "result/device_put_s"),
    P(D, "accuracy 0.025 -> 0.775 (+0.750) in 376 s, the\ntool-call rate "
      "0.09 -> 0.97, the sampled reward 0.055 -> 0.801",
      "job_tiny_tool_cpu.json", "result/eval_accuracy_first",
      "result/eval_accuracy_last", "result/gain", "result/wall_s",
      "result/tool_call_rate_first", "result/tool_call_rate_last",
      "result/reward_first", "result/reward_last"),
    P(D, "0.015 ->\n0.020, the call rate falling to 0.01",
      "job_tiny_tool_notools_cpu.json", "result/eval_accuracy_first",
      "result/eval_accuracy_last", "result/tool_call_rate_last"),
    P(D, "pair accuracy 0.916 in 175 s", "job_tiny_rm_cpu.json",
      "result/rm_pair_accuracy_last", "result/wall_s"),
    P(D, "takes 97 s: the reward-model\nscore of greedy held-out answers "
      "1.799 -> 2.926, the sampled reward's\nmean over the first and last "
      "tenth of the run 2.62 -> 3.54, the sequence\nKL to the reference "
      "2.85 at the end, and exact-match accuracy, never\ntrained on, 0.190 "
      "-> 0.135", PPO, "result/wall_s", "result/eval_reward_first",
      "result/eval_reward_last", "result/reward_mean_by_tenth/0",
      "result/reward_mean_by_tenth/9", "result/rollout_kl_last",
      "result/eval_accuracy_first", "result/eval_accuracy_last"),
    P(D, "the rollout 3.41x faster", "prefix_sharing_cpu.json",
      "result/rollout_speedup"),
    P(D, "(prefill 15.66x, decode 1.61x against a KV-read theory of 6x)",
      "prefix_sharing_cpu.json", "result/rollout_prefill_speedup",
      "result/rollout_decode_speedup", "result/theoretical_kv_read_ratio"),
    P(D, "the train step 3.48x faster (token theory 3.33x)",
      "prefix_sharing_cpu.json", "result/train_step_speedup",
      "result/theoretical_train_token_ratio"),
    P(D, "fall 6x", "prefix_sharing_cpu.json", "result/kv_bytes_ratio"),
    P(D, "rollout 2.63x, samples identical", "prefix_sharing_cpu.json",
      "result/common256_rollout_speedup"),
    P(D, "takes\n0.364 s, of which rollout 0.126 s, scoring 0.068 s, training "
      "0.168 s and\nthe layout switches 0.006 s; 5462", "grpo_step_cpu.json",
      "result/step_s", "result/rollout_s", "result/scoring_s",
      "result/train_s", "result/repartition_s", "result/tokens_per_s"),
    P(D, "took 17.96 s", "grpo_step_cpu.json", "result/first_step_s"),
    P(D, "(0.12x:", "repartition_cpu.json", "result/speedup_vs_device_put"),
    P(D, "moves\n0 bytes", "repartition_cpu.json", "result/bytes_moved_back"),
    # ---- docs/results.md: the code task ([algos])
    P(D, "held-out greedy pass rate 0.163 -> 1.000 in 50 RL steps",
      "job_tiny_code_cpu.json", "result/eval_accuracy_first",
      "result/eval_accuracy_last", "result/rl_steps"),
    P(D, "0.047 -> 0.863", "job_tiny_code_cpu.json",
      ("text", "detail/summary_txt")),
    P(D, "427.5 s in all, the median RL\nstep 6.58 s", "job_tiny_code_cpu.json",
      "result/wall_s", "result/rl_step_median_s"),
    # ---- docs/results.md: off-policy objectives ([algos])
    P(D, "synchronous default job gains +0.235, and the same job with bf16 "
      "compute\n+0.220", OBJ, "result/sync_gain_median",
      "result/sync_bf16_gain_median"),
    P(D, "eta = 2 with a bf16 rollout copy gains +0.200\nwith TIS, +0.195 "
      "with IcePop, +0.190 with the geometric sequence mask on\nTIS and "
      "+0.205 with CISPO: -0.035, -0.040, -0.045 and -0.030 against the\n"
      "synchronous job, -0.020, -0.025, -0.030 and -0.015 against its bf16 "
      "twin.", OBJ, None, "result/tis.gain_median",
      "result/icepop.gain_median", "result/seq-mask.gain_median",
      "result/cispo.gain_median", "result/tis.vs_sync",
      "result/icepop.vs_sync", "result/seq-mask.vs_sync",
      "result/cispo.vs_sync", "result/tis.vs_sync_bf16",
      "result/icepop.vs_sync_bf16", "result/seq-mask.vs_sync_bf16",
      "result/cispo.vs_sync_bf16"),
    P(D, "alone at SkyRL's band (0.99, 1.01)\nit masked 0.344 of the "
      "sequences per step and gained -0.015; on TIS at\nthat band it masked "
      "0.340 and gained -0.040; on TIS at (0.9, 1.1) it\nmasked 0.054 and "
      "gained +0.170", "seq_mask_trials_cpu.json", None, None,
      "runs/0/seq_masked_frac_mean", "runs/0/gain",
      "runs/2/seq_masked_frac_mean", "runs/2/gain", None, None,
      "runs/3/seq_masked_frac_mean", "runs/3/gain"),
]

# Figure-like text that is not a measured figure: (regex, why).
NOT_FIGURES = [
    (r"\b(?:Python|python)\s?3\.1[0-9]\b", "a Python version"),
    (r"\bjax[ =]\d+\.\d+\.\d+", "a jax version"),
    (r"\d+\.\d+\.\d+", "a version number"),
    (r"(?i)\b(?:qwen|llama|gemma|smollm)(?: ?\d)?[\w.\-/]*", "a model's name"),
    (r"\bSSE4\.2\b|\bSSE4_2\b", "an instruction set's name"),
    (r"\bApache-2\.0\b", "a license's name"),
    (r"\bcuda1[23]\b|CUDA 1[23]", "a CUDA version"),
    (r"≥ \d+(?:\.\d+)?\s?(?:x|×|%)", "a goal, not a measurement"),
    (r"load-balancing loss at\s0\.01 in the warm-start and 0\.001 in RL",
     "config values (configs/tiny_grpo_moe.py: sft.moe_balance_coef, "
     "rl.moe_balance_coef)"),
    (r"the gain without replay less 0\.03", "[r3]'s target, not a "
     "measurement"),
    (r"synchronous gain - 0\.05", "[algos]'s target, not a measurement"),
    (r"each under 3 minutes", "[honest]'s target for the default job; "
     "every run's wall_s in default_job_quiet_cpu.json is under 180"),
]
