"""A JetStream-style decode engine whose rows store each prompt's KV once.

API (mirrors JetStream's Engine, in our own code; the `google-jetstream`
package is not used: its last release is from 2024, it pulls TensorFlow through
seqio and the repository is archived):
  init_decode_state() -> DecodeState
  prefill(params, padded_tokens, true_length, ...) -> Prefix
  prefill_multisampling(params, padded_tokens, true_length, num_samples, ...)
  insert(prefix, state, slot) / bulk_insert(prefix, state, slots) -> state
  generate(params, state) -> (state, ResultTokens)
  free_resource(slot), max_concurrent_decodes, max_prefill_length

Differences from JetStream, on purpose: `bulk_insert` points the G slots of
one row at ONE copy of the prompt KV (JetStream/MaxText copy it into each
slot); slots are grouped in rows of `samples_per_row` so the G queries of a
prompt read its KV in one matmul. A row is reused once all its slots are
freed (a GRPO group is scored as a whole anyway).

Prefill, insert and generate are pure jitted functions of pytrees with
explicit shardings under the engine's layout; the state is donated. Shapes
are static: one compile per prompt bucket for prefill/insert, one for
generate. Host-side bookkeeping (which rows and slots are live) lives in the
Engine object, outside the jitted functions.
"""

from __future__ import annotations

import collections
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.engine.sampling import SamplingParams, sample, token_keys
from rlhf_jax.engine.state import (
    STATE_AXES, DecodeState, Prefix, ResultTokens)
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel.layout import Layout, use_layout


class Engine:
  """Prefill / insert / generate over R rows x G slots on one layout."""

  def __init__(self, cfg: ModelConfig, graphdef, layout: Layout, *,
               num_rows: int, samples_per_row: int,
               prefill_buckets: Sequence[int], sampling: SamplingParams,
               attention_impl: str = "auto"):
    sampling.validate(cfg.vocab_size)
    buckets = tuple(sorted(set(int(b) for b in prefill_buckets)))
    if not buckets or buckets[0] < 1:
      raise ValueError(f"prefill_buckets must be positive, got {prefill_buckets}")
    replicas = layout.mesh.shape["data"]
    if num_rows % replicas:
      raise ValueError(f"num_rows={num_rows} must be divisible by the rollout "
                       f"replicas={replicas}")
    total = buckets[-1] + sampling.max_new_tokens
    if cfg.sliding_window is not None and total > cfg.sliding_window:
      raise NotImplementedError(
          f"decode beyond the sliding window ({cfg.sliding_window}) is not "
          f"implemented; prompt bucket + max_new_tokens = {total}")
    self.cfg, self.graphdef, self.layout = cfg, graphdef, layout
    self.num_rows, self.samples_per_row = num_rows, samples_per_row
    self.buckets, self.sampling = buckets, sampling
    self.attention_impl = attention_impl
    self.trace_counts: collections.Counter = collections.Counter()
    self._row_slots: list[set[int]] = [set() for _ in range(num_rows)]

    _, abstract = model_lib.abstract_params(cfg)
    self.param_shardings = layout.param_shardings(abstract)
    self.state_shardings = DecodeState(**{
        name: layout.sharding(axes, self._state_shape(name))
        for name, axes in STATE_AXES.items()})
    rep = layout.replicated()
    prefix_sh = Prefix(k=rep, v=rep, true_length=rep, first_tokens=rep,
                       first_logp=rep, first_logp_raw=rep)
    self._prefill_jit = jax.jit(
        self._prefill_fn, in_shardings=(self.param_shardings,) + (rep,) * 5,
        out_shardings=prefix_sh)
    self._insert_jit = jax.jit(
        self._insert_fn, in_shardings=(self.state_shardings, prefix_sh) +
        (rep,) * 5, out_shardings=self.state_shardings, donate_argnums=0)
    self._generate_jit = jax.jit(
        self._generate_fn,
        in_shardings=(self.param_shardings, self.state_shardings),
        out_shardings=(self.state_shardings,
                       ResultTokens(layout.sharding(("batch", None)))),
        donate_argnums=1)

  # ---------------------------------------------------------------- shapes
  @property
  def max_concurrent_decodes(self) -> int:
    return self.num_rows * self.samples_per_row

  @property
  def max_prefill_length(self) -> int:
    return self.buckets[-1]

  def _state_shape(self, name):
    c = self.cfg
    L, R, G = c.num_layers, self.num_rows, self.samples_per_row
    P, M = self.max_prefill_length, self.sampling.max_new_tokens
    kv = (L, R, P, c.num_kv_heads, c.head_dim)
    suffix = (L, R, G, M, c.num_kv_heads, c.head_dim)
    return {"prefix_k": kv, "prefix_v": kv, "prefix_len": (R,),
            "suffix_k": suffix, "suffix_v": suffix, "suffix_len": (R, G),
            "tokens": (R, G), "positions": (R, G), "generated": (R, G),
            "active": (R, G), "prompt_id": (R,), "sample_idx": (R, G),
            "seed": (R,)}[name]

  def decode_state_bytes(self) -> int:
    return sum(int(np.prod(self._state_shape(n))) *
               (self.cfg.compute_jnp_dtype(0).itemsize
                if n.startswith(("prefix_k", "prefix_v", "suffix_k",
                                 "suffix_v")) else 4)
               for n in STATE_AXES)

  # ------------------------------------------------------------ validation
  def bucket_for(self, length: int, prompt_id=None) -> int:
    for b in self.buckets:
      if length <= b:
        return b
    raise ValueError(f"prompt {prompt_id} has {length} tokens, longer than the "
                     f"largest prefill bucket {self.buckets[-1]}")

  def pad_prompt(self, tokens, prompt_id=None):
    """Validates a prompt and right-pads it to its bucket."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if tokens.size == 0:
      raise ValueError(f"prompt {prompt_id} is empty")
    bad = tokens[(tokens < 0) | (tokens >= self.cfg.vocab_size)]
    if bad.size:
      raise ValueError(f"prompt {prompt_id} has token ids {bad[:5].tolist()} "
                       f"outside the vocabulary [0, {self.cfg.vocab_size})")
    padded = np.zeros(self.bucket_for(tokens.size, prompt_id), np.int32)
    padded[:tokens.size] = tokens
    return padded, tokens.size

  # ----------------------------------------------------------- jitted fns
  def _prefill_fn(self, params, tokens_P, true_length, prompt_id, seed,
                  sample_idx_G):
    self.trace_counts["prefill"] += 1
    with use_layout(self.layout):
      P = tokens_P.shape[0]
      positions = jnp.arange(P, dtype=jnp.int32)[None]
      mask = positions < true_length
      logits, (k, v) = model_lib.forward(
          self.graphdef, params, tokens_P[None], positions, mask,
          return_kv=True)
      last = jax.lax.dynamic_index_in_dim(logits[0], true_length - 1, 0,
                                          keepdims=False)
      G = sample_idx_G.shape[0]
      keys = token_keys(seed, prompt_id, sample_idx_G, true_length)
      tokens, logp, raw = sample(jnp.broadcast_to(last, (G,) + last.shape),
                                 keys, self.sampling)
      cdt = self.cfg.compute_jnp_dtype
      return Prefix(k=k[:, 0].astype(cdt), v=v[:, 0].astype(cdt),
                    true_length=true_length, first_tokens=tokens,
                    first_logp=logp, first_logp_raw=raw)

  def _insert_fn(self, state: DecodeState, prefix: Prefix, row, slot_mask_G,
                 sample_idx_G, prompt_id, seed):
    self.trace_counts["insert"] += 1
    with use_layout(self.layout):
      k = prefix.k[:, None].astype(state.prefix_k.dtype)
      v = prefix.v[:, None].astype(state.prefix_v.dtype)
      start = (0, row, 0, 0, 0)
      first_done = ((self.sampling.max_new_tokens <= 1)
                    | self._is_stop(prefix.first_tokens))
      G = self.samples_per_row
      set_row = lambda a, x: a.at[row].set(x)
      return state.replace(
          prefix_k=jax.lax.dynamic_update_slice(state.prefix_k, k, start),
          prefix_v=jax.lax.dynamic_update_slice(state.prefix_v, v, start),
          prefix_len=set_row(state.prefix_len, prefix.true_length),
          suffix_len=set_row(state.suffix_len, jnp.zeros(G, jnp.int32)),
          tokens=set_row(state.tokens, prefix.first_tokens),
          positions=set_row(state.positions,
                            jnp.full(G, prefix.true_length, jnp.int32)),
          generated=set_row(state.generated, jnp.ones(G, jnp.int32)),
          active=set_row(state.active, slot_mask_G & ~first_done),
          prompt_id=set_row(state.prompt_id, prompt_id),
          sample_idx=set_row(state.sample_idx, sample_idx_G),
          seed=set_row(state.seed, seed))

  def _generate_fn(self, params, state: DecodeState):
    self.trace_counts["generate"] += 1
    with use_layout(self.layout):
      logits, suffix_k, suffix_v = model_lib.decode(
          self.graphdef, params, state.tokens, state.positions,
          state.prefix_k, state.prefix_v, state.prefix_len, state.suffix_k,
          state.suffix_v, state.suffix_len, attention_impl=self.attention_impl)
      R, G, V = logits.shape
      keys = token_keys(state.seed[:, None], state.prompt_id[:, None],
                        state.sample_idx, state.positions + 1)
      tokens, logp, raw = sample(logits.reshape(R * G, V), keys.reshape(-1),
                                 self.sampling)
      tokens, logp, raw = (x.reshape(R, G) for x in (tokens, logp, raw))
      valid = state.active
      step = valid.astype(jnp.int32)
      generated = state.generated + step
      done = valid & (self._is_stop(tokens)
                      | (generated >= self.sampling.max_new_tokens))
      new_state = state.replace(
          suffix_k=suffix_k, suffix_v=suffix_v,
          suffix_len=state.suffix_len + step,
          tokens=jnp.where(valid, tokens, state.tokens),
          positions=state.positions + step,
          generated=generated, active=valid & ~done)
      result = ResultTokens.pack(tokens, valid, done, generated, logp, raw)
      return new_state, result

  def _is_stop(self, tokens):
    stops = jnp.asarray(self.sampling.stop_tokens or (-1,), jnp.int32)
    return jnp.any(tokens[..., None] == stops, axis=-1)

  # ------------------------------------------------------------ public API
  def init_decode_state(self) -> DecodeState:
    cdt = self.cfg.compute_jnp_dtype

    def init():
      fields = {}
      for name in STATE_AXES:
        shape = self._state_shape(name)
        dtype = (cdt if name in ("prefix_k", "prefix_v", "suffix_k",
                                 "suffix_v")
                 else bool if name == "active"
                 else jnp.uint32 if name == "seed" else jnp.int32)
        fields[name] = jnp.zeros(shape, dtype)
      return DecodeState(**fields)

    self._row_slots = [set() for _ in range(self.num_rows)]
    return jax.jit(init, out_shardings=self.state_shardings)()

  def prefill(self, params, padded_tokens, true_length, *, prompt_id=0,
              seed=0) -> Prefix:
    return self.prefill_multisampling(params, padded_tokens, true_length, 1,
                                      prompt_id=prompt_id, seed=seed)

  def prefill_multisampling(self, params, padded_tokens, true_length,
                            num_samples, *, prompt_id=0, seed=0,
                            first_sample_index=0) -> Prefix:
    """Runs the prompt once and draws `num_samples` first tokens from it."""
    if not 1 <= num_samples <= self.samples_per_row:
      raise ValueError(
          f"prompt {prompt_id} asks for num_samples={num_samples}; this engine "
          f"holds 1..{self.samples_per_row} samples per prompt row "
          f"(max_concurrent_decodes={self.max_concurrent_decodes})")
    padded_tokens = np.asarray(padded_tokens, np.int32)
    if padded_tokens.shape[0] not in self.buckets:
      raise ValueError(f"prompt {prompt_id}: padded length "
                       f"{padded_tokens.shape[0]} is not a bucket {self.buckets}")
    indices = tuple(range(first_sample_index, first_sample_index + num_samples))
    sample_idx = np.zeros(self.samples_per_row, np.int32)
    sample_idx[:num_samples] = indices
    prefix = self._prefill_jit(params, padded_tokens, np.int32(true_length),
                               np.int32(prompt_id), np.uint32(seed), sample_idx)
    return prefix.replace(prompt_id=int(prompt_id), sample_indices=indices,
                          seed=int(seed))

  def free_rows(self) -> list[int]:
    return [r for r, slots in enumerate(self._row_slots) if not slots]

  def bulk_insert(self, prefix: Prefix, state: DecodeState,
                  slots: Sequence[int]) -> DecodeState:
    """Points `slots` (all in one free row) at one copy of the prompt's KV."""
    G = self.samples_per_row
    slots = list(slots)
    rows = {s // G for s in slots}
    if len(rows) != 1 or len(set(slots)) != len(slots):
      raise ValueError(f"prompt {prefix.prompt_id}: slots {slots} must be "
                       f"distinct slots of one row (rows of {G} slots)")
    if len(slots) != len(prefix.sample_indices):
      raise ValueError(f"prompt {prefix.prompt_id}: {len(slots)} slots for "
                       f"{len(prefix.sample_indices)} samples")
    row = rows.pop()
    if not 0 <= row < self.num_rows:
      raise ValueError(f"slots {slots} are outside [0, {self.max_concurrent_decodes})")
    if self._row_slots[row]:
      raise ValueError(f"row {row} is still in use by slots "
                       f"{sorted(self._row_slots[row])}")
    mask = np.zeros(G, bool)
    sample_idx = np.zeros(G, np.int32)
    for s, i in zip(slots, prefix.sample_indices):
      mask[s % G] = True
      sample_idx[s % G] = i
    self._row_slots[row] = set(slots)
    # Host metadata is static pytree data: strip it so one compile serves all.
    arrays = prefix.replace(prompt_id=0, sample_indices=(), seed=0)
    return self._insert_jit(state, arrays, np.int32(row), mask, sample_idx,
                            np.int32(prefix.prompt_id), np.uint32(prefix.seed))

  def insert(self, prefix: Prefix, state: DecodeState, slot: int):
    return self.bulk_insert(prefix, state, [slot])

  def generate(self, params, state: DecodeState):
    return self._generate_jit(params, state)

  def free_resource(self, slot: int) -> None:
    """Releases a finished slot; its row frees when all its slots are free."""
    self._row_slots[slot // self.samples_per_row].discard(slot)

  @functools.cached_property
  def slots_of_row(self):
    G = self.samples_per_row
    return [list(range(r * G, (r + 1) * G)) for r in range(self.num_rows)]
