"""Trace-driven discrete-event simulator of RL post-training at scale.

Run: python -m rlhf_jax.sim --config=configs/sim/<name>.py (docs/sim.md).
Its cost model (device and model profiles, roofline costs, the setting)
is `rlhf_jax.sched.cost_model`, which the live jobs use too.

  workload          long-tailed, correlated, drifting lengths or a CSV trace
  availability      spot traces: A/B/C segments generated with parameters
                    measured from Bamboo's trace, that trace's windows, CSV
  instance          continuous-batching decode engine as a fluid model
  step, step_tail, step_elastic, step_phases
                    one RL step as events, executing rlhf_jax.sched
  training          pipeline-parallel actor/critic training time
  pool, accounting  billing, utilization, Chrome-trace timelines
  runner, reproduce multi-step runs, policy comparisons, headlines
"""
