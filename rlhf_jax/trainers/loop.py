"""The RL step loop of the RL job (`rl_job.py`), whatever its algorithm.

Resume order: (1) the newest intact checkpoint in the workdir (a damaged
one is moved aside, `Checkpointer.restore_latest`), else (2) a fresh start
(the job's SFT warm-start, itself resumable from `checkpoints_sft/`, and
initial states, evaluated and saved as step 0). Then steps until `train.steps`, evaluating every `eval.every`,
checkpointing every `train.checkpoint_every` and on SIGTERM/SIGINT. All
randomness derives from (seed, step), so a killed run restarted with the
same command writes the metrics an uninterrupted run would have. The
checkpoint is one dict of states; its "ref" entry (the frozen reference
policy; none for a LoRA policy, whose reference is its own base) waits in
host memory between uses.
"""

from __future__ import annotations

import os
import shutil
import signal
from typing import Any, Callable

import jax
import numpy as np
from absl import logging

from rlhf_jax import distributed, report
from rlhf_jax.config.sections import Logging
from rlhf_jax.errors import NonFiniteError
from rlhf_jax.metrics import MetricWriter, Progress
from rlhf_jax.parallel.colocate import Colocation
from rlhf_jax.step_clock import StepClock
from rlhf_jax.typed_config import from_partial
from rlhf_jax.trainers.sft import Stopped

States = dict[str, Any]


class StopFlag:
  """Set by SIGTERM/SIGINT (preemption): save and exit after this step.
  `close()` puts the previous handlers back."""

  def __init__(self):
    self.requested = False
    self._previous = {sig: signal.signal(sig, self._set)
                      for sig in (signal.SIGTERM, signal.SIGINT)}

  def _set(self, signum, frame):
    del frame
    logging.warning("signal %d: checkpointing after this step", signum)
    self.requested = True

  def close(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def workdir_outputs(config, workdir: str, keep: int):
  """(writer, checkpointer, is_main); process 0 writes."""
  from rlhf_jax.checkpoint import Checkpointer

  main_process = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  logs = from_partial(Logging, config.get("logging") or {}, "logging")
  wandb = None
  if logs.wandb == "offline":
    wandb = (config.to_dict(), logs.wandb_project,
             config.get("name") or os.path.basename(os.path.abspath(workdir)))
  writer = MetricWriter(workdir, enabled=main_process, wandb=wandb)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=keep)
  return writer, ckpt, main_process


def write_config(config, workdir: str) -> None:
  """config.json of the run (process 0), once its checkpoint restored: a
  run refused for another model or job leaves the workdir's as it was."""
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))


def run(config, workdir: str, *, train, eval_every: int, iterator,
        colocation: Colocation, clock: StepClock,
        fresh: Callable[[MetricWriter, bool, str, StopFlag], States],
        like: Callable[[], States],
        step: Callable[[int, States], tuple[States, dict]],
        evaluate: Callable[[States], dict], history=None,
        rollout=None) -> States:
  """Runs (or resumes) the loop; returns the final states (None when
  stopped by a signal during the warm-start).

  Args:
    config: the job's ConfigDict (saved as config.json).
    workdir: checkpoints, metrics, timeline and report go here.
    train: the `train` section (steps, checkpoint_every, keep_checkpoints).
    eval_every: evaluate every this many steps (and at the end).
    iterator: the train prompt iterator (its position is checkpointed).
    colocation: the job's training <-> rollout switch (parks the
      reference, counts weight versions).
    clock: the job's phases on its timeline (`step_clock.StepClock`).
    fresh: (writer, verbose, checkpoint_dir, stop) -> initial states (runs
      the warm-start, resumable from `checkpoint_dir`; raises
      `sft.Stopped` when `stop` is set).
    like: -> states with the shapes and shardings to restore into.
    step: (step, states) -> (states, host metrics) of one RL step.
    evaluate: states -> eval metrics.
    history: a per-prompt `LengthHistory` (the rollout's length-aware
      policies) saved in and restored from the checkpoint metadata, or None.
    rollout: the job's rollout (`rollout/step_rollouts.py`), or None:
      `start(step, states, meta)` once the states are restored or fresh
      (meta: the checkpoint's, {} when fresh), `dump(step, states)` ->
      metadata to save with a checkpoint (async RL's rollout holds still
      until `saved()`).
  """
  writer, ckpt, main_process = workdir_outputs(config, workdir,
                                               train.keep_checkpoints)
  stop = StopFlag()
  co, timeline = colocation, clock.timeline
  timeline.open(workdir, enabled=main_process)

  def do_eval(states):
    with clock.span("eval"):
      return evaluate(states)

  def save(s, states):
    extra = rollout.dump(s, states) if rollout is not None else {}
    meta = {**distributed.iterator_meta(iterator), **extra}
    if history is not None:
      meta["length_history"] = history.state_dict()
    ckpt.save(s, states, meta)
    if rollout is not None:
      rollout.saved()

  try:
    restored = ckpt.restore_latest(like())
    write_config(config, workdir)
    if restored is None:
      writer.truncate_after("rl", -1)
      timeline.truncate_after(-1)
      # The warm-start checkpoints to (and resumes from) sft_dir until RL
      # step 0 holds its result.
      sft_dir = os.path.join(workdir, "checkpoints_sft")
      states, start, meta = fresh(writer, main_process, sft_dir, stop), 0, {}
      writer.write("rl", 0, do_eval(states))
      save(0, states)
      ckpt.wait()
      if main_process:
        shutil.rmtree(sft_dir, ignore_errors=True)
    else:
      start, states, meta = restored
      distributed.restore_iterator(iterator, meta)
      if history is not None and "length_history" in meta:
        history.load_state_dict(meta["length_history"])
      writer.truncate_after("rl", start)
      timeline.truncate_after(start)
      logging.info("resumed from step %d", start)
    # Weight version v = the weights of step v.
    co.version = start
    if "ref" in states:
      states["ref"] = co.park(states["ref"])
    if rollout is not None:
      rollout.start(start, states, meta)

    total = train.steps
    progress = Progress(total, start, name="rl", enabled=main_process)
    for s in range(start + 1, total + 1):
      states, metrics = step(s, states)
      bad = {k: v for k, v in metrics.items()
             if k.endswith("/loss") and not np.isfinite(v)}
      if bad:
        raise NonFiniteError(
            f"non-finite loss at step {s}: {bad}; the last checkpoint "
            f"(step {ckpt.latest_step()}) is intact, so lower the learning "
            "rate or check the rewards and rerun the same command to resume")
      if s % eval_every == 0 or s == total:
        metrics.update(do_eval(states))
      record = writer.write("rl", s, metrics)
      progress.update(s, report.log_line(record))
      last = s == total or stop.requested
      if s % train.checkpoint_every == 0 or last:
        # With the checkpoint, not every step: the file holds every span
        # so far, and rewriting it each step grew with the run.
        timeline.write(png=True)
        save(s, states)
      if stop.requested:
        logging.warning("stopped after step %d (checkpointed); rerun the "
                        "same command to resume", s)
        return states
  except Stopped as e:
    logging.warning("%s; rerun the same command to resume", e)
    return None
  finally:  # Also on errors: Orbax's threads end before the interpreter.
    stop.close()
    ckpt.close()
    writer.close()
  if main_process:
    report.finish(writer.read(), workdir)
  return states

