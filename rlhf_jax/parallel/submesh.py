"""Sub-mesh splits: carve the device set into parts at run time, merge back.

A rollout layout is replicas x expert x tensor over the devices in mesh
order. `split`
cuts it into consecutive blocks of whole replicas, each a layout of its own
(a rollout layout, or a training/FSDP layout for scoring), so e.g. 8 devices
in 4 replicas x TP 2 become rollout on 2 replicas (devices 0-3) and scoring on
devices 4-7. `merge` puts rollout parts back together. `view` reads an
array on another part's devices without copying the shards it shares
(`engine/moves.py` carries an in-flight rollout onto another engine).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.parallel.layout import Layout


def _rollout(devices_RxT, expert: int) -> Layout:
  """Replicas (rows of the grid) x expert x tensor."""
  R, per_replica = devices_RxT.shape
  return Layout("rollout", mesh_lib.replica_mesh(
      devices_RxT, R, per_replica // expert, expert), mesh_lib.ROLLOUT_RULES)


def split(layout: Layout, replicas: Sequence[int],
          kinds: Sequence[str] | None = None) -> tuple[Layout, ...]:
  """Cuts a rollout layout into consecutive parts of whole replicas.

  Args:
    layout: a rollout layout (mesh data = replicas, tensor = TP size).
    replicas: replicas per part; they must sum to the layout's replicas.
    kinds: per part "rollout" (replicas x tensor, same TP) or "train"
      (FSDP over the part's devices, for scoring); default all "rollout".

  Returns:
    One layout per part, over disjoint device sets, in device order.
  """
  grid = np.asarray(layout.mesh.devices).reshape(
      layout.mesh.shape["data"], -1)  # [replicas, devices per replica]
  if sum(replicas) != grid.shape[0] or min(replicas) < 1:
    raise ValueError(f"parts of {list(replicas)} replicas do not split "
                     f"{grid.shape[0]} replicas")
  kinds = kinds or ("rollout",) * len(replicas)
  out, start = [], 0
  for n, kind in zip(replicas, kinds, strict=True):
    part = grid[start:start + n]
    start += n
    if kind == "rollout":
      out.append(_rollout(part, layout.mesh.shape["expert"]))
    elif kind == "train":
      out.append(mesh_lib.train_layout(
          mesh_lib.make_mesh(fsdp=-1, devices=list(part.reshape(-1)))))
    else:
      raise ValueError(f"part kind must be 'rollout' or 'train', got {kind!r}")
  return tuple(out)


def merge(parts: Sequence[Layout]) -> Layout:
  """The rollout layout over the parts' devices, replicas in part order."""
  grids = [np.asarray(p.mesh.devices).reshape(p.mesh.shape["data"], -1)
           for p in parts]
  if len({g.shape[1] for g in grids}) != 1:
    raise ValueError("parts differ in devices per replica: "
                     f"{[g.shape[1] for g in grids]}")
  return _rollout(np.concatenate(grids, axis=0),
                  parts[0].mesh.shape["expert"])


def devices_of(layout: Layout) -> list:
  return list(np.asarray(layout.mesh.devices).reshape(-1))


def view(x: jax.Array, sharding, shape: Sequence[int] | None = None):
  """`x` on `sharding` without a copy: the array of `shape` (default x's)
  built from the shards x already has on `sharding`'s devices. Right when
  each of those devices holds the same block in both (a replicated array
  on a sub-block of its devices; a replica-split array on its first
  replicas, `shape` then the first replicas' part)."""
  shape = x.shape if shape is None else tuple(shape)
  by_device = {s.device: s.data for s in x.addressable_shards}
  return jax.make_array_from_single_device_arrays(
      shape, sharding,
      [by_device[d] for d in sharding.addressable_devices_indices_map(shape)])
