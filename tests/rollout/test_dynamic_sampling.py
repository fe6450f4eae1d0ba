"""DAPO dynamic sampling in the loop: static shapes, refills, no constant group."""

import numpy as np

from rlhf_jax.samples import PromptBatch
from rlhf_jax.samples import Sample
from rlhf_jax.rollout import dynamic_sampling
from rlhf_jax.rollout.base import Sampled

G = 2


def _batch(ids):
  n = len(ids)
  return PromptBatch(prompt_ids=np.asarray(ids, np.int32),
                     tokens_NxP=np.ones((n, 3), np.int32),
                     lengths_N=np.full(n, 3, np.int32),
                     prompts=[str(i) for i in ids], metadata=[{}] * n)


def _round_fn(rewards_by_prompt, calls):
  """Samples whose reward is a fixed function of (prompt id, sample idx)."""
  def run(prompts):
    calls.append(prompts.prompt_ids.tolist())
    samples, rewards = [], []
    for pid in prompts.prompt_ids.tolist():
      for g in range(G):
        samples.append(Sample(pid, g, np.ones(3, np.int32), [5], [0.0],
                              [0.0], "stop", 0))
        rewards.append(rewards_by_prompt[pid][g])
    return Sampled(samples, np.asarray(rewards), np.ones(len(samples), bool),
                   {"rewards/x": float(np.mean(rewards))})
  return run


def test_refills_until_full_and_never_keeps_a_constant_group():
  # Prompts 0..11, 3 per batch; constant groups: 0, 1, 3, 5, 6.
  table = {p: (0.0, 0.0) if p in (0, 1, 3, 5, 6) else (0.0, 1.0)
           for p in range(12)}
  stream = iter([_batch([3, 4, 5]), _batch([6, 7, 8]), _batch([9, 10, 11])])
  calls = []
  got = dynamic_sampling.collect(_batch([0, 1, 2]), stream,
                                 _round_fn(table, calls), group_size=G,
                                 max_rounds=5)
  assert calls == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # Stops once full.
  assert len(got.samples) == 3 * G and got.valid.all()
  kept = [s.prompt_id for s in got.samples]
  assert kept == [2, 2, 4, 4, 7, 7]  # Stream order, whole groups.
  assert got.rewards.tolist() == [0.0, 1.0] * 3
  assert got.metrics["rollout/sampling_rounds"] == 3
  assert got.metrics["rollout/informative_frac"] == 4 / 9


def test_round_cap_masks_missing_slots():
  table = {p: (1.0, 1.0) if p != 4 else (0.0, 1.0) for p in range(6)}
  stream = iter([_batch([3, 4, 5])])
  got = dynamic_sampling.collect(_batch([0, 1, 2]), stream,
                                 _round_fn(table, []), group_size=G,
                                 max_rounds=2)
  assert len(got.samples) == 3 * G  # Static shape.
  assert got.valid.tolist() == [True, True, False, False, False, False]
  # Masked slots repeat the informative group, so gathers stay in range.
  assert [s.prompt_id for s in got.samples] == [4] * 6
  assert got.metrics["rollout/informative_groups"] == 1
