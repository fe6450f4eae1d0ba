"""Async RL's split of the devices when `asynchronous.rollout_devices=-1`:
the cost model (`sched/cost_model/`) predicts a batch's rollout and
training seconds, `sched/staleness.rollout_split` picks the split."""

from __future__ import annotations

import dataclasses

from absl import logging

from rlhf_jax.config import checks
from rlhf_jax.errors import ConfigError
from rlhf_jax.sched import staleness
from rlhf_jax.sched.cost_model import hardware, profiles
from rlhf_jax.sched.cost_model.async_batch import batch_seconds
from rlhf_jax.sched.cost_model.setting import Setting


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
