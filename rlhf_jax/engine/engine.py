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
  set_common_prefix(params, tokens) / clear_common_prefix()

Differences from JetStream, on purpose: `bulk_insert` points the G slots of
one row at ONE copy of the prompt KV (JetStream/MaxText copy it into each
slot); slots are grouped in rows of `samples_per_row` so the G queries of a
prompt read its KV in one matmul. A row is reused once all its slots are
freed (a GRPO group is scored as a whole anyway).

Two-level sharing (RLHFless's deduplicated prefill): with
`max_common_length > 0`, `set_common_prefix` prefills a prefix common to a
batch of prompts ONCE; `init_decode_state` stores its KV once for all rows,
and later prefills take only the tokens after it (they attend to it as
context, positions offset by its length). Decode attends to it as a third
part merged by log-sum-exp. A version number ties prefills and decode states
to the common prefix they were built with; mixing them raises.

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
    STATE_AXES, CommonPrefix, DecodeState, Prefix, ResultTokens)
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel.layout import Layout, use_layout

_KV_FIELDS = ("prefix_k", "prefix_v", "suffix_k", "suffix_v", "common_k",
              "common_v")


class EngineBase:
  """What every decode engine shares: the model, the rollout layout, the
  prompt buckets and their validation, the sampling rule, and the common
  prefix prefilled once and held as one dense copy for all prompts.

  Subclasses store their decode state their own way (`Engine`: prompt rows
  x G slots; `paged.PagedEngine`: a page pool)."""

  def __init__(self, cfg: ModelConfig, graphdef, layout: Layout, *,
               prefill_buckets: Sequence[int], sampling: SamplingParams,
               attention_impl: str = "auto", max_common_length: int = 0):
    sampling.validate(cfg.vocab_size)
    if max_common_length < 0:
      raise ValueError(
          f"max_common_length must be >= 0, got {max_common_length}")
    buckets = tuple(sorted(set(int(b) for b in prefill_buckets)))
    if not buckets or buckets[0] < 1:
      raise ValueError(f"prefill_buckets must be positive, got {prefill_buckets}")
    self.cfg, self.graphdef, self.layout = cfg, graphdef, layout
    self.buckets, self.sampling = buckets, sampling
    self.attention_impl = attention_impl
    self.max_common_length = int(max_common_length)
    self.trace_counts: collections.Counter = collections.Counter()
    self._common_tokens = np.zeros(0, np.int32)
    self._common: CommonPrefix | None = None
    self._empty_common: CommonPrefix | None = None  # Built on first use.
    self._common_version = 0
    self._state_common_version = 0
    _, abstract = model_lib.abstract_params(cfg)
    self.param_shardings = layout.param_shardings(abstract)
    rep = layout.replicated()
    common_kv = layout.sharding(STATE_AXES["common_k"],
                                self._common_kv_shape())
    self._common_shardings = CommonPrefix(k=common_kv, v=common_kv,
                                          length=rep)
    self._common_prefill_jit = jax.jit(
        self._common_prefill_fn,
        in_shardings=(self.param_shardings, rep, rep),
        out_shardings=self._common_shardings)

  def _common_kv_shape(self):
    c = self.cfg
    return (c.num_layers, self.max_common_length, c.num_kv_heads, c.head_dim)

  @property
  def max_prefill_length(self) -> int:
    return self.buckets[-1]

  @property
  def common_prefix_tokens(self) -> np.ndarray:
    """The common prefix set on the engine (empty if none)."""
    return self._common_tokens.copy()

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

  def _common_prefill_fn(self, params, tokens_C, length) -> CommonPrefix:
    self.trace_counts["common_prefill"] += 1
    with use_layout(self.layout):
      index = jnp.arange(tokens_C.shape[0], dtype=jnp.int32)[None]
      _, (k, v) = model_lib.prefill(
          self.graphdef, params, tokens_C[None], index, index < length,
          jnp.zeros((1,), jnp.int32))
      cdt = self.cfg.compute_jnp_dtype
      return CommonPrefix(k=k[:, 0].astype(cdt), v=v[:, 0].astype(cdt),
                          length=length)

  def set_common_prefix(self, params, tokens) -> CommonPrefix:
    """Prefills a prefix common to the prompts that follow, once.

    Later `prefill*` calls take only the tokens after it, and decode states
    from later `init_decode_state` calls hold its KV once for all rows.
    Rows of an older state keep decoding against the old common prefix, but
    inserting a new prefill into it raises (see `bulk_insert`).

    Args:
      params: the weights (rollout layout).
      tokens: 1-D common token ids, at most `max_common_length`.

    Returns:
      The prefilled `CommonPrefix` (the engine keeps it).
    """
    tokens = self.check_common_prefix(tokens)
    padded = np.zeros(self.max_common_length, np.int32)
    padded[:tokens.size] = tokens
    self._common = self._common_prefill_jit(params, padded,
                                            np.int32(tokens.size))
    self._common_tokens = tokens.copy()
    self._common_version += 1
    return self._common

  def check_common_prefix(self, tokens) -> np.ndarray:
    """Validates a common prefix for this engine; returns it as int32."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if not self.max_common_length:
      raise ValueError(
          "this engine stores no common prefix (max_common_length=0); build "
          f"it with max_common_length >= {tokens.size} to share one")
    if not tokens.size:
      raise ValueError("common prefix is empty; use clear_common_prefix()")
    if tokens.size > self.max_common_length:
      raise ValueError(
          f"common prefix has {tokens.size} tokens, longer than this engine's "
          f"max_common_length={self.max_common_length}")
    bad = tokens[(tokens < 0) | (tokens >= self.cfg.vocab_size)]
    if bad.size:
      raise ValueError(f"common prefix has token ids {bad[:5].tolist()} "
                       f"outside the vocabulary [0, {self.cfg.vocab_size})")
    return tokens

  def copy_common_prefix(self, other: "EngineBase") -> None:
    """Holds `other`'s common prefix (its KV moved onto this engine's
    devices, no prefill): a decode state migrated from `other` keeps its
    rows, and later prefills here attend to the same tokens."""
    if other.max_common_length != self.max_common_length:
      raise ValueError("engines with different max_common_length")
    if other._common is None:  # pylint: disable=protected-access
      self.clear_common_prefix()
      return
    self._common = jax.device_put(other._common, self._common_shardings)  # pylint: disable=protected-access
    self._common_tokens = other.common_prefix_tokens
    self._common_version += 1

  def clear_common_prefix(self) -> None:
    """Prompts that follow are whole again (no common prefix)."""
    if self._common is None:
      return
    self._common, self._common_tokens = None, np.zeros(0, np.int32)
    self._common_version += 1

  def _common_or_empty(self) -> CommonPrefix:
    """The current common prefix, or an all-masked one (length 0)."""
    if self._common is not None:
      return self._common
    if self._empty_common is None:
      kv = np.zeros(self._common_kv_shape(), self.cfg.compute_jnp_dtype)
      self._empty_common = jax.device_put(
          CommonPrefix(k=kv, v=kv, length=np.int32(0)), self._common_shardings)
    return self._empty_common

  def _is_stop(self, tokens):
    stops = jnp.asarray(self.sampling.stop_tokens or (-1,), jnp.int32)
    return jnp.any(tokens[..., None] == stops, axis=-1)


class Engine(EngineBase):
  """Prefill / insert / generate over R rows x G slots on one layout."""

  def __init__(self, cfg: ModelConfig, graphdef, layout: Layout, *,
               num_rows: int, samples_per_row: int,
               prefill_buckets: Sequence[int], sampling: SamplingParams,
               attention_impl: str = "auto", max_common_length: int = 0):
    """Builds the jitted functions; nothing is compiled until first use.

    Args:
      cfg: the model.
      graphdef: its static graph (`model_lib.abstract_params`).
      layout: rollout layout (rows split over its "data" axis).
      num_rows: R prompt rows; a multiple of the layout's replicas.
      samples_per_row: G slots per row.
      prefill_buckets: padded prompt lengths (after the common prefix, if
        one is set); the largest is the prompt-row capacity P.
      sampling: how tokens are drawn.
      attention_impl: "auto" | "xla" | "pallas" for decode attention.
      max_common_length: capacity C of the common prefix stored once for all
        rows (0: no common prefix).
    """
    super().__init__(cfg, graphdef, layout, prefill_buckets=prefill_buckets,
                     sampling=sampling, attention_impl=attention_impl,
                     max_common_length=max_common_length)
    replicas = layout.mesh.shape["data"]
    if num_rows % replicas:
      raise ValueError(f"num_rows={num_rows} must be divisible by the rollout "
                       f"replicas={replicas}")
    self.num_rows, self.samples_per_row = num_rows, samples_per_row
    self._row_slots: list[set[int]] = [set() for _ in range(num_rows)]
    self._init_jit = None
    self.state_shardings = DecodeState(**{
        name: layout.sharding(axes, self.state_shape(name))
        for name, axes in STATE_AXES.items()})
    rep = layout.replicated()
    prefix_sh = Prefix(k=rep, v=rep, true_length=rep, first_tokens=rep,
                       first_logp=rep, first_logp_raw=rep)
    common_sh = self._common_shardings
    self._prefill_jit = jax.jit(
        self._prefill_fn,
        in_shardings=(self.param_shardings,) + (rep,) * 5 + (common_sh,),
        out_shardings=prefix_sh)
    self._set_common_jit = jax.jit(
        lambda state, common: state.replace(
            common_k=common.k, common_v=common.v, common_len=common.length),
        in_shardings=(self.state_shardings, common_sh),
        out_shardings=self.state_shardings, donate_argnums=0)
    self._insert_jit = jax.jit(
        self._insert_fn, in_shardings=(self.state_shardings, prefix_sh) +
        (rep,) * 5, out_shardings=self.state_shardings, donate_argnums=0)
    self._generate_jit = jax.jit(
        self._generate_fn,
        in_shardings=(self.param_shardings, self.state_shardings),
        # The packed result is replicated (a few bytes per slot): every host
        # reads all of it, so multi-host drivers take the same decisions.
        out_shardings=(self.state_shardings, ResultTokens(rep)),
        donate_argnums=1)

  # ---------------------------------------------------------------- shapes
  @property
  def max_concurrent_decodes(self) -> int:
    return self.num_rows * self.samples_per_row

  def state_shape(self, name):
    c = self.cfg
    L, R, G = c.num_layers, self.num_rows, self.samples_per_row
    P, M = self.max_prefill_length, self.sampling.max_new_tokens
    kv = (L, R, P, c.num_kv_heads, c.head_dim)
    suffix = (L, R, G, M, c.num_kv_heads, c.head_dim)
    return {"prefix_k": kv, "prefix_v": kv, "prefix_len": (R,),
            "suffix_k": suffix, "suffix_v": suffix, "suffix_len": (R, G),
            "tokens": (R, G), "positions": (R, G), "generated": (R, G),
            "active": (R, G), "prompt_id": (R,), "sample_idx": (R, G),
            "seed": (R,),
            "common_k": (L, self.max_common_length, c.num_kv_heads,
                         c.head_dim),
            "common_v": (L, self.max_common_length, c.num_kv_heads,
                         c.head_dim),
            "common_len": ()}[name]

  def decode_state_bytes(self) -> int:
    """Bytes of the decode state (KV in the compute dtype, the rest 4)."""
    return sum(int(np.prod(self.state_shape(n))) *
               (self.cfg.compute_jnp_dtype(0).itemsize
                if n in _KV_FIELDS else 4)
               for n in STATE_AXES)

  # ----------------------------------------------------------- jitted fns
  def _prefill_fn(self, params, tokens_P, true_length, prompt_id, seed,
                  sample_idx_G, common: CommonPrefix):
    self.trace_counts["prefill"] += 1
    with use_layout(self.layout):
      P = tokens_P.shape[0]
      index = jnp.arange(P, dtype=jnp.int32)[None]
      mask = index < true_length
      # After a common prefix the prompt's tokens continue its positions and
      # attend to its KV (C = 0 when the engine has no common prefix: the
      # model then skips the context part, and this is the plain prefill).
      logits, (k, v) = model_lib.prefill(
          self.graphdef, params, tokens_P[None], index + common.length, mask,
          (true_length - 1)[None],
          context=(common.k, common.v, common.length))
      last = logits[0]
      G = sample_idx_G.shape[0]
      keys = token_keys(seed, prompt_id, sample_idx_G,
                        common.length + true_length)
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
          positions=set_row(state.positions, jnp.full(
              G, state.common_len + prefix.true_length, jnp.int32)),
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
          state.suffix_v, state.suffix_len, attention_impl=self.attention_impl,
          common_k=state.common_k, common_v=state.common_v,
          common_len=state.common_len)
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

  # ------------------------------------------------------------ public API
  def _zero_state(self) -> DecodeState:
    cdt = self.cfg.compute_jnp_dtype
    fields = {}
    for name in STATE_AXES:
      shape = self.state_shape(name)
      dtype = (cdt if name in _KV_FIELDS
               else bool if name == "active"
               else jnp.uint32 if name == "seed" else jnp.int32)
      fields[name] = jnp.zeros(shape, dtype)
    return DecodeState(**fields)

  def abstract_state(self) -> DecodeState:
    """The decode state's shapes and dtypes (nothing allocated)."""
    return jax.eval_shape(self._zero_state)

  def init_decode_state(self) -> DecodeState:
    """An empty state (every row free) holding the current common prefix."""
    self._row_slots = [set() for _ in range(self.num_rows)]
    if self._init_jit is None:  # Once: a fresh closure per call would retrace.
      self._init_jit = jax.jit(self._zero_state,
                               out_shardings=self.state_shardings)
    state = self._init_jit()
    if self._common is not None:
      state = self._set_common_jit(state, self._common)
    self._state_common_version = self._common_version
    return state

  def prefill(self, params, padded_tokens, true_length, *, prompt_id=0,
              seed=0) -> Prefix:
    return self.prefill_multisampling(params, padded_tokens, true_length, 1,
                                      prompt_id=prompt_id, seed=seed)

  def prefill_multisampling(self, params, padded_tokens, true_length,
                            num_samples, *, prompt_id=0, seed=0,
                            first_sample_index=0) -> Prefix:
    """Runs the prompt once and draws `num_samples` first tokens from it.

    With a common prefix set, `padded_tokens` are the prompt's tokens after
    it (and `true_length` their count); they attend to its KV.
    """
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
                               np.int32(prompt_id), np.uint32(seed), sample_idx,
                               self._common_or_empty())
    return prefix.replace(prompt_id=int(prompt_id), sample_indices=indices,
                          seed=int(seed), common_version=self._common_version)

  def free_rows(self) -> list[int]:
    return [r for r, slots in enumerate(self._row_slots) if not slots]

  def slots_in_use(self, row: int) -> frozenset[int]:
    """The live slots of `row` (empty: the row is free)."""
    return frozenset(self._row_slots[row])

  def adopt(self, row_slots: dict[int, set[int]]) -> None:
    """Takes over a decode state built elsewhere (a migration): exactly the
    rows of `row_slots` are in use, and the state holds this engine's
    current common prefix."""
    self._row_slots = [set(row_slots.get(r, ())) for r in range(self.num_rows)]
    self._state_common_version = self._common_version

  def release_all(self) -> None:
    """Every row free (its samples moved to another engine)."""
    self._row_slots = [set() for _ in range(self.num_rows)]

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
    if prefix.common_version != self._common_version:
      raise ValueError(
          f"prompt {prefix.prompt_id} was prefilled after a different common "
          f"prefix than the engine's current one; prefill it again")
    if self._state_common_version != self._common_version:
      raise ValueError(
          "the decode state holds an older common prefix than the engine's "
          "(set_common_prefix / clear_common_prefix was called after "
          "init_decode_state); call init_decode_state() once its rows finish")
    mask = np.zeros(G, bool)
    sample_idx = np.zeros(G, np.int32)
    for s, i in zip(slots, prefix.sample_indices):
      mask[s % G] = True
      sample_idx[s % G] = i
    self._row_slots[row] = set(slots)
    # Host metadata is static pytree data: strip it so one compile serves all.
    arrays = prefix.replace(prompt_id=0, sample_indices=(), seed=0,
                            common_version=0)
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
