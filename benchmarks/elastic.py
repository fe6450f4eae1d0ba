"""Elastic rollout under an availability trace vs the trainer-only rollout.

  python -m benchmarks.elastic [--quick]

A tiny random model on 8 forced CPU devices, every engine the paged one
(`engine/engine.py`, as jobs and their workers decode). Trainer-only: one
engine over all 8 devices (8 replicas x `rows_per_replica` rows: a row is
a group entry of G slots), driven by one `Driver`. Elastic:
in-process `RolloutWorker`s of one device and `rows_per_replica` rows each
(the same per-replica block of slots, entries and pages; a sample's tokens
depend on its seed, prompt, index and position only, so they are the
trainer-only run's), driven by a `RolloutManager`
while an `AvailabilityReplayer` replays a short spot trace in the
simulator's format: workers join, are preempted mid-response, and others
join (event times are fractions of T, the wall time of a trainer-only run
after warm-up; joining workers are warm: built and compiled before the
trace, as a spot instance that finished booting). Response lengths are
long-tailed and forced by per-sample budgets, as in
`benchmarks/long_tail.py`. Each repeat runs trainer-only, then the elastic
rollout on the same trace, then a step-cost calibration (the machine is
shared: ratios are paired within a repeat, medians over repeats). Every
engine has one group entry per row (`num_groups` = rows, `num_slots` =
rows x G: a group starts once a row frees, as the row-level simulator
models it), a page pool for every slot (automatic: no pool preemption) and
one decode step a call (`decode_window=1`, as the jobs' workers: a poll of
n steps is n tokens a sample).

Reports tokens lost to preemption (reference tokens not reproduced: must
be 0), re-prefill tokens spent on continuations, weight pull latency,
throughput and worker-seconds vs trainer-only. On this 2-core machine extra
workers add no compute, so the throughput ratio is not a target here.

Simulator: `rlhf_jax/sim/worker_rows.py` replays the same length trace and
the same availability trace (times in seconds) through the manager's poll
rounds (in-process workers poll one after the other: a round costs the sum)
with unit costs measured here: a worker's driver iteration (calibration
rollouts through `RolloutWorker.poll`, every slot live vs one live sample:
a step cost plus a per-live-sample cost, prefills taken off; measured
before and after each repeat, the mean used), a prefill call + insert per
prompt bucket (short prompts, long continuations; a call prefills up to
the engine's `prefill_batch` prompts), a joiner's weight load, and
the per-poll overhead of the manager and the call (the residual of
calibration manager runs over another long-tailed trace, no events, minus
their zero-overhead simulation). Trainer-only: `worker_rows.simulate_driver`
(one driver loop; its step counts equal `sim/rows.py`'s and the live
driver's) with the 8-replica engine's step, per-sample and prefill costs.
The headline `sim_rel_error` = sim throughput ratio / live ratio - 1, both
medians over repeats (the sim's ratio with that repeat's step costs).
Diagnostic: the same simulation with the events at the poll rounds where
the live replayer applied them ("aligned", `clock="rounds"`): its step
counts per worker and re-prefill tokens equal the live run's, so its error
is the unit costs' alone. `--quick` (24 prompts, 5 repeats) takes about
20-30 s on a shared 2-core CPU, the full run (64 prompts, 7) about 30 s.

`--lora_rank=8`: the policy is a LoRA policy (rank 8 on the attention
projections, B non-zero): the workers get the frozen base once and each
version's adapters, and merge them themselves; the trainer-only engine runs
the same merged weights (merged on one device as a worker does, so the
reference tokens are the same). Each repeat publishes the weights as a new
version (the same values: the reference tokens stay valid), so every
joining worker pulls, the base with its first version (a joiner is a new
instance to the manager, though these warm ones already hold it). The
JSON's `lora` reports the bytes pulled per pull and their fraction of the
full weights (the rollout copy).

`--smoke` (tests/test_benchmarks_smoke.py): 8 prompts of up to 16 tokens,
one repeat, one calibration manager run, no step-cost warm-up, every
worker on device 0; the numbers mean nothing.

Last stdout line: JSON with `tokens_lost`, `reprefill_tokens`,
`pull_latency_s`, `sim_rel_error`, `cpu_throughput_vs_trainer_only` (named
so: on fake CPU devices sharing 2 cores it is what the simulator predicts,
not a figure to compare with an accelerator's), ...
"""

from __future__ import annotations

import statistics
import time

from absl import app
from absl import flags
import numpy as np

from benchmarks import report
from benchmarks import timing

_QUICK = flags.DEFINE_bool("quick", False, "Fewer prompts and repeats.")
_PROMPTS = flags.DEFINE_integer("prompts", 0, "0: 24 (--quick) or 64.")
_REPEATS = flags.DEFINE_integer("repeats", 0, "0: 5 (--quick) or 7.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Length cap M.")
_RPR = flags.DEFINE_integer("rows_per_replica", 2, "Rows per device.")
_LORA = flags.DEFINE_integer("lora_rank", 0, "> 0: a LoRA policy (q k v o).")
_SMOKE = flags.DEFINE_bool("smoke", False, "8 prompts of up to 16 tokens, "
                           "one repeat: that it runs (tests).")

PROMPT_LEN = 16
PAGE_SIZE = 16  # Tokens per KV page.
THETA, POLL_STEPS = 2, 4
EVENTS = (  # (fraction of T, instance, kind)
    (0.0, "a", "add"), (0.0, "b", "add"), (0.0, "c", "add"),
    (0.1, "b", "remove"), (0.15, "d", "add"), (0.2, "a", "remove"),
    (0.25, "e", "add"))


def _prefill_s(eng, params, prompt_len, num_samples):
  """Seconds of one prefill call (one prompt; a call computes all of the
  engine's `prefill_batch` rows) + its insert into group entry 0 (the
  same pages every time)."""
  tokens = np.arange(prompt_len) % 250 + 3
  pages = list(range(-(-prompt_len // eng.page_size)))
  box = [eng.init_decode_state()]

  def admit():
    pre = eng.prefill(params, [(tokens, 0)], [0], [5],
                      [list(range(num_samples))])
    box[0] = eng.insert(box[0], pre, [0], [pages], [prompt_len], [0], [5])
    return box[0].group_first
  return timing.median_time(admit, 7)


def _loop_s(rollout, n_rows, g, prefill_s, prefill_batch, steps=32):
  """Seconds per driver iteration of a calibration rollout: `n_rows`
  prompts of `g` samples (admitted together: prefilled `prefill_batch` a
  call), all `steps` tokens long (results read one step late), prefills
  taken off. `rollout(requests)` returns its steps."""
  from rlhf_jax.samples import Request
  reqs = [Request(10**6 + r, np.arange(3, 3 + PROMPT_LEN - 4), num_samples=g,
                  seed=3, max_new_tokens_per_sample=(steps,) * g)
          for r in range(n_rows)]
  calls = -(-n_rows // prefill_batch)
  t0 = time.perf_counter()
  n = rollout(reqs)
  return (time.perf_counter() - t0 - calls * prefill_s) / n


def _step_costs(rollout, num_rows, G, prefill_s, prefill_batch):
  """(step_s, sample_s) of an engine: its iteration with every slot live
  vs with one live sample, linear in between (the paged engine runs the
  listed live slots, and the host reads each live sample's token)."""
  full = _loop_s(rollout, num_rows, G, prefill_s, prefill_batch)
  one = _loop_s(rollout, 1, 1, prefill_s, prefill_batch)
  sample_s = max(0.0, (full - one) / (num_rows * G - 1))
  return one - sample_s, sample_s


def _poll_rollout(w):
  """A worker's calibration rollout through `poll(POLL_STEPS)`, as the
  manager polls it (the partials it streams included)."""
  def rollout(reqs):
    w.submit(reqs)
    s0 = w.steps
    while w.poll(POLL_STEPS).pending or w.driver.busy:
      pass
    return w.steps - s0
  return rollout


def _drain(w):
  while w.poll(64).pending or w.driver.busy:
    pass


def main(argv):
  del argv
  if _SMOKE.value:  # The whole trace of events still plays.
    timing.smoke_defaults(quick=True, prompts=8, repeats=1,
                          max_new_tokens=16)
  import jax
  from flax import nnx
  timing.fake_cpu_devices(8)
  jax.config.update("jax_platforms", "cpu")
  from rlhf_jax.samples import Request
  from rlhf_jax.engine.driver import Driver
  from rlhf_jax.engine.engine import Engine
  from rlhf_jax.engine.sampling import SamplingParams
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.models.config import ModelConfig
  from rlhf_jax.parallel import mesh as mesh_lib
  from rlhf_jax.sim import worker_rows
  from rlhf_jax.sim.availability import SpotEvent
  from rlhf_jax.sim.workload import long_tailed_lengths
  from rlhf_jax.workers import manager as manager_lib
  from rlhf_jax.workers.replay import AvailabilityReplayer
  from rlhf_jax.workers.weights import LocalWeightStore
  from rlhf_jax.workers.worker import EngineSpec, RolloutWorker

  t_start = time.perf_counter()
  n = _PROMPTS.value or (24 if _QUICK.value else 64)
  repeats = _REPEATS.value or (5 if _QUICK.value else 7)
  G, M, rpr = 4, _MAX_NEW.value, _RPR.value
  cfg = ModelConfig.tiny(vocab_size=256)
  mesh = mesh_lib.make_mesh(fsdp=8)
  layout = mesh_lib.rollout_layout(mesh, 1)
  graphdef, params = model_lib.init_params(cfg, 0, mesh_lib.train_layout(mesh))
  lora_spec = None
  if _LORA.value:  # Workers get adapters; everyone runs the merged weights.
    from rlhf_jax.models import lora, rollout_copy
    from rlhf_jax.models.config import LoraSpec
    lora_spec = LoraSpec(_LORA.value, 2.0 * _LORA.value, ("q", "k", "v", "o"))
    _, _, master = lora.attach(cfg, params, lora_spec, seed=1)
    adapters, base = lora.split(master)
    keys = iter(jax.random.split(jax.random.key(2), 64))
    adapters = jax.tree.map(  # Non-zero B: the adapters change the model.
        lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), adapters)
    merge = rollout_copy.rollout_model(cfg, None, lora_spec=lora_spec)[2]
    params = jax.jit(merge)(jax.device_put(
        nnx.merge_state(adapters, base), jax.devices()[0]))
  trace = long_tailed_lengths(n, G, M, 10.0, 0)
  rng = np.random.default_rng(1)
  requests = [Request(p, rng.integers(3, 256, int(rng.integers(4, PROMPT_LEN))),
                      num_samples=G, seed=5,
                      max_new_tokens_per_sample=tuple(int(x) for x in row))
              for p, row in enumerate(trace)]
  prompt_lens = [len(r.tokens) for r in requests]
  sampling = SamplingParams(temperature=1.0, max_new_tokens=M)
  buckets = (PROMPT_LEN, PROMPT_LEN + M)  # The long one: continuations.

  # One group entry per row (G slots), pages for every slot (automatic),
  # one decode step a call: the row-level simulator's engine.
  paged = dict(page_size=PAGE_SIZE, decode_window=1)

  # Trainer-only: one engine over the mesh (warm-up compiles).
  engine = Engine(cfg, graphdef, layout, num_slots=8 * rpr * G,
                  samples_per_group=G, num_groups=8 * rpr,
                  prefill_buckets=buckets, sampling=sampling, **paged)
  rparams = jax.device_put(params, engine.param_shardings)

  def trainer_only():
    driver = Driver(engine, rparams)
    t0 = time.perf_counter()
    out = {s.key: s for s in driver.run(requests)}
    return time.perf_counter() - t0, driver.stats.steps, out

  trainer_only()
  T, _, ref = trainer_only()  # The trace's time unit.
  ref_tokens = sum(len(s.tokens) for s in ref.values())
  events = [SpotEvent(f * T, iid, kind) for f, iid, kind in EVENTS]

  spec = EngineSpec(cfg, num_rows=rpr, samples_per_row=G,
                    prefill_buckets=buckets, sampling=sampling,
                    lora=lora_spec,
                    paged=dict(paged, num_pages=0, num_slots=rpr * G,
                               num_groups=rpr))
  devices = jax.devices()
  store = LocalWeightStore()

  def publish(version):
    if lora_spec is None:
      store.publish(version, params)
    else:
      store.publish(version, adapters)
  if lora_spec is not None:
    store.publish_base(base)
  publish(0)
  # Instances that join are warm (their startup is not measured here):
  # each worker is built and its prefill buckets and decode step compiled
  # before the trace starts.
  ready = []
  for i in range(5):
    # --smoke: every worker on device 0. XLA:CPU compiles a program per
    # device; on one device the workers' programs compile once (the
    # compilation cache, tests/conftest.py, loads the others').
    w = RolloutWorker(f"pool{i}", spec,
                      devices=[devices[0 if _SMOKE.value else i]])
    w.pull(store)
    long_prompt = np.arange(3, 3 + PROMPT_LEN + 4) % 250 + 3
    w.submit([requests[0], Request(10**6, long_prompt, num_samples=1,
                                   seed=5)])
    _drain(w)
    ready.append(w)

  # Unit costs of the simulator (after warm-up, medians).
  w0 = ready[0]

  def pull():
    w0.load(*store.pull())
    return w0.params
  pull_s = timing.median_time(pull, 7)
  prefill_s = {PROMPT_LEN: _prefill_s(w0.engine, w0.params, PROMPT_LEN - 4, G),
               buckets[1]: _prefill_s(w0.engine, w0.params, PROMPT_LEN + 8, 1)}
  trainer_prefill_s = _prefill_s(engine, rparams, PROMPT_LEN - 4, G)

  batch = w0.engine.prefill_batch  # Prompts per prefill call (both).
  assert engine.prefill_batch == batch

  def worker_step_costs():
    return tuple(statistics.median(x) for x in zip(*(
        _step_costs(_poll_rollout(w), rpr, G, prefill_s[PROMPT_LEN], batch)
        for w in ready[:3])))

  def trainer_rollout(reqs):
    driver = Driver(engine, rparams)
    for _ in driver.run(reqs):
      pass
    return driver.stats.steps

  def step_costs():
    """(worker step_s, sample_s, trainer step_s, sample_s), measured
    around every repeat."""
    return worker_step_costs() + _step_costs(trainer_rollout, 8 * rpr, G,
                                             trainer_prefill_s, batch)

  if not _SMOKE.value:  # Warm-up (--smoke: its costs mean nothing).
    step_costs()

  sim_kw = dict(rows_per_worker=rpr, buckets=buckets, theta=THETA,
                poll_steps=POLL_STEPS, wait_for_workers_s=30.0,
                prefill_batch=batch)

  # Per-poll overhead: calibration manager runs over 3 workers (another
  # long-tailed trace, no events), each minus its simulation without
  # overhead on a worker step measured just before.
  cal_lengths = long_tailed_lengths(16, G, M, 10.0, 1)
  cal = [Request(p, np.arange(3, 3 + 4 + p % 8), num_samples=G, seed=7,
                 max_new_tokens_per_sample=tuple(int(x) for x in row))
         for p, row in enumerate(cal_lengths)]
  residuals = []
  for _ in range(1 if _SMOKE.value else 5):
    step_s, sample_s = worker_step_costs()
    cal_sim = worker_rows.simulate(
        cal_lengths, [len(r.tokens) for r in cal],
        [SpotEvent(0.0, w.worker_id, "add") for w in ready[:3]],
        worker_rows.WorkerCosts(step_s, prefill_s, sample_s, pull_s=pull_s),
        **sim_kw)
    mgr = manager_lib.RolloutManager(store, max_new_tokens=M, theta=THETA,
                                     poll_steps=POLL_STEPS,
                                     spec_lora=lora_spec)
    for w in ready[:3]:
      mgr.add(manager_lib.LocalHandle(w))
    t0 = time.perf_counter()
    mgr.run(cal)
    residuals.append(time.perf_counter() - t0 - cal_sim.makespan)
  residual_s = statistics.median(residuals)
  poll_s = max(0.0, residual_s / cal_sim.polls)
  print(f"  warm-up and unit costs done ({time.perf_counter() - t_start:.0f}s)",
        flush=True)

  def elastic():
    """One live elastic run on the trace; the workers are reset after."""
    publish(store.latest() + 1)  # The step's weights: every joiner pulls.
    pool, spawned = list(ready), {}

    def spawn(iid):
      w = pool.pop(0)
      w.worker_id = iid
      spawned[iid] = (w, w.steps)
      return manager_lib.LocalHandle(w)

    replay = AvailabilityReplayer(events, spawn)
    mgr = manager_lib.RolloutManager(store, max_new_tokens=M, theta=THETA,
                                     poll_steps=POLL_STEPS,
                                     spec_lora=lora_spec)
    rounds = []  # The live poll round of each applied event.

    def on_poll(m):
      k = len(replay.applied)
      replay(m)
      rounds.extend([on_poll.round] * (len(replay.applied) - k))
      on_poll.round += 1
    on_poll.round = 0
    mgr.on_poll = on_poll
    mgr.wait_for_workers_s = 30.0
    t0 = time.perf_counter()
    samples = mgr.run(requests)
    wall = time.perf_counter() - t0
    worker_s = replay.close()
    steps = {iid: w.steps - s0 for iid, (w, s0) in spawned.items()}
    for w in ready:
      _drain(w)
    aligned = [SpotEvent(r, e.iid, e.kind)
               for r, (_, e) in zip(rounds, replay.applied)]
    return dict(wall=wall, samples=samples, worker_s=worker_s, steps=steps,
                rounds=on_poll.round, stats=mgr.stats, aligned=aligned,
                applied=replay.applied)

  def tokens_lost(samples):
    lost, got = 0, {s.key: s for s in samples}
    for key, want in ref.items():
      common = 0
      if key in got:
        for a, b in zip(got[key].tokens, want.tokens):
          if a != b:
            break
          common += 1
      lost += len(want.tokens) - common
    return lost

  runs, before = [], step_costs()
  for i in range(repeats):
    trainer_s, trainer_steps, _ = trainer_only()
    live = elastic()
    after = step_costs()  # Unit step costs: the mean around the pair.
    step_s, sample_s, tr_step_s, tr_sample_s = (
        (a + b) / 2 for a, b in zip(before, after))
    before = after
    costs = worker_rows.WorkerCosts(step_s, prefill_s, sample_s, poll_s,
                                    pull_s)
    sim_tr_s, sim_tr_steps = worker_rows.simulate_driver(
        trace, prompt_lens, worker_rows.WorkerCosts(
            tr_step_s, {PROMPT_LEN: trainer_prefill_s}, tr_sample_s),
        num_rows=8 * rpr, buckets=buckets, prefill_batch=batch)
    sim_el = worker_rows.simulate(trace, prompt_lens, events, costs,
                                  **sim_kw)
    sim_al = worker_rows.simulate(trace, prompt_lens, live["aligned"], costs,
                                  clock="rounds", **sim_kw)
    runs.append(dict(
        live, trainer_s=trainer_s, trainer_steps=trainer_steps,
        sim_tr_s=sim_tr_s, sim_tr_steps=sim_tr_steps, sim_el=sim_el,
        sim_al=sim_al, ratio=trainer_s / live["wall"],
        sim_ratio=sim_tr_s / sim_el.makespan,
        costs=dict(worker_step_s=step_s, worker_sample_s=sample_s,
                   trainer_step_s=tr_step_s, trainer_sample_s=tr_sample_s),
        lost=tokens_lost(live["samples"])))
    print(f"  repeat {i + 1}: trainer-only {trainer_s:.3f}s, elastic "
          f"{live['wall']:.3f}s ({runs[-1]['ratio']:.2f}x), sim "
          f"{sim_tr_s:.3f}s / {sim_el.makespan:.3f}s "
          f"({runs[-1]['sim_ratio']:.2f}x) "
          f"({time.perf_counter() - t_start:.0f}s)", flush=True)

  live_ratio = statistics.median(r["ratio"] for r in runs)
  sim_ratio = statistics.median(r["sim_ratio"] for r in runs)
  rel_error = sim_ratio / live_ratio - 1
  # Table and counts: the repeat of the median live ratio and its sim.
  lr = sorted(runs, key=lambda r: r["ratio"])[len(runs) // 2]
  st = lr["stats"]
  tokens = sum(len(s.tokens) for s in lr["samples"])
  assert tokens == ref_tokens
  aligned_exact = all(
      r["sim_al"].steps == r["steps"] and r["sim_al"].rounds == r["rounds"]
      and r["sim_al"].reprefill_tokens == r["stats"].reprefill_tokens
      for r in runs)
  wall = time.perf_counter() - t_start

  print(f"\ntrace: {n} prompts x G={G}, {ref_tokens} tokens; T = {T:.3f}s; "
        f"events {[(round(t, 3), e.iid, e.kind) for t, e in lr['applied']]}"
        f" (live, median run); median of {repeats}")
  head = (f"{'run':<14}{'wall s':>8}{'sim s':>8}{'tok/s':>7}{'device-s':>10}"
          f"{'sim':>7}{'steps':>7}{'sim':>6}{'rounds':>7}{'sim':>5}"
          f"{'reprefill':>10}{'sim':>6}")
  print(head)
  print("-" * len(head))
  sim_el = lr["sim_el"]
  print(f"{'trainer-only':<14}{lr['trainer_s']:>8.3f}"
        f"{lr['sim_tr_s']:>8.3f}{ref_tokens / lr['trainer_s']:>7.0f}"
        f"{8 * lr['trainer_s']:>10.2f}{8 * lr['sim_tr_s']:>7.2f}"
        f"{lr['trainer_steps']:>7}{lr['sim_tr_steps']:>6}")
  print(f"{'elastic':<14}{lr['wall']:>8.3f}{sim_el.makespan:>8.3f}"
        f"{tokens / lr['wall']:>7.0f}{lr['worker_s']:>10.2f}"
        f"{sim_el.worker_seconds:>7.2f}{sum(lr['steps'].values()):>7}"
        f"{sum(sim_el.steps.values()):>6}{lr['rounds']:>7}{sim_el.rounds:>5}"
        f"{st.reprefill_tokens:>10}{sim_el.reprefill_tokens:>6}")
  print(f"preemptions {st.preemptions}, migrated samples "
        f"{st.migrated_samples}, kept tokens {st.kept_tokens}, re-prefill "
        f"tokens {st.reprefill_tokens}, pulls {st.pulls} "
        f"({st.pull_s / max(1, st.pulls) * 1e3:.1f} ms each), "
        f"balanced {st.balanced_requests}")
  print(f"event rounds: live {[round(e.time) for e in lr['aligned']]}, sim "
        f"{[r for r, _, _ in sim_el.applied]}")
  print(f"steps per worker: live {lr['steps']}, sim {sim_el.steps}, sim with "
        f"events at the live rounds {lr['sim_al'].steps} (equal in every "
        f"repeat: {aligned_exact})")
  c = lr["costs"]
  print(f"unit costs: worker step {c['worker_step_s'] * 1e3:.3f} ms + "
        f"{c['worker_sample_s'] * 1e6:.1f} us per live sample, trainer step "
        f"{c['trainer_step_s'] * 1e3:.3f} ms + "
        f"{c['trainer_sample_s'] * 1e6:.1f} us, prefill "
        f"{({b: round(v * 1e3, 3) for b, v in prefill_s.items()})} ms "
        f"(trainer {trainer_prefill_s * 1e3:.3f}), poll overhead "
        f"{poll_s * 1e3:.3f} ms (calibration residual "
        f"{residual_s * 1e3:+.1f} ms over {cal_sim.polls} polls, "
        f"{cal_sim.makespan * 1e3:.1f} ms simulated), pull "
        f"{pull_s * 1e3:.2f} ms")
  print(f"throughput vs trainer-only: live {live_ratio:.2f}x, sim "
        f"{sim_ratio:.2f}x ({rel_error:+.1%}); per repeat live "
        f"{[round(r['ratio'], 2) for r in runs]}, sim "
        f"{[round(r['sim_ratio'], 2) for r in runs]}")
  print(f"wall time: {wall:.0f}s")

  def r3(x):
    return round(float(x), 3)

  full_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  per_pull = st.pull_bytes / max(1, st.pulls)
  print(f"weights: {st.pulls} pulls of {per_pull:,.0f} bytes each = "
        f"{per_pull / full_bytes:.4f} of the full {full_bytes:,} bytes"
        + (f"; LoRA bases sent {st.base_bytes:,} bytes" if lora_spec else ""))
  lora_report = None if lora_spec is None else dict(
      rank=lora_spec.rank, targets=list(lora_spec.targets),
      adapter_bytes=sum(x.size * x.dtype.itemsize
                        for x in jax.tree.leaves(adapters)),
      full_bytes=full_bytes, pulls=st.pulls,
      pull_bytes_per_pull=round(per_pull), pull_fraction=round(
          per_pull / full_bytes, 5), base_bytes=st.base_bytes)

  report.emit(dict(
      tokens_lost=sum(r["lost"] for r in runs),
      reprefill_tokens=st.reprefill_tokens, kept_tokens=st.kept_tokens,
      pull_latency_s=round(st.pull_s / max(1, st.pulls), 5),
      cpu_throughput_vs_trainer_only=r3(live_ratio),
      worker_seconds=r3(lr["worker_s"]),
      trainer_only_device_seconds=r3(8 * lr["trainer_s"]),
      preemptions=st.preemptions, migrated_samples=st.migrated_samples,
      samples=len(lr["samples"]), expected_samples=len(ref),
      sim_rel_error=r3(rel_error),
      sim_cpu_throughput_vs_trainer_only=r3(sim_ratio),
      live_s=dict(trainer_only=r3(lr["trainer_s"]), elastic=r3(lr["wall"])),
      sim_s=dict(trainer_only=r3(lr["sim_tr_s"]),
                 elastic=r3(sim_el.makespan)),
      sim_reprefill_tokens=sim_el.reprefill_tokens,
      sim_worker_seconds=r3(sim_el.worker_seconds),
      steps=dict(trainer_only=lr["trainer_steps"],
                 elastic=sum(lr["steps"].values())),
      sim_steps=dict(trainer_only=lr["sim_tr_steps"],
                     elastic=sum(sim_el.steps.values())),
      sim_aligned_exact=aligned_exact,
      sim_aligned_rel_error=r3(statistics.median(
          r["sim_tr_s"] / r["sim_al"].makespan for r in runs)
          / live_ratio - 1),
      ratios=dict(live=[r3(r["ratio"]) for r in runs],
                  sim=[r3(r["sim_ratio"]) for r in runs]),
      unit_costs=dict({k: round(v, 7) for k, v in c.items()},
                      prefill_s={b: round(v, 6) for b, v in prefill_s.items()},
                      trainer_prefill_s=round(trainer_prefill_s, 6),
                      poll_s=round(poll_s, 6), pull_s=round(pull_s, 6)),
      lora=lora_report, repeats=repeats, quick=_QUICK.value,
      bench_wall_s=round(wall, 1)))


if __name__ == "__main__":
  app.run(main)
