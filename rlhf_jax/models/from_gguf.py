"""A llama.cpp GGUF file -> a Hugging Face checkpoint directory.

The command is `python -m rlhf_jax.convert_gguf --gguf=FILE --out=DIR`;
`python -m rlhf_jax.fetch` calls `convert` too. What it covers: the Llama architecture with a byte-level BPE ("gpt2")
vocabulary, tensors stored as F32, F16, BF16, Q8_0, Q4_0 or Q4_1 (the
`gguf` package dequantizes them with numpy; needs `pip install
'rlhf_jax[gguf]'`). Anything else (another architecture, vocabulary model
or pre-tokenizer, another tensor type) is one line naming it.

What it writes (float32 weights; `models/hf.load` and transformers read it):
  model.safetensors        HF tensor names; the query and key projections
                           put back in HF's rotary layout (llama.cpp's
                           converter permutes their rows for its own)
  config.json              LlamaForCausalLM, from the GGUF's llama.* keys
  generation_config.json   bos / eos / pad ids
  tokenizer.json           the BPE vocabulary and merges, the control
                           tokens as special tokens, and the pre-tokenizer
                           the GGUF names (`_PRE_TOKENIZERS`)
  tokenizer_config.json    the chat template and special-token names

Quantized weights stay what they were: dequantizing gives the exact values
the quantized model computes with, in float32, not the original
checkpoint's.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from rlhf_jax.errors import ConfigError, MissingInputError

# llama.cpp's per-layer tensor names -> HF's (after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# tokenizer.ggml.pre -> the tokenizers pre-tokenizer that reproduces it.
# "smollm": every digit on its own, then byte-level without a prefix space
# (llama.cpp's rule for SmolLM; transformers' GGUF loader drops the digit
# split, which changes ids wherever whitespace precedes a digit).
_PRE_TOKENIZERS = ("smollm",)
_CONTROL = 3  # tokenizer.ggml.token_type of special (control) tokens.


def gguf_module():
  try:
    import gguf  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError("reading GGUF files needs the `gguf` package: pip "
                      "install 'rlhf_jax[gguf]'") from None
  return gguf


def _field(reader, key: str, default: Any = None) -> Any:
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's row permutation of a query / key projection.

  llama.cpp's converter reorders each head's rows from HF's rotary layout
  (first halves, then second halves of the pairs) to interleaved pairs:
  rows (h, half, i) -> (h, i, half). This puts them back. `w` is
  [heads * head_dim, in] (HF's [out, in]).
  """
  out, rest = w.shape[0], w.shape[1:]
  half = out // heads // 2
  return (w.reshape(heads, half, 2, *rest).swapaxes(1, 2)
          .reshape(out, *rest))


def _hf_name(name: str) -> str:
  base, suffix = name.rsplit(".", 1)  # "blk.3.attn_q", "weight"
  if base in _GLOBAL_NAMES:
    return f"{_GLOBAL_NAMES[base]}.{suffix}"
  parts = base.split(".")
  if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
  raise ConfigError(f"GGUF tensor {name!r} has no Llama counterpart")


def llama_config(reader) -> dict:
  """config.json of the GGUF's llama.* keys (transformers 4.x and 5.x)."""
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise ConfigError(f"GGUF architecture {arch!r} is not supported; the "
                      "converter covers 'llama'")
  k = lambda name, default=None: _field(reader, f"llama.{name}", default)  # noqa: E731
  heads = int(k("attention.head_count"))
  hidden = int(k("embedding_length"))
  head_dim = int(k("attention.key_length", hidden // heads))
  names = {t.name for t in reader.tensors}
  ids = {name: _field(reader, f"tokenizer.ggml.{name}_token_id")
         for name in ("bos", "eos", "padding")}
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "hidden_size": hidden,
      "intermediate_size": int(k("feed_forward_length")),
      "num_hidden_layers": int(k("block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": int(k("attention.head_count_kv", heads)),
      "head_dim": head_dim,
      "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
      "max_position_embeddings": int(k("context_length")),
      "rms_norm_eps": float(k("attention.layer_norm_rms_epsilon")),
      "rope_theta": float(k("rope.freq_base", 10_000.0)),
      "hidden_act": "silu",
      "attention_bias": False,
      "mlp_bias": False,
      "tie_word_embeddings": "output.weight" not in names,
      "bos_token_id": ids["bos"],
      "eos_token_id": ids["eos"],
      "pad_token_id": ids["padding"],
      "torch_dtype": "float32",
  }


def tensors(reader, cfg: dict) -> dict[str, np.ndarray]:
  """HF name -> float32 array, dequantized, rotary rows put back."""
  gguf = gguf_module()
  out = {}
  for t in reader.tensors:
    kind = t.tensor_type.name
    if kind not in _TENSOR_TYPES:
      raise ConfigError(f"GGUF tensor {t.name} is {kind}; the converter "
                        f"reads {', '.join(_TENSOR_TYPES)}")
    # numpy shape: GGUF lists dimensions innermost first.
    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    w = w.reshape([int(d) for d in reversed(t.shape)])
    name = _hf_name(t.name)
    if name.endswith("q_proj.weight"):
      w = unpermute_rotary(w, cfg["num_attention_heads"])
    elif name.endswith("k_proj.weight"):
      w = unpermute_rotary(w, cfg["num_key_value_heads"])
    out[name] = np.ascontiguousarray(w)
  return out


def tokenizer_json(reader) -> str:
  """tokenizer.json (the `tokenizers` library's format) of the GGUF's
  vocabulary, merges, special tokens and pre-tokenizer."""
  from tokenizers import (AddedToken, Tokenizer, decoders, models,  # pylint: disable=g-import-not-at-top
                          pre_tokenizers, processors)
  kind = _field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise ConfigError(f"GGUF tokenizer model {kind!r} is not supported; the "
                      "converter covers byte-level BPE ('gpt2')")
  pre = _field(reader, "tokenizer.ggml.pre")
  if pre not in _PRE_TOKENIZERS:
    raise ConfigError(f"GGUF pre-tokenizer {pre!r} is not supported; the "
                      f"converter covers {', '.join(_PRE_TOKENIZERS)}")
  tokens = _field(reader, "tokenizer.ggml.tokens")
  types = _field(reader, "tokenizer.ggml.token_type")
  merges = [tuple(m.split(" ", 1)) for m in
            _field(reader, "tokenizer.ggml.merges")]
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                             merges=merges, fuse_unk=False,
                             byte_fallback=False))
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  tok.add_special_tokens([
      AddedToken(t, special=True, normalized=False)
      for t, kind in zip(tokens, types) if kind == _CONTROL])
  return tok.to_str()


def tokenizer_config(reader) -> dict:
  tokens = _field(reader, "tokenizer.ggml.tokens")
  name = lambda key: (None if _field(reader, key) is None  # noqa: E731
                      else tokens[int(_field(reader, key))])
  out = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "bos_token": name("tokenizer.ggml.bos_token_id"),
      "eos_token": name("tokenizer.ggml.eos_token_id"),
      "pad_token": name("tokenizer.ggml.padding_token_id"),
      "unk_token": name("tokenizer.ggml.unknown_token_id"),
      "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token",
                                   False)),
      "model_max_length": int(_field(reader, "llama.context_length")),
  }
  template = _field(reader, "tokenizer.chat_template")
  if template is not None:
    out["chat_template"] = template
  return out


def convert(gguf_path: str, out: str) -> dict:
  """Writes the HF directory `out` from `gguf_path`; returns config.json."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(gguf_path):
    raise MissingInputError(f"--gguf={gguf_path}: no such file")
  try:
    reader = gguf_module().GGUFReader(gguf_path)
  except (ValueError, OSError) as e:  # Bad magic, truncated file.
    raise ConfigError(f"{gguf_path}: not a readable GGUF file ({e})") from None
  cfg = llama_config(reader)
  tok_json = tokenizer_json(reader)  # Checks before the slow part.
  weights = tensors(reader, cfg)
  os.makedirs(out, exist_ok=True)
  save_file(weights, os.path.join(out, "model.safetensors"),
            metadata={"format": "pt"})
  _write_json(os.path.join(out, "config.json"), cfg)
  _write_json(os.path.join(out, "generation_config.json"), {
      k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
  with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
    f.write(tok_json)
  _write_json(os.path.join(out, "tokenizer_config.json"),
              tokenizer_config(reader))
  return cfg


def _write_json(path: str, obj: dict) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, ensure_ascii=False)
