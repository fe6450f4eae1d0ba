"""After the rollout: streaming trainer, scoring, training, step accounting."""

from rlhf_jax.sim import accounting
from rlhf_jax.sched.cost_model import costs
from rlhf_jax.sim import training
from rlhf_jax.sched.cost_model.profiles import get_model


class StreamingTrainer:
  """RLBoost's trainer: consumes finished groups as micro-batches.

  It opens when the seeding window closes, starts a micro-batch once at least
  m_b responses of complete groups are ready (a larger burst becomes one
  larger micro-batch) and idles otherwise; that idle time is t_train^wait.
  With `sample_level_scoring` (RLHFuse's sample-level fusion) it also scores
  (reference / old log-probs) single finished samples while their group is
  still generating, so only the fwd/bwd waits for complete groups.
  """

  def __init__(self, setting, policy, n_total: int):
    self.s, self.p, self.n_total = setting, policy, n_total
    self.sample_level = policy.sample_level_scoring
    self.unscored, self.ready, self.segments = [], [], []
    self.sim = None
    self.opened_at = self.end = self.idle_since = None
    self.busy = False
    self.processed = 0
    self.wait_s = self.busy_s = 0.0

  def sample_done(self, sample, t: float):
    if self.sample_level:
      sample.scored = False
      self.unscored.append(sample)
      if self.sim is not None:
        self._try(t)

  def take_unscored(self, n: int) -> list:
    """Hands up to n unscored finished samples to another scorer."""
    chunk, self.unscored = self.unscored[:n], self.unscored[n:]
    return chunk

  def return_unscored(self, samples, t: float):
    """Scoring elsewhere failed (preemption): the samples need scoring."""
    self.unscored.extend(samples)
    if self.sim is not None:
      self._try(t)

  def mark_scored(self, samples, t: float):
    for x in samples:
      x.scored = True
    if self.sim is not None:
      self._try(t)

  def group_ready(self, samples, t: float):
    self.ready.extend(samples)
    if self.sim is not None:
      self._try(t)

  def open(self, t: float, sim):
    self.sim, self.opened_at, self.idle_since = sim, t, t
    self._try(t)

  def streaming_pending(self, sim) -> bool:
    return self.opened_at is not None and self.end is None

  def _next_chunk(self):
    """(kind, samples) of the next micro-batch, or None to wait."""
    remaining = self.n_total - self.processed
    trainable = [x for x in self.ready
                 if not self.sample_level or x.scored]
    if trainable and len(trainable) >= min(self.p.micro_batch_min, remaining):
      self.ready = [x for x in self.ready
                    if self.sample_level and not x.scored]
      return ("train" if self.sample_level else "score_train"), trainable
    all_done = self.sim.ledger.done
    if self.unscored and (len(self.unscored) >= self.p.micro_batch_min or
                          all_done or len(trainable) < len(self.ready)):
      chunk, self.unscored = self.unscored, []
      return "score", chunk
    return None

  def _try(self, t: float):
    sim = self.sim
    if self.busy or self.end is not None:
      return
    if sim.local_open:
      if sim.queue or any(i.n_work for i in sim.local if i.alive):
        return
      sim.local_open = False
    chunk = self._next_chunk()
    if chunk is None:
      return
    kind, samples = chunk
    tokens, ctx = _tokens(samples)
    duration = 0.0
    if kind in ("score", "score_train"):
      duration += self.s.scoring_time(tokens, ctx, self.s.reserved_devices)
      for x in samples:
        x.scored = True
    if kind in ("train", "score_train"):
      duration += self.s.fsdp_train_time(tokens, len(samples), ctx, 0)
      self.processed += len(samples)
    self.wait_s += t - self.idle_since
    self.busy = True
    self.segments.append((t, t + duration))
    sim._push(t + duration, "train")

  def finished_chunk(self, t: float, sim):
    self.busy = False
    self.busy_s += self.segments[-1][1] - self.segments[-1][0]
    self.idle_since = t
    if self.processed == self.n_total:
      opt = optimizer_time(self.s)
      self.segments.append((t, t + opt))
      self.end = t + opt
      return
    sim._dispatch(t)
    self._try(t)


def _tokens(samples) -> tuple[float, float]:
  tokens = sum(x.prompt_len + x.target_len for x in samples)
  return tokens, tokens / max(len(samples), 1)


def optimizer_time(setting) -> float:
  total = costs.optimizer_time(setting.actor, setting.hw,
                               setting.reserved_devices,
                               setting.optimizer_steps)
  if setting.critic_model:
    total += costs.optimizer_time(get_model(setting.critic_model), setting.hw,
                                  setting.reserved_devices,
                                  setting.optimizer_steps)
  return total


def overlapped_scoring(sim, t_end: float) -> float:
  """Device-seconds of scoring the freed instances finish during the tail.

  After consolidation the freed devices score finished samples in finish
  order; scoring is compute-bound so one sample costs the same device-seconds
  wherever it runs.
  """
  if (sim.consolidated_at is None or not sim.p.tail_inference_overlap or
      not sim.freed_devices):
    return 0.0
  devices = sim.freed_devices
  t, done = sim.consolidated_at, 0.0
  for finish, x in sorted(sim.finish_order, key=lambda e: e[0]):
    work = sim.s.scoring_time(x.prompt_len + x.target_len,
                              x.prompt_len + x.target_len, 1)
    start = max(t, finish)
    if start >= t_end:
      break
    t = start + work / devices
    if t > t_end:
      done += (t_end - start) * devices
      break
    done += work
  return done


def train_phase_time(sim, tokens: float, ctx: float) -> float:
  """Actor (+ critic) training after the rollout."""
  s = sim.s
  if s.train_pp:
    return training.pipeline_train_time(s, len(sim.samples), tokens, ctx,
                                        fused=sim.p.fused_training)
  return s.fsdp_train_time(tokens, len(sim.samples), ctx)


def finish_step(sim) -> accounting.StepResult:
  """Post-rollout phases, billing and the timeline of one step."""
  s = sim.s
  t_roll_end = max(t for t, _ in sim.finish_order)
  tokens, ctx = _tokens(sim.samples)
  trainer = sim.trainer
  phases = []
  if trainer.end is not None:
    t_end = trainer.end
    phases += [("train_stream", a, b) for a, b in trainer.segments]
  else:
    d = s.reserved_devices
    scoring_total = s.scoring_time(tokens, ctx, d) * d
    scoring = max(0.0, scoring_total - overlapped_scoring(sim, t_roll_end)) / d
    train = train_phase_time(sim, tokens, ctx)
    phases += [("scoring", t_roll_end, t_roll_end + scoring),
               ("train", t_roll_end + scoring, t_roll_end + scoring + train)]
    t_end = t_roll_end + scoring + train
  return accounting.account(sim, t_roll_end, t_end, tokens, phases)
