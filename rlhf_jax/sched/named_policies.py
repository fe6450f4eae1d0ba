"""Named policies: which mechanisms are on, with their knobs.

A policy only decides; the simulator (and later the live engine) executes.
Knob defaults come from the papers' code where public and are marked [U]
where we chose (see docs/sim.md).
"""

import dataclasses

from rlhf_jax.errors import ConfigError
from rlhf_jax.sched.placement import PLACEMENTS


@dataclasses.dataclass(frozen=True)
class Policy:
  """Mechanism switches and knobs of one scheduling policy.

  Attributes:
    name: display name.
    dispatch: 'static' (assign every group to an actor up front) or 'jsq'
      (central queue, join-the-shortest-queue with at most `theta` pending).
    theta: RLBoost pending cap per instance ([U], default 4).
    length_grouping: RLHFless EWMA ranking + length-grouped assignment (with
      'static') or longest-predicted-first order (with 'jsq').
    ewma_alpha: weight of the newest length observation ([U]).
    dedup_prefill: prefill each prompt once per instance (prefix sharing).
    prefix_shared_decode: read a group's prompt KV once per decode step.
    tail_r_t: RLHFuse consolidation trigger (unfinished fraction), 0 = off.
    tail_slack: survivors keep the decode step within (1 + slack) of its
      batch-1 time ([U]; "tail decoding does not slow down").
    tail_inference_overlap: freed instances start scoring finished samples.
    cut_tau: RLHFless local cut threshold (completion fraction), 0 = off.
    actor_lambda: RLHFless latency weight for the actor count, None = off.
    release_idle: serverless resource model: reserved devices are billed
      per second only while a function (actor or learner) holds them, and an
      actor is released when it has no work left; otherwise every reserved
      device is billed for the whole step.
    seeding: RLBoost time-bounded local rollout + remote continuation.
    t_init, eta, seed_floor, seed_memory: Algorithm 1 knobs.
    use_remote: use elastic / preemptible rollout instances.
    remote_cap: apply Algorithm 1's N_prem cap on remote instances.
    continuous_lb: RLBoost CONTINUOUSLB polling.
    lb_period_s: polling period ([U], default 1 s).
    plateau_fraction: throughput fraction defining the batching plateau B.
    migration: how samples the scheduler moves resume: 'kv' (cache moved
      over RDMA) or 'reprefill' (prompt + partial re-prefilled, RLBoost).
    preemption_recovery: samples of a preempted instance keep their tokens
      ('tokens', RLBoost's token-level migration) or restart from the prompt
      ('recompute', the fault-handling ablation baseline).
    pull_weights: remote instances pull weights and may join mid-step
      (False = synchronous push at step start only).
    streaming_train: trainer consumes finished groups in micro-batches.
    micro_batch_min: RLBoost m_b, responses per streamed micro-batch ([U]).
    sample_level_scoring: score (reference / old log-probs) each finished
      sample at once instead of per complete group (RLHFuse sample-level
      fusion applied to the streaming trainer).
    remote_scoring: idle remote instances score finished samples once the
      queue is empty (RLHFuse inter-stage fusion on the elastic pool).
    remote_scoring_chunk: samples per remote scoring task.
    fused_training: RLHFuse intra-stage actor/critic pipeline fusion.
    placement: how the static-dispatch rollout actors get the new weights:
      'colocated' (on the training devices, every one ready after the
      reshard all-gather), or serverless actors placed on nodes by
      `sched.placement` ('locality': RLHFless, the most loaded on the
      learner's node; 'spread': load-blind), each ready after
      `costs.weight_sync_time` from its node.
  """

  name: str
  dispatch: str = "static"
  theta: int = 4
  length_grouping: bool = False
  ewma_alpha: float = 0.5
  dedup_prefill: bool = False
  prefix_shared_decode: bool = False
  tail_r_t: float = 0.0
  tail_slack: float = 0.1
  tail_inference_overlap: bool = False
  cut_tau: float = 0.0
  actor_lambda: float | None = None
  release_idle: bool = False
  seeding: bool = False
  t_init: float = 150.0
  eta: float = 3.0
  seed_floor: float = 5.0
  seed_memory: bool = True
  use_remote: bool = False
  remote_cap: bool = True
  continuous_lb: bool = False
  lb_period_s: float = 1.0
  plateau_fraction: float = 0.8
  migration: str = "reprefill"
  preemption_recovery: str = "tokens"
  pull_weights: bool = True
  streaming_train: bool = False
  micro_batch_min: int = 64
  sample_level_scoring: bool = False
  remote_scoring: bool = False
  remote_scoring_chunk: int = 16
  fused_training: bool = False
  placement: str = "colocated"

  def __post_init__(self):
    for field, allowed in (("dispatch", ("static", "jsq")),
                           ("migration", ("kv", "reprefill")),
                           ("preemption_recovery", ("tokens", "recompute")),
                           ("placement", PLACEMENTS)):
      if getattr(self, field) not in allowed:
        raise ConfigError(f"policy {self.name!r}: {field} must be one of "
                          f"{allowed}, got {getattr(self, field)!r}")
    if self.placement != "colocated" and self.dispatch != "static":
      raise ConfigError(f"policy {self.name!r}: placement "
                        f"{self.placement!r} places static-dispatch actors; "
                        "dispatch is 'jsq'")


def baseline() -> Policy:
  """verl-like synchronous colocated: generate, then score, then train."""
  return Policy(name="baseline")


def rlhfuse() -> Policy:
  """RLHFuse: tail consolidation at R_t = 0.2 with KV migration + overlap."""
  return Policy(name="rlhfuse", tail_r_t=0.2, tail_inference_overlap=True,
                migration="kv", fused_training=True)


def rlhfless(lam: float = 0.5) -> Policy:
  """RLHFless: dedup prefill, EWMA grouping, cut at tau, lambda scaling,
  locality-aware placement.

  tau = 0.8 and lambda = 0.5 are [U]. Migration moves the KV cache: the
  paper names KV transfer as a constraint on the actor count, which implies
  caches move rather than being recomputed.
  """
  return Policy(name="rlhfless", length_grouping=True, dedup_prefill=True,
                cut_tau=0.8, actor_lambda=lam, release_idle=True,
                migration="kv", placement="locality")


def rlboost() -> Policy:
  """RLBoost: seeding, JSQ-Theta, CONTINUOUSLB, token migration, pull."""
  return Policy(name="rlboost", dispatch="jsq", seeding=True, use_remote=True,
                continuous_lb=True, migration="reprefill", pull_weights=True,
                streaming_train=True)


def combined() -> Policy:
  """Ours: RLBoost's elastic core + RLHFuse's fusions + RLHFless's prefill.

  Adds to RLBoost: RLHFuse's sample-level fusion in the streaming trainer
  (each finished sample is scored at once; only fwd/bwd waits for its
  group), RLHFuse's inter-stage fusion moved onto the elastic pool (remote
  instances with nothing left to decode score finished samples instead of
  idling until the step ends), RLHFless's deduplicated prefill (a prompt is
  prefilled once per instance, also when migrated samples re-prefill) and
  prefix-shared decode (a group's prompt KV is read once per step).

  RLHFless's EWMA length ranking is available (length_grouping=True selects
  longest-predicted-first dispatch to the least predicted-loaded instance)
  but off: on the RLBoost traces it measured slower and costlier
  (docs/sim.md).
  """
  return dataclasses.replace(
      rlboost(), name="combined", dedup_prefill=True,
      prefix_shared_decode=True, sample_level_scoring=True,
      remote_scoring=True)


def disagg_bal() -> Policy:
  """RLBoost's Disagg.BAL baseline (section 6.2, after StreamRL): reserved
  rollout instances do all of the rollout, the training cluster only trains,
  on micro-batches as responses stream in. Our reading of "lacks efficient
  request migration and pull-based weight transfer": failed requests
  restart, weights are pushed at the step's start. The instance count is
  `offload.balanced_instance_count`'s, not the policy's.
  """
  return dataclasses.replace(
      rlboost(), name="disagg_bal", t_init=0.0, seed_floor=0.0,
      eta=float("inf"), seed_memory=False, remote_cap=False,
      pull_weights=False, preemption_recovery="recompute")


PRESETS = {
    "baseline": baseline,
    "rlhfuse": rlhfuse,
    "rlhfless": rlhfless,
    "rlboost": rlboost,
    "combined": combined,
    "disagg_bal": disagg_bal,
}


def get_policy(preset: str, **overrides) -> Policy:
  """Preset by name, with field overrides (including a new `name`)."""
  if preset not in PRESETS:
    raise ConfigError(f"unknown policy {preset!r}; have {sorted(PRESETS)}")
  try:
    return dataclasses.replace(PRESETS[preset](), **overrides)
  except TypeError as e:  # A knob Policy does not have.
    raise ConfigError(f"policy {preset!r}: {e}") from None
