"""Long-tail-aware rollout on one mesh: fusion, consolidation, assignment.

RL response lengths are long-tailed: near the end of a rollout a few samples
keep every replica stepping. `LongTailRollout` runs the continuous-batching
`Driver` over engines on prefix blocks of the rollout layout's replicas
(`parallel/submesh.split`), with the decisions of `rlhf_jax/sched` (the
same code the simulator runs):
  - assignment (RLHFless): requests start longest-predicted first (per-prompt
    EWMA `LengthHistory`), each into a free row of the replica with the
    least predicted outstanding work;
  - replica count (RLHFless lambda): "cost" picks how many replicas decode
    from predicted lengths and measured step times
    (`sched.continuous.choose_replicas`); the rest score from the start;
  - consolidation (RLHFuse R_t): once nothing is pending and the unfinished
    fraction of samples is below `consolidate_below`, the live rows move onto
    the smallest prefix block of replicas that holds them (KV moved, or the
    samples re-prefilled: `migrate.py`), and the freed replicas score;
  - fusion (RLHFuse inter-stage): finished samples are scored in chunks as
    they finish (`scorer.score(samples, layout)`, dispatched asynchronously
    on the scoring devices) instead of after the whole batch.
Every engine has the same rows per replica, so decode runs the same
per-device program wherever a row is: tokens equal the plain run's.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Protocol, Sequence

import jax
import numpy as np
from absl import logging

from rlhf_jax.engine import migrate
from rlhf_jax.engine.driver import Controller, Driver, Request, Sample
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.parallel import submesh
from rlhf_jax.parallel.layout import Layout
from rlhf_jax.sched import continuous
from rlhf_jax.sched.length_history import LengthHistory
from rlhf_jax.timeline import Timeline, device_group


@dataclasses.dataclass(frozen=True)
class TailConfig:
  """Switches and knobs of the long-tail policies."""
  admission: str = "continuous"    # "static" | "continuous"
  assignment: str = "length"       # "fifo" | "length"
  consolidate_below: float = 0.2   # R_t (unfinished fraction); 0: never
  migration: str = "kv"            # "kv" | "reprefill" | "auto"
  reprefill_max_tokens: int = 64   # "auto": re-prefill rows this short
  fusion: bool = True              # score samples as they finish
  score_chunk: int = 8             # samples per scoring dispatch
  replicas: str | int = "all"      # "all" | "cost" | a count
  cost_lambda: float = 0.7         # weight of latency vs device-seconds
  default_length: float = 0.0      # prediction for unseen prompts (0: M/2)

  def validate(self) -> None:
    checks = {
        "admission": self.admission in ("static", "continuous"),
        "assignment": self.assignment in ("fifo", "length"),
        "consolidate_below": 0.0 <= self.consolidate_below <= 1.0,
        "migration": self.migration in ("kv", "reprefill", "auto"),
        "score_chunk": self.score_chunk >= 1,
        "replicas": self.replicas in ("all", "cost") or (
            isinstance(self.replicas, int) and self.replicas >= 1),
        "cost_lambda": 0.0 <= self.cost_lambda <= 1.0,
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
      raise ValueError(f"rollout.long_tail: invalid {bad[0]}="
                       f"{getattr(self, bad[0])!r}")


class Scorer(Protocol):
  def score(self, samples: Sequence[Sample], layout: Layout) -> Any:
    """Dispatches scoring of `samples` on `layout`; returns device arrays."""


@dataclasses.dataclass
class RolloutResult:
  samples: list[Sample]
  scores: dict          # sample key -> the scorer's output row (host)
  stats: dict


def _powers_of_two_divisors(n: int) -> list[int]:
  return [m for m in (2 ** k for k in range(n.bit_length())) if n % m == 0]


class LongTailRollout:
  """Engines on prefix blocks of a rollout layout, driven by the policies."""

  def __init__(self, cfg, graphdef, layout: Layout, *, rows_per_replica: int,
               samples_per_row: int, prefill_buckets: Sequence[int],
               sampling: SamplingParams, tail: TailConfig = TailConfig(),
               history: LengthHistory | None = None,
               timeline: Timeline | None = None, attention_impl="auto"):
    tail.validate()
    self.layout, self.tail = layout, tail
    self.replicas = layout.mesh.shape["data"]
    self.rows_per_replica = rows_per_replica
    self.history = history if history is not None else LengthHistory(0.5)
    self.timeline = timeline if timeline is not None else Timeline(None)
    self.sampling = sampling
    self._engine_args = dict(
        samples_per_row=samples_per_row, prefill_buckets=prefill_buckets,
        sampling=sampling, attention_impl=attention_impl)
    self._cfg, self._graphdef = cfg, graphdef
    self.sizes = _powers_of_two_divisors(self.replicas)
    self._engines: dict[int, Engine] = {}
    self.step_s: dict[int, float] = {}   # measured decode step per size
    if isinstance(tail.replicas, int) and tail.replicas not in self.sizes:
      raise ValueError(f"rollout.long_tail.replicas={tail.replicas} must be "
                       f"a power-of-two divisor of {self.replicas} replicas")

  # ------------------------------------------------------------- engines
  def parts(self, m: int) -> tuple[Layout, Layout | None]:
    """(rollout layout of replicas [0, m), layout of the rest or None)."""
    if m == self.replicas:
      return self.layout, None
    return submesh.split(self.layout, [m, self.replicas - m])

  def engine(self, m: int) -> Engine:
    if m not in self._engines:
      self._engines[m] = Engine(
          self._cfg, self._graphdef, self.parts(m)[0],
          num_rows=self.rows_per_replica * m, **self._engine_args)
    return self._engines[m]

  def params_for(self, params, m: int):
    """`params` (full rollout layout) viewed on replicas [0, m): no copy.

    Every replica holds the same shards, so the sub-layout's arrays are
    built from the buffers already on its devices.
    """
    if m == self.replicas:
      return params
    shardings = self.engine(m).param_shardings

    def view(x, sharding):
      by_device = {s.device: s.data for s in x.addressable_shards}
      return jax.make_array_from_single_device_arrays(
          x.shape, sharding,
          [by_device[d] for d in sharding.addressable_devices_indices_map(
              x.shape)])

    return jax.tree.map(view, params, shardings)

  # ---------------------------------------------------------- prediction
  def predicted(self, req: Request) -> float:
    default = self.tail.default_length or self.sampling.max_new_tokens / 2
    return self.history.predict(req.prompt_id, default)

  def choose_replicas(self, requests: Sequence[Request]) -> tuple[int, dict]:
    """The decode replica count for this rollout and the decision inputs."""
    t = self.tail
    if t.replicas == "all":
      return self.replicas, {}
    if isinstance(t.replicas, int):
      return t.replicas, {}
    lengths = [[self.predicted(r)] * r.num_samples for r in requests]
    step = {m: self.step_s.get(m) for m in self.sizes}
    if any(v is None for v in step.values()):
      return self.replicas, {"unmeasured": True}  # First rollout: measure.
    return continuous.choose_replicas(
        lengths, self.sizes, self.rows_per_replica, step, t.cost_lambda)

  # ----------------------------------------------------------------- run
  def run(self, params, requests: Sequence[Request],
          scorer: Scorer | None = None, step: int = 0,
          weight_version: int = 0) -> RolloutResult:
    """Samples every request (and scores it when a scorer is given).

    Args:
      params: the weights on the full rollout layout.
      requests: the prompts.
      scorer: scores chunks of finished samples (see `Scorer`).
      step: the RL step (timeline spans).
      weight_version: stamped on the samples.
    """
    t = self.tail
    requests = list(requests)
    if t.assignment == "length":
      requests.sort(key=lambda r: (-self.predicted(r), r.prompt_id))
    m0, decision = self.choose_replicas(requests)
    logging.info("long-tail rollout step %d: %d decode replicas of %d; "
                 "inputs %s", step, m0, self.replicas, decision)
    ctl = _TailController(self, m0, scorer, step)
    driver = Driver(self.engine(m0), self.params_for(params, m0),
                    weight_version=weight_version)
    ctl.full_params = params
    samples = []
    t0 = time.perf_counter()
    for sample in driver.run(requests, admission=t.admission, controller=ctl):
      samples.append(sample)
      ctl.finished(driver, sample)
    ctl.flush(driver)
    scores = ctl.collect()
    wall = time.perf_counter() - t0
    ctl.close_spans(wall)
    for m, times in ctl.step_times.items():
      if times:
        self.step_s[m] = statistics.median(times)
    predicted = {r.prompt_id: self.predicted(r) for r in requests}
    by_prompt: dict[int, list[int]] = {}
    for s in samples:
      by_prompt.setdefault(s.prompt_id, []).append(len(s.tokens))
    errors = [abs(statistics.fmean(v) - predicted[p]) /
              max(1.0, statistics.fmean(v)) for p, v in by_prompt.items()]
    for p, v in by_prompt.items():
      self.history.update(p, v)
    idle = ctl.idle_s
    stats = {
        "rollout/wall_s": wall,
        "rollout/steps": driver.stats.steps,
        "rollout/replicas": m0,
        "rollout/consolidated_replicas": ctl.m,
        "rollout/tail_moves": ctl.moves,
        "rollout/reprefilled": ctl.reprefilled,
        "rollout/moved_bytes": ctl.moved_bytes,
        "rollout/move_s": ctl.move_s,
        "rollout/consolidations": ctl.consolidations,
        "rollout/idle_s": idle / self.replicas,
        "rollout/idle_fraction": idle / (self.replicas * wall) if wall else 0.,
        "rollout/scoring_chunks": ctl.chunks,
        "sched/predicted_vs_actual_len": statistics.fmean(errors)
                                         if errors else 0.0,
        "sched/decision": decision,
    }
    return RolloutResult(samples, scores, stats)


class _TailController(Controller):
  """Row choice, per-replica idle accounting, consolidation and fusion."""

  def __init__(self, owner: LongTailRollout, m: int, scorer, step: int):
    self.o, self.m, self.scorer, self.step = owner, m, scorer, step
    self.total = None
    self.done = 0
    self.moves = self.reprefilled = self.moved_bytes = self.chunks = 0
    self.move_s = 0.0
    self.consolidations = 0
    self.idle_s = 0.0
    self.buffer: list[Sample] = []
    self.pending_scores: list[tuple[list[Sample], Any, float, str]] = []
    self.scores: dict = {}
    self.step_times: dict[int, list[float]] = {}
    self.full_params = None
    self._last = None
    tl = owner.timeline
    devs = submesh.devices_of(owner.layout)
    per = len(devs) // owner.replicas
    self.groups = [device_group(f"replica{r}", devs[r * per:(r + 1) * per])
                   for r in range(owner.replicas)]
    self._no_gain_rows = owner.replicas * owner.rows_per_replica + 1
    # Open span per replica: decode replicas prefill from the start.
    self._phase = ["rollout" if r < m else "idle"
                   for r in range(owner.replicas)]
    self._since = [tl.now()] * owner.replicas
    self._score_free_at = tl.now()
    self.load = [0.0] * owner.replicas        # predicted outstanding tokens
    self.row_load: dict[int, float] = {}

  # ---------------------------------------------------------- assignment
  def choose_row(self, driver, free_rows, request):
    rpr = self.o.rows_per_replica
    if self.o.tail.assignment == "length":
      row = min(free_rows, key=lambda r: (self.load[r // rpr], r))
    else:
      row = free_rows[0]
    work = self.o.predicted(request) * request.num_samples
    self.load[row // rpr] += work
    self.row_load[row] = work
    if self.total is None:
      self.total = sum(r.num_samples for r in driver.pending) + \
          request.num_samples
    return row

  # -------------------------------------------------------- accounting
  def _set_phase(self, r: int, phase: str, now: float) -> None:
    if self._phase[r] != phase:
      if now > self._since[r]:
        self.o.timeline.add(self.groups[r], self._phase[r], self._since[r],
                            now, self.step)
      if self._phase[r] == "idle":
        self.idle_s += now - self._since[r]
      self._phase[r], self._since[r] = phase, now

  def after_step(self, driver):
    now = self.o.timeline.now()
    if self._last is not None:
      self.step_times.setdefault(self.m, []).append(now - self._last)
    self._last = now
    rpr, G = self.o.rows_per_replica, driver.engine.samples_per_row
    busy = {s // G // rpr for s in driver.live}
    for r in range(self.m):
      self._set_phase(r, "rollout" if r in busy else "idle", now)
    self._poll_scores(now)

  def close_spans(self, wall):
    del wall
    now = self.o.timeline.now()
    for r in range(self.o.replicas):
      self._set_phase(r, "done", now)

  # ------------------------------------------------------ consolidation
  def wants_switch(self, driver):
    t = self.o.tail
    if t.consolidate_below <= 0 or driver.pending or self.m == 1:
      return False
    total = self.total or 1
    if len(driver.live) / total >= t.consolidate_below:
      return False
    G = driver.engine.samples_per_row
    return len({s // G for s in driver.live}) < self._no_gain_rows

  def _target(self, n_rows: int) -> int:
    rpr = self.o.rows_per_replica
    fits = [m for m in self.o.sizes if m * rpr >= n_rows]
    return min(fits) if fits else self.m

  def switch(self, driver):
    t, o = self.o.tail, self.o
    G = driver.engine.samples_per_row
    live_rows = sorted({s // G for s in driver.live})
    if t.migration == "kv":
      redo: list[int] = []
    elif t.migration == "reprefill":
      redo = live_rows
    else:  # "auto": recompute short rows, move long ones.
      redo = [r for r in live_rows if sum(
          len(it.tokens) for s, it in driver.live.items() if s // G == r)
              <= t.reprefill_max_tokens]
    keep = [r for r in live_rows if r not in redo]
    n_redo = sum(1 for s in driver.live if s // G in redo)
    m = self._target(len(keep) + n_redo)
    if m >= self.m:  # Nothing to gain yet: ask again with fewer rows.
      self._no_gain_rows = len(live_rows)
      return
    now = o.timeline.now()
    src, dst = driver.engine, o.engine(m)
    params = o.params_for(self.full_params, m)
    cap = dst.num_rows
    # Rows already on the survivors keep their index; others fill free rows.
    row_map = {r: r for r in keep if r < cap}
    free = [r for r in range(cap) if r not in row_map.values()]
    for r in keep:
      if r not in row_map:
        row_map[r] = free.pop(0)
    redo_samples = [(s, it) for s, it in sorted(driver.live.items())
                    if s // G in redo]
    redo_rows = [free.pop(0) for _ in redo_samples]
    old_live = driver.live
    state = migrate.move_rows(src, driver.state, dst, row_map)
    if redo_samples:
      state = migrate.reprefill_rows(
          dst, params, state,
          [(it.request, it.sample_idx, it.tokens) for _, it in redo_samples],
          redo_rows)
    live = {}
    for s, it in old_live.items():
      if s // G in row_map:
        live[row_map[s // G] * G + s % G] = it
    for (s, it), row in zip(redo_samples, redo_rows):
      live[row * G] = it
      dst._row_slots[row] = {row * G}  # pylint: disable=protected-access
    driver.engine, driver.params, driver.state = dst, params, state
    driver.live = live
    # Moves: live samples that leave a freed replica (KV or re-prefill).
    off = [r for r in row_map if r // o.rows_per_replica >= m]
    self.moves += sum(1 for s in old_live if s // G in off)
    self.moves += len(redo_samples)
    self.reprefilled += len(redo_samples)
    self.moved_bytes += migrate.row_bytes(src) * len(off)
    jax.block_until_ready(state)
    end = o.timeline.now()
    self.move_s += end - now
    self.consolidations += 1
    for r in range(o.replicas):
      self._set_phase(r, "repartition", now)
    for r in range(o.replicas):
      self._set_phase(r, "idle", end)
    logging.info(
        "long-tail consolidation: %d live rows, %d -> %d replicas, %d samples "
        "moved (%d re-prefilled), %.3fs", len(live_rows), self.m, m,
        sum(1 for s in old_live if s // G in off) + len(redo_samples),
        len(redo_samples), end - now)
    self.m = m
    self._last = None
    # Row loads follow their rows (for the record; no more admissions).
    self.load = [0.0] * o.replicas

  # ------------------------------------------------------------ fusion
  def scoring_layout(self) -> Layout:
    rest = self.o.parts(self.m)[1]
    return rest if rest is not None else self.o.parts(self.m)[0]

  def scoring_replicas(self) -> list[int]:
    if self.m == self.o.replicas:
      return list(range(self.o.replicas))
    return list(range(self.m, self.o.replicas))

  def finished(self, driver, sample):
    self.done += 1
    if self.scorer is None:
      return
    self.buffer.append(sample)
    t = self.o.tail
    if t.fusion and len(self.buffer) >= t.score_chunk:
      self._dispatch(self.buffer[:t.score_chunk])
      del self.buffer[:t.score_chunk]

  def _dispatch(self, chunk):
    layout = self.scoring_layout()
    start = max(self.o.timeline.now(), self._score_free_at)
    out = self.scorer.score(chunk, layout)
    self.pending_scores.append((chunk, out, start, tuple(
        self.scoring_replicas())))
    self.chunks += 1

  def _poll_scores(self, now, block=False):
    keep = []
    for chunk, out, start, reps in self.pending_scores:
      leaves = jax.tree.leaves(out)
      if block:
        jax.block_until_ready(out)
        now = self.o.timeline.now()
      elif not all(getattr(x, "is_ready", lambda: True)() for x in leaves):
        keep.append((chunk, out, start, reps))
        continue
      host = jax.tree.map(np.asarray, out)
      for i, s in enumerate(chunk):
        self.scores[s.key] = jax.tree.map(lambda a, i=i: a[i], host)
      end = max(now, start)
      for r in reps:  # Replicas not decoding show the scoring span.
        if self._phase[r] != "rollout":
          self._set_phase(r, "scoring", max(start, self._since[r]))
          self._set_phase(r, "idle", max(end, self._since[r]))
      self._score_free_at = end
    self.pending_scores = keep

  def flush(self, driver):
    del driver
    if self.scorer is None:
      return
    if self.buffer:
      size = self.o.tail.score_chunk
      for i in range(0, len(self.buffer), size):
        self._dispatch(self.buffer[i:i + size])
      self.buffer = []
    self._poll_scores(self.o.timeline.now(), block=True)

  def collect(self) -> dict:
    return self.scores
