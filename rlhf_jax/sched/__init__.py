"""rlhf_jax.sched."""
