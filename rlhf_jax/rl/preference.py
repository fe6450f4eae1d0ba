"""Preference (reward-model) losses: Bradley-Terry with an optional margin.

Dimension letters: P preference pairs.

P(chosen > rejected) = sigmoid(s_c - s_r - m) under the Bradley-Terry model;
the loss is its negative log-likelihood. The margin m >= 0 (Llama 2's
graded preferences) asks for a score gap of at least m before a pair stops
pulling. Pure jnp, no model imports.
"""

import jax
import jax.numpy as jnp


def bradley_terry_loss(
    chosen_P: jax.Array,
    rejected_P: jax.Array,
    margin_P: jax.Array | None = None,
) -> jax.Array:
  """-log sigmoid(s_chosen - s_rejected - margin), per pair.

  Args:
    chosen_P: [P] scores of the preferred responses.
    rejected_P: [P] scores of the other responses.
    margin_P: optional [P] margins (0 = plain Bradley-Terry).

  Returns:
    [P] fp32 losses (log 2 when the scores tie and the margin is 0).
  """
  diff_P = chosen_P.astype(jnp.float32) - rejected_P.astype(jnp.float32)
  if margin_P is not None:
    diff_P = diff_P - jnp.asarray(margin_P, jnp.float32)
  return -jax.nn.log_sigmoid(diff_P)


def pair_accuracy(chosen_P: jax.Array, rejected_P: jax.Array) -> jax.Array:
  """[P] fp32 1 where the chosen response scores strictly higher."""
  return (chosen_P > rejected_P).astype(jnp.float32)
