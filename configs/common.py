"""Helpers shared by config files."""

import ml_collections


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses "a=1,b,c=x" into a ConfigDict; bare words are True flags.

  Every accepted key must have a default, so a typo fails loudly.
  """
  out = ml_collections.ConfigDict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.partition("=")
    if key not in defaults:
      raise ValueError(f"unknown config argument {key!r}; known: "
                       f"{sorted(defaults)}")
    default = defaults[key]
    if not value:
      out[key] = True
    elif isinstance(default, bool):
      out[key] = value.lower() in ("1", "true", "yes")
    else:
      out[key] = type(default)(value)
  return out


def model_config(preset: str = "tiny") -> ml_collections.ConfigDict:
  """Model section: a preset name plus optional field overrides."""
  return ml_collections.ConfigDict(dict(
      preset=preset,
      overrides=ml_collections.ConfigDict(),  # e.g. num_layers=4
      param_dtype="float32",
      compute_dtype="float32",
  ))


def mesh_config() -> ml_collections.ConfigDict:
  """Training mesh axes (one may be -1) and the rollout tensor size."""
  return ml_collections.ConfigDict(dict(
      num_devices=0,  # 0 = all devices; n = the first n.
      data=1, fsdp=-1, tensor=1,
      rollout_tensor=1,  # Rollout = the same devices as replicas x tensor.
      offload=True,  # Optimizer state + reference in host memory in rollout.
      layers_per_group=1,  # Layers per jitted reshard (transient memory).
      stale_samples="raise",  # Samples of older weights: "raise" | "drop".
  ))


def tiny_model_config() -> ml_collections.ConfigDict:
  """The 2-layer, 128-wide decoder the tiny CPU jobs share."""
  c = model_config("tiny")
  c.overrides = ml_collections.ConfigDict(dict(
      num_layers=2, embed_dim=128, num_heads=4, num_kv_heads=2, head_dim=32,
      mlp_dim=384))
  return c


def shrink_addition_rl(c: ml_collections.ConfigDict) -> None:
  """`runlocal` sizes of the addition RL jobs (GRPO, PPO): seconds, tests."""
  c.sft.steps = 20
  c.sft.log_every = 10
  c.train.steps = 4
  c.train.prompts_per_step = 8
  c.train.checkpoint_every = 2
  c.rollout.num_rows = 8
  c.eval.every = 2
  c.eval.batch_size = 40
  c.eval.num_rows = 40
