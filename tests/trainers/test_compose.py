"""The rollout layers compose: common prefix, long-tail policies and elastic
workers all on at once give the plain run's samples, rewards and losses."""


import numpy as np
import pytest

import fakes

pytestmark = pytest.mark.slow


def _assert_same_samples(ours, plain):
  assert [s.key for s in ours.samples] == [s.key for s in plain.samples]
  for a, b in zip(ours.samples, plain.samples):
    assert a.tokens == b.tokens, a.key
    np.testing.assert_allclose(a.logp_raw, b.logp_raw, atol=1e-5)
  np.testing.assert_allclose(ours.rewards, plain.rewards, rtol=1e-5)


def test_gsm8k_prefix_long_tail_and_workers_equal_plain(mesh8, tmp_path,
                                                        round_clock):
  """configs/gsm8k_grpo.py:runlocal (a ChatML system turn in front of every
  prompt) with the common prefix stored once, the long-tail policies on the
  trainer's engine while it seeds, and 2 local elastic workers; the
  rollout also runs its layers unrolled (`rollout.unroll_layers`, the
  trainer's engine and the workers'); the plain run scans them."""
  del mesh8
  from configs import gsm8k_grpo
  from rlhf_jax.data import sources
  from rlhf_jax.trainers import rl_job

  c = sources.prepare(gsm8k_grpo.get_config("runlocal"), str(tmp_path))
  assert c.rollout.max_common_length > 0
  # Long responses with a tail: the untrained model rarely stops early.
  c.rollout.update(max_new_tokens=12, max_seq_len=80, unroll_layers=True)
  c.rollout.long_tail.update(enabled=True, consolidate_below=0.6)
  # The trainer's engine seeds and never hands off in this short rollout:
  # it decodes beside the workers (its long-tail policies on), the workers
  # take requests from the start (JSQ, theta 1).
  c.rollout.workers.update(num=2, kind="local", theta=1, poll_steps=1,
                           seed=True, seed_init_s=1e6)
  job = rl_job.build(c)
  fakes.watch_rounds(job, round_clock)
  prompts = next(job.iterator)
  plain_job = fakes.with_sampler(job, fakes.plain_rollout(job))
  seen, seen_plain = fakes.capture_samples(job), fakes.capture_samples(
      plain_job)
  _, ours = fakes.first_step(job, prompts)
  _, plain = fakes.first_step(plain_job, prompts)
  _assert_same_samples(seen[0], seen_plain[0])
  for k in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss",
            "train/grad_norm", "train/kl"):
    np.testing.assert_allclose(ours[k], plain[k], rtol=1e-5, err_msg=k)
  assert ours["rollout/common_prefix_len"] >= 16
  assert plain["rollout/common_prefix_len"] == 0
  assert ours["rollout/consolidations"] >= 1
  assert ours["workers/tokens"] > 0 and ours["workers/trainer_tokens"] > 0
  assert ours["train/grad_norm"] > 0
  engines = [job.sampler.seed_window.worker.engine] + [
      h.worker.engine for h in job.sampler.manager.handles.values()]
  assert len(engines) == 3 and {type(e).__name__ for e in engines} == {
      "Engine"}
  assert {e.cfg.scan_layers for e in engines} == {False}
  assert job.cfg.scan_layers  # The trainer and the plain run scan.
