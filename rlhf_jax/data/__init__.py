"""rlhf_jax.data."""
