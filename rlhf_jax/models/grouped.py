"""Grouped forward: one prompt + G responses, the prompt computed once.

Dimension letters as in layers.py, except that N counts groups (prompts)
here and J the kv heads (layers.py's N); G responses per group, B = N*G
sequences, P prompt length (padded), R response length, Q = H/J query heads
per kv head, S response keys.

A GRPO group is G sequences [prompt; response_g] with the same prompt. In the
repeated layout each sequence runs the prompt again. Here the prompt rows
[N, P] run once per layer, as usual causal self-attention (prompt K/V depend
only on the prompt), and each response row [B, R] attends to two disjoint key
sets:
  prefix part: the group's prompt keys. All G*R*Q queries of a group and kv
    head meet the group's P keys in one [G*R*Q, K] x [K, P] matmul.
  suffix part: the response's own earlier tokens (causal).
Each part gives a normalised output and its log-sum-exp, merged exactly in
fp32 by `merge_parts` (the same rule the engine's decode uses). So the logits
equal the repeated layout's up to fp32 rounding. The backward pass is plain
autodiff: the prefix einsum's transpose sums the G responses' gradients into
the prompt's K/V, and from there into the prompt activations and weights.

Prompts are right-padded: prompt n holds tokens at positions [0, len_n) and
response token j of group n sits at position len_n + j, exactly where the
repeated layout [prompt; response] puts it. Padding keys are masked.

This is pure jnp: the XLA path, used on every backend (the default on CPU).
The Pallas prefix-decode kernel is not on this path: JAX cannot differentiate
a `pallas_call`, so a kernel here would need a `custom_vjp` (forward kernel
saving the LSE, backward kernel or jnp recompute); none is needed to get the
FLOP and memory saving, which comes from running the prompt once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas.attention_parts import attention_part, merge_parts
from rlhf_jax.models.transformer import Decoder, causal_attention
from rlhf_jax.parallel.layout import constrain


def _softcap(x, cap):
  return x if cap is None else cap * jnp.tanh(x / cap)

def prefix_suffix_attention(q_BxRxHxK, k_BxRxJxK, v_BxRxJxK, prompt_k_NxPxJxK,
                            prompt_v_NxPxJxK, prefix_allowed_BxRxP,
                            suffix_allowed_BxRxS, cfg):
  """Attention of response queries over prompt keys + own keys, LSE-merged.

  Args:
    q_BxRxHxK: response queries, rows ordered group-major (b = n*G + g).
    k_BxRxJxK, v_BxRxJxK: the responses' own keys/values.
    prompt_k_NxPxJxK, prompt_v_NxPxJxK: each group's prompt keys/values.
    prefix_allowed_BxRxP: bool, which prompt keys a query sees.
    suffix_allowed_BxRxS: bool, which own keys a query sees (causal).
    cfg: the ModelConfig (scale, logit soft-cap).

  Returns:
    [B, R, H, K] attention output in the query dtype.
  """
  B, R, H, K = q_BxRxHxK.shape
  N, P, J = prompt_k_NxPxJxK.shape[:3]
  G = B // N
  q = q_BxRxHxK.reshape(B, R, J, H // J, K)
  # Prefix: the group's G*R*Q queries per kv head in one matmul.
  qg = q.reshape(N, G, R, J, H // J, K)
  s_pre = jnp.einsum("ngrjqk,npjk->ngrjqp", qg, prompt_k_NxPxJxK,
                     preferred_element_type=jnp.float32) * cfg.scores_scale
  s_pre = _softcap(s_pre, cfg.attn_logit_softcap)
  mask_pre = prefix_allowed_BxRxP.reshape(N, G, R, 1, 1, P)
  o_pre, l_pre = attention_part(s_pre, mask_pre, prompt_v_NxPxJxK,
                                "ngrjqp,npjk->ngrjqk")
  o_pre = o_pre.reshape(B, R, J, H // J, K)
  l_pre = l_pre.reshape(B, R, J, H // J)
  # Suffix: each response against its own tokens.
  s_suf = jnp.einsum("brjqk,bsjk->brjqs", q, k_BxRxJxK,
                     preferred_element_type=jnp.float32) * cfg.scores_scale
  s_suf = _softcap(s_suf, cfg.attn_logit_softcap)
  o_suf, l_suf = attention_part(s_suf, suffix_allowed_BxRxS[:, :, None, None],
                                v_BxRxJxK, "brjqs,bsjk->brjqk")
  out, _ = merge_parts([(o_pre, l_pre), (o_suf, l_suf)])
  return out.reshape(B, R, H, K).astype(q_BxRxHxK.dtype)


def _grouped_logits(model: Decoder, prompt_tokens_NxP, prompt_len_N,
                    response_tokens_NxGxR):
  """See `grouped_logits`; `model` is the merged Decoder."""
  cfg = model.cfg
  N, P = prompt_tokens_NxP.shape
  G, R = response_tokens_NxGxR.shape[1:]
  B = N * G
  len_B = jnp.repeat(prompt_len_N, G)
  pos_p = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (N, P))
  pos_r = len_B[:, None] + jnp.arange(R, dtype=jnp.int32)[None]  # [B, R]
  mask_p = pos_p < prompt_len_N[:, None]
  # Prompt self-attention: causal + padding, as Decoder._trunk.
  allowed_p = jnp.tril(jnp.ones((P, P), bool))[None] & mask_p[:, None, :]
  dist_p = pos_p[:, :, None] - pos_p[:, None, :]
  # Responses: prompt keys below the prompt length; own keys causal.
  allowed_pre = jnp.broadcast_to(jnp.repeat(mask_p, G, axis=0)[:, None, :],
                                 (B, R, P))
  dist_pre = pos_r[:, :, None] - jnp.arange(P)[None, None, :]
  allowed_suf = jnp.broadcast_to(jnp.tril(jnp.ones((R, R), bool)), (B, R, R))
  dist_suf = jnp.arange(R)[:, None] - jnp.arange(R)[None, :]

  x_p = model._embed(prompt_tokens_NxP)
  x_r = model._embed(response_tokens_NxGxR.reshape(B, R))
  for i, block in enumerate(model.blocks):
    a_p, a_pre, a_suf = allowed_p, allowed_pre, allowed_suf
    if cfg.is_local_layer(i):
      w = cfg.sliding_window
      a_p, a_pre, a_suf = (a_p & (dist_p < w), a_pre & (dist_pre < w),
                           a_suf & (dist_suf < w)[None])
    q_p, k_p, v_p = block.attn.qkv(block.attn_norm(x_p), pos_p)
    q_r, k_r, v_r = block.attn.qkv(block.attn_norm(x_r), pos_r)
    o_p = causal_attention(q_p, k_p, v_p, a_p, cfg)
    o_r = prefix_suffix_attention(q_r, k_r, v_r, k_p, v_p, a_pre, a_suf, cfg)
    x_p = block._residual_mlp(x_p, block.attn.out(o_p))
    x_r = block._residual_mlp(x_r, block.attn.out(o_r))
  # Response token 0 is predicted by the prompt's last token (shared by the
  # group), token j > 0 by response token j - 1; the last response token
  # predicts nothing, so it skips the vocabulary projection.
  last_N = jnp.take_along_axis(x_p, (prompt_len_N - 1)[:, None, None],
                               axis=1)  # [N, 1, D]
  first = model._logits(last_N)  # [N, 1, V]
  first = constrain(jnp.repeat(first, G, axis=0), ("batch", "length", "vocab"))
  rest = model._logits(x_r[:, :R - 1])
  return jnp.concatenate([first, rest], axis=1)


def grouped_logits(graphdef, params, prompt_tokens_NxP: jax.Array,
                   prompt_len_N: jax.Array,
                   response_tokens_NxGxR: jax.Array) -> jax.Array:
  """Logits of every response token, prompt computed once per group.

  Args:
    graphdef, params: the decoder (see `model.forward`).
    prompt_tokens_NxP: right-padded prompt ids.
    prompt_len_N: true prompt lengths (>= 1).
    response_tokens_NxGxR: response ids (padding after each response's end
      is harmless: no valid position attends to it).

  Returns:
    fp32 logits [B, R, V], B = N*G rows ordered group-major: row n*G + g,
    position j is the distribution of response token j, i.e. the logits the
    repeated layout has at position len_n - 1 + j.
  """
  model = nnx.merge(graphdef, params)
  return _grouped_logits(model, prompt_tokens_NxP, prompt_len_N,
                         response_tokens_NxGxR)
