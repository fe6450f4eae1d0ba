r"""RLBoost headline, Qwen3-32B: 1.51x throughput, +28% cost efficiency vs veRL.

Also Disagg.BAL's per-token cost, 45% above RLBoost's (no veRL.2x: "we do
not have additional reserved 8xH100 instances").

python -m rlhf_jax.sim --config=configs/sim/rlboost_qwen3_32b.py
python -m rlhf_jax.sim --config=configs/sim/rlboost_qwen3_32b.py:trace=PATH  # Bamboo's spot trace
"""

from configs.sim import common
from configs.sim import rlboost_common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False, trace="")
  return rlboost_common.rlboost_config("qwen3-32b", 16, 1.51, 0.28,
                                       runlocal=arg.runlocal, disagg_cost=0.45,
                                       verl_2x=False, trace=arg.trace)
