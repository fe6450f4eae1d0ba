"""Continuous batching over the engine, streaming finished samples.

JetStream-orchestrator style, in one thread: admit prompts into free rows as
soon as they free up (prefill once, bulk_insert G slots), dispatch one
`generate` per step, start the async device->host copy of its packed result,
and read the previous step's result only after the next step is dispatched,
so the host never stalls the device. Finished samples are yielded as soon as
they complete (scoring can start while others still decode).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Iterable, Iterator

import numpy as np

from rlhf_jax.engine.engine import Engine


@dataclasses.dataclass(frozen=True)
class Request:
  """A prompt to sample `num_samples` responses for."""
  prompt_id: int
  tokens: np.ndarray
  num_samples: int = 1
  seed: int = 0
  first_sample_index: int = 0  # Sample indices are first..first+num-1.


@dataclasses.dataclass
class Sample:
  """One finished response, addressable by (prompt_id, sample_idx)."""
  prompt_id: int
  sample_idx: int
  prompt_tokens: np.ndarray
  tokens: list[int]
  logp: list[float]        # under the distribution sampled from
  logp_raw: list[float]    # temperature-1 policy log-prob
  finish_reason: str       # "stop" or "length"
  weight_version: int

  @property
  def key(self):
    return self.prompt_id, self.sample_idx


@dataclasses.dataclass
class _Live:
  request: Request
  sample_idx: int
  tokens: list
  logp: list
  logp_raw: list


@dataclasses.dataclass
class DriverStats:
  steps: int = 0
  prefills: int = 0
  generated_tokens: int = 0
  decode_s: float = 0.0


class Driver:
  """Streams samples for a stream of requests through one Engine."""

  def __init__(self, engine: Engine, params, *, weight_version: int = 0):
    self.engine = engine
    self.params = params
    self.weight_version = weight_version
    self.stats = DriverStats()

  def run(self, requests: Iterable[Request]) -> Iterator[Sample]:
    eng = self.engine
    pending = collections.deque(requests)
    for req in pending:  # Reject bad input before any work starts.
      eng.pad_prompt(req.tokens, req.prompt_id)
      if not 1 <= req.num_samples <= eng.samples_per_row:
        raise ValueError(
            f"prompt {req.prompt_id} asks for num_samples={req.num_samples}; "
            f"the engine holds 1..{eng.samples_per_row} samples per prompt")
    state = eng.init_decode_state()
    live: dict[int, _Live] = {}
    events = collections.deque()  # ("insert", slots, prefix) | ("step", res)
    t0 = time.perf_counter()

    while pending or live or events:
      free = eng.free_rows()
      while pending and free:
        req = pending.popleft()
        row = free.pop(0)
        padded, true_len = eng.pad_prompt(req.tokens, req.prompt_id)
        prefix = eng.prefill_multisampling(
            self.params, padded, true_len, req.num_samples,
            prompt_id=req.prompt_id, seed=req.seed,
            first_sample_index=req.first_sample_index)
        slots = eng.slots_of_row[row][:req.num_samples]
        state = eng.bulk_insert(prefix, state, slots)
        for s, i in zip(slots, prefix.sample_indices):
          live[s] = _Live(req, i, [], [], [])
        for x in (prefix.first_tokens, prefix.first_logp,
                  prefix.first_logp_raw):
          x.copy_to_host_async()
        events.append(("insert", slots, prefix))
        self.stats.prefills += 1
      if live:
        state, result = eng.generate(self.params, state)
        result.copy_to_host_async()
        events.append(("step", result))
        self.stats.steps += 1
      # Read everything but the newest step: it is still in flight.
      while events and (len(events) > 1 or not live or
                        events[0][0] == "insert"):
        yield from self._consume(events.popleft(), live)
    self.stats.decode_s += time.perf_counter() - t0

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
    res = event[1].convert_to_numpy()
    for s in np.nonzero(res.valid)[0]:
      if int(s) in live:
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
    if stop or len(item.tokens) >= sp.max_new_tokens:
      del live[slot]
      self.engine.free_resource(slot)
      yield Sample(item.request.prompt_id, item.sample_idx,
                   np.asarray(item.request.tokens, np.int32), item.tokens,
                   item.logp, item.logp_raw, "stop" if stop else "length",
                   self.weight_version)
