"""Scale to demand: the worker pool holds what the cost-aware policy picks,
bills worker-seconds only while held, and releasing a worker mid-batch
changes no token."""

import functools
import types

import jax
import numpy as np
import pytest

import fakes
from rlhf_jax.sched.length_history import LengthHistory
from rlhf_jax.workers import manager as manager_lib
from rlhf_jax.workers import demand_pool as pool_lib
from rlhf_jax.workers.worker import RolloutWorker
from worker_env import M, SPEC, check as _check, published_store
from worker_env import reference, requests as _requests
SLOTS = SPEC.slots


class _Fake:
  """A handle without an engine: 10 decode steps per second of work."""

  timeout_s = float("inf")

  def __init__(self, worker_id):
    self.worker_id, self.alive, self.killed = worker_id, True, False
    self.steps, self.secs = 0, 0.0

  def call_async(self, name, *args):
    del args
    if name == "counters":
      self.steps, self.secs = self.steps + 10, self.secs + 1.0
      return self.steps, self.secs
    return None

  def done(self, future):
    del future
    return True

  def result(self, future):
    return future

  def kill(self):
    self.alive, self.killed = False, True


class _Slow(_Fake):
  """Ready `start_s` after it is spawned (a Ray actor starting its process);
  its first rollout takes `compile_s` more."""

  def __init__(self, worker_id, clock, start_s, compile_s):
    super().__init__(worker_id)
    self.clock, self.ready_at = clock, clock() + start_s
    self.compile_s = compile_s

  def call_async(self, name, *args):
    if name == "counters" and self.steps == 10:  # After its first rollout.
      self.secs += self.compile_s
    return super().call_async(name, *args)

  def done(self, future):
    del future
    return self.clock() >= self.ready_at

  def result(self, future):
    self.clock.t = max(self.clock.t, self.ready_at)
    return future


def _fake_pool(n, clock):
  mgr = manager_lib.RolloutManager(None, max_new_tokens=M)
  pool = pool_lib.WorkerPool(mgr, clock=clock)
  spawned = []

  def spawn(wid):
    spawned.append(_Fake(wid))
    return spawned[-1]
  for i in range(n):
    pool.offer(f"w{i}", functools.partial(spawn, f"w{i}"))
  return mgr, pool, spawned


def test_hold_release_acquire_bills_only_while_held():
  clock = fakes.Clock()
  mgr, pool, spawned = _fake_pool(4, clock)
  assert pool.available == 4 and pool.hold(2) == 2
  assert list(mgr.handles) == list(pool.held) == ["w0", "w1"]
  clock.t = 10.0
  assert pool.hold(3) == 3 and "w2" in mgr.handles
  clock.t = 15.0
  assert pool.hold(1) == 1  # The newest go first: w2, then w1.
  assert list(mgr.handles) == ["w0"]
  assert [h.killed for h in spawned] == [False, True, True]
  assert pool.worker_seconds == 15 + 15 + 5
  clock.t = 20.0
  assert pool.record()["worker_s"] == 40  # w0 alone keeps counting.
  clock.t = 30.0
  assert pool.hold(2) == 2 and len(spawned) == 4  # w1 is started again.
  clock.t = 31.0
  assert pool.record() == {"held": 2, "worker_s": 10 + 1 + 1}
  spawned[0].kill()  # A preemption: billed until the pool notices it.
  clock.t = 33.0
  assert pool.hold(2) == 2 and list(pool.held) == ["w1", "w2"]
  assert pool.worker_seconds == 20 + 33 + 3 + 0  # w0 stopped at 33.
  # w0 is offered again once the manager has requeued the dead one's work.
  assert pool.hold(9) == 3
  clock.t = 34.0
  assert pool.close() == 56 + 3 and list(mgr.handles) == ["w0"]


def test_replayed_trace_offers_workers_the_pool_may_leave_unused():
  """Replayer joins become offers; only held ones bill; a held one the
  trace removes is replaced from the rest of the offer."""
  from rlhf_jax.sim.availability import SpotEvent
  from rlhf_jax.workers.replay import AvailabilityReplayer

  clock = fakes.Clock()
  trace = [SpotEvent(0, "a", "add"), SpotEvent(0, "b", "add"),
           SpotEvent(3, "a", "remove"), SpotEvent(5, "b", "remove")]
  replay = AvailabilityReplayer(trace, _Fake, clock=clock)
  mgr = manager_lib.RolloutManager(None, max_new_tokens=M)
  pool = pool_lib.WorkerPool(mgr, clock=clock, source=replay)
  mgr.on_poll = pool
  pool.hold(1)
  pool(mgr)
  assert list(pool.held) == ["a"] and pool.available == 2
  clock.t = 3.0
  pool(mgr)  # a is preempted: b takes over.
  assert list(pool.held) == ["b"] and pool.available == 1
  clock.t = 4.0
  pool.hold(0)  # Released: the spot instance goes back to the cloud.
  assert pool.available == 0 and replay.handles["b"].killed
  clock.t = 5.0
  pool(mgr)
  assert pool.close() == 3 + 1 and replay.close() == 3 + 5


def test_policy_known_answer():
  """8 prompts x 2 samples of predicted length 10, 4 slots per worker,
  1 s per step, 5 s startup: T and C by hand."""
  history = LengthHistory()
  for p in range(7):
    history.update(p, [8.0, 12.0])
  lengths, how = pool_lib.predicted_lengths(history, range(8), 64)
  assert lengths == dict.fromkeys(range(8), 10.0)  # 7: the mean of known.
  assert how == {"known_prompts": 7, "default_len": 10.0}
  assert pool_lib.predicted_lengths(LengthHistory(), [3], 64)[0] == {3: 32}
  pick = functools.partial(pool_lib.choose_worker_count, lengths, 2,
                           available=4, slots=4, step_s=1.0, startup_s=5.0)
  n, table = pick(lam=0.0)
  assert table == {1: (45, 45), 2: (25, 50), 3: (25, 65), 4: (15, 60)}
  assert n == 1                     # Cheapest: one worker, 4 waves.
  assert pick(lam=0.1)[0] == 2
  assert pick(lam=1.0)[0] == 4      # Fastest.
  # 2 held now; a new worker decodes 40 s later and is billed for them:
  # T(3) = T(4) = 15 or 25 + 40 > T(2), so the fastest keeps 2.
  n, table = pick(lam=1.0, spawn_s=40.0, held=2)
  assert table == {1: (45, 45), 2: (25, 50), 3: (55, 105), 4: (55, 140)}
  assert n == 2 and pick(lam=1.0, spawn_s=0.0, held=2)[0] == 4


def test_pool_measures_spawn_and_scaler_counts_it():
  """Workers ready 5 s after spawn() whose first rollout compiles for 2 s:
  the start-up is measured, billed, and keeps lambda=1 from growing."""
  clock = fakes.Clock()
  mgr = manager_lib.RolloutManager(None, max_new_tokens=M)
  pool = pool_lib.WorkerPool(mgr, clock=clock)
  for i in range(4):
    pool.offer(f"w{i}", functools.partial(_Slow, f"w{i}", clock, 5.0, 2.0))
  assert pool.spawn_s == 0.0 and pool.hold(1) == 1
  assert clock.t == 5.0 and pool.spawn_s == 5.0
  assert pool.worker_seconds == 5.0  # Billed while starting.
  scaler = pool_lib.DemandScaler(pool, scale="cost", lam=1.0, slots=4,
                                 max_new_tokens=20)
  scaler.step_s = 0.1  # As if measured (10 steps per second of work).
  samples = [types.SimpleNamespace(prompt_id=p, tokens=[0] * 10)
             for p in range(8) for _ in range(2)]
  # T(1) = 4 waves x 10 x 0.1 s; T(4) = 5 + 1 wave x 10 x 0.1 s.
  d = scaler.begin(range(8), 2)
  assert d["spawn_s"] == 5.0 and d["held_before"] == 1
  assert d["chosen"] == d["held"] == 1 and d["spawned"] == 0
  assert d["table"][4] == pytest.approx((6.0, 1.0 + 3 * 6.0))
  clock.t += 1.0
  m = scaler.end(samples)  # w0's first rollout: 10 steps in 1 + 2 s.
  assert scaler.compile_s == pytest.approx(2.0)
  assert m["workers/spawn_s"] == 5.0 and m["workers/spawned"] == 0
  assert scaler.begin(range(8), 2)["spawn_s"] == pytest.approx(7.0)
  pool.startups.clear()
  scaler.compiles.clear()  # Free start-ups: the fastest grows to 4.
  d = scaler.begin(range(8), 2)
  assert d["spawn_s"] == 0.0 and d["held"] == 4 and d["spawned"] == 3
  # Not waited for: w0 decodes while the 3 start (billed from the start).
  assert clock.t == 6.0 and list(mgr.handles) == ["w0"]
  clock.t = 11.0
  pool(mgr)  # The manager's poll-round hook admits the ready ones.
  assert list(mgr.handles) == ["w0", "w1", "w2", "w3"]
  assert pool.startups == [5.0] * 3 and pool.worker_seconds == 11 + 3 * 5


def test_a_worker_that_never_starts_is_dropped():
  """Silent past its timeout: killed, billing stops, the offer stays."""
  clock = fakes.Clock()
  mgr = manager_lib.RolloutManager(None, max_new_tokens=M)
  pool = pool_lib.WorkerPool(mgr, clock=clock)
  pool.offer("w0", lambda: _Fake("w0"))
  never = _Slow("w1", clock, 1e9, 0.0)
  never.timeout_s = 30.0
  pool.offer("w1", lambda: never)
  assert pool.hold(2) == 2 and list(mgr.handles) == ["w0"]
  clock.t = 31.0
  pool(mgr)
  assert never.killed and list(pool.held) == ["w0"] and pool.available == 2
  assert pool.worker_seconds == 31.0 + 31.0  # w1 billed until dropped.


def test_scaler_measures_then_chooses():
  clock = fakes.Clock()
  mgr, pool, _ = _fake_pool(4, clock)
  scaler = pool_lib.DemandScaler(pool, scale="cost", lam=0.0, slots=4,
                                 max_new_tokens=20)
  samples = [types.SimpleNamespace(prompt_id=p, tokens=[0] * 10)
             for p in range(8) for _ in range(2)]
  for _ in range(2):  # Unmeasured: every worker; then the baseline.
    assert scaler.begin(range(8), 2)["unmeasured"]
    assert len(mgr.handles) == 4
    clock.t += 1.0
    m = scaler.end(samples, pull_s=0.5, pulls=1)
  assert scaler.step_s == pytest.approx(0.1) and scaler.startup_s == 0.5
  assert m["workers/held"] == 4 and m["workers/worker_s"] == 4.0
  d = scaler.begin(range(8), 2)  # T(1) = 0.5 + 4 waves x 10 x 0.1 s.
  assert d["chosen"] == d["held"] == 1 and len(mgr.handles) == 1
  assert d["table"][1] == pytest.approx((4.5, 4.5))
  clock.t += 1.0
  m = scaler.end(samples)
  assert m["workers/worker_s"] == 1.0 and m["workers/chosen"] == 1
  assert m["workers/predicted_T_s"] == pytest.approx(4.5)
  scaler.lam = 1.0
  # Capped: N_prem 2.7 allows round(2.7 + 0.5) = 3 workers, the rounding
  # of `sched.offload.cap_count` (Algorithm 1's, shared with the simulator).
  assert scaler.begin(range(8), 2, cap=2.7)["held"] == 3
  assert scaler.begin(range(8), 2, cap=1.2)["held"] == 2
  assert scaler.begin(range(8), 2)["held"] == 4


def test_config_errors():
  from configs import tiny_grpo
  from rlhf_jax.config.sections import ConfigError, RLJob

  for key, value in (("scale", "fast"), ("cost_lambda", 1.5),
                     ("cost_lambda", -0.1), ("gpus_per_worker", -1.0),
                     ("ray_resources", {"spot": 0})):
    c = tiny_grpo.get_config("runlocal")
    c.rollout.workers.update(num=2, **{key: value})
    with pytest.raises(ConfigError, match=f"config.rollout.workers.{key}="):
      RLJob.from_config(c)
  c = tiny_grpo.get_config("runlocal")
  c.rollout.workers.update(num=2, scale="cost", cost_lambda=0.0)
  RLJob.from_config(c)


def test_ray_worker_asks_for_its_resources():
  """Accelerators and spot-only placement are actor resource requests."""
  pytest.importorskip("ray")
  from rlhf_jax.workers.worker import ray_worker

  options = ray_worker(num_cpus=2, num_gpus=1,
                       resources={"TPU": 4, "spot": 1})._default_options
  assert options["num_cpus"] == 2 and options["num_gpus"] == 1
  assert options["resources"] == {"TPU": 4, "spot": 1}
  assert options["max_restarts"] == 0  # A dead worker is requeued, not
                                       # restarted with lost state.


# ------------------------------------------------ on real 1-device engines
@pytest.fixture(scope="module")
def env(mesh8):
  del mesh8
  store, _ = published_store()
  workers = [RolloutWorker(f"w{i}", SPEC, devices=[d])
             for i, d in enumerate(jax.devices()[6:8])]
  want = reference(store, workers[0], _requests(), poll_steps=4)
  return store, workers, want


def _local_pool(mgr, workers, clock=None):
  pool = pool_lib.WorkerPool(mgr, **({"clock": clock} if clock else {}))
  for w in workers:
    pool.offer(w.worker_id, functools.partial(manager_lib.LocalHandle, w))
  return pool


def test_release_mid_batch_loses_nothing(env):
  store, workers, want = env
  clock = fakes.Clock()
  mgr = manager_lib.RolloutManager(store, max_new_tokens=M, theta=1,
                                   poll_steps=2)
  pool = _local_pool(mgr, workers, clock)
  pool.hold(2)
  mgr.start(_requests())
  rounds = 0
  while not mgr.done:
    if rounds == 2:
      pool.hold(1)  # w1 leaves mid-response: its samples continue on w0.
    if rounds == 5:
      pool.hold(2)  # w1 is held again: it pulls the weights and helps.
    mgr.step()
    rounds += 1
    clock.t += 1.0
  _check(mgr.results(), want)
  st = mgr.stats
  assert st.migrated_samples > 0 and st.kept_tokens > 0
  assert st.preemptions == 0 and mgr.produced["w1"] > 0
  assert rounds > 5 and pool.worker_seconds == rounds + 2 + (rounds - 5)


def test_generate_holds_the_chosen_count(env):
  """An `ElasticRollout` on a cost-scaled pool: every worker until a step
  time is measured, then 1 worker at lambda=0 (the 12 samples of length 12
  fill 4 slots in 3 waves: 36 steps vs 2 x 24 on 2 workers) and 2 at
  lambda=1; the tokens never change."""
  from rlhf_jax.rollout.base import generate
  from rlhf_jax.rollout.elastic import ElasticRollout

  store, workers, want = env
  reqs = _requests()
  prompts = fakes.prompt_batch(reqs)
  mgr = manager_lib.RolloutManager(store, max_new_tokens=M, theta=2,
                                   poll_steps=4)
  scaler = pool_lib.DemandScaler(
      _local_pool(mgr, workers), scale="cost", lam=0.0, slots=SLOTS,
      max_new_tokens=M)
  rollout = ElasticRollout(mgr, scaler=scaler)
  rollout.set_weights(None, 0)  # Published already.
  held = []
  for lam in (0.0, 0.0, 0.0, 1.0):
    scaler.lam = lam
    sampled = generate(rollout, prompts, 2, seed=3)
    _check(sampled.samples, want)
    metrics = sampled.metrics
    held.append(metrics["workers/held"])
    assert metrics["workers/worker_s"] > 0
  assert held == [2, 2, 1, 2]
  assert metrics["workers/chosen"] == 2 and metrics["workers/step_s"] > 0
  history = rollout.length_history
  assert history.predict(0, 0.0) == M and history.known(5)
