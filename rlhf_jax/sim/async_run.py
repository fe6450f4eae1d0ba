"""Async RL in simulated time, under the live rollout's own rules.

  summary = async_run.summarize(async_run.run(setting, policy, workload,
                                              steps, eta=1), setting)

The rollout part (`rollout_devices`, the rest train) is a set of decode
instances (`sim/instance.py`, fluid continuous batching) fed batch after
batch; the trainer trains batch b once it is complete and batch b - 1 is
trained. The decisions are `sched/staleness.py`'s, the functions
`rollout/asynchronous.py` executes:

- batch b is queued (each sample to the instance with the least work) once
  the rollout holds version >= b - 1 - eta (`may_draw`);
- the rollout takes version v by `switch_due` (batch v complete and
  `switch_after_groups` more groups finished, or nothing left to decode),
  waiting for the trainer when v is not published yet; its in-flight
  samples then recompute their KV (a prefill of their tokens, a stall of
  each instance), and the weights' copy onto its devices costs
  `costs.reshard_time`.

Training a batch costs what the synchronous step's does on the train
part's devices: scoring (`Setting.scoring_time`) + FSDP training
(`Setting.fsdp_train_time`). `rollout_devices=0` tries up to eight
splits (multiples of `rollout_tp`) and keeps the fastest; the result also
names the split the live job's cost model picks
(`staleness.rollout_split` over `batch_seconds`), for comparison.

With `measured` unit costs (a live run's decode step and trainer seconds,
`benchmarks/async_rl.py`) the rollout is one engine stepping at that
cost and `sync_step_s` gives the synchronous step at the same units: the
event loop checked against the live benchmark.
"""

from __future__ import annotations

import dataclasses
import math

from rlhf_jax.sched import staleness
from rlhf_jax.sched.named_policies import Policy
from rlhf_jax.sched.cost_model import costs
from rlhf_jax.sched.cost_model.async_batch import batch_seconds
from rlhf_jax.sim.instance import DecodeInstance, Sample
from rlhf_jax.sched.cost_model.setting import Setting
from rlhf_jax.sim.workload import Workload


@dataclasses.dataclass(frozen=True)
class Measured:
  """A live run's unit costs in place of the roofline (one engine)."""
  step_s: float     # One decode step (its prefills and recomputes included).
  train_s: float    # Scoring and training one batch (the trainer busy).
  slots: int        # Samples decoding at once.


@dataclasses.dataclass
class AsyncResult:
  """A simulated async run: when each step's update was applied."""
  trained_at: list[float]     # [steps] seconds
  tokens: list[float]         # [steps] generated + trained tokens
  rollout_devices: int
  rollout_wait_s: float       # The rollout waiting for weights.
  trainer_wait_s: float       # The trainer waiting for batches.
  cost_model: "AsyncResult | None" = None  # At `staleness.rollout_split`'s.


def run(setting: Setting, policy: Policy, workload: Workload, steps: int, *,
        eta: int = 1, rollout_devices: int = 0,
        switch_after_groups: int = -1,
        measured: Measured | None = None) -> AsyncResult:
  """Simulates `steps` async steps (see the module doc); with `measured`,
  one engine at those unit costs (`rollout_devices` then only splits)."""
  s = setting
  if not rollout_devices:  # Eight candidate splits at most.
    stride = s.rollout_tp * max(1, s.reserved_devices // s.rollout_tp // 8)
    runs = [run(setting, policy, workload, steps, eta=eta,
                rollout_devices=r, switch_after_groups=switch_after_groups)
            for r in range(stride, s.reserved_devices, stride)]
    best = min(runs, key=lambda r: r.trained_at[-1])
    samples = [x for i in range(steps) for x in workload.batch(i).samples]
    b = workload.batch(0)
    split = staleness.rollout_split(
        range(s.rollout_tp, s.reserved_devices, s.rollout_tp),
        s.reserved_devices, *batch_seconds(
            s, samples=len(b.samples),
            group_size=len(b.samples) // len(b.prompt_ids),
            prompt_len=sum(x[2] for x in samples) / len(samples),
            response_len=sum(x[3] for x in samples) / len(samples)))
    rule = next((r for r in runs if r.rollout_devices == split), None)
    rule = dataclasses.replace(rule) if rule else run(
        setting, policy, workload, steps, eta=eta, rollout_devices=split,
        switch_after_groups=switch_after_groups)
    best.cost_model = rule  # A copy: `best` may be the rule's run.
    return best
  return _Pipeline(s, policy, workload, steps, eta, rollout_devices,
                   switch_after_groups, measured).run()


class _Pipeline:
  """The event loop of one async run."""

  def __init__(self, s, policy, workload, steps, eta, rollout_devices,
               switch_after_groups, measured):
    if not 0 < rollout_devices < s.reserved_devices:
      raise ValueError(f"rollout on {rollout_devices} of "
                       f"{s.reserved_devices} devices")
    self.s, self.steps, self.eta = s, steps, eta
    self.R = rollout_devices
    self.train = dataclasses.replace(s, reserved_devices=s.reserved_devices
                                     - rollout_devices)
    self.batches = [workload.batch(i) for i in range(steps)]
    self.F = (switch_after_groups if switch_after_groups >= 0
              else len(self.batches[0].prompt_ids) // 2)
    lengths = [pl + n for b in self.batches for _, _, pl, n in b.samples]
    ctx = sum(lengths) / len(lengths)
    slots = s.engine_slots(s.hw, s.rollout_tp, ctx)
    self.measured = measured
    if measured is not None:  # Copies and recomputes are in its units.
      self.instances, self.copy_s = [_measured_engine(s, measured)], 0.0
    else:
      self.instances = [DecodeInstance(
          f"rollout{i}", s.actor, s.hw, s.rollout_tp, slots, kind="local",
          start_time=0.0, shared_prefix_decode=policy.prefix_shared_decode,
          dedup_prefill=policy.dedup_prefill)
          for i in range(rollout_devices // s.rollout_tp)]
      self.copy_s = costs.reshard_time(s.actor, s.hw, rollout_devices)

  def run(self) -> AsyncResult:
    t, version, drawn, trained = 0.0, 0, 0, 0
    left: dict[int, int] = {}        # batch -> unfinished samples
    group_left: dict[tuple, int] = {}
    after, blocked_since = 0, None
    trainer_end, trained_at = None, []
    waits = {"rollout": 0.0, "trainer": 0.0}
    idle_since = 0.0
    while trained < self.steps:
      while drawn < self.steps and staleness.may_draw(drawn + 1, version,
                                                      self.eta):
        drawn += 1
        self._draw(drawn, t, left, group_left)
      v = version + 1
      busy = any(i.n_work for i in self.instances)
      if blocked_since is None and staleness.switch_due(
          v <= drawn and left[v] == 0, after, self.F, busy):
        blocked_since = t   # Waits for version v, decoding nothing.
      if blocked_since is not None and trained >= v:
        self._switch(blocked_since, t)
        waits["rollout"] += t - blocked_since
        version, after, blocked_since = v, 0, None
        continue
      if trainer_end is None and trained + 1 <= drawn and left[trained + 1] == 0:
        trainer_end = t + self._train_time(self.batches[trained])
        waits["trainer"] += t - idle_since
      t_inst = (math.inf if blocked_since is not None else
                min((i.next_event_time() for i in self.instances),
                    default=math.inf))
      t_next = min(t_inst, math.inf if trainer_end is None else trainer_end)
      if not math.isfinite(t_next):
        raise RuntimeError(f"async simulation stuck at {t:.1f}s")
      if blocked_since is None:
        for inst in self.instances:
          for sample in inst.advance(t_next):
            b = sample.prompt_id // _BATCH
            left[b] -= 1
            group_left[b, sample.prompt_id] -= 1
            if (not group_left[b, sample.prompt_id] and v <= drawn
                and left[v] == 0 and b != v):
              after += 1
      t = t_next
      if trainer_end is not None and t >= trainer_end:
        trained += 1
        trained_at.append(t)
        trainer_end, idle_since = None, t
    # Generated + trained tokens, as `accounting.StepResult` counts them.
    tokens = [sum(pl + 2 * n for _, _, pl, n in b.samples)
              for b in self.batches]
    return AsyncResult(trained_at, tokens, self.R, waits["rollout"],
                       waits["trainer"])

  def _draw(self, b: int, t: float, left, group_left) -> None:
    """Batch b's samples to the instances with the least work."""
    batch = self.batches[b - 1]
    left[b] = len(batch.samples)
    for p, j, pl, n in batch.samples:
      # Prompt ids repeat across epochs; an instance outlives a batch.
      pid = b * _BATCH + p
      group_left[b, pid] = group_left.get((b, pid), 0) + 1
      inst = min(self.instances, key=lambda i: (i.n_work, i.iid))
      inst.advance(t)
      inst.add(Sample(uid=pid * 1000 + j, prompt_id=pid, index=j,
                      prompt_len=pl, target_len=max(1, n)), t)

  def _switch(self, since: float, t: float) -> None:
    """New weights: the wait, the copy, then each instance's in-flight
    samples recompute their KV."""
    for inst in self.instances:
      inst.stall(since, t - since + self.copy_s, "weights")
      if self.measured is not None:
        continue
      tokens = sum(smp.prompt_len + inst.progress_of(smp)
                   for smp, _, _ in inst.running.values())
      if tokens:
        inst.stall(t, costs.forward_time(
            inst.model, inst.hw, inst.tp, tokens,
            tokens / len(inst.running)), "recompute")

  def _train_time(self, batch) -> float:
    if self.measured is not None:
      return self.measured.train_s
    tokens = sum(pl + n for _, _, pl, n in batch.samples)
    ctx = tokens / len(batch.samples)
    d = self.train.reserved_devices
    return (self.train.scoring_time(tokens, ctx, d)
            + self.train.fsdp_train_time(tokens, len(batch.samples), ctx))


def _measured_engine(s: Setting, m: Measured) -> DecodeInstance:
  return DecodeInstance("engine", s.actor, s.hw, 1, m.slots, kind="local",
                        start_time=0.0, step_s=m.step_s)


def sync_step_s(setting: Setting, batch, m: Measured) -> float:
  """The synchronous step at measured costs: `batch` (a `StepBatch`)
  decodes on one engine, every sample queued at once, then the batch is
  scored and trained (`m.train_s`)."""
  engine = _measured_engine(setting, m)
  for p, j, pl, n in batch.samples:
    engine.add(Sample(uid=p * 1000 + j, prompt_id=p, index=j,
                      prompt_len=pl, target_len=max(1, n)), 0.0)
  t = 0.0
  while math.isfinite(t_next := engine.next_event_time()):
    engine.advance(t_next)
    t = t_next
  return t + m.train_s


_BATCH = 1 << 20  # Batch b's prompt ids: b * _BATCH + the workload's id.


def summarize(result: AsyncResult, setting: Setting,
              warmup: int = 0) -> dict:
  """Throughput and cost over the steps after `warmup` (the metrics'
  names of `accounting.summarize`; every device billed all along)."""
  start = result.trained_at[warmup - 1] if warmup else 0.0
  time = result.trained_at[-1] - start
  kept = len(result.trained_at) - warmup
  cost = setting.reserved_price_per_s * time
  rule = {}
  if result.cost_model is not None:
    r = summarize(result.cost_model, setting, warmup)
    rule = {"cost_model_rollout_devices": r["rollout_devices"],
            "cost_model_step_s": r["step_s"]}
  return {"steps": kept, "step_s": time / kept,
          "tokens_per_s": sum(result.tokens[warmup:]) / time,
          "cost_per_step": cost / kept,
          "rollout_devices": result.rollout_devices, **rule,
          "rollout_wait_s": result.rollout_wait_s / len(result.trained_at),
          "trainer_wait_s": result.trainer_wait_s / len(result.trained_at)}
