"""Adaptive offload (RLBoost Algorithm 1): the trainer's mesh seeds, then
hands its unfinished samples to the rollout workers.

Each step the trainer's own rollout engine joins the manager as one more
worker (already holding the step's weights, so it pulls nothing) and
generates beside the remote workers for a window T_seed. Then it leaves
(`RolloutManager.remove`): its unfinished samples continue on the workers
from the tokens it streamed (the preemption path, so the finished tokens
are those of an uninterrupted run) and the trainer's devices are free for
the training side of the step. The trainer's engine runs the decode loop
of the job's `LocalRollout` (`start_driver`): with the long-tail policies
on, it consolidates its own tail onto fewer replicas while it seeds.

After the step, `sched.offload.SeedWindowController` moves T_seed by
(t_train_wait - t_remote_wait) / eta and caps the worker count N_prem:
  t_train_wait   the trainer's mesh waiting for samples after the hand-off
                 (it would rather have kept generating: T_seed grows);
  t_remote_wait  mean idle of the remote workers after their last response
                 of the step (they ran out of work: T_seed shrinks);
  t_train        the trainer's training time (previous step's train span);
  t_remote       mean busy time per remote worker.
With micro-batch streaming (`rl/train_stage.Streamed`) the trainer
trains on finished groups during that wait, and t_train_wait counts only
the poll rounds that began with no part in flight (`trainer_busy`);
without it the wait is pure idle and the controller settles where the
hand-off meets the end of the remote work.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Sequence

import numpy as np
from absl import logging

from rlhf_jax.samples import Request, Sample
from rlhf_jax.sched import offload
from rlhf_jax.workers import manager as manager_lib
from rlhf_jax.workers.worker import RolloutWorker

TRAINER_ID = "trainer"


class SeedWindow:
  """Runs one batch with the trainer's engine seeding for T_seed seconds."""

  def __init__(self, local, controller: offload.SeedWindowController,
               clock=time.perf_counter):
    """`local`: the job's `rollout.local.LocalRollout` (the trainer's
    engines and decode policies)."""
    self.local = local
    self.worker = RolloutWorker(TRAINER_ID, None,
                                engine=local.engines.engine(),
                                start_driver=local.start_driver)
    self.controller, self.clock = controller, clock
    self.runs = 0
    self.handed_off = False
    self.metrics: dict[str, float] = {}

  @property
  def worker_cap(self) -> float | None:
    """N_prem: the most remote workers worth holding next step (None: no
    bound yet). `DemandScaler.begin(cap=...)` applies it."""
    cap = self.controller.n_prem_cap
    return None if cap == float("inf") else cap

  def rounds(self, mgr: manager_lib.RolloutManager, params, version: int,
             requests: Sequence[Request], common_prefix: np.ndarray,
             train_s: float | None = None,
             trainer_busy: Callable[[], bool] | None = None
             ) -> Iterator[list[Sample]]:
    """Yields each poll round's finished samples until the batch is done;
    `handed_off` turns True once the trainer's devices left; `metrics`
    then holds the window's measurements.

    Args:
      mgr: the manager with the remote workers (the trainer joins it).
      params: the step's policy, on device in the engine's layout.
      version: the weight version `params` are (the newest published).
      requests: the batch.
      common_prefix: the batch's shared prefix (empty: none).
      train_s: the trainer's last training time (for the N_prem cap).
      trainer_busy: whether the trainer's devices have work in flight
        (streamed training); rounds they are busy are not a train wait.
    """
    ctl = self.controller
    t_seed = ctl.t_seed
    self.runs += 1
    self.handed_off = False
    if self.runs <= 2:
      # The first step after a (re)start trains with compilation, so the
      # second run's train time would set a cap far too low: no cap yet.
      train_s = None
    self.worker.common_prefix = np.asarray(common_prefix, np.int32)
    self.worker.install(version, params)
    self._tail_stats = {}
    handle = manager_lib.LocalHandle(self.worker)
    mgr.start(requests, common_prefix=common_prefix)
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
        waiting = t_handoff is not None and not (trainer_busy and
                                                 trainer_busy())
        start = self.clock()
        finished = mgr.step()
        now = self.clock()
        if waiting:  # The trainer's devices had nothing to do this round.
          train_wait += now - start
        rounds += 1
        remote_rounds += sum(1 for w in mgr.handles if w != TRAINER_ID)
        for w, n in mgr.produced.items():
          if n != produced.get(w, 0):
            if w == TRAINER_ID:
              seeded += n - produced.get(w, 0)
            else:
              last[w] = now
        produced = dict(mgr.produced)
        yield finished
    finally:
      if TRAINER_ID in mgr.handles:
        self._leave(mgr)
    t_done = self.clock()
    if t_handoff is None:  # The trainer's engine finished the batch alone.
      t_handoff = t_done
    self.handed_off = True
    remote_wait = (sum(t_done - t for t in last.values()) / len(last)
                   if last else 0.0)
    remote_busy = (sum(t - t0 for t in last.values()) / len(last)
                   if last else 0.0)
    n_prem = remote_rounds / max(1, rounds)
    ctl.update(offload.StepObservation(
        t_train_wait=train_wait, t_remote_wait=remote_wait,
        t_train=train_s or 0.0, t_remote=remote_busy, n_prem=n_prem,
        n_prem_next=sum(1 for w in mgr.handles if w != TRAINER_ID)))
    logging.info(
        "seed window %.3fs: %d samples on the trainer's engine, hand-off at "
        "%.3fs, train wait %.3fs, remote wait %.3fs -> T_seed %.3fs, "
        "N_prem cap %s", t_seed, seeded, t_handoff - t0, train_wait,
        remote_wait, ctl.t_seed, ctl.n_prem_cap)
    self.metrics = {
        "workers/t_seed_s": t_seed, "workers/t_seed_next_s": ctl.t_seed,
        "workers/handoff_s": t_handoff - t0,
        "workers/seeded_samples": float(seeded),
        "workers/train_wait_s": train_wait,
        "workers/remote_wait_s": remote_wait, "workers/n_prem": n_prem,
        **self._tail_stats}
    if ctl.n_prem_cap != float("inf"):
      self.metrics["workers/n_prem_cap"] = ctl.n_prem_cap

  def _handoff(self, mgr) -> float | None:
    """The trainer leaves; its unfinished samples continue on the workers."""
    if not any(w != TRAINER_ID for w in mgr.handles):
      return None  # No worker to hand to: keep generating (colocated).
    self._leave(mgr)
    self.handed_off = True
    return self.clock()

  def _leave(self, mgr) -> None:
    """Removes the trainer's worker; keeps its decode policies' counts."""
    driver = self.worker.driver
    ctl = driver.controller if driver is not None else None
    if ctl is not None and hasattr(ctl, "stats"):
      self._tail_stats = {k: float(v) for k, v in ctl.stats().items()}
    mgr.remove(TRAINER_ID)
    self.worker.unload()
