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


def test_segment_a_has_more_capacity_than_b():
  def mean_available(segment):
    events = availability.generate(segment, 8, 7200.0, seed=0)
    alive, area, last = 0, 0.0, 0.0
    for e in events:
      t = min(e.time, 7200.0)
      area += alive * (t - last)
      last = t
      alive += 1 if e.kind == "add" else -1
    return area / 7200.0
  assert mean_available("A") > 2 * mean_available("B")


def test_csv_availability(tmp_path):
  path = tmp_path / "spot.csv"
  path.write_text("time,instance,event\n0,a,add\n5,a,remove\n9,b,add\n"
                  "1,c,remove\n")
  events = availability.load_csv(str(path))
  assert [(e.time, e.iid, e.kind) for e in events] == [
      (0.0, "a", "add"), (5.0, "a", "remove"), (9.0, "b", "add")]
