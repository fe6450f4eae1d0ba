"""Async GRPO on the default task: the rollout decodes on half the devices
while the trainer trains on the other half, samples at most one version
old (eta = 1), TIS on the sampler's log-probs.

XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m rlhf_jax.main --config=configs/tiny_grpo_async.py --workdir=workdirs/tiny_grpo_async
python -m rlhf_jax.main --config=configs/tiny_grpo_async.py:runlocal   # tests

On one CPU the flag splits it into two devices (they share its cores). The
synchronous job it compares with: configs/tiny_grpo.py (docs/async.md).
"""

from configs import tiny_grpo
from rlhf_jax.config import sections


def get_config(arg=None):
  c = tiny_grpo.get_config(arg)
  c.name = "tiny_grpo_async"
  c.rollout.engine = "paged"  # Samples move to new weights with their pages.
  c.asynchronous = sections.config_dict(sections.Async, enabled=True,
                                        max_staleness=1)
  c.rl.importance_weight = "tis"
  return c
