"""DAPO dynamic sampling: fill the batch with informative groups, refilling
from the prompt stream, at a static batch shape.

A round samples and scores the next prompt batch (`generate` with the
job's reward scorer); groups whose G rewards are all equal (group-relative
advantage 0) are set aside. Rounds continue until N informative groups are
collected or `max_rounds` is reached; the slots still missing repeat a
collected group and are masked out of the loss (`dapo.select_groups`), so
the train step always sees N·G rows and never trains on a zero-variance
group. Every round runs on the same weights (one rollout layout switch).
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from rlhf_jax.samples import PromptBatch
from rlhf_jax.rl import dapo
from rlhf_jax.rollout.base import Sampled


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
  G, N = group_size, len(first.prompt_ids)
  pool_samples, pool_rewards, round_metrics = [], [], []
  batch = first
  for rounds in range(1, max_rounds + 1):
    got = run_round(batch)
    pool_samples += got.samples
    pool_rewards.append(np.asarray(got.rewards, np.float32))
    round_metrics.append(got.metrics)
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
  return Sampled([pool_samples[r] for r in rows], rewards[rows], valid,
                 metrics)
