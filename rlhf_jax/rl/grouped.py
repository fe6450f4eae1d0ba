"""Three layouts of one RL batch: repeated prompts, grouped (prompt once),
or packed rows.

Dimension letters: N groups (prompts), G responses per group, B = N*G
sequences, P prompt length, R response length (max new tokens), T = P + R.

repeated: tokens, positions, attn_mask, targets, loss_mask [B, T]; old_logp,
  ref_logp [B, T]; advantages [B]. Every sequence carries its prompt.
grouped: prompt_tokens [N, P] (right-padded), prompt_len [N],
  response_tokens [N, G, R] (also the targets), loss_mask [N, G, R]; old_logp,
  ref_logp [N, G, R]; advantages [N, G]. The forward runs each prompt once
  (`models/grouped_forward.py`).

MoE routing replay (`rl/batch.py`): "routes" [B, T, L, k] repeated and
  [W, L_row, L, k] packed, "prompt_routes" [N, P, L, k] and
  "response_routes" [N, G, R, L, k] grouped; the forward sends each token
  to those experts.

packed (`rl/packing.py`): rows [W, L] of several sequences (tokens,
  positions, seg, optional sub, targets, loss_mask, seq, seq_len; old_logp,
  ref_logp and advantages per token [W, L]; row_seqs [W]), padding neither
  computed nor trained; with shared prompts a group's prompt sits once per
  unit, its responses in sub-segments.

Axis 0 is what `Learner` splits into micro-batches and gathers into
mini-batches: sequences in the repeated layout, whole groups in the grouped
one, packed rows in the packed one. A batch is grouped iff it holds
"prompt_tokens", packed iff it holds "seg". Loss code sees either
layout as per-sequence [B, ...] arrays through `per_sequence`, so the loss
math (policy losses, KL, aggregation modes) is shared and the layouts give
the same loss and gradients up to fp32 rounding (packed rows: their
aggregation reads `seq`, `seq_len` and `row_seqs`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlhf_jax.models import grouped_forward as grouped_model
from rlhf_jax.parallel.layout import active_layout
from rlhf_jax.rl.logprobs import head_logprobs

PROMPT_KEYS = ("prompt_tokens", "prompt_len")
# Every per-prompt field of a grouped batch (routing replay's too).
_PER_PROMPT = PROMPT_KEYS + ("prompt_routes",)


def is_grouped(batch) -> bool:
  return "prompt_tokens" in batch


def is_packed(batch) -> bool:
  return "seg" in batch


def sequence_sums(x, batch: dict, num_seqs: int) -> jax.Array:
  """[B] per-sequence sums of per-token `x` (shaped like the loss mask)."""
  if is_packed(batch):  # Tokens of no sequence (-1) are dropped.
    seq = jnp.ravel(batch["seq"])
    return jax.ops.segment_sum(
        jnp.ravel(x), jnp.where(seq >= 0, seq, num_seqs),
        num_segments=num_seqs, mode="drop")
  return jnp.sum(x.reshape(num_seqs, -1), axis=1)


def per_sequence_values(values_B, batch: dict) -> jax.Array:
  """[B] values laid out as the batch keeps them: per token in packed rows
  ([W, L], 0 off the trained tokens), [B] repeated, [N, G] grouped."""
  if is_packed(batch):
    seq = batch["seq"]
    return jnp.where(seq >= 0, values_B[jnp.maximum(seq, 0)], 0.0)
  return values_B.reshape(batch["loss_mask"].shape[:-1])


def per_sequence(batch: dict) -> dict:
  """Per-sequence view: grouped [N, G, ...] fields -> [B, ...].

  Prompt fields are dropped; "targets" is the response tokens. A repeated
  or packed batch is returned unchanged.
  """
  if not is_grouped(batch):
    return batch
  out = {k: v.reshape((-1,) + v.shape[2:]) for k, v in batch.items()
         if k not in _PER_PROMPT}
  out["targets"] = out.pop("response_tokens")
  return out


def target_logprobs(graphdef, params, mb: dict, *,
                    temperature: float = 1.0, router_stats: bool = False,
                    route_by_replay: bool = True):
  """(log p(targets), entropy, argmax) [B, T] of a micro-batch, either layout.

  From the final hidden states and the vocabulary projection in chunks
  (`logprobs.head_logprobs`: never the [B, T, V] logits). For a grouped
  batch T = R: position j holds response token j.

  With `router_stats`, a fourth output: an MoE's router statistics per
  layer (`models/moe.py`) over the tokens that predict trained targets
  (the loss mask), the same tokens in every layout; None for a dense
  model. `route_by_replay` False: the batch's recorded experts (routing
  replay) only count the router's flips; each token takes its own top k.
  """
  model = nnx.merge(graphdef, params)
  weights = mb["loss_mask"] if router_stats and model.cfg.is_moe else None
  if is_grouped(mb):
    replay = (None if "prompt_routes" not in mb
              else (mb["prompt_routes"], mb["response_routes"]))
    hidden = grouped_model.grouped_hidden(
        model, mb["prompt_tokens"], mb["prompt_len"], mb["response_tokens"],
        router_weights_NxGxR=weights, replay=replay,
        route_by_replay=route_by_replay)
    targets = per_sequence(mb)["targets"]
  elif is_packed(mb):
    hidden = model.hidden_states(mb["tokens"], mb["positions"], None,
                                 segments=mb["seg"], subs=mb.get("sub"),
                                 router_weights_BxT=weights,
                                 replay_BxTxLxK=mb.get("routes"),
                                 route_by_replay=route_by_replay)
    targets = mb["targets"]
  else:
    hidden = model.hidden_states(mb["tokens"], mb["positions"],
                                 mb["attn_mask"], router_weights_BxT=weights,
                                 replay_BxTxLxK=mb.get("routes"),
                                 route_by_replay=route_by_replay)
    targets = mb["targets"]
  hidden, stats = hidden if weights is not None else (hidden, None)
  head, axis = model.head()
  rows, vocab = model.cfg.logprob_chunks
  layout = active_layout()
  out = head_logprobs(hidden, head, targets, vocab_axis=axis,
                      softcap=model.cfg.final_logit_softcap,
                      temperature=temperature,
                      row_chunk=rows or targets.size,
                      vocab_chunk=vocab or head.shape[axis],
                      row_groups=1 if layout is None else layout.shards(
                          "rows"))
  return (*out, stats) if router_stats else out


def token_logprobs_in_layout(graphdef, params, mb: dict,
                             *, temperature: float = 1.0) -> jax.Array:
  """Log-probs of the targets: [B, T] repeated, [N, G, R] grouped, [W, L]
  packed."""
  logp, _, _ = target_logprobs(graphdef, params, mb, temperature=temperature)
  if is_grouped(mb):
    return logp.reshape(mb["response_tokens"].shape)
  return logp
