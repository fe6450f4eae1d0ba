"""Engine data: the prefix-shared decode state, prefill results, packed results.

Slots are a flat range [0, R*G): slot = row * G + j. A row holds one prompt's
KV once (`prefix_*`); its G slots hold the samples' own tokens (`suffix_*`).
Two-level sharing: a common prefix in front of every prompt of a batch (a
system prompt, few-shot examples) is stored once for all rows (`common_*`);
rows then hold only the tokens after it.
Dimension letters: L layers, R rows, G samples per row, P max prompt length
(after the common prefix), M max new tokens, N kv heads, K head dim, C max
common-prefix length.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# Logical axes of each decode-state field (for the layout's shardings).
STATE_AXES = {
    "prefix_k": ("layers", "batch", "cache_length", "kv_heads", "head_dim"),
    "prefix_v": ("layers", "batch", "cache_length", "kv_heads", "head_dim"),
    "prefix_len": ("batch",),
    "suffix_k": ("layers", "batch", None, "cache_length", "kv_heads",
                 "head_dim"),
    "suffix_v": ("layers", "batch", None, "cache_length", "kv_heads",
                 "head_dim"),
    "suffix_len": ("batch", None),
    "tokens": ("batch", None),
    "positions": ("batch", None),
    "generated": ("batch", None),
    "active": ("batch", None),
    "prompt_id": ("batch",),
    "sample_idx": ("batch", None),
    "seed": ("batch",),
    "common_k": ("layers", "cache_length", "kv_heads", "head_dim"),
    "common_v": ("layers", "cache_length", "kv_heads", "head_dim"),
    "common_len": (),
}


@struct.dataclass
class DecodeState:
  """Everything `generate` reads and writes; pure pytree, donated each step."""
  prefix_k: jax.Array     # [L, R, P, N, K] prompt keys, once per row
  prefix_v: jax.Array     # [L, R, P, N, K]
  prefix_len: jax.Array   # [R] valid prompt tokens
  suffix_k: jax.Array     # [L, R, G, M, N, K] each sample's own keys
  suffix_v: jax.Array     # [L, R, G, M, N, K]
  suffix_len: jax.Array   # [R, G] own tokens already in the cache
  tokens: jax.Array       # [R, G] last sampled token, fed next step
  positions: jax.Array    # [R, G] position of `tokens`
  generated: jax.Array    # [R, G] tokens generated so far (incl. `tokens`)
  active: jax.Array       # [R, G] live and not finished
  prompt_id: jax.Array    # [R]
  sample_idx: jax.Array   # [R, G]
  seed: jax.Array         # [R] uint32 sampling seed of the row's request
  common_k: jax.Array     # [L, C, N, K] common prefix, once for all rows
  common_v: jax.Array     # [L, C, N, K]
  common_len: jax.Array   # [] valid common tokens (0: none); prompt rows
                          # start at this position


@struct.dataclass
class CommonPrefix:
  """A common prefix prefilled once, shared by every row of a decode state."""
  k: jax.Array         # [L, C, N, K], C = the engine's max_common_length
  v: jax.Array
  length: jax.Array    # [] int32 valid tokens (0: no common prefix)


@struct.dataclass
class Prefix:
  """A prefill result: one prompt's KV and its G first tokens.

  With a common prefix set on the engine, the prompt is the part after it:
  `k`, `v` and `true_length` cover only those tokens.
  """
  k: jax.Array              # [L, Pb, N, K] for the prompt's bucket Pb
  v: jax.Array
  true_length: jax.Array    # [] int32
  first_tokens: jax.Array   # [G]
  first_logp: jax.Array     # [G] under the sampling distribution
  first_logp_raw: jax.Array  # [G] temperature-1 policy log-prob
  prompt_id: int = struct.field(pytree_node=False, default=0)
  sample_indices: tuple[int, ...] = struct.field(pytree_node=False,
                                                 default=())
  seed: int = struct.field(pytree_node=False, default=0)
  # Which common prefix of the engine the prompt was prefilled after.
  common_version: int = struct.field(pytree_node=False, default=0)


# Columns of the packed per-slot result array.
TOKEN, VALID, DONE, LENGTH, LOGP, LOGP_RAW = range(6)
NUM_COLUMNS = 6


@struct.dataclass
class ResultTokens:
  """One step's output for every slot packed in ONE int32 array [S, 6]
  (the paged engine: [W, S, 6], one row block per step of its window).

  Columns: token, valid (slot produced a token), done (it finished now),
  length (tokens generated so far), sampling log-prob and raw log-prob (fp32
  bit patterns). One array means one device->host copy per step.
  """
  data: jax.Array

  @staticmethod
  def pack(tokens, valid, done, length, logp, logp_raw) -> "ResultTokens":
    cols = [tokens, valid.astype(jnp.int32), done.astype(jnp.int32), length,
            jax.lax.bitcast_convert_type(logp.astype(jnp.float32), jnp.int32),
            jax.lax.bitcast_convert_type(logp_raw.astype(jnp.float32),
                                         jnp.int32)]
    return ResultTokens(jnp.stack([c.reshape(-1).astype(jnp.int32)
                                   for c in cols], axis=-1))

  def copy_to_host_async(self) -> None:
    self.data.copy_to_host_async()

  def convert_to_numpy(self) -> "HostResult":
    return HostResult(np.asarray(self.data))


@dataclasses.dataclass
class HostResult:
  """Numpy view of ResultTokens."""
  data: np.ndarray

  def window(self, j: int) -> "HostResult":
    """Step j of a paged decode window ([W, S, 6] results)."""
    return HostResult(self.data[j])

  @property
  def tokens(self):
    return self.data[:, TOKEN]

  @property
  def valid(self):
    return self.data[:, VALID].astype(bool)

  @property
  def done(self):
    return self.data[:, DONE].astype(bool)

  @property
  def lengths(self):
    return self.data[:, LENGTH]

  @property
  def logp(self):
    return self.data[:, LOGP].view(np.float32)

  @property
  def logp_raw(self):
    return self.data[:, LOGP_RAW].view(np.float32)
