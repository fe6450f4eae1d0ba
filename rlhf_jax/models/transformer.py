"""The decoder: one set of weights, three forward modes.

- `__call__(tokens, positions, mask)`: full sequence, causal + padding mask
  (training, log-probs); with `return_kv=True` it is also the prefill and
  returns every layer's keys/values.
- `decode(...)`: one token per sample against the engine's prefix-shared KV
  (a prompt row read once per group + each sample's own tokens, + optionally
  a common prefix shared by every row).
- `__call__(..., context=(k, v, length))`: the tokens also attend to a
  context KV that precedes them (the engine's common prefix, prefilled once);
  positions are the caller's (offset by the context length).

Dimension letters as in layers.py, plus L layers, R prompt rows, G samples
per row, P prefix length, M per-sample suffix length.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from kernels_pallas.attention_parts import attention_part, merge_parts
from kernels_pallas.prefix_decode_attention import prefix_decode_attention
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.models.layers import (
    AttentionProjections, GatedMLP, RMSNorm, _param)
from rlhf_jax.parallel.layout import constrain


def _softcap(x, cap):
  return x if cap is None else cap * jnp.tanh(x / cap)


def causal_attention(q_BxTxHxK, k_BxSxNxK, v_BxSxNxK, allowed_BxTxS, cfg):
  """Softmax attention with an explicit allowed-keys mask (fp32 softmax)."""
  B, T, H, K = q_BxTxHxK.shape
  N = k_BxSxNxK.shape[2]
  q = q_BxTxHxK.reshape(B, T, N, H // N, K)
  s = jnp.einsum("btnqk,bsnk->bnqts", q, k_BxSxNxK,
                 preferred_element_type=jnp.float32) * cfg.scores_scale
  s = _softcap(s, cfg.attn_logit_softcap)
  out, _ = attention_part(s, allowed_BxTxS[:, None, None], v_BxSxNxK,
                          "bnqts,bsnk->btnqk")
  return out.reshape(B, T, H, K).astype(q_BxTxHxK.dtype)


def context_causal_attention(q_BxTxHxK, k_BxSxNxK, v_BxSxNxK, allowed_BxTxS,
                             ctx_k_CxNxK, ctx_v_CxNxK, ctx_allowed_BxTxC, cfg):
  """`causal_attention` plus a context KV shared by the batch, LSE-merged.

  The context (the engine's common prefix) is one [C, N, K] copy for all B
  sequences; it is its own attention part, merged exactly with the causal
  part by log-sum-exp, so it is never broadcast to [B, C, N, K].
  """
  B, T, H, K = q_BxTxHxK.shape
  N = k_BxSxNxK.shape[2]
  q = q_BxTxHxK.reshape(B, T, N, H // N, K)
  s = jnp.einsum("btnqk,bsnk->bnqts", q, k_BxSxNxK,
                 preferred_element_type=jnp.float32) * cfg.scores_scale
  own = attention_part(_softcap(s, cfg.attn_logit_softcap),
                       allowed_BxTxS[:, None, None], v_BxSxNxK,
                       "bnqts,bsnk->btnqk")
  s = jnp.einsum("btnqk,cnk->bnqtc", q, ctx_k_CxNxK,
                 preferred_element_type=jnp.float32) * cfg.scores_scale
  ctx = attention_part(_softcap(s, cfg.attn_logit_softcap),
                       ctx_allowed_BxTxC[:, None, None], ctx_v_CxNxK,
                       "bnqtc,cnk->btnqk")
  # lse comes back as [B, N, Q, T]; merge_parts wants out's layout minus K.
  parts = [(o, jnp.transpose(lse, (0, 3, 1, 2))) for o, lse in (own, ctx)]
  out, _ = merge_parts(parts)
  return out.reshape(B, T, H, K).astype(q_BxTxHxK.dtype)


class Block(nnx.Module):
  """Pre-norm attention + gated MLP, with Gemma 2's optional post-norms."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d = cfg.embed_dim
    self.attn_norm = RMSNorm(d, cfg, rngs=rngs)
    self.attn = AttentionProjections(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(d, cfg, rngs=rngs)
    self.mlp = GatedMLP(cfg, rngs=rngs)
    if cfg.post_norms:
      self.attn_post_norm = RMSNorm(d, cfg, rngs=rngs)
      self.mlp_post_norm = RMSNorm(d, cfg, rngs=rngs)
    self.post_norms = cfg.post_norms

  def _residual_mlp(self, x, attn_out):
    if self.post_norms:
      attn_out = self.attn_post_norm(attn_out)
    x = x + attn_out.astype(x.dtype)
    y = self.mlp(self.mlp_norm(x))
    if self.post_norms:
      y = self.mlp_post_norm(y)
    return x + y.astype(x.dtype)


class Decoder(nnx.Module):
  """Decoder-only transformer for the Llama / Qwen2 / Qwen3 / Gemma 2 family."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, v = cfg.embed_dim, cfg.vocab_size
    self.embed = _param(rngs, (v, d), ("vocab", "embed"), cfg.param_jnp_dtype,
                        fan_in=d)
    self.blocks = nnx.List([Block(cfg, rngs=rngs)
                            for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(d, cfg, rngs=rngs)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (d, v), ("embed", "vocab"),
                            cfg.param_jnp_dtype, fan_in=d)

  def _embed(self, tokens):
    cdt = self.cfg.compute_jnp_dtype
    x = jnp.take(self.embed[...], tokens, axis=0).astype(cdt)
    if self.cfg.embed_scale:
      x = x * jnp.asarray(math.sqrt(self.cfg.embed_dim), cdt)
    return constrain(x, ("batch", "length", "embed_act"))

  def _logits(self, x):
    cdt = self.cfg.compute_jnp_dtype
    x = self.final_norm(x)
    if self.cfg.tie_embeddings:
      logits = jnp.einsum("btd,vd->btv", x, self.embed[...].astype(cdt),
                          preferred_element_type=jnp.float32)
    else:
      logits = jnp.einsum("btd,dv->btv", x, self.lm_head[...].astype(cdt),
                          preferred_element_type=jnp.float32)
    logits = _softcap(logits, self.cfg.final_logit_softcap)
    return constrain(logits, ("batch", "length", "vocab"))

  def __call__(self, tokens_BxT, positions_BxT, mask_BxT, *,
               return_kv: bool = False, context=None):
    """Full-sequence forward.

    Args:
      tokens_BxT: int token ids.
      positions_BxT: RoPE positions.
      mask_BxT: True for real tokens; padding keys are never attended.
      return_kv: also return keys/values stacked over layers.
      context: optional (k [L,C,N,K], v [L,C,N,K], length []) of tokens at
        positions 0..length-1 that precede every sequence (one copy for the
        batch); every token also attends to them. Positions must continue
        after the context. C = 0 is the same as None.

    Returns:
      logits [B,T,V] fp32, and with return_kv (k, v) each [L,B,T,N,K] (the
      tokens' own KV, not the context's).
    """
    x, ks, vs = self._trunk(tokens_BxT, positions_BxT, mask_BxT,
                            context=context)
    logits = self._logits(x)
    if return_kv:
      return logits, (jnp.stack(ks), jnp.stack(vs))
    return logits

  def hidden_states(self, tokens_BxT, positions_BxT, mask_BxT):
    """Final-norm hidden states [B,T,D] (compute dtype), for scalar heads."""
    x, _, _ = self._trunk(tokens_BxT, positions_BxT, mask_BxT)
    return self.final_norm(x)

  def _trunk(self, tokens_BxT, positions_BxT, mask_BxT, context=None):
    """Embedding + blocks: residual stream [B,T,D] and per-layer k, v lists."""
    T = tokens_BxT.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    allowed = causal[None] & mask_BxT[:, None, :]
    dist = positions_BxT[:, :, None] - positions_BxT[:, None, :]
    if context is not None and context[0].shape[1] == 0:
      context = None
    if context is not None:
      ctx_k, ctx_v, ctx_len = context
      ctx_pos = jnp.arange(ctx_k.shape[1])
      ctx_dist = positions_BxT[:, :, None] - ctx_pos  # [B, T, C]
      ctx_allowed = jnp.broadcast_to(ctx_pos < ctx_len, ctx_dist.shape)
    x = self._embed(tokens_BxT)
    ks, vs = [], []
    for i, block in enumerate(self.blocks):
      layer_allowed = allowed
      if self.cfg.is_local_layer(i):
        layer_allowed = allowed & (dist < self.cfg.sliding_window)
      q, k, v = block.attn.qkv(block.attn_norm(x), positions_BxT)
      if context is None:
        o = causal_attention(q, k, v, layer_allowed, self.cfg)
      else:
        layer_ctx = ctx_allowed
        if self.cfg.is_local_layer(i):
          layer_ctx = ctx_allowed & (ctx_dist < self.cfg.sliding_window)
        o = context_causal_attention(q, k, v, layer_allowed, ctx_k[i],
                                     ctx_v[i], layer_ctx, self.cfg)
      x = block._residual_mlp(x, block.attn.out(o))
      ks.append(k)
      vs.append(v)
    return x, ks, vs

  def decode(self, tokens_RxG, positions_RxG, prefix_k, prefix_v, prefix_len_R,
             suffix_k, suffix_v, suffix_len_RxG, *, attention_impl="auto",
             common_k=None, common_v=None, common_len=None):
    """One decode step for R rows x G samples against prefix-shared KV.

    Args:
      tokens_RxG: the token each sample feeds now (not yet in any cache).
      positions_RxG: its position (prompt length + own tokens so far).
      prefix_k, prefix_v: [L,R,P,N,K] prompt KV, one row per prompt.
      prefix_len_R: valid prompt tokens per row.
      suffix_k, suffix_v: [L,R,G,M,N,K] each sample's own KV.
      suffix_len_RxG: own tokens already cached; the new KV is written there.
      attention_impl: "auto" | "xla" | "pallas".
      common_k, common_v: optional [L,C,N,K] common prefix shared by every row
        (positions 0..C-1; then prompt positions start after it).
      common_len: [] its valid tokens.

    Returns:
      logits [R,G,V] fp32, updated suffix_k, suffix_v.
    """
    common = common_k is not None and common_k.shape[1] > 0
    R, G = tokens_RxG.shape
    rows = jnp.arange(R)[:, None]
    cols = jnp.arange(G)[None, :]
    x = self._embed(tokens_RxG)  # [R, G, D]: rows as batch, samples as length.
    for i, block in enumerate(self.blocks):
      q, k, v = block.attn.qkv(block.attn_norm(x), positions_RxG)
      suffix_k = suffix_k.at[i, rows, cols, suffix_len_RxG].set(
          k.astype(suffix_k.dtype), mode="drop")
      suffix_v = suffix_v.at[i, rows, cols, suffix_len_RxG].set(
          v.astype(suffix_v.dtype), mode="drop")
      o = prefix_decode_attention(
          q, prefix_k[i], prefix_v[i], prefix_len_R, suffix_k[i], suffix_v[i],
          suffix_len_RxG + 1, scale=self.cfg.scores_scale,
          logit_softcap=self.cfg.attn_logit_softcap, impl=attention_impl,
          **(dict(common_k_CxNxK=common_k[i], common_v_CxNxK=common_v[i],
                  common_len=common_len) if common else {}))
      x = block._residual_mlp(x, block.attn.out(o))
    return self._logits(x), suffix_k, suffix_v
