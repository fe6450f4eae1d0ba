"""GRPO and its family (DAPO, Dr. GRPO, RLOO, ...): the reward functions
score each group as it finishes, the ADVANTAGES stage (`rl/prepare.py`)
turns rewards into group-relative advantages with the policy's and the
reference's log-probs, and one learner (the policy) trains.

What an RL algorithm is here (PPO beside it, `trainers/ppo.py`; a new one
is a file like this and a line in `trainers/algorithms.py`): how a group is
scored on the host (`scorer`), how finished samples become the training
batch (`batch`), which learners train on it (`learners`), its states and
metrics. The step itself is `trainers/rl_step.py`, the same for every
algorithm; sampling variants (async, DAPO's refill) are rollouts
(`rollout/step_rollouts.py`) and streaming is a train stage
(`rl/train_stage.py`), chosen when the job is built (`trainers/rl_job.py`).
"""

from __future__ import annotations

import numpy as np

from rlhf_jax.scoring.host_rewards import RewardScorer
from rlhf_jax.rl import batch as batch_lib
from rlhf_jax.rl import prepare
from rlhf_jax.trainers import policy as policy_lib


class GRPO:
  """Host rewards per group, group-relative advantages, one learner."""
  checks_as = "grpo"     # Which composition rules apply (`config/checks`).
  policy_key = "policy"  # The policy's entry in the checkpointed states.

  def __init__(self, config, c, source, policy):
    """`c`: the job's typed sections; `policy`: `trainers/policy.Policy`."""
    del config
    rl = c.rl
    self.c, self.source, self.policy = c, source, policy
    self.learners = (("train", self.policy_key, policy.learner),)
    self.preparer = prepare.Preparer(policy.learner, rl.advantage_config(
        c.rollout.samples_per_row))
    self.scorer = RewardScorer(
        source.tokenizer, rl.rewards, rl.reward_weights, rl.on_reward_error,
        overlong=(c.rollout.max_new_tokens, rl.overlong_buffer,
                  rl.overlong_penalty) if rl.overlong_buffer else None)
    names = list(rl.rewards)  # Eval: the first reward is the accuracy.
    self.eval_scorer = RewardScorer(
        source.tokenizer, names, [1.0] + [0.0] * (len(names) - 1), "zero")
    self.fused = policy_lib.fused_scoring(c, policy, source.prompt_len,
                                           kind=self.checks_as)

  def fresh_states(self, params, *, copy: bool = True) -> dict:
    """The checkpointed states from the post-SFT `params`."""
    return self.policy.fresh_states(params, self.policy_key, copy=copy)

  def fused_weights(self, weights) -> dict:
    """Weights the fused passes need beyond the policy and reference."""
    del weights
    return {}

  def batch(self, samples, rewards, keep, params, ref, *, states=None,
            minibatches: int, current=None, fused=None):
    """The device training batch of whole groups and its info: the
    ADVANTAGES stage's, the response lengths and the trained tokens. With
    `rl.pack_length`, packed rows dealt to `minibatches` mini-batches;
    `current`: `Preparer.put`'s; `fused`: the scores of the passes that ran
    during the rollout (`scoring/fused.py`), not run here then."""
    del states
    rl = self.c.rl
    packed = batch_lib.pack(
        samples, self.source.prompt_len, self.c.rollout.max_new_tokens,
        group_size=self.c.shared_prompt_group,
        keep=keep, slots=batch_lib.slots(rl, self.policy.learner,
                                                   minibatches),
        routes=rl.routing_replay)
    batch = self.preparer.put(packed, rewards, current)
    if fused is None:
      batch, info = self.preparer(params, ref, batch)
    else:
      batch, info = self.preparer.from_scores(
          batch, fused.assemble(samples, packed))
    return batch, {**info, **packed.info()}

  def metrics(self, info, states) -> dict:
    del info
    return self.policy.learner.state_bytes(states[self.policy_key])

  def eval_values(self, sampled, states) -> dict:
    """Per-sample values of held-out greedy samples (`evaluation.evaluate`
    means them): eval/accuracy is the first reward function's, and
    eval/rewards/<name> each reward's (a format reward beside a
    correctness one says whether a gain is format alone)."""
    del states
    n = len(sampled.samples)
    return {"eval/accuracy": sampled.rewards, **{
        f"eval/rewards/{name}": np.full(n, sampled.metrics[
            f"rewards/{name}"]) for name in self.c.rl.rewards}}
