"""Multi-turn sampling with the conversation's KV kept (engine/multiturn.py):
a trajectory equals the same trajectory re-prefilled at every turn on the
static-rows decoder (greedy; the oracle prefills prompt + everything so
far anew each turn), appended tokens are masked, and a tight pool
(preemption, recompute with the replies) changes nothing."""

import numpy as np
import pytest

from benchmarks.static_rows import StaticRows
from rlhf_jax.samples import Request
from rlhf_jax.engine.multiturn import MultiTurnDriver
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import model as model_lib
from rlhf_jax.parallel import mesh as mesh_lib
from test_paged import CFG

STOPS = tuple(range(0, CFG.vocab_size, 7))  # End of turn: ~1 token in 7.
M = 20
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=M, stop_tokens=STOPS)
REPLY = [30, 31, 33, 34, 36, 37]  # No stop token among them.
BUDGETS = (20, 13)


@pytest.fixture(scope="module")
def model(mesh8):
  return model_lib.init_params(CFG, 0, mesh_lib.train_layout(mesh8))


def _reply_fn(turns=2):
  """The environment: REPLY + [turn number] after each of the first
  `turns` turns of a sample, then the sample ends."""
  seen = {}

  def reply(request, sample_idx, tokens):
    assert tokens[-1] in STOPS
    k = seen[request.prompt_id, sample_idx] = seen.get(
        (request.prompt_id, sample_idx), 0) + 1
    return REPLY + [40 + k] if k <= turns else None
  return reply


def _requests():
  rng = np.random.default_rng(4)
  return [Request(i, rng.integers(6, CFG.vocab_size, rng.integers(3, 12)
                                  ).astype(np.int32), 2, seed=1,
                  max_new_tokens_per_sample=BUDGETS) for i in range(5)]


def _oracle(model, layout, reply=None):
  """Each sample turn by turn on the static-rows decoder, prompt + all
  tokens so far prefilled anew every turn (`reply`: the environment, by
  default `_reply_fn()`)."""
  graphdef, params = model
  rows = StaticRows(CFG, graphdef, mesh_lib.to_layout(params, layout),
                    rows=2, samples_per_row=1, bucket=48, sampling=GREEDY)
  reply, out = reply or _reply_fn(), {}
  for req in _requests():
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


@pytest.mark.parametrize("pages", [200, 40], ids=["roomy", "tight"])
def test_turns_keep_their_kv_and_equal_reprefill(model, mesh8, mesh1,
                                                 pages):
  graphdef, params = model
  layout = mesh_lib.rollout_layout(mesh8, tensor=2)  # 4 replicas x 2.
  engine = Engine(CFG, graphdef, layout, num_slots=8,
                       samples_per_group=2, prefill_buckets=(16,),
                       sampling=GREEDY, page_size=4, num_pages=pages,
                       prefill_batch=2)
  driver = MultiTurnDriver(engine, mesh_lib.to_layout(params, layout),
                           reply=_reply_fn())
  got = {s.key: s for s in driver.run(_requests())}
  want = _oracle(model, mesh_lib.rollout_layout(mesh1))
  assert got.keys() == want.keys()
  for k, s in got.items():
    tokens, mask, reason = want[k]
    assert (s.tokens, s.env_mask, s.finish_reason) == (tokens, mask,
                                                       reason), k
    assert all(lp == 0.0 for lp, m in zip(s.logp_raw, mask) if m)
  assert driver.turns > 4  # Several samples took turns ...
  assert driver.appended_tokens == sum(sum(m) for _, m, _ in want.values())
  # ... and nothing before a reply was prefilled again: only the prompts.
  assert driver.stats.prefills == -(-len(_requests()) // 2)
  assert driver.pool.num_used == 0
  if pages == 40:  # A reply found no page: its sample gave way.
    assert driver.reply_preemptions > 0
