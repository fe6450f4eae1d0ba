"""LoRA adapters in the PEFT format: `adapter_config.json` and
`adapter_model.safetensors`.

PEFT names a projection's pair `base_model.model.<module>.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r] and applies W + (lora_alpha / r)
B A to the torch weight [out, in]. Ours are `<name>_lora_a` [layers, in...,
r] and `<name>_lora_b` [layers, r, out...] (`layers.add_lora`); the
modules and their in/out flattening are the HF weights' own
(`hf_weights.tensor_specs`), so an adapter written here applies to the
base exported from the same run by `transformers` + `peft`.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from rlhf_jax.errors import CheckpointError, MissingInputError
from rlhf_jax.models import hf_config, hf_weights
from rlhf_jax.models.config import LoraSpec, ModelConfig

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def _pairs(cfg: ModelConfig):
  """(HF module name, our weight path, layer) of every adapted weight."""
  targets = set(cfg.lora.targets)
  for s in hf_weights.tensor_specs(cfg, hf_config.family(cfg)):
    if s.layer is not None and s.path[-1] in targets and s.n_in > 0:
      yield s.hf_name[:-len(".weight")], s.path, s.layer


def save(path: str, cfg: ModelConfig, params, *,
         base_model: str = "") -> None:
  """Writes the adapters of `params` (a LoRA policy, `cfg.lora`) to the
  directory `path` (created)."""
  os.makedirs(path, exist_ok=True)
  flat = {k: np.asarray(v.get_value(), np.float32)
          for k, v in nnx.to_flat_state(params)}
  r = cfg.lora.rank
  tensors = {}
  for module, wpath, layer in _pairs(cfg):
    a = flat[wpath[:-1] + (f"{wpath[-1]}_lora_a",)][layer]
    b = flat[wpath[:-1] + (f"{wpath[-1]}_lora_b",)][layer]
    tensors[f"{_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(
        a.reshape(-1, r).T)
    tensors[f"{_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(
        b.reshape(r, -1).T)
  save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
  names = sorted({m.rsplit(".", 1)[-1] for m, _, _ in _pairs(cfg)})
  with open(os.path.join(path, CONFIG), "w", encoding="utf-8") as f:
    json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r,
               "lora_alpha": cfg.lora.alpha, "lora_dropout": 0.0,
               "bias": "none", "target_modules": names,
               "base_model_name_or_path": base_model}, f, indent=2)


def read_spec(path: str) -> LoraSpec:
  """The `LoraSpec` an adapter directory was written with."""
  file = os.path.join(path, CONFIG)
  if not os.path.exists(file):
    raise MissingInputError(f"{path!r} has no {CONFIG}: not a LoRA "
                            "adapter directory")
  with open(file, encoding="utf-8") as f:
    c = json.load(f)
  targets = tuple(m[:-len("_proj")] if m.endswith("_proj") else m
                  for m in c.get("target_modules", ()))
  return LoraSpec(int(c["r"]), float(c["lora_alpha"]), targets)


def check(path: str, want: LoraSpec) -> None:
  """Raises (one line) unless `path` holds adapters of `want`'s shape."""
  spec = read_spec(path)
  if (spec.rank, spec.alpha, set(spec.targets)) != (
      want.rank, want.alpha, set(want.targets)):
    raise CheckpointError(
        f"the adapters in {path!r} are rank {spec.rank}, alpha {spec.alpha} "
        f"on {sorted(spec.targets)}; config.lora asks for rank {want.rank}, "
        f"alpha {want.alpha} on {sorted(want.targets)}")


def load(path: str, cfg: ModelConfig, adapters_like):
  """Adapters (the structure of `adapters_like`, fp32 host arrays) read
  from the directory `path`, which must match `cfg.lora`."""
  check(path, cfg.lora)
  want = cfg.lora
  tensors = load_file(os.path.join(path, WEIGHTS))
  flat = {k: np.zeros(v.get_value().shape, np.float32)
          for k, v in nnx.to_flat_state(adapters_like)}
  r = want.rank
  for module, wpath, layer in _pairs(cfg):
    for kind, key in (("a", "lora_A"), ("b", "lora_B")):
      name = f"{_PREFIX}{module}.{key}.weight"
      if name not in tensors:
        raise CheckpointError(f"{path!r} has no tensor {name}")
      dst = flat[wpath[:-1] + (f"{wpath[-1]}_lora_{kind}",)]
      x = tensors[name].T  # [in, r] or [r, out]
      if x.size != dst[layer].size:
        raise CheckpointError(
            f"{path!r}: {name} has shape {tensors[name].shape}; the model's "
            f"is {dst.shape[1:]} (rank {r}) in our layout")
      dst[layer] = x.reshape(dst.shape[1:])
  return nnx.from_flat_state([
      (k, v.replace(jnp.asarray(flat[k])))
      for k, v in nnx.to_flat_state(adapters_like)])
