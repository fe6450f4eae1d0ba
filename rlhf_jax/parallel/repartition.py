"""Memory-bounded repartitioning of a param pytree between two layouts.

Training and rollout are two layouts over the same devices (`mesh.py`). Moving
the weights between them is a reshard on one device set: XLA collectives
inside a jitted identity, never a host round trip. Doing it for the whole
pytree at once (`jax.device_put`) holds the source and the target copy of
every weight at the same time; here the leaves are cut into groups (a slice
of layers; the embedding and head on their own) and each group is resharded
by one jitted identity whose source buffers are donated (and deleted when
their shape differs, since XLA can only alias equal shapes). So the live
device bytes stay near one copy of the weights plus one group in flight.

Offload: optimizer state and the reference policy move to a host memory kind
(`pinned_host` where the backend offers it, else `unpinned_host`) while the
decode loop runs, and come back for training. On CPU this is the same code
path over the CPU client's memory spaces.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

PyTree = Any


# ------------------------------------------------------------------ groups
def _layer_key(path) -> Any:
  """The first integer key of a path (its layer), else its first name."""
  for k in path:
    key = getattr(k, "key", getattr(k, "idx", None))
    if isinstance(key, (int, np.integer)):
      return int(key)
  first = path[0] if path else None
  return str(getattr(first, "key", getattr(first, "name", first)))


def _is_layers(path) -> bool:
  """Whether a leaf lies under the stacked layers (a "blocks" entry)."""
  return any(getattr(k, "key", getattr(k, "name", None)) == "blocks"
             for k in path)


def layer_groups(tree: PyTree, layers_per_group: int = 1
                 ) -> tuple[tuple[int, ...], ...]:
  """Leaf indices (in flatten order) cut into layer groups.

  Leaves under an integer key (a block of `blocks`) belong to that layer;
  `layers_per_group` consecutive layers form one group. Every other top-level
  entry (embedding, final norm, head) is its own group. Stacked layers
  (`models/transformer.stack_layers`: no integer keys) hold each kind of
  weight of every layer in one leaf: each of those leaves is a group, so at
  most one leaf (plus `max_in_flight` - 1) exists in both layouts at once.
  """
  if layers_per_group < 1:
    raise ValueError(f"layers_per_group must be >= 1, got {layers_per_group}")
  paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  stacked = not any(isinstance(_layer_key(p), int) for p in paths)
  groups: dict[Any, list[int]] = {}
  for i, path in enumerate(paths):
    key = _layer_key(path)
    if isinstance(key, int):
      key = ("layer", key // layers_per_group)
    elif stacked and _is_layers(path):
      key = ("leaf", i)
    groups.setdefault(key, []).append(i)
  return tuple(tuple(v) for v in groups.values())


# ------------------------------------------------------------- accounting
def _shard_bytes(shape, dtype, sharding) -> int:
  """Bytes of one array summed over its devices (replicas counted)."""
  per = int(np.prod(sharding.shard_shape(tuple(shape)))) * np.dtype(
      dtype).itemsize
  return per * len(sharding.device_set)


def tree_device_bytes(tree: PyTree, shardings: PyTree | None = None) -> int:
  """Device bytes of a pytree laid out with `shardings` (default: its own)."""
  leaves = jax.tree.leaves(tree)
  shs = (jax.tree.leaves(shardings) if shardings is not None
         else [x.sharding for x in leaves])
  return sum(_shard_bytes(x.shape, x.dtype, s) for x, s in zip(leaves, shs))


def live_device_bytes() -> int:
  """Bytes of live device buffers (device memory kind), over all devices.

  Buffers are counted once by (device, address): an array and the
  single-device arrays of its shards (which `jax.live_arrays` also lists
  once they exist as Python objects) share them.
  """
  seen: dict[tuple, int] = {}
  for x in jax.live_arrays():
    if x.is_deleted() or x.sharding.memory_kind not in (None, "device"):
      continue
    for shard in x.addressable_shards:
      buf = shard.data
      seen[shard.device.id, buf.unsafe_buffer_pointer()] = buf.nbytes
  return sum(seen.values())


def _index_sets(sharding, shape):
  return {d: tuple(sl.indices(n) for sl, n in zip(idx, shape))
          for d, idx in sharding.devices_indices_map(tuple(shape)).items()}


def _overlap(a, b) -> int:
  n = 1
  for (a0, a1, _), (b0, b1, _) in zip(a, b):
    n *= max(0, min(a1, b1) - max(a0, b0))
  return n


def _count(box) -> int:
  return int(np.prod([hi - lo for lo, hi, _ in box]))


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """How one leaf moves: whether every device keeps its source shard."""
  superset: bool      # each device's target shard contains its source shard
  bytes_moved: int    # bytes devices receive (target minus local overlap)


def plan_leaf(shape, dtype, src: NamedSharding, dst: NamedSharding
              ) -> LeafPlan:
  """Per-device index arithmetic of one reshard (no device work)."""
  s_idx, d_idx = _index_sets(src, shape), _index_sets(dst, shape)
  if set(s_idx) != set(d_idx):
    raise ValueError("repartition keeps the device set; got "
                     f"{len(s_idx)} -> {len(d_idx)} devices")
  item = np.dtype(dtype).itemsize
  superset, moved = True, 0
  for d, dbox in d_idx.items():
    ov = _overlap(s_idx[d], dbox)
    superset &= ov == _count(s_idx[d])
    moved += (_count(dbox) - ov) * item
  return LeafPlan(superset, moved)


def plan(tree: PyTree, dst_shardings: PyTree) -> list[LeafPlan]:
  """`plan_leaf` for every leaf of `tree` (arrays or ShapeDtypeStructs)."""
  return [plan_leaf(x.shape, x.dtype, x.sharding, s)
          for x, s in zip(jax.tree.leaves(tree),
                          jax.tree.leaves(dst_shardings))]


# ------------------------------------------------------------- resharding
def canonical(s: NamedSharding) -> NamedSharding:
  """`s` with trailing None dims dropped, as jitted outputs carry it.

  P("fsdp", None) and P("fsdp") place data identically but are different
  jit cache keys: a step fed one and then the other compiles twice.
  """
  spec = tuple(s.spec)
  while spec and spec[-1] is None:
    spec = spec[:-1]
  return NamedSharding(s.mesh, PartitionSpec(*spec),
                       memory_kind=s.memory_kind)


@functools.lru_cache(maxsize=256)
def _group_fn(dst: tuple[NamedSharding, ...], donate: bool,
              casts: tuple | None = None):
  """One jitted identity per distinct tuple of target shardings (cached);
  `casts`: a dtype (or None: keep) per leaf."""
  def fn(*xs):
    if casts is None:
      return xs
    return tuple(x if c is None else x.astype(c) for x, c in zip(xs, casts))
  return jax.jit(fn, out_shardings=dst,
                 donate_argnums=tuple(range(len(dst))) if donate else ())


def cast_floats(tree: PyTree, dtype) -> PyTree:
  """Floating leaves cast to `dtype` (None: unchanged)."""
  if dtype is None:
    return tree
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(
      x.dtype, jnp.floating) else x, tree)


def repartition(tree: PyTree, dst_shardings: PyTree, *,
                groups: Sequence[Sequence[int]] | None = None,
                donate: bool = True, max_in_flight: int = 1,
                on_group: Callable[[int], None] | None = None,
                dtype=None) -> PyTree:
  """Reshards `tree` onto `dst_shardings` group by group, on device.

  Args:
    tree: a pytree of committed jax arrays (e.g. an nnx.State of params).
    dst_shardings: a matching pytree of target shardings (same devices).
    groups: leaf indices per group (default `layer_groups(tree)`).
    donate: free each group's source buffers as soon as it is resharded; the
      caller's `tree` is invalid afterwards.
    max_in_flight: groups dispatched before waiting for the oldest one; this
      bounds the transient memory to about that many groups. Keep it small
      on CPU: ~75 concurrent collective programs over 8 host devices on 2
      cores stalled XLA's in-process all-gather rendezvous until it aborted.
    on_group: called with the group index after each group is dispatched
      (memory accounting in benchmarks).
    dtype: cast floating leaves to this dtype on the way (the rollout copy
      in the compute dtype); None keeps the dtypes.

  Returns:
    The pytree on `dst_shardings`.
  """
  leaves, treedef = jax.tree.flatten(tree)
  dst = jax.tree.leaves(dst_shardings)
  if len(dst) != len(leaves):
    raise ValueError(f"{len(leaves)} leaves but {len(dst)} target shardings")
  groups = layer_groups(tree) if groups is None else groups
  if sorted(i for g in groups for i in g) != list(range(len(leaves))):
    raise ValueError("groups must cover every leaf exactly once")
  out: list[Any] = [None] * len(leaves)
  pending: list[Any] = []
  for gi, group in enumerate(groups):
    if len(pending) >= max_in_flight:
      jax.block_until_ready(pending.pop(0))
    casts = None if dtype is None else tuple(
        jnp.dtype(dtype) if jnp.issubdtype(leaves[i].dtype, jnp.floating)
        else None for i in group)
    fn = _group_fn(tuple(canonical(dst[i]) for i in group), donate, casts)
    srcs = [leaves[i] for i in group]
    with warnings.catch_warnings():
      # Leaves whose per-device shape changes cannot be aliased; they are
      # deleted below instead (the intent of the donation).
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      res = fn(*srcs)
    if donate:
      for x in srcs:
        if not x.is_deleted():
          x.delete()  # Freed once the reshard that reads it completes.
    for i, y in zip(group, res):
      out[i] = y
    pending.append(res)
    if on_group is not None:
      on_group(gi)
  return jax.tree.unflatten(treedef, out)


# ---------------------------------------------------------------- offload
def host_memory_kind(device=None) -> str | None:
  """`pinned_host` if the device offers it, else `unpinned_host`, else None."""
  device = device or jax.devices()[0]
  kinds = {m.kind for m in device.addressable_memories()}
  for kind in ("pinned_host", "unpinned_host"):
    if kind in kinds:
      return kind
  return None


def with_memory_kind(tree: PyTree, kind: str) -> PyTree:
  """Shardings of `tree` moved to memory `kind` (same devices and specs)."""
  return jax.tree.map(lambda x: x.sharding.with_memory_kind(kind), tree)


def _move(tree: PyTree, kind: str, donate: bool) -> PyTree:
  out = jax.device_put(tree, with_memory_kind(tree, kind))
  if donate:
    # PJRT does not donate across memory kinds: free the source explicitly
    # (it is released once the copy that reads it completes).
    for x in jax.tree.leaves(tree):
      x.delete()
  return out


def offload(tree: PyTree, kind: str | None = None, donate: bool = True
            ) -> PyTree:
  """Moves a pytree to host memory; the device copy is freed when donating."""
  kind = kind or host_memory_kind()
  if kind is None:
    return tree
  return _move(tree, kind, donate)


def reload(tree: PyTree, donate: bool = True) -> PyTree:
  """Brings a pytree back to device memory (same devices and specs)."""
  if on_device(tree):
    return tree
  return _move(tree, "device", donate)


def on_device(tree: PyTree) -> bool:
  return all(x.sharding.memory_kind in (None, "device")
             for x in jax.tree.leaves(tree))
