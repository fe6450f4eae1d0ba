"""Adaptive offload: the trainer's engine seeds a GRPO step's rollout for
T_seed, hands its unfinished samples to the workers mid-response, and the
step equals the trainer-only step; T_seed then moves by Algorithm 1."""

import numpy as np
import pytest

import fakes
from rlhf_jax.config.sections import ConfigError


@pytest.mark.slow
def test_seeded_grpo_step_matches_trainer_only(mesh8, round_clock):
  del mesh8
  from configs import tiny_grpo
  from rlhf_jax.trainers import rl_job

  c = tiny_grpo.get_config("runlocal")
  c.rollout.workers.update(num=2, theta=2, poll_steps=2, seed=True,
                           seed_init_s=2.0, seed_eta=2.0, seed_floor_s=0.5)
  job = rl_job.build(c)
  window, mgr = job.sampler.seed_window, job.sampler.manager
  fakes.watch_rounds(job, round_clock)
  prompts = next(job.iterator)
  _, plain = fakes.first_step(job, prompts, fakes.local_rollout(job))
  _, ours = fakes.first_step(job, prompts)
  for k in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss",
            "train/grad_norm"):
    np.testing.assert_allclose(ours[k], plain[k], rtol=1e-5, err_msg=k)
  assert ours["rollout/stale_dropped"] == 0
  # Two rounds of seeding: some samples finished on the trainer's engine,
  # the unfinished ones moved mid-response to the workers.
  assert ours["workers/t_seed_s"] == 2.0
  n = c.train.prompts_per_step * c.rollout.samples_per_row
  assert 0 < ours["workers/seeded_samples"] < n
  assert ours["workers/migrated_samples"] > 0
  assert mgr.stats.kept_tokens > 0
  assert ours["workers/tokens"] > 0 and ours["workers/trainer_tokens"] > 0
  assert min(v for w, v in mgr.produced.items() if w != "trainer") > 0
  # Algorithm 1, exactly: T_seed += (train wait - remote wait) / eta.
  want = max(0.5, 2.0 + (ours["workers/train_wait_s"]
                         - ours["workers/remote_wait_s"]) / 2.0)
  assert ours["workers/t_seed_next_s"] == pytest.approx(want)
  assert window.controller.t_seed == pytest.approx(want)
  assert "trainer" not in mgr.handles
  assert window.worker.params is None  # The trainer's devices are free.


def test_seed_config_errors():
  from configs import tiny_grpo
  from rlhf_jax.config.sections import RLJob

  c = tiny_grpo.get_config("runlocal")
  c.rollout.workers.update(num=1, seed=True, seed_eta=0.0)
  with pytest.raises(ConfigError, match="seed_eta"):
    RLJob.from_config(c)


def test_seed_window_caps_the_held_workers(mesh8):
  """From the third seeded run on, the N_prem cap bounds the pool.

  Four rollouts of an `ElasticRollout` whose trainer engine seeds each one
  (T_seed 1 poll round) beside a pool of 2 one-device workers that holds
  every available worker unless capped. Runs 1 and 2 set no cap (their
  train times include compilation); run 3 sets N_prem = (t_remote * n_prem
  + T_seed * N_resv) / t_train, by hand from its observation; run 4 holds
  cap_count(2, N_prem) = 1 worker (t_train = 1000 s puts N_prem far below
  0.5). The tokens never change."""
  import functools
  import types

  import jax

  from rlhf_jax.rollout.base import generate
  from rlhf_jax.rollout.elastic import ElasticRollout
  from rlhf_jax.sched import offload
  from rlhf_jax.workers import manager as manager_lib
  from rlhf_jax.workers import demand_pool as pool_lib
  from rlhf_jax.workers.seeding import TRAINER_ID, SeedWindow
  from rlhf_jax.workers.worker import RolloutWorker
  from worker_env import M, SPEC, check, published_store, reference
  from worker_env import requests as make_requests

  del mesh8
  store, params = published_store()
  d0, d1, d2 = jax.devices()[:3]
  workers = [RolloutWorker(f"w{i}", SPEC, devices=[d])
             for i, d in ((1, d1), (2, d2))]
  want = reference(store, workers[0], make_requests(), poll_steps=2)
  # The trainer's engine (one device) and the step's params in its layout.
  engine = RolloutWorker("t", SPEC, devices=[d0]).engine
  local = types.SimpleNamespace(
      engines=types.SimpleNamespace(engine=lambda: engine),
      start_driver=None)
  clock = fakes.Clock()
  window = SeedWindow(local, offload.SeedWindowController(
      n_resv=1, t_init=1.0, eta=3.0, floor=0.5), clock=clock)
  ctl, seen = window.controller, []
  update = ctl.update

  def spy(obs):  # Each observation and the T_seed it leads to.
    update(obs)
    seen.append((obs, ctl.t_seed))
  ctl.update = spy
  mgr = manager_lib.RolloutManager(store, max_new_tokens=M, theta=2,
                                   poll_steps=2)
  mgr.on_poll = clock.tick  # One second per poll round.
  pool = pool_lib.WorkerPool(mgr)
  for w in workers:
    pool.offer(w.worker_id, functools.partial(manager_lib.LocalHandle, w))
  rollout = ElasticRollout(
      mgr, scaler=pool_lib.DemandScaler(pool, scale="all", slots=4,
                                        max_new_tokens=M),
      seed_window=window, train_time=lambda step: 1000.0)
  rollout.set_weights(jax.device_put(params, engine.param_shardings), 0)
  reqs = make_requests()
  prompts = fakes.prompt_batch(reqs)
  held, caps = [], []
  for run in range(1, 5):
    sampled = generate(rollout, prompts, 2, seed=3, step=run)
    check(sampled.samples, want)
    held.append(sampled.metrics["workers/held"])
    caps.append(window.worker_cap)
    # The trainer's engine decoded beside the workers, then handed off.
    assert sampled.metrics["workers/trainer_tokens"] > 0, run
    assert TRAINER_ID not in mgr.handles
  # The train time reaches the controller from the third run on only.
  assert [o.t_train for o, _ in seen] == [0.0, 0.0, 1000.0, 1000.0]
  assert caps[:2] == [None, None]
  for (obs, t_seed), cap in list(zip(seen, caps))[2:]:
    assert obs.t_remote > 0 and obs.n_prem > 0
    assert cap == pytest.approx(
        (obs.t_remote * obs.n_prem + t_seed * 1) / 1000.0)
  assert caps[2] < 0.5  # cap_count(2, cap) = 1.
  assert held == [2, 2, 2, 1]
