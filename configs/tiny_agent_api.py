"""The tiny tool task with the calculator in an agent written against the
`openai` client: the agent talks to the rollout's OpenAI-compatible
endpoint on 127.0.0.1 (docs/agentic.md), one thread per episode.

python -m rlhf_jax.main --config=configs/tiny_agent_api.py --workdir=workdirs/tiny_agent_api
python -m rlhf_jax.main --config=configs/tiny_agent_api.py:runlocal   # tests
python -m rlhf_jax.main --config=configs/tiny_agent_api.py:program     # the agent as a program
python -m rlhf_jax.main --config=configs/tiny_agent_api.py:threads     # in the job's threads

Everything else is configs/tiny_tool.py. `calc_agent` answers each call
exactly as the in-process `ToolEnv` does, so this job's samples, rewards
and updates are tiny_tool's (tests/serving/test_agent_api.py); the eval's
greedy accuracy is measured through the same agent. The episode's reward
is the task's (`arithmetic` on the final answer); the agent returns 0.
The agent runs in a worker process of the job (`agent.agent_workers=1`,
one thread per episode there); `:threads` runs it in the job's process.
`:program` runs the same agent as a program per episode
(`agent.agent_cmd`: `python -m configs.tiny_agent_api`, the endpoint in
its environment, as `openai.OpenAI()` reads it).
"""

import json
import os
import sys

# Light imports only: the program (`:program`) starts once per episode.
from rlhf_jax.envs.tools import Calculator

TOOLS = {"calc": Calculator()}


def calc_agent(client, prompt, metadata):
  """Calls the policy until it answers without a tool call; runs the
  calculator on each call (other names get the error `ToolEnv` gives)."""
  del metadata
  messages = [{"role": "user", "content": prompt}]
  while True:
    reply = client.chat.completions.create(model="policy", messages=messages)
    choice = reply.choices[0]
    if choice.finish_reason != "tool_calls":
      return 0.0
    messages.append(choice.message.model_dump(exclude_none=True))
    for call in choice.message.tool_calls:
      name = call.function.name
      arg = next(iter(json.loads(call.function.arguments).values()), "")
      if not name:  # The format's nameless call: its text is the reply.
        out = arg
      elif name in TOOLS:
        out = TOOLS[name](arg)
      else:
        out = f"error: unknown tool {name!r}; tools: {sorted(TOOLS)}"
      messages.append({"role": "tool", "tool_call_id": call.id,
                       "content": out})


def get_config(arg=None):
  from configs import common, tiny_tool  # pylint: disable=g-import-not-at-top
  parsed = common.parse_arg(arg, runlocal=False, program=False,
                            threads=False)
  c = tiny_tool.get_config("runlocal" if parsed.runlocal else None)
  c.name = "tiny_agent_api"
  if parsed.program:
    c.agent.agent_cmd = f"{sys.executable} -m configs.tiny_agent_api"
  else:
    c.agent.agent_fn = "configs.tiny_agent_api:calc_agent"
    # A worker process runs the agents (their threads), not the job's.
    c.agent.agent_workers = 0 if parsed.threads else 1
  return c


if __name__ == "__main__":  # The agent as a program (`:program`).
  import openai  # pylint: disable=g-import-not-at-top
  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment; no proxy.
  print(calc_agent(
      openai.OpenAI(max_retries=0,
                    http_client=openai.DefaultHttpxClient(trust_env=False)),
      os.environ["RLHF_JAX_PROMPT"],
      json.loads(os.environ["RLHF_JAX_METADATA"])))
