"""Long-tailed rollout + scoring: static vs continuous vs ours, and the sim.

  python -m benchmarks.long_tail [--quick]

Setting: a tiny random model on 8 forced CPU devices, rollout layout 8
replicas x TP 1, `rows_per_replica` rows of G samples each. Response
lengths are long-tailed by construction: each prompt draws a mean from a
lognormal, each of its G samples a length from a lognormal around that
mean, clipped to [1, max_new_tokens]; the stop rule forces them
(`Request.max_new_tokens_per_sample`: sample i ends after its drawn number
of tokens). Scoring is a reference-model forward over prompt + response of
each finished sample (chunks of `score_chunk`, batch split over the scoring
devices' replicas).

Modes, each on the same trace (`engine/long_tail.LongTailRollout`):
  static      a new wave of prompts only once every row is free (FIFO), then
              scoring of the whole batch;
  continuous  a prompt enters any row as soon as it frees (FIFO), then
              scoring of the whole batch;
  ours        continuous + longest-predicted first on the least-loaded
              replica (length history from one earlier epoch of the same
              prompts) + consolidation at R_t onto fewer replicas + scoring
              fused into decoding.
Wall time of the rollout+scoring phase is the median over repeats after a
warm-up run that compiles everything. Idle fraction: per-replica timeline
tracks (a replica with no live sample, and not scoring, is idle).

Simulator: `rlhf_jax/sim/rows.py` replays the same length trace through the
same row-level policies with unit costs measured here (decode step time per
engine size, prefill, scoring chunk, the consolidation move) and predicts
the speedup of ours over static; the JSON reports both and the error.

Last stdout line: JSON with `speedup_vs_static`, `speedup_vs_continuous`,
`idle_fraction_static`, `idle_fraction_continuous`, `idle_fraction_ours`,
`sim_speedup_vs_static`, `sim_error`.
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app
from absl import flags
import numpy as np

_QUICK = flags.DEFINE_bool("quick", False, "Fewer prompts and repeats.")
_PROMPTS = flags.DEFINE_integer("prompts", 0, "0: 48 (--quick) or 96.")
_REPEATS = flags.DEFINE_integer("repeats", 0, "0: 2 (--quick) or 5.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 96, "Length cap M.")
_G = flags.DEFINE_integer("samples_per_row", 4, "Samples per prompt G.")
_RPR = flags.DEFINE_integer("rows_per_replica", 2, "Rows per replica.")
_MEDIAN = flags.DEFINE_float("median_len", 8.0, "Median prompt mean length.")
_R_T = flags.DEFINE_float("consolidate_below", 0.2, "R_t of ours.")
_CHUNK = flags.DEFINE_integer("score_chunk", 8, "Samples per scoring chunk.")
_SEED = flags.DEFINE_integer("seed", 0, "Trace seed.")

PROMPT_LEN = 16


class RefScorer:
  """Reference-model max logit over prompt + response, chunk by chunk."""

  def __init__(self, graphdef, params, seq_len, chunk):
    import jax
    import jax.numpy as jnp
    from rlhf_jax.models import model as model_lib

    self.params, self.placed = params, {}
    self.seq_len, self.chunk = seq_len, chunk

    def score(params, toks_BxT):
      pos = jnp.broadcast_to(jnp.arange(toks_BxT.shape[1]), toks_BxT.shape)
      logits = model_lib.forward(graphdef, params, toks_BxT, pos,
                                 toks_BxT > 0)
      return jnp.max(logits, axis=(1, 2))

    self._jit = jax.jit(score)
    self._jax = jax

  def score(self, samples, layout):
    jax = self._jax
    if layout not in self.placed:
      self.placed[layout] = jax.device_put(
          self.params, layout.param_shardings(self.params))
    toks = np.zeros((self.chunk, self.seq_len), np.int32)
    for i, s in enumerate(samples):
      seq = np.concatenate([s.prompt_tokens, s.tokens])[:self.seq_len]
      toks[i, :seq.size] = seq
    toks = jax.device_put(toks, layout.sharding(("batch", None), toks.shape))
    return self._jit(self.placed[layout], toks)[:len(samples)]


def _median_time(fn, n=5):
  import jax
  jax.block_until_ready(fn())  # Compiled already; one more warm call.
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _time_steps(lt, params, m):
  """Seconds per decode step of the m-replica engine (state reused)."""
  eng = lt.engine(m)
  p = lt.params_for(params, m)
  box = [eng.init_decode_state()]

  def step():
    box[0], res = eng.generate(p, box[0])
    return res.data
  return _median_time(step, n=10)


def _time_prefill(lt, params, requests):
  """Seconds of one prompt's prefill + insert on the full engine."""
  eng = lt.engine(lt.replicas)
  box = [eng.init_decode_state()]
  req = requests[0]
  padded, n = eng.pad_prompt(req.tokens, req.prompt_id)

  def admit():
    prefix = eng.prefill_multisampling(params, padded, n, req.num_samples,
                                       prompt_id=req.prompt_id, seed=req.seed)
    eng._row_slots[0] = set()  # pylint: disable=protected-access
    box[0] = eng.bulk_insert(prefix, box[0], eng.slots_of_row[0][
        :req.num_samples])
    return box[0].tokens
  return _median_time(admit)


def _time_score(scorer, samples, layout):
  """Seconds of one scoring chunk on the full layout."""
  chunk = samples[:scorer.chunk]
  return _median_time(lambda: scorer.score(chunk, layout))


def main(argv):
  del argv
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  jax.config.update("jax_platforms", "cpu")
  from rlhf_jax.engine.driver import Request
  from rlhf_jax.engine.long_tail import LongTailRollout, TailConfig
  from rlhf_jax.engine.sampling import SamplingParams
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.models.config import ModelConfig
  from rlhf_jax.parallel import mesh as mesh_lib
  from rlhf_jax.sched.length_history import LengthHistory
  from rlhf_jax.sim import rows as sim_rows
  from rlhf_jax.sim import workload

  t_start = time.perf_counter()
  n_prompts = _PROMPTS.value or (48 if _QUICK.value else 96)
  repeats = _REPEATS.value or (2 if _QUICK.value else 5)
  G, M, rpr = _G.value, _MAX_NEW.value, _RPR.value
  cfg = ModelConfig.tiny(vocab_size=256)
  mesh = mesh_lib.make_mesh(fsdp=8)
  layout = mesh_lib.rollout_layout(mesh, 1)
  graphdef, params = model_lib.init_params(cfg, 0, mesh_lib.train_layout(mesh))
  params = jax.device_put(params, layout.param_shardings(params))
  _, ref = model_lib.init_params(cfg, 1, mesh_lib.train_layout(mesh))
  ref = jax.device_put(ref, layout.param_shardings(ref))
  trace = workload.long_tailed_lengths(n_prompts, G, M, _MEDIAN.value,
                                       _SEED.value)
  rng = np.random.default_rng(_SEED.value + 1)
  requests = [Request(p, rng.integers(3, 256, int(rng.integers(4, PROMPT_LEN))),
                      num_samples=G, seed=11,
                      max_new_tokens_per_sample=tuple(int(x) for x in row))
              for p, row in enumerate(trace)]
  sampling = SamplingParams(temperature=1.0, max_new_tokens=M)
  modes = {
      "static": TailConfig(admission="static", assignment="fifo",
                           consolidate_below=0.0, fusion=False,
                           score_chunk=_CHUNK.value),
      "continuous": TailConfig(assignment="fifo", consolidate_below=0.0,
                               fusion=False, score_chunk=_CHUNK.value),
      "ours": TailConfig(assignment="length",
                         consolidate_below=_R_T.value, migration="kv",
                         fusion=True, score_chunk=_CHUNK.value),
  }
  scorer = RefScorer(graphdef, ref, PROMPT_LEN + M, _CHUNK.value)
  results, rollouts = {}, {}
  for name, tail in modes.items():
    lt = LongTailRollout(cfg, graphdef, layout, rows_per_replica=rpr,
                         samples_per_row=G, prefill_buckets=(PROMPT_LEN,),
                         sampling=sampling, tail=tail,
                         history=LengthHistory(1.0))
    # Warm-up: epoch 1 fills the length history; epoch 2 compiles the
    # engines and moves the measured runs use (same decisions from then on).
    for _ in range(2):
      lt.run(params, requests, scorer=scorer)
    runs = [lt.run(params, requests, scorer=scorer) for _ in range(repeats)]
    rollouts[name] = lt
    walls = [r.stats["rollout/wall_s"] for r in runs]
    mid = runs[int(np.argsort(walls)[len(walls) // 2])]
    results[name] = dict(wall_s=statistics.median(walls), stats=mid.stats,
                         samples=len(mid.samples), scores=len(mid.scores),
                         sample_list=mid.samples)
    print(f"  {name}: {statistics.median(walls):.2f}s "
          f"({time.perf_counter() - t_start:.0f}s)", flush=True)

  # Unit costs for the simulator, measured on the same engines.
  ours = rollouts["ours"]
  step_s = {m: _time_steps(ours, params, m) for m in ours.sizes}
  prefill_s = _time_prefill(ours, params, requests)
  score_s = _time_score(scorer, results["static"]["sample_list"], layout)
  o_stats = results["ours"]["stats"]
  move_s = o_stats["rollout/move_s"] / max(1, o_stats["rollout/consolidations"])
  costs = sim_rows.UnitCosts(step_s=step_s, prefill_s=prefill_s,
                             score_s=score_s, move_s=move_s)
  sim = {name: sim_rows.simulate(trace, replicas=8, rows_per_replica=rpr,
                                 policy=name, costs=costs,
                                 consolidate_below=_R_T.value,
                                 score_chunk=_CHUNK.value)
         for name in modes}
  live_speedup = results["static"]["wall_s"] / results["ours"]["wall_s"]
  sim_speedup = sim["static"].makespan / sim["ours"].makespan
  wall = time.perf_counter() - t_start

  lengths = trace.ravel()
  print(f"\ntrace: {n_prompts} prompts x G={G}, lengths median "
        f"{np.median(lengths):.0f}, p90 {np.percentile(lengths, 90):.0f}, "
        f"max {lengths.max()} (cap {M}); 8 replicas x {rpr} rows; "
        f"median of {repeats}")
  head = (f"{'mode':<12}{'wall s':>8}{'sim s':>8}{'steps':>7}{'idle frac':>10}"
          f"{'replicas':>9}{'tail moves':>11}{'chunks':>8}")
  print(head)
  print("-" * len(head))
  for name, r in results.items():
    st = r["stats"]
    print(f"{name:<12}{r['wall_s']:>8.2f}{sim[name].makespan:>8.2f}"
          f"{st['rollout/steps']:>7}{st['rollout/idle_fraction']:>10.3f}"
          f"{st['rollout/consolidated_replicas']:>9}"
          f"{st['rollout/tail_moves']:>11}{st['rollout/scoring_chunks']:>8}"
          f"   sim: {sim[name].steps} steps, {sim[name].consolidations} moves")
  print(f"unit costs: step_s {({m: round(v, 4) for m, v in step_s.items()})}"
        f", prefill {prefill_s:.4f}s, score chunk {score_s:.4f}s, "
        f"move {move_s:.4f}s")
  print(f"wall time: {wall:.0f}s")
  print(json.dumps(dict(
      speedup_vs_static=round(live_speedup, 3),
      speedup_vs_continuous=round(results["continuous"]["wall_s"] /
                                  results["ours"]["wall_s"], 3),
      continuous_vs_static=round(results["static"]["wall_s"] /
                                 results["continuous"]["wall_s"], 3),
      idle_fraction_static=round(
          results["static"]["stats"]["rollout/idle_fraction"], 3),
      idle_fraction_continuous=round(
          results["continuous"]["stats"]["rollout/idle_fraction"], 3),
      idle_fraction_ours=round(o_stats["rollout/idle_fraction"], 3),
      sim_speedup_vs_static=round(sim_speedup, 3),
      live_speedup_vs_static=round(live_speedup, 3),
      sim_error=round(sim_speedup / live_speedup - 1, 3),
      wall_s={k: round(v["wall_s"], 3) for k, v in results.items()},
      sim_s={k: round(v.makespan, 3) for k, v in sim.items()},
      consolidated_replicas=o_stats["rollout/consolidated_replicas"],
      tail_moves=o_stats["rollout/tail_moves"],
      prompts=n_prompts, samples_per_row=G, max_new_tokens=M,
      repeats=repeats, quick=_QUICK.value, bench_wall_s=round(wall, 1))))


if __name__ == "__main__":
  app.run(main)
