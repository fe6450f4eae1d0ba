"""SFT warm-start: teacher forcing on task solutions with a small budget."""

from __future__ import annotations

import numpy as np

from rlhf_jax.config import sections
from rlhf_jax.errors import ConfigError, NonFiniteError
from rlhf_jax.metrics import MetricWriter, Progress
from rlhf_jax.rl import objectives
from rlhf_jax.rl.learner import Learner, OptimConfig, make_optimizer


class Stopped(Exception):
  """SIGTERM/SIGINT arrived during the warm-start; its state is saved."""


def run_sft(c, graphdef, params, layout, arrays_fn,
            writer: MetricWriter, *, verbose: bool = True,
            checkpoint_dir: str | None = None, stop=None):
  """Runs `c.steps` updates and returns the trained params.

  Args:
    c: the `sft` section (`config/sections.SFT`).
    graphdef: the model graph.
    params: initial params (train layout).
    layout: the train layout.
    arrays_fn: (start, batch_size) -> host arrays of SFT examples
      [start, start + batch_size) (`sft_arrays` of the data source), or None
      when the data has no SFT data.
    writer: metric writer ("sft" phase).
    verbose: show progress.
    checkpoint_dir: resume from and save to this directory (every
      `c.checkpoint_every` steps and on `stop`); None: no checkpoints.
    stop: a `loop.StopFlag`; when it is set the state is saved and
      `Stopped` raised.
  """
  if c.steps == 0:
    return params
  if arrays_fn is None:
    raise ConfigError(f"config.sft.steps={c.steps} but the data source "
                      "(config.data.kind) has no SFT data; set "
                      "config.sft.steps=0")
  terms, weight = objectives.sft_terms(sections.router_loss(c))
  learner = Learner(graphdef, layout, make_optimizer(OptimConfig(
      learning_rate=c.learning_rate, warmup_steps=c.warmup_steps,
      grad_clip=c.grad_clip)), terms_fn=terms, weight_fn=weight,
      micro_batches=1)
  state, start, ckpt = learner.init_state(params), 0, None
  if checkpoint_dir is not None:
    from rlhf_jax.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
    ckpt = Checkpointer(checkpoint_dir, keep=2)
    if (restored := ckpt.restore_latest(state)) is not None:
      start, state, _ = restored
  writer.truncate_after("sft", start)
  progress = Progress(c.steps, start, name="sft", enabled=verbose)
  try:
    for step in range(start + 1, c.steps + 1):
      batch = learner.put_batch(arrays_fn((step - 1) * c.batch_size,
                                          c.batch_size))
      state, metrics = learner.step(state, batch)
      stopping = stop is not None and stop.requested
      saving = ckpt is not None and step < c.steps and (
          stopping or step % c.checkpoint_every == 0)
      log = step % c.log_every == 0 or step == c.steps
      # The loss is fetched (a host sync) only to log it or before a save.
      if (log or saving) and not np.isfinite(float(metrics["loss"])):
        raise NonFiniteError(
            f"non-finite SFT loss at step {step}: lower "
            f"config.sft.learning_rate (now {c.learning_rate}) and rerun "
            "the same command: it resumes from the last SFT checkpoint")
      if log:
        record = writer.write("sft", step, {
            f"sft/{k}": v for k, v in metrics.items()
            if k == "loss" or k == "accuracy" or k.startswith(
                ("expert_tokens_", "moe_"))})
        progress.update(step, f"loss {record['sft/loss']:.3f}")
      if saving:
        ckpt.save(step, state, {"step": step})
      if stopping:
        raise Stopped(f"stopped during the SFT warm-start after step {step}")
  finally:
    if ckpt is not None:
      ckpt.close()
  return state.params
