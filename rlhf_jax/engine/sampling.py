"""Token sampling with placement-independent randomness.

The key of a token is fold_in(seed, prompt id, sample index, position): it
never depends on the slot, the replica or what else is in the batch, so a
sample can move or resume mid-response and continue exactly.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How tokens are drawn; static for an engine (one compile per setting)."""
  temperature: float = 1.0   # 0 means greedy.
  top_k: int = 0             # 0 means off.
  top_p: float = 1.0         # 1 means off.
  max_new_tokens: int = 32
  stop_tokens: tuple[int, ...] = ()

  def validate(self, vocab_size: int) -> None:
    """The engine's invariant. Values from a config passed the same rule
    (`range_errors`) before anything compiled; other callers (tests,
    benchmarks) are checked here."""
    errors = [f"{key}={getattr(self, key)!r} {rule}" for key, rule in
              range_errors(self.temperature, self.top_k, self.top_p,
                           self.max_new_tokens, vocab_size)]
    bad = [t for t in self.stop_tokens if not 0 <= t < vocab_size]
    if bad:
      errors.append(f"stop_tokens {bad} are outside the vocabulary "
                    f"[0, {vocab_size})")
    if errors:
      raise ValueError("invalid sampling parameters: " + "; ".join(errors))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def _real(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def range_errors(temperature, top_k, top_p, max_new_tokens,
                 vocab_size: int | None = None) -> list[tuple[str, str]]:
  """(key, the allowed range) of each sampling parameter outside it.

  The one statement of these rules: the config's rollout section checks
  them before anything compiles (`config/sections.Rollout`; top_k's upper
  bound once the model's vocabulary is known: `trainers/policy.build`,
  `rollout/engines.engines`), and the engine asserts them
  (`SamplingParams.validate`). NaN fails every range.
  """
  errors = []
  if not (_real(temperature) and math.isfinite(temperature)
          and temperature >= 0):
    errors.append(("temperature", "must be a finite number >= 0 (0: greedy)"))
  # top_k = k keeps the k likeliest tokens: at most the vocabulary.
  if not (_int(top_k) and 0 <= top_k
          and (vocab_size is None or top_k <= vocab_size)):
    errors.append(("top_k", "must be an int in [0, vocab_size" + (
        "" if vocab_size is None else f"={vocab_size}") + "] (0: off)"))
  # top_p = 0 would keep no token; 1 keeps them all.
  if not (_real(top_p) and 0 < top_p <= 1):
    errors.append(("top_p", "must be in (0, 1] (1: off)"))
  if not (_int(max_new_tokens) and max_new_tokens >= 1):
    errors.append(("max_new_tokens", "must be an int >= 1"))
  return errors


def token_keys(seed, prompt_id, sample_idx, position):
  """Keys for a batch of tokens; all arguments broadcast to one shape."""
  seed, prompt_id, sample_idx, position = jnp.broadcast_arrays(
      seed, prompt_id, sample_idx, position)

  def one(s, p, i, t):
    key = jax.random.key(s)
    for x in (p, i, t):
      key = jax.random.fold_in(key, x)
    return key

  flat = jax.vmap(one)(*(x.reshape(-1) for x in (seed, prompt_id, sample_idx,
                                                  position)))
  return flat.reshape(seed.shape)


def sample(logits_BxV, keys_B, params: SamplingParams):
  """Draws one token per row.

  Returns:
    tokens [B] int32, the log-prob of each token under the distribution it
    was drawn from (temperature-scaled, top-k/top-p filtered; 0 for greedy),
    and its raw temperature-1 log-prob under the policy.
  """
  logits = logits_BxV.astype(jnp.float32)
  raw_logp = jax.nn.log_softmax(logits, axis=-1)
  if params.greedy:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled_logp = jnp.zeros(tokens.shape, jnp.float32)
  else:
    scaled = logits / params.temperature
    if params.top_k or params.top_p < 1:
      k = params.top_k or logits.shape[-1]
      vals, idx = jax.lax.top_k(scaled, k)  # descending
      if params.top_p < 1:
        probs = jax.nn.softmax(vals, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        vals = jnp.where(mass_before < params.top_p, vals, -jnp.inf)
      choice = jax.vmap(jax.random.categorical)(keys_B, vals)
      tokens = jnp.take_along_axis(idx, choice[:, None], -1)[:, 0]
      sampled_logp = jnp.take_along_axis(
          jax.nn.log_softmax(vals, -1), choice[:, None], -1)[:, 0]
    else:
      tokens = jax.vmap(jax.random.categorical)(keys_B, scaled)
      sampled_logp = jnp.take_along_axis(
          jax.nn.log_softmax(scaled, -1), tokens[:, None], -1)[:, 0]
    tokens = tokens.astype(jnp.int32)
  raw = jnp.take_along_axis(raw_logp, tokens[:, None], -1)[:, 0]
  return tokens, sampled_logp, raw
