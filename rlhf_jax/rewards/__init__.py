"""rlhf_jax.rewards."""
