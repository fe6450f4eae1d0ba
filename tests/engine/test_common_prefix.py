"""Two-level sharing: a common prefix prefilled once, stored once, attended
as a third log-sum-exp part. Oracles: float64 concatenated-key attention for
the kernel part, the full-sequence forward for the context prefill, and the
plain engine fed the whole prompts for the engine and driver."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fakes
from kernels_pallas import prefix_decode_attention as pda
from rlhf_jax.engine.common_prefix import (
    longest_common_prefix, strip_common_prefix)
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.driver import Driver
from rlhf_jax.samples import Request
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import model as model_lib
from rlhf_jax.parallel import mesh as mesh_lib

CFG = fakes.TINY_CFG  # GQA: 4 query heads, 2 kv heads.
STOP = 5
SAMPLED = SamplingParams(temperature=1.0, top_k=40, top_p=0.95,
                         max_new_tokens=8, stop_tokens=(STOP,))
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


# ------------------------------------------------------------------ kernel
def _naive3(q, ck, cv, clen, pk, pv, plen, sk, sv, slen, scale):
  """Float64 softmax over [common[:clen]; prefix[:plen]; suffix[:slen]]."""
  q, ck, cv, pk, pv, sk, sv = (np.asarray(x, np.float64)
                               for x in (q, ck, cv, pk, pv, sk, sv))
  R, G, H, K = q.shape
  N = pk.shape[2]
  out = np.zeros((R, G, H, K))
  lse = np.full((R, G, H), -np.inf)
  for r in range(R):
    for g in range(G):
      for h in range(H):
        n = h // (H // N)
        keys = np.concatenate([ck[:clen, n], pk[r, :plen[r], n],
                               sk[r, g, :slen[r, g], n]])
        vals = np.concatenate([cv[:clen, n], pv[r, :plen[r], n],
                               sv[r, g, :slen[r, g], n]])
        if not len(keys):
          continue
        s = keys @ q[r, g, h] * scale
        lse[r, g, h] = np.logaddexp.reduce(s)
        out[r, g, h] = np.exp(s - lse[r, g, h]) @ vals
  return out, lse


def _kernel_inputs(seed, *, R=3, G=4, H=8, N=2, K=16, P=7, M=5, C=9,
                   clen=6):
  rng = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  plen = np.array([7, 0, 3])[:R]   # Row 1: a free row.
  slen = rng.integers(0, M + 1, (R, G))
  slen[1] = 0
  args = (normal(R, G, H, K), normal(R, P, N, K), normal(R, P, N, K),
          jnp.asarray(plen, jnp.int32), normal(R, G, M, N, K),
          normal(R, G, M, N, K), jnp.asarray(slen, jnp.int32))
  common = dict(common_k_CxNxK=normal(C, N, K), common_v_CxNxK=normal(C, N, K),
                common_len=jnp.int32(clen))
  return args, common


def test_third_part_matches_concatenated_keys():
  args, common = _kernel_inputs(0)
  kw = dict(impl="xla", return_lse=True)
  out, lse = jax.jit(functools.partial(pda.prefix_decode_attention, **kw))(
      *args, **common)
  ref = jax.jit(pda.prefix_decode_attention_reference)
  q, pk, pv, plen, sk, sv, slen = args
  want_out, want_lse = _naive3(
      q, common["common_k_CxNxK"], common["common_v_CxNxK"], 6, pk, pv,
      np.asarray(plen), sk, sv, np.asarray(slen), 16**-0.5)
  np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(lse, want_lse, atol=1e-5)
  # An empty common prefix (length 0) is exactly the two-part result.
  two = ref(*args)
  none = ref(*args, **{**common, "common_len": jnp.int32(0)})
  np.testing.assert_allclose(none, two, atol=1e-6)


# ------------------------------------------------------------------ model
def test_context_prefill_equals_full_sequence_forward():
  # Gemma-2 switches: soft-caps and a sliding window smaller than the
  # sequence, so the window must also cut the context keys.
  cfg = CFG.replace(attn_logit_softcap=5.0, sliding_window=7)
  graphdef, params = model_lib.init_params(cfg, 0)
  rng = np.random.default_rng(1)
  C, T, pad_c, pad_t = 6, 5, 8, 8
  tokens = rng.integers(6, cfg.vocab_size, C + T).astype(np.int32)

  @jax.jit
  def both(params):
    full = model_lib.forward(graphdef, params, tokens[None],
                             np.arange(C + T)[None], np.ones((1, C + T), bool))
    ctx_tokens = np.zeros(pad_c, np.int32)
    ctx_tokens[:C] = tokens[:C]
    _, (ck, cv) = model_lib.forward(
        graphdef, params, ctx_tokens[None], np.arange(pad_c)[None],
        (np.arange(pad_c) < C)[None], return_kv=True)
    own = np.zeros(pad_t, np.int32)
    own[:T] = tokens[C:]
    logits = model_lib.forward(
        graphdef, params, own[None], C + np.arange(pad_t)[None],
        (np.arange(pad_t) < T)[None],
        context=(ck[:, 0], cv[:, 0], jnp.int32(C)))
    return logits[0, :T], full[0, C:]

  got, want = both(params)
  np.testing.assert_allclose(got, want, atol=1e-5)


# ----------------------------------------------------------------- helpers
def test_longest_common_prefix_and_strip():
  a = np.array([1, 2, 3, 4, 5])
  b = np.array([1, 2, 3, 9])
  c = np.array([1, 2, 3])
  np.testing.assert_array_equal(longest_common_prefix([a, b]), [1, 2, 3])
  # Every prompt keeps at least one token after the common prefix.
  np.testing.assert_array_equal(longest_common_prefix([a, c]), [1, 2])
  np.testing.assert_array_equal(longest_common_prefix([a, a]), [1, 2, 3, 4])
  np.testing.assert_array_equal(
      longest_common_prefix([a, b], max_length=2), [1, 2])
  assert longest_common_prefix([a, b], min_length=4).size == 0
  assert longest_common_prefix([a, np.array([7, 2])]).size == 0
  assert longest_common_prefix([]).size == 0
  np.testing.assert_array_equal(strip_common_prefix(a, [1, 2]), [3, 4, 5])
  with pytest.raises(ValueError, match="prompt 4 does not start with the "
                     "common prefix: token 2 is 3"):
    strip_common_prefix(a, [1, 2, 7], prompt_id=4)
  with pytest.raises(ValueError, match="prompt 5 has 3 tokens, none after"):
    strip_common_prefix(c, [1, 2, 3], prompt_id=5)


# ------------------------------------------------------------------ engine
def _batch(common, n, seed):
  """Prompts = common + 1..9 own tokens (variable lengths)."""
  rng = np.random.default_rng(seed)
  return [np.concatenate([common, rng.integers(6, CFG.vocab_size,
                                               rng.integers(1, 10))])
          .astype(np.int32) for _ in range(n)]


def _requests(prompts, g, seed=3):
  return [Request(i, p, g, seed=seed) for i, p in enumerate(prompts)]


def _assert_same(a, b, logp_atol=1e-5):
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].tokens == b[k].tokens, k
    assert a[k].finish_reason == b[k].finish_reason, k
    np.testing.assert_array_equal(a[k].prompt_tokens, b[k].prompt_tokens)
    np.testing.assert_allclose(a[k].logp_raw, b[k].logp_raw, atol=logp_atol)
    np.testing.assert_allclose(a[k].logp, b[k].logp, atol=logp_atol)


@pytest.mark.parametrize("sampling,kv_heads", [(GREEDY, 2), (SAMPLED, 1)],
                         ids=["greedy_gqa2", "sampled_gqa4"])
def test_common_prefix_equals_whole_prompts(mesh8, sampling, kv_heads):
  cfg = CFG.replace(num_kv_heads=kv_heads)
  layout = mesh_lib.rollout_layout(mesh8, tensor=2)  # 4 replicas x TP 2.
  graphdef, params = model_lib.init_params(cfg, 0, layout)
  g = 4
  make = lambda **kw: Engine(cfg, graphdef, layout, num_slots=16,
                                  samples_per_group=g, sampling=sampling,
                                  page_size=4, prefill_batch=4, **kw)
  plain = make(prefill_buckets=(32,))
  shared = make(prefill_buckets=(16,), max_common_length=16)
  shared_driver = Driver(shared, params)
  rng = np.random.default_rng(0)
  # Two batches with different common prefixes (13 and 7 tokens) through
  # the same engines: 6 prompts over 4 rows, so rows are reused.
  for batch, clen in enumerate((13, 7)):
    common = rng.integers(6, CFG.vocab_size, clen).astype(np.int32)
    prompts = _batch(common, 6, seed=batch)
    want = {s.key: s for s in Driver(plain, params).run(
        _requests(prompts, g))}
    declared = common if batch == 0 else "auto"
    got = {s.key: s for s in shared_driver.run(
        _requests(prompts, g), common_prefix=declared, min_common_length=4)}
    # Declared: exactly the given tokens. "auto": the longest prefix all six
    # prompts share (>= clen: own tokens may agree by chance), capped at
    # max_common_length=16 and leaving every prompt one token; by hand.
    if batch == 0:
      want_len = clen
    else:
      want_len = 0
      while (want_len < min(16, min(p.size for p in prompts) - 1)
             and len({int(p[want_len]) for p in prompts}) == 1):
        want_len += 1
    assert want_len >= clen
    assert shared_driver.stats.common_prefix_length == want_len
    _assert_same(got, want)
    if not sampling.greedy:  # The G samples of a prompt really differ.
      assert len({tuple(got[0, j].tokens) for j in range(g)}) > 1
  # One common prefill compile for both batches; one prefill per bucket.
  assert shared.trace_counts["common_prefill"] == 1
  assert shared.trace_counts["prefill"] == len(shared.buckets) == 1
  # KV: the common prefix once in the state; a group's prompt pages hold
  # only its own tokens (16-token bucket: 4 pages of 4, not 8), and the
  # default pool has room for 4 groups' prompts (16 slots / G=4).
  L, N, K = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  saved = (4 * 32 - 4 * 16 - 16) * 2 * L * N * K * 4
  common_bytes = 16 * 2 * L * N * K * 4
  assert plain.pool_bytes - (shared.pool_bytes + common_bytes) == saved
  assert shared.max_prompt_pages == 4 and plain.max_prompt_pages == 8
  # Prefill work: 16 padded common tokens once a batch + per prefill call
  # of up to 4 prompts 4 x 16 (not 4 x 32); 6 prompts need >= 2 calls.
  stats = shared_driver.stats
  assert stats.prefills >= 2 * 2
  assert stats.prefill_tokens == 2 * 16 + stats.prefills * 4 * 16


def test_bad_inputs_raise_clear_errors(mesh8):
  layout = mesh_lib.rollout_layout(mesh8, tensor=2)
  graphdef, params = model_lib.init_params(CFG, 0, layout)
  make = lambda **kw: Engine(CFG, graphdef, layout, num_slots=8,
                                  samples_per_group=2, prefill_buckets=(8,),
                                  sampling=GREEDY, page_size=4, **kw)
  engine = make(max_common_length=6)
  driver = Driver(engine, params)
  run = lambda reqs, **kw: list(driver.run(reqs, **kw))
  common = np.arange(6, 12, dtype=np.int32)
  ok = np.concatenate([common, [20, 21]]).astype(np.int32)
  with pytest.raises(ValueError, match="common prefix has 7 tokens, longer "
                     "than this engine's max_common_length=6"):
    run([Request(0, np.arange(6, 15), 1)], common_prefix=np.arange(6, 13))
  with pytest.raises(ValueError, match="prompt 1 does not start with the "
                     "common prefix: token 3 is 40"):
    bad = ok.copy()
    bad[3] = 40
    run([Request(0, ok, 1), Request(1, bad, 1)], common_prefix=common)
  with pytest.raises(ValueError, match="prompt 2 has 6 tokens, none after"):
    run([Request(2, common, 1)], common_prefix=common)
  with pytest.raises(ValueError, match="prompt 3 has 9 tokens after the "
                     "common prefix of 6, longer than the largest prefill"):
    run([Request(3, np.concatenate([common, np.full(9, 7)]), 1)],
        common_prefix=common)
  with pytest.raises(ValueError, match="common_prefix must be None, 'auto'"):
    run([Request(0, ok, 1)], common_prefix="yes")
  plain = make()
  with pytest.raises(ValueError, match="max_common_length=0"):
    plain.set_common_prefix(params, common)
  with pytest.raises(ValueError, match="'auto' needs an engine"):
    list(Driver(plain, params).run([Request(0, ok, 1)],
                                        common_prefix="auto"))
  with pytest.raises(ValueError, match="max_common_length must be >= 0"):
    make(max_common_length=-1)
  # A decode state is tied to the common prefix it was made with.
  engine.set_common_prefix(params, common)
  state = engine.init_decode_state()
  prompt = np.array([20, 21], np.int32)
  insert = lambda state, pre: engine.insert(state, pre, [0], [[0]], [2], [0],
                                            [0])
  engine.set_common_prefix(params, common[:4])
  pre = engine.prefill(params, [(prompt, 0)], [0], [0], [[0]])
  with pytest.raises(ValueError, match="decode state holds an older common"):
    insert(state, pre)
  insert(engine.init_decode_state(), pre)
