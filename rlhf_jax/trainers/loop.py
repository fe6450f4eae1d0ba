"""The RL step loop shared by the GRPO and PPO jobs.

Resume order: (1) the latest checkpoint in the workdir, else (2) a fresh
start (the job's SFT warm-start and initial states, evaluated and saved as
step 0). Then steps until `train.steps`, evaluating every `eval.every`,
checkpointing every `train.checkpoint_every` and on SIGTERM/SIGINT. All
randomness derives from (seed, step), so a killed run restarted with the
same command writes the metrics an uninterrupted run would have. The
checkpoint is one dict of states; its "ref" entry (the frozen reference
policy) waits in host memory between uses.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable

import jax
import numpy as np
from absl import logging

from rlhf_jax import distributed, report
from rlhf_jax.metrics import MetricWriter, Progress
from rlhf_jax.parallel.colocate import Colocation

States = dict[str, Any]


class StopFlag:
  """Set by SIGTERM/SIGINT (preemption): save and exit after this step."""

  def __init__(self):
    self.requested = False
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, self._set)

  def _set(self, signum, frame):
    del frame
    logging.warning("signal %d: checkpointing after this step", signum)
    self.requested = True


def workdir_outputs(config, workdir: str, keep: int):
  """(writer, checkpointer, is_main): config.json saved, process 0 writes."""
  from rlhf_jax.checkpoint import Checkpointer

  main_process = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  if main_process:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  writer = MetricWriter(workdir, enabled=main_process)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=keep)
  return writer, ckpt, main_process


def run(config, workdir: str, *, train, eval_every: int, iterator,
        colocation: Colocation,
        fresh: Callable[[MetricWriter, bool], States],
        like: Callable[[], States],
        step: Callable[[int, States], tuple[States, dict]],
        evaluate: Callable[[States], dict], history=None) -> States:
  """Runs (or resumes) the loop; returns the final states.

  Args:
    config: the job's ConfigDict (saved as config.json).
    workdir: checkpoints, metrics, timeline and report go here.
    train: the `train` section (steps, checkpoint_every, keep_checkpoints).
    eval_every: evaluate every this many steps (and at the end).
    iterator: the train prompt iterator (its position is checkpointed).
    colocation: the job's training <-> rollout switch; owns the timeline.
    fresh: (writer, verbose) -> initial states (runs the warm-start).
    like: -> states with the shapes and shardings to restore into.
    step: (step, states) -> (states, host metrics) of one RL step.
    evaluate: states -> eval metrics.
    history: a per-prompt `LengthHistory` (the rollout's length-aware
      policies) saved in and restored from the checkpoint metadata, or None.
  """
  writer, ckpt, main_process = workdir_outputs(config, workdir,
                                               train.keep_checkpoints)
  stop = StopFlag()
  co = colocation
  co.timeline.open(workdir, enabled=main_process)

  def do_eval(states):
    with co.span("eval"):
      return evaluate(states)

  def save(s, states):
    meta = distributed.iterator_meta(iterator)
    if history is not None:
      meta["length_history"] = history.state_dict()
    ckpt.save(s, states, meta)

  start = ckpt.latest_step()
  if start is None:
    writer.truncate_after("sft", -1)
    writer.truncate_after("rl", -1)
    co.timeline.truncate_after(-1)
    states, start = fresh(writer, main_process), 0
    writer.write("rl", 0, do_eval(states))
    save(0, states)
  else:
    states, meta = ckpt.restore(start, like())
    distributed.restore_iterator(iterator, meta)
    if history is not None and "length_history" in meta:
      history.load_state_dict(meta["length_history"])
    writer.truncate_after("rl", start)
    co.timeline.truncate_after(start)
    logging.info("resumed from step %d", start)
  # Weight version v = the weights of step v.
  co.version = start
  states["ref"] = co.park(states["ref"])

  total = train.steps
  progress = Progress(total, start, name="rl", enabled=main_process)
  for s in range(start + 1, total + 1):
    states, metrics = step(s, states)
    bad = {k: v for k, v in metrics.items()
           if k.endswith("/loss") and not np.isfinite(v)}
    if bad:
      raise FloatingPointError(
          f"non-finite loss at step {s}: {bad}; the last checkpoint "
          f"(step {ckpt.latest_step()}) is intact, so lower the learning "
          "rate or check the rewards and rerun the same command to resume")
    if s % eval_every == 0 or s == total:
      metrics.update(do_eval(states))
    record = writer.write("rl", s, metrics)
    progress.update(s, report.log_line(record))
    last = s == total or stop.requested
    co.timeline.write(png=s % train.checkpoint_every == 0 or last)
    if s % train.checkpoint_every == 0 or last:
      save(s, states)
    if stop.requested:
      break
  ckpt.close()
  writer.close()
  if main_process and not stop.requested:
    report.finish(writer.read(), workdir)
  return states
