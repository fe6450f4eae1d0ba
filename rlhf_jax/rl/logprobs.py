"""Per-token log-probabilities and entropies from logits.

Dimension letters: B sequences, T positions, V vocabulary.

Both functions work in fp32 whatever the logits dtype (bf16 log-softmax loses
about 3 significant digits, which is the size of the policy ratios PPO clips
at), and neither builds a one-hot [B, T, V] or a stored log-softmax [B, T, V]:
log p(y) = logits[y] - logsumexp(logits), where the gather reads one logit per
token and the logsumexp is a single reduction that XLA fuses with the fp32
cast. The only V-sized tensor left is the softmax in the backward pass.
"""

import jax
import jax.numpy as jnp

from rlhf_jax.rl.aggregation import masked_mean


def _scaled_fp32(logits_BxTxV: jax.Array, temperature: float) -> jax.Array:
  """fp32 logits divided by the sampling temperature."""
  logits_BxTxV = logits_BxTxV.astype(jnp.float32)
  if temperature != 1.0:
    logits_BxTxV = logits_BxTxV / temperature
  return logits_BxTxV


def token_logprobs(
    logits_BxTxV: jax.Array,
    targets_BxT: jax.Array,
    *,
    temperature: float = 1.0,
) -> jax.Array:
  """Gathers log p(targets) under softmax(logits / temperature).

  Pass the sampler's temperature so the trainer's log-probs are of the same
  distribution the rollout sampled from (they are compared in the PPO ratio).

  Args:
    logits_BxTxV: [B, T, V] logits; position t predicts targets_BxT[:, t].
    targets_BxT: [B, T] integer token ids in [0, V).
    temperature: static sampling temperature (> 0).

  Returns:
    [B, T] fp32 log-probabilities (<= 0).
  """
  logits_BxTxV = _scaled_fp32(logits_BxTxV, temperature)
  lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
  target_BxTx1 = targets_BxT.astype(jnp.int32)[..., None]
  picked_BxT = jnp.take_along_axis(logits_BxTxV, target_BxTx1, axis=-1)[..., 0]
  return picked_BxT - lse_BxT


def token_entropy(
    logits_BxTxV: jax.Array, *, temperature: float = 1.0
) -> jax.Array:
  """Entropy of softmax(logits / temperature) at every position.

  Uses H = logsumexp(z) - sum_v p_v z_v, which needs no log(p) and therefore
  no log(0) for tokens whose probability underflows; logits of -inf (masked
  vocabulary entries) contribute 0 instead of 0 * -inf = nan.

  Args:
    logits_BxTxV: [B, T, V] logits.
    temperature: static sampling temperature (> 0).

  Returns:
    [B, T] fp32 entropies in nats, in [0, log V].
  """
  logits_BxTxV = _scaled_fp32(logits_BxTxV, temperature)
  lse_BxTx1 = jax.nn.logsumexp(logits_BxTxV, axis=-1, keepdims=True)
  p_BxTxV = jnp.exp(logits_BxTxV - lse_BxTx1)
  z_BxTxV = jnp.where(p_BxTxV > 0, logits_BxTxV, 0.0)
  return lse_BxTx1[..., 0] - jnp.sum(p_BxTxV * z_BxTxV, axis=-1)


@jax.jit
def logprob_gap(logp_BxT: jax.Array, sampler_logp_BxT: jax.Array,
                mask_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(max, mean) over valid tokens of |learner - sampler| log-probs.

  The stale-weights alarm: the engine and the learner score the same tokens
  with the same weights, so anything above fp32 noise means they differ.
  """
  gap_BxT = jnp.abs(logp_BxT - sampler_logp_BxT) * mask_BxT
  return jnp.max(gap_BxT), masked_mean(gap_BxT, mask_BxT)
