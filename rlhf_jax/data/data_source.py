"""What an RL job needs from its data (`data/sources.py` builds one per
`config.data.kind`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

from rlhf_jax.samples import PromptBatch


@dataclasses.dataclass
class DataSource:
  """What the GRPO job needs from its data, whatever the kind."""
  tokenizer: Any             # encode/decode, pad_id (CharTokenizer | HF)
  prompt_len: int            # P: every prompt batch is padded to it
  stop_ids: tuple[int, ...]  # sampling stops at these tokens
  iterator: Iterator[PromptBatch]  # train prompts; get_state/set_state
  eval_batches: list[PromptBatch]
  sft_arrays: Callable[[int, int], dict] | None = None  # (start, batch) ->
