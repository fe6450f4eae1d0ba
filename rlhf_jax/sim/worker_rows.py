"""Row-level replay of the elastic rollout: manager, workers, spot trace.

`sim/rows.py` replays one engine's driver loop; this replays what
`benchmarks/elastic.py` runs live: a `workers/manager.RolloutManager`
feeding `RolloutWorker`s while a spot trace (`sim/availability.SpotEvent`s,
as `workers/replay.AvailabilityReplayer` applies them) adds and preempts
workers. The workers run the paged engine (`engine/driver.Driver`);
this models them at row granularity: a worker holds
`rows_per_worker` rows (its engine's group entries) of G slots each, a
prompt's group takes a free row whole and frees it once all its samples
end. That is exact for a paged worker with one group entry per row
(`num_groups` = rows, `num_slots` = rows x G), pages for every slot (no
pool preemption) and one decode step a call (`decode_window=1`), as the
benchmark and tests/sim/test_sim_worker_rows.py build them; with more group
entries than rows (the engine's default, 2 S / G) a new group starts as
soon as one slot frees, which this does not model. Exact and
deterministic, in simulated seconds, one poll round at a time as in
`RolloutManager.run`:
  - Round start: every event whose time has come is applied: `add` joins a
    worker (it pulls weights first, `pull_s`), `remove` kills it. The clock
    is the simulated seconds since the first round ("seconds": a
    prediction from the trace's times) or the round index ("rounds": the
    events at the rounds a live run applied them, a diagnostic).
  - Dispatch: the queue's head goes to the worker with the shortest pending
    queue below `theta` (`sched.offload.select_instance`, on the running
    counts of the last poll), until none qualifies.
  - Poll: each live worker runs up to `poll_steps` driver iterations while
    it has work (`Driver.step`): admit pending requests into free
    rows (lowest first; prefilled `prefill_batch` prompts a call,
    `prefill_s` of the bucket of a call's longest prompt; the prefill gives
    the first token), one decode step (`step_s` + `sample_s` per live
    sample: the paged engine runs the listed live slots, and the host reads
    each one's token), read the previous step's tokens. A sample of L
    tokens admitted at iteration a has streamed k - a + 1 tokens after
    iteration k and is read finished at iteration a + L - 1; a row frees
    once all its samples end. Each poll adds `poll_s` (the call and the
    manager's handling). In-process workers poll one after the other, so a
    round costs the sum of its polls; `parallel=True` (Ray actors on their
    own machines) the max.
  - Then balancing (`sched.offload.balance_moves`; its self-moves, src ==
    dst, are skipped as the manager skips them): a worker with nothing
    pending takes the newest pending request of the busiest. With
    `plateau=B`, once no worker has a request pending, an idle one takes
    the running samples above B of the busiest (`RolloutWorker.
    take_running` on the paged engine, `sched.offload.samples_to_cut`):
    single samples, the most budget left first, at most the destination's
    rows (group entries), each continued on it as its own request (prompt
    + tokens so far, appended to its pending queue in key order, as
    `Driver.cut` returns them). A cut sample leaves its row, which
    frees once none of its samples is left. The decode step in flight
    still has to be read, so a source left with no work runs one more,
    empty, iteration (no decode step: no step cost). Then each preempted
    worker's unfinished samples go to the front of the queue: a started
    sample as a request of its own, prompt + the tokens its last poll
    streamed (re-prefilled, often in the longer bucket) with the budget
    left; a request none of whose samples started goes back whole.
  - With no worker alive the manager sleeps `GAP_SLEEP_S` per round until
    a join, or gives up after `wait_for_workers_s` (at once if the trace
    holds no more joins).
With the "rounds" clock the step counts per worker, rounds, migrations,
running moves and re-prefill tokens equal a live run's, with or without
`plateau` (tests/sim/test_sim_worker_rows.py); with "seconds" the events land
at the rounds the simulated costs put them in. Not modelled: stale-weight
resampling (one weight version), stop tokens (a sample runs its budget),
worker failures other than the trace's.
`simulate_driver` is the trainer-only baseline: one `Driver.run` of every
prompt on one engine (rows: all its group entries), with the same cost
model.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence

import numpy as np

from rlhf_jax.sched import offload
from rlhf_jax.sim.availability import SpotEvent

GAP_SLEEP_S = 0.01  # The manager's sleep while no worker is alive.


@dataclasses.dataclass(frozen=True)
class WorkerCosts:
  """Measured seconds of a worker's units and the manager's overheads."""
  step_s: float                   # a driver iteration's decode step
  prefill_s: Mapping[int, float]  # prefill + insert, per prompt bucket
  sample_s: float = 0.0           # + per live sample (the host's reads)
  poll_s: float = 0.0             # per poll: the call, streaming, manager
  pull_s: float = 0.0             # a joining worker's weight load


@dataclasses.dataclass
class WorkerSimResult:
  makespan: float            # seconds until the last sample is done
  rounds: int                # poll rounds (gap rounds included)
  polls: int                 # worker polls (calls of `poll`)
  steps: dict[str, int]      # driver iterations per worker
  produced: dict[str, int]   # samples finished per worker
  prefills: int
  preemptions: int
  migrated_samples: int
  kept_tokens: int           # tokens streamed before a cut, kept
  reprefill_tokens: int      # prompt + kept tokens of continuations
  balanced_requests: int
  worker_seconds: float
  applied: list[tuple[int, float, SpotEvent]]  # (round, seconds, event)
  moved_running: int = 0     # running samples moved (also migrated)


@dataclasses.dataclass
class _Request:
  prompt_id: int
  samples: tuple[int, ...]   # sample indices
  prompt_len: int            # prompt + tokens kept before a cut
  budgets: tuple[int, ...]   # tokens to generate, per sample


@dataclasses.dataclass
class _Worker:
  """One engine's driver loop (`engine/driver.Driver.step`), in rows."""
  num_rows: int
  costs: WorkerCosts
  buckets: Sequence[int]
  prefill_batch: int = 1
  pending: collections.deque = dataclasses.field(
      default_factory=collections.deque)
  rows: dict = dataclasses.field(default_factory=dict)  # row -> {key: (a, L)}
  k: int = 0                 # driver iterations so far
  prefills: int = 0
  alive: bool = True
  # A decode step in flight after rows were cut: the driver stays busy
  # until an iteration reads (and, for the cut rows, drops) it.
  unread: bool = False

  def busy(self) -> bool:
    return bool(self.pending or self.rows or self.unread)

  def live(self) -> dict[tuple[int, int], int]:
    """Unfinished admitted samples -> tokens read so far."""
    return {key: self.k - a + 1 for row in self.rows.values()
            for key, (a, _) in row.items()}

  def iterate(self) -> tuple[float, list[tuple[int, int]]]:
    """Admission, one decode step, reads: (seconds, samples finished)."""
    self.k += 1
    self.unread = False
    dt, c = 0.0, self.costs
    free = [r for r in range(self.num_rows) if r not in self.rows]
    admitted = []  # Prompt lengths, in admission order.
    while self.pending and free:
      req = self.pending.popleft()
      self.rows[free.pop(0)] = {(req.prompt_id, i): (self.k, b)
                                for i, b in zip(req.samples, req.budgets)}
      admitted.append(req.prompt_len)
      self.prefills += 1
    for i in range(0, len(admitted), self.prefill_batch):
      # One call: padded to the bucket of its longest prompt.
      n = max(admitted[i:i + self.prefill_batch])
      dt += c.prefill_s[next(b for b in self.buckets if n <= b)]
    if self.rows:  # `Driver.step` decodes only with samples live.
      dt += c.step_s + c.sample_s * sum(len(r) for r in self.rows.values())
    finished = []
    for r in list(self.rows):
      row = self.rows[r]
      ends = [key for key, (a, b) in row.items() if self.k >= a + b - 1]
      for key in ends:
        del row[key]
      finished += ends
      if not row:
        del self.rows[r]
    return dt, finished

  def take_running(self, n: int) -> list[tuple[int, int]]:
    """Cuts the samples `sched.offload.samples_to_cut` picks (as
    `RolloutWorker.take_running` on the paged engine: single samples, most
    budget left first, at most the destination's rows, which are this
    worker's); their keys in key order (`Driver.cut`). A row left
    with no sample frees."""
    left = {key: b - (self.k - a + 1) for row in self.rows.values()
            for key, (a, b) in row.items()}
    out = sorted(offload.samples_to_cut(left, n, self.num_rows))
    for r in list(self.rows):
      row = self.rows[r]
      for key in out:
        row.pop(key, None)
      if not row:
        del self.rows[r]
    self.unread = self.unread or bool(out)
    return out


def _original(lengths_PxG, prompt_lens_P, p) -> _Request:
  return _Request(p, tuple(range(lengths_PxG.shape[1])),
                  int(prompt_lens_P[p]),
                  tuple(int(x) for x in lengths_PxG[p]))


def simulate_driver(lengths_PxG, prompt_lens_P: Sequence[int],
                    costs: WorkerCosts, *, num_rows: int,
                    buckets: Sequence[int],
                    prefill_batch: int = 1) -> tuple[float, int]:
  """One `Driver.run` of every prompt (trainer-only) on an engine of
  `num_rows` rows (group entries): (seconds, steps)."""
  lengths = np.asarray(lengths_PxG, int)
  wk = _Worker(num_rows, costs, buckets, prefill_batch)
  wk.pending.extend(_original(lengths, prompt_lens_P, p)
                    for p in range(len(lengths)))
  t = 0.0
  while wk.busy():
    t += wk.iterate()[0]
  return t, wk.k


def simulate(lengths_PxG, prompt_lens_P: Sequence[int],
             events: Sequence[SpotEvent], costs: WorkerCosts, *,
             rows_per_worker: int, buckets: Sequence[int], theta: int,
             poll_steps: int, parallel: bool = False, clock: str = "seconds",
             wait_for_workers_s: float = 0.0,
             plateau: int | None = None,
             prefill_batch: int = 1) -> WorkerSimResult:
  """Simulates one elastic rollout of a length trace under a spot trace.

  Args:
    lengths_PxG: response lengths (tokens, >= 1) of G samples per prompt,
      the budgets the live requests carry (already capped).
    prompt_lens_P: prompt lengths (tokens).
    events: the availability trace.
    costs: measured unit costs.
    rows_per_worker: rows of one worker's engine: its group entries
      (prompts of up to G samples), G slots each.
    buckets: the engines' prefill buckets (ascending).
    theta: the manager's Theta (at most this many pending per worker).
    poll_steps: driver iterations per worker per poll.
    parallel: workers poll concurrently (a round costs the slowest poll,
      pulls the slowest pull) instead of one after the other.
    clock: "seconds" or "rounds": what event times are compared with.
    wait_for_workers_s: the manager's patience with no worker alive.
    plateau: the manager's batching plateau B (samples): running samples
      above it move to an idle worker; None: they never move.
    prefill_batch: prompts per prefill call (the engine's
      `prefill_batch`); a call costs its bucket's `prefill_s`.

  Returns:
    The rollout's `WorkerSimResult`.
  """
  if clock not in ("seconds", "rounds"):
    raise ValueError(f"clock must be 'seconds' or 'rounds', got {clock!r}")
  lengths = np.asarray(lengths_PxG, int)
  n_prompts, G = lengths.shape
  trace = sorted(events, key=lambda e: e.time)
  slots = rows_per_worker * G

  def original(p):
    return _original(lengths, prompt_lens_P, p)

  queue = collections.deque(original(p) for p in range(n_prompts))
  head: dict[tuple[int, int], int] = {}       # tokens kept before cuts
  where: dict[tuple[int, int], str] = {}      # worker of each sample
  streamed: dict[tuple[int, int], int] = {}   # tokens of the last poll
  done: set[tuple[int, int]] = set()
  workers: dict[str, _Worker] = {}            # every worker ever joined
  handles: list[str] = []                     # the manager's, in order
  pending: dict[str, int] = collections.defaultdict(int)
  running: dict[str, tuple[int, int]] = {}    # last poll: (live, slots)
  joined: dict[str, float] = {}              # alive since (seconds)
  pulled: set[str] = set()
  produced: collections.Counter = collections.Counter()
  n = dict(preemptions=0, migrated=0, kept=0, reprefill=0, balanced=0,
           moved=0)
  applied, t, rounds, polls, nxt, worker_s = [], 0.0, 0, 0, 0, 0.0
  gap_since = None

  def cut(key):  # Prompt + the tokens streamed so far, the budget left.
    kept = streamed.pop(key, 0)
    head[key] = head.get(key, 0) + kept
    p, i = key
    req = _Request(p, (i,), int(prompt_lens_P[p]) + head[key],
                   (int(lengths[p, i]) - head[key],))
    n["kept"] += kept
    n["migrated"] += 1
    n["reprefill"] += req.prompt_len
    return req

  def assign(req, w):
    workers[w].pending.append(req)
    for i in req.samples:
      where[req.prompt_id, i] = w
      streamed.pop((req.prompt_id, i), None)

  def poll(w):  # -> seconds; `Driver.step` up to poll_steps times.
    wk, dt = workers[w], costs.poll_s
    for _ in range(poll_steps):
      if not wk.busy():
        break
      step_s, finished = wk.iterate()
      dt += step_s
      for key in finished:
        done.add(key)
        streamed.pop(key, None)
        produced[w] += 1
    live = wk.live()
    streamed.update(live)
    pending[w] = len(wk.pending)
    running[w] = (len(live), slots)
    return dt

  def views(ids):
    return [offload.QueueView(pending[w], *running.get(w, (0, 1)))
            for w in ids]

  while len(done) < lengths.size:
    now = t if clock == "seconds" else rounds
    while nxt < len(trace) and trace[nxt].time <= now:
      e = trace[nxt]
      nxt += 1
      if e.kind == "add" and e.iid not in joined:
        workers[e.iid] = _Worker(rows_per_worker, costs, buckets,
                                 prefill_batch)
        handles.append(e.iid)
        joined[e.iid] = t
      elif e.kind == "remove" and e.iid in joined:
        workers[e.iid].alive = False
        worker_s += t - joined.pop(e.iid)
      else:
        continue
      applied.append((rounds, t, e))
    rounds += 1
    lost = [w for w in handles if not workers[w].alive]
    stale = [w for w in handles if workers[w].alive and w not in pulled]
    if stale:  # Joiners pull the weights before their first work.
      t += costs.pull_s * (1 if parallel else len(stale))
      pulled.update(stale)
    ids = [w for w in handles if workers[w].alive]
    while queue and ids:  # Join the shortest queue, at most theta pending.
      pick = offload.select_instance(views(ids), theta)
      if pick is None:
        break
      assign(queue.popleft(), ids[pick])
      pending[ids[pick]] += 1
    if not ids and not lost:
      gap_since = t if gap_since is None else gap_since
      if t - gap_since >= wait_for_workers_s or nxt == len(trace):
        raise RuntimeError(f"no worker alive for {t - gap_since:.2f}s")
      t += GAP_SLEEP_S
      continue
    gap_since = None
    polls += len(ids)
    poll_s = [poll(w) for w in ids] or [0.0]
    t += max(poll_s) if parallel else sum(poll_s)
    # Pending requests to starving workers; running samples above B.
    for src, dst, count, moving in offload.worker_moves(views(ids), plateau):
      s, d = ids[src], ids[dst]
      if moving:  # Cut on s, continued on d from the tokens so far.
        keys = workers[s].take_running(count)
        taken = [cut(key) for key in keys]
        # As the manager: s's running count drops until its next poll.
        running[s] = (max(running[s][0] - len(keys), 0), slots)
        n["moved"] += len(keys)
      else:
        taken = [workers[s].pending.pop()
                 for _ in range(min(count, len(workers[s].pending)))]
        pending[s] -= len(taken)
        n["balanced"] += len(taken)
      for req in taken:
        assign(req, d)
      pending[d] += len(taken)
    for w in lost:  # Unfinished samples continue elsewhere, queue first.
      keys = sorted(k for k, v in where.items() if v == w and k not in done)
      for key in keys:
        del where[key]
      for kind, item in offload.requeue_plan(
          keys, lambda k: k in streamed or bool(head.get(k)),
          lambda k: k[0], lambda p: G):
        queue.appendleft(cut(item) if kind == "continue" else original(item))
      pending.pop(w, None)
      n["preemptions"] += 1
      handles.remove(w)
  worker_s += sum(t - since for since in joined.values())
  return WorkerSimResult(
      t, rounds, polls, {w: wk.k for w, wk in workers.items()},
      dict(produced), sum(wk.prefills for wk in workers.values()),
      n["preemptions"], n["migrated"], n["kept"], n["reprefill"],
      n["balanced"], worker_s, applied, moved_running=n["moved"])
