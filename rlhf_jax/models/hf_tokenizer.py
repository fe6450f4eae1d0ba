"""Tokenizers of HF checkpoints: fast tokenizer JSON + jinja2 chat templates.

`HFTokenizer.from_dir(path)` reads, from a local checkpoint directory:
- tokenizer.json through the `tokenizers` library (encode/decode);
- special tokens (bos/eos/pad/unk) from tokenizer_config.json, then
  special_tokens_map.json;
- the chat template from chat_template.jinja, chat_template.json or
  tokenizer_config.json["chat_template"] (first found), rendered with jinja2
  in a sandbox set up as transformers does (trim_blocks, lstrip_blocks,
  loopcontrols, `tojson` without HTML escaping, `raise_exception`,
  `strftime_now`), so prompts match `apply_chat_template` character for
  character;
- stop ids: eos_token_id of generation_config.json, else of config.json (an
  int or a list), plus the tokenizer's eos token.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import numpy as np
import tokenizers
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rlhf_jax.errors import ConfigError, MissingInputError

SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def _read(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _token_text(value: Any) -> str | None:
  """A special token as a string (configs store str or AddedToken dicts)."""
  if isinstance(value, Mapping):
    return value.get("content")
  return value


class _GenerationTag(jinja2.ext.Extension):
  """Accepts `{% generation %}...{% endgeneration %}` and renders the body."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return nodes.CallBlock(self.call_method("_render"), [], [], body
                           ).set_lineno(lineno)

  def _render(self, caller):
    return caller()


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None,
            sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                    separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
  """Compiles a chat template in a sandbox configured like transformers'."""
  env = ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = (
      lambda fmt: datetime.datetime.now().strftime(fmt))
  return env.from_string(source)


def _chat_template(path: str, tok_config: Mapping[str, Any]) -> str | None:
  jinja_file = os.path.join(path, "chat_template.jinja")
  if os.path.exists(jinja_file):
    with open(jinja_file, encoding="utf-8") as f:
      return f.read()
  template = _read(os.path.join(path, "chat_template.json")).get(
      "chat_template", tok_config.get("chat_template"))
  if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
    named = {t["name"]: t["template"] for t in template}
    template = named.get("default", next(iter(named.values()), None))
  return template


def _as_list(ids: int | Sequence[int] | None) -> list[int]:
  if ids is None:
    return []
  return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


class HFTokenizer:
  """A fast tokenizer with its checkpoint's special tokens and chat template."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, *,
               special_tokens: Mapping[str, str | None],
               chat_template: str | None = None,
               eos_token_ids: Sequence[int] = ()):
    self.tokenizer = tokenizer
    self.special_tokens = {k: special_tokens.get(k) for k in SPECIAL_NAMES}
    self.chat_template = chat_template
    self._template = (None if chat_template is None
                      else compile_chat_template(chat_template))
    ids = list(eos_token_ids)
    if self.eos_id is not None:
      ids.append(self.eos_id)
    self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))

  @classmethod
  def from_dir(cls, path: str) -> "HFTokenizer":
    """Loads the tokenizer of a local HF checkpoint directory.

    Args:
      path: directory with tokenizer.json (and optionally
        tokenizer_config.json, special_tokens_map.json, chat template files,
        generation_config.json, config.json).

    Returns:
      The HFTokenizer.
    """
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
      raise MissingInputError(
          f"{file} not found; only fast tokenizers (tokenizer.json) are "
          "supported")
    tok_config = _read(os.path.join(path, "tokenizer_config.json"))
    specials_map = _read(os.path.join(path, "special_tokens_map.json"))
    specials = {k: _token_text(tok_config.get(k, specials_map.get(k)))
                for k in SPECIAL_NAMES}
    gen = _read(os.path.join(path, "generation_config.json"))
    eos = gen.get("eos_token_id")
    if eos is None:
      eos = _read(os.path.join(path, "config.json")).get("eos_token_id")
    return cls(tokenizers.Tokenizer.from_file(file), special_tokens=specials,
               chat_template=_chat_template(path, tok_config),
               eos_token_ids=_as_list(eos))

  def _id(self, name: str) -> int | None:
    text = self.special_tokens[name]
    return None if text is None else self.tokenizer.token_to_id(text)

  @property
  def vocab_size(self) -> int:
    """Ids the tokenizer can produce (the model's vocab may be padded up)."""
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  @property
  def bos_id(self) -> int | None:
    return self._id("bos_token")

  @property
  def eos_id(self) -> int | None:
    return self._id("eos_token")

  @property
  def pad_id(self) -> int:
    """The pad token, else the first stop id, else 0 (padding is masked)."""
    pad = self._id("pad_token")
    if pad is not None:
      return pad
    return self.stop_ids[0] if self.stop_ids else 0

  def encode(self, text: str, *, add_special_tokens: bool = False
             ) -> list[int]:
    """Token ids of `text` (the post-processor adds bos etc. if asked)."""
    return self.tokenizer.encode(
        text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True,
             stop_at_eos: bool = True) -> str:
    """Text of `ids`, cut at the first stop id unless stop_at_eos=False."""
    ids = [int(i) for i in np.asarray(list(ids)).reshape(-1)]
    if stop_at_eos:
      cut = [k for k, i in enumerate(ids) if i in self.stop_ids]
      ids = ids[:cut[0]] if cut else ids
    return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True,
                          **kwargs: Any) -> str:
    """Renders a conversation with the checkpoint's chat template.

    Args:
      messages: [{"role": ..., "content": ...}, ...].
      add_generation_prompt: end with the assistant turn's opening.
      **kwargs: extra template variables (e.g. enable_thinking=False).

    Returns:
      The prompt text (tokenize it with `encode`, no special tokens added).
    """
    if self._template is None:
      raise ConfigError("this tokenizer has no chat template")
    context = {k: v for k, v in self.special_tokens.items() if v is not None}
    return self._template.render(
        **context, messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt, **kwargs)

  def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                  **kwargs: Any) -> list[int]:
    """Ids of the rendered conversation (the template holds the specials)."""
    return self.encode(self.apply_chat_template(messages, **kwargs))
