"""Row-level simulation of our decode engine (`engine/long_tail.py`).

The cluster simulator (`step.py`) models instances with roofline costs of
real accelerators; this one models OUR engine with unit costs measured on
it, so a live benchmark can check the prediction (`benchmarks/long_tail`):
  - m replicas x `rows_per_replica` rows; a row holds one prompt's G
    samples and frees when its longest sample ends;
  - the host reads each step's tokens one step late, so a row frees one
    step after its last sample ends;
  - admitting a prompt costs `prefill_s` on the host loop (its first token
    comes from the prefill); each decode step advances every live sample by
    one token and costs `step_s[m]`, whatever the number of live slots
    (static shapes);
  - policies: "static" (a new wave only once every row is free, FIFO),
    "continuous" (any free row, FIFO), "ours" (continuous, longest predicted
    first, and consolidation: once nothing is pending and the unfinished
    fraction of samples is below R_t, the live rows go to the smallest
    power-of-two block of replicas holding them, paying `move_s`, and again
    whenever fewer rows would fit a smaller block);
  - scoring: chunks of `score_chunk` finished samples cost `score_s` each;
    static and continuous score after the last sample, ours as chunks fill.
    With `concurrent_scoring` (scoring on freed devices that are physically
    separate) a chunk dispatched after consolidation overlaps decoding;
    without it (CPU: 8 fake devices share the host's cores) every chunk adds
    its time to the loop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class UnitCosts:
  step_s: dict[int, float]   # decode step time of an m-replica engine
  prefill_s: float           # one prompt's prefill + insert
  score_s: float             # one scoring chunk
  move_s: float = 0.0        # one consolidation


@dataclasses.dataclass
class SimResult:
  makespan: float
  steps: int
  consolidations: int
  decode_s: float
  scoring_s: float


def simulate(lengths_PxG: np.ndarray, *, replicas: int, rows_per_replica: int,
             policy: str, costs: UnitCosts, consolidate_below: float = 0.2,
             score_chunk: int = 8, predicted: Sequence[float] | None = None,
             concurrent_scoring: bool = False) -> SimResult:
  """Simulated seconds of one rollout + scoring phase."""
  if policy not in ("static", "continuous", "ours"):
    raise ValueError(f"unknown policy {policy!r}")
  lengths = np.asarray(lengths_PxG, int)
  n_prompts, G = lengths.shape
  order = list(range(n_prompts))
  if policy == "ours":
    pred = (lengths.mean(1) if predicted is None else np.asarray(predicted))
    order.sort(key=lambda p: (-pred[p], p))
  sizes = [m for m in (2 ** k for k in range(replicas.bit_length()))
           if replicas % m == 0]
  m = replicas
  total = n_prompts * G
  pending = list(order)
  rows: dict[int, list[int]] = {}   # row slot id -> remaining tokens per sample
  t, steps, consolidations = 0.0, 0, 0
  decode_s = scoring_s = 0.0
  finished = chunks_done = 0
  score_busy_until = 0.0
  next_row = 0

  def done_samples(remaining):
    return sum(1 for x in remaining if x <= 0)

  while pending or rows:
    capacity = m * rows_per_replica
    admit = not (policy == "static" and rows)
    while admit and pending and len(rows) < capacity:
      p = pending.pop(0)
      t += costs.prefill_s
      decode_s += costs.prefill_s
      rows[next_row] = [int(x) - 1 for x in lengths[p]]  # First token: prefill.
      next_row += 1
    # The host reads a step's tokens one step late (the next step is
    # dispatched first), so a finished row frees one iteration later.
    for r in list(rows):
      if all(x < 0 for x in rows[r]):
        del rows[r]
        continue
      finished += done_samples(rows[r]) - sum(1 for x in rows[r] if x < 0)
      rows[r] = [x if x > 0 else -1 for x in rows[r]]
    if policy == "ours":
      t, chunks_done, score_busy_until, scoring_s = _fused_scoring(
          finished, chunks_done, score_chunk, t, costs, m < replicas,
          concurrent_scoring, score_busy_until, scoring_s)
    if not rows:
      continue
    if (policy == "ours" and consolidate_below > 0 and not pending and
        (total - finished) / total < consolidate_below):
      fits = [k for k in sizes if k * rows_per_replica >= len(rows)]
      if fits and min(fits) < m:
        m = min(fits)
        t += costs.move_s
        consolidations += 1
    t += costs.step_s[m]
    decode_s += costs.step_s[m]
    steps += 1
    for r in rows:
      rows[r] = [x - 1 if x > 0 else x for x in rows[r]]
  if policy == "ours":
    leftover = finished - chunks_done * score_chunk
    n = math.ceil(leftover / score_chunk) if leftover > 0 else 0
    start = max(t, score_busy_until) if concurrent_scoring else t
    t = start + n * costs.score_s
    scoring_s += n * costs.score_s
    t = max(t, score_busy_until)
  else:
    n = math.ceil(total / score_chunk)
    t += n * costs.score_s
    scoring_s += n * costs.score_s
  return SimResult(t, steps, consolidations, decode_s, scoring_s)


def _fused_scoring(finished, chunks_done, chunk, t, costs, freed, concurrent,
                   busy_until, scoring_s):
  """Dispatches every full chunk; returns the updated clock and counters."""
  while finished - chunks_done * chunk >= chunk:
    chunks_done += 1
    scoring_s += costs.score_s
    if freed and concurrent:
      busy_until = max(busy_until, t) + costs.score_s
    else:
      t += costs.score_s
  return t, chunks_done, busy_until, scoring_s
