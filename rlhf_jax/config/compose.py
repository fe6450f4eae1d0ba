"""Which features of an RL job combine: one table, read by the checks and
by fusion.

A row names two features and what a job that has both gets:

  REFUSED  `check_rl_job` raises ConfigError, naming both features and why,
           before anything compiles (not implemented, or meaningless);
  UNFUSED  the first feature, fused scoring (`rollout.long_tail.fusion`,
           on by default with the long tail), steps aside: the step's
           passes run after the rollout instead of on the replicas the
           tail frees, with one log line saying why. Not an error.

Combinations no row names compose. A feature is a predicate of the job's
sections and its algorithm's kind ("grpo" or "ppo", `Algorithm.checks_as`).
Adding a layer means adding its feature and its rows here; the checks and
`trainers/policy.fused_scoring` read nothing else about compositions.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rlhf_jax.config.sections import RLJob
from rlhf_jax.rl import off_policy, registry

REFUSED = "refused"
UNFUSED = "unfused"


@dataclasses.dataclass(frozen=True)
class Feature:
  says: str                          # How messages name it.
  on: Callable[[RLJob, str], bool]   # (sections, kind) -> the job has it.


def _workers(c: RLJob) -> bool:
  return c.rollout.workers.num > 0


FEATURES: dict[str, Feature] = {
    "ppo": Feature("the PPO job", lambda c, kind: kind == "ppo"),
    "async": Feature("config.asynchronous.enabled=True",
                     lambda c, kind: c.asynchronous.enabled),
    "agent": Feature("config.agent.enabled=True",
                     lambda c, kind: c.agent.enabled),
    "workers": Feature("config.rollout.workers.num > 0",
                       lambda c, kind: _workers(c)),
    "async_workers": Feature(
        "async RL on elastic workers",
        lambda c, kind: c.asynchronous.enabled and _workers(c)),
    "workers_seed": Feature(
        "rollout.workers.seed",
        lambda c, kind: _workers(c) and c.rollout.workers.seed),
    "workers_without_seed": Feature(
        "rollout.workers without seed=True",
        lambda c, kind: _workers(c) and not c.rollout.workers.seed),
    "workers_scale_cost": Feature(
        "rollout.workers.scale='cost'",
        lambda c, kind: _workers(c) and c.rollout.workers.scale != "all"),
    "long_tail": Feature("rollout.long_tail",
                         lambda c, kind: c.rollout.long_tail.enabled),
    "long_tail_grouped": Feature(
        "config.rollout.long_tail.assignment='grouped'",
        lambda c, kind: (c.rollout.long_tail.enabled
                         and c.rollout.long_tail.assignment == "grouped")),
    "long_tail_replicas_cost": Feature(
        "config.rollout.long_tail.replicas='cost'",
        lambda c, kind: (c.rollout.long_tail.enabled
                         and c.rollout.long_tail.replicas == "cost")),
    "fusion": Feature(
        "rollout.long_tail.fusion",
        lambda c, kind: (c.rollout.long_tail.enabled
                         and c.rollout.long_tail.fusion)),
    "common_prefix": Feature("rollout.max_common_length",
                             lambda c, kind: c.rollout.max_common_length > 0),
    "quantize": Feature("rollout.quantize",
                        lambda c, kind: c.rollout.quantize != "none"),
    "lora": Feature("LoRA", lambda c, kind: c.lora.rank > 0),
    "stream": Feature("config.rl.stream", lambda c, kind: c.rl.stream),
    "dynamic_sampling": Feature("config.rl.dynamic_sampling",
                                lambda c, kind: c.rl.dynamic_sampling),
    "grouped_layout": Feature(
        "config.rl.share_prompt=True without packed rows",
        lambda c, kind: c.grouped_layout),
    "context": Feature("config.mesh.context > 1",
                       lambda c, kind: c.mesh.context > 1),
    "several_epochs": Feature("config.rl.ppo_epochs > 1",
                              lambda c, kind: c.rl.ppo_epochs != 1),
    "batch_advantage": Feature(
        "a config.rl.advantage that is not group-local (it normalises "
        "over the whole batch)",
        lambda c, kind: kind != "ppo" and not registry.has(
            "advantage", c.rl.advantage, "group_local")),
    # The rollout copy is not the training weights (cast or quantized; LoRA
    # has its own row) and, off the on-policy path, the old log-probs are
    # the trainer's forward on them.
    "routing_replay": Feature("config.rl.routing_replay=True",
                              lambda c, kind: c.rl.routing_replay),
    "cast_copy_old_logprobs": Feature(
        "old log-probs from a cast or quantized rollout copy",
        lambda c, kind: (not off_policy.on_policy(c.rl) and (
            c.model.param_dtype != c.model.compute_dtype
            or c.rollout.quantize != "none"))),
}


@dataclasses.dataclass(frozen=True)
class Row:
  first: str      # Keys of FEATURES.
  second: str
  allowed: str    # REFUSED or UNFUSED.
  why: str


TABLE: tuple[Row, ...] = (
    # Asynchronous RL: its rollout part runs beside the trainer.
    Row("async", "workers_seed", REFUSED,
        "not implemented (the trainer's devices only train)"),
    Row("async", "workers_scale_cost", REFUSED,
        "not implemented (every worker is held)"),
    Row("async", "long_tail", REFUSED, "not implemented"),
    Row("async_workers", "common_prefix", REFUSED,
        "not implemented (the workers would prefill whole prompts)"),
    Row("async", "agent", REFUSED, "not implemented"),
    Row("async", "stream", REFUSED, "not implemented"),
    # Multi-turn rollouts.
    Row("agent", "ppo", REFUSED,
        "multi-turn rollouts are implemented for the GRPO job only"),
    Row("agent", "workers", REFUSED,
        "not implemented (a sample handed to a worker would lose its "
        "environment tokens' mask)"),
    # PPO: GAE, whitening and the critic read whole batches of plain rows.
    Row("ppo", "stream", REFUSED,
        "config.rl.stream is GRPO-only (PPO's GAE and "
        "whitening need the whole batch)"),
    Row("ppo", "dynamic_sampling", REFUSED,
        "config.rl.dynamic_sampling is GRPO-only (PPO's GAE "
        "and whitening need the whole batch)"),
    Row("ppo", "grouped_layout", REFUSED,
        "share_prompt=True needs packed rows for PPO (the "
        "critic reads the repeated or packed layout, not the grouped one); "
        "set rl.pack_length > 0, or share_prompt=False"),
    # Streaming trains each group once, as it finishes.
    Row("stream", "dynamic_sampling", REFUSED,
        "not implemented (streaming trains parts as they finish; dynamic "
        "sampling refills the batch in rounds)"),
    Row("stream", "several_epochs", REFUSED,
        "streaming trains on each group once, as it finishes "
        "(set config.rl.ppo_epochs=1)"),
    Row("stream", "batch_advantage", REFUSED,
        "streaming needs group-local advantages (a part of "
        "whole groups must get the advantages the whole batch would)"),
    # Context parallelism: tested on packed rows and the repeated layout.
    Row("context", "grouped_layout", REFUSED,
        "not tested yet; set rl.pack_length > 0 (packed rows) or "
        "share_prompt=False"),
    # The long tail runs on the trainer's mesh.
    Row("long_tail_grouped", "workers", REFUSED,
        "RLHFless's grouped assignment (each replica decodes "
        "its own prompts, then leaves) runs on the trainer's mesh; set "
        "rollout.workers.num=0, or assignment='length'"),
    Row("long_tail", "workers_without_seed", REFUSED,
        "the long tail runs on the trainer's mesh, which "
        "decodes beside the workers only while it seeds (set "
        "config.rollout.workers.seed=True, or long_tail.enabled=False)"),
    Row("long_tail_replicas_cost", "workers", REFUSED,
        "'cost' picks the trainer's decode replicas per batch, "
        "and with workers the trainer's engine takes requests as they "
        "come (use 'all' or a count)"),
    # Fused scoring needs the freed replicas, whole batches and the
    # trainer's weights on the rollout side.
    Row("fusion", "workers", UNFUSED, "the rollout runs on elastic workers"),
    Row("fusion", "stream", UNFUSED, "rl.stream scores per part"),
    Row("fusion", "dynamic_sampling", UNFUSED,
        "rl.dynamic_sampling scores per round"),
    Row("fusion", "lora", UNFUSED,
        "LoRA: the reference is the policy's base, not a copy of its own"),
    # Routing replay: the experts are recorded by the paged engines and
    # the workers' (appended turns too) and carried in the repeated,
    # grouped and packed layouts, over async RL's switches and resumes,
    # the long tail's moves and workers' continuations; GRPO's and PPO's
    # actor replay them.
    Row("routing_replay", "common_prefix", REFUSED, "not implemented yet"),
    Row("fusion", "routing_replay", UNFUSED,
        "the fused passes do not replay the recorded experts"),
    Row("fusion", "cast_copy_old_logprobs", UNFUSED,
        "the rollout copy is not the training weights (cast or quantized) "
        "and the old log-probs need the trainer's"),
)


def _both_on(c: RLJob, kind: str, row: Row) -> bool:
  return FEATURES[row.first].on(c, kind) and FEATURES[row.second].on(c, kind)


def refused(c: RLJob, kind: str) -> str | None:
  """The message of the first REFUSED row the job has both features of,
  else None."""
  for row in TABLE:
    if row.allowed == REFUSED and _both_on(c, kind, row):
      first, second = FEATURES[row.first], FEATURES[row.second]
      return f"{first.says} with {second.says}: {row.why}"
  return None


def unfused_because(c: RLJob, kind: str) -> str | None:
  """Why fused scoring steps aside for this job (the first UNFUSED row it
  has both features of), else None."""
  return next((row.why for row in TABLE
               if row.allowed == UNFUSED and _both_on(c, kind, row)), None)
