"""Row-level simulation of our long-tail policies (`engine/long_tail.py`).

The cluster simulator (`step.py`) models instances with roofline costs of
real accelerators; this one replays a length trace through OUR policies
as row-level continuous batching, with unit costs measured on the paged
engine jobs decode on (`benchmarks/long_tail.py` calibrates them there
and checks the prediction against its live runs). A model, not a replay of
the paged driver: a row here is a group of G slots that frees when its last
sample ends, where the paged driver starts a waiting sample in any slot
that frees (its continuous runs can take a few steps fewer), and a step
costs `step_s(m)` however many slots are live. Exact and deterministic, in
simulated seconds, one host loop as in the engine's driver:
  - R replicas x `rows_per_replica` rows; a row holds one prompt's G samples
    and frees only when all of them end; row r lives on replica r // rows.
  - Iteration k: admit pending prompts into free rows (`prefill_s` each; the
    first token comes from the prefill), one decode step (`step_s(m)` on an
    m-replica engine, however many slots are live), then read
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
  - "rlhfless": as "ours", but each prompt decodes on its own replica
    (`sched.assignment.replica_of`: runs of similar predicted length, the
    longest on replica 0; `sched.tail.grouped_admission`), and the block
    shrinks by its last replica once no prompt is queued there and it is
    done, or its finished fraction reached `cut_tau` and its live rows fit
    the free rows before it (they move: `sched.tail.release_due`, one
    `move_s`).
  - Scoring: chunks of `score_chunk` samples (rounded up to fill the
    rows they are padded to on the scoring replicas) cost `score_s(n, L)`
    (L: the chunk's longest response), released by the live controller's
    rule (`sched.tail.scoring_chunk`). Static and continuous score
    everything after the last sample, on every replica; ours (fusion)
    holds finished samples while every replica decodes, then scores a
    chunk as soon as it fills on the R - m freed replicas, concurrently
    with the tail steps, and the rest after the decode. `score_overlap` is the
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

POLICIES = ("static", "continuous", "ours", "rlhfless")


@dataclasses.dataclass(frozen=True)
class UnitCosts:
  """Measured seconds of the engine's units."""
  step_s: Mapping[int, float] | Callable[[int], float]  # m-replica step
  prefill_s: float                                      # prefill + insert
  # A chunk of n samples whose longest response has L tokens: (n, L) -> s.
  score_s: float | Callable[[int, int], float]
  move_s: float = 0.0                                   # one consolidation

  def step(self, m: int) -> float:
    if callable(self.step_s):
      return self.step_s(m)
    if m not in self.step_s:
      raise ValueError(f"no step cost of the {m}-replica engine (step_s has "
                       f"{sorted(self.step_s)}; rlhfless releases one "
                       "replica at a time: give every count or a function)")
    return self.step_s[m]

  def score(self, n: int, longest: int) -> float:
    return (self.score_s(n, longest) if callable(self.score_s)
            else self.score_s)


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
  releases: int = 0       # "rlhfless": replicas released one by one

  @property
  def idle_fraction(self) -> float:
    return 1.0 - self.busy_device_s / (self.n_devices * self.makespan)

  @property
  def timeline_idle_fraction(self) -> float:
    return 1.0 - self.live_device_s / (self.n_devices * self.makespan)


def simulate(lengths_PxG, *, replicas: int, rows_per_replica: int,
             policy: str, costs: UnitCosts, consolidate_below: float = 0.2,
             score_chunk: int = 8, predicted: Sequence[float] | None = None,
             score_overlap: float = 1.0, fusion: bool | None = None,
             devices_per_replica: int = 1, cut_tau: float = 0.8
             ) -> SimResult:
  """Simulates one rollout + scoring phase of `policy` on a length trace.

  Args:
    lengths_PxG: response lengths (tokens, >= 1) of G samples per prompt.
    replicas: R, a power of two times an odd number (consolidation blocks
      are power-of-two divisors of R).
    rows_per_replica: rows (prompts) per replica.
    policy: "static", "continuous", "ours" or "rlhfless" (ours with
      RLHFless's assignment and release instead of least-loaded rows).
    costs: measured unit costs.
    consolidate_below: R_t of "ours" (0: never consolidate).
    score_chunk: samples per scoring chunk.
    predicted: per-prompt predicted lengths for "ours" (default: the true
      per-prompt means, a perfect length history).
    score_overlap: fraction of a chunk on freed replicas hidden behind
      decoding (0: it adds its whole time to the loop).
    fusion: score chunks on freed replicas during the tail (default: for
      "ours" only); else everything after the decode.
    devices_per_replica: devices of one replica (tensor parallelism).
    cut_tau: tau of "rlhfless"'s local cut.

  Returns:
    The phase's `SimResult`.
  """
  if policy not in POLICIES:
    raise ValueError(f"unknown policy {policy!r}; one of {POLICIES}")
  lengths = np.asarray(lengths_PxG, int)
  n_prompts, G = lengths.shape
  ours, R, rpr = policy in ("ours", "rlhfless"), replicas, rows_per_replica
  grouped = policy == "rlhfless"
  fusion = ours if fusion is None else fusion
  pred = np.asarray(lengths.mean(1) if predicted is None else predicted, float)
  order = (assignment.longest_first(pred, range(n_prompts)) if ours
           else list(range(n_prompts)))
  pending = collections.deque(order)
  replica = assignment.replica_of(pred, R) if grouped else None
  assigned, releases = [0] * R, 0   # samples admitted per replica
  sizes = tail.block_sizes(R)
  total, m, k = n_prompts * G, R, 0
  rows: dict[int, list[tuple[int, int]]] = {}  # row -> live samples'
  #                                   (read iteration, length)
  load = [0.0] * R                  # predicted tokens admitted per replica
  no_gain, steps, moves = tail.no_gain_rows(R, rpr), 0, 0
  buffered: collections.deque[int] = collections.deque()  # their lengths
  c = dict(t=0.0, busy=0.0, live=0.0, decode=0.0, score=0.0, free_at=0.0)
  ends: list[float] = []            # Finish times of freed-replica chunks.

  def spend(dt, busy, live=None):  # Host-loop time; busy/live in replicas.
    c["t"] += dt
    c["decode"] += dt
    c["busy"] += dt * busy
    c["live"] += dt * (busy if live is None else live)

  def live_replicas():
    return len({r // rpr for r in rows})

  def read(k):  # Lengths of samples read finished by iteration k; frees
    done = []   # empty rows.
    for r in list(rows):
      done += [x for f, x in rows[r] if f <= k]
      left = [(f, x) for f, x in rows[r] if f > k]
      if left:
        rows[r] = left
      else:
        del rows[r]
    return done

  def score(chunk, decoded):  # One chunk on the scoring replicas.
    cost = costs.score(len(chunk), max(chunk))
    c["score"] += cost
    if decoded or m == R:  # Every replica, after the chunks in flight.
      c["t"] = max(c["t"], c["free_at"]) + cost
      c["busy"] += cost * R
      c["live"] += cost * R
      return
    start = max(c["t"], c["free_at"])
    c["free_at"] = start + cost
    ends.append(c["free_at"])
    c["busy"] += cost * (R - m)
    c["live"] += cost * (R - m)
    c["t"] += (1.0 - score_overlap) * cost

  def finished(done, decoded=False):  # The live controller's chunk rule.
    buffered.extend(done)
    while True:
      size = tail.scoring_chunk(
          len(buffered), score_chunk, R - m if m < R else R, fusion=fusion,
          freed=m < R, decoded=decoded,
          in_flight=sum(e > c["t"] for e in ends))
      if not size:
        return
      score([buffered.popleft() for _ in range(size)], decoded)

  while pending or rows:
    k += 1
    if pending and not (policy == "static" and rows):
      free = [r for r in range(m * rpr) if r not in rows]
      while pending and free:
        if grouped:
          pick = tail.grouped_admission(free, [replica[q] for q in pending],
                                        rpr)
          if pick is None:
            break
          p, row = pending[pick[0]], pick[1]
          del pending[pick[0]]
        else:
          p = pending.popleft()
          row = tail.least_loaded_row(free, load, rpr) if ours else free[0]
        free.remove(row)
        load[row // rpr] += pred[p] * G
        assigned[row // rpr] += G
        rows[row] = [(k + int(x) - 1, int(x)) for x in lengths[p]]
        spend(costs.prefill_s, m, live_replicas())
    spend(costs.step(m), m, live_replicas())
    steps += 1
    finished(read(k))
    n_live = sum(len(v) for v in rows.values())
    if grouped and rows:
      unfinished, fits = tail.last_replica_rows(
          {r: len(v) for r, v in rows.items()}, replicas=m,
          rows_per_replica=rpr)
    release = grouped and rows and tail.release_due(
        unfinished, replicas=m,
        queued=sum(replica[q] == m - 1 for q in pending),
        assigned=assigned[m - 1], tau=cut_tau, fits=fits)
    if release or (ours and tail.consolidation_due(
        n_live, total, consolidate_below, pending=bool(pending), replicas=m,
        live_rows=len(rows), no_gain=no_gain)):
      finished(read(k + 1))  # The switch first reads the step in flight.
      if not rows:
        continue
      target = (m - 1 if release
                else tail.consolidation_block(len(rows), rpr, sizes, m))
      if target >= m:
        no_gain = len(rows)
        continue
      row_map, _ = tail.remap_rows(list(rows), target * rpr)
      rows = {row_map[r]: v for r, v in rows.items()}
      releases += bool(release)
      moves += not release
      m = target
      spend(costs.move_s, R)
      finished([])  # Samples that waited for freed replicas.
  finished([], decoded=True)
  makespan = max(c["t"], c["free_at"])
  dpr = devices_per_replica
  return SimResult(makespan, steps, moves, c["decode"], c["score"],
                   c["busy"] * dpr, c["live"] * dpr, R * dpr, m, releases)


def simulate_policies(lengths_PxG,
                      policies: Sequence[str] = ("static", "continuous", "ours"),
                      **kwargs) -> dict[str, SimResult]:
  """`simulate` for each policy on the same trace and costs (by default
  those whose engines are power-of-two blocks: "rlhfless" needs the step
  cost of every replica count)."""
  return {p: simulate(lengths_PxG, policy=p, **kwargs) for p in policies}
