"""Async GRPO (`config.asynchronous`): the rollout decodes on its own part
of the mesh (`rollout/asynchronous.py`) while the trainer trains on the
rest, the samples at most eta weight versions old.

One step reads top to bottom (`step`): publish the last step's weights (a
rollout copy moved to the rollout's devices), take the step's batch (drawn
and decoded while earlier steps trained), score it, run the ADVANTAGES
stage with the trainer's weights as the proximal policy, train. Stale
samples are corrected by `rl.importance_weight` (decoupled PPO, TIS, MIS:
`rl/off_policy.py`); one older than eta would be dropped and counted.
Checkpoints hold the rollout's state at its switch to the saved version,
so a resumed run continues exactly as the uninterrupted one.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from absl import logging

from rlhf_jax.config import checks
from rlhf_jax.errors import ConfigError
from rlhf_jax.metrics import rl_step_metrics
from rlhf_jax.parallel import colocate
from rlhf_jax.rl.learner import TrainState, train_epochs
from rlhf_jax.rollout import build as rollout_build
from rlhf_jax.rollout.async_workers import WorkerBackend
from rlhf_jax.rollout.asynchronous import AsyncRollout, PagedBackend
from rlhf_jax.rollout.base import step_seed
from rlhf_jax.sched import staleness
from rlhf_jax.sched.cost_model import hardware, profiles
from rlhf_jax.sched.cost_model.async_batch import batch_seconds
from rlhf_jax.sched.cost_model.setting import Setting
from rlhf_jax.timeline import device_group
from rlhf_jax.workers import weights as weights_lib


class AsyncSide:
  """The rollout beside the steps: what `loop.run` starts, checkpoints
  (`dump`, `saved`) and what `step` publishes to and takes from."""

  def __init__(self, rollout: AsyncRollout, colocation, layout):
    """`layout`: the rollout's part of the mesh, or None: elastic workers
    decode (they pull host copies)."""
    self.rollout, self.co = rollout, colocation
    self.shardings = None   # The rollout copy's, from the first params.
    self.layout = layout
    self.group = ("workers" if layout is None else
                  device_group("rollout", layout.mesh.devices.flat))
    self.published = None   # The newest version the rollout was given.
    self.params = None      # The trainer's newest params (to publish).

  def copy(self, params):
    """The rollout copy of `params` on the rollout's devices (a host copy
    for the workers)."""
    local = self.co.rollout_copy(params)  # Cast, on the trainer's devices.
    if self.layout is None:
      out = weights_lib.to_payload(local)
    else:
      if self.shardings is None:
        self.shardings = self.layout.param_shardings(local)
      out = jax.device_put(local, self.shardings)
    colocate.delete(local)  # Once the copy has read it.
    return out

  def start(self, step: int, states: dict, meta: dict) -> None:
    self.params = states["policy"].params
    self.rollout.start(self.copy(self.params), step, first_step=step + 1,
                       snapshot=meta.get("async"))
    self.published = step

  def publish(self, version: int) -> None:
    if self.published < version:
      self.rollout.publish(self.copy(self.params), version)
      self.published = version

  def dump(self, step: int) -> dict:
    if self.published is None:  # Step 0, before the rollout starts.
      return {}
    snap = self.rollout.publish(self.copy(self.params), step, snapshot=True)
    self.published = step
    return {"async": snap}

  def saved(self) -> None:
    if self.published is not None:
      self.rollout.release()

  def close(self) -> None:
    self.rollout.close()


def with_cost_model_split(c, cfg, devices, prompt_len: int):
  """The job sections `c` with `asynchronous.rollout_devices=-1` replaced by
  the split `staleness.rollout_split` picks from roofline batch times
  (`sched/cost_model/async_batch.batch_seconds`) of the model `cfg` on `devices`' kind:
  prompts of `prompt_len` tokens, responses of half the cap (the lengths
  are not known before the run), the proximal (and, with a KL term, the
  reference) log-probs scored, `ppo_epochs x num_minibatches` updates;
  among the splits the config checks accept (the batch shards over the
  trainer's part, `rollout_tensor` divides the rollout's)."""
  try:
    hw = hardware.of_device(devices[0])
  except KeyError as e:
    raise ConfigError(f"config.asynchronous.rollout_devices=-1: {e.args[0]}"
                      "; set the split by hand") from None
  profile = profiles.profile_of(cfg)
  rl, ro = c.rl, c.rollout
  setting = Setting(
      model=profile, hardware=hw, reserved_devices=len(devices),
      rollout_tp=c.mesh.rollout_tensor,
      scoring_models=(profile,) * (1 + (rl.kl_coef > 0)),
      optimizer_steps=rl.ppo_epochs * rl.num_minibatches,
      max_response=ro.max_new_tokens)
  G = ro.samples_per_row
  rollout_s, train_s = batch_seconds(
      setting, samples=c.train.prompts_per_step * G, group_size=G,
      prompt_len=prompt_len, response_len=ro.max_new_tokens / 2)
  n = len(devices)
  fits = [r for r in range(1, n) if _check_split(c, r, n, prompt_len) is None]
  if not fits:
    raise ConfigError(f"config.asynchronous.rollout_devices=-1: no split of "
                      f"{n} devices passes the checks; with half: "
                      f"{_check_split(c, n // 2, n, prompt_len)}")
  r = staleness.rollout_split(fits, n, rollout_s, train_s)
  logging.info("async split (cost model, %s): rollout on %d of %d devices, "
               "%.3g s a batch; training %.3g s", hw.name, r, len(devices),
               rollout_s(r), train_s(len(devices) - r))
  return dataclasses.replace(c, asynchronous=dataclasses.replace(
      c.asynchronous, rollout_devices=r))


def _check_split(c, rollout_devices: int, devices: int,
                 prompt_len: int) -> ConfigError | None:
  """The config checks' error with this split, or None."""
  a = dataclasses.replace(c.asynchronous, rollout_devices=rollout_devices)
  try:
    checks.check_rl_job(dataclasses.replace(c, asynchronous=a), job="grpo",
                        prompt_len=prompt_len, num_devices=devices)
  except ConfigError as e:
    return e
  return None


def build_side(c, policy, source, layout) -> AsyncSide:
  """The async rollout of the job sections `c` on `layout` (its part of
  the mesh), decoding `policy`'s model, or (layout None) on the elastic
  workers of `policy.rollout`; `source` gives the prompts."""
  if layout is None:
    backend = WorkerBackend(policy.rollout.manager)
  else:
    backend = PagedBackend(rollout_build.engines(
        c.rollout, policy.rollout_cfg, policy.rollout_graphdef, layout,
        source.stop_ids))
  a = c.asynchronous
  batch_groups = c.train.prompts_per_step
  rollout = AsyncRollout(
      backend, source.iterator, num_samples=c.rollout.samples_per_row,
      seed=c.seed, eta=a.max_staleness,
      switch_after_groups=(batch_groups // 2 if a.switch_after_groups < 0
                           else a.switch_after_groups),
      in_flight=a.in_flight, last_step=c.train.steps)
  return AsyncSide(rollout, policy.colocation, layout)


def step(job, step: int, state: TrainState, ref_params, train_batch):
  """One async GRPO step; returns the new state and its metrics.
  `train_batch`: GRPO's (`grpo._train_batch`)."""
  co, c, side = job.colocation, job.c, job.side
  rl, eta = c.rl, c.asynchronous.max_staleness
  co.begin_step(step)
  start = co.timeline.now()
  side.publish(step - 1)
  batch = side.rollout.take(step)  # An idle span of the trainer's devices.
  waited = co.timeline.now() - start
  samples, version = batch.samples, step - 1  # The trainer's weights.
  G = c.rollout.samples_per_row
  job.scorer.reset()  # Host rewards, group by group.
  rewards = np.concatenate([job.scorer.score(samples[i:i + G], batch.prompts)
                            for i in range(0, len(samples), G)])
  oldest = np.array([s.weight_version for s in samples])
  keep = np.array([staleness.trainable(version, int(o), eta)
                   for o in oldest])
  current = np.array([min(s.token_versions) == max(s.token_versions)
                      == version for s in samples])
  with co.span("scoring"), colocate.transient(co, ref_params) as ref:
    arrays, info = train_batch(job, samples, rewards, keep, state.params,
                               ref, minibatches=rl.num_minibatches,
                               current=current)
    jax.block_until_ready(arrays)
  with co.span("train"):
    (state,), (trained,) = train_epochs(
        [job.learner], [state], arrays, epochs=rl.ppo_epochs,
        num_minibatches=rl.num_minibatches, seed=step_seed(c.seed, step))
  side.params = state.params
  co.version = step
  # The rollout's devices decode all along (their waits for weights:
  # perf/rollout_wait_weights_s).
  co.timeline.add(side.group, "rollout", start, co.timeline.now())
  lag = np.concatenate([version - np.asarray(s.token_versions)
                        for s in samples])  # Per token, in versions.
  extra = {"async/staleness_mean": float(lag.mean()),
           "async/staleness_max": float(lag.max()),
           "async/off_policy_samples": float(np.sum(oldest < version)),
           "perf/trainer_wait_s": waited,  # Timings are perf/.
           **{(f"perf/rollout_{k}" if k.endswith("_s") else f"async/{k}"):
              float(v) for k, v in batch.metrics.items()}}
  if side.layout is not None:
    extra["async/rollout_devices"] = float(side.layout.mesh.devices.size)
  else:
    mgr = job.rollout.manager  # Totals since the start (its thread's).
    extra.update({"workers/alive": float(len(mgr.handles)),
                  "workers/preemptions": float(mgr.stats.preemptions),
                  "workers/migrated_samples": float(
                      mgr.stats.migrated_samples),
                  "workers/pulls": float(mgr.stats.pulls)})
  return state, rl_step_metrics(
      jax.device_get(info), {"train": trained}, co.end_step(step),
      job.scorer.metrics(), extra, job.learner.state_bytes(state),
      version=version, stale=int(np.sum(~keep)), step=step,
      alarm_kl=rl.mismatch_alarm_kl)
