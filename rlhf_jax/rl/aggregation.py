"""Loss aggregation modes: per-token losses [B, T] -> one scalar.

Dimension letters: B sequences, T response positions.

Modes (registered under category "aggregation"):
  "token-mean": sum of all valid token losses / number of valid tokens. Every
    token weighs the same, so long responses weigh more (DAPO).
  "seq-mean-token-mean": mean over tokens within a sequence, then mean over
    the sequences that have at least one valid token (original GRPO). Tokens
    of long responses weigh less.
  "seq-mean-token-sum-norm": sum over tokens divided by the constant `max_len`,
    then mean over the B rows (Dr.GRPO). Both divisors are constants, so a
    token's gradient does not depend on its own or anyone's length.

Each mode is a pair (numerator, weight) with aggregate = numerator / weight.
Summing numerators and weights over micro-batches and dividing once gives
exactly the full-batch value, which is what gradient accumulation needs
(averaging per-micro-batch means would not, for the two "mean" modes).
"""

import jax
import jax.numpy as jnp

from rlhf_jax.rl import registry


def _fp32_mask(mask_BxT: jax.Array) -> jax.Array:
  """Bool or numeric mask as fp32 0/1 weights."""
  return jnp.asarray(mask_BxT).astype(jnp.float32)


def _masked_loss(loss_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """loss * mask, with padding forced to 0 even where the loss is nan/inf."""
  return jnp.where(mask_BxT > 0, loss_BxT.astype(jnp.float32), 0.0) * mask_BxT


def masked_mean(
    x: jax.Array, mask: jax.Array, axis: int | None = None
) -> jax.Array:
  """Mean of x over entries where mask != 0 (0 when there are none).

  Args:
    x: values, same shape as mask.
    mask: 1/0 or bool weights.
    axis: reduction axis; None reduces everything.

  Returns:
    fp32 masked mean, reduced over `axis`.
  """
  mask = _fp32_mask(mask)
  total = jnp.sum(_masked_loss(x, mask), axis=axis)
  return total / jnp.maximum(jnp.sum(mask, axis=axis), 1.0)


@registry.register("aggregation", "token-mean")
def token_mean_terms(
    loss_BxT: jax.Array, mask_BxT: jax.Array, *, max_len: int | None = None
) -> tuple[jax.Array, jax.Array]:
  """Terms of "token-mean": (sum of valid losses, number of valid tokens).

  Args:
    loss_BxT: [B, T] per-token losses.
    mask_BxT: [B, T] 1 on valid tokens.
    max_len: unused; accepted so all modes share one signature.

  Returns:
    (numerator, weight), fp32 scalars.
  """
  del max_len
  mask_BxT = _fp32_mask(mask_BxT)
  return jnp.sum(_masked_loss(loss_BxT, mask_BxT)), jnp.sum(mask_BxT)


@registry.register("aggregation", "seq-mean-token-mean")
def seq_mean_token_mean_terms(
    loss_BxT: jax.Array, mask_BxT: jax.Array, *, max_len: int | None = None
) -> tuple[jax.Array, jax.Array]:
  """Terms of "seq-mean-token-mean": (sum of sequence means, #sequences).

  Rows without any valid token (batch padding) count in neither term.

  Args:
    loss_BxT: [B, T] per-token losses.
    mask_BxT: [B, T] 1 on valid tokens.
    max_len: unused; accepted so all modes share one signature.

  Returns:
    (numerator, weight), fp32 scalars.
  """
  del max_len
  mask_BxT = _fp32_mask(mask_BxT)
  len_B = jnp.sum(mask_BxT, axis=1)
  seq_mean_B = jnp.sum(_masked_loss(loss_BxT, mask_BxT), axis=1) / (
      jnp.maximum(len_B, 1.0)
  )
  return jnp.sum(seq_mean_B), jnp.sum((len_B > 0).astype(jnp.float32))


@registry.register("aggregation", "seq-mean-token-sum-norm")
def seq_mean_token_sum_norm_terms(
    loss_BxT: jax.Array, mask_BxT: jax.Array, *, max_len: int | None = None
) -> tuple[jax.Array, jax.Array]:
  """Terms of "seq-mean-token-sum-norm": (sum / max_len, B).

  Args:
    loss_BxT: [B, T] per-token losses.
    mask_BxT: [B, T] 1 on valid tokens.
    max_len: the constant length normaliser, normally the maximum response
      length of the run; defaults to T.

  Returns:
    (numerator, weight), fp32 scalars.
  """
  mask_BxT = _fp32_mask(mask_BxT)
  norm = float(loss_BxT.shape[1] if max_len is None else max_len)
  total = jnp.sum(_masked_loss(loss_BxT, mask_BxT)) / norm
  return total, jnp.asarray(loss_BxT.shape[0], jnp.float32)


def aggregate_terms(
    loss_BxT: jax.Array,
    mask_BxT: jax.Array,
    mode: str,
    *,
    max_len: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(numerator, weight) of `mode`; sum these over micro-batches.

  Args:
    loss_BxT: [B, T] per-token losses.
    mask_BxT: [B, T] 1 on valid tokens, 0 on prompt/padding.
    mode: a registered aggregation name, e.g. "token-mean".
    max_len: constant normaliser of "seq-mean-token-sum-norm".

  Returns:
    (numerator, weight), fp32 scalars.
  """
  return registry.get("aggregation", mode)(loss_BxT, mask_BxT, max_len=max_len)


def aggregate_loss(
    loss_BxT: jax.Array,
    mask_BxT: jax.Array,
    mode: str,
    *,
    max_len: int | None = None,
) -> jax.Array:
  """Aggregates per-token losses to a scalar according to `mode`.

  Args:
    loss_BxT: [B, T] per-token losses.
    mask_BxT: [B, T] 1 on valid tokens, 0 on prompt/padding.
    mode: a registered aggregation name, e.g. "token-mean".
    max_len: constant normaliser of "seq-mean-token-sum-norm".

  Returns:
    fp32 scalar loss (0 when there is nothing to aggregate).
  """
  num, weight = aggregate_terms(loss_BxT, mask_BxT, mode, max_len=max_len)
  return num / jnp.maximum(weight, 1.0)
