"""rlhf_jax.engine."""
