"""RLBoost: adaptive seeding window, instance cap, dispatch and balancing.

Algorithm 1 (T_seed controller), Algorithm 2 SELECTINSTANCE (join the
shortest pending queue, at most Theta pending per instance) and CONTINUOUSLB
(move pending to an instance with none; move running beyond the batching
plateau B to an idle instance). Constants follow the released code
(PolyRL rollout-manager/src/balance.rs): eta = 3, T_init = 150 s, floor 5 s.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepObservation:
  """What Algorithm 1 observes at the end of a step."""

  t_train_wait: float  # trainer idle while waiting for micro-batches.
  t_remote_wait: float  # remote idle after their last response.
  t_train: float  # trainer effective compute time.
  t_remote: float  # mean remote effective compute time per instance.
  n_prem: float  # mean active remote instances over the step.
  n_prem_next: int  # active just before the next step.


class SeedWindowController:
  """Algorithm 1: T_seed += (t_train_wait - t_remote_wait) / eta."""

  def __init__(self, n_resv: int, t_init: float = 150.0, eta: float = 3.0,
               floor: float = 5.0, use_memory: bool = True):
    self.n_resv = n_resv
    self.t_seed = t_init
    self.eta = eta
    self.floor = floor
    self.use_memory = use_memory
    self.memory = {}
    self.n_prem_cap = float("inf")

  def update(self, obs: StepObservation):
    """Adapts T_seed and the remote-instance cap after one step."""
    self.t_seed = max(self.floor, self.t_seed +
                      (obs.t_train_wait - obs.t_remote_wait) / self.eta)
    if obs.t_train > 0:
      self.n_prem_cap = (obs.t_remote * obs.n_prem +
                         self.t_seed * self.n_resv) / obs.t_train
    if not self.use_memory:
      return
    if round(obs.n_prem) == obs.n_prem_next:
      self.memory[obs.n_prem_next] = self.t_seed
    elif obs.n_prem_next in self.memory:
      self.t_seed = self.memory[obs.n_prem_next]

  def allowed_instances(self, available: int) -> int:
    """Remote instances to use out of `available` (never above the cap)."""
    return cap_count(available, self.n_prem_cap)

  def state_dict(self) -> dict:
    return {"t_seed": self.t_seed, "n_prem_cap": self.n_prem_cap,
            "memory": dict(self.memory)}


def cap_count(n: int, cap: float) -> int:
  """At most n instances and no more than the N_prem cap allows (at least
  one): the cap rounded as Algorithm 1's released code does."""
  if cap == float("inf"):
    return n
  return min(n, max(1, round(cap + 0.5)))


def balanced_instance_count(candidates: Sequence[int],
                            rollout_work_s: Callable[[int], float],
                            train_work_s: float) -> int:
  """Reserved rollout instances of a disaggregated job (Disagg.BAL's
  resource optimizer, which "balances the workloads" of the two stages).

  Balanced means an instance's share of the rollout work takes about as
  long as the trainer's work: the count minimising the longer of the two,
  the fewer on a tie. Work, not the rollout's span: past some count the
  span is the longest response's decode, which more instances cannot
  shorten (`sim.runner.balanced_instances` prices the work at one
  engine's full-batch decode rate).
  """
  if not candidates:
    raise ValueError("no rollout instance count to choose from")
  return min(candidates,
             key=lambda n: (max(rollout_work_s(n), train_work_s), n))


@dataclasses.dataclass(frozen=True)
class QueueView:
  """Pending (queued) and executing counts of one instance."""

  pending: int
  running: int
  max_slots: int


def select_instance(views: Sequence[QueueView], theta: int) -> int | None:
  """SELECTINSTANCE: shortest pending queue below Theta, else None (wait).

  Ties go to the instance with the most free slots, then the lowest index,
  so an empty instance is filled before a busy one.
  """
  best, best_key = None, None
  for i, v in enumerate(views):
    if v.pending >= theta:
      continue
    key = (v.pending, v.running - v.max_slots, i)
    if best_key is None or key < best_key:
      best, best_key = i, key
  return best


def balance_moves(views: Sequence[QueueView],
                  plateau: int) -> list[tuple[int, int, int, bool]]:
  """CONTINUOUSLB: one polling round of moves.

  Args:
    views: per-instance counts.
    plateau: batching plateau B.

  Returns:
    (source, destination, count, running?) moves.
  """
  pending = [v.pending for v in views]
  running = [v.running for v in views]
  moves = []
  starving = [i for i, p in enumerate(pending) if p == 0]
  if starving and any(pending):
    for dst in starving:
      free = views[dst].max_slots - running[dst] + 1
      while free > 0:
        src = max(range(len(views)), key=lambda i: (pending[i], -i))
        if pending[src] <= 1:
          break
        moves.append((src, dst, 1, False))
        pending[src] -= 1
        pending[dst] += 1
        free -= 1
    return moves
  for dst in (i for i, r in enumerate(running) if r == 0 and pending[i] == 0):
    src = max(range(len(views)), key=lambda i: (running[i], -i))
    count = min(max(running[src] - plateau, 0), views[dst].max_slots)
    if count > 0:
      moves.append((src, dst, count, True))
      running[src] -= count
      running[dst] += count
  return moves


def worker_moves(views: Sequence[QueueView],
                 plateau: int | None) -> list[tuple[int, int, int, bool]]:
  """`balance_moves` as the rollout manager applies it: no running moves
  without a plateau (None), and no self-moves (a source that became the
  longest queue after receiving; the cluster simulator applies those as a
  re-queue)."""
  moves = balance_moves(views, NO_PLATEAU if plateau is None else plateau)
  return [m for m in moves if m[0] != m[1]]


NO_PLATEAU = 1 << 30  # A plateau no batch reaches: running samples stay.


def samples_to_cut(budget_left: dict[Any, int], n: int, cap: int) -> list:
  """Which samples a worker hands to an idle one (CONTINUOUSLB).

  The engine frees each sample's slot and pages on its own, so single
  samples move, the ones with the most budget left first (their decode
  steps are the gain; a move costs about the same for any sample), at most
  `cap`: each continues as a group of its own on the destination, which
  admits at most its group entries at once.

  Args:
    budget_left: sample key -> tokens left in its budget (live or waiting).
    n: samples the manager asks for.
    cap: the destination's group entries (same spec as the source).
  """
  order = sorted(budget_left, key=lambda k: (-budget_left[k], k))
  return order[:max(0, min(n, cap))]


def requeue_plan(keys: Sequence, started: Callable[[Any], bool],
                 group: Callable[[Any], Any],
                 group_size: Callable[[Any], int]) -> list[tuple[str, Any]]:
  """How a lost (or released) worker's unfinished samples go back to the
  queue's front, in the order to push them there.

  A started sample continues on its own ("continue", key: prompt + its
  tokens so far, the budget left); a group none of whose samples started
  goes back whole ("whole", group: one prefill for its samples) when all
  of them were on the worker, else sample by sample.

  Args:
    keys: the worker's unfinished samples, in the caller's order.
    started: whether a sample has streamed tokens.
    group: a sample's group (its request).
    group_size: samples of a group.
  """
  plan, unstarted = [], {}
  for key in keys:
    if started(key):
      plan.append(("continue", key))
    else:
      unstarted.setdefault(group(key), []).append(key)
  for g, members in unstarted.items():
    if len(members) == group_size(g):
      plan.append(("whole", g))
    else:
      plan += [("continue", key) for key in members]
  return plan


def batching_plateau(throughput: Callable[[int], float], max_batch: int,
                     fraction: float = 0.8, *,
                     nondecreasing: bool = False) -> int:
  """Smallest batch reaching `fraction` of the throughput at max_batch.

  `nondecreasing`: the caller's throughput never falls as the batch grows
  (a roofline; not measured timings), so a bisection finds the same batch
  in log2(max_batch) calls instead of up to max_batch."""
  target = fraction * throughput(max_batch)
  if nondecreasing:
    lo, hi = 1, max_batch  # throughput(hi) >= target.
    while lo < hi:
      mid = (lo + hi) // 2
      if throughput(mid) >= target:
        hi = mid
      else:
        lo = mid + 1
    return lo
  for b in range(1, max_batch + 1):
    if throughput(b) >= target:
      return b
  return max_batch


def select_least_work(views: Sequence[QueueView], work: Sequence[float],
                      theta: int) -> int | None:
  """History-aware SELECTINSTANCE: least predicted outstanding tokens.

  Used with a longest-predicted-first queue this is LPT list scheduling:
  the longest samples land on the least loaded instances, i.e. in small
  batches, where a decode step is fastest. Theta still bounds pending.
  """
  best, best_key = None, None
  for i, (v, w) in enumerate(zip(views, work)):
    if v.pending >= theta:
      continue
    key = (w, v.pending, i)
    if best_key is None or key < best_key:
      best, best_key = i, key
  return best
