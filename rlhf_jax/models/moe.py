"""Mixture-of-experts feed-forward (Qwen3-MoE): router, top-k, routed experts.

Each token's router picks `experts_per_token` of `num_experts` gated MLPs
(softmax over all experts, top-k, optionally renormalised over the k: the
checkpoint's `norm_topk_prob`); its output is the weighted sum of theirs.
Dropless: every assignment is computed, by a grouped matmul
(`jax.lax.ragged_dot`) over the assignments sorted by expert.

Expert parallelism: the experts' weights [E, ...] are split over the mesh
axis "expert" (`parallel/mesh.py`), each device holding E / ep of them
whole. Under a layout the layer runs in `shard_map`:
- training (the batch split over "expert" too): each device gathers the
  tokens of its expert group (`all_gather`), computes its own experts'
  share of every token, and the shares are summed back onto the tokens'
  devices (`psum_scatter`);
- rollout (a replica's tokens on every device of the replica): each device
  computes its experts' share of the replica's tokens, summed by `psum`.
Both are collectives XLA:CPU has, sized by the tokens, never by how the
router spread them: nothing is dropped, whatever the routing. (A ragged
all-to-all would move only the routed rows; XLA:CPU lacks it,
jax-ml/jax#34755.) With the expert MLP's hidden dimension split over
"tensor" the shares are partial sums over it too.

Dimension letters as in layers.py, plus E experts (e local ones), A
assignments (tokens x k), F the expert MLP's hidden size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from rlhf_jax.models.config import ModelConfig
from rlhf_jax.models.layers import _param, gate_activation
from rlhf_jax.parallel.layout import active_layout

# Router statistics of one layer (`Decoder.__call__(router_stats=True)`),
# summed over the tokens the losses count (each with its weight): top-k
# assignments per expert, router probability per expert, squared
# log-sum-exp of the router logits, tokens; the load: top-k assignments
# per expert over every real token the pass routes; with routing replay,
# the routed tokens replayed and those whose own top k differs.
STAT_KEYS = ("assigned_E", "prob_E", "lse_sq", "tokens", "routed_E",
             "replayed", "flipped")


def route(cfg: ModelConfig, router_DxE, x_NxD, replay_NxK=None):
  """(router logits [N, E] fp32, expert ids [N, k], their weights [N, k]
  fp32) as Qwen3-MoE routes: softmax in fp32 over all experts, the k
  largest, renormalised to sum 1 with `norm_topk_prob`.

  With `replay_NxK` (rollout routing replay: the experts the sampler
  chose), a token whose row holds k ids >= 0 goes to those experts instead,
  weighted by this router's probabilities of them (renormalised the same
  way), so the router still gets gradients; a row with a -1 (no record)
  keeps the token's own top k.
  """
  logits = jnp.einsum("nd,de->ne", x_NxD, router_DxE.astype(x_NxD.dtype),
                      preferred_element_type=jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  weights, ids = jax.lax.top_k(probs, cfg.experts_per_token)
  ids = ids.astype(jnp.int32)
  if replay_NxK is not None:
    recorded = jnp.all(replay_NxK >= 0, axis=-1, keepdims=True)
    ids = jnp.where(recorded, replay_NxK.astype(jnp.int32), ids)
    weights = jnp.take_along_axis(probs, ids, axis=-1)
  if cfg.norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return logits, ids, weights


def routed_experts(cfg: ModelConfig, x_NxD, ids_NxK, weights_NxK, gate_ExDxF,
                   up_ExDxF, down_ExFxD):
  """Sum over each token's assignments to the given e experts (ids in
  [0, e); others are another device's and add nothing) of weight x that
  expert's gated MLP of the token: [N, D] in x's dtype.

  The A = N k assignments are sorted by expert so each expert's rows are
  contiguous; `ragged_dot` multiplies each group by its expert's weights
  (rows past the groups, the other devices' assignments, come out 0)."""
  N, K = ids_NxK.shape
  e = gate_ExDxF.shape[0]
  expert_A = ids_NxK.reshape(-1)
  local_A = (expert_A >= 0) & (expert_A < e)
  order_A = jnp.argsort(jnp.where(local_A, expert_A, e), stable=True)
  group_sizes = jnp.bincount(jnp.where(local_A, expert_A, e),
                             length=e + 1)[:e].astype(jnp.int32)
  token_A = order_A // K
  xs_AxD = x_NxD[token_A]
  cdt = x_NxD.dtype
  gate = jax.lax.ragged_dot(xs_AxD, gate_ExDxF.astype(cdt), group_sizes)
  up = jax.lax.ragged_dot(xs_AxD, up_ExDxF.astype(cdt), group_sizes)
  h_AxF = gate_activation(cfg, gate) * up
  y_AxD = jax.lax.ragged_dot(h_AxF, down_ExFxD.astype(cdt), group_sizes)
  w_A = jnp.where(local_A, weights_NxK.reshape(-1), 0.0)[order_A]
  y_AxD = (y_AxD.astype(jnp.float32) * w_A[:, None])
  return jnp.zeros((N, x_NxD.shape[1]), jnp.float32).at[token_A].add(
      y_AxD).astype(cdt)


def _expert_parallel(cfg: ModelConfig, layout, x, ids, weights, gate, up,
                     down):
  """`routed_experts` under `shard_map` over the layout's mesh (module
  docstring): tokens on their batch shards, experts on "expert", their
  hidden dimension on "tensor"."""
  lead = x.shape[:-1]
  batch = layout.spec(("batch",), lead[:1])[0]
  batch_axes = () if batch is None else (
      (batch,) if isinstance(batch, str) else tuple(batch))
  experts = layout.spec(("experts",), gate.shape[:1])[0]
  hidden = layout.spec(("expert_mlp",), gate.shape[2:])[0]
  # Experts split over "expert" (dropped when it does not divide E: then
  # every device holds them all and computes its own tokens).
  ep = layout.mesh.shape["expert"] if experts is not None else 1
  gather = "expert" in batch_axes and ep > 1
  token_spec = P(batch, *(None,) * (len(lead) - 1), None)

  def local(x, ids, weights, gate, up, down):
    shape = x.shape
    x, ids, weights = (a.reshape(-1, a.shape[-1]) for a in (x, ids, weights))
    if gather:
      x, ids, weights = (jax.lax.all_gather(a, "expert", tiled=True)
                         for a in (x, ids, weights))
    if ep > 1:
      ids = ids - jax.lax.axis_index("expert") * gate.shape[0]
    y = routed_experts(cfg, x, ids, weights, gate, up, down)
    if hidden is not None:
      y = jax.lax.psum(y, "tensor")
    if gather:
      y = jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)
    elif ep > 1:
      y = jax.lax.psum(y, "expert")
    return y.reshape(shape)

  return jax.shard_map(
      local, mesh=layout.mesh,
      in_specs=(token_spec, token_spec, token_spec, P(experts, None, hidden),
                P(experts, None, hidden), P(experts, hidden, None)),
      out_specs=token_spec, check_vma=False)(x, ids, weights, gate, up, down)


class MoeMLP(nnx.Module):
  """Router + `num_experts` gated MLPs, each token through its top k.

  Params: router [D, E]; gate, up [E, D, F]; down [E, F, D] (one stacked
  weight per projection: HF's per-expert tensors, `hf_weights`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f, n, dt = (cfg.embed_dim, cfg.expert_mlp_dim, cfg.num_experts,
                   cfg.param_jnp_dtype)
    self.cfg = cfg
    self.router = _param(rngs, (d, n), ("embed", None), dt, d)
    self.gate = _param(rngs, (n, d, f), ("experts", "embed", "expert_mlp"),
                       dt, d)
    self.up = _param(rngs, (n, d, f), ("experts", "embed", "expert_mlp"),
                     dt, d)
    self.down = _param(rngs, (n, f, d), ("experts", "expert_mlp", "embed"),
                       dt, f)

  def __call__(self, x_BxTxD):
    return self.with_router(x_BxTxD)[0]

  def with_router(self, x_BxTxD, replay_BxTxK=None):
    """(output like x, router logits [..., E] fp32, the expert ids each
    token went to [..., k]); `replay_BxTxK`: see `route`."""
    cfg = self.cfg
    x = x_BxTxD.astype(cfg.compute_jnp_dtype)
    lead = x.shape[:-1]
    K = cfg.experts_per_token
    logits, ids, weights = route(
        cfg, self.router[...], x.reshape(-1, x.shape[-1]),
        None if replay_BxTxK is None else replay_BxTxK.reshape(-1, K))
    ids = ids.reshape(lead + ids.shape[-1:])
    weights = weights.reshape(lead + weights.shape[-1:])
    gate, up, down = self.gate[...], self.up[...], self.down[...]
    layout = active_layout()
    if layout is None:
      y = routed_experts(cfg, x.reshape(-1, x.shape[-1]),
                         ids.reshape(-1, ids.shape[-1]),
                         weights.reshape(-1, ids.shape[-1]), gate, up,
                         down).reshape(x.shape)
    else:
      y = _expert_parallel(cfg, layout, x, ids, weights, gate, up, down)
    return y, logits.reshape(lead + logits.shape[-1:]), ids


def router_stats(logits_NxE, weights_N, routed_N, k: int, ids_NxK=None,
                 replay_NxK=None) -> dict:
  """One layer's `STAT_KEYS`: the loss terms' over the tokens counted
  `weights_N` times, the load over the tokens where `routed_N`. `ids_NxK`:
  the experts each token went to (default: its top k); with `replay_NxK`
  (`route`), also how many routed tokens had a recorded choice and how many
  of those the router's own top k would have sent elsewhere (another set
  of experts)."""
  m = weights_N.astype(jnp.float32)
  probs = jax.nn.softmax(logits_NxE, axis=-1)
  _, own = jax.lax.top_k(probs, k)
  ids = own if ids_NxK is None else ids_NxK

  def per_expert(count_N):
    return jnp.zeros(logits_NxE.shape[-1], jnp.float32).at[
        ids.reshape(-1)].add(jnp.repeat(count_N.astype(jnp.float32), k))

  lse = jax.nn.logsumexp(logits_NxE, axis=-1)
  routed = routed_N.astype(jnp.float32)
  if replay_NxK is None:
    replayed = flipped = jnp.zeros((), jnp.float32)
  else:
    recorded = jnp.all(replay_NxK >= 0, axis=-1).astype(jnp.float32)
    differ = jnp.any(jnp.sort(own, -1) != jnp.sort(replay_NxK, -1), -1)
    replayed = jnp.sum(recorded * routed)
    flipped = jnp.sum(recorded * routed * differ)
  return {"assigned_E": per_expert(m),
          "prob_E": jnp.sum(probs * m[:, None], 0),
          "lse_sq": jnp.sum(lse * lse * m), "tokens": jnp.sum(m),
          "routed_E": per_expert(routed_N), "replayed": replayed,
          "flipped": flipped}


def balance_loss(stats: dict, per_layer: bool = True) -> jax.Array:
  """Switch-Transformer load balancing: E x sum_e f_e p_e, f_e the share of
  top-k assignments to expert e per token, p_e its mean router
  probability; k when balanced.

  per_layer: f and p of each layer, the mean over layers (Switch,
  Megatron-LM, MaxText): every layer is balanced. False: transformers'
  `load_balancing_loss_func`, f and p over every (layer, token) together,
  which balances only each expert index summed over the layers (an expert
  idle in one layer and busy in another costs nothing).
  """
  if per_layer:
    rows_L = jnp.maximum(stats["tokens"], 1.0)[:, None]
    f_LxE, p_LxE = stats["assigned_E"] / rows_L, stats["prob_E"] / rows_L
    return f_LxE.shape[-1] * jnp.mean(jnp.sum(f_LxE * p_LxE, -1))
  rows = jnp.maximum(jnp.sum(stats["tokens"]), 1.0)
  f_E = jnp.sum(stats["assigned_E"], 0) / rows
  p_E = jnp.sum(stats["prob_E"], 0) / rows
  return f_E.shape[0] * jnp.sum(f_E * p_E)


def z_loss(stats: dict) -> jax.Array:
  """Router z-loss (ST-MoE): the mean over (layer, token) of the squared
  log-sum-exp of the router logits; 0 over no token (an all-padding
  micro-batch of packed rows)."""
  return jnp.sum(stats["lse_sq"]) / jnp.maximum(jnp.sum(stats["tokens"]), 1.0)


def expert_load(stats: dict) -> dict:
  """Top-k assignments per expert and layer over the real tokens the pass
  routed (a prompt the grouped or packed layout shares once): the largest
  and the mean (their ratio is 1 when balanced), and the fewest (0: an
  expert of some layer received no token; +inf over no token at all, an
  all-padding micro-batch of packed rows, so the least over micro-batches
  skips it)."""
  per_layer_LxE = stats["routed_E"]
  return {"expert_tokens_max": jnp.max(per_layer_LxE),
          "expert_tokens_mean": jnp.mean(per_layer_LxE),
          "expert_tokens_min": jnp.where(jnp.sum(per_layer_LxE) > 0,
                                         jnp.min(per_layer_LxE), jnp.inf)}
