"""Turns a sim config into runs, a table and headline numbers.

A config lists `cases` (e.g. spot segments or model pairs), the policies to
run on each (the first is the reference), and `headlines`: a metric of one
policy relative to another, averaged over cases, with the paper's number.
"""

import dataclasses
import math

from rlhf_jax.sched import named_policies as policy_lib
from rlhf_jax.sim import accounting, async_run, availability, runner
from rlhf_jax.sched.cost_model.setting import Setting
from rlhf_jax.sim.workload import Workload, WorkloadSpec


def _metric(kind: str, subject: dict, reference: dict) -> float:
  """Relative metric of subject vs reference summaries."""
  if kind == "throughput_ratio":
    return subject["tokens_per_s"] / reference["tokens_per_s"]
  if kind == "speedup":
    return reference["step_s"] / subject["step_s"]
  if kind == "train_speedup":
    return reference["train_s"] / subject["train_s"]
  if kind == "gen_score_speedup":
    return reference["gen_score_s"] / subject["gen_score_s"]
  if kind == "cost_efficiency_gain":
    return (subject["trained_tokens_per_dollar"] /
            reference["trained_tokens_per_dollar"] - 1)
  if kind == "cost_reduction":
    return 1 - subject["cost_per_step"] / reference["cost_per_step"]
  raise ValueError(f"unknown metric {kind!r}")


def _policies(config) -> list:
  """Policies of a config: 'preset' or 'alias=preset' entries, with
  overrides keyed by the (alias) name."""
  out = []
  for entry in config.policies.split(","):
    alias, _, preset = entry.partition("=")
    preset = preset or alias
    overrides = dict(config.policy_overrides.get(alias, {}))
    out.append(policy_lib.get_policy(preset, name=alias, **overrides))
  return out


def run_case(config, case) -> dict[str, dict]:
  """Runs every policy on one case; returns per-policy summaries.

  A policy listed in `config.policy_runs` may run on its own setting
  (e.g. veRL.2x: twice the reserved devices) and its own remote pool
  ('case': the case's trace; an int: that many reserved instances; or
  'balanced': the count `runner.balanced_instances` picks), billed at
  `remote_price`.
  """
  setting_kw = dict(config.setting)
  setting_kw.update(case.get("setting", {}))
  workload_kw = dict(config.workload)
  workload_kw.update(case.get("workload", {}))
  if "train_pp" in setting_kw:
    setting_kw["train_pp"] = tuple(setting_kw["train_pp"])
  if "scoring_models" in setting_kw:
    setting_kw["scoring_models"] = tuple(setting_kw["scoring_models"])
  setting = Setting(**setting_kw)
  spec = WorkloadSpec(**workload_kw)
  spot = case.get("spot", config.spot.segment)
  events = runner.spot_trace(spot, config.spot.max_instances,
                             config.spot.duration_s, config.spot.seed,
                             config.spot.trace, config.spot.sample)
  fault = tuple(case["fault"]) if case.get("fault") else None
  runs = config.get("policy_runs", {})
  out = {}
  for policy in _policies(config):
    own = dict(runs.get(policy.name, {}))
    policy_setting = dataclasses.replace(setting, **own.get("setting", {}))
    pool = own.get("remote", "case")
    policy_events = events
    if pool == "balanced":
      pool = runner.balanced_instances(
          policy_setting, policy, spec, list(range(1, own["max_remote"] + 1)),
          own["profile_steps"])
    if pool != "case":
      policy_events = availability.static(pool)
    results = runner.run(policy_setting, policy, Workload(spec), config.steps,
                         policy_events, fault)
    out[policy.name] = accounting.summarize(results, config.warmup)
    out[policy.name]["_results"] = results
    out[policy.name]["remote_reserved"] = 0 if pool == "case" else pool
  if "async_rl" in config:  # Async RL on the reserved devices, no spot.
    a = config.async_rl
    out["async"] = async_run.summarize(async_run.run(
        setting, policy_lib.get_policy(a.policy), Workload(spec),
        config.steps, eta=a.eta, rollout_devices=a.rollout_devices,
        switch_after_groups=a.switch_after_groups), setting, config.warmup)
  return out


def reproduce(config) -> tuple[list[dict], list[dict]]:
  """Runs all cases; returns (table rows, headline dicts)."""
  rows, per_case = [], []
  for case in config.cases:
    case = dict(case)
    summaries = run_case(config, case)
    per_case.append(summaries)
    for name, summary in summaries.items():
      row = {"case": case.get("name", ""), "policy": name}
      row.update({k: v for k, v in summary.items() if not k.startswith("_")})
      rows.append(row)
  headlines = []
  names = [dict(c).get("name", "") for c in config.cases]
  for h in config.headlines:
    if h.metric == "overhead_reduction":
      # 1 - (extra step time of subject) / (extra step time of reference),
      # extra = fault case minus the no-fault case (RLBoost fault ablation).
      fault, base = (per_case[names.index(h.case)],
                     per_case[names.index(h.base_case)])
      extra = lambda name: fault[name]["step_s"] - base[name]["step_s"]
      # No overhead to cut (the fault hit idle instances) reports 0.
      values = [1 - extra(h.subject) / extra(h.reference)
                if extra(h.reference) > 1e-9 else 0.0]
    elif h.best_of:
      # Margin over the best of several policies (combined vs best seed).
      values = []
      for s in per_case:
        others = [_metric(h.metric, s[o], s[h.reference])
                  for o in h.best_of.split(",")]
        values.append(_metric(h.metric, s[h.subject], s[h.reference]) -
                      max(others))
    else:
      values = [_metric(h.metric, s[h.subject], s[h.reference])
                for s in per_case]
    ours = (max(values) if h.aggregate == "max" else
            sum(values) / len(values))
    paper = h.paper
    rel = (abs(ours - paper) / abs(paper)) if paper else None
    headlines.append({
        "headline": h.name, "paper": paper, "ours": round(ours, 4),
        "rel_error": None if rel is None else round(rel, 4),
        "per_case": [round(v, 4) for v in values]})
  return rows, headlines


def format_table(rows: list[dict]) -> str:
  """Fixed-width table of the per-case, per-policy summaries."""
  cols = ["case", "policy", "step_s", "rollout_s", "tokens_per_s",
          "cost_per_step", "trained_tokens_per_dollar", "utilization",
          "n_remote", "migrations", "preemptions"]
  def fmt(v):
    if isinstance(v, float):
      return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)
  cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
  widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in
            enumerate(cols)]
  lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
  lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths)) for r in cells]
  return "\n".join(lines)


def results_of(config, case_index: int = 0) -> dict:
  """Per-policy StepResults of one case (for timelines and tests)."""
  summaries = run_case(config, dict(config.cases[case_index]))
  return {k: v["_results"] for k, v in summaries.items()}


