"""What the driver tracks on the host during a run: the admitted groups
(one prompt each: its entry, prompt pages and replica), their samples
waiting for a slot, the samples in slots, and the run's counts. The device
holds the same in `state.DecodeState`; `driver.Driver` keeps the two in
step.
"""

from __future__ import annotations

import collections
import dataclasses

from rlhf_jax.samples import Request


@dataclasses.dataclass
class DriverStats:
  steps: int = 0
  prefills: int = 0
  prefill_tokens: int = 0       # Padded tokens run through prefill.
  common_prefix_length: int = 0  # Of the last run (0: none).
  generated_tokens: int = 0


def member_samples(req: Request) -> list[int]:
  """Sample index of each member of a request's group: first tokens are
  drawn and kept per member (also for a group admitted again, whose
  waiting samples are a reordered subset)."""
  return list(range(req.first_sample_index,
                    req.first_sample_index + req.num_samples))


@dataclasses.dataclass
class Waiting:
  """A sample of an admitted group without a slot (new, or preempted)."""
  member: int
  sample_idx: int
  budget: int
  tokens: list = dataclasses.field(default_factory=list)
  logp: list = dataclasses.field(default_factory=list)
  logp_raw: list = dataclasses.field(default_factory=list)
  routes: list = dataclasses.field(default_factory=list)  # See Slot.
  top: list = dataclasses.field(default_factory=list)     # See Slot.


@dataclasses.dataclass
class Group:
  request: Request
  entry: int
  length: int                      # prompt tokens after the common prefix
  pages: list[int]
  waiting: collections.deque
  replica: int = 0
  order: int = 0                   # admission order
  live: int = 0
  first: tuple | None = None       # host copies of (tokens, logp, raw) [G]
  # Engine(record_routes=True): the experts of each prompt token [P, L, k].
  prompt_routes: object = None
  # Engine(top_logprobs=K): the first tokens' top K, `state.top_columns`.
  first_top: object = None


@dataclasses.dataclass
class Slot:
  group: Group
  member: int
  sample_idx: int
  budget: int
  pages: list[int]
  started: int                     # decode steps dispatched before start
  order: int                       # start order (preemption picks newest)
  tokens: list = dataclasses.field(default_factory=list)
  logp: list = dataclasses.field(default_factory=list)
  logp_raw: list = dataclasses.field(default_factory=list)
  # Engine(record_routes=True): route j [L, k] is token j's, recorded when
  # it was fed (the last token is never fed).
  routes: list = dataclasses.field(default_factory=list)
  # Engine(top_logprobs=K): token j's K likeliest tokens
  # (`state.top_columns`, [2K]); None at appended (not drawn) tokens.
  top: list = dataclasses.field(default_factory=list)

  @property
  def request(self) -> Request:
    return self.group.request


@dataclasses.dataclass
class PagedStats:
  preemptions: int = 0
  recomputed_tokens: int = 0
  peak_pages: int = 0
  peak_live: int = 0
  peak_kv_tokens: int = 0    # Tokens with KV in the pool (prompts once).
  groups_by_replica: list = dataclasses.field(default_factory=list)
  moved_samples: int = 0     # Left a dropped replica (`consolidate`).
