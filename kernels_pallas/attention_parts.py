"""Attention over one key set, and the exact merge of disjoint parts.

Each part returns its normalised output O_X and log-sum-exp L_X; parts over
disjoint key sets merge exactly in fp32:
  O = sum_X exp(L_X - L) O_X,  L = logsumexp_X(L_X),
an associative rule, so parts can be computed anywhere and merged in any
order. An empty part (L = -inf: a free slot, an empty suffix) contributes
nothing and never produces NaN; a query with no keys at all gets zeros.
The decode kernels (`prefix_decode_attention*.py`) and the grouped
training layout (`rlhf_jax/models/grouped_forward.py`) build on these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")


def cap_logits(logits, cap):
  """Gemma 2's soft cap, cap * tanh(logits / cap) (None: no cap): the one
  definition for attention scores and final logits, in jnp, kernels too."""
  return logits if cap is None else cap * jnp.tanh(logits / cap)


def attention_part(scores, mask, v, v_spec):
  """Masked softmax attention over one key set.

  Args:
    scores: fp32 logits, keys on the last axis.
    mask: bool, broadcastable to scores; False keys are excluded.
    v: values, contracted against the last axis of scores by `v_spec`.
    v_spec: einsum spec "<probs>,<v>-><out>".

  Returns:
    (out, lse): out normalised over the part's keys (zeros if it has none),
    in the layout `v_spec` gives; lse the log-sum-exp of the kept logits
    (-inf if none), in the layout of scores without its last axis.
  """
  scores = jnp.where(mask, scores, NEG_INF)
  m = jnp.max(scores, axis=-1)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(scores - m_safe[..., None])
  s = jnp.sum(p, axis=-1)
  s_safe = jnp.where(s > 0, s, 1.0)
  lse = jnp.where(s > 0, m_safe + jnp.log(s_safe), NEG_INF)
  out = jnp.einsum(v_spec, p / s_safe[..., None], v.astype(jnp.float32))
  return out, lse


def merge_parts(parts):
  """Exact merge of [(out, lse), ...] attention parts over disjoint key sets."""
  lses = jnp.stack([lse for _, lse in parts])
  total = jax.nn.logsumexp(lses, axis=0)
  total_safe = jnp.where(jnp.isfinite(total), total, 0.0)
  out = 0.0
  for o, lse in parts:
    out = out + jnp.exp(lse - total_safe)[..., None] * o
  return out, total


def common_prefix_part(q_RxGxNxQxK, common_k_CxNxK, common_v_CxNxK,
                       common_len, *, scale, logit_softcap=None,
                       q_pos_RxG=None, window=None):
  """Attention of every query to one common prefix shared by all rows.

  Args:
    q_RxGxNxQxK: queries grouped by kv head.
    common_k_CxNxK: common-prefix keys, one copy for the whole batch.
    common_v_CxNxK: common-prefix values.
    common_len: [] valid common tokens (0: no common prefix).
    scale: logit scale.
    logit_softcap: optional soft-cap of the logits.
    q_pos_RxG, window: optional sliding window: a query at position t sees
      common positions c with t - c < window.

  Returns:
    (out [R,G,N,Q,K] fp32, lse [R,G,N,Q] fp32), as `attention_part`.
  """
  C = common_k_CxNxK.shape[0]
  s = jnp.einsum("rgnqk,cnk->rgnqc", q_RxGxNxQxK, common_k_CxNxK,
                 preferred_element_type=jnp.float32) * scale
  s = cap_logits(s, logit_softcap)
  mask = jnp.arange(C) < common_len
  if window is not None:
    mask = (mask[None, None, :]
            & (q_pos_RxG[:, :, None] - jnp.arange(C)[None, None, :] < window)
            )[:, :, None, None, :]
  return attention_part(s, mask, common_v_CxNxK, "rgnqc,cnk->rgnqk")
