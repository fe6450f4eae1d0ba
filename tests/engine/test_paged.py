"""The paged engine and its driver against the static-rows decoder.

The oracle is `benchmarks/static_rows.StaticRows`: plain jnp, one device,
rows of one prompt's KV and G suffix buffers, nothing paged, moved or
preempted (it shares only the sampling keys and the model). The engine must
sample exactly its tokens on another layout, with pools small enough to
force preemption, with sample-level slot reuse, common prefixes, appended
tokens and worker continuations; against transformers: test_hf.py.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.static_rows import StaticRows
import fakes
from kernels_pallas import paged_decode_attention as pda
from rlhf_jax.engine import moves
from rlhf_jax.samples import Request
from rlhf_jax.engine.page_pool import PagePool, PoolExhausted
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.workers import continuation

CFG = fakes.TINY_CFG
STOP = 5
SAMPLED = SamplingParams(temperature=1.0, top_k=40, top_p=0.95,
                         max_new_tokens=20, stop_tokens=(STOP,))
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)
G = 4


@pytest.fixture(scope="module")
def model(tiny_model):
  return tiny_model


@pytest.fixture(scope="module")
def layouts(mesh8, mesh1):
  return mesh_lib.rollout_layout(mesh1), mesh_lib.rollout_layout(mesh8,
                                                                 tensor=2)


def _requests(n=6, seed=0, common=()):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    own = rng.integers(6, CFG.vocab_size, rng.integers(3, 14))
    budgets = tuple(int(b) for b in rng.integers(1, 21, G))
    out.append(Request(i, np.concatenate([common, own]).astype(np.int32), G,
                       seed=3, max_new_tokens_per_sample=budgets))
  return out


@pytest.fixture(scope="module")
def rows_run(model, layouts):
  """Static-rows samples of some requests, on one device (prompts of up
  to 48 tokens, prefilled whole)."""
  graphdef, params = model
  decoder = StaticRows(CFG, graphdef, mesh_lib.to_layout(params, layouts[0]),
                       rows=2, samples_per_row=G, bucket=48, sampling=SAMPLED)
  return decoder.run


@pytest.fixture(scope="module")
def oracle(rows_run):
  return rows_run(_requests())


_ENGINES = {}
# The sampled engine most tests share: 4 replicas x tensor 2, a roomy pool,
# a common prefix of up to 16 tokens, prompts of up to 48 (chunked).
MAIN = dict(pages=200, max_common_length=16, max_prompt_length=48)


def _paged(model, layout, *, pages, slots=8, sampling=SAMPLED, page_size=4,
           buckets=(8, 16), **kw):
  """A driver on a paged engine, the engine shared by equal arguments."""
  graphdef, params = model
  key = (id(layout), pages, slots, sampling, page_size, buckets,
         tuple(sorted(kw.items())))
  if key not in _ENGINES:
    _ENGINES[key] = Engine(CFG, graphdef, layout, num_slots=slots,
                                samples_per_group=G, prefill_buckets=buckets,
                                sampling=sampling, page_size=page_size,
                                num_pages=pages, prefill_batch=2, **kw)
  return Driver(_ENGINES[key], mesh_lib.to_layout(params, layout))


def _assert_same(a, b):
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].tokens == b[k].tokens, k
    assert a[k].finish_reason == b[k].finish_reason, k
    np.testing.assert_allclose(a[k].logp_raw, b[k].logp_raw, atol=1e-5)


@pytest.mark.parametrize("pages", [200, 48], ids=["roomy", "tight"])
def test_paged_equals_static_rows(model, layouts, oracle, pages):
  """Same samples as the static-rows decoder (other layout: 4 replicas x tensor 2,
  each replica its own pool, a quarter of the pages); a tight pool (12
  pages a replica) preempts and recomputes, and every page comes back."""
  driver = (_paged(model, layouts[1], **MAIN) if pages == 200 else
            _paged(model, layouts[1], pages=pages))
  got = {s.key: s for s in driver.run(_requests())}
  _assert_same(got, oracle)
  assert driver.pool.num_free == pages
  assert driver.paged.peak_pages <= pages
  # Groups went to every replica (each within its own block of pages).
  assert driver.pool.per_replica == pages // 4
  assert len(driver.paged.groups_by_replica) == 4
  assert min(driver.paged.groups_by_replica) > 0
  if pages == 48:  # The exhaustion policy really ran.
    assert driver.paged.preemptions > 0
    assert driver.paged.recomputed_tokens > 0
  else:
    assert driver.paged.preemptions == 0


def test_a_groups_prompt_pages_are_read_once_per_step(model, layouts,
                                                      monkeypatch):
  """The prompt-once read, counted where the jnp decode attention reads
  the pool: with 4 groups of G = 4 samples live, a decode step gathers 4
  rows of prompt pages (each live group's once, for all its samples) and
  16 rows of own pages (one per sample), not 16 prompt copies."""
  reads = []

  class _Jnp:  # jnp, with the pool gathers recorded as they are traced.
    def __getattr__(self, name):
      return getattr(jnp, name)

    @staticmethod
    def take(a, ids, *args, **kwargs):
      if a.ndim == 4 and kwargs.get("axis", args[0] if args else None) == 1:
        reads.append(ids.shape)
      return jnp.take(a, ids, *args, **kwargs)

  monkeypatch.setattr(pda, "jnp", _Jnp())
  graphdef, params = model
  sampling = dataclasses.replace(GREEDY, max_new_tokens=6)
  engine = Engine(CFG, graphdef, layouts[0], num_slots=16,
                  samples_per_group=G, prefill_buckets=(16,),
                  sampling=sampling, page_size=4, decode_window=1,
                  attention_impl="xla")
  prompts = [np.arange(6 + i, 18 + i, dtype=np.int32) for i in range(4)]
  out = list(Driver(engine, mesh_lib.to_layout(params, layouts[0])).run(
      [Request(i, p, G) for i, p in enumerate(prompts)]))
  assert len(out) == 4 * G
  # k and v, prompt then own, per layer of the (traced once) decode step.
  assert reads and len(reads) % 4 == 0
  prompt = [r for i, r in enumerate(reads) if i % 4 < 2]
  own = [r for i, r in enumerate(reads) if i % 4 >= 2]
  assert {r[0] for r in prompt} == {4}    # Rows: one per live group.
  # Its prompt pages: 3 of 4 tokens, the bound capped at the table's 4.
  assert {r[1] for r in prompt} == {4}
  assert {r[0] for r in own} == {16}      # Rows: one per live sample.


def test_tpu_kernel_in_the_engine(model, layouts, oracle):
  """The engine with attention_impl="pallas" decodes with the Mosaic
  paged kernel (interpret mode here) under shard_map over tensor 2: the
  static-rows samples, and every page back."""
  driver = _paged(model, layouts[1], pages=40, attention_impl="pallas")
  got = {s.key: s for s in driver.run(_requests(3))}
  _assert_same(got, {k: v for k, v in oracle.items() if k in got})
  assert len(got) == 3 * G and driver.pool.num_free == 40


def test_exhaustion_policy_in_pool_and_driver(model, layouts):
  """All-or-nothing allocation; a prompt whose sample can never fit the
  pool is refused before any work; a pool that fits one sample at a time
  still finishes everything, by preempting the newest sample."""
  pool = PagePool(4, 2)
  pages = pool.allocate(3)
  with pytest.raises(PoolExhausted):
    pool.allocate(2)
  assert pool.num_free == 1  # Nothing was taken by the failed call.
  pool.release(pages[:1])
  assert pool.num_free == 2
  with pytest.raises(ValueError, match="release of free pages"):
    pool.release(pages[:1])  # Twice: a bookkeeping bug, caught.
  pool.release(pages[1:])
  assert pool.num_free == 4

  small = _paged(model, layouts[0], pages=6)  # < prompt + 21 own tokens.
  with pytest.raises(ValueError, match="pool has 6"):
    list(small.run(_requests(2)))
  assert small.stats.prefills == 0
  # 4 pages for a 16-token prompt + 6 for one sample's 21 tokens: with
  # two live samples growing, one must give way.
  one_at_a_time = _paged(model, layouts[0], pages=10, slots=2)
  reqs = [dataclasses.replace(r, max_new_tokens_per_sample=(20,) * G)
          for r in _requests(2)]
  got = {s.key: s for s in one_at_a_time.run(reqs)}
  roomy = {s.key: s for s in _paged(model, layouts[1], **MAIN).run(reqs)}
  _assert_same(got, roomy)
  assert one_at_a_time.paged.preemptions > 0
  assert one_at_a_time.pool.num_free == 10


def test_slot_takes_new_work_before_its_group_ends(model, layouts):
  """Sample-level continuous batching: with 4 slots and groups whose
  samples end at different times, a slot freed by a short sample starts a
  sample of the next group at once. Row-level reuse would need
  max(A) + max(B) = 40 steps; sample-level needs about 22."""
  reqs = [Request(0, np.arange(6, 14, dtype=np.int32), G, seed=1,
                  max_new_tokens_per_sample=(2, 2, 2, 20)),
          Request(1, np.arange(20, 30, dtype=np.int32), G, seed=1,
                  max_new_tokens_per_sample=(20, 2, 2, 2))]
  driver = _paged(model, layouts[0], pages=100, slots=G, sampling=GREEDY)
  got = list(driver.run(reqs))
  assert len(got) == 2 * G
  assert driver.stats.steps < 30, driver.stats.steps
  assert driver.pool.num_free == 100


def test_static_admission_admits_a_new_wave_only_when_all_ended(
    model, layouts, oracle):
  """`admission="static"` (the long-tail baseline): new prompts only while
  no group is admitted, then as many as fit; same samples."""
  driver = _paged(model, layouts[1], **MAIN)
  driver.start(_requests(), admission="static")
  got, waves = {}, []
  while driver.busy:
    before = {g.request.prompt_id for g in driver.groups.values()}
    got.update((s.key, s) for s in driver.step())
    new = {g.request.prompt_id for g in driver.groups.values()} - before
    if new:
      assert not before, (before, new)  # Admitted into an empty engine.
      waves.append(new)
  # 2 slots per replica, G=4: one group per replica (4 of 6) a wave.
  assert waves == [{0, 1, 2, 3}, {4, 5}]
  _assert_same(got, oracle)
  assert driver.pool.num_used == 0


def test_common_prefix(model, layouts, rows_run):
  """A common prefix stored once: same samples as whole prompts."""
  common = np.arange(40, 52, dtype=np.int32)
  reqs = _requests(common=common)
  driver = _paged(model, layouts[1], **MAIN)
  got = {s.key: s for s in driver.run(reqs, common_prefix=common)}
  _assert_same(got, rows_run(reqs))
  assert driver.stats.common_prefix_length == common.size


def test_extend_appends_tokens_to_a_live_sample(model, layouts):
  """Multi-turn: appending tokens to a live sample and decoding on gives
  the greedy continuation of prompt + response + appended tokens (the
  static-rows decoder run on that whole prompt is the oracle)."""
  graphdef, params = model
  layout = layouts[0]
  p = mesh_lib.to_layout(params, layout)
  eng = _paged(model, layout, pages=100, slots=G, sampling=GREEDY).engine
  prompt = np.arange(7, 18, dtype=np.int32)
  state = eng.init_decode_state()
  pre = eng.prefill(p, [(prompt, 0)], [0], [0], [[0]])
  state = eng.insert(state, pre, [1], [[0, 1, 2]], [prompt.size], [0], [0])
  state = eng.start(state, [(3, 1, 0, 0, 20, [3, 4, 5, 6, 7, 8])])
  response = [int(pre.first_tokens[0, 0])]
  state, res = eng.generate(p, state, slots=[3], groups=1, prompt_pages=3,
                            own_pages=6, steps=4)  # One call, 4 tokens.
  host = res.convert_to_numpy()
  response += [int(host.window(j).tokens[3]) for j in range(4)]
  user = [30, 31, 32, 33, 34, 35]
  state, _ = moves.extend(eng, p, state, 3, [3, 4, 5, 6, 7, 8], user)
  after = []
  for _ in range(5):
    state, res = eng.generate(p, state, slots=[3], groups=1,
                              prompt_pages=3, own_pages=6)
    after.append(int(res.convert_to_numpy().window(0).tokens[3]))
  whole = np.concatenate([prompt, response, user]).astype(np.int32)
  rows = StaticRows(CFG, graphdef, p, rows=1, samples_per_row=1, bucket=32,
                    sampling=dataclasses.replace(GREEDY, max_new_tokens=5))
  (want,) = rows.run([Request(0, whole)]).values()
  assert after == want.tokens


def test_worker_continuation(model, layouts, oracle):
  """A driver cut mid-run hands back partials (live and waiting samples)
  and pending requests; continued on another driver as prompt + tokens so
  far, they finish as an uninterrupted run."""
  first = _paged(model, layouts[1], **MAIN)
  first.start(_requests())
  done = []
  for _ in range(6):
    done += first.step()
  partials, pending = first.partials(), list(first.pending)
  assert partials and any(p.tokens for p in partials)
  second = _paged(model, layouts[0], pages=60, slots=6, buckets=(16, 40))
  tails = {s.key: s for s in second.run(
      [continuation.continuation(p) for p in partials] + pending)}
  got = {s.key: s for s in done}
  for p in partials:
    got[p.request.prompt_id, p.sample_idx] = continuation.merge(
        p.request.tokens, p, tails[p.request.prompt_id, p.sample_idx])
  for k, s in tails.items():
    got.setdefault(k, s)
  assert got.keys() == oracle.keys()
  for k in got:
    assert got[k].tokens == oracle[k].tokens, k


def test_rollout_section_builds_the_paged_engine(model, layouts):
  """The job's LocalRollout decodes on the paged engine, sized by the
  rollout section's defaults, with the static-rows samples; config
  errors: test_grpo."""
  from rlhf_jax.config import sections  # pylint: disable=g-import-not-at-top
  from rlhf_jax.rollout import build  # pylint: disable=g-import-not-at-top
  from rlhf_jax.rollout.local import LocalRollout  # pylint: disable=g-import-not-at-top
  graphdef, params = model
  layout = layouts[1]
  reqs = _requests(4)
  ro = sections.Rollout(num_rows=4, samples_per_row=G, prefill_buckets=(16,),
                        max_new_tokens=20, max_seq_len=36, page_size=4)
  engines = build.engines(ro, CFG, graphdef, layout)
  rollout = LocalRollout(engines)
  rollout.set_weights(mesh_lib.to_layout(params, layout), 0)
  got = {s.key: s for s in rollout.run(reqs)}
  eng = engines.engine()
  # Defaults: rows x G slots, and pages for all of them at full length:
  # 4 prompts of 16 tokens (4 pages each), 16 samples of 20 tokens + 1
  # (6 pages each).
  assert (eng.num_slots, eng.num_pages) == (4 * G, 4 * 4 + 16 * 6)
  oracle = StaticRows(CFG, graphdef, mesh_lib.to_layout(params, layouts[0]),
                      rows=2, samples_per_row=G, bucket=16,
                      sampling=engines.sampling)
  _assert_same(got, oracle.run(reqs))


def test_chunked_prefill_of_long_prompts(model, layouts, rows_run):
  """Prompts longer than the largest bucket (16) are prefilled in chunks
  of 16 that attend to the prompt so far: same samples as the static-rows
  decoder prefilling them whole (bucket 48), beside short prompts."""
  rng = np.random.default_rng(4)
  reqs = [Request(i, rng.integers(6, CFG.vocab_size, n).astype(np.int32), G,
                  seed=5, max_new_tokens_per_sample=(12, 3, 20, 7))
          for i, n in enumerate((41, 9, 33, 16))]
  driver = _paged(model, layouts[1], **MAIN)
  got = {s.key: s for s in driver.run(reqs)}
  _assert_same(got, rows_run(reqs))
  assert driver.engine.trace_counts["prompt_chunk"] >= 1
  assert driver.pool.num_free == MAIN["pages"]
  with pytest.raises(ValueError, match="max_prompt_length=48"):
    list(_paged(model, layouts[1], **MAIN).run(
        [Request(9, np.full(49, 7, np.int32), G)]))


def test_generation_demo_samples_the_static_rows_tokens():
  """The README's generation demo (`configs/tiny_generate.py:runlocal`)
  decodes on the paged engine: every prompt's G samples run to
  max_new_tokens (a random model, no stop token) with the tokens of the
  plain-jnp static-rows decoder on the same random weights."""
  from benchmarks.static_rows import StaticRows  # pylint: disable=g-import-not-at-top
  from configs import tiny_generate  # pylint: disable=g-import-not-at-top
  from rlhf_jax import typed_config  # pylint: disable=g-import-not-at-top
  from rlhf_jax.config import sections  # pylint: disable=g-import-not-at-top
  from rlhf_jax.engine.sampling import SamplingParams  # pylint: disable=g-import-not-at-top
  from rlhf_jax.models import model as model_lib  # pylint: disable=g-import-not-at-top
  from rlhf_jax.samples import Request  # pylint: disable=g-import-not-at-top
  from rlhf_jax.trainers import generate  # pylint: disable=g-import-not-at-top
  config = tiny_generate.get_config("runlocal")
  got = {s.key: s for s in generate.run(config, "")}
  ro = typed_config.from_dict(sections.Rollout, config.rollout, "rollout")
  cfg = typed_config.from_dict(sections.Model, config.model,
                           "model").model_config()
  graphdef, params = model_lib.init_params(cfg, config.seed)
  rng = np.random.default_rng(config.seed)
  G = ro.samples_per_row
  requests = [Request(i, rng.integers(0, cfg.vocab_size, config.prompt_len),
                      G, seed=config.seed) for i in range(config.num_prompts)]
  oracle = StaticRows(cfg, graphdef, params, rows=2, samples_per_row=G,
                      bucket=max(ro.prefill_buckets),
                      sampling=SamplingParams(
                          temperature=ro.temperature, top_k=ro.top_k,
                          top_p=ro.top_p, max_new_tokens=ro.max_new_tokens)
                      ).run(requests)
  assert len(got) == config.num_prompts * G
  assert all(len(s.tokens) == ro.max_new_tokens for s in got.values())
  assert {k: s.tokens for k, s in got.items()} == {
      k: s.tokens for k, s in oracle.items()}
