"""The GRPO-family job: SFT warm-start, then rollout -> score -> train steps.

Resume, evaluation and checkpoints: `trainers/loop.py` (a killed run
restarted with the same command writes the metrics an uninterrupted run
would have).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.engine import Engine
from rlhf_jax.rl import dapo, losses, objectives, registry
from rlhf_jax.rl.learner import Learner
from rlhf_jax.rl.logprobs import logprob_gap
from rlhf_jax.trainers import (
  builders,
  colocate,
  dynamic_sampling,
  loop,
  rollout,
  sources,
  streaming,
)
from rlhf_jax.trainers import elastic as elastic_lib
from rlhf_jax.trainers import long_tail as long_tail_lib
from rlhf_jax.trainers.sft import run_sft
from rlhf_jax.trainers.validate import validate_rl


def _learner(config, graphdef, layout, max_len):
  rl = config.rl
  terms, weight = objectives.policy_terms(objectives.PolicyLossConfig(
      policy_loss=rl.policy_loss, clip_low=rl.clip_low,
      clip_high=rl.clip_high, clip_c=rl.clip_c or None, kl_coef=rl.kl_coef,
      kl_estimator=rl.kl_estimator, kl_in_loss=rl.kl_in_loss,
      aggregation=rl.aggregation, max_len=max_len))
  return Learner(graphdef, layout, builders.optimizer(config.optim),
                 terms_fn=terms, weight_fn=weight,
                 micro_batches=rl.micro_batches)


def evaluate(engine: Engine, params, batches, tokenizer, config) -> dict:
  """Greedy accuracy of the first reward function on held-out prompts."""
  values = []
  for prompts in batches:
    samples = rollout.generate(Driver(engine, params), prompts, 1, seed=0)
    rewards, _ = rollout.score(samples, prompts, tokenizer,
                               [config.rl.rewards[0]], None, "zero")
    values.extend(rewards.tolist())
  return {"eval/accuracy": float(np.mean(values))}


def _rewards(samples, prompts, tokenizer, config):
  """Rewards [B] of the config's reward functions, and reward metrics."""
  rl = config.rl
  rewards, metrics = rollout.score(
      samples, prompts, tokenizer, list(rl.rewards),
      list(rl.reward_weights) or None, rl.on_reward_error)
  return _overlong(samples, rewards, metrics, config), metrics


def _last_train_s(co, step) -> float | None:
  """The previous step's train time (it sizes the seed window's cap)."""
  return sum(x.duration for x in co.timeline.step_spans(step - 1)
             if x.phase == "train") or None


def _overlong(samples, rewards, metrics, config):
  """Rewards with DAPO's soft overlong penalty (`rl.overlong_buffer`)."""
  rl = config.rl
  if not rl.overlong_buffer:
    return rewards
  penalty = np.asarray(dapo.overlong_penalty(
      np.array([len(x.tokens) for x in samples]),
      max_len=config.rollout.max_new_tokens,
      cache_len=rl.overlong_buffer, penalty=rl.overlong_penalty))
  metrics["rewards/overlong_penalty"] = float(penalty.mean())
  return rewards + penalty


def _learner_batch(samples, rewards, trainable, params, ref_params, *,
                   config, learner, prompt_len):
  """The learner's device batch for whole groups of samples, and its info.

  Packs the samples (`trainable` False: out of the loss, shapes unchanged),
  scores them under the policy `params` (old log-probs) and the reference,
  applies the KL reward penalty and the group advantages. Info: rewards
  after the penalty, response lengths, and the learner-vs-sampler log-prob
  gap (max, mean over `tokens` tokens).
  """
  rl, G = config.rl, config.rollout.samples_per_row
  # share_prompt: the grouped layout, each prompt run once for its G
  # responses in log-probs and training (rl/grouped.py); same loss.
  packed = rollout.pack(samples, prompt_len, config.rollout.max_new_tokens,
                        group_size=G if rl.share_prompt and G > 1 else 0)
  packed.arrays["loss_mask"].reshape(len(samples), -1)[~trainable] = 0.0
  batch = learner.put_batch(packed.arrays)
  old_logp = learner.logprobs(params, batch)
  ref_logp = learner.logprobs(ref_params, batch)
  mask = batch["loss_mask"]
  rewards = jnp.asarray(rewards)
  if rl.kl_coef and not rl.kl_in_loss:
    # Per-sequence [B, T] rows in either layout.
    rows = [x.reshape(len(samples), -1) for x in (old_logp, ref_logp, mask)]
    rewards, _ = losses.kl_reward_penalty(
        rewards, *rows, beta=rl.kl_coef, estimator=rl.kl_estimator)
  advantages = registry.get("advantage", rl.advantage)(rewards, G).reshape(
      mask.shape[:-1])  # [B], or [N, G] grouped.
  batch = learner.put_batch({**batch, "old_logp": old_logp,
                             "ref_logp": ref_logp, "advantages": advantages})
  gap_max, gap_mean = logprob_gap(old_logp, packed.sampler_logp, mask)
  return batch, dict(rewards=rewards, response_len=packed.response_len,
                     gap_max=gap_max, gap_mean=gap_mean,
                     tokens=float(packed.arrays["loss_mask"].sum()))


def _merge_infos(infos):
  """`_learner_batch` infos of the parts of one batch -> the batch's."""
  tokens = sum(i["tokens"] for i in infos)
  return dict(
      rewards=np.concatenate([np.asarray(i["rewards"]) for i in infos]),
      response_len=np.concatenate([i["response_len"] for i in infos]),
      gap_max=max(float(i["gap_max"]) for i in infos),
      gap_mean=sum(float(i["gap_mean"]) * i["tokens"] for i in infos)
      / max(tokens, 1.0), tokens=tokens)


def rl_step(step, state, ref_params, prompts, *, config, learner, engine,
            rollout_layout, tokenizer, prompt_len, colocation=None,
            refill=None, long_tail=None, workers=None):
  """One GRPO step; returns the new state and its metrics (host floats).

  The mesh switches layouts in place (`trainers/colocate.py`): the policy's
  buffers are donated to the rollout layout and back, optimizer state waits
  in host memory during the decode loop, and a parked reference policy is
  brought to the device only for its log-prob pass. Every phase is a span
  on `colocation.timeline`; the perf/ metrics are read from those spans.
  With `rl.dynamic_sampling`, groups whose rewards are all equal are
  replaced by groups of further prompt batches drawn from `refill`
  (`trainers/dynamic_sampling.py`) before the weights go back to training.
  With `long_tail` (`trainers/long_tail.py`) the rollout runs through the
  long-tail policies and the reward functions score samples as they finish;
  with `workers` (`trainers/elastic.py`) it runs on elastic rollout workers.
  """
  rl, G = config.rl, config.rollout.samples_per_row
  co = colocation or colocate.Colocation(
      learner.layout, rollout_layout, state.params, offload=False,
      version=step - 1)
  co.begin_step(step)
  with co.span("repartition"):
    rollout_params = jax.block_until_ready(co.to_rollout(state.params))
    opt_state = co.park(state.opt_state)
  driver = Driver(engine, rollout_params, weight_version=co.version)

  def sample_and_score(batch):
    seed = rollout.step_seed(config.seed, step)
    if long_tail is not None:
      long_tail.timeline = co.timeline
      with co.span("rollout"):  # Reward scoring is fused into it.
        samples, rewards, metrics = long_tail_lib.generate_and_score(
            long_tail, rollout_params, batch, G, seed,
            long_tail_lib.RewardScorer(
                batch, tokenizer, list(rl.rewards),
                list(rl.reward_weights) or None, rl.on_reward_error),
            weight_version=co.version, step=step)
    else:
      with co.span("rollout"):
        if workers is not None:
          samples, worker_metrics = elastic_lib.generate(
              workers, rollout_params, co.version, batch, G, seed,
              engine=engine, train_s=_last_train_s(co, step))
        else:
          samples, worker_metrics = rollout.generate(
              driver, batch, G, seed, common_prefix="auto"
              if config.rollout.max_common_length else None), {}
      with co.span("scoring"):
        rewards, metrics = _rewards(samples, batch, tokenizer, config)
        metrics.update(worker_metrics)
      return samples, rewards, metrics
    with co.span("scoring"):
      rewards = _overlong(samples, rewards, metrics, config)
    return samples, rewards, metrics

  if workers is not None and config.rollout.workers.stream:
    state, info, keep, reward_metrics, train = _streamed(
        step, state, ref_params, prompts, co, rollout_params, opt_state,
        config=config, learner=learner, engine=engine, tokenizer=tokenizer,
        prompt_len=prompt_len, workers=workers)
    perf = co.end_step(step)
    return state, _metrics(info, keep, reward_metrics, train, perf,
                           co.version)
  if rl.dynamic_sampling:
    got = dynamic_sampling.collect(prompts, refill, sample_and_score,
                                   group_size=G,
                                   max_rounds=rl.dynamic_max_rounds)
    samples, rewards, reward_metrics = got.samples, got.rewards, got.metrics
    informative = got.valid
  else:
    samples, rewards, reward_metrics = sample_and_score(prompts)
    informative = np.ones(len(samples), bool)
  with co.span("repartition"):
    state = state.replace(params=jax.block_until_ready(
        co.to_train(rollout_params)), opt_state=None)
  with co.span("scoring"):
    keep = co.fresh(samples)  # Raises on stale samples unless "drop".
    # Stale samples ("drop") and the slots dynamic sampling could not fill
    # stay out of the loss.
    with colocate.transient(co, ref_params) as ref_on_device:
      batch, info = _learner_batch(
          samples, rewards, keep & informative, state.params, ref_on_device,
          config=config, learner=learner, prompt_len=prompt_len)
      jax.block_until_ready(batch)

  with co.span("train"):
    state = state.replace(opt_state=co.unpark(opt_state))
    rng = np.random.default_rng(rollout.step_seed(config.seed, step))
    # Rows: sequences, or groups.
    B, n = batch["loss_mask"].shape[0], rl.num_minibatches
    train = []
    for _ in range(rl.ppo_epochs):
      perm = rng.permutation(B)
      for k in range(n):
        state, m = learner.step(state, learner.rows(batch, perm[k::n]))
        train.append(m)
    train = jax.device_get(train)
  perf = co.end_step(step)
  return state, _metrics(info, keep, reward_metrics, train, perf,
                         co.version)


def _metrics(info, keep, reward_metrics, train, perf, version):
  """The step's host metrics."""
  gen_tokens = float(info["response_len"].sum())
  return {
      "rollout/reward_mean": float(np.mean(info["rewards"])),
      "rollout/response_len_mean": float(info["response_len"].mean()),
      "rollout/logprob_gap": float(info["gap_max"]),
      "rollout/logprob_gap_mean": float(info["gap_mean"]),
      "rollout/weight_version": float(version),
      "rollout/stale_dropped": float(np.sum(~keep)),
      **{k: float(v) for k, v in reward_metrics.items()},
      **{f"train/{k}": float(np.mean([m[k] for m in train]))
         for k in train[0]},
      **perf, "perf/tokens_per_s": gen_tokens / perf["perf/step_s"],
  }


def _streamed(step, state, ref_params, prompts, co, rollout_params,
              opt_state, *, config, learner, engine, tokenizer, prompt_len,
              workers):
  """The rollout on the workers with micro-batch streaming: the trainer's
  devices train on finished groups as soon as they leave the rollout
  (`trainers/streaming.py`); `rl.num_minibatches` updates, each as soon as
  its groups are in, the last after the rollout.

  Returns (state, info, keep, reward metrics, train metrics).
  """
  rl, G = config.rl, config.rollout.samples_per_row
  t0 = co.timeline.now()
  ref_scope = contextlib.ExitStack()
  ref_on_device = []

  def on_free():  # The seeding trainer handed off (or there is no seeding).
    co.timeline.add(co.group, "rollout", t0, co.timeline.now())
    with co.span("repartition"):
      params = co.to_train(rollout_params)
    ref_on_device.append(ref_scope.enter_context(
        colocate.transient(co, ref_params)))
    return params

  def prepare(samples, params):
    with co.span("scoring"):
      rewards, metrics = _rewards(samples, prompts, tokenizer, config)
      keep = co.fresh(samples)
      batch, info = _learner_batch(samples, rewards, keep, params,
                                   ref_on_device[0], config=config,
                                   learner=learner, prompt_len=prompt_len)
    return batch, {**info, "keep": keep, "reward_metrics": metrics}

  train = []  # Metrics of each update.

  def update(params, sums, parts):  # The optimizer step on `parts` parts.
    nonlocal state
    with co.span("train"):
      if state.opt_state is None:  # First update: optimizer state in.
        state = state.replace(opt_state=co.unpark(opt_state))
      state, m = learner.apply(state.replace(params=params), *sums,
                               parts * rl.micro_batches)
      train.append(m)
    return state.params

  parts = config.rollout.workers.stream_parts
  stream = streaming.StreamedStep(
      learner, num_groups=len(prompts.prompt_ids), group_size=G,
      groups_per_part=config.train.prompts_per_step // parts,
      on_free=on_free, prepare=prepare,
      parts_per_update=parts // rl.num_minibatches, on_update=update)
  state = state.replace(opt_state=None)
  with ref_scope:
    with co.span("rollout", group="workers"):
      _, worker_metrics = elastic_lib.generate(  # Samples: in the parts.
          workers, rollout_params, co.version, prompts, G,
          rollout.step_seed(config.seed, step), engine=engine,
          train_s=_last_train_s(co, step), stream=stream)
    params, sums, infos = stream.finish()  # The parts still to come.
    jax.block_until_ready(sums)  # Before the reference copy is freed.
  update(params, sums, stream.sum_parts)  # The last update.
  train = jax.device_get(train)
  reward_metrics = streaming.merge_means(
      [(len(i["samples"]), i["reward_metrics"]) for i in infos])
  reward_metrics.update(worker_metrics)
  reward_metrics.update({
      "workers/stream_parts": float(stream.parts),
      "workers/streamed_groups": float(stream.groups_during_rollout),
      "workers/streamed_updates": float(stream.updates)})
  keep = np.concatenate([i["keep"] for i in infos])
  return state, _merge_infos(infos), keep, reward_metrics, train


@dataclasses.dataclass
class Job:
  """Everything a GRPO run builds before its first step."""
  config: Any
  source: sources.DataSource
  graphdef: Any
  params: Any
  train_layout: Any
  rollout_layout: Any
  learner: Learner
  engine: Engine
  eval_engine: Engine
  colocation: colocate.Colocation | None = None
  long_tail: Any = None  # engine/long_tail.LongTailRollout when enabled.
  workers: Any = None    # workers/manager.RolloutManager when enabled.

  @property
  def tokenizer(self):
    return self.source.tokenizer

  @property
  def iterator(self):
    return self.source.iterator

  @property
  def prompt_len(self) -> int:
    return self.source.prompt_len

  def step(self, step, state, ref_params):
    return rl_step(step, state, ref_params, next(self.iterator),
                   config=self.config, learner=self.learner,
                   engine=self.engine, rollout_layout=self.rollout_layout,
                   tokenizer=self.tokenizer, prompt_len=self.prompt_len,
                   colocation=self.colocation, refill=self.iterator,
                   long_tail=self.long_tail, workers=self.workers)


def build(config) -> Job:
  """Validates the config, then builds data, model, layouts, learner, engines.

  The data comes from `sources.build` (`config.data.kind`); the model from
  the HF directory `config.model.path` when set, else random init.
  """
  source = sources.build(config)
  validate_rl(config, prompt_len=source.prompt_len)
  long_tail_lib.check(config)
  elastic_lib.check(config)
  train_layout, rollout_layout = builders.layouts(config.mesh)
  cfg, graphdef, params = builders.model(
      config.model, seed=config.seed, layout=train_layout,
      vocab_size=source.tokenizer.vocab_size)
  job = Job(
      config=config, source=source, graphdef=graphdef,
      params=params, train_layout=train_layout, rollout_layout=rollout_layout,
      learner=_learner(config, graphdef, train_layout,
                       max_len=config.rollout.max_new_tokens),
      long_tail=long_tail_lib.build(config, cfg, graphdef, rollout_layout,
                                    source.stop_ids),
      workers=elastic_lib.build(config, cfg, source.stop_ids),
      **builders.policy_runtime(config, cfg, graphdef, params, train_layout,
                                rollout_layout, source.stop_ids))
  elastic_lib.attach_seed_window(job.workers, config, job.engine)
  return job


def run(config, workdir: str):
  """Runs (or resumes) the job in `workdir`; returns the final train state."""
  config = sources.prepare(config, workdir)
  job = build(config)
  learner, co = job.learner, job.colocation

  def fresh(writer, verbose):
    params = run_sft(config, job.graphdef, job.params, job.train_layout,
                     job.source.sft_arrays, writer, verbose=verbose)
    # The reference is a frozen copy: the policy's buffers are donated.
    ref_params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    return {"policy": learner.init_state(params), "ref": ref_params}

  def step(s, states):
    state, metrics = job.step(s, states["policy"], states["ref"])
    return {**states, "policy": state}, metrics

  try:
    states = loop.run(
        config, workdir, iterator=job.iterator, colocation=co, fresh=fresh,
        like=lambda: {"policy": learner.init_state(job.params),
                      "ref": job.params},
        step=step, history=(job.long_tail.history
                            if job.long_tail is not None
                            else elastic_lib.length_history(job.workers)),
        evaluate=lambda states: evaluate(
            job.eval_engine, co.rollout_copy(states["policy"].params),
            job.source.eval_batches, job.tokenizer, config))
  finally:
    elastic_lib.close(job.workers)  # Held workers stop (and stop billing).
  return states["policy"]
