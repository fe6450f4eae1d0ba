"""Elastic-pool events inside a step: seeding end, balancing, spot churn,
and scoring on idle remote instances.

A mixin of StepSimulator (step.py): the decisions come from
rlhf_jax.sched.offload; these methods apply them to the simulated instances.
"""

from rlhf_jax.sched import offload


class ElasticEvents:
  """RLBoost's events plus inter-stage fusion on the elastic pool."""

  # --- scoring on idle rollout instances ------------------------------------

  def _offload_scoring(self, t):
    """Idle remote instances score finished samples (inter-stage fusion).

    Once the central queue is empty, a remote instance with nothing to decode
    runs the scoring forwards (reference / old log-probs) of finished samples
    instead of idling; the frozen reference weights are loaded from host
    memory once per step.
    """
    if not self.p.remote_scoring or self.queue:
      return
    for inst in self.remote.values():
      if not (inst.alive and inst.ready) or inst.n_work or inst.scoring:
        continue
      chunk = self.trainer.take_unscored(self.p.remote_scoring_chunk)
      if not chunk:
        return
      self._touch(inst, t)
      tokens = sum(x.prompt_len + x.target_len for x in chunk)
      seconds = self.s.scoring_time(tokens, tokens / len(chunk),
                                    inst.tp, hw=inst.hw)
      if not inst.ref_loaded:
        seconds += self.s.host_load_time(inst.tp)
        inst.ref_loaded = True
      inst.scoring = True
      inst.stall(t, seconds, "score")
      self._push(inst.stall_until, "scored", (inst, chunk))

  def _scored(self, t, inst, chunk):
    inst.scoring = False
    if inst.released_at is not None and inst.released_at <= t:
      # Preempted while scoring: the work is lost, the samples go back.
      self.trainer.return_unscored(chunk, t)
    else:
      self.trainer.mark_scored(chunk, t)
    self._offload_scoring(t)

  # --- RLBoost events ------------------------------------------------------

  def _seed_end(self, t):
    if not any(i.alive for i in self.remote.values()):
      return  # no remote capacity: stay colocated (fallback).
    self.local_open = False
    moved = []
    for inst in self.local:
      self._touch(inst, t)
      evicted = inst.evict_all()
      self._removed(inst, evicted)
      moved += evicted
      inst.alive = False
    self._requeue(moved, t)
    self.trainer.open(t, self)

  def _balance(self, t):
    # Every engine the manager dispatches to takes part, including the
    # training cluster's engines while they seed (Algorithm 2 polls every
    # instance), so remotes that finish their weight pull take work at once.
    targets = self._targets()
    if len(targets) > 1:
      ctx = sum(i.kv_tokens for i in targets) / max(
          1, sum(i.n_running for i in targets))
      plateau = offload.batching_plateau(
          self.s.decode_throughput(self.s.remote_hw, self.s.remote_devices,
                                   ctx), targets[0].max_slots,
          self.p.plateau_fraction, nondecreasing=True)
      views = [offload.QueueView(i.n_pending, i.n_running, i.max_slots)
               for i in targets]
      for src, dst, n, running in offload.balance_moves(views, plateau):
        self._move(targets[src], targets[dst], n, running, t)
    if not self.ledger.done:
      self._push(t + self.p.lb_period_s, "lb")

  def _availability(self, t):
    pool = self.state.pool
    event = pool.pop()
    if event.kind == "remove" and event.iid in pool.acquired:
      pool.release(event.iid, t)
      inst = self.remote.get(event.iid)
      if inst is not None and inst.alive:
        self._touch(inst, t)
        moved = inst.evict_all()
        self._removed(inst, moved)
        inst.alive = False
        inst.released_at = t
        self.counters["preemptions"] += 1
        self._requeue(moved, t, preempted=True)
    elif event.kind == "add" and self.p.use_remote:
      allowed = len(pool.present)
      if self.p.remote_cap and self.state.controller is not None:
        allowed = self.state.controller.allowed_instances(allowed)
      if len(pool.acquired) < allowed:
        pool.acquire(event.iid, t)
        if self.p.pull_weights:
          self._pull_all([event.iid], t, self.ctx)
    self._push(pool.next_time(), "avail")
