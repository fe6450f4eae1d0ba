"""Row-level simulation of our engine (`rlhf_jax/sim/rows.py`): hand-checked
step counts, costs and idle fractions, and the policies' order on random
long-tailed traces. Pure Python, no JAX."""

import dataclasses

import numpy as np
import pytest

from rlhf_jax.sim import rows

UNIT = rows.UnitCosts(step_s=lambda m: 1.0, prefill_s=0.0, score_s=0.0)


def _sim(lengths, policy, costs=UNIT, **kw):
  kw = dict(dict(replicas=1, rows_per_replica=1), **kw)
  return rows.simulate(np.array(lengths), policy=policy, costs=costs, **kw)


def test_one_row_hand_checked():
  # G=2, lengths 3 and 5: the prefill gives token 1, steps 1-4 the rest; the
  # host reads step 4's tokens only after dispatching step 5 (one step
  # late, as engine/driver.py does), so the row takes 5 steps.
  r = _sim([[3, 5]], "static")
  assert (r.steps, r.makespan) == (5, 5.0)
  # The next prompt enters the freed row: a step for its second token, one
  # more before the host reads it.
  assert _sim([[3, 5], [2, 2]], "continuous").steps == 5 + 2
  # A one-token sample still rides the step dispatched with its prefill.
  assert _sim([[1, 1]], "static").steps == 1


def test_static_waits_for_the_wave():
  lengths = [[5], [1], [1], [1]]
  # Static: wave {5, 1} takes 5 steps, wave {1, 1} one more.
  assert _sim(lengths, "static", rows_per_replica=2).steps == 6
  # Continuous: the short prompts cycle through row 1 while row 0 decodes.
  assert _sim(lengths, "continuous", rows_per_replica=2).steps == 5


def test_prefill_and_scoring_are_serial_without_fusion():
  costs = rows.UnitCosts({1: 1.0}, prefill_s=0.25,
                         score_s=lambda n, longest: 0.5 * n)
  r = _sim([[3, 5], [2, 2]], "continuous", costs, score_chunk=3)
  # 7 steps, 2 prefills, chunks of 3 + 1 samples after the last one.
  assert r.makespan == pytest.approx(7 + 2 * 0.25 + 1.5 + 0.5)
  assert r.scoring_s == pytest.approx(2.0)
  assert r.idle_fraction == pytest.approx(0.0)


def test_consolidation_hand_checked():
  # Two replicas of one row, G=1: the long prompt goes first (longest
  # predicted first) to row 0; the short one ends at iteration 1, leaving
  # 1/2 samples unfinished < R_t = 0.6: row 0 stays on replica 0 of a
  # 1-replica engine, which steps at half the cost.
  costs = rows.UnitCosts({1: 1.0, 2: 2.0}, 0.0, 0.0, move_s=0.5)
  kw = dict(replicas=2, rows_per_replica=1, consolidate_below=0.6)
  ours = _sim([[1], [10]], "ours", costs, **kw)
  cont = _sim([[1], [10]], "continuous", costs, **kw)
  assert (cont.steps, cont.makespan) == (10, 20.0)
  assert (ours.steps, ours.consolidations, ours.final_replicas) == (10, 1, 1)
  assert ours.makespan == pytest.approx(2.0 + 0.5 + 9 * 1.0)
  # Continuous: every step runs both replicas, but replica 1 holds a live
  # row only in step 1.
  assert cont.idle_fraction == pytest.approx(0.0)
  assert cont.timeline_idle_fraction == pytest.approx(1 - (4 + 18) / 40)
  # Ours: 2 x 2 (step 1) + 2 x 0.5 (move) + 9 x 1 busy device-seconds.
  assert ours.idle_fraction == pytest.approx(1 - 14 / (2 * 11.5))
  assert ours.timeline_idle_fraction == pytest.approx(ours.idle_fraction)


def test_fused_scoring_overlaps_the_tail():
  # Row 0: [10, 5], row 1: [1, 1]; steps cost 1 s, chunks of one sample
  # 3 s. Row 1's two samples finish at iteration 1 and wait while both
  # replicas decode; the consolidation onto replica 0 (at once: 2 of 4
  # unfinished < 0.6) frees replica 1, which scores them at 1-4 and 4-7,
  # the 5-token sample (iteration 5, t = 5) at 7-10 and the last (t = 10)
  # at 10-13: all hidden behind decoding with score_overlap=1. With 0 the
  # host loop pays each chunk: 1 + 3 + 3, then 4 steps to t = 11, 3 more,
  # 5 steps to 19, and the last chunk to 22.
  costs = rows.UnitCosts({1: 1.0, 2: 1.0}, 0.0, 3.0)
  kw = dict(replicas=2, rows_per_replica=1, consolidate_below=0.6,
            score_chunk=1)
  hidden = _sim([[10, 5], [1, 1]], "ours", costs, score_overlap=1.0, **kw)
  serial = _sim([[10, 5], [1, 1]], "ours", costs, score_overlap=0.0, **kw)
  assert hidden.makespan == pytest.approx(10 + 3)
  assert serial.makespan == pytest.approx(22)
  assert hidden.scoring_s == serial.scoring_s == 4 * 3.0


def _trace(seed, prompts=24, G=4):
  rng = np.random.default_rng(seed)
  means = 6 * rng.lognormal(0, 0.9, prompts)
  return np.clip(np.rint(means[:, None] * rng.lognormal(0, 0.5, (prompts, G))),
                 1, 64).astype(int)


@pytest.mark.parametrize("seed", range(6))
def test_policies_order_on_long_tails(seed):
  lengths = _trace(seed)
  costs = rows.UnitCosts({1: 0.2, 2: 0.4, 4: 1.0}, prefill_s=0.01,
                         score_s=0.05, move_s=0.1)
  kw = dict(replicas=4, rows_per_replica=2, costs=costs)
  sim = rows.simulate_policies(lengths, **kw)
  assert sim["continuous"].steps <= sim["static"].steps
  assert sim["continuous"].makespan <= sim["static"].makespan
  # Consolidation helps when fewer replicas step faster.
  no_move = rows.simulate(lengths, policy="ours", consolidate_below=0.0, **kw)
  assert sim["ours"].makespan < no_move.makespan
  assert sim["ours"].consolidations >= 1 and sim["ours"].final_replicas < 4
  # And costs nothing but the move when they do not.
  flat = dict(kw, costs=dataclasses.replace(costs, step_s=lambda m: 1.0))
  a = rows.simulate(lengths, policy="ours", **flat)
  b = rows.simulate(lengths, policy="ours", consolidate_below=0.0, **flat)
  assert a.makespan <= b.makespan + a.consolidations * costs.move_s + 1e-9
  assert sim["static"].timeline_idle_fraction > \
      sim["continuous"].timeline_idle_fraction


def test_rejects_unknown_policy():
  with pytest.raises(ValueError, match="unknown policy"):
    _sim([[1]], "greedy")
