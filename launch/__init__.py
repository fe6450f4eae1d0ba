"""Launchers that build the same `python -m rlhf_jax.main` command per host."""
