r"""RLBoost headline, Qwen3-8B: 1.66x throughput, +34% cost efficiency vs veRL.

python -m rlhf_jax.sim --config=configs/sim/rlboost_qwen3_8b.py
"""

from configs.sim import common
from configs.sim import rlboost_common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False)
  return rlboost_common.rlboost_config("qwen3-8b", 8, 1.66, 0.34,
                                       runlocal=arg.runlocal)
