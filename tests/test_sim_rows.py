"""Row-level simulation of our engine (`rlhf_jax/sim/rows.py`): hand-checked
step counts, and the policies' order on random long-tailed traces."""

import numpy as np
import pytest

from rlhf_jax.sim import rows

COSTS = rows.UnitCosts(step_s={1: 1.0, 2: 1.0, 4: 1.0}, prefill_s=0.0,
                       score_s=0.0)


def test_one_row_hand_checked():
  # One row, G=2, lengths 3 and 5: prefill gives token 1, 4 steps give the
  # rest; the host reads each step's tokens one step late, so it has
  # dispatched a 5th step before it sees the row finish (as the Driver does).
  r = rows.simulate(np.array([[3, 5]]), replicas=1, rows_per_replica=1,
                    policy="static", costs=COSTS)
  assert r.steps == 5 and r.makespan == 5.0
  # A second prompt in the same row enters after that: 1 step for its
  # second token, 1 lagged step.
  r = rows.simulate(np.array([[3, 5], [2, 2]]), replicas=1,
                    rows_per_replica=1, policy="continuous", costs=COSTS)
  assert r.steps == 5 + 2


def test_static_waits_for_the_wave():
  lengths = np.array([[10], [1], [1], [1]])
  static = rows.simulate(lengths, replicas=2, rows_per_replica=1,
                         policy="static", costs=COSTS)
  cont = rows.simulate(lengths, replicas=2, rows_per_replica=1,
                       policy="continuous", costs=COSTS)
  assert cont.steps < static.steps


@pytest.mark.parametrize("seed", range(5))
def test_policies_order_on_long_tails(seed):
  rng = np.random.default_rng(seed)
  lengths = np.clip(np.rint(6 * rng.lognormal(0, 1, (24, 4))), 1, 64)
  costs = rows.UnitCosts(step_s={1: 0.2, 2: 0.4, 4: 1.0}, prefill_s=0.01,
                         score_s=0.05, move_s=0.1)
  kw = dict(replicas=4, rows_per_replica=2, costs=costs)
  static = rows.simulate(lengths, policy="static", **kw)
  cont = rows.simulate(lengths, policy="continuous", **kw)
  ours = rows.simulate(lengths, policy="ours", **kw)
  assert cont.makespan <= static.makespan
  assert ours.makespan < cont.makespan  # Cheaper tail steps on fewer replicas.
  assert ours.consolidations >= 1


def test_concurrent_scoring_hides_chunks_after_consolidation():
  lengths = np.array([[40, 1]] + [[1, 1]] * 15)
  costs = rows.UnitCosts(step_s={1: 1.0, 2: 1.0, 4: 1.0}, prefill_s=0.0,
                         score_s=3.0)
  kw = dict(replicas=4, rows_per_replica=1, policy="ours", costs=costs,
            score_chunk=2, consolidate_below=0.5)
  serial = rows.simulate(lengths, concurrent_scoring=False, **kw)
  overlap = rows.simulate(lengths, concurrent_scoring=True, **kw)
  assert overlap.makespan < serial.makespan
  assert serial.scoring_s == overlap.scoring_s == 16 * 3.0
