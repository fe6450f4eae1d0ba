"""SFT warm-start: teacher forcing on task solutions with a small budget."""

from __future__ import annotations

from rlhf_jax.metrics import MetricWriter, Progress
from rlhf_jax.rl import objectives
from rlhf_jax.rl.learner import Learner, OptimConfig, make_optimizer


def run_sft(c, graphdef, params, layout, arrays_fn,
            writer: MetricWriter, *, verbose: bool = True):
  """Runs `c.steps` updates and returns the trained params.

  Args:
    c: the `sft` section (`config/sections.SFT`).
    graphdef: the model graph.
    params: initial params (train layout).
    layout: the train layout.
    arrays_fn: (start, batch_size) -> host arrays of SFT examples
      [start, start + batch_size) (`sft_arrays` of the data source), or None
      when the data has no SFT targets.
    writer: metric writer ("sft" phase).
    verbose: show progress.
  """
  if c.steps == 0:
    return params
  if arrays_fn is None:
    raise ValueError(f"config.sft.steps={c.steps} but the data source "
                     "(config.data.kind) has no SFT data; set "
                     "config.sft.steps=0")
  terms, weight = objectives.sft_terms()
  learner = Learner(graphdef, layout, make_optimizer(OptimConfig(
      learning_rate=c.learning_rate, warmup_steps=c.warmup_steps,
      grad_clip=c.grad_clip)), terms_fn=terms, weight_fn=weight,
      micro_batches=1)
  state = learner.init_state(params)
  progress = Progress(c.steps, name="sft", enabled=verbose)
  for step in range(1, c.steps + 1):
    batch = learner.put_batch(arrays_fn((step - 1) * c.batch_size,
                                        c.batch_size))
    state, metrics = learner.step(state, batch)
    if step % c.log_every == 0 or step == c.steps:
      record = writer.write("sft", step, {
          "sft/loss": metrics["loss"], "sft/accuracy": metrics["accuracy"]})
      progress.update(step, f"loss {record['sft/loss']:.3f}")
  return state.params
