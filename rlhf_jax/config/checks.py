"""Checks that span config sections, run once before anything compiles.

Each section validates its own keys (`sections.py`); this module checks how
they combine for a GRPO or PPO job: which features compose (the table in
`compose.py`), batch splits over the mesh and rollout sizes against the
data.
"""

from __future__ import annotations

import jax

from rlhf_jax.config import compose
from rlhf_jax.config.sections import ConfigError, RLJob
from rlhf_jax.rl import registry


def check_rl_job(c: RLJob, *, job: str, prompt_len: int,
                 num_devices: int | None = None) -> None:
  """Raises ConfigError (naming the keys) if the sections do not combine.

  Args:
    c: the job's sections.
    job: "grpo" or "ppo".
    prompt_len: the data's padded prompt length P.
    num_devices: devices of the mesh (default: `c.mesh.num_devices` or all).
  """
  if job not in ("grpo", "ppo"):
    raise ConfigError(f"unknown RL job {job!r}")
  (_check_grpo if job == "grpo" else _check_ppo)(c)
  refused = compose.refused(c, job)
  if refused:
    raise ConfigError(refused)
  _check_async(c, num_devices)
  if c.asynchronous.enabled and not c.rollout.workers.num:
    # The trainer has the devices the rollout does not.
    num_devices = _devices(c, num_devices) - async_rollout_devices(
        c, num_devices)
  _check_batch(c, prompt_len, num_devices)
  if job == "grpo":
    _check_grpo_splits(c)
  _check_rollout_devices(c, num_devices)


def async_rollout_devices(c: RLJob, num_devices: int | None = None) -> int:
  """Devices of async RL's rollout part (`asynchronous.rollout_devices`,
  0: half the mesh; -1, the cost model's, is resolved by `grpo.build`)."""
  return c.asynchronous.rollout_devices or _devices(c, num_devices) // 2


def _check_async(c: RLJob, num_devices) -> None:
  """Async GRPO's rollout part (unless elastic workers decode)."""
  if not c.asynchronous.enabled or c.rollout.workers.num:
    return  # With workers decoding, the trainer keeps every device.
  key = "config.asynchronous.enabled=True"
  n, r = _devices(c, num_devices), async_rollout_devices(c, num_devices)
  if r < 0:  # `grpo.build` resolves it before checking.
    raise ConfigError(f"{key}: config.asynchronous.rollout_devices=-1 (the "
                      "cost model's split) is chosen when the job builds")
  if not 0 < r < n:
    raise ConfigError(f"{key}: the rollout takes {r} of {n} devices; it "
                      "needs at least one and must leave one to train on "
                      "(config.asynchronous.rollout_devices)")
  if r % c.mesh.rollout_tensor:
    raise ConfigError(f"{key}: config.mesh.rollout_tensor="
                      f"{c.mesh.rollout_tensor} does not divide the "
                      f"rollout's {r} devices")


def _devices(c: RLJob, num_devices: int | None) -> int:
  return num_devices or c.mesh.num_devices or jax.device_count()


def _check_batch(c: RLJob, prompt_len: int, num_devices) -> None:
  rl, ro, m = c.rl, c.rollout, c.mesh
  if max(ro.prefill_buckets) < prompt_len:
    raise ConfigError(f"config.rollout.prefill_buckets={ro.prefill_buckets}: "
                      f"the data's prompts need {prompt_len} tokens")
  n = _devices(c, num_devices)
  shards = n // max(m.tensor, 1) if -1 in (m.data, m.fsdp) else m.data * m.fsdp
  G = ro.samples_per_row
  B = c.train.prompts_per_step * G
  if rl.pack_length:
    _check_packing(c, prompt_len)
  elif B % rl.num_minibatches:
    raise ConfigError(f"batch {B} (train.prompts_per_step x samples_per_row) "
                      "is not divisible by config.rl.num_minibatches="
                      f"{rl.num_minibatches}")
  elif B // rl.num_minibatches % (rl.micro_batches * shards):
    raise ConfigError(
        f"mini-batch of {B // rl.num_minibatches} sequences does not split "
        f"into config.rl.micro_batches={rl.micro_batches} x {shards} data "
        f"shards of the mesh ({n} devices, config.mesh)")
  replicas = n // m.rollout_tensor
  if ro.num_rows % replicas:
    raise ConfigError(f"config.rollout.num_rows={ro.num_rows} must be "
                      f"divisible by the rollout replicas={replicas} "
                      f"({n} devices / rollout_tensor)")
  if rl.overlong_buffer > ro.max_new_tokens:
    raise ConfigError(f"config.rl.overlong_buffer={rl.overlong_buffer} must "
                      f"be in [0, rollout.max_new_tokens={ro.max_new_tokens}]")


def _check_grpo(c: RLJob) -> None:
  rl, G = c.rl, c.rollout.samples_per_row
  if rl.advantage == "gae":
    raise ConfigError("config.rl.advantage='gae' needs a critic: use the "
                      "PPO job (config.job='ppo')")
  if not rl.rewards:
    raise ConfigError("config.rl.rewards is empty: name at least one "
                      "registered reward function")
  if registry.has("advantage", rl.advantage, "group") and G < 2:
    raise ConfigError(f"config.rl.advantage={rl.advantage!r} is a group "
                      f"estimator and needs rollout.samples_per_row >= 2, "
                      f"got {G}")
  if rl.dynamic_sampling and G < 2:
    raise ConfigError("config.rl.dynamic_sampling drops groups whose "
                      "rewards are all equal and needs "
                      f"rollout.samples_per_row >= 2, got {G}")


def _check_grpo_splits(c: RLJob) -> None:
  """Whole groups per mini-batch, micro-batch and streamed part."""
  rl, prompts = c.rl, c.train.prompts_per_step
  if c.grouped_layout and (
      prompts % rl.num_minibatches or
      prompts // rl.num_minibatches % rl.micro_batches):
    # The grouped layout splits batches by whole groups (rl/grouped.py).
    raise ConfigError(
        f"config.rl.share_prompt: train.prompts_per_step={prompts} does not "
        f"split into rl.num_minibatches={rl.num_minibatches} x "
        f"rl.micro_batches={rl.micro_batches} whole groups; change them or "
        f"set rl.share_prompt=False")
  if rl.stream:
    _check_stream(c)


def _check_ppo(c: RLJob) -> None:
  rl = c.rl
  if rl.advantage != "gae":
    raise ConfigError(f"config.rl.advantage={rl.advantage!r}: the PPO job "
                      "trains a critic and uses 'gae'")
  if c.critic is None:
    raise ConfigError("the PPO job needs a config.critic section")
  if rl.rewards:
    raise ConfigError("config.rl.rewards: PPO trains on its reward model's "
                      "score; use config.rl.tracked_rewards to log others")
  if c.eval.num_samples:
    raise ConfigError(f"config.eval.num_samples={c.eval.num_samples}: "
                      "pass@k and maj@k score GRPO jobs (a verifiable "
                      "accuracy reward); PPO evaluates greedy")


def _check_packing(c: RLJob, prompt_len: int) -> None:
  """Packed rows (rl/packing.py) hold whole sequences."""
  rl, ro = c.rl, c.rollout
  need = prompt_len + ro.max_new_tokens
  if rl.pack_length < need:
    raise ConfigError(
        f"config.rl.pack_length={rl.pack_length} is shorter than one "
        f"sequence: prompt {prompt_len} + rollout.max_new_tokens "
        f"{ro.max_new_tokens} = {need}")


def _check_stream(c: RLJob) -> None:
  """Streaming needs equal parts the updates and the learner can split."""
  rl = c.rl
  if rl.stream_parts % rl.num_minibatches:
    raise ConfigError(
        f"config.rl.stream_parts={rl.stream_parts} must be a multiple of "
        f"config.rl.num_minibatches={rl.num_minibatches} (whole parts per "
        "update)")
  n, parts = c.train.prompts_per_step, rl.stream_parts
  G = c.rollout.samples_per_row
  rows = n // parts * (1 if c.shared_prompt_group else G)
  if n % parts or (rows % rl.micro_batches and not rl.pack_length):
    raise ConfigError(
        f"config.rl.stream_parts={parts} must divide "
        f"config.train.prompts_per_step={n} into parts whose {rows} rows "
        f"split into config.rl.micro_batches={rl.micro_batches}")


def _check_rollout_devices(c: RLJob, num_devices) -> None:
  """The long tail's replicas, the local workers' devices."""
  ro = c.rollout
  w, lt = ro.workers, ro.long_tail
  n = _devices(c, num_devices)
  replicas = n // c.mesh.rollout_tensor
  if lt.enabled and isinstance(lt.replicas, int) and (
      lt.replicas > replicas or replicas % lt.replicas
      or lt.replicas & (lt.replicas - 1)):
    raise ConfigError(f"config.rollout.long_tail.replicas={lt.replicas} must "
                      f"be a power-of-two divisor of the {replicas} rollout "
                      "replicas")
  if not w.num:
    return
  if w.kind == "local" and w.num * w.devices_per_worker > jax.device_count():
    raise ConfigError(
        f"config.rollout.workers: {w.num} local workers x "
        f"{w.devices_per_worker} devices > {jax.device_count()} devices")
