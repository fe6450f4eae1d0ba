"""Shared pieces of the simulator configs (not a config itself)."""

import ml_collections

# RLBoost OpenR1-Math workload ([U]: the paper shows the length distribution
# only as a figure). Qwen3 reasoning responses: median 3K tokens, log-normal
# sigma 0.8 (mean ~4.1K, ~2.5% hit the 14K cap), mean drifting up 0.5%/step.
OPENR1_MATH = dict(prompts_per_step=128, group_size=8, dataset_prompts=512,
                   prompt_len=250, median_len=3000.0, sigma=0.8,
                   max_len=14336, group_corr=0.5, epoch_corr=0.8,
                   drift=0.005, seed=0, trace_csv="")


def base_config() -> ml_collections.ConfigDict:
  """Every key with its default; each config file overrides what it needs."""
  c = ml_collections.ConfigDict()
  c.setting = ml_collections.ConfigDict(dict(
      model="qwen3-8b", hardware="h100", reserved_devices=8, rollout_tp=2,
      max_slots=256, remote_hardware="h100", remote_devices=2,
      remote_price="spot", scoring_models=["qwen3-8b", "qwen3-8b"],
      critic_model="", optimizer_steps=4, micro_batch_size=8, train_pp=[],
      max_response=14336))
  c.workload = ml_collections.ConfigDict(dict(OPENR1_MATH))
  c.spot = ml_collections.ConfigDict(dict(
      segment="none", max_instances=0, duration_s=4 * 3600.0, seed=0,
      trace="", sample=0.5))
  c.policies = "baseline"
  c.policy_overrides = ml_collections.ConfigDict()
  c.policy_runs = ml_collections.ConfigDict()  # alias -> own setting / pool.
  c.cases = [dict(name="default")]
  c.headlines = []
  c.steps = 20
  c.warmup = 2
  return c


def headline(name: str, metric: str, subject: str, reference: str,
             paper: float | None, aggregate: str = "mean",
             best_of: str = "", case: str = "",
             base_case: str = "") -> ml_collections.ConfigDict:
  """One compared number: metric of subject vs reference over cases.

  Args:
    name: what is compared.
    metric: throughput_ratio | speedup | cost_efficiency_gain |
      cost_reduction | train_speedup | gen_score_speedup |
      overhead_reduction (uses `case` vs `base_case`).
    subject: policy measured.
    reference: policy it is compared with.
    paper: the paper's number (None for our own claims).
    aggregate: 'mean' or 'max' ("up to") over cases.
    best_of: comma-separated policies; report subject's margin over the best.
    case: fault case (overhead_reduction).
    base_case: no-fault case (overhead_reduction).
  """
  return ml_collections.ConfigDict(dict(
      name=name, metric=metric, subject=subject, reference=reference,
      paper=paper, aggregate=aggregate, best_of=best_of, case=case,
      base_case=base_case))


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """'a=1,b=x,flag' -> ConfigDict with typed defaults (big_vision style)."""
  out = ml_collections.ConfigDict(defaults)
  for part in (arg or "").split(","):
    if not part:
      continue
    key, _, value = part.partition("=")
    kind = type(defaults.get(key, ""))
    if not value:
      out[key] = True
    elif kind is bool:
      out[key] = value.lower() in ("1", "true", "yes")
    else:
      out[key] = kind(value)
  return out
