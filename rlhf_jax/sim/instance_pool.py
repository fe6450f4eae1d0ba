"""The elastic pool of remote instances: availability and billing.

An instance is *present* when the availability trace says it exists, and
*acquired* while a policy holds it (billed per second from acquisition to
release or preemption). Billing intervals are kept so any time window can be
charged exactly.
"""

from rlhf_jax.sim.availability import SpotEvent


class RemotePool:
  """Replays an availability trace and records who held what, when."""

  def __init__(self, events: list[SpotEvent], price_per_s: float):
    self.events = list(events)
    self.cursor = 0
    self.present = []  # insertion order = acquisition preference
    self.acquired = {}  # iid -> acquisition time
    self.intervals = []  # closed (iid, start, end)
    self.price_per_s = price_per_s

  def next_time(self) -> float:
    if self.cursor < len(self.events):
      return self.events[self.cursor].time
    return float("inf")

  def pop(self) -> SpotEvent:
    """Applies the next trace event to the presence set and returns it."""
    event = self.events[self.cursor]
    self.cursor += 1
    if event.kind == "add":
      self.present.append(event.iid)
    elif event.iid in self.present:
      self.present.remove(event.iid)
    return event

  def preempt_at(self, t: float, count: int, readd_every_s: float = 0.0):
    """Schedules removal of `count` instances present now (a fault burst);
    with `readd_every_s`, a substitute for each arrives one at a time, that
    many seconds apart after the burst."""
    victims = list(self.present)[:count]
    burst = [SpotEvent(t, iid, "remove") for iid in victims]
    if readd_every_s > 0:
      burst += [SpotEvent(t + k * readd_every_s, f"{iid}.sub", "add")
                for k, iid in enumerate(victims, start=1)]
    pending = self.events[self.cursor:] + burst
    pending.sort(key=lambda e: (e.time, e.kind != "remove", e.iid))
    self.events = self.events[:self.cursor] + pending

  def apply_until(self, t: float) -> list[SpotEvent]:
    """Applies every event up to time t; returns them."""
    applied = []
    while self.next_time() <= t:
      applied.append(self.pop())
    return applied

  def idle_present(self) -> list[str]:
    return [i for i in self.present if i not in self.acquired]

  def acquire(self, iid: str, t: float):
    self.acquired[iid] = t

  def release(self, iid: str, t: float):
    start = self.acquired.pop(iid)
    self.intervals.append((iid, start, t))

  def cost(self, t0: float, t1: float) -> float:
    """Dollars billed for instance time inside [t0, t1]."""
    held = self.held_seconds(t0, t1)
    return held * self.price_per_s

  def held_seconds(self, t0: float, t1: float) -> float:
    spans = list(self.intervals)
    spans += [(i, s, t1) for i, s in self.acquired.items()]
    return sum(max(0.0, min(end, t1) - max(start, t0))
               for _, start, end in spans)
