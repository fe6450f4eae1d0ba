"""Spot / preemptible availability traces: (time, instance, add|remove).

The RLBoost evaluation replays 2-hour segments of the Bamboo spot trace.
That trace is public but not in this repository: `load_bamboo` and
`bamboo_segments` cut its windows when given the file, and `generate`
produces A, B and C segments whose level, preemption rate and replacement
delay were measured from those windows (`segment_params`). Other traces
load from CSV (time,instance,event).
"""

import csv
import os

import numpy as np

from rlhf_jax.errors import DataError, MissingInputError
from rlhf_jax.sched.spot import SpotEvent


# Per segment: (availability level range as a fraction of max instances,
# mean seconds between preemptions of one instance, replacement delay range
# in seconds, seconds between level changes). The first three are measured
# from the trace RLBoost replays (Bamboo's p3 trace, half its instances,
# sample seed 0: `load_bamboo`, `bamboo_segments`, `segment_params`; 19
# instances at most, the pool of `configs/sim/rlboost_common.py`); A is its
# 0-2 h window, B 8-10 h, C 4-6 h. The period between level changes is not
# a property of the trace: [U], as chosen before (docs/sim.md).
_SEGMENTS = {
    "A": ((0.640, 1.0), 7189.0, (165.0, 600.0), 1200.0),
    "B": ((0.256, 0.689), 3805.0, (420.0, 660.0), 900.0),
    "C": ((0.481, 0.923), 6400.0, (120.0, 630.0), 1200.0),
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
  if not os.path.isfile(path):
    raise MissingInputError(f"no spot trace at {path}")
  with open(path) as f:
    rows = [SpotEvent(float(r["time"]), r["instance"], r["event"])
            for r in csv.DictReader(f)]
  return _consistent(sorted(rows, key=lambda e: (e.time, e.iid)))


# ------------------------------------------- the Bamboo trace, as RLBoost
# RLBoost section 6.1: the real spot trace of Bamboo (NSDI'23), 50% of its
# instances sampled at random with their whole allocate/preempt history, cut
# into 2-hour segments; A "high availability with many preempt-and-
# immediately-replace spikes", B "frequent preemption and low availability".
# Bamboo publishes it (github.com/uclasystem/bamboo, traces/p3-trace.csv:
# rows `milliseconds,add|remove,node`, ~11.4 h); it is not in this
# repository. Which 2-hour segments the paper took is in its Table 5, an
# image; `bamboo_segments` picks them by a stated rule instead.
def load_bamboo(path: str, sample: float = 0.5, seed: int = 0
                ) -> list[SpotEvent]:
  """Bamboo's trace (`ms,add|remove,node`, no header) in seconds, keeping
  the whole history of a random `sample` fraction of its nodes."""
  if not os.path.isfile(path):
    raise MissingInputError(f"no Bamboo spot trace at {path} (traces/"
                            "p3-trace.csv of github.com/uclasystem/bamboo)")
  with open(path) as f:
    rows = [r for r in csv.reader(f) if r]
  try:
    events = [SpotEvent(int(ms) / 1000.0, node, kind)
              for ms, kind, node in rows]
  except ValueError as e:
    raise DataError(f"{path}: not a Bamboo trace (rows of "
                    f"milliseconds,add|remove,node): {e}") from None
  if any(e.kind not in ("add", "remove") for e in events):
    raise DataError(f"{path}: events must be 'add' or 'remove'")
  nodes = sorted({e.iid for e in events})
  rng = np.random.default_rng(seed)
  kept = set(rng.choice(nodes, size=round(sample * len(nodes)),
                        replace=False))
  return _consistent(sorted((e for e in events if e.iid in kept),
                            key=lambda e: (e.time, e.iid)))


def window(events: list[SpotEvent], start: float, duration: float
           ) -> list[SpotEvent]:
  """The events of [start, start + duration) from time 0: the instances
  alive at `start` are added at 0."""
  alive = set()
  for e in events:
    if e.time >= start:
      break
    (alive.add if e.kind == "add" else alive.discard)(e.iid)
  out = [SpotEvent(0.0, iid, "add") for iid in sorted(alive)]
  out += [SpotEvent(e.time - start, e.iid, e.kind) for e in events
          if start <= e.time < start + duration]
  return _consistent(out)


def _alive_spans(events: list[SpotEvent], duration: float) -> np.ndarray:
  """[n, 2]: (instances alive, seconds) of each span of [0, duration)."""
  alive, last, spans = 0, 0.0, []
  for e in events:
    spans.append((alive, min(e.time, duration) - last))
    last = min(e.time, duration)
    alive += 1 if e.kind == "add" else -1
  spans.append((alive, duration - last))
  return np.array(spans, dtype=float)


def mean_alive(events: list[SpotEvent], duration: float) -> float:
  """Time-weighted mean count of alive instances over [0, duration)."""
  counts, seconds = _alive_spans(events, duration).T
  return float(np.average(counts, weights=seconds))


def bamboo_segments(events: list[SpotEvent], hours: float = 2.0
                    ) -> dict[str, tuple[float, list[SpotEvent]]]:
  """{A, B, C: (start second, the segment's events)}: the trace cut into
  whole back-to-back windows of `hours` from its start; A the one with the
  most instances alive on average, B the fewest, C the median one."""
  length = hours * 3600.0
  count = int(events[-1].time // length) if events else 0
  if count < 3:
    raise DataError(f"a trace of {events[-1].time if events else 0:.0f} s "
                    f"has {count} whole {hours:g}-hour windows; A, B and C "
                    "need 3")
  windows = sorted((mean_alive(window(events, i * length, length), length),
                    i * length) for i in range(count))
  pick = dict(A=windows[-1][1], B=windows[0][1],
              C=windows[(count - 1) // 2][1])
  return {k: (t, window(events, t, length)) for k, t in pick.items()}


def segment_params(events: list[SpotEvent], duration: float, pool: int
                   ) -> tuple[tuple[float, float], float, tuple[float, float]]:
  """`generate`'s parameters measured from one trace segment (from time 0):
  the level range, a uniform draw with the time-weighted mean and standard
  deviation of alive / pool (mean -/+ sqrt(3) sd, clipped to [0, 1]); the
  mean seconds to preemption of one instance (mean alive x duration /
  removes); the replacement delay range, the quartiles of the wait from a
  remove to the next add."""
  counts, seconds = _alive_spans(events, duration).T
  mean = np.average(counts, weights=seconds)
  sd = np.sqrt(np.average((counts - mean) ** 2, weights=seconds))
  level = tuple(float(np.clip((mean + k * np.sqrt(3) * sd) / pool, 0, 1))
                for k in (-1, 1))
  removes = sum(e.kind == "remove" and e.time < duration for e in events)
  waits = replacement_waits(events, duration)
  if not removes or not len(waits):
    raise DataError("a segment without a remove followed by an add has no "
                    "preemption or replacement to measure")
  mttp = float(mean * duration / removes)
  return level, mttp, tuple(float(q) for q in np.percentile(waits, [25, 75]))


def replacement_waits(events: list[SpotEvent], duration: float
                      ) -> np.ndarray:
  """Seconds from each remove before `duration` to the next add after it
  (the instances alive at time 0 are not replacements)."""
  adds = np.array([e.time for e in events if e.kind == "add" and e.time > 0])
  return np.array([adds[adds >= e.time][0] - e.time for e in events
                   if e.kind == "remove" and e.time < duration
                   and (adds >= e.time).any()])
