"""Hugging Face checkpoints in and out: `load` and `save`.

  cfg, graphdef, params = hf.load("/ckpt/Qwen2.5-0.5B-Instruct",
                                  layout=train_layout(mesh))
  hf.save("/out/step_1000", cfg, params, tokenizer_dir="/ckpt/Qwen2.5-...")

Supported architectures: LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, Qwen3MoeForCausalLM, Gemma2ForCausalLM (config mapping in
`hf_config`, tensor
names and layouts in `hf_weights`). Everything reads local directories;
nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np

from rlhf_jax.models import hf_config
from rlhf_jax.models import hf_weights
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel.layout import Layout

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
              "float16": np.float16}

# Files of a tokenizer / generation setup copied next to saved weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json",
                   "tokenizer.model", "vocab.json", "merges.txt")


def load(path: str, layout: Layout | None = None, dtype: str | None = None,
         compute_dtype: str | None = None, **runtime):
  """Loads an HF checkpoint directory onto `layout`, one tensor at a time.

  Args:
    path: directory with config.json and *.safetensors (optionally sharded,
      with model.safetensors.index.json).
    layout: target layout (each param goes straight to its sharding); None
      puts everything on the default device.
    dtype: param dtype ("float32", "bfloat16", "float16"); None keeps the
      checkpoint's dtype.
    compute_dtype: activation dtype; None means the param dtype.
    **runtime: `ModelConfig` fields of how the model runs (`scan_layers`,
      `remat`), not in the checkpoint.

  Returns:
    (cfg, graphdef, params) as `model.init_params` returns them.

  Raises:
    ValueError: unsupported architecture, or a missing, unexpected or
      mis-shaped tensor (named in the message).
    NotImplementedError: a checkpoint feature the decoder lacks.
  """
  hf = hf_config.read_json(os.path.join(path, "config.json"))
  arch = hf_config.architecture(hf)
  cfg = hf_config.from_hf(hf, dtype=dtype, compute_dtype=compute_dtype
                         ).replace(**runtime)
  graphdef, abstract = model_lib.abstract_params(cfg)
  shardings = None if layout is None else layout.param_shardings(abstract)
  params = hf_weights.load_params(path, cfg, arch, abstract, shardings)
  return cfg, graphdef, params


def save(path: str, cfg: ModelConfig, params, tokenizer_dir: str | None = None,
         *, dtype: str | None = None, max_shard_size: int = 2 << 30,
         config_overrides: dict | None = None) -> None:
  """Writes params as an HF checkpoint that transformers and vLLM open.

  Args:
    path: output directory (created if needed).
    cfg: the ModelConfig of `params`.
    params: nnx.State of params, any sharding (gathered tensor by tensor).
    tokenizer_dir: copy tokenizer, chat template and generation config files
      from here (usually the directory the policy was loaded from).
    dtype: dtype to write; None keeps cfg.param_dtype.
    max_shard_size: bytes per safetensors file before starting another.
    config_overrides: extra or replaced config.json keys (e.g. the original
      max_position_embeddings, bos/eos ids).
  """
  os.makedirs(path, exist_ok=True)
  dtype = dtype or cfg.param_dtype
  arch = hf_config.family(cfg)
  if dtype not in _NP_DTYPES:
    raise ValueError(
        f"dtype must be one of {sorted(_NP_DTYPES)}, got {dtype!r}")
  np_dtype = np.dtype(_NP_DTYPES[dtype])
  hf_weights.save_params(path, cfg, arch, params, dtype=np_dtype,
                         max_shard_bytes=max_shard_size)
  config = {**hf_config.to_hf(cfg, dtype), **(config_overrides or {})}
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  if tokenizer_dir is not None:
    for name in TOKENIZER_FILES:
      src = os.path.join(tokenizer_dir, name)
      if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(
          os.path.join(path, name)):
        shutil.copyfile(src, os.path.join(path, name))
