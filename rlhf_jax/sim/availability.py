"""Spot / preemptible availability traces: (time, instance, add|remove).

The RLBoost evaluation replays 2-hour segments of the Bamboo spot trace; the
trace itself is not public here, so `generate` produces segments with the
two properties the paper describes: A = high availability with many
preempt-and-immediately-replace spikes, B = frequent preemption and low
availability, C = in between. Real traces load from CSV (time,instance,event).
"""

import csv
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SpotEvent:
  time: float
  iid: str
  kind: str  # 'add' | 'remove'


# Per segment: (availability level range as a fraction of max instances,
# mean seconds between preemptions of one instance, replacement delay range
# in seconds, seconds between level changes). Chosen to match the
# qualitative description in RLBoost section 6.1 ([U]: Table 5 is an image).
_SEGMENTS = {
    "A": ((0.85, 1.0), 1800.0, (5.0, 60.0), 1200.0),
    "B": ((0.15, 0.5), 900.0, (300.0, 1200.0), 900.0),
    "C": ((0.5, 0.85), 2400.0, (60.0, 300.0), 1200.0),
}


def static(n: int) -> list[SpotEvent]:
  """n instances present from t=0, never preempted."""
  return [SpotEvent(0.0, f"spot{i}", "add") for i in range(n)]


def generate(segment: str, max_instances: int, duration_s: float,
             seed: int = 0) -> list[SpotEvent]:
  """Synthetic segment with churn and availability-level changes.

  Args:
    segment: 'A', 'B' or 'C'.
    max_instances: pool size at full availability.
    duration_s: trace length.
    seed: random seed.

  Returns:
    Events sorted by time.
  """
  (lo, hi), mttp, (rep_lo, rep_hi), period = _SEGMENTS[segment]
  rng = np.random.default_rng((seed, ord(segment)))
  events, alive, counter = [], {}, 0

  def add(t):
    nonlocal counter
    iid = f"spot{counter}"
    counter += 1
    alive[iid] = t + rng.exponential(mttp)
    events.append(SpotEvent(t, iid, "add"))

  t = 0.0
  while t < duration_s:
    target = max(1, round(rng.uniform(lo, hi) * max_instances))
    while len(alive) < target:
      add(t if not events else t + rng.uniform(rep_lo, rep_hi))
    while len(alive) > target:
      iid = max(alive, key=lambda k: (alive[k], k))
      alive.pop(iid)
      events.append(SpotEvent(t, iid, "remove"))
    end = t + period
    for iid, t_pre in sorted(alive.items(), key=lambda kv: kv[1]):
      if t_pre < end:
        alive.pop(iid)
        events.append(SpotEvent(t_pre, iid, "remove"))
        add(t_pre + rng.uniform(rep_lo, rep_hi))
    t = end
  events.sort(key=lambda e: (e.time, e.kind != "remove", e.iid))
  return _consistent(events)


def _consistent(events: list[SpotEvent]) -> list[SpotEvent]:
  """Drops removes of instances not (yet) present after sorting."""
  present, out = set(), []
  for e in events:
    if e.kind == "add":
      present.add(e.iid)
      out.append(e)
    elif e.iid in present:
      present.discard(e.iid)
      out.append(e)
  return out


def load_csv(path: str) -> list[SpotEvent]:
  """Reads a trace with columns time,instance,event (add|remove)."""
  with open(path) as f:
    rows = [SpotEvent(float(r["time"]), r["instance"], r["event"])
            for r in csv.DictReader(f)]
  return _consistent(sorted(rows, key=lambda e: (e.time, e.iid)))
