"""The two kinds of scorer an RL step meets: host reward functions, group
by group as groups finish, and device passes over chunks of samples."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np


class GroupScorer(Protocol):
  """Host rewards of each group (`host_rewards.RewardScorer`); an
  algorithm's `scorer`."""

  def reset(self) -> None:
    """Starts a batch: `metrics` are the batch's."""

  def score(self, group: Sequence, prompts) -> np.ndarray:
    """[G] rewards of one prompt's samples (`prompts`: their batch)."""

  def metrics(self) -> dict[str, float]:
    """rewards/ metrics of the batch so far."""


class DevicePasses(Protocol):
  """Forward passes over chunks of finished samples on a layout
  (`passes.ScoringPasses`), fused into the rollout by `fused.FusedScoring`."""

  def begin(self, **weights) -> None:
    """The step's weights (policy, ref, rm, critic as the passes need)."""

  def end(self) -> None:
    """Drops what `begin` placed."""

  def score(self, samples: Sequence, layout) -> Any:
    """Dispatches every pass over `samples` on `layout`; device arrays
    whose row i is `samples[i]`."""

  def compile(self, samples: Sequence, layout) -> list:
    """Starts compiling what `score` would need; the futures still
    running (empty: ready)."""

  def bytes_per_device(self, layout) -> int:
    """What placing the step's weights on `layout` takes a device."""

  def assemble(self, samples: Sequence, scores: dict, packed) -> dict:
    """Host arrays of the passes' `scores` (by sample key) laid out as the
    training batch `packed`."""
