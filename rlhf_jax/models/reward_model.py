"""Scalar-head models: the decoder trunk plus a linear value head.

One module serves both the reward model (the value at the last real token
is the sequence score) and, later, the critic (the value at every position).
The decoder keeps its LM head (unused here) so a reward model or critic can
be initialised from, and checkpointed like, a policy of the same config.

Dimension letters: B sequences, T length, D model width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.models.layers import _param
from rlhf_jax.models.transformer import Decoder
from rlhf_jax.parallel.layout import Layout, constrain


class RewardModel(nnx.Module):
  """Decoder trunk -> final-norm hidden state -> one scalar per position."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.decoder = Decoder(cfg, rngs=rngs)
    # Born at zero: every score starts at 0 (BT loss log 2), and the head's
    # first gradient steps set the scale instead of a random projection.
    self.value_head = _param(None, (cfg.embed_dim,), ("embed",),
                             jnp.float32,
                             value=jnp.zeros((cfg.embed_dim,), jnp.float32))
    self.value_bias = _param(None, (), (), jnp.float32,
                             value=jnp.zeros((), jnp.float32))

  def __call__(self, tokens_BxT, positions_BxT, mask_BxT, *, segments=None,
               subs=None):
    """Values [B, T] fp32: the head applied to every position's state (of
    right-padded rows, or of packed rows: `Decoder.hidden_states`)."""
    h_BxTxD = self.decoder.hidden_states(tokens_BxT, positions_BxT, mask_BxT,
                                         segments=segments, subs=subs)
    v_BxT = jnp.einsum("btd,d->bt", h_BxTxD.astype(jnp.float32),
                       self.value_head[...]) + self.value_bias[...]
    return constrain(v_BxT, ("batch", "length"))


# What a LoRA critic trains: the adapters (`models/lora.py`) and the value
# head, which is new to the task (PEFT's "modules_to_save").
LORA_TRAINABLE = nnx.Any(nnx.LoRAParam, nnx.PathContains("value_head"),
                         nnx.PathContains("value_bias"))


def abstract_params(cfg: ModelConfig):
  """(graphdef, params of ShapeDtypeStructs) without allocating anything."""
  model = nnx.eval_shape(lambda: RewardModel(cfg, rngs=nnx.Rngs(0)))
  return nnx.split(model, nnx.Param)


def init_params(cfg: ModelConfig, seed: int, layout: Layout | None = None):
  """(graphdef, random params born sharded under `layout`)."""
  graphdef, _ = abstract_params(cfg)
  return graphdef, model_lib.random_params(RewardModel, cfg, seed, layout)


def values(graphdef, params, tokens_BxT, positions_BxT, mask_BxT):
  """Per-position values [B, T] fp32 (critic use)."""
  return nnx.merge(graphdef, params)(tokens_BxT, positions_BxT, mask_BxT)


def batch_values(graphdef, params, batch: dict) -> jax.Array:
  """Per-position values of a training batch: [B, T] of right-padded rows,
  [W, L] of packed ones (`rl/packing.py`: "seg", and "sub" with shared
  prompts)."""
  if "seg" in batch:
    return nnx.merge(graphdef, params)(
        batch["tokens"], batch["positions"], None, segments=batch["seg"],
        subs=batch.get("sub"))
  return values(graphdef, params, batch["tokens"], batch["positions"],
                batch["attn_mask"])


def last_index(mask_BxT: jax.Array) -> jax.Array:
  """[B] index of the last True of each row (0 for an empty row)."""
  t_BxT = jnp.arange(mask_BxT.shape[1])[None, :]
  return jnp.max(jnp.where(mask_BxT, t_BxT, 0), axis=1)


def score(graphdef, params, tokens_BxT, positions_BxT, mask_BxT):
  """Sequence scores [B] fp32: the value at the last real token of each row.

  Args:
    graphdef: the RewardModel graph.
    params: its params.
    tokens_BxT: int token ids, right-padded (prompt + response + <eos>).
    positions_BxT: RoPE positions.
    mask_BxT: True for real tokens.

  Returns:
    [B] fp32 scores.
  """
  v_BxT = values(graphdef, params, tokens_BxT, positions_BxT, mask_BxT)
  idx_B = last_index(mask_BxT)
  return jnp.take_along_axis(v_BxT, idx_B[:, None], axis=1)[:, 0]


def packed_score(graphdef, params, batch: dict, last) -> jax.Array:
  """Sequence scores fp32 of packed rows that hold every token
  (`packing.with_last_token`): the value at each flat cell of `last`
  (`packing.last_cells`: each sequence's last real token)."""
  return batch_values(graphdef, params, batch).reshape(-1)[last]
