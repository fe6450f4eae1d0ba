"""Async RL's version rules (bounded staleness), as plain decisions.

Versions: v names the weights after v updates; step b trains batch b on top
of version b - 1. The async rollout (`rollout/asynchronous.py`) executes
these rules; they count batches and finished groups, never seconds, so a
run (and a resumed run) takes every decision at the same point.
`rollout_split` sizes the rollout's part of the mesh from predicted
batch times (a cost model: `sched/cost_model/async_batch.py`).
"""

from typing import Callable, Sequence

# What a synchronous step (eta = 0) does with a sample of other weights.
STALE_POLICIES = ("raise", "drop")


def may_draw(batch: int, version: int, eta: int) -> bool:
  """Batch `batch` may be drawn and decoded by a rollout holding `version`:
  then its samples are at most `eta` versions older than the trainer they
  meet (version batch - 1). eta = 0: the synchronous job."""
  return batch - 1 - eta <= version


def switch_due(batch_complete: bool, groups_after: int,
               switch_after_groups: int, busy: bool) -> bool:
  """Whether the rollout takes the next version (v + 1) now: once batch
  v + 1 is complete (the trainer can only publish v + 1 after training on
  it) and `switch_after_groups` more groups have finished, or at once
  when it has nothing else to decode (it then waits for the weights)."""
  return batch_complete and (groups_after >= switch_after_groups or not busy)


def trainable(trainer_version: int, oldest_token_version: int,
              eta: int) -> bool:
  """A sample is trained on only within the staleness bound."""
  return trainer_version - oldest_token_version <= eta


def rollout_split(candidates: Sequence[int], devices: int,
                  rollout_s: Callable[[int], float],
                  train_s: Callable[[int], float]) -> int:
  """The rollout's share of `devices`, one of `candidates`: in the steady
  state the rollout decodes batch b + 1 while the trainer trains batch b,
  so a step lasts the longer of the two, `rollout_s(r)` and
  `train_s(devices - r)` (predicted seconds of one batch); the split
  minimising it, the smaller rollout on a tie."""
  if not candidates:
    raise ValueError(f"no rollout split of {devices} devices to choose from")
  return min(candidates,
             key=lambda r: (max(rollout_s(r), train_s(devices - r)), r))
