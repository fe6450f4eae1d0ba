"""What one RL step samples and how the policy's weights reach the sampler:
the job's rollout, one of three, chosen when the job is built.

  weights = rollout.to_rollout(states, step)   # the policy reaches it
  for group in rollout.groups(step, scorer):   # scored, as groups finish
    ...
  states = rollout.to_train(weights)           # the trainer's states back
  keep, current = rollout.trainable(samples, weights.version)
  metrics = rollout.end_step()

- `Colocated`: the step's prompt batch is the iterator's next; the policy
  switches to the rollout layout of the trainer's own devices
  (`parallel/colocate.py`; elastic workers pull it from there) while the
  optimizer state and the other learners' states wait in host memory.
- `Refill` (DAPO's dynamic sampling): `Colocated`, refilling the batch with
  informative groups from the prompt stream (`rollout/dynamic_sampling.py`).
- `Asynchronous`: its own devices (or the elastic workers) decode batch
  after batch while the trainer trains (`rollout/asynchronous.py`); the
  step publishes the trainer's newest weights and takes its batch (with
  dynamic sampling, refilled and scored by the rollout's thread).

One staleness rule serves them all (`sched/staleness.trainable`): a sample
is trained on when it is at most eta versions older than the weights the
trainer holds; eta = 0 for the synchronous rollouts, whose stale samples
raise unless `mesh.stale_samples="drop"`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterator

import jax
import numpy as np

from rlhf_jax.parallel import colocate
from rlhf_jax.rl.learner import TrainState
from rlhf_jax.rollout import dynamic_sampling
from rlhf_jax.rollout import elastic
from rlhf_jax.rollout.asynchronous import AsyncRollout
from rlhf_jax.rollout.base import Rollout, generate, step_seed
from rlhf_jax.sched import staleness
from rlhf_jax.timeline import device_group
from rlhf_jax.workers import weights as weights_lib

class StaleSampleError(ValueError):
  """A synchronous step met samples of weights other than its own."""


@dataclasses.dataclass
class ScoredGroup:
  """One prompt's G samples, their host rewards (None: the algorithm
  scores none) and whether they train (False: a filler of a refilled
  batch, masked out of the loss); `order`: its place in the step's
  batch."""
  samples: list
  rewards: np.ndarray | None
  valid: bool
  order: int


@dataclasses.dataclass
class Weights:
  """Where the step's weights are while the rollout samples: the policy's
  rollout copy (None: the rollout holds its own), the learners' states as
  they wait (parked in host memory, or live) and the version the samples
  are judged against."""
  params: Any
  states: dict
  version: int


def keep_mask(versions, trainer_version: int, eta: int,
              on_stale: str = "drop") -> np.ndarray:
  """[B] bool: the samples (their oldest tokens' `versions`) that train on
  top of `trainer_version` (`staleness.trainable`); with eta = 0 and
  `on_stale="raise"` a stale one raises `StaleSampleError` instead."""
  if on_stale not in staleness.STALE_POLICIES:
    raise ValueError(f"on_stale must be one of {staleness.STALE_POLICIES}, "
                     f"got {on_stale!r}")
  versions = np.asarray(versions, np.int64)
  keep = np.array([staleness.trainable(trainer_version, int(v), eta)
                   for v in versions], bool)
  if on_stale == "raise" and not keep.all():
    bad = np.nonzero(~keep)[0]
    raise StaleSampleError(
        f"{bad.size} of {versions.size} samples were generated with weight "
        f"versions {sorted(set(versions[bad].tolist()))}, not the current "
        f"version {trainer_version} (first stale sample index "
        f"{int(bad[0])}); set config.mesh.stale_samples='drop' to mask them "
        "out instead")
  return keep


class Colocated:
  """The step's prompt batch on the rollout of the trainer's own mesh (or
  on elastic workers fed from it); see the module doc."""

  def __init__(self, sampler: Rollout, colocation: colocate.Colocation,
               clock, iterator, *, group_size: int, seed: int,
               policy_key: str):
    """`sampler`: the engine-level rollout (`LocalRollout` or
    `ElasticRollout`); `policy_key`: the policy's entry of the states
    (the others, but "ref", wait in host memory during the rollout)."""
    self.sampler, self.co, self.iterator = sampler, colocation, iterator
    self.clock = clock  # `step_clock.StepClock`: the job's phases.
    self.G, self.seed, self.policy_key = group_size, seed, policy_key
    self._metrics: dict = {}
    self._t0 = 0.0

  # The trainer's devices decode until the sampler hands off (workers).
  trainer_free = property(lambda self: self.sampler.trainer_free)
  length_history = property(lambda self: self.sampler.length_history)

  def to_rollout(self, states: dict, step: int) -> Weights:
    del step
    co, key = self.co, self.policy_key
    with self.clock.span("repartition"):
      params = co.to_rollout(states[key].params)
      parked = {k: v if k == "ref" else co.park(v)
                for k, v in states.items() if k != key}
      parked[key] = TrainState(None, co.park(states[key].opt_state),
                               states[key].step)
    self.sampler.set_weights(params, co.version, master=co.master)
    self._t0 = self.clock.now()
    return Weights(params, parked, co.version)

  def groups(self, step: int, scorer, trainer_busy=None, freed=None
             ) -> Iterator[ScoredGroup]:
    prompts = next(self.iterator)
    order = {int(p): i for i, p in enumerate(prompts.prompt_ids)}
    if scorer is not None:
      scorer.reset()  # Its metrics are this step's.
    t0 = self.clock.now()
    for group in self.sampler.stream(prompts, self.G,
                                     step_seed(self.seed, step), step=step,
                                     trainer_busy=trainer_busy, freed=freed):
      rewards = None if scorer is None else scorer.score(group, prompts)
      end = self.clock.now()  # The rollout's end, once all are in.
      yield ScoredGroup(group, rewards, True, order[group[0].prompt_id])
    if self.sampler.on_workers:  # Their own row of the timeline.
      self.clock.timeline.add("workers", "rollout", t0, end)
    self._metrics = {**self.sampler.metrics(),
                     **(scorer.metrics() if scorer is not None else {})}

  def to_train(self, weights: Weights) -> dict:
    """The policy's params back in the training layout; the parked states
    stay parked until a stage needs them (`TrainStage`)."""
    clock, key = self.clock, self.policy_key
    clock.timeline.add(clock.group, "rollout", self._t0, clock.now())
    with clock.span("repartition"):
      params = self.co.to_train(weights.params)
    return {**weights.states, key: weights.states[key].replace(
        params=params)}

  def trainable(self, samples, version: int):
    """(keep [B], None): this version's samples; eta = 0."""
    return keep_mask([s.weight_version for s in samples], version, 0,
                     self.co.on_stale), None

  def end_step(self) -> dict:
    return dict(self._metrics)

  # The loop's hooks (`trainers/loop.py`): the iterator is checkpointed
  # there; nothing runs beside the steps.
  def start(self, step: int, states: dict, meta: dict) -> None:
    del step, states, meta

  def dump(self, step: int, states: dict) -> dict:
    del step, states
    return {}

  def saved(self) -> None:
    pass

  def close(self) -> None:
    pass  # The sampler is the policy's (`rl_job.run` closes it).


class Refill(Colocated):
  """DAPO's dynamic sampling: rounds on the step's weights until the batch
  holds N informative groups (`rollout/dynamic_sampling.collect`); the
  slots still missing repeat a collected group, masked out (not valid)."""

  def __init__(self, *args, max_rounds: int, **kwargs):
    super().__init__(*args, **kwargs)
    self.max_rounds = max_rounds

  def groups(self, step: int, scorer, trainer_busy=None, freed=None
             ) -> Iterator[ScoredGroup]:
    del trainer_busy, freed  # Rounds score after the rollout.
    run_round = functools.partial(
        generate, self.sampler, num_samples=self.G,
        seed=step_seed(self.seed, step), step=step, scorer=scorer)
    got = dynamic_sampling.collect(
        next(self.iterator), self.iterator, run_round, group_size=self.G,
        max_rounds=self.max_rounds)
    self._metrics = got.metrics
    for n in range(len(got.samples) // self.G):
      rows = slice(n * self.G, (n + 1) * self.G)
      yield ScoredGroup(got.samples[rows], got.rewards[rows],
                        bool(got.valid[rows].all()), n)


class Asynchronous:
  """Async RL's rollout on its own devices or the elastic workers; the
  step publishes the trainer's newest weights (version step - 1) and takes
  the batch drawn for it. Checkpoints hold its state at the switch to the
  saved version, so a resumed run continues as the uninterrupted one."""

  trainer_free = True  # The trainer's devices never decode.
  length_history = None

  def __init__(self, rollout: AsyncRollout, colocation, clock, layout, *,
               group_size: int, eta: int, policy_key: str, manager=None):
    """`layout`: the rollout's part of the mesh, or None: elastic workers
    decode (they pull host copies; `manager`, theirs, for metrics)."""
    self.rollout, self.co, self.layout = rollout, colocation, layout
    self.clock = clock
    self.G, self.eta, self.policy_key = group_size, eta, policy_key
    self.manager = manager
    self.sampler = None        # No fused scoring: the trainer's own part.
    self.shardings = None      # The rollout copy's, from the first params.
    self.group = ("workers" if layout is None else device_group(
        "rollout", layout.mesh.devices.flat))
    self.published = None      # The newest version the rollout was given.
    self._base_published = False  # A LoRA policy's base, to the workers.
    self._start, self._metrics = 0.0, {}

  def copy(self, params):
    """The rollout copy of `params` on the rollout's devices (a host copy
    for the workers; of a LoRA policy's adapters only, as in the
    synchronous job: the workers merge them into the base sent once)."""
    if self.layout is None and self.manager.spec_lora is not None:
      adapters = elastic.lora_version(self.manager.store, params,
                                      self._base_published)
      self._base_published = True
      return weights_lib.to_payload(adapters)
    local = self.co.rollout_copy(params)  # Cast, on the trainer's devices.
    if self.layout is None:
      out = weights_lib.to_payload(local)
    else:
      if self.shardings is None:
        self.shardings = self.layout.param_shardings(local)
      out = jax.device_put(local, self.shardings)
    colocate.delete(local)  # Once the copy has read it.
    return out

  def to_rollout(self, states: dict, step: int) -> Weights:
    self._start = self.clock.now()
    if self.published < step - 1:
      self.rollout.publish(self.copy(states[self.policy_key].params),
                           step - 1)
      self.published = step - 1
    return Weights(None, states, step - 1)  # The trainer's weights.

  def groups(self, step: int, scorer, trainer_busy=None, freed=None
             ) -> Iterator[ScoredGroup]:
    del trainer_busy, freed  # Its own devices decode.
    start = self.clock.now()
    batch = self.rollout.take(step)  # An idle span of the trainer's devices.
    self._metrics = {"perf/trainer_wait_s": self.clock.now() - start}
    self._batch = batch
    if batch.rewards is not None:  # Dynamic sampling: the rollout scored.
      self._metrics.update(batch.scored)
      for n in range(len(batch.samples) // self.G):
        rows = slice(n * self.G, (n + 1) * self.G)
        yield ScoredGroup(batch.samples[rows], batch.rewards[rows],
                          bool(batch.valid[rows].all()), n)
      return
    if scorer is not None:
      scorer.reset()  # Host rewards, group by group.
    for n in range(len(batch.samples) // self.G):
      group = batch.samples[n * self.G:(n + 1) * self.G]
      yield ScoredGroup(group, None if scorer is None else scorer.score(
          group, batch.prompts), True, n)
    if scorer is not None:
      self._metrics.update(scorer.metrics())

  def to_train(self, weights: Weights) -> dict:
    return weights.states  # They never left.

  def trainable(self, samples, version: int):
    """(keep [B]: within eta, current [B]: every token of `version`)."""
    keep = keep_mask([s.weight_version for s in samples], version, self.eta)
    current = np.array([min(s.token_versions) == max(s.token_versions)
                        == version for s in samples])
    return keep, current

  def end_step(self) -> dict:
    """The step's async/ and perf/rollout_ metrics; the rollout's devices
    decoded all along (their waits for weights: perf/rollout_wait_weights_s)."""
    self.clock.timeline.add(self.group, "rollout", self._start,
                            self.clock.now())
    samples, version = self._batch.samples, self._batch.step - 1
    lag = np.concatenate([version - np.asarray(s.token_versions)
                          for s in samples])  # Per token, in versions.
    oldest = np.array([s.weight_version for s in samples])
    out = {**self._metrics,
           "async/staleness_mean": float(lag.mean()),
           "async/staleness_max": float(lag.max()),
           "async/off_policy_samples": float(np.sum(oldest < version)),
           **{(f"perf/rollout_{k}" if k.endswith("_s") else f"async/{k}"):
              float(v) for k, v in self._batch.metrics.items()}}
    if self.layout is not None:
      out["async/rollout_devices"] = float(self.layout.mesh.devices.size)
      out["rollout/common_prefix_len"] = float(self.rollout.stored_prefix)
    else:
      mgr = self.manager  # Totals since the start (its thread's).
      out.update({"workers/alive": float(len(mgr.handles)),
                  "workers/preemptions": float(mgr.stats.preemptions),
                  "workers/migrated_samples": float(
                      mgr.stats.migrated_samples),
                  "workers/pulls": float(mgr.stats.pulls),
                  # A LoRA policy's versions are its adapters; its base
                  # goes once to each worker.
                  "workers/pull_bytes": float(mgr.stats.pull_bytes),
                  "workers/base_bytes": float(mgr.stats.base_bytes)})
    return out

  # The loop's hooks (`trainers/loop.py`).
  def start(self, step: int, states: dict, meta: dict) -> None:
    """Starts decoding from the restored or fresh `states` (meta: the
    checkpoint's, with the rollout's snapshot)."""
    self.rollout.start(self.copy(states[self.policy_key].params), step,
                       first_step=step + 1, snapshot=meta.get("async"))
    self.published = step

  def dump(self, step: int, states: dict) -> dict:
    """The rollout's state at its switch to `step`'s weights (it holds
    still there until `saved`)."""
    if self.published is None:  # Step 0, before the rollout starts.
      return {}
    snap = self.rollout.publish(self.copy(states[self.policy_key].params),
                                step, snapshot=True)
    self.published = step
    return {"async": snap}

  def saved(self) -> None:
    if self.published is not None:
      self.rollout.release()

  def close(self) -> None:
    self.rollout.close()
