"""Micro-batch streaming (RLBoost): train on finished groups while the
rollout workers finish the rest.

Once the trainer's devices leave the rollout (the seed window's hand-off,
or at once without seeding) they switch to the train layout, and every
`groups_per_part` complete groups (all G samples of a prompt: GRPO's
advantages are group-local) are scored, packed and turned into gradient
sums (`Learner.grad_sums`) while the workers go on generating. The step's
one optimizer update (`Learner.apply`) divides the summed numerator
gradients by the summed weight, so it equals the update the whole batch
would give (same samples, summation order aside).

Parts are dispatched without waiting for them (JAX runs them while the
host polls the workers); `idle()` tells the seed window whether the
trainer's devices have work in flight, so its train wait counts only the
time they really waited for samples.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from rlhf_jax.engine.driver import Sample

GROUP_LOCAL_ADVANTAGES = ("grpo", "drgrpo", "rloo")


class StreamedStep:
  """One step's updates, their gradient sums built part by part.

  With `parts_per_update` < the step's parts (`rl.num_minibatches` > 1)
  the step makes several optimizer updates, each as soon as its parts are
  in (`on_update`); the mini-batches are then the groups in arrival order,
  not a random split. Old log-probs always come from the step's weights
  (a copy kept for it), whatever updates came before.
  """

  def __init__(self, learner, *, num_groups: int, group_size: int,
               groups_per_part: int, on_free: Callable[[], Any],
               prepare: Callable[[Sequence[Sample], Any], tuple[dict, dict]],
               parts_per_update: int = 0,
               on_update: Callable[[Any, tuple, int], Any] | None = None):
    """
    Args:
      learner: the `Learner` whose `grad_sums` run on each part.
      num_groups: groups (prompts) in the batch.
      group_size: G, samples per prompt.
      groups_per_part: complete groups per part (the last part of a batch
        may be smaller).
      on_free: called once when the trainer's devices leave the rollout;
        returns the policy params in the train layout.
      prepare: (samples of whole groups, the step's params) -> (device
        batch, info); the same packing the whole-batch step uses.
      parts_per_update: parts per optimizer update (0: one update, the
        last, which the caller applies after `finish`).
      on_update: (params, sums, parts) -> updated params, for every update
        but the last.
    """
    self.learner, self.G, self.k = learner, group_size, groups_per_part
    self.num_groups = num_groups
    self._on_free, self._prepare = on_free, prepare
    self._per_update, self._on_update = parts_per_update, on_update
    self.params = None      # Current policy params (train layout).
    self._behaviour = None  # The step's params, for old log-probs.
    self.sums = None        # (grads, loss numerator, aux, weight) so far.
    self.sum_parts = 0      # Parts in `sums` (the update being built).
    self.infos: list[dict] = []
    self.parts = 0
    self.updates = 0        # Updates applied during the rollout.
    # Groups in parts started before the batch's last group was complete.
    self.groups_during_rollout = 0
    self._groups: dict[int, list[Sample]] = {}
    self._ready: list[list[Sample]] = []
    self._complete = 0
    self._last = None       # The newest dispatched device result.

  def free(self) -> None:
    """The trainer's devices are free: take the train layout, start parts."""
    if self.params is None:
      self.params = self._behaviour = self._on_free()
      if (self._on_update is not None
          and 0 < self._per_update < self._parts_left()):
        # Updates replace (donate) `params`; old log-probs need the copy.
        self._behaviour = jax.tree.map(jnp.copy, self.params)
      self._drain(final=False)

  def add(self, samples: Sequence[Sample]) -> None:
    """Finished samples of a poll round; trains whole parts once free."""
    for s in samples:
      group = self._groups.setdefault(int(s.prompt_id), [])
      group.append(s)
      if len(group) == self.G:
        self._ready.append(sorted(group, key=lambda x: x.sample_idx))
        self._complete += 1
    if self.params is not None:
      self._drain(final=False)

  def idle(self) -> bool:
    """True when no part is being computed (the devices wait for samples)."""
    return self._last is None or all(
        x.is_ready() for x in jax.tree.leaves(self._last))

  def finish(self) -> tuple[Any, tuple, list[dict]]:
    """After the rollout: the last parts; (params, the last update's sums,
    per-part infos). The caller applies that last update."""
    if self._complete != self.num_groups:
      raise RuntimeError(
          f"rollout ended with {self._complete} of {self.num_groups} groups "
          "complete: " + str({p: len(g) for p, g in self._groups.items()
                              if len(g) != self.G}))
    self.free()
    self._drain(final=True)
    return self.params, self.sums, self.infos

  def _drain(self, final: bool) -> None:
    """Trains every full part (and the rest when `final`)."""
    while len(self._ready) >= self.k or (final and self._ready):
      part, self._ready = self._ready[:self.k], self._ready[self.k:]
      samples = [s for group in part for s in group]
      batch, info = self._prepare(samples, self._behaviour)
      sums = self.learner.grad_sums(self.params, batch)
      self.sums = sums if self.sums is None else jax.tree.map(
          jnp.add, self.sums, sums)
      self._last = self.sums
      self.sum_parts += 1
      self.infos.append({**info, "samples": samples})
      self.parts += 1
      if self._complete < self.num_groups:
        self.groups_during_rollout += len(part)
      # A full update with parts still to come is applied now; the last
      # one is the caller's, after `finish`.
      if (self._on_update is not None and self.sum_parts == self._per_update
          and self._parts_left()):
        self.params = self._on_update(self.params, self.sums, self.sum_parts)
        self._last, self.sums, self.sum_parts = self.params, None, 0
        self.updates += 1

  def _parts_left(self) -> int:
    """Parts still to come in this step."""
    return -(-self.num_groups // self.k) - self.parts


def merge_means(parts: Sequence[tuple[int, dict]]) -> dict:
  """Per-part mean metrics -> batch metrics (weighted by part sizes);
  "/errors" counts are summed."""
  total = sum(n for n, _ in parts)
  out: dict[str, float] = {}
  for n, metrics in parts:
    for k, v in metrics.items():
      w = 1.0 if k.endswith("/errors") else n / max(total, 1)
      out[k] = out.get(k, 0.0) + float(v) * w
  return out

