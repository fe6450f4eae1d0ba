"""Stop a run at a step boundary and continue it on a new driver.

  finished = drain(driver)                 # read every result in flight
  partials, pending = unfinished(driver)   # host state: nothing on device
  new = engines.driver(new_params, version)
  new.start(pending)
  readmit(new, partials)                   # ahead of the pending prompts

What async RL does when the rollout takes new weights
(`rollout/asynchronous.py`), and what a resumed run does with the
partials its checkpoint holds: the two are the same code from the same
host state, so a resumed run continues exactly as the uninterrupted one.
Each partial group's prompt is prefilled once more, with the new weights,
for its unfinished samples (the prompt still stored once for them), and
their tokens so far are recomputed (`moves.recompute`): the KV policy
at a weight change is "recompute", never a cache mixing two versions.
"""

from __future__ import annotations

import collections

from rlhf_jax.samples import Partial, Request, Sample
from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.groups import Group, Waiting


def drain(driver: Driver) -> list[Sample]:
  """Reads every result in flight (the host then holds each sample's
  tokens); returns the samples that finished."""
  out: list[Sample] = []
  while driver._events:  # pylint: disable=protected-access
    out.extend(driver._consume(  # pylint: disable=protected-access
        driver._events.popleft(), driver.live))  # pylint: disable=protected-access
  return out


def unfinished(driver: Driver) -> tuple[list[Partial], list[Request]]:
  """(every admitted unfinished sample, live or waiting, also those of
  groups queued for admission again, in (prompt, seed, sample) order;
  the requests not admitted yet, in order). Call after `drain`."""
  partials = driver.partials()
  for g in driver._readmit:  # pylint: disable=protected-access
    partials += [Partial(g.request, w.sample_idx, list(w.tokens),
                         list(w.logp), list(w.logp_raw), w.budget,
                         driver.weight_version,
                         prompt_routes=g.prompt_routes,
                         routes=list(w.routes)) for w in g.waiting]
  partials.sort(key=lambda p: (p.request.prompt_id, p.request.seed,
                               p.sample_idx))
  return partials, list(driver.pending)


def readmit(driver: Driver, partials: list[Partial]) -> None:
  """Queues the partials of a started `driver`'s run for admission ahead
  of its pending prompts, one group per request (the order given). A
  sample holding only its first token starts over: that token came from
  the old prefill, and the new one draws the member's first token again."""
  groups: dict[tuple[int, int], list[Partial]] = {}
  for p in partials:
    groups.setdefault((p.request.prompt_id, p.request.seed), []).append(p)
  for ps in groups.values():
    req = ps[0].request
    driver._order += 1  # pylint: disable=protected-access
    own = len(req.tokens) - driver._common.size  # pylint: disable=protected-access
    driver._readmit.append(Group(  # pylint: disable=protected-access
        req, -1, own, [], collections.deque(
            Waiting(p.sample_idx - req.first_sample_index, p.sample_idx,
                     p.budget, *_kept(p)) for p in ps),
        order=driver._order))  # pylint: disable=protected-access


def _kept(p: Partial) -> tuple[list, list, list, list]:
  """The partial's (tokens, logp, logp_raw, routes) to continue from."""
  if len(p.tokens) == 1:
    return [], [], [], []
  return (list(p.tokens), list(p.logp), list(p.logp_raw),
          list(p.routes or []))
