"""Two layouts of one RL batch: repeated prompts, or grouped (prompt once).

Dimension letters: N groups (prompts), G responses per group, B = N*G
sequences, P prompt length, R response length (max new tokens), T = P + R.

repeated: tokens, positions, attn_mask, targets, loss_mask [B, T]; old_logp,
  ref_logp [B, T]; advantages [B]. Every sequence carries its prompt.
grouped: prompt_tokens [N, P] (right-padded), prompt_len [N],
  response_tokens [N, G, R] (also the targets), loss_mask [N, G, R]; old_logp,
  ref_logp [N, G, R]; advantages [N, G]. The forward runs each prompt once
  (`models/grouped.py`).

Axis 0 is what `Learner` splits into micro-batches and gathers into
mini-batches: sequences in the repeated layout, whole groups in the grouped
one. A batch is grouped iff it holds "prompt_tokens". Loss code sees either
layout as per-sequence [B, ...] arrays through `per_sequence`, so the loss
math (policy losses, KL, aggregation modes) is shared and the two layouts give
the same loss and gradients up to fp32 rounding.
"""

from __future__ import annotations

import jax

from rlhf_jax.models import grouped as grouped_model
from rlhf_jax.models import model as model_lib
from rlhf_jax.rl.logprobs import token_logprobs

PROMPT_KEYS = ("prompt_tokens", "prompt_len")


def is_grouped(batch) -> bool:
  return "prompt_tokens" in batch


def per_sequence(batch: dict) -> dict:
  """Per-sequence view: grouped [N, G, ...] fields -> [B, ...].

  Prompt fields are dropped; "targets" is the response tokens. A repeated
  batch is returned unchanged.
  """
  if not is_grouped(batch):
    return batch
  out = {k: v.reshape((-1,) + v.shape[2:]) for k, v in batch.items()
         if k not in PROMPT_KEYS}
  out["targets"] = out.pop("response_tokens")
  return out


def logits_and_targets(graphdef, params, mb: dict):
  """(fp32 logits [B, T, V], targets [B, T]) of a micro-batch, either layout.

  For a grouped batch T = R: position j holds response token j.
  """
  if is_grouped(mb):
    logits = grouped_model.grouped_logits(
        graphdef, params, mb["prompt_tokens"], mb["prompt_len"],
        mb["response_tokens"])
    return logits, per_sequence(mb)["targets"]
  logits = model_lib.forward(graphdef, params, mb["tokens"], mb["positions"],
                             mb["attn_mask"])
  return logits, mb["targets"]


def token_logprobs_in_layout(graphdef, params, mb: dict,
                             *, temperature: float = 1.0) -> jax.Array:
  """Log-probs of the targets: [B, T] repeated, [N, G, R] grouped."""
  logits, targets = logits_and_targets(graphdef, params, mb)
  logp = token_logprobs(logits, targets, temperature=temperature)
  if is_grouped(mb):
    return logp.reshape(mb["response_tokens"].shape)
  return logp
