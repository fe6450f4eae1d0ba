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

`prefix_decode_attention` dispatches by `impl`: "xla" is the jnp reference
below (used on CPU and as the oracle), "pallas" a Pallas kernel, "auto" picks
by backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from absl import logging

from kernels_pallas import prefix_decode_attention_tpu as tpu
from kernels_pallas.attention_parts import (
    attention_part, common_prefix_part, merge_parts, softcap)

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
  s_pre = softcap(s_pre, logit_softcap)
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
  s_suf = softcap(s_suf, logit_softcap)
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


@functools.cache
def _say_once(message: str) -> None:
  logging.warning(message)


def prefix_decode_attention(*args, impl: str = "auto", block_sizes=None,
                            interpret: bool | None = None, **kwargs):
  """Dispatch: "xla" (jnp reference), "pallas" (kernel), "auto" (by backend).

  "auto" is the Pallas TPU kernel on TPU and the reference elsewhere. On GPU
  the reference is the prefix path too: XLA lowers its prefix einsum to one
  batched [G*H/N, K] x [K, P] matmul per row and kv head, which already reads
  the prompt KV once per row. `jax.nn.dot_product_attention` is not used:
  its cuDNN residual (the LSE) comes back in the output dtype (bf16), which
  would make the fp32 merge inexact, and it has no logit soft-cap. "pallas"
  runs the Mosaic kernel, in interpret mode off TPU (CPU tests); it is not a
  GPU kernel. The optional common-prefix part is jnp in every implementation
  (see `prefix_decode_attention_tpu.py`), merged in fp32 with the others.

  Args:
    *args: as `prefix_decode_attention_reference`.
    impl: "auto" | "xla" | "pallas".
    block_sizes: `BlockSizes` for the Pallas kernel (default if None); unused
      by the reference.
    interpret: run the Pallas kernel in interpret mode; None: off TPU only
      (False off TPU lowers the Mosaic kernel, e.g. for `jax.export`).
    **kwargs: common_k_CxNxK, common_v_CxNxK, common_len (the optional
      third part), scale, logit_softcap, return_lse, q_pos_RxG and window
      (sliding window; the jnp path).

  Returns:
    As `prefix_decode_attention_reference`.
  """
  backend = jax.default_backend()
  if impl == "auto":
    impl = "pallas" if backend == "tpu" else "xla"
    if backend == "gpu":
      _say_once("prefix_decode_attention: no GPU kernel yet; decode runs "
                "the jnp path (XLA)")
  if impl == "pallas" and kwargs.get("window") is not None:
    # The Mosaic kernel has no window mask: Gemma 2's decode runs the jnp
    # path (said once, never silently).
    _say_once("prefix_decode_attention: the Pallas kernel has no sliding "
              "window; windowed models decode with the jnp reference")
    impl = "xla"
  if impl == "xla":
    return prefix_decode_attention_reference(*args, **kwargs)
  if impl == "pallas":
    if backend == "gpu":
      raise ValueError(
          "attention_impl='pallas' is a TPU (Mosaic) kernel; on GPU use "
          "attention_impl='auto' or 'xla'.")
    if block_sizes is not None:
      kwargs["block_sizes"] = block_sizes
    if interpret is None:
      interpret = backend != "tpu"
    return _sharded_tpu_kernel(*args, interpret=interpret, **kwargs)
  raise ValueError(
      f"attention_impl must be 'auto', 'xla' or 'pallas', got {impl!r}")


def _sharded_tpu_kernel(q, pk, pv, plen, sk, sv, slen, *, common_k_CxNxK=None,
                        common_v_CxNxK=None, common_len=None,
                        return_lse=False, **kwargs):
  """The Pallas TPU kernel under `shard_map` over the active layout's rows
  (replicas) and heads (tensor): a Pallas call does not partition by
  itself. Each device runs the kernel on its rows and heads; no
  communication (rows and kv heads are independent). Without an active
  layout, the kernel as it is."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from rlhf_jax.parallel.layout import active_layout  # pylint: disable=g-import-not-at-top

  common = common_k_CxNxK is not None
  kernel = functools.partial(tpu.prefix_decode_attention_tpu,
                             return_lse=return_lse, **kwargs)
  layout = active_layout()
  if common and not isinstance(common_len, jax.Array):
    common_len = jnp.asarray(common_len, jnp.int32)
  if layout is None or layout.mesh.size == 1:
    return kernel(q, pk, pv, plen, sk, sv, slen, common_k_CxNxK=common_k_CxNxK,
                  common_v_CxNxK=common_v_CxNxK, common_len=common_len)
  R, _, H, _ = q.shape
  N = pk.shape[2]
  rows = layout.spec(("batch",), (R,))[0]
  heads = layout.spec(("heads",), (H,))[0]
  kv = layout.spec(("kv_heads",), (N,))[0]
  if (heads is None) != (kv is None):  # GQA groups must stay whole.
    heads = kv = None

  def local(q, pk, pv, plen, sk, sv, slen, *common_kv):
    ck, cv, clen = common_kv if common else (None, None, None)
    return kernel(q, pk, pv, plen, sk, sv, slen, common_k_CxNxK=ck,
                  common_v_CxNxK=cv, common_len=clen)

  in_specs = [P(rows, None, heads), P(rows, None, kv), P(rows, None, kv),
              P(rows), P(rows, None, None, kv), P(rows, None, None, kv),
              P(rows)]
  args = [q, pk, pv, plen, sk, sv, slen]
  if common:
    in_specs += [P(None, kv), P(None, kv), P()]
    args += [common_k_CxNxK, common_v_CxNxK, common_len]
  out = P(rows, None, heads)
  return jax.shard_map(local, mesh=layout.mesh, in_specs=tuple(in_specs),
                       out_specs=(out, out) if return_lse else out,
                       check_vma=False)(*args)

