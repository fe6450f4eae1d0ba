"""Roofline costs of the pieces of an RL step, from hardware and model profiles.

Each cost is max(compute time, memory time) at the profile's efficiency, plus
link time where data moves. Times are seconds.
"""

import functools

from rlhf_jax.sched.cost_model.hardware import Hardware
from rlhf_jax.sched.cost_model.profiles import ModelProfile

# Per-layer collective latency of a tensor-parallel all-reduce (two per layer).
_TP_ALLREDUCE_LATENCY_S = 8e-6
# Adam state traffic per parameter in the optimizer step (fp32 master, m, v,
# grad read + master, m, v write).
_OPTIMIZER_BYTES_PER_PARAM = 28


def decode_step_time(model: ModelProfile, hw: Hardware, tp: int, batch: int,
                     kv_tokens: float) -> float:
  """Time of one decode step of `batch` sequences reading `kv_tokens` of KV.

  Args:
    model: the generating model.
    hw: device type.
    tp: tensor-parallel degree of the engine.
    batch: running sequences.
    kv_tokens: KV-cache tokens read this step (sum of contexts, or less when a
      group's shared prompt is read once).

  Returns:
    Seconds for the step.
  """
  return decode_step_fn(model, hw, tp)(batch, kv_tokens)


@functools.lru_cache(maxsize=None)
def decode_step_fn(model: ModelProfile, hw: Hardware, tp: int):
  """`decode_step_time` of one engine shape as a function of (batch,
  kv_tokens): what depends only on the shape is read once (the simulator
  calls it per decode event); the arithmetic is the same, op for op."""
  weight_bytes, kv_bytes = model.weight_bytes, model.kv_bytes_per_token
  mem_rate = hw.hbm_bw * hw.decode_mem_eff
  n_params = model.n_params
  attn = 4 * model.n_layers * model.n_heads * model.head_dim  # An exact int.
  flop_rate = hw.peak_flops * hw.prefill_mfu
  overhead = hw.step_overhead_s
  comm_rate = hw.intra_bw * hw.link_eff
  n_layers, d_model = model.n_layers, model.d_model

  def step_time(batch: int, kv_tokens: float) -> float:
    if batch <= 0:
      return 0.0
    mem_bytes = (weight_bytes + kv_bytes * kv_tokens) / tp
    t_mem = mem_bytes / mem_rate
    flops = batch * 2 * n_params + attn * kv_tokens
    t_compute = flops / tp / flop_rate
    t_comm = 0.0
    if tp > 1:
      allreduce_bytes = 2 * (tp - 1) / tp * batch * d_model * 2
      t_comm = 2 * n_layers * (
          _TP_ALLREDUCE_LATENCY_S + allreduce_bytes / comm_rate)
    return max(t_mem, t_compute) + t_comm + overhead
  return step_time


def forward_time(model: ModelProfile, hw: Hardware, devices: int,
                 tokens: float, mean_context: float) -> float:
  """Compute-bound forward over `tokens` tokens (prefill or scoring)."""
  if tokens <= 0:
    return 0.0
  flops = tokens * model.fwd_flops_per_token(mean_context / 2)
  t_compute = flops / (devices * hw.peak_flops * hw.prefill_mfu)
  t_weights = model.weight_bytes / devices / (hw.hbm_bw * hw.decode_mem_eff)
  return max(t_compute, t_weights)


def train_time(model: ModelProfile, hw: Hardware, devices: int, tokens: float,
               mean_context: float, micro_batches: int,
               optimizer_steps: int) -> float:
  """FSDP fwd+bwd over `tokens`, with exposed cross-node gather/scatter.

  Args:
    model: the trained model.
    hw: device type.
    devices: data-parallel devices (FSDP shards).
    tokens: trained tokens (prompt + response, times PPO epochs).
    mean_context: mean sequence length, for the attention FLOPs.
    micro_batches: micro-batches per device over the step; each one
      all-gathers the weights twice and reduce-scatters the gradients once.
    optimizer_steps: optimizer updates in the step.

  Returns:
    Seconds for the training phase.
  """
  if tokens <= 0:
    return 0.0
  flops = 3 * tokens * model.fwd_flops_per_token(mean_context / 2)
  t_compute = flops / (devices * hw.peak_flops * hw.train_mfu)
  nodes = max(1, -(-devices // hw.devices_per_node))
  t_exposed_comm = 0.0
  if nodes > 1:
    # Inside a node FSDP traffic overlaps with compute; across nodes each
    # micro-batch moves 3 x W x (n-1)/n through the node's RDMA NICs. Only
    # the part that exceeds compute is exposed.
    node_bw = hw.rdma_bw * hw.devices_per_node * hw.link_eff
    per_micro = 3 * model.weight_bytes * (nodes - 1) / nodes / node_bw
    t_exposed_comm = max(0.0, micro_batches * per_micro - t_compute)
  return t_compute + t_exposed_comm + optimizer_time(model, hw, devices,
                                                     optimizer_steps)


def optimizer_time(model: ModelProfile, hw: Hardware, devices: int,
                   steps: int) -> float:
  """Adam updates: memory-bound over the device's shard of the state."""
  return steps * (model.n_params * _OPTIMIZER_BYTES_PER_PARAM / devices /
                  (hw.hbm_bw * hw.decode_mem_eff))


def reshard_time(model: ModelProfile, hw: Hardware, devices: int) -> float:
  """Training -> rollout layout switch: all-gather weights over NVLink/ICI."""
  per_device = model.weight_bytes * (devices - 1) / max(devices, 1)
  return per_device / (hw.intra_bw * hw.link_eff) if devices > 1 else 0.0


def weight_sync_time(model: ModelProfile, hw: Hardware, tp: int,
                     node: int) -> float:
  """New weights from the learner's node (node 0) to a rollout actor of tp
  devices on `node`: each device takes its 1/tp over the node's links; on
  another node, after the node's one copy over its backend RDMA (a
  pipelined broadcast: one copy's time, however many nodes receive)."""
  local = model.weight_bytes / tp / (hw.intra_bw * hw.link_eff)
  if node == 0:
    return local
  node_bw = hw.rdma_bw * hw.devices_per_node * hw.link_eff
  return model.weight_bytes / node_bw + local


def weight_pull_time(model: ModelProfile, sender_bw: float,
                     receiver_bw: float, link_eff: float) -> float:
  """Weights to one remote instance over the slower of the two NIC shares."""
  return model.weight_bytes / (min(sender_bw, receiver_bw) * link_eff)


def kv_migration_time(model: ModelProfile, hw: Hardware,
                      tokens: float) -> float:
  """KV cache of `tokens` tokens moved over RDMA (RLHFuse consolidation)."""
  return tokens * model.kv_bytes_per_token / (hw.rdma_bw * hw.link_eff)
