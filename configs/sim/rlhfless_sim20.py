r"""RLHFless 20-node simulation: 1.23x speedup, 38.7% cost cut vs VERL (avg).

20 nodes x 8 H100 (Vidur-based in the paper), Llama2-70B, TP=8 actors.

python -m rlhf_jax.sim --config=configs/sim/rlhfless_sim20.py
python -m rlhf_jax.sim --config=configs/sim/rlhfless_sim20.py:placement=spread
"""

from configs.sim import common
from configs.sim import rlhfless_common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False, placement="locality")
  c = rlhfless_common.rlhfless_config(
      ["llama2-70b"], "h100", 160, 8, 1.23, 0.387, "mean",
      runlocal=arg.runlocal, placement=arg.placement)
  c.workload.prompts_per_step = 256  # [U] batch; 2048 responses per step.
  c.workload.dataset_prompts = 768
  return c
