"""Tools, the formats a policy calls them in, and the tool environment.

A tool maps its argument text to an observation text and never raises (a
failure is an observation starting "error:"). Formats:

- "tagged", for the character-level tiny models: the call is
  `[name args]` (`]` is a stop token), the reply `(output)`:
  `37*48=[calc 37*48](1776)1776`.
- "qwen", the Qwen2.5/Qwen3 chat template's: the call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the close is
  one special token, the stop token), the reply a tool turn,
  `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response>
  <|im_end|>\\n<|im_start|>assistant\\n`, after which the model goes on.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Callable, Mapping, Protocol

from rlhf_jax.envs.environment import Step
from rlhf_jax.errors import ConfigError


class Tool(Protocol):
  name: str
  arg: str  # The argument's name in a JSON call ("expression", "code").

  def __call__(self, text: str) -> str: ...


# --------------------------------------------------------------- calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub,
           ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class Calculator:
  """Arithmetic on numbers: + - * / // % ** and parentheses. The
  expression is parsed, never executed: only these nodes are evaluated."""
  name, arg = "calc", "expression"
  MAX_DIGITS = 64   # Operands and results; ** cannot blow up memory.
  MAX_CHARS = 200

  def __call__(self, text: str) -> str:
    try:
      if len(text) > self.MAX_CHARS:
        raise ValueError(f"longer than {self.MAX_CHARS} characters")
      value = self._eval(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError,
            TypeError) as e:
      return f"error: {e}" if str(e) else f"error: {type(e).__name__}"
    if isinstance(value, float) and value.is_integer():
      value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"

  def _eval(self, node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return self._check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
      left, right = self._eval(node.left), self._eval(node.right)
      if isinstance(node.op, ast.Pow) and abs(right) * max(
          1, len(str(abs(int(left))))) > self.MAX_DIGITS:
        raise ValueError("result too large")
      return self._check(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
      return _UNARY[type(node.op)](self._eval(node.operand))
    raise ValueError("only numbers, + - * / // % ** and parentheses")

  def _check(self, value):
    if isinstance(value, complex) or (
        isinstance(value, int) and len(str(abs(value))) > self.MAX_DIGITS):
      raise ValueError("result too large")
    return value


# ------------------------------------------------------------------ formats
class TaggedFormat:
  """`[name args]` calls and `(output)` replies (module doc)."""
  name = "tagged"
  _TRANSCRIPT = re.compile(r"\[[^\[\]]*\]\([^()]*\)")

  def stop_ids(self, tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.encode("]"))

  def parse(self, action: str, tools: Mapping) -> tuple[str, str] | None:
    """(tool name, argument text) of a turn ending in a call, else None."""
    if not action.endswith("]") or "[" not in action:
      return None
    name, _, args = action[action.rindex("[") + 1:-1].partition(" ")
    return name, args

  def before_call(self, action: str) -> str:
    """The text of a turn ending in a call before the call."""
    return action[:action.rindex("[")]

  def render(self, observation: str) -> str:
    # Parentheses would end the reply early; the tiny vocabulary has no
    # other brackets to swap in, so they go.
    return "(" + observation.replace("(", "").replace(")", "") + ")"

  def final(self, text: str) -> str:
    """The text after the last call transcript (the answer)."""
    ends = [m.end() for m in self._TRANSCRIPT.finditer(text)]
    return text[ends[-1]:] if ends else text


class QwenFormat:
  """The Qwen2.5/Qwen3 chat template's tool calls (module doc)."""
  name = "qwen"
  OPEN, CLOSE = "<tool_call>", "</tool_call>"

  def stop_ids(self, tokenizer) -> tuple[int, ...]:
    ids = tuple(tokenizer.encode(self.CLOSE))
    if len(ids) != 1:
      raise ConfigError(
          f"config.agent.format='qwen': the tokenizer encodes {self.CLOSE!r} "
          f"as {len(ids)} tokens, not one special token (not a Qwen2.5/"
          "Qwen3 tokenizer?); use format='tagged'")
    return ids

  def parse(self, action: str, tools: Mapping) -> tuple[str, str] | None:
    # The special tokens may be decoded away; the JSON object remains.
    body = action.rsplit(self.OPEN, 1)[-1]
    start, end = body.find("{"), body.rfind("}")
    if start < 0 or end < start or not (
        action.endswith(self.CLOSE) or action.rstrip().endswith("}")):
      return None
    try:
      call = json.loads(body[start:end + 1])
      name, args = call["name"], call.get("arguments", {})
      if isinstance(args, str):
        args = json.loads(args)
    except (ValueError, KeyError, TypeError):
      return "", "error: the tool call is not valid JSON"
    tool = tools.get(name)
    arg = args.get(tool.arg, "") if tool is not None and isinstance(
        args, dict) else ""
    return str(name), str(arg)

  def before_call(self, action: str) -> str:
    return action.rsplit(self.OPEN, 1)[0] if self.OPEN in action else ""

  def render(self, observation: str) -> str:
    return ("<|im_end|>\n<|im_start|>user\n<tool_response>\n" + observation
            + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")

  def final(self, text: str) -> str:
    return text.rsplit("</tool_response>", 1)[-1]


FORMATS = {"tagged": TaggedFormat, "qwen": QwenFormat}


# ---------------------------------------------------------------------- env
class ToolEnv:
  """An episode with tools: a turn ending in a call gets the tool's
  output; any other turn ends the episode. `enabled=False` (the ablation)
  answers every call with an error observation."""

  def __init__(self, tools: Mapping[str, Tool], fmt, *, enabled: bool = True):
    self.tools, self.fmt, self.enabled = dict(tools), fmt, enabled

  def reset(self, prompt: str, metadata: Mapping) -> None:
    del prompt, metadata  # Tools keep no state across turns.

  def close(self) -> None:
    pass

  def step(self, action: str) -> Step:
    call = self.fmt.parse(action, self.tools)
    if call is None:
      return Step(None, done=True)
    name, args = call
    if not name:  # A malformed call: `args` says why.
      out = args
    elif not self.enabled:
      out = "error: tools are disabled"
    elif name not in self.tools:
      out = f"error: unknown tool {name!r}; tools: {sorted(self.tools)}"
    else:
      try:
        out = self.tools[name](args)
      except Exception as e:  # pylint: disable=broad-except
        out = f"error: {type(e).__name__}: {e}"  # Never stops the job.
    return Step(out, tool_call=True, tool_error=out.startswith("error"))


def _python_sandbox(python_limits) -> Tool:
  """The Python tool, checked here: a machine that cannot isolate it fails
  at the job's start."""
  from rlhf_jax.envs import sandbox  # pylint: disable=g-import-not-at-top
  tool = sandbox.PythonSandbox(python_limits or sandbox.SandboxLimits())
  try:
    tool.check()
  except sandbox.SandboxUnavailable as e:
    raise ConfigError(f"config.agent.tools has 'python': {e}") from None
  return tool


# name -> (python_limits -> the tool); `config.agent.tools` names these.
_MAKERS: dict[str, Callable[..., Tool]] = {
    "calc": lambda python_limits: Calculator(),
    "python": _python_sandbox,
}
TOOL_NAMES = tuple(_MAKERS)


def make_tools(names, *, python_limits=None) -> dict[str, Tool]:
  """The named tools (of `TOOL_NAMES`), the Python sandbox checked."""
  unknown = [n for n in names if n not in _MAKERS]
  if unknown:
    raise ConfigError(f"config.agent.tools: unknown tool {unknown[0]!r}; "
                      f"known: {list(TOOL_NAMES)}")
  return {tool.name: tool
          for tool in (_MAKERS[n](python_limits) for n in names)}
