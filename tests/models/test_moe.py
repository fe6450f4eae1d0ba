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

from moe_cases import E, F, K, V, torch, torch_reference
from moe_cases import batch as _batch
from moe_cases import checkpoint as _checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return _checkpoint(str(tmp_path_factory.mktemp("qwen3_moe")))


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
  ref, _, _, ref_grads = torch_reference(model, tokens, mask, weights)
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
  ref, _, _, _ = torch_reference(model, tokens, mask, np.zeros(
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
  _, aux, router_logits, _ = torch_reference(
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


def test_an_all_padding_micro_batch_of_packed_rows_adds_nothing(mesh8):
  """Packed rows (`rl.pack_length`) deal a small batch over many cells, so
  a micro-batch can hold padding only: its router terms are 0, not 0/0
  (a NaN that made every MoE job with packed rows fail at its first
  update), and its fewest-tokens figure is +inf, so the least over
  micro-batches skips it, while a real micro-batch's is finite."""
  import types
  from rlhf_jax.rl import batch as batch_lib
  from rlhf_jax.rl import objectives
  from rlhf_jax.rl import packing

  cfg = ModelConfig.tiny(vocab_size=V, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, embed_dim=32,
                         mlp_dim=64, num_experts=E, experts_per_token=K,
                         expert_mlp_dim=F)
  layout = mesh_lib.train_layout(mesh_lib.make_mesh(fsdp=-1, expert=2))
  graphdef, params = model_lib.init_params(cfg, 0, layout)
  rng = np.random.default_rng(3)
  samples = [types.SimpleNamespace(
      prompt_id=i, prompt_tokens=rng.integers(1, V, 5).tolist(),
      tokens=rng.integers(1, V, 6).tolist(),
      logp_raw=-rng.random(6).astype(np.float32)) for i in range(2)]
  packed = batch_lib.pack(samples, 8, 8, slots=packing.Slots(
      16, micro_batches=4, shards=layout.shards("batch")))
  rows = packed.arrays["seg"].max(-1) >= 0
  assert rows.any() and not rows.all()
  terms, _ = objectives.policy_terms(objectives.PolicyLossConfig(
      router=objectives.RouterLoss(balance_coef=0.01, z_coef=0.001)))
  step = jax.jit(lambda p, b: terms(graphdef, p, b))
  for real in (False, True):
    batch = {k: v[rows == real][:8] for k, v in packed.arrays.items()}
    shape = batch["loss_mask"].shape
    batch.update(old_logp=np.zeros(shape, np.float32),
                 ref_logp=np.zeros(shape, np.float32),
                 advantages=np.ones(shape, np.float32))
    with use_layout(layout):
      num, aux = step(params, batch)
    assert np.isfinite(float(num)), real
    assert np.isfinite(float(aux["moe_z_loss"])), real
    assert np.isfinite(float(aux["expert_tokens_min"])) == real
    if not real:
      assert float(num) == 0.0 and float(aux["moe_z_loss"]) == 0.0


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
  _, _, router_logits, _ = torch_reference(
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
@pytest.mark.parametrize("replay,asynchronous",
                         [(False, False), (True, False), (True, True)])
def test_tiny_grpo_moe_runlocal_samples_what_it_trains(tmp_path, replay,
                                                       asynchronous):
  """configs/tiny_grpo_moe.py:runlocal end to end on the real engine, the
  experts split 2 ways in training and in each rollout replica, without
  and with routing replay, and with replay in async RL (the rollout on 4
  devices, samples up to a version old): the sampler's log-probs equal
  the trainer's on policy (the rollout's psum path and the training's
  gather path compute one model), and the router terms and expert loads
  are logged; with replay the flip rate and the mismatch without replay
  too. (Whether every expert receives tokens at every step is the full
  job's figure: `benchmarks.job`'s steps_with_an_idle_expert,
  docs/results.md.)"""
  import resume
  from configs import tiny_grpo_moe
  from rlhf_jax.trainers import rl_job

  from rlhf_jax import typed_config
  from rlhf_jax.config import sections

  c = resume.override(tiny_grpo_moe.get_config("runlocal"),
                      **{"rl.routing_replay": replay})
  if asynchronous:  # configs/tiny_grpo_async.py's settings.
    c.asynchronous = typed_config.config_dict(
        sections.Async, enabled=True, max_staleness=1, switch_after_groups=0)
  rl_job.run(c, str(tmp_path))
  records = resume.rl_records(str(tmp_path))
  steps = [s for s in sorted(records) if s > 0]
  assert steps
  for step in steps:
    r = records[step]
    assert ("train/moe_flip_rate" in r) == replay
    assert ("rollout/mismatch_kl_without_replay" in r) == replay
    assert ("rollout/moe_flip_rate" in r) == replay
    if asynchronous and step > 1:
      # Off policy: a one-version-old sample's routes and log-probs are
      # not the trainer's; replay must still leave the mismatch below the
      # own-routing mismatch.
      assert r["async/off_policy_samples"] > 0 or step == 2, (step, r)
      assert (r["rollout/mismatch_kl"]
              <= r["rollout/mismatch_kl_without_replay"] + 1e-9), (step, r)
      continue
    if replay:  # Near-ties of the trained router flip on paged decode's
      # rounding (0.35% in a step seen); replay keeps the mismatch at 0.
      assert 0.0 <= r["train/moe_flip_rate"] < 0.05, (step, r)
      assert 0.0 <= r["rollout/moe_flip_rate"] < 0.05, (step, r)
      assert 0.0 <= r["rollout/mismatch_kl_without_replay"] < 1e-3, step
    assert (r["train/expert_tokens_max"] > r["train/expert_tokens_mean"]
            > 0), (step, r)
    assert r["rollout/mismatch_kl"] < 1e-6, (step, r["rollout/mismatch_kl"])
    # E sum_e f_e p_e: k when balanced, at most E (every token to one).
    assert 0 < r["train/moe_balance_loss"] <= E, step
    assert np.isfinite(r["train/moe_z_loss"]) and r["train/moe_z_loss"] > 0
