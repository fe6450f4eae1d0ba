"""RLHF with PPO: actor, critic, frozen reference and reward model.

One step (InstructGPT-style), top to bottom in `ppo_step`:
  rollout   the job's rollout (the trainer's mesh or elastic workers, with
            the common prefix and long-tail policies as its options)
            samples G responses per prompt; tracked verifiable rewards are
            scored as groups finish (logged only);
  scoring   the reward model scores each sequence on device, the critic
            gives values, and the ADVANTAGES stage (`rl/prepare.py`, one
            jitted function shared with GRPO) the actor's and reference's
            log-probs, r_t = score at the last token - beta * KL_t,
            GAE(gamma, lambda) and whitened advantages; with
            `rollout.long_tail.fusion` the four forward passes ran during
            the rollout on the replicas its tail freed
            (`rl/scoring_passes.py`) and only the advantages remain;
  train     ppo_epochs x num_minibatches; each mini-batch updates the
            actor (clipped surrogate) and the critic (clipped value loss),
            each with its own optimizer, on the same training layout.

The reward model comes from an `rm` job's workdir (`reward_model.workdir`);
the critic starts as a copy of it. The actor is built as GRPO's policy
(`trainers/policy.py`): with `config.lora` it trains adapters on a frozen
base that is also the reference, and the critic trains adapters of the same
spec on its frozen copy of the reward model, and its value head; without,
the critic trains every weight. Resume,
evaluation and checkpoints (actor, critic, reference): `loop.py`.

Dimension letters: B sequences, T = prompt length + max new tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from rlhf_jax.config import checks
from rlhf_jax.config.sections import ConfigError, RLJob
from rlhf_jax.data import sources
from rlhf_jax.metrics import rl_step_metrics
from rlhf_jax.models import lora, reward_model
from rlhf_jax.parallel import colocate
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.rewards.model_score import ScalarHead
from rlhf_jax.rewards.scoring import RewardScorer
from rlhf_jax.rl import batch as batch_lib
from rlhf_jax.rl import objectives, packing, prepare, scoring_passes
from rlhf_jax.rl.learner import Learner, TrainState, make_optimizer
from rlhf_jax.rl.learner import train_epochs
from rlhf_jax.rollout.base import Rollout, generate, step_seed
from rlhf_jax.timeline import Timeline
from rlhf_jax.trainers import loop, rm
from rlhf_jax.trainers import policy as policy_lib
from rlhf_jax.trainers.sft import run_sft

# Task fields that define the answer format a reward model has learned.
_FORMAT_KEYS = ("max_digits", "min_digits", "reverse_answer", "zero_pad")


@dataclasses.dataclass
class Job:
  """Everything a PPO run builds before its first step."""
  c: RLJob
  source: sources.DataSource
  graphdef: Any              # Actor (decoder).
  params: Any                # Actor init (random or HF), before SFT.
  train_layout: Any
  actor: Learner
  critic: Learner
  preparer: prepare.Preparer
  heads: ScalarHead          # The reward model's graph.
  critic_heads: ScalarHead   # The critic's: the same, + adapters (LoRA).
  rm_params: Any
  rm_step: int
  tracked: RewardScorer | None  # Logged verifiable rewards.
  rollout: Rollout
  eval_rollout: Any
  colocation: colocate.Colocation
  cfg: Any = None            # The actor's ModelConfig.
  rollout_layout: Any = None
  policy: Any = None         # The actor's `policy_lib.Policy`.
  fused: Any = None          # `ScoringPasses` on the tail's freed devices.
  critic_init: Any = None    # Reward-model params -> the critic's.

  @property
  def tokenizer(self):
    return self.source.tokenizer


def ppo_step(job: Job, step: int, actor_state, critic_state, ref_params,
             prompts):
  """One PPO step; returns the new actor and critic states and metrics.

  The actor switches layouts as in GRPO (`parallel/colocate.py`); the
  actor's optimizer state and the critic wait in host memory while the
  rollout decodes, the parked reference visits the device for the
  ADVANTAGES stage. Every phase is a span on the timeline.
  """
  co, c = job.colocation, job.c
  co.begin_step(step)
  with co.span("repartition"):
    rollout_params = co.to_rollout(actor_state.params)
    actor_opt, critic_state = (co.park(actor_state.opt_state),
                               co.park(critic_state))
  job.rollout.set_weights(rollout_params, co.version, master=co.master)
  with co.span("rollout"), scoring_passes.during(
      job.fused, job.rollout, policy=rollout_params, ref=ref_params,
      rm=job.rm_params, critic=critic_state.params) as fused:
    sampled = generate(job.rollout, prompts, c.rollout.samples_per_row,
                       step_seed(c.seed, step), step=step, scorer=job.tracked)
  with co.span("repartition"):
    params = co.to_train(rollout_params)
  with co.span("scoring"), scoring_passes.reference(
      co, ref_params, fused) as ref:
    keep = co.fresh(sampled.samples)  # Raises on stale ones unless "drop".
    critic_state = co.unpark(critic_state)
    batch, info = train_batch(job, sampled.samples, keep, params, ref,
                               critic_state.params, fused)
    jax.block_until_ready(batch)  # Before the reference copy is freed.
  with co.span("train"):
    actor_state = TrainState(params, co.unpark(actor_opt), actor_state.step)
    (actor_state, critic_state), (trained, critic_trained) = train_epochs(
        [job.actor, job.critic], [actor_state, critic_state], batch,
        epochs=c.rl.ppo_epochs, num_minibatches=c.rl.num_minibatches,
        seed=step_seed(c.seed, step))
  info = jax.device_get(info)
  return actor_state, critic_state, rl_step_metrics(
      info, {"train": trained, "critic": critic_trained}, co.end_step(step),
      sampled.metrics, {"rollout/reward_std": float(np.std(info["rewards"])),
                        "rollout/value_mean": float(info["value_mean"]),
                        "rollout/return_mean": float(info["return_mean"])},
      job.actor.state_bytes(actor_state), {
          k.replace("memory/", "memory/critic_"): v
          for k, v in job.critic.state_bytes(critic_state).items()},
      version=co.version,
      stale=int(np.sum(~keep)), step=step,
      alarm_kl=c.rl.mismatch_alarm_kl)


def train_batch(job: Job, samples, trainable, params, ref, critic_params,
                fused=None):
  """The training batch: reward-model scores, critic values, then the
  ADVANTAGES stage (GAE); and its info. `fused`: the scores of the passes
  that ran during the rollout (`scoring_passes.during`), not run here
  then. Reads the job's `source.prompt_len`, `c.rollout`, `preparer`,
  `heads`, `critic_heads`, `rm_params` and `fused`."""
  c, rl = job.c, job.c.rl
  P, M = job.source.prompt_len, c.rollout.max_new_tokens
  shards = job.actor.layout.shards("batch")
  slots = packing.Slots(  # Rows of several sequences: padding not trained.
      rl.pack_length, rl.num_minibatches, rl.micro_batches,
      shards) if rl.pack_length else None
  # Shared prompts need packed rows here (`checks`: not the grouped layout).
  group_size = c.rollout.samples_per_row if rl.share_prompt else 0
  packed = batch_lib.pack(samples, P, M, group_size=group_size,
                          trainable=trainable, slots=slots)
  computed, real = packed.positions()
  out = {"response_len": packed.response_len, "positions": computed,
         "real_positions": real}
  if fused is not None:
    per_token = job.fused.assemble(samples, fused, packed)
    batch = job.preparer.put(packed, rewards=per_token.pop("rewards"))
    batch, info = job.preparer.from_scores(batch, per_token)
    return batch, {**info, **out}
  batch = job.preparer.put(packed)
  if slots is None:
    scores = job.heads.scores(job.rm_params, batch)
  else:  # Every sample, each with its last token (a packed row has not).
    whole = batch_lib.pack(packing.with_last_token(samples), P, M + 1,
                           group_size=group_size,
                           slots=packing.Slots(rl.pack_length, shards=shards))
    scores = job.heads.packed_scores(
        job.rm_params, job.actor.put_batch(whole.arrays),
        packing.last_cells(whole.arrays["seq"], len(samples)))
  values = job.critic_heads.values(critic_params, batch)
  batch, info = job.preparer(params, ref, {**batch, "rewards": scores},
                             values)
  return batch, {**info, **out}


def evaluate(job: Job, actor_params) -> dict:
  """Greedy responses to held-out prompts: eval/reward_mean (reward-model
  score) and eval/accuracy (the first tracked reward, e.g. exact match)."""
  c = job.c
  tracked = (RewardScorer(job.tokenizer, c.rl.tracked_rewards[:1], None,
                          "zero") if c.rl.tracked_rewards else None)
  job.eval_rollout.set_weights(job.colocation.rollout_copy(actor_params), 0)
  scores, accuracy = [], []
  for prompts in job.source.eval_batches:
    sampled = generate(job.eval_rollout, prompts, 1, seed=0, scorer=tracked)
    packed = batch_lib.pack(sampled.samples, job.source.prompt_len,
                            c.rollout.max_new_tokens)
    batch = job.actor.put_batch(packed.arrays)
    scores.append(np.asarray(job.heads.scores(job.rm_params, batch)))
    if tracked is not None:
      accuracy.append(sampled.rewards)
  out = {"eval/reward_mean": float(np.mean(np.concatenate(scores),
                                           dtype=np.float64))}
  if accuracy:
    out["eval/accuracy"] = float(np.mean(np.concatenate(accuracy),
                                         dtype=np.float64))
  return out


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


def build(config, timeline: Timeline | None = None) -> Job:
  """Validates, loads the reward model, builds actor, critic, rollout."""
  c = RLJob.from_config(config)
  source = sources.build(config, c)
  checks.check_rl_job(c, job="ppo", prompt_len=source.prompt_len)
  train_layout, rollout_layout = mesh_lib.layouts(c.mesh)
  rm_config, rm_cfg, rm_graphdef, rm_params, rm_step = rm.load_trained(
      c.reward_model.workdir, train_layout)
  _check_reward_model_task(config, rm_config)
  p = policy_lib.build(c, source, train_layout, rollout_layout, timeline)
  rl, spec = c.rl, c.lora.spec()
  critic_graphdef, critic_init = _critic(rm_cfg, rm_graphdef, spec,
                                         seed=c.seed + 1, layout=train_layout)
  fused = policy_lib.fused_scoring(c, p, source.prompt_len,
                                   heads_graphdef=rm_graphdef,
                                   critic_graphdef=critic_graphdef)
  value_terms, value_weight = objectives.value_terms(rl.value_clip or None)
  return Job(
      c=c, source=source, graphdef=p.graphdef, params=p.params,
      train_layout=train_layout, actor=p.learner,
      critic=Learner(critic_graphdef, train_layout,
                     make_optimizer(c.critic.optim), terms_fn=value_terms,
                     weight_fn=value_weight, micro_batches=rl.micro_batches,
                     trainable=None if spec is None
                     else reward_model.LORA_TRAINABLE),
      preparer=prepare.Preparer(p.learner, rl.advantage_config(
          c.rollout.samples_per_row)),
      heads=ScalarHead(rm_graphdef, train_layout),
      critic_heads=ScalarHead(critic_graphdef, train_layout),
      critic_init=critic_init, rm_params=rm_params,
      rm_step=rm_step,
      tracked=RewardScorer(source.tokenizer, rl.tracked_rewards, None,
                           "zero") if rl.tracked_rewards else None,
      rollout=p.rollout, eval_rollout=p.eval_rollout,
      colocation=p.colocation, cfg=p.cfg, rollout_layout=rollout_layout,
      policy=p, fused=fused)


def run(config, workdir: str):
  """Runs (or resumes) PPO in `workdir`; returns the final actor state."""
  config = sources.prepare(config, workdir)
  job = build(config)
  critic_learner = job.critic
  logging.info("reward model: %s step %d", job.c.reward_model.workdir,
               job.rm_step)

  def copy(tree):  # Frozen copies: the learners donate their states.
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)

  def fresh(writer, verbose, sft_dir, stop):
    params = run_sft(job.c.sft, job.graphdef, job.params, job.train_layout,
                     job.source.sft_arrays, writer, verbose=verbose,
                     checkpoint_dir=sft_dir, stop=stop)
    return {**job.policy.fresh_states(params, "actor"),
            "critic": critic_learner.init_state(
                job.critic_init(copy(job.rm_params)))}

  def step(s, states):
    actor_state, critic_state, metrics = ppo_step(
        job, s, states["actor"], states["critic"], states.get("ref"),
        next(job.source.iterator))
    return {**states, "actor": actor_state, "critic": critic_state}, metrics

  try:
    states = loop.run(
        config, workdir, train=job.c.train, eval_every=job.c.eval.every,
        iterator=job.source.iterator, colocation=job.colocation,
        fresh=fresh, step=step, history=job.rollout.length_history,
        like=lambda: {
            **job.policy.fresh_states(job.params, "actor", copy=False),
            "critic": critic_learner.init_state(
                job.critic_init(job.rm_params))},
        evaluate=lambda states: evaluate(job, states["actor"].params))
  finally:
    job.rollout.close()  # Held workers stop (and stop billing).
  return None if states is None else states["actor"]
