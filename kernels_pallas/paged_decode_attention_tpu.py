"""Pallas TPU (Mosaic) kernel for one part of paged decode attention.

The TPU twin of `paged_decode_attention_gpu.py`, with the same contract: a
segment is a group (its G members' queries against the group's prompt
pages: M = G * H/N query rows per kv head, so the prompt is read once for
all of them) or a slot (its H/N query rows against its own pages). It
returns the normalised fp32 output and the log-sum-exp per query row; the
caller merges the prompt, own and common parts exactly
(`paged_decode_attention.py`).

Grid (segment, kv-head block, page block). A page block is
`pages_per_block` pages, each its own BlockSpec on the head-major pool of
all layers [L, N, P, T, K] whose index_map reads the layer and the page id
from scalar-prefetched operands: the pipeline gathers the pages straight from the
pool, double-buffered, with no copy of the pool and no manual DMA. Each
page is one [M, K] x [K, T] matmul per kv head in an fp32 online softmax
(running max / sum / accumulator in VMEM scratch across the page blocks).

Lengths and windows decide work and traffic, not shapes: a page at or past
the segment's length, or before the first key any of its rows sees (a
sliding window), skips its compute, and its index_map clamps to the nearest
needed page, so the pipeline issues no DMA for it. Keys past the length or
before a row's first key (`row_lo`) are masked in the scores, and V past
the length is zeroed (the tail of a page is whatever the pool holds).

Inference only: there is no VJP (decode never differentiates through it).
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from kernels_pallas import online_softmax_tpu as osm
from kernels_pallas.attention_parts import cap_logits



def _kernel(table_ref, length_ref, first_ref, layer_ref, q_ref, row_lo_ref,
            *refs,
            pages_per_block, scale, logit_softcap):
  """q_ref [bn, M, K]; row_lo_ref [M, LANES]; refs: pages_per_block k
  pages [bn, T, K], as many v pages, then o_ref [bn, M, K], lse_ref
  [bn, M, LANES] and the m / l / acc scratch."""
  del table_ref, layer_ref  # Read by the index_maps only.
  ppb = pages_per_block
  k_refs, v_refs = refs[:ppb], refs[ppb:2 * ppb]
  o_ref, lse_ref, m_scr, l_scr, acc_scr = refs[2 * ppb:]
  x, j = pl.program_id(0), pl.program_id(2)
  length, first = length_ref[x], first_ref[x]
  T = k_refs[0].shape[1]
  M = q_ref.shape[1]

  @pl.when(j == 0)
  def _init():
    osm.init(m_scr, l_scr, acc_scr)

  row_lo = row_lo_ref[:, :1]                                  # [M, 1]
  for i in range(ppb):
    start = (j * ppb + i) * T

    @pl.when((start < length) & (start + T > first))
    def _page(i=i, start=start):
      idx = start + jax.lax.broadcasted_iota(jnp.int32, (M, T), 1)
      live = (idx < length) & (idx >= row_lo)
      v_live = start + jax.lax.broadcasted_iota(
          jnp.int32, k_refs[i].shape[1:], 0) < length
      for h in range(q_ref.shape[0]):  # Static unroll: 2-D MXU work each.
        s = jax.lax.dot_general(q_ref[h], k_refs[i][h], osm.NT_DIMS,
                                preferred_element_type=jnp.float32) * scale
        s = cap_logits(s, logit_softcap)
        s = jnp.where(live, s, -jnp.inf)
        # V past the length: whatever the page's tail holds.
        v = jnp.where(v_live, v_refs[i][h].astype(jnp.float32), 0.0)
        osm.update(h, s, v, m_scr, l_scr, acc_scr)

  @pl.when(j == pl.num_programs(2) - 1)
  def _finalize():
    osm.finalize(m_scr, l_scr, acc_scr, o_ref, lse_ref)


def _page_map(i, *, ppb, pages_per_row, page_size):
  """index_map of the i-th page of a block: the table's page id, clamped
  to the segment's needed pages (a skipped step re-uses a block: no DMA)."""

  def index(x, n, j, table_ref, length_ref, first_ref, layer_ref):
    last = jnp.maximum(pl.cdiv(length_ref[x], page_size) - 1, 0)
    # lax.div (non-negative operands): `//` lowers through sign, which
    # asks for the TPU generation at lowering time.
    lo = jnp.minimum(jax.lax.div(first_ref[x], page_size), last)
    col = jnp.clip(j * ppb + i, lo, last)
    return layer_ref[0], n, table_ref[x * pages_per_row + col], 0, 0

  return index


def paged_part(q_XxNxMxK, k_pages_LxNxPxTxK, v_pages_LxNxPxTxK, table_XxA,
               length_X, row_lo_XxM=None, *, layer, scale,
               logit_softcap=None, pages_per_block=4, block_heads=8,
               interpret=False):
  """Attention of each segment's queries to its pages (TPU kernel).

  Args:
    q_XxNxMxK: M query rows per segment and kv head.
    k_pages_LxNxPxTxK, v_pages_LxNxPxTxK: the page pool of all layers.
    table_XxA: page ids of each segment (entries past its length unread).
    length_X: keys of each segment (0: none).
    row_lo_XxM: optional first key index each query row sees (a sliding
      window; keys before it are masked, pages before every row's are not
      read).
    layer: the layer to read (may be traced).
    scale, logit_softcap: logit scale and optional soft-cap.
    pages_per_block: pages gathered per grid step.
    block_heads: kv heads per grid step (the largest divisor of N up to it).
    interpret: False on TPU; True (or `pltpu.InterpretParams`) on CPU.

  Returns:
    out [X, N, M, K] fp32 (zeros for an empty segment), lse [X, N, M] fp32.
  """
  X, N, M, K = q_XxNxMxK.shape
  P, T = k_pages_LxNxPxTxK.shape[2:4]
  A = table_XxA.shape[1]
  ppb = min(pages_per_block, A)
  pad = -A % ppb
  bn = max(d for d in range(1, min(block_heads, N) + 1) if N % d == 0)
  table = jnp.clip(jnp.pad(table_XxA.astype(jnp.int32), ((0, 0), (0, pad))),
                   0, P - 1)
  Ap = A + pad
  length_X = jnp.clip(length_X.astype(jnp.int32), 0, Ap * T)
  if row_lo_XxM is None:
    row_lo_XxM = jnp.zeros((X, M), jnp.int32)
  row_lo_XxM = row_lo_XxM.astype(jnp.int32)
  first_X = jnp.maximum(row_lo_XxM.min(axis=1), 0)
  row_lo = jnp.broadcast_to(row_lo_XxM[..., None], (X, M, osm.LANES))

  kernel = functools.partial(
      _kernel, pages_per_block=ppb, scale=scale, logit_softcap=logit_softcap)
  page = lambda i: pl.BlockSpec(
      (None, bn, None, T, K), _page_map(i, ppb=ppb, pages_per_row=Ap, page_size=T))
  rows = lambda *tail: pl.BlockSpec(
      (None, bn) + tail, lambda x, n, j, *_: (x, n) + (0,) * len(tail))
  kv_bytes = 2 * X * N * A * T * K * k_pages_LxNxPxTxK.dtype.itemsize
  out, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          grid=(X, N // bn, Ap // ppb),
          in_specs=[rows(M, K),
                    pl.BlockSpec((None, M, osm.LANES),
                                 lambda x, n, j, *_: (x, 0, 0))]
          + [page(i) for i in range(ppb)] * 2,
          out_specs=[rows(M, K), rows(M, osm.LANES)],
          scratch_shapes=osm.scratch(bn, M, K)),
      out_shape=[jax.ShapeDtypeStruct((X, N, M, K), jnp.float32),
                 jax.ShapeDtypeStruct((X, N, M, osm.LANES), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=(pltpu.PARALLEL, pltpu.PARALLEL,
                               pltpu.ARBITRARY)),
      cost_estimate=pl.CostEstimate(
          flops=4 * X * N * M * A * T * K, transcendentals=X * N * M * A * T,
          bytes_accessed=kv_bytes),
      interpret=interpret,
      name="paged_decode_part_tpu",
  )(table.reshape(-1), length_X, first_X,
    jnp.asarray(layer, jnp.int32).reshape(1), q_XxNxMxK, row_lo,
    *([k_pages_LxNxPxTxK] * ppb + [v_pages_LxNxPxTxK] * ppb))
  return out, lse[..., 0]
