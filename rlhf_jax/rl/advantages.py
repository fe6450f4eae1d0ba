"""Group-relative advantage estimators (GRPO, Dr.GRPO, RLOO).

Dimension letters: N prompts, G samples per prompt (group size), B = N * G
sequences, T response positions.

Layout convention: a flat `rewards_B` is prompt-major, i.e. the G samples of
prompt n are rows n * G ... n * G + G - 1 (the order the rollout emits them).
Every estimator also accepts the grouped form `rewards_NxG` and then returns
advantages of the same shape.

All estimators are registered under category "advantage" with the signature
`fn(rewards, group_size=None, **kwargs) -> advantages` and are pure, jittable
functions (`group_size` is static).
"""

import jax
import jax.numpy as jnp

from rlhf_jax.rl import registry


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


@registry.register("advantage", "grpo")
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


@registry.register("advantage", "drgrpo")
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


@registry.register("advantage", "rloo")
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
