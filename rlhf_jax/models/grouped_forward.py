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

Both parts run `kernels_pallas/flash_attention.py` (the chunked path with
its own VJP: no [R, P] or [R, R] scores are held whole, in either pass;
the prompt's self-attention may use the vendor kernels), so the memory
saving of running the prompt once composes with the flash-style saving.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import flash_attention as fa
from kernels_pallas.attention_parts import merge_parts
from rlhf_jax.models import moe
from rlhf_jax.models.transformer import (
    Decoder, layer_window, parts_impl, scan_layers, self_attention)
from rlhf_jax.parallel.layout import constrain

# The prefix part's blocks: up to 2,048 prompt keys a block, and as many
# query rows as `cfg.prefix_block_scores` allows (the default, 1024 x 2048
# fp32, is 8 MiB per group and query head: ~100 MiB for 12 heads).
PREFIX_BLOCK_KEYS = 2048


def prefix_suffix_attention(q_BxRxHxK, k_BxRxJxK, v_BxRxJxK, pos_BxR,
                            prompt_k_NxPxJxK, prompt_v_NxPxJxK, prompt_pos_NxP,
                            prompt_seg_NxP, window, cfg):
  """Attention of response queries over prompt keys + own keys, LSE-merged.

  Args:
    q_BxRxHxK: response queries, rows ordered group-major (b = n*G + g).
    k_BxRxJxK, v_BxRxJxK: the responses' own keys/values.
    pos_BxR: response positions (after the group's prompt).
    prompt_k_NxPxJxK, prompt_v_NxPxJxK: each group's prompt keys/values.
    prompt_pos_NxP, prompt_seg_NxP: their positions; segment 0 real, -1 pad.
    window: this layer's sliding window (`transformer.layer_window`).
    cfg: the ModelConfig (scale, logit soft-cap, attention impl).

  Returns:
    [B, R, H, K] attention output in the query dtype.
  """
  B, R, H, K = q_BxRxHxK.shape
  N, P = prompt_k_NxPxJxK.shape[:2]
  G = B // N
  # Prefix: a group's G*R queries against its P prompt keys, one call, in
  # blocks far larger than the chunked path's default: the prefix has no
  # causal mask to skip blocks by, and 128 x 128 blocks made G*R/128 x P/128
  # sequential loop steps (2,048 a layer at G=16, R=1024, P=2048), which
  # bound a GPU step by launches rather than FLOPs (docs/results.md, GPU).
  block_k = min(P, PREFIX_BLOCK_KEYS, cfg.prefix_block_scores // 128)
  block_q = max(128, cfg.prefix_block_scores // block_k)
  pre, lse_pre = fa.attention(
      q_BxRxHxK.reshape(N, G * R, H, K), prompt_k_NxPxJxK, prompt_v_NxPxJxK,
      pos_BxR.reshape(N, G * R), prompt_pos_NxP,
      jnp.zeros((N, G * R), jnp.int32), prompt_seg_NxP, window=window,
      softcap=cfg.attn_logit_softcap, scale=cfg.scores_scale,
      impl=parts_impl(cfg),
      return_lse=True, block_q=block_q, block_k=block_k)
  # Suffix: each response against its own tokens (causal).
  own, lse_own = self_attention(
      q_BxRxHxK, k_BxRxJxK, v_BxRxJxK, pos_BxR,
      jnp.zeros((B, R), jnp.int32), window, cfg, return_lse=True)
  out, _ = merge_parts([
      (pre.reshape(B, R, H, K).astype(jnp.float32), lse_pre.reshape(B, R, H)),
      (own.astype(jnp.float32), lse_own)])
  return out.astype(q_BxRxHxK.dtype)


def grouped_hidden(model: Decoder, prompt_tokens_NxP, prompt_len_N,
                   response_tokens_NxGxR, router_weights_NxGxR=None,
                   replay=None, route_by_replay: bool = True):
  """Final-norm hidden states [B, R, D] that predict each response token
  (the model's `project` turns them into logits); `model` is a merged
  Decoder.

  With `router_weights_NxGxR` (MoE): also each layer's router statistics:
  the loss terms' over the tokens that predict the response tokens, each
  counted with the weight of the token it predicts (a prompt's last token
  once per response of its group): the tokens, and counts, of the
  repeated layout; the load over the real tokens routed (a prompt once).

  `replay` (MoE, rollout routing replay): (prompt [N, P, L, k], responses
  [N, G, R, L, k]) expert ids to route each token to (`moe.route`), or
  with `route_by_replay` False only to count the router's flips against
  (`Decoder.hidden_states`)."""
  cfg = model.cfg
  N, P = prompt_tokens_NxP.shape
  G, R = response_tokens_NxGxR.shape[1:]
  B = N * G
  len_B = jnp.repeat(prompt_len_N, G)
  pos_p = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (N, P))
  pos_r = len_B[:, None] + jnp.arange(R, dtype=jnp.int32)[None]  # [B, R]
  seg_p = jnp.where(pos_p < prompt_len_N[:, None], 0, -1)

  stats = router_weights_NxGxR is not None
  if stats:  # Who predicts what: see the end of this function.
    w_r = router_weights_NxGxR.reshape(B, R)
    # The load counts every real token once: the prompt's, and a
    # response's up to its last trained token (the layout marks no other
    # end; tokens an environment appended after it are not counted).
    routed_p = seg_p >= 0
    routed_r = jax.lax.cummax((w_r > 0).astype(jnp.int32), axis=1,
                              reverse=True)
    w_p = jnp.where(jnp.arange(P)[None] == prompt_len_N[:, None] - 1,
                    jnp.sum(router_weights_NxGxR[..., 0], 1)[:, None], 0.0)
    w_r = jnp.concatenate([w_r[:, 1:], jnp.zeros((B, 1), w_r.dtype)], 1)

  def layer(block, i, carry, replay_i):
    # The positions and segments ride in the carry: as the scan's
    # constants, the attention's block masks would be computed once for
    # every layer and kept (`Decoder._trunk`).
    x_p, x_r, pos_p, pos_r, seg_p = carry
    ids = (pos_p, pos_r, seg_p)
    window = layer_window(cfg, i)
    q_p, k_p, v_p = block.attn.qkv(block.attn_norm(x_p), pos_p)
    q_r, k_r, v_r = block.attn.qkv(block.attn_norm(x_r), pos_r)
    o_p = self_attention(q_p, k_p, v_p, pos_p, seg_p, window, cfg)
    o_r = prefix_suffix_attention(q_r, k_r, v_r, pos_r, k_p, v_p, pos_p,
                                  seg_p, window, cfg)
    if not stats and replay_i is None:
      return (block._residual_mlp(x_p, block.attn.out(o_p)),
              block._residual_mlp(x_r, block.attn.out(o_r)), *ids), None
    rep_p, rep_r = (None, None) if replay_i is None else replay_i
    route_p, route_r = (rep_p, rep_r) if route_by_replay else (None, None)
    x_p, logits_p, ids_p = block._residual_mlp(
        x_p, block.attn.out(o_p), routing=True, replay=route_p)
    x_r, logits_r, ids_r = block._residual_mlp(
        x_r, block.attn.out(o_r), routing=True, replay=route_r)
    if not stats:
      return (x_p, x_r, *ids), None
    E, K = cfg.num_experts, cfg.experts_per_token

    def rows(a, b, width):
      return jnp.concatenate([a.reshape(-1, width), b.reshape(-1, width)])

    return (x_p, x_r, *ids), moe.router_stats(
        rows(logits_p, logits_r, E),
        jnp.concatenate([w_p.reshape(-1), w_r.reshape(-1)]),
        jnp.concatenate([routed_p.reshape(-1), routed_r.reshape(-1)]), K,
        ids_NxK=rows(ids_p, ids_r, K),
        replay_NxK=None if replay_i is None else rows(rep_p, rep_r, K))

  x = (model._embed(prompt_tokens_NxP),
       model._embed(response_tokens_NxGxR.reshape(B, R)))
  if replay is not None:  # Scanned over layers: [L, ...] first.
    L, K = cfg.num_layers, cfg.experts_per_token
    replay = (jnp.moveaxis(replay[0], 2, 0),
              jnp.moveaxis(replay[1].reshape(B, R, L, K), 2, 0))
  (x_p, x_r, *_), layer_stats = scan_layers(
      model.blocks, cfg, layer, (*x, pos_p, pos_r, seg_p), replay)
  # Response token 0 is predicted by the prompt's last token (shared by the
  # group), token j > 0 by response token j - 1; the last response token
  # predicts nothing.
  last_N = jnp.take_along_axis(x_p, (prompt_len_N - 1)[:, None, None],
                               axis=1)  # [N, 1, D]
  x = jnp.concatenate([jnp.repeat(last_N, G, axis=0), x_r[:, :R - 1]], 1)
  h = model.final_norm(constrain(x, ("batch", "length", "embed_act")))
  return (h, layer_stats) if stats else h
