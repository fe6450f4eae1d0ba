"""RLBoost evaluation setting shared by the Qwen3-8B/14B/32B configs."""

from configs.sim import common


def rlboost_config(model: str, reserved_devices: int, throughput: float,
                   cost_gain: float, runlocal: bool = False,
                   disagg_cost: float | None = None, verl_2x: bool = False,
                   verl_2x_gain: float | None = None, trace: str = ""):
  """Reserved 8xH100 node(s) + spot 2xH100 instances, segments A, B, C.

  The section 6.2 baselines besides veRL: Disagg.BAL runs the rollout on
  reserved 2xH100 instances, as many as its resource optimizer balances
  against the training cluster (`offload.balanced_instance_count` over
  1-16 [U], from a 3-step profile), billed at the on-demand price per GPU
  of the 8xH100 node ([U]: the paper's Table 2 is an image; it averages
  prices across providers);
  veRL.2x is veRL on twice the reserved nodes (8B and 14B only).

  Args:
    model: Qwen3 model profile.
    reserved_devices: 8 (one node) or 16 (two nodes, 32B).
    throughput: paper's throughput ratio vs veRL (avg over segments).
    cost_gain: paper's cost-efficiency gain vs veRL (avg over segments).
    runlocal: tiny smoke-test version.
    disagg_cost: paper's per-token cost of Disagg.BAL above RLBoost's
      (None: Disagg.BAL not run).
    verl_2x: also run veRL.2x.
    verl_2x_gain: paper's throughput ratio vs veRL.2x ("up to"; None: no
      headline).
    trace: Bamboo's spot trace (github.com/uclasystem/bamboo,
      traces/p3-trace.csv; not in this repository): segments A, B, C cut
      from it by `availability.bamboo_segments` (half its instances, as the
      paper samples) instead of generated ones.
  """
  c = common.base_config()
  c.setting.model = model
  c.setting.reserved_devices = reserved_devices
  c.setting.scoring_models = [model, model]  # reference + old log-probs.
  # Pool at full availability: the most instances alive at once in the
  # paper's trace as it samples it (half of Bamboo's p3 instances;
  # `availability._SEGMENTS`).
  c.spot.max_instances = 19
  c.policies = "baseline,rlboost"
  c.spot.trace = trace
  c.cases = [dict(name=f"segment_{s}", spot=f"bamboo:{s}" if trace else s)
             for s in "ABC"]
  c.headlines = [
      common.headline(f"RLBoost {model} throughput vs veRL (avg A,B,C)",
                      "throughput_ratio", "rlboost", "baseline", throughput),
      common.headline(f"RLBoost {model} cost efficiency gain vs veRL",
                      "cost_efficiency_gain", "rlboost", "baseline",
                      cost_gain),
  ]
  if verl_2x:
    c.policies += ",verl_2x=baseline"
    c.policy_runs["verl_2x"] = dict(
        setting=dict(reserved_devices=2 * reserved_devices))
  if verl_2x_gain is not None:
    c.headlines.append(common.headline(
        f"RLBoost {model} throughput vs veRL.2x, up to (A,B,C)",
        "throughput_ratio", "rlboost", "verl_2x", verl_2x_gain,
        aggregate="max"))
  if disagg_cost is not None:
    c.policies += ",disagg_bal"
    c.policy_runs["disagg_bal"] = dict(
        setting=dict(remote_price="ondemand"), remote="balanced",
        max_remote=16, profile_steps=3)
    c.headlines.append(common.headline(
        f"Disagg.BAL {model} per-token cost above RLBoost's (avg A,B,C)",
        "cost_efficiency_gain", "rlboost", "disagg_bal", disagg_cost))
  if runlocal:
    c.steps, c.warmup = 3, 0
    c.workload.prompts_per_step = 16
    c.cases = c.cases[:1]
  return c
