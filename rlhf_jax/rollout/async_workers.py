"""Async RL's rollout on elastic workers (`config.asynchronous` with
`rollout.workers.num > 0`).

`AsyncRollout` drives the workers' `RolloutManager` where it would drive a
paged driver: the manager keeps several batches in flight (`extend`),
keeps samples finished on older weights (their versions are counted, not
re-sampled), and at each switch to new weights cuts every worker's
unfinished samples (`take_unfinished`). Those continue on the new version
as prompt + tokens so far, the path a preempted worker's samples take
(`workers/continuation.py`): the KV policy is "recompute", and sampling
keys do not depend on the worker. The trainer keeps the whole mesh; the
workers run elsewhere (Ray actors) or, in tests, in process.
"""

from __future__ import annotations

import numpy as np

from rlhf_jax.samples import Partial, Request, Sample
from rlhf_jax.workers.manager import RolloutManager


class WorkerBackend:
  """Async decoding on the manager's workers (see the module doc)."""

  def __init__(self, manager: RolloutManager):
    manager.resample_stale = False
    manager.start([])  # Batches join with `extend`.
    self.manager = manager
    self.max_new_tokens = manager.max_new_tokens

  def open(self, params, version: int, partials: list[Partial],
           pending: list[Request], *, common=None) -> "_Run":
    """Publishes `params` (the rollout copy, host or device) as `version`
    (workers pull it before their next request) and queues the partials,
    then the pending prompts."""
    del common  # The workers prefill whole prompts (`common_prefix`).
    self.manager.store.publish(version, params)
    self.manager.extend(pending, heads=partials)
    return _Run(self.manager)

  def common_prefix(self, requests, current) -> np.ndarray:
    """None stored: async RL on workers prefills whole prompts
    (`config/compose.py` refuses `rollout.max_common_length` there)."""
    del requests, current
    return np.zeros(0, np.int32)

  @staticmethod
  def stored_prefix(run: "_Run") -> int:
    del run
    return 0

  def drain(self, run: "_Run") -> list[Sample]:
    del run  # Every poll round's results are read as it ends.
    return []

  def unfinished(self, run: "_Run") -> tuple[list[Partial], list[Request]]:
    del run
    return self.manager.take_unfinished()


class _Run:
  """One weight version's decoding: what `AsyncRollout` steps."""

  def __init__(self, manager: RolloutManager):
    self.manager = manager

  def add(self, requests: list[Request]) -> None:
    self.manager.extend(requests)

  @property
  def busy(self) -> bool:
    return self.manager.unfinished > 0

  def step(self) -> list[Sample]:
    """One poll round of every worker; the samples that finished."""
    finished = self.manager.step()
    self.manager.forget(finished)
    return finished
