"""Benchmarks: each measures one claim against a baseline in the same run."""
