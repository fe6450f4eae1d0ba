"""Fakes and helpers the tests share: a deterministic clock, step runners."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.models.config import ModelConfig
from rlhf_jax.rollout.base import Rollout

# The tiny decoder most engine, rollout and scoring tests run: 64 tokens,
# GQA (4 query heads over 2 kv heads).
TINY_CFG = ModelConfig.tiny(vocab_size=64)


class Clock:
  """A clock the test sets by hand (`t`), or one second per poll round
  (`tick` as a manager's `on_poll` hook: a seed window made
  deterministic)."""

  def __init__(self, t: float = 0.0):
    self.t = t

  def __call__(self):
    return self.t

  def tick(self, _mgr=None):
    self.t += 1.0


def rollout_layout8(tensor: int):
  """A rollout layout over the 8 fake CPU devices (8 / tensor replicas x
  tensor); skips the test on an accelerator with fewer devices."""
  import pytest  # pylint: disable=g-import-not-at-top
  from rlhf_jax.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  if jax.device_count() < 8:
    pytest.skip("needs the 8 fake CPU devices")
  return mesh_lib.rollout_layout(mesh_lib.make_mesh(fsdp=8), tensor)


def copy_tree(tree):
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def local_rollout(job, **tail):
  """A plain `LocalRollout` of the job (the trainer's mesh, no workers):
  on the engines of its sampler or of its seed window when it has them;
  `tail`: long-tail fields (default: off)."""
  from rlhf_jax.config.sections import LongTail
  from rlhf_jax.rollout import build as rollout_build
  from rlhf_jax.rollout.local import LocalRollout

  r = job.sampler
  local = r if isinstance(r, LocalRollout) else (
      r.seed_window.local if r.seed_window is not None else None)
  if local is None:
    ro = dataclasses.replace(job.c.rollout, workers=dataclasses.replace(
        job.c.rollout.workers, num=0))
    local = rollout_build.build(ro, job.cfg, job.graphdef,
                                job.rollout_layout, job.source.stop_ids)
  return LocalRollout(local.engines, tail=LongTail(**tail))


def plain_rollout(job):
  """The job's sampler with every layer off: its trainer's mesh, no common
  prefix, no long-tail policies, no workers (new engines)."""
  from rlhf_jax.config.sections import LongTail, Workers
  from rlhf_jax.rollout import build as rollout_build

  ro = dataclasses.replace(job.c.rollout, workers=Workers(),
                           long_tail=LongTail(), max_common_length=0)
  return rollout_build.build(ro, job.cfg, job.graphdef, job.rollout_layout,
                             job.source.stop_ids)


def with_sampler(job, sampler):
  """The job with its (synchronous) step rollout sampling on `sampler`, an
  engine-level rollout (`local_rollout`, `plain_rollout`)."""
  import copy  # pylint: disable=g-import-not-at-top
  rollout = copy.copy(job.rollout)
  rollout.sampler = sampler
  return dataclasses.replace(job, rollout=rollout,
                             policy=dataclasses.replace(job.policy,
                                                        rollout=sampler))


def whole_batch(job):
  """The job with the whole-batch train stage (`rl.stream` off)."""
  from rlhf_jax.trainers import rl_job  # pylint: disable=g-import-not-at-top
  c = dataclasses.replace(job.c, rl=dataclasses.replace(job.c.rl,
                                                        stream=False))
  return dataclasses.replace(job, train_stage=rl_job._train_stage(  # pylint: disable=protected-access
      c, job.algorithm, job.colocation, job.clock))


def capture_samples(job) -> list:
  """Records every batch the job's train stage takes, as
  `rollout.base.Sampled` (samples in batch order, rewards, valid), in a
  list filled in place (the job's `train_stage` is wrapped)."""
  from rlhf_jax.rollout.base import Sampled  # pylint: disable=g-import-not-at-top
  seen, make = [], job.train_stage

  def stage(trainable_of, step):
    train, got = make(trainable_of, step=step), []
    add, finish = train.add, train.finish

    def spy_add(group):
      got.append(group)
      add(group)

    def spy_finish(fused):
      groups = sorted(got, key=lambda g: g.order)
      seen.append(Sampled(
          [s for g in groups for s in g.samples],
          None if groups[0].rewards is None else np.concatenate(
              [g.rewards for g in groups]),
          np.concatenate([np.full(len(g.samples), g.valid)
                          for g in groups]), {}))
      return finish(fused)
    train.add, train.finish = spy_add, spy_finish
    return train
  job.train_stage = stage
  return seen


def sample(job, prompts, step: int):
  """The job's sampler's scored samples of `prompts` (one synchronous
  round, `rollout.base.generate`) at `step`'s seed."""
  from rlhf_jax.rollout.base import generate, step_seed  # pylint: disable=g-import-not-at-top
  return generate(job.sampler, prompts, job.c.rollout.samples_per_row,
                  step_seed(job.c.seed, step), step=step,
                  scorer=job.algorithm.scorer)


def first_states(job, ref_scale: float = 1.05, critic=None) -> dict:
  """Step 1's states from the job's initial params: the policy's train
  state and the reference (the initial params times `ref_scale`); PPO's
  critic from `critic` params (default: the reward model's)."""
  key = job.algorithm.policy_key
  states = {key: job.learner.init_state(copy_tree(job.params)),
            "ref": jax.tree.map(lambda x: x * ref_scale, job.params)}
  if key == "actor":
    states["critic"] = job.algorithm.critic.init_state(copy_tree(
        job.algorithm.rm_params if critic is None else critic))
  return states


def first_step(job, prompts, rollout=None, ref_scale: float = 1.05,
               states=None):
  """Step 1 of a built RL `job` (`rl_job.rl_step`) from its initial params
  on `prompts`, on `rollout` (an engine-level sampler; default: the job's
  own); the reference is the initial params times `ref_scale` (or
  `states`, `first_states`'s). Returns (the policy's state, metrics); the
  step's states are `first_step.states`."""
  import copy, itertools  # pylint: disable=g-import-not-at-top
  from rlhf_jax.trainers.rl_step import rl_step  # pylint: disable=g-import-not-at-top
  if rollout is not None:
    job = with_sampler(job, rollout)
  step_rollout = copy.copy(job.rollout)
  step_rollout.iterator = itertools.chain([prompts], job.iterator)
  job = dataclasses.replace(job, rollout=step_rollout)
  states = first_states(job, ref_scale) if states is None else states
  out, metrics = rl_step(job, 1, states)
  first_step.states = out
  return out[job.algorithm.policy_key], metrics


def watch_rounds(job, clock: Clock) -> None:
  """Drives the job's elastic rollout by poll rounds: the seed window
  reads `clock`, which the manager ticks every round."""
  r = job.sampler
  if r.seed_window is not None:
    r.seed_window.clock = clock
  pool = r.manager.on_poll

  def on_poll(mgr):
    clock.tick()
    if pool is not None:
      pool(mgr)
  r.manager.on_poll = on_poll


def prompt_batch(requests):
  """A PromptBatch-like batch (ids, lengths, right-padded tokens) of engine
  requests, for `rollout.base.generate`."""
  width = max(len(r.tokens) for r in requests)
  return types.SimpleNamespace(
      prompt_ids=np.array([r.prompt_id for r in requests]),
      lengths_N=np.array([len(r.tokens) for r in requests]),
      tokens_NxP=np.stack([np.pad(r.tokens, (0, width - len(r.tokens)))
                           for r in requests]))


def random_samples(rng, groups: int, group_size: int, prompt_lens,
                   response_lens, vocab: int) -> list:
  """Finished samples of `groups` prompts x `group_size` (G consecutive per
  prompt, as `generate` returns them): prompt lengths drawn from
  `prompt_lens` (a range, or one length per group), response lengths from
  the range `response_lens`; random tokens in [1, vocab), sampler
  log-probs in (-1, 0]."""
  from rlhf_jax.samples import Sample
  out = []
  for n in range(groups):
    p = (prompt_lens[n] if not isinstance(prompt_lens, range)
         else int(rng.integers(prompt_lens.start, prompt_lens.stop)))
    prompt = rng.integers(1, vocab, p).astype(np.int32)
    for g in range(group_size):
      r = int(rng.integers(response_lens.start, response_lens.stop))
      out.append(Sample(
          prompt_id=n, sample_idx=g, prompt_tokens=prompt,
          tokens=rng.integers(1, vocab, r).tolist(), logp=[0.0] * r,
          logp_raw=(-rng.random(r)).tolist(), finish_reason="length",
          weight_version=0))
  return out


class ScriptedRollout(Rollout):
  """An engine-level rollout (`rollout/base.Rollout`) that yields canned
  groups instead of decoding: the step, its train stages, the loop and the
  metrics run without compiling an engine.

  `groups_of(prompts, num_samples, seed, step)` -> the groups of one
  stream (each a list of Samples, in the order they "finish"); every
  sample is stamped with the weight version `set_weights` last gave, as a
  real rollout stamps it. `recorded(samples)` replays samples a real
  rollout produced (by prompt id and sample index), so a scripted step can
  be checked against the real one.
  """

  def __init__(self, groups_of):
    self.groups_of, self.version, self.streams = groups_of, -1, []

  def set_weights(self, params, version: int, master=None) -> None:
    del params, master  # Nothing decodes: only the version is stamped.
    self.version = version

  def stream(self, prompts, num_samples: int, seed: int, *, step: int = 0,
             trainer_busy=None, freed=None):
    del trainer_busy, freed
    groups = self.groups_of(prompts, num_samples, seed, step)
    self.streams.append((step, seed, [len(g) for g in groups]))
    for group in groups:
      yield [dataclasses.replace(s, weight_version=self.version)
             for s in group]

  @staticmethod
  def recorded(samples):
    """groups_of replaying `samples` (any order) for the prompts asked."""
    by_key = {(s.prompt_id, s.sample_idx): s for s in samples}

    def groups_of(prompts, num_samples, seed, step):
      del seed, step
      return [[by_key[int(p), j] for j in range(num_samples)]
              for p in prompts.prompt_ids]
    return groups_of
