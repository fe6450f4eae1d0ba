"""The long-tail rollout in the RL loop: config, build, fused reward scoring.

With `rollout.long_tail.enabled`, a step's rollout runs through
`engine/long_tail.LongTailRollout` (length-aware assignment, consolidation,
cost-aware replica count) and the reward functions score samples in chunks
as they finish, on the host while the devices decode (fusion). The
per-prompt length history is part of the checkpoint metadata.
"""

from __future__ import annotations

import numpy as np
from ml_collections import ConfigDict

from rlhf_jax.engine.long_tail import LongTailRollout, TailConfig
from rlhf_jax.sched.length_history import LengthHistory
from rlhf_jax.trainers import rollout

TAIL_KEYS = ("admission", "assignment", "consolidate_below", "migration",
             "reprefill_max_tokens", "fusion", "score_chunk", "replicas",
             "cost_lambda")


def default_config() -> ConfigDict:
  """`rollout.long_tail`: off by default; the knobs of `TailConfig`."""
  d = TailConfig()
  return ConfigDict(dict(enabled=False, history_alpha=0.5,
                         **{k: getattr(d, k) for k in TAIL_KEYS}))


def tail_config(section) -> TailConfig:
  values = {k: section[k] for k in TAIL_KEYS}
  if isinstance(values["replicas"], str) and values["replicas"].isdigit():
    values["replicas"] = int(values["replicas"])  # "4" from the command line.
  cfg = TailConfig(**values)
  cfg.validate()
  return cfg


def check(config) -> None:
  """Config errors of `rollout.long_tail`, before anything is built."""
  from rlhf_jax.trainers.validate import ConfigError

  section = config.rollout.get("long_tail")
  if section is None or not section.enabled:
    return
  try:
    tail_config(section)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  if config.rollout.get("max_common_length", 0):
    raise ConfigError("config.rollout.long_tail does not combine with "
                      "config.rollout.max_common_length yet; turn one off")


def build(config, cfg, graphdef, rollout_layout,
          stop_tokens) -> LongTailRollout | None:
  """The job's long-tail rollout, or None when it is off."""
  from rlhf_jax.trainers import builders

  section = config.rollout.get("long_tail")
  if section is None or not section.enabled:
    return None
  ro = config.rollout
  replicas = rollout_layout.mesh.shape["data"]
  if ro.num_rows % replicas:
    raise ValueError(f"rollout.num_rows={ro.num_rows} must be a multiple of "
                     f"the {replicas} rollout replicas")
  return LongTailRollout(
      cfg, graphdef, rollout_layout, rows_per_replica=ro.num_rows // replicas,
      samples_per_row=ro.samples_per_row,
      prefill_buckets=tuple(ro.prefill_buckets),
      sampling=builders.sampling_params(ro, stop_tokens),
      tail=tail_config(section), history=LengthHistory(section.history_alpha),
      attention_impl=ro.get("attention_impl", "auto"))


class RewardScorer:
  """Reward functions over chunks of finished samples (host, fused)."""

  def __init__(self, prompts, tokenizer, fns, weights, on_error):
    self.prompts, self.tokenizer = prompts, tokenizer
    self.fns, self.weights, self.on_error = fns, weights, on_error
    self.sums: dict[str, float] = {}
    self.count = 0

  def score(self, samples, layout):
    del layout  # Host work: it overlaps the decode steps in flight.
    rewards, metrics = rollout.score(list(samples), self.prompts,
                                     self.tokenizer, self.fns, self.weights,
                                     self.on_error)
    n = len(samples)
    for k, v in metrics.items():  # Errors add up; means weigh by size.
      self.sums[k] = self.sums.get(k, 0.0) + (v if k == "rewards/errors"
                                              else v * n)
    self.count += n
    return {"reward": rewards}

  def metrics(self) -> dict:
    return {k: v if k == "rewards/errors" else v / max(1, self.count)
            for k, v in self.sums.items()}


def generate_and_score(lt: LongTailRollout, params, prompts, num_samples,
                       seed, scorer: RewardScorer, *, weight_version: int,
                       step: int):
  """Samples (ordered as `rollout.generate`), rewards [B], metrics."""
  order = {int(pid): i for i, pid in enumerate(prompts.prompt_ids)}
  if len(order) != len(prompts.prompt_ids):
    raise ValueError(f"prompt ids repeat within one batch: "
                     f"{sorted(prompts.prompt_ids.tolist())}")
  result = lt.run(params, rollout.requests_for(prompts, num_samples, seed),
                  scorer=scorer, step=step, weight_version=weight_version)
  samples = sorted(result.samples,
                   key=lambda s: (order[s.prompt_id], s.sample_idx))
  expected = len(order) * num_samples
  if len(samples) != expected:
    raise RuntimeError(f"rollout returned {len(samples)} samples, expected "
                       f"{expected}")
  rewards = np.array([float(result.scores[s.key]["reward"]) for s in samples],
                     np.float32)
  stats = {k: float(v) for k, v in result.stats.items()
           if isinstance(v, (int, float))}
  return samples, rewards, {**scorer.metrics(), **stats}
