"""Rollout workers held to demand (RLHFless scale-to-demand).

Two sets of workers:
  available  what the cloud or a spot trace offers: `offer(id, spawn)` is
             capacity that can be started (again) at will, `add(handle)` one
             running instance (what `replay.AvailabilityReplayer` joins when
             the pool stands in for its manager);
  held       started for the `RolloutManager` and billed; a held worker
             joins the manager once it answers its first call (`ready`).
`hold(n)` releases the newest held workers beyond n (`manager.remove`: their
unfinished work continues on the others, then `handle.kill()`: a Ray actor
is killed, an in-process worker just stops being used; a released `add`ed
instance goes back to the cloud and is no longer available) and acquires
available ones up to n. Billing is per second while held: a released or
dead worker stops counting. An acquired worker is started and joins when
it answers (checked at every `hold` and, as the manager's `on_poll` hook,
every poll round; waited for only when the manager has no worker at all):
that start-up is measured (`spawn_s`) and billed.

`choose_worker_count` is the cost-aware count (`sched.actor_scaling`, the
RLHFless reconstruction of seeds.md section 1.2); `DemandScaler` is the
per-rollout glue the elastic trainer calls: predict lengths, choose, hold,
then learn the lengths and the measured step time.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

from absl import logging

from rlhf_jax.sched import actor_scaling, offload
from rlhf_jax.sched.length_history import LengthHistory
from rlhf_jax.workers.manager import WorkerDied

SCALES = ("all", "cost")


class WorkerPool:
  """Available vs held workers of one manager; worker-seconds while held."""

  def __init__(self, manager, *, clock: Callable[[], float] = time.perf_counter,
               source: Callable[["WorkerPool"], None] | None = None):
    """`source(pool)` runs before each poll round when the pool is the
    manager's `on_poll` hook (an `AvailabilityReplayer`: its joins become
    offers)."""
    self.manager, self.clock, self.source = manager, clock, source
    self._offers: dict[str, Callable[[], Any]] = {}  # Available, in order.
    self._instances: dict[str, Any] = {}  # `add`ed offers: the one handle.
    self.held: dict[str, Any] = {}        # Joined and billed, oldest first.
    self._since: dict[str, float] = {}
    self._billed = 0.0
    self._recorded = 0.0
    self.target: int | None = None
    self.records: list[dict] = []
    self.startups: list[float] = []  # Seconds from spawn() to ready.
    # Per worker, its newest handle's (handle, steps, secs) when it was
    # ready: the baseline of its first rollout (`DemandScaler._measure`).
    self.spawned: dict[str, tuple[Any, int, float]] = {}
    # Held workers not ready yet: (handle, first call, spawned at).
    self._starting: dict[str, tuple[Any, Any, float]] = {}

  # -------------------------------------------------------------- supply
  def offer(self, worker_id: str, spawn: Callable[[], Any]) -> None:
    """Capacity that `spawn()` starts as a handle whenever it is held."""
    self._offers[worker_id] = spawn

  def add(self, handle) -> None:
    """One running instance is available (the replayer's `manager.add`)."""
    self._instances[handle.worker_id] = handle
    self._offers[handle.worker_id] = lambda: handle
    self._top_up(self.clock())

  @property
  def available(self) -> int:
    """Workers that could be held now (the held ones included)."""
    self._settle(self.clock())
    return len(self._offers)

  # ------------------------------------------------------------- holding
  def hold(self, n: int) -> int:
    """Holds n workers (fewer if fewer are available); returns how many."""
    if n < 0:
      raise ValueError(f"cannot hold {n} workers")
    now = self.clock()
    self.target = n
    self._settle(now)
    for wid in list(self.held)[n:][::-1]:  # Newest first.
      self._release(wid, now)
    self._top_up(now)
    return len(self.held)

  def __call__(self, manager) -> None:
    """A manager `on_poll` hook: the source's events, deaths, top-up."""
    del manager
    if self.source is not None:
      self.source(self)
    now = self.clock()
    self._settle(now)
    self._top_up(now)

  @property
  def spawn_s(self) -> float:
    """Median seconds from spawn() to ready (0 before any was measured).

    Ready is the first call answered: a Ray actor's process has started,
    imported JAX and built its engine (compilation happens at its first
    rollout: `DemandScaler.compile_s`); an in-process worker is ready at
    once.
    """
    return statistics.median(self.startups) if self.startups else 0.0

  @property
  def worker_seconds(self) -> float:
    """Seconds billed so far, the held workers' running time included."""
    now = self.clock()
    return self._billed + sum(now - t for t in self._since.values())

  def record(self, **fields) -> dict:
    """Appends and returns {held, worker_s since the last record, fields}."""
    total = self.worker_seconds
    rec = {"held": len(self.held), "worker_s": total - self._recorded,
           **fields}
    self._recorded = total
    self.records.append(rec)
    return rec

  def close(self) -> float:
    """Releases every held worker; total worker-seconds."""
    self.hold(0)
    return self._billed

  # ------------------------------------------------------------- private
  def _bill(self, wid: str, now: float) -> None:
    self._billed += now - self._since.pop(wid)

  def _release(self, wid: str, now: float) -> None:
    handle = self.held.pop(wid)
    self._starting.pop(wid, None)
    self.manager.remove(wid)  # Its unfinished work continues elsewhere.
    handle.kill()             # A Ray actor ends; a local one goes unused.
    self._bill(wid, now)
    self._drop_instance(wid)

  def _drop_instance(self, wid: str) -> None:
    if self._instances.pop(wid, None) is not None:
      del self._offers[wid]  # That instance is gone from the cloud.

  def _settle(self, now: float) -> None:
    """Dead held workers stop billing now; dead offered instances leave."""
    for wid, handle in list(self.held.items()):
      if not handle.alive:  # Preempted (the manager requeues its work).
        del self.held[wid]
        self._starting.pop(wid, None)
        self._bill(wid, now)
        self._drop_instance(wid)
    for wid, handle in list(self._instances.items()):
      if not handle.alive and wid not in self.held:
        self._drop_instance(wid)

  def _top_up(self, now: float) -> None:
    """Starts available workers up to the target; admits the ready ones."""
    if self.target is not None:
      for wid, spawn in list(self._offers.items()):
        if len(self.held) >= self.target:
          break
        if wid in self.held or wid in self.manager.handles:
          continue  # A dead one the manager has yet to requeue keeps its id.
        handle = spawn()  # Billed from now: starting is paid for.
        self.held[wid], self._since[wid] = handle, now
        self._starting[wid] = (handle, handle.call_async("counters"), now)
    # The rollout cannot start without a worker: then wait for the first.
    self._admit(block=not any(h.alive for h in self.manager.handles.values()))

  def _admit(self, block: bool = False) -> None:
    """Starting workers that answered their first call join the manager.

    Not waited for (a Ray actor's process start, JAX import and engine
    build take seconds to minutes; the others keep decoding meanwhile),
    except with `block`, which waits for the oldest. A worker silent for
    its handle's `timeout_s` is killed and stops billing; its offer stays
    available.
    """
    for wid, (handle, ready, t0) in list(self._starting.items()):
      if not (block or handle.done(ready)):
        if self.clock() - t0 > handle.timeout_s:
          del self._starting[wid], self.held[wid]
          handle.kill()
          self._bill(wid, self.clock())
        continue
      del self._starting[wid]
      block = False
      try:
        steps, secs = handle.result(ready)
      except WorkerDied:  # Never started: the manager requeues as usual.
        pass
      else:
        self.startups.append(self.clock() - t0)
        self.spawned[wid] = (handle, steps, secs)
      self.manager.add(handle)

  @property
  def ready(self) -> dict[str, Any]:
    """Held workers that joined the manager (not still starting)."""
    return {w: h for w, h in self.held.items() if w not in self._starting}


def predicted_lengths(history: LengthHistory, prompt_ids: Sequence[int],
                      max_new_tokens: int) -> tuple[dict[int, float], dict]:
  """Per prompt, its predicted response length, and how it was predicted.

  A prompt with no history gets the mean prediction of every prompt seen so
  far, or max_new_tokens / 2 when none has been seen (the first rollout).
  """
  default = history.mean(max_new_tokens / 2)
  ids = [int(p) for p in prompt_ids]
  known = sum(history.known(p) for p in ids)
  return ({p: history.predict(p, default) for p in ids},
          {"known_prompts": known, "default_len": default})


def choose_worker_count(lengths: dict[int, float], num_samples: int, *,
                        available: int, slots: int, step_s: float,
                        lam: float, devices_per_worker: int = 1,
                        startup_s: float = 0.0, spawn_s: float = 0.0,
                        held: int = 0) -> tuple[int, dict]:
  """The worker count in 1..available and the policy's {n: (T, C)} table.

  `actor_scaling.choose_actor_count` wants TPOT(b), the decode step time
  with b samples running on one actor. A worker's engine has static
  shapes: a step costs `step_s` whether 1 or all of its `slots` samples
  are live, and samples beyond the slots queue. So TPOT is a step function,
  step_s * ceil(b / slots): b > slots samples share the worker in waves
  (exact for equal lengths; optimistic for mixed ones, since a queued row
  starts only when a whole row frees). Every sample of a prompt gets the
  prompt's predicted length (its G samples share one row). C(n) is the
  policy's busy worker-seconds (each worker until its last sample), not
  what the pool bills (held time): see docs/elastic.md. Holding more than
  the `held` workers starts new ones: they decode `spawn_s` later and are
  billed for it, so a count that is only a little faster is not worth a
  start-up each time it is acquired again.

  Args:
    lengths: prompt id -> predicted response length (decode steps).
    num_samples: samples per prompt.
    available: workers that could be held.
    slots: samples one worker decodes at once.
    step_s: measured seconds per decode step of one worker.
    lam: weight of latency (1: fastest, 0: fewest worker-seconds).
    devices_per_worker: the billing unit of a worker.
    startup_s: per-worker fixed time before decoding (weight pull).
    spawn_s: extra start-up of a worker not held now (start + compile).
    held: workers held now.
  """
  if available < 1 or not lengths:
    return min(1, available), {}
  groups = {p: [max(1.0, float(x))] * num_samples for p, x in lengths.items()}
  step_s = max(step_s, 1e-9)

  def tpot(b: int) -> float:
    return step_s * math.ceil(b / slots)

  return actor_scaling.choose_actor_count(
      groups, range(1, available + 1), tpot, lam, devices_per_worker,
      startup_s, spawn_s, held)


class DemandScaler:
  """Per rollout: choose and hold the worker count, then learn from it.

  scale="all" holds every available worker (no prediction, no extra worker
  calls); scale="cost" runs `choose_worker_count` once a step time has been
  measured (the first rollout of a newly held worker includes compilation
  and is not measured; until then every available worker is held). A
  worker not held now costs `spawn_s` = the pool's spawn-to-ready time +
  `compile_s`, the median excess of a new worker's first rollout over its
  steps at the measured step time.
  """

  def __init__(self, pool: WorkerPool, *, scale: str = "all",
               lam: float = 0.5, slots: int, max_new_tokens: int,
               devices_per_worker: int = 1,
               history: LengthHistory | None = None):
    if scale not in SCALES:
      raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    self.pool, self.scale, self.lam, self.slots = pool, scale, lam, slots
    self.max_new_tokens = max_new_tokens
    self.devices_per_worker = devices_per_worker
    self.history = history if history is not None else LengthHistory()
    self.step_s: float | None = None  # Seconds per decode step, measured.
    self.startup_s = 0.0              # Weight pull per worker, measured.
    self.compiles: list[float] = []   # First-rollout excess per new worker.
    self._counters: dict[str, tuple[Any, int, float]] = {}
    self.decision: dict = {}

  def begin(self, prompt_ids: Sequence[int], num_samples: int,
            version: int = 0, cap: float | None = None) -> dict:
    """Chooses n, holds it; returns the decision and its inputs.

    `cap` bounds the count from above (at least 1 worker), e.g. the seed
    window's N_prem cap (`sched.offload.SeedWindowController.n_prem_cap`).
    """
    available, before = self.pool.available, len(self.pool.held)
    n, inputs = available, {}
    if self.scale == "cost":
      lengths, how = predicted_lengths(self.history, prompt_ids,
                                       self.max_new_tokens)
      inputs = {"lambda": self.lam, "available": available,
                "slots": self.slots, "step_s": self.step_s,
                "startup_s": self.startup_s, "held_before": before,
                "spawn_s": self.pool.spawn_s + self.compile_s,
                "predicted_len_mean": statistics.fmean(lengths.values())
                                      if lengths else 0.0, **how}
      if self.step_s is None:
        inputs["unmeasured"] = True
      else:
        n, table = choose_worker_count(
            lengths, num_samples, available=available, slots=self.slots,
            step_s=self.step_s, lam=self.lam,
            devices_per_worker=self.devices_per_worker,
            startup_s=self.startup_s, spawn_s=inputs["spawn_s"], held=before)
        inputs["table"] = table
    if cap is not None and offload.cap_count(n, cap) < n:
      n, inputs["cap"] = offload.cap_count(n, cap), cap
    held = self.pool.hold(n)
    if self.scale == "cost":
      logging.info("elastic rollout v%d: holding %d of %d available workers "
                   "(chose %d, scale=cost); inputs %s", version, held,
                   available, n, inputs)
    self.decision = {"chosen": n, "held": held, "available": available,
                     "spawned": max(0, held - before), **inputs}
    return self.decision

  def end(self, samples, pull_s: float = 0.0, pulls: int = 0) -> dict:
    """Learns lengths and step time; the rollout's `workers/` metrics."""
    d = self.decision
    metrics = {"workers/held": float(d.get("held", len(self.pool.held))),
               "workers/chosen": float(d.get("chosen", len(self.pool.held))),
               "workers/available": float(d.get("available", 0)),
               "workers/spawned": float(d.get("spawned", 0))}
    if self.scale == "cost":
      by_prompt: dict[int, list[int]] = {}
      for s in samples:
        by_prompt.setdefault(int(s.prompt_id), []).append(len(s.tokens))
      for p, v in by_prompt.items():
        self.history.update(p, v)
      self._measure()
      if pulls:
        self.startup_s = pull_s / pulls
      table = d.get("table", {})
      if table:
        t, c = table[d["chosen"]]
        metrics.update({"workers/predicted_T_s": t,
                        "workers/predicted_C_s": c})
      if d.get("step_s") is not None:
        metrics.update({"workers/step_s": d["step_s"],
                        "workers/startup_s": d["startup_s"]})
      metrics["workers/predicted_len"] = d.get("predicted_len_mean", 0.0)
      metrics["workers/spawn_s"] = d.get("spawn_s", 0.0)
    metrics["workers/worker_s"] = self.pool.record(
        chosen=d.get("chosen"))["worker_s"]
    return metrics

  @property
  def compile_s(self) -> float:
    """Median first-rollout excess of a newly started worker (0 if none)."""
    return statistics.median(self.compiles) if self.compiles else 0.0

  def _measure(self) -> None:
    """Step time: median over held workers of their last rollout's
    seconds per driver step (admission, decode step, host reads); and the
    excess of a new worker's first rollout over its steps at that time."""
    previous, self._counters, rates, firsts = self._counters, {}, [], []
    for wid, handle in self.pool.ready.items():
      try:
        steps, secs = handle.result(handle.call_async("counters"))
      except WorkerDied:
        continue
      self._counters[wid] = (handle, steps, secs)
      old = previous.get(wid)
      if old is not None and old[0] is handle:
        if steps > old[1]:
          rates.append((secs - old[2]) / (steps - old[1]))
        continue
      old = self.pool.spawned.get(wid)  # Its first rollout since spawn().
      if old is not None and old[0] is handle and steps > old[1]:
        firsts.append((steps - old[1], secs - old[2]))
    if rates:
      self.step_s = statistics.median(rates)
    if self.step_s is not None:  # Else unknown: the first rollout of all.
      self.compiles += [max(0.0, s - n * self.step_s) for n, s in firsts]
