"""A tiny random Qwen2-family HF checkpoint with a trained tokenizer, offline.

  write(path, corpus, seed=0)   # config.json, model.safetensors, tokenizer

The tokenizer is a byte-level BPE trained with the `tokenizers` library on
`corpus` (ChatML special tokens, a ChatML chat template with a default system
prompt, eos "<|im_end|>", pad "<|endoftext|>", as Qwen2.5-Instruct has). The
weights are `model.init_params` of a 2-layer Qwen2 config (QKV bias, tied
embeddings), written with `hf.save`, so the directory loads through the same
`hf.load` / `HFTokenizer.from_dir` path a real checkpoint does. Used by the
`runlocal` configs and tests; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from rlhf_jax.models import hf
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig

# Qwen2.5's tool-call tags are single tokens too (configs/gsm8k_tool.py).
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>",
            "</tool_call>")
DEFAULT_SYSTEM = "You are a helpful assistant."
# Qwen2.5-Instruct's template, without the tool-calling branches.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "  {%- if not (message.role == 'system' and loop.first) %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content"
    " + '<|im_end|>\\n' }}\n"
    "  {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}\n")


def write_tokenizer(path: str, corpus: Sequence[str], vocab_size: int = 512
                    ) -> tokenizers.Tokenizer:
  """Trains a byte-level BPE on `corpus` and writes the tokenizer files."""
  os.makedirs(path, exist_ok=True)
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(
      list(corpus) + [DEFAULT_SYSTEM] * 8,
      trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                          show_progress=False))
  tok.save(os.path.join(path, "tokenizer.json"))
  config = {"tokenizer_class": "Qwen2TokenizerFast",
            "bos_token": None, "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
            "model_max_length": 32768}
  with open(os.path.join(path, "tokenizer_config.json"), "w",
            encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  ids = [tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
  with open(os.path.join(path, "generation_config.json"), "w",
            encoding="utf-8") as f:
    json.dump({"eos_token_id": ids, "pad_token_id": ids[1]}, f, indent=2)
  return tok


def qwen2_config(vocab_size: int, **overrides) -> ModelConfig:
  """A 2-layer Qwen2-family ModelConfig (QKV bias, tied embeddings, GQA)."""
  base = dict(vocab_size=vocab_size, num_layers=2, embed_dim=64, num_heads=4,
              num_kv_heads=2, head_dim=16, mlp_dim=128, rope_theta=1e6,
              qkv_bias=True, tie_embeddings=True, norm_eps=1e-6)
  return ModelConfig(**{**base, **overrides})


def write(path: str, corpus: Sequence[str], *, seed: int = 0,
          tokenizer_vocab: int = 512, pad_vocab_to: int = 64,
          **model_overrides) -> ModelConfig:
  """Writes a tiny random Qwen2 checkpoint + tokenizer into `path`.

  Args:
    path: output directory (created).
    corpus: texts the BPE tokenizer is trained on.
    seed: init seed of the weights.
    tokenizer_vocab: BPE vocab size target.
    pad_vocab_to: the model's vocab is the tokenizer's rounded up to a
      multiple of this (real checkpoints pad it too).
    **model_overrides: ModelConfig fields replacing `qwen2_config`'s.

  Returns:
    The ModelConfig written.
  """
  tok = write_tokenizer(path, corpus, tokenizer_vocab)
  n = tok.get_vocab_size(with_added_tokens=True)
  cfg = qwen2_config(-(-n // pad_vocab_to) * pad_vocab_to, **model_overrides)
  _, params = model_lib.init_params(cfg, seed)
  hf.save(path, cfg, params, config_overrides={
      "eos_token_id": tok.token_to_id("<|im_end|>"),
      "bos_token_id": tok.token_to_id("<|endoftext|>")})
  return cfg
