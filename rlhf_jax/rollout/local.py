"""The trainer's own mesh decodes: continuous batching over prompt rows.

One implementation, its options parameters rather than branches:
  - common prefix (`rollout.max_common_length > 0`): a token prefix every
    prompt of the batch shares is prefilled and stored once (two-level
    sharing; `Driver.run(common_prefix="auto")`);
  - long-tail policies (`rollout.long_tail.enabled`): longest-predicted
    prompts first into the least-loaded replica's rows, tail consolidation
    onto fewer replicas, the cost-aware replica count, per-replica spans
    (`engine/long_tail.TailController`); the per-prompt length history
    learns from every batch and is checkpointed.
Samples are the same with or without either (placement-independent keys).
With `episodes` (`envs/episodes.py`) every sample is a
multi-turn episode: `MultiTurnDriver` appends the environment's replies.
`start_driver` starts the same decode loop for a worker that is fed over
time (the trainer's engine seeding an elastic rollout).
"""

from __future__ import annotations

import statistics
import time
from typing import Iterator, Sequence

import numpy as np
from absl import logging

from rlhf_jax.config.sections import LongTail
from rlhf_jax.samples import PromptBatch
from rlhf_jax.engine import common_prefix as common_lib
from rlhf_jax.engine.controller import Controller
from rlhf_jax.engine.driver import Driver
from rlhf_jax.samples import Request, Sample
from rlhf_jax.engine.engine_set import EngineSet
from rlhf_jax.engine.long_tail import FreedReplicaWork, TailController
from rlhf_jax.rollout.base import Group, Groups, Rollout, requests_for
from rlhf_jax.sched import assignment, continuous
from rlhf_jax.sched.length_history import LengthHistory
from rlhf_jax.timeline import Timeline


class LocalRollout(Rollout):
  """Prompt batches on the `EngineSet` of the trainer's rollout layout."""

  # The job's agent endpoint (`serving/`) where agents drive the episodes:
  # stopped with this rollout.
  agent_server = None
  agent_runner = None  # Its `close()`, if any, ends agent worker processes.

  def __init__(self, engines: EngineSet, *, tail: LongTail = LongTail(),
               history: LengthHistory | None = None,
               timeline: Timeline | None = None, episodes=None):
    """
    Args:
      engines: the engines (their `max_common_length` > 0 enables the
        common prefix).
      tail: the long-tail policies; `tail.enabled` False runs plain
        continuous batching on all replicas.
      history: per-prompt length history (default: EWMA of
        `tail.history_alpha`).
      timeline: where per-replica spans go (long-tail only).
      episodes: multi-turn environments (`envs/episodes.Episodes`).
    """
    self.engines, self.tail, self.episodes = engines, tail, episodes
    self.history = history or LengthHistory(tail.history_alpha)
    self.timeline = timeline if timeline is not None else Timeline(None)
    self.step_s: dict[int, float] = {}  # Measured decode step per block.
    self.params = None
    self._metrics: dict = {}

  @property
  def frees_replicas(self) -> bool:
    """The long-tail controller frees replicas as it consolidates."""
    return self.tail.enabled

  @property
  def length_history(self):
    return self.history if self.tail.enabled else None

  def set_weights(self, params, version: int, master=None) -> None:
    del master  # The trainer's own devices hold the rollout copy.
    self.params, self.version = params, version

  def stream(self, prompts: PromptBatch, num_samples: int, seed: int, *,
             step: int = 0, trainer_busy=None,
             freed: FreedReplicaWork | None = None) -> Iterator[Group]:
    del trainer_busy  # The trainer's devices decode here.
    groups = Groups(prompts, num_samples)
    if self.episodes is not None:
      self.episodes.begin(step, prompts)
    for sample in self.run(requests_for(prompts, num_samples, seed),
                           step=step, freed=freed):
      group = groups.add(sample)
      if group is not None:
        yield group
    groups.check_complete()

  def metrics(self) -> dict:
    return dict(self._metrics)

  # ----------------------------------------------------------- requests
  def predicted(self, req: Request) -> float:
    """The request's predicted response length (its prompt's history)."""
    default = (self.tail.default_length
               or self.engines.sampling.max_new_tokens / 2)
    return self.history.predict(req.prompt_id, default)

  def common_prefix(self, requests: Sequence[Request]) -> np.ndarray:
    """The batch's shared prefix to store once (empty: none)."""
    return common_lib.batch_common_prefix(
        [r.tokens for r in requests], self.engines.engine().max_common_length)

  def run(self, requests: Sequence[Request], *, step: int = 0,
          freed: FreedReplicaWork | None = None) -> Iterator[Sample]:
    """Samples every request; yields samples as they finish.

    `freed` (long-tail only) works on the replicas the tail frees (the
    fused passes, `scoring/fused.py`), and is done once the iterator is
    exhausted; the run's metrics are in `metrics()`.
    """
    t, eng = self.tail, self.engines
    requests = list(requests)
    common = self.common_prefix(requests)
    t0 = time.perf_counter()
    if not t.enabled:
      driver = eng.driver(self.params, self.version, reply=self.episodes)
      yield from self._finished(driver.run(requests, common_prefix=common))
      self._metrics = self._driver_metrics(driver)
      return
    if t.assignment in ("length", "grouped"):
      order = assignment.longest_first(
          [self.predicted(r) for r in requests],
          [r.prompt_id for r in requests])
      requests = [requests[i] for i in order]
    m0, decision = continuous.decode_replicas(
        t.replicas, eng.sizes,
        [[self.predicted(r)] * r.num_samples for r in requests],
        eng.rows_per_replica, {m: self.step_s.get(m) for m in eng.sizes},
        t.cost_lambda)
    logging.info("long-tail rollout step %d: %d decode replicas of %d; "
                 "inputs %s", step, m0, eng.replicas, decision)
    driver, ctl = self._tail_driver(m0, step, freed)
    samples = []
    for sample in self._finished(driver.run(
        requests, admission=t.admission, controller=ctl,
        common_prefix=common)):
      samples.append(sample)
      ctl.finished(sample)
      yield sample
    ctl.flush()
    ctl.close_spans()
    wall = time.perf_counter() - t0
    for m, times in ctl.step_times.items():
      if times:
        self.step_s[m] = statistics.median(times)
    errors = self._learn_lengths(requests, samples)
    self._metrics = {
        **self._driver_metrics(driver), **ctl.stats(),
        "rollout/replicas": m0, "perf/rollout_wall_s": wall,
        "perf/rollout_idle_s": ctl.idle_s / eng.replicas,
        "perf/rollout_idle_fraction": (ctl.idle_s / (eng.replicas * wall)
                                       if wall else 0.0),
        "sched/predicted_vs_actual_len": errors,
        "sched/unmeasured": float(decision.get("unmeasured", False))}

  def start_driver(self, params, version: int, requests: Sequence[Request],
                   common_prefix: np.ndarray, *, step: int = 0) -> Driver:
    """A started driver for a worker fed over time (requests may be added
    later); with the long-tail policies on, on every replica."""
    if not self.tail.enabled:
      driver = self.engines.driver(params, version)
      # One decode step a call, as on the elastic workers' engines: a
      # worker's poll of `poll_steps` iterations is that many tokens a
      # sample, and the seed window's T_seed is checked between calls.
      driver.start(requests, common_prefix=common_prefix,
                   controller=Controller(window=1))
      return driver
    self.params, self.version = params, version
    driver, ctl = self._tail_driver(self.engines.replicas, step, None)
    driver.start(requests, admission=self.tail.admission, controller=ctl,
                 common_prefix=common_prefix)
    return driver

  def close(self) -> None:
    if self.agent_server is not None:
      self.agent_server.stop()
    getattr(self.agent_runner, "close", lambda: None)()

  # ------------------------------------------------------------ helpers
  def _finished(self, samples: Iterator[Sample]) -> Iterator[Sample]:
    """The driver's samples, each episode closed first (multi-turn)."""
    for sample in samples:
      if self.episodes is not None:
        self.episodes.finish(sample)
      yield sample

  def _tail_driver(self, m: int, step: int, freed):
    eng = self.engines
    ctl = TailController(eng, self.tail, self.predicted,
                         full_params=self.params, m=m,
                         timeline=self.timeline, step=step, work=freed)
    driver = eng.make_driver(eng.engine(m), eng.params_for(self.params, m),
                             self.version, reply=self.episodes)
    return driver, ctl

  def _learn_lengths(self, requests, samples) -> float:
    """Folds the lengths into the history; the mean relative error of the
    predictions (made before this batch)."""
    predicted = {r.prompt_id: self.predicted(r) for r in requests}
    by_prompt: dict[int, list[int]] = {}
    for s in samples:
      by_prompt.setdefault(s.prompt_id, []).append(len(s.tokens))
    errors = [abs(statistics.fmean(v) - predicted[p]) /
              max(1.0, statistics.fmean(v)) for p, v in by_prompt.items()]
    for p, v in by_prompt.items():
      self.history.update(p, v)
    return statistics.fmean(errors) if errors else 0.0

  def _driver_metrics(self, driver: Driver) -> dict:
    st = driver.stats
    out = {"rollout/steps": st.steps,
           "rollout/prefill_tokens": st.prefill_tokens,
           "rollout/common_prefix_len": st.common_prefix_length,
           "rollout/preemptions": driver.paged.preemptions,
           "rollout/peak_kv_pages": driver.paged.peak_pages,
           "rollout/peak_live_samples": driver.paged.peak_live,
           # A sample's own tokens prefilled again (a preempted one
           # recomputed); earlier turns never are otherwise.
           "rollout/reprefill_tokens": driver.paged.recomputed_tokens}
    if self.episodes is not None:
      out.update(self.episodes.metrics())
      out["rollout/appended_tokens"] = driver.appended_tokens
    return out
