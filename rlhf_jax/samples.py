"""What flows between the data, the engine, the rollouts and the trainers.

A `PromptBatch` of prompts becomes `Request`s (one per prompt, G samples
each); the engine returns each finished response as a `Sample`, or, cut
mid-response (a preempted worker, a load-balancing move), as a `Partial`
that continues elsewhere as prompt + the tokens so far. Plain host data:
numpy and lists, nothing on a device.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class PromptBatch:
  """Prompts for one rollout (or eval) batch."""

  prompt_ids: np.ndarray  # [N] int32, unique per prompt, stable across runs
  tokens_NxP: np.ndarray  # [N, P] int32, <bos> + prompt, right-padded
  lengths_N: np.ndarray  # [N] int32, true lengths incl. <bos>
  prompts: list[str]  # prompt texts, for reward functions
  metadata: list[dict]  # Example.metadata() per prompt (answer, ...)



@dataclasses.dataclass(frozen=True)
class Request:
  """A prompt to sample `num_samples` responses for."""
  prompt_id: int
  tokens: np.ndarray
  num_samples: int = 1
  seed: int = 0
  first_sample_index: int = 0  # Sample indices are first..first+num-1.
  # Per-sample token budgets (<= the engine's max_new_tokens): a stop rule
  # that ends sample i after that many tokens, finish_reason "length".
  max_new_tokens_per_sample: tuple[int, ...] | None = None

  def budget(self, i: int, engine_max: int) -> int:
    """Token budget of the i-th sample of this request."""
    if self.max_new_tokens_per_sample is None:
      return engine_max
    return min(engine_max, int(self.max_new_tokens_per_sample[i]))


@dataclasses.dataclass
class Sample:
  """One finished response, addressable by (prompt_id, sample_idx)."""
  prompt_id: int
  sample_idx: int
  prompt_tokens: np.ndarray
  tokens: list[int]
  logp: list[float]        # under the distribution sampled from
  logp_raw: list[float]    # temperature-1 policy log-prob
  finish_reason: str       # "stop" or "length"
  weight_version: int
  # Multi-turn (`engine/multiturn.py`): True at the tokens the environment
  # appended (not sampled: log-probs 0, kept out of the loss); None: none.
  env_mask: list[bool] | None = None
  env_reward: float = 0.0  # The environment's rewards (envs/episodes.py).
  seed: int = 0            # Its request's (tells batches apart: async RL).
  # Async RL (`rollout/asynchronous.py`): the weight version of each token
  # (weight_version is then the oldest); None: all weight_version.
  token_versions: list[int] | None = None
  # Rollout routing replay (MoE, `Engine(record_routes=True)`): the experts
  # each prompt token [P, L, k] and each fed response token [len(tokens) -
  # 1, L, k] went to (the last token is never fed); -1: not recorded.
  prompt_routes: np.ndarray | None = None
  routes: np.ndarray | None = None

  @property
  def key(self):
    return self.prompt_id, self.sample_idx


@dataclasses.dataclass(frozen=True)
class Partial:
  """A sample cut mid-response: its request and the tokens so far."""
  request: Request
  sample_idx: int
  tokens: list[int]
  logp: list[float]
  logp_raw: list[float]
  budget: int
  weight_version: int = 0
  # Routing replay (`Engine(record_routes=True)`): its group's prompt
  # routes and one record per token fed so far (`engine/groups.Slot`).
  prompt_routes: np.ndarray | None = None
  routes: list | None = None
