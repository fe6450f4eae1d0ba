"""Paged decode attention that reads each group's prompt pages once.

Dimension letters: S decode slots (one sample each), R group entries (one
prompt each), G members per group, H query heads, N kv heads, K head dim,
T page size, A prompt pages read per group, B own pages read per slot,
C common-prefix capacity.

KV lives in a pool of fixed-size pages [num_pages, T, N, K] (one pool per
layer). A group's prompt KV is in the pages of its row of `group_pages_RxA`
(shared by its G samples); a sample's own tokens are in the pages of its
row of `own_pages_SxB`. The queries of a group's live members are gathered
into [R, G] so the group's prompt pages are read ONCE per step for all of
them (one [G*H/N, K] x [K, A*T] matmul per group and kv head), exactly like
the dense prefix rows (`prefix_decode_attention.py`); each sample then reads
only its own pages. The parts merge by log-sum-exp in fp32
(`attention_parts.merge_parts`), with the optional common prefix (stored
once for every group) as a third part.

Only the first A (B) columns of the page tables are read: the caller slices
the tables to the live maximum (the engine rounds it up to a power of two,
one compile per bucket), so a step reads live pages, not the max-length
reservation. Entries past a group's (slot's) length are masked and may hold
any page id.

This file is the jnp reference, used on every backend; a Pallas kernel
that reads pages in place (no gather copy) is the follow-up.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.attention_parts import (
    attention_part, common_prefix_part, merge_parts, softcap)


def gather_pages(pages_PxTxNxK, table_XxA):
  """[X, A*T, N, K]: the pages of each row of `table_XxA`, in order."""
  X, A = table_XxA.shape
  _, T, N, K = pages_PxTxNxK.shape
  # "clip": an id out of range reads some page (masked by the caller),
  # never the NaN fill of jnp.take's default.
  return jnp.take(pages_PxTxNxK, table_XxA, axis=0, mode="clip").reshape(
      X, A * T, N, K)


def paged_decode_attention_reference(
    q_SxHxK,
    k_pages_PxTxNxK,
    v_pages_PxTxNxK,
    slot_group_S,
    slot_member_S,
    group_slots_RxG,
    group_pages_RxA,
    group_len_R,
    own_pages_SxB,
    own_len_S,
    *,
    common_k_CxNxK=None,
    common_v_CxNxK=None,
    common_len=None,
    scale=None,
    logit_softcap=None,
    q_pos_S=None,
    window=None,
    return_lse=False,
):
  """Pure-jnp paged prefix-shared decode attention (module docstring).

  Args:
    q_SxHxK: one query per slot.
    k_pages_PxTxNxK, v_pages_PxTxNxK: the layer's page pool.
    slot_group_S, slot_member_S: each slot's group entry and its place in
      the group (any value for a free slot: its output is then garbage that
      the caller ignores, never NaN).
    group_slots_RxG: the slot of each member of each group; negative: none.
    group_pages_RxA: prompt page ids of each group (first A columns).
    group_len_R: prompt tokens of each group (after the common prefix).
    own_pages_SxB: own page ids of each slot (first B columns).
    own_len_S: own tokens of each slot in the pool (incl. this step's).
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
  N = k_pages_PxTxNxK.shape[2]
  R, G = group_slots_RxG.shape
  scale = K**-0.5 if scale is None else scale
  q = q_SxHxK.reshape(S, N, H // N, K)
  base = 0 if common_len is None else common_len  # Prompt's first position.

  # Prompt part: the live members of a group against its pages, one read.
  member_ok_RxG = group_slots_RxG >= 0
  member_slot = jnp.where(member_ok_RxG, group_slots_RxG, 0)
  q_grp = q[member_slot]                                   # [R, G, N, Q, K]
  pk = gather_pages(k_pages_PxTxNxK, group_pages_RxA)      # [R, A*T, N, K]
  pv = gather_pages(v_pages_PxTxNxK, group_pages_RxA)
  s_pre = jnp.einsum("rgnqk,rpnk->rgnqp", q_grp, pk,
                     preferred_element_type=jnp.float32) * scale
  s_pre = softcap(s_pre, logit_softcap)
  key_idx = jnp.arange(pk.shape[1])
  mask_pre = ((key_idx[None, None, :] < group_len_R[:, None, None])
              & member_ok_RxG[:, :, None])                 # [R, G, A*T]
  if window is not None:
    q_pos_grp = q_pos_S[member_slot]
    mask_pre &= q_pos_grp[:, :, None] - (base + key_idx)[None, None] < window
  o_pre, l_pre = attention_part(s_pre, mask_pre[:, :, None, None, :], pv,
                                "rgnqp,rpnk->rgnqk")
  # Back to slots: each slot reads its (group, member) entry.
  o_pre, l_pre = (x[slot_group_S, slot_member_S] for x in (o_pre, l_pre))

  # Own part: each slot against its own pages only.
  ok = gather_pages(k_pages_PxTxNxK, own_pages_SxB)        # [S, B*T, N, K]
  ov = gather_pages(v_pages_PxTxNxK, own_pages_SxB)
  s_own = jnp.einsum("snqk,smnk->snqm", q, ok,
                     preferred_element_type=jnp.float32) * scale
  s_own = softcap(s_own, logit_softcap)
  own_idx = jnp.arange(ok.shape[1])
  mask_own = own_idx[None, :] < own_len_S[:, None]         # [S, B*T]
  if window is not None:
    own_pos = (base + group_len_R[slot_group_S])[:, None] + own_idx[None]
    mask_own &= q_pos_S[:, None] - own_pos < window
  o_own, l_own = attention_part(s_own, mask_own[:, None, None, :], ov,
                                "snqm,smnk->snqk")

  parts = [(o_pre, l_pre), (o_own, l_own)]
  if common_k_CxNxK is not None and common_k_CxNxK.shape[0]:
    o_c, l_c = common_prefix_part(
        q[:, None], common_k_CxNxK, common_v_CxNxK, common_len, scale=scale,
        logit_softcap=logit_softcap,
        q_pos_RxG=None if q_pos_S is None else q_pos_S[:, None],
        window=window)
    parts.append((o_c[:, 0], l_c[:, 0]))
  out, lse = merge_parts(parts)
  out = out.reshape(S, H, K).astype(q_SxHxK.dtype)
  if return_lse:
    return out, lse.reshape(S, H)
  return out
