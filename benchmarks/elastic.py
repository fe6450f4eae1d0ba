"""Elastic rollout under an availability trace vs the trainer-only rollout.

  python -m benchmarks.elastic [--quick]

A tiny random model on 8 forced CPU devices. Trainer-only: one engine over
all 8 devices (8 replicas x `rows_per_replica` rows). Elastic: in-process
`RolloutWorker`s of one device and `rows_per_replica` rows each (the same
per-device program, so the same tokens), driven by a `RolloutManager`
while an `AvailabilityReplayer` replays a short spot trace in the
simulator's format: workers join, are preempted mid-response, and others
join (event times are fractions of the trainer-only wall time; joining
workers are warm: built and compiled before the trace, as a spot instance
that finished booting). Response
lengths are long-tailed and forced by per-sample budgets, as in
`benchmarks/long_tail.py`.

Reports tokens lost to preemption (reference tokens not reproduced: must
be 0), re-prefill tokens spent on continuations, weight pull latency,
throughput and worker-seconds vs trainer-only. On this 2-core machine extra
workers add no compute, so the throughput ratio is not a target here.
Not yet: the simulator's prediction for the same trace (`sim_rel_error` is
null until the simulator models live workers with a CPU profile).
"""

from __future__ import annotations

import json
import time

from absl import app
from absl import flags
import numpy as np

_QUICK = flags.DEFINE_bool("quick", False, "Fewer prompts.")
_PROMPTS = flags.DEFINE_integer("prompts", 0, "0: 24 (--quick) or 64.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Length cap M.")
_RPR = flags.DEFINE_integer("rows_per_replica", 2, "Rows per device.")

PROMPT_LEN = 16


def main(argv):
  del argv
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  jax.config.update("jax_platforms", "cpu")
  from rlhf_jax.engine.driver import Driver, Request
  from rlhf_jax.engine.engine import Engine
  from rlhf_jax.engine.sampling import SamplingParams
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.models.config import ModelConfig
  from rlhf_jax.parallel import mesh as mesh_lib
  from rlhf_jax.sim.availability import SpotEvent
  from rlhf_jax.sim.workload import long_tailed_lengths
  from rlhf_jax.workers import manager as manager_lib
  from rlhf_jax.workers.replay import AvailabilityReplayer
  from rlhf_jax.workers.weights import LocalWeightStore
  from rlhf_jax.workers.worker import EngineSpec, RolloutWorker

  t_start = time.perf_counter()
  n = _PROMPTS.value or (24 if _QUICK.value else 64)
  G, M, rpr = 4, _MAX_NEW.value, _RPR.value
  cfg = ModelConfig.tiny(vocab_size=256)
  mesh = mesh_lib.make_mesh(fsdp=8)
  layout = mesh_lib.rollout_layout(mesh, 1)
  graphdef, params = model_lib.init_params(cfg, 0, mesh_lib.train_layout(mesh))
  trace = long_tailed_lengths(n, G, M, 10.0, 0)
  rng = np.random.default_rng(1)
  requests = [Request(p, rng.integers(3, 256, int(rng.integers(4, PROMPT_LEN))),
                      num_samples=G, seed=5,
                      max_new_tokens_per_sample=tuple(int(x) for x in row))
              for p, row in enumerate(trace)]
  sampling = SamplingParams(temperature=1.0, max_new_tokens=M)
  buckets = (PROMPT_LEN, PROMPT_LEN + M)  # The long one: continuations.

  # Trainer-only: one engine over the mesh (warm-up compiles).
  engine = Engine(cfg, graphdef, layout, num_rows=8 * rpr, samples_per_row=G,
                  prefill_buckets=buckets, sampling=sampling)
  rparams = jax.device_put(params, layout.param_shardings(params))
  list(Driver(engine, rparams).run(requests))
  t0 = time.perf_counter()
  ref = {s.key: s for s in Driver(engine, rparams).run(requests)}
  trainer_s = time.perf_counter() - t0
  ref_tokens = sum(len(s.tokens) for s in ref.values())

  spec = EngineSpec(cfg, num_rows=rpr, samples_per_row=G,
                    prefill_buckets=buckets, sampling=sampling)
  devices = jax.devices()
  store = LocalWeightStore()
  store.publish(0, params)
  # Instances that join are warm (their startup is not measured here):
  # each worker is built and its prefill buckets and decode step compiled
  # before the trace starts.
  ready = []
  for i in range(5):
    w = RolloutWorker(f"pool{i}", spec, devices=[devices[i]])
    w.load(*store.pull())
    long_prompt = np.arange(3, 3 + PROMPT_LEN + 4) % 250 + 3
    w.submit([requests[0], Request(10**6, long_prompt, num_samples=1,
                                   seed=5)])
    while w.poll(16).pending or w.driver.busy:
      pass
    ready.append(w)

  def spawn(iid):
    w = ready.pop(0)
    w.worker_id = iid
    return manager_lib.LocalHandle(w)

  T = trainer_s
  events = [SpotEvent(0.0, "a", "add"), SpotEvent(0.0, "b", "add"),
            SpotEvent(0.0, "c", "add"), SpotEvent(0.1 * T, "b", "remove"),
            SpotEvent(0.15 * T, "d", "add"), SpotEvent(0.2 * T, "a", "remove"),
            SpotEvent(0.25 * T, "e", "add")]
  replay = AvailabilityReplayer(events, spawn)
  mgr = manager_lib.RolloutManager(store, max_new_tokens=M, theta=2,
                                   poll_steps=4)
  mgr.on_poll = replay
  mgr.wait_for_workers_s = 30.0
  t0 = time.perf_counter()
  samples = mgr.run(requests)
  elastic_s = time.perf_counter() - t0
  worker_s = replay.close()

  lost = 0
  got = {s.key: s for s in samples}
  for key, want in ref.items():
    have = got.get(key)
    common = 0
    if have is not None:
      for a, b in zip(have.tokens, want.tokens):
        if a != b:
          break
        common += 1
    lost += len(want.tokens) - common
  st = mgr.stats
  tokens = sum(len(s.tokens) for s in samples)
  wall = time.perf_counter() - t_start
  print(f"trace: {n} prompts x G={G}, {ref_tokens} tokens; events "
        f"{[(round(t, 2), e.iid, e.kind) for t, e in replay.applied]}")
  head = f"{'run':<14}{'wall s':>8}{'tok/s':>9}{'device-s':>10}"
  print(head)
  print("-" * len(head))
  print(f"{'trainer-only':<14}{trainer_s:>8.2f}{ref_tokens / trainer_s:>9.0f}"
        f"{8 * trainer_s:>10.2f}")
  print(f"{'elastic':<14}{elastic_s:>8.2f}{tokens / elastic_s:>9.0f}"
        f"{worker_s:>10.2f}")
  print(f"preemptions {st.preemptions}, migrated samples "
        f"{st.migrated_samples}, kept tokens {st.kept_tokens}, re-prefill "
        f"tokens {st.reprefill_tokens}, pulls {st.pulls} "
        f"({st.pull_s / max(1, st.pulls) * 1e3:.1f} ms each), "
        f"balanced {st.balanced_requests}")
  print(f"wall time: {wall:.0f}s")
  print(json.dumps(dict(
      tokens_lost=lost, reprefill_tokens=st.reprefill_tokens,
      kept_tokens=st.kept_tokens,
      pull_latency_s=round(st.pull_s / max(1, st.pulls), 5),
      throughput_vs_trainer_only=round(
          (tokens / elastic_s) / (ref_tokens / trainer_s), 3),
      worker_seconds=round(worker_s, 3),
      trainer_only_device_seconds=round(8 * trainer_s, 3),
      preemptions=st.preemptions, migrated_samples=st.migrated_samples,
      samples=len(samples), expected_samples=len(ref),
      sim_rel_error=None, quick=_QUICK.value, bench_wall_s=round(wall, 1))))


if __name__ == "__main__":
  app.run(main)
