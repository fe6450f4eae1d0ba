"""Cost-aware replica count for row-level continuous batching (RLHFless).

Our engine steps every row of every replica at once (static shapes), a row
holds one prompt's G samples and frees when its longest sample ends. So a
rollout on m replicas with `rows_per_replica` rows each takes about
  T(m) = steps(m) * step_s[m],
where steps(m) comes from replaying longest-first admission of the predicted
row lengths into m * rows_per_replica rows. The device cost is C(m) =
T(m) * m (replica-seconds held by decode; the other replicas score or are
released). As in `actor_scaling.py` the choice minimizes
  lambda * T(m) / T_ref + (1 - lambda) * C(m) / C_ref
with the references at the largest candidate.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from rlhf_jax.sched import actor_scaling


def decode_steps(row_lengths: Sequence[float], num_rows: int) -> float:
  """Steps until every row finished, rows admitted in the given order."""
  free_at = [0.0] * num_rows  # Min-heap of the step each row frees.
  heapq.heapify(free_at)
  end = 0.0
  for length in row_lengths:
    start = heapq.heappop(free_at)
    finish = start + max(1.0, float(length))
    end = max(end, finish)
    heapq.heappush(free_at, finish)
  return end


def choose_replicas(sample_lengths: Sequence[Sequence[float]],
                    candidates: Sequence[int], rows_per_replica: int,
                    step_s: dict[int, float], lam: float
                    ) -> tuple[int, dict]:
  """The decode replica count and its inputs.

  Args:
    sample_lengths: per request (row), predicted lengths of its samples.
    candidates: replica counts to consider.
    rows_per_replica: rows each replica holds.
    step_s: measured seconds per decode step, per candidate.
    lam: weight of latency (1: fastest, 0: fewest replica-seconds).

  Returns:
    (chosen count, {"lambda", "table": {m: (T, C)}}).
  """
  rows = sorted((max(v) for v in sample_lengths), reverse=True)
  table = {}
  for m in candidates:
    t = decode_steps(rows, m * rows_per_replica) * step_s[m]
    table[m] = (t, t * m)
  return (actor_scaling.lambda_argmin(table, lam),
          {"lambda": lam, "table": table})


def decode_replicas(mode: str | int, sizes: Sequence[int],
                    sample_lengths: Sequence[Sequence[float]],
                    rows_per_replica: int, step_s: dict[int, float | None],
                    lam: float) -> tuple[int, dict]:
  """The replica count a rollout decodes on, and the decision inputs.

  mode "all": every replica; an int: that many; "cost": `choose_replicas`
  once every candidate's step time is measured (until then all: the first
  rollouts measure them).
  """
  if mode == "all":
    return max(sizes), {}
  if isinstance(mode, int):
    return mode, {}
  if any(step_s.get(m) is None for m in sizes):
    return max(sizes), {"unmeasured": True}
  return choose_replicas(sample_lengths, sizes, rows_per_replica,
                         {m: step_s[m] for m in sizes}, lam)
