"""Pallas TPU (Mosaic) kernel for prefix-shared decode attention.

Dimension letters as in `prefix_decode_attention.py`: R rows, G samples per
row, H query heads, N kv heads, K head dim, P prefix length, M suffix length;
Q = H // N query heads per kv head.

One kernel body (`_kernel`: a flash-decoding online softmax over kv blocks,
lengths by scalar prefetch) runs on two grids, with `bn` kv heads per step:
  prefix: grid (R, N/bn, cdiv(P, block_p)). Per kv head, the G*Q queries of
    a row form one [G*Q, K] block multiplied against each [block_p, K] prefix
    block, so the prompt KV is read once per row instead of once per sample.
  suffix: grid (R, G, N/bn, cdiv(M, block_m)). Each sample's Q queries per
    kv head attend to its own [block_m, K] blocks (ragged decode attention).
Each call returns its normalised fp32 output and log-sum-exp; the two parts
merge exactly in fp32 with `merge_parts` (a few [R,G,H,K] fp32 element-wise
ops, negligible next to the KV reads of decode).

Lengths only decide work and traffic, not shapes: kv blocks starting at or past
a length skip their compute, and their index_map clamps to the last needed
block, so the pipeline issues no DMA for them. The padded tail of the last
block (unspecified memory on TPU, NaN in interpret mode) is masked in the
scores and zeroed in V, so it never reaches the output.

The kernel reads head-major layouts ([R,N,P,K], [R,G,N,M,K]) so that every
block's two minor dims are (tokens, head_dim), which Mosaic tiles natively;
the wrapper transposes the engine's token-major caches. That transpose is one
extra pass over the KV (still once per row for the prefix, not G times); a
head-major engine cache would remove it.

The optional third part (a common prefix shared by ALL rows, see
`prefix_decode_attention.py`) is not a Pallas kernel: it is
`common_prefix_part` in jnp, merged with the kernels' fp32 parts by the same
`merge_parts` before the cast. Its keys are the same for every row, so XLA
reads them once per step as one [R*G*Q, K] x [K, C] matmul per kv head; a
kernel would add nothing but a second copy of that code. (The prefix kernel
with one row of R*G*Q queries would do it too, but its query block would
then hold the whole batch in VMEM.)

Inference only: there is no VJP (decode never differentiates through it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from kernels_pallas import online_softmax_tpu as osm
from kernels_pallas.attention_parts import common_prefix_part, merge_parts

_SUBLANES = 8


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the two kernels.

  Attributes:
    block_p: prefix tokens per grid step (multiple of 8, the sublane tile).
    block_m: suffix tokens per grid step (multiple of 8).
    block_heads: kv heads per grid step; the largest divisor of N up to this
      is used. Several heads per step amortise the fixed per-step cost,
      which dominates the small decode blocks (a few query rows each).
  A token block longer than its sequence shrinks to the sequence length,
  which Mosaic accepts as a full-dim block.
  """

  block_p: int = 256
  block_m: int = 128
  block_heads: int = 8

  def __post_init__(self):
    for name in ("block_p", "block_m"):
      size = getattr(self, name)
      if size <= 0 or size % _SUBLANES:
        raise ValueError(
            f"{name} must be a positive multiple of {_SUBLANES}, got {size}")
    if self.block_heads <= 0:
      raise ValueError(f"block_heads must be positive, got {self.block_heads}")


def _kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_scr, l_scr,
            acc_scr, *, length_index, kv_axis, block_kv, scale,
            logit_softcap):
  """Online softmax of [heads, rows, K] queries over one kv sequence."""
  j = pl.program_id(kv_axis)
  length = lengths_ref[length_index()]
  start = j * block_kv

  @pl.when(j == 0)
  def _init():
    osm.init(m_scr, l_scr, acc_scr)

  @pl.when(start < length)
  def _step():
    block_shape = (q_ref.shape[1], k_ref.shape[1])  # [rows, block_kv]
    kv_live = start + jax.lax.broadcasted_iota(
        jnp.int32, block_shape, 1) < length
    v_live = start + jax.lax.broadcasted_iota(
        jnp.int32, v_ref.shape[1:], 0) < length
    # Static unroll over the head block: each head is 2-D MXU work.
    for h in range(q_ref.shape[0]):
      s = jax.lax.dot_general(
          q_ref[h], k_ref[h], osm.NT_DIMS,
          preferred_element_type=jnp.float32) * scale
      if logit_softcap is not None:
        s = logit_softcap * jnp.tanh(s / logit_softcap)
      s = jnp.where(kv_live, s, -jnp.inf)
      # V past the length is the padded tail: unspecified on TPU.
      v = jnp.where(v_live, v_ref[h].astype(jnp.float32), 0.0)
      osm.update(h, s, v, m_scr, l_scr, acc_scr)

  @pl.when(j == pl.num_programs(kv_axis) - 1)
  def _finalize():
    osm.finalize(m_scr, l_scr, acc_scr, o_ref, lse_ref)


def _kv_block_index(j, length, block_kv):
  """KV block for grid step j, clamped so skipped steps re-use (no DMA)."""
  last = jnp.maximum(pl.cdiv(length, block_kv) - 1, 0)
  return jnp.minimum(j, last)


def _prefix_part(q_RxNxSxK, k_RxNxPxK, v_RxNxPxK, len_R, *, block_p,
                 block_heads, scale, logit_softcap, interpret):
  """Prefix attention: the S = G*Q queries of a row against its prompt."""
  R, N, S, K = q_RxNxSxK.shape
  P = k_RxNxPxK.shape[2]
  block = min(block_p, P)
  bn = block_heads

  def kv_map(r, n, j, len_ref):
    return r, n, _kv_block_index(j, len_ref[r], block), 0

  row_map = lambda r, n, j, len_ref: (r, n, 0, 0)
  kernel = functools.partial(
      _kernel, length_index=lambda: pl.program_id(0), kv_axis=2,
      block_kv=block, scale=scale, logit_softcap=logit_softcap)
  kv_bytes = 2 * R * N * P * K * k_RxNxPxK.dtype.itemsize
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(R, N // bn, pl.cdiv(P, block)),
          in_specs=[
              pl.BlockSpec((None, bn, S, K), row_map),
              pl.BlockSpec((None, bn, block, K), kv_map),
              pl.BlockSpec((None, bn, block, K), kv_map),
          ],
          out_specs=[
              pl.BlockSpec((None, bn, S, K), row_map),
              pl.BlockSpec((None, bn, S, osm.LANES), row_map),
          ],
          scratch_shapes=osm.scratch(bn, S, K)),
      out_shape=[
          jax.ShapeDtypeStruct((R, N, S, K), jnp.float32),
          jax.ShapeDtypeStruct((R, N, S, osm.LANES), jnp.float32),
      ],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=(pltpu.PARALLEL, pltpu.PARALLEL,
                               pltpu.ARBITRARY)),
      cost_estimate=pl.CostEstimate(
          flops=4 * R * N * S * P * K, transcendentals=R * N * S * P,
          bytes_accessed=kv_bytes),
      interpret=interpret,
      name="prefix_decode_attention_prefix",
  )(len_R, q_RxNxSxK, k_RxNxPxK, v_RxNxPxK)


def _suffix_part(q_RxNxGxQxK, k_RxGxNxMxK, v_RxGxNxMxK, len_RG, *, block_m,
                 block_heads, scale, logit_softcap, interpret):
  """Suffix attention: each sample's Q queries against its own tokens."""
  R, N, G, Q, K = q_RxNxGxQxK.shape
  M = k_RxGxNxMxK.shape[3]
  block = min(block_m, M)
  bn = block_heads

  def kv_map(r, g, n, j, len_ref):
    return r, g, n, _kv_block_index(j, len_ref[r * G + g], block), 0

  row_map = lambda r, g, n, j, len_ref: (r, n, g, 0, 0)
  kernel = functools.partial(
      _kernel, length_index=lambda: pl.program_id(0) * G + pl.program_id(1),
      kv_axis=3, block_kv=block, scale=scale, logit_softcap=logit_softcap)
  kv_bytes = 2 * R * G * N * M * K * k_RxGxNxMxK.dtype.itemsize
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(R, G, N // bn, pl.cdiv(M, block)),
          in_specs=[
              pl.BlockSpec((None, bn, None, Q, K), row_map),
              pl.BlockSpec((None, None, bn, block, K), kv_map),
              pl.BlockSpec((None, None, bn, block, K), kv_map),
          ],
          out_specs=[
              pl.BlockSpec((None, bn, None, Q, K), row_map),
              pl.BlockSpec((None, bn, None, Q, osm.LANES), row_map),
          ],
          scratch_shapes=osm.scratch(bn, Q, K)),
      out_shape=[
          jax.ShapeDtypeStruct((R, N, G, Q, K), jnp.float32),
          jax.ShapeDtypeStruct((R, N, G, Q, osm.LANES), jnp.float32),
      ],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=(pltpu.PARALLEL, pltpu.PARALLEL, pltpu.PARALLEL,
                               pltpu.ARBITRARY)),
      cost_estimate=pl.CostEstimate(
          flops=4 * R * G * N * Q * M * K, transcendentals=R * G * N * Q * M,
          bytes_accessed=kv_bytes),
      interpret=interpret,
      name="prefix_decode_attention_suffix",
  )(len_RG.reshape(R * G), q_RxNxGxQxK, k_RxGxNxMxK, v_RxGxNxMxK)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "logit_softcap", "return_lse", "block_sizes",
                     "interpret"))
def prefix_decode_attention_tpu(
    q_RxGxHxK: jax.Array,
    prefix_k_RxPxNxK: jax.Array,
    prefix_v_RxPxNxK: jax.Array,
    prefix_len_R: jax.Array,
    suffix_k_RxGxMxNxK: jax.Array,
    suffix_v_RxGxMxNxK: jax.Array,
    suffix_len_RxG: jax.Array,
    *,
    common_k_CxNxK: jax.Array | None = None,
    common_v_CxNxK: jax.Array | None = None,
    common_len: jax.Array | None = None,
    scale: float | None = None,
    logit_softcap: float | None = None,
    return_lse: bool = False,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: Any = False,
):
  """Prefix-shared decode attention with Pallas TPU kernels.

  Same contract as `prefix_decode_attention_reference`.

  Args:
    q_RxGxHxK: queries of the current decode step.
    prefix_k_RxPxNxK: prompt keys, one copy per row.
    prefix_v_RxPxNxK: prompt values.
    prefix_len_R: valid prompt tokens per row (0: a free row).
    suffix_k_RxGxMxNxK: each sample's own keys.
    suffix_v_RxGxMxNxK: each sample's own values.
    suffix_len_RxG: valid own tokens per sample (0: empty suffix).
    common_k_CxNxK: optional common-prefix keys shared by all rows (jnp part).
    common_v_CxNxK: its values.
    common_len: [] its valid tokens.
    scale: logit scale; default K**-0.5.
    logit_softcap: if set, logits become cap * tanh(logits / cap).
    return_lse: also return the [R,G,H] fp32 log-sum-exp (-inf: no keys).
    block_sizes: tiling of the two kernels (`BlockSizes`).
    interpret: False on TPU; True (HLO interpreter) or a
      `pltpu.InterpretParams` to run on CPU.

  Returns:
    out [R,G,H,K] in q's dtype (zeros for a query without keys), and the
    lse if `return_lse`.
  """
  R, G, H, K = q_RxGxHxK.shape
  P, N = prefix_k_RxPxNxK.shape[1:3]
  M = suffix_k_RxGxMxNxK.shape[2]
  Q = H // N
  scale = K**-0.5 if scale is None else scale
  # Lengths past the cache would unmask the padded tail of the last block.
  prefix_len_R = jnp.clip(prefix_len_R.astype(jnp.int32), 0, P)
  suffix_len_RxG = jnp.clip(suffix_len_RxG.astype(jnp.int32), 0, M)
  q_RxNxGxQxK = q_RxGxHxK.reshape(R, G, N, Q, K).transpose(0, 2, 1, 3, 4)
  kw = dict(block_heads=math.gcd(N, block_sizes.block_heads), scale=scale,
            logit_softcap=logit_softcap, interpret=interpret)

  parts = []
  if P:
    o, lse = _prefix_part(
        q_RxNxGxQxK.reshape(R, N, G * Q, K),
        prefix_k_RxPxNxK.transpose(0, 2, 1, 3),
        prefix_v_RxPxNxK.transpose(0, 2, 1, 3),
        prefix_len_R, block_p=block_sizes.block_p, **kw)
    parts.append((o.reshape(R, N, G, Q, K), lse[..., 0].reshape(R, N, G, Q)))
  if M:
    o, lse = _suffix_part(
        q_RxNxGxQxK,
        suffix_k_RxGxMxNxK.transpose(0, 1, 3, 2, 4),
        suffix_v_RxGxMxNxK.transpose(0, 1, 3, 2, 4),
        suffix_len_RxG, block_m=block_sizes.block_m, **kw)
    parts.append((o, lse[..., 0]))
  if common_k_CxNxK is not None and common_k_CxNxK.shape[0]:
    o, lse = common_prefix_part(
        q_RxNxGxQxK.transpose(0, 2, 1, 3, 4), common_k_CxNxK, common_v_CxNxK,
        common_len, scale=scale, logit_softcap=logit_softcap)
    parts.append((o.transpose(0, 2, 1, 3, 4), lse.transpose(0, 2, 1, 3)))
  if not parts:  # No keys at all: zeros and lse -inf, by convention.
    parts.append((jnp.zeros((R, N, G, Q, K), jnp.float32),
                  jnp.full((R, N, G, Q), -jnp.inf, jnp.float32)))

  out, lse = merge_parts(parts)  # fp32, exact.
  out = out.transpose(0, 2, 1, 3, 4).reshape(R, G, H, K).astype(q_RxGxHxK.dtype)
  if return_lse:
    return out, lse.transpose(0, 2, 1, 3).reshape(R, G, H)
  return out
