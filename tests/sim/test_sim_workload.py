"""Length workloads and spot availability traces."""

import dataclasses

import numpy as np
import pytest

from rlhf_jax.sim import availability
from rlhf_jax.sim.workload import Workload, WorkloadSpec, write_trace

SPEC = WorkloadSpec(prompts_per_step=64, group_size=8, dataset_prompts=128,
                    median_len=500.0, sigma=1.0, max_len=2048)


def _lengths(batch):
  by_prompt = {}
  for p, _, _, n in batch.samples:
    by_prompt.setdefault(p, []).append(n)
  return by_prompt


def test_cap_tail_and_shape():
  batch = Workload(SPEC).batch(0)
  lengths = np.array([n for *_, n in batch.samples])
  assert len(lengths) == 64 * 8
  assert lengths.max() <= 2048 and lengths.min() >= 1
  assert (lengths == 2048).any()  # a long tail hits the cap.
  assert np.mean(lengths) > np.median(lengths)  # right-skewed.


def test_group_and_epoch_correlation():
  w = Workload(SPEC)
  epoch0 = {**_lengths(w.batch(0)), **_lengths(w.batch(1))}
  epoch1 = {**_lengths(w.batch(2)), **_lengths(w.batch(3))}
  prompts = sorted(epoch0)
  a = [np.log(np.mean(epoch0[p])) for p in prompts]
  b = [np.log(np.mean(epoch1[p])) for p in prompts]
  assert np.corrcoef(a, b)[0, 1] > 0.5  # what EWMA ranking relies on.
  # Within-group variance is below the total variance.
  logs = [np.log(v) for v in epoch0.values()]
  within = np.mean([np.var(x) for x in logs])
  assert within < np.var(np.concatenate(logs))
  uncorrelated = Workload(dataclasses.replace(SPEC, epoch_corr=0.0,
                                              group_corr=0.0))
  c = _lengths(uncorrelated.batch(2))
  d = _lengths(uncorrelated.batch(0))
  common = sorted(set(c) & set(d))
  r = np.corrcoef([np.mean(c[p]) for p in common],
                  [np.mean(d[p]) for p in common])[0, 1]
  assert abs(r) < 0.4


def test_drift_raises_lengths():
  w = Workload(dataclasses.replace(SPEC, drift=0.05, max_len=10**6))
  early = np.mean([n for *_, n in w.batch(0).samples])
  late = np.mean([n for *_, n in w.batch(20).samples])
  assert late > 1.5 * early


def test_csv_trace_round_trip(tmp_path):
  w = Workload(SPEC)
  path = str(tmp_path / "trace.csv")
  write_trace(path, [w.batch(0), w.batch(1)])
  replay = Workload(dataclasses.replace(SPEC, trace_csv=path))
  assert replay.batch(0).samples == w.batch(0).samples
  assert replay.batch(1).samples == w.batch(1).samples


@pytest.mark.parametrize("segment", ["A", "B", "C"])
def test_generated_segments_are_consistent(segment):
  events = availability.generate(segment, 8, 7200.0, seed=0)
  present = set()
  for e in events:
    if e.kind == "add":
      assert e.iid not in present
      present.add(e.iid)
    else:
      assert e.iid in present
      present.remove(e.iid)
  assert any(e.kind == "remove" for e in events)


def _mean_alive(events, duration):
  alive, area, last = 0, 0.0, 0.0
  for e in events:
    t = min(e.time, duration)
    area += alive * (t - last)
    last = t
    alive += 1 if e.kind == "add" else -1
  return (area + alive * (duration - last)) / duration


def test_generated_segments_keep_the_measured_availability():
  """The A, B, C segments at the RLBoost pool (19) average the alive
  fraction measured in Bamboo's trace windows (16.0, 9.0 and 13.3 of 19
  instances; docs/sim.md) to within 0.1, over 5 seeds."""
  measured = dict(A=16.0 / 19, B=9.0 / 19, C=13.3 / 19)
  got = {s: np.mean([_mean_alive(availability.generate(s, 19, 7200.0, k),
                                 7200.0) / 19 for k in range(5)])
         for s in "ABC"}
  assert got["A"] > got["C"] > got["B"]
  for s in "ABC":
    assert abs(got[s] - measured[s]) < 0.1, (s, got[s], measured[s])


def _bamboo_file(tmp_path, rows):
  path = tmp_path / "trace.csv"
  path.write_text("".join(f"{ms},{kind},{node}\n" for ms, kind, node in rows))
  return str(path)


def test_bamboo_trace_keeps_whole_histories_of_a_sample(tmp_path):
  rows = [(0, "add", f"node{i}") for i in range(10)]
  rows += [(1000 * (i + 1), "remove", f"node{i}") for i in range(10)]
  rows += [(20000 + i, "add", f"node{i}") for i in range(10)]
  events = availability.load_bamboo(_bamboo_file(tmp_path, rows), 0.5, 3)
  nodes = {e.iid for e in events}
  assert len(nodes) == 5
  for node in nodes:  # Its three events, in seconds.
    i = int(node[4:])
    assert [(e.time, e.kind) for e in events if e.iid == node] == [
        (0.0, "add"), (i + 1.0, "remove"), (20.0 + i / 1000, "add")]
  ours = tmp_path / "ours.csv"  # The header of `load_csv`'s format.
  ours.write_text("time,instance,event\n0,a,add\n")
  with pytest.raises(ValueError, match="not a Bamboo trace"):
    availability.load_bamboo(str(ours))


def test_bamboo_segments_by_mean_availability(tmp_path):
  """Five 2-hour windows with 4, 1, 3, 2 and 5 instances alive: A is the
  last, B the second, C the median (3 alive), each from time 0."""
  hour = 3600 * 1000
  counts = [4, 1, 3, 2, 5]
  rows, alive = [], []
  for w, n in enumerate(counts):
    t = 2 * hour * w
    for node in alive:
      rows.append((t, "remove", node))
    alive = [f"w{w}n{i}" for i in range(n)]
    rows += [(t, "add", node) for node in alive]
  rows.append((10 * hour + 1000, "remove", alive[0]))
  events = availability.load_bamboo(_bamboo_file(tmp_path, rows), 1.0)
  segments = availability.bamboo_segments(events)
  assert {k: t / 7200 for k, (t, _) in segments.items()} == dict(
      A=4.0, B=1.0, C=2.0)
  for k, n in dict(A=5, B=1, C=3).items():
    assert _mean_alive(segments[k][1], 7200.0) == n
    assert all(e.time == 0.0 for e in segments[k][1] if e.kind == "add")
  with pytest.raises(ValueError, match="has 1 whole 2-hour windows"):
    availability.bamboo_segments(availability.window(events, 0, 3 * 3600))


def test_segment_params_measure_level_preemption_and_replacement():
  """Alive 2, 1, 2 over [0, 1000), [1000, 1600), [1600, 2000): mean 1.7,
  sd sqrt(0.21); one remove (mttp 1.7 x 2000 s) replaced after 600 s."""
  events = [availability.SpotEvent(0.0, "a", "add"),
            availability.SpotEvent(0.0, "b", "add"),
            availability.SpotEvent(1000.0, "a", "remove"),
            availability.SpotEvent(1600.0, "c", "add")]
  level, mttp, delay = availability.segment_params(events, 2000.0, 2)
  sd = np.sqrt(0.21)
  assert level == pytest.approx(((1.7 - np.sqrt(3) * sd) / 2, 1.0))
  assert mttp == pytest.approx(3400.0)
  assert delay == (600.0, 600.0)
  # The adds at time 0 replace nothing; a remove after `duration` counts not.
  late = events + [availability.SpotEvent(2500.0, "b", "remove"),
                   availability.SpotEvent(2600.0, "d", "add")]
  assert list(availability.replacement_waits(late, 2000.0)) == [600.0]
  assert list(availability.replacement_waits(late, 3000.0)) == [600.0, 100.0]


def test_csv_availability(tmp_path):
  path = tmp_path / "spot.csv"
  path.write_text("time,instance,event\n0,a,add\n5,a,remove\n9,b,add\n"
                  "1,c,remove\n")
  events = availability.load_csv(str(path))
  assert [(e.time, e.iid, e.kind) for e in events] == [
      (0.0, "a", "add"), (5.0, "a", "remove"), (9.0, "b", "add")]


def test_spot_trace_forms(tmp_path):
  from rlhf_jax.sim import runner
  path = tmp_path / "ours.csv"
  path.write_text("time,instance,event\n0,a,add\n5,a,remove\n")
  assert runner.spot_trace(f"csv:{path}", 0, 0.0, 0) == (
      availability.load_csv(str(path)))
  with pytest.raises(ValueError, match="needs the Bamboo trace"):
    runner.spot_trace("bamboo:A", 0, 0.0, 0)
  hour = 3600 * 1000
  bamboo = _bamboo_file(tmp_path, [(0, "add", "n0"), (3 * hour, "add", "n1"),
                                   (7 * hour, "add", "n2"),
                                   (7 * hour + 1, "remove", "n2")])
  events = availability.load_bamboo(bamboo, 1.0)
  assert runner.spot_trace("bamboo:B", 0, 0.0, 0, bamboo, 1.0) == (
      availability.bamboo_segments(events)["B"][1])
