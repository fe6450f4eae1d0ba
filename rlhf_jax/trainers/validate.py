"""Config checks that run before anything compiles: one clear error each."""

from __future__ import annotations

import jax

from rlhf_jax.rl import registry

GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline")


class ConfigError(ValueError):
  """A config value that cannot work, named by its key."""


def _positive(config, *keys):
  for key in keys:
    section, name = key.rsplit(".", 1)
    value = config
    for part in section.split("."):
      value = value[part]
    value = value[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ConfigError(f"config.{key} must be a positive int, got {value!r}")


def _known(category, name, key):
  try:
    registry.get(category, name)
  except ValueError as e:
    raise ConfigError(f"config.{key}: {e}") from None


def validate_rl(config, *, prompt_len: int, num_devices: int | None = None):
  """Checks the GRPO-family config; raises ConfigError naming the key."""
  rl = config.rl
  _known("advantage", rl.advantage, "rl.advantage")
  for name in rl.rewards:
    _known("reward", name, "rl.rewards")
  if len(rl.reward_weights) not in (0, len(rl.rewards)):
    raise ConfigError(f"config.rl.reward_weights has {len(rl.reward_weights)} "
                      f"entries for {len(rl.rewards)} rewards")
  if rl.on_reward_error not in ("raise", "zero"):
    raise ConfigError("config.rl.on_reward_error must be 'raise' or 'zero', "
                      f"got {rl.on_reward_error!r}")
  G = config.rollout.samples_per_row
  if rl.dynamic_sampling and G < 2:
    raise ConfigError("config.rl.dynamic_sampling drops groups whose "
                      "rewards are all equal and needs "
                      f"rollout.samples_per_row >= 2, got {G}")
  _positive(config, "rl.dynamic_max_rounds")
  if not 0 <= rl.overlong_buffer <= config.rollout.max_new_tokens:
    raise ConfigError(f"config.rl.overlong_buffer={rl.overlong_buffer} must "
                      "be in [0, rollout.max_new_tokens="
                      f"{config.rollout.max_new_tokens}]")
  if rl.advantage in GROUP_ESTIMATORS and G < 2:
    raise ConfigError(f"config.rl.advantage={rl.advantage!r} is a group "
                      f"estimator and needs rollout.samples_per_row >= 2, "
                      f"got {G}")
  validate_rollout_and_batch(config, prompt_len=prompt_len,
                             num_devices=num_devices)
  if not isinstance(rl.share_prompt, bool):
    raise ConfigError(f"config.rl.share_prompt must be a bool, got "
                      f"{rl.share_prompt!r}")
  prompts = config.train.prompts_per_step
  if rl.share_prompt and G > 1 and (
      prompts % rl.num_minibatches or
      prompts // rl.num_minibatches % rl.micro_batches):
    # The grouped layout splits batches by whole groups (rl/grouped.py).
    raise ConfigError(
        f"config.rl.share_prompt: train.prompts_per_step={prompts} does not "
        f"split into rl.num_minibatches={rl.num_minibatches} x "
        f"rl.micro_batches={rl.micro_batches} whole groups; change them or "
        f"set rl.share_prompt=False")


def validate_ppo(config, *, prompt_len: int, num_devices: int | None = None):
  """Checks the PPO config (actor, critic, reward model); names the key."""
  rl = config.rl
  for name in rl.tracked_rewards:
    _known("reward", name, "rl.tracked_rewards")
  for key in ("gamma", "lam"):
    if not 0.0 <= rl[key] <= 1.0:
      raise ConfigError(f"config.rl.{key} must be in [0, 1], got {rl[key]}")
  if rl.value_clip < 0:
    raise ConfigError(f"config.rl.value_clip must be >= 0 (0 = off), got "
                      f"{rl.value_clip}")
  if config.critic.init != "reward_model":
    raise ConfigError(f"config.critic.init={config.critic.init!r}; supported: "
                      "'reward_model'")
  validate_rollout_and_batch(config, prompt_len=prompt_len,
                             num_devices=num_devices)


def validate_rollout_and_batch(config, *, prompt_len: int,
                               num_devices: int | None = None):
  """Checks shared by the RL jobs: rollout sizes, losses, batch splits."""
  _positive(config, "train.steps", "train.prompts_per_step",
            "rollout.samples_per_row", "rollout.num_rows",
            "rollout.max_new_tokens", "rl.ppo_epochs", "rl.num_minibatches",
            "rl.micro_batches")
  rl, ro = config.rl, config.rollout
  _known("policy_loss", rl.policy_loss, "rl.policy_loss")
  _known("kl_estimator", rl.kl_estimator, "rl.kl_estimator")
  _known("aggregation", rl.aggregation, "rl.aggregation")
  G = ro.samples_per_row
  if not isinstance(rl.kl_coef, float) or rl.kl_coef < 0:
    raise ConfigError(f"config.rl.kl_coef must be a float >= 0, got "
                      f"{rl.kl_coef!r}")
  if max(ro.prefill_buckets) < prompt_len:
    raise ConfigError(f"config.rollout.prefill_buckets={tuple(ro.prefill_buckets)}"
                      f": the task's prompts need {prompt_len} tokens")
  cache = max(ro.prefill_buckets) + ro.max_new_tokens
  if cache > ro.max_seq_len:
    raise ConfigError(
        f"config.rollout.prefill_buckets max {max(ro.prefill_buckets)} + "
        f"max_new_tokens {ro.max_new_tokens} = {cache} exceeds the KV cache "
        f"length config.rollout.max_seq_len={ro.max_seq_len}")
  m = config.mesh
  n = num_devices or m.num_devices or jax.device_count()
  shards = n // max(m.tensor, 1) if m.data == -1 or m.fsdp == -1 else (
      m.data * m.fsdp)
  B = config.train.prompts_per_step * G
  per_update = B // rl.num_minibatches
  if B % rl.num_minibatches:
    raise ConfigError(f"batch {B} (train.prompts_per_step x samples_per_row) "
                      f"is not divisible by rl.num_minibatches="
                      f"{rl.num_minibatches}")
  if per_update % (rl.micro_batches * shards):
    raise ConfigError(
        f"mini-batch of {per_update} sequences does not split into "
        f"rl.micro_batches={rl.micro_batches} x {shards} data shards of the "
        f"mesh ({n} devices, config.mesh)")
  replicas = n // max(config.mesh.rollout_tensor, 1)
  if ro.num_rows % replicas:
    raise ConfigError(f"config.rollout.num_rows={ro.num_rows} must be "
                      f"divisible by the rollout replicas={replicas} "
                      f"({n} devices / rollout_tensor)")
