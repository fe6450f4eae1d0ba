"""The tiny tool task with the calculator in an agent written against the
`openai` client: the agent talks to the rollout's OpenAI-compatible
endpoint on 127.0.0.1 (docs/agentic.md), one thread per episode.

python -m rlhf_jax.main --config=configs/tiny_agent_api.py --workdir=workdirs/tiny_agent_api
python -m rlhf_jax.main --config=configs/tiny_agent_api.py:runlocal   # tests

Everything else is configs/tiny_tool.py. `calc_agent` answers each call
exactly as the in-process `ToolEnv` does, so this job's samples, rewards
and updates are tiny_tool's (tests/serving/test_agent_api.py); the eval's
greedy accuracy is measured through the same agent. The episode's reward
is the task's (`arithmetic` on the final answer); the agent returns 0.
"""

import json

from configs import tiny_tool
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
  c = tiny_tool.get_config(arg)
  c.name = "tiny_agent_api"
  c.agent.agent_fn = "configs.tiny_agent_api:calc_agent"
  return c
