"""RLHFless evaluation settings shared by the testbed and 20-node configs."""

from configs.sim import common

# Response-length shapes per dataset ([U]: the paper's length figures were
# not readable). Medians reflect typical Qwen2.5 answers: GSM8K short chains
# of thought, GPQA longer reasoning, LiveCodeBench code with long tails.
DATASETS = {
    "gsm8k": dict(median_len=300.0, sigma=0.7, prompt_len=200),
    "gpqa": dict(median_len=700.0, sigma=0.8, prompt_len=400),
    "livecodebench": dict(median_len=900.0, sigma=0.9, prompt_len=600),
}


def rlhfless_config(models: list[str], hardware: str, devices: int, tp: int,
                    speedup: float, cost_cut: float, aggregate: str,
                    runlocal: bool = False, placement: str = "locality"):
  """VERL (serverful, colocated) vs RLHFless (serverless functions).

  Args:
    models: actor models; one case per (model, dataset).
    hardware: device type.
    devices: GPUs in the pool.
    tp: tensor parallelism of one decode actor.
    speedup: paper's step-time speedup.
    cost_cut: paper's GPU-second cost reduction.
    aggregate: 'max' for "up to" numbers, 'mean' for averages.
    runlocal: tiny smoke-test version.
    placement: RLHFless's actor placement (`sched.placement`): 'locality'
      (the paper's) or 'spread' (load-blind, the ablation).
  """
  c = common.base_config()
  c.setting.hardware = hardware
  c.setting.reserved_devices = devices
  c.setting.rollout_tp = tp
  c.setting.max_response = 2048
  c.setting.optimizer_steps = 4
  c.workload.update(dict(prompts_per_step=128, group_size=8,
                         dataset_prompts=384, max_len=2048, drift=0.0))
  # 3 epochs of a 384-prompt subset: step time averaged over them, as the
  # paper averages over 3 epochs; epoch 1 has no length history.
  c.steps, c.warmup = 9, 0
  # RLHFless with RLHFuse's global consolidation in place of its own length
  # grouping + local cut (the paper's prompt-assignment comparison).
  c.policies = "baseline,rlhfless,global_cut=rlhfless"
  c.policy_overrides = {
      "rlhfless": dict(placement=placement),
      "global_cut": dict(length_grouping=False, cut_tau=0.0, tail_r_t=0.2,
                         placement=placement)}
  c.cases = []
  for model in models:
    for name, shape in DATASETS.items():
      c.cases.append(dict(
          name=f"{model}/{name}",
          setting=dict(model=model, scoring_models=[model, model]),
          workload=shape))
  c.headlines = [
      common.headline(f"RLHFless speedup vs VERL ({aggregate})", "speedup",
                      "rlhfless", "baseline", speedup, aggregate),
      common.headline(f"RLHFless cost reduction vs VERL ({aggregate})",
                      "cost_reduction", "rlhfless", "baseline", cost_cut,
                      aggregate),
      common.headline("[S] extra cost saving of ranking+grouping vs "
                      "RLHFuse-style global cut (mean)", "cost_reduction",
                      "rlhfless", "global_cut", 0.128),
  ]
  if runlocal:
    c.steps = 2
    c.workload.prompts_per_step = 16
    c.cases = c.cases[:1]
  return c
