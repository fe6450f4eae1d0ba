"""Elastic rollout workers on the paged engine: a preempted worker loses
nothing, running samples move one at a time to an idle worker, and every
sample's tokens equal an uninterrupted run on a `worker_env.SPEC` worker
(the oracle: another engine, its pool sized for every slot, nothing cut or
preempted); every page goes back to its pool."""

import dataclasses

import jax
import numpy as np
import pytest

from rlhf_jax.workers import continuation
from rlhf_jax.workers import manager as manager_lib
from rlhf_jax.workers.worker import RolloutWorker
from test_workers import _Preempted
from worker_env import M, SPEC, check as _check, published_store
from worker_env import reference, requests

# 4 slots and 12 pages of 4 tokens per worker: a group's prompt takes 2
# pages, a sample of 12 tokens 4, so 4 live samples outgrow the pool and
# the newest is preempted (recomputed later with the same tokens). One
# decode step a call: the polls land mid-response, as the cases need.
PAGED = dataclasses.replace(SPEC, paged=dict(page_size=4, num_pages=12,
                                             num_slots=4, decode_window=1))


@pytest.fixture(scope="module")
def env(mesh8):
  del mesh8
  store, _ = published_store()
  devices = jax.devices()
  oracle = RolloutWorker("oracle", SPEC, devices=devices[:1])
  paged = [RolloutWorker(f"p{i}", PAGED, devices=[devices[i + 1]])
           for i in range(3)]
  want = reference(store, oracle, requests(), poll_steps=3)
  return store, paged, want


def _assert_pages_returned(*workers):
  for w in workers:
    assert not w.driver.busy and w.driver.pool.num_used == 0, w.worker_id


def test_spec_builds_the_paged_engine(env):
  _, (a, _, _), _ = env
  eng = a.engine
  assert (eng.num_slots, eng.num_pages, eng.page_size) == (4, 12, 4)
  assert PAGED.slots == 4 and SPEC.slots == SPEC.num_rows * 2
  assert dataclasses.replace(PAGED, paged=dict(
      page_size=4, num_pages=0, num_slots=0)).slots == SPEC.slots


def test_preempted_paged_worker_loses_nothing(env):
  store, (a, b, _), want = env
  mgr = manager_lib.RolloutManager(store, max_new_tokens=M, theta=1,
                                   poll_steps=3)
  dying = _Preempted(a, polls=2)   # Dies mid-response.
  mgr.add(dying)
  mgr.add(manager_lib.LocalHandle(b))
  samples = mgr.run(requests())
  _check(samples, want)
  st = mgr.stats
  assert st.preemptions == 1 and st.migrated_samples > 0
  assert st.kept_tokens > 0
  assert b.driver.paged.preemptions > 0  # The pool ran out, too.
  _assert_pages_returned(b)


def test_running_samples_move_to_idle_paged_worker(env):
  store, (a, b, _), want = env
  mgr = manager_lib.RolloutManager(store, max_new_tokens=M, theta=100,
                                   poll_steps=2, plateau=1)
  mgr.add(manager_lib.LocalHandle(a))  # Takes all 6 requests.
  rounds = []

  def join(m):
    rounds.append(1)
    if len(rounds) == 2:
      m.add(manager_lib.LocalHandle(b))
  mgr.on_poll = join
  samples = mgr.run(requests())
  _check(samples, want)
  st = mgr.stats
  assert st.moved_running >= 1 and st.preemptions == 0
  assert mgr.produced["p0"] > 0 and mgr.produced["p1"] > 0
  _assert_pages_returned(a, b)


def test_take_running_cuts_single_samples_most_budget_left_first(env):
  """Single samples leave (not whole groups): their slots and pages free
  at once, their group-mates keep decoding, nothing of them comes out of
  the source, and their continuations finish with the oracle's tokens."""
  store, (_, _, c), want = env
  c.pull(store)
  budgets = [(4, 5), (9, 11)]
  reqs = requests(2, rng_seed=0, seed=3, budgets=budgets)
  c.submit(reqs)
  res = c.poll(3)
  assert not res.finished and len(res.partials) == 4
  left = c.driver.budget_left()
  cut = c.take_running(2)
  # The two with the most budget left: request 1's samples, 11 and 9.
  assert [(p.request.prompt_id, p.sample_idx) for p in cut] == [(1, 0),
                                                                (1, 1)]
  assert all(left[1, i] == budgets[1][i] - len(p.tokens)
             for i, p in enumerate(cut))
  assert {p.request.prompt_id for p in c.driver.partials()} == {0}
  assert len(c.driver.groups) == 1  # Request 1's entry and pages freed.
  c.submit([continuation.continuation(p) for p in cut])
  finished = []
  while c.driver.busy:
    finished += c.poll(4).finished
  heads = {(p.request.prompt_id, p.sample_idx): p for p in cut}
  samples = [continuation.merge(heads[s.key].request.tokens, heads[s.key], s)
             if s.key in heads else s for s in finished]
  budget = {(p, i): budgets[p][i] for p in range(2) for i in range(2)}
  _check(samples, {k: want[k] for k in budget}, budget)
  _assert_pages_returned(c)


def test_measure_plateau_on_paged_engine(env):
  store, (_, _, c), _ = env
  c.pull(store)
  plateau = c.measure_plateau(fraction=0.8, steps=2)
  counts = np.array(sorted(c.plateau_step_s), float)
  assert counts.tolist() == [1, 2, 4]  # 1, each multiple of G=2, slots.
  times = np.array([c.plateau_step_s[n] for n in counts.astype(int)])
  assert (times > 0).all()
  # Oracle (numpy, from the measured step times).
  batch = np.arange(1, 5)
  throughput = batch / np.interp(batch, counts, times)
  assert plateau == batch[np.argmax(throughput >= 0.8 * throughput[-1])]
  with pytest.raises(ValueError, match="do not fit"):
    c.measure_plateau(counts=[4], steps=40)  # 4 x 11 pages > 12.
