r"""RLBoost headline, Qwen3-8B: 1.66x throughput, +34% cost efficiency vs veRL.

Also section 6.2's other baselines: Disagg.BAL's per-token cost is 62%
above RLBoost's, and RLBoost's throughput is "up to 24%" above veRL.2x's
(over 8B and 14B; ours peaks at 8B, so the headline lives here).

python -m rlhf_jax.sim --config=configs/sim/rlboost_qwen3_8b.py
python -m rlhf_jax.sim --config=configs/sim/rlboost_qwen3_8b.py:trace=PATH  # Bamboo's spot trace
"""

from configs.sim import common
from configs.sim import rlboost_common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False, trace="")
  return rlboost_common.rlboost_config("qwen3-8b", 8, 1.66, 0.34,
                                       runlocal=arg.runlocal, disagg_cost=0.62,
                                       verl_2x=True, verl_2x_gain=1.24,
                                       trace=arg.trace)
