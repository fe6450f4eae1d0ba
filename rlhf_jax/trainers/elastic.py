"""GRPO rollouts on elastic workers (`rlhf_jax/workers/`).

With `rollout.workers.num > 0` a step publishes the policy once to the
weight store (host copy) and runs its prompts on the workers through the
`RolloutManager` (JSQ dispatch, preemption-safe continuation, stale
samples re-sampled); with 0 the job runs trainer-only on its own mesh.
Workers are in-process engines on the trainer's devices (`kind="local"`,
tests) or Ray actors in their own JAX processes (`kind="ray"`).
Not built yet: the seed window on the trainer's mesh before handing off
(RLBoost adaptive offload) and scaling the worker count to demand.
"""

from __future__ import annotations

import jax
from ml_collections import ConfigDict

from rlhf_jax.trainers import rollout


def default_config() -> ConfigDict:
  """`rollout.workers`: how many rollout workers, where, dispatch knobs."""
  return ConfigDict(dict(num=0, kind="local", theta=4, poll_steps=8,
                         devices_per_worker=1, timeout_s=300.0))


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
  if w.kind == "local" and w.num * w.devices_per_worker > jax.device_count():
    raise ConfigError(
        f"config.rollout.workers: {w.num} local workers x "
        f"{w.devices_per_worker} devices > {jax.device_count()} devices")
  if config.rollout.get("long_tail") and config.rollout.long_tail.enabled:
    raise ConfigError("config.rollout.workers and config.rollout.long_tail "
                      "do not combine yet; turn one off")


def build(config, cfg, stop_tokens):
  """(manager, store) for `rollout.workers`, or None when num == 0."""
  from rlhf_jax.trainers import builders
  from rlhf_jax.workers import manager as manager_lib
  from rlhf_jax.workers import weights
  from rlhf_jax.workers.worker import EngineSpec, RolloutWorker, ray_worker

  w, ro = config.rollout.get("workers"), config.rollout
  if w is None or not w.num:
    return None
  replicas = jax.device_count() // max(config.mesh.rollout_tensor, 1)
  spec = EngineSpec(cfg, num_rows=max(1, ro.num_rows // replicas)
                    * w.devices_per_worker,
                    samples_per_row=ro.samples_per_row,
                    prefill_buckets=tuple(ro.prefill_buckets),
                    sampling=builders.sampling_params(ro, stop_tokens))
  if w.kind == "ray":
    import ray  # Optional extra: pip install .[ray]
    if not ray.is_initialized():
      # An existing cluster if RAY_ADDRESS is set, else a local one.
      ray.init(include_dashboard=False, log_to_driver=False)
    store = weights.RayWeightStore()
    actor = ray_worker(num_cpus=1)
    handles = [manager_lib.RayHandle(
        actor.remote(f"w{i}", spec, None, w.devices_per_worker), f"w{i}",
        timeout_s=w.timeout_s) for i in range(w.num)]
  else:
    store = weights.LocalWeightStore()
    devs = jax.devices()
    k = w.devices_per_worker
    handles = [manager_lib.LocalHandle(RolloutWorker(
        f"w{i}", spec, devices=devs[i * k:(i + 1) * k]))
               for i in range(w.num)]
  mgr = manager_lib.RolloutManager(store, max_new_tokens=ro.max_new_tokens,
                                   theta=w.theta, poll_steps=w.poll_steps)
  for h in handles:
    mgr.add(h)
  return mgr


def generate(mgr, params, version: int, prompts, num_samples: int,
             seed: int):
  """Publishes `params` as `version`; the batch's samples, in batch order."""
  from rlhf_jax.workers.manager import ManagerStats

  try:
    published = mgr.store.latest()
  except LookupError:
    published = None
  if published != version:  # Dynamic sampling reruns a step's rollout.
    mgr.store.publish(version, params)
  mgr.stats = ManagerStats()
  order = {int(pid): i for i, pid in enumerate(prompts.prompt_ids)}
  samples = mgr.run(rollout.requests_for(prompts, num_samples, seed))
  samples.sort(key=lambda s: (order[s.prompt_id], s.sample_idx))
  st = mgr.stats
  metrics = {"workers/alive": float(len(mgr.handles)),
             "workers/preemptions": float(st.preemptions),
             "workers/migrated_samples": float(st.migrated_samples),
             "workers/stale_resampled": float(st.stale_resampled),
             "workers/pull_s": st.pull_s}
  return samples, metrics
