"""HF safetensors tensors <-> decoder params: names, layouts, streaming I/O.

A torch Linear weight is [out, in]; ours put the input axes first and split
heads out: q_proj [H*K, D] -> q [D,H,K], k/v_proj [N*K, D] -> [D,N,K],
o_proj [D, H*K] -> o [H,K,D], gate/up_proj [F, D] -> [D,F], down_proj
[D, F] -> [F,D], lm_head [V, D] -> [D,V]. Biases [H*K] -> [H,K]. Norm weights
and the embedding are stored as they are (Gemma's (1 + w) norm is our
`norm_plus_one`, so w is not shifted).

Our layer weights are stacked over layers ([L, ...], `stack_layers`): HF's
tensor of layer i is slice i of one param. A Qwen3-MoE layer's experts are
stacked too ([L, E, ...]): HF's expert e of layer i
(`mlp.experts.{e}.gate_proj.weight`) is slice [i, e]; its router
`mlp.gate.weight` [E, D] is ours [D, E]. Reading is one tensor at a time:
read from its file, re-layout and cast on the host, `jax.device_put` to
that param's sharding (a layer slice: the stacked sharding without its
layer axis) and written into its slice of the stacked param, which is
allocated once on its sharding (donated, so updated in place); wait, move
on. Host memory never holds more than one tensor (two while re-laying it
out). Writing gathers one output shard's tensors at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os
import struct
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from rlhf_jax import distributed
from rlhf_jax.errors import CheckpointError, MissingInputError
from rlhf_jax.models.config import ModelConfig

INDEX = "model.safetensors.index.json"
# numpy has no bf16/fp8, so safe_open(framework="numpy") cannot return them;
# those tensors are memory-mapped through the header offsets instead.
_ML_DTYPES = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
              "F8_E5M2": ml_dtypes.float8_e5m2}
# Tensors some checkpoints carry that are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One HF tensor and the param it becomes.

  n_in: 0 stores as is; -1 flattens (a bias); k > 0 is a torch Linear
  weight whose input is our first k axes.
  """
  hf_name: str
  path: tuple[Any, ...]
  n_in: int
  layer: int | None = None  # Slice `layer` of a stacked param,
  expert: int | None = None  # and in it slice `expert` (stacked experts).

  @property
  def index(self) -> tuple[int, ...]:
    """The leading indices of the param's slice this tensor is."""
    return tuple(i for i in (self.layer, self.expert) if i is not None)

  def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    if self.n_in == 0:
      return tuple(shape)
    if self.n_in < 0:
      return (math.prod(shape),)
    return (math.prod(shape[self.n_in:]), math.prod(shape[:self.n_in]))

  def to_ours(self, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if self.n_in == 0:
      return w
    return (w if self.n_in < 0 else w.T).reshape(shape)

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    if self.n_in == 0:
      return x
    if self.n_in < 0:
      return x.reshape(-1)
    return x.reshape(math.prod(x.shape[:self.n_in]), -1).T


def tensor_specs(cfg: ModelConfig, arch: str) -> list[TensorSpec]:
  """Every HF tensor of `arch` with `cfg`'s shapes, mapped to our paths."""
  specs = [TensorSpec("model.embed_tokens.weight", ("embed",), 0),
           TensorSpec("model.norm.weight", ("final_norm", "scale"), 0)]
  if not cfg.tie_embeddings:
    specs.append(TensorSpec("lm_head.weight", ("lm_head",), 1))
  norms = ([("post_attention_layernorm", "attn_post_norm"),
            ("pre_feedforward_layernorm", "mlp_norm"),
            ("post_feedforward_layernorm", "mlp_post_norm")]
           if arch == "Gemma2ForCausalLM" else
           [("post_attention_layernorm", "mlp_norm")])
  norms.append(("input_layernorm", "attn_norm"))
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."
    add = lambda name, path, n_in, e=None, i=i, pre=pre: specs.append(
        TensorSpec(pre + name, ("blocks",) + path, n_in, i, e))
    for hf, ours in norms:
      add(f"{hf}.weight", (ours, "scale"), 0)
    for x in "qkv":
      add(f"self_attn.{x}_proj.weight", ("attn", x), 1)
      if cfg.qkv_bias:
        add(f"self_attn.{x}_proj.bias", ("attn", f"{x}_bias"), -1)
    add("self_attn.o_proj.weight", ("attn", "o"), 2)
    if cfg.qk_norm:
      add("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), 0)
      add("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), 0)
    if cfg.is_moe:  # Qwen3-MoE: the router, then each expert's MLP.
      add("mlp.gate.weight", ("mlp", "router"), 1)
      for e in range(cfg.num_experts):
        for x in ("gate", "up", "down"):
          add(f"mlp.experts.{e}.{x}_proj.weight", ("mlp", x), 1, e)
      continue
    for x in ("gate", "up", "down"):
      add(f"mlp.{x}_proj.weight", ("mlp", x), 1)
  return specs


def checkpoint_files(path: str) -> dict[str, str]:
  """Tensor name -> safetensors file, from the index or by listing files."""
  index = os.path.join(path, INDEX)
  if os.path.exists(index):
    with open(index, encoding="utf-8") as f:
      weight_map = json.load(f)["weight_map"]
    return {k: os.path.join(path, v) for k, v in weight_map.items()}
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise MissingInputError(f"no *.safetensors files in {path!r}")
  out = {}
  for file in files:
    with safe_open(file, framework="numpy") as f:
      out.update({k: file for k in f.keys()})
  return out


@functools.lru_cache(maxsize=64)
def _header(file: str, mtime: float) -> tuple[int, dict]:
  """(data start, header) of a safetensors file; mtime keys the cache."""
  del mtime
  with open(file, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    return 8 + n, json.loads(f.read(n))


def _read(handle, file: str, name: str) -> np.ndarray:
  dtype = handle.get_slice(name).get_dtype()
  if dtype not in _ML_DTYPES:
    return handle.get_tensor(name)
  start, header = _header(file, os.path.getmtime(file))
  info = header[name]
  begin, end = info["data_offsets"]
  shape = tuple(info["shape"])
  if begin == end:
    return np.zeros(shape, _ML_DTYPES[dtype])
  return np.memmap(file, _ML_DTYPES[dtype], "r", start + begin, shape)


def read_tensors(path: str,
                 names: set[str]) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (name, host array) for `names`, one file open at a time."""
  by_file: dict[str, list[str]] = {}
  for name, file in checkpoint_files(path).items():
    if name in names:
      by_file.setdefault(file, []).append(name)
  for file in sorted(by_file):
    with safe_open(file, framework="numpy") as handle:
      for name in by_file[file]:
        yield name, _read(handle, file, name)


def load_params(path: str, cfg: ModelConfig, arch: str, abstract,
                shardings=None):
  """Streams a checkpoint's tensors into an nnx.State shaped like `abstract`.

  Args:
    path: HF checkpoint directory.
    cfg: its ModelConfig.
    arch: its architecture (selects the norm names).
    abstract: params of ShapeDtypeStructs (`model.abstract_params`).
    shardings: matching nnx.State of shardings, or None for one device.

  Returns:
    nnx.State of params, each placed on its sharding.

  Raises:
    ValueError: a tensor with the wrong shape, a missing tensor or one the
      decoder has no param for (each named).
  """
  flat = dict(nnx.to_flat_state(abstract))
  flat_sh = dict(nnx.to_flat_state(shardings)) if shardings else {}
  specs = {s.hf_name: s for s in tensor_specs(cfg, arch)}
  unmapped = set(flat) - {s.path for s in specs.values()}
  if unmapped:
    raise AssertionError(f"params without an HF tensor: {sorted(unmapped)}")
  available = set(checkpoint_files(path))
  ignored = {n for n in available if n.endswith(_IGNORED_SUFFIXES)}
  if cfg.tie_embeddings:
    ignored.add("lm_head.weight")  # Some tied checkpoints store a copy.
  missing = sorted(set(specs) - available)
  extra = sorted(available - set(specs) - ignored)
  if missing or extra:
    raise CheckpointError(
        f"checkpoint {path!r} does not match {arch} with this config: "
        f"missing tensors {missing}, unexpected tensors {extra}")
  out = {}
  for name, w in read_tensors(path, set(specs)):
    spec = specs[name]
    var = flat[spec.path]
    full = tuple(var.get_value().shape)
    index = spec.index
    shape = full[len(index):]
    if tuple(w.shape) != spec.hf_shape(shape):
      raise CheckpointError(
          f"tensor {name!r} has shape {tuple(w.shape)}, expected "
          f"{spec.hf_shape(shape)} for param {'.'.join(map(str, spec.path))} "
          f"{full}{f' {list(index)}' if index else ''}")
    # astype copies: nothing placed on a device aliases the file's mmap.
    host = spec.to_ours(w, shape).astype(var.get_value().dtype)
    sharding = flat_sh[spec.path].get_value() if flat_sh else None
    if not index:
      value = _put(host, sharding)
    else:
      if spec.path not in out:  # The stacked param, allocated once.
        out[spec.path] = var.replace(_zeros(full, host.dtype, sharding))
      value = _set_slice(out[spec.path].get_value(),
                         _put(host, _slice_sharding(sharding, len(index))),
                         np.asarray(index, np.int32))
    out[spec.path] = var.replace(value)
    value.block_until_ready()  # Bounds host memory.
  return nnx.from_flat_state(out)


def _put(host: np.ndarray, sharding):
  # put_global: each host places its own shards of the tensor it read.
  return (jax.device_put(host) if sharding is None
          else distributed.put_global(host, sharding))


def _slice_sharding(sharding, leading: int):
  """The sharding of one slice of a stacked param (its `leading` axes,
  layer and expert, indexed away)."""
  if sharding is None:
    return None
  return jax.sharding.NamedSharding(
      sharding.mesh,
      jax.sharding.PartitionSpec(*tuple(sharding.spec)[leading:]))


def _zeros(shape, dtype, sharding):
  return _zeros_fn(tuple(shape), jnp.dtype(dtype), sharding)()


@functools.lru_cache(maxsize=256)
def _zeros_fn(shape, dtype, sharding):
  """A jitted zeros per (shape, dtype, sharding): allocated on the devices,
  never on the host; one compile for every load of the same model."""
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.partial(jax.jit, donate_argnums=0)
def _set_slice(stacked, value, index_I):
  """`stacked` with its slice at the leading indices `index_I` set to
  `value` (a traced index: one compile serves every slice)."""
  lead = index_I.shape[0]
  start = tuple(index_I) + (0,) * value.ndim
  return jax.lax.dynamic_update_slice(
      stacked, value.reshape((1,) * lead + value.shape), start)


def _to_host(x: jax.Array) -> np.ndarray:
  if not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def save_params(path: str, cfg: ModelConfig, arch: str, params, *,
                dtype, max_shard_bytes: int) -> list[str]:
  """Writes params as HF safetensors shards (+ index if more than one).

  Args:
    path: output directory (exists).
    cfg: the ModelConfig of `params`.
    arch: HF architecture to name tensors for.
    params: nnx.State of params (any sharding).
    dtype: numpy dtype of the written tensors.
    max_shard_bytes: start a new file past this many bytes.

  Returns:
    The written file names.
  """
  flat = dict(nnx.to_flat_state(params))
  specs = tensor_specs(cfg, arch)

  def value(s: TensorSpec):
    x = flat[s.path].get_value()
    return x[s.index] if s.index else x

  def size(s: TensorSpec) -> int:
    shape = flat[s.path].get_value().shape
    return math.prod(shape[len(s.index):]) * dtype.itemsize

  shards: list[list[TensorSpec]] = [[]]
  used = 0
  for spec in specs:
    if shards[-1] and used + size(spec) > max_shard_bytes:
      shards.append([])
      used = 0
    shards[-1].append(spec)
    used += size(spec)
  n = len(shards)
  names = (["model.safetensors"] if n == 1 else
           [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)])
  writer = jax.process_index() == 0
  for name, shard in zip(names, shards):
    tensors = {s.hf_name: np.ascontiguousarray(
        s.to_hf(_to_host(value(s))).astype(dtype)) for s in shard}
    if writer:
      save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
    del tensors
  if n > 1 and writer:
    index = {"metadata": {"total_size": sum(size(s) for s in specs)},
             "weight_map": {s.hf_name: names[k]
                            for k, shard in enumerate(shards) for s in shard}}
    with open(os.path.join(path, INDEX), "w", encoding="utf-8") as f:
      json.dump(index, f, indent=2)
  return names
