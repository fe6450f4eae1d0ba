"""Held-out evaluation (`trainers/evaluation.py`) through the default job:
greedy accuracy and, with `eval.num_samples`, pass@k and maj@k."""

import pytest

import resume
from configs import tiny_grpo, tiny_ppo
from rlhf_jax.config import checks
from rlhf_jax.config.sections import ConfigError, RLJob
from rlhf_jax.trainers import rl_job

KS = (1, 2, 4, 8)


def test_the_default_job_logs_pass_and_maj_at_k(tmp_path):
  """configs/tiny_grpo.py:runlocal with the full job's sampled eval (8
  responses a prompt at temperature 1): every eval step logs pass@k and
  maj@k for k = 1, 2, 4, 8 beside the greedy accuracy; pass@k grows with k,
  and at step 0 (after the warm-start) pass@8 > pass@1: some prompts are
  solved by some of their 8 responses only."""
  full = tiny_grpo.get_config()
  c = resume.override(tiny_grpo.get_config("runlocal"), **{
      "train.steps": 2, "eval.every": 2,
      "eval.num_samples": full.eval.num_samples,
      "eval.temperature": full.eval.temperature})
  assert (c.eval.num_samples, c.eval.temperature) == (8, 1.0)
  rl_job.run(c, str(tmp_path))
  records = resume.rl_records(str(tmp_path))
  evals = {s: r for s, r in records.items() if "eval/accuracy" in r}
  assert sorted(evals) == [0, 2]
  for step, r in evals.items():
    passes = [r[f"eval/pass_at_{k}"] for k in KS]
    assert passes == sorted(passes), (step, passes)
    for k in KS:
      assert 0.0 <= r[f"eval/maj_at_{k}"] <= 1.0
  first = evals[0]
  assert first["eval/pass_at_8"] > first["eval/pass_at_1"] > 0, first
  # summary.txt reports pass@1, pass@8 and maj@8 first -> last.
  summary = (tmp_path / "summary.txt").read_text()
  for key in ("eval/pass_at_1", "eval/pass_at_8", "eval/maj_at_8"):
    assert (f"{key} first (after SFT) -> last" in summary
            and f"{evals[0][key]:.3f} -> {evals[2][key]:.3f}" in summary), (
                key, summary)


def test_sampled_eval_is_refused_for_ppo():
  c = tiny_ppo.get_config("runlocal")
  c.eval.num_samples = 8
  with pytest.raises(ConfigError, match="config.eval.num_samples=8: pass@k"):
    checks.check_rl_job(RLJob.from_config(c), job="ppo", prompt_len=8)
