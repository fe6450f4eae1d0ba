"""Shared setup of the rollout-worker tests: a tiny paged engine spec,
requests, a store holding version 0, reference samples and the check
against them."""

import numpy as np

from rlhf_jax.samples import Request
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.workers import manager as manager_lib
from rlhf_jax.workers.weights import LocalWeightStore
from rlhf_jax.workers.worker import EngineSpec

M = 12  # Max new tokens.
# The paged engine, as jobs' workers run it (`rollout/elastic.py`): 4 slots
# (2 rows x G=2), pages of 4 tokens, the pool sized for every slot (0: no
# pool preemption), one decode step a call (a poll of n steps is n tokens
# a sample, so polls land mid-response).
SPEC = EngineSpec(ModelConfig.tiny(vocab_size=64), num_rows=2,
                  samples_per_row=2, prefill_buckets=(8, 8 + M),
                  sampling=SamplingParams(temperature=1.0, top_k=40,
                                          max_new_tokens=M),
                  paged=dict(page_size=4, num_pages=0, num_slots=0,
                             decode_window=1))


def requests(n=6, *, rng_seed=0, seed=3, budgets=None):
  """n prompts of 2-7 random tokens, 2 samples each (per-sample budgets:
  `budgets[p]`)."""
  rng = np.random.default_rng(rng_seed)
  return [Request(p, rng.integers(6, 64, int(rng.integers(2, 8))),
                  num_samples=2, seed=seed,
                  max_new_tokens_per_sample=budgets and budgets[p])
          for p in range(n)]


def published_store(spec=SPEC):
  """(a `LocalWeightStore` holding version 0, those params)."""
  _, params = model_lib.init_params(spec.model, 0)
  store = LocalWeightStore()
  store.publish(0, params)
  return store, params


def reference(store, worker, reqs, poll_steps):
  """{sample key: sample} of `reqs` on one worker, nothing interrupted."""
  ref = manager_lib.RolloutManager(store, max_new_tokens=M,
                                   poll_steps=poll_steps)
  ref.add(manager_lib.LocalHandle(worker))
  return {s.key: s for s in ref.run(reqs)}


def check(samples, want, budgets=None):
  """Every sample once, with the reference's prompt, tokens and log-probs
  (its first `budgets[key]` tokens when cut short)."""
  keys = [s.key for s in samples]
  assert len(keys) == len(set(keys)) == len(want)
  for s in samples:
    w = want[s.key]
    n = len(w.tokens) if budgets is None else budgets[s.key]
    assert s.tokens == w.tokens[:n], s.key
    np.testing.assert_array_equal(s.prompt_tokens, w.prompt_tokens)
    np.testing.assert_allclose(s.logp_raw, w.logp_raw[:n], atol=1e-4)
