"""The long-tailed decode workload of `benchmarks.paged_long_tail`.

32 prompts x G=8 samples, prompts of 256 random tokens, response lengths
lognormal (mean 256, sigma 1) capped at 2048 and forced by per-sample token
budgets (no stop tokens), so every engine produces the same samples; a
1-layer model (embed 256, 4 query heads, 1 kv head of 64, vocab 1024,
fp32); the KV budget of `static_rows` rows of the static layout (prompt
bucket + G x max_new_tokens each), which the paged pool gets in pages.
"""

from __future__ import annotations

import math

import numpy as np

from rlhf_jax.samples import Request
from rlhf_jax.models.config import ModelConfig

SIZES = dict(prompts=32, samples=8, prompt_len=256, mean_len=256.0,
             sigma=1.0, max_new_tokens=2048, static_rows=2, paged_slots=256,
             page_size=16, num_layers=1, num_heads=4, num_kv_heads=1)
# `--smoke` (tests/test_benchmarks_smoke.py): seconds, numbers meaningless.
SMOKE = dict(SIZES, prompts=4, samples=2, prompt_len=16, mean_len=8.0,
             max_new_tokens=32, paged_slots=8)


def workload(**sizes) -> dict:
  """The model, requests, lengths and KV budget of `SIZES` updated by
  `sizes`; every size is returned too."""
  w = dict(SIZES, **sizes)
  cfg = ModelConfig.tiny(num_layers=w["num_layers"], embed_dim=256,
                         num_heads=w["num_heads"],
                         num_kv_heads=w["num_kv_heads"], head_dim=64,
                         mlp_dim=768, vocab_size=1024)
  n, G, cap = w["prompts"], w["samples"], w["max_new_tokens"]
  rng = np.random.default_rng(0)
  mu = math.log(w["mean_len"]) - w["sigma"]**2 / 2
  lengths = np.clip(np.round(rng.lognormal(mu, w["sigma"], (n, G))), 1,
                    cap).astype(int)
  prompts = rng.integers(0, cfg.vocab_size, (n, w["prompt_len"]))
  requests = [Request(i, prompts[i].astype(np.int32), G, seed=7,
                      max_new_tokens_per_sample=tuple(int(x)
                                                      for x in lengths[i]))
              for i in range(n)]
  token_bytes = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim *
                 np.dtype(cfg.compute_jnp_dtype).itemsize)
  budget = w["static_rows"] * (w["prompt_len"] + G * cap) * token_bytes
  return dict(w, cfg=cfg, requests=requests, lengths=lengths,
              token_bytes=token_bytes, budget=budget, G=G,
              P=w["prompt_len"], M=cap)
