"""Asynchronous rollout: its own devices decode while the trainer trains,
never more than eta weight versions behind it.

  ar = AsyncRollout(PagedBackend(engines), iterator, num_samples=G,
                    seed=seed, eta=1, ...)
  ar.start(rollout_params, version=s0, first_step=s0 + 1)
  batch = ar.take(step)                      # blocks until it is complete
  ar.publish(rollout_params, version=step)   # the trainer's new weights
  snap = ar.publish(..., snapshot=True); ...; ar.release()   # checkpoint
  ar.close()

A background thread runs one paged driver over batch after batch (prompts
from the job's iterator, in order: batch b is what step b trains on), or
drives the elastic workers' manager the same way
(`rollout/async_workers.py`). Its rules (`sched/staleness.py`),
deterministic because they count finished groups, never seconds:

- Batch b is drawn and queued once the rollout holds version >= b - 1 - eta,
  so the samples the trainer (at version b - 1) meets are at most eta
  versions old. eta = 0 is the synchronous job: batch b waits for b - 1.
- The rollout takes version v once batch v is complete and
  `switch_after_groups` more groups have finished, or earlier when it has
  nothing else to decode; it waits there for the trainer to publish v.
- At that switch every unfinished sample is cut with its tokens and goes on
  with the new weights on a new driver (`engine/restart.py`): its KV is
  recomputed ("continue"), or its tokens are dropped and it is sampled
  again ("restart"). Each token records the version that drew it
  (`Sample.token_versions`; `weight_version` is the oldest).
- A checkpoint after step s holds the rollout's host state at its switch to
  version s (`snapshot`); a resumed run starts from it with version s, the
  very thing the uninterrupted run did at that switch.
- With DAPO's dynamic sampling (`refill`), this thread scores each round
  of a batch as it finishes (a copy of the job's host scorer); while the
  batch holds fewer than N informative groups and rounds are left, the
  next prompts of the stream join it as a new round (same seed, as the
  synchronous job's rounds), decoded beside the other batches. The batch
  is complete, for the switch rule too, once its last round is scored
  (`rollout/dynamic_sampling.Pool` picks its groups).
"""

from __future__ import annotations

import base64
import dataclasses
import threading
import time
from typing import Iterator

import numpy as np

from rlhf_jax.samples import PromptBatch
from rlhf_jax.engine import common_prefix as common_lib
from rlhf_jax.engine import restart
from rlhf_jax.engine.controller import Controller
from rlhf_jax.samples import Partial, Request, Sample
from rlhf_jax.engine.engine_set import EngineSet
from rlhf_jax.rollout import dynamic_sampling
from rlhf_jax.rollout.base import requests_for, step_seed
from rlhf_jax.sched import staleness

IN_FLIGHT = ("continue", "restart")


@dataclasses.dataclass
class Batch:
  """One step's samples, complete, in prompt order (G per prompt); with
  dynamic sampling, scored: the rewards, which rows train (`valid`) and
  the rounds' metrics (`scored`: the scorer's and the refill's)."""
  step: int
  prompts: PromptBatch
  samples: list[Sample]
  metrics: dict
  rewards: np.ndarray | None = None
  valid: np.ndarray | None = None
  scored: dict = dataclasses.field(default_factory=dict)


class AsyncRollout:
  """Decodes batches ahead of the trainer on its backend; see the module
  doc."""

  def __init__(self, backend, iterator: Iterator[PromptBatch], *,
               num_samples: int, seed: int, eta: int,
               switch_after_groups: int, in_flight: str, last_step: int,
               refill: dynamic_sampling.Refill | None = None):
    """`backend`: where the samples decode (`PagedBackend`, or
    `rollout/async_workers.WorkerBackend`); `refill`: DAPO's dynamic
    sampling (None: none)."""
    if in_flight not in IN_FLIGHT:
      raise ValueError(f"in_flight {in_flight!r}: one of {IN_FLIGHT}")
    self.backend, self.iterator = backend, iterator
    self.G, self.seed, self.eta = num_samples, seed, eta
    self.switch_after_groups, self.in_flight = switch_after_groups, in_flight
    self.last_step, self.refill = last_step, refill
    self._cv = threading.Condition()
    self._weights: dict[int, object] = {}   # version -> rollout params
    self._ready: dict[int, Batch] = {}
    self._snapshot_at: int | None = None
    self._snapshot: dict | None = None
    self._released = True
    self._error: BaseException | None = None
    self._closed = False
    self._thread: threading.Thread | None = None
    # The prompt prefix the run stores once (`rollout.max_common_length`;
    # empty: none; None: not set before the first batch), and the length
    # its driver stores.
    self.common: np.ndarray | None = None
    self.stored_prefix = 0
    self.counters = dict(switches=0, recomputed_tokens=0, restarted_tokens=0,
                         decode_steps=0, wait_weights_s=0.0, decode_s=0.0)

  # ------------------------------------------------------- trainer side
  def start(self, params, version: int, *, first_step: int,
            snapshot: dict | None = None) -> None:
    """Starts decoding with `params` (version `version`) from batch
    `first_step`, or from a checkpoint's `snapshot` (taken at the switch
    to `version`)."""
    self.version, self.next_batch = version, first_step
    # Batch b's round in flight (its first, or a refill) and its groups.
    self.batches: dict[int, PromptBatch] = {}
    self.finished: dict[int, dict[int, list[Sample]]] = {}  # b -> pid -> G
    # Dynamic sampling: each incomplete batch's scored rounds, and the
    # batches whose next round is due.
    self.pools: dict[int, dynamic_sampling.Pool] = {}
    self.refills: list[int] = []
    self.marks: dict[tuple, list[tuple[int, int]]] = {}
    self._delivered = dict(self.counters)  # Counters at the last delivery.
    partials, pending = [], []
    if snapshot is not None:
      partials, pending = self._load(snapshot)
    self._thread = threading.Thread(
        target=self._main, args=(params, partials, pending),
        name="async-rollout", daemon=True)
    self._thread.start()

  def publish(self, params, version: int, *,
              snapshot: bool = False) -> dict | None:
    """Makes `params` the weights of `version`. With `snapshot`, waits for
    the rollout to reach its switch to `version` and returns its host
    state there; the rollout then waits for `release()`."""
    with self._cv:
      self._weights[version] = params
      if snapshot:
        self._snapshot_at, self._released = version, False
      self._cv.notify_all()
      if not snapshot:
        return None
      self._wait(lambda: self._snapshot is not None)
      out, self._snapshot = self._snapshot, None
      return out

  def release(self) -> None:
    with self._cv:
      self._released = True
      self._cv.notify_all()

  def take(self, step: int) -> Batch:
    """Batch `step`, once all its groups have finished."""
    with self._cv:
      self._wait(lambda: step in self._ready)
      return self._ready.pop(step)

  def close(self) -> None:
    with self._cv:
      self._closed = True
      self._cv.notify_all()
    if self._thread is not None:
      self._thread.join()

  def _wait(self, ready) -> None:
    """Waits (holding the lock) until `ready()`; raises the thread's error."""
    while not ready():
      if self._error is not None:
        raise RuntimeError("the async rollout failed") from self._error
      if self._thread is not None and not self._thread.is_alive():
        raise RuntimeError("the async rollout stopped")
      self._cv.wait(timeout=1.0)

  # ------------------------------------------------------ rollout thread
  def _main(self, params, partials, pending) -> None:
    try:
      self._decode(params, partials, pending)
    except BaseException as e:  # Reaches the trainer at its next wait.
      with self._cv:
        self._error = e
        self._cv.notify_all()

  def _decode(self, params, partials, pending) -> None:
    driver = self._driver(params, partials, pending)
    after = 0   # Groups finished since batch version + 1 completed.
    while not self._closed:
      driver = self._draw(driver)
      v = self.version + 1
      complete = v < self.next_batch and v not in self.finished
      if staleness.switch_due(complete, after, self.switch_after_groups,
                              driver.busy):
        for s in self.backend.drain(driver):
          self._route(s)
        params = self._weights_of(v)
        if params is None:
          return
        driver, after = self._switch(driver, params, v), 0
        continue
      if not driver.busy:
        if self.next_batch > self.last_step and not self.finished:
          return  # Every batch is out.
        raise RuntimeError(f"async rollout stuck at version {self.version}")
      t0 = time.perf_counter()
      finished = driver.step()
      self.counters["decode_s"] += time.perf_counter() - t0
      self.counters["decode_steps"] += 1
      for s in finished:
        if self._route(s) and complete:
          after += 1

  def _driver(self, params, partials, pending):
    driver = self.backend.open(params, self.version, partials, pending,
                               common=self.common)
    self.stored_prefix = self.backend.stored_prefix(driver)
    return driver

  def _draw(self, driver):
    """Queues the refill rounds due, then batch b while the rollout's
    version allows it; returns the driver (a new one, with the same
    weights, where a round shares less of the stored prompt prefix than
    the run's prompts so far)."""
    while self.refills:
      driver = self._add(driver, self.refills.pop(0), next(self.iterator))
    while (self.next_batch <= self.last_step
           and staleness.may_draw(self.next_batch, self.version, self.eta)):
      driver = self._add(driver, self.next_batch, next(self.iterator))
      self.next_batch += 1
    return driver

  def _add(self, driver, b: int, prompts: PromptBatch):
    """Batch b's next round, `prompts`, on the driver (its first round
    opens its pool: N = its prompts)."""
    if self.refill is not None and b not in self.pools:
      self.pools[b] = self.refill.pool(len(prompts.prompt_ids), self.G)
    self.batches[b] = prompts
    self.finished[b] = {int(p): [] for p in prompts.prompt_ids}
    requests = requests_for(prompts, self.G, self._seed(b))
    for r in requests:
      for i in range(r.num_samples):
        self.marks[_key(r, r.first_sample_index + i)] = [(0, self.version)]
    stored = np.zeros(0, np.int32) if self.common is None else self.common
    self.common = self.backend.common_prefix(requests, self.common)
    if not np.array_equal(self.common, stored):
      driver = self._reopen(driver)
    driver.add(requests)
    return driver

  def _reopen(self, driver):
    """The run on a new driver with the same weights and `self.common`.
    Batches are drawn only at the start and right after a switch, so the
    driver replaced has not stepped: nothing to drain, and its partials
    (a switch's, counted there) are recomputed once, by the new one."""
    for s in self.backend.drain(driver):
      self._route(s)
    partials, pending = self.backend.unfinished(driver)
    return self._driver(driver.params, partials, pending)

  def _route(self, sample: Sample) -> bool:
    """Files a finished sample under its batch; True if it completed a
    group."""
    b = self._batch_of[sample.seed]
    versions = _token_versions(self.marks.pop(
        (sample.prompt_id, sample.seed, sample.sample_idx)),
        len(sample.tokens))
    group = self.finished[b][sample.prompt_id]
    group.append(dataclasses.replace(
        sample, weight_version=min(versions, default=self.version),
        token_versions=versions))
    if len(group) < self.G:
      return False
    if all(len(g) == self.G for g in self.finished[b].values()):
      self._round_done(b)
    return True

  def _round_done(self, b: int) -> None:
    """Batch b's round in flight has finished: the batch is complete, or
    (dynamic sampling) its round is scored and the batch is complete once
    its pool is, else its next round is due."""
    by_prompt, prompts = self.finished.pop(b), self.batches.pop(b)
    groups = [sorted(by_prompt[int(pid)], key=lambda s: s.sample_idx)
              for pid in prompts.prompt_ids]
    if self.refill is None:
      self._deliver(Batch(b, prompts, [s for g in groups for s in g], {}))
      return
    pool = self.pools[b]
    pool.add(self.refill.score_round(groups, prompts))
    if not pool.done:
      self.refills.append(b)
      self.finished[b] = {}  # Incomplete until its next round is in.
      return
    del self.pools[b]
    got = pool.result()
    self._deliver(Batch(b, prompts, got.samples, {}, got.rewards, got.valid,
                        got.metrics))

  def _deliver(self, batch: Batch) -> None:
    batch.metrics = {k: v - self._delivered[k]
                     for k, v in self.counters.items()}
    self._delivered = dict(self.counters)
    with self._cv:
      self._ready[batch.step] = batch
      self._cv.notify_all()

  def _weights_of(self, v: int):
    """The weights of version v, waiting for the trainer; None: closed."""
    t0 = time.perf_counter()
    with self._cv:
      while v not in self._weights and not self._closed:
        self._cv.wait()
      self.counters["wait_weights_s"] += time.perf_counter() - t0
      return None if self._closed else self._weights.pop(v)

  def _switch(self, driver, params, v: int):
    """Version v: every unfinished sample continues on a new driver."""
    partials, pending = self.backend.unfinished(driver)
    kept = []
    for p in partials:
      n = 0 if self.in_flight == "restart" or len(p.tokens) <= 1 else len(
          p.tokens)
      self.counters["restarted_tokens"] += len(p.tokens) - n
      self.counters["recomputed_tokens"] += max(n - 1, 0)
      key = _key(p.request, p.sample_idx)
      self.marks[key] = ([m for m in self.marks[key] if m[0] < n]
                         + [(n, v)])
      kept.append(p if n else dataclasses.replace(
          p, tokens=[], logp=[], logp_raw=[],
          routes=None if p.routes is None else []))
    for r in pending:
      for i in range(r.num_samples):
        self.marks[_key(r, r.first_sample_index + i)] = [(0, v)]
    self.version = v
    self.counters["switches"] += 1
    with self._cv:
      if self._snapshot_at == v:
        self._snapshot = self._dump(kept, pending)
        self._cv.notify_all()
        while not self._released and not self._closed:
          self._cv.wait()
    return self._driver(params, kept, pending)

  # --------------------------------------------------------- bookkeeping
  def _seed(self, b: int) -> int:
    return step_seed(self.seed, b)

  @property
  def _batch_of(self) -> dict[int, int]:
    return {self._seed(b): b for b in self.finished}

  # ------------------------------------------------------------ snapshot
  def _dump(self, partials: list[Partial], pending: list[Request]) -> dict:
    """The rollout's host state at a switch, as JSON-able values."""
    return {
        "version": self.version, "next_batch": self.next_batch,
        "counters": self.counters, "delivered": self._delivered,
        "common": None if self.common is None else self.common.tolist(),
        "batches": {str(b): _prompts_dict(p) for b, p in self.batches.items()},
        "ready": {str(b): dict(prompts=_prompts_dict(r.prompts),
                               samples=[_sample_dict(s) for s in r.samples],
                               metrics=r.metrics, **_scored_dict(r))
                  for b, r in self._ready.items()},
        "pools": {str(b): _pool_dict(p) for b, p in self.pools.items()},
        "refills": list(self.refills),
        "finished": [_sample_dict(s) for g in self.finished.values()
                     for ss in g.values() for s in ss],
        "partials": [dict(prompt_id=p.request.prompt_id,
                          seed=p.request.seed, sample_idx=p.sample_idx,
                          tokens=p.tokens, logp=p.logp,
                          logp_raw=p.logp_raw,
                          **_routes_dict(p.prompt_routes, p.routes))
                     for p in partials],
        "pending": [[r.prompt_id, r.seed] for r in pending],
        "marks": [[list(k), [list(m) for m in v]]
                  for k, v in self.marks.items()]}

  def _load(self, snap: dict) -> tuple[list[Partial], list[Request]]:
    """Rebuilds the state `_dump` wrote; returns (partials, pending)."""
    self.version, self.next_batch = snap["version"], snap["next_batch"]
    self.counters, self._delivered = (dict(snap["counters"]),
                                      dict(snap["delivered"]))
    common = snap.get("common")  # Absent in snapshots before it existed.
    self.common = None if common is None else np.asarray(common, np.int32)
    requests = {}
    for b, p in snap["batches"].items():
      self.batches[int(b)] = prompts = _prompts_from(p)
      self.finished[int(b)] = {int(i): [] for i in prompts.prompt_ids}
      for r in requests_for(prompts, self.G, self._seed(int(b))):
        requests[r.prompt_id, r.seed] = r
    for b, r in snap["ready"].items():
      self._ready[int(b)] = Batch(int(b), _prompts_from(r["prompts"]), [
          _sample_from(s) for s in r["samples"]], r["metrics"],
                                  **_scored_from(r))
    for b, p in snap.get("pools", {}).items():  # Dynamic sampling's.
      self.pools[int(b)] = _pool_from(p, self.refill, self.G)
    self.refills = list(snap.get("refills", []))
    for b in self.refills:  # Between rounds: no round in flight.
      self.finished[b] = {}
    self.marks = {tuple(k): [tuple(m) for m in v] for k, v in snap["marks"]}
    for d in snap["finished"]:
      s = _sample_from(d)
      self.finished[self._batch_of[s.seed]][s.prompt_id].append(s)
    engine_max = self.backend.max_new_tokens
    partials = []
    for p in snap["partials"]:
      r = requests[p["prompt_id"], p["seed"]]
      i = p["sample_idx"] - r.first_sample_index
      partials.append(Partial(r, p["sample_idx"], p["tokens"], p["logp"],
                              p["logp_raw"], r.budget(i, engine_max),
                              self.version, **_routes_from(p, rows=True)))
    return partials, [requests[pid, seed] for pid, seed in snap["pending"]]


class PagedBackend:
  """Decoding on the engines of the rollout's own devices: a driver per
  weight version, unfinished samples cut and continued by
  `engine/restart.py` (KV recomputed)."""

  def __init__(self, engines: EngineSet):
    self.engines = engines
    self.max_new_tokens = engines.sampling.max_new_tokens

  def open(self, params, version: int, partials: list[Partial],
           pending: list[Request], *, common: np.ndarray | None = None):
    """A started driver with weights `version` storing the prompt prefix
    `common` once: the partials first."""
    driver = self.engines.driver(params, version)
    # One decode step a call: the weight switch is checked between calls.
    driver.start(pending, controller=Controller(window=1),
                 common_prefix=common)
    restart.readmit(driver, partials)
    return driver

  def common_prefix(self, requests: list[Request],
                    current: np.ndarray | None) -> np.ndarray:
    """The prefix the run stores once with `requests` joining it."""
    return common_lib.batch_common_prefix(
        [r.tokens for r in requests],
        self.engines.engine().max_common_length, current)

  @staticmethod
  def stored_prefix(driver) -> int:
    """The prompt prefix length `driver`'s engine stores once."""
    return driver.stats.common_prefix_length

  drain = staticmethod(restart.drain)
  unfinished = staticmethod(restart.unfinished)


def _key(request: Request, sample_idx: int) -> tuple[int, int, int]:
  return request.prompt_id, request.seed, sample_idx


def _token_versions(marks: list[tuple[int, int]], n: int) -> list[int]:
  """Per-token versions from (first token index, version) marks."""
  out = []
  for k, (start, v) in enumerate(marks):
    end = marks[k + 1][0] if k + 1 < len(marks) else n
    out += [v] * (min(end, n) - start)
  return out


_SAMPLE_FIELDS = ("prompt_id", "sample_idx", "tokens", "logp", "logp_raw",
                  "finish_reason", "weight_version", "seed", "token_versions")


def _sample_dict(s: Sample) -> dict:
  out = {k: getattr(s, k) for k in _SAMPLE_FIELDS}
  out["prompt_tokens"] = np.asarray(s.prompt_tokens).tolist()
  return {**out, **_routes_dict(s.prompt_routes, s.routes)}


def _sample_from(d: dict) -> Sample:
  return Sample(prompt_tokens=np.asarray(d["prompt_tokens"], np.int32),
                **{k: d[k] for k in _SAMPLE_FIELDS}, **_routes_from(d))


def _scored_dict(batch: Batch) -> dict:
  """A dynamic-sampling batch's rewards, rows trained and metrics."""
  if batch.rewards is None:
    return {}
  return dict(rewards=batch.rewards.tolist(), valid=batch.valid.tolist(),
              scored=batch.scored)


def _scored_from(d: dict) -> dict:
  if "rewards" not in d:
    return {}
  return dict(rewards=np.asarray(d["rewards"], np.float32),
              valid=np.asarray(d["valid"], bool), scored=d["scored"])


def _pool_dict(pool: dynamic_sampling.Pool) -> dict:
  return dict(num_groups=pool.N,
              samples=[_sample_dict(s) for s in pool.samples],
              rewards=[r.tolist() for r in pool.rewards],
              metrics=pool.round_metrics)


def _pool_from(d: dict, refill: dynamic_sampling.Refill,
               group_size: int) -> dynamic_sampling.Pool:
  """The pool `_pool_dict` wrote."""
  pool = refill.pool(d["num_groups"], group_size)
  pool.samples = [_sample_from(s) for s in d["samples"]]
  pool.rewards = [np.asarray(r, np.float32) for r in d["rewards"]]
  pool.round_metrics = list(d["metrics"])
  return pool


def _prompts_dict(p: PromptBatch) -> dict:
  return dict(prompt_ids=p.prompt_ids.tolist(), tokens=p.tokens_NxP.tolist(),
              lengths=p.lengths_N.tolist(), prompts=list(p.prompts),
              metadata=list(p.metadata))


def _prompts_from(d: dict) -> PromptBatch:
  return PromptBatch(np.asarray(d["prompt_ids"], np.int32),
                     np.asarray(d["tokens"], np.int32),
                     np.asarray(d["lengths"], np.int32), d["prompts"],
                     d["metadata"])


# Routing replay's records in a snapshot: little-endian int16 bytes in
# base64 (an MoE's L x k ids a token: JSON lists would be twice the size).
# A partial's unrecorded tokens (None) are rows of -1, as in a Sample.
def _routes_dict(prompt_routes, routes) -> dict:
  """{} when nothing was recorded (a dense policy's, or no replay)."""
  rows = [r for r in (() if routes is None else routes) if r is not None]
  if prompt_routes is None and not rows:
    return {}
  out = {}
  if prompt_routes is not None:
    out["prompt_routes"] = _b64(prompt_routes)
  if routes is not None:
    if isinstance(routes, list):  # A partial's: rows, or None (unrecorded).
      width = np.shape(rows[0]) if rows else (0,)
      routes = np.stack([np.full(width, -1) if r is None else r
                         for r in routes]) if routes else np.zeros((0,) + width)
    out["routes"] = _b64(routes)
  return out


def _b64(a) -> dict:
  a = np.asarray(a, "<i2")
  return dict(shape=list(a.shape),
              b64=base64.b64encode(a.tobytes()).decode("ascii"))


def _routes_from(d: dict, rows: bool = False) -> dict:
  """`rows`: a partial's routes, a list with None for unrecorded tokens."""
  out = {}
  for name in ("prompt_routes", "routes"):
    r = d.get(name)
    out[name] = None if r is None else np.frombuffer(
        base64.b64decode(r["b64"]), "<i2").reshape(r["shape"]).astype(
            np.int16)
  if rows and out["routes"] is not None:
    out["routes"] = [None if (r < 0).all() else r for r in out["routes"]]
  return out
