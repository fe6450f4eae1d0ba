"""Paged decode attention that reads a group's prompt pages once.

Dimension letters: S decode slots (one sample each), R group entries (one
prompt each), G members per group, H query heads, N kv heads (Q = H / N per
kv head), K head dim, T page size, X groups read in a step.

KV lives in a pool of fixed-size pages [L, N, num_pages, T, K] (head-major,
so that a page of one kv head is a contiguous [T, K] tile that the TPU and
GPU kernels read as it is). The op reads layer `layer` of it: the kernels
take the whole pool and index the layer themselves, because a layer sliced
out of the pool (a scan carry) before a kernel call would be copied, a
whole-pool read every step. A group's prompt KV is in the pages of its row
of `group_pages_RxA` (shared by its G samples); a sample's own tokens are
in the pages of its row of `own_pages_SxB`. Two parts, each a softmax over
its keys, merged exactly in fp32 with the optional common-prefix part
(`attention_parts.merge_parts`):
  - prompt: each group with a live member once, against the queries of all
    its G members (one [G*Q, K] x [K, t] matmul per kv head: the prompt is
    read once per group, not once per sample);
  - own: each slot's pages against its own query.

`paged_decode_attention_reference` is the jnp version (CPU and the
oracle). It gathers pages into dense rows of static sizes: the caller
passes upper bounds (`groups_read` groups with a live member,
`prompt_pages_read` and `own_pages_read` pages of one of them), which the
engine rounds up to powers of two above a floor (one compile per triple);
pages past a row's length are read and masked, so the work follows the
longest live sequence of the step, and a bound below the live count would
drop keys (the engine derives its bounds from lengths never below the
device's). Dense rows beat a ragged list of single pages on CPU: XLA runs
one batched matmul per part instead of a matmul, a gather and a segment
reduction per page.

`paged_decode_attention` dispatches to a Pallas kernel on TPU
(`paged_decode_attention_tpu.py`, Mosaic) and GPU
(`paged_decode_attention_gpu.py`, Triton), which walk each group's /
slot's page table up to its length (no bounds needed). Under a layout, the
op runs in `shard_map` over the data replicas (each its own block of
slots, groups and pages) and the tensor axis (`_sharded`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import paged_decode_attention_gpu as gpu
from kernels_pallas import paged_decode_attention_tpu as tpu

from kernels_pallas.attention_parts import (
    NEG_INF, attention_part, common_prefix_part, merge_parts, cap_logits)


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
    groups_read,
    prompt_pages_read,
    own_pages_read,
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
  """Pure-jnp paged prefix-shared decode attention (module doc).

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
    groups_read: static upper bound of the groups with a live member.
    prompt_pages_read, own_pages_read: static upper bounds of the pages
      of one such group's prompt and of one slot's own tokens.
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

  def read(pages_XxA, count):
    """KV of the first `count` pages of each row: [N, X, count * T, K]."""
    ids = pages_XxA[:, :count]
    X = ids.shape[0]
    k = jnp.take(k_pages_NxPxTxK, ids, axis=1, mode="clip")
    v = jnp.take(v_pages_NxPxTxK, ids, axis=1, mode="clip")
    return k.reshape(N, X, -1, K), v.reshape(N, X, -1, K)

  # Prompt part: the groups with a live member (stably first), each read
  # once for the queries of all its G members.
  member_ok_RxG = group_slots_RxG >= 0
  live_R = member_ok_RxG.any(axis=1)
  groups_X = jnp.argsort(~live_R, stable=True)[:groups_read]
  X = groups_X.shape[0]
  member_slot_XxG = jnp.where(member_ok_RxG, group_slots_RxG, 0)[groups_X]
  k, v = read(group_pages_RxA[groups_X], prompt_pages_read)
  s = jnp.einsum("xgnqk,nxtk->xgnqt", q[member_slot_XxG], k,
                 preferred_element_type=jnp.float32) * scale
  s = cap_logits(s, logit_softcap)
  idx = jnp.arange(k.shape[2])
  length_X = jnp.where(live_R[groups_X], group_len_R[groups_X], 0)
  mask = ((idx[None, :] < length_X[:, None])[:, None, :]
          & member_ok_RxG[groups_X][:, :, None])                # [X, G, t]
  if window is not None:
    qpos = q_pos_S[member_slot_XxG]                             # [X, G]
    mask &= qpos[:, :, None] - (base + idx)[None, None, :] < window
  o, lse = attention_part(s, mask[:, :, None, None, :], v,
                          "xgnqt,nxtk->xgnqk")
  # Each slot's place in the list (X: its group was not read).
  place_R = jnp.full(R, X, jnp.int32).at[groups_X].set(
      jnp.arange(X, dtype=jnp.int32))
  x_S = place_R[slot_group_S]
  o_pre = o[jnp.minimum(x_S, X - 1), slot_member_S]
  l_pre = jnp.where((x_S < X)[:, None, None],
                    lse[jnp.minimum(x_S, X - 1), slot_member_S], NEG_INF)

  # Own part: each slot's first pages against its own query.
  k, v = read(own_pages_SxB, own_pages_read)
  s = jnp.einsum("snqk,nstk->snqt", q, k,
                 preferred_element_type=jnp.float32) * scale
  s = cap_logits(s, logit_softcap)
  idx = jnp.arange(k.shape[2])
  mask = idx[None, :] < own_len_S[:, None]                      # [S, t]
  if window is not None:
    own_pos = (base + group_len_R[slot_group_S])[:, None] + idx[None, :]
    mask &= q_pos_S[:, None] - own_pos < window
  o_own, l_own = attention_part(s, mask[:, None, None, :], v,
                                "snqt,nstk->snqk")

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
  replicas and the tensor axis (`_sharded`); the read bounds are then per
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
                  groups_read=None, prompt_pages_read=None,
                  own_pages_read=None,
                  common_k_CxNxK=None, common_v_CxNxK=None, common_len=None,
                  scale=None, logit_softcap=None, q_pos_S=None, window=None,
                  return_lse=False):
  """The prompt and own parts by a kernel (each walks its segment's page
  table up to its length: no chunk bounds needed), merged with the common
  part as the reference does."""
  del groups_read, prompt_pages_read, own_pages_read
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
