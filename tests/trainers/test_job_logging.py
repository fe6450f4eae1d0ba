"""What the default job logs at its eval steps and where: greedy accuracy,
pass@k and maj@k (`trainers/evaluation.py`), in metrics.jsonl,
summary.txt and an offline W&B run (`metrics.WandbRun`) read back with
the wandb package's own record schema."""

import glob
import json
import struct
import sys

import pytest

import resume
from configs import tiny_grpo, tiny_ppo
from rlhf_jax.config import checks
from rlhf_jax.config.sections import ConfigError, RLJob
from rlhf_jax.metrics import MetricWriter
from rlhf_jax.trainers import rl_job

KS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
  """configs/tiny_grpo.py:runlocal, 2 RL steps, with the full job's
  sampled eval (8 responses a prompt at temperature 1) and W&B offline."""
  pytest.importorskip("wandb")
  workdir = tmp_path_factory.mktemp("logged")
  full = tiny_grpo.get_config()
  c = resume.override(tiny_grpo.get_config("runlocal"), **{
      "train.steps": 2, "eval.every": 2,
      "eval.num_samples": full.eval.num_samples,
      "eval.temperature": full.eval.temperature,
      "logging.wandb": "offline"})
  assert (c.eval.num_samples, c.eval.temperature) == (8, 1.0)
  rl_job.run(c, str(workdir))
  return workdir


# A whole job (the slow tier's kind, tests/conftest.py), ~20 s alone.
@pytest.mark.slow
def test_the_default_job_logs_pass_and_maj_at_k(logged_run):
  """Every eval step logs pass@k and maj@k for k = 1, 2, 4, 8 beside the
  greedy accuracy; pass@k grows with k, and at step 0 (after the
  warm-start) pass@8 > pass@1: some prompts are solved by some of their 8
  responses only. summary.txt reports pass@1, pass@8 and maj@8."""
  records = resume.rl_records(str(logged_run))
  evals = {s: r for s, r in records.items() if "eval/accuracy" in r}
  assert sorted(evals) == [0, 2]
  for step, r in evals.items():
    passes = [r[f"eval/pass_at_{k}"] for k in KS]
    assert passes == sorted(passes), (step, passes)
    for k in KS:
      assert 0.0 <= r[f"eval/maj_at_{k}"] <= 1.0
  first = evals[0]
  assert first["eval/pass_at_8"] > first["eval/pass_at_1"] > 0, first
  summary = (logged_run / "summary.txt").read_text()
  for key in ("eval/pass_at_1", "eval/pass_at_8", "eval/maj_at_8"):
    assert (f"{key} first (after SFT) -> last" in summary
            and f"{evals[0][key]:.3f} -> {evals[2][key]:.3f}" in summary), (
                key, summary)


def wandb_records(path: str):
  """The records of a .wandb file, decoded with wandb's protobuf schema:
  the file is a LevelDB-style log (a 7-byte header, 32 KiB blocks,
  records framed as crc32c, length, type: full, first, middle, last)."""
  from wandb.proto import wandb_internal_pb2
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B", data[:8]
  block, pos, out, pending = 32768, 7, [], b""
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:  # The block's tail is padding.
      pos += left
      continue
    _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
    chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
    if kind in (1, 2):
      pending = chunk
    else:
      pending += chunk
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      out.append(record)
  return out


@pytest.mark.slow
def test_an_offline_wandb_run_holds_the_metrics_jsonl_values(logged_run):
  """`--config.logging.wandb=offline`: a W&B run under <workdir>/wandb
  whose history is metrics.jsonl, record for record and value for value
  (and the job's step as "<phase>/step"), with the config once."""
  runs = glob.glob(str(logged_run / "wandb" / "wandb" / "offline-run-*" /
                       "run-*.wandb"))
  assert len(runs) == 1, runs
  records = wandb_records(runs[0])
  history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json)
              for i in r.history.item} for r in records
             if r.WhichOneof("record_type") == "history"]
  jsonl = MetricWriter(str(logged_run), enabled=False).read()
  assert len(history) == len(jsonl) == 5  # 2 SFT logs, 3 RL records.
  for logged, written in zip(history, jsonl):
    phase, step = written.pop("phase"), written.pop("step")
    assert logged.pop(f"{phase}/step") == step
    assert {k: v for k, v in logged.items() if not k.startswith("_")} == (
        written)
  run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
  config = {u.key: json.loads(u.value_json) for u in run.config.update}
  assert config["eval"]["num_samples"] == 8, config["eval"]
  assert config["logging"]["wandb"] == "offline"


def test_wandb_offline_without_wandb_is_one_line(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails.
  with pytest.raises(ConfigError, match=r"config.logging.wandb='offline' "
                     r"needs the wandb package: pip install -e '.\[wandb\]'"):
    MetricWriter(str(tmp_path), wandb=({}, "p", "n"))


def test_sampled_eval_is_refused_for_ppo():
  c = tiny_ppo.get_config("runlocal")
  c.eval.num_samples = 8
  with pytest.raises(ConfigError, match="config.eval.num_samples=8: pass@k"):
    checks.check_rl_job(RLJob.from_config(c), job="ppo", prompt_len=8)
