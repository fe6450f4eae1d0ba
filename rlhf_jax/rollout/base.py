"""The Rollout seam: prompt batches in, finished groups out as they finish.

  rollout.set_weights(params, version)         # rollout-layout policy
  for group in rollout.stream(prompts, G, seed, step=s):
    ...                                        # G samples of one prompt
  sampled = generate(rollout, prompts, G, seed, step=s, scorer=scorer)

`stream` yields each prompt's G samples (sorted by sample index) as soon as
the last of them finishes, so a consumer can score groups while the rest
decode (fusion), train on them (streaming) or queue them (async RL)
without callbacks threaded back into the step. `generate` is the simple
consumer: the whole batch in prompt order, scored group by group when a
scorer is given. `trainer_free` says whether the trainer's devices have
left the rollout under way (always after it ends; before, when the
rollout runs on workers and the trainer's engine has handed off).

Implementations, chosen once when the job is built (`rollout/build.py`):
`LocalRollout` (the trainer's mesh: continuous batching, common prefix,
long-tail policies) and `ElasticRollout` (rollout workers, optionally
seeded by a `LocalRollout`). Dimension letters: N prompts, G samples per
prompt, B = N*G.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Iterator

import numpy as np

from rlhf_jax.samples import PromptBatch
from rlhf_jax.samples import Request, Sample

Group = list[Sample]


def step_seed(seed: int, step: int) -> int:
  """Sampling seed of one RL step (placement-independent keys derive from it)."""
  return (seed * 1_000_003 + step * 7_919 + 1) % (2**32)


def requests_for(prompts: PromptBatch, num_samples: int,
                 seed: int) -> list[Request]:
  """One request of `num_samples` samples per prompt, in batch order."""
  ids = [int(p) for p in prompts.prompt_ids]
  if len(set(ids)) != len(ids):
    # Sampling keys derive from the prompt id: a repeat would be a copy.
    raise ValueError(f"prompt ids repeat within one batch: {sorted(ids)}")
  return [Request(pid, prompts.tokens_NxP[i, :prompts.lengths_N[i]],
                  num_samples, seed=seed) for i, pid in enumerate(ids)]


class Groups:
  """Assembles finished samples into complete groups of one batch."""

  def __init__(self, prompts: PromptBatch, num_samples: int):
    self.G = num_samples
    self.order = {int(p): i for i, p in enumerate(prompts.prompt_ids)}
    self._open: dict[int, list[Sample]] = {}
    self.done = 0

  def add(self, sample: Sample) -> Group | None:
    """The sample's group once it is complete (sorted by sample index)."""
    if sample.prompt_id not in self.order:
      raise RuntimeError(f"rollout returned a sample of prompt "
                         f"{sample.prompt_id}, which is not in the batch")
    group = self._open.setdefault(sample.prompt_id, [])
    group.append(sample)
    if len(group) < self.G:
      return None
    del self._open[sample.prompt_id]
    self.done += 1
    return sorted(group, key=lambda s: s.sample_idx)

  def check_complete(self) -> None:
    if self.done != len(self.order):
      raise RuntimeError(
          f"rollout ended with {self.done} of {len(self.order)} groups "
          "complete; incomplete: "
          f"{ {p: len(g) for p, g in self._open.items()} }")


class Rollout(abc.ABC):
  """Samples prompt batches with versioned weights; see the module doc."""

  version: int = -1
  # Multi-turn environments the samples step through (`envs/episodes`),
  # or None: single-turn.
  episodes = None
  # Whether workers of their own decode the samples (their rollout gets
  # its own row of the timeline).
  on_workers: bool = False

  @abc.abstractmethod
  def set_weights(self, params, version: int, master=None) -> None:
    """The policy the next streams sample from (rollout layout), stamped
    on every sample as its weight version. `master`: the training params
    it was derived from (a LoRA policy's base + adapters), for rollouts
    that ship less than the rollout copy (elastic workers: the adapters)."""

  @abc.abstractmethod
  def stream(self, prompts: PromptBatch, num_samples: int, seed: int, *,
             step: int = 0, trainer_busy=None,
             freed=None) -> Iterator[Group]:
    """Yields each prompt's group as soon as its last sample finishes.

    `trainer_busy()` (optional) tells a rollout that shares time with the
    trainer's devices whether they have training work in flight (streamed
    updates); it only informs measurements, never the samples. `freed`
    (`engine/long_tail.FreedReplicaWork`) runs on the replicas the rollout
    frees under way, where it frees any (`frees_replicas`).
    """

  @property
  def frees_replicas(self) -> bool:
    """Whether `stream` frees replicas under way (long-tail consolidation)
    for `freed` work."""
    return False

  @property
  def trainer_free(self) -> bool:
    """Whether the trainer's devices have left the stream under way."""
    return False

  def metrics(self) -> dict[str, float]:
    """rollout/ (and workers/) metrics of the last stream."""
    return {}

  @property
  def length_history(self):
    """The per-prompt `LengthHistory` to checkpoint, or None."""
    return None

  def close(self) -> None:
    """Releases what the rollout holds (workers)."""


@dataclasses.dataclass
class Sampled:
  """A batch's samples in prompt order (G consecutive per prompt)."""
  samples: list[Sample]
  rewards: np.ndarray | None   # [B] when scored
  valid: np.ndarray            # [B] False: kept out of the loss
  metrics: dict


def generate(rollout: Rollout, prompts: PromptBatch, num_samples: int,
             seed: int, *, step: int = 0, scorer=None, freed=None) -> Sampled:
  """Every sample of the batch, in prompt order; with a `scorer`
  (`scoring/host_rewards.RewardScorer`) each group is scored as it
  arrives and the scorer's metrics (of this batch) join the rollout's;
  `freed`: work on the replicas the rollout frees (`Rollout.stream`)."""
  groups: dict[int, Group] = {}
  rewards: dict[int, np.ndarray] = {}
  if scorer is not None:
    scorer.reset()  # Its metrics are this batch's.
  for group in rollout.stream(prompts, num_samples, seed, step=step,
                              freed=freed):
    pid = group[0].prompt_id
    groups[pid] = group
    if scorer is not None:
      rewards[pid] = scorer.score(group, prompts)
  ids = [int(p) for p in prompts.prompt_ids]
  samples = [s for p in ids for s in groups[p]]
  metrics = dict(rollout.metrics())
  if scorer is not None:
    metrics.update(scorer.metrics())
  return Sampled(
      samples, np.concatenate([rewards[p] for p in ids])
      if scorer is not None else None, np.ones(len(samples), bool), metrics)
