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
  from rlhf_jax.trainers import grpo

  c = tiny_grpo.get_config("runlocal")
  c.rollout.workers.update(num=2, theta=2, poll_steps=2, seed=True,
                           seed_init_s=2.0, seed_eta=2.0, seed_floor_s=0.5)
  job = grpo.build(c)
  window, mgr = job.rollout.seed_window, job.rollout.manager
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


def test_seed_window_caps_the_held_workers():
  """From the third seeded run on, the N_prem cap bounds the pool."""
  from rlhf_jax.sched import offload
  from rlhf_jax.workers.seeding import SeedWindow

  window = SeedWindow.__new__(SeedWindow)  # No engine needed for the cap.
  window.controller = offload.SeedWindowController(n_resv=1, t_init=1.0,
                                                    floor=0.5)
  assert window.worker_cap is None
  window.controller.update(offload.StepObservation(
      t_train_wait=0.0, t_remote_wait=0.0, t_train=4.0, t_remote=2.0,
      n_prem=3.0, n_prem_next=3))
  # (t_remote * n_prem + t_seed * n_resv) / t_train = (6 + 1) / 4.
  assert window.worker_cap == pytest.approx(1.75)
