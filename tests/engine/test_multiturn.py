"""Multi-turn sampling with the conversation's KV kept (engine/multiturn.py):
a trajectory equals the same trajectory re-prefilled at every turn on the
static-rows decoder (greedy; the oracle prefills prompt + everything so
far anew each turn), appended tokens are masked, and a tight pool
(preemption, recompute with the replies) changes nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fakes import TINY_CFG as CFG
from multiturn_cases import GREEDY, oracle, reply_fn, requests
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.multiturn import MultiTurnDriver
from rlhf_jax.engine.state import split_top
from rlhf_jax.models import model as model_lib
from rlhf_jax.parallel import mesh as mesh_lib


@pytest.fixture(scope="module")
def model(tiny_model):
  return tiny_model


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
                           reply=reply_fn())
  got = {s.key: s for s in driver.run(requests())}
  want = oracle(model, mesh_lib.rollout_layout(mesh1))
  assert got.keys() == want.keys()
  for k, s in got.items():
    tokens, mask, reason = want[k]
    assert (s.tokens, s.env_mask, s.finish_reason) == (tokens, mask,
                                                       reason), k
    assert all(lp == 0.0 for lp, m in zip(s.logp_raw, mask) if m)
  assert driver.turns > 4  # Several samples took turns ...
  assert driver.appended_tokens == sum(sum(m) for _, m, _ in want.values())
  # ... and nothing before a reply was prefilled again: only the prompts.
  assert driver.stats.prefills == -(-len(requests()) // 2)
  assert driver.pool.num_used == 0
  if pages == 40:  # A reply found no page: its sample gave way.
    assert driver.reply_preemptions > 0


@pytest.mark.parametrize("pages", [200, 40], ids=["roomy", "tight"])
def test_top_logprobs_are_the_policys_likeliest_tokens(model, mesh8, pages):
  """Engine(top_logprobs=4): at each turn end the reply gets, for every
  drawn token of the sample, the 4 likeliest tokens and their log-probs
  where it was drawn: a full-sequence forward's log-softmax over the
  prompt and the tokens before it (teacher-forced), top 4. Appended tokens
  have none; a tight pool (preemption, recompute) keeps the records."""
  graphdef, params = model
  layout = mesh_lib.rollout_layout(mesh8, tensor=2)
  engine = Engine(CFG, graphdef, layout, num_slots=8, samples_per_group=2,
                  prefill_buckets=(16,), sampling=GREEDY, page_size=4,
                  num_pages=pages, prefill_batch=2, top_logprobs=4)
  inner, seen = reply_fn(), []

  def reply(request, sample_idx, tokens, logp, top):
    appended = driver._appended.get((request.prompt_id, sample_idx), ())  # pylint: disable=protected-access
    seen.append((request, list(tokens), list(top), set(appended)))
    return inner(request, sample_idx, tokens, logp)

  driver = MultiTurnDriver(engine, mesh_lib.to_layout(params, layout),
                           reply=reply)
  list(driver.run(requests()))
  assert len(seen) > 4
  P = 64  # Padded length of the oracle's forward (causal: no effect).

  @jax.jit
  def logp_of(params, tokens_P):
    logits = model_lib.forward(graphdef, params, tokens_P[None],
                               jnp.arange(P)[None], jnp.ones((1, P), bool))
    return jax.nn.log_softmax(logits[0].astype(jnp.float32), -1)

  checked = 0
  for request, tokens, top, appended in seen:
    assert len(top) == len(tokens)
    seq = np.zeros(P, np.int32)
    n = len(request.tokens)
    seq[:n + len(tokens)] = np.concatenate([request.tokens, tokens])
    want = np.asarray(logp_of(params, seq))
    for j, row in enumerate(top):
      assert (row is None) == (j in appended), (j, appended)
      if row is None:  # An appended token (the environment's).
        continue
      ids, logps = split_top(np.asarray(row))
      oracle_ids = np.argsort(-want[n + j - 1])[:4]
      np.testing.assert_array_equal(ids, oracle_ids)
      np.testing.assert_allclose(logps, want[n + j - 1][oracle_ids],
                                 atol=2e-5)
      assert ids[0] == tokens[j]  # Greedy: the drawn one is the likeliest.
      checked += 1
  assert checked > 10  # 18 drawn tokens checked (counted once).
  if pages == 40:
    assert driver.reply_preemptions > 0 or driver.paged.preemptions > 0
