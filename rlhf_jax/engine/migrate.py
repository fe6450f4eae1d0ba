"""Moving live decode rows from one engine onto a smaller one.

Two ways, same tokens (sampling keys depend on seed, prompt, sample index
and position, never on placement):
  move_rows      the rows' KV and counters are gathered on the source
                 engine and put on the target engine's devices;
  reprefill_rows each live sample is prefilled again on the target, its
                 prompt extended by the tokens it already generated, into a
                 row of its own; then its pending token and count are set.
The target engine has the same per-device shapes as the source (rows per
replica, buckets, cache lengths), so decode is the same computation on it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.state import STATE_AXES, DecodeState


def _row_axis(name: str) -> int | None:
  axes = STATE_AXES[name]
  return axes.index("batch") if "batch" in axes else None


@functools.lru_cache(maxsize=32)
def _gather_fn(sharding):
  """Jitted row gather (rows `idx`, inactive where not `valid`)."""

  def gather(state: DecodeState, idx, valid):
    out = {}
    for name in STATE_AXES:
      x = getattr(state, name)
      axis = _row_axis(name)
      out[name] = x if axis is None else jnp.take(x, idx, axis=axis)
    out["active"] = out["active"] & valid[:, None]
    return DecodeState(**out)

  return jax.jit(gather, out_shardings=sharding)


def row_bytes(engine: Engine) -> int:
  """Device bytes one row of `engine`'s decode state occupies."""
  return engine.decode_state_bytes() // engine.num_rows


def move_rows(src: Engine, state: DecodeState, dst: Engine,
              row_map: dict[int, int]) -> DecodeState:
  """A `dst` decode state holding rows `row_map` (src row -> dst row).

  The rows' slots keep their position within the row. Host bookkeeping
  moves too: `dst` knows the moved rows as used, `src` is left empty.
  """
  if src.samples_per_row != dst.samples_per_row or src.buckets != dst.buckets:
    raise ValueError("move_rows needs engines with the same rows and buckets")
  idx = np.zeros(dst.num_rows, np.int32)
  valid = np.zeros(dst.num_rows, bool)
  for s_row, d_row in row_map.items():
    idx[d_row], valid[d_row] = s_row, True
  rep = jax.sharding.NamedSharding(src.layout.mesh,
                                   jax.sharding.PartitionSpec())
  gathered = _gather_fn(rep)(state, idx, valid)
  out = jax.device_put(gathered, dst.state_shardings)
  G = src.samples_per_row
  # pylint: disable=protected-access
  dst._row_slots = [set() for _ in range(dst.num_rows)]
  for s_row, d_row in row_map.items():
    dst._row_slots[d_row] = {d_row * G + s % G for s in src._row_slots[s_row]}
  src._row_slots = [set() for _ in src._row_slots]
  dst._state_common_version = dst._common_version
  return out


@functools.lru_cache(maxsize=32)
def _force_fn(state_shardings):
  """Jitted: slot (row, 0) continues from `token` with `generated` done."""

  def force(state: DecodeState, row, token, generated):
    return state.replace(
        tokens=state.tokens.at[row, 0].set(token),
        generated=state.generated.at[row, 0].set(generated),
        active=state.active.at[row, 0].set(True))

  return jax.jit(force, out_shardings=state_shardings, donate_argnums=0)


def reprefill_rows(dst: Engine, params, state: DecodeState,
                   samples: list, rows: list[int]) -> DecodeState:
  """Prefills each live sample again on `dst`, one sample per row.

  Args:
    dst: the target engine (no common prefix: rows hold whole prompts).
    params: its weights.
    state: a `dst` decode state (e.g. from `init_decode_state`).
    samples: `(request, sample_idx, tokens)` of each live sample; the last
      token is sampled but not yet in the cache.
    rows: the free `dst` row of each sample.

  Returns:
    The state; slot 0 of each row continues the sample.
  """
  if dst.max_common_length:
    raise NotImplementedError(
        "re-prefill with a common prefix is not implemented; use move_rows")
  for (req, sample_idx, tokens), row in zip(samples, rows, strict=True):
    prompt = np.concatenate([np.asarray(req.tokens, np.int32),
                             np.asarray(tokens[:-1], np.int32)])
    if prompt.size > dst.max_prefill_length:
      raise ValueError(
          f"re-prefill of prompt {req.prompt_id} sample {sample_idx} needs "
          f"{prompt.size} tokens but the largest prefill bucket is "
          f"{dst.max_prefill_length}; add a bucket >= prompt + max_new_tokens")
    padded, true_len = dst.pad_prompt(prompt, req.prompt_id)
    prefix = dst.prefill_multisampling(
        params, padded, true_len, 1, prompt_id=req.prompt_id, seed=req.seed,
        first_sample_index=sample_idx)
    slot = dst.slots_of_row[row][0]
    state = dst.bulk_insert(prefix, state, [slot])
    state = _force_fn(dst.state_shardings)(
        state, np.int32(row), np.int32(tokens[-1]), np.int32(len(tokens)))
  return state
