"""Multi-step arithmetic word problems, generated: a task for real models.

A problem is one of `TEMPLATES` (two or three operations over small
integers: buy, give away, packs of, days of, change from a bill), its
numbers drawn from `(seed, index)`, its people and things picked by the
same draw; the answer is a non-negative integer. A 135M instruct model
gets such problems right often enough for GRPO to have signal and wrong
often enough to leave room (measured on SmolLM2-135M-Instruct:
docs/results.md), and every problem needs more than one step, so a gain
is not one memorised fact.

Splits: a seeded hash of (template, numbers) marks `holdout_fraction` of
all problems as held out; training draws skip them, so the eval prompts
(the first `num_eval` held-out problems of their own stream) are never
trained on, in any wording. Every example is a pure function of its index:
a resumed run regenerates the same prompts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np

from rlhf_jax.errors import ConfigError

NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Ivy",
         "Jack", "Kate", "Leo", "Mia", "Noah", "Olivia", "Sam")
THINGS = ("apples", "pencils", "stickers", "marbles", "cookies", "cards",
          "books", "shells")
# Eval prompt ids sit above every train index (unique across splits; the
# engine derives sampling keys from prompt ids).
EVAL_ID_OFFSET = 1 << 30


@dataclasses.dataclass(frozen=True)
class Template:
  """A problem's wording, its answer, and which numbers are valid."""
  text: str  # str.format fields: name, friend, things, a, b, c
  answer: Callable[[int, int, int], int]
  valid: Callable[[int, int, int], bool]  # a sensible case


TEMPLATES = (
    Template("{name} has {a} {things}. {name} buys {b} more, then gives {c} "
             "to {friend}. How many {things} does {name} have now?",
             lambda a, b, c: a + b - c, lambda a, b, c: c <= a + b),
    Template("A pack holds {a} {things}. {name} buys {b} packs and gives {c} "
             "{things} to {friend}. How many {things} does {name} have left?",
             lambda a, b, c: a * b - c, lambda a, b, c: c < a * b),
    Template("{name} reads {a} pages on Monday, {b} more pages on Tuesday "
             "than on Monday, and {c} pages on Wednesday. How many pages does "
             "{name} read in the three days?",
             lambda a, b, c: 2 * a + b + c, lambda a, b, c: True),
    Template("{name} had {c} dollars and then earned {a} dollars a day for "
             "{b} days. How many dollars does {name} have now?",
             lambda a, b, c: c + a * b, lambda a, b, c: True),
    Template("A hall has {a} rows of {b} chairs. {c} chairs are taken away. "
             "How many chairs are left in the hall?",
             lambda a, b, c: a * b - c, lambda a, b, c: c < a * b),
    Template("{name} buys {b} {things} at {a} dollars each and a pen for {c} "
             "dollars, and pays with a 100-dollar bill. How many dollars of "
             "change does {name} get?",
             lambda a, b, c: 100 - a * b - c, lambda a, b, c: True),
)


def _mix(*xs: int) -> int:
  """A seeded 64-bit hash of integers (splitmix64 over their sequence)."""
  h = 0x9E3779B97F4A7C15
  for x in xs:
    h = (h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & (2**64 - 1)
    h ^= h >> 31
  return h


@dataclasses.dataclass(frozen=True)
class WordProblems:
  """The task's knobs (`config.task` of configs/smollm2_grpo.py)."""
  seed: int = 0
  max_a: int = 12           # a in [2, max_a]
  max_b: int = 9            # b in [2, max_b]
  max_c: int = 20           # c in [1, max_c] where a template uses it
  holdout_fraction: float = 0.1
  num_eval: int = 200
  instruction: str = ("Solve it step by step. On the last line write "
                      "'Answer: ' and the number.")

  def __post_init__(self):
    if not 0.0 < self.holdout_fraction < 1.0:
      raise ConfigError(f"task.holdout_fraction={self.holdout_fraction} must "
                        "be in (0, 1)")
    if min(self.max_a, self.max_b) < 2 or self.max_c < 1:
      raise ConfigError(f"task.max_a={self.max_a} and task.max_b="
                        f"{self.max_b} must be >= 2, task.max_c >= 1")
    if self.num_eval > len(self._heldout_keys()):
      raise ConfigError(f"task.num_eval={self.num_eval} is more than the "
                        f"{len(self._heldout_keys())} held-out problems")

  def is_heldout(self, key: tuple[int, int, int, int]) -> bool:
    return (_mix(self.seed, 7, *key) % 10_000) < self.holdout_fraction * 10_000

  @functools.cache
  def _keys(self, heldout: bool) -> tuple[tuple[tuple[int, int, int, int],
                                                ...], ...]:
    """Per template, its valid (template, a, b, c) keys of one split, in a
    fixed order. Templates are drawn uniformly and then their numbers, so a
    template with fewer valid cases is not rarer."""
    out = []
    for t, tmpl in enumerate(TEMPLATES):
      out.append(tuple(
          (t, a, b, c) for a in range(2, self.max_a + 1)
          for b in range(2, self.max_b + 1)
          for c in range(1, self.max_c + 1)
          if tmpl.valid(a, b, c) and tmpl.answer(a, b, c) >= 0
          and self.is_heldout((t, a, b, c)) == heldout))
    return tuple(out)

  def _heldout_keys(self) -> tuple[tuple[int, int, int, int], ...]:
    return tuple(k for keys in self._keys(True) for k in keys)

  def _render(self, key, index: int, prompt_id: int) -> tuple[str, dict]:
    t, a, b, c = key
    rng = np.random.default_rng(_mix(self.seed, 11, index, *key))
    name, friend = rng.choice(len(NAMES), 2, replace=False)
    text = TEMPLATES[t].text.format(
        name=NAMES[name], friend=NAMES[friend],
        things=THINGS[rng.integers(len(THINGS))], a=a, b=b, c=c)
    return (f"{text} {self.instruction}",
            {"answer": TEMPLATES[t].answer(a, b, c), "prompt_id": prompt_id,
             "template": t})

  def train_example(self, index: int) -> tuple[str, dict]:
    """The index-th training problem (never a held-out one)."""
    h = _mix(self.seed, 3, index)
    keys = self._keys(False)[h % len(TEMPLATES)]
    return self._render(keys[(h >> 8) % len(keys)], index, index)

  def train_examples(self, n: int) -> list[tuple[str, dict]]:
    return [self.train_example(i) for i in range(n)]

  def eval_examples(self) -> list[tuple[str, dict]]:
    """The first `num_eval` held-out problems: the templates in turn, each
    template's problems in a seeded order."""
    rng = np.random.default_rng(_mix(self.seed, 5))
    queues = [list(np.asarray(keys, dtype=object)[rng.permutation(len(keys))])
              for keys in self._keys(True)]
    picked = []
    while len(picked) < self.num_eval:
      for queue in queues:
        if queue and len(picked) < self.num_eval:
          picked.append(tuple(int(x) for x in queue.pop()))
    return [self._render(key, i, EVAL_ID_OFFSET + i)
            for i, key in enumerate(picked)]
