"""The engine's ops that append to or move a sequence's KV.

Plain functions over an `engine.Engine` and its donated `DecodeState`
(the engine holds the jitted `*_fn`s, its shardings and bucket rules);
each op is one jitted call:
  extend(engine, params, state, slot, pages, tokens)  KV of tokens appended
                                                to a live sample (multi-turn)
  prefill_chunk(engine, params, state, entry, ...)    one chunk of a long
                                                      prompt
  recompute(engine, params, state, entry, samples)    KV of restarted
                                  samples of a group (preemption, a move)
  gather_kv(engine, state, page lists)      a move's source pages, dense
  place(engine, state, samples, k, v)       restarted samples continue
                                            with given KV (a move's end)
  adopt_state(engine, src, state)           a bigger engine's state on
                                            this engine's replicas
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.engine.state import (
    DecodeState, dense_context, pow2_at_least, write_tokens)
from rlhf_jax.engine.sampling import sample, token_keys
from rlhf_jax.models import model as model_lib
from rlhf_jax.parallel import submesh
from rlhf_jax.parallel.layout import use_layout


def adopt_state(engine, src, state: DecodeState) -> DecodeState:
  """`src`'s decode state (an engine on more replicas: this one's first,
  the same blocks per replica) seen on this engine's replicas without a
  copy: their slots, groups and pages as they are; the other replicas'
  are dropped. Takes `src`'s common prefix too."""
  engine.copy_common_prefix(src)
  engine._state_common_version = engine._common_version
  fields = engine._fields()
  return DecodeState(**{
      name: submesh.view(getattr(state, name),
                         getattr(engine.state_shardings, name),
                         fields[name][1]) for name in fields})


def _attend_after(engine, params, state: DecodeState, feed_E, pos0, count,
                  pieces, return_routes: bool = False):
  """Runs feed_E[:count] at positions pos0.. after a context (the common
  prefix, then each (page ids, length) piece: `dense_context`). Returns
  the logits of the last fed token [V] and the fed tokens' KV
  [L, E, N, K] (and with `return_routes` their experts [E, L, k])."""
  ck, cv, total = dense_context(state, pieces)
  index = jnp.arange(feed_E.shape[0], dtype=jnp.int32)
  logits, (k, v), *routes = model_lib.prefill(
      engine.graphdef, params, feed_E[None], (pos0 + index)[None],
      (index < count)[None], (count - 1)[None], context=(ck, cv, total),
      return_routes=return_routes)
  return (logits[0], k[:, 0], v[:, 0], *(r[0] for r in routes))


def extend_fn(engine, params, state: DecodeState, slot, own_row_B,
              tokens_E, count, active):
  """Appends `count` tokens to a sample: the token it feeds now and
  tokens_E[:count-1] get KV in its pages (attending to the common prefix,
  its prompt and its own tokens); tokens_E[count-1] is fed next. Returns
  the state and, if the engine records them, the fed tokens' experts
  [E, L, k] (else None)."""
  engine.trace_counts["extend"] += 1
  with use_layout(engine.layout):
    g = state.slot_group[slot]
    o_len = state.own_len[slot]
    feed = jnp.concatenate([state.tokens[slot][None], tokens_E[:-1]])
    _, k, v, *routes = _attend_after(
        engine, params, state, feed, state.positions[slot], count,
        [(state.group_pages[g], state.group_len[g]), (own_row_B, o_len)],
        return_routes=engine.record_routes)
    state = write_tokens(state, own_row_B, o_len, count, k, v)
    return state.replace(
        own_pages=state.own_pages.at[slot].set(own_row_B),
        own_len=state.own_len.at[slot].add(count),
        tokens=state.tokens.at[slot].set(tokens_E[count - 1]),
        positions=state.positions.at[slot].add(count),
        generated=state.generated.at[slot].add(count),
        active=state.active.at[slot].set(active)), (
            routes[0] if routes else None)


def recompute_fn(engine, params, state: DecodeState, entry, slots_X,
                 own_rows_XxB, feed_XxE, counts_X, next_X) -> DecodeState:
  """Several just-started samples of group `entry` get back the KV of
  their tokens so far in one call: row x feeds feed_XxE[x, :counts_X[x]]
  (its first token onwards) after the common prefix and the group's
  prompt (shared by the rows), then `place_fn`. Padding rows: slot S."""
  engine.trace_counts["recompute"] += 1
  with use_layout(engine.layout):
    sl = jnp.minimum(slots_X, state.active.shape[0] - 1)
    E = feed_XxE.shape[1]
    ck, cv, total = dense_context(
        state, [(state.group_pages[entry], state.group_len[entry])])
    index = jnp.arange(E, dtype=jnp.int32)
    pos = state.positions[sl][:, None] + index[None]
    _, (k, v) = model_lib.prefill(
        engine.graphdef, params, feed_XxE, pos, index[None] < counts_X[:, None],
        jnp.maximum(counts_X - 1, 0), context=(ck, cv, total))
    return place_fn(engine, state, slots_X, own_rows_XxB, k, v, counts_X,
                    next_X)


def place_fn(engine, state: DecodeState, slots_X, own_rows_XxB, k_LxXxExNxK,
             v_LxXxExNxK, counts_X, next_X) -> DecodeState:
  """Just-started samples continue after `counts_X` tokens whose KV is
  given (dense per sample): the KV goes into their own pages, each feeds
  next_X next, and each is active. Padding rows: slot S."""
  engine.trace_counts["place"] += 1
  S = state.active.shape[0]
  sl = jnp.minimum(slots_X, S - 1)
  X, E = k_LxXxExNxK.shape[1:3]
  T, num_pages = engine.page_size, state.k_pages.shape[2]
  index = jnp.arange(E, dtype=jnp.int32)
  page = jnp.take_along_axis(
      own_rows_XxB, jnp.minimum(index[None] // T, own_rows_XxB.shape[1] - 1)
      .repeat(X, axis=0), axis=1)
  page = jnp.where((index[None] < counts_X[:, None]) & (slots_X < S)[:, None],
                   page, num_pages)                            # [X, E]
  put = lambda pages, x: pages.at[:, :, page, index % T].set(
      x[:, :, :E].transpose(0, 3, 1, 2, 4).astype(pages.dtype), mode="drop")
  at = lambda a, x: a.at[slots_X].set(x, mode="drop")
  return state.replace(
      k_pages=put(state.k_pages, k_LxXxExNxK),
      v_pages=put(state.v_pages, v_LxXxExNxK),
      own_pages=at(state.own_pages, own_rows_XxB),
      own_len=at(state.own_len, state.own_len[sl] + counts_X),
      tokens=at(state.tokens, next_X),
      positions=at(state.positions, state.positions[sl] + counts_X),
      generated=at(state.generated, state.generated[sl] + counts_X),
      # They continue even if their first token was a stop (a multi-turn
      # sample's end of turn, which `start` deactivated).
      active=at(state.active, jnp.ones_like(slots_X, bool)))


def gather_fn(engine, state: DecodeState, rows_XxA):
  """The KV of the pages of each row of `rows_XxA`, dense per row:
  (k, v) [L, X, A*T, N, K] (a move's source)."""
  def dense(pages):  # [L, N, X, A, T, K] -> [L, X, A*T, N, K]
    x = pages[:, :, rows_XxA]
    L, N, X, A, T, K = x.shape
    return x.transpose(0, 2, 3, 4, 1, 5).reshape(L, X, A * T, N, K)
  return dense(state.k_pages), dense(state.v_pages)


def prompt_chunk_fn(engine, params, state: DecodeState, entry, prompt_row_A,
                    tokens_E, start, count, sample_idx_G):
  """Chunked prefill: tokens start..start+count of group `entry`'s prompt
  (its first `start` already in its pages `prompt_row_A`) attend to the
  common prefix and the prompt so far; their KV goes to its pages, and G
  first tokens are drawn after them (the last chunk's are the group's)."""
  engine.trace_counts["prompt_chunk"] += 1
  with use_layout(engine.layout):
    c_len = state.common_len
    logits, k, v = _attend_after(
        engine, params, state, tokens_E, c_len + start, count,
        [(prompt_row_A, start)])
    state = write_tokens(state, prompt_row_A, start, count, k, v)
    G = sample_idx_G.shape[0]
    keys = token_keys(state.group_seed[entry], state.group_prompt_id[entry],
                      sample_idx_G, c_len + start + count)
    first = sample(jnp.broadcast_to(logits, (G,) + logits.shape), keys,
                   engine.sampling)
    return state.replace(
        group_pages=state.group_pages.at[entry].set(prompt_row_A),
        group_len=state.group_len.at[entry].set(start + count),
        group_first=state.group_first.at[entry].set(first[0])), first


def extend(engine, params, state: DecodeState, slot: int, own_row,
           tokens, *, active: bool = True):
  """Appends `tokens` to the live sample in `slot`: the token it feeds
  now and tokens[:-1] get KV (own pages `own_row`, covering the new
  length); tokens[-1] is fed by the next step. Returns (the state, the
  fed tokens' experts [n, L, k] on the device if the engine records them,
  padded to a power of two: the first len(tokens) rows; else None)."""
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  if not tokens.size:
    raise ValueError("extend needs at least one token")
  E = pow2_at_least(tokens.size, 1 << 30)
  padded = np.zeros(E, np.int32)
  padded[:tokens.size] = tokens
  row = np.zeros(engine.max_own_pages, np.int32)
  row[:len(own_row)] = own_row
  return engine._extend_jit(params, state, np.int32(slot), row, padded,
                            np.int32(tokens.size), np.bool_(active))


def recompute(engine, params, state: DecodeState, entry: int,
              samples) -> DecodeState:
  """Recomputes the KV of samples of group `entry` just started again
  (`start`, after a preemption or a consolidation) in one call:
  `samples` are (slot, own page ids covering its tokens, its tokens so
  far: 2 or more). Each continues after its last token, as if it had
  never stopped."""
  X = pow2_at_least(len(samples), engine.num_slots)
  E = pow2_at_least(max(len(t) for _, _, t in samples) - 1, 1 << 30)
  slots = np.full(X, engine.num_slots, np.int32)
  rows = np.zeros((X, engine.max_own_pages), np.int32)
  feed = np.zeros((X, E), np.int32)
  counts, nxt = np.zeros(X, np.int32), np.zeros(X, np.int32)
  for x, (slot, pages, tokens) in enumerate(samples):
    slots[x], counts[x], nxt[x] = slot, len(tokens) - 1, tokens[-1]
    rows[x, :len(pages)] = pages
    feed[x, :len(tokens) - 1] = tokens[:-1]
  return engine._recompute_jit(params, state, np.int32(entry), slots, rows,
                               feed, counts, nxt)


def gather_kv(engine, state: DecodeState, page_lists):
  """The KV of each list of page ids, dense per list and replicated:
  (k, v) [L, X, A*T, N, K], A the longest list (a move's source; read
  it before a later op donates `state`)."""
  A = max(1, max(map(len, page_lists)))
  rows = np.zeros((len(page_lists), A), np.int32)
  for x, pages in enumerate(page_lists):
    rows[x, :len(pages)] = pages
  return engine._gather_jit(state, rows)


def place(engine, state: DecodeState, samples, k, v) -> DecodeState:
  """Samples just started again (`start`) continue with the KV of their
  tokens given (`gather_kv` of their old pages, moved here): `samples`
  are (slot, own page ids, tokens so far: 2 or more); k, v
  [L, X, E', N, K] cover each one's first len(tokens) - 1 tokens."""
  X = len(samples)
  rep = engine.layout.replicated()
  k, v = jax.device_put((k, v), rep)
  slots = np.array([s for s, _, _ in samples], np.int32)
  rows = np.zeros((X, engine.max_own_pages), np.int32)
  counts, nxt = np.zeros(X, np.int32), np.zeros(X, np.int32)
  for x, (_, pages, tokens) in enumerate(samples):
    rows[x, :len(pages)] = pages
    counts[x], nxt[x] = len(tokens) - 1, tokens[-1]
  return engine._place_jit(state, slots, rows, k, v, counts, nxt)


def prefill_chunk(engine, params, state: DecodeState, entry: int, pages,
                  tokens, start: int, sample_indices):
  """Prefills tokens start.. of group `entry`'s prompt (after its first
  `start` tokens, already in its pages) into `pages` (the group's whole
  page list); returns (state, (first tokens, logp, raw) [G]) drawn after
  them. Chunks are one bucket long at most (one compile per bucket)."""
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  padded = np.zeros(engine.bucket_for(tokens.size), np.int32)
  padded[:tokens.size] = tokens
  row = np.zeros(engine.max_prompt_pages, np.int32)
  row[:len(pages)] = pages
  idx = np.zeros(engine.samples_per_group, np.int32)
  idx[:len(sample_indices)] = sample_indices
  return engine._prompt_chunk_jit(params, state, np.int32(entry), row,
                                  padded, np.int32(start),
                                  np.int32(tokens.size), idx)
