"""The sampler's log-probs against the trainer's: importance weights and the
mismatch between them.

Every sample carries the per-token log-probs of the engine that drew it
(the behaviour policy mu). The trainer recomputes them with its current
weights before the update (the proximal policy pi_prox, the anchor of the
PPO ratio). The two differ when the sample is stale (async RL: drawn by
older weights) and when the engines differ (bf16 or int8 rollout weights,
other kernels). Two things follow.

Correction. The per-token weight w = pi_prox / mu multiplies the clipped
PPO term, which is decoupled PPO (Hilton et al. 2022; AReaL's objective for
stale samples):

  loss_t = w_t * max(-A r_t, -A clip(r_t)),   r_t = pi_theta / pi_prox

with w_t, by `rl.importance_weight`:
  "none": 1 (the classic loss; the mismatch is ignored),
  "is":   w (uncapped decoupled PPO),
  "tis":  min(w, C) (truncated importance sampling, Yao et al. 2025),
  "mis":  w where w <= C, else 0 (masked: such a token leaves the loss),
  "icepop": w where F <= w <= C, else 0 (IcePop, Ring-1T 2025: masked on
          both sides of a band),
C = `rl.importance_cap`, F = `rl.importance_floor`. w carries no gradient.

Sequence masking (`rl.sequence_mask`), on top of any token weighting:
"geometric" drops every token of a sequence whose geometric-mean weight
exp(mean_t log w_t) leaves the band `rl.sequence_band` = (lo, hi), both
ends kept (SkyRL's default correction; token-level truncation was found to
diverge on long runs). A geometric mean, unlike a product, does not shrink
with the length, so one band suits short and long responses.

Monitoring. Over the tokens the trainer's current weights sampled (a stale
token's gap is staleness, not a mismatch): max |log mu - log pi_prox| and
KL(mu || pi_prox), estimated per token by k3 with r = pi_prox / mu
(r - 1 - log r >= 0; unbiased under samples of mu). `alarm` logs and
flags a step whose KL passes `rl.mismatch_alarm_kl`.

The on-policy path (`on_policy`: one update per batch) has no pass for
pi_prox: it is the weights being trained, so the loss takes
stop_gradient(log pi_theta) as the anchor (r_t = 1, same gradient) and
measures the mismatch itself (`mismatch_sums`, reduced over micro-batches
and streamed parts by `Learner`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from rlhf_jax.rl.aggregation import masked_mean, sequence_sums

WEIGHTINGS = ("none", "is", "tis", "mis", "icepop")
SEQUENCE_MASKS = ("none", "geometric")
# log w is clamped here before exp, so an extreme token (or an env token's
# zero sampler log-prob) gives a large finite weight, never inf * 0 = nan.
_MAX_LOG_WEIGHT = 20.0


def on_policy(rl) -> bool:
  """Whether the PPO anchor pi_prox is the weights the update starts from,
  so that no pass before the update computes it: one update per batch
  (`rl.ppo_epochs` x `rl.num_minibatches` = 1; a streamed step then makes
  one update of all its parts) and no KL reward penalty (which reads
  pi_prox before the update). `rl`: the `RL` config section."""
  return (rl.ppo_epochs * rl.num_minibatches == 1
          and (rl.kl_in_loss or not rl.kl_coef))


def behaviour_weights(prox_logp_BxT: jax.Array, behav_logp_BxT: jax.Array,
                      mask_BxT: jax.Array, *, weighting: str, cap: float,
                      floor: float = 0.0, sequence_mask: str = "none",
                      sequence_band: tuple[float, float] = (0.99, 1.01),
                      seq_BxT: jax.Array | None = None,
                      ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(w [B, T], metrics): the per-token weights of the module doc.

  Args:
    prox_logp_BxT: [B, T] log-probs of the trainer's weights before the
      update (the PPO anchor, "old_logp").
    behav_logp_BxT: [B, T] log-probs the sampler recorded.
    mask_BxT: [B, T] 1 on trained tokens; w is 0 elsewhere.
    weighting: one of WEIGHTINGS (static).
    cap: C of "tis", "mis" and "icepop" (static, > 0).
    floor: F of "icepop" (static, < cap).
    sequence_mask: one of SEQUENCE_MASKS (static).
    sequence_band: (lo, hi) of the "geometric" sequence mask (static).
    seq_BxT: packed rows only: the sequence each token belongs to (-1:
      none, `rl/packing.py`); otherwise each row is one sequence.

  Returns:
    w without gradient, and fp32 scalar metrics over the trained tokens:
    "is_weight_mean" (before capping) and "is_capped_frac" (tokens
    truncated, "tis", or masked, "mis" and "icepop"); with a sequence mask
    also "seq_ratio_mean" (the geometric-mean weight, averaged over the
    sequences) and "seq_masked_frac" (the share of sequences masked).
  """
  if weighting not in WEIGHTINGS:
    raise ValueError(f"importance weighting {weighting!r}: one of "
                     f"{WEIGHTINGS}")
  if sequence_mask not in SEQUENCE_MASKS:
    raise ValueError(f"sequence mask {sequence_mask!r}: one of "
                     f"{SEQUENCE_MASKS}")
  mask = jnp.asarray(mask_BxT).astype(jnp.float32)
  log_w = jax.lax.stop_gradient(prox_logp_BxT.astype(jnp.float32)
                                - behav_logp_BxT.astype(jnp.float32))
  log_w = jnp.where(mask > 0, log_w, 0.0)
  raw = jnp.exp(jnp.minimum(log_w, _MAX_LOG_WEIGHT))
  outside = raw > cap
  if weighting == "icepop":
    outside = outside | (raw < floor)
  if weighting == "none":
    w = jnp.ones_like(raw)
  elif weighting == "is":
    w = raw
  elif weighting == "tis":
    w = jnp.minimum(raw, cap)
  else:  # "mis", "icepop"
    w = jnp.where(outside, 0.0, raw)
  w = jnp.where(mask > 0, w, 0.0)
  metrics = {"is_weight_mean": masked_mean(raw, mask),
             "is_capped_frac": masked_mean(
                 outside.astype(jnp.float32), mask) if weighting in (
                     "tis", "mis", "icepop") else jnp.zeros((), jnp.float32)}
  if sequence_mask == "geometric":
    keep, seq_metrics = _geometric_sequence_mask(log_w, mask, sequence_band,
                                                 seq_BxT)
    w = w * keep
    metrics.update(seq_metrics)
  return w, metrics


def _geometric_sequence_mask(log_w_BxT, mask_BxT, band, seq_BxT):
  """(keep [B, T] 0/1, metrics): 1 on the tokens of the sequences whose
  geometric-mean weight lies in `band`, both ends included."""
  sums_S, counts_S, on_tokens = sequence_sums(log_w_BxT, mask_BxT, seq_BxT)
  ratio_S = jnp.exp(jnp.minimum(sums_S / jnp.maximum(counts_S, 1.0),
                                _MAX_LOG_WEIGHT))
  valid_S = counts_S > 0
  kept_S = (ratio_S >= band[0]) & (ratio_S <= band[1])
  valid_f = valid_S.astype(jnp.float32)
  metrics = {
      "seq_ratio_mean": masked_mean(ratio_S, valid_f),
      "seq_masked_frac": masked_mean((~kept_S).astype(jnp.float32), valid_f),
  }
  return on_tokens(kept_S).astype(jnp.float32), metrics


def mismatch_sums(trainer_logp_BxT: jax.Array, sampler_logp_BxT: jax.Array,
                  mask_BxT: jax.Array) -> dict[str, jax.Array]:
  """What `mismatch` reduces, as fp32 scalars that add up over parts of a
  batch (micro-batches, streamed parts): "mismatch_gap_max" (the max, which
  combines by max), "mismatch_gap_sum" (|log mu - log pi|),
  "mismatch_k3_sum" (k3 of KL(mu || pi)) and "mismatch_tokens_sum" over
  the tokens of `mask_BxT`."""
  mask = jnp.asarray(mask_BxT).astype(jnp.float32)
  log_r = jnp.where(mask > 0, trainer_logp_BxT.astype(jnp.float32)
                    - sampler_logp_BxT.astype(jnp.float32), 0.0)
  gap = jnp.abs(log_r)
  # expm1 keeps the precision of r - 1 - log r when r ~= 1.
  k3 = jnp.expm1(jnp.minimum(log_r, _MAX_LOG_WEIGHT)) - log_r
  return {"mismatch_gap_max": jnp.max(gap),
          "mismatch_gap_sum": jnp.sum(gap * mask),
          "mismatch_k3_sum": jnp.sum(k3 * mask),
          "mismatch_tokens_sum": jnp.sum(mask)}


def mismatch_of_sums(sums: dict, xp=jnp) -> dict:
  """"gap_max", "gap_mean" and "mismatch_kl" (per token) from
  `mismatch_sums`; 0 when no token is masked in. `xp`: jnp, or np for host
  values (no device op)."""
  tokens = xp.maximum(sums["mismatch_tokens_sum"], 1.0)
  return {"gap_max": sums["mismatch_gap_max"],
          "gap_mean": sums["mismatch_gap_sum"] / tokens,
          "mismatch_kl": sums["mismatch_k3_sum"] / tokens}


def mismatch(trainer_logp_BxT: jax.Array, sampler_logp_BxT: jax.Array,
             mask_BxT: jax.Array) -> dict[str, jax.Array]:
  """Sampler vs trainer over the tokens of `mask_BxT` (those the trainer's
  current weights sampled): "gap_max" and "gap_mean" (|log mu - log pi|)
  and "mismatch_kl" (k3 estimate of KL(mu || pi) per token), fp32 scalars;
  all 0 when no token is masked in."""
  return mismatch_of_sums(mismatch_sums(trainer_logp_BxT, sampler_logp_BxT,
                                        mask_BxT))


def measured_in_updates(updates: list[dict]) -> tuple[dict, list[dict]]:
  """(the mismatch, the updates' metrics without its sums) where the loss
  measured it (`PolicyLossConfig.on_policy`): `updates` are the host
  metrics of a step's updates, each holding `mismatch_sums`."""
  keys = [k for k in updates[0] if k.startswith("mismatch_")]
  sums = {k: (max if k.endswith("_max") else sum)(float(m[k])
                                                    for m in updates)
          for k in keys}
  rest = [{k: v for k, v in m.items() if k not in keys} for m in updates]
  return {k: float(v) for k, v in mismatch_of_sums(sums, np).items()}, rest


def alarm(metrics: dict, threshold_kl: float, *, step: int) -> dict:
  """`metrics` (host, one step's) with "rollout/mismatch_alarm" set: 1.0,
  and a warning logged, when the sampler-trainer KL passes `threshold_kl`
  (0 disables the alarm; the metric is then always 0)."""
  kl = metrics.get("rollout/mismatch_kl", 0.0)
  fired = bool(threshold_kl) and kl > threshold_kl
  if fired:
    logging.warning(
        "step %d: sampler and trainer disagree: KL(sampler || trainer) = "
        "%.3g nats/token > rl.mismatch_alarm_kl = %.3g (max |d log p| = "
        "%.3g). Causes: rollout dtype or quantization, other kernels, "
        "weights not synced; rl.importance_weight='tis' corrects for it",
        step, kl, threshold_kl, metrics.get("rollout/logprob_gap", 0.0))
  return {**metrics, "rollout/mismatch_alarm": float(fired)}
