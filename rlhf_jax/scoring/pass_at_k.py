"""pass@k and maj@k of n sampled responses per held-out prompt.

pass@k: the chance that at least one of k responses drawn without
replacement from a prompt's n is correct, estimated without bias from its
c correct ones (Chen et al. 2021, HumanEval):

  pass@k = 1 - C(n - c, k) / C(n, k),

averaged over the prompts. It uses all n responses for every k, so pass@1
is the mean accuracy of the samples, not of one of them.

maj@k: the answer most of a prompt's first k responses give (the reward's
answer extraction, `answer_of`) is voted in, and the prompt counts as
solved when a response with that answer is correct. Responses with no
answer do not vote; a prompt where none has one is unsolved. A tie goes
to the answer that came first among the k (a stated rule, so one run's
maj@k is reproducible).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased pass@k of one prompt: `c` of `n` responses correct."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, "
                     f"c={c}, k={k}")
  if n - c < k:  # Every draw of k holds a correct one.
    return 1.0
  # C(n - c, k) / C(n, k) as a product: no huge binomials.
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_correct(answers: Sequence[Hashable | None],
                     correct: Sequence[bool]) -> bool:
  """Whether the majority answer of `answers` (None: no answer, no vote;
  ties: the answer seen first) is a correct one."""
  votes: dict[Hashable, int] = {}
  first_correct: dict[Hashable, bool] = {}
  for answer, ok in zip(answers, correct):
    if answer is None:
      continue
    votes[answer] = votes.get(answer, 0) + 1
    first_correct.setdefault(answer, bool(ok))
  if not votes:
    return False
  # max keeps the first of equal counts: dicts keep insertion order.
  winner = max(votes, key=votes.get)
  return first_correct[winner]


def ks_up_to(n: int) -> list[int]:
  """The k reported for n responses a prompt: 1, 2, 4, ... below n, and n."""
  ks = [1 << i for i in range(n.bit_length()) if 1 << i < n]
  return ks + [n]


def metrics(correct_NxS: np.ndarray,
            answers_NxS: Sequence[Sequence[Hashable | None]]) -> dict:
  """{"eval/pass_at_<k>", "eval/maj_at_<k>"} for each k of `ks_up_to(S)`,
  means over the N prompts; `correct_NxS` [N, S] bool, `answers_NxS` each
  response's extracted answer."""
  correct_NxS = np.asarray(correct_NxS, bool)
  n_prompts, n = correct_NxS.shape
  out = {}
  for k in ks_up_to(n):
    out[f"eval/pass_at_{k}"] = float(np.mean([
        pass_at_k(n, int(c), k) for c in correct_NxS.sum(axis=1)]))
    out[f"eval/maj_at_{k}"] = float(np.mean([
        majority_correct(answers_NxS[p][:k], correct_NxS[p, :k])
        for p in range(n_prompts)]))
  return out
