"""The multi-turn cases the engine's and the agent's tests share: a tiny
model's conversations whose environment appends fixed replies, and their
oracle on the static-rows decoder, re-prefilled anew every turn."""

import numpy as np

from benchmarks.static_rows import StaticRows
from fakes import TINY_CFG as CFG
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.samples import Request

STOPS = tuple(range(0, CFG.vocab_size, 7))  # End of turn: ~1 token in 7.
M = 20
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=M, stop_tokens=STOPS)
REPLY = [30, 31, 33, 34, 36, 37]  # No stop token among them.
BUDGETS = (20, 13)


def reply_fn(turns=2):
  """The environment: REPLY + [turn number] after each of the first
  `turns` turns of a sample, then the sample ends."""
  seen = {}

  def reply(request, sample_idx, tokens, logp=None):
    assert tokens[-1] in STOPS
    assert logp is None or len(logp) == len(tokens)
    k = seen[request.prompt_id, sample_idx] = seen.get(
        (request.prompt_id, sample_idx), 0) + 1
    return REPLY + [40 + k] if k <= turns else None
  return reply


def requests():
  rng = np.random.default_rng(4)
  return [Request(i, rng.integers(6, CFG.vocab_size, rng.integers(3, 12)
                                  ).astype(np.int32), 2, seed=1,
                  max_new_tokens_per_sample=BUDGETS) for i in range(5)]


def oracle(model, layout, reply=None):
  """Each sample turn by turn on the static-rows decoder, prompt + all
  tokens so far prefilled anew every turn (`reply`: the environment, by
  default `reply_fn()`)."""
  graphdef, params = model
  rows = StaticRows(CFG, graphdef, mesh_lib.to_layout(params, layout),
                    rows=2, samples_per_row=1, bucket=48, sampling=GREEDY)
  reply, out = reply or reply_fn(), {}
  for req in requests():
    for j, budget in enumerate(BUDGETS):
      tokens, mask, reason = [], [], "length"
      while len(tokens) < budget:
        (s,) = rows.run([Request(
            req.prompt_id, np.concatenate([req.tokens, tokens]).astype(
                np.int32), 1, seed=1, first_sample_index=j,
            max_new_tokens_per_sample=(budget - len(tokens),))]).values()
        tokens, mask = tokens + s.tokens, mask + [False] * len(s.tokens)
        reason = s.finish_reason
        if reason != "stop":
          break
        extra = reply(req, j, list(tokens))
        if extra is None:
          break
        if len(tokens) + 1 + len(extra) > budget:
          reason = "length"
          break
        tokens, mask = tokens + extra, mask + [True] * len(extra)
      out[req.prompt_id, j] = tokens, mask, reason
  return out
