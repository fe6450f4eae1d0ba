"""Pallas (Triton) kernel for one part of paged decode attention, for GPU.

A segment is a group (its G members' queries against the group's prompt
pages: M = G * H/N query rows, so the prompt is read once for all of them)
or a slot (its H/N query rows against its own pages). One program per
(segment, kv head, block of query rows, split of the keys): it walks its
share of the segment's page table, `pages_per_block` pages at a time,
gathering those pages straight from the pool (no copy of the pool, no
dense KV), with an online softmax in fp32, and returns the normalised
output and the log-sum-exp per query row; the splits of a segment merge
exactly, and so do the prompt, own and common parts
(`paged_decode_attention.py`). A segment of length 0 reads nothing and
returns zeros and -inf. How many row blocks and splits: `launch_shape`.

Runs on GPU (Triton), and on CPU in interpret mode (tests). The jnp
reference is `paged_decode_attention_reference`.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from kernels_pallas.attention_parts import cap_logits, merge_parts

NEG_INF = float("-inf")


def _kernel(table_ref, bounds_ref, q_ref, row_lo_ref, k_ref, v_ref, o_ref,
            lse_ref, *, scale, softcap, pages_per_block, num_splits):
  """q_ref [Mb, K] (one block of a segment's query rows); k_ref, v_ref
  [L, P, T, K] (one kv head of the pool); table_ref [A]; bounds_ref [3]
  (length, first key any row sees, layer); row_lo_ref [Mb] (each row's
  first key); o_ref [Mb, K] and lse_ref [Mb]: this split's part."""
  M, K = q_ref.shape
  T = k_ref.shape[2]
  block = pages_per_block * T
  length, first, layer = bounds_ref[0], bounds_ref[1], bounds_ref[2]
  # Dots in the pool's dtype with fp32 sums: bf16 tensor-core products
  # (exact) for a bf16 pool, the probabilities rounded to bf16 for P.V as
  # flash attention does; an fp32 pool asks for IEEE fp32, not Triton's
  # default TF32 (~1e-3 off). A tensor-core dot needs every dimension >= 16:
  # a smaller head dim (tiny test models) runs fp32 dots.
  dtype = k_ref.dtype if K >= 16 else jnp.float32
  precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
  q = q_ref[...].astype(dtype)
  row_lo = row_lo_ref[...]

  def body(b, carry):
    acc, m_prev, l_prev = carry
    pages = table_ref[pl.ds(b * pages_per_block, pages_per_block)]
    k = k_ref[layer, pages].reshape(block, K).astype(dtype)
    v = v_ref[layer, pages].reshape(block, K).astype(dtype)
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [M, blk]
    s = cap_logits(s, softcap)
    idx = b * block + jnp.arange(block)
    s = jnp.where((idx < length)[None, :] & (idx[None, :] >= row_lo[:, None]),
                  s, NEG_INF)
    m_next = jnp.maximum(m_prev, s.max(axis=-1))
    m_safe = jnp.where(m_next == NEG_INF, 0.0, m_next)
    correction = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    acc = acc * correction[:, None] + plgpu.dot(p.astype(dtype), v,
                                                precision=precision)
    return acc, m_next, l_prev * correction + p.sum(axis=-1)

  # This program's share of the segment's key blocks (flash-decoding: a
  # long segment is walked by num_splits programs at once).
  blocks = (length + block - 1) // block
  per_split = (blocks + num_splits - 1) // num_splits
  split = pl.program_id(3)
  hi = jnp.minimum(blocks, (split + 1) * per_split)
  lo = jnp.minimum(jnp.maximum(first // block, split * per_split), hi)
  acc, m, l = lax.fori_loop(
      lo, hi, body,
      (jnp.zeros((M, K), jnp.float32), jnp.full((M,), NEG_INF, jnp.float32),
       jnp.zeros((M,), jnp.float32)))
  has_keys = l > 0
  l_safe = jnp.where(has_keys, l, 1.0)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(has_keys, m + jnp.log(l_safe), NEG_INF)


def launch_shape(X, N, M, A, *, pages_per_block=4, block_rows=128,
                 target_programs=512, min_blocks_per_split=8):
  """(row blocks, key splits) of a call.

  A segment's M query rows go in blocks of `block_rows`: up to 128 rows
  a program at head dim 128 (`rows_for_head_dim`), so that a group's keys
  and values are read once for all its G*Q rows (such a program runs 8
  warps, `warps_for`, for its fp32 accumulator's registers). Its page table is
  walked by several programs (splits, powers of two) while X * N * row
  blocks programs would leave the GPU's SMs idle (a few long shared
  prompts), each walking at least `min_blocks_per_split` key blocks, so
  that the partial outputs written stay small next to the keys read.
  Measured on an H200 at Qwen2.5-1.5B's decode shapes
  (`benchmarks.paged_kernel`; docs/results.md): a group's prompt part
  took 116 us in 4 blocks of 32 rows at 4 warps and 52 us in one block
  of 128 at 8 warps."""
  row_blocks = max(1, M // block_rows) if M % block_rows == 0 else 1
  programs = X * N * row_blocks
  most = max(1, -(-A // pages_per_block) // min_blocks_per_split)
  splits = 1
  while splits * 2 <= most and programs * splits * 2 <= target_programs:
    splits *= 2
  return row_blocks, splits


def rows_for_head_dim(head_dim: int) -> int:
  """Query rows a program holds: as many as keep its fp32 accumulator at
  the 128 x 128 measured at head dim 128 (`launch_shape`), so a larger
  head dim gets fewer rows (256: 64) and a smaller one more."""
  return max(16, (128 * 128) // head_dim)


def warps_for(rows: int) -> int:
  """Triton warps of a program holding `rows` query rows: 8 from 64 rows
  (the accumulator's registers spread over twice the threads), else 4 (a
  slot's few rows: more programs resident per SM)."""
  return 8 if rows >= 64 else 4


def paged_part(q_XxNxMxK, k_pages_LxNxPxTxK, v_pages_LxNxPxTxK, table_XxA,
               length_X, row_lo_XxM=None, *, layer, scale,
               logit_softcap=None, pages_per_block=4, interpret=False,
               num_warps=None, block_rows=None, num_splits=None):
  """Attention of each segment's queries to its pages.

  Args:
    q_XxNxMxK: M query rows per segment and kv head.
    k_pages_LxNxPxTxK, v_pages_LxNxPxTxK: the page pool of all layers.
    table_XxA: page ids of each segment (entries past its length unread).
    length_X: keys of each segment (0: none).
    row_lo_XxM: optional first key index each query row sees (a sliding
      window; keys before it are masked, blocks before every row's are not
      read).
    layer: the layer to read (may be traced).
    scale, logit_softcap: logit scale and optional soft-cap.
    pages_per_block: pages gathered per loop iteration.
    interpret: run the kernel in interpret mode (CPU).
    num_warps: Triton warps per program; None: `warps_for`'s.
    block_rows: query rows per program; None: `rows_for_head_dim`'s.
    num_splits: programs per segment's keys; None: `launch_shape`'s.

  Returns:
    out [X, N, M, K] fp32 (zeros for an empty segment), lse [X, N, M] fp32.
  """
  X, N, M, K = q_XxNxMxK.shape
  L, _, P, T, _ = k_pages_LxNxPxTxK.shape
  A = table_XxA.shape[1]
  block_rows = rows_for_head_dim(K) if block_rows is None else block_rows
  row_blocks, splits = launch_shape(X, N, M, A,
                                    pages_per_block=pages_per_block,
                                    block_rows=block_rows)
  splits = splits if num_splits is None else int(num_splits)
  Mb = M // row_blocks
  if row_lo_XxM is None:
    row_lo_XxM = jnp.zeros((X, M), jnp.int32)
  row_lo_XxM = row_lo_XxM.astype(jnp.int32)
  bounds = jnp.stack([length_X.astype(jnp.int32), row_lo_XxM.min(axis=1),
                      jnp.full((X,), layer, jnp.int32)], axis=1)
  pad = -A % pages_per_block
  table = jnp.pad(table_XxA.astype(jnp.int32), ((0, 0), (0, pad)))
  table = jnp.clip(table, 0, P - 1)
  kernel = functools.partial(_kernel, scale=scale, softcap=logit_softcap,
                             pages_per_block=pages_per_block,
                             num_splits=splits)
  num_warps = warps_for(Mb) if num_warps is None else num_warps
  params = (None if interpret else
            plgpu.CompilerParams(num_warps=num_warps, num_stages=2))
  out, lse = pl.pallas_call(
      kernel,
      grid=(X, N, row_blocks, splits),
      in_specs=[
          pl.BlockSpec((None, A + pad), lambda x, n, r, s: (x, 0)),
          pl.BlockSpec((None, 3), lambda x, n, r, s: (x, 0)),
          pl.BlockSpec((None, None, Mb, K), lambda x, n, r, s: (x, n, r, 0)),
          pl.BlockSpec((None, Mb), lambda x, n, r, s: (x, r)),
          pl.BlockSpec((L, None, P, T, K),
                       lambda x, n, r, s: (0, n, 0, 0, 0)),
          pl.BlockSpec((L, None, P, T, K),
                       lambda x, n, r, s: (0, n, 0, 0, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, Mb, K),
                       lambda x, n, r, s: (x, n, s, r, 0)),
          pl.BlockSpec((None, None, None, Mb),
                       lambda x, n, r, s: (x, n, s, r)),
      ],
      out_shape=[jax.ShapeDtypeStruct((X, N, splits, M, K), jnp.float32),
                 jax.ShapeDtypeStruct((X, N, splits, M), jnp.float32)],
      interpret=interpret,
      compiler_params=params,
      name="paged_decode_part",
  )(table, bounds, q_XxNxMxK, row_lo_XxM, k_pages_LxNxPxTxK,
    v_pages_LxNxPxTxK)
  if splits == 1:
    return out[:, :, 0], lse[:, :, 0]
  return merge_parts([(out[:, :, i], lse[:, :, i]) for i in range(splits)])


def rows_for_dot(m: int) -> int:
  """Query rows padded for the GPU matmul (a power of two, at least 16)."""
  return max(16, 1 << math.ceil(math.log2(max(m, 1))))
