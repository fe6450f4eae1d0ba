"""Functional face of the decoder: params are a pytree, modes are pure functions.

Hot paths (train step, prefill, generate) take `params` (an nnx.State of
nnx.Param) as a jit argument and rebuild the module from the static graphdef
inside the trace, so weights are never closed over as constants.
"""

from __future__ import annotations

import contextlib
import functools
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


def random_params(model_cls, cfg, seed: int, layout: Layout | None = None,
                  select=None):
  """The nnx.Param state of `model_cls(cfg, rngs=...)`, drawn from `seed`
  by a jitted init and born sharded under `layout`; `select` (a
  module-level function: it is part of the cache key) keeps part of that
  state (the rest is dead code to XLA).

  The key is an argument of the jitted init, not a constant: with a
  constant key every weight is a constant expression that XLA may fold at
  compile time (the constant-key init of Qwen2.5-1.5B compiled for 2 min
  12 s on an H100, docs/results.md). Same values either way, and one
  compiled init serves every seed (a policy, its reference and rollout
  copy are one compile, not three).
  """
  init = _compiled_init(model_cls, cfg, layout, select)
  with use_layout(layout) if layout is not None else contextlib.nullcontext():
    return init(jax.random.key(seed))


@functools.lru_cache(maxsize=32)
def _compiled_init(model_cls, cfg, layout: Layout | None, select):
  """The jitted init of `random_params`, one per (class, config, layout,
  selection)."""
  select = select or (lambda state: state)

  def init(key):
    return select(nnx.split(model_cls(cfg, rngs=nnx.Rngs(key)), nnx.Param)[1])

  if layout is None:
    return jax.jit(init)
  abstract = nnx.split(
      nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  return jax.jit(init, out_shardings=layout.param_shardings(
      select(abstract[1])))


def init_params(cfg: ModelConfig, seed: int, layout: Layout | None = None):
  """(graphdef, random params born sharded under `layout`)."""
  graphdef, _ = abstract_params(cfg)
  return graphdef, random_params(Decoder, cfg, seed, layout)


def forward(graphdef, params, tokens_BxT, positions_BxT, mask_BxT, *,
            return_kv: bool = False, context=None,
            router_stats: bool = False, replay_BxTxLxK=None):
  """Full-sequence logits (and per-layer KV, and an MoE's router
  statistics; `replay_BxTxLxK`: routing replay); see `Decoder.__call__`."""
  model = nnx.merge(graphdef, params)
  return model(tokens_BxT, positions_BxT, mask_BxT, return_kv=return_kv,
               context=context, router_stats=router_stats,
               replay_BxTxLxK=replay_BxTxLxK)


def prefill(graphdef, params, tokens_BxT, positions_BxT, mask_BxT, last_B,
            *, context=None, return_routes: bool = False):
  """Logits at `last_B` only, and every layer's KV (and an MoE's routes);
  see `Decoder.prefill`."""
  return nnx.merge(graphdef, params).prefill(
      tokens_BxT, positions_BxT, mask_BxT, last_B, context=context,
      return_routes=return_routes)


def decode(graphdef, params, *args, **kwargs):
  """One prefix-shared decode step; see `Decoder.decode`."""
  return nnx.merge(graphdef, params).decode(*args, **kwargs)


def paged_decode(graphdef, params, *args, **kwargs):
  """One paged decode step; see `Decoder.paged_decode`."""
  return nnx.merge(graphdef, params).paged_decode(*args, **kwargs)


def param_bytes(params) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
