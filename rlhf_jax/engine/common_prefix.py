"""Finding and splitting off a token prefix common to a batch of prompts.

Two-level sharing (RLHFless's deduplicated prefill): many RL datasets put the
same system prompt or few-shot examples in front of every prompt. The engine
prefills such a prefix once (`Engine.set_common_prefix`) and each prompt row
then holds only the tokens after it. These host-side helpers detect the
prefix of a batch and validate and strip it per prompt; `Driver.run` uses
them (`common_prefix="auto"` or a declared token array).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

MIN_COMMON_LENGTH = 16  # A batch shares a common prefix this long or more.


def longest_common_prefix(prompts: Sequence[np.ndarray], *,
                          min_length: int = 1,
                          max_length: int | None = None) -> np.ndarray:
  """The longest token prefix shared by every prompt, if long enough.

  It is capped so that every prompt keeps at least one token after it (the
  last prompt token's logits draw the first sampled token) and at
  `max_length` (a prefix of a common prefix is still common).

  Args:
    prompts: 1-D token id arrays.
    min_length: shorter common prefixes are not worth a separate prefill;
      they come back empty.
    max_length: cap (e.g. the engine's `max_common_length`); None: no cap.

  Returns:
    The common prefix as an int32 array, empty if none qualifies.
  """
  prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
  if not prompts:
    return np.zeros(0, np.int32)
  n = min(p.size for p in prompts) - 1
  if max_length is not None:
    n = min(n, max_length)
  first = prompts[0]
  for p in prompts[1:]:
    if n <= 0:
      break
    differs = np.nonzero(p[:n] != first[:n])[0]
    if differs.size:
      n = int(differs[0])
  if n < max(min_length, 1):
    return np.zeros(0, np.int32)
  return first[:n].copy()


def strip_common_prefix(tokens: np.ndarray, common: np.ndarray,
                        prompt_id=None) -> np.ndarray:
  """The tokens of a prompt after `common`; raises if it does not start so.

  Args:
    tokens: the whole prompt.
    common: the common prefix (may be empty).
    prompt_id: for error messages.

  Returns:
    tokens[len(common):], at least one token.
  """
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  common = np.asarray(common, np.int32).reshape(-1)
  if not common.size:
    return tokens
  head = tokens[:common.size]
  differs = np.nonzero(head != common[:head.size])[0]
  if differs.size:
    i = int(differs[0])
    raise ValueError(
        f"prompt {prompt_id} does not start with the common prefix: token "
        f"{i} is {int(tokens[i])}, the common prefix has {int(common[i])}")
  if tokens.size <= common.size:
    raise ValueError(
        f"prompt {prompt_id} has {tokens.size} tokens, none after the common "
        f"prefix of {common.size}; at least one is needed to sample from")
  return tokens[common.size:]


def batch_common_prefix(prompts: Sequence[np.ndarray], cap: int,
                        current: np.ndarray | None = None) -> np.ndarray:
  """The prefix a rollout stores once for a batch of prompts (empty:
  none): their longest common prefix if it has `MIN_COMMON_LENGTH` tokens
  or more, capped at `cap` (the engine's `max_common_length`; 0: never).

  `current`: the prefix a run already stores for prompts in flight (async
  RL's run spans batches); the result is then what the batch shares with
  it, so every prompt of the run starts with it (a run that stores none
  keeps none).
  """
  if not cap or (current is not None and not current.size):
    return np.zeros(0, np.int32)
  common = longest_common_prefix(prompts, min_length=MIN_COMMON_LENGTH,
                                 max_length=cap)
  if current is not None:
    n = min(common.size, current.size)
    differs = np.nonzero(common[:n] != current[:n])[0]
    n = int(differs[0]) if differs.size else n
    common = current[:n] if n >= MIN_COMMON_LENGTH else np.zeros(0, np.int32)
  return common
