"""Agent functions the agent-worker tests run in worker processes
(`rlhf_jax/envs/agent_workers.py` imports them by "module:function"; this
directory is on the job's import path, so on the workers')."""

import os
import sys
import time


def by_prompt(client, prompt, metadata):
  """Does what the prompt says, without the endpoint: "exit" ends its
  process, "raise" raises, "sleep" sleeps 600 s, "pid" returns its
  process id, "print" prints to stdout first; else returns the prompt as
  a number."""
  del client
  if prompt == "exit":
    os._exit(3)
  if prompt == "raise":
    raise ValueError(f"asked to raise ({metadata})")
  if prompt == "sleep":
    if "pid_file" in metadata:
      with open(metadata["pid_file"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
  if prompt == "pid":
    return float(os.getpid())
  if prompt == "print":
    print("an agent's own output\n1e9", flush=True)
    sys.stdout.write("not JSON\n")
    return 5.0
  return float(prompt)
