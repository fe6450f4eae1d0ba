"""Layouts: a mesh plus logical->mesh axis rules, and activation constraints.

Models name their axes logically ("embed", "heads", "batch", ...). A `Layout`
maps those names onto one mesh. Training and rollout are two layouts over the
same devices (see `mesh.py`). Jitted functions are traced inside
`use_layout(layout)`, so `constrain(x, names)` in model code becomes a
`with_sharding_constraint` for that layout; with no layout active (a plain
single-device call) it is the identity.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = tuple[tuple[str, Any], ...]
_ACTIVE: contextvars.ContextVar["Layout | None"] = contextvars.ContextVar(
    "rlhf_jax_layout", default=None)


@dataclasses.dataclass(frozen=True)
class Layout:
  """A named mesh + logical axis rules (logical name -> mesh axis/axes/None).

  `param_axes` (training: "fsdp", then "expert") additionally shard every
  parameter along its leading dimension, as ZeRO-3 / PyTorch FSDP shard the
  flat parameter:
  each device's shard is a contiguous block of rows, so gathering it (every
  forward pass, and every switch to the rollout layout) concatenates whole
  blocks. Sharding a minor dimension (e.g. "embed" of the (vocab, embed)
  table) makes each gather a strided transpose; on CPU that was 2-3x slower.
  """
  name: str
  mesh: Mesh
  rules: Rules
  param_axes: tuple[str, ...] = ()

  def spec(self, logical: Sequence[str | None],
           shape: Sequence[int] | None = None) -> PartitionSpec:
    """PartitionSpec for logical axis names.

    A mesh axis is used at most once per array, and is dropped for a
    dimension it does not divide (e.g. 2 kv heads over tensor=4), so every
    preset fits every mesh; the dropped axis means replication there.
    """
    rules = dict(self.rules)
    used: set[str] = set()
    out = []
    for i, name in enumerate(logical):
      target = rules.get(name) if name is not None else None
      axes = (target,) if isinstance(target, str) else tuple(target or ())
      kept = []
      size = 1
      for ax in axes:
        if ax in used or self.mesh.shape[ax] == 1:
          continue
        if shape is not None and shape[i] % (size * self.mesh.shape[ax]):
          continue
        kept.append(ax)
        size *= self.mesh.shape[ax]
      used.update(kept)
      out.append(None if not kept else kept[0] if len(kept) == 1
                 else tuple(kept))
    return PartitionSpec(*out)

  def shards(self, logical: str) -> int:
    """Devices a dimension named `logical` is split over (at most)."""
    spec = self.spec((logical,))[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return int(np.prod([self.mesh.shape[a] for a in axes]))

  def sharding(self, logical, shape=None) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(logical, shape))

  def param_spec(self, logical: Sequence[str | None],
                 shape: Sequence[int]) -> PartitionSpec:
    """`spec` plus the `param_axes` it leaves unused, on the first
    dimension they divide.

    On a dimension already split over other axes (e.g. "tensor" on heads),
    they go minor to them: ("tensor", "fsdp"). Every device's block then
    lies inside its block of the rollout layout (which drops them), so the
    switch gathers within groups only. When no dimension takes all of them,
    the last ones are left out (replicated) one by one. The "layers" axis
    of stacked params is never split: a scan over layers slices it, and
    each layer's shards must be on every device.
    """
    spec = list(self.spec(logical, shape))
    spec += [None] * (len(shape) - len(spec))
    used = {a for s in spec for a in ((s,) if isinstance(s, str)
                                      else tuple(s or ()))}
    extra = [a for a in self.param_axes
             if a not in used and self.mesh.shape[a] > 1]
    while extra:
      width = int(np.prod([self.mesh.shape[a] for a in extra]))
      for i, n in enumerate(shape):
        if i < len(logical) and logical[i] == "layers":
          continue
        axes = (spec[i],) if isinstance(spec[i], str) else tuple(spec[i] or ())
        size = int(np.prod([self.mesh.shape[a] for a in axes]))
        if n % (size * width) == 0:
          spec[i] = (*axes, *extra)
          spec[i] = spec[i][0] if len(spec[i]) == 1 else spec[i]
          return PartitionSpec(*spec)
      extra.pop()
    return PartitionSpec(*spec)

  def param_sharding(self, logical, shape) -> NamedSharding:
    return NamedSharding(self.mesh, self.param_spec(logical, shape))

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def param_shardings(self, params: Any) -> Any:
    """Shardings for an nnx.State of params whose Variables carry logical_axes."""
    def one(v):
      axes = v.get_metadata().get("logical_axes")
      if axes is None:
        return v.replace(self.replicated())
      return v.replace(self.param_sharding(axes, v.get_value().shape))
    return jax.tree.map(one, params,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


@contextlib.contextmanager
def use_layout(layout: Layout | None):
  """Make `layout` the target of `constrain` while tracing."""
  token = _ACTIVE.set(layout)
  try:
    yield layout
  finally:
    _ACTIVE.reset(token)


def active_layout() -> Layout | None:
  return _ACTIVE.get()


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
  """Sharding constraint on an activation under the active layout."""
  layout = _ACTIVE.get()
  if layout is None:
    return x
  return jax.lax.with_sharding_constraint(
      x, layout.sharding(logical, x.shape))
