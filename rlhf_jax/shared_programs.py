"""Equal objects share their jitted programs.

An `Engine` or a `Learner` holds `jax.jit` functions bound to itself, so a
second one built with the same arguments would trace and lower every
program again (the persistent compilation cache only saves the compile):
a job's engines rebuilt, the learners of jobs built in one process, tests.
Their programs depend on nothing but those arguments, so

  PROGRAMS = SharedPrograms(("_step_jit", "trace_counts"))
  ...
  PROGRAMS.adopt(self, key)   # at the end of __init__

gives an object the jitted functions (and trace counts) of a live object
whose `key` (its construction arguments) is equal. Only live objects are
remembered: nothing is kept alive for later.
"""

from __future__ import annotations

import weakref
from typing import Hashable, Sequence


class SharedPrograms:
  """Live objects by key, and the attributes equal ones share."""

  def __init__(self, names: Sequence[str]):
    self.names = tuple(names)
    self._live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

  def adopt(self, obj, key: Hashable) -> bool:
    """Gives `obj` the shared attributes of a live object of equal `key`
    (True), or remembers `obj` as the one for `key` (False)."""
    first = self._live.get(key)
    if first is None:
      self._live[key] = obj
      return False
    for name in self.names:
      setattr(obj, name, getattr(first, name))
    return True
