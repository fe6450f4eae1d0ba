"""Finished samples -> the host arrays of one RL batch, in either layout.

Samples are the rollout's (`samples.Sample`: prompt tokens, response
tokens, sampler log-probs); only their fields are read, so this module
imports nothing from the engine. Dimension letters: N prompts, G samples
per prompt, B = N*G sequences, T = P + M (prompt length + max new tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rlhf_jax.rl import packing


@dataclasses.dataclass
class PackedBatch:
  """Host arrays for the learner plus the sampler's log-probs."""
  arrays: dict            # One layout of rl/grouped.py.
  sampler_logp: np.ndarray  # Raw engine log-probs, shaped like loss_mask.
  response_len: np.ndarray  # [B]

  def positions(self) -> tuple[int, int]:
    """(positions the train step computes on, those holding a prompt or
    response token): padding is the difference."""
    a = self.arrays
    if "seg" in a:  # Packed rows; -1 marks padding.
      return a["seg"].size, int(np.sum(a["seg"] >= 0))
    if "attn_mask" in a:  # Repeated: each row prompt + response, padded.
      return a["attn_mask"].size, int(np.sum(a["attn_mask"]))
    # Grouped: each prompt once [N, P], its responses [N, G, R].
    return (a["prompt_tokens"].size + a["response_tokens"].size,
            int(np.sum(a["prompt_len"]) + np.sum(self.response_len)))

  def info(self) -> dict:
    """What a step's metrics read of the batch: response lengths, trained
    tokens, computed and real positions (`positions`)."""
    computed, real = self.positions()
    return {"response_len": self.response_len,
            "tokens": float(self.arrays["loss_mask"].sum()),
            "positions": computed, "real_positions": real}


def slots(rl, learner, minibatches: int) -> packing.Slots | None:
  """The packed layout's slots of the `rl` section (`rl.pack_length` > 0:
  rows of that many tokens dealt to `minibatches` x `rl.micro_batches` x
  the learner's batch shards), or None: one row a sample or group."""
  if not rl.pack_length:
    return None
  return packing.Slots(rl.pack_length, minibatches, rl.micro_batches,
                       learner.layout.shards("batch"))


def pack(samples: Sequence, prompt_len: int, max_new: int, *,
         group_size: int = 0, keep=None,
         slots: packing.Slots | None = None,
         routes: bool = False) -> PackedBatch:
  """Host arrays of the batch in one of the layouts of `rl/grouped.py`.

  group_size=0: the repeated layout, prompt + response per row, right-padded
  to T; targets are shifted left. group_size=G: the grouped layout, each
  prompt once ([N, P], right-padded) and its G responses [N, G, R]; samples
  must come as `generate` returns them (G consecutive samples per prompt).
  `keep` [B] bool: False samples stay in the batch (static shapes) but
  out of the loss (stale samples, empty dynamic-sampling slots). `slots`:
  the packed layout instead (`rl/packing.py`: rows of `slots.length`
  tokens dealt to the step's mini-batch x micro-batch x shard cells; with
  group_size each group's prompt is shared inside its row), where
  samples not kept take no room at all. `routes` (MoE routing replay): the
  experts the sampler routed each token to (`Sample.routes`), -1 where
  none: "routes" [B, T, L, k] repeated, "prompt_routes" [N, P, L, k] and
  "response_routes" [N, G, R, L, k] grouped.
  """
  response_len = np.array([len(s.tokens) for s in samples], np.float32)
  if slots is not None:
    arrays, sampler_logp = packing.pack(
        samples, slots, group_size=group_size, keep=keep,
        routes_shape=_routes_shape(samples) if routes else None)
    return PackedBatch(arrays, sampler_logp, response_len)
  packed = (_pack_grouped(samples, group_size, prompt_len, max_new)
            if group_size else _pack_repeated(samples, prompt_len, max_new))
  if keep is not None:
    rows = packed.arrays["loss_mask"].reshape(len(samples), -1)
    rows[~np.asarray(keep, bool)] = 0.0
  if routes:
    packed.arrays.update(_routes(samples, group_size, prompt_len, max_new))
  return packed


def _routes_shape(samples) -> tuple:
  """(L, k) of the samples' recorded experts."""
  first = next((s for s in samples if s.prompt_routes is not None), None)
  if first is None:
    raise ValueError("routing replay: the samples carry no routes (the "
                     "engine must record them: Engine(record_routes=True))")
  return first.prompt_routes.shape[1:]


def _routes(samples, G, prompt_len, max_new) -> dict:
  """The recorded experts in the repeated (G = 0) or grouped layout: a
  token at position t of its sequence replays the experts it went to when
  the sampler fed it; padding and tokens never fed (a response's last)
  have none (-1)."""
  per_token = _routes_shape(samples)  # (L, k)
  B, R = len(samples), max_new
  if not G:
    routes = np.full((B, prompt_len + R) + per_token, -1, np.int16)
    for b, s in enumerate(samples):
      if s.prompt_routes is not None:
        p = len(s.prompt_tokens)
        routes[b, :p] = s.prompt_routes
        routes[b, p:p + len(s.routes)] = s.routes
    return {"routes": routes}
  N = B // G
  prompt = np.full((N, prompt_len) + per_token, -1, np.int16)
  response = np.full((N, G, R) + per_token, -1, np.int16)
  for n in range(N):
    group = samples[n * G:(n + 1) * G]
    record = packing.prompt_record(group)  # One prompt a group.
    if record is not None:
      prompt[n, :len(record)] = record
    for g, s in enumerate(group):
      if s.routes is not None:
        response[n, g, :len(s.routes)] = s.routes
  return {"prompt_routes": prompt, "response_routes": response}


def _pack_repeated(samples, prompt_len, max_new) -> PackedBatch:
  """The repeated layout; see `pack`."""
  B, T = len(samples), prompt_len + max_new
  tokens = np.zeros((B, T), np.int32)
  loss_mask = np.zeros((B, T), np.float32)
  sampler_logp = np.zeros((B, T), np.float32)
  lengths = np.zeros(B, np.int32)
  for b, s in enumerate(samples):
    p, r = len(s.prompt_tokens), len(s.tokens)
    tokens[b, :p] = s.prompt_tokens
    tokens[b, p:p + r] = s.tokens
    # Target t is token t+1, so response token j is target p-1+j.
    loss_mask[b, p - 1:p - 1 + r] = packing.trained_tokens(s)
    sampler_logp[b, p - 1:p - 1 + r] = s.logp_raw
    lengths[b] = p + r
  targets = np.concatenate([tokens[:, 1:], np.zeros((B, 1), np.int32)], 1)
  arrays = dict(
      tokens=tokens,
      positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
      attn_mask=np.arange(T)[None] < lengths[:, None],
      targets=targets, loss_mask=loss_mask)
  response_len = np.array([len(s.tokens) for s in samples], np.float32)
  return PackedBatch(arrays, sampler_logp, response_len)


def _pack_grouped(samples, G, prompt_len, max_new) -> PackedBatch:
  """The grouped layout; see `pack`."""
  if len(samples) % G:
    raise ValueError(f"{len(samples)} samples are not groups of {G}")
  N, R = len(samples) // G, max_new
  prompt_tokens = np.zeros((N, prompt_len), np.int32)
  prompt_lens = np.zeros(N, np.int32)
  responses = np.zeros((N, G, R), np.int32)
  loss_mask = np.zeros((N, G, R), np.float32)
  sampler_logp = np.zeros((N, G, R), np.float32)
  for b, s in enumerate(samples):
    n, g = divmod(b, G)
    p, r = len(s.prompt_tokens), len(s.tokens)
    if g == 0:
      prompt_tokens[n, :p] = s.prompt_tokens
      prompt_lens[n] = p
    elif s.prompt_id != samples[n * G].prompt_id:
      raise ValueError(f"sample {b} (prompt {s.prompt_id}) is not in the "
                       f"group of prompt {samples[n * G].prompt_id}")
    responses[n, g, :r] = s.tokens
    loss_mask[n, g, :r] = packing.trained_tokens(s)
    sampler_logp[n, g, :r] = s.logp_raw
  arrays = dict(prompt_tokens=prompt_tokens, prompt_len=prompt_lens,
                response_tokens=responses, loss_mask=loss_mask)
  response_len = np.array([len(s.tokens) for s in samples], np.float32)
  return PackedBatch(arrays, sampler_logp, response_len)
