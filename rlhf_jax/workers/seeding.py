"""Adaptive offload (RLBoost Algorithm 1): the trainer's mesh seeds, then
hands its unfinished samples to the rollout workers.

Each step the trainer's own rollout engine joins the manager as one more
worker (already holding the step's weights, so it pulls nothing) and
generates beside the remote workers for a window T_seed. Then it leaves
(`RolloutManager.remove`): its unfinished samples continue on the workers
from the tokens it streamed (the preemption path, so the finished tokens
are those of an uninterrupted run) and the trainer's devices are free for
the training side of the step.

After the step, `sched.offload.SeedWindowController` moves T_seed by
(t_train_wait - t_remote_wait) / eta and caps the worker count N_prem:
  t_train_wait   the trainer's mesh waiting for samples after the hand-off
                 (it would rather have kept generating: T_seed grows);
  t_remote_wait  mean idle of the remote workers after their last response
                 of the step (they ran out of work: T_seed shrinks);
  t_train        the trainer's training time (previous step's train span);
  t_remote       mean busy time per remote worker.
With `stream` (`trainers/streaming.py`, RLBoost's micro-batch streaming)
the trainer trains on finished groups during that wait, and t_train_wait
counts only the poll rounds that began with no part in flight; without it
the wait is pure idle and the controller settles where the hand-off meets
the end of the remote work.
"""

from __future__ import annotations

import time
from typing import Sequence

from absl import logging

from rlhf_jax.engine.driver import Request, Sample
from rlhf_jax.sched import offload
from rlhf_jax.workers import manager as manager_lib
from rlhf_jax.workers.worker import RolloutWorker

TRAINER_ID = "trainer"


class SeedWindow:
  """Runs one batch with the trainer's engine seeding for T_seed seconds."""

  def __init__(self, engine, controller: offload.SeedWindowController,
               clock=time.perf_counter):
    self.worker = RolloutWorker(TRAINER_ID, None, engine=engine)
    self.controller, self.clock = controller, clock
    self.runs = 0

  @property
  def worker_cap(self) -> float | None:
    """N_prem: the most remote workers worth holding next step (None: no
    bound yet). `DemandScaler.begin(cap=...)` applies it."""
    cap = self.controller.n_prem_cap
    return None if cap == float("inf") else cap

  def run(self, mgr: manager_lib.RolloutManager, params, version: int,
          requests: Sequence[Request], train_s: float | None = None,
          stream=None) -> tuple[list[Sample], dict]:
    """Every sample of `requests`; metrics of the window and its waits.

    Args:
      mgr: the manager with the remote workers (the trainer joins it).
      params: the step's policy, on device in the engine's layout.
      version: the weight version `params` are (the newest published).
      requests: the batch.
      train_s: the trainer's last training time (for the N_prem cap).
      stream: a `streaming.StreamedStep` fed each round's finished samples
        and freed at the hand-off, or None.
    """
    ctl = self.controller
    t_seed = ctl.t_seed
    self.runs += 1
    if self.runs <= 2:
      # The first step after a (re)start trains with compilation, so the
      # second run's train time would set a cap far too low: no cap yet.
      train_s = None
    self.worker.install(version, params)
    handle = manager_lib.LocalHandle(self.worker)
    mgr.start(requests)
    mgr.add(handle, version=version)
    remote = [w for w in mgr.handles if w != TRAINER_ID]
    t0 = self.clock()
    last = dict.fromkeys(remote, t0)
    produced = dict(mgr.produced)
    seeded, t_handoff, rounds, remote_rounds = 0, None, 0, 0
    train_wait = 0.0
    try:
      while not mgr.done:
        if t_handoff is None and self.clock() - t0 >= t_seed:
          t_handoff = self._handoff(mgr)
          if t_handoff is not None and stream is not None:
            stream.free()
        waiting = t_handoff is not None and (stream is None or stream.idle())
        start = self.clock()
        finished = mgr.step()
        now = self.clock()
        if waiting:  # The trainer's devices had nothing to do this round.
          train_wait += now - start
        if stream is not None:
          stream.add(finished)
        rounds += 1
        remote_rounds += sum(1 for w in mgr.handles if w != TRAINER_ID)
        for w, n in mgr.produced.items():
          if n != produced.get(w, 0):
            if w == TRAINER_ID:
              seeded += n - produced.get(w, 0)
            else:
              last[w] = now
        produced = dict(mgr.produced)
    finally:
      if TRAINER_ID in mgr.handles:
        mgr.remove(TRAINER_ID)
      self.worker.unload()
    t_done = self.clock()
    if t_handoff is None:  # The trainer's engine finished the batch alone.
      t_handoff = t_done
    remote_wait = (sum(t_done - t for t in last.values()) / len(last)
                   if last else 0.0)
    remote_busy = (sum(t - t0 for t in last.values()) / len(last)
                   if last else 0.0)
    n_prem = remote_rounds / max(1, rounds)
    obs = offload.StepObservation(
        t_train_wait=train_wait, t_remote_wait=remote_wait,
        t_train=train_s or 0.0, t_remote=remote_busy, n_prem=n_prem,
        n_prem_next=sum(1 for w in mgr.handles if w != TRAINER_ID))
    ctl.update(obs)
    logging.info(
        "seed window %.3fs: %d samples on the trainer's engine, hand-off at "
        "%.3fs, train wait %.3fs, remote wait %.3fs -> T_seed %.3fs, "
        "N_prem cap %s", t_seed, seeded, t_handoff - t0, train_wait,
        remote_wait, ctl.t_seed, ctl.n_prem_cap)
    metrics = {"workers/t_seed_s": t_seed, "workers/t_seed_next_s": ctl.t_seed,
               "workers/handoff_s": t_handoff - t0,
               "workers/seeded_samples": float(seeded),
               "workers/train_wait_s": train_wait,
               "workers/remote_wait_s": remote_wait,
               "workers/n_prem": n_prem}
    if ctl.n_prem_cap != float("inf"):
      metrics["workers/n_prem_cap"] = ctl.n_prem_cap
    return mgr.results(), metrics

  def _handoff(self, mgr) -> float | None:
    """The trainer leaves; its unfinished samples continue on the workers."""
    if not any(w != TRAINER_ID for w in mgr.handles):
      return None  # No worker to hand to: keep generating (colocated).
    mgr.remove(TRAINER_ID)
    self.worker.unload()
    return self.clock()
