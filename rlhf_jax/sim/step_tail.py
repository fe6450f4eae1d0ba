"""Tail policies executed inside a step: RLHFuse consolidation, RLHFless cut.

A mixin of StepSimulator (step.py): the decisions come from
rlhf_jax.sched.tail; these methods apply them to the simulated instances.
"""

from rlhf_jax.sched import tail
from rlhf_jax.sched.cost_model import costs


class TailPolicies:
  """Consolidation at R_t and local cut-and-migrate at tau."""

  def _consolidate(self, t):
    s = self.s
    active = [i for i in self.local if i.alive]
    self.consolidated_at = t
    for inst in active:
      self._touch(inst, t)
    running = sum(i.n_running for i in active)
    ctx = sum(i.kv_tokens for i in active) / max(1, running)
    capacity = tail.latency_capacity(
        lambda b: costs.decode_step_time(s.actor, s.hw, s.rollout_tp, b,
                                         b * ctx),
        active[0].max_slots, self.p.tail_slack)
    kv_cap = (s.rollout_tp * s.hw.hbm_bytes * 0.9 - s.actor.weight_bytes
              ) / s.actor.kv_bytes_per_token
    loads = [tail.InstanceLoad(i.iid, i.n_work, i.kv_tokens, 0) for i in active]
    keep = set(tail.consolidation_survivors(loads, capacity, kv_cap))
    survivors = [i for i in active if i.iid in keep]
    for inst in active:
      if inst.iid in keep:
        continue
      while inst.n_work:
        dst = min(survivors, key=lambda d: (d.n_work + d.in_transit, d.iid))
        self._move(inst, dst, 1, inst.n_running > 0, t)
      inst.alive = False
      inst.released_at = t
      self.freed_devices += s.rollout_tp

  def _cut(self, t):
    active = [i for i in self.local if i.alive and i.iid not in self.cut_done]
    loads = [tail.InstanceLoad(i.iid, i.n_work, i.kv_tokens,
                               i.max_slots - i.n_work, i.assigned, i.finished)
             for i in active]
    by_id = {i.iid: i for i in active}
    for src, dst, n in tail.cut_moves(loads, self.p.cut_tau, self.cut_done):
      src_inst = by_id[src]
      pending = min(n, src_inst.n_pending)
      if pending:
        self._move(src_inst, by_id[dst], pending, False, t)
      if n - pending:
        self._move(src_inst, by_id[dst], n - pending, True, t)
      self.counters["cuts"] += 1
