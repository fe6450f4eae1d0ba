"""Jobs run by `rlhf_jax.main`, chosen by `config.job`: the RL algorithms
(`trainers/algorithms.py`: GRPO, PPO, ...) run as one RL job
(`trainers/rl_job.py`); "generate" and "rm" are jobs of their own."""

import importlib

from rlhf_jax.errors import ConfigError
from rlhf_jax.trainers import algorithms

OTHER_JOBS = ("generate", "rm")


def run(config, workdir: str):
  """Runs `config.job`."""
  if config.job in algorithms.ALGORITHMS:
    from rlhf_jax.trainers import rl_job  # pylint: disable=g-import-not-at-top
    return rl_job.run(config, workdir)
  if config.job not in OTHER_JOBS:
    raise ConfigError(f"config.job={config.job!r} is not a known job; "
                      f"known: {sorted([*algorithms.ALGORITHMS, *OTHER_JOBS])}")
  module = importlib.import_module(f"rlhf_jax.trainers.{config.job}")
  return module.run(config, workdir)
