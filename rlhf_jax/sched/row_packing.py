"""Where packed training sequences go: units into rows, rows into slots.

A unit is what must sit in one row (one sequence with its prompt, or a
prompt with some of its group's responses: `rl/packing.py` makes them);
a row holds `length` tokens; a slot is one (mini-batch, micro-batch, data
shard) cell of the training step, holding the same number of rows as every
other slot (static shapes). The rules here only see token counts.

RLHFuse balances data-parallel ranks by token count; these rules do the
same at row granularity: rows are filled first-fit decreasing (few, full
rows: padding is not trained), then dealt to slots longest-first onto the
least-loaded slot, so every mini-batch, micro-batch and shard gets about
the same number of real tokens (and in a step with fewer rows than slots,
every mini-batch gets some).
"""

from __future__ import annotations

from collections.abc import Sequence

from rlhf_jax.sched.assignment import longest_first


def fill_rows(unit_tokens: Sequence[int], length: int) -> list[list[int]]:
  """Unit indices per row, first-fit decreasing into rows of `length`.

  Raises ValueError when a unit is longer than a row.
  """
  rows: list[list[int]] = []
  free: list[int] = []
  for u in longest_first(unit_tokens, range(len(unit_tokens))):
    n = unit_tokens[u]
    if n > length:
      raise ValueError(f"a packed unit of {n} tokens does not fit rows of "
                       f"{length} (rl.pack_length)")
    for r, left in enumerate(free):
      if n <= left:
        rows[r].append(u)
        free[r] -= n
        break
    else:
      rows.append([u])
      free.append(length - n)
  return rows


# Rows per slot are rounded up to one of these (then to multiples of 32),
# so a run compiles the train step for a handful of shapes, not one per
# step; the padding this costs is at most a third of a slot.
_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def rows_per_slot(num_rows: int, num_slots: int) -> int:
  """Rows each slot holds: enough for `num_rows`, rounded up to a bucket."""
  need = max(1, -(-num_rows // num_slots))
  for b in _BUCKETS:
    if need <= b:
      return b
  return -(-need // 32) * 32


def deal_rows(row_tokens: Sequence[int], num_slots: int, per_slot: int, *,
              minibatches: int = 1) -> list[list[int]]:
  """Row indices per slot: longest row first onto the slot with the fewest
  tokens that still has room, `per_slot` rows each at most (callers pad the
  rest with empty rows).

  Slots are `minibatches` contiguous blocks (slot s is in mini-batch
  s // (num_slots // minibatches)). Ties between equally loaded slots go
  round the mini-batches first: with fewer rows than slots (a small step)
  every mini-batch still gets rows, so no optimizer update is a step of
  zero gradient; then the lower slot."""
  if len(row_tokens) > num_slots * per_slot:
    raise ValueError(f"{len(row_tokens)} rows do not fit {num_slots} slots "
                     f"of {per_slot}")
  if num_slots % minibatches:
    raise ValueError(f"{num_slots} slots are not {minibatches} mini-batches")
  per_minibatch = num_slots // minibatches
  # Tie order: (place in its mini-batch, mini-batch).
  tie = [(s % per_minibatch, s // per_minibatch) for s in range(num_slots)]
  slots: list[list[int]] = [[] for _ in range(num_slots)]
  load = [0] * num_slots
  for r in longest_first(row_tokens, range(len(row_tokens))):
    s = min((s for s in range(num_slots) if len(slots[s]) < per_slot),
            key=lambda s: (load[s], tie[s]))
    slots[s].append(r)
    load[s] += row_tokens[r]
  return slots
