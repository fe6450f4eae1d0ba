"""Rollout phase: prompts -> engine samples -> scored, packed training batch.

Dimension letters: N prompts, G samples per prompt, B = N*G sequences,
T = P + M (largest prompt bucket + max new tokens).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlhf_jax.data.batching import PromptBatch
from rlhf_jax.engine.driver import Driver, Request, Sample
from rlhf_jax.rewards import scoring


def step_seed(seed: int, step: int) -> int:
  """Sampling seed of one RL step (placement-independent keys derive from it)."""
  return (seed * 1_000_003 + step * 7_919 + 1) % (2**32)


def requests_for(prompts: PromptBatch, num_samples: int, seed: int):
  return [Request(int(pid), prompts.tokens_NxP[i, :prompts.lengths_N[i]],
                  num_samples, seed=seed)
          for i, pid in enumerate(prompts.prompt_ids)]


def generate(driver: Driver, prompts: PromptBatch, num_samples: int,
             seed: int, common_prefix=None) -> list[Sample]:
  """All samples of the batch, ordered by (prompt order, sample index).

  `common_prefix` ("auto", tokens or None) goes to `Driver.run`: a prefix
  every prompt of the batch shares is prefilled and stored once.
  """
  order = {int(pid): i for i, pid in enumerate(prompts.prompt_ids)}
  if len(order) != len(prompts.prompt_ids):
    # Sampling keys derive from the prompt id: a repeat would be a copy.
    raise ValueError(f"prompt ids repeat within one batch: "
                     f"{sorted(prompts.prompt_ids.tolist())}")
  samples = list(driver.run(requests_for(prompts, num_samples, seed),
                            common_prefix=common_prefix))
  samples.sort(key=lambda s: (order[s.prompt_id], s.sample_idx))
  expected = len(prompts.prompt_ids) * num_samples
  if len(samples) != expected:
    raise RuntimeError(f"rollout returned {len(samples)} samples, expected "
                       f"{expected}")
  return samples


def score(samples: list[Sample], prompts: PromptBatch, tokenizer, reward_fns,
          weights, on_error: str):
  """Rewards [B] and reward metrics for samples ordered as `generate` returns."""
  index = {int(pid): i for i, pid in enumerate(prompts.prompt_ids)}
  rows = [index[s.prompt_id] for s in samples]
  batch = scoring.RewardBatch(
      prompt_ids=[s.prompt_id for s in samples],
      prompts=[prompts.prompts[r] for r in rows],
      completions=[tokenizer.decode(s.tokens) for s in samples],
      metadata=[{**prompts.metadata[r], "finish_reason": s.finish_reason}
                for r, s in zip(rows, samples)])
  return scoring.score(reward_fns, weights, batch, on_error)


@dataclasses.dataclass
class PackedBatch:
  """Host arrays for the learner plus the sampler's log-probs."""
  arrays: dict            # One layout of rl/grouped.py.
  sampler_logp: np.ndarray  # Raw engine log-probs, shaped like loss_mask.
  response_len: np.ndarray  # [B]


def pack(samples: list[Sample], prompt_len: int, max_new: int, *,
         group_size: int = 0) -> PackedBatch:
  """Host arrays of the batch in one of the layouts of `rl/grouped.py`.

  group_size=0: the repeated layout, prompt + response per row, right-padded
  to T; targets are shifted left. group_size=G: the grouped layout, each
  prompt once ([N, P], right-padded) and its G responses [N, G, R]; samples
  must come as `generate` returns them (G consecutive samples per prompt).
  """
  if group_size:
    return _pack_grouped(samples, group_size, prompt_len, max_new)
  B, T = len(samples), prompt_len + max_new
  tokens = np.zeros((B, T), np.int32)
  loss_mask = np.zeros((B, T), np.float32)
  sampler_logp = np.zeros((B, T), np.float32)
  lengths = np.zeros(B, np.int32)
  for b, s in enumerate(samples):
    p, r = len(s.prompt_tokens), len(s.tokens)
    tokens[b, :p] = s.prompt_tokens
    tokens[b, p:p + r] = s.tokens
    # Target t is token t+1, so response token j is target p-1+j.
    loss_mask[b, p - 1:p - 1 + r] = 1.0
    sampler_logp[b, p - 1:p - 1 + r] = s.logp_raw
    lengths[b] = p + r
  targets = np.concatenate([tokens[:, 1:], np.zeros((B, 1), np.int32)], 1)
  arrays = dict(
      tokens=tokens,
      positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
      attn_mask=np.arange(T)[None] < lengths[:, None],
      targets=targets, loss_mask=loss_mask)
  response_len = np.array([len(s.tokens) for s in samples], np.float32)
  return PackedBatch(arrays, sampler_logp, response_len)


def _pack_grouped(samples, G, prompt_len, max_new) -> PackedBatch:
  """The grouped layout; see `pack`."""
  if len(samples) % G:
    raise ValueError(f"{len(samples)} samples are not groups of {G}")
  N, R = len(samples) // G, max_new
  prompt_tokens = np.zeros((N, prompt_len), np.int32)
  prompt_lens = np.zeros(N, np.int32)
  responses = np.zeros((N, G, R), np.int32)
  loss_mask = np.zeros((N, G, R), np.float32)
  sampler_logp = np.zeros((N, G, R), np.float32)
  for b, s in enumerate(samples):
    n, g = divmod(b, G)
    p, r = len(s.prompt_tokens), len(s.tokens)
    if g == 0:
      prompt_tokens[n, :p] = s.prompt_tokens
      prompt_lens[n] = p
    elif s.prompt_id != samples[n * G].prompt_id:
      raise ValueError(f"sample {b} (prompt {s.prompt_id}) is not in the "
                       f"group of prompt {samples[n * G].prompt_id}")
    responses[n, g, :r] = s.tokens
    loss_mask[n, g, :r] = 1.0
    sampler_logp[n, g, :r] = s.logp_raw
  arrays = dict(prompt_tokens=prompt_tokens, prompt_len=prompt_lens,
                response_tokens=responses, loss_mask=loss_mask)
  response_len = np.array([len(s.tokens) for s in samples], np.float32)
  return PackedBatch(arrays, sampler_logp, response_len)
