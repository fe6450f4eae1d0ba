"""The GGUF converter on small files written here with gguf's own writer.

The oracle is the HF-layout weights the test starts from: it writes them the
way llama.cpp's converter does (query and key rows interleaved per head,
dimensions listed innermost first, some tensors quantized to Q8_0), and the
conversion must give them back. Unsupported input is one line naming it.
The real model's checks (tokenizer, logits, greedy tokens against
transformers' own GGUF loader) are in tests/models/test_real_model.py.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from rlhf_jax.errors import ConfigError  # noqa: E402
from rlhf_jax.models import from_gguf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HIDDEN, HEADS, KV_HEADS, MLP, LAYERS = 32, 4, 2, 48, 2
HEAD_DIM = HIDDEN // HEADS
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab",
          "Ġ", "ĠĠ", "0", "1", "2", "4"]


def llama_cpp_permute(w, heads):
  """llama.cpp's convert_hf_to_gguf rotary permutation of q/k rows."""
  return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def hf_weights(rng):
  """HF name -> [out, in] float32 weights of a 2-layer Llama."""
  w = {"model.embed_tokens.weight": (len(TOKENS), HIDDEN),
       "model.norm.weight": (HIDDEN,)}
  for i in range(LAYERS):
    p = f"model.layers.{i}."
    w.update({
        p + "input_layernorm.weight": (HIDDEN,),
        p + "post_attention_layernorm.weight": (HIDDEN,),
        p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        p + "mlp.gate_proj.weight": (MLP, HIDDEN),
        p + "mlp.up_proj.weight": (MLP, HIDDEN),
        p + "mlp.down_proj.weight": (HIDDEN, MLP),
    })
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in w.items()}


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf):
  if hf == "model.embed_tokens.weight":
    return "token_embd.weight"
  if hf == "model.norm.weight":
    return "output_norm.weight"
  _, _, i, *rest = hf.split(".")
  return f"blk.{i}.{GGUF_NAMES['.'.join(rest[:-1])]}.weight"


def write_gguf(path, weights, *, arch="llama", pre="smollm", q8=()):
  """A GGUF file as llama.cpp writes one; names in `q8` stored as Q8_0."""
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(LAYERS)
  w.add_context_length(128)
  w.add_embedding_length(HIDDEN)
  w.add_feed_forward_length(MLP)
  w.add_head_count(HEADS)
  w.add_head_count_kv(KV_HEADS)
  w.add_rope_freq_base(100000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(TOKENS)
  w.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
  w.add_token_merges(["a b", "Ġ Ġ"])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_pad_token_id(2)
  w.add_unk_token_id(0)
  w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
  for name, value in weights.items():
    if name.endswith("q_proj.weight"):
      value = llama_cpp_permute(value, HEADS)
    elif name.endswith("k_proj.weight"):
      value = llama_cpp_permute(value, KV_HEADS)
    if name in q8:
      kind = gguf.GGMLQuantizationType.Q8_0
      w.add_tensor(gguf_name(name), gguf.quants.quantize(value, kind),
                   raw_dtype=kind)
    else:
      w.add_tensor(gguf_name(name), value)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.fixture
def weights():
  return hf_weights(np.random.default_rng(0))


def test_weights_config_and_tokenizer_round_trip(tmp_path, weights):
  from safetensors.numpy import load_file
  q8 = {"model.layers.1.self_attn.q_proj.weight",
        "model.layers.0.mlp.up_proj.weight"}
  write_gguf(str(tmp_path / "m.gguf"), weights, q8=q8)
  from_gguf.convert(str(tmp_path / "m.gguf"), str(tmp_path / "hf"))
  got = load_file(str(tmp_path / "hf" / "model.safetensors"))
  assert set(got) == set(weights)  # Tied: no lm_head.
  for name, want in weights.items():
    if name in q8:  # Q8_0: blocks of 32 with one fp16 scale, int8 values.
      scale = np.abs(want).reshape(-1, 32).max(1).repeat(32) / 127
      err = np.abs(got[name] - want).reshape(-1)
      # Half a step, plus the fp16 rounding of the scale over 127 steps.
      assert (err <= scale * (0.5 + 127 * 2.0**-11)).all(), name
      assert err.max() > 0  # Quantized indeed (the bound is not vacuous).
    else:
      np.testing.assert_array_equal(got[name], want, err_msg=name)
  cfg = json.load(open(tmp_path / "hf" / "config.json"))
  assert cfg["architectures"] == ["LlamaForCausalLM"]
  assert (cfg["hidden_size"], cfg["num_attention_heads"],
          cfg["num_key_value_heads"], cfg["head_dim"],
          cfg["intermediate_size"], cfg["num_hidden_layers"],
          cfg["vocab_size"], cfg["rope_theta"], cfg["eos_token_id"],
          cfg["tie_word_embeddings"]) == (
              HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS, len(TOKENS),
              100000.0, 2, True)
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
  enc = tok.encode("  402<|im_end|>ab")
  # Two spaces merge; each digit stands alone; the special token whole.
  assert enc.tokens == ["ĠĠ", "4", "0", "2", "<|im_end|>", "ab"]
  tc = json.load(open(tmp_path / "hf" / "tokenizer_config.json"))
  assert (tc["eos_token"], tc["bos_token"]) == ("<|im_end|>", "<|im_start|>")
  assert "chat_template" in tc


@pytest.mark.parametrize("kw,message", [
    (dict(arch="gpt2"), "GGUF architecture 'gpt2' is not supported"),
    (dict(pre="llama-bpe"), "GGUF pre-tokenizer 'llama-bpe' is not supported"),
])
def test_unsupported_input_is_one_line(tmp_path, weights, kw, message):
  path = str(tmp_path / "m.gguf")
  write_gguf(path, weights, **kw)
  with pytest.raises(ConfigError, match=message):
    from_gguf.convert(path, str(tmp_path / "hf"))
  assert not os.path.exists(tmp_path / "hf")  # Checked before writing.
  out = subprocess.run(
      [sys.executable, "-m", "rlhf_jax.convert_gguf", f"--gguf={path}",
       f"--out={tmp_path / 'hf'}"], cwd=ROOT, capture_output=True, text=True,
      timeout=120)
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [f"error: {message}" + (
      "; the converter covers 'llama'" if "architecture" in message else
      "; the converter covers smollm")]
