"""Long-tail policies: RLHFuse global tail consolidation, RLHFless local cut.

RLHFuse: once the unfinished fraction of the batch drops below R_t, keep the
m instances with the most remaining work, move the other instances' samples
(with their KV cache) onto them, and free the rest for inference. m is the
smallest count whose decode batch capacity holds every unfinished sample at
the batching plateau and whose KV memory holds their caches.

RLHFless: each actor cuts locally, once, when the fraction of its own samples
that finished reaches tau; its unfinished samples move to actors that still
have free slots, and the actor is released.

Row-level rules of our engine (`engine/long_tail.py` executes them, the row
simulator `sim/rows.py` replays them): the replicas of the rollout layout
hold rows of G samples; admission puts a prompt into the free row of the
least-loaded replica, and consolidation moves the live rows onto the
smallest power-of-two prefix block of replicas that holds them. With
RLHFless's assignment instead, each replica decodes its own run of
similar predicted lengths (`grouped_admission`) and the block shrinks by
one replica as the last one finishes or cuts (`release_due`). The cluster
simulator (`sim/step.py`) models instances instead of rows and uses
`should_consolidate` once per step with `consolidation_survivors`.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class InstanceLoad:
  """What a tail policy may know about one instance."""

  iid: str
  unfinished: int
  kv_tokens: float
  free_slots: int
  assigned: int = 0
  finished: int = 0


def should_consolidate(unfinished: int, total: int, r_t: float) -> bool:
  """RLHFuse trigger: the unfinished fraction fell below R_t."""
  return total > 0 and unfinished > 0 and unfinished / total < r_t


# ------------------------------------------------------ rows of our engine
def block_sizes(replicas: int) -> list[int]:
  """Replica counts a consolidation may shrink to: the power-of-two
  divisors of `replicas` (prefix blocks of the rollout layout)."""
  return [m for m in (2 ** k for k in range(replicas.bit_length()))
          if replicas % m == 0]


def least_loaded_row(free_rows: Sequence[int], replica_load: Sequence[float],
                     rows_per_replica: int) -> int:
  """The free row on the replica with the least predicted work admitted
  so far (ties: the lowest row). Admission adds the prompt's predicted
  tokens (`predicted length * samples`) to its replica's load."""
  return min(free_rows, key=lambda r: (replica_load[r // rows_per_replica], r))


def no_gain_rows(replicas: int, rows_per_replica: int) -> int:
  """The initial live-row threshold of `consolidation_due` (no bound)."""
  return replicas * rows_per_replica + 1


def consolidation_due(unfinished: int, total: int, r_t: float, *,
                      pending: bool, replicas: int, live_rows: int,
                      no_gain: int) -> bool:
  """Row-level RLHFuse trigger of our engine.

  `should_consolidate`, once every request is admitted (`pending` False),
  on more than one replica, and while the live rows are fewer than
  `no_gain` (the live-row count at which the last attempt found no smaller
  block; `no_gain_rows` at first).
  """
  return (r_t > 0 and not pending and replicas > 1 and live_rows < no_gain
          and should_consolidate(unfinished, total, r_t))


SCORING_IN_FLIGHT = 2  # Chunks queued on the freed replicas at most.


def scoring_chunk(buffered: int, chunk: int, shards: int, *, fusion: bool,
                  freed: bool, decoded: bool, in_flight: int = 0) -> int:
  """Finished samples to hand to the scoring passes now (0: wait).

  RLHFuse's inter-stage fusion: finished samples wait while every replica
  decodes; once consolidation has freed replicas (`freed`), a chunk of
  `chunk` samples goes to them as soon as it fills, with at most
  `SCORING_IN_FLIGHT` chunks queued there (`in_flight`): a deeper queue
  would outlast the tail and keep the decode replicas waiting at the end.
  When nothing is queued there, the freed replicas would idle, so what is
  buffered goes at once. Once the decode is over (`decoded`) every sample
  left goes, in chunks, on every replica. A chunk is rounded up to a
  size of `chunk_rows` so it fills the rows it is padded to; a partial one
  is padded (`scoring/passes.py`). Without fusion only `decoded`
  releases samples.
  """
  size = chunk_rows(chunk, shards)
  if decoded:
    return min(size, buffered)
  if not (fusion and freed and in_flight < SCORING_IN_FLIGHT):
    return 0
  if buffered >= size:
    return size
  return buffered if in_flight == 0 else 0


def chunk_rows(n: int, shards: int) -> int:
  """Rows a scoring chunk of n samples is padded to: `shards` (the scoring
  replicas, so rows split evenly) times a power of two, so that chunks of
  every size meet O(log n) row counts, each a compiled program."""
  return shards * (1 << (-(-n // shards) - 1).bit_length())


def consolidation_block(rows_needed: int, rows_per_replica: int,
                        sizes: Sequence[int], current: int) -> int:
  """The smallest block size whose rows hold `rows_needed` (else
  `current`: nothing to gain)."""
  fits = [m for m in sizes if m * rows_per_replica >= rows_needed]
  return min(fits) if fits else current


def paged_consolidation_block(groups: int, samples: int, pages: int,
                              per_replica: tuple[int, int, int],
                              sizes: Sequence[int], current: int) -> int:
  """The paged engine's `consolidation_block`: the smallest block whose
  replicas hold the unfinished groups, their samples (live and waiting)
  and `pages` pages; `per_replica` is (group entries, slots, pages) of one
  replica. Else `current`: nothing to gain."""
  R, S, P = per_replica
  fits = [m for m in sizes
          if m * R >= groups and m * S >= samples and m * P >= pages]
  return min(fits) if fits else current


def grouped_admission(free_rows: Sequence[int], pending_replicas: Sequence[int],
                      rows_per_replica: int) -> tuple[int, int] | None:
  """RLHFless's admission (each prompt decodes on its own replica,
  `assignment.replica_of`): (index into the pending prompts, free row) of
  the lowest free row whose replica has a prompt pending, its first one;
  None when no free row's replica has one (free rows of a replica whose
  queue is empty stay free: they take only cut samples)."""
  for row in sorted(free_rows):
    r = row // rows_per_replica
    for i, replica in enumerate(pending_replicas):
      if replica == r:
        return i, row
  return None


def release_due(unfinished: int, *, replicas: int, queued: int,
                assigned: int, tau: float, fits: bool) -> bool:
  """RLHFless's release of the block's last replica (our engine shrinks
  from its end: replicas [0, m) -> [0, m - 1)), once no prompt is queued
  for it and either nothing of it is unfinished, or the finished fraction
  of its samples (`assigned` admitted, `unfinished` of them live or
  waiting) reached `tau` and its unfinished work `fits` the replicas
  before it: the local cut, that work moves there. tau >= 1: no cut."""
  if replicas <= 1 or queued:
    return False
  if not unfinished:
    return True
  return assigned > 0 and (assigned - unfinished) / assigned >= tau and fits


def last_replica_rows(live: Mapping[int, int], *, replicas: int,
                      rows_per_replica: int) -> tuple[int, bool]:
  """`release_due`'s view of a row layout (`live`: row -> samples still
  decoding in it): the samples live on the last replica's rows, and
  whether those rows fit the free rows of the replicas before it."""
  cap = (replicas - 1) * rows_per_replica
  mine = [n for r, n in live.items() if r >= cap]
  free_before = cap - sum(r < cap for r in live)
  return sum(mine), len(mine) <= free_before


def remap_rows(live_rows: Sequence[int], cap: int,
               extra: int = 0) -> tuple[dict[int, int], list[int]]:
  """Where the live rows go on a block of `cap` rows, and `extra` free rows.

  Rows below the cap keep their index; the others take the lowest free
  rows in ascending order; `extra` more free rows (for re-prefilled
  samples, one row each) follow.
  """
  row_map = {r: r for r in live_rows if r < cap}
  free = [r for r in range(cap) if r not in row_map.values()]
  for r in sorted(live_rows):
    if r not in row_map:
      row_map[r] = free.pop(0)
  return row_map, free[:extra]


def reprefill_choice(row_tokens: Mapping[int, int], migration: str,
                     max_tokens: int) -> list[int]:
  """Live rows to re-prefill instead of moving their KV.

  "kv": none; "reprefill": all; "auto": rows whose samples generated at
  most `max_tokens` tokens in all (cheap to recompute).
  """
  if migration == "kv":
    return []
  if migration == "reprefill":
    return sorted(row_tokens)
  return sorted(r for r, n in row_tokens.items() if n <= max_tokens)


def latency_capacity(step_time: Callable[[int], float], max_batch: int,
                     slack: float = 0.1) -> int:
  """Largest batch whose decode step is within (1 + slack) of batch 1.

  RLHFuse keeps enough survivors that "tail decoding does not slow down";
  this is that capacity for the tail's current context length.
  """
  limit = (1 + slack) * step_time(1)
  best = 1
  for b in range(1, max_batch + 1):
    if step_time(b) <= limit:
      best = b
    else:
      break
  return best


def consolidation_survivors(loads: list[InstanceLoad], batch_capacity: int,
                            kv_capacity_tokens: float) -> list[str]:
  """Instances that keep decoding the tail.

  Args:
    loads: every generation instance.
    batch_capacity: samples one instance decodes without slowing down
      (see latency_capacity).
    kv_capacity_tokens: KV tokens one instance can hold.

  Returns:
    Ids of the m survivors, the ones with the most unfinished work first.
  """
  ranked = sorted(loads, key=lambda s: (-s.unfinished, -s.kv_tokens, s.iid))
  need = sum(s.unfinished for s in loads)
  kv_need = sum(s.kv_tokens for s in loads)
  for m in range(1, len(ranked) + 1):
    if (m * batch_capacity >= need and m * kv_capacity_tokens >= kv_need):
      return [s.iid for s in ranked[:m]]
  return [s.iid for s in ranked]


def cut_moves(loads: list[InstanceLoad], tau: float,
              already_cut: set[str]) -> list[tuple[str, str, int]]:
  """RLHFless local cut-and-migrate decisions.

  An actor whose completion fraction reached tau moves its unfinished
  samples to actors with free slots (most free first); it only cuts if all
  of them fit, since a partial cut would not let it be released.

  Args:
    loads: active actors (assigned = samples given to the actor this step,
      finished = those done).
    tau: completion-fraction threshold.
    already_cut: actors that already cut this step (cut fires once).

  Returns:
    (source, destination, count) moves.
  """
  free = {s.iid: s.free_slots for s in loads}
  moves = []
  for src in sorted(loads, key=lambda s: s.iid):
    if src.iid in already_cut or src.unfinished == 0 or src.assigned == 0:
      continue
    if src.finished / src.assigned < tau:
      continue
    others = sorted((d for d in loads if d.iid != src.iid and
                     d.iid not in already_cut and free[d.iid] > 0),
                    key=lambda d: (-free[d.iid], d.iid))
    if sum(free[d.iid] for d in others) < src.unfinished:
      continue
    left = src.unfinished
    for dst in others:
      n = min(left, free[dst.iid])
      if n:
        moves.append((src.iid, dst.iid, n))
        free[dst.iid] -= n
        left -= n
      if not left:
        break
    free[src.iid] = 0
    already_cut.add(src.iid)
  return moves
