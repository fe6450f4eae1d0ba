"""Sums of small integers, generated: a task for small real models.

A problem is one integer from each of `ranges`, asked as "What is 45+9?
Answer with only the number." (the `prompt` format) in the model's chat
template; the answer is their sum. The default, a in [1, 99] and b in
[1, 9], needs a carry in half the cases: the ones digits, then the tens
plus the carry. SmolLM2-135M-Instruct adds one-digit numbers right most of
the time but a two-digit and a one-digit number rarely ("45+9 is 45+9 =
13"), so GRPO has signal and room, and what it learns is arithmetic (the
eval also counts the strict "only the number" format apart; measured:
docs/results.md, "Real model").

Splits are by operand multiset: a seeded hash marks `holdout_fraction` of
the multisets {a, b} as held out, and every ordering of a held-out multiset
is an eval problem only, so no eval sum is trained on in any order. Every
example is a pure function of its index: a resumed run regenerates the
same prompts. Metadata: "answer", "prompt_id", and "carries" (how many
digit columns carry), so an eval can report by difficulty.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os

import numpy as np

from rlhf_jax.errors import ConfigError
from rlhf_jax.models import tiny_checkpoint

# Eval prompt ids sit above every train index (unique across splits; the
# engine derives sampling keys from prompt ids).
EVAL_ID_OFFSET = 1 << 30


def _mix(*xs: int) -> int:
  """A seeded 64-bit hash of integers (splitmix64-style over a sequence)."""
  h = 0x9E3779B97F4A7C15
  for x in xs:
    h = (h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & (2**64 - 1)
    h ^= h >> 31
  return h


def carries(operands) -> int:
  """How many digit columns of the written-out sum carry into the next."""
  count, carry, column = 0, 0, 0
  while any(x // 10**column for x in operands) or carry:
    carry = (sum(x // 10**column % 10 for x in operands) + carry) // 10
    count += carry > 0
    column += 1
  return count


@dataclasses.dataclass(frozen=True)
class Sums:
  """The task's knobs (`config.task` of configs/smollm2_grpo.py)."""
  seed: int = 0
  ranges: tuple = ((1, 99), (1, 9))  # [low, high] of each term, in order.
  holdout_fraction: float = 0.4  # Of the operand multisets.
  num_eval: int = 200
  prompt: str = "What is {expression}? Answer with only the number."

  def __post_init__(self):
    if not 0.0 < self.holdout_fraction < 1.0:
      raise ConfigError(f"task.holdout_fraction={self.holdout_fraction} must "
                        "be in (0, 1)")
    if len(self.ranges) < 2 or not all(
        len(r) == 2 and 0 <= r[0] <= r[1] for r in self.ranges):
      raise ConfigError(f"task.ranges={self.ranges!r}: need two or more "
                        "(low, high) pairs with 0 <= low <= high")
    if "{expression}" not in self.prompt:
      raise ConfigError(f"task.prompt={self.prompt!r} has no {{expression}}")
    held, train = len(self._operands(True)), len(self._operands(False))
    if not train or self.num_eval > held:
      raise ConfigError(
          f"task.num_eval={self.num_eval}: the split has {held} held-out and "
          f"{train} training problems; need num_eval <= held-out and some "
          "training problems (change holdout_fraction, terms or the range)")

  def is_heldout(self, operands: tuple[int, ...]) -> bool:
    multiset = sorted(operands)
    return _mix(self.seed, 7, *multiset) % 10_000 < (
        self.holdout_fraction * 10_000)

  @functools.cache
  def _operands(self, heldout: bool) -> tuple[tuple[int, ...], ...]:
    """Every ordered operand tuple of one split, in a fixed order."""
    values = [range(low, high + 1) for low, high in self.ranges]
    return tuple(ops for ops in itertools.product(*values)
                 if self.is_heldout(ops) == heldout)

  def _render(self, operands: tuple[int, ...], prompt_id: int
              ) -> tuple[str, dict]:
    expression = "+".join(str(x) for x in operands)
    return (self.prompt.format(expression=expression),
            {"answer": sum(operands), "prompt_id": prompt_id,
             "carries": carries(operands)})

  def train_example(self, index: int) -> tuple[str, dict]:
    """The index-th training problem (never a held-out multiset)."""
    pool = self._operands(False)
    return self._render(pool[_mix(self.seed, 3, index) % len(pool)], index)

  def train_examples(self, n: int) -> list[tuple[str, dict]]:
    return [self.train_example(i) for i in range(n)]

  def eval_examples(self) -> list[tuple[str, dict]]:
    """The first `num_eval` held-out problems in a seeded order."""
    pool = self._operands(True)
    order = np.random.default_rng(_mix(self.seed, 5)).permutation(len(pool))
    return [self._render(pool[j], EVAL_ID_OFFSET + i)
            for i, j in enumerate(order[:self.num_eval])]


def build_tiny_model(path: str, task: Sums, *, seed: int = 0) -> str:
  """`runlocal`: writes (once) a tiny random checkpoint whose tokenizer is
  trained on the task's prompts and answers; returns its directory.

  The run then goes through the same data, engine, reward, checkpoint and
  eval path as the real model, in seconds (configs/smollm2_grpo.py).
  """
  model_dir = os.path.join(path, "model")
  marker = os.path.join(path, "ASSETS_OK")
  if os.path.exists(marker):
    return model_dir
  corpus = [f"{prompt} {meta['answer']}"
            for prompt, meta in task.train_examples(512) + task.eval_examples()]
  tiny_checkpoint.write(model_dir, corpus, seed=seed)
  with open(marker, "w", encoding="utf-8") as f:
    f.write("ok\n")
  return model_dir
