"""Host-side bookkeeping of the KV page pool: free list and reference counts.

The device holds the pages ([L, num_pages, T, N, K], `paged.PagedState`);
this object decides which page ids are free. The sharing tree of a batch is
common prefix -> prompt (group) -> sample: the common prefix is one dense
copy for every group (`PagedEngine`), a group's prompt pages are referenced
once by the group and read by all its samples, and a sample's own pages by
the sample. A page returns to the free list when its last reference goes.
Allocation is all-or-nothing: a caller that cannot get every page it asked
for gets none, and decides (wait, or preempt someone: `PagedDriver`).
"""

from __future__ import annotations

import math

import numpy as np


class PoolExhausted(Exception):
  """Fewer free pages than asked for (nothing was allocated)."""


class PagePool:
  """Free list + reference counts over page ids [0, num_pages)."""

  def __init__(self, num_pages: int, page_size: int):
    if num_pages < 1 or page_size < 1:
      raise ValueError(f"a page pool needs num_pages >= 1 and page_size >= 1, "
                       f"got {num_pages} and {page_size}")
    self.num_pages, self.page_size = int(num_pages), int(page_size)
    self._refs = np.zeros(self.num_pages, np.int32)
    # Lowest ids first (deterministic placement, easier to read in tests).
    self._free = list(range(self.num_pages - 1, -1, -1))
    self.peak_used = 0

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_used(self) -> int:
    return self.num_pages - len(self._free)

  def pages_for(self, tokens: int) -> int:
    """Pages that hold `tokens` tokens."""
    return math.ceil(max(int(tokens), 0) / self.page_size)

  def allocate(self, n: int) -> list[int]:
    """`n` fresh pages (reference count 1), or `PoolExhausted`."""
    if n > len(self._free):
      raise PoolExhausted(f"{n} pages asked, {len(self._free)} free of "
                          f"{self.num_pages}")
    pages = [self._free.pop() for _ in range(n)]
    self._refs[pages] = 1
    self.peak_used = max(self.peak_used, self.num_used)
    return pages

  def retain(self, pages) -> None:
    """One more reference to each of `pages` (a sharer)."""
    pages = list(pages)
    if pages and (self._refs[pages] < 1).any():
      raise ValueError(f"retain of free pages {pages}")
    np.add.at(self._refs, pages, 1)

  def release(self, pages) -> None:
    """Drops one reference to each page; pages left with none are free."""
    pages = list(pages)
    if pages and (self._refs[pages] < 1).any():
      raise ValueError(f"release of free pages {pages}")
    np.add.at(self._refs, pages, -1)
    # Freed pages go to the front of the reuse order (LIFO keeps the live
    # set compact in low ids).
    self._free.extend(p for p in dict.fromkeys(reversed(pages))
                      if self._refs[p] == 0)

  def refcount(self, page: int) -> int:
    return int(self._refs[page])
