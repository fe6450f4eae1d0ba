r"""RLBoost seeding ablation (Qwen3-14B, section 6.4.1, Fig. 12): with 5 of
6 spot instances preempted and substitutes arriving gradually, running
without response seeding lowers the average throughput by 19%, and without
the scheduler memory by a further 6%.

"We construct a scenario where 5 out of 6 2xH100 rollout instances are
initially preempted, with substitute instances gradually becoming available
after a period of time." Without seeding "RLBoost has to blindly offload all
rollout requests to remote instances" (the training cluster only trains:
T_seed fixed at 0); without memory, Algorithm 1 re-converges T_seed from
where it is when the instance count changes.

Six static instances run `warmup` steps (Algorithm 1 settles and remembers
T_seed for 6), then the burst hits at the start of the next step and a
substitute arrives every `readd_s` seconds; the averages cover the steps
from the burst on, past the last arrival. Fig. 12's time axis is an image,
so `readd_s` is the median wait from a preemption to the next arrival in
the trace of the paper's other runs (Bamboo's p3 trace, half its
instances: `availability.replacement_waits`, 540 s; 570 s and 540 s with
sample seeds 1 and 2).

python -m rlhf_jax.sim --config=configs/sim/rlboost_seeding_ablation.py
"""

from configs.sim import common
from configs.sim import rlboost_common


def get_config(arg=None):
  arg = common.parse_arg(arg, readd_s=540.0, runlocal=False)
  c = rlboost_common.rlboost_config("qwen3-14b", 8, 0.0, 0.0)
  c.spot.max_instances = 6
  c.warmup = 6
  c.steps = c.warmup + 10
  c.policies = "full=rlboost,no_memory=rlboost,no_seeding=rlboost"
  c.policy_overrides = {
      "no_memory": {"seed_memory": False},
      # T_seed stays 0: the training cluster's engines hand every request to
      # the remote instances at once (eta = inf: no adaptation).
      "no_seeding": {"t_init": 0.0, "seed_floor": 0.0, "eta": float("inf"),
                     "seed_memory": False},
  }
  c.cases = [dict(name="preempt_5_of_6", spot="static",
                  fault=[c.warmup, 0.0, 5, arg.readd_s])]
  c.headlines = [
      common.headline("RLBoost 14B, 5 of 6 preempted then replaced: "
                      "throughput without seeding vs full", "throughput_ratio",
                      "no_seeding", "full", 0.81),
      common.headline("RLBoost 14B, same: throughput without scheduler "
                      "memory vs full", "throughput_ratio", "no_memory",
                      "full", 1 / 1.06),
  ]
  if arg.runlocal:
    c.workload.prompts_per_step = 16
    c.warmup, c.steps = 1, 3
    c.cases = [dict(name="preempt_5_of_6", spot="static",
                    fault=[1, 0.0, 5, 30.0])]
  return c
