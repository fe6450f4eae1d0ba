"""One synchronous RL step as a discrete-event simulation.

The rollout runs as events (a sample finishing on an instance, the seeding
window closing, a balancing poll, a spot instance appearing or vanishing, a
remote finishing its weight pull, the streaming trainer finishing a
micro-batch). Every decision is delegated to rlhf_jax.sched; this module only
executes them and keeps time. Tail policies live in step_tail.py and
elastic-pool events in step_elastic.py (mixins); scoring and training after
the rollout in step_phases.py.
"""

import collections
import heapq
import itertools
import math

from rlhf_jax.sched import actor_scaling, assignment, offload, placement
from rlhf_jax.sched import tail
from rlhf_jax.sched.named_policies import Policy
from rlhf_jax.sim import accounting, step_elastic, step_phases
from rlhf_jax.sched.cost_model import costs
from rlhf_jax.sim import step_tail
from rlhf_jax.sim.instance import DecodeInstance, Sample
from rlhf_jax.sched.cost_model.setting import Setting


class SampleLedger:
  """Counts completions; a lost or duplicated sample fails loudly."""

  def __init__(self, samples: list[Sample]):
    self.total = len(samples)
    self.finished = set()
    self.group_left = collections.Counter(s.prompt_id for s in samples)

  def finish(self, sample: Sample) -> bool:
    """Records a completion; returns True when its group is complete."""
    if sample.uid in self.finished:
      raise RuntimeError(f"sample {sample.uid} finished twice")
    if round(sample.generated) != sample.target_len:
      raise RuntimeError(f"sample {sample.uid} ended at {sample.generated} "
                         f"tokens, expected {sample.target_len}")
    self.finished.add(sample.uid)
    self.group_left[sample.prompt_id] -= 1
    return self.group_left[sample.prompt_id] == 0

  @property
  def done(self) -> bool:
    return len(self.finished) == self.total


class StepSimulator(step_tail.TailPolicies, step_elastic.ElasticEvents):
  """Simulates step `step` of `policy` on `setting`; see `run`."""

  def __init__(self, setting: Setting, policy: Policy, batch, run_state,
               step: int):
    self.s, self.p, self.state, self.step = setting, policy, run_state, step
    self.t0 = run_state.clock
    self.samples = [Sample(uid=i, prompt_id=p, index=j, prompt_len=pl,
                           target_len=max(1, n))
                    for i, (p, j, pl, n) in enumerate(batch.samples)]
    self.ledger = SampleLedger(self.samples)
    self.events, self.seq = [], itertools.count()
    self.queue = collections.deque()  # central queue (jsq dispatch)
    self.local, self.remote = [], {}
    self.finish_order = []  # (time, sample)
    self.counters = collections.Counter()
    self.cut_done = set()
    self.consolidated_at, self.freed_devices = None, 0
    self.trainer = step_phases.StreamingTrainer(setting, policy, len(
        self.samples))
    self.local_open = True

  # --- event plumbing -----------------------------------------------------

  def _push(self, t: float, kind: str, data=None):
    heapq.heappush(self.events, (t, next(self.seq), kind, data))

  def _schedule(self, inst: DecodeInstance):
    t = inst.next_event_time()
    if t < math.inf:
      self._push(t, "inst", (inst, inst.version))

  def _touch(self, inst: DecodeInstance, t: float):
    """Advances an instance to t, handling what finished on the way."""
    finished = inst.advance(t)
    for sample in finished:
      self._on_finished(inst, sample, sample.finish_time)

  # --- setup ---------------------------------------------------------------

  def _predictions(self) -> dict[int, float]:
    history = self.state.history
    known = [history.predict(p, 0.0) for p in self.ledger.group_left
             if history.known(p)]
    default = sum(known) / len(known) if known else 0.0
    return {p: history.predict(p, default) for p in self.ledger.group_left}

  def _mean_context(self, predicted: dict[int, float]) -> float:
    mean_pred = sum(predicted.values()) / max(len(predicted), 1)
    guess = mean_pred if mean_pred > 0 else self.s.max_response / 2
    prompt = sum(x.prompt_len for x in self.samples) / len(self.samples)
    return prompt + guess

  def _engine(self, iid, hw, tp, kind, start, ctx, price) -> DecodeInstance:
    inst = DecodeInstance(
        iid, self.s.actor, hw, tp, self.s.engine_slots(hw, tp, ctx),
        kind=kind, start_time=start,
        shared_prefix_decode=self.p.prefix_shared_decode,
        dedup_prefill=self.p.dedup_prefill, price_per_s=price)
    return inst

  def _setup_local(self, predicted, ctx):
    s, p = self.s, self.p
    # Colocated actors take the weights in the reshard; placed (serverless)
    # ones each wait for their own copy (`_sync_weights`).
    self.local_start = self.t0 + (
        costs.reshard_time(s.actor, s.hw, s.reserved_devices)
        if p.placement == "colocated" else 0.0)
    n = s.n_local_engines
    # The actors' predicted decode times (scaling and placement rank them).
    self.tpot = lambda b: costs.decode_step_time(s.actor, s.hw, s.rollout_tp,
                                                 b, b * ctx)
    self.group_lengths = collections.defaultdict(list)
    for x in self.samples:
      self.group_lengths[x.prompt_id].append(predicted[x.prompt_id] or ctx)
    if p.actor_lambda is not None:
      candidates = sorted({max(1, n >> k) for k in range(4)})
      n, _ = actor_scaling.choose_actor_count(
          self.group_lengths, candidates, self.tpot, p.actor_lambda,
          s.rollout_tp)
    price = s.rollout_tp * s.hw.ondemand_per_h / 3600
    self.local = [self._engine(f"local{i}", s.hw, s.rollout_tp, "local",
                               self.local_start, ctx, price)
                  for i in range(n)]

  def _setup_remote(self, ctx):
    p, pool = self.p, self.state.pool
    # Trace events between the previous step's end and now: an instance
    # preempted in between stops being billed when it vanished.
    for event in pool.apply_until(self.t0):
      if event.kind == "remove" and event.iid in pool.acquired:
        pool.release(event.iid, event.time)
    if not p.use_remote:
      return
    allowed = len(pool.present)
    if p.remote_cap and self.state.controller is not None:
      allowed = self.state.controller.allowed_instances(allowed)
    for iid in list(pool.acquired)[allowed:]:
      pool.release(iid, self.t0)
    for iid in pool.idle_present()[:max(0, allowed - len(pool.acquired))]:
      pool.acquire(iid, self.t0)
    self._pull_all(list(pool.acquired), self.t0, ctx)

  def _pull_all(self, iids, t, ctx):
    s = self.s
    if not iids:
      return
    nodes = max(1, s.reserved_devices // s.hw.devices_per_node)
    receivers = len(self.state.pool.acquired)
    sender = s.hw.nic_bw * nodes / max(receivers, 1)
    pull = costs.weight_pull_time(s.actor, sender, s.remote_hw.nic_bw,
                                  s.remote_hw.link_eff)
    ready = t + pull
    for iid in iids:
      inst = self._engine(iid, s.remote_hw, s.remote_devices, "remote", ready,
                          ctx, s.remote_price_per_s)
      inst._mark(t, ready, "weights")
      self.remote[iid] = inst
      self._push(ready, "ready", inst)

  def _assign_initial(self, predicted):
    groups = collections.defaultdict(list)
    for x in self.samples:
      groups[x.prompt_id].append(x)
    if self.p.dispatch == "static":
      order = list(groups)
      chunks = (assignment.length_grouped_split(predicted, len(self.local))
                if self.p.length_grouping else
                assignment.contiguous_split(order, len(self.local)))
      if self.p.placement != "colocated":
        self._sync_weights(chunks)
      for inst, chunk in zip(self.local, chunks):
        for g in chunk:
          for x in groups[g]:
            self._add(inst, x, self.local_start)
    else:
      order = (assignment.longest_first_order(predicted)
               if self.p.length_grouping else list(groups))
      self.queue.extend(x for g in order for x in groups[g])
      self._dispatch(self.local_start)

  def _sync_weights(self, chunks):
    """Each actor with work waits for the weights on the node
    `sched.placement` gives it by its predicted decode time (node 0: the
    learner's)."""
    s = self.s
    work = [actor_scaling.predicted_actor_time(
        [x for g in chunk for x in self.group_lengths[g]], self.tpot)
            for chunk in chunks]
    nodes = placement.actor_nodes(
        work, tp=s.rollout_tp, devices_per_node=s.hw.devices_per_node,
        nodes=-(-s.reserved_devices // s.hw.devices_per_node),
        placement=self.p.placement)
    for inst, chunk, node in zip(self.local, chunks, nodes):
      if chunk:
        inst.stall(self.t0, costs.weight_sync_time(
            s.actor, s.hw, s.rollout_tp, node), "weights")

  # --- dispatch and migration --------------------------------------------

  def _targets(self) -> list[DecodeInstance]:
    local = [i for i in self.local if i.alive and self.local_open]
    remote = [i for i in self.remote.values() if i.alive and i.ready]
    return local + remote

  def _dispatch(self, t: float):
    if self.p.dispatch != "jsq":
      return
    targets = self._targets()
    while self.queue and targets:
      views = [offload.QueueView(i.n_pending, i.n_running, i.max_slots)
               for i in targets]
      if self.p.length_grouping:
        k = offload.select_least_work(views, [i.pred_work for i in targets],
                                      self.p.theta)
      else:
        k = offload.select_instance(views, self.p.theta)
      if k is None:
        break
      inst = targets[k]
      self._touch(inst, t)
      self._add(inst, self.queue.popleft(), t)
      self._schedule(inst)
    if self.queue and not any(i.alive for i in self.remote.values()):
      self._fallback_local(t)

  def _add(self, inst, sample, t, kv_arrives=False):
    """Places a sample on an instance, tracking its predicted remaining work."""
    sample.pred_left = max(self.predicted[sample.prompt_id] - sample.generated,
                           0.0) + 1.0
    inst.pred_work += sample.pred_left
    inst.assigned += 1
    inst.add(sample, t, kv_arrives=kv_arrives)

  def _removed(self, inst, samples):
    for x in samples:
      inst.pred_work -= x.pred_left
    inst.assigned -= len(samples)

  def _fallback_local(self, t: float):
    """No remote capacity at all: reopen colocated rollout (veRL mode)."""
    if self.local_open or self.trainer.busy:
      return
    self.local_open = True
    self.counters["fallbacks"] += 1
    for inst in self.local:
      inst.alive = True
      inst.t = max(inst.t, t)
    self._dispatch(t)

  def _requeue(self, moved: list[Sample], t: float,
               preempted: bool = False):
    """Moved samples go to the front of the central queue, tokens kept
    (unless preempted under `preemption_recovery='recompute'`)."""
    for x in reversed(moved):
      if x.generated > 0:  # started: it resumes elsewhere (re-prefill).
        x.migrations += 1
        self.counters["migrations"] += 1
      if preempted and self.p.preemption_recovery == "recompute":
        x.generated = 0.0
      self.queue.appendleft(x)
    self._dispatch(t)

  def _move(self, src, dst, n, running, t):
    """Moves n samples; KV moves travel over RDMA and join on arrival."""
    self._touch(src, t)
    self._touch(dst, t)
    taken = src.take(n, running=running, now=t)
    self._removed(src, taken)
    for x in taken:
      kv = self.p.migration == "kv" and running
      if running:  # a queued sample that never started is not a migration.
        x.migrations += 1
        self.counters["migrations"] += 1
      if kv:
        tokens = x.prompt_len + x.generated
        dst.in_transit += 1
        self._push(t + costs.kv_migration_time(self.s.actor, src.hw, tokens),
                   "arrive", (dst, x))
      else:
        self._add(dst, x, t)
    self._schedule(src)
    self._schedule(dst)

  def _arrive(self, t, dst, sample):
    dst.in_transit -= 1
    self._touch(dst, t)
    self._add(dst, sample, t, kv_arrives=True)
    self._schedule(dst)

  # --- completions and tail policies ------------------------------------

  def _on_finished(self, inst, sample, t):
    inst.finished += 1
    inst.pred_work -= sample.pred_left
    self.finish_order.append((t, sample))
    self.trainer.sample_done(sample, t)
    if self.ledger.finish(sample):
      self.trainer.group_ready(
          [x for x in self._group(sample.prompt_id)], t)
    if self.p.tail_r_t and self.consolidated_at is None:
      unfinished = self.ledger.total - len(self.ledger.finished)
      if tail.should_consolidate(unfinished, self.ledger.total,
                                 self.p.tail_r_t):
        self._consolidate(t)
    if self.p.cut_tau:
      self._cut(t)

  def _group(self, prompt_id):
    if not hasattr(self, "_groups"):
      self._groups = collections.defaultdict(list)
      for x in self.samples:
        self._groups[x.prompt_id].append(x)
    return self._groups[prompt_id]

  # --- main loop -------------------------------------------------------------

  def run(self) -> accounting.StepResult:
    """Runs the step; returns its timing, tokens, cost and timeline."""
    predicted = self._predictions()
    self.predicted = predicted
    self.ctx = self._mean_context(predicted)
    self._setup_local(predicted, self.ctx)
    self._setup_remote(self.ctx)
    seeding = self.p.seeding and self.p.use_remote and self.remote
    if seeding and self.state.controller.t_seed <= 0:
      # No seeding window: the training cluster hands every request to the
      # remote instances before any reaches its engines, and only trains.
      self._seed_end(self.local_start)
      seeding = False
    self._assign_initial(predicted)
    for inst in self.local:
      self._schedule(inst)
    if seeding:
      self._push(self.local_start + self.state.controller.t_seed, "seed_end")
    if self.p.continuous_lb:
      self._push(self.t0 + self.p.lb_period_s, "lb")
    if self.p.use_remote:
      self._push(self.state.pool.next_time(), "avail")
    while self.events:
      t, _, kind, data = heapq.heappop(self.events)
      if kind == "inst":
        inst, version = data
        if inst.version == version and inst.alive:
          self._touch(inst, t)
          self._dispatch(t)
          self._schedule(inst)
          self._offload_scoring(t)
      elif kind == "ready":
        if data.alive:
          data.ready = True
          self._dispatch(t)
      elif kind == "seed_end":
        self._seed_end(t)
      elif kind == "lb":
        self._balance(t)
      elif kind == "avail":
        if t == math.inf:
          continue
        self._availability(t)
      elif kind == "scored":
        self._scored(t, *data)
      elif kind == "arrive":
        self._arrive(t, *data)
      elif kind == "train":
        self.trainer.finished_chunk(t, self)
      if self.ledger.done and not self.trainer.streaming_pending(self):
        break
    if not self.ledger.done:
      raise RuntimeError(
          f"step {self.step}: {self.ledger.total - len(self.ledger.finished)}"
          " samples never finished (no capacity left)")
    return step_phases.finish_step(self)
