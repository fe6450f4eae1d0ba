"""A tiny code task: write a Python expression over a list from a short spec.

A prompt names a reduction, a map and a filter, "sum v*3 pos:", and the
answer is the expression "sum(v*3 for v in x if v>0)"; the `code` reward
(`rewards/code.py`) runs it as `f = lambda x: <answer>` in the sandbox
against `num_tests` calls on seeded lists and their expected values:

  reductions  list: [E for v in x C]      sum: sum(E for v in x C)
  maps        v+k, v-k, v*k for k = 1..9
  filters     all: (none)  pos: if v>0  neg: if v<0  big: if v>4
              small: if v<-4
(the character tokenizer's symbols: no "%").

2 x 27 x 5 = 270 specs. A seeded hash holds out `holdout_fraction` of them:
held-out specs are evaluation prompts only, so what RL must learn is to
compose pieces it saw in other combinations. Every example is a pure
function of its index (a resumed run regenerates the same prompts); the
tests of a train example are drawn from its index, an eval prompt's from
its spec.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from rlhf_jax.data.tasks import EVAL_ID_OFFSET, _splitmix64
from rlhf_jax.errors import ConfigError

REDUCTIONS = {"list": "[{e} for v in x{c}]", "sum": "sum({e} for v in x{c})"}
OPS = {"+": lambda v, k: v + k, "-": lambda v, k: v - k,
       "*": lambda v, k: v * k}
FILTERS = {"all": ("", lambda v: True), "pos": (" if v>0", lambda v: v > 0),
           "neg": (" if v<0", lambda v: v < 0),
           "big": (" if v>4", lambda v: v > 4),
           "small": (" if v<-4", lambda v: v < -4)}
TEMPLATE = "f = lambda x: {program}"
_STREAM_TRAIN, _STREAM_SFT, _STREAM_EVAL = 11, 12, 13


@dataclasses.dataclass(frozen=True)
class Spec:
  reduction: str
  op: str
  k: int
  filt: str

  @property
  def prompt(self) -> str:
    return f"{self.reduction} v{self.op}{self.k} {self.filt}:"

  @property
  def program(self) -> str:
    return REDUCTIONS[self.reduction].format(
        e=f"v{self.op}{self.k}", c=FILTERS[self.filt][0])

  def __call__(self, x: list[int]):
    """The reference: what the program returns on `x`."""
    values = [OPS[self.op](v, self.k) for v in x if FILTERS[self.filt][1](v)]
    return values if self.reduction == "list" else sum(values)


SPECS = tuple(Spec(r, o, k, f) for r, o, k, f in itertools.product(
    REDUCTIONS, OPS, range(1, 10), FILTERS))


@dataclasses.dataclass(frozen=True)
class CodeExample:
  """One code problem (the fields `data/batching.py` reads)."""
  prompt_id: int
  prompt: str
  answer: str              # The reference program (SFT's target).
  tests: tuple             # ((expression, expected literal), ...)
  split: str
  tool_demo: bool = False

  def metadata(self) -> dict:
    return {"prompt_id": self.prompt_id, "answer": self.answer,
            "tests": [list(t) for t in self.tests],
            "program_template": TEMPLATE, "split": self.split}


@dataclasses.dataclass(frozen=True)
class CodeTask:
  """The task's knobs (`config.task` of configs/tiny_code.py)."""
  seed: int = 0
  holdout_fraction: float = 0.15
  num_tests: int = 4
  max_list_len: int = 5
  tool_demo_fraction: float = 0.0  # (No tool demos: `data/batching.py`.)

  def __post_init__(self):
    if not 0.0 < self.holdout_fraction <= 0.5:
      raise ConfigError(f"config.task.holdout_fraction="
                        f"{self.holdout_fraction} must be in (0, 0.5]")
    if self.num_tests < 1 or self.max_list_len < 1:
      raise ConfigError("config.task.num_tests and max_list_len must be >= 1")
    if not self.heldout_specs:
      raise ConfigError("config.task.holdout_fraction holds out no spec")

  @property
  def max_prompt_len(self) -> int:
    return 1 + max(len(s.prompt) for s in SPECS)  # <bos> + the spec.

  @property
  def max_response_len(self) -> int:
    return max(len(s.program) for s in SPECS) + 1  # + <eos>.

  @property
  def num_eval(self) -> int:
    return len(self.heldout_specs)

  def is_heldout(self, spec: Spec) -> bool:
    h = _splitmix64(self.seed ^ _splitmix64(SPECS.index(spec) + 1))
    return h < self.holdout_fraction * 2.0**64

  @functools.cached_property
  def heldout_specs(self) -> tuple[Spec, ...]:
    return tuple(s for s in SPECS if self.is_heldout(s))

  @functools.cached_property
  def _train_specs(self) -> tuple[Spec, ...]:
    return tuple(s for s in SPECS if not self.is_heldout(s))

  def _tests(self, spec: Spec, rng: np.random.Generator) -> tuple:
    tests = []
    for _ in range(self.num_tests):
      x = [int(v) for v in rng.integers(-9, 10, rng.integers(
          1, self.max_list_len + 1))]
      tests.append((f"f({x})", repr(spec(x))))
    return tuple(tests)

  def _example(self, stream: int, index: int, split: str) -> CodeExample:
    rng = np.random.default_rng([self.seed, stream, index])
    spec = self._train_specs[int(rng.integers(len(self._train_specs)))]
    return CodeExample(index, spec.prompt, spec.program,
                       self._tests(spec, rng), split)

  def train_example(self, index: int) -> CodeExample:
    """RL prompt number `index` (its prompt id)."""
    return self._example(_STREAM_TRAIN, index, "train")

  def sft_example(self, index: int) -> CodeExample:
    """SFT example number `index` (a stream of its own)."""
    return self._example(_STREAM_SFT, index, "sft")

  def eval_examples(self) -> list[CodeExample]:
    """Every held-out spec once, ids EVAL_ID_OFFSET + j."""
    out = []
    for j, spec in enumerate(self.heldout_specs):
      rng = np.random.default_rng([self.seed, _STREAM_EVAL, j])
      out.append(CodeExample(EVAL_ID_OFFSET + j, spec.prompt, spec.program,
                             self._tests(spec, rng), "eval"))
    return out
