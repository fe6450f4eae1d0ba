"""Roofline seconds of one asynchronous RL batch: the cost model both the
async job (`asynchronous.rollout_devices=-1`: which split of the devices
decodes) and the simulator (`sim/async_run.py`) use."""

import dataclasses
import math

from rlhf_jax.sched.cost_model import costs
from rlhf_jax.sched.cost_model.setting import Setting


def batch_seconds(setting: Setting, *, samples: int, group_size: int,
                  prompt_len: float, response_len: float):
  """Roofline seconds of one async batch, as (rollout_s(r), train_s(t)):
  decoding it on r devices (r / rollout_tp engines sharing its samples,
  each group's prompt prefilled and read once, the running batch capped
  by the KV that fits), and scoring and training it on t devices. Mean
  lengths stand in for the distribution: the async rollout overlaps a
  batch's tail with the next batch, so its rate, not its tail, sets the
  pace."""
  s, ctx = setting, prompt_len + response_len

  def rollout_s(r: int) -> float:
    per_engine = math.ceil(samples / max(1, r // s.rollout_tp))
    running = min(per_engine, s.engine_slots(s.hw, s.rollout_tp, ctx))
    kv = running * (response_len / 2 + prompt_len / group_size)
    step = costs.decode_step_time(s.actor, s.hw, s.rollout_tp, running, kv)
    prefill = costs.forward_time(s.actor, s.hw, s.rollout_tp,
                                 per_engine / group_size * prompt_len,
                                 prompt_len)
    return prefill + response_len * per_engine / running * step

  def train_s(t: int) -> float:
    part = dataclasses.replace(s, reserved_devices=t)
    tokens = samples * ctx
    return (part.scoring_time(tokens, ctx, t)
            + part.fsdp_train_time(tokens, samples, ctx))

  return rollout_s, train_s
