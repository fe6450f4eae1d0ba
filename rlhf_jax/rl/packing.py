"""Sequence packing: a batch's samples as rows of `length` tokens.

The packed layout (`rl/grouped.py` names it; batches holding "seg"): rows
[W, L] of several sequences each, told apart by segment ids, so padding is
neither computed nor trained; attention never crosses a segment
(`kernels_pallas/flash_attention.py`). With shared prompts, a group's
prompt sits once in a unit and its responses follow it as sub-segments:

  prompt[0 : p-1] (sub 0) | prompt[p-1], r_0 .. r_{n-2} (sub 1) | ...

Each response segment starts with a copy of the prompt's last token (at
position p-1, seeing the prompt core and itself: exactly its causal
context), whose hidden state predicts the response's first token; the
segment's targets are r_0 .. r_{n-1}. A response sees the prompt core (sub
0) and its own tokens, never a sibling's. A group too long for one row is
split over several units, each with its own copy of the prompt core.

Keys (W rows, L = length):
  tokens, positions, seg, targets, loss_mask, sampler_logp [W, L]; sub
    [W, L] (shared prompts only); seq [W, L]: the sequence (sample index b)
    whose target a token holds, -1 elsewhere; seq_len [W, L]: that
    sequence's trained tokens (the "seq-mean" aggregations divide by it);
  row_seqs [W]: sequences a row counts for (the "seq-mean-token-sum-norm"
    weight: sums to the batch's B over the batch, so samples that train
    nothing, left out of the rows, still count as in the other layouts).

Rows are placed by `sched/row_packing.py` (first-fit decreasing into rows,
longest-first over slots) so each (mini-batch, micro-batch, data shard)
slot holds the same number of rows and about the same number of tokens;
mini-batch m is rows [m * n, (m + 1) * n) and `split_micro`'s strided
micro-batches find their slots (`slot_order`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rlhf_jax.sched import row_packing as rules


@dataclasses.dataclass(frozen=True)
class Slots:
  """The cells of one training batch that rows are dealt to."""
  length: int               # L, tokens per row (`rl.pack_length`).
  minibatches: int = 1
  micro_batches: int = 1
  shards: int = 1           # Data-parallel shards of the batch axis.

  @property
  def count(self) -> int:
    return self.minibatches * self.micro_batches * self.shards


@dataclasses.dataclass(frozen=True)
class _Unit:
  """What must share a row: a prompt (core) and some of its responses, or
  one whole sequence."""
  prompt: np.ndarray        # Tokens of the prompt (all of them).
  samples: tuple[int, ...]  # Sample indices of the responses.
  shared: bool              # Prompt core + response sub-segments.
  tokens: int


def _units(samples, group_size: int, shared: bool, keep,
           length: int) -> list[_Unit]:
  """The units of the kept, non-empty samples."""
  live = [b for b, s in enumerate(samples) if len(s.tokens) and keep[b]]
  if not shared:
    return [_Unit(np.asarray(samples[b].prompt_tokens), (b,), False,
                  len(samples[b].prompt_tokens) + len(samples[b].tokens) - 1)
            for b in live]
  units = []
  for n in range(0, len(samples), group_size):
    for b in range(n + 1, n + group_size):
      if samples[b].prompt_id != samples[n].prompt_id:
        raise ValueError(f"sample {b} (prompt {samples[b].prompt_id}) is "
                         f"not in the group of prompt {samples[n].prompt_id}")
    group = [b for b in live if n <= b < n + group_size]
    prompt = np.asarray(samples[n].prompt_tokens)
    core = len(prompt) - 1
    chunk, size = [], core
    for b in group:  # Greedy: as many responses as fit beside the core.
      r = len(samples[b].tokens)
      if chunk and size + r > length:
        units.append(_Unit(prompt, tuple(chunk), True, size))
        chunk, size = [], core
      chunk.append(b)
      size += r
    if chunk:
      units.append(_Unit(prompt, tuple(chunk), True, size))
  return units


def slot_order(slots: Slots, per_slot: int) -> np.ndarray:
  """For each (mini-batch, micro-batch, shard, row-in-slot) cell in that
  nested order, its row index in the batch: mini-batch m is a contiguous
  block; inside it `learner.split_micro` takes micro-batch u as rows u,
  u + U, ..., and the batch axis gives shard d a contiguous run of them."""
  M, U, D, k = slots.minibatches, slots.micro_batches, slots.shards, per_slot
  m, u, d, j = np.meshgrid(np.arange(M), np.arange(U), np.arange(D),
                           np.arange(k), indexing="ij")
  return (m * U * D * k + (d * k + j) * U + u).reshape(-1)


def pack(samples: Sequence, slots: Slots, *, group_size: int = 0,
         keep=None, routes_shape: tuple | None = None):
  """(arrays of the packed layout, sampler_logp [W, L]): module doc.

  group_size=G shares each group's prompt (samples come G per prompt, as
  `generate` returns them); 0 packs every sequence whole. `routes_shape`
  (layers, k) (MoE routing replay): also "routes" [W, L, layers, k], the
  experts the sampler routed each token to, -1 where none; a shared
  prompt's are its group's newest record (`prompt_record`).
  """
  B, L = len(samples), slots.length
  keep = np.ones(B, bool) if keep is None else np.asarray(keep, bool)
  if group_size and B % group_size:
    raise ValueError(f"{B} samples are not groups of {group_size}")
  units = _units(samples, group_size, bool(group_size), keep, L)
  unit_rows = rules.fill_rows([u.tokens for u in units], L)
  row_tokens = [sum(units[u].tokens for u in r) for r in unit_rows]
  per_slot = rules.rows_per_slot(len(unit_rows), slots.count)
  dealt = rules.deal_rows(row_tokens, slots.count, per_slot,
                          minibatches=slots.minibatches)
  W = slots.count * per_slot
  order = slot_order(slots, per_slot).reshape(slots.count, per_slot)

  a = dict(tokens=np.zeros((W, L), np.int32),
           positions=np.zeros((W, L), np.int32),
           seg=np.full((W, L), -1, np.int32),
           targets=np.zeros((W, L), np.int32),
           loss_mask=np.zeros((W, L), np.float32),
           seq=np.full((W, L), -1, np.int32),
           seq_len=np.zeros((W, L), np.float32),
           row_seqs=np.zeros(W, np.float32))
  if group_size:
    a["sub"] = np.zeros((W, L), np.int32)
  if routes_shape is not None:
    a["routes"] = np.full((W, L) + tuple(routes_shape), -1, np.int16)
  sampler_logp = np.zeros((W, L), np.float32)
  for slot, rows_of_slot in enumerate(dealt):
    for j, r in enumerate(rows_of_slot):
      w, at = order[slot, j], 0
      for seg, u in enumerate(unit_rows[r]):
        at = _write_unit(a, sampler_logp, w, at, seg, units[u], samples)
  # Samples that train nothing still count as sequences: in the first row
  # of mini-batch (b mod M).
  n = W // slots.minibatches
  for b in np.flatnonzero(~keep | np.array([len(s.tokens) == 0
                                                 for s in samples])):
    a["row_seqs"][(b % slots.minibatches) * n] += 1
  return a, sampler_logp


def cells_by_sequence(seq: np.ndarray, num_seqs: int):
  """(cells, start): the flat cells of packed rows whose `seq` is >= 0,
  grouped by sequence and in row order within one (a sequence sits in one
  row); sequence b's are cells[start[b]:start[b + 1]]."""
  seq = seq.reshape(-1)
  cells = np.flatnonzero(seq >= 0)
  cells = cells[np.argsort(seq[cells], kind="stable")]
  return cells, np.searchsorted(seq[cells], np.arange(num_seqs + 1))


def last_cells(seq: np.ndarray, num_seqs: int) -> np.ndarray:
  """[num_seqs] int32: the flat cell of each sequence's last `seq` cell
  (every sequence must have one: `with_last_token` rows)."""
  cells, start = cells_by_sequence(seq, num_seqs)
  return cells[start[1:] - 1].astype(np.int32)


def with_last_token(samples: Sequence) -> list:
  """The samples with one padding target appended. `pack` writes every
  token of a sequence but its last, which is only a target; packed, these
  hold every token of the originals, the last one in each sequence's last
  `seq` cell (`last_cells`): what a reward model reads
  (`reward_model.packed_score`)."""
  return [dataclasses.replace(
      s, tokens=list(s.tokens) + [0],
      logp_raw=np.zeros(len(s.tokens) + 1, np.float32), env_mask=None)
          for s in samples]


def trained_tokens(sample) -> np.ndarray:
  """[len(sample.tokens)] float32: 1 at sampled tokens, 0 at the ones a
  multi-turn environment appended (`Sample.env_mask`): never trained."""
  if not getattr(sample, "env_mask", None):
    return np.ones(len(sample.tokens), np.float32)
  return 1.0 - np.asarray(sample.env_mask, np.float32)


def prompt_record(group: Sequence):
  """The prompt routes a group's samples share in a batch (MoE routing
  replay): the newest prefill's (async RL prefills a carried-over group
  again with new weights, and the tokens drawn since attend to it); None
  if none was recorded."""
  recorded = [s for s in group if s.prompt_routes is not None]
  if not recorded:
    return None
  newest = max(recorded, key=lambda s: max(s.token_versions)
               if s.token_versions else s.weight_version)
  return newest.prompt_routes


def _routes_of(sample, prompt_routes, first: int):
  """The records of the tokens a packed sequence feeds: its prompt's from
  `first` on, then its response's but the last (never fed)."""
  if prompt_routes is None or sample.routes is None:
    return None
  return np.concatenate([prompt_routes[first:], sample.routes])


def _write_unit(a, sampler_logp, w, at, seg, unit: _Unit, samples) -> int:
  """Writes `unit` into row w from column `at`; returns the next column."""
  def put(tokens, first_pos, sub, b, targets, logp, routes=None):
    nonlocal at
    n = len(tokens)
    cols = slice(at, at + n)
    if routes is not None:
      a["routes"][w, cols] = routes
    a["tokens"][w, cols] = tokens
    a["positions"][w, cols] = first_pos + np.arange(n)
    a["seg"][w, cols] = seg
    if "sub" in a:
      a["sub"][w, cols] = sub
    if b is not None:
      t = len(targets)
      tcols = slice(at + n - t, at + n)  # The last t tokens hold targets.
      a["targets"][w, tcols] = targets
      mask = trained_tokens(samples[b])
      a["loss_mask"][w, tcols] = mask
      a["seq"][w, tcols] = b
      a["seq_len"][w, tcols] = mask.sum()
      a["row_seqs"][w] += 1
      sampler_logp[w, tcols] = logp
    at += n

  p = len(unit.prompt)
  recorded = "routes" in a
  if not unit.shared:
    s = samples[unit.samples[0]]
    seq = np.concatenate([unit.prompt, np.asarray(s.tokens)])
    put(seq[:-1], 0, 0, unit.samples[0], seq[p:], s.logp_raw,
        _routes_of(s, s.prompt_routes, 0) if recorded else None)
    return at
  prompt_routes = (prompt_record([samples[b] for b in unit.samples])
                   if recorded else None)
  put(unit.prompt[:p - 1], 0, 0, None, None, None,
      None if prompt_routes is None else prompt_routes[:p - 1])
  for i, b in enumerate(unit.samples):
    s = samples[b]
    r = np.asarray(s.tokens)
    put(np.concatenate([unit.prompt[p - 1:], r[:-1]]), p - 1, i + 1, b, r,
        s.logp_raw, _routes_of(s, prompt_routes, p - 1))
  return at
