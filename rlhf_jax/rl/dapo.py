"""DAPO's data-side pieces: dynamic sampling and overlong reward shaping.

Dimension letters: C candidate groups (prompts) in the pool, N groups the
train batch holds, G samples per group, B sequences.

Dynamic sampling (Yu et al. 2025, DAPO section 3.2) drops groups whose G
rewards are all equal: their group-relative advantages are 0, so they only
dilute the batch. To keep the train step's shapes static, selection returns
a fixed number N of group indices into a candidate pool plus a validity
mask, never a shorter batch. The trainer refills from the prompt stream:

  pool_CxG = rewards of one round of C prompts
  for _ in range(max_rounds):
    idx_N, valid_N = select_groups(pool_CxG, N)
    if valid_N.all():
      break
    pool_CxG = np.concatenate([pool_CxG, rewards of the next C prompts])
  batch = gather the N groups idx_N; loss_mask *= valid_N per group

Slots that stay invalid after `max_rounds` repeat an informative group (or
group 0 if there is none), so the gather is always in range, and their
`valid` is False so the trainer zeroes their loss mask; a zero-variance group
is never selected as valid. This is host-side numpy (it decides what to
generate next, so it runs between rollout and train anyway).

Overlong reward shaping (DAPO section 3.4) is a soft length penalty, pure
jnp so it can run beside the reward function or on device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def informative_groups(rewards_CxG: np.ndarray, *, atol: float = 0.0
                       ) -> np.ndarray:
  """True for groups whose rewards are not all equal (max - min > atol).

  Args:
    rewards_CxG: [C, G] rewards of C groups of G samples.
    atol: spread at or below which a group counts as constant.

  Returns:
    [C] bool.
  """
  r_CxG = np.asarray(rewards_CxG, np.float64)
  if r_CxG.ndim != 2:
    raise ValueError(f"Expected rewards [C, G], got shape {r_CxG.shape}.")
  return (r_CxG.max(axis=1) - r_CxG.min(axis=1)) > atol


def select_groups(
    rewards_CxG: np.ndarray, num_groups: int, *, atol: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
  """The first `num_groups` informative groups of a candidate pool.

  Pool order is kept (earlier prompts first), so a stream consumed round by
  round trains on prompts in the order they came.

  Args:
    rewards_CxG: [C, G] rewards of the candidate pool, C may be < N.
    num_groups: N, the static number of groups of the train batch.
    atol: see `informative_groups`.

  Returns:
    (idx_N int32 indices into the pool, valid_N bool). Valid slots come
    first and point at distinct informative groups; invalid slots (pool too
    small) point at a valid slot's group, or 0 if none, and must be masked.
  """
  if num_groups < 1:
    raise ValueError(f"num_groups must be >= 1, got {num_groups}.")
  keep_C = informative_groups(rewards_CxG, atol=atol)
  chosen = np.flatnonzero(keep_C)[:num_groups]
  k = len(chosen)
  idx_N = np.zeros((num_groups,), np.int32)
  idx_N[:k] = chosen
  if k:
    idx_N[k:] = chosen[np.arange(num_groups - k) % k]
  valid_N = np.arange(num_groups) < k
  return idx_N, valid_N


def group_rows(idx_N: np.ndarray, valid_N: np.ndarray, group_size: int
               ) -> tuple[np.ndarray, np.ndarray]:
  """Group selection -> row selection of a prompt-major flat batch.

  Args:
    idx_N: [N] selected group indices (from `select_groups`).
    valid_N: [N] their validity.
    group_size: G.

  Returns:
    (rows_B int32 row indices with B = N * G, valid_B bool), prompt-major.
  """
  g = np.arange(group_size)
  rows_B = (np.asarray(idx_N)[:, None] * group_size + g[None, :]).reshape(-1)
  valid_B = np.repeat(np.asarray(valid_N, bool), group_size)
  return rows_B.astype(np.int32), valid_B


def overlong_penalty(
    response_len_B: jax.Array,
    *,
    max_len: int,
    cache_len: int,
    penalty: float = 1.0,
) -> jax.Array:
  """DAPO soft overlong punishment, added to the task reward.

  With expected length L_exp = max_len - cache_len:
    0                                     if |y| <= L_exp,
    (L_exp - |y|) / cache_len * penalty   if L_exp < |y| <= max_len,
    -penalty                              if |y| > max_len.
  The linear ramp gives a graded signal before the hard truncation point.

  Args:
    response_len_B: [B] response lengths in tokens.
    max_len: L_max, the generation limit.
    cache_len: L_cache, the width of the ramp (0 < cache_len <= max_len).
    penalty: magnitude at the end of the ramp (DAPO uses 1).

  Returns:
    [B] fp32 penalties in [-penalty, 0].
  """
  if not 0 < cache_len <= max_len:
    raise ValueError(f"Need 0 < cache_len <= max_len, got cache_len="
                     f"{cache_len}, max_len={max_len}.")
  n_B = jnp.asarray(response_len_B, jnp.float32)
  expected = float(max_len - cache_len)
  ramp_B = (expected - n_B) / cache_len
  out_B = jnp.where(n_B <= expected, 0.0,
                    jnp.where(n_B <= max_len, ramp_B, -1.0))
  return out_B * penalty
