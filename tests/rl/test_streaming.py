"""Micro-batch streaming: the trainer trains on finished groups while the
workers finish the rest, and the step's update equals the whole-batch one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fakes
from rlhf_jax.config.sections import ConfigError


def _config(**workers):
  from configs import tiny_grpo

  c = tiny_grpo.get_config("runlocal")
  c.rl.update(num_minibatches=1, stream=True, stream_parts=2)
  c.optim.warmup_steps = 0  # The first update moves the params.
  c.rollout.workers.update({**dict(num=2, theta=2, poll_steps=1), **workers})
  return c


@pytest.mark.parametrize("seed,pack_length", [(True, 0), (False, 0),
                                              (False, 40)])
@pytest.mark.slow
def test_streamed_step_equals_whole_batch_step(mesh8, round_clock, seed,
                                              pack_length):
  """(pack_length: every part, and the whole batch, in packed rows.)"""
  del mesh8
  from rlhf_jax.trainers import rl_job

  c = _config(seed=seed, seed_init_s=1.0)
  c.rl.pack_length = pack_length
  job = rl_job.build(c)
  if seed:
    fakes.watch_rounds(job, round_clock)
  prompts = next(job.iterator)
  plain_state, plain = fakes.first_step(  # Trainer-only, whole batch.
      fakes.whole_batch(job), prompts, fakes.local_rollout(job))
  state, ours = fakes.first_step(job, prompts)
  for k in ("rollout/reward_mean", "rollout/response_len_mean",
            "rewards/addition", "train/loss", "train/grad_norm"):
    np.testing.assert_allclose(ours[k], plain[k], rtol=1e-5, err_msg=k)
  assert ours["rollout/logprob_gap"] < 1e-4  # fp32 noise: same weights.
  moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                       plain_state.params, job.params)
  assert max(jax.tree.leaves(moved)) > 1e-4  # The update did something.
  # Adam's first update is ~lr * sign(grad): a gradient at fp32 noise level
  # may move by a fraction of lr, a wrong one by ~2 lr.
  diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                      state.params, plain_state.params)
  assert max(jax.tree.leaves(diff)) < 0.05 * c.optim.learning_rate
  assert int(state.step) == int(plain_state.step) == 1
  assert ours["stream/parts"] == 2
  # Part of the batch was trained on before the rollout ended.
  assert 0 < ours["stream/groups_during_rollout"] < c.train.prompts_per_step
  assert state.params is not None and not any(
      x.is_deleted() for x in jax.tree.leaves(state.params))
  if seed:
    assert ours["workers/seeded_samples"] > 0
    # The trainer trained during part of its wait: less than all of it idle.
    rounds_after_handoff = round_clock.t - ours["workers/handoff_s"]
    assert ours["workers/train_wait_s"] < rounds_after_handoff


@pytest.mark.slow
def test_streamed_minibatches_are_updates_in_arrival_order(mesh8,
                                                          monkeypatch):
  """rl.num_minibatches=2: the first update is applied as soon as its half
  of the groups is in; each equals a learner step on its groups in arrival
  order, with old log-probs of the step's weights."""
  del mesh8
  from rlhf_jax.trainers import rl_job

  c = _config()
  c.rl.num_minibatches = 2
  job = rl_job.build(c)
  parts, old_params, real = [], [], job.algorithm.batch

  def spy(samples, rewards, keep, params, ref, **kw):
    parts.append((list(samples), np.asarray(rewards)))
    old_params.append(jax.device_get(params))  # Of the old log-probs.
    return real(samples, rewards, keep, params, ref, **kw)
  monkeypatch.setattr(job.algorithm, "batch", spy)
  prompts = next(job.iterator)
  state, metrics = fakes.first_step(job, prompts)
  monkeypatch.undo()
  assert int(state.step) == 2 and len(parts) == 2
  assert metrics["stream/updates_during_rollout"] == 1
  # Both parts' old log-probs come from the step's weights, the second's
  # too, after the first update.
  for p in old_params:
    jax.tree.map(np.testing.assert_array_equal, p,
                 jax.device_get(job.params))
  want = job.learner.init_state(fakes.copy_tree(job.params))
  behaviour = fakes.copy_tree(job.params)
  ref = jax.tree.map(lambda x: x * 1.05, job.params)
  for samples, rewards in parts:
    batch, _ = job.algorithm.batch(samples, rewards,
                                   np.ones(len(samples), bool), behaviour,
                                   ref, minibatches=1)
    want, _ = job.learner.step(want, batch)
  diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                      state.params, want.params)
  assert max(jax.tree.leaves(diff)) < 0.05 * c.optim.learning_rate


@pytest.mark.parametrize("change, key", [
    (dict(num_minibatches=3), "num_minibatches"),
    (dict(ppo_epochs=2), "ppo_epochs"),
    (dict(advantage="reinforce_pp"), "advantage"),
    (dict(dynamic_sampling=True), "dynamic_sampling"),
    (dict(micro_batches=8), "stream_parts"),  # Parts of 4 groups.
    (dict(stream_parts=3), "stream_parts=3"),
])
def test_stream_config_errors(change, key):
  from rlhf_jax.config import checks
  from rlhf_jax.config.sections import RLJob

  c = _config()
  c.rl.update(change)
  with pytest.raises(ConfigError, match=key):
    checks.check_rl_job(RLJob.from_config(c), job="grpo", prompt_len=7)
