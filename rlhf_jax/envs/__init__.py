"""Environments for multi-turn, tool-using rollouts.

  base.py      the `Env` interface (reset, step -> observation, reward, done)
  tools.py     tools (calculator), call formats (tagged, Qwen), `ToolEnv`
  sandbox.py   the Python tool, isolated by the operating system
  episodes.py  one rollout's environments as the engine's `reply`, with
               the turn budget, the replay log and the metrics
  agent_env.py an agent behind the OpenAI-compatible endpoint as an
               environment (a function in threads, or a program)
  agent_workers.py, agent_worker.py  agent functions in worker processes
"""
