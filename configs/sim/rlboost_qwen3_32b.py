r"""RLBoost headline, Qwen3-32B: 1.51x throughput, +28% cost efficiency vs veRL.

python -m rlhf_jax.sim --config=configs/sim/rlboost_qwen3_32b.py
"""

from configs.sim import common
from configs.sim import rlboost_common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False)
  return rlboost_common.rlboost_config("qwen3-32b", 16, 1.51, 0.28,
                                       runlocal=arg.runlocal)
