"""Row-level event simulation of our decode engine (`engine/long_tail.py`).

The cluster simulator (`step.py`) models instances with roofline costs of
real accelerators; this one replays a length trace through OUR engine's
row-level continuous batching with unit costs measured on it, so the live
benchmark (`benchmarks/long_tail.py`) can check its prediction. Exact and
deterministic, in simulated seconds, one host loop as in `engine/driver.py`:
  - R replicas x `rows_per_replica` rows; a row holds one prompt's G samples
    and frees only when all of them end; row r lives on replica r // rows.
  - Iteration k: admit pending prompts into free rows (`prefill_s` each; the
    first token comes from the prefill), one decode step (`step_s(m)` on an
    m-replica engine, however many slots are live: static shapes), then read
    step k-1's tokens (the host reads one step late). A sample of length L
    admitted at iteration a is read finished at iteration a + L - 1, and
    its row is free for admission at the next iteration.
  - "static": a new wave only once every row is free (FIFO). "continuous":
    any free row at once (FIFO, lowest row). "ours": continuous, longest
    predicted first into the free row of the replica with the least
    predicted work admitted so far, plus consolidation: once nothing is
    pending and the unfinished fraction of samples is below
    `consolidate_below`, the host reads the step in flight, and the live
    rows move (`move_s`) to the smallest power-of-two block of replicas
    [0, m) that holds them (rows below m * rows keep their index); again
    whenever fewer rows would fit a smaller block.
  - Scoring: chunks of `score_chunk` samples cost `score_s(n)`. Static and
    continuous score everything after the last sample; ours scores a chunk
    as soon as it fills (fusion). Before consolidation a chunk runs on the
    decode devices, serially with the loop; after, on the R - m freed
    replicas, concurrently with the tail steps. `score_overlap` is the
    fraction of a concurrent chunk hidden behind decoding (1 on separate
    accelerators; measured on a CPU, whose fake devices share cores). The
    phase ends when decoding and every chunk are done.
Device accounting: a step keeps its m replicas busy (`idle_fraction`);
`timeline_idle_fraction` counts a stepping replica busy only while it holds
a live row, as the live rollout's timeline does (stepping empty rows is
wasted). Prefill keeps the engine's replicas busy, a move all of them,
scoring its replicas.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np

from rlhf_jax.sched import assignment, tail

POLICIES = ("static", "continuous", "ours")


@dataclasses.dataclass(frozen=True)
class UnitCosts:
  """Measured seconds of the engine's units."""
  step_s: Mapping[int, float] | Callable[[int], float]  # m-replica step
  prefill_s: float                                      # prefill + insert
  score_s: float | Callable[[int], float]               # chunk of n samples
  move_s: float = 0.0                                   # one consolidation

  def step(self, m: int) -> float:
    return self.step_s(m) if callable(self.step_s) else self.step_s[m]

  def score(self, n: int) -> float:
    return self.score_s(n) if callable(self.score_s) else self.score_s


@dataclasses.dataclass
class SimResult:
  makespan: float         # seconds until decoding and scoring are done
  steps: int              # decode steps
  consolidations: int
  decode_s: float         # host-loop seconds of prefills, steps and moves
  scoring_s: float        # seconds of scoring chunks (sum over chunks)
  busy_device_s: float    # device-seconds running a program
  live_device_s: float    # same, stepping replicas only with a live row
  n_devices: int
  final_replicas: int

  @property
  def idle_fraction(self) -> float:
    return 1.0 - self.busy_device_s / (self.n_devices * self.makespan)

  @property
  def timeline_idle_fraction(self) -> float:
    return 1.0 - self.live_device_s / (self.n_devices * self.makespan)


def simulate(lengths_PxG, *, replicas: int, rows_per_replica: int,
             policy: str, costs: UnitCosts, consolidate_below: float = 0.2,
             score_chunk: int = 8, predicted: Sequence[float] | None = None,
             score_overlap: float = 1.0,
             devices_per_replica: int = 1) -> SimResult:
  """Simulates one rollout + scoring phase of `policy` on a length trace.

  Args:
    lengths_PxG: response lengths (tokens, >= 1) of G samples per prompt.
    replicas: R, a power of two times an odd number (consolidation blocks
      are power-of-two divisors of R).
    rows_per_replica: rows (prompts) per replica.
    policy: "static", "continuous" or "ours".
    costs: measured unit costs.
    consolidate_below: R_t of "ours" (0: never consolidate).
    score_chunk: samples per scoring chunk.
    predicted: per-prompt predicted lengths for "ours" (default: the true
      per-prompt means, a perfect length history).
    score_overlap: fraction of a chunk on freed replicas hidden behind
      decoding (0: it adds its whole time to the loop).
    devices_per_replica: devices of one replica (tensor parallelism).

  Returns:
    The phase's `SimResult`.
  """
  if policy not in POLICIES:
    raise ValueError(f"unknown policy {policy!r}; one of {POLICIES}")
  lengths = np.asarray(lengths_PxG, int)
  n_prompts, G = lengths.shape
  ours, R, rpr = policy == "ours", replicas, rows_per_replica
  pred = np.asarray(lengths.mean(1) if predicted is None else predicted, float)
  order = (assignment.longest_first(pred, range(n_prompts)) if ours
           else list(range(n_prompts)))
  pending = collections.deque(order)
  sizes = tail.block_sizes(R)
  total, m, k = n_prompts * G, R, 0
  rows: dict[int, list[int]] = {}   # row -> read iterations of live samples
  load = [0.0] * R                  # predicted tokens admitted per replica
  no_gain, steps, moves, buffered = tail.no_gain_rows(R, rpr), 0, 0, 0
  c = dict(t=0.0, busy=0.0, live=0.0, decode=0.0, score=0.0, free_at=0.0)

  def spend(dt, busy, live=None):  # Host-loop time; busy/live in replicas.
    c["t"] += dt
    c["decode"] += dt
    c["busy"] += dt * busy
    c["live"] += dt * (busy if live is None else live)

  def live_replicas():
    return len({r // rpr for r in rows})

  def read(k):  # Samples read finished by iteration k; frees empty rows.
    n = 0
    for r in list(rows):
      left = [f for f in rows[r] if f > k]
      n += len(rows[r]) - len(left)
      if left:
        rows[r] = left
      else:
        del rows[r]
    return n

  def score(n):  # One chunk of n samples, on the scoring replicas.
    cost = costs.score(n)
    c["score"] += cost
    if m == R:  # Same devices as decoding: serial.
      c["t"] += cost
      c["busy"] += cost * R
      c["live"] += cost * R
      return
    start = max(c["t"], c["free_at"])
    c["free_at"] = start + cost
    c["busy"] += cost * (R - m)
    c["live"] += cost * (R - m)
    c["t"] += (1.0 - score_overlap) * cost

  def finished(n):
    nonlocal buffered
    buffered += n
    while ours and buffered >= score_chunk:
      score(score_chunk)
      buffered -= score_chunk

  while pending or rows:
    k += 1
    if pending and not (policy == "static" and rows):
      free = [r for r in range(m * rpr) if r not in rows]
      while pending and free:
        p = pending.popleft()
        row = tail.least_loaded_row(free, load, rpr) if ours else free[0]
        free.remove(row)
        load[row // rpr] += pred[p] * G
        rows[row] = [k + int(x) - 1 for x in lengths[p]]
        spend(costs.prefill_s, m, live_replicas())
    spend(costs.step(m), m, live_replicas())
    steps += 1
    finished(read(k))
    n_live = sum(len(v) for v in rows.values())
    if ours and tail.consolidation_due(
        n_live, total, consolidate_below, pending=bool(pending), replicas=m,
        live_rows=len(rows), no_gain=no_gain):
      finished(read(k + 1))  # The switch first reads the step in flight.
      if not rows:
        continue
      target = tail.consolidation_block(len(rows), rpr, sizes, m)
      if target >= m:
        no_gain = len(rows)
        continue
      row_map, _ = tail.remap_rows(list(rows), target * rpr)
      rows = {row_map[r]: v for r, v in rows.items()}
      m, moves = target, moves + 1
      spend(costs.move_s, R)
  while buffered > 0:
    score(min(score_chunk, buffered))
    buffered -= score_chunk
  makespan = max(c["t"], c["free_at"])
  dpr = devices_per_replica
  return SimResult(makespan, steps, moves, c["decode"], c["score"],
                   c["busy"] * dpr, c["live"] * dpr, R * dpr, m)


def simulate_policies(lengths_PxG, policies: Sequence[str] = POLICIES,
                      **kwargs) -> dict[str, SimResult]:
  """`simulate` for each policy on the same trace and costs."""
  return {p: simulate(lengths_PxG, policy=p, **kwargs) for p in policies}
