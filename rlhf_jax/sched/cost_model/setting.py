"""The cluster, job and cost setting one simulation runs in."""

import dataclasses
import functools
import math

from rlhf_jax.sched.cost_model import costs
from rlhf_jax.sched.cost_model.hardware import Hardware, get_hardware
from rlhf_jax.sched.cost_model.profiles import ModelProfile, get_model

# Pinned host-to-device copy per GPU (PCIe Gen4 x16 measured ~25 GB/s; Gen5
# is faster, so this is conservative).
HOST_TO_DEVICE_BW = 25e9


@dataclasses.dataclass(frozen=True)
class Setting:
  """Hardware and job shape, shared by every policy compared on it.

  Attributes:
    model: actor (generating) model profile name (or a `ModelProfile`).
    hardware: reserved / training device type (or a `Hardware`).
    reserved_devices: devices of the reserved (training) cluster.
    rollout_tp: tensor-parallel size of one rollout engine.
    max_slots: engine cap on concurrent sequences (vLLM/SGLang max_num_seqs).
    remote_hardware: device type of elastic / preemptible instances.
    remote_devices: devices per remote instance.
    remote_price: 'spot' or 'ondemand'.
    scoring_models: models run forward once per sample after generation
      (reference, old log-probs, reward, critic).
    critic_model: trained critic (PPO) or '' (GRPO).
    optimizer_steps: optimizer updates (mini-batches) per RL step.
    micro_batch_size: sequences per training micro-batch per device group.
    train_pp: (actor_pp, critic_pp, tp) pipeline layout; () = FSDP.
    max_response: response cap (KV sizing of engine slots).
  """

  model: str | ModelProfile
  hardware: str | Hardware
  reserved_devices: int
  rollout_tp: int = 1
  max_slots: int = 256
  remote_hardware: str = "h100"
  remote_devices: int = 2
  remote_price: str = "spot"
  scoring_models: tuple[str, ...] = ()
  critic_model: str = ""
  optimizer_steps: int = 1
  micro_batch_size: int = 8
  train_pp: tuple[int, ...] = ()
  max_response: int = 4096

  @functools.cached_property
  def actor(self) -> ModelProfile:
    return get_model(self.model)

  @functools.cached_property
  def hw(self) -> Hardware:
    return get_hardware(self.hardware)

  @functools.cached_property
  def remote_hw(self) -> Hardware:
    return get_hardware(self.remote_hardware)

  @property
  def n_local_engines(self) -> int:
    return self.reserved_devices // self.rollout_tp

  @property
  def reserved_price_per_s(self) -> float:
    return self.reserved_devices * self.hw.ondemand_per_h / 3600

  @property
  def remote_price_per_s(self) -> float:
    hw = self.remote_hw
    per_h = hw.spot_per_h if self.remote_price == "spot" else hw.ondemand_per_h
    return self.remote_devices * per_h / 3600

  def engine_slots(self, hw: Hardware, tp: int, mean_context: float) -> int:
    """Concurrent sequences one engine holds: KV memory, capped by max_slots."""
    free = tp * hw.hbm_bytes * 0.9 - self.actor.weight_bytes
    per_seq = self.actor.kv_bytes_per_token * max(mean_context, 1.0)
    return max(1, min(self.max_slots, int(free / per_seq)))

  def decode_throughput(self, hw: Hardware, tp: int, mean_context: float):
    """Tokens/s of one engine as a function of batch (for the plateau B)."""
    def throughput(batch: int) -> float:
      return batch / costs.decode_step_time(self.actor, hw, tp, batch,
                                            batch * mean_context)
    return throughput

  def scoring_time(self, n_tokens: float, mean_context: float,
                   devices: int, hw: Hardware | None = None) -> float:
    """Forward passes of every scoring model over `n_tokens`."""
    return sum(costs.forward_time(get_model(m), hw or self.hw, devices,
                                  n_tokens, mean_context)
               for m in self.scoring_models)

  def host_load_time(self, devices: int) -> float:
    """Frozen scoring weights from pinned host memory to `devices` GPUs."""
    weights = sum(get_model(m).weight_bytes for m in self.scoring_models[1:])
    return weights / (devices * HOST_TO_DEVICE_BW)

  def fsdp_train_time(self, n_tokens: float, n_sequences: int,
                      mean_context: float,
                      optimizer_steps: int | None = None) -> float:
    """Actor (and critic) FSDP training over the whole reserved cluster."""
    if optimizer_steps is None:
      optimizer_steps = self.optimizer_steps
    micro = math.ceil(n_sequences / (self.micro_batch_size *
                                     self.reserved_devices))
    total = costs.train_time(self.actor, self.hw, self.reserved_devices,
                             n_tokens, mean_context, micro, optimizer_steps)
    if self.critic_model:
      total += costs.train_time(get_model(self.critic_model), self.hw,
                                self.reserved_devices, n_tokens, mean_context,
                                micro, optimizer_steps)
    return total
