"""Micro-batch streaming vs the whole-batch update, on elastic workers.

  python -m benchmarks.streaming [--quick]

One GRPO step of the default task's model (random weights: the phases
cost the same; response lengths then follow the stop token's chance under
a near-uniform policy, a long tail up to `max_new_tokens`) with its
rollout on 2 in-process workers of one device each, on 8 forced CPU
devices. Whole batch: the trainer's mesh waits for the last sample, then
repartitions, scores, takes log-probs and trains. Streamed (`rl.stream`,
`rl/train_stage.Streamed`, `rl/streaming.py`): the mesh switches to
the train layout at once and turns every `stream_parts`-th of the groups
into gradient sums as they complete, while the workers decode the rest.
Each repeat runs both on the same prompts and seed (the same samples),
after one warm-up step each (compilation).

Reported per mode, medians over repeats: the step, the rollout (until the
last sample), and the tail: from the last sample to the update applied,
the time streaming exists to shorten. The 8 fake devices and the workers
share 2 cores here, so the parts compete with decoding for the same CPU:
the tail ratio is the headline, the step ratio is not a target on this
machine. The losses of the two modes must agree (the same update).

`--smoke` (tests/test_benchmarks_smoke.py): 8 prompts, 8 new tokens, 2
parts, one repeat; the numbers mean nothing.

Last stdout line: JSON with `tail_vs_whole_batch`, `step_vs_whole_batch`,
`streamed_groups_fraction`, `loss_rel_diff`, ...
"""

from __future__ import annotations

import statistics
import sys

from absl import app
from absl import flags

from benchmarks import report
from benchmarks import timing

_QUICK = flags.DEFINE_bool("quick", False, "Fewer repeats.")
_REPEATS = flags.DEFINE_integer("repeats", 0, "0: 5 (--quick) or 9.")
_PROMPTS = flags.DEFINE_integer("prompts", 32, "Prompts per step.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 48, "Length cap.")
_PARTS = flags.DEFINE_integer("stream_parts", 4, "Parts per step.")
_SMOKE = flags.DEFINE_bool("smoke", False, "8 prompts, 8 tokens, one "
                           "repeat: that it runs (tests).")


def _config(stream: bool):
  from configs import tiny_grpo

  c = tiny_grpo.get_config("runlocal")
  n = _PROMPTS.value
  c.train.prompts_per_step = n
  c.rollout.update(num_rows=n, max_new_tokens=_MAX_NEW.value,
                   max_seq_len=max(c.rollout.prefill_buckets)
                   + 2 * _MAX_NEW.value)
  c.rl.update(num_minibatches=1,  # One update a step in both modes.
              stream=stream, stream_parts=_PARTS.value)
  c.rollout.workers.update(num=2, theta=2, poll_steps=4)
  c.mesh.offload = False  # Nothing parked in host memory between phases.
  return c


def _phases(co, step: int) -> dict:
  """Step, rollout and tail seconds from the step's timeline spans."""
  spans = [s for s in co.timeline.step_spans(step) if s.phase != "idle"]
  start = min(s.start for s in spans)
  end = max(s.end for s in spans)
  # The rollout ends with its last sample: the workers' span when streamed,
  # the trainer's otherwise (its only rollout span then).
  rollout_end = max(s.end for s in spans if s.phase == "rollout")
  return {"step_s": end - start, "rollout_s": rollout_end - start,
          "tail_s": end - rollout_end}


def main(argv):
  del argv
  if _SMOKE.value:
    timing.smoke_defaults(quick=True, repeats=1, prompts=8, max_new_tokens=8,
                          stream_parts=2)
  import jax
  timing.fake_cpu_devices(8)
  jax.config.update("jax_platforms", "cpu")
  import jax.numpy as jnp


  from rlhf_jax.timeline import Timeline
  from rlhf_jax.trainers import rl_job
  from rlhf_jax.trainers.rl_step import rl_step

  config = {m: _config(m == "streamed") for m in ("whole batch", "streamed")}
  jobs = {m: rl_job.build(c) for m, c in config.items()}
  base = jobs["whole batch"]
  prompts = next(base.iterator)
  ref = jax.tree.map(lambda x: jnp.array(x, copy=True), base.params)

  def run(mode):
    job = jobs[mode]
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), base.params)
    # A fresh timeline holds this run's step 1 only, at version 0.
    co = job.clock
    co.timeline, job.colocation.version = Timeline(None), 0
    job.rollout.iterator = iter([prompts])
    _, metrics = rl_step(job, 1, {"policy": job.learner.init_state(params),
                                  "ref": ref})
    return {**_phases(co, 1), **metrics}

  for mode in jobs:  # Warm-up: compilation.
    run(mode)
  repeats = _REPEATS.value or (5 if _QUICK.value else 9)
  results = {m: [] for m in jobs}
  for r in range(repeats):
    for mode in jobs:  # Interleaved: the shared machine's load hits both.
      results[mode].append(run(mode))
    w, s = results["whole batch"][-1], results["streamed"][-1]
    print(f"  repeat {r + 1}: tail {w['tail_s']:.3f}s -> {s['tail_s']:.3f}s, "
          f"step {w['step_s']:.3f}s -> {s['step_s']:.3f}s", flush=True)

  med = {m: {k: statistics.median(x[k] for x in rs)
             for k in ("step_s", "rollout_s", "tail_s")}
         for m, rs in results.items()}
  w, s = results["whole batch"][0], results["streamed"][0]
  lengths = w["rollout/response_len_mean"]
  n_groups = _PROMPTS.value
  streamed = statistics.median(x["stream/groups_during_rollout"]
                               for x in results["streamed"])
  print(f"\n{n_groups} prompts x {config['streamed'].rollout.samples_per_row}"
        f" samples, mean response {lengths:.1f} of {_MAX_NEW.value} tokens, "
        f"2 workers x 1 device, {_PARTS.value} parts; median of {repeats}")
  print(f"{'mode':<14}{'step s':>9}{'rollout s':>11}{'tail s':>9}")
  print("-" * 43)
  for m in jobs:
    print(f"{m:<14}{med[m]['step_s']:>9.3f}{med[m]['rollout_s']:>11.3f}"
          f"{med[m]['tail_s']:>9.3f}")
  print(f"groups trained before the last sample: {streamed:.0f} of "
        f"{n_groups}")
  def rel_diff(k):
    return abs(s[k] - w[k]) / max(abs(w[k]), 1e-12)
  loss_diff = rel_diff("train/loss")
  ratios = [x["tail_s"] / y["tail_s"] for x, y in
            zip(results["streamed"], results["whole batch"])]
  print(f"tail streamed / whole batch per repeat: "
        f"{[round(x, 2) for x in ratios]}; loss rel. diff {loss_diff:.1e}")
  summary = {
      "tail_vs_whole_batch": round(med["streamed"]["tail_s"]
                                   / med["whole batch"]["tail_s"], 3),
      "step_vs_whole_batch": round(med["streamed"]["step_s"]
                                   / med["whole batch"]["step_s"], 3),
      "streamed_groups_fraction": round(streamed / n_groups, 3),
      "loss_rel_diff": float(f"{loss_diff:.2e}"),
      "grad_norm_rel_diff": float(f"{rel_diff('train/grad_norm'):.2e}"),
      "median_s": med, "response_len_mean": round(float(lengths), 2),
      "repeats": repeats, "quick": _QUICK.value,
      "tail_ratios": [round(x, 3) for x in ratios]}
  sys.stdout.flush()
  report.emit(summary)


if __name__ == "__main__":
  app.run(main)
