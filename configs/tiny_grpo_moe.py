"""The default job with a mixture-of-experts policy, experts split 2 ways.

XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m rlhf_jax.main --config=configs/tiny_grpo_moe.py --workdir=workdirs/tiny_grpo_moe
XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m rlhf_jax.main --config=configs/tiny_grpo_moe.py:runlocal

tiny_grpo's job (SFT warm-start, then GRPO on 2-digit addition) with the
tiny decoder's MLP replaced by 8 experts of 96 hidden units, each token
through its top 2 (`models/moe.py`), Qwen3-MoE style (QK-norm). The
experts are split over 2 devices (`mesh.expert`) in training and in each
rollout replica (`mesh.rollout_expert`), with each layer's load-balancing
loss in the warm-start and in RL; `train/expert_tokens_{min,mean,max}` log
the experts' loads. 500 RL steps, tiny_grpo's 300 and more: its held-out
accuracy was still rising at 300 (docs/results.md).
On CPU the devices are fake ones (XLA_FLAGS above); the expert axis
needs at least 2.
"""

from configs import common
from configs import tiny_grpo


def get_config(arg=None):
  runlocal = common.parse_arg(arg, runlocal=False).runlocal
  c = tiny_grpo.get_config(arg)
  c.name = "tiny_grpo_moe"
  c.model = common.model_config(
      "tiny-moe", num_layers=2, embed_dim=128, num_heads=4, num_kv_heads=2,
      head_dim=32, num_experts=8, experts_per_token=2, expert_mlp_dim=96,
      scan_layers=False)
  c.mesh.expert = 2
  c.mesh.rollout_expert = 2
  # Load balancing per layer (`moe.balance_loss`): 0.01 in the warm-start,
  # where the routing forms, and transformers' default 0.001 in RL. With
  # none in the warm-start an expert of the first layer received no token
  # in most RL steps; with transformers' all-layers form at 0.01 in the
  # warm-start, in 153 of 500 (seed 0; docs/results.md).
  c.sft.moe_balance_coef = 0.01
  c.rl.moe_balance_coef = 0.001
  if not runlocal:
    c.train.steps = 500
  return c
