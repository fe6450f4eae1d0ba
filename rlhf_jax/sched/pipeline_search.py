"""Search for a fused actor/critic pipeline schedule (RLHFuse intra-stage).

The FlexFusion solver anneals per-node task orders with random adjacent
swaps, evaluating each order by event simulation, over 767 MPI seeds and
millions of iterations. In Python that budget is out of reach, so we anneal
in a smaller, smarter neighbourhood (forward-backward improvement, standard
for resource-constrained project scheduling):

1. Decode a priority into a schedule by list scheduling: whenever a node can
   start work it runs its ready task of best priority. The first priority is
   critical-path (longest remaining chain first).
2. Double justification: shift every task as late as possible (latest
   finish first), then as early as possible (earliest start first). Never
   worse, often shorter.
3. Simulated annealing over priorities: perturb the incumbent's start times
   with Gaussian noise, decode and justify; accept worse makespans with
   probability exp(-delta / T). Stop at the lower bound.
4. Memory pass: retry under 1F1B-shaped caps on in-flight micro-batches
   (stage s of an S-stage model holds at most S - s + extra), tightest
   first, keeping the first that still reaches the best makespan. Ties are
   broken by peak, then sum of peaks (FlexFusion's lexicographic order).

`anneal_swaps` keeps FlexFusion's adjacent-swap annealing on order lists.
"""

import bisect
import dataclasses
import math
import random
from collections.abc import Callable

from rlhf_jax.sched.pipeline import Evaluation, FusedProblem, evaluate
from rlhf_jax.sched.pipeline import lower_bound

Task = tuple[int, int, bool]  # (model, micro-batch, forward?)
Schedule = list[list[Task]]
# One scheduled task: [node, start, end, model, micro-batch, chain position].
Timed = list


def list_schedule(problem: FusedProblem,
                  priority: Callable[[int, int, int], float],
                  inflight_extra: int | None = None) -> list[Timed] | None:
  """Non-delay list scheduling; lower priority value runs first.

  With `inflight_extra`, a node may hold at most S - s + extra forwarded,
  not yet backwarded micro-batches of a model whose stage s it runs (1F1B
  holds S - s): the activation-memory shape of 1F1B plus slack. Returns None
  if the caps deadlock every node.
  """
  chains = [problem.chain(m) for m in range(problem.n_models)]
  cap = {}
  if inflight_extra is not None:
    for m in range(problem.n_models):
      nodes = problem.fwd_nodes(m)
      for s, node in enumerate(nodes):
        cap[(node, m)] = len(nodes) - s + inflight_extra
  available = [[] for _ in range(problem.pp0)]
  for m, chain in enumerate(chains):
    for k in range(problem.micro_batches(m)):
      available[chain[0][0]].append((0.0, m, k, 0))
  free_at = [0.0] * problem.pp0
  inflight = {}
  timed = []

  def eligible(node):
    return [e for e in available[node] if not chains[e[1]][e[3]][2] or
            inflight.get((node, e[1]), 0) < cap.get((node, e[1]), math.inf)]

  while any(available):
    options = []
    for node in range(problem.pp0):
      tasks = eligible(node)
      if tasks:
        options.append((max(free_at[node], min(e[0] for e in tasks)), node,
                        tasks))
    if not options:
      return None
    t, node, tasks = min(options, key=lambda x: (x[0], x[1]))
    ready = [e for e in tasks if e[0] <= t]
    chosen = min(ready, key=lambda e: (priority(e[1], e[2], e[3]), e[2],
                                       e[1]))
    available[node].remove(chosen)
    _, m, k, j = chosen
    end = t + chains[m][j][1]
    free_at[node] = end
    inflight[(node, m)] = inflight.get((node, m), 0) + (
        1 if chains[m][j][2] else -1)
    timed.append([node, t, end, m, k, j])
    if j + 1 < len(chains[m]):
      available[chains[m][j + 1][0]].append((end, m, k, j + 1))
  return timed


def justify(problem: FusedProblem, timed: list[Timed]) -> float:
  """Right- then left-justifies `timed` in place; returns the makespan."""
  n_stages = {m: len(problem.chain(m)) for m in range(problem.n_models)}
  by_key = {(x[3], x[4], x[5]): x for x in timed}
  horizon = max(x[2] for x in timed)
  busy = [[] for _ in range(problem.pp0)]
  for x in sorted(timed, key=lambda x: -x[2]):
    node, start, end, m, k, j = x
    limit = (horizon if j + 1 == n_stages[m] else by_key[(m, k, j + 1)][1])
    spans, latest = busy[node], limit
    for s, e in reversed(spans):  # spans sorted by start
      if e <= latest - (end - start) + 1e-9:
        break
      latest = min(latest, s)
    x[1], x[2] = latest - (end - start), latest
    bisect.insort(spans, (x[1], x[2]))
  busy = [[] for _ in range(problem.pp0)]
  for x in sorted(timed, key=lambda x: x[1]):
    node, start, end, m, k, j = x
    earliest = 0.0 if j == 0 else by_key[(m, k, j - 1)][2]
    spans, duration = busy[node], end - start
    for s, e in spans:
      if s >= earliest + duration - 1e-9:
        break
      earliest = max(earliest, e)
    x[1], x[2] = earliest, earliest + duration
    bisect.insort(spans, (x[1], x[2]))
  return max(x[2] for x in timed)


def to_schedule(problem: FusedProblem, timed: list[Timed]) -> Schedule:
  """Per-node task lists ordered by start time."""
  chains = [problem.chain(m) for m in range(problem.n_models)]
  schedule = [[] for _ in range(problem.pp0)]
  for node, _, _, m, k, j in sorted(timed, key=lambda x: (x[1], x[0])):
    schedule[node].append((m, k, chains[m][j][2]))
  return schedule


def _decode(problem, priority,
            inflight_extra=None) -> tuple[Schedule | None, Evaluation]:
  """Priority -> list schedule -> repeated double justification.

  Justification never lengthens a schedule but may reorder a node and raise
  its memory peak; among the passes, the shortest, then leanest, is kept.
  """
  timed = list_schedule(problem, priority, inflight_extra)
  if timed is None:
    return None, Evaluation(math.inf, math.inf, math.inf)
  schedule = to_schedule(problem, timed)
  result = evaluate(problem, schedule)
  makespan = result.makespan
  while True:
    improved = justify(problem, timed)
    candidate = to_schedule(problem, timed)
    cand_eval = evaluate(problem, candidate)
    if _key(cand_eval) < _key(result):
      schedule, result = candidate, cand_eval
    if improved >= makespan - 1e-9:
      break
    makespan = improved
  return schedule, result


def _key(e: Evaluation) -> tuple[float, float, float]:
  return (e.makespan, e.peak_mem, e.sum_peak_mem)


@dataclasses.dataclass(frozen=True)
class SearchResult:
  """Best schedule found, its makespan and peak memory, and the bound."""

  schedule: Schedule
  makespan: float
  lower_bound: int
  peak_mem: float
  greedy_makespan: float
  iterations: int


def search(problem: FusedProblem, *, iterations: int = 60,
           memory_tries: int = 0, t0: float = 2.0,
           seed: int = 0) -> SearchResult:
  """Critical-path start, annealing over priorities to the bound, then memory.

  Args:
    problem: the instance.
    iterations: annealing iterations (stops early at the lower bound).
    memory_tries: perturbed decodes per in-flight cap in the memory pass
      (0 = no memory pass); see _reduce_memory.
    t0: initial temperature, in units of the smaller forward time.
    seed: random seed (deterministic search).

  Returns:
    The best schedule and its numbers.
  """
  rng = random.Random(seed)
  bound = lower_bound(problem)
  chains = [problem.chain(m) for m in range(problem.n_models)]
  tails = [[sum(d for _, d, _ in chain[j + 1:]) for j in range(len(chain))]
           for chain in chains]
  best, best_eval = _decode(problem, lambda m, k, j: -tails[m][j])
  greedy_makespan = best_eval.makespan
  current, cur_eval = best, best_eval
  unit = min(problem.f0, problem.f1)
  temp = t0 * unit
  cooling = (0.01 / t0) ** (1.0 / max(iterations, 1))
  done = 0
  for done in range(1, iterations + 1):
    if best_eval.makespan <= bound:
      break
    cand, cand_eval = _decode(problem, _perturbed(problem, current, rng, unit))
    delta = cand_eval.makespan - cur_eval.makespan
    if (_key(cand_eval) <= _key(cur_eval) or
        rng.random() < math.exp(-delta / max(temp, 1e-9))):
      current, cur_eval = cand, cand_eval
      if _key(cur_eval) < _key(best_eval):
        best, best_eval = cand, cand_eval
    temp *= cooling
  if memory_tries:
    best, best_eval = _reduce_memory(problem, best, best_eval, memory_tries,
                                     rng, unit)
  return SearchResult(best, best_eval.makespan, bound, best_eval.peak_mem,
                      greedy_makespan, done)


def _perturbed(problem, schedule, rng, unit):
  """Priority = incumbent start time + Gaussian noise."""
  starts = _start_times(problem, schedule)
  sigma = rng.choice((0.5, 1.0, 2.0, 4.0)) * unit
  noise = {key: rng.gauss(0.0, sigma) for key in starts}
  return lambda m, k, j: starts[(m, k, j)] + noise[(m, k, j)]


def _reduce_memory(problem, best, best_eval, tries, rng, unit):
  """Tightest 1F1B-shaped in-flight cap that keeps the best makespan.

  Caps S - s + extra for extra = 0, 1, 2, 4, 8: each gets a critical-path
  decode and up to `tries` perturbed ones; the first cap reaching the best
  makespan with a lower memory peak wins.
  """
  chains = [problem.chain(m) for m in range(problem.n_models)]
  tails = [[sum(d for _, d, _ in chain[j + 1:]) for j in range(len(chain))]
           for chain in chains]
  for extra in (0, 1, 2, 4, 8):
    cand, cand_eval = _decode(problem, lambda m, k, j: -tails[m][j], extra)
    for _ in range(tries):
      if cand is not None and cand_eval.makespan <= best_eval.makespan:
        break
      if cand is None:
        break
      nxt, nxt_eval = _decode(problem, _perturbed(problem, cand, rng, unit),
                              extra)
      if nxt is not None and _key(nxt_eval) < _key(cand_eval):
        cand, cand_eval = nxt, nxt_eval
    if (cand is not None and cand_eval.makespan <= best_eval.makespan and
        cand_eval.peak_mem < best_eval.peak_mem):
      return cand, cand_eval
  return best, best_eval


def _start_times(problem, schedule) -> dict:
  """Start time of every task when `schedule` runs as early as possible."""
  chains = [problem.chain(m) for m in range(problem.n_models)]
  position = {(m, node, fwd): j for m, chain in enumerate(chains)
              for j, (node, _, fwd) in enumerate(chain)}
  done, starts = {}, {}
  free_at = [0.0] * problem.pp0
  index = [0] * problem.pp0
  left = sum(map(len, schedule))
  while left:
    for node, tasks in enumerate(schedule):
      while index[node] < len(tasks):
        m, k, fwd = tasks[index[node]]
        j = position[(m, node, fwd)]
        ready = 0.0 if j == 0 else done.get((m, k, j - 1), -1.0)
        if ready < 0:
          break
        starts[(m, k, j)] = max(ready, free_at[node])
        free_at[node] = done[(m, k, j)] = starts[(m, k, j)] + chains[m][j][1]
        index[node] += 1
        left -= 1
  return starts


def anneal_swaps(problem: FusedProblem, schedule: Schedule, *,
                 iterations: int, t0: float = 10.0, t_end: float = 1e-3,
                 seed: int = 0) -> tuple[Schedule, Evaluation]:
  """FlexFusion's move: swap two adjacent tasks of one node; anneal."""
  rng = random.Random(seed)
  current = [list(tasks) for tasks in schedule]
  cur_eval = evaluate(problem, current)
  best, best_eval = [list(t) for t in current], cur_eval
  cooling = (t_end / t0) ** (1.0 / max(iterations, 1))
  temp = t0
  for _ in range(iterations):
    tasks = current[rng.randrange(problem.pp0)]
    i = rng.randrange(len(tasks) - 1)
    tasks[i], tasks[i + 1] = tasks[i + 1], tasks[i]
    new_eval = evaluate(problem, current)
    delta = new_eval.makespan - cur_eval.makespan
    if new_eval.makespan < math.inf and (
        _key(new_eval) < _key(cur_eval) or
        rng.random() < math.exp(-delta / temp)):
      cur_eval = new_eval
      if _key(cur_eval) < _key(best_eval):
        best, best_eval = [list(t) for t in current], cur_eval
    else:
      tasks[i], tasks[i + 1] = tasks[i + 1], tasks[i]
    temp *= cooling
  return best, best_eval
