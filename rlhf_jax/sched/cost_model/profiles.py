"""Model profiles: the few shape numbers roofline costs need.

Shapes come from the public model configs (HF config.json of each release, and
the LLaMA paper's Table 2 for LLaMA-1 13B/33B/65B). `tiny` and `small` mirror
the CPU-sized presets the engine and tests use.
"""

import dataclasses
import functools

BYTES_BF16 = 2


@dataclasses.dataclass(frozen=True)
class ModelProfile:
  """Decoder-only transformer shape.

  Attributes:
    name: profile name.
    n_params: parameter count.
    n_layers: transformer blocks.
    d_model: hidden size.
    n_heads: query heads.
    n_kv_heads: key/value heads (GQA).
    head_dim: per-head dimension.
  """

  name: str
  n_params: float
  n_layers: int
  d_model: int
  n_heads: int
  n_kv_heads: int
  head_dim: int

  @functools.cached_property  # The simulator reads these per decode step.
  def weight_bytes(self) -> float:
    """BF16 weight bytes."""
    return self.n_params * BYTES_BF16

  @functools.cached_property
  def kv_bytes_per_token(self) -> float:
    """BF16 K and V bytes one token occupies across all layers."""
    return 2 * self.n_layers * self.n_kv_heads * self.head_dim * BYTES_BF16

  def fwd_flops_per_token(self, context: float) -> float:
    """Forward FLOPs of one token attending to `context` earlier tokens."""
    attention = 4 * self.n_layers * self.n_heads * self.head_dim * context
    return 2 * self.n_params + attention


_MODELS = {
    m.name: m for m in [
        ModelProfile("qwen2.5-3b", 3.09e9, 36, 2048, 16, 2, 128),
        ModelProfile("qwen2.5-7b", 7.62e9, 28, 3584, 28, 4, 128),
        ModelProfile("qwen3-8b", 8.19e9, 36, 4096, 32, 8, 128),
        ModelProfile("qwen3-14b", 14.8e9, 40, 5120, 40, 8, 128),
        ModelProfile("qwen3-32b", 32.8e9, 64, 5120, 64, 8, 128),
        ModelProfile("llama-13b", 13.0e9, 40, 5120, 40, 40, 128),
        ModelProfile("llama-33b", 32.5e9, 60, 6656, 52, 52, 128),
        ModelProfile("llama-65b", 65.2e9, 80, 8192, 64, 64, 128),
        ModelProfile("llama2-70b", 69.0e9, 80, 8192, 64, 8, 128),
        ModelProfile("tiny", 2.0e6, 2, 128, 4, 2, 32),
        ModelProfile("small", 1.2e8, 12, 768, 12, 4, 64),
    ]
}


def get_model(name: str | ModelProfile) -> ModelProfile:
  """Returns the named model profile (a profile is returned as it is)."""
  if isinstance(name, ModelProfile):
    return name
  if name not in _MODELS:
    raise KeyError(f"unknown model {name!r}; have {sorted(_MODELS)}")
  return _MODELS[name]


def profile_of(cfg) -> ModelProfile:
  """The profile of a live `models.config.ModelConfig` (costs in BF16)."""
  return ModelProfile("live", float(cfg.num_params()), cfg.num_layers,
                      cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads,
                      cfg.head_dim)
