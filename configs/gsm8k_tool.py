"""GRPO with a calculator tool on GSM8K, from a local Qwen2.5 checkpoint.

python -m rlhf_jax.main --config=configs/gsm8k_tool.py \
    --config.model.path=/ckpt/Qwen2.5-1.5B-Instruct \
    --config.data.path=/data/gsm8k/train.jsonl \
    --workdir=workdirs/gsm8k_tool
python -m rlhf_jax.main --config=configs/gsm8k_tool.py:runlocal \
    --workdir=/tmp/gsm8k_tool_runlocal   # CPU, tiny random Qwen2, ~1 minute

`configs/gsm8k_grpo.py` with multi-turn rollouts (`config.agent`,
rlhf_jax/envs/, docs/agentic.md): the system prompt offers a calculator in
the Qwen2.5 chat template's tool format; a `<tool_call>` JSON call ends the
turn (`</tool_call>` is a stop token), the result comes back as a tool
turn, and the model goes on, the conversation's KV kept. Add
`--config.agent.tools='("calc", "python")'` for the sandboxed Python tool
(refused at start where the sandbox cannot be isolated).
"""

import json

from configs import common
from configs import gsm8k_grpo
from rlhf_jax import typed_config
from rlhf_jax.config import sections

CALCULATOR = {"type": "function", "function": {
    "name": "calc",
    "description": "Evaluates an arithmetic expression: numbers, + - * / "
                   "// % ** and parentheses.",
    "parameters": {"type": "object", "properties": {
        "expression": {"type": "string",
                       "description": "e.g. (48 - 12) * 3 / 4"}},
        "required": ["expression"]}}}

# The Qwen2.5 chat template's system text for tools, with the calculator.
SYSTEM = (
    "You are a helpful assistant.\n\n# Tools\n\nYou may call one or more "
    "functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(CALCULATOR) + "\n</tools>\n\nFor each function call, return "
    "a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False)
  c = gsm8k_grpo.get_config("runlocal" if arg.runlocal else None)
  c.name = "gsm8k_tool"
  c.data.system_prompt = SYSTEM
  # The system turn (with the tool list) is every prompt's common prefix.
  c.rollout.max_common_length = 0 if arg.runlocal else 512
  if not arg.runlocal:
    c.rollout.update(prefill_buckets=(512, 768), max_new_tokens=768,
                     max_seq_len=1536)
    c.data.max_prompt_len = 768
  else:
    c.data.max_prompt_len = 640
    c.rollout.update(prefill_buckets=(640,), max_new_tokens=32,
                     max_seq_len=672)
  c.agent = typed_config.config_dict(
      sections.Agent, enabled=True, tools=("calc",), format="qwen",
      max_turns=4)
  return c
