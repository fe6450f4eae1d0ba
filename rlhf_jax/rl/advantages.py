"""Advantage estimators: group-relative (GRPO, Dr.GRPO, RLOO), REINFORCE++.

Dimension letters: N prompts, G samples per prompt (group size), B = N * G
sequences, T response positions.

Layout convention: a flat `rewards_B` is prompt-major, i.e. the G samples of
prompt n are rows n * G ... n * G + G - 1 (the order the rollout emits them).
Every estimator also accepts the grouped form `rewards_NxG` and then returns
advantages of the same shape.

All estimators are registered under category "advantage" with the signature
`fn(rewards, group_size=None, **kwargs) -> advantages` and are pure, jittable
functions (`group_size` is static). Two properties ride on the
registration, read by the config checks (`registry.has`):
  group:       a baseline from the other samples of the prompt, so it needs
               G >= 2 samples per prompt;
  group_local: a group's advantages depend on that group's rewards only, so
               a streamed part of whole groups gets the advantages the whole
               batch would give it (`rl.stream`).
"""

import jax
import jax.numpy as jnp

from rlhf_jax.rl import registry
from rlhf_jax.rl.critic import discounted_returns
from rlhf_jax.rl.critic import last_token_rewards
from rlhf_jax.rl.critic import masked_whiten


def _as_groups(rewards: jax.Array, group_size: int | None) -> jax.Array:
  """Reshapes flat [B] rewards to [N, G]; passes [N, G] through (fp32)."""
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.ndim == 2:
    if group_size is not None and group_size != rewards.shape[1]:
      raise ValueError(
          f"group_size={group_size} disagrees with rewards shape "
          f"{rewards.shape} (expected [N, G])."
      )
    return rewards
  if rewards.ndim != 1 or group_size is None:
    raise ValueError(
        "Expected rewards [N, G], or flat rewards [B] with group_size; got "
        f"shape {rewards.shape} and group_size={group_size}."
    )
  if group_size < 1 or rewards.shape[0] % group_size:
    raise ValueError(
        f"Flat rewards of length {rewards.shape[0]} do not split into groups "
        f"of {group_size}."
    )
  return rewards.reshape(-1, group_size)


@registry.register("advantage", "grpo", group=True, group_local=True)
def grpo_advantages(
    rewards: jax.Array,
    group_size: int | None = None,
    *,
    eps: float = 1e-6,
    ddof: int = 1,
) -> jax.Array:
  """GRPO: (r - group mean) / (group std + eps).

  The std is the sample std (ddof=1, as torch.std in TRL/DeepSeekMath), so a
  group needs G >= 2; a group whose rewards are all equal gets advantage 0.

  Args:
    rewards: [B] prompt-major flat rewards, or [N, G].
    group_size: G; required for flat rewards.
    eps: added to the std (not the variance) to bound 1 / std.
    ddof: degrees of freedom of the std (1 = sample std, 0 = population).

  Returns:
    Per-sequence advantages, fp32, same shape as `rewards`.
  """
  r_NxG = _as_groups(rewards, group_size)
  mean_Nx1 = r_NxG.mean(axis=1, keepdims=True)
  std_Nx1 = r_NxG.std(axis=1, ddof=ddof, keepdims=True)
  return ((r_NxG - mean_Nx1) / (std_Nx1 + eps)).reshape(jnp.shape(rewards))


@registry.register("advantage", "drgrpo", group=True, group_local=True)
def drgrpo_advantages(
    rewards: jax.Array, group_size: int | None = None
) -> jax.Array:
  """Dr.GRPO: r - group mean, without the std division.

  Dropping the std removes GRPO's bias towards prompts whose groups have low
  reward variance (very easy or very hard prompts). Pair it with the
  "seq-mean-token-sum-norm" aggregation to also drop the length bias.

  Args:
    rewards: [B] prompt-major flat rewards, or [N, G].
    group_size: G; required for flat rewards.

  Returns:
    Per-sequence advantages, fp32, same shape as `rewards`.
  """
  r_NxG = _as_groups(rewards, group_size)
  adv_NxG = r_NxG - r_NxG.mean(axis=1, keepdims=True)
  return adv_NxG.reshape(jnp.shape(rewards))


@registry.register("advantage", "rloo", group=True, group_local=True)
def rloo_advantages(
    rewards: jax.Array, group_size: int | None = None
) -> jax.Array:
  """RLOO: r_i - mean of the other G - 1 rewards of the group.

  The leave-one-out baseline does not depend on r_i, so the policy gradient
  stays unbiased; it equals G / (G - 1) * (r_i - group mean). Needs G >= 2.

  Args:
    rewards: [B] prompt-major flat rewards, or [N, G].
    group_size: G; required for flat rewards.

  Returns:
    Per-sequence advantages, fp32, same shape as `rewards`.
  """
  r_NxG = _as_groups(rewards, group_size)
  g = r_NxG.shape[1]
  baseline_NxG = (r_NxG.sum(axis=1, keepdims=True) - r_NxG) / (g - 1)
  return (r_NxG - baseline_NxG).reshape(jnp.shape(rewards))


def _reinforce_pp(
    r_B: jax.Array,
    mask_BxT: jax.Array | None,
    token_rewards_BxT: jax.Array | None,
    gamma: float,
    eps: float,
) -> jax.Array:
  """Shared body of the REINFORCE++ pair: returns then batch whitening."""
  if mask_BxT is None:
    if token_rewards_BxT is not None:
      raise ValueError("token_rewards_BxT needs mask_BxT.")
    return masked_whiten(r_B, jnp.ones_like(r_B), eps=eps)
  r_BxT = last_token_rewards(r_B, mask_BxT)
  if token_rewards_BxT is not None:
    r_BxT = r_BxT + jnp.asarray(token_rewards_BxT, jnp.float32)
  returns_BxT = discounted_returns(r_BxT, mask_BxT, gamma=gamma)
  return masked_whiten(returns_BxT, mask_BxT, eps=eps)


@registry.register("advantage", "reinforce_pp")
def reinforce_pp_advantages(
    rewards: jax.Array,
    group_size: int | None = None,
    *,
    mask_BxT: jax.Array | None = None,
    token_rewards_BxT: jax.Array | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> jax.Array:
  """REINFORCE++ (Hu 2025): discounted return, no baseline, batch-whitened.

  Token form (`mask_BxT` given, as OpenRLHF): the sequence reward sits at the
  last valid token, `token_rewards_BxT` (e.g. -beta * KL_t) is added, the
  discounted return G_t is taken per token and whitened over all valid
  tokens of the batch. Sequence form (no mask): the rewards themselves are
  whitened over the batch, so it plugs into the GRPO trainer unchanged; the
  two agree when gamma = 1, there are no token rewards and all responses
  have the same length.

  Args:
    rewards: [B] sequence rewards, or [N, G] (grouping is ignored).
    group_size: unused (the estimator is not group-relative); accepted so
      every "advantage" entry shares one signature.
    mask_BxT: [B, T] 1 on response tokens, for the token form.
    token_rewards_BxT: optional [B, T] extra per-token rewards.
    gamma: discount of the token form.
    eps: added to the variance when whitening.

  Returns:
    Token form: [B, T] fp32, 0 off the mask. Sequence form: fp32 with the
    shape of `rewards`.
  """
  del group_size
  r = jnp.asarray(rewards, jnp.float32)
  adv = _reinforce_pp(r.reshape(-1), mask_BxT, token_rewards_BxT, gamma, eps)
  return adv if mask_BxT is not None else adv.reshape(r.shape)


@registry.register("advantage", "reinforce_pp_baseline", group=True)
def reinforce_pp_baseline_advantages(
    rewards: jax.Array,
    group_size: int | None = None,
    *,
    mask_BxT: jax.Array | None = None,
    token_rewards_BxT: jax.Array | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> jax.Array:
  """REINFORCE++-baseline: r - group mean, then REINFORCE++ (batch whitening).

  Subtracting the group mean removes the prompt's difficulty (as Dr.GRPO);
  the batch-level (not group-level) whitening keeps GRPO's per-group std
  division out, which is REINFORCE++'s point. Forms as `reinforce_pp`.

  Args:
    rewards: [B] prompt-major flat rewards, or [N, G].
    group_size: G; required for flat rewards.
    mask_BxT: [B, T] 1 on response tokens, for the token form.
    token_rewards_BxT: optional [B, T] extra per-token rewards (added after
      the baseline, so they are not centred).
    gamma: discount of the token form.
    eps: added to the variance when whitening.

  Returns:
    Token form: [B, T] fp32, 0 off the mask. Sequence form: fp32 with the
    shape of `rewards`.
  """
  r_NxG = _as_groups(rewards, group_size)
  centred_B = (r_NxG - r_NxG.mean(axis=1, keepdims=True)).reshape(-1)
  adv = _reinforce_pp(centred_B, mask_BxT, token_rewards_BxT, gamma, eps)
  return adv if mask_BxT is not None else adv.reshape(jnp.shape(rewards))


def token_advantages(adv_B: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """Broadcasts per-sequence advantages to response tokens.

  Args:
    adv_B: [B] per-sequence advantages.
    mask_BxT: [B, T] 1 on response tokens, 0 on padding (bool or number).

  Returns:
    [B, T] fp32 advantages, 0 where the mask is 0.
  """
  mask_BxT = jnp.asarray(mask_BxT).astype(jnp.float32)
  return jnp.asarray(adv_B, jnp.float32)[:, None] * mask_BxT
