"""Scalar-head models on device: reward-model scores and critic values.

The scoring stage of an RLHF step runs the frozen reward model on the packed
batch of finished samples (<bos> prompt response [<eos>], right-padded), in
one jitted call on the training layout, next to the verifiable rewards that
run on the host. The same jitted pair serves the critic's values.

Dimension letters: B sequences, T positions.
"""

from __future__ import annotations

import jax

from rlhf_jax.models import reward_model
from rlhf_jax.parallel.layout import Layout, constrain, use_layout


class ScalarHead:
  """Jitted `score` ([B]) and `values` ([B, T]) of one scalar-head graph."""

  def __init__(self, graphdef, layout: Layout):
    self.graphdef, self.layout = graphdef, layout
    self._scores = jax.jit(self._scores_fn)
    self._values = jax.jit(self._values_fn)
    self._packed_scores = jax.jit(self._packed_scores_fn)

  def scores(self, params, batch) -> jax.Array:
    """[B] fp32: the value at each row's last real token (attn_mask)."""
    return self._scores(params, batch)

  def packed_scores(self, params, batch, last) -> jax.Array:
    """[B] fp32 of packed rows holding every token
    (`packing.with_last_token`): the value at each sequence's last one,
    the flat cells `last` [B] (`packing.last_cells`)."""
    return self._packed_scores(params, batch, last)

  def values(self, params, batch) -> jax.Array:
    """[B, T] fp32: the value at every position ([W, L] of packed rows)."""
    return self._values(params, batch)

  def _scores_fn(self, params, batch):
    with use_layout(self.layout):
      s_B = reward_model.score(self.graphdef, params, batch["tokens"],
                               batch["positions"], batch["attn_mask"])
      return constrain(s_B, ("batch",))

  def _packed_scores_fn(self, params, batch, last):
    with use_layout(self.layout):
      s_B = reward_model.packed_score(self.graphdef, params, batch, last)
      return jax.lax.with_sharding_constraint(s_B, self.layout.replicated())

  def _values_fn(self, params, batch):
    with use_layout(self.layout):
      return reward_model.batch_values(self.graphdef, params, batch)
