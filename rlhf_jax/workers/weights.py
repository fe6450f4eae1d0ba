"""Versioned weights that rollout workers pull (RLBoost pull-based transfer).

The trainer publishes each new version once, as host arrays, and goes on;
a worker compares its version with `latest()` and pulls when stale (no push
barrier), and a worker that joins pulls the newest at once. Weights travel
as the flat list of param leaves; workers rebuild the pytree from the model
config, so the payload is plain numpy.

Two transports behind one interface: `LocalWeightStore` (one process) and
`RayWeightStore` (Ray's object store: `ray.put` once per version, workers
`ray.get` it). A device-to-device path (`jax.experimental.transfer`) would
be a third implementation of the same three methods.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import jax
import numpy as np


def to_payload(params) -> list[np.ndarray]:
  """Host copy of a param pytree's leaves (flatten order)."""
  return [np.asarray(x) for x in jax.device_get(jax.tree.leaves(params))]


def payload_bytes(leaves) -> int:
  return sum(x.size * x.dtype.itemsize for x in leaves)


class WeightStore(Protocol):
  """Versions of the policy; with a LoRA policy each version is its
  adapters and `publish_base` holds the frozen base they apply to."""
  def publish(self, version: int, params) -> None: ...
  def latest(self) -> int: ...
  def pull(self, version: int | None = None) -> tuple[int, list]: ...
  def publish_base(self, params) -> None: ...
  def base(self) -> list | None: ...


class LocalWeightStore:
  """In-process store keeping the newest `keep` versions."""

  def __init__(self, keep: int = 2):
    self.keep = keep
    self._versions: dict[int, list] = {}
    self._base = None
    self._lock = threading.Lock()

  def publish_base(self, params) -> None:
    self._base = to_payload(params)

  def base(self) -> list | None:
    return self._base

  def publish(self, version: int, params) -> None:
    payload = to_payload(params)
    with self._lock:
      if self._versions and version <= max(self._versions):
        raise ValueError(f"weight version {version} is not newer than "
                         f"{max(self._versions)}")
      self._versions[version] = payload
      for v in sorted(self._versions)[:-self.keep]:
        del self._versions[v]

  def latest(self) -> int:
    with self._lock:
      if not self._versions:
        raise LookupError("no weights published yet")
      return max(self._versions)

  def pull(self, version: int | None = None) -> tuple[int, list]:
    with self._lock:
      version = max(self._versions) if version is None else version
      if version not in self._versions:
        raise LookupError(f"weight version {version} is gone; have "
                          f"{sorted(self._versions)}")
      return version, self._versions[version]


class RayWeightStore:
  """Versions in Ray's object store; a small actor maps version -> ref."""

  def __init__(self, keep: int = 2):
    import ray  # Optional extra: pip install .[ray]

    @ray.remote(num_cpus=0)
    class _Registry:
      def __init__(self):
        self.refs: dict[int, Any] = {}

      def add(self, version, ref_list):
        self.refs[version] = ref_list[0]
        for v in sorted(self.refs)[:-keep]:
          del self.refs[v]

      def latest(self):
        return max(self.refs) if self.refs else None

      def set_base(self, ref_list):
        self.base = ref_list[0]

      def get_base(self):
        return [getattr(self, "base", None)]

      def get(self, version):
        version = max(self.refs) if version is None else version
        return version, [self.refs.get(version)]

    self._ray = ray
    self._registry = _Registry.remote()

  def publish(self, version: int, params) -> None:
    ref = self._ray.put(to_payload(params))
    # A list keeps Ray from resolving the ref when passing it to the actor.
    self._ray.get(self._registry.add.remote(version, [ref]))

  def publish_base(self, params) -> None:
    ref = self._ray.put(to_payload(params))
    self._ray.get(self._registry.set_base.remote([ref]))

  def base(self) -> list | None:
    (ref,) = self._ray.get(self._registry.get_base.remote())
    return None if ref is None else self._ray.get(ref)

  def latest(self) -> int:
    v = self._ray.get(self._registry.latest.remote())
    if v is None:
      raise LookupError("no weights published yet")
    return v

  def pull(self, version: int | None = None) -> tuple[int, list]:
    v, (ref,) = self._ray.get(self._registry.get.remote(version))
    if ref is None:
      raise LookupError(f"weight version {version} is gone")
    return v, self._ray.get(ref)
