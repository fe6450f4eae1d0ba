"""Policy-gradient, KL and entropy terms, per token.

Dimension letters: B sequences, T response positions, V vocabulary.

Every loss here is per token ([B, T], 0 on padding); turning it into a scalar
is `aggregation.aggregate_loss`'s job, so the aggregation mode is chosen once
for all terms. Metrics are masked means over valid tokens and carry no
gradient.

Registered names:
  "policy_loss": "ppo" (clipped ratio, DAPO clip-higher, optional dual-clip);
    "gspo" (the same clip on the sequence-level ratio); "cispo" (REINFORCE
    weighted by the clipped ratio, without gradient: no token is dropped).
  "kl_estimator": "k1", "k2", "k3" (Schulman's estimators of KL(pi || ref)
    from samples of pi; k3 is the low-variance, always >= 0 one).
"""

import dataclasses

import jax
import jax.numpy as jnp

from rlhf_jax.rl import registry
from rlhf_jax.rl.aggregation import masked_mean, sequence_sums
from rlhf_jax.rl.logprobs import token_entropy


@dataclasses.dataclass(frozen=True)
class KLConfig:
  """The KL to the reference, stated once for the loss and the ADVANTAGES
  stage: beta, the estimator, and where it goes."""
  coef: float = 0.0        # beta; 0: no KL term anywhere.
  estimator: str = "k3"    # A registered "kl_estimator".
  in_loss: bool = True     # False: beta * KL is a per-token reward penalty.

  @property
  def loss_coef(self) -> float:
    """beta of the loss term (0 when the KL is a reward penalty)."""
    return self.coef if self.in_loss else 0.0

  @property
  def penalty(self) -> float:
    """beta of the reward penalty (0 when the KL is a loss term)."""
    return 0.0 if self.in_loss else self.coef


@registry.register("policy_loss", "ppo")
def ppo_policy_loss(
    logp_BxT: jax.Array,
    old_logp_BxT: jax.Array,
    adv: jax.Array,
    mask_BxT: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    seq_BxT: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """PPO clipped-ratio policy loss, per token.

  ratio = exp(logp - old_logp);
  loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)).
  A clip_high above clip_low (DAPO "clip-higher", e.g. 0.2 / 0.28) lets
  low-probability tokens with A > 0 grow further and keeps entropy up.
  Dual-clip (clip_c > 1): for A < 0 the loss is also capped at -A * clip_c, so
  one token whose ratio exploded cannot dominate the batch.

  Args:
    logp_BxT: [B, T] log-probs under the policy being trained.
    old_logp_BxT: [B, T] log-probs under the policy that sampled (no grad).
    adv: [B, T] per-token advantages, or [B] per-sequence advantages.
    mask_BxT: [B, T] 1 on response tokens.
    clip_low: lower clip range epsilon_low (ratio >= 1 - clip_low).
    clip_high: upper clip range epsilon_high (ratio <= 1 + clip_high).
    clip_c: dual-clip constant (> 1), or None to disable (static).
    seq_BxT: packed rows' sequence of each cell; unused (a per-token loss;
      one signature for all policy losses).

  Returns:
    (loss_BxT, metrics): fp32 per-token loss, 0 on padding; metrics are fp32
    scalars "clip_frac" (either clip active), "clip_frac_low",
    "clip_frac_high", "dual_clip_frac", "approx_kl" (k3 of old vs. new) and
    "ratio_mean".
  """
  del seq_BxT
  if clip_c is not None and clip_c <= 1.0:
    raise ValueError(f"Dual-clip constant clip_c must be > 1, got {clip_c}.")
  adv_BxT = jnp.asarray(adv, jnp.float32)
  if adv_BxT.ndim == 1:
    adv_BxT = adv_BxT[:, None]
  old_logp_BxT = jax.lax.stop_gradient(old_logp_BxT.astype(jnp.float32))
  log_ratio_BxT = logp_BxT.astype(jnp.float32) - old_logp_BxT
  ratio_BxT = jnp.exp(log_ratio_BxT)
  clipped_BxT = jnp.clip(ratio_BxT, 1.0 - clip_low, 1.0 + clip_high)
  pg_BxT = -adv_BxT * ratio_BxT
  pg_clipped_BxT = -adv_BxT * clipped_BxT
  loss_BxT = jnp.maximum(pg_BxT, pg_clipped_BxT)
  # The clipped branch wins exactly when it is the (strictly) larger loss.
  clip_active_BxT = pg_clipped_BxT > pg_BxT
  dual_active_BxT = jnp.zeros_like(clip_active_BxT)
  if clip_c is not None:
    capped_BxT = jnp.minimum(loss_BxT, -adv_BxT * clip_c)
    dual_active_BxT = (adv_BxT < 0) & (capped_BxT < loss_BxT)
    loss_BxT = jnp.where(adv_BxT < 0, capped_BxT, loss_BxT)
  mask_BxT = jnp.asarray(mask_BxT).astype(jnp.float32)
  loss_BxT = jnp.where(mask_BxT > 0, loss_BxT, 0.0)

  def mean(x):
    return masked_mean(jax.lax.stop_gradient(x).astype(jnp.float32), mask_BxT)

  metrics = {
      "clip_frac": mean(clip_active_BxT),
      "clip_frac_low": mean(clip_active_BxT & (ratio_BxT < 1.0)),
      "clip_frac_high": mean(clip_active_BxT & (ratio_BxT > 1.0)),
      "dual_clip_frac": mean(dual_active_BxT),
      "approx_kl": mean(kl_k3(logp_BxT, old_logp_BxT)),
      "ratio_mean": mean(ratio_BxT),
  }
  return loss_BxT, metrics


@registry.register("policy_loss", "gspo")
def gspo_policy_loss(
    logp_BxT: jax.Array,
    old_logp_BxT: jax.Array,
    adv: jax.Array,
    mask_BxT: jax.Array,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    clip_c: float | None = None,
    seq_BxT: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GSPO (Zheng et al. 2025): PPO's clip on a sequence-level ratio.

  s_i = exp(mean over the valid tokens of sequence i of (logp - old_logp)),
  the length-normalised sequence likelihood ratio (a sequence is a row, or
  in packed rows a run of `seq_BxT`); every token of sequence i uses it:
  loss = max(-A * s, -A * clip(s, 1 - clip_low, 1 + clip_high)) (+ dual-clip
  as "ppo"). Written in the GSPO-token form s_i,t = sg(s_i) * pi_t / sg(pi_t)
  so per-token advantages work too; its value is s_i and, for a per-sequence
  A, its gradient with "seq-mean-token-mean" aggregation is exactly GSPO's
  (A * grad s_i per sequence). The paper's clip ranges are ~1e-4 scale
  (defaults 3e-4 / 4e-4), far smaller than PPO's, because s_i is a geometric
  mean and moves little.

  Args:
    logp_BxT: [B, T] log-probs under the policy being trained.
    old_logp_BxT: [B, T] log-probs under the policy that sampled (no grad).
    adv: [B, T] per-token advantages, or [B] per-sequence advantages.
    mask_BxT: [B, T] 1 on response tokens.
    clip_low: lower clip range of the sequence ratio.
    clip_high: upper clip range of the sequence ratio.
    clip_c: dual-clip constant (> 1), or None to disable (static).
    seq_BxT: packed rows only: the sequence of each cell (-1: none);
      `aggregation.sequence_sums`.

  Returns:
    (loss_BxT, metrics) as "ppo"; "clip_frac" counts tokens of clipped
    sequences, "ratio_mean" is the token-weighted mean of s_i, and
    "seq_log_ratio" the token-weighted mean of log s_i.
  """
  mask_f_BxT = jnp.asarray(mask_BxT).astype(jnp.float32)
  logp_BxT = logp_BxT.astype(jnp.float32)
  old_BxT = jax.lax.stop_gradient(old_logp_BxT.astype(jnp.float32))
  sums_S, counts_S, on_tokens = sequence_sums(logp_BxT - old_BxT, mask_f_BxT,
                                              seq_BxT)
  # Each token's sequence's mean log-ratio, without gradient.
  seq_log_ratio_BxT = jax.lax.stop_gradient(
      on_tokens(sums_S / jnp.maximum(counts_S, 1.0)))
  # Value: seq_log_ratio; gradient: d logp_t per token (GSPO-token).
  token_log_ratio_BxT = (seq_log_ratio_BxT + logp_BxT
                         - jax.lax.stop_gradient(logp_BxT))
  loss_BxT, metrics = ppo_policy_loss(
      token_log_ratio_BxT, jnp.zeros_like(token_log_ratio_BxT), adv,
      mask_f_BxT, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c)
  # The ppo metrics' approx_kl is of the sequence ratio; report the tokens'.
  metrics["approx_kl"] = masked_mean(
      jax.lax.stop_gradient(kl_k3(logp_BxT, old_BxT)), mask_f_BxT)
  metrics["seq_log_ratio"] = masked_mean(seq_log_ratio_BxT, mask_f_BxT)
  return loss_BxT, metrics


@registry.register("policy_loss", "cispo")
def cispo_policy_loss(
    logp_BxT: jax.Array,
    old_logp_BxT: jax.Array,
    adv: jax.Array,
    mask_BxT: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    seq_BxT: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped ratio.

  The objective's gradient is sg(clip(r, 1 - clip_low, 1 + clip_high)) *
  A * grad log pi per token, r = pi / pi_old. PPO's clip zeroes the
  gradient of a token whose ratio left the band (often the rare tokens
  that open a reasoning step); CISPO keeps every token's gradient and
  bounds only its weight. Written as loss = -A * sg(clip(r) / r) * r, whose
  value is -A * clip(r) (PPO's clipped term) and whose gradient is the one
  above. MiniMax-M1 clips only from above: clip_low >= 1 turns the lower
  bound off.

  Args:
    logp_BxT: [B, T] log-probs under the policy being trained.
    old_logp_BxT: [B, T] log-probs under the anchor policy (no grad).
    adv: [B, T] per-token advantages, or [B] per-sequence advantages.
    mask_BxT: [B, T] 1 on response tokens.
    clip_low: lower clip range of the weight (weight >= 1 - clip_low).
    clip_high: upper clip range of the weight (weight <= 1 + clip_high).
    clip_c: must be None (CISPO has no dual clip).
    seq_BxT: unused (a per-token loss; one signature for all).

  Returns:
    (loss_BxT, metrics) as "ppo": "clip_frac" (and _low, _high) counts the
    tokens whose weight was clipped; "dual_clip_frac" is 0.
  """
  del seq_BxT  # A per-token loss.
  if clip_c is not None:
    raise ValueError("policy_loss 'cispo' has no dual clip: set rl.clip_c "
                     "= 0")
  adv_BxT = jnp.asarray(adv, jnp.float32)
  if adv_BxT.ndim == 1:
    adv_BxT = adv_BxT[:, None]
  logp_BxT = logp_BxT.astype(jnp.float32)
  old_logp_BxT = jax.lax.stop_gradient(old_logp_BxT.astype(jnp.float32))
  ratio_BxT = jnp.exp(logp_BxT - old_logp_BxT)
  weight_BxT = jax.lax.stop_gradient(
      jnp.clip(ratio_BxT, max(0.0, 1.0 - clip_low), 1.0 + clip_high))
  # ratio / sg(ratio) is 1 in value and d log pi in gradient.
  loss_BxT = -adv_BxT * weight_BxT * (ratio_BxT
                                      / jax.lax.stop_gradient(ratio_BxT))
  mask_BxT = jnp.asarray(mask_BxT).astype(jnp.float32)
  loss_BxT = jnp.where(mask_BxT > 0, loss_BxT, 0.0)
  low = ratio_BxT < 1.0 - clip_low
  high = ratio_BxT > 1.0 + clip_high

  def mean(x):
    return masked_mean(jax.lax.stop_gradient(x).astype(jnp.float32), mask_BxT)

  metrics = {
      "clip_frac": mean(low | high),
      "clip_frac_low": mean(low),
      "clip_frac_high": mean(high),
      "dual_clip_frac": jnp.zeros((), jnp.float32),
      "approx_kl": mean(kl_k3(logp_BxT, old_logp_BxT)),
      "ratio_mean": mean(ratio_BxT),
  }
  return loss_BxT, metrics


@registry.register("kl_estimator", "k1")
def kl_k1(logp_BxT: jax.Array, ref_logp_BxT: jax.Array) -> jax.Array:
  """k1 = log pi - log ref: unbiased, high variance, can be negative.

  Args:
    logp_BxT: [B, T] policy log-probs of the sampled tokens.
    ref_logp_BxT: [B, T] reference log-probs of the same tokens.

  Returns:
    [B, T] fp32 per-token estimate.
  """
  return logp_BxT.astype(jnp.float32) - ref_logp_BxT.astype(jnp.float32)


@registry.register("kl_estimator", "k2")
def kl_k2(logp_BxT: jax.Array, ref_logp_BxT: jax.Array) -> jax.Array:
  """k2 = (log pi - log ref)^2 / 2: biased, low variance, >= 0.

  Args:
    logp_BxT: [B, T] policy log-probs of the sampled tokens.
    ref_logp_BxT: [B, T] reference log-probs of the same tokens.

  Returns:
    [B, T] fp32 per-token estimate.
  """
  return 0.5 * jnp.square(kl_k1(logp_BxT, ref_logp_BxT))


@registry.register("kl_estimator", "k3")
def kl_k3(logp_BxT: jax.Array, ref_logp_BxT: jax.Array) -> jax.Array:
  """k3 = ref/pi - log(ref/pi) - 1: unbiased, low variance, >= 0.

  Args:
    logp_BxT: [B, T] policy log-probs of the sampled tokens.
    ref_logp_BxT: [B, T] reference log-probs of the same tokens.

  Returns:
    [B, T] fp32 per-token estimate.
  """
  log_r_BxT = -kl_k1(logp_BxT, ref_logp_BxT)
  # expm1 keeps precision when ref ~= pi, where k3 is a tiny difference.
  return jnp.expm1(log_r_BxT) - log_r_BxT


def kl_loss(
    logp_BxT: jax.Array,
    ref_logp_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    beta: float,
    estimator: str = "k3",
) -> jax.Array:
  """beta * KL(pi || ref) per token, as a loss term (gradient flows to pi).

  Args:
    logp_BxT: [B, T] policy log-probs.
    ref_logp_BxT: [B, T] reference log-probs (treated as constants).
    mask_BxT: [B, T] 1 on response tokens.
    beta: KL coefficient.
    estimator: registered "kl_estimator" name.

  Returns:
    [B, T] fp32 per-token loss, 0 on padding.
  """
  ref_logp_BxT = jax.lax.stop_gradient(ref_logp_BxT)
  kl_BxT = registry.get("kl_estimator", estimator)(logp_BxT, ref_logp_BxT)
  return jnp.where(jnp.asarray(mask_BxT) > 0, beta * kl_BxT, 0.0)


def kl_reward_penalty(
    rewards: jax.Array,
    logp_BxT: jax.Array,
    ref_logp_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    beta: float,
    estimator: str = "k1",
    sequence_sums=None,
) -> tuple[jax.Array, jax.Array]:
  """Subtracts beta * KL(pi || ref) from rewards (InstructGPT-style penalty).

  Sequence rewards [B] lose beta * sum_t KL_t (k1 summed over a sampled
  response is an unbiased estimate of the sequence KL); per-token rewards
  [B, T] lose beta * KL_t at each valid token. No gradient flows.

  Args:
    rewards: [B] sequence rewards or [B, T] per-token rewards.
    logp_BxT: [B, T] log-probs of the sampling policy.
    ref_logp_BxT: [B, T] reference log-probs.
    mask_BxT: [B, T] 1 on response tokens.
    beta: KL coefficient.
    estimator: registered "kl_estimator" name.
    sequence_sums: [B, T] -> [B] per-sequence sums (default: over axis 1;
      packed rows pass `grouped.sequence_sums`).

  Returns:
    (penalised rewards with the shape of `rewards`, fp32 sequence KL [B]).
  """
  kl_BxT = registry.get("kl_estimator", estimator)(
      jax.lax.stop_gradient(logp_BxT), jax.lax.stop_gradient(ref_logp_BxT)
  )
  kl_BxT = jnp.where(jnp.asarray(mask_BxT) > 0, kl_BxT, 0.0)
  rewards = jnp.asarray(rewards, jnp.float32)
  if sequence_sums is None:
    sequence_sums = lambda x: jnp.sum(x, axis=1)
  kl_B = sequence_sums(kl_BxT)
  penalty = kl_BxT if rewards.ndim == 2 else kl_B
  return rewards - beta * penalty, kl_B


def entropy_metric(
    logits_BxTxV: jax.Array,
    mask_BxT: jax.Array,
    *,
    temperature: float = 1.0,
) -> jax.Array:
  """Mean token entropy over valid tokens; a metric, so no gradient.

  Args:
    logits_BxTxV: [B, T, V] logits at the response positions.
    mask_BxT: [B, T] 1 on response tokens.
    temperature: static sampling temperature.

  Returns:
    fp32 scalar mean entropy in nats.
  """
  logits_BxTxV = jax.lax.stop_gradient(logits_BxTxV)
  ent_BxT = token_entropy(logits_BxTxV, temperature=temperature)
  return masked_mean(ent_BxT, mask_BxT)
