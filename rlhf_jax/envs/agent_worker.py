"""An agent worker process (`agent_workers.py`):

  python -m rlhf_jax.envs.agent_worker MODULE:FUNCTION ANSWER_FD

reads episodes as JSON lines on stdin, runs each in a thread of its own
(`FUNCTION(client, prompt, metadata)` with an `openai` client for the
episode's key) and writes one JSON line per episode to the file
descriptor ANSWER_FD. Exits when stdin closes. Keeps its imports light:
the agent's module and `openai`, not JAX.
"""

from __future__ import annotations

import json
import os
import sys
import threading


def main(agent_fn: str, answer_fd: int) -> None:
  # The protocol's pipes are this loop's alone: the agent's own
  # subprocesses get neither (stdin is /dev/null to them; the answer pipe
  # is not inherited), so they cannot eat episodes or keep a dead
  # worker's pipe open.
  os.set_inheritable(answer_fd, False)
  answers = os.fdopen(answer_fd, "w")
  episodes = os.fdopen(os.dup(0), "r")
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  sys.stdout = sys.stderr  # The agent's prints go to the job's stderr.
  from rlhf_jax.envs import agent_env  # pylint: disable=g-import-not-at-top
  agent = agent_env.load_agent(agent_fn)
  __import__("openai")  # Once here, not in the first episode's thread.
  lock = threading.Lock()

  def run(episode: dict) -> None:
    try:
      client = agent_env._openai_client(episode["base_url"],  # pylint: disable=protected-access
                                        episode["api_key"])
      reward = agent(client, episode["prompt"], episode["metadata"])
      answer = {"reward": None if reward is None else float(reward)}
    except Exception as e:  # pylint: disable=broad-except
      answer = {"error": f"{type(e).__name__}: {e}"}
    with lock:
      answers.write(json.dumps(dict(answer, id=episode["id"])) + "\n")
      answers.flush()

  for line in episodes:
    threading.Thread(target=run, args=(json.loads(line),), daemon=True).start()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
