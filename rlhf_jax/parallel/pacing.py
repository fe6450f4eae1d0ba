"""How far the host may dispatch device programs ahead of the devices.

Enough in flight keeps an accelerator fed. Unbounded, XLA's CPU client
deadlocks: once a device holds 32 queued computations the next launch
blocks one of the client's threads, and with one thread per (fake) device
a sharded program can then never gather all its devices (a rendezvous abort
after 40 s; seen in CI and in `benchmarks.long_tail`).
"""

from __future__ import annotations

import collections

import jax

MAX_AHEAD = 8  # Programs a `Pacer` lets run ahead of the devices.


class Pacer:
  """Waits for the program `MAX_AHEAD` dispatches back before the host goes
  on, so at most that many of the caller's programs are unfinished."""

  def __init__(self, max_ahead: int = MAX_AHEAD):
    self.max_ahead = max_ahead
    self._ahead: collections.deque = collections.deque()

  def dispatched(self, marker: jax.Array) -> None:
    """`marker`: one output of the program just dispatched (never
    donated later)."""
    self._ahead.append(marker)
    while len(self._ahead) > self.max_ahead:
      self._ahead.popleft().block_until_ready()
