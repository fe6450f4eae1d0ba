"""RLHF with PPO: actor, critic, frozen reference and reward model.

One step (InstructGPT-style):
  rollout   the engine samples G responses per prompt from the actor;
  scoring   the reward model scores each finished sequence on device, the
            actor and reference give per-token log-probs and the critic
            values (tracked verifiable rewards, if any, are only logged);
  targets   r_t = score at the last token - beta * KL_t, GAE(gamma, lambda),
            whitened advantages (`critic.ppo_targets`);
  train     ppo_epochs x num_minibatches updates; each mini-batch updates the
            actor (clipped surrogate) and the critic (clipped value loss),
            each with its own optimizer, on the same training layout.

The reward model comes from an `rm` job's workdir (`config.reward_model.
workdir`); the critic starts as a copy of it. Resume, evaluation and
checkpoints (actor, critic, reference): `trainers/loop.py`.

Dimension letters: B sequences, T = prompt length + max new tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.engine import Engine
from rlhf_jax.rewards.model_score import ScalarHead
from rlhf_jax.rl import critic, objectives
from rlhf_jax.rl.aggregation import masked_mean
from rlhf_jax.rl.learner import Learner
from rlhf_jax.rl.logprobs import logprob_gap
from rlhf_jax.trainers import builders, colocate, loop, rm, rollout, sources
from rlhf_jax.trainers.sft import run_sft
from rlhf_jax.trainers.validate import ConfigError, validate_ppo

# Task fields that define the answer format a reward model has learned.
_FORMAT_KEYS = ("max_digits", "min_digits", "reverse_answer", "zero_pad")


@dataclasses.dataclass
class Job:
  """Everything a PPO run builds before its first step."""
  config: Any
  source: sources.DataSource
  graphdef: Any              # Actor (decoder).
  params: Any                # Actor init (random or HF), before SFT.
  train_layout: Any
  rollout_layout: Any
  actor: Learner
  critic: Learner
  heads: ScalarHead          # Reward model and critic share one graph.
  rm_params: Any
  rm_step: int
  engine: Engine
  eval_engine: Engine
  colocation: colocate.Colocation

  @property
  def tokenizer(self):
    return self.source.tokenizer


def _check_reward_model_task(config, rm_config):
  """The policy must answer in the format the reward model was trained on."""
  if rm_config.data.kind != "synthetic" or config.data.kind != "addition":
    return
  for key in _FORMAT_KEYS:
    mine, theirs = config.task[key], rm_config.task[key]
    if mine != theirs:
      raise ConfigError(
          f"config.task.{key}={mine!r} but the reward model in "
          f"{config.reward_model.workdir!r} was trained with {theirs!r}: its "
          "scores would not mean anything for this policy's answers")


def build(config) -> Job:
  """Validates, loads the reward model, builds actor, critic and engines."""
  source = sources.build(config)
  validate_ppo(config, prompt_len=source.prompt_len)
  train_layout, rollout_layout = builders.layouts(config.mesh)
  rm_config, rm_graphdef, rm_params, rm_step = rm.load_trained(
      config.reward_model.workdir, train_layout)
  _check_reward_model_task(config, rm_config)
  cfg, graphdef, params = builders.model(
      config.model, seed=config.seed, layout=train_layout,
      vocab_size=source.tokenizer.vocab_size)
  rl = config.rl
  actor_terms, actor_weight = objectives.policy_terms(
      objectives.PolicyLossConfig(
          policy_loss=rl.policy_loss, clip_low=rl.clip_low,
          clip_high=rl.clip_high, clip_c=rl.clip_c or None,
          kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator,
          kl_in_loss=rl.kl_in_loss, aggregation=rl.aggregation,
          max_len=config.rollout.max_new_tokens))
  value_terms, value_weight = objectives.value_terms(rl.value_clip or None)
  return Job(
      config=config, source=source, graphdef=graphdef, params=params,
      train_layout=train_layout, rollout_layout=rollout_layout,
      actor=Learner(graphdef, train_layout, builders.optimizer(config.optim),
                    terms_fn=actor_terms, weight_fn=actor_weight,
                    micro_batches=rl.micro_batches),
      critic=Learner(rm_graphdef, train_layout,
                     builders.optimizer(config.critic.optim),
                     terms_fn=value_terms, weight_fn=value_weight,
                     micro_batches=rl.micro_batches),
      heads=ScalarHead(rm_graphdef, train_layout), rm_params=rm_params,
      rm_step=rm_step,
      **builders.policy_runtime(config, cfg, graphdef, params, train_layout,
                                rollout_layout, source.stop_ids))


def ppo_step(job: Job, step: int, actor_state, critic_state, ref_params,
             prompts):
  """One PPO step; returns the new actor and critic states and metrics.

  The actor switches layouts as in GRPO (`trainers/colocate.py`); the
  actor's optimizer state and the critic wait in host memory while the
  engine decodes, the parked reference visits the device for its log-prob
  pass. Every phase is a span on the timeline; perf/ metrics come from it.
  """
  config, actor, critic_learner = job.config, job.actor, job.critic
  co = job.colocation
  rl, G = config.rl, config.rollout.samples_per_row
  co.begin_step(step)
  with co.span("repartition"):
    rollout_params = jax.block_until_ready(co.to_rollout(actor_state.params))
    actor_opt, critic_state = (co.park(actor_state.opt_state),
                               co.park(critic_state))
  with co.span("rollout"):
    driver = Driver(job.engine, rollout_params, weight_version=co.version)
    samples = rollout.generate(driver, prompts, G,
                               rollout.step_seed(config.seed, step))
  with co.span("repartition"):
    actor_state = actor_state.replace(params=jax.block_until_ready(
        co.to_train(rollout_params)), opt_state=None)

  with co.span("scoring"):
    keep = co.fresh(samples)  # Raises on stale samples unless "drop".
    tracked = {}
    if rl.tracked_rewards:
      _, tracked = rollout.score(samples, prompts, job.tokenizer,
                                 list(rl.tracked_rewards), None, "zero")
    packed = rollout.pack(samples, job.source.prompt_len,
                          config.rollout.max_new_tokens)
    packed.arrays["loss_mask"][~keep] = 0.0
    batch = actor.put_batch(packed.arrays)
    critic_state = co.unpark(critic_state)
    scores = job.heads.scores(job.rm_params, batch)
    old_logp = actor.logprobs(actor_state.params, batch)
    with colocate.transient(co, ref_params) as ref_on_device:
      ref_logp = jax.block_until_ready(
          actor.logprobs(ref_on_device, batch))
    old_values = job.heads.values(critic_state.params, batch)
    mask = batch["loss_mask"]
    targets = _targets(scores, old_logp, ref_logp, old_values, mask,
                       kl_coef=0.0 if rl.kl_in_loss else rl.kl_coef,
                       kl_estimator=rl.kl_estimator, gamma=rl.gamma,
                       lam=rl.lam, whiten=rl.whiten_advantages)
    batch = actor.put_batch({
        **batch, "old_logp": old_logp, "ref_logp": ref_logp,
        "old_values": old_values, "advantages": targets["advantages"],
        "returns": targets["returns"]})
    gap_max, gap_mean = logprob_gap(old_logp, packed.sampler_logp, mask)
    jax.block_until_ready(batch)

  with co.span("train"):
    actor_state = actor_state.replace(opt_state=co.unpark(actor_opt))
    rng = np.random.default_rng(rollout.step_seed(config.seed, step))
    B, n = len(samples), rl.num_minibatches
    actor_metrics, critic_metrics = [], []
    for _ in range(rl.ppo_epochs):
      perm = rng.permutation(B)
      for k in range(n):
        mini = actor.rows(batch, perm[k::n])
        actor_state, m = actor.step(actor_state, mini)
        actor_metrics.append(m)
        critic_state, m = critic_learner.step(critic_state, mini)
        critic_metrics.append(m)
    actor_metrics, critic_metrics, host = jax.device_get(
        (actor_metrics, critic_metrics,
         {"scores": scores, "kl": targets["kl"], "gap_max": gap_max,
          "gap_mean": gap_mean, "values": masked_mean(old_values, mask),
          "returns": masked_mean(targets["returns"], mask)}))
  perf = co.end_step(step)

  mean = lambda ms, k: float(np.mean([m[k] for m in ms]))  # noqa: E731
  gen_tokens = float(packed.response_len.sum())
  metrics = {
      # The reward being maximised: the reward-model score (before KL).
      "rollout/reward_mean": float(np.mean(host["scores"])),
      "rollout/reward_std": float(np.std(host["scores"])),
      "rollout/kl": float(np.mean(host["kl"])),
      "rollout/response_len_mean": float(packed.response_len.mean()),
      "rollout/logprob_gap": float(host["gap_max"]),
      "rollout/logprob_gap_mean": float(host["gap_mean"]),
      "rollout/weight_version": float(co.version),
      "rollout/stale_dropped": float(np.sum(~keep)),
      "rollout/value_mean": float(host["values"]),
      "rollout/return_mean": float(host["returns"]),
      **{k: float(v) for k, v in tracked.items()},
      **{f"train/{k}": mean(actor_metrics, k) for k in actor_metrics[0]},
      **{f"critic/{k}": mean(critic_metrics, k) for k in critic_metrics[0]},
      **perf, "perf/tokens_per_s": gen_tokens / perf["perf/step_s"],
  }
  return actor_state, critic_state, metrics


_targets = jax.jit(critic.ppo_targets, static_argnames=(
    "kl_coef", "kl_estimator", "gamma", "lam", "whiten"))


def evaluate(job: Job, actor_params) -> dict:
  """Greedy responses to held-out prompts: eval/reward_mean (reward-model
  score) and eval/accuracy (the first tracked reward, e.g. exact match)."""
  config = job.config
  params = job.colocation.rollout_copy(actor_params)
  scores, tracked = [], []
  for prompts in job.source.eval_batches:
    samples = rollout.generate(Driver(job.eval_engine, params), prompts, 1,
                               seed=0)
    packed = rollout.pack(samples, job.source.prompt_len,
                          config.rollout.max_new_tokens)
    batch = job.actor.put_batch(packed.arrays)
    scores.extend(np.asarray(job.heads.scores(job.rm_params, batch)).tolist())
    if config.rl.tracked_rewards:
      values, _ = rollout.score(samples, prompts, job.tokenizer,
                                [config.rl.tracked_rewards[0]], None, "zero")
      tracked.extend(values.tolist())
  out = {"eval/reward_mean": float(np.mean(scores))}
  if tracked:
    out["eval/accuracy"] = float(np.mean(tracked))
  return out


def run(config: ml_collections.ConfigDict, workdir: str):
  """Runs (or resumes) PPO in `workdir`; returns the final actor state."""
  config = sources.prepare(config, workdir)
  job = build(config)
  actor, critic_learner = job.actor, job.critic
  logging.info("reward model: %s step %d", config.reward_model.workdir,
               job.rm_step)

  def fresh(writer, verbose):
    params = run_sft(config, job.graphdef, job.params, job.train_layout,
                     job.source.sft_arrays, writer, verbose=verbose)
    # Frozen copies: the learners donate the buffers of their states.
    copy = lambda tree: jax.tree.map(lambda x: jnp.array(x, copy=True),  # noqa: E731
                                     tree)
    return {"actor": actor.init_state(params),
            "critic": critic_learner.init_state(copy(job.rm_params)),
            "ref": copy(params)}

  def step(s, states):
    actor_state, critic_state, metrics = ppo_step(
        job, s, states["actor"], states["critic"], states["ref"],
        next(job.source.iterator))
    return {**states, "actor": actor_state, "critic": critic_state}, metrics

  states = loop.run(
      config, workdir, iterator=job.source.iterator,
      colocation=job.colocation, fresh=fresh,
      like=lambda: {"actor": actor.init_state(job.params),
                    "critic": critic_learner.init_state(job.rm_params),
                    "ref": job.params},
      step=step, evaluate=lambda states: evaluate(job, states["actor"].params))
  return states["actor"]
