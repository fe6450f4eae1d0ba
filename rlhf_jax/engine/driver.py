"""Sample-level continuous batching over the engine, streaming samples.

JetStream-orchestrator style, in one thread: requests in, `Sample`s out as
soon as they finish; each `generate` call's packed result is copied to the
host asynchronously and read only after the next call is dispatched, so the
host never stalls the device. `run(requests, common_prefix=...)` adds
two-level sharing: a token prefix common to all requests (declared, or
detected with "auto") is prefilled once and stored once; each group then
holds only its tokens after it (same samples as without it). The
decisions a page pool needs are all taken here on the host:

- Admission: pending prompts are prefilled `prefill_batch` at a time into
  free group entries when the pool has their prompt pages and there are
  free slots no waiting sample will take ("static", the baseline: only
  when no group is admitted, then as many as fit). Their samples wait in
  the group until a slot frees. With data replicas, a group lives on one
  replica (its entry, its samples' slots and all its pages): the one with
  the most free pages among those with room.
- Slots: a slot whose sample finished takes the next waiting sample at once
  (oldest group first of its replica), whatever group it belongs to; the
  rest of the old group keeps reading its prompt pages once per step.
- Pages: before each step every live sample is given pages for its known
  length + 2 tokens (the step in flight and the one dispatched now).
- Exhaustion policy (stated and tested): when a live sample needs a page and
  none is free on its replica, the most recently started live sample of
  that replica is preempted: it is stopped on the device, its own pages
  are freed, and it goes back to the front of its group's waiting samples
  with the tokens read so far. When it gets a slot again,
  `moves.recompute` recomputes its KV (one call for the samples of a group
  started together) and it continues with the same tokens (sampling keys
  do not depend on the slot). Admission and restarts never preempt: they
  wait for pages. A prompt whose one sample cannot fit its replica's pool
  is refused in one line before any work (`_validate`), never silently
  truncated.
- Consolidation (`consolidate`, called by a long-tail controller): the run
  continues on an engine over the first replicas only. Their slots, groups
  and pages stay as they are (the state is viewed there, no copy); a group
  on a dropped replica moves its pages to a kept one, or is admitted again
  (its prompt prefilled anew and its live samples recomputed), with the
  same tokens.
"""

from __future__ import annotations

import collections
import math
from typing import Iterable, Iterator, Sequence

import numpy as np

from rlhf_jax.samples import Partial, Request, Sample
from rlhf_jax.engine.page_pool import PagePool, PoolExhausted
from rlhf_jax.engine import common_prefix as common_lib
from rlhf_jax.engine import moves
from rlhf_jax.engine.controller import Controller, most_free_replica
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.groups import (
    DriverStats, Group, PagedStats, Slot, Waiting, member_samples)
from rlhf_jax.engine.state import Prefill


class Driver:
  """Streams samples for a stream of requests through one Engine.

  During a run, `engine`, `params`, `state` (the decode state), `live`
  (slot -> sample decoding), `groups` (entry -> admitted prompt) and
  `pending` (requests not yet admitted) are its state; a `Controller` may
  read them and, in `switch`, move the run (`consolidate`).
  """

  def __init__(self, engine: Engine, params, *, weight_version: int = 0):
    self.engine = engine
    self.params = params
    self.weight_version = weight_version
    self.stats = DriverStats()
    self._controller = None
    self.paged = PagedStats(groups_by_replica=[0] * engine.replicas)

  def run(self, requests: Iterable[Request], *,
          common_prefix: str | Sequence[int] | np.ndarray | None = None,
          min_common_length: int = 16, admission: str = "continuous",
          controller: "Controller | None" = None) -> Iterator[Sample]:
    """Samples every request; yields each sample as soon as it finishes.

    Args:
      requests: prompts (whole, including any common prefix).
      common_prefix: None (no common prefix), "auto" (the longest token
        prefix of all requests, if >= `min_common_length`, capped at the
        engine's `max_common_length`), or the common tokens themselves,
        which every request must start with. It is prefilled once and
        stored once for all groups (`Engine.set_common_prefix`).
      min_common_length: threshold of "auto".
      admission: "continuous" (a prompt is admitted as soon as pages and
        a slot allow) or "static" (a new wave of prompts only once no
        group is admitted: the synchronous batching of most RL
        frameworks).
      controller: optional scheduling hooks (`Controller`): the replica a
        prompt's group goes to, and a move of the run between decode
        steps (long-tail consolidation, `long_tail.py`).

    Yields:
      `Sample`s; `prompt_tokens` is the whole request prompt.
    """
    self.start(requests, common_prefix=common_prefix,
               min_common_length=min_common_length, admission=admission,
               controller=controller)
    while self.busy:
      yield from self.step()

  # ------------------------------------------------------------ the run
  def start(self, requests: Iterable[Request] = (), *, common_prefix=None,
            min_common_length: int = 16, admission: str = "continuous",
            controller: Controller | None = None) -> None:
    """Begins a run (arguments as `run`); drive it with `step()`."""
    if admission not in ("continuous", "static"):
      raise ValueError(f"admission={admission!r}: 'continuous' or 'static'")
    eng: Engine = self.engine
    pending, common = self._open(requests, common_prefix, min_common_length)
    D = eng.replicas
    self.pool = PagePool(eng.num_pages, eng.page_size, D)
    self.pending = pending
    self.live: dict[int, Slot] = {}
    self.groups: dict[int, Group] = {}        # entry -> group
    # Per replica, lowest ids first.
    blocks = lambda n: [list(range((r + 1) * n // D - 1, r * n // D - 1, -1))
                        for r in range(D)]
    self._free_entries = blocks(eng.num_groups)
    self._free_slots = blocks(eng.num_slots)
    self._common, self._admission = common, admission
    self._controller = controller or Controller()
    self._readmit: collections.deque[Group] = collections.deque()
    # Samples that keep their slot and pages out of decoding (the
    # multi-turn driver's, while their environment answers): no switch
    # moves the run while any is parked.
    self.parked: dict[int, Slot] = {}
    self._events = collections.deque()
    self._unread = 0  # Decode steps dispatched whose results are unread.
    self._order = 0

  def _open(self, requests, common_prefix, min_common_length):
    """Validates every request (bad input fails before any work), sets the
    run's common prefix on the engine and a fresh decode state; returns
    (the pending requests, the common tokens)."""
    eng = self.engine
    pending = collections.deque(requests)
    common = self._resolve_common_prefix(pending, common_prefix,
                                         min_common_length)
    for req in pending:
      self._validate(req, common)
    if common.size:
      eng.set_common_prefix(self.params, common)
      self.stats.prefill_tokens += eng.max_common_length
    else:
      eng.clear_common_prefix()
    self.stats.common_prefix_length = int(common.size)
    self.state = eng.init_decode_state()
    return pending, common

  def add(self, requests: Iterable[Request]) -> None:
    """Queues more requests into a started run (a worker fed over time)."""
    requests = list(requests)
    for req in requests:
      self._validate(req, self._common)
    self.pending.extend(requests)

  @property
  def controller(self) -> "Controller | None":
    """The scheduling hooks of the run under way (None before a run)."""
    return self._controller

  @property
  def busy(self) -> bool:
    return bool(self.pending or self.live or self._events or self.groups
                or self._readmit)

  def _validate(self, req: Request, common: np.ndarray) -> None:
    eng = self.engine
    own = common_lib.strip_common_prefix(req.tokens, common, req.prompt_id)
    if common.size and own.size > eng.max_prefill_length:
      raise ValueError(
          f"prompt {req.prompt_id} has {own.size} tokens after the common "
          f"prefix of {common.size}, longer than the largest prefill "
          f"bucket {eng.max_prefill_length}")
    eng.pad_prompt(own, req.prompt_id)
    if not 1 <= req.num_samples <= eng.samples_per_group:
      raise ValueError(
          f"prompt {req.prompt_id} asks for num_samples={req.num_samples}; "
          f"the engine holds 1..{eng.samples_per_group} samples per prompt")
    budgets = req.max_new_tokens_per_sample
    if budgets is not None and (len(budgets) != req.num_samples or
                                min(budgets) < 1):
      raise ValueError(
          f"prompt {req.prompt_id}: max_new_tokens_per_sample must hold "
          f"{req.num_samples} budgets >= 1, got {budgets}")
    own = len(req.tokens) - common.size
    need = self.pool_pages_for(own) + eng.max_own_pages
    per_replica = eng.num_pages // eng.replicas
    if need > per_replica:
      raise ValueError(
          f"prompt {req.prompt_id}: one sample needs up to {need} pages "
          f"(prompt + max_new_tokens={eng.sampling.max_new_tokens}), the "
          f"pool has {per_replica} per replica; give the engine more pages")

  def _resolve_common_prefix(self, requests, common_prefix,
                             min_common_length) -> np.ndarray:
    """The common tokens of this run (empty: none), validated."""
    eng = self.engine
    if common_prefix is None:
      return np.zeros(0, np.int32)
    if isinstance(common_prefix, str):
      if common_prefix != "auto":
        raise ValueError(f"common_prefix must be None, 'auto' or tokens, got "
                         f"{common_prefix!r}")
      if not eng.max_common_length:
        raise ValueError("common_prefix='auto' needs an engine built with "
                         "max_common_length > 0")
      return common_lib.longest_common_prefix(
          [r.tokens for r in requests], min_length=min_common_length,
          max_length=eng.max_common_length)
    if not np.asarray(common_prefix).size:
      return np.zeros(0, np.int32)
    return eng.check_common_prefix(common_prefix)

  def pool_pages_for(self, tokens: int) -> int:
    return math.ceil(tokens / self.engine.page_size)

  def step(self) -> list[Sample]:
    eng: Engine = self.engine
    self._admit()
    out = self._start_waiting()
    steps = self._window()
    growth = self._grow(steps)
    if self.live:
      # Read bounds of the busiest replica: groups with live samples, the
      # pages of one's prompt, the own pages of one sample (they hold the
      # device's tokens after the window, `_grow`).
      live_groups = {id(s.group): s.group for s in self.live.values()}
      per_replica = [0] * eng.replicas
      for g in live_groups.values():
        per_replica[g.replica] += 1
      self.state, result = eng.generate(
          self.params, self.state, growth, slots=list(self.live),
          groups=max(per_replica),
          prompt_pages=max(len(g.pages) for g in live_groups.values()),
          own_pages=max(len(s.pages) for s in self.live.values()),
          steps=steps)
      result.copy_to_host_async()
      self._events.append(("step", result, self.stats.steps, steps))
      self.stats.steps += steps
      self._unread += steps
      self._controller.after_step(self)
    self.paged.peak_live = max(self.paged.peak_live, len(self.live))
    kv_tokens = (sum(g.length for g in self.groups.values()) +
                 sum(max(len(s.tokens) - 1, 0) for s in self.live.values()))
    self.paged.peak_kv_tokens = max(self.paged.peak_kv_tokens, kv_tokens)
    self.paged.peak_pages = max(self.paged.peak_pages, self.pool.num_used)
    events = self._events
    while events and (len(events) > 1 or not self.live or
                      events[0][0] == "insert"):
      out.extend(self._consume(events.popleft(), self.live))
    if (self.live and not self.parked
        and self._controller.wants_switch(self)):
      while events:  # The switch needs every sample's host state current.
        out.extend(self._consume(events.popleft(), self.live))
      if self.live:
        self._controller.switch(self)
    if not self.busy and self.pool.num_used:  # An invariant, checked.
      raise RuntimeError(f"{self.pool.num_used} pages still held after the "
                         "run")
    return out

  # ---------------------------------------------------------- decisions
  def _admit(self) -> None:
    """Prefills pending prompts into free entries, `prefill_batch` a call,
    while pages and unclaimed slots allow; groups to admit again (from a
    consolidation) go first. Static admission (the baseline): new prompts
    only while no group is admitted, then as many as fit."""
    static = self._admission == "static"
    new = not static or not self.groups
    while (self._readmit or (new and self.pending)) and self._admit_batch(
        new):
      pass

  def _admit_batch(self, new: bool) -> bool:
    """One prefill call's groups (`new`: pending prompts too)."""
    eng: Engine = self.engine
    waiting = [0] * eng.replicas
    for g in self.groups.values():
      waiting[g.replica] += len(g.waiting)
    batch = []
    def room_for(req) -> list[int]:
      """Replicas with a free entry, a slot no waiting sample will take,
      and pages for the prompt. Prompt pages never take the last sample's
      worth of a replica's pool: with nothing live there, any waiting
      sample can start and run to its end."""
      need = self.pool_pages_for(len(req.tokens) - self._common.size)
      return [r for r in range(eng.replicas)
              if self._free_entries[r]
              and len(self._free_slots[r]) > waiting[r]
              and self.pool.free_in(r) - need >= eng.max_own_pages]

    while ((self._readmit or (new and self.pending))
           and len(batch) < eng.prefill_batch):
      again = self._readmit[0] if self._readmit else None
      if again:
        # A readmitted group's samples were already counted where they
        # were admitted: it goes where the pages are, outside the policy.
        req, room = again.request, room_for(again.request)
        if not room:
          break
        r = most_free_replica(self.pool, room)
      else:
        pick = self._controller.pick(self, room_for)
        if pick is None:
          break
        i, r = pick
        req = self.pending[i]
        del self.pending[i]
      own = np.asarray(req.tokens, np.int32)[self._common.size:]
      need = self.pool_pages_for(own.size)
      pages = self.pool.allocate(need, r)
      self.paged.groups_by_replica[r] += 1
      if again:
        group = self._readmit.popleft()
        group.entry, group.pages, group.replica = (
            self._free_entries[r].pop(), pages, r)
      else:
        self._order += 1
        group = Group(req, self._free_entries[r].pop(), int(own.size), pages,
                       collections.deque(
                           Waiting(j, req.first_sample_index + j,
                                    req.budget(j, eng.sampling.max_new_tokens))
                           for j in range(req.num_samples)), r, self._order)
      self.groups[group.entry] = group
      batch.append((group, own))
      waiting[r] += len(group.waiting)
    chunk = eng.chunk_length
    short = [(g, own) for g, own in batch if own.size <= chunk]
    if short:
      self._prefill_batch(short)
    for group, own in batch:
      if own.size > chunk:
        self._prefill_chunked(group, own)
    return bool(batch)

  def _prefill_batch(self, batch) -> None:
    """Prompts of at most one bucket: one prefill call for all."""
    eng: Engine = self.engine
    reqs = [g.request for g, _ in batch]
    pre = eng.prefill(
        self.params, [(own, g.request.prompt_id) for g, own in batch],
        [r.prompt_id for r in reqs], [r.seed for r in reqs],
        [member_samples(g.request) for g, _ in batch])
    self.state = eng.insert(
        self.state, pre, [g.entry for g, _ in batch],
        [g.pages for g, _ in batch], [g.length for g, _ in batch],
        [r.prompt_id for r in reqs], [r.seed for r in reqs])
    for x in (pre.first_tokens, pre.first_logp, pre.first_logp_raw,
              *(x for x in (pre.routes, pre.first_top) if x is not None)):
      x.copy_to_host_async()
    self._events.append(("insert", [g for g, _ in batch], pre))
    self.stats.prefills += 1
    self.stats.prefill_tokens += pre.k.shape[1] * pre.k.shape[2]

  def _prefill_chunked(self, group: Group, own: np.ndarray) -> None:
    """A prompt past the largest bucket: its first bucket like any prompt,
    then bucket-long chunks that attend to the prompt so far; the G first
    tokens are drawn after the last chunk."""
    eng: Engine = self.engine
    req, chunk = group.request, eng.chunk_length
    idx = member_samples(req)
    pre = eng.prefill(self.params, [(own[:chunk], req.prompt_id)],
                      [req.prompt_id], [req.seed], [idx])
    self.state = eng.insert(self.state, pre, [group.entry],
                            [group.pages[:self.pool_pages_for(chunk)]],
                            [chunk], [req.prompt_id], [req.seed])
    for start in range(chunk, own.size, chunk):
      part = own[start:start + chunk]
      self.state, first = moves.prefill_chunk(
          eng, self.params, self.state, group.entry, group.pages, part,
          start, idx)
      self.stats.prefill_tokens += eng.bucket_for(part.size)
    for x in first:
      x.copy_to_host_async()
    self._events.append(("insert", [group], Prefill(
        None, None, first[0][None], first[1][None], first[2][None])))
    self.stats.prefills += 1 + (own.size - 1) // chunk
    self.stats.prefill_tokens += chunk

  def _start_waiting(self) -> list[Sample]:
    """Free slots take waiting samples, oldest group first; returns the
    samples that end at a first token already on the host."""
    eng: Engine = self.engine
    started = []
    if not any(self._free_slots) or not any(g.waiting
                                            for g in self.groups.values()):
      return []
    for group in sorted(self.groups.values(), key=lambda g: g.order):
      free_slots = self._free_slots[group.replica]
      while group.waiting and free_slots:
        w = group.waiting[0]
        try:
          pages = self.pool.allocate(self.pool_pages_for(len(w.tokens) + 2),
                                     group.replica)
        except PoolExhausted:
          break
        group.waiting.popleft()
        slot = free_slots.pop()
        self._order += 1
        item = Slot(group, w.member, w.sample_idx, w.budget, pages,
                     self.stats.steps, self._order, w.tokens, w.logp,
                     w.logp_raw, w.routes, w.top)
        self.live[slot] = item
        group.live += 1
        started.append((slot, item))
    if not started:
      return []
    self.state = eng.start(self.state, [
        (slot, it.group.entry, it.member, it.sample_idx, it.budget, it.pages)
        for slot, it in started])
    out = []
    redo = collections.defaultdict(list)  # Group entry -> samples.
    for slot, it in started:
      if len(it.tokens) > 1:  # Preempted or moved: recompute its KV.
        redo[it.group.entry].append((slot, it.pages, it.tokens))
        self.paged.recomputed_tokens += len(it.tokens) - 1
      elif not it.tokens and it.group.first is not None:
        out.extend(self._take_first(slot, it))
    for entry, samples in redo.items():  # One call per group.
      self.state = moves.recompute(eng, self.params, self.state, entry,
                                   samples)
    return out

  def _window(self) -> int:
    """Decode steps of the next `generate` call: the engine's window while
    nothing waits for a slot (a finish is read only after the window) and
    the controller allows it, no more than a live sample has left, and
    only if the pool holds their pages; else one."""
    most = min(self.engine.decode_window,
               self._controller.decode_window(self))
    if (most == 1 or not self.live or self.pending or self._readmit
        or any(g.waiting for g in self.groups.values())):
      return 1
    left = max(it.budget - self._device_tokens(it)
               for it in self.live.values())
    steps = max(1, min(most, left))
    short = [0] * self.engine.replicas
    for it in self.live.values():
      short[it.group.replica] += max(
          0, self.pool_pages_for(self._tokens_ahead(it, steps))
          - len(it.pages))
    if any(n > self.pool.free_in(r) for r, n in enumerate(short)):
      return 1  # A window must not preempt.
    return steps

  def _device_tokens(self, it: Slot) -> int:
    """At least the tokens the device has generated for `it` (the host's,
    plus one per unread step; the first comes with the start)."""
    return max(len(it.tokens), 1) + self._unread

  def _tokens_ahead(self, it: Slot, steps: int) -> int:
    """Own tokens whose KV the pool holds after `steps` more steps, and
    one spare: the device's, one a step, no further than the budget."""
    dev = self._device_tokens(it)
    return dev + 1 + min(steps - 1, max(it.budget - dev, 0))

  def _grow(self, steps: int = 1) -> list[tuple[int, int, int]]:
    """Pages for every live sample's tokens of the next `steps` steps,
    oldest sample first; preempts on exhaustion."""
    cap, T = self.engine.max_own_pages, self.engine.page_size
    short = [slot for slot, it in self.live.items()  # Most steps: none.
             if len(it.pages) < cap
             and len(it.pages) * T < self._tokens_ahead(it, steps)]
    growth = []
    for slot in sorted(short, key=lambda s: self.live[s].order):
      it = self.live.get(slot)
      if it is None:  # Preempted by an earlier sample of this loop.
        continue
      need = self.pool_pages_for(self._tokens_ahead(it, steps))
      r = it.group.replica
      while len(it.pages) < min(need, cap):
        try:
          (page,) = self.pool.allocate(1, r)
        except PoolExhausted:
          victim = max((s for s in self.live if self.live[s].group.replica
                        == r), key=lambda s: self.live[s].order)
          self._preempt(victim)
          growth = [g for g in growth if g[0] != victim]
          if victim == slot:
            break
          continue
        growth.append((slot, len(it.pages), page))
        it.pages.append(page)
    return growth

  def _preempt(self, slot: int) -> None:
    it = self.live.pop(slot)
    self.state = self.engine.stop(self.state, [slot])
    self.pool.release(it.pages)
    self._free_slots[it.group.replica].append(slot)
    it.group.live -= 1
    it.group.waiting.appendleft(Waiting(it.member, it.sample_idx, it.budget,
                                         it.tokens, it.logp, it.logp_raw,
                                         it.routes, it.top))
    self.paged.preemptions += 1

  def consolidate(self, engine: Engine, params,
                  kv_groups=lambda groups: groups) -> tuple[int, int, int]:
    """Continues the run on `engine`, an engine on this one's first
    replicas (`EngineSet.engine`), with `params` there. Call with
    every result read. Groups on the dropped replicas move: those that
    `kv_groups` (a filter of the moving groups) keeps and that fit a kept
    replica move their pages there (prompt and each live sample's own
    KV, `moves.gather_kv` / `insert` / `moves.place`); the others are
    admitted again
    (prompt re-prefilled) and their live samples recomputed.

    Returns:
      (samples whose KV moved, samples to recompute, bytes of pages moved).
    """
    src, m = self.engine, engine.replicas
    gone = sorted((g for g in self.groups.values() if g.replica >= m),
                  key=lambda g: g.order)
    lives = {id(g): [] for g in gone}
    for slot, it in sorted(self.live.items()):
      if it.group.replica >= m:
        lives[id(it.group)].append((slot, it))
    pool = self.pool.first(m)
    free_slots, free_entries = self._free_slots[:m], self._free_entries[:m]
    plans = []  # (group, replica, entry, prompt pages, [(it, slot, pages)])
    for g in kv_groups(gone):
      live = lives[id(g)]
      need = len(g.pages) + sum(len(it.pages) for _, it in live)
      room = [r for r in range(m) if free_entries[r]
              and len(free_slots[r]) >= len(live)
              and pool.free_in(r) - need >= engine.max_own_pages]
      if not room or g.first is None or any(not it.tokens for _, it in live):
        continue
      r = max(room, key=lambda r: (pool.free_in(r), -r))
      plans.append((g, r, free_entries[r].pop(), pool.allocate(len(g.pages), r),
                    [(it, free_slots[r].pop(), pool.allocate(len(it.pages), r))
                     for _, it in live]))
    # Read the moving pages before the adopted state's first donation.
    own_pages = [it.pages for p in plans for it, _, _ in p[4]]
    kv_prompt = (moves.gather_kv(src, self.state, [p[0].pages for p in plans])
                 if plans else None)
    kv_own = (moves.gather_kv(src, self.state, own_pages) if own_pages
              else None)
    moving = {id(p[0]) for p in plans}
    redo = 0
    for g in gone:
      del self.groups[g.entry]
      for slot, it in lives[id(g)]:
        del self.live[slot]
      if id(g) in moving:
        continue
      for _, it in sorted(lives[id(g)], key=lambda x: -x[1].order):
        g.live -= 1
        g.waiting.appendleft(Waiting(it.member, it.sample_idx, it.budget,
                                      it.tokens, it.logp, it.logp_raw,
                                      it.routes, it.top))
        redo += 1
      g.pages = []  # Their pages go with the dropped replicas' pool.
      self._readmit.append(g)
    self.state = moves.adopt_state(engine, src, self.state)
    self.engine, self.params, self.pool = engine, params, pool
    self._free_slots, self._free_entries = free_slots, free_entries
    moved = 0
    if plans:
      self._place_moved(plans, kv_prompt, kv_own)
      moved = sum(len(p[4]) for p in plans)
    pages = sum(len(p[3]) + sum(len(x[2]) for x in p[4]) for p in plans)
    self.paged.moved_samples += moved + redo
    return moved, redo, pages * engine.page_bytes

  def _place_moved(self, plans, kv_prompt, kv_own) -> None:
    """The moved groups' prompt KV and meta (`insert`), their samples into
    slots (`start`) with their own KV (`place`), on the new engine."""
    eng: Engine = self.engine
    tok, logp, raw = (np.stack([np.asarray(p[0].first[i]) for p in plans])
                      for i in range(3))
    self.state = eng.insert(
        self.state, Prefill(kv_prompt[0], kv_prompt[1], tok, logp, raw),
        [p[2] for p in plans], [p[3] for p in plans],
        [p[0].length for p in plans], [p[0].request.prompt_id for p in plans],
        [p[0].request.seed for p in plans])
    starts, samples = [], []
    for g, r, entry, pages, moved in plans:
      g.entry, g.replica, g.pages = entry, r, pages
      self.groups[entry] = g
      for it, slot, own in moved:
        it.pages, it.started = own, self.stats.steps
        self.live[slot] = it
        starts.append((slot, entry, it.member, it.sample_idx, it.budget, own))
        samples.append((slot, own, it.tokens))
    if samples:  # A group may move with only waiting samples.
      self.state = eng.start(self.state, starts)
      self.state = moves.place(eng, self.state, samples, *kv_own)

  def budget_left(self) -> dict[tuple[int, int], int]:
    """(prompt id, sample index) -> tokens left in its budget, for every
    admitted unfinished sample, live or waiting for a slot (what `cut`
    may take; a group waiting to be admitted again is not offered)."""
    out = {(it.request.prompt_id, it.sample_idx): it.budget - len(it.tokens)
           for it in self.live.values()}
    for g in self.groups.values():
      for w in g.waiting:
        out[g.request.prompt_id, w.sample_idx] = w.budget - len(w.tokens)
    return out

  def cut(self, keys) -> list[Partial]:
    """Cuts these samples (keys of `budget_left`) out of the run; returns
    them as `Partial`s with the tokens read so far.

    For handing samples to another worker (CONTINUOUSLB running moves):
    they continue there as prompt + tokens so far. A live sample's slot and
    pages free at once (stopped on the device; the step in flight still
    carries a token for it, which is not read: the continuation draws it
    again with the same key); a group left with no sample frees its entry
    and prompt pages. The group's other samples keep their prompt-once
    read.
    """
    keys, out, slots = set(keys), [], []
    for slot, it in list(self.live.items()):
      if (it.request.prompt_id, it.sample_idx) in keys:
        del self.live[slot]
        slots.append(slot)
        self.pool.release(it.pages)
        self._free_slots[it.group.replica].append(slot)
        it.group.live -= 1
        out.append(self._partial(it.group, it))
    for g in list(self.groups.values()):
      cut = [w for w in g.waiting
             if (g.request.prompt_id, w.sample_idx) in keys]
      if cut:
        gone = {id(w) for w in cut}
        g.waiting = collections.deque(w for w in g.waiting
                                      if id(w) not in gone)
      out += [self._partial(g, w) for w in cut]
      self._free_if_empty(g)
    if slots:
      self.state = self.engine.stop(self.state, slots)
    return sorted(out, key=lambda p: (p.request.prompt_id, p.sample_idx))

  def _free_if_empty(self, group: Group) -> None:
    """A group with no sample live or waiting frees its entry and pages."""
    if not group.live and not group.waiting:
      self.pool.release(group.pages)
      del self.groups[group.entry]
      self._free_entries[group.replica].append(group.entry)

  def partials(self) -> list[Partial]:
    """Every admitted sample not finished: live ones with the tokens read
    so far, and those waiting for a slot (new: no tokens; preempted). With
    `pending`, what a preempted worker hands back
    (`workers/continuation.py`)."""
    out = [self._partial(it.group, it) for it in self.live.values()]
    for group in self.groups.values():
      out += [self._partial(group, w) for w in group.waiting]
    return sorted(out, key=lambda p: (p.request.prompt_id, p.sample_idx))

  def _partial(self, group: Group, it: Slot | Waiting) -> Partial:
    """A live or waiting sample with the tokens read so far (and, if the
    engine records them, its experts so far)."""
    return Partial(group.request, it.sample_idx, list(it.tokens),
                   list(it.logp), list(it.logp_raw), it.budget,
                   self.weight_version, prompt_routes=group.prompt_routes,
                   routes=list(it.routes))

  # ------------------------------------------------------------ results
  def _consume(self, event, live):
    if event[0] == "insert":
      _, groups, pre = event
      host = [np.asarray(x) for x in (pre.first_tokens, pre.first_logp,
                                      pre.first_logp_raw)]
      routes = None if pre.routes is None else np.asarray(pre.routes)
      top = None if pre.first_top is None else np.asarray(pre.first_top)
      for b, group in enumerate(groups):
        group.first = tuple(x[b] for x in host)
        group.first_top = None if top is None else top[b]
        if routes is not None:
          # A readmitted group's new prefill replaces its record: every
          # token its members draw from now on attends to this KV.
          group.prompt_routes = routes[b, :group.length]
      batch = {id(g) for g in groups}
      for slot, it in list(live.items()):
        if id(it.group) in batch and not it.tokens:
          yield from self._take_first(slot, it)
      return
    window = event[1].convert_to_numpy(self.engine.top_logprobs)
    base, steps = event[2], event[3]
    self._unread -= steps
    for j in range(steps):
      res, step = window.window(j), base + j + 1
      routes, top = res.routes, res.top
      for s in np.nonzero(res.valid)[0]:
        it = live.get(int(s))
        if it is not None and step > it.started:
          yield from self._append(int(s), live, int(res.tokens[s]),
                                  float(res.logp[s]), float(res.logp_raw[s]),
                                  routes[s] if routes.shape[1] else None,
                                  top[s] if top.shape[1] else None)

  def _routes_of(self, group: Group, it: Slot) -> dict:
    """A finished sample's recorded experts (`Sample.routes`), if the
    engine records them: its prompt's and its fed tokens', [n, L, k]
    int16, -1 where none was recorded."""
    eng = self.engine
    if not eng.record_routes:
      return {}
    shape = (eng.cfg.num_layers, eng.cfg.experts_per_token)
    own = np.full((len(it.tokens) - 1,) + shape, -1, np.int16)
    for j, r in enumerate(it.routes[:len(own)]):
      if r is not None:
        own[j] = np.reshape(r, shape)
    return dict(prompt_routes=np.asarray(group.prompt_routes, np.int16),
                routes=own)

  def _take_first(self, slot, it: Slot):
    toks, logp, raw = it.group.first
    j = it.member
    return list(self._append(slot, self.live, int(toks[j]), float(logp[j]),
                             float(raw[j]), top=it.group.first_top))

  @staticmethod
  def _record(it: Slot, routes) -> None:
    """`routes`: the experts of the sample's last token (just fed). Tokens
    carried over without their records (a continuation) get none (-1: the
    trainer routes them itself)."""
    it.routes.extend([None] * (len(it.tokens) - 1 - len(it.routes)))
    it.routes.append(routes)

  @staticmethod
  def _record_top(it: Slot, top) -> None:
    """`top`: the K likeliest tokens where the sample's next token was
    drawn (`Engine(top_logprobs=K)`); tokens without one get None."""
    it.top.extend([None] * (len(it.tokens) - len(it.top)))
    it.top.append(top)

  def _take(self, it: Slot, token, logp, raw, routes=None, top=None) -> None:
    """A drawn token into the sample's host record (with its experts and
    alternatives, where recorded)."""
    if routes is not None:
      self._record(it, routes)
    if top is not None:
      self._record_top(it, top)
    it.tokens.append(token)
    it.logp.append(logp)
    it.logp_raw.append(raw)
    self.stats.generated_tokens += 1

  def _append(self, slot, live, token, logp, raw, routes=None, top=None):
    """Token `token` of the sample in `slot`; `routes` (recorded): the
    experts the token fed before it went to; `top` (recorded): the K
    likeliest tokens where it was drawn."""
    it = live[slot]
    self._take(it, token, logp, raw, routes, top)
    stop = token in self.engine.sampling.stop_tokens
    if stop or len(it.tokens) >= it.budget:
      del live[slot]
      yield self._finish(slot, it, "stop" if stop else "length")

  def _finish(self, slot: int, it: Slot, reason: str) -> Sample:
    """The sample of `it` (out of `live` already); frees its slot, pages
    and, if it was the last, its group."""
    self.pool.release(it.pages)
    group = it.group
    self._free_slots[group.replica].append(slot)
    group.live -= 1
    self._free_if_empty(group)
    return Sample(group.request.prompt_id, it.sample_idx,
                  np.asarray(group.request.tokens, np.int32), it.tokens,
                  it.logp, it.logp_raw, reason, self.weight_version,
                  seed=group.request.seed, **self._routes_of(group, it))
