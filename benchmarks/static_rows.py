"""A static-rows decoder in plain jnp: the tests' oracle, a benchmark baseline.

R rows x G slots, the layout of the static batching most RL frameworks
run: a row holds one prompt's KV (its bucket, P tokens) once for its G
samples and a suffix buffer of max_new_tokens per sample, and takes its
next prompt only when the last of its G samples has ended. Nothing is
paged, shared across rows, preempted or moved; the model's rows decode
(`Decoder.decode`) with the jnp attention does the arithmetic.

Sampling keys are the engine's (seed, prompt id, sample index, position,
`engine/sampling.py`), so every sample's tokens equal the paged engine's
wherever and whenever either decodes it: tests compare the two token by
token. Results are read one step late (the host never waits for the step
it has just dispatched), as the engine's driver does, so its time is the
static layout's, not a synchronising host's
(`benchmarks.paged_long_tail`).

  decoder = StaticRows(cfg, graphdef, params, rows=4, samples_per_row=G,
                       bucket=64, sampling=SamplingParams(...))
  samples = decoder.run(requests)     # {(prompt id, sample index): Sample}
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rlhf_jax.samples import Request, Sample
from rlhf_jax.engine.sampling import SamplingParams, sample, token_keys
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig


@struct.dataclass
class _Rows:
  """The decode state: prompt KV once per row, a suffix per sample."""
  prefix_k: jax.Array      # [L, R, P, N, K]
  prefix_v: jax.Array
  prefix_len: jax.Array    # [R]
  suffix_k: jax.Array      # [L, R, G, M, N, K]
  suffix_v: jax.Array
  suffix_len: jax.Array    # [R, G] own tokens cached
  tokens: jax.Array        # [R, G] the token fed next
  positions: jax.Array     # [R, G] its position
  generated: jax.Array     # [R, G] response tokens so far
  budget: jax.Array        # [R, G] the sample's token budget
  active: jax.Array        # [R, G] bool
  prompt_id: jax.Array     # [R]
  seed: jax.Array          # [R] uint32
  sample_idx: jax.Array    # [R, G]


@dataclasses.dataclass
class _Slot:
  request: Request
  sample_idx: int
  budget: int
  tokens: list = dataclasses.field(default_factory=list)
  logp: list = dataclasses.field(default_factory=list)
  logp_raw: list = dataclasses.field(default_factory=list)


class StaticRows:
  """Static-row batching over dense per-row KV buffers (module doc)."""

  def __init__(self, cfg: ModelConfig, graphdef, params, *, rows: int,
               samples_per_row: int, bucket: int, sampling: SamplingParams):
    sampling.validate(cfg.vocab_size)
    self.cfg, self.graphdef, self.params = cfg, graphdef, params
    self.rows, self.G, self.P = rows, samples_per_row, bucket
    self.sampling = sampling
    self._prefill = jax.jit(self._prefill_fn)
    self._insert = jax.jit(self._insert_fn, donate_argnums=0)
    self._step = jax.jit(self._step_fn, donate_argnums=1)

  def _zero_state(self) -> _Rows:
    c, R, G = self.cfg, self.rows, self.G
    L, N, K, M = (c.num_layers, c.num_kv_heads, c.head_dim,
                  self.sampling.max_new_tokens)
    kv = lambda *s: jnp.zeros(s, c.compute_jnp_dtype)
    i32 = lambda *s: jnp.zeros(s, jnp.int32)
    return _Rows(kv(L, R, self.P, N, K), kv(L, R, self.P, N, K), i32(R),
                 kv(L, R, G, M, N, K), kv(L, R, G, M, N, K), i32(R, G),
                 i32(R, G), i32(R, G), i32(R, G), i32(R, G),
                 jnp.zeros((R, G), bool), i32(R), jnp.zeros(R, jnp.uint32),
                 i32(R, G))

  def _is_stop(self, tokens):
    stops = jnp.asarray(self.sampling.stop_tokens or (-1,), jnp.int32)
    return jnp.any(tokens[..., None] == stops, axis=-1)

  def _prefill_fn(self, params, tokens_P, length, prompt_id, seed,
                  sample_idx_G):
    """The prompt once; its G first tokens."""
    index = jnp.arange(self.P, dtype=jnp.int32)[None]
    logits_1xV, (k, v) = model_lib.prefill(
        self.graphdef, params, tokens_P[None], index, index < length,
        (length - 1)[None])
    keys = token_keys(seed, prompt_id, sample_idx_G, length)
    first = sample(jnp.broadcast_to(logits_1xV, (self.G,) +
                                    logits_1xV.shape[1:]), keys,
                   self.sampling)
    cdt = self.cfg.compute_jnp_dtype
    return k[:, 0].astype(cdt), v[:, 0].astype(cdt), first

  def _insert_fn(self, state: _Rows, k, v, row, length, prompt_id, seed,
                 sample_idx_G, budget_G, first_G, live_G) -> _Rows:
    """A prompt's KV into `row`; its samples start at their first token."""
    put = lambda a, x: a.at[row].set(x)
    at_row = (0, row, 0, 0, 0)
    G = self.G
    return state.replace(
        prefix_k=jax.lax.dynamic_update_slice(state.prefix_k, k[:, None],
                                              at_row),
        prefix_v=jax.lax.dynamic_update_slice(state.prefix_v, v[:, None],
                                              at_row),
        prefix_len=put(state.prefix_len, length),
        suffix_len=put(state.suffix_len, jnp.zeros(G, jnp.int32)),
        tokens=put(state.tokens, first_G),
        positions=put(state.positions, jnp.full(G, length, jnp.int32)),
        generated=put(state.generated, jnp.ones(G, jnp.int32)),
        budget=put(state.budget, budget_G),
        active=put(state.active,
                   live_G & (budget_G > 1) & ~self._is_stop(first_G)),
        prompt_id=put(state.prompt_id, prompt_id),
        seed=put(state.seed, seed),
        sample_idx=put(state.sample_idx, sample_idx_G))

  def _step_fn(self, params, state: _Rows):
    """One token for every active slot (the others compute and drop)."""
    logits, suffix_k, suffix_v = model_lib.decode(
        self.graphdef, params, state.tokens, state.positions, state.prefix_k,
        state.prefix_v, state.prefix_len, state.suffix_k, state.suffix_v,
        state.suffix_len, attention_impl="xla")
    R, G, V = logits.shape
    keys = token_keys(state.seed[:, None], state.prompt_id[:, None],
                      state.sample_idx, state.positions + 1)
    tokens, logp, raw = (x.reshape(R, G) for x in sample(
        logits.reshape(R * G, V), keys.reshape(-1), self.sampling))
    valid = state.active
    step = valid.astype(jnp.int32)
    generated = state.generated + step
    done = valid & (self._is_stop(tokens) | (generated >= state.budget))
    new = state.replace(
        suffix_k=suffix_k, suffix_v=suffix_v,
        suffix_len=state.suffix_len + step,
        tokens=jnp.where(valid, tokens, state.tokens),
        positions=state.positions + step, generated=generated,
        active=valid & ~done)
    return new, (tokens, valid, logp, raw)

  def run(self, requests: Iterable[Request]) -> dict:
    """Samples every request: {(prompt id, sample index): Sample}."""
    pending = collections.deque(requests)
    M = self.sampling.max_new_tokens
    for req in pending:
      n = len(req.tokens)
      if not 1 <= n <= self.P or not 1 <= req.num_samples <= self.G:
        raise ValueError(f"prompt {req.prompt_id}: {n} tokens and "
                         f"{req.num_samples} samples; this decoder takes "
                         f"1..{self.P} and 1..{self.G}")
    state = jax.jit(self._zero_state)()
    slots: list[list[_Slot | None]] = [[None] * self.G
                                       for _ in range(self.rows)]
    out, in_flight = {}, None

    def take(r, g, token, logp, raw):
      it = slots[r][g]
      it.tokens.append(int(token))
      it.logp.append(float(logp))
      it.logp_raw.append(float(raw))
      stop = token in self.sampling.stop_tokens
      if stop or len(it.tokens) >= it.budget:
        slots[r][g] = None
        req = it.request
        out[req.prompt_id, it.sample_idx] = Sample(
            req.prompt_id, it.sample_idx, np.asarray(req.tokens, np.int32),
            it.tokens, it.logp, it.logp_raw, "stop" if stop else "length",
            0, seed=req.seed)

    while True:
      for r in range(self.rows):  # A row takes a prompt once it is empty.
        if not pending or any(slots[r]):
          continue
        req = pending.popleft()
        n, G = len(req.tokens), self.G
        padded = np.zeros(self.P, np.int32)
        padded[:n] = req.tokens
        idx = np.zeros(G, np.int32)
        idx[:req.num_samples] = range(req.first_sample_index,
                                      req.first_sample_index +
                                      req.num_samples)
        budget = np.ones(G, np.int32)
        live = np.zeros(G, bool)
        live[:req.num_samples] = True
        for g in range(req.num_samples):
          budget[g] = req.budget(g, M)
          slots[r][g] = _Slot(req, int(idx[g]), int(budget[g]))
        k, v, (first, logp, raw) = self._prefill(
            self.params, padded, np.int32(n), np.int32(req.prompt_id),
            np.uint32(req.seed), idx)
        state = self._insert(state, k, v, np.int32(r), np.int32(n),
                             np.int32(req.prompt_id), np.uint32(req.seed),
                             idx, budget, first, live)
        first, logp, raw = (np.asarray(x) for x in (first, logp, raw))
        for g in range(req.num_samples):
          take(r, g, first[g], logp[g], raw[g])
      # Slots the host still waits on: those of the step in flight end
      # there or later (a slot's result is read one step late).
      busy = any(any(row) for row in slots)
      result = None
      if busy:
        state, result = self._step(self.params, state)
        for x in result:
          x.copy_to_host_async()
      if in_flight is not None:
        tokens, valid, logp, raw = (np.asarray(x) for x in in_flight)
        for r, g in zip(*np.nonzero(valid)):
          if slots[r][g] is not None:
            take(r, g, tokens[r, g], logp[r, g], raw[r, g])
      in_flight = result
      if not busy and in_flight is None and not pending:
        return out
