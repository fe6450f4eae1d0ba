"""Built-in verifiable reward functions, registered under category "reward".

Every reward function has the signature

  fn(prompts, completions, metadata) -> list[float]

over a batch: `prompts[i]` is the prompt text, `completions[i]` the decoded
response (text before the first <eos>), `metadata[i]` the task's metadata
dict (for the addition task: "prompt_id", "answer", "a", "b",
"reverse_answer", "split"). Functions are plain Python on the host; missing
metadata keys raise (`scoring.score` turns that into an error naming the
prompt id and the function, or a counted 0).

A correctness reward may name its answer extraction, `answer=fn` (text ->
a hashable answer or None), which maj@k votes with
(`scoring/pass_at_k.py`); without one the whole completion is the answer.
"""

import re
from typing import Mapping, Sequence

from rlhf_jax.data.tasks import OPERATORS, format_answer
from rlhf_jax.envs.tools import TaggedFormat
from rlhf_jax.rl import registry

_ADDITION_PROMPT = re.compile(r"(\d+)\+(\d+)=")
_DIGITS = re.compile(r"\d+")


@registry.register("reward", "exact_match")
def exact_match(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[Mapping],
) -> list[float]:
  """1.0 where the completion equals metadata["answer"] exactly, else 0.0.

  Args:
    prompts: prompt texts (unused).
    completions: decoded responses.
    metadata: per-sample dicts with "answer".

  Returns:
    One float per sample.
  """
  del prompts
  return [
      float(c == str(m["answer"])) for c, m in zip(completions, metadata)
  ]


@registry.register("reward", "addition")
def addition_correct(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[Mapping],
) -> list[float]:
  """1.0 where the completion is the sum asked by an "a+b=" prompt.

  Recomputes the sum from the prompt text rather than trusting a stored
  answer, so it also catches a task whose answers are wrong. The digit order
  follows metadata["reverse_answer"].

  Args:
    prompts: "a+b=" prompt texts.
    completions: decoded responses.
    metadata: per-sample dicts with "reverse_answer".

  Returns:
    One float per sample.

  Raises:
    ValueError: a prompt that is not an addition prompt.
  """
  out = []
  for p, c, m in zip(prompts, completions, metadata):
    match = _ADDITION_PROMPT.fullmatch(p)
    if match is None:
      raise ValueError(f"Not an addition prompt: {p!r}.")
    total = int(match[1]) + int(match[2])
    out.append(float(c == format_answer(total, m["reverse_answer"],
                                        m.get("answer_width", 0))))
  return out


@registry.register("reward", "digits_format")
def digits_format(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[Mapping],
) -> list[float]:
  """1.0 where the completion is only digits, no longer than the answer can be.

  The bound is len(metadata["answer"]) + 1, so rambling past the answer
  (including not stopping at <eos> until the length cap) scores 0.

  Args:
    prompts: prompt texts (unused).
    completions: decoded responses.
    metadata: per-sample dicts with "answer".

  Returns:
    One float per sample.
  """
  del prompts
  return [
      float(
          _DIGITS.fullmatch(c) is not None and len(c) <= len(m["answer"]) + 1
      )
      for c, m in zip(completions, metadata)
  ]


@registry.register("reward", "digit_accuracy")
def digit_accuracy(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[Mapping],
) -> list[float]:
  """Fraction of answer positions the completion gets right (partial credit).

  Position-wise comparison over max(len(completion), len(answer)) positions,
  so missing or extra characters count as wrong. A denser signal than
  exact_match when few samples of a group are fully right.

  Args:
    prompts: prompt texts (unused).
    completions: decoded responses.
    metadata: per-sample dicts with "answer".

  Returns:
    One float in [0, 1] per sample.
  """
  del prompts
  out = []
  for c, m in zip(completions, metadata):
    answer = str(m["answer"])
    hits = sum(x == y for x, y in zip(c, answer))
    out.append(hits / max(len(c), len(answer), 1))
  return out


_ARITHMETIC_PROMPT = re.compile(r"(\d+)([+*])(\d+)=")


def _final_answer(completion: str) -> str | None:
  """The answer after the last tool call (the tagged format)."""
  return TaggedFormat().final(completion) or None


@registry.register("reward", "arithmetic", answer=_final_answer)
def arithmetic_correct(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[Mapping],
) -> list[float]:
  """1.0 where the answer after the last tool call is the result asked by
  an "a+b=" or "a*b=" prompt (the tagged tool format of `envs/tools.py`;
  a completion without calls is all answer). Recomputed from the prompt.

  Args:
    prompts: "a+b=" / "a*b=" prompt texts.
    completions: decoded responses (tool calls and replies included).
    metadata: per-sample dicts with "reverse_answer".

  Returns:
    One float per sample.

  Raises:
    ValueError: a prompt that is neither.
  """
  final = TaggedFormat().final
  out = []
  for p, c, m in zip(prompts, completions, metadata):
    match = _ARITHMETIC_PROMPT.fullmatch(p)
    if match is None:
      raise ValueError(f"Not an arithmetic prompt: {p!r}.")
    value = OPERATORS[match[2]](int(match[1]), int(match[3]))
    out.append(float(final(c) == format_answer(
        value, m["reverse_answer"], m.get("answer_width", 0))))
  return out


@registry.register("reward", "env")
def env_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[Mapping],
) -> list[float]:
  """The environment's rewards of a multi-turn sample (`envs/environment.py`),
  summed over its turns; 0 for single-turn samples."""
  del prompts, completions
  return [float(m.get("env_reward", 0.0)) for m in metadata]


@registry.register("reward", "even_tokens")
def even_tokens(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[Mapping],
) -> list[float]:
  """Fraction of a response's ids that are even, for the "random_tokens"
  data, whose text is the ids (`data/random_tokens.py`); 0 when empty."""
  del prompts, metadata
  out = []
  for text in completions:
    ids = [int(t) for t in text.split()]
    out.append(sum(i % 2 == 0 for i in ids) / len(ids) if ids else 0.0)
  return out
