"""configs/gsm8k_grpo.py end to end on CPU, plus its data-source wiring.

`:runlocal` builds a tiny random Qwen2 checkpoint and a synthetic GSM8K-format
JSONL in the workdir, then runs GRPO steps through `python -m rlhf_jax.main`,
the same path a real run takes.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from configs import gsm8k_grpo
from rlhf_jax.data import synthetic_gsm8k
from rlhf_jax.models.hf_tokenizer import HFTokenizer
from rlhf_jax.config.sections import ConfigError, RLJob
from rlhf_jax.data import sources

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_runlocal_main_runs_grpo_steps(tmp_path):
  workdir = str(tmp_path / "run")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(
      [sys.executable, "-m", "rlhf_jax.main",
       "--config=configs/gsm8k_grpo.py:runlocal", f"--workdir={workdir}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  rl = {r["step"]: r for r in records if r["phase"] == "rl"}
  steps = gsm8k_grpo.get_config("runlocal").train.steps
  assert sorted(rl) == list(range(steps + 1))
  for step in range(1, steps + 1):
    assert math.isfinite(rl[step]["train/loss"]), rl[step]
    assert 0.0 <= rl[step]["rollout/reward_mean"] <= 1.1
    assert "rewards/gsm8k" in rl[step] and "rewards/gsm8k_format" in rl[step]
  assert "eval/accuracy" in rl[0] and "eval/accuracy" in rl[steps]
  assets = os.path.join(workdir, "runlocal_assets")
  with open(os.path.join(assets, "model", "config.json")) as f:
    hf_config = json.load(f)
  assert hf_config["architectures"] == ["Qwen2ForCausalLM"]
  assert hf_config["tie_word_embeddings"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
  """(model dir, train.jsonl) of 40 records, built once for this module."""
  return synthetic_gsm8k.build_assets(
      str(tmp_path_factory.mktemp("assets")), num_records=40)


def _jsonl_config(assets, **data):
  model_dir, data_path = assets
  c = gsm8k_grpo.get_config("runlocal")
  c.data.synthetic = False
  c.model.path, c.data.path = model_dir, data_path
  c.data.update(data)
  return c


def test_jsonl_source_holds_out_eval_prompts(assets):
  c = _jsonl_config(assets)
  source = sources.build(RLJob.from_config(c))
  tok = HFTokenizer.from_dir(c.model.path)
  assert source.stop_ids == tok.stop_ids and source.sft_arrays is None
  eval_ids = [int(i) for b in source.eval_batches for i in b.prompt_ids]
  assert eval_ids == list(range(c.eval.num_prompts))
  batch = next(source.iterator)
  assert batch.tokens_NxP.shape == (c.train.prompts_per_step,
                                    c.data.max_prompt_len)
  assert min(batch.prompt_ids) >= c.eval.num_prompts
  text = tok.decode(batch.tokens_NxP[0, :batch.lengths_N[0]],
                    skip_special_tokens=False, stop_at_eos=False)
  assert text.startswith("<|im_start|>system\n") and text.endswith(
      "<|im_start|>assistant\n")
  assert batch.metadata[0]["answer"].split("#### ")[1].isdigit()


def test_jsonl_source_eval_path(assets, tmp_path):
  eval_path = str(tmp_path / "test.jsonl")
  synthetic_gsm8k.write_jsonl(eval_path, synthetic_gsm8k.records(5, seed=9))
  c = _jsonl_config(assets, eval_path=eval_path)
  source = sources.build(RLJob.from_config(c))
  assert sum(len(b.prompt_ids) for b in source.eval_batches) == 5
  assert len(source.iterator) == 40   # nothing held out of the train file.


def test_sft_needs_sft_data(assets):
  c = _jsonl_config(assets)
  c.sft.steps = 5
  with pytest.raises(ConfigError, match="config.sft.steps=5"):
    sources.build(RLJob.from_config(c))


@pytest.mark.parametrize("key", ["model.path", "data.path"])
def test_missing_paths_name_the_key(key, assets):
  c = gsm8k_grpo.get_config()
  section, name = key.split(".")
  c.model.path, c.data.path = assets
  c[section][name] = ""
  with pytest.raises(ConfigError, match=rf"config\.{key} is empty.*"
                     rf"--config\.{key}="):
    sources.build(RLJob.from_config(c))
  c[section][name] = "/nonexistent/x"
  with pytest.raises(ConfigError, match=rf"config\.{key}='/nonexistent/x' "
                     "does not exist"):
    sources.build(RLJob.from_config(c))
