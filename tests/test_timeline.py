"""The device timeline: spans, idle accounting, trace JSON, PNG, resume."""

import json
import os

import pytest

import fakes
from rlhf_jax.timeline import PHASES, Timeline


def _step(tl, clock, step, phases):
  """Records `phases` [(phase, seconds, gap_before)] on group "all[0-7]"."""
  tl.begin_step(step)
  for phase, seconds, gap in phases:
    clock.t += gap
    with tl.span("all[0-7]", phase):
      clock.t += seconds
  return tl.end_step(step)


def test_idle_and_repartition_come_from_the_spans(tmp_path):
  clock = fakes.Clock(100.0)
  tl = Timeline(str(tmp_path), clock=clock)
  perf = _step(tl, clock, 1, [("repartition", 0.5, 0), ("rollout", 2, 0.25),
                              ("repartition", 0.5, 0), ("scoring", 1, 0),
                              ("train", 3, 0.75)])
  assert perf["perf/repartition_s"] == pytest.approx(1.0)
  assert perf["perf/idle_s"] == pytest.approx(1.0)
  idle = [s for s in tl.step_spans(1) if s.phase == "idle"]
  assert [(s.start, s.end) for s in idle] == [(0.5, 0.75), (4.25, 5.0)]
  # A second group that only scores is idle for the rest of the window.
  tl.begin_step(2)
  t0 = tl.now()
  tl.add("rollout[0-3]", "rollout", t0, t0 + 4)
  tl.add("scoring[4-7]", "scoring", t0 + 1, t0 + 2)
  perf = tl.end_step(2)
  assert perf["perf/idle_s"] == pytest.approx((0 + 3) / 2)
  with pytest.raises(ValueError, match="unknown phase"):
    tl.add("all[0-7]", "nap", 0, 1)


def test_trace_json_is_valid_and_resume_truncates(tmp_path):
  clock = fakes.Clock(100.0)
  tl = Timeline(str(tmp_path), clock=clock)
  for step in (1, 2, 3):
    _step(tl, clock, step, [("repartition", 0.1, 0), ("rollout", 1, 0.05),
                            ("scoring", 0.5, 0), ("train", 1, 0)])
  tl.write(png=True)
  with open(tmp_path / "timeline.json") as f:
    trace = json.load(f)
  events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
  assert {e["name"] for e in events} <= set(PHASES)
  assert all(e["dur"] >= 0 and e["name"] == e["cat"] for e in events)
  for step in (1, 2, 3):  # Spans of one track never overlap within a step.
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e["args"]["step"] == step)
    assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:]))
  names = [e["args"]["name"] for e in trace["traceEvents"]
           if e["name"] == "thread_name"]
  assert names == ["all[0-7]"]
  assert os.path.getsize(tmp_path / "timeline.png") > 1000

  # Resume after step 2: step 3's spans go, new ones append after them.
  clock.t += 10
  resumed = Timeline(str(tmp_path), clock=clock)
  assert len(resumed.spans) == len(tl.spans)
  resumed.truncate_after(2)
  assert max(s.step for s in resumed.spans) == 2
  _step(resumed, clock, 3, [("rollout", 1, 0)])
  resumed.write()
  with open(tmp_path / "timeline.json") as f:
    again = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
  assert [e["args"]["step"] for e in again].count(3) == 1
  assert max(e["ts"] for e in again) > max(e["ts"] for e in events)


def test_disabled_timeline_records_but_writes_nothing(tmp_path):
  clock = fakes.Clock(100.0)
  tl = Timeline(str(tmp_path), enabled=False, clock=clock)
  _step(tl, clock, 1, [("train", 1, 0)])
  tl.write(png=True)
  assert tl.spans and not os.listdir(tmp_path)


def test_device_seconds_take_the_finest_span():
  """4 devices, one step: the mesh decodes 0-10 and trains 10-12; replica 2
  scores at 6-8 and replica 3 idles from 5 inside the mesh's rollout span;
  a track without device ids is left out. By hand: rollout 10 + 10 + 8 + 5,
  scoring 2, idle 5, train 4 x 2; 48 device-seconds in all."""
  t = Timeline(None)
  t.begin_step(1)
  t.add("all[0-3]", "rollout", 0.0, 10.0)
  t.add("replica2[2]", "scoring", 6.0, 8.0)
  t.add("replica3[3]", "idle", 5.0, 10.0)
  t.add("all[0-3]", "train", 10.0, 12.0)
  t.add("workers", "rollout", 0.0, 30.0)
  got = t.device_seconds(1)
  assert got["rollout"] == pytest.approx(33.0)
  assert got["scoring"] == pytest.approx(2.0)
  assert got["idle"] == pytest.approx(5.0)
  assert got["train"] == pytest.approx(8.0)
  assert sum(got.values()) == pytest.approx(48.0)
