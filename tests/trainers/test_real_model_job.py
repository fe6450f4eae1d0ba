"""configs/smollm2_grpo.py end to end on `:runlocal` (a tiny random model
whose tokenizer is trained on the sums; no fetched weights needed): the
job's data path, checkpoints and resume.

SIGKILL after the step-2 checkpoint, then the same command again: every
record (each step's metrics, each evaluation) equals an uninterrupted
run's, the oracle.
"""

import os
import subprocess
import sys

import pytest

import resume

STEPS = 4  # :runlocal's; a checkpoint every 2 steps.


def _cmd(workdir):
  return [sys.executable, "-m", "rlhf_jax.main",
          "--config=configs/smollm2_grpo.py:runlocal", f"--workdir={workdir}"]


def _env():
  # One CPU device, as the real run uses.
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")


def _run(workdir):
  out = subprocess.run(_cmd(workdir), cwd=resume.REPO, env=_env(),
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out


@pytest.mark.slow
def test_sigkill_then_rerun_equals_uninterrupted(tmp_path):
  reference = str(tmp_path / "uninterrupted")
  _run(reference)
  workdir = str(tmp_path / "run")
  resume.sigkill_at_checkpoint(_cmd(workdir), workdir, 2, _env())
  assert not os.path.isdir(os.path.join(workdir, "checkpoints", str(STEPS)))
  assert "resumed from step" in _run(workdir).stderr
  resumed, expected = resume.records(workdir), resume.records(reference)
  assert sorted(step for _, step in expected) == list(range(STEPS + 1))
  resume.assert_same_records(resumed, expected)
  # Not vacuous: the run trained and evaluated.
  assert any(expected[("rl", s)]["train/grad_norm"] > 0
             for s in range(1, STEPS + 1))
  assert "eval/rewards/number_only" in expected[("rl", STEPS)]
