"""Scheduling policies of the seed papers, as plain Python decisions.

Nothing here touches arrays or time: each function takes what a scheduler can
observe (queue lengths, predicted lengths, idle times) and returns a
decision. rlhf_jax.sim executes the decisions in simulated time; the live
engine and elastic workers will execute the same ones.

  policy          named policies (baseline, rlhfuse, rlhfless, rlboost,
                  combined) = mechanism switches + knobs
  length_history  per-prompt EWMA of response lengths (RLHFless)
  assignment      contiguous and length-grouped group -> actor assignment
  actor_scaling   lambda-weighted latency/cost choice of the actor count
  tail            RLHFuse consolidation at R_t, RLHFless cut at tau
  placement       RLHFless locality-aware placement of actors on nodes
  offload         RLBoost T_seed controller, N_prem cap, JSQ-Theta dispatch,
                  CONTINUOUSLB with the batching plateau, Disagg.BAL's
                  balanced reserved instance count
  pipeline        fused actor/critic pipeline problem, evaluator, bound
  pipeline_search schedule search for the fused pipeline
  cost_model      roofline profiles and costs (hardware, models, setting,
                  an async batch's seconds): the simulator's and the
                  async job's split
  spot            a spot availability trace's event
  staleness       async RL: when a batch may be drawn, when the rollout
                  takes new weights, which samples are trainable (eta)
"""
