"""Moving live decode rows from one engine onto a smaller one.

Two ways, same tokens (sampling keys depend on seed, prompt, sample index
and position, never on placement):
  move_rows      the rows that change replica travel to their target
                 row (collective permutes over the replicas), the others
                 stay where they are, and the target's state is a view of
                 its replicas' shards;
  reprefill_rows each live sample is prefilled again on the target, its
                 prompt extended by the tokens it already generated, into a
                 row of its own; then its pending token and count are set.
The target engine has the same per-device shapes as the source (rows per
replica, buckets, cache lengths), so decode is the same computation on it.
"""

from __future__ import annotations

import collections
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


def row_bytes(engine: Engine) -> int:
  """Device bytes one row of `engine`'s decode state occupies."""
  return engine.decode_state_bytes() // engine.num_rows


def move_rows(src: Engine, state: DecodeState, dst: Engine,
              row_map: dict[int, int]) -> DecodeState:
  """A `dst` decode state holding rows `row_map` (src row -> dst row).

  The rows' slots keep their position within the row. Host bookkeeping
  moves too: `dst` knows the moved rows as used, `src` is left empty.
  `state` is donated.
  """
  if src.samples_per_row != dst.samples_per_row or src.buckets != dst.buckets:
    raise ValueError("move_rows needs engines with the same rows and buckets")
  # `dst` decodes on `src`'s first replicas with the same rows per replica,
  # so its row r sits where `src`'s row r does: with every row of `row_map`
  # moved to its target row in a state of `src`'s shape and sharding, each
  # device's part of `dst`'s state is a block it already holds (a view).
  # Only the rows that change replica travel, each to its target replica
  # alone: a device holds its share and the rows it sends and receives.
  # (A gather of rows across replicas makes XLA gather the whole state on
  # every device.)
  replicas = src.layout.mesh.shape["data"]
  shifts, send, recv, valid = _exchange_plan(row_map, replicas,
                                             src.num_rows // replicas)
  moved = _exchange_fn(src.state_shardings, src.layout.mesh, shifts)(
      state, send, recv, valid)
  out = DecodeState(**{
      name: submesh.view(getattr(moved, name),
                         getattr(dst.state_shardings, name),
                         dst.state_shape(name)) for name in STATE_AXES})
  G = src.samples_per_row
  dst.copy_common_prefix(src)  # The state carries the common KV along.
  dst.adopt({d_row: {d_row * G + s % G for s in src.slots_in_use(s_row)}
             for s_row, d_row in row_map.items()})
  src.release_all()
  return out


def _exchange_plan(row_map: dict[int, int], replicas: int, per: int):
  """Host arrays of a row exchange among `replicas` of `per` rows each,
  one step per shift d (replica a sends to a + d mod R):
  shifts (d, k_d) with k_d the most rows one replica sends in that step (a
  power of two: a few programs), send [R, sum k_d] (replica a's local rows
  for each step), recv [R, sum k_d] (replica b's local target rows for what
  it receives; `per` pads: dropped), valid [R, per] (the local rows live
  after the move)."""
  by_shift = collections.defaultdict(lambda: collections.defaultdict(list))
  valid = np.zeros((replicas, per), bool)
  for s_row, d_row in sorted(row_map.items()):
    a, b = s_row // per, d_row // per
    valid[b, d_row % per] = True
    if s_row != d_row:
      by_shift[(b - a) % replicas][a].append((s_row % per, d_row % per))
  shifts = tuple((d, 1 << (max(map(len, rows.values())) - 1).bit_length())
                 for d, rows in sorted(by_shift.items()))
  width = sum(k for _, k in shifts)
  send = np.zeros((replicas, width), np.int32)
  recv = np.full((replicas, width), per, np.int32)
  at = 0
  for d, k in shifts:
    for a, rows in by_shift[d].items():
      for j, (s_local, d_local) in enumerate(rows):
        send[a, at + j], recv[(a + d) % replicas, at + j] = s_local, d_local
    at += k
  return shifts, send, recv, valid


@functools.lru_cache(maxsize=32)
def _exchange_fn(shardings: DecodeState, mesh, shifts: tuple):
  """Jitted: for each shift (d, k), every replica sends its k rows of
  `send` to replica + d (a collective permute over "data") and writes what
  it receives at `recv`; rows `valid` stay active."""
  P = jax.sharding.PartitionSpec
  specs = jax.tree.map(lambda s: s.spec, shardings)
  replicas = mesh.shape["data"]

  def local(state: DecodeState, send, recv, valid):
    out = {}
    for name in STATE_AXES:
      x = getattr(state, name)
      axis = _row_axis(name)
      at = 0
      for d, k in shifts if axis is not None else ():
        sent = jnp.take(x, send[0, at:at + k], axis=axis)
        got = jax.lax.ppermute(sent, "data", [(a, (a + d) % replicas)
                                              for a in range(replicas)])
        x = x.at[(slice(None),) * axis + (recv[0, at:at + k],)].set(
            got, mode="drop")
        at += k
      out[name] = x
    out["active"] = out["active"] & valid[0][:, None]
    return DecodeState(**out)

  exchange = jax.shard_map(
      local, mesh=mesh, in_specs=(specs, P("data"), P("data"), P("data")),
      out_specs=specs, check_vma=False)
  return jax.jit(exchange, out_shardings=shardings, donate_argnums=0)


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
