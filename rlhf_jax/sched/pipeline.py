"""Fused actor/critic pipeline (RLHFuse intra-stage fusion): problem, scoring.

Two models train on the same pp0 nodes. The large model's stages 0..pp0-1
run forward on nodes 0..pp0-1; pp0/pp1 copies of the small model each span
pp1 consecutive nodes in the *opposite* direction (copy c puts its stage 0 on
node (c+1)*pp1-1), so one model's bubbles can be filled by the other's
micro-batches. A schedule is one ordered task list per node, each task a
(model, forward?) pair; the k-th forward of a model on a node is micro-batch
k (FIFO), as in the released FlexFusion solver. Backward = 2 x forward.

Model 0 is the large model; models 1..pp0/pp1 are the small-model copies,
each with m1 micro-batches. Times are abstract integer units.
"""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class FusedProblem:
  """A FlexFusion instance: (pp0, pp1, m0, m1, f0, f1, mem0, mem1)."""

  pp0: int
  pp1: int
  m0: int
  m1: int
  f0: int
  f1: int
  mem0: float
  mem1: float

  def __post_init__(self):
    if self.pp0 % self.pp1:
      raise ValueError("pp1 must divide pp0")

  @property
  def n_models(self) -> int:
    return 1 + self.pp0 // self.pp1

  def micro_batches(self, model: int) -> int:
    return self.m0 if model == 0 else self.m1

  def fwd_time(self, model: int) -> int:
    return self.f0 if model == 0 else self.f1

  def mem(self, model: int) -> float:
    return self.mem0 if model == 0 else self.mem1

  def fwd_nodes(self, model: int) -> list[int]:
    """Node of each forward stage of `model`."""
    if model == 0:
      return list(range(self.pp0))
    last = model * self.pp1 - 1
    return [last - j for j in range(self.pp1)]

  def chain(self, model: int) -> list[tuple[int, int, bool]]:
    """(node, duration, forward?) of every task of one micro-batch, in order."""
    nodes, f = self.fwd_nodes(model), self.fwd_time(model)
    return ([(n, f, True) for n in nodes] +
            [(n, 2 * f, False) for n in reversed(nodes)])


PUBLISHED_INSTANCES = [
    FusedProblem(8, 4, 32, 16, 5, 4, 1.95, 2),
    FusedProblem(8, 4, 16, 8, 5, 4, 1.95, 2),
    FusedProblem(8, 4, 8, 4, 5, 4, 1.95, 2),
    FusedProblem(8, 8, 32, 32, 5, 2, 1.95, 1),
    FusedProblem(8, 8, 16, 16, 5, 2, 1.95, 1),
    FusedProblem(8, 8, 8, 8, 5, 2, 1.95, 1),
    FusedProblem(16, 8, 64, 32, 2, 2, 1.64, 2),
    FusedProblem(16, 8, 32, 16, 2, 2, 1.64, 2),
    FusedProblem(16, 8, 16, 8, 2, 2, 1.64, 2),
    FusedProblem(16, 16, 64, 64, 2, 1, 1.64, 1),
    FusedProblem(16, 16, 32, 32, 2, 1, 1.64, 1),
    FusedProblem(16, 16, 16, 16, 2, 1, 1.64, 1),
]


@dataclasses.dataclass(frozen=True)
class Evaluation:
  makespan: float  # inf when the schedule deadlocks or is invalid.
  peak_mem: float  # max over nodes of peak activation memory.
  sum_peak_mem: float


def evaluate(problem: FusedProblem,
             schedule: list[list[tuple[int, int, bool]]]) -> Evaluation:
  """Runs the per-node task lists; a task starts when both its node is free
  and its previous stage finished. Deadlock or a malformed list -> inf.

  Args:
    problem: the instance.
    schedule: per node, the ordered (model, micro-batch, forward?) tasks.

  Returns:
    Makespan and activation-memory peaks (+mem per forward, -mem per bwd).
  """
  chains = [problem.chain(m) for m in range(problem.n_models)]
  position = {}
  for m, chain in enumerate(chains):
    for j, (node, _, fwd) in enumerate(chain):
      position[(m, node, fwd)] = j
  expected = sum(problem.micro_batches(m) * len(chains[m])
                 for m in range(problem.n_models))
  seen = {(m, k, fwd, node) for node, tasks in enumerate(schedule)
          for m, k, fwd in tasks}
  if len(seen) != expected or sum(map(len, schedule)) != expected:
    return Evaluation(math.inf, math.inf, math.inf)
  done = {}
  n_nodes = problem.pp0
  free_at = [0.0] * n_nodes
  index = [0] * n_nodes
  mem = [0.0] * n_nodes
  peak = [0.0] * n_nodes
  remaining = expected
  progress = True
  while remaining and progress:
    progress = False
    for node in range(n_nodes):
      tasks = schedule[node]
      while index[node] < len(tasks):
        m, k, fwd = tasks[index[node]]
        j = position.get((m, node, fwd))
        if j is None or k >= problem.micro_batches(m):
          return Evaluation(math.inf, math.inf, math.inf)
        ready = 0.0 if j == 0 else done.get((m, k, j - 1), -1.0)
        if ready < 0:
          break
        start = max(ready, free_at[node])
        free_at[node] = start + chains[m][j][1]
        done[(m, k, j)] = free_at[node]
        mem[node] += problem.mem(m) if fwd else -problem.mem(m)
        peak[node] = max(peak[node], mem[node])
        index[node] += 1
        remaining -= 1
        progress = True
  if remaining:
    return Evaluation(math.inf, math.inf, math.inf)
  return Evaluation(max(free_at), max(peak), sum(peak))


def lower_bound(problem: FusedProblem) -> int:
  """Max of the four bounds of FlexFusion's get-lower-bound.py."""
  c = problem
  critical = (c.m0 + c.pp0 - 1) * 3 * c.f0
  total = math.ceil((c.pp0 * c.m0 * 3 * c.f0 +
                     c.pp1 * c.m1 * 3 * c.f1 * (c.pp0 // c.pp1)) / c.pp0)
  per_node = c.m0 * 3 * c.f0 + c.m1 * 3 * c.f1
  with_edges = 0
  for node in range(c.pp0):
    local = node % c.pp1 if c.pp0 != c.pp1 else node
    span = c.pp1 if c.pp0 != c.pp1 else c.pp0
    start = min(node * c.f0, (span - local - 1) * c.f1)
    trail = min(node * 2 * c.f0, (span - local - 1) * 2 * c.f1)
    with_edges = max(with_edges, start + per_node + trail)
  return max(critical, total, per_node, with_edges)


def serial_1f1b_makespan(problem: FusedProblem) -> int:
  """Unfused baseline: the large model's 1F1B, then the small copies' 1F1B."""
  c = problem
  return (c.m0 + c.pp0 - 1) * 3 * c.f0 + (c.m1 + c.pp1 - 1) * 3 * c.f1
