"""Long-tailed rollout + scoring: static vs continuous vs ours, and the sim.

  python -m benchmarks.long_tail [--quick]

Setting: a tiny random model (`ModelConfig.tiny`, vocab 256) on 8 forced CPU
devices, rollout layout 8 replicas x TP 1 (`--replicas`: the first that
many devices), the paged engine jobs decode on (`EngineSet(paged=...)`,
one per replica block) with `rows_per_replica` x G slots a replica
(`rows_per_replica` groups of G samples), a page pool sized to them (no
sample waits for pages) and one decode step a call, max M new tokens.
Lengths are long-tailed by construction: each prompt draws a mean from a
lognormal (median `median_len`, sigma 0.9), each of its G samples a
length from a lognormal around it (sigma 0.5), clipped to [1, M] (seeded
numpy). The stop rule forces them: the engine
samples with `max_new_tokens=M` and each request carries its samples'
budgets (`Request.max_new_tokens_per_sample`; the driver ends sample i
after that many tokens, finish_reason "length"), so every mode decodes the
same trace. Scoring: the reference model's log-prob of each finished
response (a full forward of prompt + response padded to P + M, chunks of
`score_chunk` samples, the batch split over the scoring replicas).

Modes, each on the same trace (`rollout/local.LocalRollout` with the
long-tail policies of `engine/long_tail.py`):
  static      a new wave of prompts only once every group of the last one
              is done (FIFO), then scoring of the whole batch;
  continuous  a prompt's group enters as soon as a slot frees, its samples
              taking slots as they free (FIFO), then scoring of the whole
              batch;
  ours        continuous + longest predicted first on the least-loaded
              replica + consolidation at R_t onto fewer replicas (pages
              moved) + scoring fused into decoding;
  rlhfless    RLHFless's assignment (each replica decodes its own run of
              similar predicted lengths, the longest on replica 0) and
              release (the block shrinks by its last replica once that
              one is done, or cut at tau = `cut_tau`, its groups' pages
              moved)
              + scoring fused into decoding on the released replicas.
Predictions come from the length history of another epoch: the trace has
two epochs of the same prompts (each prompt's mean length is the same, its
samples' lengths are drawn anew), the two warm-up rollouts per mode run
epoch 0 (the first fills the history, both compile every engine, move and
scoring shape) and the timed runs epoch 1, each from the warm-up's
history (a rollout folds its own lengths in; they are taken out again).
The simulator predicts from the same history. Wall time of the
rollout+scoring phase: median over repeats, the modes interleaved repeat
by repeat (the machine is shared). Idle fraction: from the rollout's
timeline, idle replica-seconds / (replicas x phase time); a replica with no
live sample that is not scoring is idle (stepping empty slots is wasted).

Simulator: `rlhf_jax/sim/rows.py` replays the same trace through the same
policies, modelled at row level, with unit costs measured here on the same
paged engines: `step_s(m)` (a decode step of each m-replica paged engine
in its driver's loop: a calibration rollout with every slot live and equal
budgets after each repeat, its prefill calls taken off), `prefill_s` (one
prefill call + insert on the whole engine), `score_s` (one chunk on all
replicas), `move_s` (the live run's consolidation time per move;
rlhfless's: per release) and `score_overlap` (the fraction of a chunk on
freed replicas hidden behind tail decoding: ~0 here, 8 fake devices share
2 cores). It predicts the speedup of ours over static, the step counts
and the idle fractions. Its rows free when their last sample ends; the
paged driver starts a waiting sample in any slot that frees, so the live
continuous modes can take a few steps fewer than the model's (static
waves are the same).

`--smoke` (tests/test_benchmarks_smoke.py): --quick's modes and PPO step
on 4 replicas (the fewest where ours consolidates and rlhfless releases),
16 prompts of up to 16 tokens, one warm-up epoch, one repeat, 4-step
calibrations, no PPO warm-up step; the numbers mean nothing.

Prints a table, then one JSON line (last stdout line) with
`speedup_vs_continuous` (the headline: continuous batching is the fair
baseline; on 8 fake CPU devices sharing 2 cores part of it is
consolidation's, whose smaller engines step faster here, not on
accelerators), `speedup_vs_static`, `idle_fraction_static`, `idle_fraction_ours`,
`sim_speedup_vs_static`, `live_speedup_vs_static`, `sim_rel_error`
(sim / live - 1) and the per-mode numbers. Speedups are medians over
repeats of paired ratios (static / ours of the same repeat; the sim with
that repeat's step costs), so drift of the shared machine cancels.
`--quick` (48 prompts, median of 3; the PPO step's chunked mode left
out, `--ppo_chunked` puts it back) took 169 s twice on the shared 2-core
CPU on 2026-11-27 (with the chunked mode 155-197 s that day, 286-304 s
on busier hours); ~60 s of it is compiling. The modes and the PPO step
share one set of engines (each size compiles once), the scoring passes
are one program each, and the PPO warm-up is one step per mode (the
length history comes from the GRPO part). A timed PPO step that compiled
anything is run again (`ppo_reruns_after_compile` counts them).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from absl import app
from absl import flags
import numpy as np

from benchmarks import long_tail_ppo
from benchmarks import report
from benchmarks import timing

_QUICK = flags.DEFINE_bool("quick", False, "Fewer prompts and repeats.")
_PROMPTS = flags.DEFINE_integer("prompts", 0, "0: 48 (--quick) or 96.")
_REPEATS = flags.DEFINE_integer("repeats", 0, "0: 3 (--quick) or 5.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 96, "Length cap M.")
_G = flags.DEFINE_integer("samples_per_row", 4, "Samples per prompt G.")
_RPR = flags.DEFINE_integer("rows_per_replica", 2, "Rows per replica.")
_MEDIAN = flags.DEFINE_float("median_len", 8.0, "Median prompt mean length.")
_R_T = flags.DEFINE_float("consolidate_below", 0.2, "R_t of ours.")
_CHUNK = flags.DEFINE_integer("score_chunk", 8, "Samples per scoring chunk.")
_SEED = flags.DEFINE_integer("seed", 0, "Trace seed.")
_PPO = flags.DEFINE_bool("ppo", True, "Also the PPO step, fused or not.")
_TAU = flags.DEFINE_float("cut_tau", 0.8, "tau of rlhfless's local cut.")
_PPO_CHUNKED = flags.DEFINE_bool(
    "ppo_chunked", None, "Also the PPO step's chunked mode (unfused -> fused "
    "split into chunking and overlap); default: not with --quick.")
_SMOKE = flags.DEFINE_bool("smoke", False, "16 prompts of up to 16 tokens "
                           "on 4 replicas, one repeat: that it runs (tests).")
_REPLICAS = flags.DEFINE_integer(
    "replicas", 8, "Rollout replicas (TP 1), the first of the 8 fake CPU "
    "devices; every size 1..replicas gets its own engine programs.")
_PPO_PACK = flags.DEFINE_integer(
    "ppo_pack_length", 0, "The PPO step's training batch in packed rows of "
    "this many tokens (rl.pack_length; 0: padded rows).")

PROMPT_LEN = 16
DEVICES = 8  # Fake CPU devices; the rollout uses the first --replicas.
MODES = ("static", "continuous", "ours", "rlhfless")


def length_trace(n_prompts, G, max_new, median, seed, epoch=0):
  """[n_prompts, G] response lengths of one epoch: each prompt's lognormal
  mean is fixed by `seed` (how long a prompt's answers run is a property of
  the prompt), its G samples are drawn anew each epoch around it."""
  means = median * np.random.default_rng(seed).lognormal(0.0, 0.9, n_prompts)
  noise = np.random.default_rng([seed, epoch]).lognormal(0.0, 0.5,
                                                         (n_prompts, G))
  return np.clip(np.rint(means[:, None] * noise), 1, max_new).astype(int)


class RefScorer:
  """Reference-model log-prob of each response, one jitted forward a chunk.

  The chunk is padded to [B, P + M] tokens, B the rows of a full chunk
  (`sched.tail.chunk_rows`: a multiple of the layout's replicas, so the
  batch splits over them; a batch that does not divide would run
  replicated on every device).
  """

  def __init__(self, graphdef, params, seq_len, chunk):
    import jax
    import jax.numpy as jnp
    from rlhf_jax.models import model as model_lib
    from rlhf_jax.rl import logprobs

    self.params, self.placed = params, {}
    self.seq_len, self.chunk = seq_len, chunk
    self._jax = jax

    def score(params, toks_BxT, resp_BxT):
      B, T = toks_BxT.shape
      pos_BxT = jnp.broadcast_to(jnp.arange(T), (B, T))
      logits_BxTxV = model_lib.forward(graphdef, params, toks_BxT, pos_BxT,
                                       toks_BxT > 0)
      logp_BxT = logprobs.token_logprobs(logits_BxTxV[:, :-1], toks_BxT[:, 1:])
      return jnp.sum(jnp.where(resp_BxT[:, 1:], logp_BxT, 0.0), axis=1)

    self._jit = jax.jit(score)

  def compile(self, samples, layout):
    """Nothing compiles ahead (`ScoringPasses.compile`): `score` compiles
    inline."""
    del samples, layout
    return []

  def bytes_per_device(self, layout):
    """No room check: the benchmark's reference fits."""
    del layout
    return 0

  def score(self, samples, layout):
    """Dispatches the chunk on `layout`; returns [rows] log-probs, row i
    `samples[i]` (the padding rows left in, as `ScoringPasses.score`)."""
    jax = self._jax
    if layout not in self.placed:
      self.placed[layout] = jax.device_put(
          self.params, layout.param_shardings(self.params))
    from rlhf_jax.sched import tail as tail_rules
    B = tail_rules.chunk_rows(self.chunk, layout.mesh.shape["data"])
    toks = np.zeros((B, self.seq_len), np.int32)
    resp = np.zeros((B, self.seq_len), bool)
    for i, s in enumerate(samples):
      P = len(s.prompt_tokens)
      seq = np.concatenate([s.prompt_tokens, s.tokens])[:self.seq_len]
      toks[i, :seq.size] = seq
      resp[i, P:seq.size] = True
    sharding = layout.sharding(("batch", None), toks.shape)
    toks, resp = jax.device_put((toks, resp), sharding)
    return self._jit(self.placed[layout], toks, resp)


# ------------------------------------------------------------ unit costs
def _full_run(lt, params, m, prompt, budget):
  """(the paged driver of the m-replica engine, requests that fill every
  slot): one group of G samples of `prompt` per G slots, each sample
  stopping after `budget` tokens. The engines take one decode step a call
  (`decode_window=1`, as the long-tail controller asks), so a driver step
  is one decode step."""
  from rlhf_jax.samples import Request

  engines = lt.engines
  eng = engines.engine(m)
  G = eng.samples_per_group
  reqs = [Request(10**6 + r, prompt, num_samples=G, seed=3,
                  max_new_tokens_per_sample=(budget,) * G)
          for r in range(eng.num_slots // G)]
  driver = engines.make_driver(eng, engines.params_for(params, m), 0)
  return driver, reqs


def _stepper(lt, params, m, prompt):
  """One decode step of the m-replica paged engine with every slot live,
  in the driver's loop (the previous step's results read); a call returns
  a device array of its step to wait on. The samples run to
  `max_new_tokens`; before their last step a call starts a fresh run
  (every group prefilled and started, one step), and `step.refill(k)`
  does so unless k more steps fit (outside a timed loop)."""
  budget = lt.engines.sampling.max_new_tokens
  driver, reqs = _full_run(lt, params, m, prompt, budget)
  left = [0]  # Steps the run's samples have left, every slot live.

  def refill(k=1):
    if left[0] < k:
      driver.start(reqs)
      driver.step()  # Admits and starts every group; its first step.
      left[0] = budget - 2

  def step():
    refill()
    driver.step()
    left[0] -= 1
    return driver.state.tokens
  step.refill = refill
  return step


def _time_steps(lt, params, m, prompt, prefill_s, steps=40):
  """Seconds per decode step of the m-replica paged engine in its driver's
  loop.

  A calibration rollout (`Driver` via `EngineSet.make_driver`, no
  controller, one step a call): every slot holds a sample of one of
  num_slots / G groups, all stopping after `steps` tokens, so the loop
  runs `steps` decode calls with every slot live (results read one step
  late, as in the benchmark's runs; the last call finds nothing active);
  its prefill calls are taken off.
  """
  driver, reqs = _full_run(lt, params, m, prompt, steps)
  t0 = time.perf_counter()
  for _ in driver.run(reqs):
    pass
  return ((time.perf_counter() - t0 - driver.stats.prefills * prefill_s)
          / driver.stats.steps)


def _time_prefill(lt, params, req):
  """Seconds of one prompt's prefill + insert on the full paged engine:
  one `prefill` call (the batch padded to `prefill_batch`, as the
  driver's calls are) and the insert of its KV into a group entry's
  pages."""
  eng = lt.engines.engine()
  box = [eng.init_decode_state()]
  tokens = np.asarray(req.tokens, np.int32)
  pages = list(range(-(-tokens.size // eng.page_size)))  # Replica 0's.
  members = list(range(req.first_sample_index,
                       req.first_sample_index + req.num_samples))

  def admit():
    pre = eng.prefill(params, [(tokens, req.prompt_id)], [req.prompt_id],
                      [req.seed], [members])
    box[0] = eng.insert(box[0], pre, [0], [pages], [tokens.size],
                        [req.prompt_id], [req.seed])
    return box[0].group_len
  return timing.median_time(admit, 5)


def _score_overlap(lt, params, scorer, chunk, m, step_s, score_s, prompt,
                   n=5):
  """Fraction of a chunk on the replicas freed by m hidden behind decoding.

  Dispatches a chunk on replicas [m, R), then as many blocking m-replica
  paged steps (`_stepper`) as the chunk lasts alone, and waits for both:
  the loop paid (1 - overlap) * score_s on top of the steps.
  """
  import jax
  step, rest = _stepper(lt, params, m, prompt), lt.engines.parts(m)[1]
  k = max(1, round(score_s / step_s))
  jax.block_until_ready((scorer.score(chunk, rest), step()))  # Warm.
  times = []
  for _ in range(n):
    step.refill(k)
    t0 = time.perf_counter()
    out = scorer.score(chunk, rest)
    for _ in range(k):
      jax.block_until_ready(step())
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t0)
  extra = statistics.median(times) - k * step_s
  return min(1.0, max(0.0, 1.0 - extra / score_s))


# ---------------------------------------------------------------- modes
def _tail_configs(chunk, r_t):
  from rlhf_jax.config.sections import LongTail
  return {
      "static": LongTail(enabled=True, admission="static", assignment="fifo",
                         consolidate_below=0.0, fusion=False,
                         score_chunk=chunk),
      "continuous": LongTail(enabled=True, assignment="fifo",
                             consolidate_below=0.0, fusion=False,
                             score_chunk=chunk),
      "ours": LongTail(enabled=True, assignment="length",
                       consolidate_below=r_t, migration="kv", fusion=True,
                       score_chunk=chunk),
      "rlhfless": LongTail(enabled=True, assignment="grouped",
                           consolidate_below=0.0, cut_tau=_TAU.value,
                           fusion=True, score_chunk=chunk),
  }


@dataclasses.dataclass
class _Run:
  samples: list
  scores: dict
  stats: dict


def _run(lt, params, requests, scorer, step, history=None) -> _Run:
  """One rollout of every request with device scoring; its samples,
  scores and metrics. `history`: the length history to predict from (a
  rollout folds its own lengths into it; restoring it first keeps every
  timed run predicting from the warm-up epoch only)."""
  if history is not None:
    lt.history.load_state_dict(history)
  from rlhf_jax.scoring.fused import FusedScoring
  lt.set_weights(params, 0)
  fused = FusedScoring(scorer, lt.tail)
  samples = list(lt.run(requests, step=step, freed=fused))
  return _Run(samples, dict(fused.scores), lt.metrics())


def _timeline_idle(timeline, step, replicas):
  """Idle replica-seconds / (replicas x window) of one run's spans."""
  spans = timeline.step_spans(step)
  t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
  idle = sum(s.duration for s in spans if s.phase == "idle")
  return idle / (replicas * (t1 - t0))


def _summary(lt, runs, requests):
  """(median wall, the median run's stats, its samples) of timed runs."""
  walls = [r.stats["perf/rollout_wall_s"] for r in runs]
  mid = int(np.argsort(walls)[len(walls) // 2])
  stats = dict(runs[mid].stats)
  stats["timeline_idle_fraction"] = _timeline_idle(lt.timeline, mid,
                                                   lt.engines.replicas)
  assert len(runs[mid].scores) == len(runs[mid].samples) == sum(
      r.num_samples for r in requests)
  return statistics.median(walls), stats, runs[mid].samples


def main(argv):
  del argv
  if _SMOKE.value:  # Every mode and the PPO step still run.
    # 4 replicas: 4 engine sizes compile instead of 8 (most of the time).
    timing.smoke_defaults(quick=True, prompts=16, repeats=1,
                          max_new_tokens=16, median_len=4.0, replicas=4)
  import jax
  timing.fake_cpu_devices(DEVICES)
  jax.config.update("jax_platforms", "cpu")
  from rlhf_jax.samples import Request
  from rlhf_jax.engine.engine_set import EngineSet
  from rlhf_jax.engine.sampling import SamplingParams
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.models.config import ModelConfig
  from rlhf_jax.parallel import mesh as mesh_lib
  from rlhf_jax.rollout.local import LocalRollout
  from rlhf_jax.sched.length_history import LengthHistory
  from rlhf_jax.sim import rows as sim_rows
  from rlhf_jax.timeline import Timeline

  t_start = time.perf_counter()
  n_prompts = _PROMPTS.value or (48 if _QUICK.value else 96)
  repeats = _REPEATS.value or (3 if _QUICK.value else 5)
  G, M, rpr, chunk = _G.value, _MAX_NEW.value, _RPR.value, _CHUNK.value
  replicas = _REPLICAS.value
  sizes = tuple(range(1, replicas + 1))  # Engines rlhfless's releases use.
  cfg = ModelConfig.tiny(vocab_size=256)
  mesh = mesh_lib.make_mesh(fsdp=replicas, devices=jax.devices()[:replicas])
  layout = mesh_lib.rollout_layout(mesh, 1)
  train = mesh_lib.train_layout(mesh)
  graphdef, params = model_lib.init_params(cfg, 0, train)
  params = jax.device_put(params, layout.param_shardings(params))
  _, ref = model_lib.init_params(cfg, 1, train)
  ref = jax.device_put(ref, layout.param_shardings(ref))
  # Two epochs of one workload: the warm-up runs epoch 0 (it fills the
  # length history), the timed runs epoch 1, whose sample lengths the
  # history has not seen (a history of the timed trace itself would be a
  # perfect oracle).
  warm_trace, trace = (length_trace(n_prompts, G, M, _MEDIAN.value,
                                    _SEED.value, epoch) for epoch in (0, 1))
  rng = np.random.default_rng(_SEED.value + 1)
  prompts = [rng.integers(3, 256, int(rng.integers(4, PROMPT_LEN)))
             for _ in range(n_prompts)]

  def epoch_requests(lengths_PxG):
    return [Request(p, prompts[p], num_samples=G, seed=11,
                    max_new_tokens_per_sample=tuple(int(x) for x in row))
            for p, row in enumerate(lengths_PxG)]
  warm_requests, requests = epoch_requests(warm_trace), epoch_requests(trace)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=M)
  scorer = RefScorer(graphdef, ref, PROMPT_LEN + M, chunk)
  # One set of engines for every mode and the PPO step: the modes run one
  # after another (a rollout starts from a fresh decode state), and each
  # engine size compiles once instead of once per mode. The paged engine
  # (the one jobs decode on): rows x G slots, a pool sized to them (no
  # sample waits for pages), one decode step a call (the long-tail
  # controller's window).
  engines = EngineSet(cfg, graphdef, layout, rows_per_replica=rpr,
                      samples_per_row=G, prefill_buckets=(PROMPT_LEN,),
                      sampling=sampling,
                      paged=dict(page_size=16, num_pages=0, num_slots=0,
                                 decode_window=1))
  rollouts = {}
  for name, tail in _tail_configs(chunk, _R_T.value).items():
    lt = LocalRollout(engines, tail=tail, history=LengthHistory(1.0),
                      timeline=Timeline(None))
    # The first warm-up fills the length history; both compile. --smoke:
    # one only (the timed repeat compiles what the second would have).
    for i in range(1 if _SMOKE.value else 2):
      _run(lt, params, warm_requests, scorer, step=-1 - i)
    rollouts[name] = lt
  print(f"  warm-up done ({time.perf_counter() - t_start:.0f}s)", flush=True)
  ours = rollouts["ours"]
  warm_history = ours.history.state_dict()  # Epoch 0's lengths only.
  prefill_s = _time_prefill(ours, params, requests[0])
  # --smoke: calibrations of 4 steps, not warmed up (their step costs mean
  # nothing, like the rest of its numbers).
  calib = dict(steps=4) if _SMOKE.value else {}
  for m in () if _SMOKE.value else sizes:  # Calibration warm-up.
    _time_steps(ours, params, m, requests[0].tokens, prefill_s)
  # Timed runs, modes interleaved repeat by repeat (the machine is shared),
  # each repeat followed by a step-cost calibration of every engine size.
  runs = {name: [] for name in MODES}
  step_times = {m: [] for m in sizes}
  for i in range(repeats):
    for name in MODES:
      runs[name].append(_run(rollouts[name], params, requests, scorer,
                             step=i, history=warm_history))
    for m in sizes:
      step_times[m].append(_time_steps(ours, params, m, requests[0].tokens,
                                       prefill_s, **calib))
    print(f"  repeat {i + 1}: " + ", ".join(
        f"{k} {v[-1].stats['perf/rollout_wall_s']:.2f}s" for k, v in runs.items())
          + f" ({time.perf_counter() - t_start:.0f}s)", flush=True)
  live = {k: _summary(rollouts[k], v, requests) for k, v in runs.items()}

  # The other unit costs for the simulator, on the same engines.
  step_s = {m: statistics.median(v) for m, v in step_times.items()}
  samples = live["static"][2][:chunk]
  score_s = timing.median_time(lambda: scorer.score(samples, layout))
  o_stats = live["ours"][1]
  move_s = o_stats["perf/move_s"] / max(1, o_stats["rollout/consolidations"])
  l_stats = live["rlhfless"][1]
  release_s = l_stats["perf/move_s"] / max(1, l_stats["rollout/releases"])
  tail_sizes = [m for m in ours.engines.sizes
                if o_stats["rollout/consolidated_replicas"] <= m < replicas]
  overlaps = {m: _score_overlap(ours, params, scorer, samples, m, step_s[m],
                                score_s, requests[0].tokens,
                                n=1 if _SMOKE.value else 5)
              for m in tail_sizes}
  overlap = statistics.fmean(overlaps.values()) if overlaps else 0.0

  def simulate(step_s):
    def costs(move_s):
      return sim_rows.UnitCosts(step_s=step_s, prefill_s=prefill_s,
                                score_s=score_s, move_s=move_s)
    args = dict(replicas=replicas, rows_per_replica=rpr,
                score_chunk=chunk, score_overlap=overlap,
                predicted=warm_trace.mean(1))
    out = sim_rows.simulate_policies(
        trace, costs=costs(move_s),
        consolidate_below=_R_T.value, **args)
    out["rlhfless"] = sim_rows.simulate(
        trace, policy="rlhfless", costs=costs(release_s),
        consolidate_below=0.0, cut_tau=_TAU.value, **args)
    return out

  sim = simulate(step_s)
  wall = {k: v[0] for k, v in live.items()}
  stats = {k: v[1] for k, v in live.items()}
  # Speedups: medians over repeats of the paired ratios, live (static /
  # ours of the same repeat) and simulated (with that repeat's step costs),
  # so drift of the shared machine between repeats cancels.
  def paired(a, b):
    return statistics.median(x.stats["perf/rollout_wall_s"] / y.stats[
        "perf/rollout_wall_s"] for x, y in zip(runs[a], runs[b]))

  live_speedup = paired("static", "ours")
  sims = [simulate({m: v[i] for m, v in step_times.items()})
          for i in range(repeats)]
  sim_speedup = statistics.median(
      r["static"].makespan / r["ours"].makespan for r in sims)
  live_rlhfless = paired("rlhfless", "ours")
  sim_rlhfless = statistics.median(
      r["rlhfless"].makespan / r["ours"].makespan for r in sims)

  lengths = trace.ravel()
  print(f"\ntrace: {n_prompts} prompts x G={G}, lengths median "
        f"{np.median(lengths):.0f}, p90 {np.percentile(lengths, 90):.0f}, "
        f"max {lengths.max()} (cap {M}); {replicas} replicas x {rpr} rows; "
        f"median of {repeats}")
  head = (f"{'mode':<12}{'wall s':>8}{'sim s':>8}{'steps':>7}{'sim':>6}"
          f"{'idle':>7}{'sim':>7}{'replicas':>9}{'sim':>5}{'switch':>6}"
          f"{'sim':>5}{'chunks':>7}")
  print(head)
  print("-" * len(head))
  for name in MODES:
    st, s = stats[name], sim[name]
    print(f"{name:<12}{wall[name]:>8.2f}{s.makespan:>8.2f}"
          f"{st['rollout/steps']:>7}{s.steps:>6}"
          f"{st['timeline_idle_fraction']:>7.3f}"
          f"{s.timeline_idle_fraction:>7.3f}"
          f"{st['rollout/consolidated_replicas']:>9}{s.final_replicas:>5}"
          f"{st['rollout/consolidations'] + st['rollout/releases']:>6}"
          f"{s.consolidations + s.releases:>5}"
          f"{st.get('rollout/scoring_chunks', 0):>7}")
  print(f"unit costs: step_s {({m: round(v, 4) for m, v in step_s.items()})}"
        f", prefill {prefill_s:.4f}s, score chunk {score_s:.4f}s, "
        f"move {move_s:.4f}s, score overlap "
        f"{({m: round(v, 2) for m, v in overlaps.items()})}")
  print(f"speedup vs static: live {live_speedup:.2f}x, sim "
        f"{sim_speedup:.2f}x ({sim_speedup / live_speedup - 1:+.1%})")
  print(f"ours vs rlhfless: live {live_rlhfless:.2f}x, sim "
        f"{sim_rlhfless:.2f}x ({sim_rlhfless / live_rlhfless - 1:+.1%}); "
        f"rlhfless released {l_stats['rollout/releases']} replicas, "
        f"{l_stats['rollout/tail_moves']} samples cut and moved")
  ppo = None
  if _PPO.value:  # PPO: the passes fused into the tail, or after it.
    ppo = long_tail_ppo.run(
        cfg, graphdef, layout, train, lambda: LocalRollout(
            engines, tail=_tail_configs(chunk, _R_T.value)["ours"],
            history=LengthHistory.from_state_dict(warm_history),
            timeline=Timeline(None)),
        requests, prompt_len=PROMPT_LEN, max_new=M, group_size=G,
        repeats=repeats, log=lambda line: print(line, flush=True),
        chunked=(not _QUICK.value if _PPO_CHUNKED.value is None
                 else _PPO_CHUNKED.value),
        pack_length=_PPO_PACK.value, warmup=not _SMOKE.value,
        sim_rollout=lambda score_s, fusion: sim_rows.simulate(
            trace, replicas=replicas, rows_per_replica=rpr, policy="ours",
            costs=sim_rows.UnitCosts(step_s=step_s, prefill_s=prefill_s,
                                     score_s=score_s, move_s=move_s),
            consolidate_below=_R_T.value, score_chunk=chunk,
            score_overlap=overlap, fusion=fusion,
            predicted=warm_trace.mean(1)).makespan)
    head = (f"{'ppo step':<10}{'wall s':>8}{'sim s':>7}{'rollout':>9}"
            f"{'sim':>6}{'scoring':>9}{'train':>7}{'idle':>7}{'chunks':>7}")
    print("\n" + head + "\n" + "-" * len(head))
    for name, m in ppo["modes"].items():
      print(f"{name:<10}{m['wall_s']:>8.2f}{m['sim_wall_s']:>7.2f}"
            f"{m['rollout_s']:>9.2f}{m['sim_rollout_s']:>6.2f}"
            f"{m['scoring_s']:>9.2f}{m['train_s']:>7.2f}"
            f"{m['idle_fraction']:>7.3f}{m['chunks']:>7.0f}")
    split = ("" if "fused_vs_chunked" not in ppo else
             f"; chunked vs unfused {ppo['chunked_vs_unfused']:.2f}x, fused "
             f"vs chunked {ppo['fused_vs_chunked']:.2f}x")
    print(f"ppo step speedup vs unfused: live {ppo['speedup_vs_unfused']:.2f}x"
          f", sim {ppo['sim_speedup_vs_unfused']:.2f}x "
          f"({ppo['sim_rel_error']:+.1%}){split}; chunk cost fit "
          f"{ppo['chunk_fit']}; timed steps run again after a compile: "
          f"{ppo['reruns']}")
  bench_wall = time.perf_counter() - t_start
  print(f"wall time: {bench_wall:.0f}s")

  def r3(x):
    return round(float(x), 3)

  ppo_json = {} if ppo is None else dict(
      ppo_step_speedup_vs_unfused=r3(ppo["speedup_vs_unfused"]),
      ppo_step_idle_fraction=r3(ppo["modes"]["fused"]["idle_fraction"]),
      ppo_step_idle_fraction_unfused=r3(
          ppo["modes"]["unfused"]["idle_fraction"]),
      **{f"ppo_{k}": r3(ppo[k]) for k in ("chunked_vs_unfused",
                                          "fused_vs_chunked") if k in ppo},
      ppo_sim_step_speedup_vs_unfused=r3(ppo["sim_speedup_vs_unfused"]),
      ppo_sim_rel_error=r3(ppo["sim_rel_error"]),
      ppo_step_s={k: r3(v["wall_s"]) for k, v in ppo["modes"].items()},
      ppo_sim_step_s={k: r3(v["sim_wall_s"])
                      for k, v in ppo["modes"].items()},
      ppo_idle_fraction={k: r3(v["idle_fraction"])
                         for k, v in ppo["modes"].items()},
      ppo_reruns_after_compile=ppo["reruns"])

  report.emit(dict(
      speedup_vs_static=r3(live_speedup),
      speedup_vs_continuous=r3(paired("continuous", "ours")),
      continuous_vs_static=r3(paired("static", "continuous")),
      idle_fraction_static=r3(stats["static"]["timeline_idle_fraction"]),
      idle_fraction_continuous=r3(
          stats["continuous"]["timeline_idle_fraction"]),
      idle_fraction_ours=r3(stats["ours"]["timeline_idle_fraction"]),
      sim_speedup_vs_static=r3(sim_speedup),
      live_speedup_vs_static=r3(live_speedup),
      sim_rel_error=r3(sim_speedup / live_speedup - 1),
      sim_error=r3(sim_speedup / live_speedup - 1),
      idle_fraction_stats={k: r3(stats[k]["perf/rollout_idle_fraction"])
                           for k in MODES},
      sim_idle_fraction={k: r3(v.timeline_idle_fraction)
                         for k, v in sim.items()},
      wall_s={k: r3(v) for k, v in wall.items()},
      sim_s={k: r3(v.makespan) for k, v in sim.items()},
      steps={k: stats[k]["rollout/steps"] for k in MODES},
      sim_steps={k: v.steps for k, v in sim.items()},
      consolidated_replicas=o_stats["rollout/consolidated_replicas"],
      tail_moves=o_stats["rollout/tail_moves"],
      ours_vs_rlhfless=r3(live_rlhfless),
      sim_ours_vs_rlhfless=r3(sim_rlhfless),
      rlhfless_sim_rel_error=r3(sim_rlhfless / live_rlhfless - 1),
      rlhfless_releases=l_stats["rollout/releases"],
      rlhfless_cut_moves=l_stats["rollout/tail_moves"],
      idle_fraction_rlhfless=r3(stats["rlhfless"]["timeline_idle_fraction"]),
      unit_costs=dict(step_s={m: round(v, 5) for m, v in step_s.items()},
                      prefill_s=round(prefill_s, 5),
                      score_s=round(score_s, 5), move_s=round(move_s, 5),
                      release_s=round(release_s, 5),
                      score_overlap=r3(overlap)),
      prompts=n_prompts, samples_per_row=G, max_new_tokens=M,
      ppo_pack_length=_PPO_PACK.value, **ppo_json,
      repeats=repeats, quick=_QUICK.value, bench_wall_s=round(bench_wall, 1)))


if __name__ == "__main__":
  app.run(main)
