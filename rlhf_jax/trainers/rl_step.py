"""One RL step, for every algorithm and variant.

  to_rollout -> for each scored group as it finishes: the train stage
  takes it -> to_train -> prepare -> train -> metrics

The job (`trainers/rl_job.py`) chose every variant when it was built:
the rollout (`rollout/step_rollouts.py`: colocated, DAPO's refill or
asynchronous: what the step samples and how the weights reach it), the
train stage (`rl/train_stage.py`: the whole batch, or streamed parts while
the rest decodes), the algorithm (`trainers/grpo.py`, `trainers/ppo.py`:
how a group is scored and the batch prepared, which learners train) and the
passes fused into the rollout's tail (`scoring/fused.py`). Every phase
is a span on the job's timeline; perf/ metrics come from those spans.
"""

from __future__ import annotations

import contextlib

import numpy as np

from rlhf_jax.metrics import rl_step_metrics
from rlhf_jax.scoring import fused as fused_scoring


def rl_step(job, step: int, states: dict) -> tuple[dict, dict]:
  """Step `step` from the learners' `states` (and the parked reference,
  "ref"); returns the new states and the step's host metrics."""
  clock, rollout, algo = job.clock, job.rollout, job.algorithm
  clock.begin_step(step)
  weights = rollout.to_rollout(states, step)  # The policy reaches it.
  train = job.train_stage(
      lambda samples: rollout.trainable(samples, weights.version), step=step)
  fused = None
  with contextlib.ExitStack() as scope:

    def leave_rollout():  # Once: the trainer's devices are back.
      if not train.started:
        train.start(rollout.to_train(weights), scope.enter_context(
            fused_scoring.reference(job.colocation, states.get("ref"),
                                    fused)))

    with fused_scoring.during(
        job.fused, rollout.sampler, policy=weights.params,
        ref=states.get("ref"), **algo.fused_weights(weights)) as fused:
      for group in rollout.groups(step, algo.scorer, trainer_busy=train.busy,
                                  freed=fused):
        train.add(group)  # A streamed stage trains once the devices are back.
        if rollout.trainer_free:
          leave_rollout()
    leave_rollout()
    states, info, trained = train.finish(fused)
  return states, rl_step_metrics(
      info, trained, clock.end_step(step), rollout.end_step(),
      train.counts(), algo.metrics(info, states), version=weights.version,
      stale=int(np.sum(~info["keep"])), step=step,
      alarm_kl=job.c.rl.mismatch_alarm_kl)
