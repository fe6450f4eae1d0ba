"""Cost-aware choice of the number of decode actors (RLHFless).

The paper's exact objective and lambda are [U]. We use the reconstruction in
seeds.md section 1.2: choose n from a candidate set minimizing
  lambda * T(n) / T_ref + (1 - lambda) * C(n) / C_ref,
where T(n) is the predicted rollout latency and C(n) the GPU-seconds held,
both predicted from the length history and a profiled time-per-output-token
(TPOT) curve; T_ref and C_ref are the values at the largest candidate.
Growing from the actors already running to n starts n - running new ones,
which decode `spawn_s` later (process start, init, compile) and are billed
for it; shrinking is free.
"""

from collections.abc import Callable, Sequence

from rlhf_jax.sched import assignment


def predicted_actor_time(lengths: Sequence[float],
                         tpot: Callable[[int], float]) -> float:
  """Decode time of one actor whose samples have these predicted lengths.

  The batch shrinks as samples finish, so the time is the sum over
  length intervals of interval * TPOT(samples still running).

  Args:
    lengths: predicted response lengths of the actor's samples.
    tpot: seconds per decode step as a function of running batch size.

  Returns:
    Predicted seconds until the actor's last sample finishes.
  """
  ordered = sorted(lengths)
  total, previous = 0.0, 0.0
  for k, length in enumerate(ordered):
    total += (length - previous) * tpot(len(ordered) - k)
    previous = length
  return total


def choose_actor_count(group_lengths: dict[int, list[float]],
                       candidates: Sequence[int], tpot: Callable[[int], float],
                       lam: float, devices_per_actor: int,
                       startup_s: float = 0.0, spawn_s: float = 0.0,
                       running: int = 0) -> tuple[int, dict]:
  """Picks the actor count with the best latency/cost trade-off.

  Args:
    group_lengths: group id -> predicted lengths of its samples.
    candidates: actor counts to consider.
    tpot: decode step time as a function of batch size.
    lam: weight of latency (1.0 = fastest, 0.0 = cheapest).
    devices_per_actor: devices each actor holds (billing unit).
    startup_s: per-actor fixed time (weight load, prefill) before decoding.
    spawn_s: extra start-up of an actor not running yet; the new actors are
      the last n - running ones (the shortest groups: they start last).
    running: actors already running (they skip spawn_s).

  Returns:
    (chosen count, {n: (T(n), C(n))} for every candidate).
  """
  predicted = {g: max(v) for g, v in group_lengths.items()}
  table = {}
  for n in candidates:
    chunks = assignment.length_grouped_split(predicted, n)
    times = [
        startup_s + (spawn_s if i >= running else 0.0) + predicted_actor_time(
            [x for g in chunk for x in group_lengths[g]], tpot)
        for i, chunk in enumerate(chunks) if chunk
    ]
    table[n] = (max(times), sum(times) * devices_per_actor)
  return lambda_argmin(table, lam), table


def lambda_argmin(table: dict[int, tuple[float, float]], lam: float) -> int:
  """The count n minimising lam * T(n) / T_ref + (1 - lam) * C(n) / C_ref,
  the references at the largest candidate (ties: the smaller n)."""
  t_ref, c_ref = table[max(table)]
  t_ref, c_ref = t_ref or 1.0, c_ref or 1.0
  return min(table, key=lambda n: (
      lam * table[n][0] / t_ref + (1 - lam) * table[n][1] / c_ref, n))
