"""rlhf_jax.workers."""
