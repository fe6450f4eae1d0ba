"""The real model on this machine: rollout vs transformers, train FLOP/s.

  python -m benchmarks.real_model [--quick] [--config=configs/smollm2_grpo.py]
      [--out=benchmarks/results/real_model_cpu.json]

Needs the fetched model (`python -m rlhf_jax.fetch smollm2-135m-instruct`).
In one run, on the config's model and batch (its first training prompts,
`rollout.samples_per_row` samples each, `rollout.max_new_tokens` tokens):

- rollout: our paged engine and `transformers.generate` (float32, sampling
  at the config's temperature) decode the same prompts, every sample to
  exactly `max_new_tokens` tokens (no stop token on either side, so both
  do the same work); tokens/s of each, median of the timed runs after one
  untimed run (our compile; torch's warm-up). The baseline is transformers
  on this CPU with its default threads.
- train: the GRPO job of the config (`trainers/grpo.py`: packed rows,
  shared prompts) runs a few whole steps; the train phase's achieved FLOP/s
  is 3x the forward FLOPs of the positions it computed on (`train/positions`,
  padding included: the work done, not the useful work) over its time
  (`perf/train_s`), median over the steps after the first (compiles); the
  useful FLOP/s counts only the non-padding positions. Both are set against
  this machine's float32 matmul rate, measured in the same run (a jitted
  2048^3 matmul, median of 5).

Report, no gate. Last stdout line: JSON with `rollout_vs_transformers` (our
tokens/s over transformers'), `train_vs_matmul_peak` (achieved train
FLOP/s over the matmul rate) and the figures behind them.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

from benchmarks import report

_CONFIG = flags.DEFINE_string("config", "configs/smollm2_grpo.py",
                              "The job's config (with :args).")
_QUICK = flags.DEFINE_bool("quick", False, "One timed rollout per side and "
                           "3 RL steps (< 10 minutes here).")
_SMOKE = flags.DEFINE_bool("smoke", False, "The config's :runlocal variant (a "
                           "tiny random model; tests/test_benchmarks_smoke.py)"
                           ": that it runs, not a measurement.")


def _median_s(fn, runs: int) -> float:
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def matmul_flops_per_s(runs: int = 5, n: int = 2048) -> float:
  """float32 matmul rate of the default device (a jitted n^3 product)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  f = jax.jit(jnp.matmul)
  f(a, b).block_until_ready()
  return 2 * n**3 / _median_s(lambda: f(a, b).block_until_ready(), runs)


def _prompts(job, count: int) -> list[np.ndarray]:
  batch = next(job.source.iterator)
  return [batch.tokens_NxP[n, :batch.lengths_N[n]]
          for n in range(min(count, len(batch.lengths_N)))]


def ours_rollout(job, prompts, runs: int) -> dict:
  """Tokens/s of the paged engine on `prompts` x G samples, fixed length."""
  from rlhf_jax.samples import Request  # pylint: disable=g-import-not-at-top
  from rlhf_jax.engine.engine import Engine  # pylint: disable=g-import-not-at-top
  from rlhf_jax.engine.driver import Driver  # pylint: disable=g-import-not-at-top
  from rlhf_jax.engine.sampling import SamplingParams  # pylint: disable=g-import-not-at-top
  from rlhf_jax.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  c = job.c
  G, M = c.rollout.samples_per_row, c.rollout.max_new_tokens
  layout = job.rollout_layout
  sampling = SamplingParams(temperature=c.rollout.temperature,
                            max_new_tokens=M, stop_tokens=())
  page = c.rollout.page_size
  pages = len(prompts) * (G + 1) * -(-c.rollout.max_seq_len // page)
  engine = Engine(job.cfg, job.graphdef, layout,
                       num_slots=len(prompts) * G, samples_per_group=G,
                       prefill_buckets=tuple(c.rollout.prefill_buckets),
                       sampling=sampling, page_size=page, num_pages=pages)
  driver = Driver(engine, mesh_lib.to_layout(job.params, layout))
  seed = [0]

  def run():
    seed[0] += 1
    samples = list(driver.run([Request(i, p, num_samples=G, seed=seed[0])
                               for i, p in enumerate(prompts)]))
    assert all(len(s.tokens) == M for s in samples), "a sample stopped early"
  run()  # Compiles.
  seconds = _median_s(run, runs)
  return dict(seconds=round(seconds, 3),
              tokens_per_s=round(len(prompts) * G * M / seconds, 1))


def transformers_rollout(model_dir: str, c, prompts, runs: int) -> dict:
  """Tokens/s of `transformers.generate` on the same batch."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  G, M = c.rollout.samples_per_row, c.rollout.max_new_tokens
  model = transformers.AutoModelForCausalLM.from_pretrained(
      model_dir, dtype=torch.float32).eval()
  width = max(len(p) for p in prompts)
  pad = 0
  input_ids = torch.tensor([[pad] * (width - len(p)) + p.tolist()
                            for p in prompts])
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p)
                       for p in prompts])
  torch.manual_seed(0)

  def run():
    with torch.no_grad():
      out = model.generate(
          input_ids=input_ids, attention_mask=mask, do_sample=True,
          temperature=c.rollout.temperature, top_k=0, top_p=1.0,
          num_return_sequences=G, max_new_tokens=M, min_new_tokens=M,
          pad_token_id=pad)
    assert out.shape == (len(prompts) * G, width + M), out.shape
  run()  # Warm-up.
  seconds = _median_s(run, runs)
  return dict(seconds=round(seconds, 3),
              tokens_per_s=round(len(prompts) * G * M / seconds, 1),
              torch_threads=torch.get_num_threads())


def train_flops(job, steps: int) -> dict:
  """Whole RL steps of the job; the train phase's FLOP/s after step 1."""
  from rlhf_jax.sched.cost_model.profiles import profile_of  # pylint: disable=g-import-not-at-top
  from rlhf_jax.trainers.rl_step import rl_step  # pylint: disable=g-import-not-at-top
  states = job.fresh_states(job.params)  # The policy and a reference copy.
  records = []
  for step in range(1, steps + 1):
    states, metrics = rl_step(job, step, states)
    records.append(metrics)
    print(f"step {step}: train {metrics['perf/train_s']:.2f} s, positions "
          f"{metrics['train/positions']:.0f} (padding "
          f"{metrics['train/padding_fraction']:.0%}), step "
          f"{metrics['perf/step_s']:.2f} s", flush=True)
  timed = records[1:]
  profile = profile_of(job.cfg)
  # Forward FLOPs per position at a packed row's mean context (half of a
  # row), times 3 for forward + backward.
  context = job.c.rl.pack_length / 2 if job.c.rl.pack_length else (
      job.source.prompt_len + job.c.rollout.max_new_tokens) / 2
  per_position = 3 * profile.fwd_flops_per_token(context)
  achieved = [per_position * r["train/positions"] / r["perf/train_s"]
              for r in timed]
  useful = [a * (1 - r["train/padding_fraction"])
            for a, r in zip(achieved, timed)]
  return dict(steps=steps, first_step_s=round(records[0]["perf/step_s"], 2),
              train_s=round(statistics.median(r["perf/train_s"]
                                              for r in timed), 3),
              step_s=round(statistics.median(r["perf/step_s"]
                                             for r in timed), 3),
              positions=statistics.median(r["train/positions"] for r in timed),
              padding_fraction=round(statistics.median(
                  r["train/padding_fraction"] for r in timed), 4),
              flops_per_s=statistics.median(achieved),
              useful_flops_per_s=statistics.median(useful))


def main(argv):
  del argv
  from rlhf_jax import cli  # pylint: disable=g-import-not-at-top
  from rlhf_jax.data import sources  # pylint: disable=g-import-not-at-top
  from rlhf_jax.trainers import rl_job  # pylint: disable=g-import-not-at-top
  quick = _QUICK.value or _SMOKE.value
  runs = 1 if quick else 3
  spec = _CONFIG.value + (":runlocal" if _SMOKE.value else "")
  config = cli._load_config(report.repo_path(spec))  # pylint: disable=protected-access
  # :runlocal's tiny model is written here (nothing for the real config).
  config = sources.prepare(config, tempfile.mkdtemp(prefix="real_model_"))
  config.mesh.num_devices = 1  # One device: what the job runs on here.
  if not os.path.isdir(config.model.path):
    raise SystemExit(f"error: config.model.path={config.model.path!r} is "
                     "not there: run `python -m rlhf_jax.fetch "
                     "smollm2-135m-instruct` first")
  job = rl_job.build(config)
  matmul = matmul_flops_per_s()
  print(f"float32 matmul rate: {matmul / 1e9:.1f} GFLOP/s", flush=True)
  prompts = _prompts(job, config.train.prompts_per_step)
  ours = ours_rollout(job, prompts, runs)
  theirs = transformers_rollout(config.model.path, job.c, prompts, runs)
  train = train_flops(job, 2 if _SMOKE.value else 3 if quick else 5)
  c = job.c
  print(f"rollout: {len(prompts)} prompts x {c.rollout.samples_per_row} "
        f"samples x {c.rollout.max_new_tokens} tokens")
  print(f"{'':<28}{'seconds':>10}{'tokens/s':>10}")
  print(f"{'rlhf_jax paged engine':<28}{ours['seconds']:>10.2f}"
        f"{ours['tokens_per_s']:>10.1f}")
  print(f"{'transformers.generate':<28}{theirs['seconds']:>10.2f}"
        f"{theirs['tokens_per_s']:>10.1f}")
  print(f"train: {train['train_s']:.2f} s per step, "
        f"{train['flops_per_s'] / 1e9:.1f} GFLOP/s achieved "
        f"({train['useful_flops_per_s'] / 1e9:.1f} useful), matmul "
        f"{matmul / 1e9:.1f} GFLOP/s")
  report.emit(dict(
      rollout_vs_transformers=round(
          ours["tokens_per_s"] / theirs["tokens_per_s"], 3),
      train_vs_matmul_peak=round(train["flops_per_s"] / matmul, 3),
      useful_train_vs_matmul_peak=round(
          train["useful_flops_per_s"] / matmul, 3),
      matmul_gflop_per_s=round(matmul / 1e9, 2),
      rollout=dict(prompts=len(prompts), samples=c.rollout.samples_per_row,
                   new_tokens=c.rollout.max_new_tokens, ours=ours,
                   transformers=theirs),
      train={**{k: v for k, v in train.items() if "flops" not in k},
             "gflop_per_s": round(train["flops_per_s"] / 1e9, 2),
             "useful_gflop_per_s": round(
                 train["useful_flops_per_s"] / 1e9, 2)},
      config=spec, quick=quick))


if __name__ == "__main__":
  app.run(main)
