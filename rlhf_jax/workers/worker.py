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
import time
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from rlhf_jax.engine.driver import Driver
from rlhf_jax.samples import Partial, Request, Sample
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.engine_set import EngineSet
from rlhf_jax.engine.page_pool import PagePool
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import lora
from rlhf_jax.models import model as model_lib
from rlhf_jax.models import rollout_copy
from rlhf_jax.models.config import LoraSpec, ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.sched import offload


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """What a worker needs to build its engine (picklable for Ray)."""
  model: ModelConfig
  num_rows: int
  samples_per_row: int
  prefill_buckets: tuple[int, ...]
  sampling: SamplingParams
  max_common_length: int = 0   # > 0: a batch's common prefix stored once.
  # A LoRA policy's adapters: versions arrive as adapters, which the worker
  # merges onto the base it got once (`models/rollout_copy.py`).
  lora: LoraSpec | None = None
  # The engine's own arguments (page_size, num_pages, num_slots,
  # decode_window; 0 or missing: automatic, as `EngineSet.engine`).
  paged: dict | None = None
  # Routing replay: the engine records an MoE's experts (`Sample.routes`).
  record_routes: bool = False

  @property
  def slots(self) -> int:
    """Samples the worker decodes at once."""
    return ((self.paged or {}).get("num_slots") or
            self.num_rows * self.samples_per_row)


@dataclasses.dataclass
class PollResult:
  finished: list[Sample]
  partials: list[Partial]   # every unfinished sample, tokens so far
  pending: int              # requests not yet admitted
  version: int
  slots: int                # samples the engine decodes at once


class RolloutWorker:
  """Engine + driver on this process's (or the given) devices."""

  def __init__(self, worker_id: str, spec: EngineSpec | None, devices=None,
               num_devices: int | None = None, engine: Engine | None = None,
               start_driver=None):
    """Builds an engine from `spec` on `devices`, or drives `engine` (the
    trainer's own, for the seed window: `workers/seeding.py`) with
    `start_driver(params, version, requests, common_prefix)` (a started
    `Driver`; default: plain continuous batching on `engine`)."""
    self.worker_id, self.spec = worker_id, spec
    if engine is None:
      devices = list(devices or jax.local_devices()[:num_devices])
      layout = mesh_lib.rollout_layout(
          mesh_lib.make_mesh(fsdp=len(devices), devices=devices), 1)
      self.graphdef, abstract = model_lib.abstract_params(spec.model)
      self._treedef = jax.tree.structure(abstract)
      engines = EngineSet(spec.model, self.graphdef, layout,
                          rows_per_replica=spec.num_rows // len(devices),
                          samples_per_row=spec.samples_per_row,
                          prefill_buckets=spec.prefill_buckets,
                          sampling=spec.sampling,
                          max_common_length=spec.max_common_length,
                          record_routes=spec.record_routes,
                          paged=spec.paged)
      engine = engines.engine()
      if spec.lora is not None:
        self._adapters_to_rollout(spec, layout, engine.param_shardings)
    self.engine = engine
    self._start_driver = start_driver or self._plain_driver
    # The batch's common prefix (empty: none); a driver starts with it.
    self.common_prefix = np.zeros(0, np.int32)
    self._next_prefix = None   # A new prefix waiting for a drain.
    self.version = -1
    self.driver: Driver | None = None
    self.steps = 0
    self.step_s = 0.0  # Wall seconds of those steps (`counters`).
    self._next = None          # (version, params) waiting for a drain
    self._queued: list[Request] = []  # requests for the next version
    self.plateau_step_s: dict[int, float] = {}  # measure_plateau's timings

  # ---------------------------------------------------------------- weights
  def _adapters_to_rollout(self, spec: EngineSpec, layout,
                           rollout_shardings) -> None:
    """The LoRA structures and the jitted merge of a version's adapters
    onto the base (cast and quantized as the trainer's rollout copy)."""
    plain = spec.model.replace(weight_quant="none")
    _, train_like = model_lib.abstract_params(plain.replace(lora=spec.lora))
    adapters_like, base_like = lora.split(train_like)
    self._adapter_treedef = jax.tree.structure(adapters_like)
    self._base_treedef = jax.tree.structure(base_like)
    self._base_shardings = layout.param_shardings(base_like)
    _, _, to_rollout = rollout_copy.rollout_model(
        plain, None, lora_spec=spec.lora, quant=spec.model.weight_quant)
    self._merge = jax.jit(
        lambda adapters, base: to_rollout(nnx.merge_state(adapters, base)),
        out_shardings=rollout_shardings)
    self._base = None

  def load(self, version: int, leaves: Sequence, base=None) -> int:
    """Installs weights `version` (flat host leaves; a LoRA policy's: its
    adapters, merged onto `base`, the frozen base's leaves, sent with a
    worker's first version); returns the version."""
    if self.spec is not None and self.spec.lora is not None:
      if base is not None:
        self._base = jax.device_put(jax.tree.unflatten(
            self._base_treedef, list(base)), self._base_shardings)
      params = self._merge(jax.tree.unflatten(self._adapter_treedef,
                                              list(leaves)), self._base)
    else:
      params = jax.tree.unflatten(self._treedef, list(leaves))
      params = jax.device_put(params, self.engine.param_shardings)
    d = self.driver
    if d is not None:  # Requests not started yet start on the new weights.
      self._queued = list(d.pending) + self._queued
      d.pending.clear()
    if d is not None and d.busy:
      # Samples in flight finish on the weights they started with; the
      # queued requests wait for the driver to drain (see `submit`).
      self._next = (version, params)
      return self.version
    self._install(version, params)
    return version

  def pull(self, store) -> int:
    """Pulls the newest version from `store` if this worker is behind."""
    latest = store.latest()
    if latest != self.version:
      lora_base = (self.spec is not None and self.spec.lora is not None
                   and self._base is None)
      self.load(*store.pull(latest), *((store.base(),) if lora_base else ()))
    return self.version

  def install(self, version: int, params) -> None:
    """Starts decoding with device params already in the engine's layout."""
    self._queued = []
    self._install(version, params)

  def unload(self) -> None:
    """Drops the params and all work (the trainer takes its devices back)."""
    self.driver, self.params, self._next, self._queued = None, None, None, []
    self._next_prefix = None
    self.version = -1

  def _install(self, version, params):
    self.version, self.params = version, params
    if self._next_prefix is not None:
      self.common_prefix, self._next_prefix = self._next_prefix, None
    self.driver = self._start_driver(params, version, self._queued,
                                     self.common_prefix)
    self._next, self._queued = None, []

  def _plain_driver(self, params, version, requests, common_prefix):
    driver = Driver(self.engine, params, weight_version=version)
    driver.start(requests, common_prefix=common_prefix)
    return driver

  def set_common_prefix(self, tokens) -> None:
    """The prefix every request of the coming batch starts with (empty:
    none): prefilled once per weight version and stored once. A worker
    still draining older work switches once it drains."""
    tokens = np.asarray(tokens, np.int32)
    if np.array_equal(tokens, self.common_prefix):
      return
    d = self.driver
    if d is not None and (d.busy or self._next is not None):
      self._next_prefix = tokens
      return
    self.common_prefix = tokens
    if d is not None:
      self._queued = list(d.pending) + self._queued
      d.pending.clear()
      self._install(self.version, self.params)

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

  def take_running(self, n: int) -> list[Partial]:
    """Cuts up to `n` running samples out; returns their tokens so far.

    CONTINUOUSLB's running moves: the manager continues them on an idle
    worker (`continuation.py`). Single samples move (live, or waiting for
    a slot), most budget left first, at most the engine's group entries
    (`sched.offload.samples_to_cut`): a sample frees its slot and pages on
    its own, and its group's other samples stay. The remaining budget is
    an upper bound on a sample's remaining length (a stop token may end it
    earlier); it is what the engine knows.
    """
    d = self.driver
    if d is None or n < 1:
      return []
    return d.cut(offload.samples_to_cut(d.budget_left(), n,
                                        d.engine.num_groups))

  def measure_plateau(self, fraction: float = 0.8, steps: int = 5,
                      counts: Sequence[int] | None = None) -> int:
    """The batching plateau B of this worker's engine, measured.

    Times a decode step with b live samples for each b in `counts`
    (default: 1 and every multiple of the row size up to the slots),
    dummy prompts inserted straight into the idle engine, a warm-up step
    first, the fastest of `steps` timed steps (other load only adds), and
    returns `sched.offload.batching_plateau` of throughput(b) =
    b / step time (step time linear between measured counts): the smallest
    b reaching `fraction` of the full batch's throughput. The engine runs
    only the listed live slots (`_step_s`), so its step time grows with b
    and B sits where throughput levels off. Needs an idle worker with
    weights.
    """
    d = self.driver
    if d is None:
      raise RuntimeError(f"worker {self.worker_id} has no weights yet")
    if d.busy or self._queued:
      raise RuntimeError(f"worker {self.worker_id} is busy; measure when idle")
    eng = self.engine
    G, slots = eng.samples_per_group, eng.num_slots
    counts = sorted(set(counts or [1, *range(G, slots + 1, G), slots]))
    if not 1 <= counts[0] <= counts[-1] <= slots:
      raise ValueError(f"counts {counts} must lie in [1, {slots}]")
    times = [self._step_s(b, steps) for b in counts]
    self.plateau_step_s = dict(zip(counts, times))
    return offload.batching_plateau(
        lambda b: b / float(np.interp(b, counts, times)), slots, fraction)

  def _step_s(self, b: int, steps: int) -> float:
    """The fastest of `steps` decode steps of the idle engine with b
    live samples: groups of G on a one-token dummy prompt, dealt over the
    replicas as the driver would (a group on one replica), each sample
    with pages for every token it writes. The engine runs only the listed
    slots, so its step time grows with b (a real knee)."""
    eng: Engine = self.engine
    G, D = eng.samples_per_group, eng.replicas
    pool = PagePool(eng.num_pages, eng.page_size, D)
    own = pool.pages_for(steps + 3)  # Warm-up + timed steps + start.
    pre = eng.prefill(self.params, [(np.ones(1, np.int32), 0)], [0], [0],
                      [list(range(G))])
    state = eng.init_decode_state()
    starts, most_groups = [], 0
    for r in range(D):
      n = b // D + (r < b % D)
      groups = -(-n // G)
      if groups > eng.num_groups // D or groups + n * own > pool.per_replica:
        raise ValueError(f"{b} samples of {steps} steps do not fit the "
                         f"worker's pool or group entries")
      for i in range(groups):
        entry = r * (eng.num_groups // D) + i
        state = eng.insert(state, pre, [entry], [pool.allocate(1, r)], [1],
                           [0], [0])
        for j in range(min(G, n - i * G)):
          starts.append((r * (eng.num_slots // D) + i * G + j, entry, j, j,
                         eng.sampling.max_new_tokens, pool.allocate(own, r)))
      most_groups = max(most_groups, groups)
    state = eng.start(state, starts)
    slots = [x[0] for x in starts]
    step = lambda st: eng.generate(self.params, st, slots=slots,
                                   groups=most_groups, prompt_pages=1,
                                   own_pages=own)
    state, res = step(state)  # Warm-up (compiled).
    jax.block_until_ready(res)
    best = float("inf")  # Min over steps: other load only adds time.
    for _ in range(steps):
      t0 = time.perf_counter()
      state, res = step(state)
      jax.block_until_ready((state, res))
      best = min(best, time.perf_counter() - t0)
    return best

  def clear(self) -> None:
    """Drops every request and sample in flight (they continue elsewhere)."""
    self._queued = []
    if self._next is not None:
      self._install(*self._next)
    elif self.driver is not None:
      # Fed again by `submit` if it is held again.
      self.driver = self._start_driver(self.params, self.version, [],
                                       self.common_prefix)

  def counters(self) -> tuple[int, float]:
    """(driver steps so far, their wall seconds): the pool's step time."""
    return self.steps, self.step_s

  def poll(self, max_steps: int = 8) -> PollResult:
    """Runs up to `max_steps` decode iterations (fewer once idle)."""
    d = self.driver
    finished: list[Sample] = []
    for _ in range(max_steps):
      if d is None or not d.busy:
        break
      t0 = time.perf_counter()
      finished += d.step()
      self.steps += 1
      self.step_s += time.perf_counter() - t0
    if d is not None and not d.busy and self._next is not None:
      self._install(*self._next)
      d = self.driver
    elif d is not None and not d.busy and self._next_prefix is not None:
      self._install(self.version, self.params)
      d = self.driver
    pending = (len(d.pending) if d else 0) + len(self._queued)
    engine = d.engine if d else self.engine  # Consolidation may shrink it.
    return PollResult(finished, d.partials() if d else [], pending,
                      self.version, engine.num_slots)


def ray_worker(num_cpus: float = 1, num_gpus: float = 0,
               resources: dict[str, float] | None = None):
  """`RolloutWorker` as a Ray actor class (its own process and devices).

  `resources`: custom Ray resources each actor needs, e.g. {"TPU": 4} for
  a TPU host's chips, or {"spot": 1} to place workers only on nodes started
  with `ray start --resources='{"spot": 8}'`.
  """
  import ray  # Optional extra: pip install .[ray]

  return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus,
                    resources=dict(resources or {}),
                    max_restarts=0)(RolloutWorker)
