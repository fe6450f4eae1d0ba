"""Pipeline-parallel actor + critic training time (RLHFuse settings).

Per-micro-batch stage times come from the roofline model; the schedule is
either serial 1F1B (actor, then critic: RLHFuse-Base) or the fused
bidirectional schedule found by rlhf_jax.sched.pipeline_search. The search
runs on the integer-rounded problem and its makespan ratio to serial is
applied to the serial time.
"""

import functools
import math

from rlhf_jax.sched import pipeline, pipeline_search
from rlhf_jax.sched.cost_model import costs
from rlhf_jax.sched.cost_model.profiles import get_model


@functools.lru_cache(maxsize=64)
def _fused_ratio(problem: pipeline.FusedProblem) -> float:
  result = pipeline_search.search(problem, iterations=20)
  return result.makespan / pipeline.serial_1f1b_makespan(problem)


def pipeline_train_time(setting, n_sequences: int, tokens: float, ctx: float,
                        fused: bool) -> float:
  """Training time of actor + critic with pipeline parallelism.

  Args:
    setting: with train_pp = (actor_pp, critic_pp, tp) and a critic model.
    n_sequences: sequences in the step's global batch.
    tokens: trained tokens.
    ctx: mean sequence length.
    fused: use the fused actor/critic schedule.

  Returns:
    Seconds.
  """
  actor_pp, critic_pp, tp = setting.train_pp
  actor, critic = setting.actor, get_model(setting.critic_model)
  hw = setting.hw
  # The model with the deeper pipeline is "model 0" of the fused problem;
  # its data-parallel degree sets the micro-batches per pipeline, and each of
  # the pp0/pp1 copies of the other model takes an equal share of them.
  (big, pp0), (small, pp1) = sorted(
      [(actor, actor_pp), (critic, critic_pp)], key=lambda x: -x[1])
  dp = setting.reserved_devices // (pp0 * tp)
  per_mini = n_sequences / setting.optimizer_steps
  m0 = max(1, math.ceil(per_mini / dp / setting.micro_batch_size))
  m1 = max(1, m0 * pp1 // pp0)
  mb_tokens = tokens / n_sequences * setting.micro_batch_size
  def stage_fwd(model, pp):
    flops = mb_tokens * model.fwd_flops_per_token(ctx / 2) / pp
    return flops / (tp * hw.peak_flops * hw.train_mfu)
  f0, f1 = stage_fwd(big, pp0), stage_fwd(small, pp1)
  serial = (m0 + pp0 - 1) * 3 * f0 + (m1 + pp1 - 1) * 3 * f1
  if fused:
    scale = min(f0, f1) / 2  # integer problem with ~2-unit resolution.
    problem = pipeline.FusedProblem(
        pp0, pp1, m0, m1, max(1, round(f0 / scale)),
        max(1, round(f1 / scale)), 1.0, 1.0)
    serial *= _fused_ratio(problem)
  opt = (costs.optimizer_time(actor, hw, setting.reserved_devices, 1) +
         costs.optimizer_time(critic, hw, setting.reserved_devices, 1))
  return setting.optimizer_steps * (serial + opt)
