r"""RLBoost Fig. 11 (Qwen3-14B): one always-available spot instance gives
+37% throughput and -22% cost per token vs veRL.

A static trace removes the spot-trace assumptions ([U] segments) from the
comparison: one 2xH100 spot instance is present for the whole run.

python -m rlhf_jax.sim --config=configs/sim/rlboost_static_spot.py
"""

from configs.sim import common
from configs.sim import rlboost_common


def get_config(arg=None):
  arg = common.parse_arg(arg, instances=1, runlocal=False)
  c = rlboost_common.rlboost_config("qwen3-14b", 8, 0.0, 0.0,
                                    runlocal=arg.runlocal)
  c.spot.max_instances = arg.instances
  c.cases = [dict(name=f"static_{arg.instances}", spot="static")]
  c.headlines = [
      common.headline("RLBoost 14B, 1 static spot instance: throughput vs "
                      "veRL", "throughput_ratio", "rlboost", "baseline", 1.37),
      common.headline("RLBoost 14B, 1 static spot instance: per-token cost "
                      "reduction vs veRL", "cost_reduction", "rlboost",
                      "baseline", 0.22),
  ]
  return c
