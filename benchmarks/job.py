"""What a whole job reaches: a config run start to finish in a fresh workdir.

  python -m benchmarks.job --config=configs/tiny_ppo.py [--set=seed=1 ...]
      [--out=benchmarks/results/job_tiny_ppo_cpu.json]

Runs `python -m rlhf_jax.main --config=CONFIG --workdir=TMP` as a child
process (the environment passes through: `XLA_FLAGS` picks the devices and
the arithmetic) and reads the workdir the job wrote. The baseline measured in
the same run is the job's own first evaluation, after its SFT warm-start:
`gain` is the last held-out accuracy minus the first, `eval_reward_gain` the
same for a reward-model score. Reported with them: the wall time of the
whole command (compiles included), every evaluation and when it ended
(`eval_done_s`, from the command's start; `gain_0_20_at_s`: the end of the
first one 0.20 above the first evaluation), the first and last
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

from absl import app
from absl import flags

from benchmarks import report
from benchmarks.job_run import run_job

_CONFIG = flags.DEFINE_string("config", "configs/tiny_grpo.py",
                              "The job's config (with :args).")
_SET = flags.DEFINE_multi_string(
    "set", [], "key=value config overrides (--set=seed=1 passes "
    "--config.seed=1).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Keep the run here (a new "
                               "directory; default: a temporary one).")
_SMOKE = flags.DEFINE_bool("smoke", False, "The config's :runlocal variant "
                           "(tests/test_benchmarks_smoke.py).")


def main(argv):
  del argv
  config = _CONFIG.value
  if _SMOKE.value and ":" not in config:
    config += ":runlocal"
  result, summary_txt = run_job(config, _SET.value, _WORKDIR.value)
  print(f"wall time {result['wall_s']:.1f} s")
  for line in summary_txt:
    print(line)
  report.emit(result, detail=dict(summary_txt=summary_txt))


if __name__ == "__main__":
  app.run(main)
