"""OpenAI chat messages <-> the policy's text: the chat template renders an
agent's messages; a model turn becomes an assistant message.

A conversation is trained as one token sequence, so the template must
render an assistant message exactly as the model wrote it (its content,
then its tool call in the tool format). `TAGGED_TEMPLATE` does that for
the tiny models' "tagged" format (`envs/tools.TaggedFormat`): a turn
`37*48=[calc 37*48]` is the message {content: "37*48=", tool_calls:
[calc({"expression": "37*48"})]} and renders back to the same text; a
tool message renders as `TaggedFormat.render` writes a reply, `(1776)`.
Templates are Jinja (Hugging Face's convention: `messages`, tool-call
`arguments` as a mapping), run in Jinja's sandbox.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

# User and system text as given; an assistant turn's content, then each
# call as `[name argument]`; a tool reply in parentheses, its own
# parentheses dropped (they would end the reply early).
TAGGED_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] -%}"
    "[{{ c.function.name }}"
    "{%- for v in c.function.arguments.values() %} {{ v }}{%- endfor -%}]"
    "{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}"
    "({{ m.content | replace('(', '') | replace(')', '') }})"
    "{%- else -%}{{ m.content }}"
    "{%- endif -%}"
    "{%- endfor -%}")

ROLES = ("system", "user", "assistant", "tool")


class MessageError(ValueError):
  """A request's messages that cannot be rendered (one line)."""


class ChatRenderer:
  """Renders message lists with one Jinja chat template."""

  def __init__(self, template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=g-import-not-at-top
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    self._template = env.from_string(template)

  def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
    return self._template.render(messages=[_normalised(m) for m in messages])


def _normalised(message: Mapping[str, Any]) -> dict:
  """A message as templates read it: a known role, text content, tool-call
  arguments as a mapping (the API sends them as a JSON string)."""
  if not isinstance(message, Mapping):
    raise MessageError("each message must be an object")
  role = message.get("role")
  if role not in ROLES:
    raise MessageError(f"message role {role!r}: one of {list(ROLES)}")
  content = message.get("content")
  if isinstance(content, list):  # Content parts: their text, joined.
    content = "".join(p.get("text", "") for p in content
                      if isinstance(p, Mapping))
  if content is not None and not isinstance(content, str):
    raise MessageError(f"a {role} message's content must be text")
  calls = []
  for call in message.get("tool_calls") or []:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
      try:
        args = json.loads(args) if args.strip() else {}
      except ValueError:
        raise MessageError(f"tool call {fn.get('name')!r}: arguments are "
                           "not JSON") from None
    if not isinstance(args, Mapping):
      raise MessageError(f"tool call {fn.get('name')!r}: arguments must be "
                         "a JSON object")
    calls.append({"id": call.get("id"), "type": "function",
                  "function": {"name": fn.get("name", ""),
                               "arguments": dict(args)}})
  out = {"role": role, "content": content}
  if calls:
    out["tool_calls"] = calls
  return out


def assistant_message(turn: str, fmt, tools: Mapping, call_id: str) -> dict:
  """The assistant message of a model turn's text (its stop token's text
  included): a turn ending in a call of the tool format carries it as
  `tool_calls` (the argument under the tool's argument name), the text
  before it as content; any other turn is content alone."""
  call = fmt.parse(turn, tools)
  if call is None:
    return {"role": "assistant", "content": turn}
  name, arg = call  # A nameless call too: the tool format's own reply.
  tool = tools.get(name)
  key = tool.arg if tool is not None else "input"
  content = fmt.before_call(turn)
  return {"role": "assistant", "content": content, "tool_calls": [{
      "id": call_id, "type": "function",
      "function": {"name": name,
                   "arguments": json.dumps({key: arg} if arg else {})}}]}
