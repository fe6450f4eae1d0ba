"""Decode attention for G samples that share one prompt: prefix part + suffix part.

Dimension letters: R prompt rows (groups), G samples per row, H query heads,
N kv heads, K head dim, P prefix (prompt) length, M suffix (own tokens) length.

The G samples of a row attend to the row's prompt KV (read once per row: one
[G*H/N, K] x [K, P] matmul per kv head) and to their own tokens. Each part
returns its normalised output and log-sum-exp; the two merge exactly in fp32:
  O = exp(L_a - L) O_a + exp(L_b - L) O_b,  L = logaddexp(L_a, L_b).
Empty parts (L = -inf: a free slot, an empty suffix) contribute nothing and
never produce NaN; a query with no keys at all returns zeros.

Two-level sharing: an optional third part is a common prefix C (a system
prompt or few-shot block in front of every prompt of a batch), stored once for
all rows. Every query of every row attends to it in one matmul per kv head
([R*G*H/N, K] x [K, C]); it merges with the other two by the same rule, which
is associative, so the order of the merge does not matter.

`prefix_decode_attention` runs the jnp reference below on every backend: it
is the attention of the model's row decode (`Decoder.decode`), which only
the plain-jnp static-rows decoder runs (`benchmarks/static_rows.py`, the
tests' oracle and the long-tail benchmark's baseline). The engine decodes
with `paged_decode_attention.py`.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.attention_parts import (
    attention_part, common_prefix_part, merge_parts, cap_logits)

def prefix_decode_attention_reference(
    q_RxGxHxK,
    prefix_k_RxPxNxK,
    prefix_v_RxPxNxK,
    prefix_len_R,
    suffix_k_RxGxMxNxK,
    suffix_v_RxGxMxNxK,
    suffix_len_RxG,
    *,
    common_k_CxNxK=None,
    common_v_CxNxK=None,
    common_len=None,
    scale=None,
    logit_softcap=None,
    return_lse=False,
    q_pos_RxG=None,
    window=None,
):
  """Pure-jnp prefix-shared decode attention (see module docstring).

  `common_k_CxNxK`, `common_v_CxNxK`, `common_len` (optional, together) add
  the common-prefix part shared by all rows; C = 0 is the same as None.
  `window` (with `q_pos_RxG`, each query's position): a query sees only keys
  less than `window` positions behind it (Gemma 2's local layers; may be
  traced). Key positions: common prefix 0.., then the row's prompt from
  `common_len`, then the sample's own tokens after the prompt.
  """
  R, G, H, K = q_RxGxHxK.shape
  N = prefix_k_RxPxNxK.shape[2]
  P = prefix_k_RxPxNxK.shape[1]
  M = suffix_k_RxGxMxNxK.shape[2]
  scale = K**-0.5 if scale is None else scale
  q = q_RxGxHxK.reshape(R, G, N, H // N, K)

  # Prefix: all G*H/N queries of a row against the row's keys in one matmul.
  s_pre = jnp.einsum(
      "rgnqk,rpnk->rnqgp", q, prefix_k_RxPxNxK,
      preferred_element_type=jnp.float32) * scale
  s_pre = cap_logits(s_pre, logit_softcap)
  base = 0 if common_len is None else common_len  # Prompt's first position.
  mask_pre = jnp.broadcast_to(
      jnp.arange(P)[None, None, :] < prefix_len_R[:, None, None], (R, G, P))
  if window is not None:
    k_pos = base + jnp.arange(P)
    mask_pre &= q_pos_RxG[:, :, None] - k_pos[None, None, :] < window
  o_pre, l_pre = attention_part(
      s_pre, mask_pre[:, None, None, :, :], prefix_v_RxPxNxK,
      "rnqgp,rpnk->rnqgk")
  o_pre = jnp.transpose(o_pre, (0, 3, 1, 2, 4))  # r g n q k
  l_pre = jnp.transpose(l_pre, (0, 3, 1, 2))

  # Suffix: each sample against its own tokens.
  s_suf = jnp.einsum(
      "rgnqk,rgmnk->rgnqm", q, suffix_k_RxGxMxNxK,
      preferred_element_type=jnp.float32) * scale
  s_suf = cap_logits(s_suf, logit_softcap)
  mask_suf = jnp.arange(M)[None, None, :] < suffix_len_RxG[..., None]
  if window is not None:
    k_pos = base + prefix_len_R[:, None, None] + jnp.arange(M)[None, None, :]
    mask_suf &= q_pos_RxG[:, :, None] - k_pos < window
  o_suf, l_suf = attention_part(
      s_suf, mask_suf[:, :, None, None, :], suffix_v_RxGxMxNxK,
      "rgnqm,rgmnk->rgnqk")

  parts = [(o_pre, l_pre), (o_suf, l_suf)]
  if common_k_CxNxK is not None and common_k_CxNxK.shape[0]:
    parts.append(common_prefix_part(
        q, common_k_CxNxK, common_v_CxNxK, common_len, scale=scale,
        logit_softcap=logit_softcap, q_pos_RxG=q_pos_RxG, window=window))
  out, lse = merge_parts(parts)
  out = out.reshape(R, G, H, K).astype(q_RxGxHxK.dtype)
  if return_lse:
    return out, lse.reshape(R, G, H)
  return out


def prefix_decode_attention(*args, impl: str = "auto", **kwargs):
  """The row decode's attention: the jnp reference on every backend.

  "auto" and "xla" run `prefix_decode_attention_reference`; there is no
  kernel (the rows engine's went with [one-engine]), so "pallas" is an
  error rather than a silent fallback.
  """
  if impl in ("auto", "xla"):
    return prefix_decode_attention_reference(*args, **kwargs)
  if impl == "pallas":
    raise ValueError("attention_impl='pallas': the row decode has no kernel "
                     "(removed with [one-engine]); use 'auto' or 'xla', or "
                     "the engine (paged_decode_attention)")
  raise ValueError(
      f"attention_impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
