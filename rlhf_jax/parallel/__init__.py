"""rlhf_jax.parallel."""
