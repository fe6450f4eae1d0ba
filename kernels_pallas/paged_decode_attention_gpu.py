"""Pallas (Triton) kernel for one part of paged decode attention, for GPU.

One program per (segment, kv head). A segment is a group (its G members'
queries against the group's prompt pages: M = G * H/N query rows, so the
prompt is read once for all of them) or a slot (its H/N query rows against
its own pages). The program walks the segment's page table up to its
length, `pages_per_block` pages at a time, gathering those pages straight
from the pool (no copy of the pool, no dense KV), with an online softmax in
fp32. It returns the normalised output and the log-sum-exp per query row,
so the caller merges the prompt, own and common parts exactly
(`paged_decode_attention.py`). A segment of length 0 reads nothing and
returns zeros and -inf.

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

NEG_INF = float("-inf")


def _kernel(table_ref, bounds_ref, q_ref, row_lo_ref, k_ref, v_ref, o_ref,
            lse_ref, *, scale, softcap, pages_per_block):
  """q_ref [M, K]; k_ref, v_ref [L, P, T, K] (one kv head of the pool);
  table_ref [A]; bounds_ref [3] (length, first key any row sees, layer);
  row_lo_ref [M] (each row's first key); o_ref [M, K]; lse_ref [M]."""
  M, K = q_ref.shape
  T = k_ref.shape[2]
  block = pages_per_block * T
  length, first, layer = bounds_ref[0], bounds_ref[1], bounds_ref[2]
  q = q_ref[...].astype(jnp.float32) * scale
  row_lo = row_lo_ref[...]

  def body(b, carry):
    acc, m_prev, l_prev = carry
    pages = table_ref[pl.ds(b * pages_per_block, pages_per_block)]
    k = k_ref[layer, pages].reshape(block, K).astype(jnp.float32)
    v = v_ref[layer, pages].reshape(block, K).astype(jnp.float32)
    s = plgpu.dot(q, k, trans_b=True)                             # [M, block]
    if softcap is not None:
      s = softcap * jnp.tanh(s / softcap)
    idx = b * block + jnp.arange(block)
    s = jnp.where((idx < length)[None, :] & (idx[None, :] >= row_lo[:, None]),
                  s, NEG_INF)
    m_next = jnp.maximum(m_prev, s.max(axis=-1))
    m_safe = jnp.where(m_next == NEG_INF, 0.0, m_next)
    correction = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    acc = acc * correction[:, None] + plgpu.dot(p, v)
    return acc, m_next, l_prev * correction + p.sum(axis=-1)

  blocks = (length + block - 1) // block
  acc, m, l = lax.fori_loop(
      jnp.minimum(first // block, blocks), blocks, body,
      (jnp.zeros((M, K), jnp.float32), jnp.full((M,), NEG_INF, jnp.float32),
       jnp.zeros((M,), jnp.float32)))
  has_keys = l > 0
  l_safe = jnp.where(has_keys, l, 1.0)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(has_keys, m + jnp.log(l_safe), NEG_INF)


def paged_part(q_XxNxMxK, k_pages_LxNxPxTxK, v_pages_LxNxPxTxK, table_XxA,
               length_X, row_lo_XxM=None, *, layer, scale,
               logit_softcap=None, pages_per_block=4, interpret=False,
               num_warps=4):
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
    num_warps: Triton warps per program.

  Returns:
    out [X, N, M, K] fp32 (zeros for an empty segment), lse [X, N, M] fp32.
  """
  X, N, M, K = q_XxNxMxK.shape
  L, _, P, T, _ = k_pages_LxNxPxTxK.shape
  A = table_XxA.shape[1]
  if row_lo_XxM is None:
    row_lo_XxM = jnp.zeros((X, M), jnp.int32)
  row_lo_XxM = row_lo_XxM.astype(jnp.int32)
  bounds = jnp.stack([length_X.astype(jnp.int32), row_lo_XxM.min(axis=1),
                      jnp.full((X,), layer, jnp.int32)], axis=1)
  pad = -A % pages_per_block
  table = jnp.pad(table_XxA.astype(jnp.int32), ((0, 0), (0, pad)))
  table = jnp.clip(table, 0, P - 1)
  kernel = functools.partial(_kernel, scale=scale, softcap=logit_softcap,
                             pages_per_block=pages_per_block)
  params = (None if interpret else
            plgpu.CompilerParams(num_warps=num_warps, num_stages=2))
  return pl.pallas_call(
      kernel,
      grid=(X, N),
      in_specs=[
          pl.BlockSpec((None, A + pad), lambda x, n: (x, 0)),
          pl.BlockSpec((None, 3), lambda x, n: (x, 0)),
          pl.BlockSpec((None, None, M, K), lambda x, n: (x, n, 0, 0)),
          pl.BlockSpec((None, M), lambda x, n: (x, 0)),
          pl.BlockSpec((L, None, P, T, K), lambda x, n: (0, n, 0, 0, 0)),
          pl.BlockSpec((L, None, P, T, K), lambda x, n: (0, n, 0, 0, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, M, K), lambda x, n: (x, n, 0, 0)),
          pl.BlockSpec((None, None, M), lambda x, n: (x, n, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct((X, N, M, K), jnp.float32),
                 jax.ShapeDtypeStruct((X, N, M), jnp.float32)],
      interpret=interpret,
      compiler_params=params,
      name="paged_decode_part",
  )(table, bounds, q_XxNxMxK, row_lo_XxM, k_pages_LxNxPxTxK,
    v_pages_LxNxPxTxK)


def rows_for_dot(m: int) -> int:
  """Query rows padded for the GPU matmul (a power of two, at least 16)."""
  return max(16, 1 << math.ceil(math.log2(max(m, 1))))
