"""A sample cut mid-response continues elsewhere as prompt + tokens so far.

Sampling keys depend on (seed, prompt id, sample index, absolute position),
never on the worker: prefilling the prompt extended by the k tokens already
generated draws token k+1 with the key the original run would have used,
so the finished tokens equal an uninterrupted run's (up to the float
difference between one prefill and k decode steps over the same tokens).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlhf_jax.samples import Partial, Request, Sample


def remaining_request(request: Request, sample_idx: int, budget: int,
                      tokens: list[int]) -> Request:
  """The rest of one sample as a request of its own (num_samples=1)."""
  if budget - len(tokens) < 1:
    raise ValueError(f"sample {request.prompt_id}/{sample_idx} has no budget "
                     f"left ({len(tokens)} of {budget} tokens)")
  prompt = np.concatenate([np.asarray(request.tokens, np.int32),
                           np.asarray(tokens, np.int32)])
  return Request(request.prompt_id, prompt, num_samples=1, seed=request.seed,
                 first_sample_index=sample_idx,
                 max_new_tokens_per_sample=(budget - len(tokens),))


def continuation(p: Partial) -> Request:
  return remaining_request(p.request, p.sample_idx, p.budget, p.tokens)


def merge(original_prompt, head: Partial | None, tail: Sample,
          weight_version: int | None = None) -> Sample:
  """One sample from the tokens before the cut and the continuation's."""
  if head is None:
    return dataclasses.replace(
        tail, prompt_tokens=np.asarray(original_prompt, np.int32))
  routes = {}
  if tail.prompt_routes is not None:  # The engines record experts.
    P, shape = len(original_prompt), tail.prompt_routes.shape[1:]
    prompt_routes, rows = absorb_routes(P, head.prompt_routes, head.routes,
                                        len(head.tokens), tail)
    routes = dict(prompt_routes=prompt_routes, routes=np.concatenate([
        np.stack([np.reshape(r, shape) for r in rows]).astype(np.int16),
        tail.routes]) if rows else tail.routes)
  return Sample(
      tail.prompt_id, tail.sample_idx, np.asarray(original_prompt, np.int32),
      head.tokens + tail.tokens, head.logp + tail.logp,
      head.logp_raw + tail.logp_raw, tail.finish_reason,
      tail.weight_version if weight_version is None else weight_version,
      seed=tail.seed, **routes)


def absorb_routes(P: int, prompt_routes, head_routes: list, n: int,
                  part) -> tuple:
  """Routing replay's records of a sample continued as prompt + its `n`
  head tokens, once `part` (a `Partial` or `Sample` of that continuation
  request) has run: (the prompt's [P, L, k], one flat row a head token),
  without the part's own tokens for a `Sample` (its `routes` follow), with
  them for a `Partial`. Each response token keeps the record of its first
  feeding, and a head token not fed before the cut (the last one) takes
  the continuation prefill's; the prompt takes the newest prefill's (the
  tokens drawn from then on attend to it), as `engine/restart.readmit`
  does. No records: (prompt_routes, head_routes) as they were."""
  if part.prompt_routes is None:
    return prompt_routes, head_routes
  recorded = np.asarray(part.prompt_routes)
  prompt_routes = recorded[:P]
  rows = list(head_routes[:n]) + [None] * (n - len(head_routes[:n]))
  rows = [np.ravel(recorded[P + j]) if r is None else np.ravel(r)
          for j, r in enumerate(rows)]
  if isinstance(part, Partial):
    rows += [None if r is None else np.ravel(r) for r in part.routes or []]
  return prompt_routes, rows
