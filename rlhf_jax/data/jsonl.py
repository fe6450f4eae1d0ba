"""RL prompts from a local JSONL (or Parquet) file, with a field mapping.

A record becomes a prompt through `fields`, which maps our names to the
file's keys (dotted keys reach into nested objects):

  fields = {"prompt": "question", "answer": "answer"}   # GSM8K

"prompt" is required; every other mapped name lands in the sample's metadata
for the reward functions (plus "prompt_id", the record's 0-based index in
the file, stable across runs). The prompt text is wrapped as
`prompt_template.format(prompt=...)`, then rendered with the tokenizer's chat
template (optional system prompt) or encoded as plain text.

`PromptSource` iterates batches of `samples.PromptBatch` in a seeded
per-epoch order with a resumable integer position, like the addition task's
iterator. Prompts longer than `max_prompt_len` tokens are dropped (and
counted) when the source is built, so every batch has the same shape.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Mapping, Sequence

from absl import logging
import numpy as np

from rlhf_jax.samples import PromptBatch
from rlhf_jax.errors import (CheckpointError, ConfigError, DataError,
                             MissingFieldError)


def _get(record: Mapping[str, Any], key: str, where: str) -> Any:
  value: Any = record
  for part in key.split("."):
    if not isinstance(value, Mapping) or part not in value:
      raise MissingFieldError(
          f"{where} has no field {key!r} (keys: {sorted(record)})")
    value = value[part]
  return value


def read_records(path: str) -> list[dict]:
  """Rows of a .jsonl / .json-lines file, or of a .parquet file (pyarrow);
  DataError if there are none."""
  if path.endswith(".parquet"):
    try:
      import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ConfigError(
          f"reading {path!r} needs pyarrow (pip install pyarrow), or convert "
          "it to JSONL") from e
    rows = pq.read_table(path).to_pylist()
    if not rows:
      raise DataError(f"{path} has no records")
    return rows
  rows = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if line.strip():
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise DataError(f"{path}:{n} is not valid JSON: {e}") from e
  if not rows:
    raise DataError(f"{path} has no records")
  return rows


def load_examples(path: str, fields: Mapping[str, str]
                  ) -> list[tuple[str, dict]]:
  """(prompt text, metadata) per record, following the field mapping.

  Args:
    path: .jsonl or .parquet file.
    fields: our name -> the file's (dotted) key; must map "prompt".

  Returns:
    One (prompt, metadata) pair per record, in file order.

  Raises:
    KeyError: a record lacks a mapped field (names the record).
  """
  if "prompt" not in fields:
    raise ConfigError(f"fields must map 'prompt', got {dict(fields)}")
  out = []
  for i, row in enumerate(read_records(path)):
    where = f"{path} record {i}"
    meta = {name: _get(row, key, where) for name, key in fields.items()}
    prompt = str(meta.pop("prompt"))
    out.append((prompt, {"prompt_id": i, **meta}))
  return out


def format_prompt(tokenizer, prompt: str, *, template: str = "{prompt}",
                  system_prompt: str | None = None,
                  use_chat_template: bool = True) -> list[int]:
  """Token ids of one prompt, through the chat template if asked."""
  text = template.format(prompt=prompt)
  if not use_chat_template:
    return tokenizer.encode(text, add_special_tokens=True)
  messages = [{"role": "system", "content": system_prompt}] if (
      system_prompt) else []
  return tokenizer.encode_chat(messages + [{"role": "user", "content": text}])


class PromptSource:
  """Endless batches of file prompts, reshuffled per epoch, resumable.

  Position k of epoch e is record perm_e[k], perm_e a function of (seed, e)
  only, so the state is two ints and a resumed run sees the same batches.
  """

  def __init__(self, examples: Sequence[tuple[str, dict]], tokenizer, *,
               batch_size: int, max_prompt_len: int, seed: int = 0,
               shuffle: bool = True, template: str = "{prompt}",
               system_prompt: str | None = None,
               use_chat_template: bool = True):
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    self._batch_size, self._seed, self._shuffle = batch_size, seed, shuffle
    self._pad = tokenizer.pad_id
    self.max_prompt_len = max_prompt_len
    self._items = []
    for prompt, meta in examples:
      ids = format_prompt(tokenizer, prompt, template=template,
                          system_prompt=system_prompt,
                          use_chat_template=use_chat_template)
      if len(ids) <= max_prompt_len:
        self._items.append((prompt, meta, ids))
    self.num_dropped = len(examples) - len(self._items)
    if self.num_dropped:
      logging.info("dropped %d of %d prompts longer than %d tokens",
                   self.num_dropped, len(examples), max_prompt_len)
    if not self._items:
      raise DataError(f"no prompt fits max_prompt_len={max_prompt_len}")
    self._next = 0
    self._orders: dict[int, np.ndarray] = {}

  def __len__(self) -> int:
    return len(self._items)

  def __iter__(self) -> Iterator[PromptBatch]:
    return self

  def _order(self, epoch: int) -> np.ndarray:
    if epoch not in self._orders:
      n = len(self._items)
      self._orders = {epoch: np.random.default_rng([self._seed, epoch])
                      .permutation(n) if self._shuffle else np.arange(n)}
    return self._orders[epoch]

  def __next__(self) -> PromptBatch:
    n = len(self._items)
    picks = []
    for pos in range(self._next, self._next + self._batch_size):
      picks.append(self._items[self._order(pos // n)[pos % n]])
    self._next += self._batch_size
    tokens = np.full((len(picks), self.max_prompt_len), self._pad, np.int32)
    lengths = np.zeros((len(picks),), np.int32)
    for row, (_, _, ids) in enumerate(picks):
      tokens[row, :len(ids)] = ids
      lengths[row] = len(ids)
    return PromptBatch(
        prompt_ids=np.asarray([m["prompt_id"] for _, m, _ in picks], np.int32),
        tokens_NxP=tokens, lengths_N=lengths,
        prompts=[p for p, _, _ in picks], metadata=[m for _, m, _ in picks])

  def get_state(self) -> dict[str, int]:
    """The position as ints (checkpoint it with the train state)."""
    return {"next_index": self._next, "seed": self._seed,
            "batch_size": self._batch_size, "num_prompts": len(self._items)}

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Restores `get_state`; refuses a different seed, batch or file."""
    mine = self.get_state()
    for key in ("seed", "batch_size", "num_prompts"):
      if int(state[key]) != mine[key]:
        raise CheckpointError(
            f"iterator state has {key}={int(state[key])}, this source has "
            f"{mine[key]}; refusing to resume with a different data order")
    self._next = int(state["next_index"])
