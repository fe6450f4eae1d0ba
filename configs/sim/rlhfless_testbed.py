r"""RLHFless physical testbed: up to 1.35x speedup, 44.8% cost cut vs VERL.

2x g6e.48xlarge (16x L40S), Qwen2.5-3B/7B, GRPO on GSM8K/GPQA/LiveCodeBench,
max prompt 1024, max response 2048.

python -m rlhf_jax.sim --config=configs/sim/rlhfless_testbed.py
python -m rlhf_jax.sim --config=configs/sim/rlhfless_testbed.py:placement=spread
"""

from configs.sim import common
from configs.sim import rlhfless_common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False, placement="locality")
  return rlhfless_common.rlhfless_config(
      ["qwen2.5-3b", "qwen2.5-7b"], "l40s", 16, 1, 1.35, 0.448, "max",
      runlocal=arg.runlocal, placement=arg.placement)
