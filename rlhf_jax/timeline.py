"""A device timeline: which device group did what, when, in every step.

Spans are (device group, phase, start, end, step) host wall-clock records
taken at phase boundaries (each phase ends with its results ready, so host
time brackets the device work). Within a step, the time a group has no span
is its idle time: closing a step adds explicit `idle` spans for those gaps,
and `perf/idle_s` and `perf/repartition_s` are sums over these same records.

Outputs (process 0 only): `timeline.json`, Chrome/Perfetto trace-event JSON
(opens in ui.perfetto.dev or chrome://tracing; one track per device group),
and `timeline.png`, a matplotlib chart of the same spans. Per step,
`device_seconds` says how many device-seconds went to each phase (which
devices decoded, scored, trained or idled when, the finest span winning).
On resume,
`truncate_after(step)` drops spans of steps after the restored checkpoint, as
the metric writer does, so the file continues the interrupted run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time

PHASES = ("rollout", "scoring", "train", "repartition", "eval", "idle")
COLORS = {"rollout": "#4c72b0", "scoring": "#dd8452", "train": "#55a868",
          "repartition": "#c44e52", "eval": "#8172b3", "idle": "#d0d0d0"}


@dataclasses.dataclass(frozen=True)
class Span:
  group: str      # device group, e.g. "all[0-7]" or "rollout[0-3]"
  phase: str      # one of PHASES
  start: float    # seconds since the timeline origin
  end: float
  step: int

  @property
  def duration(self) -> float:
    return self.end - self.start


def device_group(name: str, devices) -> str:
  """A track name: the group's role and its device ids."""
  ids = sorted(int(d.id) for d in devices)
  contiguous = ids == list(range(ids[0], ids[-1] + 1))
  rng = (f"{ids[0]}-{ids[-1]}" if contiguous and len(ids) > 1
         else ",".join(map(str, ids)))
  return f"{name}[{rng}]"


class Timeline:
  """Collects spans per step; writes trace JSON and PNG into `workdir`."""

  def __init__(self, workdir: str | None = None, *, enabled: bool = True,
               clock=time.time):
    self.enabled = enabled and workdir is not None
    self.json_path = workdir and os.path.join(workdir, "timeline.json")
    self.png_path = workdir and os.path.join(workdir, "timeline.png")
    self.clock = clock
    self.spans: list[Span] = []
    self.groups: list[str] = []
    self.origin = clock()
    self._step = 0
    if self.enabled and os.path.exists(self.json_path):
      self._load()

  def open(self, workdir: str, *, enabled: bool = True) -> None:
    """Writes to `workdir` from now on (the step loop's, once it knows it),
    continuing its `timeline.json` if there is one; spans so far are
    dropped (they belonged to no run)."""
    fresh = Timeline(workdir, enabled=enabled, clock=self.clock)
    self.__dict__.update(fresh.__dict__)

  # ----------------------------------------------------------- recording
  def now(self) -> float:
    return self.clock() - self.origin

  def begin_step(self, step: int) -> None:
    self._step = step

  def add(self, group: str, phase: str, start: float, end: float,
          step: int | None = None) -> Span:
    if phase not in PHASES:
      raise ValueError(f"unknown phase {phase!r}; known: {PHASES}")
    if end < start:
      raise ValueError(f"span {phase} of {group} ends before it starts")
    if group not in self.groups:
      self.groups.append(group)
    span = Span(group, phase, start, end,
                self._step if step is None else step)
    self.spans.append(span)
    return span

  @contextlib.contextmanager
  def span(self, group: str, phase: str):
    """Records the wall time of the `with` body as one span."""
    start = self.now()
    try:
      yield
    finally:
      self.add(group, phase, start, self.now())

  def step_spans(self, step: int) -> list[Span]:
    return [s for s in self.spans if s.step == step]

  def end_step(self, step: int, groups=None) -> dict:
    """Adds idle spans for the step's gaps; returns its perf metrics.

    The step window runs from its first span start to its last span end
    over all groups. `perf/idle_s` is the mean idle time per device group
    (each group's uncovered time in the window, averaged over groups);
    `perf/repartition_s` is the wall time of the step's repartition spans.
    """
    spans = [s for s in self.step_spans(step) if s.phase != "idle"]
    if not spans:
      return {"perf/idle_s": 0.0, "perf/repartition_s": 0.0}
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    groups = list(groups or dict.fromkeys(s.group for s in spans))
    idle = []
    for g in groups:
      cursor, total = t0, 0.0
      for s in sorted((s for s in spans if s.group == g),
                      key=lambda s: s.start):
        if s.start > cursor:
          self.add(g, "idle", cursor, s.start, step)
          total += s.start - cursor
        cursor = max(cursor, s.end)
      if t1 > cursor:
        self.add(g, "idle", cursor, t1, step)
        total += t1 - cursor
      idle.append(total)
    rep = _union([(s.start, s.end) for s in spans
                  if s.phase == "repartition"])
    return {"perf/idle_s": sum(idle) / len(idle), "perf/repartition_s": rep}

  def device_seconds(self, step: int) -> dict[str, float]:
    """Device-seconds of each phase in the step's window, idle included.

    A device's time goes to the phase of the finest group covering it
    then (a replica's `scoring` span over its whole mesh's `rollout`);
    time no span covers is idle. Groups without device ids are left out.
    """
    spans = [s for s in self.step_spans(step) if group_devices(s.group)]
    if not spans:
      return {}
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    by_device: dict[int, list[Span]] = {}
    for s in spans:
      for d in group_devices(s.group):
        by_device.setdefault(d, []).append(s)
    out = dict.fromkeys(PHASES, 0.0)
    for mine in by_device.values():
      events = sorted({t0, t1, *(s.start for s in mine),
                       *(s.end for s in mine)})
      mine = sorted(mine, key=lambda s: s.start)
      active, i = [], 0
      for a, b in zip(events, events[1:]):
        while i < len(mine) and mine[i].start <= a:
          active.append(mine[i])
          i += 1
        active = [s for s in active if s.end > a]
        cover = min(active, default=None, key=lambda s: (
            len(group_devices(s.group)), -s.start))
        out["idle" if cover is None else cover.phase] += b - a
    return out

  # ---------------------------------------------------------------- files
  def truncate_after(self, step: int) -> None:
    """Drops spans of steps > `step` (recorded before a crash)."""
    self.spans = [s for s in self.spans if s.step <= step]

  def trace(self) -> dict:
    """Chrome trace-event JSON: one complete ("X") event per span."""
    tids = {g: i for i, g in enumerate(self.groups)}
    events = [{"name": "process_name", "ph": "M", "pid": 0,
               "args": {"name": "rlhf_jax devices"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t,
                "args": {"name": g}} for g, t in tids.items()]
    events += [{"name": s.phase, "cat": s.phase, "ph": "X", "pid": 0,
                "tid": tids[s.group], "ts": round(s.start * 1e6, 1),
                "dur": round(s.duration * 1e6, 1),
                "args": {"step": s.step, "group": s.group}}
               for s in self.spans]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"origin_unix_s": self.origin}}

  def write(self, png: bool = False) -> None:
    if not self.enabled:
      return
    tmp = self.json_path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.trace(), f)
    os.replace(tmp, self.json_path)
    if png:
      self.plot(self.png_path, last_steps=5)

  def plot(self, path: str, last_steps: int | None = None) -> None:
    """A Gantt chart of the spans (of the last steps), one row per group."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = self.spans
    if last_steps and spans:
      last = max(s.step for s in spans)
      spans = [s for s in spans if s.step > last - last_steps]
    t0 = min((s.start for s in spans), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.5 * len(self.groups)))
    for row, g in enumerate(self.groups):
      for phase in PHASES:
        bars = [(s.start - t0, s.duration) for s in spans
                if s.group == g and s.phase == phase]
        if bars:
          ax.broken_barh(bars, (row - 0.4, 0.8), color=COLORS[phase],
                         label=phase)
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend(seen.values(), seen.keys(), loc="center left",
              bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    ax.set_yticks(range(len(self.groups)), self.groups)
    steps = sorted({s.step for s in spans})
    ax.set_xlabel("wall time (s)")
    ax.set_title("device timeline" + (f", steps {steps[0]}-{steps[-1]}"
                                      if steps else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

  def _load(self) -> None:
    with open(self.json_path) as f:
      trace = json.load(f)
    self.origin = trace.get("otherData", {}).get("origin_unix_s", self.origin)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    self.groups = [names[t] for t in sorted(names)]
    for e in trace["traceEvents"]:
      if e["ph"] == "X":
        start = e["ts"] / 1e6
        self.spans.append(Span(names[e["tid"]], e["name"], start,
                               start + e["dur"] / 1e6, e["args"]["step"]))


def group_devices(group: str) -> tuple[int, ...]:
  """The device ids in a track name of `device_group` (() for none)."""
  if not group.endswith("]") or "[" not in group:
    return ()
  ids = []
  for part in group[group.rindex("[") + 1:-1].split(","):
    a, _, b = part.partition("-")
    ids += range(int(a), int(b or a) + 1)
  return tuple(ids)


def _union(intervals) -> float:
  total, end = 0.0, float("-inf")
  for a, b in sorted(intervals):
    if b > end:
      total += b - max(a, end)
      end = b
  return total
