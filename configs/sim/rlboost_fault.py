r"""RLBoost fault-handling ablation (Qwen3-14B): with 3 of 6 spot instances
preempted at once, token-level migration cuts the step-time overhead of full
recompute by 33% (preemption 100 s into the step) and 76% (200 s).

Six static 2xH100 spot instances; the burst hits step 3 and the three
instances do not come back. Overhead = mean step time minus the no-fault
run's, per policy.

python -m rlhf_jax.sim --config=configs/sim/rlboost_fault.py
"""

from configs.sim import common
from configs.sim import rlboost_common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False)
  c = rlboost_common.rlboost_config("qwen3-14b", 8, 0.0, 0.0)
  c.spot.max_instances = 6
  c.steps, c.warmup = 5, 3
  c.policies = "token=rlboost,recompute=rlboost"
  c.policy_overrides = {"recompute": {"preemption_recovery": "recompute"}}
  c.cases = [dict(name="no_fault", spot="static"),
             dict(name="fault_100s", spot="static", fault=[3, 100.0, 3]),
             dict(name="fault_150s", spot="static", fault=[3, 150.0, 3]),
             dict(name="fault_200s", spot="static", fault=[3, 200.0, 3])]
  c.headlines = [
      common.headline("token-level migration vs recompute: overhead cut, "
                      "preempted at 100 s", "overhead_reduction", "token",
                      "recompute", 0.33, case="fault_100s",
                      base_case="no_fault"),
      common.headline("token-level migration vs recompute: overhead cut, "
                      "preempted at 150 s (ours only)", "overhead_reduction",
                      "token", "recompute", None, case="fault_150s",
                      base_case="no_fault"),
      common.headline("token-level migration vs recompute: overhead cut, "
                      "preempted at 200 s", "overhead_reduction", "token",
                      "recompute", 0.76, case="fault_200s",
                      base_case="no_fault"),
  ]
  if arg.runlocal:
    c.workload.prompts_per_step = 16
    c.steps, c.warmup = 2, 1
    c.cases = [dict(name="no_fault", spot="static"),
               dict(name="fault_100s", spot="static", fault=[1, 30.0, 3]),
               dict(name="fault_150s", spot="static", fault=[1, 45.0, 3]),
               dict(name="fault_200s", spot="static", fault=[1, 60.0, 3])]
  return c
