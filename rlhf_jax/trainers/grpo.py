"""The GRPO-family job: SFT warm-start, then rollout -> score -> train steps.

Resume order: (1) the latest checkpoint in workdir, else (2) a fresh run
(SFT, then RL from step 0). A run killed at any point and restarted with the
same command continues from its last checkpoint and writes the same metrics
an uninterrupted run would have (all randomness derives from seed and step).
"""

from __future__ import annotations

import dataclasses
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.engine.engine import Engine
from rlhf_jax.metrics import Progress
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.rl import losses, objectives, registry
from rlhf_jax.rl.learner import Learner, OptimConfig, make_optimizer
from rlhf_jax.trainers import builders, report, rollout, sources
from rlhf_jax.trainers.sft import run_sft
from rlhf_jax.trainers.validate import validate_rl


class _StopFlag:
  """Set by SIGTERM/SIGINT (preemption): save and exit after this step."""

  def __init__(self):
    self.requested = False
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, self._set)

  def _set(self, signum, frame):
    del frame
    logging.warning("signal %d: checkpointing after this step", signum)
    self.requested = True


def _learner(config, graphdef, layout, max_len):
  rl = config.rl
  terms, weight = objectives.policy_terms(objectives.PolicyLossConfig(
      policy_loss=rl.policy_loss, clip_low=rl.clip_low,
      clip_high=rl.clip_high, clip_c=rl.clip_c or None, kl_coef=rl.kl_coef,
      kl_estimator=rl.kl_estimator, kl_in_loss=rl.kl_in_loss,
      aggregation=rl.aggregation, max_len=max_len))
  o = config.optim
  optimizer = make_optimizer(OptimConfig(
      learning_rate=o.learning_rate, warmup_steps=o.warmup_steps,
      decay_steps=o.decay_steps, end_lr_ratio=o.end_lr_ratio, b1=o.b1,
      b2=o.b2, weight_decay=o.weight_decay, grad_clip=o.grad_clip))
  return Learner(graphdef, layout, optimizer, terms_fn=terms,
                 weight_fn=weight, micro_batches=rl.micro_batches)


def evaluate(engine: Engine, params, batches, tokenizer, config) -> dict:
  """Greedy accuracy of the first reward function on held-out prompts."""
  values = []
  for prompts in batches:
    samples = rollout.generate(Driver(engine, params), prompts, 1, seed=0)
    rewards, _ = rollout.score(samples, prompts, tokenizer,
                               [config.rl.rewards[0]], None, "zero")
    values.extend(rewards.tolist())
  return {"eval/accuracy": float(np.mean(values))}


def rl_step(step, state, ref_params, prompts, *, config, learner, engine,
            rollout_layout, tokenizer, prompt_len):
  """One GRPO step; returns the new state and its metrics (host floats)."""
  rl, G = config.rl, config.rollout.samples_per_row
  t0 = time.perf_counter()
  rollout_params = jax.block_until_ready(
      mesh_lib.to_layout(state.params, rollout_layout))
  t1 = time.perf_counter()
  driver = Driver(engine, rollout_params, weight_version=step - 1)
  samples = rollout.generate(driver, prompts, G,
                             rollout.step_seed(config.seed, step))
  t2 = time.perf_counter()
  rewards, reward_metrics = rollout.score(
      samples, prompts, tokenizer, list(rl.rewards),
      list(rl.reward_weights) or None, rl.on_reward_error)
  packed = rollout.pack(samples, prompt_len, config.rollout.max_new_tokens)
  batch = learner.put_batch(packed.arrays)
  old_logp = learner.logprobs(state.params, batch)
  ref_logp = learner.logprobs(ref_params, batch)
  mask = batch["loss_mask"]
  rewards = jnp.asarray(rewards)
  if rl.kl_coef and not rl.kl_in_loss:
    rewards, _ = losses.kl_reward_penalty(rewards, old_logp, ref_logp, mask,
                                          beta=rl.kl_coef,
                                          estimator=rl.kl_estimator)
  advantages = registry.get("advantage", rl.advantage)(rewards, G)
  batch = learner.put_batch({**batch, "old_logp": old_logp,
                             "ref_logp": ref_logp, "advantages": advantages})
  gap = jnp.abs(old_logp - packed.sampler_logp) * mask
  gap_max, gap_mean = jnp.max(gap), jnp.sum(gap) / jnp.sum(mask)
  jax.block_until_ready(batch)
  t3 = time.perf_counter()

  rng = np.random.default_rng(rollout.step_seed(config.seed, step))
  B, n = len(samples), rl.num_minibatches
  train = []
  for _ in range(rl.ppo_epochs):
    perm = rng.permutation(B)
    for k in range(n):
      state, m = learner.step(state, learner.rows(batch, perm[k::n]))
      train.append(m)
  train = jax.device_get(train)
  t4 = time.perf_counter()

  gen_tokens = float(packed.response_len.sum())
  metrics = {
      "rollout/reward_mean": float(np.mean(rewards)),
      "rollout/response_len_mean": float(packed.response_len.mean()),
      "rollout/logprob_gap": float(gap_max),
      "rollout/logprob_gap_mean": float(gap_mean),
      "rollout/weight_version": float(step - 1),
      **{k: float(v) for k, v in reward_metrics.items()},
      **{f"train/{k}": float(np.mean([m[k] for m in train]))
         for k in train[0]},
      "perf/repartition_s": t1 - t0, "perf/rollout_s": t2 - t1,
      "perf/scoring_s": t3 - t2, "perf/train_s": t4 - t3,
      "perf/step_s": t4 - t0, "perf/tokens_per_s": gen_tokens / (t4 - t0),
  }
  return state, metrics


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
                   tokenizer=self.tokenizer, prompt_len=self.prompt_len)


def build(config) -> Job:
  """Validates the config, then builds data, model, layouts, learner, engines.

  The data comes from `sources.build` (`config.data.kind`); the model from
  the HF directory `config.model.path` when set, else random init.
  """
  source = sources.build(config)
  validate_rl(config, prompt_len=source.prompt_len)
  train_layout, rollout_layout = builders.layouts(config.mesh)
  cfg, graphdef, params = builders.model(
      config.model, seed=config.seed, layout=train_layout,
      vocab_size=source.tokenizer.vocab_size)
  stops = source.stop_ids
  greedy = builders.sampling_params(config.rollout, stops)
  greedy = SamplingParams(temperature=0.0, max_new_tokens=greedy.max_new_tokens,
                          stop_tokens=stops)
  return Job(
      config=config, source=source, graphdef=graphdef,
      params=params, train_layout=train_layout, rollout_layout=rollout_layout,
      learner=_learner(config, graphdef, train_layout,
                       max_len=config.rollout.max_new_tokens),
      engine=builders.engine(cfg, graphdef, rollout_layout, config.rollout,
                             stops),
      eval_engine=Engine(
          cfg, graphdef, rollout_layout, num_rows=config.eval.num_rows,
          samples_per_row=1,
          prefill_buckets=tuple(config.rollout.prefill_buckets),
          sampling=greedy))


def run(config, workdir: str):
  """Runs (or resumes) the job in `workdir`; returns the final train state."""
  config = sources.prepare(config, workdir)
  job = build(config)
  writer, ckpt, main_process = builders.workdir_outputs(config, workdir)
  stop = _StopFlag()
  learner, iterator, params = job.learner, job.iterator, job.params
  evals = job.source.eval_batches
  do_eval = lambda p: evaluate(job.eval_engine, mesh_lib.to_layout(
      p, job.rollout_layout), evals, job.tokenizer, config)

  start = ckpt.latest_step()
  if start is None:
    writer.truncate_after("sft", -1)
    writer.truncate_after("rl", -1)
    params = run_sft(config, job.graphdef, params, job.train_layout,
                     job.source.sft_arrays, writer, verbose=main_process)
    # The reference is a frozen copy: the policy's buffers are donated.
    ref_params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    state, start = learner.init_state(params), 0
    writer.write("rl", 0, do_eval(state.params))
    ckpt.save(0, {"policy": state, "ref": ref_params},
              {"iterator": iterator.get_state()})
  else:
    like = {"policy": learner.init_state(params), "ref": params}
    restored, meta = ckpt.restore(start, like)
    state, ref_params = restored["policy"], restored["ref"]
    iterator.set_state(meta["iterator"])
    writer.truncate_after("rl", start)
    logging.info("resumed from step %d", start)

  total = config.train.steps
  progress = Progress(total, start, name="rl", enabled=main_process)
  for step in range(start + 1, total + 1):
    state, metrics = job.step(step, state, ref_params)
    if step % config.eval.every == 0 or step == total:
      metrics.update(do_eval(state.params))
    record = writer.write("rl", step, metrics)
    progress.update(step, report.log_line(record))
    if step % config.train.checkpoint_every == 0 or step == total or (
        stop.requested):
      ckpt.save(step, {"policy": state, "ref": ref_params},
                {"iterator": iterator.get_state()})
    if stop.requested:
      break
  ckpt.close()
  writer.close()
  if main_process and not stop.requested:
    report.finish(writer.read(), workdir)
  return state
