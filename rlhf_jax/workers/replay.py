"""Replays a spot availability trace against live workers.

The trace is the simulator's (`sched/spot.SpotEvent`: time, instance,
add | remove), so a live run and a simulated run can face the same joins
and preemptions. Installed as the manager's `on_poll` hook: before each poll
round, every event whose (scaled) time has come is applied: `add` starts a
worker through `spawn(instance_id)` and joins it, `remove` kills it (the
manager sees a dead worker at its next call, as with a real preemption).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from rlhf_jax.sched.spot import SpotEvent


class AvailabilityReplayer:
  """Applies `events` to a `RolloutManager` as wall time passes."""

  def __init__(self, events: Sequence[SpotEvent], spawn: Callable[[str], object],
               *, seconds_per_trace_second: float = 1.0, clock=time.perf_counter):
    self.events = sorted(events, key=lambda e: e.time)
    self.spawn, self.scale, self.clock = spawn, seconds_per_trace_second, clock
    self.start: float | None = None
    self.next = 0
    self.handles: dict[str, object] = {}
    self.alive_since: dict[str, float] = {}
    self.worker_seconds = 0.0
    self.applied: list[tuple[float, SpotEvent]] = []

  def __call__(self, manager) -> None:
    now = self.clock()
    if self.start is None:
      self.start = now
    while (self.next < len(self.events) and
           self.events[self.next].time * self.scale <= now - self.start):
      event = self.events[self.next]
      self.next += 1
      if event.kind == "add" and event.iid not in self.handles:
        handle = self.spawn(event.iid)
        self.handles[event.iid] = handle
        self.alive_since[event.iid] = now
        manager.add(handle)
      elif event.kind == "remove" and event.iid in self.handles:
        self.handles.pop(event.iid).kill()
        self.worker_seconds += now - self.alive_since.pop(event.iid)
      else:
        continue
      self.applied.append((now - self.start, event))

  def close(self) -> float:
    """Stops the clock of every worker still alive; total worker-seconds."""
    now = self.clock()
    for iid in list(self.alive_since):
      self.worker_seconds += now - self.alive_since.pop(iid)
    return self.worker_seconds
