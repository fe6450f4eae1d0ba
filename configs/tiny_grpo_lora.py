"""The default job with a LoRA policy: adapters train, the base is frozen.

python -m rlhf_jax.main --config=configs/tiny_grpo_lora.py --workdir=workdirs/tiny_grpo_lora
python -m rlhf_jax.main --config=configs/tiny_grpo_lora.py:runlocal   # tests

tiny_grpo's SFT warm-start trains every weight; GRPO then trains rank-16
adapters on every block projection (q k v o gate up down) while the
post-SFT weights stay frozen, serve as the KL reference and take the
adapters merged for rollout (`rlhf_jax/models/lora.py`). The optimizer state
covers the adapters only (`memory/opt_state_bytes` in the metrics).
"""

from configs import tiny_grpo


def get_config(arg=None):
  c = tiny_grpo.get_config(arg)
  c.name = "tiny_grpo_lora"
  c.lora.rank = 16
  c.lora.alpha = 32.0
  c.lora.targets = ("q", "k", "v", "o", "gate", "up", "down")
  # Adapters start at zero effect and see ~12x fewer params: a higher rate.
  c.optim.learning_rate = 1e-3
  return c
