"""rlhf_jax.sim."""
