r"""RLBoost headline, Qwen3-14B: 1.97x throughput, +49% cost efficiency vs veRL.

Also Disagg.BAL's per-token cost, 75% above RLBoost's, and veRL.2x (run,
no headline: the paper's "up to 24%" is pinned in the 8B config).

python -m rlhf_jax.sim --config=configs/sim/rlboost_qwen3_14b.py
python -m rlhf_jax.sim --config=configs/sim/rlboost_qwen3_14b.py:trace=PATH  # Bamboo's spot trace
"""

from configs.sim import common
from configs.sim import rlboost_common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False, trace="")
  return rlboost_common.rlboost_config("qwen3-14b", 8, 1.97, 0.49,
                                       runlocal=arg.runlocal, disagg_cost=0.75,
                                       verl_2x=True, trace=arg.trace)
