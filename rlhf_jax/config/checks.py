"""Checks that span config sections, run once before anything compiles.

Each section validates its own keys (`sections.py`); this module checks how
they combine for a GRPO or PPO job: batch splits over the mesh, rollout
sizes against the data, and which rollout layers compose with which.
"""

from __future__ import annotations

import jax

from rlhf_jax.config.sections import ConfigError, RLJob

GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline")
# Advantages a group's own rewards determine: a streamed part (whole groups)
# gets the advantages the whole batch would give it.
GROUP_LOCAL_ADVANTAGES = ("grpo", "drgrpo", "rloo")


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
  _check_async(c, job, num_devices)
  if c.asynchronous.enabled and not c.rollout.workers.num:
    # The trainer has the devices the rollout does not.
    num_devices = _devices(c, num_devices) - async_rollout_devices(
        c, num_devices)
  _check_batch(c, prompt_len, num_devices)
  if job == "grpo":
    _check_grpo_splits(c)
  _check_rollout_layers(c, num_devices)
  _check_agent(c, job)


def _check_agent(c: RLJob, job: str) -> None:
  """Multi-turn rollouts: GRPO, the trainer's mesh."""
  if not c.agent.enabled:
    return
  if job != "grpo":
    raise ConfigError("config.agent.enabled=True: multi-turn rollouts are "
                      "implemented for the GRPO job only")
  if c.rollout.workers.num:
    raise ConfigError("config.agent.enabled=True with config.rollout.workers"
                      ".num > 0 is not implemented (a sample handed to a "
                      "worker would lose its environment tokens' mask)")


def async_rollout_devices(c: RLJob, num_devices: int | None = None) -> int:
  """Devices of async RL's rollout part (`asynchronous.rollout_devices`,
  0: half the mesh; -1, the cost model's, is resolved by `grpo.build`)."""
  return c.asynchronous.rollout_devices or _devices(c, num_devices) // 2


def _check_async(c: RLJob, job: str, num_devices) -> None:
  """Async GRPO: its rollout part (unless elastic workers decode), and the
  layers it does not compose with yet (each named)."""
  if not c.asynchronous.enabled:
    return
  key = "config.asynchronous.enabled=True"
  unsupported = [
      (job != "grpo", "the PPO job"),
      (c.rollout.workers.num > 0 and c.rollout.workers.seed,
       "rollout.workers.seed (the trainer's devices only train)"),
      (c.rollout.workers.num > 0 and c.rollout.workers.scale != "all",
       "rollout.workers.scale='cost' (every worker is held)"),
      (c.rollout.long_tail.enabled, "rollout.long_tail"),
      (c.rollout.max_common_length > 0, "rollout.max_common_length"),
      (c.rollout.quantize != "none", "rollout.quantize"),
      (c.lora.rank > 0, "LoRA"), (c.agent.enabled, "agent"),
      (c.rl.stream, "rl.stream"), (c.rl.dynamic_sampling,
                                   "rl.dynamic_sampling")]
  for bad, what in unsupported:
    if bad:
      raise ConfigError(f"{key} with {what} is not implemented")
  if c.rollout.workers.num:  # The workers decode; the trainer keeps all.
    return
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
  if rl.advantage in GROUP_ESTIMATORS and G < 2:
    raise ConfigError(f"config.rl.advantage={rl.advantage!r} is a group "
                      f"estimator and needs rollout.samples_per_row >= 2, "
                      f"got {G}")
  if rl.dynamic_sampling and G < 2:
    raise ConfigError("config.rl.dynamic_sampling drops groups whose "
                      "rewards are all equal and needs "
                      f"rollout.samples_per_row >= 2, got {G}")


def _check_grpo_splits(c: RLJob) -> None:
  """Whole groups per mini-batch, micro-batch and streamed part."""
  rl, G = c.rl, c.rollout.samples_per_row
  prompts = c.train.prompts_per_step
  if rl.share_prompt and G > 1 and not rl.pack_length and (
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
  if rl.share_prompt and not rl.pack_length:
    raise ConfigError("config.rl.share_prompt=True needs packed rows for "
                      "PPO (rl.pack_length > 0: the critic reads the "
                      "repeated or packed layout, not the grouped one); "
                      "set one, or share_prompt=False")
  for key in ("stream", "dynamic_sampling"):
    if getattr(rl, key):
      raise ConfigError(f"config.rl.{key} is GRPO-only: PPO's GAE and "
                        "whitening need the whole batch")
  if rl.rewards:
    raise ConfigError("config.rl.rewards: PPO trains on its reward model's "
                      "score; use config.rl.tracked_rewards to log others")


def _check_packing(c: RLJob, prompt_len: int) -> None:
  """Packed rows (rl/packing.py) hold any sequence; the loss needs to tell
  sequences apart, which GSPO's row ratio does not."""
  rl, ro = c.rl, c.rollout
  need = prompt_len + ro.max_new_tokens
  if rl.pack_length < need:
    raise ConfigError(
        f"config.rl.pack_length={rl.pack_length} is shorter than one "
        f"sequence: prompt {prompt_len} + rollout.max_new_tokens "
        f"{ro.max_new_tokens} = {need}")
  if rl.policy_loss == "gspo":
    raise ConfigError("config.rl.pack_length: policy_loss='gspo' takes the "
                      "sequence ratio of a row; set rl.pack_length=0")


def _check_stream(c: RLJob) -> None:
  """Streaming needs each group used once, groups that are independent,
  and equal parts the updates and the learner can split."""
  rl = c.rl
  if rl.ppo_epochs != 1:
    raise ConfigError(
        "config.rl.stream trains on each group once, as it finishes: set "
        f"config.rl.ppo_epochs=1 (got {rl.ppo_epochs})")
  if rl.stream_parts % rl.num_minibatches:
    raise ConfigError(
        f"config.rl.stream_parts={rl.stream_parts} must be a multiple of "
        f"config.rl.num_minibatches={rl.num_minibatches} (whole parts per "
        "update)")
  if rl.advantage not in GROUP_LOCAL_ADVANTAGES:
    raise ConfigError(
        f"config.rl.stream needs group-local advantages "
        f"{GROUP_LOCAL_ADVANTAGES}; config.rl.advantage={rl.advantage!r} "
        "normalises over the whole batch")
  if rl.dynamic_sampling:
    raise ConfigError("config.rl.stream and config.rl.dynamic_sampling do "
                      "not combine")
  n, parts = c.train.prompts_per_step, rl.stream_parts
  G = c.rollout.samples_per_row
  rows = n // parts * (1 if rl.share_prompt and G > 1 else G)
  if n % parts or (rows % rl.micro_batches and not rl.pack_length):
    raise ConfigError(
        f"config.rl.stream_parts={parts} must divide "
        f"config.train.prompts_per_step={n} into parts whose {rows} rows "
        f"split into config.rl.micro_batches={rl.micro_batches}")


def _check_rollout_layers(c: RLJob, num_devices) -> None:
  """Which rollout layers compose, and how."""
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
  if lt.enabled and lt.assignment == "grouped" and w.num:
    raise ConfigError(
        "config.rollout.long_tail.assignment='grouped' (RLHFless: each "
        "replica decodes its own prompts, then leaves) runs on the "
        "trainer's mesh: set rollout.workers.num=0, or assignment='length'")
  if not w.num:
    return
  if w.kind == "local" and w.num * w.devices_per_worker > jax.device_count():
    raise ConfigError(
        f"config.rollout.workers: {w.num} local workers x "
        f"{w.devices_per_worker} devices > {jax.device_count()} devices")
  if lt.enabled and not w.seed:
    raise ConfigError(
        "config.rollout.long_tail runs on the trainer's mesh, which decodes "
        "beside the workers only while it seeds: set "
        "config.rollout.workers.seed=True (or long_tail.enabled=False)")
  if lt.enabled and lt.replicas == "cost":
    raise ConfigError(
        "config.rollout.long_tail.replicas='cost' picks the trainer's "
        "decode replicas per batch; with workers the trainer's engine "
        "takes requests as they come: use 'all' or a count")
