"""Fused actor/critic pipeline schedule: evaluator, lower bound, search."""

import math

import pytest

from rlhf_jax.sched import pipeline
from rlhf_jax.sched import pipeline_search

INSTANCES = pipeline.PUBLISHED_INSTANCES


def _check_timing(problem, schedule):
  """Independent validity check: replays the lists and checks every rule."""
  result = pipeline.evaluate(problem, schedule)
  assert math.isfinite(result.makespan)
  tasks = sorted((m, k, f, n) for n, ts in enumerate(schedule)
                 for m, k, f in ts)
  expected = sorted((m, k, f, n) for m in range(problem.n_models)
                    for k in range(problem.micro_batches(m))
                    for n, _, f in problem.chain(m))
  assert tasks == expected  # every (model, micro-batch, stage) exactly once.
  return result


def test_lower_bounds_match_flexfusion():
  # Values printed by FlexFusion's get-lower-bound.py for its 12 instances;
  # instance 0's published trace (results/trace_exp0.txt) ends at 708.
  assert [pipeline.lower_bound(p) for p in INSTANCES] == [
      708, 372, 225, 702, 366, 225, 618, 330, 186, 606, 318, 186]


def test_evaluate_detects_deadlock_and_bad_lists():
  p = pipeline.FusedProblem(2, 2, 1, 1, 1, 1, 1.0, 1.0)
  # Node 0: actor stage 0 fwd, critic bwd last; node 1 mirror.
  good = [[(0, 0, True), (1, 0, True), (1, 0, False), (0, 0, False)],
          [(1, 0, True), (0, 0, True), (0, 0, False), (1, 0, False)]]
  # f=1, b=2: fwds end at 2, first bwds at 4, last bwds at 6.
  assert pipeline.evaluate(p, good).makespan == 6.0
  # Backward before its forward on the same node never becomes ready.
  bad = [[(0, 0, False), (0, 0, True), (1, 0, True), (1, 0, False)],
         good[1]]
  assert pipeline.evaluate(p, bad).makespan == math.inf
  missing = [good[0][:-1], good[1]]
  assert pipeline.evaluate(p, missing).makespan == math.inf


def test_serial_baseline_is_slower_than_bound():
  for p in INSTANCES:
    assert pipeline.serial_1f1b_makespan(p) > pipeline.lower_bound(p)


def test_search_reaches_lower_bound_on_published_instances():
  makespans = []
  for p in INSTANCES:
    result = pipeline_search.search(p)
    evaluation = _check_timing(p, result.schedule)
    assert evaluation.makespan == result.makespan
    assert result.lower_bound == pipeline.lower_bound(p)
    assert result.makespan <= result.greedy_makespan
    makespans.append(result.makespan)
  # Every instance at FlexFusion's lower bound (the values its
  # get-lower-bound.py prints, as in test_lower_bounds_match_flexfusion;
  # docs/sim.md: 12 of 12).
  assert makespans == [708, 372, 225, 702, 366, 225, 618, 330, 186, 606,
                       318, 186]


def test_search_is_deterministic():
  p = INSTANCES[4]
  a, b = pipeline_search.search(p, seed=3), pipeline_search.search(p, seed=3)
  assert a.schedule == b.schedule


def test_memory_pass_never_worsens_makespan():
  p = INSTANCES[2]
  plain = pipeline_search.search(p)
  reduced = pipeline_search.search(p, memory_tries=3)
  assert reduced.makespan == plain.makespan
  assert reduced.peak_mem <= plain.peak_mem + 1e-9


def test_adjacent_swap_annealing_keeps_valid_schedules():
  p = INSTANCES[2]
  start = pipeline_search.search(p, iterations=0).schedule
  best, evaluation = pipeline_search.anneal_swaps(p, start, iterations=200)
  assert evaluation.makespan <= pipeline.evaluate(p, start).makespan
  _check_timing(p, best)


@pytest.mark.parametrize("bad", [(8, 3, 1, 1, 1, 1, 1.0, 1.0)])
def test_problem_rejects_non_dividing_pp(bad):
  with pytest.raises(ValueError):
    pipeline.FusedProblem(*bad)
