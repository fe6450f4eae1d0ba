"""Functional face of the decoder: params are a pytree, modes are pure functions.

Hot paths (train step, prefill, generate) take `params` (an nnx.State of
nnx.Param) as a jit argument and rebuild the module from the static graphdef
inside the trace, so weights are never closed over as constants.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from rlhf_jax.models.config import ModelConfig
from rlhf_jax.models.transformer import Decoder
from rlhf_jax.parallel.layout import Layout, use_layout

Params = Any


def abstract_params(cfg: ModelConfig):
  """(graphdef, params of ShapeDtypeStructs) without allocating anything."""
  model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  return nnx.split(model, nnx.Param)


def init_params(cfg: ModelConfig, seed: int, layout: Layout | None = None):
  """Random params, born sharded under `layout` (shapes first, then arrays)."""
  graphdef, abstract = abstract_params(cfg)

  def init():
    return nnx.split(Decoder(cfg, rngs=nnx.Rngs(seed)), nnx.Param)[1]

  if layout is None:
    return graphdef, jax.jit(init)()
  with use_layout(layout):
    params = jax.jit(init, out_shardings=layout.param_shardings(abstract))()
  return graphdef, params


def forward(graphdef, params, tokens_BxT, positions_BxT, mask_BxT, *,
            return_kv: bool = False, context=None):
  """Full-sequence logits (and per-layer KV); see `Decoder.__call__`."""
  model = nnx.merge(graphdef, params)
  return model(tokens_BxT, positions_BxT, mask_BxT, return_kv=return_kv,
               context=context)


def prefill(graphdef, params, tokens_BxT, positions_BxT, mask_BxT, last_B,
            *, context=None):
  """Logits at `last_B` only, and every layer's KV; see `Decoder.prefill`."""
  return nnx.merge(graphdef, params).prefill(
      tokens_BxT, positions_BxT, mask_BxT, last_B, context=context)


def decode(graphdef, params, *args, **kwargs):
  """One prefix-shared decode step; see `Decoder.decode`."""
  return nnx.merge(graphdef, params).decode(*args, **kwargs)


def paged_decode(graphdef, params, *args, **kwargs):
  """One paged decode step; see `Decoder.paged_decode`."""
  return nnx.merge(graphdef, params).paged_decode(*args, **kwargs)


def param_bytes(params) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
