"""The GRPO-family job: SFT warm-start, then rollout -> score -> train steps.

One step reads top to bottom (`grpo_step`): the policy moves to the rollout
layout, the rollout (`job.rollout`, built once: the trainer's mesh or
elastic workers, with the common prefix and long-tail policies as its
options) streams finished groups which the reward functions score as they
arrive, the policy moves back, the ADVANTAGES stage runs as one jitted
function (`rl/prepare.py`), then `ppo_epochs x num_minibatches` updates.
With `rl.dynamic_sampling` the sampling is a DAPO refill loop; with
`rl.stream` the step is `streamed_step` (training on finished groups
while the rest decode). Resume, evaluation and checkpoints: `loop.py`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
from typing import Any

import jax
import numpy as np

from rlhf_jax.config import checks
from rlhf_jax.config.sections import RLJob
from rlhf_jax.data import sources
from rlhf_jax.envs.episodes import ReplayLog
from rlhf_jax.metrics import rl_step_metrics
from rlhf_jax.models import build as model_build
from rlhf_jax.parallel import colocate
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.rewards.scoring import RewardScorer
from rlhf_jax.rl import batch as batch_lib
from rlhf_jax.rl import packing, prepare, scoring_passes, streaming
from rlhf_jax.rl.learner import Learner, TrainState, train_epochs
from rlhf_jax.rl.scoring_passes import ScoringPasses
from rlhf_jax.rollout import dynamic_sampling
from rlhf_jax.rollout.base import Rollout, Sampled, generate, step_seed
from rlhf_jax.timeline import Timeline
from rlhf_jax.trainers import grpo_async, loop
from rlhf_jax.trainers import policy as policy_lib
from rlhf_jax.trainers.sft import run_sft


@dataclasses.dataclass
class Job:
  """Everything a GRPO run builds before its first step."""
  c: RLJob                  # The typed config sections.
  source: sources.DataSource
  graphdef: Any
  params: Any               # Initial policy (random or HF), before SFT.
  train_layout: Any
  rollout_layout: Any
  learner: Learner
  preparer: prepare.Preparer
  scorer: RewardScorer
  rollout: Rollout
  eval_rollout: Any         # Greedy `LocalRollout` for held-out prompts.
  colocation: colocate.Colocation
  cfg: Any = None           # The policy's ModelConfig (no adapters).

  policy: policy_lib.Policy | None = None
  side: grpo_async.AsyncSide | None = None  # Async RL's rollout.
  fused: ScoringPasses | None = None  # Passes run on the tail's freed devices.
  sft_layout: Any = None    # Async RL: the warm-start's (every device).

  def trainable(self, params):
    return self.policy.trainable(params)

  def fresh_states(self, params, *, copy: bool = True) -> dict:
    """The checkpointed states from the post-SFT `params`
    (`Policy.fresh_states`)."""
    return self.policy.fresh_states(params, "policy", copy=copy)

  @property
  def tokenizer(self):
    return self.source.tokenizer

  @property
  def iterator(self):
    return self.source.iterator

  def step(self, step, state, ref_params, prompts=None):
    """One RL step on the next prompt batch (or `prompts`)."""
    if self.side is not None:  # The rollout drew and sampled the batch.
      return grpo_async.step(self, step, state, ref_params, _train_batch)
    step_fn = streamed_step if self.c.rl.stream else grpo_step
    prompts = next(self.iterator) if prompts is None else prompts
    return step_fn(self, step, state, ref_params, prompts)

  def sample(self, prompts, step: int) -> Sampled:
    """The step's scored samples: one rollout, or DAPO's refill rounds."""
    c = self.c
    run_round = functools.partial(
        generate, self.rollout, num_samples=c.rollout.samples_per_row,
        seed=step_seed(c.seed, step), step=step, scorer=self.scorer)
    if not c.rl.dynamic_sampling:
      return run_round(prompts)
    return dynamic_sampling.collect(
        prompts, self.iterator, run_round,
        group_size=c.rollout.samples_per_row,
        max_rounds=c.rl.dynamic_max_rounds)


def grpo_step(job: Job, step: int, state: TrainState, ref_params, prompts):
  """One GRPO step; returns the new state and its metrics (host floats).

  The mesh switches layouts in place (`parallel/colocate.py`): the
  policy's buffers are donated to the rollout layout and back, the
  optimizer state waits in host memory while the rollout decodes, and the
  parked reference visits the device for the ADVANTAGES stage. Every phase
  is a span on the timeline; the perf/ metrics come from those spans.
  """
  co, rl = job.colocation, job.c.rl
  co.begin_step(step)
  with co.span("repartition"):
    rollout_params = co.to_rollout(state.params)
    opt_state = co.park(state.opt_state)
  job.rollout.set_weights(rollout_params, co.version, master=co.master)
  with co.span("rollout"), scoring_passes.during(
      job.fused, job.rollout, policy=rollout_params, ref=ref_params) as fused:
    sampled = job.sample(prompts, step)  # Rewards scored as groups finish.
  with co.span("repartition"):
    params = co.to_train(rollout_params)
  with co.span("scoring"), scoring_passes.reference(
      co, ref_params, fused) as ref:
    keep = co.fresh(sampled.samples)  # Raises on stale ones unless "drop".
    batch, info = _train_batch(job, sampled.samples, sampled.rewards,
                               keep & sampled.valid, params, ref,
                               minibatches=rl.num_minibatches, fused=fused)
    jax.block_until_ready(batch)  # Before the reference copy is freed.
  with co.span("train"):
    state = TrainState(params, co.unpark(opt_state), state.step)
    (state,), (trained,) = train_epochs(
        [job.learner], [state], batch, epochs=rl.ppo_epochs,
        num_minibatches=rl.num_minibatches, seed=step_seed(job.c.seed, step))
  return state, rl_step_metrics(
      jax.device_get(info), {"train": trained}, co.end_step(step),
      sampled.metrics, job.learner.state_bytes(state), version=co.version,
      stale=int(np.sum(~keep)), step=step, alarm_kl=rl.mismatch_alarm_kl)


def streamed_step(job: Job, step: int, state: TrainState, ref_params,
                  prompts):
  """GRPO with micro-batch streaming (RLBoost, `rl/streaming.py`): once the
  trainer's devices leave the rollout they train on finished groups while
  the rest decode, an update as soon as its parts are in (old log-probs:
  the step's weights). One update equals `grpo_step`'s (float32 rounding).
  """
  co, c = job.colocation, job.c
  co.begin_step(step)
  with co.span("repartition"):
    rollout_params = co.to_rollout(state.params)
    opt_state = co.park(state.opt_state)
  job.rollout.set_weights(rollout_params, co.version, master=co.master)
  job.scorer.reset()
  updates = streaming.StreamedUpdates(
      job.learner, functools.partial(_part_batch, job),
      num_groups=len(prompts.prompt_ids),
      groups_per_part=c.train.prompts_per_step // c.rl.stream_parts,
      parts_per_update=c.rl.stream_parts // c.rl.num_minibatches)
  t0 = co.timeline.now()
  with contextlib.ExitStack() as scope:

    def leave_rollout():  # The train layout; the reference on device.
      if updates.started:
        return
      co.timeline.add(co.group, "rollout", t0, co.timeline.now())
      with co.span("repartition"):
        params = co.to_train(rollout_params)
      ref = scope.enter_context(colocate.transient(co, ref_params))
      updates.start(TrainState(params, co.unpark(opt_state), state.step), ref)

    for group in job.rollout.stream(
        prompts, c.rollout.samples_per_row, step_seed(c.seed, step),
        step=step, trainer_busy=updates.busy):
      updates.add(group, job.scorer.score(group, prompts))
      last_sample = co.timeline.now()  # The rollout's end, once all are in.
      if job.rollout.trainer_free:
        leave_rollout()
        with co.span("train"):
          updates.train_ready()
    co.timeline.add("workers", "rollout", t0, last_sample)
    leave_rollout()
    with co.span("train"):
      updates.train_ready(final=True)
      state, trained = updates.finish()
  info = streaming.merge_infos(updates.infos)
  return state, rl_step_metrics(
      info, {"train": trained}, co.end_step(step), job.rollout.metrics(),
      job.scorer.metrics(), updates.counts(), job.learner.state_bytes(state),
      version=co.version, stale=int(np.sum(~info["keep"])), step=step,
      alarm_kl=c.rl.mismatch_alarm_kl)


def _train_batch(job: Job, samples, rewards, trainable, params, ref, *,
                 minibatches: int, current=None, fused=None):
  """The device training batch of whole groups and its info: the
  ADVANTAGES stage's, the response lengths and the trained tokens. With
  `rl.pack_length`, packed rows dealt to `minibatches` mini-batches;
  `current`: `Preparer.put`'s; `fused`: the scores of the passes that ran
  during the rollout (`scoring_passes.during`), not run here then."""
  G, rl = job.c.rollout.samples_per_row, job.c.rl
  slots = packing.Slots(
      rl.pack_length, minibatches, rl.micro_batches,
      job.learner.layout.shards("batch")) if rl.pack_length else None
  packed = batch_lib.pack(
      samples, job.source.prompt_len, job.c.rollout.max_new_tokens,
      group_size=G if rl.share_prompt and G > 1 else 0,
      trainable=trainable, slots=slots)
  batch = job.preparer.put(packed, rewards, current)
  if fused is None:
    batch, info = job.preparer(params, ref, batch)
  else:
    batch, info = job.preparer.from_scores(
        batch, job.fused.assemble(samples, fused, packed))
  computed, real = packed.positions()
  return batch, {**info, "response_len": packed.response_len,
                 "tokens": float(packed.arrays["loss_mask"].sum()),
                 "positions": computed, "real_positions": real}


def _part_batch(job: Job, samples, rewards, params, ref):
  """`_train_batch` of a streamed part; stale samples are left out (or
  raise, as `mesh.stale_samples` says)."""
  keep = job.colocation.fresh(samples)
  batch, info = _train_batch(job, samples, rewards, keep, params, ref,
                             minibatches=1)
  return batch, {**info, "keep": keep}


def evaluate(job: Job, params) -> dict:
  """Greedy responses to held-out prompts: eval/accuracy is the first
  reward function's mean, and eval/rewards/<name> each reward's (a format
  reward beside a correctness one says whether a gain is format alone)."""
  c = job.c
  names = list(c.rl.rewards)
  scorer = RewardScorer(job.tokenizer, names,
                        [1.0] + [0.0] * (len(names) - 1), "zero")
  values, sums = [], collections.Counter()
  job.eval_rollout.set_weights(job.colocation.rollout_copy(params), 0)
  for prompts in job.source.eval_batches:
    out = generate(job.eval_rollout, prompts, 1, seed=0, scorer=scorer)
    values.append(out.rewards)
    for name in names:  # Each batch's means, weighed by its size.
      sums[name] += out.metrics[f"rewards/{name}"] * len(out.rewards)
  total = sum(len(v) for v in values)
  return {"eval/accuracy": float(np.mean(np.concatenate(values),
                                          dtype=np.float64)),
          **{f"eval/rewards/{name}": sums[name] / total for name in names}}


def build(config, timeline: Timeline | None = None) -> Job:
  """Validates the config, then builds data, model, layouts, learner and
  the rollout (`rollout/build.py`).

  The data comes from `data/sources.py` (`config.data.kind`); the model
  from the HF directory `config.model.path` when set, else random init.
  """
  c = RLJob.from_config(config)
  source = sources.build(config, c)
  split = c.asynchronous.enabled and not c.rollout.workers.num
  if split and c.asynchronous.rollout_devices < 0:
    c = grpo_async.with_cost_model_split(
        c, model_build.config_of(c.model,
                                 vocab_size=source.tokenizer.vocab_size),
        jax.devices()[:c.mesh.num_devices or None], source.prompt_len)
  checks.check_rl_job(c, job="grpo", prompt_len=source.prompt_len)
  sft_layout = async_layout = None
  if split:  # Decode on a part of the mesh of its own.
    train_layout, async_layout, rollout_layout = mesh_lib.async_layouts(
        c.mesh, checks.async_rollout_devices(c))
    sft_layout = mesh_lib.layouts(c.mesh)[0]
  else:  # Or on the workers (async), or colocated.
    train_layout, rollout_layout = mesh_lib.layouts(c.mesh)
  p = policy_lib.build(c, source, train_layout, rollout_layout, timeline)
  rl = c.rl
  side = None
  if c.asynchronous.enabled:
    side = grpo_async.build_side(c, p, source, async_layout)
  return Job(
      c=c, source=source, graphdef=p.graphdef, params=p.params,
      fused=policy_lib.fused_scoring(c, p, source.prompt_len),
      train_layout=train_layout, rollout_layout=rollout_layout,
      learner=p.learner,
      preparer=prepare.Preparer(p.learner, rl.advantage_config(
          c.rollout.samples_per_row)),
      scorer=RewardScorer(
          source.tokenizer, rl.rewards, rl.reward_weights, rl.on_reward_error,
          overlong=(c.rollout.max_new_tokens, rl.overlong_buffer,
                    rl.overlong_penalty) if rl.overlong_buffer else None),
      rollout=p.rollout, eval_rollout=p.eval_rollout,
      colocation=p.colocation, cfg=p.cfg, policy=p, side=side,
      sft_layout=sft_layout)


def run(config, workdir: str):
  """Runs (or resumes) the job in `workdir`; returns the final train state."""
  config = sources.prepare(config, workdir)
  job = build(config)
  episodes = getattr(job.rollout, "episodes", None)
  if episodes is not None:  # Tool outputs replayed by a resumed step.
    episodes.log = ReplayLog(os.path.join(workdir, "episodes"),
                             keep_steps=job.c.train.checkpoint_every,
                             process=jax.process_index())

  def fresh(writer, verbose, sft_dir, stop):
    params, layout = job.params, job.train_layout
    if job.sft_layout is not None:  # Async RL: every device warm-starts.
      params, layout = (mesh_lib.to_layout(params, job.sft_layout),
                        job.sft_layout)
    params = run_sft(job.c.sft, job.graphdef, params, layout,
                     job.source.sft_arrays, writer, verbose=verbose,
                     checkpoint_dir=sft_dir, stop=stop)
    if job.sft_layout is not None:  # Then the train part holds it.
      params = mesh_lib.to_layout(params, job.train_layout)
    return job.fresh_states(params)

  def step(s, states):
    state, metrics = job.step(s, states["policy"], states.get("ref"))
    return {**states, "policy": state}, metrics

  try:
    states = loop.run(
        config, workdir, train=job.c.train, eval_every=job.c.eval.every,
        iterator=job.iterator, colocation=job.colocation,
        fresh=fresh, step=step, history=job.rollout.length_history,
        like=lambda: job.fresh_states(job.params, copy=False),
        evaluate=lambda states: evaluate(job, states["policy"].params),
        side=job.side)
  finally:
    job.rollout.close()  # Held workers stop (and stop billing).
    if job.side is not None:
      job.side.close()
  return None if states is None else states["policy"]
