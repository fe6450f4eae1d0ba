"""Host-side batches of the addition task: RL prompts, eval prompts, SFT.

Dimension letters: N prompts, P prompt length, B sequences, L sequence length.

Arrays are numpy on the host; the trainer places them on the mesh. Shapes are
fixed per task (prompts padded to `task.max_prompt_len`, SFT sequences to
`sft_length(task)`), so each jitted consumer compiles once.
"""

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from rlhf_jax.data.tasks import AdditionTask, Example
from rlhf_jax.data.tokenizer import PAD_ID, CharTokenizer
from rlhf_jax.errors import CheckpointError
from rlhf_jax.samples import PromptBatch


@dataclasses.dataclass(frozen=True)
class SFTBatch:
  """Teacher-forcing batch: inputs predict targets; loss on the answer only."""

  inputs_BxL: np.ndarray  # [B, L] int32: <bos> prompt answer (<eos> dropped)
  targets_BxL: np.ndarray  # [B, L] int32: inputs shifted left by one
  mask_BxL: np.ndarray  # [B, L] float32: 1 on answer-digit and <eos> targets


def make_prompt_batch(
    examples: Sequence[Example], tokenizer: CharTokenizer, prompt_len: int
) -> PromptBatch:
  """Tokenizes examples into a PromptBatch.

  Args:
    examples: the problems.
    tokenizer: the character tokenizer.
    prompt_len: padded prompt length P (usually task.max_prompt_len).

  Returns:
    The PromptBatch.
  """
  prompts = [ex.prompt for ex in examples]
  tokens_NxP, lengths_N = tokenizer.encode_batch(prompts, prompt_len)
  return PromptBatch(
      prompt_ids=np.asarray([ex.prompt_id for ex in examples], np.int32),
      tokens_NxP=tokens_NxP,
      lengths_N=lengths_N,
      prompts=prompts,
      metadata=[ex.metadata() for ex in examples],
  )


class PromptIterator:
  """Infinite iterator over RL prompt batches with a resumable position.

  Batch k holds train examples [k * N, (k + 1) * N). The state is plain ints,
  so it checkpoints with the train state; restoring it continues with exactly
  the batches an uninterrupted run would have produced.
  """

  def __init__(
      self, task: AdditionTask, tokenizer: CharTokenizer, batch_size: int
  ):
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    self._task = task
    self._tokenizer = tokenizer
    self._batch_size = batch_size
    self._next_index = 0

  def __iter__(self) -> Iterator[PromptBatch]:
    return self

  def __next__(self) -> PromptBatch:
    start = self._next_index
    examples = [
        self._task.train_example(i)
        for i in range(start, start + self._batch_size)
    ]
    self._next_index = start + self._batch_size
    return make_prompt_batch(
        examples, self._tokenizer, self._task.max_prompt_len
    )

  def get_state(self) -> dict[str, int]:
    """Returns the position as {"next_index", "seed", "batch_size"} ints."""
    return {
        "next_index": self._next_index,
        "seed": self._task.seed,
        "batch_size": self._batch_size,
    }

  def set_state(self, state: dict[str, int]) -> None:
    """Restores a position saved by `get_state`.

    Args:
      state: a dict from `get_state` (values may be numpy/jax integer
        scalars, as they come back from a checkpoint).

    Raises:
      ValueError: the state was saved for another seed or batch size, which
        would silently change the data order of the resumed run.
    """
    check_same_order(state, self.get_state())
    self._next_index = int(state["next_index"])


def check_same_order(saved: dict, mine: dict) -> None:
  """Raises CheckpointError unless a saved iterator state has this
  iterator's seed and batch size (another would silently change the data
  order of the resumed run)."""
  for key in ("seed", "batch_size"):
    if int(saved[key]) != mine[key]:
      raise CheckpointError(
          f"Iterator state has {key}={int(saved[key])}, this iterator has "
          f"{key}={mine[key]}; refusing to resume with a different data "
          "order.")


def eval_batches(
    task: AdditionTask, tokenizer: CharTokenizer, batch_size: int
) -> list[PromptBatch]:
  """The held-out prompts in fixed order, split into batches.

  Args:
    task: the task.
    tokenizer: the character tokenizer.
    batch_size: prompts per batch; the last batch is smaller when
      batch_size does not divide task.num_eval.

  Returns:
    List of PromptBatch covering every eval example once.
  """
  examples = task.eval_examples()
  return [
      make_prompt_batch(
          examples[i : i + batch_size], tokenizer, task.max_prompt_len
      )
      for i in range(0, len(examples), batch_size)
  ]


def sft_length(task: AdditionTask) -> int:
  """L of SFT batches: whole sequence (prompt + response) minus the shift."""
  response = task.max_response_len
  if task.tool_demo_fraction:  # "[calc a*b](answer)" before the answer.
    response += len(_tool_demo("9" * task.max_digits, "9" * task.max_digits,
                               task.operator, "9" * task.answer_digits)[0][0])
    response += task.answer_digits + 2
  return task.max_prompt_len + response - 1


def _tool_demo(a: str, b: str, op: str, answer: str) -> list[tuple[str, bool]]:
  """The calculator call of a tool demo, as (text, trained) segments in
  the tagged format (`envs/tools.py`): the reply is the environment's."""
  from rlhf_jax.envs.tools import Calculator, TaggedFormat  # pylint: disable=g-import-not-at-top
  fmt = TaggedFormat()
  return [(f"[{Calculator.name} {a}{op}{b}]", True),
          (fmt.render(answer), False)]


def sft_batch(
    task: AdditionTask, tokenizer: CharTokenizer, start: int, batch_size: int
) -> SFTBatch:
  """Teacher-forcing batch of SFT examples [start, start + batch_size).

  Sequences are <bos> prompt answer <eos>; only the targets after the "="
  (answer digits and <eos>) are trained, the same tokens RL later samples.
  A tool demo (`Example.tool_demo`) answers after a calculator call,
  "37*48=[calc 37*48](1776)1776": the call is trained, the reply (the
  environment's tokens) is not.

  Args:
    task: the task.
    tokenizer: the character tokenizer.
    start: index of the first example in the SFT stream.
    batch_size: B.

  Returns:
    The SFTBatch, shapes [B, sft_length(task)].
  """
  length = sft_length(task) + 1
  seq_BxL1 = np.full((batch_size, length), PAD_ID, np.int32)
  mask_BxL = np.zeros((batch_size, length - 1), np.float32)
  for row in range(batch_size):
    ex = task.sft_example(start + row)
    segments = []
    if ex.tool_demo:  # The call repeats the prompt's operands as written.
      a, b = ex.prompt[:-1].split(ex.operator)
      segments = _tool_demo(a, b, ex.operator, ex.answer)
    segments.append((ex.answer, True))
    ids = tokenizer.encode(ex.prompt, add_bos=True)
    p = len(ids)
    trained = [False] * p
    for i, (text, train) in enumerate(segments):
      part = tokenizer.encode(text, add_eos=i == len(segments) - 1)
      ids += part
      trained += [train] * len(part)
    seq_BxL1[row, :len(ids)] = ids
    # Target t is token t + 1: token j is trained through target j - 1.
    mask_BxL[row, :len(ids) - 1] = trained[1:]
  return SFTBatch(
      inputs_BxL=seq_BxL1[:, :-1],
      targets_BxL=seq_BxL1[:, 1:],
      mask_BxL=mask_BxL,
  )


def sft_arrays(task, tokenizer, start: int, batch_size: int) -> dict:
  """The learner's host arrays of SFT examples [start, start + batch_size)."""
  b = sft_batch(task, tokenizer, start, batch_size)
  B, L = b.inputs_BxL.shape
  return dict(tokens=b.inputs_BxL,
              positions=np.broadcast_to(np.arange(L, dtype=np.int32),
                                        (B, L)).copy(),
              attn_mask=b.inputs_BxL != tokenizer.pad_id,
              targets=b.targets_BxL, loss_mask=b.mask_BxL)
