"""Hugging Face `config.json` <-> `ModelConfig`, for the supported families.

Reads both transformers 4.x and 5.x spellings: top-level `rope_theta` +
`rope_scaling` (4.x) or `rope_parameters` (5.x), `torch_dtype` (4.x) or
`dtype` (5.x), `rope_type` or the older `type` inside the scaling dict.
Writes a config that both spellings' readers accept.

Anything the decoder cannot express (an o_proj or MLP bias, Qwen2 sliding
windows, RoPE types other than default and llama3, a Gemma 2 layer pattern
other than local/global alternation, dense layers in a Qwen3-MoE) raises
instead of loading silently wrong.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from rlhf_jax.errors import ConfigError
from rlhf_jax.models.config import ModelConfig, RopeScaling

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Qwen3MoeForCausalLM", "Gemma2ForCausalLM")
_MODEL_TYPE = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
               "Gemma2ForCausalLM": "gemma2"}
_QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Class defaults of transformers where config.json may omit the key.
_DEFAULT_HEAD_DIM = {"Qwen3ForCausalLM": 128, "Qwen3MoeForCausalLM": 128,
                     "Gemma2ForCausalLM": 256}
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


def read_json(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def architecture(hf: Mapping[str, Any]) -> str:
  """The supported architecture named by a config.json dict, or raise."""
  archs = hf.get("architectures") or []
  if len(archs) != 1 or archs[0] not in ARCHITECTURES:
    raise ConfigError(
        f"unsupported architecture {archs!r} (model_type "
        f"{hf.get('model_type')!r}); supported: {list(ARCHITECTURES)}")
  return archs[0]


def _unsupported(arch: str, what: str):
  return NotImplementedError(f"{arch}: {what} is not supported by the decoder")


def _rope(arch: str, hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
  """(theta, scaling) from rope_parameters (5.x) or rope_theta/rope_scaling."""
  params = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {}) or params
  theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return float(theta), None
  if kind != "llama3":
    raise _unsupported(arch, f"rope_type {kind!r}")
  return float(theta), RopeScaling(
      factor=float(scaling["factor"]),
      low_freq_factor=float(scaling["low_freq_factor"]),
      high_freq_factor=float(scaling["high_freq_factor"]),
      original_max_position=int(scaling["original_max_position_embeddings"]))


def checkpoint_dtype(hf: Mapping[str, Any]) -> str:
  """The checkpoint's dtype name ("float32" when the config has none)."""
  name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  return str(name).removeprefix("torch.")


def from_hf(hf: Mapping[str, Any], *, dtype: str | None = None,
            compute_dtype: str | None = None) -> ModelConfig:
  """Maps a config.json dict to a ModelConfig.

  Args:
    hf: the parsed config.json.
    dtype: param dtype; None keeps the checkpoint's dtype.
    compute_dtype: activation dtype; None means the param dtype.

  Returns:
    The ModelConfig.

  Raises:
    ValueError: unsupported architecture.
    NotImplementedError: a feature of the checkpoint the decoder lacks.
  """
  arch = architecture(hf)
  heads = int(hf["num_attention_heads"])
  head_dim = hf.get("head_dim") or _DEFAULT_HEAD_DIM.get(
      arch, hf["hidden_size"] // heads)
  theta, scaling = _rope(arch, hf)
  dtype = dtype or checkpoint_dtype(hf)
  kw = dict(
      vocab_size=int(hf["vocab_size"]),
      num_layers=int(hf["num_hidden_layers"]),
      embed_dim=int(hf["hidden_size"]),
      num_heads=heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(head_dim),
      mlp_dim=int(hf["intermediate_size"]),
      rope_theta=theta,
      rope_scaling=scaling,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings",
                                 arch == "Gemma2ForCausalLM")),
      param_dtype=dtype,
      compute_dtype=compute_dtype or dtype,
  )
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
  if arch == "Gemma2ForCausalLM":
    if act not in _TANH_GELU:
      raise _unsupported(arch, f"activation {act!r}")
    kw.update(mlp_activation="gelu", norm_plus_one=True, post_norms=True,
              embed_scale=True,
              query_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
              attn_logit_softcap=hf.get("attn_logit_softcapping"),
              final_logit_softcap=hf.get("final_logit_softcapping"),
              sliding_window=hf.get("sliding_window"))
  elif act != "silu":
    raise _unsupported(arch, f"activation {act!r}")
  if hf.get("mlp_bias"):
    raise _unsupported(arch, "mlp_bias=True")
  if arch != "Qwen2ForCausalLM" and hf.get("attention_bias"):
    raise _unsupported(arch, "attention_bias=True (o_proj bias)")
  if arch in ("Qwen2ForCausalLM",) + _QWEN3 and hf.get("use_sliding_window"):
    raise _unsupported(arch, "use_sliding_window=True")
  kw["qkv_bias"] = arch == "Qwen2ForCausalLM"
  kw["qk_norm"] = arch in _QWEN3
  if arch == "Qwen3MoeForCausalLM":
    kw.update(_experts(arch, hf))
  cfg = ModelConfig(**kw)
  _check_layer_types(arch, hf, cfg)
  return cfg


def _experts(arch: str, hf: Mapping[str, Any]) -> dict:
  """ModelConfig's MoE fields from a Qwen3-MoE config.json (4.x names the
  expert count `num_experts`, 5.x `num_local_experts`); every layer must
  be sparse (the layers are scanned: one structure for all)."""
  if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
    raise _unsupported(arch, "dense MLP layers between sparse ones "
                       f"(decoder_sparse_step={hf.get('decoder_sparse_step')},"
                       f" mlp_only_layers={hf.get('mlp_only_layers')})")
  return dict(
      num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
      experts_per_token=int(hf["num_experts_per_tok"]),
      expert_mlp_dim=int(hf["moe_intermediate_size"]),
      norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def _check_layer_types(arch: str, hf: Mapping[str, Any], cfg: ModelConfig):
  """5.x configs list each layer's attention; it must match our pattern."""
  types = hf.get("layer_types")
  if not types:
    return
  ours = ["sliding_attention" if cfg.is_local_layer(i) else "full_attention"
          for i in range(cfg.num_layers)]
  if list(types) != ours:
    raise _unsupported(arch, f"layer_types {list(types)} (expected {ours})")


def family(cfg: ModelConfig) -> str:
  """The HF architecture that expresses `cfg` exactly, or raise."""
  if cfg.post_norms or cfg.norm_plus_one:
    arch = "Gemma2ForCausalLM"
  elif cfg.is_moe:
    arch = "Qwen3MoeForCausalLM"
  elif cfg.qk_norm:
    arch = "Qwen3ForCausalLM"
  elif cfg.qkv_bias:
    arch = "Qwen2ForCausalLM"
  else:
    arch = "LlamaForCausalLM"
  gemma = arch == "Gemma2ForCausalLM"
  mismatch = [
      name for name, ok in [
          ("norm_plus_one", cfg.norm_plus_one == gemma),
          ("post_norms", cfg.post_norms == gemma),
          ("embed_scale", cfg.embed_scale == gemma),
          ("mlp_activation", (cfg.mlp_activation == "gelu") == gemma),
          ("qkv_bias", cfg.qkv_bias == (arch == "Qwen2ForCausalLM")),
          ("qk_norm", cfg.qk_norm == (arch in _QWEN3)),
          ("num_experts", cfg.is_moe == (arch == "Qwen3MoeForCausalLM")),
          ("rope_scaling", cfg.rope_scaling is None
           or arch == "LlamaForCausalLM"),
          ("softcaps/sliding_window/query_scale", gemma or (
              cfg.attn_logit_softcap is None and cfg.sliding_window is None
              and cfg.final_logit_softcap is None and cfg.query_scale is None)),
      ] if not ok]
  if mismatch:
    raise ValueError(f"ModelConfig is not expressible as {arch}: {mismatch}")
  return arch


def to_hf(cfg: ModelConfig, dtype: str) -> dict:
  """A config.json dict for `cfg`, readable by transformers 4.x and 5.x."""
  arch = family(cfg)
  rope = {"rope_type": "default"}
  max_pos = 32_768
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    rope = {"rope_type": "llama3", "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position}
    max_pos = int(s.factor * s.original_max_position)
  hf = {
      "architectures": [arch], "model_type": _MODEL_TYPE[arch],
      "vocab_size": cfg.vocab_size, "num_hidden_layers": cfg.num_layers,
      "hidden_size": cfg.embed_dim, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "intermediate_size": cfg.mlp_dim, "rms_norm_eps": cfg.norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": max_pos,
      "rope_theta": cfg.rope_theta,  # 4.x spelling
      "rope_scaling": None if cfg.rope_scaling is None else rope,  # 4.x
      "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},  # 5.x
      "dtype": dtype, "torch_dtype": dtype,
      "hidden_act": "silu", "attention_bias": False, "use_cache": True,
  }
  if arch == "Qwen2ForCausalLM":
    hf.pop("attention_bias")
  if arch == "LlamaForCausalLM":
    hf["mlp_bias"] = False
  if arch in ("Qwen2ForCausalLM",) + _QWEN3:
    hf["use_sliding_window"] = False
  if arch == "Qwen3MoeForCausalLM":
    hf.update(num_experts=cfg.num_experts,  # 4.x
              num_local_experts=cfg.num_experts,  # 5.x
              num_experts_per_tok=cfg.experts_per_token,
              moe_intermediate_size=cfg.expert_mlp_dim,
              norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
              mlp_only_layers=[], output_router_logits=False)
  if arch == "Gemma2ForCausalLM":
    hf.update(
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=_round_if_int(cfg.scores_scale ** -2),
        attn_logit_softcapping=cfg.attn_logit_softcap,
        final_logit_softcapping=cfg.final_logit_softcap,
        sliding_window=cfg.sliding_window, max_position_embeddings=8192)
    if cfg.sliding_window is None:
      raise ValueError("Gemma2ForCausalLM needs a sliding_window")
    hf["layer_types"] = ["sliding_attention" if cfg.is_local_layer(i)
                         else "full_attention" for i in range(cfg.num_layers)]
  return hf


def _round_if_int(x: float) -> float | int:
  return round(x) if abs(x - round(x)) < 1e-6 * max(1.0, abs(x)) else x


def load_config(path: str, **kw) -> ModelConfig:
  """ModelConfig of the HF checkpoint directory `path` (see `from_hf`)."""
  return from_hf(read_json(os.path.join(path, "config.json")), **kw)
