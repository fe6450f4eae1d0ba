"""DAPO dynamic sampling: fill the batch with informative groups, refilling
from the prompt stream, at a static batch shape.

A round samples and scores the next prompt batch (`generate` with the
job's reward scorer); groups whose G rewards are all equal (group-relative
advantage 0) are set aside. Rounds continue until N informative groups are
collected or `max_rounds` is reached; the slots still missing repeat a
collected group and are masked out of the loss (`dapo.select_groups`), so
the train step always sees N·G rows and never trains on a zero-variance
group. `Pool` holds that rule: the synchronous job's rounds (`collect`, on
the step's weights) and async RL's (`rollout/asynchronous.py`, drawn by
its rollout thread as a batch's round finishes) go through it.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Iterator

import numpy as np

from rlhf_jax.samples import PromptBatch
from rlhf_jax.rl import dapo
from rlhf_jax.rollout.base import Sampled


class Pool:
  """One batch's rounds so far, in the order they were drawn."""

  def __init__(self, num_groups: int, group_size: int, max_rounds: int,
               atol: float = 0.0):
    self.N, self.G, self.max_rounds, self.atol = (num_groups, group_size,
                                                  max_rounds, atol)
    self.samples: list = []
    self.rewards: list[np.ndarray] = []
    self.round_metrics: list[dict] = []

  @property
  def rounds(self) -> int:
    return len(self.rewards)

  def add(self, got: Sampled) -> None:
    """A round's scored samples (prompt order, G per prompt)."""
    self.samples += got.samples
    self.rewards.append(np.asarray(got.rewards, np.float32))
    self.round_metrics.append(got.metrics)

  def _selection(self):
    return dapo.select_groups(np.concatenate(self.rewards).reshape(
        -1, self.G), self.N, atol=self.atol)

  @property
  def done(self) -> bool:
    """N informative groups collected, or no round left."""
    return bool(self._selection()[1].all()) or self.rounds == self.max_rounds

  def result(self) -> Sampled:
    """The first N informative groups (missing slots: a repeat, not
    valid) and the rounds' metrics: each round's mean, and the refill's."""
    idx_N, valid_N = self._selection()
    rows, valid = dapo.group_rows(idx_N, valid_N, self.G)
    rewards = np.concatenate(self.rewards)
    metrics = {k: float(np.mean([m[k] for m in self.round_metrics]))
               for k in self.round_metrics[0]}
    metrics.update({
        "rollout/sampling_rounds": float(self.rounds),
        "rollout/informative_groups": float(valid_N.sum()),
        "rollout/informative_frac": float(dapo.informative_groups(
            rewards.reshape(-1, self.G), atol=self.atol).mean()),
    })
    return Sampled([self.samples[r] for r in rows], rewards[rows], valid,
                   metrics)


@dataclasses.dataclass(frozen=True)
class Refill:
  """Async RL's refill, on its rollout thread: the job's reward scorer
  (each round scores with a copy of its own: the trainer keeps the
  original) and the round cap."""
  scorer: object  # `scoring/host_rewards.RewardScorer`.
  max_rounds: int
  atol: float = 0.0

  def pool(self, num_groups: int, group_size: int) -> Pool:
    return Pool(num_groups, group_size, self.max_rounds, self.atol)

  def score_round(self, groups: list[list], prompts: PromptBatch) -> Sampled:
    """A finished round, its groups in prompt order, scored."""
    scorer = copy.copy(self.scorer)
    scorer.reset()
    rewards = [scorer.score(group, prompts) for group in groups]
    return Sampled([s for group in groups for s in group],
                   np.concatenate(rewards), np.ones(
                       sum(map(len, groups)), bool), scorer.metrics())


def collect(first: PromptBatch, prompts: Iterator[PromptBatch],
            run_round: Callable[[PromptBatch], Sampled], *, group_size: int,
            max_rounds: int, atol: float = 0.0) -> Sampled:
  """Runs rounds from `first`, then `prompts`, until N groups are informative.

  Args:
    first: the step's prompt batch; N = its number of prompts.
    prompts: the prompt stream the refills are drawn from.
    run_round: samples and scores one prompt batch (prompt order).
    group_size: G.
    max_rounds: rounds at most (>= 1), the first included.
    atol: reward spread at or below which a group counts as constant.
  """
  pool = Pool(len(first.prompt_ids), group_size, max_rounds, atol)
  pool.add(run_round(first))
  while not pool.done:
    pool.add(run_round(next(prompts)))
  return pool.result()
