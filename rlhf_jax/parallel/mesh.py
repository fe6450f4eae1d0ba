"""Mesh construction and the two layouts (training, rollout) over one device set.

Mesh axes, major to minor: `AXES`. Each axis past ("data", "fsdp",
"tensor") is size 1 unless a config asks for it, so a new kind of
parallelism is one more entry here and in the rules.

Training: params FSDP over `fsdp` (and over `context` and `expert` where
they do not already split them) along their leading dimension, optionally
TP over `tensor`; batch over `data` x `fsdp` x `expert`; each sequence's
tokens over `context` (`parallel/context.py`: attention gathers the keys
and values of the other shards); an MoE layer's experts over `expert`
(tokens go to their experts' devices and back, `models/moe.py`). Rollout: the same devices, in the same order, reshaped
into replicas x expert x tensor: params replicated across replicas, experts
and TP inside a replica, decode rows split across replicas. The rollout
mesh has fsdp = 1 and data = replicas.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from rlhf_jax.errors import ConfigError
from rlhf_jax.parallel.layout import Layout

AXES = ("data", "fsdp", "context", "expert", "tensor")
_AUTO = (AxisType.Auto,) * len(AXES)

# Logical axis -> mesh axes. Names not listed are replicated.
TRAIN_RULES = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", "context"),
    # [batch x length] flattened: batch's axes, then length's.
    ("rows", ("data", "fsdp", "expert", "context")),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
)
ROLLOUT_RULES = (
    ("batch", "data"),
    ("rows", "data"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, *,
              expert: int = 1, context: int = 1, devices=None) -> Mesh:
  """A mesh with the axes `AXES`; one size may be -1 (fill the rest).

  Axis types are Auto on purpose: `jax.make_mesh` defaults to Explicit axes,
  under which sharding constraints become assertions.
  """
  devices = list(jax.devices() if devices is None else devices)
  named = dict(data=data, fsdp=fsdp, context=context, expert=expert,
               tensor=tensor)
  sizes = [named[a] for a in AXES]
  if sizes.count(-1) > 1:
    raise ConfigError(
        f"at most one mesh axis may be -1, got {dict(zip(AXES, sizes))}")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devices) % known:
      raise ConfigError(f"mesh {dict(zip(AXES, sizes))} does not divide "
                        f"{len(devices)} devices")
    sizes[sizes.index(-1)] = len(devices) // known
  if int(np.prod(sizes)) != len(devices):
    raise ConfigError(f"mesh {dict(zip(AXES, sizes))} needs "
                      f"{int(np.prod(sizes))} devices, have {len(devices)}")
  return jax.make_mesh(tuple(sizes), AXES, axis_types=_AUTO, devices=devices)


def replica_mesh(devices, replicas: int, tensor: int = 1,
                 expert: int = 1) -> Mesh:
  """`devices` in order as `replicas` x expert x tensor (fsdp = context =
  1): the rollout's mesh."""
  grid = np.asarray(devices).reshape(replicas, 1, 1, expert, tensor)
  return Mesh(grid, AXES, axis_types=_AUTO)


def train_layout(mesh: Mesh) -> Layout:
  return Layout("train", mesh, TRAIN_RULES,
                param_axes=("fsdp", "context", "expert"))


def rollout_layout(mesh: Mesh, tensor: int = 1, expert: int = 1) -> Layout:
  """Replicas x expert x tensor over the devices of `mesh`, in the same
  order."""
  devices = mesh.devices.reshape(-1)
  if len(devices) % (tensor * expert):
    raise ConfigError(f"rollout tensor={tensor} x expert={expert} does not "
                      f"divide {len(devices)} devices")
  return Layout("rollout", replica_mesh(
      devices, len(devices) // (tensor * expert), tensor, expert),
                ROLLOUT_RULES)


def to_layout(params, layout: Layout):
  """A copy of a param pytree on `layout` (plain `jax.device_put`).

  Works across device sets (e.g. onto a one-device mesh). Between the
  training and rollout layouts of one mesh use `repartition.py`: on device,
  donated, one layer group in flight (this goes through host numpy there).
  """
  return jax.device_put(params, layout.param_shardings(params))


def layouts(section) -> tuple[Layout, Layout]:
  """(train, rollout) layouts over one mesh from a `config.sections.Mesh`."""
  devices = jax.devices()[:section.num_devices or None]
  mesh = make_mesh(section.data, section.fsdp, section.tensor,
                   expert=section.expert, context=section.context,
                   devices=devices)
  return train_layout(mesh), rollout_layout(mesh, section.rollout_tensor,
                                            section.rollout_expert)


def async_layouts(section, rollout_devices: int
                  ) -> tuple[Layout, Layout, Layout]:
  """(train, rollout, eval) layouts of async RL from a `Mesh` section: the
  last `rollout_devices` devices decode (replicas x `rollout_tensor`), the
  others train (the section's axes over them) and evaluate (their own
  rollout layout)."""
  devices = jax.devices()[:section.num_devices or None]
  if not 0 < rollout_devices < len(devices):
    raise ConfigError(f"async rollout on {rollout_devices} of "
                      f"{len(devices)} devices: it needs at least one and "
                      "must leave one to train on")
  train = make_mesh(section.data, section.fsdp, section.tensor,
                    expert=section.expert, context=section.context,
                    devices=devices[:-rollout_devices])
  decode = make_mesh(fsdp=-1, devices=devices[-rollout_devices:])
  return (train_layout(train),
          rollout_layout(decode, section.rollout_tensor,
                         section.rollout_expert),
          rollout_layout(train, section.rollout_tensor,
                         section.rollout_expert))
