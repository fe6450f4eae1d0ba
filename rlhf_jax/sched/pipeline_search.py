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
4. Memory pass: at the best makespan, prefer schedules with lower peak and
   sum-of-peaks activation memory (lexicographic, as FlexFusion).

`anneal_swaps` keeps FlexFusion's adjacent-swap annealing on order lists.
"""

import bisect
import dataclasses
import math
import random
from collections.abc import Callable

from rlhf_jax.sched.pipeline import Evaluation, FusedProblem, evaluate
from rlhf_jax.sched.pipeline import lower_bound, serial_peak_memory

Task = tuple[int, int, bool]  # (model, micro-batch, forward?)
Schedule = list[list[Task]]
# One scheduled task: [node, start, end, model, micro-batch, chain position].
Timed = list


def list_schedule(problem: FusedProblem,
                  priority: Callable[[int, int, int], float],
                  mem_cap: float = math.inf) -> list[Timed] | None:
  """Non-delay list scheduling; lower priority value runs first.

  A forward may only start on a node whose activation memory (+mem per
  forward, -mem per backward, in start order) stays within `mem_cap`.
  Returns None when the cap deadlocks every node.
  """
  chains = [problem.chain(m) for m in range(problem.n_models)]
  available = [[] for _ in range(problem.pp0)]
  for m, chain in enumerate(chains):
    for k in range(problem.micro_batches(m)):
      available[chain[0][0]].append((0.0, m, k, 0))
  free_at = [0.0] * problem.pp0
  memory = [0.0] * problem.pp0
  timed = []

  def eligible(node):
    return [e for e in available[node] if not chains[e[1]][e[3]][2] or
            memory[node] + problem.mem(e[1]) <= mem_cap + 1e-9]

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
    memory[node] += problem.mem(m) if chains[m][j][2] else -problem.mem(m)
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
            mem_cap=math.inf) -> tuple[Schedule | None, Evaluation]:
  """Priority -> list schedule -> repeated double justification."""
  timed = list_schedule(problem, priority, mem_cap)
  if timed is None:
    return None, Evaluation(math.inf, math.inf, math.inf)
  makespan = max(x[2] for x in timed)
  schedule = to_schedule(problem, timed)
  result = evaluate(problem, schedule)
  while True:
    # Justification can reorder a node and so move its memory peak; keep
    # the justified schedule only while it respects the cap.
    improved = justify(problem, timed)
    candidate = to_schedule(problem, timed)
    cand_eval = evaluate(problem, candidate)
    if cand_eval.peak_mem > mem_cap + 1e-9:
      break
    if cand_eval.makespan <= result.makespan:
      schedule, result = candidate, cand_eval
    if improved >= makespan - 1e-9:
      break
    makespan = improved
  return schedule, result


def _key(e: Evaluation) -> tuple[float, float, float]:
  return (e.makespan, e.peak_mem, e.sum_peak_mem)


@dataclasses.dataclass(frozen=True)
class SearchResult:
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
    memory_tries: decodes per activation-memory cap in the memory pass; caps
      step down from the found peak toward the serial-1F1B peak, and the
      lowest cap that keeps the best makespan wins (0 = no memory pass).
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


def _perturbed(problem, schedule, rng, unit, bwd_bias=0.0):
  """Priority = incumbent start time + Gaussian noise (- bias for bwd)."""
  chains = [problem.chain(m) for m in range(problem.n_models)]
  starts = _start_times(problem, schedule)
  sigma = rng.choice((0.5, 1.0, 2.0, 4.0)) * unit
  noise = {key: rng.gauss(0.0, sigma) for key in starts}
  def priority(m, k, j):
    backward = not chains[m][j][2]
    return starts[(m, k, j)] + noise[(m, k, j)] - bwd_bias * backward
  return priority


def _reduce_memory(problem, best, best_eval, tries, rng, unit):
  """Lowest activation cap (from the peak down) keeping the best makespan."""
  floor = max(serial_peak_memory(problem), problem.mem0, problem.mem1)
  cap = best_eval.peak_mem
  while cap > floor + 1e-9:
    cap = max(floor, cap * 0.85)
    found = None
    for _ in range(tries):
      cand, cand_eval = _decode(
          problem, _perturbed(problem, best, rng, unit, bwd_bias=2 * unit),
          mem_cap=cap)
      if cand is not None and cand_eval.makespan <= best_eval.makespan:
        found = (cand, cand_eval)
        break
    if found is None:
      break
    best, best_eval = found
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
