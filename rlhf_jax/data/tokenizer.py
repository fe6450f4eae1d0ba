"""Built-in character-level tokenizer, so the default run downloads nothing.

Ids: 0 <pad>, 1 <bos>, 2 <eos>, then one id per character of `CHARS` in
order: digits first (ids 3..12, so digit d is id 3 + d), then the arithmetic
and punctuation symbols, space and newline, then a-z and A-Z. The table is
part of the checkpoint format: append new characters, never reorder.
"""

from typing import Iterable, Sequence

import numpy as np

from rlhf_jax.errors import DataError

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL = 3

DIGITS = "0123456789"
SYMBOLS = "+-*/=<>()[].,:;?!'\"_ \n"
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
CHARS = DIGITS + SYMBOLS + LETTERS


class CharTokenizer:
  """Maps characters of `CHARS` to ids and back; no merges, no unknown id."""

  pad_id = PAD_ID
  bos_id = BOS_ID
  eos_id = EOS_ID

  def __init__(self) -> None:
    self._id_of = {c: NUM_SPECIAL + i for i, c in enumerate(CHARS)}
    self._char_of = {i: c for c, i in self._id_of.items()}

  @property
  def vocab_size(self) -> int:
    """Number of ids, specials included (models may pad this up)."""
    return NUM_SPECIAL + len(CHARS)

  def encode(
      self, text: str, *, add_bos: bool = False, add_eos: bool = False
  ) -> list[int]:
    """Encodes text to ids.

    Args:
      text: a string made of characters of `CHARS`.
      add_bos: prepend <bos>.
      add_eos: append <eos>.

    Returns:
      List of int ids.

    Raises:
      ValueError: a character outside the vocabulary (names it and its index).
    """
    ids = [BOS_ID] if add_bos else []
    for pos, ch in enumerate(text):
      tok = self._id_of.get(ch)
      if tok is None:
        raise DataError(
            f"Character {ch!r} at index {pos} of {text!r} is not in the "
            f"CharTokenizer vocabulary {CHARS!r}."
        )
      ids.append(tok)
    if add_eos:
      ids.append(EOS_ID)
    return ids

  def decode(
      self,
      ids: Iterable[int],
      *,
      stop_at_eos: bool = True,
      strict: bool = False,
  ) -> str:
    """Decodes ids to text, dropping <pad> and <bos>.

    Sampled ids can be anything the model's (possibly padded) vocabulary
    allows, and a reward function must still see a string, so by default an
    id without a character decodes to U+FFFD rather than raising.

    Args:
      ids: token ids (list, numpy or jax array).
      stop_at_eos: stop at the first <eos>; otherwise <eos> is dropped.
      strict: raise on ids that have no character instead of U+FFFD.

    Returns:
      The decoded string.
    """
    out = []
    for tok in np.asarray(ids).reshape(-1).tolist():
      if tok == EOS_ID:
        if stop_at_eos:
          break
        continue
      if tok in (PAD_ID, BOS_ID):
        continue
      ch = self._char_of.get(tok)
      if ch is None:
        if strict:
          raise ValueError(
              f"Token id {tok} has no character (vocab_size "
              f"{self.vocab_size})."
          )
        ch = "\ufffd"
      out.append(ch)
    return "".join(out)

  def encode_batch(
      self,
      texts: Sequence[str],
      length: int,
      *,
      add_bos: bool = True,
      add_eos: bool = False,
  ) -> tuple[np.ndarray, np.ndarray]:
    """Encodes and right-pads texts to a fixed length (one shape bucket).

    Args:
      texts: strings to encode.
      length: padded length L; longer encodings raise.
      add_bos: prepend <bos> to each.
      add_eos: append <eos> to each.

    Returns:
      (ids [N, L] int32 right-padded with <pad>, lengths [N] int32).
    """
    ids_NxL = np.full((len(texts), length), PAD_ID, np.int32)
    len_N = np.zeros((len(texts),), np.int32)
    for n, text in enumerate(texts):
      ids = self.encode(text, add_bos=add_bos, add_eos=add_eos)
      if len(ids) > length:
        raise DataError(
            f"{text!r} encodes to {len(ids)} tokens, more than the padded "
            f"length {length}."
        )
      ids_NxL[n, : len(ids)] = ids
      len_N[n] = len(ids)
    return ids_NxL, len_N
