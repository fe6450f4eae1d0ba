"""Long-tail execution on one mesh: engines on replica blocks, a controller.

RL response lengths are long-tailed: near the end of a rollout a few samples
keep every replica stepping. Two pieces execute the decisions of
`rlhf_jax/sched` (the same functions the row simulator `sim/rows.py` runs):
  - `EngineSet` (`engine/engine_set.py`): an engine on each prefix block
    of the rollout layout's replicas, the same slots, group entries and
    pages per replica.
  - `TailController`: a `Driver` controller that
      * puts each prompt's group onto the replica with the least predicted
        work admitted ("length"), or with `assignment="grouped"` (RLHFless)
        onto its own replica's run of similar predicted lengths
        (`sched.assignment.replica_of`), among those with room, and
        releases the block's last replica once it finishes or its finished
        fraction reaches tau (`sched.tail.release_due`: its groups move to
        the others, the local cut);
      * consolidates (RLHFuse R_t, `sched.tail.consolidation_due`): onto
        the smallest block whose replicas hold the unfinished groups, their
        samples and pages (`sched.tail.paged_consolidation_block`);
        `Driver.consolidate` keeps the block's groups where they are and
        moves the others there: their pages (`migration="kv"`), or a
        re-prefill of the prompt and a recompute of the samples
        ("reprefill"; "auto": groups whose samples hold at most
        `reprefill_max_tokens` tokens, `reprefill_choice`); the freed
        replicas are free for other work;
      * reports what it frees to that `work` (`FreedReplicaWork`, e.g. the
        RL job's fused forward passes): each finished sample,
        each decode step, each consolidation, the decode's end; and the
        replicas and layout that are free;
      * records per-replica rollout / idle / repartition spans, and the
        spans the work marks on the replicas it ran on.
The rollout that runs prompt batches through these is `rollout/local.py`.
"""

from __future__ import annotations

from typing import Protocol

import jax
from absl import logging

from rlhf_jax.engine.controller import Controller
from rlhf_jax.samples import Sample
from rlhf_jax.engine.engine_set import EngineSet
from rlhf_jax.parallel import submesh
from rlhf_jax.parallel.layout import Layout
from rlhf_jax.sched import assignment
from rlhf_jax.sched import tail as tail_rules
from rlhf_jax.timeline import Timeline, device_group


class FreedReplicaWork(Protocol):
  """Work on the replicas the tail frees; the controller calls it."""

  def finished(self, sample: Sample) -> None:
    """A sample finished."""

  def after_step(self, tail: "TailController", now: float) -> None:
    """A decode step was dispatched (the host is free until it ends)."""

  def switched(self, tail: "TailController") -> None:
    """The tail moved to fewer replicas (`tail.free_replicas()`)."""

  def flush(self, tail: "TailController") -> None:
    """The decode is over: every replica is free."""

  def stats(self) -> dict:
    """Its rollout/ metrics."""


class TailController(Controller):
  """Group placement, consolidation, the freed replicas and per-replica
  spans.

  `predict(request)` gives a request's predicted response length (the
  length history); `m` is the block the driver starts on. Counts of what
  it did are in `stats()`.
  """

  window = 1  # Step times, phases, the work and the switch check: per step.

  def __init__(self, engines: EngineSet, tail, predict, *,
               full_params, m: int, timeline: Timeline, step: int = 0,
               work: FreedReplicaWork | None = None):
    # `tail`: the `rollout.long_tail` section (`config.sections.LongTail`).
    self.o, self.tail, self.predict = engines, tail, predict
    self.full_params, self.m, self.step = full_params, m, step
    self.timeline, self.work = timeline, work
    self.admitted = 0          # Samples admitted since the driver started.
    self.moves = self.reprefilled = self.moved_bytes = 0
    self.move_s = 0.0
    self.consolidations = 0
    self.idle_s = 0.0
    self.step_times: dict[int, list[float]] = {}
    self._last = None
    devs = submesh.devices_of(engines.layout)
    per = len(devs) // engines.replicas
    self.groups = [device_group(f"replica{r}", devs[r * per:(r + 1) * per])
                   for r in range(engines.replicas)]
    # Group count at which a consolidation had nothing to gain: asked
    # again only once fewer groups are left.
    self._no_gain = engines.engine().num_groups + 1
    # Open span per replica: decode replicas prefill from the start.
    self._phase = ["rollout" if r < m else "idle"
                   for r in range(engines.replicas)]
    self._since = [timeline.now()] * engines.replicas
    self._decoded = False  # Set by `flush`: every replica is free.
    self.load = [0.0] * engines.replicas  # Predicted tokens admitted.
    self.assigned = [0] * engines.replicas  # Samples admitted.
    self.releases = 0
    self._replica_of: dict[int, int] | None = None  # id(request) -> replica

  # -------------------------------------------------------- accounting
  def _set_phase(self, r: int, phase: str, now: float) -> None:
    if self._phase[r] != phase:
      if now > self._since[r]:
        self.timeline.add(self.groups[r], self._phase[r], self._since[r],
                          now, self.step)
      if self._phase[r] == "idle":
        self.idle_s += now - self._since[r]
      self._phase[r], self._since[r] = phase, now

  def after_step(self, driver):
    now = self.timeline.now()
    if self._last is not None:
      self.step_times.setdefault(self.m, []).append(now - self._last)
    self._last = now
    busy = self._busy_replicas(driver)
    for r in range(self.m):
      self._set_phase(r, "rollout" if r in busy else "idle", now)
    if self.work is not None:
      self.work.after_step(self, now)

  def _busy_replicas(self, driver) -> set[int]:
    return {driver.engine.replica_of(s) for s in driver.live}

  def close_spans(self):
    now = self.timeline.now()
    for r in range(self.o.replicas):
      self._set_phase(r, "done", now)

  def stats(self) -> dict:
    return {"rollout/consolidated_replicas": self.m,
            "rollout/tail_moves": self.moves,
            "rollout/reprefilled": self.reprefilled,
            "rollout/moved_bytes": self.moved_bytes,
            "perf/move_s": self.move_s,
            "rollout/consolidations": self.consolidations,
            "rollout/releases": self.releases,
            **(self.work.stats() if self.work is not None else {})}

  # ---------------------------------------------------------- assignment
  def pick(self, driver, room_for):
    if self.tail.assignment != "grouped":
      return super().pick(driver, room_for)
    replica_of = self._grouped_replicas(driver)
    for i, request in enumerate(driver.pending):  # Its own replica only.
      r = replica_of[id(request)]
      if r in room_for(request):
        self._count(request, r)
        return i, r
    return None

  def choose_replica(self, driver, replicas, request):
    if self.tail.assignment == "length":
      r = min(replicas, key=lambda r: (self.load[r], -driver.pool.free_in(r),
                                       r))
    else:
      r = super().choose_replica(driver, replicas, request)
    self._count(request, r)
    return r

  def _grouped_replicas(self, driver) -> dict[int, int]:
    """RLHFless: id(request) -> its replica (`assignment.replica_of`),
    fixed at the first admission, when every request is pending."""
    if self._replica_of is None:
      reqs = list(driver.pending)
      self._replica_of = dict(zip(map(id, reqs), assignment.replica_of(
          [self.predict(r) for r in reqs], self.m)))
    return self._replica_of

  def _count(self, request, r: int) -> None:
    self.load[r] += self.predict(request) * request.num_samples
    self.assigned[r] += request.num_samples
    self.admitted += request.num_samples

  # ------------------------------------------------------ consolidation
  @staticmethod
  def _unfinished(driver) -> int:
    return len(driver.live) + sum(len(g.waiting)
                                  for g in driver.groups.values())

  def _block(self, driver, sizes) -> int:
    """The smallest of `sizes` whose replicas hold the unfinished groups
    (else the current block)."""
    eng = driver.engine
    D = eng.replicas
    return tail_rules.paged_consolidation_block(
        len(driver.groups), self._unfinished(driver),
        driver.pool.num_used + eng.max_own_pages,
        (eng.num_groups // D, eng.num_slots // D, eng.num_pages // D),
        sizes, self.m)

  def _release_due(self, driver) -> bool:
    if self._replica_of is None:
      return False
    last = self.m - 1
    unfinished = (
        sum(it.group.replica == last for it in driver.live.values()) +
        sum(len(g.waiting) for g in driver.groups.values()
            if g.replica == last))
    return tail_rules.release_due(
        unfinished, replicas=self.m,
        queued=sum(self._replica_of[id(r)] == last for r in driver.pending),
        assigned=self.assigned[last], tau=self.tail.cut_tau,
        fits=self._block(driver, [last]) == last)

  def wants_switch(self, driver):
    return self._release_due(driver) or tail_rules.consolidation_due(
        self._unfinished(driver), self.admitted, self.tail.consolidate_below,
        pending=bool(driver.pending), replicas=self.m,
        live_rows=len(driver.groups), no_gain=self._no_gain)

  def switch(self, driver):
    if self._release_due(driver):
      self.releases += 1
      return self._move(driver, self.m - 1, f"release of replica "
                        f"{self.m - 1}", release=True)
    m = self._block(driver, self.o.sizes)
    if m >= self.m:  # Nothing to gain yet: ask again with fewer groups.
      self._no_gain = len(driver.groups)
      return
    self._move(driver, m, f"{len(driver.groups)} unfinished groups")

  def _move(self, driver, m: int, what: str, release: bool = False):
    """The run continues on replicas [0, m) (`Driver.consolidate`)."""
    o, t = self.o, self.tail
    now = self.timeline.now()

    def kv_groups(gone):  # `migration`: which groups move their pages.
      tokens = {g.order: sum(len(it.tokens) for it in driver.live.values()
                             if it.group is g) for g in gone}
      redo = set(tail_rules.reprefill_choice(tokens, t.migration,
                                             t.reprefill_max_tokens))
      return [g for g in gone if g.order not in redo]

    moved, redo, nbytes = driver.consolidate(
        o.engine(m), o.params_for(self.full_params, m), kv_groups)
    self.moves += moved + redo
    self.reprefilled += redo
    self.moved_bytes += nbytes
    self._switched(now, driver.state, m, what, moved + redo, redo,
                   release=release)

  def _switched(self, now, state, m, what, moved, reprefilled, *,
                release=False):
    """Accounting of a consolidation (or release) that started at `now`."""
    jax.block_until_ready(state)
    end = self.timeline.now()
    self.move_s += end - now
    self.consolidations += not release
    for r in range(self.o.replicas):
      self._set_phase(r, "repartition", now)
    for r in range(self.o.replicas):
      self._set_phase(r, "idle", end)
    logging.info(
        "long-tail consolidation: %s, %d -> %d replicas, %d samples moved "
        "(%d re-prefilled), %.3fs", what, self.m, m, moved, reprefilled,
        end - now)
    self.m = m
    self._last = None
    if self.work is not None:  # It uses the freed replicas from the next
      self.work.switched(self)  # `after_step`, once a decode step is out.

  # ------------------------------------------------------ freed replicas
  @property
  def freed(self) -> bool:
    """Whether the tail decodes on fewer replicas than it has."""
    return self.m < self.o.replicas

  @property
  def decoded(self) -> bool:
    """Whether the decode is over (`flush`): every replica is free."""
    return self._decoded

  def free_layout(self) -> Layout:
    """The freed replicas; every replica before consolidation and once
    the decode is over."""
    if self._decoded:
      return self.o.layout
    rest = self.o.parts(self.m)[1]
    return rest if rest is not None else self.o.parts(self.m)[0]

  def free_replicas(self) -> list[int]:
    if not self.freed or self._decoded:
      return list(range(self.o.replicas))
    return list(range(self.m, self.o.replicas))

  def kv_bytes_per_device(self) -> int:
    """The KV cache's bytes a device, which the freed replicas hold free."""
    return self.o.kv_bytes_per_device()

  def mark(self, replicas, phase: str, start: float, end: float) -> None:
    """A span of `phase` (the work's) on each of `replicas` not decoding."""
    for r in replicas:
      if self._phase[r] != "rollout":
        self._set_phase(r, phase, max(start, self._since[r]))
        self._set_phase(r, "idle", max(end, self._since[r]))

  def finished(self, sample):
    """A sample finished: the work's, if any."""
    if self.work is not None:
      self.work.finished(sample)

  def flush(self) -> None:
    """The decode is over: the work finishes on every replica."""
    self._decoded = True
    if self.work is not None:
      self.work.flush(self)
