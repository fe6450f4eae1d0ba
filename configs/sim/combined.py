r"""Ours: the combined policy vs every seed's policy on the same traces.

RLBoost's Qwen3-14B setting (one reserved 8xH100 node + spot 2xH100
instances, segments A/B/C, OpenR1-Math-like lengths). Every policy sees the
same lengths and the same availability trace. RLHFless and RLHFuse cannot
use spot capacity: they run on the reserved node, RLHFless with every actor
and serverful billing (its serverless model does not apply to a reserved
node).

python -m rlhf_jax.sim --config=configs/sim/combined.py
"""

from configs.sim import common
from configs.sim import rlboost_common


def get_config(arg=None):
  arg = common.parse_arg(arg, model="qwen3-14b", runlocal=False)
  c = rlboost_common.rlboost_config(arg.model, 8, 0.0, 0.0,
                                    runlocal=arg.runlocal)
  c.policies = "baseline,rlhfuse,rlhfless,rlboost,combined"
  # On a reserved node idle devices are paid anyway, so RLHFless's cost
  # levers (actor count, release after a cut, serverless billing) buy
  # nothing; its cut also measured slower here (docs/sim.md). Its best
  # reserved-node form: every actor, EWMA length grouping, dedup prefill.
  c.policy_overrides = {"rlhfless": {"release_idle": False,
                                     "actor_lambda": None, "cut_tau": 0.0}}
  best = "rlhfuse,rlhfless,rlboost"
  c.headlines = [
      common.headline("combined throughput margin over best seed policy "
                      "(ratio-to-veRL points, >0 = better)",
                      "throughput_ratio", "combined", "baseline", None,
                      best_of=best),
      common.headline("combined cost-efficiency margin over best seed policy",
                      "cost_efficiency_gain", "combined", "baseline", None,
                      best_of=best),
      common.headline("combined throughput vs veRL", "throughput_ratio",
                      "combined", "baseline", None),
  ]
  return c
