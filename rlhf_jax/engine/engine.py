"""The decode engine: KV in a page pool, prompt pages read once per group.

JetStream-style (prefill / insert / generate as pure jitted functions of a
donated decode state, in our own code; the `google-jetstream` package is
not used: its last release is from 2024, it pulls TensorFlow through seqio
and the repository is archived), with pages and prompt sharing of its own.

Memory: KV lives in fixed-size pages of one pool ([L, N, num_pages, T, K]),
sized from a byte or page budget, not from slots x max_new_tokens. A
group (one prompt, up to G samples) holds the pages of its prompt; each
sample holds pages for its own tokens, one more page whenever it crosses a
page boundary. A finished sample frees its pages and its slot at once; the
slot takes new work (a waiting sample of any group) while the rest of its
group decodes. The common prefix of a batch is one dense copy for all
groups (`set_common_prefix`: prefilled once; later prefills take only
the tokens after it and attend to it as context). Sharing tree: common ->
prompt -> sample. With data replicas, slots, group entries and pages are
split into one equal block per replica, and a group with its samples and
pages lives on one replica: decode attention runs per replica
(`shard_map`), with no communication.

Work per step: decode attention reads the prompt pages of the groups with
live samples, once per group for all of them, and each live sample's own
pages (`kernels_pallas/paged_decode_attention.py`). The jnp version reads
dense rows up to bounds (groups, a prompt's pages, a sample's own pages)
rounded up to powers of two above floors (`state.step_bounds`), one
compile per triple; a job whose prompts and responses fit the floors
compiles one decode step.

This class executes; `driver.Driver` decides (admission, page
allocation, preemption). Device ops, each a pure jitted function of the
donated `DecodeState`:
  prefill(params, prompts)                 batched: several prompts a call
  insert(state, prefill, entries, pages)   prompt KV into pages, group rows
  start(state, starts)                     samples into free slots
  generate(params, state, growth, ...)     up to W tokens for every live slot
  stop(state, slots)                       deactivate slots (preemption)
and the KV appends and moves of `moves.py` (extend, prefill_chunk,
recompute, gather_kv, place, adopt_state: plain functions of an engine and
its state). Sampling keys are (seed, prompt id, sample index, position): a
sample's tokens do not depend on its slot, its page ids, its neighbours or
on being preempted and recomputed.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import paged_decode_attention as pda
from rlhf_jax.engine import moves
from rlhf_jax.engine.sampling import SamplingParams, sample, token_keys
from rlhf_jax.engine.state import (
    NUM_COLUMNS, STEP_FLOORS, CommonPrefix, DecodeState, Prefill, ResultTokens,
    pow2_at_least, state_fields, step_bounds, top_columns)
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel.layout import Layout, use_layout
from rlhf_jax.shared_programs import SharedPrograms

# The common prefix's KV [L, C, N, K]: one copy, heads split as the model's.
_COMMON_AXES = ("layers", "cache_length", "kv_heads", "head_dim")

_PROGRAMS = SharedPrograms((
    "_common_prefill_jit", "_init_jit", "_prefill_jit", "_insert_jit",
    "_start_jit", "_stop_jit", "_extend_jit", "_recompute_jit", "_place_jit",
    "_gather_jit", "_prompt_chunk_jit", "_generate_jits", "trace_counts"))


class Engine:
  """Paged prefill / insert / start / generate over S slots."""

  def __init__(self, cfg: ModelConfig, graphdef, layout: Layout, *,
               num_slots: int, samples_per_group: int,
               prefill_buckets: Sequence[int], sampling: SamplingParams,
               page_size: int = 16, num_pages: int | None = None,
               kv_budget_bytes: int | None = None,
               num_groups: int | None = None, prefill_batch: int = 4,
               max_prompt_length: int | None = None,
               attention_impl: str = "auto", max_common_length: int = 0,
               decode_window: int = 8, record_routes: bool = False,
               top_logprobs: int = 0):
    """Builds the jitted functions; nothing is compiled until first use.

    Args:
      cfg, graphdef, layout: the model and the rollout layout.
      num_slots: S samples decoded per step at most.
      samples_per_group: G, the most samples one prompt has.
      prefill_buckets: padded prompt lengths (after a common prefix).
      sampling: how tokens are drawn; `max_new_tokens` caps every sample.
      page_size: T tokens per page.
      num_pages / kv_budget_bytes: the pool size over all data replicas,
        in pages or in bytes of K+V over all layers (at most one of them;
        neither: room for every slot's sample at max_new_tokens with its
        group's longest prompt, so nothing waits for pages). Each replica
        holds its own equal share (`PagePool`).
      num_groups: R group entries (prompts with samples alive or waiting);
        default 2 S / G, at least 2.
      prefill_batch: prompts per prefill call.
      max_prompt_length: the longest prompt (after a common prefix); one
        longer than the largest bucket is prefilled in chunks of that
        bucket (`prefill_chunk`). Default: the largest bucket.
      attention_impl: "auto" (the Pallas kernel on TPU and GPU, jnp
        elsewhere), "xla" or "pallas" (the backend's kernel, interpreted
        on CPU; `kernels_pallas/paged_decode_attention.py`).
      max_common_length: capacity of the common prefix (0: none).
      decode_window: W, the most decode steps one `generate` call runs
        (the driver asks for several while no sample waits for a slot:
        one dispatch and one result copy for all of them).
      record_routes: (MoE) also return the experts every prompt token and
        every fed token went to in each layer (`Prefill.routes`,
        `ResultTokens`' extra columns), for rollout routing replay. Not
        yet with a common prefix or chunked prefill.
      top_logprobs: K > 0 also returns, for every token drawn, the K
        likeliest tokens and their log-probs under the policy
        (temperature 1, unfiltered: `state.top_columns`), for an agent
        asking `top_logprobs` (`serving/`). Not with chunked prefill.
    """
    sampling.validate(cfg.vocab_size)
    if max_common_length < 0:
      raise ValueError(
          f"max_common_length must be >= 0, got {max_common_length}")
    buckets = tuple(sorted(set(int(b) for b in prefill_buckets)))
    if not buckets or buckets[0] < 1:
      raise ValueError(
          f"prefill_buckets must be positive, got {prefill_buckets}")
    if record_routes and not cfg.is_moe:
      raise ValueError("record_routes: the model has no routed experts")
    if record_routes and max_common_length:
      raise NotImplementedError(
          "record_routes with a common prefix (max_common_length > 0)")
    if record_routes and (max_prompt_length or 0) > max(prefill_buckets):
      raise NotImplementedError(
          "record_routes with chunked prefill (max_prompt_length above the "
          "largest prefill bucket)")
    self.record_routes = bool(record_routes)
    if not 0 <= top_logprobs <= cfg.vocab_size:
      raise ValueError(f"top_logprobs={top_logprobs}: in [0, vocab_size]")
    if top_logprobs and (max_prompt_length or 0) > max(prefill_buckets):
      raise NotImplementedError(
          "top_logprobs with chunked prefill (max_prompt_length above the "
          "largest prefill bucket)")
    self.top_logprobs = int(top_logprobs)
    # Result columns: token, valid, log-probs, then L x k expert ids.
    # Then 2K top-logprob columns (`state.top_columns`).
    self.result_columns = NUM_COLUMNS + (
        cfg.num_layers * cfg.experts_per_token if record_routes else 0) + (
            2 * self.top_logprobs)
    self.cfg, self.graphdef, self.layout = cfg, graphdef, layout
    self.buckets, self.sampling = buckets, sampling
    self.attention_impl = attention_impl
    self.max_common_length = int(max_common_length)
    self.trace_counts: collections.Counter = collections.Counter()
    # The common prefix: one dense copy for every group (`set_common_prefix`);
    # its version ties decode states to the prefix they were made with.
    self._common_tokens = np.zeros(0, np.int32)
    self._common: CommonPrefix | None = None
    self._empty_common: CommonPrefix | None = None  # Built on first use.
    self._common_version = 0
    self._state_common_version = 0
    _, abstract = model_lib.abstract_params(cfg)
    self.param_shardings = layout.param_shardings(abstract)
    common_kv = layout.sharding(_COMMON_AXES, self._common_kv_shape())
    self._common_shardings = CommonPrefix(k=common_kv, v=common_kv,
                                          length=layout.replicated())
    self._common_prefill_jit = jax.jit(
        self._common_prefill_fn,
        in_shardings=(self.param_shardings,) + (layout.replicated(),) * 2,
        out_shardings=self._common_shardings)
    if num_pages is not None and kv_budget_bytes is not None:
      raise ValueError("give the page pool as at most one of num_pages or "
                       "kv_budget_bytes")
    self.page_size = int(page_size)
    # Data replicas: each holds its share of slots, groups and pages, and a
    # group's samples and pages stay on its replica (the driver's rule), so
    # decode attention runs on each replica's own share (`shard_map`).
    D = self.replicas = layout.shards("batch")
    G = int(samples_per_group)
    T = self.page_size
    if kv_budget_bytes is not None:
      num_pages = int(kv_budget_bytes) // self.page_bytes // D * D
    elif num_pages is None:
      groups = D * math.ceil(num_slots / D / max(G, 1))
      num_pages = (groups * math.ceil((max_prompt_length or
                                       self.buckets[-1]) / T) +
                   num_slots * math.ceil((sampling.max_new_tokens + 1) / T))
    if num_slots < 1 or G < 1:
      raise ValueError(f"num_slots and samples_per_group must be >= 1, got "
                       f"{num_slots} and {G}")
    num_groups = int(num_groups or max(2, 2 * num_slots // G))
    num_groups += -num_groups % D
    for name, n in (("num_slots", num_slots), ("num_pages", num_pages)):
      if n % D:
        raise ValueError(f"{name}={n} must be a multiple of the layout's "
                         f"{D} data replicas")
    if num_pages // D < 2:
      raise ValueError(f"a page pool of {num_pages} pages over {D} replicas "
                       f"is too small (one page is {self.page_bytes} bytes)")
    self.num_slots, self.samples_per_group = int(num_slots), G
    self.num_pages, self.num_groups = int(num_pages), num_groups
    self.prefill_batch = int(prefill_batch)
    if decode_window < 1:
      raise ValueError(f"decode_window={decode_window} must be >= 1")
    self.decode_window = int(decode_window)
    self.max_prompt_length = int(max_prompt_length or self.buckets[-1])
    if self.max_prompt_length < self.buckets[-1]:
      raise ValueError(f"max_prompt_length={self.max_prompt_length} is "
                       f"shorter than the largest bucket {self.buckets[-1]}")
    self.max_prompt_pages = math.ceil(self.max_prefill_length / T)
    # Own tokens in the pool reach max_new_tokens - 1; the driver keeps two
    # tokens of headroom (the step in flight and the next).
    self.max_own_pages = math.ceil((sampling.max_new_tokens + 1) / T)
    self.state_shardings = DecodeState(**{
        name: layout.sharding(axes, shape)
        for name, (axes, shape, _) in self._fields().items()})
    rep = layout.replicated()
    self._prefill_sh = Prefill(*(rep,) * 5,
                               routes=rep if record_routes else None,
                               first_top=rep if top_logprobs else None)
    self._insert_sh = Prefill(*(rep,) * 5)  # The routes stay behind.
    st, params, common = (self.state_shardings, self.param_shardings,
                          self._common_shardings)
    self._init_jit = jax.jit(self._zero_state, in_shardings=(common,),
                             out_shardings=st)
    self._prefill_jit = jax.jit(
        self._prefill_fn, in_shardings=(params,) + (rep,) * 5 + (common,),
        out_shardings=self._prefill_sh)
    self._insert_jit = jax.jit(
        self._insert_fn, in_shardings=(st, self._insert_sh) + (rep,) * 5,
        out_shardings=st, donate_argnums=0)
    self._start_jit = jax.jit(self._start_fn, out_shardings=st,
                              donate_argnums=0)
    self._stop_jit = jax.jit(self._stop_fn, out_shardings=st,
                             donate_argnums=0)
    # The KV appends and moves (`moves.py`), bound to this engine.
    bound = lambda fn: functools.partial(fn, self)
    self._extend_jit = jax.jit(bound(moves.extend_fn),
                               out_shardings=(st, rep if self.record_routes
                                              else None),
                               donate_argnums=1)
    self._recompute_jit = jax.jit(bound(moves.recompute_fn),
                                  out_shardings=st, donate_argnums=1)
    self._place_jit = jax.jit(bound(moves.place_fn), out_shardings=st,
                              donate_argnums=0)
    self._gather_jit = jax.jit(bound(moves.gather_fn),
                               out_shardings=(rep, rep))
    self._prompt_chunk_jit = jax.jit(
        bound(moves.prompt_chunk_fn), out_shardings=(st, (rep,) * 3),
        donate_argnums=1)
    # Growth rows of one call: a slot gains at most this many pages in a
    # window (its tokens plus the spare cross a page boundary that often).
    self._growth_rows = self.num_slots * (
        math.ceil(self.decode_window / self.page_size) + 1)
    no_growth = np.zeros((self._growth_rows, 3), np.int32)
    no_growth[:, 0] = self.num_slots
    self._no_growth = jax.device_put(no_growth, rep)
    self._listed = ((), None)  # (slots, their device list) of the last step
    # One jitted step per triple of read bounds (bound into the function:
    # no static argument to hash at every call).
    self._generate_jits: dict = {}
    self._step_counts: dict = {}
    self._generate_sh = dict(in_shardings=(params, st, rep, rep, rep),
                             out_shardings=(st, ResultTokens(rep)),
                             donate_argnums=1)
    # The kernel walks the page tables (no page-list bounds needed).
    self._walks_tables = pda.resolve_impl(self.attention_impl) == "pallas"
    # An engine equal to a live one runs its programs (`shared_programs`).
    _PROGRAMS.adopt(self, (cfg, graphdef, layout, self.num_slots, G,
                           buckets, sampling, self.page_size, self.num_pages,
                           self.num_groups, self.prefill_batch,
                           self.max_prompt_length, attention_impl,
                           self.max_common_length, self.decode_window,
                           self.record_routes, self.top_logprobs))

  # --------------------------------------------------------- common prefix
  def _common_kv_shape(self):
    c = self.cfg
    return (c.num_layers, self.max_common_length, c.num_kv_heads, c.head_dim)

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

    Later `prefill` calls take only the tokens after it, and decode states
    from later `init_decode_state` calls hold its KV once for all groups.
    Groups of an older state keep decoding against the old common prefix,
    but inserting a new prefill into it raises (see `insert`).

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

  def copy_common_prefix(self, other: "Engine") -> None:
    """Holds `other`'s common prefix (its KV moved onto this engine's
    devices, no prefill): a decode state adopted from `other` keeps its
    groups, and later prefills here attend to the same tokens."""
    if other.max_common_length != self.max_common_length:
      raise ValueError("engines with different max_common_length")
    if other._common is None:  # pylint: disable=protected-access
      self.clear_common_prefix()
      return
    self._common = jax.device_put(other._common, self._common_shardings)
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

  # ------------------------------------------------------------- prompts
  def _pad_to_bucket(self, tokens, prompt_id=None):
    """Validates a prompt of at most one bucket and right-pads it to its
    bucket."""
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

  # ---------------------------------------------------------------- shapes
  @property
  def page_bytes(self) -> int:
    """Bytes of one page: K and V of T tokens over all layers."""
    c = self.cfg
    return (2 * c.num_layers * self.page_size * c.num_kv_heads * c.head_dim *
            jnp.dtype(c.compute_jnp_dtype).itemsize)

  @property
  def pool_bytes(self) -> int:
    """Bytes of the allocated page pool (what the engine reserves)."""
    return self.num_pages * self.page_bytes

  @property
  def max_prefill_length(self) -> int:
    """The longest prompt accepted (chunked past the largest bucket)."""
    return self.max_prompt_length

  @property
  def chunk_length(self) -> int:
    """Tokens per prefill call: the largest bucket."""
    return self.buckets[-1]

  def pad_prompt(self, tokens, prompt_id=None):
    """Validates a prompt; pads it to its bucket, or, past the largest
    bucket (chunked prefill), returns it as it is."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if tokens.size <= self.chunk_length:
      return self._pad_to_bucket(tokens, prompt_id)
    if tokens.size > self.max_prompt_length:
      raise ValueError(f"prompt {prompt_id} has {tokens.size} tokens, longer "
                       f"than max_prompt_length={self.max_prompt_length}")
    for start in range(0, tokens.size, self.chunk_length):  # Token ids.
      self._pad_to_bucket(tokens[start:start + self.chunk_length], prompt_id)
    return tokens, tokens.size

  def _fields(self):
    """name -> (logical axes, shape, dtype) of every DecodeState field."""
    return state_fields(
        self.cfg, num_slots=self.num_slots, num_groups=self.num_groups,
        samples_per_group=self.samples_per_group, num_pages=self.num_pages,
        page_size=self.page_size, max_prompt_pages=self.max_prompt_pages,
        max_own_pages=self.max_own_pages,
        max_common_length=self.max_common_length)

  def _zero_state(self, common: CommonPrefix) -> DecodeState:
    fields = {name: jnp.zeros(shape, dtype)
              for name, (_, shape, dtype) in self._fields().items()}
    fields["group_slots"] = -jnp.ones_like(fields["group_slots"])
    fields.update(common_k=common.k, common_v=common.v,
                  common_len=common.length)
    return DecodeState(**fields)

  def init_decode_state(self) -> DecodeState:
    """An empty state (no groups, no samples, every page free) holding the
    current common prefix."""
    self._state_common_version = self._common_version
    return self._init_jit(self._common_or_empty())

  # ----------------------------------------------------------- jitted fns
  def _prefill_fn(self, params, tokens_BxP, lengths_B, prompt_ids_B, seeds_B,
                  sample_idx_BxG, common: CommonPrefix) -> Prefill:
    self.trace_counts["prefill"] += 1
    with use_layout(self.layout):
      B, P = tokens_BxP.shape
      index = jnp.arange(P, dtype=jnp.int32)[None]
      mask = index < lengths_B[:, None]
      logits_BxV, (k, v), *routes = model_lib.prefill(
          self.graphdef, params, tokens_BxP, index + common.length, mask,
          lengths_B - 1, context=(common.k, common.v, common.length),
          return_routes=self.record_routes)
      G = sample_idx_BxG.shape[1]
      keys = token_keys(seeds_B[:, None], prompt_ids_B[:, None],
                        sample_idx_BxG, (common.length + lengths_B)[:, None])
      logits = jnp.broadcast_to(logits_BxV[:, None], (B, G) +
                                logits_BxV.shape[1:])
      tokens, logp, raw = sample(logits.reshape(B * G, -1), keys.reshape(-1),
                                 self.sampling)
      cdt = self.cfg.compute_jnp_dtype
      return Prefill(k=k.astype(cdt), v=v.astype(cdt),
                          first_tokens=tokens.reshape(B, G),
                          first_logp=logp.reshape(B, G),
                          first_logp_raw=raw.reshape(B, G),
                          routes=routes[0] if routes else None,
                          first_top=(top_columns(logits_BxV,
                                                 self.top_logprobs)
                                     if self.top_logprobs else None))

  def _insert_fn(self, state: DecodeState, pre: Prefill, entries_B,
                 pages_BxA, lengths_B, prompt_ids_B, seeds_B) -> DecodeState:
    """Prompt KV into its pages; entry rows of the group tables. Padding
    rows of the batch have entry R and page ids num_pages (dropped)."""
    self.trace_counts["insert"] += 1
    L, B, P, N, K = pre.k.shape
    T, A = self.page_size, pages_BxA.shape[1]
    pad = A * T - P

    def to_pages(x):  # [L, B, P, N, K] -> [L, N, B, A, T, K]
      x = jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0)))
      x = x.reshape(L, B, A, T, N, K).transpose(0, 4, 1, 2, 3, 5)
      return x.astype(state.k_pages.dtype)

    drop = dict(mode="drop")
    G = state.group_slots.shape[1]
    # The table reads page 0 past a prompt's pages (masked); the KV scatter
    # drops them (id num_pages).
    table = jnp.zeros((B, state.group_pages.shape[1]), jnp.int32)
    table = table.at[:, :A].set(
        jnp.where(pages_BxA < state.k_pages.shape[2], pages_BxA, 0))
    return state.replace(
        k_pages=state.k_pages.at[:, :, pages_BxA].set(to_pages(pre.k),
                                                      **drop),
        v_pages=state.v_pages.at[:, :, pages_BxA].set(to_pages(pre.v),
                                                      **drop),
        group_pages=state.group_pages.at[entries_B].set(table, **drop),
        group_len=state.group_len.at[entries_B].set(lengths_B, **drop),
        group_slots=state.group_slots.at[entries_B].set(
            jnp.full((B, G), -1, jnp.int32), **drop),
        group_first=state.group_first.at[entries_B].set(pre.first_tokens,
                                                        **drop),
        group_prompt_id=state.group_prompt_id.at[entries_B].set(prompt_ids_B,
                                                                **drop),
        group_seed=state.group_seed.at[entries_B].set(seeds_B, **drop))

  def _start_fn(self, state: DecodeState, slots_X, entries_X, members_X,
                sample_idx_X, budgets_X, own_rows_XxB) -> DecodeState:
    """Samples into slots at their first token (padding: slot S)."""
    self.trace_counts["start"] += 1
    drop = dict(mode="drop")
    first = state.group_first[entries_X, members_X]
    done = (budgets_X <= 1) | self._is_stop(first)
    pos = state.common_len + state.group_len[entries_X]
    zero = jnp.zeros_like(slots_X)
    at = lambda a, x: a.at[slots_X].set(x, **drop)
    return state.replace(
        group_slots=state.group_slots.at[entries_X, members_X].set(
            slots_X, **drop),
        slot_group=at(state.slot_group, entries_X),
        slot_member=at(state.slot_member, members_X),
        own_pages=at(state.own_pages, own_rows_XxB),
        own_len=at(state.own_len, zero), tokens=at(state.tokens, first),
        positions=at(state.positions, pos),
        generated=at(state.generated, zero + 1),
        budget=at(state.budget, budgets_X), active=at(state.active, ~done),
        sample_idx=at(state.sample_idx, sample_idx_X))

  def _stop_fn(self, state: DecodeState, slots_X) -> DecodeState:
    self.trace_counts["stop"] += 1
    return state.replace(active=state.active.at[slots_X].set(False,
                                                             mode="drop"))

  def _window_fn(self, params, state: DecodeState, growth_Sx3, slots_X,
                 steps, bounds: tuple[int, int, int]):
    """Up to `steps` (<= W) decode steps of the listed slots, stopping
    once none of them is active. growth_Sx3 rows (slot, column, page) add
    own pages first (slot S: none), for all the steps. Results: [W, S, 4],
    rows past the last step run not valid."""
    S, W = state.active.shape[0], self.decode_window
    state = state.replace(own_pages=state.own_pages.at[
        growth_Sx3[:, 0], growth_Sx3[:, 1]].set(growth_Sx3[:, 2],
                                                 mode="drop"))
    out = jnp.zeros((W, S, self.result_columns), jnp.int32)
    listed = jnp.minimum(slots_X, S - 1)

    def more(carry):
      j, state, _ = carry
      return (j < steps) & jnp.any(state.active[listed] & (slots_X < S))

    def step(carry):
      j, state, out = carry
      state, res = self._generate_fn(params, state, slots_X, bounds)
      return j + 1, state, jax.lax.dynamic_update_index_in_dim(
          out, res.data, j, 0)

    _, state, out = jax.lax.while_loop(more, step, (jnp.int32(0), state, out))
    return state, ResultTokens(out)

  def _generate_fn(self, params, state: DecodeState, slots_X,
                   bounds: tuple[int, int, int]):
    """One token for each live slot of `slots_X` (padding: slot S).

    Only the X listed slots run through the model (X is the live count
    rounded up: a step of the tail costs what its few samples cost).
    bounds: static (groups with live samples, pages of one's prompt, own
    pages of one sample) the jnp attention reads this step.
    """
    self.trace_counts["generate"] += 1
    with use_layout(self.layout):
      T, num_pages = self.page_size, state.k_pages.shape[2]
      S = state.active.shape[0]
      X = slots_X.shape[0]
      own_pages = state.own_pages
      sl = jnp.minimum(slots_X, S - 1)
      live = state.active[sl] & (slots_X < S)                  # [X]
      own_len = state.own_len[sl]
      write_page = jnp.where(
          live, jnp.take_along_axis(own_pages[sl], (own_len // T)[:, None],
                                    axis=1)[:, 0], num_pages)
      # Group members as places in the slot list. A member entry counts
      # only while its slot still holds that sample (a freed slot may have
      # started a sample of another group since).
      place = jnp.full(S, -1, jnp.int32).at[slots_X].set(
          jnp.where(live, jnp.arange(X, dtype=jnp.int32), -1), mode="drop")
      gs = jnp.maximum(state.group_slots, 0)
      R, G = gs.shape
      member = ((state.group_slots >= 0) & (place[gs] >= 0)
                & (state.slot_group[gs] == jnp.arange(R)[:, None])
                & (state.slot_member[gs] == jnp.arange(G)[None, :]))
      index = dict(
          slot_group_S=state.slot_group[sl],
          slot_member_S=state.slot_member[sl],
          group_slots_RxG=jnp.where(member, place[gs], -1),
          group_pages_RxA=state.group_pages, group_len_R=state.group_len,
          own_pages_SxB=own_pages[sl],
          own_len_S=jnp.where(live, own_len + 1, 0),
          groups_read=bounds[0], prompt_pages_read=bounds[1],
          own_pages_read=bounds[2])
      logits, k_pages, v_pages, *routes = model_lib.paged_decode(
          self.graphdef, params, state.tokens[sl], state.positions[sl],
          state.k_pages, state.v_pages, write_page, own_len % T, index,
          attention_impl=self.attention_impl, common_k=state.common_k,
          common_v=state.common_v, common_len=state.common_len,
          return_routes=self.record_routes)
      g = state.slot_group[sl]
      keys = token_keys(state.group_seed[g], state.group_prompt_id[g],
                        state.sample_idx[sl], state.positions[sl] + 1)
      tokens, logp, raw = sample(logits, keys, self.sampling)
      step = live.astype(jnp.int32)
      generated = state.generated[sl] + step
      done = live & (self._is_stop(tokens) | (generated >= state.budget[sl]))
      put = lambda a, x: a.at[slots_X].set(x, mode="drop")
      new_state = state.replace(
          k_pages=k_pages, v_pages=v_pages,
          own_len=put(state.own_len, own_len + step),
          tokens=put(state.tokens, jnp.where(live, tokens, state.tokens[sl])),
          positions=put(state.positions, state.positions[sl] + step),
          generated=put(state.generated, generated),
          active=put(state.active, live & ~done))
      # Results in slot order ([S, 4]); unlisted slots are not valid.
      per_slot = lambda x: jnp.zeros((S,) + x.shape[1:], x.dtype).at[
          slots_X].set(x, mode="drop")
      return new_state, ResultTokens.pack(
          per_slot(tokens), per_slot(live), per_slot(logp), per_slot(raw),
          per_slot(routes[0].reshape(X, -1)) if routes else None,
          per_slot(top_columns(logits, self.top_logprobs))
          if self.top_logprobs else None)

  # ------------------------------------------------------------ host API
  def prefill(self, params, prompts: Sequence[tuple[np.ndarray, int]],
              prompt_ids, seeds, sample_indices) -> Prefill:
    """Prefills up to `prefill_batch` prompts in one call.

    Args:
      params: rollout weights.
      prompts: (tokens after the common prefix, unpadded) per prompt.
      prompt_ids, seeds: per prompt.
      sample_indices: per prompt, the sample indices of its G first tokens
        (fewer than G: the rest are unused).

    Returns:
      `Prefill` with B = prefill_batch rows (the first len(prompts)
      real), padded to the bucket of the longest prompt.
    """
    n, Bp = len(prompts), self.prefill_batch
    if not 1 <= n <= Bp:
      raise ValueError(f"prefill takes 1..{Bp} prompts, got {n}")
    P = self.bucket_for(max(len(t) for t, _ in prompts))
    tokens = np.zeros((Bp, P), np.int32)
    lengths = np.ones(Bp, np.int32)
    ids, sd = np.zeros(Bp, np.int32), np.zeros(Bp, np.uint32)
    idx = np.zeros((Bp, self.samples_per_group), np.int32)
    for b, ((toks, pid), seed, si) in enumerate(
        zip(zip((t for t, _ in prompts), prompt_ids), seeds, sample_indices)):
      tokens[b, :len(toks)] = toks
      lengths[b], ids[b], sd[b] = len(toks), pid, seed
      idx[b, :len(si)] = si
    return self._prefill_jit(params, tokens, lengths, ids, sd, idx,
                             self._common_or_empty())

  def insert(self, state: DecodeState, pre: Prefill, entries, pages,
             lengths, prompt_ids, seeds) -> DecodeState:
    """Writes the first len(entries) prompts of `pre` into their pages
    (`pages[b]`: ceil(length / T) ids) and group entries."""
    if self._state_common_version != self._common_version:
      raise ValueError(
          "the decode state holds an older common prefix than the engine's; "
          "call init_decode_state() once its samples finish")
    # Read by the driver, not the state.
    pre = pre.replace(routes=None, first_top=None)
    Bp = pre.k.shape[1]
    A = math.ceil(pre.k.shape[2] / self.page_size)
    ent = np.full(Bp, self.num_groups, np.int32)
    table = np.full((Bp, A), self.num_pages, np.int32)
    lens, ids = np.zeros(Bp, np.int32), np.zeros(Bp, np.int32)
    sd = np.zeros(Bp, np.uint32)
    for b, e in enumerate(entries):
      ent[b], lens[b], ids[b], sd[b] = e, lengths[b], prompt_ids[b], seeds[b]
      table[b, :len(pages[b])] = pages[b]
    return self._insert_jit(state, pre, ent, table, lens, ids, sd)

  def start(self, state: DecodeState, starts) -> DecodeState:
    """Puts samples into slots at their first token.

    Args:
      state: the decode state.
      starts: (slot, group entry, member, sample index, budget, own page
        ids) per sample.
    """
    S, Bm = self.num_slots, self.max_own_pages
    cols = np.zeros((5, S), np.int32)
    cols[0], cols[1] = S, self.num_groups  # Padding: dropped.
    rows = np.zeros((S, Bm), np.int32)
    for x, (slot, entry, member, idx, budget, pages) in enumerate(starts):
      cols[:, x] = slot, entry, member, idx, budget
      rows[x, :len(pages)] = pages
    return self._start_jit(state, *cols, rows)

  def stop(self, state: DecodeState, slots) -> DecodeState:
    """Deactivates `slots` (their pages may be reused after this call)."""
    arr = np.full(self.num_slots, self.num_slots, np.int32)
    arr[:len(slots)] = list(slots)
    return self._stop_jit(state, arr)

  def replica_of(self, slot: int) -> int:
    """The data replica a slot lives on (slot ids are split into equal
    contiguous blocks, as are group entries and page ids)."""
    return slot // (self.num_slots // self.replicas)

  def generate(self, params, state: DecodeState, growth=(), *, slots,
               groups: int, prompt_pages: int, own_pages: int,
               steps: int = 1):
    """`steps` decode steps (at most `decode_window`), one call.

    Args:
      params, state: weights and the decode state (donated).
      growth: (slot, column, page) own pages added before the step.
      slots: the slots to step (every slot live on the device must be
        listed; others may be).
      groups: at least the groups with live samples on one replica;
        prompt_pages: at least the prompt pages of one of them; own_pages:
        at least the own pages one live sample holds after the last step's
        token. Rounded up here (`step_bounds`), like the slot count per
        replica (one compile per bucket); a smaller bound would drop keys.
      steps: decode steps to run; fewer run once no listed slot is active.

    Returns:
      (state, ResultTokens [W, S, 4]): row j is step j's result (rows past
      the steps run are not valid).
    """
    if not 1 <= steps <= self.decode_window:
      raise ValueError(f"steps={steps}: 1..{self.decode_window}")
    if growth:  # Placed like the no-growth table: one compile for both.
      g = np.zeros((self._growth_rows, 3), np.int32)
      g[:, 0] = self.num_slots
      g[:len(growth)] = growth
      g = jax.device_put(g, self.layout.replicated())
    else:  # Most steps: no page added (one device array, no copy).
      g = self._no_growth
    if tuple(slots) != self._listed[0]:  # Unchanged between finishes.
      self._listed = (tuple(slots), self._list_slots(slots))
    listed = self._listed[1]
    if self._walks_tables:  # The kernel reads each table up to its length.
      bounds = (0, 0, 0)
    else:
      bounds = step_bounds((groups, prompt_pages, own_pages),
                           (self.num_groups // self.replicas,
                            self.max_prompt_pages,
                            self.max_own_pages))
    step = self._generate_jits.get(bounds)
    if step is None:
      step = self._generate_jits[bounds] = jax.jit(
          functools.partial(self._window_fn, bounds=bounds),
          **self._generate_sh)
    n = self._step_counts.get(steps)
    if n is None:  # One device scalar per count (no copy per call).
      n = self._step_counts[steps] = jax.device_put(
          np.int32(steps), self.layout.replicated())
    return step(params, state, g, listed, n)

  def _list_slots(self, slots) -> jax.Array:
    """The slot list of a step: replica r's slots in block r (decode
    attention reads the list per replica), each block padded with slot S
    to a power of two (one compile per size)."""
    D = self.replicas
    per_replica = [[] for _ in range(D)]
    for slot in sorted(slots):
      per_replica[self.replica_of(slot)].append(slot)
    X_loc = pow2_at_least(max(map(len, per_replica)), self.num_slots // D,
                          STEP_FLOORS[0])
    listed = np.full((D, X_loc), self.num_slots, np.int32)
    for r, own in enumerate(per_replica):
      listed[r, :len(own)] = own
    return jax.device_put(listed.reshape(-1), self.layout.replicated())
