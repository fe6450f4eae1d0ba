"""DAPO dynamic sampling in the live loop: fill the batch with informative
groups, refilling from the prompt stream, at a static batch shape.

A round takes the next prompt batch, samples G responses per prompt and
scores them; groups whose G rewards are all equal (group-relative advantage
0) are set aside. Rounds continue until N informative groups are collected
or `max_rounds` is reached; the slots still missing repeat a collected group
and are masked out of the loss (`dapo.select_groups`), so the train step
always sees N·G rows and never trains on a zero-variance group.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import numpy as np

from rlhf_jax.data.batching import PromptBatch
from rlhf_jax.engine.driver import Sample
from rlhf_jax.rl import dapo

# (prompts) -> (samples ordered prompt-major, rewards [N*G], reward metrics)
RoundFn = Callable[[PromptBatch], tuple[list[Sample], np.ndarray, dict]]


@dataclasses.dataclass
class Collected:
  """The train batch's groups: N*G samples, prompt-major."""
  samples: list[Sample]
  rewards: np.ndarray         # [N*G]
  valid: np.ndarray           # [N*G] bool; False rows are masked out
  metrics: dict               # reward metrics (of all rounds) + sampling stats


def collect(first: PromptBatch, prompts: Iterator[PromptBatch],
            run_round: RoundFn, *, group_size: int, max_rounds: int,
            atol: float = 0.0) -> Collected:
  """Runs rounds from `first`, then `prompts`, until N groups are informative.

  Args:
    first: the step's prompt batch; N = its number of prompts.
    prompts: the prompt stream the refills are drawn from.
    run_round: samples and scores one prompt batch.
    group_size: G.
    max_rounds: rounds at most (>= 1), the first included.
    atol: reward spread at or below which a group counts as constant.
  """
  G, N = group_size, len(first.prompt_ids)
  pool_samples, pool_rewards, round_metrics = [], [], []
  batch = first
  for rounds in range(1, max_rounds + 1):
    samples, rewards, metrics = run_round(batch)
    pool_samples += samples
    pool_rewards.append(np.asarray(rewards, np.float32))
    round_metrics.append(metrics)
    idx_N, valid_N = dapo.select_groups(
        np.concatenate(pool_rewards).reshape(-1, G), N, atol=atol)
    if valid_N.all() or rounds == max_rounds:
      break
    batch = next(prompts)
  rows, valid = dapo.group_rows(idx_N, valid_N, G)
  rewards = np.concatenate(pool_rewards)
  metrics = {k: float(np.mean([m[k] for m in round_metrics]))
             for k in round_metrics[0]}
  metrics.update({
      "rollout/sampling_rounds": float(rounds),
      "rollout/informative_groups": float(valid_N.sum()),
      "rollout/informative_frac": float(dapo.informative_groups(
          rewards.reshape(-1, G), atol=atol).mean()),
  })
  return Collected([pool_samples[r] for r in rows], rewards[rows], valid,
                   metrics)
