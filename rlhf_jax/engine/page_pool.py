"""Host-side bookkeeping of the KV page pool: free list and reference counts.

The device holds the pages ([L, N, num_pages, T, K], `state.DecodeState`);
this object decides which page ids are free. With data replicas the pool
is split into one equal block of ids per replica (replica r owns ids
[r * per_replica, (r + 1) * per_replica), the block its devices hold), and
every allocation names the replica it is for. The sharing tree of a batch is
common prefix -> prompt (group) -> sample: the common prefix is one dense
copy for every group (`Engine`), a group's prompt pages are referenced
once by the group and read by all its samples, and a sample's own pages by
the sample. A page returns to the free list when its last reference goes.
Allocation is all-or-nothing: a caller that cannot get every page it asked
for gets none, and decides (wait, or preempt someone: `Driver`).
"""

from __future__ import annotations

import math

import numpy as np


class PoolExhausted(Exception):
  """Fewer free pages than asked for (nothing was allocated)."""


class PagePool:
  """Free lists (one per replica) + reference counts over page ids
  [0, num_pages)."""

  def __init__(self, num_pages: int, page_size: int, replicas: int = 1):
    if num_pages < 1 or page_size < 1 or replicas < 1 or num_pages % replicas:
      raise ValueError(
          f"a page pool needs num_pages >= 1, page_size >= 1 and num_pages a "
          f"multiple of replicas, got {num_pages}, {page_size}, {replicas}")
    self.num_pages, self.page_size = int(num_pages), int(page_size)
    self.per_replica = self.num_pages // replicas
    self._refs = np.zeros(self.num_pages, np.int32)
    # Lowest ids first (deterministic placement, easier to read in tests).
    self._free = [list(range((r + 1) * self.per_replica - 1,
                             r * self.per_replica - 1, -1))
                  for r in range(replicas)]
    self.peak_used = 0

  @property
  def num_free(self) -> int:
    return sum(map(len, self._free))

  @property
  def num_used(self) -> int:
    return self.num_pages - self.num_free

  def first(self, replicas: int) -> "PagePool":
    """The pool of the first `replicas` replicas (same ids and counts):
    what remains when the rest are given up."""
    out = PagePool(replicas * self.per_replica, self.page_size, replicas)
    out._refs = self._refs[:out.num_pages].copy()
    out._free = [list(f) for f in self._free[:replicas]]
    out.peak_used = out.num_used
    return out

  def free_in(self, replica: int) -> int:
    """Free pages of one replica."""
    return len(self._free[replica])

  def pages_for(self, tokens: int) -> int:
    """Pages that hold `tokens` tokens."""
    return math.ceil(max(int(tokens), 0) / self.page_size)

  def allocate(self, n: int, replica: int = 0) -> list[int]:
    """`n` fresh pages of `replica` (reference count 1), or
    `PoolExhausted`."""
    free = self._free[replica]
    if n > len(free):
      raise PoolExhausted(f"{n} pages asked, {len(free)} free of "
                          f"{self.per_replica} (replica {replica})")
    pages = [free.pop() for _ in range(n)]
    self._refs[pages] = 1
    self.peak_used = max(self.peak_used, self.num_used)
    return pages

  def release(self, pages) -> None:
    """Drops one reference to each page; pages left with none are free."""
    pages = list(pages)
    if pages and (self._refs[pages] < 1).any():
      raise ValueError(f"release of free pages {pages}")
    np.add.at(self._refs, pages, -1)
    # Freed pages go to the front of the reuse order (LIFO keeps the live
    # set compact in low ids).
    for p in dict.fromkeys(reversed(pages)):
      if self._refs[p] == 0:
        self._free[p // self.per_replica].append(p)
