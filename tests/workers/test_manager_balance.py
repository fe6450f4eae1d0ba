"""The rollout manager's dispatch and balancing rules (issue [elastic]).

Engine-free: SELECTINSTANCE (join the shortest queue, at most Theta
pending, ties) and CONTINUOUSLB (pending moves to starving workers, running
moves only above the batching plateau B), and the manager's plumbing of a
running move over fake workers. Live: two in-process workers, all work on
one, the other idle: running samples move, and every sample's tokens equal
an unbalanced run's.
"""

import jax
import numpy as np
import pytest

from rlhf_jax.samples import Partial, Request
from rlhf_jax.sched.offload import QueueView, balance_moves, select_instance
from rlhf_jax.workers import manager as manager_lib
from rlhf_jax.workers.weights import LocalWeightStore
from rlhf_jax.workers.worker import PollResult, RolloutWorker
from worker_env import M, SPEC, check as _check, published_store
from worker_env import reference, requests

V = QueueView  # (pending, running, max_slots)


# ------------------------------------------------------------ SELECTINSTANCE
def test_select_instance_joins_shortest_queue():
  assert select_instance([V(2, 0, 4), V(1, 4, 4), V(3, 0, 4)], theta=4) == 1


def test_select_instance_caps_pending_at_theta():
  assert select_instance([V(4, 0, 4), V(5, 0, 4)], theta=4) is None
  # The only instance below Theta wins even with every slot busy.
  assert select_instance([V(4, 0, 4), V(3, 4, 4)], theta=4) == 1
  assert select_instance([], theta=4) is None


def test_select_instance_ties_most_free_slots_then_lowest_index():
  assert select_instance([V(1, 3, 4), V(1, 1, 4)], theta=4) == 1
  assert select_instance([V(1, 2, 8), V(1, 1, 4)], theta=4) == 0  # 6 vs 3
  assert select_instance([V(0, 0, 4), V(0, 0, 4)], theta=4) == 0


# --------------------------------------------------------------- CONTINUOUSLB
def test_pending_moves_to_starving_worker():
  # Worker 1 has nothing queued and one slot's worth of room (+1 to queue).
  assert balance_moves([V(5, 4, 4), V(0, 4, 4), V(2, 4, 4)], plateau=2) == [
      (0, 1, 1, False)]
  # An empty worker takes up to its free slots + 1 requests, one at a time
  # from the longest queue (ties to the lowest index); a source keeps its
  # last one. Once the destination's own queue is the longest it is picked
  # as the source: (1, 1) moves are no-ops (the manager skips them).
  assert balance_moves([V(6, 4, 4), V(0, 0, 4), V(3, 4, 4)], plateau=2) == [
      (0, 1, 1, False), (0, 1, 1, False), (0, 1, 1, False),
      (0, 1, 1, False), (1, 1, 1, False)]
  assert balance_moves([V(1, 4, 4), V(0, 0, 4)], plateau=0) == []


def test_pending_moves_come_before_running_moves():
  # Queued work exists: only it moves, whatever the plateau.
  assert balance_moves([V(3, 4, 4), V(0, 0, 4)], plateau=1) == [
      (0, 1, 1, False), (0, 1, 1, False)] + [(1, 1, 1, False)] * 3


def test_running_moves_only_above_plateau_to_idle_worker():
  views = [V(0, 4, 4), V(0, 0, 4)]
  assert balance_moves(views, plateau=4) == []
  assert balance_moves(views, plateau=1 << 30) == []  # The manager's "off".
  assert balance_moves(views, plateau=3) == [(0, 1, 1, True)]
  assert balance_moves(views, plateau=1) == [(0, 1, 3, True)]
  # At most what the destination decodes at once.
  assert balance_moves([V(0, 8, 8), V(0, 0, 2)], plateau=1) == [
      (0, 1, 2, True)]
  # Only to an idle worker (nothing running, nothing queued).
  assert balance_moves([V(0, 4, 4), V(0, 1, 4)], plateau=1) == []
  # From the worker running the most (ties to the lowest index).
  assert balance_moves([V(0, 3, 4), V(0, 4, 4), V(0, 0, 4)], plateau=2) == [
      (1, 2, 2, True)]


# ------------------------------------------ the manager's plumbing, no engine
class _FakeWorker:
  """Admits queued requests at a poll while their samples fit its slots,
  as running samples with fixed tokens (sample i has i + 1); never
  advances."""

  def __init__(self, worker_id, slots=4):
    self.worker_id, self.slots = worker_id, slots
    self.queued, self.running, self.calls = [], [], []

  def load(self, version, payload):
    del payload
    return version

  def submit(self, reqs):
    self.queued += reqs
    return len(self.queued)

  def poll(self, max_steps):
    del max_steps
    while self.queued and (len(self.running) + self.queued[0].num_samples
                           <= self.slots):
      req = self.queued.pop(0)
      for j in range(req.num_samples):
        i = req.first_sample_index + j
        self.running.append(Partial(req, i, [40 + i] * (i + 1),
                                    [-1.0] * (i + 1), [-2.0] * (i + 1),
                                    req.budget(j, 10), 0))
    return PollResult([], list(self.running), len(self.queued), 0,
                      self.slots)

  def take_pending(self, n):
    self.calls.append(("take_pending", n))
    out = []  # The newest first, as RolloutWorker.take_pending.
    while self.queued and len(out) < n:
      out.append(self.queued.pop())
    return out

  def take_running(self, n):
    self.calls.append(("take_running", n))
    out, self.running = self.running[-n:], self.running[:-n]
    return out

  def clear(self):
    self.queued, self.running = [], []


class _DiesOnSubmit(manager_lib.LocalHandle):

  def call_async(self, name, *args):
    if name == "submit":
      self.alive = False
    return super().call_async(name, *args)


def _fake_run(plateau, b_handle=manager_lib.LocalHandle):
  store = LocalWeightStore()
  store.publish(0, {"w": np.zeros(1, np.float32)})
  mgr = manager_lib.RolloutManager(store, max_new_tokens=10, theta=8,
                                   poll_steps=1, plateau=plateau)
  a, b = _FakeWorker("a"), _FakeWorker("b")
  mgr.add(manager_lib.LocalHandle(a))
  req = Request(7, np.array([5, 6, 7], np.int32), num_samples=3, seed=1)
  mgr.start([req])
  mgr.step()  # a takes the request and starts its 3 samples; no idle worker.
  assert a.calls == [] and len(a.running) == 3
  mgr.add(b_handle(b))
  mgr.step()  # b joins idle: 3 running on a, plateau 1 -> move 2.
  return mgr, a, b


def test_manager_moves_running_samples_as_continuations():
  mgr, a, b = _fake_run(plateau=1)
  assert a.calls == [("take_running", 2)]
  assert len(a.running) == 1 and len(b.running) == 0
  # Samples 1 and 2 continue on b from their tokens, with the budget left.
  conts = sorted(b.queued, key=lambda r: r.first_sample_index)
  assert [r.first_sample_index for r in conts] == [1, 2]
  for r in conts:
    i = r.first_sample_index
    np.testing.assert_array_equal(r.tokens, [5, 6, 7] + [40 + i] * (i + 1))
    assert r.num_samples == 1 and r.max_new_tokens_per_sample == (10 - i - 1,)
  st = mgr.stats
  assert st.moved_running == st.migrated_samples == 2
  assert st.kept_tokens == 2 + 3 and st.reprefill_tokens == 5 + 6
  assert st.preemptions == 0
  # State keys: (prompt id, batch seed, sample index).
  assert {mgr._states[7, 1, i].worker for i in (1, 2)} == {"b"}
  assert mgr._states[7, 1, 0].worker == "a"


def test_manager_without_plateau_never_moves_running_samples():
  mgr, a, b = _fake_run(plateau=None)
  assert a.calls == [] and len(a.running) == 3 and not b.queued
  assert mgr.stats.moved_running == 0


def test_manager_moves_queued_requests_and_skips_self_moves():
  store = LocalWeightStore()
  store.publish(0, {"w": np.zeros(1, np.float32)})
  mgr = manager_lib.RolloutManager(store, max_new_tokens=10, theta=8,
                                   poll_steps=1, plateau=1)
  a, b = _FakeWorker("a"), _FakeWorker("b")
  mgr.add(manager_lib.LocalHandle(a))
  mgr.start([Request(p, np.array([5, p], np.int32), num_samples=2)
             for p in range(5)])
  mgr.step()  # a: 2 requests running (4 slots), 3 queued.
  assert len(a.running) == 4 and len(a.queued) == 3
  mgr.add(manager_lib.LocalHandle(b))
  mgr.step()  # Moves (a, b) x2, then (b, b) x3: skipped.
  assert a.calls == [("take_pending", 1)] * 2 and b.calls == []
  assert [r.prompt_id for r in b.queued] == [4, 3]
  st = mgr.stats
  assert st.balanced_requests == 2 and st.moved_running == 0
  assert st.migrated_samples == 0 and st.reprefill_tokens == 0


def test_running_move_to_a_dead_worker_goes_to_queue_front():
  mgr, a, _ = _fake_run(plateau=1, b_handle=_DiesOnSubmit)
  assert a.calls == [("take_running", 2)] and "b" not in mgr.handles
  front = [(r.prompt_id, r.first_sample_index) for r in mgr._queue]
  assert sorted(front) == [(7, 1), (7, 2)]
  assert mgr.stats.moved_running == 2 and mgr.stats.preemptions == 1


# ------------------------------------------------------------- live workers
def _requests(budgets=None):
  return requests(2, rng_seed=1, seed=5, budgets=budgets)


@pytest.fixture(scope="module")
def live(mesh8):
  del mesh8
  store, _ = published_store()
  a, b = (RolloutWorker(w, SPEC, devices=[d])
          for w, d in zip("ab", jax.devices()[:2]))
  want = reference(store, a, _requests(), poll_steps=4)
  return store, a, b, want


def test_running_samples_move_to_idle_worker(live):
  store, a, b, want = live
  mgr = manager_lib.RolloutManager(store, max_new_tokens=M, theta=100,
                                   poll_steps=2, plateau=1)
  mgr.add(manager_lib.LocalHandle(a))  # Admits all 4 samples at once.
  rounds = []

  def join(m):
    rounds.append(1)
    if len(rounds) == 2:  # b joins idle while a decodes 4 > B samples.
      m.add(manager_lib.LocalHandle(b))
  mgr.on_poll = join
  samples = mgr.run(_requests())
  _check(samples, want)  # Nothing lost, nothing duplicated, same tokens.
  st = mgr.stats
  assert st.moved_running >= 2 and st.kept_tokens > 0
  assert st.balanced_requests == 0 and st.preemptions == 0
  assert mgr.produced["a"] > 0 and mgr.produced["b"] > 0
  assert not a.driver.busy and not b.driver.busy


def test_take_running_cuts_most_budget_left_and_source_never_emits_it(live):
  """The cut samples free their slots at once (a group with none left its
  entry and pages too), the continuations take them on the same worker,
  and nothing of the cut samples comes out of the source."""
  from rlhf_jax.workers import continuation

  store, a, _, want = live
  a.pull(store)
  budgets = [(4, 5), (9, 11)]  # Request 1's samples have the most left.
  a.submit(_requests(budgets=budgets))
  res = a.poll(3)
  assert not res.finished and len(res.partials) == 4
  used = a.driver.pool.num_used
  cut = a.take_running(3)  # Single samples: budget left 8, 6, then 2.
  assert [(p.request.prompt_id, p.sample_idx) for p in cut] == [
      (0, 1), (1, 0), (1, 1)]
  assert [len(p.tokens) for p in cut] == [3, 3, 3]
  # 3 slots free; request 1's group freed its entry and prompt pages,
  # prompt 0's keeps its entry for the sample left.
  assert len(a.driver.live) == 1 and list(a.driver.groups.values())[
      0].request.prompt_id == 0
  assert a.driver.pool.num_used < used
  assert [(p.request.prompt_id, p.sample_idx)
          for p in a.driver.partials()] == [(0, 0)]
  a.submit([continuation.continuation(p) for p in cut])
  finished = []
  while a.driver.busy:
    finished += a.poll(4).finished
  assert a.driver.pool.num_used == 0
  heads = {(p.request.prompt_id, p.sample_idx): p for p in cut}
  assert sorted(s.key for s in finished) == sorted(
      (p, i) for p in range(2) for i in range(2))
  samples = []
  for s in finished:
    if s.key in heads:  # A continuation: its prompt is prompt + head.
      head = heads[s.key]
      assert s.prompt_tokens.size == head.request.tokens.size + len(
          head.tokens)
      s = continuation.merge(head.request.tokens, head, s)
    samples.append(s)
  budget = {(p, i): budgets[p][i] for p in range(2) for i in range(2)}
  _check(samples, want, budget)


def test_measure_plateau(live):
  store, _, b, _ = live
  b.pull(store)  # Weights, whichever test of the module ran first.
  slots = b.engine.num_slots
  # Two fractions: 0.8 and 0.25 (the paged engine runs only the listed
  # live slots: its step time grows with b).
  for fraction in (0.8, 0.25):
    plateau = b.measure_plateau(fraction=fraction, steps=2)
    # Measured at 1 sample and at every multiple of the row size (G=2).
    assert slots == 4 and sorted(b.plateau_step_s) == [1, 2, 4]
    counts = np.array(sorted(b.plateau_step_s), float)
    times = np.array([b.plateau_step_s[c] for c in sorted(b.plateau_step_s)])
    assert (times > 0).all()
    # Oracle (numpy, from the measured step times): throughput(b) = b /
    # step time, linear between measured counts; B is the smallest batch
    # reaching `fraction` of the full batch's throughput.
    batch = np.arange(1, slots + 1)
    throughput = batch / np.interp(batch, counts, times)
    reaches = throughput >= fraction * throughput[-1]
    assert plateau == batch[np.argmax(reaches)], (fraction, times)
    assert reaches[plateau - 1] and not reaches[:plateau - 1].any()
  # Measured on a state and pool of its own: the driver's stay empty.
  assert not b.driver.busy and not b.driver.live and not b.driver.groups
  assert b.driver.pool.num_used == 0
