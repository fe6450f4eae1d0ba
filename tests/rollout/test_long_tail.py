"""Long-tail rollout on 8 devices: consolidation (KV move or re-prefill),
fusion and length-aware assignment change where and when samples decode,
never their tokens; nothing is lost or duplicated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fakes
from rlhf_jax.config.sections import LongTail
from benchmarks.static_rows import StaticRows
from rlhf_jax.samples import Request
from rlhf_jax.engine import moves
from rlhf_jax.engine.engine_set import EngineSet
from rlhf_jax.engine.long_tail import TailController
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import model as model_lib
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.rollout.local import LocalRollout
from rlhf_jax.sched import continuous
from rlhf_jax.sched.length_history import LengthHistory
from rlhf_jax.sim import rows

CFG = fakes.TINY_CFG
M = 12
SAMPLING = SamplingParams(temperature=1.0, top_k=40, max_new_tokens=M)
G, RPR = 2, 1
BUCKETS = (8, 8 + M)  # The long bucket lets a sample be re-prefilled.
# 8 replicas: 2 slots (one group of G) and a pool of 8 pages of 4 each.
PAGED = dict(page_size=4, num_pages=64, num_slots=16)


def _requests(n=20):
  rng = np.random.default_rng(0)
  out = []
  for p in range(n):
    # Long-tailed budgets: most samples short, every 6th prompt runs to M.
    budgets = tuple(int(x) for x in rng.integers(1, 4, G))
    if p % 6 == 5:
      budgets = (M,) + budgets[1:]
    out.append(Request(p, rng.integers(6, 64, int(rng.integers(2, 8))),
                       num_samples=G, seed=7,
                       max_new_tokens_per_sample=budgets))
  return out


class _Scorer:
  """Device passes (`ScoringPasses`' interface): the largest logit of each
  sequence under the model (a real forward), compiled inline, weights
  that take no room."""

  def __init__(self, graphdef, params):
    self.graphdef, self.params, self.placed = graphdef, params, {}

  def compile(self, samples, layout):
    del samples, layout
    return []  # Nothing compiling: `score` compiles inline.

  def bytes_per_device(self, layout):
    del layout
    return 0

  def score(self, samples, layout):
    if layout not in self.placed:
      self.placed[layout] = jax.device_put(
          self.params, layout.param_shardings(self.params))
    T = 8 + M
    toks = np.zeros((len(samples), T), np.int32)
    for i, s in enumerate(samples):
      seq = np.concatenate([s.prompt_tokens, s.tokens])[:T]
      toks[i, :seq.size] = seq
    toks = jax.device_put(toks, layout.replicated())
    return _score_jit(self.graphdef, self.placed[layout], toks)


def _fused_run(lt, requests, passes):
  """(samples, scores by key) of `lt.run` with `passes` fused into its
  tail (`scoring/fused.FusedScoring`)."""
  from rlhf_jax.scoring.fused import FusedScoring
  fused = FusedScoring(passes, lt.tail)
  return list(lt.run(requests, freed=fused)), fused.scores


@jax.jit(static_argnums=0)
def _score_jit(graphdef, params, toks_BxT):
  T = toks_BxT.shape[1]
  pos = jnp.broadcast_to(jnp.arange(T), toks_BxT.shape)
  logits = model_lib.forward(graphdef, params, toks_BxT, pos, toks_BxT > 0)
  return jnp.max(logits, axis=(1, 2))


@pytest.fixture(scope="module")
def setup(mesh8):
  del mesh8
  mesh = mesh_lib.make_mesh(fsdp=8)
  layout = mesh_lib.rollout_layout(mesh, 1)
  graphdef, params = model_lib.init_params(CFG, 0, mesh_lib.train_layout(mesh))
  params = jax.device_put(params, layout.param_shardings(params))
  # The oracle: the plain-jnp static-rows decoder (nothing moved, paged or
  # scheduled), one row of G samples a replica.
  plain = StaticRows(CFG, graphdef, params, rows=8 * RPR, samples_per_row=G,
                     bucket=BUCKETS[0], sampling=SAMPLING).run(_requests())
  return graphdef, layout, params, plain


def _rollout(setup, history=None, paged=PAGED, **tail) -> LocalRollout:
  graphdef, layout, params, _ = setup
  engines = EngineSet(CFG, graphdef, layout, rows_per_replica=RPR,
                      samples_per_row=G, prefill_buckets=BUCKETS,
                      sampling=SAMPLING, paged=paged)
  lt = LocalRollout(engines, tail=LongTail(enabled=True, **tail),
                    history=history)
  lt.set_weights(params, 0)
  return lt


def _run(setup, paged=PAGED, known=True, **tail):
  """(samples, device scores, metrics) of the long-tail rollout; `known`:
  the lengths are predicted from an earlier epoch (else all M / 2)."""
  history = LengthHistory(0.5)
  for r in _requests() if known else ():  # An earlier epoch's lengths.
    history.update(r.prompt_id, list(r.max_new_tokens_per_sample))
  lt = _rollout(setup, history, paged, **tail)
  samples, scores = _fused_run(lt, _requests(), _Scorer(setup[0], setup[2]))
  return samples, scores, lt.metrics()


def _assert_same(samples, scores, plain):
  keys = [s.key for s in samples]
  assert len(keys) == len(set(keys)) == len(plain)  # None lost or doubled.
  for s in samples:
    want = plain[s.key]
    assert s.tokens == want.tokens, s.key
    np.testing.assert_allclose(s.logp_raw, want.logp_raw, atol=1e-5)
  assert set(scores) == set(plain)


@pytest.mark.parametrize("migration,assignment",
                         [("kv", "fifo"), ("reprefill", "length"),
                          ("auto", "fifo")])
def test_consolidation_keeps_tokens(setup, migration, assignment):
  """The long tail on 8 replicas (pools of 8 pages each): groups on the
  dropped replicas move onto the kept ones, their pages ("kv"), a
  re-prefill and recompute, or either by the sample's tokens so far
  ("auto", re-prefill up to 2); the static-rows decoder's tokens, every
  sample once, scores for all in several chunks, and every page back (the
  driver checks)."""
  samples, scores, st = _run(
      setup, consolidate_below=0.5, migration=migration, score_chunk=4,
      assignment=assignment, reprefill_max_tokens=2)
  assert st["rollout/consolidated_replicas"] < 8
  assert st["rollout/consolidations"] >= 1
  assert st["rollout/tail_moves"] > 0
  if migration == "kv":
    assert st["rollout/moved_bytes"] > 0
    assert st["rollout/reprefilled"] < st["rollout/tail_moves"]
  elif migration == "reprefill":
    assert st["rollout/reprefilled"] == st["rollout/tail_moves"]
    assert st["rollout/moved_bytes"] == 0
  assert st["rollout/scoring_chunks"] >= 2
  _assert_same(samples, scores, setup[3])


def test_budgets_force_the_lengths(setup):
  plain = setup[3]
  by_key = {(r.prompt_id, i): b for r in _requests()
            for i, b in enumerate(r.max_new_tokens_per_sample)}
  assert sorted(plain) == sorted(by_key)
  # No stop tokens in SAMPLING: every sample runs to exactly its budget.
  assert SAMPLING.stop_tokens == ()
  for key, s in plain.items():
    assert (len(s.tokens), s.finish_reason) == (by_key[key], "length"), key


def test_scoring_chunks_go_out_after_a_decode_step(setup, monkeypatch):
  """While the tail decodes, a chunk is dispatched only right after a
  decode step is (its host work hides behind the device's step): never
  as a sample finishes, nor as a consolidation ends."""
  events = []

  def logged(name, fn):
    def call(*args, **kwargs):
      events.append(name)  # On entry: what `fn` dispatches comes after.
      return fn(*args, **kwargs)
    return call

  monkeypatch.setattr(Engine, "generate",
                      logged("generate", Engine.generate))
  for name in ("finished", "_switched"):
    monkeypatch.setattr(TailController, name,
                        logged(name, getattr(TailController, name)))
  scorer = _Scorer(setup[0], setup[2])
  monkeypatch.setattr(scorer, "score", logged("score", scorer.score))
  history = LengthHistory(0.5)
  for r in _requests():
    history.update(r.prompt_id, list(r.max_new_tokens_per_sample))
  lt = _rollout(setup, history, consolidate_below=0.5, score_chunk=2)
  samples, scores = _fused_run(lt, _requests(), scorer)
  _assert_same(samples, scores, setup[3])
  # Up to the last sample's finish: the decode (then `flush` scores the
  # rest on every replica).
  decoding = events[:len(events) - events[::-1].index("finished")]
  assert "_switched" in decoding and "score" in decoding, events
  for i, e in enumerate(decoding):
    if e == "score":  # Its decode step (or that step's other chunks).
      assert decoding[i - 1] in ("generate", "score"), decoding[:i + 1]


def test_a_chunk_waits_for_its_compile_while_the_tail_decodes(
    setup, monkeypatch):
  """[fuse] A chunk whose scoring programs are not compiled yet waits while
  they compile on a background thread (slowed here by 0.3 s each), and the
  tail's decode steps go on meanwhile. The log-probs equal the sampler's,
  as in the same rollout with every program compiled inline as its chunk
  goes out."""
  import threading
  import time

  from rlhf_jax.scoring import passes as scoring_passes

  compiles, steps = [], []
  real_compile, real_generate = scoring_passes._compile, Engine.generate

  def slow_compile(*args):
    start = time.perf_counter()
    time.sleep(0.3)
    out = real_compile(*args)
    if threading.current_thread() is not threading.main_thread():
      compiles.append((start, time.perf_counter()))
    return out

  def timed_generate(*args, **kwargs):
    steps.append(time.perf_counter())
    return real_generate(*args, **kwargs)

  requests = _requests(8)  # One row each: the tail starts early.
  history = LengthHistory(0.5)
  for r in requests:
    history.update(r.prompt_id, list(r.max_new_tokens_per_sample))
  lt = _rollout(setup, history, consolidate_below=1.0, score_chunk=2)
  _fused_run(lt, requests, _Scorer(setup[0], setup[2]))  # Warm.
  scores, waits = {}, {}
  for ahead in (True, False):
    passes = scoring_passes.ScoringPasses(setup[0], prompt_len=8, max_new=M,
                                          with_ref=False)
    if not ahead:  # Nothing compiles ahead: each chunk inline, at once.
      passes.compile = lambda chunk, layout: []
    monkeypatch.setattr(scoring_passes, "_compile", slow_compile)
    monkeypatch.setattr(Engine, "generate", timed_generate)
    passes.begin(policy=setup[2])
    samples, scores[ahead] = _fused_run(lt, requests, passes)
    passes.end()
    monkeypatch.undo()
    assert len({s.key for s in samples}) == len(samples) == 8 * G
    assert set(scores[ahead]) == {s.key for s in samples}
    for s in samples:
      assert s.tokens == setup[3][s.key].tokens, s.key
    waits[ahead] = lt.metrics()[
        "rollout/scoring_compile_waits"]
    if ahead:  # Decode steps while a background compile ran.
      assert any(a < t < b for a, b in compiles for t in steps), (compiles,
                                                                   steps)
      background = len(compiles)
  assert waits[True] >= 1 and waits[False] == 0
  assert len(compiles) == background  # The inline run compiled inline.
  for s in samples:  # Each token's log-prob, as the sampler computed it.
    n = len(s.tokens)
    for ahead in (True, False):
      np.testing.assert_allclose(scores[ahead][s.key]["old_logp"][:n],
                                 s.logp_raw[:n], atol=1e-5, err_msg=s.key)


def test_without_room_on_the_freed_replicas_samples_wait_for_the_end(
    setup, monkeypatch):
  """[fuse] The room check's two sides are the bytes devices hold: the
  reference placed on a replica, and a replica's share of the page
  pool. When the freed replicas cannot hold the scoring weights (here a
  budget of 0 bytes), no chunk goes out while the tail decodes; every
  sample is scored at the end, with the sampler's log-probs."""
  from rlhf_jax.scoring import passes as scoring_passes

  graphdef, layout, params, plain = setup
  engines = _rollout(setup).engines
  state = engines.engine().init_decode_state()
  on_device0 = sum(shard.data.nbytes for x in (state.k_pages, state.v_pages)
                   for shard in x.addressable_shards
                   if shard.device == jax.devices()[0])
  assert engines.kv_bytes_per_device() == on_device0  # Its share of pages.
  passes = scoring_passes.ScoringPasses(graphdef, prompt_len=8, max_new=M)
  passes.begin(policy=params, ref=params)
  placed = jax.device_put(params, layout.param_shardings(params))
  assert passes.bytes_per_device(layout) == sum(  # The reference's alone.
      shard.data.nbytes for x in jax.tree.leaves(placed)
      for shard in x.addressable_shards if shard.device == jax.devices()[0])

  events = []
  score = passes.score
  monkeypatch.setattr(passes, "score", lambda *a: events.append("score") or
                      score(*a))
  monkeypatch.setattr(EngineSet, "kv_bytes_per_device", lambda self: 0)
  history = LengthHistory(0.5)
  requests = _requests(8)
  for r in requests:
    history.update(r.prompt_id, list(r.max_new_tokens_per_sample))
  lt = _rollout(setup, history, consolidate_below=1.0, score_chunk=2)
  from rlhf_jax.scoring.fused import FusedScoring
  fused = FusedScoring(passes, lt.tail)
  samples = []
  for sample in lt.run(requests, freed=fused):
    events.append("finished")
    samples.append(sample)
  passes.end()
  st = lt.metrics()
  assert st["rollout/consolidations"] >= 1
  assert st["rollout/scoring_waited_for_room"] == 1.0
  assert events.index("score") > len(events) - 1 - events[::-1].index(
      "finished"), events
  assert set(fused.scores) == {s.key for s in samples}
  for s in samples:
    n = len(s.tokens)
    assert s.tokens == plain[s.key].tokens
    for name in ("old_logp", "ref_logp"):
      np.testing.assert_allclose(fused.scores[s.key][name][:n],
                                 s.logp_raw[:n],
                                 atol=1e-5, err_msg=(s.key, name))


def test_a_move_reads_only_the_moving_pages(setup):
  """A consolidation's move (`moves.gather_kv`, then `insert` / `place`
  on the kept replicas) holds, on a device, its share of the page pool and
  the moving groups' pages (gathered, then laid out dense; replicated:
  every kept replica may take one), never a gather of the whole pool; the
  gathered KV equals the pages it read."""
  graphdef, layout = setup[0], setup[1]
  engines = EngineSet(CFG, graphdef, layout, rows_per_replica=4,
                      samples_per_row=G, prefill_buckets=BUCKETS,
                      sampling=SAMPLING, paged=dict(page_size=4))
  engine = engines.engine()
  state = engine.init_decode_state()
  # Page p of the pool holds the value p (every layer, head, token).
  pool = jnp.arange(engine.num_pages, dtype=state.k_pages.dtype)
  state = state.replace(k_pages=state.k_pages + pool[None, None, :, None,
                                                    None])
  device0 = jax.devices()[0]
  share = sum(sh.data.nbytes for x in (state.k_pages, state.v_pages)
              for sh in x.addressable_shards if sh.device == device0)
  # Two groups' pages on replicas 5 and 7 (pages split in equal blocks).
  per = engine.num_pages // engine.replicas
  lists = [[5 * per + 1, 5 * per + 2], [7 * per, 7 * per + 3]]
  rows = np.array(lists, np.int32)
  m = engine._gather_jit.lower(state, rows).compile().memory_analysis()  # pylint: disable=protected-access
  held = (m.argument_size_in_bytes + m.output_size_in_bytes
          - m.alias_size_in_bytes + m.temp_size_in_bytes)
  moving = rows.size * engine.page_bytes  # K and V of the 4 pages.
  # The gathered pages and their dense copy (a transpose), beside the pool.
  assert held <= (share + 2 * moving) * 1.01 + 4096, (held, share, moving)
  assert held < 2 * share  # Far from a gather of the whole pool.
  k, v = moves.gather_kv(engine, state, lists)
  T = engine.page_size
  want = np.repeat(np.array(lists, np.float32), T, axis=1)  # [X, A*T]
  np.testing.assert_array_equal(np.asarray(k)[0, :, :, 0, 0], want)
  assert not np.asarray(v).any()


def test_static_and_fifo_keep_tokens(setup):
  samples, scores, st = _run(setup, admission="static", assignment="fifo",
                             consolidate_below=0.0, fusion=False)
  assert st["rollout/consolidated_replicas"] == 8
  _assert_same(samples, scores, setup[3])
  # The row simulator replays the same trace in the same number of steps.
  trace = np.array([r.max_new_tokens_per_sample for r in _requests()])
  sim = rows.simulate(trace, replicas=8, rows_per_replica=RPR,
                      policy="static", costs=rows.UnitCosts(
                          {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}, 0.0, 0.0))
  assert sim.steps == st["rollout/steps"]


def test_rlhfless_assignment_releases_replicas_and_keeps_tokens(setup):
  """RLHFless: each replica decodes its own run of prompts (no length
  history: runs in prompt order), a group is admitted onto its own replica
  only, and the block shrinks from its end as the last replica is done or
  cuts at tau (its groups move by their pages); the static-rows tokens,
  every sample once, every page back (the driver checks)."""
  samples, scores, st = _run(
      setup, assignment="grouped", cut_tau=0.5, consolidate_below=0.0,
      score_chunk=4, known=False)
  assert st["rollout/releases"] >= 4
  assert st["rollout/consolidations"] == 0
  assert st["rollout/consolidated_replicas"] == 8 - st["rollout/releases"]
  assert st["rollout/tail_moves"] > 0  # A cut moved groups.
  _assert_same(samples, scores, setup[3])


def test_rlhfless_admission_and_release_rules():
  """Oracle by hand: the replicas of five prompts on two replicas (equal
  predicted tokens a side, the longest on replica 0), the admission of a
  free row's own prompts only, and when the last replica may leave."""
  from rlhf_jax.sched import assignment, tail
  assert assignment.replica_of([10, 1, 9, 2, 8], 2) == [0, 1, 0, 1, 1]
  # Free rows 2, 3 (replica 1 of 2 rows each); pending: replicas 0, 1.
  assert tail.grouped_admission([3, 2], [0, 1], 2) == (1, 2)
  assert tail.grouped_admission([0], [1, 1], 2) is None
  # The last replica: 4 samples admitted, `unfinished` of them not done.
  due = dict(replicas=2, queued=0, assigned=4, tau=0.75, fits=True)
  assert tail.release_due(1, **due)  # 3 of 4 done, and it fits.
  assert not tail.release_due(1, **{**due, "queued": 1})
  assert not tail.release_due(2, **due)  # 0.5 < tau.
  assert not tail.release_due(1, **{**due, "fits": False})
  assert tail.release_due(0, **{**due, "assigned": 0, "fits": False})  # Done.
  assert not tail.release_due(1, **{**due, "replicas": 1})
  # Rows 0-1 on replica 0, 2-3 on the last; row -> samples decoding.
  rows_of = dict(replicas=2, rows_per_replica=2)
  assert tail.last_replica_rows({0: 2, 2: 1}, **rows_of) == (1, True)
  assert tail.last_replica_rows({0: 2, 1: 2, 2: 1}, **rows_of) == (1, False)
  assert tail.last_replica_rows({0: 2, 1: 2}, **rows_of) == (0, True)


def test_cost_aware_replica_count(setup):
  graphdef, _, params, plain = setup
  lt = _rollout(setup, replicas="cost", cost_lambda=0.0)
  lt.step_s = {m: 0.01 for m in lt.engines.sizes}  # Equal cost: fewest.
  samples, scores = _fused_run(lt, _requests(), _Scorer(graphdef, params))
  assert lt.metrics()["rollout/replicas"] == 1
  _assert_same(samples, scores, plain)


def test_choose_replicas_trades_latency_for_cost():
  lengths = [[10.0, 2.0]] * 8
  step = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
  fast, info = continuous.choose_replicas(lengths, [1, 2, 4, 8], 1, step, 1.0)
  cheap, _ = continuous.choose_replicas(lengths, [1, 2, 4, 8], 1, step, 0.0)
  assert fast == 8 and cheap == 1
  assert info["table"][8][0] == 10.0 and info["table"][1][0] == 80.0
  assert continuous.decode_steps([5, 3, 3, 1], 2) == 6.0


@pytest.mark.slow
def test_grpo_step_with_long_tail_matches_plain(tiny_grpo_job):
  """One GRPO step on 8 devices: the long-tail rollout (consolidation,
  assignment; rewards scored as groups finish) gives the plain step's
  samples and numbers."""
  job = tiny_grpo_job({
      # R_t = 1: consolidate as soon as the 8 rows fit 4 replicas (the
      # untrained policy answers in ~4 tokens: no natural tail here).
      "rollout.long_tail.enabled": True,
      "rollout.long_tail.consolidate_below": 1.0,
      # 2 rows per replica: 8 prompts fit 4 replicas.
      "rollout.num_rows": 16})
  assert job.sampler.tail.enabled
  prompts = next(job.iterator)
  _, plain = fakes.first_step(job, prompts, fakes.local_rollout(job))
  _, ours = fakes.first_step(job, prompts)
  for k in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss",
            "train/grad_norm", "train/kl"):
    np.testing.assert_allclose(ours[k], plain[k], rtol=1e-6, err_msg=k)
  for k in plain:
    if k.startswith("rewards/"):
      np.testing.assert_allclose(ours[k], plain[k], rtol=1e-6, err_msg=k)
  assert ours["rollout/consolidated_replicas"] < 8
  assert ours["rollout/consolidations"] >= 1
  # The history learned this step's lengths (it is checkpointed by the loop).
  history = job.sampler.length_history
  assert all(history.known(int(p)) for p in prompts.prompt_ids)


def test_length_history_survives_checkpoint_json():
  import json
  h = LengthHistory(0.25)
  h.update(3, [4, 8])
  h.update(3, [2])
  restored = LengthHistory(0.5)
  restored.load_state_dict(json.loads(json.dumps(h.state_dict())))
  assert restored.alpha == 0.25
  assert restored.predict(3, 0.0) == h.predict(3, 0.0) == 0.25 * 2 + 0.75 * 6


@pytest.mark.parametrize("key,value,match", [
    ("migration", "teleport", "migration"),
    ("consolidate_below", 1.5, "consolidate_below"),
    ("replicas", "most", "replicas")])
def test_long_tail_config_errors_name_the_key(key, value, match):
  from configs import tiny_grpo
  from rlhf_jax.config.sections import ConfigError, RLJob

  c = tiny_grpo.get_config("runlocal")
  c.rollout.long_tail.update(enabled=True, **{key: value})
  with pytest.raises(ConfigError, match=f"config.rollout.long_tail.{match}="):
    RLJob.from_config(c)
