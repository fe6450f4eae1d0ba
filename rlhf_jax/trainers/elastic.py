"""GRPO rollouts on elastic workers (`rlhf_jax/workers/`).

With `rollout.workers.num > 0` a step publishes the policy once to the
weight store (host copy) and runs its prompts on the workers through the
`RolloutManager` (JSQ dispatch, preemption-safe continuation, stale
samples re-sampled); with 0 the job runs trainer-only on its own mesh.
Workers are in-process engines on the trainer's devices (`kind="local"`,
tests) or Ray actors in their own JAX processes (`kind="ray"`).
`rollout.workers.seed`: the trainer's own engine seeds each rollout for
T_seed, then hands its unfinished samples to the workers (RLBoost adaptive
offload, `workers/seeding.py`). `rollout.workers.stream`: the trainer
trains on finished groups while the workers finish the rest
(`trainers/streaming.py`). `rollout.workers.scale="cost"`: hold the
cost-aware number of workers each step (`workers/pool.py`).
"""

from __future__ import annotations

import math
import os

from absl import logging
import jax
from ml_collections import ConfigDict

from rlhf_jax.trainers import rollout


def default_config() -> ConfigDict:
  """`rollout.workers`: how many rollout workers, where, dispatch knobs."""
  return ConfigDict(dict(num=0, kind="local", theta=4, poll_steps=8,
                         devices_per_worker=1, timeout_s=300.0,
                         # Ray resources each worker actor asks for:
                         # CPUs, GPUs, custom ones ({"TPU": 4},
                         # {"spot": 1}: docs/elastic.md).
                         cpus_per_worker=1.0, gpus_per_worker=0.0,
                         ray_resources={},
                         # Scale to demand (workers/pool.py): hold every
                         # available worker ("all") or the cost-aware count
                         # ("cost", lambda = weight of latency vs cost).
                         scale="all", cost_lambda=0.5,
                         # Adaptive offload (RLBoost Algorithm 1): the
                         # trainer's engine seeds for T_seed, then hands off.
                         seed=False, seed_init_s=1.0, seed_eta=3.0,
                         seed_floor_s=0.05,
                         # Micro-batch streaming (trainers/streaming.py):
                         # train on finished groups, stream_parts parts a
                         # step, while the workers finish the rest.
                         stream=False, stream_parts=2))


def check(config) -> None:
  from rlhf_jax.trainers.validate import ConfigError

  w = config.rollout.get("workers")
  if w is None or not w.num:
    return
  if w.num < 0 or w.kind not in ("local", "ray") or w.theta < 1 or (
      w.poll_steps < 1) or w.devices_per_worker < 1:
    raise ConfigError(f"config.rollout.workers is invalid: {w.to_dict()}; "
                      "num >= 0, kind local|ray, theta, poll_steps and "
                      "devices_per_worker >= 1")
  if not w.cpus_per_worker > 0:
    raise ConfigError("config.rollout.workers.cpus_per_worker must be > 0, "
                      f"got {w.cpus_per_worker}")
  bad = {k: v for k, v in dict(w.get("ray_resources", {})).items()
         if not (isinstance(v, (int, float)) and v > 0)}
  if w.get("gpus_per_worker", 0) < 0 or bad:
    raise ConfigError(
        "config.rollout.workers.gpus_per_worker must be >= 0 and "
        "ray_resources amounts > 0; got "
        f"{w.get('gpus_per_worker', 0)} and {bad or 'ok'}")
  if w.kind == "local" and w.num * w.devices_per_worker > jax.device_count():
    raise ConfigError(
        f"config.rollout.workers: {w.num} local workers x "
        f"{w.devices_per_worker} devices > {jax.device_count()} devices")
  if w.scale not in ("all", "cost"):
    raise ConfigError("config.rollout.workers.scale must be 'all' or "
                      f"'cost', got {w.scale!r}")
  if not 0.0 <= w.cost_lambda <= 1.0:
    raise ConfigError("config.rollout.workers.cost_lambda must be in "
                      f"[0, 1], got {w.cost_lambda}")
  if w.seed and not (w.seed_init_s >= 0 and w.seed_eta > 0 and
                     w.seed_floor_s >= 0):
    raise ConfigError(
        "config.rollout.workers.seed_init_s and .seed_floor_s must be >= 0 "
        f"and .seed_eta > 0; got {w.seed_init_s}, {w.seed_floor_s}, "
        f"{w.seed_eta}")
  if w.stream:
    _check_stream(config)
  if config.rollout.get("long_tail") and config.rollout.long_tail.enabled:
    raise ConfigError("config.rollout.workers and config.rollout.long_tail "
                      "do not combine yet; turn one off")


def _check_stream(config) -> None:
  """`rollout.workers.stream` needs each group used once, groups that are
  independent, and equal parts the updates and the learner can split."""
  from rlhf_jax.trainers.streaming import GROUP_LOCAL_ADVANTAGES
  from rlhf_jax.trainers.validate import ConfigError

  rl, w = config.rl, config.rollout.workers
  if rl.ppo_epochs != 1:
    raise ConfigError(
        "config.rollout.workers.stream trains on each group once, as it "
        f"finishes: set config.rl.ppo_epochs=1 (got {rl.ppo_epochs})")
  if w.stream_parts % rl.num_minibatches:
    raise ConfigError(
        f"config.rollout.workers.stream_parts={w.stream_parts} must be a "
        f"multiple of config.rl.num_minibatches={rl.num_minibatches} "
        "(whole parts per update)")
  if rl.advantage not in GROUP_LOCAL_ADVANTAGES:
    raise ConfigError(
        f"config.rollout.workers.stream needs group-local advantages "
        f"{GROUP_LOCAL_ADVANTAGES}; config.rl.advantage={rl.advantage!r} "
        "normalises over the whole batch")
  if rl.dynamic_sampling:
    raise ConfigError("config.rollout.workers.stream and "
                      "config.rl.dynamic_sampling do not combine")
  n, parts = config.train.prompts_per_step, w.stream_parts
  G = config.rollout.samples_per_row
  rows = n // max(parts, 1) * (1 if rl.share_prompt and G > 1 else G)
  if parts < 1 or n % parts or rows % rl.micro_batches:
    raise ConfigError(
        f"config.rollout.workers.stream_parts={parts} must divide "
        f"config.train.prompts_per_step={n} into parts whose {rows} rows "
        f"split into config.rl.micro_batches={rl.micro_batches}")


def build(config, cfg, stop_tokens):
  """(manager, store) for `rollout.workers`, or None when num == 0."""
  from rlhf_jax.trainers import builders
  from rlhf_jax.workers import manager as manager_lib
  from rlhf_jax.workers import weights
  from rlhf_jax.workers.pool import DemandScaler, WorkerPool
  from rlhf_jax.workers.worker import EngineSpec, RolloutWorker, ray_worker

  w, ro = config.rollout.get("workers"), config.rollout
  if w is None or not w.num:
    return None
  replicas = jax.device_count() // max(config.mesh.rollout_tensor, 1)
  spec = EngineSpec(cfg, num_rows=max(1, ro.num_rows // replicas)
                    * w.devices_per_worker,
                    samples_per_row=ro.samples_per_row,
                    # Continuations (prompt + tokens so far, after a
                    # preemption or hand-off) need the longest bucket.
                    prefill_buckets=tuple(sorted(set(ro.prefill_buckets) | {
                        max(ro.prefill_buckets) + ro.max_new_tokens})),
                    sampling=builders.sampling_params(ro, stop_tokens))
  if w.kind == "ray":
    import ray  # Optional extra: pip install .[ray]
    need = w.num * w.cpus_per_worker
    if not ray.is_initialized():
      if os.environ.get("RAY_ADDRESS"):  # An existing cluster.
        ray.init(include_dashboard=False, log_to_driver=False)
      else:  # A local one: its workers share this machine's cores (and
        # it offers the custom resources they ask for).
        ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(need)),
                 resources={k: v * w.num
                            for k, v in dict(w.ray_resources).items()},
                 include_dashboard=False, log_to_driver=False)
    per_worker = {"CPU": w.cpus_per_worker, "GPU": w.gpus_per_worker,
                  **dict(w.ray_resources)}
    have = ray.cluster_resources()
    short = {k: (have.get(k, 0), v * w.num) for k, v in per_worker.items()
             if have.get(k, 0) < v * w.num}
    if short:  # An actor Ray cannot place would time out as dead.
      logging.warning(
          "Ray cluster has {resource: (have, %d workers need)} %s; the rest "
          "start when nodes join", w.num, short)
    store = weights.RayWeightStore()
    actor = ray_worker(num_cpus=w.cpus_per_worker,
                       num_gpus=w.gpus_per_worker,
                       resources=dict(w.ray_resources))

    def spawn(wid):  # Holding starts an actor; releasing kills it.
      return manager_lib.RayHandle(
          actor.remote(wid, spec, None, w.devices_per_worker), wid,
          timeout_s=w.timeout_s)
  else:
    store = weights.LocalWeightStore()
    devs = jax.devices()
    k = w.devices_per_worker
    workers = {f"w{i}": RolloutWorker(f"w{i}", spec,
                                      devices=devs[i * k:(i + 1) * k])
               for i in range(w.num)}

    def spawn(wid):  # Releasing just stops using the in-process worker.
      workers[wid].clear()  # Work it held when it died runs elsewhere.
      return manager_lib.LocalHandle(workers[wid])
  mgr = manager_lib.RolloutManager(store, max_new_tokens=ro.max_new_tokens,
                                   theta=w.theta, poll_steps=w.poll_steps)
  pool = WorkerPool(mgr)
  # Every poll round the pool admits workers that finished starting and
  # replaces dead ones; with none alive the manager waits for one as long
  # as a worker may take to answer.
  mgr.on_poll, mgr.wait_for_workers_s = pool, w.timeout_s
  for i in range(w.num):
    pool.offer(f"w{i}", lambda wid=f"w{i}": spawn(wid))
  pool.hold(w.num)  # Every worker at first; `generate` re-chooses per step.
  mgr.scaler = DemandScaler(
      pool, scale=w.scale, lam=w.cost_lambda,
      slots=spec.num_rows * spec.samples_per_row,
      max_new_tokens=ro.max_new_tokens, devices_per_worker=w.devices_per_worker)
  mgr.seed_window = None
  return mgr


def attach_seed_window(mgr, config, engine) -> None:
  """Adds the trainer's `engine` as the seeding worker (`rollout.workers.seed`)."""
  from rlhf_jax.sched import offload
  from rlhf_jax.workers.seeding import SeedWindow

  if mgr is None or not config.rollout.workers.seed:
    return
  w = config.rollout.workers
  mgr.seed_window = SeedWindow(engine, offload.SeedWindowController(
      n_resv=1, t_init=w.seed_init_s, eta=w.seed_eta, floor=w.seed_floor_s))


def generate(mgr, params, version: int, prompts, num_samples: int,
             seed: int, engine=None, train_s: float | None = None,
             stream=None):
  """Publishes `params` as `version`; the batch's samples, in batch order.

  With `rollout.workers.seed`, `engine` (the trainer's rollout engine, which
  `params` are laid out for) seeds the batch first (`workers/seeding.py`);
  `train_s` is the trainer's last training time, for the worker cap.
  `stream` (`trainers/streaming.StreamedStep`) gets every poll round's
  finished samples and is freed when the trainer's devices leave the
  rollout (at the hand-off; at once without seeding).
  """
  from rlhf_jax.workers.manager import ManagerStats

  try:
    published = mgr.store.latest()
  except LookupError:
    published = None
  if published != version:  # Dynamic sampling reruns a step's rollout.
    mgr.store.publish(version, params)
  mgr.stats = ManagerStats()
  scaler = getattr(mgr, "scaler", None)
  if scaler is not None:  # Scale to demand: hold this rollout's workers.
    window = getattr(mgr, "seed_window", None)
    scaler.begin(prompts.prompt_ids, num_samples, version,
                 cap=window.worker_cap if window is not None else None)
  order = {int(pid): i for i, pid in enumerate(prompts.prompt_ids)}
  requests = rollout.requests_for(prompts, num_samples, seed)
  seed_metrics = {}
  if getattr(mgr, "seed_window", None) is not None and engine is not None:
    samples, seed_metrics = mgr.seed_window.run(mgr, params, version,
                                                requests, train_s, stream)
  elif stream is not None:
    mgr.start(requests)
    stream.free()
    while not mgr.done:
      stream.add(mgr.step())
    samples = mgr.results()
  else:
    samples = mgr.run(requests)
  samples.sort(key=lambda s: (order[s.prompt_id], s.sample_idx))
  st = mgr.stats
  metrics = {"workers/alive": float(len(mgr.handles)),
             "workers/preemptions": float(st.preemptions),
             "workers/migrated_samples": float(st.migrated_samples),
             "workers/stale_resampled": float(st.stale_resampled),
             "workers/pull_s": st.pull_s, **seed_metrics}
  if scaler is not None:  # held, worker_s, chosen and the policy inputs.
    metrics.update(scaler.end(samples, st.pull_s, st.pulls))
  return samples, metrics


def length_history(mgr):
  """The per-prompt length history `rollout.workers.scale="cost"` learns
  (to save in the checkpoint metadata), else None."""
  scaler = getattr(mgr, "scaler", None)
  return (scaler.history if scaler is not None and scaler.scale == "cost"
          else None)


def close(mgr) -> float:
  """Releases every held worker (Ray actors end); total worker-seconds."""
  scaler = getattr(mgr, "scaler", None)
  return scaler.pool.close() if scaler is not None else 0.0
