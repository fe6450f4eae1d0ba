"""Decoder building blocks: RMSNorm, RoPE, attention projections, gated MLP.

Dimension letters: B batch, T length, D embed, H query heads, N kv heads,
K head dim, F mlp hidden, V vocab. Every parameter carries `logical_axes`
metadata; `rlhf_jax.parallel.layout` maps those names onto a mesh.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from rlhf_jax.models.config import ModelConfig, RopeScaling
from rlhf_jax.parallel.layout import constrain


def _param(rngs, shape, axes, dtype, fan_in=None, value=None, kind=nnx.Param):
  if value is None:
    std = 1.0 / math.sqrt(fan_in)
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  return kind(value.astype(dtype), logical_axes=axes)


# The block projections: weight name -> how many leading axes it contracts
# (its inputs; the rest are its outputs).
PROJECTIONS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
# Weight-only quantized storage: dtype and its largest finite value.
QUANT_DTYPES = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}


def add_quant(module: nnx.Module, cfg: ModelConfig, names) -> None:
  """With `cfg.weight_quant`, the module's `names` weights are stored in
  that dtype with an fp32 scale per output channel, `<name>_scale`
  [out...] (the rollout copy; `models/rollout_copy.quantize` fills them)."""
  if cfg.weight_quant == "none":
    return
  dtype = QUANT_DTYPES[cfg.weight_quant][0]
  for name in names:
    w, n_in = getattr(module, name), PROJECTIONS[name]
    axes = w.get_metadata()["logical_axes"]
    setattr(module, name, nnx.Param(jnp.zeros(w.shape, dtype),
                                    logical_axes=axes))
    setattr(module, name + "_scale", nnx.Param(
        jnp.ones(w.shape[n_in:], jnp.float32), logical_axes=axes[n_in:]))


def add_lora(module: nnx.Module, cfg: ModelConfig, rngs, names) -> None:
  """LoRA pairs for the module's `names` weights that `cfg.lora.targets`
  lists: A [in..., r] random, B [r, out...] zero, fp32 (trainable
  masters), as nnx.LoRAParam leaves `<name>_lora_a`, `<name>_lora_b`."""
  if cfg.lora is None:
    return
  r = cfg.lora.rank
  for name in names:
    if name not in cfg.lora.targets:
      continue
    w, n_in = getattr(module, name), PROJECTIONS[name]
    shape, axes = w.shape, w.get_metadata()["logical_axes"]
    setattr(module, name + "_lora_a", _param(
        rngs, shape[:n_in] + (r,), axes[:n_in] + (None,), jnp.float32,
        math.prod(shape[:n_in]), kind=nnx.LoRAParam))
    setattr(module, name + "_lora_b", _param(
        None, (r,) + shape[n_in:], (None,) + axes[n_in:], jnp.float32,
        value=jnp.zeros((r,) + shape[n_in:]), kind=nnx.LoRAParam))


def lora_specs(spec: str) -> tuple[str, str]:
  """The einsums of a weight's LoRA path: "btd,dhk->bthk" ->
  ("btd,dr->btr", "btr,rhk->bthk") (the weight's axes: inputs, then
  outputs)."""
  ins, out = spec.split("->")
  x, w = ins.split(",")
  contracted = "".join(c for c in w if c in x)
  produced = "".join(c for c in w if c not in x)
  rest = "".join(c for c in x if c not in contracted)
  return (f"{x},{contracted}r->{rest}r", f"{rest}r,r{produced}->{out}")


def project(module: nnx.Module, spec: str, x, name: str):
  """`x` times the module's weight `name` (einsum `spec`) in the compute
  dtype (a quantized weight: times its per-channel scale after the
  matmul), plus its LoRA path scale * (x A) B when it has adapters (the
  base weight is never rebuilt, so it gets no gradient work)."""
  cfg = module.cfg
  cdt = cfg.compute_jnp_dtype
  y = jnp.einsum(spec, x, getattr(module, name)[...].astype(cdt))
  if hasattr(module, name + "_scale"):
    y = y * getattr(module, name + "_scale")[...].astype(cdt)
  if not hasattr(module, name + "_lora_a"):
    return y
  spec_a, spec_b = lora_specs(spec)
  a = getattr(module, name + "_lora_a")[...].astype(cdt)
  b = getattr(module, name + "_lora_b")[...].astype(cdt)
  delta = jnp.einsum(spec_b, jnp.einsum(spec_a, x, a), b)
  return y + (cfg.lora.scale * delta).astype(y.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm in fp32; Gemma's form multiplies by (1 + w) with w born at 0."""

  def __init__(self, dim: int, cfg: ModelConfig, *, rngs: nnx.Rngs):
    del rngs
    self.eps = cfg.norm_eps
    self.plus_one = cfg.norm_plus_one
    init = jnp.zeros if self.plus_one else jnp.ones
    self.scale = _param(None, (dim,), ("norm",), cfg.param_jnp_dtype,
                        value=init((dim,), jnp.float32))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps)
    w = self.scale[...].astype(jnp.float32)
    return (x32 * (1.0 + w if self.plus_one else w)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float,
                  scaling: RopeScaling | None) -> jax.Array:
  """Inverse frequencies, with Llama-3 frequency-dependent scaling if given."""
  inv = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  if scaling is None:
    return inv
  low_wavelen = scaling.original_max_position / scaling.low_freq_factor
  high_wavelen = scaling.original_max_position / scaling.high_freq_factor
  wavelen = 2 * jnp.pi / inv
  scaled = jnp.where(wavelen > low_wavelen, inv / scaling.factor, inv)
  smooth = ((scaling.original_max_position / wavelen - scaling.low_freq_factor)
            / (scaling.high_freq_factor - scaling.low_freq_factor))
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(x, positions, inv_freq):
  """Rotate-half RoPE (the Hugging Face convention). x: [..., T, heads, K]."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., T, K/2]
  cos = jnp.cos(angles)[..., None, :]
  sin = jnp.sin(angles)[..., None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class AttentionProjections(nnx.Module):
  """Q/K/V projections (with optional bias and QK-norm, then RoPE) and output."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, h, n, k = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dt = cfg.param_jnp_dtype
    self.cfg = cfg
    self.q = _param(rngs, (d, h, k), ("embed", "heads", "head_dim"), dt, d)
    self.k = _param(rngs, (d, n, k), ("embed", "kv_heads", "head_dim"), dt, d)
    self.v = _param(rngs, (d, n, k), ("embed", "kv_heads", "head_dim"), dt, d)
    self.o = _param(rngs, (h, k, d), ("heads", "head_dim", "embed"), dt, h * k)
    if cfg.qkv_bias:
      zeros = lambda *s: jnp.zeros(s, jnp.float32)
      self.q_bias = _param(None, (h, k), ("heads", "head_dim"), dt,
                           value=zeros(h, k))
      self.k_bias = _param(None, (n, k), ("kv_heads", "head_dim"), dt,
                           value=zeros(n, k))
      self.v_bias = _param(None, (n, k), ("kv_heads", "head_dim"), dt,
                           value=zeros(n, k))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(k, cfg, rngs=rngs)
      self.k_norm = RMSNorm(k, cfg, rngs=rngs)
    add_lora(self, cfg, rngs, ("q", "k", "v", "o"))
    add_quant(self, cfg, ("q", "k", "v", "o"))

  def qkv(self, x_BxTxD, positions_BxT):
    """Returns q [B,T,H,K], k and v [B,T,N,K], RoPE applied to q and k."""
    cdt = self.cfg.compute_jnp_dtype
    x = x_BxTxD.astype(cdt)
    q = project(self, "btd,dhk->bthk", x, "q")
    k = project(self, "btd,dnk->btnk", x, "k")
    v = project(self, "btd,dnk->btnk", x, "v")
    if self.cfg.qkv_bias:
      q = q + self.q_bias[...].astype(cdt)
      k = k + self.k_bias[...].astype(cdt)
      v = v + self.v_bias[...].astype(cdt)
    if self.cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta,
                             self.cfg.rope_scaling)
    q = apply_rope(q, positions_BxT, inv_freq)
    k = apply_rope(k, positions_BxT, inv_freq)
    q = constrain(q, ("batch", "length", "heads", "head_dim"))
    k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
    v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
    return q, k, v

  def out(self, o_BxTxHxK):
    y = project(self, "bthk,hkd->btd",
                o_BxTxHxK.astype(self.cfg.compute_jnp_dtype), "o")
    return constrain(y, ("batch", "length", "embed_act"))


def gate_activation(cfg: ModelConfig, gate):
  """The gated MLP's activation of its gate: silu (SwiGLU) or
  tanh-approximate gelu (GeGLU); the dense MLP and every expert share it."""
  return (jax.nn.silu(gate) if cfg.mlp_activation == "silu"
          else jax.nn.gelu(gate, approximate=True))


class GatedMLP(nnx.Module):
  """SwiGLU (silu) or GeGLU (tanh-approximate gelu) feed-forward."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f, dt = cfg.embed_dim, cfg.mlp_dim, cfg.param_jnp_dtype
    self.cfg = cfg
    self.gate = _param(rngs, (d, f), ("embed", "mlp"), dt, d)
    self.up = _param(rngs, (d, f), ("embed", "mlp"), dt, d)
    self.down = _param(rngs, (f, d), ("mlp", "embed"), dt, f)
    add_lora(self, cfg, rngs, ("gate", "up", "down"))
    add_quant(self, cfg, ("gate", "up", "down"))

  def __call__(self, x_BxTxD):
    cdt = self.cfg.compute_jnp_dtype
    x = x_BxTxD.astype(cdt)
    gate = project(self, "btd,df->btf", x, "gate")
    up = project(self, "btd,df->btf", x, "up")
    act = gate_activation(self.cfg, gate)
    h = constrain(act * up, ("batch", "length", "mlp"))
    y = project(self, "btf,fd->btd", h, "down")
    return constrain(y, ("batch", "length", "embed_act"))
