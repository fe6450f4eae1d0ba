"""Multi-turn sampling on the engine, the conversation's KV kept.

`MultiTurnDriver` is a `Driver` whose samples may take several turns.
When a sample draws a stop token (the end of its turn, or the close of a
tool call), `reply(request, sample_idx, tokens, logp)` (the environment;
`logp`: each token's log-prob under the distribution sampled from, 0 at
appended ones) returns
the tokens to append (a tool's output, the next user message, the chat
template's turn markers) or None to end the sample there, or `PARK`: the
answer comes later (an agent in a process of its own), and meanwhile the
sample keeps its slot and pages out of the decode steps while the others
decode. Appended tokens get their KV with `moves.extend`, after the
sample's own pages: nothing before them is prefilled again, and the
group's prompt pages stay shared. Decoding continues after them.

The emitted `Sample` holds every token after the prompt, sampled and
appended, with `env_mask` True at the appended ones (log-probs 0: they
were not sampled); a trainer keeps them out of the loss.

Budget: a sample's token budget counts appended tokens too (its pages hold
both). A reply that leaves no room for one more sampled token ends the
sample at its stop token, finish_reason "length". A reply that finds no
free page preempts the sample (the driver's exhaustion policy): it is
recomputed later from all its tokens, appended ones included, and
continues with the same tokens. Samples keep their turns across the
driver's own moves (preemption, consolidation; the controller's
consolidation waits while a sample is parked); handing them to elastic
workers (`partials`, `cut`) would drop `env_mask` and is refused.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from rlhf_jax.engine.page_pool import PoolExhausted
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine import moves
from rlhf_jax.engine.driver import Driver

# (request, sample index, tokens after the prompt so far, ending with the
# stop token, their log-probs[, with `Engine(top_logprobs=K)` each token's
# K likeliest tokens (`state.top_columns` rows; None at appended ones)])
# -> tokens to append, None (the sample ends), or PARK (the answer comes
# later, from `ready`).
Reply = Callable[..., Sequence[int] | None]  # or PARK

# A reply that is not ready yet (an agent thinking in a process of its
# own): the sample parks, keeping its slot and pages (its KV stays, nothing
# is computed again) but out of the decode steps, which go on for the
# others. A reply that parks also has `ready(timeout)`: the parked samples
# whose answers have come, [((prompt id, sample index), tokens or None)],
# waiting up to `timeout` seconds for one when none has.
PARK = object()

# How long a driver with nothing to decode waits for a parked sample's
# answer before it looks at admission and results again.
_IDLE_WAIT_S = 0.02


class MultiTurnDriver(Driver):
  """A `Driver` whose samples continue after `reply`'s tokens."""

  def __init__(self, engine: Engine, params, *, reply: Reply,
               weight_version: int = 0):
    super().__init__(engine, params, weight_version=weight_version)
    self.reply = reply
    self._appended: dict[tuple[int, int], list[int]] = {}  # token indices
    self._parked_slot: dict[tuple[int, int], int] = {}
    self.turns = 0             # Replies appended, all samples.
    self.appended_tokens = 0   # Their tokens (none prefilled again).
    self.reply_preemptions = 0  # Replies that found no free page.
    self.parkings = 0          # Turn ends that parked their sample.

  def step(self):
    # Nothing to decode or read until a parked sample's answer comes.
    idle = self.parked and not self.live and not self._events
    out = self._unpark(_IDLE_WAIT_S if idle else 0.0)
    return out + super().step()

  def _append(self, slot, live, token, logp, raw, routes=None, top=None):
    it = live[slot]
    extra, length = None, False
    if token in self.engine.sampling.stop_tokens:
      # With recorded alternatives, the reply gets them too (all tokens').
      tops = ((it.top + [None] * (len(it.tokens) - len(it.top)) + [top],)
              if self.engine.top_logprobs else ())
      extra = self.reply(it.request, it.sample_idx, it.tokens + [token],
                         it.logp + [logp], *tops)
      if extra is PARK:
        self._take(it, token, logp, raw, routes, top)
        del live[slot]
        self.parked[slot] = it
        self._parked_slot[it.request.prompt_id, it.sample_idx] = slot
        self.parkings += 1
        return
      extra = None if extra is None else [int(t) for t in extra]
      # The reply and one more sampled token must fit the budget.
      length = bool(extra) and len(it.tokens) + 2 + len(extra) > it.budget
    if extra and not length:
      self._take(it, token, logp, raw, routes, top)
      self._continue(slot, it, extra)
      return
    for sample in super()._append(slot, live, token, logp, raw, routes, top):
      yield self._masked(sample, length)

  def _continue(self, slot: int, it, extra: list[int]) -> None:
    """Appends the reply `extra` after the sample's stop token (on the
    host and, by `_extend`, its KV); decoding goes on after it."""
    start = len(it.tokens)
    it.tokens += extra
    it.logp += [0.0] * len(extra)
    it.logp_raw += [0.0] * len(extra)
    self._appended.setdefault((it.request.prompt_id, it.sample_idx),
                              []).extend(range(start, start + len(extra)))
    self.turns += 1
    self.appended_tokens += len(extra)
    self._extend(slot, it, extra)

  def _masked(self, sample, length: bool):
    """The finished `sample` with its `env_mask` (and "length" if its last
    reply did not fit)."""
    env = set(self._appended.pop(sample.key, ()))
    sample.env_mask = [i in env for i in range(len(sample.tokens))]
    if length:
      sample.finish_reason = "length"
    return sample

  def _unpark(self, timeout: float) -> list:
    """Parked samples whose answers came: back to decoding after their
    reply, or finished (no reply; a reply past the budget)."""
    out = []
    if not self.parked:
      return out
    for key, extra in self.reply.ready(timeout):
      slot = self._parked_slot.pop(key)
      it = self.parked.pop(slot)
      extra = None if extra is None else [int(t) for t in extra]
      # As at once: the reply and one more sampled token must fit (the
      # stop token is in `it.tokens` by now).
      length = bool(extra) and len(it.tokens) + 1 + len(extra) > it.budget
      if extra and not length:
        self.live[slot] = it
        it.started = self.stats.steps  # Earlier steps' results: not its.
        self._continue(slot, it, extra)
      else:
        out.append(self._masked(self._finish(
            slot, it, "length" if length else "stop"), length))
    return out

  def _extend(self, slot: int, it, extra: list[int]) -> None:
    """The reply's KV after the sample's own tokens; pages first."""
    eng: Engine = self.engine
    # Own KV after the append: all tokens but the last (fed next), + the
    # two tokens of headroom `_grow` keeps.
    need = min(self.pool_pages_for(len(it.tokens) + 1), eng.max_own_pages)
    while len(it.pages) < need:
      try:
        it.pages += self.pool.allocate(1, it.group.replica)
      except PoolExhausted:
        self._preempt(slot)  # Recomputed with its reply when restarted.
        self.reply_preemptions += 1
        return
    self.state, routes = moves.extend(eng, self.params, self.state, slot,
                                      it.pages, extra)
    if routes is not None:  # The fed tokens': the stop token, the reply's.
      stop = len(it.tokens) - len(extra) - 1
      it.routes.extend([None] * (stop - len(it.routes)))
      it.routes.extend(np.asarray(routes[:len(extra)]).reshape(
          len(extra), -1))
    if jax.default_backend() == "cpu":
      # XLA:CPU with several (fake) devices deadlocked in an all-gather
      # (one device never arrived) with extends queued behind a decode
      # step; waiting for each is cheap, the reply already waited for
      # the step's tokens (docs/results.md, tool use).
      jax.block_until_ready(self.state)

  def partials(self):
    if self._appended or self.parked:
      raise NotImplementedError(
          "multi-turn samples cannot be handed over yet (a Partial has no "
          "env_mask)")
    return super().partials()

  def cut(self, keys):
    if self._appended or self.parked:
      raise NotImplementedError(
          "multi-turn samples cannot be handed over yet (a Partial has no "
          "env_mask)")
    return super().cut(keys)
