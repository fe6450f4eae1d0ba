"""Micro-batch streaming (RLBoost): a step's updates from parts of the batch
that arrive while the rest still decodes.

Complete groups (all G samples of a prompt: group-relative advantages are
group-local) are buffered with their rewards; once the trainer's devices
are free (`start`), every `groups_per_part` of them become a part: packed,
prepared with the step's weights (old log-probs from the weights the
samples came from) and turned into gradient sums (`Learner.grad_sums`)
without waiting for them. Every `parts_per_update` parts the sums become
one optimizer update (`Learner.apply`: summed numerator gradients over the
summed weight, so one update over k parts equals the update on their union,
summation order aside); the last update comes at `finish`. `busy()` tells a
seed window whether the devices have work in flight.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.rl.learner import Learner, TrainState, add_sums

# (samples of whole groups, rewards, params, reference) -> (batch, info)
PrepareFn = Callable[[Sequence[Any], np.ndarray, Any, Any], tuple[dict, dict]]


class StreamedUpdates:
  """One step's optimizer updates, built part by part."""

  def __init__(self, learner: Learner, prepare: PrepareFn, *, num_groups: int,
               groups_per_part: int, parts_per_update: int):
    """
    Args:
      learner: the policy learner.
      prepare: the job's batch of whole groups (pack, then the ADVANTAGES
        stage) under the given params and reference.
      num_groups: groups (prompts) in the batch.
      groups_per_part: complete groups per part (the last may be smaller).
      parts_per_update: parts per optimizer update.
    """
    self.learner, self.prepare = learner, prepare
    self.num_groups, self.k = num_groups, groups_per_part
    self.num_parts = -(-num_groups // groups_per_part)
    self.per_update = parts_per_update
    self.state: TrainState | None = None  # Set by `start`.
    self._behaviour = self._ref = None
    self._ready: list[tuple[list, np.ndarray]] = []  # (group, rewards)
    self._complete = 0
    self.sums, self.summed, self.parts = None, 0, 0
    self.infos: list[dict] = []
    self.trained: list[dict] = []
    self.updates_during_rollout = 0
    self.groups_during_rollout = 0
    self._last = None  # The newest dispatched device result.

  @property
  def started(self) -> bool:
    return self.state is not None

  def add(self, group: Sequence[Any], rewards: np.ndarray) -> None:
    """A complete group and its rewards."""
    self._ready.append((list(group), np.asarray(rewards, np.float32)))
    self._complete += 1

  def start(self, state: TrainState, ref_params) -> None:
    """The trainer's devices are free: `state` holds the step's params in
    the train layout (old log-probs come from them) and its optimizer."""
    self.state, self._ref = state, ref_params
    self._behaviour = state.params
    if self.per_update < self.num_parts:  # Updates donate `state.params`.
      self._behaviour = jax.tree.map(jnp.copy, state.params)

  def train_ready(self, final: bool = False) -> None:
    """Dispatches every full part (and the rest when `final`)."""
    while len(self._ready) >= self.k or (final and self._ready):
      part, self._ready = self._ready[:self.k], self._ready[self.k:]
      samples = [s for group, _ in part for s in group]
      batch, info = self.prepare(samples,
                                 np.concatenate([r for _, r in part]),
                                 self._behaviour, self._ref)
      sums = self.learner.grad_sums(self.state.params, batch)
      self.sums = sums if self.sums is None else add_sums(self.sums, sums)
      self._last = self.sums
      self.summed += 1
      self.parts += 1
      self.infos.append(info)
      if self._complete < self.num_groups:
        self.groups_during_rollout += len(part)
      if self.summed == self.per_update and self.parts < self.num_parts:
        self._apply()
        self.updates_during_rollout += self._complete < self.num_groups

  def busy(self) -> bool:
    """True while a part or an update is being computed."""
    return self._last is not None and not all(
        x.is_ready() for x in jax.tree.leaves(self._last))

  def finish(self) -> tuple[TrainState, list[dict]]:
    """The last update; (state, host metrics of every update)."""
    if self._complete != self.num_groups or self._ready:
      raise RuntimeError(f"streamed step finished with {self._complete} of "
                         f"{self.num_groups} groups, {len(self._ready)} "
                         "not trained")
    self._apply()
    jax.block_until_ready(self.state)  # Before the reference copy is freed.
    return self.state, jax.device_get(self.trained)

  def counts(self) -> dict[str, float]:
    return {"stream/parts": float(self.parts),
            "stream/groups_during_rollout": float(self.groups_during_rollout),
            "stream/updates_during_rollout":
                float(self.updates_during_rollout)}

  def _apply(self) -> None:
    self.state, m = self.learner.apply(
        self.state, *self.sums, self.summed * self.learner.micro_batches)
    self.trained.append(m)
    self._last, self.sums, self.summed = self.state.params, None, 0


def merge_infos(infos: Sequence[dict]) -> dict:
  """Per-part infos (device arrays) -> the batch's host info."""
  infos = jax.device_get(list(infos))
  tokens = sum(float(i["tokens"]) for i in infos)
  cat = lambda k: np.concatenate([np.asarray(i[k]) for i in infos])  # noqa: E731
  out = {"rewards": cat("rewards"), "kl": cat("kl"),
         "response_len": cat("response_len"), "keep": cat("keep"),
         **{k: sum(int(i[k]) for i in infos)
            for k in ("positions", "real_positions")}}
  if "gap_max" in infos[0]:  # Else the loss measured it (on-policy).
    out.update(gap_max=max(float(i["gap_max"]) for i in infos), **{
        k: sum(float(i[k]) * float(i["tokens"]) for i in infos)
        / max(tokens, 1.0) for k in ("gap_mean", "mismatch_kl")})
  return out
