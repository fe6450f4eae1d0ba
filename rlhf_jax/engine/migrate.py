"""Moving live decode rows from one engine onto a smaller one.

Two ways, same tokens (sampling keys depend on seed, prompt, sample index
and position, never on placement):
  move_rows      the rows' KV and counters are gathered on the source
                 engine, in place for the target's rows on its first
                 replicas, and the target's state is a view of those
                 replicas' shards (no copy leaves a device);
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
from rlhf_jax.parallel import submesh


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
  # `dst` decodes on `src`'s first replicas with the same rows per replica,
  # so its row r sits where `src`'s row r does. Gathered into a state of
  # `src`'s shape and sharding, its rows are in place, and each device's
  # part of `dst`'s state is a block it already holds: a view, no copy.
  # The peak is twice a device's share of the state (a replicated gather
  # put it whole on every device).
  idx = np.zeros(src.num_rows, np.int32)
  valid = np.zeros(src.num_rows, bool)
  for s_row, d_row in row_map.items():
    idx[d_row], valid[d_row] = s_row, True
  gathered = _gather_fn(src.state_shardings)(state, idx, valid)
  out = DecodeState(**{
      name: submesh.view(getattr(gathered, name),
                         getattr(dst.state_shardings, name),
                         dst.state_shape(name)) for name in STATE_AXES})
  G = src.samples_per_row
  dst.copy_common_prefix(src)  # The state carries the common KV along.
  dst.adopt({d_row: {d_row * G + s % G for s in src.slots_in_use(s_row)}
             for s_row, d_row in row_map.items()})
  src.release_all()
  return out


def move_decode(state: DecodeState, src: Engine, dst: Engine) -> DecodeState:
  """Moves a live decode state from engine `src` to engine `dst`.

  Both engines must have the same rows, samples per row, cache lengths and
  sampling; only their layouts differ (e.g. a sub-mesh and the merged
  mesh). The rows in use move with the state, so `dst` continues every
  in-flight sample and `src` is left empty.
  """
  same = (src.num_rows == dst.num_rows
          and src.samples_per_row == dst.samples_per_row
          and src.buckets == dst.buckets and src.sampling == dst.sampling
          and src.cfg == dst.cfg)
  if not same:
    raise ValueError("move_decode needs engines that differ only in layout")
  out = submesh.move(state, dst.state_shardings)
  dst.copy_common_prefix(src)
  dst.adopt({r: set(src.slots_in_use(r)) for r in range(src.num_rows)})
  src.release_all()
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
    dst: the target engine; with a common prefix set, each sample's
      tokens after it are prefilled (they attend to its KV).
    params: its weights.
    state: a `dst` decode state (e.g. from `init_decode_state`).
    samples: `(request, sample_idx, tokens)` of each live sample; the last
      token is sampled but not yet in the cache.
    rows: the free `dst` row of each sample.

  Returns:
    The state; slot 0 of each row continues the sample.
  """
  common = dst.common_prefix_tokens.size
  for (req, sample_idx, tokens), row in zip(samples, rows, strict=True):
    prompt = np.concatenate([np.asarray(req.tokens, np.int32)[common:],
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
