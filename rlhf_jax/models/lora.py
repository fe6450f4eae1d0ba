"""LoRA on the policy: adapters next to a frozen base, merged for rollout.

A LoRA policy is one nnx.State: the base weights (nnx.Param, frozen) and
the adapters (nnx.LoRAParam, `<weight>_lora_a` [in..., r] and
`<weight>_lora_b` [r, out...] per targeted projection, `layers.add_lora`).
The learner trains only the adapters (`Learner(trainable=ADAPTERS)`), so
gradients and optimizer state exist for them alone. The reference policy
is the base itself (`without_adapters`: the same buffers, adapters zero),
never a second copy. Rollout takes `merged` weights, W + (alpha / r) A B,
in the plain model's structure, so the engine runs no adapter math.

qwix (Google's LoRA/quantization library) was tried first: its
`apply_lora_to_model` wraps a module's methods and creates the LoRA params
on the module it sees during a Python call. Our blocks are one stacked
module that `transformer.scan_layers` splits and rebuilds per layer inside
`jax.lax.scan` (or a loop over slices), and qwix fails inside that call
(IndexError on the sliced layer state; docs/lora.md). Our own code is the
`add_lora`/`project` pair in layers.py and this file.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import LoraSpec, ModelConfig
from rlhf_jax.models.transformer import Decoder
from rlhf_jax.parallel.layout import Layout

ADAPTERS = nnx.LoRAParam  # The filter of the trainable leaves.


def has_adapters(params) -> bool:
  return any(isinstance(v, ADAPTERS) for v in jax.tree.leaves(
      params, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def split(params):
  """(adapters, base) of a LoRA policy's state."""
  return nnx.split_state(params, ADAPTERS, ...)


def without_adapters(params):
  """The base model in the LoRA structure: adapters zero (so W + s A B is
  exactly W), base leaves the same arrays: the reference policy."""
  adapters, base = split(params)
  return nnx.merge_state(jax.tree.map(jnp.zeros_like, adapters), base)


def _delta(a, b, w_shape):
  """A [lead..., in..., r] @ B [lead..., r, out...] -> [lead..., in...,
  out...] = `w_shape`, in fp32."""
  lead = a.ndim + b.ndim - 2 - len(w_shape)
  r = a.shape[-1]
  a2 = a.reshape(a.shape[:lead] + (-1, r)).astype(jnp.float32)
  b2 = b.reshape(b.shape[:lead] + (r, -1)).astype(jnp.float32)
  return jnp.matmul(a2, b2).reshape(w_shape)


def merged(params, spec: LoraSpec):
  """The plain model's state: each adapted weight W + scale * A B (summed
  in fp32, stored in W's dtype), the adapters dropped."""
  flat = dict(nnx.to_flat_state(params))
  out = []
  for path, var in flat.items():
    if isinstance(var, ADAPTERS):
      continue
    a = flat.get(path[:-1] + (f"{path[-1]}_lora_a",))
    if a is not None:
      b = flat[path[:-1] + (f"{path[-1]}_lora_b",)]
      w = var.get_value()
      delta = spec.scale * _delta(a.get_value(), b.get_value(), w.shape)
      var = var.replace((w.astype(jnp.float32) + delta).astype(w.dtype))
    out.append((path, var))
  return nnx.from_flat_state(out)


def _adapters_of(params):
  """The adapter half of `split` (a named function: a cache key)."""
  return split(params)[0]


def attach(cfg: ModelConfig, params, spec: LoraSpec, *, seed: int,
           layout: Layout | None = None, model=Decoder):
  """(LoRA cfg, its graphdef, base `params` + fresh adapters born on
  `layout`): the same adapters for the same seed, B zero (so the model
  starts as the base). `model`: the class `params` are of (`Decoder`; the
  critic's `reward_model.RewardModel`)."""
  lora_cfg = cfg.replace(lora=spec)
  graphdef, _ = nnx.split(
      nnx.eval_shape(lambda: model(lora_cfg, rngs=nnx.Rngs(0))), nnx.Param)

  adapters = model_lib.random_params(model, lora_cfg, seed, layout,
                                     select=_adapters_of)
  return lora_cfg, graphdef, nnx.merge_state(adapters, params)
