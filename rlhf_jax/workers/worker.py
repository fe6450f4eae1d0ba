"""A rollout worker: the decode engine on its own devices, fed over time.

The same class runs in-process (tests, a trainer's spare devices) or as a
Ray actor in its own JAX process (`ray_worker`). It pulls weights from a
`WeightStore` when stale, takes requests at any time, and on every `poll`
advances its decode loop a few steps and streams back finished samples and
the tokens of every unfinished one (so a preempted worker's partial
responses survive on the manager's side).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax

from rlhf_jax.engine.driver import Driver, Partial, Request, Sample
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """What a worker needs to build its engine (picklable for Ray)."""
  model: ModelConfig
  num_rows: int
  samples_per_row: int
  prefill_buckets: tuple[int, ...]
  sampling: SamplingParams


@dataclasses.dataclass
class PollResult:
  finished: list[Sample]
  partials: list[Partial]   # every unfinished sample, tokens so far
  pending: int              # requests not yet admitted
  version: int
  slots: int                # samples the engine decodes at once


class RolloutWorker:
  """Engine + driver on this process's (or the given) devices."""

  def __init__(self, worker_id: str, spec: EngineSpec, devices=None,
               num_devices: int | None = None):
    self.worker_id, self.spec = worker_id, spec
    devices = list(devices or jax.local_devices()[:num_devices])
    layout = mesh_lib.rollout_layout(
        mesh_lib.make_mesh(fsdp=len(devices), devices=devices), 1)
    self.graphdef, abstract = model_lib.abstract_params(spec.model)
    self._treedef = jax.tree.structure(abstract)
    self.engine = Engine(spec.model, self.graphdef, layout,
                         num_rows=spec.num_rows,
                         samples_per_row=spec.samples_per_row,
                         prefill_buckets=spec.prefill_buckets,
                         sampling=spec.sampling)
    self.version = -1
    self.driver: Driver | None = None
    self.steps = 0
    self._next = None          # (version, params) waiting for a drain
    self._queued: list[Request] = []  # requests for the next version

  # ---------------------------------------------------------------- weights
  def load(self, version: int, leaves: Sequence) -> int:
    """Installs weights `version` (flat host leaves); returns the version."""
    params = jax.tree.unflatten(self._treedef, list(leaves))
    params = jax.device_put(params, self.engine.param_shardings)
    if self.driver is not None and self.driver.busy:
      # Samples in flight finish on the weights they started with; new
      # requests wait for the driver to drain (see `submit`).
      self._next = (version, params)
      return self.version
    self._install(version, params)
    return version

  def pull(self, store) -> int:
    """Pulls the newest version from `store` if this worker is behind."""
    latest = store.latest()
    if latest != self.version:
      self.load(*store.pull(latest))
    return self.version

  def _install(self, version, params):
    self.version, self.params = version, params
    self.driver = Driver(self.engine, params, weight_version=version)
    self.driver.start(self._queued)
    self._next, self._queued = None, []

  # ---------------------------------------------------------------- rollout
  def submit(self, requests: Sequence[Request]) -> int:
    """Queues requests; returns how many are pending here."""
    if self.driver is None:
      raise RuntimeError(f"worker {self.worker_id} has no weights yet")
    if self._next is not None:  # New weights wait for the old to drain.
      self._queued += list(requests)
      return len(self._queued) + len(self.driver.pending)
    self.driver.add(requests)
    return len(self.driver.pending)

  def take_pending(self, n: int) -> list[Request]:
    """Hands back up to `n` requests not yet admitted (load balancing)."""
    out = []
    while n > len(out) and self._queued:
      out.append(self._queued.pop())
    while self.driver is not None and n > len(out) and self.driver.pending:
      out.append(self.driver.pending.pop())
    return out

  def clear(self) -> None:
    """Drops every request and sample in flight (they continue elsewhere)."""
    self._queued = []
    if self._next is not None:
      self._install(*self._next)
    elif self.driver is not None:
      self.driver = Driver(self.engine, self.params,
                           weight_version=self.version)

  def poll(self, max_steps: int = 8) -> PollResult:
    """Runs up to `max_steps` decode iterations (fewer once idle)."""
    d = self.driver
    finished: list[Sample] = []
    for _ in range(max_steps):
      if d is None or not d.busy:
        break
      finished += d.step()
      self.steps += 1
    if d is not None and not d.busy and self._next is not None:
      self._install(*self._next)
      d = self.driver
    pending = (len(d.pending) if d else 0) + len(self._queued)
    return PollResult(finished, d.partials() if d else [], pending,
                      self.version, self.engine.max_concurrent_decodes)


def ray_worker(num_cpus: float = 1):
  """`RolloutWorker` as a Ray actor class (its own process and devices)."""
  import ray  # Optional extra: pip install .[ray]

  return ray.remote(num_cpus=num_cpus, max_restarts=0)(RolloutWorker)
