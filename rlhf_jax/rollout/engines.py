"""The trainer's rollout engines and sampling parameters from the `rollout`
section (the job's rollout, `rollout/build.py`, and the elastic workers'
engine spec, `rollout/elastic.py`, both read them)."""

from __future__ import annotations

from rlhf_jax.config.sections import Rollout as RolloutSection
from rlhf_jax.engine.engine_set import EngineSet
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel.layout import Layout


def sampling_params(ro: RolloutSection, stop_tokens=()) -> SamplingParams:
  return SamplingParams(
      temperature=ro.temperature, top_k=ro.top_k, top_p=ro.top_p,
      max_new_tokens=ro.max_new_tokens, stop_tokens=tuple(stop_tokens))


def engines(ro: RolloutSection, cfg: ModelConfig, graphdef, layout: Layout,
            stop_tokens=(), record_routes: bool = False,
            top_logprobs: int = 0) -> EngineSet:
  """The rollout engines of the trainer's mesh (one per replica block);
  `record_routes`: they record an MoE's experts (routing replay);
  `top_logprobs`: each drawn token's likeliest alternatives (the agent
  endpoint's)."""
  # The engines build lazily (after a job's warm-start): top_k against the
  # vocabulary now, as a config error (the jobs checked it before building
  # the weights, `trainers/policy.build`; this covers the generation demo).
  ro.check_sampling(cfg.vocab_size)
  return EngineSet(cfg, graphdef, layout,
                   rows_per_replica=ro.num_rows // layout.mesh.shape["data"],
                   samples_per_row=ro.samples_per_row,
                   prefill_buckets=tuple(ro.prefill_buckets),
                   sampling=sampling_params(ro, stop_tokens),
                   attention_impl=ro.attention_impl,
                   max_common_length=ro.max_common_length,
                   record_routes=record_routes, top_logprobs=top_logprobs,
                   paged=dict(page_size=ro.page_size, num_pages=ro.kv_pages,
                              num_slots=ro.num_slots,
                              decode_window=ro.decode_window))
