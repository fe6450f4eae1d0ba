"""Paged decode attention that reads only live pages, prompt pages once.

Dimension letters: S decode slots (one sample each), R group entries (one
prompt each), G members per group, H query heads, N kv heads (Q = H / N per
kv head), K head dim, T page size, X page chunks read in a step.

KV lives in a pool of fixed-size pages [L, N, num_pages, T, K] (head-major,
so that a page of one kv head is a contiguous [T, K] tile that the TPU and
GPU kernels read as it is). The op reads layer `layer` of it: the kernels
take the whole pool and index the layer themselves, because a layer sliced
out of the pool (a scan carry) before a kernel call would be copied, a
whole-pool read every step. A group's prompt KV is in the pages of its row of `group_pages_RxA`
(shared by its G samples); a sample's own tokens are in the pages of its
row of `own_pages_SxB`. The op is ragged: it lists the live pages of the
step (a group's prompt pages if any member is live; a live slot's pages up
to its length) and reads each listed page once:
  - a prompt page against the queries of all G members of its group (one
    [G*Q, K] x [K, T] matmul per kv head: the prompt is read once per
    group, like the dense prefix rows of `prefix_decode_attention.py`);
  - an own page against its slot's query.
Each page gives a normalised partial output and its log-sum-exp; partials
of one query merge exactly in fp32 (`segment_merge`, the rule of
`attention_parts.merge_parts` over a variable number of parts), then the
prompt, own and optional common-prefix parts merge by the same rule. Work
and bytes read scale with the live KV, not with max lengths or with the
longest sample of the batch.

The page lists have a static size (`num_prompt_chunks`, `num_own_chunks`):
the caller passes upper bounds of the live page counts (the engine rounds
them up to powers of two, one compile per pair); surplus entries are
masked. A bound below the live count would drop pages: the engine derives
its bounds from lengths that are never below the device's.

`paged_decode_attention_reference` is the jnp version (CPU and the
oracle); `paged_decode_attention` dispatches to a Pallas kernel on TPU
(`paged_decode_attention_tpu.py`, Mosaic) and GPU
(`paged_decode_attention_gpu.py`, Triton). The kernels walk each group's /
slot's page table in place instead of listing pages. Under a layout, the op
runs in `shard_map` over the data replicas (each its own block of slots,
groups and pages) and the tensor axis (`_sharded`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import paged_decode_attention_gpu as gpu
from kernels_pallas import paged_decode_attention_tpu as tpu

from kernels_pallas.attention_parts import (
    NEG_INF, attention_part, common_prefix_part, merge_parts, softcap)


def segment_merge(out_XxD, lse_X, segment_X, num_segments):
  """Exact merge of partial attention outputs by segment.

  Args:
    out_XxD: normalised partial outputs [X, ...D] (fp32).
    lse_X: their log-sum-exps [X, ...] (-inf: an empty part).
    segment_X: [X] segment of each part (>= num_segments: dropped).
    num_segments: number of segments.

  Returns:
    (out [num_segments, ...D], lse [num_segments, ...]); a segment with no
    keys gets zeros and -inf.
  """
  seg_max = jax.ops.segment_max(lse_X, segment_X, num_segments)
  seg_max = jnp.where(jnp.isfinite(seg_max), seg_max, 0.0)
  weight = jnp.exp(lse_X - seg_max[jnp.minimum(segment_X, num_segments - 1)])
  total = jax.ops.segment_sum(weight, segment_X, num_segments)
  out = jax.ops.segment_sum(weight[..., None] * out_XxD, segment_X,
                            num_segments)
  safe = jnp.where(total > 0, total, 1.0)
  lse = jnp.where(total > 0, seg_max + jnp.log(safe), NEG_INF)
  return out / safe[..., None], lse


def live_chunks(num_pages_X, num_chunks):
  """Lists the pages of rows with ragged page counts, row-major.

  Args:
    num_pages_X: [rows] pages each row has live.
    num_chunks: static length of the list (>= the sum; surplus masked).

  Returns:
    (row [num_chunks] (rows: a surplus entry), column [num_chunks]).
  """
  ends = jnp.cumsum(num_pages_X)
  i = jnp.arange(num_chunks)
  row = jnp.searchsorted(ends, i, side="right")
  start = ends - num_pages_X
  col = i - start[jnp.minimum(row, num_pages_X.shape[0] - 1)]
  return row, col


def paged_decode_attention_reference(
    q_SxHxK,
    k_pages_LxNxPxTxK,
    v_pages_LxNxPxTxK,
    slot_group_S,
    slot_member_S,
    group_slots_RxG,
    group_pages_RxA,
    group_len_R,
    own_pages_SxB,
    own_len_S,
    *,
    num_prompt_chunks,
    num_own_chunks,
    layer=0,
    common_k_CxNxK=None,
    common_v_CxNxK=None,
    common_len=None,
    scale=None,
    logit_softcap=None,
    q_pos_S=None,
    window=None,
    return_lse=False,
):
  """Pure-jnp ragged paged prefix-shared decode attention (module doc).

  Args:
    q_SxHxK: one query per slot.
    k_pages_LxNxPxTxK, v_pages_LxNxPxTxK: the page pool of all layers.
    slot_group_S, slot_member_S: each slot's group entry and its place in
      the group (any value for a free slot: its output is then garbage that
      the caller ignores, never NaN).
    group_slots_RxG: the slot of each live member of each group; negative:
      none (a group without live members reads nothing).
    group_pages_RxA: prompt page ids of each group.
    group_len_R: prompt tokens of each group (after the common prefix).
    own_pages_SxB: own page ids of each slot.
    own_len_S: own tokens of each slot in the pool, incl. this step's (0:
      a free slot, reads nothing).
    num_prompt_chunks, num_own_chunks: static upper bounds of the prompt
      pages of groups with live members and of the own pages of slots.
    layer: the pool's layer to read (may be traced).
    common_k_CxNxK, common_v_CxNxK, common_len: optional common prefix.
    scale, logit_softcap: as the dense reference.
    q_pos_S, window: optional sliding window (Gemma 2's local layers): a
      query at position t sees keys at positions > t - window. Key
      positions: common prefix 0.., the prompt from `common_len`, then the
      sample's own tokens.
    return_lse: also return the merged log-sum-exp [S, H].

  Returns:
    out [S, H, K] in q's dtype (and lse [S, H] fp32).
  """
  S, H, K = q_SxHxK.shape
  k_pages_NxPxTxK = jax.lax.dynamic_index_in_dim(k_pages_LxNxPxTxK, layer,
                                                 keepdims=False)
  v_pages_NxPxTxK = jax.lax.dynamic_index_in_dim(v_pages_LxNxPxTxK, layer,
                                                 keepdims=False)
  N, _, T, _ = k_pages_NxPxTxK.shape
  R, G = group_slots_RxG.shape
  scale = K**-0.5 if scale is None else scale
  q = q_SxHxK.reshape(S, N, H // N, K)
  base = 0 if common_len is None else common_len  # Prompt's first position.
  offset = jnp.arange(T)

  # Prompt part: each live prompt page once, for all G members of its group.
  member_ok_RxG = group_slots_RxG >= 0
  member_slot = jnp.where(member_ok_RxG, group_slots_RxG, 0)
  group_pages_R = jnp.where(member_ok_RxG.any(axis=1),
                            -(-group_len_R // T), 0)
  grp, col = live_chunks(group_pages_R, num_prompt_chunks)
  grp_c = jnp.minimum(grp, R - 1)
  page = group_pages_RxA[grp_c, jnp.minimum(col, group_pages_RxA.shape[1] - 1)]
  q_c = q[member_slot[grp_c]]                                  # [X, G, N, Q, K]
  length = jnp.where(grp < R, group_len_R[grp_c], 0)
  qpos = None if q_pos_S is None else q_pos_S[member_slot[grp_c]]  # [X, G]
  k = jnp.take(k_pages_NxPxTxK, page, axis=1, mode="clip")     # [N, X, T, K]
  v = jnp.take(v_pages_NxPxTxK, page, axis=1, mode="clip")
  s = jnp.einsum("xgnqk,nxtk->xgnqt", q_c, k,
                 preferred_element_type=jnp.float32) * scale
  s = softcap(s, logit_softcap)
  idx = col[:, None] * T + offset[None]                        # [X, T]
  mask = ((idx < length[:, None])[:, None, :]
          & member_ok_RxG[grp_c][:, :, None])                  # [X, G, T]
  if window is not None:
    mask &= qpos[:, :, None] - (base + idx)[:, None, :] < window
  o, lse = attention_part(s, mask[:, :, None, None, :], v,
                          "xgnqt,nxtk->xgnqk")
  o_pre, l_pre = segment_merge(o, lse, grp, R)                 # [R, G, ...]
  o_pre, l_pre = (x[slot_group_S, slot_member_S] for x in (o_pre, l_pre))

  # Own part: each live own page against its slot's query.
  slot, col = live_chunks(-(-own_len_S // T), num_own_chunks)
  slot_c = jnp.minimum(slot, S - 1)
  page = own_pages_SxB[slot_c, jnp.minimum(col, own_pages_SxB.shape[1] - 1)]
  k = jnp.take(k_pages_NxPxTxK, page, axis=1, mode="clip")
  v = jnp.take(v_pages_NxPxTxK, page, axis=1, mode="clip")
  s = jnp.einsum("xnqk,nxtk->xnqt", q[slot_c], k,
                 preferred_element_type=jnp.float32) * scale
  s = softcap(s, logit_softcap)
  idx = col[:, None] * T + offset[None]
  mask = idx < jnp.where(slot < S, own_len_S[slot_c], 0)[:, None]  # [X, T]
  if window is not None:
    own_pos = (base + group_len_R[slot_group_S[slot_c]])[:, None] + idx
    mask &= q_pos_S[slot_c][:, None] - own_pos < window
  o, lse = attention_part(s, mask[:, None, None, :], v, "xnqt,nxtk->xnqk")
  o_own, l_own = segment_merge(o, lse, slot, S)

  return _merge_with_common(
      [(o_pre, l_pre), (o_own, l_own)], q, q_SxHxK.dtype, common_k_CxNxK,
      common_v_CxNxK, common_len, scale=scale, logit_softcap=logit_softcap,
      q_pos_S=q_pos_S, window=window, return_lse=return_lse)


def _merge_with_common(parts, q_SxNxQxK, dtype, common_k_CxNxK,
                       common_v_CxNxK, common_len, *, scale, logit_softcap,
                       q_pos_S, window, return_lse):
  """The prompt and own parts merged with the optional common-prefix part
  (jnp, one copy for every slot): out [S, H, K] (and lse [S, H])."""
  S, N, Q, K = q_SxNxQxK.shape
  if common_k_CxNxK is not None and common_k_CxNxK.shape[0]:
    o_c, l_c = common_prefix_part(
        q_SxNxQxK[:, None], common_k_CxNxK, common_v_CxNxK, common_len,
        scale=scale, logit_softcap=logit_softcap,
        q_pos_RxG=None if q_pos_S is None else q_pos_S[:, None],
        window=window)
    parts = parts + [(o_c[:, 0], l_c[:, 0])]
  out, lse = merge_parts(parts)
  out = out.reshape(S, N * Q, K).astype(dtype)
  if return_lse:
    return out, lse.reshape(S, N * Q)
  return out


def paged_decode_attention(q_SxHxK, k_pages_LxNxPxTxK, v_pages_LxNxPxTxK,
                           slot_group_S, slot_member_S, group_slots_RxG,
                           group_pages_RxA, group_len_R, own_pages_SxB,
                           own_len_S, *, impl: str = "auto",
                           kernel: str | None = None,
                           interpret: bool | None = None, **kwargs):
  """Dispatch: "xla" (the jnp reference), "pallas" (a Pallas kernel for
  the prompt and own parts; the common-prefix part is jnp), "auto" (the
  kernel on TPU and GPU, the reference elsewhere).

  Args and returns as `paged_decode_attention_reference`, plus:
    impl: "auto" | "xla" | "pallas".
    kernel: which Pallas kernel, "tpu" (Mosaic,
      `paged_decode_attention_tpu.py`) or "gpu" (Triton,
      `paged_decode_attention_gpu.py`); None: the backend's (the TPU one
      off GPU).
    interpret: run the kernel in interpret mode; None: when the backend is
      not the kernel's (CPU tests). False off its backend lowers it (e.g.
      for `jax.export`).
  With an active rollout layout both run under `shard_map` over the data
  replicas and the tensor axis (`_sharded`); the chunk bounds are then per
  replica.
  """
  args = (q_SxHxK, k_pages_LxNxPxTxK, v_pages_LxNxPxTxK, slot_group_S,
          slot_member_S, group_slots_RxG, group_pages_RxA, group_len_R,
          own_pages_SxB, own_len_S)
  backend = jax.default_backend()
  if resolve_impl(impl) == "xla":
    return _sharded(paged_decode_attention_reference, *args, **kwargs)
  kernel = kernel or ("gpu" if backend == "gpu" else "tpu")
  if kernel not in _KERNELS:
    raise ValueError(f"kernel must be 'tpu' or 'gpu', got {kernel!r}")
  if interpret is None:
    interpret = backend != kernel
  return _sharded(functools.partial(_kernel_parts, kernel=kernel,
                                    interpret=interpret), *args, **kwargs)


def resolve_impl(impl: str) -> str:
  """"xla" or "pallas": what `impl` runs on this backend ("auto": the
  kernel on TPU and GPU, the jnp reference elsewhere)."""
  if impl == "auto":
    return "pallas" if jax.default_backend() in ("tpu", "gpu") else "xla"
  if impl not in ("xla", "pallas"):
    raise ValueError(
        f"attention_impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
  return impl


# A kernel's part function and the query rows it wants per segment.
_KERNELS = {
    "gpu": (gpu.paged_part, gpu.rows_for_dot),
    "tpu": (tpu.paged_part, lambda m: m),
}


def _row_lo(q_pos_XxM, key_start_X, window):
  """First key index (within a segment) each query row sees: keys less
  than `window` positions behind the query; 0 without a window. Written so
  that NO_WINDOW (int32 max) cannot overflow."""
  ahead = jnp.maximum(q_pos_XxM - key_start_X[:, None] + 1, 0)
  return jnp.maximum(ahead - window, 0)


def _kernel_parts(q_SxHxK, k_pages, v_pages, slot_group_S, slot_member_S,
                  group_slots_RxG, group_pages_RxA, group_len_R,
                  own_pages_SxB, own_len_S, *, kernel, interpret, layer=0,
                  num_prompt_chunks=None, num_own_chunks=None,
                  common_k_CxNxK=None, common_v_CxNxK=None, common_len=None,
                  scale=None, logit_softcap=None, q_pos_S=None, window=None,
                  return_lse=False):
  """The prompt and own parts by a kernel (each walks its segment's page
  table up to its length: no chunk bounds needed), merged with the common
  part as the reference does."""
  del num_prompt_chunks, num_own_chunks
  part_fn, rows_for = _KERNELS[kernel]
  S, H, K = q_SxHxK.shape
  N = k_pages.shape[1]
  Q = H // N
  R, G = group_slots_RxG.shape
  scale = K**-0.5 if scale is None else scale
  part = functools.partial(part_fn, layer=layer, scale=scale,
                           logit_softcap=logit_softcap, interpret=interpret)
  q = q_SxHxK.reshape(S, N, Q, K)
  base = jnp.zeros((), jnp.int32) if common_len is None else common_len
  windowed = window is not None

  def padded(x_XxNxMxK, row_lo_XxM):
    """Query rows padded for the kernel (padding rows: the segment's
    first row's window, never an earlier first key)."""
    M = x_XxNxMxK.shape[2]
    extra = rows_for(M) - M
    x = jnp.pad(x_XxNxMxK, ((0, 0), (0, 0), (0, extra), (0, 0)))
    if row_lo_XxM is not None:
      row_lo_XxM = jnp.pad(row_lo_XxM, ((0, 0), (0, extra)), mode="edge")
    return x, row_lo_XxM

  # Prompt: a group's G*Q query rows per kv head against its pages.
  member_ok_RxG = group_slots_RxG >= 0
  member_slot = jnp.where(member_ok_RxG, group_slots_RxG, 0)
  q_grp = q[member_slot]                                     # [R, G, N, Q, K]
  rows = G * Q
  q_grp = jnp.transpose(q_grp, (0, 2, 1, 3, 4)).reshape(R, N, rows, K)
  row_lo = None
  if windowed:
    row_lo = jnp.repeat(_row_lo(q_pos_S[member_slot], jnp.broadcast_to(
        base, (R,)), window), Q, axis=1)                     # [R, G*Q]
  q_grp, row_lo = padded(q_grp, row_lo)
  o, lse = part(q_grp, k_pages, v_pages, group_pages_RxA,
                jnp.where(member_ok_RxG.any(axis=1), group_len_R, 0), row_lo)
  o = jnp.transpose(o[:, :, :rows].reshape(R, N, G, Q, K), (0, 2, 1, 3, 4))
  lse = jnp.transpose(lse[:, :, :rows].reshape(R, N, G, Q), (0, 2, 1, 3))
  o_pre = o[slot_group_S, slot_member_S]
  l_pre = lse[slot_group_S, slot_member_S]

  # Own: a slot's Q query rows per kv head against its pages.
  row_lo = None
  if windowed:
    own_start = base + group_len_R[slot_group_S]
    row_lo = jnp.repeat(_row_lo(q_pos_S[:, None], own_start, window), Q,
                        axis=1)                              # [S, Q]
  q_own, row_lo = padded(q, row_lo)
  o, lse = part(q_own, k_pages, v_pages, own_pages_SxB, own_len_S, row_lo)
  return _merge_with_common(
      [(o_pre, l_pre), (o[:, :, :Q], lse[:, :, :Q])], q, q_SxHxK.dtype,
      common_k_CxNxK, common_v_CxNxK, common_len, scale=scale,
      logit_softcap=logit_softcap, q_pos_S=q_pos_S, window=window,
      return_lse=return_lse)


def _sharded(parts_fn, q_SxHxK, k_pages, v_pages, *index, common_k_CxNxK=None,
             common_v_CxNxK=None, return_lse=False, **kwargs):
  """`parts_fn` under `shard_map` over the active layout's data replicas
  and tensor axis (a Pallas call does not partition by itself, and the jnp
  op would gather pages across replicas): each device runs on its kv heads
  and on its replica's block of slots, groups and pages, with the ids made
  local. The paged engine keeps a group's samples and pages on one replica
  and lists each replica's slots in its block, so no communication is
  needed. Without an active layout, `parts_fn` as it is."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from rlhf_jax.parallel.layout import active_layout  # pylint: disable=g-import-not-at-top

  common = common_k_CxNxK is not None
  layout = active_layout()
  if layout is None or layout.mesh.size == 1:
    return parts_fn(q_SxHxK, k_pages, v_pages, *index,
                    common_k_CxNxK=common_k_CxNxK,
                    common_v_CxNxK=common_v_CxNxK, return_lse=return_lse,
                    **kwargs)
  (S, H), (N, num_pages), R = (q_SxHxK.shape[:2], k_pages.shape[1:3],
                               index[4].shape[0])
  heads = layout.spec(("heads",), (H,))[0]
  kv = layout.spec(("kv_heads",), (N,))[0]
  if (heads is None) != (kv is None):  # GQA groups must stay whole.
    heads = kv = None
  rows = layout.spec(("batch",), (S,))[0]
  if any(layout.spec(("batch",), (n,))[0] != rows for n in (R, num_pages)):
    rows = None  # Not split alike: every device sees every replica.
  # Traced values (layer, common_len, q positions, window) travel as
  # arguments.
  traced = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
  run = functools.partial(parts_fn, return_lse=return_lse,
                          **{k: v for k, v in kwargs.items()
                             if k not in traced})

  def local(q, kp, vp, index, common_kv, traced):
    sg, sm, gs, gp, gl, op, ol = index
    if rows is not None:  # Replica r's ids start at r x its block size.
      r = jax.lax.axis_index(rows)
      S_loc, R_loc, P_loc = q.shape[0], gl.shape[0], kp.shape[2]
      sg = jnp.clip(sg - r * R_loc, 0, R_loc - 1)
      gs = jnp.where(gs >= 0, gs - r * S_loc, -1)
      gp = jnp.clip(gp - r * P_loc, 0, P_loc - 1)
      op = jnp.clip(op - r * P_loc, 0, P_loc - 1)
    ck, cv = common_kv if common else (None, None)
    return run(q, kp, vp, sg, sm, gs, gp, gl, op, ol, common_k_CxNxK=ck,
               common_v_CxNxK=cv, **traced)

  out = P(rows, heads)
  common_spec = (P(None, kv), P(None, kv)) if common else ()
  traced_spec = {k: P(rows) if k == "q_pos_S" else P() for k in traced}
  return jax.shard_map(
      local, mesh=layout.mesh,
      in_specs=(P(rows, heads), P(None, kv, rows), P(None, kv, rows),
                P(rows), common_spec, traced_spec),
      out_specs=(out, out) if return_lse else out, check_vma=False)(
          q_SxHxK, k_pages, v_pages, index,
          (common_k_CxNxK, common_v_CxNxK) if common else (), traced)
