"""Rollouts on elastic workers (`rlhf_jax/workers/`, docs/elastic.md).

With `rollout.workers.num > 0` a step publishes the policy once to the
weight store (host copy) and runs its prompts on the workers through the
`RolloutManager` (JSQ dispatch, preemption-safe continuation, stale
samples re-sampled). Workers are in-process engines on the trainer's
devices (`kind="local"`, tests) or Ray actors in their own JAX processes
(`kind="ray"`). Layers, all optional and composable:
  - `workers.seed`: the trainer's own engine seeds each rollout for T_seed,
    then hands its unfinished samples to the workers (RLBoost adaptive
    offload, `workers/seeding.py`); while it seeds it runs the job's
    `LocalRollout` decode loop, so the long-tail policies apply on the
    trainer's mesh;
  - `workers.scale="cost"`: hold the cost-aware number of workers each
    step (`workers/demand_pool.py`);
  - `rollout.max_common_length > 0`: the batch's common prefix is stored
    once on every worker (and on the trainer's engine).
Groups stream out as they complete; `trainer_free` turns True at the
hand-off (at once without seeding), when a streaming consumer may train.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Iterator

import jax
import numpy as np
from absl import logging

from rlhf_jax.config.sections import Rollout as RolloutSection
from rlhf_jax.samples import PromptBatch
from rlhf_jax.models import lora
from rlhf_jax.rollout.base import Group, Groups, Rollout, requests_for
from rlhf_jax.rollout.engines import sampling_params
from rlhf_jax.sched import offload
from rlhf_jax.workers import manager as manager_lib
from rlhf_jax.workers import ray_local
from rlhf_jax.workers import weights as weights_lib
from rlhf_jax.workers.demand_pool import DemandScaler, WorkerPool
from rlhf_jax.workers.seeding import TRAINER_ID, SeedWindow
from rlhf_jax.workers.worker import EngineSpec, RolloutWorker, ray_worker


def lora_version(store, master, base_published: bool):
  """What a version of a LoRA policy (`master`, the trainer's) carries to
  the workers: its adapters; they merge them into the frozen base, which
  goes to `store` first unless `base_published`."""
  adapters, base = lora.split(master)
  if not base_published:
    store.publish_base(base)
  return adapters


class ElasticRollout(Rollout):
  """Prompt batches on a `RolloutManager`'s workers (see the module doc)."""

  def __init__(self, manager: manager_lib.RolloutManager, *,
               scaler: DemandScaler | None = None,
               seed_window: SeedWindow | None = None,
               common_prefix: Callable[[list], np.ndarray] | None = None,
               train_time: Callable[[int], float | None] | None = None):
    """
    Args:
      manager: dispatches to the workers.
      scaler: chooses and holds the workers of each rollout.
      seed_window: the trainer's engine seeding each rollout, or None.
      common_prefix: requests -> the batch's shared prefix (None: none).
      train_time: step -> the trainer's train seconds of that step (the
        seed window's worker cap), or None.
    """
    self.manager, self.scaler, self.seed_window = manager, scaler, seed_window
    self._common_prefix = common_prefix
    self._train_time = train_time or (lambda step: None)
    self.params = None
    # A LoRA policy: versions carry adapters, the base goes once.
    self.adapters_only = manager.spec_lora is not None
    self._base_published = False
    self._full_bytes = 0  # Of the rollout copy: what a full pull ships.
    self._free = False
    self._metrics: dict = {}

  on_workers = True  # The workers decode (`Rollout.on_workers`).

  @property
  def trainer_free(self) -> bool:
    return self._free

  @property
  def length_history(self):
    s = self.scaler
    return s.history if s is not None and s.scale == "cost" else None

  def set_weights(self, params, version: int, master=None) -> None:
    """Publishes `params` as `version` (once; dynamic sampling reruns a
    step's rollout on the same version). A LoRA policy's workers merge
    for themselves: a version is its adapters (of `master`), and the
    frozen base is published once."""
    store = self.manager.store
    try:
      published = store.latest()
    except LookupError:
      published = None
    if published != version:
      if self.adapters_only:
        store.publish(version, lora_version(store, master,
                                            self._base_published))
        self._base_published = True
      else:
        store.publish(version, params)
    self.params, self.version = params, version
    self._full_bytes = weights_lib.payload_bytes(jax.tree.leaves(params))

  def stream(self, prompts: PromptBatch, num_samples: int, seed: int, *,
             step: int = 0, trainer_busy=None,
             freed=None) -> Iterator[Group]:
    """Groups as they complete; `trainer_busy` (streamed training) tells
    the seed window when the trainer's devices are not waiting. (`freed`:
    no replicas of the trainer's are freed here, `frees_replicas`.)"""
    del freed
    mgr, window = self.manager, self.seed_window
    mgr.stats = manager_lib.ManagerStats()
    if self.scaler is not None:  # Scale to demand: hold this rollout's.
      self.scaler.begin(prompts.prompt_ids, num_samples, self.version,
                        cap=window.worker_cap if window is not None else None)
    requests = requests_for(prompts, num_samples, seed)
    common = (self._common_prefix(requests) if self._common_prefix
              else np.zeros(0, np.int32))
    if window is not None:
      rounds = window.rounds(mgr, self.params, self.version, requests, common,
                             train_s=self._train_time(step - 1),
                             trainer_busy=trainer_busy)
    else:
      mgr.start(requests, common_prefix=common)
      rounds = _rounds(mgr)
    self._free = window is None
    groups, samples = Groups(prompts, num_samples), []
    for finished in rounds:
      self._free = window is None or window.handed_off
      samples += finished
      for sample in finished:
        group = groups.add(sample)
        if group is not None:
          yield group
    self._free = True
    groups.check_complete()
    self._metrics = self._collect_metrics(samples, common)

  def metrics(self) -> dict:
    return dict(self._metrics)

  def _collect_metrics(self, samples, common) -> dict:
    mgr, st = self.manager, self.manager.stats
    remote = [w for w in st.tokens if w != TRAINER_ID]  # Not the seeder.
    metrics = {"workers/alive": float(len(mgr.handles)),
               "workers/preemptions": float(st.preemptions),
               "workers/migrated_samples": float(st.migrated_samples),
               "workers/stale_resampled": float(st.stale_resampled),
               "workers/pull_s": st.pull_s,
               # Bytes workers pulled, and per pull as a fraction of the
               # rollout copy (a LoRA policy's adapters: well below 1).
               "workers/pulls": float(st.pulls),
               "workers/pull_bytes": float(st.pull_bytes),
               "workers/base_bytes": float(st.base_bytes),
               "workers/pull_fraction": float(
                   st.pull_bytes / (st.pulls * self._full_bytes)
                   if st.pulls and self._full_bytes else 0.0),
               "workers/tokens": float(sum(st.tokens[w] for w in remote)),
               "workers/trainer_tokens": float(st.tokens[TRAINER_ID]),
               "rollout/common_prefix_len": float(len(common))}
    if self.seed_window is not None:
      metrics.update(self.seed_window.metrics)
    if self.scaler is not None:  # held, worker_s, chosen and the inputs.
      metrics.update(self.scaler.end(samples, st.pull_s, st.pulls))
    return metrics

  def close(self) -> float:
    """Releases every held worker (Ray actors end); total worker-seconds."""
    return self.scaler.pool.close() if self.scaler is not None else 0.0


def _rounds(mgr) -> Iterator[list]:
  """The manager's poll rounds until its batch is done."""
  while not mgr.done:
    yield mgr.step()


def build(ro: RolloutSection, cfg, stop_tokens, *, rollout_tensor: int,
          local=None, train_time=None, common_prefix=None,
          lora_spec=None, record_routes: bool = False) -> ElasticRollout:
  """The elastic rollout of `rollout.workers` (num > 0).

  Args:
    ro: the rollout section.
    cfg: the model config (workers build their engines from it).
    stop_tokens: sampling stops at these tokens.
    rollout_tensor: the trainer's rollout tensor size (a worker's rows).
    local: the job's `LocalRollout`, which seeds with `workers.seed`.
    train_time: step -> train seconds (the seed window's worker cap).
    common_prefix: requests -> the batch's shared prefix, or None.
    lora_spec: a LoRA policy's adapters (workers pull those and merge).
    record_routes: the workers record an MoE's experts (routing replay).
  """
  w = ro.workers
  mgr, pool, spec = build_manager(ro, cfg, stop_tokens,
                                  rollout_tensor=rollout_tensor,
                                  lora_spec=lora_spec,
                                  record_routes=record_routes)
  scaler = DemandScaler(
      pool, scale=w.scale, lam=w.cost_lambda,
      slots=spec.slots,
      max_new_tokens=ro.max_new_tokens, devices_per_worker=w.devices_per_worker)
  window = None
  if w.seed:
    window = SeedWindow(local, offload.SeedWindowController(
        n_resv=1, t_init=w.seed_init_s, eta=w.seed_eta, floor=w.seed_floor_s))
  return ElasticRollout(mgr, scaler=scaler, seed_window=window,
                        common_prefix=common_prefix, train_time=train_time)


def build_manager(ro: RolloutSection, cfg, stop_tokens, *,
                  rollout_tensor: int, lora_spec=None,
                  record_routes: bool = False):
  """(`RolloutManager`, its `WorkerPool` holding all `rollout.workers.num`
  workers, their `EngineSpec`) of the rollout section `ro`."""
  w = ro.workers
  replicas = jax.device_count() // max(rollout_tensor, 1)
  spec = EngineSpec(cfg, num_rows=max(1, ro.num_rows // replicas)
                    * w.devices_per_worker,
                    samples_per_row=ro.samples_per_row,
                    # Continuations (prompt + tokens so far, after a
                    # preemption or hand-off) need the longest bucket.
                    prefill_buckets=tuple(sorted(set(ro.prefill_buckets) | {
                        max(ro.prefill_buckets) + ro.max_new_tokens})),
                    sampling=sampling_params(ro, stop_tokens),
                    max_common_length=ro.max_common_length, lora=lora_spec,
                    paged=_worker_pages(ro, replicas, w.devices_per_worker),
                    record_routes=record_routes)
  store, spawn = (_ray_workers(w, spec) if w.kind == "ray"
                  else _local_workers(w, spec))
  mgr = manager_lib.RolloutManager(store, max_new_tokens=ro.max_new_tokens,
                                   theta=w.theta, poll_steps=w.poll_steps,
                                   spec_lora=lora_spec)
  pool = WorkerPool(mgr)
  # Every poll round the pool admits workers that finished starting and
  # replaces dead ones; with none alive the manager waits for one as long
  # as a worker may take to answer.
  mgr.on_poll, mgr.wait_for_workers_s = pool, w.timeout_s
  for i in range(w.num):
    pool.offer(f"w{i}", lambda wid=f"w{i}": spawn(wid))
  pool.hold(w.num)  # Every worker at first; each rollout re-chooses.
  return mgr, pool, spec


def _worker_pages(ro: RolloutSection, replicas: int, devices: int) -> dict:
  """A worker's paged engine arguments: the pages and slots per device of
  the trainer's mesh (0 stays automatic)."""
  per = lambda n: n // replicas * devices
  return dict(page_size=ro.page_size, num_pages=per(ro.kv_pages),
              num_slots=per(ro.num_slots),
              # One decode step a call: a poll of `poll_steps` iterations
              # is that many tokens a sample.
              decode_window=1)


def _local_workers(w, spec):
  """In-process workers on the first devices (tests, spare devices)."""
  devs, k = jax.devices(), w.devices_per_worker
  workers = {f"w{i}": RolloutWorker(f"w{i}", spec,
                                    devices=devs[i * k:(i + 1) * k])
             for i in range(w.num)}

  def spawn(wid):  # Releasing just stops using the in-process worker.
    workers[wid].clear()  # Work it held when it died runs elsewhere.
    return manager_lib.LocalHandle(workers[wid])

  return weights_lib.LocalWeightStore(), spawn


def _ray_workers(w, spec):
  """Ray actors in their own JAX processes (an existing cluster when
  RAY_ADDRESS is set, else a local one)."""
  import ray  # Optional extra: pip install .[ray]

  need = w.num * w.cpus_per_worker
  if not ray.is_initialized():
    if os.environ.get("RAY_ADDRESS"):
      ray.init(include_dashboard=False, log_to_driver=False)
    else:  # On loopback only (`ray_local`). Its workers share this
      # machine's cores (and it offers the custom resources they ask for).
      ray_local.init_local(
          num_cpus=max(os.cpu_count() or 1, math.ceil(need)),
          resources={k: v * w.num for k, v in w.ray_resources.items()},
          log_to_driver=False)
  per_worker = {"CPU": w.cpus_per_worker, "GPU": w.gpus_per_worker,
                **w.ray_resources}
  have = ray.cluster_resources()
  short = {k: (have.get(k, 0), v * w.num) for k, v in per_worker.items()
           if have.get(k, 0) < v * w.num}
  if short:  # An actor Ray cannot place would time out as dead.
    logging.warning(
        "Ray cluster has {resource: (have, %d workers need)} %s; the rest "
        "start when nodes join", w.num, short)
  actor = ray_worker(num_cpus=w.cpus_per_worker, num_gpus=w.gpus_per_worker,
                     resources=dict(w.ray_resources))

  def spawn(wid):  # Holding starts an actor; releasing kills it.
    return manager_lib.RayHandle(
        actor.remote(wid, spec, None, w.devices_per_worker), wid,
        timeout_s=w.timeout_s)

  return weights_lib.RayWeightStore(), spawn
