"""What the rollout engine runs: the policy's weights merged, cast, quantized.

The train -> rollout switch (`parallel/colocate.py`) makes the rollout copy
of the training params. For a plain policy in its own dtype that is the
params themselves (resharded); otherwise one jitted function built here:
LoRA adapters merged into the base (`lora.merged`), floats cast to the
compute dtype, then, with `rollout.quantize`, the block projections stored
int8 (or fp8) with an fp32 scale per output channel (weight-only: the
matmul runs in the compute dtype; decode reads a quarter of the fp32
bytes of those weights). The engine and the workers run the matching
model (`rollout_model`), whose projections hold such weights.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

from rlhf_jax.models import lora
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.models.layers import PROJECTIONS, QUANT_DTYPES
from rlhf_jax.parallel import repartition as rp


def quantize(params, kind: str):
  """Each block projection W [layers, in..., out...] -> `kind` values
  round(W / s) and fp32 scales s = max|W| over the inputs / the dtype's
  largest value (per layer and output channel), as `<name>_scale`."""
  dtype, top = QUANT_DTYPES[kind]
  out = []
  for path, var in nnx.to_flat_state(params):
    n_in = PROJECTIONS.get(path[-1]) if "blocks" in path else None
    if n_in is None:
      out.append((path, var))
      continue
    w = var.get_value().astype(jnp.float32)
    inputs = tuple(range(1, 1 + n_in))  # Axis 0: the stacked layers.
    amax = jnp.max(jnp.abs(w), axis=inputs, keepdims=True)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    q = w / scale
    q = (jnp.clip(jnp.round(q), -top, top) if kind == "int8" else q)
    axes = var.get_metadata()["logical_axes"]
    out.append((path, var.replace(q.astype(dtype))))
    out.append((path[:-1] + (f"{path[-1]}_scale",), nnx.Param(
        jnp.squeeze(scale, inputs),
        logical_axes=(axes[0],) + tuple(axes[1 + n_in:]))))
  return nnx.from_flat_state(out)


def _copy(params, *, spec, dtype, quant):
  if spec is not None:
    params = lora.merged(params, spec)
  params = rp.cast_floats(params, dtype)
  return params if quant == "none" else quantize(params, quant)


def rollout_model(cfg: ModelConfig, graphdef, *, lora_spec=None,
                  quant: str = "none", scan_layers: bool | None = None):
  """(the rollout model's cfg, its graphdef, params -> rollout weights or
  None): None when the rollout copy is the (cast) params themselves; the
  function casts to the compute dtype itself. `scan_layers` (None: the
  policy's) sets how the rollout runs the same stacked layers: False, a
  Python loop (on GPU the scan copied each layer's weight slice before its
  GEMMs, 2.8 ms of an 8.2 ms decode step at 1.5B; docs/results.md)."""
  scan = cfg.scan_layers if scan_layers is None else scan_layers
  if lora_spec is None and quant == "none" and scan == cfg.scan_layers:
    return cfg, graphdef, None
  rollout_cfg = cfg.replace(lora=None, weight_quant=quant, scan_layers=scan)
  if quant != "none" or scan != cfg.scan_layers:
    graphdef = model_lib.abstract_params(rollout_cfg)[0]
  if lora_spec is None and quant == "none":
    return rollout_cfg, graphdef, None  # The same params, another loop.
  dtype = cfg.compute_jnp_dtype
  return rollout_cfg, graphdef, functools.partial(
      _copy, spec=lora_spec, dtype=None if dtype == cfg.param_jnp_dtype
      else dtype, quant=quant)
