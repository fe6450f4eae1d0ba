"""GSM8K-style rewards: numeric final-answer match and an answer-format check.

The final answer of a completion is the number after its last "####" (the
GSM8K solution format) or, failing that, inside its last \\boxed{...}. The
reference is metadata["answer"]: a full GSM8K solution ("... #### 72") or
the bare answer. Numbers compare as values, tolerant of thousands commas,
"$", "%", LaTeX spacing and \\frac{a}{b} / a/b fractions ("1,000.00" equals
"$1000"). Registered as reward "gsm8k" and "gsm8k_format".

For models that answer in prose rather than GSM8K's format: "last_number"
(lenient: the completion's last number is the answer) and "number_only"
(strict format: the completion is the bare number, whatever its value).
"""

from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

from rlhf_jax.errors import DataError
from rlhf_jax.rl import registry

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")
# Decorations that never change the value.
_NOISE = ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\;", "\\ ", "\\left",
          "\\right", "−")


def last_boxed(text: str) -> str | None:
  """Content of the last \\boxed{...} (or \\fbox{...}), nested braces ok."""
  start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
  if start < 0:
    return None
  i = text.index("{", start) + 1
  depth = 1
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i:j]
  return None


def _clean(text: str) -> str:
  text = _FRAC.sub(r"(\1)/(\2)", text)
  text = _TEXT.sub(r"\1", text)
  for noise in _NOISE:
    text = text.replace(noise, "-" if noise == "−" else "")
  return text.replace("(", "").replace(")", "")


def to_number(text: str) -> float | None:
  """The first number in `text` as a float (commas, fractions ok), or None."""
  match = _NUMBER.search(_clean(text))
  if match is None:
    return None
  token = match.group().replace(",", "")
  try:
    if "/" in token:
      num, den = token.split("/")
      return float(num) / float(den) if float(den) else None
    return float(token)
  except ValueError:
    return None


def extract_answer(text: str) -> float | None:
  """The final answer of a completion: after the last '####', else boxed."""
  if "####" in text:
    return to_number(text.rsplit("####", 1)[1])
  boxed = last_boxed(text)
  return None if boxed is None else to_number(boxed)


def reference_answer(answer) -> float:
  """The numeric reference from a GSM8K answer field (solution or number)."""
  if isinstance(answer, (int, float)) and not isinstance(answer, bool):
    return float(answer)
  text = str(answer)
  value = extract_answer(text) if ("####" in text or "\\boxed" in text) else (
      to_number(text))
  if value is None:
    raise DataError(f"reference answer {text!r} has no number")
  return value


def same_number(a: float, b: float) -> bool:
  return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


@registry.register("reward", "gsm8k", answer=extract_answer)
def gsm8k_correct(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[Mapping],
) -> list[float]:
  """1.0 where the completion's final answer equals the reference number.

  Args:
    prompts: prompt texts (unused).
    completions: decoded responses.
    metadata: per-sample dicts with "answer" (GSM8K solution or number).

  Returns:
    One float per sample.
  """
  del prompts
  return _matches(completions, metadata, extract_answer)


def _matches(completions, metadata, answer_of) -> list[float]:
  """1.0 where `answer_of(completion)` equals metadata["answer"]'s number."""
  out = []
  for c, m in zip(completions, metadata):
    pred = answer_of(c)
    out.append(float(pred is not None
                     and same_number(pred, reference_answer(m["answer"]))))
  return out


@registry.register("reward", "gsm8k_format")
def gsm8k_format(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[Mapping],
) -> list[float]:
  """1.0 where the completion states a numeric final answer in a known form.

  The form is "#### <number>" or "\\boxed{<number>}", whatever the value.

  Args:
    prompts: prompt texts (unused).
    completions: decoded responses.
    metadata: unused.

  Returns:
    One float per sample.
  """
  del prompts, metadata
  return [float(extract_answer(c) is not None) for c in completions]


def last_number(text: str) -> float | None:
  """The last number in `text` as a float (commas, fractions ok), or None."""
  matches = _NUMBER.findall(_clean(text))
  return None if not matches else to_number(matches[-1])


_BARE_NUMBER = re.compile(r"\s*-?\d[\d,]*(?:\.\d+)?\.?\s*")


@registry.register("reward", "last_number")
def last_number_correct(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[Mapping],
) -> list[float]:
  """1.0 where the completion's last number equals the reference number
  (lenient: "45 + 9 = 54." and "The answer is 54" both count).

  Args:
    prompts: prompt texts (unused).
    completions: decoded responses.
    metadata: per-sample dicts with "answer" (a number or a GSM8K solution).

  Returns:
    One float per sample.
  """
  del prompts
  return _matches(completions, metadata, last_number)


@registry.register("reward", "number_only")
def number_only(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[Mapping],
) -> list[float]:
  """1.0 where the completion is a bare number ("54", " 54.\n"), whatever
  its value: the strict answer format of "answer with only the number".

  Args:
    prompts: prompt texts (unused).
    completions: decoded responses.
    metadata: unused.

  Returns:
    One float per sample.
  """
  del prompts, metadata
  return [float(_BARE_NUMBER.fullmatch(c) is not None) for c in completions]


_ANSWER_LINE = re.compile(r"answer:\s*-?\d[\d,]*(?:\.\d+)?\s*\.?\s*",
                          re.IGNORECASE)


@registry.register("reward", "answer_line")
def answer_line(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[Mapping],
) -> list[float]:
  """1.0 where the completion's last non-empty line is "Answer: <number>",
  whatever the number: the strict format of a step-by-step answer
  (configs/smollm2_grpo.py asks for it).

  Args:
    prompts: prompt texts (unused).
    completions: decoded responses.
    metadata: unused.

  Returns:
    One float per sample.
  """
  del prompts, metadata
  out = []
  for c in completions:
    lines = [line for line in c.splitlines() if line.strip()]
    out.append(float(bool(lines) and
                     _ANSWER_LINE.fullmatch(lines[-1].strip()) is not None))
  return out
