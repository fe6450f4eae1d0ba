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
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas import flash_attention as fa
from kernels_pallas.attention_parts import cap_logits, merge_parts
from kernels_pallas.paged_decode_attention import paged_decode_attention
from kernels_pallas.prefix_decode_attention import prefix_decode_attention
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.models import moe
from rlhf_jax.models.layers import (
    AttentionProjections, GatedMLP, RMSNorm, _param)
from rlhf_jax.parallel import context as context_parallel
from rlhf_jax.parallel.layout import constrain


def layer_window(cfg: ModelConfig, layer):
  """The sliding window of a layer (`NO_WINDOW` on a global one); traced
  when the layer index is (a scanned layer of Gemma 2)."""
  if cfg.sliding_window is None:
    return fa.NO_WINDOW
  local = cfg.is_local_layer(layer)
  if isinstance(local, bool):
    return cfg.sliding_window if local else fa.NO_WINDOW
  return jnp.where(local, cfg.sliding_window, fa.NO_WINDOW)


def self_attention(q_BxTxHxK, k_BxTxNxK, v_BxTxNxK, positions_BxT, seg_BxT,
                   window, cfg: ModelConfig, *, sub_BxT=None,
                   return_lse: bool = False, padded_rows: bool = True):
  """Causal attention of a row's tokens to its own (same segment, earlier
  positions, within the window; with `sub_BxT`, packed groups' sub-segments
  too); `kernels_pallas/flash_attention.py`. Under a layout that splits
  sequences over `context`, each device's queries attend to the keys and
  values gathered from the others (`parallel/context.py`)."""
  if context_parallel.shards() > 1:
    return context_parallel.attention(
        q_BxTxHxK, k_BxTxNxK, v_BxTxNxK, positions_BxT, seg_BxT, sub_BxT,
        window, return_lse=return_lse, softcap=cfg.attn_logit_softcap,
        scale=cfg.scores_scale, impl=parts_impl(cfg),
        block_q=cfg.attention_block, block_k=cfg.attention_block)
  return fa.attention(
      q_BxTxHxK, k_BxTxNxK, v_BxTxNxK, positions_BxT, positions_BxT, seg_BxT,
      seg_BxT, window=window, softcap=cfg.attn_logit_softcap,
      scale=cfg.scores_scale, impl=cfg.attention, return_lse=return_lse,
      q_sub=sub_BxT, k_sub=sub_BxT, self_attention=True,
      padded_rows=padded_rows, block_q=cfg.attention_block,
      block_k=cfg.attention_block)


def parts_impl(cfg: ModelConfig) -> str:
  """The attention impl of parts that are not a sequence's self-attention
  (a shared context, the grouped layout's prompt part): the vendor kernels
  take self-attention only, so "auto" picks for those."""
  return "auto" if cfg.attention in ("splash", "cudnn") else cfg.attention


def context_attention(q_BxTxHxK, k_BxTxNxK, v_BxTxNxK, positions_BxT,
                      seg_BxT, ctx_k_CxNxK, ctx_v_CxNxK, ctx_len, window,
                      cfg: ModelConfig):
  """`self_attention` plus a context KV that precedes every row (the
  engine's common prefix, positions 0..ctx_len-1), LSE-merged: two parts
  over disjoint keys, merged exactly (`attention_parts.merge_parts`)."""
  B = q_BxTxHxK.shape[0]
  C = ctx_k_CxNxK.shape[0]
  own = self_attention(q_BxTxHxK, k_BxTxNxK, v_BxTxNxK, positions_BxT,
                       seg_BxT, window, cfg, return_lse=True)
  ctx_pos = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C))
  ctx_seg = jnp.where(ctx_pos < ctx_len, 0, -1)
  ctx = fa.attention(
      q_BxTxHxK, jnp.broadcast_to(ctx_k_CxNxK, (B,) + ctx_k_CxNxK.shape),
      jnp.broadcast_to(ctx_v_CxNxK, (B,) + ctx_v_CxNxK.shape), positions_BxT,
      ctx_pos, jnp.where(seg_BxT >= 0, 0, -2), ctx_seg, window=window,
      softcap=cfg.attn_logit_softcap, scale=cfg.scores_scale,
      impl=parts_impl(cfg),
      return_lse=True)
  out, _ = merge_parts([(o.astype(jnp.float32), lse) for o, lse in (own, ctx)])
  return out.astype(q_BxTxHxK.dtype)


class Block(nnx.Module):
  """Pre-norm attention + gated MLP (or routed experts, `moe.MoeMLP`), with
  Gemma 2's optional post-norms."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d = cfg.embed_dim
    self.attn_norm = RMSNorm(d, cfg, rngs=rngs)
    self.attn = AttentionProjections(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(d, cfg, rngs=rngs)
    self.mlp = (moe.MoeMLP if cfg.is_moe else GatedMLP)(cfg, rngs=rngs)
    if cfg.post_norms:
      self.attn_post_norm = RMSNorm(d, cfg, rngs=rngs)
      self.mlp_post_norm = RMSNorm(d, cfg, rngs=rngs)
    self.post_norms = cfg.post_norms

  def _residual_mlp(self, x, attn_out, *, routing: bool = False,
                    replay=None):
    """The residual stream after the attention output and the MLP; with
    `routing` (MoE), also the router's logits [..., E] of each token and
    the experts it went to [..., k] (`replay`: `moe.route`)."""
    if self.post_norms:
      attn_out = self.attn_post_norm(attn_out)
    x = x + attn_out.astype(x.dtype)
    h = self.mlp_norm(x)
    y, logits, ids = (self.mlp.with_router(h, replay) if routing
                      else (self.mlp(h), None, None))
    if self.post_norms:
      y = self.mlp_post_norm(y)
    x = x + y.astype(x.dtype)
    return (x, logits, ids) if routing else x


def stack_layers(modules: list[nnx.Module]) -> nnx.Module:
  """One module whose params hold `modules`' params stacked on a leading
  "layers" axis (logical name prepended), for `jax.lax.scan`."""
  splits = [nnx.split(m) for m in modules]
  graphdef, states = splits[0][0], [state for _, state in splits]

  def stack(*vs):
    axes = vs[0].get_metadata().get("logical_axes")
    value = jnp.stack([v.get_value() for v in vs])
    if axes is None:
      return vs[0].replace(value)
    return vs[0].replace(value, logical_axes=("layers",) + tuple(axes))

  return nnx.merge(graphdef, jax.tree.map(
      stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable)))


_REMAT = {"none": None,
          "full": lambda f: jax.checkpoint(f, prevent_cse=False),
          "dots": lambda f: jax.checkpoint(
              f, prevent_cse=False,
              policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)}


def scan_layers(stacked: nnx.Module, cfg: ModelConfig,
                body: Callable[[nnx.Module, Any, Any, Any], tuple[Any, Any]],
                carry, xs=None):
  """Runs `body(block, layer, carry, x) -> (carry, y)` over the layers of
  the stacked module; returns (carry, ys stacked over layers).

  `jax.lax.scan` over the stacked params (one compiled layer, whatever the
  depth), or with `cfg.scan_layers=False` a Python loop over the same
  params (the reference; `layer` is then an int). `cfg.remat` wraps each
  layer in `jax.checkpoint` with its policy.
  """
  graphdef, state = nnx.split(stacked)

  def step(carry, inputs):
    layer_state, layer, x = inputs
    return body(nnx.merge(graphdef, layer_state), layer, carry, x)

  if _REMAT[cfg.remat] is not None:
    step = _REMAT[cfg.remat](step)
  if cfg.scan_layers:
    return jax.lax.scan(step, carry, (state, jnp.arange(cfg.num_layers), xs))
  ys = []
  for i in range(cfg.num_layers):
    layer_state, x = jax.tree.map(lambda a, i=i: a[i], (state, xs))
    carry, y = step(carry, (layer_state, i, x))
    ys.append(y)
  return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)


class Decoder(nnx.Module):
  """Decoder-only transformer for the Llama / Qwen2 / Qwen3 / Gemma 2 family.

  The blocks' params are stacked over layers (`stack_layers`; logical axis
  "layers", never sharded) and every mode runs them with `scan_layers`.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, v = cfg.embed_dim, cfg.vocab_size
    self.embed = _param(rngs, (v, d), ("vocab", "embed"), cfg.param_jnp_dtype,
                        fan_in=d)
    # Built one by one (each layer draws its own init), then stacked.
    self.blocks = stack_layers([Block(cfg, rngs=rngs)
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

  def head(self) -> tuple[jax.Array, int]:
    """(the vocabulary projection in the compute dtype, its vocab axis):
    the tied embedding [V, D] (axis 0) or the lm_head [D, V] (axis 1)."""
    cdt = self.cfg.compute_jnp_dtype
    if self.cfg.tie_embeddings:
      return self.embed[...].astype(cdt), 0
    return self.lm_head[...].astype(cdt), 1

  def project(self, h):
    """fp32 logits [..., V] of final-norm hidden states (soft-capped)."""
    w, axis = self.head()
    spec = "...d,vd->...v" if axis == 0 else "...d,dv->...v"
    logits = jnp.einsum(spec, h, w, preferred_element_type=jnp.float32)
    logits = cap_logits(logits, self.cfg.final_logit_softcap)
    if logits.ndim == 3:
      logits = constrain(logits, ("batch", "length", "vocab"))
    return logits

  def _logits(self, x):
    return self.project(self.final_norm(x))

  def __call__(self, tokens_BxT, positions_BxT, mask_BxT, *,
               return_kv: bool = False, context=None,
               router_stats: bool = False, replay_BxTxLxK=None):
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
      router_stats: (MoE) also return each layer's router statistics over
        the real tokens (`moe.STAT_KEYS`, each with a leading [L]).
      replay_BxTxLxK: (MoE) each token's experts in each layer to route it
        to (rollout routing replay, `moe.route`; -1: its own top k).

    Returns:
      logits [B,T,V] fp32, then with return_kv (k, v) each [L,B,T,N,K] (the
      tokens' own KV, not the context's), then with router_stats the stats.
    """
    if return_kv and context_parallel.shards() > 1:
      raise ValueError("return_kv: the rollout's prefill, not under a "
                       "layout that splits sequences over `context`")
    x, ks, vs, stats = self._trunk(tokens_BxT, positions_BxT, mask_BxT,
                                   context=context, router_stats=router_stats,
                                   replay_BxTxLxK=replay_BxTxLxK)
    out = (self._logits(x),)
    if return_kv:
      out += ((ks, vs),)
    if router_stats:
      out += (stats,)
    return out if len(out) > 1 else out[0]

  def prefill(self, tokens_BxT, positions_BxT, mask_BxT, last_B, *,
              context=None, return_routes: bool = False):
    """(logits [B,V] fp32 at positions `last_B` only, (k, v) [L,B,T,N,K]):
    the engine's prefill, without the [B,T,V] logits of every position.
    With `return_routes` (MoE), also the experts each token went to in
    each layer, [B,T,L,k]."""
    x, ks, vs, routes = self._trunk(tokens_BxT, positions_BxT, mask_BxT,
                                    context=context,
                                    return_routes=return_routes)
    x_last = jnp.take_along_axis(x, last_B[:, None, None], axis=1)[:, 0]
    out = self.project(self.final_norm(x_last)), (ks, vs)
    return (*out, jnp.moveaxis(routes, 0, 2)) if return_routes else out

  def hidden_states(self, tokens_BxT, positions_BxT, mask_BxT, *,
                    segments=None, subs=None, router_weights_BxT=None,
                    replay_BxTxLxK=None, route_by_replay: bool = True):
    """Final-norm hidden states [B,T,D] (compute dtype): of right-padded
    rows (`mask_BxT`), or of packed rows (`segments` [B,T]: tokens attend
    within their segment; negative: padding; `subs` [B,T]: packed groups,
    `rl/packing.py`). With `router_weights_BxT` (MoE): also each layer's
    router statistics, each token counted with its weight (the load over
    the real tokens). `replay_BxTxLxK`: see `__call__`; with
    `route_by_replay` False the tokens take their own top k and the
    recorded experts only count the router's flips (the statistics'
    "flipped": the trainer's own routing against the sampler's)."""
    x, _, _, stats = self._trunk(tokens_BxT, positions_BxT, mask_BxT,
                                 segments=segments, subs=subs,
                                 router_stats=router_weights_BxT is not None,
                                 router_weights_BxT=router_weights_BxT,
                                 replay_BxTxLxK=replay_BxTxLxK,
                                 route_by_replay=route_by_replay)
    h = self.final_norm(x)
    return h if router_weights_BxT is None else (h, stats)

  def _trunk(self, tokens_BxT, positions_BxT, mask_BxT, context=None,
             segments=None, subs=None, router_stats: bool = False,
             router_weights_BxT=None, replay_BxTxLxK=None,
             return_routes: bool = False, route_by_replay: bool = True):
    """Embedding + blocks: residual stream [B,T,D], k, v [L,B,T,N,K] and
    (with `router_stats`, MoE) each layer's router statistics over the
    real tokens (or each token counted `router_weights_BxT` times), or
    (with `return_routes`) the experts each token went to [L,B,T,k], else
    None. `replay_BxTxLxK`: see `__call__` (`route_by_replay`:
    `hidden_states`)."""
    cfg = self.cfg
    padded_rows = segments is None
    seg_BxT = (jnp.where(mask_BxT, 0, -1) if padded_rows  # Padding: its own.
               else segments)
    if context is not None and context[0].shape[1] == 0:
      context = None
    ctx_len = None if context is None else context[2]

    def layer(block, i, carry, xs):
      # The token ids ride in the carry, unchanged, rather than as constants
      # of the scan: JAX computes what depends on a scan's constants alone
      # once, before the loop, and keeps it for the backward pass, which
      # for the attention's block masks is every (query block, key block)
      # pair of every head: [T, T] bytes (0.9 GiB of Qwen2.5-0.5B's 4.7
      # at 8K tokens, quadratic in T; `benchmarks/memory.py`'s long
      # sequences).
      x, positions_BxT, seg_BxT, subs = carry
      ctx, replay_BxTxK = xs
      q, k, v = block.attn.qkv(block.attn_norm(x), positions_BxT)
      window = layer_window(cfg, i)
      if ctx is None:
        o = self_attention(q, k, v, positions_BxT, seg_BxT, window, cfg,
                           sub_BxT=subs, padded_rows=padded_rows)
      else:
        o = context_attention(q, k, v, positions_BxT, seg_BxT, ctx[0],
                              ctx[1], ctx_len, window, cfg)
      ids_carry = lambda x: (x, positions_BxT, seg_BxT, subs)  # noqa: E731
      if not (router_stats or return_routes or replay_BxTxK is not None):
        return ids_carry(block._residual_mlp(x, block.attn.out(o))), (
            k, v, None)
      x, logits, ids = block._residual_mlp(
          x, block.attn.out(o), routing=True,
          replay=replay_BxTxK if route_by_replay else None)
      if not router_stats:
        return ids_carry(x), (k, v, ids if return_routes else None)
      K = cfg.experts_per_token
      stats = moe.router_stats(
          logits.reshape(-1, cfg.num_experts), weights_N, real_N, K,
          ids_NxK=ids.reshape(-1, K), replay_NxK=None
          if replay_BxTxK is None else replay_BxTxK.reshape(-1, K))
      return ids_carry(x), (k, v, stats)

    if ((router_stats or return_routes or replay_BxTxLxK is not None)
        and not cfg.is_moe):
      raise ValueError("router_stats / routing replay: the model has no "
                       "routed experts")
    if router_stats and return_routes:
      raise ValueError("router_stats or return_routes, not both")
    C = context_parallel.shards()
    T = tokens_BxT.shape[1]
    if C > 1:
      if (context is not None or router_stats or return_routes
          or replay_BxTxLxK is not None):
        raise ValueError("context parallelism: no shared context, routing "
                         "replay or router statistics (an MoE) yet")
      # Whole chunks, then each device's two chunks (`context.balance`):
      # padding is a segment no real token has.
      pad = context_parallel.padded_length(T, C) - T
      lay_out = lambda x, fill: context_parallel.balance(  # noqa: E731
          jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill))
      tokens_BxT, positions_BxT = lay_out(tokens_BxT, 0), lay_out(
          positions_BxT, 0)
      seg_BxT = lay_out(seg_BxT, -1)
      subs = None if subs is None else lay_out(subs, 0)
    real_N = (seg_BxT >= 0).reshape(-1)
    weights_N = (real_N if router_weights_BxT is None
                 else router_weights_BxT.reshape(-1))
    x = self._embed(tokens_BxT)
    replay_LxBxTxK = (None if replay_BxTxLxK is None
                      else jnp.moveaxis(replay_BxTxLxK, 2, 0))
    (x, *_), (ks, vs, stats) = scan_layers(
        self.blocks, cfg, layer, (x, positions_BxT, seg_BxT, subs),
        (None if context is None else (context[0], context[1]),
         replay_LxBxTxK))
    if C > 1:  # Back to sequence order; no KV (that is the rollout's).
      x = context_parallel.unbalance(x)[:, :T]
      ks = vs = None
    return x, ks, vs, stats

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

    def layer(block, i, carry, _):
      # The caches ride in the carry: each layer writes its own slice in
      # place (a scan output would be a second copy of the cache).
      x, suffix_k, suffix_v = carry
      q, k, v = block.attn.qkv(block.attn_norm(x), positions_RxG)
      suffix_k = suffix_k.at[i, rows, cols, suffix_len_RxG].set(
          k.astype(suffix_k.dtype), mode="drop")
      suffix_v = suffix_v.at[i, rows, cols, suffix_len_RxG].set(
          v.astype(suffix_v.dtype), mode="drop")
      windowed = (dict(q_pos_RxG=positions_RxG, window=layer_window(
          self.cfg, i)) if self.cfg.sliding_window is not None else {})
      o = prefix_decode_attention(
          q, prefix_k[i], prefix_v[i], prefix_len_R, suffix_k[i], suffix_v[i],
          suffix_len_RxG + 1, scale=self.cfg.scores_scale,
          logit_softcap=self.cfg.attn_logit_softcap, impl=attention_impl,
          **windowed,
          **(dict(common_k_CxNxK=common_k[i], common_v_CxNxK=common_v[i],
                  common_len=common_len) if common else {}))
      return (block._residual_mlp(x, block.attn.out(o)), suffix_k,
              suffix_v), None

    x = self._embed(tokens_RxG)  # [R, G, D]: rows as batch, samples as length.
    (x, suffix_k, suffix_v), _ = scan_layers(
        self.blocks, self.cfg, layer, (x, suffix_k, suffix_v))
    return self._logits(x), suffix_k, suffix_v

  def paged_decode(self, tokens_S, positions_S, k_pages, v_pages,
                   write_page_S, write_offset_S, index, *,
                   attention_impl="auto", common_k=None, common_v=None,
                   common_len=None, return_routes: bool = False):
    """One decode step for S slots against paged, prefix-shared KV.

    Args:
      tokens_S: the token each slot feeds now (not yet in any page).
      positions_S: its position.
      k_pages, v_pages: [L, N, num_pages, T, K] the page pool.
      write_page_S, write_offset_S: where each slot's new KV goes (a page
        id out of range: nowhere, a free slot).
      index: dict of the page tables and lengths
        (`paged_decode_attention`: slot_group_S, slot_member_S,
        group_slots_RxG, group_pages_RxA, group_len_R, own_pages_SxB,
        own_len_S counting the new token, and the chunk bounds).
      attention_impl: "auto" | "xla" | "pallas" (the GPU kernel).
      common_k, common_v, common_len: optional common prefix [L, C, N, K].

      return_routes: (MoE) also return the experts each slot's token went
        to in each layer, [S, L, k].

    Returns:
      logits [S, V] fp32, updated k_pages, v_pages (and the routes).
    """
    common = common_k is not None and common_k.shape[1] > 0

    def layer(block, i, carry, _):
      x, k_pages, v_pages = carry
      q, k, v = block.attn.qkv(block.attn_norm(x), positions_S[:, None])
      # Advanced indices split by the head slice: the update is [S, N, K].
      k_pages = k_pages.at[i, :, write_page_S, write_offset_S].set(
          k[:, 0].astype(k_pages.dtype), mode="drop")
      v_pages = v_pages.at[i, :, write_page_S, write_offset_S].set(
          v[:, 0].astype(v_pages.dtype), mode="drop")
      windowed = (dict(q_pos_S=positions_S, window=layer_window(self.cfg, i))
                  if self.cfg.sliding_window is not None else {})
      # The whole pool and the layer index: a kernel reads its pages in
      # place (k_pages[i] would copy the layer's pool every step).
      o = paged_decode_attention(
          q[:, 0], k_pages, v_pages, **index, layer=i, impl=attention_impl,
          scale=self.cfg.scores_scale,
          logit_softcap=self.cfg.attn_logit_softcap, **windowed,
          **(dict(common_k_CxNxK=common_k[i], common_v_CxNxK=common_v[i],
                  common_len=common_len) if common else {}))
      if not return_routes:
        x = block._residual_mlp(x, block.attn.out(o[:, None]))
        return (x, k_pages, v_pages), None
      x, _, ids = block._residual_mlp(x, block.attn.out(o[:, None]),
                                      routing=True)
      return (x, k_pages, v_pages), ids[:, 0]

    x = self._embed(tokens_S[:, None])  # [S, 1, D]
    (x, k_pages, v_pages), routes_LxSxK = scan_layers(
        self.blocks, self.cfg, layer, (x, k_pages, v_pages))
    out = self._logits(x)[:, 0], k_pages, v_pages
    return ((*out, jnp.moveaxis(routes_LxSxK, 0, 1)) if return_routes
            else out)
