"""Jobs run by `rlhf_jax.main`, one file each, chosen by `config.job`."""

import importlib

from rlhf_jax.errors import ConfigError

JOBS = ("generate", "grpo", "ppo", "rm")


def run(config, workdir: str):
  """Runs `config.job` (a module of this package exposing `run`)."""
  if config.job not in JOBS:
    raise ConfigError(f"config.job={config.job!r} is not a known job; "
                      f"known: {list(JOBS)}")
  module = importlib.import_module(f"rlhf_jax.trainers.{config.job}")
  return module.run(config, workdir)
