"""The policy model from its config section (`config.sections.Model`, read
by attribute: models know no job config): a preset or an HF checkpoint."""

from __future__ import annotations

import os

from rlhf_jax.errors import ConfigError
from rlhf_jax.models import hf
from rlhf_jax.models import hf_config
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig


def config_of(m, *, vocab_size: int) -> ModelConfig:
  """The `ModelConfig` `build` gives, without building the weights."""
  if not m.path:
    return m.model_config(vocab_size=vocab_size)
  hf_cfg = hf_config.read_json(os.path.join(m.path, "config.json"))
  return hf_config.from_hf(hf_cfg, dtype=m.param_dtype,
                           compute_dtype=m.compute_dtype)


def build(m, *, seed: int, layout, vocab_size: int):
  """(cfg, graphdef, params) on `layout`.

  With `m.path` (a local HF directory) the weights are loaded with the
  section's dtypes; otherwise the preset + overrides are randomly
  initialised from `seed` with `vocab_size` (the tokenizer's).
  """
  if not m.path:
    cfg = config_of(m, vocab_size=vocab_size)
    return (cfg, *model_lib.init_params(cfg, seed, layout))
  cfg, graphdef, params = hf.load(m.path, layout=layout, dtype=m.param_dtype,
                                  compute_dtype=m.compute_dtype,
                                  scan_layers=m.scan_layers, remat=m.remat,
                                  attention=m.attention)
  if cfg.vocab_size < vocab_size:
    raise ConfigError(f"the model in config.model.path={m.path!r} has "
                      f"vocab_size={cfg.vocab_size}, smaller than its "
                      f"tokenizer's {vocab_size} ids")
  return cfg, graphdef, params
