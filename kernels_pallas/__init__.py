"""Pallas kernels: one op per file, each with a jnp reference and a dispatching wrapper."""
