"""Multi-host (multi-controller) JAX: start-up and host <-> global arrays.

One Python process per host runs the same program over a global mesh. Every
process builds the same global host values (prompt batches, packed rollouts)
deterministically, and `put_global` places only the shards its own devices
hold, so a run on N processes computes what a run on one process with the
same devices would. Outputs read on the host are fully replicated (or
gathered with `to_host`), so every process takes the same host decisions.

  distributed.initialize("auto", address, num_processes, process_id)
  x = distributed.put_global(host_array, sharding)
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from absl import logging

from rlhf_jax.errors import CheckpointError, ConfigError

MODES = ("auto", "on", "off")


def wanted(mode: str, coordinator_address: str | None,
           num_processes: int | None, process_id: int | None) -> bool:
  """Whether `initialize` should start the distributed runtime.

  "on" always does (missing values are auto-detected by JAX on Cloud TPU,
  SLURM, Open MPI, Kubernetes, GCE instance groups); "off" never does;
  "auto" does when a flag or JAX_COORDINATOR_ADDRESS names a cluster.
  """
  if mode not in MODES:
    raise ConfigError(f"--distributed={mode!r}; expected one of {MODES}")
  if mode != "auto":
    return mode == "on"
  return bool(coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
              or (num_processes or 1) > 1 or process_id)


def loopback_bind_address(coordinator_address: str | None) -> str | None:
  """Where process 0's coordinator binds when every process is on this
  host: the loopback address it is reached at. JAX's default binds every
  interface ([::]:PORT); a cluster over real hosts (any other address)
  keeps that default, and so does an explicit JAX_COORDINATOR_BIND_ADDRESS.
  """
  address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not address or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
    return None
  host, _, port = address.rpartition(":")
  host = host.strip("[]")
  if host == "localhost" or host == "::1" or host.startswith("127."):
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
  return None


def initialize(mode: str = "auto", coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Calls `jax.distributed.initialize` if `wanted`; returns whether it did.

  Must run before any JAX computation (the backend then sees every host).

  Args:
    mode: "auto" | "on" | "off" (see `wanted`).
    coordinator_address: "host:port" of process 0's coordinator service.
    num_processes: total processes (hosts).
    process_id: this process, in [0, num_processes).
  """
  if not wanted(mode, coordinator_address, num_processes, process_id):
    return False
  if num_processes is not None and num_processes < 1:
    raise ConfigError(f"--num_processes={num_processes} must be >= 1")
  if process_id is not None and not (
      0 <= process_id < (num_processes or process_id + 1)):
    raise ConfigError(f"--process_id={process_id} must be in "
                      f"[0, --num_processes={num_processes})")
  try:
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes,
        process_id=process_id,
        coordinator_bind_address=loopback_bind_address(coordinator_address))
  except ValueError as e:
    raise ConfigError(
        f"jax.distributed.initialize could not find the cluster ({e}); pass "
        "--coordinator_address, --num_processes and --process_id, or run "
        "where JAX auto-detects them (Cloud TPU, SLURM, Open MPI, GKE)"
    ) from e
  logging.info("jax.distributed: process %d of %d, %d local devices",
               jax.process_index(), jax.process_count(),
               jax.local_device_count())
  return True


def put_global(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """A value every process holds in full -> a global array on `sharding`.

  Device arrays that already span the mesh are resharded on device. Host
  values are sliced on each process, which places only its own shards (no
  cross-process check, unlike `jax.device_put` of a host value).
  """
  if jax.process_count() == 1 or (
      isinstance(x, jax.Array) and not x.is_fully_addressable):
    return jax.device_put(x, sharding)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding,
                                      lambda index: host[index])


def to_host(x: jax.Array) -> np.ndarray:
  """The full value of `x` on every process (gathered if not replicated)."""
  if x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def per_process(state: dict) -> list[dict]:
  """The JSON-able `state` of every process, in process order (a collective)."""
  if jax.process_count() == 1:
    return [state]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  blob = np.frombuffer(json.dumps(state, sort_keys=True).encode(), np.uint8)
  sizes = multihost_utils.process_allgather(np.int32(blob.size))
  padded = np.zeros(int(np.max(sizes)), np.uint8)
  padded[:blob.size] = blob
  rows = multihost_utils.process_allgather(padded)
  return [json.loads(bytes(row[:n]).decode()) for row, n in zip(rows, sizes)]


def this_process(states: list[dict]) -> dict:
  """This process's entry of `per_process` states saved by a past run.

  A run with another process count may resume only when all entries agree
  (iterators that produce the same global batch on every process do).
  """
  if len(states) == jax.process_count():
    return states[jax.process_index()]
  if all(s == states[0] for s in states):
    return states[0]
  raise CheckpointError(
      f"the checkpoint holds per-process data states of {len(states)} "
      f"processes that differ; this run has {jax.process_count()} processes. "
      "Resume with the original process count.")


def iterator_meta(iterator) -> dict:
  """Checkpoint metadata of a data iterator: its state on every process."""
  states = per_process(iterator.get_state())
  return {"iterator": states[0], "iterators": states}


def restore_iterator(iterator, meta: dict) -> None:
  """Sets this process's iterator state from `iterator_meta` metadata."""
  # Checkpoints written before per-process states have only "iterator".
  states = meta["iterators"] if "iterators" in meta else [meta["iterator"]]
  iterator.set_state(this_process(states))


def process0_first(fn, name: str):
  """`fn()` on process 0, then (after a barrier) on the others.

  For writers of shared files that skip work already done (assets built
  once): the other processes then find the finished files.
  """
  if jax.process_count() == 1:
    return fn()
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  out = fn() if jax.process_index() == 0 else None
  multihost_utils.sync_global_devices(name)
  return out if jax.process_index() == 0 else fn()
