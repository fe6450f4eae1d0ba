"""Multi-step runs: state carried across steps and policy comparisons."""

import dataclasses

from rlhf_jax.errors import ConfigError
from rlhf_jax.sched import length_history, offload
from rlhf_jax.sched.named_policies import Policy
from rlhf_jax.sim import availability
from rlhf_jax.sim.instance_pool import RemotePool
from rlhf_jax.sched.cost_model.setting import Setting
from rlhf_jax.sim.step import StepSimulator
from rlhf_jax.sim.workload import Workload


@dataclasses.dataclass
class RunState:
  """What survives from one step to the next (checkpointed in a live run)."""

  clock: float
  history: length_history.LengthHistory
  controller: offload.SeedWindowController | None
  pool: RemotePool


def run(setting: Setting, policy: Policy, workload: Workload, steps: int,
        spot_events: list | None = None,
        fault: tuple | None = None) -> list:
  """Simulates `steps` RL steps; returns the per-step StepResults.

  Args:
    setting: hardware and job.
    policy: scheduling policy.
    workload: length source (same seed -> same lengths for every policy).
    steps: number of steps.
    spot_events: availability trace of remote instances (None = none).
    fault: (step, seconds into the step, count[, readd_every_s]): that many
      held remote instances are preempted at once (RLBoost's fault-handling
      ablation) and do not come back, or, with readd_every_s, substitutes
      arrive one at a time that many seconds apart (its seeding ablation).
  """
  controller = None
  if policy.seeding:
    controller = offload.SeedWindowController(
        n_resv=setting.n_local_engines, t_init=policy.t_init, eta=policy.eta,
        floor=policy.seed_floor, use_memory=policy.seed_memory)
  state = RunState(
      clock=0.0, history=length_history.LengthHistory(policy.ewma_alpha),
      controller=controller,
      pool=RemotePool(spot_events or [], setting.remote_price_per_s))
  results = []
  for step in range(steps):
    if fault is not None and fault[0] == step:
      state.pool.preempt_at(state.clock + fault[1], *fault[2:])
    batch = workload.batch(step)
    result = StepSimulator(setting, policy, batch, state, step).run()
    results.append(result)
    state.clock = result.t_end
    by_prompt = {}
    for p, _, _, length in batch.samples:
      by_prompt.setdefault(p, []).append(length)
    for p, lengths in by_prompt.items():
      state.history.update(p, lengths)
    if controller is not None and result.observation is not None:
      controller.update(result.observation)
  return results


def balanced_instances(setting: Setting, policy: Policy, workload_spec,
                       candidates: list[int], steps: int) -> int:
  """Reserved rollout instances for a disaggregated policy (Disagg.BAL).

  A profiling run of `steps` steps (on the largest candidate pool) gives
  the tokens generated and the trainer's busy seconds per step; an
  instance's rollout work is its share of the tokens at the full-batch
  decode rate of one instance (what a throughput profile gives), and
  `offload.balanced_instance_count` picks the count.
  """
  results = run(setting, policy, Workload(workload_spec), steps,
                availability.static(max(candidates)))
  gen_tokens = sum(r.gen_tokens for r in results) / len(results)
  train_s = sum(r.observation.t_train for r in results) / len(results)
  mean_context = (workload_spec.prompt_len +
                  gen_tokens / (workload_spec.prompts_per_step *
                                workload_spec.group_size) / 2)
  hw, tp = setting.remote_hw, setting.remote_devices
  full_batch = setting.engine_slots(hw, tp, mean_context)
  tokens_per_s = setting.decode_throughput(hw, tp, mean_context)(full_batch)
  return offload.balanced_instance_count(
      candidates, lambda n: gen_tokens / (n * tokens_per_s), train_s)


def spot_trace(segment: str, max_instances: int, duration_s: float,
               seed: int, trace: str = "", sample: float = 0.5) -> list:
  """'none', 'static', a generated 'A' / 'B' / 'C' segment, 'csv:PATH'
  (time,instance,event), or 'bamboo:A' / 'B' / 'C': that segment of the
  Bamboo trace at `trace`, a `sample` of its instances
  (`availability.bamboo_segments`)."""
  if segment == "none":
    return []
  if segment == "static":
    return availability.static(max_instances)
  if segment.startswith("csv:"):
    return availability.load_csv(segment[len("csv:"):])
  if segment.startswith("bamboo:"):
    if not trace:
      raise ConfigError(f"spot segment {segment!r} needs the Bamboo trace: "
                        "config.spot.trace=PATH (traces/p3-trace.csv of "
                        "github.com/uclasystem/bamboo)")
    events = availability.load_bamboo(trace, sample, seed)
    return availability.bamboo_segments(events)[segment[len("bamboo:"):]][1]
  return availability.generate(segment, max_instances, duration_s, seed)
