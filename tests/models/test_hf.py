"""HF checkpoints: parity with transformers (logits, greedy decoding), save ->
load -> transformers round trips, sharded loading, config spellings, errors;
for Llama, Qwen2, Qwen3, Qwen3-MoE and Gemma 2 (expert parallelism and the
router losses: tests/models/test_moe.py).

Tiny random models are built offline with transformers' config classes and
`save_pretrained` (test-only dependencies: transformers, torch CPU).
"""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from rlhf_jax.samples import Request
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import hf
from rlhf_jax.models import hf_config
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig, RopeScaling
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.parallel.layout import use_layout

# torch and transformers only for the tests that build or read a checkpoint
# with them: the config-spelling tests run without either.
try:
  import torch
  import transformers
except ImportError:
  torch = transformers = None
needs_torch = pytest.mark.skipif(
    transformers is None, reason="needs the test-only torch + transformers")

V, NEW_TOKENS, BUCKET, WINDOW = 128, 30, 8, 8
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# Each family covers other switches: tied/untied, bias, QK-norm, GQA ratios
# 4:1, 4:2, 4:4; Gemma 2's window (8) is shorter than the logits batch (48)
# and than a prompt plus its 30 greedy tokens (decode past the window).
# 30, not 32: a sample's tokens and the driver's two of headroom fill 8
# pages of 4, one decode program per family (32 needed a second at 9
# pages: 12 programs, 20.9 s for the generation tests alone; 7, 16.8 s).
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=1,
                                  tie_word_embeddings=True,
                                  rope_scaling=LLAMA3_ROPE)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2,
                                  tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32,
                                  tie_word_embeddings=True)),
    # 8 experts, top 2 (renormalised); the router is drawn at scale 0.1
    # like every weight, so tokens spread over the experts.
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=4, head_dim=16,
                                    query_pre_attn_scalar=24,
                                    attn_logit_softcapping=5.0,
                                    final_logit_softcapping=3.0,
                                    sliding_window=WINDOW,
                                    tie_word_embeddings=True)),
}


def _build(tmp_dir, family):
  cls_name, kw = FAMILIES[family]
  config = getattr(transformers, cls_name)(
      vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, initializer_range=0.1, **kw)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(
      config, attn_implementation="eager").eval()
  with torch.no_grad():  # Norms and biases are born 1/0 and would hide bugs.
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
  path = os.path.join(tmp_dir, family)
  model.save_pretrained(path)
  return model, path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp("hf"))
  return {f: _build(tmp, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def loaded(checkpoints):
  return {f: hf.load(path) for f, (_, path) in checkpoints.items()}


def _batch(seed=0, B=3, T=48):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (B, T)).astype(np.int32)
  lengths = np.array([T, 30, 9, 20])[:B]
  mask = np.arange(T)[None] < lengths[:, None]
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
  return tokens, positions, mask, lengths


def _hf_logits(model, tokens, mask):
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long)
                 ).logits.numpy()


def _assert_real_close(ours, ref, lengths, atol=1e-5):
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(np.asarray(ours)[b, :n], ref[b, :n], atol=atol,
                               rtol=0)


@needs_torch
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, checkpoints, loaded):
  model, _ = checkpoints[family]
  cfg, graphdef, params = loaded[family]
  tokens, positions, mask, lengths = _batch()
  ours = jax.jit(model_lib.forward, static_argnums=0)(
      graphdef, params, tokens, positions, mask)
  _assert_real_close(ours, _hf_logits(model, tokens, mask), lengths)
  assert cfg.tie_embeddings == FAMILIES[family][1]["tie_word_embeddings"]


@needs_torch
@pytest.mark.parametrize("family,engine_kind", [
    (f, "paged") for f in sorted(FAMILIES)] + [
        # The Mosaic paged kernel (interpreted): Gemma 2's window and
        # soft-cap, and Llama's 4:1 GQA.
        ("gemma2", "paged_kernel"), ("llama", "paged_kernel")])
def test_greedy_generation_matches_transformers(family, engine_kind,
                                                checkpoints, loaded, mesh1):
  model, _ = checkpoints[family]
  cfg, graphdef, params = loaded[family]
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, V, n).astype(np.int32) for n in (5, BUCKET)]
  layout = mesh_lib.rollout_layout(mesh1)
  sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
  # Pages of 4: Gemma 2's window of 8 spans pages.
  engine = Engine(
      cfg, graphdef, layout, num_slots=2, samples_per_group=1,
      prefill_buckets=(BUCKET,), sampling=sampling, page_size=4,
      num_pages=32, attention_impl=("pallas" if engine_kind ==
                                    "paged_kernel" else "auto"))
  driver = Driver(engine, mesh_lib.to_layout(params, layout))
  ours = {s.prompt_id: s.tokens for s in driver.run(
      [Request(i, p) for i, p in enumerate(prompts)])}
  model.generation_config.eos_token_id = None  # Always 30 tokens.
  for i, prompt in enumerate(prompts):
    ids = torch.tensor(prompt[None], dtype=torch.long)
    with torch.no_grad():
      out = model.generate(ids, attention_mask=torch.ones_like(ids),
                           do_sample=False, max_new_tokens=NEW_TOKENS,
                           pad_token_id=0)
    assert ours[i] == out[0, len(prompt):].tolist(), (family, i)


@needs_torch
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_load_transformers_round_trip(family, checkpoints, loaded,
                                           tmp_path):
  model, src = checkpoints[family]
  cfg, _, params = loaded[family]
  out = str(tmp_path / "saved")
  # A small shard size forces several files plus the index.
  hf.save(out, cfg, params, tokenizer_dir=src, max_shard_size=64 << 10)
  assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
  assert os.path.exists(os.path.join(out, "generation_config.json"))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      out, attn_implementation="eager").eval()
  assert type(reloaded) is type(model)
  ref, got = model.state_dict(), reloaded.state_dict()
  assert ref.keys() == got.keys()
  for name in ref:
    assert torch.equal(ref[name], got[name]), name
  tokens, _, mask, _ = _batch(seed=2)
  np.testing.assert_array_equal(_hf_logits(reloaded, tokens, mask),
                                _hf_logits(model, tokens, mask))
  cfg2, _, params2 = hf.load(out)
  assert cfg2 == cfg
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_array_equal(a, b)


@needs_torch
@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_sharded_loads_give_same_logits(family, checkpoints, loaded, mesh8):
  _, path = checkpoints[family]
  _, graphdef, ref_params = loaded[family]
  tokens, positions, mask, lengths = _batch(seed=3, B=4)
  ref = model_lib.forward(graphdef, ref_params, tokens, positions, mask)
  layouts = [mesh_lib.train_layout(mesh_lib.make_mesh(fsdp=4, tensor=2)),
             mesh_lib.rollout_layout(mesh8, tensor=2)]
  for layout in layouts:
    cfg, graphdef, params = hf.load(path, layout=layout)
    want = layout.param_shardings(model_lib.abstract_params(cfg)[1])
    for x, sh in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
      assert x.sharding.is_equivalent_to(sh, x.ndim), layout.name
    with use_layout(layout):
      logits = jax.jit(model_lib.forward, static_argnums=0)(
          graphdef, params, tokens, positions, mask)
    _assert_real_close(logits, np.asarray(ref), lengths)


@needs_torch
def test_bf16_save_and_load(checkpoints, loaded, tmp_path):
  cfg, _, params = loaded["qwen2"]
  out = str(tmp_path / "bf16")
  hf.save(out, cfg, params, dtype="bfloat16")
  cfg16, _, params16 = hf.load(out)
  assert cfg16.param_dtype == cfg16.compute_dtype == "bfloat16"
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params16)):
    np.testing.assert_array_equal(np.asarray(a).astype(b.dtype), b)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert reloaded.dtype == torch.bfloat16
  cfg32, _, _ = hf.load(out, dtype="float32")
  assert cfg32.param_dtype == "float32"


def test_config_spellings_4x_and_5x():
  v5 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32,
        "num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 32,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "dtype": "bfloat16",
        "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5e5}}
  v4 = {k: v for k, v in v5.items() if k not in ("dtype", "rope_parameters")}
  v4.update(torch_dtype="bfloat16", rope_theta=5e5,
            rope_scaling={**LLAMA3_ROPE, "type": "llama3"})
  del v4["rope_scaling"]["rope_type"]
  a, b = hf_config.from_hf(v5), hf_config.from_hf(v4)
  assert a == b
  assert (a.rope_theta, a.head_dim, a.param_dtype) == (5e5, 8, "bfloat16")
  assert a.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)
  # Our writer's config reads back to the same ModelConfig.
  assert hf_config.from_hf(hf_config.to_hf(a, "bfloat16")) == a
  with pytest.raises(NotImplementedError, match="rope_type 'yarn'"):
    hf_config.from_hf({**v5, "rope_parameters": {"rope_type": "yarn"}})
  with pytest.raises(NotImplementedError, match="o_proj bias"):
    hf_config.from_hf({**v5, "attention_bias": True})


@needs_torch
def test_clear_errors(checkpoints, tmp_path):
  _, src = checkpoints["qwen2"]
  bad = str(tmp_path / "bad")
  shutil.copytree(src, bad)
  config_file = os.path.join(bad, "config.json")
  config = json.load(open(config_file))
  json.dump({**config, "intermediate_size": 96}, open(config_file, "w"))
  with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.(gate|up|"
                     r"down)_proj\.weight' has shape"):
    hf.load(bad)
  json.dump({**config, "architectures": ["MambaForCausalLM"]},
            open(config_file, "w"))
  with pytest.raises(ValueError, match="unsupported architecture.*Mamba"):
    hf.load(bad)
  # Qwen2 weights under a Llama config: the biases are unexpected.
  json.dump({**config, "architectures": ["LlamaForCausalLM"]},
            open(config_file, "w"))
  with pytest.raises(ValueError, match=r"unexpected tensors \['model\.layers"
                     r"\.0\.self_attn\.k_proj\.bias'"):
    hf.load(bad)


# Abridged config.json files of the published checkpoints (4.x spellings).
PUBLISHED = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896,
        "intermediate_size": 4864, "num_attention_heads": 14,
        "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 32768, "use_sliding_window": False,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "vocab_size": 151936, "hidden_act": "silu"},
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 8192, "num_attention_heads": 32,
        "num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                         "low_freq_factor": 1.0, "rope_type": "llama3",
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "vocab_size": 128256, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False},
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
        "intermediate_size": 3072, "num_attention_heads": 16,
        "num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": None,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "vocab_size": 151936, "attention_bias": False,
        "use_sliding_window": False, "sliding_window": None},
    "gemma2-2b": {
        "architectures": ["Gemma2ForCausalLM"], "hidden_size": 2304,
        "intermediate_size": 9216, "num_attention_heads": 8,
        "num_hidden_layers": 26, "num_key_value_heads": 4, "head_dim": 256,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
        "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "float32",
        "vocab_size": 256000},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_match_presets(name):
  got = hf_config.from_hf(PUBLISHED[name], dtype="float32")
  assert got == ModelConfig.preset(name)
