"""[fuse] The RL jobs' passes fused into the long-tail rollout: the step's
numbers equal the unfused step's; where fusion cannot give the trainer's
numbers the job scores after the rollout; a chunk's log-probs in each of its
layouts equal a full-length forward. (The rollout side: test_long_tail.py.)"""

import jax
import numpy as np
import pytest

import fakes
from rlhf_jax.models import model as model_lib
from rlhf_jax.parallel import mesh as mesh_lib

CFG = fakes.TINY_CFG


@pytest.mark.slow
@pytest.mark.parametrize("pack_length", [0, 40])
def test_fused_grpo_step_equals_the_unfused_step(mesh8, pack_length):
  """[fuse] tiny_grpo (grouped layout, or packed rows with shared prompts;
  KL loss, one update a step: no old-log-prob pass, `off_policy.on_policy`)
  with the tail consolidated: the reference pass runs on the freed replicas
  as samples finish, and the step's numbers equal those of the same step
  with the pass after the rollout (the same job without its passes); every
  sample is scored once. (The PPO test in test_ppo_trainer.py runs the
  policy's pass fused.)"""
  del mesh8
  import dataclasses

  from configs import tiny_grpo
  from rlhf_jax.trainers import rl_job

  c = tiny_grpo.get_config("runlocal")
  c.rollout.long_tail.update(enabled=True, consolidate_below=1.0,
                             score_chunk=4)
  c.rollout.num_rows = 16  # 2 rows per replica: 8 prompts fit 4 replicas.
  c.rl.update(num_minibatches=1, pack_length=pack_length)
  fused = rl_job.build(c)
  assert fused.fused is not None
  assert list(fused.fused.names) == ["ref"]  # No old-log-prob pass.
  plain = dataclasses.replace(fused, fused=None)
  prompts = next(fused.iterator)
  _, ours = fakes.first_step(fused, prompts)
  _, theirs = fakes.first_step(plain, prompts)
  assert fused.fused.scored == len(prompts.prompt_ids) * (
      fused.c.rollout.samples_per_row)
  assert ours["rollout/scoring_chunks"] >= fused.fused.scored // 8
  assert ours["rollout/consolidations"] >= 1
  for k in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss",
            "train/grad_norm", "train/kl", "rollout/logprob_gap"):
    np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-7,
                               err_msg=k)


@pytest.mark.parametrize("key,value", [
    ("rollout.long_tail.fusion", False),
    ("lora.rank", 4),                 # A merged rollout copy.
    ("rl.dynamic_sampling", True),    # Scored per refill round.
    ("rollout.quantize", "int8"),     # Old log-probs need the trainer's.
])
def test_fusion_falls_back_to_scoring_after_the_rollout(key, value):
  """[fuse] Where the fused passes are off, would not give the trainer's
  numbers or have no batch to join, the job scores after the rollout (the
  fused test above builds the same config without these: passes on)."""
  from configs import tiny_grpo
  from rlhf_jax.trainers import rl_job

  c = tiny_grpo.get_config("runlocal")
  c.rollout.long_tail.update(enabled=True)
  *path, name = key.split(".")
  node = c
  for part in path:
    node = node[part]
  node[name] = value
  assert rl_job.build(c).fused is None


def test_on_policy_fusion_runs_with_a_quantized_rollout_copy():
  """[fuse] With one update a step no pass reads the rollout copy, so a
  cast or quantized one fuses too: the reference's pass alone."""
  from configs import tiny_grpo
  from rlhf_jax.trainers import rl_job

  c = tiny_grpo.get_config("runlocal")
  c.rollout.long_tail.update(enabled=True)
  c.rollout.quantize = "int8"
  c.rl.num_minibatches = 1
  job = rl_job.build(c)
  assert not job.colocation.rollout_is_master
  assert list(job.fused.names) == ["ref"]


def test_scoring_chunks_run_each_prompt_once_when_that_is_cheaper(
    mesh8, monkeypatch):
  """[fuse] A chunk of long prompts with short responses takes the grouped
  layout (each prompt once for its samples there, partial groups padded
  to a power of two of slots);
  the reference's log-probs it gives, and those of the repeated rows and
  of packed rows, equal a full-length forward of the training batch's
  rows, laid out in the repeated and the grouped batch."""
  from rlhf_jax.parallel.layout import use_layout
  from rlhf_jax.rl import batch as batch_lib
  from rlhf_jax.rl import grouped
  from rlhf_jax.scoring.passes import ScoringPasses

  P, R, Gs = 48, 8, 4
  samples = fakes.random_samples(np.random.default_rng(3), 2, Gs, (40, 23),
                                 range(1, R - 1), 64)
  train = mesh_lib.train_layout(mesh8)
  graphdef, params = model_lib.init_params(CFG, 1, train)
  passes = ScoringPasses(graphdef, prompt_len=P, max_new=R,
                         with_policy=False)
  # Partial groups of 3 and 2 samples: 4 slots, one padded.
  chunk = samples[1:4] + samples[5:7]
  layout = mesh_lib.rollout_layout(mesh8)
  repeated = batch_lib.pack(chunk, P, R)
  with use_layout(train):
    oracle = np.asarray(jax.jit(grouped.token_logprobs_in_layout,
                                static_argnums=0)(graphdef, params,
                                                  repeated.arrays))
  mask = repeated.arrays["loss_mask"]
  # In packed rows (`pack`, the training batch's layout with
  # rl.pack_length): several samples a row, the same log-probs.
  packed_passes = ScoringPasses(graphdef, prompt_len=P, max_new=R,
                                with_policy=False, pack=True)
  packed_passes.begin(ref=params)
  out = jax.device_get(packed_passes.score(chunk, layout))
  packed_passes.end()
  got = packed_passes.assemble(chunk, {
      s.key: {"ref_logp": out["ref_logp"][i]} for i, s in enumerate(chunk)},
                               repeated)["ref_logp"]
  np.testing.assert_allclose(got * mask, oracle * mask, rtol=1e-5, atol=1e-6,
                             err_msg="packed")
  assert passes.runs_grouped(chunk) and not packed_passes.runs_grouped(chunk)
  for grouped_chunk in (True, False):
    monkeypatch.setattr(ScoringPasses, "runs_grouped",
                        lambda self, s, g=grouped_chunk: g)
    passes.begin(ref=params)
    out = jax.device_get(passes.score(chunk, layout))
    passes.end()
    scores = {s.key: {"ref_logp": out["ref_logp"][i]}
              for i, s in enumerate(chunk)}
    got = passes.assemble(chunk, scores, repeated)["ref_logp"]
    np.testing.assert_allclose(got * mask, oracle * mask, rtol=1e-5,
                               atol=1e-6, err_msg=f"grouped={grouped_chunk}")
  whole = samples[:Gs]  # The grouped training batch: its responses at 0.
  packed = batch_lib.pack(whole, P, R, group_size=Gs)
  scores = {s.key: {"ref_logp": np.full(R, i, np.float32)}
            for i, s in enumerate(whole)}
  laid = passes.assemble(whole, scores, packed)["ref_logp"]
  np.testing.assert_array_equal(
      laid, np.arange(Gs)[None, :, None] * packed.arrays["loss_mask"])
