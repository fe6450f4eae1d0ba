"""The random-token data (`data/random_tokens.py`) and its job
(configs/synthetic_grpo.py): deterministic, resumable prompts of the asked
sizes, the even_tokens reward, and a run that learns it."""

import numpy as np
import pytest

import resume
from rlhf_jax.data import random_tokens
from rlhf_jax.errors import CheckpointError
from rlhf_jax.rewards.verifiable import even_tokens

SPEC = dict(vocab_size=1000, min_len=5, max_len=12, seed=3)


def test_batches_have_the_asked_shapes_and_resume_in_order():
  it = random_tokens.RandomPrompts(6, **SPEC)
  first = [next(it) for _ in range(3)]
  state = it.get_state()
  want = [next(it) for _ in range(2)]
  again = random_tokens.RandomPrompts(6, **SPEC)
  again.set_state(state)
  for a, b in zip(want, [next(again) for _ in range(2)]):
    np.testing.assert_array_equal(a.tokens_NxP, b.tokens_NxP)
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
  batches = first + want
  ids = np.concatenate([b.prompt_ids for b in batches])
  assert len(set(ids.tolist())) == len(ids)  # Unique over batches.
  tok = random_tokens.IdTokenizer(SPEC["vocab_size"])
  for b in batches:
    assert b.tokens_NxP.shape == (6, 12)
    assert np.all((b.lengths_N >= 5) & (b.lengths_N <= 12))
    for row, n, text in zip(b.tokens_NxP, b.lengths_N, b.prompts):
      assert row[0] == random_tokens.BOS_ID and np.all(row[n:] == 0)
      assert np.all((row[1:n] >= 3) & (row[1:n] < 1000))
      assert tok.encode(text, add_bos=True) == row[:n].tolist()
  assert not np.array_equal(first[0].tokens_NxP, first[1].tokens_NxP)
  other = random_tokens.RandomPrompts(3, **SPEC)
  with pytest.raises(CheckpointError, match="batch_size=6"):
    other.set_state(state)


def test_ids_decode_to_text_and_even_tokens_counts_them():
  tok = random_tokens.IdTokenizer(50)
  assert tok.decode([1, 10, 7, 0, 44, 2, 8]) == "10 7 44"
  assert tok.decode([10, 2, 8], stop_at_eos=False) == "10 8"
  assert even_tokens(["", ""], ["10 7 44", ""], [{}, {}]) == [2 / 3, 0.0]
  with pytest.raises(ValueError, match="outside the vocabulary of 50"):
    tok.encode("3 50")


@pytest.mark.slow
def test_runlocal_job_learns_to_sample_even_ids(tmp_path):
  """configs/synthetic_grpo.py:runlocal: responses run to the cap (a random
  model rarely samples <eos>), the reward starts near chance (half the ids
  are even) and GRPO drives it up."""
  from configs import synthetic_grpo
  from rlhf_jax.trainers import rl_job

  c = synthetic_grpo.get_config("runlocal,steps=8")
  rl_job.run(c, str(tmp_path))
  records = resume.rl_records(str(tmp_path))
  assert sorted(records) == list(range(9))  # Step 0: the first eval.
  assert 0.35 < records[1]["rollout/reward_mean"] < 0.65
  assert records[8]["rollout/reward_mean"] > 0.85
  assert records[1]["rollout/response_len_mean"] > 0.8 * 24


@pytest.mark.parametrize("arg", [None, "preset=qwen2.5-7b,prompt_len=2048,"
                                 "new_tokens=4096"])
def test_the_real_shape_configs_pass_the_job_checks(arg):
  """The docstring's commands: sections and their combination check out
  on one device and on 8 (nothing is built)."""
  from configs import synthetic_grpo
  from rlhf_jax.config import checks
  from rlhf_jax.config.sections import RLJob
  from rlhf_jax.models.config import ModelConfig

  c = synthetic_grpo.get_config(arg)
  job = RLJob.from_config(c)
  for devices in (1, 8):
    checks.check_rl_job(job, job="grpo", prompt_len=c.data.max_prompt_len,
                        num_devices=devices)
  assert c.data.vocab_size == ModelConfig.preset(c.model.preset).vocab_size
  assert job.rollout.max_seq_len == (c.data.max_prompt_len
                                     + job.rollout.max_new_tokens)
