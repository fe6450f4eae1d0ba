"""Multi-turn sampling with the conversation's KV kept (engine/multiturn.py):
a trajectory equals the same trajectory re-prefilled at every turn on the
static-rows decoder (greedy; the oracle prefills prompt + everything so
far anew each turn), appended tokens are masked, and a tight pool
(preemption, recompute with the replies) changes nothing."""

import pytest

from fakes import TINY_CFG as CFG
from multiturn_cases import GREEDY, oracle, reply_fn, requests
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.multiturn import MultiTurnDriver
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
