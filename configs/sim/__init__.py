"""Simulator configs: one per seed headline; docstring = the run command."""
