"""RLHFuse consolidation, RLHFless cut-and-migrate, history and scaling."""

import pytest

from rlhf_jax.sched import actor_scaling
from rlhf_jax.sched import assignment
from rlhf_jax.sched import length_history
from rlhf_jax.sched import tail


def test_consolidation_trigger():
  assert tail.should_consolidate(19, 100, 0.2)
  assert not tail.should_consolidate(20, 100, 0.2)
  assert not tail.should_consolidate(0, 100, 0.2)


def test_survivors_are_fewest_with_most_work():
  loads = [tail.InstanceLoad("a", 2, 100, 0), tail.InstanceLoad("b", 9, 900, 0),
           tail.InstanceLoad("c", 5, 500, 0), tail.InstanceLoad("d", 0, 0, 0)]
  # 16 unfinished, 8 per instance -> 2 survivors: the two with most work.
  assert tail.consolidation_survivors(loads, 8, 1e9) == ["b", "c"]
  # KV memory can force more survivors.
  assert tail.consolidation_survivors(loads, 8, 750) == ["b", "c"]
  assert tail.consolidation_survivors(loads, 8, 700) == ["b", "c", "a"]


def test_latency_capacity():
  step = lambda b: 1.0 + 0.01 * b  # limit 1.1 * 1.01 -> b <= 11.1.
  assert tail.latency_capacity(step, 64, slack=0.1) == 11
  assert tail.latency_capacity(step, 5, slack=0.1) == 5


def test_cut_fires_at_tau_once_and_only_if_it_fits():
  loads = [tail.InstanceLoad("a", 2, 0, 0, assigned=10, finished=8),
           tail.InstanceLoad("b", 5, 0, 3, assigned=10, finished=5),
           tail.InstanceLoad("c", 5, 0, 1, assigned=10, finished=5)]
  done = set()
  moves = tail.cut_moves(loads, 0.8, done)
  assert moves == [("a", "b", 2)]
  assert done == {"a"}
  assert tail.cut_moves(loads, 0.8, done) == []  # fires once.
  tight = [tail.InstanceLoad("a", 4, 0, 0, assigned=10, finished=8),
           tail.InstanceLoad("b", 5, 0, 3, assigned=10, finished=5)]
  assert tail.cut_moves(tight, 0.8, set()) == []  # 4 do not fit in 3.
  assert tail.cut_moves(loads, 0.9, set()) == []  # below tau.


def test_ewma_history():
  h = length_history.LengthHistory(alpha=0.5)
  assert h.predict(7, default=3.0) == 3.0
  h.update(7, [100, 300])
  assert h.predict(7, 0.0) == 200.0
  h.update(7, [400])
  assert h.predict(7, 0.0) == 300.0
  restored = length_history.LengthHistory.from_state_dict(h.state_dict())
  assert restored.predict(7, 0.0) == 300.0
  with pytest.raises(ValueError):
    length_history.LengthHistory(alpha=0.0)


def test_length_grouped_split_balances_tokens_and_keeps_every_group():
  predicted = {g: float(l) for g, l in enumerate([1000, 100, 100, 100, 100,
                                                  100, 100, 100, 100, 100])}
  chunks = assignment.length_grouped_split(predicted, 2)
  assert chunks[0] == [0]  # the long group alone: it decodes in a small batch.
  assert sorted(g for c in chunks for g in c) == list(range(10))
  assert assignment.contiguous_split(list(range(5)), 2) == [[0, 1, 2], [3, 4]]


def test_predicted_actor_time_hand_computed():
  # Lengths 1, 3 with TPOT(b) = b: 1 step at batch 2, then 2 at batch 1.
  assert actor_scaling.predicted_actor_time([3, 1], lambda b: b) == 4.0


def test_actor_count_lambda_trades_time_for_cost():
  groups = {g: [100.0 + 50 * g] * 4 for g in range(16)}
  tpot = lambda b: 0.01 + 0.0002 * b  # memory-bound decode.
  fastest, table = actor_scaling.choose_actor_count(groups, [1, 2, 4, 8],
                                                    tpot, 1.0, 1)
  cheapest, _ = actor_scaling.choose_actor_count(groups, [1, 2, 4, 8], tpot,
                                                 0.0, 1)
  assert table[fastest][0] == min(t for t, _ in table.values())
  assert table[cheapest][1] == min(c for _, c in table.values())
  assert fastest > cheapest
