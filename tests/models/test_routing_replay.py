"""Rollout routing replay ([r3]) on a tiny Qwen3-MoE: the forward routes
tokens to recorded experts (against transformers with forced routers), the
paged engine records what it routed, the trainer's log-probs replay it, and
replay cuts a bf16 rollout copy's mismatch; the dense policy is refused.
(The runlocal job with replay: tests/models/test_moe.py.)"""

import numpy as np
import pytest

import jax
from flax import nnx

from moe_cases import E, K, V, torch, torch_reference
from moe_cases import batch as _batch
from moe_cases import checkpoint as _checkpoint
from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.engine_set import EngineSet
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import hf
from rlhf_jax.models import model as model_lib
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.parallel.layout import use_layout
from rlhf_jax.samples import Request


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return _checkpoint(str(tmp_path_factory.mktemp("qwen3_moe")))


def _forced_router(router, replay_NxK):
  """transformers' `Qwen3MoeTopKRouter.forward` with each token whose row
  of `replay_NxK` has no -1 sent to those experts, weighted by its router
  probabilities of them, renormalised: the oracle of routing replay."""
  def forward(hidden_states):
    h = hidden_states.reshape(-1, router.hidden_dim)
    logits = torch.nn.functional.linear(h, router.weight)
    probs = torch.softmax(logits.float(), dim=-1)
    _, top = torch.topk(probs, router.top_k, dim=-1)
    forced = torch.tensor(replay_NxK, dtype=torch.long)
    ids = torch.where((forced >= 0).all(-1, keepdim=True), forced, top)
    w = probs.gather(-1, ids)
    return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), ids
  return forward


def test_routing_replay_routes_tokens_to_the_recorded_experts(checkpoint):
  """Rollout routing replay ([r3]) on EP 2 (8 devices): with recorded
  experts for every (token, layer), random sets with a few tokens left
  unrecorded (-1: their own top k), the logits and the router's and
  experts' gradients equal transformers' with its routers forced to those
  experts (torch autograd: gradients reach the router through the
  replayed experts' weights); the router statistics count the replayed
  tokens and those whose own top k differs (numpy on transformers' router
  logits); replaying a forward's own choices changes no logit."""
  model, path = checkpoint
  tokens, positions, mask = _batch(seed=5)
  B, T = tokens.shape
  L = model.config.num_hidden_layers
  rng = np.random.default_rng(6)
  replay = np.stack([rng.permutation(E)[:K] for _ in range(B * T * L)]
                    ).reshape(B, T, L, K).astype(np.int32)
  replay[0, :3] = -1
  replay[1, 2, 1] = -1
  weights = rng.normal(size=tokens.shape + (V,)).astype(np.float32)
  _, _, own_logits, _ = torch_reference(model, tokens, mask, weights)
  own = np.stack([np.argsort(-r, -1)[:, :K] for r in own_logits], 1
                 ).reshape(B, T, L, K).astype(np.int32)
  for i, layer in enumerate(model.model.layers):
    layer.mlp.gate.forward = _forced_router(layer.mlp.gate,
                                            replay[:, :, i].reshape(-1, K))
  try:
    ref, _, router_logits, ref_grads = torch_reference(model, tokens, mask,
                                                        weights)
  finally:
    for layer in model.model.layers:
      del layer.mlp.gate.forward  # The class's forward again.

  layout = mesh_lib.train_layout(mesh_lib.make_mesh(fsdp=-1, expert=2))
  _, graphdef, params = hf.load(path, layout=layout)

  def loss(p, replay):
    logits, stats = model_lib.forward(graphdef, p, tokens, positions, mask,
                                      router_stats=True,
                                      replay_BxTxLxK=replay)
    return (logits * weights * mask[..., None]).sum(), (logits, stats)

  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  with use_layout(layout):
    (_, (logits, stats)), grads = step(params, replay)
    (_, (own_replayed, _)), _ = step(params, own)
    (_, (plain, _)), _ = step(params, np.full_like(own, -1))
  np.testing.assert_allclose(np.asarray(logits)[mask], ref[mask], atol=1e-5,
                             rtol=0)
  flat = dict(nnx.to_flat_state(grads))
  for name, want in ref_grads.items():
    got = np.asarray(flat[("blocks", "mlp", name)].get_value())
    assert np.abs(want).max() > 1e-2, name
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(),
                               err_msg=name)
  np.testing.assert_allclose(np.asarray(own_replayed)[mask],
                             np.asarray(plain)[mask], atol=1e-6, rtol=0)
  assert np.abs(np.asarray(plain) - np.asarray(logits))[mask].max() > 1e-2
  real = mask.reshape(-1)
  for i, r in enumerate(router_logits):
    recorded = (replay[:, :, i] >= 0).all(-1).reshape(-1) & real
    mine = np.sort(np.argsort(-r, -1)[:, :K], -1)
    differ = (mine != np.sort(replay[:, :, i].reshape(-1, K), -1)).any(-1)
    assert float(stats["replayed"][i]) == recorded.sum(), i
    assert float(stats["flipped"][i]) == (recorded & differ).sum() > 0, i


@pytest.fixture(scope="module")
def recorded(checkpoint, mesh8):
  """Samples of `Engine(record_routes=True)` on 4 replicas x EP 2: 3
  prompts, 2 sampled responses each."""
  model, path = checkpoint
  layout = mesh_lib.rollout_layout(mesh8, expert=2)
  cfg, graphdef, params = hf.load(path, layout=layout)
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, V, n).astype(np.int32) for n in (6, 3, 8)]
  engines = EngineSet(cfg, graphdef, layout, rows_per_replica=1,
                      samples_per_row=2, prefill_buckets=(8,),
                      # Four stop tokens: lengths vary (async RL's
                      # switches then cut samples mid-response).
                      sampling=SamplingParams(temperature=1.0,
                                              max_new_tokens=10,
                                              stop_tokens=(0, 1, 2, 3)),
                      record_routes=True,
                      paged=dict(num_slots=4, page_size=4, num_pages=64))
  engine = engines.engine()
  requests = [Request(i, p, num_samples=2) for i, p in enumerate(prompts)]
  samples = list(Driver(engine, params).run(requests))
  # The engines, weights and requests too: tests cut the run midway.
  return cfg, sorted(samples, key=lambda s: s.key), (engine, params,
                                                     requests, engines)


def test_recorded_routes_survive_a_continuation_on_a_new_driver(recorded):
  """A run cut after 3 steps and continued on a new driver (the host state
  `engine/restart.py` hands over: what async RL and a worker's
  continuation do, the KV recomputed) ends with the tokens and the
  recorded experts of the uninterrupted run."""
  from rlhf_jax.engine import restart

  _, whole, (engine, params, requests, _) = recorded
  first = Driver(engine, params)
  first.start(requests)
  out = []
  for _ in range(3):
    out += first.step()
  out += restart.drain(first)
  partials, pending = restart.unfinished(first)
  assert any(len(p.tokens) > 1 for p in partials)  # Cut mid-response.
  second = Driver(engine, params)
  second.start(pending)
  restart.readmit(second, partials)
  while second.busy:
    out += second.step()
  assert sorted(s.key for s in out) == [s.key for s in whole]
  for s, want in zip(sorted(out, key=lambda s: s.key), whole):
    assert s.tokens == want.tokens, s.key
    np.testing.assert_array_equal(s.prompt_routes, want.prompt_routes)
    np.testing.assert_array_equal(s.routes, want.routes, err_msg=str(s.key))


def _top_k_routes(model, seq):
  """transformers' top-k experts of every token of `seq` in each layer,
  sorted: [T, L, K] (one forward, causal: row t sees tokens <= t)."""
  with torch.no_grad():
    out = model(input_ids=torch.tensor(np.asarray(seq, np.int64)[None]),
                output_router_logits=True)
  return np.stack([np.sort(np.argsort(-r.numpy(), -1)[:, :K], -1)
                   for r in out.router_logits], 1)


def _assert_records_are_top_k(model, samples):
  """Each sample's prompt and fed tokens recorded transformers' top k of
  its whole sequence (one set of weights)."""
  for s in samples:
    P = len(s.prompt_tokens)
    want = _top_k_routes(model, np.concatenate([s.prompt_tokens,
                                                s.tokens[:-1]]))
    np.testing.assert_array_equal(np.sort(s.prompt_routes, -1), want[:P])
    np.testing.assert_array_equal(np.sort(s.routes, -1), want[P:],
                                  err_msg=str((s.key, s.tokens)))


ASYNC_STEPS = 4


def _async_prompts(first: int):
  """Batch b's prompts for b = first, first + 1, ...: 2 of 3-8 tokens."""
  from rlhf_jax.samples import PromptBatch
  b = first
  while True:
    rng = np.random.default_rng(100 + b)
    lengths = rng.integers(3, 9, 2).astype(np.int32)
    tokens = np.zeros((2, 8), np.int32)
    for i, n in enumerate(lengths):
      tokens[i, :n] = rng.integers(0, V, n)
    yield PromptBatch(np.array([2 * b, 2 * b + 1], np.int32), tokens,
                      lengths, ["", ""], [{}, {}])
    b += 1


def _async_batches(backend, weights, *, resume=None, snapshot_at=None):
  """{step: batch} of async RL's rollout on `backend` (eta 1, KV
  recomputed at each switch) driven as `step_rollouts.Asynchronous` drives
  it: version v's weights are `weights[v]`; `snapshot_at`: also the
  snapshot taken at the switch to that version, through JSON as a
  checkpoint holds it; `resume`: (version, snapshot) to start from."""
  import json
  from rlhf_jax.rollout.asynchronous import AsyncRollout
  version, snap = resume or (0, None)
  first = snap["next_batch"] if snap else 1
  ar = AsyncRollout(backend, _async_prompts(first),
                    num_samples=2, seed=3, eta=1, switch_after_groups=1,
                    in_flight="continue", last_step=ASYNC_STEPS)
  ar.start(weights[version], version, first_step=version + 1, snapshot=snap)
  batches, taken = {}, None
  try:
    for step in range(version + 1, ASYNC_STEPS + 1):
      if step - 1 > version:
        ar.publish(weights[step - 1], step - 1)
        version = step - 1
      batches[step] = ar.take(step)
      if step == snapshot_at:
        taken = json.loads(json.dumps(ar.publish(weights[step], step,
                                                 snapshot=True)))
        ar.release()
        version = step
  finally:
    ar.close()
  return batches, taken


class _Dying:
  """A worker handle that stops answering after `polls` polls: a spot
  preemption (`workers/manager.LocalHandle`'s interface)."""

  def __init__(self, worker, polls):
    from rlhf_jax.workers import manager as manager_lib
    self.handle = manager_lib.LocalHandle(worker)
    self.worker_id, self.polls = worker.worker_id, polls

  alive = property(lambda self: self.handle.alive,
                   lambda self, v: setattr(self.handle, "alive", v))
  timeout_s = float("inf")

  def call_async(self, name, *args):
    if name == "poll":
      self.polls -= 1
      self.handle.alive = self.handle.alive and self.polls >= 0
    return self.handle.call_async(name, *args)

  def done(self, future):
    return self.handle.done(future)

  def result(self, future):
    return self.handle.result(future)

  def kill(self):
    self.handle.kill()


@pytest.fixture(scope="module")
def moe_workers(recorded):
  """Two elastic workers (`workers/worker.py`, one device each) of the
  tiny MoE that record the experts."""
  from rlhf_jax.workers.worker import EngineSpec, RolloutWorker
  cfg = recorded[0]
  spec = EngineSpec(cfg, num_rows=2, samples_per_row=2,
                    prefill_buckets=(8, 18),  # Continuations: + 10 tokens.
                    sampling=recorded[2][3].sampling,
                    paged=dict(page_size=4, decode_window=1),
                    record_routes=True)
  return [RolloutWorker(f"moe{i}", spec, devices=[d])
          for i, d in enumerate(jax.devices()[6:8])]


def _backend(kind, recorded, moe_workers, *, preempt: bool):
  """Async RL's decoding on the paged engines or on the two workers (the
  first dies mid-response with `preempt`: its samples continue on the
  other as prompt + tokens so far)."""
  from rlhf_jax.rollout.async_workers import WorkerBackend
  from rlhf_jax.rollout.asynchronous import PagedBackend
  from rlhf_jax.workers import manager as manager_lib
  from rlhf_jax.workers.weights import LocalWeightStore
  if kind == "paged":
    return PagedBackend(recorded[2][3])
  mgr = manager_lib.RolloutManager(LocalWeightStore(), max_new_tokens=10,
                                   theta=1, poll_steps=2)
  for w in moe_workers:
    w.unload()
  mgr.add(_Dying(moe_workers[0], polls=3) if preempt
          else manager_lib.LocalHandle(moe_workers[0]))
  mgr.add(manager_lib.LocalHandle(moe_workers[1]))
  return WorkerBackend(mgr)


@pytest.mark.parametrize("kind", ["paged", "workers"])
def test_recorded_routes_survive_async_carry_over_and_resume(
    tmp_path, recorded, request, kind):
  """Async RL's rollout (`rollout/asynchronous.py`) with recorded experts,
  each weight version a different tiny MoE, on the paged engines or on
  two elastic workers (one preempted mid-response): at every switch, and
  at the preemption, the unfinished samples carry their records to where
  they continue, so each fed token's experts are transformers' top k under
  the weights that fed it (the version of the token it drew: its KV all of
  that version, recomputed at the switch) and each sample's prompt experts
  are those of its newest prefill (under its newest token's version); a
  run resumed from the snapshot at version 2 (through JSON) delivers the
  uninterrupted run's tokens and records."""
  cfg, _, (_, _, _, engines) = recorded
  workers = request.getfixturevalue("moe_workers") if kind == "workers" else None
  models, weights = [], []
  for v in range(ASYNC_STEPS):
    model, path = _checkpoint(str(tmp_path / f"v{v}"), seed=v)
    models.append(model)
    weights.append(hf.load(path, layout=engines.layout)[2])
  first = _backend(kind, recorded, workers, preempt=True)
  whole, snap = _async_batches(first, weights, snapshot_at=2)
  if kind == "workers":
    st = first.manager.stats
    assert st.preemptions == 1 and st.kept_tokens > 0, st
  carried = 0
  for step, batch in whole.items():
    assert len(batch.samples) == 4, step
    for s in batch.samples:
      versions = s.token_versions
      carried += len(set(versions[:-1])) > 1
      P = len(s.prompt_tokens)
      np.testing.assert_array_equal(
          np.sort(s.prompt_routes, -1),
          _top_k_routes(models[max(versions)], s.prompt_tokens)[:P])
      assert s.routes.shape == (len(s.tokens) - 1, cfg.num_layers, K)
      seq = np.concatenate([s.prompt_tokens, s.tokens[:-1]])
      for j, v in enumerate(versions[1:]):
        np.testing.assert_array_equal(
            np.sort(s.routes[j], -1), _top_k_routes(models[v], seq)[P + j],
            err_msg=f"step {step} sample {s.key} token {j} version {v}")
  assert carried >= 2  # Records carried over a switch, not re-recorded.
  resumed, _ = _async_batches(
      _backend(kind, recorded, workers, preempt=False), weights,
      resume=(2, snap))
  assert sorted(resumed) == [3, 4]
  for step, batch in resumed.items():
    for s, want in zip(batch.samples, whole[step].samples):
      assert (s.key, s.tokens, s.token_versions) == (
          want.key, want.tokens, want.token_versions)
      np.testing.assert_array_equal(s.prompt_routes, want.prompt_routes)
      np.testing.assert_array_equal(s.routes, want.routes)


@pytest.mark.parametrize("migration", ["kv", "reprefill"])
def test_recorded_routes_survive_a_long_tail_migration(checkpoint, recorded,
                                                       migration):
  """The long tail (`rollout.long_tail`, 4 replicas x EP 2) consolidates
  the unfinished groups onto fewer replicas, their pages moved ("kv") or
  their prompts prefilled again and tokens recomputed ("reprefill"): every
  sample's recorded experts are still transformers' top k of its tokens
  (as without a move), none lost or doubled."""
  from rlhf_jax.config.sections import LongTail
  from rlhf_jax.rollout.local import LocalRollout

  model, _ = checkpoint
  cfg, _, (_, params, _, _) = recorded
  M = 10
  engines = EngineSet(cfg, recorded[2][3].graphdef, recorded[2][3].layout,
                      rows_per_replica=1, samples_per_row=2,
                      prefill_buckets=(8, 8 + M),  # Room to re-prefill.
                      sampling=SamplingParams(temperature=1.0,
                                              max_new_tokens=M),
                      record_routes=True,
                      paged=dict(num_slots=8, page_size=4, num_pages=64))
  rng = np.random.default_rng(9)
  requests = []
  for i in range(8):  # Long-tailed budgets: every 4th prompt runs to M.
    budgets = (M if i % 4 == 3 else int(rng.integers(1, 4)),
               int(rng.integers(1, 4)))
    requests.append(Request(i, rng.integers(0, V, int(rng.integers(3, 9))),
                            num_samples=2, seed=4,
                            max_new_tokens_per_sample=budgets))
  lt = LocalRollout(engines, tail=LongTail(
      enabled=True, consolidate_below=0.5, migration=migration,
      fusion=False))
  lt.set_weights(params, 0)
  samples = list(lt.run(requests))
  moved = lt.metrics()
  assert moved["rollout/tail_moves"] > 0, moved
  assert (moved["rollout/reprefilled"] > 0) == (migration == "reprefill")
  assert sorted(s.key for s in samples) == [(r.prompt_id, j)
                                            for r in requests
                                            for j in range(2)]
  _assert_records_are_top_k(model, samples)


def test_multi_turn_appends_record_the_experts_of_their_tokens(
    checkpoint, recorded):
  """`MultiTurnDriver` (`engine/multiturn.py`) with recorded experts: at a
  sample's first stop token the environment appends 2 tokens (their KV by
  `moves.extend`, nothing prefilled again); every fed token, the stop
  token and the appended ones included, records transformers' top k of
  the whole conversation."""
  from rlhf_jax.engine.multiturn import MultiTurnDriver

  model, _ = checkpoint
  _, _, (engine, params, _, _) = recorded
  rng = np.random.default_rng(11)
  requests = [Request(i, rng.integers(4, V, int(rng.integers(3, 9))),
                      num_samples=2) for i in range(8)]
  reply = [40, 41]

  def env(request, sample_idx, tokens, logp=None):
    del request, sample_idx, logp
    return None if 40 in tokens else reply

  driver = MultiTurnDriver(engine, params, reply=env)
  samples = sorted(driver.run(requests), key=lambda s: s.key)
  assert driver.turns >= 2, driver.turns  # Replies appended, not vacuous.
  _assert_records_are_top_k(model, samples)


def test_paged_engine_records_the_experts_of_every_routed_token(
    checkpoint, recorded):
  """`Engine(record_routes=True)` (routing replay's source; 4 replicas x
  EP 2, 2 sampled responses a prompt): each sample's prompt routes and the
  routes of every response token it fed are transformers' top k of those
  tokens in each layer (the whole sequence in one forward); the last token,
  never fed, has none."""
  model, _ = checkpoint
  cfg, samples, _ = recorded
  assert len(samples) == 6
  L = cfg.num_layers
  for s in samples:
    seq = np.concatenate([s.prompt_tokens, s.tokens]).astype(np.int64)
    with torch.no_grad():
      out = model(input_ids=torch.tensor(seq[None]),
                  output_router_logits=True)
    want = np.stack([np.sort(np.argsort(-r.numpy(), -1)[:, :K], -1)
                     for r in out.router_logits], 1)  # [T, L, K]
    P = len(s.prompt_tokens)
    assert s.prompt_routes.shape == (P, L, K)
    assert s.routes.shape == (len(s.tokens) - 1, L, K)
    np.testing.assert_array_equal(np.sort(s.prompt_routes, -1), want[:P])
    np.testing.assert_array_equal(np.sort(s.routes, -1),
                                  want[P:P + len(s.tokens) - 1])


@pytest.mark.parametrize("rows", ["padded", "packed"])
def test_replayed_logprobs_equal_the_samplers(checkpoint, recorded, rows):
  """The recorded routes in the repeated, grouped and packed batches
  (`rl/batch`, `rl/packing`: whole sequences, or each group's prompt
  shared in its row), replayed by the trainer's log-prob pass on the
  training mesh (FSDP x EP 2, fp32 on both sides): each trained token's
  log-prob equals the sampler's to 1e-6."""
  from rlhf_jax.rl import batch as batch_lib
  from rlhf_jax.rl import grouped as grouped_lib
  from rlhf_jax.rl import packing

  _, path = checkpoint
  cfg, samples, _ = recorded
  layout = mesh_lib.train_layout(mesh_lib.make_mesh(fsdp=-1, expert=2))
  _, graphdef, params = hf.load(path, layout=layout)
  logprobs = jax.jit(lambda p, b: grouped_lib.token_logprobs_in_layout(
      graphdef, p, b))
  slots = packing.Slots(24, shards=layout.shards("batch")) if (
      rows == "packed") else None
  for G in (0, 2):
    packed = batch_lib.pack(samples, 8, 10, group_size=G, routes=True,
                            slots=slots)
    assert ("routes" in packed.arrays) == (G == 0 or slots is not None)
    with use_layout(layout):
      got = np.asarray(logprobs(params, packed.arrays))
    mask = packed.arrays["loss_mask"] > 0
    assert mask.sum() == sum(len(s.tokens) for s in samples)
    np.testing.assert_allclose(got[mask], packed.sampler_logp[mask],
                               atol=1e-6, rtol=0, err_msg=f"G={G}")
    # Not vacuous (the sampler's experts are also the trainer's own here):
    # other experts in the records move the log-probs.
    other = {k: (np.where(v >= 0, (v + 1) % E, v) if k.endswith("routes")
                 else v) for k, v in packed.arrays.items()}
    with use_layout(layout):
      moved = np.asarray(logprobs(params, other))
    assert np.abs(moved - got)[mask].max() > 1e-2, G


# Fixed before measuring: replay must cut the bf16 rollout's mismatch KL
# per token at least this many times.
REPLAY_KL_CUT = 2.0


def test_replay_cuts_the_mismatch_of_a_bf16_rollout_copy(tmp_path, mesh8):
  """[r3]'s measurement: a bf16 rollout copy samples (its recorded
  experts), the fp32 trainer scores the samples with and without replay
  (16 experts, top 2, the router at transformers' default init std 0.02:
  close choices, as in a freshly initialised or well-balanced router).
  Without replay >= 1% of the (token, layer) top-k choices differ (the
  router statistics count them; numpy on transformers' fp32 router logits
  agrees), and replay cuts the mismatch KL per token (k3 of
  KL(sampler || trainer), `off_policy.mismatch`) by REPLAY_KL_CUT."""
  from rlhf_jax.rl import batch as batch_lib
  from rlhf_jax.rl import grouped as grouped_lib
  from rlhf_jax.rl import off_policy

  model, path = _checkpoint(str(tmp_path), num_experts=16, router_std=0.02)
  rollout = mesh_lib.rollout_layout(mesh8, expert=2)
  cfg16, graphdef16, params16 = hf.load(path, layout=rollout,
                                        dtype="bfloat16")
  rng = np.random.default_rng(8)
  prompts = [rng.integers(0, V, n).astype(np.int32) for n in (8, 5, 7, 6)]
  engine = Engine(cfg16, graphdef16, rollout, num_slots=8,
                  samples_per_group=4, prefill_buckets=(8,),
                  sampling=SamplingParams(temperature=1.0, max_new_tokens=16),
                  page_size=4, num_pages=128, record_routes=True)
  samples = sorted(Driver(engine, params16).run(
      [Request(i, p, num_samples=4) for i, p in enumerate(prompts)]),
                   key=lambda s: s.key)
  train = mesh_lib.train_layout(mesh_lib.make_mesh(fsdp=-1, expert=2))
  _, graphdef, params = hf.load(path, layout=train, dtype="float32")
  packed = batch_lib.pack(samples, 8, 16, group_size=4, routes=True)
  plain = {k: v for k, v in packed.arrays.items() if "routes" not in k}
  score = jax.jit(lambda p, b: grouped_lib.target_logprobs(
      graphdef, p, b, router_stats=True))
  mask = packed.arrays["loss_mask"]
  kl, logp = {}, {}
  with use_layout(train):
    for name, batch in (("replay", packed.arrays), ("own", plain)):
      lp, _, _, stats = score(params, batch)
      logp[name] = np.asarray(lp).reshape(mask.shape)
      kl[name] = float(off_policy.mismatch(
          logp[name], packed.sampler_logp, mask)["mismatch_kl"])
      if name == "replay":
        replayed = float(np.sum(stats["replayed"]))
        flipped = float(np.sum(stats["flipped"]))
  # The flips, independently: transformers' fp32 top k of every fed token
  # against the recorded experts.
  flips = choices = 0
  for s in samples:
    seq = np.concatenate([s.prompt_tokens, s.tokens[:-1]]).astype(np.int64)
    with torch.no_grad():
      out = model(input_ids=torch.tensor(seq[None]),
                  output_router_logits=True)
    own = np.stack([np.sort(np.argsort(-r.numpy(), -1)[:, :K], -1)
                    for r in out.router_logits], 1)
    recorded = np.sort(np.concatenate([s.prompt_routes, s.routes]), -1)
    flips += int(np.sum(np.any(own != recorded, -1)))
    choices += own.shape[0] * own.shape[1]
  print(f"flips {flips} of {choices} (token, layer) choices; mismatch KL "
        f"per token {kl['own']:.3g} without replay, {kl['replay']:.3g} "
        "with")
  assert flips >= 0.01 * choices, (flips, choices)
  assert kl["replay"] * REPLAY_KL_CUT < kl["own"], kl
  # The router statistics count the same choices (the grouped layout
  # routes each prompt once: the samples' prompts counted once here too).
  assert replayed > 0 and flipped / replayed >= 0.01, (flipped, replayed)
  # The trainer's own routing (`learner.own_routing_logprobs`: the
  # ADVANTAGES stage's `rollout/moe_flip_rate`), each sample's prompt its
  # own (the repeated layout), against the recorded choices: every fed
  # token's counted, and its flips are numpy's (transformers' fp32 router,
  # up to a near-tie or two of our fp32 forward).
  from rlhf_jax.rl import learner as learner_lib
  repeated = batch_lib.pack(samples, 8, 16, routes=True).arrays
  own_flips = jax.jit(lambda p, b: learner_lib.own_routing_logprobs(
      graphdef, p, b, 2))
  with use_layout(train):
    _, own_flipped, own_recorded = own_flips(params, repeated)
  print(f"own routing: {float(own_flipped):.0f} flips of "
        f"{float(own_recorded):.0f}")
  assert float(own_recorded) == choices, (own_recorded, choices)
  assert abs(float(own_flipped) - flips) <= max(2, 0.1 * flips), (
      own_flipped, flips)


def test_routing_replay_of_a_dense_policy_is_refused_in_one_line():
  import resume
  from configs import tiny_grpo
  from rlhf_jax.errors import ConfigError
  from rlhf_jax.trainers import rl_job
  c = resume.override(tiny_grpo.get_config("runlocal"),
                      **{"rl.routing_replay": True})
  with pytest.raises(ConfigError, match=r"^config\.rl\.routing_replay=True: "
                     r"the model has no routed experts \(config\.model is "
                     r"dense\)$"):
    rl_job.build(c)
