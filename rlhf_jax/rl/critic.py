"""Critic-side math for PPO: returns, GAE, whitening and the value loss.

Dimension letters: B sequences, T positions.

Masks are [B, T] with 1 on response tokens. The valid tokens of a
sequence are assumed contiguous (the response span of a right-padded
sequence, possibly after prompt positions that are masked out): the
position after the last valid token is terminal, so nothing is bootstrapped
from padding. A hole in the middle of a response would also be treated as
an episode end. Packed rows (`rl/packing.py`) hold several sequences per
row: `seq_BxT` (the sequence of each token, -1 off them) tells GAE and
`ppo_targets` where one ends and the next begins.

All functions are pure jnp, jittable, fp32 and carry no model imports.
`ppo_targets` chains them into what one PPO step trains on.
"""

import jax
import jax.numpy as jnp

from rlhf_jax.rl.aggregation import masked_mean
from rlhf_jax.rl.losses import kl_reward_penalty


def _f32(x: jax.Array) -> jax.Array:
  """fp32 copy of an array, bool or number."""
  return jnp.asarray(x).astype(jnp.float32)


def masked_whiten(
    x: jax.Array,
    mask: jax.Array,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> jax.Array:
  """(x - mean) / sqrt(var + eps) over the entries where mask != 0.

  The variance is the population one (ddof=0), as OpenRLHF's
  `masked_whiten`. Entries where the mask is 0 come out as 0.

  Args:
    x: values, any shape (e.g. [B, T] advantages or [B] rewards).
    mask: 1/0 or bool weights, same shape as x.
    shift_mean: False keeps the mean (only rescales), as TRL does for rewards.
    eps: added to the variance.

  Returns:
    fp32 whitened x, 0 where the mask is 0.
  """
  mask = _f32(mask)
  x = _f32(x)
  mean = masked_mean(x, mask)
  var = masked_mean(jnp.square(x - mean), mask)
  out = (x - mean) * jax.lax.rsqrt(var + eps)
  if not shift_mean:
    out = out + mean
  return jnp.where(mask > 0, out, 0.0)


def continues(mask_BxT: jax.Array, seq_BxT: jax.Array | None = None
              ) -> jax.Array:
  """[B, T] fp32: 1 where the next token is a valid token of the same
  sequence (`seq_BxT` of packed rows; None: one sequence per row)."""
  next_m_BxT = jnp.pad(_f32(mask_BxT)[:, 1:], ((0, 0), (0, 1)))
  if seq_BxT is None:
    return next_m_BxT
  same_BxT = jnp.pad(seq_BxT[:, 1:] == seq_BxT[:, :-1], ((0, 0), (0, 1)))
  return next_m_BxT * same_BxT


def discounted_returns(
    rewards_BxT: jax.Array, mask_BxT: jax.Array, *, gamma: float = 1.0
) -> jax.Array:
  """G_t = r_t + gamma * G_{t+1}, reset after the last valid token.

  Args:
    rewards_BxT: [B, T] per-token rewards.
    mask_BxT: [B, T] 1 on response tokens (contiguous per row).
    gamma: discount.

  Returns:
    [B, T] fp32 returns, 0 where the mask is 0.
  """
  r_BxT = _f32(rewards_BxT)
  m_BxT = _f32(mask_BxT)
  next_m_BxT = continues(mask_BxT)

  def body(g_next_B, xs):
    r_B, m_B, next_m_B = xs
    g_B = r_B + gamma * next_m_B * g_next_B
    return g_B, g_B * m_B

  _, g_TxB = jax.lax.scan(
      body, jnp.zeros(r_BxT.shape[:1], jnp.float32),
      (r_BxT.T, m_BxT.T, next_m_BxT.T), reverse=True)
  return g_TxB.T


def gae(
    rewards_BxT: jax.Array,
    values_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    seq_BxT: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation (Schulman et al. 2016).

  delta_t = r_t + gamma * V_{t+1} - V_t, with V after the last valid token 0;
  A_t = delta_t + gamma * lam * A_{t+1}; returns R_t = A_t + V_t (the critic
  target). No gradient flows (the inputs are rollout constants).

  Args:
    rewards_BxT: [B, T] per-token rewards (e.g. -beta * KL_t, plus the
      reward-model score at the last valid token).
    values_BxT: [B, T] critic values V(s_t) of the sampling-time critic.
    mask_BxT: [B, T] 1 on response tokens (contiguous per sequence).
    gamma: discount.
    lam: GAE lambda (1 = Monte-Carlo return - V, 0 = one-step TD).
    seq_BxT: packed rows' sequence ids (None: one sequence per row).

  Returns:
    (advantages_BxT, returns_BxT), fp32, 0 where the mask is 0.
  """
  r_BxT = jax.lax.stop_gradient(_f32(rewards_BxT))
  v_BxT = jax.lax.stop_gradient(_f32(values_BxT))
  m_BxT = _f32(mask_BxT)
  next_m_BxT = continues(mask_BxT, seq_BxT)
  next_v_BxT = jnp.pad(v_BxT[:, 1:], ((0, 0), (0, 1))) * next_m_BxT
  delta_BxT = r_BxT + gamma * next_v_BxT - v_BxT

  def body(a_next_B, xs):
    d_B, next_m_B = xs
    a_B = d_B + gamma * lam * next_m_B * a_next_B
    return a_B, a_B

  _, a_TxB = jax.lax.scan(
      body, jnp.zeros(r_BxT.shape[:1], jnp.float32),
      (delta_BxT.T, next_m_BxT.T), reverse=True)
  adv_BxT = a_TxB.T * m_BxT
  return adv_BxT, (adv_BxT + v_BxT) * m_BxT


def value_loss(
    values_BxT: jax.Array,
    old_values_BxT: jax.Array,
    returns_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    clip_range: float | None = 0.2,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """PPO clipped value loss, per token.

  v_clip = old_v + clip(v - old_v, -c, c);
  loss = 0.5 * max((v - R)^2, (v_clip - R)^2). The max makes the clip
  pessimistic: a value that moved more than c from the sampling-time critic
  gets no gradient when moving further would look better.

  Args:
    values_BxT: [B, T] values of the critic being trained.
    old_values_BxT: [B, T] values of the sampling-time critic (no grad).
    returns_BxT: [B, T] targets, e.g. GAE returns (no grad).
    mask_BxT: [B, T] 1 on response tokens.
    clip_range: c, or None for the plain squared error (static).

  Returns:
    (loss_BxT, metrics): fp32 per-token loss, 0 on padding; metrics are fp32
    scalars "vf_clip_frac" (clipped branch strictly larger) and
    "value_error" (masked mean of (v - R)^2).
  """
  v_BxT = _f32(values_BxT)
  old_BxT = jax.lax.stop_gradient(_f32(old_values_BxT))
  ret_BxT = jax.lax.stop_gradient(_f32(returns_BxT))
  mask_BxT = _f32(mask_BxT)
  err_BxT = jnp.square(v_BxT - ret_BxT)
  if clip_range is None:
    loss_BxT, clipped_BxT = 0.5 * err_BxT, jnp.zeros_like(err_BxT, bool)
  else:
    v_clip_BxT = old_BxT + jnp.clip(v_BxT - old_BxT, -clip_range, clip_range)
    err_clip_BxT = jnp.square(v_clip_BxT - ret_BxT)
    loss_BxT = 0.5 * jnp.maximum(err_BxT, err_clip_BxT)
    clipped_BxT = err_clip_BxT > err_BxT
  loss_BxT = jnp.where(mask_BxT > 0, loss_BxT, 0.0)
  metrics = {
      "vf_clip_frac": masked_mean(_f32(clipped_BxT), mask_BxT),
      "value_error": masked_mean(jax.lax.stop_gradient(err_BxT), mask_BxT),
  }
  return loss_BxT, metrics


def last_token_rewards(
    scores_B: jax.Array, mask_BxT: jax.Array,
    seq_BxT: jax.Array | None = None,
) -> jax.Array:
  """Places a per-sequence score at the last valid token of each sequence.

  Args:
    scores_B: [B] sequence scores (e.g. reward-model outputs).
    mask_BxT: [B, T] 1 on response tokens (contiguous per sequence).
    seq_BxT: packed rows' sequence ids (None: row b is sequence b).

  Returns:
    [B, T] fp32 per-token rewards; sequences without valid tokens get none.
  """
  m_BxT = _f32(mask_BxT)
  is_last_BxT = (m_BxT > 0) & (continues(mask_BxT, seq_BxT) == 0)
  if seq_BxT is None:
    score_BxT = _f32(scores_B)[:, None]
  else:
    score_BxT = _f32(scores_B)[jnp.maximum(seq_BxT, 0)]
  return jnp.where(is_last_BxT, score_BxT, 0.0)


def ppo_targets(
    scores_B: jax.Array,
    logp_BxT: jax.Array,
    ref_logp_BxT: jax.Array,
    values_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    kl_coef: float,
    kl_estimator: str = "k1",
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
    seq_BxT: jax.Array | None = None,
    sequence_sums=None,
) -> dict[str, jax.Array]:
  """InstructGPT-style PPO targets from one rollout.

  r_t = score * [t is the last response token] - kl_coef * KL_t (KL of the
  sampling policy to the reference, per token; kl_coef 0 when the KL is a
  loss term instead); GAE on r with the sampling-time critic values; the
  advantages are whitened over valid tokens (the returns are not).

  Args:
    scores_B: [B] reward-model scores of the sampled sequences.
    logp_BxT: [B, T] log-probs of the sampling policy.
    ref_logp_BxT: [B, T] reference log-probs.
    values_BxT: [B, T] critic values at sampling time.
    mask_BxT: [B, T] 1 on response tokens (contiguous per row).
    kl_coef: beta of the KL reward penalty.
    kl_estimator: registered "kl_estimator" name.
    gamma: discount.
    lam: GAE lambda.
    whiten: whiten the advantages.
    seq_BxT: packed rows' sequence ids (None: row b is sequence b); then
      `sequence_sums` ([B, T] -> [B], `grouped.sequence_sums`) too.

  Returns:
    {"advantages", "returns", "token_rewards"} [B, T] and "kl" [B] (the
    sequence KL estimate), fp32.
  """
  rewards_BxT = last_token_rewards(scores_B, mask_BxT, seq_BxT)
  rewards_BxT, kl_B = kl_reward_penalty(rewards_BxT, logp_BxT, ref_logp_BxT,
                                        mask_BxT, beta=kl_coef,
                                        estimator=kl_estimator,
                                        sequence_sums=sequence_sums)
  adv_BxT, ret_BxT = gae(rewards_BxT, values_BxT, mask_BxT, gamma=gamma,
                         lam=lam, seq_BxT=seq_BxT)
  if whiten:
    adv_BxT = masked_whiten(adv_BxT, mask_BxT)
  return {"advantages": adv_BxT, "returns": ret_BxT,
          "token_rewards": rewards_BxT, "kl": kl_B}
