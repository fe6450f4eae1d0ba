"""Helpers shared by config files.

Sections are built from the typed defaults in `rlhf_jax/config/sections.py`
(`config_dict(Section, **overrides)`), so every key has a default and a
mistyped override fails on the locked config.
"""

import dataclasses

import ml_collections

from rlhf_jax import typed_config
from rlhf_jax.config import sections


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


def model_config(preset: str = "tiny", **overrides) -> ml_collections.ConfigDict:
  """Model section: a preset name plus optional `ModelConfig` overrides
  (keys of the section itself, e.g. scan_layers, set the section)."""
  own = {f.name for f in dataclasses.fields(sections.Model)}
  section = {k: overrides.pop(k) for k in list(overrides) if k in own}
  return typed_config.config_dict(sections.Model, preset=preset, **section,
                              overrides=ml_collections.ConfigDict(overrides))


def mesh_config(**kw) -> ml_collections.ConfigDict:
  """Training mesh axes (one may be -1) and the rollout tensor size."""
  return typed_config.config_dict(sections.Mesh, **kw)


def tiny_model_config() -> ml_collections.ConfigDict:
  """The 2-layer, 128-wide decoder the tiny CPU jobs share. Two layers run
  faster unrolled than scanned (the scan pays off in compile time and
  memory from a few layers on; the presets scan)."""
  return model_config("tiny", num_layers=2, embed_dim=128, num_heads=4,
                      num_kv_heads=2, head_dim=32, mlp_dim=384,
                      scan_layers=False)


def optim_config(**kw) -> ml_collections.ConfigDict:
  """AdamW + clipping + warmup/cosine (`rl/learner.OptimConfig`)."""
  return typed_config.config_dict(sections.OptimConfig, **kw)


def rl_sections(c: ml_collections.ConfigDict, *, rollout: dict, rl: dict,
                optim: dict, train: dict, eval: dict,  # noqa: A002
                sft: dict) -> None:
  """Sets the typed sections every RL job (GRPO, PPO) has."""
  c.logging = typed_config.config_dict(sections.Logging)
  c.rollout = typed_config.config_dict(sections.Rollout, **rollout)
  c.rl = typed_config.config_dict(sections.RL, **rl)
  c.optim = optim_config(**optim)
  c.train = typed_config.config_dict(sections.Train, **train)
  c.eval = typed_config.config_dict(sections.Eval, **eval)
  c.sft = typed_config.config_dict(sections.SFT, **sft)
  c.lora = typed_config.config_dict(sections.Lora)  # rank 0: full fine-tuning.


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
  # Greedy only: a sampled eval engine is one more compile in every test
  # that runs the job (tests/trainers/test_evaluation.py turns it on).
  c.eval.num_samples = 0
