"""RLHFuse consolidation, RLHFless cut-and-migrate, history and scaling."""

import pytest

from rlhf_jax.sched import actor_scaling
from rlhf_jax.sched import assignment
from rlhf_jax.sched import continuous
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


# ---------------------------------------- the row rules of our engine
def test_block_sizes_are_power_of_two_divisors():
  assert tail.block_sizes(8) == [1, 2, 4, 8]
  assert tail.block_sizes(6) == [1, 2]
  assert tail.block_sizes(1) == [1]


def test_least_loaded_row_picks_the_lightest_replica_then_lowest_row():
  load = [5.0, 1.0, 1.0, 0.0]   # Replica 3 has the least admitted work.
  assert tail.least_loaded_row([0, 2, 3, 6, 7], load, 2) == 6
  assert tail.least_loaded_row([0, 2, 3], load, 2) == 2  # Tie 1 vs 1: row 2.


def test_consolidation_due_needs_every_condition():
  due = dict(pending=False, replicas=8, live_rows=3, no_gain=9)
  assert tail.consolidation_due(5, 64, 0.2, **due)        # 5/64 < 0.2
  assert not tail.consolidation_due(13, 64, 0.2, **due)   # 13/64 >= 0.2
  assert not tail.consolidation_due(5, 64, 0.0, **due)    # R_t off.
  assert not tail.consolidation_due(5, 64, 0.2, **{**due, "pending": True})
  assert not tail.consolidation_due(5, 64, 0.2, **{**due, "replicas": 1})
  assert not tail.consolidation_due(5, 64, 0.2, **{**due, "no_gain": 3})
  assert not tail.consolidation_due(0, 64, 0.2, **due)    # Nothing live.
  assert tail.no_gain_rows(8, 2) == 17


def test_consolidation_block_and_row_remap():
  assert tail.consolidation_block(3, 2, [1, 2, 4, 8], 8) == 2   # 2x2 >= 3.
  assert tail.consolidation_block(9, 2, [1, 2, 4], 4) == 4      # None fits.
  # Rows below the cap (4) stay; 9 and 13 take the lowest free rows.
  row_map, extra = tail.remap_rows([13, 1, 9, 3], 4, extra=1)
  assert row_map == {1: 1, 3: 3, 9: 0, 13: 2} and extra == []
  row_map, extra = tail.remap_rows([5], 4, extra=2)
  assert row_map == {5: 0} and extra == [1, 2]


def test_reprefill_choice():
  tokens = {0: 3, 1: 40, 2: 2}
  assert tail.reprefill_choice(tokens, "kv", 8) == []
  assert tail.reprefill_choice(tokens, "reprefill", 8) == [0, 1, 2]
  assert tail.reprefill_choice(tokens, "auto", 3) == [0, 2]


def test_longest_first_is_stable_by_key():
  order = assignment.longest_first([3.0, 9.0, 3.0, 5.0], [7, 1, 2, 4])
  assert order == [1, 3, 2, 0]  # 9, 5, then the two 3s by key (2 < 7).
  assert assignment.longest_first_order({4: 1.0, 2: 6.0, 9: 1.0}) == [2, 4, 9]


def test_decode_replicas_modes():
  lengths = [[10.0, 2.0]] * 8
  sizes = [1, 2, 4, 8]
  assert continuous.decode_replicas("all", sizes, lengths, 1, {}, 0.5) == (
      8, {})
  assert continuous.decode_replicas(2, sizes, lengths, 1, {}, 0.5) == (2, {})
  m, info = continuous.decode_replicas("cost", sizes, lengths, 1,
                                       {1: 1.0, 2: None}, 0.0)
  assert m == 8 and info == {"unmeasured": True}
  m, _ = continuous.decode_replicas("cost", sizes, lengths, 1,
                                    dict.fromkeys(sizes, 1.0), 0.0)
  assert m == 1  # Equal step costs: the fewest replica-seconds.


def test_lambda_argmin_references_the_largest_candidate():
  table = {1: (8.0, 8.0), 2: (4.0, 8.0), 4: (3.0, 12.0)}
  assert actor_scaling.lambda_argmin(table, 1.0) == 4   # Fastest.
  assert actor_scaling.lambda_argmin(table, 0.0) == 1   # Cheapest, smaller n.
  assert actor_scaling.lambda_argmin({1: (0.0, 0.0)}, 0.5) == 1  # No 0 / 0.


def test_scoring_chunk_fills_then_keeps_freed_replicas_busy():
  kw = dict(fusion=True, freed=True, decoded=False)
  # 7 scoring replicas: a chunk of 8 is rounded up to 14 rows.
  assert tail.scoring_chunk(20, 8, 7, in_flight=1, **kw) == 14
  assert tail.scoring_chunk(13, 8, 7, in_flight=1, **kw) == 0  # Queued: wait.
  assert tail.scoring_chunk(13, 8, 7, in_flight=0, **kw) == 13  # Else idle.
  assert tail.scoring_chunk(1, 8, 7, in_flight=0, **kw) == 1
  assert tail.scoring_chunk(0, 8, 7, in_flight=0, **kw) == 0
  assert tail.scoring_chunk(30, 8, 7, in_flight=2, **kw) == 0  # Queue full.
  # Before consolidation, or without fusion, samples wait for the decode.
  assert tail.scoring_chunk(30, 8, 7, fusion=True, freed=False,
                            decoded=False) == 0
  assert tail.scoring_chunk(30, 8, 7, fusion=False, freed=True,
                            decoded=False) == 0
  assert tail.scoring_chunk(30, 8, 8, fusion=False, freed=True,
                            decoded=True) == 8
  assert tail.scoring_chunk(5, 8, 8, fusion=False, freed=True,
                            decoded=True) == 5


def test_chunk_rows_split_evenly_and_stay_few():
  # 3 scoring replicas: a chunk of 8 fills 12 rows (4 per replica).
  assert tail.scoring_chunk(30, 8, 3, fusion=True, freed=True,
                            decoded=False) == 12
  for shards in (1, 3, 6, 7, 8):
    rows = {n: tail.chunk_rows(n, shards) for n in range(1, 65)}
    for n, r in rows.items():
      per_replica = r // shards
      assert r % shards == 0 and r >= n
      assert per_replica & (per_replica - 1) == 0  # A power of two.
      assert (per_replica == 1) or (per_replica // 2) * shards < n  # Tight.
    # Chunks of 1..64 samples: 7 or fewer row counts, not one per size.
    assert len(set(rows.values())) <= 7
