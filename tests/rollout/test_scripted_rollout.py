"""The scripted rollout the step, loop and metric tests may run on
(`fakes.ScriptedRollout`) stands in for the real one: replaying a real
rollout's samples, a step gives the real step's rewards, losses, gradient
norm and updated params, without an engine."""

import jax
import numpy as np

import fakes


def test_replayed_samples_give_the_real_step(tiny_grpo_job):
  job = tiny_grpo_job()
  prompts = next(job.iterator)
  seen = fakes.capture_samples(job)
  real_state, real = fakes.first_step(job, prompts)
  (sampled,) = seen
  scripted = fakes.ScriptedRollout(
      fakes.ScriptedRollout.recorded(sampled.samples))
  state, ours = fakes.first_step(job, prompts, rollout=scripted)
  # One stream, every prompt's group whole.
  assert [sizes for _, _, sizes in scripted.streams] == [
      [job.c.rollout.samples_per_row] * len(prompts.prompt_ids)]
  for k in ("rollout/reward_mean", "rollout/response_len_mean",
            "rewards/addition", "train/loss", "train/grad_norm", "train/kl"):
    np.testing.assert_allclose(ours[k], real[k], rtol=1e-6, err_msg=k)
  assert abs(real["train/loss"]) > 0  # The step trained on something.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7),
               state.params, real_state.params)
