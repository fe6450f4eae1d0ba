"""Qwen3-MoE: expert parallelism on the 8-device mesh against transformers
(logits, router and expert gradients, training and rollout layouts), the
router losses against transformers' `aux_loss` and numpy, the paged engine
decoding with experts split over a replica, and config errors.

(Logits on one device, greedy decoding and the save -> transformers round
trip run with the other families in tests/models/test_hf.py.)
"""

import numpy as np
import pytest

import jax
from flax import nnx

from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import hf, hf_config, moe
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import LoraSpec, ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.parallel.layout import use_layout
from rlhf_jax.samples import Request

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, E, K, F = 64, 8, 2, 24


def _checkpoint(path, num_experts=E, router_std=0.5):
  """(transformers model, its directory): 2 layers of `num_experts`
  experts, top 2; the router drawn at std 0.5 by default so its choices
  are clear (no near-ties for rounding to flip) and spread over the
  experts."""
  config = transformers.Qwen3MoeConfig(
      vocab_size=V, hidden_size=32, intermediate_size=48,
      moe_intermediate_size=F, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, num_experts=num_experts,
      num_experts_per_tok=K, norm_topk_prob=True, tie_word_embeddings=False,
      initializer_range=0.1)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(
      config, attn_implementation="eager").eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 1:  # Norms are born 1 and would hide bugs.
        p.add_(0.1 * torch.randn_like(p))
      if name.endswith("mlp.gate.weight"):
        p.normal_(0.0, router_std)
  model.save_pretrained(path)
  return model, path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return _checkpoint(str(tmp_path_factory.mktemp("qwen3_moe")))


def _batch(B=8, T=12, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (B, T)).astype(np.int32)
  mask = np.arange(T)[None] < rng.integers(T // 2, T + 1, B)[:, None]
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()
  return tokens, positions, mask


def _torch_reference(model, tokens, mask, weights):
  """transformers' logits, aux loss, router logits per layer, and the
  gradient of sum(logits * weights) over real tokens for the router and
  the experts, in our layouts: router [L, D, E], gate / up [L, E, D, F],
  down [L, E, F, D]."""
  model.zero_grad()
  out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
              attention_mask=torch.tensor(mask, dtype=torch.long),
              output_router_logits=True)
  loss = (out.logits * torch.tensor(weights * mask[..., None])).sum()
  loss.backward()
  grads = {"router": [], "gate": [], "up": [], "down": []}
  for layer in model.model.layers:
    experts = layer.mlp.experts
    grads["router"].append(layer.mlp.gate.weight.grad.T)
    gate_up = experts.gate_up_proj.grad  # [E, 2F, D]: gate rows, then up.
    grads["gate"].append(gate_up[:, :F].transpose(1, 2))
    grads["up"].append(gate_up[:, F:].transpose(1, 2))
    grads["down"].append(experts.down_proj.grad.transpose(1, 2))
  grads = {k: torch.stack(v).numpy() for k, v in grads.items()}
  return (out.logits.detach().numpy(), float(out.aux_loss.detach()),
          [r.detach().numpy() for r in out.router_logits], grads)


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
  _, _, own_logits, _ = _torch_reference(model, tokens, mask, weights)
  own = np.stack([np.argsort(-r, -1)[:, :K] for r in own_logits], 1
                 ).reshape(B, T, L, K).astype(np.int32)
  for i, layer in enumerate(model.model.layers):
    layer.mlp.gate.forward = _forced_router(layer.mlp.gate,
                                            replay[:, :, i].reshape(-1, K))
  try:
    ref, _, router_logits, ref_grads = _torch_reference(model, tokens, mask,
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


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_parallel_matches_transformers(checkpoint, ep):
  """EP = ep on the 8-device training mesh (FSDP over the rest; the batch
  split over the expert axis too, so tokens travel to their experts'
  devices and back): logits equal transformers' to 1e-5 and the router's
  and experts' gradients equal torch autograd's; the rollout layout's
  replicas (experts split inside each, tokens summed over them) give the
  same logits."""
  model, path = checkpoint
  tokens, positions, mask = _batch()
  weights = np.random.default_rng(1).normal(
      size=tokens.shape + (V,)).astype(np.float32)
  ref, _, _, ref_grads = _torch_reference(model, tokens, mask, weights)
  layout = mesh_lib.train_layout(mesh_lib.make_mesh(fsdp=-1, expert=ep))
  if ep > 1:
    assert "expert" in layout.spec(("batch",), (8,))[0]
  cfg, graphdef, params = hf.load(path, layout=layout)
  assert (cfg.num_experts, cfg.experts_per_token) == (E, K)
  experts = dict(nnx.to_flat_state(params))[("blocks", "mlp", "gate")]
  axes = experts.get_value().sharding.spec[1]  # [L, E, D, F]: E's axes.
  assert ("expert" in ((axes,) if isinstance(axes, str) else axes or ())
          ) == (ep > 1)

  def loss(p):
    logits = model_lib.forward(graphdef, p, tokens, positions, mask)
    return (logits * weights * mask[..., None]).sum(), logits

  with use_layout(layout):
    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        params)
  np.testing.assert_allclose(np.asarray(logits)[mask], ref[mask], atol=1e-5,
                             rtol=0)
  flat = dict(nnx.to_flat_state(grads))
  for name, want in ref_grads.items():
    got = np.asarray(flat[("blocks", "mlp", name)].get_value())
    assert np.abs(want).max() > 1e-2, name  # Every part gets gradient.
    np.testing.assert_allclose(got, want, rtol=0,
                               atol=1e-5 * np.abs(want).max(), err_msg=name)

  rollout = mesh_lib.rollout_layout(layout.mesh, expert=ep)
  with use_layout(rollout):
    logits = jax.jit(model_lib.forward, static_argnums=0)(
        graphdef, mesh_lib.to_layout(params, rollout), tokens, positions,
        mask)
  np.testing.assert_allclose(np.asarray(logits)[mask], ref[mask], atol=1e-5,
                             rtol=0)


def test_experts_the_expert_axis_does_not_divide_stay_whole(tmp_path):
  """6 experts on an expert axis of 4 (the batch still split over it):
  every device holds all 6 and computes its own tokens; the logits equal
  transformers'."""
  model, path = _checkpoint(str(tmp_path), num_experts=6)
  tokens, positions, mask = _batch()
  ref, _, _, _ = _torch_reference(model, tokens, mask, np.zeros(
      tokens.shape + (V,), np.float32))
  layout = mesh_lib.train_layout(mesh_lib.make_mesh(fsdp=-1, expert=4))
  assert layout.spec(("experts",), (6,))[0] is None
  assert "expert" in layout.spec(("batch",), (8,))[0]
  _, graphdef, params = hf.load(path, layout=layout)
  with use_layout(layout):
    logits = jax.jit(model_lib.forward, static_argnums=0)(
        graphdef, params, tokens, positions, mask)
  np.testing.assert_allclose(np.asarray(logits)[mask], ref[mask], atol=1e-5,
                             rtol=0)


def test_router_losses_and_load_match_transformers_and_numpy(checkpoint):
  """From our forward's router statistics (EP 2, 8 devices): the
  load-balancing loss in transformers' form equals its `aux_loss` (padding
  excluded by the attention mask), the per-layer form (the default) a
  numpy computation, the z-loss and the per-expert loads equal numpy
  on transformers' router logits; every expert receives tokens."""
  model, path = checkpoint
  tokens, positions, mask = _batch(seed=2)
  _, aux, router_logits, _ = _torch_reference(
      model, tokens, mask, np.zeros(tokens.shape + (V,), np.float32))
  layout = mesh_lib.train_layout(mesh_lib.make_mesh(fsdp=-1, expert=2))
  _, graphdef, params = hf.load(path, layout=layout)
  fwd = jax.jit(lambda p: model_lib.forward(graphdef, p, tokens, positions,
                                            mask, router_stats=True)[1])
  with use_layout(layout):
    stats = fwd(params)
  np.testing.assert_allclose(
      float(moe.balance_loss(stats, per_layer=False)), aux, rtol=1e-5)
  real = mask.reshape(-1)
  probs = [np.exp(r[real] - r[real].max(-1, keepdims=True))
           for r in router_logits]
  probs = [p / p.sum(-1, keepdims=True) for p in probs]
  per_layer = [E * np.sum(np.bincount(np.argsort(-p, -1)[:, :K].reshape(-1),
                                      minlength=E) / len(p) * p.mean(0))
               for p in probs]  # Each layer's own f and p.
  np.testing.assert_allclose(float(moe.balance_loss(stats)),
                             np.mean(per_layer), rtol=1e-5)
  assert abs(np.mean(per_layer) - aux) > 1e-3  # The two forms differ here.
  lse = [np.log(np.exp(r - r.max(-1, keepdims=True)).sum(-1)) + r.max(-1)
         for r in router_logits]  # [B*T] per layer.
  z = np.mean(np.concatenate([x[real] ** 2 for x in lse]))
  np.testing.assert_allclose(float(moe.z_loss(stats)), z, rtol=1e-5)
  load = np.stack([np.bincount(np.argsort(-r[real], -1)[:, :K].reshape(-1),
                               minlength=E) for r in router_logits])
  metrics = jax.device_get(moe.expert_load(stats))
  assert metrics["expert_tokens_max"] == load.max()
  assert metrics["expert_tokens_min"] == load.min() > 0
  np.testing.assert_allclose(metrics["expert_tokens_mean"], load.mean())


def test_paged_engine_decodes_with_experts_split_over_each_replica(
    checkpoint, mesh8):
  """Greedy tokens of the paged engine on 4 replicas x EP 2 (each replica's
  decode rows through experts on its two devices) equal
  `transformers.generate`."""
  model, path = checkpoint
  layout = mesh_lib.rollout_layout(mesh8, expert=2)
  cfg, graphdef, params = hf.load(path, layout=layout)
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, V, n).astype(np.int32) for n in (5, 8, 3, 7)]
  engine = Engine(cfg, graphdef, layout, num_slots=4, samples_per_group=1,
                  prefill_buckets=(8,), sampling=SamplingParams(
                      temperature=0.0, max_new_tokens=16),
                  page_size=4, num_pages=64)
  ours = {s.prompt_id: s.tokens for s in Driver(engine, params).run(
      [Request(i, p) for i, p in enumerate(prompts)])}
  model.generation_config.eos_token_id = None
  for i, prompt in enumerate(prompts):
    ids = torch.tensor(prompt[None], dtype=torch.long)
    with torch.no_grad():
      out = model.generate(ids, attention_mask=torch.ones_like(ids),
                           do_sample=False, max_new_tokens=16, pad_token_id=0)
    assert ours[i] == out[0, len(prompt):].tolist(), i


@pytest.fixture(scope="module")
def recorded(checkpoint, mesh8):
  """Samples of `Engine(record_routes=True)` on 4 replicas x EP 2: 3
  prompts, 2 sampled responses each."""
  model, path = checkpoint
  layout = mesh_lib.rollout_layout(mesh8, expert=2)
  cfg, graphdef, params = hf.load(path, layout=layout)
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, V, n).astype(np.int32) for n in (6, 3, 8)]
  engine = Engine(cfg, graphdef, layout, num_slots=4, samples_per_group=2,
                  prefill_buckets=(8,), sampling=SamplingParams(
                      temperature=1.0, max_new_tokens=10),
                  page_size=4, num_pages=64, record_routes=True)
  samples = list(Driver(engine, params).run(
      [Request(i, p, num_samples=2) for i, p in enumerate(prompts)]))
  return cfg, sorted(samples, key=lambda s: s.key)


def test_paged_engine_records_the_experts_of_every_routed_token(
    checkpoint, recorded):
  """`Engine(record_routes=True)` (routing replay's source; 4 replicas x
  EP 2, 2 sampled responses a prompt): each sample's prompt routes and the
  routes of every response token it fed are transformers' top k of those
  tokens in each layer (the whole sequence in one forward); the last token,
  never fed, has none."""
  model, _ = checkpoint
  cfg, samples = recorded
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


def test_replayed_logprobs_equal_the_samplers(checkpoint, recorded):
  """The recorded routes in the repeated and grouped batches (`rl/batch`),
  replayed by the trainer's log-prob pass on the training mesh (FSDP x EP
  2, fp32 on both sides): each trained token's log-prob equals the
  sampler's to 1e-6."""
  from rlhf_jax.rl import batch as batch_lib
  from rlhf_jax.rl import grouped as grouped_lib

  _, path = checkpoint
  cfg, samples = recorded
  layout = mesh_lib.train_layout(mesh_lib.make_mesh(fsdp=-1, expert=2))
  _, graphdef, params = hf.load(path, layout=layout)
  logprobs = jax.jit(lambda p, b: grouped_lib.token_logprobs_in_layout(
      graphdef, p, b))
  for G in (0, 2):
    packed = batch_lib.pack(samples, 8, 10, group_size=G, routes=True)
    assert ("routes" in packed.arrays) == (G == 0)
    with use_layout(layout):
      got = np.asarray(logprobs(params, packed.arrays))
    mask = packed.arrays["loss_mask"] > 0
    assert mask.sum() == sum(len(s.tokens) for s in samples)
    np.testing.assert_allclose(got[mask], packed.sampler_logp[mask],
                               atol=1e-6, rtol=0, err_msg=f"G={G}")


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


def test_moe_config_errors_name_the_problem():
  hf_cfg = hf_config.to_hf(ModelConfig.tiny_moe(), "float32")
  with pytest.raises(NotImplementedError, match="dense MLP layers between "
                     "sparse ones"):
    hf_config.from_hf({**hf_cfg, "mlp_only_layers": [1]})
  assert hf_config.from_hf(hf_cfg) == ModelConfig.tiny_moe()
  with pytest.raises(ValueError, match=r"experts_per_token=9 must be in "
                     r"1\.\.num_experts=8"):
    ModelConfig.tiny_moe(experts_per_token=9)
  with pytest.raises(ValueError, match=r"LoRA on the routed experts' "
                     r"\['up'\]: not implemented"):
    ModelConfig.tiny_moe(lora=LoraSpec(4, 8.0, ("q", "up")))
  with pytest.raises(ValueError, match="record_routes: the model has no "
                     "routed experts"):
    Engine(ModelConfig.tiny(), None, None, num_slots=2, samples_per_group=1,
           prefill_buckets=(8,), sampling=SamplingParams(), record_routes=True)
  with pytest.raises(ValueError, match="the model has no routed experts"):
    cfg = ModelConfig.tiny()
    graphdef, params = model_lib.init_params(cfg, 0)
    x = np.zeros((1, 4), np.int32)
    model_lib.forward(graphdef, params, x, x, x == 0, router_stats=True)


def test_router_loss_keys_reach_the_rl_and_sft_losses():
  """`rl.moe_*` and `sft.moe_*` become the losses' `RouterLoss`; the
  per-layer balancing is the default."""
  from rlhf_jax.config import sections
  from rlhf_jax.rl.objectives import RouterLoss
  assert sections.RL().policy_loss_config(8).router == RouterLoss(
      0.0, 0.0, balance_per_layer=True)
  rl = sections.RL(moe_balance_coef=0.01, moe_z_coef=0.001,
                   moe_balance_per_layer=False)
  assert rl.policy_loss_config(8).router == RouterLoss(0.01, 0.001, False)
  sft = sections.SFT(moe_balance_coef=0.02, moe_z_coef=0.003)
  assert sections.router_loss(sft) == RouterLoss(0.02, 0.003, True)
  with pytest.raises(sections.ConfigError, match="moe_z_coef"):
    sections.SFT(moe_z_coef=-1.0)


def _layouts_of_groups(seed=4, N=2, G=2, P=6, R=5):
  """The same N x G sequences (prompt + response) as a grouped batch and as
  a repeated one, with a loss mask over the responses (a few tokens off)."""
  rng = np.random.default_rng(seed)
  plen = np.array([P, 3], np.int32)
  prompt = np.where(np.arange(P)[None] < plen[:, None],
                    rng.integers(1, V, (N, P)), 0).astype(np.int32)
  resp = rng.integers(1, V, (N, G, R)).astype(np.int32)
  lm = (rng.random((N, G, R)) < 0.8).astype(np.float32)
  lm[0, 1, 0] = 0.0  # A response whose first token is not trained.
  lm[1, 0, -2:] = 0.0  # Ends untrained: the grouped load stops before.
  grouped = dict(prompt_tokens=prompt, prompt_len=plen, response_tokens=resp,
                 loss_mask=lm)
  T = P + R
  tokens = np.zeros((N * G, T), np.int32)
  loss_mask = np.zeros((N * G, T), np.float32)
  for n in range(N):
    for g in range(G):
      b, p = n * G + g, plen[n]
      tokens[b, :p + R] = np.concatenate([prompt[n, :p], resp[n, g]])
      loss_mask[b, p - 1:p - 1 + R] = lm[n, g]
  repeated = dict(
      tokens=tokens, attn_mask=np.arange(T)[None] < (plen.repeat(G) + R)[
          :, None],
      positions=np.broadcast_to(np.arange(T, dtype=np.int32), (N * G, T)),
      targets=np.concatenate([tokens[:, 1:], np.zeros((N * G, 1), np.int32)],
                             1),
      loss_mask=loss_mask)
  return grouped, repeated


def test_router_terms_count_the_trained_tokens_in_every_layout(checkpoint):
  """The policy loss's router statistics count the tokens that predict
  trained targets: in the repeated layout and in the grouped one (each
  prompt run once, its last token counted per trained response) they
  equal numpy on transformers' router logits at those positions (the
  expert loads: at every real token each layout routes), and
  `rl.moe_balance_coef` / `moe_z_coef` add exactly coef x each term to
  the loss (one micro-batch)."""
  from rlhf_jax.rl import grouped as grouped_lib
  from rlhf_jax.rl import objectives

  model, path = checkpoint
  grouped, repeated = _layouts_of_groups()
  _, _, router_logits, _ = _torch_reference(
      model, repeated["tokens"], repeated["attn_mask"],
      np.zeros(repeated["tokens"].shape + (V,), np.float32))
  trained = repeated["loss_mask"].reshape(-1) > 0
  probs = [np.exp(r - r.max(-1, keepdims=True)) for r in router_logits]
  probs = [p / p.sum(-1, keepdims=True) for p in probs]
  rows = trained.sum() * len(probs)
  f = sum(np.bincount(np.argsort(-p[trained], -1)[:, :K].reshape(-1),
                      minlength=E) for p in probs) / rows
  p_mean = sum(p[trained].sum(0) for p in probs) / rows
  want_balance = E * np.sum(f * p_mean)  # transformers' form.
  want_layer_balance = np.mean([E * np.sum(
      np.bincount(np.argsort(-p[trained], -1)[:, :K].reshape(-1),
                  minlength=E) / trained.sum() * p[trained].mean(0))
      for p in probs])
  want_z = np.mean(np.concatenate([
      (np.log(np.exp(r - r.max(-1, keepdims=True)).sum(-1)) + r.max(-1))[
          trained] ** 2 for r in router_logits]))

  # The loads count what each pass routes: every real token of the
  # repeated rows; the grouped layout's prompts once, and each response up
  # to its last trained token.
  G, R = grouped["response_tokens"].shape[1:]
  routed_grouped = np.zeros_like(repeated["attn_mask"])
  for b in range(len(routed_grouped)):
    n, g = divmod(b, G)
    p = grouped["prompt_len"][n]
    routed_grouped[b, :p] = g == 0
    trained_from = np.cumsum(grouped["loss_mask"][n, g, ::-1])[::-1] > 0
    routed_grouped[b, p:p + R] = trained_from
  routed = {"repeated": repeated["attn_mask"].reshape(-1),
            "grouped": routed_grouped.reshape(-1)}

  cfg, graphdef, params = hf.load(path)
  for name, batch in (("repeated", repeated), ("grouped", grouped)):
    stats = jax.jit(lambda p, b: grouped_lib.target_logprobs(
        graphdef, p, b, router_stats=True)[3])(params, batch)
    np.testing.assert_allclose(float(moe.balance_loss(stats, False)),
                               want_balance, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(float(moe.balance_loss(stats)),
                               want_layer_balance, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(float(moe.z_loss(stats)), want_z, rtol=1e-5,
                               err_msg=name)
    load = np.stack([np.bincount(
        np.argsort(-p[routed[name]], -1)[:, :K].reshape(-1), minlength=E)
        for p in probs])
    got = jax.device_get(moe.expert_load(stats))
    assert (got["expert_tokens_max"], got["expert_tokens_min"]) == (
        load.max(), load.min()), name
    np.testing.assert_allclose(got["expert_tokens_mean"], load.mean(),
                               err_msg=name)

  batch = {**repeated, "old_logp": np.zeros_like(repeated["loss_mask"]),
           "ref_logp": np.zeros_like(repeated["loss_mask"]),
           "advantages": np.ones(len(repeated["tokens"]), np.float32)}
  nums = {}
  for coefs in ((0.0, 0.0), (0.01, 0.0), (0.0, 0.001)):
    terms, weight = objectives.policy_terms(objectives.PolicyLossConfig(
        router=objectives.RouterLoss(balance_coef=coefs[0],
                                     z_coef=coefs[1])))
    num, aux = jax.jit(lambda p, b: terms(graphdef, p, b))(params, batch)
    nums[coefs] = float(num / weight(batch))
  assert aux["expert_tokens_max"] > aux["expert_tokens_mean"] > 0
  np.testing.assert_allclose(nums[(0.01, 0.0)] - nums[(0.0, 0.0)],
                             0.01 * want_layer_balance, rtol=1e-4)
  np.testing.assert_allclose(nums[(0.0, 0.001)] - nums[(0.0, 0.0)],
                             0.001 * want_z, rtol=1e-4)


@pytest.mark.slow  # A whole job (the tier's rule), 22 s alone.
@pytest.mark.parametrize("replay", [False, True])
def test_tiny_grpo_moe_runlocal_samples_what_it_trains(tmp_path, replay):
  """configs/tiny_grpo_moe.py:runlocal end to end on the real engine, the
  experts split 2 ways in training and in each rollout replica, without
  and with routing replay: the sampler's log-probs equal the trainer's
  (the rollout's psum path and the training's gather path compute one
  model), and the router terms and expert loads are logged; with replay
  the flip rate too. (Whether
  every expert receives tokens at every step is the full job's figure:
  `benchmarks.job`'s steps_with_an_idle_expert, docs/results.md.)"""
  import resume
  from configs import tiny_grpo_moe
  from rlhf_jax.trainers import rl_job

  rl_job.run(resume.override(tiny_grpo_moe.get_config("runlocal"),
                             **{"rl.routing_replay": replay}), str(tmp_path))
  records = resume.rl_records(str(tmp_path))
  steps = [s for s in sorted(records) if s > 0]
  assert steps
  for step in steps:
    r = records[step]
    assert ("train/moe_flip_rate" in r) == replay
    if replay:  # Near-ties of the trained router flip on paged decode's
      # rounding (0.35% in a step seen); replay keeps the mismatch at 0.
      assert 0.0 <= r["train/moe_flip_rate"] < 0.05, (step, r)
    assert (r["train/expert_tokens_max"] > r["train/expert_tokens_mean"]
            > 0), (step, r)
    assert r["rollout/mismatch_kl"] < 1e-6, (step, r["rollout/mismatch_kl"])
    # E sum_e f_e p_e: k when balanced, at most E (every token to one).
    assert 0 < r["train/moe_balance_loss"] <= E, step
    assert np.isfinite(r["train/moe_z_loss"]) and r["train/moe_z_loss"] > 0
