"""A job's step clock: the phases of its devices on a `Timeline`, and each
RL step's perf/ metrics from those spans.

  clock = StepClock(timeline, devices)
  clock.begin_step(step)
  with clock.span("train"): ...           # all of the job's devices
  perf = clock.end_step(step)             # perf/<phase>_s, step_s, ...

The layout switch (`parallel/colocate.py`) moves weights; this records when
things happened. The rollouts add their own spans (per replica, workers,
an async rollout's devices) on the same timeline.
"""

from __future__ import annotations

from rlhf_jax.timeline import Timeline, device_group


class StepClock:
  """Phase spans of one job's devices and the perf/ metrics of a step."""

  def __init__(self, timeline: Timeline | None, devices):
    """`timeline`: where spans go (an in-memory one by default);
    `devices`: the job's (the group `span` records by default)."""
    self.timeline = timeline if timeline is not None else Timeline(None)
    self.group = device_group("all", devices)

  def now(self) -> float:
    return self.timeline.now()

  def span(self, phase: str, group: str | None = None):
    """Context manager recording `phase` of `group` (default: all devices)."""
    return self.timeline.span(group or self.group, phase)

  def begin_step(self, step: int) -> None:
    self.timeline.begin_step(step)

  def phase_seconds(self, step: int, phase: str = "train") -> float | None:
    """Seconds of the step's `phase` spans (None when it has none)."""
    return sum(x.duration for x in self.timeline.step_spans(step)
               if x.phase == phase) or None

  def end_step(self, step: int) -> dict:
    """Closes the step on the timeline; returns its perf/ metrics."""
    perf = self.timeline.end_step(step)
    spans = [s for s in self.timeline.step_spans(step) if s.phase != "idle"]
    for phase in ("rollout", "scoring", "train"):
      perf[f"perf/{phase}_s"] = sum(s.duration for s in spans
                                    if s.phase == phase)
    perf["perf/step_s"] = (max(s.end for s in spans) -
                           min(s.start for s in spans)) if spans else 0.0
    device_s = self.timeline.device_seconds(step)
    total = sum(device_s.values())
    for phase, seconds in device_s.items():  # Of the devices' step time.
      perf[f"perf/device_fraction/{phase}"] = seconds / total if total else 0.0
    return perf
