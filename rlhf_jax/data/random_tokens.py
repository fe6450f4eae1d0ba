"""Random-token prompts at any size: an RL step of real shapes, no assets.

`config.data.kind = "random_tokens"` (configs/synthetic_grpo.py): prompts
are random ids of a vocabulary of `data.vocab_size` (the model's, e.g.
Qwen2.5's 151,936), their lengths uniform in [`data.min_prompt_len`,
`data.max_prompt_len`], drawn from (`data.seed`, batch index), so a resumed
run sees the batches an uninterrupted one would. Responses end at <eos>
(id 2) or at `rollout.max_new_tokens`; a randomly initialised model over a
large vocabulary almost never samples <eos>, so the step decodes to the
cap: the cost of a long-response RL step without a checkpoint or a
dataset. The "even_tokens" reward (the fraction of a response's ids that
are even) gives the run a signal a policy can learn.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Iterable

import numpy as np

from rlhf_jax.data import batching
from rlhf_jax.data.data_source import DataSource
from rlhf_jax.samples import PromptBatch
from rlhf_jax.typed_config import fail

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
NUM_SPECIAL = 3
EVAL_STREAM = 1 << 30  # Batch indices of the eval prompts (apart from train).


class IdTokenizer:
  """Text is the ids themselves, space-separated ("17 4 99")."""

  pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size
    self.stop_ids = (EOS_ID,)

  def encode(self, text: str, *, add_bos: bool = False,
             add_eos: bool = False) -> list[int]:
    ids = [int(t) for t in text.split()]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"id {bad[0]} is outside the vocabulary of "
                       f"{self.vocab_size}")
    return [BOS_ID] * add_bos + ids + [EOS_ID] * add_eos

  def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
    out = []
    for tok in np.asarray(ids).reshape(-1).tolist():
      if tok == EOS_ID and stop_at_eos:
        break
      if tok not in (PAD_ID, BOS_ID, EOS_ID):
        out.append(str(tok))
    return " ".join(out)


def prompt_batch(index: int, size: int, *, vocab_size: int, min_len: int,
                 max_len: int, seed: int) -> PromptBatch:
  """Batch `index`: `size` prompts of <bos> + random ids, right-padded to
  `max_len`; prompt ids index * size + row."""
  rng = np.random.default_rng((seed, index))
  lengths_N = rng.integers(min_len, max_len + 1, size).astype(np.int32)
  tokens_NxP = np.full((size, max_len), PAD_ID, np.int32)
  body = rng.integers(NUM_SPECIAL, vocab_size, (size, max_len - 1))
  for n, length in enumerate(lengths_N):
    tokens_NxP[n, 0] = BOS_ID
    tokens_NxP[n, 1:length] = body[n, :length - 1]
  prompts = [" ".join(map(str, row[1:length]))
             for row, length in zip(tokens_NxP.tolist(), lengths_N)]
  return PromptBatch(
      prompt_ids=(index * size + np.arange(size)).astype(np.int32),
      tokens_NxP=tokens_NxP, lengths_N=lengths_N, prompts=prompts,
      metadata=[{} for _ in range(size)])


class RandomPrompts:
  """Endless train batches with a resumable position (plain ints)."""

  def __init__(self, batch_size: int, **spec):
    self._batch_size, self._spec, self._next = batch_size, spec, 0

  def __iter__(self):
    return self

  def __next__(self) -> PromptBatch:
    batch = prompt_batch(self._next, self._batch_size, **self._spec)
    self._next += 1
    return batch

  def get_state(self) -> dict[str, int]:
    return {"next_batch": self._next, "seed": self._spec["seed"],
            "batch_size": self._batch_size}

  def set_state(self, state: dict[str, int]) -> None:
    batching.check_same_order(state, self.get_state())
    self._next = int(state["next_batch"])


@dataclasses.dataclass(frozen=True)
class RandomTokensData:
  """`config.data` of kind "random_tokens" (see the module doc)."""
  PATH: ClassVar[str] = "data"
  kind: str = "random_tokens"
  vocab_size: int = 32000
  min_prompt_len: int = 16
  max_prompt_len: int = 32
  seed: int = 0

  def __post_init__(self):
    if self.vocab_size <= NUM_SPECIAL:
      fail(self, "vocab_size", f"must exceed the {NUM_SPECIAL} special ids")
    if not 2 <= self.min_prompt_len <= self.max_prompt_len:
      fail(self, "min_prompt_len", f"and max_prompt_len="
           f"{self.max_prompt_len} must satisfy 2 <= min <= max (<bos> + "
           "ids)")


def source(c):
  """The `DataSource` of the job sections `c` (`c.data`: RandomTokensData)."""
  data = c.data
  spec = dict(vocab_size=data.vocab_size, min_len=data.min_prompt_len,
              max_len=data.max_prompt_len, seed=data.seed)
  return DataSource(
      tokenizer=IdTokenizer(data.vocab_size), prompt_len=data.max_prompt_len,
      stop_ids=(EOS_ID,),
      iterator=RandomPrompts(c.train.prompts_per_step, **spec),
      eval_batches=[prompt_batch(EVAL_STREAM, c.eval.batch_size, **spec)])

