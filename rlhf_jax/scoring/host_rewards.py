"""Weighted scoring of a batch with several reward functions, on the host.

A reward function that raises (or returns a wrong number of values, or a
non-finite value) either stops the run with a `RewardError` naming the
function and the prompt id of the sample it failed on (on_error="raise"), or
scores that sample 0 for that function and counts it in `rewards/errors`
(on_error="zero"). Reward functions work on batches; when a batch call fails,
the samples are re-scored one by one to find which ones fail, so the error
can name a prompt and "zero" only zeroes the samples that actually fail.
"""

import dataclasses
import math
from typing import Callable, Mapping, Sequence

from absl import logging
import numpy as np

from rlhf_jax.errors import ConfigError, UserError
from rlhf_jax.rl import registry

RewardFn = Callable[
    [Sequence[str], Sequence[str], Sequence[Mapping]], Sequence[float]
]
ON_ERROR_MODES = ("raise", "zero")


class RewardError(UserError, RuntimeError):
  """A reward function failed on a sample; names the function and prompt."""

  def __init__(self, message: str, fn_name: str, prompt_id: int | None):
    super().__init__(message)
    self.fn_name = fn_name
    self.prompt_id = prompt_id


@dataclasses.dataclass(frozen=True)
class RewardBatch:
  """Finished samples to score, one entry per sample."""

  prompt_ids: Sequence[int]
  prompts: Sequence[str]
  completions: Sequence[str]
  metadata: Sequence[Mapping]

  def __post_init__(self):
    sizes = {
        len(self.prompt_ids),
        len(self.prompts),
        len(self.completions),
        len(self.metadata),
    }
    if len(sizes) != 1:
      raise ValueError(
          "RewardBatch fields differ in length: prompt_ids "
          f"{len(self.prompt_ids)}, prompts {len(self.prompts)}, completions "
          f"{len(self.completions)}, metadata {len(self.metadata)}."
      )

  def __len__(self) -> int:
    return len(self.prompts)


def _resolve(fn: str | RewardFn) -> tuple[str, RewardFn]:
  """(name, function) from a registered name or a callable."""
  if isinstance(fn, str):
    return fn, registry.get("reward", fn)
  return getattr(fn, "__name__", repr(fn)), fn


def _call(fn: RewardFn, batch: RewardBatch, rows: Sequence[int]) -> np.ndarray:
  """Calls fn on `rows` of the batch; raises unless it returns finite floats."""
  values = fn(
      [batch.prompts[i] for i in rows],
      [batch.completions[i] for i in rows],
      [batch.metadata[i] for i in rows],
  )
  values = [float(v) for v in values]
  if len(values) != len(rows):
    raise ValueError(f"returned {len(values)} values for {len(rows)} samples")
  bad = [v for v in values if not math.isfinite(v)]
  if bad:
    raise ValueError(f"returned non-finite value {bad[0]}")
  return np.asarray(values, np.float64)


def _score_one_fn(
    name: str, fn: RewardFn, batch: RewardBatch, on_error: str
) -> tuple[np.ndarray, int]:
  """Values of one function over the batch and its number of failed samples."""
  n = len(batch)
  try:
    return _call(fn, batch, range(n)), 0
  except Exception as batch_error:  # pylint: disable=broad-exception-caught
    values, failures = np.zeros((n,), np.float64), []
    for i in range(n):
      try:
        values[i] = _call(fn, batch, [i])[0]
      except Exception as e:  # pylint: disable=broad-exception-caught
        failures.append((i, e))
    if on_error == "raise":
      if failures:
        i, e = failures[0]
        pid = int(batch.prompt_ids[i])
        raise RewardError(
            f"Reward function {name!r} failed on prompt id {pid} (batch row "
            f"{i}, completion {batch.completions[i]!r}): "
            f"{type(e).__name__}: {e}",
            name,
            pid,
        ) from e
      # Every sample passes alone: the batch call itself is broken.
      raise RewardError(
          f"Reward function {name!r} failed on the batch of prompt ids "
          f"{[int(p) for p in batch.prompt_ids]} although each sample scores "
          f"alone: {type(batch_error).__name__}: {batch_error}",
          name,
          None,
      ) from batch_error
    for i, e in failures:
      logging.warning(
          "Reward %r failed on prompt id %d, scored 0: %s: %s",
          name,
          int(batch.prompt_ids[i]),
          type(e).__name__,
          e,
      )
    return values, len(failures)


def score(
    fns: Sequence[str | RewardFn],
    weights: Sequence[float] | None,
    batch: RewardBatch,
    on_error: str = "raise",
) -> tuple[np.ndarray, dict[str, float]]:
  """Scores a batch: sum_k weights[k] * fns[k](batch).

  Args:
    fns: registered reward names or reward callables.
    weights: one weight per function; None means all 1.
    batch: the samples to score.
    on_error: "raise" to stop with a RewardError naming the function and the
      prompt id, or "zero" to score failed samples 0 and count them.

  Returns:
    (rewards [B] float32, metrics) where metrics has "rewards/errors" (number
    of failed (sample, function) pairs) and "rewards/<name>" (mean value of
    each function, failed samples counted as 0).

  Raises:
    RewardError: a function failed and on_error == "raise".
    ValueError: bad on_error, weights of the wrong length, unknown name.
  """
  if on_error not in ON_ERROR_MODES:
    raise ConfigError(
        f"on_error must be one of {ON_ERROR_MODES}, got {on_error!r}."
    )
  weights = [1.0] * len(fns) if weights is None else list(weights)
  if len(weights) != len(fns):
    raise ConfigError(
        f"Got {len(weights)} reward weights for {len(fns)} reward functions."
    )
  total_B = np.zeros((len(batch),), np.float64)
  metrics = {"rewards/errors": 0}
  for fn, weight in zip(fns, weights):
    name, fn = _resolve(fn)
    values_B, errors = _score_one_fn(name, fn, batch, on_error)
    total_B += float(weight) * values_B
    metrics["rewards/errors"] += errors
    metrics[f"rewards/{name}"] = float(values_B.mean()) if len(batch) else 0.0
  return total_B.astype(np.float32), metrics


def score_samples(samples, prompts, tokenizer, fns, weights, on_error: str):
  """Rewards [B] and metrics of finished samples of a prompt batch.

  `samples` are engine `Sample`s of prompts in `prompts` (a `PromptBatch`:
  texts and metadata by prompt id); each is decoded with `tokenizer` and
  scored with `score` (`finish_reason` joins its metadata).
  """
  index = {int(pid): i for i, pid in enumerate(prompts.prompt_ids)}
  rows = [index[s.prompt_id] for s in samples]
  batch = RewardBatch(
      prompt_ids=[s.prompt_id for s in samples],
      prompts=[prompts.prompts[r] for r in rows],
      # A multi-turn sample's tokens hold the environment's replies, which
      # may contain stop tokens (a chat template's end of turn).
      completions=[tokenizer.decode(s.tokens, stop_at_eos=not s.env_mask)
                   for s in samples],
      metadata=[{**prompts.metadata[r], "finish_reason": s.finish_reason,
                 "env_reward": s.env_reward}
                for r, s in zip(rows, samples)])
  return score(fns, weights, batch, on_error)


class RewardScorer:
  """The job's reward: scores finished samples a group at a time (as a
  rollout streams them) and keeps the metrics of all scored so far.

  With `overlong` = (max_new_tokens, buffer, penalty) DAPO's soft overlong
  penalty (`rl/dapo.overlong_penalty`) is added to each reward.
  """

  def __init__(self, tokenizer, fns, weights=None, on_error: str = "raise",
               overlong: tuple[int, int, float] | None = None):
    self.tokenizer, self.fns = tokenizer, list(fns)
    self.weights = list(weights) if weights else None
    self.on_error, self.overlong = on_error, overlong
    self.reset()

  def reset(self) -> None:
    self._sums: dict[str, float] = {}
    self._count = 0

  def score(self, samples, prompts) -> np.ndarray:
    """Rewards [len(samples)] (float32); metrics accumulate."""
    rewards, metrics = score_samples(samples, prompts, self.tokenizer,
                                     self.fns, self.weights, self.on_error)
    if self.overlong is not None:
      from rlhf_jax.rl import dapo  # pylint: disable=g-import-not-at-top
      max_len, buffer, penalty = self.overlong
      extra = np.asarray(dapo.overlong_penalty(
          np.array([len(s.tokens) for s in samples]), max_len=max_len,
          cache_len=buffer, penalty=penalty), np.float32)
      rewards = rewards + extra
      metrics["rewards/overlong_penalty"] = float(extra.mean())
    n = len(samples)
    for k, v in metrics.items():  # Errors add up; means weigh by size.
      self._sums[k] = self._sums.get(k, 0.0) + (v if k.endswith("/errors")
                                                else v * n)
    self._count += n
    return rewards

  def metrics(self) -> dict[str, float]:
    """Means over every sample scored since `reset` (errors: counts)."""
    return {k: float(v) if k.endswith("/errors")
            else v / max(1, self._count) for k, v in self._sums.items()}
