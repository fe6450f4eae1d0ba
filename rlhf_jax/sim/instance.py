"""A continuous-batching decode instance, simulated as a fluid between events.

Between two events (a sample finishing, a sample joining or leaving) the batch
is fixed, so every running sample gains one token per decode step and the KV
read per step grows by the batch size. The step time is linear in the KV read
within one roofline regime, so the time of k steps is the trapezoid
k * (tau(start) + tau(end)) / 2, and the step count reached in a given time is
the root of that quadratic. Instances keep their own clock and are advanced
lazily, only when an event touches them, which keeps 256-GPU runs fast.
"""

import collections
import dataclasses
import heapq
import math

from rlhf_jax.sched.cost_model import costs
from rlhf_jax.sched.cost_model.hardware import Hardware
from rlhf_jax.sched.cost_model.profiles import ModelProfile

_EPS = 1e-9


@dataclasses.dataclass(eq=False)
class Sample:
  """One response being generated; it is never copied, only moved."""

  uid: int
  prompt_id: int
  index: int
  prompt_len: int
  target_len: int
  generated: float = 0.0
  finish_time: float | None = None
  migrations: int = 0
  location: object = None
  kv_ready: bool = False  # its KV cache arrived with it (no re-prefill).
  pred_left: float = 0.0  # predicted remaining tokens when placed.
  scored: bool = False  # reference / old log-probs computed.

  @property
  def done(self) -> bool:
    return self.finish_time is not None


class DecodeInstance:
  """One inference engine (tp devices) with slots, a local queue and a clock."""

  def __init__(self, iid: str, model: ModelProfile, hw: Hardware, tp: int,
               max_slots: int, *, kind: str, start_time: float,
               shared_prefix_decode: bool = False, dedup_prefill: bool = False,
               price_per_s: float = 0.0, step_s: float | None = None):
    self.iid = iid
    # A measured decode step (seconds, prefills included) in place of the
    # roofline's; then prefills cost nothing extra.
    self.measured_step_s = step_s
    self.model, self.hw, self.tp = model, hw, tp
    self._decode_step = costs.decode_step_fn(model, hw, tp)
    self.max_slots = max_slots
    self.kind = kind
    self.shared_prefix_decode = shared_prefix_decode
    self.dedup_prefill = dedup_prefill
    self.price_per_s = price_per_s
    self.t = start_time
    self.stall_until = start_time
    self.steps = 0.0
    self.kv_tokens = 0.0
    self.running = {}  # uid -> (sample, join_step, generated_at_join)
    self.heap = []  # (finish_step, uid)
    self.queue = collections.deque()
    self.group_running = collections.Counter()
    self.prefilled_prompts = set()
    self.alive = True
    self.ready = kind == "local"  # remotes become ready after weight pull.
    self.version = 0
    # Scheduler bookkeeping for this step.
    self.assigned = self.finished = 0
    self.pred_work = 0.0
    self.in_transit = 0
    self.scoring = self.ref_loaded = False
    self.released_at = None
    self.busy_s = 0.0
    self.last_completion = start_time
    self.timeline = []  # [start, end, label]

  # --- bookkeeping -------------------------------------------------------

  def _mark(self, start: float, end: float, label: str):
    if end - start <= _EPS:
      return
    self.busy_s += end - start
    if self.timeline and self.timeline[-1][2] == label and abs(
        self.timeline[-1][1] - start) < 1e-6:
      self.timeline[-1][1] = end
    else:
      self.timeline.append([start, end, label])

  def _step_time(self, kv_tokens: float) -> float:
    if self.measured_step_s is not None:
      return self.measured_step_s if self.running else 0.0
    return self._decode_step(len(self.running), kv_tokens)

  def progress_of(self, sample: Sample) -> float:
    """Tokens generated so far by a sample running here."""
    _, join_step, gen0 = self.running[sample.uid]
    return gen0 + self.steps - join_step

  @property
  def n_pending(self) -> int:
    return len(self.queue)

  @property
  def n_running(self) -> int:
    return len(self.running)

  @property
  def n_work(self) -> int:
    return len(self.queue) + len(self.running)

  def stall(self, now: float, seconds: float, label: str):
    """Blocks decoding for `seconds` (prefill, KV arrival, weight load)."""
    start = max(self.stall_until, now, self.t)
    self.stall_until = start + seconds
    self._mark(start, self.stall_until, label)

  # --- admission ---------------------------------------------------------

  def add(self, sample: Sample, now: float, *, kv_arrives: bool = False):
    """Queues a sample here; it starts as soon as a slot is free.

    Args:
      sample: the sample; `sample.generated` tokens already exist.
      now: current time (the instance must have been advanced to it).
      kv_arrives: its KV cache is migrated in (no re-prefill is needed; the
        caller pays the transfer as a stall).
    """
    sample.location = self
    sample.kv_ready = kv_arrives
    self.queue.append(sample)
    self._admit(now)
    self.version += 1

  def _admit(self, now: float):
    prefill_tokens, context = 0.0, 0.0
    while self.queue and len(self.running) < self.max_slots:
      sample = self.queue.popleft()
      if not sample.kv_ready:
        prompt_cached = (self.dedup_prefill and
                         sample.prompt_id in self.prefilled_prompts)
        new_tokens = sample.generated + (0 if prompt_cached else
                                         sample.prompt_len)
        prefill_tokens += new_tokens
        context += sample.prompt_len + sample.generated
        self.prefilled_prompts.add(sample.prompt_id)
      self._start(sample)
    if prefill_tokens and self.measured_step_s is None:
      n = max(1, len(self.running))
      self.stall(now, costs.forward_time(
          self.model, self.hw, self.tp, prefill_tokens, context / n), "prefill")

  def _start(self, sample: Sample):
    self.running[sample.uid] = (sample, self.steps, sample.generated)
    finish_step = self.steps + (sample.target_len - sample.generated)
    heapq.heappush(self.heap, (finish_step, sample.uid))
    shared = self.shared_prefix_decode and self.group_running[sample.prompt_id]
    self.kv_tokens += sample.generated + (0 if shared else sample.prompt_len)
    self.group_running[sample.prompt_id] += 1

  def _stop(self, sample: Sample) -> float:
    _, join_step, gen0 = self.running.pop(sample.uid)
    generated = gen0 + self.steps - join_step
    self.group_running[sample.prompt_id] -= 1
    shared = (self.shared_prefix_decode and
              self.group_running[sample.prompt_id] > 0)
    self.kv_tokens -= generated + (0 if shared else sample.prompt_len)
    if self.group_running[sample.prompt_id] == 0:
      del self.group_running[sample.prompt_id]
    return generated

  # --- time --------------------------------------------------------------

  def _clean_heap(self):
    while self.heap and self.heap[0][1] not in self.running:
      heapq.heappop(self.heap)

  def next_event_time(self) -> float:
    """When the next running sample finishes (inf if none)."""
    self._clean_heap()
    if not self.alive or not self.heap:
      return math.inf
    k = max(0.0, self.heap[0][0] - self.steps)
    t_start = max(self.t, self.stall_until)
    tau0 = self._step_time(self.kv_tokens)
    tau1 = self._step_time(self.kv_tokens + len(self.running) * k)
    return t_start + k * (tau0 + tau1) / 2

  def _progress(self, k: float, dt: float):
    self.kv_tokens += len(self.running) * k
    self.steps += k
    self._mark(self.t, self.t + dt, "decode")
    self.t += dt

  def advance(self, t_target: float) -> list[Sample]:
    """Runs the instance up to t_target; returns samples finished on the way."""
    finished = []
    while self.alive and self.t < t_target - _EPS:
      if self.t < self.stall_until:
        self.t = min(self.stall_until, t_target)
        continue
      self._clean_heap()
      if not self.heap:
        self.t = t_target
        break
      batch = len(self.running)
      k_next = max(0.0, self.heap[0][0] - self.steps)
      tau0 = self._step_time(self.kv_tokens)
      tau1 = self._step_time(self.kv_tokens + batch * k_next)
      t_need = k_next * (tau0 + tau1) / 2
      if self.t + t_need <= t_target + _EPS:
        self._progress(k_next, t_need)
        while self.heap and self.heap[0][0] <= self.steps + _EPS:
          _, uid = heapq.heappop(self.heap)
          if uid not in self.running:
            continue
          sample = self.running[uid][0]
          sample.generated = self._stop(sample)
          sample.generated = float(sample.target_len)
          sample.finish_time = self.t
          sample.location = None
          finished.append(sample)
        self.last_completion = self.t
        self._admit(self.t)
        self.version += 1
      else:
        remaining = t_target - self.t
        slope = (tau1 - tau0) / k_next if k_next > 0 else 0.0
        if slope > 1e-15:
          k = (-tau0 + math.sqrt(tau0 * tau0 + 2 * slope * remaining)) / slope
        else:
          k = remaining / tau0
        self._progress(min(k, k_next), remaining)
    self.t = max(self.t, t_target)
    return finished

  # --- removal -----------------------------------------------------------

  def take(self, n: int, *, running: bool, now: float) -> list[Sample]:
    """Removes up to n samples (queued, or running least-progressed first)."""
    taken = []
    if not running:
      while self.queue and len(taken) < n:
        taken.append(self.queue.pop())
    else:
      order = sorted(self.running.values(), key=lambda r: r[2] - r[1])
      for sample, _, _ in order[:n]:
        sample.generated = self._stop(sample)
        taken.append(sample)
    for sample in taken:
      sample.location = None
    self.version += 1
    if running:
      self._admit(now)
    return taken

  def evict_all(self) -> list[Sample]:
    """Removes every sample (preemption, abort or release), tokens kept."""
    out = list(self.queue)
    self.queue.clear()
    for sample, _, _ in list(self.running.values()):
      sample.generated = self._stop(sample)
      out.append(sample)
    self.heap.clear()
    for sample in out:
      sample.location = None
    self.version += 1
    return out
