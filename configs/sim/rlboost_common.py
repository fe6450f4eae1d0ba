"""RLBoost evaluation setting shared by the Qwen3-8B/14B/32B configs."""

from configs.sim import common


def rlboost_config(model: str, reserved_devices: int, throughput: float,
                   cost_gain: float, runlocal: bool = False):
  """Reserved 8xH100 node(s) + spot 2xH100 instances, segments A, B, C.

  Args:
    model: Qwen3 model profile.
    reserved_devices: 8 (one node) or 16 (two nodes, 32B).
    throughput: paper's throughput ratio vs veRL (avg over segments).
    cost_gain: paper's cost-efficiency gain vs veRL (avg over segments).
    runlocal: tiny smoke-test version.
  """
  c = common.base_config()
  c.setting.model = model
  c.setting.reserved_devices = reserved_devices
  c.setting.scoring_models = [model, model]  # reference + old log-probs.
  c.spot.max_instances = 8  # [U] pool size at full availability.
  c.policies = "baseline,rlboost"
  c.cases = [dict(name=f"segment_{s}", spot=s) for s in "ABC"]
  c.headlines = [
      common.headline(f"RLBoost {model} throughput vs veRL (avg A,B,C)",
                      "throughput_ratio", "rlboost", "baseline", throughput),
      common.headline(f"RLBoost {model} cost efficiency gain vs veRL",
                      "cost_efficiency_gain", "rlboost", "baseline",
                      cost_gain),
  ]
  if runlocal:
    c.steps, c.warmup = 3, 0
    c.workload.prompts_per_step = 16
    c.cases = c.cases[:1]
  return c
