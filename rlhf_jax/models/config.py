"""Typed, frozen model configuration for the decoder family, with presets.

One decoder covers Llama 3, Qwen2, Qwen3, Qwen3-MoE and Gemma 2 by
switches: norm form, RoPE theta and scaling, GQA, gated MLP activation, QKV
bias, QK-norm, tied embeddings, attention and final-logit soft-caps,
post-norms, embedding scale, routed experts in place of the MLP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# The choices of ModelConfig's string fields, stated once (the config
# sections validate against these).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
          "float16": jnp.float16}
REMAT_POLICIES = ("none", "full", "dots")
ATTENTION_IMPLS = ("auto", "chunked", "splash", "cudnn", "reference")
WEIGHT_QUANTS = ("none", "int8", "fp8")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""
  factor: float = 32.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """LoRA adapters on the named block projections (`models/lora.py`): each
  weight W acts as W + (alpha / rank) * A @ B, A [in..., rank] random,
  B [rank, out...] born zero."""
  rank: int
  alpha: float
  targets: tuple[str, ...] = ("q", "k", "v", "o")

  def __post_init__(self):
    if self.rank < 1:
      raise ValueError(f"rank must be >= 1, got {self.rank}")
    if self.alpha <= 0:
      raise ValueError(f"alpha must be > 0, got {self.alpha}")
    unknown = sorted(set(self.targets) - set(LORA_TARGETS))
    if unknown or not self.targets:
      raise ValueError(f"targets must be a non-empty subset of "
                       f"{LORA_TARGETS}, got {tuple(self.targets)}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and family switches of a decoder-only transformer."""
  vocab_size: int
  num_layers: int
  embed_dim: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  norm_eps: float = 1e-6
  norm_plus_one: bool = False     # Gemma: x * (1 + w).
  mlp_activation: str = "silu"    # "silu" (SwiGLU) or "gelu" (GeGLU, tanh).
  qkv_bias: bool = False          # Qwen2.
  qk_norm: bool = False           # Qwen3: RMSNorm on each q and k head.
  tie_embeddings: bool = False
  post_norms: bool = False        # Gemma 2: norms after attention and MLP.
  embed_scale: bool = False       # Gemma: embeddings times sqrt(embed_dim).
  query_scale: float | None = None  # Scores scale; None means head_dim**-0.5.
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  sliding_window: int | None = None  # Gemma 2: every other layer is local.
  # Mixture of experts (`models/moe.py`): with num_experts > 0 every layer's
  # MLP is num_experts gated MLPs of expert_mlp_dim, each token through the
  # experts_per_token its router ranks first (weights renormalised over
  # them with norm_topk_prob); mlp_dim is then unused.
  num_experts: int = 0
  experts_per_token: int = 0
  expert_mlp_dim: int = 0
  norm_topk_prob: bool = True
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  # How the layers run (not part of a checkpoint): under `jax.lax.scan` over
  # the stacked layer params (compile time independent of depth) or a
  # Python loop over them; activation checkpointing of each layer: "none",
  # "full" (recompute everything in the backward pass) or "dots" (save the
  # matmul outputs, recompute the rest).
  scan_layers: bool = True
  remat: str = "none"
  # Full-sequence attention (training, prefill): "auto" | "chunked" |
  # "reference" | "splash" | "cudnn" (kernels_pallas/flash_attention.py).
  attention: str = "auto"
  # The chunked path's query and key block (each block pair is one step of
  # its loops): a GPU pays per step in launches, so larger blocks there trade
  # score memory ([rows, heads, block, block] fp32) for fewer steps.
  attention_block: int = 128
  # Log-probs from hidden states in [rows, vocab] blocks of logits
  # (`rl/logprobs.head_logprobs`); (0, 0): one block, the whole [B*T, V].
  logprob_chunks: tuple[int, int] = (1024, 8192)
  # The grouped layout's prefix part (responses over their prompt's keys,
  # `models/grouped_forward.py`): fp32 score elements per block of the
  # chunked path, per (group, query head). Large blocks: few sequential loop steps, which
  # a GPU pays for in launches (docs/results.md, GPU).
  prefix_block_scores: int = 1024 * 2048
  # Trainable LoRA adapters next to the (then frozen) weights; None: none.
  lora: LoraSpec | None = None
  # Block projections stored "int8" / "fp8" with per-channel scales (a
  # rollout copy, `models/rollout_copy.py`); "none": in param_dtype.
  weight_quant: str = "none"

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads}")
    if self.mlp_activation not in ("silu", "gelu"):
      raise ValueError(
          f"mlp_activation must be 'silu' or 'gelu', got {self.mlp_activation!r}")
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"{name} must be one of {sorted(DTYPES)}, "
                         f"got {getattr(self, name)!r}")
    if self.weight_quant not in WEIGHT_QUANTS:
      raise ValueError(f"weight_quant must be one of {WEIGHT_QUANTS}, got "
                       f"{self.weight_quant!r}")
    if self.attention not in ATTENTION_IMPLS:
      raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got "
                       f"{self.attention!r}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {REMAT_POLICIES}, got "
                       f"{self.remat!r}")
    if self.num_experts:
      if not 1 <= self.experts_per_token <= self.num_experts:
        raise ValueError(f"experts_per_token={self.experts_per_token} must "
                         f"be in 1..num_experts={self.num_experts}")
      if self.expert_mlp_dim < 1:
        raise ValueError("a mixture of experts needs expert_mlp_dim >= 1, "
                         f"got {self.expert_mlp_dim}")
      routed = sorted({"gate", "up", "down"} & set(
          self.lora.targets if self.lora else ()))
      if routed:
        raise ValueError(f"LoRA on the routed experts' {routed}: not "
                         "implemented (target the attention projections)")
      if self.weight_quant != "none":
        raise ValueError(f"weight_quant={self.weight_quant!r} with routed "
                         "experts: not implemented")

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  @property
  def param_jnp_dtype(self):
    return DTYPES[self.param_dtype]

  @property
  def compute_jnp_dtype(self):
    return DTYPES[self.compute_dtype]

  @property
  def scores_scale(self) -> float:
    return self.head_dim**-0.5 if self.query_scale is None else self.query_scale

  def is_local_layer(self, layer):
    """Gemma 2 alternates local (sliding window) and global layers: layer 0
    is local. `layer` may be traced (a scan index): a bool array then."""
    if self.sliding_window is None:
      return False
    if isinstance(layer, int):
      return layer % 2 == 0
    return jnp.asarray(layer) % 2 == 0

  def replace(self, **kwargs) -> "ModelConfig":
    return dataclasses.replace(self, **kwargs)

  def num_params(self) -> int:
    d, h, n, k, f = (self.embed_dim, self.num_heads, self.num_kv_heads,
                     self.head_dim, self.mlp_dim)
    attn = d * k * (2 * h + 2 * n) + (self.qkv_bias and (h + 2 * n) * k)
    mlp = (d * self.num_experts * (1 + 3 * self.expert_mlp_dim)
           if self.is_moe else 3 * d * f)
    per_layer = attn + mlp + d * (4 if self.post_norms else 2)
    per_layer += 2 * k if self.qk_norm else 0
    head = 0 if self.tie_embeddings else d * self.vocab_size
    return self.num_layers * per_layer + d * self.vocab_size + head + d

  # Presets. Real shapes follow the published config.json of each model.
  @classmethod
  def tiny(cls, **kw) -> "ModelConfig":
    base = dict(vocab_size=256, num_layers=2, embed_dim=128, num_heads=4,
                num_kv_heads=2, head_dim=32, mlp_dim=384)
    return cls(**{**base, **kw})

  @classmethod
  def qwen2_5_0_5b(cls, **kw) -> "ModelConfig":
    base = dict(vocab_size=151936, num_layers=24, embed_dim=896, num_heads=14,
                num_kv_heads=2, head_dim=64, mlp_dim=4864, rope_theta=1e6,
                qkv_bias=True, tie_embeddings=True, norm_eps=1e-6)
    return cls(**{**base, **kw})

  @classmethod
  def qwen2_5_1_5b(cls, **kw) -> "ModelConfig":
    base = dict(vocab_size=151936, num_layers=28, embed_dim=1536, num_heads=12,
                num_kv_heads=2, head_dim=128, mlp_dim=8960, rope_theta=1e6,
                qkv_bias=True, tie_embeddings=True, norm_eps=1e-6)
    return cls(**{**base, **kw})

  @classmethod
  def qwen2_5_7b(cls, **kw) -> "ModelConfig":
    base = dict(vocab_size=152064, num_layers=28, embed_dim=3584, num_heads=28,
                num_kv_heads=4, head_dim=128, mlp_dim=18944, rope_theta=1e6,
                qkv_bias=True, tie_embeddings=False, norm_eps=1e-6)
    return cls(**{**base, **kw})

  @classmethod
  def llama3_1_8b(cls, **kw) -> "ModelConfig":
    base = dict(vocab_size=128256, num_layers=32, embed_dim=4096,
                num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336,
                rope_theta=500_000.0,
                rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0,
                                         original_max_position=8192),
                tie_embeddings=False, norm_eps=1e-5)
    return cls(**{**base, **kw})

  @classmethod
  def llama3_2_1b(cls, **kw) -> "ModelConfig":
    base = dict(vocab_size=128256, num_layers=16, embed_dim=2048,
                num_heads=32, num_kv_heads=8, head_dim=64, mlp_dim=8192,
                rope_theta=500_000.0, rope_scaling=RopeScaling(),
                tie_embeddings=True, norm_eps=1e-5)
    return cls(**{**base, **kw})

  @classmethod
  def qwen3_0_6b(cls, **kw) -> "ModelConfig":
    base = dict(vocab_size=151936, num_layers=28, embed_dim=1024,
                num_heads=16, num_kv_heads=8, head_dim=128, mlp_dim=3072,
                rope_theta=1e6, qk_norm=True, tie_embeddings=True,
                norm_eps=1e-6)
    return cls(**{**base, **kw})

  @classmethod
  def tiny_moe(cls, **kw) -> "ModelConfig":
    """Qwen3-MoE-like: QK-norm, 8 experts, top 2."""
    base = dict(vocab_size=256, num_layers=2, embed_dim=64, num_heads=4,
                num_kv_heads=2, head_dim=16, mlp_dim=128, qk_norm=True,
                num_experts=8, experts_per_token=2, expert_mlp_dim=32)
    return cls(**{**base, **kw})

  @classmethod
  def qwen3_30b_a3b(cls, **kw) -> "ModelConfig":
    base = dict(vocab_size=151936, num_layers=48, embed_dim=2048,
                num_heads=32, num_kv_heads=4, head_dim=128, mlp_dim=6144,
                rope_theta=1e6, qk_norm=True, tie_embeddings=False,
                norm_eps=1e-6, num_experts=128, experts_per_token=8,
                expert_mlp_dim=768)
    return cls(**{**base, **kw})

  @classmethod
  def gemma2_2b(cls, **kw) -> "ModelConfig":
    base = dict(vocab_size=256000, num_layers=26, embed_dim=2304, num_heads=8,
                num_kv_heads=4, head_dim=256, mlp_dim=9216, rope_theta=10_000.0,
                norm_plus_one=True, mlp_activation="gelu", tie_embeddings=True,
                post_norms=True, embed_scale=True, query_scale=256**-0.5,
                attn_logit_softcap=50.0, final_logit_softcap=30.0,
                sliding_window=4096, norm_eps=1e-6)
    return cls(**{**base, **kw})

  @classmethod
  def preset(cls, name: str, **kw: Any) -> "ModelConfig":
    presets = {"tiny": cls.tiny, "qwen2.5-0.5b": cls.qwen2_5_0_5b,
               "qwen2.5-1.5b": cls.qwen2_5_1_5b, "qwen2.5-7b": cls.qwen2_5_7b,
               "llama3.2-1b": cls.llama3_2_1b, "llama3.1-8b": cls.llama3_1_8b,
               "qwen3-0.6b": cls.qwen3_0_6b, "gemma2-2b": cls.gemma2_2b,
               "tiny-moe": cls.tiny_moe,
               "qwen3-30b-a3b": cls.qwen3_30b_a3b}
    if name not in presets:
      raise ValueError(f"unknown model preset {name!r}; known: {sorted(presets)}")
    return presets[name](**kw)
