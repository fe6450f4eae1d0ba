"""A new RL algorithm is a class and a registry line: REINFORCE with a
learned value baseline (its own set of learners: the policy and a value
network), written here against the algorithm interface of
`trainers/grpo.py`, registered, and trained by the one RL step and job."""

import ast
import dataclasses
import json

import jax
import numpy as np
import pytest

import fakes
from configs import tiny_grpo
from rlhf_jax.metrics import MetricWriter
from rlhf_jax.models import reward_model
from rlhf_jax.scoring.heads import ScalarHead
from rlhf_jax.scoring.host_rewards import RewardScorer
from rlhf_jax.rl import batch as batch_lib
from rlhf_jax.rl import objectives, prepare
from rlhf_jax.rl.learner import Learner, make_optimizer
from rlhf_jax.trainers import algorithms, rl_job


class ReinforceWithValueBaseline:
  """Host rewards R per sample; a value network V (the policy's decoder
  with a scalar head, random init) is the baseline: advantage_t = R - V_t
  (GAE with gamma = lambda = 1, no whitening); the value network regresses
  R. Two learners on the same mini-batches."""
  checks_as = "grpo"     # Host reward functions, like GRPO.
  policy_key = "policy"
  value_learning_rate = 1e-5  # Adam's first steps: +-lr on every weight.

  def __init__(self, config, c, source, policy):
    del config
    self.c, self.source, self.policy = c, source, policy
    layout, rl = policy.train_layout, c.rl
    value_graphdef, self.value_init = reward_model.init_params(
        policy.cfg, c.seed + 7, layout)
    terms, weight = objectives.value_terms(None)
    self.value = Learner(value_graphdef, layout, make_optimizer(
        dataclasses.replace(c.optim, learning_rate=self.value_learning_rate)),
                         terms_fn=terms, weight_fn=weight,
                         micro_batches=rl.micro_batches)
    self.value_head = ScalarHead(value_graphdef, layout)
    self.learners = (("train", "policy", policy.learner),
                     ("value", "value", self.value))
    self.preparer = prepare.Preparer(policy.learner, dataclasses.replace(
        rl.advantage_config(c.rollout.samples_per_row), estimator="gae",
        gamma=1.0, lam=1.0, whiten=False))
    self.scorer = RewardScorer(source.tokenizer, rl.rewards,
                               rl.reward_weights, rl.on_reward_error)
    self.eval_scorer = RewardScorer(source.tokenizer, rl.rewards[:1], None,
                                    "zero")
    self.fused = None  # No passes fused into the rollout.

  def fresh_states(self, params, *, copy: bool = True) -> dict:
    return {**self.policy.fresh_states(params, "policy", copy=copy),
            "value": self.value.init_state(fakes.copy_tree(self.value_init)
                                           if copy else self.value_init)}

  def fused_weights(self, weights) -> dict:
    del weights
    return {}

  def batch(self, samples, rewards, keep, params, ref, *, states=None,
            minibatches: int, current=None, fused=None):
    del minibatches, current, fused
    packed = batch_lib.pack(samples, self.source.prompt_len,
                            self.c.rollout.max_new_tokens,
                            keep=keep)  # Repeated rows.
    batch = self.preparer.put(packed)
    values = self.value_head.values(states["value"].params, batch)
    batch, info = self.preparer(params, ref, {**batch, "rewards": rewards},
                                values)
    return batch, {**info, **packed.info()}

  def metrics(self, info, states) -> dict:
    del info
    return self.policy.learner.state_bytes(states["policy"])

  def eval_values(self, sampled, states) -> dict:
    del states
    return {"eval/accuracy": sampled.rewards}


algorithms.register("reinforce_value", ReinforceWithValueBaseline)


def _config():
  c = tiny_grpo.get_config("runlocal")
  c.job = "reinforce_value"
  c.rl.update(kl_coef=0.0, num_minibatches=1, ppo_epochs=1)
  c.optim.update(learning_rate=3e-3, warmup_steps=0)
  return c


@pytest.mark.slow
def test_a_registered_algorithm_trains_with_its_own_learners(mesh8):
  """One step of the toy: the batch's advantages are R - V_t and its
  returns R at every trained token (a hand computation from the host
  rewards and the value network's outputs), both learners update, and the
  value network's error on that batch falls."""
  del mesh8
  job = rl_job.build(_config())
  assert isinstance(job.algorithm, ReinforceWithValueBaseline)
  prompts = next(job.iterator)
  seen = fakes.capture_samples(job)
  states = job.fresh_states(fakes.copy_tree(job.params))
  value0 = fakes.copy_tree(states["value"].params)
  policy0 = fakes.copy_tree(states["policy"].params)
  _, metrics = fakes.first_step(job, prompts, states=states)
  after = fakes.first_step.states
  assert np.isfinite(metrics["train/loss"]) and np.isfinite(
      metrics["value/loss"])
  for before, now in ((policy0, after["policy"].params),
                      (value0, after["value"].params)):
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))),
                         before, now)
    assert max(jax.tree.leaves(moved)) > 0

  sampled = seen[0]
  R = np.asarray(sampled.rewards, np.float32)
  assert np.ptp(R) > 0  # Rewards that say something.
  ref = jax.tree.map(lambda x: x * 1.05, job.params)
  batch, _ = job.algorithm.batch(
      sampled.samples, R, sampled.valid, policy0, ref,
      states={"value": dataclasses.replace(states["value"], params=value0)},
      minibatches=1)
  mask = np.asarray(batch["loss_mask"]) > 0
  packed = batch_lib.pack(sampled.samples, job.source.prompt_len,
                          job.c.rollout.max_new_tokens)
  V = np.asarray(job.algorithm.value_head.values(
      value0, job.learner.put_batch(packed.arrays)))
  want_adv = R[:, None] - V
  np.testing.assert_allclose(np.asarray(batch["advantages"])[mask],
                             want_adv[mask], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(batch["returns"])[mask],
                             np.broadcast_to(R[:, None], V.shape)[mask],
                             rtol=1e-6)

  def value_error(params):
    v = np.asarray(job.algorithm.value_head.values(
        params, job.learner.put_batch(packed.arrays)))
    return float(np.mean((R[:, None] - v)[mask] ** 2))
  assert value_error(after["value"].params) < value_error(value0)


@pytest.mark.slow
def test_a_registered_algorithm_runs_as_a_job(tmp_path):
  """`config.job` picks it: the real loop runs, evaluates, checkpoints the
  value network beside the policy and resumes."""
  from rlhf_jax import trainers
  c = _config()
  c.train.update(steps=2, checkpoint_every=1)
  c.eval.every = 2
  trainers.run(c, str(tmp_path))
  with open(tmp_path / "checkpoints" / "2" / "state" / "_METADATA") as f:
    saved = {ast.literal_eval(k)[0] for k in json.load(f)["tree_metadata"]}
  assert saved == {"policy", "value", "ref"}
  c.train.steps = 3
  trainers.run(c, str(tmp_path))
  rl_records = {r["step"]: r for r in MetricWriter(
      str(tmp_path), enabled=False).read() if r["phase"] == "rl"}
  assert sorted(rl_records) == [0, 1, 2, 3]
  assert all(np.isfinite(rl_records[s]["value/loss"]) for s in (1, 2, 3))
  assert "eval/accuracy" in rl_records[2]
