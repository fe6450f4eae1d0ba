"""The RL algorithms `config.job` names, as "module:Class" (imported when
chosen). An algorithm (see `trainers/grpo.py`) is built with
(config, sections, data source, policy) and says how groups are scored
(`scorer`), how samples become the training batch (`batch`), which
learners train (`learners`), its states, metrics and evaluation; the step
(`trainers/rl_step.py`) and the job (`trainers/rl_job.py`) are shared.
A new algorithm is a class and a line here (or `register`)."""

from __future__ import annotations

import importlib

from rlhf_jax.errors import ConfigError

ALGORITHMS = {
    "grpo": "rlhf_jax.trainers.grpo:GRPO",
    "ppo": "rlhf_jax.trainers.ppo:PPO",
}


def register(name: str, algorithm) -> None:
  """Adds `algorithm` (a class, or "module:Class") as `config.job=name`."""
  ALGORITHMS[name] = algorithm


def get(name: str):
  """The algorithm class of `config.job=name`."""
  if name not in ALGORITHMS:
    raise ConfigError(f"config.job={name!r} is not a known RL algorithm; "
                      f"known: {sorted(ALGORITHMS)}")
  found = ALGORITHMS[name]
  if isinstance(found, str):
    module, _, cls = found.partition(":")
    found = getattr(importlib.import_module(module), cls)
  return found
