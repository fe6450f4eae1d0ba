"""Built-in verifiable task: multi-digit addition (or multiplication).

A prompt is "a+b=" and the solution is the digits of a + b followed by <eos>.
With `operator="*"` it is "a*b=" and a * b: the tool task
(configs/tiny_tool.py), which the tiny model cannot learn alone but can
with a calculator call; `tool_demo_fraction` of the SFT examples then
demonstrate the call (`data/batching.sft_batch`).
Operands have between `min_digits` and `max_digits` digits (the digit count is
drawn uniformly first, so short numbers are not rare).

Decision: the answer is written least-significant digit first by default
(`reverse_answer=True`; "12+345=" -> "753"). A causal model emits digits left
to right and the carry flows from the low digits to the high ones, so in the
reversed order each digit needs only the operand digits at its position and
the carry it has already written; in the usual order the first digit depends
on carries still to come. Measured (one seed; 2-layer, d=64 decoder, SFT with
batch 64, AdamW 1e-3; greedy accuracy on 200 held-out prompts):
  max_digits=2, reversed: 0.13 / 0.63 / 0.91 / 0.98 at 400/600/800/1200 steps
  max_digits=2, usual:    0.30 / 0.60 / 0.76 / 0.86 (0.955 at 3000 steps)
  max_digits=3, reversed: 0.06 / 0.05 / 0.32 / 0.59 at 800/1200/1600/2000
  max_digits=3, usual:    0.13 / 0.46 / 0.70 / 0.73
With 2 digits the reversed task reaches ~100% while the usual order plateaus
lower, so a limited SFT budget (~400-600 steps) leaves a partly right policy
(non-zero GRPO reward) with a high ceiling for RL to climb towards. With 3
digits the variable operand lengths make the digit alignment the hard part
and the usual order learned faster in this probe; the default is therefore
max_digits=2 with reversed answers.

Determinism and splits: every example is a pure function of (seed, stream,
index), so any position of any stream can be regenerated without replaying
the ones before it (that is what makes the iterator state a single int).
A seeded hash of the unordered operand pair marks `holdout_fraction` of all
distinct problems as held out, the same fraction of every digit-count stratum
(a held-out set drawn directly from the stratified distribution would eat
most of the 55 one-digit problems). Train and SFT streams redraw held-out
pairs (in either order); the eval split is the first `num_eval` distinct
held-out pairs of its own stream, so it follows the train distribution and
the held-out accuracy measures generalisation, not memorisation.
"""

import dataclasses
import functools

import numpy as np

from rlhf_jax.errors import ConfigError

# Eval prompt ids live above every train index, so ids are unique across
# splits (the engine derives sampling keys from prompt ids) and fit in int32.
EVAL_ID_OFFSET = 1 << 30

_STREAM_EVAL = 0
_STREAM_TRAIN = 1
_STREAM_SFT = 2
_MASK64 = (1 << 64) - 1
OPERATORS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}


def _splitmix64(x: int) -> int:
  """One round of splitmix64: a fast, well-mixed 64-bit integer hash."""
  x = (x + 0x9E3779B97F4A7C15) & _MASK64
  x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
  x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
  return x ^ (x >> 31)


@dataclasses.dataclass(frozen=True)
class Example:
  """One addition problem."""

  prompt_id: int
  a: int
  b: int
  prompt: str  # "a+b="
  answer: str  # digits of a + b, reversed if the task reverses answers
  reverse_answer: bool
  split: str  # "train", "sft" or "eval"
  answer_width: int = 0  # zero-padded width of the answer (0: no padding)
  operator: str = "+"
  tool_demo: bool = False  # SFT: the solution calls the calculator.

  def metadata(self) -> dict:
    """Per-sample metadata handed to reward functions."""
    return {
        "prompt_id": self.prompt_id,
        "answer": self.answer,
        "a": self.a,
        "b": self.b,
        "reverse_answer": self.reverse_answer,
        "answer_width": self.answer_width,
        "split": self.split,
        "operator": self.operator,
    }


def format_answer(total: int, reverse_answer: bool, width: int = 0) -> str:
  """Writes a sum the way the task expects it.

  Args:
    total: the sum.
    reverse_answer: least-significant digit first.
    width: zero-pad to this many digits (0: no padding).

  Returns:
    The answer string (no <eos>).
  """
  digits = str(total).zfill(width)
  return digits[::-1] if reverse_answer else digits


@dataclasses.dataclass(frozen=True)
class AdditionTask:
  """Addition prompts with a disjoint held-out split, deterministic in seed.

  Attributes:
    max_digits: most digits per operand (2-3 suits a 2-4 layer model).
    min_digits: fewest digits per operand.
    reverse_answer: write the sum least-significant digit first.
    zero_pad: write operands with max_digits digits and the answer with
      max_digits + 1, so digit i of every number sits at a fixed position.
    num_eval: number of distinct held-out problems in the eval split.
    holdout_fraction: fraction of all distinct problems never trained on.
    seed: determines every stream and the held-out set.
  """

  max_digits: int = 2
  min_digits: int = 1
  reverse_answer: bool = True
  zero_pad: bool = False  # Fixed-width operands and answer ("007+042=").
  num_eval: int = 200
  holdout_fraction: float = 0.1
  seed: int = 0
  operator: str = "+"            # "+" or "*".
  tool_demo_fraction: float = 0.0  # SFT examples that call the calculator.

  def __post_init__(self):
    if self.operator not in OPERATORS:
      raise ConfigError(f"config.task.operator={self.operator!r} must be one "
                        f"of {sorted(OPERATORS)}")
    if not 0.0 <= self.tool_demo_fraction <= 1.0:
      raise ConfigError("config.task.tool_demo_fraction="
                        f"{self.tool_demo_fraction} must be in [0, 1]")
    if not 1 <= self.min_digits <= self.max_digits:
      raise ConfigError(
          f"Need 1 <= min_digits <= max_digits, got min_digits="
          f"{self.min_digits}, max_digits={self.max_digits}."
      )
    lo = 0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)
    n = 10**self.max_digits - lo
    unordered_pairs = n * (n + 1) // 2
    if not 0.0 < self.holdout_fraction <= 0.5:
      raise ConfigError(
          "holdout_fraction must be in (0, 0.5], got "
          f"{self.holdout_fraction}."
      )
    # Leave the eval draw plenty of held-out problems to pick from.
    limit = int(self.holdout_fraction * unordered_pairs) // 2
    if not 1 <= self.num_eval <= limit:
      raise ConfigError(
          f"num_eval={self.num_eval} must be in [1, {limit}] for "
          f"{self.min_digits}-{self.max_digits} digit operands "
          f"({unordered_pairs} distinct problems, holdout_fraction "
          f"{self.holdout_fraction})."
      )

  @property
  def max_prompt_len(self) -> int:
    """Prompt tokens including <bos>: bos, a, '+', b, '='."""
    return 1 + 2 * self.max_digits + 2

  @property
  def max_response_len(self) -> int:
    """Response tokens including <eos>: the answer's digits, + 1."""
    return self.answer_digits + 1

  @property
  def answer_digits(self) -> int:
    """Most digits an answer has (a sum: one more; a product: twice)."""
    return (2 if self.operator == "*" else 1) * self.max_digits + (
        self.operator == "+")

  def _draw_operand(self, rng: np.random.Generator) -> int:
    """Uniform digit count, then a uniform number with that many digits."""
    ndig = int(rng.integers(self.min_digits, self.max_digits + 1))
    lo = 0 if ndig == 1 else 10 ** (ndig - 1)
    return int(rng.integers(lo, 10**ndig))

  @functools.cached_property
  def _eval_pairs(self) -> tuple[tuple[int, int], ...]:
    """The eval (a, b) pairs, in draw order, distinct as unordered."""
    rng = np.random.default_rng([self.seed, _STREAM_EVAL])
    pairs, seen = [], set()
    # Bounded so an unlucky hash can only cost an error, never a hang.
    for _ in range(10_000 * self.num_eval):
      if len(pairs) == self.num_eval:
        return tuple(pairs)
      a, b = self._draw_operand(rng), self._draw_operand(rng)
      key = (min(a, b), max(a, b))
      if key not in seen and self.is_heldout_pair(a, b):
        seen.add(key)
        pairs.append((a, b))
    raise ConfigError(
        f"Found only {len(pairs)} of num_eval={self.num_eval} distinct "
        "held-out problems; lower num_eval or raise holdout_fraction."
    )

  def is_heldout_pair(self, a: int, b: int) -> bool:
    """Whether a+b (and b+a) is held out: never in the train or SFT streams.

    Args:
      a: first operand.
      b: second operand.

    Returns:
      True for a seeded-hash-chosen `holdout_fraction` of unordered pairs.
    """
    lo, hi = min(a, b), max(a, b)
    h = _splitmix64(_splitmix64(_splitmix64(self.seed) ^ lo) ^ hi)
    return h < self.holdout_fraction * 2.0**64

  def _example(self, a: int, b: int, prompt_id: int, split: str) -> Example:
    """Builds the Example for operands (a, b)."""
    w = self.max_digits if self.zero_pad else 0
    answer_width = self.answer_digits if self.zero_pad else 0
    op = self.operator
    demo = split == "sft" and self.tool_demo_fraction > 0 and (
        _splitmix64(_splitmix64(self.seed ^ 0x70) ^ prompt_id)
        < self.tool_demo_fraction * 2.0**64)
    return Example(
        prompt_id=prompt_id,
        a=a,
        b=b,
        prompt=f"{a:0{w}d}{op}{b:0{w}d}=" if w else f"{a}{op}{b}=",
        answer=format_answer(OPERATORS[op](a, b), self.reverse_answer,
                             answer_width),
        reverse_answer=self.reverse_answer,
        split=split,
        answer_width=answer_width,
        operator=op,
        tool_demo=demo,
    )

  def _stream_example(self, stream: int, index: int, split: str) -> Example:
    """Example `index` of a train-side stream, skipping eval pairs."""
    if not 0 <= index < EVAL_ID_OFFSET:
      raise ValueError(
          f"Example index must be in [0, {EVAL_ID_OFFSET}), got {index}."
      )
    rng = np.random.default_rng([self.seed, stream, index])
    while True:
      a, b = self._draw_operand(rng), self._draw_operand(rng)
      if not self.is_heldout_pair(a, b):
        return self._example(a, b, index, split)

  def train_example(self, index: int) -> Example:
    """RL prompt number `index` (its prompt id is `index`).

    Args:
      index: position in the train stream, in [0, EVAL_ID_OFFSET).

    Returns:
      The Example; never an eval problem.
    """
    return self._stream_example(_STREAM_TRAIN, index, "train")

  def sft_example(self, index: int) -> Example:
    """SFT (teacher-forcing) example number `index`.

    A separate stream from the RL prompts, so the SFT budget is counted in
    examples of its own and the RL prompt order does not depend on it.

    Args:
      index: position in the SFT stream, in [0, EVAL_ID_OFFSET).

    Returns:
      The Example; never an eval problem.
    """
    return self._stream_example(_STREAM_SFT, index, "sft")

  def eval_examples(self) -> list[Example]:
    """The held-out problems, ids EVAL_ID_OFFSET + j, in a fixed order.

    Returns:
      `num_eval` Examples.
    """
    return [
        self._example(a, b, EVAL_ID_OFFSET + j, "eval")
        for j, (a, b) in enumerate(self._eval_pairs)
    ]
