"""rlhf_jax.models."""
