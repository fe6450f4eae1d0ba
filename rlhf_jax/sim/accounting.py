"""Step accounting: results, billing, utilization, Chrome-trace timelines.

Throughput follows RLBoost: (tokens generated + tokens trained) / step time.
Cost is dollars (or device-seconds when prices are equal); timelines are
Chrome trace JSON events (load in chrome://tracing or Perfetto), the same
format the live trainer writes.
"""

import dataclasses
import json

from rlhf_jax.sched import offload


@dataclasses.dataclass
class StepResult:
  """Per-step accounting (RLBoost's definitions)."""

  step: int
  t0: float
  t_end: float
  rollout_s: float
  gen_tokens: float
  trained_tokens: float
  cost: float
  device_s_held: float
  device_s_busy: float
  counters: dict
  n_remote: float
  t_seed: float
  timeline: list
  observation: object = None
  phase_s: dict = dataclasses.field(default_factory=dict)
  remote_device_s: tuple = (0.0, 0.0)  # (busy, held) device-seconds.

  @property
  def step_s(self) -> float:
    return self.t_end - self.t0

  @property
  def tokens_per_s(self) -> float:
    return (self.gen_tokens + self.trained_tokens) / self.step_s


def _engine_billed_until(inst) -> float:
  """A serverless actor is billed until its last activity (then released)."""
  end = inst.last_completion if inst.finished else inst.stall_until
  if inst.released_at is not None:
    end = max(end, inst.released_at)
  if inst.timeline:
    end = max(end, inst.timeline[-1][1])
  return end


def account(sim, t_roll_end, t_end, tokens, phases):
  """Builds the StepResult of a simulated step."""
  s, p, t0 = sim.s, sim.p, sim.t0
  step_s = t_end - t0
  gen = sum(x.target_len for x in sim.samples)
  pool = sim.state.pool
  remote_cost = pool.cost(t0, t_end)
  remote_held = pool.held_seconds(t0, t_end)
  remote_busy = sum(i.busy_s * i.tp for i in sim.remote.values())
  busy = sum(i.busy_s * i.tp for i in sim.local) + remote_busy
  train_s = sum(b - a for _, a, b in phases)
  busy += train_s * s.reserved_devices
  device_price = s.hw.ondemand_per_h / 3600
  if p.release_idle:
    held = sum((_engine_billed_until(i) - t0) * i.tp for i in sim.local)
    held += (t_end - t_roll_end) * s.reserved_devices
    cost = held * device_price
  else:
    held = s.reserved_devices * step_s
    cost = s.reserved_price_per_s * step_s
  held += remote_held * s.remote_devices
  cost += remote_cost
  obs = None
  if sim.remote:
    remotes = list(sim.remote.values())
    waits = [t_end - max(i.last_completion, i.stall_until) for i in remotes
             if i.finished]
    obs = offload.StepObservation(
        t_train_wait=sim.trainer.wait_s,
        t_remote_wait=sum(waits) / len(waits) if waits else step_s,
        t_train=max(sim.trainer.busy_s, 1e-9),
        t_remote=sum(i.busy_s for i in remotes) / len(remotes),
        n_prem=remote_held / step_s,
        n_prem_next=sum(1 for i in pool.acquired if i in pool.present))
  controller = sim.state.controller
  phase_s = {}
  for label, start, end in phases:
    phase_s[label] = phase_s.get(label, 0.0) + end - start
  return StepResult(
      phase_s=phase_s,
      remote_device_s=(remote_busy, remote_held * s.remote_devices),
      step=sim.step, t0=t0, t_end=t_end, rollout_s=t_roll_end - t0,
      gen_tokens=gen, trained_tokens=tokens, cost=cost, device_s_held=held,
      device_s_busy=busy, counters=dict(sim.counters),
      n_remote=remote_held / step_s,
      t_seed=controller.t_seed if controller else 0.0,
      timeline=_timeline(sim, phases), observation=obs)


def _timeline(sim, phases) -> list[dict]:
  events = []
  for inst in sim.local + list(sim.remote.values()):
    for start, end, label in inst.timeline:
      events.append({"name": label, "ph": "X", "pid": inst.kind,
                     "tid": inst.iid, "ts": start * 1e6,
                     "dur": (end - start) * 1e6, "args": {"step": sim.step}})
  for label, start, end in phases:
    events.append({"name": label, "ph": "X", "pid": "trainer",
                   "tid": "trainer", "ts": start * 1e6,
                   "dur": (end - start) * 1e6, "args": {"step": sim.step}})
  return events


def write_chrome_trace(path: str, results) -> None:
  """Writes every step's timeline as one Chrome trace JSON file."""
  events = [e for r in results for e in r.timeline]
  with open(path, "w") as f:
    json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def summarize(results, warmup: int = 0) -> dict:
  """Totals over steps after `warmup`: throughput, cost, utilization."""
  kept = results[warmup:] or results
  time = sum(r.step_s for r in kept)
  tokens = sum(r.gen_tokens + r.trained_tokens for r in kept)
  cost = sum(r.cost for r in kept)
  held = sum(r.device_s_held for r in kept)
  busy = sum(r.device_s_busy for r in kept)
  return {
      "steps": len(kept),
      "step_s": time / len(kept),
      "rollout_s": sum(r.rollout_s for r in kept) / len(kept),
      "tokens_per_s": tokens / time,
      "cost_per_step": cost / len(kept),
      "trained_tokens_per_dollar": sum(r.trained_tokens for r in kept) / cost
                                   if cost else float("inf"),
      "utilization": busy / held if held else 0.0,
      "idle_device_s": max(0.0, held - busy) / len(kept),
      "migrations": sum(r.counters.get("migrations", 0) for r in kept),
      "preemptions": sum(r.counters.get("preemptions", 0) for r in kept),
      "n_remote": sum(r.n_remote for r in kept) / len(kept),
      "remote_utilization": (
          sum(r.remote_device_s[0] for r in kept) /
          max(sum(r.remote_device_s[1] for r in kept), 1e-9)),
      "train_s": sum(r.phase_s.get("train", 0.0) for r in kept) / len(kept),
      "gen_score_s": sum(r.step_s - r.phase_s.get("train", 0.0)
                         for r in kept) / len(kept),
  }
