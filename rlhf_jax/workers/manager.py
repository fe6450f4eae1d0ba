"""Rollout manager: dispatch to workers, stream tokens, survive preemption.

RLBoost's manager over `RolloutWorker`s that come and go:
  - dispatch by join-shortest-queue with at most Theta pending requests per
    worker (`sched.offload.select_instance`), only to workers holding the
    newest weights;
  - every poll streams back finished samples and the tokens so far of the
    unfinished ones, so the manager always holds each response's prefix;
  - a worker that dies or times out (preemption) loses nothing: each of its
    unfinished samples is re-dispatched as prompt + tokens so far with the
    remaining budget (`continuation.py`), and its tokens continue exactly;
  - CONTINUOUSLB (`sched.offload.balance_moves`): a worker with nothing
    pending takes requests still queued on the busiest one; with
    `plateau=B` set, an idle worker also takes the running samples above B
    of the busiest (single samples, most budget left first,
    `RolloutWorker.take_running`), continued as
    prompt + tokens so far
    like a preempted worker's; B comes from `RolloutWorker.measure_plateau`
    or is given;
  - a sample that finished on older weights than the newest published is
    discarded and sampled again, so the learner never sees a stale sample.
Workers are reached through handles: `LocalHandle` (in-process) or
`RayHandle` (a Ray actor; failures are Ray's actor errors and timeouts).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Sequence

import numpy as np

from rlhf_jax.samples import Partial, Request, Sample
from rlhf_jax.sched import offload
from rlhf_jax.workers import continuation
from rlhf_jax.workers import weights as weights_lib


class WorkerDied(RuntimeError):
  """A worker stopped answering (killed, preempted, timed out)."""


class LocalHandle:
  """An in-process worker; `kill()` simulates a preemption."""

  timeout_s = float("inf")  # Its calls return when done.

  def __init__(self, worker):
    self.worker, self.worker_id, self.alive = worker, worker.worker_id, True

  def call_async(self, name: str, *args):
    # An error inside the worker's method (a bad request) is raised as it
    # is: the worker is alive, and retrying elsewhere would fail the same.
    if not self.alive:
      return WorkerDied(self.worker_id)
    return getattr(self.worker, name)(*args)

  def done(self, future) -> bool:
    del future
    return True

  def result(self, future):
    if isinstance(future, WorkerDied):
      raise future
    return future

  def kill(self):
    self.alive = False


class RayHandle:
  """A Ray actor worker; errors and timeouts count as a dead worker."""

  def __init__(self, actor, worker_id: str, timeout_s: float = 120.0):
    import ray
    self._ray, self.actor = ray, actor
    self.worker_id, self.timeout_s, self.alive = worker_id, timeout_s, True

  def call_async(self, name: str, *args):
    return getattr(self.actor, name).remote(*args)

  def done(self, future) -> bool:
    """Whether `future` has its answer (does not wait)."""
    ready, _ = self._ray.wait([future], timeout=0)
    return bool(ready)

  def result(self, future):
    exceptions = self._ray.exceptions
    try:
      return self._ray.get(future, timeout=self.timeout_s)
    except exceptions.RayTaskError as e:
      # The method raised inside a live actor (a bad request): re-raise the
      # worker's own error, as LocalHandle does.
      raise e.as_instanceof_cause() from None
    except (exceptions.RayError, TimeoutError) as e:
      self.alive = False
      raise WorkerDied(f"{self.worker_id}: {e!r}") from e

  def kill(self):
    self._ray.kill(self.actor)
    self.alive = False


@dataclasses.dataclass
class _SampleState:
  """One sample across the workers that worked on it."""
  request: Request          # the original request (whole prompt)
  budget: int
  head: list = dataclasses.field(default_factory=list)      # tokens before
  head_logp: list = dataclasses.field(default_factory=list)  # the last cut
  head_raw: list = dataclasses.field(default_factory=list)
  head_version: int | None = None
  # Routing replay (workers that record experts): the prompt's and each
  # head token's records (`continuation.absorb_routes`).
  prompt_routes: Any = None
  head_routes: list = dataclasses.field(default_factory=list)
  live: Any = None          # newest streamed Partial on the current worker
  worker: str | None = None

  def absorb_live(self) -> None:
    """The streamed tokens join the head (the sample is cut there)."""
    if self.live is not None:
      self.prompt_routes, self.head_routes = continuation.absorb_routes(
          len(self.request.tokens), self.prompt_routes, self.head_routes,
          len(self.head), self.live)
      self.head += self.live.tokens
      self.head_logp += self.live.logp
      self.head_raw += self.live.logp_raw
      v = self.live.weight_version
      self.head_version = v if self.head_version is None else min(
          self.head_version, v)
    self.live = None


@dataclasses.dataclass
class ManagerStats:
  preemptions: int = 0
  migrated_samples: int = 0
  reprefill_tokens: int = 0   # prompt + kept tokens prefilled again
  kept_tokens: int = 0        # tokens generated before a cut, kept
  balanced_requests: int = 0  # queued requests moved to an idle worker
  moved_running: int = 0      # running samples moved to an idle worker
                              # (also counted in migrated_samples)
  stale_resampled: int = 0
  pulls: int = 0
  pull_s: float = 0.0
  pull_bytes: int = 0         # versions shipped to workers
  base_bytes: int = 0         # LoRA bases shipped (once per joining worker)
  # Tokens each worker generated (of samples it finished; a continued
  # sample's earlier tokens count for the worker that made them).
  tokens: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)


class RolloutManager:
  """Runs batches of requests over a changing set of workers."""

  def __init__(self, store, *, max_new_tokens: int, theta: int = 4,
               poll_steps: int = 8, plateau: int | None = None,
               spec_lora=None):
    self.store, self.max_new_tokens = store, max_new_tokens
    # A LoRA policy (its `LoraSpec`): versions are adapters; a worker gets
    # the store's base with its first version.
    self.spec_lora = spec_lora
    # A sample finished on weights older than the newest is sampled again
    # (the synchronous contract); async RL keeps it (its versions counted).
    self.resample_stale = True
    self._has_base: set[str] = set()
    self.theta, self.poll_steps = theta, poll_steps
    # Batching plateau B in samples: running samples above it move to an
    # idle worker. None: running samples never move (queued ones still do).
    self.plateau = plateau
    self.handles: dict[str, Any] = {}
    self.versions: dict[str, int] = {}
    self.stats = ManagerStats()
    self.produced: collections.Counter = collections.Counter()  # per worker
    self.on_poll = None  # Test/replay hook: called before each poll round.
    # With no worker alive, wait this long for one to join (an availability
    # trace's gap) before giving up.
    self.wait_for_workers_s = 0.0
    self._states = self._pending = None
    self._lost: list[str] = []
    self._running: dict[str, tuple[int, int]] = {}
    self._sent: dict[str, int] = {}  # Newest version sent to each worker.
    # The batch's common prefix, and the one each worker holds.
    self.common_prefix = np.zeros(0, np.int32)
    self._prefix_of: dict[str, tuple] = {}

  # ---------------------------------------------------------- membership
  def add(self, handle, version: int = -1) -> None:
    """A worker joins; it pulls the newest weights before its first work
    unless it already holds `version` (the trainer's own engine)."""
    self.handles[handle.worker_id] = handle
    self.versions[handle.worker_id] = version
    self._sent.pop(handle.worker_id, None)
    self._prefix_of.pop(handle.worker_id, None)
    self._has_base.discard(handle.worker_id)

  def _refresh(self) -> int:
    """Stale live workers pull the newest version; returns it."""
    latest = self.store.latest()
    # A worker still draining old samples holds the newest version queued
    # (`RolloutWorker.load`); it is not sent again.
    stale = [w for w, v in self.versions.items()
             if v != latest and self._sent.get(w) != latest
             and self.handles[w].alive]
    if stale:
      t0 = time.perf_counter()
      version, payload = self.store.pull(latest)
      size = weights_lib.payload_bytes(payload)
      base = base_size = None
      if self.spec_lora is not None and set(stale) - self._has_base:
        base = self.store.base()
        base_size = weights_lib.payload_bytes(base)
      futures = {}
      for w in stale:
        extra = () if base is None or w in self._has_base else (base,)
        futures[w] = self.handles[w].call_async("load", version, payload,
                                                *extra)
        self.stats.pull_bytes += size
        self.stats.base_bytes += base_size if extra else 0
      for w, f in futures.items():
        try:
          self.versions[w] = self.handles[w].result(f)
          self._sent[w] = version
          if base is not None:
            self._has_base.add(w)
        except WorkerDied:
          self._lost.append(w)
      self.stats.pulls += len(stale)
      self.stats.pull_s += time.perf_counter() - t0
    # Workers whose common prefix is not this batch's get it (a worker
    # starts with none).
    want = tuple(self.common_prefix.tolist())
    for w in [w for w, h in self.handles.items()
              if h.alive and self._prefix_of.get(w, ()) != want]:
      self._call(w, "set_common_prefix", self.common_prefix)
      self._prefix_of[w] = want
    return latest

  def remove(self, worker_id: str) -> None:
    """A worker leaves gracefully (released, or handed off after seeding).

    Its unfinished samples continue on other workers from the tokens it
    streamed (the same path as a preemption, not counted as one); queued
    requests it had not admitted go back to the manager's queue.
    """
    handle = self.handles.get(worker_id)
    if handle is None:
      return
    if self._states is not None:
      self._requeue(worker_id, self._states, self._done, self._queue)
    if handle.alive:  # Its engine drops the work that now runs elsewhere.
      try:
        handle.result(handle.call_async("clear"))
      except WorkerDied:
        pass
    handle.alive = False
    del self.handles[worker_id]
    self.versions.pop(worker_id, None)
    self._sent.pop(worker_id, None)
    if self._pending is not None:
      self._pending.pop(worker_id, None)
    self._running.pop(worker_id, None)

  # ---------------------------------------------------------------- run
  def run(self, requests: Sequence[Request],
          common_prefix=None) -> list[Sample]:
    """Every sample of `requests`, whatever happens to the workers."""
    self.start(requests, common_prefix)
    while not self.done:
      self.step()
    return self.results()

  def start(self, requests: Sequence[Request],
            common_prefix=None) -> None:
    """Queues a batch; `step()` then advances it one poll round at a time.

    `common_prefix`: tokens every request starts with, stored once per
    worker (None or empty: none).
    """
    self.common_prefix = np.asarray(
        [] if common_prefix is None else common_prefix, np.int32)
    self._lost = []
    self._states = {}
    self._queue = collections.deque()
    self._done = {}
    self.extend(requests)
    self._pending = collections.defaultdict(int)
    self._running = {}  # worker -> (live samples, slots)

  @property
  def done(self) -> bool:
    return len(self._done) == len(self._states)

  @property
  def unfinished(self) -> int:
    """Samples not finished yet."""
    return len(self._states) - len(self._done)

  def results(self) -> list[Sample]:
    """The batch's samples in (prompt id, seed, sample index) order."""
    return [self._done[k] for k in sorted(self._done)]

  def extend(self, requests: Sequence[Request], heads=()) -> None:
    """Queues more requests behind the batch's (async RL keeps several
    batches in flight). `heads`: `Partial`s to continue, each as prompt +
    its tokens so far (a resumed or switched async rollout)."""
    for p in heads:  # Ahead of the new prompts, as the paged engine does.
      key = _key(p.request, p.sample_idx)
      st = self._states[key] = _SampleState(p.request, p.budget)
      st.head, st.head_logp, st.head_raw = (list(p.tokens), list(p.logp),
                                            list(p.logp_raw))
      st.head_version = p.weight_version if p.tokens else None
      if p.tokens:
        st.prompt_routes, st.head_routes = p.prompt_routes, list(
            p.routes or [])
      self._queue.append(continuation.remaining_request(
          p.request, p.sample_idx, p.budget, st.head))
    for req in requests:
      for j in range(req.num_samples):
        self._states[_key(req, req.first_sample_index + j)] = _SampleState(
            req, req.budget(j, self.max_new_tokens))
      self._queue.append(req)

  def take_unfinished(self) -> tuple[list[Partial], list[Request]]:
    """Cuts every unfinished sample off its worker (the workers drop their
    work) and hands back (each unfinished sample of a started request,
    with its tokens so far; the requests none of whose samples started),
    in key order, emptying the manager: async RL's switch to new weights.
    The finished samples must have been read."""
    for w, h in self.handles.items():
      if h.alive:
        self._call(w, "clear")
    by_request: dict[tuple, list] = collections.defaultdict(list)
    for key, st in sorted(self._states.items(), key=lambda kv: kv[0]):
      if key in self._done:
        by_request[key[:2]].append(None)
        continue
      st.absorb_live()
      by_request[key[:2]].append(Partial(
          st.request, key[2], st.head, st.head_logp, st.head_raw, st.budget,
          -1 if st.head_version is None else st.head_version,
          prompt_routes=st.prompt_routes, routes=list(st.head_routes)))
    partials, pending = [], []
    for parts in by_request.values():
      live = [p for p in parts if p is not None]
      if not live:
        continue
      if (len(live) == live[0].request.num_samples
          and not any(p.tokens for p in live)):
        pending.append(live[0].request)  # Prefilled once for its G.
      else:
        partials += live
    self.start([])
    self._lost, self._running = [], {}
    return partials, pending

  def forget(self, samples: Sequence[Sample]) -> None:
    """Drops finished samples the caller has taken (async RL's manager
    outlives a batch)."""
    for s in samples:
      key = s.prompt_id, s.seed, s.sample_idx
      self._states.pop(key, None)
      self._done.pop(key, None)

  def step(self) -> list[Sample]:
    """One poll round: membership, weights, dispatch, poll, balance, requeue.

    Returns the samples that finished in this round (fresh ones only).
    """
    states, done, queue = self._states, self._done, self._queue
    pending = self._pending
    finished = []
    if self.on_poll is not None:
      self.on_poll(self)
    # Handles killed from outside (a replayed preemption, `kill()`).
    self._lost += [w for w, h in self.handles.items()
                   if not h.alive and w not in self._lost]
    latest = self._refresh()
    self._dispatch(queue, pending, states, latest)
    alive = [w for w, h in self.handles.items() if h.alive
             and w not in self._lost]
    if not alive and not self._lost:
      self._await_workers()
      return finished
    self._gap = None
    futures = {w: self.handles[w].call_async("poll", self.poll_steps)
               for w in alive}
    for w, f in futures.items():
      try:
        res = self.handles[w].result(f)
      except WorkerDied:
        self._lost.append(w)
        continue
      pending[w] = res.pending
      self.versions[w] = res.version  # Installed once its old work drained.
      self._running[w] = (len(res.partials), res.slots)
      for p in res.partials:  # (Work cut since is no longer a state.)
        st = states.get(_key(p.request, p.sample_idx))
        if st is not None:
          st.live = p
      for s in res.finished:
        if self._finish(s, states, done, queue, latest):
          self.produced[w] += 1
          self.stats.tokens[w] += len(s.tokens)
          finished.append(done[s.prompt_id, s.seed, s.sample_idx])
    self._balance(pending, states, latest, queue)
    for w in self._lost:
      self._requeue(w, states, done, queue)
      try:  # A timed-out actor may still run: free its resources.
        self.handles[w].kill()
      except Exception:  # pylint: disable=broad-except
        pass  # Already gone.
      self.handles[w].alive = False
      self._sent.pop(w, None)
      self.versions.pop(w, None)
      pending.pop(w, None)
      self.stats.preemptions += 1
    self._lost = []
    for w in list(self.handles):
      if not self.handles[w].alive:
        del self.handles[w]
    return finished

  def _await_workers(self) -> None:
    t0 = time.perf_counter()
    self._gap = getattr(self, "_gap", None) or t0
    if t0 - self._gap >= self.wait_for_workers_s:
      raise RuntimeError(
          f"no rollout worker alive for {t0 - self._gap:.1f}s "
          f"(wait_for_workers_s={self.wait_for_workers_s}); add workers")
    time.sleep(0.01)

  def _dispatch(self, queue, pending, states, latest):
    ids = [w for w, h in self.handles.items()
           if h.alive and self.versions.get(w) == latest]
    while queue and ids:
      views = [offload.QueueView(pending[w], *self._running.get(w, (0, 1)))
               for w in ids]
      pick = offload.select_instance(views, self.theta)
      if pick is None:
        return
      w, req = ids[pick], queue.popleft()
      if self._call(w, "submit", [req]) is None:
        queue.appendleft(req)
        ids.remove(w)
        continue
      pending[w] += 1
      for j in range(req.num_samples):
        st = states[_key(req, req.first_sample_index + j)]
        st.worker, st.live = w, None

  def _call(self, w: str, name: str, *args):
    """`name(*args)` on worker w; a dead worker is marked lost (None)."""
    try:
      return self.handles[w].result(self.handles[w].call_async(name, *args))
    except WorkerDied:
      self._lost.append(w)
      return None

  def _balance(self, pending, states, latest, queue):
    """Moves queued requests from the busiest workers to idle ones, and
    (with `plateau` set) running samples above the plateau to idle ones."""
    ids = [w for w, h in self.handles.items() if h.alive and
           w not in self._lost and self.versions.get(w) == latest]
    views = [offload.QueueView(pending[w], *self._running.get(w, (0, 1)))
             for w in ids]
    for src, dst, count, running in offload.worker_moves(views, self.plateau):
      s, d = ids[src], ids[dst]
      if running:  # Cut on s, continued on d from the tokens so far.
        parts = self._call(s, "take_running", count)
        if not parts:
          continue
        conts = collections.deque()
        for p in parts:
          key = _key(p.request, p.sample_idx)
          states[key].live = p  # Its tokens as of the cut.
          self._continue(key, states[key], conts)
        reqs = list(reversed(conts))  # In the order they were cut.
        self.stats.moved_running += len(parts)
        n, slots = self._running.get(s, (0, 1))
        self._running[s] = (max(n - len(parts), 0), slots)
      else:
        reqs = self._call(s, "take_pending", count)
        if not reqs:
          continue
        pending[s] -= len(reqs)
      if self._call(d, "submit", reqs) is None:
        queue.extendleft(reversed(reqs))  # Queue front, in order.
        continue
      pending[d] += len(reqs)
      if not running:
        self.stats.balanced_requests += len(reqs)
      for req in reqs:
        for j in range(req.num_samples):
          states[_key(req, req.first_sample_index + j)].worker = d

  def _finish(self, s: Sample, states, done, queue, latest):
    key = s.prompt_id, s.seed, s.sample_idx
    st = states.get(key)
    if st is None or key in done:
      # A duplicate after a timeout that was not a death, or a late answer
      # for work cut since (`take_unfinished`).
      return False
    version = min(v for v in (st.head_version, s.weight_version)
                  if v is not None)
    if version != latest and self.resample_stale:  # Sample it again.
      self.stats.stale_resampled += 1
      st.head, st.head_logp, st.head_raw, st.head_version = [], [], [], None
      st.prompt_routes, st.head_routes = None, []
      queue.append(continuation.remaining_request(
          st.request, s.sample_idx, st.budget, []))
      return False
    head = None
    if st.head:
      head = _Head(st.head, st.head_logp, st.head_raw, st.prompt_routes,
                   st.head_routes)
    done[key] = continuation.merge(st.request.tokens, head, s, version)
    st.live = None
    return True

  def _requeue(self, w, states, done, queue):
    """Unfinished samples of a lost or removed worker continue elsewhere.

    A request none of whose samples had started goes back whole (one
    prefill for its G samples); a started sample continues from its tokens.
    """
    keys = [k for k, st in states.items() if st.worker == w and k not in done]
    requests = {id(states[k].request): states[k].request for k in keys}
    for kind, item in offload.requeue_plan(
        keys, lambda k: states[k].live is not None or bool(states[k].head),
        lambda k: id(states[k].request),
        lambda g: requests[g].num_samples):
      if kind == "continue":
        self._continue(item, states[item], queue)
      else:
        queue.appendleft(requests[item])
    for k in keys:
      states[k].worker = None

  def _continue(self, key, st, queue):
    if st.live is not None:
      self.stats.kept_tokens += len(st.live.tokens)
      self.stats.tokens[st.worker] += len(st.live.tokens)
    st.absorb_live()
    st.worker = None
    req = continuation.remaining_request(st.request, key[2], st.budget,
                                         st.head)
    self.stats.migrated_samples += 1
    self.stats.reprefill_tokens += len(req.tokens)
    queue.appendleft(req)


def _key(request: Request, sample_idx: int) -> tuple[int, int, int]:
  """A sample's state key: its batch's seed tells recurring prompts apart."""
  return request.prompt_id, request.seed, sample_idx


@dataclasses.dataclass
class _Head:
  tokens: list
  logp: list
  logp_raw: list
  prompt_routes: Any = None
  routes: list = dataclasses.field(default_factory=list)
