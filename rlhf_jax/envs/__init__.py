"""Environments for multi-turn, tool-using rollouts.

  base.py      the `Env` interface (reset, step -> observation, reward, done)
  tools.py     tools (calculator), call formats (tagged, Qwen), `ToolEnv`
  sandbox.py   the Python tool, isolated by the operating system
  episodes.py  one rollout's environments as the engine's `reply`, with
               the turn budget, the replay log and the metrics
"""
