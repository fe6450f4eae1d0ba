"""The GRPO job end to end: sharding parity, kill-and-resume, config errors."""

import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

import resume
from configs import tiny_grpo
from rlhf_jax.config import checks
from rlhf_jax.config.sections import ConfigError, RLJob
from rlhf_jax.trainers import rl_job

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OVERRIDES = {"train.steps": 6, "eval.every": 3}


def _config(num_devices=0, **extra):
  c = resume.override(tiny_grpo.get_config("runlocal"),
                      **{**OVERRIDES, **extra})
  c.mesh.num_devices = num_devices
  return c


def _rl_records(workdir):
  from rlhf_jax.metrics import MetricWriter
  return {r["step"]: {k: v for k, v in r.items()
                      if not k.startswith("perf/") and k != "phase"}
          for r in MetricWriter(workdir, enabled=False).read()
          if r["phase"] == "rl"}


@pytest.fixture(scope="module")
def run8(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("grpo8"))
  rl_job.run(_config(), workdir)
  return workdir


@pytest.mark.slow
def test_eight_devices_match_one_device(run8, tmp_path):
  rl_job.run(_config(num_devices=1), str(tmp_path))
  sharded, single = _rl_records(run8), _rl_records(str(tmp_path))
  assert sorted(sharded) == list(range(7))
  for step in range(1, 7):
    for key in ("train/loss", "train/kl", "train/grad_norm",
                "rollout/reward_mean"):
      a, b = sharded[step][key], single[step][key]
      # fp32 relative 1e-5. The policy loss is a sum of +-A*ratio terms of
      # size ~1 that nearly cancel (loss ~5e-3), so it is compared relative
      # to that term scale: an absolute floor of 1e-6.
      assert abs(a - b) <= 1e-5 * abs(b) + 1e-6, (step, key, a, b)
  # The comparison is not vacuous: updates and rewards are non-zero.
  assert all(sharded[s]["train/grad_norm"] > 1e-3 for s in range(1, 7))
  assert any(sharded[s]["rollout/reward_mean"] > 0 for s in range(1, 7))
  assert os.path.exists(os.path.join(run8, "reward_curve.png"))
  assert os.path.exists(os.path.join(run8, "tensorboard"))
  assert os.path.exists(os.path.join(run8, "timeline.png"))
  with open(os.path.join(run8, "timeline.json")) as f:
    steps = {e["args"]["step"] for e in json.load(f)["traceEvents"]
             if e["ph"] == "X"}
  assert steps == set(range(7))  # Step 0 is the evaluation after SFT.


@pytest.mark.slow
def test_sigkill_then_rerun_gives_the_same_metrics(run8, tmp_path):
  workdir = str(tmp_path / "run")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "rlhf_jax.main",
         "--config=configs/tiny_grpo.py:runlocal", f"--workdir={workdir}",
         "--config.train.steps=6", "--config.eval.every=3"]
  resume.sigkill_at_checkpoint(cmd, workdir, 2, env)
  assert not os.path.isdir(os.path.join(workdir, "checkpoints", "6"))
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resumed from step" in out.stderr
  # What a person sees: progress lines, and little else (no Orbax INFO).
  other = [l for l in out.stderr.splitlines()
           if not re.search(r"\] (sft|rl) \d+/\d+ \[", l)]
  assert len(other) < 20, "\n".join(other)
  resumed, reference = _rl_records(workdir), _rl_records(run8)
  assert sorted(resumed) == list(range(7))
  for step in range(3, 7):
    assert resumed[step] == pytest.approx(reference[step], rel=1e-6), step


@pytest.mark.slow
def test_sigterm_in_the_warm_start_then_rerun_equals_uninterrupted(
    run8, tmp_path):
  """SIGTERM during the SFT warm-start saves it (checkpoints_sft/) and
  stops; the rerun resumes the SFT and writes run8's metrics."""
  workdir = str(tmp_path / "run")
  config = _config()
  with resume.SigtermWhen(lambda: resume.has_record(workdir, "sft", 10)
                          ) as sigterm:
    assert rl_job.run(config, workdir) is None  # Stopped in the SFT.
  assert sigterm.sent
  saved = os.listdir(os.path.join(workdir, "checkpoints_sft"))
  assert saved and all(10 <= int(s) < config.sft.steps for s in saved)
  assert not os.listdir(os.path.join(workdir, "checkpoints"))
  rl_job.run(config, workdir)
  resume.assert_same_records(resume.records(workdir), resume.records(run8))
  assert not os.path.exists(os.path.join(workdir, "checkpoints_sft"))


@pytest.mark.slow
def test_damaged_latest_checkpoint_is_set_aside_and_the_run_resumes(
    run8, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(run8, workdir)
  latest = os.path.join(workdir, "checkpoints", "6")
  for path in glob.glob(os.path.join(latest, "**"), recursive=True):
    if os.path.isfile(path):  # Truncated, as by a full disk.
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
  step4 = resume.tree_digest(os.path.join(workdir, "checkpoints", "4"))
  rl_job.run(_config(), workdir)
  aside = glob.glob(os.path.join(workdir, "checkpoints.damaged", "6-*"))
  assert len(aside) == 1  # Kept for a post-mortem, not deleted.
  assert resume.tree_digest(os.path.join(workdir, "checkpoints", "4")) == (
      step4)
  # Steps 5 and 6 rerun from step 4 give the uninterrupted numbers.
  resume.assert_same_records(resume.records(workdir), resume.records(run8))


@pytest.mark.slow
def test_wrong_shape_restore_is_one_line_and_keeps_the_workdir(run8,
                                                               tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(run8, workdir)
  before = resume.tree_digest(workdir)
  out = resume.run_main(["--config=configs/tiny_grpo.py:runlocal",
                         "--config.model.overrides.mlp_dim=256",
                         f"--workdir={workdir}"])
  assert out.returncode == 2, out.stderr[-3000:]
  lines = out.stderr.strip().splitlines()
  assert lines[-1].startswith(
      f"error: checkpoint {workdir}/checkpoints/6 does not match this "
      "config's state (wrong model shape or different job?)"), lines[-1]
  assert "Traceback" not in out.stderr and "Event loop" not in out.stderr
  assert len(lines) < 5, out.stderr
  # Checkpoints, config.json and metrics as they were (TensorBoard may
  # have opened a new, empty events file).
  kept = lambda d: {k: v for k, v in d.items()
                    if not k.startswith("tensorboard")}
  assert kept(resume.tree_digest(workdir)) == kept(before)


@pytest.mark.slow
def test_dynamic_sampling_and_overlong_shaping_run(tmp_path):
  """DAPO's data side in the live loop, on 8 devices: the batch keeps its
  static shape whatever the refills, and the overlong penalty reaches the
  reward (responses of the 4-token budget end in its 2-token ramp)."""
  config = _config(**{"train.steps": 2, "eval.every": 2,
                      "rl.dynamic_sampling": True,
                      "rl.dynamic_max_rounds": 2, "rl.overlong_buffer": 2})
  rl_job.run(config, str(tmp_path))
  records = _rl_records(str(tmp_path))
  for step in (1, 2):
    r = records[step]
    assert 1 <= r["rollout/sampling_rounds"] <= 2
    assert 0 < r["rollout/informative_groups"] <= 8
    assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
    # 2- and 3-digit answers + <eos> are 3-4 tokens, past the 2-token mark.
    assert r["rewards/overlong_penalty"] < 0


@pytest.mark.parametrize("key,value,message", [
    ("rl.dynamic_max_rounds", 0, "rl.dynamic_max_rounds=0: must be a positive"),
    ("rl.overlong_buffer", 9, "config.rl.overlong_buffer"),
    ("rl.advantage", "gae", "config.rl.advantage='gae' needs a critic"),
    ("rl.advantage", "best", "config.rl.advantage='best': unknown"),
    ("rl.aggregation", "mean", "config.rl.aggregation"),
    ("rl.kl_estimator", "k9", "config.rl.kl_estimator"),
    ("rl.rewards", ("nope",), "config.rl.rewards"),
    ("rollout.samples_per_row", 1, "group estimator"),
    ("train.prompts_per_step", 3, "data shards"),
    ("rl.num_minibatches", 5, "not divisible by config.rl.num_minibatches"),
    ("rollout.prefill_buckets", (4,), "prompts need 7 tokens"),
    ("rollout.max_seq_len", 10, "config.rollout.max_seq_len=10: the largest"),
    ("rollout.num_rows", 7, "rollout replicas"),
    ("rl.kl_coef", -1.0, "kl_coef"),
    ("train.steps", 0, "config.train.steps=0: must be a positive int"),
    ("rl.pack_length", 10, "config.rl.pack_length=10 is shorter than one "
     "sequence"),
    ("rl.pack_length", -1, "pack_length=-1: must be an int >= 0"),
    ("rollout.engine", "rows", "config.rollout.engine is not a known key"),
    ("rollout.kv_pages", -1, "config.rollout.kv_pages=-1"),
])
def test_config_errors(key, value, message):
  c = _config(**{key: value})
  with pytest.raises(ConfigError, match=message):
    checks.check_rl_job(RLJob.from_config(c), job="grpo", prompt_len=7,
                        num_devices=8)


def test_override_with_wrong_type_fails():
  c = _config()
  with pytest.raises(TypeError):
    c.rl.kl_coef = "big"
