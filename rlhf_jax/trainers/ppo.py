"""RLHF with PPO: actor, critic, frozen reference and reward model.

One step (InstructGPT-style; the step is `trainers/rl_step.py`, PPO is
what this algorithm scores and trains):
  rollout   the job's rollout (the trainer's mesh or elastic workers, with
            the common prefix and long-tail policies as its options; or
            async RL's, decoding ahead on its own devices or the workers)
            samples G responses per prompt; tracked verifiable rewards are
            scored as groups finish (logged only);
  scoring   the reward model scores each sequence on device, the critic
            gives values, and the ADVANTAGES stage (`rl/prepare.py`, one
            jitted function shared with GRPO) the actor's and reference's
            log-probs, r_t = score at the last token - beta * KL_t,
            GAE(gamma, lambda) and whitened advantages; with
            `rollout.long_tail.fusion` the four forward passes ran during
            the rollout on the replicas its tail freed
            (`scoring/fused.py`) and only the advantages remain;
  train     ppo_epochs x num_minibatches; each mini-batch updates the
            actor (clipped surrogate) and the critic (clipped value loss),
            each with its own optimizer, on the same training layout.

The reward model comes from an `rm` job's workdir (`reward_model.workdir`);
the critic starts as a copy of it. The actor is built as GRPO's policy
(`trainers/policy.py`): with `config.lora` it trains adapters on a frozen
base that is also the reference, and the critic trains adapters of the same
spec on its frozen copy of the reward model, and its value head; without,
the critic trains every weight. Resume,
evaluation and checkpoints (actor, critic, reference): `rl_job.py`,
`loop.py`.

Dimension letters: B sequences, T = prompt length + max new tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from rlhf_jax.data import preferences
from rlhf_jax.errors import ConfigError
from rlhf_jax.models import lora, reward_model
from rlhf_jax.scoring.heads import ScalarHead
from rlhf_jax.scoring.host_rewards import RewardScorer
from rlhf_jax.rl import batch as batch_lib
from rlhf_jax.rl import objectives, packing, prepare
from rlhf_jax.rl.learner import Learner, make_optimizer
from rlhf_jax.trainers import policy as policy_lib
from rlhf_jax.trainers import rm

# Task fields that define the answer format a reward model has learned.
_FORMAT_KEYS = ("max_digits", "min_digits", "reverse_answer", "zero_pad")


class PPO:
  """Reward-model scores, GAE with a critic's values, two learners."""
  checks_as = "ppo"     # Which composition rules apply (`config/checks`).
  policy_key = "actor"  # The policy's entry in the checkpointed states.

  def __init__(self, config, c, source, policy):
    """Loads the reward model (`reward_model.workdir`) and builds the
    critic on the policy's training layout."""
    layout = policy.train_layout
    rm_config, rm_cfg, rm_graphdef, self.rm_params, self.rm_step = (
        rm.load_trained(c.reward_model.workdir, layout))
    _check_reward_model_task(c, rm_config)
    logging.info("reward model: %s step %d", c.reward_model.workdir,
                 self.rm_step)
    rl, spec = c.rl, c.lora.spec()
    critic_graphdef, self.critic_init = _critic(
        rm_cfg, rm_graphdef, spec, seed=c.seed + 1, layout=layout)
    value_terms, value_weight = objectives.value_terms(rl.value_clip or None)
    self.critic = Learner(
        critic_graphdef, layout, make_optimizer(c.critic.optim),
        terms_fn=value_terms, weight_fn=value_weight,
        micro_batches=rl.micro_batches,
        trainable=None if spec is None else reward_model.LORA_TRAINABLE)
    self.c, self.source, self.policy = c, source, policy
    self.actor = policy.learner
    self.learners = (("train", "actor", self.actor),
                     ("critic", "critic", self.critic))
    self.preparer = prepare.Preparer(self.actor, rl.advantage_config(
        c.rollout.samples_per_row))
    self.heads = ScalarHead(rm_graphdef, layout)             # The reward model.
    self.critic_heads = ScalarHead(critic_graphdef, layout)  # + adapters.
    # Verifiable rewards, logged only (the reward model trains the policy).
    self.scorer = (RewardScorer(source.tokenizer, rl.tracked_rewards, None,
                                "zero") if rl.tracked_rewards else None)
    self.eval_scorer = (RewardScorer(source.tokenizer,
                                     rl.tracked_rewards[:1], None, "zero")
                        if rl.tracked_rewards else None)
    self.fused = policy_lib.fused_scoring(
        c, policy, source.prompt_len, kind=self.checks_as,
        heads_graphdef=rm_graphdef,
        critic_graphdef=critic_graphdef)

  def fresh_states(self, params, *, copy: bool = True) -> dict:
    """The actor's states from the post-SFT `params` and the critic's from
    the reward model (a copy unless `copy=False`: a restore target)."""
    rm_params = self.rm_params if not copy else jax.tree.map(
        lambda x: jnp.array(x, copy=True), self.rm_params)
    return {**self.policy.fresh_states(params, "actor", copy=copy),
            "critic": self.critic.init_state(self.critic_init(rm_params))}

  def fused_weights(self, weights) -> dict:
    """The reward model and the (parked) critic for the fused passes."""
    return {"rm": self.rm_params, "critic": weights.states["critic"].params}

  def batch(self, samples, rewards, keep, params, ref, *, states=None,
            minibatches: int, current=None, fused=None):
    """The training batch: reward-model scores, critic values, then the
    ADVANTAGES stage (GAE); and its info. `rewards` (tracked ones) are not
    trained on; `fused`: the scores of the passes that ran during the
    rollout (`scoring/fused.py`), not run here then."""
    del rewards, current
    c, rl = self.c, self.c.rl
    P, M = self.source.prompt_len, c.rollout.max_new_tokens
    slots = batch_lib.slots(rl, self.actor, minibatches)
    # Shared prompts need packed rows here (`config/compose`: not the
    # grouped layout).
    packed = batch_lib.pack(samples, P, M, group_size=c.shared_prompt_group,
                            keep=keep, slots=slots, routes=rl.routing_replay)
    if fused is not None:
      per_token = fused.assemble(samples, packed)
      batch = self.preparer.put(packed, rewards=per_token.pop("rewards"))
      batch, info = self.preparer.from_scores(batch, per_token)
      return batch, {**info, **packed.info()}
    batch = self.preparer.put(packed)
    if slots is None:
      scores = self.heads.scores(self.rm_params, batch)
    else:  # Every sample, each with its last token (a packed row has not).
      whole = batch_lib.pack(
          packing.with_last_token(samples), P, M + 1,
          group_size=c.shared_prompt_group,
          slots=packing.Slots(rl.pack_length,
                              shards=self.actor.layout.shards("batch")))
      scores = self.heads.packed_scores(
          self.rm_params, self.actor.put_batch(whole.arrays),
          packing.last_cells(whole.arrays["seq"], len(samples)))
    values = self.critic_heads.values(states["critic"].params, batch)
    batch, info = self.preparer(params, ref, {**batch, "rewards": scores},
                                values)
    return batch, {**info, **packed.info()}

  def metrics(self, info, states) -> dict:
    return {"rollout/reward_std": float(np.std(info["rewards"])),
            "rollout/value_mean": float(info["value_mean"]),
            "rollout/return_mean": float(info["return_mean"]),
            **self.actor.state_bytes(states["actor"]),
            **{k.replace("memory/", "memory/critic_"): v
               for k, v in self.critic.state_bytes(states["critic"]).items()}}

  def eval_values(self, sampled, states) -> dict:
    """Per-sample values of held-out greedy samples (`evaluation.evaluate`
    means them): eval/reward_mean (reward-model score) and eval/accuracy
    (the first tracked reward, e.g. exact match)."""
    del states
    packed = batch_lib.pack(sampled.samples, self.source.prompt_len,
                            self.c.rollout.max_new_tokens)
    batch = self.actor.put_batch(packed.arrays)
    out = {"eval/reward_mean": np.asarray(
        self.heads.scores(self.rm_params, batch))}
    if self.eval_scorer is not None:
      out["eval/accuracy"] = sampled.rewards
    return out


def _check_reward_model_task(c, rm_config):
  """The policy (sections `c`) must answer in the format the reward model
  (its saved config) was trained on."""
  _, rm_task = preferences.sections_of(rm_config, saved=True)
  if rm_task is None or c.data.kind != "addition":
    return
  for key in _FORMAT_KEYS:
    mine, theirs = getattr(c.task, key), getattr(rm_task, key)
    if mine != theirs:
      raise ConfigError(
          f"config.task.{key}={mine!r} but the reward model in "
          f"{c.reward_model.workdir!r} was trained with {theirs!r}: its "
          "scores would not mean anything for this policy's answers")


def _critic(rm_cfg, rm_graphdef, spec, *, seed: int, layout):
  """(graphdef, init) of the critic: init maps the reward model's params
  to the critic's; with a LoRA `spec`, fresh adapters on them (B zero: the
  critic starts as the reward model), else the params themselves."""
  if spec is None:
    return rm_graphdef, lambda params: params

  def init(params):
    return lora.attach(rm_cfg, params, spec, seed=seed, layout=layout,
                       model=reward_model.RewardModel)[2]
  graphdef = lora.attach(rm_cfg, reward_model.abstract_params(rm_cfg)[1],
                         spec, seed=seed, model=reward_model.RewardModel)[1]
  return graphdef, init
