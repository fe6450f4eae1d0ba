"""Preference pairs for reward-model training: local JSONL or synthetic.

A pair is a prompt with a preferred ("chosen") and a dispreferred
("rejected") response. Sources:

- JSONL: one {"prompt", "chosen", "rejected"} object per line (an optional
  "margin" number is kept). Held-out pairs come from a second file, or from
  a seeded `holdout_fraction` of the first.
- Synthetic addition (the built-in default): prompts of `tasks.AdditionTask`
  ("12+34="), chosen = the correct sum, rejected = a wrong sum, both in the
  task's answer format (reversed digits by default), so a reward model
  trained here scores exactly what a policy trained on that task emits.
  Train pairs come from the task's train stream and eval pairs from its
  disjoint held-out problems, so eval measures generalisation. The wrong sum
  is the right one plus a nonzero offset in [-max_offset, max_offset] (0 =
  any other number in the range of sums): small offsets need the units
  digit, large ones only the magnitude. A `near_miss` fraction of pairs
  instead gets a wrong sum one digit away from the right one, the policy's
  typical mistake: without them a reward model cannot tell a near miss from
  the answer, and PPO learns to produce near misses.

Texts are encoded as <bos> prompt response <eos> with the char tokenizer and
right-padded to `seq_len`; the score is read at <eos>.

Dimension letters: P pairs, T = seq_len.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from rlhf_jax.data import jsonl
from rlhf_jax.data.tasks import AdditionTask, format_answer
from rlhf_jax.data.tokenizer import CharTokenizer
from rlhf_jax.errors import DataError, MissingFieldError
from rlhf_jax.typed_config import fail, from_partial, in_range, one_of


@dataclasses.dataclass(frozen=True)
class PreferenceData:
  """`config.data` of the reward-model job: "addition" (pairs made from
  the addition task of `config.task`: the right sum against a wrong one)
  or "jsonl" (a local file of {"prompt", "chosen", "rejected"} lines)."""
  PATH: ClassVar[str] = "data"
  kind: str = "addition"
  max_offset: int = 0       # addition: wrong sum; 0 = any other sum.
  near_miss: float = 0.0    # addition: fraction of wrong sums one digit off.
  train_path: str = ""      # jsonl.
  eval_path: str = ""       # jsonl: held-out file; "" = split train.
  holdout_fraction: float = 0.1
  seq_len: int = 16         # <bos> prompt response <eos>, right-padded.

  def __post_init__(self):
    one_of(self, "kind", ("addition", "jsonl"))
    in_range(self, "near_miss", 0.0, 1.0)
    if self.kind == "jsonl" and not self.train_path:
      fail(self, "train_path", "is empty: config.data.kind='jsonl' reads "
           "its pairs from it")


# Kinds a reward-model workdir saved by an older version names otherwise.
_SAVED_KINDS = {"synthetic": "addition"}  # Renamed 2026-11-30.


def sections_of(config, *, saved: bool = False
                ) -> tuple[PreferenceData, Any]:
  """(data, task) of a reward-model config: the task (AdditionTask) for
  kind "addition", else None. `saved`: the config.json of a trained
  reward model, which may use an older kind's name."""
  d = dict(config.data)
  if saved:
    d["kind"] = _SAVED_KINDS.get(d.get("kind"), d.get("kind"))
  data = from_partial(PreferenceData, d, "data")
  task = (from_partial(AdditionTask, config.get("task") or {}, "task")
          if data.kind == "addition" else None)
  return data, task


@dataclasses.dataclass(frozen=True)
class Pair:
  prompt: str
  chosen: str
  rejected: str
  margin: float = 0.0


def load_jsonl(path: str) -> list[Pair]:
  """Reads {"prompt", "chosen", "rejected"[, "margin"]} records."""
  pairs = []
  for i, r in enumerate(jsonl.read_records(path)):
    missing = {"prompt", "chosen", "rejected"} - set(r)
    if missing:
      raise MissingFieldError(f"{path} record {i} lacks {sorted(missing)}")
    pairs.append(Pair(str(r["prompt"]), str(r["chosen"]), str(r["rejected"]),
                      float(r.get("margin", 0.0))))
  return pairs


def split_holdout(pairs: list[Pair], fraction: float, seed: int
                  ) -> tuple[list[Pair], list[Pair]]:
  """(train, eval) with a seeded `fraction` of pairs held out."""
  order = np.random.default_rng(seed).permutation(len(pairs))
  n_eval = max(1, int(round(fraction * len(pairs))))
  if n_eval >= len(pairs):
    raise DataError(f"holdout_fraction={fraction} leaves no train pairs of "
                    f"{len(pairs)}")
  return ([pairs[i] for i in order[n_eval:]],
          [pairs[i] for i in order[:n_eval]])


def _one_digit_off(total: int, max_sum: int, rng: np.random.Generator
                   ) -> int | None:
  """`total` with one digit changed (no new leading zero, <= max_sum)."""
  digits = str(total)
  for _ in range(20):
    pos = int(rng.integers(len(digits)))
    new = str(int(rng.integers(9)))
    new = str(int(new) + 1) if new >= digits[pos] else new  # Skip the same.
    if pos == 0 and new == "0" and len(digits) > 1:
      continue
    wrong = int(digits[:pos] + new + digits[pos + 1:])
    if wrong <= max_sum:
      return wrong
  return None


def _wrong_sum(total: int, max_sum: int, max_offset: int,
               rng: np.random.Generator, near_miss: float = 0.0) -> int:
  """A number in [0, max_sum] other than `total`.

  With probability `near_miss` it differs from `total` in exactly one digit
  (the mistake a policy makes most), else as `max_offset` says.
  """
  if near_miss and rng.random() < near_miss:
    wrong = _one_digit_off(total, max_sum, rng)
    if wrong is not None:
      return wrong
  if max_offset:
    lo, hi = max(0, total - max_offset), min(max_sum, total + max_offset)
  else:
    lo, hi = 0, max_sum
  wrong = int(rng.integers(lo, hi))  # [lo, hi - 1]; shift past the total.
  return wrong + 1 if wrong >= total else wrong


def addition_pair(task: AdditionTask, example, max_offset: int,
                  rng: np.random.Generator, near_miss: float = 0.0) -> Pair:
  """(prompt, correct sum, wrong sum) for one task example."""
  total = example.a + example.b
  max_sum = 2 * (10**task.max_digits - 1)
  wrong = _wrong_sum(total, max_sum, max_offset, rng, near_miss)
  width = example.answer_width
  return Pair(example.prompt, example.answer,
              format_answer(wrong, task.reverse_answer, width))


def synthetic_train_pairs(task: AdditionTask, start: int, count: int, *,
                          max_offset: int, seed: int,
                          near_miss: float = 0.0) -> list[Pair]:
  """Train pairs [start, start + count): a deterministic, endless stream."""
  out = []
  for i in range(start, start + count):
    rng = np.random.default_rng([seed, 7, i])
    out.append(addition_pair(task, task.train_example(i), max_offset, rng,
                             near_miss))
  return out


def synthetic_eval_pairs(task: AdditionTask, *, max_offset: int, seed: int,
                         near_miss: float = 0.0) -> list[Pair]:
  """One pair per held-out problem of the task."""
  rng = np.random.default_rng([seed, 8])
  return [addition_pair(task, ex, max_offset, rng, near_miss)
          for ex in task.eval_examples()]


def fits(pair: Pair, tokenizer: CharTokenizer, seq_len: int) -> bool:
  """Whether both sides encode to at most seq_len tokens."""
  n = len(tokenizer.encode(pair.prompt)) + 2
  return max(len(tokenizer.encode(pair.chosen)),
             len(tokenizer.encode(pair.rejected))) + n <= seq_len


def encode_pairs(pairs: list[Pair], tokenizer: CharTokenizer, seq_len: int
                 ) -> dict[str, np.ndarray]:
  """Host arrays of a batch of P pairs for `objectives.reward_model_terms`.

  Args:
    pairs: the pairs.
    tokenizer: encodes "<bos>prompt+response<eos>".
    seq_len: padded length T.

  Returns:
    {chosen,rejected}_{tokens int32, positions int32, mask bool} [P, T] and
    margin [P] fp32.
  """
  out = {"margin": np.array([p.margin for p in pairs], np.float32)}
  positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32),
                              (len(pairs), seq_len)).copy()
  for side in ("chosen", "rejected"):
    texts = [p.prompt + getattr(p, side) for p in pairs]
    ids, _ = tokenizer.encode_batch(texts, seq_len, add_bos=True,
                                    add_eos=True)
    out[f"{side}_tokens"] = ids
    out[f"{side}_positions"] = positions
    out[f"{side}_mask"] = ids != tokenizer.pad_id
  return out
