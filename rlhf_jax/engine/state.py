"""The engine's data: its decode state, batched prefill results, the common
prefix, the packed per-step results, the logical axes and shapes of every
state field, the bucket rule of a decode step, and the two page moves of
appended tokens (a dense copy of a sequence's context, its new KV into its
pages); `engine.Engine` executes on them.

Dimension letters: L layers, S slots, R group entries, G samples per
group, T page size, N kv heads, K head dim, A / B most prompt / own pages
of one group / sample, C common-prefix capacity.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rlhf_jax.models.config import ModelConfig

# The page axis is split over the data replicas: each holds its own pool.
_PAGES = ("layers", "kv_heads", "batch", None, "head_dim")
_SLOTS, _GROUPS = ("batch",), ("batch",)


@struct.dataclass
class DecodeState:
  """Everything `generate` reads and writes (S slots, R group entries)."""
  k_pages: jax.Array       # [L, N, num_pages, T, K] (head-major)
  v_pages: jax.Array
  group_pages: jax.Array   # [R, A_max] prompt page ids
  group_len: jax.Array     # [R] prompt tokens (after the common prefix)
  group_slots: jax.Array   # [R, G] slot of each member (-1: none)
  group_first: jax.Array   # [R, G] each member's first token (from prefill)
  group_prompt_id: jax.Array  # [R]
  group_seed: jax.Array    # [R] uint32
  slot_group: jax.Array    # [S] group entry of the slot's sample
  slot_member: jax.Array   # [S] its member index in the group
  own_pages: jax.Array     # [S, B_max] own page ids
  own_len: jax.Array       # [S] own tokens whose KV is in the pool
  tokens: jax.Array        # [S] last sampled token, fed next step
  positions: jax.Array     # [S] its position
  generated: jax.Array     # [S] tokens of the response so far
  budget: jax.Array        # [S] the sample's token budget
  active: jax.Array        # [S] bool
  sample_idx: jax.Array    # [S]
  common_k: jax.Array      # [L, C, N, K]
  common_v: jax.Array
  common_len: jax.Array    # []


@struct.dataclass
class Prefill:
  """B prompts prefilled in one call: KV and each one's G first tokens."""
  k: jax.Array             # [L, B, Pb, N, K]
  v: jax.Array
  first_tokens: jax.Array  # [B, G]
  first_logp: jax.Array    # [B, G]
  first_logp_raw: jax.Array  # [B, G]
  # With `Engine(record_routes=True)` (MoE): the experts each prompt token
  # went to in each layer, [B, Pb, L, k]; else None.
  routes: jax.Array | None = None
  # With `Engine(top_logprobs=K)`: the K likeliest first tokens under the
  # policy (temperature 1, unfiltered), ids then log-prob bits, [B, 2K]
  # int32 (one prompt's G samples share them); else None.
  first_top: jax.Array | None = None


def pow2_at_least(n: int, cap: int, floor: int = 1) -> int:
  """The bucket of n: a power of two >= max(n, floor), at most cap."""
  return min(cap, 1 << max(0, math.ceil(math.log2(max(n, floor, 1)))))


# Smallest buckets of a decode step: listed slots per replica, then the
# jnp attention's reads (groups with live samples, pages of one prompt,
# own pages of one sample). A job whose prompts and responses fit in 8
# pages compiles one step for the whole rollout; past the floors each
# doubling costs a compile, and a bound never exceeds its cap.
STEP_FLOORS = (8, 4, 8, 8)


def step_bounds(needs, caps) -> tuple[int, ...]:
  """The static read bounds of a decode step: each need (groups, prompt
  pages, own pages) rounded up to a power of two above its floor, at
  most its cap."""
  return tuple(pow2_at_least(n, cap, floor)
               for n, cap, floor in zip(needs, caps, STEP_FLOORS[1:]))


def state_fields(cfg: ModelConfig, *, num_slots, num_groups,
                 samples_per_group, num_pages, page_size, max_prompt_pages,
                 max_own_pages, max_common_length):
  """name -> (logical axes, shape, dtype) of every DecodeState field."""
  L, N, K = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  S, R, G = num_slots, num_groups, samples_per_group
  cdt = cfg.compute_jnp_dtype
  i32 = jnp.int32
  pool = (L, N, num_pages, page_size, K)
  common = (L, max_common_length, N, K)
  slot = lambda dt=i32: (_SLOTS, (S,), dt)
  group = lambda dt=i32: (_GROUPS, (R,), dt)
  return {
      "k_pages": (_PAGES, pool, cdt), "v_pages": (_PAGES, pool, cdt),
      "group_pages": (_GROUPS + (None,), (R, max_prompt_pages), i32),
      "group_len": group(), "group_slots": (_GROUPS + (None,), (R, G), i32),
      "group_first": (_GROUPS + (None,), (R, G), i32),
      "group_prompt_id": group(), "group_seed": group(jnp.uint32),
      "slot_group": slot(), "slot_member": slot(),
      "own_pages": (_SLOTS + (None,), (S, max_own_pages), i32),
      "own_len": slot(), "tokens": slot(), "positions": slot(),
      "generated": slot(), "budget": slot(), "active": slot(jnp.bool_),
      "sample_idx": slot(),
      "common_k": (("layers", None, "kv_heads", "head_dim"), common, cdt),
      "common_v": (("layers", None, "kv_heads", "head_dim"), common, cdt),
      "common_len": ((), (), i32),
  }


def dense_context(state: DecodeState, pieces):
  """The common prefix, then each (page ids, valid length) piece in order,
  laid out densely at their true positions (each piece after the previous
  one's valid tokens): (k [L, C', N, K], v, total valid length)."""
  L, N, _, T, K = state.k_pages.shape
  size = state.common_k.shape[1] + sum(ids.shape[0] * T for ids, _ in pieces)

  def context(common, pages):
    ctx = jnp.zeros((L, size, N, K), pages.dtype)
    ctx = jax.lax.dynamic_update_slice(ctx, common, (0, 0, 0, 0))
    at = state.common_len
    for ids, length in pieces:
      dense = jnp.moveaxis(pages[:, :, ids], 1, 3)  # [L, n, T, N, K]
      ctx = jax.lax.dynamic_update_slice(
          ctx, dense.reshape(L, -1, N, K), (0, at, 0, 0))
      at = at + length
    return ctx, at

  k, total = context(state.common_k, state.k_pages)
  v, _ = context(state.common_v, state.v_pages)
  return k, v, total


def write_tokens(state: DecodeState, ids, start, count, k_LxExNxK, v_LxExNxK):
  """KV of tokens start.. (the first `count`) of one sequence into its
  pages `ids`."""
  _, _, num_pages, T, _ = state.k_pages.shape
  index = jnp.arange(k_LxExNxK.shape[1], dtype=jnp.int32)
  pos = start + index
  page = jnp.where(index < count, ids[jnp.minimum(pos // T, ids.shape[0] - 1)],
                   num_pages)
  put = lambda pages, x: pages.at[:, :, page, pos % T].set(
      x.transpose(0, 2, 1, 3).astype(pages.dtype), mode="drop")
  return state.replace(k_pages=put(state.k_pages, k_LxExNxK),
                       v_pages=put(state.v_pages, v_LxExNxK))


@struct.dataclass
class CommonPrefix:
  """A common prefix prefilled once, shared by every row of a decode state."""
  k: jax.Array         # [L, C, N, K], C = the engine's max_common_length
  v: jax.Array
  length: jax.Array    # [] int32 valid tokens (0: no common prefix)


# Columns of the packed per-slot result array.
TOKEN, VALID, LOGP, LOGP_RAW = range(4)
NUM_COLUMNS = 4


@struct.dataclass
class ResultTokens:
  """A decode call's output for every slot packed in ONE int32 array
  [W, S, 4], one row block per step of its window.

  Columns: token, valid (slot produced a token), sampling log-prob and raw
  log-prob (fp32 bit patterns): what the driver reads (it ends a sample on
  its stop token or budget itself). One array means one device->host copy
  per call.
  """
  data: jax.Array

  @staticmethod
  def pack(tokens, valid, logp, logp_raw, routes_SxC=None,
           top_Sx2K=None) -> "ResultTokens":
    """`routes_SxC` (`Engine(record_routes=True)`): the experts each slot's
    fed token went to, L x k columns after the four; `top_Sx2K`
    (`Engine(top_logprobs=K)`, `top_columns`): the K likeliest tokens,
    last."""
    cols = [tokens, valid.astype(jnp.int32),
            jax.lax.bitcast_convert_type(logp.astype(jnp.float32), jnp.int32),
            jax.lax.bitcast_convert_type(logp_raw.astype(jnp.float32),
                                         jnp.int32)]
    data = jnp.stack([c.reshape(-1).astype(jnp.int32) for c in cols], -1)
    for extra in (routes_SxC, top_Sx2K):
      if extra is not None:
        data = jnp.concatenate([data, extra.astype(jnp.int32)], -1)
    return ResultTokens(data)

  def copy_to_host_async(self) -> None:
    self.data.copy_to_host_async()

  def convert_to_numpy(self, top_k: int = 0) -> "HostResult":
    return HostResult(np.asarray(self.data), top_k)


def top_columns(logits_BxV, k: int):
  """The k likeliest tokens of each row under the policy's own
  distribution (log-softmax of the logits: temperature 1, unfiltered), as
  [B, 2k] int32: their ids, then their log-probs' fp32 bit patterns."""
  logp_k, ids_k = jax.lax.top_k(
      jax.nn.log_softmax(logits_BxV.astype(jnp.float32), axis=-1), k)
  return jnp.concatenate(
      [ids_k.astype(jnp.int32),
       jax.lax.bitcast_convert_type(logp_k, jnp.int32)], -1)


def split_top(top_2K: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`top_columns`' row(s) on the host: (ids, log-probs)."""
  k = top_2K.shape[-1] // 2
  return top_2K[..., :k], top_2K[..., k:].view(np.float32)


@dataclasses.dataclass
class HostResult:
  """Numpy view of ResultTokens (`top_k`: the engine's `top_logprobs`)."""
  data: np.ndarray
  top_k: int = 0

  def window(self, j: int) -> "HostResult":
    """Step j of a decode window."""
    return HostResult(self.data[j], self.top_k)

  @property
  def tokens(self):
    return self.data[:, TOKEN]

  @property
  def valid(self):
    return self.data[:, VALID].astype(bool)

  @property
  def logp(self):
    return self.data[:, LOGP].view(np.float32)

  @property
  def logp_raw(self):
    return self.data[:, LOGP_RAW].view(np.float32)

  @property
  def routes(self):
    """[S, L x k] the recorded experts (no columns: not recorded)."""
    return self.data[:, NUM_COLUMNS:self.data.shape[1] - 2 * self.top_k]

  @property
  def top(self):
    """[S, 2K] `top_columns` (no columns: not recorded)."""
    return self.data[:, self.data.shape[1] - 2 * self.top_k:]
