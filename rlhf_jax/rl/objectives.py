"""Loss "terms" for the learner: SFT, policy loss, value loss, Bradley-Terry.

Each factory returns (terms_fn, weight_fn) for `Learner`: terms_fn gives a
micro-batch numerator (summed over micro-batches), weight_fn the batch-level
normaliser. Batches are dicts of [B, T] arrays: tokens, positions, attn_mask,
targets (tokens shifted left), loss_mask (1 where the target is trained) and,
for RL, old_logp, ref_logp and advantages [B].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from rlhf_jax.models import moe, reward_model
from rlhf_jax.rl import (
  aggregation,
  critic,
  grouped,
  losses,
  off_policy,
  preference,
  registry,
)


def _masked_mean(x, mask):
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


@dataclasses.dataclass(frozen=True)
class RouterLoss:
  """An MoE policy's router terms (`models/moe.py`), over the tokens that
  predict trained targets: coef x the load-balancing loss (each layer's,
  or transformers' form over all layers together: `moe.balance_loss`),
  coef x the router z-loss."""
  balance_coef: float = 0.0
  z_coef: float = 0.0
  balance_per_layer: bool = True


def _router_terms(router, c: RouterLoss, weight, replayed: bool = False):
  """(coef-weighted router losses x `weight`, their metrics) of an MoE
  micro-batch's router statistics (`models/moe.py`); weighting each
  micro-batch by its share of the batch's normaliser makes one
  micro-batch's loss exactly coef x each term. `replayed` (the batch
  carries recorded routes): also the flip rate, the share of replayed
  (token, layer) choices the trainer's router would have made otherwise."""
  balance = moe.balance_loss(router, per_layer=c.balance_per_layer)
  z = moe.z_loss(router)
  aux = {**moe.expert_load(router), "moe_balance_loss": balance,
         "moe_z_loss": z}
  if replayed:
    aux["moe_flip_rate"] = jnp.sum(router["flipped"]) / jnp.maximum(
        jnp.sum(router["replayed"]), 1.0)
  return (c.balance_coef * balance + c.z_coef * z) * weight, aux


# The terms functions are cached by their (frozen) configs: learners built
# from equal configs get the same functions, so they share their programs
# (`rl/learner.py`, `shared_programs.py`).


@functools.cache
def sft_terms(router_loss: RouterLoss = RouterLoss()):
  """Token-mean cross-entropy on the loss_mask targets (+ an MoE's router
  losses, `_router_terms`)."""
  def terms(graphdef, params, mb):
    logp, _, argmax, router = grouped.target_logprobs(graphdef, params, mb,
                                                      router_stats=True)
    mask = mb["loss_mask"]
    num = -jnp.sum(logp * mask)
    aux = {"accuracy": _masked_mean(
        (argmax == mb["targets"]).astype(jnp.float32), mask)}
    if router is not None:
      extra, router_aux = _router_terms(router, router_loss, jnp.sum(mask))
      num, aux = num + extra, {**aux, **router_aux}
    return num, aux

  return terms, lambda batch: jnp.sum(batch["loss_mask"])


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
  """The clipped policy-gradient objective (GRPO family)."""
  policy_loss: str = "ppo"
  clip_low: float = 0.2
  clip_high: float = 0.2
  clip_c: float | None = None      # Dual-clip constant (> 1) or None.
  kl: losses.KLConfig = losses.KLConfig()  # A loss term where in_loss.
  aggregation: str = "token-mean"
  max_len: int | None = None       # For seq-mean-token-sum-norm.
  # Sampler -> trainer correction (`rl/off_policy.py`): "none" | "is"
  # (decoupled PPO) | "tis" | "mis" | "icepop", with cap C (and floor F);
  # a sequence mask on the geometric-mean weight: "none" | "geometric".
  importance_weight: str = "none"
  importance_cap: float = 2.0
  importance_floor: float = 0.5
  sequence_mask: str = "none"
  sequence_band: tuple[float, float] = (0.99, 1.01)
  # One update per batch (`off_policy.on_policy`): the anchor is the
  # weights being trained, stop_gradient(logp); batches carry no old_logp
  # and the loss measures the sampler mismatch (`off_policy.mismatch_sums`
  # over "mismatch_mask", default the loss mask).
  on_policy: bool = False
  router: RouterLoss = RouterLoss()  # An MoE policy's router terms.


@functools.cache
def policy_terms(c: PolicyLossConfig):
  """Clipped surrogate (+ beta * KL to the reference) with `c.aggregation`.

  Takes batches in any layout of `rl/grouped.py` (repeated prompts,
  grouped: each prompt run once for its G responses, or packed rows); same
  loss in each (GSPO's sequence ratio over each packed sequence's run).
  With `c.importance_weight` or `c.sequence_mask` each token's
  term is weighted by `off_policy.behaviour_weights` of old_logp (the
  anchor) against the batch's "sampler_logp".
  """
  loss_fn = registry.get("policy_loss", c.policy_loss)
  registry.get("kl_estimator", c.kl.estimator)  # Fail early on a bad name.

  def packed(batch):
    return batch if grouped.is_packed(batch) else None

  def terms(graphdef, params, mb):
    logp, entropy, _, router = grouped.target_logprobs(
        graphdef, params, mb, router_stats=True)
    replayed = "routes" in mb or "prompt_routes" in mb
    mb = grouped.per_sequence(mb)
    mask = mb["loss_mask"]
    aux = {}
    if c.on_policy:
      old_logp = jax.lax.stop_gradient(logp)
      aux = off_policy.mismatch_sums(old_logp, mb["sampler_logp"],
                                     mb.get("mismatch_mask", mask))
    else:
      old_logp = mb["old_logp"]
    loss, m = loss_fn(logp, old_logp, mb["advantages"], mask,
                      clip_low=c.clip_low, clip_high=c.clip_high,
                      clip_c=c.clip_c, seq_BxT=mb.get("seq"))
    if c.importance_weight != "none" or c.sequence_mask != "none":
      w, weights_aux = off_policy.behaviour_weights(
          old_logp, mb["sampler_logp"], mask,
          weighting=c.importance_weight, cap=c.importance_cap,
          floor=c.importance_floor, sequence_mask=c.sequence_mask,
          sequence_band=c.sequence_band, seq_BxT=mb.get("seq"))
      loss = loss * w
      aux.update(weights_aux)
    kl = registry.get("kl_estimator", c.kl.estimator)(logp, mb["ref_logp"])
    if c.kl.loss_coef:
      loss = loss + losses.kl_loss(logp, mb["ref_logp"], mask,
                                   beta=c.kl.loss_coef,
                                   estimator=c.kl.estimator)
    num, _ = aggregation.aggregate_terms(loss, mask, c.aggregation,
                                         max_len=c.max_len, packed=packed(mb))
    aux = {**aux, "kl": _masked_mean(kl, mask),
           "entropy": _masked_mean(entropy, mask),
           "clip_frac": m["clip_frac"], "approx_kl": m["approx_kl"]}
    if router is not None:
      extra, router_aux = _router_terms(router, c.router, weight(mb),
                                        replayed=replayed)
      num, aux = num + extra, {**aux, **router_aux}
    return num, aux

  def weight(batch):
    batch = grouped.per_sequence(batch)
    zeros = jnp.zeros(batch["loss_mask"].shape, jnp.float32)
    return aggregation.aggregate_terms(zeros, batch["loss_mask"],
                                       c.aggregation, max_len=c.max_len,
                                       packed=packed(batch))[1]

  return terms, weight


@functools.cache
def reward_model_terms():
  """Bradley-Terry loss (+ margin) summed over pairs; weight = #pairs.

  The batch holds P pairs as chosen_{tokens,positions,mask} and
  rejected_{tokens,positions,mask} [P, T] plus margin [P]; both sides go
  through one forward of 2P rows.
  """
  def terms(graphdef, params, mb):
    both = {k: jnp.concatenate([mb[f"chosen_{k}"], mb[f"rejected_{k}"]])
            for k in ("tokens", "positions", "mask")}
    s = reward_model.score(graphdef, params, both["tokens"],
                           both["positions"], both["mask"])
    chosen, rejected = jnp.split(s, 2)
    loss = preference.bradley_terry_loss(chosen, rejected, mb["margin"])
    acc = preference.pair_accuracy(chosen, rejected)
    return jnp.sum(loss), {"pair_accuracy": jnp.mean(acc),
                           "score_gap": jnp.mean(chosen - rejected)}

  return terms, lambda batch: jnp.asarray(batch["margin"].shape[0],
                                          jnp.float32)


@functools.cache
def value_terms(clip_range: float | None):
  """PPO's clipped value loss, token-mean over loss_mask (the critic).

  The batch also holds old_values and returns [B, T] (GAE targets; [W, L]
  in packed rows); values are read at the positions whose next token is a
  response token, the same positions as the policy's log-probs.
  """
  def terms(graphdef, params, mb):
    v = reward_model.batch_values(graphdef, params, mb)
    loss, m = critic.value_loss(v, mb["old_values"], mb["returns"],
                                mb["loss_mask"], clip_range=clip_range)
    return jnp.sum(loss), m

  return terms, lambda batch: jnp.sum(batch["loss_mask"])


def policy_learner(graphdef, layout, c: PolicyLossConfig, optimizer, *,
                   micro_batches: int, trainable=None):
  """The policy's `Learner` (GRPO's, PPO's actor): `policy_terms(c)`;
  `trainable`: a filter of the params that train (LoRA), None: all."""
  from rlhf_jax.rl.learner import Learner  # pylint: disable=g-import-not-at-top
  terms, weight = policy_terms(c)
  return Learner(graphdef, layout, optimizer, terms_fn=terms,
                 weight_fn=weight, micro_batches=micro_batches,
                 trainable=trainable)

