"""Continuous batching over the engine, streaming finished samples.

JetStream-orchestrator style, in one thread: admit prompts into free rows as
soon as they free up (prefill once, bulk_insert G slots), dispatch one
`generate` per step, start the async device->host copy of its packed result,
and read the previous step's result only after the next step is dispatched,
so the host never stalls the device. Finished samples are yielded as soon as
they complete (scoring can start while others still decode).

`run(requests, common_prefix=...)` adds two-level sharing: a token prefix
common to all requests (declared, or detected with "auto") is prefilled once
and stored once; each request's row then holds only its tokens after it.
Samples are the same as without it (same keys, same positions).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Iterable, Iterator, Sequence

import numpy as np

from rlhf_jax.engine import common_prefix as common_lib
from rlhf_jax.engine.engine import Engine
from rlhf_jax.samples import Partial, Request, Sample


@dataclasses.dataclass
class _Live:
  request: Request
  sample_idx: int
  tokens: list
  logp: list
  logp_raw: list
  budget: int
  # Decode steps dispatched before the sample entered its slot: results of
  # those steps for this slot belong to its previous occupant (a sample the
  # host ended on its budget while the device kept stepping it).
  since_step: int = 0


@dataclasses.dataclass
class DriverStats:
  steps: int = 0
  prefills: int = 0
  prefill_tokens: int = 0       # Padded tokens run through prefill.
  common_prefix_length: int = 0  # Of the last run (0: none).
  generated_tokens: int = 0
  decode_s: float = 0.0


def most_free_replica(pool, replicas) -> int:
  """The replica among `replicas` with the most free pages (lowest first
  on ties)."""
  return max(replicas, key=lambda r: (pool.free_in(r), -r))


class Controller:
  """Scheduling hooks of `Driver.run` (defaults: plain continuous batching).

  `window`: the most decode steps one paged engine call may run before
  these hooks run again (None: the engine's `decode_window`).
  """

  window: int | None = None

  def __init__(self, window: int | None = None):
    self.window = window

  def choose_row(self, driver: "Driver", free_rows: list[int],
                 request: Request) -> int:
    """The free row `request` goes to."""
    del driver, request
    return free_rows[0]

  def admit(self, driver: "Driver", free_rows: list[int]
            ) -> tuple[int, int] | None:
    """The next admission: (index into `driver.pending`, the free row it
    goes to), or None to admit nothing more now (default: the first
    pending request, into `choose_row`'s row)."""
    return 0, self.choose_row(driver, free_rows, driver.pending[0])

  def pick(self, driver, room_for) -> tuple[int, int] | None:
    """The paged engine's next admission: (index into `driver.pending`,
    the replica its group goes to), or None to admit nothing more now.
    `room_for(request)` lists the replicas with room for it. Default: the
    first pending request, onto `choose_replica`'s replica."""
    request = driver.pending[0]
    room = room_for(request)
    return (0, self.choose_replica(driver, room, request)) if room else None

  def choose_replica(self, driver, replicas: list[int],
                     request: Request) -> int:
    """The data replica of the paged engine `request`'s group goes to,
    among those with room (default: the one with the most free pages)."""
    del request
    return most_free_replica(driver.pool, replicas)

  def after_step(self, driver: "Driver") -> None:
    """Called after each decode call is dispatched."""

  def decode_window(self, driver: "Driver") -> int:
    """The most decode steps the paged driver may run in one call."""
    return self.window or driver.engine.decode_window

  def wants_switch(self, driver: "Driver") -> bool:
    """Whether to move the live samples onto another engine now."""
    del driver
    return False

  def switch(self, driver: "Driver") -> None:
    """Replaces driver.engine / params / state / live (slot keys)."""


class Driver:
  """Streams samples for a stream of requests through one Engine.

  During `run`, `engine`, `params`, `state` (the decode state), `live`
  (slot -> in-flight sample) and `pending` (requests not yet admitted) are
  the run's state; a `Controller` may read them and, in `switch`, replace
  them (the samples continue on the new engine).
  """

  def __init__(self, engine: Engine, params, *, weight_version: int = 0):
    self.engine = engine
    self.params = params
    self.weight_version = weight_version
    self.stats = DriverStats()
    self._controller = None

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
        stored once for all rows (`Engine.set_common_prefix`).
      min_common_length: threshold of "auto".
      admission: "continuous" (a prompt enters any row as soon as it frees)
        or "static" (a new wave of prompts enters only once every row is
        free: the synchronous batching of most RL frameworks).
      controller: optional scheduling hooks (`Controller`): the row a
        prompt goes to, and a switch of engine between decode steps
        (long-tail consolidation, `long_tail.py`).

    Yields:
      `Sample`s; `prompt_tokens` is the whole request prompt.
    """
    self.start(requests, common_prefix=common_prefix,
               min_common_length=min_common_length, admission=admission,
               controller=controller)
    while self.busy:
      yield from self.step()

  # ------------------------------------------------- step-by-step control
  def start(self, requests: Iterable[Request] = (), *,
            common_prefix: str | Sequence[int] | np.ndarray | None = None,
            min_common_length: int = 16, admission: str = "continuous",
            controller: "Controller | None" = None) -> None:
    """Begins a run (arguments as `run`); drive it with `step()`."""
    if admission not in ("continuous", "static"):
      raise ValueError(f"admission must be 'continuous' or 'static', got "
                       f"{admission!r}")
    pending, common = self._open(requests, common_prefix, min_common_length)
    self.live: dict[int, _Live] = {}
    self.pending = pending
    self._common, self._admission = common, admission
    self._controller = controller
    self._events = collections.deque()  # ("insert", slots, prefix) |
                                        # ("step", res, n)

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
    """The scheduling hooks of the run under way (None: plain)."""
    return self._controller

  @property
  def busy(self) -> bool:
    """Requests pending, samples decoding, or results not yet read."""
    return bool(self.pending or self.live or self._events)

  def step(self) -> list[Sample]:
    """One iteration: admit into free rows, one decode step, read results.

    Returns the samples that finished (results are read one step late: the
    host never waits for the step it just dispatched).
    """
    t0 = time.perf_counter()
    eng, ctl, events = self.engine, self._controller, self._events
    free = eng.free_rows()
    if self._admission == "static" and self.live:
      free = []
    while self.pending and free:
      pick = ctl.admit(self, free) if ctl else (0, free[0])
      if pick is None:
        break
      i, row = pick
      req = self.pending[i]
      del self.pending[i]
      free.remove(row)
      self._admit(req, row, self._common, events)
    if self.live:
      self.state, result = eng.generate(self.params, self.state)
      result.copy_to_host_async()
      self.stats.steps += 1
      events.append(("step", result, self.stats.steps))
      if ctl is not None:
        ctl.after_step(self)
    out: list[Sample] = []
    # Read everything but the newest step: it is still in flight.
    while events and (len(events) > 1 or not self.live or
                      events[0][0] == "insert"):
      out.extend(self._consume(events.popleft(), self.live))
    if ctl is not None and self.live and ctl.wants_switch(self):
      while events:  # The switch needs every slot's host state current.
        out.extend(self._consume(events.popleft(), self.live))
      if self.live:
        ctl.switch(self)
    self.stats.decode_s += time.perf_counter() - t0
    return out

  def partials(self) -> list[Partial]:
    """The samples still decoding, with the tokens the host has read.

    What a preempted worker hands back: each continues elsewhere as its
    prompt + these tokens (`workers/continuation.py`).
    """
    return [self._partial(it) for _, it in sorted(self.live.items())]

  def evict(self, row: int) -> list[Partial]:
    """Cuts `row`'s samples out of the run; returns them as `Partial`s.

    For handing running samples to another worker (load balancing): they
    continue there as prompt + tokens so far. The row frees at once (the
    next admission may reuse it). Nothing of the cut samples is emitted
    later: the step in flight still carries a token for their slots, but
    `_consume` reads only slots in `live`, and a new occupant of the row
    reads only steps dispatched after it entered (`since_step`). That
    in-flight token is not in the Partials: the continuation samples it
    again with the same key at the same position (the same token). On the
    device the slots keep stepping until the row is refilled, as for a
    sample the host ended on its budget (static shapes: no extra cost).
    """
    if any(e[0] == "insert" and e[1][0] // self.engine.samples_per_row == row
           for e in self._events):  # `step()` always reads its inserts.
      raise RuntimeError(f"row {row}: its first tokens are not read yet")
    slots = [s for s in self.engine.slots_of_row[row] if s in self.live]
    out = [self._partial(self.live.pop(s)) for s in slots]
    for s in slots:
      self.engine.free_resource(s)
    return out

  def _partial(self, it: _Live) -> Partial:
    return Partial(it.request, it.sample_idx, list(it.tokens), list(it.logp),
                   list(it.logp_raw), it.budget, self.weight_version)

  def _validate(self, req: Request, common: np.ndarray) -> None:
    eng = self.engine
    own = common_lib.strip_common_prefix(req.tokens, common, req.prompt_id)
    if common.size and own.size > eng.max_prefill_length:
      raise ValueError(
          f"prompt {req.prompt_id} has {own.size} tokens after the common "
          f"prefix of {common.size}, longer than the largest prefill "
          f"bucket {eng.max_prefill_length}")
    eng.pad_prompt(own, req.prompt_id)
    if not 1 <= req.num_samples <= eng.samples_per_row:
      raise ValueError(
          f"prompt {req.prompt_id} asks for num_samples={req.num_samples}; "
          f"the engine holds 1..{eng.samples_per_row} samples per prompt")
    budgets = req.max_new_tokens_per_sample
    if budgets is not None and (len(budgets) != req.num_samples or
                                min(budgets) < 1):
      raise ValueError(
          f"prompt {req.prompt_id}: max_new_tokens_per_sample must hold "
          f"{req.num_samples} budgets >= 1, got {budgets}")

  def _admit(self, req: Request, row: int, common: np.ndarray,
             events) -> None:
    """Prefills `req` once and inserts its samples into `row`."""
    eng = self.engine
    padded, true_len = eng.pad_prompt(
        np.asarray(req.tokens)[common.size:], req.prompt_id)
    prefix = eng.prefill_multisampling(
        self.params, padded, true_len, req.num_samples,
        prompt_id=req.prompt_id, seed=req.seed,
        first_sample_index=req.first_sample_index)
    slots = eng.slots_of_row[row][:req.num_samples]
    self.state = eng.bulk_insert(prefix, self.state, slots)
    max_new = eng.sampling.max_new_tokens
    for j, (s, i) in enumerate(zip(slots, prefix.sample_indices)):
      self.live[s] = _Live(req, i, [], [], [], req.budget(j, max_new),
                           self.stats.steps)
    for x in (prefix.first_tokens, prefix.first_logp, prefix.first_logp_raw):
      x.copy_to_host_async()
    events.append(("insert", slots, prefix))
    self.stats.prefills += 1
    self.stats.prefill_tokens += padded.size

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

  def _consume(self, event, live) -> Iterator[Sample]:
    if event[0] == "insert":
      _, slots, prefix = event
      toks = np.asarray(prefix.first_tokens)
      logp = np.asarray(prefix.first_logp)
      raw = np.asarray(prefix.first_logp_raw)
      for j, s in enumerate(slots):
        yield from self._append(s, live, int(toks[j]), float(logp[j]),
                                float(raw[j]), first=True)
      return
    res, step = event[1].convert_to_numpy(), event[2]
    for s in np.nonzero(res.valid)[0]:
      if int(s) in live and step > live[int(s)].since_step:
        yield from self._append(int(s), live, int(res.tokens[s]),
                                float(res.logp[s]), float(res.logp_raw[s]))

  def _append(self, slot, live, token, logp, raw, first=False):
    item = live[slot]
    item.tokens.append(token)
    item.logp.append(logp)
    item.logp_raw.append(raw)
    self.stats.generated_tokens += 1
    sp = self.engine.sampling
    stop = token in sp.stop_tokens
    if stop or len(item.tokens) >= item.budget:
      del live[slot]
      self.engine.free_resource(slot)
      yield Sample(item.request.prompt_id, item.sample_idx,
                   np.asarray(item.request.tokens, np.int32), item.tokens,
                   item.logp, item.logp_raw, "stop" if stop else "length",
                   self.weight_version, seed=item.request.seed)
