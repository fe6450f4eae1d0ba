"""Row-level replay of the elastic rollout (`rlhf_jax/sim/worker_rows.py`):
hand-checked schedules, preemption, round costs, Theta and balancing, no
sample lost; and the same step counts as a live manager run over paged
workers of one group entry per row."""

import numpy as np
import pytest

from rlhf_jax.sim import rows
from rlhf_jax.sim import worker_rows as wr
from rlhf_jax.sim.availability import SpotEvent

COSTS = wr.WorkerCosts(1.0, {8: 0.25, 20: 0.5}, poll_s=0.5, pull_s=0.1)
ONE_ROW = dict(rows_per_worker=1, buckets=(8, 20), poll_steps=2)


def _events(*spec):
  return [SpotEvent(t, iid, kind) for t, iid, kind in spec]


def test_one_worker_hand_checked():
  # G=2, lengths 3 and 5: 5 driver iterations (the host reads one step
  # late, as in sim/rows.py), polled 2 at a time: 3 rounds. A pull, a
  # prefill, 5 steps and 3 poll overheads.
  joins = _events((0, "w", "add"))
  r = wr.simulate([[3, 5]], [5], joins, COSTS, theta=1, **ONE_ROW)
  assert (r.steps, r.rounds, r.polls) == ({"w": 5}, 3, 3)
  assert r.makespan == pytest.approx(0.1 + 0.25 + 5 + 3 * 0.5)
  assert r.worker_seconds == pytest.approx(r.makespan)
  # With theta=1 the second prompt waits in the manager's queue until the
  # second round, in the worker's until its row frees after iteration 5; it
  # enters at iteration 6 and is read finished at iteration 7.
  r = wr.simulate([[3, 5], [2, 2]], [5, 5], joins, COSTS, theta=1,
                  **ONE_ROW)
  assert (r.steps, r.rounds, r.prefills) == ({"w": 7}, 4, 2)
  assert r.makespan == pytest.approx(0.1 + 2 * 0.25 + 7 + 4 * 0.5)
  assert sum(r.produced.values()) == 4


def test_driver_matches_rows_and_charges_live_samples():
  rng = np.random.default_rng(0)
  lengths = np.clip(rng.lognormal(2, 0.8, (20, 4)).astype(int), 1, 40)
  costs = wr.WorkerCosts(2.0, {8: 0.3})
  t, steps = wr.simulate_driver(lengths, [5] * 20, costs, num_rows=6,
                                buckets=(8,))
  ref = rows.simulate(lengths, replicas=3, rows_per_replica=2,
                      policy="continuous",
                      costs=rows.UnitCosts({3: 2.0}, 0.3, 0.0))
  assert (t, steps) == (pytest.approx(ref.makespan), ref.steps)
  # A sample of L tokens is live in L steps: sample_s adds per token.
  t2, _ = wr.simulate_driver(lengths, [5] * 20, wr.WorkerCosts(
      2.0, {8: 0.3}, sample_s=0.01), num_rows=6, buckets=(8,))
  assert t2 == pytest.approx(t + 0.01 * lengths.sum())


def test_preemption_continues_exactly_the_unfinished():
  # One row; prompt 0 (lengths 4, 6) runs on a, prompt 1 waits in a's
  # queue (theta=2). a dies at round 2 after 4 iterations: sample (0, 0)
  # is done, (0, 1) streamed 4 tokens and continues as prompt + 4 = 9
  # tokens (the long bucket) with 2 left; prompt 1 never started and goes
  # back whole, at the queue's front.
  costs = wr.WorkerCosts(1.0, {8: 0.0, 20: 0.5})
  trace = _events((0, "a", "add"), (2, "a", "remove"), (2, "b", "add"))
  r = wr.simulate([[4, 6], [1, 1]], [5, 5], trace, costs, theta=2,
                  clock="rounds", **ONE_ROW)
  assert (r.preemptions, r.migrated_samples) == (1, 1)
  assert (r.kept_tokens, r.reprefill_tokens) == (4, 9)
  # b: prompt 1 at iteration 1 (both end there), the continuation at 2,
  # read finished at 2 + 2 - 1 = 3.
  assert r.steps == {"a": 4, "b": 3}
  assert r.produced == {"a": 1, "b": 3}
  assert r.makespan == pytest.approx(4.0 + 1 + 0.5 + 2)
  assert [(k, t, e.kind) for k, t, e in r.applied] == [
      (0, 0.0, "add"), (2, 4.0, "remove"), (2, 4.0, "add")]
  assert r.worker_seconds == pytest.approx(r.makespan)


def test_sequential_vs_parallel_rounds():
  # Two workers, one prompt each, two rounds of 2 steps: in-process polls
  # add up, parallel ones (Ray actors) cost the slowest; pulls likewise.
  trace = _events((0, "a", "add"), (0, "b", "add"))
  costs = wr.WorkerCosts(1.0, {8: 0.0}, poll_s=0.5, pull_s=0.2)
  kw = dict(theta=1, rows_per_worker=1, buckets=(8,), poll_steps=2)
  seq = wr.simulate([[4, 4], [4, 4]], [5, 5], trace, costs, **kw)
  par = wr.simulate([[4, 4], [4, 4]], [5, 5], trace, costs, parallel=True,
                    **kw)
  assert seq.steps == par.steps == {"a": 4, "b": 4}
  assert seq.makespan == pytest.approx(2 * 0.2 + 2 * 2 * 2.5)
  assert par.makespan == pytest.approx(0.2 + 2 * 2.5)


def _logged_workers(monkeypatch):
  """Records, per worker in join order, (iteration, prompt) as each prompt
  is read finished."""
  log = []

  class Logged(wr._Worker):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      log.append([])
      self._log = log[-1]

    def iterate(self):
      dt, finished = super().iterate()
      self._log += sorted({(self.k, p) for p, _ in finished})
      return dt, finished

  monkeypatch.setattr(wr, "_Worker", Logged)
  return log


def test_theta_keeps_work_in_the_queue_for_joiners(monkeypatch):
  # Six prompts P0..P5 of G=2 samples of 3 tokens; one row (2 slots) per
  # worker, 2 iterations per poll, b joins at round 2. Prefill, poll and
  # pull cost 0 and every iteration has a live row, so each costs 1 s and
  # polls add up: makespan = all iterations. A prompt admitted at iteration
  # i is read finished at i + 2 and the next one enters at i + 3.
  # theta=1 (the manager holds the queue; work reaches b by dispatch):
  #   r0: P0 -> a; a: k1-2 (P0 in at 1).
  #   r1: P1 -> a; a: k3 P0 done, k4 P1 in.
  #   r2: b joins; P2 -> b (ties on pending go to the most free slots: b
  #     runs 0 of 2, a 2 of 2), P3 -> a; a: k5, k6 P1 done (P3 waits in a's
  #     queue); b: k1 P2 in, k2. Balancing: b has nothing pending but a
  #     only 1 (a source keeps its last): no move.
  #   r3: P4 -> b; a: k7 P3 in, k8; b: k3 P2 done, k4 P4 in.
  #   r4: P5 -> a (tie on everything: lowest index); a: k9 P3 done, k10 P5
  #     in; b: k5, k6 P4 done.
  #   r5: a: k11, k12 P5 done; b idle. 6 rounds.
  # theta=100 (a takes the whole queue; b gets work by balancing):
  #   r0: P0..P5 -> a; a: k1 P0 in, k2.  r1: a: k3 P0 done, k4 P1 in.
  #   r2: b joins idle; a: k5, k6 P1 done; b: no work, no iteration. a has
  #     4 pending (P2..P5), b 0 pending and 0 of 2 slots running: b may take
  #     2 - 0 + 1 = 3, one at a time from the longest queue while it holds
  #     more than 1: a 4 -> 3 -> 2 -> 1, b takes a's newest: P5, P4, P3
  #     (3 moves).
  #   r3: a: k7 P2 in, k8; b: k1 P5 in, k2. Now a has 0 pending, b 2 (P4,
  #     P3) and a runs 2 of 2: a may take 2 - 2 + 1 = 1: b's newest, P3
  #     (1 move: 4 in all).
  #   r4: a: k9 P2 done, k10 P3 in; b: k3 P5 done, k4 P4 in.
  #   r5: a: k11, k12 P3 done; b: k5, k6 P4 done. 6 rounds.
  # Either way a finishes 4 prompts in 12 iterations and b 2 in 6:
  # makespan 18 s.
  finishes = {
      1: {"a": [(3, 0), (6, 1), (9, 3), (12, 5)], "b": [(3, 2), (6, 4)]},
      100: {"a": [(3, 0), (6, 1), (9, 2), (12, 3)], "b": [(3, 5), (6, 4)]},
  }
  balanced = {1: 0, 100: 3 + 1}
  trace = _events((0, "a", "add"), (2, "b", "add"))
  costs = wr.WorkerCosts(1.0, {8: 0.0})
  lengths = np.full((6, 2), 3)
  seen = []
  select = wr.offload.select_instance

  def spy(views, theta):
    seen.append(max(v.pending for v in views))
    return select(views, theta)

  for theta in (1, 100):
    seen.clear()
    log = _logged_workers(monkeypatch)
    monkeypatch.setattr(wr.offload, "select_instance", spy)
    r = wr.simulate(lengths, [5] * 6, trace, costs, theta=theta,
                    clock="rounds", **ONE_ROW)
    monkeypatch.undo()  # The next run wraps the real worker again.
    want = finishes[theta]
    assert dict(zip("ab", log)) == want, theta
    assert r.produced == {w: 2 * len(f) for w, f in want.items()}
    assert r.steps == {w: f[-1][0] for w, f in want.items()}
    assert r.makespan == 1.0 * sum(f[-1][0] for f in want.values()) == 18.0
    assert (r.rounds, r.balanced_requests) == (6, balanced[theta])
    # The most pending a dispatch decision saw: theta=1, a refused one sees
    # a's 1; theta=100, the 6th dispatch sees a's 5.
    assert max(seen) == {1: 1, 100: 5}[theta]


def test_running_samples_move_to_an_idle_worker():
  # One row; a runs prompt 0 (lengths 6, 6), b joins idle at round 1.
  # After a's second poll (4 tokens each) B=0 asks for both running
  # samples, B=1 for one; single samples move, at most b's rows (1): (0, 0)
  # (budgets left tie at 2: key order), continued on b as prompt + 4 = 9
  # tokens (long bucket) with 2 left. a keeps (0, 1) in its row (read
  # finished at iteration 6); b runs the continuation in 2 iterations.
  # B=2 or none: nothing moves.
  trace = _events((0, "a", "add"), (1, "b", "add"))
  costs = wr.WorkerCosts(1.0, {8: 0.0, 20: 0.5})
  for plateau in (0, 1):
    r = wr.simulate([[6, 6]], [5], trace, costs, theta=1, clock="rounds",
                    plateau=plateau, **ONE_ROW)
    assert (r.moved_running, r.migrated_samples, r.preemptions) == (1, 1, 0)
    assert (r.kept_tokens, r.reprefill_tokens) == (4, 9)
    assert r.steps == {"a": 6, "b": 2}
    assert r.produced == {"a": 1, "b": 1}
    assert r.rounds == 3 and r.makespan == pytest.approx(2 + 2 + 2 + 2.5)
  for plateau in (None, 2):
    r = wr.simulate([[6, 6]], [5], trace, costs, theta=1, clock="rounds",
                    plateau=plateau, **ONE_ROW)
    assert (r.moved_running, r.steps, r.rounds) == (0, {"a": 6, "b": 0}, 3)
  # G=1: the move empties a's row. a reads the cut step in flight in one
  # more, empty, iteration (no decode, no cost).
  r = wr.simulate([[6]], [5], trace, costs, theta=1, clock="rounds",
                  plateau=0, **ONE_ROW)
  assert (r.moved_running, r.kept_tokens, r.reprefill_tokens) == (1, 4, 9)
  assert r.steps == {"a": 5, "b": 2} and r.produced == {"b": 1}
  assert r.rounds == 3 and r.makespan == pytest.approx(2 + 2 + 2.5)


def test_prefill_calls_batch_the_prompts_admitted_together():
  # Three rows, 5 prompts of one sample admitted together at iteration 1
  # (3) and 2 (2): prefill_batch=2 makes calls of (5, 5) and (12) tokens,
  # then (5, 12): buckets 8, 20, then 20.
  costs = wr.WorkerCosts(1.0, {8: 0.25, 20: 0.5})
  lengths, prompts = [[1], [1], [1], [1], [1]], [5, 5, 12, 5, 12]
  t, steps = wr.simulate_driver(lengths, prompts, costs, num_rows=3,
                                buckets=(8, 20), prefill_batch=2)
  assert steps == 2 and t == pytest.approx(0.25 + 0.5 + 1 + 0.5 + 1)
  t1, _ = wr.simulate_driver(lengths, prompts, costs, num_rows=3,
                             buckets=(8, 20))
  assert t1 == pytest.approx(3 * 0.25 + 2 * 0.5 + 2)


@pytest.mark.parametrize("seed", range(4))
def test_no_sample_lost_or_duplicated(seed):
  rng = np.random.default_rng(seed)
  lengths, prompt_lens = rng.integers(1, 30, (16, 4)), rng.integers(4, 16, 16)
  trace = _events((0, "a", "add"), (0, "b", "add"), (5, "a", "remove"),
                  (8, "c", "add"), (12, "b", "remove"), (15, "c", "remove"),
                  (16, "d", "add"))
  costs = wr.WorkerCosts(0.1, {16: 0.05, 48: 0.1}, poll_s=0.01)
  kw = dict(rows_per_worker=2, buckets=(16, 48), theta=2, poll_steps=3,
            wait_for_workers_s=10.0)
  r = wr.simulate(lengths, prompt_lens, trace, costs, **kw)
  assert sum(r.produced.values()) == lengths.size
  assert r.preemptions == sum(e.kind == "remove" for _, _, e in r.applied)
  # Each continuation re-prefills its prompt and the tokens kept so far.
  assert r.kept_tokens < lengths.sum()
  assert r.reprefill_tokens >= r.kept_tokens + 4 * r.migrated_samples
  assert r == wr.simulate(lengths, prompt_lens, trace, costs, **kw)


def test_gap_without_workers():
  # a is preempted after round 0 (2 tokens streamed per sample); the
  # manager waits ~0.5 s (gap rounds of GAP_SLEEP_S) for b, which runs the
  # two continuations (prompt + 2 tokens, 4 left each) one after the other.
  trace = _events((0, "a", "add"), (1.0, "a", "remove"), (2.5, "b", "add"))
  costs = wr.WorkerCosts(1.0, {8: 0.0})
  r = wr.simulate([[6, 6]], [5], trace, costs, theta=1,
                  wait_for_workers_s=1.0, **ONE_ROW)
  assert r.produced == {"b": 2} and r.steps == {"a": 2, "b": 8}
  assert (r.kept_tokens, r.reprefill_tokens) == (4, 2 * 7)
  assert r.makespan == pytest.approx(2.5 + 8, abs=wr.GAP_SLEEP_S)
  assert r.rounds == pytest.approx(2 + 50 + 4, abs=1)
  for cut, wait in ((2, 1.0), (3, 0.1)):  # No join left, or too late.
    with pytest.raises(RuntimeError, match="no worker alive"):
      wr.simulate([[6, 6]], [5], trace[:cut], costs, theta=1,
                  wait_for_workers_s=wait, **ONE_ROW)


def _live_and_sim(trace, *, seed, theta, poll_steps, plateau=None):
  """A live `RolloutManager` over in-process one-device workers (trace
  replayed on a round clock: one tick per round) and its simulation."""
  import jax

  from rlhf_jax.samples import Request
  from rlhf_jax.engine.sampling import SamplingParams
  from rlhf_jax.models.config import ModelConfig
  from rlhf_jax.workers import manager as manager_lib
  from rlhf_jax.workers.replay import AvailabilityReplayer
  from rlhf_jax.workers.worker import EngineSpec, RolloutWorker
  from worker_env import published_store

  M, G, R = 12, 2, 2
  # Paged workers with one group entry per row (the sim's rows), pages for
  # every slot, one decode step a call.
  spec = EngineSpec(ModelConfig.tiny(vocab_size=64), num_rows=R,
                    samples_per_row=G, prefill_buckets=(8, 8 + M),
                    sampling=SamplingParams(max_new_tokens=M),
                    paged=dict(page_size=4, num_pages=0, num_slots=R * G,
                               num_groups=R, decode_window=1))
  store, _ = published_store(spec)
  rng = np.random.default_rng(seed)
  lengths, prompt_lens = rng.integers(1, M + 1, (8, G)), rng.integers(2, 8, 8)
  requests = [Request(p, rng.integers(6, 64, prompt_lens[p]), num_samples=G,
                      seed=3, max_new_tokens_per_sample=tuple(
                          int(x) for x in lengths[p])) for p in range(8)]
  spawned = {}

  def spawn(iid):
    spawned[iid] = RolloutWorker(iid, spec,
                                 devices=[jax.devices()[len(spawned)]])
    return manager_lib.LocalHandle(spawned[iid])

  rounds = iter(range(10**6))
  replay = AvailabilityReplayer(trace, spawn, clock=lambda: next(rounds))
  mgr = manager_lib.RolloutManager(store, max_new_tokens=M, theta=theta,
                                   poll_steps=poll_steps, plateau=plateau)
  mgr.on_poll = replay
  mgr.wait_for_workers_s = 5.0
  samples = mgr.run(requests)
  assert sum(len(s.tokens) for s in samples) == lengths.sum()
  sim = wr.simulate(lengths, prompt_lens, trace,
                    wr.WorkerCosts(1.0, {8: 0.0, 8 + M: 0.0}),
                    rows_per_worker=R, buckets=(8, 8 + M), theta=theta,
                    poll_steps=poll_steps, clock="rounds",
                    wait_for_workers_s=5.0, plateau=plateau)
  live_steps = {k: w.steps for k, w in spawned.items()}
  return mgr, live_steps, next(rounds), sim


def test_matches_a_live_manager_run(mesh8):
  """The same steps per worker, rounds, samples per worker, migrations,
  re-prefill tokens and balancing moves as a live manager run."""
  del mesh8
  # b joins at round 1 and takes queued work (balancing); a is preempted
  # at round 4 mid-response.
  trace = _events((0, "a", "add"), (1, "b", "add"), (4, "a", "remove"))
  mgr, steps, rounds, sim = _live_and_sim(trace, seed=0, theta=3,
                                          poll_steps=3)
  st = mgr.stats
  assert steps == sim.steps
  assert rounds == sim.rounds  # The clock ticks once per round.
  assert dict(mgr.produced) == sim.produced
  assert (st.preemptions, st.migrated_samples, st.kept_tokens,
          st.reprefill_tokens, st.balanced_requests) == (
              sim.preemptions, sim.migrated_samples, sim.kept_tokens,
              sim.reprefill_tokens, sim.balanced_requests)
  assert st.migrated_samples > 0 and st.balanced_requests > 0
  assert st.moved_running == sim.moved_running == 0


@pytest.mark.parametrize("plateau,seed,trace,theta", [
    # B = one row: c joins idle at round 6 and takes b's 2 samples with
    # the most budget left: (6, 1) with 5, then (6, 0) with 4, which ties
    # (7, 0) and wins on key order (another pick would give other counts).
    (2, 0, ((0, "a", "add"), (1, "b", "add"), (3, "a", "remove"),
            (6, "c", "add")), 2),
    # B = 0: any running sample may move, sources are left with no work
    # (their next poll reads the cut samples' step in flight: one more,
    # empty, iteration); moves are capped at the rows (group entries, 2):
    # one asks for 3 samples and gets 2.
    (0, 3, ((0, "a", "add"), (1, "b", "add"), (3, "c", "add"),
            (5, "a", "remove")), 100),
])
def test_running_moves_match_a_live_manager_run(mesh8, plateau, seed, trace,
                                                theta):
  """With `plateau` set the live manager moves running samples to idle
  workers; the sim makes the same moves: the same steps per worker,
  rounds, samples per worker, moves, migrations and re-prefill tokens."""
  del mesh8
  mgr, steps, rounds, sim = _live_and_sim(
      _events(*trace), seed=seed, theta=theta, poll_steps=2,
      plateau=plateau)
  st = mgr.stats
  assert st.moved_running > 0 and st.preemptions > 0
  assert steps == sim.steps
  assert rounds == sim.rounds
  assert dict(mgr.produced) == sim.produced
  assert (st.moved_running, st.preemptions, st.migrated_samples,
          st.kept_tokens, st.reprefill_tokens, st.balanced_requests) == (
              sim.moved_running, sim.preemptions, sim.migrated_samples,
              sim.kept_tokens, sim.reprefill_tokens, sim.balanced_requests)
