"""The RL job: an algorithm (`config.job`, `trainers/algorithms.py`: GRPO,
PPO, ...) trained step after step by `rl_step` after the SFT warm-start.

  job = build(config)          # validated, every variant chosen
  states, metrics = rl_step(job, step, states)
  run(config, workdir)         # resumable, evaluated, checkpointed

`build` chooses what the step executes: the rollout
(`rollout/step_rollouts.py`: colocated on the trainer's mesh or its
elastic workers, DAPO's refill with `rl.dynamic_sampling`, asynchronous
with `asynchronous.enabled`, refilled on its rollout thread with both), the train stage (`rl/train_stage.py`:
whole batch, or streamed with `rl.stream`) and the passes fused into the
long-tail rollout (`rollout.long_tail.fusion`). Resume, evaluation and
checkpoints: `loop.py`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax

from rlhf_jax.config import checks
from rlhf_jax.config.sections import RLJob
from rlhf_jax.data import sources
from rlhf_jax.envs.episodes import ReplayLog
from rlhf_jax.models import checkpoint_or_preset
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.rl import train_stage
from rlhf_jax.rollout import build as rollout_build
from rlhf_jax.rollout import dynamic_sampling
from rlhf_jax.rollout import step_rollouts
from rlhf_jax.rollout.async_workers import WorkerBackend
from rlhf_jax.rollout.asynchronous import AsyncRollout, PagedBackend
from rlhf_jax.rollout.base import step_seed
from rlhf_jax.timeline import Timeline
from rlhf_jax.trainers import algorithms, async_split, loop
from rlhf_jax.trainers.evaluation import evaluate
from rlhf_jax.trainers import policy as policy_lib
from rlhf_jax.trainers.rl_step import rl_step
from rlhf_jax.trainers.sft import run_sft


@dataclasses.dataclass
class Job:
  """Everything an RL run builds before its first step."""
  c: RLJob                  # The typed config sections.
  source: sources.DataSource
  policy: policy_lib.Policy  # Model, learner, layout switch, rollouts.
  algorithm: Any            # `trainers/grpo.GRPO`, `trainers/ppo.PPO`, ...
  rollout: Any              # `rollout/step_rollouts`: what a step samples.
  train_stage: Callable     # (trainable_of, step=) -> `rl/train_stage` stage.
  train_layout: Any
  rollout_layout: Any
  fused: Any = None         # `ScoringPasses` on the tail's freed devices.
  sft_layout: Any = None    # Async RL: the warm-start's (every device).

  # What the step and the tests read of the parts.
  colocation = property(lambda self: self.policy.colocation)
  clock = property(lambda self: self.policy.clock)
  sampler = property(lambda self: self.policy.rollout)  # Engine-level.
  params = property(lambda self: self.policy.params)  # Before SFT.
  graphdef = property(lambda self: self.policy.graphdef)
  cfg = property(lambda self: self.policy.cfg)
  learner = property(lambda self: self.policy.learner)
  eval_rollout = property(lambda self: self.policy.eval_rollout)
  tokenizer = property(lambda self: self.source.tokenizer)
  iterator = property(lambda self: self.source.iterator)

  def fresh_states(self, params, *, copy: bool = True) -> dict:
    """The checkpointed states from the post-SFT `params`."""
    return self.algorithm.fresh_states(params, copy=copy)


def build(config, timeline: Timeline | None = None) -> Job:
  """Validates the config, then builds data, model, layouts, the policy
  (`trainers/policy.py`), the algorithm, the rollout and the train stage.

  The data comes from `data/sources.py` (`config.data.kind`); the model
  from the HF directory `config.model.path` when set, else random init.
  """
  algorithm = algorithms.get(config.job)
  c = RLJob.from_config(config)
  source = sources.build(c)
  split = c.asynchronous.enabled and not c.rollout.workers.num
  if split and c.asynchronous.rollout_devices < 0:
    c = async_split.with_cost_model_split(
        c, checkpoint_or_preset.config_of(
            c.model, vocab_size=source.tokenizer.vocab_size),
        jax.devices()[:c.mesh.num_devices or None], source.prompt_len)
  checks.check_rl_job(c, job=algorithm.checks_as,
                      prompt_len=source.prompt_len)
  sft_layout = async_layout = None
  if split:  # Decode on a part of the mesh of its own.
    train_layout, async_layout, rollout_layout = mesh_lib.async_layouts(
        c.mesh, checks.async_rollout_devices(c))
    sft_layout = mesh_lib.layouts(c.mesh)[0]
  else:  # Or on the workers (async), or colocated.
    train_layout, rollout_layout = mesh_lib.layouts(c.mesh)
  p = policy_lib.build(c, source, train_layout, rollout_layout, timeline)
  algo = algorithm(config, c, source, p)
  return Job(c=c, source=source, policy=p, algorithm=algo,
             rollout=_rollout(c, p, source, async_layout, algo),
             train_stage=_train_stage(c, algo, p.colocation, p.clock),
             train_layout=train_layout, rollout_layout=rollout_layout,
             fused=algo.fused, sft_layout=sft_layout)


def _rollout(c, p: policy_lib.Policy, source, async_layout, algo):
  """The step rollout the sections `c` ask for (see the module doc)."""
  G, policy_key = c.rollout.samples_per_row, algo.policy_key
  if c.asynchronous.enabled:
    a = c.asynchronous
    if async_layout is None:  # The elastic workers decode.
      backend = WorkerBackend(p.rollout.manager)
    else:
      backend = PagedBackend(rollout_build.engines(
          c.rollout, p.rollout_cfg, p.rollout_graphdef, async_layout,
          source.stop_ids, record_routes=c.rl.routing_replay))
    batch_groups = c.train.prompts_per_step
    return step_rollouts.Asynchronous(
        AsyncRollout(
            backend, source.iterator, num_samples=G, seed=c.seed,
            eta=a.max_staleness,
            switch_after_groups=(batch_groups // 2
                                 if a.switch_after_groups < 0
                                 else a.switch_after_groups),
            in_flight=a.in_flight, last_step=c.train.steps,
            refill=dynamic_sampling.Refill(
                algo.scorer, c.rl.dynamic_max_rounds)
            if c.rl.dynamic_sampling else None),
        p.colocation, p.clock, async_layout, group_size=G,
        eta=a.max_staleness,
        policy_key=policy_key,
        manager=None if async_layout is not None else p.rollout.manager)
  kwargs = dict(group_size=G, seed=c.seed, policy_key=policy_key)
  if c.rl.dynamic_sampling:
    return step_rollouts.Refill(p.rollout, p.colocation, p.clock,
                                source.iterator,
                                max_rounds=c.rl.dynamic_max_rounds, **kwargs)
  return step_rollouts.Colocated(p.rollout, p.colocation, p.clock,
                                 source.iterator, **kwargs)


def _train_stage(c, algo, co, clock) -> Callable:
  """(trainable_of, step=) -> the step's train stage (see the module doc)."""
  rl = c.rl
  if rl.stream:
    groups = c.train.prompts_per_step
    return lambda trainable_of, step: train_stage.Streamed(
        algo, co, clock, trainable_of, step=step, num_groups=groups,
        groups_per_part=groups // rl.stream_parts,
        parts_per_update=rl.stream_parts // rl.num_minibatches)
  return lambda trainable_of, step: train_stage.WholeBatch(
      algo, co, clock, trainable_of, step=step, epochs=rl.ppo_epochs,
      num_minibatches=rl.num_minibatches, seed=step_seed(c.seed, step))


def run(config, workdir: str):
  """Runs (or resumes) the job in `workdir`; returns the policy's final
  train state."""
  config = sources.prepare(config, workdir)
  job = build(config)
  episodes = job.policy.rollout.episodes
  if episodes is not None and episodes.replayable:
    # Tool outputs replayed by a resumed step.
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

  try:
    states = loop.run(
        config, workdir, train=job.c.train, eval_every=job.c.eval.every,
        iterator=job.iterator, colocation=job.colocation, clock=job.clock,
        fresh=fresh,
        step=lambda s, states: rl_step(job, s, states),
        history=job.rollout.length_history,
        like=lambda: job.fresh_states(job.params, copy=False),
        evaluate=lambda states: evaluate(job, states), rollout=job.rollout)
  finally:
    job.rollout.close()         # The async rollout's thread stops.
    job.policy.rollout.close()  # Held workers stop (and stop billing).
  return None if states is None else states[job.algorithm.policy_key]
