"""How a step's train stage consumes the scored groups, chosen when the job
is built: `WholeBatch` trains once every group is in, `Streamed` (RLBoost's
micro-batch streaming, `rl/streaming.py`) trains on parts of the batch
while the rest still decodes.

  train = stage(trainable_of, step=step)   # per step
  train.add(group)                   # each scored group as it finishes
  train.start(states, ref)           # once the trainer's devices are back
  states, info, trained = train.finish(fused)

`states` are the job's learner states (the policy's params back in the
training layout; optimizer states and the other learners' states may still
wait in host memory: a stage brings them back when it needs them), `ref`
the reference on device (None when its pass ran fused). The algorithm
(`trainers/grpo.py`, `trainers/ppo.py`) says how samples become the
training batch (`batch`) and which learners train (`learners`:
(metric prefix, state key, Learner), the policy first); `trainable_of`
(samples -> (keep, current)) is the rollout's staleness rule.
"""

from __future__ import annotations

import jax
import numpy as np

from rlhf_jax.parallel import repartition
from rlhf_jax.rl import streaming
from rlhf_jax.rl.learner import train_epochs


def _live(co, tree):
  """`tree` on device: brought back from host memory if parked."""
  return tree if repartition.on_device(tree) else co.unpark(tree)


class WholeBatch:
  """Every group first, then `epochs x num_minibatches` updates of every
  learner on the same mini-batches (`train_epochs`)."""

  def __init__(self, algorithm, colocation, clock, trainable_of, *, step: int,
               epochs: int, num_minibatches: int, seed: int):
    self.algo, self.co, self.trainable_of = algorithm, colocation, trainable_of
    self.clock = clock
    self.step, self.epochs, self.minibatches = step, epochs, num_minibatches
    self.seed = seed
    self.groups, self.states, self.ref = [], None, None

  @property
  def started(self) -> bool:
    return self.states is not None

  def busy(self) -> bool:
    return False  # Nothing trains during the rollout.

  def add(self, group) -> None:
    self.groups.append(group)

  def start(self, states: dict, ref) -> None:
    self.states, self.ref = states, ref

  def counts(self) -> dict:
    return {}

  def finish(self, fused):
    """Trains on the batch (in the rollout's order: prompt order, or a
    refill's); `fused`: the scores of the passes that ran during the
    rollout (`scoring/fused.FusedScoring`), or None."""
    co, algo = self.co, self.algo
    groups = sorted(self.groups, key=lambda g: g.order)
    samples = [s for g in groups for s in g.samples]
    rewards = (None if groups[0].rewards is None
               else np.concatenate([g.rewards for g in groups]))
    valid = np.concatenate([np.full(len(g.samples), g.valid) for g in groups])
    keep, current = self.trainable_of(samples)
    key = algo.learners[0][1]
    with self.clock.span("scoring"):
      states = {k: v if k in (key, "ref") else _live(co, v)
                for k, v in self.states.items()}
      policy = states[key]
      batch, info = algo.batch(
          samples, rewards, keep & valid, policy.params, self.ref,
          states=states, minibatches=self.minibatches, current=current,
          fused=fused)
      jax.block_until_ready(batch)  # Before the reference copy is freed.
    with self.clock.span("train"):
      states[key] = policy.replace(opt_state=_live(co, policy.opt_state))
      keys = [k for _, k, _ in algo.learners]
      new, trained = train_epochs(
          [learner for _, _, learner in algo.learners],
          [states[k] for k in keys], batch, epochs=self.epochs,
          num_minibatches=self.minibatches, seed=self.seed)
    states.update(zip(keys, new))
    return (states, {**jax.device_get(info), "keep": keep},
            {prefix: t for (prefix, _, _), t in zip(algo.learners, trained)})


class Streamed:
  """Micro-batch streaming: once the trainer's devices are back, parts of
  `groups_per_part` groups are prepared with the step's weights and summed
  into updates of `parts_per_update` parts (`streaming.StreamedUpdates`);
  one update equals the whole batch's (float32 rounding). The policy is
  the only learner."""

  def __init__(self, algorithm, colocation, clock, trainable_of, *, step: int,
               num_groups: int, groups_per_part: int,
               parts_per_update: int):
    self.algo, self.co, self.trainable_of = algorithm, colocation, trainable_of
    self.clock = clock
    (_, self.key, learner), = algorithm.learners
    self.updates = streaming.StreamedUpdates(
        learner, self._part, num_groups=num_groups,
        groups_per_part=groups_per_part, parts_per_update=parts_per_update)
    self.states = None

  @property
  def started(self) -> bool:
    return self.updates.started

  def busy(self) -> bool:
    return self.updates.busy()

  def add(self, group) -> None:
    self.updates.add(group.samples, group.rewards)
    if self.started:
      self._train_ready()

  def start(self, states: dict, ref) -> None:
    self.states, policy = states, states[self.key]
    self.updates.start(policy.replace(
        opt_state=_live(self.co, policy.opt_state)), ref)
    self._train_ready()

  def counts(self) -> dict:
    return self.updates.counts()

  def finish(self, fused):
    del fused  # Streaming scores per part (`policy.fused_scoring`).
    self._train_ready(final=True)
    with self.clock.span("train"):
      state, trained = self.updates.finish()
    return ({**self.states, self.key: state},
            streaming.merge_infos(self.updates.infos), {"train": trained})

  def _train_ready(self, final: bool = False) -> None:
    with self.clock.span("train"):
      self.updates.train_ready(final=final)

  def _part(self, samples, rewards, params, ref):
    """A part's batch; stale samples are left out (or raise, as the
    rollout's rule says)."""
    keep, current = self.trainable_of(samples)
    batch, info = self.algo.batch(samples, rewards, keep, params, ref,
                                  minibatches=1, current=current)
    return batch, {**info, "keep": keep}
