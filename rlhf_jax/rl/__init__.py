"""rlhf_jax.rl."""
