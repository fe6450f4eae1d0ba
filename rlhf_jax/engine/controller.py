"""Scheduling hooks of a driver's run (`driver.Driver.run(controller=)`).

The driver executes; a controller decides where a prompt's group goes,
how many decode steps one call may run, and when the run moves to another
engine (`long_tail.TailController`). The defaults are plain continuous
batching.
"""

from __future__ import annotations

from rlhf_jax.samples import Request


def most_free_replica(pool, replicas) -> int:
  """The replica among `replicas` with the most free pages (lowest first
  on ties)."""
  return max(replicas, key=lambda r: (pool.free_in(r), -r))


class Controller:
  """Scheduling hooks of `Driver.run` (defaults: plain continuous batching).

  `window`: the most decode steps one engine call may run before these
  hooks run again (None: the engine's `decode_window`).
  """

  window: int | None = None

  def __init__(self, window: int | None = None):
    self.window = window

  def pick(self, driver, room_for) -> tuple[int, int] | None:
    """The next admission: (index into `driver.pending`, the replica its
    group goes to), or None to admit nothing more now.
    `room_for(request)` lists the replicas with room for it. Default: the
    first pending request, onto `choose_replica`'s replica."""
    request = driver.pending[0]
    room = room_for(request)
    return (0, self.choose_replica(driver, room, request)) if room else None

  def choose_replica(self, driver, replicas: list[int],
                     request: Request) -> int:
    """The data replica `request`'s group goes to, among those with room
    (default: the one with the most free pages)."""
    del request
    return most_free_replica(driver.pool, replicas)

  def after_step(self, driver: "Driver") -> None:
    """Called after each decode call is dispatched."""

  def decode_window(self, driver: "Driver") -> int:
    """The most decode steps the driver may run in one call."""
    return self.window or driver.engine.decode_window

  def wants_switch(self, driver: "Driver") -> bool:
    """Whether to move the live samples onto another engine now."""
    del driver
    return False

  def switch(self, driver: "Driver") -> None:
    """Replaces driver.engine / params / state / live (slot keys)."""
